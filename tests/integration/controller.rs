//! The controller and the mover agent end to end on a real kube-apiserver
//! and a real MinIO: manifests applied as a user would, a BSL and a
//! VolumeBackup created, the controller running with its own
//! ServiceAccount's token (so its RBAC is the real one), stage pods run by
//! the kubelet stand-in as real `mover-agent` processes with their own
//! TokenRequest tokens; every snapshot restores byte-identical, and nothing
//! is left behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::{CREDENTIALS_COPY_LABEL, SYSTEM_NAMESPACE};
use haulage::api::{
    BackupStorageLocation, BackupStorageLocationPhase, VolumeBackup, VolumeTransfer,
    VolumeTransferPhase,
};
use haulage::engine::Repository;
use haulage::engine::progress::Progress;
use haulage::engine::restore::{RestoreOptions, restore};
use haulage::store::open_store;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::engine::support::{assert_same_tree, random_bytes};
use crate::support::kube::KubeCluster;
use crate::support::kubelet::Kubelet;
use crate::support::minio::{ACCESS_KEY, MinioServer, REGION, SECRET_KEY};
use crate::support::scrape::{Exposition, scrape};

const BUCKET: &str = "haulage-e2e";
/// The StorageClass of every fixture claim, and its provisioner.
const STORAGE_CLASS: &str = "haulage-test";
const PROVISIONER: &str = "test.csi.haulage.dev";
const PREFIX: &str = "cluster-a";
/// Generous: two cores shared with other builds, debug binaries.
const BACKUP_DEADLINE: Duration = Duration::from_secs(240);

fn manifests() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("manifests")
}

async fn create<K>(
    client: &kube::Client,
    namespace: Option<&str>,
    value: serde_json::Value,
) -> anyhow::Result<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let object: K = serde_json::from_value(value)?;
    let resource = kube::core::ApiResource::erase::<K>(&());
    let api: Api<kube::core::DynamicObject> = match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let dynamic: kube::core::DynamicObject =
        serde_json::from_value(serde_json::to_value(&object)?)?;
    let created = api
        .create(&PostParams::default(), &dynamic)
        .await
        .with_context(|| format!("create {:?}", object.meta().name))?;
    Ok(serde_json::from_value(serde_json::to_value(created)?)?)
}

/// A bound claim with its volume; `mode` is the access mode.
async fn bound_claim(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    mode: &str,
) -> anyhow::Result<()> {
    let volume = format!("pv-{namespace}-{name}");
    create::<PersistentVolume>(
        client,
        None,
        json!({"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode],
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                "csi": {"driver": PROVISIONER, "volumeHandle": volume},
                "claimRef": {"namespace": namespace, "name": name}}}),
    )
    .await?;
    create::<PersistentVolumeClaim>(
        client,
        Some(namespace),
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace,
                "labels": {"backup": "yes", "claim": name}},
            "spec": {"accessModes": [mode], "volumeName": volume,
                "storageClassName": STORAGE_CLASS,
                "resources": {"requests": {"storage": "1Gi"}}}}),
    )
    .await?;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    claims
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Bound", "accessModes": [mode],
                "capacity": {"storage": "1Gi"}}})),
        )
        .await?;
    Ok(())
}

/// A running application pod on `node` mounting `claim`.
async fn app_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    node: &str,
    claim: &str,
) -> anyhow::Result<()> {
    create::<Pod>(
        client,
        Some(namespace),
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeName": node,
                "containers": [{"name": "app", "image": "app:1",
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}}),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running"}})),
    )
    .await?;
    Ok(())
}

async fn client_from(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// Poll `check` until it returns `Some`, failing with `describe` after the
/// deadline.
async fn eventually<T, F, Fut>(deadline: Duration, mut check: F) -> anyhow::Result<T>
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
            bail!("not reached within {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The namespaces, claims, nodes and application pods of a [`Fixture`].
struct Layout {
    namespaces: Vec<String>,
    /// (namespace, name, access mode, seed of its data).
    claims: Vec<(String, String, &'static str, u64)>,
    nodes: Vec<String>,
    /// Running pods mounting claims: (namespace, pod, node, claim).
    app_pods: Vec<(String, String, String, String)>,
    /// MinIO on HTTPS under a throwaway CA that the BSL's `caBundle` carries.
    tls: bool,
}

impl Layout {
    /// Two namespaces, five claims, three nodes, three application pods
    /// (one claim mounted on node-a, an RWX one on node-b and node-c).
    fn five_claims() -> Self {
        let owned = |values: &[&str]| values.iter().map(|v| v.to_string()).collect();
        Layout {
            namespaces: owned(&["shop", "web"]),
            claims: [
                ("shop", "db", "ReadWriteOnce", 3_u64),
                ("shop", "uploads", "ReadWriteMany", 4),
                ("shop", "archive", "ReadWriteOnce", 5),
                ("web", "content", "ReadWriteOnce", 6),
                ("web", "logs", "ReadWriteOnce", 7),
            ]
            .into_iter()
            .map(|(namespace, name, mode, seed)| {
                (namespace.to_string(), name.to_string(), mode, seed)
            })
            .collect(),
            nodes: owned(&["node-a", "node-b", "node-c"]),
            app_pods: [
                ("shop", "db-0", "node-a", "db"),
                ("shop", "uploader-b", "node-b", "uploads"),
                ("shop", "uploader-c", "node-c", "uploads"),
            ]
            .into_iter()
            .map(|(namespace, pod, node, claim)| {
                (
                    namespace.to_string(),
                    pod.to_string(),
                    node.to_string(),
                    claim.to_string(),
                )
            })
            .collect(),
            tls: false,
        }
    }

    /// `claims` unmounted RWO claims `data-NNN`, dealt round-robin over
    /// `namespaces` namespaces `team-N`, and `nodes` nodes `node-N` for
    /// the planner to spread them over.
    fn many(claims: usize, namespaces: usize, nodes: usize) -> Self {
        Layout {
            namespaces: (0..namespaces).map(|n| format!("team-{n}")).collect(),
            claims: (0..claims)
                .map(|index| {
                    (
                        format!("team-{}", index % namespaces),
                        format!("data-{index:03}"),
                        "ReadWriteOnce",
                        1000 + index as u64,
                    )
                })
                .collect(),
            nodes: (0..nodes).map(|n| format!("node-{n}")).collect(),
            app_pods: Vec::new(),
            tls: false,
        }
    }
}

/// A cluster with the manifests applied, MinIO with an initialised
/// repository, claims with data on nodes run by the kubelet stand-in (the
/// [`Layout`]: five claims on three nodes unless said otherwise), an
/// Available BSL and the controller running.
struct Fixture {
    cluster: KubeCluster,
    minio: MinioServer,
    client: kube::Client,
    kubelet: Kubelet,
    work: tempfile::TempDir,
    volumes: PathBuf,
    store: haulage::store::DynStore,
    /// Port of the in-process controller's `/healthz` and `/readyz`.
    health_port: u16,
    shutdown: CancellationToken,
    controller: tokio::task::JoinHandle<Result<(), haulage::controller::RunError>>,
    /// Where the in-process controller serves `/healthz`, `/readyz` and
    /// `/metrics`.
    health_address: std::net::SocketAddr,
}

impl Fixture {
    /// `upload_bytes_per_second` caps each agent (the BSL's cap), to make
    /// transfers slow enough to interrupt; `volume_bytes` is each claim's
    /// data (a sample tree, or with `small_packs` incompressible random
    /// files and 1 MiB packs, so a transfer stores several packs).
    async fn start(
        upload_bytes_per_second: Option<u64>,
        volume_bytes: u64,
        small_packs: bool,
    ) -> anyhow::Result<Self> {
        Self::start_with_secret(
            upload_bytes_per_second,
            volume_bytes,
            small_packs,
            SECRET_KEY,
        )
        .await
    }

    /// Like [`Fixture::start`] with `secret_key` in the BSL's credentials;
    /// waits for the BSL to be Available only when it is the right one.
    async fn start_with_secret(
        upload_bytes_per_second: Option<u64>,
        volume_bytes: u64,
        small_packs: bool,
        secret_key: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with_objects(
            upload_bytes_per_second,
            volume_bytes,
            small_packs,
            secret_key,
            &[],
            false,
        )
        .await
    }

    /// Like [`Fixture::start`] with MinIO serving HTTPS under a throwaway
    /// CA that the BSL's `caBundle` carries.
    async fn start_tls(volume_bytes: u64) -> anyhow::Result<Self> {
        Self::start_with_objects(None, volume_bytes, false, SECRET_KEY, &[], true).await
    }

    /// Like [`Fixture::start_with_secret`], with `extra_objects` (more
    /// BSLs, Secrets) created in the controller's namespace before the
    /// controller starts, and MinIO on HTTPS when `tls`.
    async fn start_with_objects(
        upload_bytes_per_second: Option<u64>,
        volume_bytes: u64,
        small_packs: bool,
        secret_key: &str,
        extra_objects: &[serde_json::Value],
        tls: bool,
    ) -> anyhow::Result<Self> {
        let layout = Layout {
            tls,
            ..Layout::five_claims()
        };
        Self::start_with_layout(
            layout,
            false,
            upload_bytes_per_second,
            volume_bytes,
            small_packs,
            secret_key,
            extra_objects,
        )
        .await
    }

    /// `claims` of `volume_bytes` of sample data each (no cap, no app
    /// pods), with the apiserver's audit log on when `audited`.
    async fn start_many(layout: Layout, audited: bool, volume_bytes: u64) -> anyhow::Result<Self> {
        Self::start_with_layout(layout, audited, None, volume_bytes, false, SECRET_KEY, &[]).await
    }

    async fn start_with_layout(
        layout: Layout,
        audited: bool,
        upload_bytes_per_second: Option<u64>,
        volume_bytes: u64,
        small_packs: bool,
        secret_key: &str,
        extra_objects: &[serde_json::Value],
    ) -> anyhow::Result<Self> {
        let cluster = if audited {
            KubeCluster::start_audited().await?
        } else {
            KubeCluster::start().await?
        };
        let minio = if layout.tls {
            MinioServer::start_tls().await?
        } else {
            MinioServer::start().await?
        };
        let ca_bundle = match minio.ca_bundle() {
            Some(path) => Some(std::fs::read_to_string(path)?),
            None => None,
        };
        minio.create_bucket(BUCKET).await?;
        let client = cluster.client().await?;
        cluster
            .kubectl_ok(&["apply", "-k", &manifests().to_string_lossy()], None)
            .await?;
        cluster
            .wait_for_crds(&[
                "crd/volumebackups.haulage.dev",
                "crd/volumetransfers.haulage.dev",
                "crd/backupstoragelocations.haulage.dev",
            ])
            .await?;

        // The repository, initialised as a user would with `haulage repo init`.
        let repository_url = format!("s3://{BUCKET}/{PREFIX}");
        let mut store_options = minio.store_options();
        store_options.s3.ca_bundle = minio.ca_bundle().map(Path::to_path_buf);
        let store = open_store(&repository_url, &store_options).await?;
        if small_packs {
            let mut config = haulage::repo::config::RepoConfig::generate();
            config.pack_target_bytes = 1 << 20;
            store
                .put(
                    haulage::repo::CONFIG_KEY,
                    config.to_json().into(),
                    haulage::store::PutMode::Create,
                )
                .await?;
        } else {
            Repository::init(store.clone()).await?;
        }

        create::<k8s_openapi::api::storage::v1::StorageClass>(
            &client,
            None,
            json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                "metadata": {"name": STORAGE_CLASS}, "provisioner": PROVISIONER}),
        )
        .await?;

        let work = tempfile::tempdir()?;
        let volumes = work.path().join("volumes");
        for namespace in &layout.namespaces {
            create::<Namespace>(
                &client,
                None,
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
            )
            .await?;
        }
        for (namespace, name, mode, seed) in &layout.claims {
            bound_claim(&client, namespace, name, mode).await?;
            let directory = volumes.join(namespace).join(name);
            if small_packs {
                std::fs::create_dir_all(&directory)?;
                for part in 0..4 {
                    let bytes = random_bytes(seed * 10 + part, (volume_bytes / 4) as usize);
                    std::fs::write(directory.join(format!("part{part}.bin")), bytes)?;
                }
            } else {
                haulage::sample::generate(&directory, volume_bytes, *seed)?;
            }
        }
        let nodes: Vec<&str> = layout.nodes.iter().map(String::as_str).collect();
        let kubelet = Kubelet::start(
            client.clone(),
            cluster.kubeconfig(),
            &nodes,
            &volumes,
            &work.path().join("kubelet"),
        )
        .await?;
        for (namespace, pod, node, claim) in &layout.app_pods {
            app_pod(&client, namespace, pod, node, claim).await?;
        }

        // The BSL, pointing at MinIO, with its credentials Secret.
        create::<Secret>(
        &client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "s3-credentials", "namespace": SYSTEM_NAMESPACE},
            "stringData": {"cloud": format!(
                "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {secret_key}\n")}}),
    )
    .await?;
        create::<BackupStorageLocation>(
            &client,
            Some(SYSTEM_NAMESPACE),
            json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
            "metadata": {"name": "minio", "namespace": SYSTEM_NAMESPACE},
            "spec": {"bucket": BUCKET, "prefix": PREFIX, "endpoint": minio.endpoint(),
                "region": REGION, "s3ForcePathStyle": true, "default": true,
                "credential": {"name": "s3-credentials", "key": "cloud"}, "caBundle": ca_bundle,
                "validationFrequency": "10s", "uploadBytesPerSecond": upload_bytes_per_second}}),
        )
        .await?;
        if !extra_objects.is_empty() {
            let list = json!({"apiVersion": "v1", "kind": "List", "items": extra_objects});
            cluster
                .kubectl_ok(
                    &["apply", "-n", SYSTEM_NAMESPACE, "-f", "-"],
                    Some(&list.to_string()),
                )
                .await?;
        }

        // The controller, in-process, with its own ServiceAccount's token.
        let controller_kubeconfig = kubelet
            .service_account_kubeconfig(
                SYSTEM_NAMESPACE,
                "haulage-controller",
                &work.path().join("controller.kubeconfig"),
            )
            .await?;
        let controller_client = client_from(&controller_kubeconfig).await?;
        let health = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let health_port = health.local_addr()?.port();
        let health_address = health.local_addr()?;
        let config = haulage::controller::Config {
            agent_image: "mover-agent:test".to_string(),
            health_address: format!("127.0.0.1:{health_port}").parse()?,
            concurrency: 4,
            replica_lease_seconds: haulage::controller::MIN_LEASE_SECONDS,
            ..haulage::controller::Config::new(SYSTEM_NAMESPACE, "controller-0")
        };
        let shutdown = CancellationToken::new();
        crate::support::logs::capture();
        crate::support::logs::capture();
        let controller = tokio::spawn(haulage::controller::run_with_listener(
            config,
            controller_client,
            health,
            shutdown.clone(),
        ));

        let locations: Api<BackupStorageLocation> =
            Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
        eventually(Duration::from_secs(60), || async {
            if secret_key != SECRET_KEY {
                return Ok(Some(()));
            }
            let location = locations.get("minio").await?;
            Ok((location.status.and_then(|s| s.phase)
                == Some(BackupStorageLocationPhase::Available))
            .then_some(()))
        })
        .await
        .context("the BSL never became Available")?;

        Ok(Fixture {
            cluster,
            minio,
            client,
            kubelet,
            work,
            volumes,
            store,
            health_port,
            shutdown,
            controller,
            health_address,
        })
    }

    /// The test configuration of an in-process controller replica named
    /// `identity` (health on an ephemeral port, short replica lease).
    fn controller_config(identity: &str) -> anyhow::Result<haulage::controller::Config> {
        Ok(haulage::controller::Config {
            agent_image: "mover-agent:test".to_string(),
            health_address: "127.0.0.1:0".parse()?,
            concurrency: 4,
            replica_lease_seconds: haulage::controller::MIN_LEASE_SECONDS,
            ..haulage::controller::Config::new(SYSTEM_NAMESPACE, identity)
        })
    }

    /// Start another in-process controller replica with `config`, on the
    /// controller ServiceAccount's token; cancel the token to stop it.
    async fn spawn_controller(
        &self,
        config: haulage::controller::Config,
    ) -> anyhow::Result<(
        CancellationToken,
        tokio::task::JoinHandle<Result<(), haulage::controller::RunError>>,
    )> {
        let kubeconfig = self
            .kubelet
            .service_account_kubeconfig(
                SYSTEM_NAMESPACE,
                "haulage-controller",
                &self
                    .work
                    .path()
                    .join(format!("{}.kubeconfig", config.identity)),
            )
            .await?;
        let shutdown = CancellationToken::new();
        crate::support::logs::capture();
        let controller = tokio::spawn(haulage::controller::run(
            config,
            client_from(&kubeconfig).await?,
            shutdown.clone(),
        ));
        Ok((shutdown, controller))
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.controller).await;
        drop(self.kubelet);
        drop(self.cluster);
    }
}

/// Wait up to `deadline` for VolumeBackup `name` to reach a final phase;
/// a timeout names it with its last status and every agent's log.
async fn final_backup(
    backups: &Api<VolumeBackup>,
    kubelet: &Kubelet,
    name: &str,
    deadline: Duration,
) -> anyhow::Result<VolumeBackup> {
    let finished = eventually(deadline, || async {
        let backup = backups.get(name).await?;
        let phase = backup.status.as_ref().and_then(|status| status.phase);
        Ok(phase
            .is_some_and(|phase| phase.is_final())
            .then_some(backup))
    })
    .await;
    match finished {
        Ok(backup) => Ok(backup),
        Err(error) => {
            let status = backups
                .get(name)
                .await
                .ok()
                .and_then(|backup| backup.status);
            bail!(
                "VolumeBackup {name} never finished ({error}): status {status:#?}\nagent logs:\n{}",
                kubelet.all_agent_logs()
            )
        }
    }
}

/// Create the VolumeBackup `name` of both namespaces' labelled claims.
async fn create_backup(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    create_backup_of(client, name, json!({"matchLabels": {"backup": "yes"}})).await
}

/// Create the VolumeBackup `name` of the claims `selector` picks.
async fn create_backup_of(
    client: &kube::Client,
    name: &str,
    selector: serde_json::Value,
) -> anyhow::Result<()> {
    create::<VolumeBackup>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"namespaces": ["shop", "web"], "selector": selector}}),
    )
    .await?;
    Ok(())
}

/// Stage pods and credentials copies left in the cluster.
async fn leftovers(client: &kube::Client) -> anyhow::Result<(usize, usize)> {
    let stage_pods: Api<Pod> = Api::all(client.clone());
    let pods = stage_pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=haulage-agent"))
        .await?;
    let secrets: Api<Secret> = Api::all(client.clone());
    let copies = secrets
        .list(&ListParams::default().labels(&format!("{CREDENTIALS_COPY_LABEL}=true")))
        .await?;
    Ok((pods.items.len(), copies.items.len()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_volume_backup_moves_every_selected_claim_into_the_storage_location() -> anyhow::Result<()>
{
    let fixture = Fixture::start(None, 2 << 20, false).await?;
    let Fixture {
        client,
        kubelet,
        volumes,
        store,
        minio,
        work,
        ..
    } = &fixture;
    // `haulage plan` against the live cluster (the current kubeconfig
    // context), before the backup: read-only lists, the same planner.
    let planned = std::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args(["plan", "-n", "shop", "-n", "web", "-o", "json"])
        .env("KUBECONFIG", fixture.cluster.kubeconfig())
        .output()?;
    assert!(
        planned.status.success(),
        "haulage plan: {}",
        String::from_utf8_lossy(&planned.stderr)
    );
    let live_plan: serde_json::Value = serde_json::from_slice(&planned.stdout)?;
    create_backup(client, "nightly").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, kubelet, "nightly", BACKUP_DEADLINE).await?;
    let status = backup.status.clone().context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{status:#?}\n{}",
        kubelet.all_agent_logs()
    );

    // The plan: the RWO claim in use on node-a is read there, the RWX one
    // by exactly one stage pod, every claim placed.
    let plan = status.plan.clone().context("plan in status")?;
    assert!(plan.unplaceable.is_empty(), "{plan:#?}");
    let pod_of = |namespace: &str, pvc: &str| {
        plan.stage_pods
            .iter()
            .filter(|pod| pod.namespace == namespace && pod.volumes.iter().any(|v| v == pvc))
            .collect::<Vec<_>>()
    };
    assert_eq!(pod_of("shop", "db").len(), 1);
    assert_eq!(pod_of("shop", "db")[0].node, "node-a");
    assert_eq!(pod_of("shop", "uploads").len(), 1);
    assert!(["node-b", "node-c"].contains(&pod_of("shop", "uploads")[0].node.as_str()));
    // The CLI's plan of the live cluster is the controller's plan.
    let placements = |pods: Vec<(String, String, Vec<String>)>| {
        pods.into_iter()
            .map(|(namespace, node, mut volumes)| {
                volumes.sort();
                (namespace, node, volumes)
            })
            .collect::<std::collections::BTreeSet<_>>()
    };
    let from_cli = placements(
        live_plan["stagePods"]
            .as_array()
            .context("stagePods")?
            .iter()
            .map(|pod| {
                (
                    pod["namespace"].as_str().unwrap_or_default().to_string(),
                    pod["node"].as_str().unwrap_or_default().to_string(),
                    pod["volumes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|volume| volume.as_str().map(str::to_string))
                        .collect(),
                )
            })
            .collect(),
    );
    let from_controller = placements(
        plan.stage_pods
            .iter()
            .map(|pod| (pod.namespace.clone(), pod.node.clone(), pod.volumes.clone()))
            .collect(),
    );
    assert_eq!(from_cli, from_controller, "{live_plan:#}");

    let counts = status.volumes.clone().context("volume counts")?;
    assert_eq!((counts.total, counts.completed, counts.failed), (5, 5, 0));
    let progress = status.progress.clone().context("progress")?;
    assert!(
        progress.total_bytes > 0 && progress.bytes_done == progress.total_bytes,
        "{progress:?}"
    );
    assert_eq!(status.results.len(), 5);

    // `haulage describe backup` shows the plan and every volume, from status.
    let described = std::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args(["describe", "backup", "nightly"])
        .env("KUBECONFIG", fixture.cluster.kubeconfig())
        .output()?;
    let text = String::from_utf8_lossy(&described.stdout);
    assert!(
        described.status.success(),
        "{}",
        String::from_utf8_lossy(&described.stderr)
    );
    assert!(text.contains("Phase:     Completed"), "{text}");
    assert!(text.contains("5 total: 5 completed"), "{text}");
    for (namespace, pvc) in [("shop", "db"), ("shop", "uploads"), ("web", "logs")] {
        assert!(
            text.lines().any(|line| line.starts_with(namespace)
                && line.contains(pvc)
                && line.contains("100%")),
            "{pvc} missing:\n{text}"
        );
    }

    // Every snapshot restores byte-identical.
    let repository = Repository::open(store.clone()).await?;
    for result in &status.results {
        let snapshot_text = result.snapshot_id.as_deref().context("snapshot id")?;
        let snapshot = repository.resolve_snapshot(snapshot_text).await?;
        let target = work
            .path()
            .join("restored")
            .join(&result.namespace)
            .join(&result.pvc);
        restore(
            &repository,
            &snapshot,
            RestoreOptions::new(&target),
            Arc::new(Progress::default()),
            CancellationToken::new(),
        )
        .await?;
        assert_same_tree(&volumes.join(&result.namespace).join(&result.pvc), &target);
    }

    // Nothing left behind: stage pods, credentials copies, uploads.
    eventually(Duration::from_secs(60), || async {
        Ok((leftovers(client).await? == (0, 0)).then_some(()))
    })
    .await
    .context("stage pods or credentials copies remain")?;
    assert!(minio.multipart_uploads(BUCKET, "").await?.is_empty());
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_volume_backup_mid_transfer_stops_its_agents_and_leaves_nothing_behind()
-> anyhow::Result<()> {
    // Slow uploads (256 KiB/s per agent) keep the transfers running.
    let fixture = Fixture::start(Some(256 << 10), 4 << 20, false).await?;
    let client = &fixture.client;
    create_backup(client, "doomed").await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    eventually(Duration::from_secs(120), || async {
        let list = transfers.list(&ListParams::default()).await?;
        Ok(list
            .items
            .iter()
            .any(|transfer| {
                let status = transfer.status.clone().unwrap_or_default();
                status.phase == Some(VolumeTransferPhase::InProgress)
                    && status
                        .progress
                        .is_some_and(|progress| progress.bytes_done > 0)
            })
            .then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "no transfer got going:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    assert!(fixture.kubelet.running_agents() > 0, "agents already done");

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    backups.delete("doomed", &DeleteParams::default()).await?;
    eventually(Duration::from_secs(60), || async {
        Ok(backups.get_opt("doomed").await?.is_none().then_some(()))
    })
    .await
    .context("the finalizer was not released")?;

    eventually(Duration::from_secs(60), || async {
        let remaining = transfers.list(&ListParams::default()).await?.items.len();
        Ok((remaining == 0
            && leftovers(client).await? == (0, 0)
            && fixture.kubelet.running_agents() == 0)
            .then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "transfers, stage pods, credentials copies or agents remain:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    assert!(
        fixture
            .minio
            .multipart_uploads(BUCKET, "")
            .await?
            .is_empty()
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_agent_is_restarted_and_resumes_without_sending_stored_packs_again()
-> anyhow::Result<()> {
    // 12 MiB of random data per claim in 1 MiB packs, uploaded at 1 MiB/s:
    // the kill lands well before the snapshot is written.
    let fixture = Fixture::start(Some(1 << 20), 12 << 20, true).await?;
    let client = &fixture.client;
    // One claim only, so every pack in the bucket is this transfer's.
    create_backup_of(
        client,
        "resumed",
        json!({"matchLabels": {"claim": "archive"}}),
    )
    .await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let s3 = fixture.minio.admin_client();
    let packs_stored = || async {
        let listed = s3
            .list_objects_v2()
            .bucket(BUCKET)
            .prefix(format!("{PREFIX}/{}", haulage::repo::DATA_PREFIX))
            .send()
            .await?;
        anyhow::Ok(listed.contents().len())
    };
    // A pack object exists only once fully uploaded: kill after two.
    eventually(Duration::from_secs(120), || async {
        Ok((packs_stored().await? >= 2).then_some(()))
    })
    .await
    .with_context(|| format!("no packs appeared:\n{}", fixture.kubelet.all_agent_logs()))?;
    let victim = transfers
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .next()
        .context("no transfer")?;
    let phase = victim.status.clone().and_then(|status| status.phase);
    assert_eq!(
        phase,
        Some(VolumeTransferPhase::InProgress),
        "finished before the kill"
    );
    let namespace = victim.metadata.namespace.clone().context("namespace")?;
    let starts_before = fixture
        .kubelet
        .starts
        .load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        fixture.kubelet.kill(&namespace, &victim.spec.stage_pod),
        "the agent had already exited"
    );

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "resumed", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{status:#?}\n{}",
        fixture.kubelet.all_agent_logs()
    );
    assert!(
        fixture
            .kubelet
            .starts
            .load(std::sync::atomic::Ordering::SeqCst)
            > starts_before,
        "the killed agent was not restarted"
    );
    // The transfers are kept until the backup is deleted.
    let resumed = Api::<VolumeTransfer>::namespaced(client.clone(), &namespace)
        .get(&victim.metadata.name.clone().context("name")?)
        .await?;
    let final_status = resumed.status.context("transfer status")?;
    let bytes_read = final_status.bytes_read.context("bytesRead")?;
    let bytes_new = final_status.bytes_new.context("bytesNew")?;
    assert!(
        bytes_new + (1 << 20) <= bytes_read,
        "the restarted agent sent stored data again: {bytes_new} new of {bytes_read} read\n{}",
        fixture.kubelet.all_agent_logs()
    );

    let repository = Repository::open(fixture.store.clone()).await?;
    let snapshot_text = final_status.snapshot_id.context("snapshot id")?;
    let snapshot = repository.resolve_snapshot(&snapshot_text).await?;
    let target = fixture.work.path().join("restored-victim");
    restore(
        &repository,
        &snapshot,
        RestoreOptions::new(&target),
        Arc::new(Progress::default()),
        CancellationToken::new(),
    )
    .await?;
    assert_same_tree(
        &fixture.volumes.join(&namespace).join(&resumed.spec.pvc),
        &target,
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_waits_with_a_condition_while_its_location_is_unavailable_and_runs_once_fixed()
-> anyhow::Result<()> {
    let fixture = Fixture::start_with_secret(None, 1 << 20, false, "wrong-secret-key").await?;
    let client = &fixture.client;
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    create_backup(client, "patient").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(60), || async {
        let location = locations.get("minio").await?;
        let backup = backups.get("patient").await?;
        let status = backup.status.unwrap_or_default();
        let storage = haulage::api::condition::find_condition(
            &status.conditions,
            haulage::api::condition::condition_type::STORAGE_AVAILABLE,
        )
        .cloned();
        Ok(
            (location.status.and_then(|s| s.phase)
                == Some(BackupStorageLocationPhase::Unavailable)
                && status.phase == Some(VolumeBackupPhase::WaitingForStorage)
                && storage.is_some_and(|condition| {
                    condition.status == haulage::api::ConditionStatus::False
                        && condition.reason
                            == haulage::api::condition::reason::STORAGE_LOCATION_UNAVAILABLE
                }))
            .then_some(()),
        )
    })
    .await
    .context("the backup did not wait for the unavailable location with a condition")?;
    let pods: Api<Pod> = Api::all(client.clone());
    assert!(
        pods.list(&ListParams::default().labels("app.kubernetes.io/name=haulage-agent"))
            .await?
            .items
            .is_empty(),
        "stage pods created for an unavailable location"
    );

    // The user fixes the credentials; the next probe (every 10 s) finds it.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    secrets
        .patch(
            "s3-credentials",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"cloud": format!(
                "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")}})),
        )
        .await?;
    let backup = final_backup(&backups, &fixture.kubelet, "patient", BACKUP_DEADLINE).await?;
    assert_eq!(
        backup.status.and_then(|status| status.phase),
        Some(VolumeBackupPhase::Completed)
    );
    fixture.stop().await;
    Ok(())
}

/// `GET path` on 127.0.0.1:port; the status code and body, if it answered.
async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// Poll `/readyz` on 127.0.0.1:`port` until it answers 200; after
/// `deadline` the error carries its last answer (which names the caches
/// still listing or the API server's problem).
async fn wait_until_ready(port: u16, deadline: Duration) -> anyhow::Result<()> {
    let last = std::sync::Mutex::new(None);
    let ready = eventually(deadline, || async {
        let answer = http_get(port, "/readyz").await;
        let ready = matches!(answer, Some((200, _)));
        *last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = answer;
        Ok(ready.then_some(()))
    })
    .await;
    let last = last
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    ready.with_context(|| match last {
        Some((status, body)) => format!("/readyz last answered {status}: {}", body.trim_end()),
        None => "/readyz never answered".to_string(),
    })
}

/// `GET path` on 127.0.0.1:port; the status code, if it answered.
async fn http_status(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_one_of_them_the_binary_complete_backups_each_written_only_by_its_owner()
-> anyhow::Result<()> {
    let fixture = Fixture::start(None, 1 << 20, false).await?;
    let client = &fixture.client;
    // The second replica: `haulage controller` as the Deployment runs it,
    // with the controller ServiceAccount's token.
    let kubeconfig = fixture
        .kubelet
        .service_account_kubeconfig(
            SYSTEM_NAMESPACE,
            "haulage-controller",
            &fixture.work.path().join("replica-1.kubeconfig"),
        )
        .await?;
    let port = crate::support::minio::free_port()?;
    let log_path = fixture.work.path().join("replica-1.log");
    let mut replica = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args([
            "controller",
            "--health-address",
            &format!("127.0.0.1:{port}"),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", "controller-1")
        .env("POD_NAMESPACE", SYSTEM_NAMESPACE)
        .env("HAULAGE_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .kill_on_drop(true)
        .spawn()?;
    if let Err(not_ready) = wait_until_ready(port, Duration::from_secs(60)).await {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        anyhow::bail!("the binary never became ready: {not_ready:#}; its log:\n{log}");
    }
    assert_eq!(http_status(port, "/healthz").await, Some(200));

    for name in ["first", "second", "third"] {
        create_backup(client, name).await?;
    }
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for name in ["first", "second", "third"] {
        let backup = final_backup(&backups, &fixture.kubelet, name, BACKUP_DEADLINE).await?;
        let status = backup.status.context("status")?;
        assert_eq!(status.phase, Some(VolumeBackupPhase::Completed), "{name}");
        let owner = status.owner.context("owner")?.replica;
        assert!(["controller-0", "controller-1"].contains(&owner.as_str()));
        let claimed = haulage::api::condition::find_condition(
            &status.conditions,
            haulage::api::condition::condition_type::CLAIMED,
        )
        .context("Claimed condition")?;
        assert_eq!(
            claimed.message,
            format!("claimed by replica {owner}"),
            "{name}: the status was written by a replica that does not own it"
        );
    }

    // SIGTERM stops the binary cleanly.
    let pid = replica.id().context("pid")?;
    tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    let exit = tokio::time::timeout(Duration::from_secs(30), replica.wait()).await??;
    assert!(exit.success(), "haulage controller exited with {exit}");
    fixture.stop().await;
    Ok(())
}

/// A BSL in the controller's namespace, validated every 5 s.
fn location_object(name: &str, endpoint: &str, bucket: &str, secret: &str) -> serde_json::Value {
    json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
        "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
        "spec": {"bucket": bucket, "prefix": PREFIX, "endpoint": endpoint,
            "region": REGION, "s3ForcePathStyle": true, "initialize": true,
            "credential": {"name": secret, "key": "cloud"},
            "validationFrequency": "5s"}})
}

/// The phase and `Available` reason of every BSL.
async fn location_states(
    client: &kube::Client,
) -> anyhow::Result<std::collections::BTreeMap<String, (Option<BackupStorageLocationPhase>, String)>>
{
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    Ok(locations
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|location| {
            let status = location.status.clone().unwrap_or_default();
            let why = haulage::api::condition::find_condition(
                &status.conditions,
                haulage::api::condition::condition_type::AVAILABLE,
            )
            .map(|condition| condition.reason.clone())
            .unwrap_or_default();
            (
                location.metadata.name.clone().unwrap_or_default(),
                (status.phase, why),
            )
        })
        .collect())
}

/// Create a VolumeBackup of the claim labelled `claim` into `location`.
async fn create_backup_to(
    client: &kube::Client,
    name: &str,
    claim: &str,
    location: &str,
) -> anyhow::Result<()> {
    create::<VolumeBackup>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"namespaces": ["shop", "web"], "storageLocation": location,
                "selector": {"matchLabels": {"claim": claim}}}}),
    )
    .await?;
    Ok(())
}

impl Fixture {
    /// The controller is Ready and its task still runs.
    async fn assert_controller_up(&self, when: &str) {
        assert!(
            !self.controller.is_finished(),
            "{when}: the controller task exited"
        );
        assert_eq!(
            http_status(self.health_port, "/readyz").await,
            Some(200),
            "{when}: /readyz"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_storage_locations_get_their_reasons_while_the_controller_stays_ready_and_a_stopped_server_recovers()
-> anyhow::Result<()> {
    // A second S3 server with a bucket, stopped before the controller
    // starts; restarted later on the same port and data directory.
    let mut stopped = MinioServer::start().await?;
    stopped.create_bucket(BUCKET).await?;
    stopped.stop();
    let wrong_credentials = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "wrong-credentials", "namespace": SYSTEM_NAMESPACE},
        "stringData": {"cloud": format!(
            "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = not-the-secret\n")}});
    // The good server's endpoint is only known once the fixture started
    // it, so the two BSLs on it are created right after; the stopped one
    // exists before the controller starts.
    let fixture = Fixture::start_with_objects(
        None,
        1 << 20,
        false,
        SECRET_KEY,
        &[
            wrong_credentials,
            location_object("stopped", &stopped.endpoint(), BUCKET, "s3-credentials"),
        ],
        false,
    )
    .await?;
    let client = &fixture.client;
    let endpoint = fixture.minio.endpoint();
    // The wrong bucket is also marked default: two defaults, the older
    // (the fixture's `minio`) wins.
    let mut wrong_bucket = location_object(
        "wrong-bucket",
        &endpoint,
        "no-such-bucket",
        "s3-credentials",
    );
    wrong_bucket["spec"]["default"] = json!(true);
    for object in [
        wrong_bucket,
        location_object("wrong-credentials", &endpoint, BUCKET, "wrong-credentials"),
    ] {
        create::<BackupStorageLocation>(client, Some(SYSTEM_NAMESPACE), object).await?;
    }
    wait_until_ready(fixture.health_port, Duration::from_secs(60))
        .await
        .context("the controller never became ready")?;
    fixture.assert_controller_up("at start").await;

    let expected = [
        ("stopped", "EndpointUnreachable"),
        ("wrong-bucket", "BucketNotFound"),
        ("wrong-credentials", "AccessDenied"),
    ];
    let reasons = eventually(Duration::from_secs(120), || async {
        let states = location_states(client).await?;
        let all = expected.iter().all(|(name, why)| {
            states.get(*name).is_some_and(|(phase, reason)| {
                *phase == Some(BackupStorageLocationPhase::Unavailable) && reason == why
            })
        });
        Ok(all.then_some(()))
    })
    .await;
    if let Err(error) = reasons {
        bail!(
            "the bad locations did not get their reasons ({error}): {:#?}",
            location_states(client).await?
        );
    }
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for (name, _) in expected {
        let message = locations
            .get(name)
            .await?
            .status
            .and_then(|status| status.message)
            .unwrap_or_default();
        assert!(!message.contains(SECRET_KEY), "{name}: {message}");
        assert!(!message.contains("not-the-secret"), "{name}: {message}");
        assert!(message.len() <= 1024, "{name}: {} bytes", message.len());
    }
    fixture
        .assert_controller_up("with three bad locations")
        .await;

    // Both defaults carry the conflict, each naming the other.
    let default_condition = |name: &'static str| {
        let locations = locations.clone();
        async move {
            let status = locations.get(name).await?.status.unwrap_or_default();
            anyhow::Ok(
                haulage::api::condition::find_condition(
                    &status.conditions,
                    haulage::api::condition::condition_type::UNIQUE_DEFAULT,
                )
                .cloned(),
            )
        }
    };
    let conflict = eventually(Duration::from_secs(60), || async {
        let winner = default_condition("minio").await?;
        let loser = default_condition("wrong-bucket").await?;
        Ok(match (winner, loser) {
            (Some(winner), Some(loser))
                if winner.reason == haulage::api::condition::reason::DEFAULT_CONFLICT
                    && loser.reason == haulage::api::condition::reason::DEFAULT_CONFLICT =>
            {
                Some((winner, loser))
            }
            _ => None,
        })
    })
    .await;
    let (winner, loser) = match conflict {
        Ok(pair) => pair,
        Err(error) => bail!(
            "no DefaultConflict on both defaults ({error}): minio {:?}, wrong-bucket {:?}",
            default_condition("minio").await?,
            default_condition("wrong-bucket").await?
        ),
    };
    assert_eq!(winner.status, haulage::api::ConditionStatus::False);
    assert!(
        winner
            .message
            .contains("wrong-bucket is also marked default"),
        "{}",
        winner.message
    );
    assert!(
        loser.message.contains("minio is older"),
        "{}",
        loser.message
    );

    // A backup to the good location completes; one to the stopped server
    // waits with a condition.
    create_backup_to(client, "to-good", "logs", "minio").await?;
    create_backup_to(client, "to-stopped", "content", "stopped").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let finished = final_backup(&backups, &fixture.kubelet, "to-good", BACKUP_DEADLINE)
        .await?
        .status
        .and_then(|status| status.phase);
    assert_eq!(finished, Some(VolumeBackupPhase::Completed));
    let waiting = backups.get("to-stopped").await?.status.unwrap_or_default();
    assert_eq!(waiting.phase, Some(VolumeBackupPhase::WaitingForStorage));
    let storage = haulage::api::condition::find_condition(
        &waiting.conditions,
        haulage::api::condition::condition_type::STORAGE_AVAILABLE,
    )
    .context("StorageAvailable condition")?;
    assert_eq!(storage.status, haulage::api::ConditionStatus::False);
    assert_eq!(
        storage.reason,
        haulage::api::condition::reason::STORAGE_LOCATION_UNAVAILABLE
    );
    assert!(storage.message.contains("stopped"), "{}", storage.message);

    // `haulage status -o json` shows the four locations from status.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args([
            "status",
            "-o",
            "json",
            "--namespace",
            SYSTEM_NAMESPACE,
            "--kubeconfig",
        ])
        .arg(fixture.cluster.kubeconfig())
        .output()
        .await?;
    assert!(
        output.status.success(),
        "haulage status exited with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let phases: std::collections::BTreeMap<String, (String, String)> = report["locations"]
        .as_array()
        .context("locations array")?
        .iter()
        .map(|location| {
            (
                location["name"].as_str().unwrap_or_default().to_string(),
                (
                    location["phase"].as_str().unwrap_or_default().to_string(),
                    location["reason"].as_str().unwrap_or_default().to_string(),
                ),
            )
        })
        .collect();
    assert_eq!(phases.len(), 4, "{report:#}");
    assert_eq!(phases["minio"].0, "Available", "{report:#}");
    for (name, why) in expected {
        assert_eq!(
            phases[name],
            ("Unavailable".to_string(), why.to_string()),
            "{report:#}"
        );
    }
    assert_eq!(report["defaultLocation"], "minio");
    assert!(
        report["problems"]
            .as_array()
            .is_some_and(|problems| problems.iter().any(|problem| problem
                .as_str()
                .is_some_and(|text| text.contains("several locations are marked default")))),
        "{report:#}"
    );
    assert!(
        report["queuedBackups"]
            .as_array()
            .is_some_and(|queued| queued.iter().any(|backup| backup["name"] == "to-stopped")),
        "{report:#}"
    );

    // The conflict is fixed: the remaining default says it is the only one.
    locations
        .patch(
            "wrong-bucket",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"default": false}})),
        )
        .await?;
    eventually(Duration::from_secs(60), || async {
        let winner = default_condition("minio").await?;
        let loser = default_condition("wrong-bucket").await?;
        Ok((loser.is_none()
            && winner.is_some_and(|condition| {
                condition.status == haulage::api::ConditionStatus::True
                    && condition.reason == haulage::api::condition::reason::SINGLE_DEFAULT
            }))
        .then_some(()))
    })
    .await
    .context("the default conditions did not follow the fix")?;

    // The server comes back: the next probe (every 5 s) initialises the
    // repository there (spec.initialize) and the waiting backup runs.
    stopped.restart().await?;
    eventually(Duration::from_secs(60), || async {
        let states = location_states(client).await?;
        Ok(states
            .get("stopped")
            .is_some_and(|(phase, _)| *phase == Some(BackupStorageLocationPhase::Available))
            .then_some(()))
    })
    .await
    .context("the restarted server's location never became Available")?;
    let finished = final_backup(&backups, &fixture.kubelet, "to-stopped", BACKUP_DEADLINE)
        .await?
        .status
        .and_then(|status| status.phase);
    assert_eq!(finished, Some(VolumeBackupPhase::Completed));
    let store = open_store(&format!("s3://{BUCKET}/{PREFIX}"), &stopped.store_options()).await?;
    let repository = Repository::open(store).await?;
    assert_eq!(repository.snapshot_ids().await?.len(), 1);

    // The winning default is deleted: the other default, probed only on
    // change (validationFrequency 0, so no periodic probe would ever
    // correct it), learns it is now the only one from the deletion. The
    // locations still probed every 5 s go first: any change of a location
    // also re-evaluates the defaults, which would hide a missed deletion.
    for name in ["stopped", "wrong-credentials"] {
        locations
            .delete(name, &kube::api::DeleteParams::default())
            .await?;
    }
    locations
        .patch(
            "wrong-bucket",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"default": true, "validationFrequency": "0"}})),
        )
        .await?;
    eventually(Duration::from_secs(60), || async {
        Ok(default_condition("wrong-bucket")
            .await?
            .is_some_and(|condition| {
                condition.reason == haulage::api::condition::reason::DEFAULT_CONFLICT
            })
            .then_some(()))
    })
    .await
    .context("the second default did not get its conflict back")?;
    locations
        .delete("minio", &kube::api::DeleteParams::default())
        .await?;
    eventually(Duration::from_secs(60), || async {
        Ok(default_condition("wrong-bucket")
            .await?
            .is_some_and(|condition| {
                condition.status == haulage::api::ConditionStatus::True
                    && condition.reason == haulage::api::condition::reason::SINGLE_DEFAULT
            })
            .then_some(()))
    })
    .await
    .context("deleting the winning default did not update the other default's condition")?;
    fixture.assert_controller_up("at the end").await;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_any_storage_location_the_controller_is_ready_backups_wait_and_status_exits_5()
-> anyhow::Result<()> {
    let cluster = KubeCluster::start().await?;
    cluster
        .kubectl_ok(&["apply", "-k", &manifests().to_string_lossy()], None)
        .await?;
    cluster
        .wait_for_crds(&[
            "crd/volumebackups.haulage.dev",
            "crd/backupstoragelocations.haulage.dev",
        ])
        .await?;
    let client = cluster.client().await?;
    // The admin client: this test is about having no location, not about
    // RBAC, which the fixture's tests cover with the controller's own token.
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let health_port = health.local_addr()?.port();
    let config = haulage::controller::Config {
        agent_image: "mover-agent:test".to_string(),
        health_address: format!("127.0.0.1:{health_port}").parse()?,
        concurrency: 2,
        replica_lease_seconds: haulage::controller::MIN_LEASE_SECONDS,
        ..haulage::controller::Config::new(SYSTEM_NAMESPACE, "controller-0")
    };
    let shutdown = CancellationToken::new();
    let controller = tokio::spawn(haulage::controller::run_with_listener(
        config,
        client.clone(),
        health,
        shutdown.clone(),
    ));
    wait_until_ready(health_port, Duration::from_secs(60))
        .await
        .context("the controller never became ready without a location")?;

    create_backup(&client, "orphan").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(60), || async {
        let status = backups.get("orphan").await?.status.unwrap_or_default();
        let waiting = status.phase == Some(VolumeBackupPhase::WaitingForStorage)
            && haulage::api::condition::find_condition(
                &status.conditions,
                haulage::api::condition::condition_type::STORAGE_AVAILABLE,
            )
            .is_some_and(|condition| {
                condition.reason == haulage::api::condition::reason::STORAGE_LOCATION_NOT_FOUND
            });
        Ok(waiting.then_some(()))
    })
    .await
    .context("the backup did not wait for a location with a condition")?;

    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args([
            "status",
            "-o",
            "json",
            "-n",
            SYSTEM_NAMESPACE,
            "--kubeconfig",
        ])
        .arg(cluster.kubeconfig())
        .output()
        .await?;
    assert_eq!(
        output.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    assert_eq!(report["locations"], json!([]), "{report:#}");
    assert_eq!(report["queuedBackups"][0]["name"], "orphan", "{report:#}");
    assert!(
        report["problems"]
            .as_array()
            .is_some_and(|problems| problems.iter().any(|problem| problem
                .as_str()
                .is_some_and(|text| text.contains("no BackupStorageLocation")))),
        "{report:#}"
    );

    assert!(!controller.is_finished(), "the controller task exited");
    assert_eq!(http_status(health_port, "/readyz").await, Some(200));
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(30), controller).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "the controller did not stop cleanly: {stopped:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_replicas_backup_is_adopted_by_another_and_completes() -> anyhow::Result<()> {
    // 12 MiB per claim at 1 MiB/s: the backup is still running when its
    // owner crashes.
    let fixture = Fixture::start(Some(1 << 20), 12 << 20, true).await?;
    let client = fixture.client.clone();
    create_backup_of(
        &client,
        "adopted",
        json!({"matchLabels": {"claim": "archive"}}),
    )
    .await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(120), || async {
        let backup = backups.get("adopted").await?;
        let status = backup.status.unwrap_or_default();
        let owned = status
            .owner
            .is_some_and(|owner| owner.replica == "controller-0");
        let running = status
            .volumes
            .is_some_and(|volumes| volumes.in_progress > 0);
        Ok((owned && running).then_some(()))
    })
    .await
    .context("controller-0 never started the backup")?;

    // The crash: the replica's future is dropped, with every task it
    // spawned; nothing runs on the way out, so its lease stays behind.
    fixture.controller.abort();
    eventually(Duration::from_secs(10), || async {
        Ok(fixture.controller.is_finished().then_some(()))
    })
    .await
    .context("the aborted controller did not stop")?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    assert!(
        leases
            .get_opt(&haulage::controller::replicas::lease_name("controller-0"))
            .await?
            .is_some(),
        "a crashed replica's lease stays until it expires"
    );

    let (shutdown, successor) = fixture
        .spawn_controller(Fixture::controller_config("controller-1")?)
        .await?;

    let backup = final_backup(&backups, &fixture.kubelet, "adopted", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
    let owner = status.owner.context("owner")?;
    assert_eq!(owner.replica, "controller-1");
    assert_eq!(owner.adopted_from.as_deref(), Some("controller-0"));
    let claimed = haulage::api::condition::find_condition(
        &status.conditions,
        haulage::api::condition::condition_type::CLAIMED,
    )
    .context("Claimed condition")?;
    assert_eq!(
        claimed.reason,
        haulage::api::condition::reason::ADOPTED_FROM_REPLICA
    );
    assert_eq!(status.results.len(), 1);
    assert!(
        status.results[0].snapshot_id.is_some(),
        "{:?}",
        status.results
    );
    // Nothing left: the successor released the stage pod and its secrets.
    eventually(Duration::from_secs(60), || async {
        Ok((leftovers(&client).await? == (0, 0)).then_some(()))
    })
    .await
    .context("stage pods or credential copies remain")?;

    // A clean stop releases the lease at once.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), successor).await???;
    assert!(
        leases
            .get_opt(&haulage::controller::replicas::lease_name("controller-1"))
            .await?
            .is_none(),
        "a stopped replica deletes its lease"
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicted_stage_pod_is_recreated_and_a_crash_looping_one_fails_its_volume_with_the_last_log_line()
-> anyhow::Result<()> {
    // 12 MiB per claim at 1 MiB/s: both transfers run long enough to be
    // interrupted. "archive" (shop) and "content" (web) are in different
    // namespaces, so in different stage pods.
    let fixture = Fixture::start(Some(1 << 20), 12 << 20, true).await?;
    let client = fixture.client.clone();
    create_backup_of(
        &client,
        "supervised",
        json!({"matchExpressions": [{"key": "claim", "operator": "In", "values": ["archive", "content"]}]}),
    )
    .await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let stage_pod_of = |pvc: &'static str| {
        let transfers = transfers.clone();
        async move {
            let list = transfers.list(&ListParams::default()).await?;
            let transfer = list
                .items
                .into_iter()
                .find(|transfer| transfer.spec.pvc == pvc)
                .filter(|transfer| {
                    transfer.status.as_ref().and_then(|status| status.phase)
                        == Some(VolumeTransferPhase::InProgress)
                });
            anyhow::Ok(transfer.map(|transfer| {
                (
                    transfer.metadata.namespace.clone().unwrap_or_default(),
                    transfer.spec.stage_pod.clone(),
                )
            }))
        }
    };
    let (archive_namespace, archive_pod) =
        eventually(Duration::from_secs(120), || stage_pod_of("archive"))
            .await
            .context("archive never started")?;
    let (content_namespace, content_pod) =
        eventually(Duration::from_secs(120), || stage_pod_of("content"))
            .await
            .context("content never started")?;

    // The node evicts archive's stage pod: the controller recreates it
    // after its backoff and the transfer resumes.
    fixture
        .kubelet
        .evict(&archive_namespace, &archive_pod)
        .await?;

    // content's agent keeps dying: each time it is up again, it is killed,
    // until the kubelet reports five restarts; then its volume fails.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &content_namespace);
    let kills = std::sync::atomic::AtomicI32::new(0);
    eventually(Duration::from_secs(120), || {
        let pods = pods.clone();
        let kubelet = &fixture.kubelet;
        let content_namespace = content_namespace.clone();
        let content_pod = content_pod.clone();
        let kills = &kills;
        async move {
            // Gone: the controller already stopped it after the fifth restart.
            let Some(pod) = pods.get_opt(&content_pod).await? else {
                return Ok(Some(()));
            };
            let container = pod
                .status
                .and_then(|status| status.container_statuses)
                .and_then(|statuses| statuses.into_iter().next());
            let Some(container) = container else {
                return Ok(None);
            };
            if container.restart_count >= 5 {
                return Ok(Some(()));
            }
            let running = container.state.is_some_and(|state| state.running.is_some());
            // Kill each incarnation once: the one the kubelet reports
            // running after as many restarts as there were kills.
            if running
                && container.restart_count == kills.load(std::sync::atomic::Ordering::SeqCst)
                && kubelet.kill(&content_namespace, &content_pod)
            {
                kills.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Ok(None)
        }
    })
    .await
    .context("content's agent was not restarted five times")?;

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "supervised", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::PartiallyFailed),
        "{:?}",
        status.results
    );
    let result = |pvc: &str| {
        status
            .results
            .iter()
            .find(|result| result.pvc == pvc)
            .cloned()
            .with_context(|| format!("no result for {pvc}"))
    };
    let archive = result("archive")?;
    assert_eq!(archive.phase, VolumeTransferPhase::Completed, "{archive:?}");
    assert!(archive.snapshot_id.is_some());
    let content = result("content")?;
    assert_eq!(content.phase, VolumeTransferPhase::Failed);
    let message = content.message.unwrap_or_default();
    assert!(
        message.contains(&format!("the agent in stage pod {content_pod} crashed"))
            && message.contains("last: exit code 137 (Error): "),
        "{message}"
    );
    let archive_transfer = transfers
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|transfer| transfer.spec.pvc == "archive")
        .context("archive transfer")?;
    assert_eq!(
        archive_transfer.status.and_then(|status| status.attempts),
        Some(1),
        "one earlier stage pod for archive"
    );
    // `kubectl describe vbk supervised` tells the story as Events.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let reasons = eventually(Duration::from_secs(30), || async {
        let reasons: std::collections::BTreeSet<String> = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|event| {
                event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("supervised")
            })
            .filter_map(|event| event.reason)
            .collect();
        Ok([
            "ClaimedByReplica",
            "StagePodRecreated",
            "StagePodFailed",
            "PartiallyFailed",
        ]
        .iter()
        .all(|reason| reasons.contains(*reason))
        .then_some(reasons))
    })
    .await
    .context("the backup's events are missing")?;
    assert!(reasons.contains("StagePodFailed"), "{reasons:?}");
    eventually(Duration::from_secs(60), || async {
        Ok((leftovers(&client).await? == (0, 0)).then_some(()))
    })
    .await
    .context("stage pods or credential copies remain")?;
    fixture.stop().await;
    Ok(())
}

/// The stage pods (namespace, name) that exist now.
async fn stage_pods(client: &kube::Client) -> anyhow::Result<Vec<(String, String)>> {
    let pods: Api<Pod> = Api::all(client.clone());
    Ok(pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=haulage-agent"))
        .await?
        .items
        .iter()
        .map(|pod| {
            (
                pod.metadata.namespace.clone().unwrap_or_default(),
                pod.metadata.name.clone().unwrap_or_default(),
            )
        })
        .collect())
}

/// One agent's scrape with every per-transfer series of its volume, bytes
/// read and time waited on the upload cap.
struct AgentScrape {
    address: std::net::SocketAddr,
    namespace: String,
    pvc: String,
    exposition: Exposition,
}

/// Scrape the running agents until one shows bytes read and time waited on
/// the upload cap for one of its volumes.
async fn scrape_a_busy_agent(fixture: &Fixture) -> anyhow::Result<AgentScrape> {
    eventually(BACKUP_DEADLINE, || async {
        for (namespace, pod) in stage_pods(&fixture.client).await? {
            let Some(address) = fixture.kubelet.agent_metrics_address(&namespace, &pod) else {
                continue;
            };
            // The agent may have finished and exited since.
            let Ok(exposition) = scrape(address).await else {
                continue;
            };
            let waited = exposition.sum(
                "haulage_agent_throttle_wait_seconds_total",
                &[("limiter", "upload")],
            );
            let busy = exposition
                .find(
                    "haulage_agent_bytes_read_total",
                    &[("namespace", &namespace)],
                )
                .find(|sample| sample.value > 0.0)
                .map(|sample| sample.labels["pvc"].clone());
            if let Some(pvc) = busy
                && waited > 0.0
            {
                return Ok(Some(AgentScrape {
                    address,
                    namespace,
                    pvc,
                    exposition,
                }));
            }
        }
        Ok(None)
    })
    .await
    .with_context(|| format!("no busy agent seen:\n{}", fixture.kubelet.all_agent_logs()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_controller_and_agent_metrics_exist_and_move_with_a_volume_backup() -> anyhow::Result<()>
{
    // Incompressible data behind a 512 KiB/s upload cap per agent: uploads
    // wait on the cap, and agents live long enough to be scraped.
    let fixture = Fixture::start(Some(512 << 10), 3 << 20, true).await?;
    let client = &fixture.client;
    let location = [("namespace", SYSTEM_NAMESPACE), ("location", "minio")];

    let before = scrape(fixture.health_address).await?;
    assert_eq!(
        before.value("haulage_storage_location_available", &location)?,
        1.0
    );
    assert!(before.value("haulage_storage_location_probe_latency_seconds", &location)? > 0.0);
    assert!(
        before.value(
            "haulage_storage_location_last_validation_timestamp_seconds",
            &location
        )? > 1.7e9
    );
    assert!(
        before.sum(
            "haulage_reconcile_duration_seconds_count",
            &[("controller", "backupstoragelocation")]
        ) > 0.0
    );
    // Families computed at scrape time are declared even while empty; the
    // byte counters appear with their first series.
    for (family, kind) in [
        ("haulage_reconcile_duration_seconds", "histogram"),
        ("haulage_volume_transfers", "gauge"),
        ("haulage_transfer_queue_length", "gauge"),
        ("haulage_transfer_throughput_bytes_per_second", "gauge"),
        ("haulage_volume_backups", "gauge"),
        ("haulage_waiting_volume_backups", "gauge"),
    ] {
        assert_eq!(
            before.types.get(family).map(String::as_str),
            Some(kind),
            "{family}"
        );
    }
    let read_before = before.sum("haulage_transfer_bytes_read_total", &[]);
    let uploaded_before = before.sum("haulage_transfer_bytes_uploaded_total", &[]);

    create_backup(client, "observed").await?;

    // An agent mid-transfer: its per-volume series, and counters that only
    // grow between two scrapes.
    let first = scrape_a_busy_agent(&fixture).await?;
    let volume = [
        ("namespace", first.namespace.as_str()),
        ("pvc", first.pvc.as_str()),
    ];
    for family in [
        "haulage_agent_transfer_bytes_done",
        "haulage_agent_transfer_size_bytes",
        "haulage_agent_transfer_files_done",
        "haulage_agent_transfer_files",
        "haulage_agent_bytes_read_total",
        "haulage_agent_bytes_uploaded_total",
    ] {
        first.exposition.value(family, &volume)?;
    }
    assert!(
        first
            .exposition
            .value("haulage_agent_transfer_size_bytes", &volume)?
            >= first
                .exposition
                .value("haulage_agent_transfer_bytes_done", &volume)?
    );
    if let Ok(second) = scrape(first.address).await {
        for (family, labels) in [
            ("haulage_agent_bytes_read_total", &volume[..]),
            ("haulage_agent_bytes_uploaded_total", &volume[..]),
            (
                "haulage_agent_throttle_wait_seconds_total",
                &[("limiter", "upload")][..],
            ),
        ] {
            assert!(
                second.value(family, labels)? >= first.exposition.value(family, labels)?,
                "{family} went down"
            );
        }
    }

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "observed", BACKUP_DEADLINE).await?;
    assert_eq!(
        backup.status.and_then(|status| status.phase),
        Some(VolumeBackupPhase::Completed)
    );

    // The controller saw the bytes move and the transfers complete.
    let after = eventually(Duration::from_secs(30), || async {
        let after = scrape(fixture.health_address).await?;
        let completed = after.sum(
            "haulage_volume_transfers",
            &[("phase", "Completed"), ("direction", "Upload")],
        );
        Ok((completed == 5.0).then_some(after))
    })
    .await
    .context("the transfers gauge never showed five completed uploads")?;
    for family in [
        "haulage_transfer_bytes_read_total",
        "haulage_transfer_bytes_uploaded_total",
    ] {
        assert_eq!(
            after.types.get(family).map(String::as_str),
            Some("counter"),
            "{family}"
        );
    }
    let read_after = after.sum(
        "haulage_transfer_bytes_read_total",
        &[("location", "minio")],
    );
    assert!(
        read_after >= read_before + 5.0 * f64::from(3 << 20),
        "bytes read {read_before} -> {read_after}"
    );
    assert!(
        after.sum(
            "haulage_transfer_bytes_uploaded_total",
            &[("location", "minio")]
        ) > uploaded_before
    );
    assert!(
        after.sum(
            "haulage_reconcile_duration_seconds_count",
            &[("controller", "volumebackup")]
        ) > 0.0
    );
    assert_eq!(
        after.value("haulage_volume_backups", &[("phase", "Completed")])?,
        1.0
    );
    assert_eq!(after.value("haulage_transfer_queue_length", &[])?, 0.0);
    assert_eq!(after.value("haulage_waiting_volume_backups", &[])?, 0.0);
    assert_eq!(
        after.value("haulage_storage_location_available", &location)?,
        1.0
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_follows_the_api_server_and_not_the_storage_location() -> anyhow::Result<()> {
    let mut fixture = Fixture::start(None, 1 << 20, false).await?;
    let address = fixture.health_address;
    let location = [("namespace", SYSTEM_NAMESPACE), ("location", "minio")];
    wait_until_ready(address.port(), Duration::from_secs(60))
        .await
        .context("never ready")?;

    // The storage goes away: the location turns Unavailable and its gauge
    // 0, and the controller stays ready.
    fixture.minio.stop();
    eventually(Duration::from_secs(90), || async {
        let exposition = scrape(address).await?;
        Ok(
            (exposition.value("haulage_storage_location_available", &location)? == 0.0)
                .then_some(()),
        )
    })
    .await
    .context("the location's gauge never fell to 0")?;
    assert_eq!(http_status(address.port(), "/readyz").await, Some(200));

    // The API server goes away: not ready (within the 10 s check interval
    // and its 5 s timeout), still alive, metrics still served from the
    // caches.
    fixture.cluster.stop_apiserver();
    let body = eventually(Duration::from_secs(60), || async {
        Ok(http_get(address.port(), "/readyz")
            .await
            .filter(|(status, _)| *status == 503)
            .map(|(_, body)| body))
    })
    .await
    .context("still ready without an API server")?;
    assert!(body.starts_with("API server not reachable: "), "{body}");
    assert_eq!(http_status(address.port(), "/healthz").await, Some(200));
    assert_eq!(
        scrape(address)
            .await?
            .value("haulage_storage_location_available", &location)?,
        0.0
    );
    fixture.stop().await;
    Ok(())
}

/// What a watch of every VolumeTransfer saw, event by event.
#[derive(Debug, Default)]
struct AdmissionRecord {
    /// Latest phase of each transfer.
    phases: std::collections::BTreeMap<(String, String), VolumeTransferPhase>,
    /// Most transfers Admitted, InProgress or Finalizing after any event.
    max_running: usize,
    /// Queue positions seen.
    positions: std::collections::BTreeSet<i32>,
    /// Messages of `Admitted=False` conditions seen.
    holds: std::collections::BTreeSet<String>,
    /// Grants of transfers seen running.
    grants: std::collections::BTreeSet<Option<i64>>,
    /// Events seen.
    events: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storage_policy_of_one_volume_admits_its_transfers_one_at_a_time_and_queues_the_rest()
-> anyhow::Result<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    const POLICY_BYTES_PER_SECOND: i64 = 8 << 20;
    let fixture = Fixture::start(None, 2 << 20, false).await?;
    let client = &fixture.client;
    // Selected by provisioner, so the StorageClass cache is what matches it.
    create::<haulage::api::StoragePolicy>(
        client,
        None,
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "StoragePolicy",
            "metadata": {"name": "one-at-a-time"},
            "spec": {"provisioners": [PROVISIONER], "maxConcurrentVolumes": 1,
                "maxBytesPerSecond": POLICY_BYTES_PER_SECOND}}),
    )
    .await?;
    // No wait for the controller to see the policy: admission reads the
    // policies from the API server before it admits, so the backup created
    // right after is capped from its first transfer.

    // Every change of every transfer, in the API server's order.
    let record = Arc::new(std::sync::Mutex::new(AdmissionRecord::default()));
    let recorder = {
        let record = record.clone();
        let events = watcher(
            Api::<VolumeTransfer>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .applied_objects();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(Ok(transfer)) = events.next().await {
                let mut record = record.lock().expect("record lock");
                let status = transfer.status.clone().unwrap_or_default();
                let phase = status.phase.unwrap_or(VolumeTransferPhase::New);
                let key = (
                    transfer.metadata.namespace.clone().unwrap_or_default(),
                    transfer.metadata.name.clone().unwrap_or_default(),
                );
                record.phases.insert(key, phase);
                let running = |phase: &VolumeTransferPhase| {
                    matches!(
                        phase,
                        VolumeTransferPhase::Admitted
                            | VolumeTransferPhase::InProgress
                            | VolumeTransferPhase::Finalizing
                    )
                };
                let now_running = record.phases.values().filter(|p| running(p)).count();
                record.max_running = record.max_running.max(now_running);
                record.events += 1;
                if let Some(position) = status.queue_position {
                    record.positions.insert(position);
                }
                if running(&phase) {
                    record.grants.insert(transfer.spec.granted_bytes_per_second);
                }
                if let Some(condition) = haulage::api::condition::find_condition(
                    &status.conditions,
                    haulage::api::condition::condition_type::ADMITTED,
                ) && condition.status == haulage::api::ConditionStatus::False
                {
                    record.holds.insert(condition.message.clone());
                }
            }
        })
    };

    create_backup(client, "serial").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "serial", BACKUP_DEADLINE)
        .await
        .with_context(|| {
            format!(
                "admissions seen: {:#?}",
                record.lock().map(|r| format!("{r:?}"))
            )
        })?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{status:#?}"
    );
    let counts = status.volumes.context("volume counts")?;
    assert_eq!((counts.total, counts.completed), (5, 5));

    // The policy's status settles at nothing running, nothing queued.
    let policies: Api<haulage::api::StoragePolicy> = Api::all(client.clone());
    eventually(Duration::from_secs(30), || async {
        let policy = policies.get("one-at-a-time").await?;
        let status = policy.status.unwrap_or_default();
        Ok((status.running_volumes == Some(0) && status.queued_volumes == Some(0)).then_some(()))
    })
    .await
    .context("the StoragePolicy status did not settle")?;
    recorder.abort();

    {
        let record = record.lock().expect("record lock");
        assert_eq!(record.phases.len(), 5, "{record:?}");
        assert_eq!(
            record.max_running, 1,
            "more than one transfer of the policy's storage ran at once: {record:?}"
        );
        // Four waited behind the first, numbered from 1.
        assert!(record.positions.contains(&1), "{record:?}");
        assert!(
            record.positions.iter().all(|p| (1..=4).contains(p)),
            "{record:?}"
        );
        assert!(
            record.holds.iter().any(|message| message
                .contains("held by StoragePolicy one-at-a-time: 1 of 1 volumes running")),
            "{record:?}"
        );
        // Alone under the policy, each running transfer got its whole bandwidth.
        assert_eq!(
            record.grants,
            std::collections::BTreeSet::from([Some(POLICY_BYTES_PER_SECOND)]),
            "{record:?}"
        );
    }
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grants_are_re_split_as_transfers_start_and_end_never_adding_up_past_the_cap()
-> anyhow::Result<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    const CAP: i64 = 4 << 20;
    let fixture = Fixture::start(None, 4 << 20, false).await?;
    let client = &fixture.client;
    create::<haulage::api::StoragePolicy>(
        client,
        None,
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "StoragePolicy",
            "metadata": {"name": "four-mebibytes"},
            "spec": {"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": CAP}}),
    )
    .await?;

    // After every event: the sum of the grants of the running transfers,
    // and each transfer's distinct grants while running.
    #[derive(Debug, Default)]
    struct Grants {
        max_sum: i64,
        unlimited_while_running: usize,
        per_transfer: std::collections::BTreeMap<String, std::collections::BTreeSet<i64>>,
    }
    let grants = Arc::new(std::sync::Mutex::new(Grants::default()));
    let recorder = {
        let grants = grants.clone();
        let events = watcher(
            Api::<VolumeTransfer>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .applied_objects();
        tokio::spawn(async move {
            let mut latest: std::collections::BTreeMap<String, Option<i64>> =
                std::collections::BTreeMap::new();
            let mut events = std::pin::pin!(events);
            while let Some(Ok(transfer)) = events.next().await {
                let name = transfer.metadata.name.clone().unwrap_or_default();
                let phase = transfer
                    .status
                    .as_ref()
                    .and_then(|status| status.phase)
                    .unwrap_or(VolumeTransferPhase::New);
                let running = matches!(
                    phase,
                    VolumeTransferPhase::Admitted
                        | VolumeTransferPhase::InProgress
                        | VolumeTransferPhase::Finalizing
                );
                let grant = transfer.spec.granted_bytes_per_second;
                let mut grants = grants.lock().expect("grants lock");
                if running {
                    latest.insert(name.clone(), grant);
                    match grant {
                        Some(bytes) => {
                            grants.per_transfer.entry(name).or_default().insert(bytes);
                        }
                        None => grants.unlimited_while_running += 1,
                    }
                } else {
                    latest.remove(&name);
                }
                let sum = latest
                    .values()
                    .map(|grant| grant.unwrap_or(i64::MAX))
                    .fold(0i64, i64::saturating_add);
                grants.max_sum = grants.max_sum.max(sum);
            }
        })
    };

    create_backup(client, "resplit").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "resplit", BACKUP_DEADLINE).await?;
    recorder.abort();
    assert_eq!(
        backup.status.and_then(|status| status.phase),
        Some(VolumeBackupPhase::Completed)
    );
    let logs = fixture.kubelet.all_agent_logs();
    {
        let grants = grants.lock().expect("grants lock");
        assert_eq!(grants.unlimited_while_running, 0, "{grants:?}");
        assert!(
            grants.max_sum <= CAP,
            "the running transfers' grants added up to {} > {CAP}: {grants:?}",
            grants.max_sum
        );
        // Re-split while running: some transfer saw its grant change, and
        // its agent applied the change without restarting.
        let resplit = grants
            .per_transfer
            .values()
            .filter(|seen| seen.len() >= 2)
            .count();
        assert!(resplit > 0, "no grant changed while running: {grants:?}");
    }
    assert!(
        logs.contains("bandwidth grant changed"),
        "no agent followed a changed grant:\n{logs}"
    );
    fixture.stop().await;
    Ok(())
}

/// The bandwidth split measured, not asserted (figures in
/// docs/benchmarks.md): five claims of 7 to 31 MiB of random data under a
/// StoragePolicy of 6 MiB/s. After every progress report, the sum of the
/// running agents' measured read rates (each over its last 2 s interval) is
/// a sample; a sample is steady when the running set and every grant have
/// not changed for 3 s, so each summed rate was measured under the grants
/// in force. Also the average over the whole backup. Run with
/// `cargo test --test integration measure_the_bandwidth_split -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~30 s), not a check"]
async fn measure_the_bandwidth_split_under_a_storage_policy() -> anyhow::Result<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    const CAP: i64 = 6 << 20;
    /// How long grants and the running set must stand still for a sample
    /// to count as steady (agents report every 2 s).
    const STEADY: Duration = Duration::from_secs(3);
    let fixture = Fixture::start(None, 1 << 20, true).await?;
    let client = &fixture.client;
    let claims = [
        ("shop", "db"),
        ("shop", "uploads"),
        ("shop", "archive"),
        ("web", "content"),
        ("web", "logs"),
    ];
    for (index, (namespace, pvc)) in claims.iter().enumerate() {
        let size = (index + 1) * (6 << 20);
        std::fs::write(
            fixture.volumes.join(namespace).join(pvc).join("extra.bin"),
            random_bytes(100 + index as u64, size),
        )?;
    }
    create::<haulage::api::StoragePolicy>(
        client,
        None,
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "StoragePolicy",
            "metadata": {"name": "six-mebibytes"},
            "spec": {"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": CAP}}),
    )
    .await?;

    #[derive(Default)]
    struct Measured {
        /// Steady sums of the running transfers' reported rates.
        steady: Vec<i64>,
        /// Every sum with at least two running.
        all: Vec<i64>,
        first_start: Option<Instant>,
        last_end: Option<Instant>,
    }
    let measured = Arc::new(std::sync::Mutex::new(Measured::default()));
    let recorder = {
        let measured = measured.clone();
        let events = watcher(
            Api::<VolumeTransfer>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .applied_objects();
        tokio::spawn(async move {
            // name → (running, grant, last reported rate)
            let mut latest: std::collections::BTreeMap<String, (bool, Option<i64>, i64)> =
                std::collections::BTreeMap::new();
            let mut last_change = Instant::now();
            let mut events = std::pin::pin!(events);
            while let Some(Ok(transfer)) = events.next().await {
                let now = Instant::now();
                let status = transfer.status.clone().unwrap_or_default();
                let phase = status.phase.unwrap_or(VolumeTransferPhase::New);
                let running = phase == VolumeTransferPhase::InProgress;
                let grant = transfer.spec.granted_bytes_per_second;
                let rate = status.progress.as_ref().map_or(0, |p| p.bytes_per_second);
                let name = transfer.metadata.name.clone().unwrap_or_default();
                let before = latest.insert(name, (running, grant, rate));
                if before.is_none_or(|(was_running, old_grant, _)| {
                    was_running != running || old_grant != grant
                }) {
                    last_change = now;
                }
                let mut measured = measured.lock().expect("measured lock");
                if running {
                    measured.first_start.get_or_insert(now);
                }
                if phase == VolumeTransferPhase::Completed {
                    measured.last_end = Some(now);
                }
                let rates: Vec<i64> = latest
                    .values()
                    .filter(|(running, _, _)| *running)
                    .map(|(_, _, rate)| *rate)
                    .collect();
                if rates.len() >= 2 && rates.iter().all(|rate| *rate > 0) {
                    let sum = rates.iter().sum();
                    measured.all.push(sum);
                    if now.duration_since(last_change) >= STEADY {
                        measured.steady.push(sum);
                    }
                }
            }
        })
    };

    create_backup(client, "measured").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "measured", BACKUP_DEADLINE).await?;
    recorder.abort();
    let status = backup.status.context("status")?;
    assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let bytes_read: i64 = transfers
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|transfer| transfer.status.as_ref()?.bytes_read)
        .sum();

    let (mut steady, mut all, first, last) = {
        let measured = measured.lock().expect("measured lock");
        (
            measured.steady.clone(),
            measured.all.clone(),
            measured.first_start,
            measured.last_end,
        )
    };
    let (first, last) = (
        first.context("no start seen")?,
        last.context("no end seen")?,
    );
    let span = last.duration_since(first).as_secs_f64();
    assert!(
        !steady.is_empty() && bytes_read > 0,
        "nothing measured in steady state"
    );
    steady.sort_unstable();
    all.sort_unstable();
    let percent = |bytes: i64| 100.0 * bytes as f64 / CAP as f64;
    println!(
        "cap {} B/s; steady sums of reported rates: {} samples, min {:.1}%, median {:.1}%, \
         max {:.1}% of the cap; all sums with >= 2 running: {} samples, median {:.1}%, \
         max {:.1}%; whole backup: {} B read in {:.1} s from first start to last \
         completion = {:.1}% of the cap",
        CAP,
        steady.len(),
        percent(steady[0]),
        percent(steady[steady.len() / 2]),
        percent(steady[steady.len() - 1]),
        all.len(),
        percent(all[all.len() / 2]),
        percent(all[all.len() - 1]),
        bytes_read,
        span,
        100.0 * bytes_read as f64 / span / CAP as f64,
    );
    fixture.stop().await;
    Ok(())
}

/// The medians and maximum of `values` (sorted in place), for a printout.
fn spread(values: &mut [f64]) -> String {
    if values.is_empty() {
        return "none".to_string();
    }
    values.sort_by(f64::total_cmp);
    format!(
        "min {:.1} / median {:.1} / max {:.1}",
        values[0],
        values[values.len() / 2],
        values[values.len() - 1]
    )
}

/// The API requests of a VolumeBackup of 100 claims, counted from the
/// apiserver's audit log (level Metadata, every request): the controller's
/// by verb and resource (before the backup: its start; during the backup:
/// per claim), its lists and watches, the agents' requests and status
/// writes per transfer and per minute of transfer time, and the agents'
/// peak resident memory sampled by the kubelet stand-in. 100 claims of
/// 1 MiB of sample data in 4 namespaces on 5 nodes (20 stage pods), under a
/// StoragePolicy of 2 MiB/s so that transfers last long enough for the
/// progress writes to show their rate. Prints the figures; asserts only
/// that the backup completed. Run with
/// `cargo build -p mover-agent && cargo test --test integration
/// measure_api_requests_and_status_writes -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~1.5 min), not a check"]
async fn measure_api_requests_and_status_writes_of_a_100_claim_backup() -> anyhow::Result<()> {
    use crate::support::audit::{self, count_by_verb_and_resource, table};
    const CLAIMS: usize = 100;
    const NAMESPACES: usize = 4;
    const NODES: usize = 5;
    const VOLUME_BYTES: u64 = 1 << 20;
    const CAP: i64 = 2 << 20;
    let fixture =
        Fixture::start_many(Layout::many(CLAIMS, NAMESPACES, NODES), true, VOLUME_BYTES).await?;
    let client = &fixture.client;
    create::<haulage::api::StoragePolicy>(
        client,
        None,
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "StoragePolicy",
            "metadata": {"name": "two-mebibytes"},
            "spec": {"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": CAP}}),
    )
    .await?;
    let namespaces: Vec<String> = (0..NAMESPACES).map(|n| format!("team-{n}")).collect();
    let created = k8s_openapi::jiff::Timestamp::now();
    create::<VolumeBackup>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
            "metadata": {"name": "hundred", "namespace": SYSTEM_NAMESPACE},
            "spec": {"namespaces": namespaces,
                "selector": {"matchLabels": {"backup": "yes"}}}}),
    )
    .await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(
        &backups,
        &fixture.kubelet,
        "hundred",
        Duration::from_secs(900),
    )
    .await?;
    let completed = k8s_openapi::jiff::Timestamp::now();
    let status = backup.status.context("status")?;
    assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
    let backup_seconds = completed.duration_since(created).as_secs_f64();
    // The release (stage pods, Roles, bindings, credentials copies) comes
    // after the final status: it is part of the backup's requests.
    eventually(Duration::from_secs(120), || async {
        Ok((leftovers(client).await? == (0, 0)).then_some(()))
    })
    .await
    .context("stage pods or credentials copies left behind")?;
    let finished = k8s_openapi::jiff::Timestamp::now();

    let transfers: Vec<VolumeTransfer> = Api::<VolumeTransfer>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    assert_eq!(transfers.len(), CLAIMS);
    let mut transfer_seconds = Vec::new();
    for transfer in &transfers {
        let status = transfer.status.as_ref().context("transfer status")?;
        let start = status.start_time.as_ref().context("startTime")?.0;
        let end = status.completion_time.as_ref().context("completionTime")?.0;
        transfer_seconds.push(end.duration_since(start).as_secs_f64());
    }
    let transfer_minutes: f64 = transfer_seconds.iter().sum::<f64>() / 60.0;

    let requests = fixture.cluster.audit_requests()?;
    let controller = audit::service_account(SYSTEM_NAMESPACE, "haulage-controller");
    let is_agent =
        |user: &str| user.starts_with("system:serviceaccount:") && user.ends_with(":haulage-agent");
    let controller_requests: Vec<&audit::Request> =
        requests.iter().filter(|r| r.user == controller).collect();
    let (before, during): (Vec<&audit::Request>, Vec<&audit::Request>) = controller_requests
        .iter()
        .filter(|r| r.received <= finished)
        .partition(|r| r.received < created);
    let agent_requests: Vec<&audit::Request> =
        requests.iter().filter(|r| is_agent(&r.user)).collect();
    let status_writes = agent_requests
        .iter()
        .filter(|r| {
            (r.verb == "patch" || r.verb == "update") && r.resource == "volumetransfers/status"
        })
        .count();
    let controller_relists = controller_requests
        .iter()
        .filter(|r| r.verb == "list")
        .count();

    println!(
        "\n{CLAIMS} claims of {VOLUME_BYTES} B in {NAMESPACES} namespaces on {NODES} nodes, \
         StoragePolicy {CAP} B/s; backup Completed {backup_seconds:.1} s after it was created; \
         {} stage pods; transfer time {}  s",
        status.plan.as_ref().map_or(0, |plan| plan.stage_pods.len()),
        spread(&mut transfer_seconds.clone()),
    );
    println!(
        "\ncontroller ({controller}), from its start to the backup's creation \
         ({} requests):\n{}",
        before.len(),
        table(
            &count_by_verb_and_resource(before.iter().copied()),
            1,
            "start"
        )
    );
    println!(
        "controller from the backup's creation until its stage pods and copies were gone \
         ({:.1} s, {} requests):\n{}",
        finished.duration_since(created).as_secs_f64(),
        during.len(),
        table(
            &count_by_verb_and_resource(during.iter().copied()),
            CLAIMS,
            "claim"
        )
    );
    println!(
        "controller list calls over the whole run: {controller_relists}; watches: {}",
        controller_requests
            .iter()
            .filter(|r| r.verb == "watch")
            .count()
    );
    let controller_start = controller_requests
        .first()
        .map(|r| r.received)
        .context("no controller request")?;
    for request in controller_requests
        .iter()
        .filter(|r| r.verb == "list" || r.verb == "watch")
    {
        println!(
            "  {:>6.1} s after the controller's first request: {} {} ({:?})",
            request
                .received
                .duration_since(controller_start)
                .as_secs_f64(),
            request.verb,
            request.resource,
            request.code
        );
    }
    println!(
        "\nagents ({} service accounts, {} requests):\n{}",
        agent_requests
            .iter()
            .map(|r| r.user.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        agent_requests.len(),
        table(
            &count_by_verb_and_resource(agent_requests.iter().copied()),
            CLAIMS,
            "transfer"
        )
    );
    println!(
        "agent status writes: {status_writes} = {:.2} per transfer; transfer time {:.1} min \
         in all = {:.1} status writes per transfer per minute of transfer time",
        status_writes as f64 / CLAIMS as f64,
        transfer_minutes,
        status_writes as f64 / transfer_minutes,
    );
    // Who writes a transfer's status how often: the agent (claim,
    // progress, completion) and the controller (admission, queue position).
    for (who, filter) in [
        (
            "controller",
            &(|user: &str| user == controller) as &dyn Fn(&str) -> bool,
        ),
        ("agents", &is_agent),
    ] {
        let mut per_transfer: std::collections::BTreeMap<&str, f64> = transfers
            .iter()
            .filter_map(|transfer| transfer.metadata.name.as_deref())
            .map(|name| (name, 0.0))
            .collect();
        for request in &requests {
            if filter(&request.user)
                && request.verb == "patch"
                && request.resource == "volumetransfers/status"
                && let Some(count) = request
                    .name
                    .as_deref()
                    .and_then(|name| per_transfer.get_mut(name))
            {
                *count += 1.0;
            }
        }
        let mut counts: Vec<f64> = per_transfer.into_values().collect();
        println!(
            "volumetransfers/status patches by the {who} per transfer: {}",
            spread(&mut counts)
        );
    }
    let backup_writes = during
        .iter()
        .filter(|r| {
            r.verb == "patch" && r.resource == "volumebackups/status" && r.received <= completed
        })
        .count();
    println!(
        "volumebackups/status patches by the controller: {backup_writes} in {backup_seconds:.1} s \
         = {:.2} per second",
        backup_writes as f64 / backup_seconds
    );
    let peaks = fixture.kubelet.agent_peak_memory();
    let mut mebibytes: Vec<f64> = peaks
        .values()
        .map(|bytes| *bytes as f64 / f64::from(1 << 20))
        .collect();
    println!(
        "agent peak RSS (VmHWM sampled every 100 ms) over {} agents: {} MiB",
        mebibytes.len(),
        spread(&mut mebibytes)
    );
    fixture.stop().await;
    Ok(())
}

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
/// `cargo test --test integration measure_agent_memory -- --ignored --nocapture`.
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
        tls: false,
    };
    let fixture = Fixture::start_many(layout, false, VOLUME_BYTES).await?;
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
            final_backup(&backups, &fixture.kubelet, name, Duration::from_secs(900)).await?;
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
/// `cargo test --test integration measure_controller_memory -- --ignored --nocapture`.
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
    cluster
        .kubectl_ok(&["apply", "-k", &manifests().to_string_lossy()], None)
        .await?;
    cluster
        .kubectl_ok(
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/volumebackups.haulage.dev",
                "crd/volumetransfers.haulage.dev",
                "crd/backupstoragelocations.haulage.dev",
            ],
            None,
        )
        .await?;
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
        let mut controller = tokio::process::Command::new(&binary)
            .args([
                "controller",
                "--health-address",
                &format!("127.0.0.1:{port}"),
            ])
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAME", "controller-memory")
            .env("POD_NAMESPACE", SYSTEM_NAMESPACE)
            .env("HAULAGE_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log_path)?)
            .kill_on_drop(true)
            .spawn()?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_never_both_hold_the_admission_lease_and_a_dead_holders_lease_is_taken_over()
-> anyhow::Result<()> {
    use haulage::controller::lease::{self, LEASE_DURATION_SECONDS, Leadership};
    let cluster = KubeCluster::start().await?;
    let client = cluster.client().await?;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "default");
    let replica = |identity: &str| {
        let leadership = Arc::new(Leadership::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(lease::run(
            leases.clone(),
            identity.to_string(),
            leadership.clone(),
            shutdown.clone(),
        ));
        (leadership, shutdown, task)
    };
    let (a, a_shutdown, a_task) = replica("replica-a");
    let (b, b_shutdown, b_task) = replica("replica-b");
    // Sampled every 20 ms: never both leaders.
    let sample = |a: &Leadership, b: &Leadership| {
        let led = (a.is_leader(), b.is_leader());
        assert!(!(led.0 && led.1), "both replicas admit at once");
        led
    };
    let start = Instant::now();
    let mut leader = None;
    while start.elapsed() < Duration::from_secs(6) {
        match sample(&a, &b) {
            (true, _) => leader = leader.or(Some('a')),
            (_, true) => leader = leader.or(Some('b')),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leader = leader.context("no replica took the admission lease")?;
    let (holder, holder_task, other, other_shutdown, other_task) = match leader {
        'a' => (a, a_task, b, b_shutdown, b_task),
        _ => (b, b_task, a, a_shutdown, a_task),
    };
    // The holder dies without releasing (its task is aborted): its own
    // deadline passes before the other may take over, after the lease's
    // duration of standing still.
    holder_task.abort();
    let died = Instant::now();
    loop {
        let (_, other_led) = sample(&holder, &other);
        if other_led {
            break;
        }
        if died.elapsed() > Duration::from_secs(LEASE_DURATION_SECONDS + 15) {
            bail!("the other replica never took over the dead holder's lease");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = died.elapsed();
    assert!(
        took >= Duration::from_secs(LEASE_DURATION_SECONDS - 2),
        "taken over after {took:?}, before the lease could expire"
    );
    let lease = leases.get(lease::ADMISSION_LEASE).await?;
    let spec = lease.spec.context("lease spec")?;
    assert_ne!(spec.holder_identity, None);
    assert_eq!(spec.lease_transitions, Some(1));

    // A replica that stops releases the lease (holder cleared).
    other_shutdown.cancel();
    other_task.await?;
    let released = leases.get(lease::ADMISSION_LEASE).await?;
    assert_eq!(
        released.spec.and_then(|spec| spec.holder_identity),
        None,
        "the stopping holder did not release the lease"
    );
    drop(cluster);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_to_a_location_behind_a_private_ca_completes() -> anyhow::Result<()> {
    // MinIO serves HTTPS with a certificate from a throwaway CA that only
    // the BSL's caBundle carries: the probe and every agent must trust it.
    let fixture = Fixture::start_tls(1 << 20).await?;
    let client = &fixture.client;
    assert!(fixture.minio.endpoint().starts_with("https://"));
    create_backup_of(
        client,
        "private-ca",
        json!({"matchLabels": {"claim": "db"}}),
    )
    .await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "private-ca", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{:?}\n{}",
        status.results,
        fixture.kubelet.all_agent_logs()
    );
    assert!(status.results[0].snapshot_id.is_some());
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_agent_is_noticed_by_its_silence_and_its_stage_pod_is_recreated()
-> anyhow::Result<()> {
    // 12 MiB at 1 MiB/s, so the transfer is running when its agent hangs.
    let fixture = Fixture::start(Some(1 << 20), 12 << 20, true).await?;
    let client = fixture.client.clone();
    // The fixture's controller stops cleanly (releasing its leases); this
    // one counts an agent silent for 10 s as lost (the default is 300 s).
    fixture.shutdown.cancel();
    eventually(Duration::from_secs(30), || async {
        Ok(fixture.controller.is_finished().then_some(()))
    })
    .await
    .context("the fixture's controller did not stop")?;
    let (shutdown, controller) = fixture
        .spawn_controller(haulage::controller::Config {
            agent_lost_seconds: haulage::controller::MIN_AGENT_LOST_SECONDS,
            ..Fixture::controller_config("controller-watchful")?
        })
        .await?;

    create_backup_of(
        &client,
        "hung",
        json!({"matchLabels": {"claim": "archive"}}),
    )
    .await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let (namespace, pod) = eventually(Duration::from_secs(120), || async {
        let running = transfers
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|transfer| {
                transfer.spec.pvc == "archive"
                    && transfer.status.as_ref().and_then(|status| status.phase)
                        == Some(VolumeTransferPhase::InProgress)
            });
        Ok(running.map(|transfer| {
            (
                transfer.metadata.namespace.clone().unwrap_or_default(),
                transfer.spec.stage_pod.clone(),
            )
        }))
    })
    .await
    .context("the transfer never started")?;
    assert!(
        fixture.kubelet.freeze(&namespace, &pod).await,
        "no agent process to freeze"
    );

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_backup(&backups, &fixture.kubelet, "hung", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{:?}",
        status.results
    );
    let transfer = transfers
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|transfer| transfer.spec.pvc == "archive")
        .context("transfer")?;
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let notes: Vec<String> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|event| Some(format!("{:?} {:?}", event.reason?, event.note)))
        .collect();
    // Exactly one replacement: the new pod's agent is judged from when its
    // container started, not from the pod's creation (the old frozen
    // process takes its grace period to stop before the new one starts).
    let attempts = transfer.status.and_then(|status| status.attempts);
    assert_eq!(
        attempts,
        Some(1),
        "attempts {attempts:?}: {notes:#?}\n{}",
        fixture.kubelet.all_agent_logs()
    );
    let recreated = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|event| {
            event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("hung")
                && event.reason.as_deref() == Some("StagePodRecreated")
        })
        .filter_map(|event| event.note)
        .collect::<Vec<_>>();
    assert!(
        recreated
            .iter()
            .any(|note| note.contains("has not reported")),
        "{recreated:?}"
    );
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), controller).await;
    fixture.stop().await;
    Ok(())
}
