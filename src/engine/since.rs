//! A sync restore's shortcut: the snapshot the target was last restored
//! (or synced) from, completely — its *since* snapshot.
//!
//! Without it a sync reads and hashes every file of the target to find what
//! differs, so a cutover pass costs a read of the whole claim however little
//! changed. With it, a file is not read when the two snapshots hold the same
//! file at its path ([`Entry::restores_as`]: same content, size, attributes
//! and time) and the disk still shows what that restore wrote (a regular
//! file of that size, permissions, owner and modification time): the pass
//! reads only what changed between the snapshots, as rsync's quick check
//! does, but decided on the snapshots' content, so a file rewritten at the
//! source with its old size and time put back (ctime catches it at backup)
//! is still compared. What it trusts is that nothing wrote into the target
//! since that restore and put the size and time back; the controller stops
//! naming a claim's since snapshot while a sync into it runs, so a pass cut
//! off half-way is followed by a full comparison.
//!
//! The restore and the tree verification after it use the same rule, from
//! here. The verification must still re-read every file the sync wrote —
//! including a file both snapshots agree on that the sync found changed on
//! disk and put right, which afterwards looks as restored — so before
//! writing, the sync takes a [`ChangeMark`] from the target filesystem's own
//! clock: everything it writes or sets attributes of changes later, and the
//! verification skips only files whose change time is older.

use std::os::fd::OwnedFd;

use rustix::fs::{FileType, Stat, Timespec, Timestamps};

use crate::repo::BlobId;
use crate::repo::tree::{Entry, EntryKind, Tree};

/// What the since snapshot holds at the directory being walked.
#[derive(Debug, Clone)]
pub enum SinceDirectory {
    /// The same tree as the snapshot's (the same tree id): every file in it
    /// is unchanged.
    Same,
    /// Its own tree there.
    Tree(Tree),
}

/// What the since snapshot holds at a subdirectory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinceSubdirectory {
    /// The same tree.
    Same,
    /// Another tree, to be loaded.
    Load(BlobId),
    /// Nothing there (or not a directory): every file below is compared.
    Nothing,
}

impl SinceDirectory {
    /// Whether `entry`, a regular file of this directory in the snapshot
    /// being restored, is the same file in the since snapshot.
    pub fn file_unchanged(&self, entry: &Entry) -> bool {
        match self {
            SinceDirectory::Same => entry.kind == EntryKind::File,
            SinceDirectory::Tree(tree) => tree
                .find(&entry.name)
                .is_some_and(|earlier| entry.restores_as(earlier)),
        }
    }

    /// What the since snapshot holds at subdirectory `entry`.
    pub fn subdirectory(&self, entry: &Entry) -> SinceSubdirectory {
        let Some(subtree) = entry.subtree else {
            return SinceSubdirectory::Nothing;
        };
        match self {
            SinceDirectory::Same => SinceSubdirectory::Same,
            SinceDirectory::Tree(tree) => match tree.find(&entry.name) {
                Some(earlier) if earlier.kind == EntryKind::Directory => match earlier.subtree {
                    Some(id) if id == subtree => SinceSubdirectory::Same,
                    Some(id) => SinceSubdirectory::Load(id),
                    None => SinceSubdirectory::Nothing,
                },
                _ => SinceSubdirectory::Nothing,
            },
        }
    }
}

/// The since snapshot's root against the snapshot's root tree id.
pub fn since_root(since_root_tree: &BlobId, snapshot_root_tree: &BlobId) -> SinceSubdirectory {
    if since_root_tree == snapshot_root_tree {
        SinceSubdirectory::Same
    } else {
        SinceSubdirectory::Load(*since_root_tree)
    }
}

/// What the verification after a sync needs to skip what the sync did
/// not read: its since snapshot and the mark taken before it wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinceCheck {
    /// The since snapshot.
    pub snapshot: crate::repo::ObjectId,
    /// The target filesystem's clock before the sync wrote.
    pub mark: ChangeMark,
}

/// A reading of the target filesystem's clock (a change time) taken before
/// a sync wrote anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ChangeMark {
    seconds: i64,
    nanos: i64,
}

impl ChangeMark {
    /// Read the clock of the filesystem holding `directory`: set its times
    /// to what they are (which moves its change time to that filesystem's
    /// now, on its own clock, as every write of the sync will) and read its
    /// change time back. `None` when that is not allowed; then nothing is
    /// skipped by the verification.
    pub fn take(directory: &OwnedFd) -> Option<ChangeMark> {
        let before = rustix::fs::fstat(directory).ok()?;
        let times = Timestamps {
            last_access: Timespec {
                tv_sec: before.st_atime,
                tv_nsec: before.st_atime_nsec as _,
            },
            last_modification: Timespec {
                tv_sec: before.st_mtime,
                tv_nsec: before.st_mtime_nsec as _,
            },
        };
        rustix::fs::futimens(directory, &times).ok()?;
        let after = rustix::fs::fstat(directory).ok()?;
        Some(ChangeMark::of(&after))
    }

    fn of(stat: &Stat) -> ChangeMark {
        ChangeMark {
            seconds: stat.st_ctime,
            nanos: stat.st_ctime_nsec as i64,
        }
    }

    /// Whether the file at `stat` last changed before the mark was taken
    /// (so the sync neither wrote it nor set its attributes).
    pub fn changed_before(&self, stat: &Stat) -> bool {
        ChangeMark::of(stat) < *self
    }
}

/// Whether the file at `stat` (an `lstat`) still shows what a restore of
/// `entry` wrote: a regular file of its size, permissions, modification
/// time and (when the restore set them) owner.
pub fn on_disk_as_restored(stat: &Stat, entry: &Entry, owners_restored: bool) -> bool {
    FileType::from_raw_mode(stat.st_mode) == FileType::RegularFile
        && stat.st_size as u64 == entry.size
        && (stat.st_mode & 0o7777) == entry.mode
        && stat.st_mtime == entry.mtime_seconds
        && stat.st_mtime_nsec as u32 == entry.mtime_nanos
        && (!owners_restored || (stat.st_uid == entry.uid && stat.st_gid == entry.gid))
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::repo::tree::Extent;

    fn entry(name: &str, kind: EntryKind, content: Vec<Extent>, subtree: Option<BlobId>) -> Entry {
        Entry {
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            mtime_seconds: 1_700_000_000,
            ctime_seconds: 1_700_000_000,
            inode: 1,
            device: 1,
            size: content.iter().map(Extent::length).sum(),
            content,
            subtree,
            ..Entry::new(name.as_bytes(), kind)
        }
    }

    fn file(name: &str, byte: u8) -> Entry {
        entry(
            name,
            EntryKind::File,
            vec![Extent::Chunk(BlobId([byte; 32]), 100)],
            None,
        )
    }

    fn directory(name: &str, tree: u8) -> Entry {
        entry(
            name,
            EntryKind::Directory,
            Vec::new(),
            Some(BlobId([tree; 32])),
        )
    }

    #[test]
    fn only_files_the_since_snapshot_holds_unchanged_are_unchanged() {
        let since = SinceDirectory::Tree(Tree {
            entries: vec![file("a", 1), file("b", 2), directory("d", 9)],
        });
        assert!(since.file_unchanged(&file("a", 1)));
        assert!(!since.file_unchanged(&file("b", 3)), "other content");
        assert!(!since.file_unchanged(&file("c", 1)), "new in the snapshot");
        assert!(!since.file_unchanged(&file("d", 1)), "a directory before");
        assert!(SinceDirectory::Same.file_unchanged(&file("z", 5)));
        assert!(
            !SinceDirectory::Same.file_unchanged(&directory("d", 9)),
            "only regular files are skipped"
        );
    }

    #[test]
    fn subdirectories_are_the_same_another_tree_or_nothing() {
        let since = SinceDirectory::Tree(Tree {
            entries: vec![
                directory("other", 2),
                directory("same", 1),
                file("was-file", 3),
            ],
        });
        assert_eq!(
            since.subdirectory(&directory("same", 1)),
            SinceSubdirectory::Same
        );
        assert_eq!(
            since.subdirectory(&directory("other", 7)),
            SinceSubdirectory::Load(BlobId([2; 32]))
        );
        assert_eq!(
            since.subdirectory(&directory("was-file", 4)),
            SinceSubdirectory::Nothing
        );
        assert_eq!(
            since.subdirectory(&directory("new", 4)),
            SinceSubdirectory::Nothing
        );
        assert_eq!(
            SinceDirectory::Same.subdirectory(&directory("any", 4)),
            SinceSubdirectory::Same
        );
        assert_eq!(
            since_root(&BlobId([1; 32]), &BlobId([1; 32])),
            SinceSubdirectory::Same
        );
    }

    #[test]
    fn the_disk_must_show_the_size_permissions_time_and_owner_the_restore_wrote() {
        let directory = tempfile::tempdir().expect("tempdir");
        let path = directory.path().join("f");
        std::fs::write(&path, vec![7u8; 100]).expect("write");
        let stat = rustix::fs::lstat(&path).expect("lstat");
        let mut written = file("f", 1);
        written.mode = stat.st_mode & 0o7777;
        written.mtime_seconds = stat.st_mtime;
        written.mtime_nanos = stat.st_mtime_nsec as u32;
        written.uid = stat.st_uid;
        written.gid = stat.st_gid;
        assert!(on_disk_as_restored(&stat, &written, true));
        let changes: [fn(&mut Entry); 5] = [
            |entry| entry.size += 1,
            |entry| entry.mode ^= 0o100,
            |entry| entry.mtime_nanos ^= 1,
            |entry| entry.mtime_seconds -= 1,
            |entry| entry.uid += 1,
        ];
        for change in changes {
            let mut other = written.clone();
            change(&mut other);
            assert!(!on_disk_as_restored(&stat, &other, true), "{other:?}");
        }
        let mut other_owner = written.clone();
        other_owner.uid += 1;
        assert!(
            on_disk_as_restored(&stat, &other_owner, false),
            "owners count only when the restore set them"
        );
        let link = directory.path().join("l");
        std::os::unix::fs::symlink("f", &link).expect("symlink");
        let link_stat = rustix::fs::lstat(&link).expect("lstat");
        assert!(!on_disk_as_restored(&link_stat, &written, false));
    }

    #[test]
    fn a_file_written_after_the_mark_changed_after_it_and_one_left_alone_before() {
        let directory = tempfile::tempdir().expect("tempdir");
        let old = directory.path().join("old");
        std::fs::write(&old, b"old").expect("write");
        // Change times are taken from a coarse clock: step past its tick.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let root = rustix::fs::open(
            directory.path(),
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY,
            rustix::fs::Mode::empty(),
        )
        .expect("open");
        let mark = ChangeMark::take(&root).expect("a mark");
        let new = directory.path().join("new");
        std::fs::write(&new, b"new").expect("write");
        let touched = directory.path().join("old");
        assert!(mark.changed_before(&rustix::fs::lstat(&touched).expect("lstat")));
        assert!(!mark.changed_before(&rustix::fs::lstat(&new).expect("lstat")));
        // Setting attributes counts as a change, as the sync's do.
        std::fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
        assert!(!mark.changed_before(&rustix::fs::lstat(&old).expect("lstat")));
    }
}
