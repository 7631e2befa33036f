//! The byte-rate limiter: smooth bytes-per-second limits with `governor`,
//! the one limiter behind the engine's read and write limits (a
//! StoragePolicy's grant, `--limit-read`) and the store's upload cap (a
//! BackupStorageLocation's `uploadBytesPerSecond`, `--limit-upload`).
//!
//! The limiter counts in KiB cells and allows a burst of only a tenth of a
//! second's worth (at least one request: a read block for the engine, a
//! slice of an upload for the store), so a limited copy runs at a steady
//! rate instead of racing at full speed and then sleeping. The rate can
//! change while a copy runs ([`Throttle::set_rate`]).

use std::num::NonZeroU32;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use governor::clock::{Clock, MonotonicClock};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

/// Time spent waiting on a rate limiter, summed over every waiter. Clones
/// share the sum, so a limiter records into it and whoever exports the
/// figure (the agent's `/metrics`) reads it, without the limiter knowing
/// about metrics.
#[derive(Debug, Clone, Default)]
pub struct WaitTime(Arc<AtomicU64>);

impl WaitTime {
    /// Add one wait.
    pub fn add(&self, waited: Duration) {
        let nanoseconds = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(nanoseconds, Ordering::Relaxed);
    }

    /// The sum so far.
    pub fn total(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

/// Bytes per cell of the limiter.
const CELL_BYTES: u64 = 1024;
/// Largest single request the engine makes (bytes); an engine throttle's
/// burst is at least this.
pub const MAX_REQUEST_BYTES: usize = 256 * 1024;
/// Largest rate a throttle holds (governor counts `u32` cells of a KiB).
pub const MAX_BYTES_PER_SECOND: u64 = u32::MAX as u64 * CELL_BYTES;
/// The burst is this fraction of one second's allowance.
const BURST_DIVISOR: u64 = 10;

/// A rate such as `50MiB` (per second), parsed from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRate(pub u64);

impl FromStr for ByteRate {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim().trim_end_matches("/s");
        let size: bytesize::ByteSize = trimmed.parse().map_err(|error| {
            format!("{text:?} is not a rate like 50MiB or 200MB (per second): {error}")
        })?;
        if size.as_u64() < CELL_BYTES {
            return Err(format!(
                "{text:?} is below the smallest rate, 1KiB per second"
            ));
        }
        Ok(ByteRate(size.as_u64()))
    }
}

/// The governor quota for a rate, and its burst in cells: a tenth of a
/// second's worth, at least `burst_floor_bytes` (one request).
fn quota_for(bytes_per_second: u64, burst_floor_bytes: usize) -> (Quota, u32) {
    let cells_per_second = (bytes_per_second / CELL_BYTES).clamp(1, u64::from(u32::MAX)) as u32;
    let burst_cells = (u64::from(cells_per_second) / BURST_DIVISOR)
        .max((burst_floor_bytes as u64 / CELL_BYTES).max(1))
        .min(u64::from(u32::MAX)) as u32;
    let quota = Quota::per_second(NonZeroU32::new(cells_per_second).expect("clamped to >= 1"))
        .allow_burst(NonZeroU32::new(burst_cells).expect("at least one request"));
    (quota, burst_cells)
}

/// The clock of every throttle: `std::time::Instant`. Not governor's
/// default `QuantaClock`, whose first use in a process busy-loops on the
/// calling thread for 0.5 to 200 ms to calibrate the TSC against the
/// monotonic clock, in every command, limited or not: on this project's
/// test machine that loop was 8–27 % of the CPU samples of three of six
/// profiled unchanged backups (39 ms of the main thread's in one). A throttle
/// reads the clock once per request of up to 256 KiB, where the few
/// nanoseconds `quanta` saves per reading are nothing.
type ThrottleClock = MonotonicClock;

/// A direct (unkeyed) governor limiter on clock `C`.
type Limiter<C> = RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<<C as Clock>::Instant>>;

/// The limiter in force and its burst; replaced whole when the rate changes.
#[derive(Debug)]
struct Current<C: Clock> {
    limiter: Option<Arc<Limiter<C>>>,
    burst_bytes: usize,
    rate: Option<ByteRate>,
}

impl<C: Clock> Clone for Current<C> {
    fn clone(&self) -> Self {
        Current {
            limiter: self.limiter.clone(),
            burst_bytes: self.burst_bytes,
            rate: self.rate,
        }
    }
}

/// A limiter whose rate can change while callers wait on it: the one place
/// that swaps governor limiters. A caller takes the current limiter and
/// waits on it; a new rate installs a fresh limiter with its burst already
/// spent, so a request already waiting finishes at the old rate and every
/// later one passes at the new rate, with no extra burst.
#[derive(Debug)]
struct AdjustableLimiter<C: Clock> {
    current: RwLock<Current<C>>,
    clock: C,
    burst_floor_bytes: usize,
}

impl<C: Clock + Clone> AdjustableLimiter<C> {
    fn new(rate: Option<ByteRate>, clock: C, burst_floor_bytes: usize) -> Self {
        AdjustableLimiter {
            current: RwLock::new(Self::build(rate, &clock, burst_floor_bytes)),
            clock,
            burst_floor_bytes,
        }
    }

    fn build(rate: Option<ByteRate>, clock: &C, burst_floor_bytes: usize) -> Current<C> {
        match rate {
            None => Current {
                limiter: None,
                burst_bytes: MAX_REQUEST_BYTES,
                rate: None,
            },
            Some(ByteRate(bytes_per_second)) => {
                let (quota, burst_cells) = quota_for(bytes_per_second, burst_floor_bytes);
                Current {
                    limiter: Some(Arc::new(RateLimiter::direct_with_clock(
                        quota,
                        clock.clone(),
                    ))),
                    burst_bytes: burst_cells as usize * CELL_BYTES as usize,
                    rate,
                }
            }
        }
    }

    /// The limiter and burst in force now.
    fn current(&self) -> Current<C> {
        // A poisoned lock only means a writer panicked between two plain
        // assignments; the value is still whole.
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_rate(&self, rate: Option<ByteRate>) {
        let next = Self::build(rate, &self.clock, self.burst_floor_bytes);
        // A fresh limiter starts with a full burst. The copy was running
        // under the old one, so that burst would be extra: every re-split
        // would let each transfer exceed its share by a burst. Drain it.
        if let Some(limiter) = &next.limiter {
            let burst_cells = (next.burst_bytes / CELL_BYTES as usize).max(1) as u32;
            let _ = limiter.check_n(NonZeroU32::new(burst_cells).expect("at least one cell"));
        }
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
    }
}

/// A shared limit; cloning shares the budget, and [`Throttle::set_rate`]
/// changes it for every clone, live (the agent follows the bandwidth the
/// controller grants without restarting its copy).
#[derive(Debug, Clone)]
pub struct Throttle {
    shared: Arc<AdjustableLimiter<ThrottleClock>>,
    waited: WaitTime,
    /// Once cancelled, waits end at once (a copy being stopped must not sit
    /// out a slow grant first).
    cancel: Option<tokio_util::sync::CancellationToken>,
}

impl Throttle {
    /// No limit (until [`Throttle::set_rate`] sets one).
    pub fn unlimited() -> Self {
        Self::new(None)
    }

    /// A limit of `rate` bytes per second, or none, for the engine's
    /// requests (bursts of at least [`MAX_REQUEST_BYTES`]).
    pub fn new(rate: Option<ByteRate>) -> Self {
        Self::with_burst_floor(rate, MAX_REQUEST_BYTES)
    }

    /// A limit whose burst is at least `burst_floor_bytes` (the largest
    /// request its callers make at once: a smaller one keeps the rate
    /// smoother).
    pub fn with_burst_floor(rate: Option<ByteRate>, burst_floor_bytes: usize) -> Self {
        Throttle {
            shared: Arc::new(AdjustableLimiter::new(
                rate,
                ThrottleClock::default(),
                burst_floor_bytes,
            )),
            waited: WaitTime::default(),
            cancel: None,
        }
    }

    /// End every wait as soon as `cancel` is cancelled (shared by clones
    /// made afterwards): a stopping copy does not wait for its budget.
    pub fn cancelled_by(mut self, cancel: tokio_util::sync::CancellationToken) -> Self {
        self.cancel = Some(cancel);
        self
    }

    /// Record the time callers wait for this limit into `waited` (shared
    /// by clones made afterwards).
    pub fn recording_wait_into(mut self, waited: WaitTime) -> Self {
        self.waited = waited;
        self
    }

    /// Change the limit of this throttle and all its clones: requests
    /// after the call pass at `rate` (or unlimited when `None`); one
    /// already waiting completes at the old rate.
    pub fn set_rate(&self, rate: Option<ByteRate>) {
        self.shared.set_rate(rate);
    }

    /// The rate in force (`None`: unlimited).
    pub fn rate(&self) -> Option<ByteRate> {
        self.shared.current().rate
    }

    /// True when a limit is set.
    pub fn is_limited(&self) -> bool {
        self.shared.current().limiter.is_some()
    }

    /// The largest request [`Throttle::acquire`] accepts at once (at most
    /// [`MAX_REQUEST_BYTES`] whatever the rate, so callers may read it once).
    pub fn max_request_bytes(&self) -> usize {
        self.shared.current().burst_bytes.min(MAX_REQUEST_BYTES)
    }

    /// Wait until `bytes` (at most [`Throttle::max_request_bytes`]) may pass.
    pub async fn acquire(&self, bytes: usize) {
        let Current {
            limiter,
            burst_bytes,
            ..
        } = self.shared.current();
        let Some(limiter) = limiter else { return };
        let cells = bytes.div_ceil(CELL_BYTES as usize).max(1) as u32;
        let cells = NonZeroU32::new(cells).expect("at least one cell");
        let started = std::time::Instant::now();
        let wait = async {
            // A request above the burst is split by callers; if one slips
            // through, wait for the burst instead of failing the copy.
            if limiter.until_n_ready(cells).await.is_err() {
                let burst = NonZeroU32::new((burst_bytes / CELL_BYTES as usize).max(1) as u32)
                    .expect("at least one cell");
                let _ = limiter.until_n_ready(burst).await;
            }
        };
        match &self.cancel {
            Some(cancel) => {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = wait => {}
                }
            }
            None => wait.await,
        }
        self.waited.add(started.elapsed());
    }

    /// [`Throttle::acquire`] from a blocking thread inside a Tokio runtime.
    pub fn acquire_blocking(&self, handle: &tokio::runtime::Handle, bytes: usize) {
        if self.is_limited() {
            handle.block_on(self.acquire(bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No crate of the build brings `quanta`, whose clock busy-loops up to
    /// 200 ms at its first use in a process ([`ThrottleClock`]): not
    /// governor with its default features back, nor another crate.
    #[test]
    fn no_crate_of_the_build_calibrates_a_tsc_clock_at_start() {
        // The workspace's lock file, read at build time (a change of it
        // builds the test again).
        let lock = include_str!("../Cargo.lock");
        assert!(
            !lock.contains("name = \"quanta\""),
            "Cargo.lock holds `quanta`: `cargo tree --workspace --target all -i quanta` shows \
             which crate brings it; turn that crate's feature off"
        );
    }

    #[tokio::test]
    async fn waiting_for_the_limit_is_recorded() {
        let waited = WaitTime::default();
        // 64 KiB/s with a burst of one 256 KiB request: after the burst, 16
        // KiB wait a quarter of a second (real time: governor sleeps on the
        // real clock).
        let throttle = Throttle::new(Some(ByteRate(64 * 1024))).recording_wait_into(waited.clone());
        throttle.acquire(256 * 1024).await;
        let started = std::time::Instant::now();
        throttle.acquire(16 * 1024).await;
        let elapsed = started.elapsed();
        let total = waited.total();
        assert!(
            total >= elapsed / 2 && total > std::time::Duration::from_millis(100),
            "{total:?} of {elapsed:?}"
        );
    }

    #[tokio::test]
    async fn a_cancelled_copy_does_not_wait_for_its_budget() {
        let cancel = tokio_util::sync::CancellationToken::new();
        // 1 KiB/s: after the first request, the next would wait ~256 s.
        let throttle = Throttle::new(Some(ByteRate(1024))).cancelled_by(cancel.clone());
        let request = throttle.max_request_bytes();
        throttle.acquire(request).await;
        cancel.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), throttle.acquire(request))
            .await
            .expect("the wait ends when the copy is cancelled");
    }

    #[test]
    fn rates_parse_with_units() {
        assert_eq!("1MiB".parse::<ByteRate>().unwrap(), ByteRate(1024 * 1024));
        assert_eq!("10MB/s".parse::<ByteRate>().unwrap(), ByteRate(10_000_000));
        assert!("fast".parse::<ByteRate>().is_err());
        assert!("10".parse::<ByteRate>().is_err());
    }

    #[test]
    fn a_limited_copy_runs_at_the_rate_after_a_burst_of_a_tenth_of_a_second() {
        use governor::clock::FakeRelativeClock;
        use std::time::Duration;
        let rate = 100 * 1024 * 1024; // 100 MiB/s = 102400 cells/s
        let (quota, burst_cells) = quota_for(rate, MAX_REQUEST_BYTES);
        assert_eq!(burst_cells, 10240, "a tenth of a second");
        let clock = FakeRelativeClock::default();
        let limiter = RateLimiter::direct_with_clock(quota, clock.clone());
        let request = NonZeroU32::new(256).unwrap(); // 256 KiB reads
        let mut passed_cells = 0u64;
        // Over 2 simulated seconds in 1 ms steps, count what passes.
        for _ in 0..2000 {
            while limiter
                .check_n(request)
                .expect("request fits the burst")
                .is_ok()
            {
                passed_cells += 256;
            }
            clock.advance(Duration::from_millis(1));
        }
        let expected = 2 * 102_400 + u64::from(burst_cells);
        let deviation = passed_cells.abs_diff(expected) as f64 / expected as f64;
        assert!(
            deviation < 0.01,
            "passed {passed_cells} cells, expected about {expected}"
        );
    }

    #[test]
    fn after_a_rate_change_the_new_rate_holds() {
        use governor::clock::FakeRelativeClock;
        use std::time::Duration;
        let clock = FakeRelativeClock::default();
        let limiter =
            AdjustableLimiter::new(Some(ByteRate(8 << 20)), clock.clone(), MAX_REQUEST_BYTES);
        let request = NonZeroU32::new(64).unwrap(); // 64 KiB reads
        // Count the cells that pass over `millis` simulated milliseconds,
        // taking the limiter in force before each step as a caller would.
        let run = |millis: u64| {
            let mut passed = 0u64;
            for _ in 0..millis {
                let current = limiter.current().limiter.expect("limited");
                while current.check_n(request).expect("fits the burst").is_ok() {
                    passed += 64;
                }
                clock.advance(Duration::from_millis(1));
            }
            passed
        };
        let before = run(1000);
        let expected_before = 8 * 1024 + 8 * 1024 / 10;
        assert!(
            before.abs_diff(expected_before) * 100 < expected_before,
            "before: {before} cells, expected about {expected_before}"
        );
        // Down to 2 MiB/s: the next two seconds carry 2 MiB/s, neither the
        // old rate nor a fresh burst on top.
        limiter.set_rate(Some(ByteRate(2 << 20)));
        let after = run(2000);
        let expected_after = 2 * 2048;
        assert!(
            after <= expected_after && after + 64 >= expected_after,
            "after: {after} cells, expected {expected_after} at most and within one request"
        );
        // Lifted: no limiter at all.
        limiter.set_rate(None);
        assert!(limiter.current().limiter.is_none());
    }
}
