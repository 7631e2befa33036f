//! Admission under the caps that protect shared storage, as a pure
//! function: from every open VolumeTransfer in the cluster and the caps in
//! force to a decision per transfer. No client, no clock; the admission
//! loop ([`crate::controller::admitter`]) builds the input from the caches
//! and writes the decisions.
//!
//! The rules (docs/controller.md, "Admission and caps"):
//!
//! - A transfer occupies a slot from the moment it is admitted until it is
//!   final: `Admitted`, `InProgress` and `Finalizing` are running.
//! - A waiting transfer (`New` or `Queued`) is admitted only when every cap
//!   it falls under has room: the cluster-wide cap, each StoragePolicy
//!   selecting its storage class (all of them apply, so the most
//!   restrictive binds), its BackupStorageLocation's cap and its node's cap.
//!   A bandwidth cap also holds a transfer back when its equal share would
//!   fall below [`MIN_GRANT_BYTES_PER_SECOND`].
//! - Waiting transfers are considered first in, first out: by creation
//!   time, then namespace and name, so the result is deterministic. A
//!   transfer that is held does not reserve anything: one behind it whose
//!   caps have room is admitted (no head-of-line blocking across different
//!   caps). Two transfers under the same full cap keep their order, since
//!   a full cap stays full for the rest of the pass.
//! - Running transfers are never preempted, even when a cap was lowered
//!   below what runs; the cap then admits nothing until enough finish.
//! - Bandwidth: a StoragePolicy's `maxBytesPerSecond` is split equally
//!   among the running transfers of its storage, a location's
//!   `uploadBytesPerSecond` among the running transfers writing there; a
//!   transfer's grant is the smallest of its shares (rounded down, so the
//!   grants under a cap never add up to more than the cap).

use std::collections::BTreeMap;
use std::fmt;

/// Smallest bandwidth grant, bytes per second: the engine's throttle
/// counts in KiB, so a smaller grant would run faster than granted.
pub const MIN_GRANT_BYTES_PER_SECOND: u64 = 1024;

/// A VolumeTransfer's identity.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferKey {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl fmt::Display for TransferKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}/{}", self.namespace, self.name)
    }
}

/// Whether a transfer holds a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferState {
    /// `New` or `Queued`: waiting for admission.
    Waiting,
    /// `Admitted`, `InProgress` or `Finalizing`: holding a slot.
    Running,
}

/// What admission needs to know about one open transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferFacts {
    /// Which transfer.
    pub key: TransferKey,
    /// `metadata.creationTimestamp`, seconds since the epoch (FIFO order).
    pub created_seconds: i64,
    /// Waiting or running.
    pub state: TransferState,
    /// The node its stage pod runs on, when known (no node cap otherwise).
    pub node: Option<String>,
    /// Its BackupStorageLocation, `namespace/name`.
    pub location: Option<String>,
    /// Names of the StoragePolicies selecting its storage class.
    pub policies: Vec<String>,
}

/// The caps of one StoragePolicy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyLimits {
    /// `maxConcurrentVolumes`.
    pub max_volumes: Option<u32>,
    /// `maxBytesPerSecond`.
    pub max_bytes_per_second: Option<u64>,
}

/// The caps of one BackupStorageLocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LocationLimits {
    /// `maxConcurrentVolumes`.
    pub max_volumes: Option<u32>,
    /// `uploadBytesPerSecond`.
    pub upload_bytes_per_second: Option<u64>,
}

/// Every cap in force.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    /// Volumes moved at once in the cluster (`--max-concurrent-volumes`).
    pub max_volumes: Option<u32>,
    /// Volumes moved at once per node (`--max-volumes-per-node`).
    pub max_volumes_per_node: Option<u32>,
    /// StoragePolicies by name.
    pub policies: BTreeMap<String, PolicyLimits>,
    /// BackupStorageLocations by `namespace/name`.
    pub locations: BTreeMap<String, LocationLimits>,
}

/// One cap a transfer falls under.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Cap {
    /// The cluster-wide volume cap.
    Cluster,
    /// A StoragePolicy, by name.
    Policy(String),
    /// A BackupStorageLocation, `namespace/name`.
    Location(String),
    /// A node, by name.
    Node(String),
}

impl Cap {
    /// The object as a person names it, and the setting that raises it.
    fn describe(&self) -> (String, &'static str) {
        match self {
            Cap::Cluster => (
                "the cluster-wide cap".to_string(),
                "the controller's --max-concurrent-volumes",
            ),
            Cap::Policy(name) => (
                format!("StoragePolicy {name}"),
                "its spec.maxConcurrentVolumes",
            ),
            Cap::Location(name) => (
                format!("BackupStorageLocation {name}"),
                "its spec.maxConcurrentVolumes",
            ),
            Cap::Node(name) => (
                format!("node {name}"),
                "the controller's --max-volumes-per-node",
            ),
        }
    }
}

/// Why a transfer waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hold {
    /// A volume cap is full.
    Volumes {
        /// Which cap.
        cap: Cap,
        /// Transfers running under it.
        running: u32,
        /// Its limit.
        limit: u32,
    },
    /// Another transfer would leave each a share below
    /// [`MIN_GRANT_BYTES_PER_SECOND`].
    Bandwidth {
        /// Which cap (a policy or a location).
        cap: Cap,
        /// Its bytes per second.
        bytes_per_second: u64,
        /// Transfers running under it.
        running: u32,
    },
}

impl Hold {
    /// The cap that holds the transfer.
    pub fn cap(&self) -> &Cap {
        match self {
            Hold::Volumes { cap, .. } | Hold::Bandwidth { cap, .. } => cap,
        }
    }
}

impl fmt::Display for Hold {
    /// What holds the transfer and what lets it start, e.g.
    /// `StoragePolicy ceph-rbd: 4 of 4 volumes running; starts when one of
    /// them finishes (or raise its spec.maxConcurrentVolumes)`.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hold::Volumes {
                cap,
                running,
                limit,
            } => {
                let (object, setting) = cap.describe();
                write!(
                    formatter,
                    "{object}: {running} of {limit} volumes running; starts when one of them \
                     finishes (or raise {setting})"
                )
            }
            Hold::Bandwidth {
                cap,
                bytes_per_second,
                running,
            } => {
                let (object, _) = cap.describe();
                let setting = match cap {
                    Cap::Location(_) => "its spec.uploadBytesPerSecond",
                    _ => "its spec.maxBytesPerSecond",
                };
                write!(
                    formatter,
                    "{object}: {bytes_per_second} bytes/s shared by {running} running volumes \
                     leaves less than {MIN_GRANT_BYTES_PER_SECOND} bytes/s for another; starts \
                     when one of them finishes (or raise {setting})"
                )
            }
        }
    }
}

/// What happens to one transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// It was waiting and may start now, with this bandwidth (`None`:
    /// unlimited).
    Admit {
        /// Bytes per second granted.
        grant: Option<u64>,
    },
    /// It keeps waiting.
    Queue {
        /// Place among the transfers still waiting, FIFO (1 = next).
        position: u32,
        /// The first full cap it falls under.
        hold: Hold,
    },
    /// It runs already; its bandwidth after the re-split.
    Run {
        /// Bytes per second granted.
        grant: Option<u64>,
    },
}

/// How much of a StoragePolicy is in use after admission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyUsage {
    /// Transfers of its storage running (admitted ones included).
    pub running: u32,
    /// Transfers of its storage waiting.
    pub queued: u32,
    /// Sum of the grants of its running transfers (`None` when one of them
    /// is unlimited).
    pub granted_bytes_per_second: Option<u64>,
}

/// The result of one admission pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// One decision per open transfer.
    pub decisions: BTreeMap<TransferKey, Decision>,
    /// Usage of every StoragePolicy in [`Limits::policies`].
    pub policies: BTreeMap<String, PolicyUsage>,
}

/// The caps a transfer falls under, in the order they are checked (and
/// named when full): cluster, policies by name, location, node.
fn caps_of(transfer: &TransferFacts, limits: &Limits) -> Vec<Cap> {
    let mut caps = vec![Cap::Cluster];
    let mut policies: Vec<&String> = transfer
        .policies
        .iter()
        .filter(|name| limits.policies.contains_key(*name))
        .collect();
    policies.sort();
    policies.dedup();
    caps.extend(policies.into_iter().map(|name| Cap::Policy(name.clone())));
    if let Some(location) = &transfer.location {
        caps.push(Cap::Location(location.clone()));
    }
    if let Some(node) = &transfer.node {
        caps.push(Cap::Node(node.clone()));
    }
    caps
}

fn volume_limit(cap: &Cap, limits: &Limits) -> Option<u32> {
    match cap {
        Cap::Cluster => limits.max_volumes,
        Cap::Policy(name) => limits.policies.get(name).and_then(|p| p.max_volumes),
        Cap::Location(name) => limits.locations.get(name).and_then(|l| l.max_volumes),
        Cap::Node(_) => limits.max_volumes_per_node,
    }
}

fn bandwidth_limit(cap: &Cap, limits: &Limits) -> Option<u64> {
    match cap {
        Cap::Policy(name) => limits
            .policies
            .get(name)
            .and_then(|p| p.max_bytes_per_second),
        Cap::Location(name) => limits
            .locations
            .get(name)
            .and_then(|l| l.upload_bytes_per_second),
        Cap::Cluster | Cap::Node(_) => None,
    }
}

/// The first cap that holds a transfer back, given what runs under each.
fn hold_of(caps: &[Cap], running: &BTreeMap<Cap, u32>, limits: &Limits) -> Option<Hold> {
    caps.iter().find_map(|cap| {
        let count = running.get(cap).copied().unwrap_or(0);
        if let Some(limit) = volume_limit(cap, limits)
            && count >= limit
        {
            return Some(Hold::Volumes {
                cap: cap.clone(),
                running: count,
                limit,
            });
        }
        match bandwidth_limit(cap, limits) {
            Some(bytes_per_second)
                if bytes_per_second / u64::from(count + 1) < MIN_GRANT_BYTES_PER_SECOND =>
            {
                Some(Hold::Bandwidth {
                    cap: cap.clone(),
                    bytes_per_second,
                    running: count,
                })
            }
            _ => None,
        }
    })
}

/// Decide, for every open transfer, whether it starts, waits (and why), or
/// keeps running with which bandwidth. Deterministic: the order of
/// `transfers` does not matter.
pub fn admit(limits: &Limits, transfers: &[TransferFacts]) -> Admission {
    let mut ordered: Vec<&TransferFacts> = transfers.iter().collect();
    ordered.sort_by(|a, b| (a.created_seconds, &a.key).cmp(&(b.created_seconds, &b.key)));

    let mut running: BTreeMap<Cap, u32> = BTreeMap::new();
    fn occupy(caps: &[Cap], running: &mut BTreeMap<Cap, u32>) {
        for cap in caps {
            *running.entry(cap.clone()).or_insert(0) += 1;
        }
    }
    let mut admitted: Vec<(&TransferFacts, Vec<Cap>, bool)> = Vec::new();
    for transfer in ordered.iter().filter(|t| t.state == TransferState::Running) {
        let caps = caps_of(transfer, limits);
        occupy(&caps, &mut running);
        admitted.push((transfer, caps, false));
    }
    let mut held: Vec<(&TransferFacts, Vec<Cap>, Hold)> = Vec::new();
    for transfer in ordered.iter().filter(|t| t.state == TransferState::Waiting) {
        let caps = caps_of(transfer, limits);
        match hold_of(&caps, &running, limits) {
            Some(hold) => held.push((transfer, caps, hold)),
            None => {
                occupy(&caps, &mut running);
                admitted.push((transfer, caps, true));
            }
        }
    }

    let mut admission = Admission::default();
    let mut policy_usage: BTreeMap<String, PolicyUsage> = limits
        .policies
        .keys()
        .map(|name| {
            (
                name.clone(),
                PolicyUsage {
                    granted_bytes_per_second: Some(0),
                    ..PolicyUsage::default()
                },
            )
        })
        .collect();
    for (transfer, caps, newly) in admitted {
        let grant = caps
            .iter()
            .filter_map(|cap| {
                let bytes_per_second = bandwidth_limit(cap, limits)?;
                let count = u64::from(running.get(cap).copied().unwrap_or(1).max(1));
                // Only when caps were lowered below what runs can the share
                // fall under 1 byte/s; a grant is at least 1 (the API's
                // minimum).
                Some((bytes_per_second / count).max(1))
            })
            .min();
        for cap in &caps {
            if let Cap::Policy(name) = cap
                && let Some(usage) = policy_usage.get_mut(name)
            {
                usage.running += 1;
                usage.granted_bytes_per_second = match (usage.granted_bytes_per_second, grant) {
                    (Some(sum), Some(grant)) => Some(sum.saturating_add(grant)),
                    _ => None,
                };
            }
        }
        let decision = if newly {
            Decision::Admit { grant }
        } else {
            Decision::Run { grant }
        };
        admission.decisions.insert(transfer.key.clone(), decision);
    }
    for (index, (transfer, caps, hold)) in held.into_iter().enumerate() {
        for cap in &caps {
            if let Cap::Policy(name) = cap
                && let Some(usage) = policy_usage.get_mut(name)
            {
                usage.queued += 1;
            }
        }
        let position = u32::try_from(index + 1).unwrap_or(u32::MAX);
        admission
            .decisions
            .insert(transfer.key.clone(), Decision::Queue { position, hold });
    }
    for usage in policy_usage.values_mut() {
        if usage.running == 0 {
            usage.granted_bytes_per_second = None;
        }
    }
    admission.policies = policy_usage;
    admission
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn transfer(name: &str, created: i64, state: TransferState) -> TransferFacts {
        TransferFacts {
            key: TransferKey {
                namespace: "shop".to_string(),
                name: name.to_string(),
            },
            created_seconds: created,
            state,
            node: None,
            location: None,
            policies: Vec::new(),
        }
    }

    fn with(mut facts: TransferFacts, node: &str, policies: &[&str]) -> TransferFacts {
        facts.node = Some(node.to_string());
        facts.location = Some("haulage-system/minio".to_string());
        facts.policies = policies.iter().map(|p| p.to_string()).collect();
        facts
    }

    fn key(name: &str) -> TransferKey {
        TransferKey {
            namespace: "shop".to_string(),
            name: name.to_string(),
        }
    }

    fn ceph(max_volumes: Option<u32>, max_bytes_per_second: Option<u64>) -> Limits {
        Limits {
            max_volumes: Some(16),
            max_volumes_per_node: Some(2),
            policies: BTreeMap::from([(
                "ceph-rbd".to_string(),
                PolicyLimits {
                    max_volumes,
                    max_bytes_per_second,
                },
            )]),
            locations: BTreeMap::new(),
        }
    }

    #[test]
    fn a_full_policy_queues_the_rest_in_creation_order_and_names_itself() {
        let transfers = vec![
            with(
                transfer("c", 3, TransferState::Waiting),
                "node-c",
                &["ceph-rbd"],
            ),
            with(
                transfer("a", 1, TransferState::Waiting),
                "node-a",
                &["ceph-rbd"],
            ),
            with(
                transfer("b", 2, TransferState::Waiting),
                "node-b",
                &["ceph-rbd"],
            ),
        ];
        let admission = admit(&ceph(Some(1), None), &transfers);
        assert_eq!(
            admission.decisions[&key("a")],
            Decision::Admit { grant: None }
        );
        let Decision::Queue { position, hold } = &admission.decisions[&key("b")] else {
            panic!("b should wait: {admission:?}");
        };
        assert_eq!(*position, 1);
        assert_eq!(
            hold.to_string(),
            "StoragePolicy ceph-rbd: 1 of 1 volumes running; starts when one of them \
             finishes (or raise its spec.maxConcurrentVolumes)"
        );
        assert!(matches!(
            admission.decisions[&key("c")],
            Decision::Queue { position: 2, .. }
        ));
        assert_eq!(
            admission.policies["ceph-rbd"],
            PolicyUsage {
                running: 1,
                queued: 2,
                granted_bytes_per_second: None
            }
        );
    }

    #[test]
    fn a_transfer_held_by_its_node_does_not_block_one_on_another_node() {
        let transfers = vec![
            with(transfer("run-1", 0, TransferState::Running), "node-a", &[]),
            with(transfer("run-2", 0, TransferState::Running), "node-a", &[]),
            with(transfer("first", 1, TransferState::Waiting), "node-a", &[]),
            with(transfer("second", 2, TransferState::Waiting), "node-b", &[]),
        ];
        let admission = admit(&ceph(None, None), &transfers);
        let Decision::Queue { hold, .. } = &admission.decisions[&key("first")] else {
            panic!("first should wait for node-a");
        };
        assert_eq!(hold.cap(), &Cap::Node("node-a".to_string()));
        assert_eq!(
            admission.decisions[&key("second")],
            Decision::Admit { grant: None }
        );
    }

    #[test]
    fn the_policy_bandwidth_is_split_equally_and_the_location_share_applies_when_smaller() {
        let mut limits = ceph(None, Some(300 << 20));
        limits.locations.insert(
            "haulage-system/minio".to_string(),
            LocationLimits {
                max_volumes: None,
                upload_bytes_per_second: Some(500 << 20),
            },
        );
        let mut transfers = vec![
            with(
                transfer("a", 1, TransferState::Running),
                "node-a",
                &["ceph-rbd"],
            ),
            with(
                transfer("b", 2, TransferState::Waiting),
                "node-b",
                &["ceph-rbd"],
            ),
            with(transfer("c", 3, TransferState::Waiting), "node-c", &[]),
        ];
        let admission = admit(&limits, &transfers);
        // ceph-rbd: 300 MiB/s over a and b; minio: 500 MiB/s over a, b, c.
        let third = (500u64 << 20) / 3;
        assert_eq!(
            admission.decisions[&key("a")],
            Decision::Run {
                grant: Some((300 << 20) / 2)
            }
        );
        assert_eq!(
            admission.decisions[&key("b")],
            Decision::Admit {
                grant: Some((300 << 20) / 2)
            }
        );
        assert_eq!(
            admission.decisions[&key("c")],
            Decision::Admit { grant: Some(third) }
        );
        // a finishes: the policy would give b all 300 MiB/s, the location
        // only half its 500.
        transfers.remove(0);
        transfers[0].state = TransferState::Running;
        transfers[1].state = TransferState::Running;
        let admission = admit(&limits, &transfers);
        assert_eq!(
            admission.decisions[&key("b")],
            Decision::Run {
                grant: Some(250 << 20)
            }
        );
        assert_eq!(
            admission.policies["ceph-rbd"].granted_bytes_per_second,
            Some(250 << 20)
        );
    }

    #[test]
    fn a_bandwidth_cap_admits_no_more_than_it_can_give_a_kibibyte_per_second() {
        let transfers = vec![
            with(
                transfer("a", 1, TransferState::Waiting),
                "node-a",
                &["ceph-rbd"],
            ),
            with(
                transfer("b", 2, TransferState::Waiting),
                "node-b",
                &["ceph-rbd"],
            ),
            with(
                transfer("c", 3, TransferState::Waiting),
                "node-c",
                &["ceph-rbd"],
            ),
        ];
        let admission = admit(&ceph(None, Some(2048)), &transfers);
        assert!(matches!(
            admission.decisions[&key("c")],
            Decision::Queue {
                hold: Hold::Bandwidth { running: 2, .. },
                ..
            }
        ));
        assert_eq!(
            admission.decisions[&key("b")],
            Decision::Admit { grant: Some(1024) }
        );
    }

    #[test]
    fn running_transfers_are_kept_when_a_cap_is_lowered_below_them() {
        let transfers = vec![
            with(
                transfer("a", 1, TransferState::Running),
                "node-a",
                &["ceph-rbd"],
            ),
            with(
                transfer("b", 2, TransferState::Running),
                "node-b",
                &["ceph-rbd"],
            ),
            with(
                transfer("c", 3, TransferState::Waiting),
                "node-c",
                &["ceph-rbd"],
            ),
        ];
        let admission = admit(&ceph(Some(1), None), &transfers);
        assert_eq!(
            admission.decisions[&key("b")],
            Decision::Run { grant: None }
        );
        assert!(matches!(
            &admission.decisions[&key("c")],
            Decision::Queue {
                hold: Hold::Volumes {
                    running: 2,
                    limit: 1,
                    ..
                },
                ..
            }
        ));
    }

    // Property tests: random caps and transfers on three nodes, two
    // locations and three policies.

    const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
    const LOCATIONS: [&str; 2] = ["ops/minio", "ops/rgw"];
    const POLICIES: [&str; 3] = ["ceph-rbd", "cephfs", "nfs"];

    fn limits_strategy() -> impl Strategy<Value = Limits> {
        let volumes = proptest::option::of(1u32..5);
        let bandwidth = proptest::option::of(1024u64..(64 << 20));
        (
            volumes.clone(),
            volumes.clone(),
            proptest::collection::vec((volumes.clone(), bandwidth.clone()), 3),
            proptest::collection::vec((volumes, bandwidth), 2),
        )
            .prop_map(|(global, node, policies, locations)| Limits {
                max_volumes: global,
                max_volumes_per_node: node,
                policies: POLICIES
                    .iter()
                    .zip(policies)
                    .map(|(name, (max_volumes, max_bytes_per_second))| {
                        (
                            name.to_string(),
                            PolicyLimits {
                                max_volumes,
                                max_bytes_per_second,
                            },
                        )
                    })
                    .collect(),
                locations: LOCATIONS
                    .iter()
                    .zip(locations)
                    .map(|(name, (max_volumes, upload_bytes_per_second))| {
                        (
                            name.to_string(),
                            LocationLimits {
                                max_volumes,
                                upload_bytes_per_second,
                            },
                        )
                    })
                    .collect(),
            })
    }

    /// Waiting transfers only (a sequence of passes makes the running ones).
    fn transfers_strategy() -> impl Strategy<Value = Vec<TransferFacts>> {
        proptest::collection::vec(
            (
                0i64..6,
                proptest::option::of(0usize..3),
                0usize..2,
                proptest::collection::btree_set(0usize..3, 0..3),
            ),
            0..24,
        )
        .prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(
                    |(index, (created, node, location, policies))| TransferFacts {
                        key: TransferKey {
                            namespace: ["shop", "web"][index % 2].to_string(),
                            name: format!("t{index:02}"),
                        },
                        created_seconds: created,
                        state: TransferState::Waiting,
                        node: node.map(|n| NODES[n].to_string()),
                        location: Some(LOCATIONS[location].to_string()),
                        policies: policies
                            .into_iter()
                            .map(|p| POLICIES[p].to_string())
                            .collect(),
                    },
                )
                .collect()
        })
    }

    /// Every volume cap holds for the running set, and the grants under
    /// each bandwidth cap add up to at most the cap.
    fn assert_within_caps(limits: &Limits, transfers: &[TransferFacts], admission: &Admission) {
        let mut count: BTreeMap<Cap, u32> = BTreeMap::new();
        let mut granted: BTreeMap<Cap, u64> = BTreeMap::new();
        for transfer in transfers {
            let grant = match &admission.decisions[&transfer.key] {
                Decision::Admit { grant } | Decision::Run { grant } => *grant,
                Decision::Queue { .. } => continue,
            };
            for cap in caps_of(transfer, limits) {
                *count.entry(cap.clone()).or_insert(0) += 1;
                if bandwidth_limit(&cap, limits).is_some() {
                    let grant = grant.expect("a transfer under a bandwidth cap has a grant");
                    *granted.entry(cap).or_insert(0) += grant;
                }
            }
        }
        for (cap, running) in &count {
            if let Some(limit) = volume_limit(cap, limits) {
                assert!(*running <= limit, "{cap:?}: {running} running, cap {limit}");
            }
        }
        for (cap, sum) in &granted {
            let limit = bandwidth_limit(cap, limits).expect("a bandwidth cap");
            assert!(*sum <= limit, "{cap:?}: {sum} granted, cap {limit}");
        }
    }

    proptest! {
        #[test]
        fn no_cap_is_exceeded_after_any_sequence_of_admissions_and_completions(
            limits in limits_strategy(),
            mut transfers in transfers_strategy(),
            finished in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
        ) {
            let mut finished = finished.into_iter();
            loop {
                let admission = admit(&limits, &transfers);
                assert_within_caps(&limits, &transfers, &admission);
                for transfer in &mut transfers {
                    if matches!(admission.decisions[&transfer.key], Decision::Admit { .. }) {
                        transfer.state = TransferState::Running;
                    }
                }
                let running: Vec<usize> = transfers
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.state == TransferState::Running)
                    .map(|(index, _)| index)
                    .collect();
                let Some(pick) = finished.next() else { break };
                if running.is_empty() {
                    break;
                }
                transfers.remove(running[pick.index(running.len())]);
            }
        }

        #[test]
        fn admission_is_deterministic_whatever_the_input_order(
            limits in limits_strategy(),
            transfers in transfers_strategy(),
            seed in any::<u64>(),
        ) {
            use rand::seq::SliceRandom;
            use rand::SeedableRng;
            let mut shuffled = transfers.clone();
            shuffled.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
            prop_assert_eq!(admit(&limits, &transfers), admit(&limits, &shuffled));
        }

        #[test]
        fn a_waiting_transfer_is_passed_only_by_one_outside_the_cap_that_holds_it(
            limits in limits_strategy(),
            transfers in transfers_strategy(),
        ) {
            let admission = admit(&limits, &transfers);
            let order = |t: &TransferFacts| (t.created_seconds, t.key.clone());
            let mut positions = Vec::new();
            for held in &transfers {
                let Decision::Queue { position, hold } = &admission.decisions[&held.key] else {
                    continue;
                };
                positions.push((order(held), *position));
                // Held for a reason that is true after the pass.
                let running_under = transfers
                    .iter()
                    .filter(|t| !matches!(admission.decisions[&t.key], Decision::Queue { .. }))
                    .filter(|t| caps_of(t, &limits).contains(hold.cap()))
                    .count() as u32;
                match hold {
                    Hold::Volumes { running, limit, .. } => {
                        prop_assert_eq!(*running, running_under);
                        prop_assert!(running_under >= *limit);
                    }
                    Hold::Bandwidth { bytes_per_second, running, .. } => {
                        prop_assert_eq!(*running, running_under);
                        prop_assert!(
                            bytes_per_second / u64::from(running_under + 1)
                                < MIN_GRANT_BYTES_PER_SECOND
                        );
                    }
                }
                // Everything admitted after it in FIFO order is outside
                // the cap that holds it.
                for later in transfers.iter().filter(|t| order(t) > order(held)) {
                    if matches!(admission.decisions[&later.key], Decision::Admit { .. }) {
                        prop_assert!(
                            !caps_of(later, &limits).contains(hold.cap()),
                            "{} passed {} under {:?}", later.key, held.key, hold.cap()
                        );
                    }
                }
            }
            // Positions are 1..=n in FIFO order.
            positions.sort();
            let numbers: Vec<u32> = positions.iter().map(|(_, position)| *position).collect();
            let expected: Vec<u32> = (1..=numbers.len() as u32).collect();
            prop_assert_eq!(numbers, expected);
        }
    }
}
