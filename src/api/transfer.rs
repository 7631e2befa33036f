//! `VolumeTransfer` (`vxf`): the move of one PersistentVolumeClaim's data,
//! up into a repository (backup) or down from it (restore). It lives in the
//! claim's namespace. The controller writes the spec; the mover agent in
//! the stage pod claims it and writes the status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::condition::Condition;
use crate::progress::Progress;

const MIB: u64 = 1024 * 1024;

/// What a mover agent holds besides its engines' buffers: the async
/// runtime and its blocking threads, the S3 client, the binary's pages,
/// the repository's blob index (one copy, which the agent's engines
/// share: 52 bytes a blob, 4.5 MiB for the 90,000 blobs of five 1 GiB
/// sample claims; 60–100 bytes and 7 MiB when this baseline was
/// measured, and it was not lowered since), each thread's zstd context
/// and the allocator's slack (small with the agent's allocator settings,
/// `haulage::allocator`; about 20 MiB more without them). A restore of one small file peaks at 25 MiB. Four
/// engines at once restoring 1 GiB claims peak at 111–113 MiB (135 MiB
/// while each loaded its own copy of the index; docs/benchmarks.md,
/// "Several volumes in one stage pod"). A repository of millions of blobs
/// needs stage pods with more memory (a StoragePolicy's
/// `stagePodResources`).
pub const AGENT_BASELINE_BYTES: u64 = 36 * MIB;
/// The memory of one volume's engine at most, what one engine always had
/// (a backup's 16 MiB packs and chunks in flight, a restore's whole-pack
/// reads, its verification's trees). More buys an engine nothing
/// measurable; an agent with the default 128Mi to itself gives its one
/// engine what the baseline leaves, 88 MiB.
pub const DEFAULT_VOLUME_SHARE_BYTES: u64 = 94 * MIB;
/// The least memory one volume's engine is given: a backup's read
/// buffer, a compression output, a largest chunk in flight and two data
/// packs of a largest chunk; a restore's pack reads of a largest blob, one
/// scatter worker and batches of 512 files. Below this the agent moves
/// fewer volumes at once rather than starve each.
pub const SMALLEST_VOLUME_SHARE_BYTES: u64 = 23 * MIB;

/// Volumes a stage pod's agent moves at once, given the memory it may use
/// (its `--memory-budget`: the stage pod's memory request): as many as
/// leave each at least [`SMALLEST_VOLUME_SHARE_BYTES`] besides
/// [`AGENT_BASELINE_BYTES`], and at least one. Four in the default 128Mi.
/// The controller's admission grants a stage pod no more running
/// transfers than this (from the pod's request, with the same function),
/// so a cap slot, and its share of the bandwidth, never goes to a transfer
/// its agent cannot begin now.
pub fn volumes_at_once(memory_bytes: u64) -> u32 {
    let room = memory_bytes.saturating_sub(AGENT_BASELINE_BYTES);
    u32::try_from(room / SMALLEST_VOLUME_SHARE_BYTES)
        .unwrap_or(u32::MAX)
        .max(1)
}

/// The memory each of `volumes` engines moving at once gets from an agent
/// that may use `memory_bytes`: an equal part of what the baseline leaves,
/// at most [`DEFAULT_VOLUME_SHARE_BYTES`] (more buys an engine nothing
/// measurable) and at least [`SMALLEST_VOLUME_SHARE_BYTES`].
pub fn volume_share_bytes(memory_bytes: u64, volumes: u32) -> u64 {
    let room = memory_bytes.saturating_sub(AGENT_BASELINE_BYTES);
    (room / u64::from(volumes.max(1)))
        .clamp(SMALLEST_VOLUME_SHARE_BYTES, DEFAULT_VOLUME_SHARE_BYTES)
}

/// One claim's data on its way to or from a storage location.
#[allow(
    clippy::duplicated_attributes,
    reason = "each kube printcolumn(...) repeats the same keys"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "haulage.dev",
    version = "v1alpha1",
    kind = "VolumeTransfer",
    plural = "volumetransfers",
    shortname = "vxf",
    category = "haulage",
    namespaced,
    status = "VolumeTransferStatus",
    derive = "PartialEq",
    doc = "The transfer of one PersistentVolumeClaim's data to or from a BackupStorageLocation",
    selectable = ".spec.stagePod",
    selectable = ".spec.pvc",
    selectable = ".spec.direction",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "PVC", type_ = "string", json_path = ".spec.pvc"),
    printcolumn(name = "Direction", type_ = "string", json_path = ".spec.direction"),
    printcolumn(
        name = "Progress",
        type_ = "integer",
        description = "percent of the bytes done",
        json_path = ".status.progress.percent"
    ),
    printcolumn(
        name = "Bytes Done",
        type_ = "integer",
        json_path = ".status.progress.bytesDone"
    ),
    printcolumn(
        name = "Total Bytes",
        type_ = "integer",
        json_path = ".status.progress.totalBytes"
    ),
    printcolumn(
        name = "Stage Pod",
        type_ = "string",
        json_path = ".spec.stagePod",
        priority = 1
    ),
    printcolumn(
        name = "Snapshot",
        type_ = "string",
        json_path = ".status.snapshotId",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self.direction != 'Download' || (has(self.snapshot) && size(self.snapshot) > 0)").message("snapshot is required when direction is Download").field_path(".snapshot"))]
#[serde(rename_all = "camelCase")]
pub struct VolumeTransferSpec {
    /// Upload (backup) or Download (restore).
    #[x_kube(validation = Rule::new("self == oldSelf").message("is immutable"))]
    pub direction: TransferDirection,
    /// The claim, in this VolumeTransfer's namespace.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("is immutable"))]
    pub pvc: String,
    /// The VolumeBackup (Upload) or VolumeRestore (Download) this belongs to.
    #[x_kube(validation = Rule::new("self == oldSelf").message("is immutable"))]
    pub backup_ref: OwnerReference,
    /// The storage location the repository is in.
    pub storage_location: StorageLocationReference,
    /// Name of the stage pod (in this namespace) whose agent does the work.
    #[schemars(length(min = 1, max = 253))]
    pub stage_pod: String,
    /// Snapshot to reuse unchanged files from (Upload); a full read when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub parent_snapshot: Option<String>,
    /// Snapshot to restore (Download; required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("is immutable"))]
    pub snapshot: Option<String>,
    /// Download into a claim that holds an earlier restore: the snapshot
    /// that restore wrote completely. Files both snapshots hold unchanged,
    /// still as that restore left them on disk, are not read (the
    /// cutover's quick check); every file is compared when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub since_snapshot: Option<String>,
    /// Bandwidth this transfer may use now, bytes per second; the
    /// controller changes it while the transfer runs and the agent follows.
    /// Unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub granted_bytes_per_second: Option<i64>,
    /// Upload: the claim as the controller saw it, recorded in the snapshot
    /// so another cluster can recreate it from the storage location alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<haulage_repo::snapshot::ClaimRecord>,
    /// Upload: `Full` reads every file again instead of reusing unchanged
    /// files of the claim's latest snapshot (the VolumeBackup's
    /// `parentPolicy`).
    #[serde(default)]
    pub parent_policy: ParentPolicy,
    /// Upload: tags written into the snapshot (the VolumeBackup's `tags`,
    /// `key=value` or a bare name).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub tags: std::collections::BTreeMap<String, String>,
    /// Upload: measure instead of back up (the VolumeBackup's
    /// `benchmark`); the figures go into `status.benchmark`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("is immutable"))]
    pub benchmark: Option<crate::benchmark::BenchmarkRequest>,
}

/// Which way the data goes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TransferDirection {
    /// From the claim into the repository (backup).
    Upload,
    /// From the repository into the claim (restore).
    Download,
}

/// The object a transfer belongs to, which may be in another namespace
/// (so it cannot be an owner reference; the controller cleans up by label).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReference {
    /// Its namespace.
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
    /// Its name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Its UID, so a new object with the same name is not mistaken for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// A BackupStorageLocation, which may be in another namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageLocationReference {
    /// Its namespace.
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
    /// Its name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// What the agent (and, for admission, the controller) reports.
///
/// A final phase (Completed, Failed, Canceled) is final on the server: the
/// API server refuses any status write that leaves it (422), so no writer
/// with a stale view (an agent's progress report, an admission pass) can
/// bring a finished transfer back to life.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.phase) || !(oldSelf.phase in ['Completed', 'Failed', 'Canceled']) || (has(self.phase) && self.phase == oldSelf.phase)").message("a Completed, Failed or Canceled transfer keeps its phase: create a new backup to move the volume again"))]
pub struct VolumeTransferStatus {
    /// Where the transfer is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VolumeTransferPhase>,
    /// Place in the admission queue while Queued (1 = next).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub queue_position: Option<i32>,
    /// Stage pods started for it so far; the controller retries a failed
    /// stage pod with backoff up to a bound, then fails the transfer with
    /// the pod's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub attempts: Option<i32>,
    /// How far it has come; never goes backwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The agent working on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentClaim>,
    /// The snapshot written (Upload) once Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// Bytes read from the claim (Upload) or the repository (Download).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub bytes_read: Option<i64>,
    /// Bytes of data the repository did not have yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub bytes_new: Option<i64>,
    /// Bytes stored for them, after compression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub bytes_stored: Option<i64>,
    /// Files that could not be read or written (listed in the agent's log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub warnings: Option<i64>,
    /// Why it failed, or the first warning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// When the agent started moving data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When it reached a final phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Download: bytes written into the claim (a resumed or synced restore
    /// writes only what differed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub bytes_written: Option<i64>,
    /// Download: regular files that already matched the snapshot and were
    /// left untouched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub files_unchanged: Option<i64>,
    /// Download: entries removed because the snapshot does not have them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub entries_removed: Option<i64>,
    /// Download: the snapshot's root tree the written claim was verified
    /// against, entry by entry (condition `Verified`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub verified_tree: Option<String>,
    /// Upload with `spec.benchmark`: what the benchmark measured, once
    /// Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub benchmark: Option<crate::benchmark::ClaimBenchmark>,
    /// Conditions, keyed by type (`Admitted`, `StorageAvailable`,
    /// `Progressing`, `Verified`, `Complete`, `Failed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The agent that claimed a transfer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentClaim {
    /// The agent's identity: its stage pod's name, from the downward API.
    /// A restarted container, or a stage pod recreated under the same
    /// name, is the same agent and claims its transfers again (resuming
    /// from the packs already stored).
    #[schemars(length(min = 1, max = 512))]
    pub identity: String,
    /// When it claimed the transfer.
    pub claimed_at: Time,
    /// When it last reported; a claim whose heartbeat is old belongs to a
    /// dead agent and may be taken over.
    pub heartbeat_time: Time,
    /// When it last moved the volume past every earlier report
    /// (`progress.bytesDone` rose), across restarts. The controller tells
    /// an agent whose crashes only slow it down (each run moves the volume
    /// further) from one that crashes in a loop by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_time: Option<Time>,
}

/// The life of a VolumeTransfer:
/// New → Queued → Admitted → InProgress → Finalizing → Completed | Failed |
/// Canceled. Failed and Canceled can be reached from every phase that is
/// not final.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum VolumeTransferPhase {
    /// Created by the controller.
    New,
    /// Waiting for room under the caps.
    Queued,
    /// Allowed to start; waiting for its agent.
    Admitted,
    /// The agent is moving data.
    InProgress,
    /// Data moved; the agent writes the index and snapshot.
    Finalizing,
    /// Done; `snapshotId` is set (Upload).
    Completed,
    /// Given up; `message` says why.
    Failed,
    /// Stopped because its backup or restore was deleted.
    Canceled,
}

impl VolumeTransfer {
    /// The transfer's phase: `New` while its status is empty.
    pub fn phase(&self) -> VolumeTransferPhase {
        self.status
            .as_ref()
            .and_then(|status| status.phase)
            .unwrap_or(VolumeTransferPhase::New)
    }
}

impl VolumeTransferPhase {
    /// Whether nothing more happens in this phase.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Canceled)
    }

    /// Whether a status writer may move from `self` to `next`: forward
    /// along the chain (skipping is allowed, so an agent that restarts
    /// mid-way is not stuck), never out of a final phase, never back.
    pub fn can_move_to(self, next: VolumeTransferPhase) -> bool {
        if self.is_final() {
            return self == next;
        }
        match next {
            Self::Failed | Self::Canceled => true,
            _ => next >= self,
        }
    }
}

/// Which snapshot a volume's backup reuses unchanged files from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ParentPolicy {
    /// The latest snapshot of the same claim in the repository.
    #[default]
    Latest,
    /// None: read every file again (still deduplicated against the
    /// repository, so unchanged data is not uploaded again).
    Full,
}

#[cfg(test)]
mod tests {
    use super::*;
    use VolumeTransferPhase::*;

    const ALL: [VolumeTransferPhase; 8] = [
        New, Queued, Admitted, InProgress, Finalizing, Completed, Failed, Canceled,
    ];

    #[test]
    fn a_stage_pod_moves_as_many_volumes_as_its_memory_holds() {
        assert_eq!(volumes_at_once(128 * MIB), 4, "the default stage pod");
        assert_eq!(volumes_at_once(0), 1, "always one");
        assert_eq!(
            volumes_at_once(AGENT_BASELINE_BYTES + SMALLEST_VOLUME_SHARE_BYTES - 1),
            1
        );
        assert_eq!(
            volumes_at_once(AGENT_BASELINE_BYTES + 2 * SMALLEST_VOLUME_SHARE_BYTES),
            2
        );
        assert_eq!(volumes_at_once(1 << 30), 42);
        // A budget below one smallest engine still moves one volume, in
        // the smallest share; from there on, the volumes fit.
        for memory in [
            AGENT_BASELINE_BYTES + SMALLEST_VOLUME_SHARE_BYTES,
            128 * MIB,
            256 * MIB,
            1 << 30,
        ] {
            let volumes = volumes_at_once(memory);
            let share = volume_share_bytes(memory, volumes);
            assert!(
                AGENT_BASELINE_BYTES + u64::from(volumes) * share <= memory,
                "{volumes} volumes of {share} bytes in {memory}"
            );
        }
        assert_eq!(volume_share_bytes(128 * MIB, 1), 92 * MIB);
        assert_eq!(volume_share_bytes(128 * MIB, 4), 23 * MIB);
        assert_eq!(volume_share_bytes(128 * MIB, 3), 92 * MIB / 3);
        assert_eq!(volume_share_bytes(256 * MIB, 1), DEFAULT_VOLUME_SHARE_BYTES);
        assert_eq!(
            volume_share_bytes(1 << 30, 1),
            DEFAULT_VOLUME_SHARE_BYTES,
            "no more than a whole engine"
        );
        assert_eq!(volume_share_bytes(0, 3), SMALLEST_VOLUME_SHARE_BYTES);
    }

    #[test]
    fn phases_only_move_forward() {
        assert!(New.can_move_to(Queued));
        assert!(Queued.can_move_to(InProgress));
        assert!(InProgress.can_move_to(InProgress));
        assert!(Finalizing.can_move_to(Completed));
        assert!(!InProgress.can_move_to(Queued));
        assert!(!Finalizing.can_move_to(New));
    }

    #[test]
    fn final_phases_are_never_left() {
        for from in [Completed, Failed, Canceled] {
            for to in ALL {
                assert_eq!(from.can_move_to(to), from == to, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn every_open_phase_can_fail_or_be_canceled() {
        for from in ALL.into_iter().filter(|phase| !phase.is_final()) {
            assert!(from.can_move_to(Failed), "{from:?}");
            assert!(from.can_move_to(Canceled), "{from:?}");
        }
    }

    #[test]
    fn a_download_spec_round_trips_with_camel_case_names() {
        let yaml = "direction: Download\npvc: data\nbackupRef: {namespace: ops, name: nightly}\n\
                    storageLocation: {namespace: ops, name: s3}\nstagePod: stage-a\nsnapshot: abc\n";
        let spec: VolumeTransferSpec = serde_yaml::from_str(yaml).expect("valid spec");
        assert_eq!(spec.direction, TransferDirection::Download);
        let json = serde_json::to_value(&spec).expect("serialisable");
        assert_eq!(json["backupRef"]["name"], "nightly");
        assert_eq!(json["stagePod"], "stage-a");
    }
}
