//! Backup, restore and verify of a directory tree against a repository.
//!
//! - [`repository`]: an opened repository: config, index loading, blob and
//!   snapshot reading and writing over an [`crate::store::ObjectStore`].
//! - [`backup`]: walk → chunk → hash/dedup/compress (parallel, ordered) →
//!   pack → upload, then trees, index and snapshot.
//! - [`restore`]: snapshot → target directory, every chunk checked, no
//!   write outside the target.
//! - [`verify`]: re-read and check everything a snapshot references.
//! - [`throttle`]: smooth bytes-per-second limits.
//! - [`buffers`]: reusable large buffers for the pipeline.
//! - [`progress`]: counters shared with whoever displays progress.

pub mod backup;
pub mod buffers;
pub mod progress;
pub mod repository;
pub mod restore;
pub mod throttle;
pub mod verify;

use std::path::PathBuf;

use crate::repo::config::ConfigError;
use crate::repo::{BlobId, ObjectId};
use crate::store::StoreError;

pub use repository::Repository;

/// Threads a runtime running the engine should allow for blocking work
/// (`tokio::runtime::Builder::max_blocking_threads`). Enough for every stage
/// at once (backup: walker, scan, parallel chunks, pack finishing; restore:
/// its file jobs and their decoding), and few, because every thread that
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
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => value,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}
