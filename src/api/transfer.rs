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
/// the repository's blob index up to [`INDEX_MEMORY_IN_BASELINE_BYTES`]
/// (one copy, which the agent's engines share; a larger one is counted on
/// its own, [`AgentMemory`]), each thread's zstd context and the
/// allocator's slack (small with the agent's allocator settings,
/// `haulage::allocator`; about 20 MiB more without them). A restore of one
/// small file peaks at 25 MiB. Four engines at once restoring 1 GiB claims
/// peak at 111–113 MiB (135 MiB while each loaded its own copy of the
/// index; docs/benchmarks.md, "Several volumes in one stage pod").
pub const AGENT_BASELINE_BYTES: u64 = 36 * MIB;
/// The blob index [`AGENT_BASELINE_BYTES`] holds: 7 MiB when the baseline
/// was measured (60–100 bytes a blob then; 52 since, 4.5 MiB for the
/// 90,000 blobs of five 1 GiB sample claims). An index above this takes
/// its excess from the volumes' memory.
pub const INDEX_MEMORY_IN_BASELINE_BYTES: u64 = 7 * MIB;
/// The fewest bytes an index file holds a blob in: its 32-byte id, which
/// does not compress, and a byte for its kind, offset and lengths, which
/// do (46 bytes before compression; 33.5 a blob for 20,000 files of 4 KiB
/// each, their lengths all alike; 42.3 over the 27 files of a million
/// small files of 256–4,096 bytes, docs/benchmarks.md, "The blob index's
/// memory").
pub const INDEX_FILE_BYTES_PER_BLOB: u64 = 33;
/// The most bytes the loaded index holds a blob in (`repo::blob_table`:
/// 52.8 at a million blobs with its prefix table).
pub const INDEX_MEMORY_BYTES_PER_BLOB: u64 = 53;
/// The memory of one volume's engine at most, what one engine always had
/// (a backup's 16 MiB packs and chunks in flight, or 12 MiB of chunks and
/// two uploads at once into S3; a restore's whole-pack
/// reads, its verification's trees). More buys an engine nothing
/// measurable; an agent with the default 128Mi to itself gives its one
/// engine what the baseline leaves, 92 MiB.
pub const DEFAULT_VOLUME_SHARE_BYTES: u64 = 94 * MIB;
/// The least memory one volume's engine is given: a backup's read
/// buffer, a compression output, a largest chunk in flight and two data
/// packs of a largest chunk; a restore's pack reads of a largest blob, one
/// scatter worker and batches of 512 files. Below this the agent moves
/// fewer volumes at once rather than starve each.
pub const SMALLEST_VOLUME_SHARE_BYTES: u64 = 23 * MIB;

/// The memory a loaded index takes at most for a repository whose index
/// files hold `index_file_bytes` (as many blobs as those bytes can hold,
/// [`INDEX_FILE_BYTES_PER_BLOB`] each, at [`INDEX_MEMORY_BYTES_PER_BLOB`]).
/// An estimate from above: a million small files' blobs, 42.5 MB of index
/// files, are counted as 68 MB where their index took 52.8.
pub fn index_memory_bytes(index_file_bytes: u64) -> u64 {
    (index_file_bytes / INDEX_FILE_BYTES_PER_BLOB).saturating_mul(INDEX_MEMORY_BYTES_PER_BLOB)
}

/// The memory a mover agent plans its volumes in: its budget (its
/// `--memory-budget`, the stage pod's memory request) and the index of
/// the repository it moves them to or from, which its engines share and
/// which grows with the repository rather than with the claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentMemory {
    /// What the agent may use.
    pub budget_bytes: u64,
    /// The bytes of the repository's index files
    /// (`BackupStorageLocationStatus::index_bytes` in a stage pod).
    pub index_file_bytes: u64,
}

impl AgentMemory {
    /// A budget with an index no larger than the baseline's.
    pub fn of_budget(budget_bytes: u64) -> Self {
        AgentMemory {
            budget_bytes,
            index_file_bytes: 0,
        }
    }

    /// What the baseline and the index leave to the engines.
    fn room_bytes(self) -> u64 {
        self.budget_bytes
            .saturating_sub(AGENT_BASELINE_BYTES)
            .saturating_sub(index_excess_bytes(self.index_file_bytes))
    }

    /// Volumes the agent moves at once: as many as leave each at least
    /// [`SMALLEST_VOLUME_SHARE_BYTES`] besides [`AGENT_BASELINE_BYTES`]
    /// and the index's excess, and at least one. Four in the default
    /// 128Mi with a small index; two with half a million blobs, one with
    /// a million (counted as 68 MB where it takes 53: an estimate from
    /// above, [`index_memory_bytes`]). The
    /// controller's admission grants a stage pod no more running transfers
    /// than this (from the pod's request and the index bytes it gives the
    /// agent, with the same function), so a cap slot, and its share of the
    /// bandwidth, never goes to a transfer its agent cannot begin now.
    pub fn volumes_at_once(self) -> u32 {
        u32::try_from(self.room_bytes() / SMALLEST_VOLUME_SHARE_BYTES)
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// The memory each of `volumes` engines moving at once gets: an equal
    /// part of what the baseline and the index leave, at most
    /// [`DEFAULT_VOLUME_SHARE_BYTES`] (more buys an engine nothing
    /// measurable) and at least [`SMALLEST_VOLUME_SHARE_BYTES`].
    pub fn volume_share_bytes(self, volumes: u32) -> u64 {
        (self.room_bytes() / u64::from(volumes.max(1)))
            .clamp(SMALLEST_VOLUME_SHARE_BYTES, DEFAULT_VOLUME_SHARE_BYTES)
    }

    /// The least budget in which one volume fits beside the baseline and
    /// an index of `index_file_bytes` of index files: a stage pod's memory
    /// request is raised to it.
    pub fn least_budget_bytes(index_file_bytes: u64) -> u64 {
        AGENT_BASELINE_BYTES
            .saturating_add(index_excess_bytes(index_file_bytes))
            .saturating_add(SMALLEST_VOLUME_SHARE_BYTES)
    }
}

/// The memory of an index of `index_file_bytes` of index files beyond
/// what [`AGENT_BASELINE_BYTES`] holds of it.
fn index_excess_bytes(index_file_bytes: u64) -> u64 {
    index_memory_bytes(index_file_bytes).saturating_sub(INDEX_MEMORY_IN_BASELINE_BYTES)
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
        let budget = |bytes| AgentMemory::of_budget(bytes);
        assert_eq!(
            budget(128 * MIB).volumes_at_once(),
            4,
            "the default stage pod"
        );
        assert_eq!(budget(0).volumes_at_once(), 1, "always one");
        assert_eq!(
            budget(AGENT_BASELINE_BYTES + SMALLEST_VOLUME_SHARE_BYTES - 1).volumes_at_once(),
            1
        );
        assert_eq!(
            budget(AGENT_BASELINE_BYTES + 2 * SMALLEST_VOLUME_SHARE_BYTES).volumes_at_once(),
            2
        );
        assert_eq!(budget(1 << 30).volumes_at_once(), 42);
        assert_eq!(budget(128 * MIB).volume_share_bytes(1), 92 * MIB);
        assert_eq!(budget(128 * MIB).volume_share_bytes(4), 23 * MIB);
        assert_eq!(budget(128 * MIB).volume_share_bytes(3), 92 * MIB / 3);
        assert_eq!(
            budget(256 * MIB).volume_share_bytes(1),
            DEFAULT_VOLUME_SHARE_BYTES
        );
        assert_eq!(
            budget(1 << 30).volume_share_bytes(1),
            DEFAULT_VOLUME_SHARE_BYTES,
            "no more than a whole engine"
        );
        assert_eq!(budget(0).volume_share_bytes(3), SMALLEST_VOLUME_SHARE_BYTES);
    }

    #[test]
    fn an_index_beyond_the_baseline_takes_its_memory_from_the_volumes() {
        // A million blobs: 42.5 MB of index files (measured), counted as
        // 68 MB in memory (52.8 MB measured).
        let million = 42_500_000;
        let estimate = index_memory_bytes(million);
        assert!((52_800_000..70_000_000).contains(&estimate), "{estimate}");
        let with_index = |budget_bytes| AgentMemory {
            budget_bytes,
            index_file_bytes: million,
        };
        assert_eq!(with_index(128 * MIB).volumes_at_once(), 1);
        assert_eq!(with_index(192 * MIB).volumes_at_once(), 4);
        let half = AgentMemory {
            budget_bytes: 128 * MIB,
            index_file_bytes: million / 2,
        };
        assert_eq!(half.volumes_at_once(), 2);
        // An index within the baseline changes nothing.
        let small = AgentMemory {
            budget_bytes: 128 * MIB,
            index_file_bytes: 4 * MIB,
        };
        assert_eq!(small.volumes_at_once(), 4);
        assert_eq!(small.volume_share_bytes(4), 23 * MIB);
        assert_eq!(
            AgentMemory::least_budget_bytes(small.index_file_bytes),
            59 * MIB
        );
        // Four million blobs: one volume does not fit in 128Mi; the least
        // budget holds it.
        let huge = with_index(128 * MIB);
        let huge = AgentMemory {
            index_file_bytes: 4 * million,
            ..huge
        };
        assert_eq!(huge.volumes_at_once(), 1);
        assert!(AgentMemory::least_budget_bytes(huge.index_file_bytes) > 128 * MIB);
        // Whatever the budget and the index, the volumes at once, each in
        // its share, fit beside the baseline and the index's excess once
        // the budget is at least the least one.
        for budget_bytes in [0, 64 * MIB, 128 * MIB, 256 * MIB, 1 << 30] {
            for index_file_bytes in [0, MIB, 10 * MIB, million, 4 * million] {
                let memory = AgentMemory {
                    budget_bytes: budget_bytes
                        .max(AgentMemory::least_budget_bytes(index_file_bytes)),
                    index_file_bytes,
                };
                let volumes = memory.volumes_at_once();
                let share = memory.volume_share_bytes(volumes);
                let index = index_memory_bytes(index_file_bytes)
                    .saturating_sub(INDEX_MEMORY_IN_BASELINE_BYTES);
                assert!(
                    AGENT_BASELINE_BYTES + index + u64::from(volumes) * share
                        <= memory.budget_bytes,
                    "{volumes} volumes of {share} bytes in {memory:?}"
                );
            }
        }
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
