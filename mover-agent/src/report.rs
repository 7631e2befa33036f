//! What the agent writes into a VolumeTransfer's status, as typed
//! [`VolumeTransferStatus`] values computed from the engine's counters:
//! pure functions, so "never backwards", the claim and the final figures
//! (a backup's [`completed_status`]; a restore's [`restored_status`] from
//! its [`restore_verdict`]) are unit tests. Each value is server-side applied whole by the agent's
//! field manager, so it names every field the agent owns at that moment
//! (a field left out of an apply is dropped).

use haulage::api::benchmark::ClaimBenchmark;
use haulage::api::condition::{
    Condition, ConditionStatus, bounded_message, condition_type, reason,
};
use haulage::api::transfer::AgentClaim;
use haulage::api::{Progress, VolumeTransferPhase, VolumeTransferStatus};
use haulage::engine::progress::ProgressSnapshot;
use haulage::engine::restore::RestoreOutcome;
use haulage::engine::verify_tree::TreeVerification;
use haulage::store::FailureCause;
use haulage::store::outage::{EndedOutage, OutageReport, Retries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The progress to report now, from the engine's counters, the last
/// report and the seconds since it. Every counter is at least what was
/// reported before (an engine restart after a resume starts its counters
/// from zero; the status must not jump back), the rate is over the last
/// interval and the ETA follows from it.
pub fn next_progress(
    counters: &ProgressSnapshot,
    previous: Option<&Progress>,
    seconds_since_previous: f64,
) -> Progress {
    let previous = previous.cloned().unwrap_or_default();
    let bytes_done = signed(counters.bytes_done).max(previous.bytes_done);
    let total_bytes = signed(counters.total_bytes)
        .max(previous.total_bytes)
        .max(bytes_done);
    let rate = if seconds_since_previous > 0.0 {
        ((bytes_done - previous.bytes_done) as f64 / seconds_since_previous) as i64
    } else {
        previous.bytes_per_second
    };
    let left = total_bytes - bytes_done;
    let eta_seconds = if left == 0 {
        Some(0)
    } else if rate > 0 && counters.totals_known {
        Some(left / rate)
    } else {
        None
    };
    Progress {
        total_bytes,
        bytes_done,
        total_files: signed(counters.total_files).max(previous.total_files),
        files_done: signed(counters.files_done).max(previous.files_done),
        // Compressed bytes of new data packed for upload: the engine does
        // not count bytes the store acknowledged, and packing runs ahead
        // of a throttled upload by the packs queued behind it.
        bytes_uploaded: signed(counters.bytes_stored).max(previous.bytes_uploaded),
        bytes_per_second: rate.max(0),
        eta_seconds,
        percent: 0,
    }
    .with_percent(false)
}

/// The agent's claim of a transfer, renewed with each report: who works on
/// it, since when (the `earlier` claim's time, kept across restarts), when
/// it last moved the volume forward (now when `moved`: this report's
/// `bytesDone` is above every earlier one; else the `earlier` claim's),
/// and now.
pub fn agent_claim(
    identity: &str,
    earlier: Option<&AgentClaim>,
    moved: bool,
    now: &Time,
) -> AgentClaim {
    AgentClaim {
        identity: identity.to_string(),
        claimed_at: earlier.map_or_else(|| now.clone(), |claim| claim.claimed_at.clone()),
        heartbeat_time: now.clone(),
        progress_time: if moved {
            Some(now.clone())
        } else {
            earlier.and_then(|claim| claim.progress_time.clone())
        },
    }
}

/// Whether `report` moved the volume past the report before it.
pub fn moved_forward(report: &Progress, before: Option<&Progress>) -> bool {
    report.bytes_done > before.map_or(0, |before| before.bytes_done)
}

/// The status part of the claim (a merge patch conditional on the
/// resourceVersion read): InProgress, this agent, and the start time (the
/// first claim's, when a restarted agent claims again).
pub fn claim_status(
    old: &VolumeTransferStatus,
    identity: &str,
    now: &Time,
) -> VolumeTransferStatus {
    VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::InProgress),
        agent: Some(agent_claim(identity, old.agent.as_ref(), false, now)),
        start_time: Some(old.start_time.clone().unwrap_or_else(|| now.clone())),
        ..VolumeTransferStatus::default()
    }
}

/// A progress report: still InProgress, the progress, the heartbeat.
pub fn progress_status(progress: Progress, agent: AgentClaim) -> VolumeTransferStatus {
    VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::InProgress),
        progress: Some(progress),
        agent: Some(agent),
        ..VolumeTransferStatus::default()
    }
}

/// What the agent knows of its storage location's outages when it
/// reports ([`haulage::store::outage::Outage`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StorageSeen {
    /// The outage going on now.
    pub current: Option<OutageReport>,
    /// The latest outage that ended.
    pub last_ended: Option<EndedOutage>,
    /// The transfer's `failAfterUnavailableSeconds`.
    pub give_up_after_seconds: Option<u64>,
    /// Whether an operation gave up on an outage longer than that.
    pub gave_up: bool,
    /// The failed requests retried within the budget, short of an outage.
    pub retries: Retries,
}

/// The `StorageAvailable` condition of a transfer's reports: `False` while
/// the location does not answer (the volume paused, since when, the latest
/// error, when it gives up), `True` once it answers again after an outage
/// (how long it lasted), `True` with reason `StorageRequestsRetried` when
/// it answers but throttled or failed requests that were retried (how
/// many: the volume moves slower), none when all went well.
pub fn storage_condition(seen: &StorageSeen, generation: Option<i64>) -> Option<Condition> {
    if let Some(current) = &seen.current {
        let limit = match seen.give_up_after_seconds {
            Some(seconds) => {
                format!("the volume fails if it lasts {seconds}s (failAfterUnavailableSeconds)")
            }
            None => "it waits as long as it takes (no failAfterUnavailableSeconds)".to_string(),
        };
        // A want of this agent's descriptors is not the location's silence:
        // said as what it is, under a reason of its own, so nobody goes
        // looking at the server.
        let (what, resumes, why) = if current.cause == FailureCause::OutOfDescriptors {
            (
                "this agent has had no file descriptor free to reach the storage location",
                "once a descriptor is free",
                reason::AGENT_OUT_OF_FILE_DESCRIPTORS,
            )
        } else {
            (
                "the storage location has not answered",
                "when the location answers",
                reason::STORAGE_LOCATION_UNAVAILABLE,
            )
        };
        let message = format!(
            "{what} for {}s: {}; the volume is paused, what it stored is kept, and it resumes by itself {resumes}; {limit}",
            current.lasted.as_secs(),
            current.error
        );
        return Some(Condition::new(
            condition_type::STORAGE_AVAILABLE,
            ConditionStatus::False,
            why,
            &message,
            generation,
            haulage::clock::time_of(current.since),
        ));
    }
    let retried = seen.retries;
    let retried_text = (retried.total() > 0).then(|| {
        format!(
            "the storage location throttled {} of this agent's requests (503 SlowDown, 429) and {} more failed transiently (cut connections, timeouts, 5xx); each was retried after a backoff, so the volume moves slower and nothing failed",
            retried.throttled, retried.other
        )
    });
    if let Some(ended) = &seen.last_ended {
        let what = if ended.cause == FailureCause::OutOfDescriptors {
            "this agent has a file descriptor free again to reach the storage location, after waiting"
        } else {
            "the storage location answers again after an outage of"
        };
        let mut message = format!(
            "{what} {}s; the volume resumed where it was",
            ended.lasted.as_secs()
        );
        if let Some(retried_text) = retried_text {
            message = format!("{message}; {retried_text}");
        }
        return Some(Condition::new(
            condition_type::STORAGE_AVAILABLE,
            ConditionStatus::True,
            reason::STORAGE_LOCATION_AVAILABLE,
            &message,
            generation,
            haulage::clock::time_of(ended.since + ended.lasted),
        ));
    }
    Some(Condition::new(
        condition_type::STORAGE_AVAILABLE,
        ConditionStatus::True,
        reason::STORAGE_REQUESTS_RETRIED,
        &retried_text?,
        generation,
        haulage::clock::time_of(retried.since?),
    ))
}

/// What a finished backup of a volume produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupFigures {
    /// The snapshot written.
    pub snapshot_id: String,
    /// Bytes read from the volume.
    pub bytes_read: u64,
    /// Bytes not in the repository before.
    pub bytes_new: u64,
    /// Bytes stored after compression.
    pub bytes_stored: u64,
    /// Files that could not be read.
    pub warning_count: u64,
    /// The first warning, if any.
    pub first_warning: Option<String>,
}

/// What every final status carries besides the outcome: the progress at
/// the end, the agent's claim, the transfer's generation (the conditions
/// observed it) and when the transfer ended.
#[derive(Debug, Clone)]
pub struct Ending {
    /// The progress as the engine left it.
    pub progress: Progress,
    /// The agent's claim, renewed at `time`.
    pub agent: AgentClaim,
    /// The transfer's `metadata.generation`.
    pub generation: Option<i64>,
    /// When the transfer ended.
    pub time: Time,
}

/// `progress` of a volume moved completely: every byte done, no time
/// left, 100 %.
fn done(progress: Progress) -> Progress {
    Progress {
        bytes_done: progress.total_bytes,
        eta_seconds: Some(0),
        ..progress
    }
    .with_percent(true)
}

impl Ending {
    /// What every final status holds: the claim and the completion time.
    fn final_status(&self) -> VolumeTransferStatus {
        VolumeTransferStatus {
            agent: Some(self.agent.clone()),
            completion_time: Some(self.time.clone()),
            ..VolumeTransferStatus::default()
        }
    }

    /// A condition of the final status, observing the generation, set at
    /// the end.
    fn condition(
        &self,
        type_: &str,
        status: ConditionStatus,
        why: &str,
        message: &str,
    ) -> Condition {
        Condition::new(
            type_,
            status,
            why,
            message,
            self.generation,
            self.time.clone(),
        )
    }
}

/// The final status of a volume backed up: Completed with its snapshot
/// and figures, progress at 100 %.
pub fn completed_status(ending: Ending, figures: &BackupFigures) -> VolumeTransferStatus {
    let message = figures
        .first_warning
        .as_ref()
        .map(|warning| format!("{} warnings, first: {warning}", figures.warning_count));
    VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::Completed),
        progress: Some(done(ending.progress.clone())),
        snapshot_id: Some(figures.snapshot_id.clone()),
        bytes_read: Some(signed(figures.bytes_read)),
        bytes_new: Some(signed(figures.bytes_new)),
        bytes_stored: Some(signed(figures.bytes_stored)),
        warnings: Some(signed(figures.warning_count)),
        message: message.map(|message| bounded_message(&message)),
        conditions: vec![ending.condition(
            condition_type::COMPLETE,
            ConditionStatus::True,
            reason::ALL_VOLUMES_COMPLETED,
            "snapshot written",
        )],
        ..ending.final_status()
    }
}

/// The final status of a volume measured by a benchmark, with its figures.
pub fn measured_status(ending: Ending, figures: ClaimBenchmark) -> VolumeTransferStatus {
    VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::Completed),
        progress: Some(done(ending.progress.clone())),
        conditions: vec![ending.condition(
            condition_type::COMPLETE,
            ConditionStatus::True,
            reason::ALL_VOLUMES_COMPLETED,
            "benchmark measured; nothing stored",
        )],
        benchmark: Some(figures),
        ..ending.final_status()
    }
}

/// The final status of a volume that failed, with what went wrong: the
/// reason `StorageUnavailableTimeout` when it failed because the storage
/// location stayed away past `failAfterUnavailableSeconds` (the outage
/// still going on, an operation given up on it),
/// `AgentOutOfFileDescriptors` when what lasted that long was this agent's
/// want of descriptors, else `AllVolumesFailed`.
pub fn failed_status(ending: Ending, message: &str, storage: &StorageSeen) -> VolumeTransferStatus {
    let why = match &storage.current {
        Some(current) if storage.gave_up => {
            if current.cause == FailureCause::OutOfDescriptors {
                reason::AGENT_OUT_OF_FILE_DESCRIPTORS
            } else {
                reason::STORAGE_UNAVAILABLE_TIMEOUT
            }
        }
        _ => reason::ALL_VOLUMES_FAILED,
    };
    VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::Failed),
        progress: Some(ending.progress.clone()),
        message: Some(bounded_message(message)),
        conditions: vec![ending.condition(
            condition_type::FAILED,
            ConditionStatus::True,
            why,
            message,
        )],
        ..ending.final_status()
    }
}

/// Entries named in a restore's final message.
pub const ENTRIES_NAMED: usize = 3;

/// What a finished restore of a volume wrote, whatever its verdict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreFigures {
    /// The snapshot restored.
    pub snapshot_id: String,
    /// Bytes written into the claim (a resumed or synced restore writes
    /// only what differed).
    pub bytes_written: u64,
    /// Regular files that already matched and were left untouched.
    pub files_unchanged: u64,
    /// Entries removed because the snapshot does not have them.
    pub entries_removed: u64,
}

/// How a restored volume's verification ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreVerdict {
    /// The claim holds exactly the snapshot.
    Verified {
        /// The snapshot's root tree.
        root_tree: String,
        /// Entries of the snapshot a restore does not create (sockets,
        /// device nodes), absent as expected.
        not_restorable: u64,
        /// The first of them.
        not_restorable_paths: Vec<String>,
    },
    /// The written claim differs from the snapshot.
    Mismatch {
        /// The snapshot's root tree.
        root_tree: String,
        /// What differs, `path: what`, the first few.
        mismatches: Vec<String>,
        /// How many were found (the verification stops at its limit).
        found: usize,
        /// It stopped at its limit: more may differ.
        stopped_at_limit: bool,
    },
    /// The restore could not restore some entries (not verified).
    NotRestored {
        /// `path: what went wrong`, the first few.
        problems: Vec<String>,
        /// How many.
        count: usize,
    },
}

fn first_few(items: &[String]) -> String {
    items
        .iter()
        .take(ENTRIES_NAMED)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The final status of a restored volume: Completed and `Verified` (the
/// root tree in `verifiedTree` and in the condition's message), with the
/// restore's figures, progress at 100 %; or Failed, saying what differs or
/// what was not restored and what to do, with the figures so far.
pub fn restored_status(
    ending: Ending,
    figures: &RestoreFigures,
    verdict: &RestoreVerdict,
) -> VolumeTransferStatus {
    let progress = ending.progress.clone();
    let snapshot = &figures.snapshot_id;
    let mut status = VolumeTransferStatus {
        bytes_written: Some(signed(figures.bytes_written)),
        files_unchanged: Some(signed(figures.files_unchanged)),
        entries_removed: Some(signed(figures.entries_removed)),
        ..ending.final_status()
    };
    match verdict {
        RestoreVerdict::Verified {
            root_tree,
            not_restorable,
            not_restorable_paths,
        } => {
            let verified = format!(
                "the claim holds exactly snapshot {snapshot}: root tree {root_tree}, compared entry by entry and every file re-hashed"
            );
            status.phase = Some(VolumeTransferPhase::Completed);
            status.progress = Some(done(Progress {
                files_done: progress.total_files,
                ..progress
            }));
            status.verified_tree = Some(root_tree.clone());
            status.warnings = Some(signed(*not_restorable));
            status.message = (*not_restorable > 0).then(|| {
                bounded_message(&format!(
                    "{not_restorable} entries of the snapshot cannot be restored and were left out (Unix sockets are recreated by their programs; device nodes are not created in a claim), first: {}",
                    first_few(not_restorable_paths)
                ))
            });
            status.conditions = vec![
                ending.condition(
                    condition_type::VERIFIED,
                    ConditionStatus::True,
                    reason::TREE_VERIFIED,
                    &verified,
                ),
                ending.condition(
                    condition_type::COMPLETE,
                    ConditionStatus::True,
                    reason::ALL_VOLUMES_COMPLETED,
                    "restored and verified",
                ),
            ];
        }
        RestoreVerdict::Mismatch {
            root_tree,
            mismatches,
            found,
            stopped_at_limit,
        } => {
            let count = if *stopped_at_limit {
                format!("at least {found} entries")
            } else {
                format!("{found} entries")
            };
            let message = format!(
                "the claim differs from snapshot {snapshot} (root tree {root_tree}) in {count}, first: {}. Something else wrote into the claim while it was restored, or its storage lost writes: make sure nothing else mounts the claim, then restore it again with existingClaim: Sync, which rewrites only what differs",
                first_few(mismatches)
            );
            status.phase = Some(VolumeTransferPhase::Failed);
            status.progress = Some(progress);
            status.message = Some(bounded_message(&message));
            status.conditions = vec![
                ending.condition(
                    condition_type::VERIFIED,
                    ConditionStatus::False,
                    reason::TREE_MISMATCH,
                    &message,
                ),
                ending.condition(
                    condition_type::FAILED,
                    ConditionStatus::True,
                    reason::TREE_MISMATCH,
                    &message,
                ),
            ];
        }
        RestoreVerdict::NotRestored { problems, count } => {
            let message = format!(
                "{count} entries of snapshot {snapshot} could not be restored, first: {}. A damaged file is removed, never left half-written: run `haulage verify --repo <the location's URL> {snapshot}` to see which data is damaged; otherwise fix what the claim refused (space, permissions) and restore again with existingClaim: Sync",
                first_few(problems)
            );
            status.phase = Some(VolumeTransferPhase::Failed);
            status.progress = Some(progress);
            status.warnings = Some(signed(*count as u64));
            status.message = Some(bounded_message(&message));
            status.conditions = vec![ending.condition(
                condition_type::FAILED,
                ConditionStatus::True,
                reason::ENTRIES_NOT_RESTORED,
                &message,
            )];
        }
    }
    status
}

/// The verdict on a restore from what it reported and what the
/// verification found: verified when the claim holds exactly the snapshot
/// (entries a restore cannot create left aside); otherwise the restore's
/// own problems when it had any beyond those entries (they say why, e.g.
/// damaged data), else the differences found.
pub fn restore_verdict(
    outcome: &RestoreOutcome,
    verification: &TreeVerification,
) -> RestoreVerdict {
    if let Some(root_tree) = verification.verified_tree() {
        return RestoreVerdict::Verified {
            root_tree: root_tree.to_string(),
            not_restorable: verification.not_restorable,
            not_restorable_paths: verification.not_restorable_paths.clone(),
        };
    }
    let left_aside: std::collections::BTreeSet<&str> = verification
        .not_restorable_paths
        .iter()
        .map(String::as_str)
        .collect();
    let problems: Vec<String> = outcome
        .problems
        .iter()
        .filter(|problem| !left_aside.contains(problem.path.as_str()))
        .map(|problem| format!("{}: {}", problem.path, problem.message))
        .collect();
    if !problems.is_empty() {
        return RestoreVerdict::NotRestored {
            count: problems.len(),
            problems: problems.into_iter().take(ENTRIES_NAMED).collect(),
        };
    }
    RestoreVerdict::Mismatch {
        root_tree: verification.root_tree.clone(),
        found: verification.mismatches.len(),
        mismatches: verification
            .mismatches
            .iter()
            .take(ENTRIES_NAMED)
            .map(ToString::to_string)
            .collect(),
        stopped_at_limit: verification.stopped_at_limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(done: u64, total: u64) -> ProgressSnapshot {
        ProgressSnapshot {
            total_bytes: total,
            total_files: 10,
            totals_known: true,
            bytes_done: done,
            files_done: done / 10,
            bytes_transferred: done / 2,
            bytes_new: 0,
            bytes_stored: 0,
            warnings: 0,
        }
    }

    #[test]
    fn progress_reports_a_rate_and_an_eta() {
        let first = next_progress(&counters(100, 1000), None, 1.0);
        let second = next_progress(&counters(300, 1000), Some(&first), 2.0);
        assert_eq!(second.bytes_per_second, 100);
        assert_eq!(second.eta_seconds, Some(7));
        assert_eq!(second.percent, 30);
    }

    #[test]
    fn progress_never_goes_backwards_when_the_engine_restarts_its_counters() {
        let before = next_progress(&counters(800, 1000), None, 1.0);
        let after_restart = next_progress(&counters(50, 1000), Some(&before), 2.0);
        assert_eq!(after_restart.bytes_done, 800);
        assert_eq!(after_restart.files_done, before.files_done);
        assert_eq!(after_restart.bytes_per_second, 0);
    }

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + seconds).expect("valid"))
    }

    /// How a transfer of agent `stage-a` with generation 1 ended at 5 s,
    /// with `progress`.
    fn ending(progress: Progress) -> Ending {
        Ending {
            progress,
            agent: agent_claim("stage-a", None, false, &at(5)),
            generation: Some(1),
            time: at(5),
        }
    }

    #[test]
    fn an_outage_is_a_storage_condition_false_while_it_lasts_and_true_once_it_ended() {
        use std::time::{Duration, UNIX_EPOCH};
        assert_eq!(storage_condition(&StorageSeen::default(), Some(1)), None);
        let since = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut seen = StorageSeen {
            current: Some(OutageReport {
                since,
                lasted: Duration::from_secs(75),
                error: "connection refused".to_string(),
                cause: FailureCause::Unreachable,
            }),
            last_ended: None,
            give_up_after_seconds: Some(600),
            gave_up: false,
            retries: Retries::default(),
        };
        let paused = storage_condition(&seen, Some(1)).expect("during the outage");
        assert_eq!(paused.type_, condition_type::STORAGE_AVAILABLE);
        assert_eq!(paused.status, ConditionStatus::False);
        assert_eq!(paused.reason, reason::STORAGE_LOCATION_UNAVAILABLE);
        assert_eq!(paused.last_transition_time, at(0), "since the outage began");
        for part in ["75s", "connection refused", "paused", "600s"] {
            assert!(paused.message.contains(part), "{part}: {}", paused.message);
        }
        assert!(
            paused
                .message
                .starts_with("the storage location has not answered")
        );
        seen.give_up_after_seconds = None;
        let paused = storage_condition(&seen, Some(1)).expect("during the outage");
        assert!(
            paused.message.contains("as long as it takes"),
            "{}",
            paused.message
        );
        // A want of the agent's own descriptors is not the location's
        // silence.
        if let Some(current) = seen.current.as_mut() {
            current.cause = FailureCause::OutOfDescriptors;
        }
        let paused = storage_condition(&seen, Some(1)).expect("during the outage");
        assert!(
            paused
                .message
                .starts_with("this agent has had no file descriptor free"),
            "{}",
            paused.message
        );
        assert_eq!(paused.status, ConditionStatus::False);
        assert_eq!(paused.reason, reason::AGENT_OUT_OF_FILE_DESCRIPTORS);
        assert!(
            paused.message.contains("once a descriptor is free")
                && !paused.message.contains("when the location answers"),
            "{}",
            paused.message
        );
        if let Some(current) = seen.current.as_mut() {
            current.cause = FailureCause::Unreachable;
        }
        seen.current = None;
        seen.last_ended = Some(EndedOutage {
            since,
            lasted: Duration::from_secs(90),
            cause: FailureCause::OutOfDescriptors,
        });
        let back = storage_condition(&seen, Some(1)).expect("after the wait");
        assert!(
            back.message
                .starts_with("this agent has a file descriptor free again"),
            "{}",
            back.message
        );
        seen.last_ended = Some(EndedOutage {
            since,
            lasted: Duration::from_secs(90),
            cause: FailureCause::Unreachable,
        });
        let back = storage_condition(&seen, Some(1)).expect("after the outage");
        assert_eq!(back.status, ConditionStatus::True);
        assert_eq!(back.reason, reason::STORAGE_LOCATION_AVAILABLE);
        assert!(
            back.message
                .starts_with("the storage location answers again"),
            "{}",
            back.message
        );
        assert_eq!(back.last_transition_time, at(90), "since it ended");
        assert!(back.message.contains("90s"), "{}", back.message);
    }

    #[test]
    fn requests_retried_short_of_an_outage_are_a_storage_condition_true_saying_how_many() {
        use std::time::{Duration, UNIX_EPOCH};
        let mut seen = StorageSeen {
            retries: Retries {
                throttled: 120,
                other: 3,
                since: Some(UNIX_EPOCH + Duration::from_secs(1_800_000_007)),
            },
            ..StorageSeen::default()
        };
        let retried = storage_condition(&seen, Some(1)).expect("requests were retried");
        assert_eq!(retried.status, ConditionStatus::True);
        assert_eq!(retried.reason, reason::STORAGE_REQUESTS_RETRIED);
        assert_eq!(retried.last_transition_time, at(7), "since the first");
        for part in ["throttled 120", "503 SlowDown", "3 more failed", "slower"] {
            assert!(
                retried.message.contains(part),
                "{part}: {}",
                retried.message
            );
        }
        // After an outage, the outage first and the retries beside it.
        seen.last_ended = Some(EndedOutage {
            since: UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            lasted: Duration::from_secs(60),
            cause: FailureCause::Unreachable,
        });
        let back = storage_condition(&seen, Some(1)).expect("after the outage");
        assert_eq!(back.reason, reason::STORAGE_LOCATION_AVAILABLE);
        assert!(
            back.message.contains("outage of 60s") && back.message.contains("throttled 120"),
            "{}",
            back.message
        );
    }

    #[test]
    fn a_claim_keeps_the_first_claims_start_and_claim_times() {
        let first = claim_status(&VolumeTransferStatus::default(), "stage-a", &at(0));
        assert_eq!(first.phase, Some(VolumeTransferPhase::InProgress));
        assert_eq!(first.start_time, Some(at(0)));
        let again = claim_status(&first, "stage-a", &at(90));
        assert_eq!(again.start_time, Some(at(0)));
        let agent = again.agent.expect("claimed");
        assert_eq!((agent.claimed_at, agent.heartbeat_time), (at(0), at(90)));
    }

    #[test]
    fn the_claim_remembers_when_the_volume_last_moved_forward_across_restarts() {
        let before = next_progress(&counters(800, 1000), None, 1.0);
        assert!(moved_forward(&before, None));
        let first = agent_claim("stage-a", None, true, &at(10));
        assert_eq!(first.progress_time, Some(at(10)));
        // A restarted agent reads again what it had read: its counters
        // restart from zero, the report stays at 800, the volume did not
        // move, and the claim keeps when it last did.
        let reread = next_progress(&counters(300, 1000), Some(&before), 2.0);
        assert!(!moved_forward(&reread, Some(&before)));
        let claimed_again = claim_status(
            &VolumeTransferStatus {
                agent: Some(first),
                ..VolumeTransferStatus::default()
            },
            "stage-a",
            &at(20),
        )
        .agent
        .expect("claimed");
        let renewed = agent_claim("stage-a", Some(&claimed_again), false, &at(22));
        assert_eq!(
            (renewed.claimed_at.clone(), renewed.progress_time.clone()),
            (at(10), Some(at(10)))
        );
        let past = next_progress(&counters(900, 1000), Some(&reread), 2.0);
        assert!(moved_forward(&past, Some(&reread)));
        let moved = agent_claim("stage-a", Some(&renewed), true, &at(24));
        assert_eq!(moved.progress_time, Some(at(24)));
    }

    #[test]
    fn a_completed_volume_reports_its_snapshot_figures_and_full_progress() {
        let figures = BackupFigures {
            snapshot_id: "abc".to_string(),
            bytes_read: 1000,
            bytes_new: 400,
            bytes_stored: 200,
            warning_count: 2,
            first_warning: Some("cannot read /secret".to_string()),
        };
        let progress = next_progress(&counters(900, 1000), None, 1.0);
        let status = completed_status(ending(progress), &figures);
        assert_eq!(status.phase, Some(VolumeTransferPhase::Completed));
        assert_eq!(status.snapshot_id.as_deref(), Some("abc"));
        assert_eq!(
            (status.bytes_new, status.bytes_stored),
            (Some(400), Some(200))
        );
        let progress = status.progress.expect("progress");
        assert_eq!((progress.bytes_done, progress.percent), (1000, 100));
        assert!(status.message.unwrap_or_default().starts_with("2 warnings"));
        assert_eq!(status.conditions[0].type_, condition_type::COMPLETE);
    }

    #[test]
    fn a_failed_volume_says_why_in_its_message_and_condition() {
        let status = failed_status(
            ending(Progress::default()),
            "store unreachable",
            &StorageSeen::default(),
        );
        assert_eq!(status.phase, Some(VolumeTransferPhase::Failed));
        assert_eq!(status.message.as_deref(), Some("store unreachable"));
        assert_eq!(status.conditions[0].message, "store unreachable");
        assert_eq!(status.conditions[0].reason, reason::ALL_VOLUMES_FAILED);
        assert_eq!(status.snapshot_id, None);
        let given_up = StorageSeen {
            current: Some(OutageReport {
                since: std::time::UNIX_EPOCH,
                lasted: std::time::Duration::from_secs(20),
                error: "connection refused".to_string(),
                cause: FailureCause::Unreachable,
            }),
            gave_up: true,
            ..StorageSeen::default()
        };
        let status = failed_status(ending(Progress::default()), "gave up", &given_up);
        assert_eq!(
            status.conditions[0].reason,
            reason::STORAGE_UNAVAILABLE_TIMEOUT
        );
        // What lasted past the limit was the agent's want of descriptors.
        let mut out_of_descriptors = given_up;
        if let Some(current) = out_of_descriptors.current.as_mut() {
            current.cause = FailureCause::OutOfDescriptors;
        }
        let status = failed_status(ending(Progress::default()), "gave up", &out_of_descriptors);
        assert_eq!(
            status.conditions[0].reason,
            reason::AGENT_OUT_OF_FILE_DESCRIPTORS
        );
    }

    fn restore_figures() -> RestoreFigures {
        RestoreFigures {
            snapshot_id: "5n4p".to_string(),
            bytes_written: 700,
            files_unchanged: 3,
            entries_removed: 2,
        }
    }

    #[test]
    fn a_verified_restore_completes_with_its_root_tree_figures_and_full_progress() {
        let verdict = RestoreVerdict::Verified {
            root_tree: "7ree".to_string(),
            not_restorable: 0,
            not_restorable_paths: Vec::new(),
        };
        let status = restored_status(
            ending(next_progress(&counters(900, 1000), None, 1.0)),
            &restore_figures(),
            &verdict,
        );
        assert_eq!(status.phase, Some(VolumeTransferPhase::Completed));
        assert_eq!(status.verified_tree.as_deref(), Some("7ree"));
        assert_eq!(
            (
                status.bytes_written,
                status.files_unchanged,
                status.entries_removed
            ),
            (Some(700), Some(3), Some(2))
        );
        let progress = status.progress.clone().expect("progress");
        assert_eq!((progress.bytes_done, progress.percent), (1000, 100));
        assert_eq!(progress.files_done, progress.total_files);
        let verified = &status.conditions[0];
        assert_eq!(
            (
                verified.type_.as_str(),
                verified.status,
                verified.reason.as_str()
            ),
            (
                condition_type::VERIFIED,
                ConditionStatus::True,
                reason::TREE_VERIFIED
            )
        );
        assert!(verified.message.contains("root tree 7ree"), "{verified:?}");
        assert_eq!(status.conditions[1].type_, condition_type::COMPLETE);
        assert_eq!(status.message, None);
        assert_eq!(
            status.snapshot_id, None,
            "snapshotId names written snapshots"
        );
    }

    #[test]
    fn entries_a_restore_cannot_create_are_named_in_a_verified_restores_message() {
        let verdict = RestoreVerdict::Verified {
            root_tree: "7ree".to_string(),
            not_restorable: 1,
            not_restorable_paths: vec!["run/app.sock".to_string()],
        };
        let status = restored_status(ending(Progress::default()), &restore_figures(), &verdict);
        assert_eq!(status.phase, Some(VolumeTransferPhase::Completed));
        assert_eq!(status.warnings, Some(1));
        assert!(
            status.message.unwrap_or_default().contains("run/app.sock"),
            "the message names the socket"
        );
    }

    #[test]
    fn a_mismatched_tree_fails_naming_the_first_differences_and_what_to_do() {
        let mismatches: Vec<String> = (0..5)
            .map(|n| format!("file-{n}: content differs"))
            .collect();
        let verdict = RestoreVerdict::Mismatch {
            root_tree: "7ree".to_string(),
            mismatches,
            found: 100,
            stopped_at_limit: true,
        };
        let progress = next_progress(&counters(1000, 1000), None, 1.0);
        let status = restored_status(ending(progress), &restore_figures(), &verdict);
        assert_eq!(status.phase, Some(VolumeTransferPhase::Failed));
        assert_eq!(status.verified_tree, None);
        let message = status.message.clone().unwrap_or_default();
        assert!(message.contains("at least 100 entries"), "{message}");
        assert!(message.contains("file-2: content differs"), "{message}");
        assert!(!message.contains("file-3"), "only the first few: {message}");
        assert!(message.contains("existingClaim: Sync"), "{message}");
        let reasons: Vec<(&str, ConditionStatus, &str)> = status
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status, c.reason.as_str()))
            .collect();
        assert_eq!(
            reasons,
            vec![
                (
                    condition_type::VERIFIED,
                    ConditionStatus::False,
                    reason::TREE_MISMATCH
                ),
                (
                    condition_type::FAILED,
                    ConditionStatus::True,
                    reason::TREE_MISMATCH
                ),
            ]
        );
        assert_eq!(
            status.bytes_written,
            Some(700),
            "the figures so far are kept"
        );
    }

    #[test]
    fn entries_not_restored_fail_the_volume_naming_them() {
        let verdict = RestoreVerdict::NotRestored {
            problems: vec!["db/table.ibd: not restored, its data is damaged".to_string()],
            count: 1,
        };
        let status = restored_status(ending(Progress::default()), &restore_figures(), &verdict);
        assert_eq!(status.phase, Some(VolumeTransferPhase::Failed));
        assert_eq!(status.conditions[0].reason, reason::ENTRIES_NOT_RESTORED);
        let message = status.message.unwrap_or_default();
        assert!(message.contains("db/table.ibd"), "{message}");
        assert!(message.contains("haulage verify"), "{message}");
    }

    fn verification(mismatches: &[&str], not_restorable: &[&str]) -> TreeVerification {
        TreeVerification {
            root_tree: "7ree".to_string(),
            mismatches: mismatches
                .iter()
                .map(|path| haulage::engine::verify_tree::TreeMismatch {
                    path: path.to_string(),
                    difference: haulage::engine::verify_tree::Difference::Extra,
                })
                .collect(),
            not_restorable: not_restorable.len() as u64,
            not_restorable_paths: not_restorable.iter().map(|p| p.to_string()).collect(),
            ..TreeVerification::default()
        }
    }

    fn outcome(problems: &[&str]) -> RestoreOutcome {
        RestoreOutcome {
            problems: problems
                .iter()
                .map(|path| haulage::engine::restore::RestoreProblem {
                    path: path.to_string(),
                    message: "went wrong".to_string(),
                })
                .collect(),
            ..RestoreOutcome::default()
        }
    }

    #[test]
    fn the_verification_decides_a_restore_and_the_restores_own_problems_say_why_it_failed() {
        // Verified, the socket the restore reported left aside.
        assert_eq!(
            restore_verdict(&outcome(&["app.sock"]), &verification(&[], &["app.sock"])),
            RestoreVerdict::Verified {
                root_tree: "7ree".to_string(),
                not_restorable: 1,
                not_restorable_paths: vec!["app.sock".to_string()],
            }
        );
        // Differences and a damaged file: the restore's problem names why.
        assert_eq!(
            restore_verdict(
                &outcome(&["app.sock", "db/data"]),
                &verification(&["db/data"], &["app.sock"])
            ),
            RestoreVerdict::NotRestored {
                problems: vec!["db/data: went wrong".to_string()],
                count: 1,
            }
        );
        // Differences the restore did not see: someone else wrote.
        assert_eq!(
            restore_verdict(&outcome(&[]), &verification(&["stray"], &[])),
            RestoreVerdict::Mismatch {
                root_tree: "7ree".to_string(),
                mismatches: vec!["stray: not in the snapshot".to_string()],
                found: 1,
                stopped_at_limit: false,
            }
        );
    }
}
