//! `haulage restore SNAPSHOT DIR --repo URL`.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use tokio_util::sync::CancellationToken;

use super::progress::{ProgressDisplay, human_bytes};
use super::{Outcome, RepoArgs};
use crate::engine::progress::Progress;
use crate::engine::restore::{RestoreOptions, RestoreOutcome, restore};
use crate::engine::throttle::{ByteRate, Throttle};

/// Arguments of `haulage restore`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Snapshot id, unique prefix, or `latest`.
    pub snapshot: String,
    /// Target directory: created if missing; must be empty unless --sync.
    pub target: PathBuf,
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub lock: super::LockArgs,
    /// Update an earlier copy in place: write only what differs and remove
    /// entries the snapshot does not have (for a migration's final cutover).
    #[arg(long)]
    pub sync: bool,
    /// With --sync: the snapshot the target was last restored or synced
    /// from, completely. Files both snapshots hold unchanged, whose size,
    /// permissions, owner and modification time on disk are still as that
    /// restore wrote them, are not read, so the pass costs what changed.
    /// Leave it out after anything else wrote into the target.
    #[arg(long, value_name = "SNAPSHOT", requires = "sync")]
    pub since: Option<String>,
    /// Limit writing to the target, per second (e.g. 50MiB).
    #[arg(long, value_name = "RATE")]
    pub limit_write: Option<ByteRate>,
    /// Also create device nodes found in the snapshot.
    #[arg(long)]
    pub allow_devices: bool,
    /// Do not restore owners even when running as root.
    #[arg(long)]
    pub no_owners: bool,
    /// Print one JSON summary object on standard output.
    #[arg(long)]
    pub json: bool,
    /// Do not draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

pub async fn run(args: RestoreArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    super::under_shared_lock(&repository, "restore", &args.lock, &cancel, |work| {
        run_locked(&args, &repository, work)
    })
    .await
}

async fn run_locked(
    args: &RestoreArgs,
    repository: &crate::engine::Repository,
    cancel: CancellationToken,
) -> anyhow::Result<Outcome> {
    let snapshot = repository.resolve_snapshot(&args.snapshot).await?;
    let mut options = RestoreOptions::new(&args.target);
    options.sync = args.sync;
    if let Some(since) = &args.since {
        options.since = Some(repository.resolve_snapshot(since).await?);
    }
    options.write_throttle = Throttle::new(args.limit_write);
    options.allow_devices = args.allow_devices;
    if args.no_owners {
        options.restore_owners = false;
    }
    let progress = Arc::new(Progress::default());
    let display = ProgressDisplay::start(
        progress.clone(),
        "restoring",
        !args.no_progress && !args.json,
    );
    let result = restore(repository, &snapshot, options, progress, cancel).await;
    drop(display);
    let outcome = result?;
    print_summary(&outcome, &args.target, args.json);
    Ok(Outcome::damaged_if(!outcome.problems.is_empty()))
}

/// Print what a restore did.
pub fn print_summary(outcome: &RestoreOutcome, target: &std::path::Path, as_json: bool) {
    if as_json {
        println!("{}", serde_json::to_string(outcome).expect("serializes"));
        return;
    }
    let rate = outcome.bytes_written as f64 / outcome.duration_seconds.max(1e-6);
    println!(
        "restored snapshot {} into {}",
        &outcome.snapshot_id[..8],
        target.display()
    );
    println!(
        "  files:    {} ({} already identical), {} directories, {} other, {} removed",
        outcome.files,
        outcome.files_unchanged,
        outcome.directories,
        outcome.other_entries,
        outcome.entries_removed
    );
    if let Some(since) = &outcome.since {
        println!(
            "  since:    {}: {} files as it left them, not read",
            &since[..8.min(since.len())],
            outcome.files_not_read
        );
    }
    if let Some(reason) = &outcome.since_not_used {
        println!("  since:    {reason}");
    }
    println!(
        "  written:  {} in {:.1} s ({}/s)",
        human_bytes(outcome.bytes_written),
        outcome.duration_seconds,
        human_bytes(rate as u64)
    );
    if !outcome.problems.is_empty() {
        println!(
            "{} entries were not restored correctly:",
            outcome.problems.len()
        );
        for problem in &outcome.problems {
            println!("  {}: {}", problem.path, problem.message);
        }
    }
}
