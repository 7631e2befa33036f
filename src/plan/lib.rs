//! The stage-pod planner: a pure function from observed cluster facts to a
//! plan saying which stage pod (one per namespace and node) mounts each
//! selected PersistentVolumeClaim, and why the others cannot be mounted.
//!
//! No I/O, no clock, no Kubernetes client: [`facts`] are plain values, built
//! by [`objects`] from Kubernetes objects (a `kubectl get -o yaml` dump, or
//! the controller's informer caches); [`plan_stage_pods`] and
//! [`plan_restore`] return a [`StagePlan`], whose [`StagePod`]s travel
//! unchanged into a VolumeBackup's status and into the stage pod's desired
//! objects (`haulage_reconcile::stage_pod`). The rules the planner keeps are
//! listed on [`plan_stage_pods`] and checked by property tests in
//! `tests/plan.rs`; `docs/planner.md` explains them for users.

pub mod facts;
pub mod objects;
pub mod output;
mod placement;
pub mod quantity;
mod restore;
pub mod selector;

pub use facts::ClusterFacts;
pub use output::{StagePlan, StagePod, UnplaceableClaim, UnplaceableReason};
pub use restore::{RestoreClaim, plan_restore};
pub use selector::{LabelSelector, Selection};

use placement::{IndexedCluster, Request, demand_of_existing_claim, place_requests};

/// Facts the planner refuses, because any plan from them would depend on
/// the order they were listed in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Two objects with the same identity.
    #[error("the cluster facts hold {kind} {name} twice")]
    DuplicateObject {
        /// Kind of the object.
        kind: &'static str,
        /// Name (`namespace/name` for namespaced kinds).
        name: String,
    },
}

/// Plan the stage pods that read the selected claims for a backup.
///
/// Every selected claim lands in exactly one stage pod or in `unplaceable`
/// with a reason. The rules:
/// - Pending and Lost claims, claims whose volume is not in the facts, and
///   ReadWriteOncePod volumes mounted by a live pod (quiesce first) are
///   unplaceable.
/// - A volume without ReadWriteMany/ReadOnlyMany that is attached to a node
///   (mounted by a live pod there, or listed in the node's
///   `status.volumesAttached`) goes to that node, even a cordoned, not-ready
///   or NoSchedule-tainted one: the volume is already there. A NoExecute
///   node, or one outside the volume's node affinity, is never used; the
///   claim is then unplaceable with the node's problem.
/// - A shared volume (ReadWriteMany/ReadOnlyMany) attached to several nodes
///   is mounted by one stage pod, on the least loaded of those nodes.
/// - Any other volume goes to the least loaded node that is ready,
///   schedulable, free of NoSchedule and NoExecute taints, inside the
///   volume's node affinity, has the volume's CSI driver and room under its
///   attach limit (counting volumes already attached there).
/// - Load is bytes (measured usage when known, else the request), then
///   volume count; volumes are placed largest first. The volumes other
///   backups' and restores' stage pods hold on a node now count as its
///   load before the plan adds any (many backups created at once spread
///   over the nodes).
/// - The plan is the same for the same facts, in any order.
///
/// Live pods are those bound to a node and not finished (Pending, Running
/// or Unknown): their volumes are attached to that node.
pub fn plan_stage_pods(
    facts: &ClusterFacts,
    selection: &Selection,
) -> Result<StagePlan, PlanError> {
    let cluster = IndexedCluster::new(facts)?;
    let requests = cluster
        .claims
        .iter()
        .filter(|claim| selection.selects(&claim.namespace, &claim.name, &claim.labels))
        .map(|&claim| Request {
            namespace: &claim.namespace,
            name: &claim.name,
            bytes: claim.bytes(),
            demand: demand_of_existing_claim(&cluster, claim),
        })
        .collect();
    Ok(place_requests(&cluster, requests))
}
