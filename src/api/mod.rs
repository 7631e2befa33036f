//! The haulage API (group `haulage.dev`, version `v1alpha1`): the custom
//! resources as Rust types, their shared status values, and the CRDs
//! generated from them into `manifests/crds/`.
//!
//! - [`location`]: `BackupStorageLocation` (`bsl`), where repositories live.
//! - [`policy`]: `StoragePolicy`, caps that protect a kind of storage.
//! - [`backup`]: `VolumeBackup` (`vbk`), which claims to back up where.
//! - [`transfer`]: `VolumeTransfer` (`vxf`), one claim's data in motion.
//! - [`condition`]: status conditions, their types and reasons.
//! - [`progress`]: transfer progress and duration strings.
//! - [`labels`]: label keys, the finalizer and field managers shared with
//!   the manifests and the agents.
//! - `fixtures` (tests only): `VolumeBackup::test("nightly").with_phase(..)`
//!   and the like for unit tests.
//!
//! This module holds values only: no client, no clock, no I/O. Whatever
//! reads or writes these objects takes them from here.

pub mod backup;
pub mod condition;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod labels;
pub mod location;
pub mod policy;
pub mod progress;
pub mod transfer;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use backup::{VolumeBackup, VolumeBackupPhase, VolumeBackupSpec, VolumeBackupStatus};
pub use condition::{Condition, ConditionStatus, set_condition};
pub use location::{
    BackupStorageLocation, BackupStorageLocationPhase, BackupStorageLocationSpec,
    BackupStorageLocationStatus,
};
pub use policy::{StoragePolicy, StoragePolicySpec, StoragePolicyStatus};
pub use progress::Progress;
pub use transfer::{
    TransferDirection, VolumeTransfer, VolumeTransferPhase, VolumeTransferSpec,
    VolumeTransferStatus,
};

/// API group of every haulage resource.
pub const GROUP: &str = "haulage.dev";
/// API version of every haulage resource.
pub const VERSION: &str = "v1alpha1";

/// The body of a server-side apply of `status` to an object of kind `K`:
/// `apiVersion`, `kind` and `status`, nothing else (so the writer's field
/// manager owns only the status fields it sets). One place for every
/// status writer: controller, BSL prober, admission and the agent.
pub fn status_apply<K>(status: &impl serde::Serialize) -> serde_json::Value
where
    K: kube::Resource<DynamicType = ()>,
{
    serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    })
}

/// The command that rewrites `manifests/crds/` from these types.
pub const REGENERATE_COMMAND: &str = "cargo run -- crds --output-dir manifests/crds";

/// Every CRD haulage installs, in a stable order.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        BackupStorageLocation::crd(),
        StoragePolicy::crd(),
        VolumeBackup::crd(),
        VolumeTransfer::crd(),
    ]
}

/// A CRD could not be rendered as YAML.
#[derive(Debug, thiserror::Error)]
#[error("failed to render CRD {name} as YAML")]
pub struct RenderError {
    /// The CRD's name.
    pub name: String,
    /// What serde_yaml said.
    #[source]
    pub source: serde_yaml::Error,
}

/// The files of `manifests/crds/`: (file name, contents) for each CRD and
/// the kustomization listing them. Deterministic, so a test can compare
/// them byte for byte with what is committed.
pub fn crd_manifests() -> Result<Vec<(String, String)>, RenderError> {
    let header = format!(
        "# Generated from the Rust types in src/api by `{REGENERATE_COMMAND}`.\n\
         # Do not edit: change the types and regenerate.\n"
    );
    let mut files = Vec::new();
    let mut resources = String::new();
    for crd in crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let yaml = serde_yaml::to_string(&crd).map_err(|source| RenderError {
            name: name.clone(),
            source,
        })?;
        let file_name = format!("{name}.yaml");
        resources.push_str(&format!("  - {file_name}\n"));
        files.push((file_name, format!("{header}{yaml}")));
    }
    files.push((
        "kustomization.yaml".to_string(),
        format!(
            "{header}apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n{resources}"
        ),
    ));
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_apply_names_the_kind_and_version_of_the_crd() {
        let body = status_apply::<VolumeTransfer>(&serde_json::json!({"phase": "Queued"}));
        assert_eq!(
            body,
            serde_json::json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeTransfer",
                "status": {"phase": "Queued"}})
        );
    }
    use serde::Deserialize;

    #[test]
    fn every_crd_is_in_the_haulage_group_with_a_status_subresource() {
        for crd in crds() {
            let name = crd.metadata.name.clone().unwrap_or_default();
            assert_eq!(crd.spec.group, GROUP, "{name}");
            assert_eq!(crd.spec.versions.len(), 1, "{name}");
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, VERSION, "{name}");
            assert!(
                version
                    .subresources
                    .as_ref()
                    .is_some_and(|s| s.status.is_some()),
                "{name} has no status subresource"
            );
            let columns = version
                .additional_printer_columns
                .clone()
                .unwrap_or_default();
            assert!(
                columns.iter().any(|column| column.name == "Age"),
                "{name} lacks an Age column"
            );
        }
    }

    #[test]
    fn the_examples_read_as_the_rust_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/examples");
        let mut kinds = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("manifests/examples exists") {
            let path = entry.expect("readable directory").path();
            let text = std::fs::read_to_string(&path).expect("readable example");
            for document in serde_yaml::Deserializer::from_str(&text) {
                let value = serde_yaml::Value::deserialize(document).expect("valid YAML");
                let kind = value["kind"].as_str().unwrap_or_default().to_string();
                let parsed = match kind.as_str() {
                    "BackupStorageLocation" => {
                        serde_yaml::from_value::<BackupStorageLocation>(value).map(|_| ())
                    }
                    "StoragePolicy" => serde_yaml::from_value::<StoragePolicy>(value).map(|_| ()),
                    "VolumeBackup" => serde_yaml::from_value::<VolumeBackup>(value).map(|_| ()),
                    "VolumeTransfer" => serde_yaml::from_value::<VolumeTransfer>(value).map(|_| ()),
                    _ => Ok(()),
                };
                if let Err(error) = parsed {
                    panic!("{}: {kind}: {error}", path.display());
                }
                kinds.push(kind);
            }
        }
        for kind in [
            "BackupStorageLocation",
            "StoragePolicy",
            "VolumeBackup",
            "Secret",
        ] {
            assert!(kinds.iter().any(|k| k == kind), "no {kind} example");
        }
    }

    #[test]
    fn manifests_in_the_repository_match_the_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/crds");
        let mut stale = Vec::new();
        let files = crd_manifests().expect("CRDs render");
        for (name, expected) in &files {
            let committed = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
            if &committed != expected {
                stale.push(name.clone());
            }
        }
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| !files.iter().any(|(file, _)| file == name))
            .collect();
        on_disk.sort();
        assert!(
            stale.is_empty() && on_disk.is_empty(),
            "manifests/crds is stale (differs: {stale:?}, not generated: {on_disk:?}); \
             regenerate with `{REGENERATE_COMMAND}`"
        );
    }
}
