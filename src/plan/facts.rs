//! The observed cluster facts the planner works from: plain values, already
//! reduced from Kubernetes objects to what placement needs (see
//! [`crate::dump`] for the conversion from `kubectl get -o yaml`).
//!
//! Facts carry no behaviour beyond small queries (does a node selector match
//! this node, how many bytes does this claim hold) and builder methods that
//! keep tests, benchmarks and fixtures short.

use std::collections::BTreeMap;

/// Label holding a node's zone, used to spread ties across zones.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Everything the planner knows about one cluster.
///
/// The order of every list is irrelevant: the planner sorts what it reads, so
/// the same facts in any order give the same plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterFacts {
    /// Nodes, with readiness, cordon, taints, labels and CSI attach limits.
    pub nodes: Vec<NodeFacts>,
    /// Pods, with their node, phase and the claims they mount.
    pub pods: Vec<PodFacts>,
    /// PersistentVolumeClaims.
    pub claims: Vec<ClaimFacts>,
    /// PersistentVolumes.
    pub volumes: Vec<VolumeFacts>,
    /// Storage classes.
    pub storage_classes: Vec<StorageClassFacts>,
}

/// The effect of a node taint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TaintEffect {
    /// New pods are not scheduled there unless they tolerate it.
    NoSchedule,
    /// The scheduler avoids the node but may still use it.
    PreferNoSchedule,
    /// Running pods that do not tolerate it are evicted.
    NoExecute,
}

impl TaintEffect {
    /// The effect as Kubernetes spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// A node taint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Taint {
    /// Taint key.
    pub key: String,
    /// Taint value, if any.
    pub value: Option<String>,
    /// What the taint does to pods that do not tolerate it.
    pub effect: TaintEffect,
}

impl std::fmt::Display for Taint {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Some(value) => write!(formatter, "{}={}:{}", self.key, value, self.effect.as_str()),
            None => write!(formatter, "{}:{}", self.key, self.effect.as_str()),
        }
    }
}

/// A CSI volume: which driver serves it and its handle in that driver.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CsiVolume {
    /// CSI driver name (for example `ebs.csi.aws.com`).
    pub driver: String,
    /// The driver's volume handle.
    pub handle: String,
}

/// One node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    /// Node name.
    pub name: String,
    /// The `Ready` condition is `True`.
    pub ready: bool,
    /// Cordoned (`spec.unschedulable`).
    pub unschedulable: bool,
    /// Taints on the node.
    pub taints: Vec<Taint>,
    /// Node labels (zone, hostname, ...).
    pub labels: BTreeMap<String, String>,
    /// CSI drivers registered on the node (from its CSINode) with their
    /// attach limit (`allocatable.count`; `None` is unlimited). `None` as a
    /// whole means no CSINode was observed: every driver is assumed present
    /// and unlimited.
    pub csi_drivers: Option<BTreeMap<String, Option<u32>>>,
    /// CSI volumes attached to the node (`status.volumesAttached`).
    pub attached_volumes: Vec<CsiVolume>,
}

impl NodeFacts {
    /// A ready, schedulable, untainted node with no labels and unknown CSI
    /// drivers.
    pub fn new(name: impl Into<String>) -> Self {
        NodeFacts {
            name: name.into(),
            ready: true,
            unschedulable: false,
            taints: Vec::new(),
            labels: BTreeMap::new(),
            csi_drivers: None,
            attached_volumes: Vec::new(),
        }
    }

    /// The same node with its `Ready` condition not `True`.
    pub fn not_ready(mut self) -> Self {
        self.ready = false;
        self
    }

    /// The same node, cordoned.
    pub fn cordoned(mut self) -> Self {
        self.unschedulable = true;
        self
    }

    /// The same node with one more taint (no value).
    pub fn with_taint(mut self, key: impl Into<String>, effect: TaintEffect) -> Self {
        self.taints.push(Taint {
            key: key.into(),
            value: None,
            effect,
        });
        self
    }

    /// The same node with one more label.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// The same node in a zone (sets [`ZONE_LABEL`]).
    pub fn in_zone(self, zone: impl Into<String>) -> Self {
        self.with_label(ZONE_LABEL, zone)
    }

    /// The same node with a CSI driver registered, with an attach limit
    /// (`None` for unlimited).
    pub fn with_csi_driver(mut self, driver: impl Into<String>, limit: Option<u32>) -> Self {
        self.csi_drivers
            .get_or_insert_with(BTreeMap::new)
            .insert(driver.into(), limit);
        self
    }

    /// The same node with one more CSI volume attached.
    pub fn with_attached_volume(
        mut self,
        driver: impl Into<String>,
        handle: impl Into<String>,
    ) -> Self {
        self.attached_volumes.push(CsiVolume {
            driver: driver.into(),
            handle: handle.into(),
        });
        self
    }

    /// The node's zone label, if any.
    pub fn zone(&self) -> Option<&str> {
        self.labels.get(ZONE_LABEL).map(String::as_str)
    }

    /// The first taint with this effect, if any.
    pub fn taint_with_effect(&self, effect: TaintEffect) -> Option<&Taint> {
        self.taints.iter().find(|taint| taint.effect == effect)
    }
}

/// The phase of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PodPhase {
    /// Accepted, containers not all started yet.
    Pending,
    /// Bound to a node, containers running.
    Running,
    /// All containers terminated successfully.
    Succeeded,
    /// All containers terminated, at least one failed.
    Failed,
    /// The node stopped reporting.
    Unknown,
}

impl PodPhase {
    /// Whether a pod in this phase still holds its volumes on its node.
    /// Pending (attaching), Running and Unknown (node silent) pods do;
    /// finished pods do not.
    pub fn holds_volumes(self) -> bool {
        matches!(
            self,
            PodPhase::Pending | PodPhase::Running | PodPhase::Unknown
        )
    }
}

/// One pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// The node it is bound to, if scheduled.
    pub node: Option<String>,
    /// Phase.
    pub phase: PodPhase,
    /// Names of the claims (in the pod's namespace) it mounts, generic
    /// ephemeral volumes included.
    pub claims: Vec<String>,
    /// A haulage stage pod (labelled with [`STAGE_POD_LABELS`]): another
    /// backup or restore moves the volumes it mounts now. While it holds
    /// them they count as load on its node, so that many backups created
    /// at once spread over the nodes instead of all choosing the same one
    /// and queueing under its per-node cap; they do not tie a claim to
    /// that node (the claim is free again once that transfer ends, which
    /// admission waits for).
    pub stage_pod: bool,
}

/// The labels (name, value) every haulage stage pod carries, by which
/// the planner tells stage pods from the workload's pods.
pub const STAGE_POD_LABELS: [(&str, &str); 2] = [
    ("app.kubernetes.io/name", "haulage-agent"),
    ("app.kubernetes.io/component", "stage-pod"),
];

/// Whether a pod with `labels` is a haulage stage pod ([`STAGE_POD_LABELS`]).
pub fn is_stage_pod(labels: Option<&BTreeMap<String, String>>) -> bool {
    STAGE_POD_LABELS.iter().all(|(label, value)| {
        labels
            .and_then(|labels| labels.get(*label))
            .is_some_and(|found| found == value)
    })
}

impl PodFacts {
    /// A running pod on a node, mounting nothing yet.
    pub fn running(
        namespace: impl Into<String>,
        name: impl Into<String>,
        node: impl Into<String>,
    ) -> Self {
        PodFacts {
            namespace: namespace.into(),
            name: name.into(),
            node: Some(node.into()),
            phase: PodPhase::Running,
            claims: Vec::new(),
            stage_pod: false,
        }
    }

    /// The same pod as a haulage stage pod.
    pub fn as_stage_pod(mut self) -> Self {
        self.stage_pod = true;
        self
    }

    /// The same pod in another phase.
    pub fn with_phase(mut self, phase: PodPhase) -> Self {
        self.phase = phase;
        self
    }

    /// The same pod mounting one more claim.
    pub fn mounting(mut self, claim: impl Into<String>) -> Self {
        self.claims.push(claim.into());
        self
    }

    /// Whether this pod keeps its claims attached to its node (scheduled and
    /// not finished).
    pub fn holds_volumes(&self) -> bool {
        self.node.is_some() && self.phase.holds_volumes()
    }
}

/// A volume access mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AccessMode {
    /// Read-write by the pods of one node.
    ReadWriteOnce,
    /// Read-only by many nodes.
    ReadOnlyMany,
    /// Read-write by many nodes.
    ReadWriteMany,
    /// Read-write by a single pod.
    ReadWriteOncePod,
}

impl AccessMode {
    /// The mode as Kubernetes spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::ReadWriteOnce => "ReadWriteOnce",
            AccessMode::ReadOnlyMany => "ReadOnlyMany",
            AccessMode::ReadWriteMany => "ReadWriteMany",
            AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
        }
    }
}

/// The phase of a PersistentVolumeClaim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ClaimPhase {
    /// Not bound to a volume yet.
    Pending,
    /// Bound to a volume.
    Bound,
    /// Its volume is gone.
    Lost,
}

/// One PersistentVolumeClaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimFacts {
    /// Namespace.
    pub namespace: String,
    /// Claim name.
    pub name: String,
    /// Labels, for selection.
    pub labels: BTreeMap<String, String>,
    /// Phase.
    pub phase: ClaimPhase,
    /// Requested size in bytes (`spec.resources.requests.storage`).
    pub requested_bytes: u64,
    /// Bytes actually used, when measured; preferred over the request for
    /// balancing.
    pub measured_bytes: Option<u64>,
    /// Access modes (of the bound volume when bound, else requested).
    pub access_modes: Vec<AccessMode>,
    /// Storage class name.
    pub storage_class: Option<String>,
    /// Name of the bound PersistentVolume.
    pub volume: Option<String>,
}

impl ClaimFacts {
    /// A Bound ReadWriteOnce claim of `bytes` bytes on volume `volume`.
    pub fn bound(
        namespace: impl Into<String>,
        name: impl Into<String>,
        volume: impl Into<String>,
        bytes: u64,
    ) -> Self {
        ClaimFacts {
            namespace: namespace.into(),
            name: name.into(),
            labels: BTreeMap::new(),
            phase: ClaimPhase::Bound,
            requested_bytes: bytes,
            measured_bytes: None,
            access_modes: vec![AccessMode::ReadWriteOnce],
            storage_class: None,
            volume: Some(volume.into()),
        }
    }

    /// The same claim in another phase.
    pub fn with_phase(mut self, phase: ClaimPhase) -> Self {
        self.phase = phase;
        self
    }

    /// The same claim with these access modes.
    pub fn with_access_modes(mut self, modes: impl IntoIterator<Item = AccessMode>) -> Self {
        self.access_modes = modes.into_iter().collect();
        self
    }

    /// The same claim with one more label.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// The same claim with a measured usage.
    pub fn with_measured_bytes(mut self, bytes: u64) -> Self {
        self.measured_bytes = Some(bytes);
        self
    }

    /// The same claim in a storage class.
    pub fn with_storage_class(mut self, class: impl Into<String>) -> Self {
        self.storage_class = Some(class.into());
        self
    }

    /// The bytes this claim weighs for balancing: measured usage when known,
    /// else the request.
    pub fn bytes(&self) -> u64 {
        self.measured_bytes.unwrap_or(self.requested_bytes)
    }

    /// Whether the volume can be mounted from several nodes at once
    /// (ReadWriteMany or ReadOnlyMany among its modes).
    pub fn is_shared(&self) -> bool {
        self.access_modes
            .iter()
            .any(|mode| matches!(mode, AccessMode::ReadWriteMany | AccessMode::ReadOnlyMany))
    }

    /// Whether the volume admits a single pod only (ReadWriteOncePod).
    pub fn is_single_pod(&self) -> bool {
        self.access_modes.contains(&AccessMode::ReadWriteOncePod)
    }
}

/// One PersistentVolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeFacts {
    /// Volume name.
    pub name: String,
    /// Access modes. Informational: placement reads the claim's modes,
    /// which for a bound claim (`status.accessModes`) are the volume's.
    pub access_modes: Vec<AccessMode>,
    /// The CSI driver and handle, for CSI volumes (attach limits apply).
    pub csi: Option<CsiVolume>,
    /// Required node affinity (local volumes, zonal disks).
    pub node_affinity: Option<NodeSelector>,
}

impl VolumeFacts {
    /// A volume with no CSI source and no node affinity.
    pub fn new(name: impl Into<String>) -> Self {
        VolumeFacts {
            name: name.into(),
            access_modes: vec![AccessMode::ReadWriteOnce],
            csi: None,
            node_affinity: None,
        }
    }

    /// The same volume served by a CSI driver.
    pub fn with_csi(mut self, driver: impl Into<String>, handle: impl Into<String>) -> Self {
        self.csi = Some(CsiVolume {
            driver: driver.into(),
            handle: handle.into(),
        });
        self
    }

    /// The same volume with a required node affinity.
    pub fn with_node_affinity(mut self, selector: NodeSelector) -> Self {
        self.node_affinity = Some(selector);
        self
    }
}

/// When a storage class binds (and provisions) a new claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BindingMode {
    /// As soon as the claim exists; the provisioner picks the topology.
    Immediate,
    /// When the first pod using it is scheduled; the pod's node decides.
    WaitForFirstConsumer,
}

/// One storage class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageClassFacts {
    /// Class name.
    pub name: String,
    /// Provisioner (the CSI driver name for CSI classes).
    pub provisioner: String,
    /// Volume binding mode.
    pub binding_mode: BindingMode,
    /// Topologies new volumes may be provisioned in (`None`: anywhere).
    pub allowed_topologies: Option<NodeSelector>,
    /// Marked as the cluster default class.
    pub is_default: bool,
}

impl StorageClassFacts {
    /// A class with WaitForFirstConsumer binding and no topology limit.
    pub fn new(name: impl Into<String>, provisioner: impl Into<String>) -> Self {
        StorageClassFacts {
            name: name.into(),
            provisioner: provisioner.into(),
            binding_mode: BindingMode::WaitForFirstConsumer,
            allowed_topologies: None,
            is_default: false,
        }
    }

    /// The CSI driver whose attach limits new volumes of this class count
    /// against: the provisioner, unless it is an in-tree
    /// (`kubernetes.io/...`) one.
    pub fn csi_driver(&self) -> Option<&str> {
        if self.provisioner.starts_with("kubernetes.io/") {
            None
        } else {
            Some(&self.provisioner)
        }
    }
}

/// What a node requirement looks at.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RequirementSubject {
    /// A node label (`matchExpressions`).
    Label(String),
    /// The node name (`matchFields` on `metadata.name`).
    NodeName,
}

/// A node selector operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SelectorOperator {
    /// The value is one of the values.
    In,
    /// The value is none of the values (or absent).
    NotIn,
    /// The label exists.
    Exists,
    /// The label does not exist.
    DoesNotExist,
    /// The value, as an integer, is greater than the single value.
    GreaterThan,
    /// The value, as an integer, is less than the single value.
    LessThan,
}

/// One requirement of a node selector term.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeRequirement {
    /// What is compared.
    pub subject: RequirementSubject,
    /// How.
    pub operator: SelectorOperator,
    /// Against what.
    pub values: Vec<String>,
}

impl NodeRequirement {
    /// Whether a node satisfies this requirement.
    pub fn matches(&self, node: &NodeFacts) -> bool {
        let value = match &self.subject {
            RequirementSubject::Label(key) => node.labels.get(key).map(String::as_str),
            RequirementSubject::NodeName => Some(node.name.as_str()),
        };
        match self.operator {
            SelectorOperator::In => {
                value.is_some_and(|value| self.values.iter().any(|v| v == value))
            }
            SelectorOperator::NotIn => {
                value.is_none_or(|value| self.values.iter().all(|v| v != value))
            }
            SelectorOperator::Exists => value.is_some(),
            SelectorOperator::DoesNotExist => value.is_none(),
            SelectorOperator::GreaterThan | SelectorOperator::LessThan => {
                let (Some(value), [bound]) = (value, self.values.as_slice()) else {
                    return false;
                };
                match (value.parse::<i64>(), bound.parse::<i64>()) {
                    (Ok(value), Ok(bound)) if self.operator == SelectorOperator::GreaterThan => {
                        value > bound
                    }
                    (Ok(value), Ok(bound)) => value < bound,
                    _ => false,
                }
            }
        }
    }
}

/// A term of a node selector: all its requirements must hold. A term with no
/// requirements matches no node, as in Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeSelectorTerm {
    /// Requirements, all of which must hold.
    pub requirements: Vec<NodeRequirement>,
}

/// A node selector: a node matches when any term matches. Used for PV node
/// affinity and for storage-class allowed topologies.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeSelector {
    /// Terms, any of which may match.
    pub terms: Vec<NodeSelectorTerm>,
}

impl NodeSelector {
    /// A selector matching the named nodes only (local volumes).
    pub fn node_names<Name: Into<String>>(names: impl IntoIterator<Item = Name>) -> Self {
        NodeSelector {
            terms: vec![NodeSelectorTerm {
                requirements: vec![NodeRequirement {
                    subject: RequirementSubject::NodeName,
                    operator: SelectorOperator::In,
                    values: names.into_iter().map(Into::into).collect(),
                }],
            }],
        }
    }

    /// A selector matching nodes whose label `key` is one of `values`
    /// (zonal disks).
    pub fn label_in<Value: Into<String>>(
        key: impl Into<String>,
        values: impl IntoIterator<Item = Value>,
    ) -> Self {
        NodeSelector {
            terms: vec![NodeSelectorTerm {
                requirements: vec![NodeRequirement {
                    subject: RequirementSubject::Label(key.into()),
                    operator: SelectorOperator::In,
                    values: values.into_iter().map(Into::into).collect(),
                }],
            }],
        }
    }

    /// Whether a node satisfies the selector.
    pub fn matches(&self, node: &NodeFacts) -> bool {
        self.terms.iter().any(|term| {
            !term.requirements.is_empty()
                && term
                    .requirements
                    .iter()
                    .all(|requirement| requirement.matches(node))
        })
    }
}

/// The minimum a namespace's LimitRange sets for containers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceMinimum {
    /// Minimum CPU in millicores.
    pub cpu_millis: Option<u64>,
    /// Minimum memory in bytes.
    pub memory_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_selector_term_without_requirements_matches_nothing() {
        let selector = NodeSelector {
            terms: vec![NodeSelectorTerm {
                requirements: Vec::new(),
            }],
        };
        assert!(!selector.matches(&NodeFacts::new("a")));
    }

    #[test]
    fn node_selector_matches_any_term() {
        let selector = NodeSelector {
            terms: vec![
                NodeSelector::node_names(["a"]).terms[0].clone(),
                NodeSelector::label_in(ZONE_LABEL, ["z1"]).terms[0].clone(),
            ],
        };
        assert!(selector.matches(&NodeFacts::new("a")));
        assert!(selector.matches(&NodeFacts::new("b").in_zone("z1")));
        assert!(!selector.matches(&NodeFacts::new("b").in_zone("z2")));
    }

    #[test]
    fn greater_than_compares_integers_and_rejects_non_integers() {
        let requirement = NodeRequirement {
            subject: RequirementSubject::Label("cores".into()),
            operator: SelectorOperator::GreaterThan,
            values: vec!["8".into()],
        };
        assert!(requirement.matches(&NodeFacts::new("a").with_label("cores", "16")));
        assert!(!requirement.matches(&NodeFacts::new("a").with_label("cores", "4")));
        assert!(!requirement.matches(&NodeFacts::new("a").with_label("cores", "many")));
        assert!(!requirement.matches(&NodeFacts::new("a")));
    }

    #[test]
    fn not_in_matches_nodes_without_the_label() {
        let requirement = NodeRequirement {
            subject: RequirementSubject::Label(ZONE_LABEL.into()),
            operator: SelectorOperator::NotIn,
            values: vec!["z1".into()],
        };
        assert!(requirement.matches(&NodeFacts::new("a")));
        assert!(!requirement.matches(&NodeFacts::new("a").in_zone("z1")));
    }
}
