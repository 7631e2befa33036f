//! What the decisions of backups and restores share, in one place: the
//! part of their observations both read ([`StagingObservation`]: this
//! replica's standing, the locations, the stage pods and their transfers,
//! and what a new stage pod is built from), and what is decided from it
//! alike for either kind — who acts, the planned stage pods still to
//! create and how one is created, their supervision and release, the
//! cancel of a deleted object, the progress-write throttle of its status
//! and what follows a final status (the finish Event, the release).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use haulage_api::backup::{BackupPlan, OwnerClaim, PlannedStagePod, VolumeCounts};
use haulage_api::condition::{Condition, condition_type, find_condition};
use haulage_api::{
    BackupStorageLocation, VolumeBackupPhase, VolumeBackupStatus, VolumeRestorePhase,
    VolumeRestoreStatus, VolumeTransfer, VolumeTransferPhase, VolumeTransferStatus,
};
use haulage_plan::objects::node_facts;
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::rbac::v1::Role;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::action::{Action, Event, ObjectName, StagePodRelease};
use crate::ownership::{ControllerSettings, Decision, Ownership, OwnershipFacts, decide_ownership};
use crate::stage_pod::{
    LocationSettings, Operation, Owner, StagePodInputs, StagePodTemplate, TransferDetails,
    desired_stage_pod, resources_for,
};
use crate::supervision::{
    AgentWatch, ApiOutage, supervise_stage_pods, transfer_name_of, transfers_of,
};

/// Least time between two status writes of a backup or restore that change
/// only its progress: each agent reports every 2 s and each volume moves
/// through several phases, so an object of many volumes would otherwise
/// be rewritten several times a second.
pub const PROGRESS_WRITE_INTERVAL: Duration = Duration::from_secs(5);

/// What one reconcile of a VolumeBackup or VolumeRestore reads alike from
/// the caches (and, when the decision will create a stage pod, the
/// location's credentials).
#[derive(Debug, Clone)]
pub struct StagingObservation {
    /// The controller's settings.
    pub settings: ControllerSettings,
    /// Whether this replica renewed its liveness lease recently enough to
    /// act as an owner (another replica may be adopting its objects).
    pub lease_fresh: bool,
    /// When this replica saw the API server not answering (its start
    /// included, until the first answer): no agent's silence is counted in
    /// them, its heartbeats could not reach the server.
    pub api_outages: Vec<ApiOutage>,
    /// The replicas' liveness Leases.
    pub leases: Vec<Lease>,
    /// The BackupStorageLocations of the object's namespace.
    pub locations: Vec<Arc<BackupStorageLocation>>,
    /// The nodes (for the tolerations of a stage pod on a cordoned node).
    pub nodes: Vec<Arc<Node>>,
    /// The object's VolumeTransfers.
    pub transfers: Vec<Arc<VolumeTransfer>>,
    /// The object's stage pods.
    pub pods: Vec<Arc<Pod>>,
    /// The Roles of the object's stage pods (each named as its pod), but
    /// those this replica released already: a Role is the first of a
    /// stage pod's objects created and the last released, so while one is
    /// here something of that pod's access may be left.
    pub roles: Vec<Arc<Role>>,
    /// UIDs of stage pods this replica deleted (to replace them, to stop
    /// them once their volumes were final, or releasing them): a lagging
    /// cache may still show one as running, and it must not be judged
    /// (and replaced, and counted) or deleted twice.
    pub deleted_pods: BTreeSet<String>,
    /// How long ago this replica last wrote the object's status, if it did.
    pub since_last_status_write: Option<Duration>,
    /// The location's credentials file (the bytes under its key), read
    /// when the kind's `needs_credentials` said so.
    pub credentials: Option<ByteString>,
    /// The repository's password, read with the credentials for a
    /// location with `spec.encryption`.
    pub password: Option<ByteString>,
    /// The StoragePolicies (their `stagePodResources`).
    pub policies: Vec<Arc<haulage_api::StoragePolicy>>,
    /// The LimitRange minimum of each namespace that has one.
    pub limit_minimums: BTreeMap<String, haulage_plan::facts::ResourceMinimum>,
}

#[cfg(test)]
impl StagingObservation {
    /// What the unit tests of backups and restores start from: replica
    /// `controller-0` with a fresh lease, `locations`, and nothing else.
    pub(crate) fn test(locations: Vec<Arc<BackupStorageLocation>>) -> Self {
        StagingObservation {
            settings: ControllerSettings {
                identity: "controller-0".to_string(),
                agent_image: "agent:1".to_string(),
                pinning: crate::stage_pod::Pinning::RequiredNodeAffinity,
                agent_lost_seconds: 300,
                checkpoint_seconds: None,
            },
            lease_fresh: true,
            api_outages: Vec::new(),
            leases: Vec::new(),
            locations,
            nodes: Vec::new(),
            transfers: Vec::new(),
            pods: Vec::new(),
            roles: Vec::new(),
            deleted_pods: BTreeSet::new(),
            since_last_status_write: None,
            credentials: None,
            password: None,
            policies: Vec::new(),
            limit_minimums: BTreeMap::new(),
        }
    }
}

/// What of an object's old status decides whether a reconcile goes on.
#[derive(Debug, Clone, Copy)]
pub struct StatusStanding<'a> {
    /// Its phase is final.
    pub finished: bool,
    /// Its plan, whose stage pods a finished object releases.
    pub plan: Option<&'a BackupPlan>,
    /// Its `status.owner`.
    pub owner: Option<&'a OwnerClaim>,
    /// The kind, for the Events (`backup`, `restore`).
    pub noun: &'static str,
}

impl StagingObservation {
    /// Who acts on the object ([`decide_ownership`]), or the decision that
    /// ends this reconcile here: a finished object releases what is left
    /// of its stage pods, and a replica that may not act waits.
    pub fn ownership<S>(
        &self,
        standing: StatusStanding<'_>,
        now: &Time,
    ) -> Result<Ownership, Decision<S>> {
        if standing.finished {
            return Err(Decision::Finished {
                release: self.release_left(&[]),
            });
        }
        decide_ownership(
            OwnershipFacts {
                owner: standing.owner,
                identity: &self.settings.identity,
                lease_fresh: self.lease_fresh,
                leases: &self.leases,
                noun: standing.noun,
            },
            now,
        )
        .map_err(|(why, requeue)| Decision::Wait { why, requeue })
    }

    /// The planned stage pods not in the cache whose volumes still have
    /// work (a pod whose transfers are all final is not created again).
    pub fn missing_stage_pods<'a>(&self, plan: &'a BackupPlan) -> Vec<&'a PlannedStagePod> {
        plan.stage_pods
            .iter()
            .filter(|planned| {
                !self.pods.iter().any(|pod| {
                    pod.namespace().as_deref() == Some(planned.stage.namespace.as_str())
                        && pod.name_any() == planned.pod_name
                })
            })
            .filter(|planned| {
                let of_pod =
                    transfers_of(&self.transfers, &planned.stage.namespace, &planned.pod_name);
                let all_final = !of_pod.is_empty()
                    && of_pod.len() >= planned.stage.volumes.len()
                    && of_pod.iter().all(|transfer| transfer.phase().is_final());
                !all_final
            })
            .collect()
    }

    /// The release of every stage pod of the object, whatever the caches
    /// show: those of its plan and those in the cache (a cancel, after
    /// which the finalizer goes, so a pod or Role the caches do not show
    /// yet must not be left behind).
    pub fn release_by_plan(&self, plan: Option<&BackupPlan>) -> Vec<Action> {
        let mut pods: BTreeSet<ObjectName> = plan
            .map(|plan| {
                plan.stage_pods
                    .iter()
                    .filter(|pod| !pod.pod_name.is_empty())
                    .map(|pod| ObjectName::new(&pod.stage.namespace, &pod.pod_name))
                    .collect()
            })
            .unwrap_or_default();
        pods.extend(self.pods.iter().map(|pod| object_name(pod.as_ref())));
        pods.into_iter()
            .map(|pod| Action::ReleaseStagePod(StagePodRelease::everything(pod)))
            .collect()
    }

    /// What the caches show is left of stage pod `pod`: the pod, unless it
    /// is gone, being deleted or deleted by this replica already (the
    /// cache lagging), and its access while its Role is there; `None` when
    /// nothing is.
    pub fn release_of(&self, pod: &ObjectName) -> Option<StagePodRelease> {
        let live_pod = self.pods.iter().find(|cached| {
            &object_name(cached.as_ref()) == pod
                && cached.metadata.deletion_timestamp.is_none()
                && !cached
                    .uid()
                    .is_some_and(|uid| self.deleted_pods.contains(&uid))
        });
        let role = self
            .roles
            .iter()
            .find(|role| &object_name(role.as_ref()) == pod);
        (live_pod.is_some() || role.is_some()).then(|| StagePodRelease {
            pod: pod.clone(),
            delete_pod: live_pod.is_some(),
            pod_uid: live_pod.and_then(|pod| pod.uid()),
            delete_access: role.is_some(),
            role_uid: role.and_then(|role| role.uid()),
        })
    }

    /// The names of the object's stage pods the caches show something of:
    /// the pod or its Role.
    pub fn stage_pod_names(&self) -> BTreeSet<ObjectName> {
        self.pods
            .iter()
            .map(|pod| object_name(pod.as_ref()))
            .chain(self.roles.iter().map(|role| object_name(role.as_ref())))
            .collect()
    }

    /// The release of what the caches show is left of the object's stage
    /// pods ([`StagingObservation::release_among`] of them all).
    pub fn release_left(&self, deciding: &[Action]) -> Vec<Action> {
        self.release_among(&self.stage_pod_names(), deciding)
    }

    /// The release of what the caches show is left of the stage pods
    /// `names` ([`StagingObservation::release_of`]), each released once:
    /// not those `deciding` (this reconcile's other actions) releases
    /// already, nor the pods it deletes (their access is released).
    pub fn release_among(&self, names: &BTreeSet<ObjectName>, deciding: &[Action]) -> Vec<Action> {
        let mut released = BTreeSet::new();
        let mut deleted = BTreeSet::new();
        for action in deciding {
            match action {
                Action::ReleaseStagePod(release) => {
                    released.insert(&release.pod);
                }
                Action::DeletePod { pod, .. } => {
                    deleted.insert(pod);
                }
                _ => {}
            }
        }
        names
            .iter()
            .filter(|name| !released.contains(name))
            .filter_map(|name| self.release_of(name))
            .filter_map(|mut release| {
                if deleted.contains(&release.pod) {
                    release.delete_pod = false;
                }
                (release.delete_pod || release.delete_access).then_some(release)
            })
            .map(Action::ReleaseStagePod)
            .collect()
    }

    /// The supervision of the object's stage pods ([`supervise_stage_pods`]):
    /// the actions, and when to look again if a backoff is running.
    pub fn supervise(&self, now: &Time) -> (Vec<Action>, Option<Duration>) {
        supervise_stage_pods(
            &self.pods,
            &self.transfers,
            &self.deleted_pods,
            AgentWatch {
                lost_after_seconds: self.settings.agent_lost_seconds,
                api_outages: &self.api_outages,
            },
            now,
        )
    }

    /// What every stage pod of the object shares: this controller's agent
    /// image and pinning, and `location`.
    pub fn stage_pod_template(
        &self,
        operation: Operation,
        owner: &Owner,
        location: &BackupStorageLocation,
    ) -> StagePodTemplate {
        StagePodTemplate {
            pinning: self.settings.pinning,
            checkpoint_seconds: self.settings.checkpoint_seconds,
            ..StagePodTemplate::new(
                operation,
                owner.clone(),
                &self.settings.agent_image,
                LocationSettings::of(location),
            )
        }
    }

    /// The creation of `planned`, complete ([`desired_stage_pod`]): its
    /// node's facts, its namespace's LimitRange minimum and the requests
    /// of the StoragePolicies selecting `classes` (the class name and
    /// provisioner of each of its claims), with `credentials` copied and
    /// what each claim's transfer carries.
    pub fn create_stage_pod(
        &self,
        template: &StagePodTemplate,
        planned: &PlannedStagePod,
        classes: &[(String, String)],
        credentials: BTreeMap<String, ByteString>,
        volumes: BTreeMap<String, TransferDetails>,
    ) -> Action {
        let node = self
            .nodes
            .iter()
            .find(|node| node.metadata.name.as_deref() == Some(planned.stage.node.as_str()))
            .and_then(|node| node_facts(node, None).ok());
        let policies: Vec<&haulage_api::StoragePolicy> =
            self.policies.iter().map(Arc::as_ref).collect();
        Action::CreateStagePod(Box::new(desired_stage_pod(
            template,
            &planned.stage,
            StagePodInputs {
                node: node.as_ref(),
                minimum: self.limit_minimums.get(&planned.stage.namespace).copied(),
                resources: resources_for(&policies, classes),
                credentials,
                volumes,
            },
        )))
    }

    /// The StagePodsCreated condition of `status` once planned
    /// ([`crate::supervision::note_stage_pods`], no refusals): True again
    /// when every stage pod of the plan exists.
    pub fn note_stage_pods<S: StagedStatus>(
        &self,
        status: &mut S,
        generation: Option<i64>,
        now: &Time,
    ) {
        let all_exist = status
            .plan()
            .map(|plan| self.missing_stage_pods(plan).is_empty());
        if let Some(all_exist) = all_exist {
            crate::supervision::note_stage_pods(
                status.conditions_mut(),
                &[],
                all_exist,
                generation,
                now,
            );
        }
    }

    /// Cancel a deleted object: mark its open transfers Canceled with
    /// `why` (agents watching them stop and abort their work), release
    /// its stage pods (those of `plan` and those in the cache), delete its
    /// transfers.
    pub fn cancel(&self, plan: Option<&BackupPlan>, why: &str, now: &Time) -> Vec<Action> {
        let mut actions: Vec<Action> = self
            .transfers
            .iter()
            .filter(|transfer| !transfer.phase().is_final())
            .map(|transfer| Action::WriteTransferStatus {
                transfer: transfer_name_of(transfer),
                status: Box::new(VolumeTransferStatus {
                    phase: Some(VolumeTransferPhase::Canceled),
                    message: Some(why.to_string()),
                    completion_time: Some(now.clone()),
                    ..VolumeTransferStatus::default()
                }),
            })
            .collect();
        actions.extend(self.release_by_plan(plan));
        actions.extend(
            self.transfers
                .iter()
                .map(|transfer| Action::DeleteTransfer(transfer_name_of(transfer))),
        );
        actions
    }
}

/// `namespace/name` of a namespaced object.
fn object_name(object: &impl ResourceExt) -> ObjectName {
    ObjectName::new(object.namespace().unwrap_or_default(), object.name_any())
}

/// The status of an object whose volumes are staged: a VolumeBackup's or
/// a VolumeRestore's (the progress-write throttle and what follows a
/// final status read it alike).
pub trait StagedStatus: Clone + PartialEq {
    /// The kind's phase.
    type Phase: Copy + PartialEq + Debug;
    /// The phase of success.
    const COMPLETED: Self::Phase;
    /// This status with `old`'s progress, volume counts and per-volume
    /// results.
    fn with_progress_of(&self, old: &Self) -> Self;
    /// Its conditions.
    fn conditions(&self) -> &[Condition];
    /// Its conditions, to change.
    fn conditions_mut(&mut self) -> &mut Vec<Condition>;
    /// Its phase, when final.
    fn final_phase(&self) -> Option<Self::Phase>;
    /// Its message.
    fn message(&self) -> Option<&str>;
    /// Its volume counts.
    fn volume_counts(&self) -> VolumeCounts;
    /// Its plan.
    fn plan(&self) -> Option<&BackupPlan>;
}

/// [`StagedStatus`] for status types of the same fields, each with its
/// phase type.
macro_rules! staged_status {
    ($($status:ident: $phase:ident),*) => {$(
        impl StagedStatus for $status {
            type Phase = $phase;
            const COMPLETED: $phase = $phase::Completed;
            fn with_progress_of(&self, old: &Self) -> Self {
                $status {
                    progress: old.progress.clone(),
                    volumes: old.volumes.clone(),
                    results: old.results.clone(),
                    ..self.clone()
                }
            }
            fn conditions(&self) -> &[Condition] {
                &self.conditions
            }
            fn conditions_mut(&mut self) -> &mut Vec<Condition> {
                &mut self.conditions
            }
            fn final_phase(&self) -> Option<$phase> {
                self.phase.filter(|phase| phase.is_final())
            }
            fn message(&self) -> Option<&str> {
                self.message.as_deref()
            }
            fn volume_counts(&self) -> VolumeCounts {
                self.volumes.clone().unwrap_or_default()
            }
            fn plan(&self) -> Option<&BackupPlan> {
                self.plan.as_ref()
            }
        }
    )*};
}

staged_status!(
    VolumeBackupStatus: VolumeBackupPhase,
    VolumeRestoreStatus: VolumeRestorePhase
);

/// Whether `status` differs from `old` only in what changes as the volumes
/// move (progress, volume counts, per-volume results and the Progressing
/// condition's message): such a write may wait for the throttle; a change
/// of phase, condition or plan, and the final status, are written at once.
pub fn is_progress_only<S: StagedStatus>(old: &S, status: &S) -> bool {
    let mut without_progress = status.with_progress_of(old);
    let progressing =
        |status: &S| find_condition(status.conditions(), condition_type::PROGRESSING).cloned();
    if let (Some(new), Some(previous)) = (progressing(&without_progress), progressing(old))
        && new.status == previous.status
        && new.reason == previous.reason
    {
        for condition in without_progress.conditions_mut() {
            if condition.type_ == condition_type::PROGRESSING {
                *condition = previous.clone();
            }
        }
    }
    without_progress == *old
}

/// Whether to write `status` now: a change of only what moves with the
/// volumes waits until [`PROGRESS_WRITE_INTERVAL`] after this replica's
/// last write. Returns the status to write (`None`: unchanged), or how
/// long the write waits.
pub fn status_to_write<S: StagedStatus>(
    old: &S,
    status: S,
    since_last_write: Option<Duration>,
) -> Result<Option<S>, Duration> {
    if status == *old {
        return Ok(None);
    }
    match since_last_write {
        Some(elapsed) if is_progress_only(old, &status) && elapsed < PROGRESS_WRITE_INTERVAL => {
            Err(PROGRESS_WRITE_INTERVAL - elapsed)
        }
        _ => Ok(Some(status)),
    }
}

/// What follows the write of `status` once it is final (`old`: the
/// status this reconcile started from): the finish Event, when it just
/// became final, and the release of what is left of the stage pods but
/// what `deciding` (this reconcile's actions) releases or deletes already
/// ([`StagingObservation::release_left`]). `done` says what happened to a
/// completed volume (`completed`, `restored`).
pub fn after_final_status<S: StagedStatus>(
    staging: &StagingObservation,
    (old, status): (&S, &S),
    deciding: &[Action],
    done: &str,
) -> Vec<Action> {
    let Some(phase) = status.final_phase() else {
        return Vec::new();
    };
    let mut after_status = Vec::new();
    if old.final_phase() != Some(phase) {
        let counts = status.volume_counts();
        let note = status
            .message()
            .map_or_else(|| format!("{phase:?}"), str::to_string);
        let note = format!(
            "{note} ({} of {} volumes {done}, {} failed)",
            counts.completed, counts.total, counts.failed
        );
        after_status.push(Action::Emit(if phase == S::COMPLETED {
            Event::normal("Completed", "Finish", note)
        } else {
            Event::warning(format!("{phase:?}"), "Finish", note)
        }));
    }
    after_status.extend(staging.release_left(deciding));
    after_status
}
