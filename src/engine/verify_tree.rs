//! Tree verification: whether a directory holds exactly a snapshot.
//!
//! [`verify_tree`] walks the snapshot's trees and the target directory
//! together, entry by entry: the same names (none missing, none extra),
//! and for each entry its type, mode, owner (when the restore sets
//! owners), modification time, symlink target, device number, extended
//! attributes (those the restore writes: its prefix allowlist), hard-link
//! groups, and every regular file's content, re-read and re-hashed chunk
//! by chunk with the repository's keyed BLAKE3 at the offsets the tree's
//! chunk list gives (a hole must read as zeros), never trusting a size.
//! The target is opened relative to directory descriptors, every
//! component with `O_NOFOLLOW`: no symlink is followed and no FIFO or
//! device is opened.
//!
//! It reports the snapshot's root tree as verified, or what differs, path
//! by path, at most [`TreeVerifyOptions::max_mismatches`] (it stops
//! there: a claim that differs in thousands of entries needs the same
//! answer as one that differs in a hundred).
//!
//! After a sync restore given its since snapshot ([`super::since`]),
//! [`TreeVerifyOptions::after`] lets the walk skip, from its `lstat` alone,
//! the files the sync neither read nor wrote (both snapshots hold them
//! unchanged, the disk shows them as restored, and they last changed before
//! the sync began); everything the sync wrote is re-read as above.
//!
//! Entries a restore never creates — Unix sockets, and device nodes when
//! the restore does not create them — are expected to be absent; they are
//! counted in [`TreeVerification::not_restorable`], not as mismatches.
//!
//! The comparisons themselves are pure functions: one entry's metadata
//! ([`metadata_differences`]), a directory's names
//! ([`name_differences`]), extended attributes ([`xattr_differences`]),
//! hard-link groups ([`HardLinks`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, SeekFrom, Stat};
use rustix::io::Errno;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::repository::Repository;
use super::restore::LoadedSnapshot;
use super::restore::RestoreOptions;
use super::restore::RestoreOutcome;
use super::restore::TREE_PREFETCH_BYTES;
use super::scan;
use super::since::{SinceCheck, SinceDirectory, SinceSubdirectory, on_disk_as_restored};
use super::tree_cache::TreeCache;
use super::{EngineError, run_blocking};
use crate::repo::config::RepoKeys;
use crate::repo::index::BlobIndex;
use crate::repo::tree::{Entry, EntryKind, Extent, Tree, Xattr, validate_name};
use crate::repo::{BlobId, ObjectId};

/// Mismatches recorded before verification stops.
pub const MAX_MISMATCHES: usize = 100;
/// Files whose content is re-read at once with the default memory
/// share: enough to keep a disk and a core busy while another file waits
/// on its reads, few enough that the read buffers ([`READ_BYTES`] each at
/// most) stay small.
pub(crate) const PARALLEL_FILE_CHECKS: usize = 4;
/// Most files one blocking job checks.
const FILES_PER_CHECK: usize = 64;
/// Content one blocking job may re-read beyond its first file, bytes.
const BYTES_PER_CHECK: u64 = 8 * 1024 * 1024;
/// Largest read of a hole's data regions, bytes.
pub(crate) const READ_BYTES: usize = 4 * 1024 * 1024;
/// Names of entries that cannot be restored kept in the report.
const MAX_NOT_RESTORABLE_NAMED: usize = 20;

/// What the target is expected to hold besides the snapshot's data: the
/// choices of the restore that wrote it.
#[derive(Debug, Clone)]
pub struct TreeVerifyOptions {
    /// Compare owners (the restore set them: root or `CAP_CHOWN`).
    pub check_owners: bool,
    /// Extended attributes compared: those whose names start with one of
    /// these (the restore writes only these).
    pub xattr_prefixes: Vec<Vec<u8>>,
    /// Device nodes are expected (the restore created them).
    pub devices_restored: bool,
    /// Stop after this many mismatches.
    pub max_mismatches: usize,
    /// After a sync restore with a since snapshot ([`super::since`]): a
    /// file both snapshots hold unchanged, whose metadata on disk matches
    /// and which last changed before the sync began, is not re-read (the
    /// sync neither read nor wrote it); everything else is compared as
    /// always.
    pub since: Option<SinceCheck>,
    /// Files re-read at once (each with a read buffer of up to 4 MiB):
    /// what the restore's memory share holds.
    pub parallel_checks: usize,
}

impl TreeVerifyOptions {
    /// What a restore with `options` promises to have written.
    pub fn for_restore(options: &RestoreOptions) -> Self {
        TreeVerifyOptions {
            check_owners: options.restore_owners,
            xattr_prefixes: options.xattr_prefixes.clone(),
            devices_restored: options.allow_devices,
            max_mismatches: MAX_MISMATCHES,
            since: None,
            parallel_checks: options.memory.verify_parallel_checks(),
        }
    }

    /// The same, after `outcome`: skip what the sync did not read.
    pub fn after(mut self, outcome: &RestoreOutcome) -> Self {
        self.since = outcome.since_check;
        self
    }
}

/// One thing that differs between an entry of the snapshot and the
/// target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "what")]
pub enum Difference {
    /// In the snapshot, not in the target.
    Missing {
        /// The snapshot's kind of entry.
        expected: &'static str,
    },
    /// In the target, not in the snapshot.
    Extra,
    /// Another kind of entry.
    Kind {
        /// The snapshot's.
        expected: &'static str,
        /// The target's.
        found: &'static str,
    },
    /// Permission bits (with setuid, setgid, sticky).
    Mode {
        /// The snapshot's.
        expected: u32,
        /// The target's.
        found: u32,
    },
    /// Owner or group.
    Owner {
        /// The snapshot's uid:gid.
        expected: (u32, u32),
        /// The target's.
        found: (u32, u32),
    },
    /// Modification time (seconds, nanoseconds).
    Mtime {
        /// The snapshot's.
        expected: (i64, u32),
        /// The target's.
        found: (i64, u32),
    },
    /// A regular file's size.
    Size {
        /// The snapshot's.
        expected: u64,
        /// The target's.
        found: u64,
    },
    /// A chunk's bytes do not hash to the snapshot's chunk id.
    Content {
        /// Where the chunk starts.
        offset: u64,
        /// Its length.
        length: u64,
    },
    /// Bytes inside one of the snapshot's holes are not zero.
    Hole {
        /// The first non-zero byte.
        offset: u64,
    },
    /// A symlink points elsewhere.
    SymlinkTarget {
        /// The snapshot's.
        expected: String,
        /// The target's.
        found: String,
    },
    /// A device node's number.
    Device {
        /// The snapshot's.
        expected: u64,
        /// The target's.
        found: u64,
    },
    /// An extended attribute.
    Xattr {
        /// Its name.
        name: String,
        /// `missing`, `differs`, or `not in the snapshot`.
        problem: &'static str,
    },
    /// Hard links: the entry is not linked as in the snapshot.
    HardLink {
        /// What is wrong, naming the other path.
        problem: String,
    },
    /// The entry could not be read, so it could not be compared.
    Unreadable {
        /// What failed.
        reason: String,
    },
    /// The snapshot's entry is unusable (a bad name, a chunk list that
    /// does not add up to the size, an unreadable tree).
    Snapshot {
        /// What is wrong.
        reason: String,
    },
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::Missing { expected } => write!(f, "missing (a {expected} in the snapshot)"),
            Difference::Extra => f.write_str("not in the snapshot"),
            Difference::Kind { expected, found } => {
                write!(f, "is a {found}, the snapshot has a {expected}")
            }
            Difference::Mode { expected, found } => {
                write!(f, "mode {found:04o}, the snapshot has {expected:04o}")
            }
            Difference::Owner { expected, found } => write!(
                f,
                "owner {}:{}, the snapshot has {}:{}",
                found.0, found.1, expected.0, expected.1
            ),
            Difference::Mtime { expected, found } => write!(
                f,
                "modified {}.{:09}, the snapshot has {}.{:09}",
                found.0, found.1, expected.0, expected.1
            ),
            Difference::Size { expected, found } => {
                write!(f, "{found} bytes, the snapshot has {expected}")
            }
            Difference::Content { offset, length } => write!(
                f,
                "content differs in the {length} bytes at offset {offset}"
            ),
            Difference::Hole { offset } => write!(
                f,
                "byte {offset} is not zero, the snapshot has a hole there"
            ),
            Difference::SymlinkTarget { expected, found } => write!(
                f,
                "points to {found:?}, the snapshot's points to {expected:?}"
            ),
            Difference::Device { expected, found } => {
                write!(f, "device number {found}, the snapshot has {expected}")
            }
            Difference::Xattr { name, problem } => {
                write!(f, "extended attribute {name}: {problem}")
            }
            Difference::HardLink { problem } => f.write_str(problem),
            Difference::Unreadable { reason } => write!(f, "cannot be compared: {reason}"),
            Difference::Snapshot { reason } => write!(f, "the snapshot's entry: {reason}"),
        }
    }
}

/// A path of the target (relative, `.` for the target itself) and what
/// differs there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TreeMismatch {
    /// Relative to the target.
    pub path: String,
    /// What differs.
    pub difference: Difference,
}

impl fmt::Display for TreeMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.difference)
    }
}

/// What [`verify_tree`] found.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TreeVerification {
    /// The snapshot.
    pub snapshot_id: String,
    /// Its root tree (hex), the one hash that names its whole content.
    pub root_tree: String,
    /// Entries compared (the target itself included).
    pub entries: u64,
    /// Regular files whose content was re-read and re-hashed.
    pub files: u64,
    /// Bytes of content re-read.
    pub bytes_verified: u64,
    /// Regular files whose metadata was compared but not their content:
    /// the since snapshot holds them unchanged.
    pub files_not_read: u64,
    /// Entries of the snapshot a restore does not create (sockets, device
    /// nodes when not restored) and the target does not have.
    pub not_restorable: u64,
    /// The first of them, by path.
    pub not_restorable_paths: Vec<String>,
    /// What differs, at most the options' `max_mismatches`; empty when
    /// the target holds exactly the snapshot.
    pub mismatches: Vec<TreeMismatch>,
    /// Verification stopped at the mismatch limit: more may differ.
    pub stopped_at_limit: bool,
    /// Wall time, seconds.
    pub duration_seconds: f64,
}

impl TreeVerification {
    /// The root tree, when the target holds exactly the snapshot.
    pub fn verified_tree(&self) -> Option<&str> {
        self.mismatches
            .is_empty()
            .then_some(self.root_tree.as_str())
    }
}

/// What the target holds at one path, from `lstat`/`fstat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// Its kind, `None` for a type the snapshot format has no name for.
    pub kind: Option<EntryKind>,
    /// `st_mode & 0o7777`.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds.
    pub mtime_seconds: i64,
    /// Modification time, nanoseconds.
    pub mtime_nanos: u32,
    /// Size in bytes.
    pub size: u64,
    /// Device number of a device node.
    pub rdev: u64,
    /// Device of the filesystem.
    pub device: u64,
    /// Inode number.
    pub inode: u64,
    /// Hard-link count.
    pub links: u64,
}

/// The snapshot's kind for a file type from `st_mode`; `None` for a type
/// the format has no name for.
pub(crate) fn entry_kind(file_type: FileType) -> Option<EntryKind> {
    match file_type {
        FileType::RegularFile => Some(EntryKind::File),
        FileType::Directory => Some(EntryKind::Directory),
        FileType::Symlink => Some(EntryKind::Symlink),
        FileType::Fifo => Some(EntryKind::Fifo),
        FileType::Socket => Some(EntryKind::Socket),
        FileType::CharacterDevice => Some(EntryKind::CharDevice),
        FileType::BlockDevice => Some(EntryKind::BlockDevice),
        FileType::Unknown => None,
    }
}

impl Observed {
    /// From a `stat` result.
    pub fn from_stat(stat: &Stat) -> Self {
        Observed {
            kind: entry_kind(FileType::from_raw_mode(stat.st_mode)),
            mode: stat.st_mode & 0o7777,
            uid: stat.st_uid,
            gid: stat.st_gid,
            mtime_seconds: stat.st_mtime,
            mtime_nanos: stat.st_mtime_nsec as u32,
            size: u64::try_from(stat.st_size).unwrap_or(0),
            rdev: stat.st_rdev,
            device: stat.st_dev,
            inode: stat.st_ino,
            links: nlink(stat),
        }
    }
}

#[allow(
    clippy::unnecessary_cast,
    reason = "nlink_t is u64 on x86_64 and u32 on some other targets"
)]
fn nlink(stat: &Stat) -> u64 {
    stat.st_nlink as u64
}

/// A kind of entry, in words.
pub fn kind_name(kind: Option<EntryKind>) -> &'static str {
    match kind {
        Some(EntryKind::File) => "regular file",
        Some(EntryKind::Directory) => "directory",
        Some(EntryKind::Symlink) => "symlink",
        Some(EntryKind::Fifo) => "FIFO",
        Some(EntryKind::Socket) => "socket",
        Some(EntryKind::CharDevice) => "character device",
        Some(EntryKind::BlockDevice) => "block device",
        None => "file of unknown type",
    }
}

/// How an entry's metadata differs from the snapshot's, as a restore
/// writes it: another kind is the only difference reported (the rest
/// cannot be compared); permission bits except on symlinks (Linux has
/// none); owners when `check_owners`; the modification time of every
/// kind; a regular file's size; a device node's number. Content, names,
/// extended attributes and links are compared elsewhere.
pub fn metadata_differences(
    expected: &Entry,
    observed: &Observed,
    check_owners: bool,
) -> Vec<Difference> {
    if observed.kind != Some(expected.kind) {
        return vec![Difference::Kind {
            expected: kind_name(Some(expected.kind)),
            found: kind_name(observed.kind),
        }];
    }
    let mut differences = Vec::new();
    if expected.kind != EntryKind::Symlink && observed.mode != expected.mode & 0o7777 {
        differences.push(Difference::Mode {
            expected: expected.mode & 0o7777,
            found: observed.mode,
        });
    }
    if check_owners && (observed.uid, observed.gid) != (expected.uid, expected.gid) {
        differences.push(Difference::Owner {
            expected: (expected.uid, expected.gid),
            found: (observed.uid, observed.gid),
        });
    }
    if (observed.mtime_seconds, observed.mtime_nanos)
        != (expected.mtime_seconds, expected.mtime_nanos)
    {
        differences.push(Difference::Mtime {
            expected: (expected.mtime_seconds, expected.mtime_nanos),
            found: (observed.mtime_seconds, observed.mtime_nanos),
        });
    }
    if expected.kind == EntryKind::File && observed.size != expected.size {
        differences.push(Difference::Size {
            expected: expected.size,
            found: observed.size,
        });
    }
    if matches!(
        expected.kind,
        EntryKind::CharDevice | EntryKind::BlockDevice
    ) && observed.rdev != expected.rdev
    {
        differences.push(Difference::Device {
            expected: expected.rdev,
            found: observed.rdev,
        });
    }
    differences
}

/// The names of a directory the snapshot lists but the target lacks
/// (`missing`), and those the target has beyond the snapshot's (`extra`),
/// each sorted.
pub fn name_differences<'a>(
    expected: impl IntoIterator<Item = &'a [u8]>,
    found: &[Vec<u8>],
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    // Two sorted lists walked side by side (a snapshot's names come
    // sorted, so the first sort costs a pass).
    fn sorted(mut names: Vec<&[u8]>) -> Vec<&[u8]> {
        if !names.is_sorted() {
            names.sort_unstable();
        }
        names.dedup();
        names
    }
    let expected = sorted(expected.into_iter().collect());
    let found = sorted(found.iter().map(Vec::as_slice).collect());
    let (mut missing, mut extra) = (Vec::new(), Vec::new());
    let (mut expected, mut found) = (
        expected.into_iter().peekable(),
        found.into_iter().peekable(),
    );
    loop {
        match (expected.peek(), found.peek()) {
            (Some(wanted), Some(there)) => match wanted.cmp(there) {
                std::cmp::Ordering::Less => missing.extend(expected.next().map(<[u8]>::to_vec)),
                std::cmp::Ordering::Greater => extra.extend(found.next().map(<[u8]>::to_vec)),
                std::cmp::Ordering::Equal => {
                    expected.next();
                    found.next();
                }
            },
            (Some(_), None) => missing.extend(expected.next().map(<[u8]>::to_vec)),
            (None, Some(_)) => extra.extend(found.next().map(<[u8]>::to_vec)),
            (None, None) => break,
        }
    }
    (missing, extra)
}

/// How the target's extended attributes (`found`: name and value) differ
/// from the snapshot's, counting only names with one of `prefixes` (the
/// ones a restore writes).
pub fn xattr_differences(
    expected: &[Xattr],
    found: &[(Vec<u8>, Vec<u8>)],
    prefixes: &[Vec<u8>],
) -> Vec<Difference> {
    let compared = |name: &[u8]| prefixes.iter().any(|prefix| name.starts_with(prefix));
    let expected: BTreeMap<&[u8], &[u8]> = expected
        .iter()
        .filter(|xattr| compared(&xattr.name))
        .map(|xattr| (xattr.name.as_slice(), xattr.value.as_slice()))
        .collect();
    let found: BTreeMap<&[u8], &[u8]> = found
        .iter()
        .filter(|(name, _)| compared(name))
        .map(|(name, value)| (name.as_slice(), value.as_slice()))
        .collect();
    let named = |name: &[u8], problem| Difference::Xattr {
        name: String::from_utf8_lossy(name).into_owned(),
        problem,
    };
    let mut differences = Vec::new();
    for (name, value) in &expected {
        match found.get(name) {
            None => differences.push(named(name, "missing")),
            Some(found_value) if found_value != value => differences.push(named(name, "differs")),
            Some(_) => {}
        }
    }
    for name in found.keys().filter(|name| !expected.contains_key(*name)) {
        differences.push(named(name, "not in the snapshot"));
    }
    differences
}

/// The hard-link groups of the regular files seen so far: the snapshot's
/// (its files' device and inode at backup time, when linked more than
/// once) against the target's (device and inode now). The two partitions
/// of the paths must be the same: files of one snapshot group share one
/// inode, and no inode is shared by files the snapshot keeps apart. Only
/// linked files are remembered, so memory follows the number of links.
#[derive(Debug, Default)]
pub struct HardLinks {
    /// Snapshot group → the target's inode of its first path, and that path.
    groups: HashMap<FileId, (FileId, String)>,
    /// A target inode seen → the snapshot group it belongs to, and the path.
    inodes: HashMap<FileId, (Option<FileId>, String)>,
}

/// A file's device and inode number.
pub type FileId = (u64, u64);

/// Extended attributes as read: name and value.
pub type XattrValues = Vec<(Vec<u8>, Vec<u8>)>;

impl HardLinks {
    /// Check the regular file at `path`: its snapshot group (`None` when
    /// the snapshot has it linked once) and its device, inode and link
    /// count in the target.
    pub fn check(
        &mut self,
        path: &str,
        group: Option<FileId>,
        inode: FileId,
        links: u64,
    ) -> Option<Difference> {
        if group.is_none() && links <= 1 {
            return None;
        }
        let other = self.inodes.get(&inode).cloned();
        let problem = match (group, other) {
            (Some(group), _) if self.groups.contains_key(&group) => {
                let (first_inode, first) = &self.groups[&group];
                (*first_inode != inode)
                    .then(|| format!("is not a hard link of {first}, as it is in the snapshot"))
            }
            (_, Some((_, other))) => Some(format!(
                "is a hard link of {other}, which the snapshot has as a separate file"
            )),
            (Some(group), None) => {
                self.groups.insert(group, (inode, path.to_string()));
                self.inodes.insert(inode, (Some(group), path.to_string()));
                None
            }
            (None, None) => {
                self.inodes.insert(inode, (None, path.to_string()));
                None
            }
        };
        problem.map(|problem| Difference::HardLink { problem })
    }
}

/// A path inside the target as its components.
type Components = Vec<Vec<u8>>;

fn display(components: &[Vec<u8>]) -> String {
    if components.is_empty() {
        return ".".to_string();
    }
    components
        .iter()
        .map(|part| String::from_utf8_lossy(part).into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

fn child(components: &[Vec<u8>], name: &[u8]) -> Components {
    let mut path = components.to_vec();
    path.push(name.to_vec());
    path
}

/// What the walk has found so far; shared with the file checks.
#[derive(Debug)]
struct Findings {
    report: Mutex<TreeVerification>,
    links: Mutex<HardLinks>,
    limit: usize,
    /// Cancelled at the mismatch limit, or when the caller cancels.
    stop: CancellationToken,
}

impl Findings {
    fn record(&self, path: &[Vec<u8>], difference: Difference) {
        let mut report = self.report.lock().expect("report");
        if report.mismatches.len() >= self.limit {
            report.stopped_at_limit = true;
            self.stop.cancel();
            return;
        }
        report.mismatches.push(TreeMismatch {
            path: display(path),
            difference,
        });
        if report.mismatches.len() >= self.limit {
            report.stopped_at_limit = true;
            self.stop.cancel();
        }
    }

    fn record_all(&self, path: &[Vec<u8>], differences: Vec<Difference>) {
        for difference in differences {
            self.record(path, difference);
        }
    }

    fn count_entry(&self) {
        self.report.lock().expect("report").entries += 1;
    }

    fn not_restorable(&self, path: &[Vec<u8>]) {
        let mut report = self.report.lock().expect("report");
        report.not_restorable += 1;
        if report.not_restorable_paths.len() < MAX_NOT_RESTORABLE_NAMED {
            report.not_restorable_paths.push(display(path));
        }
    }
}

/// Verify that `target` holds exactly snapshot `snapshot_id`: see the
/// module documentation for what is compared. A snapshot that cannot be
/// loaded, a target that cannot be opened, or a cancel is an error;
/// everything else that differs is in the returned report.
pub async fn verify_tree(
    repository: &Repository,
    snapshot_id: &ObjectId,
    target: &Path,
    options: &TreeVerifyOptions,
    cancel: CancellationToken,
) -> Result<TreeVerification, EngineError> {
    let started = Instant::now();
    let loaded = LoadedSnapshot::load(repository, snapshot_id).await?;
    let mut verification = verify_tree_loaded(repository, &loaded, target, options, cancel).await?;
    verification.duration_seconds = started.elapsed().as_secs_f64();
    Ok(verification)
}

/// [`verify_tree`] of a snapshot already loaded (the one its restore
/// loaded: the index is not read again).
pub async fn verify_tree_loaded(
    repository: &Repository,
    loaded: &LoadedSnapshot,
    target: &Path,
    options: &TreeVerifyOptions,
    cancel: CancellationToken,
) -> Result<TreeVerification, EngineError> {
    let started = Instant::now();
    let (snapshot_id, snapshot, index) = (&loaded.id, &loaded.snapshot, loaded.index.clone());
    // One that cannot be loaded only costs reading every file.
    let since_snapshot = match &options.since {
        Some(since) => repository.load_snapshot(&since.snapshot).await.ok(),
        None => None,
    };
    let root_fd = rustix::fs::open(
        target,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|error| EngineError::Target {
        path: target.to_path_buf(),
        reason: format!("cannot open it to verify: {error}"),
    })?;
    let findings = Arc::new(Findings {
        report: Mutex::new(TreeVerification {
            snapshot_id: snapshot_id.to_hex(),
            root_tree: snapshot.tree.to_hex(),
            ..TreeVerification::default()
        }),
        links: Mutex::new(HardLinks::default()),
        limit: options.max_mismatches.max(1),
        stop: cancel.child_token(),
    });
    let checker = Arc::new(Checker {
        keys: repository.keys().clone(),
        options: options.clone(),
        root_fd,
        findings: findings.clone(),
    });
    let slots = Arc::new(Semaphore::new(options.parallel_checks.max(1)));
    let mut file_checks = JoinSet::new();
    let since_root = since_snapshot.map_or(SinceSubdirectory::Nothing, |earlier| {
        super::since::since_root(&earlier.tree, &snapshot.tree)
    });
    let mut pending = vec![(
        Vec::new(),
        snapshot.root_attributes(),
        Some(snapshot.tree),
        since_root,
    )];
    // Trees loaded a window at a time (one request for neighbouring
    // blobs) until their directory is visited.
    let mut preloaded = HashMap::new();
    while let Some((path, entry, subtree, since)) = pending.pop() {
        if findings.stop.is_cancelled() {
            break;
        }
        load_window(
            repository,
            &index,
            &loaded.trees,
            (subtree, since),
            &pending,
            &mut preloaded,
        )
        .await;
        let tree = match subtree {
            Some(id) => match tree_of(repository, &index, &loaded.trees, &mut preloaded, &id).await
            {
                Ok(tree) => Some(tree),
                Err(error) => {
                    findings.record(
                        &path,
                        Difference::Snapshot {
                            reason: format!("its tree cannot be read: {error}"),
                        },
                    );
                    None
                }
            },
            None => Some(Tree::default()),
        };
        let since = match since {
            SinceSubdirectory::Same => Some(SinceDirectory::Same),
            SinceSubdirectory::Load(id) => {
                tree_of(repository, &index, &loaded.trees, &mut preloaded, &id)
                    .await
                    .ok()
                    .map(SinceDirectory::Tree)
            }
            SinceSubdirectory::Nothing => None,
        };
        let visit = {
            let checker = checker.clone();
            run_blocking(move || checker.visit_directory(path, &entry, tree, since.as_ref())).await
        };
        let Some(visit) = visit else {
            continue;
        };
        for group in file_groups(visit.files) {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break;
            };
            if findings.stop.is_cancelled() {
                break;
            }
            let checker = checker.clone();
            let directory = visit.directory.clone();
            file_checks.spawn_blocking(move || {
                for (path, entry, unchanged_since) in group {
                    checker.check_file(&directory, &path, &entry, unchanged_since);
                }
                drop(slot);
            });
            while let Some(joined) = file_checks.try_join_next() {
                joined.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
            }
        }
        pending.extend(visit.directories.into_iter().rev());
    }
    while let Some(joined) = file_checks.join_next().await {
        joined.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
    }
    if cancel.is_cancelled() {
        return Err(EngineError::Cancelled);
    }
    let mut report = findings.report.lock().expect("report").clone();
    report.duration_seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// A directory's files in groups checked by one blocking job each: at
/// most [`FILES_PER_CHECK`] files and, past the first, [`BYTES_PER_CHECK`]
/// of content that may be re-read. A job per file would spend more on
/// handing it to a thread than on checking a small file.
fn file_groups(
    files: Vec<(Components, Entry, bool)>,
) -> impl Iterator<Item = Vec<(Components, Entry, bool)>> {
    let mut groups: Vec<Vec<(Components, Entry, bool)>> = Vec::new();
    let mut bytes = 0u64;
    for file in files {
        let to_read = if file.2 { 0 } else { file.1.size };
        let full = groups.last().is_none_or(|group| {
            group.len() >= FILES_PER_CHECK
                || (bytes.saturating_add(to_read) > BYTES_PER_CHECK && !group.is_empty())
        });
        if full {
            groups.push(Vec::new());
            bytes = 0;
        }
        // Saturating: a forged size must not overflow the count.
        bytes = bytes.saturating_add(to_read);
        groups.last_mut().expect("a group").push(file);
    }
    groups.into_iter()
}

/// A tree loaded with its siblings', or loaded now.
async fn tree_of(
    repository: &Repository,
    index: &BlobIndex,
    trees: &TreeCache,
    preloaded: &mut HashMap<BlobId, Result<Tree, String>>,
    id: &BlobId,
) -> Result<Tree, String> {
    match preloaded.remove(id) {
        Some(tree) => tree,
        None => trees
            .take_or_load_one(repository, index, id)
            .await
            .map_err(|error| error.to_string()),
    }
}

/// A directory still to visit: its path, entry, tree and what the since
/// snapshot holds there.
type PendingDirectory = (Components, Entry, Option<BlobId>, SinceSubdirectory);

/// Unless they are loaded already, load the trees the directory about to
/// be visited needs (its own, and the since snapshot's there) together with
/// those of the directories visited after it (the top of `pending`), up to
/// [`TREE_PREFETCH_BYTES`]: neighbouring tree blobs come in one request
/// instead of one each.
async fn load_window(
    repository: &Repository,
    index: &BlobIndex,
    trees: &TreeCache,
    current: (Option<BlobId>, SinceSubdirectory),
    pending: &[PendingDirectory],
    preloaded: &mut HashMap<BlobId, Result<Tree, String>>,
) {
    let trees_of = |(subtree, since): (Option<BlobId>, SinceSubdirectory)| {
        let since = match since {
            SinceSubdirectory::Load(id) => Some(id),
            SinceSubdirectory::Same | SinceSubdirectory::Nothing => None,
        };
        subtree.into_iter().chain(since)
    };
    if trees_of(current).all(|id| preloaded.contains_key(&id)) {
        return;
    }
    let next = pending
        .iter()
        .rev()
        .flat_map(|(_, _, subtree, since)| trees_of((*subtree, *since)));
    let mut ids = Vec::new();
    let mut chosen = std::collections::HashSet::new();
    let mut bytes = 0u64;
    for id in trees_of(current).chain(next) {
        if bytes >= TREE_PREFETCH_BYTES {
            break;
        }
        if preloaded.contains_key(&id) || !chosen.insert(id) {
            continue;
        }
        bytes += index
            .get(&id)
            .map_or(0, |location| u64::from(location.raw_length));
        ids.push(id);
    }
    let loaded = trees.take_or_load(repository, index, &ids).await;
    for (id, tree) in ids.into_iter().zip(loaded) {
        preloaded.insert(id, tree.map_err(|error| error.to_string()));
    }
}

/// What visiting one directory leaves to do.
struct Visit {
    /// The directory, for its files' checks.
    directory: Arc<OwnedFd>,
    /// Its regular files present in the target, and whether the since
    /// snapshot holds them unchanged.
    files: Vec<(Components, Entry, bool)>,
    /// Its subdirectories present in the target, with their trees and
    /// what the since snapshot holds there.
    directories: Vec<PendingDirectory>,
}

/// The blocking half of the walk.
struct Checker {
    keys: RepoKeys,
    options: TreeVerifyOptions,
    root_fd: OwnedFd,
    findings: Arc<Findings>,
}

impl Checker {
    fn unreadable(&self, path: &[Vec<u8>], what: &str, error: Errno) {
        self.findings.record(
            path,
            Difference::Unreadable {
                reason: format!("cannot {what}: {error}"),
            },
        );
    }

    /// Compare the directory at `path` (its metadata and names) with
    /// `entry` and its `tree` (`None`: the tree could not be read), and
    /// the entries that need no reading of content.
    fn visit_directory(
        &self,
        path: Components,
        entry: &Entry,
        tree: Option<Tree>,
        since: Option<&SinceDirectory>,
    ) -> Option<Visit> {
        let directory = match scan::open_directory_at(&self.root_fd, &path) {
            Ok(fd) => fd,
            Err(error) => {
                self.unreadable(&path, "open the directory", error);
                return None;
            }
        };
        self.findings.count_entry();
        match rustix::fs::fstat(&directory) {
            Ok(stat) => {
                let observed = Observed::from_stat(&stat);
                self.findings.record_all(
                    &path,
                    metadata_differences(entry, &observed, self.options.check_owners),
                );
            }
            Err(error) => self.unreadable(&path, "stat the directory", error),
        }
        self.compare_xattrs(&directory, &path, &entry.xattrs);
        let tree = tree?;
        let found = match scan::list_directory(&directory) {
            Ok(names) => names,
            Err(error) => {
                self.unreadable(&path, "list the directory", error);
                return None;
            }
        };
        let mut entries = Vec::with_capacity(tree.entries.len());
        // Names in strictly ascending order (as backups write them) are
        // each listed once; only others need remembering.
        let ascending = tree
            .entries
            .windows(2)
            .all(|pair| pair[0].name.as_slice() < pair[1].name.as_slice());
        let mut names_seen = BTreeSet::new();
        for entry in tree.entries {
            let entry_path = child(&path, &entry.name);
            if let Err(error) = validate_name(&entry.name) {
                self.findings.record(
                    &entry_path,
                    Difference::Snapshot {
                        reason: format!("refused name: {error}"),
                    },
                );
                continue;
            }
            if !ascending && !names_seen.insert(entry.name.to_vec()) {
                self.findings.record(
                    &entry_path,
                    Difference::Snapshot {
                        reason: "the name is listed twice".to_string(),
                    },
                );
                continue;
            }
            entries.push(entry);
        }
        let (missing, extra) =
            name_differences(entries.iter().map(|entry| entry.name.as_slice()), &found);
        for name in &extra {
            self.findings.record(&child(&path, name), Difference::Extra);
        }
        let missing: BTreeSet<Vec<u8>> = missing.into_iter().collect();
        let directory = Arc::new(directory);
        let mut visit = Visit {
            directory: directory.clone(),
            files: Vec::new(),
            directories: Vec::new(),
        };
        for entry in entries {
            if self.findings.stop.is_cancelled() {
                break;
            }
            let entry_path = child(&path, &entry.name);
            let never_created = entry.kind == EntryKind::Socket
                || (matches!(entry.kind, EntryKind::CharDevice | EntryKind::BlockDevice)
                    && !self.options.devices_restored);
            if missing.contains(entry.name.as_slice()) {
                if never_created {
                    self.findings.not_restorable(&entry_path);
                } else {
                    self.findings.record(
                        &entry_path,
                        Difference::Missing {
                            expected: kind_name(Some(entry.kind)),
                        },
                    );
                }
                continue;
            }
            match entry.kind {
                EntryKind::File => {
                    let unchanged = since.is_some_and(|since| since.file_unchanged(&entry));
                    visit.files.push((entry_path, entry, unchanged));
                }
                EntryKind::Directory => match self.observe(&directory, &entry_path, &entry) {
                    Some(observed) if observed.kind == Some(EntryKind::Directory) => {
                        let subtree = entry.subtree;
                        let since = since.map_or(SinceSubdirectory::Nothing, |since| {
                            since.subdirectory(&entry)
                        });
                        visit.directories.push((entry_path, entry, subtree, since));
                    }
                    Some(observed) => {
                        self.findings.count_entry();
                        self.findings.record_all(
                            &entry_path,
                            metadata_differences(&entry, &observed, false),
                        );
                    }
                    None => {}
                },
                _ => {
                    let Some(observed) = self.observe(&directory, &entry_path, &entry) else {
                        continue;
                    };
                    self.findings.count_entry();
                    if never_created {
                        // Left as the target had it; only its kind is
                        // the snapshot's business.
                        if observed.kind != Some(entry.kind) {
                            self.findings.record_all(
                                &entry_path,
                                metadata_differences(&entry, &observed, false),
                            );
                        }
                        continue;
                    }
                    self.findings.record_all(
                        &entry_path,
                        metadata_differences(&entry, &observed, self.options.check_owners),
                    );
                    if entry.kind == EntryKind::Symlink && observed.kind == Some(EntryKind::Symlink)
                    {
                        self.compare_symlink(&directory, &entry_path, &entry);
                    }
                }
            }
        }
        Some(visit)
    }

    /// `lstat` of an entry of `directory`.
    fn observe(&self, directory: &OwnedFd, path: &[Vec<u8>], entry: &Entry) -> Option<Observed> {
        self.lstat(directory, path, entry)
            .map(|stat| Observed::from_stat(&stat))
    }

    /// `lstat` of an entry of `directory`, its absence or failure recorded.
    fn lstat(&self, directory: &OwnedFd, path: &[Vec<u8>], entry: &Entry) -> Option<Stat> {
        match rustix::fs::statat(directory, entry.name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => Some(stat),
            Err(Errno::NOENT) => {
                self.findings.record(
                    path,
                    Difference::Missing {
                        expected: kind_name(Some(entry.kind)),
                    },
                );
                None
            }
            Err(error) => {
                self.unreadable(path, "stat it", error);
                None
            }
        }
    }

    fn compare_symlink(&self, directory: &OwnedFd, path: &[Vec<u8>], entry: &Entry) {
        let expected = entry.link_target.as_deref().map(|target| target.as_slice());
        match rustix::fs::readlinkat(directory, entry.name.as_slice(), Vec::new()) {
            Ok(found) if Some(found.as_bytes()) == expected => {}
            Ok(found) => self.findings.record(
                path,
                Difference::SymlinkTarget {
                    expected: String::from_utf8_lossy(expected.unwrap_or_default()).into_owned(),
                    found: String::from_utf8_lossy(found.as_bytes()).into_owned(),
                },
            ),
            Err(error) => self.unreadable(path, "read the symlink", error),
        }
    }

    fn compare_xattrs(&self, fd: &OwnedFd, path: &[Vec<u8>], expected: &[Xattr]) {
        match read_xattrs(fd) {
            Ok(Some(found)) => self.findings.record_all(
                path,
                xattr_differences(expected, &found, &self.options.xattr_prefixes),
            ),
            // The filesystem keeps none; the restore skips them there too.
            Ok(None) => {}
            Err(error) => self.unreadable(path, "read the extended attributes", error),
        }
    }

    /// Everything about one regular file: kind, metadata, extended
    /// attributes, hard links, and its content chunk by chunk.
    fn check_file(
        &self,
        directory: &OwnedFd,
        path: &[Vec<u8>],
        entry: &Entry,
        unchanged_since: bool,
    ) {
        if self.findings.stop.is_cancelled() {
            return;
        }
        let name = entry.name.as_slice();
        let Some(listed_stat) = self.lstat(directory, path, entry) else {
            return;
        };
        let listed = Observed::from_stat(&listed_stat);
        self.findings.count_entry();
        if unchanged_since && entry.links <= 1 && self.untouched_as_restored(entry, &listed_stat) {
            // Neither read nor written by the sync, as the since
            // snapshot's verified restore left it: its content and
            // extended attributes are that restore's.
            self.findings.report.lock().expect("report").files_not_read += 1;
            return;
        }
        if listed.kind != Some(EntryKind::File) {
            self.findings
                .record_all(path, metadata_differences(entry, &listed, false));
            return;
        }
        let fd = match rustix::fs::openat(
            directory,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(error) => return self.unreadable(path, "open the file", error),
        };
        let stat = match rustix::fs::fstat(&fd) {
            Ok(stat) => stat,
            Err(error) => return self.unreadable(path, "stat the file", error),
        };
        let observed = Observed::from_stat(&stat);
        if (observed.device, observed.inode) != (listed.device, listed.inode)
            || observed.kind != Some(EntryKind::File)
        {
            return self.findings.record(
                path,
                Difference::Unreadable {
                    reason: "it was replaced while being verified".to_string(),
                },
            );
        }
        self.findings.record_all(
            path,
            metadata_differences(entry, &observed, self.options.check_owners),
        );
        self.compare_xattrs(&fd, path, &entry.xattrs);
        let group = (entry.links > 1).then_some((entry.device, entry.inode));
        let linked = self.findings.links.lock().expect("links").check(
            &display(path),
            group,
            (observed.device, observed.inode),
            observed.links,
        );
        if let Some(difference) = linked {
            self.findings.record(path, difference);
        }
        let content_length = entry.content_length();
        if content_length != Some(entry.size) {
            let covered = content_length
                .map_or_else(|| "more than 2^64".to_string(), |bytes| bytes.to_string());
            return self.findings.record(
                path,
                Difference::Snapshot {
                    reason: format!(
                        "its chunk list covers {covered} bytes, its size is {}",
                        entry.size
                    ),
                },
            );
        }
        if observed.size != entry.size {
            // Already reported; the chunks cannot line up.
            return;
        }
        match self.compare_content(&fd, entry) {
            Ok(Some(difference)) => self.findings.record(path, difference),
            Ok(None) => {
                let mut report = self.findings.report.lock().expect("report");
                report.files += 1;
                report.bytes_verified += entry.size;
            }
            Err(Stopped::Io(error)) => self.unreadable(path, "read the file", error),
            Err(Stopped::Cancelled) => {}
        }
    }

    /// Whether a regular file the since snapshot holds unchanged shows on
    /// disk exactly what the restore wrote and last changed before the
    /// sync began (so the sync neither wrote it nor set its attributes).
    fn untouched_as_restored(&self, entry: &Entry, stat: &Stat) -> bool {
        self.options.since.is_some_and(|since| {
            on_disk_as_restored(stat, entry, self.options.check_owners)
                && since.mark.changed_before(stat)
        })
    }

    /// The first chunk or hole of `entry` that the file's bytes do not
    /// match, if any; its extents add up to its size (checked by the
    /// caller).
    fn compare_content(&self, fd: &OwnedFd, entry: &Entry) -> Result<Option<Difference>, Stopped> {
        let mut buffer = Vec::new();
        let mut offset = 0u64;
        for extent in &entry.content {
            if self.findings.stop.is_cancelled() {
                return Err(Stopped::Cancelled);
            }
            let length = extent.length();
            match extent {
                Extent::Chunk(id, _) => {
                    buffer.resize(length as usize, 0);
                    let read = read_exactly_at(fd, &mut buffer, offset).map_err(Stopped::Io)?;
                    if read != buffer.len() || self.keys.blob_id(&buffer) != *id {
                        return Ok(Some(Difference::Content { offset, length }));
                    }
                }
                Extent::Hole(_) => {
                    if let Some(at) = first_nonzero_in(fd, offset, length, &self.findings.stop)? {
                        return Ok(Some(Difference::Hole { offset: at }));
                    }
                }
            }
            offset += length;
        }
        Ok(None)
    }
}

/// Why reading a file's content stopped.
enum Stopped {
    Io(Errno),
    Cancelled,
}

/// `pread` until `buffer` is full or the file ends; the bytes read.
fn read_exactly_at(fd: &OwnedFd, buffer: &mut [u8], offset: u64) -> Result<usize, Errno> {
    let mut done = 0;
    while done < buffer.len() {
        match rustix::io::pread(fd, &mut buffer[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(read) => done += read,
            Err(Errno::INTR) => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(done)
}

/// The offset of the first non-zero byte in `[offset, offset + length)`,
/// reading only the regions the filesystem says hold data (`SEEK_DATA`,
/// `SEEK_HOLE`; everything, where it cannot say).
fn first_nonzero_in(
    fd: &OwnedFd,
    offset: u64,
    length: u64,
    stop: &CancellationToken,
) -> Result<Option<u64>, Stopped> {
    let end = offset + length;
    let mut position = offset;
    let mut buffer = Vec::new();
    while position < end {
        let data_start = match rustix::fs::seek(fd, SeekFrom::Data(position)) {
            Ok(start) => start,
            // No data after `position`: the rest is a hole.
            Err(Errno::NXIO) => return Ok(None),
            Err(Errno::INVAL | Errno::OPNOTSUPP) => position,
            Err(error) => return Err(Stopped::Io(error)),
        };
        if data_start >= end {
            return Ok(None);
        }
        let data_end = match rustix::fs::seek(fd, SeekFrom::Hole(data_start)) {
            Ok(hole) => hole.clamp(data_start + 1, end),
            Err(_) => end,
        };
        let mut at = data_start;
        while at < data_end {
            if stop.is_cancelled() {
                return Err(Stopped::Cancelled);
            }
            let step = (data_end - at).min(READ_BYTES as u64) as usize;
            buffer.resize(step, 0);
            let read = read_exactly_at(fd, &mut buffer, at).map_err(Stopped::Io)?;
            if let Some(index) = buffer[..read].iter().position(|byte| *byte != 0) {
                return Ok(Some(at + index as u64));
            }
            if read < step {
                return Ok(None);
            }
            at += step as u64;
        }
        position = data_end;
    }
    Ok(None)
}

/// The extended attributes of an open file or directory; `None` when its
/// filesystem keeps none.
fn read_xattrs(fd: &OwnedFd) -> Result<Option<XattrValues>, Errno> {
    let mut names = vec![0u8; 4096];
    let length = loop {
        match rustix::fs::flistxattr(fd, &mut names[..]) {
            Ok(length) => break length,
            Err(Errno::RANGE) if names.len() < 1 << 20 => names.resize(names.len() * 4, 0),
            Err(Errno::NOTSUP) => return Ok(None),
            Err(error) => return Err(error),
        }
    };
    let mut found = Vec::new();
    for name in names[..length]
        .split(|byte| *byte == 0)
        .filter(|name| !name.is_empty())
    {
        let mut value = vec![0u8; 1024];
        let value_length = loop {
            match rustix::fs::fgetxattr(fd, name, &mut value[..]) {
                Ok(length) => break length,
                Err(Errno::RANGE) if value.len() < 1 << 20 => value.resize(value.len() * 8, 0),
                Err(error) => return Err(error),
            }
        };
        value.truncate(value_length);
        found.push((name.to_vec(), value));
    }
    Ok(Some(found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_bytes::ByteBuf;

    fn entry(kind: EntryKind) -> Entry {
        Entry {
            mode: 0o640,
            uid: 1000,
            gid: 2000,
            mtime_seconds: 1_700_000_000,
            mtime_nanos: 123,
            inode: 7,
            device: 1,
            size: if kind == EntryKind::File { 10 } else { 0 },
            ..Entry::new(b"f", kind)
        }
    }

    #[test]
    fn files_are_checked_in_groups_bounded_by_count_and_by_bytes_to_read() {
        let file = |size: u64, unchanged: bool| {
            let mut entry = entry(EntryKind::File);
            entry.size = size;
            (Vec::new(), entry, unchanged)
        };
        let sizes = |groups: Vec<Vec<(Components, Entry, bool)>>| -> Vec<usize> {
            groups.iter().map(Vec::len).collect()
        };
        let small: Vec<_> = (0..200).map(|_| file(10, false)).collect();
        assert_eq!(sizes(file_groups(small).collect()), [64, 64, 64, 8]);
        let mixed = vec![
            file(BYTES_PER_CHECK * 2, false),
            file(10, false),
            file(BYTES_PER_CHECK, false),
            file(BYTES_PER_CHECK * 4, true),
            file(10, false),
        ];
        // A large file goes alone; one the sync left unread costs nothing.
        assert_eq!(sizes(file_groups(mixed).collect()), [1, 1, 2, 1]);
        assert_eq!(file_groups(Vec::new()).count(), 0);
    }

    fn observed_as(entry: &Entry) -> Observed {
        Observed {
            kind: Some(entry.kind),
            mode: entry.mode,
            uid: entry.uid,
            gid: entry.gid,
            mtime_seconds: entry.mtime_seconds,
            mtime_nanos: entry.mtime_nanos,
            size: entry.size,
            rdev: entry.rdev,
            device: 50,
            inode: 99,
            links: 1,
        }
    }

    #[test]
    fn an_entry_as_the_restore_writes_it_has_no_differences() {
        for kind in [
            EntryKind::File,
            EntryKind::Directory,
            EntryKind::Symlink,
            EntryKind::Fifo,
            EntryKind::CharDevice,
        ] {
            let expected = entry(kind);
            assert_eq!(
                metadata_differences(&expected, &observed_as(&expected), true),
                Vec::new(),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn another_kind_is_the_only_difference_reported() {
        let expected = entry(EntryKind::File);
        let mut observed = observed_as(&expected);
        observed.kind = Some(EntryKind::Symlink);
        observed.mode = 0o777;
        assert_eq!(
            metadata_differences(&expected, &observed, true),
            vec![Difference::Kind {
                expected: "regular file",
                found: "symlink"
            }]
        );
    }

    #[test]
    fn mode_owner_time_and_size_differences_are_each_named() {
        let expected = entry(EntryKind::File);
        let mut observed = observed_as(&expected);
        observed.mode = 0o4640;
        observed.uid = 0;
        observed.mtime_nanos = 124;
        observed.size = 11;
        assert_eq!(
            metadata_differences(&expected, &observed, true),
            vec![
                Difference::Mode {
                    expected: 0o640,
                    found: 0o4640
                },
                Difference::Owner {
                    expected: (1000, 2000),
                    found: (0, 2000)
                },
                Difference::Mtime {
                    expected: (1_700_000_000, 123),
                    found: (1_700_000_000, 124)
                },
                Difference::Size {
                    expected: 10,
                    found: 11
                },
            ]
        );
    }

    #[test]
    fn owners_are_compared_only_when_the_restore_set_them() {
        let expected = entry(EntryKind::Directory);
        let mut observed = observed_as(&expected);
        observed.gid = 0;
        assert_eq!(
            metadata_differences(&expected, &observed, false),
            Vec::new()
        );
        assert_eq!(metadata_differences(&expected, &observed, true).len(), 1);
    }

    #[test]
    fn a_symlinks_permission_bits_are_not_compared_its_time_is() {
        let expected = entry(EntryKind::Symlink);
        let mut observed = observed_as(&expected);
        observed.mode = 0o777;
        assert_eq!(metadata_differences(&expected, &observed, true), Vec::new());
        observed.mtime_seconds += 1;
        assert!(matches!(
            metadata_differences(&expected, &observed, true)[..],
            [Difference::Mtime { .. }]
        ));
    }

    #[test]
    fn a_device_nodes_number_is_compared() {
        let mut expected = entry(EntryKind::BlockDevice);
        expected.rdev = 0x0801;
        let mut observed = observed_as(&expected);
        observed.rdev = 0x0802;
        assert_eq!(
            metadata_differences(&expected, &observed, true),
            vec![Difference::Device {
                expected: 0x0801,
                found: 0x0802
            }]
        );
    }

    proptest::proptest! {
        /// Whatever the order and repeats of either list, the names
        /// missing and extra are those of the two sets' differences.
        #[test]
        fn missing_and_extra_names_are_the_differences_of_the_two_sets(
            expected in proptest::collection::vec(proptest::collection::vec(0u8..4, 0..3), 0..12),
            found in proptest::collection::vec(proptest::collection::vec(0u8..4, 0..3), 0..12),
        ) {
            let (missing, extra) =
                name_differences(expected.iter().map(Vec::as_slice), &found);
            let wanted: BTreeSet<Vec<u8>> = expected.into_iter().collect();
            let there: BTreeSet<Vec<u8>> = found.into_iter().collect();
            proptest::prop_assert_eq!(missing, wanted.difference(&there).cloned().collect::<Vec<_>>());
            proptest::prop_assert_eq!(extra, there.difference(&wanted).cloned().collect::<Vec<_>>());
        }
    }

    #[test]
    fn names_missing_and_extra_are_told_apart() {
        let expected: Vec<&[u8]> = vec![b"a", b"b", b"c"];
        let found = vec![b"c".to_vec(), b"d".to_vec(), b"a".to_vec()];
        let (missing, extra) = name_differences(expected, &found);
        assert_eq!(missing, vec![b"b".to_vec()]);
        assert_eq!(extra, vec![b"d".to_vec()]);
    }

    fn xattr(name: &str, value: &str) -> Xattr {
        Xattr {
            name: ByteBuf::from(name.as_bytes().to_vec()),
            value: ByteBuf::from(value.as_bytes().to_vec()),
        }
    }

    #[test]
    fn extended_attributes_are_compared_within_the_restores_allowlist() {
        let prefixes = vec![b"user.".to_vec()];
        let expected = vec![
            xattr("user.a", "1"),
            xattr("user.b", "2"),
            xattr("security.selinux", "x"),
        ];
        let found = vec![
            (b"user.a".to_vec(), b"1".to_vec()),
            (b"user.b".to_vec(), b"3".to_vec()),
            (b"user.c".to_vec(), b"4".to_vec()),
            (b"trusted.x".to_vec(), b"5".to_vec()),
        ];
        let problems: Vec<String> = xattr_differences(&expected, &found, &prefixes)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            problems,
            vec![
                "extended attribute user.b: differs",
                "extended attribute user.c: not in the snapshot"
            ]
        );
        assert_eq!(
            xattr_differences(&expected, &found[..1], &prefixes),
            vec![Difference::Xattr {
                name: "user.b".to_string(),
                problem: "missing"
            }]
        );
    }

    #[test]
    fn files_of_one_snapshot_group_must_share_one_inode() {
        let mut links = HardLinks::default();
        assert_eq!(links.check("a", Some((1, 7)), (50, 100), 2), None);
        assert_eq!(links.check("b", Some((1, 7)), (50, 100), 2), None);
        let broken = links.check("c", Some((1, 7)), (50, 101), 1);
        assert_eq!(
            broken.map(|difference| difference.to_string()),
            Some("is not a hard link of a, as it is in the snapshot".to_string())
        );
    }

    #[test]
    fn files_the_snapshot_keeps_apart_must_not_share_an_inode() {
        let mut links = HardLinks::default();
        assert_eq!(links.check("single", None, (50, 100), 2), None);
        let shared = links.check("other", None, (50, 100), 2);
        assert!(
            shared
                .map(|difference| difference.to_string())
                .is_some_and(|text| text.contains("hard link of single")),
        );
        let mut links = HardLinks::default();
        assert_eq!(links.check("grouped", Some((1, 7)), (50, 100), 2), None);
        assert!(links.check("stray", None, (50, 100), 2).is_some());
        assert!(
            links
                .check("other group", Some((1, 8)), (50, 100), 3)
                .is_some(),
            "two snapshot groups on one inode"
        );
        assert_eq!(
            links.check("unlinked", None, (50, 200), 1),
            None,
            "a file linked once is not remembered"
        );
    }

    #[test]
    fn a_tree_verification_names_its_root_tree_only_without_mismatches() {
        let mut report = TreeVerification {
            root_tree: "abc".to_string(),
            ..TreeVerification::default()
        };
        assert_eq!(report.verified_tree(), Some("abc"));
        report.mismatches.push(TreeMismatch {
            path: "x".to_string(),
            difference: Difference::Extra,
        });
        assert_eq!(report.verified_tree(), None);
        assert_eq!(report.mismatches[0].to_string(), "x: not in the snapshot");
    }
}
