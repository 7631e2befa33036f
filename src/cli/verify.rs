//! `haulage verify --repo URL [SNAPSHOT]`.

use std::sync::Arc;

use clap::Args;

use super::progress::human_bytes;
use super::{Outcome, RepoArgs};
use crate::engine::progress::Progress;
use crate::engine::verify::verify;

/// Arguments of `haulage verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Snapshot to verify (id, prefix or `latest`); default: all.
    pub snapshot: Option<String>,
    #[command(flatten)]
    pub repo: RepoArgs,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: VerifyArgs) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    let snapshot = match &args.snapshot {
        Some(text) => Some(repository.resolve_snapshot(text).await?),
        None => None,
    };
    let report = verify(&repository, snapshot, Arc::new(Progress::default())).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("serializes"));
    } else {
        println!(
            "checked {} snapshots, {} trees, {} data blobs in {} packs ({} read)",
            report.snapshots,
            report.trees,
            report.data_blobs,
            report.packs,
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
    Ok(if report.problems.is_empty() {
        Outcome::Success
    } else {
        Outcome::DamagedData
    })
}
