//! The admission lease: caps are global, so only one replica at a time may
//! admit transfers. That replica holds the `coordination.k8s.io` Lease
//! [`ADMISSION_LEASE`] in the controller's namespace, as client-go's leader
//! election does: every write of the lease carries its resourceVersion (of
//! two replicas racing for it, one wins), the holder renews it every
//! [`RETRY_PERIOD_SECONDS`], and another replica takes it over only after
//! seeing it unchanged for the lease's duration on its own monotonic
//! clock (no synchronised clocks needed). The holder stops admitting
//! [`RENEW_DEADLINE_SECONDS`] after its last successful renewal began,
//! which is earlier than any other replica can take over, so two replicas
//! never admit at once.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::controller::error::{is_conflict, is_not_found};
use crate::reconcile::replicas::{ADMISSION_LEASE_DURATION_SECONDS, LeaseStep, next_step};

/// Name of the admission Lease in the controller's namespace.
pub const ADMISSION_LEASE: &str = "haulage-admission";
/// How long an unrenewed lease stays with its holder.
pub const LEASE_DURATION_SECONDS: u64 = ADMISSION_LEASE_DURATION_SECONDS;
/// How long the holder keeps admitting after a renewal began without a
/// newer one succeeding; shorter than [`LEASE_DURATION_SECONDS`] so the
/// holder has stopped before anyone else may start.
pub const RENEW_DEADLINE_SECONDS: u64 = 10;
/// Seconds between looks at the lease (renewals, takeover attempts).
pub const RETRY_PERIOD_SECONDS: u64 = 2;

/// Whether this replica may admit now; shared by the lease loop (writer)
/// and the admission loop (reader).
#[derive(Debug, Default)]
pub struct Leadership {
    valid_until: Mutex<Option<Instant>>,
}

impl Leadership {
    /// True while the last successful renewal is fresh enough.
    pub fn is_leader(&self) -> bool {
        self.valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until)
    }

    /// A renewal that began at `began` succeeded.
    fn renewed(&self, began: Instant) {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(began + Duration::from_secs(RENEW_DEADLINE_SECONDS));
    }

    /// Stop admitting now.
    fn resign(&self) {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// A lease's holder and renew time: when it stops changing, its holder is
/// dead.
type LeaseRecord = (Option<String>, Option<String>);

/// The record of a lease.
fn record_of(lease: &Lease) -> LeaseRecord {
    let spec = lease.spec.clone().unwrap_or_default();
    (
        spec.holder_identity,
        spec.renew_time.map(|time| time.0.to_string()),
    )
}

/// Hold the admission lease when possible until `shutdown`; then release
/// it if held, so another replica takes over at once.
pub async fn run(
    api: Api<Lease>,
    identity: String,
    leadership: std::sync::Arc<Leadership>,
    shutdown: CancellationToken,
) {
    let duration = Duration::from_secs(LEASE_DURATION_SECONDS);
    let mut seen: Option<(LeaseRecord, Instant)> = None;
    loop {
        let began = Instant::now();
        match api.get_opt(ADMISSION_LEASE).await {
            Err(error) => warn!(
                lease = ADMISSION_LEASE,
                "cannot read the admission lease: {error}"
            ),
            Ok(current) => {
                let record = current.as_ref().map(record_of);
                let unchanged_for = match (&seen, &record) {
                    (Some((old, since)), Some(record)) if old == record => since.elapsed(),
                    _ => {
                        // Counted from after the read returned: never
                        // earlier than the holder's write that made it.
                        seen = record.clone().map(|record| (record, Instant::now()));
                        Duration::ZERO
                    }
                };
                let lease_duration = current
                    .as_ref()
                    .and_then(|lease| lease.spec.as_ref()?.lease_duration_seconds)
                    .and_then(|seconds| u64::try_from(seconds).ok())
                    .map_or(duration, Duration::from_secs);
                let holder = record.as_ref().and_then(|(holder, _)| holder.as_deref());
                let step = next_step(
                    current.is_some(),
                    holder,
                    &identity,
                    unchanged_for,
                    lease_duration,
                );
                match write(&api, current, step, &identity).await {
                    Ok(true) => {
                        if !leadership.is_leader() {
                            info!(replica = %identity, "holding the admission lease; admitting transfers");
                        }
                        leadership.renewed(began);
                    }
                    Ok(false) => {}
                    Err(error) => {
                        warn!(
                            lease = ADMISSION_LEASE,
                            ?step,
                            "admission lease not written: {error}"
                        )
                    }
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_secs(RETRY_PERIOD_SECONDS)) => {}
        }
    }
    if leadership.is_leader() {
        leadership.resign();
        release(&api, &identity).await;
    }
}

/// Carry out `step`; true when this replica holds the lease afterwards.
async fn write(
    api: &Api<Lease>,
    current: Option<Lease>,
    step: LeaseStep,
    identity: &str,
) -> Result<bool, kube::Error> {
    let time = now();
    match (step, current) {
        (LeaseStep::Wait, _) => Ok(false),
        (LeaseStep::Create, _) | (_, None) => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(ADMISSION_LEASE.to_string()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(identity.to_string()),
                    lease_duration_seconds: Some(LEASE_DURATION_SECONDS as i32),
                    acquire_time: Some(time.clone()),
                    renew_time: Some(time),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(error) if is_conflict(&error) => Ok(false),
                Err(error) => Err(error),
            }
        }
        (step, Some(mut lease)) => {
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if step == LeaseStep::TakeOver {
                info!(
                    replica = %identity,
                    previous = spec.holder_identity.as_deref().unwrap_or("-"),
                    "taking over the admission lease"
                );
                spec.holder_identity = Some(identity.to_string());
                spec.acquire_time = Some(time.clone());
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            spec.lease_duration_seconds = Some(LEASE_DURATION_SECONDS as i32);
            spec.renew_time = Some(time);
            // `replace` carries the resourceVersion read: a conflict means
            // another replica wrote it first.
            match api
                .replace(ADMISSION_LEASE, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(false),
                Err(error) => Err(error),
            }
        }
    }
}

/// Give the lease up (holder cleared), if this replica still holds it.
async fn release(api: &Api<Lease>, identity: &str) {
    let Ok(Some(mut lease)) = api.get_opt(ADMISSION_LEASE).await else {
        return;
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(identity) {
        return;
    }
    spec.holder_identity = None;
    match api
        .replace(ADMISSION_LEASE, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => info!(replica = %identity, "released the admission lease"),
        Err(error) => warn!(
            lease = ADMISSION_LEASE,
            "admission lease not released: {error}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holder_stops_admitting_before_anyone_may_take_over() {
        const { assert!(RENEW_DEADLINE_SECONDS < LEASE_DURATION_SECONDS) };
        let leadership = Leadership::default();
        assert!(!leadership.is_leader());
        leadership.renewed(Instant::now());
        assert!(leadership.is_leader());
        leadership.renewed(Instant::now() - Duration::from_secs(RENEW_DEADLINE_SECONDS));
        assert!(!leadership.is_leader());
    }
}
