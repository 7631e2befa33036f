//! The VolumeBackup decisions. The controller reads what a backup's
//! reconcile needs from its caches into a [`BackupObservation`] and asks:
//!
//! - [`needs_credentials`]: whether this reconcile will create a stage pod
//!   (then it reads the location's credentials Secret once, the only read
//!   that is not from a cache);
//! - [`decide`]: ownership (keep, claim, adopt, or wait), the plan, the
//!   stage pods to create, the verdict on each running one, the next
//!   status and whether it is written now or held by the progress-write
//!   throttle, the Events, the release of finished stage pods, and when to
//!   look again;
//! - [`decide_cancel`]: what deleting a VolumeBackup undoes;
//! - [`decide_lifecycle`], before all of these: what `deletionPolicy` and
//!   `ttl` ask (the `haulage.dev/forget-snapshots` finalizer, forgetting
//!   a deleted backup's snapshots, deleting an expired one), and
//!   [`forget_failed`], the status of a forget that could not be done.
//!
//! It executes what comes back in order: the ownership claim (a
//! resourceVersion-checked write: of two replicas, one wins and the other
//! stops), the actions, the status (with the resourceVersion this replica
//! last saw), then the actions after the status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use haulage_api::backup::BackupPlan;
use haulage_api::condition::{condition_type, find_condition};
use haulage_api::labels::labelled_as_owned_by;
use haulage_api::{
    BackupStorageLocation, VolumeBackup, VolumeBackupPhase, VolumeBackupStatus, VolumeTransfer,
    VolumeTransferPhase,
};
use haulage_plan::objects::{ClusterObjects, DumpError, facts_from_objects};
use haulage_plan::selector::LabelRequirement;
use haulage_plan::{LabelSelector, PlanError, Selection, plan_stage_pods};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::action::{Action, Event, Requeue};
use crate::backup_status::{Observed, StorageState, TransferObservation, next_status};
use crate::ownership::{Decision, OwnerActs};
use crate::stage_pod::{
    BackupIdentity, Operation, Owner, StagePodTemplate, TransferDetails, credentials_copy,
    status_plan,
};
use crate::staging::{StagingObservation, StatusStanding, after_final_status, status_to_write};

/// How often a waiting or running backup is looked at even without events.
pub const RECHECK_SECONDS: u64 = 15;
/// How long planning waits for a selected claim that is still Pending
/// (created with its backup, its volume not provisioned yet).
pub const CLAIM_BINDING_GRACE_SECONDS: i64 = 120;
/// Shortest requeue of a running backup.
const MINIMUM_REQUEUE_SECONDS: u64 = 1;

/// What one reconcile of a VolumeBackup read from the caches (and, when
/// [`needs_credentials`] said so, the location's credentials).
#[derive(Debug, Clone)]
pub struct BackupObservation {
    /// The backup as the cache shows it.
    pub backup: Arc<VolumeBackup>,
    /// What a backup's reconcile reads like a restore's: this replica's
    /// standing, the locations of the backup's namespace, its stage pods
    /// and transfers, and what a new stage pod is built from.
    pub staging: StagingObservation,
    /// The cluster's objects in the backup's namespaces, read only while
    /// the backup has no plan yet.
    pub cluster: Option<ClusterObjects>,
    /// The record of each claim of the plan (`claims::claim_record`), by
    /// (namespace, name), for the snapshots; a claim gone from the cache
    /// has none.
    pub claim_records: BTreeMap<(String, String), haulage_repo::snapshot::ClaimRecord>,
}

/// A backup that cannot be decided on: the spec or the cluster facts are
/// unusable (permanent until someone changes them).
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// A required metadata field is empty.
    #[error("the VolumeBackup has no {field}")]
    MissingField {
        /// The field.
        field: &'static str,
    },
    /// `spec.selector` uses an operator the API does not define.
    #[error("spec.selector of VolumeBackup {name}: {message}")]
    Selector {
        /// The backup.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The caches hold an object the planner cannot read.
    #[error("cannot turn the cluster's objects into planner facts")]
    Facts {
        /// Which object and why.
        #[source]
        source: DumpError,
    },
    /// `spec.ttl` cannot be read (too long, say).
    #[error("spec.ttl of VolumeBackup {name}: {message}: set a duration such as 72h")]
    Ttl {
        /// The backup.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The planner refused the facts.
    #[error("cannot plan the stage pods")]
    Plan {
        /// Why.
        #[source]
        source: PlanError,
    },
}

/// What a reconcile of a VolumeBackup does.
pub type BackupDecision = Decision<VolumeBackupStatus>;

/// The owner's actions for one reconcile of a VolumeBackup.
pub type BackupActs = OwnerActs<VolumeBackupStatus>;

/// The owner of a backup's children.
pub fn owner_of(backup: &VolumeBackup) -> Result<Owner, BackupError> {
    Owner::of(backup).map_err(|field| BackupError::MissingField { field })
}

/// Whether `transfer` belongs to `owner`'s backup.
pub fn owns_transfer(owner_uid: &str, transfer: &VolumeTransfer) -> bool {
    labelled_as_owned_by(transfer, owner_uid)
        || transfer.spec.backup_ref.uid.as_deref() == Some(owner_uid)
}

/// Whether the decision needs the cluster's objects: only a backup that
/// has no plan yet is planned.
pub fn needs_cluster(backup: &VolumeBackup) -> bool {
    let status = backup.status.as_ref();
    status.and_then(|status| status.plan.as_ref()).is_none()
        && !status
            .and_then(|status| status.phase)
            .is_some_and(VolumeBackupPhase::is_final)
}

/// A Kubernetes label selector as the planner's (`None` when absent), or
/// what is wrong with it.
pub fn label_selector_of(
    selector: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
) -> Result<Option<LabelSelector>, String> {
    let Some(selector) = selector else {
        return Ok(None);
    };
    let mut labels = LabelSelector::default();
    for (key, value) in selector.match_labels.clone().unwrap_or_default() {
        labels
            .requirements
            .push(LabelRequirement::Equals(key, value));
    }
    for expression in selector.match_expressions.clone().unwrap_or_default() {
        let values = expression.values.unwrap_or_default();
        let requirement = match expression.operator.as_str() {
            "In" => LabelRequirement::In(expression.key, values),
            "NotIn" => LabelRequirement::NotIn(expression.key, values),
            "Exists" => LabelRequirement::Exists(expression.key),
            "DoesNotExist" => LabelRequirement::DoesNotExist(expression.key),
            other => return Err(format!("unknown operator {other:?}")),
        };
        labels.requirements.push(requirement);
    }
    Ok(Some(labels))
}

/// The claims a backup selects.
pub fn selection_of(backup: &VolumeBackup) -> Result<Selection, BackupError> {
    let labels = label_selector_of(backup.spec.selector.as_ref())
        .map_err(|message| BackupError::Selector {
            name: backup.name_any(),
            message,
        })?
        .unwrap_or_default();
    Ok(Selection {
        namespaces: backup.spec.namespaces.iter().cloned().collect(),
        labels,
        names: backup.spec.claim_names.iter().cloned().collect(),
    })
}

/// The storage location of a backup and its state: the one recorded when
/// it was planned ([`crate::location::resolve_kept_location`]).
pub fn resolve_location<'a>(
    backup: &VolumeBackup,
    locations: &'a [Arc<BackupStorageLocation>],
) -> (StorageState, Option<&'a BackupStorageLocation>) {
    crate::location::resolve_kept_location(
        &backup.namespace().unwrap_or_default(),
        backup
            .status
            .as_ref()
            .and_then(|status| status.storage_location.as_deref()),
        backup.spec.storage_location.as_deref(),
        locations,
    )
}

/// The plan from the cluster's objects (the planner counts other backups'
/// and restores' stage pods as load on their nodes, and does not let them
/// pin a claim to their node).
fn make_plan(
    observation: &BackupObservation,
    owner: &Owner,
    cluster: &ClusterObjects,
) -> Result<BackupPlan, BackupError> {
    let selection = selection_of(&observation.backup)?;
    let facts = facts_from_objects(cluster).map_err(|source| BackupError::Facts { source })?;
    let plan =
        plan_stage_pods(&facts, &selection).map_err(|source| BackupError::Plan { source })?;
    Ok(status_plan(Operation::Backup, owner, plan))
}

/// The plan this reconcile works with: the status's, or a new one when
/// the location is Available (`None` while it is not).
fn current_plan(
    observation: &BackupObservation,
    owner: &Owner,
    storage: &StorageState,
    now: &Time,
) -> Result<Result<Option<BackupPlan>, String>, BackupError> {
    let old = observation.backup.status.clone().unwrap_or_default();
    match (old.plan, storage, &observation.cluster) {
        (Some(plan), _, _) => Ok(Ok(Some(plan))),
        (None, StorageState::Available { .. }, Some(cluster)) => {
            if let Some(waiting) = claims_still_binding(observation, cluster, now)? {
                return Ok(Err(waiting));
            }
            make_plan(observation, owner, cluster).map(|plan| Ok(Some(plan)))
        }
        (None, _, _) => Ok(Ok(None)),
    }
}

/// A selected claim still Pending that was created less than
/// [`CLAIM_BINDING_GRACE_SECONDS`] ago (applied together with its backup,
/// say): the plan waits for it rather than fail it as unplaceable at once.
fn claims_still_binding(
    observation: &BackupObservation,
    cluster: &ClusterObjects,
    now: &Time,
) -> Result<Option<String>, BackupError> {
    let selection = selection_of(&observation.backup)?;
    let young_pending: Vec<String> = cluster
        .claims
        .iter()
        .filter(|claim| {
            selection.selects(
                &claim.namespace().unwrap_or_default(),
                &claim.name_any(),
                claim.labels(),
            ) && claim
                .status
                .as_ref()
                .and_then(|status| status.phase.as_deref())
                == Some("Pending")
                && claim
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .is_some_and(|created| {
                        now.0.as_second() - created.0.as_second() < CLAIM_BINDING_GRACE_SECONDS
                    })
        })
        .map(|claim| {
            format!(
                "{}/{}",
                claim.namespace().unwrap_or_default(),
                claim.name_any()
            )
        })
        .collect();
    Ok((!young_pending.is_empty()).then(|| {
        format!(
            "waiting for claims to bind before planning: {} (a claim still Pending after {CLAIM_BINDING_GRACE_SECONDS}s is planned as unplaceable)",
            young_pending.join(", ")
        )
    }))
}

/// Whether [`decide`] will create a stage pod, so the location's
/// credentials must be read first.
pub fn needs_credentials(observation: &BackupObservation, now: &Time) -> Result<bool, BackupError> {
    let backup = &observation.backup;
    if backup
        .status
        .as_ref()
        .and_then(|status| status.phase)
        .is_some_and(VolumeBackupPhase::is_final)
    {
        return Ok(false);
    }
    let owner = owner_of(backup)?;
    let (storage, location) = resolve_location(backup, &observation.staging.locations);
    if location.is_none() || matches!(storage, StorageState::Missing { .. }) {
        return Ok(false);
    }
    Ok(current_plan(observation, &owner, &storage, now)?
        .ok()
        .flatten()
        .is_some_and(|plan| !observation.staging.missing_stage_pods(&plan).is_empty()))
}

/// The transfer as [`next_status`] sees it.
fn observe_transfer(transfer: &VolumeTransfer) -> TransferObservation {
    let status = transfer.status.clone().unwrap_or_default();
    TransferObservation {
        namespace: transfer.namespace().unwrap_or_default(),
        pvc: transfer.spec.pvc.clone(),
        phase: status.phase.unwrap_or(VolumeTransferPhase::New),
        progress: status.progress,
        snapshot_id: status.snapshot_id,
        benchmark: status.benchmark,
        // A waiting volume says what holds it (a cap, another backup of
        // the same claim), from its Admitted condition.
        message: status.message.or_else(|| {
            (status.phase == Some(VolumeTransferPhase::Queued))
                .then(|| find_condition(&status.conditions, condition_type::ADMITTED))
                .flatten()
                .map(|condition| condition.message.clone())
        }),
    }
}

/// The stage pods of `plan` to create now, each complete
/// ([`StagingObservation::create_stage_pod`]), with the location's
/// credentials copied.
fn stage_pods_to_create(
    observation: &BackupObservation,
    owner: &Owner,
    plan: &BackupPlan,
    location: &BackupStorageLocation,
) -> Vec<Action> {
    let staging = &observation.staging;
    let missing = staging.missing_stage_pods(plan);
    if missing.is_empty() {
        return Vec::new();
    }
    let template = StagePodTemplate {
        backup_identity: match observation.backup.spec.agent_user {
            Some(user_id) => BackupIdentity::NonRoot { user_id },
            None => BackupIdentity::Root,
        },
        fail_after_unavailable_seconds: observation.backup.spec.fail_after_unavailable_seconds,
        ..staging.stage_pod_template(Operation::Backup, owner, location)
    };
    let credentials = credentials_copy(
        &location.spec,
        staging.credentials.clone().unwrap_or_default(),
        staging.password.clone(),
    );
    missing
        .into_iter()
        .map(|planned| {
            let record_of = |pvc: &String| {
                observation
                    .claim_records
                    .get(&(planned.stage.namespace.clone(), pvc.clone()))
            };
            let classes: Vec<(String, String)> = planned
                .stage
                .volumes
                .iter()
                .filter_map(|pvc| {
                    let record = record_of(pvc)?;
                    Some((
                        record.storage_class.clone().unwrap_or_default(),
                        record.provisioner.clone().unwrap_or_default(),
                    ))
                })
                .collect();
            let volumes = planned
                .stage
                .volumes
                .iter()
                .map(|pvc| {
                    (
                        pvc.clone(),
                        TransferDetails {
                            snapshot: None,
                            since_snapshot: None,
                            claim: record_of(pvc).cloned(),
                            parent_policy: observation.backup.spec.parent_policy,
                            tags: observation.backup.spec.snapshot_tags(),
                            benchmark: observation.backup.spec.benchmark.clone(),
                        },
                    )
                })
                .collect();
            staging.create_stage_pod(&template, planned, &classes, credentials.clone(), volumes)
        })
        .collect()
}

/// Decide one reconcile of a VolumeBackup at `now` (pure; see the module
/// documentation for the order in which the result is carried out).
pub fn decide(observation: &BackupObservation, now: &Time) -> Result<BackupDecision, BackupError> {
    let backup = &observation.backup;
    let staging = &observation.staging;
    let owner = owner_of(backup)?;
    let old = backup.status.clone().unwrap_or_default();
    let standing = StatusStanding {
        finished: old.phase.is_some_and(VolumeBackupPhase::is_final),
        plan: old.plan.as_ref(),
        owner: old.owner.as_ref(),
        noun: "backup",
    };
    let ownership = match staging.ownership(standing, now) {
        Ok(ownership) => ownership,
        Err(decision) => return Ok(decision),
    };
    let claim = ownership.claim().clone();

    let (storage, location) = resolve_location(backup, &staging.locations);
    let (plan, waiting) = match current_plan(observation, &owner, &storage, now)? {
        Ok(plan) => (plan, None),
        Err(waiting) => (None, Some(waiting)),
    };
    let mut actions = match (&plan, location) {
        (Some(plan), Some(location)) if !matches!(storage, StorageState::Missing { .. }) => {
            stage_pods_to_create(observation, &owner, plan, location)
        }
        _ => Vec::new(),
    };
    let (supervision, backoff) = staging.supervise(now);
    actions.extend(supervision);

    let observed = Observed {
        generation: backup.metadata.generation,
        replica: staging.settings.identity.clone(),
        adopted_from: claim.adopted_from.clone(),
        storage,
        fail_after_unavailable_seconds: backup.spec.fail_after_unavailable_seconds,
        benchmark: backup.spec.benchmark.is_some(),
        plan,
        transfers: staging
            .transfers
            .iter()
            .map(|transfer| observe_transfer(transfer))
            .collect(),
        waiting: waiting.clone(),
    };
    let mut status = next_status(&old, &observed, now.clone());
    status.owner = Some(claim);
    // The location the plan was made for stays the backup's.
    if status.plan.is_some() && status.storage_location.is_none() {
        status.storage_location = location.map(ResourceExt::name_any);
    }
    staging.note_stage_pods(&mut status, backup.metadata.generation, now);

    let (write, progress_wait) =
        match status_to_write(&old, status.clone(), staging.since_last_status_write) {
            Ok(write) => (write, None),
            Err(wait) => (None, Some(wait)),
        };
    let after_status = after_final_status(staging, (&old, &status), &actions, "completed");
    if status.phase.is_some_and(VolumeBackupPhase::is_final) {
        return Ok(BackupDecision::Act(Box::new(BackupActs {
            ownership,
            actions,
            status: write,
            after_status,
            finished: true,
            requeue: Requeue::OnChange,
        })));
    }
    let recheck = Duration::from_secs(RECHECK_SECONDS);
    let soonest = [backoff, progress_wait].into_iter().flatten().min();
    let requeue = soonest.map_or(recheck, |wait| {
        wait.min(recheck)
            .max(Duration::from_secs(MINIMUM_REQUEUE_SECONDS))
    });
    Ok(BackupDecision::Act(Box::new(BackupActs {
        ownership,
        actions,
        status: write,
        after_status,
        finished: false,
        requeue: Requeue::After(requeue),
    })))
}

/// Cancel a deleted backup: mark its open transfers Canceled (agents
/// watching them stop and abort their uploads), release its stage pods,
/// delete its transfers (the controller bounds the time this may take).
pub fn decide_cancel(observation: &BackupObservation, now: &Time) -> Vec<Action> {
    let status = observation.backup.status.as_ref();
    let plan = status.and_then(|status| status.plan.as_ref());
    let why = "its VolumeBackup was deleted";
    observation.staging.cancel(plan, why, now)
}

/// How long after a failed forget of a deleted backup's snapshots it is
/// tried again.
pub const FORGET_RETRY_SECONDS: u64 = 30;

/// What a VolumeBackup's `deletionPolicy` and `ttl` ask of a reconcile,
/// decided before anything else ([`decide_lifecycle`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Lifecycle {
    /// Nothing: reconcile as usual. `ttl_left`: the backup is finished and
    /// is deleted this long from now (look again then).
    Continue {
        /// Time until the ttl expires.
        ttl_left: Option<Duration>,
    },
    /// Add [`FORGET_FINALIZER`] (`deletionPolicy: Delete`), then look again.
    AddFinalizer,
    /// Remove [`FORGET_FINALIZER`]: the policy is `Retain` (again), so
    /// deleting the backup keeps its snapshots.
    RemoveFinalizer,
    /// The backup is being deleted, its transfers are canceled and its
    /// stage pods gone: forget its snapshots (those whose claim record
    /// names `backup` and this cluster) from `location`, then remove
    /// [`FORGET_FINALIZER`].
    Forget {
        /// The backup, `namespace/name`, as its snapshots record it.
        backup: String,
        /// The BackupStorageLocation (in the backup's namespace).
        location: String,
    },
    /// The backup is being deleted with `deletionPolicy: Delete` but its
    /// storage location does not exist: nothing can be forgotten. Keep
    /// the finalizer, say so ([`forget_failed`]) and look again.
    ForgetBlocked {
        /// What is wrong, for the condition.
        problem: String,
    },
    /// The backup finished longer than its `ttl` ago: delete it.
    Expired {
        /// The Event saying so.
        event: Event,
    },
}

fn has_finalizer(backup: &VolumeBackup, finalizer: &str) -> bool {
    backup
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|finalizers| finalizers.iter().any(|name| name == finalizer))
}

/// Decide what `deletionPolicy` and `ttl` ask of this reconcile (pure):
///
/// - not being deleted: `Delete` without the finalizer adds it, `Retain`
///   with it removes it; a finished backup whose `completionTime + ttl`
///   passed is deleted, one still within its ttl is looked at again when
///   it expires;
/// - being deleted: the cancel (finalizer `haulage.dev/cancel`) goes
///   first, then `Delete` forgets the snapshots from the backup's
///   location (or says the location is missing), and `Retain` releases
///   the finalizer at once — which is how a user lets go of a backup
///   whose snapshots cannot be forgotten.
pub fn decide_lifecycle(
    backup: &VolumeBackup,
    locations: &[Arc<BackupStorageLocation>],
    now: &Time,
) -> Result<Lifecycle, BackupError> {
    use haulage_api::backup::DeletionPolicy;
    use haulage_api::labels::{CANCEL_FINALIZER, FORGET_FINALIZER};
    let held = has_finalizer(backup, FORGET_FINALIZER);
    let policy = backup.spec.deletion_policy;
    if policy == DeletionPolicy::Retain && held {
        return Ok(Lifecycle::RemoveFinalizer);
    }
    if backup.metadata.deletion_timestamp.is_some() {
        if !held || has_finalizer(backup, CANCEL_FINALIZER) {
            return Ok(Lifecycle::Continue { ttl_left: None });
        }
        let owner = owner_of(backup)?;
        return Ok(match resolve_location(backup, locations) {
            (_, Some(location)) => Lifecycle::Forget {
                backup: format!("{}/{}", owner.namespace, owner.name),
                location: location.name_any(),
            },
            (storage, None) => Lifecycle::ForgetBlocked {
                problem: match storage {
                    StorageState::Missing { name } => format!(
                        "its BackupStorageLocation {name} does not exist in namespace {}",
                        owner.namespace
                    ),
                    _ => "its BackupStorageLocation cannot be found".to_string(),
                },
            },
        });
    }
    if policy == DeletionPolicy::Delete && !held {
        return Ok(Lifecycle::AddFinalizer);
    }
    let ttl = backup
        .spec
        .ttl_duration()
        .map_err(|error| BackupError::Ttl {
            name: backup.name_any(),
            message: format!("{:?}: {}", error.text, error.problem),
        })?;
    let status = backup.status.as_ref();
    let finished = status
        .and_then(|status| status.phase)
        .is_some_and(VolumeBackupPhase::is_final);
    let completed = status.and_then(|status| status.completion_time.as_ref());
    let (Some(ttl), true, Some(completed)) = (ttl, finished, completed) else {
        return Ok(Lifecycle::Continue { ttl_left: None });
    };
    let age = now.0.duration_since(completed.0);
    let age = Duration::try_from(age).unwrap_or(Duration::ZERO);
    if age >= ttl {
        return Ok(Lifecycle::Expired {
            event: Event::normal(
                haulage_api::condition::reason::TTL_EXPIRED,
                "Delete",
                format!(
                    "finished at {} and its ttl {} is over: deleting it ({})",
                    completed.0,
                    backup.spec.ttl.as_deref().unwrap_or_default(),
                    match policy {
                        DeletionPolicy::Delete =>
                            "deletionPolicy Delete: its snapshots are forgotten",
                        DeletionPolicy::Retain => "deletionPolicy Retain: its snapshots are kept",
                    }
                ),
            ),
        });
    }
    Ok(Lifecycle::Continue {
        ttl_left: Some(ttl.saturating_sub(age)),
    })
}

/// The status and Event of a deleted backup whose snapshots could not be
/// forgotten: the old status with `SnapshotsForgotten` False
/// (`ForgetFailed`), saying what went wrong and what to do.
pub fn forget_failed(
    backup: &VolumeBackup,
    location: Option<&str>,
    problem: &str,
    now: &Time,
) -> (VolumeBackupStatus, Event) {
    use haulage_api::condition::{Condition, ConditionStatus, reason, set_condition};
    use haulage_api::labels::FORGET_FINALIZER;
    let name = format!(
        "{}/{}",
        backup.namespace().unwrap_or_default(),
        backup.name_any()
    );
    let place = location.map_or_else(String::new, |location| {
        format!(" from BackupStorageLocation {location}")
    });
    let message = format!(
        "cannot forget the snapshots of VolumeBackup {name}{place}: {problem}; \
         the finalizer {FORGET_FINALIZER} keeps the VolumeBackup until they are forgotten \
         (tried again every {FORGET_RETRY_SECONDS}s); to keep its snapshots and let it go, \
         set spec.deletionPolicy: Retain"
    );
    let mut status = backup.status.clone().unwrap_or_default();
    set_condition(
        &mut status.conditions,
        Condition::new(
            condition_type::SNAPSHOTS_FORGOTTEN,
            ConditionStatus::False,
            reason::FORGET_FAILED,
            &message,
            backup.metadata.generation,
            now.clone(),
        ),
        now.clone(),
    );
    (
        status,
        Event::warning(reason::FORGET_FAILED, "Forget", message),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{ObjectName, StagePodRelease};
    use crate::ownership::{Ownership, WaitReason};
    use crate::staging::PROGRESS_WRITE_INTERVAL;
    use crate::test_support::{at, available, available_default};
    use haulage_api::backup::OwnerClaim;
    use haulage_api::backup::VolumeCounts;
    use haulage_api::condition::reason;
    use haulage_api::labels::OWNER_UID_LABEL;
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, PodStatus};
    use k8s_openapi::api::rbac::v1::Role;
    use k8s_openapi::api::storage::v1::StorageClass;
    use std::collections::BTreeSet;

    fn observation(backup: VolumeBackup) -> BackupObservation {
        BackupObservation {
            backup: Arc::new(backup),
            staging: StagingObservation::test(vec![available("s3")]),
            cluster: None,
            claim_records: BTreeMap::new(),
        }
    }

    /// A backup this replica owns, with a plan of one stage pod on node-a
    /// holding `volumes`.
    fn owned_and_planned(volumes: &[&str]) -> VolumeBackup {
        let backup = VolumeBackup::test("nightly");
        let owner = owner_of(&backup).expect("owner");
        let plan = status_plan(
            Operation::Backup,
            &owner,
            haulage_plan::StagePlan {
                stage_pods: vec![haulage_plan::StagePod {
                    namespace: "shop".to_string(),
                    node: "node-a".to_string(),
                    volumes: volumes.iter().map(|v| v.to_string()).collect(),
                    bytes: 100,
                }],
                unplaceable: Vec::new(),
            },
        );
        let mut backup = backup.with_phase(VolumeBackupPhase::InProgress);
        let status = backup.status.as_mut().expect("status");
        status.owner = Some(OwnerClaim {
            replica: "controller-0".to_string(),
            claimed_at: at(0),
            adopted_from: None,
        });
        status.plan = Some(plan);
        backup
    }

    /// An observation of `backup` with its stage pod Running and a
    /// transfer of each of `volumes` in its phase.
    fn running(
        backup: &VolumeBackup,
        volumes: &[(&str, VolumeTransferPhase)],
    ) -> BackupObservation {
        let mut seen = observation(backup.clone());
        seen.staging.pods = vec![stage_pod(backup, "Running")];
        seen.staging.transfers = volumes
            .iter()
            .map(|(pvc, phase)| transfer_of(backup, pvc, *phase))
            .collect();
        seen
    }

    fn pod_name_of(backup: &VolumeBackup) -> String {
        backup
            .status
            .as_ref()
            .expect("status")
            .plan
            .as_ref()
            .expect("plan")
            .stage_pods[0]
            .pod_name
            .clone()
    }

    fn stage_pod(backup: &VolumeBackup, phase: &str) -> Arc<Pod> {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": pod_name_of(backup), "namespace": "shop", "uid": "pod-uid-1",
                "creationTimestamp": "2027-01-15T08:00:00Z",
                "labels": {OWNER_UID_LABEL: "uid-nightly"}},
        }))
        .expect("valid pod");
        pod.status = Some(PodStatus {
            phase: Some(phase.to_string()),
            ..PodStatus::default()
        });
        Arc::new(pod)
    }

    /// A stage pod the kubelet gave up on (phase Failed, its agent
    /// terminated at T0).
    fn evicted_pod(backup: &VolumeBackup) -> Arc<Pod> {
        let mut pod = (*stage_pod(backup, "Failed")).clone();
        pod.status.as_mut().expect("status").container_statuses = Some(vec![
            serde_json::from_value(serde_json::json!({
                "name": "agent", "image": "agent:1", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 137, "reason": "Evicted",
                    "finishedAt": "2027-01-15T08:00:00Z"}},
            }))
            .expect("container status"),
        ]);
        Arc::new(pod)
    }

    fn transfer_of(
        backup: &VolumeBackup,
        pvc: &str,
        phase: VolumeTransferPhase,
    ) -> Arc<VolumeTransfer> {
        let mut transfer = VolumeTransfer::test(&format!("nightly-{pvc}"), pvc).with_phase(phase);
        transfer.spec.stage_pod = pod_name_of(backup);
        Arc::new(transfer)
    }

    fn acts(decision: BackupDecision) -> BackupActs {
        match decision {
            BackupDecision::Act(acts) => *acts,
            other => panic!("expected the owner to act, got {other:?}"),
        }
    }

    fn events(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|action| match action {
                Action::Emit(event) => Some(event.reason.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_new_backup_is_claimed_by_this_replica_with_an_event() {
        let decision =
            decide(&observation(VolumeBackup::test("nightly")), &at(0)).expect("decided");
        let acts = acts(decision);
        let Ownership::Take { claim, event } = &acts.ownership else {
            panic!("a new backup is claimed");
        };
        assert_eq!(claim.replica, "controller-0");
        assert_eq!(claim.adopted_from, None);
        assert_eq!(event.reason, reason::CLAIMED_BY_REPLICA);
        let status = acts.status.expect("the first status is written");
        assert_eq!(status.owner.as_ref(), Some(claim));
    }

    #[test]
    fn a_backup_of_a_live_replica_is_left_alone_and_looked_at_again_later() {
        let mut backup = VolumeBackup::test("nightly");
        backup.status = Some(VolumeBackupStatus {
            owner: Some(OwnerClaim {
                replica: "controller-1".to_string(),
                claimed_at: at(0),
                adopted_from: None,
            }),
            ..VolumeBackupStatus::default()
        });
        // No lease seen yet, but the claim is young: alive.
        let decision = decide(&observation(backup), &at(10)).expect("decided");
        let BackupDecision::Wait { why, requeue } = decision else {
            panic!("another replica's backup is not touched");
        };
        assert_eq!(
            why,
            WaitReason::OwnedElsewhere {
                replica: "controller-1".to_string()
            }
        );
        assert_eq!(
            requeue,
            Requeue::After(Duration::from_secs(
                crate::ownership::ADOPTION_CHECK_SECONDS
            ))
        );
    }

    #[test]
    fn a_backup_whose_owner_stopped_renewing_its_lease_is_adopted() {
        let mut backup = owned_and_planned(&["db"]);
        backup.status.as_mut().expect("status").owner = Some(OwnerClaim {
            replica: "controller-1".to_string(),
            claimed_at: at(0),
            adopted_from: None,
        });
        let decision = decide(&observation(backup), &at(600)).expect("decided");
        let acts = acts(decision);
        let Ownership::Take { claim, event } = &acts.ownership else {
            panic!("adopted");
        };
        assert_eq!(claim.adopted_from.as_deref(), Some("controller-1"));
        assert_eq!(event.reason, reason::ADOPTED_FROM_REPLICA);
        let status = acts.status.expect("written");
        let condition =
            find_condition(&status.conditions, condition_type::CLAIMED).expect("claimed");
        assert_eq!(condition.reason, reason::ADOPTED_FROM_REPLICA);
    }

    #[test]
    fn a_replica_whose_own_lease_is_stale_does_not_act_on_its_backups() {
        let mut seen = observation(owned_and_planned(&["db"]));
        seen.staging.lease_fresh = false;
        let decision = decide(&seen, &at(5)).expect("decided");
        assert!(matches!(
            decision,
            BackupDecision::Wait {
                why: WaitReason::StaleLease,
                ..
            }
        ));
    }

    #[test]
    fn a_missing_location_makes_the_backup_wait_without_planning() {
        let mut seen = observation(VolumeBackup::test("nightly"));
        seen.staging.locations.clear();
        seen.cluster = Some(ClusterObjects::default());
        assert!(!needs_credentials(&seen, &at(0)).expect("decided"));
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let status = acts.status.expect("written");
        assert_eq!(status.phase, Some(VolumeBackupPhase::WaitingForStorage));
        assert_eq!(status.plan, None);
        assert!(acts.actions.is_empty());
    }

    fn cluster_with_one_claim() -> ClusterObjects {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .expect("node");
        let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                "volumeName": "pv-db", "resources": {"requests": {"storage": "1Gi"}}},
            "status": {"phase": "Bound"},
        }))
        .expect("claim");
        let volume: PersistentVolume = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pv-db"},
            "spec": {"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                "storageClassName": "fast",
                "claimRef": {"namespace": "shop", "name": "db"}},
            "status": {"phase": "Bound"},
        }))
        .expect("volume");
        let class: StorageClass = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "fast"}, "provisioner": "example.com/fast",
        }))
        .expect("class");
        ClusterObjects {
            nodes: vec![node],
            claims: vec![claim],
            volumes: vec![volume],
            storage_classes: vec![class],
            ..ClusterObjects::default()
        }
    }

    #[test]
    fn an_available_location_plans_and_creates_each_stage_pod_complete_with_credentials() {
        let mut backup = VolumeBackup::test("nightly");
        backup.spec.agent_user = Some(1000);
        backup.spec.tags = vec!["team=payments".to_string(), "weekly".to_string()];
        backup.spec.parent_policy = haulage_api::backup::ParentPolicy::Full;
        let mut seen = observation(backup);
        seen.cluster = Some(cluster_with_one_claim());
        assert!(
            needs_credentials(&seen, &at(0)).expect("decided"),
            "a pod is to be made"
        );
        seen.staging.credentials = Some(ByteString(b"[default]\n".to_vec()));
        let record = haulage_repo::snapshot::ClaimRecord {
            namespace: "shop".to_string(),
            name: "db".to_string(),
            requested_bytes: 1 << 30,
            ..Default::default()
        };
        seen.claim_records =
            BTreeMap::from([(("shop".to_string(), "db".to_string()), record.clone())]);
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let status = acts.status.expect("written");
        assert_eq!(status.phase, Some(VolumeBackupPhase::InProgress));
        assert_eq!(
            status.storage_location.as_deref(),
            Some("s3"),
            "the location it is planned for is recorded"
        );
        let plan = status.plan.expect("planned");
        assert_eq!(plan.stage_pods.len(), 1);
        let [Action::CreateStagePod(objects)] = &acts.actions[..] else {
            panic!("one stage pod created: {:?}", acts.actions);
        };
        assert_eq!(objects.pod_name(), plan.stage_pods[0].pod_name);
        assert_eq!(
            objects
                .credentials
                .data
                .as_ref()
                .and_then(|data| data.get("cloud")),
            Some(&ByteString(b"[default]\n".to_vec()))
        );
        assert_eq!(objects.transfers.len(), 1);
        assert_eq!(objects.transfers[0].spec.pvc, "db");
        assert_eq!(
            objects.transfers[0].spec.claim.as_ref(),
            Some(&record),
            "the claim's record travels to the snapshot"
        );
        assert_eq!(
            objects.transfers[0].spec.tags,
            BTreeMap::from([
                ("team".to_string(), "payments".to_string()),
                ("weekly".to_string(), String::new())
            ])
        );
        assert_eq!(
            objects.transfers[0].spec.parent_policy,
            haulage_api::backup::ParentPolicy::Full
        );
        let security = objects.pod.spec.as_ref().expect("spec").containers[0]
            .security_context
            .clone()
            .expect("security context");
        assert_eq!(
            (security.run_as_user, security.run_as_non_root),
            (Some(1000), Some(true)),
            "spec.agentUser runs the agent as that uid"
        );
    }

    #[test]
    fn a_stage_pod_in_the_cache_is_not_created_again_nor_one_whose_volumes_are_all_final() {
        let backup = owned_and_planned(&["db"]);
        let mut seen = observation(backup.clone());
        seen.staging.pods = vec![stage_pod(&backup, "Running")];
        assert!(!needs_credentials(&seen, &at(0)).expect("decided"));
        let acts_running = acts(decide(&seen, &at(5)).expect("decided"));
        assert!(
            acts_running.actions.is_empty(),
            "{:?}",
            acts_running.actions
        );

        let mut finished = observation(backup.clone());
        finished.staging.transfers = vec![transfer_of(&backup, "db", VolumeTransferPhase::Failed)];
        assert!(!needs_credentials(&finished, &at(0)).expect("decided"));
        let decided = acts(decide(&finished, &at(5)).expect("decided"));
        assert!(
            !decided
                .actions
                .iter()
                .any(|action| matches!(action, Action::CreateStagePod(_)))
        );
    }

    #[test]
    fn a_pod_whose_volumes_are_all_final_is_stopped() {
        let backup = owned_and_planned(&["db", "logs"]);
        let mut seen = running(
            &backup,
            &[
                ("db", VolumeTransferPhase::Completed),
                ("logs", VolumeTransferPhase::InProgress),
            ],
        );
        let running = acts(decide(&seen, &at(5)).expect("decided"));
        assert!(running.actions.is_empty());
        seen.staging.transfers[1] = transfer_of(&backup, "logs", VolumeTransferPhase::Failed);
        let done = acts(decide(&seen, &at(6)).expect("decided"));
        assert!(done.actions.iter().any(|action| matches!(
            action,
            Action::DeletePod {
                uid: Some(uid),
                replaced: false,
                ..
            } if uid == "pod-uid-1"
        )));

        // Deleted, the cache lagging: neither stopped nor released again.
        seen.staging.deleted_pods = BTreeSet::from(["pod-uid-1".to_string()]);
        let again = acts(decide(&seen, &at(7)).expect("decided"));
        let deletes_the_pod = |action: &Action| {
            matches!(
                action,
                Action::DeletePod { .. }
                    | Action::ReleaseStagePod(StagePodRelease {
                        delete_pod: true,
                        ..
                    })
            )
        };
        assert!(
            !again
                .actions
                .iter()
                .chain(&again.after_status)
                .any(deletes_the_pod),
            "{:?}",
            again.actions
        );
    }

    #[test]
    fn a_failed_stage_pod_is_recreated_after_its_backoff_recording_the_attempt() {
        let backup = owned_and_planned(&["db"]);
        let mut seen = observation(backup.clone());
        seen.staging.pods = vec![stage_pod(&backup, "Failed")];
        seen.staging.transfers = vec![transfer_of(&backup, "db", VolumeTransferPhase::InProgress)];
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        // No termination time: the backoff counts from now.
        assert!(acts.actions.is_empty(), "{:?}", acts.actions);
        assert_eq!(
            acts.requeue,
            Requeue::After(Duration::from_secs(
                crate::supervision::RECREATE_BACKOFF_SECONDS.unsigned_abs()
            ))
        );
        // The pod says when it failed: past the backoff.
        seen.staging.pods = vec![evicted_pod(&backup)];
        let later = decide(&seen, &at(3600)).expect("decided");
        let acts = self::acts(later);
        assert_eq!(events(&acts.actions), ["StagePodRecreated"]);
        assert!(
            acts.actions
                .iter()
                .any(|action| matches!(action, Action::RecordAttempts { attempts: 1, .. }))
        );
        assert!(acts.actions.iter().any(|action| matches!(
            action,
            Action::DeletePod { uid: Some(uid), replaced: true, .. } if uid == "pod-uid-1"
        )));
    }

    #[test]
    fn a_pod_this_replica_replaced_is_not_judged_again() {
        let backup = owned_and_planned(&["db"]);
        let mut seen = observation(backup.clone());
        seen.staging.pods = vec![evicted_pod(&backup)];
        seen.staging.transfers = vec![transfer_of(&backup, "db", VolumeTransferPhase::InProgress)];
        let first = acts(decide(&seen, &at(3600)).expect("decided"));
        assert_eq!(events(&first.actions), ["StagePodRecreated"]);
        seen.staging.deleted_pods = BTreeSet::from(["pod-uid-1".to_string()]);
        let acts = acts(decide(&seen, &at(3601)).expect("decided"));
        assert!(acts.actions.is_empty(), "{:?}", acts.actions);
    }

    #[test]
    fn a_stage_pod_out_of_attempts_fails_its_open_volumes_with_its_reason() {
        let backup = owned_and_planned(&["db"]);
        let mut seen = observation(backup.clone());
        seen.staging.pods = vec![stage_pod(&backup, "Failed")];
        let mut transfer = (*transfer_of(&backup, "db", VolumeTransferPhase::InProgress)).clone();
        transfer.status.as_mut().expect("status").attempts = Some(2);
        seen.staging.transfers = vec![Arc::new(transfer)];
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        assert_eq!(events(&acts.actions), [reason::STAGE_POD_FAILED]);
        let failed = acts
            .actions
            .iter()
            .find_map(|action| match action {
                Action::WriteTransferStatus { status, .. } => Some(status),
                _ => None,
            })
            .expect("the open transfer is failed");
        assert_eq!(failed.phase, Some(VolumeTransferPhase::Failed));
        assert!(
            failed
                .message
                .clone()
                .unwrap_or_default()
                .contains("failed 3 times")
        );
    }

    #[test]
    fn a_running_agent_that_stopped_reporting_gets_its_pod_recreated() {
        let backup = owned_and_planned(&["db"]);
        let mut seen = observation(backup.clone());
        seen.staging.pods = vec![stage_pod(&backup, "Running")];
        let mut transfer = (*transfer_of(&backup, "db", VolumeTransferPhase::InProgress)).clone();
        transfer.status.as_mut().expect("status").agent = Some(haulage_api::transfer::AgentClaim {
            identity: pod_name_of(&backup),
            claimed_at: at(0),
            heartbeat_time: at(0),
            progress_time: None,
        });
        seen.staging.transfers = vec![Arc::new(transfer)];
        let quiet = acts(decide(&seen, &at(100)).expect("decided"));
        assert!(quiet.actions.is_empty());
        let lost = acts(decide(&seen, &at(3600)).expect("decided"));
        assert_eq!(events(&lost.actions), ["StagePodRecreated"]);
    }

    #[test]
    fn a_progress_only_change_waits_for_the_write_interval_and_a_phase_change_does_not() {
        let backup = owned_and_planned(&["db", "logs"]);
        let mut seen = running(
            &backup,
            &[
                ("db", VolumeTransferPhase::InProgress),
                ("logs", VolumeTransferPhase::InProgress),
            ],
        );
        let first = acts(decide(&seen, &at(0)).expect("decided"));
        let written = first
            .status
            .expect("never written by this replica: written now");
        let mut after = (*seen.backup).clone();
        after.status = Some(written);
        seen.backup = Arc::new(after);
        // Progress moves, two seconds after the last write: held back.
        let mut moving = (*seen.staging.transfers[0]).clone();
        moving.status.as_mut().expect("status").progress = Some(haulage_api::Progress {
            total_bytes: 100,
            bytes_done: 40,
            ..haulage_api::Progress::default()
        });
        seen.staging.transfers[0] = Arc::new(moving);
        seen.staging.since_last_status_write = Some(Duration::from_secs(2));
        let held = acts(decide(&seen, &at(2)).expect("decided"));
        assert_eq!(held.status, None);
        assert_eq!(held.requeue, Requeue::After(Duration::from_secs(3)));
        // Past the interval: written.
        seen.staging.since_last_status_write = Some(PROGRESS_WRITE_INTERVAL);
        assert!(
            acts(decide(&seen, &at(5)).expect("decided"))
                .status
                .is_some()
        );
        // A volume finishing changes a condition's reason? No: the counts
        // only; a backup finishing changes the phase: written at once.
        seen.staging.since_last_status_write = Some(Duration::from_secs(1));
        seen.staging.transfers = vec![
            transfer_of(&backup, "db", VolumeTransferPhase::Completed),
            transfer_of(&backup, "logs", VolumeTransferPhase::Completed),
        ];
        let finished = acts(decide(&seen, &at(6)).expect("decided"));
        let status = finished.status.expect("a phase change is written at once");
        assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
        assert!(finished.finished);
        assert_eq!(events(&finished.after_status), ["Completed"]);
        assert!(
            finished
                .actions
                .iter()
                .chain(&finished.after_status)
                .any(|action| matches!(
                    action,
                    Action::DeletePod { .. }
                        | Action::ReleaseStagePod(StagePodRelease {
                            delete_pod: true,
                            ..
                        })
                ))
        );
    }

    /// The Role of `backup`'s stage pod, as the cache shows it.
    fn stage_role(backup: &VolumeBackup) -> Arc<Role> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": pod_name_of(backup), "namespace": "shop", "uid": "role-uid-1",
                    "labels": {OWNER_UID_LABEL: "uid-nightly"}},
            }))
            .expect("valid role"),
        )
    }

    fn releases(actions: &[Action]) -> Vec<&StagePodRelease> {
        actions
            .iter()
            .filter_map(|action| match action {
                Action::ReleaseStagePod(release) => Some(release),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_finished_backup_releases_what_the_caches_show_is_left_of_its_stage_pods_once() {
        let backup = owned_and_planned(&["db"]).with_phase(VolumeBackupPhase::Completed);
        let mut seen = observation(backup.clone());
        let finished = |seen: &BackupObservation| {
            let BackupDecision::Finished { release } = decide(seen, &at(0)).expect("decided")
            else {
                panic!("final");
            };
            release
        };
        assert!(
            finished(&seen).is_empty(),
            "nothing left: nothing to release"
        );

        seen.staging.pods = vec![stage_pod(&backup, "Succeeded")];
        seen.staging.roles = vec![stage_role(&backup)];
        let release = finished(&seen);
        assert_eq!(
            releases(&release),
            [&StagePodRelease {
                pod: ObjectName::new("shop", pod_name_of(&backup)),
                delete_pod: true,
                pod_uid: Some("pod-uid-1".to_string()),
                delete_access: true,
                role_uid: Some("role-uid-1".to_string()),
            }]
        );

        // The pod deleted by this replica already, the cache not showing
        // it yet: its access only, the pod not deleted twice.
        seen.staging.deleted_pods = BTreeSet::from(["pod-uid-1".to_string()]);
        assert_eq!(
            releases(&finished(&seen)),
            [&StagePodRelease {
                pod: ObjectName::new("shop", pod_name_of(&backup)),
                delete_pod: false,
                pod_uid: None,
                delete_access: true,
                role_uid: Some("role-uid-1".to_string()),
            }]
        );
        seen.staging.deleted_pods = BTreeSet::new();

        // The pod on its way out and its Role released (this replica
        // leaves a Role it released out of the observation): nothing,
        // however often the pod's changes wake the backup.
        let mut leaving = (*stage_pod(&backup, "Succeeded")).clone();
        leaving.metadata.deletion_timestamp = Some(at(0));
        seen.staging.pods = vec![Arc::new(leaving)];
        seen.staging.roles = Vec::new();
        assert!(finished(&seen).is_empty(), "{:?}", finished(&seen));

        // A release cut short left the Role: its access is released again,
        // the pod is not deleted twice.
        seen.staging.roles = vec![stage_role(&backup)];
        let release = finished(&seen);
        let release = releases(&release);
        assert_eq!(release.len(), 1);
        assert!(!release[0].delete_pod && release[0].delete_access);
    }

    #[test]
    fn a_backup_that_finishes_now_deletes_each_stage_pod_once_and_releases_its_access_once() {
        let backup = owned_and_planned(&["db"]);
        let mut seen = running(&backup, &[("db", VolumeTransferPhase::Completed)]);
        seen.staging.roles = vec![stage_role(&backup)];
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let pod = ObjectName::new("shop", pod_name_of(&backup));
        let pod_deletes = acts
            .actions
            .iter()
            .chain(&acts.after_status)
            .filter(|action| match action {
                Action::DeletePod { pod: deleted, .. } => deleted == &pod,
                Action::ReleaseStagePod(release) => release.pod == pod && release.delete_pod,
                _ => false,
            })
            .count();
        assert_eq!(pod_deletes, 1, "{acts:?}");
        let release = releases(&acts.after_status);
        assert_eq!(release.len(), 1, "{acts:?}");
        assert!(release[0].delete_access);
    }

    #[test]
    fn cancel_marks_open_transfers_canceled_releases_pods_and_deletes_every_transfer() {
        let backup = owned_and_planned(&["db", "logs"]);
        let seen = running(
            &backup,
            &[
                ("db", VolumeTransferPhase::Completed),
                ("logs", VolumeTransferPhase::InProgress),
            ],
        );
        let actions = decide_cancel(&seen, &at(0));
        let canceled: Vec<&ObjectName> = actions
            .iter()
            .filter_map(|action| match action {
                Action::WriteTransferStatus { transfer, status }
                    if status.phase == Some(VolumeTransferPhase::Canceled) =>
                {
                    Some(transfer)
                }
                _ => None,
            })
            .collect();
        assert_eq!(canceled.len(), 1, "only the open one");
        assert_eq!(canceled[0].name, "nightly-logs");
        let release = actions
            .iter()
            .position(|action| matches!(action, Action::ReleaseStagePod(_)))
            .expect("released");
        let deletes: Vec<usize> = actions
            .iter()
            .enumerate()
            .filter(|(_, action)| matches!(action, Action::DeleteTransfer(_)))
            .map(|(index, _)| index)
            .collect();
        assert_eq!(deletes.len(), 2);
        assert!(
            deletes.iter().all(|index| *index > release),
            "pods go first"
        );
    }

    #[test]
    fn an_unknown_selector_operator_is_refused_naming_the_backup() {
        let mut backup = VolumeBackup::test("nightly");
        backup.spec.selector = Some(
            serde_json::from_value(serde_json::json!({
                "matchExpressions": [{"key": "tier", "operator": "Near", "values": ["db"]}]
            }))
            .expect("selector"),
        );
        let mut seen = observation(backup);
        seen.cluster = Some(cluster_with_one_claim());
        let error = decide(&seen, &at(0)).expect_err("refused");
        assert!(error.to_string().contains("nightly"), "{error}");
        assert!(error.to_string().contains("Near"), "{error}");
    }

    #[test]
    fn the_volume_counts_follow_the_transfers() {
        let backup = owned_and_planned(&["db", "logs"]);
        let seen = running(&backup, &[("db", VolumeTransferPhase::Completed)]);
        let status = acts(decide(&seen, &at(0)).expect("decided"))
            .status
            .expect("written");
        assert_eq!(
            status.volumes,
            Some(VolumeCounts {
                total: 2,
                pending: 1,
                completed: 1,
                ..VolumeCounts::default()
            })
        );
    }

    #[test]
    fn a_stage_pod_gets_its_storage_policys_resources_and_its_namespaces_limit_range_minimum() {
        let mut seen = observation(VolumeBackup::test("nightly"));
        seen.cluster = Some(cluster_with_one_claim());
        seen.staging.credentials = Some(ByteString(b"[default]".to_vec()));
        seen.claim_records = BTreeMap::from([(
            ("shop".to_string(), "db".to_string()),
            haulage_repo::snapshot::ClaimRecord {
                namespace: "shop".to_string(),
                name: "db".to_string(),
                storage_class: Some("fast".to_string()),
                provisioner: Some("example.com/fast".to_string()),
                ..Default::default()
            },
        )]);
        let mut policy = haulage_api::StoragePolicy::test("fast-storage");
        policy.spec.storage_class_names = vec!["fast".to_string()];
        policy.spec.stage_pod_resources = Some(
            serde_json::from_value(serde_json::json!({
                "requests": {"cpu": "500m", "memory": "256Mi"}
            }))
            .expect("resources"),
        );
        seen.staging.policies = vec![Arc::new(policy)];
        seen.staging.limit_minimums = BTreeMap::from([(
            "shop".to_string(),
            haulage_plan::facts::ResourceMinimum {
                cpu_millis: Some(750),
                memory_bytes: None,
            },
        )]);
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let [Action::CreateStagePod(objects)] = &acts.actions[..] else {
            panic!("one stage pod: {:?}", acts.actions);
        };
        let requests = objects.pod.spec.as_ref().expect("spec").containers[0]
            .resources
            .as_ref()
            .and_then(|resources| resources.requests.clone())
            .expect("requests");
        assert_eq!(requests["memory"].0, "256Mi", "the policy's memory");
        assert_eq!(
            requests["cpu"].0, "750m",
            "raised to the LimitRange minimum"
        );
    }

    #[test]
    fn a_selected_claim_still_binding_holds_the_plan_for_a_grace_period_then_is_unplaceable() {
        let mut cluster = cluster_with_one_claim();
        let claim = &mut cluster.claims[0];
        claim.status.as_mut().expect("status").phase = Some("Pending".to_string());
        claim.spec.as_mut().expect("spec").volume_name = None;
        claim.metadata.creation_timestamp = Some(at(0));
        let mut seen = observation(VolumeBackup::test("nightly"));
        seen.cluster = Some(cluster);
        let waiting = acts(decide(&seen, &at(10)).expect("decided"));
        let status = waiting.status.expect("written");
        assert_eq!(status.phase, Some(VolumeBackupPhase::Planning));
        assert_eq!(status.plan, None);
        assert!(
            status.message.unwrap_or_default().contains("shop/db"),
            "the waiting claim is named"
        );
        let later = acts(decide(&seen, &at(CLAIM_BINDING_GRACE_SECONDS + 1)).expect("decided"));
        let plan = later
            .status
            .expect("written")
            .plan
            .expect("planned after the grace");
        assert_eq!(plan.unplaceable.len(), 1);
    }

    fn with_policy(
        mut backup: VolumeBackup,
        policy: haulage_api::backup::DeletionPolicy,
        finalizers: &[&str],
    ) -> VolumeBackup {
        backup.spec.deletion_policy = policy;
        backup.metadata.finalizers = (!finalizers.is_empty())
            .then(|| finalizers.iter().map(|name| name.to_string()).collect());
        backup
    }

    fn deleted(mut backup: VolumeBackup) -> VolumeBackup {
        backup.metadata.deletion_timestamp = Some(at(0));
        backup
    }

    #[test]
    fn a_delete_policy_adds_the_forget_finalizer_and_retain_removes_it() {
        use haulage_api::backup::DeletionPolicy::{Delete, Retain};
        use haulage_api::labels::{CANCEL_FINALIZER, FORGET_FINALIZER};
        let locations = vec![available("s3")];
        let decide_on =
            |backup: VolumeBackup| decide_lifecycle(&backup, &locations, &at(0)).expect("decided");
        assert_eq!(
            decide_on(with_policy(
                VolumeBackup::test("nightly"),
                Delete,
                &[CANCEL_FINALIZER]
            )),
            Lifecycle::AddFinalizer
        );
        assert_eq!(
            decide_on(with_policy(
                VolumeBackup::test("nightly"),
                Delete,
                &[CANCEL_FINALIZER, FORGET_FINALIZER]
            )),
            Lifecycle::Continue { ttl_left: None }
        );
        assert_eq!(
            decide_on(with_policy(VolumeBackup::test("nightly"), Retain, &[])),
            Lifecycle::Continue { ttl_left: None }
        );
        // Changed back to Retain, before or during the deletion: let go.
        assert_eq!(
            decide_on(with_policy(
                VolumeBackup::test("nightly"),
                Retain,
                &[FORGET_FINALIZER]
            )),
            Lifecycle::RemoveFinalizer
        );
        assert_eq!(
            decide_on(deleted(with_policy(
                VolumeBackup::test("nightly"),
                Retain,
                &[FORGET_FINALIZER]
            ))),
            Lifecycle::RemoveFinalizer
        );
    }

    #[test]
    fn a_deleted_backup_with_a_delete_policy_is_canceled_first_then_forgets_from_its_location() {
        use haulage_api::backup::DeletionPolicy::{Delete, Retain};
        use haulage_api::labels::{CANCEL_FINALIZER, FORGET_FINALIZER};
        let locations = vec![available("s3")];
        let canceling = deleted(with_policy(
            VolumeBackup::test("nightly"),
            Delete,
            &[CANCEL_FINALIZER, FORGET_FINALIZER],
        ));
        assert_eq!(
            decide_lifecycle(&canceling, &locations, &at(0)).expect("decided"),
            Lifecycle::Continue { ttl_left: None },
            "the cancel (stage pods, transfers) goes first"
        );
        let canceled = deleted(with_policy(
            VolumeBackup::test("nightly"),
            Delete,
            &[FORGET_FINALIZER],
        ));
        assert_eq!(
            decide_lifecycle(&canceled, &locations, &at(0)).expect("decided"),
            Lifecycle::Forget {
                backup: format!("{SYSTEM}/nightly"),
                location: "s3".to_string(),
            }
        );
        // Without the finalizer (added too late, or Retain) nothing is forgotten.
        let retained = deleted(with_policy(VolumeBackup::test("nightly"), Retain, &[]));
        assert_eq!(
            decide_lifecycle(&retained, &locations, &at(0)).expect("decided"),
            Lifecycle::Continue { ttl_left: None }
        );
        // The location is gone: say so, keep the finalizer.
        match decide_lifecycle(&canceled, &[], &at(0)).expect("decided") {
            Lifecycle::ForgetBlocked { problem } => {
                assert!(
                    problem.contains("s3") && problem.contains("does not exist"),
                    "{problem}"
                )
            }
            other => panic!("expected the forget to be blocked, got {other:?}"),
        }
    }

    #[test]
    fn a_backup_of_the_default_location_keeps_it_when_another_becomes_the_default() {
        use haulage_api::backup::DeletionPolicy::Delete;
        use haulage_api::labels::FORGET_FINALIZER;
        // Planned while `old` was the default; `new` is the default now.
        let mut backup = owned_and_planned(&["db"]);
        backup.spec.storage_location = None;
        backup.status.as_mut().expect("status").storage_location = Some("old".to_string());
        let locations = vec![
            available_default("old", false),
            available_default("new", true),
        ];
        let (_, location) = resolve_location(&backup, &locations);
        assert_eq!(location.map(ResourceExt::name_any).as_deref(), Some("old"));
        // Deleted with Delete: its snapshots are forgotten where they are.
        let deleted = deleted(with_policy(backup, Delete, &[FORGET_FINALIZER]));
        assert_eq!(
            decide_lifecycle(&deleted, &locations, &at(0)).expect("decided"),
            Lifecycle::Forget {
                backup: format!("{SYSTEM}/nightly"),
                location: "old".to_string(),
            }
        );
        // Recorded but gone: blocked, naming it, never another location.
        match decide_lifecycle(&deleted, &[available_default("new", true)], &at(0))
            .expect("decided")
        {
            Lifecycle::ForgetBlocked { problem } => {
                assert!(problem.contains("old"), "{problem}")
            }
            other => panic!("expected the forget to be blocked, got {other:?}"),
        }
    }

    const SYSTEM: &str = haulage_api::labels::SYSTEM_NAMESPACE;

    #[test]
    fn a_finished_backup_is_deleted_when_its_ttl_is_over_and_looked_at_again_when_it_will_be() {
        let mut backup = VolumeBackup::test("nightly").with_phase(VolumeBackupPhase::Completed);
        backup.spec.ttl = Some("1h".to_string());
        backup.status.as_mut().expect("status").completion_time = Some(at(100));
        let locations = vec![available("s3")];
        assert_eq!(
            decide_lifecycle(&backup, &locations, &at(100 + 3599)).expect("decided"),
            Lifecycle::Continue {
                ttl_left: Some(Duration::from_secs(1))
            }
        );
        match decide_lifecycle(&backup, &locations, &at(100 + 3600)).expect("decided") {
            Lifecycle::Expired { event } => {
                assert_eq!(event.reason, reason::TTL_EXPIRED);
                assert!(event.note.contains("snapshots are kept"), "{}", event.note);
            }
            other => panic!("expected the backup to expire, got {other:?}"),
        }
        // A running backup does not expire, however old.
        let mut running = backup.clone().with_phase(VolumeBackupPhase::InProgress);
        running.status.as_mut().expect("status").completion_time = None;
        assert_eq!(
            decide_lifecycle(&running, &locations, &at(100_000)).expect("decided"),
            Lifecycle::Continue { ttl_left: None }
        );
        // Nor one without a ttl.
        backup.spec.ttl = None;
        assert_eq!(
            decide_lifecycle(&backup, &locations, &at(100_000)).expect("decided"),
            Lifecycle::Continue { ttl_left: None }
        );
    }

    #[test]
    fn a_failed_forget_keeps_the_status_and_says_what_went_wrong_and_what_to_do() {
        let backup = owned_and_planned(&["db"]).with_phase(VolumeBackupPhase::Completed);
        let (status, event) = forget_failed(&backup, Some("s3"), "endpoint unreachable", &at(5));
        let condition = find_condition(&status.conditions, condition_type::SNAPSHOTS_FORGOTTEN)
            .expect("condition");
        assert_eq!(condition.reason, reason::FORGET_FAILED);
        for needle in [
            "VolumeBackup haulage-system/nightly",
            "BackupStorageLocation s3",
            "endpoint unreachable",
            "deletionPolicy: Retain",
        ] {
            assert!(
                condition.message.contains(needle),
                "{needle}: {}",
                condition.message
            );
        }
        assert_eq!(event.reason, reason::FORGET_FAILED);
        // Everything else of the status is kept (it is applied whole).
        let old = backup.status.clone().expect("status");
        assert_eq!(status.plan, old.plan);
        assert_eq!(status.phase, old.phase);
        assert_eq!(status.owner, old.owner);
    }
}
