//! The VolumeBackup status as a pure function: what the reconciler
//! observed (storage location, plan, transfers) and the old status go in,
//! the next status comes out. No client, no clock: `now` is an argument, so
//! every phase change is a plain unit test.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use haulage_api::backup::{BackupPlan, VolumeCounts, VolumeResult};
use haulage_api::condition::{Condition, ConditionStatus, condition_type, reason, set_condition};
use haulage_api::{Progress, VolumeBackupPhase, VolumeBackupStatus, VolumeTransferPhase};

/// What the reconciler found about the backup's storage location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StorageState {
    /// No BackupStorageLocation of that name (or no default one).
    Missing {
        /// The name looked for, or a description of the default.
        name: String,
    },
    /// The location exists but its last probe failed (or none ran yet).
    Unavailable {
        /// Its name.
        name: String,
        /// Why, from its status.
        message: String,
    },
    /// The location's last probe succeeded.
    Available {
        /// Its name.
        name: String,
    },
}

/// One VolumeTransfer of the backup, as observed in the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferObservation {
    /// Namespace of the claim.
    pub namespace: String,
    /// Claim name.
    pub pvc: String,
    /// Phase of the transfer (`New` when its status is still empty).
    pub phase: VolumeTransferPhase,
    /// Its progress, if the agent reported any.
    pub progress: Option<Progress>,
    /// The snapshot written, once Completed.
    pub snapshot_id: Option<String>,
    /// A benchmark's figures, once Completed.
    pub benchmark: Option<haulage_api::benchmark::ClaimBenchmark>,
    /// Why it failed, or its warnings.
    pub message: Option<String>,
}

/// Everything the next status depends on besides the old one.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// The VolumeBackup's `metadata.generation`.
    pub generation: Option<i64>,
    /// The replica that owns the backup (this one, once claimed).
    pub replica: String,
    /// The replica it was adopted from, when its lease expired.
    pub adopted_from: Option<String>,
    /// The storage location's state.
    pub storage: StorageState,
    /// The spec's `failAfterUnavailableSeconds`.
    pub fail_after_unavailable_seconds: Option<i64>,
    /// Whether the spec asks for a benchmark instead of a backup.
    pub benchmark: bool,
    /// The stage-pod plan, once made.
    pub plan: Option<BackupPlan>,
    /// The backup's transfers (any order).
    pub transfers: Vec<TransferObservation>,
    /// Why there is no plan yet, when it waits for something (a claim
    /// still binding).
    pub waiting: Option<String>,
}

/// The next status of a VolumeBackup.
///
/// A final phase is never left. Otherwise: an unusable storage location
/// means `WaitingForStorage` (or `Failed` once `failAfterUnavailableSeconds`
/// have passed since the start), no plan yet means `Planning`, and with a
/// plan the phase follows the volumes: all final gives `Completed` (every
/// volume has a snapshot), `Failed` (none has) or `PartiallyFailed`;
/// anything else is `InProgress`. Unplaceable volumes count as failed with
/// the planner's reason. A plan selecting no volume fails the backup, since
/// that is almost always a wrong selector or namespace.
pub fn next_status(old: &VolumeBackupStatus, observed: &Observed, now: Time) -> VolumeBackupStatus {
    let mut status = old.clone();
    if old.phase.is_some_and(VolumeBackupPhase::is_final) {
        return status;
    }
    let generation = observed.generation;
    let start = status.start_time.clone().unwrap_or_else(|| now.clone());
    status.start_time = Some(start.clone());
    status.observed_generation = generation;
    let conditions = Conditions {
        generation,
        now: now.clone(),
    };
    let set = |status: &mut VolumeBackupStatus, type_, state, why, message: &str| {
        conditions.set(&mut status.conditions, type_, state, why, message);
    };
    conditions.claimed(
        &mut status.conditions,
        &observed.replica,
        observed.adopted_from.as_deref(),
    );

    // Once planned, the agents talk to the storage themselves and report
    // their own failures; only a backup that has not started waits for
    // the location.
    if let Some(storage_message) = conditions.storage(&mut status.conditions, &observed.storage)
        && observed.plan.is_none()
    {
        let waited = now.0.as_second() - start.0.as_second();
        let timed_out = observed
            .fail_after_unavailable_seconds
            .is_some_and(|limit| waited >= limit);
        if timed_out {
            let message = format!("{storage_message}; gave up after {waited}s");
            set(
                &mut status,
                condition_type::FAILED,
                ConditionStatus::True,
                reason::STORAGE_UNAVAILABLE_TIMEOUT,
                &message,
            );
            status.phase = Some(VolumeBackupPhase::Failed);
            status.message = Some(haulage_api::condition::bounded_message(&message));
            status.completion_time = Some(now.clone());
        } else {
            status.phase = Some(VolumeBackupPhase::WaitingForStorage);
            status.message = Some(haulage_api::condition::bounded_message(&storage_message));
        }
        return status;
    }

    let Some(plan) = &observed.plan else {
        status.phase = Some(VolumeBackupPhase::Planning);
        status.message = observed
            .waiting
            .as_deref()
            .map(crate::backup_status::bounded);
        return status;
    };
    status.plan = Some(plan.clone());
    conditions.planned(&mut status.conditions, plan);

    let (results, progress) = volume_results(plan, &observed.transfers);
    let counts = VolumeCounts::from_phases(results.iter().map(|result| result.phase));
    status.progress = Some(Progress::sum(&progress));
    status.benchmarks = haulage_api::benchmark::by_storage_class(
        results
            .iter()
            .filter_map(|result| result.benchmark.as_ref()),
    );
    status.results = results;

    status.volumes = Some(counts.clone());
    let rolled_up = conditions.roll_up(
        &mut status.conditions,
        &counts,
        final_phase(&counts, observed.benchmark),
        [VolumeBackupPhase::Completed, VolumeBackupPhase::InProgress],
    );
    status.phase = Some(rolled_up.phase);
    status.message = rolled_up.message;
    if let Some(completion_time) = rolled_up.completion_time {
        status.completion_time = Some(completion_time);
    }
    status
}

/// A message bounded for a status.
fn bounded(message: &str) -> String {
    haulage_api::condition::bounded_message(message)
}

/// What [`Conditions::roll_up`] gives a status: its phase, its message,
/// and its completion time once final.
pub(crate) struct RolledUp<P> {
    pub(crate) phase: P,
    pub(crate) message: Option<String>,
    pub(crate) completion_time: Option<Time>,
}

/// The generation and time every condition of one status write carries;
/// backups, restores and storage locations write their conditions through it.
pub(crate) struct Conditions {
    pub(crate) generation: Option<i64>,
    pub(crate) now: Time,
}

impl Conditions {
    /// Set condition `type_` in `conditions`.
    pub(crate) fn set(
        &self,
        conditions: &mut Vec<Condition>,
        type_: &str,
        state: ConditionStatus,
        why: &str,
        message: &str,
    ) {
        set_condition(
            conditions,
            Condition::new(
                type_,
                state,
                why,
                message,
                self.generation,
                self.now.clone(),
            ),
            self.now.clone(),
        );
    }

    /// The Claimed condition of an object `replica` owns, adopted from
    /// replica `adopted_from` when that one's lease expired.
    pub(crate) fn claimed(
        &self,
        conditions: &mut Vec<Condition>,
        replica: &str,
        adopted_from: Option<&str>,
    ) {
        match adopted_from {
            None => self.set(
                conditions,
                condition_type::CLAIMED,
                ConditionStatus::True,
                reason::CLAIMED_BY_REPLICA,
                &format!("claimed by replica {replica}"),
            ),
            Some(previous) => self.set(
                conditions,
                condition_type::CLAIMED,
                ConditionStatus::True,
                reason::ADOPTED_FROM_REPLICA,
                &format!(
                    "claimed by replica {replica}, adopted from replica {previous} after its lease expired"
                ),
            ),
        }
    }

    /// The StorageAvailable condition of the object's location in
    /// `storage`; returns what is wrong with the location (`None` when it
    /// is Available).
    pub(crate) fn storage(
        &self,
        conditions: &mut Vec<Condition>,
        storage: &StorageState,
    ) -> Option<String> {
        let (state, why, message) = match storage {
            StorageState::Available { name } => (
                ConditionStatus::True,
                reason::STORAGE_LOCATION_AVAILABLE,
                format!("BackupStorageLocation {name} is Available"),
            ),
            StorageState::Missing { name } => (
                ConditionStatus::False,
                reason::STORAGE_LOCATION_NOT_FOUND,
                format!("BackupStorageLocation {name} does not exist"),
            ),
            StorageState::Unavailable { name, message } => (
                ConditionStatus::False,
                reason::STORAGE_LOCATION_UNAVAILABLE,
                format!("BackupStorageLocation {name} is Unavailable: {message}"),
            ),
        };
        self.set(
            conditions,
            condition_type::STORAGE_AVAILABLE,
            state,
            why,
            &message,
        );
        (state == ConditionStatus::False).then_some(message)
    }

    /// The Planned condition of `plan`: how many volumes it placed in how
    /// many stage pods, and how many it could not place.
    pub(crate) fn planned(&self, conditions: &mut Vec<Condition>, plan: &BackupPlan) {
        let placed_count: usize = plan
            .stage_pods
            .iter()
            .map(|pod| pod.stage.volumes.len())
            .sum();
        self.set(
            conditions,
            condition_type::PLANNED,
            ConditionStatus::True,
            if plan.unplaceable.is_empty() {
                reason::PLAN_COMPLETE
            } else {
                reason::VOLUMES_UNPLACEABLE
            },
            &format!(
                "{placed_count} volumes in {} stage pods, {} unplaceable",
                plan.stage_pods.len(),
                plan.unplaceable.len()
            ),
        );
    }

    /// The phase, message and conditions of an object whose volumes are at
    /// `counts`: with `outcome` (their final phase, its reason and message)
    /// those of a finished one ([`Conditions::finished`], succeeded when
    /// the phase is the first of `[completed, in_progress]`), without it
    /// `in_progress` ([`Conditions::running`]).
    pub(crate) fn roll_up<P: Copy + PartialEq>(
        &self,
        conditions: &mut Vec<Condition>,
        counts: &VolumeCounts,
        outcome: Option<(P, &str, String)>,
        [completed, in_progress]: [P; 2],
    ) -> RolledUp<P> {
        match outcome {
            Some((phase, why, message)) => {
                self.finished(conditions, phase == completed, why, &message);
                RolledUp {
                    phase,
                    message: Some(bounded(&message)),
                    completion_time: Some(self.now.clone()),
                }
            }
            None => {
                self.running(conditions, counts);
                RolledUp {
                    phase: in_progress,
                    message: None,
                    completion_time: None,
                }
            }
        }
    }

    /// The Progressing, Complete and Failed conditions of an object whose
    /// volumes are all final (`succeeded`: it is Completed), for `why`.
    pub(crate) fn finished(
        &self,
        conditions: &mut Vec<Condition>,
        succeeded: bool,
        why: &str,
        message: &str,
    ) {
        let (complete, failed) = if succeeded {
            (ConditionStatus::True, ConditionStatus::False)
        } else {
            (ConditionStatus::False, ConditionStatus::True)
        };
        self.set(
            conditions,
            condition_type::PROGRESSING,
            ConditionStatus::False,
            why,
            message,
        );
        self.set(conditions, condition_type::COMPLETE, complete, why, message);
        self.set(conditions, condition_type::FAILED, failed, why, message);
    }

    /// The Progressing condition of an object whose volumes still move,
    /// with their `counts`.
    pub(crate) fn running(&self, conditions: &mut Vec<Condition>, counts: &VolumeCounts) {
        let message = format!(
            "{} of {} volumes done, {} running, {} pending",
            counts.completed + counts.failed + counts.canceled,
            counts.total,
            counts.in_progress,
            counts.pending
        );
        self.set(
            conditions,
            condition_type::PROGRESSING,
            ConditionStatus::True,
            reason::TRANSFERS_RUNNING,
            &message,
        );
    }
}

/// Each volume's result (placed ones from their transfers, unplaceable
/// ones failed with the planner's reason), sorted by namespace and claim,
/// and the progress of those that reported any.
fn volume_results(
    plan: &BackupPlan,
    transfers: &[TransferObservation],
) -> (Vec<VolumeResult>, Vec<Progress>) {
    let placed_count: usize = plan
        .stage_pods
        .iter()
        .map(|pod| pod.stage.volumes.len())
        .sum();
    let mut results = Vec::with_capacity(placed_count + plan.unplaceable.len());
    let mut progress = Vec::new();
    for pod in plan.stage_pods.iter().map(|planned| &planned.stage) {
        for pvc in &pod.volumes {
            let transfer = transfers
                .iter()
                .find(|transfer| transfer.namespace == pod.namespace && &transfer.pvc == pvc);
            results.push(VolumeResult {
                namespace: pod.namespace.clone(),
                pvc: pvc.clone(),
                phase: transfer.map_or(VolumeTransferPhase::New, |transfer| transfer.phase),
                snapshot_id: transfer.and_then(|transfer| transfer.snapshot_id.clone()),
                message: transfer.and_then(|transfer| transfer.message.clone()),
                benchmark: transfer.and_then(|transfer| transfer.benchmark.clone()),
            });
            if let Some(part) = transfer.and_then(|transfer| transfer.progress.as_ref()) {
                progress.push(part.clone());
            }
        }
    }
    for volume in &plan.unplaceable {
        results.push(VolumeResult {
            namespace: volume.namespace.clone(),
            pvc: volume.pvc.clone(),
            phase: VolumeTransferPhase::Failed,
            snapshot_id: None,
            message: Some(volume.reason.clone()),
            benchmark: None,
        });
    }
    results.sort_by(|a, b| (&a.namespace, &a.pvc).cmp(&(&b.namespace, &b.pvc)));
    (results, progress)
}

/// What the volume counts of a backup or a restore say once every volume
/// is final (one rule for both; each names the phases in its own words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalCounts {
    /// No volume was selected.
    NoVolumes,
    /// Every volume completed.
    AllCompleted,
    /// None completed.
    NoneCompleted,
    /// Some completed, some failed or were canceled.
    SomeCompleted,
}

impl FinalCounts {
    /// `None` while some volume is not final.
    pub fn of(counts: &VolumeCounts) -> Option<FinalCounts> {
        let all_final = counts.completed + counts.failed + counts.canceled == counts.total;
        if counts.total == 0 {
            Some(FinalCounts::NoVolumes)
        } else if !all_final {
            None
        } else if counts.completed == counts.total {
            Some(FinalCounts::AllCompleted)
        } else if counts.completed == 0 {
            Some(FinalCounts::NoneCompleted)
        } else {
            Some(FinalCounts::SomeCompleted)
        }
    }
}

/// The final phase the volume counts give, with its reason and message:
/// `None` while some volume is not final. A plan selecting no volume fails
/// the backup, since that is almost always a wrong selector or namespace.
/// A `benchmark`'s volumes are measured, not given a snapshot.
fn final_phase(
    counts: &VolumeCounts,
    benchmark: bool,
) -> Option<(VolumeBackupPhase, &'static str, String)> {
    let (have, has) = if benchmark {
        ("were measured", "was measured")
    } else {
        ("have a snapshot", "has a snapshot")
    };
    Some(match FinalCounts::of(counts)? {
        FinalCounts::NoVolumes => (
            VolumeBackupPhase::Failed,
            reason::NO_VOLUMES_SELECTED,
            "no PersistentVolumeClaim matches the namespaces and selector".to_string(),
        ),
        FinalCounts::AllCompleted => (
            VolumeBackupPhase::Completed,
            reason::ALL_VOLUMES_COMPLETED,
            format!("all {} volumes {have}", counts.total),
        ),
        FinalCounts::NoneCompleted => (
            VolumeBackupPhase::Failed,
            reason::ALL_VOLUMES_FAILED,
            format!("none of the {} volumes {has}", counts.total),
        ),
        FinalCounts::SomeCompleted => (
            VolumeBackupPhase::PartiallyFailed,
            reason::SOME_VOLUMES_FAILED,
            format!(
                "{} of {} volumes {have}, {} failed, {} canceled",
                counts.completed, counts.total, counts.failed, counts.canceled
            ),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::at;
    use haulage_api::backup::{PlannedStagePod, UnplaceableVolume};
    use haulage_api::condition::find_condition;

    #[test]
    fn the_final_counts_are_read_the_same_for_backups_and_restores() {
        let counts = |total, completed, failed, canceled| VolumeCounts {
            total,
            completed,
            failed,
            canceled,
            ..VolumeCounts::default()
        };
        assert_eq!(
            FinalCounts::of(&counts(0, 0, 0, 0)),
            Some(FinalCounts::NoVolumes)
        );
        assert_eq!(
            FinalCounts::of(&counts(3, 2, 0, 0)),
            None,
            "one is not final"
        );
        assert_eq!(
            FinalCounts::of(&counts(3, 3, 0, 0)),
            Some(FinalCounts::AllCompleted)
        );
        assert_eq!(
            FinalCounts::of(&counts(3, 0, 2, 1)),
            Some(FinalCounts::NoneCompleted)
        );
        assert_eq!(
            FinalCounts::of(&counts(3, 1, 1, 1)),
            Some(FinalCounts::SomeCompleted)
        );
    }

    fn observed(storage: StorageState) -> Observed {
        Observed {
            generation: Some(1),
            replica: "controller-0".to_string(),
            adopted_from: None,
            storage,
            fail_after_unavailable_seconds: None,
            benchmark: false,
            plan: None,
            transfers: Vec::new(),
            waiting: None,
        }
    }

    fn available() -> StorageState {
        StorageState::Available {
            name: "s3".to_string(),
        }
    }

    fn plan(volumes: &[&str], unplaceable: &[&str]) -> BackupPlan {
        BackupPlan {
            stage_pods: vec![PlannedStagePod {
                pod_name: "haulage-backup-nightly-node-a".to_string(),
                stage: haulage_plan::StagePod {
                    namespace: "shop".to_string(),
                    node: "node-a".to_string(),
                    volumes: volumes.iter().map(|v| v.to_string()).collect(),
                    bytes: 10,
                },
            }],
            unplaceable: unplaceable
                .iter()
                .map(|pvc| UnplaceableVolume {
                    namespace: "shop".to_string(),
                    pvc: pvc.to_string(),
                    reason: "claim is Pending".to_string(),
                })
                .collect(),
        }
    }

    fn transfer(pvc: &str, phase: VolumeTransferPhase, done: i64) -> TransferObservation {
        TransferObservation {
            namespace: "shop".to_string(),
            pvc: pvc.to_string(),
            phase,
            progress: Some(Progress {
                total_bytes: 100,
                bytes_done: done,
                ..Progress::default()
            }),
            snapshot_id: (phase == VolumeTransferPhase::Completed).then(|| format!("snap-{pvc}")),
            benchmark: None,
            message: None,
        }
    }

    #[test]
    fn a_benchmarks_figures_go_into_its_volumes_results_and_per_storage_class() {
        use haulage_api::benchmark::ClaimBenchmark;
        let figures = |class: &str, bytes: i64, pace: i64| ClaimBenchmark {
            storage_class: Some(class.to_string()),
            bytes,
            estimate_bytes_per_second: pace,
            limited_by: "read".to_string(),
            ..ClaimBenchmark::default()
        };
        let mut seen = observed(available());
        seen.plan = Some(plan(&["a", "b", "c"], &[]));
        let measured = |pvc: &str, benchmark: ClaimBenchmark| TransferObservation {
            snapshot_id: None,
            benchmark: Some(benchmark),
            ..transfer(pvc, VolumeTransferPhase::Completed, 100)
        };
        seen.transfers = vec![
            measured("a", figures("ceph", 100, 10)),
            measured("b", figures("local", 30, 30)),
            transfer("c", VolumeTransferPhase::InProgress, 50),
        ];
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        assert_eq!(
            status.results[1].benchmark.as_ref().map(|b| b.bytes),
            Some(30)
        );
        assert_eq!(status.results[2].benchmark, None);
        let classes: Vec<_> = status
            .benchmarks
            .iter()
            .map(|class| {
                (
                    class.storage_class.as_str(),
                    class.claims,
                    class.estimate_seconds,
                )
            })
            .collect();
        assert_eq!(classes, [("ceph", 1, 10), ("local", 1, 1)]);
        seen.benchmark = true;
        seen.transfers[2] = measured("c", figures("ceph", 0, 10));
        let status = next_status(&status, &seen, at(1));
        assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
        assert_eq!(
            status.message.as_deref(),
            Some("all 3 volumes were measured")
        );
    }

    #[test]
    fn an_unavailable_location_makes_the_backup_wait_with_a_condition() {
        let seen = observed(StorageState::Unavailable {
            name: "s3".to_string(),
            message: "connection refused".to_string(),
        });
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        assert_eq!(status.phase, Some(VolumeBackupPhase::WaitingForStorage));
        let condition =
            find_condition(&status.conditions, condition_type::STORAGE_AVAILABLE).expect("set");
        assert_eq!(condition.status, ConditionStatus::False);
        assert_eq!(condition.reason, reason::STORAGE_LOCATION_UNAVAILABLE);
        assert!(condition.message.contains("connection refused"));
    }

    #[test]
    fn waiting_longer_than_fail_after_unavailable_seconds_fails_the_backup() {
        let mut seen = observed(StorageState::Missing {
            name: "s3".to_string(),
        });
        seen.fail_after_unavailable_seconds = Some(60);
        let waiting = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        let still = next_status(&waiting, &seen, at(59));
        assert_eq!(still.phase, Some(VolumeBackupPhase::WaitingForStorage));
        let failed = next_status(&still, &seen, at(60));
        assert_eq!(failed.phase, Some(VolumeBackupPhase::Failed));
        assert_eq!(
            find_condition(&failed.conditions, condition_type::FAILED).map(|c| c.reason.as_str()),
            Some(reason::STORAGE_UNAVAILABLE_TIMEOUT)
        );
    }

    #[test]
    fn an_available_location_without_a_plan_is_planning() {
        let status = next_status(
            &VolumeBackupStatus::default(),
            &observed(available()),
            at(0),
        );
        assert_eq!(status.phase, Some(VolumeBackupPhase::Planning));
    }

    #[test]
    fn running_transfers_roll_up_into_progress_and_counts() {
        let mut seen = observed(available());
        seen.plan = Some(plan(&["a", "b", "c"], &[]));
        seen.transfers = vec![
            transfer("a", VolumeTransferPhase::Completed, 100),
            transfer("b", VolumeTransferPhase::InProgress, 50),
        ];
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        assert_eq!(status.phase, Some(VolumeBackupPhase::InProgress));
        let counts = status.volumes.expect("counts");
        assert_eq!((counts.total, counts.completed), (3, 1));
        assert_eq!((counts.in_progress, counts.pending), (1, 1));
        let progress = status.progress.expect("progress");
        assert_eq!((progress.bytes_done, progress.total_bytes), (150, 200));
        assert_eq!(status.results[0].snapshot_id.as_deref(), Some("snap-a"));
    }

    #[test]
    fn every_volume_completed_completes_the_backup() {
        let mut seen = observed(available());
        seen.plan = Some(plan(&["a", "b"], &[]));
        seen.transfers = vec![
            transfer("a", VolumeTransferPhase::Completed, 100),
            transfer("b", VolumeTransferPhase::Completed, 100),
        ];
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(5));
        assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
        assert_eq!(status.completion_time, Some(at(5)));
        assert_eq!(
            find_condition(&status.conditions, condition_type::COMPLETE).map(|c| c.status),
            Some(ConditionStatus::True)
        );
    }

    #[test]
    fn an_unplaceable_volume_makes_the_backup_partially_failed_with_its_reason() {
        let mut seen = observed(available());
        seen.plan = Some(plan(&["a"], &["pending"]));
        seen.transfers = vec![transfer("a", VolumeTransferPhase::Completed, 100)];
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        assert_eq!(status.phase, Some(VolumeBackupPhase::PartiallyFailed));
        let failed = status
            .results
            .iter()
            .find(|result| result.pvc == "pending")
            .expect("listed");
        assert_eq!(failed.phase, VolumeTransferPhase::Failed);
        assert_eq!(failed.message.as_deref(), Some("claim is Pending"));
    }

    #[test]
    fn no_volume_with_a_snapshot_fails_the_backup() {
        let mut seen = observed(available());
        seen.plan = Some(plan(&["a"], &[]));
        seen.transfers = vec![transfer("a", VolumeTransferPhase::Failed, 10)];
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        assert_eq!(status.phase, Some(VolumeBackupPhase::Failed));
    }

    #[test]
    fn a_plan_that_selects_nothing_fails_the_backup() {
        let mut seen = observed(available());
        seen.plan = Some(BackupPlan::default());
        let status = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        assert_eq!(status.phase, Some(VolumeBackupPhase::Failed));
        assert_eq!(
            find_condition(&status.conditions, condition_type::FAILED).map(|c| c.reason.as_str()),
            Some(reason::NO_VOLUMES_SELECTED)
        );
    }

    #[test]
    fn a_final_phase_is_never_left() {
        let done = VolumeBackupStatus {
            phase: Some(VolumeBackupPhase::Completed),
            ..VolumeBackupStatus::default()
        };
        let seen = observed(StorageState::Missing {
            name: "s3".to_string(),
        });
        assert_eq!(next_status(&done, &seen, at(0)), done);
    }

    #[test]
    fn an_unchanged_condition_keeps_its_transition_time() {
        let mut seen = observed(available());
        seen.plan = Some(plan(&["a"], &[]));
        let first = next_status(&VolumeBackupStatus::default(), &seen, at(0));
        let second = next_status(&first, &seen, at(30));
        let time = |status: &VolumeBackupStatus| {
            find_condition(&status.conditions, condition_type::PROGRESSING)
                .map(|c| c.last_transition_time.clone())
        };
        assert_eq!(time(&first), time(&second));
        assert_eq!(time(&second), Some(at(0)));
    }
}
