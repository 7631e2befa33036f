//! Status conditions as the Kubernetes API conventions define them, the
//! condition types and reasons haulage writes (constants, so a typo is a
//! compile error), and the pure [`set_condition`] that keeps
//! `lastTransitionTime` unless the status flipped.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Longest `message` haulage writes into any status, in bytes: status is
/// read by every watcher and stored in etcd, so free text stays small.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// One observation about an object, as in `metav1.Condition`.
///
/// `type` is unique within a status's list (the list is a map keyed by
/// `type`, so server-side apply merges conditions one by one).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// What the condition is about, in CamelCase (see [`condition_type`]).
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    /// Whether it holds.
    pub status: ConditionStatus,
    /// Why, as one CamelCase word (see [`reason`]).
    #[schemars(length(min = 1, max = 1024))]
    pub reason: String,
    /// Details for a person, at most [`MAX_MESSAGE_BYTES`].
    #[serde(default)]
    #[schemars(length(max = 1024))]
    pub message: String,
    /// When `status` last changed.
    pub last_transition_time: Time,
    /// The `metadata.generation` this condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
}

/// Whether a condition holds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ConditionStatus {
    /// It holds.
    True,
    /// It does not hold.
    False,
    /// It could not be determined.
    Unknown,
}

impl Condition {
    /// A condition with `message` cut to [`MAX_MESSAGE_BYTES`], stamped
    /// `now` (which [`set_condition`] replaces by the old time when the
    /// status did not change).
    pub fn new(
        type_: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
        observed_generation: Option<i64>,
        now: Time,
    ) -> Self {
        Condition {
            type_: type_.to_string(),
            status,
            reason: reason.to_string(),
            message: bounded_message(message),
            last_transition_time: now,
            observed_generation,
        }
    }
}

/// `message` cut to at most [`MAX_MESSAGE_BYTES`] bytes at a character
/// boundary, with `…` marking the cut.
pub fn bounded_message(message: &str) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message.to_string();
    }
    const ELLIPSIS: &str = "…";
    let mut end = MAX_MESSAGE_BYTES - ELLIPSIS.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ELLIPSIS}", &message[..end])
}

/// Put `new` into `conditions`, replacing the one of the same type.
///
/// `lastTransitionTime` is kept from the old condition when the status is
/// unchanged (a new reason or message alone is not a transition) and set
/// to `now` when it flipped or the type is new. Returns whether anything
/// changed, so a caller can skip a status write that would change nothing.
pub fn set_condition(conditions: &mut Vec<Condition>, new: Condition, now: Time) -> bool {
    let mut new = new;
    new.message = bounded_message(&new.message);
    match conditions.iter_mut().find(|old| old.type_ == new.type_) {
        Some(old) => {
            new.last_transition_time = if old.status == new.status {
                old.last_transition_time.clone()
            } else {
                now
            };
            if *old == new {
                return false;
            }
            *old = new;
            true
        }
        None => {
            new.last_transition_time = now;
            conditions.push(new);
            true
        }
    }
}

/// The condition of `type_` in `conditions`, if any.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|condition| condition.type_ == type_)
}

/// Condition types haulage writes. Positive polarity: `True` is the good or
/// finished state, as the API conventions ask.
pub mod condition_type {
    /// BackupStorageLocation: the last probe reached the bucket with the
    /// configured credentials.
    pub const AVAILABLE: &str = "Available";
    /// VolumeBackup: a controller replica owns it.
    pub const CLAIMED: &str = "Claimed";
    /// VolumeBackup / VolumeTransfer: its storage location is Available.
    pub const STORAGE_AVAILABLE: &str = "StorageAvailable";
    /// VolumeBackup: the stage-pod plan is computed.
    pub const PLANNED: &str = "Planned";
    /// VolumeTransfer: the controller admitted it under every cap.
    pub const ADMITTED: &str = "Admitted";
    /// VolumeBackup / VolumeTransfer: data is moving.
    pub const PROGRESSING: &str = "Progressing";
    /// VolumeBackup / VolumeTransfer: finished (whatever the outcome).
    pub const COMPLETE: &str = "Complete";
    /// VolumeBackup / VolumeTransfer: finished with at least one failure.
    pub const FAILED: &str = "Failed";
    /// StoragePolicy: its selectors and limits are valid and in force.
    pub const ACCEPTED: &str = "Accepted";
    /// BackupStorageLocation marked `default: true`: it is the only one so
    /// marked (`False`, reason `DefaultConflict`, on every default location
    /// while several are).
    pub const UNIQUE_DEFAULT: &str = "UniqueDefault";
    /// VolumeRestore: the snapshots to restore and their destination
    /// claims are chosen.
    pub const SELECTED: &str = "Selected";
    /// VolumeBackup / VolumeRestore: every stage pod of the plan could be
    /// created (`False`: the API server refused one, with its answer and
    /// what to do).
    pub const STAGE_PODS_CREATED: &str = "StagePodsCreated";
    /// VolumeTransfer (Download): the written claim matches the snapshot's
    /// tree, entry by entry (message: the root tree id).
    pub const VERIFIED: &str = "Verified";
    /// VolumeBackup being deleted with `deletionPolicy: Delete`: its
    /// snapshots are forgotten (`False`, reason `ForgetFailed`, while the
    /// storage location cannot be reached: the finalizer stays and the
    /// forget is retried).
    pub const SNAPSHOTS_FORGOTTEN: &str = "SnapshotsForgotten";

    /// Every type above, for tests and docs.
    pub const ALL: &[&str] = &[
        SNAPSHOTS_FORGOTTEN,
        STAGE_PODS_CREATED,
        SELECTED,
        VERIFIED,
        AVAILABLE,
        CLAIMED,
        STORAGE_AVAILABLE,
        PLANNED,
        ADMITTED,
        PROGRESSING,
        COMPLETE,
        FAILED,
        ACCEPTED,
        UNIQUE_DEFAULT,
    ];
}

/// Reasons haulage writes, one CamelCase word each.
pub mod reason {
    /// The storage probe succeeded.
    pub const PROBE_SUCCEEDED: &str = "ProbeSucceeded";
    /// The storage probe failed in a way no other reason names (the
    /// message says how, without credentials).
    pub const PROBE_FAILED: &str = "ProbeFailed";
    /// Validation is disabled (`validationFrequency: 0`) and no probe ran.
    pub const VALIDATION_DISABLED: &str = "ValidationDisabled";
    /// The probe passed and the controller initialised the repository
    /// (`spec.initialize: true`).
    pub const REPOSITORY_INITIALIZED: &str = "RepositoryInitialized";
    /// The credentials Secret or its key does not exist, or holds no usable
    /// credentials.
    pub const CREDENTIALS_MISSING: &str = "CredentialsMissing";
    /// The server refused the credentials or the request (unknown key,
    /// bad signature, expired token, no permission).
    pub const ACCESS_DENIED: &str = "AccessDenied";
    /// The bucket does not exist at the endpoint.
    pub const BUCKET_NOT_FOUND: &str = "BucketNotFound";
    /// The endpoint could not be reached (refused, reset, no route, DNS,
    /// connect timeout).
    pub const ENDPOINT_UNREACHABLE: &str = "EndpointUnreachable";
    /// The TLS handshake failed (untrusted or mismatched certificate).
    pub const TLS_ERROR: &str = "TLSError";
    /// The bucket lives in another region or behind another endpoint.
    pub const REGION_MISMATCH: &str = "RegionMismatch";
    /// The server refused requests because the clocks disagree.
    pub const CLOCK_SKEW: &str = "ClockSkew";
    /// The server answered with internal errors or throttling.
    pub const SERVER_ERROR: &str = "ServerError";
    /// The probe did not finish within its timeout.
    pub const PROBE_TIMEOUT: &str = "ProbeTimeout";
    /// The prefix holds no repository and `spec.initialize` is false.
    pub const REPOSITORY_NOT_INITIALIZED: &str = "RepositoryNotInitialized";
    /// The repository there has a newer format than this haulage reads,
    /// or a config it cannot parse.
    pub const REPOSITORY_INCOMPATIBLE: &str = "RepositoryIncompatible";
    /// The spec holds a value the controller cannot use (a bad CA bundle,
    /// endpoint or validation frequency).
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// Several BackupStorageLocations are marked `default: true`.
    pub const DEFAULT_CONFLICT: &str = "DefaultConflict";
    /// This BackupStorageLocation is the only one marked `default: true`.
    pub const SINGLE_DEFAULT: &str = "SingleDefault";
    /// The named BackupStorageLocation does not exist.
    pub const STORAGE_LOCATION_NOT_FOUND: &str = "StorageLocationNotFound";
    /// The BackupStorageLocation exists but is Unavailable.
    pub const STORAGE_LOCATION_UNAVAILABLE: &str = "StorageLocationUnavailable";
    /// The BackupStorageLocation is Available.
    pub const STORAGE_LOCATION_AVAILABLE: &str = "StorageLocationAvailable";
    /// The location answers, but throttled (503 SlowDown, 429) or failed
    /// some of the agent's requests, which were retried.
    pub const STORAGE_REQUESTS_RETRIED: &str = "StorageRequestsRetried";
    /// The location stayed Unavailable past `failAfterUnavailableSeconds`.
    pub const STORAGE_UNAVAILABLE_TIMEOUT: &str = "StorageUnavailableTimeout";
    /// The agent had no file descriptor free to reach the storage location
    /// (its own limit of open files, or the node's, not the location):
    /// its volume waits, and fails after `failAfterUnavailableSeconds`.
    pub const AGENT_OUT_OF_FILE_DESCRIPTORS: &str = "AgentOutOfFileDescriptors";
    /// A controller replica claimed the object.
    pub const CLAIMED_BY_REPLICA: &str = "ClaimedByReplica";
    /// A replica adopted the object after its owner's lease expired.
    pub const ADOPTED_FROM_REPLICA: &str = "AdoptedFromReplica";
    /// The selector matched no PersistentVolumeClaim.
    pub const NO_VOLUMES_SELECTED: &str = "NoVolumesSelected";
    /// The plan places every selected volume.
    pub const PLAN_COMPLETE: &str = "PlanComplete";
    /// The plan leaves some volumes unplaceable.
    pub const VOLUMES_UNPLACEABLE: &str = "VolumesUnplaceable";
    /// Waiting for room under a concurrency cap.
    pub const WAITING_FOR_CAPACITY: &str = "WaitingForCapacity";
    /// Admitted under every cap.
    pub const CAPACITY_GRANTED: &str = "CapacityGranted";
    /// Transfers are running.
    pub const TRANSFERS_RUNNING: &str = "TransfersRunning";
    /// Every volume completed.
    pub const ALL_VOLUMES_COMPLETED: &str = "AllVolumesCompleted";
    /// Some volumes failed, the others completed.
    pub const SOME_VOLUMES_FAILED: &str = "SomeVolumesFailed";
    /// Every volume failed, or the backup could not start.
    pub const ALL_VOLUMES_FAILED: &str = "AllVolumesFailed";
    /// An agent claimed the transfer.
    pub const AGENT_CLAIMED: &str = "AgentClaimed";
    /// The agent stopped reporting.
    pub const AGENT_LOST: &str = "AgentLost";
    /// The stage pod failed more often than the retry budget allows.
    pub const STAGE_POD_FAILED: &str = "StagePodFailed";
    /// The object was deleted and its work canceled.
    pub const CANCELED: &str = "Canceled";
    /// The policy is in force.
    pub const POLICY_ACCEPTED: &str = "PolicyAccepted";
    /// The API server refused a stage pod (Pod Security, a quota, a
    /// LimitRange maximum).
    pub const STAGE_POD_REFUSED: &str = "StagePodRefused";
    /// Every stage pod of the plan exists.
    pub const STAGE_PODS_EXIST: &str = "StagePodsExist";
    /// Every selected snapshot has a destination claim.
    pub const SNAPSHOTS_SELECTED: &str = "SnapshotsSelected";
    /// The selection names no snapshot of the location.
    pub const NO_SNAPSHOTS_SELECTED: &str = "NoSnapshotsSelected";
    /// A snapshot id of the spec is not in the location (or is ambiguous).
    pub const SNAPSHOT_NOT_FOUND: &str = "SnapshotNotFound";
    /// A destination storage class (after the maps) does not exist.
    pub const STORAGE_CLASS_NOT_FOUND: &str = "StorageClassNotFound";
    /// Two selected snapshots map to the same destination claim.
    pub const DESTINATION_COLLISION: &str = "DestinationCollision";
    /// A destination claim exists and `existingClaim` is `Fail`.
    pub const CLAIM_EXISTS: &str = "ClaimExists";
    /// A destination namespace is missing and `createNamespaces` is off.
    pub const NAMESPACE_NOT_FOUND: &str = "NamespaceNotFound";
    /// The location's snapshots could not be read.
    pub const REPOSITORY_UNREADABLE: &str = "RepositoryUnreadable";
    /// The written claim matches the snapshot.
    pub const TREE_VERIFIED: &str = "TreeVerified";
    /// The written claim differs from the snapshot.
    pub const TREE_MISMATCH: &str = "TreeMismatch";
    /// Some entries of the snapshot could not be restored into the claim
    /// (their data is damaged in the repository, or the claim refused the
    /// writes); the message names the first.
    pub const ENTRIES_NOT_RESTORED: &str = "EntriesNotRestored";
    /// The snapshots of a VolumeBackup deleted with `deletionPolicy:
    /// Delete` could not be forgotten (the message says why and what to
    /// do); retried.
    pub const FORGET_FAILED: &str = "ForgetFailed";
    /// The password of `spec.encryption` opens none of the repository's
    /// keys.
    pub const WRONG_PASSWORD: &str = "WrongPassword";
    /// The Secret or key of `spec.encryption.passwordSecretRef` does not
    /// exist or is empty.
    pub const PASSWORD_MISSING: &str = "PasswordMissing";
    /// The repository is encrypted and the location has no
    /// `spec.encryption`.
    pub const REPOSITORY_ENCRYPTED: &str = "RepositoryEncrypted";
    /// The snapshots of a deleted VolumeBackup were forgotten.
    pub const SNAPSHOTS_FORGOTTEN: &str = "SnapshotsForgotten";
    /// A finished VolumeBackup outlived its `ttl` and was deleted.
    pub const TTL_EXPIRED: &str = "TtlExpired";

    /// Every reason above, for tests and docs.
    pub const ALL: &[&str] = &[
        FORGET_FAILED,
        WRONG_PASSWORD,
        PASSWORD_MISSING,
        REPOSITORY_ENCRYPTED,
        SNAPSHOTS_FORGOTTEN,
        TTL_EXPIRED,
        STAGE_POD_REFUSED,
        STAGE_PODS_EXIST,
        SNAPSHOTS_SELECTED,
        NO_SNAPSHOTS_SELECTED,
        SNAPSHOT_NOT_FOUND,
        STORAGE_CLASS_NOT_FOUND,
        DESTINATION_COLLISION,
        CLAIM_EXISTS,
        NAMESPACE_NOT_FOUND,
        REPOSITORY_UNREADABLE,
        TREE_VERIFIED,
        TREE_MISMATCH,
        ENTRIES_NOT_RESTORED,
        PROBE_SUCCEEDED,
        PROBE_FAILED,
        VALIDATION_DISABLED,
        REPOSITORY_INITIALIZED,
        CREDENTIALS_MISSING,
        ACCESS_DENIED,
        BUCKET_NOT_FOUND,
        ENDPOINT_UNREACHABLE,
        TLS_ERROR,
        REGION_MISMATCH,
        CLOCK_SKEW,
        SERVER_ERROR,
        PROBE_TIMEOUT,
        REPOSITORY_NOT_INITIALIZED,
        REPOSITORY_INCOMPATIBLE,
        INVALID_SPEC,
        DEFAULT_CONFLICT,
        SINGLE_DEFAULT,
        STORAGE_LOCATION_NOT_FOUND,
        STORAGE_LOCATION_UNAVAILABLE,
        STORAGE_LOCATION_AVAILABLE,
        STORAGE_REQUESTS_RETRIED,
        STORAGE_UNAVAILABLE_TIMEOUT,
        AGENT_OUT_OF_FILE_DESCRIPTORS,
        CLAIMED_BY_REPLICA,
        ADOPTED_FROM_REPLICA,
        NO_VOLUMES_SELECTED,
        PLAN_COMPLETE,
        VOLUMES_UNPLACEABLE,
        WAITING_FOR_CAPACITY,
        CAPACITY_GRANTED,
        TRANSFERS_RUNNING,
        ALL_VOLUMES_COMPLETED,
        SOME_VOLUMES_FAILED,
        ALL_VOLUMES_FAILED,
        AGENT_CLAIMED,
        AGENT_LOST,
        STAGE_POD_FAILED,
        CANCELED,
        POLICY_ACCEPTED,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).expect("timestamp in range"))
    }

    fn available(status: ConditionStatus, reason: &str, message: &str) -> Condition {
        Condition::new(
            condition_type::AVAILABLE,
            status,
            reason,
            message,
            Some(1),
            at(0),
        )
    }

    #[test]
    fn a_new_condition_type_is_added_with_now() {
        let mut conditions = Vec::new();
        let changed = set_condition(
            &mut conditions,
            available(ConditionStatus::True, reason::PROBE_SUCCEEDED, ""),
            at(10),
        );
        assert!(changed);
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, at(10));
    }

    #[test]
    fn same_status_keeps_the_transition_time_but_takes_the_new_message() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            available(ConditionStatus::False, reason::PROBE_FAILED, "timeout"),
            at(10),
        );
        let changed = set_condition(
            &mut conditions,
            available(ConditionStatus::False, reason::PROBE_FAILED, "refused"),
            at(20),
        );
        assert!(changed);
        assert_eq!(conditions[0].last_transition_time, at(10));
        assert_eq!(conditions[0].message, "refused");
    }

    #[test]
    fn a_flipped_status_takes_now() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            available(ConditionStatus::False, reason::PROBE_FAILED, "timeout"),
            at(10),
        );
        set_condition(
            &mut conditions,
            available(ConditionStatus::True, reason::PROBE_SUCCEEDED, ""),
            at(30),
        );
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].status, ConditionStatus::True);
        assert_eq!(conditions[0].last_transition_time, at(30));
    }

    #[test]
    fn an_identical_condition_reports_no_change() {
        let mut conditions = Vec::new();
        let condition = available(ConditionStatus::True, reason::PROBE_SUCCEEDED, "ok");
        set_condition(&mut conditions, condition.clone(), at(10));
        assert!(!set_condition(&mut conditions, condition, at(99)));
        assert_eq!(conditions[0].last_transition_time, at(10));
    }

    #[test]
    fn other_condition_types_are_left_alone() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            available(ConditionStatus::True, reason::PROBE_SUCCEEDED, ""),
            at(10),
        );
        let planned = Condition::new(
            condition_type::PLANNED,
            ConditionStatus::True,
            reason::PLAN_COMPLETE,
            "",
            Some(2),
            at(0),
        );
        set_condition(&mut conditions, planned, at(20));
        assert_eq!(conditions.len(), 2);
        assert_eq!(conditions[0].last_transition_time, at(10));
        assert_eq!(
            find_condition(&conditions, condition_type::PLANNED).map(|c| c.observed_generation),
            Some(Some(2))
        );
    }

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_MESSAGE_BYTES);
        let cut = bounded_message(&long);
        assert!(cut.len() <= MAX_MESSAGE_BYTES, "{} bytes", cut.len());
        assert!(cut.ends_with('…'));
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            available(ConditionStatus::False, reason::PROBE_FAILED, &long),
            at(1),
        );
        assert!(conditions[0].message.len() <= MAX_MESSAGE_BYTES);
        assert_eq!(bounded_message("short"), "short");
    }

    #[test]
    fn types_and_reasons_match_the_api_conventions_pattern() {
        // metav1.Condition: reason ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$,
        // type is a CamelCase name.
        for word in condition_type::ALL.iter().chain(reason::ALL) {
            let mut chars = word.chars();
            assert!(
                chars.next().is_some_and(|c| c.is_ascii_uppercase()),
                "{word}"
            );
            assert!(chars.all(|c| c.is_ascii_alphanumeric()), "{word}");
        }
    }
}
