//! haulage installed the user's way on a real node: the images built from
//! this build (`tests/infra/build-images.sh`), `kubectl apply -k
//! manifests/`, the controller running as pods, stage pods scheduled by
//! kube-scheduler, run by a real kubelet with containerd and runc, reading
//! local PersistentVolumes that kube-controller-manager's PV controller
//! bound, and reaching kube-apiserver through kube-proxy and MinIO across
//! the node's network (support::node, docs/test-infra.md "A real node").
//!
//! The node is shared by the tests here (started once per test binary);
//! each test has its own namespaces, volumes, MinIO and storage location,
//! and removes them. The many-node scenarios stay on the kubelet stand-in
//! (controller.rs), which a single real node cannot host.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{
    BackupStorageLocation, BackupStorageLocationPhase, VolumeBackup, VolumeTransfer,
};
use haulage::engine::Repository;
use haulage::store::{DynStore, open_store};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::engine::support::{assert_snapshot_restores_as, random_bytes};
use crate::support::fixture::transfer_of;
use crate::support::minio::{ACCESS_KEY, MinioServer, REGION, SECRET_KEY};
use crate::support::node::{self, RealNode, cgroup_value};

const BUCKET: &str = "haulage-real-node";
/// Label selecting stage pods.
const STAGE_PODS: &str = "app.kubernetes.io/name=haulage-agent";
/// Generous: two shared cores, debug binaries in the images.
const DEADLINE: Duration = Duration::from_secs(300);

/// Poll `check` every 500 ms until it returns `Some`.
async fn eventually<T, F, Fut>(deadline: Duration, what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if start.elapsed() > deadline {
            bail!("{what}: not reached within {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Apply `objects` (a JSON list) with kubectl, as a user would.
async fn apply(node: &RealNode, objects: Vec<serde_json::Value>) -> anyhow::Result<()> {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    node.kubectl_ok(&["apply", "-f", "-"], Some(&list.to_string()))
        .await?;
    Ok(())
}

/// A local PersistentVolume on the node for each claim (data under
/// `node.volumes/NAMESPACE/CLAIM`, the node's local StorageClass) and the
/// claims, labelled `set: SET`; waits until the PV controller bound every
/// one.
async fn local_claims(
    node: &RealNode,
    client: &kube::Client,
    namespace: &str,
    claims: &[(&str, &str)],
) -> anyhow::Result<()> {
    let mut objects = Vec::new();
    for (claim, set) in claims {
        let path = node.volumes.join(namespace).join(claim);
        std::fs::create_dir_all(&path)?;
        objects.push(json!({"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": format!("{namespace}-{claim}")},
            "spec": {"capacity": {"storage": "2Gi"}, "accessModes": ["ReadWriteOnce"],
                "storageClassName": node.storage_class, "persistentVolumeReclaimPolicy": "Retain",
                "local": {"path": path},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In",
                     "values": [node.node_name]}]}]}}}}));
        objects.push(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace, "labels": {"set": set}},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": node.storage_class,
                "volumeName": format!("{namespace}-{claim}"),
                "resources": {"requests": {"storage": "2Gi"}}}}));
    }
    apply(node, objects).await?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    eventually(Duration::from_secs(60), "claims Bound", || async {
        let listed = pvcs.list(&ListParams::default()).await?;
        Ok(listed
            .items
            .iter()
            .all(|claim| {
                claim
                    .status
                    .as_ref()
                    .and_then(|status| status.phase.as_deref())
                    == Some("Bound")
            })
            .then_some(()))
    })
    .await
}

/// MinIO on the host side of the node's network (pods reach it there), an
/// initialised repository under `prefix`, its credentials in the Secret
/// `secret`, and a BackupStorageLocation for each of `locations` (name,
/// upload cap in bytes per second), waited for until Available.
async fn storage(
    node: &RealNode,
    client: &kube::Client,
    secret: &str,
    prefix: &str,
    locations: &[(&str, Option<u64>)],
) -> anyhow::Result<(MinioServer, DynStore)> {
    let minio = MinioServer::start_on(node.host_ip).await?;
    minio.create_bucket(BUCKET).await?;
    let store = open_store(&format!("s3://{BUCKET}/{prefix}"), &minio.store_options()).await?;
    Repository::init(store.clone(), haulage::engine::Encryption::None).await?;
    let mut objects = vec![json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": secret, "namespace": SYSTEM_NAMESPACE},
        "stringData": {"cloud": format!(
            "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")}})];
    for (location, cap) in locations {
        objects.push(
            json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
            "metadata": {"name": location, "namespace": SYSTEM_NAMESPACE},
            "spec": {"bucket": BUCKET, "prefix": prefix, "endpoint": minio.endpoint(),
                "region": REGION, "s3ForcePathStyle": true,
                "credential": {"name": secret, "key": "cloud"},
                "validationFrequency": "10s", "uploadBytesPerSecond": cap}}),
        );
    }
    apply(node, objects).await?;
    let api: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for (location, _) in locations {
        eventually(
            Duration::from_secs(90),
            &format!("BackupStorageLocation {location} Available"),
            || async {
                let status = api.get(location).await?.status;
                Ok((status.and_then(|status| status.phase)
                    == Some(BackupStorageLocationPhase::Available))
                .then_some(()))
            },
        )
        .await
        .with_context(|| {
            format!(
                "the controller could not reach MinIO at {}",
                minio.endpoint()
            )
        })?;
    }
    Ok((minio, store))
}

/// Create VolumeBackup `name` of the claims labelled `set` in `namespace`.
async fn backup(
    node: &RealNode,
    name: &str,
    namespace: &str,
    set: &str,
    location: &str,
) -> anyhow::Result<()> {
    apply(
        node,
        vec![
            json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"namespaces": [namespace], "selector": {"matchLabels": {"set": set}},
                "storageLocation": location}}),
        ],
    )
    .await
}

/// Wait until VolumeBackup `name` is final; fail with its status and the
/// controller's log if it is not Completed.
async fn completed(
    node: &RealNode,
    client: &kube::Client,
    name: &str,
) -> anyhow::Result<VolumeBackup> {
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let finished = eventually(DEADLINE, &format!("VolumeBackup {name} final"), || async {
        let backup = backups.get(name).await?;
        let phase = backup.status.as_ref().and_then(|status| status.phase);
        Ok(phase
            .is_some_and(|phase| phase.is_final())
            .then_some(backup))
    })
    .await;
    let backup = match finished {
        Ok(backup) => backup,
        Err(error) => {
            let status = backups
                .get(name)
                .await
                .ok()
                .and_then(|backup| backup.status);
            // The diagnostics first, the status on one line: a long
            // failure message is cut in its middle.
            bail!(
                "{error}\n{}\nstatus: {}",
                node.controller_logs().await,
                serde_json::to_string(&status)?
            )
        }
    };
    let status = backup.status.as_ref().context("status")?;
    if status.phase != Some(VolumeBackupPhase::Completed) {
        bail!(
            "VolumeBackup {name} ended {:?}\n{}\nstatus: {}",
            status.phase,
            node.controller_logs().await,
            serde_json::to_string(status)?
        );
    }
    Ok(backup)
}

/// Restore every snapshot of `backup` from the repository with the haulage
/// library into `target/NAMESPACE/PVC` and compare it byte for byte with
/// the volume's data.
async fn restores_byte_identical(
    node: &RealNode,
    store: &DynStore,
    backup: &VolumeBackup,
    target: &std::path::Path,
) -> anyhow::Result<()> {
    let repository =
        Repository::open(store.clone(), &haulage::engine::KeySource::PlaintextOnly).await?;
    let status = backup.status.as_ref().context("status")?;
    for result in &status.results {
        assert_snapshot_restores_as(
            &repository,
            result.snapshot_id.as_deref().context("snapshot id")?,
            &node.volumes.join(&result.namespace).join(&result.pvc),
            &target.join(&result.namespace).join(&result.pvc),
        )
        .await?;
    }
    Ok(())
}

/// Delete the test's VolumeBackups, namespace, volumes and locations, and
/// wait until the namespace is gone.
async fn clean_up(
    node: &RealNode,
    client: &kube::Client,
    backups: &[&str],
    namespace: &str,
    locations: &[&str],
    secret: &str,
) -> anyhow::Result<()> {
    let vbk: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let deleting = Instant::now();
    for name in backups {
        let _ = vbk.delete(name, &DeleteParams::default()).await;
    }
    for name in backups {
        // Generous: under CI's load one deletion took over 120 s once (the
        // controller's cleanup is bounded at 30 s; a failed reconcile is
        // retried after 5 s, or 120 s when judged permanent).
        let deleted = eventually(
            Duration::from_secs(300),
            &format!("VolumeBackup {name} deleted"),
            || async { Ok(vbk.get_opt(name).await?.is_none().then_some(())) },
        )
        .await;
        if let Err(error) = deleted {
            let left = vbk.get_opt(name).await.ok().flatten();
            bail!(
                "{error}: {}\n{}",
                serde_json::to_string(&left)?,
                node.controller_logs().await
            );
        }
    }
    eprintln!(
        "VolumeBackups {backups:?} deleted in {:.1} s",
        deleting.elapsed().as_secs_f64()
    );
    let locations_api: Api<BackupStorageLocation> =
        Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for name in locations {
        let _ = locations_api.delete(name, &DeleteParams::default()).await;
    }
    node.kubectl_ok(
        &[
            "-n",
            SYSTEM_NAMESPACE,
            "delete",
            "secret",
            secret,
            "--ignore-not-found",
        ],
        None,
    )
    .await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let _ = namespaces.delete(namespace, &DeleteParams::default()).await;
    eventually(Duration::from_secs(120), "namespace deleted", || async {
        Ok(namespaces.get_opt(namespace).await?.is_none().then_some(()))
    })
    .await?;
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    for volume in volumes.list(&ListParams::default()).await?.items {
        let name = volume.metadata.name.clone().unwrap_or_default();
        if name.starts_with(&format!("{namespace}-")) {
            volumes.delete(&name, &DeleteParams::default()).await?;
        }
    }
    std::fs::remove_dir_all(node.volumes.join(namespace))?;
    Ok(())
}

/// What the sampler saw of one agent container: its memory cgroup (v1)
/// and its process.
#[derive(Debug, Clone, Default)]
struct AgentContainer {
    pod: String,
    /// `memory.max_usage_in_bytes`, last read while it ran: the kernel's
    /// high-water mark of everything charged to the cgroup, the page cache
    /// of the files the agent read included.
    max_usage_bytes: u64,
    /// Highest `total_rss` of `memory.stat` sampled (anonymous memory: the
    /// agent's own, without page cache).
    rss_bytes: u64,
    /// Highest `VmHWM` of the container's processes (the agent's peak
    /// resident memory, the figure docs/benchmarks.md compares).
    vm_hwm_bytes: u64,
    /// `memory.failcnt`: how often a charge failed at the limit.
    fail_count: u64,
    /// `memory.limit_in_bytes` of its cgroup.
    limit_bytes: u64,
    /// The pod spec's memory limit.
    spec_limit_bytes: u64,
}

/// The sampled `total_rss` of `memory.stat`.
fn cgroup_rss(cgroup: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(cgroup.join("memory.stat"))
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix("total_rss "))?
        .trim()
        .parse()
        .ok()
}

/// The highest `VmHWM` (bytes) of the processes in `cgroup`.
fn cgroup_vm_hwm(cgroup: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .ok()?
        .lines()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{}/status", pid.trim())).ok())
        .filter_map(|status| {
            let line = status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))?
                .to_string();
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .max()
}

/// What the sampler saw of the stage pods.
#[derive(Debug, Default)]
struct StageObservation {
    /// Per container ID.
    containers: std::collections::BTreeMap<String, AgentContainer>,
    /// Highest restart count of an agent container.
    restarts: i32,
    /// (pod, required node affinity on the node's name, node it ran on).
    placements: std::collections::BTreeSet<(String, bool, String)>,
    /// Running agent containers: (pod, container ID).
    running: Vec<(String, String)>,
}

/// Sample the stage pods of `namespace` every 200 ms until `stop`: their
/// placement, restarts and each running agent container's cgroup memory.
fn sample_stage_pods(
    node: &'static RealNode,
    client: kube::Client,
    namespace: String,
    stop: CancellationToken,
) -> (Arc<Mutex<StageObservation>>, tokio::task::JoinHandle<()>) {
    let observation = Arc::new(Mutex::new(StageObservation::default()));
    let shared = observation.clone();
    let task = tokio::spawn(async move {
        let pods: Api<Pod> = Api::namespaced(client, &namespace);
        while !stop.is_cancelled() {
            let listed = pods
                .list(&ListParams::default().labels(STAGE_PODS))
                .await
                .map(|list| list.items)
                .unwrap_or_default();
            let mut running = Vec::new();
            for pod in &listed {
                let name = pod.metadata.name.clone().unwrap_or_default();
                let spec = pod.spec.clone().unwrap_or_default();
                let pinned = spec
                    .affinity
                    .as_ref()
                    .and_then(|affinity| affinity.node_affinity.as_ref())
                    .and_then(|affinity| {
                        affinity
                            .required_during_scheduling_ignored_during_execution
                            .as_ref()
                    })
                    .is_some_and(|selector| {
                        selector.node_selector_terms.iter().any(|term| {
                            term.match_fields.iter().flatten().any(|field| {
                                field.key == "metadata.name"
                                    && field.values.iter().flatten().any(|v| *v == node.node_name)
                            })
                        })
                    });
                let spec_limit = spec
                    .containers
                    .first()
                    .and_then(|container| container.resources.as_ref())
                    .and_then(|resources| resources.limits.as_ref())
                    .and_then(|limits| limits.get("memory"))
                    .and_then(|quantity| haulage::plan::quantity::parse_quantity(&quantity.0).ok())
                    .unwrap_or(0);
                let statuses = pod
                    .status
                    .as_ref()
                    .and_then(|status| status.container_statuses.clone())
                    .unwrap_or_default();
                let mut guard = shared.lock().expect("observation");
                if let Some(on) = spec.node_name.clone() {
                    guard.placements.insert((name.clone(), pinned, on));
                }
                for status in statuses {
                    guard.restarts = guard.restarts.max(status.restart_count);
                    let Some(id) = status.container_id.clone() else {
                        continue;
                    };
                    if status
                        .state
                        .as_ref()
                        .and_then(|state| state.running.as_ref())
                        .is_none()
                    {
                        continue;
                    }
                    running.push((name.clone(), id.clone()));
                    // Sampled only while its process is there to read (a
                    // short container can exit between its status and this
                    // read, leaving an empty cgroup that says nothing).
                    if let Some(cgroup) = node.container_memory_cgroup(&id)
                        && let Some(hwm) = cgroup_vm_hwm(&cgroup)
                    {
                        let entry = guard.containers.entry(id).or_default();
                        entry.vm_hwm_bytes = entry.vm_hwm_bytes.max(hwm);
                        entry.pod = name.clone();
                        entry.spec_limit_bytes = spec_limit;
                        if let Ok(peak) = cgroup_value(&cgroup, "memory.max_usage_in_bytes") {
                            entry.max_usage_bytes = entry.max_usage_bytes.max(peak);
                        }
                        if let Ok(count) = cgroup_value(&cgroup, "memory.failcnt") {
                            entry.fail_count = entry.fail_count.max(count);
                        }
                        if let Some(rss) = cgroup_rss(&cgroup) {
                            entry.rss_bytes = entry.rss_bytes.max(rss);
                        }
                        if let Ok(limit) = cgroup_value(&cgroup, "memory.limit_in_bytes") {
                            entry.limit_bytes = limit;
                        }
                    }
                }
            }
            shared.lock().expect("observation").running = running;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    (observation, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_manifests_name_the_images_the_build_makes_and_one_images_entry_moves_each()
-> anyhow::Result<()> {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let names = std::process::Command::new(root.join("tests/infra/build-images.sh"))
        .arg("names")
        .output()?;
    assert!(
        names.status.success(),
        "{}",
        String::from_utf8_lossy(&names.stderr)
    );
    let names = String::from_utf8(names.stdout)?;
    let built: Vec<&str> = names.lines().collect();
    assert_eq!(built.len(), 2, "{names}");
    assert_eq!(built[1], haulage::controller::DEFAULT_AGENT_IMAGE);
    // The Containerfile labels its images with the same version.
    let containerfile = std::fs::read_to_string(root.join("Containerfile"))?;
    let versions: Vec<&str> = containerfile
        .lines()
        .filter_map(|line| line.strip_prefix("ARG VERSION="))
        .collect();
    assert_eq!(
        versions,
        [env!("CARGO_PKG_VERSION"); 2],
        "the Containerfile's VERSION of each image"
    );

    let kubectl = crate::support::kube::KubeBinaries::find()?.kubectl;
    let render = |dir: &std::path::Path| -> anyhow::Result<(String, String)> {
        let output = std::process::Command::new(&kubectl)
            .arg("kustomize")
            .arg(dir)
            .output()?;
        if !output.status.success() {
            bail!(
                "kubectl kustomize: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let mut image = None;
        let mut agent = None;
        for document in serde_yaml::Deserializer::from_slice(&output.stdout) {
            let value = serde_json::to_value(serde_yaml::Value::deserialize(document)?)?;
            if value["kind"] == "Deployment" {
                let container = &value["spec"]["template"]["spec"]["containers"][0];
                image = container["image"].as_str().map(str::to_string);
                agent = container["env"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|env| env["name"] == "HAULAGE_AGENT_IMAGE")
                    .and_then(|env| env["value"].as_str().map(str::to_string));
            }
        }
        Ok((
            image.context("no controller image")?,
            agent.context("no HAULAGE_AGENT_IMAGE")?,
        ))
    };
    use serde::Deserialize;
    // As shipped: the images build-images.sh (and the Containerfile) make.
    let (controller, agent) = render(&root.join("manifests"))?;
    assert_eq!((controller.as_str(), agent.as_str()), (built[0], built[1]));
    // A user's overlay: one images: entry per image moves it everywhere,
    // the agent image of the stage pods included.
    // kustomize takes only a relative path to a base.
    let overlay = tempfile::tempdir()?;
    let up = "../".repeat(overlay.path().components().count() - 1);
    let base = format!(
        "{up}{}",
        root.join("manifests")
            .display()
            .to_string()
            .trim_start_matches('/')
    );
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "resources:\n  - {base}\nimages:\n  - name: ghcr.io/haulage-dev/haulage\n    newName: registry.example/team/haulage\n    newTag: \"7\"\n  - name: ghcr.io/haulage-dev/mover-agent\n    newName: registry.example/team/mover-agent\n    newTag: \"7\"\n"
        ),
    )?;
    let (controller, agent) = render(overlay.path())?;
    assert_eq!(controller, "registry.example/team/haulage:7");
    assert_eq!(agent, "registry.example/team/mover-agent:7");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_real_node_the_installed_controller_backs_up_claims_in_use_and_a_killed_agent_resumes()
-> anyhow::Result<()> {
    let node = node::shared().await?;
    let apply_to_ready = node.install_haulage().await?;
    eprintln!(
        "real node started in {:.1} s; kubectl apply -k to Ready controller pods: {apply_to_ready:.1} s",
        node.start_seconds
    );
    let client = node.client().await?;

    // The controller runs as pods of the built image, as non-root.
    let controllers: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let pods = controllers
        .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
        .await?
        .items;
    assert_eq!(pods.len(), 2, "the Deployment's two replicas");
    for pod in &pods {
        let status = pod.status.clone().context("controller pod status")?;
        let container = status
            .container_statuses
            .unwrap_or_default()
            .into_iter()
            .next()
            .context("controller container status")?;
        assert!(container.ready, "{container:#?}");
        assert_eq!(container.image, node.controller_image);
        let pid = node.container_pid(container.container_id.as_deref().unwrap_or_default())?;
        let process = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let uids = process
            .lines()
            .find(|line| line.starts_with("Uid:"))
            .context("Uid")?;
        assert!(
            uids.split_whitespace().skip(1).all(|uid| uid == "65532"),
            "the controller process runs as {uids}"
        );
    }

    let namespace = "real-shop";
    let (minio, store) = storage(
        node,
        &client,
        "real-shop-s3",
        "real-shop",
        &[("real-shop", None), ("real-shop-capped", Some(24 << 20))],
    )
    .await?;
    apply(
        node,
        vec![json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})],
    )
    .await?;
    local_claims(
        node,
        &client,
        namespace,
        &[("db", "small"), ("uploads", "small"), ("archive", "large")],
    )
    .await?;
    let data = |claim: &str| node.volumes.join(namespace).join(claim);
    haulage::sample::generate(&data("db"), 8 << 20, 11)?;
    haulage::sample::generate(&data("uploads"), 3 << 20, 12)?;
    // 1 GiB of incompressible data in 64 MiB files: every byte is uploaded.
    for part in 0..16_u64 {
        std::fs::write(
            data("archive").join(format!("part-{part:02}.bin")),
            random_bytes(100 + part, 64 << 20),
        )?;
    }
    // db is in use: a running pod (scheduled to the node by its claim's
    // volume affinity) holds it mounted.
    apply(
        node,
        vec![json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "db-0", "namespace": namespace},
            "spec": {"containers": [{"name": "db", "image": node.pause_image,
                    "volumeMounts": [{"name": "data", "mountPath": "/var/lib/db"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "db"}}]}})],
    )
    .await?;
    node.kubectl_ok(
        &[
            "-n",
            namespace,
            "wait",
            "--for=condition=Ready",
            "--timeout=120s",
            "pod/db-0",
        ],
        None,
    )
    .await?;

    let stop = CancellationToken::new();
    let (observed, sampler) =
        sample_stage_pods(node, client.clone(), namespace.to_string(), stop.clone());

    // A backup of the claim in use and an idle one: Completed, and every
    // snapshot restores byte-identical.
    backup(node, "real-first", namespace, "small", "real-shop").await?;
    let first = completed(node, &client, "real-first").await?;
    let results = &first.status.as_ref().context("status")?.results;
    assert_eq!(results.len(), 2, "{results:#?}");
    let restored = tempfile::tempdir()?;
    restores_byte_identical(node, &store, &first, &restored.path().join("first")).await?;

    // The 1 GiB claim under a 24 MiB/s upload cap: kill the agent's
    // container once 8 packs are stored; the kubelet restarts it and the
    // transfer resumes without sending those packs again.
    backup(node, "real-large", namespace, "large", "real-shop-capped").await?;
    let s3 = minio.admin_client();
    let packs_stored = || async {
        let listed = s3
            .list_objects_v2()
            .bucket(BUCKET)
            .prefix(format!("real-shop/{}", haulage::repo::DATA_PREFIX))
            .send()
            .await?;
        anyhow::Ok(listed.contents().len())
    };
    let packs_before = packs_stored().await?;
    let victim = eventually(DEADLINE, "8 packs of the large claim stored", || async {
        if packs_stored().await? < packs_before + 8 {
            return Ok(None);
        }
        let guard = observed.lock().expect("observation");
        Ok(guard
            .running
            .iter()
            .find(|(pod, _)| pod.contains("real-large"))
            .cloned())
    })
    .await?;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), namespace);
    let transfer = transfer_of(&transfers, "archive").await?;
    assert!(
        transfer
            .status
            .as_ref()
            .and_then(|status| status.snapshot_id.as_ref())
            .is_none(),
        "the transfer finished before the kill"
    );
    node.kill_container(&victim.1)?;
    eprintln!("killed the agent container {} of {}", victim.1, victim.0);
    let large = completed(node, &client, "real-large").await?;
    stop.cancel();
    sampler.await?;
    let observation = std::mem::take(&mut *observed.lock().expect("observation"));

    assert!(
        observation.restarts >= 1,
        "the kubelet did not restart the killed agent: {observation:#?}"
    );
    let resumed = transfers
        .get(&transfer.metadata.name.clone().context("transfer name")?)
        .await?
        .status
        .context("transfer status")?;
    let (read, new) = (
        resumed.bytes_read.context("bytesRead")?,
        resumed.bytes_new.context("bytesNew")?,
    );
    assert!(
        new + (4 << 24) <= read,
        "the restarted agent sent stored packs again: {new} new of {read} read"
    );
    restores_byte_identical(node, &store, &large, &restored.path().join("large")).await?;

    // Stage pods: pinned by required node affinity, placed by the scheduler.
    assert!(!observation.placements.is_empty(), "no stage pod seen");
    for (pod, pinned, on) in &observation.placements {
        assert!(
            *pinned,
            "stage pod {pod} has no node affinity to {}",
            node.node_name
        );
        assert_eq!(on, &node.node_name, "stage pod {pod}");
    }
    // The memory limit is the kernel's: each agent container's cgroup
    // carries the pod's limit, nothing charged to it ever passed it, and
    // the agent's own memory stayed under it. (Reading a large claim can
    // fill the cgroup with page cache up to the limit: max_usage then
    // reaches it while the kernel reclaims cache; that is the kernel
    // enforcing the limit, not the agent's memory.)
    assert!(
        !observation.containers.is_empty(),
        "no agent cgroup was read"
    );
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    for (id, container) in &observation.containers {
        assert!(container.spec_limit_bytes > 0, "{container:?}");
        assert_eq!(
            container.limit_bytes, container.spec_limit_bytes,
            "cgroup memory.limit_in_bytes of {id} is not the pod's limit"
        );
        assert!(
            container.max_usage_bytes <= container.limit_bytes,
            "{container:?}"
        );
        assert!(
            container.vm_hwm_bytes > 0 && container.vm_hwm_bytes < container.limit_bytes,
            "{container:?}"
        );
        assert!(container.rss_bytes < container.limit_bytes, "{container:?}");
        eprintln!(
            "agent container {} of {}: peak resident {:.1} MiB (VmHWM), cgroup rss peak {:.1} MiB \
             (memory.stat total_rss, sampled), cgroup max_usage {:.1} MiB with page cache, \
             failcnt {}, limit {:.0} MiB",
            &id.trim_start_matches("containerd://")[..12],
            container.pod,
            mib(container.vm_hwm_bytes),
            mib(container.rss_bytes),
            mib(container.max_usage_bytes),
            container.fail_count,
            mib(container.limit_bytes)
        );
    }

    clean_up(
        node,
        &client,
        &["real-first", "real-large"],
        namespace,
        &["real-shop", "real-shop-capped"],
        "real-shop-s3",
    )
    .await?;
    Ok(())
}

/// A namespace that enforces Pod Security `restricted`: the API server
/// refuses the stage pod of a backup in the default (root, DAC_OVERRIDE)
/// mode, and the VolumeBackup says so (condition `StagePodsCreated=False`,
/// reason `StagePodRefused`, naming the pod, the answer and
/// `spec.agentUser`); a backup with `agentUser` runs there and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restricted_namespace_refuses_the_root_stage_pod_with_a_condition_and_a_non_root_backup_completes()
-> anyhow::Result<()> {
    use haulage::reconcile::stage_pod::{
        BackupIdentity, LocationSettings, Operation, Owner, StagePodInputs, StagePodTemplate,
        desired_stage_pod,
    };
    let node = node::shared().await?;
    node.install_haulage().await?;
    let client = node.client().await?;
    let namespace = "real-locked";
    let (_minio, _store) = storage(
        node,
        &client,
        "real-locked-s3",
        "real-locked",
        &[("real-locked", None)],
    )
    .await?;
    apply(
        node,
        vec![
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace,
            "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest"}}}),
        ],
    )
    .await?;
    local_claims(node, &client, namespace, &[("data", "locked")]).await?;
    std::fs::write(
        node.volumes.join(namespace).join("data/file.txt"),
        b"locked",
    )?;

    backup(node, "real-locked", namespace, "locked", "real-locked").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    // The controller's attempt is refused by PodSecurity admission (its
    // log says so); no stage pod ever exists.
    let refusal = eventually(
        Duration::from_secs(120),
        "the stage pod refused",
        || async {
            let listed = pods.list(&ListParams::default()).await?.items;
            assert!(
                listed.is_empty(),
                "a pod was admitted in {namespace}: {listed:#?}"
            );
            let logs = node.controller_logs().await;
            Ok(logs
                .lines()
                .find(|line| {
                    line.contains("haulage-backup-real-locked")
                        && line.contains("violates PodSecurity")
                })
                .map(str::to_string))
        },
    )
    .await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    // The VolumeBackup says why nothing runs and what to do.
    let condition = eventually(
        Duration::from_secs(120),
        "the refusal in the VolumeBackup's status",
        || async {
            let status = backups.get("real-locked").await?.status.unwrap_or_default();
            Ok(haulage::api::condition::find_condition(
                &status.conditions,
                haulage::api::condition::condition_type::STAGE_PODS_CREATED,
            )
            .filter(|condition| condition.status == haulage::api::condition::ConditionStatus::False)
            .cloned())
        },
    )
    .await?;
    assert_eq!(
        condition.reason,
        haulage::api::condition::reason::STAGE_POD_REFUSED
    );
    assert!(
        condition.message.contains("violates PodSecurity")
            && condition.message.contains("spec.agentUser"),
        "{}",
        condition.message
    );
    assert!(pods.list(&ListParams::default()).await?.items.is_empty());
    eprintln!(
        "restricted namespace, root mode: the controller's log: {}\nthe VolumeBackup's condition: {}",
        refusal.trim(),
        condition.message
    );
    // The same claim backed up in the non-root mode completes there.
    apply(
        node,
        vec![
            json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
            "metadata": {"name": "real-locked-nonroot", "namespace": SYSTEM_NAMESPACE},
            "spec": {"namespaces": [namespace], "selector": {"matchLabels": {"set": "locked"}},
                "storageLocation": "real-locked", "agentUser": 1000}}),
        ],
    )
    .await?;
    let nonroot = completed(node, &client, "real-locked-nonroot").await?;
    assert_eq!(
        nonroot.status.and_then(|status| status.phase),
        Some(VolumeBackupPhase::Completed)
    );

    // The pod specs of both modes against the same admission (server-side
    // dry run): root refused, non-root admitted.
    let stage = haulage::plan::StagePod {
        namespace: namespace.to_string(),
        node: node.node_name.clone(),
        volumes: vec!["data".to_string()],
        bytes: 1,
    };
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let locations: Api<haulage::api::BackupStorageLocation> =
        Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let location = locations.get("real-locked").await?;
    let mut template = StagePodTemplate::new(
        Operation::Backup,
        Owner {
            namespace: SYSTEM_NAMESPACE.to_string(),
            name: "real-locked".to_string(),
            uid: "dry-run".to_string(),
        },
        &node.agent_image,
        LocationSettings::of(&location),
    );
    let pod_of = |template: &StagePodTemplate| {
        desired_stage_pod(template, &stage, StagePodInputs::default()).pod
    };
    let root = pods.create(&dry_run, &pod_of(&template)).await;
    let refused = format!(
        "{:?}",
        root.err().context("the root stage pod was admitted")?
    );
    assert!(refused.contains("violates PodSecurity"), "{refused}");
    template.backup_identity = BackupIdentity::NonRoot { user_id: 1000 };
    pods.create(&dry_run, &pod_of(&template))
        .await
        .context("the non-root stage pod was refused")?;

    clean_up(
        node,
        &client,
        &["real-locked", "real-locked-nonroot"],
        namespace,
        &["real-locked"],
        "real-locked-s3",
    )
    .await?;
    Ok(())
}
