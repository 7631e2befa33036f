//! Outages of a storage location, waited out instead of failed.
//!
//! A [`super::retry::RetryStore`] given an [`OutageWait`] does not fail an
//! operation whose retry budget is spent on transient errors (connection
//! refused, timeouts, 5xx, throttling): it records an outage in the shared
//! [`Outage`] and waits. While the outage lasts, no operation of the store
//! sends a request of its own: one of the waiting operations at a time
//! probes the location with a single `HEAD` of [`PROBE_KEY`] every
//! [`OutageWait::probe_every`] (jittered), so an agent sends about one
//! request per probe interval however many uploads and reads it had in
//! flight, not a retry storm. Any answer that is not transient (the object,
//! or `NotFound`: the server answered) ends the outage, and every waiting
//! operation starts again with its full retry budget. With
//! [`OutageWait::give_up_after`], an outage that lasts longer fails each
//! waiting operation with an error saying so; without it, operations wait
//! as long as it takes.
//!
//! The state is shared by everything that uses the store (one agent's
//! volumes), so the agent can report the outage (its progress reports'
//! `StorageAvailable` condition, its metrics) and all waiting operations
//! give up at the same time. It also counts the failed attempts the retry
//! budget absorbed short of an outage ([`Outage::retries`]): a location
//! that throttles a share of the requests (503 SlowDown) slows the volumes
//! without stopping them, and the reports say so.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{FailureCause, StoreError};

/// The key the probe reads: a repository's config, which exists in every
/// repository (a `NotFound` answer ends the outage as well).
pub const PROBE_KEY: &str = "config";
/// Default time between two probes of a location in an outage.
pub const DEFAULT_PROBE_SECONDS: u64 = 5;

/// How a store waits out outages: the shared state, and the limits.
#[derive(Debug, Clone)]
pub struct OutageWait {
    /// Where the outage is recorded (shared with whoever reports it).
    pub outage: Outage,
    /// Fail the waiting operations once an outage lasts this long; wait as
    /// long as it takes when `None`.
    pub give_up_after: Option<Duration>,
    /// Upper bound of the time between two probes; each waits a random
    /// time between half of it and all of it.
    pub probe_every: Duration,
    /// Once cancelled (the process stops: SIGTERM), nothing waits for the
    /// location any more: a waiting operation fails at once, and a retry
    /// within the budget does not sleep again. What is stored stays; the
    /// work resumes when the process runs again.
    pub stop: CancellationToken,
}

impl OutageWait {
    /// Wait out outages into `outage`, giving up after `give_up_after`,
    /// probing every [`DEFAULT_PROBE_SECONDS`].
    pub fn new(outage: Outage, give_up_after: Option<Duration>) -> Self {
        OutageWait {
            outage,
            give_up_after,
            probe_every: Duration::from_secs(DEFAULT_PROBE_SECONDS),
            stop: CancellationToken::new(),
        }
    }

    /// The same, no longer waiting once `stop` is cancelled.
    pub fn stopping_with(mut self, stop: CancellationToken) -> Self {
        self.stop = stop;
        self
    }
}

/// The outage going on now.
#[derive(Debug, Clone)]
struct Current {
    /// When it began (wall clock, for reports).
    since: SystemTime,
    /// When it began (for the limit).
    started: Instant,
    /// The latest transient error, as a message.
    error: String,
    /// The cause of the latest error.
    cause: FailureCause,
    /// Where the store points.
    location: String,
}

/// What an outage of cause `so_far` is about once an error of cause
/// `latest` comes: a want of this process's descriptors only while every
/// error of it has been one, so that a wait said to be for a descriptor
/// ("for Ns") was that all along; once the location itself failed, the
/// outage is the location's to its end, counted from its start (which may
/// include a wait for descriptors first: said as the location's, the
/// cautious reading).
fn outage_cause(so_far: FailureCause, latest: FailureCause) -> FailureCause {
    if latest == FailureCause::OutOfDescriptors && so_far != FailureCause::OutOfDescriptors {
        so_far
    } else {
        latest
    }
}

/// How a wait is said, by what it waits for: the location to answer, or
/// (for a want of this process's descriptors, which is not the location's
/// doing) a descriptor.
struct WaitWords {
    /// Logged when the wait begins.
    begins: &'static str,
    /// Logged when it ends.
    ends: &'static str,
    /// In an error, after "while" or before "for Ns".
    lasting: &'static str,
}

/// [`WaitWords`] of an outage of `cause`.
fn wait_words(cause: FailureCause) -> WaitWords {
    if cause == FailureCause::OutOfDescriptors {
        WaitWords {
            begins: "this process has no file descriptor free to reach the storage location: waiting, probing; work resumes by itself once one is free",
            ends: "a file descriptor is free again and the storage location answers: work resumes",
            lasting: "this process has had no file descriptor free to reach it",
        }
    } else {
        WaitWords {
            begins: "the storage location does not answer: waiting for it, probing; work resumes by itself when it answers",
            ends: "the storage location answers again: work resumes",
            lasting: "it has not answered",
        }
    }
}

/// What the outage state tells a reporter.
#[derive(Debug, Clone, PartialEq)]
pub struct OutageReport {
    /// When the outage began.
    pub since: SystemTime,
    /// How long it has lasted.
    pub lasted: Duration,
    /// The latest error, as a message.
    pub error: String,
    /// What the outage is about: the latest error's cause, except that a
    /// want of descriptors after the location itself failed leaves it the
    /// location's ([`outage_cause`]).
    pub cause: FailureCause,
}

/// An outage that ended.
#[derive(Debug, Clone, PartialEq)]
pub struct EndedOutage {
    /// When it began.
    pub since: SystemTime,
    /// How long it lasted.
    pub lasted: Duration,
    /// What it was about at its end ([`OutageReport::cause`]).
    pub cause: FailureCause,
}

/// Failed attempts that were retried within the budget, by what they
/// were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retries {
    /// Throttled by the server (503 SlowDown, 429).
    pub throttled: u64,
    /// Any other transient failure (a cut connection, a timeout, a 500).
    pub other: u64,
    /// When the first of them failed.
    pub since: Option<SystemTime>,
}

impl Retries {
    /// Retried attempts in all.
    pub fn total(&self) -> u64 {
        self.throttled + self.other
    }
}

/// Totals kept across outages.
#[derive(Debug, Default)]
struct Totals {
    outages: u64,
    ended: Duration,
    last_ended: Option<EndedOutage>,
    gave_up: bool,
    retries: Retries,
}

/// The outage state of one store, shared by its users: whether the
/// location is unavailable now, since when and why, and what it was so
/// far. Cheap to clone (all clones share the state).
#[derive(Debug, Clone)]
pub struct Outage {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    current: watch::Sender<Option<Current>>,
    /// Held by the one waiting operation that probes.
    probe: tokio::sync::Mutex<()>,
    totals: Mutex<Totals>,
}

impl Default for Outage {
    fn default() -> Self {
        Outage {
            inner: Arc::new(Inner {
                current: watch::Sender::new(None),
                probe: tokio::sync::Mutex::new(()),
                totals: Mutex::new(Totals::default()),
            }),
        }
    }
}

impl Outage {
    /// The outage going on now, if any.
    pub fn current(&self) -> Option<OutageReport> {
        self.inner
            .current
            .borrow()
            .as_ref()
            .map(|current| OutageReport {
                since: current.since,
                lasted: current.started.elapsed(),
                error: current.error.clone(),
                cause: current.cause,
            })
    }

    /// Outages begun so far.
    pub fn outages(&self) -> u64 {
        self.totals().outages
    }

    /// Time spent in outages so far, the current one included.
    pub fn unavailable(&self) -> Duration {
        let ended = self.totals().ended;
        ended
            + self
                .current()
                .map(|current| current.lasted)
                .unwrap_or_default()
    }

    /// The latest outage that ended, if any.
    pub fn last_ended(&self) -> Option<EndedOutage> {
        self.totals().last_ended.clone()
    }

    /// Whether an operation gave up because an outage lasted longer than
    /// its limit.
    pub fn gave_up(&self) -> bool {
        self.totals().gave_up
    }

    /// The failed attempts retried within the budget so far.
    pub fn retries(&self) -> Retries {
        self.totals().retries
    }

    /// Record the failed attempts an operation retried before it
    /// succeeded within its budget: `throttled` throttled ones, `other`
    /// other transient failures.
    pub(crate) fn note_retries(&self, throttled: u64, other: u64) {
        let retries = &mut self.totals().retries;
        retries.since.get_or_insert_with(SystemTime::now);
        retries.throttled += throttled;
        retries.other += other;
    }

    fn totals(&self) -> std::sync::MutexGuard<'_, Totals> {
        self.inner
            .totals
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether an outage is going on.
    pub fn is_on(&self) -> bool {
        self.inner.current.borrow().is_some()
    }

    /// Record `error` (a transient error after a spent retry budget): an
    /// outage begins unless one is going on, which then holds the latest
    /// error.
    pub(crate) fn note(&self, error: &StoreError) {
        let (location, cause) = match error {
            StoreError::Transient {
                location, cause, ..
            } => (location.clone(), *cause),
            other => (String::new(), other.cause()),
        };
        let message = error.to_string();
        let mut began = false;
        self.inner.current.send_modify(|current| match current {
            Some(current) => {
                let kept = outage_cause(current.cause, cause);
                // The latest error said is one of the outage's own kind:
                // a want of descriptors amid a location's outage does not
                // put its remedy under the location's reason.
                if kept == cause {
                    current.error = message.clone();
                }
                if kept != current.cause && current.cause == FailureCause::OutOfDescriptors {
                    tracing::warn!(
                        error = %message,
                        "after a wait for a file descriptor, {}",
                        wait_words(kept).begins
                    );
                }
                current.cause = kept;
            }
            None => {
                began = true;
                *current = Some(Current {
                    since: SystemTime::now(),
                    started: Instant::now(),
                    error: message.clone(),
                    cause,
                    location,
                });
            }
        });
        if began {
            self.totals().outages += 1;
            tracing::warn!(error = %message, "{}", wait_words(cause).begins);
        }
    }

    /// End the outage going on (a probe was answered).
    fn end(&self) {
        let mut ended = None;
        self.inner.current.send_modify(|current| {
            if let Some(current) = current.take() {
                ended = Some(EndedOutage {
                    since: current.since,
                    lasted: current.started.elapsed(),
                    cause: current.cause,
                });
            }
        });
        if let Some(ended) = ended {
            tracing::info!(
                seconds = ended.lasted.as_secs_f64(),
                "{}",
                wait_words(ended.cause).ends
            );
            let mut totals = self.totals();
            totals.ended += ended.lasted;
            totals.last_ended = Some(ended);
        }
    }

    /// Wait until no outage is going on; one waiting caller at a time
    /// probes with `probe` (after a jittered pause). `Err` when the
    /// outage lasted longer than `wait.give_up_after`: the error says so,
    /// with the latest error.
    pub(crate) async fn wait_out<F, Fut, T>(
        &self,
        wait: &OutageWait,
        mut probe: F,
    ) -> Result<(), StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let mut changes = self.inner.current.subscribe();
        loop {
            let Some(current) = changes.borrow_and_update().clone() else {
                return Ok(());
            };
            if wait.stop.is_cancelled() {
                return Err(stopped(&current));
            }
            let left = match wait.give_up_after {
                Some(limit) => {
                    let lasted = current.started.elapsed();
                    if lasted >= limit {
                        return Err(self.give_up(&current, limit));
                    }
                    Some(limit - lasted)
                }
                None => None,
            };
            let deadline = async {
                match left {
                    Some(left) => tokio::time::sleep(left).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // Ended or changed by another operation's probe.
                _ = changes.changed() => {}
                () = deadline => {}
                () = wait.stop.cancelled() => {}
                _guard = self.inner.probe.lock() => {
                    if !self.is_on() {
                        continue;
                    }
                    let pause = wait.probe_every.mul_f64(0.5 + rand::random::<f64>() / 2.0);
                    let pause = left.map_or(pause, |left| pause.min(left));
                    let probed = async {
                        tokio::time::sleep(pause).await;
                        probe().await
                    };
                    tokio::select! {
                        answer = probed => match answer {
                            Err(error) if error.is_transient() => self.note(&error),
                            // Any other answer: the location answers.
                            _ => self.end(),
                        },
                        () = wait.stop.cancelled() => {}
                    }
                }
            }
        }
    }

    fn give_up(&self, current: &Current, limit: Duration) -> StoreError {
        self.totals().gave_up = true;
        StoreError::Transient {
            location: current.location.clone(),
            operation: "reach",
            key: "the storage location".to_string(),
            message: format!(
                "{} for {}s, longer than failAfterUnavailableSeconds ({}); latest error: {}",
                wait_words(current.cause).lasting,
                current.started.elapsed().as_secs(),
                limit.as_secs(),
                current.error
            ),
            cause: current.cause,
        }
    }
}

/// The error of an operation that stops waiting for the location because
/// the process stops.
fn stopped(current: &Current) -> StoreError {
    StoreError::Transient {
        location: current.location.clone(),
        operation: "reach",
        key: "the storage location".to_string(),
        message: format!(
            "stopping while {} for {}s (latest error: {}); what is stored stays and the work resumes when it runs again",
            wait_words(current.cause).lasting,
            current.started.elapsed().as_secs(),
            current.error
        ),
        cause: current.cause,
    }
}
