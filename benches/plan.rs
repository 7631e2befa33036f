//! Planner speed: backup plans for 1k, 10k and 100k claims (nodes and
//! namespaces scaled alongside: 10k claims in 200 namespaces on 1,000 nodes
//! is the target, under 100 ms), and a 10k-claim restore plan.
//!
//! The clusters are synthetic but shaped like real ones: three zones, EBS
//! style zonal disks with an attach limit of 39, Ceph RBD and CephFS
//! volumes, local volumes pinned to their node, half the claims in use, a
//! few cordoned, not-ready and draining nodes, a few Pending claims.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use haulage::plan::facts::{
    AccessMode, ClaimFacts, ClaimPhase, ClusterFacts, NodeFacts, NodeSelector, PodFacts,
    StorageClassFacts, TaintEffect, VolumeFacts, ZONE_LABEL,
};
use haulage::plan::{RestoreClaim, Selection, plan_restore, plan_stage_pods};

const EBS: &str = "ebs.csi.aws.com";
const RBD: &str = "rbd.csi.ceph.com";
const CEPHFS: &str = "cephfs.csi.ceph.com";
const GIB: u64 = 1 << 30;

/// A small deterministic generator (64-bit LCG), so every run plans the
/// same cluster.
struct Sequence(u64);

impl Sequence {
    fn next(&mut self, bound: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % bound as u64) as usize
    }
}

fn synthetic_cluster(claims: usize, nodes: usize, namespaces: usize) -> ClusterFacts {
    let mut sequence = Sequence(7);
    let mut facts = ClusterFacts::default();
    for index in 0..nodes {
        let name = format!("node-{index:05}");
        let mut node = NodeFacts::new(&name)
            .in_zone(format!("zone-{}", index % 3))
            .with_label("kubernetes.io/hostname", &name)
            .with_csi_driver(EBS, Some(39))
            .with_csi_driver(RBD, None)
            .with_csi_driver(CEPHFS, None);
        match index % 100 {
            0 | 1 => node = node.cordoned(),
            2 => node = node.not_ready(),
            3 => node = node.with_taint("drain", TaintEffect::NoExecute),
            _ => {}
        }
        facts.nodes.push(node);
    }
    for index in 0..claims {
        let namespace = format!("team-{:04}", index % namespaces);
        let name = format!("data-{index}");
        let volume_name = format!("pv-{index}");
        let bytes = (1 + sequence.next(500) as u64) * GIB;
        let zone = sequence.next(3);
        let mut claim = ClaimFacts::bound(&namespace, &name, &volume_name, bytes);
        let mut volume = VolumeFacts::new(&volume_name);
        let mut user_nodes = Vec::new();
        let in_use = sequence.next(2) == 0;
        let zonal_node =
            |sequence: &mut Sequence| (sequence.next(nodes / 3) * 3 + zone).min(nodes - 1);
        match index % 10 {
            0..=3 => {
                volume = volume
                    .with_csi(EBS, format!("vol-{index}"))
                    .with_node_affinity(NodeSelector::label_in(
                        ZONE_LABEL,
                        [format!("zone-{zone}")],
                    ));
                if in_use {
                    user_nodes.push(zonal_node(&mut sequence));
                }
            }
            4..=6 => {
                volume = volume.with_csi(RBD, format!("rbd-{index}"));
                if in_use {
                    user_nodes.push(sequence.next(nodes));
                }
            }
            7 | 8 => {
                claim = claim.with_access_modes([AccessMode::ReadWriteMany]);
                volume = volume.with_csi(CEPHFS, format!("subvolume-{index}"));
                if in_use {
                    user_nodes.push(sequence.next(nodes));
                    user_nodes.push(sequence.next(nodes));
                }
            }
            _ => {
                let node = sequence.next(nodes);
                volume = volume
                    .with_node_affinity(NodeSelector::node_names([format!("node-{node:05}")]));
                if in_use {
                    user_nodes.push(node);
                }
            }
        }
        if index % 100 == 99 {
            claim = claim.with_phase(ClaimPhase::Pending);
        }
        for (replica, node) in user_nodes.into_iter().enumerate() {
            facts.pods.push(
                PodFacts::running(
                    &namespace,
                    format!("{name}-user-{replica}"),
                    format!("node-{node:05}"),
                )
                .mounting(&name),
            );
        }
        facts.claims.push(claim);
        facts.volumes.push(volume);
    }
    facts
}

fn backup_plans(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("plan_stage_pods");
    group.sample_size(10);
    for (claims, nodes, namespaces) in [
        (1_000, 100, 20),
        (10_000, 1_000, 200),
        (100_000, 10_000, 2_000),
    ] {
        let facts = synthetic_cluster(claims, nodes, namespaces);
        let selection = Selection::everything();
        group.throughput(Throughput::Elements(claims as u64));
        group.bench_with_input(
            BenchmarkId::new(
                "claims",
                format!("{claims}/{nodes}-nodes/{namespaces}-namespaces"),
            ),
            &facts,
            |bencher, facts| bencher.iter(|| plan_stage_pods(black_box(facts), &selection)),
        );
    }
    // Claims grow, nodes stay: no hidden claims × nodes term.
    let facts = synthetic_cluster(100_000, 1_000, 200);
    group.throughput(Throughput::Elements(100_000));
    group.bench_with_input(
        BenchmarkId::new("claims", "100000/1000-nodes/200-namespaces"),
        &facts,
        |bencher, facts| {
            bencher.iter(|| plan_stage_pods(black_box(facts), &Selection::everything()))
        },
    );
    group.finish();
}

fn restore_plans(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("plan_restore");
    group.sample_size(10);
    let mut facts = synthetic_cluster(0, 1_000, 1);
    let mut zonal = StorageClassFacts::new("gp3", EBS);
    zonal.allowed_topologies = Some(NodeSelector::label_in(ZONE_LABEL, ["zone-0", "zone-1"]));
    zonal.is_default = true;
    facts.storage_classes = vec![zonal, StorageClassFacts::new("rbd", RBD)];
    let claims: Vec<RestoreClaim> = (0..10_000)
        .map(|index| {
            let claim = RestoreClaim::new(
                format!("team-{:04}", index % 200),
                format!("data-{index}"),
                (1 + index % 97) * GIB,
            );
            if index % 2 == 0 {
                claim.with_storage_class("rbd")
            } else {
                claim
            }
        })
        .collect();
    group.throughput(Throughput::Elements(claims.len() as u64));
    group.bench_function("claims/10000/1000-nodes/200-namespaces", |bencher| {
        bencher.iter(|| plan_restore(black_box(&facts), black_box(&claims)))
    });
    group.finish();
}

criterion_group!(benches, backup_plans, restore_plans);
criterion_main!(benches);
