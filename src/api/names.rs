//! Names and label values haulage generates for Kubernetes objects: the one
//! place that turns arbitrary text (claim, node and owner names, replica
//! identities) into valid DNS labels, DNS subdomains and label values.
//!
//! Generated names are deterministic: a readable prefix cut to fit, then
//! (when the text had to change or be cut) a short hash of everything that
//! identifies the object, so two objects never share a name.

/// Longest DNS label (names of pods, and of objects that may become
/// hostnames), and longest label value.
pub const MAX_LABEL_LENGTH: usize = 63;
/// Longest DNS subdomain (names of most other objects, Leases among them).
pub const MAX_SUBDOMAIN_LENGTH: usize = 253;
/// Hex characters of the hash a generated name ends with.
const HASH_LENGTH: usize = 10;

/// `text` as a DNS label prefix: lowercase, every character other than
/// `[a-z0-9]` as `-`, at most `limit` characters, no leading or trailing
/// `-`; `haulage` when nothing is left.
pub fn dns_label_prefix(text: &str, limit: usize) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(limit)
        .collect();
    let trimmed = mapped.trim_matches('-');
    if trimmed.is_empty() {
        "haulage".to_string()
    } else {
        trimmed.to_string()
    }
}

/// A deterministic DNS label of at most `limit` characters: `readable` as
/// a prefix ([`dns_label_prefix`]), then `-` and a hash of the `identity`
/// parts (so names that share a prefix stay distinct).
pub fn hashed_dns_label(readable: &str, identity: &[&str], limit: usize) -> String {
    let digest = blake3::hash(identity.join("\0").as_bytes());
    let suffix = &digest.to_hex()[..HASH_LENGTH];
    format!(
        "{}-{suffix}",
        dns_label_prefix(readable, limit.saturating_sub(HASH_LENGTH + 1))
    )
}

/// A label value for an arbitrary string: the string itself when it is a
/// valid value, else a readable prefix and a hash of the whole string.
pub fn bounded_label_value(value: &str) -> String {
    let valid = value.len() <= MAX_LABEL_LENGTH
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value
            .chars()
            .next()
            .is_none_or(|c| c.is_ascii_alphanumeric())
        && value
            .chars()
            .last()
            .is_none_or(|c| c.is_ascii_alphanumeric());
    if valid {
        return value.to_string();
    }
    hashed_dns_label(value, &[value], MAX_LABEL_LENGTH)
}

/// `prefix` followed by `text` as a DNS subdomain: lowercase, only
/// `[a-z0-9.-]` kept (pod names already are), at most
/// [`MAX_SUBDOMAIN_LENGTH`] characters, ending in an alphanumeric.
pub fn dns_subdomain(prefix: &str, text: &str) -> String {
    let cleaned: String = text
        .chars()
        .map(|character| character.to_ascii_lowercase())
        .filter(|character| character.is_ascii_alphanumeric() || matches!(character, '-' | '.'))
        .collect();
    let cleaned = cleaned.trim_matches(|character| character == '-' || character == '.');
    let mut name = format!("{prefix}{cleaned}");
    name.truncate(MAX_SUBDOMAIN_LENGTH);
    name.trim_end_matches(['-', '.']).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_label(name: &str) -> bool {
        name.len() <= MAX_LABEL_LENGTH
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !name.starts_with('-')
            && !name.ends_with('-')
    }

    #[test]
    fn hashed_labels_are_bounded_valid_and_distinct_per_identity() {
        let long = "Node_".repeat(40);
        let a = hashed_dns_label(&long, &["a"], MAX_LABEL_LENGTH);
        let b = hashed_dns_label(&long, &["b"], MAX_LABEL_LENGTH);
        assert!(is_dns_label(&a), "{a}");
        assert_ne!(a, b);
        assert_eq!(a, hashed_dns_label(&long, &["a"], MAX_LABEL_LENGTH));
        assert_eq!(
            hashed_dns_label("---", &["x"], 30).split('-').next(),
            Some("haulage")
        );
    }

    #[test]
    fn a_valid_label_value_is_kept_and_any_other_is_bounded() {
        assert_eq!(bounded_label_value("shop.db_0"), "shop.db_0");
        let bounded = bounded_label_value(&"x".repeat(100));
        assert!(is_dns_label(&bounded), "{bounded}");
        assert_ne!(bounded, bounded_label_value(&"x".repeat(101)));
        assert!(is_dns_label(&bounded_label_value("-leading")));
    }

    #[test]
    fn subdomains_keep_dots_and_drop_what_a_name_cannot_hold() {
        assert_eq!(
            dns_subdomain("haulage-replica-", "Controller_0.Zone"),
            "haulage-replica-controller0.zone"
        );
        assert_eq!(
            dns_subdomain("p-", "x".repeat(400).as_str()).len(),
            MAX_SUBDOMAIN_LENGTH
        );
        assert_eq!(dns_subdomain("p-", "a--"), "p-a");
    }
}
