//! The controller's end-to-end fixture: a real kube-apiserver with the
//! manifests applied, MinIO with an initialised repository, claims with data
//! on nodes run by the kubelet stand-in, an Available BSL and the controller
//! running in-process with its own ServiceAccount's token; and the helpers
//! the controller's tests share (creating objects, waiting for a backup,
//! what is left behind).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use haulage::api::backup::{VolumeBackupPhase, VolumeBackupStatus};
use haulage::api::labels::{CREDENTIALS_COPY_LABEL, SYSTEM_NAMESPACE};
use haulage::api::restore::{VolumeRestorePhase, VolumeRestoreStatus};
use haulage::api::{
    BackupStorageLocation, BackupStorageLocationPhase, VolumeBackup, VolumeRestore, VolumeTransfer,
    VolumeTransferPhase,
};
use haulage::engine::Repository;
use haulage::store::open_store;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::object::HasStatus;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::engine::support::random_bytes;
use crate::support::health::http_status;
use crate::support::kube::KubeCluster;
use crate::support::kubelet::Kubelet;
use crate::support::minio::{ACCESS_KEY, MinioServer, REGION, SECRET_KEY};
use crate::support::provisioner::Provisioner;
use crate::support::proxy::FaultProxy;

pub const BUCKET: &str = "haulage-e2e";
/// The StorageClass of every fixture claim, and its provisioner.
pub const STORAGE_CLASS: &str = "haulage-test";
pub const PROVISIONER: &str = "test.csi.haulage.dev";
pub const PREFIX: &str = "cluster-a";
/// Generous: two cores shared with other builds, debug binaries.
pub const BACKUP_DEADLINE: Duration = Duration::from_secs(240);

pub async fn create<K>(
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

/// A bound claim of the fixture's class with its volume (1Gi); `mode` is
/// the access mode.
pub async fn bound_claim(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    mode: &str,
) -> anyhow::Result<()> {
    BoundClaim {
        namespace,
        name,
        mode,
        class: STORAGE_CLASS,
        provisioner: PROVISIONER,
        size: "1Gi",
        metadata: json!({"labels": {"backup": "yes", "claim": name}}),
    }
    .create(client)
    .await
}

/// A claim bound to a PersistentVolume of its own (`pv-NAMESPACE-NAME`,
/// reclaim policy Retain), with the status a bound claim has.
pub struct BoundClaim<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    /// The access mode of the claim and its volume.
    pub mode: &'a str,
    pub class: &'a str,
    /// The CSI driver of the volume.
    pub provisioner: &'a str,
    /// The claim's request and the volume's capacity (`1Gi`).
    pub size: &'a str,
    /// The claim's labels and annotations: `{"labels": {..}, "annotations": {..}}`.
    pub metadata: serde_json::Value,
}

impl BoundClaim<'_> {
    /// Create the volume and the claim, and mark the claim Bound.
    pub async fn create(&self, client: &kube::Client) -> anyhow::Result<()> {
        let BoundClaim {
            namespace,
            name,
            mode,
            class,
            provisioner,
            size,
            ..
        } = *self;
        let volume = format!("pv-{namespace}-{name}");
        create::<PersistentVolume>(
            client,
            None,
            json!({"apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {"capacity": {"storage": size}, "accessModes": [mode],
                    "persistentVolumeReclaimPolicy": "Retain", "storageClassName": class,
                    "csi": {"driver": provisioner, "volumeHandle": volume},
                    "claimRef": {"namespace": namespace, "name": name}}}),
        )
        .await?;
        let mut metadata = self.metadata.clone();
        metadata["name"] = json!(name);
        metadata["namespace"] = json!(namespace);
        create::<PersistentVolumeClaim>(
            client,
            Some(namespace),
            json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": metadata,
                "spec": {"accessModes": [mode], "volumeName": volume,
                    "storageClassName": class,
                    "resources": {"requests": {"storage": size}}}}),
        )
        .await?;
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace)
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Bound", "accessModes": [mode],
                    "capacity": {"storage": size}}})),
            )
            .await?;
        Ok(())
    }
}

/// A running application pod on `node` mounting `claim`.
pub async fn app_pod(
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

pub async fn client_from(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// `binary` (a `haulage` build) running `haulage controller` as the
/// Deployment runs it: with `kubeconfig`, as pod `pod_name` of the
/// controller's namespace, health and metrics on 127.0.0.1:`port`, its log
/// (at `info`) in `log`, and the environment variables `env` besides
/// (its settings, e.g. `HAULAGE_REPLICA_LEASE_SECONDS`); killed when
/// dropped.
pub fn controller_process(
    binary: &Path,
    kubeconfig: &Path,
    pod_name: &str,
    port: u16,
    log: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<tokio::process::Child> {
    Ok(tokio::process::Command::new(binary)
        .args([
            "controller",
            "--health-address",
            &format!("127.0.0.1:{port}"),
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAME", pod_name)
        .env("POD_NAMESPACE", SYSTEM_NAMESPACE)
        .env("HAULAGE_LOG", "info")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .kill_on_drop(true)
        .spawn()?)
}

/// Poll `check` until it returns `Some`, failing with `describe` after the
/// deadline.
pub async fn eventually<T, F, Fut>(deadline: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let start = Instant::now();
    // An error of one look (the API server slow to answer under load) is
    // not the answer: look again until the deadline, then say what the
    // last look saw.
    loop {
        let last_error = match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(error) => Some(error),
        };
        if start.elapsed() > deadline {
            match last_error {
                Some(error) => {
                    bail!("not reached within {deadline:?}; the last look failed: {error:#}")
                }
                None => bail!("not reached within {deadline:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The namespaces, claims, nodes and application pods of a [`Fixture`]
/// ([`FixtureBuilder::layout`]).
#[derive(Clone)]
pub struct Layout {
    pub namespaces: Vec<String>,
    /// (namespace, name, access mode, seed of its data).
    pub claims: Vec<(String, String, &'static str, u64)>,
    pub nodes: Vec<String>,
    /// Running pods mounting claims: (namespace, pod, node, claim).
    pub app_pods: Vec<(String, String, String, String)>,
}

impl Layout {
    /// Two namespaces, five claims, three nodes, three application pods
    /// (one claim mounted on node-a, an RWX one on node-b and node-c).
    pub fn five_claims() -> Self {
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
        }
    }

    /// One unmounted RWO claim `solo/data` (its data seeded with `seed`)
    /// on one node `node-0`.
    pub fn solo(seed: u64) -> Self {
        Layout {
            namespaces: vec!["solo".to_string()],
            claims: vec![(
                "solo".to_string(),
                "data".to_string(),
                "ReadWriteOnce",
                seed,
            )],
            nodes: vec!["node-0".to_string()],
            app_pods: Vec::new(),
        }
    }

    /// `claims` unmounted RWO claims `data-NNN`, dealt round-robin over
    /// `namespaces` namespaces `team-N`, and `nodes` nodes `node-N` for
    /// the planner to spread them over.
    pub fn many(claims: usize, namespaces: usize, nodes: usize) -> Self {
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
        }
    }
}

/// A cluster with the manifests applied, MinIO with an initialised
/// repository, claims with data on nodes run by the kubelet stand-in (the
/// [`Layout`]: five claims on three nodes unless said otherwise), an
/// Available BSL `minio` (the default one) and the controller running.
/// Made by [`Fixture::builder`].
pub struct Fixture {
    /// The kube-apiserver and etcd.
    pub cluster: KubeCluster,
    /// The S3 server the BSL `minio` points at.
    pub minio: MinioServer,
    /// The fault proxy the BSL points at, with
    /// [`FixtureBuilder::through_fault_proxy`].
    pub proxy: Option<FaultProxy>,
    /// The fault proxy between the controller and agents and the API
    /// server (a TCP proxy: TLS passes through), with
    /// [`FixtureBuilder::api_server_through_fault_proxy`].
    pub api_proxy: Option<FaultProxy>,
    /// The admin client (`system:masters`) the test acts with.
    pub client: kube::Client,
    /// The kubelet stand-in running the stage pods' agents on the nodes.
    pub kubelet: Kubelet,
    /// The provisioner stand-in binding new claims of the fixture's class
    /// to volumes and directories, when asked for
    /// ([`FixtureBuilder::provisioning`]).
    pub provisioner: Option<Provisioner>,
    /// Scratch directory of the test: claims' data, kubeconfigs, restores.
    pub work: tempfile::TempDir,
    /// The claims' data: `volumes/<namespace>/<claim>`.
    pub volumes: PathBuf,
    /// The repository behind the BSL `minio` (`s3://haulage-e2e/cluster-a`).
    pub store: haulage::store::DynStore,
    /// Cancels the in-process controller `controller-0`.
    pub shutdown: CancellationToken,
    /// The in-process controller `controller-0`.
    pub controller: tokio::task::JoinHandle<Result<(), haulage::controller::RunError>>,
    /// Where the in-process controller serves `/healthz`, `/readyz` and
    /// `/metrics`.
    pub health_address: std::net::SocketAddr,
}

/// The options of a [`Fixture`]; each one has the default most tests use,
/// so a test names only what it needs:
///
/// ```ignore
/// let fixture = Fixture::builder()
///     .volume_bytes(4 << 20)
///     .provisioning()
///     .start()
///     .await?;
/// ```
pub struct FixtureBuilder {
    layout: Layout,
    volume_bytes: u64,
    /// The pack size of a repository of random data, if so.
    random_data_pack_bytes: Option<u32>,
    upload_bytes_per_second: Option<u64>,
    secret_key: String,
    objects: Vec<serde_json::Value>,
    tls: bool,
    audited: bool,
    provisioning: bool,
    fault_proxy: bool,
    api_fault_proxy: bool,
    max_volumes_per_node: Option<u32>,
    checkpoint_seconds: Option<u32>,
    agent_lost_seconds: Option<u32>,
}

impl FixtureBuilder {
    /// The controller's `--agent-lost-seconds`. Default: its default, 300.
    pub fn agent_lost_seconds(mut self, seconds: u32) -> Self {
        self.agent_lost_seconds = Some(seconds);
        self
    }

    /// The controller's `--checkpoint-seconds`. Default: the agent's, 60.
    pub fn checkpoint_seconds(mut self, seconds: u32) -> Self {
        self.checkpoint_seconds = Some(seconds);
        self
    }

    /// The controller's `--max-volumes-per-node` (`None`: no cap).
    /// Default: the controller's default, 2.
    pub fn max_volumes_per_node(mut self, volumes: Option<u32>) -> Self {
        self.max_volumes_per_node = volumes;
        self
    }

    /// The namespaces, claims, nodes and application pods to create.
    /// Default: [`Layout::five_claims`].
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The bytes of data in each claim: a sample tree
    /// (`haulage::sample::generate`, seeded per claim), or random files
    /// with [`random_data_in_small_packs`](Self::random_data_in_small_packs).
    /// Default: 1 MiB.
    pub fn volume_bytes(mut self, bytes: u64) -> Self {
        self.volume_bytes = bytes;
        self
    }

    /// Each claim holds four files of incompressible random data (a quarter
    /// of [`volume_bytes`](Self::volume_bytes) each) instead of a sample
    /// tree, and the repository is initialised with 1 MiB packs, so a
    /// transfer stores several packs and can be interrupted between two.
    /// Default: a sample tree, the repository's default pack size.
    pub fn random_data_in_small_packs(self) -> Self {
        self.random_data_in_packs_of(1 << 20)
    }

    /// [`random_data_in_small_packs`](Self::random_data_in_small_packs),
    /// with packs of `bytes` (above the S3 store's 64 MiB multipart
    /// threshold, each pack is a multipart upload).
    pub fn random_data_in_packs_of(mut self, bytes: u32) -> Self {
        self.random_data_pack_bytes = Some(bytes);
        self
    }

    /// Transfers that run long enough (about 12 s each) to be interrupted,
    /// hung or scraped while they run: 12 MiB of
    /// [random data in 1 MiB packs](Self::random_data_in_small_packs) per
    /// claim, uploaded at 1 MiB/s.
    pub fn long_running_transfers(self) -> Self {
        self.upload_bytes_per_second(1 << 20)
            .volume_bytes(12 << 20)
            .random_data_in_small_packs()
    }

    /// The BSL's `uploadBytesPerSecond`, the upload cap of each agent: slow
    /// transfers, to interrupt or scrape them while they run. Default: no
    /// cap.
    pub fn upload_bytes_per_second(mut self, bytes_per_second: u64) -> Self {
        self.upload_bytes_per_second = Some(bytes_per_second);
        self
    }

    /// The secret access key in the BSL's credentials Secret
    /// (`s3-credentials`). With a key other than MinIO's the BSL turns
    /// Unavailable, and [`start`](Self::start) does not wait for it to be
    /// Available. Default: MinIO's key.
    pub fn secret_key(mut self, secret_key: &str) -> Self {
        self.secret_key = secret_key.to_string();
        self
    }

    /// One more object (a BSL, a Secret) applied with kubectl in the
    /// controller's namespace after the fixture's BSL and before the
    /// controller starts; may be given several times. Default: none.
    pub fn object(mut self, object: serde_json::Value) -> Self {
        self.objects.push(object);
        self
    }

    /// MinIO serves HTTPS with a certificate of a throwaway CA that only the
    /// BSL's `caBundle` carries. Default: plain HTTP.
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// New claims of the fixture's StorageClass (those a VolumeRestore
    /// creates) are given a directory under `volumes/<namespace>/<claim>`
    /// and a bound volume by the provisioner stand-in
    /// ([`crate::support::provisioner`]). Default: nothing binds them.
    pub fn provisioning(mut self) -> Self {
        self.provisioning = true;
        self
    }

    /// The BSL's endpoint is a [`FaultProxy`] in front of MinIO
    /// ([`Fixture::proxy`]), so the controller's probes and the agents'
    /// requests go through it and a test can take the location away.
    /// Default: the BSL points at MinIO.
    pub fn through_fault_proxy(mut self) -> Self {
        self.fault_proxy = true;
        self
    }

    /// The controller and the agents reach the API server through a
    /// [`FaultProxy`] ([`Fixture::api_proxy`], started with
    /// [`FaultProxy::start_opaque`]), so a test can cut them off it and
    /// count their connection attempts meanwhile; the test's own clients
    /// and the stand-ins go direct. Default: everything goes direct.
    pub fn api_server_through_fault_proxy(mut self) -> Self {
        self.api_fault_proxy = true;
        self
    }

    /// The API server writes an audit log of every request
    /// ([`KubeCluster::start_audited`]), read with
    /// [`KubeCluster::audit_requests`]. Default: no audit log.
    pub fn audited(mut self) -> Self {
        self.audited = true;
        self
    }

    /// Start everything, in this order: cluster and MinIO, the manifests,
    /// the repository, the StorageClass, namespaces, claims and their data,
    /// the kubelet stand-in, application pods, the BSL `minio` with its
    /// Secret, the extra [`object`](Self::object)s, and the controller
    /// `controller-0`; then wait for the BSL to be Available (unless its
    /// [`secret_key`](Self::secret_key) is a wrong one).
    pub async fn start(self) -> anyhow::Result<Fixture> {
        let FixtureBuilder {
            layout,
            volume_bytes,
            random_data_pack_bytes,
            upload_bytes_per_second,
            secret_key,
            objects: extra_objects,
            tls,
            audited,
            provisioning,
            fault_proxy,
            api_fault_proxy,
            max_volumes_per_node,
            checkpoint_seconds,
            agent_lost_seconds,
        } = self;
        let mut cluster = if audited {
            KubeCluster::start_audited().await?
        } else {
            KubeCluster::start().await?
        };
        let api_proxy = match api_fault_proxy {
            true => {
                let proxy = FaultProxy::start_opaque(cluster.apiserver_address()?).await?;
                cluster.route_processes_through(proxy.address())?;
                Some(proxy)
            }
            false => None,
        };
        let minio = if tls {
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
        cluster.install_manifests().await?;

        // The repository, initialised as a user would with `haulage repo init`.
        let repository_url = format!("s3://{BUCKET}/{PREFIX}");
        let mut store_options = minio.store_options();
        store_options.s3.ca_bundle = minio.ca_bundle().map(Path::to_path_buf);
        let store = open_store(&repository_url, &store_options).await?;
        if let Some(pack_bytes) = random_data_pack_bytes {
            let mut config = haulage::repo::config::RepoConfig::generate(&mut rand::rng());
            config.pack_target_bytes = pack_bytes;
            store
                .put(
                    haulage::repo::CONFIG_KEY,
                    config.to_json().into(),
                    haulage::store::PutMode::Create,
                )
                .await?;
        } else {
            Repository::init(store.clone(), haulage::engine::Encryption::None).await?;
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
            if random_data_pack_bytes.is_some() {
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
            cluster.processes_kubeconfig(),
            &nodes,
            &volumes,
            &work.path().join("kubelet"),
        )
        .await?;
        for (namespace, pod, node, claim) in &layout.app_pods {
            app_pod(&client, namespace, pod, node, claim).await?;
        }
        let provisioner = provisioning
            .then(|| Provisioner::start(client.clone(), &volumes, STORAGE_CLASS, PROVISIONER));

        // The BSL, pointing at MinIO (or the proxy), with its credentials Secret.
        let proxy = match fault_proxy {
            true => Some(FaultProxy::start(([127, 0, 0, 1], minio.port()).into()).await?),
            false => None,
        };
        create_credentials_secret(&client, &secret_key).await?;
        let mut settings = json!({"caBundle": ca_bundle, "validationFrequency": "10s",
            "uploadBytesPerSecond": upload_bytes_per_second});
        if let Some(proxy) = &proxy {
            settings["endpoint"] = json!(proxy.endpoint());
        }
        create_minio_location(&client, &minio, BUCKET, PREFIX, settings).await?;
        if !extra_objects.is_empty() {
            let list = json!({"apiVersion": "v1", "kind": "List", "items": extra_objects});
            cluster
                .kubectl_ok(
                    &["apply", "-n", SYSTEM_NAMESPACE, "-f", "-"],
                    Some(&list.to_string()),
                )
                .await?;
        }

        let InProcessController {
            shutdown,
            controller,
            health_address,
        } = start_controller_with(
            &cluster,
            work.path(),
            haulage::controller::Config {
                max_volumes_per_node,
                checkpoint_seconds,
                agent_lost_seconds: agent_lost_seconds
                    .unwrap_or(haulage::reconcile::supervision::DEFAULT_AGENT_LOST_SECONDS),
                ..Fixture::controller_config("controller-0")?
            },
        )
        .await?;

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
            proxy,
            api_proxy,
            client,
            kubelet,
            provisioner,
            work,
            volumes,
            store,
            shutdown,
            controller,
            health_address,
        })
    }
}

/// A controller running in the test's process.
pub struct InProcessController {
    /// Cancel it to stop the controller.
    pub shutdown: CancellationToken,
    pub controller: tokio::task::JoinHandle<Result<(), haulage::controller::RunError>>,
    /// Where its health endpoints listen.
    pub health_address: std::net::SocketAddr,
}

/// Start the controller `identity` ([`Fixture::controller_config`]) in
/// this process against `cluster`, with the token of its own
/// ServiceAccount (the kubeconfig written under `work`) and its health
/// endpoints on a free port.
pub async fn start_controller(
    cluster: &KubeCluster,
    work: &Path,
    identity: &str,
) -> anyhow::Result<InProcessController> {
    start_controller_with(cluster, work, Fixture::controller_config(identity)?).await
}

/// [`start_controller`] with `config` (its health address replaced by a
/// free port).
pub async fn start_controller_with(
    cluster: &KubeCluster,
    work: &Path,
    config: haulage::controller::Config,
) -> anyhow::Result<InProcessController> {
    let identity = config.identity.clone();
    let kubeconfig = cluster
        .service_account_kubeconfig(
            SYSTEM_NAMESPACE,
            "haulage-controller",
            &work.join(format!("{identity}.kubeconfig")),
        )
        .await?;
    let client = client_from(&kubeconfig).await?;
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let health_address = health.local_addr()?;
    let config = haulage::controller::Config {
        health_address,
        ..config
    };
    let shutdown = CancellationToken::new();
    crate::support::logs::capture();
    let controller = tokio::spawn(haulage::controller::run_with_listener(
        config,
        client,
        health,
        shutdown.clone(),
    ));
    Ok(InProcessController {
        shutdown,
        controller,
        health_address,
    })
}

impl Fixture {
    /// The fixture's repository (plaintext), opened in this process.
    pub async fn repository(&self) -> anyhow::Result<haulage::engine::Repository> {
        Ok(haulage::engine::Repository::open(
            self.store.clone(),
            &haulage::engine::KeySource::PlaintextOnly,
        )
        .await?)
    }

    /// Write index files naming `blobs` blobs (random ids, 10,000 a pack)
    /// of packs never stored, as a backup writes them: a repository whose
    /// index is that large, without the hours of storing its data. No
    /// backup finds a chunk among them. Returns the bytes of all the
    /// repository's index files after.
    pub async fn write_index_of_unstored_blobs(&self, blobs: u32) -> anyhow::Result<u64> {
        let repository = self.repository().await?;
        let mut random = fastrand::Rng::with_seed(u64::from(blobs));
        let mut id = move || {
            let mut id = [0u8; 32];
            random.fill(&mut id);
            id
        };
        let mut packs = Vec::new();
        let mut left = blobs;
        while left > 0 {
            let count = left.min(10_000);
            left -= count;
            let entries = (0..count)
                .map(|blob| haulage::repo::pack::PackEntry {
                    id: haulage::repo::BlobId(id()),
                    kind: haulage::repo::BlobKind::Data,
                    compression: haulage::repo::Compression::Zstd,
                    offset: blob * 4_000,
                    stored_length: 3_000 + blob % 1_000,
                    raw_length: 4_000,
                })
                .collect();
            packs.push((haulage::repo::ObjectId(id()), entries));
        }
        repository.write_index(packs).await?;
        Ok(repository.index_file_bytes().await?)
    }

    /// Wait until the location's probe has counted at least `bytes` of
    /// index files (`status.indexBytes`); what it counted.
    pub async fn location_index_bytes_at_least(&self, bytes: u64) -> anyhow::Result<u64> {
        let locations: Api<BackupStorageLocation> =
            Api::namespaced(self.client.clone(), SYSTEM_NAMESPACE);
        eventually(Duration::from_secs(60), || async {
            Ok(locations
                .get("minio")
                .await?
                .status
                .and_then(|status| status.index_bytes)
                .map(|counted| u64::try_from(counted).unwrap_or(0))
                .filter(|counted| *counted >= bytes))
        })
        .await
        .with_context(|| format!("the location's probe never counted {bytes} bytes of index files"))
    }

    /// Pack objects in the fixture's repository, listed from MinIO behind
    /// the controller's back (a pack exists only once fully uploaded).
    pub async fn packs_stored(&self) -> anyhow::Result<usize> {
        let listed = self
            .minio
            .admin_client()
            .list_objects_v2()
            .bucket(BUCKET)
            .prefix(format!("{PREFIX}/{}", haulage::repo::DATA_PREFIX))
            .send()
            .await?;
        Ok(listed.contents().len())
    }

    /// Wait up to two minutes for `packs` packs to be stored
    /// ([`Self::packs_stored`]): a transfer under way, well before its
    /// snapshot; a timeout gives every agent's log.
    pub async fn packs_stored_at_least(&self, packs: usize) -> anyhow::Result<()> {
        eventually(Duration::from_secs(120), || async {
            Ok((self.packs_stored().await? >= packs).then_some(()))
        })
        .await
        .with_context(|| {
            format!(
                "no {packs} packs appeared:\n{}",
                self.kubelet.all_agent_logs()
            )
        })
    }

    /// How many times each blob is stored in the fixture's repository's
    /// packs, read from every pack's trailer behind the controller's back;
    /// a blob stored more than once is data sent twice.
    pub async fn stored_blobs(
        &self,
    ) -> anyhow::Result<std::collections::BTreeMap<haulage::repo::BlobId, usize>> {
        let repository = self.repository().await?;
        let mut copies = std::collections::BTreeMap::new();
        for pack in repository.store().list(haulage::repo::DATA_PREFIX).await? {
            let id = haulage::repo::id_from_key(&pack.key, haulage::repo::DATA_PREFIX)
                .with_context(|| format!("{} is not a pack", pack.key))?;
            for entry in repository.read_pack_trailer(&id, pack.size).await? {
                *copies.entry(entry.id).or_insert(0) += 1;
            }
        }
        Ok(copies)
    }

    /// The options of a fixture, each at its default; `.start()` starts it.
    pub fn builder() -> FixtureBuilder {
        FixtureBuilder {
            layout: Layout::five_claims(),
            volume_bytes: 1 << 20,
            random_data_pack_bytes: None,
            upload_bytes_per_second: None,
            secret_key: SECRET_KEY.to_string(),
            objects: Vec::new(),
            tls: false,
            audited: false,
            provisioning: false,
            fault_proxy: false,
            api_fault_proxy: false,
            max_volumes_per_node: Some(haulage::controller::DEFAULT_MAX_VOLUMES_PER_NODE),
            checkpoint_seconds: None,
            agent_lost_seconds: None,
        }
    }

    /// The test configuration of an in-process controller replica named
    /// `identity` (health on an ephemeral port, short replica lease).
    pub fn controller_config(identity: &str) -> anyhow::Result<haulage::controller::Config> {
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
    pub async fn spawn_controller(
        &self,
        config: haulage::controller::Config,
    ) -> anyhow::Result<(
        CancellationToken,
        tokio::task::JoinHandle<Result<(), haulage::controller::RunError>>,
    )> {
        let kubeconfig = self
            .cluster
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

    /// Wait up to `deadline` for VolumeBackup `name` to finish, assert it
    /// Completed (else failing with its status and every agent's log), and
    /// return its status.
    pub async fn completed_backup(
        &self,
        name: &str,
        deadline: Duration,
    ) -> anyhow::Result<VolumeBackupStatus> {
        let backups: Api<VolumeBackup> = Api::namespaced(self.client.clone(), SYSTEM_NAMESPACE);
        let backup = final_phase(&backups, &self.kubelet, name, deadline).await?;
        self.completed_status(backup, |status| {
            status.phase == Some(VolumeBackupPhase::Completed)
        })
    }

    /// Wait up to `deadline` for VolumeRestore `name` to finish, assert it
    /// Completed (else failing with its status and every agent's log), and
    /// return its status.
    pub async fn completed_restore(
        &self,
        name: &str,
        deadline: Duration,
    ) -> anyhow::Result<VolumeRestoreStatus> {
        let restores: Api<VolumeRestore> = Api::namespaced(self.client.clone(), SYSTEM_NAMESPACE);
        let restore = final_phase(&restores, &self.kubelet, name, deadline).await?;
        self.completed_status(restore, |status| {
            status.phase == Some(VolumeRestorePhase::Completed)
        })
    }

    /// The status of a finished `object`, asserted `completed` (else
    /// failing with the object's kind, name and status and every agent's
    /// log).
    fn completed_status<K, S>(
        &self,
        mut object: K,
        completed: impl Fn(&S) -> bool,
    ) -> anyhow::Result<S>
    where
        K: kube::Resource<DynamicType = ()> + HasStatus<Status = S>,
        S: std::fmt::Debug,
    {
        let what = format!(
            "{} {}",
            K::kind(&()),
            object.meta().name.clone().unwrap_or_default()
        );
        let status = object.status_mut().take().context("status")?;
        assert!(
            completed(&status),
            "{what} did not complete: {status:#?}\n{}",
            self.kubelet.all_agent_logs()
        );
        Ok(status)
    }

    /// The controller is Ready and its task still runs.
    pub async fn assert_controller_up(&self, when: &str) {
        assert!(
            !self.controller.is_finished(),
            "{when}: the controller task exited"
        );
        assert_eq!(
            http_status(self.health_address.port(), "/readyz").await,
            Some(200),
            "{when}: /readyz"
        );
    }

    /// Stop the controller `controller-0` (waiting up to 10 s), the
    /// provisioner stand-in, the kubelet stand-in with its agents, and the
    /// cluster.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.controller).await;
        drop(self.provisioner);
        drop(self.kubelet);
        drop(self.cluster);
    }
}

/// The status of an object whose phase can be final (nothing more happens).
pub trait FinalPhase {
    /// Whether the object's phase is final.
    fn is_final(&self) -> bool;
}

impl FinalPhase for VolumeBackupStatus {
    fn is_final(&self) -> bool {
        self.phase.is_some_and(|phase| phase.is_final())
    }
}

impl FinalPhase for VolumeRestoreStatus {
    fn is_final(&self) -> bool {
        self.phase.is_some_and(|phase| phase.is_final())
    }
}

/// Wait up to `deadline` for the VolumeBackup or VolumeRestore `name` of
/// `api` to reach a final phase; a timeout names it, kind and name, with
/// its last status and every agent's log.
pub async fn final_phase<K>(
    api: &Api<K>,
    kubelet: &Kubelet,
    name: &str,
    deadline: Duration,
) -> anyhow::Result<K>
where
    K: kube::Resource<DynamicType = ()>
        + HasStatus
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::Status: FinalPhase + std::fmt::Debug,
{
    let finished = eventually(deadline, || async {
        let object = api.get(name).await?;
        Ok(object
            .status()
            .is_some_and(FinalPhase::is_final)
            .then_some(object))
    })
    .await;
    match finished {
        Ok(object) => Ok(object),
        Err(error) => {
            let status = api
                .get(name)
                .await
                .ok()
                .and_then(|mut object| object.status_mut().take());
            bail!(
                "{} {name} never finished ({error}): status {status:#?}\nagent logs:\n{}",
                K::kind(&()),
                kubelet.all_agent_logs()
            )
        }
    }
}

/// Create the StoragePolicy `name` (cluster-scoped) with `spec`.
pub async fn create_storage_policy(
    client: &kube::Client,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<()> {
    create::<haulage::api::StoragePolicy>(
        client,
        None,
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "StoragePolicy",
            "metadata": {"name": name}, "spec": spec}),
    )
    .await?;
    Ok(())
}

/// Wait up to `deadline` until no stage pod and no credentials copy is
/// left in the cluster; a timeout says `what` remains.
pub async fn no_leftovers_within(
    client: &kube::Client,
    deadline: Duration,
    what: &str,
) -> anyhow::Result<()> {
    eventually(deadline, || async {
        Ok((leftovers(client).await? == (0, 0)).then_some(()))
    })
    .await
    .with_context(|| what.to_string())
}

/// Within a minute, no stage pod and no copy of credentials is left.
pub async fn no_leftovers(client: &kube::Client) -> anyhow::Result<()> {
    no_leftovers_within(
        client,
        Duration::from_secs(60),
        "stage pods or credentials copies remain",
    )
    .await
}

/// Within a minute of `owner`'s deletion, none of its VolumeTransfers
/// (`transfers_left` counts them), stage pods, copies of credentials or
/// agents is left.
pub async fn nothing_left_of_deleted(
    fixture: &Fixture,
    owner: &str,
    transfers_left: impl AsyncFn() -> anyhow::Result<usize>,
) -> anyhow::Result<()> {
    let client = &fixture.client;
    eventually(Duration::from_secs(60), || async {
        Ok((transfers_left().await? == 0
            && leftovers(client).await? == (0, 0)
            && fixture.kubelet.running_agents() == 0)
            .then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "transfers, stage pods, credentials copies or agents of the deleted {owner} remain:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })
}

/// Create the VolumeRestore `name` (in the controller's namespace, from
/// the default location) of the snapshots VolumeBackup `backup` wrote,
/// each source namespace `ns` restored into `ns-b` (created).
pub async fn create_restore_of_backup(
    client: &kube::Client,
    name: &str,
    backup: &str,
) -> anyhow::Result<()> {
    create_restore_of_backup_into(client, name, backup, &["shop", "web"]).await
}

/// Like [`create_restore_of_backup`], of the source `namespaces`: each
/// one `ns` restored into `ns-b` (created).
pub async fn create_restore_of_backup_into(
    client: &kube::Client,
    name: &str,
    backup: &str,
    namespaces: &[&str],
) -> anyhow::Result<()> {
    let namespace_map: serde_json::Map<String, serde_json::Value> = namespaces
        .iter()
        .map(|namespace| (namespace.to_string(), json!(format!("{namespace}-b"))))
        .collect();
    create::<VolumeRestore>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeRestore",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"source": {"backup": backup},
                "namespaceMap": namespace_map,
                "createNamespaces": true}}),
    )
    .await?;
    Ok(())
}

/// Create the Secret `s3-credentials` in the controller's namespace: an
/// AWS credentials file (key `cloud`) with MinIO's access key and
/// `secret_key`; returns the Secret created.
pub async fn create_credentials_secret(
    client: &kube::Client,
    secret_key: &str,
) -> anyhow::Result<Secret> {
    create::<Secret>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "s3-credentials", "namespace": SYSTEM_NAMESPACE},
            "stringData": {"cloud": format!(
                "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {secret_key}\n")}}),
    )
    .await
}

/// Create the default BackupStorageLocation `minio` in the controller's
/// namespace: `bucket` and `prefix` on `minio`, with the credentials of
/// [`create_credentials_secret`] and the further spec fields in `settings`
/// (an object).
pub async fn create_minio_location(
    client: &kube::Client,
    minio: &MinioServer,
    bucket: &str,
    prefix: &str,
    settings: serde_json::Value,
) -> anyhow::Result<()> {
    let mut spec = json!({"bucket": bucket, "prefix": prefix, "endpoint": minio.endpoint(),
        "region": REGION, "s3ForcePathStyle": true, "default": true,
        "credential": {"name": "s3-credentials", "key": "cloud"}});
    let (Some(fields), serde_json::Value::Object(settings)) = (spec.as_object_mut(), settings)
    else {
        bail!("the location's settings are not an object");
    };
    fields.extend(settings);
    create::<BackupStorageLocation>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
            "metadata": {"name": "minio", "namespace": SYSTEM_NAMESPACE}, "spec": spec}),
    )
    .await?;
    Ok(())
}

/// Create the VolumeBackup `name` of both namespaces' labelled claims.
pub async fn create_backup(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    create_backup_of(client, name, json!({"matchLabels": {"backup": "yes"}})).await
}

/// Create the VolumeBackup `name` of the claims `selector` picks.
pub async fn create_backup_of(
    client: &kube::Client,
    name: &str,
    selector: serde_json::Value,
) -> anyhow::Result<()> {
    create_backup_in(client, name, &["shop", "web"], selector).await
}

/// Create the VolumeBackup `name` of the claims labelled `claim: CLAIM`
/// in `shop` and `web`.
pub async fn create_backup_of_claim(
    client: &kube::Client,
    name: &str,
    claim: &str,
) -> anyhow::Result<()> {
    create_backup_of(client, name, json!({"matchLabels": {"claim": claim}})).await
}

/// Create the VolumeBackup `name` of the claims `selector` picks in
/// `namespaces`.
pub async fn create_backup_in(
    client: &kube::Client,
    name: &str,
    namespaces: &[&str],
    selector: serde_json::Value,
) -> anyhow::Result<()> {
    create_backup_with_spec(
        client,
        name,
        json!({"namespaces": namespaces, "selector": selector}),
    )
    .await
}

/// Create the VolumeBackup `name` in the controller's namespace with `spec`.
pub async fn create_backup_with_spec(
    client: &kube::Client,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<()> {
    create::<VolumeBackup>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeBackup",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE}, "spec": spec}),
    )
    .await?;
    Ok(())
}

/// The bytes `transfer` reports done (0 before its first report).
pub fn bytes_done(transfer: &VolumeTransfer) -> i64 {
    transfer
        .status
        .as_ref()
        .and_then(|status| status.progress.as_ref())
        .map_or(0, |progress| progress.bytes_done)
}

/// The VolumeTransfer of the claim `pvc` among those `transfers` lists.
pub async fn transfer_of(
    transfers: &Api<VolumeTransfer>,
    pvc: &str,
) -> anyhow::Result<VolumeTransfer> {
    transfers
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|transfer| transfer.spec.pvc == pvc)
        .with_context(|| format!("no VolumeTransfer of claim {pvc}"))
}

/// Watch every VolumeTransfer of the cluster, calling `on_change` with
/// each one as it is created or changed, in the API server's order, until
/// the returned task is aborted (across apiserver restarts).
pub fn watch_transfers(
    client: &kube::Client,
    on_change: impl FnMut(&VolumeTransfer) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    watch_objects(
        Api::<VolumeTransfer>::all(client.clone()),
        kube::runtime::watcher::Config::default(),
        on_change,
    )
}

/// Watch the objects of `api` that `config` selects, calling `on_change`
/// with each one as it is created or changed, in the API server's order,
/// until the returned task is aborted (across apiserver restarts).
pub fn watch_objects<K>(
    api: Api<K>,
    config: kube::runtime::watcher::Config,
    mut on_change: impl FnMut(&K) + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let events = watcher(api, config).default_backoff().applied_objects();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        // An error (the apiserver restarting) is retried with backoff by
        // the watcher; the watch goes on.
        while let Some(event) = events.next().await {
            if let Ok(transfer) = event {
                on_change(&transfer);
            }
        }
    })
}

/// Whether a transfer in `phase` is running: admitted and not yet done.
pub fn is_running_phase(phase: VolumeTransferPhase) -> bool {
    matches!(
        phase,
        VolumeTransferPhase::Admitted
            | VolumeTransferPhase::InProgress
            | VolumeTransferPhase::Finalizing
    )
}

/// Stage pods and credentials copies left in the cluster.
pub async fn leftovers(client: &kube::Client) -> anyhow::Result<(usize, usize)> {
    let pods = stage_pods(client).await?;
    let secrets: Api<Secret> = Api::all(client.clone());
    let copies = secrets
        .list(&ListParams::default().labels(&format!("{CREDENTIALS_COPY_LABEL}=true")))
        .await?;
    Ok((pods.len(), copies.items.len()))
}

/// Create a VolumeBackup of the claim labelled `claim` into `location`.
pub async fn create_backup_to(
    client: &kube::Client,
    name: &str,
    claim: &str,
    location: &str,
) -> anyhow::Result<()> {
    create_backup_with_spec(
        client,
        name,
        json!({"namespaces": ["shop", "web"], "storageLocation": location,
            "selector": {"matchLabels": {"claim": claim}}}),
    )
    .await
}

/// The stage pods (namespace, name) that exist now.
pub async fn stage_pods(client: &kube::Client) -> anyhow::Result<Vec<(String, String)>> {
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
