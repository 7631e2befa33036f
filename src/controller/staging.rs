//! What the reconcilers of backups and restores do alike: wait for the
//! caches, reconcile through the cancel finalizer, observe the part of
//! their observations they share
//! ([`crate::reconcile::staging::StagingObservation`]) from the caches, read
//! the location's credentials file and repository password a new stage pod
//! copies from its Secrets, and carry out a cancel within a bounded time.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::Action as Requeue;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::debug;

use crate::api::labels::{CANCEL_FINALIZER, labelled_as_owned_by};
use crate::api::{BackupStorageLocation, VolumeTransfer};
use crate::controller::Context;
use crate::controller::error::Error;
#[cfg(doc)]
use crate::controller::execute::execute;
use crate::controller::execute::{Executed, namespaced_name};
use crate::controller::location::{password_of, read_credentials};
use crate::reconcile::ownership::ControllerSettings;
use crate::reconcile::staging::StagingObservation;
use crate::store::S3Credentials;

/// Upper bound on the cancel cleanup; the finalizer is released after it.
pub const CLEANUP_TIMEOUT_SECONDS: u64 = 30;
/// Seconds before an object reconciled while the caches are still listing
/// is looked at again.
const CACHE_SYNC_RETRY_SECONDS: u64 = 1;

/// The API of `object`'s kind (`kind`, for the error) in its namespace.
pub fn namespaced_api<K>(object: &K, kind: &'static str, context: &Context) -> Result<Api<K>, Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    let namespace = object.namespace().ok_or(Error::MissingField {
        kind,
        field: "metadata.namespace",
    })?;
    Ok(Api::namespaced(context.client.clone(), &namespace))
}

/// When to look again while the caches are still listing (`None` once
/// they have all listed). Every decision reads the caches: claims and pods
/// for the plan, transfers and stage pods for the children, leases for
/// adoption (an unsynced lease cache makes every replica look gone).
pub fn until_caches_synced(context: &Context) -> Option<Requeue> {
    if context.readiness.caches_synced() {
        return None;
    }
    debug!(
        waiting_for = ?context.readiness.problem(),
        "caches still listing; looking again in {CACHE_SYNC_RETRY_SECONDS}s"
    );
    Some(Requeue::requeue(Duration::from_secs(
        CACHE_SYNC_RETRY_SECONDS,
    )))
}

/// Reconcile `object` through the `haulage.dev/cancel` finalizer: `apply`
/// while it lives, `cleanup` once it is being deleted (the finalizer is
/// released when that returns).
pub async fn through_cancel_finalizer<K, A, C>(
    api: &Api<K>,
    object: Arc<K>,
    apply: impl FnOnce(Arc<K>) -> A,
    cleanup: impl FnOnce(Arc<K>) -> C,
) -> Result<Requeue, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug,
    A: Future<Output = Result<Requeue, Error>>,
    C: Future<Output = Result<Requeue, Error>>,
{
    let name = namespaced_name(object.as_ref());
    finalizer(api, CANCEL_FINALIZER, object, |event| async move {
        match event {
            Finalizer::Apply(object) => apply(object).await,
            Finalizer::Cleanup(object) => cleanup(object).await,
        }
    })
    .await
    .map_err(|source| Error::Finalizer {
        name,
        source: Box::new(source),
    })
}

/// Carry out a cancel (`work`: the [`execute`] of its actions), bounded
/// by [`CLEANUP_TIMEOUT_SECONDS`]; returns whether it finished in time
/// (after it the finalizer is released anyway).
pub async fn cancel_within_timeout(
    work: impl Future<Output = Result<Executed, Error>>,
) -> Result<bool, Error> {
    match tokio::time::timeout(Duration::from_secs(CLEANUP_TIMEOUT_SECONDS), work).await {
        Ok(result) => result.map(|_| true),
        Err(_) => Ok(false),
    }
}

/// What the caches and this replica's memory hold for the backup or
/// restore with UID `uid` in `namespace`: its stage pods (those labelled
/// with its UID), the transfers `owns_transfer` says are its, the
/// locations of its namespace, the replicas' leases and what a new stage
/// pod is built from; no credentials (see [`stage_pod_secrets`]).
pub fn observe_staging(
    uid: &str,
    namespace: &str,
    owns_transfer: impl Fn(&VolumeTransfer) -> bool,
    context: &Context,
) -> StagingObservation {
    let stores = &context.stores;
    let config = &context.config;
    let pods = stores
        .pods
        .state_filter(|pod| labelled_as_owned_by(pod, uid));
    let deleted_pods = pods
        .iter()
        .filter_map(|pod| pod.uid())
        .filter(|pod_uid| context.deleted_pods.contains(pod_uid))
        .collect();
    StagingObservation {
        settings: ControllerSettings {
            identity: config.identity.clone(),
            agent_image: config.agent_image.clone(),
            pinning: config.pinning,
            agent_lost_seconds: config.agent_lost_seconds,
            checkpoint_seconds: config.checkpoint_seconds,
        },
        lease_fresh: context.heartbeat.is_fresh(config.replica_lease_seconds),
        api_outages: context.readiness.api_outages(),
        leases: super::replicas::cached(&stores.leases),
        locations: stores
            .locations
            .state_filter(|location| location.namespace().as_deref() == Some(namespace)),
        nodes: stores.nodes.state(),
        transfers: stores
            .transfers
            .state_filter(|transfer| owns_transfer(transfer)),
        pods,
        roles: stores.roles.state_filter(|role| {
            labelled_as_owned_by(role, uid)
                && !role
                    .uid()
                    .is_some_and(|role_uid| context.released_roles.contains(&role_uid))
        }),
        deleted_pods,
        since_last_status_write: context.status_writes.since(uid),
        credentials: None,
        password: None,
        policies: stores.policies.state(),
        limit_minimums: stores.limit_minimums(),
    }
}

/// The bytes under the credentials key of `location`'s Secret, and the
/// credentials they hold.
pub async fn credentials_file(
    location: &BackupStorageLocation,
    context: &Context,
) -> Result<(ByteString, S3Credentials), Error> {
    let secrets: Api<Secret> = Api::namespaced(
        context.client.clone(),
        &location.namespace().unwrap_or_default(),
    );
    match read_credentials(&secrets, &location.spec).await? {
        Ok((secret, credentials)) => Ok((
            secret
                .data
                .and_then(|mut data| data.remove(&location.spec.credential.key))
                .unwrap_or_default(),
            credentials,
        )),
        Err(message) => Err(Error::Credentials {
            location: location.name_any(),
            message,
        }),
    }
}

/// What the stage pods about to be created copy from the Secrets of
/// their `location`: its credentials file ([`credentials_file`]; empty
/// when no usable location is named) and, for a location with
/// `spec.encryption`, the repository's password.
pub async fn stage_pod_secrets(
    location: Option<&BackupStorageLocation>,
    context: &Context,
) -> Result<(ByteString, Option<ByteString>), Error> {
    let Some(location) = location else {
        return Ok((ByteString(Vec::new()), None));
    };
    let (credentials, _) = credentials_file(location, context).await?;
    let password = match password_of(location, &context.client).await? {
        Ok(password) => password.map(|password| ByteString(password.as_bytes().to_vec())),
        Err(message) => {
            return Err(Error::Credentials {
                location: location.name_any(),
                message,
            });
        }
    };
    Ok((credentials, password))
}
