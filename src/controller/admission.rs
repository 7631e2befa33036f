//! The admission loop: on the replica holding the admission lease
//! ([`crate::controller::lease`]), it reads every open VolumeTransfer from
//! the shared cache, turns the caches into [`admit`]'s input ([`observe`])
//! and makes the writes [`plan_writes`] returns: lowered grants first, then
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

use crate::api::labels::NODE_ANNOTATION;
use crate::api::{
    BackupStorageLocation, StoragePolicy, StoragePolicyStatus, VolumeTransfer, VolumeTransferPhase,
    VolumeTransferStatus,
};
use crate::clock::now;
use crate::controller::error::{ApiCall, Error, kube_error};
use crate::controller::lease::Leadership;
use crate::controller::{Context, FIELD_MANAGER};
use crate::reconcile::action::ObjectName;
use crate::reconcile::admission::{
    Limits, LocationLimits, PolicyLimits, PolicyReads, TransferFacts, TransferKey, TransferState,
    Write, admit, is_older, plan_writes,
};
use crate::reconcile::stage_pod::volumes_at_once_of;

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
    let mut limits = Limits {
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
        stage_pods: BTreeMap::new(),
    };
    let mut facts = Vec::new();
    for transfer in caches.transfers {
        let phase = transfer.phase();
        let state = match phase {
            VolumeTransferPhase::New | VolumeTransferPhase::Queued => TransferState::Waiting,
            VolumeTransferPhase::Admitted
            | VolumeTransferPhase::InProgress
            | VolumeTransferPhase::Finalizing => TransferState::Running,
            VolumeTransferPhase::Completed
            | VolumeTransferPhase::Failed
            | VolumeTransferPhase::Canceled => continue,
        };
        let key = TransferKey::of(transfer);
        let pod = caches
            .pods
            .get(&ObjectRef::new(&transfer.spec.stage_pod).within(&key.namespace));
        if pod.is_none() && state == TransferState::Waiting {
            continue;
        }
        let stage_pod = format!("{}/{}", key.namespace, transfer.spec.stage_pod);
        if let Some(pod) = &pod {
            limits
                .stage_pods
                .insert(stage_pod.clone(), volumes_at_once_of(pod));
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
            claim: format!("{}/{}", key.namespace, transfer.spec.pvc),
            stage_pod,
            owner: format!(
                "{} {}/{}",
                match transfer.spec.direction {
                    crate::api::TransferDirection::Upload => "VolumeBackup",
                    crate::api::TransferDirection::Download => "VolumeRestore",
                },
                transfer.spec.backup_ref.namespace,
                transfer.spec.backup_ref.name
            ),
            key,
        });
    }
    (limits, facts)
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
        let admits = admission.decisions.values().any(|decision| {
            matches!(
                decision,
                crate::reconcile::admission::Decision::Admit { .. }
            )
        });
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
            .map(|transfer| (TransferKey::of(transfer), transfer))
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
        let listed = api
            .list(&ListParams::default())
            .await
            .map_err(kube_error(ApiCall::ListPolicies, "(all)"))?;
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
        let key = TransferKey::of(transfer);
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
            Err(source) => Err(kube_error(ApiCall::WriteGrant, key.to_string())(source)),
        }
    }

    async fn apply_transfer_status(
        &self,
        key: &TransferKey,
        status: &VolumeTransferStatus,
    ) -> Result<Option<String>, Error> {
        let patch = crate::api::status_apply::<VolumeTransfer>(status);
        match crate::controller::execute::patch_status::<VolumeTransfer, _>(
            &self.context.client,
            &ObjectName::new(&key.namespace, &key.name),
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
            Err(source) => Err(kube_error(ApiCall::WriteAdmission, key.to_string())(source)),
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
            Err(source) => Err(kube_error(ApiCall::WritePolicyStatus, name)(source)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                claim: "shop/data".to_string(),
                stage_pod: "shop/stage-a".to_string(),
                owner: "VolumeBackup ops/nightly".to_string(),
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
}
