//! Claims across clusters: the record a backup makes of each claim it
//! reads ([`claim_record`], kept in the snapshot), and the destination a
//! restore gives each selected snapshot ([`destination_of`]): namespace,
//! storage class (by name or by provisioner), access modes, volume mode and
//! size, all from the record and the restore's spec — and the complete
//! PersistentVolumeClaim it creates ([`destination_claim`]).

use std::collections::BTreeMap;

use haulage_api::labels::MANAGED_BY_LABEL;
use haulage_api::restore::{SizeChoice, SizePolicy, VolumeRestoreSpec};
use haulage_plan::quantity::{format_bytes, parse_quantity};
use haulage_repo::snapshot::ClaimRecord;
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use crate::stage_pod::Owner;

/// Annotations that belong to the cluster a claim lives in (its binding,
/// its provisioning, kubectl's bookkeeping): left out of a claim's record,
/// so a restored claim is bound and provisioned afresh.
pub const CLUSTER_BOUND_ANNOTATIONS: [&str; 9] = [
    "pv.kubernetes.io/bind-completed",
    "pv.kubernetes.io/bound-by-controller",
    "pv.kubernetes.io/migrated-to",
    "volume.beta.kubernetes.io/storage-provisioner",
    "volume.kubernetes.io/storage-provisioner",
    "volume.kubernetes.io/selected-node",
    "volume.beta.kubernetes.io/storage-class",
    "volume.kubernetes.io/storage-resizer",
    "kubectl.kubernetes.io/last-applied-configuration",
];

/// Label on a claim a restore writes: `incomplete` until its data is
/// written and verified, then `complete`. A half-written claim is never
/// mistaken for a finished one.
pub const RESTORE_STATE_LABEL: &str = "haulage.dev/restore-state";
/// [`RESTORE_STATE_LABEL`] while the claim is being written.
pub const RESTORE_INCOMPLETE: &str = "incomplete";
/// [`RESTORE_STATE_LABEL`] once the claim is verified.
pub const RESTORE_COMPLETE: &str = "complete";
/// Annotation on a restored claim naming the snapshot it holds.
pub const RESTORED_FROM_ANNOTATION: &str = "haulage.dev/restored-from";
/// Annotation on a volume being handed back ReadOnlyMany: its reclaim
/// policy before the hand-back set it to `Retain`.
pub const RECLAIM_POLICY_ANNOTATION: &str = "haulage.dev/reclaim-policy";
/// Headroom added to the bytes in use when a restore sizes by use and its
/// spec gives none.
pub const DEFAULT_HEADROOM_PERCENT: u32 = 20;
/// Smallest claim a restore asks for: provisioners round tiny requests up
/// anyway, and a claim of a few bytes would hold no filesystem.
pub const MIN_CLAIM_BYTES: u64 = 1 << 20;

/// Whether an annotation key belongs to the cluster (or to haulage).
fn is_cluster_bound(key: &str) -> bool {
    CLUSTER_BOUND_ANNOTATIONS.contains(&key) || key.starts_with("haulage.dev/")
}

/// The record of `claim` a backup keeps in its snapshot: everything a
/// destination cluster needs to recreate it, nothing that belongs to this
/// one. `classes` give the provisioner, `backup` is `namespace/name` of the
/// VolumeBackup, `cluster` this cluster's identity.
pub fn claim_record(
    claim: &PersistentVolumeClaim,
    classes: &[&StorageClass],
    backup: &str,
    cluster: Option<&str>,
) -> ClaimRecord {
    let spec = claim.spec.clone().unwrap_or_default();
    let storage_class = spec.storage_class_name.clone();
    let provisioner = storage_class.as_ref().and_then(|name| {
        classes
            .iter()
            .find(|class| class.metadata.name.as_deref() == Some(name.as_str()))
            .map(|class| class.provisioner.clone())
    });
    let requested_bytes = spec
        .resources
        .as_ref()
        .and_then(|resources| resources.requests.as_ref())
        .and_then(|requests| requests.get("storage"))
        .and_then(|quantity| parse_quantity(&quantity.0).ok())
        .unwrap_or(0);
    ClaimRecord {
        namespace: claim.namespace().unwrap_or_default(),
        name: claim.name_any(),
        labels: claim.labels().clone(),
        annotations: claim
            .annotations()
            .iter()
            .filter(|(key, _)| !is_cluster_bound(key))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect(),
        storage_class,
        provisioner,
        access_modes: spec.access_modes.unwrap_or_default(),
        volume_mode: spec.volume_mode,
        requested_bytes,
        used_bytes: None,
        backup: Some(backup.to_string()),
        cluster: cluster.map(str::to_string),
    }
}

/// Where one snapshot goes on the destination cluster, before the
/// existing claims are looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Namespace (after the namespace map).
    pub namespace: String,
    /// Claim name (the source's).
    pub name: String,
    /// Storage class (after the maps); `None`: the cluster's default.
    pub storage_class: Option<String>,
    /// Access modes the claim is created with.
    pub access_modes: Vec<String>,
    /// Access modes it is handed back with once written, when different.
    pub final_access_modes: Vec<String>,
    /// `Filesystem` or `Block`.
    pub volume_mode: Option<String>,
    /// Requested size, bytes.
    pub request_bytes: u64,
}

/// Why a snapshot has no destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    /// The mapped (or kept) storage class does not exist here.
    #[error(
        "storage class {class} (for claim {source_claim}) does not exist on this cluster: create it or map {mapped_from} to an existing class with spec.storageClassMap or spec.provisionerMap"
    )]
    StorageClassNotFound {
        /// The destination class looked for.
        class: String,
        /// The source claim, `namespace/name`.
        source_claim: String,
        /// What was mapped (the source class or provisioner).
        mapped_from: String,
    },
}

/// The destination storage class of a record: `storageClassMap` by the
/// source class's name, then `provisionerMap` by its provisioner, else the
/// same name; `None` (the default class) when the source had none.
fn destination_class(
    record: &ClaimRecord,
    spec: &VolumeRestoreSpec,
) -> (Option<String>, Option<String>) {
    if let Some(class) = &record.storage_class
        && let Some(mapped) = spec.storage_class_map.get(class)
    {
        return (Some(mapped.clone()), Some(class.clone()));
    }
    if let Some(provisioner) = &record.provisioner
        && let Some(mapped) = spec.provisioner_map.get(provisioner)
    {
        return (Some(mapped.clone()), Some(provisioner.clone()));
    }
    (record.storage_class.clone(), record.storage_class.clone())
}

/// The size a destination claim asks for: never smaller than the data
/// (`data_bytes`, the snapshot's file content), rounded up to whole MiB.
pub fn destination_size(record: &ClaimRecord, data_bytes: u64, policy: &SizePolicy) -> u64 {
    let wanted = match policy.policy {
        SizeChoice::Requested => record.requested_bytes,
        SizeChoice::UsedPlusHeadroom => {
            let used = record.used_bytes.unwrap_or(data_bytes).max(data_bytes);
            let headroom = u64::from(policy.headroom_percent.unwrap_or(DEFAULT_HEADROOM_PERCENT));
            used.saturating_add(used.saturating_mul(headroom) / 100)
        }
    };
    let bytes = wanted.max(data_bytes).max(MIN_CLAIM_BYTES);
    bytes.div_ceil(1 << 20).saturating_mul(1 << 20)
}

/// The destination of one snapshot's claim on this cluster, whose storage
/// classes are `classes`. A ReadOnlyMany claim is written through a
/// ReadWriteOnce claim and handed back ReadOnlyMany unless
/// `keepWritable`; ReadWriteMany and ReadWriteOncePod are kept.
pub fn destination_of(
    record: &ClaimRecord,
    data_bytes: u64,
    spec: &VolumeRestoreSpec,
    classes: &[&StorageClass],
) -> Result<Destination, DestinationError> {
    let namespace = spec
        .namespace_map
        .get(&record.namespace)
        .cloned()
        .unwrap_or_else(|| record.namespace.clone());
    let (storage_class, mapped_from) = destination_class(record, spec);
    if let Some(class) = &storage_class
        && !classes
            .iter()
            .any(|known| known.metadata.name.as_deref() == Some(class.as_str()))
    {
        return Err(DestinationError::StorageClassNotFound {
            class: class.clone(),
            source_claim: format!("{}/{}", record.namespace, record.name),
            mapped_from: mapped_from.unwrap_or_else(|| class.clone()),
        });
    }
    let source_modes = if record.access_modes.is_empty() {
        vec!["ReadWriteOnce".to_string()]
    } else {
        record.access_modes.clone()
    };
    let read_only_many = source_modes.iter().all(|mode| mode == "ReadOnlyMany");
    let (access_modes, final_access_modes) = if read_only_many {
        let written = vec!["ReadWriteOnce".to_string()];
        if spec.keep_writable {
            (written, Vec::new())
        } else {
            (written, source_modes)
        }
    } else {
        (source_modes, Vec::new())
    };
    Ok(Destination {
        namespace,
        name: record.name.clone(),
        storage_class,
        access_modes,
        final_access_modes,
        volume_mode: record.volume_mode.clone(),
        request_bytes: destination_size(record, data_bytes, &spec.size),
    })
}

/// The complete claim a restore creates: the source's labels and
/// annotations, the restore's owner labels, `incomplete` until verified,
/// the snapshot it will hold.
pub fn destination_claim(
    destination: &Destination,
    record: &ClaimRecord,
    snapshot_id: &str,
    owner: &Owner,
) -> PersistentVolumeClaim {
    // The owner labels, but not `app.kubernetes.io/managed-by`: the claim
    // is the user's (a Helm release may manage it), haulage only writes it.
    let mut labels = record.labels.clone();
    labels.extend(
        owner
            .labels()
            .into_iter()
            .filter(|(key, _)| key != MANAGED_BY_LABEL),
    );
    labels.insert(
        RESTORE_STATE_LABEL.to_string(),
        RESTORE_INCOMPLETE.to_string(),
    );
    let mut annotations = record.annotations.clone();
    annotations.insert(
        RESTORED_FROM_ANNOTATION.to_string(),
        snapshot_id.to_string(),
    );
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(destination.name.clone()),
            namespace: Some(destination.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(destination.access_modes.clone()),
            storage_class_name: destination.storage_class.clone(),
            volume_mode: destination.volume_mode.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity(format_bytes(destination.request_bytes)),
                )])),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(name: &str, provisioner: &str) -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..ObjectMeta::default()
            },
            provisioner: provisioner.to_string(),
            ..StorageClass::default()
        }
    }

    fn source_claim() -> PersistentVolumeClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db", "namespace": "shop",
                "labels": {"app": "db"},
                "annotations": {
                    "team": "payments",
                    "pv.kubernetes.io/bind-completed": "yes",
                    "volume.kubernetes.io/storage-provisioner": "rook-ceph.rbd.csi.ceph.com",
                    "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                    "haulage.dev/restored-from": "abc"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "ceph-block",
                "volumeMode": "Filesystem",
                "resources": {"requests": {"storage": "10Gi"}}},
        }))
        .expect("claim")
    }

    fn spec() -> VolumeRestoreSpec {
        haulage_api::VolumeRestore::test("move").spec
    }

    #[test]
    fn a_record_keeps_what_recreates_the_claim_and_drops_what_belongs_to_the_cluster() {
        let ceph = class("ceph-block", "rook-ceph.rbd.csi.ceph.com");
        let record = claim_record(
            &source_claim(),
            &[&ceph],
            "haulage-system/nightly",
            Some("cluster-a"),
        );
        assert_eq!(
            (record.namespace.as_str(), record.name.as_str()),
            ("shop", "db")
        );
        assert_eq!(record.labels.get("app").map(String::as_str), Some("db"));
        assert_eq!(
            record.annotations.keys().collect::<Vec<_>>(),
            ["team"],
            "binding, provisioning, kubectl and haulage annotations are left out"
        );
        assert_eq!(
            record.provisioner.as_deref(),
            Some("rook-ceph.rbd.csi.ceph.com")
        );
        assert_eq!(record.requested_bytes, 10 << 30);
        assert_eq!(record.access_modes, ["ReadWriteOnce"]);
        assert_eq!(record.volume_mode.as_deref(), Some("Filesystem"));
        assert_eq!(record.backup.as_deref(), Some("haulage-system/nightly"));
        assert_eq!(record.cluster.as_deref(), Some("cluster-a"));
    }

    fn record() -> ClaimRecord {
        let ceph = class("ceph-block", "rook-ceph.rbd.csi.ceph.com");
        claim_record(&source_claim(), &[&ceph], "haulage-system/nightly", None)
    }

    #[test]
    fn classes_map_by_name_then_by_provisioner_and_a_missing_class_is_refused_by_name() {
        let gp3 = class("gp3", "ebs.csi.aws.com");
        let mut by_name = spec();
        by_name.storage_class_map = [("ceph-block".to_string(), "gp3".to_string())].into();
        let destination = destination_of(&record(), 1, &by_name, &[&gp3]).expect("mapped");
        assert_eq!(destination.storage_class.as_deref(), Some("gp3"));

        let mut by_provisioner = spec();
        by_provisioner.provisioner_map =
            [("rook-ceph.rbd.csi.ceph.com".to_string(), "gp3".to_string())].into();
        let destination = destination_of(&record(), 1, &by_provisioner, &[&gp3]).expect("mapped");
        assert_eq!(destination.storage_class.as_deref(), Some("gp3"));

        let unmapped = destination_of(&record(), 1, &spec(), &[&gp3]).expect_err("no ceph here");
        let message = unmapped.to_string();
        assert!(message.contains("ceph-block"), "{message}");
        assert!(message.contains("shop/db"), "{message}");
        assert!(message.contains("storageClassMap"), "{message}");
    }

    #[test]
    fn namespaces_follow_the_map_and_keep_their_name_otherwise() {
        let ceph = class("ceph-block", "x");
        let mut mapped = spec();
        mapped.namespace_map = [("shop".to_string(), "shop-b".to_string())].into();
        assert_eq!(
            destination_of(&record(), 1, &mapped, &[&ceph])
                .expect("ok")
                .namespace,
            "shop-b"
        );
        assert_eq!(
            destination_of(&record(), 1, &spec(), &[&ceph])
                .expect("ok")
                .namespace,
            "shop"
        );
    }

    #[test]
    fn a_read_only_many_claim_is_written_read_write_once_and_handed_back_unless_kept_writable() {
        let ceph = class("ceph-block", "x");
        let mut read_only = record();
        read_only.access_modes = vec!["ReadOnlyMany".to_string()];
        let destination = destination_of(&read_only, 1, &spec(), &[&ceph]).expect("ok");
        assert_eq!(destination.access_modes, ["ReadWriteOnce"]);
        assert_eq!(destination.final_access_modes, ["ReadOnlyMany"]);
        let mut writable = spec();
        writable.keep_writable = true;
        let kept = destination_of(&read_only, 1, &writable, &[&ceph]).expect("ok");
        assert!(kept.final_access_modes.is_empty());
        for modes in [["ReadWriteMany"], ["ReadWriteOncePod"]] {
            let mut other = record();
            other.access_modes = modes.iter().map(|m| m.to_string()).collect();
            let destination = destination_of(&other, 1, &spec(), &[&ceph]).expect("ok");
            assert_eq!(destination.access_modes, modes);
            assert!(destination.final_access_modes.is_empty());
        }
    }

    #[test]
    fn sizes_follow_the_policy_and_never_fall_below_the_data() {
        let requested = SizePolicy::default();
        assert_eq!(destination_size(&record(), 1 << 30, &requested), 10 << 30);
        assert_eq!(
            destination_size(&record(), 12 << 30, &requested),
            12 << 30,
            "data wins"
        );
        let by_use = SizePolicy {
            policy: SizeChoice::UsedPlusHeadroom,
            headroom_percent: Some(50),
        };
        let mut used = record();
        used.used_bytes = Some(2 << 30);
        assert_eq!(destination_size(&used, 1 << 30, &by_use), 3 << 30);
        assert_eq!(destination_size(&used, 5, &SizePolicy::default()), 10 << 30);
        assert_eq!(
            destination_size(&ClaimRecord::default(), 5, &requested),
            MIN_CLAIM_BYTES
        );
        assert_eq!(
            destination_size(&ClaimRecord::default(), (1 << 20) + 1, &requested),
            2 << 20
        );
    }

    #[test]
    fn the_destination_claim_carries_the_records_metadata_and_is_incomplete_until_verified() {
        let ceph = class("ceph-block", "x");
        let destination = destination_of(&record(), 1, &spec(), &[&ceph]).expect("ok");
        let owner = Owner {
            namespace: "haulage-system".to_string(),
            name: "move".to_string(),
            uid: "uid-move".to_string(),
        };
        let claim = destination_claim(&destination, &record(), "abc123", &owner);
        let labels = claim.labels();
        assert_eq!(labels.get("app").map(String::as_str), Some("db"));
        assert_eq!(
            labels.get(MANAGED_BY_LABEL),
            None,
            "the claim stays the user's"
        );
        assert_eq!(
            labels
                .get(haulage_api::labels::OWNER_UID_LABEL)
                .map(String::as_str),
            Some("uid-move")
        );
        assert_eq!(
            labels.get(RESTORE_STATE_LABEL).map(String::as_str),
            Some(RESTORE_INCOMPLETE)
        );
        assert_eq!(
            claim
                .annotations()
                .get(RESTORED_FROM_ANNOTATION)
                .map(String::as_str),
            Some("abc123")
        );
        let spec = claim.spec.expect("spec");
        assert_eq!(spec.storage_class_name.as_deref(), Some("ceph-block"));
        assert_eq!(
            spec.resources
                .and_then(|resources| resources.requests)
                .and_then(|requests| requests.get("storage").cloned()),
            Some(Quantity("10Gi".to_string()))
        );
        assert_eq!(spec.volume_name, None, "bound afresh by this cluster");
    }
}
