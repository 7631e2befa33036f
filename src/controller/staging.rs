//! What the reconcilers of backups and restores observe alike: the part of
//! their observations they share ([`crate::reconcile::staging::StagingObservation`]),
//! from the caches, and the location's credentials file and repository
//! password a new stage pod copies, read from its Secrets.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};

use crate::api::labels::OWNER_UID_LABEL;
use crate::api::{BackupStorageLocation, VolumeTransfer};
use crate::controller::Context;
use crate::controller::error::Error;
use crate::controller::location::{password_of, read_credentials};
use crate::reconcile::ownership::ControllerSettings;
use crate::reconcile::staging::StagingObservation;
use crate::store::S3Credentials;

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
        .state_filter(|pod| pod.labels().get(OWNER_UID_LABEL).map(String::as_str) == Some(uid));
    let replaced_pods = pods
        .iter()
        .filter_map(|pod| pod.uid())
        .filter(|pod_uid| context.replaced_pods.contains(pod_uid))
        .collect();
    StagingObservation {
        settings: ControllerSettings {
            identity: config.identity.clone(),
            agent_image: config.agent_image.clone(),
            pinning: config.pinning,
            agent_lost_seconds: config.agent_lost_seconds,
        },
        lease_fresh: context.heartbeat.is_fresh(config.replica_lease_seconds),
        leases: super::replicas::cached(&stores.leases),
        locations: stores
            .locations
            .state_filter(|location| location.namespace().as_deref() == Some(namespace)),
        nodes: stores.nodes.state(),
        transfers: stores
            .transfers
            .state_filter(|transfer| owns_transfer(transfer)),
        pods,
        replaced_pods,
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
