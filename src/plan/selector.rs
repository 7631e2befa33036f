//! Which claims a plan covers: namespaces and a label selector in kubectl's
//! syntax (`app=db,tier!=cache,env in (prod,staging),!legacy,backup`).

use std::collections::{BTreeMap, BTreeSet};

/// A claim selection: claims in one of `namespaces` (all namespaces when
/// empty) whose labels match `labels`, and whose name is one of `names`
/// (any name when empty).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Namespaces to cover; empty covers every namespace.
    pub namespaces: BTreeSet<String>,
    /// Label selector the claims must match.
    pub labels: LabelSelector,
    /// Claim names the claims must have; any name when empty.
    pub names: BTreeSet<String>,
}

impl Selection {
    /// Every claim in every namespace.
    pub fn everything() -> Self {
        Selection::default()
    }

    /// Whether the claim `name` in `namespace` with `labels` is selected.
    pub fn selects(&self, namespace: &str, name: &str, labels: &BTreeMap<String, String>) -> bool {
        (self.namespaces.is_empty() || self.namespaces.contains(namespace))
            && (self.names.is_empty() || self.names.contains(name))
            && self.labels.matches(labels)
    }
}

/// A label selector: all requirements must hold. The empty selector
/// matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    /// Requirements, all of which must hold.
    pub requirements: Vec<LabelRequirement>,
}

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelRequirement {
    /// `key=value` or `key==value`.
    Equals(String, String),
    /// `key!=value` (also true when the label is absent).
    NotEquals(String, String),
    /// `key in (a,b)`.
    In(String, Vec<String>),
    /// `key notin (a,b)` (also true when the label is absent).
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    DoesNotExist(String),
}

/// A label selector that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid label selector requirement {requirement:?}: {problem}")]
pub struct SelectorError {
    /// The requirement as written.
    pub requirement: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl LabelRequirement {
    /// Whether labels satisfy the requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            LabelRequirement::Equals(key, value) => labels.get(key) == Some(value),
            LabelRequirement::NotEquals(key, value) => labels.get(key) != Some(value),
            LabelRequirement::In(key, values) => {
                labels.get(key).is_some_and(|v| values.contains(v))
            }
            LabelRequirement::NotIn(key, values) => {
                labels.get(key).is_none_or(|v| !values.contains(v))
            }
            LabelRequirement::Exists(key) => labels.contains_key(key),
            LabelRequirement::DoesNotExist(key) => !labels.contains_key(key),
        }
    }
}

impl LabelSelector {
    /// Whether labels satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements
            .iter()
            .all(|requirement| requirement.matches(labels))
    }

    /// Parse kubectl's selector syntax. Errors name the offending
    /// requirement.
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            requirements.push(parse_requirement(part)?);
        }
        Ok(LabelSelector { requirements })
    }
}

/// Split at commas outside parentheses.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (position, character) in text.char_indices() {
        match character {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..position]);
                start = position + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn parse_requirement(part: &str) -> Result<LabelRequirement, SelectorError> {
    let error = |problem| SelectorError {
        requirement: part.to_string(),
        problem,
    };
    let checked_key = |key: &str| {
        let key = key.trim();
        if key.is_empty() || key.contains(char::is_whitespace) {
            Err(error("the key is empty or contains spaces"))
        } else {
            Ok(key.to_string())
        }
    };
    if let Some(key) = part.strip_prefix('!') {
        return Ok(LabelRequirement::DoesNotExist(checked_key(key)?));
    }
    if let Some((key, value)) = part.split_once("!=") {
        return Ok(LabelRequirement::NotEquals(
            checked_key(key)?,
            value.trim().to_string(),
        ));
    }
    if let Some((key, value)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Ok(LabelRequirement::Equals(
            checked_key(key)?,
            value.trim().to_string(),
        ));
    }
    if let Some(open) = part.find('(') {
        let Some(inner) = part[open + 1..].strip_suffix(')') else {
            return Err(error("a value set must end with ')'"));
        };
        let mut words = part[..open].split_whitespace();
        let (Some(key), Some(operator), None) = (words.next(), words.next(), words.next()) else {
            return Err(error("expected `key in (values)` or `key notin (values)`"));
        };
        let values: Vec<String> = inner
            .split(',')
            .map(|value| value.trim().to_string())
            .filter(|value| !value.is_empty())
            .collect();
        return match operator {
            "in" => Ok(LabelRequirement::In(checked_key(key)?, values)),
            "notin" => Ok(LabelRequirement::NotIn(checked_key(key)?, values)),
            _ => Err(error("the set operator must be `in` or `notin`")),
        };
    }
    Ok(LabelRequirement::Exists(checked_key(part)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn parses_every_kubectl_form() {
        let selector = LabelSelector::parse(
            "app=db, tier!=cache,env in (prod, staging),zone notin (z3),!legacy,backup",
        )
        .expect("selector parses");
        assert_eq!(
            selector.requirements,
            vec![
                LabelRequirement::Equals("app".into(), "db".into()),
                LabelRequirement::NotEquals("tier".into(), "cache".into()),
                LabelRequirement::In("env".into(), vec!["prod".into(), "staging".into()]),
                LabelRequirement::NotIn("zone".into(), vec!["z3".into()]),
                LabelRequirement::DoesNotExist("legacy".into()),
                LabelRequirement::Exists("backup".into()),
            ]
        );
        assert!(selector.matches(&labels(&[("app", "db"), ("env", "prod"), ("backup", "")])));
        assert!(!selector.matches(&labels(&[("app", "db"), ("env", "dev"), ("backup", "")])));
        assert!(!selector.matches(&labels(&[("app", "db"), ("env", "prod")])));
    }

    #[test]
    fn empty_selector_matches_everything() {
        let selector = LabelSelector::parse("").expect("empty selector parses");
        assert!(selector.matches(&labels(&[])));
    }

    #[test]
    fn malformed_set_names_the_requirement() {
        let error = LabelSelector::parse("app=db,env in (prod").expect_err("unclosed set");
        assert_eq!(error.requirement, "env in (prod");
        let error = LabelSelector::parse("env among (prod)").expect_err("unknown operator");
        assert!(error.to_string().contains("`in` or `notin`"), "{error}");
    }
}
