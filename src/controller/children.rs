//! The objects a VolumeBackup's plan needs, as plain values: one
//! VolumeTransfer per claim, and per stage pod the pod itself, the
//! `haulage-agent` ServiceAccount, a Role narrowed to that pod's transfers,
//! its RoleBinding and the name of the credentials copy. Deterministic
//! names and owner labels; nothing here talks to the API server (the
//! reconciler applies what this returns).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::api::backup::PlannedStagePod;
use crate::api::labels::{
    MANAGED_BY, MANAGED_BY_LABEL, OWNER_NAME_LABEL, OWNER_NAMESPACE_LABEL, OWNER_UID_LABEL,
};
use crate::api::location::BackupStorageLocationSpec;
use crate::api::transfer::{OwnerReference, StorageLocationReference};
use crate::api::{TransferDirection, VolumeTransfer, VolumeTransferSpec};
use crate::plan::StagePod;
use crate::plan::facts::NodeFacts;
use crate::plan::spec::{
    CREDENTIALS_PATH, DATA_ROOT, StagePodTemplate, bounded_label_value, build_stage_pod,
    stage_pod_name,
};

/// ServiceAccount the agents run as, one per namespace with stage pods.
pub const AGENT_SERVICE_ACCOUNT: &str = "haulage-agent";
/// Environment variable naming a stage pod's VolumeTransfers (comma-separated).
pub const TRANSFERS_ENV: &str = "HAULAGE_TRANSFERS";
/// Longest readable prefix of a generated object name before its hash.
const NAME_PREFIX_LENGTH: usize = 52;

/// The VolumeBackup the children belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

impl Owner {
    /// The owner labels every child carries; cleanup selects on the UID.
    pub fn labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
            (
                OWNER_NAMESPACE_LABEL.to_string(),
                bounded_label_value(&self.namespace),
            ),
            (
                OWNER_NAME_LABEL.to_string(),
                bounded_label_value(&self.name),
            ),
            (OWNER_UID_LABEL.to_string(), bounded_label_value(&self.uid)),
        ])
    }

    /// A label selector matching exactly this owner's children.
    pub fn selector(&self) -> String {
        format!("{OWNER_UID_LABEL}={}", bounded_label_value(&self.uid))
    }

    fn metadata(&self, name: String, namespace: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(namespace.to_string()),
            labels: Some(self.labels()),
            ..ObjectMeta::default()
        }
    }
}

/// The deterministic name of the VolumeTransfer of one claim: readable
/// `<backup>-<pvc>` cut to fit, then a hash of owner and claim.
pub fn transfer_name(owner: &Owner, namespace: &str, pvc: &str) -> String {
    let digest = blake3::hash(
        [owner.namespace.as_str(), &owner.name, namespace, pvc]
            .join("\0")
            .as_bytes(),
    );
    let readable: String = format!("{}-{pvc}", owner.name)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(NAME_PREFIX_LENGTH)
        .collect();
    format!("{}-{}", readable.trim_matches('-'), &digest.to_hex()[..10])
}

/// Name of the credentials copy a stage pod mounts.
pub fn credentials_copy_name(pod_name: &str) -> String {
    format!("{pod_name}-credentials")
}

/// Where the agent finds the volume of a claim (the stage pod builder's
/// mount path convention).
pub fn volume_mount_path(pvc: &str) -> String {
    format!("{DATA_ROOT}/{pvc}")
}

/// The repository URL of a storage location: `s3://bucket/prefix`.
pub fn repository_url(location: &BackupStorageLocationSpec) -> String {
    match location.prefix.as_deref().map(|p| p.trim_matches('/')) {
        Some(prefix) if !prefix.is_empty() => format!("s3://{}/{prefix}", location.bucket),
        _ => format!("s3://{}", location.bucket),
    }
}

/// Key of the location's `caBundle` in the credentials copy (a name no AWS
/// credentials key uses).
pub const CA_BUNDLE_KEY: &str = "haulage-ca-bundle.pem";

/// The agent's command-line arguments for a stage pod of this location:
/// the agent needs no read access to the BSL, its settings arrive here.
pub fn agent_arguments(location: &BackupStorageLocationSpec) -> Vec<String> {
    let mut arguments = vec![
        "transfers".to_string(),
        "--repo".to_string(),
        repository_url(location),
        "--credentials-file".to_string(),
        format!("{CREDENTIALS_PATH}/{}", location.credential.key),
    ];
    if let Some(endpoint) = &location.endpoint {
        arguments.extend(["--endpoint".to_string(), endpoint.clone()]);
    }
    if let Some(region) = &location.region {
        arguments.extend(["--region".to_string(), region.clone()]);
    }
    if location.s3_force_path_style == Some(true) {
        arguments.push("--path-style".to_string());
    }
    // A private CA travels with the credentials copy, as a file.
    if location.ca_bundle.is_some() {
        arguments.extend([
            "--ca-bundle".to_string(),
            format!("{CREDENTIALS_PATH}/{CA_BUNDLE_KEY}"),
        ]);
    }
    // The location's caps, applied by each agent to its own uploads.
    if let Some(rate) = location.upload_bytes_per_second {
        arguments.extend(["--upload-bytes-per-second".to_string(), rate.to_string()]);
    }
    if let Some(requests) = location.max_concurrent_requests {
        arguments.extend([
            "--max-concurrent-requests".to_string(),
            requests.to_string(),
        ]);
    }
    arguments
}

/// The VolumeTransfer of one claim in a planned stage pod.
/// The transfer carries its stage pod's node (annotation
/// `haulage.dev/node`), so admission counts it against that node's cap
/// even while the pod is being recreated.
pub fn desired_transfer(
    owner: &Owner,
    location: &StorageLocationReference,
    pod_name: &str,
    node: &str,
    namespace: &str,
    pvc: &str,
) -> VolumeTransfer {
    let mut transfer = VolumeTransfer::new(
        &transfer_name(owner, namespace, pvc),
        VolumeTransferSpec {
            direction: TransferDirection::Upload,
            pvc: pvc.to_string(),
            backup_ref: OwnerReference {
                namespace: owner.namespace.clone(),
                name: owner.name.clone(),
                uid: Some(owner.uid.clone()),
            },
            storage_location: location.clone(),
            stage_pod: pod_name.to_string(),
            parent_snapshot: None,
            snapshot: None,
            granted_bytes_per_second: None,
        },
    );
    transfer.metadata.namespace = Some(namespace.to_string());
    transfer.metadata.labels = Some(owner.labels());
    transfer.metadata.annotations = Some(
        [(
            crate::plan::spec::NODE_ANNOTATION.to_string(),
            node.to_string(),
        )]
        .into(),
    );
    transfer
}

/// Everything one stage pod needs besides its transfers.
#[derive(Debug, Clone)]
pub struct StagePodObjects {
    /// The pod, with the agent's arguments and service account.
    pub pod: Pod,
    /// The agents' ServiceAccount in the pod's namespace.
    pub service_account: ServiceAccount,
    /// get/patch on exactly this pod's VolumeTransfers.
    pub role: Role,
    /// Binds [`StagePodObjects::role`] to the ServiceAccount.
    pub role_binding: RoleBinding,
    /// Name of the credentials copy the pod mounts.
    pub credentials_secret: String,
    /// Names of the pod's VolumeTransfers.
    pub transfers: Vec<String>,
}

/// Build the objects of one planned stage pod.
pub fn desired_stage_pod(
    owner: &Owner,
    template: &StagePodTemplate,
    planned: &PlannedStagePod,
    node: Option<&NodeFacts>,
    location: &BackupStorageLocationSpec,
) -> StagePodObjects {
    let stage = StagePod {
        namespace: planned.namespace.clone(),
        node: planned.node.clone(),
        volumes: planned.volumes.clone(),
        bytes: u64::try_from(planned.bytes).unwrap_or(0),
    };
    let pod_name = stage_pod_name(template, &stage);
    let credentials_secret = credentials_copy_name(&pod_name);
    let mut template = template.clone();
    template.credentials_secret = Some(credentials_secret.clone());
    template.service_account = Some(AGENT_SERVICE_ACCOUNT.to_string());
    let mut pod = build_stage_pod(&template, &stage, node, None);
    let mut labels = pod.metadata.labels.take().unwrap_or_default();
    labels.extend(owner.labels());
    pod.metadata.labels = Some(labels);
    let transfers: Vec<String> = planned
        .volumes
        .iter()
        .map(|pvc| transfer_name(owner, &planned.namespace, pvc))
        .collect();
    if let Some(container) = pod
        .spec
        .as_mut()
        .and_then(|spec| spec.containers.first_mut())
    {
        container.args = Some(agent_arguments(location));
        // The agent's Role is narrowed by resourceNames, which does not
        // authorize a list by field selector: it gets each of its
        // transfers by name instead.
        container
            .env
            .get_or_insert_with(Vec::new)
            .push(k8s_openapi::api::core::v1::EnvVar {
                name: TRANSFERS_ENV.to_string(),
                value: Some(transfers.join(",")),
                ..Default::default()
            });
        container.termination_message_policy = Some("FallbackToLogsOnError".to_string());
    }
    let namespace = planned.namespace.as_str();
    let service_account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(AGENT_SERVICE_ACCOUNT.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([(
                MANAGED_BY_LABEL.to_string(),
                MANAGED_BY.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    let rule = |resource: &str, verbs: &[&str]| PolicyRule {
        api_groups: Some(vec![crate::api::GROUP.to_string()]),
        resources: Some(vec![resource.to_string()]),
        resource_names: Some(transfers.clone()),
        verbs: verbs.iter().map(|verb| verb.to_string()).collect(),
        ..PolicyRule::default()
    };
    let role = Role {
        metadata: owner.metadata(pod_name.clone(), namespace),
        rules: Some(vec![
            rule("volumetransfers", &["get", "list", "watch"]),
            rule("volumetransfers/status", &["get", "update", "patch"]),
        ]),
    };
    let role_binding = RoleBinding {
        metadata: owner.metadata(pod_name.clone(), namespace),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".to_string(),
            kind: "Role".to_string(),
            name: pod_name,
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_string(),
            name: AGENT_SERVICE_ACCOUNT.to_string(),
            namespace: Some(namespace.to_string()),
            ..Subject::default()
        }]),
    };
    StagePodObjects {
        pod,
        service_account,
        role,
        role_binding,
        credentials_secret,
        transfers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::spec::Operation;

    fn owner() -> Owner {
        Owner {
            namespace: "haulage-system".to_string(),
            name: "nightly".to_string(),
            uid: "0b5c4c58-2f44-4c5e-9a43-6bde6bb9a3a1".to_string(),
        }
    }

    fn location() -> BackupStorageLocationSpec {
        serde_yaml::from_str(
            "bucket: backups\nprefix: /team/\nendpoint: http://127.0.0.1:9000\nregion: us-east-1\n\
             s3ForcePathStyle: true\ncredential: {name: s3, key: cloud}\nuploadBytesPerSecond: 1048576\n",
        )
        .expect("valid spec")
    }

    #[test]
    fn transfer_names_are_deterministic_valid_and_distinct() {
        let a = transfer_name(&owner(), "shop", "data");
        assert_eq!(a, transfer_name(&owner(), "shop", "data"));
        assert_ne!(a, transfer_name(&owner(), "web", "data"));
        assert!(a.starts_with("nightly-data-"));
        let long = transfer_name(&owner(), "shop", &"x".repeat(250));
        assert!(long.len() <= 63, "{long}");
        assert!(
            long.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }

    #[test]
    fn a_location_with_a_private_ca_gives_the_agent_its_bundle_as_a_file() {
        let mut spec = location();
        spec.ca_bundle = Some("-----BEGIN CERTIFICATE-----\n...".to_string());
        let arguments = agent_arguments(&spec);
        let at = arguments
            .iter()
            .position(|argument| argument == "--ca-bundle")
            .expect("--ca-bundle passed");
        assert_eq!(arguments[at + 1], format!("/credentials/{CA_BUNDLE_KEY}"));
        assert!(!agent_arguments(&location()).contains(&"--ca-bundle".to_string()));
    }

    #[test]
    fn the_agent_gets_the_location_as_arguments_and_a_credentials_file_path() {
        let arguments = agent_arguments(&location());
        assert_eq!(
            arguments,
            [
                "transfers",
                "--repo",
                "s3://backups/team",
                "--credentials-file",
                "/credentials/cloud",
                "--endpoint",
                "http://127.0.0.1:9000",
                "--region",
                "us-east-1",
                "--path-style",
                "--upload-bytes-per-second",
                "1048576"
            ]
        );
    }

    #[test]
    fn the_agent_role_is_narrowed_to_the_pods_transfers() {
        let template = StagePodTemplate::new(
            Operation::Backup,
            "haulage-system",
            "nightly",
            "haulage:dev",
        );
        let planned = PlannedStagePod {
            namespace: "shop".to_string(),
            node: "node-a".to_string(),
            pod_name: None,
            volumes: vec!["a".to_string(), "b".to_string()],
            bytes: 1,
        };
        let objects = desired_stage_pod(&owner(), &template, &planned, None, &location());
        let rules = objects.role.rules.clone().unwrap_or_default();
        assert_eq!(rules.len(), 2);
        for rule in &rules {
            assert_eq!(rule.resource_names.as_deref(), Some(&objects.transfers[..]));
            assert!(
                !rule
                    .verbs
                    .iter()
                    .any(|verb| verb == "create" || verb == "delete")
            );
        }
        let labels = objects.pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get(OWNER_UID_LABEL).map(String::as_str),
            Some(owner().uid.as_str())
        );
        let spec = objects.pod.spec.clone().expect("pod spec");
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some(AGENT_SERVICE_ACCOUNT)
        );
        let mounts_credentials = spec.volumes.unwrap_or_default().iter().any(|volume| {
            volume
                .projected
                .as_ref()
                .and_then(|projected| projected.sources.as_ref())
                .is_some_and(|sources| {
                    sources.iter().any(|source| {
                        source.secret.as_ref().map(|secret| secret.name.as_str())
                            == Some(objects.credentials_secret.as_str())
                    })
                })
        });
        assert!(mounts_credentials);
    }
}
