//! Restore of a snapshot into a target directory.
//!
//! The snapshot is untrusted input. Every name is checked to be one path
//! component; every file and directory is created relative to an open
//! directory descriptor with `O_NOFOLLOW`, so nothing is written outside
//! the target or through a symlink the restore did not create; symlinks are
//! created after all files, hard links only point at files this restore
//! created, and setuid/setgid bits are applied after chown. Every chunk's
//! BLAKE3 is checked before its bytes reach disk; a file whose data is
//! damaged is removed and reported while the rest is restored.
//!
//! `sync` mode updates a target that already holds an earlier copy: files
//! whose content and metadata already match are not written at all, only
//! differing chunks of a changed file are rewritten, and entries that are
//! not in the snapshot are removed (as rsync `--delete` would).
//!
//! How the data moves. A walker goes through the snapshot's trees in order,
//! creates directories (and FIFOs, devices), defers symlinks and hard links,
//! and collects regular files into batches (at most [`MAX_BATCH_FILES`]
//! files, [`MAX_BATCH_CHUNKS`] chunks, and as many directories as the
//! open-file limit lets it hold open, [`BatchDirectories`]). For each
//! batch, the chunks its files need are found (in `sync` mode by comparing
//! each existing file with the snapshot, in parallel), and
//! [`plan::plan_pack_reads`] turns them into pack reads: each pack once, in
//! few large ranges, each blob once with every file offset it goes to. The
//! reads are fetched a few at a time within [`PACK_BYTES_IN_FLIGHT`], and
//! scatter workers (one per core) decode and check each blob once and write
//! it to every offset that needs it; the
//! worker that writes a file's last chunk sets its size and attributes and
//! closes it. So a pack is read once whether its blobs belong to one file or
//! to a thousand, and small files cost the same per byte as large ones:
//! neither a request nor a task per file. The walker gets each
//! directory's subtrees in windows of neighbouring trees, cut from a pack
//! of trees read whole once ([`TreePacks`]) or read in ranges where it
//! cannot be held, and the windows of the directories it will enter next
//! are loaded ahead of it, several at once ([`lookahead`]), so that a tree
//! of many small directories does not wait a round trip to the store per
//! directory.
//! Memory stays within the engine's share ([`EngineMemory`]) whatever the
//! snapshot's size.

mod lookahead;
mod plan;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use futures::StreamExt;
use rustix::fs::{AtFlags, Mode, OFlags, Timestamps};
use rustix::io::Errno;
use serde::Serialize;
use serde_bytes::ByteBuf;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use self::plan::{
    BatchedRead, ChunkNeed, PlanLimits, PlannedBlob, ReadPlan, ScheduledReads, Target, Unrestorable,
};
use super::EngineError;
use super::descriptors::{self, DescriptorBudget, RestoreShare};
use super::memory::{EngineMemory, RestoreBuffers};
use super::progress::Progress;
use super::repository::Repository;
use super::scan;
use super::since::{
    ChangeMark, SinceCheck, SinceDirectory, SinceSubdirectory, on_disk_as_restored, since_root,
};
use super::throttle::Throttle;
use super::tree_cache::TreeCache;
use super::tree_packs::TreePacks;
use crate::repo::index::BlobIndex;
use crate::repo::snapshot::Snapshot;
use crate::repo::tree::{Entry, EntryKind, Extent, Tree, validate_name};
use crate::repo::{self, ObjectId};
use crate::store::ranges::DEFAULT_COALESCE_GAP_BYTES;
use crate::store::{FailureCause, StoreError};

const MIB: u64 = 1024 * 1024;

/// Longest single pack read with the default memory share: a pack of the
/// default size (16 MiB, closed after the chunk that reaches it, so at most
/// 4 MiB more, and its trailer) comes in one request. Larger packs, and
/// every pack under a smaller share, are read in several.
pub(crate) const MAX_PACK_READ_BYTES: u64 = 21 * MIB;
/// Capacity of all pack read buffers together with the default share: two
/// default packs, one arriving while the other is decoded and written
/// ([`EngineMemory`] gives the figures of a smaller share). The buffers are
/// kept and reused for the whole restore (a buffer per read, freed by
/// whichever worker finished with it, left up to twice this cached by the
/// allocator), so this bounds both the bytes in flight and what they cost
/// in memory. It is the largest share of the budget, and what a faster
/// network would want more of.
pub(crate) const PACK_BYTES_IN_FLIGHT: u64 = 2 * MAX_PACK_READ_BYTES;
/// Pack reads requested at once (within the pack bytes in flight): enough
/// to hide a request's latency when reads are small (a `sync` restore's
/// scattered chunks).
const PACK_READS_IN_FLIGHT: usize = 4;
/// Plaintext buffers of all scatter workers together with the default
/// share: each holds one chunk at a time, so the workers are at most this
/// divided by the repository's largest chunk (4 MiB by default: 4 workers).
pub(crate) const DECODE_BUFFER_BYTES: u64 = 16 * MIB;
/// Scatter workers at most; fewer on a machine (or a container quota) with
/// fewer cores: they are CPU-bound (decompress, hash, copy into the page
/// cache).
const MAX_SCATTER_WORKERS: usize = 4;
/// Plaintext written by one scatter job: a read is cut into jobs of about
/// this size so that all workers share one pack's blobs.
const SCATTER_JOB_BYTES: u64 = 4 * MIB;
/// Scatter jobs queued for the workers beyond those they are running.
const SCATTER_JOBS_QUEUED: usize = 4;
/// Files, chunks and directories of one batch with the default share (a
/// smaller one batches fewer files and chunks). A batch costs about 350
/// bytes per file (its entry and write state) and 300 per chunk while it is
/// planned (the plan's maps), and keeps a descriptor open per directory;
/// up to [`descriptors::MAX_BATCHES_ALIVE`] batches are alive at once, one
/// of them planned at a time, together within [`BATCH_BOOKKEEPING_BYTES`]. Larger batches
/// split fewer packs between two of them but cost more than they save: at
/// 16,384 files a restore of 200,000 small files peaked at 171-187 MiB, at
/// 4,096 at 93 MiB (docs/benchmarks.md).
pub(crate) const MAX_BATCH_FILES: usize = 4_096;
/// See [`MAX_BATCH_FILES`].
pub(crate) const MAX_BATCH_CHUNKS: usize = 16_384;
/// Most directories of one batch, as a share of its files: one per four.
/// Each costs a descriptor and its path (about 300 bytes for a path five
/// deep), which the estimate of [`BATCH_BOOKKEEPING_BYTES`] leaves room
/// for at this share. A deep tree of 11,111 directories and 30,000 files
/// then comes in about 11 batches of 1,024 directories rather than 87 of
/// 128, each reading its own ranges of the same packs (docs/benchmarks.md).
const FILES_PER_BATCH_DIRECTORY: usize = 4;
/// Memory of the batches alive at once (see [`MAX_BATCH_FILES`]).
pub(crate) const BATCH_BOOKKEEPING_BYTES: u64 = 24 * MIB;
/// Encoded bytes of the subtrees one directory level loads at once (at
/// least one tree): neighbouring tree blobs come in one request, and a
/// walk holds at most this much of loaded trees per level of depth.
pub(crate) const TREE_PREFETCH_BYTES: u64 = MIB;
/// Raw bytes of the subtree windows loaded ahead of the walk with the
/// default share ([`lookahead`]): the windows of many directories, so
/// that a walk through a tree of many small directories waits for a
/// round trip to the store now and then rather than at every directory.
pub(crate) const TREE_LOOKAHEAD_BYTES: u64 = 2 * MIB;
/// Window loads ahead of the walk in flight at once: with 20 ms to the
/// store, 4 restored 11,111 small directories in 7.2 s, 8 in 4.0 s, 16 in
/// 2.9 s, 32 in 3.0 s (docs/benchmarks.md).
const TREE_LOOKAHEAD_REQUESTS: usize = 16;
/// Batches the walker fills ahead of the one being written.
const BATCHES_AHEAD: usize = 1;
// Two batches (the one the walk fills and the one whose last blobs are
// being written), those queued, and those one read serves (the one planned
// and fetched and those held back for it) hold their directories open
// together.
const _: () = assert!(
    2 + BATCHES_AHEAD + plan::MAX_BATCHES_PER_READ <= descriptors::MAX_BATCHES_ALIVE,
    "more restore batches are alive at once than the descriptors set aside allow"
);
/// Files of a batch finished (or compared, in `sync` mode) per job.
const FILES_PER_JOB: usize = 256;

// The buffers of the default share, and the trees kept for the
// verification, fit that share (what the process holds besides is the
// agent's baseline, `api::transfer::AGENT_BASELINE_BYTES`);
// docs/benchmarks.md has the measured peaks.
const _: () = assert!(
    PACK_BYTES_IN_FLIGHT
        + DECODE_BUFFER_BYTES
        + BATCH_BOOKKEEPING_BYTES
        + super::tree_cache::VERIFY_TREE_CACHE_BYTES
        + TREE_LOOKAHEAD_BYTES
        + super::tree_packs::TREE_PACKS_HELD_BYTES
        <= haulage_api::transfer::DEFAULT_VOLUME_SHARE_BYTES,
    "the restore's buffers do not fit an engine's default memory share"
);

/// How to restore.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Where to restore; created if missing; must be empty unless `sync`.
    pub target: PathBuf,
    /// Update an existing copy in place, writing only what differs.
    pub sync: bool,
    /// The memory its buffers may take (pack reads in flight, the scatter
    /// workers' buffers, the batches of files).
    pub memory: EngineMemory,
    /// Sync mode: the snapshot the target was last restored or synced
    /// from, completely. A file both snapshots hold unchanged, which the
    /// disk still shows as that restore wrote it, is not read (see
    /// [`super::since`]). One that cannot be loaded is reported in the
    /// outcome and every file is compared.
    pub since: Option<ObjectId>,
    /// Limit on writing to the target.
    pub write_throttle: Throttle,
    /// Restore owners (needs root or CAP_CHOWN); default: when running as root.
    pub restore_owners: bool,
    /// Create device nodes (off by default: a snapshot should not be able
    /// to plant devices).
    pub allow_devices: bool,
    /// Extended attribute name prefixes restored (default `user.`).
    pub xattr_prefixes: Vec<Vec<u8>>,
}

impl RestoreOptions {
    /// Defaults for restoring into `target`.
    pub fn new(target: impl Into<PathBuf>) -> Self {
        RestoreOptions {
            target: target.into(),
            sync: false,
            memory: EngineMemory::default(),
            since: None,
            write_throttle: Throttle::unlimited(),
            restore_owners: rustix::process::geteuid().is_root(),
            allow_devices: false,
            xattr_prefixes: vec![b"user.".to_vec()],
        }
    }
}

/// One entry that was not restored as it should have been.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestoreProblem {
    /// Path relative to the target.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

/// What a restore did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreOutcome {
    /// The snapshot restored.
    pub snapshot_id: String,
    /// Regular files written or verified.
    pub files: u64,
    /// Directories.
    pub directories: u64,
    /// Symlinks, FIFOs, devices, hard links.
    pub other_entries: u64,
    /// Bytes of file content written.
    pub bytes_written: u64,
    /// Sync mode: files left untouched because they already matched.
    pub files_unchanged: u64,
    /// Sync mode: entries removed because the snapshot does not have them.
    pub entries_removed: u64,
    /// Sync mode: the since snapshot used, when one was given and loaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Sync mode: why the since snapshot given was not used (every file
    /// was compared instead; not a problem of the restored data).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_not_used: Option<String>,
    /// Sync mode: files not read, the since snapshot's restore having left
    /// them as this snapshot has them.
    pub files_not_read: u64,
    /// Sync mode with a since snapshot used: what the verification after
    /// it needs to skip the same files
    /// ([`super::verify_tree::TreeVerifyOptions::after`]).
    #[serde(skip)]
    pub since_check: Option<SinceCheck>,
    /// Wall time in seconds.
    pub duration_seconds: f64,
    /// Entries not restored, or restored with a problem.
    pub problems: Vec<RestoreProblem>,
}

/// Restore `snapshot_id` into `options.target`.
///
/// Returns what was restored and every entry that was not (a damaged or
/// unreadable file is removed and listed, the rest is restored); fails
/// only when the snapshot, the index or the target cannot be used at all,
/// or on cancellation (files written so far stay; directory attributes,
/// symlinks and hard links are not applied).
pub async fn restore(
    repository: &Repository,
    snapshot_id: &ObjectId,
    options: RestoreOptions,
    progress: Arc<Progress>,
    cancel: CancellationToken,
) -> Result<RestoreOutcome, EngineError> {
    let loaded = LoadedSnapshot::load(repository, snapshot_id).await?;
    restore_loaded(repository, &loaded, options, progress, cancel).await
}

/// Directories nested deeper than this are refused (reported, not
/// written): each level of the walk is a frame on its stack (see
/// [`super::WALK_STACK_BYTES`]) and holds its directory open, so a tree at the
/// limit holds about 1,025 descriptors at once: more than a soft
/// `RLIMIT_NOFILE` of 1,024 allows (the directories below that depth then
/// fail with EMFILE, reported the same way). No real tree comes near it.
pub const MAX_DIRECTORY_DEPTH: usize = 1024;

/// A snapshot with the repository's index, loaded together: what a restore
/// reads before anything else, and what the verification after it needs
/// too. Load it once and give it to both ([`restore_loaded`],
/// [`super::verify_tree::verify_tree_loaded`]) so the index is not read and
/// decoded twice.
#[derive(Debug, Clone)]
pub struct LoadedSnapshot {
    /// The snapshot's id.
    pub id: ObjectId,
    /// Its manifest.
    pub snapshot: Snapshot,
    /// Where every blob of the repository is.
    pub index: Arc<BlobIndex>,
    /// When loading began: a restore's duration counts from here.
    pub load_started: Instant,
    /// The trees the restore loads, kept for its verification (none
    /// unless [`LoadedSnapshot::keeping_trees_for_verification`]).
    pub trees: Arc<TreeCache>,
}

impl LoadedSnapshot {
    /// Read the manifest and the index (independent requests: together,
    /// not one after the other).
    pub async fn load(repository: &Repository, id: &ObjectId) -> Result<Self, EngineError> {
        let load_started = Instant::now();
        let (snapshot, loaded) =
            tokio::join!(repository.load_snapshot(id), repository.load_index());
        Ok(LoadedSnapshot {
            id: *id,
            snapshot: snapshot?,
            index: loaded?.index,
            load_started,
            trees: Arc::new(TreeCache::default()),
        })
    }

    /// The restore of this snapshot will be verified: keep the trees it
    /// loads (as many as `memory` allows,
    /// [`EngineMemory::verify_tree_cache_bytes`]) for the verification.
    pub fn keeping_trees_for_verification(mut self, memory: EngineMemory) -> Self {
        self.trees = Arc::new(TreeCache::new(memory.verify_tree_cache_bytes()));
        self
    }
}

/// [`restore`] of a snapshot already loaded.
pub async fn restore_loaded(
    repository: &Repository,
    loaded: &LoadedSnapshot,
    options: RestoreOptions,
    progress: Arc<Progress>,
    cancel: CancellationToken,
) -> Result<RestoreOutcome, EngineError> {
    let started = loaded.load_started;
    // The walk runs on a thread of its own: if this future is dropped
    // rather than cancelled, the guard still stops it.
    let cancel = cancel.child_token();
    let _stop_the_walk_when_dropped = cancel.clone().drop_guard();
    let snapshot_id = &loaded.id;
    let snapshot = &loaded.snapshot;
    let index = loaded.index.clone();
    progress.set_totals(snapshot.summary.total_bytes, snapshot.summary.files);
    let root_fd = Arc::new(open_target(&options)?);
    let since_id = options.since.filter(|_| options.sync);
    let trees = loaded.trees.clone();
    let since = async {
        match since_id {
            Some(since) => {
                load_since_root(repository, &index, &trees, &since, &snapshot.tree).await
            }
            None => Ok(None),
        }
    };
    let (root_tree, since) = tokio::join!(
        trees.load_one_and_keep(repository, &index, &snapshot.tree),
        since
    );
    let root_tree = root_tree?;

    let config = repository.config();
    let sizes = options.memory.restore(
        u64::from(config.chunker.max_bytes),
        repository.largest_stored_blob_bytes() as u64,
    );
    let (tree_lookahead_bytes, tree_packs_held_bytes) =
        (sizes.tree_lookahead_bytes, sizes.tree_packs_held_bytes);
    let shared = Arc::new(Shared {
        repository: repository.clone(),
        sizes,
        options,
        progress,
        cancel,
        outcome: Mutex::new(RestoreOutcome {
            snapshot_id: snapshot_id.to_hex(),
            since: match &since {
                Ok(Some(_)) => since_id.map(|id| id.to_hex()),
                _ => None,
            },
            since_not_used: since.as_ref().err().cloned(),
            // Taken before anything is written: what the sync writes changes later.
            since_check: match (&since, since_id) {
                (Ok(Some(_)), Some(snapshot)) => {
                    ChangeMark::take(&root_fd).map(|mark| SinceCheck { snapshot, mark })
                }
                _ => None,
            },
            ..RestoreOutcome::default()
        }),
        first_links: Mutex::new(HashMap::new()),
        open_files: AtomicUsize::new(0),
        soft_limit: descriptors::soft_limit_now(),
        handle: tokio::runtime::Handle::current(),
        trees,
        tree_packs: TreePacks::new(tree_packs_held_bytes),
        _running: descriptors::batch_directories().restore_running(),
        batches_alive: Arc::new(tokio::sync::Semaphore::new(descriptors::MAX_BATCHES_ALIVE)),
        lookahead: lookahead::Lookahead::new(tree_lookahead_bytes, TREE_LOOKAHEAD_REQUESTS),
    });
    let (batches, queued_batches) = mpsc::channel(BATCHES_AHEAD);
    let writer = tokio::spawn(write_batches(shared.clone(), index.clone(), queued_batches));
    let walker = Walker {
        shared: shared.clone(),
        index,
        root_fd: root_fd.clone(),
        batches: Some(batches),
        batch: Batch::default(),
        deferred_links: Vec::new(),
        deferred_symlinks: Vec::new(),
        directories: Vec::new(),
        removals: std::collections::VecDeque::new(),
    };
    let since = since.unwrap_or_else(|reason| {
        tracing::warn!("{reason}");
        None
    });
    // The walk from the root, on a thread of its own with a
    // [`super::WALK_STACK_BYTES`] stack (still on the runtime, through its
    // handle), so that a tree [`MAX_DIRECTORY_DEPTH`] deep cannot overflow
    // the stack of the runtime's thread; the walker comes back for what
    // follows the walk.
    let walk = super::OwnThread::spawn_with_stack(
        "restore-walk",
        Some(super::WALK_STACK_BYTES),
        move || {
            let mut walker = walker;
            let walked = tokio::runtime::Handle::current().block_on(walker.restore_directory(
                root_fd,
                Vec::new(),
                Vec::new(),
                root_tree,
                since,
            ));
            (walked, walker)
        },
    );
    let (mut walked, mut walker) = match walk {
        Ok(walk) => walk.join().await,
        // No thread to be had (a pod at its pids limit): the volume fails
        // saying so, rather than walk on a runtime thread's 2 MiB stack,
        // which a deep snapshot overflows (aborting every volume). The
        // walker, and with it the writer's batches, went with the thread
        // that never started: the writer ends.
        Err(error) => {
            shared.lookahead.close();
            writer
                .await
                .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))?;
            return Err(error);
        }
    };
    // The windows loaded ahead that the walk did not enter (it failed, or
    // refused a directory) hold the shared state: stop them.
    shared.lookahead.close();
    // Before the directories' times are set, and before returning at all.
    walker.finish_removals().await;
    if walked.is_ok() {
        walked = walker.send_batch().await;
    }
    // No more batches: the writer finishes the queued ones and stops.
    walker.batches = None;
    let written = writer
        .await
        .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
    if shared.cancel.is_cancelled() {
        return Err(EngineError::Cancelled);
    }
    // The writer's error first: the walk then only saw its batches refused.
    written?;
    walked?;
    walker.finish_links_and_metadata(&snapshot.root_attributes());
    let mut outcome = shared.outcome.lock().expect("outcome").clone();
    outcome.duration_seconds = started.elapsed().as_secs_f64();
    Ok(outcome)
}

/// The since snapshot's root for a sync of the snapshot whose root tree
/// is `root`; an error is the problem to report (every file is then
/// compared).
async fn load_since_root(
    repository: &Repository,
    index: &BlobIndex,
    trees: &TreeCache,
    since: &ObjectId,
    root: &repo::BlobId,
) -> Result<Option<SinceDirectory>, String> {
    let not_used = |error: EngineError| {
        format!(
            "the since snapshot {} is not used, every file is compared instead: {}",
            since.to_hex(),
            crate::error_chain(&error)
        )
    };
    let earlier = repository.load_snapshot(since).await.map_err(not_used)?;
    match since_root(&earlier.tree, root) {
        SinceSubdirectory::Same => Ok(Some(SinceDirectory::Same)),
        SinceSubdirectory::Load(tree) => trees
            .load_one_and_keep(repository, index, &tree)
            .await
            .map(|tree| Some(SinceDirectory::Tree(tree)))
            .map_err(not_used),
        SinceSubdirectory::Nothing => Ok(None),
    }
}

/// Create or check the target directory and open it.
fn open_target(options: &RestoreOptions) -> Result<OwnedFd, EngineError> {
    let target = &options.target;
    let error = |reason: String| EngineError::Target {
        path: target.clone(),
        reason,
    };
    match std::fs::symlink_metadata(target) {
        Err(missing) if missing.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(target).map_err(|e| error(format!("cannot create it: {e}")))?;
        }
        Err(other) => return Err(error(other.to_string())),
        Ok(metadata) if !metadata.is_dir() => {
            return Err(error("it exists and is not a directory".into()));
        }
        Ok(_) => {
            let mut entries = std::fs::read_dir(target).map_err(|e| error(e.to_string()))?;
            if !options.sync && entries.next().is_some() {
                return Err(error(
                    "it is not empty; restore into an empty directory, or pass --sync to update \
                     an earlier copy in place (entries not in the snapshot are then removed)"
                        .into(),
                ));
            }
        }
    }
    rustix::fs::open(
        target,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| error(format!("cannot open it: {e}")))
}

/// A path inside the target as its components, for re-opening with
/// `O_NOFOLLOW` at each step.
type Components = Vec<ByteBuf>;

fn display(components: &[ByteBuf]) -> String {
    let parts: Vec<_> = components
        .iter()
        .map(|part| String::from_utf8_lossy(part).into_owned())
        .collect();
    parts.join("/")
}

/// What the walker and the batch writers share.
struct Shared {
    repository: Repository,
    options: RestoreOptions,
    progress: Arc<Progress>,
    cancel: CancellationToken,
    outcome: Mutex<RestoreOutcome>,
    /// (device, inode) of a multiply-linked file → where this restore
    /// created it (empty until its content is complete).
    first_links: Mutex<HashMap<(u64, u64), Components>>,
    /// Restored files open at this moment (see [`RestoreShare::open_files`]).
    open_files: AtomicUsize,
    handle: tokio::runtime::Handle,
    /// Where the trees are loaded through (kept for a verification).
    trees: Arc<TreeCache>,
    /// The packs of trees read whole, that the trees are cut from.
    tree_packs: TreePacks,
    /// The subtree windows loaded ahead of the walk.
    lookahead: lookahead::Lookahead,
    /// Sizes from the memory share.
    sizes: RestoreBuffers,
    /// Counted among the restores whose own descriptors the batches'
    /// budget sets aside ([`descriptors::batch_directories_limit`]), and
    /// that share the limit ([`Shared::descriptors`]).
    _running: descriptors::RunningRestore,
    /// The soft limit of open files when the restore began (the binaries
    /// raise it once, at their start).
    soft_limit: u64,
    /// Places of the batches alive at once
    /// ([`Walker::take_a_place_for_the_batch`]).
    batches_alive: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    /// What this restore holds open without asking, beside the restores
    /// running now.
    fn descriptors(&self) -> RestoreShare {
        descriptors::restore_share(self.soft_limit, descriptors::batch_directories().restores())
    }

    fn problem(&self, path: impl Into<String>, message: impl Into<String>) {
        Progress::add(&self.progress.warnings, 1);
        self.outcome
            .lock()
            .expect("outcome")
            .problems
            .push(RestoreProblem {
                path: path.into(),
                message: message.into(),
            });
    }
}

/// Regular files restored together: the walker fills a batch, the writer
/// plans its pack reads and writes it.
#[derive(Default)]
struct Batch {
    /// Directories holding the batch's files (a directory may appear more
    /// than once, when a subdirectory's files came between its own).
    directories: BatchDirectories,
    files: Vec<BatchFile>,
    chunks: usize,
}

/// The directories of one batch's files, each held open until the batch is
/// written: [`RestoreShare::free_batch_directories`] of them freely,
/// the rest taken from the process's budget for them
/// ([`descriptors::batch_directories`]) and given back when the batch is
/// dropped.
struct BatchDirectories {
    held: Vec<BatchDirectory>,
    /// The batch's place among those alive at once
    /// ([`descriptors::MAX_BATCHES_ALIVE`]), taken before its first file
    /// and given back when its directories are closed.
    alive: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Where the directories beyond the first are taken from.
    budget: &'static DescriptorBudget,
    /// How many were taken from it.
    taken: usize,
}

impl Default for BatchDirectories {
    fn default() -> Self {
        BatchDirectories::taking_from(descriptors::batch_directories())
    }
}

impl BatchDirectories {
    fn taking_from(budget: &'static DescriptorBudget) -> Self {
        BatchDirectories {
            held: Vec::new(),
            alive: None,
            budget,
            taken: 0,
        }
    }

    /// Whether one more directory may be held, at most `most`: beyond the
    /// first `free`, if one can be taken from the budget within `limit`.
    fn room_for_one_more(
        &mut self,
        most: usize,
        free: usize,
        limit: impl FnOnce() -> usize,
    ) -> bool {
        let held = self.held.len();
        if held >= most {
            return false;
        }
        if held < free + self.taken {
            return true;
        }
        let taken = self.budget.try_take(limit());
        self.taken += usize::from(taken);
        taken
    }
}

impl std::ops::Deref for BatchDirectories {
    type Target = [BatchDirectory];

    fn deref(&self) -> &[BatchDirectory] {
        &self.held
    }
}

impl Drop for BatchDirectories {
    fn drop(&mut self) {
        self.budget.give_back(self.taken);
    }
}

struct BatchDirectory {
    fd: Arc<OwnedFd>,
    path: Components,
}

struct BatchFile {
    /// Position of its directory in [`Batch::directories`].
    directory: u32,
    entry: Entry,
    /// The since snapshot holds the same file (sync mode).
    unchanged_since: bool,
}

impl Batch {
    /// Whether the batch takes no more files: its files, its chunks, or
    /// its directories at their limit (a directory of room is taken for
    /// the next file, whose directory may be a new one).
    fn is_full(&mut self, sizes: &RestoreBuffers, descriptors: RestoreShare) -> bool {
        let free = descriptors.free_batch_directories;
        self.files.len() >= sizes.batch_files
            || self.chunks >= sizes.batch_chunks
            || !self.directories.room_for_one_more(
                (sizes.batch_files / FILES_PER_BATCH_DIRECTORY).max(free),
                free,
                descriptors::batch_directories_limit_now,
            )
    }

    fn add(
        &mut self,
        directory_fd: &Arc<OwnedFd>,
        directory: &[ByteBuf],
        entry: Entry,
        unchanged_since: bool,
    ) {
        let same_directory = self
            .directories
            .last()
            .is_some_and(|last| Arc::ptr_eq(&last.fd, directory_fd));
        if !same_directory {
            self.directories.held.push(BatchDirectory {
                fd: directory_fd.clone(),
                path: directory.to_vec(),
            });
        }
        self.chunks += entry.content.len();
        self.files.push(BatchFile {
            directory: (self.directories.len() - 1) as u32,
            entry,
            unchanged_since,
        });
    }
}

/// The subtrees of one directory's entries, loaded a window at a time
/// ([`Repository::load_trees`]: neighbouring tree blobs in one request)
/// and handed out in entry order. The first window starts loading when
/// the directory is entered ([`Subtrees::start`]), so that its trees are
/// fetched and decoded on the runtime while the walk lists the directory
/// and batches its files, unless it was loaded ahead ([`lookahead`]); at
/// most one window per directory is held, as when it was loaded on
/// reaching the first subdirectory.
struct Subtrees {
    ids: Vec<crate::repo::BlobId>,
    /// For the trees of the snapshot restored (not of a sync's since
    /// snapshot): the place of their directory in the walk, whose windows
    /// are loaded ahead ([`lookahead`]).
    place: Option<lookahead::Place>,
    /// Position in `ids` of the first tree not loaded yet.
    loaded_until: usize,
    /// Position in `ids` of the next tree handed out.
    handed_out: usize,
    loaded: std::collections::VecDeque<Result<Tree, EngineError>>,
    /// The window being loaded.
    loading: Option<lookahead::WindowLoad>,
}

impl Subtrees {
    /// The subtrees of `entries`, the entries of the directory at `place`.
    fn of(entries: &[Entry], place: lookahead::Place) -> Self {
        Self::load(
            entries
                .iter()
                .filter(|entry| entry.kind == EntryKind::Directory)
                .filter_map(|entry| entry.subtree)
                .collect(),
            Some(place),
        )
    }

    /// The since snapshot's trees of `entries`' subdirectories that are
    /// neither the same as the snapshot's nor missing.
    fn since_of(entries: &[Entry], since: Option<&SinceDirectory>) -> Self {
        let ids = match since {
            Some(since) => entries
                .iter()
                .filter(|entry| entry.kind == EntryKind::Directory)
                .filter_map(|entry| match since.subdirectory(entry) {
                    SinceSubdirectory::Load(id) => Some(id),
                    SinceSubdirectory::Same | SinceSubdirectory::Nothing => None,
                })
                .collect(),
            None => Vec::new(),
        };
        Self::load(ids, None)
    }

    fn load(ids: Vec<crate::repo::BlobId>, place: Option<lookahead::Place>) -> Self {
        Subtrees {
            ids,
            place,
            loaded_until: 0,
            handed_out: 0,
            loaded: std::collections::VecDeque::new(),
            loading: None,
        }
    }

    /// The place in the walk of the directory whose subtree comes next.
    fn next_place(&self) -> lookahead::Place {
        let mut place = self.place.clone().unwrap_or_default();
        place.push(u32::try_from(self.handed_out).unwrap_or(u32::MAX));
        place
    }

    /// Start loading the next window of up to [`TREE_PREFETCH_BYTES`] (at
    /// least one tree), unless one is loading or none is left; the first
    /// window, when loaded ahead, is taken instead.
    fn start(&mut self, walker: &Walker) {
        if self.loading.is_some() || self.loaded_until == self.ids.len() {
            return;
        }
        let start = self.loaded_until;
        let (end, _) = lookahead::window_end(&walker.index, &self.ids, start);
        self.loaded_until = end;
        let ids = &self.ids[start..end];
        let ahead = match &self.place {
            Some(_) if start == 0 => lookahead::Lookahead::take(&walker.shared, &walker.index, ids),
            _ => None,
        };
        self.loading = Some(ahead.unwrap_or_else(|| {
            lookahead::spawn_window_load(
                walker.shared.clone(),
                walker.index.clone(),
                ids.to_vec(),
                self.place.clone().map(|place| (place, start)),
                false,
            )
        }));
    }

    /// The next directory's subtree (directories without one take none).
    async fn next(&mut self, walker: &Walker) -> Result<Tree, EngineError> {
        if self.loaded.is_empty() {
            self.start(walker);
            let loading = self
                .loading
                .take()
                .expect("a window is loading: ids counts every subdirectory");
            self.loaded = super::joined(loading).await.into();
        }
        self.handed_out += 1;
        self.loaded
            .pop_front()
            .expect("load_trees answers once per id, and ids counts every subdirectory")
    }
}

/// Directories whose extra entries a sync removes at once, beside the walk.
const REMOVALS_AHEAD: usize = 4;

/// Sync mode, one directory: remove the entries whose names are not in
/// `keep`.
fn remove_extras(
    shared: &Shared,
    directory_fd: &OwnedFd,
    components: &[ByteBuf],
    keep: &HashSet<ByteBuf>,
) {
    let names = match scan::list_directory(directory_fd) {
        Ok(names) => names,
        Err(error) => {
            shared.problem(
                display(components),
                format!("cannot list for sync: {error}"),
            );
            return;
        }
    };
    for name in names {
        if keep.contains(serde_bytes::Bytes::new(&name)) {
            continue;
        }
        match remove_entry(directory_fd, &name) {
            Ok(()) => shared.outcome.lock().expect("outcome").entries_removed += 1,
            Err(error) => {
                let mut path = components.to_vec();
                path.push(ByteBuf::from(name));
                shared.problem(display(&path), format!("cannot remove: {error}"));
            }
        }
    }
}

/// Goes through the snapshot's trees: directories, special files and the
/// deferred entries are its own work, regular files go into batches.
struct Walker {
    shared: Arc<Shared>,
    index: Arc<BlobIndex>,
    root_fd: Arc<OwnedFd>,
    /// Where full batches go; `None` once the walk is over.
    batches: Option<mpsc::Sender<Batch>>,
    batch: Batch,
    deferred_links: Vec<(Components, Entry)>,
    deferred_symlinks: Vec<(Components, Entry)>,
    /// Directories in pre-order, for metadata in post-order at the end.
    directories: Vec<(Components, Entry)>,
    /// Sync mode: the removals of extra entries under way.
    removals: std::collections::VecDeque<tokio::task::JoinHandle<()>>,
}

impl Walker {
    fn problem(&self, path: impl Into<String>, message: impl Into<String>) {
        self.shared.problem(path, message);
    }

    /// Hand the current batch to the writer (waiting while it is busy with
    /// [`BATCHES_AHEAD`] others).
    /// Wait, before a batch's first file, until fewer than
    /// [`descriptors::MAX_BATCHES_ALIVE`] batches are alive: one lives
    /// until the last scatter job writing to it is done, so with a slow
    /// target the batches whose jobs are pending would otherwise add up,
    /// each holding its directories open. It cannot wait for ever: the
    /// batches that wait for the walk (the one queued and those whose
    /// reads are held back) are fewer than the places, and the others only
    /// wait for their jobs.
    async fn take_a_place_for_the_batch(&mut self) {
        if self.batch.directories.alive.is_none() {
            let place = self
                .shared
                .batches_alive
                .clone()
                .acquire_owned()
                .await
                .expect("the places of batches alive are never closed");
            self.batch.directories.alive = Some(place);
        }
    }

    async fn send_batch(&mut self) -> Result<(), EngineError> {
        if self.batch.files.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.batch);
        match &self.batches {
            Some(batches) => batches
                .send(batch)
                .await
                .map_err(|_| EngineError::Cancelled),
            None => Err(EngineError::Cancelled),
        }
    }

    fn restore_directory<'a>(
        &'a mut self,
        directory_fd: Arc<OwnedFd>,
        components: Components,
        place: lookahead::Place,
        tree: Tree,
        since: Option<SinceDirectory>,
    ) -> futures::future::BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            if self.shared.cancel.is_cancelled() {
                return Err(EngineError::Cancelled);
            }
            let mut names_seen = HashSet::new();
            let mut entries = Vec::with_capacity(tree.entries.len());
            for entry in tree.entries {
                let mut path = components.clone();
                path.push(entry.name.clone());
                if let Err(error) = validate_name(&entry.name) {
                    self.problem(display(&path), format!("refused: {error}"));
                    continue;
                }
                if !names_seen.insert(entry.name.clone()) {
                    self.problem(
                        display(&path),
                        "refused: the snapshot lists this name twice",
                    );
                    continue;
                }
                entries.push(entry);
            }
            let mut subtrees = Subtrees::of(&entries, place);
            let mut since_subtrees = Subtrees::since_of(&entries, since.as_ref());
            subtrees.start(self);
            since_subtrees.start(self);
            if self.shared.options.sync {
                self.remove_extra_entries(&directory_fd, &components, names_seen)
                    .await;
            }
            for entry in entries {
                // Only for what keeps or reports the entry's path: a file
                // that goes into a batch needs none.
                let path_of = |entry: &Entry| {
                    let mut path = components.clone();
                    path.push(entry.name.clone());
                    path
                };
                match entry.kind {
                    EntryKind::Directory => {
                        let path = path_of(&entry);
                        let child_place = subtrees.next_place();
                        let subtree = match entry.subtree {
                            Some(_) => subtrees.next(self).await,
                            None => Ok(Tree::default()),
                        };
                        let since_subtree = match since.as_ref().map(|s| s.subdirectory(&entry)) {
                            Some(SinceSubdirectory::Same) => Some(SinceDirectory::Same),
                            // One that cannot be read only costs reading the files.
                            Some(SinceSubdirectory::Load(_)) => {
                                since_subtrees.next(self).await.ok().map(SinceDirectory::Tree)
                            }
                            Some(SinceSubdirectory::Nothing) | None => None,
                        };
                        if path.len() > MAX_DIRECTORY_DEPTH {
                            self.problem(
                                display(&path),
                                format!(
                                    "refused: nested deeper than {MAX_DIRECTORY_DEPTH} directories"
                                ),
                            );
                            continue;
                        }
                        let Some(child_fd) = self.prepare_directory(&directory_fd, &path, &entry)
                        else {
                            continue;
                        };
                        self.shared.outcome.lock().expect("outcome").directories += 1;
                        self.directories.push((path.clone(), entry));
                        match subtree {
                            Ok(subtree) => {
                                self.restore_directory(
                                    Arc::new(child_fd),
                                    path,
                                    child_place,
                                    subtree,
                                    since_subtree,
                                )
                                .await?
                            }
                            Err(error) => self.problem(
                                display(&path),
                                format!("contents not restored: {error}"),
                            ),
                        }
                    }
                    EntryKind::File => {
                        if entry.content_length() != Some(entry.size) {
                            self.problem(
                                display(&path_of(&entry)),
                                format!(
                                    "refused: its content does not add up to its size of {} bytes (a damaged or forged tree)",
                                    entry.size
                                ),
                            );
                            continue;
                        }
                        if entry.links > 1 {
                            let key = (entry.device, entry.inode);
                            let mut first = self.shared.first_links.lock().expect("links");
                            if first.contains_key(&key) {
                                drop(first);
                                self.deferred_links.push((path_of(&entry), entry));
                                continue;
                            }
                            // Reserve; the real path is recorded once written.
                            first.insert(key, Vec::new());
                        }
                        let unchanged_since =
                            since.as_ref().is_some_and(|since| since.file_unchanged(&entry));
                        self.take_a_place_for_the_batch().await;
                        self.batch
                            .add(&directory_fd, &components, entry, unchanged_since);
                        if self
                            .batch
                            .is_full(&self.shared.sizes, self.shared.descriptors())
                        {
                            self.send_batch().await?;
                        }
                    }
                    EntryKind::Symlink => self.deferred_symlinks.push((path_of(&entry), entry)),
                    EntryKind::Fifo | EntryKind::CharDevice | EntryKind::BlockDevice => {
                        self.create_node(&directory_fd, &path_of(&entry), &entry)
                    }
                    EntryKind::Socket => self.problem(
                        display(&path_of(&entry)),
                        "a Unix socket cannot be restored; it is recreated by the program that owns it",
                    ),
                }
            }
            Ok(())
        })
    }

    /// Sync mode: remove what the snapshot does not have (`keep` holds its
    /// names), on the blocking pool while the walk goes on: the names
    /// removed are none the walk writes. At most [`REMOVALS_AHEAD`]
    /// directories at once; [`Walker::finish_removals`] waits for them.
    async fn remove_extra_entries(
        &mut self,
        directory_fd: &Arc<OwnedFd>,
        components: &[ByteBuf],
        keep: HashSet<ByteBuf>,
    ) {
        if self.removals.len() >= REMOVALS_AHEAD
            && let Some(oldest) = self.removals.pop_front()
        {
            super::joined(oldest).await;
        }
        let (shared, directory_fd, components) = (
            self.shared.clone(),
            directory_fd.clone(),
            components.to_vec(),
        );
        self.removals
            .push_back(tokio::task::spawn_blocking(move || {
                remove_extras(&shared, &directory_fd, &components, &keep)
            }));
    }

    /// Wait for every removal [`Walker::remove_extra_entries`] started.
    async fn finish_removals(&mut self) {
        while let Some(removal) = self.removals.pop_front() {
            super::joined(removal).await;
        }
    }

    /// Make sure a directory exists at `path` (replacing anything else in
    /// sync mode) and open it.
    fn prepare_directory(
        &self,
        parent: &OwnedFd,
        path: &[ByteBuf],
        entry: &Entry,
    ) -> Option<OwnedFd> {
        let name = entry.name.as_slice();
        let existing = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW);
        let result = (|| {
            match existing {
                Ok(stat)
                    if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                        == rustix::fs::FileType::Directory => {}
                Ok(_) => {
                    remove_entry(parent, name)?;
                    rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))?;
                }
                Err(Errno::NOENT) => rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))?,
                Err(error) => return Err(error),
            }
            rustix::fs::openat(
                parent,
                name,
                OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
        })();
        match result {
            Ok(fd) => Some(fd),
            Err(error) => {
                self.problem(
                    display(path),
                    format!("cannot create directory: {error}{}", remedy_of(error)),
                );
                None
            }
        }
    }

    fn create_node(&self, parent: &OwnedFd, path: &[ByteBuf], entry: &Entry) {
        let file_type = match entry.kind {
            EntryKind::Fifo => rustix::fs::FileType::Fifo,
            EntryKind::CharDevice | EntryKind::BlockDevice
                if !self.shared.options.allow_devices =>
            {
                self.problem(
                    display(path),
                    "device node not created (pass --allow-devices to restore device nodes)",
                );
                return;
            }
            EntryKind::CharDevice => rustix::fs::FileType::CharacterDevice,
            _ => rustix::fs::FileType::BlockDevice,
        };
        let name = entry.name.as_slice();
        if self.shared.options.sync {
            match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) if rustix::fs::FileType::from_raw_mode(stat.st_mode) == file_type => {
                    return self.count_other();
                }
                Ok(_) => {
                    if let Err(error) = remove_entry(parent, name) {
                        return self.problem(
                            display(path),
                            format!("cannot replace: {error}{}", remedy_of(error)),
                        );
                    }
                }
                Err(_) => {}
            }
        }
        let result = rustix::fs::mknodat(
            parent,
            name,
            file_type,
            Mode::from_raw_mode(entry.mode & 0o777),
            entry.rdev,
        )
        .and_then(|()| self.apply_metadata_at(parent, name, entry, false));
        match result {
            Ok(()) => self.count_other(),
            Err(error) => self.problem(
                display(path),
                format!("cannot create: {error}{}", remedy_of(error)),
            ),
        }
    }

    fn count_other(&self) {
        self.shared.outcome.lock().expect("outcome").other_entries += 1;
    }

    /// Hard links, symlinks, then directory metadata (children before
    /// parents, so times and read-only modes stick).
    fn finish_links_and_metadata(&mut self, root: &Entry) {
        let root_fd = self.root_fd.clone();
        for (path, entry) in std::mem::take(&mut self.deferred_links) {
            let first = self
                .shared
                .first_links
                .lock()
                .expect("links")
                .get(&(entry.device, entry.inode))
                .cloned()
                .filter(|first| !first.is_empty());
            let result = (|| -> Result<(), String> {
                let Some(first) = first else {
                    return Err("hard link to a file that was not restored".into());
                };
                let (first_name, first_dir) = first.split_last().expect("non-empty path");
                let (name, dir) = path.split_last().expect("non-empty path");
                let from =
                    scan::open_directory_at(&root_fd, first_dir).map_err(|e| e.to_string())?;
                let to = scan::open_directory_at(&root_fd, dir).map_err(|e| e.to_string())?;
                if self.shared.options.sync {
                    match rustix::fs::statat(&to, name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(_) => remove_entry(&to, name).map_err(|e| e.to_string())?,
                        Err(Errno::NOENT) => {}
                        Err(error) => return Err(error.to_string()),
                    }
                }
                rustix::fs::linkat(
                    &from,
                    first_name.as_slice(),
                    &to,
                    name.as_slice(),
                    AtFlags::empty(),
                )
                .map_err(|e| format!("cannot create hard link: {e}"))
            })();
            match result {
                Ok(()) => self.count_other(),
                Err(message) => self.problem(display(&path), message),
            }
        }
        for (path, entry) in std::mem::take(&mut self.deferred_symlinks) {
            let (name, dir) = path.split_last().expect("non-empty path");
            let target = entry.link_target.clone().unwrap_or_default();
            let result = (|| -> Result<(), Errno> {
                let dir_fd = scan::open_directory_at(&root_fd, dir)?;
                if self.shared.options.sync {
                    match rustix::fs::statat(&dir_fd, name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(stat)
                            if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                                == rustix::fs::FileType::Symlink
                                && rustix::fs::readlinkat(&dir_fd, name.as_slice(), Vec::new())
                                    .map(|current| current.as_bytes() == target.as_slice())
                                    .unwrap_or(false) =>
                        {
                            return self.apply_metadata_at(&dir_fd, name, &entry, true);
                        }
                        Ok(_) => remove_entry(&dir_fd, name)?,
                        Err(Errno::NOENT) => {}
                        Err(error) => return Err(error),
                    }
                }
                rustix::fs::symlinkat(target.as_slice(), &dir_fd, name.as_slice())?;
                self.apply_metadata_at(&dir_fd, name, &entry, true)
            })();
            match result {
                Ok(()) => self.count_other(),
                Err(error) => self.problem(
                    display(&path),
                    format!("cannot create symlink: {error}{}", remedy_of(error)),
                ),
            }
        }
        for (path, entry) in std::mem::take(&mut self.directories).into_iter().rev() {
            let result = scan::open_directory_at(&root_fd, &path)
                .and_then(|fd| apply_metadata_fd(&fd, &entry, &self.shared.options));
            if let Err(error) = result {
                self.problem(
                    display(&path),
                    format!(
                        "cannot set directory attributes: {error}{}",
                        remedy_of(error)
                    ),
                );
            }
        }
        if let Err(error) = apply_metadata_fd(&root_fd, root, &self.shared.options) {
            self.problem(
                ".",
                format!("cannot set attributes of the target directory: {error}"),
            );
        }
    }

    /// Owner, mode and times of a non-regular entry, without following it.
    fn apply_metadata_at(
        &self,
        dir: &OwnedFd,
        name: &[u8],
        entry: &Entry,
        is_symlink: bool,
    ) -> Result<(), Errno> {
        if self.shared.options.restore_owners {
            rustix::fs::chownat(
                dir,
                name,
                Some(rustix::fs::Uid::from_raw(entry.uid)),
                Some(rustix::fs::Gid::from_raw(entry.gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )?;
        }
        if !is_symlink {
            rustix::fs::chmodat(dir, name, Mode::from_raw_mode(entry.mode), AtFlags::empty())?;
        }
        rustix::fs::utimensat(dir, name, &timestamps(entry), AtFlags::SYMLINK_NOFOLLOW)
    }
}

fn timestamps(entry: &Entry) -> Timestamps {
    let time = rustix::fs::Timespec {
        tv_sec: entry.mtime_seconds,
        tv_nsec: entry.mtime_nanos.into(),
    };
    Timestamps {
        last_access: time,
        last_modification: time,
    }
}

/// Owner, then mode (so setuid/setgid survive the chown), xattrs, times.
fn apply_metadata_fd(fd: &OwnedFd, entry: &Entry, options: &RestoreOptions) -> Result<(), Errno> {
    if options.restore_owners {
        rustix::fs::fchown(
            fd,
            Some(rustix::fs::Uid::from_raw(entry.uid)),
            Some(rustix::fs::Gid::from_raw(entry.gid)),
        )?;
    }
    rustix::fs::fchmod(fd, Mode::from_raw_mode(entry.mode & 0o7777))?;
    for xattr in &entry.xattrs {
        if options
            .xattr_prefixes
            .iter()
            .any(|prefix| xattr.name.starts_with(prefix))
        {
            match rustix::fs::fsetxattr(
                fd,
                xattr.name.as_slice(),
                &xattr.value,
                rustix::fs::XattrFlags::empty(),
            ) {
                Ok(()) | Err(Errno::NOTSUP) => {}
                Err(error) => return Err(error),
            }
        }
    }
    rustix::fs::futimens(fd, &timestamps(entry))
}

/// Remove an entry of `dir`, recursively for directories, never following
/// a symlink.
fn remove_entry(dir: &OwnedFd, name: &[u8]) -> Result<(), Errno> {
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) => return Ok(()),
        Err(Errno::ISDIR) | Err(Errno::PERM) => {}
        Err(error) => return Err(error),
    }
    let child = rustix::fs::openat(
        dir,
        name,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for child_name in scan::list_directory(&child)? {
        remove_entry(&child, &child_name)?;
    }
    rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
}

/// Plan and write the batches the walker sends, until it stops sending.
async fn write_batches(
    shared: Arc<Shared>,
    index: Arc<BlobIndex>,
    mut batches: mpsc::Receiver<Batch>,
) -> Result<(), EngineError> {
    let max_chunk_bytes = shared.repository.config().chunker.max_bytes;
    let sizes = shared.sizes;
    let workers = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(MAX_SCATTER_WORKERS)
        .min((sizes.decode_buffer_bytes / u64::from(max_chunk_bytes.max(1))) as usize)
        .max(1);
    let (jobs, queued_jobs) = mpsc::channel::<Job>(SCATTER_JOBS_QUEUED);
    let queued_jobs = Arc::new(Mutex::new(queued_jobs));
    let mut worker_handles = Vec::with_capacity(workers);
    #[cfg(test)]
    let panics = tests::scatter_workers_panic_into(&shared.options.target);
    for _ in 0..workers {
        let queued = queued_jobs.clone();
        let work = move || {
            #[cfg(test)]
            if panics {
                panic!("a scatter worker panicked (as a test asked)");
            }
            run_scatter_worker(&queued)
        };
        match super::OwnThread::spawn("scatter-worker", work) {
            Ok(handle) => worker_handles.push(handle),
            Err(error) if worker_handles.is_empty() => return Err(error),
            Err(error) => {
                tracing::warn!(
                    workers = worker_handles.len(),
                    %error,
                    "restoring with the scatter workers started"
                );
                break;
            }
        }
    }
    let workers = worker_handles.len();
    // The workers hold the only receivers: if they all end (a panic), a
    // send fails instead of waiting for ever, and the join below says why.
    drop(queued_jobs);
    let limits = PlanLimits {
        max_read_bytes: sizes.max_pack_read_bytes,
        max_gap_bytes: DEFAULT_COALESCE_GAP_BYTES,
        max_chunk_bytes,
    };
    let buffers = Arc::new(ReadBuffers::new(
        sizes.pack_bytes_in_flight,
        sizes.max_pack_read_bytes,
    ));
    // Reads of the last batch held back to be fetched with the next one's
    // (plan::schedule_reads).
    let mut held = Vec::new();
    while let Some(batch) = batches.recv().await {
        if shared.cancel.is_cancelled() {
            break;
        }
        let context = WriteContext {
            shared: &shared,
            index: &index,
            limits: &limits,
            workers,
            jobs: &jobs,
            buffers: &buffers,
        };
        held = write_batch(&context, batch, held).await;
        // Every worker has ended (a panic): nothing more can be written,
        // so the walk stops here (it sees `batches` dropped below) rather
        // than create the rest of the tree's directories and files for
        // nothing, and the join below says why.
        if jobs.is_closed() {
            break;
        }
    }
    if !shared.cancel.is_cancelled() && !jobs.is_closed() {
        fetch_and_scatter(&shared, &jobs, &buffers, held).await;
    }
    // Dropping the receiver makes a walker still sending see the end.
    drop(batches);
    drop(jobs);
    for handle in worker_handles {
        handle.join().await;
    }
    Ok(())
}

/// Work for a scatter worker.
enum Job {
    /// Decode blobs of one pack read and write them where they go.
    Scatter(ScatterJob),
    /// Files that get no (more) writes: finish them.
    Finish {
        batch: Arc<BatchState>,
        files: Vec<u32>,
    },
    /// Blobs that could not be read: their files are not restored.
    Fail {
        batch: Arc<BatchState>,
        blobs: Vec<PlannedBlob>,
        message: String,
    },
}

/// Blobs of one pack read, with the read's bytes (shared by the jobs of
/// the read; the buffer goes back to its pool when the last one is done).
struct ScatterJob {
    batch: Arc<BatchState>,
    pack: ObjectId,
    /// Offset of `bytes` in the pack.
    read_start: u64,
    bytes: Arc<ReadBuffer>,
    blobs: Vec<PlannedBlob>,
}

fn run_scatter_worker(jobs: &Mutex<mpsc::Receiver<Job>>) {
    // The one plaintext buffer of this worker, reused for every blob.
    let mut plaintext = Vec::new();
    loop {
        let job = jobs.lock().expect("job queue").blocking_recv();
        match job {
            None => return,
            Some(Job::Scatter(job)) => job.run(&mut plaintext),
            Some(Job::Finish { batch, files }) => {
                for file in files {
                    batch.finish_unwritten(file);
                }
            }
            Some(Job::Fail {
                batch,
                blobs,
                message,
            }) => {
                for blob in &blobs {
                    for target in &blob.targets {
                        batch.fail_target(*target, &message);
                    }
                }
            }
        }
    }
}

impl ScatterJob {
    fn run(self, plaintext: &mut Vec<u8>) {
        let shared = &self.batch.shared;
        for blob in &self.blobs {
            if shared.cancel.is_cancelled() {
                return;
            }
            let range = blob.stored_range();
            let stored = usize::try_from(range.start - self.read_start)
                .ok()
                .and_then(|from| {
                    self.bytes
                        .data
                        .get(from..from + (range.end - range.start) as usize)
                });
            let decoded = match stored {
                Some(stored) => shared.repository.decode_blob_into(
                    &blob.id,
                    &self.pack,
                    &blob.location,
                    stored,
                    plaintext,
                ),
                None => Err(EngineError::BlobDamaged {
                    pack: self.pack,
                    blob: blob.id,
                    reason: "the store returned fewer bytes than asked for".into(),
                }),
            };
            match decoded {
                Ok(plaintext) => {
                    for target in &blob.targets {
                        self.batch.write_target(*target, plaintext);
                    }
                }
                Err(error) => {
                    let message = format!("not restored, its data is damaged: {error}");
                    for target in &blob.targets {
                        self.batch.fail_target(*target, &message);
                    }
                }
            }
        }
    }
}

/// What the writer of batches works with.
struct WriteContext<'a> {
    shared: &'a Arc<Shared>,
    index: &'a Arc<BlobIndex>,
    limits: &'a PlanLimits,
    workers: usize,
    jobs: &'a mpsc::Sender<Job>,
    buffers: &'a Arc<ReadBuffers>,
}

/// A read of the batches being written.
type Read = BatchedRead<Arc<BatchState>>;

/// Find what a batch's files need, plan the pack reads, fetch them (with
/// the reads `held` back from the previous batch) and queue their blobs
/// for the scatter workers. Returns once every read is queued (the
/// workers may still be writing), with the reads held back for the next
/// batch.
async fn write_batch(context: &WriteContext<'_>, batch: Batch, held: Vec<Read>) -> Vec<Read> {
    let WriteContext {
        shared,
        index,
        limits,
        workers,
        jobs,
        buffers,
    } = *context;
    let Batch {
        directories, files, ..
    } = batch;
    let directories = Arc::new(directories);
    let (slots, needs) = if shared.options.sync {
        compare_existing_files(shared, &directories, files, workers).await
    } else {
        new_files(shared, files)
    };
    let file_count = slots.len() as u32;
    let plan = {
        let index = index.clone();
        let limits = *limits;
        super::run_blocking(move || {
            plan::plan_pack_reads(
                file_count,
                &needs,
                |id| {
                    index
                        .get(id)
                        .map(|location| (index.pack_of(location), *location))
                },
                &limits,
            )
        })
        .await
    };
    let ReadPlan {
        reads,
        writes_per_file,
        unrestorable,
    } = plan;
    let mut slots = slots;
    for (file, remaining) in writes_per_file.iter().enumerate() {
        slots[file].state.get_mut().expect("file state").remaining = *remaining;
    }
    for (file, problem) in unrestorable {
        let error = match problem {
            Unrestorable::Missing { blob } => EngineError::BlobMissing {
                blob,
                context: "a snapshot".into(),
            },
            Unrestorable::Damaged { blob, pack, reason } => {
                EngineError::BlobDamaged { pack, blob, reason }
            }
        };
        let state = slots[file as usize].state.get_mut().expect("file state");
        state.failure.get_or_insert(FileFailure::Content(format!(
            "not restored, its data is damaged: {error}"
        )));
    }
    let unwritten: Vec<u32> = slots
        .iter_mut()
        .enumerate()
        .filter_map(|(file, slot)| {
            (slot.state.get_mut().expect("file state").remaining == 0).then_some(file)
        })
        .map(|file| file as u32)
        .collect();
    let batch = Arc::new(BatchState {
        shared: shared.clone(),
        directories,
        files: slots,
    });
    for files in unwritten.chunks(FILES_PER_JOB) {
        let job = Job::Finish {
            batch: batch.clone(),
            files: files.to_vec(),
        };
        if jobs.send(job).await.is_err() {
            return Vec::new();
        }
    }

    let ScheduledReads { fetch, hold } =
        plan::schedule_reads(held, batch, reads, |pack| index.blobs_end(pack), limits);
    fetch_and_scatter(shared, jobs, buffers, fetch).await;
    hold
}

/// Fetch `reads` and queue their blobs for the scatter workers.
async fn fetch_and_scatter(
    shared: &Shared,
    jobs: &mpsc::Sender<Job>,
    buffers: &Arc<ReadBuffers>,
    reads: Vec<Read>,
) {
    // Unordered: a read that has its bytes is handed on at once. (In order,
    // the first read could wait for a buffer that later reads hold while
    // they wait to be handed on after it.)
    let mut fetched = futures::stream::iter(reads)
        .map(|read| fetch_read(shared, buffers, read))
        .buffer_unordered(PACK_READS_IN_FLIGHT);
    while let Some((read, result)) = fetched.next().await {
        if shared.cancel.is_cancelled() {
            return;
        }
        let queued = match result {
            Ok(bytes) => queue_scatter_jobs(jobs, read, bytes).await,
            Err(error) => read_blob_by_blob(shared, jobs, read, error).await,
        };
        if queued.is_err() {
            return;
        }
    }
}

/// Fetch one planned read into a buffer of the pool.
async fn fetch_read(
    shared: &Shared,
    buffers: &Arc<ReadBuffers>,
    read: Read,
) -> (Read, Result<ReadBuffer, StoreError>) {
    let result = read_into_buffer(shared, buffers, &read.pack, read.range.clone()).await;
    (read, result)
}

/// Read `range` of `pack` into a buffer taken from `buffers`.
async fn read_into_buffer(
    shared: &Shared,
    buffers: &Arc<ReadBuffers>,
    pack: &ObjectId,
    range: Range<u64>,
) -> Result<ReadBuffer, StoreError> {
    let buffer = buffers.take(range.end - range.start).await;
    let data = shared
        .repository
        .store()
        .get_range_into(&repo::pack_key(pack), range, buffer)
        .await?;
    Ok(ReadBuffer {
        data,
        pool: Some(buffers.clone()),
    })
}

/// Cut a read into jobs of about [`SCATTER_JOB_BYTES`] of plaintext, so
/// that every worker takes a share of one pack.
async fn queue_scatter_jobs(
    jobs: &mpsc::Sender<Job>,
    read: Read,
    bytes: ReadBuffer,
) -> Result<(), mpsc::error::SendError<Job>> {
    let bytes = Arc::new(bytes);
    for (batch, part) in read.parts {
        let mut blobs = Vec::new();
        let mut job_bytes = 0;
        let total = part.len();
        for (position, blob) in part.into_iter().enumerate() {
            job_bytes += blob.written_bytes();
            blobs.push(blob);
            if job_bytes >= SCATTER_JOB_BYTES || position + 1 == total {
                jobs.send(Job::Scatter(ScatterJob {
                    batch: batch.clone(),
                    pack: read.pack,
                    read_start: read.range.start,
                    bytes: bytes.clone(),
                    blobs: std::mem::take(&mut blobs),
                }))
                .await?;
                job_bytes = 0;
            }
        }
    }
    Ok(())
}

/// What to change after `errno`, when it is a want of descriptors (EMFILE,
/// ENFILE): said after the problem's message; nothing otherwise.
fn remedy_of(errno: Errno) -> String {
    if matches!(errno, Errno::MFILE | Errno::NFILE) {
        let error = std::io::Error::from_raw_os_error(errno.raw_os_error());
        format!(" ({})", crate::store::out_of_descriptors_remedy_now(&error))
    } else {
        String::new()
    }
}

/// Why a blob was not read, for the problem of each file that needs it: a
/// want of this process's descriptors is said as one, not as data that
/// could not be read (the store's message then says what to change).
fn why_not_read(error: &StoreError) -> &'static str {
    if error.cause() == FailureCause::OutOfDescriptors {
        "this process had no file descriptor free to read its data (raise the limit, \
         then restore again: into the same directory, with --sync on the command line, it \
         writes only what is missing)"
    } else {
        "its data could not be read"
    }
}

/// A read failed as a whole: read its blobs one by one, so that only the
/// files whose blobs cannot be read are lost (a truncated pack still gives
/// the blobs before the damage). These reads do not take buffers of the
/// pool (other reads in flight may hold all of it while this one waits):
/// one blob at a time, beyond the budget, on this rare path.
async fn read_blob_by_blob(
    shared: &Shared,
    jobs: &mpsc::Sender<Job>,
    read: Read,
    error: StoreError,
) -> Result<(), mpsc::error::SendError<Job>> {
    tracing::debug!(pack = %read.pack, error = %error, "pack read failed, reading its blobs one by one");
    let blobs = read
        .parts
        .into_iter()
        .flat_map(|(batch, blobs)| blobs.into_iter().map(move |blob| (batch.clone(), blob)));
    for (batch, blob) in blobs {
        let range = blob.stored_range();
        let result = if error.is_not_found() {
            Err((why_not_read(&error), error.to_string()))
        } else {
            shared
                .repository
                .store()
                .get_range_into(&repo::pack_key(&read.pack), range.clone(), Vec::new())
                .await
                .map(|data| ReadBuffer { data, pool: None })
                .map_err(|error| (why_not_read(&error), error.to_string()))
        };
        let job = match result {
            Ok(bytes) => Job::Scatter(ScatterJob {
                batch,
                pack: read.pack,
                read_start: range.start,
                bytes: Arc::new(bytes),
                blobs: vec![blob],
            }),
            Err((why, message)) => Job::Fail {
                batch,
                message: format!(
                    "not restored, {why}: failed to read blob {} from pack {}: {message}",
                    blob.id, read.pack
                ),
                blobs: vec![blob],
            },
        };
        jobs.send(job).await?;
    }
    Ok(())
}

/// The buffers of pack reads: taken for a read, given back when its blobs
/// are written, reused for the whole restore. Their capacities together
/// never exceed the budget, so neither do the bytes in flight.
struct ReadBuffers {
    budget: u64,
    /// The longest read.
    max_read: u64,
    state: Mutex<ReadBuffersState>,
    returned: Notify,
}

#[derive(Default)]
struct ReadBuffersState {
    free: Vec<Vec<u8>>,
    /// Capacity of every buffer handed out or free.
    allocated: u64,
}

impl ReadBuffers {
    fn new(budget: u64, max_read: u64) -> Self {
        ReadBuffers {
            budget,
            max_read,
            state: Mutex::new(ReadBuffersState::default()),
            returned: Notify::new(),
        }
    }

    /// An empty buffer of at least `length` bytes of capacity, waiting for
    /// one to come back when the budget is used up. `length` is at most the
    /// budget (a read is at most `max_read`).
    async fn take(&self, length: u64) -> Vec<u8> {
        let length = length.min(self.budget);
        loop {
            // Registered before looking, so a buffer given back in between
            // is not missed.
            let returned = self.returned.notified();
            {
                let mut state = self.state.lock().expect("read buffers");
                if let Some(position) = state
                    .free
                    .iter()
                    .position(|buffer| buffer.capacity() as u64 >= length)
                {
                    return state.free.swap_remove(position);
                }
                // Reads of a whole pack (most of them) get buffers of the
                // largest read, so that any later read fits them.
                let capacity = if length > self.max_read / 2 {
                    self.max_read.min(self.budget).max(length)
                } else {
                    length.next_power_of_two()
                };
                while state.allocated + capacity > self.budget {
                    // Free buffers too small for this read make room.
                    let Some(small) = state.free.pop() else {
                        break;
                    };
                    state.allocated -= small.capacity() as u64;
                }
                if state.allocated + capacity <= self.budget {
                    state.allocated += capacity;
                    return Vec::with_capacity(capacity as usize);
                }
            }
            returned.await;
        }
    }

    fn give(&self, buffer: Vec<u8>) {
        let mut state = self.state.lock().expect("read buffers");
        state.free.push(buffer);
        drop(state);
        self.returned.notify_waiters();
    }
}

/// Bytes of one pack read, in a buffer of [`ReadBuffers`] (or of its own).
struct ReadBuffer {
    data: Vec<u8>,
    pool: Option<Arc<ReadBuffers>>,
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give(std::mem::take(&mut self.data));
        }
    }
}

/// Plain restore: every chunk of every file is needed (holes are left as
/// holes); nothing is on disk yet.
fn new_files(shared: &Shared, files: Vec<BatchFile>) -> (Vec<FileSlot>, Vec<ChunkNeed>) {
    let mut needs = Vec::new();
    let mut slots = Vec::with_capacity(files.len());
    for (
        file,
        BatchFile {
            directory,
            mut entry,
            ..
        },
    ) in files.into_iter().enumerate()
    {
        let content = std::mem::take(&mut entry.content);
        let holes = needs_of_content(file as u32, &content, &mut needs);
        Progress::add(&shared.progress.bytes_done, holes);
        slots.push(FileSlot::new(directory, entry, None, 0));
    }
    (slots, needs)
}

/// Push what `content` needs at each offset; returns the bytes of holes.
fn needs_of_content(file: u32, content: &[Extent], needs: &mut Vec<ChunkNeed>) -> u64 {
    let mut offset = 0;
    let mut holes = 0;
    for extent in content {
        match extent {
            Extent::Chunk(blob, length) => needs.push(ChunkNeed {
                file,
                offset,
                blob: *blob,
                length: *length,
            }),
            Extent::Hole(length) => holes += length,
        }
        offset += extent.length();
    }
    holes
}

/// Sync mode: compare each file of the batch with what the target holds,
/// [`FILES_PER_JOB`] files per blocking job, `workers` jobs at once.
async fn compare_existing_files(
    shared: &Arc<Shared>,
    directories: &Arc<BatchDirectories>,
    files: Vec<BatchFile>,
    workers: usize,
) -> (Vec<FileSlot>, Vec<ChunkNeed>) {
    let mut groups = Vec::new();
    let mut files = files.into_iter();
    loop {
        let group: Vec<BatchFile> = files.by_ref().take(FILES_PER_JOB).collect();
        if group.is_empty() {
            break;
        }
        groups.push(group);
    }
    let mut compared = futures::stream::iter(groups.into_iter().enumerate())
        .map(|(number, group)| {
            let shared = shared.clone();
            let directories = directories.clone();
            super::run_blocking(move || {
                let first = (number * FILES_PER_JOB) as u32;
                let mut needs = Vec::new();
                let slots: Vec<FileSlot> = group
                    .into_iter()
                    .enumerate()
                    .map(|(position, file)| {
                        compare_existing_file(
                            &shared,
                            &directories[file.directory as usize].fd,
                            first + position as u32,
                            file,
                            &mut needs,
                        )
                    })
                    .collect();
                (slots, needs)
            })
        })
        .buffered(workers);
    let mut slots = Vec::new();
    let mut needs = Vec::new();
    while let Some((group_slots, group_needs)) = compared.next().await {
        slots.extend(group_slots);
        needs.extend(group_needs);
    }
    (slots, needs)
}

/// Sync mode, one file: keep the chunks that already match, punch the holes
/// that are not holes yet, and push the chunks that must be written.
fn compare_existing_file(
    shared: &Shared,
    dir: &OwnedFd,
    file: u32,
    BatchFile {
        directory,
        mut entry,
        unchanged_since,
    }: BatchFile,
    needs: &mut Vec<ChunkNeed>,
) -> FileSlot {
    let content = std::mem::take(&mut entry.content);
    let first_need = needs.len();
    match compare_with_target(shared, dir, file, &entry, &content, unchanged_since, needs) {
        Ok((existing, written)) => FileSlot::new(directory, entry, existing, written),
        Err(failure) => {
            needs.truncate(first_need);
            let slot = FileSlot::new(directory, entry, None, 0);
            slot.state.lock().expect("file state").failure = Some(failure);
            slot
        }
    }
}

/// What [`compare_existing_file`] found on disk, and the bytes it changed.
#[allow(
    clippy::too_many_arguments,
    reason = "one file's comparison and where its needs go, named"
)]
fn compare_with_target(
    shared: &Shared,
    dir: &OwnedFd,
    file: u32,
    entry: &Entry,
    content: &[Extent],
    unchanged_since: bool,
    needs: &mut Vec<ChunkNeed>,
) -> Result<(Option<ExistingFile>, u64), FileFailure> {
    let name = entry.name.as_slice();
    let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat)
            if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                == rustix::fs::FileType::RegularFile =>
        {
            stat
        }
        Ok(_) => {
            remove_entry(dir, name)
                .map_err(|e| FileFailure::Io("replace the existing entry", e))?;
            let holes = needs_of_content(file, content, needs);
            Progress::add(&shared.progress.bytes_done, holes);
            return Ok((None, 0));
        }
        Err(Errno::NOENT) => {
            let holes = needs_of_content(file, content, needs);
            Progress::add(&shared.progress.bytes_done, holes);
            return Ok((None, 0));
        }
        Err(error) => return Err(FileFailure::Io("inspect the existing entry", error)),
    };
    if unchanged_since && on_disk_as_restored(&stat, entry, shared.options.restore_owners) {
        Progress::add(&shared.progress.bytes_done, entry.size);
        shared.outcome.lock().expect("outcome").files_not_read += 1;
        return Ok((
            Some(ExistingFile {
                size: entry.size,
                metadata_matches: true,
            }),
            0,
        ));
    }
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| FileFailure::Io("open the existing file", e))?;
    let existing_size = stat.st_size as u64;
    let mut offset = 0u64;
    let mut written = 0u64;
    for extent in content {
        if shared.cancel.is_cancelled() {
            return Err(FileFailure::Cancelled);
        }
        let length = extent.length();
        match extent {
            Extent::Hole(_) => {
                if offset < existing_size {
                    let end = (offset + length).min(existing_size);
                    if !region_is_zero(&fd, offset, end - offset)? {
                        punch_hole(shared, &fd, offset, end - offset)?;
                        written += end - offset;
                    }
                }
                Progress::add(&shared.progress.bytes_done, length);
            }
            Extent::Chunk(id, chunk_length) => {
                let same = offset + length <= existing_size
                    && region_matches(shared, &fd, offset, length, id)?;
                if same {
                    Progress::add(&shared.progress.bytes_done, length);
                } else {
                    needs.push(ChunkNeed {
                        file,
                        offset,
                        blob: *id,
                        length: *chunk_length,
                    });
                }
            }
        }
        offset += length;
    }
    let metadata_matches = (stat.st_mode & 0o7777) == entry.mode
        && (!shared.options.restore_owners
            || (stat.st_uid == entry.uid && stat.st_gid == entry.gid))
        && stat.st_mtime == entry.mtime_seconds
        && stat.st_mtime_nsec as u32 == entry.mtime_nanos;
    Ok((
        Some(ExistingFile {
            size: existing_size,
            metadata_matches,
        }),
        written,
    ))
}

/// A batch being written: its directories and the state of each file.
struct BatchState {
    shared: Arc<Shared>,
    directories: Arc<BatchDirectories>,
    files: Vec<FileSlot>,
}

/// One file of a batch.
struct FileSlot {
    directory: u32,
    /// Its entry, without the content (the plan has it).
    entry: Entry,
    /// Sync mode: what the target already held.
    existing: Option<ExistingFile>,
    state: Mutex<WriteState>,
}

/// A regular file found in the target by a sync restore.
#[derive(Debug, Clone, Copy)]
struct ExistingFile {
    size: u64,
    metadata_matches: bool,
}

#[derive(Debug, Default)]
struct WriteState {
    /// Open while more writes are expected, if [`RestoreShare::open_files`]
    /// allows.
    fd: Option<OwnedFd>,
    /// The file exists in the target (created by this restore, or found
    /// by a sync restore): opened again without `O_CREAT`.
    on_disk: bool,
    /// Writes still to come; the file is finished when this reaches 0.
    remaining: u32,
    /// Bytes written (and, in sync mode, holes punched).
    written: u64,
    /// End of the furthest write: the file's size without a truncate.
    written_end: u64,
    /// Set once something failed; later writes are skipped.
    failure: Option<FileFailure>,
}

#[derive(Debug)]
enum FileFailure {
    /// The content cannot be had (a blob missing, damaged or unreadable):
    /// the file is removed; the message says why.
    Content(String),
    Io(&'static str, Errno),
    Cancelled,
}

impl FileSlot {
    fn new(directory: u32, entry: Entry, existing: Option<ExistingFile>, written: u64) -> Self {
        FileSlot {
            directory,
            entry,
            existing,
            state: Mutex::new(WriteState {
                on_disk: existing.is_some(),
                written,
                ..WriteState::default()
            }),
        }
    }
}

impl BatchState {
    fn path_of(&self, slot: &FileSlot) -> Components {
        let mut path = self.directories[slot.directory as usize].path.clone();
        path.push(slot.entry.name.clone());
        path
    }

    /// Write one blob's plaintext at one target; finish the file if that
    /// was its last write.
    fn write_target(&self, target: Target, data: &[u8]) {
        let slot = &self.files[target.file as usize];
        let mut state = slot.state.lock().expect("file state");
        if state.failure.is_none()
            && let Err(failure) = self.write_locked(slot, &mut state, target.offset, data)
        {
            state.failure = Some(failure);
        }
        Progress::add(&self.shared.progress.bytes_done, data.len() as u64);
        self.count_down(target.file, state);
    }

    /// A target whose blob cannot be had: the file is not restored.
    fn fail_target(&self, target: Target, message: &str) {
        let slot = &self.files[target.file as usize];
        let mut state = slot.state.lock().expect("file state");
        state
            .failure
            .get_or_insert_with(|| FileFailure::Content(message.to_string()));
        self.count_down(target.file, state);
    }

    fn count_down(&self, file: u32, mut state: MutexGuard<'_, WriteState>) {
        state.remaining = state.remaining.saturating_sub(1);
        if state.remaining == 0 {
            self.finish(file, state);
        } else if state.fd.is_some()
            && self.shared.open_files.load(Ordering::Relaxed) > self.shared.descriptors().open_files
        {
            state.fd = None;
            self.shared.open_files.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A file the plan gave no writes (empty, all holes, unchanged, or not
    /// restorable).
    fn finish_unwritten(&self, file: u32) {
        let state = self.files[file as usize].state.lock().expect("file state");
        self.finish(file, state);
    }

    fn write_locked(
        &self,
        slot: &FileSlot,
        state: &mut WriteState,
        offset: u64,
        data: &[u8],
    ) -> Result<(), FileFailure> {
        let existing_size = slot.existing.map_or(0, |existing| existing.size);
        if offset >= existing_size && data.iter().all(|byte| *byte == 0) {
            // Beyond what the target held: a hole reads as these zeros.
            return Ok(());
        }
        let fd = self.open(slot, state)?;
        write_at(&self.shared, fd, data, offset)?;
        state.written += data.len() as u64;
        state.written_end = state.written_end.max(offset + data.len() as u64);
        Ok(())
    }

    /// The file's descriptor, opening (and the first time creating) it.
    fn open<'s>(
        &self,
        slot: &FileSlot,
        state: &'s mut WriteState,
    ) -> Result<&'s OwnedFd, FileFailure> {
        if state.fd.is_none() {
            let dir = &self.directories[slot.directory as usize].fd;
            let name = slot.entry.name.as_slice();
            let fd = if state.on_disk {
                rustix::fs::openat(
                    dir,
                    name,
                    OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| FileFailure::Io("open the file", e))?
            } else {
                rustix::fs::openat(
                    dir,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| FileFailure::Io("create the file", e))?
            };
            state.on_disk = true;
            self.shared.open_files.fetch_add(1, Ordering::Relaxed);
            state.fd = Some(fd);
        }
        Ok(state.fd.as_ref().expect("opened above"))
    }

    /// All writes of a file are done: set its size and attributes (or
    /// remove it, if its content could not be had) and record the outcome.
    fn finish(&self, file: u32, mut state: MutexGuard<'_, WriteState>) {
        let slot = &self.files[file as usize];
        let result = match state.failure.take() {
            Some(failure) => Err(failure),
            None => self.complete(slot, &mut state),
        };
        if state.fd.take().is_some() {
            self.shared.open_files.fetch_sub(1, Ordering::Relaxed);
        }
        let written = state.written;
        let on_disk = state.on_disk;
        drop(state);
        let shared = &self.shared;
        let entry = &slot.entry;
        match result {
            Ok(()) => {
                {
                    let mut outcome = shared.outcome.lock().expect("outcome");
                    outcome.files += 1;
                    if written == 0 && shared.options.sync && entry.size > 0 {
                        outcome.files_unchanged += 1;
                    }
                    outcome.bytes_written += written;
                }
                if entry.links > 1 {
                    shared
                        .first_links
                        .lock()
                        .expect("links")
                        .insert((entry.device, entry.inode), self.path_of(slot));
                }
            }
            Err(FileFailure::Cancelled) => return,
            Err(FileFailure::Content(message)) => {
                // Never leave a file with damaged content behind.
                if on_disk {
                    let dir = &self.directories[slot.directory as usize].fd;
                    let _ = rustix::fs::unlinkat(dir, entry.name.as_slice(), AtFlags::empty());
                }
                shared.problem(display(&self.path_of(slot)), message);
            }
            Err(FileFailure::Io(step, errno)) => shared.problem(
                display(&self.path_of(slot)),
                format!("not restored: cannot {step}: {errno}{}", remedy_of(errno)),
            ),
        }
        Progress::add(&shared.progress.files_done, 1);
    }

    fn complete(&self, slot: &FileSlot, state: &mut WriteState) -> Result<(), FileFailure> {
        let entry = &slot.entry;
        let wrong_size = match slot.existing {
            Some(existing) => existing.size != entry.size,
            None => state.written_end != entry.size,
        };
        let metadata_matches = slot
            .existing
            .is_some_and(|existing| existing.metadata_matches);
        let set_metadata = state.written > 0 || !metadata_matches;
        if state.on_disk && state.fd.is_none() && !wrong_size && !set_metadata {
            return Ok(());
        }
        let fd = self.open(slot, state)?;
        if wrong_size {
            rustix::fs::ftruncate(fd, entry.size)
                .map_err(|e| FileFailure::Io("set the file size", e))?;
        }
        if set_metadata {
            apply_metadata_fd(fd, entry, &self.shared.options)
                .map_err(|e| FileFailure::Io("set attributes", e))?;
        }
        Ok(())
    }
}

fn read_at(fd: &OwnedFd, offset: u64, length: u64) -> Result<Vec<u8>, FileFailure> {
    let mut buffer = vec![0u8; length as usize];
    let mut done = 0usize;
    while done < buffer.len() {
        match rustix::io::pread(fd, &mut buffer[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(read) => done += read,
            Err(Errno::INTR) => continue,
            Err(error) => return Err(FileFailure::Io("read the existing file", error)),
        }
    }
    buffer.truncate(done);
    Ok(buffer)
}

fn region_matches(
    shared: &Shared,
    fd: &OwnedFd,
    offset: u64,
    length: u64,
    id: &crate::repo::BlobId,
) -> Result<bool, FileFailure> {
    let existing = read_at(fd, offset, length)?;
    Ok(existing.len() as u64 == length && shared.repository.keys().blob_id(&existing) == *id)
}

fn region_is_zero(fd: &OwnedFd, offset: u64, length: u64) -> Result<bool, FileFailure> {
    let mut position = offset;
    while position < offset + length {
        let step = (offset + length - position).min(4 * MIB);
        let data = read_at(fd, position, step)?;
        if data.iter().any(|byte| *byte != 0) {
            return Ok(false);
        }
        position += step;
    }
    Ok(true)
}

fn punch_hole(shared: &Shared, fd: &OwnedFd, offset: u64, length: u64) -> Result<(), FileFailure> {
    use rustix::fs::FallocateFlags;
    match rustix::fs::fallocate(
        fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        length,
    ) {
        Ok(()) => Ok(()),
        Err(_) => {
            let zeros = vec![0u8; length.min(4 * MIB) as usize];
            let mut position = offset;
            while position < offset + length {
                let step = (offset + length - position).min(zeros.len() as u64) as usize;
                write_at(shared, fd, &zeros[..step], position)?;
                position += step as u64;
            }
            Ok(())
        }
    }
}

fn write_at(shared: &Shared, fd: &OwnedFd, data: &[u8], offset: u64) -> Result<(), FileFailure> {
    let throttle = &shared.options.write_throttle;
    let step = throttle.max_request_bytes();
    let mut done = 0usize;
    while done < data.len() {
        let piece = (data.len() - done).min(step);
        throttle.acquire_blocking(&shared.handle, piece);
        match rustix::io::pwrite(fd.as_fd(), &data[done..done + piece], offset + done as u64) {
            Ok(count) => {
                done += count;
                Progress::add(&shared.progress.bytes_transferred, count as u64);
            }
            Err(Errno::INTR) => continue,
            Err(error) => return Err(FileFailure::Io("write the file", error)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    /// Targets whose restores start scatter workers that panic at once.
    static PANICKING_SCATTER_WORKERS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    /// Whether the scatter workers of a restore into `target` are to panic.
    pub(super) fn scatter_workers_panic_into(target: &std::path::Path) -> bool {
        PANICKING_SCATTER_WORKERS
            .lock()
            .expect("targets")
            .iter()
            .any(|panicking| panicking == target)
    }

    /// Entries (files and directories) under `dir`.
    fn entries_under(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir).map_or(0, |entries| {
            entries
                .map(|entry| entry.expect("entry").path())
                .map(|path| {
                    1 + if path.is_dir() {
                        entries_under(&path)
                    } else {
                        0
                    }
                })
                .sum()
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restore_whose_scatter_workers_all_panicked_stops_its_walk_and_raises_the_panic() {
        let dir = tempfile::tempdir().expect("temp dir");
        let source = dir.path().join("source");
        // 500 directories of 60 one-byte files: 30,000 files, 35 batches
        // of the smallest share's 855 files.
        for directory in 0..500 {
            let path = source.join(format!("d{directory:03}"));
            std::fs::create_dir_all(&path).expect("mkdir");
            for file in 0..60 {
                std::fs::write(path.join(format!("f{file:02}")), [file as u8]).expect("write");
            }
        }
        let store: crate::store::DynStore = Arc::new(crate::store::local::LocalStore::new(
            dir.path().join("repo"),
        ));
        let repository = Repository::init(store, crate::engine::Encryption::None)
            .await
            .expect("init");
        let snapshot = crate::engine::backup::backup(
            &repository,
            crate::engine::backup::BackupOptions::new(&source),
            Arc::new(Progress::default()),
            CancellationToken::new(),
        )
        .await
        .expect("backup")
        .snapshot_id;
        let target = dir.path().join("target");
        PANICKING_SCATTER_WORKERS
            .lock()
            .expect("targets")
            .push(target.clone());
        let mut options = RestoreOptions::new(&target);
        options.memory = EngineMemory::new(haulage_api::transfer::SMALLEST_VOLUME_SHARE_BYTES);
        let restored = tokio::spawn(async move {
            restore(
                &repository,
                &snapshot,
                options,
                Arc::new(Progress::default()),
                CancellationToken::new(),
            )
            .await
        })
        .await;
        let panic = restored.expect_err("the workers' panic goes on in the caller");
        assert!(panic.is_panic(), "{panic}");
        // The walk stopped after the few batches it had made ready (the
        // workers create the files, so only directories are there): it did
        // not go on creating the directories of a tree that nothing would
        // fill (all 500 before).
        let created = entries_under(&target);
        assert!(
            created < 500 / 2,
            "{created} of 500 directories created after the workers were gone"
        );
    }

    fn buffer(pool: &Arc<ReadBuffers>, data: Vec<u8>) -> ReadBuffer {
        ReadBuffer {
            data,
            pool: Some(pool.clone()),
        }
    }

    #[test]
    fn a_batch_holds_its_first_directories_freely_and_takes_the_rest_from_the_budget_giving_them_back()
     {
        let fd = Arc::new(
            rustix::fs::open(".", OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
                .expect("open ."),
        );
        let budget: &'static DescriptorBudget = Box::leak(Box::new(DescriptorBudget::new()));
        let free = descriptors::FREE_BATCH_DIRECTORIES;
        let hold = |directories: &mut BatchDirectories, most: usize, limit: usize| {
            let room = directories.room_for_one_more(most, free, || limit);
            if room {
                directories.held.push(BatchDirectory {
                    fd: fd.clone(),
                    path: Vec::new(),
                });
            }
            room
        };
        let mut directories = BatchDirectories::taking_from(budget);
        // The first ones cost nothing from the budget.
        assert!((0..free).all(|_| hold(&mut directories, 1_024, 0)));
        assert_eq!(budget.taken(), 0);
        // Then each one more is taken, until the budget is spent...
        assert!((0..3).all(|_| hold(&mut directories, 1_024, 3)));
        assert!(!hold(&mut directories, 1_024, 3));
        assert_eq!(directories.len(), free + 3);
        assert_eq!(budget.taken(), 3);
        // ... or the batch holds its most.
        let mut small = BatchDirectories::taking_from(budget);
        assert!((0..10).all(|_| hold(&mut small, 10, 0)));
        assert!(!hold(&mut small, 10, 100));
        assert_eq!(budget.taken(), 3);
        // Another batch takes what the first gives back.
        let mut next = BatchDirectories::taking_from(budget);
        assert!((0..free).all(|_| hold(&mut next, 1_024, 3)));
        assert!(!hold(&mut next, 1_024, 3));
        drop(directories);
        assert_eq!(budget.taken(), 0);
        assert!(hold(&mut next, 1_024, 3));
    }

    #[test]
    fn a_blob_unread_for_want_of_a_descriptor_is_not_said_to_be_unreadable_data() {
        let out_of_descriptors = StoreError::Transient {
            location: "file:///nowhere".into(),
            operation: "get",
            key: "data/ab".into(),
            message: "Too many open files (os error 24)".into(),
            cause: FailureCause::OutOfDescriptors,
        };
        assert!(why_not_read(&out_of_descriptors).contains("no file descriptor free"));
        let missing = StoreError::NotFound {
            location: "file:///nowhere".into(),
            key: "data/ab".into(),
        };
        assert_eq!(why_not_read(&missing), "its data could not be read");
        assert!(remedy_of(Errno::MFILE).contains("move fewer volumes at once"));
        assert!(remedy_of(Errno::NFILE).contains("sysctl fs.file-max"));
        assert_eq!(remedy_of(Errno::ACCESS), "");
    }

    #[tokio::test]
    async fn a_read_buffer_given_back_is_reused_and_the_budget_is_never_exceeded() {
        let pool = Arc::new(ReadBuffers::new(
            2 * MAX_PACK_READ_BYTES,
            MAX_PACK_READ_BYTES,
        ));
        let first = pool.take(MAX_PACK_READ_BYTES).await;
        let address = first.as_ptr();
        let second = pool.take(MAX_PACK_READ_BYTES - 5).await;
        assert!(second.capacity() as u64 >= MAX_PACK_READ_BYTES);
        // The budget is spent: a third read waits.
        let mut third = Box::pin(pool.take(MIB));
        assert!((&mut third).now_or_never().is_none());
        drop(buffer(&pool, first));
        let reused = third.await;
        assert_eq!(reused.as_ptr(), address, "the returned buffer is reused");
        drop(buffer(&pool, reused));
        drop(buffer(&pool, second));
        let state = pool.state.lock().expect("state");
        assert_eq!(state.allocated, 2 * MAX_PACK_READ_BYTES);
        assert_eq!(state.free.len(), 2);
    }

    #[tokio::test]
    async fn small_free_read_buffers_make_room_for_a_large_read() {
        let pool = Arc::new(ReadBuffers::new(MAX_PACK_READ_BYTES, MAX_PACK_READ_BYTES));
        let small: Vec<Vec<u8>> = futures::future::join_all((0..4).map(|_| pool.take(MIB))).await;
        for data in small {
            drop(buffer(&pool, data));
        }
        let large = pool
            .take(MAX_PACK_READ_BYTES)
            .now_or_never()
            .expect("the free small buffers are released for it");
        assert!(large.capacity() as u64 >= MAX_PACK_READ_BYTES);
        let state = pool.state.lock().expect("state");
        assert!(state.allocated <= MAX_PACK_READ_BYTES);
    }
}
