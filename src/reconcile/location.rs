//! The BackupStorageLocation decisions: when a location is due for a
//! probe, its status from a probe's outcome, and which of several
//! `default: true` locations is used. The controller
//! (`haulage::controller::location`) observes the location and its
//! siblings, asks [`decide_probe`], runs the probe when told to (the only
//! I/O: credentials, the object round trip, the repository check) and
//! writes what [`decide_status`] returns.
//!
//! A probe is skipped while the status (shared through the API server)
//! shows a validation at the current generation younger than the
//! interval, so several replicas mostly take turns, and a status event
//! never causes an extra probe.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use haulage_api::condition::{
    ConditionStatus, bounded_message, condition_type, find_condition, reason,
};
use haulage_api::{BackupStorageLocation, BackupStorageLocationPhase, BackupStorageLocationStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use std::sync::Arc;

use crate::action::{Event, Requeue};
use crate::backup_status::{Conditions, StorageState};

/// Each location's interval is stretched or shrunk by up to this many per
/// mille (±10 %), by a fixed amount per location, so locations created
/// together drift apart instead of probing together.
const JITTER_PER_MILLE: u64 = 100;
/// Interval assumed when `validationFrequency` cannot be parsed (the CRD's
/// pattern makes that rare).
const FALLBACK_INTERVAL_SECONDS: u64 = 60;
/// Shortest requeue, so a rounding remainder never spins.
const MINIMUM_REQUEUE_MILLISECONDS: u64 = 1000;

/// Why a probe did not pass; each has one condition reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeProblem {
    /// The Secret or its key is missing, or it holds no usable credentials.
    CredentialsMissing,
    /// The server refused the credentials or the request.
    AccessDenied,
    /// The bucket does not exist at the endpoint.
    BucketNotFound,
    /// The endpoint could not be reached.
    EndpointUnreachable,
    /// The TLS handshake failed.
    Tls,
    /// The bucket is in another region or behind another endpoint.
    RegionMismatch,
    /// The clocks of this machine and the server disagree.
    ClockSkew,
    /// The server answered with internal errors or throttling.
    ServerError,
    /// The probe did not finish within its timeout.
    Timeout,
    /// No repository at the prefix, and `spec.initialize` is false.
    RepositoryNotInitialized,
    /// The repository's format is newer than supported, or its config is
    /// unreadable.
    RepositoryIncompatible,
    /// The spec holds a value the controller cannot use.
    InvalidSpec,
    /// `spec.encryption`'s password opens none of the repository's keys.
    WrongPassword,
    /// `spec.encryption`'s Secret or key is missing or empty.
    PasswordMissing,
    /// The repository is encrypted and the spec has no `encryption`.
    RepositoryEncrypted,
    /// Anything else (the message says what).
    Other,
}

impl ProbeProblem {
    /// The condition reason (one of [`haulage_api::condition::reason`]).
    pub fn reason(self) -> &'static str {
        match self {
            ProbeProblem::CredentialsMissing => reason::CREDENTIALS_MISSING,
            ProbeProblem::AccessDenied => reason::ACCESS_DENIED,
            ProbeProblem::BucketNotFound => reason::BUCKET_NOT_FOUND,
            ProbeProblem::EndpointUnreachable => reason::ENDPOINT_UNREACHABLE,
            ProbeProblem::Tls => reason::TLS_ERROR,
            ProbeProblem::RegionMismatch => reason::REGION_MISMATCH,
            ProbeProblem::ClockSkew => reason::CLOCK_SKEW,
            ProbeProblem::ServerError => reason::SERVER_ERROR,
            ProbeProblem::Timeout => reason::PROBE_TIMEOUT,
            ProbeProblem::RepositoryNotInitialized => reason::REPOSITORY_NOT_INITIALIZED,
            ProbeProblem::RepositoryIncompatible => reason::REPOSITORY_INCOMPATIBLE,
            ProbeProblem::InvalidSpec => reason::INVALID_SPEC,
            ProbeProblem::WrongPassword => reason::WRONG_PASSWORD,
            ProbeProblem::PasswordMissing => reason::PASSWORD_MISSING,
            ProbeProblem::RepositoryEncrypted => reason::REPOSITORY_ENCRYPTED,
            ProbeProblem::Other => reason::PROBE_FAILED,
        }
    }
}

/// The outcome of one probe, before it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Every step passed and the repository is usable.
    Succeeded {
        /// Wall time of the write/read/list/delete round trip, in
        /// milliseconds.
        latency_milliseconds: i64,
        /// The controller created the repository in this probe.
        initialized: bool,
        /// The bytes of the repository's index files.
        index_bytes: u64,
    },
    /// The location cannot be used.
    Failed {
        /// Why, as one reason.
        problem: ProbeProblem,
        /// What went wrong and what to check (cleaned and bounded when
        /// written).
        message: String,
    },
}

impl ProbeOutcome {
    /// A failed probe.
    pub fn failed(problem: ProbeProblem, message: impl Into<String>) -> Self {
        ProbeOutcome::Failed {
            problem,
            message: message.into(),
        }
    }
}

/// The location's next status after a probe (pure). The `Available`
/// condition keeps its `lastTransitionTime` unless it flipped; the message
/// is cleaned of `secrets` ([`sanitize_message`]).
pub fn next_location_status(
    old: &BackupStorageLocationStatus,
    outcome: &ProbeOutcome,
    secrets: &[&str],
    generation: Option<i64>,
    now: Time,
) -> BackupStorageLocationStatus {
    let mut status = old.clone();
    let (phase, state, why, message) = match outcome {
        ProbeOutcome::Succeeded {
            latency_milliseconds,
            initialized,
            index_bytes,
        } => {
            status.last_probe_latency_milliseconds = Some(*latency_milliseconds);
            status.index_bytes = Some(i64::try_from(*index_bytes).unwrap_or(i64::MAX));
            if *initialized {
                (
                    BackupStorageLocationPhase::Available,
                    ConditionStatus::True,
                    reason::REPOSITORY_INITIALIZED,
                    "the prefix held no repository; the controller created one (spec.initialize) and the probe object round trip succeeded".to_string(),
                )
            } else {
                (
                    BackupStorageLocationPhase::Available,
                    ConditionStatus::True,
                    reason::PROBE_SUCCEEDED,
                    "write, read, list and delete of a probe object succeeded and the repository is of a supported format".to_string(),
                )
            }
        }
        ProbeOutcome::Failed { problem, message } => (
            BackupStorageLocationPhase::Unavailable,
            ConditionStatus::False,
            problem.reason(),
            sanitize_message(message, secrets),
        ),
    };
    status.phase = Some(phase);
    status.last_validation_time = Some(now.clone());
    status.message = Some(bounded_message(&message));
    status.observed_generation = generation;
    Conditions { generation, now }.set(
        &mut status.conditions,
        condition_type::AVAILABLE,
        state,
        why,
        &message,
    );
    status
}

/// `message` without any of `secrets` (credential values) and without the
/// query string of any signed URL (`X-Amz-Signature`, `X-Amz-Credential`,
/// `Signature=`), bounded to [`haulage_api::condition::MAX_MESSAGE_BYTES`].
/// Store messages carry neither by construction; this is the second line
/// of defence for text that reaches a status every watcher reads.
pub fn sanitize_message(message: &str, secrets: &[&str]) -> String {
    let mut text = message.to_string();
    for secret in secrets.iter().filter(|secret| !secret.is_empty()) {
        text = text.replace(secret, "<redacted>");
    }
    let words: Vec<String> = text
        .split(' ')
        .map(|word| {
            let lower = word.to_ascii_lowercase();
            match word.find('?') {
                Some(query)
                    if lower.contains("x-amz-signature")
                        || lower.contains("x-amz-credential")
                        || lower.contains("x-amz-security-token")
                        || lower.contains("signature=") =>
                {
                    format!("{}?<redacted>", &word[..query])
                }
                _ => word.to_string(),
            }
        })
        .collect();
    bounded_message(&words.join(" "))
}

/// `interval` stretched or shrunk by a fixed fraction (up to ±10 %) that
/// depends only on `key` (the location's uid), so each location keeps its
/// own period and locations created together drift apart.
pub fn jittered_interval(interval: Duration, key: &str) -> Duration {
    let mut hasher = DefaultHasher::new();
    key.hash(&mut hasher);
    let span = 2 * JITTER_PER_MILLE + 1;
    let per_mille = 1000 - JITTER_PER_MILLE + hasher.finish() % span;
    let millis = interval.as_millis().saturating_mul(u128::from(per_mille)) / 1000;
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// When a location is next to be probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeDue {
    /// Now: never validated, spec changed since, or the period has passed.
    Now,
    /// After this long.
    In(Duration),
    /// Only when the spec changes (`validationFrequency: 0`, and the
    /// current generation was validated).
    OnChange,
}

/// When `location` is due for a probe with `period` (`None`: validate on
/// create and change only). A status event (this replica's write or
/// another's) therefore never causes an extra probe.
pub fn probe_due(
    location: &BackupStorageLocation,
    period: Option<Duration>,
    now: &Time,
) -> ProbeDue {
    let Some(status) = location.status.as_ref() else {
        return ProbeDue::Now;
    };
    if status.observed_generation != location.metadata.generation {
        return ProbeDue::Now;
    }
    let Some(last) = status.last_validation_time.as_ref() else {
        return ProbeDue::Now;
    };
    let Some(period) = period else {
        return ProbeDue::OnChange;
    };
    let elapsed = Duration::try_from(now.0.duration_since(last.0)).unwrap_or(Duration::ZERO);
    match period.checked_sub(elapsed) {
        Some(remaining) if !remaining.is_zero() => ProbeDue::In(remaining),
        _ => ProbeDue::Now,
    }
}

/// Which of several `default: true` locations is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultChoice {
    /// The oldest one (creation time, then name): backups naming no
    /// location use it.
    pub winner: String,
    /// The other locations marked default, in the same order.
    pub others: Vec<String>,
}

/// The default location among `locations` (pure): of those marked
/// `default: true`, the oldest by `creationTimestamp`, then by name. `None`
/// when none is marked. Backups (`resolve_location`), the status
/// conditions and `haulage status` all use this one rule.
pub fn choose_default<'a>(
    locations: impl IntoIterator<Item = &'a BackupStorageLocation>,
) -> Option<DefaultChoice> {
    let mut marked: Vec<(Option<i64>, String)> = locations
        .into_iter()
        .filter(|location| location.spec.is_default)
        .map(|location| {
            (
                location
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map(|time| time.0.as_second()),
                location.name_any(),
            )
        })
        .collect();
    // A missing timestamp (only in tests) sorts last.
    marked.sort_by(|a, b| (a.0.is_none(), a.0, &a.1).cmp(&(b.0.is_none(), b.0, &b.1)));
    let mut names = marked.into_iter().map(|(_, name)| name);
    let winner = names.next()?;
    Some(DefaultChoice {
        winner,
        others: names.collect(),
    })
}

/// The `UniqueDefault` condition of location `name` (pure): `None` when it
/// is not marked default (the condition is then removed), `True` when it is
/// the only one, `False` with reason `DefaultConflict` on each of several,
/// the winner's message naming the others and a loser's naming the winner.
pub fn default_condition(
    name: &str,
    is_default: bool,
    choice: Option<&DefaultChoice>,
) -> Option<(ConditionStatus, &'static str, String)> {
    if !is_default {
        return None;
    }
    let choice = choice?;
    if choice.others.is_empty() {
        return Some((
            ConditionStatus::True,
            reason::SINGLE_DEFAULT,
            "the only BackupStorageLocation marked default: backups that name no location use it"
                .to_string(),
        ));
    }
    let message = if choice.winner == name {
        format!(
            "used as the default because it is the oldest, but {} also marked default: set default: false on all but one",
            if choice.others.len() == 1 {
                format!("{} is", choice.others[0])
            } else {
                format!("{} are", choice.others.join(", "))
            }
        )
    } else {
        format!(
            "not used as the default: {} is older and also marked default; set default: false on all but one",
            choice.winner
        )
    };
    Some((ConditionStatus::False, reason::DEFAULT_CONFLICT, message))
}

/// `status` with the `UniqueDefault` condition set or removed as
/// [`default_condition`] says (pure).
pub fn with_default_condition(
    mut status: BackupStorageLocationStatus,
    condition: Option<(ConditionStatus, &'static str, String)>,
    generation: Option<i64>,
    now: Time,
) -> BackupStorageLocationStatus {
    match condition {
        None => status
            .conditions
            .retain(|condition| condition.type_ != condition_type::UNIQUE_DEFAULT),
        Some((state, why, message)) => Conditions { generation, now }.set(
            &mut status.conditions,
            condition_type::UNIQUE_DEFAULT,
            state,
            why,
            &message,
        ),
    }
    status
}

/// How the locations of the controller's namespace stand, for the periodic
/// log line (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocationsSummary {
    /// There is no location at all: every backup waits.
    NoLocation,
    /// Every location is Available.
    AllAvailable,
    /// Some are not Available (`name (Reason)`), the others are.
    SomeUnavailable {
        /// The ones that are not, with their reason.
        unavailable: Vec<String>,
    },
    /// None is Available (`name (Reason)`).
    AllUnavailable {
        /// Every location, with its reason.
        unavailable: Vec<String>,
    },
}

/// Summarise `locations` (sorted by name; a location never validated
/// counts as not Available, reason `NotValidatedYet`).
pub fn summarize_locations<'a>(
    locations: impl IntoIterator<Item = &'a BackupStorageLocation>,
) -> LocationsSummary {
    let mut total = 0;
    let mut unavailable: Vec<String> = Vec::new();
    for location in locations {
        total += 1;
        let status = location.status.clone().unwrap_or_default();
        if status.phase != Some(BackupStorageLocationPhase::Available) {
            let why = find_reason(&status).unwrap_or_else(|| {
                if status.phase.is_none() {
                    "NotValidatedYet".to_string()
                } else {
                    "NoReason".to_string()
                }
            });
            unavailable.push(format!("{} ({why})", location.name_any()));
        }
    }
    unavailable.sort();
    if total == 0 {
        LocationsSummary::NoLocation
    } else if unavailable.is_empty() {
        LocationsSummary::AllAvailable
    } else if unavailable.len() == total {
        LocationsSummary::AllUnavailable { unavailable }
    } else {
        LocationsSummary::SomeUnavailable { unavailable }
    }
}

/// The reason of the `Available` condition, if any.
pub fn find_reason(status: &BackupStorageLocationStatus) -> Option<String> {
    find_condition(&status.conditions, condition_type::AVAILABLE)
        .map(|condition| condition.reason.clone())
}

fn requeue_after(duration: Duration) -> Requeue {
    Requeue::After(duration.max(Duration::from_millis(MINIMUM_REQUEUE_MILLISECONDS)))
}

/// What the BackupStorageLocation reconciler read from its caches.
#[derive(Debug, Clone)]
pub struct LocationObservation<'a> {
    /// The location.
    pub location: &'a BackupStorageLocation,
    /// Every location of its namespace, itself included (for the default).
    pub siblings: Vec<&'a BackupStorageLocation>,
}

/// The first decision: whether to probe now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeStep {
    /// Not due; keep the status (the default condition aside).
    NotDue {
        /// When it is due, or `OnChange`.
        requeue: Requeue,
    },
    /// Probe now, then look again at `requeue`.
    Probe {
        /// The next look after this probe.
        requeue: Requeue,
    },
    /// Due, but its `validationFrequency` is not a duration: this outcome
    /// stands for the probe.
    Refuse {
        /// The InvalidSpec outcome naming the field.
        outcome: ProbeOutcome,
        /// The next look, at a fallback interval.
        requeue: Requeue,
    },
    /// Not a duration, and not due: keep the status.
    WaitInvalid {
        /// The next look, at a fallback interval.
        requeue: Requeue,
    },
}

/// Whether `location` is to be probed at `now`: its period is its
/// `validationFrequency` with a per-location jitter keyed by its UID.
pub fn decide_probe(location: &BackupStorageLocation, now: &Time) -> ProbeStep {
    let jitter_key = location.uid().unwrap_or_else(|| location.name_any());
    match location.spec.validation_interval() {
        Err(error) => {
            let requeue = Requeue::After(jittered_interval(
                Duration::from_secs(FALLBACK_INTERVAL_SECONDS),
                &jitter_key,
            ));
            if probe_due(location, None, now) == ProbeDue::Now {
                ProbeStep::Refuse {
                    outcome: ProbeOutcome::failed(
                        ProbeProblem::InvalidSpec,
                        format!(
                            "spec.validationFrequency {:?} is not a duration ({error}): use e.g. 30s, 5m or 0",
                            location.spec.validation_frequency
                        ),
                    ),
                    requeue,
                }
            } else {
                ProbeStep::WaitInvalid { requeue }
            }
        }
        Ok(interval) => {
            let period = interval.map(|interval| jittered_interval(interval, &jitter_key));
            match probe_due(location, period, now) {
                ProbeDue::In(remaining) => ProbeStep::NotDue {
                    requeue: requeue_after(remaining),
                },
                ProbeDue::OnChange => ProbeStep::NotDue {
                    requeue: Requeue::OnChange,
                },
                ProbeDue::Now => ProbeStep::Probe {
                    requeue: period.map_or(Requeue::OnChange, requeue_after),
                },
            }
        }
    }
}

/// What validation produced this time.
#[derive(Debug, Clone, Copy)]
pub enum Validation<'a> {
    /// No probe ran.
    None,
    /// A probe ran; `secrets` are the credential values no message may hold.
    Probed {
        /// Its outcome.
        outcome: &'a ProbeOutcome,
        /// Values to redact.
        secrets: &'a [&'a str],
    },
    /// The spec was refused without a probe ([`ProbeStep::Refuse`]).
    Refused {
        /// The InvalidSpec outcome.
        outcome: &'a ProbeOutcome,
    },
}

/// The second decision: the status to write (`None`: unchanged) and the
/// Event to record when a probe changed the phase or the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct LocationDecision {
    /// The next status, when it differs from the old one.
    pub status: Option<BackupStorageLocationStatus>,
    /// An Event on a change of phase or reason by a probe.
    pub event: Option<Event>,
}

/// The status after `validation`, with the default condition kept current
/// (pure).
pub fn decide_status(
    observation: &LocationObservation<'_>,
    validation: Validation<'_>,
    now: Time,
) -> LocationDecision {
    let location = observation.location;
    let generation = location.metadata.generation;
    let mut old = location.status.clone().unwrap_or_default();
    // `status.maintenance` belongs to the maintenance runner (its own field
    // manager): this decision neither compares nor writes it, so a status
    // applied from an older cache never undoes a prune's record.
    old.maintenance = None;
    let mut event = None;
    let status = match validation {
        Validation::None => old.clone(),
        Validation::Refused { outcome } => {
            next_location_status(&old, outcome, &[], generation, now.clone())
        }
        Validation::Probed { outcome, secrets } => {
            let status = next_location_status(&old, outcome, secrets, generation, now.clone());
            if status.phase != old.phase || find_reason(&status) != find_reason(&old) {
                let note = status.message.clone().unwrap_or_default();
                event = Some(
                    if status.phase == Some(BackupStorageLocationPhase::Available) {
                        Event::normal("Available", "Validate", note)
                    } else {
                        Event::warning(find_reason(&status).unwrap_or_default(), "Validate", note)
                    },
                );
            }
            status
        }
    };
    let choice = choose_default(observation.siblings.iter().copied());
    let status = with_default_condition(
        status,
        default_condition(
            &location.name_any(),
            location.spec.is_default,
            choice.as_ref(),
        ),
        generation,
        now,
    );
    LocationDecision {
        status: (status != old).then_some(status),
        event,
    }
}

/// The storage location of a backup or restore that records the one its
/// work began with: `recorded` (its status) when there is one, else `named`
/// (its spec), else the default one of `namespace` — so a location that
/// becomes the default later never takes over work already begun.
pub fn resolve_kept_location<'a>(
    namespace: &str,
    recorded: Option<&str>,
    named: Option<&str>,
    locations: &'a [Arc<BackupStorageLocation>],
) -> (StorageState, Option<&'a BackupStorageLocation>) {
    resolve_location(namespace, recorded.or(named), locations)
}

/// The storage location named `wanted` (or the default one) among the
/// `locations` of `namespace`, and its state: what a backup or restore
/// waits for.
pub fn resolve_location<'a>(
    namespace: &str,
    wanted: Option<&str>,
    locations: &'a [Arc<BackupStorageLocation>],
) -> (StorageState, Option<&'a BackupStorageLocation>) {
    let candidates: Vec<&BackupStorageLocation> = locations
        .iter()
        .map(Arc::as_ref)
        .filter(|location| location.namespace().as_deref() == Some(namespace))
        .collect();
    // Several `default: true` locations: the same rule as their conditions.
    let wanted_name = match wanted {
        Some(name) => Some(name.to_string()),
        None => choose_default(candidates.iter().copied()).map(|choice| choice.winner),
    };
    let found = wanted_name.and_then(|wanted| {
        candidates
            .into_iter()
            .find(|location| location.metadata.name.as_deref() == Some(wanted.as_str()))
    });
    let wanted = wanted.map_or_else(|| "(the default)".to_string(), str::to_string);
    let Some(location) = found else {
        return (StorageState::Missing { name: wanted }, None);
    };
    let name = location.name_any();
    let status = location.status.clone().unwrap_or_default();
    let state = if status.phase == Some(BackupStorageLocationPhase::Available) {
        StorageState::Available { name }
    } else {
        StorageState::Unavailable {
            name,
            message: status
                .message
                .unwrap_or_else(|| "not validated yet".to_string()),
        }
    };
    (state, Some(location))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::at;

    /// Location `name`, marked default, created `created` seconds after
    /// the epoch.
    fn default_at(name: &str, created: i64) -> BackupStorageLocation {
        BackupStorageLocation::test(name)
            .marked_default()
            .created_at(created)
    }

    fn failed(problem: ProbeProblem, message: &str) -> ProbeOutcome {
        ProbeOutcome::failed(problem, message)
    }

    #[test]
    fn a_location_validated_recently_at_its_generation_is_not_probed_again_on_a_status_event() {
        let period = Some(Duration::from_secs(60));
        let mut location = BackupStorageLocation::test("minio");
        assert_eq!(probe_due(&location, period, &at(0)), ProbeDue::Now);
        location.status = Some(BackupStorageLocationStatus {
            last_validation_time: Some(at(0)),
            observed_generation: location.metadata.generation,
            ..Default::default()
        });
        assert_eq!(
            probe_due(&location, period, &at(20)),
            ProbeDue::In(Duration::from_secs(40))
        );
        assert_eq!(probe_due(&location, period, &at(60)), ProbeDue::Now);
        location.metadata.generation = Some(2);
        assert_eq!(
            probe_due(&location, period, &at(20)),
            ProbeDue::Now,
            "spec changed"
        );
    }

    #[test]
    fn zero_frequency_validates_on_create_and_change_only() {
        let mut location = BackupStorageLocation::test("minio");
        assert_eq!(probe_due(&location, None, &at(0)), ProbeDue::Now);
        location.status = Some(BackupStorageLocationStatus {
            last_validation_time: Some(at(0)),
            observed_generation: location.metadata.generation,
            ..Default::default()
        });
        assert_eq!(probe_due(&location, None, &at(86_400)), ProbeDue::OnChange);
        location.metadata.generation = Some(7);
        assert_eq!(probe_due(&location, None, &at(86_400)), ProbeDue::Now);
    }

    #[test]
    fn jitter_stays_within_ten_percent_is_stable_per_location_and_spreads_locations() {
        let interval = Duration::from_secs(60);
        let mut seen = std::collections::BTreeSet::new();
        for index in 0..200 {
            let key = format!("uid-{index}");
            let period = jittered_interval(interval, &key);
            assert!(
                period >= Duration::from_secs(54) && period <= Duration::from_secs(66),
                "{key}: {period:?}"
            );
            assert_eq!(period, jittered_interval(interval, &key), "deterministic");
            seen.insert(period);
        }
        assert!(seen.len() > 50, "only {} distinct periods", seen.len());
    }

    #[test]
    fn a_successful_probe_makes_the_location_available() {
        let status = next_location_status(
            &BackupStorageLocationStatus::default(),
            &ProbeOutcome::Succeeded {
                latency_milliseconds: 12,
                initialized: false,
                index_bytes: 4096,
            },
            &[],
            Some(3),
            at(0),
        );
        assert_eq!(status.phase, Some(BackupStorageLocationPhase::Available));
        assert_eq!(status.last_probe_latency_milliseconds, Some(12));
        assert_eq!(status.index_bytes, Some(4096));
        assert_eq!(status.observed_generation, Some(3));
        let condition = find_condition(&status.conditions, condition_type::AVAILABLE).expect("set");
        assert_eq!(condition.reason, reason::PROBE_SUCCEEDED);
        assert_eq!(condition.status, ConditionStatus::True);
    }

    #[test]
    fn missing_credentials_make_it_unavailable_and_keep_the_transition_time_while_they_stay_missing()
     {
        let outcome = failed(ProbeProblem::CredentialsMissing, "Secret s3 does not exist");
        let first = next_location_status(
            &BackupStorageLocationStatus::default(),
            &outcome,
            &[],
            None,
            at(0),
        );
        let second = next_location_status(&first, &outcome, &[], None, at(60));
        assert_eq!(second.phase, Some(BackupStorageLocationPhase::Unavailable));
        let condition = find_condition(&second.conditions, condition_type::AVAILABLE).expect("set");
        assert_eq!(condition.reason, reason::CREDENTIALS_MISSING);
        assert_eq!(condition.last_transition_time, at(0));
        assert_eq!(second.last_validation_time, Some(at(60)));
    }

    #[test]
    fn messages_never_carry_the_secret_or_a_signed_url_and_stay_within_one_kibibyte() {
        let secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
        let message = format!(
            "put failed for key {secret}: see https://bucket.s3.example/key?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20261129&X-Amz-Signature=abcdef0123 and retry {}",
            "x".repeat(2000)
        );
        let status = next_location_status(
            &BackupStorageLocationStatus::default(),
            &failed(ProbeProblem::AccessDenied, &message),
            &[secret],
            None,
            at(0),
        );
        let written = status.message.expect("message");
        let condition = find_condition(&status.conditions, condition_type::AVAILABLE).expect("set");
        for text in [&written, &condition.message] {
            assert!(!text.contains(secret), "{text}");
            assert!(!text.contains("X-Amz-Signature"), "{text}");
            assert!(!text.contains("abcdef0123"), "{text}");
            assert!(
                text.contains("https://bucket.s3.example/key?<redacted>"),
                "{text}"
            );
            assert!(
                text.len() <= haulage_api::condition::MAX_MESSAGE_BYTES,
                "{}",
                text.len()
            );
        }
        assert_eq!(sanitize_message("plain words", &[""]), "plain words");
    }

    #[test]
    fn the_oldest_default_wins_then_the_name_and_each_default_gets_a_condition() {
        let older = default_at("zeta", 0);
        let newer = default_at("alpha", 10);
        let same_time = default_at("beta", 10);
        let plain = BackupStorageLocation::test("plain").created_at(-100);
        let all = [
            newer.clone(),
            plain.clone(),
            same_time.clone(),
            older.clone(),
        ];
        let choice = choose_default(all.iter()).expect("a default");
        assert_eq!(choice.winner, "zeta");
        assert_eq!(choice.others, ["alpha", "beta"]);

        let (state, why, message) =
            default_condition("zeta", true, Some(&choice)).expect("winner condition");
        assert_eq!(
            (state, why),
            (ConditionStatus::False, reason::DEFAULT_CONFLICT)
        );
        assert!(
            message.contains("alpha, beta are also marked default"),
            "{message}"
        );
        let (state, why, message) =
            default_condition("alpha", true, Some(&choice)).expect("loser condition");
        assert_eq!(
            (state, why),
            (ConditionStatus::False, reason::DEFAULT_CONFLICT)
        );
        assert!(message.contains("zeta is older"), "{message}");
        assert_eq!(default_condition("plain", false, Some(&choice)), None);

        let single = choose_default([&older, &plain]).expect("a default");
        assert_eq!(
            default_condition("zeta", true, Some(&single)).map(|c| (c.0, c.1)),
            Some((ConditionStatus::True, reason::SINGLE_DEFAULT))
        );
        assert_eq!(choose_default([&plain]), None);
    }

    #[test]
    fn the_summary_distinguishes_none_some_and_all_unavailable() {
        assert_eq!(summarize_locations([]), LocationsSummary::NoLocation);
        let good =
            BackupStorageLocation::test("good").with_phase(BackupStorageLocationPhase::Available);
        let mut bad = BackupStorageLocation::test("bad");
        bad.status = Some(next_location_status(
            &BackupStorageLocationStatus::default(),
            &failed(ProbeProblem::BucketNotFound, "no bucket"),
            &[],
            None,
            at(0),
        ));
        let fresh = BackupStorageLocation::test("fresh");
        assert_eq!(summarize_locations([&good]), LocationsSummary::AllAvailable);
        assert_eq!(
            summarize_locations([&good, &bad, &fresh]),
            LocationsSummary::SomeUnavailable {
                unavailable: vec![
                    "bad (BucketNotFound)".to_string(),
                    "fresh (NotValidatedYet)".to_string()
                ]
            }
        );
        assert_eq!(
            summarize_locations([&bad]),
            LocationsSummary::AllUnavailable {
                unavailable: vec!["bad (BucketNotFound)".to_string()]
            }
        );
    }

    #[test]
    fn a_location_no_longer_marked_default_loses_its_default_condition() {
        let conflict = with_default_condition(
            BackupStorageLocationStatus::default(),
            Some((
                ConditionStatus::False,
                reason::DEFAULT_CONFLICT,
                "x".to_string(),
            )),
            Some(1),
            at(0),
        );
        assert!(find_condition(&conflict.conditions, condition_type::UNIQUE_DEFAULT).is_some());
        let cleared = with_default_condition(conflict, None, Some(2), at(5));
        assert!(find_condition(&cleared.conditions, condition_type::UNIQUE_DEFAULT).is_none());
    }

    fn observed(location: &BackupStorageLocation) -> LocationObservation<'_> {
        LocationObservation {
            location,
            siblings: vec![location],
        }
    }

    #[test]
    fn a_never_validated_location_is_probed_and_then_looked_at_after_its_jittered_period() {
        let location = BackupStorageLocation::test("minio");
        let ProbeStep::Probe {
            requeue: Requeue::After(period),
        } = decide_probe(&location, &at(0))
        else {
            panic!("a new location is probed at once");
        };
        assert!(period >= Duration::from_secs(54) && period <= Duration::from_secs(66));
    }

    #[test]
    fn a_recently_validated_location_is_not_due_and_its_status_is_not_rewritten() {
        let mut location = BackupStorageLocation::test("minio");
        location.spec.validation_frequency = "0".to_string();
        let decision = decide_status(
            &observed(&location),
            Validation::Probed {
                outcome: &ProbeOutcome::Succeeded {
                    latency_milliseconds: 3,
                    initialized: false,
                    index_bytes: 0,
                },
                secrets: &[],
            },
            at(0),
        );
        location.status = decision.status;
        assert_eq!(
            decide_probe(&location, &at(10)),
            ProbeStep::NotDue {
                requeue: Requeue::OnChange
            }
        );
        let unchanged = decide_status(&observed(&location), Validation::None, at(10));
        assert_eq!(unchanged.status, None);
        assert_eq!(unchanged.event, None);
    }

    #[test]
    fn the_status_written_after_a_probe_leaves_the_maintenance_record_to_its_runner() {
        let mut location = BackupStorageLocation::test("minio");
        let succeeded = ProbeOutcome::Succeeded {
            latency_milliseconds: 3,
            initialized: false,
            index_bytes: 0,
        };
        let probed = Validation::Probed {
            outcome: &succeeded,
            secrets: &[],
        };
        location.status = decide_status(&observed(&location), probed, at(0)).status;
        // A prune's record, newer than this copy of the location knows of
        // or not: the probe's write neither carries nor compares it.
        location.status.as_mut().expect("status").maintenance =
            Some(haulage_api::location::MaintenanceStatus {
                result: Some(haulage_api::location::MaintenanceResult::Running),
                ..Default::default()
            });
        let next = decide_status(&observed(&location), probed, at(120))
            .status
            .expect("a probe rewrites the validation time");
        assert_eq!(next.maintenance, None);
        assert_eq!(
            decide_status(&observed(&location), Validation::None, at(130)).status,
            None,
            "the prune's record alone is no reason to write"
        );
    }

    #[test]
    fn a_probe_that_changes_the_phase_records_an_event_and_one_that_does_not_stays_quiet() {
        let mut location = BackupStorageLocation::test("minio");
        let failure = failed(ProbeProblem::AccessDenied, "403 Forbidden");
        let first = decide_status(
            &observed(&location),
            Validation::Probed {
                outcome: &failure,
                secrets: &[],
            },
            at(0),
        );
        let event = first.event.expect("a phase change is announced");
        assert_eq!(event.kind, crate::action::EventKind::Warning);
        assert_eq!(event.reason, reason::ACCESS_DENIED);
        location.status = first.status;
        let again = decide_status(
            &observed(&location),
            Validation::Probed {
                outcome: &failure,
                secrets: &[],
            },
            at(60),
        );
        assert_eq!(again.event, None);
        assert!(again.status.is_some(), "the validation time moves on");
        let back = decide_status(
            &observed(&location),
            Validation::Probed {
                outcome: &ProbeOutcome::Succeeded {
                    latency_milliseconds: 5,
                    initialized: false,
                    index_bytes: 0,
                },
                secrets: &[],
            },
            at(120),
        );
        assert_eq!(
            back.event.map(|event| (event.kind, event.reason)),
            Some((crate::action::EventKind::Normal, "Available".to_string()))
        );
    }

    #[test]
    fn a_validation_frequency_that_is_not_a_duration_is_refused_once_without_an_event() {
        let mut location = BackupStorageLocation::test("minio");
        location.spec.validation_frequency = "often".to_string();
        let ProbeStep::Refuse { outcome, .. } = decide_probe(&location, &at(0)) else {
            panic!("refused when due");
        };
        let decision = decide_status(
            &observed(&location),
            Validation::Refused { outcome: &outcome },
            at(0),
        );
        assert_eq!(decision.event, None);
        let status = decision.status.expect("written");
        assert_eq!(find_reason(&status).as_deref(), Some(reason::INVALID_SPEC));
        assert!(
            status
                .message
                .clone()
                .unwrap_or_default()
                .contains("validationFrequency")
        );
        location.status = Some(status);
        assert!(matches!(
            decide_probe(&location, &at(5)),
            ProbeStep::WaitInvalid { .. }
        ));
    }

    #[test]
    fn the_default_condition_follows_the_siblings_without_a_probe() {
        let older = default_at("zeta", 0);
        let newer = default_at("alpha", 10);
        let decision = decide_status(
            &LocationObservation {
                location: &newer,
                siblings: vec![&older, &newer],
            },
            Validation::None,
            at(20),
        );
        let status = decision.status.expect("the conflict is written");
        let condition =
            find_condition(&status.conditions, condition_type::UNIQUE_DEFAULT).expect("set");
        assert_eq!(condition.reason, reason::DEFAULT_CONFLICT);
        assert!(condition.message.contains("zeta"));
    }
}
