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
use tracing::{info, instrument, warn};

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
use crate::controller::location::{now, read_credentials};
use crate::controller::status::{Observed, StorageState, TransferObservation, next_status};
use crate::controller::{Context, FIELD_MANAGER};
use crate::plan::dump::{ClusterObjects, facts_from_objects, node_facts};
use crate::plan::spec::{Operation, StagePodTemplate};
use crate::plan::{LabelSelector, Selection, StagePlan, plan_stage_pods};

/// How often a waiting or running backup is looked at even without events.
const RECHECK_SECONDS: u64 = 15;
/// Upper bound on the cancel cleanup; the finalizer is released after it.
const CLEANUP_TIMEOUT_SECONDS: u64 = 30;

/// Reconcile one VolumeBackup through the cancel finalizer.
#[instrument(skip_all, fields(backup = %backup.name_any()))]
pub async fn reconcile(backup: Arc<VolumeBackup>, context: Arc<Context>) -> Result<Action, Error> {
    let namespace = backup.namespace().ok_or(Error::MissingField {
        kind: "VolumeBackup",
        field: "metadata.namespace",
    })?;
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

fn status_patch(status: &VolumeBackupStatus) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        "kind": "VolumeBackup",
        "status": status,
    })
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

    match &old.owner {
        Some(claim) if &claim.replica != identity => {
            // Another replica owns it; it keeps working on it.
            return Ok(Action::await_change());
        }
        Some(_) => {}
        None => {
            let claim = serde_json::json!({
                "metadata": {"resourceVersion": backup.resource_version()},
                "status": {
                    "owner": OwnerClaim { replica: identity.clone(), claimed_at: now() },
                },
            });
            match api
                .patch_status(&owner.name, &PatchParams::default(), &Patch::Merge(&claim))
                .await
            {
                Ok(_) => info!(replica = %identity, "claimed"),
                Err(error) if is_conflict(&error) => {
                    info!("another replica claimed it first, or it changed; moving on");
                    return Ok(Action::await_change());
                }
                Err(source) => {
                    return Err(kube_error("claim", "VolumeBackup", &owner.name)(source));
                }
            }
        }
    }

    let (storage, location) = resolve_location(backup, context);
    let plan = match (&old.plan, &storage) {
        (Some(plan), _) => Some(plan.clone()),
        (None, StorageState::Available { .. }) => Some(make_plan(backup, &owner, context)?),
        (None, _) => None,
    };

    if let (Some(plan), Some(location)) = (&plan, &location)
        && !matches!(storage, StorageState::Missing { .. })
    {
        ensure_children(&owner, plan, location, context).await?;
    }
    fail_transfers_of_failed_pods(&owner, context).await?;

    let observed = Observed {
        generation: backup.metadata.generation,
        replica: identity.clone(),
        storage,
        fail_after_unavailable_seconds: backup.spec.fail_after_unavailable_seconds,
        plan,
        transfers: owned_transfers(context, &owner)
            .iter()
            .map(|transfer| observe(transfer))
            .collect(),
    };
    let mut status = next_status(&old, &observed, now());
    status.owner = old.owner.clone().or_else(|| {
        Some(OwnerClaim {
            replica: identity.clone(),
            claimed_at: now(),
        })
    });
    if status != old {
        api.patch_status(
            &owner.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(status_patch(&status)),
        )
        .await
        .map_err(kube_error("apply status of", "VolumeBackup", &owner.name))?;
    }
    if status.phase.is_some_and(|phase| phase.is_final()) {
        info!(phase = ?status.phase, "backup finished");
        release_stage_pods(backup, &owner, context).await?;
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(Duration::from_secs(RECHECK_SECONDS)))
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
    let candidates = context.stores.locations.state();
    let found = candidates.into_iter().find(|location| {
        location.namespace().as_deref() == Some(namespace.as_str())
            && match &backup.spec.storage_location {
                Some(name) => location.metadata.name.as_deref() == Some(name.as_str()),
                None => location.spec.is_default,
            }
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
    context: &Context,
) -> Result<(), Error> {
    let template = template_of(owner, context);
    let location_reference = StorageLocationReference {
        namespace: location.namespace().unwrap_or_default(),
        name: location.name_any(),
    };
    let existing_pods: BTreeSet<(String, String)> = owned_pods(context, owner)
        .iter()
        .map(|pod| (pod.namespace().unwrap_or_default(), pod.name_any()))
        .collect();
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
            Ok(BTreeMap::from([(key.clone(), value)]))
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
        let transfer = desired_transfer(owner, location, &pod_name, namespace, pvc);
        server_side_apply(&transfers, &transfer, "VolumeTransfer").await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    server_side_apply(&pods, &objects.pod, "Pod").await?;
    info!(pod = %pod_name, namespace, volumes = planned.volumes.len(), "stage pod created");
    Ok(())
}

/// Why a stage pod failed, when it did: the kubelet gave up on it (phase
/// Failed), with the container's exit code, reason and termination message
/// (its last log lines, `FallbackToLogsOnError`).
pub fn stage_pod_failure(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Failed") {
        return None;
    }
    let name = pod.metadata.name.as_deref().unwrap_or("<unnamed>");
    let terminated = status
        .container_statuses
        .iter()
        .flatten()
        .find_map(|container| container.state.as_ref()?.terminated.clone());
    let detail = match terminated {
        Some(state) => {
            let mut detail = format!("exit code {}", state.exit_code);
            if let Some(reason) = state.reason.filter(|reason| !reason.is_empty()) {
                detail.push_str(&format!(" ({reason})"));
            }
            if let Some(message) = state.message.filter(|message| !message.is_empty()) {
                let last = message.lines().last().unwrap_or_default().to_string();
                detail.push_str(&format!(": {last}"));
            }
            detail
        }
        None => status
            .message
            .clone()
            .or_else(|| status.reason.clone())
            .unwrap_or_else(|| "no reason given".to_string()),
    };
    Some(format!("stage pod {name} failed: {detail}"))
}

/// Fail the open transfers of stage pods the kubelet gave up on, so the
/// backup ends with the pod's reason instead of waiting forever.
async fn fail_transfers_of_failed_pods(owner: &Owner, context: &Context) -> Result<(), Error> {
    for pod in owned_pods(context, owner) {
        let Some(message) = stage_pod_failure(&pod) else {
            continue;
        };
        let namespace = pod.namespace().unwrap_or_default();
        for transfer in owned_transfers(context, owner) {
            let open = !transfer
                .status
                .as_ref()
                .and_then(|status| status.phase)
                .is_some_and(VolumeTransferPhase::is_final);
            if open
                && transfer.spec.stage_pod == pod.name_any()
                && transfer.namespace().as_deref() == Some(namespace.as_str())
            {
                warn!(transfer = %transfer.name_any(), "{message}");
                let status = VolumeTransferStatus {
                    phase: Some(VolumeTransferPhase::Failed),
                    message: Some(crate::api::condition::bounded_message(&message)),
                    completion_time: Some(now()),
                    conditions: vec![Condition::new(
                        condition_type::FAILED,
                        ConditionStatus::True,
                        reason::STAGE_POD_FAILED,
                        &message,
                        transfer.metadata.generation,
                        now(),
                    )],
                    ..VolumeTransferStatus::default()
                };
                write_transfer_status(&transfer, &status, context).await?;
            }
        }
    }
    Ok(())
}

async fn write_transfer_status(
    transfer: &VolumeTransfer,
    status: &VolumeTransferStatus,
    context: &Context,
) -> Result<(), Error> {
    let namespace = transfer.namespace().unwrap_or_default();
    let name = transfer.name_any();
    let api: Api<VolumeTransfer> = Api::namespaced(context.client.clone(), &namespace);
    let patch = serde_json::json!({
        "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        "kind": "VolumeTransfer",
        "status": status,
    });
    match api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) => Ok(()),
        Err(source) => Err(kube_error(
            "apply status of",
            "VolumeTransfer",
            format!("{namespace}/{name}"),
        )(source)),
    }
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
    fn a_failed_stage_pod_reports_exit_code_reason_and_last_log_line() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "stage-a"},
            "status": {"phase": "Failed", "containerStatuses": [{
                "name": "agent", "image": "agent", "imageID": "", "ready": false,
                "restartCount": 5,
                "state": {"terminated": {"exitCode": 1, "reason": "Error",
                    "message": "starting\nerror: bucket not found"}}}]}
        }))
        .expect("valid pod");
        assert_eq!(
            stage_pod_failure(&pod).as_deref(),
            Some("stage pod stage-a failed: exit code 1 (Error): error: bucket not found")
        );
        let running: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "stage-b"}, "status": {"phase": "Running"}
        }))
        .expect("valid pod");
        assert_eq!(stage_pod_failure(&running), None);
    }

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
