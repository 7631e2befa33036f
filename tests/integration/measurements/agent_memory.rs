//! An agent's peak resident memory with one and with four (or
//! `HAULAGE_AGENT_CLAIMS`) large claims in its stage pod
//! (docs/benchmarks.md, "Agent memory with large claims").

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
/// agent moves as many at once as the default 128Mi request holds (four;
/// the node's cap is lifted for the measurement), each engine in an equal
/// part of the budget. 256 MiB of sample data per claim (`HAULAGE_AGENT_MEMORY_MIB`
/// for another size; a quarter small files, the rest random, log-like and
/// duplicated), one node, one VolumeBackup after the other so the caps do
/// not mix them. The kubelet stand-in samples `VmHWM` every 100 ms. Uses
/// the debug `mover-agent` next to the test unless `$HAULAGE_AGENT_BIN`
/// names another. Run with
/// `cargo build -p mover-agent && cargo test --test integration
/// measurements::agent_memory -- --ignored --nocapture`. Then the four
/// claims' snapshots restored by a VolumeRestore into new claims of
/// another namespace (one stage pod, each volume verified).
///
/// `HAULAGE_AGENT_INDEX_BLOBS=N` first writes index files of N blobs (of
/// packs never stored) into the repository, as a location many claims
/// were backed up into has, and waits for the location's probe to count
/// them; `HAULAGE_AGENT_MEMORY_REQUEST=192Mi` gives the stage pods that
/// memory request through a StoragePolicy. `HAULAGE_AGENT_STAGGER=1`
/// leaves only the files under 1 MiB in the first of the four claims, so
/// that it ends well before the others and the next volume starts (and
/// loads the index, with the index files the first one wrote) while the
/// volumes started with it still run. `HAULAGE_AGENT_CLAIMS=10` puts ten
/// claims in the second stage pod instead of four (with
/// `HAULAGE_AGENT_MEMORY_REQUEST=1Gi`, all ten move at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~1 min and 2.5 GiB of temporary disk with four claims), not a check"]
async fn measure_agent_memory_of_one_and_of_several_large_claims_in_a_stage_pod()
-> anyhow::Result<()> {
    let volume_bytes: u64 = std::env::var("HAULAGE_AGENT_MEMORY_MIB")
        .ok()
        .and_then(|mib| mib.parse::<u64>().ok())
        .unwrap_or(256)
        << 20;
    let claims_at_once: u32 = std::env::var("HAULAGE_AGENT_CLAIMS")
        .ok()
        .and_then(|claims| claims.parse().ok())
        .unwrap_or(4);
    let layout = Layout {
        namespaces: vec!["solo".to_string(), "pair".to_string()],
        claims: (0..=claims_at_once)
            .map(|index| {
                let namespace = if index == 0 { "solo" } else { "pair" };
                (
                    namespace.to_string(),
                    format!("data-{index}"),
                    "ReadWriteOnce",
                    2000 + u64::from(index),
                )
            })
            .collect(),
        nodes: vec!["node-0".to_string()],
        app_pods: Vec::new(),
    };
    let fixture = Fixture::builder()
        .layout(layout)
        .volume_bytes(volume_bytes)
        .max_volumes_per_node(None)
        .provisioning()
        .start()
        .await?;
    let client = &fixture.client;
    if let Some(blobs) = std::env::var("HAULAGE_AGENT_INDEX_BLOBS")
        .ok()
        .and_then(|blobs| blobs.parse::<u32>().ok())
    {
        let index_bytes = fixture.write_index_of_unstored_blobs(blobs).await?;
        fixture.location_index_bytes_at_least(index_bytes).await?;
        println!("index files of {blobs} blobs: {index_bytes} bytes");
    }
    if let Ok(request) = std::env::var("HAULAGE_AGENT_MEMORY_REQUEST") {
        crate::support::fixture::create_storage_policy(
            client,
            "measured-request",
            json!({"provisioners": [crate::support::fixture::PROVISIONER],
                "stagePodResources": {"requests": {"memory": request}}}),
        )
        .await?;
    }
    if std::env::var_os("HAULAGE_AGENT_STAGGER").is_some() {
        let kept = keep_small_files(&fixture.volumes.join("pair").join("data-1"))?;
        println!("pair/data-1 cut to its files under 1 MiB: {kept} B");
    }
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for (name, namespace, claims) in [("one", "solo", 1), ("at-once", "pair", claims_at_once)] {
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
            "{claims} claim(s) of {volume_bytes} B in one stage pod: backup Completed in \
             {:.1} s, agent peak RSS {:.1} MiB",
            started.elapsed().as_secs_f64(),
            peak as f64 / f64::from(1 << 20)
        );
    }
    // The claims restored into new claims of another namespace, by
    // one stage pod moving as many at once as its memory holds, each
    // verified after it is written.
    let started = Instant::now();
    create::<haulage::api::VolumeRestore>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeRestore",
            "metadata": {"name": "at-once", "namespace": SYSTEM_NAMESPACE},
            "spec": {"source": {"backup": "at-once"},
                "namespaceMap": {"pair": "pair-b"}, "createNamespaces": true}}),
    )
    .await?;
    fixture
        .completed_restore("at-once", Duration::from_secs(900))
        .await?;
    let peak = fixture
        .kubelet
        .agent_peak_memory()
        .into_iter()
        .filter(|((pod_namespace, _), _)| pod_namespace == "pair-b")
        .map(|(_, bytes)| bytes)
        .max()
        .context("no restoring agent memory sampled")?;
    println!(
        "{claims_at_once} claim(s) of {volume_bytes} B restored by one stage pod: restore Completed in \
         {:.1} s, agent peak RSS {:.1} MiB",
        started.elapsed().as_secs_f64(),
        peak as f64 / f64::from(1 << 20)
    );
    // How many volumes each agent moved at once, and what each volume's
    // index load added to its memory, in its own words.
    for needle in [
        "volumes planned within the memory budget",
        "loaded the repository's index",
    ] {
        for line in fixture.kubelet.agent_log_lines_containing(needle) {
            println!("{line}");
        }
    }
    println!(
        "agent {}",
        crate::support::kubelet::agent_binary()?.display()
    );
    fixture.stop().await;
    Ok(())
}

/// Remove the files of 1 MiB or more under `directory`; the bytes left.
fn keep_small_files(directory: &std::path::Path) -> anyhow::Result<u64> {
    let mut kept = 0;
    for entry in std::fs::read_dir(directory)? {
        let entry = entry?;
        let metadata = entry.metadata()?;
        if metadata.is_dir() {
            kept += keep_small_files(&entry.path())?;
        } else if metadata.len() >= 1 << 20 {
            std::fs::remove_file(entry.path())?;
        } else {
            kept += metadata.len();
        }
    }
    Ok(kept)
}
