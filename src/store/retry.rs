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
}

impl RetryStore {
    /// Wrap `inner`, retrying as `policy` allows.
    pub fn new(inner: DynStore, policy: RetryPolicy) -> Self {
        RetryStore { inner, policy }
    }

    async fn run<T, F, Fut>(&self, operation: &'static str, mut attempt: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut throttled = 0u32;
        loop {
            attempts += 1;
            let error = match attempt().await {
                Ok(value) => return Ok(value),
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
            tracing::debug!(
                operation,
                attempt = attempts,
                delay_ms = delay.as_millis() as u64,
                error = %error,
                "transient storage error, retrying"
            );
            tokio::time::sleep(delay).await;
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
}
