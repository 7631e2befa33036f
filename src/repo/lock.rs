//! Lock objects (`locks/<random id>`): who is using a repository, how, and
//! until when.
//!
//! Backup, restore, verify and forget take a *shared* lock; the destructive
//! phase of prune (deleting packs and index files) takes an *exclusive*
//! one. A holder refreshes its lock (rewrites it with a later expiry) every
//! [`LOCK_REFRESH_SECONDS`]; a lock is *stale* when its expiry has passed or
//! when it was taken on this host by a process that no longer runs. Stale
//! locks are reported and ignored; `haulage repo unlock` removes them. A
//! holder that cannot refresh before its lock's expiry stops its work
//! (others may already treat the lock as stale).
//!
//! Pure: times and the liveness of processes come in as arguments.

use serde::{Deserialize, Serialize};

/// Prefix of lock objects.
pub const LOCKS_PREFIX: &str = "locks/";
/// A holder rewrites its lock this often.
pub const LOCK_REFRESH_SECONDS: u64 = 5 * 60;
/// A lock not refreshed for this long is stale (restic's 30 minutes).
pub const LOCK_EXPIRY_SECONDS: u64 = 30 * 60;

/// Shared or exclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LockKind {
    /// Many may hold it at once; excludes an exclusive lock.
    Shared,
    /// Excludes every other lock.
    Exclusive,
}

/// A lock object's content (JSON; sealed in format 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LockRecord {
    /// Shared or exclusive.
    pub kind: LockKind,
    /// Host of the holder.
    pub hostname: String,
    /// Process id of the holder on that host.
    pub pid: u32,
    /// What the holder does (`backup`, `prune`, …).
    pub purpose: String,
    /// When it was taken (seconds since the epoch, holder's clock).
    pub created_seconds: i64,
    /// When it was last refreshed.
    pub refreshed_seconds: i64,
    /// After this it is stale unless refreshed.
    pub expires_seconds: i64,
}

/// Whether a lock still counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staleness {
    /// Held.
    Live,
    /// Not refreshed in time.
    Expired,
    /// Taken on this host by a process that is gone.
    HolderGone,
}

impl LockRecord {
    /// A new lock taken at `now`.
    pub fn new(kind: LockKind, hostname: &str, pid: u32, purpose: &str, now: i64) -> Self {
        LockRecord {
            kind,
            hostname: hostname.to_string(),
            pid,
            purpose: purpose.to_string(),
            created_seconds: now,
            refreshed_seconds: now,
            expires_seconds: now + LOCK_EXPIRY_SECONDS as i64,
        }
    }

    /// The same lock refreshed at `now`.
    pub fn refreshed(&self, now: i64) -> Self {
        LockRecord {
            refreshed_seconds: now,
            expires_seconds: now + LOCK_EXPIRY_SECONDS as i64,
            ..self.clone()
        }
    }

    /// Is this lock still held, seen from `this_host` at `now`?
    /// `process_alive` answers for a pid on this host.
    pub fn staleness(
        &self,
        now: i64,
        this_host: &str,
        process_alive: impl Fn(u32) -> bool,
    ) -> Staleness {
        if self.hostname == this_host && !process_alive(self.pid) {
            Staleness::HolderGone
        } else if now > self.expires_seconds {
            Staleness::Expired
        } else {
            Staleness::Live
        }
    }

    /// True when a lock of kind `wanted` cannot be held beside this one.
    pub fn conflicts_with(&self, wanted: LockKind) -> bool {
        self.kind == LockKind::Exclusive || wanted == LockKind::Exclusive
    }

    /// For messages: `exclusive lock of prune by pid 12 on host-a, taken …`.
    pub fn describe(&self) -> String {
        format!(
            "{} lock of {} by pid {} on {}",
            match self.kind {
                LockKind::Shared => "shared",
                LockKind::Exclusive => "exclusive",
            },
            self.purpose,
            self.pid,
            self.hostname
        )
    }

    /// Serialize.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("lock serializes")
    }

    /// Parse.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|error| error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_two_shared_locks_coexist() {
        let shared = LockRecord::new(LockKind::Shared, "a", 1, "backup", 0);
        let exclusive = LockRecord::new(LockKind::Exclusive, "a", 1, "prune", 0);
        assert!(!shared.conflicts_with(LockKind::Shared));
        assert!(shared.conflicts_with(LockKind::Exclusive));
        assert!(exclusive.conflicts_with(LockKind::Shared));
        assert!(exclusive.conflicts_with(LockKind::Exclusive));
    }

    #[test]
    fn a_lock_is_stale_when_expired_or_its_process_on_this_host_is_gone() {
        let lock = LockRecord::new(LockKind::Shared, "host-a", 42, "backup", 1000);
        let alive = |_| true;
        let dead = |_| false;
        assert_eq!(lock.staleness(1001, "host-a", alive), Staleness::Live);
        assert_eq!(lock.staleness(1001, "host-a", dead), Staleness::HolderGone);
        // Another host's process cannot be checked: only expiry counts.
        assert_eq!(lock.staleness(1001, "host-b", dead), Staleness::Live);
        let expiry = 1000 + LOCK_EXPIRY_SECONDS as i64;
        assert_eq!(
            lock.staleness(expiry + 1, "host-b", dead),
            Staleness::Expired
        );
        let refreshed = lock.refreshed(expiry);
        assert_eq!(
            refreshed.staleness(expiry + 1, "host-b", dead),
            Staleness::Live
        );
        assert_eq!(refreshed.created_seconds, 1000);
    }
}
