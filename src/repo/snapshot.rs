//! Snapshot manifests: one JSON object per backup, written last, naming the
//! root tree and summarising what the backup did.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use serde_bytes::ByteBuf;

use super::tree::{Entry, EntryKind, Xattr};
use super::{BlobId, ObjectId};

/// At most this many per-file warnings are kept in a manifest; the count
/// of all of them is kept in [`SnapshotSummary::warning_count`].
pub const MAX_RECORDED_WARNINGS: usize = 1000;

/// A snapshot manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// Format version of the manifest.
    pub format_version: u32,
    /// When the backup started (RFC 3339, UTC).
    pub time: String,
    /// Host (or stage pod) that made it.
    pub hostname: String,
    /// What was backed up: a path, or `namespace/pvc` for a volume.
    pub source: String,
    /// Root tree.
    pub tree: BlobId,
    /// Attributes of the source directory itself.
    pub root: RootAttributes,
    /// The snapshot this one was made incrementally against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ObjectId>,
    /// User tags.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
    /// What the backup did.
    pub summary: SnapshotSummary,
}

/// Attributes of the backed-up directory itself, applied to the restore
/// target.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RootAttributes {
    /// Permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds.
    pub mtime_seconds: i64,
    /// Modification time, nanoseconds part.
    pub mtime_nanos: u32,
    /// Extended attributes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xattrs: Vec<Xattr>,
}

/// Figures and warnings of one backup.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSummary {
    /// Regular files in the snapshot.
    pub files: u64,
    /// Directories in the snapshot.
    pub directories: u64,
    /// Other entries (symlinks, devices, FIFOs, sockets).
    pub other_entries: u64,
    /// Bytes of file content in the snapshot.
    pub total_bytes: u64,
    /// Bytes read from the source (unchanged files are not read).
    pub bytes_read: u64,
    /// Plaintext bytes of blobs the repository did not have.
    pub bytes_new: u64,
    /// Bytes those new blobs take in packs, after compression.
    pub bytes_stored: u64,
    /// Files taken from the parent snapshot without reading.
    pub files_unchanged: u64,
    /// Packs written.
    pub packs_written: u64,
    /// Wall time in seconds.
    pub duration_seconds: f64,
    /// Number of per-file warnings.
    pub warning_count: u64,
    /// The first [`MAX_RECORDED_WARNINGS`] warnings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<FileWarning>,
}

/// A file that could not be backed up as it should have been.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWarning {
    /// Path relative to the backup source.
    pub path: String,
    /// What happened.
    pub message: String,
}

/// A manifest that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("snapshot manifest is not valid: {0}")]
pub struct SnapshotError(#[source] pub serde_json::Error);

impl Snapshot {
    /// Encode, returning the bytes and the snapshot's id.
    pub fn encode(&self) -> (ObjectId, Vec<u8>) {
        let bytes = serde_json::to_vec_pretty(self).expect("snapshot serializes");
        (ObjectId::of(&bytes), bytes)
    }

    /// The source directory's own attributes as a tree entry.
    pub fn root_attributes(&self) -> Entry {
        let root = &self.root;
        Entry {
            name: ByteBuf::from(b".".to_vec()),
            kind: EntryKind::Directory,
            mode: root.mode,
            uid: root.uid,
            gid: root.gid,
            mtime_seconds: root.mtime_seconds,
            mtime_nanos: root.mtime_nanos,
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
            xattrs: root.xattrs.clone(),
        }
    }

    /// Decode a manifest.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        serde_json::from_slice(bytes).map_err(SnapshotError)
    }
}
