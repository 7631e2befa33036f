//! The controller's Prometheus series, each named and explained once here
//! (docs/controller.md, "Metrics", lists them for users).
//!
//! Three sources:
//! - the shared caches, read at scrape time by [`CacheCollector`]: storage
//!   location availability and probe latency, transfers by phase, queue
//!   lengths, throughput. Nothing is polled; a scrape reads memory.
//! - the VolumeTransfer events, by [`account_transfer_bytes`]: byte
//!   counters grown by the increase of each transfer's `status.progress`
//!   ([`ByteAccounts`], pure, so "never decreasing" is a unit test).
//! - the reconcile wrappers in `controller::run`: durations and errors.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::api::backup::VolumeBackupPhase;
use crate::api::{
    BackupStorageLocation, BackupStorageLocationPhase, Progress, TransferDirection, VolumeBackup,
    VolumeTransfer, VolumeTransferPhase,
};
use crate::controller::Error;
use crate::metrics::{NoLabels, Response, Series, encode_gauges};

/// The `controller` label of the VolumeBackup reconciler.
pub const BACKUP_CONTROLLER: &str = "volumebackup";
/// The `controller` label of the VolumeRestore reconciler.
pub const RESTORE_CONTROLLER: &str = "volumerestore";
/// The `controller` label of the BackupStorageLocation reconciler.
pub const LOCATION_CONTROLLER: &str = "backupstoragelocation";
/// Ticks of [`WAKE_INTERVAL_MILLISECONDS`] between two prunings of the
/// byte accounts of deleted transfers (a minute).
const PRUNE_EVERY_TICKS: u32 = 60;
/// The byte accounting wakes at least this often. kube-runtime's
/// subscriber stream answers `Pending` without arranging a wake-up when the
/// object of an event was deleted before it is read; a subscriber that
/// then sleeps would hold up the shared cache once its buffer fills.
const WAKE_INTERVAL_MILLISECONDS: u64 = 1000;
/// Smallest reconcile duration bucket (5 ms), doubled 14 times (~41 s).
const RECONCILE_BUCKET_START_SECONDS: f64 = 0.005;
/// Number of reconcile duration buckets.
const RECONCILE_BUCKETS: u16 = 14;

/// `haulage_storage_location_available{namespace,location}`.
pub const LOCATION_AVAILABLE: Series = Series {
    name: "haulage_storage_location_available",
    help: "1 when the storage location's last probe succeeded (phase Available), else 0",
};
/// `haulage_storage_location_probe_latency_seconds{namespace,location}`.
pub const LOCATION_PROBE_LATENCY: Series = Series {
    name: "haulage_storage_location_probe_latency_seconds",
    help: "Duration of the storage location's last probe (write, read, list, delete)",
};
/// `haulage_storage_location_last_validation_timestamp_seconds{namespace,location}`.
pub const LOCATION_LAST_VALIDATION: Series = Series {
    name: "haulage_storage_location_last_validation_timestamp_seconds",
    help: "Unix time of the storage location's last probe",
};
/// `haulage_volume_transfers{phase,direction,storage_class,location}`.
pub const TRANSFERS: Series = Series {
    name: "haulage_volume_transfers",
    help: "VolumeTransfers by phase, direction, storage class of the claim and storage location",
};
/// `haulage_transfer_queue_length`.
pub const TRANSFER_QUEUE: Series = Series {
    name: "haulage_transfer_queue_length",
    help: "VolumeTransfers waiting for admission (phase New or Queued)",
};
/// `haulage_volume_backups{phase}`.
pub const BACKUPS: Series = Series {
    name: "haulage_volume_backups",
    help: "VolumeBackups of the controller's namespace by phase",
};
/// `haulage_waiting_volume_backups`.
pub const WAITING_BACKUPS: Series = Series {
    name: "haulage_waiting_volume_backups",
    help: "VolumeBackups not started yet (phase New or WaitingForStorage)",
};
/// `haulage_transfer_throughput_bytes_per_second{storage_class,location}`.
pub const THROUGHPUT: Series = Series {
    name: "haulage_transfer_throughput_bytes_per_second",
    help: "Sum of the reported rates (bytesPerSecond) of the running VolumeTransfers",
};
/// `haulage_transfer_bytes_read_total{storage_class,location}`.
pub const BYTES_READ: Series = Series {
    name: "haulage_transfer_bytes_read",
    help: "Bytes of claim content processed by transfers (growth of status.progress.bytesDone) since this replica started",
};
/// `haulage_transfer_bytes_uploaded_total{storage_class,location}`.
pub const BYTES_UPLOADED: Series = Series {
    name: "haulage_transfer_bytes_uploaded",
    help: "Bytes packed for upload by transfers after dedup and compression (growth of status.progress.bytesUploaded) since this replica started",
};
/// `haulage_reconcile_duration_seconds{controller}`.
pub const RECONCILE_DURATION: Series = Series {
    name: "haulage_reconcile_duration_seconds",
    help: "Duration of reconciles, failed ones included",
};
/// `haulage_reconcile_errors_total{controller,kind}`.
pub const RECONCILE_ERRORS: Series = Series {
    name: "haulage_reconcile_errors",
    help: "Failed reconciles by kind of error",
};

/// Labels of the byte counters and the throughput gauge.
#[derive(Debug, Clone, Default, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct VolumeLabels {
    /// The claim's storage class (empty when unknown).
    pub storage_class: String,
    /// The storage location's name.
    pub location: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    controller: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileErrorLabels {
    controller: &'static str,
    kind: &'static str,
}

fn reconcile_histogram() -> Histogram {
    Histogram::new(exponential_buckets(
        RECONCILE_BUCKET_START_SECONDS,
        2.0,
        RECONCILE_BUCKETS,
    ))
}

/// How much a transfer's counters grew since it was last seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Growth {
    /// Growth of `bytesDone`.
    pub bytes_read: u64,
    /// Growth of `bytesUploaded`.
    pub bytes_uploaded: u64,
}

#[derive(Debug, Clone)]
struct Account {
    labels: VolumeLabels,
    bytes_done: i64,
    bytes_uploaded: i64,
}

/// The last progress seen of each transfer (by UID), from which counters
/// only ever grow:
/// - a transfer first seen after this replica started counts from zero;
///   one created before is a starting point (what it did before was
///   counted, if at all, by the replica that was running then);
/// - a value below the last one is a counter that started again (the
///   status never goes back, but a recreated status could): the new value
///   is all growth, nothing is subtracted;
/// - a deleted transfer's account is dropped, its counts stay.
#[derive(Debug)]
pub struct ByteAccounts {
    started_second: i64,
    accounts: HashMap<String, Account>,
}

fn growth(last: i64, now: i64) -> u64 {
    let now = now.max(0);
    if now >= last {
        (now - last) as u64
    } else {
        now as u64
    }
}

impl ByteAccounts {
    /// Accounts of a replica started at `started_at`.
    pub fn new(started_at: Timestamp) -> Self {
        ByteAccounts {
            started_second: started_at.as_second(),
            accounts: HashMap::new(),
        }
    }

    /// Record the progress of transfer `uid` (created at `created_at`,
    /// counted under `labels`) and return how much it grew.
    pub fn observe(
        &mut self,
        uid: &str,
        created_at: Option<Timestamp>,
        labels: &VolumeLabels,
        progress: &Progress,
    ) -> (VolumeLabels, Growth) {
        let created_after_start =
            created_at.is_some_and(|created| created.as_second() >= self.started_second);
        let account = self.accounts.entry(uid.to_string()).or_insert_with(|| {
            let (bytes_done, bytes_uploaded) = if created_after_start {
                (0, 0)
            } else {
                (progress.bytes_done, progress.bytes_uploaded)
            };
            Account {
                labels: labels.clone(),
                bytes_done,
                bytes_uploaded,
            }
        });
        // A storage class learnt later (the claim reached the cache after
        // the transfer) is kept from then on; a known one never changes, so
        // a transfer's bytes stay in one series.
        if account.labels.storage_class.is_empty() {
            account.labels.storage_class = labels.storage_class.clone();
        }
        let grown = Growth {
            bytes_read: growth(account.bytes_done, progress.bytes_done),
            bytes_uploaded: growth(account.bytes_uploaded, progress.bytes_uploaded),
        };
        account.bytes_done = progress.bytes_done.max(0);
        account.bytes_uploaded = progress.bytes_uploaded.max(0);
        (account.labels.clone(), grown)
    }

    /// Drop the accounts of transfers `live` says are gone.
    pub fn retain(&mut self, live: impl Fn(&str) -> bool) {
        self.accounts.retain(|uid, _| live(uid));
    }

    /// Transfers with an account.
    pub fn len(&self) -> usize {
        self.accounts.len()
    }

    /// Whether no transfer has an account.
    pub fn is_empty(&self) -> bool {
        self.accounts.is_empty()
    }
}

/// The caches the scrape-time series are computed from.
#[derive(Debug, Clone)]
pub struct MetricCaches {
    /// BackupStorageLocations.
    pub locations: Store<BackupStorageLocation>,
    /// VolumeTransfers.
    pub transfers: Store<VolumeTransfer>,
    /// PersistentVolumeClaims (for the storage class of a transfer).
    pub claims: Store<PersistentVolumeClaim>,
    /// VolumeBackups.
    pub backups: Store<VolumeBackup>,
}

/// The storage class of a claim: `spec.storageClassName`, or the beta
/// annotation older claims carry; empty when neither is set.
pub fn storage_class_of(claim: &PersistentVolumeClaim) -> String {
    haulage_plan::objects::claim_storage_class(claim).unwrap_or_default()
}

fn transfer_labels(
    transfer: &VolumeTransfer,
    claims: &Store<PersistentVolumeClaim>,
) -> VolumeLabels {
    let namespace = transfer.namespace().unwrap_or_default();
    let storage_class = claims
        .get(&ObjectRef::new(&transfer.spec.pvc).within(&namespace))
        .map(|claim| storage_class_of(&claim))
        .unwrap_or_default();
    VolumeLabels {
        storage_class,
        location: transfer.spec.storage_location.name.clone(),
    }
}

fn transfer_phase(transfer: &VolumeTransfer) -> VolumeTransferPhase {
    transfer
        .status
        .as_ref()
        .and_then(|status| status.phase)
        .unwrap_or(VolumeTransferPhase::New)
}

fn direction_label(direction: TransferDirection) -> &'static str {
    match direction {
        TransferDirection::Upload => "Upload",
        TransferDirection::Download => "Download",
    }
}

fn seconds(duration_milliseconds: i64) -> f64 {
    Duration::from_millis(duration_milliseconds.max(0) as u64).as_secs_f64()
}

/// Series computed from the caches at each scrape.
#[derive(Debug)]
pub struct CacheCollector {
    caches: MetricCaches,
}

impl Collector for CacheCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut locations = self.caches.locations.state();
        locations.sort_by_key(|location| (location.namespace(), location.name_any()));
        let location_labels = |location: &BackupStorageLocation| {
            [
                ("namespace", location.namespace().unwrap_or_default()),
                ("location", location.name_any()),
            ]
        };
        encode_gauges(
            &mut encoder,
            LOCATION_AVAILABLE,
            locations.iter().map(|location| {
                let available = location.status.as_ref().and_then(|status| status.phase)
                    == Some(BackupStorageLocationPhase::Available);
                (location_labels(location), i64::from(available))
            }),
        )?;
        encode_gauges(
            &mut encoder,
            LOCATION_PROBE_LATENCY,
            locations.iter().filter_map(|location| {
                let milliseconds = location.status.as_ref()?.last_probe_latency_milliseconds?;
                Some((location_labels(location), seconds(milliseconds)))
            }),
        )?;
        encode_gauges(
            &mut encoder,
            LOCATION_LAST_VALIDATION,
            locations.iter().filter_map(|location| {
                let time = location.status.as_ref()?.last_validation_time.as_ref()?;
                Some((location_labels(location), time.0.as_second()))
            }),
        )?;

        let mut transfers: BTreeMap<(&'static str, &'static str, VolumeLabels), i64> =
            BTreeMap::new();
        let mut throughput: BTreeMap<VolumeLabels, i64> = BTreeMap::new();
        let mut queued = 0_i64;
        for transfer in self.caches.transfers.state() {
            let phase = transfer_phase(&transfer);
            let labels = transfer_labels(&transfer, &self.caches.claims);
            if matches!(
                phase,
                VolumeTransferPhase::New | VolumeTransferPhase::Queued
            ) {
                queued += 1;
            }
            if phase == VolumeTransferPhase::InProgress {
                let rate = transfer
                    .status
                    .as_ref()
                    .and_then(|status| status.progress.as_ref())
                    .map_or(0, |progress| progress.bytes_per_second.max(0));
                *throughput.entry(labels.clone()).or_default() += rate;
            }
            *transfers
                .entry((
                    phase_label(phase),
                    direction_label(transfer.spec.direction),
                    labels,
                ))
                .or_default() += 1;
        }
        encode_gauges(
            &mut encoder,
            TRANSFERS,
            transfers
                .into_iter()
                .map(|((phase, direction, labels), count)| {
                    (
                        [
                            ("phase", phase.to_string()),
                            ("direction", direction.to_string()),
                            ("storage_class", labels.storage_class),
                            ("location", labels.location),
                        ],
                        count,
                    )
                }),
        )?;
        encode_gauges(&mut encoder, TRANSFER_QUEUE, [(NoLabels, queued)])?;
        encode_gauges(&mut encoder, THROUGHPUT, throughput)?;

        let mut backups: BTreeMap<&'static str, i64> = BTreeMap::new();
        let mut waiting = 0_i64;
        for backup in self.caches.backups.state() {
            let phase = backup
                .status
                .as_ref()
                .and_then(|status| status.phase)
                .unwrap_or(VolumeBackupPhase::New);
            if matches!(
                phase,
                VolumeBackupPhase::New | VolumeBackupPhase::WaitingForStorage
            ) {
                waiting += 1;
            }
            *backups.entry(backup_phase_label(phase)).or_default() += 1;
        }
        encode_gauges(
            &mut encoder,
            BACKUPS,
            backups
                .into_iter()
                .map(|(phase, count)| ([("phase", phase)], count)),
        )?;
        encode_gauges(&mut encoder, WAITING_BACKUPS, [(NoLabels, waiting)])?;
        Ok(())
    }
}

fn phase_label(phase: VolumeTransferPhase) -> &'static str {
    match phase {
        VolumeTransferPhase::New => "New",
        VolumeTransferPhase::Queued => "Queued",
        VolumeTransferPhase::Admitted => "Admitted",
        VolumeTransferPhase::InProgress => "InProgress",
        VolumeTransferPhase::Finalizing => "Finalizing",
        VolumeTransferPhase::Completed => "Completed",
        VolumeTransferPhase::Failed => "Failed",
        VolumeTransferPhase::Canceled => "Canceled",
    }
}

fn backup_phase_label(phase: VolumeBackupPhase) -> &'static str {
    match phase {
        VolumeBackupPhase::New => "New",
        VolumeBackupPhase::WaitingForStorage => "WaitingForStorage",
        VolumeBackupPhase::Planning => "Planning",
        VolumeBackupPhase::InProgress => "InProgress",
        VolumeBackupPhase::Completed => "Completed",
        VolumeBackupPhase::PartiallyFailed => "PartiallyFailed",
        VolumeBackupPhase::Failed => "Failed",
        VolumeBackupPhase::Canceling => "Canceling",
        VolumeBackupPhase::Canceled => "Canceled",
    }
}

/// The controller's metrics: the registry `/metrics` encodes and the
/// instruments the controller records into.
#[derive(Debug)]
pub struct ControllerMetrics {
    registry: Registry,
    reconcile_duration: Family<ReconcileLabels, Histogram, fn() -> Histogram>,
    reconcile_errors: Family<ReconcileErrorLabels, Counter>,
    bytes_read: Family<VolumeLabels, Counter>,
    bytes_uploaded: Family<VolumeLabels, Counter>,
    accounts: Mutex<ByteAccounts>,
}

impl ControllerMetrics {
    /// The metrics of a replica starting now; the scrape-time series are
    /// served only with `caches`.
    pub fn new(caches: Option<MetricCaches>) -> Self {
        let mut registry = Registry::default();
        let reconcile_duration: Family<ReconcileLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(reconcile_histogram);
        let reconcile_errors = Family::<ReconcileErrorLabels, Counter>::default();
        let bytes_read = Family::<VolumeLabels, Counter>::default();
        let bytes_uploaded = Family::<VolumeLabels, Counter>::default();
        for (series, metric) in [
            (BYTES_READ, bytes_read.clone()),
            (BYTES_UPLOADED, bytes_uploaded.clone()),
        ] {
            registry.register(series.name, series.help, metric);
        }
        registry.register(
            RECONCILE_DURATION.name,
            RECONCILE_DURATION.help,
            reconcile_duration.clone(),
        );
        registry.register(
            RECONCILE_ERRORS.name,
            RECONCILE_ERRORS.help,
            reconcile_errors.clone(),
        );
        // Every error series exists from the start at 0 (creating it is
        // enough; the returned guard is dropped at once).
        for controller in [BACKUP_CONTROLLER, RESTORE_CONTROLLER, LOCATION_CONTROLLER] {
            for kind in Error::labels() {
                drop(reconcile_errors.get_or_create(&ReconcileErrorLabels { controller, kind }));
            }
        }
        if let Some(caches) = caches {
            registry.register_collector(Box::new(CacheCollector { caches }));
        }
        ControllerMetrics {
            registry,
            reconcile_duration,
            reconcile_errors,
            bytes_read,
            bytes_uploaded,
            accounts: Mutex::new(ByteAccounts::new(Timestamp::now())),
        }
    }

    /// `/metrics`.
    pub fn encode(&self) -> Response {
        Response::metrics(&self.registry)
    }

    /// A reconcile of `controller` took `elapsed`.
    pub fn observe_reconcile(&self, controller: &'static str, elapsed: Duration) {
        self.reconcile_duration
            .get_or_create(&ReconcileLabels { controller })
            .observe(elapsed.as_secs_f64());
    }

    /// A reconcile of `controller` failed with `error`.
    pub fn count_reconcile_error(&self, controller: &'static str, error: &Error) {
        self.reconcile_errors
            .get_or_create(&ReconcileErrorLabels {
                controller,
                kind: error.label(),
            })
            .inc();
    }

    /// Grow the byte counters by what `transfer` did since it was last seen.
    pub fn count_transfer(&self, transfer: &VolumeTransfer, claims: &Store<PersistentVolumeClaim>) {
        let Some(uid) = transfer.uid() else {
            return;
        };
        let Some(progress) = transfer
            .status
            .as_ref()
            .and_then(|status| status.progress.as_ref())
        else {
            return;
        };
        let labels = transfer_labels(transfer, claims);
        let created_at = transfer
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|time| time.0);
        let (labels, grown) = match self.accounts.lock() {
            Ok(mut accounts) => accounts.observe(&uid, created_at, &labels, progress),
            Err(poisoned) => poisoned
                .into_inner()
                .observe(&uid, created_at, &labels, progress),
        };
        if grown.bytes_read > 0 {
            self.bytes_read
                .get_or_create(&labels)
                .inc_by(grown.bytes_read);
        }
        if grown.bytes_uploaded > 0 {
            self.bytes_uploaded
                .get_or_create(&labels)
                .inc_by(grown.bytes_uploaded);
        }
    }

    /// Forget the accounts of transfers no longer in `transfers`.
    pub fn prune_accounts(&self, transfers: &Store<VolumeTransfer>) {
        let live: HashSet<String> = transfers
            .state()
            .iter()
            .filter_map(|transfer| transfer.uid())
            .collect();
        let mut accounts = match self.accounts.lock() {
            Ok(accounts) => accounts,
            Err(poisoned) => poisoned.into_inner(),
        };
        accounts.retain(|uid| live.contains(uid));
    }
}

/// Grow the byte counters from the VolumeTransfer events (a subscriber of
/// the shared transfer cache, which must be drained promptly: a slow
/// subscriber holds up the cache) until `shutdown` or the stream ends, and
/// forget deleted transfers every minute.
pub async fn account_transfer_bytes(
    events: impl Stream<Item = Arc<VolumeTransfer>>,
    transfers: Store<VolumeTransfer>,
    claims: Store<PersistentVolumeClaim>,
    metrics: Arc<ControllerMetrics>,
    shutdown: CancellationToken,
) {
    let mut events = std::pin::pin!(events);
    let mut wake = tokio::time::interval(Duration::from_millis(WAKE_INTERVAL_MILLISECONDS));
    wake.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ticks = 0_u32;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = wake.tick() => {
                ticks = (ticks + 1) % PRUNE_EVERY_TICKS;
                if ticks == 0 {
                    metrics.prune_accounts(&transfers);
                }
            }
            event = events.next() => match event {
                Some(transfer) => metrics.count_transfer(&transfer, &claims),
                None => return,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(bytes_done: i64, bytes_uploaded: i64) -> Progress {
        Progress {
            bytes_done,
            bytes_uploaded,
            ..Progress::default()
        }
    }

    fn labels() -> VolumeLabels {
        VolumeLabels {
            storage_class: "ceph-rbd".to_string(),
            location: "s3".to_string(),
        }
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("valid time")
    }

    #[test]
    fn a_new_transfer_counts_its_growth_from_zero() {
        let mut accounts = ByteAccounts::new(at(1000));
        let (_, first) = accounts.observe("a", Some(at(1005)), &labels(), &progress(100, 40));
        assert_eq!(
            first,
            Growth {
                bytes_read: 100,
                bytes_uploaded: 40
            }
        );
        let (_, second) = accounts.observe("a", Some(at(1005)), &labels(), &progress(250, 90));
        assert_eq!(
            second,
            Growth {
                bytes_read: 150,
                bytes_uploaded: 50
            }
        );
    }

    #[test]
    fn a_transfer_older_than_the_replica_counts_only_what_it_does_afterwards() {
        let mut accounts = ByteAccounts::new(at(1000));
        let (_, first) = accounts.observe("a", Some(at(900)), &labels(), &progress(700, 300));
        assert_eq!(first, Growth::default());
        let (_, second) = accounts.observe("a", Some(at(900)), &labels(), &progress(800, 320));
        assert_eq!(second.bytes_read, 100);
        assert_eq!(second.bytes_uploaded, 20);
    }

    #[test]
    fn a_counter_that_starts_again_from_zero_never_subtracts() {
        let mut accounts = ByteAccounts::new(at(1000));
        let mut total = 0;
        for done in [500, 800, 0, 50, 300] {
            let (_, grown) = accounts.observe("a", Some(at(1001)), &labels(), &progress(done, 0));
            total += grown.bytes_read;
        }
        // 800 before the restart, then 300 counted again from zero.
        assert_eq!(total, 1100);
    }

    #[test]
    fn a_deleted_transfer_keeps_its_totals_and_a_new_one_with_the_same_name_counts_anew() {
        let metrics = ControllerMetrics::new(None);
        let claims = kube::runtime::reflector::store::<PersistentVolumeClaim>().0;
        let mut transfer: VolumeTransfer = serde_json::from_value(serde_json::json!({
            "apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeTransfer",
            "metadata": {"name": "nightly-db", "namespace": "shop", "uid": "uid-1",
                "creationTimestamp": Timestamp::now().to_string()},
            "spec": {"direction": "Upload", "pvc": "db",
                "backupRef": {"namespace": "ops", "name": "nightly"},
                "storageLocation": {"namespace": "ops", "name": "s3"}, "stagePod": "stage"},
            "status": {"phase": "InProgress", "progress": {"bytesDone": 600, "bytesUploaded": 200}},
        }))
        .expect("valid transfer");
        metrics.count_transfer(&transfer, &claims);
        let series = VolumeLabels {
            storage_class: String::new(),
            location: "s3".to_string(),
        };
        let read = || metrics.bytes_read.get_or_create(&series).get();
        assert_eq!(read(), 600);

        // Deleted: its account goes, the total stays.
        let (transfers, _writer) = kube::runtime::reflector::store::<VolumeTransfer>();
        metrics.prune_accounts(&transfers);
        assert!(metrics.accounts.lock().expect("lock").is_empty());
        assert_eq!(read(), 600);

        // Recreated with the same name: a new UID, counted from zero on top.
        transfer.metadata.uid = Some("uid-2".to_string());
        if let Some(progress) = transfer
            .status
            .as_mut()
            .and_then(|status| status.progress.as_mut())
        {
            progress.bytes_done = 50;
        }
        metrics.count_transfer(&transfer, &claims);
        assert_eq!(read(), 650);
        assert_eq!(metrics.bytes_uploaded.get_or_create(&series).get(), 400);
    }

    #[test]
    fn reconciles_and_their_errors_are_exposed_by_controller_and_kind() {
        let metrics = ControllerMetrics::new(None);
        metrics.observe_reconcile(BACKUP_CONTROLLER, Duration::from_millis(20));
        metrics.observe_reconcile(LOCATION_CONTROLLER, Duration::from_secs(2));
        let error = Error::MissingField {
            kind: "VolumeBackup",
            field: "metadata.namespace",
        };
        metrics.count_reconcile_error(BACKUP_CONTROLLER, &error);
        metrics.count_reconcile_error(BACKUP_CONTROLLER, &error);
        let body = metrics.encode().body;
        for line in [
            "# TYPE haulage_reconcile_duration_seconds histogram",
            "haulage_reconcile_duration_seconds_count{controller=\"volumebackup\"} 1",
            "haulage_reconcile_duration_seconds_bucket{controller=\"backupstoragelocation\",le=\"1.28\"} 0",
            "haulage_reconcile_duration_seconds_bucket{controller=\"backupstoragelocation\",le=\"2.56\"} 1",
            "# TYPE haulage_reconcile_errors_total counter",
            "haulage_reconcile_errors_total{controller=\"volumebackup\",kind=\"missing_field\"} 2",
            // Every other kind is there from the start, at zero.
            "haulage_reconcile_errors_total{controller=\"volumebackup\",kind=\"apply_pod\"} 0",
            "haulage_reconcile_errors_total{controller=\"backupstoragelocation\",kind=\"finalizer\"} 0",
        ] {
            assert!(body.lines().any(|l| l == line), "{line} missing:\n{body}");
        }
    }

    fn stored<K>(objects: Vec<serde_json::Value>) -> Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + 'static,
    {
        let (store, mut writer) = kube::runtime::reflector::store::<K>();
        for object in objects {
            let object: K = serde_json::from_value(object).expect("valid object");
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(object));
        }
        store
    }

    fn transfer(name: &str, pvc: &str, status: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeTransfer",
            "metadata": {"name": name, "namespace": "shop", "uid": name},
            "spec": {"direction": "Upload", "pvc": pvc,
                "backupRef": {"namespace": "ops", "name": "nightly"},
                "storageLocation": {"namespace": "ops", "name": "s3"}, "stagePod": "stage"},
            "status": status,
        })
    }

    #[test]
    fn a_scrape_reads_locations_transfers_and_backups_from_the_caches() {
        let caches = MetricCaches {
            locations: stored(vec![serde_json::json!({
                "apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
                "metadata": {"name": "s3", "namespace": "ops"},
                "spec": {"bucket": "b", "credential": {"name": "c"}},
                "status": {"phase": "Available", "lastProbeLatencyMilliseconds": 250,
                    "lastValidationTime": "2026-11-29T10:00:00Z"},
            })]),
            transfers: stored(vec![
                transfer(
                    "a",
                    "db",
                    serde_json::json!({"phase": "InProgress",
                    "progress": {"bytesPerSecond": 100}}),
                ),
                transfer(
                    "b",
                    "logs",
                    serde_json::json!({"phase": "InProgress",
                    "progress": {"bytesPerSecond": 50}}),
                ),
                transfer("c", "db", serde_json::json!({"phase": "Queued"})),
            ]),
            claims: stored(vec![serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": "db", "namespace": "shop"},
                "spec": {"storageClassName": "ceph-rbd"},
            })]),
            backups: stored(vec![serde_json::json!({
                "apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
                "metadata": {"name": "nightly", "namespace": "ops"},
                "spec": {"namespaces": ["shop"]},
                "status": {"phase": "WaitingForStorage"},
            })]),
        };
        let body = ControllerMetrics::new(Some(caches)).encode().body;
        for line in [
            "haulage_storage_location_available{namespace=\"ops\",location=\"s3\"} 1",
            "haulage_storage_location_probe_latency_seconds{namespace=\"ops\",location=\"s3\"} 0.25",
            "haulage_storage_location_last_validation_timestamp_seconds{namespace=\"ops\",location=\"s3\"} 1795946400",
            "haulage_volume_transfers{phase=\"InProgress\",direction=\"Upload\",storage_class=\"ceph-rbd\",location=\"s3\"} 1",
            "haulage_volume_transfers{phase=\"InProgress\",direction=\"Upload\",storage_class=\"\",location=\"s3\"} 1",
            "haulage_volume_transfers{phase=\"Queued\",direction=\"Upload\",storage_class=\"ceph-rbd\",location=\"s3\"} 1",
            "haulage_transfer_queue_length 1",
            "haulage_transfer_throughput_bytes_per_second{storage_class=\"ceph-rbd\",location=\"s3\"} 100",
            "haulage_transfer_throughput_bytes_per_second{storage_class=\"\",location=\"s3\"} 50",
            "haulage_volume_backups{phase=\"WaitingForStorage\"} 1",
            "haulage_waiting_volume_backups 1",
        ] {
            assert!(body.lines().any(|l| l == line), "{line} missing:\n{body}");
        }
    }
}
