//! `haulage controller`: the reconcilers of haulage's kinds over shared
//! reflector caches (the API server sees one watch per kind, never list
//! polling). Each reconciler is observe → decide → apply: it reads what it
//! needs from the caches into a plain value, asks the pure decision in
//! [`crate::reconcile`], and carries out what comes back.
//!
//! - [`backup`]: the VolumeBackup reconciler (through the cancel finalizer).
//! - [`restore`]: the VolumeRestore reconciler (the same shape; it also
//!   lists the location's snapshots once, to select them).
//! - [`location`]: the BackupStorageLocation reconciler and its probe (the
//!   object round trip and the repository check), the periodic summary.
//! - [`admission`]: the admission loop, on the replica holding the
//!   admission Lease ([`lease`]): the caps' input from the caches, the
//!   writes of [`crate::reconcile::admission`]'s decisions.
//! - [`maintenance`]: the locations' scheduled prunes, on the same replica.
//! - [`execute`]: carries out the actions decisions return (stage pods and
//!   their objects, deletions, transfer status writes, Events).
//! - [`replicas`]: each replica's liveness Lease and heartbeat.
//! - [`recent`]: moments this replica remembers by key (its last status
//!   write of each backup, the stage pods it replaced).
//! - [`error`]: one variant per failed call, transient or permanent.
//! - [`events`]: Kubernetes Events on transitions, for `kubectl describe`.
//! - [`health`]: `/healthz`, `/readyz` (caches synced, API server
//!   reachable) and `/metrics` on one listener.
//! - [`metrics`]: the Prometheus series, from the caches at scrape time,
//!   the transfer events and the reconcile wrappers.

pub mod admission;
pub mod backup;
pub mod error;
pub mod events;
pub mod execute;
pub mod health;
pub mod lease;
pub mod location;
pub mod maintenance;
pub mod metrics;
pub mod recent;
pub mod replicas;
pub mod restore;
pub mod staging;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::rbac::v1::Role;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::{Action, Config as ControllerConfig};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::labels::{CONTROLLER_FIELD_MANAGER, SYSTEM_NAMESPACE};
use crate::api::{
    BackupStorageLocation, StoragePolicy, VolumeBackup, VolumeRestore, VolumeTransfer,
};
use crate::reconcile::stage_pod::Operation;
use crate::reconcile::stage_pod::Pinning;
use crate::reconcile::staging::StagedStatus;
pub use error::Error;
use metrics::{
    BACKUP_CONTROLLER, ControllerMetrics, LOCATION_CONTROLLER, MetricCaches, RESTORE_CONTROLLER,
};

/// Server-side apply field manager of every controller write.
pub const FIELD_MANAGER: &str = CONTROLLER_FIELD_MANAGER;
/// Default agent image of stage pods: the one `tests/infra/build-images.sh` (and the
/// Containerfile) build for this version, as manifests/kustomization.yaml names it.
pub const DEFAULT_AGENT_IMAGE: &str = concat!(
    "ghcr.io/haulage-dev/mover-agent:",
    env!("CARGO_PKG_VERSION")
);
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
/// are shared with its workloads. A stage pod of the default 128Mi could
/// move four of its claims at once (what its memory holds), so on a node
/// this cap is what binds.
pub const DEFAULT_MAX_VOLUMES_PER_NODE: u32 = 2;
/// Seconds between retries of a transient failure.
const TRANSIENT_RETRY_SECONDS: u64 = 5;
/// Seconds between retries of a permanent failure (a user must act; a
/// slow retry notices when they did).
const PERMANENT_RETRY_SECONDS: u64 = 120;
/// How long a backup's last status write is remembered (far longer than
/// the progress-write interval; a finished backup is forgotten at once).
const STATUS_WRITE_MEMORY: Duration = Duration::from_secs(24 * 3600);
/// How long the UID of a stage pod this replica deleted is remembered,
/// and a released stage pod Role's.
const DELETED_POD_MEMORY: Duration = Duration::from_secs(3600);
/// Events buffered per shared cache subscriber.
const SUBSCRIBER_BUFFER: usize = 256;
/// Seconds between the storage-locations summary lines (one warning per
/// interval while there is no location or some are bad, never a stream).
pub const LOCATION_SUMMARY_INTERVAL_SECONDS: u64 = 60;

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
    /// Address of `/healthz`, `/readyz` and `/metrics`.
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
    /// Seconds this replica's liveness Lease lasts without renewal (renewed
    /// every 10 s); when it expires, other replicas adopt its backups.
    #[arg(
        long,
        env = "HAULAGE_REPLICA_LEASE_SECONDS",
        default_value_t = crate::reconcile::replicas::DEFAULT_LEASE_SECONDS,
        value_parser = clap::value_parser!(u32).range(i64::from(MIN_LEASE_SECONDS)..=3600)
    )]
    pub replica_lease_seconds: u32,
    /// Volumes moved at once in the whole cluster, over all backups and
    /// restores (0: no cap).
    #[arg(long, env = "HAULAGE_MAX_CONCURRENT_VOLUMES", default_value_t = DEFAULT_MAX_CONCURRENT_VOLUMES)]
    pub max_concurrent_volumes: u32,
    /// Volumes moved at once per node (0: no cap).
    #[arg(long, env = "HAULAGE_MAX_VOLUMES_PER_NODE", default_value_t = DEFAULT_MAX_VOLUMES_PER_NODE)]
    pub max_volumes_per_node: u32,
    /// Seconds a running agent may go without reporting before its stage
    /// pod is recreated (after 3 stage pods, its volumes fail).
    #[arg(
        long,
        env = "HAULAGE_AGENT_LOST_SECONDS",
        default_value_t = crate::reconcile::supervision::DEFAULT_AGENT_LOST_SECONDS,
        value_parser = clap::value_parser!(u32).range(i64::from(MIN_AGENT_LOST_SECONDS)..)
    )]
    pub agent_lost_seconds: u32,
    /// Seconds between two checkpoints of a backup in its agent, so that
    /// a recreated stage pod (a killed agent, a drained node) does not read
    /// again the files the volume had stored (default: the agent's, 60;
    /// 0: none).
    #[arg(long, env = "HAULAGE_CHECKPOINT_SECONDS")]
    pub checkpoint_seconds: Option<u32>,
}

/// Shortest time without a heartbeat before an agent counts as lost.
pub const MIN_AGENT_LOST_SECONDS: u32 = 10;

/// Shortest replica lease: one and a half renewal periods.
pub const MIN_LEASE_SECONDS: u32 = 15;

/// The controller's validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Namespace of the controller, its BSLs and VolumeBackups.
    pub namespace: String,
    /// This replica's identity.
    pub identity: String,
    /// Agent image.
    pub agent_image: String,
    /// Address of the health and metrics endpoints.
    pub health_address: SocketAddr,
    /// Objects reconciled at once per controller (at least 1).
    pub concurrency: u16,
    /// Stage pod pinning.
    pub pinning: Pinning,
    /// Seconds this replica's liveness Lease lasts without renewal.
    pub replica_lease_seconds: u32,
    /// Seconds a running agent may go without reporting.
    pub agent_lost_seconds: u32,
    /// Seconds between two checkpoints of a backup in its agent (`None`:
    /// the agent's default).
    pub checkpoint_seconds: Option<u32>,
    /// Volumes moved at once in the cluster (`None`: no cap).
    pub max_concurrent_volumes: Option<u32>,
    /// Volumes moved at once per node (`None`: no cap).
    pub max_volumes_per_node: Option<u32>,
}

impl Config {
    /// The defaults of `haulage controller` for `namespace` and `identity`
    /// (for embedding and tests: `Config { concurrency: 2, ..Config::new(..) }`).
    pub fn new(namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        Config {
            namespace: namespace.into(),
            identity: identity.into(),
            agent_image: DEFAULT_AGENT_IMAGE.to_string(),
            health_address: SocketAddr::from(([0, 0, 0, 0], 8080)),
            concurrency: DEFAULT_CONCURRENCY,
            pinning: Pinning::RequiredNodeAffinity,
            replica_lease_seconds: crate::reconcile::replicas::DEFAULT_LEASE_SECONDS,
            agent_lost_seconds: crate::reconcile::supervision::DEFAULT_AGENT_LOST_SECONDS,
            checkpoint_seconds: None,
            max_concurrent_volumes: Some(DEFAULT_MAX_CONCURRENT_VOLUMES),
            max_volumes_per_node: Some(DEFAULT_MAX_VOLUMES_PER_NODE),
        }
    }
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
            replica_lease_seconds: self.replica_lease_seconds.max(MIN_LEASE_SECONDS),
            agent_lost_seconds: self.agent_lost_seconds.max(MIN_AGENT_LOST_SECONDS),
            checkpoint_seconds: self.checkpoint_seconds,
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
    /// The Roles of stage pods (labelled as managed by haulage), in every
    /// namespace: what is left of a stage pod's access.
    pub roles: Store<Role>,
    /// Nodes.
    pub nodes: Store<Node>,
    /// PersistentVolumes.
    pub volumes: Store<PersistentVolume>,
    /// StorageClasses.
    pub classes: Store<StorageClass>,
    /// The replicas' liveness Leases in the controller's namespace.
    pub leases: Store<Lease>,
    /// StoragePolicies (cluster-scoped).
    pub policies: Store<StoragePolicy>,
    /// Namespaces (a restore's destinations must exist, or be created).
    pub namespaces: Store<k8s_openapi::api::core::v1::Namespace>,
    /// LimitRanges (a stage pod asks at least their container minimum).
    pub limit_ranges: Store<k8s_openapi::api::core::v1::LimitRange>,
    /// CSINodes (the planner counts their attach limits).
    pub csi_nodes: Store<k8s_openapi::api::storage::v1::CSINode>,
}

impl Stores {
    /// The cluster's objects a plan is made from: every node, CSI node,
    /// volume and class, the pods and claims of the namespaces `in_scope`
    /// accepts (one malformed object elsewhere must not stop a plan), and
    /// haulage's stage pods in every namespace (the planner counts what
    /// they move as load on their nodes).
    pub fn cluster_objects_in(
        &self,
        in_scope: impl Fn(Option<String>) -> bool,
    ) -> crate::plan::objects::ClusterObjects {
        crate::plan::objects::ClusterObjects {
            nodes: copies(&self.nodes, |_| true),
            csi_nodes: copies(&self.csi_nodes, |_| true),
            pods: copies(&self.pods, |pod| {
                in_scope(pod.namespace())
                    || crate::plan::facts::is_stage_pod(pod.metadata.labels.as_ref())
            }),
            claims: copies(&self.claims, |claim| in_scope(claim.namespace())),
            volumes: copies(&self.volumes, |_| true),
            storage_classes: copies(&self.classes, |_| true),
            limit_ranges: Vec::new(),
        }
    }

    /// The LimitRange minimum of each namespace that has one (the largest
    /// of its LimitRanges'); a LimitRange that cannot be read is left out
    /// with a warning.
    pub fn limit_minimums(
        &self,
    ) -> std::collections::BTreeMap<String, crate::plan::facts::ResourceMinimum> {
        let mut minimums: std::collections::BTreeMap<String, crate::plan::facts::ResourceMinimum> =
            std::collections::BTreeMap::new();
        for limit_range in self.limit_ranges.state() {
            let namespace = limit_range.namespace().unwrap_or_default();
            match crate::plan::objects::limit_range_minimum(&limit_range) {
                Ok(minimum) => {
                    let entry = minimums.entry(namespace).or_default();
                    entry.cpu_millis = entry.cpu_millis.max(minimum.cpu_millis);
                    entry.memory_bytes = entry.memory_bytes.max(minimum.memory_bytes);
                }
                Err(error) => warn!(%error, "a LimitRange cannot be read; stage pods ignore it"),
            }
        }
        minimums
    }
}

/// What every reconcile gets.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Validated configuration.
    pub config: Config,
    /// Shared caches.
    pub stores: Stores,
    /// When this replica last renewed its liveness lease.
    pub heartbeat: replicas::Heartbeat,
    /// Kubernetes Events publisher.
    pub events: events::Events,
    /// When this replica last wrote each running backup's status, by UID
    /// (the progress-write throttle).
    pub status_writes: recent::Recent,
    /// UIDs of stage pods this replica deleted, to replace them or to stop
    /// them once their volumes were final (kept an hour: a lagging cache
    /// must not get one judged or deleted twice).
    pub deleted_pods: recent::Recent,
    /// UIDs of stage pods' Roles this replica released (kept an hour: a
    /// cache that does not show a Role's deletion yet must not get its
    /// stage pod released twice).
    pub released_roles: recent::Recent,
    /// Which caches have synced (wait here, never on a store).
    pub readiness: Arc<health::Readiness>,
    /// This cluster's identity, the UID of its `kube-system` namespace (as
    /// Velero records it), written into every snapshot's claim record;
    /// `None` when it could not be read.
    pub cluster_id: Option<String>,
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

/// kube-runtime's requeue for a decision's.
pub(crate) fn requeue(requeue: crate::reconcile::action::Requeue) -> Action {
    match requeue {
        crate::reconcile::action::Requeue::After(duration) => Action::requeue(duration),
        crate::reconcile::action::Requeue::OnChange => Action::await_change(),
    }
}

fn error_policy<K>(object: Arc<K>, error: &Error, _context: Arc<Context>) -> Action
where
    K: kube::Resource<DynamicType = ()>,
{
    warn!(
        object = %object.name_any(),
        error = %error.chain(),
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

/// `reconcile` with its duration recorded under `controller`.
fn timed<K, F, Fut>(
    controller: &'static str,
    metrics: Arc<ControllerMetrics>,
    reconcile: F,
) -> impl FnMut(Arc<K>, Arc<Context>) -> futures::future::BoxFuture<'static, Result<Action, Error>>
where
    K: Send + Sync + 'static,
    F: Fn(Arc<K>, Arc<Context>) -> Fut,
    Fut: std::future::Future<Output = Result<Action, Error>> + Send + 'static,
{
    move |object, context| {
        let metrics = metrics.clone();
        let started = Instant::now();
        let reconciled = reconcile(object, context);
        Box::pin(async move {
            let result = reconciled.await;
            metrics.observe_reconcile(controller, started.elapsed());
            result
        })
    }
}

/// [`error_policy`] with the error counted under `controller`.
fn counted<K>(
    controller: &'static str,
    metrics: Arc<ControllerMetrics>,
) -> impl Fn(Arc<K>, &Error, Arc<Context>) -> Action
where
    K: kube::Resource<DynamicType = ()>,
{
    move |object, error, context| {
        metrics.count_reconcile_error(controller, error);
        error_policy(object, error, context)
    }
}

/// Drop an object's `managedFields` before it is cached. The controller
/// never reads them (its writes are server-side applies built from
/// scratch, and no cached object is written back), and they are often the
/// largest part of a small object: with 10,000 PVCs and PVs in the caches,
/// pruning them took the controller's resident memory from 242 to
/// 138 MiB (debug build; docs/benchmarks.md, "Controller and agent
/// budgets").
fn without_managed_fields<K: kube::Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// The controller's caches by kind name, as `/readyz` and the logs name
/// them ([`health::Readiness`]).
pub(crate) mod cache {
    /// PersistentVolumeClaims, everywhere.
    pub const CLAIMS: &str = "persistentvolumeclaims";
    /// Pods, everywhere.
    pub const PODS: &str = "pods";
    /// haulage's Roles (those of stage pods), everywhere.
    pub const ROLES: &str = "roles";
    /// Nodes.
    pub const NODES: &str = "nodes";
    /// PersistentVolumes.
    pub const VOLUMES: &str = "persistentvolumes";
    /// StorageClasses.
    pub const CLASSES: &str = "storageclasses";
    /// The replicas' liveness Leases.
    pub const LEASES: &str = "leases";
    /// StoragePolicies.
    pub const POLICIES: &str = "storagepolicies";
    /// VolumeBackups in the controller's namespace.
    pub const BACKUPS: &str = "volumebackups";
    /// BackupStorageLocations in the controller's namespace.
    pub const LOCATIONS: &str = "backupstoragelocations";
    /// VolumeRestores in the controller's namespace.
    pub const RESTORES: &str = "volumerestores";
    /// Namespaces.
    pub const NAMESPACES: &str = "namespaces";
    /// LimitRanges, everywhere.
    pub const LIMIT_RANGES: &str = "limitranges";
    /// CSINodes.
    pub const CSI_NODES: &str = "csinodes";
    /// haulage's VolumeTransfers, everywhere.
    pub const TRANSFERS: &str = "volumetransfers";
    /// Every cache: the controller is not ready until each has listed.
    pub const ALL: [&str; 15] = [
        CLAIMS,
        PODS,
        ROLES,
        NODES,
        VOLUMES,
        CLASSES,
        LEASES,
        POLICIES,
        BACKUPS,
        LOCATIONS,
        TRANSFERS,
        RESTORES,
        NAMESPACES,
        LIMIT_RANGES,
        CSI_NODES,
    ];
}

/// Log a failed watch of `kind` with what to do about it.
fn log_watch_error(kind: &'static str, error: &watcher::Error) {
    match crate::watch::error_code(error) {
        // The API server no longer keeps the resourceVersion a watch or
        // a paged list went on from: routine, the watcher lists again.
        Some(410) => info!(kind, "watch of {kind} expired; listing again"),
        Some(403) => {
            warn!(kind, %error, "the controller may not list or watch {kind}; check its ClusterRole (manifests/rbac-controller.yaml); retrying with backoff")
        }
        Some(404) => {
            warn!(kind, %error, "the API server does not serve {kind}; install the haulage CRDs (kubectl apply -k manifests/); retrying with backoff")
        }
        _ => warn!(kind, %error, "watching {kind} failed; retrying with backoff"),
    }
}

/// A kind the controller caches: a Kubernetes object it can watch and keep.
trait Cached:
    kube::Resource<DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Cached for K where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// The backup or restore (`operation`) a stage pod belongs to, by its
/// labels: `(namespace, name)`.
fn owner_of_stage_pod(pod: &Pod, operation: Operation) -> Option<(String, String)> {
    let labels = pod.labels();
    if labels
        .get(crate::api::labels::OPERATION_LABEL)
        .map(String::as_str)
        != Some(operation.as_str())
    {
        return None;
    }
    Some((
        labels
            .get(crate::api::labels::OWNER_NAMESPACE_LABEL)?
            .clone(),
        labels.get(crate::api::labels::OWNER_NAME_LABEL)?.clone(),
    ))
}

/// The other locations marked default in `changed`'s namespace, whose
/// `UniqueDefault` condition a change (or the deletion) of `changed` can
/// change.
fn other_defaults(
    locations: &Store<BackupStorageLocation>,
    changed: &BackupStorageLocation,
) -> Vec<ObjectRef<BackupStorageLocation>> {
    let namespace = changed.namespace();
    locations
        .state()
        .into_iter()
        .filter(|other| other.namespace() == namespace && other.spec.is_default)
        .filter(|other| other.name_any() != changed.name_any())
        .map(|other| ObjectRef::from_obj(other.as_ref()))
        .collect()
}

/// Run the controllers until `shutdown` is cancelled, with the health and
/// metrics endpoints on `config.health_address`.
pub async fn run(
    config: Config,
    client: Client,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let listener = tokio::net::TcpListener::bind(config.health_address)
        .await
        .map_err(|source| RunError::Health {
            address: config.health_address,
            source,
        })?;
    run_with_listener(config, client, listener, shutdown).await
}

/// Write this replica's liveness lease and keep renewing it (until
/// `release` is cancelled); an API server that is not reachable yet is
/// waited for, retrying every 5 s. `None` when `shutdown` came first.
async fn start_replica_lease(
    client: &Client,
    config: &Config,
    heartbeat: &replicas::Heartbeat,
    release: &CancellationToken,
    shutdown: &CancellationToken,
) -> Option<tokio_util::task::AbortOnDropHandle<()>> {
    loop {
        match replicas::keep_alive(
            client.clone(),
            config.namespace.clone(),
            config.identity.clone(),
            config.replica_lease_seconds,
            heartbeat.clone(),
            release.clone(),
        )
        .await
        {
            Ok(task) => return Some(tokio_util::task::AbortOnDropHandle::new(task)),
            Err(error) => {
                warn!(%error, namespace = %config.namespace, "cannot write this replica's lease; retrying in 5s (check the API server and the controller's RBAC for leases)");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        }
    }
}

/// Copies of the objects in `store` that `keep` accepts.
fn copies<K>(store: &Store<K>, keep: impl Fn(&K) -> bool) -> Vec<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store
        .state()
        .iter()
        .filter(|object| keep(object))
        .map(|object| (**object).clone())
        .collect()
}

/// A subscription to the changes of a shared cache.
type Subscription<K> = reflector::ReflectHandle<K>;

/// A new subscription to the changes `writer` makes to its cache.
fn subscribe<K: Cached>(writer: &reflector::store::Writer<K>) -> Result<Subscription<K>, RunError> {
    writer.subscribe().ok_or(RunError::Subscribe)
}

/// `N` subscriptions to the changes `writer` makes to its cache, one for
/// each consumer.
fn subscriptions<K: Cached, const N: usize>(
    writer: &reflector::store::Writer<K>,
) -> Result<[Subscription<K>; N], RunError> {
    let subscriptions = (0..N)
        .map(|_| subscribe(writer))
        .collect::<Result<Vec<_>, _>>()?;
    subscriptions.try_into().map_err(|_| RunError::Subscribe)
}

/// The caches of Kubernetes' own objects, filling in `tasks`, and the
/// subscriptions to the changes of claims and pods.
struct ClusterCaches {
    claims: Store<PersistentVolumeClaim>,
    pods: Store<Pod>,
    roles: Store<Role>,
    namespaces: Store<k8s_openapi::api::core::v1::Namespace>,
    limit_ranges: Store<k8s_openapi::api::core::v1::LimitRange>,
    csi_nodes: Store<k8s_openapi::api::storage::v1::CSINode>,
    nodes: Store<Node>,
    volumes: Store<PersistentVolume>,
    classes: Store<StorageClass>,
    leases: Store<Lease>,
    /// What of them wakes backups and restores.
    triggers: ClusterTriggers,
}

/// The changes of Kubernetes' own objects that wake backups and restores.
struct ClusterTriggers {
    /// Claim changes, for the restores (a restored claim that binds).
    claim_events: Subscription<PersistentVolumeClaim>,
    /// Stage pod changes, for the backups.
    pod_events_for_backups: Subscription<Pod>,
    /// Stage pod changes, for the restores.
    pod_events_for_restores: Subscription<Pod>,
}

/// The caches of haulage's own objects, filling in `tasks`, with one
/// subscription to their changes for each consumer: each feeds a
/// controller and triggers the others.
struct HaulageCaches {
    backups: Store<VolumeBackup>,
    locations: Store<BackupStorageLocation>,
    transfers: Store<VolumeTransfer>,
    policies: Store<StoragePolicy>,
    /// Transfer changes, for the metrics of bytes moved.
    transfer_events_for_metrics: Subscription<VolumeTransfer>,
    /// Transfer, location and policy changes, for admission.
    admission_wakers: [futures::stream::BoxStream<'static, ()>; 3],
    /// What drives and wakes the controllers.
    controllers: ControllerTriggers,
}

/// The caches of haulage's objects the controllers of backups, restores
/// and locations reconcile, and the changes that drive and wake them.
struct ControllerTriggers {
    backups: Store<VolumeBackup>,
    backup_events: Subscription<VolumeBackup>,
    restores: Store<VolumeRestore>,
    restore_events: Subscription<VolumeRestore>,
    locations: Store<BackupStorageLocation>,
    location_events: Subscription<BackupStorageLocation>,
    location_events_for_backups: Subscription<BackupStorageLocation>,
    location_events_for_restores: Subscription<BackupStorageLocation>,
    location_events_for_defaults: Subscription<BackupStorageLocation>,
    /// The deleted locations (the shared streams announce changes only).
    deleted_locations: futures::channel::mpsc::UnboundedReceiver<BackupStorageLocation>,
    transfer_events_for_backups: Subscription<VolumeTransfer>,
    transfer_events_for_restores: Subscription<VolumeTransfer>,
}

/// Where the caches start: the tasks that fill them, the readiness they
/// report their first list to, the client and the controller's namespace.
struct CacheStart<'a> {
    tasks: &'a mut JoinSet<()>,
    readiness: &'a Arc<health::Readiness>,
    client: &'a Client,
    namespace: &'a str,
}

impl CacheStart<'_> {
    /// Run a watcher of `kind` into the cache of `writer` until `tasks` is
    /// dropped. The cached objects carry no `managedFields`
    /// ([`without_managed_fields`]); the subscribers of a shared writer see
    /// every change; each deleted object is also sent to `deletions`, when
    /// given (the shared streams of kube-runtime announce changes only,
    /// never deletions); a failing watch is logged (kube-runtime logs only
    /// a 403 above debug; the watch backs off, so this is never a stream);
    /// and `readiness` learns when the first list is in the cache, from the
    /// stream itself (see [`health::Readiness`] for why not from the store).
    fn spawn<K: Cached>(
        &mut self,
        kind: &'static str,
        api: Api<K>,
        config: watcher::Config,
        writer: reflector::store::Writer<K>,
        deletions: Option<futures::channel::mpsc::UnboundedSender<K>>,
    ) {
        let readiness = self.readiness.clone();
        let mut synced = false;
        let changes =
            crate::watch::backing_off(watcher(api, config)).modify(without_managed_fields);
        self.tasks.spawn(
            // The reflector applies each change to the cache before passing it on.
            reflector::reflector(writer, changes).for_each(move |change| {
                match change {
                    Ok(watcher::Event::InitDone) if !synced => {
                        synced = true;
                        info!(kind, "cache synced");
                        readiness.set_cache_synced(kind);
                    }
                    Ok(watcher::Event::Delete(object)) => {
                        if let Some(deletions) = &deletions {
                            let _ = deletions.unbounded_send(object);
                        }
                    }
                    Err(error) => log_watch_error(kind, &error),
                    Ok(_) => {}
                }
                futures::future::ready(())
            }),
        );
    }

    /// Start the cache of the objects of `kind` in every namespace that are
    /// labelled as managed by haulage.
    fn spawn_managed<K>(&mut self, kind: &'static str, writer: reflector::store::Writer<K>)
    where
        K: Cached + kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    {
        let api = Api::<K>::all(self.client.clone());
        self.spawn(
            kind,
            api,
            watcher::Config::default().labels(&format!(
                "{}={}",
                crate::api::labels::MANAGED_BY_LABEL,
                crate::api::labels::MANAGED_BY
            )),
            writer,
            None,
        );
    }

    /// [`CacheStart::spawn`] of every `K` in the cluster, into `writer`,
    /// with the watcher's default configuration.
    fn spawn_all<K: Cached>(&mut self, kind: &'static str, writer: reflector::store::Writer<K>)
    where
        K::DynamicType: Default,
    {
        let api = Api::<K>::all(self.client.clone());
        self.spawn(kind, api, watcher::Config::default(), writer, None);
    }

    /// [`CacheStart::spawn`] of the `K`s in the controller's namespace, into
    /// `writer` (each deleted one also to `deletions`, when given), with
    /// the watcher's default configuration.
    fn spawn_namespaced<K>(
        &mut self,
        kind: &'static str,
        writer: reflector::store::Writer<K>,
        deletions: Option<futures::channel::mpsc::UnboundedSender<K>>,
    ) where
        K: Cached + kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    {
        let api = Api::<K>::namespaced(self.client.clone(), self.namespace);
        self.spawn(kind, api, watcher::Config::default(), writer, deletions);
    }

    /// A cache of every `K` in the cluster read by the reconcilers only (no
    /// controller is driven by its changes): its store, filled by a task
    /// that marks `kind` synced.
    fn cluster<K: Cached>(&mut self, kind: &'static str) -> Store<K>
    where
        K::DynamicType: Default,
    {
        let (store, writer) = reflector::store();
        self.spawn_all(kind, writer);
        store
    }

    /// Start the caches of Kubernetes' own objects (every claim, pod,
    /// namespace, LimitRange, CSINode, node, volume and class, and the
    /// replicas' liveness Leases in the controller's namespace).
    fn cluster_caches(&mut self) -> Result<ClusterCaches, RunError> {
        let client = self.client;
        let (claims, claims_writer) =
            reflector::store_shared::<PersistentVolumeClaim>(SUBSCRIBER_BUFFER);
        let claim_events = subscribe(&claims_writer)?;
        self.spawn_all(cache::CLAIMS, claims_writer);
        // Pods are shared: the planner reads them and stage pod changes wake
        // their VolumeBackup or VolumeRestore (a crash loop or an eviction is
        // acted on at once).
        let (pods, pods_writer) = reflector::store_shared::<Pod>(SUBSCRIBER_BUFFER);
        let [pod_events_for_backups, pod_events_for_restores] = subscriptions(&pods_writer)?;
        self.spawn_all(cache::PODS, pods_writer);
        let namespaces = self.cluster(cache::NAMESPACES);
        let limit_ranges = self.cluster(cache::LIMIT_RANGES);
        let csi_nodes = self.cluster(cache::CSI_NODES);
        let nodes = self.cluster(cache::NODES);
        let volumes = self.cluster(cache::VOLUMES);
        let classes = self.cluster(cache::CLASSES);

        let (roles, roles_writer) = reflector::store();
        self.spawn_managed(cache::ROLES, roles_writer);
        let (leases, leases_writer) = reflector::store();
        self.spawn(
            cache::LEASES,
            Api::<Lease>::namespaced(client.clone(), self.namespace),
            watcher::Config::default().labels(&format!(
                "{}=true",
                crate::reconcile::replicas::REPLICA_LEASE_LABEL
            )),
            leases_writer,
            None,
        );
        Ok(ClusterCaches {
            claims,
            pods,
            roles,
            namespaces,
            limit_ranges,
            csi_nodes,
            nodes,
            volumes,
            classes,
            leases,
            triggers: ClusterTriggers {
                claim_events,
                pod_events_for_backups,
                pod_events_for_restores,
            },
        })
    }

    /// Start the caches of haulage's objects: StoragePolicies, the
    /// VolumeBackups, VolumeRestores and BackupStorageLocations of the
    /// controller's namespace, and haulage's VolumeTransfers everywhere.
    fn haulage_caches(&mut self) -> Result<HaulageCaches, RunError> {
        let (backups, backups_writer) = reflector::store_shared::<VolumeBackup>(SUBSCRIBER_BUFFER);
        let (locations, locations_writer) =
            reflector::store_shared::<BackupStorageLocation>(SUBSCRIBER_BUFFER);
        let (restores, restores_writer) =
            reflector::store_shared::<VolumeRestore>(SUBSCRIBER_BUFFER);
        let (transfers, transfers_writer) =
            reflector::store_shared::<VolumeTransfer>(SUBSCRIBER_BUFFER);
        let (policies, policies_writer) =
            reflector::store_shared::<StoragePolicy>(SUBSCRIBER_BUFFER);
        let (location_deletions, deleted_locations) = futures::channel::mpsc::unbounded();
        let [
            location_events,
            location_events_for_backups,
            location_events_for_restores,
            location_events_for_defaults,
            location_events_for_admission,
        ] = subscriptions(&locations_writer)?;
        let [
            transfer_events_for_backups,
            transfer_events_for_restores,
            transfer_events_for_metrics,
            transfer_events_for_admission,
        ] = subscriptions(&transfers_writer)?;
        let caches = HaulageCaches {
            transfer_events_for_metrics,
            admission_wakers: [
                transfer_events_for_admission.map(|_| ()).boxed(),
                location_events_for_admission.map(|_| ()).boxed(),
                subscribe(&policies_writer)?.map(|_| ()).boxed(),
            ],
            controllers: ControllerTriggers {
                backups: backups.clone(),
                backup_events: subscribe(&backups_writer)?,
                restores,
                restore_events: subscribe(&restores_writer)?,
                locations: locations.clone(),
                location_events,
                location_events_for_backups,
                location_events_for_restores,
                location_events_for_defaults,
                deleted_locations,
                transfer_events_for_backups,
                transfer_events_for_restores,
            },
            backups,
            locations,
            transfers,
            policies,
        };
        self.spawn_all(cache::POLICIES, policies_writer);
        self.spawn_namespaced(cache::BACKUPS, backups_writer, None);
        self.spawn_namespaced(cache::RESTORES, restores_writer, None);
        self.spawn_namespaced(cache::LOCATIONS, locations_writer, Some(location_deletions));
        self.spawn_managed(cache::TRANSFERS, transfers_writer);
        Ok(caches)
    }
}

/// Start admission: one replica at a time (the admission lease holder,
/// whose lease is released at `release_leases`) runs the admission loop,
/// woken by changes of transfers, locations and policies (each
/// subscription drained at once, so a slow pass never holds the shared
/// caches back), and the locations' scheduled maintenance (into `tasks`).
/// Returns the lease loop and the admission loop.
fn spawn_admission(
    tasks: &mut JoinSet<()>,
    context: &Arc<Context>,
    release_leases: &CancellationToken,
    wakers: [futures::stream::BoxStream<'static, ()>; 3],
    shutdown: &CancellationToken,
) -> [tokio_util::task::AbortOnDropHandle<()>; 2] {
    let config = &context.config;
    let leadership = Arc::new(lease::Leadership::default());
    let lease_loop = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(lease::run(
        Api::namespaced(context.client.clone(), &config.namespace),
        config.identity.clone(),
        leadership.clone(),
        release_leases.clone(),
    )));
    let wake = Arc::new(tokio::sync::Notify::new());
    for events in wakers {
        let wake = wake.clone();
        tasks.spawn(events.for_each(move |()| {
            wake.notify_one();
            futures::future::ready(())
        }));
    }
    tasks.spawn(maintenance::run(
        context.clone(),
        leadership.clone(),
        shutdown.clone(),
    ));
    let admission = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
        admission::Admitter::new(context.clone(), leadership).run(wake, shutdown.clone()),
    ));
    [lease_loop, admission]
}

/// A kind whose objects move volumes through stage pods and transfers
/// (VolumeBackup, VolumeRestore): what the watches of its controller need
/// to know of it.
trait StagedKind: Cached {
    /// The operation its stage pods are labelled with.
    const OPERATION: Operation;
    /// Whether a change of `transfer` may concern the object of this kind
    /// its `backupRef` names.
    fn woken_by(transfer: &VolumeTransfer) -> bool;
    /// Whether the object's phase is final.
    fn is_finished(&self) -> bool;
}

impl StagedKind for VolumeBackup {
    const OPERATION: Operation = Operation::Backup;
    fn woken_by(_transfer: &VolumeTransfer) -> bool {
        true
    }
    fn is_finished(&self) -> bool {
        self.status
            .as_ref()
            .and_then(StagedStatus::final_phase)
            .is_some()
    }
}

impl StagedKind for VolumeRestore {
    const OPERATION: Operation = Operation::Restore;
    fn woken_by(transfer: &VolumeTransfer) -> bool {
        transfer.spec.direction == crate::api::TransferDirection::Download
    }
    fn is_finished(&self) -> bool {
        self.status
            .as_ref()
            .and_then(StagedStatus::final_phase)
            .is_some()
    }
}

/// What wakes the objects of a [`StagedKind`] besides their own changes.
struct StagedWakers {
    /// Changes of transfers (their `backupRef` names the object).
    transfers: Subscription<VolumeTransfer>,
    /// Changes of stage pods (their owner labels name the object).
    pods: Subscription<Pod>,
    /// Changes of locations (every unfinished object in their namespace).
    locations: Subscription<BackupStorageLocation>,
}

/// The controller of a [`StagedKind`] over `store`, driven by `objects`
/// and woken by its transfers, its stage pods and the locations of its
/// namespace ([`unfinished_in`]).
fn staged_controller<K: StagedKind>(
    objects: Subscription<K>,
    store: Store<K>,
    wakers: StagedWakers,
    config: ControllerConfig,
) -> Controller<K> {
    let store_for_locations = store.clone();
    Controller::for_shared_stream(objects, store)
        .with_config(config)
        .watches_shared_stream(wakers.transfers, |transfer: Arc<VolumeTransfer>| {
            K::woken_by(&transfer).then(|| {
                let reference = &transfer.spec.backup_ref;
                ObjectRef::<K>::new(&reference.name).within(&reference.namespace)
            })
        })
        .watches_shared_stream(wakers.pods, |pod: Arc<Pod>| {
            let (namespace, name) = owner_of_stage_pod(&pod, K::OPERATION)?;
            Some(ObjectRef::<K>::new(&name).within(&namespace))
        })
        .watches_shared_stream(
            wakers.locations,
            move |location: Arc<BackupStorageLocation>| {
                unfinished_in(&store_for_locations, &location, K::is_finished)
            },
        )
}

/// The restore a restored claim carries the owner labels of: a claim that
/// binds (or is replaced) moves its restore on.
fn restore_of_claim(claim: Arc<PersistentVolumeClaim>) -> Option<ObjectRef<VolumeRestore>> {
    let labels = claim.labels();
    labels.get(crate::reconcile::claims::RESTORE_STATE_LABEL)?;
    let namespace = labels.get(crate::api::labels::OWNER_NAMESPACE_LABEL)?;
    let name = labels.get(crate::api::labels::OWNER_NAME_LABEL)?;
    Some(ObjectRef::<VolumeRestore>::new(name).within(namespace))
}

/// The controller of the locations over `locations`, driven by `events`:
/// a change of one location (`changes`), or the deletion of a default one
/// (`deleted`), can change the default conditions of the others marked
/// default ([`other_defaults`]).
fn location_controller(
    events: Subscription<BackupStorageLocation>,
    locations: Store<BackupStorageLocation>,
    changes: Subscription<BackupStorageLocation>,
    deleted: futures::channel::mpsc::UnboundedReceiver<BackupStorageLocation>,
    config: ControllerConfig,
) -> Controller<BackupStorageLocation> {
    let locations_for_changes = locations.clone();
    let locations_for_deletions = locations.clone();
    Controller::for_shared_stream(events, locations)
        .with_config(config)
        .watches_shared_stream(changes, move |changed: Arc<BackupStorageLocation>| {
            other_defaults(&locations_for_changes, &changed)
        })
        .reconcile_on(deleted.flat_map(move |deleted: BackupStorageLocation| {
            let others = if deleted.spec.is_default {
                other_defaults(&locations_for_deletions, &deleted)
            } else {
                Vec::new()
            };
            futures::stream::iter(others)
        }))
}

/// Run `controller` with `reconcile` (timed and its errors counted under
/// `name` in `metrics`) until `shutdown`.
fn run_controller<K, F, Fut>(
    controller: Controller<K>,
    name: &'static str,
    reconcile: F,
    metrics: Arc<ControllerMetrics>,
    context: Arc<Context>,
    shutdown: CancellationToken,
) -> impl std::future::Future<Output = ()>
where
    K: Cached,
    F: Fn(Arc<K>, Arc<Context>) -> Fut,
    Fut: std::future::Future<Output = Result<Action, Error>> + Send + 'static,
{
    controller
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(
            timed(name, metrics.clone(), reconcile),
            counted(name, metrics),
            context,
        )
        .for_each(|_| futures::future::ready(()))
}

/// Run the controllers of backups, restores and locations (with
/// `config.concurrency` reconciles each) until `shutdown`, each driven by
/// the changes of its own objects and woken by `triggers` and `cluster`.
fn run_controllers(
    triggers: ControllerTriggers,
    cluster: ClusterTriggers,
    metrics: Arc<ControllerMetrics>,
    context: Arc<Context>,
    shutdown: &CancellationToken,
) -> impl std::future::Future<Output = ()> {
    let controller_config = ControllerConfig::default().concurrency(context.config.concurrency);
    let backups_running = run_controller(
        staged_controller(
            triggers.backup_events,
            triggers.backups,
            StagedWakers {
                transfers: triggers.transfer_events_for_backups,
                pods: cluster.pod_events_for_backups,
                locations: triggers.location_events_for_backups,
            },
            controller_config.clone(),
        ),
        BACKUP_CONTROLLER,
        backup::reconcile,
        metrics.clone(),
        context.clone(),
        shutdown.clone(),
    );
    let restores_running = run_controller(
        staged_controller(
            triggers.restore_events,
            triggers.restores,
            StagedWakers {
                transfers: triggers.transfer_events_for_restores,
                pods: cluster.pod_events_for_restores,
                locations: triggers.location_events_for_restores,
            },
            controller_config.clone(),
        )
        .watches_shared_stream(cluster.claim_events, restore_of_claim),
        RESTORE_CONTROLLER,
        restore::reconcile,
        metrics.clone(),
        context.clone(),
        shutdown.clone(),
    );
    let locations_running = run_controller(
        location_controller(
            triggers.location_events,
            triggers.locations,
            triggers.location_events_for_defaults,
            triggers.deleted_locations,
            controller_config,
        ),
        LOCATION_CONTROLLER,
        location::reconcile,
        metrics,
        context,
        shutdown.clone(),
    );
    async move {
        futures::future::join3(backups_running, restores_running, locations_running).await;
    }
}

/// [`run`] with the health and metrics endpoints on `listener`, bound by
/// the caller (who then knows its address, e.g. for port 0);
/// `config.health_address` is not used.
pub async fn run_with_listener(
    config: Config,
    client: Client,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    // Every task of this replica lives in `tasks`: when `run` returns or is
    // dropped (a test's simulated crash), they all stop with it.
    let mut tasks = JoinSet::new();
    if let Ok(address) = listener.local_addr() {
        info!(%address, "health and metrics endpoints listening");
    }
    let readiness = Arc::new(health::Readiness::new(cache::ALL));
    tasks.spawn(health::watch_api_server(
        client.clone(),
        readiness.clone(),
        shutdown.clone(),
    ));
    let mut caches = CacheStart {
        tasks: &mut tasks,
        readiness: &readiness,
        client: &client,
        namespace: &config.namespace,
    };
    let cluster = caches.cluster_caches()?;

    // This replica's liveness lease, written before it claims anything.
    // An API server that is not reachable yet is waited for, not a crash.
    // The leases are released only once every reconcile in flight has
    // finished (their own token, cancelled after the controllers stop):
    // another replica must not adopt or admit while this one still writes.
    let release_leases = CancellationToken::new();
    let heartbeat = replicas::Heartbeat::default();
    let Some(lease_task) =
        start_replica_lease(&client, &config, &heartbeat, &release_leases, &shutdown).await
    else {
        return Ok(());
    };

    let haulage = caches.haulage_caches()?;
    let stores = Stores {
        locations: haulage.locations.clone(),
        transfers: haulage.transfers.clone(),
        claims: cluster.claims,
        pods: cluster.pods,
        roles: cluster.roles,
        nodes: cluster.nodes,
        volumes: cluster.volumes,
        classes: cluster.classes,
        leases: cluster.leases,
        policies: haulage.policies,
        namespaces: cluster.namespaces,
        limit_ranges: cluster.limit_ranges,
        csi_nodes: cluster.csi_nodes,
    };
    let metrics = Arc::new(ControllerMetrics::new(Some(MetricCaches {
        locations: stores.locations.clone(),
        transfers: stores.transfers.clone(),
        claims: stores.claims.clone(),
        backups: haulage.backups.clone(),
    })));
    tasks.spawn(health::serve(
        listener,
        readiness.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(metrics::account_transfer_bytes(
        haulage.transfer_events_for_metrics,
        stores.transfers.clone(),
        stores.claims.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    let context = Arc::new(Context {
        client: client.clone(),
        config: config.clone(),
        stores,
        heartbeat,
        events: events::Events::new(client.clone(), &config.identity),
        status_writes: recent::Recent::keeping(STATUS_WRITE_MEMORY),
        deleted_pods: recent::Recent::keeping(DELETED_POD_MEMORY),
        released_roles: recent::Recent::keeping(DELETED_POD_MEMORY),
        readiness: readiness.clone(),
        cluster_id: cluster_identity(&client).await,
    });
    let [lease_loop, admission] = spawn_admission(
        &mut tasks,
        &context,
        &release_leases,
        haulage.admission_wakers,
        &shutdown,
    );

    tasks.spawn(summarize_locations_periodically(
        config.namespace.clone(),
        haulage.locations.clone(),
        readiness.clone(),
        shutdown.clone(),
    ));
    let controllers = run_controllers(
        haulage.controllers,
        cluster.triggers,
        metrics,
        context,
        &shutdown,
    );
    info!(identity = %config.identity, namespace = %config.namespace, "controller started");
    controllers.await;
    // Every reconcile and admission pass has ended (the admission loop
    // stops at `shutdown`): release the replica lease, so other replicas
    // adopt this one's backups now, and the admission lease, so another
    // admits at once.
    let _ = admission.await;
    release_leases.cancel();
    let _ = lease_task.await;
    let _ = lease_loop.await;
    info!("controller stopped");
    Ok(())
}

/// The objects of `store` in `location`'s namespace that are not final
/// (`is_final`): what a change of the location may move on.
fn unfinished_in<K>(
    store: &reflector::Store<K>,
    location: &BackupStorageLocation,
    is_final: impl Fn(&K) -> bool,
) -> Vec<ObjectRef<K>>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let namespace = location.namespace().unwrap_or_default();
    store
        .state()
        .into_iter()
        .filter(|object| object.namespace().as_deref() == Some(namespace.as_str()))
        .filter(|object| !is_final(object))
        .map(|object| ObjectRef::from_obj(object.as_ref()))
        .collect()
}

/// This cluster's identity: the UID of its `kube-system` namespace.
async fn cluster_identity(client: &Client) -> Option<String> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    match namespaces.get("kube-system").await {
        Ok(namespace) => namespace.uid(),
        Err(error) => {
            warn!(%error, "cannot read the kube-system namespace (the cluster's identity); snapshots will not record which cluster they come from (check the ClusterRole's namespaces rule)");
            None
        }
    }
}

/// Log the storage-locations summary once per
/// [`LOCATION_SUMMARY_INTERVAL_SECONDS`], the first after one interval (so
/// the first probes have run), until `shutdown`.
async fn summarize_locations_periodically(
    namespace: String,
    locations: Store<BackupStorageLocation>,
    readiness: Arc<health::Readiness>,
    shutdown: CancellationToken,
) {
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = readiness.wait_for_cache(cache::LOCATIONS) => {}
    }
    let period = Duration::from_secs(LOCATION_SUMMARY_INTERVAL_SECONDS);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let mine: Vec<_> = locations
            .state()
            .into_iter()
            .filter(|location| location.namespace().as_deref() == Some(namespace.as_str()))
            .collect();
        location::log_locations_summary(&namespace, &mine);
    }
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

    /// Log lines written while the test runs, for counting.
    #[derive(Clone, Default)]
    struct CapturedLog(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for CapturedLog {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl CapturedLog {
        fn lines_containing(&self, text: &str) -> usize {
            let bytes = self.0.lock().map(|bytes| bytes.clone()).unwrap_or_default();
            String::from_utf8_lossy(&bytes)
                .lines()
                .filter(|line| line.contains(text))
                .count()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn without_any_location_the_summary_warns_once_per_interval_not_in_a_stream() {
        let log = CapturedLog::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);

        let (locations, mut writer) = reflector::store::<BackupStorageLocation>();
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let shutdown = CancellationToken::new();
        let summary = tokio::spawn(summarize_locations_periodically(
            SYSTEM_NAMESPACE.to_string(),
            locations,
            Arc::new(health::Readiness::new([])),
            shutdown.clone(),
        ));
        // Three and a half intervals of (paused, auto-advanced) time.
        tokio::time::sleep(Duration::from_secs(
            LOCATION_SUMMARY_INTERVAL_SECONDS * 7 / 2,
        ))
        .await;
        assert_eq!(log.lines_containing("no BackupStorageLocation"), 3);
        assert_eq!(log.lines_containing("WARN"), 3);

        // One location that is Unavailable: an error per interval instead.
        let mut location = BackupStorageLocation::test("offsite");
        location.status = Some(crate::reconcile::location::next_location_status(
            &Default::default(),
            &crate::reconcile::location::ProbeOutcome::Failed {
                problem: crate::reconcile::location::ProbeProblem::AccessDenied,
                message: "refused".to_string(),
            },
            &[],
            None,
            crate::clock::now(),
        ));
        writer.apply_watcher_event(&watcher::Event::Apply(location));
        tokio::time::sleep(Duration::from_secs(LOCATION_SUMMARY_INTERVAL_SECONDS * 2)).await;
        assert_eq!(
            log.lines_containing("no BackupStorageLocation is Available"),
            2
        );
        assert_eq!(log.lines_containing("offsite (AccessDenied)"), 2);

        shutdown.cancel();
        summary.await.expect("the summary task ends on shutdown");
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
