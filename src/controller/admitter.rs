//! The admission loop: on the replica holding the admission lease
//! ([`crate::controller::lease`]), it reads every open VolumeTransfer from
//! the shared cache, turns the caches into [`admission::admit`]'s input
//! ([`observe`], pure) and writes what changed: lowered grants first, then
//! admissions (grant before phase, so an agent starts with its share),
//! raised grants, queue positions, StoragePolicy usage. Lowering before
//! admitting keeps the sum of grants under a cap at every moment.
//!
//! The loop never decides from a cache that has not seen its own last
//! writes: after writing, it waits until the cache shows a newer
//! resourceVersion of each object it wrote (or the object gone), so one
//! admission is never counted twice or missed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::api::condition::{
    Condition, ConditionStatus, condition_type, find_condition, reason, set_condition,
};
use crate::api::{
    BackupStorageLocation, StoragePolicy, StoragePolicyStatus, VolumeTransfer, VolumeTransferPhase,
    VolumeTransferStatus,
};
use crate::controller::admission::{
    Admission, Decision, Limits, LocationLimits, PolicyLimits, PolicyUsage, TransferFacts,
    TransferKey, TransferState, admit,
};
use crate::controller::error::{Error, kube_error};
use crate::controller::lease::Leadership;
use crate::controller::location::now;
use crate::controller::{Context, FIELD_MANAGER};
use crate::plan::spec::NODE_ANNOTATION;

/// Seconds between passes when nothing wakes the loop (a stage pod that
/// appeared, which is not a watched event here).
const PASS_INTERVAL_SECONDS: u64 = 2;
/// Milliseconds to let a burst of events settle before a pass.
const SETTLE_MILLISECONDS: u64 = 100;
/// Seconds to wait for the cache to show the loop's own writes before
/// deciding again anyway (a watch that was restarted relists).
const CATCH_UP_SECONDS: u64 = 30;

/// The caches admission reads, by reference.
pub struct Caches<'a> {
    /// Every haulage VolumeTransfer.
    pub transfers: &'a [Arc<VolumeTransfer>],
    /// Stage pods (for their node).
    pub pods: &'a Store<Pod>,
    /// Claims (for their storage class).
    pub claims: &'a Store<PersistentVolumeClaim>,
    /// StorageClasses (for their provisioner).
    pub classes: &'a Store<StorageClass>,
    /// StoragePolicies.
    pub policies: &'a [Arc<StoragePolicy>],
    /// BackupStorageLocations.
    pub locations: &'a [Arc<BackupStorageLocation>],
}

/// The phase a transfer without status has.
fn phase_of(transfer: &VolumeTransfer) -> VolumeTransferPhase {
    transfer
        .status
        .as_ref()
        .and_then(|status| status.phase)
        .unwrap_or(VolumeTransferPhase::New)
}

fn key_of(transfer: &VolumeTransfer) -> TransferKey {
    TransferKey {
        namespace: transfer.namespace().unwrap_or_default(),
        name: transfer.name_any(),
    }
}

/// The node a stage pod runs on: the planner's annotation (the full node
/// name), else `spec.nodeName`.
fn node_of(pod: &Pod) -> Option<String> {
    pod.annotations()
        .get(NODE_ANNOTATION)
        .cloned()
        .or_else(|| pod.spec.as_ref()?.node_name.clone())
}

/// The StoragePolicies selecting a claim's storage class: its
/// `spec.storageClassName` and that class's provisioner.
fn policies_of(namespace: &str, pvc: &str, caches: &Caches<'_>) -> Vec<String> {
    let claim = caches.claims.get(&ObjectRef::new(pvc).within(namespace));
    let Some(class_name) = claim.and_then(|claim| claim.spec.as_ref()?.storage_class_name.clone())
    else {
        return Vec::new();
    };
    let provisioner = caches
        .classes
        .get(&ObjectRef::new(&class_name))
        .map(|class| class.provisioner.clone())
        .unwrap_or_default();
    caches
        .policies
        .iter()
        .filter(|policy| policy.spec.selects(&class_name, &provisioner))
        .map(|policy| policy.name_any())
        .collect()
}

/// The admission input from the caches. A waiting transfer whose stage
/// pod is not in the cache yet is left out (its node is unknown, and it
/// could not start anyway); final transfers hold nothing.
pub fn observe(
    caches: &Caches<'_>,
    max_volumes: Option<u32>,
    max_volumes_per_node: Option<u32>,
) -> (Limits, Vec<TransferFacts>) {
    let positive_u32 =
        |value: Option<i32>| value.and_then(|v| u32::try_from(v).ok()).filter(|v| *v > 0);
    let positive_u64 =
        |value: Option<i64>| value.and_then(|v| u64::try_from(v).ok()).filter(|v| *v > 0);
    let limits = Limits {
        max_volumes,
        max_volumes_per_node,
        policies: caches
            .policies
            .iter()
            .map(|policy| {
                (
                    policy.name_any(),
                    PolicyLimits {
                        max_volumes: positive_u32(policy.spec.max_concurrent_volumes),
                        max_bytes_per_second: positive_u64(policy.spec.max_bytes_per_second),
                    },
                )
            })
            .collect(),
        locations: caches
            .locations
            .iter()
            .map(|location| {
                (
                    format!(
                        "{}/{}",
                        location.namespace().unwrap_or_default(),
                        location.name_any()
                    ),
                    LocationLimits {
                        max_volumes: positive_u32(location.spec.max_concurrent_volumes),
                        upload_bytes_per_second: positive_u64(
                            location.spec.upload_bytes_per_second,
                        ),
                    },
                )
            })
            .collect(),
    };
    let mut facts = Vec::new();
    for transfer in caches.transfers {
        let phase = phase_of(transfer);
        let state = match phase {
            VolumeTransferPhase::New | VolumeTransferPhase::Queued => TransferState::Waiting,
            VolumeTransferPhase::Admitted
            | VolumeTransferPhase::InProgress
            | VolumeTransferPhase::Finalizing => TransferState::Running,
            VolumeTransferPhase::Completed
            | VolumeTransferPhase::Failed
            | VolumeTransferPhase::Canceled => continue,
        };
        let key = key_of(transfer);
        let pod = caches
            .pods
            .get(&ObjectRef::new(&transfer.spec.stage_pod).within(&key.namespace));
        if pod.is_none() && state == TransferState::Waiting {
            continue;
        }
        let location = &transfer.spec.storage_location;
        facts.push(TransferFacts {
            created_seconds: transfer
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(0, |time| time.0.as_second()),
            state,
            // The pod's node, or while it is being recreated (not in the
            // cache) the node its transfer was planned on.
            node: pod
                .as_deref()
                .and_then(node_of)
                .or_else(|| transfer.annotations().get(NODE_ANNOTATION).cloned()),
            location: Some(format!("{}/{}", location.namespace, location.name)),
            policies: policies_of(&key.namespace, &transfer.spec.pvc, caches),
            key,
        });
    }
    (limits, facts)
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
    now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> Vec<Write> {
    let by_key: BTreeMap<TransferKey, &VolumeTransfer> = transfers
        .iter()
        .map(|transfer| (key_of(transfer), transfer.as_ref()))
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
fn is_older(cached: &str, written: &str) -> bool {
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

/// What a pass needs besides the caches.
pub struct Admitter {
    context: Arc<Context>,
    leadership: Arc<Leadership>,
    /// Objects written by the last pass: (kind, namespace, name) → the
    /// resourceVersion the write returned, until the cache shows it.
    pending: BTreeMap<(&'static str, String, String), String>,
    pending_since: Option<Instant>,
    /// When admission reads the StoragePolicies from the API server.
    policy_reads: PolicyReads,
}

impl Admitter {
    /// An admitter over the controller's caches.
    pub fn new(context: Arc<Context>, leadership: Arc<Leadership>) -> Self {
        Admitter {
            context,
            leadership,
            pending: BTreeMap::new(),
            pending_since: None,
            policy_reads: PolicyReads::default(),
        }
    }

    /// Pass after pass, woken by `wake` or every [`PASS_INTERVAL_SECONDS`],
    /// while this replica holds the admission lease; until `shutdown`.
    pub async fn run(mut self, wake: Arc<Notify>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(PASS_INTERVAL_SECONDS)) => {}
            }
            tokio::time::sleep(Duration::from_millis(SETTLE_MILLISECONDS)).await;
            if !self.leadership.is_leader() {
                self.pending.clear();
                self.policy_reads.forget();
                continue;
            }
            if let Err(error) = self.pass().await {
                warn!(error = %error.chain(), kind = error.label(), "admission pass failed; retrying");
            }
        }
    }

    /// Whether the cache shows every object the last pass wrote.
    fn caught_up(&mut self) -> bool {
        let stores = &self.context.stores;
        self.pending.retain(|(kind, namespace, name), written| {
            let cached = match *kind {
                "VolumeTransfer" => stores
                    .transfers
                    .get(&ObjectRef::new(name).within(namespace))
                    .and_then(|object| object.resource_version()),
                _ => stores
                    .policies
                    .get(&ObjectRef::new(name))
                    .and_then(|object| object.resource_version()),
            };
            // Kept while the cache holds an older version than the write
            // returned; a deleted object is caught up.
            cached.is_some_and(|cached| is_older(&cached, written))
        });
        if self.pending.is_empty() {
            self.pending_since = None;
            return true;
        }
        if self
            .pending_since
            .is_some_and(|since| since.elapsed() > Duration::from_secs(CATCH_UP_SECONDS))
        {
            warn!(
                objects = self.pending.len(),
                "the cache did not show the last admission writes within {CATCH_UP_SECONDS}s; deciding anyway"
            );
            self.pending.clear();
            self.pending_since = None;
            return true;
        }
        false
    }

    /// One admission pass.
    async fn pass(&mut self) -> Result<(), Error> {
        // A cache still listing would hide transfers, their claims (so
        // their policies) or their nodes: admit nothing until all are in.
        if !self.context.readiness.caches_synced() {
            debug!("waiting for the caches to sync before admitting");
            return Ok(());
        }
        if !self.caught_up() {
            debug!("waiting for the cache to show the last admission writes");
            return Ok(());
        }
        let stores = &self.context.stores;
        let config = &self.context.config;
        let transfers = stores.transfers.state();
        let mut policies = stores.policies.state();
        let locations = stores.locations.state();
        let decide = |policies: &[Arc<StoragePolicy>]| {
            let caches = Caches {
                transfers: &transfers,
                pods: &stores.pods,
                claims: &stores.claims,
                classes: &stores.classes,
                policies,
                locations: &locations,
            };
            let (limits, facts) = observe(
                &caches,
                config.max_concurrent_volumes,
                config.max_volumes_per_node,
            );
            admit(&limits, &facts)
        };
        let mut admission = decide(&policies);
        // Policies from the API server when the cache may lag
        // ([`PolicyReads`]).
        let admits = admission
            .decisions
            .values()
            .any(|decision| matches!(decision, Decision::Admit { .. }));
        if self.policy_reads.needed(admits) {
            let listed = self.list_policies().await?;
            if self.policy_reads.read(&policies, &listed) {
                debug!(
                    cached = policies.len(),
                    listed = listed.len(),
                    "the StoragePolicy cache lags the API server; deciding by the listed policies"
                );
                policies = listed;
                admission = decide(&policies);
            }
        }
        let writes = plan_writes(&admission, &transfers, &policies, now());
        let by_key: BTreeMap<TransferKey, &Arc<VolumeTransfer>> = transfers
            .iter()
            .map(|transfer| (key_of(transfer), transfer))
            .collect();
        for write in writes {
            // The lease may lapse mid-pass; the next holder decides then.
            if !self.leadership.is_leader() {
                return Ok(());
            }
            match &write {
                Write::Grant { key, grant } => {
                    let Some(transfer) = by_key.get(key) else {
                        continue;
                    };
                    let version = self.apply_grant(transfer, *grant).await?;
                    info!(transfer = %key, grant = ?grant, "bandwidth granted");
                    self.remember("VolumeTransfer", key, version);
                }
                Write::Status { key, status } => {
                    let version = self.apply_transfer_status(key, status).await?;
                    if status.phase == Some(VolumeTransferPhase::Admitted) {
                        info!(transfer = %key, "admitted");
                    }
                    self.remember("VolumeTransfer", key, version);
                }
                Write::Policy { name, status } => {
                    let version = self.apply_policy_status(name, status).await?;
                    self.remember(
                        "StoragePolicy",
                        &TransferKey {
                            namespace: String::new(),
                            name: name.clone(),
                        },
                        version,
                    );
                }
            }
        }
        Ok(())
    }

    /// Every StoragePolicy, read from the API server (not the cache).
    async fn list_policies(&self) -> Result<Vec<Arc<StoragePolicy>>, Error> {
        let api: Api<StoragePolicy> = Api::all(self.context.client.clone());
        let listed = api.list(&ListParams::default()).await.map_err(kube_error(
            "list",
            "StoragePolicy",
            "(all)",
        ))?;
        Ok(listed.items.into_iter().map(Arc::new).collect())
    }

    fn remember(&mut self, kind: &'static str, key: &TransferKey, version: Option<String>) {
        if let Some(version) = version {
            self.pending
                .insert((kind, key.namespace.clone(), key.name.clone()), version);
            self.pending_since.get_or_insert_with(Instant::now);
        }
    }

    /// Write the transfer's new grant as a merge patch of that one field
    /// (with the controller's field manager). A merge patch never creates:
    /// a transfer deleted meanwhile (its backup was canceled) stays deleted
    /// (404), and re-applying the transfer's desired spec when a stage pod
    /// is recreated does not remove the grant (it is owned by this update,
    /// not by that apply).
    async fn apply_grant(
        &self,
        transfer: &VolumeTransfer,
        grant: Option<u64>,
    ) -> Result<Option<String>, Error> {
        let key = key_of(transfer);
        let granted = grant.map(|bytes| i64::try_from(bytes).unwrap_or(i64::MAX));
        let patch = serde_json::json!({"spec": {"grantedBytesPerSecond": granted}});
        let api: Api<VolumeTransfer> = Api::namespaced(self.context.client.clone(), &key.namespace);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        match api.patch(&key.name, &params, &Patch::Merge(&patch)).await {
            Ok(written) => Ok(written.resource_version()),
            Err(error) if crate::controller::error::is_not_found(&error) => Ok(None),
            Err(source) => Err(kube_error(
                "write the bandwidth grant of",
                "VolumeTransfer",
                key.to_string(),
            )(source)),
        }
    }

    async fn apply_transfer_status(
        &self,
        key: &TransferKey,
        status: &VolumeTransferStatus,
    ) -> Result<Option<String>, Error> {
        let patch = crate::api::status_apply::<VolumeTransfer>(status);
        match crate::controller::backup::patch_transfer_status(
            &self.context.client,
            &key.namespace,
            &key.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        {
            Ok(written) => Ok(written.and_then(|written| written.resource_version())),
            // Refused by the CRD's phase rules: it moved on (canceled,
            // failed) since the cache saw it; the next pass sees that.
            Err(kube::Error::Api(status)) if status.code == 422 => {
                info!(transfer = %key, "admission status refused ({}); it moved on", status.message);
                Ok(None)
            }
            Err(source) => Err(kube_error(
                "apply the admission status of",
                "VolumeTransfer",
                key.to_string(),
            )(source)),
        }
    }

    async fn apply_policy_status(
        &self,
        name: &str,
        status: &StoragePolicyStatus,
    ) -> Result<Option<String>, Error> {
        let api: Api<StoragePolicy> = Api::all(self.context.client.clone());
        let patch = crate::api::status_apply::<StoragePolicy>(status);
        match api
            .patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(written) => Ok(written.resource_version()),
            Err(error) if crate::controller::error::is_not_found(&error) => Ok(None),
            Err(source) => Err(kube_error("apply status of", "StoragePolicy", name)(source)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::admission::{Cap, Hold};

    fn policy_at(name: &str, version: &str) -> Arc<StoragePolicy> {
        let mut policy = StoragePolicy::test(name);
        policy.metadata.resource_version = Some(version.to_string());
        Arc::new(policy)
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

    fn transfer(
        name: &str,
        phase: Option<VolumeTransferPhase>,
        grant: Option<i64>,
    ) -> Arc<VolumeTransfer> {
        let mut transfer: VolumeTransfer = serde_json::from_value(serde_json::json!({
            "apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeTransfer",
            "metadata": {"name": name, "namespace": "shop", "generation": 1},
            "spec": {"direction": "Upload", "pvc": name,
                "backupRef": {"namespace": "ops", "name": "nightly"},
                "storageLocation": {"namespace": "ops", "name": "minio"},
                "stagePod": "stage-a"},
        }))
        .expect("valid transfer");
        transfer.spec.granted_bytes_per_second = grant;
        transfer.status = phase.map(|phase| VolumeTransferStatus {
            phase: Some(phase),
            ..VolumeTransferStatus::default()
        });
        Arc::new(transfer)
    }

    fn key(name: &str) -> TransferKey {
        TransferKey {
            namespace: "shop".to_string(),
            name: name.to_string(),
        }
    }

    fn at(seconds: i64) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(seconds).expect("in range"),
        )
    }

    /// A cache holding `objects`.
    fn store_of<K>(objects: Vec<K>) -> Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = kube::runtime::reflector::store();
        for object in objects {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(object));
        }
        store
    }

    fn from_json<K: serde::de::DeserializeOwned>(value: serde_json::Value) -> K {
        serde_json::from_value(value).expect("valid object")
    }

    #[test]
    fn observed_transfers_get_their_node_location_and_the_policies_of_their_class() {
        let mut with_pod = (*transfer("data", Some(VolumeTransferPhase::Queued), None)).clone();
        with_pod.metadata.creation_timestamp = Some(at(100));
        let mut without_pod = (*transfer("cache", None, None)).clone();
        without_pod.spec.stage_pod = "stage-not-yet".to_string();
        let finished = transfer("old", Some(VolumeTransferPhase::Completed), None);
        let transfers = vec![Arc::new(with_pod), Arc::new(without_pod), finished];
        let pods = store_of(vec![from_json::<Pod>(serde_json::json!({
            "metadata": {"name": "stage-a", "namespace": "shop",
                "annotations": {NODE_ANNOTATION: "node-a.example.internal"}}
        }))]);
        let claims = store_of(vec![from_json::<PersistentVolumeClaim>(
            serde_json::json!({
                "metadata": {"name": "data", "namespace": "shop"},
                "spec": {"storageClassName": "fast"}
            }),
        )]);
        let classes = store_of(vec![from_json::<StorageClass>(serde_json::json!({
            "metadata": {"name": "fast"}, "provisioner": "rbd.csi.ceph.com"
        }))]);
        let policy = |name: &str, spec: serde_json::Value| {
            Arc::new(from_json::<StoragePolicy>(serde_json::json!({
                "apiVersion": "haulage.dev/v1alpha1", "kind": "StoragePolicy",
                "metadata": {"name": name}, "spec": spec
            })))
        };
        let policies = vec![
            policy(
                "by-provisioner",
                serde_json::json!({
                "provisioners": ["rbd.csi.ceph.com"], "maxConcurrentVolumes": 4}),
            ),
            policy(
                "by-name",
                serde_json::json!({
                "storageClassNames": ["fast"], "maxBytesPerSecond": 1048576}),
            ),
            policy("other", serde_json::json!({"storageClassNames": ["slow"]})),
        ];
        let locations = vec![Arc::new(from_json::<BackupStorageLocation>(
            serde_json::json!({
                "apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
                "metadata": {"name": "minio", "namespace": "ops"},
                "spec": {"bucket": "b", "credential": {"name": "s3"}, "maxConcurrentVolumes": 3}
            }),
        ))];
        let caches = Caches {
            transfers: &transfers,
            pods: &pods,
            claims: &claims,
            classes: &classes,
            policies: &policies,
            locations: &locations,
        };
        let (limits, facts) = observe(&caches, Some(16), None);
        assert_eq!(
            facts,
            [TransferFacts {
                key: key("data"),
                created_seconds: 100,
                state: TransferState::Waiting,
                node: Some("node-a.example.internal".to_string()),
                location: Some("ops/minio".to_string()),
                policies: vec!["by-provisioner".to_string(), "by-name".to_string()],
            }],
            "the transfer without a stage pod and the final one are left out"
        );
        assert_eq!(limits.max_volumes, Some(16));
        assert_eq!(limits.policies["by-provisioner"].max_volumes, Some(4));
        assert_eq!(
            limits.policies["by-name"].max_bytes_per_second,
            Some(1048576)
        );
        assert_eq!(limits.locations["ops/minio"].max_volumes, Some(3));
    }

    #[test]
    fn a_running_transfer_whose_pod_is_being_recreated_still_counts_on_its_planned_node() {
        let mut running = (*transfer("data", Some(VolumeTransferPhase::InProgress), None)).clone();
        running.spec.stage_pod = "stage-recreated".to_string();
        running.metadata.annotations =
            Some([(NODE_ANNOTATION.to_string(), "node-b".to_string())].into());
        let transfers = vec![Arc::new(running)];
        let empty_pods = store_of(Vec::<Pod>::new());
        let claims = store_of(Vec::<PersistentVolumeClaim>::new());
        let classes = store_of(Vec::<StorageClass>::new());
        let caches = Caches {
            transfers: &transfers,
            pods: &empty_pods,
            claims: &claims,
            classes: &classes,
            policies: &[],
            locations: &[],
        };
        let (_, facts) = observe(&caches, None, Some(2));
        assert_eq!(facts.len(), 1);
        assert_eq!(facts[0].state, TransferState::Running);
        assert_eq!(facts[0].node.as_deref(), Some("node-b"));
    }

    #[test]
    fn grants_are_lowered_before_admissions_and_raised_after_them() {
        let transfers = vec![
            transfer("lowered", Some(VolumeTransferPhase::InProgress), Some(200)),
            transfer("raised", Some(VolumeTransferPhase::InProgress), Some(50)),
            transfer("new", None, None),
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
        let first = plan_writes(&admission, &[transfer("waiting", None, None)], &[], at(0));
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
        let mut written = (*transfer("waiting", None, None)).clone();
        written.status = Some((**status).clone());
        let again = plan_writes(&admission, &[Arc::new(written)], &[], at(60));
        assert!(again.is_empty(), "{again:?}");
    }
}
