//! Replica liveness and the admission Lease, as decisions: whether the
//! replica that claimed an object is alive by its liveness Lease, the
//! Lease a replica applies on each renewal, and what a replica does with
//! the admission Lease it sees. The controller renews, reads and writes
//! the Leases (`haulage::controller::replicas`, `::lease`).
//!
//! Why one Lease per replica rather than a heartbeat in each VolumeBackup:
//! one write every [`RENEW_SECONDS`] per replica, whatever the number of
//! backups, and a crash is visible to every other replica in one place.
//! Why not a leader election for backups: every replica works (each on the
//! backups it claimed), so there is no leader to elect; a lease only says
//! "alive". Admission is different: caps are global, so one replica at a
//! time admits, under the admission Lease ([`next_step`]).

use std::time::Duration;

use haulage_api::labels::{MANAGED_BY, MANAGED_BY_LABEL};
use haulage_api::names::dns_subdomain;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

/// How long an unrenewed admission lease stays with its holder (client-go's
/// default).
pub const ADMISSION_LEASE_DURATION_SECONDS: u64 = 15;

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
pub const SKEW_SECONDS: i64 = 5;

/// The Lease name of a replica identity: a DNS subdomain of at most 253
/// characters (pod names already are; anything else is lowercased and
/// stripped of other characters).
pub fn lease_name(identity: &str) -> String {
    dns_subdomain(LEASE_PREFIX, identity)
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

/// What a replica does with the lease it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStep {
    /// There is none: create it, held by this replica.
    Create,
    /// This replica holds it: renew it.
    Renew,
    /// Free, or its holder stopped renewing: take it over.
    TakeOver,
    /// Another live replica holds it.
    Wait,
}

/// Decide what to do with the lease: `holder` is its holder (`None`: no
/// lease, `Some("")`: released), `unchanged_for` how long this replica has
/// seen the same record, `duration` the lease's duration.
pub fn next_step(
    lease_exists: bool,
    holder: Option<&str>,
    identity: &str,
    unchanged_for: Duration,
    duration: Duration,
) -> LeaseStep {
    if !lease_exists {
        return LeaseStep::Create;
    }
    match holder {
        Some(holder) if holder == identity => LeaseStep::Renew,
        None | Some("") => LeaseStep::TakeOver,
        Some(_) if unchanged_for >= duration => LeaseStep::TakeOver,
        Some(_) => LeaseStep::Wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DURATION: Duration = Duration::from_secs(ADMISSION_LEASE_DURATION_SECONDS);

    #[test]
    fn a_missing_lease_is_created_and_ones_own_is_renewed() {
        assert_eq!(
            next_step(false, None, "a", Duration::ZERO, DURATION),
            LeaseStep::Create
        );
        assert_eq!(
            next_step(true, Some("a"), "a", Duration::from_secs(60), DURATION),
            LeaseStep::Renew
        );
    }

    #[test]
    fn another_replicas_lease_is_taken_over_only_after_it_stood_still_for_its_duration() {
        assert_eq!(
            next_step(true, Some("b"), "a", Duration::from_secs(14), DURATION),
            LeaseStep::Wait
        );
        assert_eq!(
            next_step(true, Some("b"), "a", DURATION, DURATION),
            LeaseStep::TakeOver
        );
        assert_eq!(
            next_step(true, Some(""), "a", Duration::ZERO, DURATION),
            LeaseStep::TakeOver
        );
    }

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
