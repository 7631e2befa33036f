//! Restore planning: where the stage pods that write restored data into
//! the destination claims run.
//!
//! A destination claim that already exists and is Bound (an overwrite or a
//! sync into an earlier restore) is placed by the backup rules: where its
//! volume is attached, else anywhere its volume's node affinity allows. A
//! new claim (absent, or Pending because its class waits for a first
//! consumer) is spread by the same balance rule over the nodes its storage
//! class's allowed topologies admit, counting the class's CSI driver
//! against attach limits. With WaitForFirstConsumer binding the stage pod's
//! node then decides where the volume is provisioned (so the pod must be
//! pinned by node affinity, not `nodeName`, which bypasses the scheduler
//! and leaves the claim Pending). With Immediate binding the provisioner
//! picks the topology when the claim is created, so the plan for a claim
//! not yet bound is provisional: plan again once it is Bound and its
//! volume's node affinity decides.

use crate::PlanError;
use crate::facts::{ClaimPhase, ClusterFacts};
use crate::output::{StagePlan, UnplaceableReason};
use crate::placement::{
    Constraints, Demand, IndexedCluster, Request, demand_of_existing_claim, place_requests,
};

/// A destination claim a restore writes into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreClaim {
    /// Destination namespace.
    pub namespace: String,
    /// Destination claim name.
    pub name: String,
    /// Bytes to write (the snapshot's size), for balancing.
    pub bytes: u64,
    /// Destination storage class (after the storage-class map); `None` uses
    /// the cluster default.
    pub storage_class: Option<String>,
}

impl RestoreClaim {
    /// A claim of the default storage class. (Access modes do not matter
    /// for placement: a new volume is attached only where it is placed.)
    pub fn new(namespace: impl Into<String>, name: impl Into<String>, bytes: u64) -> Self {
        RestoreClaim {
            namespace: namespace.into(),
            name: name.into(),
            bytes,
            storage_class: None,
        }
    }

    /// The same claim in a storage class.
    pub fn with_storage_class(mut self, class: impl Into<String>) -> Self {
        self.storage_class = Some(class.into());
        self
    }
}

/// Plan the stage pods that write the restore's destination claims.
///
/// Every claim lands in exactly one stage pod or in `unplaceable`; the same
/// claim listed twice is an error. See the module documentation for how
/// existing and new claims are placed.
pub fn plan_restore(facts: &ClusterFacts, claims: &[RestoreClaim]) -> Result<StagePlan, PlanError> {
    let cluster = IndexedCluster::new(facts)?;
    let mut seen = std::collections::HashSet::with_capacity(claims.len());
    let mut requests = Vec::with_capacity(claims.len());
    for claim in claims {
        if !seen.insert((claim.namespace.as_str(), claim.name.as_str())) {
            return Err(PlanError::DuplicateObject {
                kind: "restore claim",
                name: format!("{}/{}", claim.namespace, claim.name),
            });
        }
        let existing = cluster.claim(&claim.namespace, &claim.name);
        let demand = match existing {
            Some(existing) if existing.phase != ClaimPhase::Pending => {
                demand_of_existing_claim(&cluster, existing)
            }
            _ => {
                let class_name = existing
                    .and_then(|existing| existing.storage_class.as_deref())
                    .or(claim.storage_class.as_deref());
                demand_of_new_claim(&cluster, class_name)
            }
        };
        requests.push(Request {
            namespace: &claim.namespace,
            name: &claim.name,
            bytes: claim.bytes,
            demand,
        });
    }
    Ok(place_requests(&cluster, requests))
}

fn demand_of_new_claim<'f>(cluster: &IndexedCluster<'f>, class_name: Option<&str>) -> Demand<'f> {
    let class = match class_name {
        Some(name) => match cluster.classes.get(name) {
            Some(class) => *class,
            None => {
                return Demand::Unplaceable(UnplaceableReason::StorageClassMissing {
                    class: name.to_string(),
                });
            }
        },
        None => match cluster.default_class() {
            Some(class) => class,
            None => return Demand::Unplaceable(UnplaceableReason::NoDefaultStorageClass),
        },
    };
    Demand::Anywhere(Constraints {
        affinity: None,
        topology: class.allowed_topologies.as_ref(),
        driver: class.csi_driver(),
    })
}
