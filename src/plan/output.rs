//! The plan the planner returns: stage pods keyed by (namespace, node) and
//! the claims no stage pod can mount, each with a reason written for the
//! person who has to fix it.
//!
//! The JSON form is a contract (`haulage plan -o json`, VolumeBackup status):
//! `{"stagePods":[{"namespace","node","volumes","bytes"}],
//! "unplaceable":[{"namespace","pvc","reason"}]}`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};

use bytesize::ByteSize;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize, Serializer};

use crate::facts::Taint;

/// The result of planning: where each selected claim is read (backup) or
/// written (restore).
///
/// Invariants: stage pods are sorted by (namespace, node) and unique on that
/// pair, each pod's volumes are sorted and non-empty, unplaceable claims are
/// sorted by (namespace, pvc), and every selected claim appears exactly once
/// across both lists.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StagePlan {
    /// One stage pod per (namespace, node) that has work.
    pub stage_pods: Vec<StagePod>,
    /// Claims no stage pod can mount.
    pub unplaceable: Vec<UnplaceableClaim>,
}

impl StagePlan {
    /// Total bytes the stage pods carry.
    pub fn total_bytes(&self) -> u64 {
        self.stage_pods.iter().map(|pod| pod.bytes).sum()
    }

    /// Number of claims placed in a stage pod.
    pub fn placed_volume_count(&self) -> usize {
        self.stage_pods.iter().map(|pod| pod.volumes.len()).sum()
    }
}

/// One stage pod: the claims of one namespace it mounts on one node. The
/// same value goes from the planner into a VolumeBackup's status and from
/// there into the stage pod's desired objects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StagePod {
    /// Namespace of the pod and of every claim it mounts.
    pub namespace: String,
    /// Node the pod is pinned to.
    pub node: String,
    /// Names of the claims it mounts, sorted.
    pub volumes: Vec<String>,
    /// Sum of the claims' bytes (measured usage when known, else request).
    #[serde(default)]
    pub bytes: u64,
}

/// A claim no stage pod can mount, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnplaceableClaim {
    /// Namespace of the claim.
    pub namespace: String,
    /// Claim name.
    pub pvc: String,
    /// Why; serialised as its sentence.
    pub reason: UnplaceableReason,
}

/// Why a node cannot take a volume that is already attached to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachedNodeProblem {
    /// The node is not among the facts.
    Missing,
    /// The node evicts pods that do not tolerate this taint.
    NoExecute(Taint),
    /// The volume's node affinity excludes the node.
    OutsideAffinity,
}

/// Why a claim is unplaceable. `Display` gives the sentence users read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnplaceableReason {
    /// The claim is Pending: nothing bound, nothing to copy.
    ClaimPending,
    /// The claim is Lost: its volume is gone.
    ClaimLost,
    /// The claim is Bound but names no volume.
    BoundWithoutVolume,
    /// The bound PersistentVolume is not among the facts.
    VolumeMissing {
        /// Volume name.
        volume: String,
    },
    /// A ReadWriteOncePod volume mounted by a live pod.
    SinglePodVolumeInUse {
        /// `namespace/name` of the pod holding it.
        pod: String,
    },
    /// The volume can only be read where it is attached, and none of those
    /// nodes can host a stage pod.
    AttachedNodesUnusable {
        /// Each node it is attached to, with its problem, sorted by node.
        nodes: Vec<(String, AttachedNodeProblem)>,
    },
    /// No node can take the volume; counts per cause.
    NoEligibleNode(Exclusions),
    /// The restore target's storage class is not among the facts.
    StorageClassMissing {
        /// Class name.
        class: String,
    },
    /// The restore target names no storage class and no class is the
    /// cluster default.
    NoDefaultStorageClass,
}

/// How many nodes were ruled out for a volume, by first cause found, in
/// the order the fields are listed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exclusions {
    /// Nodes outside the volume's node affinity.
    pub outside_affinity: usize,
    /// Nodes outside the storage class's allowed topologies.
    pub outside_topology: usize,
    /// Nodes that have a NoExecute taint.
    pub no_execute: usize,
    /// Nodes whose Ready condition is not True.
    pub not_ready: usize,
    /// Cordoned nodes.
    pub cordoned: usize,
    /// Nodes with a NoSchedule taint.
    pub no_schedule: usize,
    /// Nodes whose CSINode does not list the volume's driver.
    pub driver_missing: usize,
    /// Nodes at the attach limit of the volume's driver.
    pub attach_limit_reached: usize,
    /// The CSI driver, when the volume has one.
    pub driver: Option<String>,
}

impl fmt::Display for Exclusions {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let driver = self.driver.as_deref().unwrap_or("its driver");
        let causes = [
            (
                self.outside_affinity,
                "outside the volume's node affinity".to_string(),
            ),
            (
                self.outside_topology,
                "outside the storage class's allowed topologies".to_string(),
            ),
            (self.no_execute, "tainted NoExecute".to_string()),
            (self.not_ready, "not ready".to_string()),
            (self.cordoned, "cordoned".to_string()),
            (self.no_schedule, "tainted NoSchedule".to_string()),
            (self.driver_missing, format!("without CSI driver {driver}")),
            (
                self.attach_limit_reached,
                format!("at the attach limit of {driver}"),
            ),
        ];
        let mut first = true;
        for (count, cause) in causes.iter().filter(|(count, _)| *count > 0) {
            if !first {
                formatter.write_str(", ")?;
            }
            first = false;
            let noun = if *count == 1 { "node" } else { "nodes" };
            write!(formatter, "{count} {noun} {cause}")?;
        }
        if first {
            formatter.write_str("the cluster facts hold no nodes")?;
        }
        Ok(())
    }
}

impl fmt::Display for UnplaceableReason {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnplaceableReason::ClaimPending => formatter.write_str(
                "claim is Pending: it is not bound to a volume yet, so there is no data to copy",
            ),
            UnplaceableReason::ClaimLost => {
                formatter.write_str("claim is Lost: the volume it was bound to no longer exists")
            }
            UnplaceableReason::BoundWithoutVolume => {
                formatter.write_str("claim is Bound but names no volume (spec.volumeName is empty)")
            }
            UnplaceableReason::VolumeMissing { volume } => write!(
                formatter,
                "bound volume {volume} is not in the cluster facts (were persistentvolumes left out of the dump?)"
            ),
            UnplaceableReason::SinglePodVolumeInUse { pod } => write!(
                formatter,
                "ReadWriteOncePod volume is mounted by pod {pod}: quiesce the workload first (scale it to zero), then plan again"
            ),
            UnplaceableReason::AttachedNodesUnusable { nodes } => {
                formatter.write_str("volume can only be mounted where it is attached, and ")?;
                for (index, (node, problem)) in nodes.iter().enumerate() {
                    if index > 0 {
                        formatter.write_str("; ")?;
                    }
                    match problem {
                        AttachedNodeProblem::Missing => {
                            write!(formatter, "node {node} is not in the cluster facts")?
                        }
                        AttachedNodeProblem::NoExecute(taint) => write!(
                            formatter,
                            "node {node} has taint {taint}, which would evict a stage pod"
                        )?,
                        AttachedNodeProblem::OutsideAffinity => write!(
                            formatter,
                            "node {node} is outside the volume's node affinity"
                        )?,
                    }
                }
                Ok(())
            }
            UnplaceableReason::NoEligibleNode(exclusions) => {
                write!(formatter, "no node can take it: {exclusions}")
            }
            UnplaceableReason::StorageClassMissing { class } => {
                write!(
                    formatter,
                    "storage class {class} is not in the cluster facts"
                )
            }
            UnplaceableReason::NoDefaultStorageClass => formatter.write_str(
                "claim names no storage class and no storage class is marked as the default",
            ),
        }
    }
}

impl Serialize for UnplaceableReason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

fn human_bytes(bytes: u64) -> String {
    ByteSize::b(bytes).display().iec().to_string()
}

/// Namespaces the table names per node before summarising the rest, so a
/// node shared by hundreds of namespaces keeps a readable row.
const TABLE_NAMESPACES_SHOWN: usize = 3;

impl StagePlan {
    /// The plan as a table for people: one row per node (stage pods,
    /// volumes, bytes, namespaces), a total, then each unplaceable claim
    /// with its reason.
    pub fn to_table(&self) -> String {
        #[derive(Default)]
        struct NodeRow<'p> {
            pods: usize,
            volumes: usize,
            bytes: u64,
            namespaces: BTreeSet<&'p str>,
        }
        let mut rows: BTreeMap<&str, NodeRow> = BTreeMap::new();
        for pod in &self.stage_pods {
            let row = rows.entry(pod.node.as_str()).or_default();
            row.pods += 1;
            row.volumes += pod.volumes.len();
            row.bytes += pod.bytes;
            row.namespaces.insert(&pod.namespace);
        }
        let mut lines: Vec<[String; 5]> = vec![[
            "NODE".into(),
            "STAGE PODS".into(),
            "VOLUMES".into(),
            "BYTES".into(),
            "NAMESPACES".into(),
        ]];
        for (node, row) in &rows {
            lines.push([
                node.to_string(),
                row.pods.to_string(),
                row.volumes.to_string(),
                human_bytes(row.bytes),
                namespace_summary(&row.namespaces),
            ]);
        }
        let mut out = String::new();
        write_columns(&mut out, &lines);
        let _ = writeln!(
            out,
            "\n{} stage pods on {} nodes: {} volumes, {}",
            self.stage_pods.len(),
            rows.len(),
            self.placed_volume_count(),
            human_bytes(self.total_bytes())
        );
        if !self.unplaceable.is_empty() {
            let _ = writeln!(out, "\nUNPLACEABLE ({})", self.unplaceable.len());
            let mut lines: Vec<[String; 3]> =
                vec![["NAMESPACE".into(), "PVC".into(), "REASON".into()]];
            for claim in &self.unplaceable {
                lines.push([
                    claim.namespace.clone(),
                    claim.pvc.clone(),
                    claim.reason.to_string(),
                ]);
            }
            write_columns(&mut out, &lines);
        }
        out
    }
}

/// Up to [`TABLE_NAMESPACES_SHOWN`] namespaces, then how many more.
fn namespace_summary(namespaces: &BTreeSet<&str>) -> String {
    let shown: Vec<&str> = namespaces
        .iter()
        .copied()
        .take(TABLE_NAMESPACES_SHOWN)
        .collect();
    let hidden = namespaces.len() - shown.len();
    if hidden == 0 {
        shown.join(",")
    } else {
        format!("{} +{hidden} more", shown.join(","))
    }
}

fn write_columns<const WIDTH: usize>(out: &mut String, lines: &[[String; WIDTH]]) {
    let mut widths = [0; WIDTH];
    for line in lines {
        for (width, cell) in widths.iter_mut().zip(line) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for line in lines {
        let mut text = String::new();
        for (index, (cell, width)) in line.iter().zip(widths).enumerate() {
            if index + 1 == WIDTH {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}  ");
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_serialises_to_the_documented_json_shape() {
        let plan = StagePlan {
            stage_pods: vec![StagePod {
                namespace: "shop".into(),
                node: "node-a".into(),
                volumes: vec!["data".into()],
                bytes: 10,
            }],
            unplaceable: vec![UnplaceableClaim {
                namespace: "shop".into(),
                pvc: "cache".into(),
                reason: UnplaceableReason::ClaimLost,
            }],
        };
        let json = serde_json::to_value(&plan).expect("plan serialises");
        assert_eq!(
            json,
            serde_json::json!({
                "stagePods": [{"namespace": "shop", "node": "node-a", "volumes": ["data"], "bytes": 10}],
                "unplaceable": [{"namespace": "shop", "pvc": "cache",
                    "reason": "claim is Lost: the volume it was bound to no longer exists"}],
            })
        );
    }

    #[test]
    fn table_summarises_many_namespaces_on_one_node() {
        let plan = StagePlan {
            stage_pods: ["a", "b", "c", "d", "e"]
                .iter()
                .map(|namespace| StagePod {
                    namespace: namespace.to_string(),
                    node: "node-a".into(),
                    volumes: vec!["data".into()],
                    bytes: 1 << 30,
                })
                .collect(),
            unplaceable: Vec::new(),
        };
        let table = plan.to_table();
        assert!(
            table.contains("node-a  5           5        5.0 GiB  a,b,c +2 more"),
            "{table}"
        );
    }

    #[test]
    fn exclusions_read_as_a_list_of_counted_causes() {
        let exclusions = Exclusions {
            cordoned: 1,
            attach_limit_reached: 3,
            driver: Some("ebs.csi.aws.com".into()),
            ..Exclusions::default()
        };
        assert_eq!(
            UnplaceableReason::NoEligibleNode(exclusions).to_string(),
            "no node can take it: 1 node cordoned, 3 nodes at the attach limit of ebs.csi.aws.com"
        );
        assert_eq!(
            Exclusions::default().to_string(),
            "the cluster facts hold no nodes"
        );
    }
}
