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
mod forget;
pub mod migrate;
pub mod password;
mod plan;
mod progress;
mod prune;
mod repo;
mod restore;
mod snapshots;
mod status;
mod text;
mod transfer_owner;
mod verify;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::engine::{EngineError, KeySource, Repository};
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
    /// Forget snapshots by a retention policy (or by id); `prune` then
    /// reclaims their space.
    Forget(forget::ForgetArgs),
    /// Reclaim the space of data no snapshot references, safely beside
    /// running backups (two-phase deletion with a safety margin).
    Prune(prune::PruneArgs),
    /// Measure what a migration will take: source reads, the CPU stages,
    /// upload, download and latency against the location, and an estimate;
    /// here (--source DIR --repo URL) or in the cluster, in the stage pod
    /// that would back a claim up (--claim NAMESPACE/NAME).
    Bench(bench::BenchArgs),
    /// Plan stage pods for a backup from a `kubectl get -o yaml` dump, without touching a cluster.
    Plan(plan::PlanArgs),
    /// Move namespaces' claims to another cluster: a backup on the source,
    /// a restore on the destination, and with `--quiesce` a short cutover.
    Migrate(migrate::MigrateArgs),
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
    /// Read the repository password from the first line of this file
    /// (else HAULAGE_PASSWORD, else a prompt; only encrypted repositories
    /// ask).
    #[arg(long, value_name = "FILE", env = "HAULAGE_PASSWORD_FILE")]
    pub password_file: Option<std::path::PathBuf>,
}

impl RepoArgs {
    async fn open(&self) -> Result<Repository, EngineError> {
        Repository::open(self.store().await?, &self.key_source()).await
    }

    /// The password of an encrypted repository, from the CLI's sources.
    fn key_source(&self) -> KeySource {
        KeySource::Password(std::sync::Arc::new(password::CliPassword {
            file: self.password_file.clone(),
            location: self.url.clone(),
        }))
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

/// How a verb waits for the repository's locks.
#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    /// Wait this long for a conflicting lock (prune's deletion phase, or
    /// for prune: running backups) before giving up.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = humantime::parse_duration)]
    pub retry_lock: std::time::Duration,
}

/// Take a lock, reporting the stale locks it ignored.
async fn take_lock(
    repository: &Repository,
    kind: crate::repo::lock::LockKind,
    purpose: &str,
    args: &LockArgs,
) -> Result<crate::engine::lock::RepositoryLock, EngineError> {
    let lock =
        crate::engine::lock::RepositoryLock::acquire(repository, kind, purpose, args.retry_lock)
            .await?;
    for stale in &lock.stale {
        eprintln!(
            "warning: ignoring a stale lock {} ({}: {}); `haulage repo unlock` removes it",
            stale.key, stale.state, stale.description
        );
    }
    Ok(lock)
}

/// Run `work` under a shared lock on `repository` taken for `purpose`:
/// `work` gets a token cancelled by `cancel` or when the lock is lost. The
/// lock is released afterwards; a lost lock is the error then.
async fn under_shared_lock<T, Work>(
    repository: &Repository,
    purpose: &str,
    args: &LockArgs,
    cancel: &CancellationToken,
    work: impl FnOnce(CancellationToken) -> Work,
) -> anyhow::Result<T>
where
    Work: std::future::Future<Output = anyhow::Result<T>>,
{
    let lock = take_lock(
        repository,
        crate::repo::lock::LockKind::Shared,
        purpose,
        args,
    )
    .await?;
    let result = work(lock.cancel_on_loss(cancel)).await;
    let lost = lock.check();
    lock.release().await?;
    lost?;
    result
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
    /// [`Outcome::DamagedData`] when `damaged`, else success.
    fn damaged_if(damaged: bool) -> Outcome {
        if damaged {
            Outcome::DamagedData
        } else {
            Outcome::Success
        }
    }

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
        // Colours only for a person at a terminal: a pod's log (kubectl
        // logs, a log collector) or a file gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
            Command::Forget(args) => forget::run(args).await,
            Command::Prune(args) => prune::run(args, cancel.clone()).await,
            Command::Bench(args) => bench::run(args, cancel.clone()).await,
            Command::Describe(command) => describe::run(command, cancel.clone()).await,
            Command::Migrate(args) => migrate::run(args, cancel.clone()).await,
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
                // Each cause once: most messages already quote their source.
                let mut text = error.to_string();
                for cause in error.chain().skip(1) {
                    let cause = cause.to_string();
                    if !text.contains(&cause) {
                        text.push_str(": ");
                        text.push_str(&cause);
                    }
                }
                eprintln!("error: {text}");
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
