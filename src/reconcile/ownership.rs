//! Who acts on a VolumeBackup or VolumeRestore: this replica (it owns the
//! object, or claims a new one, or adopts one whose owner stopped renewing
//! its liveness Lease), or nobody now (another live replica owns it, or
//! this replica's own lease is stale, so another may be adopting its
//! objects). The claim itself is a resourceVersion-checked write the
//! controller makes: of two replicas racing, exactly one wins.

use std::time::Duration;

use haulage_api::backup::OwnerClaim;
use haulage_api::condition::reason;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::action::{Action, Event, Requeue};
use crate::replicas::{Liveness, liveness};
use crate::stage_pod::Pinning;

/// How often an object owned by another replica is checked for adoption
/// (from the cache: no API request unless that replica's lease expired).
pub const ADOPTION_CHECK_SECONDS: u64 = 20;
/// How soon a replica whose own lease is stale looks again.
pub const STALE_LEASE_RETRY_SECONDS: u64 = 5;

/// The controller's settings the decisions depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerSettings {
    /// This replica's identity.
    pub identity: String,
    /// Image of the mover agent.
    pub agent_image: String,
    /// How stage pods are pinned to their node.
    pub pinning: Pinning,
    /// Seconds a running agent may go without reporting.
    pub agent_lost_seconds: u32,
    /// Seconds between two checkpoints of a backup in its agent (`None`:
    /// the agent's default).
    pub checkpoint_seconds: Option<u32>,
}

/// Who acts on the object.
#[derive(Debug, Clone, PartialEq)]
pub enum Ownership {
    /// This replica owns it already.
    Keep(OwnerClaim),
    /// Write this claim (conditional on the resourceVersion read): a new
    /// object, or one adopted from a replica whose lease expired. When the
    /// write loses, the reconcile stops there.
    Take {
        /// The claim to write.
        claim: OwnerClaim,
        /// The Event to record once it is written.
        event: Event,
    },
}

impl Ownership {
    /// The owner claim in force after this decision.
    pub fn claim(&self) -> &OwnerClaim {
        match self {
            Ownership::Keep(claim) | Ownership::Take { claim, .. } => claim,
        }
    }
}

/// Why a reconcile waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitReason {
    /// This replica's own lease is stale: another may be adopting.
    StaleLease,
    /// Another live replica owns the object.
    OwnedElsewhere {
        /// That replica.
        replica: String,
    },
}

/// What ownership is decided from.
#[derive(Debug, Clone, Copy)]
pub struct OwnershipFacts<'a> {
    /// The object's `status.owner`.
    pub owner: Option<&'a OwnerClaim>,
    /// This replica's identity.
    pub identity: &'a str,
    /// Whether this replica renewed its liveness lease recently enough to
    /// act as an owner.
    pub lease_fresh: bool,
    /// The replicas' liveness Leases.
    pub leases: &'a [Lease],
    /// The kind, for the Events (`backup`, `restore`).
    pub noun: &'static str,
}

/// Keep, claim, adopt, or wait (with when to look again).
pub fn decide_ownership(
    facts: OwnershipFacts<'_>,
    now: &Time,
) -> Result<Ownership, (WaitReason, Requeue)> {
    let identity = facts.identity;
    match facts.owner {
        Some(claim) if claim.replica == identity => {
            if facts.lease_fresh {
                Ok(Ownership::Keep(claim.clone()))
            } else {
                Err((
                    WaitReason::StaleLease,
                    Requeue::After(Duration::from_secs(STALE_LEASE_RETRY_SECONDS)),
                ))
            }
        }
        Some(claim) => {
            // Another replica owns it and keeps working on it, unless it
            // stopped renewing its lease: then this one adopts it.
            match liveness(
                &claim.replica,
                claim.claimed_at.0.as_second(),
                facts.leases,
                now.0.as_second(),
            ) {
                Liveness::Alive => Err((
                    WaitReason::OwnedElsewhere {
                        replica: claim.replica.clone(),
                    },
                    Requeue::After(Duration::from_secs(ADOPTION_CHECK_SECONDS)),
                )),
                Liveness::Gone { why } => Ok(Ownership::Take {
                    event: Event::warning(
                        reason::ADOPTED_FROM_REPLICA,
                        "Adopt",
                        format!("replica {identity} adopted this {}: {why}", facts.noun),
                    ),
                    claim: OwnerClaim {
                        replica: identity.to_string(),
                        claimed_at: now.clone(),
                        adopted_from: Some(claim.replica.clone()),
                    },
                }),
            }
        }
        None => Ok(Ownership::Take {
            claim: OwnerClaim {
                replica: identity.to_string(),
                claimed_at: now.clone(),
                adopted_from: None,
            },
            event: Event::normal(
                reason::CLAIMED_BY_REPLICA,
                "Claim",
                format!("claimed by replica {identity}"),
            ),
        }),
    }
}
/// What a reconcile of a VolumeBackup or VolumeRestore does; `S` is its
/// status type.
#[derive(Debug, Clone)]
pub enum Decision<S> {
    /// Nothing, for now.
    Wait {
        /// Why (for the log).
        why: WaitReason,
        /// When to look again.
        requeue: Requeue,
    },
    /// The object is final: release what is left of its stage pods.
    Finished {
        /// Release these stage pods (with their Roles and credentials).
        release: Vec<Action>,
    },
    /// Act as its owner.
    Act(Box<OwnerActs<S>>),
}

/// The owner's actions for one reconcile, in the order they are carried out.
#[derive(Debug, Clone)]
pub struct OwnerActs<S> {
    /// Keep or take ownership first.
    pub ownership: Ownership,
    /// Children to create, stage pods to supervise, claims to label or
    /// hand back, Events.
    pub actions: Vec<Action>,
    /// The status to write now (`None`: unchanged, or held back by the
    /// progress-write throttle).
    pub status: Option<S>,
    /// After the status: the final Event and the release of stage pods.
    pub after_status: Vec<Action>,
    /// The object reached a final phase (forget its throttle entry once
    /// its status was written).
    pub finished: bool,
    /// When to look again.
    pub requeue: Requeue,
}
