//! The haulage API (group `haulage.dev`, version `v1alpha1`): the custom
//! resources as Rust types, their shared status values, and the CRDs
//! generated from them into `manifests/crds/`.
//!
//! - [`location`]: `BackupStorageLocation` (`bsl`), where repositories live.
//! - [`policy`]: `StoragePolicy`, caps that protect a kind of storage.
//! - [`backup`]: `VolumeBackup` (`vbk`), which claims to back up where.
//! - [`restore`]: `VolumeRestore` (`vrs`), which snapshots to restore into
//!   which claims of the destination cluster.
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
pub mod benchmark;
pub mod condition;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod labels;
pub mod location;
pub mod names;
pub mod policy;
pub mod progress;
pub mod restore;
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
pub use restore::{VolumeRestore, VolumeRestorePhase, VolumeRestoreSpec, VolumeRestoreStatus};
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
        VolumeRestore::crd(),
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
}
