//! The fixture of `haulage migrate`'s tests: two independent clusters
//! (each its own etcd and kube-apiserver, [`KubeCluster::start_two`])
//! sharing one real MinIO, haulage installed on both with `kubectl apply
//! -k`, a BackupStorageLocation on each naming the same repository, the
//! controller in-process against each with its own ServiceAccount's token
//! (one `Config` per cluster, as `support::fixture` runs one), and the
//! kubelet stand-in on each (on the destination only when asked, so a
//! test can keep its restores from running).
//!
//! The source holds two namespaces: `shop` with `db` (RWO, class `fast`,
//! mounted by the StatefulSet `db`'s pod on node-a) and `uploads` (RWX,
//! class `shared`, mounted by the Deployment `uploader`'s two pods on
//! node-b and node-c), `web` with `assets` (ROX, `shared`) and `scratch`
//! (RWO, `fast`, unattached). The destination has the classes `gp3` and
//! `shared`, no namespaces of the source's, and no claims.
//!
//! What a controller-manager would do and none runs here is done by two
//! small stand-ins, each named after the controller it replaces:
//! [`spawn_workload_controller`] (the source: a Deployment, StatefulSet or
//! ReplicaSet scaled to zero loses its pods) and [`spawn_volume_binder`]
//! (the destination: the PV controller and provisioner bind a new claim
//! to a new volume, a claim naming a volume to it, and the pvc-protection
//! controller releases a deleted claim no pod uses).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{BackupStorageLocation, VolumeBackup, VolumeRestore};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::fixture::{
    BoundClaim, InProcessController, create, create_credentials_secret, create_minio_location,
    eventually, start_controller,
};
use crate::support::kube::{KubeCluster, write_kubeconfig_of};
use crate::support::kubelet::{Kubelet, register_nodes};
use crate::support::minio::{MinioServer, SECRET_KEY};

/// Bucket both clusters' locations name.
pub const BUCKET: &str = "haulage-migrate";
/// Prefix of the repository in it.
pub const PREFIX: &str = "shared";
/// Kubeconfig context of the source cluster.
pub const SOURCE_CONTEXT: &str = "cluster-a";
/// Kubeconfig context of the destination cluster.
pub const DESTINATION_CONTEXT: &str = "cluster-b";
/// Nodes of each cluster.
pub const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
/// The source's claims: (namespace, name, access mode, class, seed).
pub const SOURCE_CLAIMS: [(&str, &str, &str, &str, u64); 4] = [
    ("shop", "db", "ReadWriteOnce", "fast", 11),
    ("shop", "uploads", "ReadWriteMany", "shared", 12),
    ("web", "assets", "ReadOnlyMany", "shared", 13),
    ("web", "scratch", "ReadWriteOnce", "fast", 14),
];
/// The source's classes and their provisioners.
pub const SOURCE_CLASSES: [(&str, &str); 2] = [
    ("fast", "rbd.csi.test.haulage.dev"),
    ("shared", "cephfs.csi.test.haulage.dev"),
];
/// The destination's classes and their provisioners.
pub const DESTINATION_CLASSES: [(&str, &str); 2] = [
    ("gp3", "ebs.csi.test.haulage.dev"),
    ("shared", "efs.csi.test.haulage.dev"),
];
/// Requested size of every source claim.
pub const CLAIM_SIZE: &str = "64Mi";
/// Generous: two cores shared with other builds, debug binaries.
pub const PASS_DEADLINE: Duration = Duration::from_secs(300);

/// One cluster of the pair.
pub struct Side {
    /// Its etcd and kube-apiserver.
    pub cluster: KubeCluster,
    /// The admin client the test acts with.
    pub client: kube::Client,
    /// The claims' data: `<volumes>/<namespace>/<claim>`.
    pub volumes: PathBuf,
    /// Its kubelet stand-in, when it runs one.
    pub kubelet: Option<Kubelet>,
    /// Stops its controller and stand-ins.
    pub shutdown: CancellationToken,
    /// Its in-process controller.
    pub controller: tokio::task::JoinHandle<Result<(), haulage::controller::RunError>>,
}

/// Both clusters, the MinIO they share, and one kubeconfig with a
/// context for each ([`SOURCE_CONTEXT`], [`DESTINATION_CONTEXT`]).
pub struct TwoClusters {
    /// Cluster A, where the claims are.
    pub source: Side,
    /// Cluster B, where they go.
    pub destination: Side,
    /// The S3 server of both locations.
    pub minio: MinioServer,
    /// The kubeconfig with both contexts.
    pub kubeconfig: PathBuf,
    /// Scratch space of the test.
    pub work: tempfile::TempDir,
}

/// How a [`TwoClusters`] starts.
pub struct TwoClustersBuilder {
    destination_agents: bool,
    volume_bytes: u64,
}

impl TwoClustersBuilder {
    /// No kubelet stand-in on the destination: its restores are planned
    /// and their stage pods created, but no agent runs (default: one runs).
    pub fn without_destination_agents(mut self) -> Self {
        self.destination_agents = false;
        self
    }

    /// Bytes of sample data per source claim (default 1 MiB).
    pub fn volume_bytes(mut self, bytes: u64) -> Self {
        self.volume_bytes = bytes;
        self
    }

    /// Start both clusters and everything on them.
    pub async fn start(self) -> anyhow::Result<TwoClusters> {
        let ((source, destination), minio) =
            tokio::try_join!(KubeCluster::start_two(), MinioServer::start())?;
        minio.create_bucket(BUCKET).await?;
        let work = tempfile::tempdir()?;
        let kubeconfig = work.path().join("kubeconfig");
        write_kubeconfig_of(
            &[
                (SOURCE_CONTEXT, &source),
                (DESTINATION_CONTEXT, &destination),
            ],
            &kubeconfig,
        )?;
        tokio::try_join!(source.install_manifests(), destination.install_manifests())?;
        let source_side = start_side(
            source,
            &minio,
            work.path(),
            "a",
            &SOURCE_CLASSES,
            true,
            true,
        )
        .await?;
        populate_source(&source_side, self.volume_bytes).await?;
        spawn_workload_controller(source_side.client.clone(), source_side.shutdown.clone());
        let destination_side = start_side(
            destination,
            &minio,
            work.path(),
            "b",
            &DESTINATION_CLASSES,
            self.destination_agents,
            false,
        )
        .await?;
        spawn_volume_binder(
            destination_side.client.clone(),
            destination_side.volumes.clone(),
            destination_side.shutdown.clone(),
        );
        for side in [&source_side, &destination_side] {
            let locations: Api<BackupStorageLocation> =
                Api::namespaced(side.client.clone(), SYSTEM_NAMESPACE);
            eventually(Duration::from_secs(90), || async {
                let phase = locations.get("minio").await?.status.and_then(|s| s.phase);
                Ok(
                    (phase == Some(haulage::api::BackupStorageLocationPhase::Available))
                        .then_some(()),
                )
            })
            .await
            .context("a BackupStorageLocation never became Available")?;
        }
        Ok(TwoClusters {
            source: source_side,
            destination: destination_side,
            minio,
            kubeconfig,
            work,
        })
    }
}

impl TwoClusters {
    /// The VolumeBackups of the source's controller namespace, which
    /// `haulage migrate` creates.
    pub fn source_backups(&self) -> Api<VolumeBackup> {
        Api::namespaced(self.source.client.clone(), SYSTEM_NAMESPACE)
    }

    /// The VolumeRestores of the destination's controller namespace, which
    /// `haulage migrate` creates.
    pub fn destination_restores(&self) -> Api<VolumeRestore> {
        Api::namespaced(self.destination.client.clone(), SYSTEM_NAMESPACE)
    }

    /// The default options.
    pub fn builder() -> TwoClustersBuilder {
        TwoClustersBuilder {
            destination_agents: true,
            volume_bytes: 1 << 20,
        }
    }

    /// `haulage migrate` with both contexts of [`TwoClusters::kubeconfig`]
    /// and `arguments`, not started yet.
    pub fn migrate(&self, arguments: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"));
        command
            .arg("migrate")
            .args([
                "--from-context",
                SOURCE_CONTEXT,
                "--to-context",
                DESTINATION_CONTEXT,
            ])
            .args(arguments)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// Run `haulage migrate` with `arguments` to its end: (exit code,
    /// stdout, stderr).
    pub async fn run_migrate(&self, arguments: &[&str]) -> anyhow::Result<(i32, String, String)> {
        let output = self
            .migrate(arguments)
            .output()
            .await
            .context("start haulage migrate")?;
        Ok((
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ))
    }

    /// Stop both controllers, stand-ins and clusters.
    pub async fn stop(self) {
        for side in [self.source, self.destination] {
            side.shutdown.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(10), side.controller).await;
            drop(side.kubelet);
            drop(side.cluster);
        }
    }
}

async fn start_side(
    cluster: KubeCluster,
    minio: &MinioServer,
    work: &Path,
    name: &str,
    classes: &[(&str, &str)],
    agents: bool,
    is_source: bool,
) -> anyhow::Result<Side> {
    let client = cluster.client().await?;
    for (class, provisioner) in classes {
        create::<StorageClass>(
            &client,
            None,
            json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                "metadata": {"name": class}, "provisioner": provisioner}),
        )
        .await?;
    }
    let volumes = work.join(format!("volumes-{name}"));
    std::fs::create_dir_all(&volumes)?;
    let kubelet = if agents {
        Some(
            Kubelet::start(
                client.clone(),
                cluster.kubeconfig(),
                &NODES,
                &volumes,
                &work.join(format!("kubelet-{name}")),
            )
            .await?,
        )
    } else {
        register_nodes(&client, &NODES).await?;
        None
    };
    create_credentials_secret(&client, SECRET_KEY).await?;
    // The source's location creates the repository; the destination's
    // finds it there.
    create_minio_location(
        &client,
        minio,
        BUCKET,
        PREFIX,
        json!({"initialize": is_source, "validationFrequency": "5s"}),
    )
    .await?;
    let InProcessController {
        shutdown,
        controller,
        ..
    } = start_controller(&cluster, work, &format!("controller-{name}")).await?;
    Ok(Side {
        cluster,
        client,
        volumes,
        kubelet,
        shutdown,
        controller,
    })
}

/// The source's namespaces, claims (bound, with data), workloads and
/// their running pods.
async fn populate_source(side: &Side, volume_bytes: u64) -> anyhow::Result<()> {
    let client = &side.client;
    for namespace in ["shop", "web"] {
        create::<Namespace>(
            client,
            None,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
        )
        .await?;
    }
    let provisioner_of = |class: &str| {
        SOURCE_CLASSES
            .iter()
            .find(|(name, _)| *name == class)
            .map_or("unknown", |(_, provisioner)| *provisioner)
    };
    for (namespace, name, mode, class, seed) in SOURCE_CLAIMS {
        BoundClaim {
            namespace,
            name,
            mode,
            class,
            provisioner: provisioner_of(class),
            size: CLAIM_SIZE,
            metadata: json!({"labels": {"app": name, "tier": "data"},
                "annotations": {"team": "payments"}}),
        }
        .create(client)
        .await?;
        haulage::sample::generate(&side.volumes.join(namespace).join(name), volume_bytes, seed)?;
    }
    let template = |app: &str, claim: &str| {
        json!({"metadata": {"labels": {"app": app}},
            "spec": {"containers": [{"name": "app", "image": "app:1",
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}})
    };
    let statefulset: StatefulSet = create(
        client,
        Some("shop"),
        json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {"replicas": 1, "serviceName": "db",
                "selector": {"matchLabels": {"app": "db"}}, "template": template("db", "db")}}),
    )
    .await?;
    let deployment: Deployment = create(
        client,
        Some("shop"),
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "uploader", "namespace": "shop"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "uploader"}},
                "template": template("uploader", "uploads")}}),
    )
    .await?;
    let replica_set: ReplicaSet = create(
        client,
        Some("shop"),
        json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "uploader-5d8f", "namespace": "shop",
                "ownerReferences": [owner_reference(&deployment)]},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "uploader"}},
                "template": template("uploader", "uploads")}}),
    )
    .await?;
    running_pod(
        client,
        "shop",
        "db-0",
        "node-a",
        "db",
        &owner_reference(&statefulset),
    )
    .await?;
    for (pod, node) in [("uploader-5d8f-b", "node-b"), ("uploader-5d8f-c", "node-c")] {
        running_pod(
            client,
            "shop",
            pod,
            node,
            "uploads",
            &owner_reference(&replica_set),
        )
        .await?;
    }
    Ok(())
}

/// The owner reference a controller puts on what it creates.
pub fn owner_reference<K: Resource<DynamicType = ()>>(owner: &K) -> serde_json::Value {
    json!({"apiVersion": K::api_version(&()), "kind": K::kind(&()),
        "name": owner.meta().name, "uid": owner.meta().uid, "controller": true})
}

/// A Running pod on `node` mounting `claim`, controlled by `owner`.
pub async fn running_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    node: &str,
    claim: &str,
    owner: &serde_json::Value,
) -> anyhow::Result<()> {
    create::<Pod>(
        client,
        Some(namespace),
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"workload": "yes"},
                "ownerReferences": [owner]},
            "spec": {"nodeName": node,
                "containers": [{"name": "app", "image": "app:1",
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}}),
    )
    .await?;
    Api::<Pod>::namespaced(client.clone(), namespace)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await?;
    Ok(())
}

/// The workload controllers' part that matters here: a Deployment,
/// StatefulSet or ReplicaSet at zero replicas loses its pods (deleted
/// at once, as a kubelet confirms a stopped pod), except those labelled
/// `stuck` (a pod stuck terminating). Pods of a ReplicaSet count as its
/// Deployment's.
pub fn spawn_workload_controller(client: kube::Client, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
            if let Err(error) = scale_down_pods(&client).await {
                eprintln!("workload controller stand-in: {error:#}");
            }
        }
    });
}

async fn scale_down_pods(client: &kube::Client) -> anyhow::Result<()> {
    let at_zero = |replicas: Option<i32>| replicas == Some(0);
    let mut stopped: BTreeSet<(String, String, String)> = BTreeSet::new();
    for deployment in Api::<Deployment>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        if at_zero(deployment.spec.as_ref().and_then(|spec| spec.replicas)) {
            for set in Api::<ReplicaSet>::all(client.clone())
                .list(&ListParams::default())
                .await?
            {
                if set
                    .owner_references()
                    .iter()
                    .any(|owner| owner.uid == deployment.uid().unwrap_or_default())
                {
                    stopped.insert((
                        "ReplicaSet".into(),
                        set.namespace().unwrap_or_default(),
                        set.name_any(),
                    ));
                }
            }
        }
    }
    for set in Api::<StatefulSet>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        if at_zero(set.spec.as_ref().and_then(|spec| spec.replicas)) {
            stopped.insert((
                "StatefulSet".into(),
                set.namespace().unwrap_or_default(),
                set.name_any(),
            ));
        }
    }
    for set in Api::<ReplicaSet>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        if at_zero(set.spec.as_ref().and_then(|spec| spec.replicas)) {
            stopped.insert((
                "ReplicaSet".into(),
                set.namespace().unwrap_or_default(),
                set.name_any(),
            ));
        }
    }
    for pod in Api::<Pod>::all(client.clone())
        .list(&ListParams::default().labels("workload=yes"))
        .await?
    {
        let namespace = pod.namespace().unwrap_or_default();
        // A pod labelled `stuck` stands for one stuck terminating.
        if pod.labels().contains_key("stuck") {
            continue;
        }
        let owned = pod.owner_references().iter().any(|owner| {
            stopped.contains(&(owner.kind.clone(), namespace.clone(), owner.name.clone()))
        });
        if owned {
            let _ = Api::<Pod>::namespaced(client.clone(), &namespace)
                .delete(&pod.name_any(), &DeleteParams::default().grace_period(0))
                .await;
        }
    }
    Ok(())
}

/// The PV controller's, a provisioner's and the pvc-protection
/// controller's part on the destination: a new Pending claim of a known
/// class gets a new volume (its directory under `volumes`) and is Bound;
/// a claim naming a volume is bound to it; a deleted claim no pod mounts
/// loses its `kubernetes.io/pvc-protection` finalizer.
pub fn spawn_volume_binder(client: kube::Client, volumes: PathBuf, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
            if let Err(error) = bind_claims(&client, &volumes).await {
                eprintln!("volume binder stand-in: {error:#}");
            }
        }
    });
}

const PVC_PROTECTION_FINALIZER: &str = "kubernetes.io/pvc-protection";

async fn bind_claims(client: &kube::Client, volumes: &Path) -> anyhow::Result<()> {
    let claims = Api::<PersistentVolumeClaim>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let known: BTreeSet<&str> = DESTINATION_CLASSES.iter().map(|(name, _)| *name).collect();
    let volume_api: Api<PersistentVolume> = Api::all(client.clone());
    for claim in claims {
        let namespace = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
        if claim.metadata.deletion_timestamp.is_some() {
            let mounted = pods.iter().any(|pod| {
                pod.namespace().as_deref() == Some(namespace.as_str())
                    && pod
                        .spec
                        .iter()
                        .flat_map(|spec| spec.volumes.iter().flatten())
                        .any(|volume| {
                            volume
                                .persistent_volume_claim
                                .as_ref()
                                .is_some_and(|source| source.claim_name == name)
                        })
            });
            if !mounted
                && claim
                    .finalizers()
                    .iter()
                    .any(|f| f == PVC_PROTECTION_FINALIZER)
            {
                let rest: Vec<&String> = claim
                    .finalizers()
                    .iter()
                    .filter(|finalizer| *finalizer != PVC_PROTECTION_FINALIZER)
                    .collect();
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": rest}})),
                )
                .await?;
            }
            continue;
        }
        let phase = claim
            .status
            .as_ref()
            .and_then(|status| status.phase.as_deref());
        let spec = claim.spec.clone().unwrap_or_default();
        let class = spec.storage_class_name.clone().unwrap_or_default();
        if phase == Some("Bound") || !known.contains(class.as_str()) {
            continue;
        }
        let uid = claim.uid().unwrap_or_default();
        let modes = spec.access_modes.clone().unwrap_or_default();
        let request = spec
            .resources
            .as_ref()
            .and_then(|resources| resources.requests.as_ref())
            .and_then(|requests| requests.get("storage"))
            .map_or_else(|| "1Gi".to_string(), |quantity| quantity.0.clone());
        let volume_name = match &spec.volume_name {
            Some(volume) => {
                volume_api
                    .patch(
                        volume,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"claimRef": {
                            "namespace": namespace, "name": name, "uid": uid}}})),
                    )
                    .await
                    .with_context(|| format!("bind volume {volume} to {namespace}/{name}"))?;
                volume.clone()
            }
            None => {
                let volume = format!("pvc-{}", &uid[..uid.len().min(18)]);
                let driver = DESTINATION_CLASSES
                    .iter()
                    .find(|(known, _)| *known == class)
                    .map_or("unknown", |(_, provisioner)| *provisioner);
                if volume_api.get_opt(&volume).await?.is_none() {
                    create::<PersistentVolume>(
                        client,
                        None,
                        json!({"apiVersion": "v1", "kind": "PersistentVolume",
                            "metadata": {"name": volume},
                            "spec": {"capacity": {"storage": request}, "accessModes": modes,
                                "persistentVolumeReclaimPolicy": "Delete",
                                "storageClassName": class,
                                "csi": {"driver": driver, "volumeHandle": volume},
                                "claimRef": {"namespace": namespace, "name": name, "uid": uid}}}),
                    )
                    .await?;
                }
                std::fs::create_dir_all(volumes.join(&namespace).join(&name))?;
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"volumeName": volume}})),
                )
                .await
                .with_context(|| format!("name volume {volume} in {namespace}/{name}"))?;
                volume
            }
        };
        volume_api
            .patch_status(
                &volume_name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Bound"}})),
            )
            .await?;
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Bound", "accessModes": modes,
                "capacity": {"storage": request}}})),
        )
        .await?;
    }
    Ok(())
}
