//! Kubernetes objects into planner facts: from the text of
//! `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml` (a v1
//! List, YAML or JSON) via [`parse_dump`], or from already typed objects
//! (the controller's informer caches) via [`facts_from_objects`].
//!
//! Pure: the caller reads the file. Every problem with the input is a
//! [`DumpError`] naming the object and the field; nothing here panics on
//! what the dump holds. Kinds the planner does not use are skipped.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::core::v1::{LimitRange, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::facts::ResourceMinimum;
use crate::facts::{
    AccessMode, BindingMode, ClaimFacts, ClaimPhase, ClusterFacts, CsiVolume, NodeFacts,
    NodeRequirement, NodeSelector, NodeSelectorTerm, PodFacts, PodPhase, RequirementSubject,
    SelectorOperator, StorageClassFacts, Taint, TaintEffect, VolumeFacts,
};
use crate::quantity::{parse_millis, parse_quantity};

/// Annotation marking the cluster's default storage class.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";
/// Prefix of CSI volumes in a node's `status.volumesAttached` names
/// (`kubernetes.io/csi/<driver>^<handle>`).
const CSI_ATTACHED_PREFIX: &str = "kubernetes.io/csi/";

/// A dump or object the planner cannot read.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// Not YAML or JSON at all.
    #[error("the dump is not valid YAML or JSON")]
    Syntax {
        /// Parser error, with line and column.
        #[source]
        source: serde_yaml::Error,
    },
    /// A YAML alias (`*name`): kubectl never writes one, and an alias of
    /// aliases expands without bound when read (the "billion laughs"), so a
    /// dump that has one is refused before it is expanded.
    #[error(
        "the dump uses a YAML alias at line {line}, which kubectl never writes: give the unedited output of `kubectl get ... -o yaml` (or `-o json`)"
    )]
    Alias {
        /// Line of the alias, from 1.
        line: usize,
    },
    /// Text the alias and depth check cannot read to its end: what follows
    /// the error could hold an alias, so the dump is refused rather than
    /// given to the parser that expands aliases.
    #[error(
        "the dump is not valid YAML at line {line}, column {column} ({message}): give the unedited output of `kubectl get ... -o yaml` (or `-o json`)"
    )]
    Unreadable {
        /// Line of the error, from 1.
        line: usize,
        /// Column of the error, from 1.
        column: usize,
        /// What the scanner found.
        message: String,
    },
    /// Nested deeper than [`MAX_DUMP_DEPTH`].
    #[error(
        "the dump nests deeper than {MAX_DUMP_DEPTH} levels at line {line}, which no Kubernetes object list does"
    )]
    TooDeep {
        /// Line where it went too deep, from 1.
        line: usize,
    },
    /// Valid YAML, but not a list of objects.
    #[error(
        "the dump is {found}, not a v1 List (expected the output of `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml`)"
    )]
    NotAList {
        /// What was found instead.
        found: String,
    },
    /// A list item without a kind, in a list that does not imply one.
    #[error("item {index} of the list has no kind")]
    ItemWithoutKind {
        /// Position in `items`, from 0.
        index: usize,
    },
    /// A list item that does not match its kind's schema.
    #[error("item {index} ({kind} {name}) does not match the {kind} schema")]
    ItemUnreadable {
        /// Position in `items`, from 0.
        index: usize,
        /// Its kind.
        kind: String,
        /// Its name, or `<unnamed>`.
        name: String,
        /// Schema error.
        #[source]
        source: serde_yaml::Error,
    },
    /// A required field is absent.
    #[error("{object}: {field} is missing")]
    MissingField {
        /// Kind and name of the object (`PersistentVolumeClaim shop/data`).
        object: String,
        /// Path of the field.
        field: &'static str,
    },
    /// A field holds a value the planner cannot use.
    #[error("{object}: {field} has invalid value {value:?}: {problem}")]
    InvalidField {
        /// Kind and name of the object.
        object: String,
        /// Path of the field.
        field: &'static str,
        /// The value found.
        value: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The same object twice.
    #[error("{object} appears twice in the dump")]
    Duplicate {
        /// Kind and name of the object.
        object: String,
    },
}

/// Typed Kubernetes objects, as a dump or informer caches hold them.
#[derive(Debug, Clone, Default)]
pub struct ClusterObjects {
    /// Nodes.
    pub nodes: Vec<Node>,
    /// CSINodes (one per node that runs CSI drivers).
    pub csi_nodes: Vec<CSINode>,
    /// Pods.
    pub pods: Vec<Pod>,
    /// PersistentVolumeClaims.
    pub claims: Vec<PersistentVolumeClaim>,
    /// PersistentVolumes.
    pub volumes: Vec<PersistentVolume>,
    /// Storage classes.
    pub storage_classes: Vec<StorageClass>,
    /// LimitRanges (not planner facts; used for stage-pod requests).
    pub limit_ranges: Vec<LimitRange>,
}

/// Parse the text of a `kubectl get ... -o yaml` (or `-o json`) dump.
pub fn parse_dump(text: &str) -> Result<ClusterFacts, DumpError> {
    facts_from_objects(&parse_objects(text)?)
}

/// Parse the text of a dump into typed objects, skipping kinds the planner
/// does not use.
pub fn parse_objects(text: &str) -> Result<ClusterObjects, DumpError> {
    refuse_aliases_and_depth(text)?;
    let document: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|source| DumpError::Syntax { source })?;
    let list_kind = document
        .get("kind")
        .and_then(serde_yaml::Value::as_str)
        .unwrap_or("");
    let Some(items) = document
        .get("items")
        .and_then(serde_yaml::Value::as_sequence)
    else {
        let found = match list_kind {
            "" => "not a Kubernetes object list".to_string(),
            kind => format!("a single {kind}"),
        };
        return Err(DumpError::NotAList { found });
    };
    // `kubectl get -o yaml` writes each item's kind; a raw API list
    // (`PodList`) does not, its name implies it.
    let implied_kind = list_kind
        .strip_suffix("List")
        .filter(|kind| !kind.is_empty());
    let mut objects = ClusterObjects::default();
    for (index, item) in items.iter().enumerate() {
        let kind = item
            .get("kind")
            .and_then(serde_yaml::Value::as_str)
            .or(implied_kind)
            .ok_or(DumpError::ItemWithoutKind { index })?;
        let unreadable = |source| DumpError::ItemUnreadable {
            index,
            kind: kind.to_string(),
            name: item_name(item),
            source,
        };
        let value = item.clone();
        match kind {
            "Node" => objects
                .nodes
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            "CSINode" => objects
                .csi_nodes
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            "Pod" => objects
                .pods
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            "PersistentVolumeClaim" => objects
                .claims
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            "PersistentVolume" => objects
                .volumes
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            "StorageClass" => objects
                .storage_classes
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            "LimitRange" => objects
                .limit_ranges
                .push(serde_yaml::from_value(value).map_err(unreadable)?),
            _ => {}
        }
    }
    Ok(objects)
}

/// An error at the first YAML alias in `text`, where it nests deeper than
/// any dump does, or where it cannot be read (what follows could hold an
/// alias: refused, not given to the parser that expands them). Read event
/// by event (no recursion, so no depth of input overflows the stack).
fn refuse_aliases_and_depth(text: &str) -> Result<(), DumpError> {
    use yaml_rust2::Event;
    let mut parser = yaml_rust2::parser::Parser::new_from_str(text);
    let mut depth = 0usize;
    loop {
        let (event, mark) = parser.next_token().map_err(|error| DumpError::Unreadable {
            line: error.marker().line(),
            column: error.marker().col() + 1,
            message: error.info().to_string(),
        })?;
        match event {
            Event::Alias(_) => return Err(DumpError::Alias { line: mark.line() }),
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                depth += 1;
                if depth > MAX_DUMP_DEPTH {
                    return Err(DumpError::TooDeep { line: mark.line() });
                }
            }
            Event::SequenceEnd | Event::MappingEnd => depth = depth.saturating_sub(1),
            Event::StreamEnd => return Ok(()),
            _ => {}
        }
    }
}

/// Nesting no Kubernetes object list comes near (a pod spec is about 12
/// levels deep); serde_yaml refuses deeper than 128 too.
const MAX_DUMP_DEPTH: usize = 100;

/// The storage class of a claim: `spec.storageClassName`, or the beta
/// annotation older claims carry.
pub fn claim_storage_class(claim: &PersistentVolumeClaim) -> Option<String> {
    claim
        .spec
        .as_ref()
        .and_then(|spec| spec.storage_class_name.clone())
        .or_else(|| {
            claim
                .metadata
                .annotations
                .as_ref()
                .and_then(|annotations| annotations.get("volume.beta.kubernetes.io/storage-class"))
                .cloned()
        })
}

fn item_name(item: &serde_yaml::Value) -> String {
    let metadata = item.get("metadata");
    let field = |key: &str| {
        metadata
            .and_then(|metadata| metadata.get(key))
            .and_then(serde_yaml::Value::as_str)
    };
    match (field("namespace"), field("name")) {
        (Some(namespace), Some(name)) => format!("{namespace}/{name}"),
        (None, Some(name)) => name.to_string(),
        _ => "<unnamed>".to_string(),
    }
}

/// Convert typed objects into planner facts.
pub fn facts_from_objects(objects: &ClusterObjects) -> Result<ClusterFacts, DumpError> {
    let mut csi_drivers: HashMap<&str, BTreeMap<String, Option<u32>>> = HashMap::new();
    for csi_node in &objects.csi_nodes {
        let (name, drivers) = csi_driver_limits(csi_node)?;
        if csi_drivers.insert(name, drivers).is_some() {
            return Err(DumpError::Duplicate {
                object: format!("CSINode {name}"),
            });
        }
    }
    let mut facts = ClusterFacts::default();
    let mut seen = HashSet::new();
    for node in &objects.nodes {
        let converted = node_facts(node, None)?;
        if !seen.insert(("Node", String::new(), converted.name.clone())) {
            return Err(DumpError::Duplicate {
                object: format!("Node {}", converted.name),
            });
        }
        let drivers = csi_drivers.remove(converted.name.as_str());
        facts.nodes.push(NodeFacts {
            csi_drivers: drivers,
            ..converted
        });
    }
    for pod in &objects.pods {
        let converted = pod_facts(pod)?;
        if !seen.insert(("Pod", converted.namespace.clone(), converted.name.clone())) {
            return Err(DumpError::Duplicate {
                object: format!("Pod {}/{}", converted.namespace, converted.name),
            });
        }
        facts.pods.push(converted);
    }
    for claim in &objects.claims {
        let converted = claim_facts(claim)?;
        if !seen.insert((
            "PersistentVolumeClaim",
            converted.namespace.clone(),
            converted.name.clone(),
        )) {
            return Err(DumpError::Duplicate {
                object: format!(
                    "PersistentVolumeClaim {}/{}",
                    converted.namespace, converted.name
                ),
            });
        }
        facts.claims.push(converted);
    }
    for volume in &objects.volumes {
        let converted = volume_facts(volume)?;
        if !seen.insert(("PersistentVolume", String::new(), converted.name.clone())) {
            return Err(DumpError::Duplicate {
                object: format!("PersistentVolume {}", converted.name),
            });
        }
        facts.volumes.push(converted);
    }
    for class in &objects.storage_classes {
        let converted = storage_class_facts(class)?;
        if !seen.insert(("StorageClass", String::new(), converted.name.clone())) {
            return Err(DumpError::Duplicate {
                object: format!("StorageClass {}", converted.name),
            });
        }
        facts.storage_classes.push(converted);
    }
    Ok(facts)
}

fn required_name<'o>(kind: &str, metadata: &'o ObjectMeta) -> Result<&'o str, DumpError> {
    metadata
        .name
        .as_deref()
        .filter(|name| !name.is_empty())
        .ok_or_else(|| DumpError::MissingField {
            object: format!("{kind} <unnamed>"),
            field: "metadata.name",
        })
}

/// `(namespace, name, "Kind namespace/name")` of a namespaced object.
fn namespaced_identity<'o>(
    kind: &str,
    metadata: &'o ObjectMeta,
) -> Result<(&'o str, &'o str, String), DumpError> {
    let name = required_name(kind, metadata)?;
    let namespace = metadata
        .namespace
        .as_deref()
        .filter(|namespace| !namespace.is_empty())
        .ok_or_else(|| DumpError::MissingField {
            object: format!("{kind} {name}"),
            field: "metadata.namespace",
        })?;
    Ok((namespace, name, format!("{kind} {namespace}/{name}")))
}

/// The node name of a CSINode and its drivers' attach limits.
fn csi_driver_limits(
    csi_node: &CSINode,
) -> Result<(&str, BTreeMap<String, Option<u32>>), DumpError> {
    let name = required_name("CSINode", &csi_node.metadata)?;
    let mut drivers = BTreeMap::new();
    for driver in &csi_node.spec.drivers {
        let limit = driver
            .allocatable
            .as_ref()
            .and_then(|resources| resources.count)
            .map(|count| {
                u32::try_from(count).map_err(|_| DumpError::InvalidField {
                    object: format!("CSINode {name}"),
                    field: "spec.drivers[].allocatable.count",
                    value: count.to_string(),
                    problem: "an attach limit cannot be negative".to_string(),
                })
            })
            .transpose()?;
        drivers.insert(driver.name.clone(), limit);
    }
    Ok((name, drivers))
}

/// Convert a Node (and its CSINode, when known) into facts.
pub fn node_facts(node: &Node, csi_node: Option<&CSINode>) -> Result<NodeFacts, DumpError> {
    let name = required_name("Node", &node.metadata)?;
    let object = format!("Node {name}");
    let spec = node.spec.as_ref();
    let status = node.status.as_ref();
    let ready = status
        .and_then(|status| status.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|condition| condition.type_ == "Ready" && condition.status == "True");
    let mut taints = Vec::new();
    for taint in spec
        .and_then(|spec| spec.taints.as_ref())
        .into_iter()
        .flatten()
    {
        let effect = match taint.effect.as_str() {
            "NoSchedule" => TaintEffect::NoSchedule,
            "PreferNoSchedule" => TaintEffect::PreferNoSchedule,
            "NoExecute" => TaintEffect::NoExecute,
            other => {
                return Err(DumpError::InvalidField {
                    object,
                    field: "spec.taints[].effect",
                    value: other.to_string(),
                    problem: "expected NoSchedule, PreferNoSchedule or NoExecute".to_string(),
                });
            }
        };
        taints.push(Taint {
            key: taint.key.clone(),
            value: taint.value.clone().filter(|value| !value.is_empty()),
            effect,
        });
    }
    let attached_volumes = status
        .and_then(|status| status.volumes_attached.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|attached| {
            let (driver, handle) = attached
                .name
                .strip_prefix(CSI_ATTACHED_PREFIX)?
                .split_once('^')?;
            Some(CsiVolume {
                driver: driver.to_string(),
                handle: handle.to_string(),
            })
        })
        .collect();
    let csi_drivers = match csi_node {
        None => None,
        Some(csi_node) => Some(csi_driver_limits(csi_node)?.1),
    };
    Ok(NodeFacts {
        name: name.to_string(),
        ready,
        unschedulable: spec.and_then(|spec| spec.unschedulable).unwrap_or(false),
        taints,
        labels: node.metadata.labels.clone().unwrap_or_default(),
        csi_drivers,
        attached_volumes,
    })
}

/// Convert a Pod into facts: its node, phase, and the claims it mounts
/// (generic ephemeral volumes are claims named `<pod>-<volume>`).
pub fn pod_facts(pod: &Pod) -> Result<PodFacts, DumpError> {
    let (namespace, name, object) = namespaced_identity("Pod", &pod.metadata)?;
    let spec = pod.spec.as_ref();
    let phase = match pod
        .status
        .as_ref()
        .and_then(|status| status.phase.as_deref())
    {
        None | Some("Pending") => PodPhase::Pending,
        Some("Running") => PodPhase::Running,
        Some("Succeeded") => PodPhase::Succeeded,
        Some("Failed") => PodPhase::Failed,
        Some("Unknown") => PodPhase::Unknown,
        Some(other) => {
            return Err(DumpError::InvalidField {
                object,
                field: "status.phase",
                value: other.to_string(),
                problem: "expected Pending, Running, Succeeded, Failed or Unknown".to_string(),
            });
        }
    };
    let claims = spec
        .and_then(|spec| spec.volumes.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|volume: &core::Volume| {
            if let Some(claim) = &volume.persistent_volume_claim {
                Some(claim.claim_name.clone())
            } else {
                volume
                    .ephemeral
                    .as_ref()
                    .map(|_| format!("{name}-{}", volume.name))
            }
        })
        .collect();
    let stage_pod = crate::facts::is_stage_pod(pod.metadata.labels.as_ref());
    Ok(PodFacts {
        namespace: namespace.to_string(),
        name: name.to_string(),
        node: spec
            .and_then(|spec| spec.node_name.clone())
            .filter(|node| !node.is_empty()),
        phase,
        claims,
        stage_pod,
    })
}

fn access_modes(
    object: &str,
    field: &'static str,
    modes: &[String],
) -> Result<Vec<AccessMode>, DumpError> {
    modes
        .iter()
        .map(|mode| match mode.as_str() {
            "ReadWriteOnce" => Ok(AccessMode::ReadWriteOnce),
            "ReadOnlyMany" => Ok(AccessMode::ReadOnlyMany),
            "ReadWriteMany" => Ok(AccessMode::ReadWriteMany),
            "ReadWriteOncePod" => Ok(AccessMode::ReadWriteOncePod),
            other => Err(DumpError::InvalidField {
                object: object.to_string(),
                field,
                value: other.to_string(),
                problem: "expected ReadWriteOnce, ReadOnlyMany, ReadWriteMany or ReadWriteOncePod"
                    .to_string(),
            }),
        })
        .collect()
}

/// Convert a PersistentVolumeClaim into facts.
pub fn claim_facts(claim: &PersistentVolumeClaim) -> Result<ClaimFacts, DumpError> {
    let (namespace, name, object) = namespaced_identity("PersistentVolumeClaim", &claim.metadata)?;
    let spec = claim.spec.as_ref().ok_or_else(|| DumpError::MissingField {
        object: object.clone(),
        field: "spec",
    })?;
    let status = claim.status.as_ref();
    let phase = match status.and_then(|status| status.phase.as_deref()) {
        None | Some("Pending") => ClaimPhase::Pending,
        Some("Bound") => ClaimPhase::Bound,
        Some("Lost") => ClaimPhase::Lost,
        Some(other) => {
            return Err(DumpError::InvalidField {
                object,
                field: "status.phase",
                value: other.to_string(),
                problem: "expected Pending, Bound or Lost".to_string(),
            });
        }
    };
    let storage = spec
        .resources
        .as_ref()
        .and_then(|resources| resources.requests.as_ref())
        .and_then(|requests| requests.get("storage"))
        .ok_or_else(|| DumpError::MissingField {
            object: object.clone(),
            field: "spec.resources.requests.storage",
        })?;
    let requested_bytes = parse_quantity(&storage.0).map_err(|error| DumpError::InvalidField {
        object: object.clone(),
        field: "spec.resources.requests.storage",
        value: storage.0.clone(),
        problem: error.problem.to_string(),
    })?;
    let status_modes = status
        .and_then(|status| status.access_modes.as_deref())
        .filter(|modes| !modes.is_empty());
    let access_modes = match status_modes {
        Some(modes) => access_modes(&object, "status.accessModes", modes)?,
        None => access_modes(
            &object,
            "spec.accessModes",
            spec.access_modes.as_deref().unwrap_or(&[]),
        )?,
    };
    let storage_class = claim_storage_class(claim);
    Ok(ClaimFacts {
        namespace: namespace.to_string(),
        name: name.to_string(),
        labels: claim.metadata.labels.clone().unwrap_or_default(),
        phase,
        requested_bytes,
        measured_bytes: None,
        access_modes,
        storage_class,
        volume: spec.volume_name.clone().filter(|volume| !volume.is_empty()),
    })
}

fn node_selector_requirement(
    object: &str,
    field: &'static str,
    subject: RequirementSubject,
    requirement: &core::NodeSelectorRequirement,
) -> Result<NodeRequirement, DumpError> {
    let operator = match requirement.operator.as_str() {
        "In" => SelectorOperator::In,
        "NotIn" => SelectorOperator::NotIn,
        "Exists" => SelectorOperator::Exists,
        "DoesNotExist" => SelectorOperator::DoesNotExist,
        "Gt" => SelectorOperator::GreaterThan,
        "Lt" => SelectorOperator::LessThan,
        other => {
            return Err(DumpError::InvalidField {
                object: object.to_string(),
                field,
                value: other.to_string(),
                problem: "expected In, NotIn, Exists, DoesNotExist, Gt or Lt".to_string(),
            });
        }
    };
    Ok(NodeRequirement {
        subject,
        operator,
        values: requirement.values.clone().unwrap_or_default(),
    })
}

/// Convert a PersistentVolume into facts.
pub fn volume_facts(volume: &PersistentVolume) -> Result<VolumeFacts, DumpError> {
    let name = required_name("PersistentVolume", &volume.metadata)?;
    let object = format!("PersistentVolume {name}");
    let spec = volume
        .spec
        .as_ref()
        .ok_or_else(|| DumpError::MissingField {
            object: object.clone(),
            field: "spec",
        })?;
    let node_affinity = match spec
        .node_affinity
        .as_ref()
        .and_then(|affinity| affinity.required.as_ref())
    {
        None => None,
        Some(selector) => {
            let mut terms = Vec::new();
            for term in &selector.node_selector_terms {
                let mut requirements = Vec::new();
                for requirement in term.match_expressions.iter().flatten() {
                    requirements.push(node_selector_requirement(
                        &object,
                        "spec.nodeAffinity.required.nodeSelectorTerms[].matchExpressions[].operator",
                        RequirementSubject::Label(requirement.key.clone()),
                        requirement,
                    )?);
                }
                for requirement in term.match_fields.iter().flatten() {
                    if requirement.key != "metadata.name" {
                        return Err(DumpError::InvalidField {
                            object,
                            field: "spec.nodeAffinity.required.nodeSelectorTerms[].matchFields[].key",
                            value: requirement.key.clone(),
                            problem: "only metadata.name can be matched as a field".to_string(),
                        });
                    }
                    requirements.push(node_selector_requirement(
                        &object,
                        "spec.nodeAffinity.required.nodeSelectorTerms[].matchFields[].operator",
                        RequirementSubject::NodeName,
                        requirement,
                    )?);
                }
                terms.push(NodeSelectorTerm { requirements });
            }
            Some(NodeSelector { terms })
        }
    };
    Ok(VolumeFacts {
        name: name.to_string(),
        access_modes: access_modes(
            &object,
            "spec.accessModes",
            spec.access_modes.as_deref().unwrap_or(&[]),
        )?,
        csi: spec.csi.as_ref().map(|csi| CsiVolume {
            driver: csi.driver.clone(),
            handle: csi.volume_handle.clone(),
        }),
        node_affinity,
    })
}

/// Convert a StorageClass into facts.
pub fn storage_class_facts(class: &StorageClass) -> Result<StorageClassFacts, DumpError> {
    let name = required_name("StorageClass", &class.metadata)?;
    let object = format!("StorageClass {name}");
    let binding_mode = match class.volume_binding_mode.as_deref() {
        None | Some("Immediate") => BindingMode::Immediate,
        Some("WaitForFirstConsumer") => BindingMode::WaitForFirstConsumer,
        Some(other) => {
            return Err(DumpError::InvalidField {
                object,
                field: "volumeBindingMode",
                value: other.to_string(),
                problem: "expected Immediate or WaitForFirstConsumer".to_string(),
            });
        }
    };
    let allowed_topologies = class
        .allowed_topologies
        .as_ref()
        .filter(|terms| !terms.is_empty())
        .map(|terms| NodeSelector {
            terms: terms
                .iter()
                .map(|term| NodeSelectorTerm {
                    requirements: term
                        .match_label_expressions
                        .iter()
                        .flatten()
                        .map(|expression| NodeRequirement {
                            subject: RequirementSubject::Label(expression.key.clone()),
                            operator: SelectorOperator::In,
                            values: expression.values.clone(),
                        })
                        .collect(),
                })
                .collect(),
        });
    let is_default = class
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|annotations| {
            [
                DEFAULT_CLASS_ANNOTATION,
                "storageclass.beta.kubernetes.io/is-default-class",
            ]
            .iter()
            .any(|key| annotations.get(*key).map(String::as_str) == Some("true"))
        });
    Ok(StorageClassFacts {
        name: name.to_string(),
        provisioner: class.provisioner.clone(),
        binding_mode,
        allowed_topologies,
        is_default,
    })
}

/// The container minimum a LimitRange sets (the largest over its
/// `Container` items), for stage-pod requests.
pub fn limit_range_minimum(limit_range: &LimitRange) -> Result<ResourceMinimum, DumpError> {
    let (_, _, object) = namespaced_identity("LimitRange", &limit_range.metadata)?;
    let mut minimum = ResourceMinimum::default();
    let items = limit_range
        .spec
        .as_ref()
        .map(|spec| spec.limits.as_slice())
        .unwrap_or(&[]);
    for item in items.iter().filter(|item| item.type_ == "Container") {
        let Some(min) = &item.min else { continue };
        if let Some(cpu) = min.get("cpu") {
            let millis = parse_millis(&cpu.0).map_err(|error| DumpError::InvalidField {
                object: object.clone(),
                field: "spec.limits[].min.cpu",
                value: cpu.0.clone(),
                problem: error.problem.to_string(),
            })?;
            minimum.cpu_millis = Some(minimum.cpu_millis.unwrap_or(0).max(millis));
        }
        if let Some(memory) = min.get("memory") {
            let bytes = parse_quantity(&memory.0).map_err(|error| DumpError::InvalidField {
                object: object.clone(),
                field: "spec.limits[].min.memory",
                value: memory.0.clone(),
                problem: error.problem.to_string(),
            })?;
            minimum.memory_bytes = Some(minimum.memory_bytes.unwrap_or(0).max(bytes));
        }
    }
    Ok(minimum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_with_a_yaml_alias_or_absurd_nesting_is_refused_naming_the_line() {
        let aliased = "apiVersion: v1\nkind: List\nbase: &base {a: 1}\nitems:\n- *base\n";
        let error = parse_dump(aliased).expect_err("an alias");
        assert!(matches!(error, DumpError::Alias { line: 5 }), "{error:?}");
        assert!(error.to_string().contains("line 5"), "{error}");
        let deep = format!("items: {}{}", "[".repeat(120), "]".repeat(120));
        let error = parse_dump(&deep).expect_err("too deep");
        assert!(matches!(error, DumpError::TooDeep { line: 1 }), "{error:?}");
        // `*` and `&` inside quoted values are text, not aliases.
        let quoted = "apiVersion: v1\nkind: List\nitems: []\nnote: \"*not-an-alias &nor-anchor\"\n";
        assert!(parse_dump(quoted).is_ok());
    }

    #[test]
    fn a_pod_with_both_stage_pod_labels_is_a_stage_pod() {
        let facts = parse_dump(
            "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata:
    name: haulage-backup-nightly-a
    namespace: shop
    labels: {app.kubernetes.io/name: haulage-agent, app.kubernetes.io/component: stage-pod}
  spec: {nodeName: a}
  status: {phase: Running}
- apiVersion: v1
  kind: Pod
  metadata:
    name: db-0
    namespace: shop
    labels: {app.kubernetes.io/component: stage-pod}
  spec: {nodeName: a}
  status: {phase: Running}
",
        )
        .expect("dump parses");
        let stage_pods: Vec<(&str, bool)> = facts
            .pods
            .iter()
            .map(|pod| (pod.name.as_str(), pod.stage_pod))
            .collect();
        assert_eq!(
            stage_pods,
            [("haulage-backup-nightly-a", true), ("db-0", false)]
        );
    }

    #[test]
    fn limit_range_minimum_takes_the_largest_container_minimum() {
        let objects = parse_objects(
            "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: LimitRange
  metadata: {name: floor, namespace: shop}
  spec:
    limits:
    - {type: Container, min: {cpu: 200m, memory: 256Mi}}
    - {type: Container, min: {cpu: 50m}}
    - {type: Pod, min: {cpu: '4'}}
",
        )
        .expect("dump parses");
        let minimum = limit_range_minimum(&objects.limit_ranges[0]).expect("limit range converts");
        assert_eq!(
            minimum,
            ResourceMinimum {
                cpu_millis: Some(200),
                memory_bytes: Some(256 << 20),
            }
        );
    }

    #[test]
    fn storage_class_keeps_binding_mode_topologies_and_default_mark() {
        let facts = parse_dump(
            "apiVersion: v1
kind: List
items:
- apiVersion: storage.k8s.io/v1
  kind: StorageClass
  metadata:
    name: zonal
    annotations: {storageclass.kubernetes.io/is-default-class: 'true'}
  provisioner: ebs.csi.aws.com
  volumeBindingMode: WaitForFirstConsumer
  allowedTopologies:
  - matchLabelExpressions:
    - {key: topology.kubernetes.io/zone, values: [z1, z2]}
",
        )
        .expect("dump parses");
        let class = &facts.storage_classes[0];
        assert_eq!(class.binding_mode, BindingMode::WaitForFirstConsumer);
        assert!(class.is_default);
        let topology = class.allowed_topologies.as_ref().expect("topologies");
        assert!(topology.matches(&NodeFacts::new("a").in_zone("z2")));
        assert!(!topology.matches(&NodeFacts::new("a").in_zone("z3")));
    }

    #[test]
    fn node_reads_readiness_cordon_and_attached_csi_volumes() {
        let facts = parse_dump(
            "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: a}
  spec: {unschedulable: true}
  status:
    conditions: [{type: Ready, status: 'True'}]
    volumesAttached:
    - {name: kubernetes.io/csi/ebs.csi.aws.com^vol-1, devicePath: ''}
    - {name: kubernetes.io/aws-ebs/aws://eu-1a/vol-2, devicePath: /dev/xvdb}
- apiVersion: storage.k8s.io/v1
  kind: CSINode
  metadata: {name: a}
  spec:
    drivers: [{name: ebs.csi.aws.com, nodeID: i-1, allocatable: {count: 25}}]
",
        )
        .expect("dump parses");
        let node = &facts.nodes[0];
        assert!(node.ready && node.unschedulable);
        assert_eq!(
            node.attached_volumes,
            [CsiVolume {
                driver: "ebs.csi.aws.com".into(),
                handle: "vol-1".into(),
            }]
        );
        assert_eq!(
            node.csi_drivers,
            Some(BTreeMap::from([("ebs.csi.aws.com".to_string(), Some(25))]))
        );
    }
}
