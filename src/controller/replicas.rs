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

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::controller::FIELD_MANAGER;
use crate::reconcile::replicas::{RENEW_SECONDS, SKEW_SECONDS, lease_name, replica_lease};

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
        // A renewal that hangs (an unreachable API server) must not be
        // followed by a burst of the ticks it missed: one try per period.
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
}
