//! `VolumeRestore` (`vrs`): on the destination cluster, which snapshots of
//! a storage location to restore into which claims, and how the claims are
//! made there (namespaces, storage classes, access modes, sizes, what to do
//! with a claim that already exists). Everything it needs comes from the
//! storage location: each snapshot carries its claim's record
//! (`repo::snapshot::ClaimRecord`).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::backup::{BackupPlan, OwnerClaim, VolumeCounts};
use crate::condition::Condition;
use crate::progress::Progress;
use crate::transfer::VolumeTransferPhase;

/// Restore snapshots of a storage location into claims of this cluster.
#[allow(
    clippy::duplicated_attributes,
    reason = "each kube printcolumn(...) repeats the same keys"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "haulage.dev",
    version = "v1alpha1",
    kind = "VolumeRestore",
    plural = "volumerestores",
    shortname = "vrs",
    category = "haulage",
    namespaced,
    status = "VolumeRestoreStatus",
    derive = "PartialEq",
    doc = "Restore snapshots of a BackupStorageLocation into PersistentVolumeClaims of this cluster",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Volumes",
        type_ = "integer",
        json_path = ".status.volumes.total"
    ),
    printcolumn(
        name = "Completed",
        type_ = "integer",
        json_path = ".status.volumes.completed"
    ),
    printcolumn(
        name = "Progress",
        type_ = "integer",
        description = "percent of the bytes done",
        json_path = ".status.progress.percent"
    ),
    printcolumn(
        name = "Location",
        type_ = "string",
        json_path = ".spec.storageLocation",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("is immutable: delete the VolumeRestore and create a new one (a cutover pass is a new VolumeRestore with existingClaim: Sync)"))]
#[serde(rename_all = "camelCase")]
pub struct VolumeRestoreSpec {
    /// Name of the BackupStorageLocation (in this VolumeRestore's
    /// namespace); the one marked `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub storage_location: Option<String>,
    /// Which snapshots.
    pub source: RestoreSource,
    /// Source namespace → destination namespace (`shop: shop-b`); a
    /// namespace not listed keeps its name. Two sources may not map to one
    /// destination claim.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub namespace_map: BTreeMap<String, String>,
    /// Create destination namespaces that do not exist (refused otherwise).
    #[serde(default)]
    pub create_namespaces: bool,
    /// Source storage class → destination storage class, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub storage_class_map: BTreeMap<String, String>,
    /// Source provisioner → destination storage class
    /// (`rook-ceph.rbd.csi.ceph.com: gp3`), for claims whose class is not
    /// in `storageClassMap`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub provisioner_map: BTreeMap<String, String>,
    /// Keep a ReadOnlyMany claim ReadWriteOnce after it is written, instead
    /// of handing it back as ReadOnlyMany.
    #[serde(default)]
    pub keep_writable: bool,
    /// How big the destination claims are.
    #[serde(default)]
    pub size: SizePolicy,
    /// What to do with a destination claim that already exists.
    #[serde(default)]
    pub existing_claim: ExistingClaimPolicy,
    /// Fail when the storage location stays Unavailable this long; wait as
    /// long as it takes when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub fail_after_unavailable_seconds: Option<i64>,
}

/// Which snapshots a restore selects. One of `backup`, `namespaces` or
/// `snapshots`; with `backup` or `namespaces`, the latest snapshot of each
/// claim.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[x_kube(validation = Rule::new("has(self.backup) || size(self.namespaces) > 0 || size(self.snapshots) > 0").message("name a backup, namespaces or snapshots"))]
#[serde(rename_all = "camelCase")]
pub struct RestoreSource {
    /// The source VolumeBackup's name (as recorded in the snapshots:
    /// `namespace/name`, or the name alone when unique).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 317))]
    pub backup: Option<String>,
    /// Source namespaces of the claims.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000), inner(length(min = 1, max = 63)))]
    pub namespaces: Vec<String>,
    /// Which claims of those namespaces, by the labels they had; all when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// Explicit snapshot ids (or unique prefixes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10000), inner(length(min = 8, max = 64)))]
    pub snapshots: Vec<String>,
}

/// How big a destination claim is.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SizePolicy {
    /// Requested (the source's request) or UsedPlusHeadroom.
    #[serde(default)]
    pub policy: SizeChoice,
    /// With UsedPlusHeadroom: percent added to the bytes in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub headroom_percent: Option<u32>,
}

/// Which size a destination claim asks for. Never smaller than the data.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SizeChoice {
    /// The source claim's requested size.
    #[default]
    Requested,
    /// The bytes in use (the snapshot's) plus the headroom.
    UsedPlusHeadroom,
}

/// What to do with a destination claim that already exists.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ExistingClaimPolicy {
    /// Refuse the volume, naming the claim.
    #[default]
    Fail,
    /// Write only the differences into it, removing what the snapshot does
    /// not have (a cutover pass after an earlier restore).
    Sync,
    /// Leave it alone.
    Skip,
}

/// What the controller observed and decided for a restore.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRestoreStatus {
    /// Where the restore is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VolumeRestorePhase>,
    /// The controller replica that owns this restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerClaim>,
    /// The snapshots selected and the claims they go to, decided once from
    /// the storage location's snapshots.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub selection: Vec<RestoreVolume>,
    /// The BackupStorageLocation the selection was read from, recorded with
    /// it (`spec.storageLocation`, or the namespace's default at that time):
    /// the rest of the restore reads from this one, even when another
    /// location has become the default since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_location: Option<String>,
    /// Where each destination claim is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<BackupPlan>,
    /// Progress summed over the volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// How many volumes are in each phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<VolumeCounts>,
    /// One entry per selected volume, sorted by destination (namespace,
    /// pvc).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<RestoreResult>,
    /// When the controller started working on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When it reached a final phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Why it is in this phase, when that needs words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// Conditions, keyed by type (`Claimed`, `StorageAvailable`,
    /// `Selected`, `Planned`, `Progressing`, `Complete`, `Failed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The life of a VolumeRestore. Completed, PartiallyFailed, Failed and
/// Canceled are final.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum VolumeRestorePhase {
    /// Created; no replica has claimed it yet.
    New,
    /// Claimed; its storage location is missing or Unavailable.
    WaitingForStorage,
    /// Reading the location's snapshots and choosing the claims.
    Selecting,
    /// Creating the claims and computing the stage-pod plan.
    Planning,
    /// Transfers are queued or running.
    InProgress,
    /// Every volume is restored and verified.
    Completed,
    /// Some volumes are restored, the others failed (each with a reason).
    PartiallyFailed,
    /// No volume is restored, or the restore could not start.
    Failed,
    /// Deleted and every transfer stopped.
    Canceled,
}

impl VolumeRestorePhase {
    /// Whether nothing more happens in this phase.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::PartiallyFailed | Self::Failed | Self::Canceled
        )
    }
}

/// One selected snapshot and the claim it is restored into.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestoreVolume {
    /// The snapshot.
    pub snapshot_id: String,
    /// The source claim, `namespace/name`.
    pub source: String,
    /// Destination namespace.
    pub namespace: String,
    /// Destination claim name.
    pub pvc: String,
    /// Destination storage class (after the maps; `None`: the cluster's
    /// default class).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
    /// Access modes the claim is created with (a ReadOnlyMany claim is
    /// written as ReadWriteOnce first).
    pub access_modes: Vec<String>,
    /// Access modes it is handed back with once written, when they differ.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub final_access_modes: Vec<String>,
    /// `Filesystem` or `Block`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mode: Option<String>,
    /// Requested size of the destination claim, bytes.
    pub request_bytes: u64,
    /// Bytes of file content in the snapshot.
    pub data_bytes: u64,
    /// What happens to the claim: created, synced into, or skipped.
    pub action: ClaimAction,
    /// The source claim's labels and annotations (cluster-bound ones left
    /// out), given to the new claim.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// See [`RestoreVolume::labels`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// What a restore does with one destination claim.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ClaimAction {
    /// It is created by the restore.
    Create,
    /// It exists; only the differences are written.
    Sync,
    /// It exists and is left alone (`existingClaim: Skip`).
    Skip,
}

/// How one volume of a restore went.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestoreResult {
    /// Destination namespace.
    pub namespace: String,
    /// Destination claim.
    pub pvc: String,
    /// The snapshot restored.
    pub snapshot_id: String,
    /// Phase of its VolumeTransfer (Completed once verified).
    pub phase: VolumeTransferPhase,
    /// Bytes written into the claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_written: Option<i64>,
    /// The snapshot's root tree the written claim was verified against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_tree: Option<String>,
    /// Why it failed or was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
}
