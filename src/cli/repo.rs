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
    }
}
