//! The VolumeBackup reconciler: claim → storage location → plan → children
//! → roll-up, and on deletion cancel and clean up (the `haulage.dev/cancel`
//! finalizer). Every step is idempotent and reads the shared caches; the
//! status is computed by [`next_status`] and written with server-side
//! apply. Which event woke the reconciler does not matter.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, info, instrument, warn};

use crate::api::backup::{BackupPlan, OwnerClaim, PlannedStagePod, UnplaceableVolume};
use crate::api::condition::{Condition, ConditionStatus, condition_type, reason};
use crate::api::labels::{CANCEL_FINALIZER, CREDENTIALS_COPY_LABEL, OWNER_UID_LABEL};
use crate::api::transfer::StorageLocationReference;
use crate::api::{
    BackupStorageLocation, BackupStorageLocationPhase, VolumeBackup, VolumeBackupStatus,
    VolumeTransfer, VolumeTransferPhase, VolumeTransferStatus,
};
use crate::controller::children::{Owner, StagePodObjects, desired_stage_pod, desired_transfer};
use crate::controller::error::{Error, is_conflict, is_not_found, kube_error};
use crate::controller::location::{choose_default, now, read_credentials};
use crate::controller::replicas::{self, Liveness};
use crate::controller::stage_pods::{self, Verdict};
use crate::controller::status::{Observed, StorageState, TransferObservation, next_status};
use crate::controller::{Context, FIELD_MANAGER};
use crate::plan::dump::{ClusterObjects, facts_from_objects, node_facts};
use crate::plan::spec::{Operation, StagePodTemplate};
use crate::plan::{LabelSelector, Selection, StagePlan, plan_stage_pods};

/// How often a waiting or running backup is looked at even without events.
const RECHECK_SECONDS: u64 = 15;
/// Least time between two status writes of a backup that change only its
/// progress.
const PROGRESS_WRITE_INTERVAL: Duration = Duration::from_secs(5);

/// When each running backup's status was last written, by UID (this
/// replica's memory; a restart writes at once, which is fine).
#[derive(Debug, Default)]
pub struct ProgressWrites(std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>);

impl ProgressWrites {
    fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, std::time::Instant>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn since_last(&self, uid: &str) -> Option<Duration> {
        self.map().get(uid).map(std::time::Instant::elapsed)
    }

    fn written(&self, uid: &str) {
        self.map()
            .insert(uid.to_string(), std::time::Instant::now());
    }

    fn forget(&self, uid: &str) {
        self.map().remove(uid);
    }
}

/// UIDs of stage pods this replica deleted to replace them: a lagging
/// cache may still show such a pod as running, and it must not be judged
/// (and replaced, and counted) twice. Entries go after an hour.
#[derive(Debug, Default)]
pub struct ReplacedPods(std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>);

impl ReplacedPods {
    const KEEP: Duration = Duration::from_secs(3600);

    fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, std::time::Instant>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn contains(&self, uid: &str) -> bool {
        !uid.is_empty() && self.map().contains_key(uid)
    }

    fn insert(&self, uid: &str) {
        let mut map = self.map();
        map.retain(|_, at| at.elapsed() < Self::KEEP);
        if !uid.is_empty() {
            map.insert(uid.to_string(), std::time::Instant::now());
        }
    }
}

/// How often a backup owned by another replica is checked for adoption
/// (from the cache: no API request unless that replica's lease expired).
const ADOPTION_CHECK_SECONDS: u64 = 20;
/// Upper bound on the cancel cleanup; the finalizer is released after it.
const CLEANUP_TIMEOUT_SECONDS: u64 = 30;

/// Seconds before a backup reconciled while the caches are still listing
/// is looked at again.
const CACHE_SYNC_RETRY_SECONDS: u64 = 1;

/// Reconcile one VolumeBackup through the cancel finalizer.
#[instrument(skip_all, fields(backup = %backup.name_any()))]
pub async fn reconcile(backup: Arc<VolumeBackup>, context: Arc<Context>) -> Result<Action, Error> {
    let namespace = backup.namespace().ok_or(Error::MissingField {
        kind: "VolumeBackup",
        field: "metadata.namespace",
    })?;
    // Every decision below reads the caches: claims and pods for the plan,
    // transfers and stage pods for the children, leases for adoption (an
    // unsynced lease cache makes every replica look gone).
    if !context.readiness.caches_synced() {
        debug!(
            waiting_for = ?context.readiness.problem(),
            "caches still listing; looking again in {CACHE_SYNC_RETRY_SECONDS}s"
        );
        return Ok(Action::requeue(Duration::from_secs(
            CACHE_SYNC_RETRY_SECONDS,
        )));
    }
    let name = format!("{namespace}/{}", backup.name_any());
    let api: Api<VolumeBackup> = Api::namespaced(context.client.clone(), &namespace);
    finalizer(&api, CANCEL_FINALIZER, backup, |event| async {
        match event {
            Event::Apply(backup) => apply(&backup, &context).await,
            Event::Cleanup(backup) => cleanup(&backup, &context).await,
        }
    })
    .await
    .map_err(|source| Error::Finalizer {
        name,
        source: Box::new(source),
    })
}

fn owner_of(backup: &VolumeBackup) -> Result<Owner, Error> {
    let missing = |field| Error::MissingField {
        kind: "VolumeBackup",
        field,
    };
    Ok(Owner {
        namespace: backup.namespace().ok_or(missing("metadata.namespace"))?,
        name: backup
            .metadata
            .name
            .clone()
            .ok_or(missing("metadata.name"))?,
        uid: backup.uid().ok_or(missing("metadata.uid"))?,
    })
}

/// The status apply, conditional on `resource_version` when given.
fn status_patch(status: &VolumeBackupStatus, resource_version: Option<&str>) -> serde_json::Value {
    let mut patch = crate::api::status_apply::<VolumeBackup>(status);
    if let Some(version) = resource_version {
        patch["metadata"] = serde_json::json!({"resourceVersion": version});
    }
    patch
}

async fn apply(backup: &VolumeBackup, context: &Context) -> Result<Action, Error> {
    let owner = owner_of(backup)?;
    let api: Api<VolumeBackup> = Api::namespaced(context.client.clone(), &owner.namespace);
    let old = backup.status.clone().unwrap_or_default();
    let identity = &context.config.identity;

    if old.phase.is_some_and(|phase| phase.is_final()) {
        if !owned_pods(context, &owner).is_empty() {
            release_stage_pods(backup, &owner, context).await?;
        }
        return Ok(Action::await_change());
    }

    // Status writes carry the resourceVersion this replica last saw: a
    // replica acting on a stale cache (back from a network partition after
    // another adopted its backups) gets a conflict instead of taking the
    // backup back.
    let mut resource_version = backup.resource_version();
    let claim = match &old.owner {
        Some(claim) if &claim.replica == identity => {
            if !context
                .heartbeat
                .is_fresh(context.config.replica_lease_seconds)
            {
                warn!(
                    "this replica's lease has not been renewed recently (API server unreachable?); not acting on its backups until it is, since another replica may adopt them"
                );
                return Ok(Action::requeue(Duration::from_secs(5)));
            }
            claim.clone()
        }
        Some(claim) => {
            // Another replica owns it and keeps working on it, unless it
            // stopped renewing its lease: then this one adopts it.
            let leases = replicas::cached(&context.stores.leases);
            let why = match replicas::liveness(
                &claim.replica,
                claim.claimed_at.0.as_second(),
                &leases,
                now().0.as_second(),
            ) {
                Liveness::Alive => {
                    return Ok(Action::requeue(Duration::from_secs(ADOPTION_CHECK_SECONDS)));
                }
                Liveness::Gone { why } => why,
            };
            let adopted = OwnerClaim {
                replica: identity.clone(),
                claimed_at: now(),
                adopted_from: Some(claim.replica.clone()),
            };
            let Some(version) = take_ownership(backup, &api, &owner, &adopted).await? else {
                return Ok(Action::await_change());
            };
            resource_version = version;
            warn!(replica = %identity, previous = %claim.replica, "adopted: {why}");
            context
                .events
                .warning(
                    backup,
                    reason::ADOPTED_FROM_REPLICA,
                    "Adopt",
                    &format!("replica {identity} adopted this backup: {why}"),
                )
                .await;
            adopted
        }
        None => {
            let claimed = OwnerClaim {
                replica: identity.clone(),
                claimed_at: now(),
                adopted_from: None,
            };
            let Some(version) = take_ownership(backup, &api, &owner, &claimed).await? else {
                return Ok(Action::await_change());
            };
            resource_version = version;
            info!(replica = %identity, "claimed");
            context
                .events
                .normal(
                    backup,
                    reason::CLAIMED_BY_REPLICA,
                    "Claim",
                    &format!("claimed by replica {identity}"),
                )
                .await;
            claimed
        }
    };

    let (storage, location) = resolve_location(backup, context);
    // One look at the caches per reconcile: every step below reads the
    // same snapshot of this backup's transfers and stage pods (each lookup
    // scans the cluster-wide cache).
    let children = OwnedChildren::of(context, &owner);
    let plan = match (&old.plan, &storage) {
        (Some(plan), _) => Some(plan.clone()),
        (None, StorageState::Available { .. }) => Some(make_plan(backup, &owner, context)?),
        (None, _) => None,
    };

    if let (Some(plan), Some(location)) = (&plan, &location)
        && !matches!(storage, StorageState::Missing { .. })
    {
        ensure_children(&owner, plan, location, &children, context).await?;
    }
    let backoff = supervise_stage_pods(backup, &children, context).await?;

    let observed = Observed {
        generation: backup.metadata.generation,
        replica: identity.clone(),
        adopted_from: claim.adopted_from.clone(),
        storage,
        fail_after_unavailable_seconds: backup.spec.fail_after_unavailable_seconds,
        plan,
        transfers: children
            .transfers
            .iter()
            .map(|transfer| observe(transfer))
            .collect(),
    };
    let mut status = next_status(&old, &observed, now());
    status.owner = Some(claim);
    // Progress, volume counts and per-volume results are written at most
    // every PROGRESS_WRITE_INTERVAL (each agent reports every 2 s and each
    // volume moves through several phases, so a backup of many volumes
    // would otherwise be rewritten several times a second); a change of
    // phase, condition or plan, and the final status, are written at once.
    let progress_only = {
        let mut without_progress = status.clone();
        without_progress.progress = old.progress.clone();
        without_progress.volumes = old.volumes.clone();
        without_progress.results = old.results.clone();
        // The Progressing condition's message counts volumes; only its
        // status or reason changing matters here.
        let progressing = |status: &VolumeBackupStatus| {
            crate::api::condition::find_condition(&status.conditions, condition_type::PROGRESSING)
                .cloned()
        };
        if let (Some(new), Some(previous)) = (progressing(&without_progress), progressing(&old))
            && new.status == previous.status
            && new.reason == previous.reason
        {
            for condition in &mut without_progress.conditions {
                if condition.type_ == condition_type::PROGRESSING {
                    *condition = previous.clone();
                }
            }
        }
        without_progress == old
    };
    let mut progress_wait = None;
    if status != old {
        let since_last = context.progress_writes.since_last(&owner.uid);
        match since_last {
            Some(elapsed) if progress_only && elapsed < PROGRESS_WRITE_INTERVAL => {
                progress_wait = Some(PROGRESS_WRITE_INTERVAL - elapsed);
            }
            _ => {
                api.patch_status(
                    &owner.name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(status_patch(&status, resource_version.as_deref())),
                )
                .await
                .map_err(kube_error(
                    "apply status of",
                    "VolumeBackup",
                    &owner.name,
                ))?;
                context.progress_writes.written(&owner.uid);
            }
        }
    }
    if let Some(phase) = status.phase.filter(|phase| phase.is_final())
        && old.phase != Some(phase)
    {
        let note = status
            .message
            .clone()
            .unwrap_or_else(|| format!("{phase:?}"));
        let counts = status.volumes.clone().unwrap_or_default();
        let note = format!(
            "{note} ({} of {} volumes completed, {} failed)",
            counts.completed, counts.total, counts.failed
        );
        if phase == crate::api::VolumeBackupPhase::Completed {
            context
                .events
                .normal(backup, "Completed", "Finish", &note)
                .await;
        } else {
            context
                .events
                .warning(backup, &format!("{phase:?}"), "Finish", &note)
                .await;
        }
    }
    if status.phase.is_some_and(|phase| phase.is_final()) {
        context.progress_writes.forget(&owner.uid);
        info!(phase = ?status.phase, "backup finished");
        release_stage_pods(backup, &owner, context).await?;
        return Ok(Action::await_change());
    }
    let recheck = Duration::from_secs(RECHECK_SECONDS);
    let soonest = [backoff, progress_wait].into_iter().flatten().min();
    Ok(Action::requeue(soonest.map_or(recheck, |wait| {
        wait.min(recheck).max(Duration::from_secs(1))
    })))
}

/// Write `claim` as the backup's owner, on the condition that the backup
/// did not change since it was read (a resourceVersion precondition): of
/// two replicas racing to claim or adopt it, exactly one wins. `false` when
/// this one lost, else the backup's new resourceVersion.
async fn take_ownership(
    backup: &VolumeBackup,
    api: &Api<VolumeBackup>,
    owner: &Owner,
    claim: &OwnerClaim,
) -> Result<Option<Option<String>>, Error> {
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": backup.resource_version()},
        "status": {"owner": claim},
    });
    match api
        .patch_status(&owner.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(written) => Ok(Some(written.resource_version())),
        Err(error) if is_conflict(&error) => {
            info!("another replica claimed it first, or it changed; moving on");
            Ok(None)
        }
        Err(source) => Err(kube_error("claim", "VolumeBackup", &owner.name)(source)),
    }
}

fn observe(transfer: &VolumeTransfer) -> TransferObservation {
    let status = transfer.status.clone().unwrap_or_default();
    TransferObservation {
        namespace: transfer.namespace().unwrap_or_default(),
        pvc: transfer.spec.pvc.clone(),
        phase: status.phase.unwrap_or(VolumeTransferPhase::New),
        progress: status.progress,
        snapshot_id: status.snapshot_id,
        message: status.message,
    }
}

/// The storage location a backup names (or the default one) and its state.
fn resolve_location(
    backup: &VolumeBackup,
    context: &Context,
) -> (StorageState, Option<Arc<BackupStorageLocation>>) {
    let namespace = backup.namespace().unwrap_or_default();
    let candidates: Vec<_> = context
        .stores
        .locations
        .state()
        .into_iter()
        .filter(|location| location.namespace().as_deref() == Some(namespace.as_str()))
        .collect();
    // Several `default: true` locations: the same rule as their conditions.
    let wanted_name = match &backup.spec.storage_location {
        Some(name) => Some(name.clone()),
        None => choose_default(candidates.iter().map(|location| location.as_ref()))
            .map(|choice| choice.winner),
    };
    let found = wanted_name.and_then(|wanted| {
        candidates
            .into_iter()
            .find(|location| location.metadata.name.as_deref() == Some(wanted.as_str()))
    });
    let wanted = backup
        .spec
        .storage_location
        .clone()
        .unwrap_or_else(|| "(the default)".to_string());
    let Some(location) = found else {
        return (StorageState::Missing { name: wanted }, None);
    };
    let name = location.name_any();
    let status = location.status.clone().unwrap_or_default();
    let state = if status.phase == Some(BackupStorageLocationPhase::Available) {
        StorageState::Available { name }
    } else {
        StorageState::Unavailable {
            name,
            message: status
                .message
                .unwrap_or_else(|| "not validated yet".to_string()),
        }
    };
    (state, Some(location))
}

/// The claim selection of a backup.
fn selection_of(backup: &VolumeBackup) -> Result<Selection, Error> {
    let invalid = |message: String| Error::Selector {
        name: backup.name_any(),
        message,
    };
    let mut labels = LabelSelector::default();
    if let Some(selector) = &backup.spec.selector {
        use crate::plan::selector::LabelRequirement;
        for (key, value) in selector.match_labels.clone().unwrap_or_default() {
            labels
                .requirements
                .push(LabelRequirement::Equals(key, value));
        }
        for expression in selector.match_expressions.clone().unwrap_or_default() {
            let values = expression.values.unwrap_or_default();
            let requirement = match expression.operator.as_str() {
                "In" => LabelRequirement::In(expression.key, values),
                "NotIn" => LabelRequirement::NotIn(expression.key, values),
                "Exists" => LabelRequirement::Exists(expression.key),
                "DoesNotExist" => LabelRequirement::DoesNotExist(expression.key),
                other => return Err(invalid(format!("unknown operator {other:?}"))),
            };
            labels.requirements.push(requirement);
        }
    }
    Ok(Selection {
        namespaces: backup.spec.namespaces.iter().cloned().collect(),
        labels,
    })
}

fn template_of(owner: &Owner, context: &Context) -> StagePodTemplate {
    let mut template = StagePodTemplate::new(
        Operation::Backup,
        &owner.namespace,
        &owner.name,
        &context.config.agent_image,
    );
    template.pinning = context.config.pinning;
    template
}

/// Plan from the caches: only the backup's namespaces (one malformed
/// object elsewhere must not stop this backup), without haulage's own pods.
fn make_plan(backup: &VolumeBackup, owner: &Owner, context: &Context) -> Result<BackupPlan, Error> {
    let selection = selection_of(backup)?;
    let in_scope = |namespace: Option<String>| {
        namespace.is_some_and(|namespace| selection.namespaces.contains(&namespace))
    };
    let stores = &context.stores;
    let objects = ClusterObjects {
        nodes: stores.nodes.state().iter().map(|n| (**n).clone()).collect(),
        csi_nodes: Vec::new(),
        pods: stores
            .pods
            .state()
            .iter()
            .filter(|pod| in_scope(pod.namespace()))
            .filter(|pod| {
                pod.labels()
                    .get(crate::api::labels::MANAGED_BY_LABEL)
                    .map(String::as_str)
                    != Some(crate::api::labels::MANAGED_BY)
            })
            .map(|pod| (**pod).clone())
            .collect(),
        claims: stores
            .claims
            .state()
            .iter()
            .filter(|claim| in_scope(claim.namespace()))
            .map(|claim| (**claim).clone())
            .collect(),
        volumes: stores
            .volumes
            .state()
            .iter()
            .map(|v| (**v).clone())
            .collect(),
        storage_classes: stores
            .classes
            .state()
            .iter()
            .map(|c| (**c).clone())
            .collect(),
        limit_ranges: Vec::new(),
    };
    let facts = facts_from_objects(&objects).map_err(|source| Error::Facts { source })?;
    let plan = plan_stage_pods(&facts, &selection).map_err(|source| Error::Plan { source })?;
    Ok(backup_plan(&plan, &template_of(owner, context)))
}

/// The planner's output in the VolumeBackup status shape, with pod names.
fn backup_plan(plan: &StagePlan, template: &StagePodTemplate) -> BackupPlan {
    BackupPlan {
        stage_pods: plan
            .stage_pods
            .iter()
            .map(|pod| PlannedStagePod {
                namespace: pod.namespace.clone(),
                node: pod.node.clone(),
                pod_name: Some(crate::plan::spec::stage_pod_name(template, pod)),
                volumes: pod.volumes.clone(),
                bytes: i64::try_from(pod.bytes).unwrap_or(i64::MAX),
            })
            .collect(),
        unplaceable: plan
            .unplaceable
            .iter()
            .map(|claim| UnplaceableVolume {
                namespace: claim.namespace.clone(),
                pvc: claim.pvc.clone(),
                reason: crate::api::condition::bounded_message(&claim.reason.to_string()),
            })
            .collect(),
    }
}

/// A backup's transfers and stage pods, as the caches show them now.
struct OwnedChildren {
    transfers: Vec<Arc<VolumeTransfer>>,
    pods: Vec<Arc<Pod>>,
}

impl OwnedChildren {
    fn of(context: &Context, owner: &Owner) -> Self {
        OwnedChildren {
            transfers: owned_transfers(context, owner),
            pods: owned_pods(context, owner),
        }
    }
}

fn owned_transfers(context: &Context, owner: &Owner) -> Vec<Arc<VolumeTransfer>> {
    context.stores.transfers.state_filter(|transfer| {
        transfer.labels().get(OWNER_UID_LABEL) == Some(&owner.uid)
            || transfer.spec.backup_ref.uid.as_deref() == Some(owner.uid.as_str())
    })
}

fn owned_pods(context: &Context, owner: &Owner) -> Vec<Arc<Pod>> {
    context
        .stores
        .pods
        .state_filter(|pod| pod.labels().get(OWNER_UID_LABEL) == Some(&owner.uid))
}

async fn server_side_apply<K>(api: &Api<K>, object: &K, kind: &'static str) -> Result<K, Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .map_err(kube_error("apply", kind, name))
}

/// Create what the plan needs and the caches do not show yet. A stage pod
/// in the cache means its ServiceAccount, Role, binding, credentials copy
/// and transfers were made before it (they are made in that order).
async fn ensure_children(
    owner: &Owner,
    plan: &BackupPlan,
    location: &BackupStorageLocation,
    children: &OwnedChildren,
    context: &Context,
) -> Result<(), Error> {
    let template = template_of(owner, context);
    let location_reference = StorageLocationReference {
        namespace: location.namespace().unwrap_or_default(),
        name: location.name_any(),
    };
    let existing_pods: BTreeSet<(String, String)> = children
        .pods
        .iter()
        .map(|pod| (pod.namespace().unwrap_or_default(), pod.name_any()))
        .collect();
    let transfers = &children.transfers;
    let nodes = context.stores.nodes.state();
    let mut credentials: Option<BTreeMap<String, ByteString>> = None;
    for planned in &plan.stage_pods {
        let node = nodes
            .iter()
            .find(|node| node.metadata.name.as_deref() == Some(planned.node.as_str()))
            .and_then(|node| node_facts(node, None).ok());
        let objects = desired_stage_pod(owner, &template, planned, node.as_ref(), &location.spec);
        let pod_name = objects.pod.name_any();
        if existing_pods.contains(&(planned.namespace.clone(), pod_name.clone())) {
            continue;
        }
        // A pod stopped because its volumes failed is not made again.
        let of_pod: Vec<_> = transfers
            .iter()
            .filter(|transfer| {
                transfer.spec.stage_pod == pod_name
                    && transfer.namespace().as_deref() == Some(planned.namespace.as_str())
            })
            .collect();
        if !of_pod.is_empty()
            && of_pod.len() >= planned.volumes.len()
            && of_pod
                .iter()
                .all(|transfer| transfer_phase(transfer).is_some_and(VolumeTransferPhase::is_final))
        {
            continue;
        }
        if credentials.is_none() {
            credentials = Some(credentials_data(location, context).await?);
        }
        let data = credentials.clone().unwrap_or_default();
        create_stage_pod(owner, &objects, &location_reference, planned, data, context).await?;
    }
    Ok(())
}

/// The bytes of the location's credentials key, to copy.
async fn credentials_data(
    location: &BackupStorageLocation,
    context: &Context,
) -> Result<BTreeMap<String, ByteString>, Error> {
    let namespace = location.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), &namespace);
    match read_credentials(&secrets, &location.spec).await? {
        Ok((secret, _)) => {
            let key = &location.spec.credential.key;
            let value = secret
                .data
                .and_then(|mut data| data.remove(key))
                .unwrap_or_default();
            let mut data = BTreeMap::from([(key.clone(), value)]);
            if let Some(pem) = &location.spec.ca_bundle {
                data.insert(
                    crate::controller::children::CA_BUNDLE_KEY.to_string(),
                    ByteString(pem.clone().into_bytes()),
                );
            }
            Ok(data)
        }
        Err(message) => Err(Error::Credentials {
            location: location.name_any(),
            message,
        }),
    }
}

async fn create_stage_pod(
    owner: &Owner,
    objects: &StagePodObjects,
    location: &StorageLocationReference,
    planned: &PlannedStagePod,
    credentials: BTreeMap<String, ByteString>,
    context: &Context,
) -> Result<(), Error> {
    let client = &context.client;
    let namespace = planned.namespace.as_str();
    let pod_name = objects.pod.name_any();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    server_side_apply(&accounts, &objects.service_account, "ServiceAccount").await?;
    let roles: Api<Role> = Api::namespaced(client.clone(), namespace);
    let role = server_side_apply(&roles, &objects.role, "Role").await?;
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    server_side_apply(&bindings, &objects.role_binding, "RoleBinding").await?;

    // Owned by the Role (same namespace, made by us before the pod), so the
    // copy goes when the Role goes, and exists before the pod that mounts it.
    let mut labels = owner.labels();
    labels.insert(CREDENTIALS_COPY_LABEL.to_string(), "true".to_string());
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(objects.credentials_secret.clone()),
            namespace: Some(namespace.to_string()),
            labels: Some(labels),
            owner_references: role.uid().map(|uid| {
                vec![OwnerReference {
                    api_version: "rbac.authorization.k8s.io/v1".to_string(),
                    kind: "Role".to_string(),
                    name: role.name_any(),
                    uid,
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        },
        data: Some(credentials),
        ..Secret::default()
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {}
        Err(error) if is_conflict(&error) => {}
        Err(source) => {
            return Err(kube_error("create", "Secret", &objects.credentials_secret)(
                source,
            ));
        }
    }

    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), namespace);
    for pvc in &planned.volumes {
        let transfer = desired_transfer(owner, location, &pod_name, &planned.node, namespace, pvc);
        server_side_apply(&transfers, &transfer, "VolumeTransfer").await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    server_side_apply(&pods, &objects.pod, "Pod").await?;
    info!(pod = %pod_name, namespace, volumes = planned.volumes.len(), "stage pod created");
    Ok(())
}

/// Supervise the backup's stage pods ([`stage_pods::verdict`]): recreate a
/// failed one after its backoff, fail the open volumes of one that cannot
/// work, and delete a pod whose volumes are all final but which did not
/// finish (so a crash-looping agent stops). Returns when to look again,
/// if a backoff is running.
async fn supervise_stage_pods(
    backup: &VolumeBackup,
    children: &OwnedChildren,
    context: &Context,
) -> Result<Option<Duration>, Error> {
    let transfers = &children.transfers;
    let mut next_look: Option<Duration> = None;
    for pod in children.pods.iter().cloned() {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_name = pod.name_any();
        let of_pod: Vec<&Arc<VolumeTransfer>> = transfers
            .iter()
            .filter(|transfer| {
                transfer.spec.stage_pod == pod_name
                    && transfer.namespace().as_deref() == Some(namespace.as_str())
            })
            .collect();
        let open: Vec<&Arc<VolumeTransfer>> = of_pod
            .iter()
            .copied()
            .filter(|transfer| !transfer_phase(transfer).is_some_and(VolumeTransferPhase::is_final))
            .collect();
        let pods: Api<Pod> = Api::namespaced(context.client.clone(), &namespace);
        let finished = pod
            .status
            .as_ref()
            .and_then(|status| status.phase.as_deref())
            == Some("Succeeded");
        if open.is_empty() {
            if !of_pod.is_empty() && !finished && pod.metadata.deletion_timestamp.is_none() {
                info!(pod = %pod_name, namespace, "every volume of this stage pod is final; stopping it");
                delete_named(&pods, &pod_name, "Pod").await?;
            }
            continue;
        }
        // A pod on its way out was judged already (by this replica, even if
        // the cache does not show its deletion yet); its replacement is
        // judged once it exists.
        let pod_uid = pod.uid().unwrap_or_default();
        if pod.metadata.deletion_timestamp.is_some() || context.replaced_pods.contains(&pod_uid) {
            continue;
        }
        let attempts = of_pod
            .iter()
            .filter_map(|transfer| transfer.status.as_ref().and_then(|status| status.attempts))
            .max()
            .unwrap_or(0);
        let heartbeats: Vec<i64> = open
            .iter()
            .filter(|transfer| transfer_phase(transfer) == Some(VolumeTransferPhase::InProgress))
            .filter_map(|transfer| {
                let agent = transfer.status.as_ref()?.agent.as_ref()?;
                Some(agent.heartbeat_time.0.as_second())
            })
            .collect();
        let time = now().0.as_second();
        let verdict = match stage_pods::verdict(&pod, attempts, time) {
            Verdict::Healthy => stage_pods::lost_agent(
                &pod,
                &heartbeats,
                attempts,
                time,
                context.config.agent_lost_seconds,
            )
            .unwrap_or(Verdict::Healthy),
            other => other,
        };
        match verdict {
            Verdict::Healthy => {}
            Verdict::Fail { message } => {
                warn!(pod = %pod_name, namespace, "{message}");
                context
                    .events
                    .warning(
                        backup,
                        reason::STAGE_POD_FAILED,
                        "SuperviseStagePod",
                        &message,
                    )
                    .await;
                for transfer in open {
                    fail_transfer(transfer, &message, context).await?;
                }
            }
            Verdict::Recreate {
                attempt,
                after_seconds,
                message,
            } => {
                if after_seconds > 0 {
                    let wait = Duration::from_secs(after_seconds.unsigned_abs());
                    next_look = Some(next_look.map_or(wait, |other| other.min(wait)));
                    continue;
                }
                warn!(pod = %pod_name, namespace, attempt, "{message}; creating it again");
                context
                    .events
                    .warning(
                        backup,
                        "StagePodRecreated",
                        "SuperviseStagePod",
                        &format!(
                            "{message}; creating it again (attempt {attempt} of {})",
                            stage_pods::MAX_POD_ATTEMPTS
                        ),
                    )
                    .await;
                for transfer in &of_pod {
                    record_attempts(transfer, attempt - 1, context).await?;
                }
                context.replaced_pods.insert(&pod_uid);
                delete_named(&pods, &pod_name, "Pod").await?;
            }
        }
    }
    Ok(next_look)
}

fn transfer_phase(transfer: &VolumeTransfer) -> Option<VolumeTransferPhase> {
    transfer.status.as_ref().and_then(|status| status.phase)
}

/// Fail one open transfer with a stage pod's reason.
async fn fail_transfer(
    transfer: &VolumeTransfer,
    message: &str,
    context: &Context,
) -> Result<(), Error> {
    let status = VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::Failed),
        message: Some(crate::api::condition::bounded_message(message)),
        completion_time: Some(now()),
        conditions: vec![Condition::new(
            condition_type::FAILED,
            ConditionStatus::True,
            reason::STAGE_POD_FAILED,
            message,
            transfer.metadata.generation,
            now(),
        )],
        ..VolumeTransferStatus::default()
    };
    write_transfer_status(transfer, &status, context).await
}

/// Record on a transfer how many stage pods were made for it before the
/// next one (survives the pod's deletion; the agent does not write it).
async fn record_attempts(
    transfer: &VolumeTransfer,
    attempts: i32,
    context: &Context,
) -> Result<(), Error> {
    let patch = serde_json::json!({"status": {"attempts": attempts}});
    patch_status_of(
        transfer,
        &PatchParams::default(),
        &Patch::Merge(&patch),
        "record attempts on",
        context,
    )
    .await
}

/// [`patch_transfer_status`] of `transfer`, a failure naming `action` and
/// the transfer.
async fn patch_status_of<P: Serialize + std::fmt::Debug>(
    transfer: &VolumeTransfer,
    params: &PatchParams,
    patch: &Patch<P>,
    action: &'static str,
    context: &Context,
) -> Result<(), Error> {
    patch_transfer_status(
        &context.client,
        &transfer.namespace().unwrap_or_default(),
        &transfer.name_any(),
        params,
        patch,
    )
    .await
    .map(|_| ())
    .map_err(kube_error(
        action,
        "VolumeTransfer",
        transfer_reference(transfer),
    ))
}

/// `namespace/name` of a transfer, for errors.
fn transfer_reference(transfer: &VolumeTransfer) -> String {
    format!(
        "{}/{}",
        transfer.namespace().unwrap_or_default(),
        transfer.name_any()
    )
}

/// Patch a transfer's status; `Ok(None)` when the transfer is gone (its
/// backup was deleted meanwhile), which every status writer treats as
/// nothing left to do.
pub(crate) async fn patch_transfer_status<P: Serialize + std::fmt::Debug>(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Option<VolumeTransfer>, kube::Error> {
    let api: Api<VolumeTransfer> = Api::namespaced(client.clone(), namespace);
    match api.patch_status(name, params, patch).await {
        Ok(written) => Ok(Some(written)),
        Err(error) if is_not_found(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

async fn write_transfer_status(
    transfer: &VolumeTransfer,
    status: &VolumeTransferStatus,
    context: &Context,
) -> Result<(), Error> {
    let patch = crate::api::status_apply::<VolumeTransfer>(status);
    patch_status_of(
        transfer,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
        "apply status of",
        context,
    )
    .await
}

/// Delete one object by name; a missing one is already gone.
async fn delete_named<K>(api: &Api<K>, name: &str, kind: &'static str) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) => Ok(()),
        Err(source) => Err(kube_error("delete", kind, name)(source)),
    }
}

/// Delete the stage pods, their Roles, bindings and credentials copies
/// (the transfers stay: they carry the per-volume results). Deletes by
/// name (from the plan and the pod cache): the controller's RBAC has no
/// `deletecollection`, and Secrets outside its namespace it may only
/// create and delete.
async fn release_stage_pods(
    backup: &VolumeBackup,
    owner: &Owner,
    context: &Context,
) -> Result<(), Error> {
    let plan = backup
        .status
        .as_ref()
        .and_then(|status| status.plan.clone())
        .unwrap_or_default();
    let mut pods: BTreeSet<(String, String)> = plan
        .stage_pods
        .iter()
        .filter_map(|pod| {
            pod.pod_name
                .clone()
                .map(|name| (pod.namespace.clone(), name))
        })
        .collect();
    pods.extend(
        owned_pods(context, owner)
            .iter()
            .map(|pod| (pod.namespace().unwrap_or_default(), pod.name_any())),
    );
    for (namespace, name) in pods {
        let client = context.client.clone();
        delete_named(
            &Api::<Pod>::namespaced(client.clone(), &namespace),
            &name,
            "Pod",
        )
        .await?;
        delete_named(
            &Api::<RoleBinding>::namespaced(client.clone(), &namespace),
            &name,
            "RoleBinding",
        )
        .await?;
        delete_named(
            &Api::<Role>::namespaced(client.clone(), &namespace),
            &name,
            "Role",
        )
        .await?;
        delete_named(
            &Api::<Secret>::namespaced(client, &namespace),
            &crate::controller::children::credentials_copy_name(&name),
            "Secret",
        )
        .await?;
    }
    Ok(())
}

/// Cancel: mark open transfers Canceled (agents watching them stop and
/// abort their uploads), delete stage pods, credentials copies and the
/// transfers. Bounded: after [`CLEANUP_TIMEOUT_SECONDS`] the finalizer is
/// released anyway, with a warning naming what may be left.
async fn cleanup(backup: &VolumeBackup, context: &Context) -> Result<Action, Error> {
    let owner = owner_of(backup)?;
    context.progress_writes.forget(&owner.uid);
    let work = async {
        for transfer in owned_transfers(context, &owner) {
            let phase = transfer.status.as_ref().and_then(|status| status.phase);
            if phase.is_some_and(VolumeTransferPhase::is_final) {
                continue;
            }
            let status = VolumeTransferStatus {
                phase: Some(VolumeTransferPhase::Canceled),
                message: Some("its VolumeBackup was deleted".to_string()),
                completion_time: Some(now()),
                ..VolumeTransferStatus::default()
            };
            write_transfer_status(&transfer, &status, context).await?;
        }
        release_stage_pods(backup, &owner, context).await?;
        for transfer in owned_transfers(context, &owner) {
            let namespace = transfer.namespace().unwrap_or_default();
            let transfers: Api<VolumeTransfer> =
                Api::namespaced(context.client.clone(), &namespace);
            delete_named(&transfers, &transfer.name_any(), "VolumeTransfer").await?;
        }
        Ok::<(), Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(CLEANUP_TIMEOUT_SECONDS), work).await {
        Ok(result) => result?,
        Err(_) => warn!(
            selector = %owner.selector(),
            "cleanup did not finish in {CLEANUP_TIMEOUT_SECONDS}s; releasing the finalizer, objects with this label may remain"
        ),
    }
    info!("canceled and cleaned up");
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::output::UnplaceableReason;

    #[test]
    fn the_status_plan_names_each_stage_pod_and_keeps_reasons() {
        let template = StagePodTemplate::new(Operation::Backup, "ops", "nightly", "agent:dev");
        let plan = StagePlan {
            stage_pods: vec![crate::plan::StagePod {
                namespace: "shop".to_string(),
                node: "node-a".to_string(),
                volumes: vec!["data".to_string()],
                bytes: 42,
            }],
            unplaceable: vec![crate::plan::UnplaceableClaim {
                namespace: "shop".to_string(),
                pvc: "cache".to_string(),
                reason: UnplaceableReason::ClaimPending,
            }],
        };
        let status_plan = backup_plan(&plan, &template);
        assert_eq!(status_plan.stage_pods[0].bytes, 42);
        assert!(
            status_plan.stage_pods[0]
                .pod_name
                .as_deref()
                .is_some_and(|name| name.starts_with("haulage-backup-nightly-node-a-"))
        );
        assert!(status_plan.unplaceable[0].reason.contains("Pending"));
    }
}
