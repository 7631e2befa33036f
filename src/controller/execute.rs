//! The executor: carries out the [`Action`]s a decision returned, in
//! order, against the API server. It decides nothing; a failed call stops
//! the rest and is returned naming the call and the object (the next
//! reconcile decides again from what then exists, since every action is
//! idempotent: applies, creates that accept an existing object, deletes
//! that accept a missing one).

use std::fmt::Debug;

use k8s_openapi::api::core::v1::{
    Namespace, PersistentVolume, PersistentVolumeClaim, Pod, Secret, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::api::VolumeTransfer;
use crate::controller::error::{ApiCall, Error, is_conflict, is_not_found, kube_error};
use crate::controller::{Context, FIELD_MANAGER};
use crate::reconcile::action::{
    Action, ClaimChange, Event, EventKind, ObjectName, StagePodRelease, VolumeChange,
};
use crate::reconcile::claims::{
    RECLAIM_POLICY_ANNOTATION, RESTORE_COMPLETE, RESTORE_INCOMPLETE, RESTORE_STATE_LABEL,
    RESTORED_FROM_ANNOTATION,
};
use crate::reconcile::stage_pod::{StagePodObjects, credentials_copy_name};

/// A stage pod the API server refused (Pod Security admission, a quota, a
/// LimitRange maximum): not a failure of the reconcile, a fact for its
/// status.
#[derive(Debug, Clone)]
pub struct RefusedPod {
    /// The pod.
    pub pod: ObjectName,
    /// The API server's answer.
    pub message: String,
}

/// What carrying out the actions met that the status should say.
#[derive(Debug, Clone, Default)]
pub struct Executed {
    /// Stage pods the API server refused; the other actions went on.
    pub refused: Vec<RefusedPod>,
}

impl Executed {
    /// The refused stage pods as (pod, the API server's answer).
    pub fn refused_pods(&self) -> Vec<(String, String)> {
        self.refused
            .iter()
            .map(|refusal| (refusal.pod.to_string(), refusal.message.clone()))
            .collect()
    }
}

/// `namespace/name` of an object, as errors and logs name it.
pub fn namespaced_name(object: &impl ResourceExt) -> String {
    format!(
        "{}/{}",
        object.namespace().unwrap_or_default(),
        object.name_any()
    )
}

/// Write `claim` as the owner of `object` (a VolumeBackup or VolumeRestore),
/// on the condition that it did not change since it was read (a
/// resourceVersion precondition): of two replicas racing to claim or adopt
/// it, exactly one wins. `None` when this one lost, else the object's new
/// resourceVersion.
pub async fn take_ownership<K>(
    object: &K,
    claim: &crate::api::backup::OwnerClaim,
    context: &Context,
    call: ApiCall,
) -> Result<Option<Option<String>>, Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let api: Api<K> = Api::namespaced(
        context.client.clone(),
        &object.namespace().unwrap_or_default(),
    );
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": object.resource_version()},
        "status": {"owner": claim},
    });
    match api
        .patch_status(
            &object.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(written) => Ok(Some(written.resource_version())),
        Err(error) if is_conflict(&error) => {
            info!("another replica claimed it first, or it changed; moving on");
            Ok(None)
        }
        Err(source) => Err(kube_error(call, namespaced_name(object))(source)),
    }
}

/// Carry out `actions` in order; Events are recorded on `subject`. A stage
/// pod the API server refuses (403 or 422) is reported in [`Executed`]
/// and the rest goes on; any other failure stops there.
pub async fn execute<K>(
    actions: Vec<Action>,
    subject: &K,
    context: &Context,
) -> Result<Executed, Error>
where
    K: Resource<DynamicType = ()>,
{
    let mut executed = Executed::default();
    for action in actions {
        match action {
            Action::CreateStagePod(objects) => match create_stage_pod(&objects, context).await {
                Ok(()) => {}
                Err(Error::Kube {
                    call: ApiCall::ApplyPod,
                    source: kube::Error::Api(status),
                    ..
                }) if status.code == 403 || status.code == 422 => {
                    let pod = ObjectName::new(
                        objects.pod.metadata.namespace.clone().unwrap_or_default(),
                        objects.pod_name(),
                    );
                    warn!(pod = %pod, "the API server refused the stage pod: {}", status.message);
                    executed.refused.push(RefusedPod {
                        pod,
                        message: status.message.clone(),
                    });
                }
                Err(error) => return Err(error),
            },
            Action::DeletePod { pod, uid, replaced } => {
                if !replaced {
                    info!(
                        pod = %pod.name,
                        namespace = %pod.namespace,
                        "every volume of this stage pod is final; stopping it"
                    );
                }
                delete(&namespaced::<Pod>(context, &pod), &pod, ApiCall::DeletePod).await?;
                // Remembered once deleted: a delete that failed is decided
                // again.
                if let Some(uid) = &uid {
                    context.deleted_pods.record(uid);
                }
            }
            Action::ReleaseStagePod(release) => release_stage_pod(&release, context).await?,
            Action::WriteTransferStatus { transfer, status } => {
                let patch = crate::api::status_apply::<VolumeTransfer>(&status);
                patch_transfer_status(
                    context,
                    &transfer,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&patch),
                    ApiCall::WriteTransferStatus,
                )
                .await?;
            }
            Action::RecordAttempts { transfer, attempts } => {
                let patch = serde_json::json!({"status": {"attempts": attempts}});
                patch_transfer_status(
                    context,
                    &transfer,
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                    ApiCall::RecordAttempts,
                )
                .await?;
            }
            Action::DeleteTransfer(transfer) => {
                delete(
                    &namespaced::<VolumeTransfer>(context, &transfer),
                    &transfer,
                    ApiCall::DeleteTransfer,
                )
                .await?;
            }
            Action::Emit(event) => emit(subject, &event, context).await,
            Action::CreateNamespace(name) => create_namespace(&name, context).await?,
            Action::CreateClaim(claim) => create_claim(&claim, context).await?,
            Action::ChangeClaim { claim, change } => change_claim(&claim, &change, context).await?,
            Action::ChangeVolume { volume, change } => {
                change_volume(&volume, &change, context).await?
            }
        }
    }
    Ok(executed)
}

/// Record `event` on `subject`, and log it.
pub async fn emit<K>(subject: &K, event: &Event, context: &Context)
where
    K: Resource<DynamicType = ()>,
{
    let object = subject.meta().name.as_deref().unwrap_or_default();
    match event.kind {
        EventKind::Normal => {
            info!(object, reason = %event.reason, "{}", event.note);
            context
                .events
                .normal(subject, &event.reason, event.action, &event.note)
                .await;
        }
        EventKind::Warning => {
            warn!(object, reason = %event.reason, "{}", event.note);
            context
                .events
                .warning(subject, &event.reason, event.action, &event.note)
                .await;
        }
    }
}

fn namespaced<K>(context: &Context, object: &ObjectName) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    Api::namespaced(context.client.clone(), &object.namespace)
}

/// Server-side apply of a complete desired object.
async fn apply<K>(api: &Api<K>, object: &K, call: ApiCall) -> Result<K, Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    let namespace = object.meta().namespace.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .map_err(kube_error(call, format!("{namespace}/{name}")))
}

/// Delete one object by name; a missing one is already gone.
async fn delete<K>(api: &Api<K>, object: &ObjectName, call: ApiCall) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    match api.delete(&object.name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) => Ok(()),
        Err(source) => Err(kube_error(call, object.to_string())(source)),
    }
}

/// Create a stage pod and what it needs, in the order [`StagePodObjects`]
/// documents: a stage pod in the cache then means the rest exists.
async fn create_stage_pod(objects: &StagePodObjects, context: &Context) -> Result<(), Error> {
    let namespace = objects.pod.metadata.namespace.clone().unwrap_or_default();
    let client = &context.client;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &namespace);
    apply(
        &accounts,
        &objects.service_account,
        ApiCall::ApplyServiceAccount,
    )
    .await?;
    let roles: Api<Role> = Api::namespaced(client.clone(), &namespace);
    let role = apply(&roles, &objects.role, ApiCall::ApplyRole).await?;
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), &namespace);
    apply(&bindings, &objects.role_binding, ApiCall::ApplyRoleBinding).await?;
    // Created, not applied: the controller may create and delete Secrets
    // outside its namespace, never patch them.
    let secret = objects.credentials_owned_by(&role.uid().unwrap_or_default());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {}
        Err(error) if is_conflict(&error) => {}
        Err(source) => {
            return Err(kube_error(
                ApiCall::CreateCredentialsCopy,
                format!("{namespace}/{}", secret.name_any()),
            )(source));
        }
    }
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), &namespace);
    for transfer in &objects.transfers {
        apply(&transfers, transfer, ApiCall::ApplyTransfer).await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    apply(&pods, &objects.pod, ApiCall::ApplyPod).await?;
    info!(
        pod = %objects.pod_name(),
        namespace,
        volumes = objects.transfers.len(),
        "stage pod created"
    );
    Ok(())
}

/// Delete a stage pod, its RoleBinding, Role and credentials copy (the
/// transfers stay: they carry the per-volume results). By name: the
/// controller's RBAC has no `deletecollection`, and Secrets outside its
/// namespace it may only create and delete.
async fn release_stage_pod(release: &StagePodRelease, context: &Context) -> Result<(), Error> {
    let pod = &release.pod;
    if release.delete_pod {
        delete(&namespaced::<Pod>(context, pod), pod, ApiCall::DeletePod).await?;
        if let Some(pod_uid) = &release.pod_uid {
            context.deleted_pods.record(pod_uid);
        }
    }
    if !release.delete_access {
        return Ok(());
    }
    delete(
        &namespaced::<RoleBinding>(context, pod),
        pod,
        ApiCall::DeleteRoleBinding,
    )
    .await?;
    let copy = ObjectName::new(&pod.namespace, credentials_copy_name(&pod.name));
    delete(
        &namespaced::<Secret>(context, &copy),
        &copy,
        ApiCall::DeleteCredentialsCopy,
    )
    .await?;
    // The Role last: while it is there the release is decided again.
    delete(&namespaced::<Role>(context, pod), pod, ApiCall::DeleteRole).await?;
    if let Some(role_uid) = &release.role_uid {
        context.released_roles.record(role_uid);
    }
    Ok(())
}

/// Patch a transfer's status; a transfer that is gone (its backup was
/// deleted meanwhile) is nothing left to do.
async fn patch_transfer_status<P: Serialize + Debug>(
    context: &Context,
    transfer: &ObjectName,
    params: &PatchParams,
    patch: &Patch<P>,
    call: ApiCall,
) -> Result<(), Error> {
    patch_status::<VolumeTransfer, P>(&context.client, transfer, params, patch)
        .await
        .map(|_| ())
        .map_err(kube_error(call, transfer.to_string()))
}

/// Patch the status of a namespaced object; `Ok(None)` when it is gone,
/// which every status writer treats as nothing left to do.
pub(crate) async fn patch_status<K, P>(
    client: &kube::Client,
    object: &ObjectName,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Option<K>, kube::Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
    P: Serialize + Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), &object.namespace);
    match api.patch_status(&object.name, params, patch).await {
        Ok(written) => Ok(Some(written)),
        Err(error) if is_not_found(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Create a namespace; one that exists (made meanwhile) is fine.
async fn create_namespace(name: &str, context: &Context) -> Result<(), Error> {
    let api: Api<Namespace> = Api::all(context.client.clone());
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        ..Namespace::default()
    };
    match api.create(&PostParams::default(), &namespace).await {
        Ok(_) => {
            info!(namespace = name, "destination namespace created");
            Ok(())
        }
        Err(error) if is_conflict(&error) => Ok(()),
        Err(source) => Err(kube_error(ApiCall::CreateNamespace, name)(source)),
    }
}

/// Create a claim; one that exists (made meanwhile) is fine.
async fn create_claim(claim: &PersistentVolumeClaim, context: &Context) -> Result<(), Error> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.name_any();
    let api: Api<PersistentVolumeClaim> = Api::namespaced(context.client.clone(), &namespace);
    match api.create(&PostParams::default(), claim).await {
        Ok(_) => {
            info!(claim = %name, namespace, "destination claim created");
            Ok(())
        }
        Err(error) if is_conflict(&error) => Ok(()),
        Err(source) => Err(kube_error(
            ApiCall::CreateClaim,
            format!("{namespace}/{name}"),
        )(source)),
    }
}

/// Label a restored claim complete or being synced, or delete it (a
/// hand-back).
async fn change_claim(
    claim: &ObjectName,
    change: &ClaimChange,
    context: &Context,
) -> Result<(), Error> {
    let api = namespaced::<PersistentVolumeClaim>(context, claim);
    let (patch, done) = match change {
        ClaimChange::MarkComplete => (
            serde_json::json!({
                "metadata": {"labels": {RESTORE_STATE_LABEL: RESTORE_COMPLETE}},
            }),
            "restored claim verified: labelled complete".to_string(),
        ),
        ClaimChange::BeginSync { snapshot } => (
            serde_json::json!({
                "metadata": {
                    "labels": {RESTORE_STATE_LABEL: RESTORE_INCOMPLETE},
                    "annotations": {RESTORED_FROM_ANNOTATION: snapshot},
                },
            }),
            format!("syncing snapshot {snapshot} into the claim: labelled incomplete"),
        ),
        ClaimChange::Delete => {
            info!(claim = %claim, "replacing the claim the volume was written through by its ReadOnlyMany claim");
            return delete(&api, claim, ApiCall::DeleteClaim).await;
        }
    };
    match api
        .patch(&claim.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            info!(claim = %claim, "{done}");
            Ok(())
        }
        Err(error) if is_not_found(&error) => Ok(()),
        Err(source) => Err(kube_error(ApiCall::PatchClaim, claim.to_string())(source)),
    }
}

/// Change a restored claim's volume for its hand-back.
async fn change_volume(
    volume: &str,
    change: &VolumeChange,
    context: &Context,
) -> Result<(), Error> {
    let api: Api<PersistentVolume> = Api::all(context.client.clone());
    let patch = match change {
        VolumeChange::Retain { original } => serde_json::json!({
            "metadata": {"annotations": {RECLAIM_POLICY_ANNOTATION: original}},
            "spec": {"persistentVolumeReclaimPolicy": "Retain"},
        }),
        VolumeChange::FreeForClaim { namespace, name } => serde_json::json!({
            "spec": {"claimRef": {"namespace": namespace, "name": name,
                "uid": null, "resourceVersion": null}},
        }),
        VolumeChange::RestoreReclaimPolicy(policy) => serde_json::json!({
            "metadata": {"annotations": {RECLAIM_POLICY_ANNOTATION: null}},
            "spec": {"persistentVolumeReclaimPolicy": policy},
        }),
    };
    match api
        .patch(volume, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) => Ok(()),
        Err(source) => Err(kube_error(ApiCall::PatchVolume, volume)(source)),
    }
}

/// The status of an object with an owner (VolumeBackup, VolumeRestore): the
/// parts [`act`] writes a refused stage pod into.
pub trait OwnerStatus: Clone + Default + Serialize {
    /// Its conditions and message.
    fn conditions_and_message(&mut self) -> (&mut Vec<crate::api::Condition>, &mut Option<String>);
    /// Its phase, for the log line of a finished object.
    fn phase_text(&self) -> Option<String>;
}

impl OwnerStatus for crate::api::VolumeBackupStatus {
    fn conditions_and_message(&mut self) -> (&mut Vec<crate::api::Condition>, &mut Option<String>) {
        (&mut self.conditions, &mut self.message)
    }
    fn phase_text(&self) -> Option<String> {
        self.phase.map(|phase| format!("{phase:?}"))
    }
}

impl OwnerStatus for crate::api::VolumeRestoreStatus {
    fn conditions_and_message(&mut self) -> (&mut Vec<crate::api::Condition>, &mut Option<String>) {
        (&mut self.conditions, &mut self.message)
    }
    fn phase_text(&self) -> Option<String> {
        self.phase.map(|phase| format!("{phase:?}"))
    }
}

/// An object with an owner and its status.
pub trait Owned:
    Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + DeserializeOwned
    + Debug
{
    /// Its status type.
    type Status: OwnerStatus;
    /// Its status, when it has one.
    fn status(&self) -> Option<&Self::Status>;
}

impl Owned for crate::api::VolumeBackup {
    type Status = crate::api::VolumeBackupStatus;
    fn status(&self) -> Option<&Self::Status> {
        self.status.as_ref()
    }
}

impl Owned for crate::api::VolumeRestore {
    type Status = crate::api::VolumeRestoreStatus;
    fn status(&self) -> Option<&Self::Status> {
        self.status.as_ref()
    }
}

/// The server-side apply of `status`, conditional on `resource_version`
/// when given.
pub fn status_patch<K>(status: &impl Serialize, resource_version: Option<&str>) -> serde_json::Value
where
    K: Resource<DynamicType = ()>,
{
    let mut patch = crate::api::status_apply::<K>(status);
    if let Some(version) = resource_version {
        patch["metadata"] = serde_json::json!({"resourceVersion": version});
    }
    patch
}

/// The API calls [`act`] makes, for its errors' labels.
pub struct OwnerCalls {
    /// Claiming or adopting the object.
    pub claim: ApiCall,
    /// Writing its status.
    pub write_status: ApiCall,
    /// What it is called in the log (`backup`, `restore`).
    pub noun: &'static str,
}

/// Carry out a decision about `object` (a VolumeBackup or VolumeRestore):
/// wait, release what is left of a finished one, or act as its owner.
pub async fn carry_out<K: Owned>(
    decision: crate::reconcile::ownership::Decision<K::Status>,
    object: &K,
    context: &Context,
    calls: OwnerCalls,
) -> Result<kube::runtime::controller::Action, Error> {
    use crate::reconcile::ownership::{Decision, WaitReason};
    match decision {
        Decision::Wait { why, requeue: next } => {
            if why == WaitReason::StaleLease {
                warn!(
                    "this replica's lease has not been renewed recently (API server unreachable?); not acting on its {}s until it is, since another replica may adopt them",
                    calls.noun
                );
            }
            Ok(crate::controller::requeue(next))
        }
        Decision::Finished { release } => {
            execute(release, object, context).await?;
            Ok(kube::runtime::controller::Action::await_change())
        }
        Decision::Act(acts) => act(*acts, object, context, calls).await,
    }
}

/// Carry out an owner's decision on `object`: claim first (stop when
/// another replica won), then the actions, the status (with what the API
/// server refused noted in it), and what follows the status.
async fn act<K: Owned>(
    acts: crate::reconcile::ownership::OwnerActs<K::Status>,
    object: &K,
    context: &Context,
    calls: OwnerCalls,
) -> Result<kube::runtime::controller::Action, Error> {
    let crate::reconcile::ownership::OwnerActs {
        ownership,
        actions,
        status,
        after_status,
        finished,
        requeue: next,
    } = acts;
    // Status writes carry the resourceVersion this replica last saw: a
    // replica acting on a stale cache (back from a network partition after
    // another adopted its objects) gets a conflict instead of taking the
    // object back.
    let mut resource_version = object.resource_version();
    if let crate::reconcile::ownership::Ownership::Take { claim, event } = &ownership {
        match take_ownership(object, claim, context, calls.claim).await? {
            Some(version) => resource_version = version,
            None => return Ok(kube::runtime::controller::Action::await_change()),
        }
        emit(object, event, context).await;
    }
    let executed = execute(actions, object, context).await?;
    let status = if executed.refused.is_empty() {
        status
    } else {
        // What the API server refused goes into the status (and an
        // Event), so a user sees why nothing runs.
        let mut noted = status.unwrap_or_else(|| object.status().cloned().unwrap_or_default());
        let (conditions, message) = noted.conditions_and_message();
        let event = crate::reconcile::supervision::note_refused_stage_pods(
            conditions,
            message,
            &executed.refused_pods(),
            object.meta().generation,
            &crate::clock::now(),
        );
        emit(object, &event, context).await;
        Some(noted)
    };
    let uid = object.uid().unwrap_or_default();
    if let Some(status) = &status {
        let api: Api<K> = Api::namespaced(
            context.client.clone(),
            &object.namespace().unwrap_or_default(),
        );
        api.patch_status(
            &object.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(status_patch::<K>(status, resource_version.as_deref())),
        )
        .await
        .map_err(kube_error(calls.write_status, namespaced_name(object)))?;
        context.status_writes.record(&uid);
    }
    if finished {
        context.status_writes.forget(&uid);
        let phase = status.as_ref().and_then(OwnerStatus::phase_text);
        info!(
            phase = phase.as_deref().unwrap_or("-"),
            "{} finished", calls.noun
        );
    }
    execute(after_status, object, context).await?;
    Ok(crate::controller::requeue(next))
}
