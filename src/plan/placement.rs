//! The placement core shared by backup and restore planning: the facts
//! indexed for lookup, what each claim demands of a node, and the balancer
//! that assigns claims to nodes.
//!
//! Placement runs in two passes. Claims tied to a node (an exclusive volume
//! already attached there) are pinned first, since they have no choice. The
//! rest are placed largest first (bytes descending, then namespace and name)
//! on the candidate node with the least load (bytes, then volume count, then
//! a rank that interleaves zones, turned by a number drawn from the claims'
//! names so different plans start on different nodes): the
//! longest-processing-time rule. On
//! identical, unconstrained nodes it keeps the busiest node within 4/3 of the
//! optimum; with constraints it still keeps the promise a property test
//! checks: the last volume placed on any node would leave any other node it
//! was allowed on at least as loaded, so moving it never lowers the peak.
//!
//! Candidate nodes for a new attachment depend only on the volume's node
//! affinity, its storage class's allowed topologies and its CSI driver, so
//! claims sharing those share one lazily refreshed min-heap of nodes: each
//! pick is O(log nodes) amortised, and a plan is O(claims × log nodes +
//! distinct constraints × nodes) rather than claims × nodes.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

use crate::PlanError;
use crate::facts::{
    ClaimFacts, ClaimPhase, ClusterFacts, NodeFacts, NodeSelector, PodFacts, PodPhase,
    RequirementSubject, SelectorOperator, StorageClassFacts, TaintEffect, VolumeFacts,
};
use crate::output::{
    AttachedNodeProblem, Exclusions, StagePlan, StagePod, UnplaceableClaim, UnplaceableReason,
};

/// The facts, indexed. Nodes are held sorted by name; a node is referred to
/// by its position in that order.
pub(crate) struct IndexedCluster<'f> {
    pub(crate) nodes: Vec<&'f NodeFacts>,
    node_index: HashMap<&'f str, usize>,
    volumes: HashMap<&'f str, &'f VolumeFacts>,
    pub(crate) classes: HashMap<&'f str, &'f StorageClassFacts>,
    /// Claims sorted by (namespace, name).
    pub(crate) claims: Vec<&'f ClaimFacts>,
    /// Pods holding volumes, per claim (namespace, name), sorted by pod name;
    /// haulage's stage pods are not among them.
    users: HashMap<(&'f str, &'f str), Vec<&'f PodFacts>>,
    /// The claims (node, namespace, claim) other backups' and restores'
    /// stage pods hold now: load on those nodes.
    moving: Vec<(&'f str, &'f str, &'f str)>,
    /// Nodes whose `status.volumesAttached` lists a CSI volume, per
    /// (driver, handle).
    attached_by_status: HashMap<(&'f str, &'f str), Vec<usize>>,
}

impl<'f> IndexedCluster<'f> {
    /// Index the facts; objects with the same identity twice are an error,
    /// since keeping either would make the plan depend on input order.
    pub(crate) fn new(facts: &'f ClusterFacts) -> Result<Self, PlanError> {
        let mut nodes: Vec<&NodeFacts> = facts.nodes.iter().collect();
        nodes.sort_by(|left, right| left.name.cmp(&right.name));
        let mut node_index = HashMap::with_capacity(nodes.len());
        for (index, node) in nodes.iter().enumerate() {
            if node_index.insert(node.name.as_str(), index).is_some() {
                return Err(PlanError::DuplicateObject {
                    kind: "Node",
                    name: node.name.clone(),
                });
            }
        }
        let mut volumes = HashMap::with_capacity(facts.volumes.len());
        for volume in &facts.volumes {
            if volumes.insert(volume.name.as_str(), volume).is_some() {
                return Err(PlanError::DuplicateObject {
                    kind: "PersistentVolume",
                    name: volume.name.clone(),
                });
            }
        }
        let mut classes = HashMap::with_capacity(facts.storage_classes.len());
        for class in &facts.storage_classes {
            if classes.insert(class.name.as_str(), class).is_some() {
                return Err(PlanError::DuplicateObject {
                    kind: "StorageClass",
                    name: class.name.clone(),
                });
            }
        }
        let mut claims: Vec<&ClaimFacts> = facts.claims.iter().collect();
        claims.sort_unstable_by(|left, right| {
            (&left.namespace, &left.name).cmp(&(&right.namespace, &right.name))
        });
        if let Some(pair) = claims
            .windows(2)
            .find(|pair| pair[0].namespace == pair[1].namespace && pair[0].name == pair[1].name)
        {
            return Err(PlanError::DuplicateObject {
                kind: "PersistentVolumeClaim",
                name: format!("{}/{}", pair[0].namespace, pair[0].name),
            });
        }
        let mut pod_names = HashSet::with_capacity(facts.pods.len());
        let mut users: HashMap<(&str, &str), Vec<&PodFacts>> = HashMap::new();
        let mut moving = Vec::new();
        for pod in &facts.pods {
            if !pod_names.insert((pod.namespace.as_str(), pod.name.as_str())) {
                return Err(PlanError::DuplicateObject {
                    kind: "Pod",
                    name: format!("{}/{}", pod.namespace, pod.name),
                });
            }
            if pod.holds_volumes() {
                let mut mounted: Vec<&str> = pod.claims.iter().map(String::as_str).collect();
                mounted.sort_unstable();
                mounted.dedup();
                if pod.stage_pod {
                    if let Some(node) = pod.node.as_deref() {
                        moving.extend(
                            mounted
                                .iter()
                                .map(|claim| (node, pod.namespace.as_str(), *claim)),
                        );
                    }
                    continue;
                }
                for claim in mounted {
                    users
                        .entry((pod.namespace.as_str(), claim))
                        .or_default()
                        .push(pod);
                }
            }
        }
        for pods in users.values_mut() {
            pods.sort_by(|left, right| left.name.cmp(&right.name));
        }
        let mut attached_by_status: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
        for (index, node) in nodes.iter().enumerate() {
            for volume in &node.attached_volumes {
                let holders = attached_by_status
                    .entry((volume.driver.as_str(), volume.handle.as_str()))
                    .or_default();
                if holders.last() != Some(&index) {
                    holders.push(index);
                }
            }
        }
        Ok(IndexedCluster {
            nodes,
            node_index,
            volumes,
            classes,
            claims,
            users,
            moving,
            attached_by_status,
        })
    }

    /// The claim with this namespace and name.
    pub(crate) fn claim(&self, namespace: &str, name: &str) -> Option<&'f ClaimFacts> {
        self.claims
            .binary_search_by(|claim| {
                (claim.namespace.as_str(), claim.name.as_str()).cmp(&(namespace, name))
            })
            .ok()
            .map(|position| self.claims[position])
    }

    /// Pods holding this claim's volume, sorted by name.
    fn users_of(&self, namespace: &'f str, claim: &'f str) -> &[&'f PodFacts] {
        self.users
            .get(&(namespace, claim))
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The default storage class: the one marked default, by smallest name
    /// when several are (Kubernetes uses the newest; the facts carry no
    /// timestamps, and determinism matters more here).
    pub(crate) fn default_class(&self) -> Option<&'f StorageClassFacts> {
        self.classes
            .values()
            .filter(|class| class.is_default)
            .min_by(|left, right| left.name.cmp(&right.name))
            .copied()
    }
}

/// What restricts the nodes that may take a new attachment of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Constraints<'f> {
    pub(crate) affinity: Option<&'f NodeSelector>,
    pub(crate) topology: Option<&'f NodeSelector>,
    pub(crate) driver: Option<&'f str>,
}

/// What a claim demands of placement.
pub(crate) enum Demand<'f> {
    /// No stage pod can mount it.
    Unplaceable(UnplaceableReason),
    /// Exclusive volume attached to this node: it goes there.
    Pinned(usize),
    /// Shared volume attached to these (usable) nodes: the least loaded.
    AmongAttached(Vec<usize>),
    /// Not attached anywhere usable: any node meeting the constraints.
    Anywhere(Constraints<'f>),
    /// Shared volume attached only to unready nodes: any node meeting the
    /// constraints, else the least loaded of these.
    AnywhereElseAttached(Constraints<'f>, Vec<usize>),
}

/// What an existing claim demands: phase, bound volume, access modes, users
/// and attachments decide.
pub(crate) fn demand_of_existing_claim<'f>(
    cluster: &IndexedCluster<'f>,
    claim: &'f ClaimFacts,
) -> Demand<'f> {
    match claim.phase {
        ClaimPhase::Pending => return Demand::Unplaceable(UnplaceableReason::ClaimPending),
        ClaimPhase::Lost => return Demand::Unplaceable(UnplaceableReason::ClaimLost),
        ClaimPhase::Bound => {}
    }
    let Some(volume_name) = claim.volume.as_deref().filter(|name| !name.is_empty()) else {
        return Demand::Unplaceable(UnplaceableReason::BoundWithoutVolume);
    };
    let Some(volume) = cluster.volumes.get(volume_name).copied() else {
        return Demand::Unplaceable(UnplaceableReason::VolumeMissing {
            volume: volume_name.to_string(),
        });
    };
    let users = cluster.users_of(&claim.namespace, &claim.name);
    if claim.is_single_pod()
        && let Some(pod) = users.first()
    {
        return Demand::Unplaceable(UnplaceableReason::SinglePodVolumeInUse {
            pod: format!("{}/{}", pod.namespace, pod.name),
        });
    }
    let constraints = Constraints {
        affinity: volume.node_affinity.as_ref(),
        topology: None,
        driver: volume.csi.as_ref().map(|csi| csi.driver.as_str()),
    };

    // Where the volume is attached now: its users' nodes, and the nodes
    // whose status lists it.
    let mut attached: BTreeSet<&str> = users.iter().filter_map(|pod| pod.node.as_deref()).collect();
    if let Some(csi) = &volume.csi
        && let Some(holders) = cluster
            .attached_by_status
            .get(&(csi.driver.as_str(), csi.handle.as_str()))
    {
        attached.extend(
            holders
                .iter()
                .map(|&index| cluster.nodes[index].name.as_str()),
        );
    }
    if attached.is_empty() {
        return Demand::Anywhere(constraints);
    }

    let mut usable = Vec::new();
    let mut problems = Vec::new();
    for name in attached {
        let Some(&index) = cluster.node_index.get(name) else {
            problems.push((name.to_string(), AttachedNodeProblem::Missing));
            continue;
        };
        let node = cluster.nodes[index];
        if let Some(taint) = node.taint_with_effect(TaintEffect::NoExecute) {
            problems.push((
                name.to_string(),
                AttachedNodeProblem::NoExecute(taint.clone()),
            ));
        } else if constraints
            .affinity
            .is_some_and(|affinity| !affinity.matches(node))
        {
            problems.push((name.to_string(), AttachedNodeProblem::OutsideAffinity));
        } else {
            usable.push(index);
        }
    }
    if claim.is_shared() {
        // A shared volume can also be attached somewhere new. A ready node
        // it is attached to is best; failing that, a new
        // attachment on a node that takes new volumes, since a stage pod on
        // a node that is not ready may never start; failing that, the
        // unready node it is attached to.
        let ready: Vec<usize> = usable
            .iter()
            .copied()
            .filter(|&index| cluster.nodes[index].ready)
            .collect();
        return if !ready.is_empty() {
            Demand::AmongAttached(ready)
        } else if usable.is_empty() {
            Demand::Anywhere(constraints)
        } else {
            Demand::AnywhereElseAttached(constraints, usable)
        };
    }
    // An exclusive volume can only be read where it is attached. Should it
    // be attached to several nodes (a pod stuck on a lost node), prefer the
    // node of a Running user, then the first by name.
    let running_node = usable.iter().copied().find(|&index| {
        users.iter().any(|pod| {
            pod.phase == PodPhase::Running
                && pod.node.as_deref() == Some(cluster.nodes[index].name.as_str())
        })
    });
    match running_node.or_else(|| usable.first().copied()) {
        Some(index) => Demand::Pinned(index),
        None => Demand::Unplaceable(UnplaceableReason::AttachedNodesUnusable { nodes: problems }),
    }
}

/// A claim to place, with its weight and demand.
pub(crate) struct Request<'f> {
    pub(crate) namespace: &'f str,
    pub(crate) name: &'f str,
    pub(crate) bytes: u64,
    pub(crate) demand: Demand<'f>,
}

/// Heap key of a node: load in bytes, then volume count, then rank.
type NodeKey = (u64, u64, u32);

/// The nodes eligible for one set of constraints, cheapest on top.
struct CandidateHeap {
    heap: BinaryHeap<Reverse<(NodeKey, usize)>>,
    exclusions: Exclusions,
    /// The constraints' CSI driver, by number.
    driver: Option<usize>,
}

/// Assigns requests to nodes, tracking load and CSI attachments.
struct Balancer<'c, 'f> {
    cluster: &'c IndexedCluster<'f>,
    load_bytes: Vec<u64>,
    load_count: Vec<u64>,
    rank: Vec<u32>,
    /// CSI drivers, numbered.
    driver_ids: HashMap<&'f str, usize>,
    /// Per node and driver: the attach limit (`None`: unlimited).
    limits: Vec<Vec<Option<u32>>>,
    /// Per node and driver: distinct CSI volumes attached, present and
    /// planned.
    attachments: Vec<Vec<u32>>,
    /// Candidate heap number per set of constraints, so each claim hashes
    /// its constraints once.
    group_ids: HashMap<Constraints<'f>, usize>,
    heaps: Vec<CandidateHeap>,
    /// Nodes per (label key, value), built when an affinity first needs it.
    label_index: Option<HashMap<(&'f str, &'f str), Vec<usize>>>,
    /// Stage pods by (namespace number, node).
    stage_pods: BTreeMap<(u32, usize), StagePodDraft<'f>>,
    unplaceable: Vec<UnplaceableClaim>,
}

/// Place every request and return the plan.
pub(crate) fn place_requests<'f>(
    cluster: &IndexedCluster<'f>,
    mut requests: Vec<Request<'f>>,
) -> StagePlan {
    // Name order first (cheap when the caller's order is already it): a
    // request's position then stands for its namespace and name, and
    // namespaces get numbers in the same order, so the rest of placement
    // compares integers, not strings.
    requests.sort_by(|left, right| (left.namespace, left.name).cmp(&(right.namespace, right.name)));
    let mut balancer = Balancer::new(cluster, tie_break_rotation(&requests));
    let mut namespace_numbers = Vec::with_capacity(requests.len());
    let mut number = 0u32;
    for (position, request) in requests.iter().enumerate() {
        if position > 0 && requests[position - 1].namespace != request.namespace {
            number += 1;
        }
        namespace_numbers.push(number);
    }
    // Pinned first: they have no choice, and their load steers the rest.
    // Then largest first (the longest-processing-time rule), ties in name
    // order.
    let mut order: Vec<(bool, Reverse<u64>, usize)> = requests
        .iter()
        .enumerate()
        .map(|(position, request)| {
            (
                !matches!(request.demand, Demand::Pinned(_)),
                Reverse(request.bytes),
                position,
            )
        })
        .collect();
    order.sort_unstable();
    let mut slots: Vec<Option<Request<'f>>> = requests.into_iter().map(Some).collect();
    for (_, _, position) in order {
        if let Some(request) = slots[position].take() {
            balancer.place(request, namespace_numbers[position]);
        }
    }
    balancer.finish()
}

/// A claim on its way to a node.
#[derive(Clone, Copy)]
struct ClaimToPlace<'f> {
    namespace: &'f str,
    name: &'f str,
    bytes: u64,
    /// The namespace's number in name order.
    namespace_number: u32,
}

/// The volumes one stage pod will mount, while placing.
#[derive(Default)]
struct StagePodDraft<'f> {
    namespace: &'f str,
    volumes: Vec<&'f str>,
    bytes: u64,
}

/// How far the tie-break ranks of the nodes turn for these requests (in
/// name order): a number drawn from the claims' names, so the plans of
/// different claims break ties on different nodes. Many one-claim backups
/// planned at once (before any sees another's stage pod) would otherwise
/// all pick the first node by name and queue under its per-node cap; the
/// same claims on the same facts still get the same plan.
fn tie_break_rotation(requests: &[Request<'_>]) -> u64 {
    let mut hasher = blake3::Hasher::new();
    for request in requests {
        hasher.update(request.namespace.as_bytes());
        hasher.update(b"/");
        hasher.update(request.name.as_bytes());
        hasher.update(b"\n");
    }
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

impl<'c, 'f> Balancer<'c, 'f> {
    /// A balancer over `cluster`'s nodes, their tie-break ranks turned by
    /// `rotation` ([`tie_break_rotation`]).
    fn new(cluster: &'c IndexedCluster<'f>, rotation: u64) -> Self {
        let node_count = cluster.nodes.len();
        let mut attached_sets: Vec<HashSet<(&'f str, &'f str)>> = vec![HashSet::new(); node_count];
        for (index, node) in cluster.nodes.iter().enumerate() {
            for volume in &node.attached_volumes {
                attached_sets[index].insert((volume.driver.as_str(), volume.handle.as_str()));
            }
        }
        for ((namespace, claim_name), pods) in &cluster.users {
            let Some(csi) = cluster
                .claim(namespace, claim_name)
                .and_then(|claim| claim.volume.as_deref())
                .and_then(|volume| cluster.volumes.get(volume))
                .and_then(|volume| volume.csi.as_ref())
            else {
                continue;
            };
            for pod in pods {
                if let Some(&index) = pod
                    .node
                    .as_deref()
                    .and_then(|node| cluster.node_index.get(node))
                {
                    attached_sets[index].insert((csi.driver.as_str(), csi.handle.as_str()));
                }
            }
        }
        let mut driver_names: BTreeSet<&'f str> = BTreeSet::new();
        for node in &cluster.nodes {
            driver_names.extend(
                node.csi_drivers
                    .iter()
                    .flatten()
                    .map(|(name, _)| name.as_str()),
            );
        }
        for set in &attached_sets {
            driver_names.extend(set.iter().map(|(driver, _)| *driver));
        }
        driver_names.extend(
            cluster
                .volumes
                .values()
                .filter_map(|volume| volume.csi.as_ref())
                .map(|csi| csi.driver.as_str()),
        );
        driver_names.extend(
            cluster
                .classes
                .values()
                .filter_map(|class| class.csi_driver()),
        );
        let driver_ids: HashMap<&str, usize> = driver_names
            .into_iter()
            .enumerate()
            .map(|(id, name)| (name, id))
            .collect();
        let mut limits = vec![vec![None; driver_ids.len()]; node_count];
        for (index, node) in cluster.nodes.iter().enumerate() {
            for (name, limit) in node.csi_drivers.iter().flatten() {
                if let Some(&id) = driver_ids.get(name.as_str()) {
                    limits[index][id] = *limit;
                }
            }
        }
        let attachments = attached_sets
            .into_iter()
            .map(|set| {
                let mut counts = vec![0u32; driver_ids.len()];
                for (driver, _) in set {
                    if let Some(&id) = driver_ids.get(driver) {
                        counts[id] += 1;
                    }
                }
                counts
            })
            .collect();
        // The volumes other backups and restores move now, through their
        // stage pods: load on those nodes before this plan adds its own.
        let (mut load_bytes, mut load_count) = (vec![0; node_count], vec![0; node_count]);
        for (node, namespace, claim_name) in &cluster.moving {
            if let Some(&index) = cluster.node_index.get(node) {
                let bytes = cluster
                    .claim(namespace, claim_name)
                    .map_or(0, |claim| claim.bytes());
                load_bytes[index] = u64::saturating_add(load_bytes[index], bytes);
                load_count[index] += 1;
            }
        }
        Balancer {
            cluster,
            load_bytes,
            load_count,
            rank: zone_interleaved_ranks(&cluster.nodes, rotation),
            driver_ids,
            limits,
            attachments,
            group_ids: HashMap::new(),
            heaps: Vec::new(),
            label_index: None,
            stage_pods: BTreeMap::new(),
            unplaceable: Vec::new(),
        }
    }

    fn key(&self, node: usize) -> NodeKey {
        (
            self.load_bytes[node],
            self.load_count[node],
            self.rank[node],
        )
    }

    fn place(&mut self, request: Request<'f>, namespace_number: u32) {
        let Request {
            namespace,
            name,
            bytes,
            demand,
        } = request;
        let claim = ClaimToPlace {
            namespace,
            name,
            bytes,
            namespace_number,
        };
        let result = match demand {
            Demand::Unplaceable(reason) => Err(reason),
            Demand::Pinned(node) => {
                self.assign(claim, node);
                Ok(())
            }
            Demand::AmongAttached(nodes) => self.place_among(claim, &nodes, Exclusions::default()),
            Demand::Anywhere(constraints) => self
                .place_anywhere(claim, constraints)
                .map_err(UnplaceableReason::NoEligibleNode),
            Demand::AnywhereElseAttached(constraints, fallback) => {
                match self.place_anywhere(claim, constraints) {
                    Ok(()) => Ok(()),
                    Err(exclusions) => self.place_among(claim, &fallback, exclusions),
                }
            }
        };
        if let Err(reason) = result {
            self.unplaceable.push(UnplaceableClaim {
                namespace: namespace.to_string(),
                pvc: name.to_string(),
                reason,
            });
        }
    }

    /// Place a claim on the least loaded of these nodes (where its volume is
    /// attached already).
    fn place_among(
        &mut self,
        claim: ClaimToPlace<'f>,
        nodes: &[usize],
        exclusions: Exclusions,
    ) -> Result<(), UnplaceableReason> {
        // Never empty as built, but a claim must never vanish.
        let node = nodes
            .iter()
            .copied()
            .min_by_key(|&node| self.key(node))
            .ok_or(UnplaceableReason::NoEligibleNode(exclusions))?;
        self.assign(claim, node);
        Ok(())
    }

    /// Place a claim on the least loaded node meeting the constraints,
    /// counting the new attachment.
    fn place_anywhere(
        &mut self,
        claim: ClaimToPlace<'f>,
        constraints: Constraints<'f>,
    ) -> Result<(), Exclusions> {
        let (group, node) = self.pick(constraints)?;
        if let Some(driver) = self.heaps[group].driver {
            self.attachments[node][driver] += 1;
        }
        self.assign(claim, node);
        let key = self.key(node);
        self.heaps[group].heap.push(Reverse((key, node)));
        Ok(())
    }

    fn assign(&mut self, claim: ClaimToPlace<'f>, node: usize) {
        self.load_bytes[node] = self.load_bytes[node].saturating_add(claim.bytes);
        self.load_count[node] += 1;
        let draft = self
            .stage_pods
            .entry((claim.namespace_number, node))
            .or_insert_with(|| StagePodDraft {
                namespace: claim.namespace,
                ..StagePodDraft::default()
            });
        draft.volumes.push(claim.name);
        draft.bytes = draft.bytes.saturating_add(claim.bytes);
    }

    /// The least loaded node meeting the constraints with room for one more
    /// attachment, taken off its heap (the caller pushes it back with its
    /// new load). Loads only grow, so an entry whose key is stale is
    /// refreshed and pushed back; a node at its attach limit stays full and
    /// is dropped for good.
    fn pick(&mut self, constraints: Constraints<'f>) -> Result<(usize, usize), Exclusions> {
        let group = match self.group_ids.get(&constraints) {
            Some(&group) => group,
            None => {
                let candidates = self.candidates(constraints);
                self.heaps.push(candidates);
                let group = self.heaps.len() - 1;
                self.group_ids.insert(constraints, group);
                group
            }
        };
        let candidates = &mut self.heaps[group];
        while let Some(Reverse((key, node))) = candidates.heap.pop() {
            let current = (
                self.load_bytes[node],
                self.load_count[node],
                self.rank[node],
            );
            if key != current {
                candidates.heap.push(Reverse((current, node)));
                continue;
            }
            if let Some(driver) = candidates.driver
                && self.limits[node][driver]
                    .is_some_and(|limit| self.attachments[node][driver] >= limit)
            {
                candidates.exclusions.attach_limit_reached += 1;
                continue;
            }
            return Ok((group, node));
        }
        Err(candidates.exclusions.clone())
    }

    /// Build the heap of nodes that may take a new attachment under these
    /// constraints, counting the others by first cause.
    fn candidates(&mut self, constraints: Constraints<'f>) -> CandidateHeap {
        let mut exclusions = Exclusions {
            driver: constraints.driver.map(str::to_string),
            ..Exclusions::default()
        };
        // Local volumes each carry their own affinity; scanning every node
        // for each would make planning quadratic, so affinities that name
        // their nodes are resolved through an index.
        let narrowed = constraints
            .affinity
            .and_then(|affinity| self.nodes_named_by(affinity));
        let all_nodes: Vec<usize>;
        let considered: &[usize] = match &narrowed {
            Some(nodes) => {
                exclusions.outside_affinity = self.cluster.nodes.len() - nodes.len();
                nodes
            }
            None => {
                all_nodes = (0..self.cluster.nodes.len()).collect();
                &all_nodes
            }
        };
        let mut entries = Vec::new();
        for &index in considered {
            let node = self.cluster.nodes[index];
            if constraints
                .affinity
                .is_some_and(|affinity| !affinity.matches(node))
            {
                exclusions.outside_affinity += 1;
            } else if constraints
                .topology
                .is_some_and(|topology| !topology.matches(node))
            {
                exclusions.outside_topology += 1;
            } else if node.taint_with_effect(TaintEffect::NoExecute).is_some() {
                exclusions.no_execute += 1;
            } else if !node.ready {
                exclusions.not_ready += 1;
            } else if node.unschedulable {
                exclusions.cordoned += 1;
            } else if node.taint_with_effect(TaintEffect::NoSchedule).is_some() {
                exclusions.no_schedule += 1;
            } else if let (Some(driver), Some(drivers)) = (constraints.driver, &node.csi_drivers)
                && !drivers.contains_key(driver)
            {
                exclusions.driver_missing += 1;
            } else {
                entries.push(Reverse((self.key(index), index)));
            }
        }
        CandidateHeap {
            heap: BinaryHeap::from(entries),
            exclusions,
            driver: constraints
                .driver
                .and_then(|driver| self.driver_ids.get(driver).copied()),
        }
    }

    /// The nodes a selector can possibly match, sorted, when every term has
    /// an `In` requirement (on the node name or a label) that bounds it;
    /// `None` when some term could match nodes no `In` names.
    fn nodes_named_by(&mut self, selector: &NodeSelector) -> Option<Vec<usize>> {
        let mut nodes = Vec::new();
        for term in &selector.terms {
            let requirement = term
                .requirements
                .iter()
                .find(|requirement| requirement.operator == SelectorOperator::In)?;
            for value in &requirement.values {
                match &requirement.subject {
                    RequirementSubject::NodeName => {
                        nodes.extend(self.cluster.node_index.get(value.as_str()).copied());
                    }
                    RequirementSubject::Label(key) => {
                        let cluster = self.cluster;
                        let index = self.label_index.get_or_insert_with(|| {
                            let mut index: HashMap<(&'f str, &'f str), Vec<usize>> = HashMap::new();
                            for (position, node) in cluster.nodes.iter().enumerate() {
                                for (key, value) in &node.labels {
                                    index
                                        .entry((key.as_str(), value.as_str()))
                                        .or_default()
                                        .push(position);
                                }
                            }
                            index
                        });
                        if let Some(matching) = index.get(&(key.as_str(), value.as_str())) {
                            nodes.extend_from_slice(matching);
                        }
                    }
                }
            }
        }
        nodes.sort_unstable();
        nodes.dedup();
        Some(nodes)
    }

    fn finish(self) -> StagePlan {
        let nodes = &self.cluster.nodes;
        let stage_pods = self
            .stage_pods
            .into_iter()
            .map(|((_, node), mut draft)| {
                draft.volumes.sort_unstable();
                StagePod {
                    namespace: draft.namespace.to_string(),
                    node: nodes[node].name.clone(),
                    volumes: draft.volumes.into_iter().map(str::to_string).collect(),
                    bytes: draft.bytes,
                }
            })
            .collect();
        let mut unplaceable = self.unplaceable;
        unplaceable.sort_by(|left, right| {
            (&left.namespace, &left.pvc).cmp(&(&right.namespace, &right.pvc))
        });
        StagePlan {
            stage_pods,
            unplaceable,
        }
    }
}

/// Tie-break ranks that interleave zones: the first node (by name) of each
/// zone, then the second of each, and so on, so equally loaded nodes are
/// taken zone by zone.
fn zone_interleaved_ranks(nodes: &[&NodeFacts], rotation: u64) -> Vec<u32> {
    let mut zones: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (index, node) in nodes.iter().enumerate() {
        zones
            .entry(node.zone().unwrap_or(""))
            .or_default()
            .push(index);
    }
    let mut ranks = vec![0; nodes.len()];
    let mut next_rank = 0;
    let deepest = zones.values().map(Vec::len).max().unwrap_or(0);
    for depth in 0..deepest {
        for members in zones.values() {
            if let Some(&index) = members.get(depth) {
                ranks[index] = next_rank;
                next_rank += 1;
            }
        }
    }
    // Turned: the interleaving stays (a zone's nodes keep their distance
    // in the order), only where it starts moves.
    let count = nodes.len().max(1) as u64;
    for rank in &mut ranks {
        *rank = ((u64::from(*rank) + rotation % count) % count) as u32;
    }
    ranks
}
