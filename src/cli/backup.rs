//! `haulage backup DIR --repo URL`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::progress::{ProgressDisplay, human_bytes};
use super::{Outcome, RepoArgs};
use crate::engine::backup::{
    BackupOptions, BackupOutcome, DEFAULT_CHECKPOINT_EVERY, DEFAULT_COMPRESSION_LEVEL,
    ParentPolicy, backup,
};
use crate::engine::progress::Progress;
use crate::engine::throttle::{ByteRate, Throttle};

/// Arguments of `haulage backup`.
#[derive(Debug, Args)]
pub struct BackupArgs {
    /// Directory to back up.
    pub source: PathBuf,
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub lock: super::LockArgs,
    /// Snapshot to back up incrementally against (id, prefix or `latest`).
    /// Default: the newest snapshot of the same source from this host.
    #[arg(long, value_name = "SNAPSHOT", conflicts_with = "no_parent")]
    pub parent: Option<String>,
    /// Read every file, even when unchanged since the parent snapshot.
    #[arg(long)]
    pub no_parent: bool,
    /// Limit reading from the source, per second (e.g. 50MiB).
    #[arg(long, value_name = "RATE")]
    pub limit_read: Option<ByteRate>,
    /// Tag the snapshot (repeatable).
    #[arg(long = "tag", value_name = "KEY=VALUE", value_parser = parse_tag)]
    pub tags: Vec<(String, String)>,
    /// zstd compression level: 1 is the fastest standard level; higher levels
    /// trade CPU for space, and zstd's fast levels -1 to -7 space for CPU.
    #[arg(long, default_value_t = DEFAULT_COMPRESSION_LEVEL, value_parser = clap::value_parser!(i32).range(-7..=19))]
    pub compression_level: i32,
    /// Write a checkpoint of what is stored this often (seconds), so that
    /// the next backup of the same source from this host, after this one
    /// was interrupted (Ctrl-C, a kill, a crash), does not read again the
    /// files it had stored; 0 writes none.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_CHECKPOINT_EVERY.as_secs())]
    pub checkpoint_seconds: u64,
    /// Name recorded as the snapshot's source (default: the absolute path).
    #[arg(long, value_name = "NAME")]
    pub label: Option<String>,
    /// Print one JSON summary object on standard output.
    #[arg(long)]
    pub json: bool,
    /// Do not draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

fn parse_tag(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("tag {text:?} must look like KEY=VALUE")),
    }
}

/// Back up. Ctrl-C or SIGTERM (`stop`) stops the backup keeping what it
/// read: the chunks read are stored and a first backup writes a last
/// checkpoint, so the next run goes on from there; a second signal exits
/// at once.
pub async fn run(args: BackupArgs, stop: CancellationToken) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    // The engine stops at once only when the lock is lost.
    super::under_shared_lock(
        &repository,
        "backup",
        &args.lock,
        &CancellationToken::new(),
        |lost| run_locked(&args, &repository, lost, stop),
    )
    .await
}

async fn run_locked(
    args: &BackupArgs,
    repository: &crate::engine::Repository,
    cancel: CancellationToken,
    stop: CancellationToken,
) -> anyhow::Result<Outcome> {
    let parent = match (&args.parent, args.no_parent) {
        (_, true) => ParentPolicy::None,
        (Some(text), false) => ParentPolicy::Snapshot(repository.resolve_snapshot(text).await?),
        (None, false) => ParentPolicy::LatestForSource,
    };
    let mut options = BackupOptions::new(&args.source);
    options.parent = parent;
    options.source_label = args.label.clone();
    options.tags = args.tags.iter().cloned().collect::<BTreeMap<_, _>>();
    options.compression_level = args.compression_level;
    options.read_throttle = Throttle::new(args.limit_read);
    options.checkpoint_every =
        (args.checkpoint_seconds > 0).then(|| Duration::from_secs(args.checkpoint_seconds));
    options.stop = stop;
    let shown = !args.no_progress && !args.json;
    // The bar draws only at a terminal (indicatif hides it elsewhere).
    options.scan_for_totals = shown && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let progress = Arc::new(Progress::default());
    let display = ProgressDisplay::start(progress.clone(), "backing up", shown);
    let result = backup(repository, options, progress, cancel).await;
    drop(display);
    let outcome = result?;
    print_summary(&outcome, args.json);
    Ok(if outcome.snapshot.summary.warning_count > 0 {
        Outcome::CompletedWithWarnings
    } else {
        Outcome::Success
    })
}

/// Print what a backup did, for humans or as JSON.
pub fn print_summary(outcome: &BackupOutcome, as_json: bool) {
    let summary = &outcome.snapshot.summary;
    if as_json {
        let value = json!({
            "snapshotId": outcome.snapshot_id.to_hex(),
            "parent": outcome.snapshot.parent.map(|id| id.to_hex()),
            "resumedFrom": outcome.resumed_from.as_ref().map(|resumed| json!({
                "checkpoint": resumed.checkpoint.to_hex(),
                "started": resumed.started,
                "files": resumed.files,
                "bytes": resumed.bytes,
            })),
            "files": summary.files,
            "filesUnchanged": summary.files_unchanged,
            "directories": summary.directories,
            "totalBytes": summary.total_bytes,
            "bytesRead": summary.bytes_read,
            "bytesNew": summary.bytes_new,
            "bytesStored": summary.bytes_stored,
            "packsWritten": summary.packs_written,
            "durationSeconds": summary.duration_seconds,
            "warningCount": summary.warning_count,
            "warnings": summary.warnings,
            "status": if summary.warning_count > 0 { "completed with warnings" } else { "completed" },
        });
        println!("{value}");
        return;
    }
    let rate = summary.bytes_read as f64 / summary.duration_seconds.max(1e-6);
    println!("snapshot {} saved", outcome.snapshot_id.short());
    println!("  id:       {}", outcome.snapshot_id);
    if let Some(parent) = outcome.snapshot.parent {
        println!("  parent:   {}", parent.short());
    }
    if let Some(resumed) = &outcome.resumed_from {
        println!(
            "  resumed:  the interrupted backup started {} (checkpoint {}): {} files, {} stored then, read again only if changed since",
            resumed.started,
            resumed.checkpoint.short(),
            resumed.files,
            human_bytes(resumed.bytes)
        );
    }
    println!(
        "  files:    {} ({} unchanged), {} directories, {} other",
        summary.files, summary.files_unchanged, summary.directories, summary.other_entries
    );
    println!(
        "  data:     {} in snapshot, {} read, {} new after dedup, {} stored after compression",
        human_bytes(summary.total_bytes),
        human_bytes(summary.bytes_read),
        human_bytes(summary.bytes_new),
        human_bytes(summary.bytes_stored)
    );
    println!(
        "  took:     {:.1} s ({}/s read)",
        summary.duration_seconds,
        human_bytes(rate as u64)
    );
    if summary.warning_count > 0 {
        println!("completed with {} warnings:", summary.warning_count);
        for warning in &summary.warnings {
            println!("  {}: {}", warning.path, warning.message);
        }
        if summary.warning_count as usize > summary.warnings.len() {
            println!(
                "  … and {} more",
                summary.warning_count as usize - summary.warnings.len()
            );
        }
    }
}
