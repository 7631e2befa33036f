//! The controller binary's resident memory with 0, 1,000 and 10,000 PVCs in
//! its caches (docs/benchmarks.md, "Controller memory with 10,000 PVCs in
//! its caches").

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::labels::SYSTEM_NAMESPACE;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::support::fixture::{PROVISIONER, STORAGE_CLASS, controller_process, create};
use crate::support::health::wait_until_ready;
use crate::support::kube::KubeCluster;

/// `VmRSS` and `VmHWM` of a process, in bytes.
fn resident_memory(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|line| line.starts_with(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .context("no value")?
            .parse()?;
        Ok(kib * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// The `haulage controller` binary's resident memory with its caches
/// filled: 0, then 1,000, then 10,000 bound PVCs (each with its PV) in 10
/// namespaces, 100 Nodes and one Pod mounting a claim per 20 claims (50,
/// then 500), created with the admin client 32 at a time. At each step a
/// fresh controller process (the ServiceAccount's token, as the Deployment
/// runs it) is started, and 5 s after `/readyz` first answers 200 (every
/// cache has finished its first list) its `VmRSS` and `VmHWM` are read from
/// `/proc`. The binary is the debug build next to the test unless
/// `$HAULAGE_CONTROLLER_BIN` names another (a release build). Run with
/// `cargo test --test integration measurements::controller_memory -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~1 min), not a check"]
async fn measure_controller_memory_with_ten_thousand_claims_in_its_caches() -> anyhow::Result<()> {
    use futures::{StreamExt, TryStreamExt};
    const NAMESPACES: usize = 10;
    const NODES: usize = 100;
    const CLAIMS_PER_POD: usize = 20;
    const AT_ONCE: usize = 32;
    let binary = std::env::var_os("HAULAGE_CONTROLLER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_haulage")));
    let cluster = KubeCluster::start().await?;
    let client = cluster.client().await?;
    cluster.install_manifests().await?;
    let work = tempfile::tempdir()?;
    let kubeconfig = cluster
        .service_account_kubeconfig(
            SYSTEM_NAMESPACE,
            "haulage-controller",
            &work.path().join("controller.kubeconfig"),
        )
        .await?;
    for namespace in 0..NAMESPACES {
        create::<Namespace>(
            &client,
            None,
            json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": format!("bulk-{namespace}")}}),
        )
        .await?;
    }
    futures::stream::iter(0..NODES)
        .map(|node| {
            let client = client.clone();
            async move {
                create::<k8s_openapi::api::core::v1::Node>(
                    &client,
                    None,
                    json!({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": format!("bulk-node-{node:03}"),
                            "labels": {"kubernetes.io/hostname": format!("bulk-node-{node:03}")}}}),
                )
                .await
                .map(drop)
            }
        })
        .buffer_unordered(AT_ONCE)
        .try_collect::<Vec<()>>()
        .await?;

    let mut claims = 0;
    let mut rows = Vec::new();
    for target in [0_usize, 1_000, 10_000] {
        let creating = Instant::now();
        futures::stream::iter(claims..target)
            .map(|index| {
                let client = client.clone();
                async move {
                    let namespace = format!("bulk-{}", index % NAMESPACES);
                    let name = format!("claim-{index:05}");
                    let volume = format!("pv-{namespace}-{name}");
                    create::<PersistentVolume>(
                        &client,
                        None,
                        json!({"apiVersion": "v1", "kind": "PersistentVolume",
                            "metadata": {"name": volume},
                            "spec": {"capacity": {"storage": "1Gi"},
                                "accessModes": ["ReadWriteOnce"],
                                "persistentVolumeReclaimPolicy": "Retain",
                                "storageClassName": STORAGE_CLASS,
                                "csi": {"driver": PROVISIONER, "volumeHandle": volume},
                                "claimRef": {"namespace": namespace, "name": name}}}),
                    )
                    .await?;
                    create::<PersistentVolumeClaim>(
                        &client,
                        Some(&namespace),
                        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                            "metadata": {"name": name, "namespace": namespace,
                                "labels": {"backup": "yes"}},
                            "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": volume,
                                "storageClassName": STORAGE_CLASS,
                                "resources": {"requests": {"storage": "1Gi"}}}}),
                    )
                    .await?;
                    let claims: Api<PersistentVolumeClaim> =
                        Api::namespaced(client.clone(), &namespace);
                    claims
                        .patch_status(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(json!({"status": {"phase": "Bound",
                                "accessModes": ["ReadWriteOnce"],
                                "capacity": {"storage": "1Gi"}}})),
                        )
                        .await?;
                    if index % CLAIMS_PER_POD == 0 {
                        create::<Pod>(
                            &client,
                            Some(&namespace),
                            json!({"apiVersion": "v1", "kind": "Pod",
                                "metadata": {"name": format!("app-{index:05}"),
                                    "namespace": namespace},
                                "spec": {"nodeName": format!("bulk-node-{:03}", index % NODES),
                                    "containers": [{"name": "app", "image": "app:1",
                                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                                    "volumes": [{"name": "data",
                                        "persistentVolumeClaim": {"claimName": name}}]}}),
                        )
                        .await?;
                    }
                    Ok::<(), anyhow::Error>(())
                }
            })
            .buffer_unordered(AT_ONCE)
            .try_collect::<Vec<()>>()
            .await?;
        let created_in = creating.elapsed().as_secs_f64();
        claims = target;

        let port = crate::support::minio::free_port()?;
        let log_path = work.path().join(format!("controller-{target}.log"));
        let started = Instant::now();
        let mut controller = controller_process(
            &binary,
            &kubeconfig,
            "controller-memory",
            port,
            &log_path,
            &[],
        )?;
        let pid = controller.id().context("controller pid")?;
        wait_until_ready(port, Duration::from_secs(300))
            .await
            .with_context(|| {
                format!(
                    "the controller never became ready:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                )
            })?;
        let ready_in = started.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (rss, hwm) = resident_memory(pid)?;
        let _ = controller.kill().await;
        let mebibytes = |bytes: u64| bytes as f64 / f64::from(1 << 20);
        let row = format!(
            "| {target} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            target / CLAIMS_PER_POD,
            created_in,
            ready_in,
            mebibytes(rss),
            mebibytes(hwm)
        );
        println!("{row}");
        rows.push(row);
    }
    println!(
        "\n{}\n{NODES} nodes, {NAMESPACES} namespaces\n\
         | PVCs (and PVs) | pods | created in s | ready in s | VmRSS MiB | VmHWM MiB |\n\
         | --- | --- | --- | --- | --- | --- |\n{}",
        binary.display(),
        rows.join("\n")
    );
    Ok(())
}
