//! Small builders for the API objects in unit tests (here and in the
//! controller): `VolumeBackup::test("nightly").with_phase(..)`. Every
//! object gets a namespace, a UID and generation 1, as the API server
//! would give it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::backup::{DeletionPolicy, ParentPolicy, VolumeBackupPhase};
use crate::labels::SYSTEM_NAMESPACE;
use crate::location::SecretKeyReference;
use crate::transfer::{OwnerReference, StorageLocationReference, TransferDirection};
use crate::{
    BackupStorageLocation, BackupStorageLocationPhase, BackupStorageLocationSpec,
    BackupStorageLocationStatus, StoragePolicy, StoragePolicySpec, VolumeBackup, VolumeBackupSpec,
    VolumeBackupStatus, VolumeTransfer, VolumeTransferPhase, VolumeTransferSpec,
    VolumeTransferStatus,
};

fn metadata(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(str::to_string),
        uid: Some(format!("uid-{name}")),
        generation: Some(1),
        resource_version: Some("1".to_string()),
        ..ObjectMeta::default()
    }
}

impl VolumeBackup {
    /// A backup of every claim in namespace `shop` into the BSL `s3`.
    pub fn test(name: &str) -> Self {
        VolumeBackup {
            metadata: metadata(name, Some(SYSTEM_NAMESPACE)),
            spec: VolumeBackupSpec {
                namespaces: vec!["shop".to_string()],
                selector: None,
                storage_location: Some("s3".to_string()),
                parent_policy: ParentPolicy::Latest,
                tags: Vec::new(),
                fail_after_unavailable_seconds: None,
                agent_user: None,
                deletion_policy: DeletionPolicy::Retain,
                ttl: None,
                claim_names: Vec::new(),
                benchmark: None,
            },
            status: None,
        }
    }

    /// With `status.phase` set.
    pub fn with_phase(mut self, phase: VolumeBackupPhase) -> Self {
        self.status
            .get_or_insert_with(VolumeBackupStatus::default)
            .phase = Some(phase);
        self
    }
}

impl BackupStorageLocation {
    /// A path-style location on a local S3 server, credentials in `s3-credentials`.
    pub fn test(name: &str) -> Self {
        BackupStorageLocation {
            metadata: metadata(name, Some(SYSTEM_NAMESPACE)),
            spec: BackupStorageLocationSpec {
                bucket: "haulage".to_string(),
                prefix: None,
                endpoint: Some("http://127.0.0.1:9000".to_string()),
                region: None,
                s3_force_path_style: Some(true),
                credential: SecretKeyReference {
                    name: "s3-credentials".to_string(),
                    key: "cloud".to_string(),
                },
                ca_bundle: None,
                is_default: false,
                validation_frequency: "1m".to_string(),
                upload_bytes_per_second: None,
                max_concurrent_volumes: None,
                max_concurrent_requests: None,
                initialize: false,
                encryption: None,
                maintenance: None,
            },
            status: None,
        }
    }

    /// Marked `default: true`.
    pub fn marked_default(mut self) -> Self {
        self.spec.is_default = true;
        self
    }

    /// Created `seconds` after a fixed instant.
    pub fn created_at(mut self, seconds: i64) -> Self {
        self.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + seconds)
                    .expect("timestamp in range"),
            ));
        self
    }

    /// With `status.phase` set.
    pub fn with_phase(mut self, phase: BackupStorageLocationPhase) -> Self {
        self.status
            .get_or_insert_with(BackupStorageLocationStatus::default)
            .phase = Some(phase);
        self
    }
}

impl VolumeTransfer {
    /// An upload of claim `pvc` in namespace `shop` for the backup
    /// `nightly`, by stage pod `stage-a`.
    pub fn test(name: &str, pvc: &str) -> Self {
        VolumeTransfer {
            metadata: metadata(name, Some("shop")),
            spec: VolumeTransferSpec {
                direction: TransferDirection::Upload,
                pvc: pvc.to_string(),
                backup_ref: OwnerReference {
                    namespace: SYSTEM_NAMESPACE.to_string(),
                    name: "nightly".to_string(),
                    uid: Some("uid-nightly".to_string()),
                },
                storage_location: StorageLocationReference {
                    namespace: SYSTEM_NAMESPACE.to_string(),
                    name: "s3".to_string(),
                },
                stage_pod: "stage-a".to_string(),
                parent_snapshot: None,
                since_snapshot: None,
                snapshot: None,
                granted_bytes_per_second: None,
                claim: None,
                parent_policy: Default::default(),
                tags: Default::default(),
                benchmark: None,
            },
            status: None,
        }
    }

    /// With `status.phase` set.
    pub fn with_phase(mut self, phase: VolumeTransferPhase) -> Self {
        self.status
            .get_or_insert_with(VolumeTransferStatus::default)
            .phase = Some(phase);
        self
    }
}

impl crate::VolumeRestore {
    /// A restore of the latest snapshots of backup `nightly` from the BSL
    /// `s3`, namespaces kept.
    pub fn test(name: &str) -> Self {
        crate::VolumeRestore {
            metadata: metadata(name, Some(SYSTEM_NAMESPACE)),
            spec: crate::VolumeRestoreSpec {
                storage_location: Some("s3".to_string()),
                source: crate::restore::RestoreSource {
                    backup: Some("nightly".to_string()),
                    ..Default::default()
                },
                namespace_map: Default::default(),
                create_namespaces: false,
                storage_class_map: Default::default(),
                provisioner_map: Default::default(),
                keep_writable: false,
                size: Default::default(),
                existing_claim: Default::default(),
                fail_after_unavailable_seconds: None,
            },
            status: None,
        }
    }
}

impl StoragePolicy {
    /// A policy over the `ceph-block` class, two volumes at a time.
    pub fn test(name: &str) -> Self {
        StoragePolicy {
            metadata: metadata(name, None),
            spec: StoragePolicySpec {
                storage_class_names: vec!["ceph-block".to_string()],
                provisioners: Vec::new(),
                max_concurrent_volumes: Some(2),
                max_bytes_per_second: None,
                stage_pod_resources: None,
            },
            status: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup::VolumeCounts;

    #[test]
    fn fixtures_serialise_as_objects_the_api_server_would_hold() {
        let backup = VolumeBackup::test("nightly").with_phase(VolumeBackupPhase::InProgress);
        let json = serde_json::to_value(&backup).expect("serialisable");
        assert_eq!(json["apiVersion"], "haulage.dev/v1alpha1");
        assert_eq!(json["kind"], "VolumeBackup");
        assert_eq!(json["status"]["phase"], "InProgress");
        let location =
            BackupStorageLocation::test("s3").with_phase(BackupStorageLocationPhase::Available);
        assert_eq!(
            serde_json::to_value(&location).expect("serialisable")["spec"]["default"],
            false
        );
        let policy = StoragePolicy::test("ceph");
        assert!(policy.spec.selects("ceph-block", "rbd.csi.ceph.com"));
        assert_eq!(policy.metadata.namespace, None);
    }

    #[test]
    fn transfers_with_phases_count_into_volume_counts() {
        let transfers = [
            VolumeTransfer::test("a", "data").with_phase(VolumeTransferPhase::Completed),
            VolumeTransfer::test("b", "logs").with_phase(VolumeTransferPhase::InProgress),
            VolumeTransfer::test("c", "cache"),
        ];
        let counts = VolumeCounts::from_phases(transfers.iter().map(|transfer| {
            transfer
                .status
                .as_ref()
                .and_then(|status| status.phase)
                .unwrap_or(VolumeTransferPhase::New)
        }));
        assert_eq!(
            (
                counts.total,
                counts.completed,
                counts.in_progress,
                counts.pending
            ),
            (3, 1, 1, 1)
        );
    }
}
