//! Retries with exponential backoff and full jitter, as a wrapper around any
//! [`ObjectStore`].
//!
//! Only [`StoreError::Transient`] is retried; `NotFound`, `AlreadyExists` and
//! `Permanent` come back at once, so a wrong bucket or bad credentials fail
//! fast instead of turning into a retry storm. The budget is bounded twice:
//! by attempts and by total elapsed time (a backoff that would end past the
//! deadline is not started). A throttled attempt ([`FailureCause::Throttled`]:
//! 503 SlowDown, 429) does not count against the attempts, up to
//! [`THROTTLED_ATTEMPTS_FACTOR`] times them: the server asks the client to
//! slow down, which the growing backoff does, and a store that throttles a
//! share of its requests (as S3 does under load) must not fail a transfer
//! by the luck of a few throttled retries in a row; the elapsed time still
//! bounds it. The S3 backend switches the SDK's own retries
//! off, so this wrapper is the only place requests are repeated and the one
//! place the budget is set: the classification is ours (a `Transient`
//! error from any backend), and attempts do not multiply across two layers.
//!
//! Given an [`OutageWait`] ([`RetryStore::waiting_out_outages`]), a spent
//! budget on transient errors is not a failure but an outage: the operation
//! waits until the location answers again (or the outage outlasts its
//! limit), and while it lasts no operation sends requests of its own
//! ([`super::outage`]). The agents in stage pods wait so; the CLI fails
//! after the budget, as a person at a terminal expects.
//!
//! A retried `put` starts the object over; for S3 that means a fresh
//! multipart upload (the failed one is aborted by the backend). A retried
//! [`PutMode::Create`] whose first attempt did land but whose response was
//! lost reports `AlreadyExists`: callers that create (the repository config)
//! read the object back and compare when they see it.

use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use super::outage::{OutageWait, PROBE_KEY};
use super::{DynStore, FailureCause, ObjectMeta, ObjectStore, PutMode, StoreError, SweepReport};

/// Default number of attempts, the first one included.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 6;
/// How many times the attempts a throttled operation may make, in all.
pub const THROTTLED_ATTEMPTS_FACTOR: u32 = 4;
/// Default backoff before the second attempt; it doubles each time.
pub const DEFAULT_INITIAL_BACKOFF_MILLISECONDS: u64 = 200;
/// Default ceiling of one backoff.
pub const DEFAULT_MAX_BACKOFF_SECONDS: u64 = 10;
/// Default ceiling of the time spent on one operation, retries included.
pub const DEFAULT_MAX_ELAPSED_SECONDS: u64 = 60;

/// How often and for how long transient failures are retried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in total, the first one included; 1 disables retries.
    pub max_attempts: u32,
    /// Upper bound of the first backoff; the bound doubles per retry.
    pub initial_backoff: Duration,
    /// Upper bound of any one backoff.
    pub max_backoff: Duration,
    /// No retry starts whose backoff would end later than this after the
    /// first attempt started.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            initial_backoff: Duration::from_millis(DEFAULT_INITIAL_BACKOFF_MILLISECONDS),
            max_backoff: Duration::from_secs(DEFAULT_MAX_BACKOFF_SECONDS),
            max_elapsed: Duration::from_secs(DEFAULT_MAX_ELAPSED_SECONDS),
        }
    }
}

impl RetryPolicy {
    /// The backoff before retry number `retry` (0 for the first retry):
    /// uniformly random between zero and `initial_backoff * 2^retry`, capped
    /// at `max_backoff` ("full jitter", so clients that failed together do not
    /// come back together).
    pub fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .initial_backoff
            .saturating_mul(2u32.saturating_pow(retry.min(31)))
            .min(self.max_backoff);
        ceiling.mul_f64(rand::random::<f64>())
    }
}

/// An [`ObjectStore`] that retries the transient failures of another.
#[derive(Debug)]
pub struct RetryStore {
    inner: DynStore,
    policy: RetryPolicy,
    outages: Option<OutageWait>,
}

impl RetryStore {
    /// Wrap `inner`, retrying as `policy` allows.
    pub fn new(inner: DynStore, policy: RetryPolicy) -> Self {
        RetryStore {
            inner,
            policy,
            outages: None,
        }
    }

    /// The same store, waiting out outages as `wait` says instead of
    /// failing when the budget is spent.
    pub fn waiting_out_outages(mut self, wait: OutageWait) -> Self {
        self.outages = Some(wait);
        self
    }

    /// Run `attempt` within the budget; with outages waited out, a spent
    /// budget on transient errors waits for the location and starts over.
    async fn run<T, F, Fut>(&self, operation: &'static str, mut attempt: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let Some(wait) = &self.outages else {
            return self.within_budget(operation, &mut attempt).await;
        };
        loop {
            if wait.outage.is_on() {
                wait.outage
                    .wait_out(wait, || self.inner.head(PROBE_KEY))
                    .await?;
            }
            match self.within_budget(operation, &mut attempt).await {
                Err(error) if error.is_transient() => wait.outage.note(&error),
                result => return result,
            }
        }
    }

    async fn within_budget<T, F, Fut>(
        &self,
        operation: &'static str,
        attempt: &mut F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut throttled = 0u32;
        // The attempts retried, counted once the operation succeeds within
        // its budget: those of an operation that gives up are part of the
        // outage that begins (or of the failure), not of the throttling a
        // volume moved through.
        let mut retried = (0u64, 0u64);
        loop {
            attempts += 1;
            let error = match attempt().await {
                Ok(value) => {
                    if let Some(wait) = &self.outages
                        && retried != (0, 0)
                    {
                        wait.outage.note_retries(retried.0, retried.1);
                    }
                    return Ok(value);
                }
                Err(error) if error.is_transient() => error,
                Err(error) => return Err(error),
            };
            if error.cause() == FailureCause::Throttled {
                throttled += 1;
            }
            let delay = self.policy.backoff(attempts - 1);
            let max_attempts = self.policy.max_attempts;
            let out_of_attempts = max_attempts <= 1
                || attempts - throttled >= max_attempts
                || attempts >= max_attempts.saturating_mul(THROTTLED_ATTEMPTS_FACTOR);
            let out_of_time = started.elapsed() + delay > self.policy.max_elapsed;
            if out_of_attempts || out_of_time {
                return Err(give_up(error, attempts, started.elapsed()));
            }
            if error.cause() == FailureCause::Throttled {
                retried.0 += 1;
            } else {
                retried.1 += 1;
            }
            tracing::debug!(
                operation,
                attempt = attempts,
                delay_ms = delay.as_millis() as u64,
                error = %error,
                "transient storage error, retrying"
            );
            match &self.outages {
                // A stopping process does not retry any more.
                Some(wait) => tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = wait.stop.cancelled() => {
                        return Err(give_up(error, attempts, started.elapsed()));
                    }
                },
                None => tokio::time::sleep(delay).await,
            }
        }
    }
}

/// Say in the final error how much was tried, so a user reading it knows
/// the retry budget is spent and not that one request failed.
fn give_up(error: StoreError, attempts: u32, elapsed: Duration) -> StoreError {
    match error {
        StoreError::Transient {
            location,
            operation,
            key,
            message,
            cause,
        } => StoreError::Transient {
            location,
            operation,
            key,
            message: format!(
                "{message} (gave up after {attempts} attempts in {:.1}s)",
                elapsed.as_secs_f64()
            ),
            cause,
        },
        other => other,
    }
}

#[async_trait]
impl ObjectStore for RetryStore {
    async fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<(), StoreError> {
        self.run("put", || self.inner.put(key, data.clone(), mode))
            .await
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes, StoreError> {
        self.run("get", || self.inner.get(key, range.clone())).await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        // The first attempt uses the caller's buffer; a failed attempt
        // consumed it, so a retry starts with a new one.
        let mut buffer = Some(buffer);
        self.run("get", || {
            self.inner
                .get_range_into(key, range.clone(), buffer.take().unwrap_or_default())
        })
        .await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        self.run("head", || self.inner.head(key)).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        self.run("list", || self.inner.list(prefix)).await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.run("delete", || self.inner.delete(key)).await
    }

    fn location(&self) -> String {
        self.inner.location()
    }

    fn is_remote(&self) -> bool {
        self.inner.is_remote()
    }

    async fn sweep_incomplete_uploads(
        &self,
        older_than: Duration,
    ) -> Result<SweepReport, StoreError> {
        self.run("sweep", || self.inner.sweep_incomplete_uploads(older_than))
            .await
    }

    async fn wait_for_cleanup(&self) {
        self.inner.wait_for_cleanup().await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// A store whose every call fails with the error `fail` builds, the first
    /// `failures` times, and then succeeds.
    #[derive(Debug)]
    struct FlakyStore {
        calls: AtomicU32,
        failures: u32,
        transient: bool,
        cause: FailureCause,
    }

    impl FlakyStore {
        fn new(failures: u32, transient: bool) -> Arc<Self> {
            Arc::new(FlakyStore {
                calls: AtomicU32::new(0),
                failures,
                transient,
                cause: FailureCause::Other,
            })
        }

        fn throttling(failures: u32) -> Arc<Self> {
            Arc::new(FlakyStore {
                calls: AtomicU32::new(0),
                failures,
                transient: true,
                cause: FailureCause::Throttled,
            })
        }

        fn calls(&self) -> u32 {
            self.calls.load(Ordering::SeqCst)
        }

        fn step(&self) -> Result<(), StoreError> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            if call >= self.failures {
                return Ok(());
            }
            let (location, operation, key) = ("test://".to_string(), "get", "k".to_string());
            let message = format!("failure {call}");
            Err(if self.transient {
                StoreError::Transient {
                    location,
                    operation,
                    key,
                    message,
                    cause: self.cause,
                }
            } else {
                StoreError::Permanent {
                    location,
                    operation,
                    key,
                    message,
                    cause: crate::store::FailureCause::Other,
                }
            })
        }
    }

    #[async_trait]
    impl ObjectStore for FlakyStore {
        async fn put(&self, _: &str, _: Bytes, _: PutMode) -> Result<(), StoreError> {
            self.step()
        }
        async fn get(&self, _: &str, _: Option<Range<u64>>) -> Result<Bytes, StoreError> {
            self.step().map(|()| Bytes::from_static(b"ok"))
        }
        async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
            self.step().map(|()| ObjectMeta {
                key: key.to_string(),
                size: 2,
            })
        }
        async fn list(&self, _: &str) -> Result<Vec<ObjectMeta>, StoreError> {
            self.step().map(|()| Vec::new())
        }
        async fn delete(&self, _: &str) -> Result<(), StoreError> {
            self.step()
        }
        fn location(&self) -> String {
            "test://".to_string()
        }
    }

    fn policy(max_attempts: u32, max_elapsed_seconds: u64) -> RetryPolicy {
        RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            max_elapsed: Duration::from_secs(max_elapsed_seconds),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn throttled_attempts_do_not_count_against_the_attempts_up_to_four_times_them() {
        // 8 throttled answers in a row (a 20 % share does that now and
        // then over many requests): the ninth attempt succeeds with 6
        // attempts allowed; as many other transient failures fail it.
        let inner = FlakyStore::throttling(8);
        let store = RetryStore::new(inner.clone(), policy(6, 60));
        store.get("k", None).await.expect("throttled, then served");
        assert_eq!(inner.calls(), 9);
        let inner = FlakyStore::new(8, true);
        let store = RetryStore::new(inner.clone(), policy(6, 60));
        store.get("k", None).await.expect_err("out of attempts");
        assert_eq!(inner.calls(), 6);
        // Bounded: at most four times the attempts, and the elapsed time.
        let inner = FlakyStore::throttling(100);
        let store = RetryStore::new(inner.clone(), policy(6, 3600));
        let error = store.get("k", None).await.expect_err("bounded");
        assert_eq!(inner.calls(), 24, "{error}");
        let inner = FlakyStore::throttling(100);
        let store = RetryStore::new(inner.clone(), policy(1, 60));
        store.get("k", None).await.expect_err("1 attempt: no retry");
        assert_eq!(inner.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn retried_attempts_are_counted_by_cause_short_of_an_outage() {
        let outage = crate::store::outage::Outage::default();
        let wait = OutageWait::new(outage.clone(), None);
        let store = RetryStore::new(FlakyStore::throttling(3), policy(6, 60))
            .waiting_out_outages(wait.clone());
        store.get("k", None).await.expect("throttled, then served");
        let store =
            RetryStore::new(FlakyStore::new(2, true), policy(6, 60)).waiting_out_outages(wait);
        store.get("k", None).await.expect("failed, then served");
        assert_eq!(
            outage.retries(),
            crate::store::outage::Retries {
                throttled: 3,
                other: 2,
                since: outage.retries().since,
            }
        );
        assert!(outage.retries().since.is_some());
        assert_eq!(outage.outages(), 0, "the budget absorbed them");

        // The attempts of an operation that gave up are the outage's, not
        // retries a volume moved through: 6 failed attempts, an outage,
        // then served at once.
        let outage = crate::store::outage::Outage::default();
        let wait = OutageWait::new(outage.clone(), None);
        let store =
            RetryStore::new(FlakyStore::new(6, true), policy(6, 60)).waiting_out_outages(wait);
        store.get("k", None).await.expect("served after the outage");
        assert_eq!(outage.outages(), 1);
        assert_eq!(outage.retries().total(), 0, "{:?}", outage.retries());
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_until_success() {
        let inner = FlakyStore::new(3, true);
        let store = RetryStore::new(inner.clone(), policy(6, 60));
        let data = store.get("k", None).await.expect("fourth attempt succeeds");
        assert_eq!(data, Bytes::from_static(b"ok"));
        assert_eq!(inner.calls(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_failures_are_not_retried() {
        let inner = FlakyStore::new(3, false);
        let store = RetryStore::new(inner.clone(), policy(6, 60));
        let error = store.head("k").await.expect_err("permanent error surfaces");
        assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
        assert_eq!(inner.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_are_bounded_and_the_error_says_so() {
        let inner = FlakyStore::new(100, true);
        let store = RetryStore::new(inner.clone(), policy(4, 600));
        let error = store.delete("k").await.expect_err("budget runs out");
        assert!(error.is_transient());
        assert!(
            error.to_string().contains("gave up after 4 attempts"),
            "{error}"
        );
        assert_eq!(inner.calls(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn elapsed_time_is_bounded() {
        let inner = FlakyStore::new(1000, true);
        let store = RetryStore::new(inner.clone(), policy(1000, 5));
        let started = Instant::now();
        let error = store.list("").await.expect_err("time budget runs out");
        assert!(error.is_transient());
        assert!(
            started.elapsed() <= Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(
            inner.calls() > 2,
            "several attempts fit in 5s: {}",
            inner.calls()
        );
    }

    #[test]
    fn backoff_grows_exponentially_and_stays_under_its_cap() {
        let policy = policy(10, 60);
        for retry in 0..20 {
            let ceiling =
                (Duration::from_millis(100) * 2u32.pow(retry.min(20))).min(Duration::from_secs(2));
            for _ in 0..50 {
                assert!(policy.backoff(retry) <= ceiling);
            }
        }
        let late: Duration = (0..200).map(|_| policy.backoff(8)).sum();
        let early: Duration = (0..200).map(|_| policy.backoff(0)).sum();
        assert!(late > early * 4, "late {late:?} early {early:?}");
    }

    /// A store that is down (every call refused, as by a stopped server)
    /// until switched back up; it counts its calls and the probes among
    /// them (`head` of the probe key).
    #[derive(Debug, Default)]
    struct SwitchedStore {
        down: std::sync::atomic::AtomicBool,
        /// While down, fail for want of descriptors rather than refused.
        out_of_descriptors: std::sync::atomic::AtomicBool,
        calls: AtomicU32,
        probes: AtomicU32,
    }

    impl SwitchedStore {
        fn step(&self, key: &str) -> Result<(), StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if key == PROBE_KEY {
                self.probes.fetch_add(1, Ordering::SeqCst);
            }
            if self.down.load(Ordering::SeqCst) {
                let (message, cause) = if self.out_of_descriptors.load(Ordering::SeqCst) {
                    (
                        "Too many open files (os error 24)",
                        FailureCause::OutOfDescriptors,
                    )
                } else {
                    ("connection refused", FailureCause::Unreachable)
                };
                return Err(StoreError::Transient {
                    location: "test://".to_string(),
                    operation: "get",
                    key: key.to_string(),
                    message: message.to_string(),
                    cause,
                });
            }
            Ok(())
        }
    }

    #[async_trait]
    impl ObjectStore for SwitchedStore {
        async fn put(&self, key: &str, _: Bytes, _: PutMode) -> Result<(), StoreError> {
            self.step(key)
        }
        async fn get(&self, key: &str, _: Option<Range<u64>>) -> Result<Bytes, StoreError> {
            self.step(key).map(|()| Bytes::from_static(b"ok"))
        }
        async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
            self.step(key).map(|()| ObjectMeta {
                key: key.to_string(),
                size: 2,
            })
        }
        async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
            self.step(prefix).map(|()| Vec::new())
        }
        async fn delete(&self, key: &str) -> Result<(), StoreError> {
            self.step(key)
        }
        fn location(&self) -> String {
            "test://".to_string()
        }
    }

    fn waiting_out(
        inner: Arc<SwitchedStore>,
        give_up_after: Option<Duration>,
    ) -> (Arc<RetryStore>, crate::store::outage::Outage) {
        let outage = crate::store::outage::Outage::default();
        let mut wait = OutageWait::new(outage.clone(), give_up_after);
        wait.probe_every = Duration::from_secs(5);
        let store = RetryStore::new(inner, policy(3, 60)).waiting_out_outages(wait);
        (Arc::new(store), outage)
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_ends_the_wait_for_the_location_and_the_retries_at_once() {
        let stop = tokio_util::sync::CancellationToken::new();
        let store_of = |inner: Arc<SwitchedStore>| {
            let outage = crate::store::outage::Outage::default();
            let wait = OutageWait::new(outage.clone(), None).stopping_with(stop.clone());
            let store = RetryStore::new(inner, policy(3, 60)).waiting_out_outages(wait);
            (Arc::new(store), outage)
        };
        let down = Arc::new(SwitchedStore::default());
        down.down.store(true, Ordering::SeqCst);
        // One operation waits out an outage as long as it takes...
        let (store, outage) = store_of(down.clone());
        let waiting = tokio::spawn(async move { store.get("data/waiting", None).await });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(outage.current().is_some(), "an outage is recorded");
        assert!(!waiting.is_finished(), "it waits as long as it takes");
        // ... another is between two attempts of its budget...
        let (store, _) = store_of(down.clone());
        let calls = down.calls.load(Ordering::SeqCst);
        let retrying = tokio::spawn(async move { store.get("data/retrying", None).await });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(down.calls.load(Ordering::SeqCst) > calls, "it tried once");
        assert!(!retrying.is_finished(), "it waits to try again");
        // ... and both end when the process stops, without waiting more.
        stop.cancel();
        let stopped_at = tokio::time::Instant::now();
        let within = |task| tokio::time::timeout(Duration::from_secs(1), task);
        let waited = within(waiting)
            .await
            .expect("stopped at once")
            .expect("joined");
        let retried = within(retrying)
            .await
            .expect("stopped at once")
            .expect("joined");
        let (waited, retried) = (waited.expect_err("stopped"), retried.expect_err("stopped"));
        assert_eq!(
            stopped_at.elapsed(),
            Duration::ZERO,
            "nothing waited after the stop"
        );
        assert!(waited.is_transient() && retried.is_transient());
        assert!(waited.to_string().contains("stopping"), "{waited}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_longer_than_the_budget_is_waited_out_with_one_probe_at_a_time() {
        let inner = Arc::new(SwitchedStore::default());
        inner.down.store(true, Ordering::SeqCst);
        let (store, outage) = waiting_out(inner.clone(), None);
        let mut operations = tokio::task::JoinSet::new();
        for index in 0..8 {
            let store = store.clone();
            operations.spawn(async move { store.get(&format!("data/{index}"), None).await });
        }
        // Each operation spends its budget (3 attempts), then waits.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let budgets = inner.calls.load(Ordering::SeqCst);
        let probes_before = inner.probes.load(Ordering::SeqCst);
        assert!(outage.current().is_some(), "an outage is recorded");
        tokio::time::sleep(Duration::from_secs(300)).await;
        let during = inner.calls.load(Ordering::SeqCst) - budgets;
        let probes = inner.probes.load(Ordering::SeqCst) - probes_before;
        // One probe every 2.5 to 5 s, whatever the number of operations:
        // 60 to 120 requests in 300 s, not eight times that.
        assert!(
            (60..=121).contains(&during),
            "{during} requests in 300 s of outage"
        );
        assert_eq!(during, probes, "only probes are sent during the outage");
        assert!(operations.try_join_next().is_none(), "all still wait");
        inner.down.store(false, Ordering::SeqCst);
        let back = Instant::now();
        while let Some(joined) = operations.join_next().await {
            assert_eq!(
                joined.expect("task").expect("done once the store answers"),
                "ok"
            );
        }
        assert!(
            back.elapsed() <= Duration::from_secs(5),
            "{:?}",
            back.elapsed()
        );
        assert!(outage.current().is_none());
        assert_eq!(outage.outages(), 1);
        let ended = outage.last_ended().expect("the outage ended");
        assert!(
            ended.lasted >= Duration::from_secs(300),
            "{:?}",
            ended.lasted
        );
        assert!(!outage.gave_up());
    }

    #[tokio::test(start_paused = true)]
    async fn a_want_of_descriptors_longer_than_the_limit_is_not_said_as_the_location_silent() {
        let inner = Arc::new(SwitchedStore::default());
        inner.down.store(true, Ordering::SeqCst);
        inner.out_of_descriptors.store(true, Ordering::SeqCst);
        let (store, outage) = waiting_out(inner.clone(), Some(Duration::from_secs(60)));
        let error = store
            .put("data/x", Bytes::new(), PutMode::Overwrite)
            .await
            .expect_err("gives up after the limit");
        assert_eq!(error.cause(), FailureCause::OutOfDescriptors);
        let message = error.to_string();
        assert!(
            message.contains("this process has had no file descriptor free to reach it for 6")
                && message.contains("longer than failAfterUnavailableSeconds (60)")
                && message.contains("Too many open files")
                && !message.contains("not answered"),
            "{message}"
        );
        assert!(outage.gave_up());
        assert_eq!(
            outage.current().map(|current| current.cause),
            Some(FailureCause::OutOfDescriptors)
        );
    }

    #[test]
    fn an_outage_is_a_want_of_descriptors_only_while_every_error_of_it_was_one() {
        let error = |cause| StoreError::Transient {
            location: "test://".to_string(),
            operation: "put",
            key: "data/x".to_string(),
            message: if cause == FailureCause::OutOfDescriptors {
                "Too many open files (os error 24)".to_string()
            } else {
                "connection refused".to_string()
            },
            cause,
        };
        let cause =
            |outage: &crate::store::outage::Outage| outage.current().map(|current| current.cause);
        // The location refused, then this process ran out of descriptors:
        // still the location's outage, not "no descriptor free for 61s".
        let outage = crate::store::outage::Outage::default();
        outage.note(&error(FailureCause::Unreachable));
        outage.note(&error(FailureCause::OutOfDescriptors));
        assert_eq!(cause(&outage), Some(FailureCause::Unreachable));
        // Nor does the descriptors' error (and its remedy) stand for it.
        assert!(
            outage
                .current()
                .is_some_and(|current| current.error.contains("refused")),
            "{:?}",
            outage.current()
        );
        // Descriptors first, then the location: the location's from then on.
        let outage = crate::store::outage::Outage::default();
        outage.note(&error(FailureCause::OutOfDescriptors));
        assert_eq!(cause(&outage), Some(FailureCause::OutOfDescriptors));
        outage.note(&error(FailureCause::OutOfDescriptors));
        assert_eq!(cause(&outage), Some(FailureCause::OutOfDescriptors));
        outage.note(&error(FailureCause::ServerError));
        assert_eq!(cause(&outage), Some(FailureCause::ServerError));
        outage.note(&error(FailureCause::OutOfDescriptors));
        assert_eq!(cause(&outage), Some(FailureCause::ServerError));
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_longer_than_its_limit_fails_the_waiting_operations_saying_so() {
        let inner = Arc::new(SwitchedStore::default());
        inner.down.store(true, Ordering::SeqCst);
        let (store, outage) = waiting_out(inner.clone(), Some(Duration::from_secs(60)));
        let started = Instant::now();
        let error = store.put("data/x", Bytes::new(), PutMode::Overwrite).await;
        let error = error.expect_err("gives up after the limit");
        assert!(error.is_transient());
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(60) && waited <= Duration::from_secs(70),
            "{waited:?}"
        );
        let message = error.to_string();
        assert!(
            message.contains("it has not answered for 6")
                && message.contains("longer than failAfterUnavailableSeconds (60)")
                && message.contains("connection refused"),
            "{message}"
        );
        assert!(outage.gave_up());
        // Without waiting out outages, the budget alone decides.
        let plain = RetryStore::new(inner.clone(), policy(3, 60));
        let started = Instant::now();
        plain
            .get("data/x", None)
            .await
            .expect_err("fails after the budget");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
