//! Lock objects in the store: taking, refreshing, releasing, listing and
//! removing stale ones (the records and their rules are
//! [`crate::repo::lock`]).
//!
//! Taking a lock writes `locks/<random id>` and then lists the others: if
//! a live one conflicts, ours is deleted and the attempt repeated until the
//! caller's wait is over. Of two takers that race, at least one sees the
//! other (both write before they list, and listings show completed
//! writes), so two conflicting locks are never both held. While held, a
//! task rewrites the lock every [`LOCK_REFRESH_SECONDS`]; if it cannot
//! before the lock's expiry, the lock is *lost*: [`RepositoryLock::lost`]
//! is cancelled and the holder must stop, since others may already treat
//! the lock as stale.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rand::Rng;
use tokio_util::sync::CancellationToken;

use super::{EngineError, Repository};
use crate::repo::codec::RecordKind;
use crate::repo::lock::{LOCK_REFRESH_SECONDS, LOCKS_PREFIX, LockKind, LockRecord, Staleness};
use crate::store::PutMode;

/// Seconds since the epoch, now.
pub(crate) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs() as i64)
        .unwrap_or(0)
}

/// True when `pid` runs on this host.
fn process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// One lock object as found.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockInfo {
    /// Its key in the store.
    pub key: String,
    /// Its content, when readable.
    #[serde(skip)]
    pub record: Option<LockRecord>,
    /// `live`, `expired`, `holder gone` or `unreadable`.
    pub state: String,
    /// For humans.
    pub description: String,
}

impl LockInfo {
    /// True unless stale: a live lock, or one that cannot be read (which
    /// counts as held, to be safe).
    pub fn is_live(&self) -> bool {
        self.state == "live" || self.state == "unreadable"
    }

    fn conflicts_with(&self, wanted: LockKind) -> bool {
        match &self.record {
            Some(record) => record.conflicts_with(wanted),
            None => true,
        }
    }
}

/// Every lock object of the repository, with whether it still counts.
pub async fn list_locks(repository: &Repository) -> Result<Vec<LockInfo>, EngineError> {
    let store = repository.store();
    let objects = store
        .list(LOCKS_PREFIX)
        .await
        .map_err(|error| EngineError::store("list locks", error))?;
    let host = super::hostname();
    let now = unix_now();
    let mut locks = Vec::new();
    for meta in objects {
        let bytes = match store.get(&meta.key, None).await {
            Ok(bytes) => bytes,
            // Released between the listing and the read.
            Err(error) if error.is_not_found() => continue,
            Err(error) => return Err(EngineError::store(format!("read lock {}", meta.key), error)),
        };
        let record = repository
            .codec()
            .decode_record(RecordKind::Lock, &bytes)
            .ok()
            .and_then(|json| LockRecord::from_json(&json).ok());
        let (state, description) = match &record {
            Some(record) => (
                match record.staleness(now, &host, process_alive) {
                    Staleness::Live => "live",
                    Staleness::Expired => "expired",
                    Staleness::HolderGone => "holder gone",
                },
                format!(
                    "{}, taken {}, refreshed {}",
                    record.describe(),
                    format_time(record.created_seconds),
                    format_time(record.refreshed_seconds)
                ),
            ),
            None => (
                "unreadable",
                "a lock that cannot be read (damaged, or sealed with another key)".to_string(),
            ),
        };
        locks.push(LockInfo {
            key: meta.key,
            record,
            state: state.to_string(),
            description,
        });
    }
    locks.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(locks)
}

fn format_time(seconds: i64) -> String {
    let time = UNIX_EPOCH + Duration::from_secs(seconds.max(0) as u64);
    humantime::format_rfc3339_seconds(time).to_string()
}

/// Remove stale locks, or every lock with `all`. Returns what was removed.
pub async fn remove_locks(
    repository: &Repository,
    all: bool,
) -> Result<Vec<LockInfo>, EngineError> {
    let mut removed = Vec::new();
    for lock in list_locks(repository).await? {
        if all || !lock.is_live() {
            repository
                .store()
                .delete(&lock.key)
                .await
                .map_err(|error| EngineError::store(format!("remove lock {}", lock.key), error))?;
            removed.push(lock);
        }
    }
    Ok(removed)
}

/// A held lock. Release it with [`RepositoryLock::release`]; dropped
/// unreleased, it stops refreshing and is deleted in the background.
#[derive(Debug)]
pub struct RepositoryLock {
    repository: Repository,
    key: String,
    lost: CancellationToken,
    refresher: Option<tokio::task::JoinHandle<()>>,
    /// Stale locks seen (and ignored) while taking this one.
    pub stale: Vec<LockInfo>,
}

impl RepositoryLock {
    /// Take a lock of `kind` for `purpose`, retrying for up to `wait` while
    /// a conflicting live lock is held.
    pub async fn acquire(
        repository: &Repository,
        kind: LockKind,
        purpose: &str,
        wait: Duration,
    ) -> Result<Self, EngineError> {
        let started = tokio::time::Instant::now();
        let host = super::hostname();
        let key = format!(
            "{LOCKS_PREFIX}{}",
            hex::encode(rand::rng().random::<[u8; 32]>())
        );
        loop {
            let record = LockRecord::new(kind, &host, std::process::id(), purpose, unix_now());
            write_lock(repository, &key, &record).await?;
            let others: Vec<LockInfo> = list_locks(repository)
                .await?
                .into_iter()
                .filter(|lock| lock.key != key)
                .collect();
            let (conflicts, stale): (Vec<_>, Vec<_>) = others
                .into_iter()
                .filter(|lock| !lock.is_live() || lock.conflicts_with(kind))
                .partition(LockInfo::is_live);
            if conflicts.is_empty() {
                let record = Arc::new(Mutex::new(record));
                let lost = CancellationToken::new();
                let refresher = tokio::spawn(refresh_loop(
                    repository.clone(),
                    key.clone(),
                    record.clone(),
                    lost.clone(),
                ));
                for lock in &stale {
                    tracing::warn!(lock = %lock.key, state = %lock.state, "ignoring a stale lock");
                }
                return Ok(RepositoryLock {
                    repository: repository.clone(),
                    key,
                    lost,
                    refresher: Some(refresher),
                    stale,
                });
            }
            delete_lock(repository, &key).await?;
            if started.elapsed() >= wait {
                return Err(EngineError::Locked {
                    location: repository.store().location(),
                    holders: conflicts
                        .iter()
                        .map(|lock| format!("{} ({})", lock.description, lock.key))
                        .collect::<Vec<_>>()
                        .join("; "),
                });
            }
            let pause = Duration::from_millis(rand::rng().random_range(500..2500));
            tokio::time::sleep(
                pause.min(
                    wait.saturating_sub(started.elapsed())
                        .max(Duration::from_millis(100)),
                ),
            )
            .await;
        }
    }

    /// Cancelled when the lock could not be refreshed in time: stop work.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// A child of `parent` that is also cancelled when this lock is lost:
    /// the token to run the work the lock protects with.
    pub fn cancel_on_loss(&self, parent: &CancellationToken) -> CancellationToken {
        let work = parent.child_token();
        let lost = self.lost.clone();
        let stop = work.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = lost.cancelled() => stop.cancel(),
                _ = stop.cancelled() => {}
            }
        });
        work
    }

    /// An error when the lock was lost.
    pub fn check(&self) -> Result<(), EngineError> {
        if self.lost.is_cancelled() {
            return Err(EngineError::LockLost {
                key: self.key.clone(),
            });
        }
        Ok(())
    }

    /// The lock's key in the store.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stop refreshing and delete the lock.
    pub async fn release(mut self) -> Result<(), EngineError> {
        if let Some(refresher) = self.refresher.take() {
            refresher.abort();
        }
        let result = delete_lock(&self.repository, &self.key).await;
        self.key.clear();
        result
    }
}

impl Drop for RepositoryLock {
    fn drop(&mut self) {
        if let Some(refresher) = self.refresher.take() {
            refresher.abort();
        }
        if !self.key.is_empty()
            && let Ok(handle) = tokio::runtime::Handle::try_current()
        {
            let repository = self.repository.clone();
            let key = std::mem::take(&mut self.key);
            handle.spawn(async move {
                let _ = delete_lock(&repository, &key).await;
            });
        }
    }
}

async fn write_lock(
    repository: &Repository,
    key: &str,
    record: &LockRecord,
) -> Result<(), EngineError> {
    let bytes =
        repository
            .codec()
            .encode_record(RecordKind::Lock, &record.to_json(), &mut rand::rng());
    repository
        .store()
        .put(key, Bytes::from(bytes), PutMode::Overwrite)
        .await
        .map_err(|error| EngineError::store(format!("write lock {key}"), error))
}

async fn delete_lock(repository: &Repository, key: &str) -> Result<(), EngineError> {
    repository
        .store()
        .delete(key)
        .await
        .map_err(|error| EngineError::store(format!("remove lock {key}"), error))
}

/// Rewrite the lock every refresh interval (every 30 s after a failure);
/// give up, cancelling `lost`, when its expiry is less than a minute away
/// (a write still waiting then, in a store waiting out an outage, is
/// given up too).
async fn refresh_loop(
    repository: Repository,
    key: String,
    record: Arc<Mutex<LockRecord>>,
    lost: CancellationToken,
) {
    let mut pause = Duration::from_secs(LOCK_REFRESH_SECONDS);
    loop {
        tokio::time::sleep(pause).await;
        let (refreshed, expires) = {
            let record = record.lock().expect("lock record");
            (record.refreshed(unix_now()), record.expires_seconds)
        };
        // A store that waits out an outage would hold the write past the
        // expiry: the write may take until a minute before it, no longer.
        let time_left = Duration::from_secs((expires - 60 - unix_now()).max(0) as u64);
        let written = match tokio::time::timeout(
            time_left,
            write_lock(&repository, &key, &refreshed),
        )
        .await
        {
            Ok(written) => written,
            Err(_) => Err(EngineError::LockLost { key: key.clone() }),
        };
        match written {
            Ok(()) => {
                *record.lock().expect("lock record") = refreshed;
                pause = Duration::from_secs(LOCK_REFRESH_SECONDS);
            }
            Err(error) => {
                tracing::warn!(lock = %key, %error, "cannot refresh the lock");
                if unix_now() + 60 >= expires {
                    lost.cancel();
                    return;
                }
                pause = Duration::from_secs(30);
            }
        }
    }
}
