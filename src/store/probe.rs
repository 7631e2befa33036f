//! A real round trip through a storage location: write, read back, list and
//! delete one small object, timing each step.
//!
//! `haulage repo check-location` prints the report, and the BSL controller
//! turns it into the location's `Available`/`Unavailable` phase and message.
//! The probe works on any [`ObjectStore`], so it checks the same wrappers
//! (retries, caps) the engine will use. Its object lives under
//! [`PROBE_PREFIX`] with a random name, so concurrent probes of one location
//! do not collide, and it is deleted even when a middle step fails.

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::{FailureCause, ObjectStore, PutMode, StoreError};

/// Key prefix of probe objects, below the store's root.
pub const PROBE_PREFIX: &str = ".haulage-probe/";
/// Size of the probe object: small, but more than one TCP segment.
pub const PROBE_OBJECT_BYTES: usize = 4096;

/// One step of the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeStepKind {
    /// Upload the probe object.
    Write,
    /// Download it and compare the bytes.
    Read,
    /// List the probe prefix and find it.
    List,
    /// Delete it and see it gone.
    Delete,
}

/// How a failed step failed, in the store's own classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeFailureKind {
    /// May pass if tried again (timeouts, throttling, 5xx, connection errors).
    Transient,
    /// Needs a change by the user (credentials, bucket, endpoint, permissions).
    Permanent,
    /// The store answered, but not with what was written.
    Mismatch,
}

/// The result of one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeStep {
    /// Which step.
    pub step: ProbeStepKind,
    /// Wall-clock time the step took, retries included.
    #[serde(rename = "latencyMs", serialize_with = "serialize_millis")]
    pub latency: Duration,
    /// Why it failed, `None` when it passed.
    pub failure: Option<ProbeFailure>,
}

/// Why a step failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeFailure {
    /// The class of failure.
    pub kind: ProbeFailureKind,
    /// A message without credentials, suitable for a status field.
    pub message: String,
    /// What the store said the failure was about
    /// ([`FailureCause::Other`] for a mismatch).
    #[serde(skip)]
    pub cause: FailureCause,
}

/// What [`check_location`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeReport {
    /// The location probed, as the store names it.
    pub location: String,
    /// The steps that ran, in order. A step after a failed write or read is
    /// not run, except the delete, which always runs to clean up.
    pub steps: Vec<ProbeStep>,
}

impl ProbeReport {
    /// True when every step passed.
    pub fn is_ok(&self) -> bool {
        self.steps.len() == 4 && self.steps.iter().all(|step| step.failure.is_none())
    }

    /// The first failure, for a one-line status message.
    pub fn first_failure(&self) -> Option<(ProbeStepKind, &ProbeFailure)> {
        self.steps
            .iter()
            .find_map(|step| step.failure.as_ref().map(|failure| (step.step, failure)))
    }
}

fn serialize_millis<S: serde::Serializer>(
    duration: &Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(duration.as_secs_f64() * 1000.0)
}

fn failure_of(error: &StoreError) -> ProbeFailure {
    ProbeFailure {
        kind: if error.is_transient() {
            ProbeFailureKind::Transient
        } else {
            ProbeFailureKind::Permanent
        },
        message: error.to_string(),
        cause: error.cause(),
    }
}

fn mismatch(message: String) -> ProbeFailure {
    ProbeFailure {
        kind: ProbeFailureKind::Mismatch,
        message,
        cause: FailureCause::Other,
    }
}

/// Write, read, list and delete one small object in `store`, and report
/// each step's latency and outcome. Never fails itself: a failure is part of
/// the report.
pub async fn check_location(store: &dyn ObjectStore) -> ProbeReport {
    let key = format!("{PROBE_PREFIX}{:016x}", rand::random::<u64>());
    let content: Bytes = (0..PROBE_OBJECT_BYTES)
        .map(|_| rand::random::<u8>())
        .collect::<Vec<u8>>()
        .into();
    let mut steps = Vec::with_capacity(4);

    let started = Instant::now();
    let written = store.put(&key, content.clone(), PutMode::Create).await;
    steps.push(ProbeStep {
        step: ProbeStepKind::Write,
        latency: started.elapsed(),
        failure: written.as_ref().err().map(failure_of),
    });

    if written.is_ok() {
        let started = Instant::now();
        let failure = match store.get(&key, None).await {
            Ok(read) if read == content => None,
            Ok(read) => Some(mismatch(format!(
                "read back {} bytes that differ from the {} written",
                read.len(),
                content.len()
            ))),
            Err(error) => Some(failure_of(&error)),
        };
        let read_ok = failure.is_none();
        steps.push(ProbeStep {
            step: ProbeStepKind::Read,
            latency: started.elapsed(),
            failure,
        });

        if read_ok {
            let started = Instant::now();
            let failure = match store.list(PROBE_PREFIX).await {
                Ok(objects) => match objects.iter().find(|meta| meta.key == key) {
                    Some(meta) if meta.size == content.len() as u64 => None,
                    Some(meta) => Some(mismatch(format!(
                        "the listing shows {} bytes for the {}-byte probe object",
                        meta.size,
                        content.len()
                    ))),
                    None => Some(mismatch(
                        "the listing does not show the probe object".to_string(),
                    )),
                },
                Err(error) => Some(failure_of(&error)),
            };
            steps.push(ProbeStep {
                step: ProbeStepKind::List,
                latency: started.elapsed(),
                failure,
            });
        }
    }

    // Clean up even after a failed read or list; a failed write may still
    // have landed (a lost response).
    let started = Instant::now();
    let failure = match store.delete(&key).await {
        Ok(()) => match store.head(&key).await {
            Err(error) if error.is_not_found() => None,
            Ok(_) => Some(mismatch(
                "the probe object is still there after delete".to_string(),
            )),
            Err(error) => Some(failure_of(&error)),
        },
        Err(error) => Some(failure_of(&error)),
    };
    steps.push(ProbeStep {
        step: ProbeStepKind::Delete,
        latency: started.elapsed(),
        failure,
    });

    ProbeReport {
        location: store.location(),
        steps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::local::LocalStore;

    #[tokio::test]
    async fn a_writable_directory_passes_every_step_and_keeps_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = LocalStore::new(dir.path());
        let report = check_location(&store).await;
        assert!(report.is_ok(), "{report:?}");
        let kinds: Vec<_> = report.steps.iter().map(|step| step.step).collect();
        assert_eq!(
            kinds,
            [
                ProbeStepKind::Write,
                ProbeStepKind::Read,
                ProbeStepKind::List,
                ProbeStepKind::Delete
            ]
        );
        assert!(store.list("").await.expect("list").is_empty());
        let json = serde_json::to_value(&report).expect("serializes");
        assert!(json["steps"][0]["latencyMs"].is_f64(), "{json}");
    }

    #[tokio::test]
    async fn an_unwritable_location_fails_the_write_and_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A regular file where the store's root directory should be.
        let root = dir.path().join("not-a-directory");
        std::fs::write(&root, b"x").expect("write file");
        let store = LocalStore::new(&root);
        let report = check_location(&store).await;
        assert!(!report.is_ok());
        let (step, failure) = report.first_failure().expect("a failure");
        assert_eq!(step, ProbeStepKind::Write);
        assert_eq!(failure.kind, ProbeFailureKind::Permanent);
        assert_eq!(
            report.steps.last().map(|step| step.step),
            Some(ProbeStepKind::Delete)
        );
    }
}
