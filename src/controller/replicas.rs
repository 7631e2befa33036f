//! Replica liveness: each controller replica renews a `coordination.k8s.io`
//! Lease named after its identity; a VolumeBackup whose owner's lease has
//! expired (or is gone) is adopted by another replica instead of being
//! failed or left alone. The agents keep working while no replica owns
//! their backup, so adoption only resumes the roll-up, the cleanup and the
//! stage-pod supervision.
//!
//! Why one Lease per replica rather than a heartbeat in each VolumeBackup:
//! one write every [`RENEW_SECONDS`] per replica, whatever the number of
//! backups, and a crash is visible to every other replica in one place.
//! Why not a leader election: every replica works (each on the backups it
//! claimed), so there is no leader to elect; a lease only says "alive".

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::api::labels::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::controller::FIELD_MANAGER;

/// Prefix of each replica's Lease name.
pub const LEASE_PREFIX: &str = "haulage-replica-";
/// Label on replica Leases (value `"true"`), so the controller watches only
/// its own and `haulage status` can list the replicas.
pub const REPLICA_LEASE_LABEL: &str = "haulage.dev/replica-lease";
/// Seconds between renewals.
pub const RENEW_SECONDS: u64 = 10;
/// Default `leaseDurationSeconds`: three missed renewals.
pub const DEFAULT_LEASE_SECONDS: u32 = 30;
/// Extra seconds granted past a lease's expiry before adopting, for clock
/// skew between replicas.
const SKEW_SECONDS: i64 = 5;

/// The Lease name of a replica identity: a DNS subdomain of at most 253
/// characters (pod names already are; anything else is lowercased and
/// stripped of other characters).
pub fn lease_name(identity: &str) -> String {
    let cleaned: String = identity
        .chars()
        .map(|character| character.to_ascii_lowercase())
        .filter(|character| character.is_ascii_alphanumeric() || matches!(character, '-' | '.'))
        .collect();
    let cleaned = cleaned.trim_matches(|character| character == '-' || character == '.');
    let mut name = format!("{LEASE_PREFIX}{cleaned}");
    name.truncate(253);
    name.trim_end_matches(['-', '.']).to_string()
}

/// The Lease a replica applies on every renewal.
pub fn replica_lease(
    identity: &str,
    namespace: &str,
    duration_seconds: u32,
    now: MicroTime,
) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(lease_name(identity)),
            namespace: Some(namespace.to_string()),
            labels: Some(
                [
                    (REPLICA_LEASE_LABEL.to_string(), "true".to_string()),
                    (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(identity.to_string()),
            lease_duration_seconds: Some(i32::try_from(duration_seconds).unwrap_or(i32::MAX)),
            renew_time: Some(now),
            ..LeaseSpec::default()
        }),
    }
}

/// Whether the replica that claimed an object is still alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// Its lease is current (or too young to judge).
    Alive,
    /// Its lease expired or is gone: the object may be adopted.
    Gone {
        /// Why, for the log and the Claimed condition.
        why: String,
    },
}

/// Whether `replica`, which claimed an object at `claimed_at` (seconds),
/// is alive at `now` (seconds) according to the cached `leases` (pure).
///
/// A missing lease counts as gone only once the claim is older than a lease
/// duration: a replica writes its lease before it claims anything, but this
/// replica's cache may not have seen it yet.
pub fn liveness(replica: &str, claimed_at: i64, leases: &[Lease], now: i64) -> Liveness {
    let holder = leases.iter().find(|lease| {
        lease
            .spec
            .as_ref()
            .and_then(|spec| spec.holder_identity.as_deref())
            == Some(replica)
    });
    let Some(spec) = holder.and_then(|lease| lease.spec.as_ref()) else {
        let age = now - claimed_at;
        return if age > i64::from(DEFAULT_LEASE_SECONDS) + SKEW_SECONDS {
            Liveness::Gone {
                why: format!("replica {replica} holds no lease"),
            }
        } else {
            Liveness::Alive
        };
    };
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(0).max(1));
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map_or(claimed_at, |time| time.0.as_second());
    let expired_at = renewed + duration;
    if now > expired_at + SKEW_SECONDS {
        Liveness::Gone {
            why: format!(
                "replica {replica} stopped renewing its lease {}s ago",
                now - renewed
            ),
        }
    } else {
        Liveness::Alive
    }
}

/// Renew this replica's lease every [`RENEW_SECONDS`] until `shutdown`,
/// then delete it so the others adopt its work at once. The first renewal
/// is done before this returns, so the replica is visible before it
/// claims anything.
pub async fn keep_alive(
    client: Client,
    namespace: String,
    identity: String,
    duration_seconds: u32,
    heartbeat: Heartbeat,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let renew = {
        let api = api.clone();
        let identity = identity.clone();
        let namespace = namespace.clone();
        move || {
            let api = api.clone();
            let lease = replica_lease(&identity, &namespace, duration_seconds, now());
            let params = params.clone();
            async move {
                let name = lease.metadata.name.clone().unwrap_or_default();
                api.patch(&name, &params, &Patch::Apply(&lease)).await
            }
        }
    };
    renew().await?;
    heartbeat.renewed();
    Ok(tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_secs(RENEW_SECONDS));
        ticker.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = ticker.tick() => {}
            }
            match renew().await {
                Ok(_) => {
                    heartbeat.renewed();
                    debug!("replica lease renewed");
                }
                Err(error) => warn!(
                    %error,
                    "cannot renew this replica's lease; other replicas adopt its backups if this lasts {duration_seconds}s"
                ),
            }
        }
        match api
            .delete(&lease_name(&identity), &DeleteParams::default())
            .await
        {
            Ok(_) => debug!("replica lease released"),
            Err(error) => {
                warn!(%error, "cannot delete this replica's lease; it expires on its own")
            }
        }
    }))
}

/// When this replica last renewed its lease (monotonic clock), shared
/// with the reconcilers: a replica that could not renew for most of a
/// lease duration stops writing to the backups it owns, since another
/// replica may be adopting them.
#[derive(Debug, Clone, Default)]
pub struct Heartbeat(std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl Heartbeat {
    /// Record a successful renewal now.
    pub fn renewed(&self) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(std::time::Instant::now());
    }

    /// Whether the last renewal is recent enough to act as owner: within
    /// the lease duration less the clock-skew allowance others grant.
    pub fn is_fresh(&self, lease_seconds: u32) -> bool {
        let last = *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let window = Duration::from_secs(
            u64::from(lease_seconds).saturating_sub(SKEW_SECONDS.unsigned_abs()),
        );
        last.is_some_and(|last| last.elapsed() < window)
    }
}

/// The cached replica leases.
pub fn cached(store: &Store<Lease>) -> Vec<Lease> {
    store
        .state()
        .iter()
        .map(|lease| (**lease).clone())
        .collect()
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(identity: &str, renewed: i64, duration: i32) -> Lease {
        let mut lease = replica_lease(
            identity,
            "haulage-system",
            30,
            MicroTime(k8s_openapi::jiff::Timestamp::from_second(renewed).expect("valid")),
        );
        if let Some(spec) = lease.spec.as_mut() {
            spec.lease_duration_seconds = Some(duration);
        }
        lease
    }

    #[test]
    fn a_heartbeat_is_fresh_only_after_a_recent_renewal() {
        let heartbeat = Heartbeat::default();
        assert!(!heartbeat.is_fresh(30), "never renewed");
        heartbeat.renewed();
        assert!(heartbeat.is_fresh(30));
        assert!(
            !heartbeat.is_fresh(5),
            "a window shorter than the skew is never fresh"
        );
    }

    #[test]
    fn lease_names_are_dns_subdomains() {
        assert_eq!(
            lease_name("controller-7d9-x"),
            "haulage-replica-controller-7d9-x"
        );
        assert_eq!(
            lease_name("Host_Name.local"),
            "haulage-replica-hostname.local"
        );
        assert!(lease_name(&"a".repeat(400)).len() <= 253);
    }

    #[test]
    fn a_replica_renewing_its_lease_is_alive_and_one_that_stopped_is_gone() {
        let t0 = 1_800_000_000;
        let leases = [lease("a", t0, 30), lease("b", t0 - 100, 30)];
        assert_eq!(liveness("a", t0 - 500, &leases, t0 + 20), Liveness::Alive);
        assert_eq!(
            liveness("a", t0 - 500, &leases, t0 + 30 + SKEW_SECONDS),
            Liveness::Alive,
            "skew is granted"
        );
        assert!(matches!(
            liveness("a", t0 - 500, &leases, t0 + 31 + SKEW_SECONDS),
            Liveness::Gone { .. }
        ));
        let Liveness::Gone { why } = liveness("b", t0 - 500, &leases, t0) else {
            panic!("b stopped renewing 100 s ago");
        };
        assert_eq!(why, "replica b stopped renewing its lease 100s ago");
    }

    #[test]
    fn a_missing_lease_counts_only_once_the_claim_is_older_than_a_lease() {
        let t0 = 1_800_000_000;
        assert_eq!(liveness("c", t0, &[], t0 + 10), Liveness::Alive);
        assert!(matches!(
            liveness("c", t0, &[], t0 + 60),
            Liveness::Gone { .. }
        ));
    }
}
