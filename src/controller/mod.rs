//! `haulage controller`: kube-runtime controllers over shared reflector
//! caches (the API server sees one watch per kind, never list polling).
//!
//! - [`admission`]: the pure admission function (caps, FIFO queue,
//!   bandwidth split); [`admitter`]: the loop that feeds it from the caches
//!   and writes its decisions; [`lease`]: the Lease that makes one replica
//!   at a time the admitter.
//! - [`backup`]: the VolumeBackup reconciler (claim, storage, plan,
//!   children, roll-up; the cancel finalizer).
//! - [`location`]: the minimal BackupStorageLocation prober that sets its
//!   phase.
//! - [`status`]: `next_status`, the pure VolumeBackup status function.
//! - [`children`]: the pure desired objects of a plan (transfers, stage
//!   pods, agent RBAC).
//! - [`error`]: one error variant per failed call, transient or permanent.
//! - [`health`]: `/healthz` and `/readyz` (ready once the caches synced).

pub mod admission;
pub mod admitter;
pub mod backup;
pub mod children;
pub mod error;
pub mod health;
pub mod lease;
pub mod location;
pub mod status;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::{Action, Config as ControllerConfig};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::labels::{CONTROLLER_FIELD_MANAGER, SYSTEM_NAMESPACE};
use crate::api::{BackupStorageLocation, StoragePolicy, VolumeBackup, VolumeTransfer};
use crate::plan::spec::Pinning;
pub use error::Error;

/// Server-side apply field manager of every controller write.
pub const FIELD_MANAGER: &str = CONTROLLER_FIELD_MANAGER;
/// Default agent image of stage pods.
pub const DEFAULT_AGENT_IMAGE: &str = "ghcr.io/haulage-dev/mover-agent:0.1.0";
/// Default address of the health endpoints.
pub const DEFAULT_HEALTH_ADDRESS: &str = "0.0.0.0:8080";
/// Default number of objects reconciled at once per controller.
pub const DEFAULT_CONCURRENCY: u16 = 8;
/// Default cap on volumes moved at once in the whole cluster: enough to
/// keep a few storage systems and nodes busy (a stage pod moves about
/// 100 MB/s, so 16 saturate a 10 Gb/s uplink twice over) while a migration
/// of thousands of claims cannot start thousands of stage pods at once;
/// StoragePolicies narrow it per storage.
pub const DEFAULT_MAX_CONCURRENT_VOLUMES: u32 = 16;
/// Default cap on volumes moved at once per node: a node's network and CPU
/// are shared with its workloads, and a stage pod (128Mi) moves two volumes
/// at once (the agent's `--parallel-volumes`); more would only queue inside
/// the pod while holding slots other nodes could use.
pub const DEFAULT_MAX_VOLUMES_PER_NODE: u32 = 2;
/// Seconds between retries of a transient failure.
const TRANSIENT_RETRY_SECONDS: u64 = 5;
/// Seconds between retries of a permanent failure (a user must act; a
/// slow retry notices when they did).
const PERMANENT_RETRY_SECONDS: u64 = 120;
/// Events buffered per shared cache subscriber.
const SUBSCRIBER_BUFFER: usize = 256;

/// How stage pods are pinned to their node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PinningArg {
    /// Required node affinity on `metadata.name` (the scheduler still runs).
    NodeAffinity,
    /// `spec.nodeName` (bypasses the scheduler).
    NodeName,
}

/// `haulage controller` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ControllerArgs {
    /// Namespace of the controller, its BackupStorageLocations, their
    /// Secrets and the VolumeBackups it serves (its own, from the downward
    /// API, in the Deployment).
    #[arg(long, env = "POD_NAMESPACE", default_value = SYSTEM_NAMESPACE)]
    pub namespace: String,
    /// This replica's identity in ownership claims (default: `$POD_NAME`,
    /// then `$HOSTNAME`).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Image of the mover agent in stage pods.
    #[arg(long, env = "HAULAGE_AGENT_IMAGE", default_value = DEFAULT_AGENT_IMAGE)]
    pub agent_image: String,
    /// Address of `/healthz` and `/readyz`.
    #[arg(long, env = "HAULAGE_HEALTH_ADDRESS", default_value = DEFAULT_HEALTH_ADDRESS)]
    pub health_address: SocketAddr,
    /// Objects reconciled at once per controller.
    #[arg(long, env = "HAULAGE_CONCURRENCY", default_value_t = DEFAULT_CONCURRENCY)]
    pub concurrency: u16,
    /// How stage pods are pinned to their node.
    #[arg(
        long,
        env = "HAULAGE_PINNING",
        value_enum,
        default_value = "node-affinity"
    )]
    pub pinning: PinningArg,
    /// Volumes moved at once in the whole cluster, over all backups and
    /// restores (0: no cap).
    #[arg(long, env = "HAULAGE_MAX_CONCURRENT_VOLUMES", default_value_t = DEFAULT_MAX_CONCURRENT_VOLUMES)]
    pub max_concurrent_volumes: u32,
    /// Volumes moved at once per node (0: no cap).
    #[arg(long, env = "HAULAGE_MAX_VOLUMES_PER_NODE", default_value_t = DEFAULT_MAX_VOLUMES_PER_NODE)]
    pub max_volumes_per_node: u32,
}

/// The controller's validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Namespace of the controller, its BSLs and VolumeBackups.
    pub namespace: String,
    /// This replica's identity.
    pub identity: String,
    /// Agent image.
    pub agent_image: String,
    /// Health endpoint address.
    pub health_address: SocketAddr,
    /// Objects reconciled at once per controller (at least 1).
    pub concurrency: u16,
    /// Stage pod pinning.
    pub pinning: Pinning,
    /// Volumes moved at once in the cluster (`None`: no cap).
    pub max_concurrent_volumes: Option<u32>,
    /// Volumes moved at once per node (`None`: no cap).
    pub max_volumes_per_node: Option<u32>,
}

/// Arguments that do not make a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Neither `--identity`, `$POD_NAME` nor `$HOSTNAME` is set.
    #[error("no replica identity: pass --identity or set POD_NAME (downward API) or HOSTNAME")]
    NoIdentity,
    /// `--concurrency 0`.
    #[error("--concurrency must be at least 1")]
    ZeroConcurrency,
}

impl ControllerArgs {
    /// Validate into a [`Config`]; `hostname` is `$HOSTNAME`.
    pub fn into_config(self, hostname: Option<String>) -> Result<Config, ConfigError> {
        let identity = self
            .identity
            .filter(|identity| !identity.is_empty())
            .or(hostname.filter(|name| !name.is_empty()))
            .ok_or(ConfigError::NoIdentity)?;
        if self.concurrency == 0 {
            return Err(ConfigError::ZeroConcurrency);
        }
        Ok(Config {
            namespace: self.namespace,
            identity,
            agent_image: self.agent_image,
            health_address: self.health_address,
            concurrency: self.concurrency,
            pinning: match self.pinning {
                PinningArg::NodeAffinity => Pinning::RequiredNodeAffinity,
                PinningArg::NodeName => Pinning::NodeName,
            },
            max_concurrent_volumes: (self.max_concurrent_volumes > 0)
                .then_some(self.max_concurrent_volumes),
            max_volumes_per_node: (self.max_volumes_per_node > 0)
                .then_some(self.max_volumes_per_node),
        })
    }
}

/// The shared caches the reconcilers read.
#[derive(Clone)]
pub struct Stores {
    /// BackupStorageLocations in the controller's namespace.
    pub locations: Store<BackupStorageLocation>,
    /// VolumeTransfers in every namespace.
    pub transfers: Store<VolumeTransfer>,
    /// PersistentVolumeClaims.
    pub claims: Store<PersistentVolumeClaim>,
    /// Pods.
    pub pods: Store<Pod>,
    /// Nodes.
    pub nodes: Store<Node>,
    /// PersistentVolumes.
    pub volumes: Store<PersistentVolume>,
    /// StorageClasses.
    pub classes: Store<StorageClass>,
    /// StoragePolicies (cluster-scoped).
    pub policies: Store<StoragePolicy>,
}

/// What every reconcile gets.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Validated configuration.
    pub config: Config,
    /// Shared caches.
    pub stores: Stores,
}

/// The controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A shared cache refused a subscriber (only a non-shared one does).
    #[error("failed to subscribe to a shared cache")]
    Subscribe,
    /// The health endpoint could not listen.
    #[error("cannot listen on {address} for health checks")]
    Health {
        /// The address.
        address: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
}

fn error_policy<K>(object: Arc<K>, error: &Error, _context: Arc<Context>) -> Action
where
    K: kube::Resource<DynamicType = ()>,
{
    warn!(
        object = %object.name_any(),
        error = %error,
        kind = error.label(),
        transient = error.is_transient(),
        "reconcile failed"
    );
    if error.is_transient() {
        Action::requeue(Duration::from_secs(TRANSIENT_RETRY_SECONDS))
    } else {
        Action::requeue(Duration::from_secs(PERMANENT_RETRY_SECONDS))
    }
}

/// Run a watcher into a cache until the process ends.
fn spawn_reflector<K>(api: Api<K>, writer: reflector::store::Writer<K>)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    tokio::spawn(
        watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer)
            .for_each(|_| futures::future::ready(())),
    );
}

/// Run the controllers until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    client: Client,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let ready = Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind(config.health_address)
        .await
        .map_err(|source| RunError::Health {
            address: config.health_address,
            source,
        })?;
    tokio::spawn(health::serve(listener, ready.clone(), shutdown.clone()));

    let (claims, claims_writer) = reflector::store();
    spawn_reflector(
        Api::<PersistentVolumeClaim>::all(client.clone()),
        claims_writer,
    );
    let (pods, pods_writer) = reflector::store();
    spawn_reflector(Api::<Pod>::all(client.clone()), pods_writer);
    let (nodes, nodes_writer) = reflector::store();
    spawn_reflector(Api::<Node>::all(client.clone()), nodes_writer);
    let (volumes, volumes_writer) = reflector::store();
    spawn_reflector(Api::<PersistentVolume>::all(client.clone()), volumes_writer);
    let (classes, classes_writer) = reflector::store();
    spawn_reflector(Api::<StorageClass>::all(client.clone()), classes_writer);

    // Shared caches: each feeds a controller and triggers the other.
    let (backups, backups_writer) = reflector::store_shared::<VolumeBackup>(SUBSCRIBER_BUFFER);
    let backup_events = backups_writer.subscribe();
    let (locations, locations_writer) =
        reflector::store_shared::<BackupStorageLocation>(SUBSCRIBER_BUFFER);
    let location_events = locations_writer.subscribe();
    let location_events_for_backups = locations_writer.subscribe();
    let (transfers, transfers_writer) =
        reflector::store_shared::<VolumeTransfer>(SUBSCRIBER_BUFFER);
    let transfer_events = transfers_writer.subscribe();
    let transfer_events_for_admission = transfers_writer.subscribe();
    let location_events_for_admission = locations_writer.subscribe();
    let (policies, policies_writer) = reflector::store_shared::<StoragePolicy>(SUBSCRIBER_BUFFER);
    let policy_events = policies_writer.subscribe();
    let (
        Some(backup_events),
        Some(location_events),
        Some(location_events_for_backups),
        Some(transfer_events),
        Some(transfer_events_for_admission),
        Some(location_events_for_admission),
        Some(policy_events),
    ) = (
        backup_events,
        location_events,
        location_events_for_backups,
        transfer_events,
        transfer_events_for_admission,
        location_events_for_admission,
        policy_events,
    )
    else {
        return Err(RunError::Subscribe);
    };
    tokio::spawn(
        watcher(
            Api::<StoragePolicy>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect_shared(policies_writer)
        .for_each(|_| futures::future::ready(())),
    );
    tokio::spawn(
        watcher(
            Api::<VolumeBackup>::namespaced(client.clone(), &config.namespace),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect_shared(backups_writer)
        .for_each(|_| futures::future::ready(())),
    );
    tokio::spawn(
        watcher(
            Api::<BackupStorageLocation>::namespaced(client.clone(), &config.namespace),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect_shared(locations_writer)
        .for_each(|_| futures::future::ready(())),
    );
    tokio::spawn(
        watcher(
            Api::<VolumeTransfer>::all(client.clone()),
            watcher::Config::default().labels(&format!(
                "{}={}",
                crate::api::labels::MANAGED_BY_LABEL,
                crate::api::labels::MANAGED_BY
            )),
        )
        .default_backoff()
        .reflect_shared(transfers_writer)
        .for_each(|_| futures::future::ready(())),
    );

    let stores = Stores {
        locations: locations.clone(),
        transfers: transfers.clone(),
        claims,
        pods,
        nodes,
        volumes,
        classes,
        policies,
    };
    {
        let stores = stores.clone();
        let backups = backups.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let synced = futures::future::join_all([
                Box::pin(stores.locations.wait_until_ready())
                    as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>,
                Box::pin(stores.transfers.wait_until_ready()),
                Box::pin(stores.policies.wait_until_ready()),
                Box::pin(backups.wait_until_ready()),
            ])
            .await;
            let others = futures::future::join_all([
                Box::pin(stores.claims.wait_until_ready())
                    as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>,
                Box::pin(stores.pods.wait_until_ready()),
            ])
            .await;
            let rest = (
                stores.nodes.wait_until_ready().await,
                stores.volumes.wait_until_ready().await,
                stores.classes.wait_until_ready().await,
            );
            if synced.iter().chain(others.iter()).all(Result::is_ok)
                && rest.0.is_ok()
                && rest.1.is_ok()
                && rest.2.is_ok()
            {
                info!("caches synced; ready");
                ready.store(true, Ordering::SeqCst);
            }
        });
    }

    let context = Arc::new(Context {
        client: client.clone(),
        config: config.clone(),
        stores,
    });
    // Admission: one replica at a time (the admission lease holder) runs
    // the admission loop, woken by changes of transfers, locations and
    // policies (each subscription drained at once, so a slow pass never
    // holds the shared caches back).
    let leadership = Arc::new(lease::Leadership::default());
    let lease_loop = tokio::spawn(lease::run(
        Api::namespaced(client.clone(), &config.namespace),
        config.identity.clone(),
        leadership.clone(),
        shutdown.clone(),
    ));
    let wake = Arc::new(tokio::sync::Notify::new());
    for events in [
        transfer_events_for_admission.map(|_| ()).boxed(),
        location_events_for_admission.map(|_| ()).boxed(),
        policy_events.map(|_| ()).boxed(),
    ] {
        let wake = wake.clone();
        tokio::spawn(events.for_each(move |()| {
            wake.notify_one();
            futures::future::ready(())
        }));
    }
    let admission = tokio::spawn(
        admitter::Admitter::new(context.clone(), leadership).run(wake, shutdown.clone()),
    );

    let controller_config = ControllerConfig::default().concurrency(config.concurrency);

    let backups_for_mapping = backups.clone();
    let backup_controller = Controller::for_shared_stream(backup_events, backups)
        .with_config(controller_config.clone())
        .watches_shared_stream(transfer_events, |transfer: Arc<VolumeTransfer>| {
            let reference = &transfer.spec.backup_ref;
            Some(ObjectRef::<VolumeBackup>::new(&reference.name).within(&reference.namespace))
        })
        .watches_shared_stream(
            location_events_for_backups,
            move |location: Arc<BackupStorageLocation>| {
                let namespace = location.namespace().unwrap_or_default();
                backups_for_mapping
                    .state()
                    .into_iter()
                    .filter(|backup| backup.namespace().as_deref() == Some(namespace.as_str()))
                    .filter(|backup| {
                        backup
                            .status
                            .as_ref()
                            .and_then(|status| status.phase)
                            .is_none_or(|phase| !phase.is_final())
                    })
                    .map(|backup| ObjectRef::from_obj(backup.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(backup::reconcile, error_policy, context.clone())
        .for_each(|_| futures::future::ready(()));

    let location_controller = Controller::for_shared_stream(location_events, locations)
        .with_config(controller_config)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(location::reconcile, error_policy, context)
        .for_each(|_| futures::future::ready(()));

    info!(identity = %config.identity, namespace = %config.namespace, "controller started");
    futures::future::join(backup_controller, location_controller).await;
    let _ = admission.await;
    // The lease is released on shutdown, so another replica admits at once.
    let _ = lease_loop.await;
    info!("controller stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        arguments: ControllerArgs,
    }

    #[test]
    fn the_identity_falls_back_to_the_hostname() {
        let wrapper = Wrapper::parse_from(["test", "--health-address", "127.0.0.1:0"]);
        let mut arguments = wrapper.arguments;
        arguments.identity = None;
        let config = arguments
            .clone()
            .into_config(Some("controller-7d9".to_string()))
            .expect("valid");
        assert_eq!(config.identity, "controller-7d9");
        assert_eq!(config.namespace, SYSTEM_NAMESPACE);
        assert!(matches!(
            arguments.into_config(None),
            Err(ConfigError::NoIdentity)
        ));
    }

    #[test]
    fn admission_caps_default_to_sixteen_and_two_and_zero_lifts_them() {
        let defaults = Wrapper::parse_from(["test", "--identity", "a"])
            .arguments
            .into_config(None)
            .expect("valid");
        assert_eq!(
            (
                defaults.max_concurrent_volumes,
                defaults.max_volumes_per_node
            ),
            (Some(16), Some(2))
        );
        let lifted = Wrapper::parse_from([
            "test",
            "--identity",
            "a",
            "--max-concurrent-volumes",
            "0",
            "--max-volumes-per-node",
            "3",
        ])
        .arguments
        .into_config(None)
        .expect("valid");
        assert_eq!(
            (lifted.max_concurrent_volumes, lifted.max_volumes_per_node),
            (None, Some(3))
        );
    }

    #[test]
    fn zero_concurrency_is_refused() {
        let wrapper = Wrapper::parse_from(["test", "--identity", "a", "--concurrency", "0"]);
        assert!(matches!(
            wrapper.arguments.into_config(None),
            Err(ConfigError::ZeroConcurrency)
        ));
    }
}
