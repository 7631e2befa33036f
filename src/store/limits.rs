//! Caps that protect the storage behind a backup storage location: a limit
//! on requests in flight and a limit on uploaded bytes per second, each a
//! [`Layer`] of a [`Layered`] store, so backends carry no throttling code.
//!
//! The request cap counts store operations. A multipart `put` is one
//! operation that the S3 backend spreads over up to its part parallelism of
//! connections, so the connections open at once stay below
//! `max_concurrent_requests × part_parallelism`; set the part parallelism to
//! 1 where each connection counts.
//!
//! The upload cap charges a `put`'s bytes before they are sent, in slices no
//! larger than the limiter's burst, so over any window longer than one burst
//! the bytes handed to the backend stay at or below the rate. The limiter is
//! the engine's ([`crate::throttle::Throttle`]); its burst is a tenth of a
//! second's worth (at least [`MIN_UPLOAD_BURST_BYTES`]), which keeps the rate
//! smooth instead of letting a queue of objects leave in a lump.

use std::num::NonZeroU64;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use crate::throttle::WaitTime;
use crate::throttle::{ByteRate, MAX_BYTES_PER_SECOND, Throttle};

use super::DynStore;
use super::layer::{Layer, Layered, Request};

/// Smallest burst of the upload limiter: below this, the per-slice overhead
/// of the limiter would dominate.
pub const MIN_UPLOAD_BURST_BYTES: usize = 64 * 1024;

/// Largest rate the upload limiter accepts.
pub const MAX_UPLOAD_BYTES_PER_SECOND: u64 = MAX_BYTES_PER_SECOND;

/// The request cap: at most a fixed number of operations of the wrapped
/// store run at once; the rest wait in FIFO order.
pub type ConcurrencyLimitStore = Layered<ConcurrencyLimit>;

/// The [`Layer`] of [`ConcurrencyLimitStore`]: a permit per request.
#[derive(Debug)]
pub struct ConcurrencyLimit {
    permits: Arc<Semaphore>,
    max: usize,
}

impl ConcurrencyLimitStore {
    /// Wrap `inner`, allowing `max` operations at once (at least one).
    pub fn new(inner: DynStore, max: usize) -> Self {
        let max = max.max(1);
        Layered::wrap(
            inner,
            ConcurrencyLimit {
                permits: Arc::new(Semaphore::new(max)),
                max,
            },
        )
    }

    /// The cap this wrapper enforces.
    pub fn max_concurrent_requests(&self) -> usize {
        self.layer().max
    }
}

#[async_trait]
impl Layer for ConcurrencyLimit {
    type Held = OwnedSemaphorePermit;

    async fn before(&self, _: Request<'_>) -> OwnedSemaphorePermit {
        // The semaphore is never closed, so acquiring cannot fail.
        match self.permits.clone().acquire_owned().await {
            Ok(permit) => permit,
            Err(_) => unreachable!("the request semaphore is never closed"),
        }
    }
}

/// Why an upload rate limit could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RateLimitError {
    /// The rate does not fit the limiter.
    #[error(
        "upload rate {bytes_per_second} bytes/s is above the supported maximum of {MAX_UPLOAD_BYTES_PER_SECOND} bytes/s"
    )]
    TooFast {
        /// The rate asked for.
        bytes_per_second: u64,
    },
}

/// The upload cap: the bytes of each `put` are held to a rate. Reads,
/// listings and deletes pass through unthrottled.
pub type UploadRateLimitStore = Layered<UploadRateLimit>;

/// The [`Layer`] of [`UploadRateLimitStore`]: charges a `put`'s bytes.
pub struct UploadRateLimit {
    throttle: Throttle,
    bytes_per_second: NonZeroU64,
}

impl std::fmt::Debug for UploadRateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadRateLimit")
            .field("bytes_per_second", &self.bytes_per_second)
            .finish()
    }
}

impl UploadRateLimitStore {
    /// Wrap `inner`, uploading at most `bytes_per_second` on average.
    pub fn new(inner: DynStore, bytes_per_second: NonZeroU64) -> Result<Self, RateLimitError> {
        if bytes_per_second.get() > MAX_UPLOAD_BYTES_PER_SECOND {
            return Err(RateLimitError::TooFast {
                bytes_per_second: bytes_per_second.get(),
            });
        }
        Ok(Layered::wrap(
            inner,
            UploadRateLimit {
                throttle: Throttle::with_burst_floor(
                    Some(ByteRate(bytes_per_second.get())),
                    MIN_UPLOAD_BURST_BYTES,
                ),
                bytes_per_second,
            },
        ))
    }

    /// Record the time uploads wait for the limiter into `waited`.
    pub fn recording_wait_into(mut self, waited: WaitTime) -> Self {
        let layer = self.layer_mut();
        layer.throttle = layer.throttle.clone().recording_wait_into(waited);
        self
    }

    /// The rate this wrapper enforces.
    pub fn bytes_per_second(&self) -> NonZeroU64 {
        self.layer().bytes_per_second
    }
}

#[async_trait]
impl Layer for UploadRateLimit {
    type Held = ();

    async fn before(&self, request: Request<'_>) {
        let Request::Put { mut bytes, .. } = request else {
            return;
        };
        let slice_bytes = self.throttle.max_request_bytes() as u64;
        while bytes > 0 {
            let slice = bytes.min(slice_bytes);
            bytes -= slice;
            self.throttle.acquire(slice as usize).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use super::*;
    use crate::store::local::LocalStore;
    use crate::store::{ObjectMeta, ObjectStore, PutMode, StoreError};

    /// Counts how many operations run at once and remembers the peak.
    #[derive(Debug, Default)]
    struct PeakStore {
        running: AtomicUsize,
        peak: AtomicUsize,
    }

    impl PeakStore {
        async fn enter(&self) {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[async_trait]
    impl ObjectStore for PeakStore {
        async fn put(&self, _: &str, _: Bytes, _: PutMode) -> Result<(), StoreError> {
            self.enter().await;
            Ok(())
        }
        async fn get(&self, _: &str, _: Option<Range<u64>>) -> Result<Bytes, StoreError> {
            self.enter().await;
            Ok(Bytes::new())
        }
        async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
            self.enter().await;
            Ok(ObjectMeta {
                key: key.to_string(),
                size: 0,
            })
        }
        async fn list(&self, _: &str) -> Result<Vec<ObjectMeta>, StoreError> {
            self.enter().await;
            Ok(Vec::new())
        }
        async fn delete(&self, _: &str) -> Result<(), StoreError> {
            self.enter().await;
            Ok(())
        }
        fn location(&self) -> String {
            "test://".to_string()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_cap_run_at_once() {
        let inner = Arc::new(PeakStore::default());
        let store = Arc::new(ConcurrencyLimitStore::new(inner.clone(), 3));
        let mut tasks = tokio::task::JoinSet::new();
        for index in 0..20 {
            let store = store.clone();
            tasks.spawn(async move {
                match index % 3 {
                    0 => store.put("k", Bytes::new(), PutMode::Overwrite).await,
                    1 => store.get("k", None).await.map(drop),
                    _ => store.head("k").await.map(drop),
                }
            });
        }
        while let Some(result) = tasks.join_next().await {
            result.expect("task ran").expect("operation succeeded");
        }
        assert_eq!(inner.peak.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_rate_above_the_limiter_range_is_refused() {
        let inner: DynStore = Arc::new(LocalStore::new("/nonexistent"));
        let rate = NonZeroU64::new(MAX_UPLOAD_BYTES_PER_SECOND + 1).expect("non-zero");
        assert!(matches!(
            UploadRateLimitStore::new(inner, rate),
            Err(RateLimitError::TooFast { .. })
        ));
    }

    // governor sleeps on the real clock, so this one measures real time. It
    // checks a lower bound only, which a slow machine cannot break.
    #[tokio::test]
    async fn uploads_do_not_exceed_the_rate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let inner: DynStore = Arc::new(LocalStore::new(dir.path()));
        let rate = NonZeroU64::new(512 * 1024).expect("non-zero");
        let waited = WaitTime::default();
        let store = UploadRateLimitStore::new(inner, rate)
            .expect("rate fits")
            .recording_wait_into(waited.clone());
        let started = Instant::now();
        let object = Bytes::from(vec![7u8; 256 * 1024]);
        for index in 0..4 {
            store
                .put(&format!("o{index}"), object.clone(), PutMode::Overwrite)
                .await
                .expect("put");
        }
        // 1 MiB at 512 KiB/s with a burst of 64 KiB: at least (1 MiB - 64 KiB) / rate.
        let floor = Duration::from_secs_f64((1024.0 - 64.0) / 512.0);
        let elapsed = started.elapsed();
        assert!(elapsed >= floor, "{elapsed:?} < {floor:?}");
        // The waiting is recorded: some, and never more than the time spent.
        let waited = waited.total();
        assert!(
            waited > Duration::ZERO && waited <= elapsed,
            "waited {waited:?} of {elapsed:?}"
        );
    }
}
