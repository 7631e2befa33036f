//! `haulage status [-o table|json]`: the controller as a whole, read from
//! the API server only (it never probes storage, so it is as fast as a few
//! list calls): the CLI's and the replicas' versions, each controller
//! replica with readiness, restarts and the backups it owns, each
//! BackupStorageLocation with phase, reason, last validation age, latency
//! and message, running and queued backups with progress, and the caps in
//! force (StoragePolicies and the locations' upload caps).
//!
//! [`build_report`] turns the listed objects into a [`StatusReport`] and
//! [`render_table`] draws it; both are pure. The JSON form is the report
//! serialised, documented in docs/cli.md.

use std::fmt::Write as _;

use anyhow::Context as _;
use bytesize::ByteSize;
use clap::{Args, ValueEnum};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde::Serialize;

use crate::api::condition::{condition_type, find_condition};
use crate::api::labels::SYSTEM_NAMESPACE;
use crate::api::location::{MaintenanceResult, MaintenanceStatus};
use crate::api::{
    BackupStorageLocation, BackupStorageLocationPhase, Progress, StoragePolicy, VolumeBackup,
    VolumeBackupPhase, VolumeRestore, VolumeRestorePhase,
};
use crate::cli::Outcome;
use crate::cli::cluster::Namespaced;
use crate::cli::transfer_owner::TransferOwner;
use crate::controller::lease::ADMISSION_LEASE;
use crate::reconcile::location::choose_default;
use crate::reconcile::replicas;

/// Label selector of the controller's pods (manifests/controller.yaml).
pub const CONTROLLER_POD_SELECTOR: &str =
    "app.kubernetes.io/name=haulage,app.kubernetes.io/component=controller";
/// Version of the `haulage status` JSON document.
pub const STATUS_FORMAT_VERSION: u32 = 1;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatusFormat {
    /// Aligned text for people.
    Table,
    /// One JSON document for scripts (docs/cli.md).
    Json,
}

/// `haulage status` arguments.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Namespace of the controller, its locations and backups.
    #[arg(long, short = 'n', env = "POD_NAMESPACE", default_value = SYSTEM_NAMESPACE)]
    pub namespace: String,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub output: StatusFormat,
    /// The cluster to read.
    #[command(flatten)]
    pub cluster: crate::cli::cluster::ClusterArgs,
}

/// Everything `haulage status` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    /// [`STATUS_FORMAT_VERSION`].
    pub format_version: u32,
    /// The CLI's version.
    pub cli_version: String,
    /// The replica holding a current admission Lease (`null`: none, so
    /// no transfer is admitted until one takes it).
    pub admission_leader: Option<String>,
    /// The namespace read.
    pub namespace: String,
    /// Controller pods, by name.
    pub replicas: Vec<ReplicaReport>,
    /// BackupStorageLocations, by name.
    pub locations: Vec<LocationReport>,
    /// The location backups that name none use (the oldest marked default).
    pub default_location: Option<String>,
    /// Backups being planned, transferring or canceling, by name.
    pub running_backups: Vec<BackupReport>,
    /// Backups not started yet (new, or waiting for their location).
    pub queued_backups: Vec<BackupReport>,
    /// Restores selecting, planning, transferring or canceling, by name.
    pub running_restores: Vec<RestoreReport>,
    /// Restores not started yet (new, or waiting for their location).
    pub queued_restores: Vec<RestoreReport>,
    /// The caps in force.
    pub caps: CapsReport,
    /// What needs attention, one sentence each (empty when all is well).
    pub problems: Vec<String>,
}

/// One controller pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaReport {
    /// Pod name (the replica's identity in ownership claims).
    pub name: String,
    /// Pod phase (`Running`, `Pending`, …).
    pub phase: Option<String>,
    /// Whether the pod's Ready condition is True.
    pub ready: bool,
    /// Restarts of its containers, summed.
    pub restarts: i32,
    /// The controller container's image.
    pub image: Option<String>,
    /// The image tag, taken as the replica's version.
    pub version: Option<String>,
    /// Node it runs on.
    pub node: Option<String>,
    /// Unfinished backups whose `status.owner` is this replica.
    pub owns: Vec<String>,
    /// Whether its liveness Lease is current (`null`: it has none, e.g. an
    /// older version or not started yet); other replicas adopt the backups
    /// of one whose lease expired.
    pub lease_alive: Option<bool>,
    /// Whether it holds the admission Lease (it alone admits transfers
    /// under the caps).
    pub admission_leader: bool,
}

/// One BackupStorageLocation.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LocationReport {
    /// Name.
    pub name: String,
    /// `Available`, `Unavailable`, or `null` before the first validation.
    pub phase: Option<BackupStorageLocationPhase>,
    /// Reason of the `Available` condition.
    pub reason: Option<String>,
    /// `s3://bucket/prefix`.
    pub url: String,
    /// Marked `default: true`.
    pub marked_default: bool,
    /// When it was last validated (RFC 3339).
    pub last_validation_time: Option<Time>,
    /// Seconds since then.
    pub last_validation_age_seconds: Option<i64>,
    /// Latency of the last successful probe.
    pub last_probe_latency_milliseconds: Option<i64>,
    /// The status message.
    pub message: Option<String>,
    /// `spec.maintenance.interval`, when the controller prunes it.
    pub maintenance_interval: Option<String>,
    /// The last scheduled prune (`status.maintenance`).
    pub maintenance: Option<MaintenanceStatus>,
    /// Seconds since that prune started.
    pub maintenance_age_seconds: Option<i64>,
}

/// One backup.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupReport {
    /// Name.
    pub name: String,
    /// Phase (`null` before a replica claimed it).
    pub phase: Option<VolumeBackupPhase>,
    /// The location it names, or `null` for the default.
    pub location: Option<String>,
    /// The replica that owns it.
    pub owner: Option<String>,
    /// Progress, once transfers report.
    pub progress: Option<Progress>,
    /// Why it waits or what it is doing (its status message or the
    /// `StorageAvailable` condition's message).
    pub message: Option<String>,
}

/// One restore.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreReport {
    /// Name.
    pub name: String,
    /// Phase (`null` before a replica claimed it).
    pub phase: Option<VolumeRestorePhase>,
    /// The location it restores from, or `null` for the default.
    pub location: Option<String>,
    /// The source VolumeBackup it selects the snapshots of, when it names one.
    pub backup: Option<String>,
    /// The replica that owns it.
    pub owner: Option<String>,
    /// Progress, once transfers report.
    pub progress: Option<Progress>,
    /// Why it waits or what it is doing (its status message or the
    /// `StorageAvailable` condition's message).
    pub message: Option<String>,
}

/// The caps in force.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapsReport {
    /// StoragePolicies (cluster-scoped), by name.
    pub storage_policies: Vec<PolicyCapsReport>,
    /// Locations with an upload cap, by name.
    pub locations: Vec<LocationCapsReport>,
}

/// One StoragePolicy's limits and what its status says is in use.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyCapsReport {
    /// Name.
    pub name: String,
    /// Volumes moved at once.
    pub max_concurrent_volumes: Option<i32>,
    /// Bytes per second over its running transfers.
    pub max_bytes_per_second: Option<i64>,
    /// Running volumes (status).
    pub running_volumes: Option<i32>,
    /// Queued volumes (status).
    pub queued_volumes: Option<i32>,
    /// Bandwidth granted (status).
    pub granted_bytes_per_second: Option<i64>,
}

/// A location's caps.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LocationCapsReport {
    /// Name.
    pub name: String,
    /// Upload bytes per second, all agents together.
    pub upload_bytes_per_second: Option<i64>,
    /// Concurrent requests, all agents together.
    pub max_concurrent_requests: Option<i32>,
}

fn replica_report(pod: &Pod, backups: &[VolumeBackup]) -> ReplicaReport {
    let name = pod.name_any();
    let status = pod.status.clone().unwrap_or_default();
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|condition| condition.type_ == "Ready" && condition.status == "True");
    let restarts = status
        .container_statuses
        .iter()
        .flatten()
        .map(|container| container.restart_count)
        .sum();
    let image = pod.spec.as_ref().and_then(|spec| {
        spec.containers
            .iter()
            .find(|container| container.name == "controller")
            .or_else(|| spec.containers.first())
            .and_then(|container| container.image.clone())
    });
    let version = image.as_deref().and_then(|image| {
        let without_digest = image.split('@').next().unwrap_or(image);
        let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
        last.split_once(':').map(|(_, tag)| tag.to_string())
    });
    ReplicaReport {
        node: pod.spec.as_ref().and_then(|spec| spec.node_name.clone()),
        owns: owned_by(&name, backups),
        name,
        phase: status.phase,
        ready,
        restarts,
        image,
        version,
        lease_alive: None,
        admission_leader: false,
    }
}

/// Unfinished backups whose `status.owner` is `name`, sorted.
fn owned_by(name: &str, backups: &[VolumeBackup]) -> Vec<String> {
    let mut owns: Vec<String> = backups
        .iter()
        .filter(|backup| {
            let status = backup.status.as_ref();
            status
                .and_then(|status| status.owner.as_ref())
                .is_some_and(|owner| owner.replica == name)
                && status
                    .and_then(|status| status.phase)
                    .is_none_or(|phase| !phase.is_final())
        })
        .map(|backup| backup.name_any())
        .collect();
    owns.sort();
    owns
}

/// Add what the Leases say (pure; `now` in seconds): each replica's
/// liveness, replicas known only by their lease (one running outside the
/// cluster, or whose pod is gone), and the admission leader.
pub fn apply_leases(
    report: &mut StatusReport,
    leases: &[Lease],
    backups: &[VolumeBackup],
    now: i64,
) {
    let current = |lease: &Lease| {
        lease.spec.as_ref().is_some_and(|spec| {
            let renewed = spec
                .renew_time
                .as_ref()
                .or(spec.acquire_time.as_ref())
                .map_or(i64::MIN / 2, |time| time.0.as_second());
            renewed + i64::from(spec.lease_duration_seconds.unwrap_or(0)) >= now
        })
    };
    let holder = |lease: &Lease| {
        lease
            .spec
            .as_ref()
            .and_then(|spec| spec.holder_identity.clone())
    };
    report.admission_leader = leases
        .iter()
        .find(|lease| lease.metadata.name.as_deref() == Some(ADMISSION_LEASE))
        .filter(|lease| current(lease))
        .and_then(holder);
    for lease in leases.iter().filter(|lease| {
        lease
            .metadata
            .name
            .as_deref()
            .is_some_and(|name| name.starts_with(replicas::LEASE_PREFIX))
    }) {
        let Some(identity) = holder(lease) else {
            continue;
        };
        let alive = current(lease);
        match report
            .replicas
            .iter_mut()
            .find(|replica| replica.name == identity)
        {
            Some(replica) => replica.lease_alive = Some(alive),
            None => report.replicas.push(ReplicaReport {
                owns: owned_by(&identity, backups),
                name: identity,
                phase: None,
                ready: alive,
                restarts: 0,
                image: None,
                version: None,
                node: None,
                lease_alive: Some(alive),
                admission_leader: false,
            }),
        }
    }
    for replica in &mut report.replicas {
        replica.admission_leader =
            report.admission_leader.as_deref() == Some(replica.name.as_str());
        if replica.lease_alive == Some(false) && !replica.owns.is_empty() {
            report.problems.push(format!(
                "replica {} stopped renewing its lease; another replica adopts its backups ({})",
                replica.name,
                replica.owns.join(", ")
            ));
        }
    }
    report.replicas.sort_by(|a, b| a.name.cmp(&b.name));
}

fn location_report(location: &BackupStorageLocation, now: &Time) -> LocationReport {
    let status = location.status.clone().unwrap_or_default();
    let reason = find_condition(&status.conditions, condition_type::AVAILABLE)
        .map(|condition| condition.reason.clone());
    let age = status
        .last_validation_time
        .as_ref()
        .map(|time| (now.0.as_second() - time.0.as_second()).max(0));
    LocationReport {
        name: location.name_any(),
        phase: status.phase,
        reason,
        url: crate::reconcile::stage_pod::repository_url(&location.spec),
        marked_default: location.spec.is_default,
        last_validation_time: status.last_validation_time,
        last_validation_age_seconds: age,
        last_probe_latency_milliseconds: status.last_probe_latency_milliseconds,
        message: status.message,
        maintenance_interval: location
            .spec
            .maintenance
            .as_ref()
            .map(|maintenance| maintenance.interval.clone()),
        maintenance_age_seconds: status
            .maintenance
            .as_ref()
            .and_then(|maintenance| maintenance.last_start_time.as_ref())
            .map(|time| (now.0.as_second() - time.0.as_second()).max(0)),
        maintenance: status.maintenance,
    }
}

/// Why an object waits or what it is doing: the message of its
/// `StorageAvailable` condition while that is False, else its status
/// message.
fn waiting_message(
    conditions: &[crate::api::Condition],
    message: Option<String>,
) -> Option<String> {
    find_condition(conditions, condition_type::STORAGE_AVAILABLE)
        .filter(|condition| condition.status == crate::api::ConditionStatus::False)
        .map(|condition| condition.message.clone())
        .or(message)
}

fn backup_report(backup: &VolumeBackup) -> BackupReport {
    let status = backup.status.clone().unwrap_or_default();
    BackupReport {
        name: backup.name_any(),
        phase: status.phase,
        location: backup.spec.storage_location.clone(),
        owner: status.owner.map(|owner| owner.replica),
        progress: status.progress,
        message: waiting_message(&status.conditions, status.message),
    }
}

fn restore_report(restore: &VolumeRestore) -> RestoreReport {
    let status = restore.status.clone().unwrap_or_default();
    RestoreReport {
        name: restore.name_any(),
        phase: status.phase,
        location: restore.spec.storage_location.clone(),
        backup: restore.spec.source.backup.clone(),
        owner: status.owner.map(|owner| owner.replica),
        progress: status.progress,
        message: waiting_message(&status.conditions, status.message),
    }
}

/// The unfinished of `objects` (backups or restores) split into running
/// and queued (no phase yet, or one before the work starts), each sorted
/// by name, as `report` shows them.
fn running_and_queued<K: TransferOwner, R>(objects: &[K], report: fn(&K) -> R) -> (Vec<R>, Vec<R>) {
    let mut unfinished: Vec<&K> = objects
        .iter()
        .filter(|object| !object.is_finished())
        .collect();
    unfinished.sort_by_key(|object| object.name_any());
    let (waiting, started): (Vec<&K>, Vec<&K>) = unfinished
        .into_iter()
        .partition(|object| object.phase().is_none_or(K::is_queued));
    (
        started.into_iter().map(report).collect(),
        waiting.into_iter().map(report).collect(),
    )
}

/// The report from what was listed (pure; `now` for ages).
pub fn build_report(
    namespace: &str,
    pods: &[Pod],
    locations: &[BackupStorageLocation],
    backups: &[VolumeBackup],
    restores: &[VolumeRestore],
    policies: &[StoragePolicy],
    now: &Time,
) -> StatusReport {
    let mut replicas: Vec<ReplicaReport> = pods
        .iter()
        .map(|pod| replica_report(pod, backups))
        .collect();
    replicas.sort_by(|a, b| a.name.cmp(&b.name));
    let mut location_reports: Vec<LocationReport> = locations
        .iter()
        .map(|location| location_report(location, now))
        .collect();
    location_reports.sort_by(|a, b| a.name.cmp(&b.name));
    let choice = choose_default(locations.iter());

    let (running, queued) = running_and_queued(backups, backup_report);
    let (running_restores, queued_restores) = running_and_queued(restores, restore_report);

    let mut storage_policies: Vec<PolicyCapsReport> = policies
        .iter()
        .map(|policy| {
            let status = policy.status.clone().unwrap_or_default();
            PolicyCapsReport {
                name: policy.name_any(),
                max_concurrent_volumes: policy.spec.max_concurrent_volumes,
                max_bytes_per_second: policy.spec.max_bytes_per_second,
                running_volumes: status.running_volumes,
                queued_volumes: status.queued_volumes,
                granted_bytes_per_second: status.granted_bytes_per_second,
            }
        })
        .collect();
    storage_policies.sort_by(|a, b| a.name.cmp(&b.name));
    let mut location_caps: Vec<LocationCapsReport> = locations
        .iter()
        .filter(|location| {
            location.spec.upload_bytes_per_second.is_some()
                || location.spec.max_concurrent_requests.is_some()
        })
        .map(|location| LocationCapsReport {
            name: location.name_any(),
            upload_bytes_per_second: location.spec.upload_bytes_per_second,
            max_concurrent_requests: location.spec.max_concurrent_requests,
        })
        .collect();
    location_caps.sort_by(|a, b| a.name.cmp(&b.name));

    let mut problems = Vec::new();
    if replicas.is_empty() {
        problems.push(format!(
            "no controller pod ({CONTROLLER_POD_SELECTOR}) in namespace {namespace}: nothing processes backups; apply manifests/"
        ));
    } else if !replicas.iter().any(|replica| replica.ready) {
        problems.push("no controller replica is Ready: see `kubectl logs` of its pods".to_string());
    }
    let available = location_reports
        .iter()
        .filter(|location| location.phase == Some(BackupStorageLocationPhase::Available))
        .count();
    if location_reports.is_empty() {
        problems.push(format!(
            "no BackupStorageLocation in namespace {namespace}: backups wait until one exists; create one (docs/api.md)"
        ));
    } else {
        let bad: Vec<String> = location_reports
            .iter()
            .filter(|location| location.phase != Some(BackupStorageLocationPhase::Available))
            .map(|location| {
                format!(
                    "{} ({})",
                    location.name,
                    location.reason.as_deref().unwrap_or("NotValidatedYet")
                )
            })
            .collect();
        if available == 0 {
            problems.push(format!(
                "no BackupStorageLocation is Available: {}; every backup waits",
                bad.join(", ")
            ));
        } else if !bad.is_empty() {
            problems.push(format!(
                "not Available: {}; backups to them wait",
                bad.join(", ")
            ));
        }
    }
    if let Some(choice) = &choice
        && !choice.others.is_empty()
    {
        problems.push(format!(
            "several locations are marked default: {} is used, {} ignored; set default: false on all but one",
            choice.winner,
            choice.others.join(", ")
        ));
    }
    for location in &location_reports {
        if let Some(maintenance) = &location.maintenance
            && maintenance.result == Some(MaintenanceResult::Failed)
        {
            problems.push(format!(
                "the scheduled prune of location {} failed: {}",
                location.name,
                maintenance.message.as_deref().unwrap_or("(no message)")
            ));
        }
    }

    StatusReport {
        format_version: STATUS_FORMAT_VERSION,
        cli_version: env!("CARGO_PKG_VERSION").to_string(),
        admission_leader: None,
        namespace: namespace.to_string(),
        replicas,
        locations: location_reports,
        default_location: choice.map(|choice| choice.winner),
        running_backups: running,
        queued_backups: queued,
        running_restores,
        queued_restores,
        caps: CapsReport {
            storage_policies,
            locations: location_caps,
        },
        problems,
    }
}

/// Whether any location is Available (the exit code depends on it).
pub fn any_location_available(report: &StatusReport) -> bool {
    report
        .locations
        .iter()
        .any(|location| location.phase == Some(BackupStorageLocationPhase::Available))
}

fn age(seconds: i64) -> String {
    match seconds {
        ..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86_400 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    }
}

fn optional<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_string(), |value| value.to_string())
}

fn rate(bytes_per_second: Option<i64>) -> String {
    bytes_per_second.map_or_else(
        || "-".to_string(),
        |value| format!("{}/s", ByteSize::b(u64::try_from(value).unwrap_or(0))),
    )
}

/// A section of the table: `title`, then `none` when there are no
/// `reports`, else `header` and a `row` each.
fn write_section<R>(
    out: &mut String,
    title: &str,
    none: &str,
    reports: &[R],
    header: String,
    row: impl Fn(&R) -> String,
) {
    let _ = writeln!(out, "\n{title}");
    if reports.is_empty() {
        let _ = writeln!(out, "  {none}");
        return;
    }
    let _ = writeln!(out, "{header}");
    for report in reports {
        let _ = writeln!(out, "{}", row(report));
    }
}

/// The DONE column: the percentage, once transfers report.
fn done(progress: Option<&Progress>) -> String {
    progress.map_or_else(
        || "-".to_string(),
        |progress| format!("{}%", progress.percent),
    )
}

/// The header of a backups or restores section; `backup` is a restore's
/// BACKUP column, padded, or empty.
fn owner_header(backup: &str) -> String {
    format!(
        "{:<24} {:<18} {:<16} {backup}{:<16} {:>5}  MESSAGE",
        "NAME", "PHASE", "LOCATION", "OWNER", "DONE"
    )
}

/// A row of a backups or restores section from `$report` (a
/// [`BackupReport`] or a [`RestoreReport`]: both name these fields alike);
/// `$backup` is a restore's BACKUP cell, padded, or empty.
macro_rules! owner_row {
    ($report:expr, $backup:expr) => {
        format!(
            "{:<24} {:<18} {:<16} {}{:<16} {:>5}  {}",
            $report.name,
            optional($report.phase.map(|phase| format!("{phase:?}"))),
            $report.location.as_deref().unwrap_or("(default)"),
            $backup,
            $report.owner.as_deref().unwrap_or("-"),
            done($report.progress.as_ref()),
            $report.message.as_deref().unwrap_or("")
        )
    };
}

fn backup_lines(out: &mut String, title: &str, backups: &[BackupReport]) {
    write_section(out, title, "(none)", backups, owner_header(""), |backup| {
        owner_row!(backup, "")
    });
}

fn restore_lines(out: &mut String, title: &str, restores: &[RestoreReport]) {
    let header = owner_header(&format!("{:<24} ", "BACKUP"));
    write_section(out, title, "(none)", restores, header, |restore| {
        owner_row!(
            restore,
            format!("{:<24} ", restore.backup.as_deref().unwrap_or("-"))
        )
    });
}

/// The report as aligned text (pure).
pub fn render_table(report: &StatusReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "haulage {} — namespace {}",
        report.cli_version, report.namespace
    );
    write_section(
        &mut out,
        "CONTROLLER REPLICAS",
        "(none)",
        &report.replicas,
        format!(
            "{:<40} {:<6} {:>8}  {:<12} {:<16} {:<8} {:<10} OWNS",
            "NAME", "READY", "RESTARTS", "VERSION", "NODE", "LEASE", "LEADS"
        ),
        |replica| {
            format!(
                "{:<40} {:<6} {:>8}  {:<12} {:<16} {:<8} {:<10} {}",
                replica.name,
                if replica.ready { "yes" } else { "no" },
                replica.restarts,
                replica.version.as_deref().unwrap_or("-"),
                replica.node.as_deref().unwrap_or("-"),
                match replica.lease_alive {
                    Some(true) => "current",
                    Some(false) => "expired",
                    None => "-",
                },
                if replica.admission_leader {
                    "admission"
                } else {
                    "-"
                },
                if replica.owns.is_empty() {
                    "-".to_string()
                } else {
                    replica.owns.join(",")
                }
            )
        },
    );
    write_section(
        &mut out,
        "STORAGE LOCATIONS",
        "(none: backups wait until one exists)",
        &report.locations,
        format!(
            "{:<20} {:<12} {:<26} {:<8} {:>9} {:>8}  MESSAGE",
            "NAME", "PHASE", "REASON", "DEFAULT", "VALIDATED", "LATENCY"
        ),
        |location| {
            let default = match (&report.default_location, location.marked_default) {
                (Some(winner), true) if *winner == location.name => "yes",
                (_, true) => "ignored",
                _ => "",
            };
            format!(
                "{:<20} {:<12} {:<26} {:<8} {:>9} {:>8}  {}",
                location.name,
                optional(location.phase.map(|phase| format!("{phase:?}"))),
                location.reason.as_deref().unwrap_or("-"),
                default,
                location.last_validation_age_seconds.map_or_else(
                    || "never".to_string(),
                    |seconds| format!("{} ago", age(seconds))
                ),
                location
                    .last_probe_latency_milliseconds
                    .map_or_else(|| "-".to_string(), |millis| format!("{millis}ms")),
                location.message.as_deref().unwrap_or("")
            )
        },
    );
    let maintained: Vec<&LocationReport> = report
        .locations
        .iter()
        .filter(|location| {
            location.maintenance_interval.is_some() || location.maintenance.is_some()
        })
        .collect();
    write_section(
        &mut out,
        "MAINTENANCE",
        "(none: no location has spec.maintenance)",
        &maintained,
        format!(
            "{:<20} {:<8} {:<10} {:>10} {:>10} {:>10}  MESSAGE",
            "LOCATION", "EVERY", "RESULT", "STARTED", "RECLAIMED", "WAITING"
        ),
        |location| {
            let maintenance = location.maintenance.clone().unwrap_or_default();
            let bytes = |value: Option<i64>| {
                value.map_or_else(
                    || "-".to_string(),
                    |bytes| ByteSize::b(u64::try_from(bytes).unwrap_or(0)).to_string(),
                )
            };
            format!(
                "{:<20} {:<8} {:<10} {:>10} {:>10} {:>10}  {}",
                location.name,
                location.maintenance_interval.as_deref().unwrap_or("off"),
                optional(maintenance.result.map(|result| format!("{result:?}"))),
                location.maintenance_age_seconds.map_or_else(
                    || "never".to_string(),
                    |seconds| format!("{} ago", age(seconds))
                ),
                bytes(maintenance.reclaimed_bytes),
                bytes(maintenance.waiting_bytes),
                maintenance.message.as_deref().unwrap_or("")
            )
        },
    );
    backup_lines(&mut out, "RUNNING BACKUPS", &report.running_backups);
    backup_lines(&mut out, "QUEUED BACKUPS", &report.queued_backups);
    restore_lines(&mut out, "RUNNING RESTORES", &report.running_restores);
    restore_lines(&mut out, "QUEUED RESTORES", &report.queued_restores);
    let _ = writeln!(out, "\nCAPS");
    if report.caps.storage_policies.is_empty() && report.caps.locations.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for policy in &report.caps.storage_policies {
        let _ = writeln!(
            out,
            "StoragePolicy {:<20} volumes {} (running {}, queued {})  bandwidth {} (granted {})",
            policy.name,
            optional(policy.max_concurrent_volumes),
            optional(policy.running_volumes),
            optional(policy.queued_volumes),
            rate(policy.max_bytes_per_second),
            rate(policy.granted_bytes_per_second),
        );
    }
    for location in &report.caps.locations {
        let _ = writeln!(
            out,
            "Location      {:<20} upload {}  requests {}",
            location.name,
            rate(location.upload_bytes_per_second),
            optional(location.max_concurrent_requests),
        );
    }
    if !report.problems.is_empty() {
        let _ = writeln!(out, "\nPROBLEMS");
        for problem in &report.problems {
            let _ = writeln!(out, "- {problem}");
        }
    }
    out
}

/// Run `haulage status`.
pub async fn run(arguments: StatusArgs) -> anyhow::Result<Outcome> {
    let client = crate::cli::cluster::client(&arguments.cluster)
        .await
        .context("cannot reach the Kubernetes API (check --kubeconfig/--context)")?;
    let namespace = &arguments.namespace;
    let everything = ListParams::default();
    let controller_pods = ListParams::default().labels(CONTROLLER_POD_SELECTOR);
    /// The objects of kind `K` in `namespace` that `params` select; the
    /// error says it could not list `what`.
    async fn list<K: Namespaced>(
        client: &kube::Client,
        namespace: &str,
        params: &ListParams,
        what: String,
    ) -> anyhow::Result<kube::core::ObjectList<K>> {
        Api::<K>::namespaced(client.clone(), namespace)
            .list(params)
            .await
            .with_context(|| format!("cannot list {what}"))
    }
    let (pods, locations, backups, restores, policies) = tokio::try_join!(
        list::<Pod>(
            &client,
            namespace,
            &controller_pods,
            format!("the controller pods in {namespace}"),
        ),
        list::<BackupStorageLocation>(
            &client,
            namespace,
            &everything,
            format!("BackupStorageLocations in {namespace}"),
        ),
        list::<VolumeBackup>(
            &client,
            namespace,
            &everything,
            format!("VolumeBackups in {namespace}"),
        ),
        list::<VolumeRestore>(
            &client,
            namespace,
            &everything,
            format!("VolumeRestores in {namespace} (are haulage's CRDs of this version applied?)"),
        ),
        async {
            Api::<StoragePolicy>::all(client.clone())
                .list(&everything)
                .await
                .context("cannot list StoragePolicies")
        },
    )?;
    // Leases say which replicas are alive and which one admits; a user
    // without `list leases` still gets the rest.
    let leases = match Api::<Lease>::namespaced(client.clone(), namespace)
        .list(&everything)
        .await
    {
        Ok(list) => list.items,
        Err(error) => {
            eprintln!(
                "haulage status: warning: cannot list Leases in {namespace} ({error}); replica liveness and the admission leader are not shown"
            );
            Vec::new()
        }
    };
    let now = crate::clock::now();
    let mut report = build_report(
        namespace,
        &pods.items,
        &locations.items,
        &backups.items,
        &restores.items,
        &policies.items,
        &now,
    );
    apply_leases(&mut report, &leases, &backups.items, now.0.as_second());
    match arguments.output {
        StatusFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        StatusFormat::Table => print!("{}", render_table(&report)),
    }
    Ok(if any_location_available(&report) {
        Outcome::Success
    } else {
        Outcome::NoLocationAvailable
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::BackupStorageLocationStatus;
    use crate::api::backup::OwnerClaim;

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + seconds).expect("valid"))
    }

    fn pod(name: &str, ready: bool, restarts: i32) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"nodeName": "node-a", "containers": [
                {"name": "controller", "image": "ghcr.io/haulage-dev/haulage:0.2.0"}]},
            "status": {"phase": "Running",
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
                "containerStatuses": [{"name": "controller", "restartCount": restarts,
                    "ready": ready, "image": "x", "imageID": "y"}]}
        }))
        .expect("valid pod")
    }

    fn backup(name: &str, phase: VolumeBackupPhase, owner: &str) -> VolumeBackup {
        let mut backup = VolumeBackup::test(name).with_phase(phase);
        if let Some(status) = backup.status.as_mut() {
            status.owner = Some(OwnerClaim {
                replica: owner.to_string(),
                claimed_at: at(0),
                adopted_from: None,
            });
            status.progress = Some(Progress {
                percent: 40,
                ..Progress::default()
            });
        }
        backup
    }

    fn location(name: &str, phase: BackupStorageLocationPhase, why: &str) -> BackupStorageLocation {
        let mut location = BackupStorageLocation::test(name);
        location.status = Some(BackupStorageLocationStatus {
            phase: Some(phase),
            last_validation_time: Some(at(30)),
            last_probe_latency_milliseconds: Some(7),
            index_bytes: None,
            message: Some(format!("{name} message")),
            conditions: vec![crate::api::Condition::new(
                condition_type::AVAILABLE,
                crate::api::ConditionStatus::False,
                why,
                "",
                None,
                at(30),
            )],
            observed_generation: None,
            maintenance: None,
        });
        location
    }

    #[test]
    fn leases_show_the_admission_leader_and_each_replicas_liveness() {
        let t = 1_800_000_000;
        let mut report = build_report(
            SYSTEM_NAMESPACE,
            &[pod("controller-a", true, 0)],
            &[],
            &[backup(
                "nightly",
                VolumeBackupPhase::InProgress,
                "controller-b",
            )],
            &[],
            &[],
            &at(0),
        );
        let micro = |seconds: i64| {
            k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                k8s_openapi::jiff::Timestamp::from_second(seconds).expect("valid"),
            )
        };
        let mut admission = replicas::replica_lease("controller-a", SYSTEM_NAMESPACE, 15, micro(t));
        admission.metadata.name = Some(ADMISSION_LEASE.to_string());
        let leases = [
            admission,
            replicas::replica_lease("controller-a", SYSTEM_NAMESPACE, 30, micro(t)),
            replicas::replica_lease("controller-b", SYSTEM_NAMESPACE, 30, micro(t - 300)),
        ];
        apply_leases(
            &mut report,
            &leases,
            &[backup(
                "nightly",
                VolumeBackupPhase::InProgress,
                "controller-b",
            )],
            t + 5,
        );
        assert_eq!(report.admission_leader.as_deref(), Some("controller-a"));
        let names: Vec<_> = report.replicas.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["controller-a", "controller-b"]);
        assert!(report.replicas[0].admission_leader);
        assert_eq!(report.replicas[0].lease_alive, Some(true));
        assert_eq!(report.replicas[1].lease_alive, Some(false));
        assert_eq!(report.replicas[1].owns, ["nightly"]);
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.contains("controller-b stopped renewing")),
            "{:?}",
            report.problems
        );
        let table = render_table(&report);
        assert!(table.contains("admission"), "{table}");
        assert!(table.contains("expired"), "{table}");
    }

    #[test]
    fn the_report_shows_replicas_with_what_they_own_locations_backups_and_problems() {
        let pods = [pod("haulage-b", true, 0), pod("haulage-a", false, 3)];
        let mut good = location(
            "good",
            BackupStorageLocationPhase::Available,
            "ProbeSucceeded",
        );
        good.spec.is_default = true;
        good.spec.upload_bytes_per_second = Some(1 << 20);
        let bad = location(
            "bad",
            BackupStorageLocationPhase::Unavailable,
            "BucketNotFound",
        );
        let backups = [
            backup("nightly", VolumeBackupPhase::InProgress, "haulage-b"),
            backup("waiting", VolumeBackupPhase::WaitingForStorage, "haulage-a"),
            backup("done", VolumeBackupPhase::Completed, "haulage-b"),
        ];
        let report = build_report(
            SYSTEM_NAMESPACE,
            &pods,
            &[good, bad],
            &backups,
            &[],
            &[],
            &at(90),
        );
        assert_eq!(report.replicas[0].name, "haulage-a");
        assert_eq!(report.replicas[0].restarts, 3);
        assert!(!report.replicas[0].ready);
        assert_eq!(report.replicas[1].version.as_deref(), Some("0.2.0"));
        assert_eq!(
            report.replicas[1].owns,
            ["nightly"],
            "finished backups are not owned work"
        );
        assert_eq!(report.locations[0].name, "bad");
        assert_eq!(
            report.locations[0].reason.as_deref(),
            Some("BucketNotFound")
        );
        assert_eq!(report.locations[1].last_validation_age_seconds, Some(60));
        assert_eq!(report.default_location.as_deref(), Some("good"));
        assert_eq!(report.running_backups.len(), 1);
        assert_eq!(report.queued_backups[0].name, "waiting");
        assert_eq!(
            report.caps.locations[0].upload_bytes_per_second,
            Some(1 << 20)
        );
        assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
        assert!(report.problems[0].contains("bad (BucketNotFound)"));
        assert!(any_location_available(&report));

        let text = render_table(&report);
        assert!(text.contains("1m ago"), "{text}");
        assert!(text.contains("BucketNotFound"), "{text}");
        assert!(text.contains("40%"), "{text}");
        assert!(
            text.contains("1.0 MiB/s") || text.contains("1.0 MB/s"),
            "{text}"
        );

        let json = serde_json::to_value(&report).expect("serialisable");
        assert_eq!(json["locations"][1]["phase"], "Available");
        assert_eq!(json["replicas"][1]["owns"][0], "nightly");
        assert_eq!(json["formatVersion"], STATUS_FORMAT_VERSION);
    }

    #[test]
    fn scheduled_maintenance_shows_its_last_prune_and_a_failed_one_is_a_problem() {
        let mut pruned = location(
            "pruned",
            BackupStorageLocationPhase::Available,
            "ProbeSucceeded",
        );
        pruned.spec.maintenance = Some(crate::api::location::LocationMaintenance {
            interval: "24h".into(),
            safety_margin: "24h".into(),
            keep_checkpoints_within: "168h".into(),
            repack_threshold_percent: 10,
        });
        let mut failing = pruned.clone();
        failing.metadata.name = Some("failing".into());
        let status = |location: &mut BackupStorageLocation, maintenance: MaintenanceStatus| {
            location.status.as_mut().expect("status").maintenance = Some(maintenance);
        };
        status(
            &mut pruned,
            MaintenanceStatus {
                result: Some(MaintenanceResult::Succeeded),
                last_start_time: Some(at(-3_600)),
                reclaimed_bytes: Some(3 << 30),
                waiting_bytes: Some(0),
                message: Some("deleted 12 packs".into()),
                ..MaintenanceStatus::default()
            },
        );
        status(
            &mut failing,
            MaintenanceStatus {
                result: Some(MaintenanceResult::Failed),
                last_start_time: Some(at(-60)),
                message: Some("prune failed: access denied".into()),
                ..MaintenanceStatus::default()
            },
        );
        let plain = location(
            "plain",
            BackupStorageLocationPhase::Available,
            "ProbeSucceeded",
        );
        let report = build_report(
            SYSTEM_NAMESPACE,
            &[pod("haulage-a", true, 0)],
            &[pruned, failing, plain],
            &[],
            &[],
            &[],
            &at(0),
        );
        let text = render_table(&report);
        let section = text
            .split("\nMAINTENANCE\n")
            .nth(1)
            .and_then(|rest| rest.split("\n\n").next())
            .expect("a MAINTENANCE section");
        assert!(section.contains("pruned"), "{section}");
        assert!(section.contains("Succeeded"), "{section}");
        assert!(section.contains("1h ago"), "{section}");
        assert!(
            section.contains("3.0 GiB") || section.contains("3.2 GB"),
            "{section}"
        );
        assert!(
            !section.contains("plain"),
            "a location without maintenance: {section}"
        );
        assert_eq!(
            report
                .problems
                .iter()
                .filter(|problem| problem
                    .contains("location failing failed: prune failed: access denied"))
                .count(),
            1,
            "{:?}",
            report.problems
        );
        let json = serde_json::to_value(&report).expect("serialisable");
        assert_eq!(json["locations"][2]["name"], "pruned");
        assert_eq!(json["locations"][2]["maintenance"]["result"], "Succeeded");
        assert_eq!(json["locations"][2]["maintenanceInterval"], "24h");
    }

    #[test]
    fn no_location_is_a_problem_and_not_available() {
        let report = build_report(SYSTEM_NAMESPACE, &[], &[], &[], &[], &[], &at(0));
        assert!(!any_location_available(&report));
        assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
        assert!(report.problems[1].contains("no BackupStorageLocation"));
        assert!(render_table(&report).contains("(none: backups wait"));
    }

    #[test]
    fn unfinished_restores_are_listed_running_or_queued_with_their_source_backup() {
        let restore = |name: &str, phase: Option<VolumeRestorePhase>| {
            let mut restore = VolumeRestore::test(name);
            restore.status = phase.map(|phase| crate::api::VolumeRestoreStatus {
                phase: Some(phase),
                message: Some(format!("{name} is {phase:?}")),
                ..Default::default()
            });
            restore
        };
        let restores = [
            restore("move-final", Some(VolumeRestorePhase::InProgress)),
            restore("move-1", Some(VolumeRestorePhase::Completed)),
            restore("waiting", Some(VolumeRestorePhase::WaitingForStorage)),
            restore("fresh", None),
            restore("selecting", Some(VolumeRestorePhase::Selecting)),
        ];
        let report = build_report(SYSTEM_NAMESPACE, &[], &[], &[], &restores, &[], &at(0));
        let names = |reports: &[RestoreReport]| -> Vec<String> {
            reports.iter().map(|report| report.name.clone()).collect()
        };
        assert_eq!(names(&report.running_restores), ["move-final", "selecting"]);
        assert_eq!(names(&report.queued_restores), ["fresh", "waiting"]);
        assert_eq!(
            report.running_restores[0].backup.as_deref(),
            Some("nightly")
        );
        let text = render_table(&report);
        assert!(text.contains("RUNNING RESTORES"), "{text}");
        assert!(text.contains("move-final is InProgress"), "{text}");
        assert!(
            !text.contains("move-1"),
            "finished restores are not shown: {text}"
        );
        let json = serde_json::to_value(&report).expect("serialisable");
        assert_eq!(json["queuedRestores"][1]["phase"], "WaitingForStorage");
    }
}
