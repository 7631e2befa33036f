//! A provisioner stand-in: there is no CSI driver and no
//! kube-controller-manager here, so the claims a VolumeRestore creates
//! would stay Pending. For every claim of the fixture's StorageClass that
//! has no volume, it does what a dynamic provisioner and the PV controller
//! do together: creates a directory for it under `<volumes>/<namespace>/
//! <claim>` (where the kubelet stand-in mounts claims), a
//! PersistentVolume of the claim's size and access modes bound to the
//! claim (a `claimRef` with its UID), sets the claim's `volumeName` and
//! marks both Bound. A claim created already naming a volume (a
//! ReadOnlyMany hand-back rebinding the written volume) is bound to it the
//! same way. It polls, as the kubelet stand-in does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// How often claims are looked at.
const SYNC_INTERVAL: Duration = Duration::from_millis(300);

/// The stand-in; stops when dropped.
pub struct Provisioner {
    stop: CancellationToken,
}

impl Provisioner {
    /// Provision claims of `storage_class` (whose provisioner is
    /// `driver`) with directories under `volumes`.
    pub fn start(client: kube::Client, volumes: &Path, storage_class: &str, driver: &str) -> Self {
        let stop = CancellationToken::new();
        let task = Task {
            client,
            volumes: volumes.to_path_buf(),
            storage_class: storage_class.to_string(),
            driver: driver.to_string(),
        };
        let token = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(SYNC_INTERVAL) => {}
                }
                if let Err(error) = task.sync().await {
                    eprintln!("provisioner stand-in: {error:#}");
                }
            }
        });
        Provisioner { stop }
    }
}

impl Drop for Provisioner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

struct Task {
    client: kube::Client,
    volumes: PathBuf,
    storage_class: String,
    driver: String,
}

impl Task {
    async fn sync(&self) -> anyhow::Result<()> {
        let claims: Api<PersistentVolumeClaim> = Api::all(self.client.clone());
        for claim in claims.list(&ListParams::default()).await?.items {
            let spec = claim.spec.clone().unwrap_or_default();
            let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
            if bound
                || claim.meta().deletion_timestamp.is_some()
                || spec.storage_class_name.as_deref() != Some(self.storage_class.as_str())
            {
                continue;
            }
            self.provision(&claim).await?;
        }
        Ok(())
    }

    async fn provision(&self, claim: &PersistentVolumeClaim) -> anyhow::Result<()> {
        let namespace = claim.namespace().context("claim without namespace")?;
        let name = claim.name_any();
        let uid = claim.uid().context("claim without uid")?;
        let spec = claim.spec.clone().unwrap_or_default();
        let modes = spec.access_modes.clone().unwrap_or_default();
        let size = spec
            .resources
            .as_ref()
            .and_then(|resources| resources.requests.as_ref())
            .and_then(|requests| requests.get("storage"))
            .map(|quantity| quantity.0.clone())
            .unwrap_or_else(|| "1Gi".to_string());
        std::fs::create_dir_all(self.volumes.join(&namespace).join(&name))?;
        let volumes: Api<PersistentVolume> = Api::all(self.client.clone());
        let volume = match &spec.volume_name {
            Some(volume) if !volume.is_empty() => volume.clone(),
            _ => {
                let volume = format!("pv-{namespace}-{name}-{}", &uid[..8]);
                let pv: PersistentVolume = serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "PersistentVolume",
                    "metadata": {"name": volume},
                    "spec": {"capacity": {"storage": size}, "accessModes": modes,
                        "persistentVolumeReclaimPolicy": "Delete",
                        "storageClassName": self.storage_class,
                        "csi": {"driver": self.driver, "volumeHandle": volume}}}))?;
                match volumes.create(&PostParams::default(), &pv).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(error) => {
                        return Err(error).with_context(|| format!("create volume {volume}"));
                    }
                }
                let claims: Api<PersistentVolumeClaim> =
                    Api::namespaced(self.client.clone(), &namespace);
                claims
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"volumeName": volume}})),
                    )
                    .await
                    .with_context(|| format!("set the volume of claim {namespace}/{name}"))?;
                volume
            }
        };
        volumes
            .patch(
                &volume,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"claimRef": {
                    "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "namespace": namespace, "name": name, "uid": uid}}})),
            )
            .await
            .with_context(|| format!("bind volume {volume}"))?;
        volumes
            .patch_status(
                &volume,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Bound"}})),
            )
            .await
            .with_context(|| format!("mark volume {volume} Bound"))?;
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &namespace);
        claims
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Bound", "accessModes": modes,
                    "capacity": {"storage": size}}})),
            )
            .await
            .with_context(|| format!("mark claim {namespace}/{name} Bound"))?;
        Ok(())
    }
}
