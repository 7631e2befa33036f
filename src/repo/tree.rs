//! Tree blobs: one per directory, listing its entries sorted by name, with
//! everything needed to recreate them (type, mode, owner, times, content,
//! link target, device number, xattrs).
//!
//! Trees are encoded as CBOR, so names and link targets are byte strings
//! (Linux names need not be UTF-8). A tree read from a repository is
//! untrusted: [`Tree::decode`] refuses names that could reach outside the
//! directory and duplicate names.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::BlobId;

/// What kind of file an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory with a subtree.
    Directory,
    /// A symbolic link.
    Symlink,
    /// A named pipe; never opened for reading during backup.
    Fifo,
    /// A Unix socket; recorded, not restorable as a live socket.
    Socket,
    /// A character device; never opened during backup.
    CharDevice,
    /// A block device; never opened during backup.
    BlockDevice,
}

/// A piece of a file's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Extent {
    /// A stored chunk and its plaintext length.
    Chunk(BlobId, u32),
    /// A hole of this many bytes: stores nothing, restored as a hole.
    Hole(u64),
}

impl Extent {
    /// Bytes of file content this extent covers.
    pub fn length(&self) -> u64 {
        match self {
            Extent::Chunk(_, length) => u64::from(*length),
            Extent::Hole(length) => *length,
        }
    }
}

/// An extended attribute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xattr {
    /// Full name, e.g. `user.comment`.
    pub name: ByteBuf,
    /// Raw value.
    pub value: ByteBuf,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Name within the directory (one path component, any bytes but `/` and NUL).
    pub name: ByteBuf,
    /// File type.
    pub kind: EntryKind,
    /// Permission bits including setuid, setgid and sticky (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime_seconds: i64,
    /// Nanoseconds part of the modification time.
    pub mtime_nanos: u32,
    /// Change time, seconds (used to decide if a file can be skipped next time).
    pub ctime_seconds: i64,
    /// Nanoseconds part of the change time.
    pub ctime_nanos: u32,
    /// Inode number at backup time.
    pub inode: u64,
    /// Device number of the filesystem at backup time.
    pub device: u64,
    /// Hard link count at backup time; above 1, entries with the same
    /// (device, inode) are restored as hard links.
    pub links: u64,
    /// Size in bytes (for files, the sum of the extents).
    pub size: u64,
    /// Content of a file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content: Vec<Extent>,
    /// Tree of a directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subtree: Option<BlobId>,
    /// Target of a symlink, verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<ByteBuf>,
    /// Device number of a device node.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rdev: u64,
    /// Extended attributes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xattrs: Vec<Xattr>,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// The entries of one directory, sorted by name bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tree {
    /// The entries.
    pub entries: Vec<Entry>,
}

/// A name in a tree that a restore must refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty name.
    #[error("empty entry name")]
    Empty,
    /// `.` or `..`.
    #[error("entry name {0:?} refers to a directory itself or its parent")]
    DotOrDotDot(String),
    /// Contains a `/` or NUL.
    #[error("entry name {0:?} contains a path separator or NUL byte")]
    Separator(String),
}

/// Check that `name` is one path component that stays inside its directory.
pub fn validate_name(name: &[u8]) -> Result<(), NameError> {
    let shown = || String::from_utf8_lossy(name).into_owned();
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name == b"." || name == b".." {
        return Err(NameError::DotOrDotDot(shown()));
    }
    if name.iter().any(|byte| *byte == b'/' || *byte == 0) {
        return Err(NameError::Separator(shown()));
    }
    Ok(())
}

/// A tree blob that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// Not valid CBOR of the tree shape.
    #[error("tree is not valid: {0}")]
    Malformed(String),
}

impl Entry {
    /// An entry of `kind` named `name` with every other field empty: mode
    /// 0, owner 0, times 0, inode and device 0, one link, no content, no
    /// subtree, no link target, no extended attributes. The place to start
    /// from (`Entry { mode, ..Entry::new(name, kind) }`) so that a field
    /// added later has one default.
    pub fn new(name: &[u8], kind: EntryKind) -> Entry {
        Entry {
            name: ByteBuf::from(name.to_vec()),
            kind,
            mode: 0,
            uid: 0,
            gid: 0,
            mtime_seconds: 0,
            mtime_nanos: 0,
            ctime_seconds: 0,
            ctime_nanos: 0,
            inode: 0,
            device: 0,
            links: 1,
            size: 0,
            content: Vec::new(),
            subtree: None,
            link_target: None,
            rdev: 0,
            xattrs: Vec::new(),
        }
    }

    /// The bytes its content adds up to (chunks and holes), or `None`
    /// when that overflows: a file whose content does not add up to its
    /// `size` is damaged or forged, and a restore refuses it.
    pub fn content_length(&self) -> Option<u64> {
        self.content
            .iter()
            .try_fold(0u64, |sum, extent| sum.checked_add(extent.length()))
    }

    /// Whether this regular file and `earlier` (the same path in an
    /// earlier snapshot) would be restored as the same file: same content,
    /// size, permissions, owner, modification time and extended
    /// attributes. A sync from the earlier snapshot's copy need not read
    /// such a file when the disk still shows what that restore wrote
    /// (its inode and change time belong to the source and do not count).
    pub fn restores_as(&self, earlier: &Entry) -> bool {
        self.kind == EntryKind::File
            && earlier.kind == EntryKind::File
            && self.size == earlier.size
            && self.mode == earlier.mode
            && self.uid == earlier.uid
            && self.gid == earlier.gid
            && self.mtime_seconds == earlier.mtime_seconds
            && self.mtime_nanos == earlier.mtime_nanos
            && self.content == earlier.content
            && self.xattrs == earlier.xattrs
    }
}

impl Tree {
    /// Encode as CBOR.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        ciborium::into_writer(self, &mut bytes).expect("in-memory CBOR encoding");
        bytes
    }

    /// Decode CBOR (what [`Tree::encode`] writes). Names are not checked
    /// here; see [`validate_name`].
    pub fn decode(bytes: &[u8]) -> Result<Self, TreeError> {
        cbor4ii::serde::from_slice(bytes).map_err(|error| TreeError::Malformed(error.to_string()))
    }

    /// Find an entry by name (entries are sorted).
    pub fn find(&self, name: &[u8]) -> Option<&Entry> {
        self.entries
            .binary_search_by(|entry| entry.name.as_slice().cmp(name))
            .ok()
            .map(|index| &self.entries[index])
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn names_that_leave_the_directory_are_refused() {
        for bad in [&b""[..], b".", b"..", b"a/b", b"/etc", b"nul\0byte"] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        for good in [
            &b"a"[..],
            b"...",
            b".hidden",
            b"\xff\xfe",
            "ünïcode".as_bytes(),
        ] {
            assert!(validate_name(good).is_ok(), "{good:?}");
        }
    }

    fn any_entry() -> impl Strategy<Value = Entry> {
        let kind = prop_oneof![
            Just(EntryKind::File),
            Just(EntryKind::Directory),
            Just(EntryKind::Symlink),
            Just(EntryKind::Fifo),
            Just(EntryKind::Socket),
            Just(EntryKind::CharDevice),
            Just(EntryKind::BlockDevice),
        ];
        let extent = prop_oneof![
            (any::<[u8; 32]>(), any::<u32>())
                .prop_map(|(id, length)| Extent::Chunk(BlobId(id), length)),
            any::<u64>().prop_map(Extent::Hole),
        ];
        let bytes = || proptest::collection::vec(any::<u8>(), 0..40).prop_map(ByteBuf::from);
        let xattr = (bytes(), bytes()).prop_map(|(name, value)| Xattr { name, value });
        (
            (
                bytes(),
                kind,
                any::<[u32; 3]>(),
                any::<(i64, u32, i64, u32)>(),
            ),
            any::<[u64; 4]>(),
            proptest::collection::vec(extent, 0..4),
            proptest::option::of(any::<[u8; 32]>().prop_map(BlobId)),
            proptest::option::of(bytes()),
            any::<u64>(),
            proptest::collection::vec(xattr, 0..3),
        )
            .prop_map(
                |(
                    (
                        name,
                        kind,
                        [mode, uid, gid],
                        (mtime_seconds, mtime_nanos, ctime_seconds, ctime_nanos),
                    ),
                    [inode, device, links, size],
                    content,
                    subtree,
                    link_target,
                    rdev,
                    xattrs,
                )| Entry {
                    name,
                    kind,
                    mode,
                    uid,
                    gid,
                    mtime_seconds,
                    mtime_nanos,
                    ctime_seconds,
                    ctime_nanos,
                    inode,
                    device,
                    links,
                    size,
                    content,
                    subtree,
                    link_target,
                    rdev,
                    xattrs,
                },
            )
    }

    proptest! {
        /// Trees are written by one CBOR library and read by another: every
        /// tree written reads back as itself, and bytes both libraries
        /// accept (a tree with a byte changed) mean the same tree to both.
        #[test]
        fn every_tree_written_reads_back_as_itself(
            entries in proptest::collection::vec(any_entry(), 0..12),
            flip in any::<(usize, u8)>(),
        ) {
            let tree = Tree { entries };
            let mut bytes = tree.encode();
            prop_assert_eq!(&Tree::decode(&bytes).expect("a tree just written"), &tree);
            let at = flip.0 % bytes.len();
            bytes[at] ^= flip.1.max(1);
            let written_by: Result<Tree, _> = ciborium::from_reader(bytes.as_slice());
            if let (Ok(theirs), Ok(ours)) = (written_by, Tree::decode(&bytes)) {
                prop_assert_eq!(ours, theirs);
            }
        }
    }

    fn file(content: Vec<Extent>) -> Entry {
        Entry {
            name: ByteBuf::from(b"data.bin".to_vec()),
            kind: EntryKind::File,
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            mtime_seconds: 1_700_000_000,
            mtime_nanos: 5,
            ctime_seconds: 1_700_000_001,
            ctime_nanos: 6,
            inode: 42,
            device: 7,
            links: 1,
            size: content.iter().map(Extent::length).sum(),
            content,
            subtree: None,
            link_target: None,
            rdev: 0,
            xattrs: Vec::new(),
        }
    }

    #[test]
    fn a_file_restores_as_its_earlier_self_only_with_the_same_content_and_attributes() {
        let chunk = |byte: u8| Extent::Chunk(BlobId([byte; 32]), 10);
        let earlier = file(vec![chunk(1), Extent::Hole(4)]);
        let mut moved = earlier.clone();
        // Inode, device and change time are the source's, not the copy's.
        moved.inode = 43;
        moved.device = 8;
        moved.ctime_seconds += 60;
        assert!(moved.restores_as(&earlier));

        // Same size and time, other bytes (a `touch -r` after a rewrite).
        let rewritten = file(vec![chunk(2), Extent::Hole(4)]);
        assert_eq!(rewritten.size, earlier.size);
        assert!(!rewritten.restores_as(&earlier));
        let changes: [fn(&mut Entry); 6] = [
            |entry| entry.mode = 0o600,
            |entry| entry.uid = 0,
            |entry| entry.gid = 0,
            |entry| entry.mtime_nanos = 6,
            |entry| {
                entry.xattrs = vec![Xattr {
                    name: ByteBuf::from(b"user.tag".to_vec()),
                    value: ByteBuf::from(b"x".to_vec()),
                }]
            },
            |entry| entry.kind = EntryKind::Symlink,
        ];
        for change in changes {
            let mut changed = earlier.clone();
            change(&mut changed);
            assert!(!changed.restores_as(&earlier), "{changed:?}");
        }
    }
}
