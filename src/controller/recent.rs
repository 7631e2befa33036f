//! Moments this replica remembers by key, on the monotonic clock: when it
//! last wrote each backup's status (the progress-write throttle), which
//! stage pods it deleted to replace them. Memory only: a restarted replica
//! starts empty, which at worst writes a status early or judges a pod
//! once more.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A map from key to the moment it was last recorded; entries older than
/// its retention are dropped as new ones come.
#[derive(Debug)]
pub struct Recent {
    moments: Mutex<HashMap<String, Instant>>,
    keep: Duration,
}

impl Recent {
    /// A map keeping each entry for `keep`.
    pub fn keeping(keep: Duration) -> Self {
        Recent {
            moments: Mutex::new(HashMap::new()),
            keep,
        }
    }

    fn moments(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.moments.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long ago `key` was recorded, if it was (and is still kept).
    pub fn since(&self, key: &str) -> Option<Duration> {
        self.moments()
            .get(key)
            .map(Instant::elapsed)
            .filter(|elapsed| *elapsed < self.keep)
    }

    /// Whether `key` was recorded and is still kept.
    pub fn contains(&self, key: &str) -> bool {
        !key.is_empty() && self.since(key).is_some()
    }

    /// Record `key` now.
    pub fn record(&self, key: &str) {
        if key.is_empty() {
            return;
        }
        let mut moments = self.moments();
        let keep = self.keep;
        moments.retain(|_, at| at.elapsed() < keep);
        moments.insert(key.to_string(), Instant::now());
    }

    /// Forget `key`.
    pub fn forget(&self, key: &str) {
        self.moments().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_key_is_known_until_forgotten_or_past_its_retention() {
        let recent = Recent::keeping(Duration::from_secs(3600));
        assert_eq!(recent.since("a"), None);
        recent.record("a");
        assert!(
            recent
                .since("a")
                .is_some_and(|ago| ago < Duration::from_secs(1))
        );
        assert!(recent.contains("a"));
        recent.forget("a");
        assert!(!recent.contains("a"));
        let expired = Recent::keeping(Duration::ZERO);
        expired.record("b");
        assert!(!expired.contains("b"));
        recent.record("");
        assert!(!recent.contains(""));
    }
}
