//! Which snapshots `forget` keeps: restic's retention semantics
//! (`internal/restic/snapshot_policy.go`) as a pure function.
//!
//! Snapshots are grouped (by source, host and/or tags), and in each group
//! sorted newest first. Every `keep-*` rule with a count walks the group:
//! `last` keeps each snapshot while its count lasts; `hourly`, `daily`,
//! `weekly`, `monthly`, `yearly` keep the newest snapshot of each hour,
//! day, ISO week, month or year while their count lasts; when a rule still
//! has counts left at the oldest snapshot of the group, that one is kept
//! too (the longest history the counts allow). A count of
//! [`KeepCount::All`] never runs out. A snapshot carrying every tag of one
//! of the `keep-tag` sets is kept and counts against no rule. A snapshot is
//! kept when any rule keeps it; the reasons say which. Periods are taken in
//! UTC (snapshots record UTC times).

use std::collections::BTreeMap;

use super::ObjectId;

/// How many periods a rule keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepCount {
    /// The rule is off.
    None,
    /// Keep this many (0 is off).
    Of(u32),
    /// Never run out (restic's `-1`).
    All,
}

impl KeepCount {
    /// From restic's convention: -1 all, 0 off, n.
    pub fn from_restic(value: i64) -> Option<Self> {
        match value {
            -1 => Some(KeepCount::All),
            0 => Some(KeepCount::None),
            n if n > 0 && n <= i64::from(u32::MAX) => Some(KeepCount::Of(n as u32)),
            _ => None,
        }
    }

    fn is_on(self) -> bool {
        !matches!(self, KeepCount::None | KeepCount::Of(0))
    }
}

/// A tag requirement: `key=value`, or `key` with any value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TagMatch {
    /// The tag's key.
    pub key: String,
    /// The value it must have, or any.
    pub value: Option<String>,
}

impl TagMatch {
    /// Parse `key=value` or `key`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (key, value) = match text.split_once('=') {
            Some((key, value)) => (key, Some(value.to_string())),
            None => (text, None),
        };
        if key.is_empty() {
            return Err(format!("tag {text:?} has an empty key"));
        }
        Ok(TagMatch {
            key: key.to_string(),
            value,
        })
    }

    fn matches(&self, tags: &BTreeMap<String, String>) -> bool {
        match (tags.get(&self.key), &self.value) {
            (Some(_), None) => true,
            (Some(actual), Some(wanted)) => actual == wanted,
            (None, _) => false,
        }
    }
}

impl std::fmt::Display for TagMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Some(value) => write!(f, "{}={value}", self.key),
            None => f.write_str(&self.key),
        }
    }
}

/// The `keep-*` rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// `--keep-last`.
    pub last: KeepCount,
    /// `--keep-hourly`.
    pub hourly: KeepCount,
    /// `--keep-daily`.
    pub daily: KeepCount,
    /// `--keep-weekly`.
    pub weekly: KeepCount,
    /// `--keep-monthly`.
    pub monthly: KeepCount,
    /// `--keep-yearly`.
    pub yearly: KeepCount,
    /// `--keep-tag`: each entry is a set of tags a snapshot must all carry.
    pub tags: Vec<Vec<TagMatch>>,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy {
            last: KeepCount::None,
            hourly: KeepCount::None,
            daily: KeepCount::None,
            weekly: KeepCount::None,
            monthly: KeepCount::None,
            yearly: KeepCount::None,
            tags: Vec::new(),
        }
    }
}

impl RetentionPolicy {
    /// True when no rule is set: such a policy would forget everything, so
    /// callers refuse it.
    pub fn is_empty(&self) -> bool {
        self.tags.is_empty() && self.counts().iter().all(|(count, _, _)| !count.is_on())
    }

    fn counts(&self) -> [(KeepCount, Period, &'static str); 6] {
        [
            (self.last, Period::Each, "last snapshot"),
            (self.hourly, Period::Hour, "hourly snapshot"),
            (self.daily, Period::Day, "daily snapshot"),
            (self.weekly, Period::Week, "weekly snapshot"),
            (self.monthly, Period::Month, "monthly snapshot"),
            (self.yearly, Period::Year, "yearly snapshot"),
        ]
    }
}

/// What groups snapshots before the policy applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupBy {
    /// The snapshot's source (`namespace/pvc` for a volume, else a path).
    pub source: bool,
    /// The host (or stage pod) that made it.
    pub host: bool,
    /// Its whole tag set.
    pub tags: bool,
}

impl GroupBy {
    /// Parse a comma-separated list of `source`, `host`, `tags` (empty: one
    /// group for everything).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut group = GroupBy {
            source: false,
            host: false,
            tags: false,
        };
        for part in text
            .split(',')
            .map(str::trim)
            .filter(|part| !part.is_empty())
        {
            match part {
                "source" => group.source = true,
                "host" => group.host = true,
                "tags" => group.tags = true,
                other => {
                    return Err(format!(
                        "cannot group by {other:?}: expected source, host or tags (comma-separated)"
                    ));
                }
            }
        }
        Ok(group)
    }
}

/// What the policy needs of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFacts {
    /// Its id.
    pub id: ObjectId,
    /// When it was taken, seconds since the Unix epoch (UTC).
    pub time_seconds: i64,
    /// The fraction of that second, in nanoseconds (0 for snapshots that
    /// record whole seconds): it orders snapshots taken in the same second.
    pub subsecond_nanos: u32,
    /// Its source.
    pub source: String,
    /// Its host.
    pub hostname: String,
    /// Its tags.
    pub tags: BTreeMap<String, String>,
}

/// The decision for one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The snapshot.
    pub id: ObjectId,
    /// When it was taken.
    pub time_seconds: i64,
    /// Kept or forgotten.
    pub keep: bool,
    /// Why it is kept (empty when forgotten).
    pub reasons: Vec<String>,
}

/// One group's decisions, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDecisions {
    /// What the group's snapshots share, for humans (`source=ns/pvc`).
    pub group: String,
    /// Newest first.
    pub decisions: Vec<Decision>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Period {
    Each,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) → days since 1970-01-01.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let month = i64::from(month);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// ISO 8601 (year, week) of a day.
fn iso_week(days: i64) -> (i64, i64) {
    // 1970-01-01 was a Thursday; Monday is 0.
    let weekday = (days + 3).rem_euclid(7);
    let thursday = days - weekday + 3;
    let (year, _, _) = civil_from_days(thursday);
    let week = (thursday - days_from_civil(year, 1, 1)) / 7 + 1;
    (year, week)
}

/// The bucket of a time for a period, as restic numbers them.
fn bucket(period: Period, seconds: i64, position: usize) -> i64 {
    let days = seconds.div_euclid(86_400);
    let hour = seconds.rem_euclid(86_400) / 3600;
    let (year, month, day) = civil_from_days(days);
    let (month, day) = (i64::from(month), i64::from(day));
    match period {
        Period::Each => position as i64,
        Period::Hour => year * 1_000_000 + month * 10_000 + day * 100 + hour,
        Period::Day => year * 10_000 + month * 100 + day,
        Period::Week => {
            let (year, week) = iso_week(days);
            year * 100 + week
        }
        Period::Month => year * 100 + month,
        Period::Year => year,
    }
}

fn group_key(group_by: GroupBy, snapshot: &SnapshotFacts) -> String {
    let mut parts = Vec::new();
    if group_by.source {
        parts.push(format!("source={}", snapshot.source));
    }
    if group_by.host {
        parts.push(format!("host={}", snapshot.hostname));
    }
    if group_by.tags {
        let tags: Vec<_> = snapshot
            .tags
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        parts.push(format!("tags=[{}]", tags.join(",")));
    }
    if parts.is_empty() {
        "all snapshots".into()
    } else {
        parts.join(" ")
    }
}

/// Decide, group by group, which snapshots `policy` keeps. Groups come in
/// the order of their keys; within a group, newest first (ties by id).
pub fn apply_policy(
    snapshots: &[SnapshotFacts],
    policy: &RetentionPolicy,
    group_by: GroupBy,
) -> Vec<GroupDecisions> {
    let mut groups: BTreeMap<String, Vec<&SnapshotFacts>> = BTreeMap::new();
    for snapshot in snapshots {
        groups
            .entry(group_key(group_by, snapshot))
            .or_default()
            .push(snapshot);
    }
    groups
        .into_iter()
        .map(|(group, mut members)| {
            members.sort_by(|a, b| {
                (b.time_seconds, b.subsecond_nanos)
                    .cmp(&(a.time_seconds, a.subsecond_nanos))
                    .then(a.id.cmp(&b.id))
            });
            GroupDecisions {
                group,
                decisions: decide_group(&members, policy),
            }
        })
        .collect()
}

fn decide_group(members: &[&SnapshotFacts], policy: &RetentionPolicy) -> Vec<Decision> {
    struct Rule {
        remaining: KeepCount,
        period: Period,
        reason: &'static str,
        last: Option<i64>,
    }
    let mut rules: Vec<Rule> = policy
        .counts()
        .into_iter()
        .filter(|(count, _, _)| count.is_on())
        .map(|(remaining, period, reason)| Rule {
            remaining,
            period,
            reason,
            last: None,
        })
        .collect();
    let oldest = members.len().saturating_sub(1);
    members
        .iter()
        .enumerate()
        .map(|(position, snapshot)| {
            let mut reasons = Vec::new();
            for set in &policy.tags {
                if set.iter().all(|tag| tag.matches(&snapshot.tags)) {
                    let names: Vec<_> = set.iter().map(ToString::to_string).collect();
                    reasons.push(format!("has tags [{}]", names.join(", ")));
                }
            }
            for rule in &mut rules {
                let has_count = match rule.remaining {
                    KeepCount::All => true,
                    KeepCount::Of(n) => n > 0,
                    KeepCount::None => false,
                };
                if !has_count {
                    continue;
                }
                let value = bucket(rule.period, snapshot.time_seconds, position);
                let new_period = rule.last != Some(value);
                if new_period || position == oldest {
                    rule.last = Some(value);
                    if let KeepCount::Of(n) = rule.remaining {
                        rule.remaining = KeepCount::Of(n - 1);
                    }
                    reasons.push(if new_period {
                        rule.reason.to_string()
                    } else {
                        format!("oldest {} (counts left)", rule.reason)
                    });
                }
            }
            Decision {
                id: snapshot.id,
                time_seconds: snapshot.time_seconds,
                keep: !reasons.is_empty(),
                reasons,
            }
        })
        .collect()
}

/// Seconds since the epoch of an RFC 3339 time (as snapshots record it,
/// whole seconds or with a fraction), and the fraction in nanoseconds; or
/// `None` when it cannot be read.
pub fn parse_snapshot_time(text: &str) -> Option<(i64, u32)> {
    let time = humantime::parse_rfc3339_weak(text).ok()?;
    match time.duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => Some((i64::try_from(after.as_secs()).ok()?, after.subsec_nanos())),
        Err(before) => {
            let before = before.duration();
            let seconds = i64::try_from(before.as_secs()).ok()?;
            Some(match before.subsec_nanos() {
                0 => (-seconds, 0),
                nanos => (-seconds - 1, 1_000_000_000 - nanos),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(text: &str) -> i64 {
        parse_snapshot_time(text).expect("time").0
    }

    fn snapshot(n: u8, time: i64) -> SnapshotFacts {
        SnapshotFacts {
            id: ObjectId([n; 32]),
            time_seconds: time,
            subsecond_nanos: 0,
            source: "ns/pvc".into(),
            hostname: "host".into(),
            tags: BTreeMap::new(),
        }
    }

    fn kept(groups: &[GroupDecisions]) -> Vec<ObjectId> {
        groups
            .iter()
            .flat_map(|group| &group.decisions)
            .filter(|decision| decision.keep)
            .map(|decision| decision.id)
            .collect()
    }

    #[test]
    fn calendar_buckets_match_known_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(
            days_from_civil(2024, 2, 29),
            at("2024-02-29T00:00:00Z") / 86_400
        );
        // 2021-01-03 belongs to ISO week 53 of 2020; 2026-12-31 to week 53 of 2026.
        assert_eq!(iso_week(at("2021-01-03T12:00:00Z") / 86_400), (2020, 53));
        assert_eq!(iso_week(at("2021-01-04T12:00:00Z") / 86_400), (2021, 1));
        assert_eq!(iso_week(at("2026-12-31T12:00:00Z") / 86_400), (2026, 53));
        assert_eq!(
            bucket(Period::Hour, at("2026-12-01T13:59:59Z"), 0),
            2026120113
        );
    }

    #[test]
    fn daily_keeps_the_newest_of_each_day_and_the_oldest_while_counts_remain() {
        let snapshots = vec![
            snapshot(1, at("2026-12-01T08:00:00Z")),
            snapshot(2, at("2026-12-01T20:00:00Z")),
            snapshot(3, at("2026-12-02T09:00:00Z")),
            snapshot(4, at("2026-12-03T09:00:00Z")),
        ];
        let by_source = GroupBy::parse("source").unwrap();
        let policy = RetentionPolicy {
            daily: KeepCount::Of(2),
            ..Default::default()
        };
        assert_eq!(
            kept(&apply_policy(&snapshots, &policy, by_source)),
            vec![ObjectId([4; 32]), ObjectId([3; 32])]
        );
        let policy = RetentionPolicy {
            daily: KeepCount::Of(10),
            ..Default::default()
        };
        // Three days, counts left: the oldest of the group is kept too.
        assert_eq!(
            kept(&apply_policy(&snapshots, &policy, by_source)),
            vec![
                ObjectId([4; 32]),
                ObjectId([3; 32]),
                ObjectId([2; 32]),
                ObjectId([1; 32])
            ]
        );
    }

    #[test]
    fn tags_keep_without_counting_and_groups_are_decided_apart() {
        let mut tagged = snapshot(1, 100);
        tagged.tags.insert("release".into(), "v1".into());
        let mut other_source = snapshot(3, 50);
        other_source.source = "ns/other".into();
        let snapshots = vec![tagged, snapshot(2, 200), other_source];
        let policy = RetentionPolicy {
            last: KeepCount::Of(1),
            tags: vec![vec![TagMatch::parse("release").unwrap()]],
            ..Default::default()
        };
        let groups = apply_policy(&snapshots, &policy, GroupBy::parse("source").unwrap());
        assert_eq!(groups.len(), 2);
        assert_eq!(
            kept(&groups),
            vec![ObjectId([3; 32]), ObjectId([2; 32]), ObjectId([1; 32])]
        );
        let reasons = &groups[1].decisions[1].reasons;
        assert_eq!(reasons, &vec!["has tags [release]".to_string()]);
    }

    fn arbitrary_snapshots() -> impl Strategy<Value = Vec<SnapshotFacts>> {
        proptest::collection::vec(
            (0i64..3 * 365 * 86_400, 0u8..3, proptest::option::of(0u8..2)),
            0..40,
        )
        .prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(|(n, (offset, source, tag))| {
                    let mut facts = snapshot(n as u8, 1_700_000_000 + offset);
                    facts.source = format!("ns/pvc-{source}");
                    if let Some(tag) = tag {
                        facts.tags.insert("kind".into(), format!("t{tag}"));
                    }
                    facts
                })
                .collect()
        })
    }

    fn arbitrary_count() -> impl Strategy<Value = KeepCount> {
        prop_oneof![
            Just(KeepCount::None),
            (1u32..6).prop_map(KeepCount::Of),
            Just(KeepCount::All)
        ]
    }

    fn arbitrary_policy() -> impl Strategy<Value = RetentionPolicy> {
        (
            arbitrary_count(),
            arbitrary_count(),
            arbitrary_count(),
            arbitrary_count(),
            arbitrary_count(),
            proptest::bool::ANY,
        )
            .prop_map(
                |(last, daily, weekly, monthly, yearly, tag)| RetentionPolicy {
                    last,
                    hourly: KeepCount::None,
                    daily,
                    weekly,
                    monthly,
                    yearly,
                    tags: if tag {
                        vec![vec![TagMatch::parse("kind=t1").unwrap()]]
                    } else {
                        Vec::new()
                    },
                },
            )
    }

    fn more(count: KeepCount) -> KeepCount {
        match count {
            KeepCount::None => KeepCount::Of(1),
            KeepCount::Of(n) => KeepCount::Of(n + 2),
            KeepCount::All => KeepCount::All,
        }
    }

    proptest! {
        #[test]
        fn every_snapshot_is_decided_once_and_kept_ones_have_reasons(
            snapshots in arbitrary_snapshots(),
            policy in arbitrary_policy(),
        ) {
            let groups = apply_policy(&snapshots, &policy, GroupBy::parse("source").unwrap());
            let mut seen: Vec<_> = groups.iter().flat_map(|g| &g.decisions).map(|d| d.id).collect();
            seen.sort();
            let mut all: Vec<_> = snapshots.iter().map(|s| s.id).collect();
            all.sort();
            prop_assert_eq!(seen, all);
            for decision in groups.iter().flat_map(|g| &g.decisions) {
                prop_assert_eq!(decision.keep, !decision.reasons.is_empty());
            }
        }

        #[test]
        fn keep_last_keeps_exactly_the_newest_of_each_group(
            snapshots in arbitrary_snapshots(),
            n in 1u32..8,
        ) {
            let policy = RetentionPolicy { last: KeepCount::Of(n), ..Default::default() };
            for group in apply_policy(&snapshots, &policy, GroupBy::parse("source").unwrap()) {
                let kept: Vec<bool> = group.decisions.iter().map(|d| d.keep).collect();
                let expected: Vec<bool> = (0..kept.len()).map(|i| i < n as usize).collect();
                prop_assert_eq!(kept, expected);
            }
        }

        #[test]
        fn a_larger_policy_keeps_a_superset_and_tagged_snapshots_are_always_kept(
            snapshots in arbitrary_snapshots(),
            policy in arbitrary_policy(),
        ) {
            let group_by = GroupBy::parse("source,tags").unwrap();
            let smaller = kept(&apply_policy(&snapshots, &policy, group_by));
            let larger_policy = RetentionPolicy {
                last: more(policy.last),
                daily: more(policy.daily),
                weekly: policy.weekly,
                monthly: more(policy.monthly),
                yearly: policy.yearly,
                hourly: KeepCount::None,
                tags: vec![vec![TagMatch::parse("kind=t1").unwrap()]],
            };
            let larger = kept(&apply_policy(&snapshots, &larger_policy, group_by));
            for id in &smaller {
                prop_assert!(larger.contains(id));
            }
            for snapshot in &snapshots {
                if snapshot.tags.get("kind").map(String::as_str) == Some("t1") {
                    prop_assert!(larger.contains(&snapshot.id));
                }
            }
        }

        #[test]
        fn a_periodic_rule_keeps_at_most_its_count_plus_nothing_else(
            snapshots in arbitrary_snapshots(),
            n in 1u32..6,
        ) {
            let policy = RetentionPolicy { daily: KeepCount::Of(n), ..Default::default() };
            for group in apply_policy(&snapshots, &policy, GroupBy::parse("source").unwrap()) {
                let kept = group.decisions.iter().filter(|d| d.keep).count();
                prop_assert!(kept <= n as usize);
                // The newest snapshot of a group is always kept.
                prop_assert!(group.decisions.first().is_none_or(|d| d.keep));
            }
        }
    }

    #[test]
    fn snapshots_of_the_same_second_are_ordered_by_their_fraction() {
        assert_eq!(
            parse_snapshot_time("2026-12-01T13:49:02.000000250Z"),
            Some((at("2026-12-01T13:49:02Z"), 250))
        );
        assert_eq!(
            parse_snapshot_time("2026-12-01T13:49:02Z").map(|time| time.1),
            Some(0)
        );
        let second = at("2026-12-01T13:49:02Z");
        // The earlier snapshot has the smaller id (which wins a tie of
        // whole seconds): the fraction must decide.
        let mut first = snapshot(1, second);
        first.subsecond_nanos = 100;
        let mut last = snapshot(9, second);
        last.subsecond_nanos = 900;
        let policy = RetentionPolicy {
            last: KeepCount::Of(1),
            ..RetentionPolicy::default()
        };
        let groups = apply_policy(
            &[first.clone(), last.clone()],
            &policy,
            GroupBy::parse("source").unwrap(),
        );
        let kept: Vec<ObjectId> = groups[0]
            .decisions
            .iter()
            .filter(|decision| decision.keep)
            .map(|decision| decision.id)
            .collect();
        assert_eq!(kept, [last.id], "the later one in the second is the last");
    }
}
