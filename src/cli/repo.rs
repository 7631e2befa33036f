//! `haulage repo`: create repositories.

use clap::Subcommand;

use super::{Outcome, RepoArgs};
use crate::engine::Repository;

/// Repository management verbs.
#[derive(Debug, Subcommand)]
pub enum RepoCommand {
    /// Create a new, empty repository (refuses if one exists).
    Init {
        #[command(flatten)]
        repo: RepoArgs,
    },
    /// Probe a storage location with a real write, read, list and delete of
    /// a small object, and report each step's latency.
    CheckLocation {
        #[command(flatten)]
        repo: RepoArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Abort incomplete multipart uploads (and remove stale temporary
    /// files) older than a threshold, left by writers that died.
    Sweep {
        #[command(flatten)]
        repo: RepoArgs,
        /// Only uploads older than this are removed (e.g. 24h, 90m).
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        older_than: std::time::Duration,
    },
}

pub async fn run(command: RepoCommand) -> anyhow::Result<Outcome> {
    match command {
        RepoCommand::Init { repo } => {
            let repository = Repository::init(repo.store().await?).await?;
            println!(
                "created repository {} at {}",
                repository.config().repository_id,
                repository.store().location()
            );
            Ok(Outcome::Success)
        }
        RepoCommand::CheckLocation { repo, json } => {
            let store = repo.store().await?;
            let report = crate::store::probe::check_location(store.as_ref()).await;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("probing {}", report.location);
                for step in &report.steps {
                    println!("  {}", serde_json::to_string(step)?);
                }
                println!(
                    "{}",
                    if report.is_ok() {
                        "location works"
                    } else {
                        "location does NOT work"
                    }
                );
            }
            Ok(if report.is_ok() {
                Outcome::Success
            } else {
                Outcome::Failed
            })
        }
        RepoCommand::Sweep { repo, older_than } => {
            let store = repo.store().await?;
            let report = store.sweep_incomplete_uploads(older_than).await?;
            println!(
                "{} incomplete uploads found, {} removed, {} younger than {} kept",
                report.found,
                report.removed.len(),
                report.kept_recent,
                humantime::format_duration(older_than)
            );
            for key in &report.removed {
                println!("  removed {key}");
            }
            Ok(Outcome::Success)
        }
    }
}
