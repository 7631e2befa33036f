//! The BackupStorageLocation reconciler: observe → decide → apply. It
//! reads the location and its siblings from the cache, asks
//! [`decide_probe`] whether a probe is due, runs the probe when it is (the
//! only I/O: it reads the credentials Secret in the controller's
//! namespace, opens the bucket with the location's endpoint, region, path
//! style and CA bundle, runs [`check_location`] — write, read, list,
//! delete of a small object under the prefix — and checks the repository
//! config there, present and of a supported format or created when
//! `spec.initialize` allows it), and writes what [`decide_status`]
//! returns. The whole probe runs under [`PROBE_TIMEOUT_SECONDS`], so a hung
//! endpoint holds one reconcile slot for at most that long.
//!
//! A probe's failure is classified into one reason of a fixed set
//! ([`problem_of`], from the store's [`FailureCause`], never by reading
//! messages); the message is cleaned of the credentials' secret values and
//! of signed URL query strings, and bounded to 1 KiB
//! ([`crate::reconcile::location::sanitize_message`]).
//!
//! At most one probe per location is in flight: kube-runtime's `Controller`
//! never runs two reconciles of one object at once. Every replica runs this
//! reconciler, but a probe is skipped while the status (shared through the
//! API server) shows a validation at the current generation younger than
//! the interval, so replicas mostly take turns; when two do probe at the
//! same moment, both write the same kind of status with server-side apply
//! under one field manager, and the later write wins. Probe objects have
//! random names and repository initialisation is create-only, so
//! concurrent probes are harmless.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use tracing::instrument;

use crate::api::BackupStorageLocation;
use crate::api::location::BackupStorageLocationSpec;
use crate::clock;
use crate::controller::error::{ApiCall, Error, kube_error};
use crate::controller::execute::emit;
use crate::controller::{Context, FIELD_MANAGER, requeue};
use crate::engine::{Encryption, EngineError, KeySource, Password, Repository};
use crate::reconcile::location::{
    LocationObservation, LocationsSummary, ProbeOutcome, ProbeProblem, ProbeStep, Validation,
    choose_default, decide_probe, decide_status, sanitize_message, summarize_locations,
};
use crate::reconcile::stage_pod::repository_url;
use crate::repo::CONFIG_KEY;
use crate::repo::config::{ConfigError, RepoConfig};
use crate::repo::keyfile::KdfParameters;
use crate::store::probe::check_location;
use crate::store::retry::RetryPolicy;
use crate::store::{
    DynStore, FailureCause, OpenStoreError, S3Credentials, S3Options, StoreOptions, open_store,
};

/// Time a whole probe (credentials aside) may take: an unreachable or
/// silent endpoint must not hold a reconcile slot longer.
pub const PROBE_TIMEOUT_SECONDS: u64 = 30;
/// Attempts per store request in a probe. A probe reports what it sees; the
/// next probe is the real retry. Two attempts ride over one dropped
/// connection.
const PROBE_REQUEST_ATTEMPTS: u32 = 2;

/// The probe problem a store failure of this cause is.
pub fn problem_of(cause: FailureCause) -> ProbeProblem {
    match cause {
        FailureCause::Unreachable => ProbeProblem::EndpointUnreachable,
        FailureCause::Tls => ProbeProblem::Tls,
        FailureCause::CredentialsMissing => ProbeProblem::CredentialsMissing,
        FailureCause::AccessDenied => ProbeProblem::AccessDenied,
        FailureCause::BucketNotFound => ProbeProblem::BucketNotFound,
        FailureCause::WrongRegion => ProbeProblem::RegionMismatch,
        FailureCause::ClockSkew => ProbeProblem::ClockSkew,
        FailureCause::ServerError | FailureCause::Throttled => ProbeProblem::ServerError,
        FailureCause::Other | FailureCause::OutOfDescriptors => ProbeProblem::Other,
    }
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
        Err(source) => return Err(kube_error(ApiCall::ReadCredentials, name.clone())(source)),
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

/// The repository password of a location with `spec.encryption`, from
/// its Secret (the first line of the value, as `--password-file` reads a
/// file); `None` without `spec.encryption`. The inner `Err` says, for a
/// person, what is missing.
pub async fn read_password(
    secrets: &Api<Secret>,
    spec: &BackupStorageLocationSpec,
) -> Result<Result<Option<Password>, String>, Error> {
    let Some(encryption) = &spec.encryption else {
        return Ok(Ok(None));
    };
    let reference = &encryption.password_secret_ref;
    let name = &reference.name;
    let secret = match secrets.get_opt(name).await {
        Ok(Some(secret)) => secret,
        Ok(None) => {
            return Ok(Err(format!(
                "Secret {name} (spec.encryption.passwordSecretRef) does not exist: create it in this namespace with the repository's password under key {}",
                reference.key
            )));
        }
        Err(source) => return Err(kube_error(ApiCall::ReadCredentials, name.clone())(source)),
    };
    let value = secret
        .data
        .as_ref()
        .and_then(|data| data.get(&reference.key))
        .map(|bytes| String::from_utf8_lossy(&bytes.0).into_owned());
    Ok(
        match value
            .as_deref()
            .map(crate::cli::password::first_line_password)
        {
            Some(Some(password)) => Ok(Some(password)),
            Some(None) | None => Err(format!(
                "Secret {name} has no non-empty key {} (spec.encryption.passwordSecretRef): put the repository's password there",
                reference.key
            )),
        },
    )
}

/// [`read_password`] of `location`, from its namespace's Secrets.
pub async fn password_of(
    location: &BackupStorageLocation,
    client: &kube::Client,
) -> Result<Result<Option<Password>, String>, Error> {
    let secrets: Api<Secret> =
        Api::namespaced(client.clone(), &location.namespace().unwrap_or_default());
    read_password(&secrets, &location.spec).await
}

/// A location's repository opened by the controller, with the secret
/// values (credentials, password) no message about it may carry.
pub struct OpenedRepository {
    /// The repository.
    pub repository: Repository,
    /// Its URL (`s3://bucket/prefix`), for messages.
    pub url: String,
    /// Values to redact from any message.
    pub secrets: Vec<String>,
}

/// Open `location`'s repository with its credentials and password, as the
/// forget of a deleted backup, the snapshot listing of a restore and the
/// scheduled maintenance do. The inner `Err` says, for a person, what is
/// missing or why the repository cannot be opened, without credentials.
/// Bounded by the store's own timeouts and retries; callers bound the
/// whole of their work.
pub async fn open_repository(
    location: &BackupStorageLocation,
    client: &kube::Client,
) -> Result<Result<OpenedRepository, String>, Error> {
    let secrets: Api<Secret> =
        Api::namespaced(client.clone(), &location.namespace().unwrap_or_default());
    let credentials = match read_credentials(&secrets, &location.spec).await? {
        Ok((_, credentials)) => credentials,
        Err(message) => return Ok(Err(message)),
    };
    let password = match read_password(&secrets, &location.spec).await? {
        Ok(password) => password,
        Err(message) => return Ok(Err(message)),
    };
    let mut values = vec![credentials.secret_access_key.clone()];
    values.extend(credentials.session_token.clone());
    values.extend(
        password
            .as_ref()
            .map(|password| String::from_utf8_lossy(password.as_bytes()).into_owned()),
    );
    let key = key_source(password);
    let url = repository_url(&location.spec);
    let opened = async {
        let store = open_store(&url, &s3_options(&location.spec, credentials))
            .await
            .map_err(|error| crate::error_chain(&error))?;
        Repository::open(store, &key)
            .await
            .map_err(|error| crate::error_chain(&error))
    }
    .await;
    let redacted: Vec<&str> = values.iter().map(String::as_str).collect();
    Ok(match opened {
        Ok(repository) => Ok(OpenedRepository {
            repository,
            url,
            secrets: values,
        }),
        Err(problem) => Err(sanitize_message(
            &format!("cannot open the repository at {url}: {problem}"),
            &redacted,
        )),
    })
}

/// How the controller and the agents open a location's repository: with
/// its password, or plaintext only.
pub fn key_source(password: Option<Password>) -> KeySource {
    match password {
        Some(password) => KeySource::Password(Arc::new(password)),
        None => KeySource::PlaintextOnly,
    }
}

/// Probe a location with `credentials` (and `password`, for a location
/// with `spec.encryption`): the object round trip, then the repository
/// check, all within `timeout`. Never fails itself: every failure is an
/// outcome.
pub async fn probe_location(
    spec: &BackupStorageLocationSpec,
    credentials: S3Credentials,
    password: Option<Password>,
    timeout: Duration,
) -> ProbeOutcome {
    let mut options = s3_options(spec, credentials);
    options.retry = Some(RetryPolicy {
        max_attempts: PROBE_REQUEST_ATTEMPTS,
        ..RetryPolicy::default()
    });
    let url = repository_url(spec);
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
                problem_of(failure.cause),
                format!("probe {step:?} failed: {}", failure.message),
            );
        }
        if !report.is_ok() {
            return ProbeOutcome::failed(ProbeProblem::Other, "the probe did not run every step");
        }
        let initialized = match check_repository(store.clone(), spec, password).await {
            Ok(initialized) => initialized,
            Err(outcome) => return outcome,
        };
        match crate::engine::repository::index_file_bytes(store.as_ref()).await {
            Ok(index_bytes) => ProbeOutcome::Succeeded {
                latency_milliseconds,
                initialized,
                index_bytes,
            },
            Err(error) => ProbeOutcome::failed(
                problem_of(error.cause()),
                format!("cannot list the repository's index files: {error}"),
            ),
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

/// Check that the store holds a repository of a supported format that
/// opens with the location's key (`password`, for `spec.encryption`), or
/// create one when `spec.initialize` (encrypted with `password` when
/// given). `Ok(true)` when this call created it. Creation is create-only:
/// when another replica (or a user) created one first, that one is
/// checked instead.
pub async fn check_repository(
    store: DynStore,
    spec: &BackupStorageLocationSpec,
    password: Option<Password>,
) -> Result<bool, ProbeOutcome> {
    let location = store.location();
    let config = match store.get(CONFIG_KEY, None).await {
        Ok(bytes) => bytes,
        Err(error) if error.is_not_found() && spec.initialize => {
            let encryption = match &password {
                Some(password) => Encryption::Password {
                    password: password.clone(),
                    kdf: KdfParameters::default(),
                },
                None => Encryption::None,
            };
            return match Repository::init(store.clone(), encryption).await {
                Ok(_) => Ok(true),
                Err(EngineError::AlreadyInitialized { .. }) => {
                    let existing = BackupStorageLocationSpec {
                        initialize: false,
                        ..spec.clone()
                    };
                    Box::pin(check_repository(store, &existing, password)).await
                }
                Err(error) => Err(repository_failure(
                    &format!("cannot create the repository at {location}"),
                    ProbeProblem::Other,
                    error,
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
                problem_of(error.cause()),
                format!("cannot read the repository config: {error}"),
            ));
        }
    };
    match RepoConfig::from_json(&config) {
        Ok(config) => open_with_key(store, spec, password, config.is_encrypted()).await,
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
/// Open the repository with the location's key: a wrong password, or an
/// encrypted repository without `spec.encryption`, is a probe failure
/// naming what to fix.
async fn open_with_key(
    store: DynStore,
    spec: &BackupStorageLocationSpec,
    password: Option<Password>,
    encrypted: bool,
) -> Result<bool, ProbeOutcome> {
    let location = store.location();
    if !encrypted && password.is_none() {
        return Ok(false);
    }
    let secret = spec
        .encryption
        .as_ref()
        .map(|encryption| {
            format!(
                "Secret {} key {}",
                encryption.password_secret_ref.name, encryption.password_secret_ref.key
            )
        })
        .unwrap_or_default();
    match Repository::open(store, &key_source(password)).await {
        Ok(_) if !encrypted => Err(ProbeOutcome::failed(
            ProbeProblem::InvalidSpec,
            format!(
                "the repository at {location} is not encrypted, but spec.encryption names a password ({secret}): remove spec.encryption, or point the location at another prefix"
            ),
        )),
        Ok(_) => Ok(false),
        Err(EngineError::WrongPassword { tried, .. }) => Err(ProbeOutcome::failed(
            ProbeProblem::WrongPassword,
            format!(
                "the password in {secret} (spec.encryption.passwordSecretRef) opens none of the {tried} keys of the repository at {location}: put the repository's password there"
            ),
        )),
        Err(EngineError::Encrypted { .. }) => Err(ProbeOutcome::failed(
            ProbeProblem::RepositoryEncrypted,
            format!(
                "the repository at {location} is encrypted and the location has no spec.encryption: set spec.encryption.passwordSecretRef to a Secret holding its password"
            ),
        )),
        Err(error) => Err(repository_failure(
            &format!("cannot open the repository at {location}"),
            ProbeProblem::RepositoryIncompatible,
            error,
        )),
    }
}

/// The probe's outcome when `what` (creating or opening the repository)
/// failed with `error`: the store's own problem when the store failed,
/// else `otherwise`.
fn repository_failure(what: &str, otherwise: ProbeProblem, error: EngineError) -> ProbeOutcome {
    match error {
        EngineError::Store { source, .. } => {
            ProbeOutcome::failed(problem_of(source.cause()), format!("{what}: {source}"))
        }
        error => ProbeOutcome::failed(otherwise, format!("{what}: {error}")),
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
    let namespace = location.namespace().ok_or(Error::MissingField {
        kind: "BackupStorageLocation",
        field: "metadata.namespace",
    })?;
    let locations = context.stores.locations.state();
    let observation = LocationObservation {
        location: location.as_ref(),
        siblings: locations
            .iter()
            .filter(|other| other.namespace().as_deref() == Some(namespace.as_str()))
            .map(|other| other.as_ref())
            .collect(),
    };
    let (probed, next) = match decide_probe(&location, &clock::now()) {
        ProbeStep::NotDue { requeue } | ProbeStep::WaitInvalid { requeue } => (None, requeue),
        ProbeStep::Refuse { outcome, requeue } => (Some((outcome, Vec::new(), false)), requeue),
        ProbeStep::Probe { requeue } => {
            let (outcome, secrets) = probe(&location, &namespace, &context).await?;
            (Some((outcome, secrets, true)), requeue)
        }
    };
    let secret_values: Vec<&str> = probed
        .as_ref()
        .map(|(_, secrets, _)| secrets.iter().map(String::as_str).collect())
        .unwrap_or_default();
    let validation = match &probed {
        None => Validation::None,
        Some((outcome, _, true)) => Validation::Probed {
            outcome,
            secrets: &secret_values,
        },
        Some((outcome, _, false)) => Validation::Refused { outcome },
    };
    let decision = decide_status(&observation, validation, clock::now());
    if let Some(event) = &decision.event {
        emit(location.as_ref(), event, &context).await;
    }
    if let Some(status) = &decision.status {
        let patch = crate::api::status_apply::<BackupStorageLocation>(status);
        apply_status(&location, &patch, FIELD_MANAGER, &context).await?;
    }
    Ok(requeue(next))
}

/// Apply `patch` (a status apply of a BackupStorageLocation) to
/// `location`'s status under `manager`, taking over its fields: the
/// probe's fields under the controller's manager, `status.maintenance`
/// under the maintenance runner's.
pub async fn apply_status(
    location: &BackupStorageLocation,
    patch: &serde_json::Value,
    manager: &str,
    context: &Context,
) -> Result<(), Error> {
    let name = location.name_any();
    let namespace = location.namespace().unwrap_or_default();
    let api: Api<BackupStorageLocation> = Api::namespaced(context.client.clone(), &namespace);
    api.patch_status(
        &name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(patch),
    )
    .await
    .map_err(kube_error(
        ApiCall::WriteLocationStatus,
        format!("{namespace}/{name}"),
    ))?;
    Ok(())
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
            let password = match read_password(&secrets, &location.spec).await? {
                Ok(password) => password,
                Err(message) => {
                    return Ok((
                        ProbeOutcome::failed(ProbeProblem::PasswordMissing, message),
                        values,
                    ));
                }
            };
            if let Some(password) = &password {
                values.push(String::from_utf8_lossy(password.as_bytes()).into_owned());
            }
            let outcome = probe_location(
                &location.spec,
                credentials,
                password,
                Duration::from_secs(PROBE_TIMEOUT_SECONDS),
            )
            .await;
            (outcome, values)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::condition::reason;
    use crate::store::local::LocalStore;

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
            (FailureCause::OutOfDescriptors, reason::PROBE_FAILED),
        ];
        for (cause, expected) in causes {
            assert_eq!(problem_of(cause).reason(), expected, "{cause:?}");
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
    fn store_in(dir: &tempfile::TempDir) -> DynStore {
        Arc::new(LocalStore::new(dir.path()))
    }

    #[tokio::test]
    async fn a_prefix_without_a_repository_is_not_initialized_unless_initialize_is_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_in(&dir);
        let spec = |initialize| BackupStorageLocationSpec {
            initialize,
            ..BackupStorageLocation::test("probe").spec
        };
        match check_repository(store.clone(), &spec(false), None).await {
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
        assert_eq!(
            check_repository(store.clone(), &spec(true), None).await,
            Ok(true)
        );
        // The next probe (or another replica) finds it and creates nothing.
        assert_eq!(
            check_repository(store.clone(), &spec(true), None).await,
            Ok(false)
        );
        Repository::open(store, &crate::engine::KeySource::PlaintextOnly)
            .await
            .expect("a usable repository");
    }

    #[tokio::test]
    async fn an_encrypted_location_creates_an_encrypted_repository_and_a_wrong_password_names_its_secret()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_in(&dir);
        let spec = BackupStorageLocationSpec {
            initialize: true,
            encryption: Some(crate::api::location::LocationEncryption {
                password_secret_ref: crate::api::location::PasswordSecretReference {
                    name: "repo-password".to_string(),
                    key: "password".to_string(),
                },
            }),
            ..BackupStorageLocation::test("probe").spec
        };
        let right = || Some(Password::new("correct horse"));
        assert_eq!(
            check_repository(store.clone(), &spec, right()).await,
            Ok(true)
        );
        assert_eq!(
            check_repository(store.clone(), &spec, right()).await,
            Ok(false)
        );
        Repository::open(store.clone(), &KeySource::password("correct horse"))
            .await
            .expect("opens with the Secret's password");
        match check_repository(store.clone(), &spec, Some(Password::new("wrong"))).await {
            Err(ProbeOutcome::Failed { problem, message }) => {
                assert_eq!(problem, ProbeProblem::WrongPassword);
                assert!(
                    message.contains("Secret repo-password key password"),
                    "{message}"
                );
            }
            other => panic!("expected WrongPassword, got {other:?}"),
        }
        let plaintext_spec = BackupStorageLocationSpec {
            encryption: None,
            ..spec.clone()
        };
        match check_repository(store, &plaintext_spec, None).await {
            Err(ProbeOutcome::Failed { problem, message }) => {
                assert_eq!(problem, ProbeProblem::RepositoryEncrypted);
                assert!(message.contains("spec.encryption"), "{message}");
            }
            other => panic!("expected RepositoryEncrypted, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_repository_of_a_newer_format_is_incompatible() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_in(&dir);
        let mut config = RepoConfig::generate(&mut rand::rng());
        config.format_version = crate::repo::config::FORMAT_VERSION + 1;
        store
            .put(
                CONFIG_KEY,
                config.to_json().into(),
                crate::store::PutMode::Create,
            )
            .await
            .expect("write config");
        let spec = BackupStorageLocationSpec {
            initialize: true,
            ..BackupStorageLocation::test("probe").spec
        };
        match check_repository(store.clone(), &spec, None).await {
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
            check_repository(store, &BackupStorageLocation::test("probe").spec, None).await,
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
            None,
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
            None,
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
        let outcome = probe_location(&spec, credentials(), None, Duration::from_secs(10)).await;
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
