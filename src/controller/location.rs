//! The minimal BackupStorageLocation reconciler: read the location's
//! credentials Secret (in the controller's namespace), probe the bucket
//! with [`check_location`] and write the phase, so a VolumeBackup knows
//! whether it can start. Probes repeat every `validationFrequency`.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use tracing::{info, instrument};

use crate::api::condition::{Condition, ConditionStatus, condition_type, reason, set_condition};
use crate::api::location::BackupStorageLocationSpec;
use crate::api::{BackupStorageLocation, BackupStorageLocationPhase, BackupStorageLocationStatus};
use crate::controller::error::{Error, kube_error};
use crate::controller::{Context, FIELD_MANAGER};
use crate::store::probe::check_location;
use crate::store::{S3Credentials, S3Options, StoreOptions, open_store};

/// How often a location whose spec asks for no validation is looked at
/// again anyway (its phase is then left as the user's last probe made it).
const UNVALIDATED_RECHECK_SECONDS: u64 = 300;
/// Probe timeout: an unreachable endpoint must not hold a reconcile slot.
const PROBE_TIMEOUT_SECONDS: u64 = 30;

/// The outcome of one probe attempt, before it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Every probe step passed.
    Succeeded {
        /// Wall time of the probe, in milliseconds.
        latency_milliseconds: i64,
    },
    /// The credentials Secret or key is missing or unreadable.
    CredentialsNotFound(String),
    /// A probe step failed.
    Failed(String),
}

/// The location's next status after a probe (pure).
pub fn next_location_status(
    old: &BackupStorageLocationStatus,
    outcome: &ProbeOutcome,
    generation: Option<i64>,
    now: Time,
) -> BackupStorageLocationStatus {
    let mut status = old.clone();
    let (phase, state, why, message) = match outcome {
        ProbeOutcome::Succeeded {
            latency_milliseconds,
        } => {
            status.last_probe_latency_milliseconds = Some(*latency_milliseconds);
            (
                BackupStorageLocationPhase::Available,
                ConditionStatus::True,
                reason::PROBE_SUCCEEDED,
                "write, read, list and delete of a probe object succeeded".to_string(),
            )
        }
        ProbeOutcome::CredentialsNotFound(message) => (
            BackupStorageLocationPhase::Unavailable,
            ConditionStatus::False,
            reason::CREDENTIALS_NOT_FOUND,
            message.clone(),
        ),
        ProbeOutcome::Failed(message) => (
            BackupStorageLocationPhase::Unavailable,
            ConditionStatus::False,
            reason::PROBE_FAILED,
            message.clone(),
        ),
    };
    status.phase = Some(phase);
    status.last_validation_time = Some(now.clone());
    status.message = Some(crate::api::condition::bounded_message(&message));
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

/// S3 settings of a location with the given credentials.
pub fn s3_options(spec: &BackupStorageLocationSpec, credentials: S3Credentials) -> StoreOptions {
    StoreOptions {
        s3: S3Options {
            endpoint: spec.endpoint.clone(),
            region: spec.region.clone(),
            path_style: spec.s3_force_path_style,
            credentials: Some(credentials),
            ..S3Options::default()
        },
        ..StoreOptions::default()
    }
}

/// Read the AWS credentials file the location's Secret holds.
pub async fn read_credentials(
    secrets: &Api<Secret>,
    spec: &BackupStorageLocationSpec,
) -> Result<Result<(Secret, S3Credentials), String>, Error> {
    let name = &spec.credential.name;
    let secret = match secrets.get_opt(name).await {
        Ok(Some(secret)) => secret,
        Ok(None) => return Ok(Err(format!("Secret {name} does not exist"))),
        Err(source) => return Err(kube_error("get", "Secret", name.clone())(source)),
    };
    let Some(bytes) = secret
        .data
        .as_ref()
        .and_then(|data| data.get(&spec.credential.key))
    else {
        return Ok(Err(format!(
            "Secret {name} has no key {}",
            spec.credential.key
        )));
    };
    let text = String::from_utf8_lossy(&bytes.0);
    match S3Credentials::parse_credentials_file(&text, "default") {
        Ok(credentials) => Ok(Ok((secret, credentials))),
        Err(problem) => Ok(Err(format!(
            "Secret {name} key {}: {problem}",
            spec.credential.key
        ))),
    }
}

/// Probe a location and write its status.
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
    let interval = match location.spec.validation_interval() {
        Ok(Some(interval)) => interval,
        Ok(None) => {
            return Ok(Action::requeue(Duration::from_secs(
                UNVALIDATED_RECHECK_SECONDS,
            )));
        }
        Err(_) => Duration::from_secs(60),
    };
    // A status write (ours or another replica's) wakes this reconciler too;
    // a location validated at its current generation within the interval is
    // not probed again until the interval is up.
    if let Some(remaining) = time_until_next_probe(&location, interval, now()) {
        return Ok(Action::requeue(remaining));
    }
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), &namespace);
    let outcome = match read_credentials(&secrets, &location.spec).await? {
        Err(message) => ProbeOutcome::CredentialsNotFound(message),
        Ok((_, credentials)) => {
            let options = s3_options(&location.spec, credentials);
            let url = crate::controller::children::repository_url(&location.spec);
            let started = std::time::Instant::now();
            match open_store(&url, &options).await {
                Err(error) => ProbeOutcome::Failed(error.to_string()),
                Ok(store) => match tokio::time::timeout(
                    Duration::from_secs(PROBE_TIMEOUT_SECONDS),
                    check_location(store.as_ref()),
                )
                .await
                {
                    Err(_) => ProbeOutcome::Failed(format!(
                        "probe did not finish within {PROBE_TIMEOUT_SECONDS}s"
                    )),
                    Ok(report) => match report.first_failure() {
                        None if report.is_ok() => ProbeOutcome::Succeeded {
                            latency_milliseconds: i64::try_from(started.elapsed().as_millis())
                                .unwrap_or(i64::MAX),
                        },
                        None => ProbeOutcome::Failed("probe did not run every step".to_string()),
                        Some((step, failure)) => {
                            ProbeOutcome::Failed(format!("{step:?} failed: {}", failure.message))
                        }
                    },
                },
            }
        }
    };
    let old = location.status.clone().unwrap_or_default();
    let status = next_location_status(&old, &outcome, location.metadata.generation, now());
    info!(phase = ?status.phase, "storage location probed");
    let api: Api<BackupStorageLocation> = Api::namespaced(context.client.clone(), &namespace);
    let patch = serde_json::json!({
        "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        "kind": "BackupStorageLocation",
        "status": status,
    });
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
    Ok(Action::requeue(interval))
}

/// How long until `location` is due for a probe, or `None` when it is due
/// now (never validated, spec changed since, or the interval has passed).
fn time_until_next_probe(
    location: &BackupStorageLocation,
    interval: Duration,
    now: Time,
) -> Option<Duration> {
    let status = location.status.as_ref()?;
    if status.observed_generation != location.metadata.generation {
        return None;
    }
    let last = status.last_validation_time.as_ref()?;
    let elapsed = now.0.duration_since(last.0);
    let elapsed = Duration::try_from(elapsed).unwrap_or(Duration::ZERO);
    interval
        .checked_sub(elapsed)
        .filter(|remaining| !remaining.is_zero())
}

/// The current time as an API timestamp.
pub(crate) fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::condition::find_condition;

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + seconds).expect("valid"))
    }

    #[test]
    fn a_location_validated_recently_at_its_generation_is_not_probed_again_on_a_status_event() {
        let interval = Duration::from_secs(60);
        let mut location = BackupStorageLocation::test("minio");
        assert_eq!(
            time_until_next_probe(&location, interval, at(0)),
            None,
            "never validated"
        );
        location.status = Some(BackupStorageLocationStatus {
            last_validation_time: Some(at(0)),
            observed_generation: location.metadata.generation,
            ..Default::default()
        });
        assert_eq!(
            time_until_next_probe(&location, interval, at(20)),
            Some(Duration::from_secs(40))
        );
        assert_eq!(
            time_until_next_probe(&location, interval, at(60)),
            None,
            "interval passed"
        );
        location.metadata.generation = Some(2);
        assert_eq!(
            time_until_next_probe(&location, interval, at(20)),
            None,
            "spec changed"
        );
    }

    #[test]
    fn a_successful_probe_makes_the_location_available() {
        let status = next_location_status(
            &BackupStorageLocationStatus::default(),
            &ProbeOutcome::Succeeded {
                latency_milliseconds: 12,
            },
            Some(3),
            at(0),
        );
        assert_eq!(status.phase, Some(BackupStorageLocationPhase::Available));
        assert_eq!(status.last_probe_latency_milliseconds, Some(12));
        assert_eq!(status.observed_generation, Some(3));
    }

    #[test]
    fn missing_credentials_make_it_unavailable_and_keep_the_transition_time_while_they_stay_missing()
     {
        let outcome = ProbeOutcome::CredentialsNotFound("Secret s3 does not exist".to_string());
        let first = next_location_status(
            &BackupStorageLocationStatus::default(),
            &outcome,
            None,
            at(0),
        );
        let second = next_location_status(&first, &outcome, None, at(60));
        assert_eq!(second.phase, Some(BackupStorageLocationPhase::Unavailable));
        let condition = find_condition(&second.conditions, condition_type::AVAILABLE).expect("set");
        assert_eq!(condition.reason, reason::CREDENTIALS_NOT_FOUND);
        assert_eq!(condition.last_transition_time, at(0));
        assert_eq!(second.last_validation_time, Some(at(60)));
    }
}
