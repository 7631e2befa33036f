//! `haulage bench`: size a migration before running it, like kopia's
//! benchmark commands. `--source DIR --repo URL` measures here;
//! `--claim NS/NAME` measures in the cluster, in the stage pod that would
//! back the claim up (a VolumeBackup with `spec.benchmark`, followed to its
//! end, its figures printed, then deleted). The measurement itself is
//! [`crate::bench`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use clap::builder::TypedValueParser;

use tokio_util::sync::CancellationToken;

use super::cluster::ClusterArgs;
use super::progress::human_bytes;
use super::{Outcome, RepoArgs};
use crate::api::labels::SYSTEM_NAMESPACE;

mod claims;
use crate::bench::{
    BENCH_PREFIX, BenchReport, BenchSettings, DEFAULT_OBJECTS, DEFAULT_PARALLEL_READERS,
    DEFAULT_SIZE_BYTES, DOWNLOADS_IN_FLIGHT, UPLOADS_IN_FLIGHT,
};
use crate::engine::backup::DEFAULT_COMPRESSION_LEVEL;
use crate::engine::throttle::ByteRate;

/// Arguments of `haulage bench`.
#[derive(Debug, Args)]
#[command(mut_arg("url", |arg| arg.required(false).required_unless_present("claims")))]
pub struct BenchArgs {
    /// Directory whose data will be migrated (read only).
    #[arg(long, value_name = "DIR", required_unless_present = "claims")]
    pub source: Option<PathBuf>,
    #[command(flatten)]
    pub repo: Option<RepoArgs>,
    /// Measure this claim in the cluster instead, in the stage pod that
    /// would back it up, against a BackupStorageLocation (repeatable).
    #[arg(
        long = "claim",
        value_name = "NAMESPACE/NAME",
        value_parser = parse_claim,
        conflicts_with_all = ["source", "estimate_bytes", "limit_read", "limit_upload",
            "compression_level", "readers", "objects", "max_phase_time"]
    )]
    pub claims: Vec<(String, String)>,
    /// With --claim: the BackupStorageLocation to measure against
    /// (default: the one marked default).
    #[arg(long, value_name = "NAME")]
    pub location: Option<String>,
    /// With --claim: namespace of the controller and its locations.
    #[arg(long, value_name = "NAMESPACE", default_value = SYSTEM_NAMESPACE)]
    pub controller_namespace: String,
    /// With --claim: keep the VolumeBackups the benchmark created (they go
    /// an hour after they finished) instead of deleting them at the end.
    #[arg(long)]
    pub keep: bool,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Bytes of the source read for the read tests (a sample of at most
    /// 64 MiB of it, 16 MiB in a stage pod, feeds the CPU stages), and
    /// backed up by the two sample backups together (half each), e.g.
    /// 256MiB; at most 512MiB with --claim.
    #[arg(long, value_name = "BYTES", default_value_t = bytesize::ByteSize::b(DEFAULT_SIZE_BYTES))]
    pub size: bytesize::ByteSize,
    /// Bytes to estimate the backup time for (default: the source's size).
    #[arg(long, value_name = "BYTES")]
    pub estimate_bytes: Option<bytesize::ByteSize>,
    /// The read cap the backup will run with (e.g. 50MiB, per second): the
    /// estimate applies it, and the measurement's own reads average no
    /// more (each phase reads at full speed, then it rests).
    #[arg(long, value_name = "RATE")]
    pub limit_read: Option<ByteRate>,
    /// The location's upload cap (e.g. 20MiB, per second); applied to the
    /// upload test too.
    #[arg(long, value_name = "RATE")]
    pub limit_upload: Option<ByteRate>,
    /// zstd level the backup will use.
    #[arg(long, default_value_t = DEFAULT_COMPRESSION_LEVEL, value_parser = clap::value_parser!(i32).range(-7..=19))]
    pub compression_level: i32,
    /// Readers in the parallel read test.
    #[arg(long, default_value_t = DEFAULT_PARALLEL_READERS, value_parser = clap::value_parser!(u16).range(1..=64).map(usize::from))]
    pub readers: usize,
    /// Test objects uploaded and downloaded (each one pack in size).
    #[arg(long, default_value_t = DEFAULT_OBJECTS, value_parser = clap::value_parser!(u16).range(1..=256).map(usize::from))]
    pub objects: usize,
    /// Longest time each storage phase may take; it stops early after that.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub max_phase_time: Duration,
    /// Print one JSON object on standard output instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `NAMESPACE/NAME` of a claim.
fn parse_claim(text: &str) -> Result<(String, String), String> {
    match text.split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace.to_string(), name.to_string()))
        }
        _ => Err(format!(
            "{text:?} is not NAMESPACE/NAME of a PersistentVolumeClaim"
        )),
    }
}

impl BenchArgs {
    /// The measurement's settings from the options.
    fn settings(&self, source: &std::path::Path) -> BenchSettings {
        BenchSettings {
            size: self.size.as_u64(),
            estimate_bytes: self.estimate_bytes.map(|bytes| bytes.as_u64()),
            limit_read: self.limit_read,
            limit_upload: self.limit_upload,
            compression_level: self.compression_level,
            readers: self.readers,
            objects: self.objects,
            max_phase_time: self.max_phase_time,
            ..BenchSettings::new(source)
        }
    }
}

pub async fn run(args: BenchArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    if !args.claims.is_empty() {
        return claims::run(&args, cancel).await;
    }
    let cluster_only = [
        ("--location", args.location.is_some()),
        ("--keep", args.keep),
        (
            "--controller-namespace",
            args.controller_namespace != SYSTEM_NAMESPACE,
        ),
        ("--kubeconfig", args.cluster.kubeconfig.is_some()),
        ("--context", args.cluster.context.is_some()),
    ];
    if let Some((flag, _)) = cluster_only.iter().find(|(_, given)| *given) {
        anyhow::bail!(
            "{flag} is for a benchmark in the cluster: give it with --claim NAMESPACE/NAME (a benchmark here takes --source DIR and --repo URL)"
        );
    }
    let (Some(source), Some(repo)) = (&args.source, &args.repo) else {
        anyhow::bail!(
            "haulage bench needs --source DIR and --repo URL (a measurement here), or --claim NAMESPACE/NAME (one in the cluster)"
        );
    };
    let store = repo.store().await?;
    let mut settings = args.settings(source);
    settings.cancel = cancel;
    let report = crate::bench::measure(&settings, store).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, &args);
    }
    Ok(if report.storage.objects_left == 0 {
        Outcome::Success
    } else {
        Outcome::Failed
    })
}

fn per_second(rate: f64) -> String {
    format!("{}/s", human_bytes(rate.max(0.0) as u64))
}

/// An estimated duration, whole seconds up; "forever" when nothing moves.
fn about(seconds: f64) -> String {
    if seconds.is_finite() && seconds < u64::MAX as f64 {
        humantime::format_duration(Duration::from_secs(seconds.max(0.0).ceil() as u64)).to_string()
    } else {
        "forever".to_string()
    }
}

fn print_table(report: &BenchReport, args: &BenchArgs) {
    let cpu = &report.cpu;
    let storage = &report.storage;
    println!(
        "source   {}: {} in {} files",
        report.source.path,
        human_bytes(report.source.bytes),
        report.source.files
    );
    println!("location {}", storage.location);
    println!();
    println!("{:<34} {:>14}  notes", "stage", "rate");
    let row = |name: &str, rate: f64, notes: String| {
        println!("{name:<34} {:>14}  {notes}", per_second(rate));
    };
    row(
        "read, 1 reader",
        report.read_single.bytes_per_second,
        format!("{} read", human_bytes(report.read_single.bytes)),
    );
    row(
        &format!("read, {} readers", report.readers),
        report.read_parallel.bytes_per_second,
        format!(
            "{} read, other files",
            human_bytes(report.read_parallel.bytes)
        ),
    );
    row(
        "chunking (FastCDC)",
        cpu.chunking.bytes_per_second,
        format!("1 core, {} sample", human_bytes(cpu.chunking.bytes)),
    );
    row(
        "hashing (keyed BLAKE3)",
        cpu.hashing.bytes_per_second,
        "1 core".into(),
    );
    row(
        &format!("compression (zstd level {})", cpu.compression_level),
        cpu.compression.bytes_per_second,
        format!("1 core, stored/source {:.2}", cpu.compression_ratio),
    );
    let samples = &report.samples;
    for (name, sample) in [
        ("backup sample, small files", &samples.small_files),
        ("backup sample, large files", &samples.large_files),
    ] {
        if let Some(sample) = sample {
            row(
                name,
                sample.rate.bytes_per_second,
                format!(
                    "{} in {} files, {:.1} of {} cores busy, stored/source {:.2}",
                    human_bytes(sample.rate.bytes),
                    sample.files,
                    sample.cores_busy,
                    samples.cores,
                    sample.stored_ratio
                ),
            );
        }
    }
    row(
        "upload",
        storage.upload.bytes_per_second,
        format!(
            "{} × {}, {UPLOADS_IN_FLIGHT} at a time",
            storage.objects,
            human_bytes(storage.object_bytes)
        ),
    );
    row(
        "download",
        storage.download.bytes_per_second,
        format!("{DOWNLOADS_IN_FLIGHT} at a time"),
    );
    println!();
    println!(
        "{:<34} {:>10} {:>10}",
        "request latency", "p50 ms", "p99 ms"
    );
    for (name, latency) in [
        ("put 4 KiB", &storage.put_latency),
        ("get 4 KiB", &storage.get_latency),
        ("head", &storage.head_latency),
    ] {
        println!(
            "{name:<34} {:>10.1} {:>10.1}",
            latency.p50_milliseconds, latency.p99_milliseconds
        );
    }
    println!();
    let estimate = &report.estimate;
    let caps = match (args.limit_read, args.limit_upload) {
        (None, None) => "no caps".to_string(),
        (read, upload) => [
            read.map(|ByteRate(rate)| format!("read cap {}", per_second(rate as f64))),
            upload.map(|ByteRate(rate)| format!("upload cap {}", per_second(rate as f64))),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(", "),
    };
    println!(
        "estimate: a first backup of {} takes about {} at {} ({caps}), limited by {}",
        human_bytes(estimate.bytes),
        about(estimate.seconds),
        per_second(estimate.bytes_per_second),
        estimate.bottleneck
    );
    if storage.objects_left > 0 {
        println!(
            "warning: {} bench objects could not be deleted under {BENCH_PREFIX} of {}",
            storage.objects_left, storage.location
        );
    }
}
