//! `haulage verify --repo URL [SNAPSHOT]`.

use std::sync::Arc;

use clap::Args;

use super::progress::human_bytes;
use super::{Outcome, RepoArgs};
use crate::engine::progress::Progress;
use crate::engine::verify::{DataSubset, verify_subset};

/// Arguments of `haulage verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Snapshot to verify (id, prefix or `latest`); default: all.
    pub snapshot: Option<String>,
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub lock: super::LockArgs,
    /// Read the data of only a subset of the packs (every tree is still
    /// checked): a random `5%`, or bucket `N/M` of the packs by id (run
    /// 1/M … M/M to cover all).
    #[arg(long, value_name = "SUBSET")]
    pub read_data_subset: Option<DataSubset>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: VerifyArgs) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    let lock = super::take_lock(
        &repository,
        crate::repo::lock::LockKind::Shared,
        "verify",
        &args.lock,
    )
    .await?;
    let result = run_locked(&args, &repository).await;
    lock.release().await?;
    result
}

async fn run_locked(
    args: &VerifyArgs,
    repository: &crate::engine::Repository,
) -> anyhow::Result<Outcome> {
    let snapshot = match &args.snapshot {
        Some(text) => Some(repository.resolve_snapshot(text).await?),
        None => None,
    };
    let subset = args.read_data_subset.unwrap_or(DataSubset::All);
    let report = verify_subset(repository, snapshot, subset, Arc::new(Progress::default())).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("serializes"));
    } else {
        println!(
            "checked {} snapshots, {} trees, {} data blobs in {} of {} packs ({} read)",
            report.snapshots,
            report.trees,
            report.data_blobs,
            report.packs,
            report.packs_total,
            human_bytes(report.bytes_read)
        );
        if report.problems.is_empty() {
            println!("no problems found");
        } else {
            println!("{} problems found:", report.problems.len());
            for problem in &report.problems {
                println!("  {}: {}", problem.object, problem.message);
                for file in &problem.affected_files {
                    println!("      affects {file}");
                }
            }
        }
    }
    Ok(Outcome::damaged_if(!report.problems.is_empty()))
}
