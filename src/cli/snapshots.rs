//! `haulage snapshots --repo URL`.

use clap::Args;
use serde_json::json;

use super::progress::human_bytes;
use super::{Outcome, RepoArgs};

/// Arguments of `haulage snapshots`.
#[derive(Debug, Args)]
pub struct SnapshotsArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    /// Print a JSON array.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: SnapshotsArgs) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    let (snapshots, damaged) = repository.list_snapshots().await?;
    if args.json {
        let list: Vec<_> = snapshots
            .iter()
            .map(|(id, snapshot)| {
                json!({
                    "id": id.to_hex(),
                    "time": snapshot.time,
                    "hostname": snapshot.hostname,
                    "source": snapshot.source,
                    "parent": snapshot.parent.map(|id| id.to_hex()),
                    "tags": snapshot.tags,
                    "files": snapshot.summary.files,
                    "totalBytes": snapshot.summary.total_bytes,
                    "warningCount": snapshot.summary.warning_count,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(list));
    } else {
        println!(
            "{:<10} {:<21} {:<16} {:>8} {:>11}  SOURCE",
            "ID", "TIME", "HOST", "FILES", "SIZE"
        );
        for (id, snapshot) in &snapshots {
            println!(
                "{:<10} {:<21} {:<16} {:>8} {:>11}  {}",
                id.short(),
                snapshot.time,
                snapshot.hostname.chars().take(16).collect::<String>(),
                snapshot.summary.files,
                human_bytes(snapshot.summary.total_bytes),
                snapshot.source
            );
        }
        println!("{} snapshots", snapshots.len());
    }
    for error in &damaged {
        eprintln!("warning: {error}");
    }
    Ok(if damaged.is_empty() {
        Outcome::Success
    } else {
        Outcome::DamagedData
    })
}
