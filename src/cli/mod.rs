//! The `haulage` command line: clap-derived verbs, each in its own module,
//! parsed once into typed arguments and run to an exit code.
//!
//! Exit codes (also in `docs/cli.md`):
//! 0 success; 1 failed (nothing or not everything was done, see the
//! message); 2 invalid usage; 3 completed with warnings (some files could
//! not be read and are listed); 4 damaged data found (verify, or a restore
//! that could not restore some files); 5 `haulage status`: no storage
//! location is Available; 130 cancelled (Ctrl-C / SIGTERM).

mod backup;
mod bench;
mod cluster;
mod controller;
mod crds;
mod demo;
mod describe;
mod plan;
mod progress;
mod repo;
mod restore;
mod snapshots;
mod status;
mod verify;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::engine::{EngineError, Repository};
use crate::store::{StoreOptions, open_store};

/// Move the data of Kubernetes PersistentVolumeClaims between clusters, or
/// any directory into a deduplicated, compressed repository and back.
#[derive(Debug, Parser)]
#[command(name = "haulage", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The verbs of `haulage`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Back up, restore and verify a generated sample tree through a local
    /// repository: the whole data path in one command, no cluster needed.
    Demo(demo::DemoArgs),
    /// Manage repositories.
    #[command(subcommand)]
    Repo(repo::RepoCommand),
    /// Back up a directory into a repository.
    Backup(backup::BackupArgs),
    /// Restore a snapshot into a directory.
    Restore(restore::RestoreArgs),
    /// List the snapshots in a repository.
    Snapshots(snapshots::SnapshotsArgs),
    /// Re-read and check everything a snapshot references.
    Verify(verify::VerifyArgs),
    /// Measure what a migration will take: source reads, the CPU stages,
    /// upload, download and latency against the location, and an estimate.
    Bench(bench::BenchArgs),
    /// Plan stage pods for a backup from a `kubectl get -o yaml` dump, without touching a cluster.
    Plan(plan::PlanArgs),
    /// Show a cluster object's plan and progress, from its status.
    #[command(subcommand)]
    Describe(describe::DescribeCommand),
    /// Show the controller, its storage locations, backups and caps, from
    /// status only (never probes).
    Status(status::StatusArgs),
    /// Run the controller: reconcile VolumeBackups and BackupStorageLocations.
    Controller(crate::controller::ControllerArgs),
    /// Write the reproducible sample tree the demo and benchmarks use.
    #[command(hide = true)]
    SampleData(demo::SampleDataArgs),
    /// Write the CRDs generated from the API types (into manifests/crds).
    #[command(hide = true)]
    Crds(crds::CrdsArgs),
}

/// The repository a verb works on.
#[derive(Debug, Clone, Args)]
pub struct RepoArgs {
    /// Repository URL: s3://bucket/prefix, file:///path or a plain directory path.
    #[arg(long = "repo", env = "HAULAGE_REPO", value_name = "URL")]
    pub url: String,
    /// AWS-style credentials file for s3:// locations (default: the
    /// standard AWS_* variables and credentials chain).
    #[arg(long, value_name = "FILE", env = "HAULAGE_CREDENTIALS_FILE")]
    pub credentials_file: Option<std::path::PathBuf>,
    /// Profile to read from the credentials file.
    #[arg(long, value_name = "NAME", requires = "credentials_file")]
    pub profile: Option<String>,
    /// s3:// only: objects of at least this size go up as multipart uploads
    /// (default 64MiB, so a pack is one PUT).
    #[arg(long, value_name = "BYTES", env = "HAULAGE_S3_MULTIPART_THRESHOLD")]
    pub multipart_threshold: Option<bytesize::ByteSize>,
}

impl RepoArgs {
    async fn open(&self) -> Result<Repository, EngineError> {
        Repository::open(self.store().await?).await
    }

    /// The store behind the URL; S3 settings come from the standard
    /// `AWS_*` variables and credentials chain.
    async fn store(&self) -> Result<crate::store::DynStore, EngineError> {
        let refuse = |error: crate::store::OpenStoreError| EngineError::Target {
            path: self.url.clone().into(),
            reason: error.to_string(),
        };
        let mut options = StoreOptions::default();
        options.s3.multipart_threshold_bytes = self.multipart_threshold.map(|size| size.as_u64());
        if let Some(path) = &self.credentials_file {
            options.s3.credentials = Some(
                crate::store::S3Credentials::from_credentials_file(path, self.profile.as_deref())
                    .map_err(refuse)?,
            );
        }
        open_store(&self.url, &options).await.map_err(refuse)
    }
}

/// How a verb ended, as the process exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Everything done.
    Success,
    /// Done, but some files were skipped or changed while read.
    CompletedWithWarnings,
    /// Damaged data was found.
    DamagedData,
    /// The verb ran but what it checked does not work (a location probe).
    Failed,
    /// `haulage status`: no BackupStorageLocation is Available.
    NoLocationAvailable,
}

impl Outcome {
    fn exit_code(self) -> ExitCode {
        match self {
            Outcome::Success => ExitCode::SUCCESS,
            Outcome::CompletedWithWarnings => ExitCode::from(3),
            Outcome::DamagedData => ExitCode::from(4),
            Outcome::Failed => ExitCode::FAILURE,
            Outcome::NoLocationAvailable => ExitCode::from(5),
        }
    }
}

/// Entry point of the `haulage` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HAULAGE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(crate::engine::MAX_BLOCKING_THREADS)
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let cancel = CancellationToken::new();
        spawn_signal_handler(cancel.clone());
        let result = match cli.command {
            Command::Demo(args) => demo::run(args, cancel.clone()).await,
            Command::Repo(command) => repo::run(command).await,
            Command::Backup(args) => backup::run(args, cancel.clone()).await,
            Command::Restore(args) => restore::run(args, cancel.clone()).await,
            Command::Snapshots(args) => snapshots::run(args).await,
            Command::Verify(args) => verify::run(args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Describe(command) => describe::run(command, cancel.clone()).await,
            Command::Status(args) => status::run(args).await,
            Command::Controller(args) => controller::run(args, cancel.clone()).await,
            Command::SampleData(args) => demo::run_sample_data(args).await,
            Command::Plan(arguments) => return plan::run(&arguments).await,
            Command::Crds(arguments) => crds::run(&arguments),
        };
        match result {
            Ok(outcome) => outcome.exit_code(),
            Err(error) => {
                if cancel.is_cancelled() {
                    eprintln!("cancelled; everything already stored stays in the repository and is reused by the next run");
                    return ExitCode::from(130);
                }
                eprintln!("error: {error:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Ctrl-C or SIGTERM cancels the running verb; a second signal exits at once.
fn spawn_signal_handler(cancel: CancellationToken) {
    tokio::spawn(async move {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => return,
            };
        for _ in 0..2 {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
            if cancel.is_cancelled() {
                std::process::exit(130);
            }
            cancel.cancel();
        }
    });
}
