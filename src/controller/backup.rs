//! The VolumeBackup reconciler: observe → decide → apply, through the
//! `haulage.dev/cancel` finalizer. [`observe`] reads what the decision
//! needs from the shared caches once (and the location's credentials when
//! a stage pod is to be created), [`crate::reconcile::backup::decide`]
//! returns the ownership claim, the actions and the next status, and
//! [`apply`] carries them out: the claim, the actions
//! ([`crate::controller::execute`]), the status (server-side apply with
//! the resourceVersion this replica last saw), then what follows the
//! status. Which event woke the reconciler does not matter.
//!
//! Before that, [`crate::reconcile::backup::decide_lifecycle`] says what
//! `deletionPolicy` and `ttl` ask: add or remove the
//! `haulage.dev/forget-snapshots` finalizer, forget a deleted backup's
//! snapshots from its location under the repository's shared lock (after
//! the cancel) and release the finalizer, or delete a backup whose ttl is
//! over.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action as Requeue;
use kube::{Api, ResourceExt};
use tracing::{debug, info, instrument, warn};

use crate::api::labels::FORGET_FINALIZER;
use crate::api::{BackupStorageLocation, VolumeBackup};
use crate::clock;
use crate::controller::error::{ApiCall, Error, is_conflict, kube_error};
use crate::controller::execute::{
    OwnerCalls, carry_out, emit, execute, namespaced_name, status_patch,
};
use crate::controller::location::{OpenedRepository, open_repository};
use crate::controller::staging::{
    CLEANUP_TIMEOUT_SECONDS, cancel_within_timeout, namespaced_api, observe_staging,
    stage_pod_secrets, through_cancel_finalizer, until_caches_synced,
};
use crate::controller::{Context, FIELD_MANAGER};
use crate::engine::forget::forget_snapshots;
use crate::engine::lock::RepositoryLock;
use crate::plan::objects::ClusterObjects;
use crate::reconcile::backup::{
    BackupObservation, FORGET_RETRY_SECONDS, Lifecycle, decide, decide_cancel, decide_lifecycle,
    forget_failed, needs_cluster, needs_credentials, owns_transfer, resolve_location,
};
use crate::reconcile::claims::claim_record;
use crate::reconcile::location::sanitize_message;
use crate::reconcile::stage_pod::repository_url;
use crate::repo::lock::LockKind;
use crate::repo::snapshot::ClaimRecord;

/// Reconcile one VolumeBackup through the cancel finalizer.
#[instrument(skip_all, fields(backup = %backup.name_any()))]
pub async fn reconcile(backup: Arc<VolumeBackup>, context: Arc<Context>) -> Result<Requeue, Error> {
    let api = namespaced_api(backup.as_ref(), "VolumeBackup", &context)?;
    if let Some(requeue) = until_caches_synced(&context) {
        return Ok(requeue);
    }
    let namespace = backup.namespace().unwrap_or_default();
    let locations = context
        .stores
        .locations
        .state_filter(|location| location.namespace().as_deref() == Some(namespace.as_str()));
    let ttl_left = match decide_lifecycle(&backup, &locations, &clock::now())
        .map_err(decision_error(&backup))?
    {
        Lifecycle::Continue { ttl_left } => ttl_left,
        Lifecycle::AddFinalizer => {
            let mut finalizers = backup.finalizers().to_vec();
            finalizers.push(FORGET_FINALIZER.to_string());
            write_finalizers(&api, &backup, finalizers).await?;
            return Ok(Requeue::await_change());
        }
        Lifecycle::RemoveFinalizer => {
            release_forget_finalizer(&api, &backup).await?;
            return Ok(Requeue::await_change());
        }
        Lifecycle::Forget {
            backup: recorded,
            location,
        } => {
            let location = locations
                .iter()
                .find(|candidate| candidate.name_any() == location)
                .cloned();
            return forget_and_release(&api, &backup, &recorded, location, &context).await;
        }
        Lifecycle::ForgetBlocked { problem } => {
            report_forget_failure(&api, &backup, None, &problem, &context).await?;
            return Ok(Requeue::requeue(Duration::from_secs(FORGET_RETRY_SECONDS)));
        }
        Lifecycle::Expired { event } => {
            emit(backup.as_ref(), &event, &context).await;
            info!(ttl = ?backup.spec.ttl, "ttl over: deleting the backup");
            match api
                .delete(&backup.name_any(), &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(source) => {
                    return Err(kube_error(
                        ApiCall::DeleteBackup,
                        namespaced_name(backup.as_ref()),
                    )(source));
                }
            }
            return Ok(Requeue::await_change());
        }
    };
    let next = through_cancel_finalizer(
        &api,
        backup,
        |backup| apply(backup, &context),
        |backup| cleanup(backup, &context),
    )
    .await?;
    // A finished backup with a ttl: nothing else wakes it when it expires.
    Ok(ttl_left.map_or(next, Requeue::requeue))
}

/// Write `finalizers` as the backup's, on the condition that it did not
/// change since it was read (a conflict is decided again next time).
async fn write_finalizers(
    api: &Api<VolumeBackup>,
    backup: &VolumeBackup,
    finalizers: Vec<String>,
) -> Result<(), Error> {
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": backup.resource_version(), "finalizers": finalizers},
    });
    match api
        .patch(
            &backup.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(error) if is_conflict(&error) => {
            debug!("the backup changed while its finalizers were written; deciding again");
            Ok(())
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(kube_error(
            ApiCall::WriteBackupFinalizers,
            namespaced_name(backup),
        )(source)),
    }
}

async fn release_forget_finalizer(
    api: &Api<VolumeBackup>,
    backup: &VolumeBackup,
) -> Result<(), Error> {
    let finalizers = backup
        .finalizers()
        .iter()
        .filter(|name| *name != FORGET_FINALIZER)
        .cloned()
        .collect();
    write_finalizers(api, backup, finalizers).await
}

/// Forget the deleted backup's snapshots from `location`, then release
/// its finalizer; when that fails, say why in its status and an Event and
/// try again in [`FORGET_RETRY_SECONDS`].
async fn forget_and_release(
    api: &Api<VolumeBackup>,
    backup: &VolumeBackup,
    recorded: &str,
    location: Option<Arc<BackupStorageLocation>>,
    context: &Context,
) -> Result<Requeue, Error> {
    let Some(location) = location else {
        // Gone from the cache between the decision and now.
        return Ok(Requeue::requeue(Duration::from_secs(FORGET_RETRY_SECONDS)));
    };
    let forgotten =
        forget_snapshots_of(&location, recorded, context.cluster_id.as_deref(), context).await?;
    match forgotten {
        Ok(count) => {
            info!(count, location = %location.name_any(), "forgot the backup's snapshots");
            emit(
                backup,
                &crate::reconcile::action::Event::normal(
                    crate::api::condition::reason::SNAPSHOTS_FORGOTTEN,
                    "Forget",
                    format!(
                        "forgot {count} snapshots of VolumeBackup {recorded} from BackupStorageLocation {} (deletionPolicy Delete); `haulage prune` reclaims their space",
                        location.name_any()
                    ),
                ),
                context,
            )
            .await;
            release_forget_finalizer(api, backup).await?;
            Ok(Requeue::await_change())
        }
        Err(problem) => {
            warn!(location = %location.name_any(), %problem, "cannot forget the backup's snapshots; keeping its finalizer");
            report_forget_failure(api, backup, Some(&location.name_any()), &problem, context)
                .await?;
            Ok(Requeue::requeue(Duration::from_secs(FORGET_RETRY_SECONDS)))
        }
    }
}

/// The `SnapshotsForgotten` False condition and a warning Event.
async fn report_forget_failure(
    api: &Api<VolumeBackup>,
    backup: &VolumeBackup,
    location: Option<&str>,
    problem: &str,
    context: &Context,
) -> Result<(), Error> {
    let (status, event) = forget_failed(backup, location, problem, &clock::now());
    if Some(&status) != backup.status.as_ref() {
        api.patch_status(
            &backup.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(status_patch::<VolumeBackup>(&status, None)),
        )
        .await
        .map_err(kube_error(
            ApiCall::WriteBackupStatus,
            namespaced_name(backup),
        ))?;
    }
    emit(backup, &event, context).await;
    Ok(())
}

/// Seconds the forget of a deleted backup's snapshots may take (opening
/// the repository, the shared lock, listing and deleting): an unreachable
/// endpoint must not hold a reconcile slot longer.
const FORGET_TIMEOUT_SECONDS: u64 = 60;
/// How long the forget waits for a conflicting lock (a prune's exclusive
/// one) before it reports the location locked and tries again later.
const FORGET_LOCK_WAIT_SECONDS: u64 = 10;

/// Forget from `location` the snapshots whose claim record names the
/// backup `recorded` (`namespace/name`) and the cluster `cluster`, under
/// the repository's shared lock (as `haulage forget` takes it). The inner
/// `Err` says what went wrong, without credentials.
async fn forget_snapshots_of(
    location: &BackupStorageLocation,
    recorded: &str,
    cluster: Option<&str>,
    context: &Context,
) -> Result<Result<usize, String>, Error> {
    let url = repository_url(&location.spec);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(FORGET_TIMEOUT_SECONDS);
    let late = || {
        format!(
            "{url} did not answer within {FORGET_TIMEOUT_SECONDS}s: check that the endpoint is reachable"
        )
    };
    let opened =
        match tokio::time::timeout_at(deadline, open_repository(location, &context.client)).await {
            Ok(opened) => opened?,
            Err(_) => Err(late()),
        };
    let OpenedRepository {
        repository,
        secrets,
        ..
    } = match opened {
        Ok(opened) => opened,
        Err(problem) => return Ok(Err(problem)),
    };
    let work = async {
        let lock = RepositoryLock::acquire(
            &repository,
            LockKind::Shared,
            &format!("forget the snapshots of VolumeBackup {recorded}"),
            Duration::from_secs(FORGET_LOCK_WAIT_SECONDS),
        )
        .await
        .map_err(|error| error.to_string())?;
        let result = async {
            let (snapshots, _damaged) = repository.list_snapshots().await?;
            let ids: Vec<_> = snapshots
                .iter()
                .filter(|(_, snapshot)| {
                    snapshot
                        .claim
                        .as_ref()
                        .is_some_and(|claim| claim.is_from_backup_of_cluster(recorded, cluster))
                })
                .map(|(id, _)| *id)
                .collect();
            lock.check()?;
            forget_snapshots(&repository, &ids).await?;
            Ok::<_, crate::engine::EngineError>(ids.len())
        }
        .await;
        let released = lock.release().await;
        let count = result.map_err(|error| error.to_string())?;
        released.map_err(|error| error.to_string())?;
        Ok(count)
    };
    let outcome = tokio::time::timeout_at(deadline, work)
        .await
        .unwrap_or_else(|_| Err(late()));
    let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
    Ok(outcome.map_err(|problem| sanitize_message(&problem, &secrets)))
}

fn decision_error(
    backup: &VolumeBackup,
) -> impl FnOnce(crate::reconcile::backup::BackupError) -> Error {
    let name = namespaced_name(backup);
    move |source| Error::Backup { name, source }
}

/// Read what deciding on `backup` needs from the caches, once (the
/// cluster's objects only while it has no plan); then the location's
/// credentials when a stage pod is to be created.
pub async fn observe(
    backup: Arc<VolumeBackup>,
    context: &Context,
) -> Result<BackupObservation, Error> {
    let mut observation = observe_caches(backup, context);
    if needs_cluster(&observation.backup) {
        observation.cluster = Some(cluster_objects(&observation.backup, context));
    }
    if needs_credentials(&observation, &clock::now())
        .map_err(decision_error(&observation.backup))?
    {
        let (_, location) = resolve_location(&observation.backup, &observation.staging.locations);
        let (credentials, password) = stage_pod_secrets(location, context).await?;
        observation.staging.credentials = Some(credentials);
        observation.staging.password = password;
        observation.claim_records = claim_records(&observation.backup, context);
    }
    Ok(observation)
}

/// The cluster's objects a plan of `backup` is made from: only its own
/// namespaces' pods and claims (one malformed object elsewhere must not
/// stop it).
fn cluster_objects(backup: &VolumeBackup, context: &Context) -> ClusterObjects {
    let in_scope = |object_namespace: Option<String>| {
        object_namespace.is_some_and(|namespace| backup.spec.namespaces.contains(&namespace))
    };
    context.stores.cluster_objects_in(in_scope)
}

/// The record of each claim in `backup`'s namespaces, for the snapshots of
/// the stage pods about to be created.
fn claim_records(
    backup: &VolumeBackup,
    context: &Context,
) -> BTreeMap<(String, String), ClaimRecord> {
    let classes = context.stores.classes.state();
    let classes: Vec<&StorageClass> = classes.iter().map(|class| class.as_ref()).collect();
    let name = namespaced_name(backup);
    context
        .stores
        .claims
        .state()
        .iter()
        .filter(|claim| {
            claim
                .namespace()
                .is_some_and(|namespace| backup.spec.namespaces.contains(&namespace))
        })
        .map(|claim| {
            (
                (claim.namespace().unwrap_or_default(), claim.name_any()),
                claim_record(claim, &classes, &name, context.cluster_id.as_deref()),
            )
        })
        .collect()
}

/// The backup's children, locations, leases and this replica's memory of
/// it, from the caches (no cluster objects, no credentials).
fn observe_caches(backup: Arc<VolumeBackup>, context: &Context) -> BackupObservation {
    let uid = backup.uid().unwrap_or_default();
    let namespace = backup.namespace().unwrap_or_default();
    BackupObservation {
        staging: observe_staging(
            &uid,
            &namespace,
            |transfer| owns_transfer(&uid, transfer),
            context,
        ),
        cluster: None,
        claim_records: BTreeMap::new(),
        backup,
    }
}

/// Observe, decide, and carry out the decision.
async fn apply(backup: Arc<VolumeBackup>, context: &Context) -> Result<Requeue, Error> {
    let observation = observe(backup, context).await?;
    let backup = observation.backup.clone();
    let decision = decide(&observation, &clock::now()).map_err(decision_error(&backup))?;
    let calls = OwnerCalls {
        claim: ApiCall::ClaimBackup,
        write_status: ApiCall::WriteBackupStatus,
        noun: "backup",
    };
    carry_out(decision, backup.as_ref(), context, calls).await
}

/// Cancel: carry out [`decide_cancel`] (open transfers Canceled, stage
/// pods, Roles and credentials copies deleted, transfers deleted), bounded
/// by [`CLEANUP_TIMEOUT_SECONDS`]: after it the finalizer is released
/// anyway, with a warning naming what may be left.
async fn cleanup(backup: Arc<VolumeBackup>, context: &Context) -> Result<Requeue, Error> {
    let uid = backup.uid().unwrap_or_default();
    context.status_writes.forget(&uid);
    let observation = observe_caches(backup, context);
    let backup = observation.backup.clone();
    let actions = decide_cancel(&observation, &clock::now());
    if !cancel_within_timeout(execute(actions, backup.as_ref(), context)).await? {
        warn!(
            selector = %crate::reconcile::backup::owner_of(&backup)
                .map(|owner| owner.selector())
                .unwrap_or_default(),
            "cleanup did not finish in {CLEANUP_TIMEOUT_SECONDS}s; releasing the finalizer, objects with this label may remain"
        );
    }
    info!("canceled and cleaned up");
    Ok(Requeue::await_change())
}
