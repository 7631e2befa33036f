//! What the migration's statuses say: whether a pass may go on
//! ([`backup_outcome`], [`restore_outcome`]), the one-line progress of a
//! pass ([`progress_text`]), and the closing report ([`build_report`],
//! [`render_report`]): per volume the bytes each pass moved (the backup's
//! `bytesRead`/`bytesNew` from its VolumeTransfers, the restore's
//! `bytesWritten`), each pass's duration, the downtime window (quiesce →
//! final restore verified) and the tree each claim was verified against.
//! Pure: read from the objects the CLI fetched.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use bytesize::ByteSize;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::quiesce::ClaimKey;
use super::settings::Pass;
use crate::api::transfer::TransferDirection;
use crate::api::{
    Progress, VolumeBackup, VolumeBackupPhase, VolumeRestore, VolumeRestorePhase, VolumeTransfer,
    VolumeTransferPhase,
};
use crate::cli::transfer_owner::{TransferOwner, VolumeOutcome};

fn bytes(value: i64) -> String {
    ByteSize::b(u64::try_from(value).unwrap_or(0))
        .display()
        .iec()
        .to_string()
}

/// Whether a finished VolumeBackup lets the migration go on: Completed,
/// or — in the first pass of a `--quiesce` migration — PartiallyFailed
/// only by the `deferred` claims (ReadWriteOncePod claims in use, moved
/// by the final pass). The error says which volumes failed and why.
pub fn backup_outcome(backup: &VolumeBackup, deferred: &BTreeSet<ClaimKey>) -> Result<(), String> {
    let status = backup.status.clone().unwrap_or_default();
    let name = format!(
        "VolumeBackup {}/{}",
        backup.namespace().unwrap_or_default(),
        backup.name_any()
    );
    let failed = failed_volumes(&status.results, deferred);
    match status.phase {
        Some(VolumeBackupPhase::Completed) => Ok(()),
        Some(VolumeBackupPhase::PartiallyFailed) if failed.is_empty() => Ok(()),
        phase => Err(format!(
            "{name} ended {}; see `haulage describe backup {} -n {}` on the source",
            how_it_ended(phase, status.message.as_deref(), &failed),
            backup.name_any(),
            backup.namespace().unwrap_or_default()
        )),
    }
}

/// The volumes of `results` that did not complete, but for the
/// `deferred` claims, each `NAMESPACE/PVC PHASE: REASON`.
fn failed_volumes(results: &[impl VolumeOutcome], deferred: &BTreeSet<ClaimKey>) -> Vec<String> {
    results
        .iter()
        .map(VolumeOutcome::outcome)
        .filter(|(_, _, phase, _)| *phase != VolumeTransferPhase::Completed)
        .filter(|(namespace, pvc, ..)| {
            !deferred.contains(&(namespace.to_string(), pvc.to_string()))
        })
        .map(|(namespace, pvc, phase, message)| {
            format!(
                "{namespace}/{pvc} {phase:?}: {}",
                message.unwrap_or("no reason given")
            )
        })
        .collect()
}

/// `PHASE: MESSAGE (FAILED; …)`: how a pass's object that does not let the
/// migration go on ended.
fn how_it_ended(
    phase: Option<impl std::fmt::Debug>,
    message: Option<&str>,
    failed: &[String],
) -> String {
    format!(
        "{}: {}{}",
        phase.map_or_else(
            || "without a phase".to_string(),
            |phase| format!("{phase:?}")
        ),
        message.unwrap_or("no message"),
        if failed.is_empty() {
            String::new()
        } else {
            format!(" ({})", failed.join("; "))
        }
    )
}

/// Whether a finished VolumeRestore lets the migration go on: only
/// Completed (every volume restored and verified).
pub fn restore_outcome(restore: &VolumeRestore) -> Result<(), String> {
    let status = restore.status.clone().unwrap_or_default();
    if status.phase == Some(VolumeRestorePhase::Completed) {
        return Ok(());
    }
    let failed = failed_volumes(&status.results, &BTreeSet::new());
    Err(format!(
        "VolumeRestore {}/{} ended {}; `haulage describe restore {} -n {}` on the destination shows each volume",
        restore.namespace().unwrap_or_default(),
        restore.name_any(),
        how_it_ended(status.phase, status.message.as_deref(), &failed),
        restore.name_any(),
        restore.namespace().unwrap_or_default()
    ))
}

/// One line of a pass's progress: phase, bytes, files, rate and ETA.
pub fn progress_text(phase: &str, progress: Option<&Progress>) -> String {
    let Some(progress) =
        progress.filter(|progress| progress.total_bytes > 0 || progress.bytes_done > 0)
    else {
        return phase.to_string();
    };
    let eta = progress
        .eta_seconds
        .map_or_else(|| "-".to_string(), |seconds| format!("{seconds}s"));
    format!(
        "{phase} {:>3}%  {} / {}  {}/{} files  {}/s  ETA {eta}",
        progress.percent,
        bytes(progress.bytes_done),
        bytes(progress.total_bytes),
        progress.files_done,
        progress.total_files,
        bytes(progress.bytes_per_second),
    )
}

/// What one pass's objects hold, for the report.
#[derive(Debug, Clone, Copy)]
pub struct PassObjects<'a> {
    /// Which pass.
    pub pass: Pass,
    /// Its VolumeBackup on the source.
    pub backup: Option<&'a VolumeBackup>,
    /// That backup's VolumeTransfers.
    pub transfers: &'a [VolumeTransfer],
    /// Its VolumeRestore on the destination.
    pub restore: Option<&'a VolumeRestore>,
}

/// One pass of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassSummary {
    /// Which pass.
    pub pass: Pass,
    /// The backup's phase.
    pub backup_phase: Option<String>,
    /// Seconds from the backup's start to its completion.
    pub backup_seconds: Option<i64>,
    /// The restore's phase.
    pub restore_phase: Option<String>,
    /// Seconds from the restore's start to its completion.
    pub restore_seconds: Option<i64>,
}

/// What one pass moved of one volume.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeFigures {
    /// Bytes the backup read from the source claim.
    pub bytes_read: Option<i64>,
    /// Bytes of those the repository did not have.
    pub bytes_new: Option<i64>,
    /// Bytes the restore wrote into the destination claim.
    pub bytes_written: Option<i64>,
}

/// One volume of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSummary {
    /// The source claim, `namespace/name`.
    pub source: String,
    /// The destination claim, `namespace/name` (once a restore chose it).
    pub destination: Option<String>,
    /// Per pass that touched it.
    pub passes: BTreeMap<Pass, VolumeFigures>,
    /// The snapshot tree the destination claim was last verified against.
    pub verified_tree: Option<String>,
}

/// The downtime window of a cutover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Downtime {
    /// When the workloads were quiesced.
    pub start: Timestamp,
    /// When the final restore was verified.
    pub end: Timestamp,
}

impl Downtime {
    /// Its length in seconds.
    pub fn seconds(&self) -> i64 {
        self.end.as_second() - self.start.as_second()
    }
}

/// The closing report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// The migration's name.
    pub name: String,
    /// Each pass that ran.
    pub passes: Vec<PassSummary>,
    /// Each volume, by source claim.
    pub volumes: Vec<VolumeSummary>,
    /// The downtime window, after a cutover.
    pub downtime: Option<Downtime>,
}

/// The report's volume of the source claim `source`, added when new.
fn volume_of(volumes: &mut BTreeMap<String, VolumeSummary>, source: String) -> &mut VolumeSummary {
    volumes
        .entry(source.clone())
        .or_insert_with(|| VolumeSummary {
            source,
            destination: None,
            passes: BTreeMap::new(),
            verified_tree: None,
        })
}

fn seconds_between(start: Option<&Time>, end: Option<&Time>) -> Option<i64> {
    Some(end?.0.as_second() - start?.0.as_second())
}

/// The report from the passes' objects; `quiesced_at` is when the
/// workloads were scaled to zero (RFC 3339).
pub fn build_report(
    name: &str,
    passes: &[PassObjects<'_>],
    quiesced_at: Option<&str>,
) -> MigrationReport {
    let mut summaries = Vec::new();
    let mut volumes: BTreeMap<String, VolumeSummary> = BTreeMap::new();
    let mut downtime = None;
    for objects in passes {
        let backup_status = objects.backup.and_then(|backup| backup.status.clone());
        let restore_status = objects.restore.and_then(|restore| restore.status.clone());
        if objects.backup.is_none() && objects.restore.is_none() {
            continue;
        }
        summaries.push(PassSummary {
            pass: objects.pass,
            backup_phase: objects.backup.map(VolumeBackup::shown_phase),
            backup_seconds: backup_status.as_ref().and_then(|status| {
                seconds_between(status.start_time.as_ref(), status.completion_time.as_ref())
            }),
            restore_phase: objects.restore.map(VolumeRestore::shown_phase),
            restore_seconds: restore_status.as_ref().and_then(|status| {
                seconds_between(status.start_time.as_ref(), status.completion_time.as_ref())
            }),
        });
        for transfer in objects
            .transfers
            .iter()
            .filter(|transfer| transfer.spec.direction == TransferDirection::Upload)
        {
            let source = format!(
                "{}/{}",
                transfer.namespace().unwrap_or_default(),
                transfer.spec.pvc
            );
            let status = transfer.status.clone().unwrap_or_default();
            let volume = volume_of(&mut volumes, source);
            let figures = volume.passes.entry(objects.pass).or_default();
            figures.bytes_read = status.bytes_read;
            figures.bytes_new = status.bytes_new;
        }
        if let Some(status) = &restore_status {
            for selected in &status.selection {
                let result = status.results.iter().find(|result| {
                    result.namespace == selected.namespace && result.pvc == selected.pvc
                });
                let volume = volume_of(&mut volumes, selected.source.clone());
                volume.destination = Some(format!("{}/{}", selected.namespace, selected.pvc));
                volume.passes.entry(objects.pass).or_default().bytes_written =
                    result.and_then(|result| result.bytes_written);
                if let Some(tree) = result.and_then(|result| result.verified_tree.clone()) {
                    volume.verified_tree = Some(tree);
                }
            }
        }
        if objects.pass == Pass::Final
            && let Some(status) = &restore_status
            && status.phase == Some(VolumeRestorePhase::Completed)
            && let Some(end) = &status.completion_time
        {
            let start = quiesced_at
                .and_then(|text| text.parse::<Timestamp>().ok())
                .or_else(|| {
                    objects
                        .backup
                        .and_then(|backup| backup.metadata.creation_timestamp.as_ref())
                        .map(|time| time.0)
                });
            downtime = start.map(|start| Downtime { start, end: end.0 });
        }
    }
    MigrationReport {
        name: name.to_string(),
        passes: summaries,
        volumes: volumes.into_values().collect(),
        downtime,
    }
}

fn optional_bytes(value: Option<i64>) -> String {
    value.map_or_else(|| "-".to_string(), bytes)
}

fn optional_seconds(value: Option<i64>) -> String {
    value.map_or_else(|| "-".to_string(), |seconds| format!("{seconds}s"))
}

/// The report as text for people.
pub fn render_report(report: &MigrationReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\nMIGRATION {}", report.name);
    let _ = writeln!(
        out,
        "{:<12} {:<16} {:>8}  {:<16} {:>8}",
        "PASS", "BACKUP", "TIME", "RESTORE", "TIME"
    );
    for pass in &report.passes {
        let _ = writeln!(
            out,
            "{:<12} {:<16} {:>8}  {:<16} {:>8}",
            pass.pass.label(),
            pass.backup_phase.as_deref().unwrap_or("-"),
            optional_seconds(pass.backup_seconds),
            pass.restore_phase.as_deref().unwrap_or("-"),
            optional_seconds(pass.restore_seconds),
        );
    }
    let _ = writeln!(out, "\nVOLUMES");
    let _ = writeln!(
        out,
        "{:<28} {:<28} {:<11} {:>10} {:>10} {:>10}  VERIFIED",
        "SOURCE", "DESTINATION", "PASS", "READ", "NEW", "WRITTEN"
    );
    for volume in &report.volumes {
        let verified = volume.verified_tree.as_deref().map_or_else(
            || "no".to_string(),
            |tree| tree[..tree.len().min(16)].to_string(),
        );
        for (index, (pass, figures)) in volume.passes.iter().enumerate() {
            let first = index == 0;
            let _ = writeln!(
                out,
                "{:<28} {:<28} {:<11} {:>10} {:>10} {:>10}  {}",
                if first { volume.source.as_str() } else { "" },
                if first {
                    volume.destination.as_deref().unwrap_or("-")
                } else {
                    ""
                },
                pass.label(),
                optional_bytes(figures.bytes_read),
                optional_bytes(figures.bytes_new),
                optional_bytes(figures.bytes_written),
                if first { verified.as_str() } else { "" },
            );
        }
    }
    match &report.downtime {
        Some(downtime) => {
            let _ = writeln!(
                out,
                "\ndowntime: {}s, from the quiesce at {} to the final restore verified at {}",
                downtime.seconds(),
                downtime.start,
                downtime.end
            );
        }
        None => {
            let _ = writeln!(
                out,
                "\nno cutover yet: the workloads still run on the source; run again with --quiesce for the final pass"
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::backup::{VolumeBackupStatus, VolumeResult};
    use crate::api::restore::{ClaimAction, RestoreResult, RestoreVolume, VolumeRestoreStatus};
    use crate::api::{VolumeTransferSpec, VolumeTransferStatus};

    fn time(text: &str) -> Time {
        Time(text.parse().expect("timestamp"))
    }

    fn backup(phase: VolumeBackupPhase, results: &[(&str, VolumeTransferPhase)]) -> VolumeBackup {
        let mut backup = VolumeBackup::test("move-1");
        backup.status = Some(VolumeBackupStatus {
            phase: Some(phase),
            message: Some("1 of 2 volumes failed".to_string()),
            start_time: Some(time("2026-12-01T10:00:00Z")),
            completion_time: Some(time("2026-12-01T10:01:40Z")),
            results: results
                .iter()
                .map(|(pvc, phase)| VolumeResult {
                    namespace: "shop".to_string(),
                    pvc: pvc.to_string(),
                    phase: *phase,
                    snapshot_id: None,
                    message: Some(format!("{pvc} says why")),
                    benchmark: None,
                })
                .collect(),
            ..VolumeBackupStatus::default()
        });
        backup
    }

    #[test]
    fn a_backup_goes_on_when_complete_or_failed_only_by_claims_left_to_the_cutover() {
        use VolumeTransferPhase::*;
        let none = BTreeSet::new();
        assert!(
            backup_outcome(
                &backup(VolumeBackupPhase::Completed, &[("db", Completed)]),
                &none
            )
            .is_ok()
        );
        let partial = backup(
            VolumeBackupPhase::PartiallyFailed,
            &[("db", Completed), ("ledger", Failed)],
        );
        let error = backup_outcome(&partial, &none).expect_err("ledger failed");
        assert!(
            error.contains("PartiallyFailed")
                && error.contains("shop/ledger Failed: ledger says why"),
            "{error}"
        );
        let deferred = [("shop".to_string(), "ledger".to_string())].into();
        assert!(backup_outcome(&partial, &deferred).is_ok());
        assert!(backup_outcome(&backup(VolumeBackupPhase::Failed, &[]), &deferred).is_err());
    }

    fn restore(phase: VolumeRestorePhase, name: &str) -> VolumeRestore {
        let mut restore = VolumeRestore::test(name);
        restore.status = Some(VolumeRestoreStatus {
            phase: Some(phase),
            start_time: Some(time("2026-12-01T10:02:00Z")),
            completion_time: Some(time("2026-12-01T10:05:00Z")),
            selection: vec![RestoreVolume {
                snapshot_id: "abc".to_string(),
                source: "shop/db".to_string(),
                namespace: "shop-b".to_string(),
                pvc: "db".to_string(),
                storage_class: Some("gp3".to_string()),
                access_modes: vec!["ReadWriteOnce".to_string()],
                final_access_modes: Vec::new(),
                volume_mode: None,
                request_bytes: 1 << 30,
                data_bytes: 10 << 20,
                action: ClaimAction::Create,
                labels: BTreeMap::new(),
                annotations: BTreeMap::new(),
            }],
            results: vec![RestoreResult {
                namespace: "shop-b".to_string(),
                pvc: "db".to_string(),
                snapshot_id: "abc".to_string(),
                phase: VolumeTransferPhase::Completed,
                bytes_written: Some(if name.ends_with("final") {
                    4096
                } else {
                    10 << 20
                }),
                verified_tree: Some(format!("tree-of-{name}-0123456789")),
                message: None,
            }],
            ..VolumeRestoreStatus::default()
        });
        restore
    }

    #[test]
    fn a_restore_goes_on_only_when_completed_and_says_which_volume_failed() {
        assert!(restore_outcome(&restore(VolumeRestorePhase::Completed, "move-1")).is_ok());
        let mut failed = restore(VolumeRestorePhase::Failed, "move-1");
        if let Some(status) = failed.status.as_mut() {
            status.message = Some("none of the 1 volumes was restored".to_string());
            status.results[0].phase = VolumeTransferPhase::Failed;
            status.results[0].message = Some("disk full".to_string());
        }
        let error = restore_outcome(&failed).expect_err("failed");
        assert!(
            error.contains("ended Failed") && error.contains("shop-b/db Failed: disk full"),
            "{error}"
        );
    }

    fn upload(pvc: &str, read: i64, new: i64) -> VolumeTransfer {
        let spec: VolumeTransferSpec = serde_json::from_value(serde_json::json!({
            "direction": "Upload", "pvc": pvc,
            "backupRef": {"namespace": "haulage-system", "name": "move-1"},
            "storageLocation": {"namespace": "haulage-system", "name": "s3"},
            "stagePod": "stage"}))
        .expect("spec");
        let mut transfer = VolumeTransfer::new("t", spec);
        transfer.metadata.namespace = Some("shop".to_string());
        transfer.status = Some(VolumeTransferStatus {
            bytes_read: Some(read),
            bytes_new: Some(new),
            ..VolumeTransferStatus::default()
        });
        transfer
    }

    #[test]
    fn the_report_gives_each_volume_both_passes_the_durations_and_the_downtime() {
        use VolumeTransferPhase::Completed;
        let first_backup = backup(VolumeBackupPhase::Completed, &[("db", Completed)]);
        let mut final_backup = backup(VolumeBackupPhase::Completed, &[("db", Completed)]);
        final_backup.metadata.name = Some("move-final".to_string());
        let first_transfers = [upload("db", 10 << 20, 10 << 20)];
        let final_transfers = [upload("db", 10 << 20, 4096)];
        let first_restore = restore(VolumeRestorePhase::Completed, "move-1");
        let final_restore = restore(VolumeRestorePhase::Completed, "move-final");
        let report = build_report(
            "move",
            &[
                PassObjects {
                    pass: Pass::First,
                    backup: Some(&first_backup),
                    transfers: &first_transfers,
                    restore: Some(&first_restore),
                },
                PassObjects {
                    pass: Pass::Final,
                    backup: Some(&final_backup),
                    transfers: &final_transfers,
                    restore: Some(&final_restore),
                },
            ],
            Some("2026-12-01T10:04:00Z"),
        );
        assert_eq!(report.passes.len(), 2);
        assert_eq!(report.passes[0].backup_seconds, Some(100));
        assert_eq!(report.passes[0].restore_seconds, Some(180));
        let volume = &report.volumes[0];
        assert_eq!(volume.source, "shop/db");
        assert_eq!(volume.destination.as_deref(), Some("shop-b/db"));
        assert_eq!(
            volume.passes[&Pass::Final],
            VolumeFigures {
                bytes_read: Some(10 << 20),
                bytes_new: Some(4096),
                bytes_written: Some(4096)
            }
        );
        assert_eq!(volume.passes[&Pass::First].bytes_written, Some(10 << 20));
        assert_eq!(
            volume.verified_tree.as_deref(),
            Some("tree-of-move-final-0123456789"),
            "the last pass's verification"
        );
        let downtime = report.downtime.clone().expect("a cutover");
        assert_eq!(downtime.seconds(), 60);
        let text = render_report(&report);
        assert!(text.contains("downtime: 60s"), "{text}");
        assert!(text.contains("final pass"), "{text}");
        assert!(text.contains("4.0 KiB"), "{text}");
        assert!(text.contains("tree-of-move-fin"), "{text}");

        let first_only = build_report(
            "move",
            &[PassObjects {
                pass: Pass::First,
                backup: Some(&first_backup),
                transfers: &first_transfers,
                restore: None,
            }],
            None,
        );
        assert_eq!(first_only.downtime, None);
        assert!(render_report(&first_only).contains("no cutover yet"));
        assert_eq!(first_only.volumes[0].verified_tree, None);
    }

    #[test]
    fn progress_shows_bytes_files_rate_and_eta() {
        let progress = Progress {
            total_bytes: 4 << 20,
            bytes_done: 1 << 20,
            total_files: 10,
            files_done: 3,
            bytes_per_second: 512 << 10,
            eta_seconds: Some(6),
            percent: 25,
            ..Progress::default()
        };
        assert_eq!(
            progress_text("InProgress", Some(&progress)),
            "InProgress  25%  1.0 MiB / 4.0 MiB  3/10 files  512.0 KiB/s  ETA 6s"
        );
        assert_eq!(progress_text("Planning", None), "Planning");
    }
}
