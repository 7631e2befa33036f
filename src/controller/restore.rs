//! The VolumeRestore reconciler: observe → decide → apply, through the
//! `haulage.dev/cancel` finalizer, in the shape of the backup's.
//! [`observe`] reads the caches once; while the restore has no selection
//! it lists the location's snapshots (the one read of the object store the
//! controller makes for a restore, with the location's credentials), and
//! when a stage pod is to be created it reads the credentials to copy.
//! [`crate::reconcile::restore::decide`] returns the ownership claim, the
//! actions and the status, which are carried out in that order.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::controller::Action as Requeue;
use tracing::{info, instrument, warn};

use crate::api::VolumeRestore;
use crate::api::labels::labelled_as_owned_by;
use crate::clock;
use crate::controller::Context;
use crate::controller::error::{ApiCall, Error};
use crate::controller::execute::{OwnerCalls, carry_out, execute, namespaced_name};
use crate::controller::location::open_repository;
use crate::controller::staging::{
    CLEANUP_TIMEOUT_SECONDS, cancel_within_timeout, namespaced_api, observe_staging,
    stage_pod_secrets, through_cancel_finalizer, until_caches_synced,
};
use crate::plan::objects::ClusterObjects;
use crate::reconcile::restore::{
    ListedSnapshot, RestoreObservation, decide, decide_cancel, needs_cluster, needs_credentials,
    needs_snapshots,
};
use crate::reconcile::stage_pod::repository_url;

/// Time the listing of a location's snapshots may take.
const SNAPSHOT_LIST_TIMEOUT_SECONDS: u64 = 120;

/// Reconcile one VolumeRestore through the cancel finalizer.
#[instrument(skip_all, fields(restore = %restore.name_any()))]
pub async fn reconcile(
    restore: Arc<VolumeRestore>,
    context: Arc<Context>,
) -> Result<Requeue, Error> {
    let api = namespaced_api(restore.as_ref(), "VolumeRestore", &context)?;
    if let Some(requeue) = until_caches_synced(&context) {
        return Ok(requeue);
    }
    through_cancel_finalizer(
        &api,
        restore,
        |restore| apply(restore, &context),
        |restore| cleanup(restore, &context),
    )
    .await
}

/// The destination namespaces a restore may write into: those of its
/// selection, or, before it is made, every namespace (the selection
/// decides which).
fn destination_namespaces(restore: &VolumeRestore) -> Option<BTreeSet<String>> {
    let selection = restore.status.as_ref().map(|status| &status.selection)?;
    (!selection.is_empty()).then(|| {
        selection
            .iter()
            .map(|volume| volume.namespace.clone())
            .collect()
    })
}

/// Read what deciding on `restore` needs from the caches, once.
fn observe_caches(restore: Arc<VolumeRestore>, context: &Context) -> RestoreObservation {
    let stores = &context.stores;
    let uid = restore.uid().unwrap_or_default();
    let namespace = restore.namespace().unwrap_or_default();
    let scope = destination_namespaces(&restore);
    let in_scope = |object_namespace: Option<String>| match (&scope, object_namespace) {
        (None, Some(_)) => true,
        (Some(scope), Some(namespace)) => scope.contains(&namespace),
        (_, None) => false,
    };
    let claims = stores
        .claims
        .state_filter(|claim| in_scope(claim.namespace()));
    let bound_volumes: BTreeSet<String> = claims
        .iter()
        .filter_map(|claim| claim.spec.as_ref()?.volume_name.clone())
        .collect();
    let volumes = stores.volumes.state_filter(|volume| {
        bound_volumes.contains(&volume.name_any())
            || volume
                .spec
                .as_ref()
                .and_then(|spec| spec.claim_ref.as_ref())
                .and_then(|reference| reference.namespace.clone())
                .is_some_and(|claim_namespace| in_scope(Some(claim_namespace)))
    });
    RestoreObservation {
        staging: observe_staging(
            &uid,
            &namespace,
            |transfer| labelled_as_owned_by(transfer, &uid),
            context,
        ),
        snapshots: None,
        classes: stores.classes.state(),
        namespaces: stores
            .namespaces
            .state()
            .iter()
            .map(|namespace| namespace.name_any())
            .collect(),
        claims,
        volumes,
        cluster: None,
        restore,
    }
}

/// The cluster's objects a restore's plan is made from: the destination
/// namespaces' pods and claims, every node, volume and class.
fn cluster_objects(restore: &VolumeRestore, context: &Context) -> ClusterObjects {
    let scope = destination_namespaces(restore).unwrap_or_default();
    let in_scope =
        |namespace: Option<String>| namespace.is_some_and(|namespace| scope.contains(&namespace));
    context.stores.cluster_objects_in(in_scope)
}

/// The observation, with the location's snapshots while there is no
/// selection, the cluster's objects while there is no plan, and the
/// credentials when a stage pod is to be created.
async fn observe(
    restore: Arc<VolumeRestore>,
    context: &Context,
) -> Result<RestoreObservation, Error> {
    let mut observation = observe_caches(restore, context);
    let restore = observation.restore.clone();
    if needs_snapshots(&restore) {
        observation.snapshots = list_snapshots(&observation, context).await?;
    }
    if needs_cluster(&restore) {
        observation.cluster = Some(cluster_objects(&restore, context));
    }
    if needs_credentials(&observation) {
        let (_, location) = location_of(&observation);
        let (credentials, password) = stage_pod_secrets(location, context).await?;
        observation.staging.credentials = Some(credentials);
        observation.staging.password = password;
    }
    Ok(observation)
}

/// The restore's storage location and its state
/// ([`crate::reconcile::restore::restore_location`]).
fn location_of(
    observation: &RestoreObservation,
) -> (
    crate::reconcile::backup_status::StorageState,
    Option<&crate::api::BackupStorageLocation>,
) {
    crate::reconcile::restore::restore_location(
        &observation.restore,
        &observation.staging.locations,
    )
}

/// List the snapshots of the restore's location, when it is Available.
/// A failure to read is an outcome the decision reports, not an error:
/// the restore says why and tries again.
async fn list_snapshots(
    observation: &RestoreObservation,
    context: &Context,
) -> Result<Option<Result<Vec<ListedSnapshot>, String>>, Error> {
    let (state, location) = location_of(observation);
    let (Some(location), crate::reconcile::backup_status::StorageState::Available { .. }) =
        (location, state)
    else {
        return Ok(None);
    };
    let url = repository_url(&location.spec);
    let listing = async {
        let repository = match open_repository(location, &context.client).await? {
            Ok(opened) => opened.repository,
            Err(problem) => return Ok(Err(problem)),
        };
        let listed = repository
            .list_snapshots()
            .await
            .map_err(|error| crate::error_chain(&error));
        Ok::<_, Error>(listed.map(|(snapshots, unreadable)| {
            for problem in unreadable {
                warn!(location = %url, "a snapshot cannot be read and is left out: {}", crate::error_chain(&problem));
            }
            snapshots
                .into_iter()
                .map(|(id, snapshot)| ListedSnapshot {
                    id: id.to_hex(),
                    snapshot,
                })
                .collect()
        }))
    };
    Ok(Some(
        match tokio::time::timeout(Duration::from_secs(SNAPSHOT_LIST_TIMEOUT_SECONDS), listing)
            .await
        {
            Ok(result) => result?,
            Err(_) => Err(format!(
                "listing the snapshots of {url} took more than {SNAPSHOT_LIST_TIMEOUT_SECONDS}s"
            )),
        },
    ))
}

async fn apply(restore: Arc<VolumeRestore>, context: &Context) -> Result<Requeue, Error> {
    let observation = observe(restore, context).await?;
    let restore = observation.restore.clone();
    let decision = decide(&observation, &clock::now()).map_err(|source| Error::Restore {
        name: namespaced_name(restore.as_ref()),
        source,
    })?;
    let calls = OwnerCalls {
        claim: ApiCall::ClaimRestore,
        write_status: ApiCall::WriteRestoreStatus,
        noun: "restore",
    };
    carry_out(decision, restore.as_ref(), context, calls).await
}

/// Cancel: stop the agents, release the stage pods, delete the transfers,
/// bounded by [`CLEANUP_TIMEOUT_SECONDS`]. The claims stay.
async fn cleanup(restore: Arc<VolumeRestore>, context: &Context) -> Result<Requeue, Error> {
    let uid = restore.uid().unwrap_or_default();
    context.status_writes.forget(&uid);
    let observation = observe_caches(restore, context);
    let restore = observation.restore.clone();
    let actions = decide_cancel(&observation, &clock::now());
    if !cancel_within_timeout(execute(actions, restore.as_ref(), context)).await? {
        warn!(
            "cleanup did not finish in {CLEANUP_TIMEOUT_SECONDS}s; releasing the finalizer, stage pods of this restore may remain"
        );
    }
    info!(
        "canceled and cleaned up; restored claims stay (those not verified are labelled incomplete)"
    );
    Ok(Requeue::await_change())
}
