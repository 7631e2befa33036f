//! `haulage restore SNAPSHOT DIR --repo URL`.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use tokio_util::sync::CancellationToken;

use super::progress::{ProgressDisplay, human_bytes};
use super::{Outcome, RepoArgs};
use crate::engine::progress::Progress;
use crate::engine::restore::{LoadedSnapshot, RestoreOptions, RestoreOutcome, restore_loaded};
use crate::engine::throttle::{ByteRate, Throttle};
use crate::engine::verify_tree::{TreeVerification, TreeVerifyOptions, verify_tree_loaded};

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
    /// After the restore, re-read what it wrote and compare it with the
    /// snapshot entry by entry (names, types, modes, owners, times, links,
    /// extended attributes, and every file's content re-hashed chunk by
    /// chunk): the check the in-cluster agent ends every restore with.
    /// Differences are listed and exit with status 4. After `--since`,
    /// files the sync did not read are compared by metadata only.
    #[arg(long)]
    pub verify: bool,
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
    let verify_options = TreeVerifyOptions::for_restore(&options);
    // Loaded once for the restore and its verification, as the agent does.
    let restored = async {
        let mut loaded = LoadedSnapshot::load(repository, &snapshot).await?;
        if args.verify {
            loaded = loaded.keeping_trees_for_verification(options.memory);
        }
        let outcome =
            restore_loaded(repository, &loaded, options, progress, cancel.clone()).await?;
        Ok::<_, crate::engine::EngineError>((loaded, outcome))
    }
    .await;
    drop(display);
    let (loaded, outcome) = restored?;
    let verification = if args.verify {
        if !args.json && !args.no_progress {
            eprintln!("verifying the written tree against the snapshot");
        }
        let verify_options = verify_options.after(&outcome);
        Some(verify_tree_loaded(repository, &loaded, &args.target, &verify_options, cancel).await?)
    } else {
        None
    };
    print_summary(&outcome, verification.as_ref(), &args.target, args.json);
    let mismatched = verification
        .as_ref()
        .is_some_and(|verification| verification.verified_tree().is_none());
    Ok(Outcome::damaged_if(
        !outcome.problems.is_empty() || mismatched,
    ))
}

/// What `haulage restore --json` prints: the restore's outcome, and its
/// verification when one ran.
#[derive(serde::Serialize)]
struct Summary<'a> {
    #[serde(flatten)]
    outcome: &'a RestoreOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    verification: Option<&'a TreeVerification>,
}

/// Print what a restore did.
pub fn print_summary(
    outcome: &RestoreOutcome,
    verification: Option<&TreeVerification>,
    target: &std::path::Path,
    as_json: bool,
) {
    if as_json {
        let summary = Summary {
            outcome,
            verification,
        };
        println!("{}", serde_json::to_string(&summary).expect("serializes"));
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
    if let Some(verification) = verification {
        print_verification(verification);
    }
}

/// Print what the verification of a restore found.
fn print_verification(verification: &TreeVerification) {
    match verification.verified_tree() {
        Some(root_tree) => println!(
            "  verified: root tree {} ({} entries; {} of {} files re-read, {}) in {:.1} s",
            &root_tree[..16.min(root_tree.len())],
            verification.entries,
            verification.files,
            verification.files + verification.files_not_read,
            human_bytes(verification.bytes_verified),
            verification.duration_seconds
        ),
        None => {
            println!(
                "the target differs from the snapshot in {}{} entries:",
                verification.mismatches.len(),
                if verification.stopped_at_limit {
                    " or more"
                } else {
                    ""
                }
            );
            for mismatch in &verification.mismatches {
                println!("  {mismatch}");
            }
        }
    }
    if verification.not_restorable > 0 {
        println!(
            "  {} entries a restore does not create (sockets, device nodes) are absent, as expected",
            verification.not_restorable
        );
    }
}
