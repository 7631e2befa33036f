//! haulage's mover agent: runs in a stage pod and moves the data of one
//! volume between its mount and the backup storage location.
//!
//! Until the controller assigns work through VolumeTransfer objects, the
//! agent takes its volume from the command line; it runs the same engine as
//! the `haulage` CLI, logs progress every `--progress-interval` seconds,
//! and on SIGTERM stops cleanly (everything already stored is reused by the
//! next run).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use haulage::engine::Repository;
use haulage::engine::backup::{BackupOptions, backup};
use haulage::engine::progress::Progress;
use haulage::engine::restore::{RestoreOptions, restore};
use haulage::engine::throttle::{ByteRate, Throttle};
use haulage::store::{StoreOptions, open_store};
use tokio_util::sync::CancellationToken;

/// Default seconds between progress reports.
const DEFAULT_PROGRESS_INTERVAL_SECONDS: u64 = 2;

/// Which way the data moves.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Direction {
    /// Back the volume up into the repository.
    Upload,
    /// Restore a snapshot into the volume.
    Download,
}

/// Move one volume's data.
#[derive(Debug, Parser)]
#[command(name = "mover-agent", version)]
struct Arguments {
    /// Repository URL (s3://bucket/prefix or file:///path).
    #[arg(long, env = "HAULAGE_REPO")]
    repo: String,
    /// Where the volume is mounted in this pod.
    #[arg(long, env = "HAULAGE_VOLUME_DIR")]
    volume_dir: PathBuf,
    /// Upload (backup) or download (restore).
    #[arg(long, value_enum)]
    direction: Direction,
    /// Source name recorded in the snapshot, `namespace/pvc` (upload).
    #[arg(long, env = "HAULAGE_VOLUME_NAME")]
    volume_name: Option<String>,
    /// Snapshot to restore (download).
    #[arg(long)]
    snapshot: Option<String>,
    /// Bytes per second granted to this volume (read on upload, write on download).
    #[arg(long)]
    limit: Option<ByteRate>,
    /// Seconds between progress reports.
    #[arg(long, default_value_t = DEFAULT_PROGRESS_INTERVAL_SECONDS)]
    progress_interval: u64,
}

fn main() -> ExitCode {
    let arguments = Arguments::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HAULAGE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(haulage::engine::MAX_BLOCKING_THREADS)
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(arguments)) {
        Ok(code) => code,
        Err(error) => {
            tracing::error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(arguments: Arguments) -> anyhow::Result<ExitCode> {
    let cancel = CancellationToken::new();
    {
        let cancel = cancel.clone();
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .context("cannot listen for SIGTERM")?;
        tokio::spawn(async move {
            terminate.recv().await;
            tracing::warn!("SIGTERM: stopping; stored data is kept and reused on restart");
            cancel.cancel();
        });
    }
    let store = open_store(&arguments.repo, &StoreOptions::default()).await?;
    let repository = Repository::open(store).await?;
    let progress = Arc::new(Progress::default());
    let reporter = {
        let progress = progress.clone();
        let interval = Duration::from_secs(arguments.progress_interval.max(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let now = progress.snapshot();
                tracing::info!(
                    bytes_done = now.bytes_done,
                    total_bytes = now.total_bytes,
                    files_done = now.files_done,
                    bytes_stored = now.bytes_stored,
                    "progress"
                );
            }
        })
    };
    let throttle = Throttle::new(arguments.limit);
    let result = match arguments.direction {
        Direction::Upload => {
            let mut options = BackupOptions::new(&arguments.volume_dir);
            options.source_label = arguments.volume_name.clone();
            options.read_throttle = throttle;
            backup(&repository, options, progress, cancel)
                .await
                .map(|outcome| {
                    let summary = &outcome.snapshot.summary;
                    tracing::info!(
                        snapshot = %outcome.snapshot_id,
                        bytes_read = summary.bytes_read,
                        bytes_new = summary.bytes_new,
                        bytes_stored = summary.bytes_stored,
                        warnings = summary.warning_count,
                        "backup completed"
                    );
                    if summary.warning_count > 0 {
                        ExitCode::from(3)
                    } else {
                        ExitCode::SUCCESS
                    }
                })
        }
        Direction::Download => {
            let text = arguments
                .snapshot
                .as_deref()
                .context("--snapshot is required with --direction download")?;
            let snapshot = repository.resolve_snapshot(text).await?;
            let mut options = RestoreOptions::new(&arguments.volume_dir);
            options.sync = true;
            options.write_throttle = throttle;
            restore(&repository, &snapshot, options, progress, cancel)
                .await
                .map(|outcome| {
                    tracing::info!(
                        files = outcome.files,
                        bytes_written = outcome.bytes_written,
                        problems = outcome.problems.len(),
                        "restore completed"
                    );
                    for problem in &outcome.problems {
                        tracing::warn!(path = %problem.path, "{}", problem.message);
                    }
                    if outcome.problems.is_empty() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(4)
                    }
                })
        }
    };
    reporter.abort();
    Ok(result?)
}
