//! Progress counters shared between the engine and whoever shows them (a
//! progress bar, a VolumeTransfer status). Plain atomics: the engine never
//! waits for a reader.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Live counters of one backup or restore.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes of file content in the whole source: for a restore the
    /// snapshot's; for a backup the parent snapshot's as an estimate, or
    /// without a parent what the scan beside the walk has found; the
    /// walk's own once a backup's walk ends.
    pub total_bytes: AtomicU64,
    /// Regular files in the whole source, as [`Progress::total_bytes`].
    pub total_files: AtomicU64,
    /// True once `total_*` can give an ETA (an estimate from a parent
    /// snapshot, the scan's final count, or the walk's).
    pub totals_known: AtomicBool,
    /// Bytes of file content processed (read, or taken from the parent).
    pub bytes_done: AtomicU64,
    /// Regular files processed.
    pub files_done: AtomicU64,
    /// Bytes actually read from the source or written to the target.
    pub bytes_transferred: AtomicU64,
    /// Plaintext bytes of new blobs.
    pub bytes_new: AtomicU64,
    /// Bytes stored into packs for new blobs (after compression).
    pub bytes_stored: AtomicU64,
    /// Per-file warnings so far.
    pub warnings: AtomicU64,
}

/// A consistent-enough copy of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProgressSnapshot {
    /// See [`Progress::total_bytes`].
    pub total_bytes: u64,
    /// See [`Progress::total_files`].
    pub total_files: u64,
    /// See [`Progress::totals_known`].
    pub totals_known: bool,
    /// See [`Progress::bytes_done`].
    pub bytes_done: u64,
    /// See [`Progress::files_done`].
    pub files_done: u64,
    /// See [`Progress::bytes_transferred`].
    pub bytes_transferred: u64,
    /// See [`Progress::bytes_new`].
    pub bytes_new: u64,
    /// See [`Progress::bytes_stored`].
    pub bytes_stored: u64,
    /// See [`Progress::warnings`].
    pub warnings: u64,
}

impl Progress {
    /// Add to a counter.
    pub fn add(counter: &AtomicU64, amount: u64) {
        counter.fetch_add(amount, Ordering::Relaxed);
    }

    /// Set the totals, usable for an ETA from now on: a restore's from its
    /// snapshot; a backup's from its parent snapshot (an estimate), and at
    /// the end from what it walked.
    pub fn set_totals(&self, total_bytes: u64, files: u64) {
        self.total_bytes.store(total_bytes, Ordering::Relaxed);
        self.total_files.store(files, Ordering::Relaxed);
        self.totals_known.store(true, Ordering::Release);
    }

    /// Copy the counters.
    pub fn snapshot(&self) -> ProgressSnapshot {
        ProgressSnapshot {
            total_bytes: self.total_bytes.load(Ordering::Relaxed),
            total_files: self.total_files.load(Ordering::Relaxed),
            totals_known: self.totals_known.load(Ordering::Acquire),
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            files_done: self.files_done.load(Ordering::Relaxed),
            bytes_transferred: self.bytes_transferred.load(Ordering::Relaxed),
            bytes_new: self.bytes_new.load(Ordering::Relaxed),
            bytes_stored: self.bytes_stored.load(Ordering::Relaxed),
            warnings: self.warnings.load(Ordering::Relaxed),
        }
    }
}
