//! haulage's mover agent: runs in a stage pod and moves the data of its
//! volumes between their mounts and the backup storage location.
//!
//! - `mover-agent transfers`: the stage-pod mode. Identity from the
//!   downward API (`POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`), work from the
//!   VolumeTransfers the controller named in `HAULAGE_TRANSFERS`, progress
//!   and results into their status ([`transfers`]).
//! - `mover-agent volume`: one volume from the command line, progress in
//!   the log (for trying the agent by hand).
//!
//! Both run the same engine as the `haulage` CLI and on SIGTERM stop
//! cleanly: everything already stored is reused by the next run.

mod memory;
mod metrics;
mod patience;
mod report;
mod transfers;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use haulage::engine::backup::{BackupOptions, DEFAULT_CHECKPOINT_EVERY, backup};
use haulage::engine::progress::Progress;
use haulage::engine::restore::{RestoreOptions, restore};
use haulage::engine::throttle::{ByteRate, Throttle};
use haulage::engine::{KeySource, Repository};
use haulage::store::{S3Credentials, StoreOptions, open_store};
use tokio_util::sync::CancellationToken;

/// Exit status of a transfers run stopped by something a restart may get
/// past (SIGTERM, an unreachable API server): `EX_TEMPFAIL`. A permanent
/// failure (a refusal the pod's RBAC or the transfer must fix) exits 1.
/// The kubelet restarts the agent after either (`restartPolicy:
/// OnFailure`); the code tells a person reading the pod which it was.
const EXIT_TRANSIENT: u8 = 75;
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

/// Move volume data between stage-pod mounts and a repository.
#[derive(Debug, Parser)]
#[command(name = "mover-agent", version)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

/// How the agent gets its work.
#[derive(Debug, Subcommand)]
enum Mode {
    /// Work on the VolumeTransfers assigned to this stage pod.
    Transfers(Box<TransfersArguments>),
    /// Move one volume named on the command line.
    Volume(Arguments),
}

/// The stage-pod mode's arguments (the controller sets them).
#[derive(Debug, Args)]
struct TransfersArguments {
    /// Repository URL (s3://bucket/prefix or file:///path).
    #[arg(long, env = "HAULAGE_REPO")]
    repo: String,
    /// AWS-style credentials file (the mounted credentials copy).
    #[arg(long, env = "HAULAGE_CREDENTIALS_FILE")]
    credentials_file: Option<PathBuf>,
    /// S3 endpoint URL.
    #[arg(long)]
    endpoint: Option<String>,
    /// S3 region.
    #[arg(long)]
    region: Option<String>,
    /// Path-style S3 addressing.
    #[arg(long)]
    path_style: bool,
    /// PEM certificates to trust for the endpoint besides the system roots
    /// (the BSL's `caBundle`, mounted with the credentials copy).
    #[arg(long, env = "HAULAGE_CA_BUNDLE")]
    ca_bundle: Option<PathBuf>,
    /// The repository's password, first line of this file (an encrypted
    /// BSL's, mounted with the credentials copy); plaintext repositories
    /// only when absent.
    #[arg(long, env = "HAULAGE_PASSWORD_FILE")]
    password_file: Option<PathBuf>,
    /// Upload cap of this agent, bytes per second (the BSL's).
    #[arg(long)]
    upload_bytes_per_second: Option<std::num::NonZeroU64>,
    /// Requests to the store at once (the BSL's cap).
    #[arg(long)]
    max_concurrent_requests: Option<usize>,
    /// Fail a volume once the storage location has not answered for this
    /// many seconds (the backup's or restore's
    /// `failAfterUnavailableSeconds`); until then, and without it, an
    /// outage longer than the retry budget pauses the volumes, which
    /// resume by themselves when the location answers.
    #[arg(long)]
    fail_after_unavailable_seconds: Option<u64>,
    /// This pod's name (downward API).
    #[arg(long, env = "POD_NAME")]
    pod_name: String,
    /// This pod's namespace (downward API).
    #[arg(long, env = "POD_NAMESPACE")]
    pod_namespace: String,
    /// This pod's node (downward API), for logs.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// The VolumeTransfers of this pod, comma-separated.
    #[arg(
        long,
        env = "HAULAGE_TRANSFERS",
        value_delimiter = ',',
        required = true
    )]
    transfers: Vec<String>,
    /// Where the claims are mounted, each at `<root>/<pvc>`.
    #[arg(long, env = "HAULAGE_DATA_ROOT", default_value = "/data")]
    data_root: PathBuf,
    /// Memory the agent's volumes share, bytes or a quantity (`128Mi`): how
    /// many move at once and how much each engine holds. The stage pod
    /// gives its memory request; without one, the container's memory limit
    /// (its cgroup's), else 128Mi.
    #[arg(long, env = "HAULAGE_MEMORY_BUDGET", value_parser = memory::parse_budget)]
    memory_budget: Option<u64>,
    /// Bytes of the repository's index files, whose loaded index the
    /// volumes share and which takes its part of the budget. The stage pod
    /// gives what its location's last probe listed (so that the agent and
    /// the controller's admission count on the same volumes at once);
    /// without it the agent lists the index files itself.
    #[arg(long, env = "HAULAGE_INDEX_BYTES")]
    index_bytes: Option<u64>,
    /// Volumes moved at once instead of as many as the memory budget holds
    /// (each then gets an equal part of it). The controller does not set
    /// it: its admission counts on what the budget holds.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    parallel_volumes: Option<u32>,
    /// Least seconds between two progress writes of a transfer.
    #[arg(long, default_value_t = DEFAULT_PROGRESS_INTERVAL_SECONDS)]
    progress_interval: u64,
    /// Seconds between two checkpoints of a backup, so that the agent of a
    /// recreated stage pod does not read again the files a volume had
    /// stored; 0 writes none (the controller's `--checkpoint-seconds`).
    #[arg(long, default_value_t = DEFAULT_CHECKPOINT_EVERY.as_secs())]
    checkpoint_seconds: u64,
    /// Address of `/metrics` and `/healthz` (port 0: any free port, logged),
    /// or `off`.
    #[arg(
        long,
        env = "HAULAGE_METRICS_ADDRESS",
        default_value_t = metrics::MetricsAddress::At(std::net::SocketAddr::from(
            ([0, 0, 0, 0], metrics::DEFAULT_METRICS_PORT)
        ))
    )]
    metrics_address: metrics::MetricsAddress,
}

/// Move one volume's data.
#[derive(Debug, Args)]
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
    haulage::allocator::keep_freed_memory_small();
    // As the Go runtime does: restores hold a batch's directories open.
    haulage::engine::descriptors::raise_open_file_limit();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HAULAGE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: a pod's log (kubectl
        // logs, a log collector) or a file gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
    let result = match cli.mode {
        Mode::Transfers(arguments) => runtime.block_on(run_transfers(*arguments)),
        Mode::Volume(arguments) => runtime.block_on(run(arguments)),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            tracing::error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A token cancelled by SIGTERM.
fn cancel_on_sigterm() -> anyhow::Result<CancellationToken> {
    let cancel = CancellationToken::new();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    let token = cancel.clone();
    tokio::spawn(async move {
        terminate.recv().await;
        tracing::warn!("SIGTERM: stopping; stored data is kept and reused on restart");
        token.cancel();
    });
    Ok(cancel)
}

/// Serve `/metrics` at `address` until `cancel`. A port that cannot be
/// bound is logged and the agent goes on: moving the data matters more than
/// watching it.
async fn serve_metrics(
    address: metrics::MetricsAddress,
    agent_metrics: Arc<metrics::AgentMetrics>,
    cancel: CancellationToken,
) {
    let metrics::MetricsAddress::At(address) = address else {
        return;
    };
    let listener = match tokio::net::TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(error) => {
            tracing::warn!(%address, %error, "metrics endpoint not served");
            return;
        }
    };
    match listener.local_addr() {
        Ok(bound) => tracing::info!("metrics endpoint listening on {bound}"),
        Err(error) => tracing::warn!(%error, "metrics endpoint address unknown"),
    }
    tokio::spawn(haulage::metrics::serve(
        listener,
        move |path: &str| agent_metrics.respond(path),
        cancel,
    ));
}

async fn run_transfers(arguments: TransfersArguments) -> anyhow::Result<ExitCode> {
    let cancel = cancel_on_sigterm()?;
    let upload_wait = haulage::store::limits::WaitTime::default();
    let storage = haulage::store::outage::OutageWait::new(
        haulage::store::outage::Outage::default(),
        arguments
            .fail_after_unavailable_seconds
            .map(Duration::from_secs),
    )
    // On SIGTERM nothing waits for the location any more: the pod has a
    // grace period, and what is stored is kept either way.
    .stopping_with(cancel.clone());
    let agent_metrics = Arc::new(metrics::AgentMetrics::new(
        upload_wait.clone(),
        storage.outage.clone(),
    ));
    // Stops with the process, not with SIGTERM: a last scrape during the
    // shutdown still sees the final counters.
    serve_metrics(
        arguments.metrics_address,
        agent_metrics.clone(),
        CancellationToken::new(),
    )
    .await;
    let mut options = StoreOptions {
        upload_wait: Some(upload_wait),
        outages: Some(storage.clone()),
        ..StoreOptions::default()
    };
    options.s3.endpoint = arguments.endpoint.clone();
    options.s3.region = arguments.region.clone();
    options.s3.path_style = arguments.path_style.then_some(true);
    options.s3.ca_bundle = arguments.ca_bundle.clone();
    options.upload_bytes_per_second = arguments.upload_bytes_per_second;
    options.max_concurrent_requests = arguments.max_concurrent_requests;
    if let Some(path) = &arguments.credentials_file {
        options.s3.credentials = Some(S3Credentials::from_credentials_file(path, None)?);
    }
    let store = open_store(&arguments.repo, &options).await?;
    let key = match &arguments.password_file {
        Some(path) => KeySource::Password(Arc::new(
            haulage::cli::password::read_password_file(path).map_err(anyhow::Error::msg)?,
        )),
        None => KeySource::PlaintextOnly,
    };
    let repository = Arc::new(Repository::open(store, &key).await?);
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API")?;
    let budget = arguments
        .memory_budget
        .or_else(memory::cgroup_memory_limit)
        .unwrap_or(memory::DEFAULT_BUDGET_BYTES);
    let index_file_bytes = match arguments.index_bytes {
        Some(bytes) => bytes,
        None => repository
            .index_file_bytes()
            .await
            .context("cannot list the repository's index files to plan the memory")?,
    };
    let plan = memory::VolumePlan::new(
        haulage::api::transfer::AgentMemory {
            budget_bytes: budget,
            index_file_bytes,
        },
        arguments.parallel_volumes.map(|volumes| volumes as usize),
        arguments.transfers.len(),
    );
    tracing::info!(
        memory_budget = budget,
        index_file_bytes,
        volumes_at_once = plan.at_once,
        memory_per_volume = plan.memory.bytes(),
        "volumes planned within the memory budget"
    );
    let assignment = transfers::Assignment {
        identity: arguments.pod_name,
        namespace: arguments.pod_namespace,
        node: arguments.node_name,
        transfers: arguments.transfers,
        data_root: arguments.data_root,
        parallelism: plan.at_once,
        memory: plan.memory,
        progress_interval: Duration::from_secs(arguments.progress_interval.max(1)),
        checkpoint_every: (arguments.checkpoint_seconds > 0)
            .then(|| Duration::from_secs(arguments.checkpoint_seconds)),
        storage,
    };
    match transfers::run(assignment, repository, client, agent_metrics, cancel).await {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(error) => {
            tracing::error!(
                transient = error.is_transient(),
                "{}",
                haulage::error_chain(&error)
            );
            Ok(if error.is_transient() {
                ExitCode::from(EXIT_TRANSIENT)
            } else {
                ExitCode::FAILURE
            })
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
    let repository = Repository::open(store, &KeySource::PlaintextOnly).await?;
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
