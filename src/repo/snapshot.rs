//! Snapshot manifests: one JSON object per backup, written last, naming the
//! root tree and summarising what the backup did.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
    /// The PersistentVolumeClaim this snapshot was read from, with what a
    /// destination cluster needs to recreate it (a snapshot of a directory
    /// has none). Older manifests lack it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<ClaimRecord>,
    /// What the backup did.
    pub summary: SnapshotSummary,
}

/// A PersistentVolumeClaim as it was when backed up: everything needed to
/// recreate it on another cluster from the storage location alone. Labels
/// and annotations are the user's (those that belong to the old cluster,
/// its binding and provisioning annotations and
/// `kubectl.kubernetes.io/last-applied-configuration`, are left out when
/// the record is made).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    /// Namespace of the claim.
    pub namespace: String,
    /// Name of the claim.
    pub name: String,
    /// Its labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Its annotations, without the cluster-bound ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Its storage class (`spec.storageClassName`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
    /// That class's provisioner, so a destination can map by provisioner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioner: Option<String>,
    /// Access modes (`ReadWriteOnce`, `ReadOnlyMany`, `ReadWriteMany`,
    /// `ReadWriteOncePod`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub access_modes: Vec<String>,
    /// `Filesystem` or `Block`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mode: Option<String>,
    /// The requested size, bytes.
    #[serde(default)]
    pub requested_bytes: u64,
    /// Bytes in use, when the source cluster reported them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
    /// The VolumeBackup that read it, `namespace/name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
    /// The source cluster's identity (the UID of its `kube-system`
    /// namespace, as Velero records it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
}

impl ClaimRecord {
    /// Whether the claim was read by the VolumeBackup `wanted`: its
    /// `namespace/name`, or its name alone (any namespace).
    pub fn is_from_backup(&self, wanted: &str) -> bool {
        self.backup
            .as_deref()
            .is_some_and(|recorded| names_match(recorded, wanted))
    }

    /// Whether the claim was read by exactly the VolumeBackup `backup`
    /// (`namespace/name`) of the cluster `cluster` (the identity the
    /// controller recorded, `None` when it could not read one): the
    /// snapshots deleting that VolumeBackup with `deletionPolicy: Delete`
    /// forgets. A backup of the same name in another cluster writing to
    /// the same repository is not it.
    pub fn is_from_backup_of_cluster(&self, backup: &str, cluster: Option<&str>) -> bool {
        self.backup.as_deref() == Some(backup) && self.cluster.as_deref() == cluster
    }

    /// Whether this is the claim `wanted`: its `namespace/name`, or its
    /// name alone (any namespace).
    pub fn is_claim(&self, wanted: &str) -> bool {
        names_match(&format!("{}/{}", self.namespace, self.name), wanted)
    }
}

/// `recorded` is `namespace/name`; `wanted` is the same, or a name alone.
fn names_match(recorded: &str, wanted: &str) -> bool {
    recorded == wanted || (!wanted.contains('/') && recorded.rsplit('/').next() == Some(wanted))
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
pub enum SnapshotError {
    /// Not JSON of the manifest's shape.
    #[error("snapshot manifest is not valid: {0}")]
    Malformed(#[source] serde_json::Error),
    /// A format 2 manifest that does not open.
    #[error("encrypted snapshot manifest does not open: {0}")]
    Sealed(String),
}

impl Snapshot {
    /// Its time to the second, for tables (`2026-12-01T13:49:02Z`): the
    /// recorded time may carry a fraction, which only orders snapshots of
    /// the same second.
    pub fn time_to_the_second(&self) -> String {
        match self.time.split_once('.') {
            Some((whole, fraction)) if fraction.ends_with('Z') => format!("{whole}Z"),
            _ => self.time.clone(),
        }
    }

    /// Encode as format 1, returning the bytes and the snapshot's id.
    pub fn encode(&self) -> (ObjectId, Vec<u8>) {
        let bytes = serde_json::to_vec_pretty(self).expect("snapshot serializes");
        (ObjectId::of(&bytes), bytes)
    }

    /// The source directory's own attributes as a tree entry.
    pub fn root_attributes(&self) -> Entry {
        let root = &self.root;
        Entry {
            mode: root.mode,
            uid: root.uid,
            gid: root.gid,
            mtime_seconds: root.mtime_seconds,
            mtime_nanos: root.mtime_nanos,
            xattrs: root.xattrs.clone(),
            ..Entry::new(b".", EntryKind::Directory)
        }
    }

    /// Decode a manifest.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        serde_json::from_slice(bytes).map_err(SnapshotError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_record_matches_its_backup_and_claim_by_full_name_or_name_alone() {
        let record = ClaimRecord {
            namespace: "shop".to_string(),
            name: "db".to_string(),
            backup: Some("ops/nightly".to_string()),
            ..ClaimRecord::default()
        };
        assert!(record.is_from_backup("ops/nightly"));
        assert!(record.is_from_backup("nightly"));
        assert!(!record.is_from_backup("other/nightly"));
        assert!(!record.is_from_backup("night"));
        assert!(record.is_claim("shop/db"));
        assert!(record.is_claim("db"));
        assert!(!record.is_claim("web/db"));
        assert!(
            !ClaimRecord::default().is_from_backup("nightly"),
            "no backup recorded"
        );
    }

    #[test]
    fn a_backups_own_snapshots_are_those_of_its_full_name_and_its_cluster() {
        let record = ClaimRecord {
            namespace: "shop".to_string(),
            name: "db".to_string(),
            backup: Some("ops/nightly".to_string()),
            cluster: Some("uid-a".to_string()),
            ..ClaimRecord::default()
        };
        assert!(record.is_from_backup_of_cluster("ops/nightly", Some("uid-a")));
        assert!(!record.is_from_backup_of_cluster("nightly", Some("uid-a")));
        assert!(!record.is_from_backup_of_cluster("ops/nightly", Some("uid-b")));
        assert!(!record.is_from_backup_of_cluster("ops/nightly", None));
        let without_cluster = ClaimRecord {
            cluster: None,
            ..record
        };
        assert!(without_cluster.is_from_backup_of_cluster("ops/nightly", None));
        assert!(!without_cluster.is_from_backup_of_cluster("ops/nightly", Some("uid-a")));
    }
}
