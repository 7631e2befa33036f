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

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustix::fs::{AtFlags, Mode, OFlags, Timestamps};
use rustix::io::Errno;
use serde::Serialize;
use serde_bytes::ByteBuf;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::EngineError;
use super::progress::Progress;
use super::repository::Repository;
use super::throttle::Throttle;
use crate::repo::index::BlobIndex;
use crate::repo::tree::{Entry, EntryKind, Extent, Tree, validate_name};
use crate::repo::{BlobId, ObjectId};

/// Files (or batches of small files) restored at once.
const PARALLEL_FILE_RESTORES: usize = 4;
/// Raw bytes of blobs fetched together: a file's next chunks, or the
/// content of a batch of small files. Neighbouring blobs of one pack then
/// come in one ranged read instead of one each; with
/// [`PARALLEL_FILE_RESTORES`] jobs this bounds fetched-but-unwritten data
/// to a few tens of MiB.
const RESTORE_BATCH_BYTES: u64 = 4 * 1024 * 1024;
/// Files of at most this size are restored in batches with the small files
/// that follow them in the snapshot, so their blobs are fetched together.
const SMALL_FILE_BYTES: u64 = 1024 * 1024;
/// Most files in one batch of small files.
const SMALL_FILE_BATCH_FILES: usize = 256;

/// How to restore.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Where to restore; created if missing; must be empty unless `sync`.
    pub target: PathBuf,
    /// Update an existing copy in place, writing only what differs.
    pub sync: bool,
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
    /// Wall time in seconds.
    pub duration_seconds: f64,
    /// Entries not restored, or restored with a problem.
    pub problems: Vec<RestoreProblem>,
}

/// Restore `snapshot_id` into `options.target`.
pub async fn restore(
    repository: &Repository,
    snapshot_id: &ObjectId,
    options: RestoreOptions,
    progress: Arc<Progress>,
    cancel: CancellationToken,
) -> Result<RestoreOutcome, EngineError> {
    let started = Instant::now();
    let snapshot = repository.load_snapshot(snapshot_id).await?;
    let loaded = repository.load_index().await?;
    let index = Arc::new(loaded.index);
    {
        use std::sync::atomic::Ordering;
        progress
            .total_bytes
            .store(snapshot.summary.total_bytes, Ordering::Relaxed);
        progress
            .total_files
            .store(snapshot.summary.files, Ordering::Relaxed);
        progress.totals_known.store(true, Ordering::Release);
    }
    let root_fd = open_target(&options)?;
    let root_tree = repository.load_tree(&index, &snapshot.tree).await?;

    let mut restorer = Restorer {
        repository: repository.clone(),
        index,
        options: Arc::new(options),
        progress,
        cancel,
        root_fd: Arc::new(root_fd),
        outcome: Arc::new(Mutex::new(RestoreOutcome {
            snapshot_id: snapshot_id.to_hex(),
            ..RestoreOutcome::default()
        })),
        file_jobs: JoinSet::new(),
        file_slots: Arc::new(Semaphore::new(PARALLEL_FILE_RESTORES)),
        first_links: Arc::new(Mutex::new(HashMap::new())),
        deferred_links: Vec::new(),
        deferred_symlinks: Vec::new(),
        directories: Vec::new(),
        small_files: Vec::new(),
        small_file_bytes: 0,
    };
    let root_fd = restorer.root_fd.clone();
    restorer
        .restore_directory(root_fd, Vec::new(), root_tree)
        .await?;
    restorer.spawn_small_files().await;
    while let Some(joined) = restorer.file_jobs.join_next().await {
        joined.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
    }
    if restorer.cancel.is_cancelled() {
        return Err(EngineError::Cancelled);
    }
    restorer.finish_links_and_metadata(&snapshot.root_attributes());
    let mut outcome = restorer.outcome.lock().expect("outcome").clone();
    outcome.duration_seconds = started.elapsed().as_secs_f64();
    Ok(outcome)
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

/// Open a directory inside the target without following any symlink.
fn open_directory_at(root: &OwnedFd, components: &[ByteBuf]) -> Result<OwnedFd, Errno> {
    let mut current = rustix::fs::openat(
        root,
        ".",
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for part in components {
        current = rustix::fs::openat(
            &current,
            part.as_slice(),
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
    }
    Ok(current)
}

struct Restorer {
    repository: Repository,
    index: Arc<BlobIndex>,
    options: Arc<RestoreOptions>,
    progress: Arc<Progress>,
    cancel: CancellationToken,
    root_fd: Arc<OwnedFd>,
    outcome: Arc<Mutex<RestoreOutcome>>,
    file_jobs: JoinSet<()>,
    file_slots: Arc<Semaphore>,
    /// (device, inode) of a multiply-linked file → where this restore
    /// created it (only set once its content is complete).
    first_links: Arc<Mutex<HashMap<(u64, u64), Components>>>,
    deferred_links: Vec<(Components, Entry)>,
    deferred_symlinks: Vec<(Components, Entry)>,
    /// Directories in pre-order, for metadata in post-order at the end.
    directories: Vec<(Components, Entry)>,
    /// Small files waiting to be restored together, and their bytes.
    small_files: Vec<(Arc<OwnedFd>, Components, Entry)>,
    small_file_bytes: u64,
}

impl Restorer {
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

    fn restore_directory<'a>(
        &'a mut self,
        directory_fd: Arc<OwnedFd>,
        components: Components,
        tree: Tree,
    ) -> futures::future::BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            if self.cancel.is_cancelled() {
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
            if self.options.sync {
                self.remove_extra_entries(&directory_fd, &components, &names_seen);
            }
            for entry in entries {
                let mut path = components.clone();
                path.push(entry.name.clone());
                match entry.kind {
                    EntryKind::Directory => {
                        let Some(child_fd) = self.prepare_directory(&directory_fd, &path, &entry)
                        else {
                            continue;
                        };
                        let subtree = match entry.subtree {
                            Some(id) => self.repository.load_tree(&self.index, &id).await,
                            None => Ok(Tree::default()),
                        };
                        self.outcome.lock().expect("outcome").directories += 1;
                        self.directories.push((path.clone(), entry));
                        match subtree {
                            Ok(subtree) => {
                                self.restore_directory(Arc::new(child_fd), path, subtree)
                                    .await?
                            }
                            Err(error) => self.problem(
                                display(&path),
                                format!("contents not restored: {error}"),
                            ),
                        }
                    }
                    EntryKind::File => {
                        if entry.links > 1 {
                            let key = (entry.device, entry.inode);
                            let mut first = self.first_links.lock().expect("links");
                            if first.contains_key(&key) {
                                drop(first);
                                self.deferred_links.push((path, entry));
                                continue;
                            }
                            // Reserve; the real path is recorded once written.
                            first.insert(key, Vec::new());
                        } else if !self.options.sync && entry.size <= SMALL_FILE_BYTES {
                            self.small_file_bytes += entry.size;
                            self.small_files.push((directory_fd.clone(), path, entry));
                            if self.small_file_bytes >= RESTORE_BATCH_BYTES
                                || self.small_files.len() >= SMALL_FILE_BATCH_FILES
                            {
                                self.spawn_small_files().await;
                            }
                            continue;
                        }
                        self.spawn_file(directory_fd.clone(), path, entry).await;
                    }
                    EntryKind::Symlink => self.deferred_symlinks.push((path, entry)),
                    EntryKind::Fifo | EntryKind::CharDevice | EntryKind::BlockDevice => {
                        self.create_node(&directory_fd, &path, &entry)
                    }
                    EntryKind::Socket => self.problem(
                        display(&path),
                        "a Unix socket cannot be restored; it is recreated by the program that owns it",
                    ),
                }
            }
            Ok(())
        })
    }

    /// Sync mode: remove what the snapshot does not have.
    fn remove_extra_entries(
        &self,
        directory_fd: &OwnedFd,
        components: &[ByteBuf],
        keep: &HashSet<ByteBuf>,
    ) {
        let names = match list_directory(directory_fd) {
            Ok(names) => names,
            Err(error) => {
                self.problem(
                    display(components),
                    format!("cannot list for sync: {error}"),
                );
                return;
            }
        };
        for name in names {
            if keep.contains(&ByteBuf::from(name.clone())) {
                continue;
            }
            match remove_entry(directory_fd, &name) {
                Ok(()) => self.outcome.lock().expect("outcome").entries_removed += 1,
                Err(error) => {
                    let mut path = components.to_vec();
                    path.push(ByteBuf::from(name));
                    self.problem(display(&path), format!("cannot remove: {error}"));
                }
            }
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
                self.problem(display(path), format!("cannot create directory: {error}"));
                None
            }
        }
    }

    fn create_node(&self, parent: &OwnedFd, path: &[ByteBuf], entry: &Entry) {
        let file_type = match entry.kind {
            EntryKind::Fifo => rustix::fs::FileType::Fifo,
            EntryKind::CharDevice | EntryKind::BlockDevice if !self.options.allow_devices => {
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
        if self.options.sync {
            match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) if rustix::fs::FileType::from_raw_mode(stat.st_mode) == file_type => {
                    return self.count_other();
                }
                Ok(_) => {
                    if let Err(error) = remove_entry(parent, name) {
                        return self.problem(display(path), format!("cannot replace: {error}"));
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
            Err(error) => self.problem(display(path), format!("cannot create: {error}")),
        }
    }

    fn count_other(&self) {
        self.outcome.lock().expect("outcome").other_entries += 1;
    }

    async fn spawn_file(&mut self, directory_fd: Arc<OwnedFd>, path: Components, entry: Entry) {
        let Ok(slot) = self.file_slots.clone().acquire_owned().await else {
            return;
        };
        let job = self.file_job();
        self.file_jobs.spawn_blocking(move || {
            job.restore(&directory_fd, path, entry, &HashMap::new());
            drop(slot);
        });
        self.reap_finished_jobs();
    }

    /// Reap finished jobs as we go: a JoinSet keeps every finished task until
    /// joined, which for 200,000 files was 150 MiB.
    fn reap_finished_jobs(&mut self) {
        while let Some(joined) = self.file_jobs.try_join_next() {
            joined.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
        }
    }

    /// Restore the waiting small files as one job that fetches all their
    /// blobs first ([`Repository::read_blobs`]), so neighbouring blobs of a
    /// pack come in one request.
    async fn spawn_small_files(&mut self) {
        let files = std::mem::take(&mut self.small_files);
        self.small_file_bytes = 0;
        if files.is_empty() {
            return;
        }
        let Ok(slot) = self.file_slots.clone().acquire_owned().await else {
            return;
        };
        let job = self.file_job();
        self.file_jobs.spawn_blocking(move || {
            let ids: Vec<BlobId> = files
                .iter()
                .flat_map(|(_, _, entry)| entry.content.iter())
                .filter_map(|extent| match extent {
                    Extent::Chunk(id, _) => Some(*id),
                    Extent::Hole(_) => None,
                })
                .collect();
            let prefetched = job
                .handle
                .block_on(job.repository.read_blobs(&job.index, &ids));
            for (directory_fd, path, entry) in files {
                job.restore(&directory_fd, path, entry, &prefetched);
            }
            drop(slot);
        });
        self.reap_finished_jobs();
    }

    fn file_job(&self) -> FileJob {
        FileJob {
            repository: self.repository.clone(),
            index: self.index.clone(),
            options: self.options.clone(),
            progress: self.progress.clone(),
            cancel: self.cancel.clone(),
            outcome: self.outcome.clone(),
            first_links: self.first_links.clone(),
            handle: tokio::runtime::Handle::current(),
        }
    }

    /// Hard links, symlinks, then directory metadata (children before
    /// parents, so times and read-only modes stick).
    fn finish_links_and_metadata(&mut self, root: &Entry) {
        let root_fd = self.root_fd.clone();
        for (path, entry) in std::mem::take(&mut self.deferred_links) {
            let first = self
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
                let from = open_directory_at(&root_fd, first_dir).map_err(|e| e.to_string())?;
                let to = open_directory_at(&root_fd, dir).map_err(|e| e.to_string())?;
                if self.options.sync {
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
                let dir_fd = open_directory_at(&root_fd, dir)?;
                if self.options.sync {
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
                Err(error) => {
                    self.problem(display(&path), format!("cannot create symlink: {error}"))
                }
            }
        }
        for (path, entry) in std::mem::take(&mut self.directories).into_iter().rev() {
            let result = open_directory_at(&root_fd, &path)
                .and_then(|fd| apply_metadata_fd(&fd, &entry, &self.options));
            if let Err(error) = result {
                self.problem(
                    display(&path),
                    format!("cannot set directory attributes: {error}"),
                );
            }
        }
        if let Err(error) = apply_metadata_fd(&root_fd, root, &self.options) {
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
        if self.options.restore_owners {
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

/// Names in a directory, without `.` and `..`.
fn list_directory(fd: &OwnedFd) -> Result<Vec<Vec<u8>>, Errno> {
    let dup = rustix::fs::openat(
        fd,
        ".",
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut dir = rustix::fs::Dir::read_from(&dup)?;
    let mut names = Vec::new();
    while let Some(entry) = dir.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    Ok(names)
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
    for child_name in list_directory(&child)? {
        remove_entry(&child, &child_name)?;
    }
    rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
}

/// Everything one file's restore needs; runs on a blocking thread.
struct FileJob {
    repository: Repository,
    index: Arc<BlobIndex>,
    options: Arc<RestoreOptions>,
    progress: Arc<Progress>,
    cancel: CancellationToken,
    outcome: Arc<Mutex<RestoreOutcome>>,
    first_links: Arc<Mutex<HashMap<(u64, u64), Components>>>,
    handle: tokio::runtime::Handle,
}

enum FileFailure {
    Data(EngineError),
    Io(&'static str, Errno),
    Cancelled,
}

impl FileJob {
    /// Restore one file; blobs in `prefetched` are not fetched again.
    fn restore(
        &self,
        dir: &OwnedFd,
        path: Components,
        entry: Entry,
        prefetched: &HashMap<BlobId, Vec<u8>>,
    ) {
        if self.cancel.is_cancelled() {
            return;
        }
        let name = entry.name.as_slice();
        let result = self.restore_file(dir, name, &entry, prefetched);
        let mut outcome = self.outcome.lock().expect("outcome");
        match result {
            Ok(written) => {
                outcome.files += 1;
                if written == 0 && self.options.sync && entry.size > 0 {
                    outcome.files_unchanged += 1;
                }
                outcome.bytes_written += written;
                drop(outcome);
                if entry.links > 1 {
                    self.first_links
                        .lock()
                        .expect("links")
                        .insert((entry.device, entry.inode), path);
                }
            }
            Err(FileFailure::Cancelled) => {}
            Err(failure) => {
                let message = match failure {
                    FileFailure::Data(error) => {
                        // Never leave a file with damaged content behind.
                        let _ = rustix::fs::unlinkat(dir, name, AtFlags::empty());
                        format!("not restored, its data is damaged: {error}")
                    }
                    FileFailure::Io(step, errno) => format!("not restored: cannot {step}: {errno}"),
                    FileFailure::Cancelled => unreachable!(),
                };
                outcome.problems.push(RestoreProblem {
                    path: display(&path),
                    message,
                });
                Progress::add(&self.progress.warnings, 1);
            }
        }
        Progress::add(&self.progress.files_done, 1);
    }

    /// Returns the bytes written.
    fn restore_file(
        &self,
        dir: &OwnedFd,
        name: &[u8],
        entry: &Entry,
        prefetched: &HashMap<BlobId, Vec<u8>>,
    ) -> Result<u64, FileFailure> {
        let existing = if self.options.sync {
            match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat)
                    if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                        == rustix::fs::FileType::RegularFile =>
                {
                    Some(stat)
                }
                Ok(_) => {
                    remove_entry(dir, name)
                        .map_err(|e| FileFailure::Io("replace the existing entry", e))?;
                    None
                }
                Err(Errno::NOENT) => None,
                Err(error) => return Err(FileFailure::Io("inspect the existing entry", error)),
            }
        } else {
            None
        };
        let fd = match &existing {
            Some(_) => rustix::fs::openat(
                dir,
                name,
                OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ),
            None => rustix::fs::openat(
                dir,
                name,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            ),
        }
        .map_err(|e| FileFailure::Io("create the file", e))?;

        let mut offset = 0u64;
        let mut written = 0u64;
        let existing_size = existing.as_ref().map_or(0, |stat| stat.st_size as u64);
        // The blobs of the next chunks, fetched together (a new file only:
        // when updating in place, most chunks are expected to match already).
        let mut window: HashMap<BlobId, Vec<u8>> = HashMap::new();
        let mut window_end = 0usize;
        for (position, extent) in entry.content.iter().enumerate() {
            if self.cancel.is_cancelled() {
                return Err(FileFailure::Cancelled);
            }
            let length = extent.length();
            match extent {
                Extent::Hole(_) => {
                    if existing.is_some() && offset < existing_size {
                        let end = (offset + length).min(existing_size);
                        if !self.region_is_zero(&fd, offset, end - offset)? {
                            self.punch_hole(&fd, offset, end - offset)?;
                            written += end - offset;
                        }
                    }
                }
                Extent::Chunk(id, _) => {
                    let same = existing.is_some()
                        && offset + length <= existing_size
                        && self.region_matches(&fd, offset, length, id)?;
                    if !same {
                        if existing.is_none() && position >= window_end {
                            window.clear();
                            window_end = self.fetch_window(
                                &entry.content,
                                position,
                                prefetched,
                                &mut window,
                            );
                        }
                        let data = match prefetched.get(id).or_else(|| window.get(id)) {
                            Some(data) => Cow::Borrowed(data.as_slice()),
                            None => Cow::Owned(
                                self.handle
                                    .block_on(self.repository.read_blob(&self.index, id))
                                    .map_err(FileFailure::Data)?,
                            ),
                        };
                        let zero = data.iter().all(|byte| *byte == 0);
                        if !(zero && offset >= existing_size) {
                            self.write_at(&fd, &data, offset)?;
                            written += data.len() as u64;
                        }
                    }
                }
            }
            offset += length;
            Progress::add(&self.progress.bytes_done, length);
        }
        if existing_size != entry.size || existing.is_none() {
            rustix::fs::ftruncate(&fd, entry.size)
                .map_err(|e| FileFailure::Io("set the file size", e))?;
        }
        let metadata_matches = existing.as_ref().is_some_and(|stat| {
            (stat.st_mode & 0o7777) == entry.mode
                && (!self.options.restore_owners
                    || (stat.st_uid == entry.uid && stat.st_gid == entry.gid))
                && stat.st_mtime == entry.mtime_seconds
                && stat.st_mtime_nsec as u32 == entry.mtime_nanos
        });
        if written > 0 || !metadata_matches {
            apply_metadata_fd(&fd, entry, &self.options)
                .map_err(|e| FileFailure::Io("set attributes", e))?;
        }
        Ok(written)
    }

    /// Fetch the blobs of the chunks from `content[start]` on, up to
    /// [`RESTORE_BATCH_BYTES`] (at least one chunk), into `window`; returns
    /// the index of the first extent not covered.
    fn fetch_window(
        &self,
        content: &[Extent],
        start: usize,
        prefetched: &HashMap<BlobId, Vec<u8>>,
        window: &mut HashMap<BlobId, Vec<u8>>,
    ) -> usize {
        let mut ids = Vec::new();
        let mut bytes = 0u64;
        let mut end = start;
        for extent in &content[start..] {
            if let Extent::Chunk(id, length) = extent {
                let length = u64::from(*length);
                if bytes > 0 && bytes + length > RESTORE_BATCH_BYTES {
                    break;
                }
                bytes += length;
                if !prefetched.contains_key(id) {
                    ids.push(*id);
                }
            }
            end += 1;
        }
        *window = self
            .handle
            .block_on(self.repository.read_blobs(&self.index, &ids));
        end
    }

    fn read_at(&self, fd: &OwnedFd, offset: u64, length: u64) -> Result<Vec<u8>, FileFailure> {
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
        &self,
        fd: &OwnedFd,
        offset: u64,
        length: u64,
        id: &BlobId,
    ) -> Result<bool, FileFailure> {
        let existing = self.read_at(fd, offset, length)?;
        Ok(existing.len() as u64 == length && self.repository.keys().blob_id(&existing) == *id)
    }

    fn region_is_zero(&self, fd: &OwnedFd, offset: u64, length: u64) -> Result<bool, FileFailure> {
        let mut position = offset;
        while position < offset + length {
            let step = (offset + length - position).min(4 * 1024 * 1024);
            let data = self.read_at(fd, position, step)?;
            if data.iter().any(|byte| *byte != 0) {
                return Ok(false);
            }
            position += step;
        }
        Ok(true)
    }

    fn punch_hole(&self, fd: &OwnedFd, offset: u64, length: u64) -> Result<(), FileFailure> {
        use rustix::fs::FallocateFlags;
        match rustix::fs::fallocate(
            fd,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            length,
        ) {
            Ok(()) => Ok(()),
            Err(_) => {
                let zeros = vec![0u8; length.min(4 * 1024 * 1024) as usize];
                let mut position = offset;
                while position < offset + length {
                    let step = (offset + length - position).min(zeros.len() as u64) as usize;
                    self.write_at(fd, &zeros[..step], position)?;
                    position += step as u64;
                }
                Ok(())
            }
        }
    }

    fn write_at(&self, fd: &OwnedFd, data: &[u8], offset: u64) -> Result<(), FileFailure> {
        let step = self.options.write_throttle.max_request_bytes();
        let mut done = 0usize;
        while done < data.len() {
            let piece = (data.len() - done).min(step);
            self.options
                .write_throttle
                .acquire_blocking(&self.handle, piece);
            match rustix::io::pwrite(fd.as_fd(), &data[done..done + piece], offset + done as u64) {
                Ok(count) => {
                    done += count;
                    Progress::add(&self.progress.bytes_transferred, count as u64);
                }
                Err(Errno::INTR) => continue,
                Err(error) => return Err(FileFailure::Io("write the file", error)),
            }
        }
        Ok(())
    }
}
