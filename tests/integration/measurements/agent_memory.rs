//! An agent's peak resident memory with one and with four large claims in
//! its stage pod (docs/benchmarks.md, "Agent memory with large claims").

use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::VolumeBackup;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use kube::api::Api;
use serde_json::json;

use crate::support::fixture::{Fixture, Layout, create, final_phase};

/// An agent's peak resident memory backing up large claims: first a stage
/// pod with one claim (one engine), then one with four claims, which its
/// agent moves as its `--parallel-volumes` default says (one at a time
/// since the first measurement showed two at once peaking at 200–247 MiB).
/// 256 MiB of sample data per
/// claim (a quarter small files, the rest random, log-like and duplicated),
/// one node, one VolumeBackup after the other so the caps do not mix them.
/// The kubelet stand-in samples `VmHWM` every 100 ms. Uses the debug
/// `mover-agent` next to the test unless `$HAULAGE_AGENT_BIN` names
/// another. Run with
/// `cargo build -p mover-agent && cargo test --test integration
/// measurements::agent_memory -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~1 min, 2.5 GiB of temporary disk), not a check"]
async fn measure_agent_memory_of_one_and_of_four_large_claims_in_a_stage_pod() -> anyhow::Result<()>
{
    const VOLUME_BYTES: u64 = 256 << 20;
    let layout = Layout {
        namespaces: vec!["solo".to_string(), "pair".to_string()],
        claims: (0..5)
            .map(|index| {
                let namespace = if index == 0 { "solo" } else { "pair" };
                (
                    namespace.to_string(),
                    format!("data-{index}"),
                    "ReadWriteOnce",
                    2000 + index,
                )
            })
            .collect(),
        nodes: vec!["node-0".to_string()],
        app_pods: Vec::new(),
    };
    let fixture = Fixture::builder()
        .layout(layout)
        .volume_bytes(VOLUME_BYTES)
        .start()
        .await?;
    let client = &fixture.client;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for (name, namespace, claims) in [("one", "solo", 1), ("two-at-once", "pair", 4)] {
        let started = Instant::now();
        create::<VolumeBackup>(
            client,
            Some(SYSTEM_NAMESPACE),
            json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
                "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
                "spec": {"namespaces": [namespace],
                    "selector": {"matchLabels": {"backup": "yes"}}}}),
        )
        .await?;
        let backup =
            final_phase(&backups, &fixture.kubelet, name, Duration::from_secs(900)).await?;
        let status = backup.status.context("status")?;
        assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
        let peak = fixture
            .kubelet
            .agent_peak_memory()
            .into_iter()
            .filter(|((pod_namespace, _), _)| pod_namespace == namespace)
            .map(|(_, bytes)| bytes)
            .max()
            .context("no agent memory sampled")?;
        println!(
            "{claims} claim(s) of {VOLUME_BYTES} B in one stage pod: backup Completed in \
             {:.1} s, agent peak RSS {:.1} MiB",
            started.elapsed().as_secs_f64(),
            peak as f64 / f64::from(1 << 20)
        );
    }
    println!(
        "agent {}",
        crate::support::kubelet::agent_binary()?.display()
    );
    fixture.stop().await;
    Ok(())
}
