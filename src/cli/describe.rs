//! `haulage describe backup NAME [--watch]` and `haulage describe restore
//! NAME [--watch]`: the plan (stage pods per node with their volumes,
//! unplaceable volumes with reasons), for a restore the snapshots selected
//! and the claims they go to, and per-volume progress bars, read from the
//! object's and its VolumeTransfers' status only. Rendering is a pure
//! function of those objects.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use bytesize::ByteSize;
use clap::{Args, Subcommand};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::backup::BackupPlan;
use crate::api::labels::SYSTEM_NAMESPACE;
use crate::api::{Progress, VolumeBackup, VolumeRestore, VolumeTransfer};
use crate::cli::Outcome;
use crate::cli::text::{access_modes, short_id};
use crate::cli::transfer_owner::{TransferOwner, VolumeOutcome, owned_transfers};

/// Seconds between redraws with `--watch`.
const WATCH_INTERVAL_SECONDS: u64 = 2;
/// Width of a progress bar, in characters.
const BAR_WIDTH: usize = 20;

/// What to describe.
#[derive(Debug, Subcommand)]
pub enum DescribeCommand {
    /// A VolumeBackup: plan, totals and per-volume progress.
    Backup(DescribeBackupArgs),
    /// A VolumeRestore: the snapshots selected, the claims they go to,
    /// plan, totals, per-volume progress and verification.
    Restore(DescribeBackupArgs),
}

/// `haulage describe backup|restore` arguments.
#[derive(Debug, Args)]
pub struct DescribeBackupArgs {
    /// Name of the VolumeBackup or VolumeRestore.
    pub name: String,
    /// Its namespace.
    #[arg(long, short = 'n', default_value = SYSTEM_NAMESPACE)]
    pub namespace: String,
    /// Redraw every two seconds until the backup is finished.
    #[arg(long, short = 'w')]
    pub watch: bool,
}

/// A bar of `percent` (0–100).
fn bar(percent: i32) -> String {
    let filled = (percent.clamp(0, 100) as usize * BAR_WIDTH) / 100;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(BAR_WIDTH - filled))
}

fn bytes(value: i64) -> String {
    ByteSize::b(u64::try_from(value).unwrap_or(0)).to_string()
}

fn progress_line(progress: &Progress) -> String {
    let eta = progress
        .eta_seconds
        .map_or_else(|| "-".to_string(), |seconds| format!("{seconds}s"));
    format!(
        "{} {:>3}%  {} / {}  {}/s  ETA {eta}",
        bar(progress.percent),
        progress.percent,
        bytes(progress.bytes_done),
        bytes(progress.total_bytes),
        bytes(progress.bytes_per_second),
    )
}

/// The lines a backup and a restore begin with: name, phase and location,
/// message, progress and volume counts.
fn write_header(out: &mut String, object: &impl TransferOwner) {
    let _ = writeln!(
        out,
        "Name:      {} ({})",
        object.name_any(),
        object.namespace().unwrap_or_default()
    );
    let _ = writeln!(
        out,
        "Phase:     {}   Location: {}",
        object.shown_phase(),
        object.storage_location().unwrap_or("(default)")
    );
    if let Some(message) = object.message() {
        let _ = writeln!(out, "Message:   {message}");
    }
    if let Some(progress) = object.progress() {
        let _ = writeln!(out, "Progress:  {}", progress_line(progress));
    }
    if let Some(volumes) = object.volumes() {
        let _ = writeln!(
            out,
            "Volumes:   {} total: {} completed, {} running, {} pending, {} failed, {} canceled",
            volumes.total,
            volumes.completed,
            volumes.in_progress,
            volumes.pending,
            volumes.failed,
            volumes.canceled
        );
    }
}

/// The VOLUMES table (nothing without results): per volume its claim,
/// its phase, the bar of its VolumeTransfer's progress (empty before it
/// reports), its `detail` (padded to its column) and its message.
fn write_volumes<R: VolumeOutcome>(
    out: &mut String,
    transfers: &[VolumeTransfer],
    results: &[R],
    detail: impl Fn(&R) -> String,
) {
    if results.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nVOLUMES");
    for result in results {
        let (namespace, pvc, phase, message) = result.outcome();
        let percent = transfers
            .iter()
            .find(|transfer| {
                transfer.namespace().as_deref() == Some(namespace) && transfer.spec.pvc == pvc
            })
            .and_then(|transfer| transfer.status.as_ref())
            .and_then(|status| status.progress.as_ref())
            .map_or(0, |progress| progress.percent);
        let _ = writeln!(
            out,
            "{namespace:<20} {pvc:<24} {:<11} {} {percent:>3}%  {} {}",
            format!("{phase:?}"),
            bar(percent),
            detail(result),
            message.unwrap_or("")
        );
    }
}

/// Render a backup and its transfers as text.
pub fn render_backup(backup: &VolumeBackup, transfers: &[VolumeTransfer]) -> String {
    let status = backup.status.clone().unwrap_or_default();
    let mut out = String::new();
    write_header(&mut out, backup);
    if let Some(plan) = &status.plan {
        render_plan(&mut out, plan);
    }
    write_volumes(&mut out, transfers, &status.results, |result| {
        format!(
            "{:<12}",
            result.snapshot_id.as_deref().map_or("-", short_id)
        )
    });
    out
}

/// The stage pods of a plan, and the volumes no stage pod can mount.
fn render_plan(out: &mut String, plan: &BackupPlan) {
    let _ = writeln!(out, "\nSTAGE PODS");
    let _ = writeln!(
        out,
        "{:<20} {:<16} {:<48} VOLUMES",
        "NAMESPACE", "NODE", "POD"
    );
    for pod in &plan.stage_pods {
        let _ = writeln!(
            out,
            "{:<20} {:<16} {:<48} {}",
            pod.stage.namespace,
            pod.stage.node,
            if pod.pod_name.is_empty() {
                "-"
            } else {
                pod.pod_name.as_str()
            },
            pod.stage.volumes.join(",")
        );
    }
    if !plan.unplaceable.is_empty() {
        let _ = writeln!(out, "\nUNPLACEABLE");
        for volume in &plan.unplaceable {
            let _ = writeln!(
                out,
                "{:<20} {:<24} {}",
                volume.namespace, volume.pvc, volume.reason
            );
        }
    }
}

/// Render a restore and its transfers as text.
pub fn render_restore(restore: &VolumeRestore, transfers: &[VolumeTransfer]) -> String {
    let status = restore.status.clone().unwrap_or_default();
    let mut out = String::new();
    write_header(&mut out, restore);
    if !status.selection.is_empty() {
        let _ = writeln!(out, "\nSELECTED");
        let _ = writeln!(
            out,
            "{:<12} {:<28} {:<32} {:<16} {:<20} {:>10} ACTION",
            "SNAPSHOT", "SOURCE", "DESTINATION", "CLASS", "ACCESS", "SIZE"
        );
        for volume in &status.selection {
            let access = access_modes(
                &volume.access_modes,
                &volume.final_access_modes,
                |first, last| format!("{first} -> {last}"),
            );
            let _ = writeln!(
                out,
                "{:<12} {:<28} {:<32} {:<16} {:<20} {:>10} {:?}",
                short_id(&volume.snapshot_id),
                volume.source,
                format!("{}/{}", volume.namespace, volume.pvc),
                volume.storage_class.as_deref().unwrap_or("(default)"),
                access,
                ByteSize::b(volume.request_bytes).to_string(),
                volume.action
            );
        }
    }
    if let Some(plan) = &status.plan {
        render_plan(&mut out, plan);
    }
    write_volumes(&mut out, transfers, &status.results, |result| {
        let verified = result.verified_tree.as_deref().map_or_else(
            || "-".to_string(),
            |tree| format!("verified {}", short_id(tree)),
        );
        format!("{verified:<21}")
    });
    out
}

/// Run `haulage describe`.
pub async fn run(command: DescribeCommand, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API (no kubeconfig or in-cluster config)")?;
    match command {
        DescribeCommand::Backup(arguments) => {
            describe(client, &arguments, &cancel, render_backup).await
        }
        DescribeCommand::Restore(arguments) => {
            describe(client, &arguments, &cancel, render_restore).await
        }
    }
}

/// Print the object `arguments` name, drawn by `render` with its
/// VolumeTransfers; with `--watch`, redraw it every
/// [`WATCH_INTERVAL_SECONDS`] until it is finished or `cancel`.
async fn describe<K: TransferOwner>(
    client: kube::Client,
    arguments: &DescribeBackupArgs,
    cancel: &CancellationToken,
    render: fn(&K, &[VolumeTransfer]) -> String,
) -> anyhow::Result<Outcome> {
    let objects: Api<K> = Api::namespaced(client.clone(), &arguments.namespace);
    let transfers: Api<VolumeTransfer> = Api::all(client);
    loop {
        let object = objects.get(&arguments.name).await.with_context(|| {
            format!(
                "cannot read {} {}/{}",
                K::kind(&()),
                arguments.namespace,
                arguments.name
            )
        })?;
        let owned = owned_transfers(&transfers, &object)
            .await
            .context("cannot list its VolumeTransfers")?;
        let text = render(&object, &owned);
        if arguments.watch {
            // Clear the screen and draw from the top.
            print!("\x1b[2J\x1b[H{text}");
        } else {
            print!("{text}");
        }
        if !arguments.watch || object.is_finished() {
            return Ok(Outcome::Success);
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(Outcome::Success),
            _ = tokio::time::sleep(Duration::from_secs(WATCH_INTERVAL_SECONDS)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::backup::{
        BackupPlan, PlannedStagePod, UnplaceableVolume, VolumeCounts, VolumeResult,
    };
    use crate::api::{VolumeBackupPhase, VolumeBackupStatus, VolumeTransferPhase};

    #[test]
    fn a_running_backup_shows_its_plan_reasons_and_per_volume_bars() {
        let mut backup: VolumeBackup = serde_yaml::from_str(
            "apiVersion: haulage.dev/v1alpha1\nkind: VolumeBackup\n\
             metadata: {name: nightly, namespace: haulage-system}\nspec: {namespaces: [shop]}\n",
        )
        .expect("valid backup");
        backup.status = Some(VolumeBackupStatus {
            phase: Some(VolumeBackupPhase::InProgress),
            plan: Some(BackupPlan {
                stage_pods: vec![PlannedStagePod {
                    pod_name: "haulage-backup-nightly-node-a-0123456789".to_string(),
                    stage: crate::plan::StagePod {
                        namespace: "shop".to_string(),
                        node: "node-a".to_string(),
                        volumes: vec!["db".to_string()],
                        bytes: 100,
                    },
                }],
                unplaceable: vec![UnplaceableVolume {
                    namespace: "shop".to_string(),
                    pvc: "cache".to_string(),
                    reason: "claim is Pending".to_string(),
                }],
            }),
            progress: Some(Progress {
                total_bytes: 100,
                bytes_done: 50,
                percent: 50,
                ..Progress::default()
            }),
            volumes: Some(VolumeCounts {
                total: 2,
                in_progress: 1,
                failed: 1,
                ..VolumeCounts::default()
            }),
            results: vec![VolumeResult {
                namespace: "shop".to_string(),
                pvc: "db".to_string(),
                phase: VolumeTransferPhase::InProgress,
                snapshot_id: None,
                message: None,
                benchmark: None,
            }],
            ..VolumeBackupStatus::default()
        });
        let text = render_backup(&backup, &[]);
        assert!(text.contains("Phase:     InProgress"), "{text}");
        assert!(text.contains("[##########..........]  50%"), "{text}");
        assert!(text.contains("node-a"), "{text}");
        assert!(text.contains("claim is Pending"), "{text}");
        assert!(text.contains("2 total: 0 completed, 1 running"), "{text}");
    }

    #[test]
    fn a_restore_shows_what_goes_where_and_which_volumes_are_verified() {
        use crate::api::restore::{ClaimAction, RestoreResult, RestoreVolume};
        let mut restore = VolumeRestore::test("move");
        restore.status = Some(crate::api::VolumeRestoreStatus {
            phase: Some(crate::api::VolumeRestorePhase::InProgress),
            selection: vec![RestoreVolume {
                snapshot_id: "ab12cd34ef56".repeat(5),
                source: "shop/db".to_string(),
                namespace: "shop-b".to_string(),
                pvc: "db".to_string(),
                storage_class: Some("gp3".to_string()),
                access_modes: vec!["ReadWriteOnce".to_string()],
                final_access_modes: vec!["ReadOnlyMany".to_string()],
                volume_mode: None,
                request_bytes: 2 << 30,
                data_bytes: 1 << 30,
                action: ClaimAction::Create,
                labels: Default::default(),
                annotations: Default::default(),
            }],
            results: vec![RestoreResult {
                namespace: "shop-b".to_string(),
                pvc: "db".to_string(),
                snapshot_id: "ab12cd34ef56".repeat(5),
                phase: VolumeTransferPhase::Completed,
                bytes_written: Some(1 << 30),
                verified_tree: Some("0f1e2d3c4b5a69788796a5b4".to_string()),
                message: None,
            }],
            ..Default::default()
        });
        let text = render_restore(&restore, &[]);
        assert!(
            text.contains("shop/db") && text.contains("shop-b/db"),
            "{text}"
        );
        assert!(text.contains("ReadWriteOnce -> ReadOnlyMany"), "{text}");
        assert!(text.contains("gp3"), "{text}");
        assert!(text.contains("verified 0f1e2d3c4b5a"), "{text}");
        assert!(text.contains("InProgress"), "{text}");
    }
}
