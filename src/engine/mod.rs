//! Backup, restore and verify of a directory tree against a repository.
//!
//! - [`repository`]: an opened repository: config, index loading, blob and
//!   snapshot reading and writing over an [`crate::store::ObjectStore`].
//! - [`backup`]: walk → chunk → hash/dedup/compress (parallel, ordered) →
//!   pack → upload, then trees, index and snapshot.
//! - [`restore`]: snapshot → target directory, every chunk checked, no
//!   write outside the target.
//! - [`verify`]: re-read and check everything a snapshot references (or a
//!   sample of the packs).
//! - [`forget`]: apply a retention policy, delete snapshot manifests.
//! - [`prune`]: reclaim the space of data no snapshot references, safely
//!   beside running backups.
//! - [`lock`]: lock objects in the store (shared, exclusive, stale).
//! - [`verify_tree`]: check that a directory holds exactly a snapshot,
//!   entry by entry and chunk by chunk (what a restore is proven with).
//! - [`throttle`]: smooth bytes-per-second limits.
//! - [`buffers`]: reusable large buffers for the pipeline.
//! - [`descriptors`]: the open-file limit, and the share of it restores
//!   hold for their batches' directories.
//! - [`progress`]: counters shared with whoever displays progress.

pub use crate::throttle;
pub mod backup;
pub mod buffers;
pub mod descriptors;
pub mod forget;
pub mod lock;
pub mod memory;
pub mod progress;
pub mod prune;
pub mod repository;
pub mod restore;
pub mod scan;
pub mod since;
pub mod tree_cache;
pub mod tree_packs;
pub mod verify;
pub mod verify_tree;

use std::path::PathBuf;

use crate::repo::config::ConfigError;
use crate::repo::{BlobId, ObjectId};
use crate::store::StoreError;

pub use repository::{Encryption, KeySource, Password, PasswordSource, Repository};

/// Threads a runtime running the engine should allow for blocking work
/// (`tokio::runtime::Builder::max_blocking_threads`), shared by every
/// volume moving at once: short jobs that end on their own (backup: reads,
/// parallel chunks, pack finishing; restore: read planning, comparisons
/// of a sync, removals, tree decoding), while what lasts as long as a
/// volume has a thread of its own (`engine::OwnThread`). Few, because
/// every thread that
/// frees large buffers gets its own glibc malloc arena, which keeps them
/// resident: with tokio's default of 512 a 1 GiB restore peaked at 190 MiB
/// of RSS, with 8 at about 100 MiB.
pub const MAX_BLOCKING_THREADS: usize = 8;

/// Why a backup, restore or verify could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A storage operation failed.
    #[error("failed to {operation}: {source}")]
    Store {
        /// What haulage was doing.
        operation: String,
        /// The storage error.
        #[source]
        source: StoreError,
    },
    /// There is no repository config at the location.
    #[error("no haulage repository at {location}: run `haulage repo init --repo {location}` first")]
    NotARepository {
        /// The location.
        location: String,
    },
    /// `repo init` on an existing repository.
    #[error("a haulage repository already exists at {location}; nothing was changed")]
    AlreadyInitialized {
        /// The location.
        location: String,
    },
    /// The config cannot be used.
    #[error("repository at {location}: {source}")]
    Config {
        /// The location.
        location: String,
        /// What is wrong.
        #[source]
        source: ConfigError,
    },
    /// No snapshot matches.
    #[error(
        "no snapshot matches {prefix:?} in {location}; `haulage snapshots --repo {location}` lists them"
    )]
    SnapshotNotFound {
        /// What the user typed.
        prefix: String,
        /// The location.
        location: String,
    },
    /// Several snapshots match a prefix.
    #[error(
        "snapshot prefix {prefix:?} is ambiguous: it matches {candidates}; give more characters"
    )]
    AmbiguousSnapshot {
        /// What the user typed.
        prefix: String,
        /// The matching ids, shortened.
        candidates: String,
    },
    /// An encrypted repository was opened without a key.
    #[error(
        "the repository at {location} is encrypted (format 2) and this command has no key for it: \
         give its password (--password-file, or a BackupStorageLocation's \
         spec.encryption.passwordSecretRef in the cluster)"
    )]
    Encrypted {
        /// The location.
        location: String,
    },
    /// No password could be had.
    #[error("{reason}")]
    PasswordUnavailable {
        /// What was tried.
        reason: String,
    },
    /// The password opens no key file.
    #[error(
        "wrong password for the repository at {location}: it opens none of its {tried} key files \
         (nothing was written); check --password-file, HAULAGE_PASSWORD_FILE or HAULAGE_PASSWORD"
    )]
    WrongPassword {
        /// The location.
        location: String,
        /// Key files tried.
        tried: usize,
    },
    /// An encrypted repository without key files.
    #[error(
        "the repository at {location} is encrypted but has no key files under keys/: it cannot be opened \
         (were they deleted?)"
    )]
    NoKeys {
        /// The location.
        location: String,
    },
    /// A key file could not be made or used.
    #[error("key file {id}: {source}")]
    KeyFile {
        /// The key file.
        id: String,
        /// What is wrong.
        #[source]
        source: crate::repo::keyfile::KeyFileError,
    },
    /// Key management on a plaintext repository.
    #[error("the repository at {location} is not encrypted (format 1): it has no keys to manage")]
    KeysNeedEncryption {
        /// The location.
        location: String,
    },
    /// `repo key remove` refused.
    #[error("key not removed: {reason}")]
    KeyRemovalRefused {
        /// Why.
        reason: String,
    },
    /// A snapshot manifest is damaged.
    #[error("snapshot {id} is damaged: {reason}")]
    SnapshotDamaged {
        /// The snapshot.
        id: ObjectId,
        /// What is wrong.
        reason: String,
    },
    /// A blob the snapshot needs is not in any index or pack.
    #[error("blob {blob} is missing from the repository (referenced by {context})")]
    BlobMissing {
        /// The blob.
        blob: BlobId,
        /// What referenced it.
        context: String,
    },
    /// A blob's stored bytes do not decode to its id.
    #[error("blob {blob} in pack {pack} is damaged: {reason}")]
    BlobDamaged {
        /// The pack holding it.
        pack: ObjectId,
        /// The blob.
        blob: BlobId,
        /// What is wrong.
        reason: String,
    },
    /// A tree blob cannot be decoded.
    #[error("tree {blob} is damaged: {reason}")]
    TreeDamaged {
        /// The tree blob.
        blob: BlobId,
        /// What is wrong.
        reason: String,
    },
    /// The backup source cannot be used.
    #[error("cannot back up {path}: {reason}")]
    Source {
        /// The source directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The restore target cannot be used.
    #[error("cannot restore into {path}: {reason}")]
    Target {
        /// The target directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A conflicting lock is held.
    #[error(
        "the repository at {location} is locked: {holders}; wait for it to finish (or pass --retry-lock), \
         or if its holder is gone, `haulage repo unlock --repo {location}` removes stale locks"
    )]
    Locked {
        /// The location.
        location: String,
        /// Who holds the conflicting locks.
        holders: String,
    },
    /// The lock could not be refreshed in time.
    #[error(
        "lost the repository lock {key}: it could not be refreshed before it expired, so another \
         process may have treated it as stale; stopped (nothing referenced is lost, run the command again)"
    )]
    LockLost {
        /// The lock's key.
        key: String,
    },
    /// Prune found referenced data missing and deleted nothing.
    #[error(
        "{count} blobs referenced by snapshots are in no pack (first: {first}); prune deleted nothing. \
         Run `haulage verify` to see which files are affected"
    )]
    ReferencedDataMissing {
        /// How many.
        count: usize,
        /// The first one.
        first: BlobId,
    },
    /// There was no file descriptor to read the source with, and none
    /// came free.
    #[error(
        "cannot open {path} to back it up: {reason}, and no file descriptor came free within \
         {waited_seconds} s: {remedy}; then run the backup again: nothing it stored is lost"
    )]
    OutOfOpenFiles {
        /// The file or directory that could not be opened.
        path: PathBuf,
        /// The system's error.
        reason: String,
        /// Whose limit was reached and what to do.
        remedy: String,
        /// How long the backup waited for a descriptor.
        waited_seconds: u64,
    },
    /// A thread for work that lasts as long as a volume could not start.
    #[error(
        "cannot start a thread ({what}): {reason}; the process may be at its limit of threads (the \
         pod's pids limit, or `ulimit -u`): raise it, or move fewer volumes at once (a lower \
         maxConcurrentVolumes, or less memory for the stage pods in a StoragePolicy's \
         stagePodResources)"
    )]
    NoThread {
        /// The thread's name: what it was for.
        what: String,
        /// The system's error.
        reason: String,
    },
    /// The operation was cancelled.
    #[error("cancelled")]
    Cancelled,
}

impl EngineError {
    /// Wrap a storage error with what haulage was doing.
    pub fn store(operation: impl Into<String>, source: StoreError) -> Self {
        EngineError::Store {
            operation: operation.into(),
            source,
        }
    }
}

/// Run CPU-bound or blocking work off the async reactor, propagating panics.
pub(crate) async fn run_blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    joined(tokio::task::spawn_blocking(work)).await
}

/// What a spawned task returned; its panic goes on in the caller.
pub(crate) async fn joined<T>(task: tokio::task::JoinHandle<T>) -> T {
    match task.await {
        Ok(value) => value,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}

/// The stack of the threads that walk a tree, a backup's source or a
/// snapshot's trees in a restore: each level of directories is a frame of
/// the walk (about 11 KiB in a debug build), and a runtime's threads have
/// 2 MiB. Reserved, not used: only the pages the walk reaches are ever
/// touched.
pub(crate) const WALK_STACK_BYTES: usize = 32 << 20;

/// Work that lasts as long as its volume (a backup's walker, which waits
/// for its chunks to be hashed on the blocking pool; its totals scan; a
/// restore's walk, on a [`WALK_STACK_BYTES`] stack, and its scatter
/// workers, which wait for blobs to write), on a thread of its own rather
/// than the blocking pool's. The pool has
/// [`MAX_BLOCKING_THREADS`] threads for every volume an agent moves at
/// once: with such work on it, ten backups at once took all eight threads
/// while their walkers waited for hashing only the pool runs, and never
/// ended.
pub(crate) struct OwnThread<T> {
    result: tokio::sync::oneshot::Receiver<T>,
    thread: std::thread::JoinHandle<()>,
}

impl<T: Send + 'static> OwnThread<T> {
    /// Start `work` on a thread named `name` with the default stack, in
    /// the current runtime's context (it may block on the runtime's
    /// handle, use `Handle::current()` and spawn) and tracing span.
    pub(crate) fn spawn(
        name: &str,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<Self, EngineError> {
        Self::spawn_with_stack(name, None, work)
    }

    /// [`OwnThread::spawn`] with a stack of `stack_bytes` (reserved; only
    /// the pages used are touched) when given.
    pub(crate) fn spawn_with_stack(
        name: &str,
        stack_bytes: Option<usize>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<Self, EngineError> {
        let handle = tokio::runtime::Handle::current();
        let span = tracing::Span::current();
        let (done, result) = tokio::sync::oneshot::channel();
        let mut builder = std::thread::Builder::new().name(name.to_string());
        if let Some(bytes) = stack_bytes {
            builder = builder.stack_size(bytes);
        }
        let thread = builder
            .spawn(move || {
                let _runtime = handle.enter();
                let _span = span.enter();
                let _ = done.send(work());
            })
            .map_err(|error| EngineError::NoThread {
                what: name.to_string(),
                reason: error.to_string(),
            })?;
        Ok(OwnThread { result, thread })
    }

    /// What the work returned; its panic goes on in the caller.
    pub(crate) async fn join(self) -> T {
        match self.result.await {
            Ok(value) => value,
            // The thread ended without sending: it panicked; so does this.
            Err(_) => match self.thread.join() {
                Err(panic) => std::panic::resume_unwind(panic),
                Ok(()) => unreachable!("the thread sends before it ends"),
            },
        }
    }
}

/// This machine's hostname (recorded in snapshots, locks and key files).
pub fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}
