//! Backup of a directory tree into a repository.
//!
//! The pipeline, each stage bounded so memory is a constant and a slow
//! store slows the reader instead of filling memory:
//!
//! ```text
//! walker (thread of its own)   lstat, open; large files: read, FastCDC
//!   │ bounded channel + chunk-bytes semaphore          → WalkItem (ordered)
//! hash/dedup/compress           BLAKE3 + zstd on the blocking pool, up to
//!   │ (ordered, `buffered`)     `parallelism` jobs at once, results in walk
//!   │                           order; a small file (up to half a maximal
//!   │                           chunk) is one job: read, cut, hash, compress
//! assembler (async task)        file extents, tree blobs, packer
//!   │ JoinSet of one or two uploads (BackupBuffers::pack_uploads)
//! store                         packs, then index files, then the snapshot
//! ```
//!
//! Files that cannot be read become warnings in the snapshot summary; the
//! backup still completes. A file unchanged since the parent snapshot (same
//! size, mtime, ctime and inode) is not read again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Seek};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_bytes::ByteBuf;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::buffers::BufferPool;
use super::descriptors;
use super::memory::{BackupBuffers, EngineMemory, PACK_TRAILER_ROOM};
use super::progress::Progress;
use super::repository::{Repository, SourceHeads};
use super::throttle::Throttle;
use super::verify_tree;
use super::{EngineError, run_blocking};
use crate::repo::blob_table::BlobSet;
use crate::repo::chunker::Chunker;
use crate::repo::index::{BlobIndex, MAX_BLOBS_PER_INDEX_FILE};
use crate::repo::pack::{PackEntry, PackWriter};
use crate::repo::snapshot::{
    FileWarning, MAX_RECORDED_WARNINGS, RootAttributes, Snapshot, SnapshotSummary,
};
use crate::repo::tree::{Entry, EntryKind, Extent, Tree, Xattr};
use crate::repo::{BlobId, BlobKind, Compression, ObjectId};
use crate::store::local::out_of_descriptors;
use crate::store::out_of_descriptors_remedy;

/// Batches of walk items buffered between the walker and the hashing
/// stage. Small: the chunk-bytes semaphore is what bounds memory; this only
/// keeps the walker a few batches ahead.
const WALK_CHANNEL_CAPACITY: usize = 16;
/// Walk items the walker collects before handing them on as one batch. An
/// unchanged file costs two stat-like calls; handing each on alone woke the
/// pipeline's thread for it (two futex calls per file, most of an
/// unchanged second backup's time on many small files).
const WALK_BATCH_ITEMS: usize = 256;
/// File bytes (of small files still to read) after which a batch goes on
/// before it is full, so the parallel stage is not kept waiting for work.
const WALK_BATCH_FILE_BYTES: u64 = 1024 * 1024;
/// Memory the queued items hold (content lists of unchanged files, small
/// chunks already compressed) after which a batch goes on before it is
/// full: the channel then holds a few MiB at most, whatever the files (an
/// unchanged 10 GiB file's content list alone is about 400 KiB).
const WALK_BATCH_HELD_BYTES: usize = 256 * 1024;
/// Places under [`descriptors::backup_open_files`] the walker waits for at
/// once: never more than the fewest places a backup has, or it would wait
/// for ever.
const OPEN_FILE_PLACES_AT_ONCE: u32 = 8;
const _: () = assert!(OPEN_FILE_PLACES_AT_ONCE as usize <= descriptors::MIN_BACKUP_OPEN_FILES);
/// Jobs of the parallel stage in flight per core, up to twice the
/// blocking pool's threads ([`super::MAX_BLOCKING_THREADS`]): enough
/// queued to keep every thread fed, no more ahead of the other engines'
/// blocking work. With one more job than cores (as before), a thread that
/// finished its job often had none queued: the next came only once the
/// pipeline's task had run. The chunk budget, not this, bounds the memory
/// of the jobs in flight. Measured on two cores only (docs/benchmarks.md,
/// "Where a first backup's cores wait").
const JOBS_IN_FLIGHT_PER_CORE: usize = 4;
/// How long the walker waits for a file descriptor when the process has
/// none left (its limit of open files is reached: other volumes of the
/// same agent, or this backup's own files in flight) before it stops the
/// backup with [`EngineError::OutOfOpenFiles`]. A want of descriptors says
/// nothing of the file: skipping it (as an unreadable file is) would leave
/// it out of the snapshot, and a directory listed that way would be stored
/// empty.
const OUT_OF_OPEN_FILES_PATIENCE: Duration = Duration::from_secs(60);
/// The longest pause between two tries to open while out of descriptors.
const OUT_OF_OPEN_FILES_LONGEST_PAUSE: Duration = Duration::from_millis(100);

/// Chunks smaller than this are hashed and compressed on the walker thread.
const INLINE_CHUNK_BYTES: usize = 64 * 1024;
/// Write an index checkpoint after this many packs (or sooner, when they
/// hold [`MAX_BLOBS_PER_INDEX_FILE`] blobs), so an interrupted backup's
/// packs are found by their index and not by reading trailers.
const INDEX_CHECKPOINT_PACKS: usize = 32;
/// Bytes per read(2) call from the source.
const READ_BLOCK_BYTES: usize = 256 * 1024;
/// How often a backup writes its checkpoint by default: a killed backup
/// reads again at most about this long of its source when it is run again.
pub const DEFAULT_CHECKPOINT_EVERY: Duration = Duration::from_secs(60);
/// Default zstd level: level 1 keeps compression from being the bottleneck
/// on two cores (see docs/benchmarks.md for the measurement).
pub const DEFAULT_COMPRESSION_LEVEL: i32 = 1;

/// Which snapshot a backup is incremental against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParentPolicy {
    /// The newest snapshot with the same source and hostname, if any.
    LatestForSource,
    /// This snapshot.
    Snapshot(ObjectId),
    /// Read everything.
    None,
}

/// What to back up and how.
#[derive(Debug, Clone)]
pub struct BackupOptions {
    /// The directory to back up.
    pub source: PathBuf,
    /// How the snapshot names its source; defaults to the absolute path.
    pub source_label: Option<String>,
    /// Hostname (or stage pod) recorded in the snapshot.
    pub hostname: String,
    /// Incremental parent.
    pub parent: ParentPolicy,
    /// User tags.
    pub tags: BTreeMap<String, String>,
    /// The claim the source is, recorded in the snapshot so a destination
    /// cluster can recreate it.
    pub claim: Option<crate::repo::snapshot::ClaimRecord>,
    /// zstd level.
    pub compression_level: i32,
    /// Limit on reading the source.
    pub read_throttle: Throttle,
    /// Jobs of the parallel stage (a large file's chunk, a run of small
    /// files) handed to the blocking pool at once; their results are
    /// taken in walk order. See [`JOBS_IN_FLIGHT_PER_CORE`].
    pub parallelism: usize,
    /// The memory its buffers may take: chunks in flight (with the
    /// default share 16 MiB, at least 4 chunks and 16 of the 1 MiB
    /// average, enough to keep two cores busy; 12 MiB into S3, where two
    /// packs are uploaded at once), chunk buffers kept for reuse, and the
    /// packs filled and uploaded.
    pub memory: EngineMemory,
    /// Back up only these files of the source (and the directories on the
    /// way to them); `None` backs up everything. `haulage bench` backs up
    /// a sample of a source this way.
    pub only: Option<Arc<Selection>>,
    /// How often a checkpoint of what is stored so far is written, so that
    /// a backup of the same source and host after this one was killed does
    /// not read again the files it had stored; `None` writes none. Only a
    /// first backup (no parent snapshot) writes and uses checkpoints; not
    /// one with [`ParentPolicy::None`] or a selection
    /// ([`BackupOptions::only`]).
    pub checkpoint_every: Option<Duration>,
    /// Whether a first backup scans its source for the progress totals
    /// (files and bytes, for a percentage and an ETA) while it walks: an
    /// lstat of every file a second time. Off where nothing shows the
    /// progress (`haulage backup --no-progress` or `--json`): the totals
    /// are then the walk's own, at its end.
    pub scan_for_totals: bool,
    /// Stops the backup keeping what it read (SIGTERM: a node drain, a
    /// Ctrl-C): reading ends at once, the chunks read are stored with
    /// their index and, for a backup that writes checkpoints, a last
    /// checkpoint holds them, all within [`LAST_SAVE_WAIT`]; then the
    /// backup ends as cancelled. The `cancel` of [`backup`] stops at once,
    /// storing nothing more (a transfer the controller ended). A stop after
    /// every file was read lets the backup finish its snapshot.
    pub stop: CancellationToken,
}

/// How long a stopped backup ([`BackupOptions::stop`]) may take to store
/// what it read and write its last checkpoint: the chunks in flight are
/// few (the chunk budget) and one pack is open, so this is a few seconds
/// at most against a working store; past it (a store not answering) the
/// uploads are aborted. Well within a stage pod's termination grace
/// period (60 s).
pub const LAST_SAVE_WAIT: Duration = Duration::from_secs(30);

/// Files of a source, by their path relative to it, that a backup is
/// limited to ([`BackupOptions::only`]).
#[derive(Debug, Clone, Default)]
pub struct Selection {
    files: HashSet<PathBuf>,
    /// Every directory with a selected file under it.
    directories: HashSet<PathBuf>,
}

impl Selection {
    /// The files at these paths, relative to the source.
    pub fn of_files(files: impl IntoIterator<Item = PathBuf>) -> Self {
        let mut selection = Selection::default();
        for file in files {
            let mut directory = file.parent();
            while let Some(path) = directory.filter(|path| !path.as_os_str().is_empty()) {
                if !selection.directories.insert(path.to_path_buf()) {
                    break;
                }
                directory = path.parent();
            }
            selection.files.insert(file);
        }
        selection
    }

    /// Whether the selection names `relative`, as a file or a directory.
    fn names(&self, relative: &Path) -> bool {
        self.files.contains(relative) || self.directories.contains(relative)
    }

    /// Whether the entry at `relative` of this kind is backed up.
    fn keeps(&self, relative: &Path, kind: EntryKind) -> bool {
        match kind {
            EntryKind::Directory => self.directories.contains(relative),
            _ => self.files.contains(relative),
        }
    }
}

impl BackupOptions {
    /// Defaults for backing up `source`.
    pub fn new(source: impl Into<PathBuf>) -> Self {
        BackupOptions {
            source: source.into(),
            source_label: None,
            hostname: super::hostname(),
            parent: ParentPolicy::LatestForSource,
            tags: BTreeMap::new(),
            claim: None,
            compression_level: DEFAULT_COMPRESSION_LEVEL,
            read_throttle: Throttle::unlimited(),
            parallelism: (JOBS_IN_FLIGHT_PER_CORE
                * std::thread::available_parallelism().map_or(2, |n| n.get()))
            .min(2 * super::MAX_BLOCKING_THREADS),
            memory: EngineMemory::default(),
            only: None,
            checkpoint_every: Some(DEFAULT_CHECKPOINT_EVERY),
            scan_for_totals: true,
            stop: CancellationToken::new(),
        }
    }
}

/// The result of a backup.
#[derive(Debug, Clone)]
pub struct BackupOutcome {
    /// The new snapshot's id.
    pub snapshot_id: ObjectId,
    /// The manifest written.
    pub snapshot: Snapshot,
    /// The checkpoint of an interrupted backup of the same source this one
    /// continued from (its files unchanged since were not read again).
    pub resumed_from: Option<ResumedFrom>,
}

/// The checkpoint a backup continued from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumedFrom {
    /// The checkpoint's id.
    pub checkpoint: ObjectId,
    /// When the interrupted backup started (RFC 3339).
    pub started: String,
    /// Files the interrupted backup had stored.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// What the walker tells the rest of the pipeline, in walk order.
enum WalkItem {
    DirectoryStart(Entry),
    /// The end of the directory started last. `unchanged_tree`: the
    /// walker found its entries to be exactly those of this stored tree
    /// (its parent snapshot's), so it is named again, not encoded,
    /// hashed and looked up again.
    DirectoryEnd {
        unchanged_tree: Option<BlobId>,
    },
    FileStart(Entry),
    Chunk(Vec<u8>, OwnedSemaphorePermit),
    /// A small chunk the walker hashed and compressed itself: handing a few
    /// kilobytes to another thread costs more than the work.
    SmallChunk {
        id: BlobId,
        raw_length: u32,
        new_blob: Option<NewBlob>,
    },
    Hole(u64),
    FileEnd(Option<(String, String)>),
    FileAborted(String, String),
    /// A whole small file (opened, not yet read), read, chunked, hashed and
    /// compressed in one job of the parallel stage, so several small files
    /// are in flight at once instead of the walker reading each in turn.
    SmallFile(Box<SmallFile>, OwnedSemaphorePermit),
    Unchanged(Entry),
    HardlinkRepeat(Entry),
    Leaf(Entry),
    Warning(String, String),
}

/// A walk item after hashing.
enum Processed {
    Item(WalkItem),
    Chunk {
        id: BlobId,
        raw_length: u32,
        new_blob: Option<NewBlob>,
        _permit: Option<OwnedSemaphorePermit>,
    },
    /// A small file read whole: its entry (content and size set), its new
    /// chunks in order, and the warning if it changed while being read.
    File(Box<ReadFile>, OwnedSemaphorePermit),
}

/// A small regular file the walker opened and checked, for one job.
struct SmallFile {
    entry: Entry,
    file: File,
    /// The file's place under [`descriptors::backup_open_files`], given back when
    /// the file is closed.
    open_file: OwnedSemaphorePermit,
    before: Metadata,
    relative: PathBuf,
}

/// What one job of the parallel stage does: a large file's chunk hashed
/// and compressed on a blocking thread; a run of small files read, chunked,
/// hashed and compressed one after the other on one blocking thread; or a
/// run of walk items with nothing left to do (entries, holes, small chunks
/// the walker compressed), handed on as they are.
enum Job {
    Chunk(Vec<u8>, OwnedSemaphorePermit),
    /// The files, and their bytes.
    SmallFiles(Vec<(SmallFile, OwnedSemaphorePermit)>, u64),
    Done(Vec<WalkItem>),
}

/// Small files one job reads at most. A job of its own for each file woke
/// a blocking thread and then the pipeline for every file: eight futex
/// calls per file, most of the system time of a first backup of 200,000
/// small files (docs/benchmarks.md, "Small files in runs").
const SMALL_FILES_PER_JOB: usize = 32;
/// Bytes of small files one job reads at most, so a run of larger small
/// files still spreads over the cores.
const SMALL_FILE_BYTES_PER_JOB: u64 = 256 * 1024;

/// The jobs of one batch of walk items, in walk order: consecutive small
/// files go together, up to [`SMALL_FILES_PER_JOB`] files and
/// [`SMALL_FILE_BYTES_PER_JOB`] bytes (a file larger than that is a job of
/// its own), and so do consecutive items with nothing left to do (an
/// unchanged backup's entries are nearly all of them).
fn jobs_of(batch: Vec<WalkItem>) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut filling: Option<Job> = None;
    for item in batch {
        match (item, &mut filling) {
            (WalkItem::SmallFile(small, permit), Some(Job::SmallFiles(run, bytes)))
                if run.len() < SMALL_FILES_PER_JOB
                    && *bytes + small.before.len() <= SMALL_FILE_BYTES_PER_JOB =>
            {
                *bytes += small.before.len();
                run.push((*small, permit));
            }
            (WalkItem::SmallFile(small, permit), _) => {
                let bytes = small.before.len();
                jobs.extend(filling.replace(Job::SmallFiles(vec![(*small, permit)], bytes)));
            }
            (WalkItem::Chunk(data, permit), _) => {
                jobs.extend(filling.take());
                jobs.push(Job::Chunk(data, permit));
            }
            (other, Some(Job::Done(items))) => items.push(other),
            (other, _) => jobs.extend(filling.replace(Job::Done(vec![other]))),
        }
    }
    jobs.extend(filling);
    jobs
}

/// A small file after its job.
struct ReadFile {
    entry: Entry,
    chunks: Vec<(BlobId, u32, Option<NewBlob>)>,
    warning: Option<(String, String)>,
}

/// State shared by the walker and the hashing stage.
struct Shared {
    repository: Repository,
    index: Arc<BlobIndex>,
    /// Blobs claimed by this backup, so two identical new chunks in flight
    /// are stored once: every new blob of the backup, so 32 bytes each
    /// ([`BlobSet`]; a hash set took up to 70, 69 MiB for the million
    /// small files of docs/benchmarks.md).
    claimed: Mutex<BlobSet>,
    /// Claimed blobs the assembler has not put into a pack yet: a job
    /// claims a blob when it hashes it, and jobs run ahead of the
    /// assembly, so an earlier file may name a blob a later one stores.
    /// Kept only by a backup that writes checkpoints.
    pending: Option<Mutex<HashSet<BlobId>>>,
    progress: Arc<Progress>,
    /// Chunk and compressed-chunk buffers.
    buffers: BufferPool,
}

impl Shared {
    /// True if this blob must be stored (unknown, and not claimed yet).
    fn claim(&self, id: &BlobId) -> bool {
        let claimed =
            !self.index.contains(id) && self.claimed.lock().expect("claim set").insert(*id);
        if claimed && let Some(pending) = &self.pending {
            pending.lock().expect("pending set").insert(*id);
        }
        claimed
    }

    /// Whether `id` was claimed and is not in a pack yet.
    fn is_pending(&self, id: &BlobId) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|pending| pending.lock().expect("pending set").contains(id))
    }

    /// `id` went into a pack.
    fn packed(&self, id: &BlobId) {
        if let Some(pending) = &self.pending {
            pending.lock().expect("pending set").remove(id);
        }
    }
}

/// Back up `options.source` into `repository`.
pub async fn backup(
    repository: &Repository,
    options: BackupOptions,
    progress: Arc<Progress>,
    cancel: CancellationToken,
) -> Result<BackupOutcome, EngineError> {
    let started = Instant::now();
    // Nanoseconds, so that snapshots taken in the same second still have an
    // order (retention's "last", the latest per claim).
    let start_time = humantime::format_rfc3339_nanos(std::time::SystemTime::now()).to_string();
    let source = std::path::absolute(&options.source).map_err(|error| EngineError::Source {
        path: options.source.clone(),
        reason: error.to_string(),
    })?;
    let root_metadata = fs::metadata(&source).map_err(|error| EngineError::Source {
        path: source.clone(),
        reason: error.to_string(),
    })?;
    if !root_metadata.is_dir() {
        return Err(EngineError::Source {
            path: source,
            reason: "not a directory".into(),
        });
    }
    let label = options
        .source_label
        .clone()
        .unwrap_or_else(|| source.display().to_string());

    let loaded = repository.load_index().await?;
    let index = loaded.index;
    let SourceHeads {
        newest: parent,
        listed: heads,
    } = find_parent(repository, &options, &label).await?;
    let parent_root = match &parent {
        Some((_, snapshot)) => Some(repository.load_tree(&index, &snapshot.tree).await?),
        None => None,
    };
    // Checkpoints of earlier runs of this backup that did not finish: for
    // a first backup, the one that got furthest stands in for a parent, so
    // the files it stored are not read again; all of them go once this
    // backup's snapshot is written.
    let checkpoints = match options.only {
        Some(_) => Vec::new(),
        // Only a saving: without them every file is read.
        None => repository
            .checkpoints_of(&label, &options.hostname)
            .await
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "checkpoints not listed; every file is read");
                Vec::new()
            }),
    };
    let checkpointed = checkpointed(&options, parent.as_ref());
    let resume = resumable(&checkpoints)
        .filter(|_| checkpointed)
        .map(|(id, checkpoint)| {
            (
                checkpoint.tree,
                ResumedFrom {
                    checkpoint: *id,
                    started: checkpoint.time.clone(),
                    files: checkpoint.summary.files,
                    bytes: checkpoint.summary.total_bytes,
                },
            )
        });
    let (previous_root, resumed_from) = match resume {
        Some((tree, resumed)) => match repository.load_tree(&index, &tree).await {
            Ok(tree) => (Some(tree), Some(resumed)),
            Err(error) => {
                tracing::warn!(checkpoint = %resumed.checkpoint, %error, "checkpoint's tree cannot be read, its files are read again");
                (parent_root, None)
            }
        },
        None => (parent_root, None),
    };

    // Room for the tag sealing appends, so a sealed buffer never grows.
    let chunk_buffer_bytes = repository.largest_stored_blob_bytes();
    let buffers = options.memory.backup(
        chunk_buffer_bytes,
        repository.config().pack_target_bytes as usize,
        repository.store().is_remote(),
    );
    let shared = Arc::new(Shared {
        repository: repository.clone(),
        index: index.clone(),
        claimed: Mutex::new(BlobSet::new()),
        pending: (checkpointed && options.checkpoint_every.is_some())
            .then(|| Mutex::new(HashSet::new())),
        progress: progress.clone(),
        buffers: BufferPool::new(chunk_buffer_bytes, buffers.chunk_buffers_kept),
    });

    // Totals for the progress and its ETA. After a parent snapshot, its
    // totals: a source changes little between two backups, and a scan
    // would stat every file a second time, on the shared storage the
    // caps protect, for an unchanged backup most of what it costs. A first
    // backup has a cheap lstat-only scan running alongside. Either way
    // the totals are the walk's own once it ends.
    let scan_cancel = cancel.child_token();
    let scan = match &parent {
        // A selection's totals are the selection's, known at the end;
        // without a display, the walk's are enough.
        _ if options.only.is_some() || !options.scan_for_totals => None,
        Some((_, snapshot)) => {
            progress.set_totals(snapshot.summary.total_bytes, snapshot.summary.files);
            None
        }
        None => {
            let source = source.clone();
            let progress = progress.clone();
            let scan_cancel = scan_cancel.clone();
            // Only for the display: without a thread, no totals until
            // the walk ends.
            super::OwnThread::spawn("totals-scan", move || {
                scan_totals(&source, &progress, &scan_cancel)
            })
            .inspect_err(|error| tracing::warn!(%error, "no totals until the walk ends"))
            .ok()
        }
    };

    // Counted among the backups running until this function returns, past
    // the last job that holds a source file open, so that a backup starting
    // meanwhile takes its share beside this one's.
    let (_running_backup, open_files) = descriptors::RunningBackup::start();
    let (items_tx, items_rx) = mpsc::channel(WALK_CHANNEL_CAPACITY);
    let walker = {
        let context = WalkContext {
            shared: shared.clone(),
            chunker: repository.chunker(),
            throttle: options.read_throttle.clone(),
            handle: tokio::runtime::Handle::current(),
            chunk_budget: Arc::new(Semaphore::new(buffers.chunk_bytes_in_flight as usize)),
            chunk_bytes_in_flight: buffers.chunk_bytes_in_flight,
            open_files: Arc::new(Semaphore::new(open_files)),
            spare_open_file_places: None,
            cancel: cancel.clone(),
            stop: options.stop.clone(),
            items: items_tx,
            batch: Vec::with_capacity(WALK_BATCH_ITEMS),
            batch_file_bytes: 0,
            batch_held_bytes: 0,
            hardlinks_seen: HashSet::new(),
            file_size_hint: 0,
            compression_level: options.compression_level,
            only: options.only.clone(),
            waited_for_descriptors: false,
        };
        let source = source.clone();
        let walker = super::OwnThread::spawn_with_stack(
            "backup-walk",
            Some(super::WALK_STACK_BYTES),
            move || {
                let mut context = context;
                context.walk_root(&source, previous_root)
            },
        );
        match walker {
            Ok(walker) => walker,
            Err(error) => {
                scan_cancel.cancel();
                return Err(error);
            }
        }
    };

    let level = options.compression_level;
    let throttle = options.read_throttle.clone();
    let chunker = Arc::new(repository.chunker());
    let processed = tokio_stream_from(items_rx)
        .flat_map(|batch| futures::stream::iter(jobs_of(batch)))
        .map(|job| {
            let shared = shared.clone();
            let chunker = chunker.clone();
            let throttle = &throttle;
            async move {
                match job {
                    Job::Chunk(data, permit) => vec![
                        run_blocking(move || hash_and_compress(&shared, data, level, permit)).await,
                    ],
                    Job::SmallFiles(files, _) => {
                        let throttle = throttle.clone();
                        read_small_files(shared, chunker, throttle, files, level).await
                    }
                    Job::Done(items) => items
                        .into_iter()
                        .map(|item| match item {
                            WalkItem::SmallChunk {
                                id,
                                raw_length,
                                new_blob,
                            } => Processed::Chunk {
                                id,
                                raw_length,
                                new_blob,
                                _permit: None,
                            },
                            other => Processed::Item(other),
                        })
                        .collect(),
                }
            }
        })
        .buffered(options.parallelism.max(1))
        .flat_map(futures::stream::iter);

    let mut assembler = Assembler::new(
        Packer::new(repository.clone(), progress.clone(), &buffers),
        shared.clone(),
    );
    if checkpointed && let Some(every) = options.checkpoint_every {
        assembler.checkpoints = Some(CheckpointWriter {
            every,
            started,
            last: Instant::now(),
            bytes_at_last: 0,
            tree_bytes_at_last: 0,
            template: Snapshot {
                format_version: repository.config().format_version,
                time: start_time.clone(),
                hostname: options.hostname.clone(),
                source: label.clone(),
                tree: BlobId([0; 32]),
                root: RootAttributes::default(),
                parent: parent.as_ref().map(|(id, _)| *id),
                tags: BTreeMap::new(),
                claim: None,
                summary: SnapshotSummary::default(),
            },
            written: None,
        });
    }
    let assembled = assembler.run(processed, &cancel).await;
    let walk_result = walker.join().await;
    scan_cancel.cancel();
    if let Some(scan) = scan {
        scan.join().await;
    }
    let root_tree = match (assembled, walk_result) {
        (Ok(Some(root)), Ok(())) if !cancel.is_cancelled() => root,
        (Ok(_), Err(EngineError::Cancelled))
            if options.stop.is_cancelled() && !cancel.is_cancelled() =>
        {
            // Everything the walker handed on is assembled: store it.
            assembler.save_after_stop(&cancel).await;
            assembler.packer.abandon().await;
            return Err(EngineError::Cancelled);
        }
        (assembled, walked) => {
            // Stop the uploads in flight and wait for their aborts, so a
            // failed or cancelled backup leaves no multipart upload behind.
            assembler.packer.abandon().await;
            return Err(match (assembled, walked) {
                (Err(error), _) | (Ok(_), Err(error)) => error,
                _ if cancel.is_cancelled() => EngineError::Cancelled,
                _ => EngineError::Source {
                    path: source.clone(),
                    reason: "walk ended without the root directory".into(),
                },
            });
        }
    };

    // Packs are stored; now the index (including adopted packs), then the
    // snapshot. The last uploads (often the longest wait: everything is
    // read, the packs queue behind the upload cap) stop at a cancel too:
    // a canceled backup aborts them and writes no snapshot (before,
    // `controller::cancels` saw every backup deleted with a pack in flight
    // finish its volume and write its snapshot after all).
    let finished = tokio::select! {
        finished = assembler.packer.finish() => finished,
        () = cancel.cancelled() => Err(EngineError::Cancelled),
    };
    let mut pending_index = match finished {
        Ok(pending) => pending,
        Err(error) => {
            assembler.packer.abandon().await;
            return Err(error);
        }
    };
    pending_index.extend(loaded.unindexed_packs);
    if !pending_index.is_empty() {
        repository.write_index(pending_index).await?;
    }
    if cancel.is_cancelled() {
        return Err(EngineError::Cancelled);
    }
    let stats = &assembler.stats;
    // The totals of what was walked, in place of the estimate or the scan.
    progress.set_totals(stats.total_bytes, stats.files);
    let snapshot = Snapshot {
        format_version: repository.config().format_version,
        time: start_time,
        hostname: options.hostname.clone(),
        source: label,
        tree: root_tree,
        root: RootAttributes {
            mode: root_metadata.mode() & 0o7777,
            uid: root_metadata.uid(),
            gid: root_metadata.gid(),
            mtime_seconds: root_metadata.mtime(),
            mtime_nanos: root_metadata.mtime_nsec() as u32,
            xattrs: read_xattrs(&source).unwrap_or_default(),
        },
        parent: parent.map(|(id, _)| id),
        tags: options.tags.clone(),
        claim: options.claim.clone(),
        summary: SnapshotSummary {
            files: stats.files,
            directories: stats.directories,
            other_entries: stats.other_entries,
            total_bytes: stats.total_bytes,
            bytes_read: progress.snapshot().bytes_transferred,
            bytes_new: assembler.packer.bytes_new,
            bytes_stored: assembler.packer.bytes_stored,
            files_unchanged: stats.files_unchanged,
            packs_written: assembler.packer.packs_written,
            duration_seconds: started.elapsed().as_secs_f64(),
            warning_count: stats.warning_count,
            warnings: stats.warnings.clone(),
        },
    };
    let snapshot_id = repository.write_snapshot(&snapshot).await?;
    // The next backup of this source finds its parent by this head.
    if options.only.is_none()
        && let Err(error) = repository
            .replace_heads(&snapshot.source, &snapshot.hostname, &snapshot_id, &heads)
            .await
    {
        tracing::warn!(snapshot = %snapshot_id, %error, "the source's head not written; the next backup of this source reads every snapshot for its parent");
    }
    // The snapshot holds everything the checkpoints did.
    let mut done: Vec<ObjectId> = checkpoints.iter().map(|(id, _)| *id).collect();
    done.extend(
        assembler
            .checkpoints
            .as_ref()
            .and_then(|writer| writer.written),
    );
    for id in &done {
        if let Err(error) = repository
            .delete_checkpoint(&snapshot.source, &snapshot.hostname, id)
            .await
        {
            tracing::warn!(checkpoint = %id, %error, "checkpoint not deleted; the next backup of this source deletes it");
        }
    }
    Ok(BackupOutcome {
        snapshot_id,
        snapshot,
        resumed_from,
    })
}

/// How many times the bytes of the trees the last checkpoint stored a
/// backup must read before its next checkpoint.
const CHECKPOINT_BYTES_PER_TREE_BYTE: u64 = 8;

/// Whether a checkpoint holding `held` file bytes is worth writing after
/// one that held `at_last` and stored `tree_bytes_at_last` of trees: each
/// checkpoint stores again the whole trees of the open directories (a flat
/// directory of a million files has a tree of about 100 MB), so a next one
/// waits until the backup has read [`CHECKPOINT_BYTES_PER_TREE_BYTE`]
/// times that since. The trees of checkpoints then stay under an eighth of
/// the file bytes the backup reads; with ordinary directories (trees of a
/// few KiB) any progress is enough.
fn checkpoint_worth_its_trees(held: u64, at_last: u64, tree_bytes_at_last: u64) -> bool {
    held > at_last.saturating_add(tree_bytes_at_last.saturating_mul(CHECKPOINT_BYTES_PER_TREE_BYTE))
}

/// Whether a backup writes checkpoints and continues from them: a first
/// backup of its source (no parent snapshot), the long one, unless it is
/// to read every file anyway or backs up a selection. With a parent, the
/// parent already spares reading the files unchanged since, while a
/// checkpoint holds only the part of the tree the interrupted run had
/// reached: continuing from it would read the rest again.
fn checkpointed(options: &BackupOptions, parent: Option<&(ObjectId, Snapshot)>) -> bool {
    options.only.is_none() && options.parent != ParentPolicy::None && parent.is_none()
}

/// The checkpoint a backup continues from: of those of its source and host
/// (`checkpoints`), the one that got furthest (the most file bytes).
fn resumable(checkpoints: &[(ObjectId, Snapshot)]) -> Option<&(ObjectId, Snapshot)> {
    checkpoints
        .iter()
        .max_by_key(|(_, checkpoint)| (checkpoint.summary.total_bytes, checkpoint.summary.files))
}

fn tokio_stream_from<T: Send + 'static>(
    mut receiver: mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |context| receiver.poll_recv(context))
}

/// The parent snapshot the options ask for, and the heads of the source
/// that this backup's snapshot replaces (docs/format.md, "Heads"; none
/// for a backup of part of the source, which writes no head).
async fn find_parent(
    repository: &Repository,
    options: &BackupOptions,
    label: &str,
) -> Result<SourceHeads, EngineError> {
    let heads = || async {
        match options.only {
            Some(_) => Vec::new(),
            None => repository.heads_of(label, &options.hostname).await,
        }
    };
    match &options.parent {
        ParentPolicy::None => Ok(SourceHeads {
            newest: None,
            listed: heads().await,
        }),
        ParentPolicy::Snapshot(id) => Ok(SourceHeads {
            newest: Some((*id, repository.load_snapshot(id).await?)),
            listed: heads().await,
        }),
        ParentPolicy::LatestForSource => {
            repository
                .newest_snapshot_of(label, &options.hostname)
                .await
        }
    }
}

/// A blob not yet in the repository, ready for a pack: compressed (or
/// not) and sealed in format 2.
#[derive(Debug)]
pub(crate) struct NewBlob {
    compression: Compression,
    /// What goes before `body` in the pack (the nonce in format 2).
    prefix: crate::repo::codec::BlobPrefix,
    /// The stored bytes (format 2: ciphertext and tag).
    body: Vec<u8>,
}

impl NewBlob {
    /// Compress (into a pooled buffer when `buffers` is given) and seal.
    fn encode(
        repository: &Repository,
        buffers: Option<&BufferPool>,
        kind: BlobKind,
        id: &BlobId,
        data: Vec<u8>,
        level: i32,
    ) -> Self {
        let (compression, mut body) = match buffers {
            Some(buffers) => compress_pooled(buffers, data, level),
            None => compress(data, level),
        };
        let prefix = repository
            .codec()
            .seal_blob_in_place(&mut rand::rng(), kind, id, &mut body);
        NewBlob {
            compression,
            prefix,
            body,
        }
    }

    fn stored_length(&self) -> usize {
        self.prefix.as_bytes().len() + self.body.len()
    }
}

/// Hash a data chunk and, when this backup is the first to claim it,
/// compress and seal it; the buffers not kept go back to the pool (which
/// keeps only chunk-sized ones).
fn data_blob(shared: &Shared, data: Vec<u8>, level: i32) -> (BlobId, u32, Option<NewBlob>) {
    let id = shared.repository.keys().blob_id(&data);
    let raw_length = data.len() as u32;
    let new_blob = if shared.claim(&id) {
        Some(NewBlob::encode(
            &shared.repository,
            Some(&shared.buffers),
            BlobKind::Data,
            &id,
            data,
            level,
        ))
    } else {
        shared.buffers.give(data);
        None
    };
    (id, raw_length, new_blob)
}

/// Append a hole to a file's extents, merged with a hole before it.
fn push_hole(content: &mut Vec<Extent>, length: u64) {
    match content.last_mut() {
        Some(Extent::Hole(previous)) => *previous += length,
        _ => content.push(Extent::Hole(length)),
    }
}

fn hash_and_compress(
    shared: &Shared,
    data: Vec<u8>,
    level: i32,
    permit: OwnedSemaphorePermit,
) -> Processed {
    let (id, raw_length, new_blob) = data_blob(shared, data, level);
    Processed::Chunk {
        id,
        raw_length,
        new_blob,
        _permit: Some(permit),
    }
}

/// zstd-compress into a new buffer (with this thread's reused context), or
/// keep the plaintext when compression does not shrink it.
fn compress(data: Vec<u8>, level: i32) -> (Compression, Vec<u8>) {
    let output = Vec::with_capacity(zstd::zstd_safe::compress_bound(data.len()));
    compress_into(output, data, level, |_| {})
}

thread_local! {
    /// One zstd context per worker thread, reused across chunks: creating
    /// one per small chunk was 3 % of a first backup's CPU.
    static COMPRESSOR: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Chunks at least this large are sampled before compressing.
const SAMPLED_CHUNK_BYTES: usize = 256 * 1024;
/// Bytes in each of the three samples of a large chunk.
const SAMPLE_BYTES: usize = 16 * 1024;
/// A large chunk whose samples compress to more than this share of their
/// size is stored as it is.
const INCOMPRESSIBLE_SHARE: f64 = 0.97;

/// [`compress`] into a pooled buffer with a reused zstd context; the buffer
/// not kept goes back to the pool.
fn compress_pooled(buffers: &BufferPool, data: Vec<u8>, level: i32) -> (Compression, Vec<u8>) {
    let output = if data.len() * 2 > buffers.capacity() {
        buffers.take()
    } else {
        Vec::with_capacity(zstd::zstd_safe::compress_bound(data.len()))
    };
    compress_into(output, data, level, |unused| buffers.give(unused))
}

/// Compress `data` into `output` with this thread's zstd context; the
/// buffer not returned goes to `give_back`. A large chunk is first sampled
/// at its start, middle and end: random or already compressed data (media,
/// archives, encrypted files) is stored as it is after compressing 48 KiB
/// instead of the whole chunk.
fn compress_into(
    mut output: Vec<u8>,
    data: Vec<u8>,
    level: i32,
    give_back: impl FnOnce(Vec<u8>),
) -> (Compression, Vec<u8>) {
    let result = COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|(current, _)| *current != level) {
            *slot = zstd::bulk::Compressor::new(level)
                .ok()
                .map(|compressor| (level, compressor));
        }
        let Some((_, compressor)) = slot.as_mut() else {
            return Err(std::io::Error::other("cannot create a zstd context"));
        };
        if data.len() >= SAMPLED_CHUNK_BYTES && !samples_compress(compressor, &data, &mut output) {
            return Ok(usize::MAX);
        }
        compressor.compress_to_buffer(&data, &mut output)
    });
    match result {
        Ok(length) if length < data.len() => {
            give_back(data);
            (Compression::Zstd, output)
        }
        _ => {
            give_back(output);
            (Compression::None, data)
        }
    }
}

/// Whether three samples of `data` shrink under compression (`scratch` is
/// the output buffer, at least [`SAMPLE_BYTES`] plus zstd's bound).
fn samples_compress(
    compressor: &mut zstd::bulk::Compressor<'static>,
    data: &[u8],
    scratch: &mut Vec<u8>,
) -> bool {
    let middle = data.len() / 2 - SAMPLE_BYTES / 2;
    let starts = [0, middle, data.len() - SAMPLE_BYTES];
    let mut compressed = 0usize;
    for start in starts {
        scratch.clear();
        match compressor.compress_to_buffer(&data[start..start + SAMPLE_BYTES], scratch) {
            Ok(length) => compressed += length,
            Err(_) => return true,
        }
    }
    scratch.clear();
    (compressed as f64) < INCOMPRESSIBLE_SHARE * (starts.len() * SAMPLE_BYTES) as f64
}

/// Fill in the progress totals with the lstat-only walk
/// ([`super::scan::scan_regular_files`]).
fn scan_totals(root: &Path, progress: &Progress, cancel: &CancellationToken) {
    use std::sync::atomic::Ordering;
    // An unreadable root fails the backup itself, with its own message.
    let _ = super::scan::scan_regular_files(root, Some(cancel), |_, size| {
        progress.total_bytes.fetch_add(size, Ordering::Relaxed);
        progress.total_files.fetch_add(1, Ordering::Relaxed);
    });
    if !cancel.is_cancelled() {
        progress.totals_known.store(true, Ordering::Release);
    }
}

/// The walker's state; runs on a thread of its own ([`super::OwnThread`]).
struct WalkContext {
    shared: Arc<Shared>,
    chunker: Chunker,
    throttle: Throttle,
    handle: tokio::runtime::Handle,
    chunk_budget: Arc<Semaphore>,
    /// The permits of `chunk_budget`: a chunk takes as many as its
    /// buffer's capacity, at most all.
    chunk_bytes_in_flight: u32,
    /// Places under [`descriptors::backup_open_files`].
    open_files: Arc<Semaphore>,
    /// Places under [`descriptors::backup_open_files`] taken and not used yet.
    spare_open_file_places: Option<OwnedSemaphorePermit>,
    cancel: CancellationToken,
    /// [`BackupOptions::stop`]: looked at before each entry and each read,
    /// and while an open waits for a descriptor, where everything handed
    /// on is whole.
    stop: CancellationToken,
    items: mpsc::Sender<Vec<WalkItem>>,
    /// Items not yet handed on, in walk order.
    batch: Vec<WalkItem>,
    /// Bytes of the small files in `batch`.
    batch_file_bytes: u64,
    /// Memory the items in `batch` hold ([`held_bytes`]).
    batch_held_bytes: usize,
    /// (device, inode) of multiply-linked files already emitted.
    hardlinks_seen: HashSet<(u64, u64)>,
    /// Size of the file being read, to size its read buffer.
    file_size_hint: u64,
    /// zstd level for chunks compressed on the walker thread.
    compression_level: i32,
    /// What the backup is limited to ([`BackupOptions::only`]).
    only: Option<Arc<Selection>>,
    /// Whether an open waited for a descriptor yet (said once a backup).
    waited_for_descriptors: bool,
}

/// Whether a batch of `items` walk items, with `file_bytes` bytes of small
/// files to read and holding `held_bytes` of memory, goes on now.
fn batch_is_full(items: usize, file_bytes: u64, held_bytes: usize) -> bool {
    items >= WALK_BATCH_ITEMS
        || file_bytes >= WALK_BATCH_FILE_BYTES
        || held_bytes >= WALK_BATCH_HELD_BYTES
}

/// Memory a queued walk item holds beyond its own size: an entry's content
/// list and extended attributes, a small chunk's stored bytes. (A large
/// chunk and a small file hold chunk budget, which bounds them.)
fn held_bytes(item: &WalkItem) -> usize {
    let entry_bytes = |entry: &Entry| {
        entry.content.len() * std::mem::size_of::<Extent>()
            + entry
                .xattrs
                .iter()
                .map(|xattr| xattr.name.len() + xattr.value.len())
                .sum::<usize>()
    };
    match item {
        WalkItem::SmallChunk { new_blob, .. } => {
            new_blob.as_ref().map_or(0, |blob| blob.body.capacity())
        }
        WalkItem::Unchanged(entry)
        | WalkItem::HardlinkRepeat(entry)
        | WalkItem::Leaf(entry)
        | WalkItem::DirectoryStart(entry)
        | WalkItem::FileStart(entry) => entry_bytes(entry),
        _ => 0,
    }
}

/// A parent snapshot's subtree being read and decoded on the runtime.
struct LoadingSubtree {
    /// The subdirectory's name.
    name: Vec<u8>,
    tree: tokio::task::JoinHandle<Option<Tree>>,
}

impl Drop for LoadingSubtree {
    /// A load no longer wanted (its directory is gone, or the walk
    /// stopped) stops.
    fn drop(&mut self) {
        self.tree.abort();
    }
}

/// Metadata of a path as a tree entry (without content).
fn entry_from_metadata(name: &[u8], kind: EntryKind, metadata: &Metadata) -> Entry {
    Entry {
        mode: metadata.mode() & 0o7777,
        uid: metadata.uid(),
        gid: metadata.gid(),
        mtime_seconds: metadata.mtime(),
        mtime_nanos: metadata.mtime_nsec() as u32,
        ctime_seconds: metadata.ctime(),
        ctime_nanos: metadata.ctime_nsec() as u32,
        inode: metadata.ino(),
        device: metadata.dev(),
        links: metadata.nlink(),
        size: if kind == EntryKind::File {
            metadata.len()
        } else {
            0
        },
        rdev: metadata.rdev(),
        ..Entry::new(name, kind)
    }
}

/// `open()`, tried again while it fails for want of descriptors, with
/// `wait(pause)` between tries (pauses from 1 ms, doubling up to
/// [`OUT_OF_OPEN_FILES_LONGEST_PAUSE`]; `wait` returns the time it took);
/// after `patience` of waiting, [`EngineError::OutOfOpenFiles`] for
/// `path`. Any other outcome of `open`, success or error, is returned as
/// it is.
fn retry_while_out_of_open_files<T>(
    path: &Path,
    patience: Duration,
    mut open: impl FnMut() -> io::Result<T>,
    mut wait: impl FnMut(Duration) -> Result<Duration, EngineError>,
) -> Result<io::Result<T>, EngineError> {
    let mut waited = Duration::ZERO;
    let mut pause = Duration::from_millis(1);
    loop {
        match open() {
            Err(error) if out_of_descriptors(&error) => {
                if waited >= patience {
                    return Err(EngineError::OutOfOpenFiles {
                        path: path.to_path_buf(),
                        remedy: out_of_descriptors_remedy(
                            &error,
                            descriptors::open_file_limits_now(),
                        ),
                        reason: error.to_string(),
                        waited_seconds: waited.as_secs(),
                    });
                }
                waited += wait(pause)?;
                pause = (pause * 2).min(OUT_OF_OPEN_FILES_LONGEST_PAUSE);
            }
            outcome => return Ok(outcome),
        }
    }
}

/// An `O_PATH` descriptor of the directory at `path`, to look its entries
/// up relative to it; `None` (the entries are then looked up by path) when
/// it cannot be opened.
fn open_directory(path: &Path) -> Option<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

/// The entry `name` of `directory` (at `path`) as a tree entry, without
/// following a symlink: one `statx` relative to the directory, or, without
/// a descriptor or when that call fails (a kernel or sandbox without
/// `statx`), `lstat` of the whole path, whose error is the one reported.
fn lstat_entry(directory: Option<&OwnedFd>, name: &OsStr, path: &Path) -> io::Result<Entry> {
    use rustix::fs::{AtFlags, StatxFlags};
    if let Some(directory) = directory
        && let Ok(status) = rustix::fs::statx(
            directory,
            name,
            AtFlags::SYMLINK_NOFOLLOW,
            StatxFlags::BASIC_STATS,
        )
        && status.stx_mask & StatxFlags::BASIC_STATS.bits() == StatxFlags::BASIC_STATS.bits()
    {
        return Ok(entry_from_statx(name.as_bytes(), &status));
    }
    let metadata = fs::symlink_metadata(path)?;
    Ok(entry_from_metadata(
        name.as_bytes(),
        kind_of_mode(metadata.mode()),
        &metadata,
    ))
}

/// [`entry_from_metadata`] from a `statx` result: the same fields.
fn entry_from_statx(name: &[u8], status: &rustix::fs::Statx) -> Entry {
    let kind = kind_of_mode(u32::from(status.stx_mode));
    Entry {
        mode: u32::from(status.stx_mode) & 0o7777,
        uid: status.stx_uid,
        gid: status.stx_gid,
        mtime_seconds: status.stx_mtime.tv_sec,
        mtime_nanos: status.stx_mtime.tv_nsec,
        ctime_seconds: status.stx_ctime.tv_sec,
        ctime_nanos: status.stx_ctime.tv_nsec,
        inode: status.stx_ino,
        device: rustix::fs::makedev(status.stx_dev_major, status.stx_dev_minor),
        links: u64::from(status.stx_nlink),
        size: if kind == EntryKind::File {
            status.stx_size
        } else {
            0
        },
        rdev: rustix::fs::makedev(status.stx_rdev_major, status.stx_rdev_minor),
        ..Entry::new(name, kind)
    }
}

/// Whether `entry` is the inode `previous` was, unchanged in its metadata
/// since: same kind, inode number and change time. Every change of an
/// inode's metadata (its extended attributes, mode, owner, links, and any
/// write) moves its ctime, so `previous`'s extended attributes are still
/// the inode's and need not be listed again.
/// Whether the file opened (`opened`) is the one `entry` was looked up as,
/// unchanged: not one renamed over it since (an application saving it
/// anew), nor written to.
fn is_the_file_looked_at(entry: &Entry, opened: &Metadata) -> bool {
    opened.ino() == entry.inode
        && opened.dev() == entry.device
        && opened.len() == entry.size
        && opened.mtime() == entry.mtime_seconds
        && opened.mtime_nsec() == i64::from(entry.mtime_nanos)
        && opened.ctime() == entry.ctime_seconds
        && opened.ctime_nsec() == i64::from(entry.ctime_nanos)
}

fn same_inode_state(previous: &Entry, entry: &Entry) -> bool {
    previous.kind == entry.kind
        && previous.inode == entry.inode
        && previous.ctime_seconds == entry.ctime_seconds
        && previous.ctime_nanos == entry.ctime_nanos
}

/// The kind of an entry from its `st_mode`; a type the format has no name
/// for is taken as a regular file, as the walk always has.
fn kind_of_mode(mode: u32) -> EntryKind {
    verify_tree::entry_kind(rustix::fs::FileType::from_raw_mode(mode)).unwrap_or(EntryKind::File)
}

/// Extended attributes of a path, without following a symlink.
fn read_xattrs(path: &Path) -> io::Result<Vec<Xattr>> {
    // Most files have none: their list is asked into the stack, not into a
    // buffer allocated and zeroed for each file.
    let mut listed = [0u8; 1024];
    let mut larger: Vec<u8> = Vec::new();
    let length = loop {
        let names: &mut [u8] = if larger.is_empty() {
            &mut listed
        } else {
            &mut larger
        };
        match rustix::fs::llistxattr(path, &mut *names) {
            Ok(length) => break length,
            Err(rustix::io::Errno::RANGE) => {
                let size = names.len() * 4;
                larger.resize(size, 0);
            }
            Err(rustix::io::Errno::NOTSUP) => return Ok(Vec::new()),
            Err(error) => return Err(error.into()),
        }
    };
    let names: &[u8] = if larger.is_empty() { &listed } else { &larger };
    let mut xattrs = Vec::new();
    for name in names[..length]
        .split(|byte| *byte == 0)
        .filter(|name| !name.is_empty())
    {
        let mut value = vec![0u8; 1024];
        let value_length = loop {
            match rustix::fs::lgetxattr(path, name, &mut value) {
                Ok(length) => break Some(length),
                Err(rustix::io::Errno::RANGE) if value.len() < 1 << 20 => {
                    value.resize(value.len() * 8, 0)
                }
                // Vanished meanwhile, or not readable by us: skip that one.
                Err(_) => break None,
            }
        };
        if let Some(value_length) = value_length {
            value.truncate(value_length);
            xattrs.push(Xattr {
                name: ByteBuf::from(name.to_vec()),
                value: ByteBuf::from(value),
            });
        }
    }
    Ok(xattrs)
}

fn relative_display(relative: &Path) -> String {
    relative.display().to_string()
}

impl WalkContext {
    /// Queue `item` for the pipeline. A large chunk goes on at once (it is
    /// work for a core); other items go on in batches.
    fn send(&mut self, item: WalkItem) -> Result<(), EngineError> {
        if self.cancel.is_cancelled() {
            return Err(EngineError::Cancelled);
        }
        if let WalkItem::SmallFile(small, _) = &item {
            self.batch_file_bytes += small.before.len();
        }
        self.batch_held_bytes += held_bytes(&item);
        let large_chunk = matches!(item, WalkItem::Chunk(..));
        self.batch.push(item);
        if large_chunk
            || batch_is_full(
                self.batch.len(),
                self.batch_file_bytes,
                self.batch_held_bytes,
            )
        {
            self.flush()?;
        }
        Ok(())
    }

    /// After a stop ([`BackupOptions::stop`]): hand on what is queued and
    /// end the walk (`Err(Cancelled)`). Called only where every item
    /// queued is whole.
    fn end_if_stopped(&mut self) -> Result<(), EngineError> {
        if !self.stop.is_cancelled() {
            return Ok(());
        }
        self.flush()?;
        Err(EngineError::Cancelled)
    }

    /// `open()` of `path`, tried again while the process has no descriptor
    /// left ([`out_of_descriptors`]): between tries the queued items are
    /// handed on (their jobs read and close the files they hold) and the
    /// walker pauses, up to [`OUT_OF_OPEN_FILES_PATIENCE`] in all. Any
    /// other outcome is returned as it is.
    fn open_when_descriptors_free<T>(
        &mut self,
        path: &Path,
        open: impl FnMut() -> io::Result<T>,
    ) -> Result<io::Result<T>, EngineError> {
        retry_while_out_of_open_files(path, OUT_OF_OPEN_FILES_PATIENCE, open, |pause| {
            let started = Instant::now();
            if !self.waited_for_descriptors {
                self.waited_for_descriptors = true;
                // Said at the default level: a backup slowed file by file
                // by a limit must not look hung for no reason.
                tracing::warn!(
                    path = %path.display(),
                    soft_limit = descriptors::soft_limit_now(),
                    "the process has no file descriptor free: waiting for a file descriptor to come free \
                     (up to {} s an open; said once a backup). If this repeats, raise the limit of open \
                     files or move fewer volumes at once",
                    OUT_OF_OPEN_FILES_PATIENCE.as_secs()
                );
            }
            // A stop (SIGTERM) ends the walk here as anywhere else, what is
            // read kept; every queued item is whole where the walker opens.
            self.end_if_stopped()?;
            self.flush()?;
            if self.cancel.is_cancelled() || self.items.is_closed() {
                return Err(EngineError::Cancelled);
            }
            std::thread::sleep(pause);
            Ok(started.elapsed())
        })
    }

    /// Hand the queued items on. Called before the walker waits for chunk
    /// budget: the queued items may hold the budget it waits for.
    fn flush(&mut self) -> Result<(), EngineError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(WALK_BATCH_ITEMS));
        self.batch_file_bytes = 0;
        self.batch_held_bytes = 0;
        self.items
            .blocking_send(batch)
            .map_err(|_| EngineError::Cancelled)
    }

    /// `permits` of the chunk budget.
    fn chunk_budget(&mut self, permits: u32) -> Result<OwnedSemaphorePermit, EngineError> {
        let budget = self.chunk_budget.clone();
        self.acquire(budget, permits)
    }

    /// A place for one more open source file. When none is free the
    /// walker waits for [`OPEN_FILE_PLACES_AT_ONCE`] and keeps the ones it
    /// does not use yet: waking it for each file a job closed made two
    /// context switches per small file.
    fn open_file_place(&mut self) -> Result<OwnedSemaphorePermit, EngineError> {
        let mut spare = match self.spare_open_file_places.take() {
            Some(last) if last.num_permits() == 1 => return Ok(last),
            Some(spare) => spare,
            None => {
                let places = self.open_files.clone();
                if let Ok(place) = places.clone().try_acquire_owned() {
                    return Ok(place);
                }
                self.acquire(places, OPEN_FILE_PLACES_AT_ONCE)?
            }
        };
        let place = spare.split(1).expect("more than one spare place");
        self.spare_open_file_places = Some(spare);
        Ok(place)
    }

    /// `permits` of `semaphore`, handing the queued items on first when it
    /// must wait (they may hold what it waits for).
    fn acquire(
        &mut self,
        semaphore: Arc<Semaphore>,
        permits: u32,
    ) -> Result<OwnedSemaphorePermit, EngineError> {
        if let Ok(permit) = semaphore.clone().try_acquire_many_owned(permits) {
            return Ok(permit);
        }
        self.flush()?;
        self.handle
            .block_on(semaphore.acquire_many_owned(permits))
            .map_err(|_| EngineError::Cancelled)
    }

    fn warn(&mut self, relative: &Path, message: impl Into<String>) -> Result<(), EngineError> {
        Progress::add(&self.shared.progress.warnings, 1);
        self.send(WalkItem::Warning(
            relative_display(relative),
            message.into(),
        ))
    }

    fn walk_root(&mut self, root: &Path, parent: Option<Tree>) -> Result<(), EngineError> {
        let metadata = fs::symlink_metadata(root).map_err(|error| EngineError::Source {
            path: root.to_path_buf(),
            reason: error.to_string(),
        })?;
        let mut entry = entry_from_metadata(b"", EntryKind::Directory, &metadata);
        entry.xattrs = read_xattrs(root).unwrap_or_default();
        self.send(WalkItem::DirectoryStart(entry))?;
        self.walk_directory(root, Path::new(""), parent.as_ref(), None)?;
        self.send(WalkItem::DirectoryEnd {
            unchanged_tree: None,
        })?;
        self.flush()
    }

    /// The parent snapshot's tree of the subdirectory `name` of `parent`,
    /// and the next subdirectory's tree set loading in `next` while this
    /// one is walked (the walk would otherwise wait for each tree's read
    /// and decode in turn: a tenth of an unchanged backup's walk on many
    /// small directories). One tree ahead per level at most.
    fn parent_subtree(
        &self,
        parent: Option<&Tree>,
        name: &[u8],
        next: &mut Option<LoadingSubtree>,
    ) -> Option<Tree> {
        let parent = parent?;
        let tree = match next.take() {
            Some(mut loading) if loading.name == name => {
                self.handle.block_on(&mut loading.tree).ok().flatten()
            }
            // A directory the parent did not have: keep what loads.
            Some(loading) if loading.name.as_slice() > name => {
                *next = Some(loading);
                self.load_parent_subtree(parent, name)
            }
            // Nothing loading, or that directory is gone (dropping its
            // load stops it).
            _ => self.load_parent_subtree(parent, name),
        };
        if next.is_none() {
            *next = self.start_loading_subtree_after(parent, name);
        }
        tree
    }

    /// Start loading the tree of `parent`'s first subdirectory after `name`.
    fn start_loading_subtree_after(&self, parent: &Tree, name: &[u8]) -> Option<LoadingSubtree> {
        let start = parent
            .entries
            .partition_point(|entry| entry.name.as_slice() <= name);
        let (entry, subtree) = parent.entries[start..].iter().find_map(|entry| {
            entry
                .subtree
                .filter(|_| entry.kind == EntryKind::Directory)
                .map(|subtree| (entry, subtree))
        })?;
        let repository = self.shared.repository.clone();
        let shared = self.shared.clone();
        let tree = self
            .handle
            .spawn(async move { repository.load_tree(&shared.index, &subtree).await.ok() });
        Some(LoadingSubtree {
            name: entry.name.to_vec(),
            tree,
        })
    }

    fn load_parent_subtree(&self, parent: &Tree, name: &[u8]) -> Option<Tree> {
        let subtree = parent
            .find(name)
            .filter(|entry| entry.kind == EntryKind::Directory)?
            .subtree?;
        let repository = &self.shared.repository;
        // A parent tree that cannot be read only costs reading the files.
        self.handle
            .block_on(repository.load_tree(&self.shared.index, &subtree))
            .ok()
    }

    /// Walk the directory at `path`, whose tree in the parent snapshot is
    /// `parent` (stored as `parent_id`). Returns `parent_id` when every
    /// entry the walk sent is the parent's entry of that name, unchanged,
    /// and the parent has no other: the directory's tree is then the
    /// parent's, bit for bit.
    fn walk_directory(
        &mut self,
        path: &Path,
        relative: &Path,
        parent: Option<&Tree>,
        parent_id: Option<BlobId>,
    ) -> Result<Option<BlobId>, EngineError> {
        // Entries sent that are their parent's entry, unchanged; any other
        // sent clears `same`.
        let mut same = parent.is_some() && parent_id.is_some();
        let mut same_entries = 0usize;
        let mut names: Vec<OsString> =
            match self.open_when_descriptors_free(path, || fs::read_dir(path))? {
                Ok(entries) => entries
                    .filter_map(|entry| entry.ok().map(|entry| entry.file_name()))
                    .collect(),
                Err(error) => {
                    self.warn(
                        relative,
                        format!("cannot list directory, stored empty: {error}"),
                    )?;
                    return Ok(None);
                }
            };
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        // The entries are looked up relative to the directory, not by their
        // whole path (which the kernel would walk again for each). At most
        // one descriptor per level: it is closed while a subdirectory is
        // walked and opened again after.
        let mut directory: Option<OwnedFd> = None;
        let mut next_subtree = None;
        for name in names {
            if self.cancel.is_cancelled() {
                return Err(EngineError::Cancelled);
            }
            self.end_if_stopped()?;
            let child_path = path.join(&name);
            let child_relative = relative.join(&name);
            // An entry no selection names is not even looked at.
            if let Some(only) = &self.only
                && !only.names(&child_relative)
            {
                continue;
            }
            if directory.is_none() {
                directory = open_directory(path);
            }
            let mut entry = match lstat_entry(directory.as_ref(), &name, &child_path) {
                Ok(entry) => entry,
                Err(error) => {
                    self.warn(
                        &child_relative,
                        format!("vanished or unreadable, skipped: {error}"),
                    )?;
                    continue;
                }
            };
            let kind = entry.kind;
            if let Some(only) = &self.only
                && !only.keeps(&child_relative, kind)
            {
                continue;
            }
            let name_bytes = name.into_vec();
            let previous = parent.and_then(|tree| tree.find(&name_bytes));
            entry.xattrs = match previous.filter(|previous| same_inode_state(previous, &entry)) {
                Some(previous) => previous.xattrs.clone(),
                None => read_xattrs(&child_path).unwrap_or_default(),
            };
            let sent_as_before = match kind {
                EntryKind::Directory => {
                    directory = None;
                    let parent_subtree =
                        self.parent_subtree(parent, &name_bytes, &mut next_subtree);
                    let previous_subtree = previous
                        .filter(|previous| previous.kind == EntryKind::Directory)
                        .and_then(|previous| previous.subtree);
                    // Compared once its tree is known.
                    let mut stored = previous.is_some().then(|| entry.clone());
                    self.send(WalkItem::DirectoryStart(entry))?;
                    let unchanged_tree = self.walk_directory(
                        &child_path,
                        &child_relative,
                        parent_subtree.as_ref(),
                        previous_subtree,
                    )?;
                    self.send(WalkItem::DirectoryEnd { unchanged_tree })?;
                    match (&mut stored, unchanged_tree) {
                        (Some(stored), Some(tree)) => {
                            stored.subtree = Some(tree);
                            previous == Some(&*stored)
                        }
                        _ => false,
                    }
                }
                EntryKind::File => self.walk_file(&child_path, &child_relative, entry, previous)?,
                EntryKind::Symlink => match fs::read_link(&child_path) {
                    Ok(target) => {
                        entry.link_target = Some(ByteBuf::from(target.into_os_string().into_vec()));
                        let as_before = previous == Some(&entry);
                        self.send(WalkItem::Leaf(entry))?;
                        as_before
                    }
                    Err(error) => {
                        self.warn(
                            &child_relative,
                            format!("cannot read symlink, skipped: {error}"),
                        )?;
                        // Nothing sent: the tree lacks it as the parent's
                        // would if it lacked it too.
                        continue;
                    }
                },
                EntryKind::Fifo
                | EntryKind::Socket
                | EntryKind::CharDevice
                | EntryKind::BlockDevice => {
                    let as_before = previous == Some(&entry);
                    self.send(WalkItem::Leaf(entry))?;
                    as_before
                }
            };
            if sent_as_before {
                same_entries += 1;
            } else {
                same = false;
            }
        }
        let unchanged_tree = parent_id.filter(|id| {
            same && parent.is_some_and(|parent| parent.entries.len() == same_entries)
                && self.shared.index.contains(id)
        });
        Ok(unchanged_tree)
    }

    /// Back up the file at `path`, whose entry in the parent snapshot (or
    /// a checkpoint) is `previous`. Returns whether it sent `previous`
    /// itself, unchanged.
    fn walk_file(
        &mut self,
        path: &Path,
        relative: &Path,
        entry: Entry,
        previous: Option<&Entry>,
    ) -> Result<bool, EngineError> {
        let progress = self.shared.progress.clone();
        // The previous entry of a file not changed since: whole (a parent
        // snapshot's, or a checkpoint's finished file), or the first part
        // of it (a checkpoint's file that was being read).
        let previous = previous.filter(|previous| {
            same_inode_state(previous, &entry)
                && previous.size == entry.size
                && previous.mtime_seconds == entry.mtime_seconds
                && previous.mtime_nanos == entry.mtime_nanos
                && previous.content.iter().all(|extent| match extent {
                    Extent::Chunk(id, _) => self.shared.index.contains(id),
                    Extent::Hole(_) => true,
                })
        });
        let stored_part = previous.map_or(0, content_length);
        if let Some(previous) = previous
            && stored_part == previous.size
        {
            let mut unchanged = entry;
            unchanged.content = previous.content.clone();
            if unchanged.links > 1 {
                self.hardlinks_seen
                    .insert((unchanged.device, unchanged.inode));
            }
            Progress::add(&progress.bytes_done, unchanged.size);
            Progress::add(&progress.files_done, 1);
            let as_before = unchanged == *previous;
            self.send(WalkItem::Unchanged(unchanged))?;
            return Ok(as_before);
        }
        self.read_changed_file(path, relative, entry, previous, stored_part)?;
        Ok(false)
    }

    /// Back up a file that changed since `previous` (or is new, or a hard
    /// link), of which `stored_part` bytes are stored already.
    fn read_changed_file(
        &mut self,
        path: &Path,
        relative: &Path,
        entry: Entry,
        previous: Option<&Entry>,
        stored_part: u64,
    ) -> Result<(), EngineError> {
        let progress = self.shared.progress.clone();
        if entry.links > 1 && !self.hardlinks_seen.insert((entry.device, entry.inode)) {
            Progress::add(&progress.bytes_done, entry.size);
            Progress::add(&progress.files_done, 1);
            return self.send(WalkItem::HardlinkRepeat(entry));
        }
        // Held until the file is closed: here for a file the walker reads,
        // by its job for a small one.
        let open_file = self.open_file_place()?;
        // O_NONBLOCK: if a FIFO was swapped in after lstat, open must not hang.
        let file = self.open_when_descriptors_free(path, || {
            fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc_flags())
                .open(path)
        })?;
        let file = match file {
            Ok(file) => file,
            Err(error) => {
                return self.warn(relative, format!("cannot open, skipped: {error}"));
            }
        };
        let before = match file.metadata() {
            Ok(metadata) if metadata.is_file() => metadata,
            Ok(_) => return self.warn(relative, "changed type while being backed up, skipped"),
            Err(error) => return self.warn(relative, format!("cannot stat, skipped: {error}")),
        };
        let max = u64::from(self.chunker.parameters().max_bytes);
        if before.len() <= max / 2 && before.blocks() * 512 >= before.len() {
            let permits = (before.len() + 1).min(u64::from(self.chunk_bytes_in_flight)) as u32;
            let permit = self.chunk_budget(permits)?;
            let small = SmallFile {
                entry,
                file,
                open_file,
                before,
                relative: relative.to_path_buf(),
            };
            return self.send(WalkItem::SmallFile(Box::new(small), permit));
        }
        // A file a checkpoint holds the first part of is read from there on:
        // the part ends where a chunk did, so the chunks after it are the
        // ones reading it from the start would make.
        let mut entry = entry;
        let resume_at = match previous {
            Some(previous)
                if stored_part > 0
                    && stored_part < before.len()
                    && is_the_file_looked_at(&entry, &before) =>
            {
                entry.content = previous.content.clone();
                Progress::add(&progress.bytes_done, stored_part);
                stored_part
            }
            _ => 0,
        };
        self.send(WalkItem::FileStart(entry))?;
        match self.read_file_content(file, &before, resume_at) {
            Ok(after) => {
                Progress::add(&progress.files_done, 1);
                let warning = changed_while_read(&before, &after).then(|| {
                    Progress::add(&progress.warnings, 1);
                    (relative_display(relative), CHANGED_WHILE_READ.to_string())
                });
                self.send(WalkItem::FileEnd(warning))
            }
            Err(ReadFailure::Cancelled) => Err(EngineError::Cancelled),
            Err(ReadFailure::Io(error)) => {
                Progress::add(&progress.warnings, 1);
                self.send(WalkItem::FileAborted(
                    relative_display(relative),
                    format!("read failed, skipped: {error}"),
                ))
            }
        }
    }

    /// Read and chunk a file from `start` (0, or where the part a
    /// checkpoint holds ends), data regions only (holes are skipped with
    /// SEEK_DATA/SEEK_HOLE when the file has any).
    fn read_file_content(
        &mut self,
        mut file: File,
        before: &Metadata,
        start: u64,
    ) -> Result<Metadata, ReadFailure> {
        let size = before.len();
        self.file_size_hint = size;
        let may_have_holes = before.blocks() * 512 < size;
        let mut position = start;
        if start > 0 {
            file.seek(io::SeekFrom::Start(start))
                .map_err(ReadFailure::Io)?;
        }
        if may_have_holes {
            loop {
                let data_start = match rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(position))
                {
                    Ok(offset) => offset,
                    // No data after `position`: the rest is a hole.
                    Err(rustix::io::Errno::NXIO) => size.max(position),
                    Err(error) => return Err(ReadFailure::Io(error.into())),
                };
                if data_start > position {
                    self.send(WalkItem::Hole(data_start - position))
                        .map_err(|_| ReadFailure::Cancelled)?;
                }
                if data_start >= size {
                    break;
                }
                let hole_start = rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(data_start))
                    .map_err(|error| ReadFailure::Io(error.into()))?;
                rustix::fs::seek(&file, rustix::fs::SeekFrom::Start(data_start))
                    .map_err(|error| ReadFailure::Io(error.into()))?;
                let region_end = if hole_start >= size {
                    None
                } else {
                    Some(hole_start)
                };
                let read = self.chunk_region(&mut file, region_end.map(|end| end - data_start))?;
                position = data_start + read;
                if region_end.is_none() {
                    break;
                }
            }
        } else {
            self.chunk_region(&mut file, None)?;
        }
        file.metadata().map_err(ReadFailure::Io)
    }

    /// Read `limit` bytes (or to the end) from the current position and send
    /// them as chunks; returns the bytes read.
    fn chunk_region(&mut self, file: &mut File, limit: Option<u64>) -> Result<u64, ReadFailure> {
        let max = self.chunker.parameters().max_bytes as usize;
        let block = READ_BLOCK_BYTES.min(self.throttle.max_request_bytes());
        // Files smaller than a maximal chunk get a buffer of their own size;
        // larger ones cycle through the pool's chunk-sized buffers.
        let pooled = limit.unwrap_or(u64::MAX) > max as u64 && self.file_size_hint > max as u64;
        // A small file's buffer holds exactly its size plus one byte, so the
        // read that finds the end needs no growth.
        let small_capacity = (self.file_size_hint as usize).min(max) + 1;
        let take = |shared: &Shared| {
            if pooled {
                shared.buffers.take()
            } else {
                Vec::with_capacity(small_capacity)
            }
        };
        let mut pending: Vec<u8> = take(&self.shared);
        let mut remaining = limit.unwrap_or(u64::MAX);
        // What the region is expected to hold. A read is charged to the
        // throttle for what it should find, not for the block it asks for
        // (a read block asked of a 4 KiB file would spend a 256 KiB share
        // on 4 KiB: many small files then read at a fraction of their
        // grant); bytes beyond that (the file grew) are charged after.
        let expected = match limit {
            Some(limit) => limit,
            None if self.throttle.is_limited() => {
                let position = file.stream_position().map_err(ReadFailure::Io)?;
                self.file_size_hint.saturating_sub(position)
            }
            None => u64::MAX,
        };
        let mut total = 0u64;
        let mut at_end = false;
        // Read a block at a time and look for the cut in each block read,
        // so a chunk's buffer holds at most one block past its cut: that
        // block's part beyond the cut is all that is copied to the next
        // chunk's buffer (reading a whole maximal chunk ahead copied about
        // two bytes for each byte of a 4 MiB / 1 MiB chunker's chunks).
        let mut search = self.chunker.cut_search();
        loop {
            if let Some(cut) = self.chunker.find_cut(&mut search, &pending, at_end) {
                if pending.is_empty() {
                    self.shared.buffers.give(pending);
                    return Ok(total);
                }
                let mut next = take(&self.shared);
                next.extend_from_slice(&pending[cut..]);
                pending.truncate(cut);
                let chunk = std::mem::replace(&mut pending, next);
                self.send_chunk(chunk)?;
                search = self.chunker.cut_search();
                continue;
            }
            let want = block
                .min(max - pending.len())
                .min(remaining.min(usize::MAX as u64) as usize);
            if want == 0 {
                at_end = true;
                continue;
            }
            // What is read but not cut into a chunk yet is left: the
            // file's part ends where its last chunk did.
            self.end_if_stopped().map_err(|_| ReadFailure::Cancelled)?;
            let charged =
                want.min(expected.saturating_sub(total).clamp(1, usize::MAX as u64) as usize);
            self.throttle.acquire_blocking(&self.handle, charged);
            // read_to_end fills spare capacity without zeroing it first.
            let read = match (&mut *file).take(want as u64).read_to_end(&mut pending) {
                Ok(read) => read,
                Err(error) => return Err(ReadFailure::Io(error)),
            };
            if read > charged {
                self.throttle.acquire_blocking(&self.handle, read - charged);
            }
            if read < want {
                at_end = true;
            }
            remaining -= read as u64;
            total += read as u64;
            Progress::add(&self.shared.progress.bytes_transferred, read as u64);
            Progress::add(&self.shared.progress.bytes_done, read as u64);
        }
    }

    fn send_chunk(&mut self, chunk: Vec<u8>) -> Result<(), ReadFailure> {
        // An all-zero chunk is a hole: it costs no storage and restores as one.
        if chunk.iter().all(|byte| *byte == 0) {
            let length = chunk.len() as u64;
            self.shared.buffers.give(chunk);
            return self
                .send(WalkItem::Hole(length))
                .map_err(|_| ReadFailure::Cancelled);
        }
        // Count the buffer's capacity: that is the memory it holds.
        if chunk.len() < INLINE_CHUNK_BYTES {
            let (id, raw_length, new_blob) = data_blob(&self.shared, chunk, self.compression_level);
            return self
                .send(WalkItem::SmallChunk {
                    id,
                    raw_length,
                    new_blob,
                })
                .map_err(|_| ReadFailure::Cancelled);
        }
        let permits =
            (chunk.capacity().max(1) as u64).min(u64::from(self.chunk_bytes_in_flight)) as u32;
        let permit = self
            .chunk_budget(permits)
            .map_err(|_| ReadFailure::Cancelled)?;
        self.send(WalkItem::Chunk(chunk, permit))
            .map_err(|_| ReadFailure::Cancelled)
    }
}

/// The warning of a file whose size or times changed while it was read.
const CHANGED_WHILE_READ: &str = "changed while being read; the copy may mix old and new content";

fn changed_while_read(before: &Metadata, after: &Metadata) -> bool {
    after.len() != before.len()
        || after.mtime() != before.mtime()
        || after.mtime_nsec() != before.mtime_nsec()
        || after.ctime() != before.ctime()
        || after.ctime_nsec() != before.ctime_nsec()
}

/// Read a run of small files, each whole, one after the other on one
/// blocking thread (charging the read throttle first for all of them);
/// chunk them, and hash and compress their chunks. One result per file, in
/// order.
async fn read_small_files(
    shared: Arc<Shared>,
    chunker: Arc<Chunker>,
    throttle: Throttle,
    files: Vec<(SmallFile, OwnedSemaphorePermit)>,
    level: i32,
) -> Vec<Processed> {
    let request = throttle.max_request_bytes().max(1);
    for (small, _) in &files {
        let expected = (small.before.len() as usize).max(1);
        let mut charged = 0;
        while charged < expected {
            let bytes = request.min(expected - charged);
            throttle.acquire(bytes).await;
            charged += bytes;
        }
    }
    run_blocking(move || {
        files
            .into_iter()
            .map(
                |(small, permit)| match read_small_file(&shared, &chunker, small, level) {
                    Ok(read) => Processed::File(Box::new(read), permit),
                    Err((path, message)) => Processed::Item(WalkItem::FileAborted(path, message)),
                },
            )
            .collect()
    })
    .await
}

/// Read a small file whole, chunk it, and hash and compress its chunks;
/// its file is closed (and its place under [`descriptors::backup_open_files`] given
/// back) when this returns. A file that grew past the chunker's maximum
/// chunk while being read is stored up to it, with a warning saying so.
fn read_small_file(
    shared: &Shared,
    chunker: &Chunker,
    small: SmallFile,
    level: i32,
) -> Result<ReadFile, (String, String)> {
    let SmallFile {
        mut entry,
        file,
        open_file: _open_file,
        before,
        relative,
    } = small;
    let expected = before.len() as usize;
    let progress = &shared.progress;
    let limit = chunker.parameters().max_bytes as usize;
    // One byte more for the read that finds the end, and room for the tag
    // a blob stored as it is gets when sealed, so neither grows it.
    let mut data = Vec::with_capacity(expected + 1 + shared.repository.codec().blob_overhead());
    let after = read_whole(&file, &mut data, expected, limit);
    let after = match after {
        Ok(after) => after,
        Err(error) => {
            Progress::add(&progress.warnings, 1);
            return Err((
                relative_display(&relative),
                format!("read failed, skipped: {error}"),
            ));
        }
    };
    Progress::add(&progress.bytes_transferred, data.len() as u64);
    Progress::add(&progress.bytes_done, data.len() as u64);
    Progress::add(&progress.files_done, 1);
    let warning = if data.len() == limit && after.len() > limit as u64 {
        Some(format!(
            "grew past {limit} bytes while being read; stored its first {limit} bytes, \
             back it up again to store all of it"
        ))
    } else {
        changed_while_read(&before, &after).then(|| CHANGED_WHILE_READ.to_string())
    };
    let warning = warning.map(|message| {
        Progress::add(&progress.warnings, 1);
        (relative_display(&relative), message)
    });
    // All of the file is here, so every cut is the one the stream would
    // get.
    let mut cuts = Vec::new();
    let mut start = 0;
    while start < data.len() {
        let end = start + chunker.cut(&data[start..]);
        cuts.push(start..end);
        start = end;
    }
    let whole = cuts.len() == 1;
    let mut chunks = Vec::with_capacity(cuts.len());
    for range in cuts {
        let chunk = &data[range.clone()];
        if chunk.iter().all(|byte| *byte == 0) {
            push_hole(&mut entry.content, chunk.len() as u64);
            continue;
        }
        // A one-chunk file (most small files) gives its buffer.
        let chunk = if whole {
            std::mem::take(&mut data)
        } else {
            chunk.to_vec()
        };
        let (id, raw_length, new_blob) = data_blob(shared, chunk, level);
        entry.content.push(Extent::Chunk(id, raw_length));
        chunks.push((id, raw_length, new_blob));
    }
    Ok(ReadFile {
        entry,
        chunks,
        warning,
    })
}

/// Read a small file of `expected` bytes (its size when the walker looked)
/// into `data`, at most `limit` bytes, and return its metadata after the
/// read. The read that would find the end is left out when the file still
/// has its size afterwards (one read call per file instead of two, 200,000
/// fewer calls for as many small files); a file that grew is read on to
/// its end or the limit.
fn read_whole(
    file: &File,
    data: &mut Vec<u8>,
    expected: usize,
    limit: usize,
) -> io::Result<Metadata> {
    let first = expected.min(limit);
    file.take(first as u64).read_to_end(data)?;
    let after = file.metadata()?;
    if data.len() == first && after.len() > first as u64 && first < limit {
        file.take((limit - first) as u64).read_to_end(data)?;
        return file.metadata();
    }
    Ok(after)
}

enum ReadFailure {
    Cancelled,
    Io(io::Error),
}

/// Open flags for source files: never follow a symlink, never block on a
/// FIFO swapped in after lstat.
fn libc_flags() -> i32 {
    (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::CLOEXEC)
        .bits() as i32
}

/// Counters of what the snapshot contains.
#[derive(Debug, Default)]
struct Stats {
    files: u64,
    directories: u64,
    other_entries: u64,
    total_bytes: u64,
    files_unchanged: u64,
    warning_count: u64,
    warnings: Vec<FileWarning>,
}

impl Stats {
    fn warn(&mut self, path: String, message: String) {
        self.warning_count += 1;
        if self.warnings.len() < MAX_RECORDED_WARNINGS {
            self.warnings.push(FileWarning { path, message });
        }
    }
}

/// Puts processed items back together into file entries and trees, and
/// feeds new blobs to the packer.
struct Assembler {
    shared: Arc<Shared>,
    packer: Packer,
    stats: Stats,
    /// Open directories, innermost last: each directory's entry and the
    /// children collected so far.
    directories: Vec<(Entry, Vec<Entry>)>,
    current_file: Option<Entry>,
    hardlink_content: HashMap<(u64, u64), Vec<Extent>>,
    /// Writes the backup's checkpoints, when it writes any.
    checkpoints: Option<CheckpointWriter>,
    /// Blobs assembled files name that a later item is to store: no
    /// checkpoint is written until they are in packs.
    unpacked: HashSet<BlobId>,
}

/// When and what a backup's checkpoints are.
struct CheckpointWriter {
    every: Duration,
    /// When the backup started: a checkpoint records the time since, so
    /// prune knows when it was written.
    started: Instant,
    /// When the last checkpoint was written (or the backup started).
    last: Instant,
    /// File bytes the last checkpoint held.
    bytes_at_last: u64,
    /// Bytes of the trees the last checkpoint stored (those of the open
    /// directories, rewritten whole by each checkpoint).
    tree_bytes_at_last: u64,
    /// The manifest of every checkpoint of this backup, but its tree and
    /// figures.
    template: Snapshot,
    /// The newest checkpoint this backup wrote.
    written: Option<ObjectId>,
}

impl Assembler {
    fn new(packer: Packer, shared: Arc<Shared>) -> Self {
        Assembler {
            packer,
            shared,
            stats: Stats::default(),
            directories: Vec::new(),
            current_file: None,
            hardlink_content: HashMap::new(),
            checkpoints: None,
            unpacked: HashSet::new(),
        }
    }

    /// Consume the pipeline; returns the root tree id.
    async fn run(
        &mut self,
        processed: impl futures::Stream<Item = Processed>,
        cancel: &CancellationToken,
    ) -> Result<Option<BlobId>, EngineError> {
        let mut processed = std::pin::pin!(processed);
        let mut root = None;
        loop {
            let next = tokio::select! {
                next = processed.next() => next,
                () = cancel.cancelled() => return Err(EngineError::Cancelled),
            };
            let Some(next) = next else { break };
            // Handling may wait for an upload slot; a cancel must not wait
            // for a slow or stalled upload to finish.
            let handled = tokio::select! {
                handled = self.handle(next) => handled?,
                () = cancel.cancelled() => return Err(EngineError::Cancelled),
            };
            if let Some(id) = handled {
                root = Some(id);
            }
            if self.checkpoint_due() {
                tokio::select! {
                    written = self.write_checkpoint() => written?,
                    () = cancel.cancelled() => return Err(EngineError::Cancelled),
                }
            }
        }
        Ok(root)
    }

    /// After a stop: store what was read (the open pack, and the index of
    /// every pack) and, for a backup that writes checkpoints, a last
    /// checkpoint holding it, within [`LAST_SAVE_WAIT`] and until
    /// `cancel`. Only a saving: a failure is logged.
    async fn save_after_stop(&mut self, cancel: &CancellationToken) {
        let checkpoint = self.checkpoint_worth_writing();
        let before = self.checkpoints.as_ref().and_then(|writer| writer.written);
        let save = async {
            if checkpoint {
                self.write_checkpoint().await
            } else {
                self.packer.settle().await
            }
        };
        let saved = tokio::select! {
            saved = tokio::time::timeout(LAST_SAVE_WAIT, save) => saved,
            () = cancel.cancelled() => return,
        };
        match saved {
            Ok(Ok(())) => {
                if let Some(id) = self.checkpoints.as_ref().and_then(|writer| writer.written)
                    && Some(id) != before
                {
                    tracing::warn!(
                        checkpoint = %id,
                        files = self.stats.files,
                        bytes = self.held_bytes(),
                        "stopped: a last checkpoint holds what was read; the next backup of this source goes on from there"
                    );
                }
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "stopped: what was read since the last checkpoint is not stored");
            }
            Err(_) => tracing::warn!(
                "stopped: storing what was read took longer than {} s; the uploads in flight are aborted",
                LAST_SAVE_WAIT.as_secs()
            ),
        }
    }

    /// Whether it is time for a checkpoint and one is worth writing.
    fn checkpoint_due(&self) -> bool {
        self.checkpoint_worth_writing()
            && self
                .checkpoints
                .as_ref()
                .is_some_and(|writer| writer.last.elapsed() >= writer.every)
    }

    /// Whether a checkpoint can be written now (every blob it would name
    /// stored or being stored by this backup's packer) and is worth it
    /// ([`checkpoint_worth_its_trees`]).
    fn checkpoint_worth_writing(&self) -> bool {
        self.checkpoints.as_ref().is_some_and(|writer| {
            !self.directories.is_empty()
                && self.unpacked.is_empty()
                && checkpoint_worth_its_trees(
                    self.held_bytes(),
                    writer.bytes_at_last,
                    writer.tree_bytes_at_last,
                )
        })
    }

    /// File bytes stored so far: finished files and the part of the file
    /// being read that is in chunks.
    fn held_bytes(&self) -> u64 {
        self.stats.total_bytes + self.current_file.as_ref().map_or(0, content_length)
    }

    /// Store what the backup holds so far as a checkpoint: the trees of the
    /// open directories with the entries finished in them and, last in the
    /// innermost, the file being read with the chunks it has so far (its
    /// size the whole file's: that its content is shorter is what tells a
    /// part), every pack they need uploaded and indexed, then the manifest;
    /// the backup's previous checkpoint is deleted.
    async fn write_checkpoint(&mut self) -> Result<(), EngineError> {
        let mut inner: Option<Entry> = self
            .current_file
            .as_ref()
            .filter(|file| !file.content.is_empty())
            .cloned();
        let mut root = None;
        let mut tree_bytes = 0u64;
        for level in (0..self.directories.len()).rev() {
            // The open directory below is this one's last entry for the
            // moment of encoding; names are in order, so it sorts last.
            let mut entries = std::mem::take(&mut self.directories[level].1);
            let pushed = inner.take().map(|entry| entries.push(entry)).is_some();
            // Encoded on the blocking pool, as every tree: a large
            // directory's takes a while.
            let (bytes, mut entries) = run_blocking(move || {
                let tree = Tree { entries };
                (tree.encode(), tree.entries)
            })
            .await;
            if pushed {
                entries.pop();
            }
            self.directories[level].1 = entries;
            tree_bytes += bytes.len() as u64;
            let id = self.store_tree_bytes(bytes).await?;
            let mut directory = self.directories[level].0.clone();
            directory.subtree = Some(id);
            inner = Some(directory);
            root = Some(id);
        }
        let Some(root) = root else { return Ok(()) };
        self.packer.settle().await?;
        let repository = self.packer.repository.clone();
        let files = self.stats.files;
        let total_bytes = self.held_bytes();
        let Some(writer) = self.checkpoints.as_mut() else {
            return Ok(());
        };
        let mut manifest = writer.template.clone();
        manifest.tree = root;
        manifest.summary.files = files;
        manifest.summary.total_bytes = total_bytes;
        manifest.summary.duration_seconds = writer.started.elapsed().as_secs_f64();
        writer.last = Instant::now();
        // Only a saving: a backup goes on without it.
        let id = match repository.write_checkpoint(&manifest).await {
            Ok(id) => id,
            Err(error) => {
                tracing::warn!(%error, "checkpoint not written; the backup goes on");
                return Ok(());
            }
        };
        tracing::debug!(checkpoint = %id, files, "checkpoint written");
        writer.bytes_at_last = total_bytes;
        writer.tree_bytes_at_last = tree_bytes;
        if let Some(previous) = writer.written.replace(id)
            && let Err(error) = repository
                .delete_checkpoint(&manifest.source, &manifest.hostname, &previous)
                .await
        {
            tracing::warn!(checkpoint = %previous, %error, "earlier checkpoint not deleted; the snapshot's backup deletes it");
        }
        Ok(())
    }

    async fn handle(&mut self, processed: Processed) -> Result<Option<BlobId>, EngineError> {
        let item = match processed {
            Processed::Chunk {
                id,
                raw_length,
                new_blob,
                _permit,
            } => {
                self.add_data_blob(id, raw_length, new_blob).await?;
                if let Some(file) = &mut self.current_file {
                    file.content.push(Extent::Chunk(id, raw_length));
                }
                return Ok(None);
            }
            Processed::File(read, _permit) => {
                let ReadFile {
                    entry,
                    chunks,
                    warning,
                } = *read;
                // The job filled `entry.content` (chunks and holes in file
                // order); only the new blobs go to the packs here.
                for (id, raw_length, new_blob) in chunks {
                    self.add_data_blob(id, raw_length, new_blob).await?;
                }
                self.finish_file(entry, warning);
                return Ok(None);
            }
            Processed::Item(item) => item,
        };
        match item {
            WalkItem::DirectoryStart(entry) => self.directories.push((entry, Vec::new())),
            WalkItem::DirectoryEnd { unchanged_tree } => {
                let (mut entry, children) = self
                    .directories
                    .pop()
                    .expect("walker emits balanced directory items");
                let id = match unchanged_tree {
                    Some(id) => id,
                    None => self.store_tree(Tree { entries: children }).await?,
                };
                entry.subtree = Some(id);
                self.stats.directories += 1;
                match self.directories.last_mut() {
                    Some((_, siblings)) => siblings.push(entry),
                    None => return Ok(Some(id)),
                }
            }
            WalkItem::FileStart(entry) => self.current_file = Some(entry),
            WalkItem::Chunk(..) | WalkItem::SmallChunk { .. } | WalkItem::SmallFile(..) => {
                unreachable!("chunks are processed before assembly")
            }
            WalkItem::Hole(length) => {
                if let Some(file) = &mut self.current_file {
                    push_hole(&mut file.content, length);
                }
            }
            WalkItem::FileEnd(warning) => {
                let file = self
                    .current_file
                    .take()
                    .expect("file end follows file start");
                self.finish_file(file, warning);
            }
            WalkItem::FileAborted(path, message) => {
                self.current_file = None;
                self.stats.warn(path, message);
            }
            WalkItem::Unchanged(entry) => {
                self.stats.files_unchanged += 1;
                if entry.links > 1 {
                    self.hardlink_content
                        .insert((entry.device, entry.inode), entry.content.clone());
                }
                self.push_file(entry);
            }
            WalkItem::HardlinkRepeat(mut entry) => {
                if let Some(content) = self.hardlink_content.get(&(entry.device, entry.inode)) {
                    entry.content = content.clone();
                    entry.size = content.iter().map(Extent::length).sum();
                    self.push_file(entry);
                } else {
                    // The first link was skipped with a warning; so is this one.
                    let name = String::from_utf8_lossy(&entry.name).into_owned();
                    self.stats.warn(
                        name,
                        "hard link to a file that could not be read, skipped".into(),
                    );
                }
            }
            WalkItem::Leaf(entry) => {
                self.stats.other_entries += 1;
                self.push_child(entry);
            }
            WalkItem::Warning(path, message) => self.stats.warn(path, message),
        }
        Ok(None)
    }

    /// A chunk a file names: into a pack when this file stores it; else
    /// noted while another item, not assembled yet, is to store it.
    async fn add_data_blob(
        &mut self,
        id: BlobId,
        raw_length: u32,
        new_blob: Option<NewBlob>,
    ) -> Result<(), EngineError> {
        match new_blob {
            Some(blob) => {
                self.packer
                    .add(id, BlobKind::Data, &blob, raw_length)
                    .await?;
                self.shared.buffers.give(blob.body);
                self.shared.packed(&id);
                self.unpacked.remove(&id);
            }
            None if self.shared.is_pending(&id) => {
                self.unpacked.insert(id);
            }
            None => {}
        }
        Ok(())
    }

    /// A file read to its end: its size from its extents, its warning,
    /// its content remembered for later hard links to it.
    fn finish_file(&mut self, mut file: Entry, warning: Option<(String, String)>) {
        file.size = file.content.iter().map(Extent::length).sum();
        if let Some((path, message)) = warning {
            self.stats.warn(path, message);
        }
        if file.links > 1 {
            self.hardlink_content
                .insert((file.device, file.inode), file.content.clone());
        }
        self.push_file(file);
    }

    fn push_file(&mut self, file: Entry) {
        self.stats.files += 1;
        self.stats.total_bytes += file.size;
        self.push_child(file);
    }

    fn push_child(&mut self, entry: Entry) {
        if let Some((_, children)) = self.directories.last_mut() {
            children.push(entry);
        }
    }

    async fn store_tree(&mut self, tree: Tree) -> Result<BlobId, EngineError> {
        let repository = self.packer.repository.clone();
        let shared = self.shared.clone();
        let (id, raw_length, new_blob) =
            run_blocking(move || tree_blob(&repository, &shared, tree.encode())).await;
        self.add_tree_blob(id, raw_length, new_blob).await
    }

    /// Store an encoded tree.
    async fn store_tree_bytes(&mut self, bytes: Vec<u8>) -> Result<BlobId, EngineError> {
        let repository = self.packer.repository.clone();
        let shared = self.shared.clone();
        let (id, raw_length, new_blob) =
            run_blocking(move || tree_blob(&repository, &shared, bytes)).await;
        self.add_tree_blob(id, raw_length, new_blob).await
    }

    async fn add_tree_blob(
        &mut self,
        id: BlobId,
        raw_length: u32,
        new_blob: Option<NewBlob>,
    ) -> Result<BlobId, EngineError> {
        if let Some(blob) = new_blob {
            self.packer
                .add(id, BlobKind::Tree, &blob, raw_length)
                .await?;
            self.shared.packed(&id);
        }
        Ok(id)
    }
}

/// A tree's id, length and, unless this backup stored it already, its blob.
fn tree_blob(
    repository: &Repository,
    shared: &Shared,
    bytes: Vec<u8>,
) -> (BlobId, u32, Option<NewBlob>) {
    let id = repository.keys().blob_id(&bytes);
    let raw_length = bytes.len() as u32;
    let new_blob = shared
        .claim(&id)
        .then(|| NewBlob::encode(repository, None, BlobKind::Tree, &id, bytes, 3));
    (id, raw_length, new_blob)
}

/// The bytes of a file its extents hold.
fn content_length(entry: &Entry) -> u64 {
    entry.content.iter().map(Extent::length).sum()
}

/// The buffer of a tree pack: its target and the trailer.
fn tree_pack_buffer_bytes(sizes: &BackupBuffers) -> usize {
    sizes.tree_pack_target_bytes + PACK_TRAILER_ROOM
}

/// A pack stored: its id, its blobs and its buffer, when the store let go
/// of it ([`Repository::upload_pack_keeping_buffer`]).
type UploadedPack = (ObjectId, Vec<PackEntry>, Option<Vec<u8>>);

/// Collects blobs into packs and uploads them, a bounded number at a time:
/// data blobs and tree blobs into packs of their own. Trees go into packs
/// of their own (as restic's do): a restore loads a directory's subtrees
/// together, and in packs of their own they lie side by side, one read for
/// many; mixed in with the data, each tree sat after its directory's
/// files, megabytes from the next, and took a request of its own (about
/// 180 of the 246 GETs of a 2 GiB restore). Tree packs are small (4 MiB
/// with the default share), so their buffer costs little memory; a tree
/// blob is at most a few MiB, so one may pass the target.
struct Packer {
    repository: Repository,
    progress: Arc<Progress>,
    /// Sizes from the engine's memory share.
    sizes: BackupBuffers,
    /// The data pack being filled.
    current: PackWriter,
    /// The tree pack being filled.
    trees: PackWriter,
    uploads: JoinSet<Result<UploadedPack, EngineError>>,
    /// Stored packs not yet named by an index file.
    unindexed: Vec<(ObjectId, Vec<PackEntry>)>,
    bytes_new: u64,
    bytes_stored: u64,
    packs_written: u64,
}

impl Packer {
    fn new(repository: Repository, progress: Arc<Progress>, sizes: &BackupBuffers) -> Self {
        Packer {
            current: repository.pack_writer(sizes.data_pack_buffer_bytes),
            trees: repository.pack_writer(tree_pack_buffer_bytes(sizes)),
            sizes: *sizes,
            repository,
            progress,
            uploads: JoinSet::new(),
            unindexed: Vec::new(),
            bytes_new: 0,
            bytes_stored: 0,
            packs_written: 0,
        }
    }

    /// The pack being filled with blobs of `kind`.
    fn filling(&mut self, kind: BlobKind) -> &mut PackWriter {
        match kind {
            BlobKind::Tree => &mut self.trees,
            BlobKind::Data => &mut self.current,
        }
    }

    /// The size at which a pack of `kind` closes.
    fn target_bytes(&self, kind: BlobKind) -> usize {
        match kind {
            BlobKind::Tree => self.sizes.tree_pack_target_bytes,
            BlobKind::Data => self.sizes.data_pack_target_bytes,
        }
    }

    /// An empty pack for blobs of `kind`, its buffer sized for its target:
    /// a data pack's `spare`, the buffer of the pack just stored, when it
    /// is large enough (a tree pack's is not).
    fn new_writer(&self, kind: BlobKind, spare: Option<Vec<u8>>) -> PackWriter {
        match kind {
            BlobKind::Tree => self
                .repository
                .pack_writer(tree_pack_buffer_bytes(&self.sizes)),
            BlobKind::Data => {
                let capacity = self.sizes.data_pack_buffer_bytes;
                match spare.filter(|buffer| buffer.capacity() >= capacity) {
                    Some(buffer) => self.repository.pack_writer_in(buffer),
                    None => self.repository.pack_writer(capacity),
                }
            }
        }
    }

    async fn add(
        &mut self,
        id: BlobId,
        kind: BlobKind,
        blob: &NewBlob,
        raw_length: u32,
    ) -> Result<(), EngineError> {
        let stored = blob.stored_length() as u64;
        self.bytes_new += u64::from(raw_length);
        self.bytes_stored += stored;
        Progress::add(&self.progress.bytes_new, u64::from(raw_length));
        Progress::add(&self.progress.bytes_stored, stored);
        let target = self.target_bytes(kind);
        // A data pack closes once it reaches its target, so with the
        // default share its buffer (the target, a largest chunk and the
        // trailer) always has room for the next blob; with a small share
        // it has none past the target, and the pack closes before a blob
        // that would not fit rather than let its buffer grow.
        let blob_bytes = blob.prefix.as_bytes().len() + blob.body.len();
        if kind == BlobKind::Data
            && !self.filling(kind).is_empty()
            && self.filling(kind).len() + blob_bytes + PACK_TRAILER_ROOM
                > self.sizes.data_pack_buffer_bytes
        {
            self.flush(kind).await?;
        }
        let writer = self.filling(kind);
        writer.add_parts(
            id,
            kind,
            blob.compression,
            &[blob.prefix.as_bytes(), &blob.body],
            raw_length,
        );
        if writer.len() >= target {
            self.flush(kind).await?;
        }
        Ok(())
    }

    /// Upload the pack of `kind` being filled, if it holds anything.
    async fn flush(&mut self, kind: BlobKind) -> Result<(), EngineError> {
        if self.filling(kind).is_empty() {
            return Ok(());
        }
        // The buffer of the pack stored last goes to the pack that starts
        // now, and only to it: held idle while another fills, it would be
        // one buffer more in memory.
        let mut spare = None;
        while self.uploads.len() >= self.sizes.pack_uploads {
            spare = self.collect_one().await?;
        }
        let fresh = self.new_writer(kind, spare);
        let writer = std::mem::replace(self.filling(kind), fresh);
        let repository = self.repository.clone();
        self.uploads
            .spawn(async move { repository.upload_pack_keeping_buffer(writer, "pack").await });
        Ok(())
    }

    /// Wait for the first upload in flight to end and note its pack; returns its
    /// buffer, when the store let go of it.
    async fn collect_one(&mut self) -> Result<Option<Vec<u8>>, EngineError> {
        let Some(result) = self.uploads.join_next().await else {
            return Ok(None);
        };
        let (id, entries, buffer) =
            result.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))?;
        tracing::debug!(pack = %id, blobs = entries.len(), "pack uploaded");
        self.packs_written += 1;
        self.unindexed.push((id, entries));
        let blobs: usize = self
            .unindexed
            .iter()
            .map(|(_, entries)| entries.len())
            .sum();
        if self.unindexed.len() >= INDEX_CHECKPOINT_PACKS || blobs >= MAX_BLOBS_PER_INDEX_FILE {
            let packs = std::mem::take(&mut self.unindexed);
            self.repository.write_index(packs).await?;
        }
        Ok(buffer)
    }

    /// Cancel the uploads in flight and wait until they are gone and the
    /// store has cleaned up after them (aborted multipart uploads). Packs
    /// already stored stay: the next backup adopts them from their trailers.
    async fn abandon(&mut self) {
        self.uploads.abort_all();
        while self.uploads.join_next().await.is_some() {}
        self.repository.store().wait_for_cleanup().await;
    }

    /// Upload the packs being filled, wait for every upload and index them
    /// all: after this, everything added so far is in the repository.
    async fn settle(&mut self) -> Result<(), EngineError> {
        let unindexed = self.finish().await?;
        if !unindexed.is_empty() {
            self.repository.write_index(unindexed).await?;
        }
        Ok(())
    }

    /// Upload what is left and wait for every upload; returns the packs
    /// that still need an index entry.
    async fn finish(&mut self) -> Result<Vec<(ObjectId, Vec<PackEntry>)>, EngineError> {
        self.flush(BlobKind::Data).await?;
        self.flush(BlobKind::Tree).await?;
        while !self.uploads.is_empty() {
            self.collect_one().await?;
        }
        Ok(std::mem::take(&mut self.unindexed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngCore;

    fn compressor() -> zstd::bulk::Compressor<'static> {
        zstd::bulk::Compressor::new(DEFAULT_COMPRESSION_LEVEL).unwrap()
    }

    fn scratch() -> Vec<u8> {
        Vec::with_capacity(zstd::zstd_safe::compress_bound(SAMPLED_CHUNK_BYTES))
    }

    /// A small file of `bytes` bytes in `directory`, as the walker hands
    /// it on.
    fn small_file(directory: &Path, index: usize, bytes: usize) -> WalkItem {
        let path = directory.join(format!("f{index}"));
        fs::write(&path, vec![b'x'; bytes]).unwrap();
        let file = File::open(&path).unwrap();
        let before = file.metadata().unwrap();
        let permits = Arc::new(Semaphore::new(1 << 20));
        let permit = |count| permits.clone().try_acquire_many_owned(count).unwrap();
        let small = SmallFile {
            entry: entry_from_metadata(b"f", EntryKind::File, &before),
            file,
            open_file: permit(1),
            before,
            relative: PathBuf::from(format!("f{index}")),
        };
        WalkItem::SmallFile(Box::new(small), permit(1))
    }

    /// The jobs' shapes: the number of files of each run, 0 for an item.
    fn shapes(jobs: &[Job]) -> Vec<usize> {
        jobs.iter()
            .map(|job| match job {
                Job::SmallFiles(files, _) => files.len(),
                Job::Chunk(..) | Job::Done(_) => 0,
            })
            .collect()
    }

    #[test]
    fn consecutive_small_files_go_to_one_job_up_to_its_files_and_bytes() {
        let directory = tempfile::tempdir().unwrap();
        let mut batch: Vec<WalkItem> = (0..SMALL_FILES_PER_JOB + 3)
            .map(|index| small_file(directory.path(), index, 100))
            .collect();
        batch.push(WalkItem::DirectoryEnd {
            unchanged_tree: None,
        });
        batch.push(small_file(directory.path(), 100, 100));
        let large = SMALL_FILE_BYTES_PER_JOB as usize / 2 + 1;
        batch.push(small_file(directory.path(), 101, large));
        batch.push(small_file(directory.path(), 102, large));
        let jobs = jobs_of(batch);
        assert_eq!(shapes(&jobs), vec![SMALL_FILES_PER_JOB, 3, 0, 2, 1]);
        // In walk order.
        let Job::SmallFiles(first, _) = &jobs[0] else {
            unreachable!()
        };
        let names: Vec<_> = first.iter().map(|(small, _)| &small.relative).collect();
        let expected: Vec<_> = (0..SMALL_FILES_PER_JOB)
            .map(|index| PathBuf::from(format!("f{index}")))
            .collect();
        assert_eq!(names, expected.iter().collect::<Vec<_>>());
    }

    #[test]
    fn a_small_file_that_grew_or_shrank_since_the_walker_looked_is_read_to_its_end() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("file");
        let content: Vec<u8> = (0..5000u32).map(|index| index as u8).collect();
        fs::write(&path, &content).unwrap();
        let file = File::open(&path).unwrap();
        for expected in [0, 100, 4999, 5000, 9000] {
            rustix::fs::seek(&file, rustix::fs::SeekFrom::Start(0)).unwrap();
            let mut data = Vec::with_capacity(expected + 1);
            let after = read_whole(&file, &mut data, expected, 1 << 20).unwrap();
            assert_eq!(data, content, "expected {expected} bytes");
            assert_eq!(after.len(), 5000);
        }
        // Never beyond the limit.
        rustix::fs::seek(&file, rustix::fs::SeekFrom::Start(0)).unwrap();
        let mut data = Vec::new();
        read_whole(&file, &mut data, 100, 1000).unwrap();
        assert_eq!(data, content[..1000]);
    }

    #[test]
    fn a_batch_goes_on_when_its_items_hold_too_much_memory() {
        // An unchanged 10 GiB file: about 10,240 chunks in its content list.
        let mut large = Entry::new(b"large", EntryKind::File);
        large.content = vec![Extent::Chunk(BlobId([7; 32]), 1 << 20); 10_240];
        let held = held_bytes(&WalkItem::Unchanged(large));
        assert!(held >= 10_240 * 36, "{held}");
        let small = held_bytes(&WalkItem::Unchanged(Entry::new(b"small", EntryKind::File)));
        // A batch holding it goes on at once; one of small entries waits.
        assert!(batch_is_full(1, 0, held));
        assert!(!batch_is_full(2, 0, 2 * small));
        assert!(batch_is_full(WALK_BATCH_ITEMS, 0, 0));
        assert!(batch_is_full(3, WALK_BATCH_FILE_BYTES, 0));
        assert!(!batch_is_full(
            WALK_BATCH_ITEMS - 1,
            WALK_BATCH_FILE_BYTES - 1,
            0
        ));
    }

    #[test]
    fn an_entry_looked_up_in_its_directory_is_the_entry_its_path_gives() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::write(root.join("file"), b"some content").unwrap();
        // A modification time apart from the change time, so a field taken
        // for the other shows.
        File::options()
            .write(true)
            .open(root.join("file"))
            .unwrap()
            .set_modified(std::time::UNIX_EPOCH + std::time::Duration::new(1_000_000_000, 5))
            .unwrap();
        fs::hard_link(root.join("file"), root.join("link")).unwrap();
        fs::create_dir(root.join("sub")).unwrap();
        std::os::unix::fs::symlink("file", root.join("symlink")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("fifo").as_path(),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o640),
            0,
        )
        .unwrap();
        let directory = open_directory(root).expect("a directory opens as O_PATH");
        for name in ["file", "link", "sub", "symlink", "fifo"] {
            let path = root.join(name);
            let metadata = fs::symlink_metadata(&path).unwrap();
            let by_path =
                entry_from_metadata(name.as_bytes(), kind_of_mode(metadata.mode()), &metadata);
            let relative = lstat_entry(Some(&directory), OsStr::new(name), &path).unwrap();
            assert_eq!(relative, by_path, "{name}");
            let without_descriptor = lstat_entry(None, OsStr::new(name), &path).unwrap();
            assert_eq!(without_descriptor, by_path, "{name}");
        }
        assert!(lstat_entry(Some(&directory), OsStr::new("gone"), &root.join("gone")).is_err());
    }

    fn manifest(time: &str, files: u64, bytes: u64) -> Snapshot {
        Snapshot {
            format_version: 2,
            time: time.to_string(),
            hostname: "host".into(),
            source: "/data".into(),
            tree: BlobId([1; 32]),
            root: RootAttributes::default(),
            parent: None,
            tags: BTreeMap::new(),
            claim: None,
            summary: SnapshotSummary {
                files,
                total_bytes: bytes,
                ..SnapshotSummary::default()
            },
        }
    }

    #[test]
    fn a_checkpoint_waits_for_eight_times_the_trees_the_last_one_stored() {
        // Small trees: any progress is worth a checkpoint.
        assert!(checkpoint_worth_its_trees(1, 0, 0));
        assert!(checkpoint_worth_its_trees(100 << 20, (100 << 20) - 1, 0));
        assert!(!checkpoint_worth_its_trees(5 << 20, 5 << 20, 4 << 10));
        assert!(checkpoint_worth_its_trees(
            (5 << 20) + (32 << 10) + 1,
            5 << 20,
            4 << 10
        ));
        // A flat directory whose tree was 100 MB: the next checkpoint only
        // after 800 MB more were read.
        let tree = 100_000_000;
        assert!(!checkpoint_worth_its_trees(
            1_000_000_000 + 8 * tree,
            1_000_000_000,
            tree
        ));
        assert!(checkpoint_worth_its_trees(
            1_000_000_001 + 8 * tree,
            1_000_000_000,
            tree
        ));
        assert!(!checkpoint_worth_its_trees(
            u64::MAX,
            u64::MAX - 1,
            u64::MAX
        ));
    }

    #[test]
    fn only_a_first_backup_that_may_skip_files_writes_and_uses_checkpoints() {
        let options = BackupOptions::new("/data");
        let parent = (
            ObjectId::of(b"parent"),
            manifest("2026-12-04T10:00:00Z", 1, 1),
        );
        assert!(checkpointed(&options, None));
        assert!(!checkpointed(&options, Some(&parent)));
        let reads_everything = BackupOptions {
            parent: ParentPolicy::None,
            ..options.clone()
        };
        assert!(!checkpointed(&reads_everything, None));
        let sample = BackupOptions {
            only: Some(Arc::new(Selection::of_files([PathBuf::from("a")]))),
            ..options
        };
        assert!(!checkpointed(&sample, None));
    }

    #[test]
    fn the_checkpoint_that_got_furthest_is_the_one_continued_from() {
        assert_eq!(resumable(&[]), None);
        let checkpoints = [
            (
                ObjectId::of(b"a"),
                manifest("2026-12-04T10:00:00Z", 900, 10 << 20),
            ),
            // Later, but a run killed again before it got as far.
            (
                ObjectId::of(b"b"),
                manifest("2026-12-04T11:00:00Z", 10, 1 << 20),
            ),
            // Fewer files, more bytes: the first part of a large file.
            (
                ObjectId::of(b"c"),
                manifest("2026-12-04T10:30:00Z", 899, 900 << 20),
            ),
        ];
        assert_eq!(
            resumable(&checkpoints).map(|(id, _)| *id),
            Some(ObjectId::of(b"c"))
        );
    }

    #[test]
    fn random_data_is_judged_incompressible_from_its_samples() {
        let mut data = vec![0u8; 1024 * 1024];
        rand::rng().fill_bytes(&mut data);
        assert!(!samples_compress(&mut compressor(), &data, &mut scratch()));
        let (compression, stored) = compress(data.clone(), DEFAULT_COMPRESSION_LEVEL);
        assert_eq!(compression, Compression::None);
        assert_eq!(stored, data);
    }

    #[test]
    fn text_is_judged_compressible_and_compressed() {
        let data: Vec<u8> = (0..1024 * 1024 / 64)
            .flat_map(|line| {
                format!("{line:08} INFO request served in 12 ms from cache\n").into_bytes()
            })
            .collect();
        assert!(samples_compress(&mut compressor(), &data, &mut scratch()));
        let (compression, stored) = compress(data.clone(), DEFAULT_COMPRESSION_LEVEL);
        assert_eq!(compression, Compression::Zstd);
        assert!(stored.len() < data.len() / 4);
    }

    #[test]
    fn a_chunk_compressible_only_at_its_samples_is_compressed_and_one_random_there_is_stored() {
        // The samples decide: text at start, middle and end wins even if
        // the rest is random; random there loses even if the rest is text.
        let text = |length: usize| -> Vec<u8> {
            b"0123456789abcdef"
                .iter()
                .copied()
                .cycle()
                .take(length)
                .collect()
        };
        let length = 1024 * 1024;
        let mut random = vec![0u8; length];
        rand::rng().fill_bytes(&mut random);
        let mut mostly_random = random.clone();
        let middle = length / 2 - SAMPLE_BYTES / 2;
        for start in [0, middle, length - SAMPLE_BYTES] {
            mostly_random[start..start + SAMPLE_BYTES].copy_from_slice(&text(SAMPLE_BYTES));
        }
        assert!(samples_compress(
            &mut compressor(),
            &mostly_random,
            &mut scratch()
        ));
        let mut mostly_text = text(length);
        for start in [0, middle, length - SAMPLE_BYTES] {
            mostly_text[start..start + SAMPLE_BYTES]
                .copy_from_slice(&random[start..start + SAMPLE_BYTES]);
        }
        assert!(!samples_compress(
            &mut compressor(),
            &mostly_text,
            &mut scratch()
        ));
        assert_eq!(
            compress(mostly_text, DEFAULT_COMPRESSION_LEVEL).0,
            Compression::None
        );
    }

    fn out_of_open_files_error() -> io::Error {
        io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error())
    }

    /// The retry of an open that never gets a descriptor, within 60 s,
    /// with `wait` between tries.
    fn never_a_descriptor(
        path: &str,
        wait: impl FnMut(Duration) -> Result<Duration, EngineError>,
    ) -> Result<io::Result<()>, EngineError> {
        retry_while_out_of_open_files(
            Path::new(path),
            Duration::from_secs(60),
            || Err(out_of_open_files_error()),
            wait,
        )
    }

    #[test]
    fn an_open_without_descriptors_is_tried_again_until_one_is_free() {
        let mut failures_left = 3;
        let mut pauses = Vec::new();
        let opened = retry_while_out_of_open_files(
            Path::new("/data/f"),
            Duration::from_secs(60),
            || {
                if failures_left == 0 {
                    return Ok("open");
                }
                failures_left -= 1;
                Err(out_of_open_files_error())
            },
            |pause| {
                pauses.push(pause);
                Ok(pause)
            },
        );
        assert_eq!(opened.unwrap().unwrap(), "open");
        assert_eq!(
            pauses,
            [1, 2, 4].map(Duration::from_millis).to_vec(),
            "a pause between tries, doubling"
        );
        // The system's limit (ENFILE) too.
        let mut failed = false;
        let opened = retry_while_out_of_open_files(
            Path::new("/data/f"),
            Duration::from_secs(60),
            || {
                if std::mem::replace(&mut failed, true) {
                    Ok(())
                } else {
                    Err(io::Error::from_raw_os_error(
                        rustix::io::Errno::NFILE.raw_os_error(),
                    ))
                }
            },
            Ok,
        );
        assert!(opened.unwrap().is_ok());
    }

    #[test]
    fn a_backup_out_of_descriptors_for_its_patience_stops_naming_the_file_and_the_remedy() {
        let mut waited = Duration::ZERO;
        let error = never_a_descriptor("/data/d/f", |pause| {
            waited += pause;
            Ok(pause)
        })
        .unwrap_err();
        assert!(waited >= Duration::from_secs(60), "{waited:?}");
        assert!(waited < Duration::from_secs(61), "{waited:?}");
        let message = error.to_string();
        assert!(
            matches!(&error, EngineError::OutOfOpenFiles { path, waited_seconds: 60, .. }
                if path == Path::new("/data/d/f")),
            "{error:?}"
        );
        for part in [
            "/data/d/f",
            // `ulimit -n`, or `ulimit -Hn` at the hard limit: the limits
            // this test runs under decide which.
            "ulimit -",
            "fewer volumes",
            "run the backup again",
        ] {
            assert!(message.contains(part), "{part:?} not in: {message}");
        }
    }

    #[test]
    fn the_patience_counts_the_time_each_wait_took_and_the_remedy_names_whose_limit() {
        // Waits that take 25 s each (a flush blocked on a full pipeline):
        // three, not the 60 s of 1 ms pauses.
        let mut waits = 0;
        let error = never_a_descriptor("/data/f", |_| {
            waits += 1;
            Ok(Duration::from_secs(25))
        })
        .unwrap_err();
        assert_eq!(waits, 3);
        assert!(
            matches!(
                error,
                EngineError::OutOfOpenFiles {
                    waited_seconds: 75,
                    ..
                }
            ),
            "{error:?}"
        );
        let at_hard = out_of_descriptors_remedy(&out_of_open_files_error(), (1_024, 1_024));
        assert!(at_hard.contains("limit of 1024 open files"), "{at_hard}");
        assert!(at_hard.contains("hard limit"), "{at_hard}");
        assert!(at_hard.contains("ulimit -Hn"), "{at_hard}");
        let below_hard = out_of_descriptors_remedy(&out_of_open_files_error(), (65_536, 1 << 20));
        assert!(below_hard.contains("hard limit is 1048576"), "{below_hard}");
        assert!(below_hard.contains("higher `ulimit -n`"), "{below_hard}");
        let unlimited = out_of_descriptors_remedy(&out_of_open_files_error(), (u64::MAX, u64::MAX));
        assert!(!unlimited.contains(&u64::MAX.to_string()), "{unlimited}");
        let system = out_of_descriptors_remedy(
            &io::Error::from_raw_os_error(rustix::io::Errno::NFILE.raw_os_error()),
            (1_024, 1_024),
        );
        assert!(system.contains("fs.file-max"), "{system}");
        assert!(!system.contains("ulimit"), "{system}");
        for remedy in [at_hard, below_hard, unlimited, system] {
            assert!(remedy.contains("maxConcurrentVolumes"), "{remedy}");
        }
    }

    #[test]
    fn other_open_errors_are_returned_at_once_and_a_cancel_stops_the_wait() {
        let mut waits = 0;
        let opened = retry_while_out_of_open_files(
            Path::new("/data/f"),
            Duration::from_secs(60),
            || Err::<(), _>(io::Error::from(io::ErrorKind::PermissionDenied)),
            |pause| {
                waits += 1;
                Ok(pause)
            },
        );
        assert_eq!(
            opened.unwrap().unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert_eq!(waits, 0);
        let stopped = never_a_descriptor("/data/f", |_| Err(EngineError::Cancelled));
        assert!(matches!(stopped, Err(EngineError::Cancelled)));
    }
}
