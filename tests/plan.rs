//! The stage-pod planner from the outside: worked examples for each rule,
//! the dump fixture through the `haulage plan` binary, malformed dumps, and
//! property tests of every rule over generated clusters.

use clap::Parser as _;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use haulage::cli::{Cli, Command};
use haulage::plan::facts::{
    AccessMode, ClaimFacts, ClaimPhase, ClusterFacts, NodeFacts, NodeSelector, PodFacts, PodPhase,
    StorageClassFacts, TaintEffect, VolumeFacts, ZONE_LABEL,
};
use haulage::plan::objects::{DumpError, parse_dump};
use haulage::plan::{
    LabelSelector, RestoreClaim, Selection, StagePlan, UnplaceableClaim, plan_restore,
    plan_stage_pods,
};
use proptest::prelude::*;

const EBS: &str = "ebs.csi.aws.com";
const CEPHFS: &str = "cephfs.csi.ceph.com";
const GIB: u64 = 1 << 30;

fn plan(facts: &ClusterFacts) -> StagePlan {
    plan_stage_pods(facts, &Selection::everything()).expect("facts are consistent")
}

/// (namespace, claim) → node, for placed claims.
fn placements(plan: &StagePlan) -> BTreeMap<(String, String), String> {
    plan.stage_pods
        .iter()
        .flat_map(|pod| {
            pod.volumes
                .iter()
                .map(move |volume| ((pod.namespace.clone(), volume.clone()), pod.node.clone()))
        })
        .collect()
}

fn reason_of(plan: &StagePlan, namespace: &str, claim: &str) -> Option<String> {
    plan.unplaceable
        .iter()
        .find(|entry| entry.namespace == namespace && entry.pvc == claim)
        .map(|entry| entry.reason.to_string())
}

fn node_of(plan: &StagePlan, namespace: &str, claim: &str) -> Option<String> {
    placements(plan)
        .get(&(namespace.to_string(), claim.to_string()))
        .cloned()
}

/// A claim and its CSI volume, both named after the claim.
fn ebs_claim(namespace: &str, name: &str, bytes: u64) -> (ClaimFacts, VolumeFacts) {
    (
        ClaimFacts::bound(namespace, name, format!("pv-{name}"), bytes),
        VolumeFacts::new(format!("pv-{name}")).with_csi(EBS, format!("vol-{name}")),
    )
}

/// A claim and its CSI volume, as `ebs_claim`, with the one access mode.
fn ebs_claim_with_access(
    namespace: &str,
    name: &str,
    bytes: u64,
    mode: AccessMode,
) -> (ClaimFacts, VolumeFacts) {
    let (claim, volume) = ebs_claim(namespace, name, bytes);
    (claim.with_access_modes([mode]), volume)
}

/// Asserts the plan places the claim on the node.
/// Bound EBS claims in namespace `shop`, by name and bytes used.
fn shop_claims(claims: &[(&str, u64)]) -> Vec<(ClaimFacts, VolumeFacts)> {
    claims
        .iter()
        .map(|(name, bytes)| ebs_claim("shop", name, *bytes))
        .collect()
}

/// Each claim of namespace `shop` is placed on its node: `(claim, node)`.
fn assert_shop_placements(plan: &StagePlan, placements: &[(&str, &str)]) {
    for (claim, node) in placements {
        assert_placed_on(plan, "shop", claim, node);
    }
}

fn assert_placed_on(plan: &StagePlan, namespace: &str, claim: &str, node: &str) {
    assert_eq!(
        node_of(plan, namespace, claim).as_deref(),
        Some(node),
        "{namespace}/{claim}"
    );
}

/// Asserts the plan leaves the claim unplaceable for a reason that says `words`.
fn assert_unplaceable_because(plan: &StagePlan, namespace: &str, claim: &str, words: &str) {
    let reason = reason_of(plan, namespace, claim)
        .unwrap_or_else(|| panic!("{namespace}/{claim} is placed"));
    assert!(reason.contains(words), "{namespace}/{claim}: {reason}");
}

fn facts_with(
    nodes: Vec<NodeFacts>,
    pairs: Vec<(ClaimFacts, VolumeFacts)>,
    pods: Vec<PodFacts>,
) -> ClusterFacts {
    let (claims, volumes) = pairs.into_iter().unzip();
    ClusterFacts {
        nodes,
        pods,
        claims,
        volumes,
        storage_classes: Vec::new(),
    }
}

#[test]
fn read_write_once_volume_in_use_stays_on_its_cordoned_node() {
    let facts = facts_with(
        vec![NodeFacts::new("busy").cordoned(), NodeFacts::new("idle")],
        vec![ebs_claim("shop", "db", 10 * GIB)],
        vec![PodFacts::running("shop", "db-0", "busy").mounting("db")],
    );
    assert_placed_on(&plan(&facts), "shop", "db", "busy");
}

/// Node `a` and the ReadWriteOncePod claim shop/queue, which pod
/// shop/queue-0 on `a` mounts in the given phase.
fn single_pod_queue_mounted_in(phase: PodPhase) -> ClusterFacts {
    facts_with(
        vec![NodeFacts::new("a")],
        vec![ebs_claim_with_access(
            "shop",
            "queue",
            GIB,
            AccessMode::ReadWriteOncePod,
        )],
        vec![
            PodFacts::running("shop", "queue-0", "a")
                .mounting("queue")
                .with_phase(phase),
        ],
    )
}

#[test]
fn read_write_once_pod_volume_in_use_asks_to_quiesce_first() {
    let plan = plan(&single_pod_queue_mounted_in(PodPhase::Running));
    assert_unplaceable_because(&plan, "shop", "queue", "quiesce");
    assert_unplaceable_because(&plan, "shop", "queue", "shop/queue-0");
}

#[test]
fn read_write_once_pod_volume_not_in_use_is_placed() {
    let facts = single_pod_queue_mounted_in(PodPhase::Succeeded);
    assert_placed_on(&plan(&facts), "shop", "queue", "a");
}

#[test]
fn shared_volume_used_from_three_nodes_gets_one_stage_pod_on_the_least_loaded() {
    let facts = facts_with(
        vec![
            NodeFacts::new("a"),
            NodeFacts::new("b"),
            NodeFacts::new("c"),
        ],
        vec![
            ebs_claim_with_access("shop", "uploads", GIB, AccessMode::ReadWriteMany),
            ebs_claim("shop", "big-a", 100 * GIB),
            ebs_claim("shop", "big-c", 100 * GIB),
        ],
        vec![
            PodFacts::running("shop", "web-a", "a")
                .mounting("uploads")
                .mounting("big-a"),
            PodFacts::running("shop", "web-b", "b").mounting("uploads"),
            PodFacts::running("shop", "web-c", "c")
                .mounting("uploads")
                .mounting("big-c"),
        ],
    );
    let plan = plan(&facts);
    assert_placed_on(&plan, "shop", "uploads", "b");
    let mounts = plan
        .stage_pods
        .iter()
        .filter(|pod| pod.volumes.contains(&"uploads".to_string()))
        .count();
    assert_eq!(mounts, 1);
}

#[test]
fn the_volumes_other_backups_stage_pods_hold_count_as_their_nodes_load() {
    // Another backup moves web/logs through its stage pod on `a`: a
    // backup of namespace shop alone goes to `b`, where nothing moves (the
    // tie-break alone, by name, would pick `a`, and many one-claim backups
    // created at once would all queue under `a`'s per-node cap).
    let facts = |holder: PodFacts| {
        facts_with(
            vec![NodeFacts::new("a"), NodeFacts::new("b")],
            vec![ebs_claim("web", "logs", GIB), ebs_claim("shop", "db", GIB)],
            vec![holder.mounting("logs")],
        )
    };
    let shop = Selection {
        namespaces: ["shop".to_string()].into(),
        ..Selection::everything()
    };
    let stage_pod = PodFacts::running("web", "haulage-backup-other-a", "a").as_stage_pod();
    let plan = plan_stage_pods(&facts(stage_pod), &shop).expect("consistent");
    assert_placed_on(&plan, "shop", "db", "b");
    // An application pod holding it is not moving data: no load.
    let application = PodFacts::running("web", "logs-0", "a");
    let plan = plan_stage_pods(&facts(application), &shop).expect("consistent");
    assert_placed_on(&plan, "shop", "db", "a");
}

#[test]
fn shared_volume_prefers_a_ready_node_it_is_attached_to() {
    let facts = facts_with(
        vec![
            NodeFacts::new("a-sick").not_ready(),
            NodeFacts::new("b-well"),
        ],
        vec![
            ebs_claim_with_access("shop", "uploads", GIB, AccessMode::ReadOnlyMany),
            ebs_claim("shop", "busy", 50 * GIB),
        ],
        vec![
            PodFacts::running("shop", "reader-a", "a-sick").mounting("uploads"),
            PodFacts::running("shop", "reader-b", "b-well")
                .mounting("uploads")
                .mounting("busy"),
        ],
    );
    assert_placed_on(&plan(&facts), "shop", "uploads", "b-well");
}

#[test]
fn shared_volume_attached_only_to_an_unready_node_moves_to_a_healthy_one() {
    // A shared claim mounted by a pod on the unready node a-sick, with
    // `other` as the only other node.
    let uploads_read_on_a_sick_node = |other: NodeFacts| {
        facts_with(
            vec![NodeFacts::new("a-sick").not_ready(), other],
            vec![ebs_claim_with_access(
                "shop",
                "uploads",
                GIB,
                AccessMode::ReadWriteMany,
            )],
            vec![PodFacts::running("shop", "reader", "a-sick").mounting("uploads")],
        )
    };
    let facts = uploads_read_on_a_sick_node(NodeFacts::new("b-well"));
    assert_placed_on(&plan(&facts), "shop", "uploads", "b-well");
    let stuck = uploads_read_on_a_sick_node(NodeFacts::new("b-cordoned").cordoned());
    assert_eq!(
        node_of(&plan(&stuck), "shop", "uploads").as_deref(),
        Some("a-sick"),
        "with nowhere else to go, the node it is attached to"
    );
}

#[test]
fn local_volume_goes_to_its_node_only() {
    let facts = facts_with(
        vec![NodeFacts::new("a"), NodeFacts::new("b")],
        vec![(
            ClaimFacts::bound("db", "fast", "pv-fast", GIB),
            VolumeFacts::new("pv-fast").with_node_affinity(NodeSelector::node_names(["b"])),
        )],
        Vec::new(),
    );
    assert_placed_on(&plan(&facts), "db", "fast", "b");
}

#[test]
fn attach_limit_counts_volumes_already_attached() {
    let facts = facts_with(
        vec![
            NodeFacts::new("a")
                .with_csi_driver(EBS, Some(2))
                .with_attached_volume(EBS, "vol-other"),
            NodeFacts::new("b").with_csi_driver(EBS, Some(1)),
        ],
        shop_claims(&[
            ("one", 3 * GIB),
            ("two", 2 * GIB),
            ("three", GIB),
            ("used", GIB),
        ]),
        vec![PodFacts::running("shop", "user", "a").mounting("used")],
    );
    let plan = plan(&facts);
    // a holds vol-other and vol-used: full. b takes one new volume.
    assert_shop_placements(&plan, &[("used", "a"), ("one", "b")]);
    for claim in ["two", "three"] {
        assert_unplaceable_because(
            &plan,
            "shop",
            claim,
            "2 nodes at the attach limit of ebs.csi.aws.com",
        );
    }
}

#[test]
fn node_without_the_csi_driver_takes_none_of_its_volumes() {
    let facts = facts_with(
        vec![
            NodeFacts::new("a").with_csi_driver(CEPHFS, None),
            NodeFacts::new("b").with_csi_driver(EBS, None),
        ],
        vec![ebs_claim("shop", "one", GIB), ebs_claim("shop", "two", GIB)],
        Vec::new(),
    );
    let plan = plan(&facts);
    assert_shop_placements(&plan, &[("one", "b"), ("two", "b")]);
}

#[test]
fn unmounted_volumes_balance_by_bytes_then_count() {
    let facts = facts_with(
        vec![NodeFacts::new("a"), NodeFacts::new("b")],
        shop_claims(&[
            ("large", 8 * GIB),
            ("medium", 5 * GIB),
            ("small-1", 2 * GIB),
            ("small-2", GIB),
        ]),
        Vec::new(),
    );
    let plan = plan(&facts);
    let loads: BTreeMap<_, _> = plan
        .stage_pods
        .iter()
        .map(|pod| (pod.node.clone(), pod.bytes))
        .collect();
    assert_eq!(loads.values().copied().max(), Some(8 * GIB));
    let large = node_of(&plan, "shop", "large").expect("placed");
    for other in ["medium", "small-1", "small-2"] {
        assert_ne!(
            node_of(&plan, "shop", other),
            Some(large.clone()),
            "{other}"
        );
    }
}

#[test]
fn equally_loaded_nodes_are_taken_zone_by_zone() {
    let nodes = vec![
        NodeFacts::new("a1").in_zone("z1"),
        NodeFacts::new("a2").in_zone("z1"),
        NodeFacts::new("b1").in_zone("z2"),
        NodeFacts::new("b2").in_zone("z2"),
        NodeFacts::new("c1").in_zone("z3"),
        NodeFacts::new("c2").in_zone("z3"),
    ];
    let facts = facts_with(
        nodes,
        shop_claims(&[("x", GIB), ("y", GIB), ("z", GIB)]),
        Vec::new(),
    );
    // One node of each zone (which of its nodes, the claims' names
    // decide: plans of other claims start elsewhere).
    let used: BTreeSet<String> = placements(&plan(&facts)).into_values().collect();
    let zones: BTreeSet<char> = used.iter().filter_map(|node| node.chars().next()).collect();
    assert_eq!(used.len(), 3, "{used:?}");
    assert_eq!(zones, BTreeSet::from(['a', 'b', 'c']), "{used:?}");
}

#[test]
fn plans_of_different_claims_break_ties_on_different_nodes() {
    // One-claim backups planned at once, none seeing another's stage pod:
    // each claim's own tie-break spreads them over the nodes (before, all
    // 40 of a test went to the first node by name and queued under its
    // per-node cap). The same claim gets the same node every time.
    let nodes: Vec<NodeFacts> = (0..5)
        .map(|n| NodeFacts::new(format!("node-{n}")))
        .collect();
    let claims: Vec<(ClaimFacts, VolumeFacts)> = (0..40)
        .map(|n| ebs_claim("team", &format!("data-{n:03}"), GIB))
        .collect();
    let facts = facts_with(nodes, claims, Vec::new());
    let node_of_alone = |claim: &str| {
        let selection = Selection {
            labels: LabelSelector::parse(&format!("claim={claim}")).expect("selector"),
            ..Selection::everything()
        };
        let mut facts = facts.clone();
        for each in &mut facts.claims {
            let name = each.name.clone();
            *each = each.clone().with_label("claim", &name);
        }
        node_of(
            &plan_stage_pods(&facts, &selection).expect("plan"),
            "team",
            claim,
        )
        .expect("placed")
    };
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for n in 0..40 {
        *per_node
            .entry(node_of_alone(&format!("data-{n:03}")))
            .or_default() += 1;
    }
    assert_eq!(per_node.len(), 5, "every node used: {per_node:?}");
    assert!(
        per_node.values().all(|&count| count <= 16),
        "no node takes most: {per_node:?}"
    );
    assert_eq!(node_of_alone("data-007"), node_of_alone("data-007"));
}

#[test]
fn unavailable_nodes_take_only_volumes_already_attached() {
    let facts = facts_with(
        vec![
            NodeFacts::new("cordoned").cordoned(),
            NodeFacts::new("not-ready").not_ready(),
            NodeFacts::new("tainted").with_taint("dedicated", TaintEffect::NoSchedule),
            NodeFacts::new("preferred").with_taint("spot", TaintEffect::PreferNoSchedule),
        ],
        shop_claims(&[("free-1", GIB), ("free-2", GIB), ("held", GIB)]),
        vec![PodFacts::running("shop", "holder", "not-ready").mounting("held")],
    );
    let plan = plan(&facts);
    assert_shop_placements(
        &plan,
        &[
            ("free-1", "preferred"),
            ("free-2", "preferred"),
            ("held", "not-ready"),
        ],
    );
}

#[test]
fn volume_attached_to_a_no_execute_node_is_unplaceable_with_the_taint() {
    let facts = facts_with(
        vec![
            NodeFacts::new("draining").with_taint("drain", TaintEffect::NoExecute),
            NodeFacts::new("other"),
        ],
        vec![ebs_claim("shop", "db", GIB)],
        vec![PodFacts::running("shop", "db-0", "draining").mounting("db")],
    );
    let plan = plan(&facts);
    assert_unplaceable_because(&plan, "shop", "db", "draining");
    assert_unplaceable_because(&plan, "shop", "db", "drain:NoExecute");
    assert!(plan.stage_pods.is_empty());
}

#[test]
fn pending_and_lost_claims_say_so() {
    let facts = facts_with(
        vec![NodeFacts::new("a")],
        vec![
            {
                let (claim, volume) = ebs_claim("shop", "new", GIB);
                (claim.with_phase(ClaimPhase::Pending), volume)
            },
            {
                let (claim, volume) = ebs_claim("shop", "gone", GIB);
                (claim.with_phase(ClaimPhase::Lost), volume)
            },
        ],
        Vec::new(),
    );
    let plan = plan(&facts);
    assert_unplaceable_because(&plan, "shop", "new", "Pending");
    assert_unplaceable_because(&plan, "shop", "gone", "Lost");
}

#[test]
fn measured_usage_outweighs_the_request() {
    let (big_request, big_volume) = ebs_claim("shop", "mostly-empty", 100 * GIB);
    let facts = facts_with(
        vec![NodeFacts::new("a"), NodeFacts::new("b")],
        vec![
            (big_request.with_measured_bytes(GIB), big_volume),
            ebs_claim("shop", "full", 10 * GIB),
        ],
        Vec::new(),
    );
    let plan = plan(&facts);
    let total: u64 = plan.stage_pods.iter().map(|pod| pod.bytes).sum();
    assert_eq!(total, 11 * GIB);
    assert_ne!(
        node_of(&plan, "shop", "full"),
        node_of(&plan, "shop", "mostly-empty"),
        "10 GiB and 1 GiB measured: one on each node"
    );
}

#[test]
fn selection_limits_the_plan_to_matching_claims() {
    let (db, db_volume) = ebs_claim("shop", "db", GIB);
    let facts = facts_with(
        vec![NodeFacts::new("a")],
        vec![
            (db.with_label("app", "db"), db_volume),
            ebs_claim("shop", "cache", GIB),
            {
                let claim =
                    ClaimFacts::bound("other", "db", "pv-other-db", GIB).with_label("app", "db");
                (claim, VolumeFacts::new("pv-other-db"))
            },
        ],
        Vec::new(),
    );
    let selection = Selection {
        namespaces: BTreeSet::from(["shop".to_string()]),
        labels: LabelSelector::parse("app=db").expect("selector"),
        names: BTreeSet::new(),
    };
    let plan = plan_stage_pods(&facts, &selection).expect("plan");
    assert_eq!(
        placements(&plan).into_keys().collect::<Vec<_>>(),
        [("shop".to_string(), "db".to_string())]
    );
    // By name: one claim of the namespace, whatever its labels.
    let by_name = Selection {
        namespaces: BTreeSet::from(["shop".to_string()]),
        labels: LabelSelector::default(),
        names: BTreeSet::from(["cache".to_string()]),
    };
    let plan = plan_stage_pods(&facts, &by_name).expect("plan");
    assert_eq!(
        placements(&plan).into_keys().collect::<Vec<_>>(),
        [("shop".to_string(), "cache".to_string())]
    );
}

#[test]
fn duplicate_objects_are_refused_rather_than_picked_by_order() {
    let facts = facts_with(
        vec![NodeFacts::new("a"), NodeFacts::new("a")],
        Vec::new(),
        Vec::new(),
    );
    let error = plan_stage_pods(&facts, &Selection::everything()).expect_err("duplicate node");
    assert_eq!(error.to_string(), "the cluster facts hold Node a twice");
}

#[test]
fn restore_spreads_new_claims_over_the_zones_the_class_allows() {
    let mut class = StorageClassFacts::new("zonal", EBS);
    class.allowed_topologies = Some(NodeSelector::label_in(ZONE_LABEL, ["z1", "z2"]));
    let facts = ClusterFacts {
        nodes: vec![
            NodeFacts::new("a").in_zone("z1"),
            NodeFacts::new("b").in_zone("z2"),
            NodeFacts::new("c").in_zone("z3"),
        ],
        storage_classes: vec![class],
        ..ClusterFacts::default()
    };
    let claims: Vec<RestoreClaim> = (0..4)
        .map(|index| {
            RestoreClaim::new("shop", format!("data-{index}"), GIB).with_storage_class("zonal")
        })
        .chain([RestoreClaim::new("shop", "orphan", GIB).with_storage_class("gone")])
        .chain([RestoreClaim::new("shop", "defaulted", GIB)])
        .collect();
    let plan = plan_restore(&facts, &claims).expect("plan");
    let loads: BTreeMap<_, _> = plan
        .stage_pods
        .iter()
        .map(|pod| (pod.node.clone(), pod.volumes.len()))
        .collect();
    assert_eq!(
        loads,
        BTreeMap::from([("a".to_string(), 2), ("b".to_string(), 2)])
    );
    assert_unplaceable_because(&plan, "shop", "orphan", "storage class gone");
    assert_unplaceable_because(&plan, "shop", "defaulted", "default");
}

#[test]
fn restore_into_an_existing_bound_claim_follows_its_attachment() {
    let facts = facts_with(
        vec![NodeFacts::new("a"), NodeFacts::new("b")],
        vec![ebs_claim("shop", "db", GIB)],
        vec![PodFacts::running("shop", "db-0", "b").mounting("db")],
    );
    let plan = plan_restore(&facts, &[RestoreClaim::new("shop", "db", GIB)]).expect("plan");
    assert_placed_on(&plan, "shop", "db", "b");
}

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/plan/cluster.yaml"
);

#[test]
fn fixture_dump_plans_as_documented() {
    let text = std::fs::read_to_string(FIXTURE).expect("fixture readable");
    let facts = parse_dump(&text).expect("fixture parses");
    let plan = plan(&facts);
    let placed = placements(&plan);
    let expect = |namespace: &str, claim: &str, node: &str| {
        assert_eq!(
            placed
                .get(&(namespace.to_string(), claim.to_string()))
                .map(String::as_str),
            Some(node),
            "{namespace}/{claim}"
        );
    };
    expect("shop", "data-db-0", "node-b"); // in use on the cordoned node
    expect("shop", "web-1-tmp", "node-a"); // generic ephemeral volume
    expect("shop", "uploads", "node-a"); // shared, least loaded of a and c
    expect("shop", "reports", "node-a"); // its pod finished: free to move
    expect("analytics", "warehouse", "node-c");
    let unplaceable: BTreeSet<_> = plan
        .unplaceable
        .iter()
        .map(|entry| entry.pvc.as_str())
        .collect();
    assert_eq!(
        unplaceable,
        BTreeSet::from(["cache", "fast", "old", "queue", "scratch"])
    );
    assert_unplaceable_because(&plan, "analytics", "scratch", "attach limit");
}

fn fixture_plan(selection: &Selection) -> StagePlan {
    let text = std::fs::read_to_string(FIXTURE).expect("fixture readable");
    plan_stage_pods(&parse_dump(&text).expect("fixture parses"), selection).expect("plan")
}

#[test]
fn namespace_plan_serialises_to_the_documented_json() {
    let plan = fixture_plan(&Selection {
        namespaces: BTreeSet::from(["shop".to_string()]),
        labels: LabelSelector::default(),
        names: BTreeSet::new(),
    });
    let json = serde_json::to_value(&plan).expect("plan serialises");
    assert_eq!(
        json["stagePods"],
        serde_json::json!([
            // Without analytics' warehouse, node-c is free for reports.
            {"namespace": "shop", "node": "node-a", "volumes": ["uploads", "web-1-tmp"], "bytes": 21 * GIB},
            {"namespace": "shop", "node": "node-b", "volumes": ["data-db-0"], "bytes": 50 * GIB},
            {"namespace": "shop", "node": "node-c", "volumes": ["reports"], "bytes": 30 * GIB},
        ])
    );
    assert_eq!(json["unplaceable"].as_array().map(Vec::len), Some(2));
    assert_eq!(json["unplaceable"][0]["pvc"], "cache");
}

#[test]
fn table_shows_each_node_then_the_unplaceable_claims_with_reasons() {
    let table = fixture_plan(&Selection::everything()).to_table();
    let expected = "\
NODE    STAGE PODS  VOLUMES  BYTES      NAMESPACES
node-a  1           3        51.0 GiB   shop
node-b  1           1        50.0 GiB   shop
node-c  1           1        100.0 GiB  analytics

3 stage pods on 3 nodes: 5 volumes, 201.0 GiB

UNPLACEABLE (5)
NAMESPACE  PVC      REASON
analytics  fast     no node can take it: 3 nodes outside the volume's node affinity, 1 node tainted NoExecute
";
    assert!(table.starts_with(expected), "{table}");
    assert!(
        table.contains(
            "shop       queue    ReadWriteOncePod volume is mounted by pod shop/queue-0: quiesce"
        ),
        "{table}"
    );
}

#[test]
fn plan_command_parses_its_arguments() {
    let cli = Cli::try_parse_from([
        "haulage",
        "plan",
        "--from-file",
        "dump.yaml",
        "-l",
        "app=db",
        "-n",
        "shop",
        "--namespace",
        "web",
        "-o",
        "yaml",
    ])
    .expect("arguments parse");
    #[allow(
        unreachable_patterns,
        reason = "the other verbs join Command as they land"
    )]
    let arguments = match cli.command {
        Command::Plan(arguments) => arguments,
        other => panic!("parsed as {other:?}"),
    };
    assert_eq!(
        arguments.from_file,
        Some(std::path::PathBuf::from("dump.yaml"))
    );
    assert_eq!(arguments.selector.as_deref(), Some("app=db"));
    assert_eq!(arguments.namespaces, ["shop", "web"]);
    assert_eq!(format!("{:?}", arguments.output), "Yaml");
    assert!(
        Cli::try_parse_from(["haulage", "plan"]).is_ok(),
        "without --from-file the current kubeconfig context is read"
    );
    assert!(
        Cli::try_parse_from([
            "haulage",
            "plan",
            "--from-file",
            "d.yaml",
            "--context",
            "prod"
        ])
        .is_err(),
        "a dump and a cluster are not both taken"
    );
}

fn dump_error(items: &str) -> DumpError {
    parse_dump(&format!("apiVersion: v1\nkind: List\nitems:\n{items}")).expect_err("malformed dump")
}

#[test]
fn malformed_dumps_name_the_object_and_field() {
    let cases = [
        (
            "- {apiVersion: v1, kind: Node, metadata: {name: a}, spec: {taints: [{key: k, effect: Sometimes}]}}\n",
            "Node a: spec.taints[].effect has invalid value \"Sometimes\"",
        ),
        (
            "- {apiVersion: v1, kind: PersistentVolumeClaim, metadata: {name: d, namespace: s}, spec: {resources: {requests: {storage: lots}}}}\n",
            "PersistentVolumeClaim s/d: spec.resources.requests.storage has invalid value \"lots\"",
        ),
        (
            "- {apiVersion: v1, kind: PersistentVolumeClaim, metadata: {name: d}, spec: {}}\n",
            "PersistentVolumeClaim d: metadata.namespace is missing",
        ),
        (
            "- {apiVersion: v1, kind: PersistentVolume, metadata: {name: p}, spec: {accessModes: [ReadWriteSometimes]}}\n",
            "PersistentVolume p: spec.accessModes has invalid value \"ReadWriteSometimes\"",
        ),
        (
            "- {apiVersion: storage.k8s.io/v1, kind: CSINode, metadata: {name: a}, spec: {drivers: [{name: x, nodeID: a, allocatable: {count: -1}}]}}\n",
            "CSINode a: spec.drivers[].allocatable.count has invalid value \"-1\"",
        ),
        (
            "- {apiVersion: v1, kind: Node, metadata: {name: a}}\n- {apiVersion: v1, kind: Node, metadata: {name: a}}\n",
            "Node a appears twice",
        ),
        (
            "- {apiVersion: v1, kind: Pod, metadata: {name: p, namespace: s}, spec: {containers: 7}}\n",
            "item 0 (Pod s/p) does not match the Pod schema",
        ),
        (
            "- {metadata: {name: p}}\n",
            "item 0 of the list has no kind",
        ),
    ];
    for (items, expected) in cases {
        let message = dump_error(items).to_string();
        assert!(
            message.starts_with(expected),
            "{message:?} should start with {expected:?}"
        );
    }
    let not_a_list =
        parse_dump("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n").expect_err("single object");
    assert!(
        not_a_list
            .to_string()
            .starts_with("the dump is a single Pod, not a v1 List"),
        "{not_a_list}"
    );
    // Text that cannot be read to its end is refused before the parser
    // that expands aliases sees it, naming where.
    let unreadable = parse_dump("items: [").expect_err("bad yaml");
    assert!(
        matches!(unreadable, DumpError::Unreadable { .. }),
        "{unreadable:?}"
    );
    assert!(
        unreadable
            .to_string()
            .starts_with("the dump is not valid YAML at line "),
        "{unreadable}"
    );
    // Nor is an alias after the point where the text stops being readable.
    assert!(matches!(
        parse_dump("items: [\n  ]]\nother: *a\n").expect_err("unreadable"),
        DumpError::Unreadable { .. }
    ));
}

#[test]
fn raw_api_lists_imply_the_kind_of_their_items() {
    let facts = parse_dump("{\"kind\": \"NodeList\", \"apiVersion\": \"v1\", \"items\": [{\"metadata\": {\"name\": \"a\"}}]}")
        .expect("node list parses");
    assert_eq!(facts.nodes.len(), 1);
    assert!(!facts.nodes[0].ready, "no Ready condition means not ready");
}

// ---------------------------------------------------------------------------
// Property tests over generated clusters.

const NAMESPACES: [&str; 3] = ["ns0", "ns1", "ns2"];

#[derive(Debug, Clone)]
struct GeneratedNode {
    ready: bool,
    cordoned: bool,
    taint: Option<TaintEffect>,
    zone: usize,
    csi: Option<(Option<u32>, bool)>,
}

#[derive(Debug, Clone)]
struct GeneratedClaim {
    namespace: usize,
    phase: ClaimPhase,
    bytes: u64,
    measured: Option<u64>,
    modes: usize,
    driver: usize,
    affinity: usize,
    affinity_target: usize,
    volume_present: bool,
    labelled: bool,
}

#[derive(Debug, Clone)]
struct GeneratedPod {
    namespace: usize,
    node: Option<usize>,
    phase: PodPhase,
    claims: Vec<usize>,
}

fn node_strategy() -> impl Strategy<Value = GeneratedNode> {
    (
        prop::bool::weighted(0.85),
        prop::bool::weighted(0.15),
        prop_oneof![
            6 => Just(None),
            1 => Just(Some(TaintEffect::NoSchedule)),
            1 => Just(Some(TaintEffect::PreferNoSchedule)),
            1 => Just(Some(TaintEffect::NoExecute)),
        ],
        0..3usize,
        prop::option::weighted(0.7, (prop::option::weighted(0.7, 0..4u32), any::<bool>())),
    )
        .prop_map(|(ready, cordoned, taint, zone, csi)| GeneratedNode {
            ready,
            cordoned,
            taint,
            zone,
            csi,
        })
}

fn claim_strategy() -> impl Strategy<Value = GeneratedClaim> {
    (
        (
            0..NAMESPACES.len(),
            prop_oneof![8 => Just(ClaimPhase::Bound), 1 => Just(ClaimPhase::Pending), 1 => Just(ClaimPhase::Lost)],
            prop_oneof![1..1000u64, Just(0u64), Just(500u64)],
            prop::option::weighted(0.2, 0..1000u64),
            0..5usize,
        ),
        (0..3usize, 0..4usize, 0..10usize, prop::bool::weighted(0.95), any::<bool>()),
    )
        .prop_map(
            |((namespace, phase, bytes, measured, modes), (driver, affinity, affinity_target, volume_present, labelled))| {
                GeneratedClaim {
                    namespace,
                    phase,
                    bytes,
                    measured,
                    modes,
                    driver,
                    affinity,
                    affinity_target,
                    volume_present,
                    labelled,
                }
            },
        )
}

fn pod_strategy() -> impl Strategy<Value = GeneratedPod> {
    (
        0..NAMESPACES.len(),
        prop::option::weighted(0.9, 0..10usize),
        prop_oneof![
            6 => Just(PodPhase::Running),
            1 => Just(PodPhase::Pending),
            1 => Just(PodPhase::Succeeded),
            1 => Just(PodPhase::Failed),
            1 => Just(PodPhase::Unknown),
        ],
        prop::collection::vec(0..40usize, 0..4),
    )
        .prop_map(|(namespace, node, phase, claims)| GeneratedPod {
            namespace,
            node,
            phase,
            claims,
        })
}

fn build_cluster(
    nodes: &[GeneratedNode],
    claims: &[GeneratedClaim],
    pods: &[GeneratedPod],
    attachments: &[(usize, usize)],
) -> ClusterFacts {
    let mut facts = ClusterFacts::default();
    for (index, generated) in nodes.iter().enumerate() {
        let name = format!("n{index}");
        let mut node = NodeFacts::new(&name)
            .in_zone(format!("z{}", generated.zone))
            .with_label("kubernetes.io/hostname", &name);
        node.ready = generated.ready;
        node.unschedulable = generated.cordoned;
        if let Some(effect) = generated.taint {
            node = node.with_taint("t", effect);
        }
        if let Some((limit, has_cephfs)) = generated.csi {
            node = node.with_csi_driver(EBS, limit);
            if has_cephfs {
                node = node.with_csi_driver(CEPHFS, None);
            }
        }
        facts.nodes.push(node);
    }
    for (index, generated) in claims.iter().enumerate() {
        let name = format!("c{index}");
        let modes: Vec<AccessMode> = match generated.modes {
            0 => vec![AccessMode::ReadWriteOnce],
            1 => vec![AccessMode::ReadWriteMany],
            2 => vec![AccessMode::ReadOnlyMany],
            3 => vec![AccessMode::ReadWriteOncePod],
            _ => vec![AccessMode::ReadWriteOnce, AccessMode::ReadWriteMany],
        };
        let mut claim = ClaimFacts::bound(
            NAMESPACES[generated.namespace],
            &name,
            format!("pv{index}"),
            generated.bytes,
        )
        .with_phase(generated.phase)
        .with_access_modes(modes.clone());
        claim.measured_bytes = generated.measured;
        if generated.labelled {
            claim = claim.with_label("app", "a");
        }
        facts.claims.push(claim);
        if generated.volume_present {
            let mut volume = VolumeFacts::new(format!("pv{index}"));
            volume.access_modes = modes;
            match generated.driver {
                0 => volume = volume.with_csi(EBS, format!("h{index}")),
                1 => volume = volume.with_csi(CEPHFS, format!("h{index}")),
                _ => {}
            }
            match generated.affinity {
                1 => {
                    volume = volume.with_node_affinity(NodeSelector::label_in(
                        ZONE_LABEL,
                        [format!("z{}", generated.affinity_target % 3)],
                    ))
                }
                2 => {
                    volume = volume.with_node_affinity(NodeSelector::node_names([format!(
                        "n{}",
                        generated.affinity_target
                    )]))
                }
                _ => {}
            }
            facts.volumes.push(volume);
        }
    }
    for (index, generated) in pods.iter().enumerate() {
        facts.pods.push(PodFacts {
            namespace: NAMESPACES[generated.namespace].to_string(),
            name: format!("p{index}"),
            node: generated.node.map(|node| format!("n{node}")),
            phase: generated.phase,
            claims: generated
                .claims
                .iter()
                .map(|claim| format!("c{claim}"))
                .collect(),
            stage_pod: false,
        });
    }
    for &(node, claim) in attachments {
        let Some(volume) = facts
            .volumes
            .iter()
            .find(|volume| volume.name == format!("pv{claim}"))
        else {
            continue;
        };
        let Some(csi) = volume.csi.clone() else {
            continue;
        };
        if let Some(node) = facts.nodes.get_mut(node) {
            node.attached_volumes.push(csi);
        }
    }
    facts
}

fn cluster_strategy() -> impl Strategy<Value = ClusterFacts> {
    (
        prop::collection::vec(node_strategy(), 0..8),
        prop::collection::vec(claim_strategy(), 0..30),
        prop::collection::vec(pod_strategy(), 0..20),
        prop::collection::vec((0..8usize, 0..30usize), 0..8),
    )
        .prop_map(|(nodes, claims, pods, attachments)| {
            build_cluster(&nodes, &claims, &pods, &attachments)
        })
}

fn selection_strategy() -> impl Strategy<Value = Selection> {
    prop_oneof![
        Just(Selection::everything()),
        Just(Selection {
            namespaces: BTreeSet::from(["ns0".to_string(), "ns2".to_string()]),
            labels: LabelSelector::default(),
            names: BTreeSet::new(),
        }),
        Just(Selection {
            namespaces: BTreeSet::new(),
            labels: LabelSelector::parse("app=a").expect("selector"),
            names: BTreeSet::new(),
        }),
        Just(Selection {
            namespaces: BTreeSet::new(),
            labels: LabelSelector::default(),
            names: BTreeSet::from(["c1".to_string(), "c4".to_string()]),
        }),
    ]
}

/// What the test knows about the generated cluster, computed independently
/// of the planner.
struct Oracle<'f> {
    facts: &'f ClusterFacts,
    nodes: HashMap<&'f str, &'f NodeFacts>,
    volumes: HashMap<&'f str, &'f VolumeFacts>,
}

impl<'f> Oracle<'f> {
    fn new(facts: &'f ClusterFacts) -> Self {
        Oracle {
            facts,
            nodes: facts
                .nodes
                .iter()
                .map(|node| (node.name.as_str(), node))
                .collect(),
            volumes: facts
                .volumes
                .iter()
                .map(|volume| (volume.name.as_str(), volume))
                .collect(),
        }
    }

    fn volume(&self, claim: &ClaimFacts) -> Option<&'f VolumeFacts> {
        claim
            .volume
            .as_deref()
            .and_then(|name| self.volumes.get(name).copied())
    }

    fn live_users(&self, claim: &ClaimFacts) -> Vec<&'f PodFacts> {
        self.facts
            .pods
            .iter()
            .filter(|pod| {
                pod.namespace == claim.namespace
                    && pod.node.is_some()
                    && matches!(
                        pod.phase,
                        PodPhase::Pending | PodPhase::Running | PodPhase::Unknown
                    )
                    && pod.claims.contains(&claim.name)
            })
            .collect()
    }

    /// Node names the claim's volume is attached to.
    fn attached_nodes(&self, claim: &ClaimFacts) -> BTreeSet<String> {
        let mut nodes: BTreeSet<String> = self
            .live_users(claim)
            .iter()
            .filter_map(|pod| pod.node.clone())
            .collect();
        if let Some(csi) = self.volume(claim).and_then(|volume| volume.csi.as_ref()) {
            for node in &self.facts.nodes {
                if node.attached_volumes.contains(csi) {
                    nodes.insert(node.name.clone());
                }
            }
        }
        nodes
    }

    fn usable_for_attached(&self, claim: &ClaimFacts, node: &str) -> bool {
        let Some(node) = self.nodes.get(node) else {
            return false;
        };
        node.taint_with_effect(TaintEffect::NoExecute).is_none()
            && self
                .volume(claim)
                .and_then(|volume| volume.node_affinity.as_ref())
                .is_none_or(|affinity| affinity.matches(node))
    }

    /// Distinct (driver, handle) attached to a node before planning.
    fn attached_before(&self, node: &NodeFacts) -> BTreeSet<(String, String)> {
        let mut attached: BTreeSet<(String, String)> = node
            .attached_volumes
            .iter()
            .map(|csi| (csi.driver.clone(), csi.handle.clone()))
            .collect();
        for claim in &self.facts.claims {
            let Some(csi) = self.volume(claim).and_then(|volume| volume.csi.as_ref()) else {
                continue;
            };
            if self
                .live_users(claim)
                .iter()
                .any(|pod| pod.node.as_deref() == Some(node.name.as_str()))
            {
                attached.insert((csi.driver.clone(), csi.handle.clone()));
            }
        }
        attached
    }

    fn takes_new_volumes(node: &NodeFacts) -> bool {
        node.ready
            && !node.unschedulable
            && node.taint_with_effect(TaintEffect::NoSchedule).is_none()
            && node.taint_with_effect(TaintEffect::NoExecute).is_none()
    }
}

fn claim_by_key<'f>(facts: &'f ClusterFacts, namespace: &str, name: &str) -> &'f ClaimFacts {
    facts
        .claims
        .iter()
        .find(|claim| claim.namespace == namespace && claim.name == name)
        .expect("planned claims exist")
}

/// What a property check returns: `Err` names the broken rule.
type Property = Result<(), TestCaseError>;

/// A generated cluster planned in full, with the oracle's view of it: what
/// each property check of a whole-cluster plan reads.
struct PlannedCluster<'f> {
    facts: &'f ClusterFacts,
    oracle: Oracle<'f>,
    plan: StagePlan,
}

impl<'f> PlannedCluster<'f> {
    fn new(facts: &'f ClusterFacts) -> Self {
        PlannedCluster {
            facts,
            oracle: Oracle::new(facts),
            plan: plan(facts),
        }
    }

    /// Each placed claim with the node of its stage pod, by namespace and name.
    fn placed_claims(&self) -> Vec<(&'f ClaimFacts, String)> {
        placements(&self.plan)
            .into_iter()
            .map(|((namespace, name), node)| (claim_by_key(self.facts, &namespace, &name), node))
            .collect()
    }

    /// Each entry of the plan's unplaceable list with its claim.
    fn unplaceable_claims(&self) -> impl Iterator<Item = (&UnplaceableClaim, &'f ClaimFacts)> {
        self.plan.unplaceable.iter().map(|entry| {
            (
                entry,
                claim_by_key(self.facts, &entry.namespace, &entry.pvc),
            )
        })
    }
}

/// New attachments per (node, driver) made by the plan, and whether each
/// node still has room for one more of that driver afterwards.
fn new_attachments(oracle: &Oracle, plan: &StagePlan) -> HashMap<(String, String), u32> {
    let mut counts = HashMap::new();
    for pod in &plan.stage_pods {
        let node = oracle.nodes[pod.node.as_str()];
        let before = oracle.attached_before(node);
        for volume_name in &pod.volumes {
            let claim = claim_by_key(oracle.facts, &pod.namespace, volume_name);
            if let Some(csi) = oracle.volume(claim).and_then(|volume| volume.csi.as_ref())
                && !before.contains(&(csi.driver.clone(), csi.handle.clone()))
            {
                *counts
                    .entry((pod.node.clone(), csi.driver.clone()))
                    .or_insert(0) += 1;
            }
        }
    }
    counts
}

fn room_left(
    oracle: &Oracle,
    counts: &HashMap<(String, String), u32>,
    node: &NodeFacts,
    driver: &str,
) -> bool {
    let Some(limit) = node
        .csi_drivers
        .as_ref()
        .and_then(|drivers| drivers.get(driver).copied().flatten())
    else {
        return true;
    };
    let before = oracle
        .attached_before(node)
        .iter()
        .filter(|(d, _)| d == driver)
        .count() as u32;
    let added = counts
        .get(&(node.name.clone(), driver.to_string()))
        .copied()
        .unwrap_or(0);
    before + added < limit
}

fn every_selected_claim_appears_once(
    facts: &ClusterFacts,
    selection: &Selection,
    plan: &StagePlan,
) -> Result<(), TestCaseError> {
    let mut seen: BTreeMap<(String, String), usize> = BTreeMap::new();
    for pod in &plan.stage_pods {
        prop_assert!(!pod.volumes.is_empty());
        let bytes: u64 = pod
            .volumes
            .iter()
            .map(|name| claim_by_key(facts, &pod.namespace, name).bytes())
            .sum();
        prop_assert_eq!(pod.bytes, bytes);
        for volume in &pod.volumes {
            *seen
                .entry((pod.namespace.clone(), volume.clone()))
                .or_default() += 1;
        }
    }
    for entry in &plan.unplaceable {
        *seen
            .entry((entry.namespace.clone(), entry.pvc.clone()))
            .or_default() += 1;
    }
    let selected: BTreeSet<(String, String)> = facts
        .claims
        .iter()
        .filter(|claim| selection.selects(&claim.namespace, &claim.name, &claim.labels))
        .map(|claim| (claim.namespace.clone(), claim.name.clone()))
        .collect();
    prop_assert_eq!(seen.keys().cloned().collect::<BTreeSet<_>>(), selected);
    prop_assert!(
        seen.values().all(|&count| count == 1),
        "a claim appears twice: {:?}",
        seen
    );
    let pod_keys: BTreeSet<_> = plan
        .stage_pods
        .iter()
        .map(|pod| (&pod.namespace, &pod.node))
        .collect();
    prop_assert_eq!(
        pod_keys.len(),
        plan.stage_pods.len(),
        "one stage pod per namespace and node"
    );
    Ok(())
}

fn exclusive_attached_volumes_stay_on_their_node(cluster: &PlannedCluster) -> Property {
    let oracle = &cluster.oracle;
    for (claim, node_name) in cluster.placed_claims() {
        let attached = oracle.attached_nodes(claim);
        if !claim.is_shared() && !attached.is_empty() {
            prop_assert!(
                attached.contains(&node_name),
                "exclusive {} moved off its node",
                claim_name(claim)
            );
        }
    }
    // A volume attached to a node a stage pod can use is never left out
    // (unless ReadWriteOncePod in use).
    for (entry, claim) in cluster.unplaceable_claims() {
        if claim.phase == ClaimPhase::Bound
            && oracle.volume(claim).is_some()
            && !claim.is_single_pod()
        {
            let usable: Vec<_> = oracle
                .attached_nodes(claim)
                .into_iter()
                .filter(|node| oracle.usable_for_attached(claim, node))
                .collect();
            prop_assert!(
                usable.is_empty(),
                "{}/{} attached to usable {:?} but unplaceable: {}",
                entry.namespace,
                entry.pvc,
                usable,
                entry.reason
            );
        }
    }
    Ok(())
}

fn single_pod_volumes_in_use_ask_to_quiesce(cluster: &PlannedCluster) -> Property {
    let oracle = &cluster.oracle;
    for (claim, _) in cluster.placed_claims() {
        if claim.is_single_pod() {
            prop_assert!(
                oracle.live_users(claim).is_empty(),
                "ReadWriteOncePod in use was placed"
            );
        }
    }
    for (entry, claim) in cluster.unplaceable_claims() {
        if claim.phase == ClaimPhase::Bound
            && claim.is_single_pod()
            && oracle.volume(claim).is_some()
            && !oracle.live_users(claim).is_empty()
        {
            prop_assert!(
                entry.reason.to_string().contains("quiesce"),
                "{}",
                entry.reason
            );
        }
    }
    Ok(())
}

/// A claim as `namespace/name`, for the properties' messages.
fn claim_name(claim: &ClaimFacts) -> String {
    format!("{}/{}", claim.namespace, claim.name)
}

fn shared_volumes_prefer_a_ready_node_they_are_attached_to(cluster: &PlannedCluster) -> Property {
    let oracle = &cluster.oracle;
    for (claim, node_name) in cluster.placed_claims() {
        if !claim.is_shared() {
            continue;
        }
        // Preference: a ready node it is attached to, else a new
        // attachment, else an unready node it is attached to.
        let attached = oracle.attached_nodes(claim);
        let node = oracle.nodes[node_name.as_str()];
        let ready_attached = attached.iter().any(|other| {
            oracle.usable_for_attached(claim, other) && oracle.nodes[other.as_str()].ready
        });
        if ready_attached {
            prop_assert!(
                attached.contains(&node_name) && node.ready,
                "shared {} not on a ready attached node",
                claim_name(claim)
            );
        } else if attached.contains(&node_name) {
            prop_assert!(
                oracle.usable_for_attached(claim, &node_name),
                "shared {} on an unusable attached node",
                claim_name(claim)
            );
        }
    }
    Ok(())
}

fn placed_volumes_are_on_nodes_they_may_use(cluster: &PlannedCluster) -> Property {
    let oracle = &cluster.oracle;
    for (claim, node_name) in cluster.placed_claims() {
        let node = oracle.nodes.get(node_name.as_str()).copied();
        prop_assert!(node.is_some(), "stage pod on unknown node {}", node_name);
        let node = node.expect("checked");
        prop_assert_eq!(claim.phase, ClaimPhase::Bound);
        let volume = oracle.volume(claim);
        prop_assert!(volume.is_some());
        if let Some(affinity) = volume.and_then(|volume| volume.node_affinity.as_ref()) {
            prop_assert!(
                affinity.matches(node),
                "{} outside its node affinity on {}",
                claim_name(claim),
                node_name
            );
        }
        if let (Some(csi), Some(drivers)) = (
            volume.and_then(|volume| volume.csi.as_ref()),
            &node.csi_drivers,
        ) {
            prop_assert!(
                drivers.contains_key(&csi.driver)
                    || oracle.attached_nodes(claim).contains(&node_name),
                "new {} volume on a node without the driver",
                csi.driver
            );
        }
    }
    Ok(())
}

fn unavailable_nodes_take_only_attached_volumes(cluster: &PlannedCluster) -> Property {
    let oracle = &cluster.oracle;
    for (claim, node_name) in cluster.placed_claims() {
        let node = oracle.nodes[node_name.as_str()];
        prop_assert!(
            node.taint_with_effect(TaintEffect::NoExecute).is_none(),
            "NoExecute node {} used",
            node_name
        );
        if !Oracle::takes_new_volumes(node) {
            prop_assert!(
                oracle.attached_nodes(claim).contains(&node_name),
                "{} is new on unavailable node {}",
                claim_name(claim),
                node_name
            );
        }
    }
    Ok(())
}

fn attach_limits_hold(cluster: &PlannedCluster) -> Property {
    let oracle = &cluster.oracle;
    // A node that got new volumes of a driver stays within its limit,
    // counting what was attached before.
    for ((node_name, driver), added) in &new_attachments(oracle, &cluster.plan) {
        let node = oracle.nodes[node_name.as_str()];
        if let Some(limit) = node
            .csi_drivers
            .as_ref()
            .and_then(|drivers| drivers.get(driver).copied().flatten())
        {
            let before = oracle
                .attached_before(node)
                .iter()
                .filter(|(d, _)| d == driver)
                .count() as u32;
            prop_assert!(
                before + added <= limit,
                "{} has {} + {} {} volumes, limit {}",
                node_name,
                before,
                added,
                driver,
                limit
            );
        }
    }
    Ok(())
}

fn pending_and_lost_claims_name_their_phase(cluster: &PlannedCluster) -> Property {
    for (entry, claim) in cluster.unplaceable_claims() {
        let reason = entry.reason.to_string();
        match claim.phase {
            ClaimPhase::Pending => prop_assert!(reason.contains("Pending"), "{}", reason),
            ClaimPhase::Lost => prop_assert!(reason.contains("Lost"), "{}", reason),
            ClaimPhase::Bound => {}
        }
    }
    Ok(())
}

/// The last movable volume placed on a node (smallest, then last by
/// namespace and name) could not go to any other node it was allowed on
/// without that node ending at least as loaded.
fn no_single_move_lowers_the_peak(cluster: &PlannedCluster) -> Property {
    let (facts, oracle, plan) = (cluster.facts, &cluster.oracle, &cluster.plan);
    let counts = new_attachments(oracle, plan);
    let mut loads: HashMap<&str, u64> = HashMap::new();
    for pod in &plan.stage_pods {
        *loads.entry(pod.node.as_str()).or_default() += pod.bytes;
    }
    let mut movable_by_node: BTreeMap<String, Vec<&ClaimFacts>> = BTreeMap::new();
    for (claim, node_name) in cluster.placed_claims() {
        let pinned = !claim.is_shared() && !oracle.attached_nodes(claim).is_empty();
        if !pinned {
            movable_by_node.entry(node_name).or_default().push(claim);
        }
    }
    for (node_name, claims) in movable_by_node {
        let Some(last) = claims.into_iter().min_by(|left, right| {
            left.bytes()
                .cmp(&right.bytes())
                .then((&right.namespace, &right.name).cmp(&(&left.namespace, &left.name)))
        }) else {
            continue;
        };
        let attached = oracle.attached_nodes(last);
        let volume = oracle.volume(last).expect("placed claims have volumes");
        let candidates: Vec<&NodeFacts> = if attached.contains(&node_name) {
            let usable: Vec<&NodeFacts> = attached
                .iter()
                .filter(|node| oracle.usable_for_attached(last, node))
                .map(|node| oracle.nodes[node.as_str()])
                .collect();
            // Ready attached nodes are preferred over unready ones, which
            // are only used when no node takes a new attachment.
            if usable.iter().any(|node| node.ready) {
                usable.into_iter().filter(|node| node.ready).collect()
            } else {
                usable
            }
        } else {
            facts
                .nodes
                .iter()
                .filter(|node| Oracle::takes_new_volumes(node))
                .filter(|node| {
                    volume
                        .node_affinity
                        .as_ref()
                        .is_none_or(|affinity| affinity.matches(node))
                })
                .filter(|node| match (&volume.csi, &node.csi_drivers) {
                    (Some(csi), Some(drivers)) => {
                        drivers.contains_key(&csi.driver)
                            && room_left(oracle, &counts, node, &csi.driver)
                    }
                    _ => true,
                })
                .collect()
        };
        let load_here = loads[node_name.as_str()];
        for other in candidates
            .into_iter()
            .filter(|other| other.name != node_name)
        {
            let load_there = loads.get(other.name.as_str()).copied().unwrap_or(0);
            prop_assert!(
                load_there + last.bytes() >= load_here,
                "moving {}/{} ({} bytes) from {} ({}) to {} ({}) would lower the peak",
                last.namespace,
                last.name,
                last.bytes(),
                node_name,
                load_here,
                other.name,
                load_there
            );
        }
    }
    Ok(())
}

fn shuffled(facts: ClusterFacts) -> impl Strategy<Value = ClusterFacts> {
    (
        Just(facts.nodes).prop_shuffle(),
        Just(facts.pods).prop_shuffle(),
        Just(facts.claims).prop_shuffle(),
        Just(facts.volumes).prop_shuffle(),
        Just(facts.storage_classes).prop_shuffle(),
    )
        .prop_map(
            |(nodes, pods, claims, volumes, storage_classes)| ClusterFacts {
                nodes,
                pods,
                claims,
                volumes,
                storage_classes,
            },
        )
}

/// One property test a rule of whole-cluster plans: each plans a generated
/// cluster in full and runs the named check on it.
macro_rules! whole_cluster_properties {
    ($($test:ident => $check:ident,)*) => {
        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            $(
                #[test]
                fn $test(facts in cluster_strategy()) {
                    $check(&PlannedCluster::new(&facts))?;
                }
            )*
        }
    };
}

whole_cluster_properties! {
    exclusive_volumes_are_read_where_they_are_attached => exclusive_attached_volumes_stay_on_their_node,
    read_write_once_pod_volumes_in_use_are_left_for_quiescing => single_pod_volumes_in_use_ask_to_quiesce,
    shared_volumes_are_read_once_from_a_ready_attached_node => shared_volumes_prefer_a_ready_node_they_are_attached_to,
    volumes_land_within_their_node_affinity_and_driver => placed_volumes_are_on_nodes_they_may_use,
    unavailable_nodes_get_no_new_volumes_and_no_execute_nodes_none => unavailable_nodes_take_only_attached_volumes,
    csi_attach_limits_are_never_exceeded => attach_limits_hold,
    pending_and_lost_claims_are_unplaceable_with_their_phase => pending_and_lost_claims_name_their_phase,
    movable_volumes_are_balanced_by_bytes => no_single_move_lowers_the_peak,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_selected_claim_is_in_one_stage_pod_or_unplaceable(
        facts in cluster_strategy(),
        selection in selection_strategy(),
    ) {
        let plan = plan_stage_pods(&facts, &selection).expect("generated facts have no duplicates");
        every_selected_claim_appears_once(&facts, &selection, &plan)?;
    }

    #[test]
    fn backup_plans_do_not_depend_on_input_order(
        (facts, reordered) in cluster_strategy().prop_flat_map(|facts| (Just(facts.clone()), shuffled(facts)))
    ) {
        let first = plan(&facts);
        let second = plan(&reordered);
        prop_assert_eq!(
            serde_json::to_string(&first).expect("plan serialises"),
            serde_json::to_string(&second).expect("plan serialises")
        );
    }

    #[test]
    fn restore_plans_place_every_claim_within_its_class_topology(
        nodes in prop::collection::vec(node_strategy(), 0..8),
        claims in prop::collection::vec((0..NAMESPACES.len(), 0..4usize, 0..1000u64), 0..30),
    ) {
        let mut facts = build_cluster(&nodes, &[], &[], &[]);
        let mut zonal = StorageClassFacts::new("zonal", EBS);
        zonal.allowed_topologies = Some(NodeSelector::label_in(ZONE_LABEL, ["z0", "z1"]));
        let mut shared = StorageClassFacts::new("shared", CEPHFS);
        shared.is_default = true;
        let local = StorageClassFacts::new("local", "kubernetes.io/no-provisioner");
        facts.storage_classes = vec![zonal.clone(), shared, local];
        let restore: Vec<RestoreClaim> = claims
            .iter()
            .enumerate()
            .map(|(index, (namespace, class, bytes))| {
                let claim = RestoreClaim::new(NAMESPACES[*namespace], format!("r{index}"), *bytes);
                match class {
                    0 => claim.with_storage_class("zonal"),
                    1 => claim.with_storage_class("local"),
                    2 => claim.with_storage_class("missing"),
                    _ => claim,
                }
            })
            .collect();
        let plan = plan_restore(&facts, &restore).expect("no duplicates");
        let reversed: Vec<RestoreClaim> = restore.iter().rev().cloned().collect();
        prop_assert_eq!(&plan_restore(&facts, &reversed).expect("no duplicates"), &plan);
        let placed = placements(&plan);
        prop_assert_eq!(placed.len() + plan.unplaceable.len(), restore.len());
        let nodes: HashMap<&str, &NodeFacts> = facts.nodes.iter().map(|node| (node.name.as_str(), node)).collect();
        let mut per_driver: HashMap<(String, &str), u32> = HashMap::new();
        for claim in &restore {
            let key = (claim.namespace.clone(), claim.name.clone());
            let class = claim.storage_class.as_deref().unwrap_or("shared");
            match placed.get(&key) {
                Some(node_name) => {
                    let node = nodes[node_name.as_str()];
                    prop_assert!(Oracle::takes_new_volumes(node));
                    prop_assert!(class != "missing");
                    if class == "zonal" {
                        prop_assert!(zonal.allowed_topologies.as_ref().is_some_and(|topology| topology.matches(node)));
                    }
                    let driver = match class { "zonal" => Some(EBS), "shared" => Some(CEPHFS), _ => None };
                    if let Some(driver) = driver {
                        *per_driver.entry((node_name.clone(), driver)).or_default() += 1;
                        if let Some(drivers) = &node.csi_drivers {
                            prop_assert!(drivers.contains_key(driver));
                        }
                    }
                }
                None => {
                    let reason = reason_of(&plan, &claim.namespace, &claim.name).expect("unplaceable");
                    if class == "missing" {
                        prop_assert!(reason.contains("storage class missing"), "{}", reason);
                    } else {
                        prop_assert!(reason.starts_with("no node can take it"), "{}", reason);
                    }
                }
            }
        }
        for ((node_name, driver), count) in per_driver {
            let limit = nodes[node_name.as_str()].csi_drivers.as_ref().and_then(|drivers| drivers.get(driver).copied().flatten());
            prop_assert!(limit.is_none_or(|limit| count <= limit), "{} over its {} limit", node_name, driver);
        }
    }
}
