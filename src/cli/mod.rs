//! The `haulage` command line: clap-derived verbs, each in its own module,
//! parsed once into typed arguments and run to an exit code.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod plan;

/// Move the data of Kubernetes PersistentVolumeClaims between clusters.
#[derive(Debug, Parser)]
#[command(name = "haulage", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The verbs of `haulage`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan stage pods for a backup from a `kubectl get -o yaml` dump, without touching a cluster.
    Plan(plan::PlanArgs),
}

/// Entry point of the `haulage` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan(arguments) => plan::run(&arguments),
    }
}
