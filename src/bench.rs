//! The measurement that sizes a migration before it runs, like kopia's
//! benchmark commands: `haulage bench --source DIR --repo URL` runs it on
//! this machine, and a VolumeBackup's `spec.benchmark` in the stage pod
//! that would read the claim (`haulage bench --claim NS/NAME`).
//!
//! It measures each stage the backup pipeline runs through, on this
//! machine, this source and this location: reading the source (one reader,
//! then several, on disjoint files so the page cache does not flatter the
//! second), the CPU stages on a sample of the source's own data (FastCDC,
//! keyed BLAKE3, zstd at the configured level), a sample backup by the
//! engine itself of each kind of file it treats alike (small files, several
//! to a job; larger files, chunked as streams) into a throwaway repository,
//! and upload, download and request latency against the location, with
//! objects written under a `bench/` prefix and deleted afterwards.
//!
//! The estimate for N bytes is the slowest of the parallel read, the backup
//! pipeline (each kind of file at its sample backup's pace) and the upload,
//! after the caps (`--limit-read`, `--limit-upload`) and the samples'
//! stored/source ratio. The stage figures alone had estimated 1 s for a
//! first backup of 200,000 small files that took 6 s: per-file work is
//! most of such a backup, and only a backup shows it (docs/benchmarks.md,
//! "`haulage bench` against the backup it estimates"). Every phase is
//! bounded in bytes, objects and time, so a bench against a slow location
//! still ends.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;

use crate::api::benchmark::ClaimBenchmark;
use crate::engine::backup::DEFAULT_COMPRESSION_LEVEL;
use crate::engine::memory::EngineMemory;
use crate::engine::progress::Progress;
use crate::engine::throttle::ByteRate;
use crate::repo::chunker::Chunker;
use crate::repo::config::RepoConfig;
use crate::store::{DynStore, PutMode};
use tokio_util::sync::CancellationToken;

/// Seed of the order files are read in (fixed, so runs are comparable).
const SAMPLE_ORDER_SEED: u64 = 0x0068_6175_6c61_6765;
/// Default bytes of the source read for the read tests.
pub const DEFAULT_SIZE_BYTES: u64 = 256 * 1024 * 1024;
/// At most this much of what was read is kept as the CPU stages' sample
/// by default.
pub const MAX_SAMPLE_BYTES: usize = 64 * 1024 * 1024;
/// Longest time each phase of the bench may take by default.
pub const DEFAULT_MAX_PHASE_TIME: Duration = Duration::from_secs(30);
/// Readers in the parallel read test.
pub const DEFAULT_PARALLEL_READERS: usize = 4;
/// Size of each upload/download test object: one pack.
const DEFAULT_OBJECT_BYTES: u64 = crate::repo::config::DEFAULT_PACK_TARGET_BYTES as u64;
/// Most test objects uploaded.
pub const DEFAULT_OBJECTS: usize = 8;
/// Uploads in flight at once, as a backup sends packs.
pub const UPLOADS_IN_FLIGHT: usize = 2;
/// Downloads in flight at once, as a restore's file jobs read.
pub const DOWNLOADS_IN_FLIGHT: usize = 4;
/// Small requests per kind for the latency figures.
const LATENCY_REQUESTS: usize = 20;
/// Size of the latency test's objects.
const LATENCY_OBJECT_BYTES: usize = 4 * 1024;
/// Prefix under the location for everything the bench writes.
pub const BENCH_PREFIX: &str = "bench/";
/// The estimate's limit the sample backups give.
const PIPELINE_LIMIT: &str = "backup pipeline";
/// Bytes per read(2) in the read tests, as the backup reads.
const READ_BLOCK_BYTES: usize = 256 * 1024;

/// What to measure and with which bounds: `haulage bench`'s options, or
/// a benchmark's in a stage pod.
#[derive(Debug, Clone)]
pub struct BenchSettings {
    /// Directory whose data will be migrated (read only).
    pub source: PathBuf,
    /// Bytes of the source read for the read tests, and backed up by the
    /// two sample backups together (half each).
    pub size: u64,
    /// Bytes the estimate is for (the source's when `None`).
    pub estimate_bytes: Option<u64>,
    /// The read cap: the estimate applies it, and the measurement keeps
    /// its own reads under it on average (each phase reads at full speed,
    /// its figure the source's, then the measurement rests until its
    /// reads so far average the cap), so a benchmark of a claim on shared
    /// storage loads it no more than the transfer's grant allows.
    pub limit_read: Option<ByteRate>,
    /// The upload cap, applied to the upload test and the estimate.
    pub limit_upload: Option<ByteRate>,
    /// zstd level of the CPU stages and the sample backups.
    pub compression_level: i32,
    /// Readers in the parallel read test.
    pub readers: usize,
    /// Most test objects uploaded.
    pub objects: usize,
    /// Longest time each phase may take.
    pub max_phase_time: Duration,
    /// Most bytes of what was read kept in memory for the CPU stages.
    pub cpu_sample_bytes: usize,
    /// What each sample backup's engine may hold.
    pub memory: EngineMemory,
    /// Stops the measurement between requests; what it wrote to the
    /// location is still deleted.
    pub cancel: CancellationToken,
    /// Where the measurement counts its reads: the total it plans (the
    /// read tests' and the sample backups') and, after each phase, what
    /// it has read (the agent reports it as the transfer's progress).
    pub progress: Option<Arc<Progress>>,
}

impl BenchSettings {
    /// The defaults for a source directory.
    pub fn new(source: impl Into<PathBuf>) -> Self {
        BenchSettings {
            source: source.into(),
            size: DEFAULT_SIZE_BYTES,
            estimate_bytes: None,
            limit_read: None,
            limit_upload: None,
            compression_level: DEFAULT_COMPRESSION_LEVEL,
            readers: DEFAULT_PARALLEL_READERS,
            objects: DEFAULT_OBJECTS,
            max_phase_time: DEFAULT_MAX_PHASE_TIME,
            cpu_sample_bytes: MAX_SAMPLE_BYTES,
            memory: EngineMemory::default(),
            cancel: CancellationToken::new(),
            progress: None,
        }
    }
}

/// A throughput figure.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rate {
    /// Bytes processed.
    pub bytes: u64,
    /// Seconds taken.
    pub seconds: f64,
    /// Bytes per second.
    pub bytes_per_second: f64,
}

impl Rate {
    fn new(bytes: u64, elapsed: Duration) -> Self {
        let seconds = elapsed.as_secs_f64().max(1e-9);
        Rate {
            bytes,
            seconds,
            bytes_per_second: bytes as f64 / seconds,
        }
    }
}

/// Latency percentiles of one kind of request, in milliseconds.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Latency {
    /// Requests measured.
    pub requests: usize,
    /// Median.
    pub p50_milliseconds: f64,
    /// 99th percentile (the slowest request when fewer than 100).
    pub p99_milliseconds: f64,
}

impl Latency {
    fn of(mut samples: Vec<Duration>) -> Self {
        samples.sort();
        let at = |quantile: f64| {
            samples
                .get(((samples.len() as f64 - 1.0) * quantile).round() as usize)
                .map_or(0.0, |duration| duration.as_secs_f64() * 1000.0)
        };
        Latency {
            requests: samples.len(),
            p50_milliseconds: at(0.50),
            p99_milliseconds: at(0.99),
        }
    }
}

/// What the source holds.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceFacts {
    /// The directory.
    pub path: String,
    /// Regular files.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// CPU throughput of the pipeline stages on one core.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuStages {
    /// FastCDC chunking.
    pub chunking: Rate,
    /// Keyed BLAKE3 of every chunk.
    pub hashing: Rate,
    /// zstd of every chunk.
    pub compression: Rate,
    /// The zstd level used.
    pub compression_level: i32,
    /// Stored bytes per source byte on the sample (1.0 when nothing shrinks).
    pub compression_ratio: f64,
}

/// A backup of a sample of the source's files of one kind, by the engine
/// itself into a throwaway encrypted repository on this machine: what the
/// backup does per file and per byte (reads, chunking, hashing,
/// compression, encryption, packs), without the upload.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SampleBackup {
    /// Files backed up (a file the sample stopped in counts once).
    pub files: u64,
    /// Source bytes backed up and in what time; its rate is the pace
    /// after the first quarter of the sample (the whole sample's when it
    /// is too short to tell).
    pub rate: Rate,
    /// Stored bytes per byte of new data (compression).
    pub stored_ratio: f64,
    /// CPU seconds of the process per second of the sample: how many
    /// cores the backup kept busy.
    pub cores_busy: f64,
}

/// The sample backups, one per kind of file the engine treats alike.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SampleBackups {
    /// Files up to [`small_file_limit`] bytes, read whole, several to a
    /// job; `None` when the source has none.
    pub small_files: Option<SampleBackup>,
    /// Bytes of the source in small files.
    pub small_file_bytes: u64,
    /// Larger files, chunked as streams; `None` when the source has none.
    pub large_files: Option<SampleBackup>,
    /// Bytes of the source in large files.
    pub large_file_bytes: u64,
    /// Cores of this machine.
    pub cores: usize,
}

/// Upload, download and request latency against the location.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StorageFigures {
    /// Where.
    pub location: String,
    /// Test objects written (and read back).
    pub objects: usize,
    /// Size of each.
    pub object_bytes: u64,
    /// Upload, [`UPLOADS_IN_FLIGHT`] at a time.
    pub upload: Rate,
    /// Download, [`DOWNLOADS_IN_FLIGHT`] at a time.
    pub download: Rate,
    /// Small PUTs.
    pub put_latency: Latency,
    /// Small GETs.
    pub get_latency: Latency,
    /// HEADs.
    pub head_latency: Latency,
    /// Objects left under the bench prefix after the clean-up (0 unless a
    /// delete failed).
    pub objects_left: usize,
}

/// The time estimate.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Estimate {
    /// Source bytes the estimate is for.
    pub bytes: u64,
    /// Source bytes per second of each limit, by name.
    pub limits: Vec<(String, f64)>,
    /// The slowest of them.
    pub bottleneck: String,
    /// Source bytes per second overall.
    pub bytes_per_second: f64,
    /// Seconds a first (full) backup of `bytes` takes.
    pub seconds: f64,
}

/// Everything `haulage bench` measured.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BenchReport {
    /// The source.
    pub source: SourceFacts,
    /// One reader.
    pub read_single: Rate,
    /// Several readers on other files.
    pub read_parallel: Rate,
    /// Readers in the parallel test.
    pub readers: usize,
    /// CPU stages.
    pub cpu: CpuStages,
    /// The sample backups.
    pub samples: SampleBackups,
    /// Storage.
    pub storage: StorageFigures,
    /// The estimate.
    pub estimate: Estimate,
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The source cannot be read.
    #[error("cannot benchmark source {path}: {reason}")]
    Source {
        /// The directory.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A sample backup failed.
    #[error("cannot back up a sample of {path}: {reason}")]
    Sample {
        /// The source.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The measurement was stopped.
    #[error("the benchmark of {path} was stopped before it ended")]
    Cancelled {
        /// The source.
        path: PathBuf,
    },
    /// A storage request failed.
    #[error("storage benchmark against {location} failed to {operation}: {source}")]
    Storage {
        /// The location.
        location: String,
        /// What was being done.
        operation: String,
        /// The store's error.
        #[source]
        source: crate::store::StoreError,
    },
}

/// Measure the stages of a backup of `args.source` into `store`, and
/// estimate its first backup.
pub async fn measure(args: &BenchSettings, store: DynStore) -> Result<BenchReport, BenchError> {
    let source_error = |reason: String| BenchError::Source {
        path: args.source.clone(),
        reason,
    };
    let source = args.source.clone();
    let (facts, files) = tokio::task::spawn_blocking(move || scan(&source))
        .await
        .map_err(|error| source_error(error.to_string()))?
        .map_err(|error| source_error(error.to_string()))?;
    if facts.bytes == 0 {
        return Err(source_error("holds no file data to measure".into()));
    }
    // Files in a fixed pseudo-random order, so the read budget and the CPU
    // sample cover the whole tree and not just its first directories; then
    // disjoint halves, so the parallel readers do not read what the single
    // reader just put in the page cache.
    let mut files = files;
    {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        files.shuffle(&mut rand::rngs::StdRng::seed_from_u64(SAMPLE_ORDER_SEED));
    }
    let files_in_order = files.clone();
    let budget = args.size.max(1);
    let (single_files, parallel_files): (Vec<_>, Vec<_>) = files
        .into_iter()
        .enumerate()
        .partition(|(index, _)| index % 2 == 0);
    let single_files: Vec<_> = single_files.into_iter().map(|(_, file)| file).collect();
    let mut parallel_files: Vec<_> = parallel_files.into_iter().map(|(_, file)| file).collect();
    if parallel_files.is_empty() {
        parallel_files = single_files.clone();
    }
    let cpu_sample_bytes = args.cpu_sample_bytes;
    let cancelled = || BenchError::Cancelled {
        path: args.source.clone(),
    };
    let mut pace = ReadPace::start(args, 2 * budget.min(facts.bytes));
    let stop = args.cancel.clone();
    let (read_single, sample) = tokio::task::spawn_blocking(move || {
        read_files(&single_files, budget / 2, 1, cpu_sample_bytes, &stop)
    })
    .await
    .map_err(|error| source_error(error.to_string()))?
    .map_err(|error| source_error(error.to_string()))?;
    pace.read(read_single.bytes).await;
    let readers = args.readers;
    let stop = args.cancel.clone();
    let (read_parallel, _) = tokio::task::spawn_blocking(move || {
        read_files(&parallel_files, budget / 2, readers, 0, &stop)
    })
    .await
    .map_err(|error| source_error(error.to_string()))?
    .map_err(|error| source_error(error.to_string()))?;
    pace.read(read_parallel.bytes).await;

    if args.cancel.is_cancelled() {
        return Err(cancelled());
    }
    let level = args.compression_level;
    let cpu = tokio::task::spawn_blocking(move || cpu_stages(&sample, level))
        .await
        .map_err(|error| source_error(error.to_string()))?;
    let samples = sample_backups(args, &files_in_order, budget, level, &mut pace).await?;
    if args.cancel.is_cancelled() {
        return Err(cancelled());
    }
    let storage = storage_figures(store, args).await?;
    if args.cancel.is_cancelled() {
        return Err(cancelled());
    }

    let estimate_bytes = args.estimate_bytes.unwrap_or(facts.bytes);
    let estimate = estimate(
        estimate_bytes,
        &read_parallel,
        &samples,
        &storage,
        args.limit_read,
        args.limit_upload,
    );
    Ok(BenchReport {
        source: facts,
        read_single,
        read_parallel,
        readers: args.readers,
        cpu,
        samples,
        storage,
        estimate,
    })
}

/// The measurement's reads of the source, against the read cap and for
/// the progress ([`BenchSettings::limit_read`], [`BenchSettings::progress`]).
struct ReadPace {
    limit: Option<ByteRate>,
    progress: Option<Arc<Progress>>,
    cancel: CancellationToken,
    started: Instant,
    bytes: u64,
}

impl ReadPace {
    /// Reads starting now, about `planned` bytes of them.
    fn start(args: &BenchSettings, planned: u64) -> Self {
        if let Some(progress) = &args.progress {
            progress.set_totals(planned, 0);
        }
        ReadPace {
            limit: args.limit_read,
            progress: args.progress.clone(),
            cancel: args.cancel.clone(),
            started: Instant::now(),
            bytes: 0,
        }
    }

    /// A phase read `bytes`: count them, then rest until the reads so far
    /// average the cap (or the measurement is cancelled).
    async fn read(&mut self, bytes: u64) {
        self.count(bytes);
        if let Some(rest) = self.rest() {
            tokio::select! {
                () = tokio::time::sleep(rest) => {}
                () = self.cancel.cancelled() => {}
            }
        }
    }

    /// Count `bytes` read, in the progress too.
    fn count(&mut self, bytes: u64) {
        self.bytes += bytes;
        if let Some(progress) = &self.progress {
            Progress::add(&progress.bytes_done, bytes);
            Progress::add(&progress.bytes_transferred, bytes);
        }
    }

    /// How long to rest for the reads so far to average the cap.
    fn rest(&self) -> Option<Duration> {
        let ByteRate(rate) = self.limit?;
        let due = Duration::from_secs_f64(self.bytes as f64 / rate.max(1) as f64);
        due.checked_sub(self.started.elapsed())
            .filter(|rest| !rest.is_zero())
    }
}

/// Regular files under `root` with their sizes, and the totals.
fn scan(root: &Path) -> std::io::Result<(SourceFacts, Vec<(PathBuf, u64)>)> {
    let mut files = Vec::new();
    crate::engine::scan::scan_regular_files(root, None, |path, size| {
        files.push((path.to_path_buf(), size));
    })?;
    files.sort();
    let facts = SourceFacts {
        path: root.display().to_string(),
        files: files.len() as u64,
        bytes: files.iter().map(|(_, size)| size).sum(),
    };
    Ok((facts, files))
}

/// Read `files` in order with `readers` threads until `budget` bytes;
/// returns the rate and up to `keep` bytes of what was read (in order).
fn read_files(
    files: &[(PathBuf, u64)],
    budget: u64,
    readers: usize,
    keep: usize,
    cancel: &CancellationToken,
) -> std::io::Result<(Rate, Vec<u8>)> {
    use std::io::Read;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let total = AtomicU64::new(0);
    let sample = Mutex::new(Vec::with_capacity(keep.min(budget as usize)));
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..readers.max(1) {
            scope.spawn(|| {
                let mut buffer = vec![0u8; READ_BLOCK_BYTES];
                loop {
                    if total.load(Ordering::Relaxed) >= budget || cancel.is_cancelled() {
                        return;
                    }
                    let Some((path, _)) = files.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        return;
                    };
                    let Ok(mut file) = std::fs::File::open(path) else {
                        continue;
                    };
                    loop {
                        let read = match file.read(&mut buffer) {
                            Ok(0) | Err(_) => break,
                            Ok(read) => read,
                        };
                        if keep > 0 {
                            let mut sample = sample.lock().expect("sample");
                            let room = keep.saturating_sub(sample.len()).min(read);
                            sample.extend_from_slice(&buffer[..room]);
                        }
                        if total.fetch_add(read as u64, Ordering::Relaxed) + read as u64 >= budget {
                            return;
                        }
                    }
                }
            });
        }
    });
    let rate = Rate::new(total.load(Ordering::Relaxed), started.elapsed());
    Ok((rate, sample.into_inner().expect("sample")))
}

/// Chunk, hash and compress `sample` on one core, stage by stage.
fn cpu_stages(sample: &[u8], level: i32) -> CpuStages {
    let config = RepoConfig::generate(&mut rand::rng());
    let keys = config.keys().expect("a generated config is valid");
    let chunker = Chunker::new(config.chunker, keys.gear_seed);
    let started = Instant::now();
    let lengths = chunker.chunk_lengths(sample);
    let chunking = Rate::new(sample.len() as u64, started.elapsed());
    let mut chunks = Vec::with_capacity(lengths.len());
    let mut offset = 0;
    for length in lengths {
        chunks.push(&sample[offset..offset + length]);
        offset += length;
    }
    let started = Instant::now();
    for chunk in &chunks {
        std::hint::black_box(keys.blob_id(chunk));
    }
    let hashing = Rate::new(sample.len() as u64, started.elapsed());
    let started = Instant::now();
    let mut stored = 0u64;
    for chunk in &chunks {
        stored += match zstd::bulk::compress(chunk, level) {
            Ok(compressed) if compressed.len() < chunk.len() => compressed.len() as u64,
            _ => chunk.len() as u64,
        };
    }
    let compression = Rate::new(sample.len() as u64, started.elapsed());
    CpuStages {
        chunking,
        hashing,
        compression,
        compression_level: level,
        compression_ratio: if sample.is_empty() {
            1.0
        } else {
            stored as f64 / sample.len() as f64
        },
    }
}

/// Files up to this size are small files to the engine: read whole, and
/// several to one job (half the default chunker's largest chunk).
pub fn small_file_limit() -> u64 {
    u64::from(crate::repo::chunker::ChunkerParameters::default().max_bytes) / 2
}

impl SampleBackups {
    /// Source bytes per second of the whole source through the backup's
    /// pipeline: each kind of file at its sample's pace, one after the
    /// other as the CPU time adds up.
    pub fn source_bytes_per_second(&self) -> f64 {
        let seconds = [
            (self.small_file_bytes, &self.small_files),
            (self.large_file_bytes, &self.large_files),
        ]
        .iter()
        .map(|(bytes, sample)| match sample {
            Some(sample) if sample.rate.bytes_per_second > 0.0 => {
                *bytes as f64 / sample.rate.bytes_per_second
            }
            _ => 0.0,
        })
        .sum::<f64>();
        let bytes = (self.small_file_bytes + self.large_file_bytes) as f64;
        if seconds > 0.0 {
            bytes / seconds
        } else {
            f64::INFINITY
        }
    }

    /// Stored bytes per source byte over the whole source, each kind of
    /// file at its sample's ratio.
    pub fn stored_ratio(&self) -> f64 {
        let bytes = (self.small_file_bytes + self.large_file_bytes) as f64;
        if bytes == 0.0 {
            return 1.0;
        }
        [
            (self.small_file_bytes, &self.small_files),
            (self.large_file_bytes, &self.large_files),
        ]
        .iter()
        .map(|(class_bytes, sample)| {
            *class_bytes as f64 * sample.as_ref().map_or(1.0, |sample| sample.stored_ratio)
        })
        .sum::<f64>()
            / bytes
    }

    /// Cores the samples kept busy, over both.
    pub fn cores_busy(&self) -> f64 {
        let (cpu, seconds) = [&self.small_files, &self.large_files]
            .into_iter()
            .flatten()
            .fold((0.0, 0.0), |(cpu, seconds), sample| {
                (
                    cpu + sample.cores_busy * sample.rate.seconds,
                    seconds + sample.rate.seconds,
                )
            });
        if seconds > 0.0 { cpu / seconds } else { 0.0 }
    }
}

/// Back up a sample of each kind of file: `files` (paths under the source,
/// in the bench's order) up to half of `budget` bytes each, and at most
/// `--max-phase-time` each.
async fn sample_backups(
    args: &BenchSettings,
    files: &[(PathBuf, u64)],
    budget: u64,
    level: i32,
    pace: &mut ReadPace,
) -> Result<SampleBackups, BenchError> {
    let limit = small_file_limit();
    let (small, large): (Vec<_>, Vec<_>) = files.iter().partition(|(_, size)| *size <= limit);
    let class_budget = (budget / 2).max(1);
    let mut samples = SampleBackups {
        small_files: None,
        small_file_bytes: small.iter().map(|(_, size)| size).sum(),
        large_files: None,
        large_file_bytes: large.iter().map(|(_, size)| size).sum(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    for (class, sample) in [
        (small, &mut samples.small_files),
        (large, &mut samples.large_files),
    ] {
        let mut bytes = 0;
        let selected: Vec<PathBuf> = class
            .iter()
            .take_while(|(_, size)| {
                let take = bytes < class_budget;
                bytes += size;
                take
            })
            .filter_map(|(path, _)| path.strip_prefix(&args.source).ok())
            .map(Path::to_path_buf)
            .collect();
        if !selected.is_empty() && bytes > 0 {
            *sample = Some(sample_backup(args, selected, class_budget, level).await?);
            // At most the files selected were read.
            pace.read(bytes).await;
        }
    }
    Ok(samples)
}

/// This process's CPU time so far, in seconds.
fn process_cpu_seconds() -> f64 {
    let time = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    time.tv_sec as f64 + time.tv_nsec as f64 / 1e9
}

/// Back up the `selected` files of the source with the engine into a
/// throwaway repository in a temporary directory, until `budget` bytes are
/// done or `--max-phase-time` has passed.
async fn sample_backup(
    args: &BenchSettings,
    selected: Vec<PathBuf>,
    budget: u64,
    level: i32,
) -> Result<SampleBackup, BenchError> {
    use crate::engine::backup::{BackupOptions, ParentPolicy, Selection};
    use crate::engine::repository::{Encryption, Password, Repository};
    use std::sync::atomic::Ordering;
    let sample_error = |reason: String| BenchError::Sample {
        path: args.source.clone(),
        reason,
    };
    let scratch = tempfile::tempdir().map_err(|error| {
        sample_error(format!(
            "cannot create a temporary directory for its repository \
             (set TMPDIR to a writable directory): {error}"
        ))
    })?;
    let store: DynStore = std::sync::Arc::new(crate::store::local::LocalStore::new(scratch.path()));
    // Encrypted as repositories are by default. The key wraps a repository
    // deleted when the sample ends: what is measured is the encryption of
    // the data, not the cost of guessing the key's password.
    let encryption = Encryption::Password {
        password: Password::new(hex::encode(rand::random::<[u8; 16]>())),
        kdf: crate::repo::keyfile::KdfParameters {
            memory_kib: 64,
            iterations: 1,
            parallelism: 1,
        },
    };
    let repository = Repository::init(store, encryption)
        .await
        .map_err(|error| sample_error(error.to_string()))?;
    let mut options = BackupOptions::new(&args.source);
    options.only = Some(std::sync::Arc::new(Selection::of_files(selected)));
    options.parent = ParentPolicy::None;
    options.compression_level = level;
    options.hostname = "bench".into();
    options.memory = args.memory;
    let progress = std::sync::Arc::new(Progress::default());
    let cancel = args.cancel.child_token();
    let started = Instant::now();
    // What is done at an instant: the pace is taken between the instant a
    // quarter of the budget is done and the cut (or the end), so neither
    // the start (threads, the first reads filling the pipeline) nor the
    // bytes read but still in the pipeline at the cut count.
    let mark = |progress: &Progress| Mark {
        at: started.elapsed(),
        cpu_seconds: process_cpu_seconds(),
        bytes: progress.bytes_done.load(Ordering::Relaxed),
        files: progress.files_done.load(Ordering::Relaxed),
    };
    let first = mark(&progress);
    let mut quarter: Option<Mark> = None;
    let mut cut: Option<Mark> = None;
    let backup =
        crate::engine::backup::backup(&repository, options, progress.clone(), cancel.clone());
    let mut backup = std::pin::pin!(backup);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let outcome = loop {
        tokio::select! {
            outcome = &mut backup => break outcome,
            _ = tick.tick() => {
                let now = mark(&progress);
                if quarter.is_none() && now.bytes >= budget / 4 {
                    quarter = Some(now);
                }
                // Not before something is stored: the ratio is taken from it.
                let stored_some = progress.bytes_new.load(Ordering::Relaxed) > 0;
                if cut.is_none()
                    && ((now.bytes >= budget && stored_some) || now.at >= args.max_phase_time)
                {
                    cut = Some(now);
                    cancel.cancel();
                }
            }
        }
    };
    let end = cut.unwrap_or_else(|| mark(&progress));
    if args.cancel.is_cancelled() {
        return Err(BenchError::Cancelled {
            path: args.source.clone(),
        });
    }
    match outcome {
        Ok(_) | Err(crate::engine::EngineError::Cancelled) => {}
        Err(error) => return Err(sample_error(error.to_string())),
    }
    // A sample too short to have a steady part is taken whole.
    let from = quarter
        .filter(|quarter| end.bytes > quarter.bytes)
        .unwrap_or(first);
    let seconds = (end.at - from.at).as_secs_f64().max(1e-9);
    let done = progress.snapshot();
    Ok(SampleBackup {
        files: end.files,
        rate: Rate {
            bytes: end.bytes,
            seconds: end.at.as_secs_f64(),
            bytes_per_second: (end.bytes - from.bytes) as f64 / seconds,
        },
        stored_ratio: if done.bytes_new == 0 {
            1.0
        } else {
            done.bytes_stored as f64 / done.bytes_new as f64
        },
        cores_busy: (end.cpu_seconds - from.cpu_seconds) / seconds,
    })
}

/// Progress of a sample backup at an instant.
#[derive(Debug, Clone, Copy)]
struct Mark {
    at: Duration,
    cpu_seconds: f64,
    bytes: u64,
    files: u64,
}

/// Incompressible bytes, different for every object so no server can dedup.
fn test_object(size: usize, seed: u64) -> Bytes {
    use rand::{RngCore, SeedableRng};
    let mut data = vec![0u8; size];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    Bytes::from(data)
}

async fn storage_figures(
    store: DynStore,
    args: &BenchSettings,
) -> Result<StorageFigures, BenchError> {
    let location = store.location();
    let run_prefix = format!("{BENCH_PREFIX}{}/", hex::encode(rand::random::<[u8; 8]>()));
    let store = match args.limit_upload {
        Some(ByteRate(rate)) => crate::store::wrap_store(
            store,
            &crate::store::StoreOptions {
                upload_bytes_per_second: std::num::NonZeroU64::new(rate),
                retry: Some(crate::store::retry::RetryPolicy {
                    max_attempts: 1,
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .map_err(|error| BenchError::Storage {
            location: location.clone(),
            operation: "apply the upload cap".into(),
            source: crate::store::StoreError::Permanent {
                location: location.clone(),
                operation: "put",
                key: String::new(),
                message: error.to_string(),
                cause: crate::store::FailureCause::Other,
            },
        })?,
        None => store,
    };
    let measured = measure_storage(&store, args, &run_prefix).await;
    // Clean up whatever was written, also after a failure.
    let mut objects_left = 0;
    match store.list(&run_prefix).await {
        Ok(objects) => {
            for object in objects {
                if store.delete(&object.key).await.is_err() {
                    objects_left += 1;
                }
            }
        }
        Err(error) => {
            tracing::warn!(error = %error, prefix = run_prefix, "cannot list bench objects to delete them");
            objects_left = usize::MAX;
        }
    }
    let mut figures = measured?;
    figures.objects_left = objects_left;
    Ok(figures)
}

/// Turns a store error into a [`BenchError`] saying what was being done.
fn storage_error(
    store: &DynStore,
    operation: String,
) -> impl FnOnce(crate::store::StoreError) -> BenchError {
    let location = store.location();
    move |source| BenchError::Storage {
        location,
        operation,
        source,
    }
}

async fn measure_storage(
    store: &DynStore,
    args: &BenchSettings,
    prefix: &str,
) -> Result<StorageFigures, BenchError> {
    let object_bytes = DEFAULT_OBJECT_BYTES;
    let deadline = Instant::now() + args.max_phase_time;
    // Upload: objects one pack in size, as many in flight as a backup sends,
    // until the count or the time is used up.
    let started = Instant::now();
    let mut uploaded = Vec::new();
    // Futures that own what they use (the agent runs this on a
    // multi-threaded runtime, where a stream borrowing its closures'
    // captures is not `Send`); each one not started by the deadline or a
    // cancel does nothing.
    let uploads: Vec<_> = (0..args.objects)
        .map(|index| {
            let (store, cancel) = (store.clone(), args.cancel.clone());
            let key = format!("{prefix}object-{index:03}");
            async move {
                if Instant::now() >= deadline || cancel.is_cancelled() {
                    return Ok(None);
                }
                let data = test_object(object_bytes as usize, index as u64);
                store
                    .put(&key, data, PutMode::Overwrite)
                    .await
                    .map(|()| Some(key.clone()))
                    .map_err(|error| (key, error))
            }
        })
        .collect();
    let mut uploads = futures::stream::iter(uploads).buffer_unordered(UPLOADS_IN_FLIGHT);
    while let Some(result) = uploads.next().await {
        let key =
            result.map_err(|(key, error)| storage_error(store, format!("upload {key}"))(error))?;
        uploaded.extend(key);
    }
    drop(uploads);
    let upload = Rate::new(uploaded.len() as u64 * object_bytes, started.elapsed());

    let deadline = Instant::now() + args.max_phase_time;
    let started = Instant::now();
    let mut downloaded = 0u64;
    let downloads: Vec<_> = uploaded
        .iter()
        .map(|key| {
            let (store, cancel, key) = (store.clone(), args.cancel.clone(), key.clone());
            async move {
                if Instant::now() >= deadline || cancel.is_cancelled() {
                    return (key, Ok(0));
                }
                let result = store.get(&key, None).await.map(|bytes| bytes.len() as u64);
                (key, result)
            }
        })
        .collect();
    let mut downloads = futures::stream::iter(downloads).buffer_unordered(DOWNLOADS_IN_FLIGHT);
    while let Some((key, result)) = downloads.next().await {
        downloaded += result.map_err(storage_error(store, format!("download {key}")))?;
    }
    drop(downloads);
    let download = Rate::new(downloaded, started.elapsed());

    let deadline = Instant::now() + args.max_phase_time;
    let (mut puts, mut gets, mut heads) = (Vec::new(), Vec::new(), Vec::new());
    for index in 0..LATENCY_REQUESTS {
        if Instant::now() >= deadline || args.cancel.is_cancelled() {
            break;
        }
        let key = format!("{prefix}small-{index:03}");
        let data = test_object(LATENCY_OBJECT_BYTES, 1_000_000 + index as u64);
        let started = Instant::now();
        store
            .put(&key, data, PutMode::Overwrite)
            .await
            .map_err(storage_error(store, format!("put {key}")))?;
        puts.push(started.elapsed());
        let started = Instant::now();
        store
            .get(&key, None)
            .await
            .map_err(storage_error(store, format!("get {key}")))?;
        gets.push(started.elapsed());
        let started = Instant::now();
        store
            .head(&key)
            .await
            .map_err(storage_error(store, format!("head {key}")))?;
        heads.push(started.elapsed());
    }
    Ok(StorageFigures {
        location: store.location(),
        objects: uploaded.len(),
        object_bytes,
        upload,
        download,
        put_latency: Latency::of(puts),
        get_latency: Latency::of(gets),
        head_latency: Latency::of(heads),
        objects_left: 0,
    })
}

/// The slowest stage decides, each expressed in source bytes per second.
fn estimate(
    bytes: u64,
    read: &Rate,
    samples: &SampleBackups,
    storage: &StorageFigures,
    limit_read: Option<ByteRate>,
    limit_upload: Option<ByteRate>,
) -> Estimate {
    // Uploaded bytes are the source's after compression and dedup, as the
    // samples stored them, so a byte of upload carries 1/ratio source bytes.
    let ratio = samples.stored_ratio().clamp(0.01, 1.0);
    let mut limits = vec![
        ("read".to_string(), read.bytes_per_second),
        (
            PIPELINE_LIMIT.to_string(),
            samples.source_bytes_per_second(),
        ),
        (
            "upload".to_string(),
            storage.upload.bytes_per_second / ratio,
        ),
    ];
    if let Some(ByteRate(rate)) = limit_read {
        limits.push(("read cap".to_string(), rate as f64));
    }
    if let Some(ByteRate(rate)) = limit_upload {
        limits.push(("upload cap".to_string(), rate as f64 / ratio));
    }
    let (bottleneck, rate) = limits
        .iter()
        .filter(|(_, rate)| rate.is_finite() && *rate > 0.0)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .unwrap_or(("nothing measured".to_string(), 0.0));
    // Whether the pipeline waits for the CPU or for something else (the
    // source's per-file calls, the engine's own stages).
    let bottleneck = if bottleneck == PIPELINE_LIMIT {
        format!(
            "{PIPELINE_LIMIT} ({:.1} of {} cores busy in the samples)",
            samples.cores_busy(),
            samples.cores
        )
    } else {
        bottleneck
    };
    Estimate {
        bytes,
        seconds: if rate > 0.0 {
            bytes as f64 / rate
        } else {
            f64::INFINITY
        },
        limits,
        bottleneck,
        bytes_per_second: rate,
    }
}

impl BenchReport {
    /// The figures a benchmark in a stage pod reports into the status of
    /// its VolumeTransfer, for a claim of `storage_class`.
    pub fn claim_benchmark(&self, storage_class: Option<String>) -> ClaimBenchmark {
        let whole = |value: f64| {
            if value.is_finite() {
                value.round().clamp(0.0, i64::MAX as f64) as i64
            } else {
                i64::MAX
            }
        };
        ClaimBenchmark {
            storage_class,
            files: whole(self.source.files as f64),
            bytes: whole(self.source.bytes as f64),
            read_one_reader_bytes_per_second: whole(self.read_single.bytes_per_second),
            read_bytes_per_second: whole(self.read_parallel.bytes_per_second),
            pipeline_bytes_per_second: whole(self.samples.source_bytes_per_second()),
            pipeline_millicores_busy: whole(self.samples.cores_busy() * 1000.0),
            cores: self.samples.cores as i64,
            stored_percent: whole(self.samples.stored_ratio() * 100.0),
            upload_bytes_per_second: whole(self.storage.upload.bytes_per_second),
            download_bytes_per_second: whole(self.storage.download.bytes_per_second),
            put_p50_microseconds: whole(self.storage.put_latency.p50_milliseconds * 1000.0),
            get_p50_microseconds: whole(self.storage.get_latency.p50_milliseconds * 1000.0),
            estimate_bytes_per_second: whole(self.estimate.bytes_per_second),
            estimate_seconds: whole(self.estimate.seconds.ceil()),
            limited_by: self.estimate.bottleneck.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_reads_rest_until_they_average_the_read_cap_and_count_in_the_progress() {
        let progress = Arc::new(Progress::default());
        let settings = BenchSettings {
            limit_read: Some(ByteRate(16 * MIB)),
            progress: Some(progress.clone()),
            ..BenchSettings::new("/data")
        };
        let mut pace = ReadPace::start(&settings, 128 * MIB);
        assert_eq!(pace.rest(), None, "nothing read yet");
        pace.count(32 * MIB);
        pace.count(32 * MIB);
        // 64 MiB at 16 MiB/s: four seconds since the start, less the
        // moment the test took.
        let rest = pace.rest().expect("a rest under the cap");
        assert!(
            rest > Duration::from_millis(3900) && rest <= Duration::from_secs(4),
            "{rest:?}"
        );
        let seen = progress.snapshot();
        assert_eq!((seen.bytes_done, seen.total_bytes), (64 * MIB, 128 * MIB));
        let uncapped = ReadPace::start(&BenchSettings::new("/data"), 128 * MIB);
        let mut uncapped = uncapped;
        uncapped.count(64 * MIB);
        assert_eq!(uncapped.rest(), None, "no cap, no rest");
    }

    fn sample(bytes_per_second: u64, stored_ratio: f64, cores_busy: f64) -> SampleBackup {
        SampleBackup {
            files: 1,
            rate: Rate {
                bytes: 128 * MIB,
                seconds: 1.0,
                bytes_per_second: bytes_per_second as f64,
            },
            stored_ratio,
            cores_busy,
        }
    }

    #[test]
    fn each_kind_of_file_takes_its_own_samples_time_and_the_times_add_up() {
        let samples = SampleBackups {
            small_files: Some(sample(10 * MIB, 0.2, 1.0)),
            small_file_bytes: 100 * MIB,
            large_files: Some(sample(100 * MIB, 1.0, 2.0)),
            large_file_bytes: 900 * MIB,
            cores: 2,
        };
        // 10 s of small files and 9 s of large ones.
        let rate = samples.source_bytes_per_second();
        assert!((rate - 1000.0 * MIB as f64 / 19.0).abs() < 1.0, "{rate}");
        assert!((samples.stored_ratio() - 0.92).abs() < 1e-9);
        assert!((samples.cores_busy() - 1.5).abs() < 1e-9);
        let nothing = SampleBackups {
            small_files: None,
            small_file_bytes: 0,
            large_files: None,
            large_file_bytes: 0,
            cores: 2,
        };
        assert!(nothing.source_bytes_per_second().is_infinite());
        assert_eq!(nothing.stored_ratio(), 1.0);
    }
}
