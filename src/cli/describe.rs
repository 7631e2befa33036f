//! `haulage describe backup NAME [--watch]`: the plan (stage pods per node
//! with their volumes, unplaceable volumes with reasons) and per-volume
//! progress bars, read from the VolumeBackup's and its VolumeTransfers'
//! status only. Rendering is a pure function of those objects.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use bytesize::ByteSize;
use clap::{Args, Subcommand};
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::labels::{OWNER_UID_LABEL, SYSTEM_NAMESPACE};
use crate::api::{Progress, VolumeBackup, VolumeTransfer};
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
}

/// `haulage describe backup` arguments.
#[derive(Debug, Args)]
pub struct DescribeBackupArgs {
    /// Name of the VolumeBackup.
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

/// Render a backup and its transfers as text.
pub fn render_backup(backup: &VolumeBackup, transfers: &[VolumeTransfer]) -> String {
    let status = backup.status.clone().unwrap_or_default();
    let mut out = String::new();
    let phase = status
        .phase
        .map_or_else(|| "New".to_string(), |phase| format!("{phase:?}"));
    let _ = writeln!(
        out,
        "Name:      {} ({})",
        backup.name_any(),
        backup.namespace().unwrap_or_default()
    );
    let _ = writeln!(
        out,
        "Phase:     {phase}   Location: {}",
        backup
            .spec
            .storage_location
            .as_deref()
            .unwrap_or("(default)")
    );
    if let Some(message) = &status.message {
        let _ = writeln!(out, "Message:   {message}");
    }
    if let Some(progress) = &status.progress {
        let _ = writeln!(out, "Progress:  {}", progress_line(progress));
    }
    if let Some(volumes) = &status.volumes {
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
    if let Some(plan) = &status.plan {
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
                pod.namespace,
                pod.node,
                pod.pod_name.as_deref().unwrap_or("-"),
                pod.volumes.join(",")
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

/// Run `haulage describe`.
pub async fn run(command: DescribeCommand, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let DescribeCommand::Backup(arguments) = command;
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API (no kubeconfig or in-cluster config)")?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), &arguments.namespace);
    let transfers: Api<VolumeTransfer> = Api::all(client);
    loop {
        let backup = backups.get(&arguments.name).await.with_context(|| {
            format!(
                "cannot read VolumeBackup {}/{}",
                arguments.namespace, arguments.name
            )
        })?;
        let owned = match backup.uid() {
            Some(uid) => {
                transfers
                    .list(&ListParams::default().labels(&format!("{OWNER_UID_LABEL}={uid}")))
                    .await
                    .context("cannot list its VolumeTransfers")?
                    .items
            }
            None => Vec::new(),
        };
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
                    namespace: "shop".to_string(),
                    node: "node-a".to_string(),
                    pod_name: Some("haulage-backup-nightly-node-a-0123456789".to_string()),
                    volumes: vec!["db".to_string()],
                    bytes: 100,
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
}
