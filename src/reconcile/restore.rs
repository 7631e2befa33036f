//! The VolumeRestore decisions. Like a backup's ([`crate::backup`]), in
//! one function of what the controller observed and the time:
//!
//! 1. ownership (keep, claim, adopt, wait) and the storage location;
//! 2. **selection**, once, from the location's snapshots (the controller
//!    lists them only while there is none): which snapshots
//!    ([`select_snapshots`]: a source VolumeBackup, namespaces and a label
//!    selector, latest per claim; or explicit ids), and the destination
//!    claim of each ([`crate::claims::destination_of`]). A spec that cannot
//!    be carried out is refused before anything is written, naming what
//!    is wrong: a snapshot id not in the location, a storage class missing
//!    here, two snapshots mapped to one claim, a namespace missing here, a
//!    claim that exists with `existingClaim: Fail`;
//! 3. the destination namespaces (when asked) and claims, created complete
//!    and labelled `incomplete` until verified;
//! 4. the plan, once every claim is ready for it (bound, or waiting for
//!    its first consumer): the planner's restore rules
//!    ([`haulage_plan::plan_restore`]);
//! 5. stage pods and their Download transfers, supervised as a backup's;
//! 6. each verified claim labelled `complete`, and a ReadOnlyMany claim
//!    handed back ([`handback`]);
//! 7. the next status, the progress-write throttle, the release of the
//!    stage pods when final, and on deletion the cancel.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use haulage_api::backup::{BackupPlan, OwnerClaim, VolumeCounts};
use haulage_api::condition::{ConditionStatus, bounded_message, condition_type, reason};
use haulage_api::restore::{
    ClaimAction, ExistingClaimPolicy, RestoreResult, RestoreVolume, VolumeRestore,
    VolumeRestorePhase, VolumeRestoreStatus,
};
use haulage_api::{BackupStorageLocation, Progress, VolumeTransfer, VolumeTransferPhase};
use haulage_plan::facts::BindingMode;
use haulage_plan::objects::{ClusterObjects, DumpError, facts_from_objects};
use haulage_plan::{LabelSelector, PlanError, RestoreClaim, plan_restore};
use haulage_repo::snapshot::{ClaimRecord, Snapshot};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::action::{Action, ClaimChange, ObjectName, Requeue};
use crate::backup::{RECHECK_SECONDS, label_selector_of};
use crate::backup_status::{Conditions, FinalCounts, StorageState};
use crate::claims::{
    RESTORE_COMPLETE, RESTORE_INCOMPLETE, RESTORE_STATE_LABEL, RESTORED_FROM_ANNOTATION,
    destination_claim, destination_of,
};
use crate::location::resolve_kept_location;
use crate::ownership::{Decision, OwnerActs, Ownership};
use crate::stage_pod::{
    Operation, Owner, StagePodTemplate, TransferDetails, credentials_copy, status_plan,
};
use crate::staging::{StagingObservation, StatusStanding, after_final_status, status_to_write};
use crate::supervision::transfers_of;

/// How soon a restore whose claims are not ready for planning (an
/// Immediate class still binding) is looked at again.
const CLAIMS_BINDING_RETRY_SECONDS: u64 = 5;
/// How soon a restore that could not read its location's snapshots tries
/// again.
const SNAPSHOT_LIST_RETRY_SECONDS: u64 = 30;

/// One snapshot of the location, as the controller listed it.
#[derive(Debug, Clone, PartialEq)]
pub struct ListedSnapshot {
    /// Its id (64 hex characters).
    pub id: String,
    /// The manifest.
    pub snapshot: Snapshot,
}

/// What one reconcile of a VolumeRestore read.
#[derive(Debug, Clone)]
pub struct RestoreObservation {
    /// The restore as the cache shows it.
    pub restore: Arc<VolumeRestore>,
    /// What a restore's reconcile reads like a backup's: this replica's
    /// standing, the locations of the restore's namespace, its stage pods
    /// and transfers, and what a new stage pod is built from.
    pub staging: StagingObservation,
    /// The location's snapshots (or why they could not be read), listed
    /// only while the restore has no selection ([`needs_snapshots`]).
    pub snapshots: Option<Result<Vec<ListedSnapshot>, String>>,
    /// This cluster's storage classes.
    pub classes: Vec<Arc<StorageClass>>,
    /// Names of this cluster's namespaces.
    pub namespaces: BTreeSet<String>,
    /// The claims of the destination namespaces.
    pub claims: Vec<Arc<PersistentVolumeClaim>>,
    /// The volumes bound to those claims (for a hand-back).
    pub volumes: Vec<Arc<PersistentVolume>>,
    /// The cluster's objects, read only while there is no plan.
    pub cluster: Option<ClusterObjects>,
}

/// A restore that cannot be decided on (permanent until someone changes
/// the spec or the cluster).
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// A required metadata field is empty.
    #[error("the VolumeRestore has no {field}")]
    MissingField {
        /// The field.
        field: &'static str,
    },
    /// The caches hold an object the planner cannot read.
    #[error("cannot turn the cluster's objects into planner facts")]
    Facts {
        /// Which object and why.
        #[source]
        source: DumpError,
    },
    /// The planner refused the facts.
    #[error("cannot plan the stage pods")]
    Plan {
        /// Why.
        #[source]
        source: PlanError,
    },
}

/// What a reconcile of a VolumeRestore does.
pub type RestoreDecision = Decision<VolumeRestoreStatus>;

/// The owner's actions for one reconcile of a VolumeRestore.
pub type RestoreActs = OwnerActs<VolumeRestoreStatus>;

/// The owner of a restore's children.
pub fn owner_of(restore: &VolumeRestore) -> Result<Owner, RestoreError> {
    Owner::of(restore).map_err(|field| RestoreError::MissingField { field })
}

fn is_final(restore: &VolumeRestore) -> bool {
    restore
        .status
        .as_ref()
        .and_then(|status| status.phase)
        .is_some_and(VolumeRestorePhase::is_final)
}

/// Whether the controller must list the location's snapshots: only while
/// no selection is made.
pub fn needs_snapshots(restore: &VolumeRestore) -> bool {
    !is_final(restore)
        && restore
            .status
            .as_ref()
            .is_none_or(|status| status.selection.is_empty())
}

/// Whether the decision needs the cluster's objects: only while there is
/// no plan.
pub fn needs_cluster(restore: &VolumeRestore) -> bool {
    !is_final(restore)
        && restore
            .status
            .as_ref()
            .is_none_or(|status| status.plan.is_none())
}

/// Why a selection cannot be made: the restore is refused with this
/// reason and message, before anything is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The condition reason.
    pub reason: &'static str,
    /// What is wrong and what to do.
    pub message: String,
}

fn refuse(reason: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        message: message.into(),
    }
}

/// The snapshots the spec selects among `listed`: explicit ids (unique
/// prefixes of at least 8 characters), or the latest snapshot of each
/// claim recorded by the named VolumeBackup and/or in the named namespaces
/// whose labels match the selector.
pub fn select_snapshots<'a>(
    restore: &VolumeRestore,
    listed: &'a [ListedSnapshot],
) -> Result<Vec<&'a ListedSnapshot>, Refusal> {
    let source = &restore.spec.source;
    if !source.snapshots.is_empty() {
        let mut chosen = Vec::new();
        for wanted in &source.snapshots {
            let matching: Vec<&ListedSnapshot> = listed
                .iter()
                .filter(|snapshot| snapshot.id.starts_with(wanted.as_str()))
                .collect();
            match matching[..] {
                [one] if one.snapshot.claim.is_some() => chosen.push(one),
                [one] => {
                    return Err(refuse(
                        reason::SNAPSHOT_NOT_FOUND,
                        format!(
                            "snapshot {} of {} has no claim record (a backup of a directory, or by a haulage before 0.2): it cannot be restored into a claim; use `haulage restore` for it",
                            &one.id[..16.min(one.id.len())],
                            one.snapshot.source
                        ),
                    ));
                }
                [] => {
                    return Err(refuse(
                        reason::SNAPSHOT_NOT_FOUND,
                        format!(
                            "snapshot {wanted} is not in the storage location: list them with `haulage snapshots --repo <the location's URL>`"
                        ),
                    ));
                }
                _ => {
                    return Err(refuse(
                        reason::SNAPSHOT_NOT_FOUND,
                        format!(
                            "{wanted} names {} snapshots: give more of the id",
                            matching.len()
                        ),
                    ));
                }
            }
        }
        return Ok(chosen);
    }
    let labels = label_selector_of(source.selector.as_ref())
        .map_err(|message| {
            refuse(
                reason::INVALID_SPEC,
                format!("spec.source.selector: {message}"),
            )
        })?
        .unwrap_or_else(LabelSelector::default);
    let backup_matches = |record: &ClaimRecord| {
        source
            .backup
            .as_deref()
            .is_none_or(|wanted| record.is_from_backup(wanted))
    };
    let mut latest: BTreeMap<(String, String), &ListedSnapshot> = BTreeMap::new();
    for snapshot in listed {
        let Some(record) = &snapshot.snapshot.claim else {
            continue;
        };
        let in_namespaces =
            source.namespaces.is_empty() || source.namespaces.contains(&record.namespace);
        if !(backup_matches(record) && in_namespaces && labels.matches(&record.labels)) {
            continue;
        }
        let key = (record.namespace.clone(), record.name.clone());
        let newer = latest.get(&key).is_none_or(|current| {
            (&snapshot.snapshot.time, &snapshot.id) > (&current.snapshot.time, &current.id)
        });
        if newer {
            latest.insert(key, snapshot);
        }
    }
    if latest.is_empty() {
        return Err(refuse(
            reason::NO_SNAPSHOTS_SELECTED,
            "no snapshot of the storage location matches spec.source: check the backup's name, the namespaces and the selector (`haulage snapshots --repo <the location's URL> -o json` lists what it holds)",
        ));
    }
    Ok(latest.into_values().collect())
}

/// The selection: each snapshot's destination, or why the restore is
/// refused. Claims this restore created already (a reconcile that created
/// them and then failed to write its status) count as its own.
pub fn make_selection(
    observation: &RestoreObservation,
    listed: &[ListedSnapshot],
    owner: &Owner,
) -> Result<Vec<RestoreVolume>, Refusal> {
    let restore = &observation.restore;
    let spec = &restore.spec;
    let chosen = select_snapshots(restore, listed)?;
    let classes: Vec<&StorageClass> = observation.classes.iter().map(Arc::as_ref).collect();
    let mut volumes = Vec::with_capacity(chosen.len());
    let mut destinations: BTreeMap<(String, String), String> = BTreeMap::new();
    for listed in chosen {
        let Some(record) = &listed.snapshot.claim else {
            continue;
        };
        let data_bytes = listed.snapshot.summary.total_bytes;
        let destination = destination_of(record, data_bytes, spec, &classes)
            .map_err(|error| refuse(reason::STORAGE_CLASS_NOT_FOUND, error.to_string()))?;
        let source = format!("{}/{}", record.namespace, record.name);
        let key = (destination.namespace.clone(), destination.name.clone());
        if let Some(other) = destinations.insert(key.clone(), source.clone()) {
            return Err(refuse(
                reason::DESTINATION_COLLISION,
                format!(
                    "{other} and {source} would both be restored into {}/{}: change spec.namespaceMap so each source namespace has its own destination",
                    key.0, key.1
                ),
            ));
        }
        if !spec.create_namespaces && !observation.namespaces.contains(&destination.namespace) {
            return Err(refuse(
                reason::NAMESPACE_NOT_FOUND,
                format!(
                    "namespace {} (for {source}) does not exist on this cluster: create it, map it with spec.namespaceMap, or set spec.createNamespaces: true",
                    destination.namespace
                ),
            ));
        }
        let existing = observation.claims.iter().find(|claim| {
            claim.namespace().as_deref() == Some(destination.namespace.as_str())
                && claim.name_any() == destination.name
        });
        let ours = existing.is_some_and(|claim| {
            claim
                .labels()
                .get(haulage_api::labels::OWNER_UID_LABEL)
                .map(String::as_str)
                == Some(owner.uid.as_str())
        });
        let action = match (existing, ours, spec.existing_claim) {
            (None, _, _) | (Some(_), true, _) => ClaimAction::Create,
            (Some(_), false, ExistingClaimPolicy::Sync) => ClaimAction::Sync,
            (Some(_), false, ExistingClaimPolicy::Skip) => ClaimAction::Skip,
            (Some(_), false, ExistingClaimPolicy::Fail) => {
                return Err(refuse(
                    reason::CLAIM_EXISTS,
                    format!(
                        "claim {}/{} (for {source}) already exists: delete it, set spec.existingClaim: Sync to write only the differences into it, or Skip to leave it",
                        destination.namespace, destination.name
                    ),
                ));
            }
        };
        volumes.push(RestoreVolume {
            snapshot_id: listed.id.clone(),
            source,
            namespace: destination.namespace,
            pvc: destination.name,
            storage_class: destination.storage_class,
            access_modes: destination.access_modes,
            final_access_modes: destination.final_access_modes,
            volume_mode: destination.volume_mode,
            request_bytes: destination.request_bytes,
            data_bytes,
            action,
            labels: record.labels.clone(),
            annotations: record.annotations.clone(),
        });
    }
    volumes.sort_by(|a, b| (&a.namespace, &a.pvc).cmp(&(&b.namespace, &b.pvc)));
    Ok(volumes)
}

fn claim_of<'a>(
    observation: &'a RestoreObservation,
    namespace: &str,
    name: &str,
) -> Option<&'a Arc<PersistentVolumeClaim>> {
    observation
        .claims
        .iter()
        .find(|claim| claim.namespace().as_deref() == Some(namespace) && claim.name_any() == name)
}

fn record_of(volume: &RestoreVolume) -> ClaimRecord {
    ClaimRecord {
        namespace: volume.namespace.clone(),
        name: volume.pvc.clone(),
        labels: volume.labels.clone(),
        annotations: volume.annotations.clone(),
        ..ClaimRecord::default()
    }
}

/// The namespaces and claims to create now.
fn claims_to_create(
    observation: &RestoreObservation,
    selection: &[RestoreVolume],
    owner: &Owner,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut namespaces = BTreeSet::new();
    for volume in selection
        .iter()
        .filter(|volume| volume.action == ClaimAction::Create)
    {
        if claim_of(observation, &volume.namespace, &volume.pvc).is_some() {
            continue;
        }
        // Written already: a ReadOnlyMany claim missing now is between the
        // two claims of its hand-back, which creates the next one itself
        // (creating the ReadWriteOnce claim again would bind a new, empty
        // volume and start the hand-back over, for ever).
        let written = transfer_for(observation, &volume.namespace, &volume.pvc)
            .is_some_and(|transfer| transfer.phase() == VolumeTransferPhase::Completed);
        if written && !volume.final_access_modes.is_empty() {
            continue;
        }
        if observation.restore.spec.create_namespaces
            && !observation.namespaces.contains(&volume.namespace)
            && namespaces.insert(volume.namespace.clone())
        {
            actions.push(Action::CreateNamespace(volume.namespace.clone()));
        }
        let destination = crate::claims::Destination {
            namespace: volume.namespace.clone(),
            name: volume.pvc.clone(),
            storage_class: volume.storage_class.clone(),
            access_modes: volume.access_modes.clone(),
            final_access_modes: volume.final_access_modes.clone(),
            volume_mode: volume.volume_mode.clone(),
            request_bytes: volume.request_bytes,
        };
        actions.push(Action::CreateClaim(Box::new(destination_claim(
            &destination,
            &record_of(volume),
            &volume.snapshot_id,
            owner,
        ))));
    }
    actions
}

/// Whether every claim to write is ready for planning: in the cache, and
/// bound, or pending on a WaitForFirstConsumer class (the stage pod's node
/// then decides where it is provisioned). A claim of an Immediate class is
/// planned once bound, on its volume's topology.
fn claims_ready(observation: &RestoreObservation, selection: &[RestoreVolume]) -> bool {
    selection
        .iter()
        .filter(|volume| volume.action != ClaimAction::Skip)
        .all(|volume| {
            let Some(claim) = claim_of(observation, &volume.namespace, &volume.pvc) else {
                return false;
            };
            let bound = claim
                .status
                .as_ref()
                .and_then(|status| status.phase.as_deref())
                == Some("Bound");
            bound || waits_for_first_consumer(observation, claim)
        })
}

fn waits_for_first_consumer(
    observation: &RestoreObservation,
    claim: &PersistentVolumeClaim,
) -> bool {
    let class_name = claim
        .spec
        .as_ref()
        .and_then(|spec| spec.storage_class_name.clone())
        .or_else(|| {
            observation
                .classes
                .iter()
                .find(|class| {
                    class
                        .annotations()
                        .get(haulage_plan::objects::DEFAULT_CLASS_ANNOTATION)
                        .map(String::as_str)
                        == Some("true")
                })
                .map(|class| class.name_any())
        });
    class_name.is_some_and(|name| {
        observation
            .classes
            .iter()
            .find(|class| class.name_any() == name)
            .and_then(|class| haulage_plan::objects::storage_class_facts(class).ok())
            .is_some_and(|facts| facts.binding_mode == BindingMode::WaitForFirstConsumer)
    })
}

/// The plan of the claims to write.
fn make_plan(
    selection: &[RestoreVolume],
    owner: &Owner,
    cluster: &ClusterObjects,
) -> Result<BackupPlan, RestoreError> {
    // The planner counts other backups' and restores' stage pods as load
    // on their nodes, and does not let them pin a claim to their node.
    let facts = facts_from_objects(cluster).map_err(|source| RestoreError::Facts { source })?;
    let claims: Vec<RestoreClaim> = selection
        .iter()
        .filter(|volume| volume.action != ClaimAction::Skip)
        .map(|volume| {
            let claim = RestoreClaim::new(&volume.namespace, &volume.pvc, volume.data_bytes);
            match &volume.storage_class {
                Some(class) => claim.with_storage_class(class),
                None => claim,
            }
        })
        .collect();
    let plan = plan_restore(&facts, &claims).map_err(|source| RestoreError::Plan { source })?;
    Ok(status_plan(Operation::Restore, owner, plan))
}

/// Whether [`decide`] will create a stage pod now (so the credentials are
/// read first).
pub fn needs_credentials(observation: &RestoreObservation) -> bool {
    let Some(status) = &observation.restore.status else {
        return false;
    };
    if is_final(&observation.restore) {
        return false;
    }
    status
        .plan
        .as_ref()
        .is_some_and(|plan| !observation.staging.missing_stage_pods(plan).is_empty())
}

/// The stage pods of `plan` to create now, each complete
/// ([`StagingObservation::create_stage_pod`]), after the change that marks
/// each claim to sync as being synced ([`sync_start`]).
fn stage_pods_to_create(
    observation: &RestoreObservation,
    owner: &Owner,
    plan: &BackupPlan,
    selection: &[RestoreVolume],
    location: &BackupStorageLocation,
) -> Vec<Action> {
    let staging = &observation.staging;
    let missing = staging.missing_stage_pods(plan);
    // The credentials are read only when the observed status already has
    // the plan (`needs_credentials`); a plan made in this pass gets its
    // stage pods in the next one, never a copy without credentials.
    let Some(location_credentials) = staging.credentials.clone() else {
        return Vec::new();
    };
    if missing.is_empty() {
        return Vec::new();
    }
    let template = StagePodTemplate {
        fail_after_unavailable_seconds: observation.restore.spec.fail_after_unavailable_seconds,
        ..staging.stage_pod_template(Operation::Restore, owner, location)
    };
    let credentials = credentials_copy(
        &location.spec,
        location_credentials,
        staging.password.clone(),
    );
    let mut actions = Vec::new();
    for planned in missing {
        let volume_of = |pvc: &String| {
            selection
                .iter()
                .find(|volume| volume.namespace == planned.stage.namespace && &volume.pvc == pvc)
        };
        let volumes = planned
            .stage
            .volumes
            .iter()
            .map(|pvc| {
                let volume = volume_of(pvc);
                let (since_snapshot, begin_sync) = volume
                    .map(|volume| sync_start(observation, volume))
                    .unwrap_or_default();
                actions.extend(begin_sync);
                (
                    pvc.clone(),
                    TransferDetails {
                        snapshot: volume.map(|volume| volume.snapshot_id.clone()),
                        since_snapshot,
                        ..TransferDetails::default()
                    },
                )
            })
            .collect();
        let classes: Vec<(String, String)> = planned
            .stage
            .volumes
            .iter()
            .filter_map(|pvc| {
                let class = volume_of(pvc)?.storage_class.clone()?;
                let provisioner = observation
                    .classes
                    .iter()
                    .find(|known| known.name_any() == class)
                    .map(|known| known.provisioner.clone())
                    .unwrap_or_default();
                Some((class, provisioner))
            })
            .collect();
        actions.push(staging.create_stage_pod(
            &template,
            planned,
            &classes,
            credentials.clone(),
            volumes,
        ));
    }
    actions
}

/// A sync's since snapshot — the one its claim holds completely
/// (`restore-state: complete`, `restored-from`), or the one its transfer
/// already names — and the change that marks the claim as being synced
/// before anything is written into it. Nothing for a claim the restore
/// creates.
fn sync_start(
    observation: &RestoreObservation,
    volume: &RestoreVolume,
) -> (Option<String>, Option<Action>) {
    if volume.action != ClaimAction::Sync {
        return (None, None);
    }
    if let Some(transfer) = transfer_for(observation, &volume.namespace, &volume.pvc) {
        return (transfer.spec.since_snapshot.clone(), None);
    }
    let Some(claim) = claim_of(observation, &volume.namespace, &volume.pvc) else {
        return (None, None);
    };
    let state = claim.labels().get(RESTORE_STATE_LABEL).map(String::as_str);
    let holds = claim
        .annotations()
        .get(RESTORED_FROM_ANNOTATION)
        .filter(|snapshot| !snapshot.is_empty());
    let since = holds.filter(|_| state == Some(RESTORE_COMPLETE)).cloned();
    let marked = state == Some(RESTORE_INCOMPLETE)
        && holds.map(String::as_str) == Some(volume.snapshot_id.as_str());
    let begin = (!marked).then(|| Action::ChangeClaim {
        claim: ObjectName::new(&volume.namespace, &volume.pvc),
        change: ClaimChange::BeginSync {
            snapshot: volume.snapshot_id.clone(),
        },
    });
    (since, begin)
}

fn transfer_for<'a>(
    observation: &'a RestoreObservation,
    namespace: &str,
    pvc: &str,
) -> Option<&'a Arc<VolumeTransfer>> {
    observation.staging.transfers.iter().find(|transfer| {
        transfer.namespace().as_deref() == Some(namespace) && transfer.spec.pvc == pvc
    })
}

/// Where a ReadOnlyMany claim is in being handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handback {
    /// Nothing to hand back (not ROX, kept writable, or not written yet).
    NotNeeded,
    /// The next step is under way or done by this action.
    Step,
    /// The ReadOnlyMany claim is bound to the written volume.
    Done,
}

/// The next step of handing a written claim back ReadOnlyMany: keep its
/// volume (`Retain`), replace the ReadWriteOnce claim by a ReadOnlyMany one
/// of the same name bound to the same volume, then give the volume its
/// reclaim policy back. Each step is decided from what the caches show,
/// so an interrupted hand-back goes on where it stopped.
pub fn handback(
    observation: &RestoreObservation,
    volume: &RestoreVolume,
    owner: &Owner,
    actions: &mut Vec<Action>,
) -> Handback {
    if volume.final_access_modes.is_empty() || volume.action == ClaimAction::Skip {
        return Handback::NotNeeded;
    }
    let name = ObjectName::new(&volume.namespace, &volume.pvc);
    let claim = claim_of(observation, &volume.namespace, &volume.pvc);
    let is_final_mode = |claim: &PersistentVolumeClaim| {
        claim
            .spec
            .as_ref()
            .and_then(|spec| spec.access_modes.clone())
            .unwrap_or_default()
            == volume.final_access_modes
    };
    let pv_of = |pv_name: &str| {
        observation
            .volumes
            .iter()
            .find(|pv| pv.name_any() == pv_name)
    };
    match claim {
        Some(claim) if is_final_mode(claim) => {
            let bound = claim
                .status
                .as_ref()
                .and_then(|status| status.phase.as_deref())
                == Some("Bound");
            let pv_name = claim
                .spec
                .as_ref()
                .and_then(|spec| spec.volume_name.clone())
                .unwrap_or_default();
            match pv_of(&pv_name) {
                Some(pv) if bound => {
                    let kept = pv
                        .annotations()
                        .get(crate::claims::RECLAIM_POLICY_ANNOTATION)
                        .cloned();
                    if let Some(policy) = kept {
                        actions.push(Action::ChangeVolume {
                            volume: pv_name,
                            change: crate::action::VolumeChange::RestoreReclaimPolicy(policy),
                        });
                        Handback::Step
                    } else {
                        Handback::Done
                    }
                }
                _ => Handback::Step,
            }
        }
        Some(claim) => {
            // Written through the ReadWriteOnce claim: keep its volume,
            // then delete the claim (its stage pod is gone first, so the
            // claim's protection finalizer lets it go).
            let pv_name = claim
                .spec
                .as_ref()
                .and_then(|spec| spec.volume_name.clone())
                .unwrap_or_default();
            let Some(pv) = pv_of(&pv_name) else {
                return Handback::Step;
            };
            let retained = pv
                .spec
                .as_ref()
                .and_then(|spec| spec.persistent_volume_reclaim_policy.as_deref())
                == Some("Retain");
            if !retained
                || !pv
                    .annotations()
                    .contains_key(crate::claims::RECLAIM_POLICY_ANNOTATION)
            {
                let original = pv
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.persistent_volume_reclaim_policy.clone())
                    .unwrap_or_else(|| "Delete".to_string());
                actions.push(Action::ChangeVolume {
                    volume: pv_name,
                    change: crate::action::VolumeChange::Retain { original },
                });
            } else if claim.metadata.deletion_timestamp.is_none() {
                actions.push(Action::ChangeClaim {
                    claim: name,
                    change: ClaimChange::Delete,
                });
            }
            Handback::Step
        }
        None => {
            // The written claim is gone: free its volume for the new claim
            // and create the ReadOnlyMany claim bound to it.
            let Some(pv) = observation.volumes.iter().find(|pv| {
                pv.spec
                    .as_ref()
                    .and_then(|spec| spec.claim_ref.as_ref())
                    .is_some_and(|reference| {
                        reference.namespace.as_deref() == Some(volume.namespace.as_str())
                            && reference.name.as_deref() == Some(volume.pvc.as_str())
                    })
                    && pv
                        .annotations()
                        .contains_key(crate::claims::RECLAIM_POLICY_ANNOTATION)
            }) else {
                return Handback::Step;
            };
            let pv_name = pv.name_any();
            let still_reserved = pv
                .spec
                .as_ref()
                .and_then(|spec| spec.claim_ref.as_ref())
                .is_some_and(|reference| reference.uid.is_some());
            if still_reserved {
                actions.push(Action::ChangeVolume {
                    volume: pv_name,
                    change: crate::action::VolumeChange::FreeForClaim {
                        namespace: volume.namespace.clone(),
                        name: volume.pvc.clone(),
                    },
                });
            } else {
                let destination = crate::claims::Destination {
                    namespace: volume.namespace.clone(),
                    name: volume.pvc.clone(),
                    storage_class: volume.storage_class.clone(),
                    access_modes: volume.final_access_modes.clone(),
                    final_access_modes: Vec::new(),
                    volume_mode: volume.volume_mode.clone(),
                    request_bytes: volume.request_bytes,
                };
                let mut claim =
                    destination_claim(&destination, &record_of(volume), &volume.snapshot_id, owner);
                claim.labels_mut().insert(
                    RESTORE_STATE_LABEL.to_string(),
                    RESTORE_COMPLETE.to_string(),
                );
                if let Some(spec) = claim.spec.as_mut() {
                    spec.volume_name = Some(pv_name);
                }
                actions.push(Action::CreateClaim(Box::new(claim)));
            }
            Handback::Step
        }
    }
}

/// The claims to label complete, and the hand-backs under way: a volume
/// whose transfer is Completed (verified) counts as done only once its
/// claim is labelled and, for ReadOnlyMany, handed back.
fn finish_volumes(
    observation: &RestoreObservation,
    selection: &[RestoreVolume],
    owner: &Owner,
    actions: &mut Vec<Action>,
) -> BTreeSet<(String, String)> {
    let mut unfinished = BTreeSet::new();
    for volume in selection
        .iter()
        .filter(|volume| volume.action != ClaimAction::Skip)
    {
        let Some(transfer) = transfer_for(observation, &volume.namespace, &volume.pvc) else {
            continue;
        };
        if transfer.phase() != VolumeTransferPhase::Completed {
            continue;
        }
        // Its stage pod goes first: the claim cannot be replaced while
        // mounted.
        let pod_gone = !observation.staging.pods.iter().any(|pod| {
            pod.namespace().as_deref() == Some(volume.namespace.as_str())
                && pod.name_any() == transfer.spec.stage_pod
        });
        let key = (volume.namespace.clone(), volume.pvc.clone());
        if let Some(claim) = claim_of(observation, &volume.namespace, &volume.pvc)
            && claim.labels().get(RESTORE_STATE_LABEL).map(String::as_str)
                == Some(RESTORE_INCOMPLETE)
        {
            actions.push(Action::ChangeClaim {
                claim: ObjectName::new(&volume.namespace, &volume.pvc),
                change: ClaimChange::MarkComplete,
            });
            if !volume.final_access_modes.is_empty() {
                unfinished.insert(key);
            }
            continue;
        }
        if !volume.final_access_modes.is_empty() {
            if !pod_gone {
                unfinished.insert(key);
                continue;
            }
            if handback(observation, volume, owner, actions) == Handback::Step {
                unfinished.insert(key);
            }
        }
    }
    unfinished
}

/// The status's phase and its conditions from the volumes, once planned.
fn roll_up(
    status: &mut VolumeRestoreStatus,
    observation: &RestoreObservation,
    unfinished: &BTreeSet<(String, String)>,
    conditions: &Conditions,
) {
    let selection = status.selection.clone();
    let plan = status.plan.clone().unwrap_or_default();
    let mut results = Vec::with_capacity(selection.len());
    let mut progress = Vec::new();
    let mut phases = Vec::new();
    for volume in &selection {
        let unplaceable = plan
            .unplaceable
            .iter()
            .find(|claim| claim.namespace == volume.namespace && claim.pvc == volume.pvc);
        let transfer = transfer_for(observation, &volume.namespace, &volume.pvc);
        let transfer_status = transfer
            .and_then(|transfer| transfer.status.clone())
            .unwrap_or_default();
        let (phase, message) = if volume.action == ClaimAction::Skip {
            (
                VolumeTransferPhase::Canceled,
                Some("left alone: the claim exists and spec.existingClaim is Skip".to_string()),
            )
        } else if let Some(unplaceable) = unplaceable {
            (
                VolumeTransferPhase::Failed,
                Some(unplaceable.reason.clone()),
            )
        } else {
            let mut phase = transfer.map_or(VolumeTransferPhase::New, |t| t.phase());
            if phase == VolumeTransferPhase::Completed
                && unfinished.contains(&(volume.namespace.clone(), volume.pvc.clone()))
            {
                phase = VolumeTransferPhase::Finalizing;
            }
            (phase, transfer_status.message.clone())
        };
        if let Some(part) = &transfer_status.progress {
            progress.push(part.clone());
        }
        if volume.action != ClaimAction::Skip {
            phases.push(phase);
        }
        results.push(RestoreResult {
            namespace: volume.namespace.clone(),
            pvc: volume.pvc.clone(),
            snapshot_id: volume.snapshot_id.clone(),
            phase,
            bytes_written: transfer_status.bytes_written,
            verified_tree: transfer_status.verified_tree.clone(),
            message: message.map(|message| bounded_message(&message)),
        });
    }
    let counts = VolumeCounts::from_phases(phases);
    status.progress = Some(Progress::sum(&progress));
    status.results = results;
    status.volumes = Some(counts.clone());
    let outcome = FinalCounts::of(&counts).map(|verdict| match verdict {
        FinalCounts::NoVolumes => (
            VolumeRestorePhase::Completed,
            reason::ALL_VOLUMES_COMPLETED,
            "every selected claim exists and is left alone (spec.existingClaim: Skip)".to_string(),
        ),
        FinalCounts::AllCompleted => (
            VolumeRestorePhase::Completed,
            reason::ALL_VOLUMES_COMPLETED,
            format!("all {} volumes restored and verified", counts.total),
        ),
        FinalCounts::NoneCompleted => (
            VolumeRestorePhase::Failed,
            reason::ALL_VOLUMES_FAILED,
            format!("none of the {} volumes was restored", counts.total),
        ),
        FinalCounts::SomeCompleted => (
            VolumeRestorePhase::PartiallyFailed,
            reason::SOME_VOLUMES_FAILED,
            format!(
                "{} of {} volumes restored and verified, {} failed, {} canceled",
                counts.completed, counts.total, counts.failed, counts.canceled
            ),
        ),
    });
    let rolled_up = conditions.roll_up(
        &mut status.conditions,
        &counts,
        outcome,
        [
            VolumeRestorePhase::Completed,
            VolumeRestorePhase::InProgress,
        ],
    );
    status.phase = Some(rolled_up.phase);
    status.message = rolled_up.message;
    if let Some(completion_time) = rolled_up.completion_time {
        status.completion_time = Some(completion_time);
    }
}

/// Release the stage pods whose volumes are all final (so each claim is
/// free for its hand-back, no agent lingers and no copy of the location's
/// credentials stays longer than needed), with what the caches show is
/// left of each, but what `deciding` (this reconcile's supervision)
/// releases or deletes already ([`StagingObservation::release_among`]).
fn release_finished_pods(observation: &RestoreObservation, deciding: &[Action]) -> Vec<Action> {
    let staging = &observation.staging;
    let finished: BTreeSet<ObjectName> = staging
        .stage_pod_names()
        .into_iter()
        .filter(|name| {
            let of_pod = transfers_of(&staging.transfers, &name.namespace, &name.name);
            !of_pod.is_empty() && of_pod.iter().all(|transfer| transfer.phase().is_final())
        })
        .collect();
    staging.release_among(&finished, deciding)
}

/// The storage location of a restore and its state: the one recorded with
/// its selection ([`crate::location::resolve_kept_location`]).
pub fn restore_location<'a>(
    restore: &VolumeRestore,
    locations: &'a [Arc<BackupStorageLocation>],
) -> (StorageState, Option<&'a BackupStorageLocation>) {
    resolve_kept_location(
        &restore.namespace().unwrap_or_default(),
        restore
            .status
            .as_ref()
            .and_then(|status| status.storage_location.as_deref()),
        restore.spec.storage_location.as_deref(),
        locations,
    )
}

/// Decide one reconcile of a VolumeRestore at `now` (pure; carried out in
/// the order of [`RestoreActs`]): who acts, then the steps of the module
/// documentation — [`select`] while there is no selection, the claims to
/// create, [`plan_when_ready`] while there is no plan, [`stage`] once there
/// is one — and [`finish`]: what is written and what follows.
pub fn decide(
    observation: &RestoreObservation,
    now: &Time,
) -> Result<RestoreDecision, RestoreError> {
    let restore = &observation.restore;
    let owner = owner_of(restore)?;
    let old = restore.status.clone().unwrap_or_default();
    let standing = StatusStanding {
        finished: old.phase.is_some_and(VolumeRestorePhase::is_final),
        plan: old.plan.as_ref(),
        owner: old.owner.as_ref(),
        noun: "restore",
    };
    let ownership = match observation.staging.ownership(standing, now) {
        Ok(ownership) => ownership,
        Err(decision) => return Ok(decision),
    };
    let conditions = Conditions {
        generation: restore.metadata.generation,
        now: now.clone(),
    };
    let mut status = claimed(&old, ownership.claim(), &conditions);
    let (storage, location) = restore_location(restore, &observation.staging.locations);
    let storage_problem = conditions.storage(&mut status.conditions, &storage);

    let mut requeue = Duration::from_secs(RECHECK_SECONDS);
    if status.selection.is_empty()
        && let Some(retry) = select(
            observation,
            &owner,
            storage_problem.as_deref(),
            &conditions,
            &mut status,
        )
    {
        requeue = retry;
    }
    // The location the selection was read from stays the restore's.
    if !status.selection.is_empty() && status.storage_location.is_none() {
        status.storage_location = location.map(ResourceExt::name_any);
    }
    let mut actions = Vec::new();
    let selection = status.selection.clone();
    if !selection.is_empty() && status.phase != Some(VolumeRestorePhase::Failed) {
        actions.extend(claims_to_create(observation, &selection, &owner));
        if status.plan.is_none() && !plan_when_ready(observation, &owner, &conditions, &mut status)?
        {
            requeue = Duration::from_secs(CLAIMS_BINDING_RETRY_SECONDS);
        }
        if let (Some(plan), Some(location)) = (status.plan.clone(), location) {
            let staged = stage(
                observation,
                &owner,
                (&plan, location),
                &conditions,
                &mut status,
            );
            actions.extend(staged.actions);
            if let Some(backoff) = staged.backoff {
                requeue = requeue.min(backoff);
            }
        }
    }
    Ok(finish(
        observation,
        &old,
        status,
        (ownership, actions),
        requeue,
        &conditions,
    ))
}

/// The old status as this reconcile starts it: owned by `claim` (the
/// Claimed condition says by whom), of this generation, started.
fn claimed(
    old: &VolumeRestoreStatus,
    claim: &OwnerClaim,
    conditions: &Conditions,
) -> VolumeRestoreStatus {
    let mut status = old.clone();
    status.owner = Some(claim.clone());
    status.observed_generation = conditions.generation;
    status.start_time = Some(
        status
            .start_time
            .clone()
            .unwrap_or_else(|| conditions.now.clone()),
    );
    conditions.claimed(
        &mut status.conditions,
        &claim.replica,
        claim.adopted_from.as_deref(),
    );
    status
}

/// `status` Failed for `why`, now.
fn fail(status: &mut VolumeRestoreStatus, conditions: &Conditions, why: &str, message: &str) {
    conditions.set(
        &mut status.conditions,
        condition_type::FAILED,
        ConditionStatus::True,
        why,
        message,
    );
    status.phase = Some(VolumeRestorePhase::Failed);
    status.message = Some(bounded_message(message));
    status.completion_time = Some(conditions.now.clone());
}

/// The selection, while the restore has none: wait for its storage
/// location (`storage_problem`: what is wrong with it) or give up after
/// `failAfterUnavailableSeconds`, wait for the listing of its snapshots,
/// say that they cannot be read, refuse the spec ([`make_selection`]), or
/// select. Returns when to look again when that is not the usual time.
fn select(
    observation: &RestoreObservation,
    owner: &Owner,
    storage_problem: Option<&str>,
    conditions: &Conditions,
    status: &mut VolumeRestoreStatus,
) -> Option<Duration> {
    match (storage_problem, &observation.snapshots) {
        (Some(message), _) => {
            let start = status
                .start_time
                .clone()
                .unwrap_or_else(|| conditions.now.clone());
            let waited = conditions.now.0.as_second() - start.0.as_second();
            if observation
                .restore
                .spec
                .fail_after_unavailable_seconds
                .is_some_and(|limit| waited >= limit)
            {
                fail(
                    status,
                    conditions,
                    reason::STORAGE_UNAVAILABLE_TIMEOUT,
                    &format!("{message}; gave up after {waited}s"),
                );
            } else {
                status.phase = Some(VolumeRestorePhase::WaitingForStorage);
                status.message = Some(bounded_message(message));
            }
            None
        }
        (None, None) => {
            status.phase = Some(VolumeRestorePhase::Selecting);
            None
        }
        (None, Some(Err(message))) => {
            let message = format!(
                "cannot read the storage location's snapshots: {message}; trying again in {SNAPSHOT_LIST_RETRY_SECONDS}s"
            );
            conditions.set(
                &mut status.conditions,
                condition_type::SELECTED,
                ConditionStatus::False,
                reason::REPOSITORY_UNREADABLE,
                &message,
            );
            status.phase = Some(VolumeRestorePhase::Selecting);
            status.message = Some(bounded_message(&message));
            Some(Duration::from_secs(SNAPSHOT_LIST_RETRY_SECONDS))
        }
        (None, Some(Ok(listed))) => {
            match make_selection(observation, listed, owner) {
                Err(refusal) => {
                    conditions.set(
                        &mut status.conditions,
                        condition_type::SELECTED,
                        ConditionStatus::False,
                        refusal.reason,
                        &refusal.message,
                    );
                    fail(status, conditions, refusal.reason, &refusal.message);
                }
                Ok(selection) => {
                    let count = |action| {
                        selection
                            .iter()
                            .filter(|volume| volume.action == action)
                            .count()
                    };
                    conditions.set(
                        &mut status.conditions,
                        condition_type::SELECTED,
                        ConditionStatus::True,
                        reason::SNAPSHOTS_SELECTED,
                        &format!(
                            "{} snapshots selected, {} claims to create, {} to sync, {} left alone",
                            selection.len(),
                            count(ClaimAction::Create),
                            count(ClaimAction::Sync),
                            count(ClaimAction::Skip),
                        ),
                    );
                    status.selection = selection;
                    status.phase = Some(VolumeRestorePhase::Planning);
                    status.message = None;
                }
            }
            None
        }
    }
}

/// The plan, while the restore has none: made once every claim to write
/// is ready for it ([`claims_ready`]) and the cluster's objects are read.
/// Returns whether it was made (if not, the restore stays Planning).
fn plan_when_ready(
    observation: &RestoreObservation,
    owner: &Owner,
    conditions: &Conditions,
    status: &mut VolumeRestoreStatus,
) -> Result<bool, RestoreError> {
    status.phase = Some(VolumeRestorePhase::Planning);
    let Some(cluster) = observation
        .cluster
        .as_ref()
        .filter(|_| claims_ready(observation, &status.selection))
    else {
        return Ok(false);
    };
    let plan = make_plan(&status.selection, owner, cluster)?;
    conditions.planned(&mut status.conditions, &plan);
    status.plan = Some(plan);
    Ok(true)
}

/// What [`stage`] does.
struct Staged {
    /// The changes and creations of stage pods, claims and volumes.
    actions: Vec<Action>,
    /// When to look again, if a stage pod's backoff is running.
    backoff: Option<Duration>,
}

/// The work of a planned restore at its location: the stage pods to
/// create, their supervision, the release of those whose volumes are all
/// final, each verified claim labelled complete and handed back; then the
/// status rolled up from the volumes.
fn stage(
    observation: &RestoreObservation,
    owner: &Owner,
    (plan, location): (&BackupPlan, &BackupStorageLocation),
    conditions: &Conditions,
    status: &mut VolumeRestoreStatus,
) -> Staged {
    let selection = status.selection.clone();
    let mut actions = stage_pods_to_create(observation, owner, plan, &selection, location);
    let (supervision, backoff) = observation.staging.supervise(&conditions.now);
    let releases = release_finished_pods(observation, &supervision);
    actions.extend(supervision);
    actions.extend(releases);
    let unfinished = finish_volumes(observation, &selection, owner, &mut actions);
    roll_up(status, observation, &unfinished, conditions);
    Staged { actions, backoff }
}

/// The end of a reconcile that acts with `ownership` and `actions`: the
/// StagePodsCreated condition, the finish Event and the release of the
/// stage pods once final, the status to write now ([`status_to_write`]),
/// and when to look again (`requeue`, or sooner for a held write).
fn finish(
    observation: &RestoreObservation,
    old: &VolumeRestoreStatus,
    mut status: VolumeRestoreStatus,
    (ownership, actions): (Ownership, Vec<Action>),
    mut requeue: Duration,
    conditions: &Conditions,
) -> RestoreDecision {
    let staging = &observation.staging;
    staging.note_stage_pods(&mut status, conditions.generation, &conditions.now);
    let finished = status.phase.is_some_and(VolumeRestorePhase::is_final);
    let after_status = after_final_status(staging, (old, &status), &actions, "restored");
    let write = match status_to_write(old, status, staging.since_last_status_write) {
        Ok(write) => write,
        Err(wait) => {
            requeue = requeue.min(wait);
            None
        }
    };
    RestoreDecision::Act(Box::new(RestoreActs {
        ownership,
        actions,
        status: write,
        after_status,
        finished,
        requeue: if finished {
            Requeue::OnChange
        } else {
            Requeue::After(requeue.max(Duration::from_secs(1)))
        },
    }))
}

/// Cancel a deleted restore: its open transfers Canceled, its stage pods
/// released, its transfers deleted. Its claims stay (nothing written is
/// deleted); one not verified keeps the label `incomplete`.
pub fn decide_cancel(observation: &RestoreObservation, now: &Time) -> Vec<Action> {
    let status = observation.restore.status.as_ref();
    let plan = status.and_then(|status| status.plan.as_ref());
    let why = "its VolumeRestore was deleted";
    observation.staging.cancel(plan, why, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{at, available, available_default};
    use haulage_api::condition::find_condition;
    use haulage_api::restore::RestoreSource;
    use haulage_repo::BlobId;
    use haulage_repo::snapshot::{RootAttributes, SnapshotSummary};
    use k8s_openapi::ByteString;

    fn class(name: &str, provisioner: &str, binding: &str) -> Arc<StorageClass> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name}, "provisioner": provisioner,
                "volumeBindingMode": binding,
            }))
            .expect("class"),
        )
    }

    fn snapshot(id: &str, namespace: &str, name: &str, time: &str, backup: &str) -> ListedSnapshot {
        ListedSnapshot {
            id: id.repeat(64 / id.len().max(1)).chars().take(64).collect(),
            snapshot: Snapshot {
                format_version: 1,
                time: time.to_string(),
                hostname: "haulage-stage-pod".to_string(),
                source: format!("{namespace}/{name}"),
                tree: BlobId([7; 32]),
                root: RootAttributes::default(),
                parent: None,
                tags: BTreeMap::new(),
                claim: Some(ClaimRecord {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    labels: [("app".to_string(), name.to_string())].into(),
                    storage_class: Some("ceph-block".to_string()),
                    provisioner: Some("rook-ceph.rbd.csi.ceph.com".to_string()),
                    access_modes: vec!["ReadWriteOnce".to_string()],
                    requested_bytes: 2 << 30,
                    backup: Some(format!("haulage-system/{backup}")),
                    ..ClaimRecord::default()
                }),
                summary: SnapshotSummary {
                    total_bytes: 1 << 30,
                    ..SnapshotSummary::default()
                },
            },
        }
    }

    fn history() -> Vec<ListedSnapshot> {
        vec![
            snapshot("a1", "shop", "db", "2027-01-15T08:00:00Z", "nightly"),
            snapshot("a2", "shop", "db", "2027-01-16T08:00:00Z", "nightly"),
            snapshot("b1", "shop", "logs", "2027-01-16T08:00:00Z", "nightly"),
            snapshot("c1", "web", "assets", "2027-01-16T08:00:00Z", "weekly"),
        ]
    }

    fn observation(restore: VolumeRestore) -> RestoreObservation {
        RestoreObservation {
            restore: Arc::new(restore),
            staging: StagingObservation {
                credentials: Some(ByteString(b"[default]".to_vec())),
                ..StagingObservation::test(vec![available("s3")])
            },
            snapshots: Some(Ok(history())),
            classes: vec![
                class(
                    "ceph-block",
                    "rook-ceph.rbd.csi.ceph.com",
                    "WaitForFirstConsumer",
                ),
                class("gp3", "ebs.csi.aws.com", "Immediate"),
            ],
            namespaces: ["shop".to_string(), "web".to_string()].into(),
            claims: Vec::new(),
            volumes: Vec::new(),
            cluster: Some(cluster()),
        }
    }

    fn cluster() -> ClusterObjects {
        ClusterObjects {
            nodes: vec![
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "node-b"},
                    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
                }))
                .expect("node"),
            ],
            storage_classes: vec![
                (*class(
                    "ceph-block",
                    "rook-ceph.rbd.csi.ceph.com",
                    "WaitForFirstConsumer",
                ))
                .clone(),
                (*class("gp3", "ebs.csi.aws.com", "Immediate")).clone(),
            ],
            ..ClusterObjects::default()
        }
    }

    fn acts(decision: RestoreDecision) -> RestoreActs {
        match decision {
            RestoreDecision::Act(acts) => *acts,
            other => panic!("expected the owner to act, got {other:?}"),
        }
    }

    fn restore_of(backup: &str) -> VolumeRestore {
        let mut restore = VolumeRestore::test("move");
        restore.spec.source = RestoreSource {
            backup: Some(backup.to_string()),
            ..RestoreSource::default()
        };
        restore
    }

    /// The restore after `acts` were carried out (status written).
    fn after(restore: &VolumeRestore, acts: &RestoreActs) -> VolumeRestore {
        let mut next = restore.clone();
        if let Some(status) = &acts.status {
            next.status = Some(status.clone());
        }
        next
    }

    fn claim(namespace: &str, name: &str, phase: &str, class: &str) -> Arc<PersistentVolumeClaim> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": namespace,
                    "labels": {RESTORE_STATE_LABEL: RESTORE_INCOMPLETE,
                        haulage_api::labels::OWNER_UID_LABEL: "uid-move"}},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": class,
                    "resources": {"requests": {"storage": "2Gi"}}},
                "status": {"phase": phase},
            }))
            .expect("claim"),
        )
    }

    fn refusal_of(
        restore: VolumeRestore,
        tweak: impl FnOnce(&mut RestoreObservation),
    ) -> (String, String) {
        let mut seen = observation(restore);
        tweak(&mut seen);
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let status = acts.status.expect("written");
        assert_eq!(status.phase, Some(VolumeRestorePhase::Failed));
        assert!(
            acts.actions.is_empty(),
            "nothing is written: {:?}",
            acts.actions
        );
        let condition = find_condition(&status.conditions, condition_type::SELECTED).expect("set");
        (condition.reason.clone(), condition.message.clone())
    }

    #[test]
    fn the_latest_snapshot_of_each_claim_of_the_backup_is_selected_and_its_claim_created() {
        let seen = observation(restore_of("nightly"));
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let status = acts.status.expect("written");
        let selected: Vec<(&str, &str)> = status
            .selection
            .iter()
            .map(|volume| (volume.pvc.as_str(), &volume.snapshot_id[..2]))
            .collect();
        assert_eq!(
            selected,
            [("db", "a2"), ("logs", "b1")],
            "latest per claim, only nightly"
        );
        assert_eq!(status.phase, Some(VolumeRestorePhase::Planning));
        let created: Vec<&str> = acts
            .actions
            .iter()
            .filter_map(|action| match action {
                Action::CreateClaim(claim) => claim.metadata.name.as_deref(),
                _ => None,
            })
            .collect();
        assert_eq!(created, ["db", "logs"]);
        let selected_condition =
            find_condition(&status.conditions, condition_type::SELECTED).expect("set");
        assert_eq!(selected_condition.reason, reason::SNAPSHOTS_SELECTED);
    }

    #[test]
    fn the_location_of_the_selection_is_recorded_and_kept_when_another_becomes_the_default() {
        let mut restore = restore_of("nightly");
        restore.spec.storage_location = None;
        let mut seen = observation(restore.clone());
        seen.staging.locations = vec![available_default("old", true)];
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let status = acts.status.clone().expect("written");
        assert!(!status.selection.is_empty());
        assert_eq!(status.storage_location.as_deref(), Some("old"));
        // `new` is the default now: the restore still reads from `old`.
        let next = after(&restore, &acts);
        let locations = vec![
            available_default("old", false),
            available_default("new", true),
        ];
        let (_, chosen) = restore_location(&next, &locations);
        assert_eq!(chosen.map(ResourceExt::name_any).as_deref(), Some("old"));
    }

    #[test]
    fn namespaces_and_a_selector_select_by_the_recorded_claims() {
        let mut restore = VolumeRestore::test("move");
        restore.spec.source = RestoreSource {
            namespaces: vec!["shop".to_string()],
            selector: Some(
                serde_json::from_value(serde_json::json!({"matchLabels": {"app": "logs"}}))
                    .expect("selector"),
            ),
            ..RestoreSource::default()
        };
        let status = acts(decide(&observation(restore), &at(0)).expect("decided"))
            .status
            .expect("written");
        let names: Vec<&str> = status.selection.iter().map(|v| v.pvc.as_str()).collect();
        assert_eq!(names, ["logs"]);
    }

    #[test]
    fn explicit_snapshot_ids_are_restored_and_an_unknown_one_is_refused_by_name() {
        let mut restore = VolumeRestore::test("move");
        restore.spec.source = RestoreSource {
            snapshots: vec!["a1a1a1a1".to_string()],
            ..RestoreSource::default()
        };
        let status = acts(decide(&observation(restore.clone()), &at(0)).expect("decided"))
            .status
            .expect("written");
        assert_eq!(status.selection.len(), 1);
        assert!(status.selection[0].snapshot_id.starts_with("a1a1"));
        restore.spec.source.snapshots = vec!["deadbeef".to_string()];
        let (why, message) = refusal_of(restore, |_| {});
        assert_eq!(why, reason::SNAPSHOT_NOT_FOUND);
        assert!(message.contains("deadbeef"), "{message}");
    }

    #[test]
    fn a_storage_class_missing_here_refuses_the_restore_and_a_map_fixes_it() {
        let (why, message) = refusal_of(restore_of("nightly"), |seen| {
            seen.classes
                .retain(|class| class.name_any() != "ceph-block");
        });
        assert_eq!(why, reason::STORAGE_CLASS_NOT_FOUND);
        assert!(
            message.contains("ceph-block") && message.contains("shop/"),
            "{message}"
        );
        let mut mapped = restore_of("nightly");
        mapped.spec.provisioner_map =
            [("rook-ceph.rbd.csi.ceph.com".to_string(), "gp3".to_string())].into();
        let mut seen = observation(mapped);
        seen.classes
            .retain(|class| class.name_any() != "ceph-block");
        let status = acts(decide(&seen, &at(0)).expect("decided"))
            .status
            .expect("written");
        assert!(
            status
                .selection
                .iter()
                .all(|v| v.storage_class.as_deref() == Some("gp3"))
        );
    }

    #[test]
    fn two_sources_mapped_to_one_claim_are_refused_naming_both() {
        let mut restore = VolumeRestore::test("move");
        restore.spec.source = RestoreSource {
            namespaces: vec!["shop".to_string(), "web".to_string()],
            ..RestoreSource::default()
        };
        restore.spec.namespace_map = [
            ("shop".to_string(), "prod".to_string()),
            ("web".to_string(), "prod".to_string()),
        ]
        .into();
        let (why, _) = refusal_of(restore.clone(), |seen| {
            seen.namespaces.insert("prod".to_string());
            if let Some(Ok(listed)) = seen.snapshots.as_mut() {
                listed.push(snapshot(
                    "d1",
                    "web",
                    "db",
                    "2027-01-16T09:00:00Z",
                    "nightly",
                ));
            }
        });
        assert_eq!(why, reason::DESTINATION_COLLISION);
    }

    #[test]
    fn a_missing_namespace_is_refused_unless_the_restore_may_create_it() {
        let mut restore = restore_of("nightly");
        restore.spec.namespace_map = [("shop".to_string(), "shop-b".to_string())].into();
        let (why, message) = refusal_of(restore.clone(), |_| {});
        assert_eq!(why, reason::NAMESPACE_NOT_FOUND);
        assert!(
            message.contains("shop-b") && message.contains("createNamespaces"),
            "{message}"
        );
        restore.spec.create_namespaces = true;
        let acts = acts(decide(&observation(restore), &at(0)).expect("decided"));
        assert!(matches!(&acts.actions[0], Action::CreateNamespace(name) if name == "shop-b"));
        assert_eq!(
            acts.actions
                .iter()
                .filter(|action| matches!(action, Action::CreateNamespace(_)))
                .count(),
            1,
            "once per namespace"
        );
    }

    #[test]
    fn an_existing_claim_is_refused_synced_or_left_alone_as_the_spec_says() {
        let existing = || {
            let mut claim = (*claim("shop", "db", "Bound", "ceph-block")).clone();
            claim.metadata.labels = None;
            Arc::new(claim)
        };
        let (why, message) =
            refusal_of(restore_of("nightly"), |seen| seen.claims = vec![existing()]);
        assert_eq!(why, reason::CLAIM_EXISTS);
        assert!(
            message.contains("shop/db") && message.contains("existingClaim"),
            "{message}"
        );
        for (policy, action) in [
            (ExistingClaimPolicy::Sync, ClaimAction::Sync),
            (ExistingClaimPolicy::Skip, ClaimAction::Skip),
        ] {
            let mut restore = restore_of("nightly");
            restore.spec.existing_claim = policy;
            let mut seen = observation(restore);
            seen.claims = vec![existing()];
            let acts = acts(decide(&seen, &at(0)).expect("decided"));
            let status = acts.status.expect("written");
            let db = status
                .selection
                .iter()
                .find(|v| v.pvc == "db")
                .expect("selected");
            assert_eq!(db.action, action);
            assert!(
                !acts.actions.iter().any(|action| matches!(action, Action::CreateClaim(claim) if claim.metadata.name.as_deref() == Some("db"))),
                "an existing claim is not created again"
            );
        }
    }

    #[test]
    fn an_unreadable_location_keeps_selecting_with_a_condition_and_retries() {
        let mut seen = observation(restore_of("nightly"));
        seen.snapshots = Some(Err("connection refused".to_string()));
        let acts = acts(decide(&seen, &at(0)).expect("decided"));
        let status = acts.status.expect("written");
        assert_eq!(status.phase, Some(VolumeRestorePhase::Selecting));
        let condition = find_condition(&status.conditions, condition_type::SELECTED).expect("set");
        assert_eq!(condition.reason, reason::REPOSITORY_UNREADABLE);
        assert_eq!(
            acts.requeue,
            Requeue::After(Duration::from_secs(SNAPSHOT_LIST_RETRY_SECONDS))
        );
    }

    #[test]
    fn a_missing_location_makes_the_restore_wait() {
        let mut seen = observation(restore_of("nightly"));
        seen.staging.locations.clear();
        let status = acts(decide(&seen, &at(0)).expect("decided"))
            .status
            .expect("written");
        assert_eq!(status.phase, Some(VolumeRestorePhase::WaitingForStorage));
        assert!(status.selection.is_empty());
    }

    /// The restore once selected, and claims in the cache in `phase`.
    fn selected(class_phase: (&str, &str)) -> (VolumeRestore, RestoreObservation) {
        let restore = restore_of("nightly");
        let first = acts(decide(&observation(restore.clone()), &at(0)).expect("decided"));
        let restore = after(&restore, &first);
        let mut seen = observation(restore.clone());
        seen.snapshots = None;
        seen.claims = vec![
            claim("shop", "db", class_phase.1, class_phase.0),
            claim("shop", "logs", class_phase.1, class_phase.0),
        ];
        (restore, seen)
    }

    #[test]
    fn claims_waiting_for_their_first_consumer_are_planned_and_get_download_stage_pods() {
        let (restore, seen) = selected(("ceph-block", "Pending"));
        let planned = acts(decide(&seen, &at(1)).expect("decided"));
        let status = planned.status.clone().expect("written");
        let plan = status.plan.clone().expect("planned");
        assert_eq!(plan.stage_pods.len(), 1);
        assert_eq!(plan.stage_pods[0].stage.volumes, ["db", "logs"]);
        assert!(
            plan.stage_pods[0]
                .pod_name
                .starts_with("haulage-restore-move-")
        );
        let restore = after(&restore, &planned);
        let mut seen = seen;
        seen.restore = Arc::new(restore);
        assert!(needs_credentials(&seen));
        let acts = acts(decide(&seen, &at(2)).expect("decided"));
        let objects = created_stage_pod(&acts);
        for transfer in &objects.transfers {
            assert_eq!(
                transfer.spec.direction,
                haulage_api::TransferDirection::Download
            );
            let chosen = status
                .selection
                .iter()
                .find(|volume| volume.pvc == transfer.spec.pvc)
                .expect("selected");
            assert_eq!(transfer.spec.snapshot.as_ref(), Some(&chosen.snapshot_id));
        }
        let mounts = objects
            .pod
            .spec
            .as_ref()
            .expect("spec")
            .volumes
            .clone()
            .unwrap_or_default();
        assert!(
            mounts
                .iter()
                .filter_map(|v| v.persistent_volume_claim.as_ref())
                .all(|c| c.read_only == Some(false))
        );
    }

    #[test]
    fn a_sync_names_the_snapshot_its_claim_holds_completely_and_marks_the_claim_first() {
        let mut restore = restore_of("nightly");
        restore.spec.existing_claim = ExistingClaimPolicy::Sync;
        let earlier = |name: &str, state: &str, holds: &str| {
            let mut claim = (*claim("shop", name, "Pending", "ceph-block")).clone();
            claim.metadata.labels =
                Some([(RESTORE_STATE_LABEL.to_string(), state.to_string())].into());
            claim.metadata.annotations =
                Some([(RESTORED_FROM_ANNOTATION.to_string(), holds.to_string())].into());
            Arc::new(claim)
        };
        // db holds a1 completely (the first pass); logs was cut off while
        // being synced to some other snapshot.
        let claims = vec![
            earlier("db", RESTORE_COMPLETE, "a1"),
            earlier("logs", RESTORE_INCOMPLETE, "zz"),
        ];
        let mut seen = observation(restore.clone());
        seen.claims = claims.clone();
        let first = acts(decide(&seen, &at(0)).expect("decided"));
        let restore = after(&restore, &first);
        let mut seen = observation(restore.clone());
        seen.snapshots = None;
        seen.claims = claims;
        let planned = acts(decide(&seen, &at(1)).expect("decided"));
        seen.restore = Arc::new(after(&restore, &planned));
        let acts = acts(decide(&seen, &at(2)).expect("decided"));
        let pod_at = acts
            .actions
            .iter()
            .position(|action| matches!(action, Action::CreateStagePod(_)))
            .expect("a stage pod");
        let Action::CreateStagePod(objects) = &acts.actions[pod_at] else {
            unreachable!()
        };
        let since_of = |pvc: &str| {
            objects
                .transfers
                .iter()
                .find(|transfer| transfer.spec.pvc == pvc)
                .expect("a transfer")
                .spec
                .since_snapshot
                .clone()
        };
        assert_eq!(since_of("db").as_deref(), Some("a1"));
        assert_eq!(
            since_of("logs"),
            None,
            "a claim cut off mid-sync holds no snapshot completely"
        );
        for (pvc, snapshot) in [("db", "a2"), ("logs", "b1")] {
            let begin = acts
                .actions
                .iter()
                .position(|action| {
                    matches!(action, Action::ChangeClaim { claim, change: ClaimChange::BeginSync { snapshot: s } }
                        if claim.name == pvc && s.starts_with(snapshot))
                })
                .unwrap_or_else(|| panic!("{pvc} is not marked as being synced: {:?}", acts.actions));
            assert!(
                begin < pod_at,
                "{pvc} is marked before its stage pod can write"
            );
        }

        // Once its transfer exists, the transfer says; the claim is not
        // marked again.
        let mut transfer = objects.transfers[0].clone();
        transfer.status = None;
        let pvc = transfer.spec.pvc.clone();
        let volume = seen
            .restore
            .status
            .as_ref()
            .and_then(|status| status.selection.iter().find(|v| v.pvc == pvc))
            .expect("selected")
            .clone();
        seen.staging.transfers = vec![Arc::new(transfer.clone())];
        let (since, begin) = sync_start(&seen, &volume);
        assert_eq!(since, transfer.spec.since_snapshot);
        assert!(begin.is_none(), "marked again: {begin:?}");
    }

    #[test]
    fn a_plan_made_in_this_pass_gets_its_stage_pods_in_the_next_with_the_credentials() {
        let (restore, mut seen) = selected(("ceph-block", "Pending"));
        // What the controller observes: no plan in the status yet, so it
        // read no credentials.
        assert!(!needs_credentials(&seen));
        seen.staging.credentials = None;
        let planned = acts(decide(&seen, &at(1)).expect("decided"));
        assert!(planned.status.as_ref().is_some_and(|s| s.plan.is_some()));
        assert!(
            !planned
                .actions
                .iter()
                .any(|action| matches!(action, Action::CreateStagePod(_))),
            "no stage pod without its credentials"
        );
        seen.restore = Arc::new(after(&restore, &planned));
        assert!(needs_credentials(&seen));
        seen.staging.credentials = Some(ByteString(b"[default]".to_vec()));
        let next = acts(decide(&seen, &at(2)).expect("decided"));
        let objects = created_stage_pod(&next);
        let copied = objects
            .credentials
            .data
            .as_ref()
            .and_then(|data| data.values().next())
            .expect("credentials copied");
        assert_eq!(copied.0, b"[default]");
    }

    #[test]
    fn claims_of_an_immediate_class_are_planned_once_bound() {
        let mut restore = restore_of("nightly");
        restore.spec.storage_class_map = [("ceph-block".to_string(), "gp3".to_string())].into();
        let first = acts(decide(&observation(restore.clone()), &at(0)).expect("decided"));
        let restore = after(&restore, &first);
        let mut seen = observation(restore);
        seen.snapshots = None;
        seen.claims = vec![
            claim("shop", "db", "Pending", "gp3"),
            claim("shop", "logs", "Bound", "gp3"),
        ];
        let waiting = acts(decide(&seen, &at(1)).expect("decided"));
        assert_eq!(waiting.status.as_ref().and_then(|s| s.plan.as_ref()), None);
        assert_eq!(
            waiting.requeue,
            Requeue::After(Duration::from_secs(CLAIMS_BINDING_RETRY_SECONDS))
        );
    }

    fn running(
        restore: &VolumeRestore,
        phases: &[(&str, VolumeTransferPhase)],
    ) -> RestoreObservation {
        let (selected_restore, mut seen) = selected(("ceph-block", "Bound"));
        let planned = acts(decide(&seen, &at(1)).expect("decided"));
        let restore = if restore.status.is_some() {
            restore.clone()
        } else {
            after(&selected_restore, &planned)
        };
        let pod_name = restore
            .status
            .as_ref()
            .and_then(|s| s.plan.as_ref())
            .expect("plan")
            .stage_pods[0]
            .pod_name
            .clone();
        seen.restore = Arc::new(restore);
        seen.staging.transfers = phases
            .iter()
            .map(|(pvc, phase)| {
                let mut transfer =
                    VolumeTransfer::test(&format!("move-{pvc}"), pvc).with_phase(*phase);
                transfer.spec.stage_pod = pod_name.clone();
                transfer.spec.direction = haulage_api::TransferDirection::Download;
                Arc::new(transfer)
            })
            .collect();
        seen
    }

    #[test]
    fn verified_volumes_are_labelled_complete_and_the_restore_completes_and_releases() {
        let mut seen = running(
            &VolumeRestore::test("x"),
            &[
                ("db", VolumeTransferPhase::Completed),
                ("logs", VolumeTransferPhase::InProgress),
            ],
        );
        let acts_running = acts(decide(&seen, &at(5)).expect("decided"));
        assert!(acts_running.actions.iter().any(|action| matches!(action, Action::ChangeClaim { claim, change: ClaimChange::MarkComplete } if claim.name == "db")));
        let status = acts_running.status.expect("written");
        assert_eq!(status.phase, Some(VolumeRestorePhase::InProgress));
        seen.staging.transfers = seen
            .staging
            .transfers
            .iter()
            .map(|transfer| {
                Arc::new(
                    (**transfer)
                        .clone()
                        .with_phase(VolumeTransferPhase::Completed),
                )
            })
            .collect();
        // Its stage pod, finished, and its Role.
        let planned = &seen
            .restore
            .status
            .as_ref()
            .and_then(|s| s.plan.as_ref())
            .expect("plan")
            .stage_pods[0];
        let (namespace, pod_name) = (planned.stage.namespace.clone(), planned.pod_name.clone());
        let metadata =
            serde_json::json!({"name": pod_name, "namespace": namespace, "uid": "uid-1"});
        let mut pod: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(serde_json::json!({"metadata": metadata})).expect("pod");
        pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".to_string()),
            ..Default::default()
        });
        seen.staging.pods = vec![Arc::new(pod)];
        seen.staging.roles = vec![Arc::new(
            serde_json::from_value(serde_json::json!({"metadata": metadata})).expect("role"),
        )];
        let done = acts(decide(&seen, &at(6)).expect("decided"));
        let status = done.status.expect("written");
        assert_eq!(status.phase, Some(VolumeRestorePhase::Completed));
        assert!(done.finished);
        // The stage pod is released once: with the volumes, not again at
        // the end.
        let released = |actions: &[Action]| {
            actions
                .iter()
                .filter(|action| matches!(action, Action::ReleaseStagePod(_)))
                .count()
        };
        assert_eq!(released(&done.actions), 1, "{:?}", done.actions);
        assert_eq!(released(&done.after_status), 0, "{:?}", done.after_status);
        assert!(
            done.after_status
                .iter()
                .any(|action| matches!(action, Action::Emit(event) if event.reason == "Completed"))
        );
    }

    #[test]
    fn a_failed_volume_makes_the_restore_partially_failed() {
        let seen = running(
            &VolumeRestore::test("x"),
            &[
                ("db", VolumeTransferPhase::Completed),
                ("logs", VolumeTransferPhase::Failed),
            ],
        );
        let status = acts(decide(&seen, &at(5)).expect("decided"))
            .status
            .expect("written");
        assert_eq!(status.phase, Some(VolumeRestorePhase::PartiallyFailed));
    }

    #[test]
    fn cancel_stops_open_transfers_and_keeps_the_claims() {
        let seen = running(
            &VolumeRestore::test("x"),
            &[
                ("db", VolumeTransferPhase::Completed),
                ("logs", VolumeTransferPhase::InProgress),
            ],
        );
        let actions = decide_cancel(&seen, &at(9));
        let canceled = actions.iter().filter(|action| matches!(action, Action::WriteTransferStatus { status, .. } if status.phase == Some(VolumeTransferPhase::Canceled))).count();
        assert_eq!(canceled, 1);
        assert!(
            !actions.iter().any(|action| matches!(
                action,
                Action::ChangeClaim { .. } | Action::CreateClaim(_)
            )),
            "claims are never deleted by a cancel"
        );
        assert_eq!(
            actions
                .iter()
                .filter(|action| matches!(action, Action::DeleteTransfer(_)))
                .count(),
            2
        );
    }

    fn volume(
        phase: &str,
        claim_ref_uid: Option<&str>,
        policy: &str,
        kept: bool,
    ) -> Arc<PersistentVolume> {
        let mut annotations = serde_json::Map::new();
        if kept {
            annotations.insert(
                crate::claims::RECLAIM_POLICY_ANNOTATION.to_string(),
                "Delete".into(),
            );
        }
        let mut claim_ref = serde_json::json!({"namespace": "shop", "name": "db"});
        if let Some(uid) = claim_ref_uid {
            claim_ref["uid"] = uid.into();
        }
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "pv-db", "annotations": annotations},
                "spec": {"persistentVolumeReclaimPolicy": policy, "claimRef": claim_ref,
                    "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "2Gi"}},
                "status": {"phase": phase},
            }))
            .expect("volume"),
        )
    }

    /// Claim shop/db of the selection, to create ReadWriteOnce and hand
    /// back with `final_modes`.
    fn db_volume(final_modes: &[&str]) -> RestoreVolume {
        RestoreVolume {
            snapshot_id: "a".repeat(64),
            source: "shop/db".to_string(),
            namespace: "shop".to_string(),
            pvc: "db".to_string(),
            storage_class: Some("ceph-block".to_string()),
            access_modes: vec!["ReadWriteOnce".to_string()],
            final_access_modes: final_modes.iter().map(|m| m.to_string()).collect(),
            volume_mode: None,
            request_bytes: 2 << 30,
            data_bytes: 1 << 30,
            action: ClaimAction::Create,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
        }
    }

    /// The first stage pod `acts` creates.
    fn created_stage_pod(acts: &RestoreActs) -> &crate::stage_pod::StagePodObjects {
        acts.actions
            .iter()
            .find_map(|action| match action {
                Action::CreateStagePod(objects) => Some(objects.as_ref()),
                _ => None,
            })
            .expect("a stage pod")
    }

    /// The owner of the restore `move`.
    fn move_owner() -> Owner {
        Owner {
            namespace: "haulage-system".into(),
            name: "move".into(),
            uid: "uid-move".into(),
        }
    }

    #[test]
    fn a_written_read_only_many_claim_gone_for_its_hand_back_is_not_created_again() {
        let volume = db_volume;
        let owner = move_owner();
        let mut seen = observation(restore_of("nightly"));
        seen.claims.clear();
        let creates = |seen: &RestoreObservation, volume: &RestoreVolume| {
            claims_to_create(seen, std::slice::from_ref(volume), &owner)
                .iter()
                .filter(|action| matches!(action, Action::CreateClaim(_)))
                .count()
        };
        assert_eq!(
            creates(&seen, &volume(&["ReadOnlyMany"])),
            1,
            "not written yet"
        );
        seen.staging.transfers = vec![Arc::new(
            VolumeTransfer::test("move-db", "db").with_phase(VolumeTransferPhase::Completed),
        )];
        assert_eq!(
            creates(&seen, &volume(&["ReadOnlyMany"])),
            0,
            "the hand-back creates its ReadOnlyMany claim"
        );
        assert_eq!(
            creates(&seen, &volume(&[])),
            1,
            "no hand-back: created again"
        );
    }

    #[test]
    fn a_read_only_many_claim_is_handed_back_step_by_step_keeping_its_volume() {
        let rox = db_volume(&["ReadOnlyMany"]);
        let owner = move_owner();
        let mut seen = observation(restore_of("nightly"));
        let mut written = (*claim("shop", "db", "Bound", "ceph-block")).clone();
        written.spec.as_mut().expect("spec").volume_name = Some("pv-db".to_string());
        seen.claims = vec![Arc::new(written.clone())];
        // 1. keep the volume.
        seen.volumes = vec![volume("Bound", Some("old-uid"), "Delete", false)];
        let mut actions = Vec::new();
        assert_eq!(handback(&seen, &rox, &owner, &mut actions), Handback::Step);
        assert!(
            matches!(&actions[..], [Action::ChangeVolume { change: crate::action::VolumeChange::Retain { original }, .. }] if original == "Delete")
        );
        // 2. delete the written claim.
        seen.volumes = vec![volume("Bound", Some("old-uid"), "Retain", true)];
        actions.clear();
        handback(&seen, &rox, &owner, &mut actions);
        assert!(matches!(
            &actions[..],
            [Action::ChangeClaim {
                change: ClaimChange::Delete,
                ..
            }]
        ));
        // 3. the claim is gone: free the volume for a claim of that name.
        seen.claims.clear();
        seen.volumes = vec![volume("Released", Some("old-uid"), "Retain", true)];
        actions.clear();
        handback(&seen, &rox, &owner, &mut actions);
        assert!(matches!(
            &actions[..],
            [Action::ChangeVolume {
                change: crate::action::VolumeChange::FreeForClaim { .. },
                ..
            }]
        ));
        // 4. create the ReadOnlyMany claim bound to it, complete.
        seen.volumes = vec![volume("Available", None, "Retain", true)];
        actions.clear();
        handback(&seen, &rox, &owner, &mut actions);
        let [Action::CreateClaim(new)] = &actions[..] else {
            panic!("{actions:?}")
        };
        let spec = new.spec.as_ref().expect("spec");
        assert_eq!(
            spec.access_modes.as_deref(),
            Some(&["ReadOnlyMany".to_string()][..])
        );
        assert_eq!(spec.volume_name.as_deref(), Some("pv-db"));
        assert_eq!(
            new.labels().get(RESTORE_STATE_LABEL).map(String::as_str),
            Some(RESTORE_COMPLETE)
        );
        // 5. bound again: the volume's policy comes back, then it is done.
        let mut rox_claim = (*claim("shop", "db", "Bound", "ceph-block")).clone();
        rox_claim.spec.as_mut().expect("spec").access_modes =
            Some(vec!["ReadOnlyMany".to_string()]);
        rox_claim.spec.as_mut().expect("spec").volume_name = Some("pv-db".to_string());
        seen.claims = vec![Arc::new(rox_claim)];
        seen.volumes = vec![volume("Bound", Some("new-uid"), "Retain", true)];
        actions.clear();
        assert_eq!(handback(&seen, &rox, &owner, &mut actions), Handback::Step);
        assert!(
            matches!(&actions[..], [Action::ChangeVolume { change: crate::action::VolumeChange::RestoreReclaimPolicy(policy), .. }] if policy == "Delete")
        );
        seen.volumes = vec![volume("Bound", Some("new-uid"), "Delete", false)];
        actions.clear();
        assert_eq!(handback(&seen, &rox, &owner, &mut actions), Handback::Done);
        assert!(actions.is_empty());
    }
}
