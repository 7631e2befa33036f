//! The BackupStorageLocation reconciler: validate each location when it is
//! created or changed and then every `validationFrequency` (with a
//! per-location jitter), and write what it found into its status.
//!
//! A probe reads the credentials Secret (in the controller's namespace),
//! opens the bucket with the location's endpoint, region, path style and CA
//! bundle, runs [`check_location`] (write, read, list, delete of a small
//! object under the prefix) and then checks the repository config there
//! (present and of a supported format, or created when `spec.initialize`
//! allows it). The whole probe runs under [`PROBE_TIMEOUT_SECONDS`], so a
//! hung endpoint holds one reconcile slot for at most that long.
//!
//! The outcome is classified into one reason of a fixed set
//! ([`ProbeProblem::reason`]) from the store's [`FailureCause`], never by
//! reading messages; the message is cleaned of the credentials' secret
//! values and of signed URL query strings, and bounded to 1 KiB.
//!
//! Everything that decides is pure and unit-tested: [`next_location_status`],
//! [`ProbeProblem::from_cause`], [`sanitize_message`], [`jittered_interval`],
//! [`probe_due`], [`choose_default`] and [`default_condition`].
//!
//! At most one probe per location is in flight: kube-runtime's `Controller`
//! never runs two reconciles of one object at once (a trigger arriving
//! while one runs is held until it finishes). Every replica runs this
//! reconciler, but a probe is skipped while the status (shared through the
//! API server) shows a validation at the current generation younger than
//! the interval, so replicas mostly take turns; when two do probe at the
//! same moment, both write the same kind of status with server-side apply
//! under one field manager, and the later write wins. Probe objects have
//! random names and repository initialisation is create-only, so
//! concurrent probes are harmless.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use tracing::{info, instrument};

use crate::api::condition::{
    Condition, ConditionStatus, bounded_message, condition_type, reason, set_condition,
};
use crate::api::location::BackupStorageLocationSpec;
use crate::api::{BackupStorageLocation, BackupStorageLocationPhase, BackupStorageLocationStatus};
use crate::controller::error::{Error, kube_error};
use crate::controller::{Context, FIELD_MANAGER};
use crate::engine::{EngineError, Repository};
use crate::repo::CONFIG_KEY;
use crate::repo::config::{ConfigError, RepoConfig};
use crate::store::probe::check_location;
use crate::store::retry::RetryPolicy;
use crate::store::{
    DynStore, FailureCause, OpenStoreError, S3Credentials, S3Options, StoreOptions, open_store,
};

/// Time a whole probe (credentials aside) may take: an unreachable or
/// silent endpoint must not hold a reconcile slot longer.
pub const PROBE_TIMEOUT_SECONDS: u64 = 30;
/// Each location's interval is stretched or shrunk by up to this many per
/// mille (±10 %), by a fixed amount per location, so locations created
/// together drift apart instead of probing together.
const JITTER_PER_MILLE: u64 = 100;
/// Attempts per store request in a probe. A probe reports what it sees; the
/// next probe is the real retry. Two attempts ride over one dropped
/// connection.
const PROBE_REQUEST_ATTEMPTS: u32 = 2;
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
    /// Anything else (the message says what).
    Other,
}

impl ProbeProblem {
    /// The condition reason (one of [`crate::api::condition::reason`]).
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
            ProbeProblem::Other => reason::PROBE_FAILED,
        }
    }

    /// The problem a store failure of this cause is.
    pub fn from_cause(cause: FailureCause) -> Self {
        match cause {
            FailureCause::Unreachable => ProbeProblem::EndpointUnreachable,
            FailureCause::Tls => ProbeProblem::Tls,
            FailureCause::CredentialsMissing => ProbeProblem::CredentialsMissing,
            FailureCause::AccessDenied => ProbeProblem::AccessDenied,
            FailureCause::BucketNotFound => ProbeProblem::BucketNotFound,
            FailureCause::WrongRegion => ProbeProblem::RegionMismatch,
            FailureCause::ClockSkew => ProbeProblem::ClockSkew,
            FailureCause::ServerError => ProbeProblem::ServerError,
            FailureCause::Other => ProbeProblem::Other,
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
    fn failed(problem: ProbeProblem, message: impl Into<String>) -> Self {
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
        } => {
            status.last_probe_latency_milliseconds = Some(*latency_milliseconds);
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
    set_condition(
        &mut status.conditions,
        Condition::new(
            condition_type::AVAILABLE,
            state,
            why,
            &message,
            generation,
            now.clone(),
        ),
        now,
    );
    status
}

/// `message` without any of `secrets` (credential values) and without the
/// query string of any signed URL (`X-Amz-Signature`, `X-Amz-Credential`,
/// `Signature=`), bounded to [`crate::api::condition::MAX_MESSAGE_BYTES`].
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

/// S3 settings of a location with the given credentials: its endpoint,
/// region, path style and CA bundle.
pub fn s3_options(spec: &BackupStorageLocationSpec, credentials: S3Credentials) -> StoreOptions {
    StoreOptions {
        s3: S3Options {
            endpoint: spec.endpoint.clone(),
            region: spec.region.clone(),
            path_style: spec.s3_force_path_style,
            credentials: Some(credentials),
            ca_bundle_pem: spec.ca_bundle.clone().map(String::into_bytes),
            ..S3Options::default()
        },
        ..StoreOptions::default()
    }
}

/// Read the AWS credentials file the location's Secret holds. The inner
/// `Err` says, for a person, what is missing.
pub async fn read_credentials(
    secrets: &Api<Secret>,
    spec: &BackupStorageLocationSpec,
) -> Result<Result<(Secret, S3Credentials), String>, Error> {
    let name = &spec.credential.name;
    let secret = match secrets.get_opt(name).await {
        Ok(Some(secret)) => secret,
        Ok(None) => {
            return Ok(Err(format!(
                "Secret {name} does not exist: create it in this namespace with an AWS credentials file under key {}",
                spec.credential.key
            )));
        }
        Err(source) => return Err(kube_error("get", "Secret", name.clone())(source)),
    };
    let Some(bytes) = secret
        .data
        .as_ref()
        .and_then(|data| data.get(&spec.credential.key))
    else {
        return Ok(Err(format!(
            "Secret {name} has no key {}: put the AWS credentials file there or set spec.credential.key",
            spec.credential.key
        )));
    };
    let text = String::from_utf8_lossy(&bytes.0);
    match S3Credentials::parse_credentials_file(&text, "default") {
        Ok(credentials) => Ok(Ok((secret, credentials))),
        Err(problem) => Ok(Err(format!(
            "Secret {name} key {}: {problem}: it must hold an AWS credentials file with a [default] profile",
            spec.credential.key
        ))),
    }
}

/// Probe a location with `credentials`: the object round trip, then the
/// repository check, all within `timeout`. Never fails itself: every
/// failure is an outcome.
pub async fn probe_location(
    spec: &BackupStorageLocationSpec,
    credentials: S3Credentials,
    timeout: Duration,
) -> ProbeOutcome {
    let mut options = s3_options(spec, credentials);
    options.retry = Some(RetryPolicy {
        max_attempts: PROBE_REQUEST_ATTEMPTS,
        ..RetryPolicy::default()
    });
    let url = crate::controller::children::repository_url(spec);
    let probe = async {
        let store = match open_store(&url, &options).await {
            Ok(store) => store,
            Err(error @ (OpenStoreError::InvalidOption { .. } | OpenStoreError::Setup { .. })) => {
                return ProbeOutcome::failed(
                    ProbeProblem::InvalidSpec,
                    format!("{error}: fix the BackupStorageLocation's spec"),
                );
            }
            Err(error) => {
                return ProbeOutcome::failed(ProbeProblem::InvalidSpec, error.to_string());
            }
        };
        let started = std::time::Instant::now();
        let report = check_location(store.as_ref()).await;
        let latency_milliseconds = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
        if let Some((step, failure)) = report.first_failure() {
            return ProbeOutcome::failed(
                ProbeProblem::from_cause(failure.cause),
                format!("probe {step:?} failed: {}", failure.message),
            );
        }
        if !report.is_ok() {
            return ProbeOutcome::failed(ProbeProblem::Other, "the probe did not run every step");
        }
        match check_repository(store, spec.initialize).await {
            Ok(initialized) => ProbeOutcome::Succeeded {
                latency_milliseconds,
                initialized,
            },
            Err(outcome) => outcome,
        }
    };
    match tokio::time::timeout(timeout, probe).await {
        Ok(outcome) => outcome,
        Err(_) => ProbeOutcome::failed(
            ProbeProblem::Timeout,
            format!(
                "the probe of {url} did not finish within {}s: check that the endpoint answers (a firewall dropping packets looks like this)",
                timeout.as_secs()
            ),
        ),
    }
}

/// Check that the store holds a repository of a supported format, or
/// create one when `initialize`. `Ok(true)` when this call created it.
/// Creation is create-only: when another replica (or a user) created one
/// first, that one is checked instead.
pub async fn check_repository(store: DynStore, initialize: bool) -> Result<bool, ProbeOutcome> {
    let location = store.location();
    let config = match store.get(CONFIG_KEY, None).await {
        Ok(bytes) => bytes,
        Err(error) if error.is_not_found() && initialize => {
            return match Repository::init(store.clone()).await {
                Ok(_) => Ok(true),
                Err(EngineError::AlreadyInitialized { .. }) => {
                    Box::pin(check_repository(store, false)).await
                }
                Err(EngineError::Store { source, .. }) => Err(ProbeOutcome::failed(
                    ProbeProblem::from_cause(source.cause()),
                    format!("cannot create the repository at {location}: {source}"),
                )),
                Err(error) => Err(ProbeOutcome::failed(
                    ProbeProblem::Other,
                    format!("cannot create the repository at {location}: {error}"),
                )),
            };
        }
        Err(error) if error.is_not_found() => {
            return Err(ProbeOutcome::failed(
                ProbeProblem::RepositoryNotInitialized,
                format!(
                    "no haulage repository at {location}: run `haulage repo init --repo {location}` or set spec.initialize: true"
                ),
            ));
        }
        Err(error) => {
            return Err(ProbeOutcome::failed(
                ProbeProblem::from_cause(error.cause()),
                format!("cannot read the repository config: {error}"),
            ));
        }
    };
    match RepoConfig::from_json(&config) {
        Ok(_) => Ok(false),
        Err(error @ ConfigError::TooNew { .. }) => Err(ProbeOutcome::failed(
            ProbeProblem::RepositoryIncompatible,
            format!("{location}: {error}"),
        )),
        Err(error) => Err(ProbeOutcome::failed(
            ProbeProblem::RepositoryIncompatible,
            format!(
                "{location} holds a repository config haulage cannot use ({error}): point the location at another prefix or repair the config"
            ),
        )),
    }
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
        Some((state, why, message)) => {
            set_condition(
                &mut status.conditions,
                Condition::new(
                    condition_type::UNIQUE_DEFAULT,
                    state,
                    why,
                    &message,
                    generation,
                    now.clone(),
                ),
                now,
            );
        }
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

/// Log one line about the locations of `namespace`: a warning when there
/// is none or some are not Available, an error when none is, nothing when
/// all are; plus a warning while several are marked default. Called once
/// per summary interval, so a bad state is one line per interval, not a
/// stream.
pub fn log_locations_summary(namespace: &str, locations: &[Arc<BackupStorageLocation>]) {
    match summarize_locations(locations.iter().map(|location| location.as_ref())) {
        LocationsSummary::NoLocation => tracing::warn!(
            namespace,
            "no BackupStorageLocation: backups wait (WaitingForStorage) until one exists and is Available; create one in this namespace (see docs/api.md)"
        ),
        LocationsSummary::AllAvailable => {}
        LocationsSummary::SomeUnavailable { unavailable } => tracing::warn!(
            namespace,
            unavailable = %unavailable.join(", "),
            "some BackupStorageLocations are not Available: backups to them wait, backups to the others proceed; see `haulage status` or their status.message"
        ),
        LocationsSummary::AllUnavailable { unavailable } => tracing::error!(
            namespace,
            unavailable = %unavailable.join(", "),
            "no BackupStorageLocation is Available: every backup waits; see `haulage status` or their status.message"
        ),
    }
    if let Some(choice) = choose_default(locations.iter().map(|location| location.as_ref()))
        && !choice.others.is_empty()
    {
        tracing::warn!(
            namespace,
            used = %choice.winner,
            ignored = %choice.others.join(", "),
            "several BackupStorageLocations are marked default: the oldest is used; set default: false on all but one"
        );
    }
}

/// Probe a location when due, keep its default condition current, and
/// write its status when it changed.
#[instrument(skip_all, fields(location = %location.name_any()))]
pub async fn reconcile(
    location: Arc<BackupStorageLocation>,
    context: Arc<Context>,
) -> Result<Action, Error> {
    let name = location.name_any();
    let namespace = location.namespace().ok_or(Error::MissingField {
        kind: "BackupStorageLocation",
        field: "metadata.namespace",
    })?;
    let generation = location.metadata.generation;
    let old = location.status.clone().unwrap_or_default();
    let jitter_key = location.uid().unwrap_or_else(|| name.clone());

    let (status, action) = match location.spec.validation_interval() {
        Err(error) => {
            let due = probe_due(&location, None, &now());
            let status = if due == ProbeDue::Now {
                next_location_status(
                    &old,
                    &ProbeOutcome::failed(
                        ProbeProblem::InvalidSpec,
                        format!(
                            "spec.validationFrequency {:?} is not a duration ({error}): use e.g. 30s, 5m or 0",
                            location.spec.validation_frequency
                        ),
                    ),
                    &[],
                    generation,
                    now(),
                )
            } else {
                old.clone()
            };
            (
                status,
                Action::requeue(jittered_interval(
                    Duration::from_secs(FALLBACK_INTERVAL_SECONDS),
                    &jitter_key,
                )),
            )
        }
        Ok(interval) => {
            let period = interval.map(|interval| jittered_interval(interval, &jitter_key));
            match probe_due(&location, period, &now()) {
                ProbeDue::In(remaining) => (old.clone(), requeue_after(remaining)),
                ProbeDue::OnChange => (old.clone(), Action::await_change()),
                ProbeDue::Now => {
                    let (outcome, secrets) = probe(&location, &namespace, &context).await?;
                    let secret_values: Vec<&str> = secrets.iter().map(String::as_str).collect();
                    let status =
                        next_location_status(&old, &outcome, &secret_values, generation, now());
                    if status.phase != old.phase || find_reason(&status) != find_reason(&old) {
                        info!(
                            phase = ?status.phase,
                            reason = find_reason(&status).unwrap_or_default(),
                            "storage location validated"
                        );
                        let reason = find_reason(&status).unwrap_or_default();
                        let note = status.message.clone().unwrap_or_default();
                        if status.phase == Some(BackupStorageLocationPhase::Available) {
                            context
                                .events
                                .normal(location.as_ref(), "Available", "Validate", &note)
                                .await;
                        } else {
                            context
                                .events
                                .warning(location.as_ref(), &reason, "Validate", &note)
                                .await;
                        }
                    }
                    let action = period.map_or_else(Action::await_change, requeue_after);
                    (status, action)
                }
            }
        }
    };

    let locations = context.stores.locations.state();
    let siblings = locations
        .iter()
        .filter(|other| other.namespace().as_deref() == Some(namespace.as_str()))
        .map(|other| other.as_ref());
    let choice = choose_default(siblings);
    let status = with_default_condition(
        status,
        default_condition(&name, location.spec.is_default, choice.as_ref()),
        generation,
        now(),
    );

    if status != old {
        let api: Api<BackupStorageLocation> = Api::namespaced(context.client.clone(), &namespace);
        let patch = crate::api::status_apply::<BackupStorageLocation>(&status);
        api.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(kube_error(
            "apply status of",
            "BackupStorageLocation",
            &name,
        ))?;
    }
    Ok(action)
}

/// Read the credentials and probe; also returns the secret values, which
/// no message may contain.
async fn probe(
    location: &BackupStorageLocation,
    namespace: &str,
    context: &Context,
) -> Result<(ProbeOutcome, Vec<String>), Error> {
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), namespace);
    Ok(match read_credentials(&secrets, &location.spec).await? {
        Err(message) => (
            ProbeOutcome::failed(ProbeProblem::CredentialsMissing, message),
            Vec::new(),
        ),
        Ok((_, credentials)) => {
            let mut values = vec![credentials.secret_access_key.clone()];
            values.extend(credentials.session_token.clone());
            let outcome = probe_location(
                &location.spec,
                credentials,
                Duration::from_secs(PROBE_TIMEOUT_SECONDS),
            )
            .await;
            (outcome, values)
        }
    })
}

fn find_reason(status: &BackupStorageLocationStatus) -> Option<String> {
    crate::api::condition::find_condition(&status.conditions, condition_type::AVAILABLE)
        .map(|condition| condition.reason.clone())
}

fn requeue_after(duration: Duration) -> Action {
    Action::requeue(duration.max(Duration::from_millis(MINIMUM_REQUEUE_MILLISECONDS)))
}

/// The current time as an API timestamp.
pub(crate) fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::condition::find_condition;
    use crate::store::local::LocalStore;

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + seconds).expect("valid"))
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
            },
            &[],
            Some(3),
            at(0),
        );
        assert_eq!(status.phase, Some(BackupStorageLocationPhase::Available));
        assert_eq!(status.last_probe_latency_milliseconds, Some(12));
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
    fn each_store_cause_has_its_own_reason_and_every_reason_is_a_known_constant() {
        let causes = [
            (FailureCause::Unreachable, reason::ENDPOINT_UNREACHABLE),
            (FailureCause::Tls, reason::TLS_ERROR),
            (
                FailureCause::CredentialsMissing,
                reason::CREDENTIALS_MISSING,
            ),
            (FailureCause::AccessDenied, reason::ACCESS_DENIED),
            (FailureCause::BucketNotFound, reason::BUCKET_NOT_FOUND),
            (FailureCause::WrongRegion, reason::REGION_MISMATCH),
            (FailureCause::ClockSkew, reason::CLOCK_SKEW),
            (FailureCause::ServerError, reason::SERVER_ERROR),
            (FailureCause::Other, reason::PROBE_FAILED),
        ];
        for (cause, expected) in causes {
            assert_eq!(
                ProbeProblem::from_cause(cause).reason(),
                expected,
                "{cause:?}"
            );
        }
        for problem in [
            ProbeProblem::Timeout,
            ProbeProblem::RepositoryNotInitialized,
            ProbeProblem::RepositoryIncompatible,
            ProbeProblem::InvalidSpec,
        ] {
            assert!(reason::ALL.contains(&problem.reason()), "{problem:?}");
        }
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
                text.len() <= crate::api::condition::MAX_MESSAGE_BYTES,
                "{}",
                text.len()
            );
        }
        assert_eq!(sanitize_message("plain words", &[""]), "plain words");
    }

    #[test]
    fn the_oldest_default_wins_then_the_name_and_each_default_gets_a_condition() {
        let older = BackupStorageLocation::test("zeta")
            .marked_default()
            .created_at(0);
        let newer = BackupStorageLocation::test("alpha")
            .marked_default()
            .created_at(10);
        let same_time = BackupStorageLocation::test("beta")
            .marked_default()
            .created_at(10);
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

    fn store_in(dir: &tempfile::TempDir) -> DynStore {
        Arc::new(LocalStore::new(dir.path()))
    }

    #[tokio::test]
    async fn a_prefix_without_a_repository_is_not_initialized_unless_initialize_is_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_in(&dir);
        match check_repository(store.clone(), false).await {
            Err(ProbeOutcome::Failed { problem, message }) => {
                assert_eq!(problem, ProbeProblem::RepositoryNotInitialized);
                assert!(message.contains("spec.initialize"), "{message}");
            }
            other => panic!("expected RepositoryNotInitialized, got {other:?}"),
        }
        assert!(
            store.list("").await.expect("list").is_empty(),
            "nothing written"
        );
        assert_eq!(check_repository(store.clone(), true).await, Ok(true));
        // The next probe (or another replica) finds it and creates nothing.
        assert_eq!(check_repository(store.clone(), true).await, Ok(false));
        Repository::open(store).await.expect("a usable repository");
    }

    #[tokio::test]
    async fn a_repository_of_a_newer_format_is_incompatible() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_in(&dir);
        let mut config = RepoConfig::generate();
        config.format_version = crate::repo::config::FORMAT_VERSION + 1;
        store
            .put(
                CONFIG_KEY,
                config.to_json().into(),
                crate::store::PutMode::Create,
            )
            .await
            .expect("write config");
        match check_repository(store.clone(), true).await {
            Err(ProbeOutcome::Failed { problem, message }) => {
                assert_eq!(problem, ProbeProblem::RepositoryIncompatible);
                assert!(message.contains("upgrade haulage"), "{message}");
            }
            other => panic!("expected RepositoryIncompatible, got {other:?}"),
        }
        store
            .put(
                CONFIG_KEY,
                "not json".into(),
                crate::store::PutMode::Overwrite,
            )
            .await
            .expect("overwrite config");
        assert!(matches!(
            check_repository(store, false).await,
            Err(ProbeOutcome::Failed {
                problem: ProbeProblem::RepositoryIncompatible,
                ..
            })
        ));
    }

    fn spec_for(endpoint: String) -> BackupStorageLocationSpec {
        let mut spec = BackupStorageLocation::test("probe").spec;
        spec.endpoint = Some(endpoint);
        spec
    }

    fn credentials() -> S3Credentials {
        S3Credentials {
            access_key_id: "key".to_string(),
            secret_access_key: "secret-value-never-shown".to_string(),
            session_token: None,
        }
    }

    #[tokio::test]
    async fn a_port_that_refuses_connections_is_endpoint_unreachable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        drop(listener);
        let outcome = probe_location(
            &spec_for(format!("http://127.0.0.1:{port}")),
            credentials(),
            Duration::from_secs(PROBE_TIMEOUT_SECONDS),
        )
        .await;
        match outcome {
            ProbeOutcome::Failed { problem, message } => {
                assert_eq!(problem, ProbeProblem::EndpointUnreachable, "{message}");
                assert!(message.contains(&port.to_string()), "{message}");
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_endpoint_that_accepts_and_never_answers_is_a_probe_timeout_not_a_hang() {
        // A blackhole: connections are accepted (by the kernel's backlog)
        // but nothing is ever read or answered.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        let outcome = probe_location(
            &spec_for(format!("http://127.0.0.1:{port}")),
            credentials(),
            Duration::from_secs(2),
        )
        .await;
        drop(listener);
        assert!(
            matches!(
                outcome,
                ProbeOutcome::Failed {
                    problem: ProbeProblem::Timeout,
                    ..
                }
            ),
            "{outcome:?}"
        );
    }

    #[tokio::test]
    async fn an_inline_ca_bundle_that_is_not_pem_is_an_invalid_spec() {
        let mut spec = spec_for("https://127.0.0.1:9".to_string());
        spec.ca_bundle = Some("not a certificate".to_string());
        let outcome = probe_location(&spec, credentials(), Duration::from_secs(10)).await;
        assert!(
            matches!(
                &outcome,
                ProbeOutcome::Failed {
                    problem: ProbeProblem::InvalidSpec,
                    message,
                } if message.contains("CA bundle")
            ),
            "{outcome:?}"
        );
    }
}
