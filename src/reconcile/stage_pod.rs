//! The desired objects of one stage pod, built complete in one place from
//! the plan entry ([`StagePod`], the planner's value unchanged) and what
//! every stage pod of the same backup or restore shares
//! ([`StagePodTemplate`]): the Pod, its VolumeTransfers, the agents'
//! ServiceAccount, a Role narrowed to the pod's transfers, its RoleBinding
//! and the copy of the storage credentials. No I/O: the controller applies
//! what [`desired_stage_pod`] returns, in the order [`StagePodObjects`]
//! documents, and edits nothing.
//!
//! The pod is pinned to its node, mounts every claim of its entry
//! (read-only for backup, read-write for restore), requests little, never
//! sets `fsGroup` (the kubelet would re-own every file of the user's
//! volume) and runs with the least privilege that can read (backup) or
//! faithfully write (restore) arbitrary files: see DESIGN.md "Security".

use std::collections::BTreeMap;

use haulage_api::labels::{
    BACKUP_LABEL, CREDENTIALS_COPY_LABEL, MANAGED_BY, MANAGED_BY_LABEL, NODE_ANNOTATION,
    NODE_LABEL, OPERATION_LABEL, OWNER_ANNOTATION, OWNER_NAME_LABEL, OWNER_NAMESPACE_LABEL,
    OWNER_UID_LABEL, RESTORE_LABEL,
};
use haulage_api::location::BackupStorageLocationSpec;
use haulage_api::names::{MAX_LABEL_LENGTH, bounded_label_value, hashed_dns_label};
use haulage_api::transfer::{AgentMemory, OwnerReference, StorageLocationReference};
use haulage_api::{TransferDirection, VolumeTransfer, VolumeTransferSpec};
use haulage_plan::StagePod;
use haulage_plan::facts::{NodeFacts, ResourceMinimum, TaintEffect};
use haulage_plan::quantity::{format_bytes, format_millis};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PersistentVolumeClaimVolumeSource, Pod, PodSecurityContext, PodSpec, ProjectedVolumeSource,
    ResourceFieldSelector, ResourceRequirements, SeccompProfile, Secret, SecretProjection,
    SecurityContext, ServiceAccount, Toleration, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{self as meta, ObjectMeta};
use kube::ResourceExt;

/// CPU a stage pod requests unless a LimitRange or StoragePolicy says
/// otherwise.
pub const DEFAULT_CPU_REQUEST_MILLIS: u64 = 100;
/// Memory a stage pod requests (and is limited to) unless a LimitRange or
/// StoragePolicy says otherwise; the agent is built to fit it.
pub const DEFAULT_MEMORY_REQUEST_BYTES: u64 = 128 << 20;
/// The variable that gives the agent its memory budget, in bytes: the
/// container's memory request, through the downward API.
pub const MEMORY_BUDGET_ENV: &str = "HAULAGE_MEMORY_BUDGET";
/// The variable that gives the agent the bytes of its repository's index
/// files, from the location's status: the agent and admission plan its
/// volumes with the same figure ([`AgentMemory`]).
pub const INDEX_BYTES_ENV: &str = "HAULAGE_INDEX_BYTES";
/// The stage pod's memory limit, as a multiple of its request.
pub const MEMORY_LIMIT_FACTOR: u64 = 2;
/// Where each claim is mounted: `/data/<claim name>`.
pub const DATA_ROOT: &str = "/data";
/// Where the agent's scratch space (an emptyDir) is mounted; the root
/// filesystem is read-only.
pub const SCRATCH_PATH: &str = "/scratch";
/// Most the scratch space may hold (its emptyDir's `sizeLimit`): the agent
/// keeps nothing there but temporary files of its libraries, and the
/// kubelet evicts a pod whose emptyDir outgrows its limit rather than let
/// it fill the node's disk.
pub const SCRATCH_SIZE_LIMIT: &str = "1Gi";
/// Where the storage credentials are mounted.
pub const CREDENTIALS_PATH: &str = "/credentials";
/// Grace period for the agent to abort in-flight uploads and checkpoint.
pub const TERMINATION_GRACE_PERIOD_SECONDS: i64 = 60;
/// Port of the agent's `/metrics` (container port `metrics`; the agent's
/// `--metrics-address` default).
pub const AGENT_METRICS_PORT: u16 = 9090;
/// Name of the agent's metrics container port (what a PodMonitor selects).
pub const AGENT_METRICS_PORT_NAME: &str = "metrics";
/// Name of the stage pod's one container, the mover agent.
pub const AGENT_CONTAINER: &str = "agent";
/// ServiceAccount the agents run as, one per namespace with stage pods.
pub const AGENT_SERVICE_ACCOUNT: &str = "haulage-agent";
/// Environment variable naming a stage pod's VolumeTransfers (comma-separated).
pub const TRANSFERS_ENV: &str = "HAULAGE_TRANSFERS";
/// Key of the location's `caBundle` in the credentials copy (a name no AWS
/// credentials key uses).
pub const CA_BUNDLE_KEY: &str = "haulage-ca-bundle.pem";
/// Key of the credentials copy holding the repository's password, for a
/// location with `spec.encryption` (the agent reads it with
/// `--password-file`).
pub const PASSWORD_KEY: &str = "haulage-repository-password";

/// The data of a stage pod's credentials copy: the location's credentials
/// file under its key, its CA bundle and, for an encrypted location, the
/// repository's password (the one place this is put together, for
/// backups and restores alike).
pub fn credentials_copy(
    location: &BackupStorageLocationSpec,
    credentials: ByteString,
    password: Option<ByteString>,
) -> BTreeMap<String, ByteString> {
    let mut data = BTreeMap::from([(location.credential.key.clone(), credentials)]);
    if let Some(pem) = &location.ca_bundle {
        data.insert(
            CA_BUNDLE_KEY.to_string(),
            ByteString(pem.clone().into_bytes()),
        );
    }
    if let (Some(_), Some(password)) = (&location.encryption, password) {
        data.insert(PASSWORD_KEY.to_string(), password);
    }
    data
}
/// Longest readable prefix of a VolumeTransfer name before its hash.
const TRANSFER_NAME_PREFIX_LENGTH: usize = 52;

/// Whether the stage pod reads (backup) or writes (restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Read the claims into the repository.
    Backup,
    /// Write snapshots into the claims.
    Restore,
}

impl Operation {
    /// Lowercase name, as used in names and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Backup => "backup",
            Operation::Restore => "restore",
        }
    }

    /// The direction of this operation's VolumeTransfers.
    pub fn direction(self) -> TransferDirection {
        match self {
            Operation::Backup => TransferDirection::Upload,
            Operation::Restore => TransferDirection::Download,
        }
    }
}

/// Who the backup agent runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackupIdentity {
    /// uid 0 with only `DAC_OVERRIDE`: reads every file, stays within the
    /// Baseline pod security level.
    Root,
    /// A non-root uid with no capabilities, for namespaces that forbid
    /// root; files it cannot read become warnings.
    NonRoot {
        /// The uid (and gid) to run as.
        user_id: i64,
    },
}

/// How the pod is tied to its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pinning {
    /// Required node affinity on `metadata.name`: the scheduler still
    /// checks resources and provisions WaitForFirstConsumer volumes.
    RequiredNodeAffinity,
    /// `spec.nodeName`: bypasses the scheduler entirely (never for
    /// WaitForFirstConsumer restores, whose claims would stay Pending).
    NodeName,
}

/// Resource requests; `None` fields fall back to the defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceOverride {
    /// CPU request in millicores.
    pub cpu_millis: Option<u64>,
    /// Memory request (and limit) in bytes.
    pub memory_bytes: Option<u64>,
}

/// The VolumeBackup or VolumeRestore a stage pod's objects belong to.
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
    /// The owner of `object`'s children (a VolumeBackup or VolumeRestore),
    /// or the first of its namespace, name and UID it lacks.
    pub fn of(object: &impl kube::Resource) -> Result<Owner, &'static str> {
        let meta = object.meta();
        Ok(Owner {
            namespace: meta.namespace.clone().ok_or("metadata.namespace")?,
            name: meta.name.clone().ok_or("metadata.name")?,
            uid: meta.uid.clone().ok_or("metadata.uid")?,
        })
    }

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

/// The storage location the agents of a stage pod talk to.
#[derive(Debug, Clone, PartialEq)]
pub struct LocationSettings {
    /// Where the BackupStorageLocation is (recorded on each transfer).
    pub reference: StorageLocationReference,
    /// Its spec (bucket, endpoint, caps: the agent's arguments).
    pub spec: BackupStorageLocationSpec,
    /// The bytes of its repository's index files at its last probe
    /// (`status.indexBytes`; 0 before the first): the agents' memory plan
    /// counts the index they load by them.
    pub index_file_bytes: u64,
}

impl LocationSettings {
    /// The settings of `location`, as its spec and status say now.
    pub fn of(location: &haulage_api::BackupStorageLocation) -> Self {
        LocationSettings {
            reference: StorageLocationReference {
                namespace: location.namespace().unwrap_or_default(),
                name: location.name_any(),
            },
            spec: location.spec.clone(),
            index_file_bytes: location
                .status
                .as_ref()
                .and_then(|status| status.index_bytes)
                .map_or(0, |bytes| u64::try_from(bytes).unwrap_or(0)),
        }
    }
}

/// What every stage pod of one backup or restore shares.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePodTemplate {
    /// Backup or restore.
    pub operation: Operation,
    /// The VolumeBackup / VolumeRestore.
    pub owner: Owner,
    /// Agent image.
    pub image: String,
    /// Backup identity (ignored for restore, which runs as root with the
    /// capabilities writing owners and modes needs).
    pub backup_identity: BackupIdentity,
    /// How the pod is pinned to its node.
    pub pinning: Pinning,
    /// The storage location.
    pub location: LocationSettings,
    /// The owner's `failAfterUnavailableSeconds`: the agent fails a volume
    /// once the location has not answered this long, and waits as long as
    /// it takes without it.
    pub fail_after_unavailable_seconds: Option<i64>,
    /// Seconds between two checkpoints of a backup (the controller's
    /// `--checkpoint-seconds`; `None`: the agent's default).
    pub checkpoint_seconds: Option<u32>,
}

impl StagePodTemplate {
    /// A template with root backup identity, node-affinity pinning and
    /// default resources.
    pub fn new(
        operation: Operation,
        owner: Owner,
        image: impl Into<String>,
        location: LocationSettings,
    ) -> Self {
        StagePodTemplate {
            operation,
            owner,
            image: image.into(),
            backup_identity: BackupIdentity::Root,
            pinning: Pinning::RequiredNodeAffinity,
            location,
            fail_after_unavailable_seconds: None,
            checkpoint_seconds: None,
        }
    }

    /// The agent's arguments in this template's stage pods: the location's
    /// ([`agent_arguments`]), how long the agent waits for it and how
    /// often a backup writes its checkpoint.
    pub fn agent_arguments(&self) -> Vec<String> {
        let mut arguments = agent_arguments(&self.location.spec);
        if let Some(seconds) = self.fail_after_unavailable_seconds {
            arguments.extend([
                "--fail-after-unavailable-seconds".to_string(),
                seconds.max(0).to_string(),
            ]);
        }
        if let Some(seconds) = self.checkpoint_seconds {
            arguments.extend(["--checkpoint-seconds".to_string(), seconds.to_string()]);
        }
        arguments
    }
}

impl ResourceOverride {
    /// The requests of a StoragePolicy's `stagePodResources` (CPU and
    /// memory; what cannot be read is left to the defaults).
    pub fn from_requirements(
        requirements: &k8s_openapi::api::core::v1::ResourceRequirements,
    ) -> Self {
        let requests = requirements.requests.clone().unwrap_or_default();
        ResourceOverride {
            cpu_millis: requests
                .get("cpu")
                .and_then(|quantity| haulage_plan::quantity::parse_millis(&quantity.0).ok()),
            memory_bytes: requests
                .get("memory")
                .and_then(|quantity| haulage_plan::quantity::parse_quantity(&quantity.0).ok()),
        }
    }

    /// The larger of two overrides, field by field (a stage pod whose
    /// claims fall under several policies gets what the largest asks).
    pub fn max(self, other: ResourceOverride) -> ResourceOverride {
        ResourceOverride {
            cpu_millis: self.cpu_millis.max(other.cpu_millis),
            memory_bytes: self.memory_bytes.max(other.memory_bytes),
        }
    }
}

/// The requests the StoragePolicies selecting the claims' classes set for
/// a stage pod: `classes` are the (class name, provisioner) of its claims.
pub fn resources_for(
    policies: &[&haulage_api::StoragePolicy],
    classes: &[(String, String)],
) -> ResourceOverride {
    policies
        .iter()
        .filter(|policy| {
            classes
                .iter()
                .any(|(class, provisioner)| policy.spec.selects(class, provisioner))
        })
        .filter_map(|policy| policy.spec.stage_pod_resources.as_ref())
        .map(ResourceOverride::from_requirements)
        .fold(ResourceOverride::default(), ResourceOverride::max)
}

/// The requests a stage pod gets: the StoragePolicy's override or the
/// default, raised to the namespace's LimitRange minimum (a pod below it
/// would be refused at admission), and its memory to what one volume
/// needs beside the repository's index (`index_file_bytes` of index
/// files; [`AgentMemory::least_budget_bytes`]), so that the agent's peak
/// stays under its request however large the repository.
pub fn effective_requests(
    resources: ResourceOverride,
    minimum: Option<ResourceMinimum>,
    index_file_bytes: u64,
) -> (u64, u64) {
    let minimum = minimum.unwrap_or_default();
    let cpu = resources
        .cpu_millis
        .unwrap_or(DEFAULT_CPU_REQUEST_MILLIS)
        .max(minimum.cpu_millis.unwrap_or(0));
    let memory = resources
        .memory_bytes
        .unwrap_or(DEFAULT_MEMORY_REQUEST_BYTES)
        .max(minimum.memory_bytes.unwrap_or(0))
        .max(AgentMemory::least_budget_bytes(index_file_bytes));
    (cpu, memory)
}

/// The planner's plan as a VolumeBackup's or VolumeRestore's status holds
/// it: each stage pod unchanged, with its name; each unplaceable claim with
/// its reason.
pub fn status_plan(
    operation: Operation,
    owner: &Owner,
    plan: haulage_plan::StagePlan,
) -> haulage_api::backup::BackupPlan {
    haulage_api::backup::BackupPlan {
        stage_pods: plan
            .stage_pods
            .into_iter()
            .map(|stage| haulage_api::backup::PlannedStagePod {
                pod_name: stage_pod_name(operation, owner, &stage),
                stage,
            })
            .collect(),
        unplaceable: plan
            .unplaceable
            .iter()
            .map(|claim| haulage_api::backup::UnplaceableVolume {
                namespace: claim.namespace.clone(),
                pvc: claim.pvc.clone(),
                reason: haulage_api::condition::bounded_message(&claim.reason.to_string()),
            })
            .collect(),
    }
}

/// The deterministic name of a stage pod: `haulage-<operation>-<owner>-
/// <node>` cut to fit, then a hash of everything that identifies the pod,
/// so the name is unique, a valid DNS label of at most 63 characters.
pub fn stage_pod_name(operation: Operation, owner: &Owner, stage: &StagePod) -> String {
    let operation = operation.as_str();
    hashed_dns_label(
        &format!("haulage-{operation}-{}-{}", owner.name, stage.node),
        &[
            operation,
            &owner.namespace,
            &owner.name,
            &stage.namespace,
            &stage.node,
        ],
        MAX_LABEL_LENGTH,
    )
}

/// The deterministic name of the VolumeTransfer of one claim: readable
/// `<owner>-<pvc>` cut to fit, then a hash of owner and claim.
pub fn transfer_name(owner: &Owner, namespace: &str, pvc: &str) -> String {
    hashed_dns_label(
        &format!("{}-{pvc}", owner.name),
        &[&owner.namespace, &owner.name, namespace, pvc],
        TRANSFER_NAME_PREFIX_LENGTH + 11,
    )
}

/// Name of the credentials copy a stage pod mounts.
pub fn credentials_copy_name(pod_name: &str) -> String {
    format!("{pod_name}-credentials")
}

/// Where the agent finds the volume of a claim.
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
    // An encrypted location's password travels the same way.
    if location.encryption.is_some() {
        arguments.extend([
            "--password-file".to_string(),
            format!("{CREDENTIALS_PATH}/{PASSWORD_KEY}"),
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

/// The labels every stage pod of this template carries; select with them
/// to find a backup's or restore's pods.
pub fn stage_pod_labels(template: &StagePodTemplate, stage: &StagePod) -> BTreeMap<String, String> {
    let owner_label = match template.operation {
        Operation::Backup => BACKUP_LABEL,
        Operation::Restore => RESTORE_LABEL,
    };
    let mut labels: BTreeMap<String, String> = haulage_plan::facts::STAGE_POD_LABELS
        .iter()
        .map(|(label, value)| (label.to_string(), value.to_string()))
        .collect();
    labels.extend([
        (
            OPERATION_LABEL.to_string(),
            template.operation.as_str().to_string(),
        ),
        (
            owner_label.to_string(),
            bounded_label_value(&template.owner.name),
        ),
        (NODE_LABEL.to_string(), bounded_label_value(&stage.node)),
    ]);
    labels.extend(template.owner.labels());
    labels
}

/// Everything one stage pod needs, complete. The controller applies them
/// in this order: ServiceAccount, Role, RoleBinding, the credentials copy
/// ([`StagePodObjects::credentials_owned_by`] the Role just applied), the
/// transfers, then the pod (so a pod in the cache means the rest exists).
#[derive(Debug, Clone)]
pub struct StagePodObjects {
    /// The agents' ServiceAccount in the pod's namespace.
    pub service_account: ServiceAccount,
    /// get/watch/patch on exactly this pod's VolumeTransfers.
    pub role: Role,
    /// Binds [`StagePodObjects::role`] to the ServiceAccount.
    pub role_binding: RoleBinding,
    /// The copy of the location's credentials the pod mounts (its owner
    /// reference is added by [`StagePodObjects::credentials_owned_by`]).
    pub credentials: Secret,
    /// One VolumeTransfer per claim of the pod.
    pub transfers: Vec<VolumeTransfer>,
    /// The pod.
    pub pod: Pod,
}

impl StagePodObjects {
    /// The credentials copy owned by the pod's Role, whose UID the API
    /// server assigns when the Role is created: the copy then goes with
    /// the Role even if the controller is gone (the controller may not
    /// patch Secrets to add an owner later, and the copy must exist before
    /// the pod that mounts it).
    pub fn credentials_owned_by(&self, role_uid: &str) -> Secret {
        let mut secret = self.credentials.clone();
        secret.metadata.owner_references = Some(vec![meta::OwnerReference {
            api_version: "rbac.authorization.k8s.io/v1".to_string(),
            kind: "Role".to_string(),
            name: self.role.metadata.name.clone().unwrap_or_default(),
            uid: role_uid.to_string(),
            ..meta::OwnerReference::default()
        }]);
        secret
    }

    /// Name of the pod.
    pub fn pod_name(&self) -> &str {
        self.pod.metadata.name.as_deref().unwrap_or_default()
    }
}

/// What one volume's transfer carries besides its claim's name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransferDetails {
    /// Download: the snapshot to restore.
    pub snapshot: Option<String>,
    /// Download into a claim holding an earlier restore: its snapshot.
    pub since_snapshot: Option<String>,
    /// Upload: the claim's record, for the snapshot.
    pub claim: Option<haulage_repo::snapshot::ClaimRecord>,
    /// Upload: whether every file is read again.
    pub parent_policy: haulage_api::backup::ParentPolicy,
    /// Upload: the snapshot's tags.
    pub tags: BTreeMap<String, String>,
    /// Upload: measure instead of back up.
    pub benchmark: Option<haulage_api::benchmark::BenchmarkRequest>,
}

/// The VolumeTransfer of one claim in a stage pod. It carries its stage
/// pod's node (annotation `haulage.dev/node`), so admission counts it
/// against that node's cap even while the pod is being recreated.
fn desired_transfer(
    template: &StagePodTemplate,
    stage: &StagePod,
    pod_name: &str,
    pvc: &str,
    details: TransferDetails,
) -> VolumeTransfer {
    let owner = &template.owner;
    let mut transfer = VolumeTransfer::new(
        &transfer_name(owner, &stage.namespace, pvc),
        VolumeTransferSpec {
            direction: template.operation.direction(),
            pvc: pvc.to_string(),
            backup_ref: OwnerReference {
                namespace: owner.namespace.clone(),
                name: owner.name.clone(),
                uid: Some(owner.uid.clone()),
            },
            storage_location: template.location.reference.clone(),
            stage_pod: pod_name.to_string(),
            parent_snapshot: None,
            snapshot: details.snapshot,
            since_snapshot: details.since_snapshot,
            granted_bytes_per_second: None,
            claim: details.claim,
            parent_policy: details.parent_policy,
            tags: details.tags,
            benchmark: details.benchmark,
        },
    );
    transfer.metadata.namespace = Some(stage.namespace.clone());
    transfer.metadata.labels = Some(owner.labels());
    transfer.metadata.annotations =
        Some([(NODE_ANNOTATION.to_string(), stage.node.clone())].into());
    transfer
}

/// What one stage pod is built from besides its template and plan entry.
#[derive(Debug, Clone, Default)]
pub struct StagePodInputs<'a> {
    /// The node's facts when known (for tolerations).
    pub node: Option<&'a NodeFacts>,
    /// The namespace's LimitRange minimum.
    pub minimum: Option<ResourceMinimum>,
    /// Requests set by the StoragePolicies of the pod's claims
    /// ([`resources_for`]).
    pub resources: ResourceOverride,
    /// The keys of the location's Secret to copy (the AWS credentials
    /// file, and the CA bundle when the location has one).
    pub credentials: BTreeMap<String, ByteString>,
    /// Per claim name: what its transfer carries.
    pub volumes: BTreeMap<String, TransferDetails>,
}

/// Build every object of one planned stage pod.
pub fn desired_stage_pod(
    template: &StagePodTemplate,
    stage: &StagePod,
    inputs: StagePodInputs<'_>,
) -> StagePodObjects {
    let StagePodInputs {
        node,
        minimum,
        resources,
        credentials,
        mut volumes,
    } = inputs;
    let pod_name = stage_pod_name(template.operation, &template.owner, stage);
    let namespace = stage.namespace.as_str();
    let owner = &template.owner;
    let transfers: Vec<VolumeTransfer> = stage
        .volumes
        .iter()
        .map(|pvc| {
            let details = volumes.remove(pvc).unwrap_or_default();
            desired_transfer(template, stage, &pod_name, pvc, details)
        })
        .collect();
    let transfer_names: Vec<String> = transfers
        .iter()
        .filter_map(|transfer| transfer.metadata.name.clone())
        .collect();
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
        api_groups: Some(vec![haulage_api::GROUP.to_string()]),
        resources: Some(vec![resource.to_string()]),
        resource_names: Some(transfer_names.clone()),
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
            name: pod_name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_string(),
            name: AGENT_SERVICE_ACCOUNT.to_string(),
            namespace: Some(namespace.to_string()),
            ..Subject::default()
        }]),
    };
    let mut credentials_labels = owner.labels();
    credentials_labels.insert(CREDENTIALS_COPY_LABEL.to_string(), "true".to_string());
    let credentials_secret = credentials_copy_name(&pod_name);
    let credentials = Secret {
        metadata: ObjectMeta {
            name: Some(credentials_secret.clone()),
            namespace: Some(namespace.to_string()),
            labels: Some(credentials_labels),
            ..ObjectMeta::default()
        },
        data: Some(credentials),
        ..Secret::default()
    };
    let pod = build_pod(
        template,
        stage,
        &PodParts {
            name: &pod_name,
            credentials_secret: &credentials_secret,
            transfers: &transfer_names,
            node,
            minimum,
            resources,
        },
    );
    StagePodObjects {
        service_account,
        role,
        role_binding,
        credentials,
        transfers,
        pod,
    }
}

/// What the pod of a stage pod is built from besides its template.
struct PodParts<'a> {
    name: &'a str,
    credentials_secret: &'a str,
    transfers: &'a [String],
    node: Option<&'a NodeFacts>,
    minimum: Option<ResourceMinimum>,
    resources: ResourceOverride,
}

/// The pod of one stage pod.
///
/// A stage pod placed on a cordoned or NoSchedule-tainted node (for
/// volumes already attached there) tolerates exactly those NoSchedule
/// taints; it never tolerates NoExecute.
fn build_pod(template: &StagePodTemplate, stage: &StagePod, parts: &PodParts<'_>) -> Pod {
    let read_only = template.operation == Operation::Backup;
    let mut volumes = Vec::with_capacity(stage.volumes.len() + 1);
    let mut mounts = Vec::with_capacity(stage.volumes.len() + 1);
    for (index, claim) in stage.volumes.iter().enumerate() {
        let volume_name = format!("claim-{index}");
        volumes.push(Volume {
            name: volume_name.clone(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: Some(read_only),
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: volume_name,
            mount_path: format!("{DATA_ROOT}/{claim}"),
            read_only: Some(read_only),
            ..VolumeMount::default()
        });
    }
    volumes.push(Volume {
        name: "scratch".to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity(SCRATCH_SIZE_LIMIT.to_string())),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    });
    mounts.push(VolumeMount {
        name: "scratch".to_string(),
        mount_path: SCRATCH_PATH.to_string(),
        ..VolumeMount::default()
    });
    {
        let secret = parts.credentials_secret;
        // Owner-only for root; a non-root agent cannot read a root-owned
        // 0400 file and there is no fsGroup to lend it the group.
        let mode = match (template.operation, template.backup_identity) {
            (Operation::Backup, BackupIdentity::NonRoot { .. }) => 0o444,
            _ => 0o400,
        };
        volumes.push(Volume {
            name: "credentials".to_string(),
            projected: Some(ProjectedVolumeSource {
                default_mode: Some(mode),
                sources: Some(vec![VolumeProjection {
                    secret: Some(SecretProjection {
                        name: secret.to_string(),
                        optional: Some(false),
                        ..SecretProjection::default()
                    }),
                    ..VolumeProjection::default()
                }]),
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "credentials".to_string(),
            mount_path: CREDENTIALS_PATH.to_string(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }

    let (cpu_millis, memory_bytes) = effective_requests(
        parts.resources,
        parts.minimum,
        template.location.index_file_bytes,
    );
    let memory = Quantity(format_bytes(memory_bytes));
    let resources = ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(format_millis(cpu_millis))),
            ("memory".to_string(), memory),
        ])),
        // A memory limit keeps a misbehaving agent from squeezing the user's
        // workloads on the same node; it is twice the request, since one
        // volume's engine peaks at 110–128 MiB on large claims (measured,
        // docs/benchmarks.md) and an OOM kill at the request would restart
        // the copy. No CPU limit: throttling only slows the copy.
        limits: Some(BTreeMap::from([(
            "memory".to_string(),
            Quantity(format_bytes(
                memory_bytes.saturating_mul(MEMORY_LIMIT_FACTOR),
            )),
        )])),
        ..ResourceRequirements::default()
    };

    let (run_as_user, run_as_non_root, added_capabilities): (i64, bool, &[&str]) =
        match (template.operation, template.backup_identity) {
            (Operation::Backup, BackupIdentity::Root) => (0, false, &["DAC_OVERRIDE"]),
            (Operation::Backup, BackupIdentity::NonRoot { user_id }) => (user_id, true, &[]),
            (Operation::Restore, _) => (0, false, &["CHOWN", "FOWNER", "DAC_OVERRIDE", "FSETID"]),
        };
    let runtime_default = SeccompProfile {
        type_: "RuntimeDefault".to_string(),
        ..SeccompProfile::default()
    };
    let security_context = SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_user: Some(run_as_user),
        run_as_group: Some(run_as_user),
        run_as_non_root: Some(run_as_non_root),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            add: (!added_capabilities.is_empty())
                .then(|| added_capabilities.iter().map(|c| c.to_string()).collect()),
        }),
        seccomp_profile: Some(runtime_default.clone()),
        ..SecurityContext::default()
    };

    let field_reference = |path: &str| EnvVarSource {
        field_ref: Some(ObjectFieldSelector {
            field_path: path.to_string(),
            ..ObjectFieldSelector::default()
        }),
        ..EnvVarSource::default()
    };
    let environment = vec![
        EnvVar {
            name: "HAULAGE_OPERATION".to_string(),
            value: Some(template.operation.as_str().to_string()),
            ..EnvVar::default()
        },
        EnvVar {
            name: "HAULAGE_DATA_ROOT".to_string(),
            value: Some(DATA_ROOT.to_string()),
            ..EnvVar::default()
        },
        EnvVar {
            name: "TMPDIR".to_string(),
            value: Some(SCRATCH_PATH.to_string()),
            ..EnvVar::default()
        },
        // The memory the agent plans its volumes in: its request (the
        // limit is twice that, head room rather than a budget).
        EnvVar {
            name: MEMORY_BUDGET_ENV.to_string(),
            value_from: Some(EnvVarSource {
                resource_field_ref: Some(ResourceFieldSelector {
                    container_name: Some(AGENT_CONTAINER.to_string()),
                    resource: "requests.memory".to_string(),
                    divisor: None,
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        },
        EnvVar {
            name: INDEX_BYTES_ENV.to_string(),
            value: Some(template.location.index_file_bytes.to_string()),
            ..EnvVar::default()
        },
        EnvVar {
            name: "POD_NAME".to_string(),
            value_from: Some(field_reference("metadata.name")),
            ..EnvVar::default()
        },
        EnvVar {
            name: "POD_NAMESPACE".to_string(),
            value_from: Some(field_reference("metadata.namespace")),
            ..EnvVar::default()
        },
        // The agent's Role is narrowed by resourceNames, which does not
        // authorize a list by field selector: it gets each of its
        // transfers by name instead.
        EnvVar {
            name: TRANSFERS_ENV.to_string(),
            value: Some(parts.transfers.join(",")),
            ..EnvVar::default()
        },
    ];

    let (node_name, affinity) = match template.pinning {
        Pinning::NodeName => (Some(stage.node.clone()), None),
        Pinning::RequiredNodeAffinity => (
            None,
            Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_fields: Some(vec![NodeSelectorRequirement {
                                key: "metadata.name".to_string(),
                                operator: "In".to_string(),
                                values: Some(vec![stage.node.clone()]),
                            }]),
                            ..NodeSelectorTerm::default()
                        }],
                    }),
                    ..NodeAffinity::default()
                }),
                ..Affinity::default()
            }),
        ),
    };

    Pod {
        metadata: ObjectMeta {
            name: Some(parts.name.to_string()),
            namespace: Some(stage.namespace.clone()),
            labels: Some(stage_pod_labels(template, stage)),
            annotations: Some(BTreeMap::from([
                (
                    OWNER_ANNOTATION.to_string(),
                    format!("{}/{}", template.owner.namespace, template.owner.name),
                ),
                (NODE_ANNOTATION.to_string(), stage.node.clone()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name,
            affinity,
            tolerations: parts
                .node
                .map(tolerations_for)
                .filter(|list| !list.is_empty()),
            restart_policy: Some("OnFailure".to_string()),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_PERIOD_SECONDS),
            service_account_name: Some(AGENT_SERVICE_ACCOUNT.to_string()),
            enable_service_links: Some(false),
            host_network: Some(false),
            host_pid: Some(false),
            host_ipc: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(run_as_non_root),
                seccomp_profile: Some(runtime_default),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: AGENT_CONTAINER.to_string(),
                image: Some(template.image.clone()),
                args: Some(template.agent_arguments()),
                env: Some(environment),
                ports: Some(vec![ContainerPort {
                    name: Some(AGENT_METRICS_PORT_NAME.to_string()),
                    container_port: i32::from(AGENT_METRICS_PORT),
                    protocol: Some("TCP".to_string()),
                    ..ContainerPort::default()
                }]),
                resources: Some(resources),
                security_context: Some(security_context),
                volume_mounts: Some(mounts),
                termination_message_policy: Some("FallbackToLogsOnError".to_string()),
                ..Container::default()
            }],
            volumes: Some(volumes),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// Volumes the agent of stage pod `pod` moves at once: what its
/// container's memory request holds beside its repository's index
/// ([`AgentMemory::volumes_at_once`], which the agent applies to the same
/// figures, given to it as `HAULAGE_MEMORY_BUDGET` and
/// [`INDEX_BYTES_ENV`]); one when the request cannot be read.
pub fn volumes_at_once_of(pod: &Pod) -> u32 {
    let Some(container) = pod
        .spec
        .iter()
        .flat_map(|spec| spec.containers.iter())
        .find(|container| container.name == AGENT_CONTAINER)
    else {
        return 1;
    };
    let index_file_bytes = container
        .env
        .iter()
        .flatten()
        .find(|variable| variable.name == INDEX_BYTES_ENV)
        .and_then(|variable| variable.value.as_deref()?.parse::<u64>().ok())
        .unwrap_or(0);
    container
        .resources
        .as_ref()
        .and_then(|resources| resources.requests.as_ref()?.get("memory"))
        .and_then(|quantity| haulage_plan::quantity::parse_quantity(&quantity.0).ok())
        .map_or(1, |budget_bytes| {
            AgentMemory {
                budget_bytes,
                index_file_bytes,
            }
            .volumes_at_once()
        })
}

/// Tolerations for the node's NoSchedule taints and its cordon, which the
/// planner only lets a stage pod meet for volumes already attached there.
fn tolerations_for(node: &NodeFacts) -> Vec<Toleration> {
    let mut tolerations: Vec<Toleration> = node
        .taints
        .iter()
        .filter(|taint| taint.effect == TaintEffect::NoSchedule)
        .map(|taint| Toleration {
            key: Some(taint.key.clone()),
            operator: Some(
                if taint.value.is_some() {
                    "Equal"
                } else {
                    "Exists"
                }
                .to_string(),
            ),
            value: taint.value.clone(),
            effect: Some(TaintEffect::NoSchedule.as_str().to_string()),
            ..Toleration::default()
        })
        .collect();
    const CORDON_TAINT: &str = "node.kubernetes.io/unschedulable";
    if node.unschedulable
        && !tolerations
            .iter()
            .any(|toleration| toleration.key.as_deref() == Some(CORDON_TAINT))
    {
        tolerations.push(Toleration {
            key: Some(CORDON_TAINT.to_string()),
            operator: Some("Exists".to_string()),
            effect: Some(TaintEffect::NoSchedule.as_str().to_string()),
            ..Toleration::default()
        });
    }
    tolerations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(node: &str) -> StagePod {
        StagePod {
            namespace: "shop".into(),
            node: node.into(),
            volumes: vec!["data-db-0".into(), "logs".into()],
            bytes: 1,
        }
    }

    fn location() -> LocationSettings {
        LocationSettings {
            reference: StorageLocationReference {
                namespace: "haulage-system".to_string(),
                name: "s3".to_string(),
            },
            spec: serde_yaml::from_str(
                "bucket: backups\nprefix: /team/\nendpoint: http://127.0.0.1:9000\nregion: us-east-1\n\
                 s3ForcePathStyle: true\ncredential: {name: s3, key: cloud}\nuploadBytesPerSecond: 1048576\n",
            )
            .expect("valid spec"),
            index_file_bytes: 0,
        }
    }

    fn owner(name: &str) -> Owner {
        Owner {
            namespace: "haulage-system".to_string(),
            name: name.to_string(),
            uid: "0b5c4c58-2f44-4c5e-9a43-6bde6bb9a3a1".to_string(),
        }
    }

    fn template(operation: Operation, name: &str) -> StagePodTemplate {
        StagePodTemplate::new(operation, owner(name), "agent:1", location())
    }

    fn objects(template: &StagePodTemplate, stage: &StagePod) -> StagePodObjects {
        let credentials =
            BTreeMap::from([("cloud".to_string(), ByteString(b"[default]".to_vec()))]);
        desired_stage_pod(
            template,
            stage,
            StagePodInputs {
                credentials,
                ..StagePodInputs::default()
            },
        )
    }

    fn pod_of(template: &StagePodTemplate, stage: &StagePod, node: Option<&NodeFacts>) -> Pod {
        desired_stage_pod(
            template,
            stage,
            StagePodInputs {
                node,
                ..StagePodInputs::default()
            },
        )
        .pod
    }

    fn container(pod: &Pod) -> &Container {
        &pod.spec.as_ref().expect("spec").containers[0]
    }

    #[test]
    fn backup_pod_mounts_claims_read_only_as_root_with_dac_override_only() {
        let template = template(Operation::Backup, "nightly");
        let pod = pod_of(&template, &stage("node-a"), None);
        let spec = pod.spec.as_ref().expect("spec");
        let claims: Vec<_> = spec
            .volumes
            .iter()
            .flatten()
            .filter_map(|volume| volume.persistent_volume_claim.as_ref())
            .collect();
        assert_eq!(claims.len(), 2);
        assert!(claims.iter().all(|claim| claim.read_only == Some(true)));
        let mounts = container(&pod).volume_mounts.as_ref().expect("mounts");
        assert!(
            mounts
                .iter()
                .filter(|mount| mount.mount_path.starts_with(DATA_ROOT))
                .all(|mount| mount.read_only == Some(true))
        );
        let security = container(&pod)
            .security_context
            .as_ref()
            .expect("security context");
        assert_eq!(security.run_as_user, Some(0));
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert_eq!(security.read_only_root_filesystem, Some(true));
        let capabilities = security.capabilities.as_ref().expect("capabilities");
        assert_eq!(capabilities.drop, Some(vec!["ALL".to_string()]));
        assert_eq!(capabilities.add, Some(vec!["DAC_OVERRIDE".to_string()]));
        assert_eq!(
            security
                .seccomp_profile
                .as_ref()
                .map(|profile| profile.type_.as_str()),
            Some("RuntimeDefault")
        );
        let pod_security = spec
            .security_context
            .as_ref()
            .expect("pod security context");
        assert_eq!(
            pod_security.fs_group, None,
            "fsGroup would re-own the user's files"
        );
        assert!(mounts.iter().any(|mount| mount.mount_path == SCRATCH_PATH));
        let scratch = spec
            .volumes
            .iter()
            .flatten()
            .find(|volume| volume.name == "scratch")
            .and_then(|volume| volume.empty_dir.as_ref())
            .expect("scratch emptyDir");
        assert_eq!(
            scratch.size_limit,
            Some(Quantity(SCRATCH_SIZE_LIMIT.to_string())),
            "a bounded scratch space"
        );
        let ports = container(&pod).ports.as_ref().expect("ports");
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].name.as_deref(), Some(AGENT_METRICS_PORT_NAME));
        assert_eq!(ports[0].container_port, 9090);
    }

    #[test]
    fn the_agent_gets_its_memory_request_as_its_budget_and_admission_the_volumes_it_holds() {
        let template = template(Operation::Backup, "nightly");
        let pod = pod_of(&template, &stage("node-a"), None);
        let budget = container(&pod)
            .env
            .iter()
            .flatten()
            .find(|variable| variable.name == MEMORY_BUDGET_ENV)
            .and_then(|variable| variable.value_from.as_ref()?.resource_field_ref.as_ref())
            .expect("the budget from the downward API");
        assert_eq!(budget.resource, "requests.memory");
        assert_eq!(budget.container_name.as_deref(), Some(AGENT_CONTAINER));
        assert_eq!(volumes_at_once_of(&pod), 4, "the default 128Mi");
        // A StoragePolicy asking 512Mi for the stage pods of its claims.
        let larger = desired_stage_pod(
            &template,
            &stage("node-a"),
            StagePodInputs {
                resources: ResourceOverride {
                    cpu_millis: None,
                    memory_bytes: Some(512 << 20),
                },
                ..StagePodInputs::default()
            },
        )
        .pod;
        assert_eq!(volumes_at_once_of(&larger), 20);
        // One whose request cannot be read moves one at a time.
        let mut unreadable = pod.clone();
        unreadable.spec.as_mut().expect("spec").containers[0].resources = None;
        assert_eq!(volumes_at_once_of(&unreadable), 1);
    }

    #[test]
    fn a_large_index_leaves_room_for_fewer_volumes_and_raises_the_request_to_fit_one() {
        let memory_request = |pod: &Pod| {
            container(pod)
                .resources
                .as_ref()
                .and_then(|resources| resources.requests.as_ref()?.get("memory").cloned())
                .expect("a memory request")
        };
        let index_bytes = |pod: &Pod| {
            container(pod)
                .env
                .iter()
                .flatten()
                .find(|variable| variable.name == INDEX_BYTES_ENV)
                .and_then(|variable| variable.value.clone())
                .expect("the index bytes")
        };
        let with_index = |index_file_bytes| {
            let mut template = template(Operation::Backup, "nightly");
            template.location.index_file_bytes = index_file_bytes;
            pod_of(&template, &stage("node-a"), None)
        };
        // Half a million blobs: 128Mi, two volumes at once.
        let half = with_index(21_250_000);
        assert_eq!(memory_request(&half), Quantity("128Mi".into()));
        assert_eq!(index_bytes(&half), "21250000");
        assert_eq!(volumes_at_once_of(&half), 2);
        // Four million: one volume does not fit in 128Mi, so the request
        // grows to what one needs beside the index; one at a time.
        let huge = with_index(170_000_000);
        let request =
            haulage_plan::quantity::parse_quantity(&memory_request(&huge).0).expect("a quantity");
        assert_eq!(request, AgentMemory::least_budget_bytes(170_000_000));
        assert!(request > 250 << 20, "{request}");
        assert_eq!(volumes_at_once_of(&huge), 1);
        // No index bytes given (a pod created before them): as before.
        let mut before = with_index(0);
        before.spec.as_mut().expect("spec").containers[0]
            .env
            .as_mut()
            .expect("env")
            .retain(|variable| variable.name != INDEX_BYTES_ENV);
        assert_eq!(volumes_at_once_of(&before), 4);
    }

    #[test]
    fn restore_pod_mounts_read_write_with_the_capabilities_to_restore_owners() {
        let template = template(Operation::Restore, "move");
        let pod = pod_of(&template, &stage("node-a"), None);
        let mounts = container(&pod).volume_mounts.as_ref().expect("mounts");
        assert!(
            mounts
                .iter()
                .filter(|mount| mount.mount_path != CREDENTIALS_PATH)
                .all(|mount| mount.read_only != Some(true))
        );
        let capabilities = container(&pod)
            .security_context
            .as_ref()
            .and_then(|security| security.capabilities.as_ref())
            .expect("capabilities");
        assert_eq!(
            capabilities.add,
            Some(
                ["CHOWN", "FOWNER", "DAC_OVERRIDE", "FSETID"]
                    .map(String::from)
                    .to_vec()
            )
        );
        assert_eq!(
            pod.metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get(RESTORE_LABEL)),
            Some(&"move".to_string())
        );
    }

    #[test]
    fn credentials_arrive_as_a_read_only_projected_secret() {
        let template = template(Operation::Backup, "nightly");
        let objects = objects(&template, &stage("node-a"));
        let pod = &objects.pod;
        let volume = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.volumes.as_ref())
            .and_then(|volumes| volumes.iter().find(|volume| volume.name == "credentials"))
            .expect("credentials volume");
        let projected = volume.projected.as_ref().expect("projected source");
        assert_eq!(projected.default_mode, Some(0o400));
        let secret = projected
            .sources
            .as_ref()
            .and_then(|sources| sources[0].secret.as_ref());
        assert_eq!(
            secret.map(|secret| secret.name.as_str()),
            objects.credentials.metadata.name.as_deref()
        );
        let mount = container(pod)
            .volume_mounts
            .iter()
            .flatten()
            .find(|mount| mount.mount_path == CREDENTIALS_PATH)
            .expect("credentials mount");
        assert_eq!(mount.read_only, Some(true));
    }

    #[test]
    fn non_root_backup_has_no_capabilities() {
        let mut template = template(Operation::Backup, "nightly");
        template.backup_identity = BackupIdentity::NonRoot { user_id: 1000 };
        let pod = pod_of(&template, &stage("node-a"), None);
        let security = container(&pod)
            .security_context
            .as_ref()
            .expect("security context");
        assert_eq!(security.run_as_user, Some(1000));
        assert_eq!(security.run_as_non_root, Some(true));
        assert_eq!(
            security.capabilities.as_ref().and_then(|c| c.add.as_ref()),
            None
        );
    }

    #[test]
    fn requests_default_then_rise_to_the_limit_range_minimum_and_follow_overrides() {
        assert_eq!(
            effective_requests(ResourceOverride::default(), None, 0),
            (100, 128 << 20)
        );
        let minimum = ResourceMinimum {
            cpu_millis: Some(250),
            memory_bytes: Some(64 << 20),
        };
        assert_eq!(
            effective_requests(ResourceOverride::default(), Some(minimum), 0),
            (250, 128 << 20)
        );
        let policy = ResourceOverride {
            cpu_millis: Some(50),
            memory_bytes: Some(512 << 20),
        };
        assert_eq!(
            effective_requests(policy, Some(minimum), 0),
            (250, 512 << 20)
        );
        let template = template(Operation::Backup, "nightly");
        let pod = desired_stage_pod(
            &template,
            &stage("node-a"),
            StagePodInputs {
                resources: policy,
                ..StagePodInputs::default()
            },
        )
        .pod;
        let requests = container(&pod)
            .resources
            .as_ref()
            .and_then(|resources| resources.requests.as_ref())
            .expect("requests");
        assert_eq!(requests.get("cpu"), Some(&Quantity("50m".into())));
        assert_eq!(requests.get("memory"), Some(&Quantity("512Mi".into())));
    }

    #[test]
    fn names_are_deterministic_bounded_dns_labels_distinct_per_node() {
        let template = template(
            Operation::Backup,
            "a-very-long-backup-name-that-goes-on-and-on-and-on-forever-and-ever",
        );
        let long_node = "ip-10-0-0-1.eu-west-1.compute.internal.example.com";
        let first = stage_pod_name(template.operation, &template.owner, &stage(long_node));
        assert_eq!(
            first,
            stage_pod_name(template.operation, &template.owner, &stage(long_node))
        );
        assert!(first.len() <= MAX_LABEL_LENGTH, "{first}");
        assert!(
            first
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        assert!(!first.starts_with('-') && !first.ends_with('-'));
        let other = stage_pod_name(
            template.operation,
            &template.owner,
            &stage("ip-10-0-0-2.eu-west-1.compute.internal.example.com"),
        );
        assert_ne!(first, other);
        let labels = stage_pod_labels(&template, &stage(long_node));
        assert!(labels.values().all(|value| value.len() <= MAX_LABEL_LENGTH));
    }

    #[test]
    fn pinning_uses_node_affinity_by_default_and_node_name_on_request() {
        let mut template = template(Operation::Backup, "nightly");
        let pod = pod_of(&template, &stage("node-a"), None);
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name, None);
        let term = &spec
            .affinity
            .as_ref()
            .and_then(|affinity| affinity.node_affinity.as_ref())
            .and_then(|node| {
                node.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .expect("required node affinity")
            .node_selector_terms[0];
        assert_eq!(
            term.match_fields.as_ref().expect("match fields")[0].values,
            Some(vec!["node-a".to_string()])
        );
        template.pinning = Pinning::NodeName;
        let pod = pod_of(&template, &stage("node-a"), None);
        assert_eq!(
            pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref()),
            Some("node-a")
        );
    }

    #[test]
    fn cordoned_node_is_tolerated_but_no_execute_never() {
        let template = template(Operation::Backup, "nightly");
        let node = NodeFacts::new("node-a")
            .cordoned()
            .with_taint("dedicated", TaintEffect::NoSchedule)
            .with_taint("evict", TaintEffect::NoExecute);
        let pod = pod_of(&template, &stage("node-a"), Some(&node));
        let tolerations = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.tolerations.as_ref())
            .expect("tolerations");
        let keys: Vec<_> = tolerations
            .iter()
            .filter_map(|t| t.key.as_deref())
            .collect();
        assert_eq!(keys, ["dedicated", "node.kubernetes.io/unschedulable"]);
        assert!(
            tolerations
                .iter()
                .all(|t| t.effect.as_deref() == Some("NoSchedule"))
        );
    }

    #[test]
    fn transfer_names_are_deterministic_valid_and_distinct() {
        let owner = owner("nightly");
        let a = transfer_name(&owner, "shop", "data");
        assert_eq!(a, transfer_name(&owner, "shop", "data"));
        assert_ne!(a, transfer_name(&owner, "web", "data"));
        assert!(a.starts_with("nightly-data-"));
        let long = transfer_name(&owner, "shop", &"x".repeat(250));
        assert!(long.len() <= 63, "{long}");
        assert!(
            long.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }

    #[test]
    fn a_location_with_a_private_ca_gives_the_agent_its_bundle_as_a_file() {
        let mut spec = location().spec;
        spec.ca_bundle = Some("-----BEGIN CERTIFICATE-----\n...".to_string());
        let arguments = agent_arguments(&spec);
        let at = arguments
            .iter()
            .position(|argument| argument == "--ca-bundle")
            .expect("--ca-bundle passed");
        assert_eq!(arguments[at + 1], format!("/credentials/{CA_BUNDLE_KEY}"));
        assert!(!agent_arguments(&location().spec).contains(&"--ca-bundle".to_string()));
    }

    #[test]
    fn an_encrypted_location_gives_the_agent_its_password_as_a_file_in_the_credentials_copy() {
        let mut spec = location().spec;
        spec.encryption = Some(haulage_api::location::LocationEncryption {
            password_secret_ref: haulage_api::location::PasswordSecretReference {
                name: "repo-password".to_string(),
                key: "password".to_string(),
            },
        });
        let arguments = agent_arguments(&spec);
        let at = arguments
            .iter()
            .position(|argument| argument == "--password-file")
            .expect("--password-file passed");
        assert_eq!(arguments[at + 1], format!("/credentials/{PASSWORD_KEY}"));
        let password = Some(ByteString(b"sealed".to_vec()));
        let copy = credentials_copy(&spec, ByteString(b"[default]".to_vec()), password.clone());
        assert_eq!(copy.get(PASSWORD_KEY), password.as_ref());
        assert_eq!(
            copy.get(&spec.credential.key),
            Some(&ByteString(b"[default]".to_vec()))
        );
        // A plaintext location: no argument, and no password copied even
        // if one was read.
        let plaintext = location().spec;
        assert!(!agent_arguments(&plaintext).contains(&"--password-file".to_string()));
        assert!(
            !credentials_copy(&plaintext, ByteString(Vec::new()), password)
                .contains_key(PASSWORD_KEY)
        );
    }

    #[test]
    fn the_agent_gets_the_location_as_arguments_and_a_credentials_file_path() {
        let arguments = agent_arguments(&location().spec);
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
        let pod = pod_of(
            &template(Operation::Backup, "nightly"),
            &stage("node-a"),
            None,
        );
        assert_eq!(container(&pod).args.as_deref(), Some(&arguments[..]));
    }

    #[test]
    fn the_agent_is_told_how_long_to_wait_for_an_unavailable_location() {
        let waiting = StagePodTemplate {
            fail_after_unavailable_seconds: Some(900),
            ..template(Operation::Restore, "move")
        };
        let pod = pod_of(&waiting, &stage("node-a"), None);
        let arguments = container(&pod).args.clone().expect("arguments");
        assert!(
            arguments.ends_with(&[
                "--fail-after-unavailable-seconds".to_string(),
                "900".to_string()
            ]),
            "{arguments:?}"
        );
    }

    #[test]
    fn the_agent_role_is_narrowed_to_the_pods_transfers() {
        let stage = StagePod {
            namespace: "shop".to_string(),
            node: "node-a".to_string(),
            volumes: vec!["a".to_string(), "b".to_string()],
            bytes: 1,
        };
        let objects = objects(&template(Operation::Backup, "nightly"), &stage);
        let names: Vec<String> = objects
            .transfers
            .iter()
            .filter_map(|transfer| transfer.metadata.name.clone())
            .collect();
        assert_eq!(names.len(), 2);
        let rules = objects.role.rules.clone().unwrap_or_default();
        assert_eq!(rules.len(), 2);
        for rule in &rules {
            assert_eq!(rule.resource_names.as_deref(), Some(&names[..]));
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
            Some(owner("nightly").uid.as_str())
        );
        let spec = objects.pod.spec.clone().expect("pod spec");
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some(AGENT_SERVICE_ACCOUNT)
        );
        let transfers_env = container(&objects.pod)
            .env
            .iter()
            .flatten()
            .find(|variable| variable.name == TRANSFERS_ENV)
            .and_then(|variable| variable.value.clone());
        assert_eq!(transfers_env, Some(names.join(",")));
    }

    #[test]
    fn each_transfer_names_its_pod_node_location_and_direction() {
        let stage = stage("node-a");
        for (operation, direction) in [
            (Operation::Backup, TransferDirection::Upload),
            (Operation::Restore, TransferDirection::Download),
        ] {
            let objects = objects(&template(operation, "move"), &stage);
            for transfer in &objects.transfers {
                assert_eq!(transfer.spec.direction, direction);
                assert_eq!(transfer.spec.stage_pod, objects.pod_name());
                assert_eq!(transfer.spec.storage_location.name, "s3");
                assert_eq!(
                    transfer
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|annotations| annotations.get(NODE_ANNOTATION))
                        .map(String::as_str),
                    Some("node-a")
                );
            }
        }
    }

    #[test]
    fn the_credentials_copy_is_labelled_and_owned_by_the_pods_role() {
        let objects = objects(&template(Operation::Backup, "nightly"), &stage("node-a"));
        let labels = objects
            .credentials
            .metadata
            .labels
            .clone()
            .unwrap_or_default();
        assert_eq!(
            labels.get(CREDENTIALS_COPY_LABEL).map(String::as_str),
            Some("true")
        );
        assert_eq!(
            objects.credentials.metadata.name.as_deref(),
            Some(credentials_copy_name(objects.pod_name()).as_str())
        );
        let owned = objects.credentials_owned_by("role-uid");
        let owner = &owned.metadata.owner_references.expect("owned")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Role", "role-uid")
        );
        assert_eq!(Some(&owner.name), objects.role.metadata.name.as_ref());
    }
}
