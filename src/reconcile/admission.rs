//! Admission under the caps that protect shared storage, as a pure
//! function: from every open VolumeTransfer in the cluster and the caps in
//! force to a decision per transfer ([`admit`]), and from the decisions to
//! the writes that carry them out, in a safe order ([`plan_writes`]). No
//! client, no clock; the admission loop (`haulage::controller::admission`)
//! builds the input from the caches and makes the writes.
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
use std::sync::Arc;

use haulage_api::condition::{
    Condition, ConditionStatus, condition_type, find_condition, reason, set_condition,
};
use haulage_api::{
    StoragePolicy, StoragePolicyStatus, VolumeTransfer, VolumeTransferPhase, VolumeTransferStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

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
    /// Its claim, `namespace/name`: one transfer at a time moves a claim.
    pub claim: String,
    /// Its stage pod, `namespace/name`: its agent moves
    /// [`Limits::stage_pods`] volumes at a time.
    pub stage_pod: String,
    /// What it belongs to, for people (`VolumeBackup haulage-system/nightly`).
    pub owner: String,
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
    /// Volumes each stage pod's agent moves at once, by `namespace/name`
    /// (what its memory request holds beside the repository's index:
    /// [`haulage_api::transfer::AgentMemory::volumes_at_once`]); one for a pod not
    /// listed.
    pub stage_pods: BTreeMap<String, u32>,
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
    /// A claim, `namespace/name`: one transfer at a time reads or writes
    /// it (two backups selecting it at once take turns).
    Claim(String),
    /// A stage pod, `namespace/name`: its agent begins no more volumes
    /// at once than its memory holds ([`Limits::stage_pods`]), so a slot
    /// granted beyond that would be held idle.
    StagePod(String),
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
            Cap::Claim(name) => (format!("claim {name}"), "nothing: one at a time"),
            Cap::StagePod(name) => (
                format!("stage pod {name}"),
                "nothing: its agent moves its volumes in turn",
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
    /// Another transfer moves the same claim now.
    ClaimBusy {
        /// The claim, `namespace/name`.
        claim: String,
        /// What that transfer belongs to.
        by: String,
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
    pub fn cap(&self) -> Cap {
        match self {
            Hold::Volumes { cap, .. } | Hold::Bandwidth { cap, .. } => cap.clone(),
            Hold::ClaimBusy { claim, .. } => Cap::Claim(claim.clone()),
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
                cap: Cap::StagePod(pod),
                limit,
                running,
            } => write!(
                formatter,
                "stage pod {pod}: its agent moves {limit} volume{} at a time (what its memory request holds beside the repository's index) and is moving {running} now; starts when one of them ends (or give the pod more memory through a StoragePolicy's spec.stagePodResources)",
                if *limit == 1 { "" } else { "s" }
            ),
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
            Hold::ClaimBusy { claim, by } => write!(
                formatter,
                "claim {claim}: {by} is moving it now; starts when that transfer ends (one transfer at a time per claim)"
            ),
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
    caps.push(Cap::StagePod(transfer.stage_pod.clone()));
    caps.push(Cap::Claim(transfer.claim.clone()));
    caps
}

fn volume_limit(cap: &Cap, limits: &Limits) -> Option<u32> {
    match cap {
        Cap::Cluster => limits.max_volumes,
        Cap::Policy(name) => limits.policies.get(name).and_then(|p| p.max_volumes),
        Cap::Location(name) => limits.locations.get(name).and_then(|l| l.max_volumes),
        Cap::Node(_) => limits.max_volumes_per_node,
        Cap::Claim(_) => Some(1),
        Cap::StagePod(name) => Some(limits.stage_pods.get(name).copied().unwrap_or(1)),
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
        Cap::Cluster | Cap::Node(_) | Cap::Claim(_) | Cap::StagePod(_) => None,
    }
}

/// The first cap that holds a transfer back, given what runs under each
/// (and who moves each claim).
fn hold_of(
    caps: &[Cap],
    running: &BTreeMap<Cap, u32>,
    claim_holders: &BTreeMap<String, String>,
    limits: &Limits,
) -> Option<Hold> {
    caps.iter().find_map(|cap| {
        let count = running.get(cap).copied().unwrap_or(0);
        if let Cap::Claim(claim) = cap {
            return claim_holders.get(claim).map(|by| Hold::ClaimBusy {
                claim: claim.clone(),
                by: by.clone(),
            });
        }
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
    let mut claim_holders: BTreeMap<String, String> = BTreeMap::new();
    let mut admitted: Vec<(&TransferFacts, Vec<Cap>, bool)> = Vec::new();
    for transfer in ordered.iter().filter(|t| t.state == TransferState::Running) {
        let caps = caps_of(transfer, limits);
        occupy(&caps, &mut running);
        claim_holders
            .entry(transfer.claim.clone())
            .or_insert_with(|| transfer.owner.clone());
        admitted.push((transfer, caps, false));
    }
    let mut held: Vec<(&TransferFacts, Vec<Cap>, Hold)> = Vec::new();
    for transfer in ordered.iter().filter(|t| t.state == TransferState::Waiting) {
        let caps = caps_of(transfer, limits);
        match hold_of(&caps, &running, &claim_holders, limits) {
            Some(hold) => held.push((transfer, caps, hold)),
            None => {
                occupy(&caps, &mut running);
                claim_holders.insert(transfer.claim.clone(), transfer.owner.clone());
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

impl TransferKey {
    /// The key of `transfer`.
    pub fn of(transfer: &VolumeTransfer) -> Self {
        TransferKey {
            namespace: transfer.namespace().unwrap_or_default(),
            name: transfer.name_any(),
        }
    }
}

/// Queue positions shown exactly; deeper ones are rounded up.
pub const EXACT_QUEUE_POSITIONS: usize = 10;

/// The queue position written to a transfer's status, and whether it is
/// exact: the first [`EXACT_QUEUE_POSITIONS`] exactly, deeper ones rounded
/// up to one significant digit (57 → 60, 123 → 200). Exact positions for a
/// queue of n would rewrite every queued transfer whenever one starts,
/// n²/2 status writes in all (measured, docs/benchmarks.md); rounded ones
/// change about 9 times per digit, so a transfer that waits behind 1,000
/// others is written some 30 times, not 1,000.
pub fn shown_position(position: usize) -> (usize, bool) {
    if position <= EXACT_QUEUE_POSITIONS {
        return (position, true);
    }
    let mut step = 1;
    while position / step >= 10 {
        step *= 10;
    }
    (position.div_ceil(step) * step, false)
}

/// One write the pass makes.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// Set `spec.grantedBytesPerSecond`.
    Grant {
        /// Which transfer.
        key: TransferKey,
        /// The new grant.
        grant: Option<u64>,
    },
    /// Apply this status (Admitted or Queued).
    Status {
        /// Which transfer.
        key: TransferKey,
        /// The status to apply.
        status: Box<VolumeTransferStatus>,
    },
    /// Apply a StoragePolicy's usage.
    Policy {
        /// Its name.
        name: String,
        /// The status to apply.
        status: StoragePolicyStatus,
    },
}

fn current_grant(transfer: &VolumeTransfer) -> Option<u64> {
    transfer
        .spec
        .granted_bytes_per_second
        .and_then(|grant| u64::try_from(grant).ok())
}

/// The writes an admission result needs, in the order they must be made:
/// lowered grants, then admissions (grant, then phase), then raised
/// grants, then queue positions, then policy usage. Only what differs from
/// the cached objects. Pure.
pub fn plan_writes(
    admission: &Admission,
    transfers: &[Arc<VolumeTransfer>],
    policies: &[Arc<StoragePolicy>],
    now: Time,
) -> Vec<Write> {
    let by_key: BTreeMap<TransferKey, &VolumeTransfer> = transfers
        .iter()
        .map(|transfer| (TransferKey::of(transfer), transfer.as_ref()))
        .collect();
    let mut lowered = Vec::new();
    let mut admitted = Vec::new();
    let mut raised = Vec::new();
    let mut queued = Vec::new();
    let lower = |old: Option<u64>, new: Option<u64>| match (old, new) {
        (None, Some(_)) => true,
        (Some(old), Some(new)) => new < old,
        _ => false,
    };
    for (key, decision) in &admission.decisions {
        let Some(transfer) = by_key.get(key) else {
            continue;
        };
        let old_grant = current_grant(transfer);
        let old_status = transfer.status.clone().unwrap_or_default();
        match decision {
            Decision::Run { grant } if *grant != old_grant => {
                let write = Write::Grant {
                    key: key.clone(),
                    grant: *grant,
                };
                if lower(old_grant, *grant) {
                    lowered.push(write);
                } else {
                    raised.push(write);
                }
            }
            Decision::Run { .. } => {}
            Decision::Admit { grant } => {
                if *grant != old_grant {
                    admitted.push(Write::Grant {
                        key: key.clone(),
                        grant: *grant,
                    });
                }
                let message = match grant {
                    Some(bytes) => format!("admitted under every cap; granted {bytes} bytes/s"),
                    None => "admitted under every cap; no bandwidth cap applies".to_string(),
                };
                let mut conditions = old_status.conditions.clone();
                set_condition(
                    &mut conditions,
                    Condition::new(
                        condition_type::ADMITTED,
                        ConditionStatus::True,
                        reason::CAPACITY_GRANTED,
                        &message,
                        transfer.metadata.generation,
                        now.clone(),
                    ),
                    now.clone(),
                );
                let admitted_condition = find_condition(&conditions, condition_type::ADMITTED)
                    .cloned()
                    .into_iter()
                    .collect();
                admitted.push(Write::Status {
                    key: key.clone(),
                    status: Box::new(VolumeTransferStatus {
                        phase: Some(VolumeTransferPhase::Admitted),
                        conditions: admitted_condition,
                        ..VolumeTransferStatus::default()
                    }),
                });
            }
            Decision::Queue { position, hold } => {
                let mut conditions = old_status.conditions.clone();
                let (position, exact) = shown_position(*position as usize);
                let place = if exact {
                    format!("queued at position {position}")
                } else {
                    format!("queued within the first {position}")
                };
                let changed = set_condition(
                    &mut conditions,
                    Condition::new(
                        condition_type::ADMITTED,
                        ConditionStatus::False,
                        reason::WAITING_FOR_CAPACITY,
                        &format!("{place}: held by {hold}"),
                        transfer.metadata.generation,
                        now.clone(),
                    ),
                    now.clone(),
                );
                let position = i32::try_from(position).unwrap_or(i32::MAX);
                if changed
                    || old_status.phase != Some(VolumeTransferPhase::Queued)
                    || old_status.queue_position != Some(position)
                {
                    queued.push(Write::Status {
                        key: key.clone(),
                        status: Box::new(VolumeTransferStatus {
                            phase: Some(VolumeTransferPhase::Queued),
                            queue_position: Some(position),
                            conditions: find_condition(&conditions, condition_type::ADMITTED)
                                .cloned()
                                .into_iter()
                                .collect(),
                            ..VolumeTransferStatus::default()
                        }),
                    });
                }
            }
        }
    }
    let mut writes = lowered;
    writes.extend(admitted);
    writes.extend(raised);
    writes.extend(queued);
    for policy in policies {
        let name = policy.name_any();
        let usage = admission
            .policies
            .get(&name)
            .copied()
            .unwrap_or(PolicyUsage::default());
        let old = policy.status.clone().unwrap_or_default();
        let signed = |value: u32| i32::try_from(value).unwrap_or(i32::MAX);
        let status = StoragePolicyStatus {
            running_volumes: Some(signed(usage.running)),
            queued_volumes: Some(signed(usage.queued)),
            granted_bytes_per_second: usage
                .granted_bytes_per_second
                .map(|bytes| i64::try_from(bytes).unwrap_or(i64::MAX)),
            conditions: old.conditions.clone(),
            observed_generation: policy.metadata.generation,
        };
        if status != old {
            writes.push(Write::Policy { name, status });
        }
    }
    writes
}

/// Whether resourceVersion `cached` predates `written`. They are etcd
/// revisions, which grow; should one not be a number, only equality
/// counts.
pub fn is_older(cached: &str, written: &str) -> bool {
    match (cached.parse::<u64>(), written.parse::<u64>()) {
        (Ok(cached), Ok(written)) => cached < written,
        _ => cached != written,
    }
}

/// Each policy's name and resourceVersion, sorted: equal when two views
/// hold the same versions of the same policies.
fn versions(policies: &[Arc<StoragePolicy>]) -> Vec<(String, Option<String>)> {
    let mut versions: Vec<_> = policies
        .iter()
        .map(|policy| (policy.name_any(), policy.resource_version()))
        .collect();
    versions.sort();
    versions
}

/// When a pass reads the StoragePolicies from the API server rather than
/// trusting the cache. Pure.
///
/// The policy cache is its own watch: a StoragePolicy created just before
/// a backup can still be on its way when that backup's transfers arrive.
/// So a pass that admits anything reads the policies first (a quorum read
/// of a handful of objects), and a cap that exists is never passed over;
/// and while the cache lags what was read, every pass reads again, so a
/// re-split after the admission does not undo the caps by the older
/// cache (CI saw exactly that: admitted under the listed policy, then
/// re-split to no grant by the cache). Other passes read nothing.
#[derive(Debug)]
pub struct PolicyReads {
    cache_lags: bool,
}

impl Default for PolicyReads {
    /// Not yet compared: the first pass reads.
    fn default() -> Self {
        PolicyReads { cache_lags: true }
    }
}

impl PolicyReads {
    /// Whether this pass reads the policies (`admits`: it would admit).
    pub fn needed(&self, admits: bool) -> bool {
        admits || self.cache_lags
    }

    /// Record a read; whether to decide by `listed` instead of `cached`.
    pub fn read(&mut self, cached: &[Arc<StoragePolicy>], listed: &[Arc<StoragePolicy>]) -> bool {
        self.cache_lags = versions(listed) != versions(cached);
        self.cache_lags
    }

    /// This replica just became (or stopped being) the admitter: a
    /// previous admitter may have admitted by policies this cache has not
    /// seen, so the next pass reads, even if it admits nothing.
    pub fn forget(&mut self) {
        self.cache_lags = true;
    }
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
            claim: format!("shop/{name}"),
            stage_pod: format!("shop/stage-{name}"),
            owner: "VolumeBackup haulage-system/nightly".to_string(),
        }
    }

    fn with(mut facts: TransferFacts, node: &str, policies: &[&str]) -> TransferFacts {
        facts.node = Some(node.to_string());
        facts.location = Some("haulage-system/minio".to_string());
        facts.policies = policies.iter().map(|p| p.to_string()).collect();
        facts
    }

    /// Transfer `name` on node `node-<name>`, under StoragePolicy ceph-rbd.
    fn on_ceph(name: &str, created: i64, state: TransferState) -> TransferFacts {
        with(
            transfer(name, created, state),
            &format!("node-{name}"),
            &["ceph-rbd"],
        )
    }

    /// A waiting transfer of the ceph-rbd policy in stage pod `shop/POD`.
    fn in_pod(name: &str, created: i64, pod: &str) -> TransferFacts {
        let mut facts = on_ceph(name, created, TransferState::Waiting);
        facts.stage_pod = format!("shop/{pod}");
        facts
    }

    /// The names of `transfers` the pass admitted, in their order.
    fn admitted_names<'a>(transfers: &'a [TransferFacts], admission: &Admission) -> Vec<&'a str> {
        transfers
            .iter()
            .filter(|t| matches!(admission.decisions[&t.key], Decision::Admit { .. }))
            .map(|t| t.key.name.as_str())
            .collect()
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
            stage_pods: BTreeMap::new(),
        }
    }

    #[test]
    fn a_full_policy_queues_the_rest_in_creation_order_and_names_itself() {
        let transfers = vec![
            on_ceph("c", 3, TransferState::Waiting),
            on_ceph("a", 1, TransferState::Waiting),
            on_ceph("b", 2, TransferState::Waiting),
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
        assert_eq!(hold.cap(), Cap::Node("node-a".to_string()));
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
            on_ceph("a", 1, TransferState::Running),
            on_ceph("b", 2, TransferState::Waiting),
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
            on_ceph("a", 1, TransferState::Waiting),
            on_ceph("b", 2, TransferState::Waiting),
            on_ceph("c", 3, TransferState::Waiting),
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
            on_ceph("a", 1, TransferState::Running),
            on_ceph("b", 2, TransferState::Running),
            on_ceph("c", 3, TransferState::Waiting),
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
            // Volumes at once of the stage pods `shop/stage-0..4` and
            // `web/stage-0..4` (a pod left out moves one).
            proptest::collection::vec(proptest::option::of(1u32..4), 8),
        )
            .prop_map(|(global, node, policies, locations, pods)| Limits {
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
                stage_pods: pods
                    .into_iter()
                    .enumerate()
                    .filter_map(|(index, volumes)| {
                        let pod = format!("{}/stage-{}", ["shop", "web"][index / 4], index % 4);
                        volumes.map(|volumes| (pod, volumes))
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
                0usize..4,
            ),
            0..24,
        )
        .prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(
                    |(index, (created, node, location, policies, pod))| TransferFacts {
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
                        claim: format!("{}/claim-{index}", ["shop", "web"][index % 2]),
                        stage_pod: format!("{}/stage-{pod}", ["shop", "web"][index % 2]),
                        owner: format!("VolumeBackup haulage-system/b{index}"),
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
                    .filter(|t| caps_of(t, &limits).contains(&hold.cap()))
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
                    Hold::ClaimBusy { .. } => prop_assert_eq!(running_under, 1),
                }
                // Everything admitted after it in FIFO order is outside
                // the cap that holds it.
                for later in transfers.iter().filter(|t| order(t) > order(held)) {
                    if matches!(admission.decisions[&later.key], Decision::Admit { .. }) {
                        prop_assert!(
                            !caps_of(later, &limits).contains(&hold.cap()),
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

    fn policy_at(name: &str, version: &str) -> Arc<StoragePolicy> {
        let mut policy = StoragePolicy::test(name);
        policy.metadata.resource_version = Some(version.to_string());
        Arc::new(policy)
    }

    fn cached_transfer(
        name: &str,
        phase: Option<VolumeTransferPhase>,
        grant: Option<i64>,
    ) -> Arc<VolumeTransfer> {
        let mut transfer = VolumeTransfer::test(name, name);
        transfer.spec.granted_bytes_per_second = grant;
        if let Some(phase) = phase {
            transfer = transfer.with_phase(phase);
        }
        Arc::new(transfer)
    }

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(seconds).expect("in range"))
    }

    #[test]
    fn policies_are_read_before_admitting_and_on_every_pass_while_the_cache_lags() {
        let mut reads = PolicyReads::default();
        // Not compared yet (a new admitter): the first pass reads.
        assert!(reads.needed(false));
        assert!(!reads.read(&[], &[]));
        // Nothing to admit, cache trusted: no read.
        assert!(!reads.needed(false));
        // Admitting: read. The cache has not seen the new policy yet.
        assert!(reads.needed(true));
        let listed = vec![policy_at("ceph", "12")];
        assert!(reads.read(&[], &listed), "decide by the list");
        // A re-split pass that admits nothing still reads while the cache
        // lags, so it does not undo the caps by the older cache.
        assert!(reads.needed(false));
        assert!(reads.read(&[], &listed));
        // The cache caught up: trusted again, and no read without an admission.
        assert!(!reads.read(&listed, &listed));
        assert!(!reads.needed(false));
        // A newer version of a policy (a changed cap) counts as a lag too.
        assert!(reads.read(&listed, &[policy_at("ceph", "13")]));
        // So does a deleted one still in the cache.
        assert!(reads.read(&listed, &[]));
        // A change of admitter: read again on the next pass.
        assert!(!reads.read(&listed, &listed));
        reads.forget();
        assert!(reads.needed(false));
    }

    #[test]
    fn grants_are_lowered_before_admissions_and_raised_after_them() {
        let transfers = vec![
            cached_transfer("lowered", Some(VolumeTransferPhase::InProgress), Some(200)),
            cached_transfer("raised", Some(VolumeTransferPhase::InProgress), Some(50)),
            cached_transfer("new", None, None),
        ];
        let admission = Admission {
            decisions: BTreeMap::from([
                (key("lowered"), Decision::Run { grant: Some(100) }),
                (key("raised"), Decision::Run { grant: Some(100) }),
                (key("new"), Decision::Admit { grant: Some(100) }),
            ]),
            policies: BTreeMap::new(),
        };
        let writes = plan_writes(&admission, &transfers, &[], at(0));
        let order: Vec<(String, &str)> = writes
            .iter()
            .map(|write| match write {
                Write::Grant { key, .. } => (key.name.clone(), "grant"),
                Write::Status { key, .. } => (key.name.clone(), "status"),
                Write::Policy { name, .. } => (name.clone(), "policy"),
            })
            .collect();
        assert_eq!(
            order,
            [
                ("lowered".to_string(), "grant"),
                ("new".to_string(), "grant"),
                ("new".to_string(), "status"),
                ("raised".to_string(), "grant"),
            ]
        );
    }

    #[test]
    fn deep_queue_positions_are_rounded_up_so_they_rarely_change() {
        assert_eq!(shown_position(1), (1, true));
        assert_eq!(shown_position(10), (10, true));
        assert_eq!(shown_position(11), (20, false));
        assert_eq!(shown_position(57), (60, false));
        assert_eq!(shown_position(100), (100, false));
        assert_eq!(shown_position(123), (200, false));
        assert_eq!(shown_position(1000), (1000, false));
        assert_eq!(shown_position(1001), (2000, false));
        // Walking a transfer from position 1,000 to 1 changes what is shown
        // a few dozen times, not a thousand.
        let shown: std::collections::BTreeSet<usize> = (1..=1000)
            .map(|position| shown_position(position).0)
            .collect();
        assert!(shown.len() <= 30, "{}", shown.len());
        // Never shown ahead of where it is.
        assert!((1..5000).all(|position| shown_position(position).0 >= position));
    }

    #[test]
    fn an_unchanged_queue_position_is_not_written_again() {
        let hold = Hold::Volumes {
            cap: Cap::Policy("ceph-rbd".to_string()),
            running: 1,
            limit: 1,
        };
        let admission = Admission {
            decisions: BTreeMap::from([(
                key("waiting"),
                Decision::Queue {
                    position: 2,
                    hold: hold.clone(),
                },
            )]),
            policies: BTreeMap::new(),
        };
        let first = plan_writes(
            &admission,
            &[cached_transfer("waiting", None, None)],
            &[],
            at(0),
        );
        let [Write::Status { status, .. }] = first.as_slice() else {
            panic!("one status write expected: {first:?}");
        };
        assert_eq!(status.phase, Some(VolumeTransferPhase::Queued));
        assert_eq!(status.queue_position, Some(2));
        let condition = &status.conditions[0];
        assert_eq!(condition.reason, reason::WAITING_FOR_CAPACITY);
        assert!(
            condition.message.starts_with(
                "queued at position 2: held by StoragePolicy ceph-rbd: 1 of 1 volumes running"
            ),
            "{}",
            condition.message
        );
        // Written: the same decision later changes nothing.
        let mut written = (*cached_transfer("waiting", None, None)).clone();
        written.status = Some((**status).clone());
        let again = plan_writes(&admission, &[Arc::new(written)], &[], at(60));
        assert!(again.is_empty(), "{again:?}");
    }

    #[test]
    fn a_stage_pod_whose_memory_holds_two_volumes_is_granted_two() {
        // The same line as below, but stage-a's agent moves two volumes at
        // once: both policy slots go to its first two claims, and the
        // third waits for the pod, the policy being full as well.
        let limits = Limits {
            policies: BTreeMap::from([(
                "ceph-rbd".to_string(),
                PolicyLimits {
                    max_volumes: Some(3),
                    max_bytes_per_second: None,
                },
            )]),
            stage_pods: BTreeMap::from([("shop/stage-a".to_string(), 2)]),
            ..Limits::default()
        };
        let transfers = [
            in_pod("a1", 1, "stage-a"),
            in_pod("a2", 2, "stage-a"),
            in_pod("a3", 3, "stage-a"),
            in_pod("b1", 4, "stage-b"),
            in_pod("b2", 5, "stage-b"),
        ];
        let admission = admit(&limits, &transfers);
        let admitted = admitted_names(&transfers, &admission);
        assert_eq!(admitted, ["a1", "a2", "b1"]);
        let Decision::Queue { hold, .. } = &admission.decisions[&key("a3")] else {
            panic!("a3 waits for its pod: {admission:?}");
        };
        assert_eq!(hold.cap(), Cap::StagePod("shop/stage-a".to_string()));
        let message = hold.to_string();
        assert!(
            message.contains("2 volumes at a time") && message.contains("moving 2 now"),
            "{message}"
        );
    }

    #[test]
    fn a_slot_goes_to_a_transfer_its_stage_pod_can_begin_not_to_the_second_of_a_busy_pod() {
        // A policy of 2 volumes over claims of two stage pods: the first
        // two transfers in line are the same pod's, whose agent moves one
        // volume at a time. The second slot (and half the bandwidth) goes
        // to the other pod's claim, not to one that would wait idle.
        let limits = Limits {
            policies: BTreeMap::from([(
                "ceph-rbd".to_string(),
                PolicyLimits {
                    max_volumes: Some(2),
                    max_bytes_per_second: Some(100 << 20),
                },
            )]),
            ..Limits::default()
        };
        let transfers = [
            in_pod("a1", 1, "stage-a"),
            in_pod("a2", 2, "stage-a"),
            in_pod("a3", 3, "stage-a"),
            in_pod("b1", 4, "stage-b"),
        ];
        let admission = admit(&limits, &transfers);
        let admitted = admitted_names(&transfers, &admission);
        assert_eq!(admitted, ["a1", "b1"]);
        assert_eq!(
            admission.decisions[&key("b1")],
            Decision::Admit {
                grant: Some(50 << 20)
            }
        );
        let Decision::Queue { position, hold } = &admission.decisions[&key("a2")] else {
            panic!("a2 waits for its pod: {admission:?}");
        };
        assert_eq!(*position, 1);
        assert_eq!(hold.cap(), Cap::StagePod("shop/stage-a".to_string()));
        let message = hold.to_string();
        assert!(
            message.contains("stage pod shop/stage-a") && message.contains("1 volume at a time"),
            "{message}"
        );
        // Once a1 runs and b1 runs, the policy is full: a2 then waits for
        // the policy as well, and is named by the first full cap.
        let running = [
            TransferFacts {
                state: TransferState::Running,
                ..transfers[0].clone()
            },
            transfers[1].clone(),
            TransferFacts {
                state: TransferState::Running,
                ..transfers[3].clone()
            },
        ];
        let admission = admit(&limits, &running);
        let Decision::Queue { hold, .. } = &admission.decisions[&key("a2")] else {
            panic!("a2 still waits: {admission:?}");
        };
        assert_eq!(hold.cap(), Cap::Policy("ceph-rbd".to_string()));
    }

    #[test]
    fn a_claim_moved_by_one_transfer_holds_another_of_the_same_claim_naming_its_owner() {
        let mut first = transfer("first-db", 1, TransferState::Running);
        first.claim = "shop/db".to_string();
        first.owner = "VolumeBackup haulage-system/first".to_string();
        let mut second = transfer("second-db", 2, TransferState::Waiting);
        second.claim = "shop/db".to_string();
        second.owner = "VolumeBackup haulage-system/second".to_string();
        let other = transfer("second-logs", 3, TransferState::Waiting);
        let admission = admit(&Limits::default(), &[first, second.clone(), other]);
        let Some(Decision::Queue { hold, .. }) = admission.decisions.get(&second.key) else {
            panic!("the second transfer of the claim waits: {admission:?}");
        };
        let message = hold.to_string();
        assert!(
            message.contains("shop/db") && message.contains("haulage-system/first"),
            "{message}"
        );
        assert!(matches!(
            admission.decisions.get(&key("second-logs")),
            Some(Decision::Admit { .. })
        ));
        // Two waiting for one claim: the older starts, the other waits.
        let mut a = transfer("a", 1, TransferState::Waiting);
        a.claim = "shop/db".to_string();
        let mut b = transfer("b", 2, TransferState::Waiting);
        b.claim = "shop/db".to_string();
        let admission = admit(&Limits::default(), &[b, a]);
        assert!(matches!(
            admission.decisions.get(&key("a")),
            Some(Decision::Admit { .. })
        ));
        assert!(matches!(
            admission.decisions.get(&key("b")),
            Some(Decision::Queue { .. })
        ));
    }
}
