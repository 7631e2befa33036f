//! `VolumeBackup` (`vbk`): which PersistentVolumeClaims to back up into
//! which storage location. Its status carries the stage-pod plan, the
//! progress rolled up from its VolumeTransfers, the volumes per phase, one
//! result per volume and the replica that owns it.

use haulage_plan::StagePod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::condition::Condition;
use crate::progress::Progress;
pub use crate::transfer::ParentPolicy;
use crate::transfer::VolumeTransferPhase;

/// Back up the selected claims into a storage location, one snapshot each.
#[allow(
    clippy::duplicated_attributes,
    reason = "each kube printcolumn(...) repeats the same keys"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "haulage.dev",
    version = "v1alpha1",
    kind = "VolumeBackup",
    plural = "volumebackups",
    shortname = "vbk",
    category = "haulage",
    namespaced,
    status = "VolumeBackupStatus",
    derive = "PartialEq",
    doc = "A backup of the selected PersistentVolumeClaims into a BackupStorageLocation",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
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
        name = "Volumes",
        type_ = "integer",
        json_path = ".status.volumes.total"
    ),
    printcolumn(
        name = "ETA(s)",
        type_ = "integer",
        json_path = ".status.progress.etaSeconds",
        priority = 1
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
#[x_kube(validation = Rule::new(SPEC_IMMUTABLE_RULE).message("is immutable except deletionPolicy and ttl: delete the VolumeBackup and create a new one"))]
#[serde(rename_all = "camelCase")]
pub struct VolumeBackupSpec {
    /// Namespaces whose claims are backed up.
    #[schemars(
        length(min = 1, max = 1000),
        inner(
            length(min = 1, max = 63),
            regex(pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
        )
    )]
    pub namespaces: Vec<String>,
    /// Which claims of those namespaces; all of them when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// Only the claims of these names (in the namespaces, matching the
    /// selector); every name when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000), inner(length(min = 1, max = 253)))]
    pub claim_names: Vec<String>,
    /// Name of the BackupStorageLocation (in this VolumeBackup's namespace);
    /// the one marked `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub storage_location: Option<String>,
    /// Which snapshot each volume's backup is incremental to.
    #[serde(default)]
    pub parent_policy: ParentPolicy,
    /// Tags written into every snapshot, for finding them later:
    /// `key=value`, or a bare name (recorded with an empty value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(min = 1, max = 128)))]
    pub tags: Vec<String>,
    /// Fail when the storage location stays Unavailable this long; wait as
    /// long as it takes when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub fail_after_unavailable_seconds: Option<i64>,
    /// Run the backup agents as this non-root uid (and gid), with no
    /// capabilities: for namespaces whose Pod Security level is
    /// `restricted`, which refuses the default agent (root with
    /// `DAC_OVERRIDE`). It reads only what this uid may read; files it
    /// cannot read are listed as warnings and the volume completes with
    /// them (docs/controller.md, "Running as non-root").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub agent_user: Option<i64>,
    /// What deleting the VolumeBackup does to its snapshots: `Retain`
    /// (default) keeps them in the storage location; `Delete` forgets
    /// them (the snapshots whose claim record names this backup and this
    /// cluster) before the object goes. The data they alone referenced
    /// is reclaimed by the next prune. May be changed at any time.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// How long the VolumeBackup is kept after it finished (a duration
    /// such as `72h`, `30m` or `1h30m`); the controller then deletes it,
    /// which forgets its snapshots when `deletionPolicy` is `Delete`.
    /// Kept until deleted when absent. May be changed at any time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^(0|([0-9]+(h|m|s|ms))+)$')").message("must be a duration such as 72h, 30m or 1h30m"))]
    pub ttl: Option<String>,
    /// Measure instead of back up: the stage pod that would back up each
    /// claim reads it read-only and measures the read, the backup
    /// pipeline on samples of its files and the upload to the storage
    /// location, writes nothing that lasts (its objects under `bench/`
    /// are deleted, its sample repository is in the pod's scratch space)
    /// and reports the figures and the estimate of the first backup in
    /// `status.results[].benchmark` and, per storage class, in
    /// `status.benchmarks`. No snapshot is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub benchmark: Option<crate::benchmark::BenchmarkRequest>,
}

/// The immutability rule of a VolumeBackup's spec: every field but
/// `deletionPolicy` and `ttl` (which say what happens to the backup
/// afterwards, not what it reads) keeps its value, and an optional field
/// is neither added nor removed.
pub const SPEC_IMMUTABLE_RULE: &str = "self.namespaces == oldSelf.namespaces \
    && has(self.selector) == has(oldSelf.selector) && (!has(self.selector) || self.selector == oldSelf.selector) \
    && has(self.storageLocation) == has(oldSelf.storageLocation) && (!has(self.storageLocation) || self.storageLocation == oldSelf.storageLocation) \
    && has(self.parentPolicy) == has(oldSelf.parentPolicy) && (!has(self.parentPolicy) || self.parentPolicy == oldSelf.parentPolicy) \
    && has(self.tags) == has(oldSelf.tags) && (!has(self.tags) || self.tags == oldSelf.tags) \
    && has(self.failAfterUnavailableSeconds) == has(oldSelf.failAfterUnavailableSeconds) && (!has(self.failAfterUnavailableSeconds) || self.failAfterUnavailableSeconds == oldSelf.failAfterUnavailableSeconds) \
    && has(self.agentUser) == has(oldSelf.agentUser) && (!has(self.agentUser) || self.agentUser == oldSelf.agentUser) \
    && has(self.claimNames) == has(oldSelf.claimNames) && (!has(self.claimNames) || self.claimNames == oldSelf.claimNames) \
    && has(self.benchmark) == has(oldSelf.benchmark) && (!has(self.benchmark) || self.benchmark == oldSelf.benchmark)";

/// What deleting a VolumeBackup does to its snapshots.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DeletionPolicy {
    /// Keep them in the storage location.
    #[default]
    Retain,
    /// Forget them (a finalizer holds the object until that succeeded).
    Delete,
}

impl VolumeBackupSpec {
    /// How long after completion the VolumeBackup is deleted, `None` when
    /// it has no ttl, or what is wrong with the ttl.
    pub fn ttl_duration(
        &self,
    ) -> Result<Option<std::time::Duration>, crate::progress::DurationError> {
        self.ttl
            .as_deref()
            .map(crate::progress::parse_duration)
            .transpose()
    }
}

impl VolumeBackupSpec {
    /// The spec's tags as a snapshot records them: `key=value` split at the
    /// first `=`, a bare name with an empty value.
    pub fn snapshot_tags(&self) -> std::collections::BTreeMap<String, String> {
        self.tags
            .iter()
            .map(|tag| match tag.split_once('=') {
                Some((key, value)) => (key.to_string(), value.to_string()),
                None => (tag.clone(), String::new()),
            })
            .collect()
    }
}

/// What the controller observed and decided for a backup.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeBackupStatus {
    /// Where the backup is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VolumeBackupPhase>,
    /// The controller replica that owns this backup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerClaim>,
    /// Where each volume is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<BackupPlan>,
    /// The BackupStorageLocation the backup writes to, recorded when it is
    /// planned (`spec.storageLocation`, or the namespace's default at that
    /// time): the rest of the backup, and the forgetting of its snapshots
    /// when it is deleted with `deletionPolicy: Delete`, use this one, even
    /// when another location has become the default since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_location: Option<String>,
    /// Progress summed over the volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// How many volumes are in each phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<VolumeCounts>,
    /// One entry per selected volume, sorted by (namespace, pvc).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<VolumeResult>,
    /// A benchmark's figures per storage class of the measured claims.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub benchmarks: Vec<crate::benchmark::StorageClassBenchmark>,
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
    /// Conditions, keyed by type (`Claimed`, `StorageAvailable`, `Planned`,
    /// `Progressing`, `Complete`, `Failed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The life of a VolumeBackup. Completed, PartiallyFailed, Failed and
/// Canceled are final.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum VolumeBackupPhase {
    /// Created; no replica has claimed it yet.
    New,
    /// Claimed; its storage location is missing or Unavailable.
    WaitingForStorage,
    /// Resolving claims and computing the stage-pod plan.
    Planning,
    /// Transfers are queued or running.
    InProgress,
    /// Every volume has a snapshot.
    Completed,
    /// Some volumes have a snapshot, the others failed (each with a reason).
    PartiallyFailed,
    /// No volume has a snapshot, or the backup could not start.
    Failed,
    /// Deleted while running; agents are being stopped.
    Canceling,
    /// Deleted and every transfer stopped.
    Canceled,
}

impl VolumeBackupPhase {
    /// Whether nothing more happens in this phase.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::PartiallyFailed | Self::Failed | Self::Canceled
        )
    }
}

/// Which controller replica owns an object: set with a resourceVersion
/// precondition, so of two racing replicas exactly one wins.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OwnerClaim {
    /// The replica's identity (its pod name).
    #[schemars(length(min = 1, max = 253))]
    pub replica: String,
    /// When it claimed the object.
    pub claimed_at: Time,
    /// The replica that owned it before, when this one adopted it because
    /// that replica stopped renewing its lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted_from: Option<String>,
}

/// The stage-pod plan as the planner made it (`haulage plan -o json`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupPlan {
    /// One stage pod per (namespace, node) that has work.
    #[serde(default)]
    pub stage_pods: Vec<PlannedStagePod>,
    /// Volumes no stage pod can mount, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unplaceable: Vec<UnplaceableVolume>,
}

/// One stage pod of the plan: the planner's stage pod as it made it,
/// and the name the pod gets.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannedStagePod {
    /// The stage pod's name (deterministic, from its owner and node).
    #[serde(default)]
    pub pod_name: String,
    /// Namespace, node, claims and bytes, as planned.
    #[serde(flatten)]
    pub stage: StagePod,
}

/// A volume left out of the plan.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnplaceableVolume {
    /// Namespace of the claim.
    pub namespace: String,
    /// Claim name.
    pub pvc: String,
    /// Why no stage pod can mount it, as a sentence.
    #[schemars(length(max = 1024))]
    pub reason: String,
}

/// Volumes per phase of their VolumeTransfer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeCounts {
    /// Volumes selected.
    #[serde(default)]
    pub total: i32,
    /// Waiting: New, Queued or Admitted (and unplaceable ones not yet failed).
    #[serde(default)]
    pub pending: i32,
    /// InProgress or Finalizing.
    #[serde(default)]
    pub in_progress: i32,
    /// With a snapshot.
    #[serde(default)]
    pub completed: i32,
    /// Failed, each with a reason in `results`.
    #[serde(default)]
    pub failed: i32,
    /// Stopped by a cancel.
    #[serde(default)]
    pub canceled: i32,
}

impl VolumeCounts {
    /// Count the phases of a backup's volumes.
    pub fn from_phases(phases: impl IntoIterator<Item = VolumeTransferPhase>) -> Self {
        let mut counts = VolumeCounts::default();
        for phase in phases {
            counts.total += 1;
            match phase {
                VolumeTransferPhase::New
                | VolumeTransferPhase::Queued
                | VolumeTransferPhase::Admitted => counts.pending += 1,
                VolumeTransferPhase::InProgress | VolumeTransferPhase::Finalizing => {
                    counts.in_progress += 1
                }
                VolumeTransferPhase::Completed => counts.completed += 1,
                VolumeTransferPhase::Failed => counts.failed += 1,
                VolumeTransferPhase::Canceled => counts.canceled += 1,
            }
        }
        counts
    }
}

/// The outcome of one volume.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeResult {
    /// Namespace of the claim.
    pub namespace: String,
    /// Claim name.
    pub pvc: String,
    /// Phase of its VolumeTransfer.
    pub phase: VolumeTransferPhase,
    /// The snapshot, once Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// Why it failed, or its warnings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// A benchmark's figures, once Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub benchmark: Option<crate::benchmark::ClaimBenchmark>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_counts_group_transfer_phases() {
        use VolumeTransferPhase::*;
        let counts = VolumeCounts::from_phases([
            New, Queued, Admitted, InProgress, Finalizing, Completed, Completed, Failed, Canceled,
        ]);
        assert_eq!(
            counts,
            VolumeCounts {
                total: 9,
                pending: 3,
                in_progress: 2,
                completed: 2,
                failed: 1,
                canceled: 1,
            }
        );
    }

    #[test]
    fn final_phases_are_exactly_the_four_outcomes() {
        use VolumeBackupPhase::*;
        let finals: Vec<_> = [
            New,
            WaitingForStorage,
            Planning,
            InProgress,
            Completed,
            PartiallyFailed,
            Failed,
            Canceling,
            Canceled,
        ]
        .into_iter()
        .filter(|phase| phase.is_final())
        .collect();
        assert_eq!(finals, [Completed, PartiallyFailed, Failed, Canceled]);
    }

    #[test]
    fn a_minimal_spec_retains_its_snapshots_and_has_no_ttl() {
        let spec: VolumeBackupSpec = serde_yaml::from_str("namespaces: [shop]\n").expect("valid");
        assert_eq!(spec.deletion_policy, DeletionPolicy::Retain);
        assert_eq!(spec.ttl_duration(), Ok(None));
        let spec: VolumeBackupSpec =
            serde_yaml::from_str("namespaces: [shop]\ndeletionPolicy: Delete\nttl: 1h30m\n")
                .expect("valid");
        assert_eq!(spec.deletion_policy, DeletionPolicy::Delete);
        assert_eq!(
            spec.ttl_duration(),
            Ok(Some(std::time::Duration::from_secs(5400)))
        );
    }

    #[test]
    fn the_crd_checks_the_ttl_with_the_pattern_the_parser_reads() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_string(&VolumeBackup::crd()).expect("serialisable");
        assert!(crd.contains(crate::progress::DURATION_PATTERN), "{crd}");
    }

    #[test]
    fn a_minimal_spec_gets_the_latest_parent_policy() {
        let spec: VolumeBackupSpec = serde_yaml::from_str("namespaces: [shop]\n").expect("valid");
        assert_eq!(spec.parent_policy, ParentPolicy::Latest);
        assert_eq!(spec.storage_location, None);
    }
}
