//! A storage location's scheduled maintenance (`spec.maintenance`): when
//! the controller prunes its repository, with which settings, and the
//! `status.maintenance` each step leaves (pure; the controller's
//! `controller::maintenance` runs the prune).
//!
//! A prune is due when the location has never been pruned at its current
//! `metadata.generation` (maintenance just set, or the spec changed: an edit
//! runs one at once), or when its jittered `interval` has passed since the
//! last start. A prune recorded `Running` is left alone for one interval
//! (the replica running it may still be at work; the repository's own lock
//! refuses a second prune anyway) and then run again, so a replica that died
//! mid-prune never stops the schedule. A location that is not Available
//! waits: its probe already says why.

use std::time::Duration;

use bytesize::ByteSize;
use haulage_api::location::{
    BackupStorageLocation, BackupStorageLocationPhase, MaintenanceResult, MaintenanceStatus,
};
use haulage_repo::prune::{PruneReport, PruneSettings};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::action::Event;
use crate::location::{jittered_interval, sanitize_message};

/// How long a location that cannot be pruned now (not Available, or an
/// invalid spec) waits before the next look.
pub const MAINTENANCE_RETRY_SECONDS: u64 = 60;

/// What to do about a location's maintenance now.
#[derive(Debug, Clone, PartialEq)]
pub enum MaintenanceStep {
    /// The location has no `spec.maintenance`.
    NotScheduled,
    /// Nothing now; look again after this long.
    NotDue {
        /// Until the next look.
        after: Duration,
    },
    /// `spec.maintenance` cannot be read: record this status (`None` when
    /// it is already recorded) and look again later.
    Refuse {
        /// The Failed status naming the field, when not yet written.
        status: Option<MaintenanceStatus>,
    },
    /// Prune now with `settings`.
    Run {
        /// The prune's threshold and margin.
        settings: PruneSettings,
    },
}

/// Whether `location`'s repository is to be pruned at `now`.
pub fn decide_maintenance(location: &BackupStorageLocation, now: &Time) -> MaintenanceStep {
    let Some(maintenance) = &location.spec.maintenance else {
        return MaintenanceStep::NotScheduled;
    };
    let retry = Duration::from_secs(MAINTENANCE_RETRY_SECONDS);
    let status = location.status.clone().unwrap_or_default();
    let old = status.maintenance.unwrap_or_default();
    let generation = location.metadata.generation;
    let settings = maintenance.interval().and_then(|interval| {
        let margin = maintenance.safety_margin()?;
        let keep_checkpoints = maintenance.keep_checkpoints_within()?;
        Ok((interval, margin, keep_checkpoints))
    });
    let (interval, margin, keep_checkpoints) = match settings {
        Ok(settings) => settings,
        Err(error) => {
            let message = format!(
                "spec.maintenance: {:?} {}: use a duration such as 24h (safetyMargin and keepCheckpointsWithin may be 0)",
                error.text, error.problem
            );
            let refused = MaintenanceStatus {
                result: Some(MaintenanceResult::Failed),
                observed_generation: generation,
                message: Some(message),
                ..old.clone()
            };
            return MaintenanceStep::Refuse {
                status: (refused != old).then_some(refused),
            };
        }
    };
    if status.phase != Some(BackupStorageLocationPhase::Available) {
        return MaintenanceStep::NotDue { after: retry };
    }
    let run = MaintenanceStep::Run {
        settings: PruneSettings {
            repack_threshold: f64::from(maintenance.repack_threshold_percent.clamp(0, 100)) / 100.0,
            safety_margin_seconds: i64::try_from(margin.as_secs()).unwrap_or(i64::MAX),
            checkpoint_max_age_seconds: i64::try_from(keep_checkpoints.as_secs())
                .unwrap_or(i64::MAX),
        },
    };
    let Some(started) = &old.last_start_time else {
        return run;
    };
    if old.observed_generation != generation && old.result != Some(MaintenanceResult::Running) {
        return run;
    }
    let period = jittered_interval(
        interval,
        &location.uid().unwrap_or_else(|| location.name_any()),
    );
    let since =
        Duration::from_secs(u64::try_from(now.0.as_second() - started.0.as_second()).unwrap_or(0));
    match period.checked_sub(since) {
        Some(remaining) if !remaining.is_zero() => MaintenanceStep::NotDue {
            after: remaining.min(period).max(Duration::from_secs(1)),
        },
        _ => run,
    }
}

/// The status a prune starting at `now` on `runner` records first.
pub fn running_status(
    location: &BackupStorageLocation,
    runner: &str,
    now: Time,
) -> MaintenanceStatus {
    let old = location
        .status
        .as_ref()
        .and_then(|status| status.maintenance.clone())
        .unwrap_or_default();
    MaintenanceStatus {
        result: Some(MaintenanceResult::Running),
        last_start_time: Some(now),
        observed_generation: location.metadata.generation,
        runner: Some(runner.to_string()),
        message: Some(format!("pruning since this start (replica {runner})")),
        // The last run's figures stay until this one replaces them.
        ..old
    }
}

/// The status after the prune that `running` recorded ended at `now` with
/// `outcome` (the prune's report, or why it failed); `secrets` are values
/// no message may carry.
pub fn finished_status(
    running: &MaintenanceStatus,
    outcome: Result<&PruneReport, &str>,
    secrets: &[&str],
    now: Time,
) -> MaintenanceStatus {
    let bytes = |value: u64| Some(i64::try_from(value).unwrap_or(i64::MAX));
    let report = match outcome {
        Err(problem) => {
            return MaintenanceStatus {
                result: Some(MaintenanceResult::Failed),
                last_completion_time: Some(now),
                message: Some(sanitize_message(
                    &format!(
                        "prune failed, nothing referenced was deleted: {problem}; it runs again at the next interval (or edit the location to run it now)"
                    ),
                    secrets,
                )),
                ..running.clone()
            };
        }
        Ok(report) => report,
    };
    let human = |bytes: u64| ByteSize::b(bytes).display().iec().to_string();
    let mut message = format!(
        "{} snapshots reference {} of {} stored; deleted {} packs ({})",
        report.snapshots,
        human(report.used_bytes),
        human(report.total_bytes),
        report.deleted_packs,
        human(report.deleted_bytes)
    );
    if report.repacked_packs > 0 {
        message.push_str(&format!(", repacked {} packs", report.repacked_packs));
    }
    if report.index_files_written > 0 && report.deleted_packs == 0 {
        message.push_str(&format!(
            ", gathered {} index files into {}",
            report.index_files, report.index_files_written
        ));
    }
    if report.checkpoints_kept + report.checkpoints_deleted > 0 {
        message.push_str(&format!(
            "; kept {} checkpoints of unfinished backups, deleted {} older than keepCheckpointsWithin",
            report.checkpoints_kept, report.checkpoints_deleted
        ));
    }
    if report.checkpoints_unreadable > 0 {
        message.push_str(&format!(
            "; {} checkpoints cannot be read and are left (a backup ignores them)",
            report.checkpoints_unreadable
        ));
    }
    if report.waiting_packs > 0 {
        message.push_str(&format!(
            "; {} packs ({}) wait for the safety margin",
            report.waiting_packs,
            human(report.waiting_bytes)
        ));
    }
    if report.abandoned_uploads_removed > 0 {
        message.push_str(&format!(
            "; removed {} incomplete uploads older than the safety margin and an hour (left by writers that died)",
            report.abandoned_uploads_removed
        ));
    }
    if let Some(problem) = &report.abandoned_uploads_problem {
        message.push_str(&format!("; {problem}"));
    }
    if !report.damaged_packs.is_empty() {
        message.push_str(&format!(
            "; {} packs cannot be read and are kept (run `haulage verify` on the repository): {}",
            report.damaged_packs.len(),
            report.damaged_packs.join(", ")
        ));
    }
    let result = match &report.deletion_deferred {
        Some(why) => {
            message.push_str(&format!("; deletions deferred: {why}"));
            MaintenanceResult::Deferred
        }
        None => MaintenanceResult::Succeeded,
    };
    MaintenanceStatus {
        result: Some(result),
        last_completion_time: Some(now),
        message: Some(sanitize_message(&message, secrets)),
        stored_bytes: bytes(report.total_bytes),
        used_bytes: bytes(report.used_bytes),
        reclaimed_bytes: bytes(report.deleted_bytes),
        deleted_packs: bytes(report.deleted_packs as u64),
        waiting_bytes: bytes(report.waiting_bytes),
        ..running.clone()
    }
}

/// The Event a prune that ended with `status` records on its location.
pub fn finished_event(status: &MaintenanceStatus) -> Event {
    let note = status.message.clone().unwrap_or_default();
    match status.result {
        Some(MaintenanceResult::Succeeded) => Event::normal("Pruned", "Maintain", note),
        Some(MaintenanceResult::Deferred) => Event::normal("PruneDeferred", "Maintain", note),
        _ => Event::warning("PruneFailed", "Maintain", note),
    }
}

#[cfg(test)]
mod tests {
    use haulage_api::condition::MAX_MESSAGE_BYTES;
    use haulage_api::location::{BackupStorageLocationStatus, LocationMaintenance};

    use super::*;
    use crate::test_support::at;

    fn scheduled(interval: &str, margin: &str) -> BackupStorageLocation {
        let mut location = BackupStorageLocation::test("minio");
        location.metadata.uid = Some("uid-1".into());
        location.metadata.generation = Some(2);
        location.spec.maintenance = Some(LocationMaintenance {
            interval: interval.into(),
            safety_margin: margin.into(),
            keep_checkpoints_within: "1h".into(),
            repack_threshold_percent: 25,
        });
        location.status = Some(BackupStorageLocationStatus {
            phase: Some(BackupStorageLocationPhase::Available),
            ..BackupStorageLocationStatus::default()
        });
        location
    }

    fn with_maintenance(
        mut location: BackupStorageLocation,
        status: MaintenanceStatus,
    ) -> BackupStorageLocation {
        location.status.as_mut().expect("status").maintenance = Some(status);
        location
    }

    fn ran(result: MaintenanceResult, started: i64, generation: i64) -> MaintenanceStatus {
        MaintenanceStatus {
            result: Some(result),
            last_start_time: Some(at(started)),
            observed_generation: Some(generation),
            ..MaintenanceStatus::default()
        }
    }

    #[test]
    fn a_location_without_maintenance_is_never_pruned() {
        let location = BackupStorageLocation::test("minio");
        assert_eq!(
            decide_maintenance(&location, &at(1_000)),
            MaintenanceStep::NotScheduled
        );
    }

    #[test]
    fn the_first_prune_runs_at_once_with_the_spec_settings() {
        let step = decide_maintenance(&scheduled("24h", "1h"), &at(1_000));
        assert_eq!(
            step,
            MaintenanceStep::Run {
                settings: PruneSettings {
                    repack_threshold: 0.25,
                    safety_margin_seconds: 3_600,
                    checkpoint_max_age_seconds: 3_600,
                }
            }
        );
    }

    #[test]
    fn the_next_prune_waits_for_the_jittered_interval_after_the_last_start() {
        let day: i64 = 86_400;
        let location = with_maintenance(
            scheduled("24h", "24h"),
            ran(MaintenanceResult::Succeeded, 10_000, 2),
        );
        let period = jittered_interval(Duration::from_secs(day as u64), "uid-1");
        let seconds = period.as_secs() as i64;
        assert!(
            (day * 9 / 10..=day * 11 / 10).contains(&seconds),
            "{seconds}"
        );
        assert_eq!(
            decide_maintenance(&location, &at(10_000 + 100)),
            MaintenanceStep::NotDue {
                after: period - Duration::from_secs(100)
            }
        );
        assert!(matches!(
            decide_maintenance(&location, &at(10_000 + seconds - 1)),
            MaintenanceStep::NotDue { .. }
        ));
        assert!(matches!(
            decide_maintenance(&location, &at(10_000 + seconds + 1)),
            MaintenanceStep::Run { .. }
        ));
        // A failed or deferred run waits as long: the schedule, not a retry
        // storm against a struggling server.
        let failed = with_maintenance(
            scheduled("24h", "24h"),
            ran(MaintenanceResult::Failed, 10_000, 2),
        );
        assert!(matches!(
            decide_maintenance(&failed, &at(10_000 + 100)),
            MaintenanceStep::NotDue { .. }
        ));
    }

    #[test]
    fn an_edit_of_the_location_runs_a_prune_at_once_unless_one_is_running() {
        let edited = with_maintenance(
            scheduled("24h", "0"),
            ran(MaintenanceResult::Deferred, 10_000, 1),
        );
        assert!(matches!(
            decide_maintenance(&edited, &at(10_060)),
            MaintenanceStep::Run { .. }
        ));
        let running = with_maintenance(
            scheduled("24h", "0"),
            ran(MaintenanceResult::Running, 10_000, 1),
        );
        assert!(matches!(
            decide_maintenance(&running, &at(10_060)),
            MaintenanceStep::NotDue { .. }
        ));
    }

    #[test]
    fn a_prune_left_running_by_a_dead_replica_runs_again_after_an_interval() {
        let location = with_maintenance(
            scheduled("1h", "24h"),
            ran(MaintenanceResult::Running, 10_000, 2),
        );
        assert!(matches!(
            decide_maintenance(&location, &at(10_000 + 600)),
            MaintenanceStep::NotDue { .. }
        ));
        assert!(matches!(
            decide_maintenance(&location, &at(10_000 + 4_000)),
            MaintenanceStep::Run { .. }
        ));
    }

    #[test]
    fn an_unavailable_location_waits() {
        let mut location = scheduled("24h", "24h");
        location.status.as_mut().expect("status").phase =
            Some(BackupStorageLocationPhase::Unavailable);
        assert_eq!(
            decide_maintenance(&location, &at(1_000)),
            MaintenanceStep::NotDue {
                after: Duration::from_secs(MAINTENANCE_RETRY_SECONDS)
            }
        );
    }

    #[test]
    fn an_interval_that_is_not_a_duration_is_refused_once_naming_the_field() {
        for (interval, margin, keep) in [
            ("0", "24h", "1h"),
            ("daily", "24h", "1h"),
            ("24h", "soon", "1h"),
            ("24h", "24h", "weekly"),
        ] {
            let mut location = scheduled(interval, margin);
            if let Some(maintenance) = &mut location.spec.maintenance {
                maintenance.keep_checkpoints_within = keep.into();
            }
            let MaintenanceStep::Refuse {
                status: Some(status),
            } = decide_maintenance(&location, &at(1_000))
            else {
                panic!("{interval} {margin} {keep}: not refused");
            };
            assert_eq!(status.result, Some(MaintenanceResult::Failed));
            let message = status.message.clone().unwrap_or_default();
            assert!(message.starts_with("spec.maintenance"), "{message}");
            let recorded = with_maintenance(location, status);
            assert_eq!(
                decide_maintenance(&recorded, &at(1_060)),
                MaintenanceStep::Refuse { status: None },
                "{interval} {margin} {keep}: written twice"
            );
        }
    }

    #[test]
    fn a_finished_prune_records_its_figures_and_a_deferred_deletion_says_why() {
        let location = scheduled("24h", "0");
        let running = running_status(&location, "controller-0", at(1_000));
        assert_eq!(running.result, Some(MaintenanceResult::Running));
        assert_eq!(running.observed_generation, Some(2));
        let report = PruneReport {
            snapshots: 3,
            total_bytes: 1_000,
            used_bytes: 600,
            deleted_packs: 2,
            deleted_bytes: 400,
            ..PruneReport::default()
        };
        let done = finished_status(&running, Ok(&report), &[], at(1_010));
        assert_eq!(done.result, Some(MaintenanceResult::Succeeded));
        assert_eq!(done.last_start_time, Some(at(1_000)));
        assert_eq!(done.last_completion_time, Some(at(1_010)));
        assert_eq!(
            (done.reclaimed_bytes, done.deleted_packs, done.stored_bytes),
            (Some(400), Some(2), Some(1_000))
        );
        let deferred = PruneReport {
            deletion_deferred: Some("the repository is in use (backup of claim shop/db)".into()),
            ..report
        };
        let done = finished_status(&running, Ok(&deferred), &[], at(1_010));
        assert_eq!(done.result, Some(MaintenanceResult::Deferred));
        assert!(
            done.message.unwrap_or_default().contains("shop/db"),
            "the holder is named"
        );
        let swept = PruneReport {
            abandoned_uploads_removed: 2,
            ..PruneReport::default()
        };
        let message = finished_status(&running, Ok(&swept), &[], at(1_010)).message;
        assert!(
            message
                .unwrap_or_default()
                .contains("removed 2 incomplete uploads"),
            "the uploads aborted are counted"
        );
        let gathered = PruneReport {
            index_files: 400,
            index_files_written: 2,
            ..PruneReport::default()
        };
        let message = finished_status(&running, Ok(&gathered), &[], at(1_010)).message;
        assert!(
            message
                .unwrap_or_default()
                .contains("gathered 400 index files into 2"),
            "the index files gathered are counted"
        );
        let refused = PruneReport {
            abandoned_uploads_problem: Some("ListMultipartUploads: AccessDenied".into()),
            ..PruneReport::default()
        };
        let done = finished_status(&running, Ok(&refused), &[], at(1_010));
        assert_eq!(done.result, Some(MaintenanceResult::Succeeded));
        assert!(
            done.message.unwrap_or_default().contains("AccessDenied"),
            "why the uploads were not looked at is said"
        );
    }

    #[test]
    fn a_failed_prune_never_carries_a_secret_and_stays_within_a_kibibyte() {
        let running = running_status(&scheduled("24h", "0"), "controller-0", at(1_000));
        let problem = format!("access denied for key hunter2 {}", "x".repeat(5_000));
        let done = finished_status(&running, Err(&problem), &["hunter2"], at(1_010));
        let message = done.message.unwrap_or_default();
        assert_eq!(done.result, Some(MaintenanceResult::Failed));
        assert!(!message.contains("hunter2"), "{message}");
        assert!(message.len() <= MAX_MESSAGE_BYTES, "{}", message.len());
    }
}
