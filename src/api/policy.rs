//! `StoragePolicy` (cluster-scoped): how hard haulage may use one kind of
//! storage. It selects storage classes by name or provisioner and caps the
//! volumes moved at once and the bytes per second read from (backup) or
//! written to (restore) that storage. This is how a team protects a shared
//! Ceph cluster from its own migration.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::condition::Condition;

/// Limits for the volumes of the storage classes it selects.
#[allow(
    clippy::duplicated_attributes,
    reason = "each kube printcolumn(...) repeats the same keys"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "haulage.dev",
    version = "v1alpha1",
    kind = "StoragePolicy",
    plural = "storagepolicies",
    shortname = "spol",
    category = "haulage",
    status = "StoragePolicyStatus",
    derive = "PartialEq",
    doc = "Caps on concurrent volumes and bandwidth for the storage classes it selects",
    printcolumn(
        name = "Max Volumes",
        type_ = "integer",
        json_path = ".spec.maxConcurrentVolumes"
    ),
    printcolumn(
        name = "Max Bytes/s",
        type_ = "integer",
        json_path = ".spec.maxBytesPerSecond"
    ),
    printcolumn(
        name = "Running",
        type_ = "integer",
        json_path = ".status.runningVolumes"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("(has(self.storageClassNames) && size(self.storageClassNames) > 0) || (has(self.provisioners) && size(self.provisioners) > 0)").message("must select storage: set storageClassNames, provisioners or both"))]
#[serde(rename_all = "camelCase")]
pub struct StoragePolicySpec {
    /// Storage classes the policy covers, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(min = 1, max = 253)))]
    pub storage_class_names: Vec<String>,
    /// Storage classes the policy covers, by provisioner (CSI driver name,
    /// e.g. `rbd.csi.ceph.com`): every class with that provisioner.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 253)))]
    pub provisioners: Vec<String>,
    /// Volumes of this storage moved at the same time, over all backups
    /// and restores; unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_concurrent_volumes: Option<i32>,
    /// Bytes per second read from this storage (backup) or written to it
    /// (restore), split among its running transfers; unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_bytes_per_second: Option<i64>,
    /// Resources of the stage pods that mount this storage's volumes,
    /// instead of the controller's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_pod_resources: Option<ResourceRequirements>,
}

impl StoragePolicySpec {
    /// Whether the policy covers a storage class with this name and
    /// provisioner.
    pub fn selects(&self, class_name: &str, provisioner: &str) -> bool {
        self.storage_class_names
            .iter()
            .any(|name| name == class_name)
            || self.provisioners.iter().any(|name| name == provisioner)
    }
}

/// What the controller reports about a policy in force.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StoragePolicyStatus {
    /// Volumes of this storage being moved now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub running_volumes: Option<i32>,
    /// Transfers waiting for room under `maxConcurrentVolumes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub queued_volumes: Option<i32>,
    /// Sum of the bandwidth granted to the running transfers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub granted_bytes_per_second: Option<i64>,
    /// Conditions, keyed by type (`Accepted`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_selects_by_name_or_by_provisioner() {
        let spec: StoragePolicySpec = serde_yaml::from_str(
            "storageClassNames: [ceph-block]\nprovisioners: [cephfs.csi.ceph.com]\n",
        )
        .expect("valid spec");
        assert!(spec.selects("ceph-block", "rbd.csi.ceph.com"));
        assert!(spec.selects("ceph-fs-retain", "cephfs.csi.ceph.com"));
        assert!(!spec.selects("local-path", "rancher.io/local-path"));
    }
}
