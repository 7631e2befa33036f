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
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::backup::BackupPlan;
use crate::api::labels::{OWNER_UID_LABEL, SYSTEM_NAMESPACE};
use crate::api::{Progress, VolumeBackup, VolumeRestore, VolumeTransfer};
use crate::cli::Outcome;

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
fn write_header(
    out: &mut String,
    object: &impl ResourceExt,
    phase: Option<String>,
    location: Option<&str>,
    message: Option<&str>,
    progress: Option<&Progress>,
    volumes: Option<&crate::api::backup::VolumeCounts>,
) {
    let phase = phase.unwrap_or_else(|| "New".to_string());
    let _ = writeln!(
        out,
        "Name:      {} ({})",
        object.name_any(),
        object.namespace().unwrap_or_default()
    );
    let _ = writeln!(
        out,
        "Phase:     {phase}   Location: {}",
        location.unwrap_or("(default)")
    );
    if let Some(message) = message {
        let _ = writeln!(out, "Message:   {message}");
    }
    if let Some(progress) = progress {
        let _ = writeln!(out, "Progress:  {}", progress_line(progress));
    }
    if let Some(volumes) = volumes {
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

/// Render a backup and its transfers as text.
pub fn render_backup(backup: &VolumeBackup, transfers: &[VolumeTransfer]) -> String {
    let status = backup.status.clone().unwrap_or_default();
    let mut out = String::new();
    write_header(
        &mut out,
        backup,
        status.phase.map(|phase| format!("{phase:?}")),
        backup.spec.storage_location.as_deref(),
        status.message.as_deref(),
        status.progress.as_ref(),
        status.volumes.as_ref(),
    );
    if let Some(plan) = &status.plan {
        render_plan(&mut out, plan);
    }
    if !status.results.is_empty() {
        let _ = writeln!(out, "\nVOLUMES");
        for result in &status.results {
            let progress = transfers
                .iter()
                .find(|transfer| {
                    transfer.namespace().as_deref() == Some(result.namespace.as_str())
                        && transfer.spec.pvc == result.pvc
                })
                .and_then(|transfer| transfer.status.clone())
                .and_then(|status| status.progress);
            let shown = progress.as_ref().map_or_else(
                || format!("{} {:>3}%", bar(0), 0),
                |progress| format!("{} {:>3}%", bar(progress.percent), progress.percent),
            );
            let snapshot = result
                .snapshot_id
                .as_deref()
                .map_or("-", |id| &id[..id.len().min(12)]);
            let _ = writeln!(
                out,
                "{:<20} {:<24} {:<11} {shown}  {snapshot:<12} {}",
                result.namespace,
                result.pvc,
                format!("{:?}", result.phase),
                result.message.as_deref().unwrap_or("")
            );
        }
    }
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
    write_header(
        &mut out,
        restore,
        status.phase.map(|phase| format!("{phase:?}")),
        restore.spec.storage_location.as_deref(),
        status.message.as_deref(),
        status.progress.as_ref(),
        status.volumes.as_ref(),
    );
    if !status.selection.is_empty() {
        let _ = writeln!(out, "\nSELECTED");
        let _ = writeln!(
            out,
            "{:<12} {:<28} {:<32} {:<16} {:<20} {:>10} ACTION",
            "SNAPSHOT", "SOURCE", "DESTINATION", "CLASS", "ACCESS", "SIZE"
        );
        for volume in &status.selection {
            let access = if volume.final_access_modes.is_empty() {
                volume.access_modes.join(",")
            } else {
                format!(
                    "{} -> {}",
                    volume.access_modes.join(","),
                    volume.final_access_modes.join(",")
                )
            };
            let _ = writeln!(
                out,
                "{:<12} {:<28} {:<32} {:<16} {:<20} {:>10} {:?}",
                &volume.snapshot_id[..volume.snapshot_id.len().min(12)],
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
    if !status.results.is_empty() {
        let _ = writeln!(out, "\nVOLUMES");
        for result in &status.results {
            let progress = transfers
                .iter()
                .find(|transfer| {
                    transfer.namespace().as_deref() == Some(result.namespace.as_str())
                        && transfer.spec.pvc == result.pvc
                })
                .and_then(|transfer| transfer.status.clone())
                .and_then(|status| status.progress);
            let shown = progress.as_ref().map_or_else(
                || format!("{} {:>3}%", bar(0), 0),
                |progress| format!("{} {:>3}%", bar(progress.percent), progress.percent),
            );
            let verified = result.verified_tree.as_deref().map_or_else(
                || "-".to_string(),
                |tree| format!("verified {}", &tree[..tree.len().min(12)]),
            );
            let _ = writeln!(
                out,
                "{:<20} {:<24} {:<11} {shown}  {verified:<21} {}",
                result.namespace,
                result.pvc,
                format!("{:?}", result.phase),
                result.message.as_deref().unwrap_or("")
            );
        }
    }
    out
}

/// Run `haulage describe`.
pub async fn run(command: DescribeCommand, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API (no kubeconfig or in-cluster config)")?;
    let arguments = match command {
        DescribeCommand::Backup(arguments) => arguments,
        DescribeCommand::Restore(arguments) => {
            return describe_restore(client, arguments, cancel).await;
        }
    };
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), &arguments.namespace);
    let transfers: Api<VolumeTransfer> = Api::all(client);
    loop {
        let backup = backups.get(&arguments.name).await.with_context(|| {
            format!(
                "cannot read VolumeBackup {}/{}",
                arguments.namespace, arguments.name
            )
        })?;
        let owned = transfers_of(&transfers, backup.uid()).await?;
        let text = render_backup(&backup, &owned);
        let finished = backup
            .status
            .as_ref()
            .and_then(|status| status.phase)
            .is_some_and(|phase| phase.is_final());
        if arguments.watch {
            // Clear the screen and draw from the top.
            print!("\x1b[2J\x1b[H{text}");
        } else {
            print!("{text}");
        }
        if !arguments.watch || finished {
            return Ok(Outcome::Success);
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(Outcome::Success),
            _ = tokio::time::sleep(Duration::from_secs(WATCH_INTERVAL_SECONDS)) => {}
        }
    }
}

/// The VolumeTransfers of the object with `uid`.
async fn transfers_of(
    transfers: &Api<VolumeTransfer>,
    uid: Option<String>,
) -> anyhow::Result<Vec<VolumeTransfer>> {
    Ok(match uid {
        Some(uid) => {
            transfers
                .list(&ListParams::default().labels(&format!("{OWNER_UID_LABEL}={uid}")))
                .await
                .context("cannot list its VolumeTransfers")?
                .items
        }
        None => Vec::new(),
    })
}

/// `haulage describe restore`.
async fn describe_restore(
    client: kube::Client,
    arguments: DescribeBackupArgs,
    cancel: CancellationToken,
) -> anyhow::Result<Outcome> {
    let restores: Api<VolumeRestore> = Api::namespaced(client.clone(), &arguments.namespace);
    let transfers: Api<VolumeTransfer> = Api::all(client);
    loop {
        let restore = restores.get(&arguments.name).await.with_context(|| {
            format!(
                "cannot read VolumeRestore {}/{}",
                arguments.namespace, arguments.name
            )
        })?;
        let owned = transfers_of(&transfers, restore.uid()).await?;
        let text = render_restore(&restore, &owned);
        let finished = restore
            .status
            .as_ref()
            .and_then(|status| status.phase)
            .is_some_and(|phase| phase.is_final());
        if arguments.watch {
            print!("\x1b[2J\x1b[H{text}");
        } else {
            print!("{text}");
        }
        if !arguments.watch || finished {
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
