//! The stage pod a plan entry becomes: a complete `Pod` value, built
//! without I/O, ready for the controller to apply with server-side apply.
//!
//! The pod is pinned to its node, mounts every claim of its entry
//! (read-only for backup, read-write for restore), requests little, never
//! sets `fsGroup` (the kubelet would re-own every file of the user's
//! volume) and runs with the least privilege that can read (backup) or
//! faithfully write (restore) arbitrary files: see DESIGN.md "Security".

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PersistentVolumeClaimVolumeSource, Pod, PodSecurityContext, PodSpec, ProjectedVolumeSource,
    ResourceRequirements, SeccompProfile, SecretProjection, SecurityContext, Toleration, Volume,
    VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::plan::facts::{NodeFacts, TaintEffect};
use crate::plan::output::StagePod;
use crate::plan::quantity::{format_bytes, format_millis};

/// CPU a stage pod requests unless a LimitRange or StoragePolicy says
/// otherwise.
pub const DEFAULT_CPU_REQUEST_MILLIS: u64 = 100;
/// Memory a stage pod requests (and is limited to) unless a LimitRange or
/// StoragePolicy says otherwise; the agent is built to fit it.
pub const DEFAULT_MEMORY_REQUEST_BYTES: u64 = 128 << 20;
/// glibc malloc arenas in the agent (`MALLOC_ARENA_MAX`).
pub const MALLOC_ARENA_MAX: u32 = 2;
/// The stage pod's memory limit, as a multiple of its request.
pub const MEMORY_LIMIT_FACTOR: u64 = 2;
/// Where each claim is mounted: `/data/<claim name>`.
pub const DATA_ROOT: &str = "/data";
/// Where the agent's scratch space (an emptyDir) is mounted; the root
/// filesystem is read-only.
pub const SCRATCH_PATH: &str = "/scratch";
/// Where the storage credentials are mounted, when the template names a
/// Secret.
pub const CREDENTIALS_PATH: &str = "/credentials";
/// Grace period for the agent to abort in-flight uploads and checkpoint.
pub const TERMINATION_GRACE_PERIOD_SECONDS: i64 = 60;
/// Port of the agent's `/metrics` (container port `metrics`; the agent's
/// `--metrics-address` default).
pub const AGENT_METRICS_PORT: u16 = 9090;
/// Name of the agent's metrics container port (what a PodMonitor selects).
/// Name of the stage pod's one container, the mover agent.
pub const AGENT_CONTAINER: &str = "agent";
pub const AGENT_METRICS_PORT_NAME: &str = "metrics";
/// Longest name a stage pod gets (a DNS label, so it can be a hostname).
pub const MAX_NAME_LENGTH: usize = 63;

/// Label naming the operation (`backup` or `restore`).
pub const OPERATION_LABEL: &str = "haulage.dev/operation";
/// Label naming the VolumeBackup a backup stage pod serves.
pub const BACKUP_LABEL: &str = "haulage.dev/volume-backup";
/// Label naming the VolumeRestore a restore stage pod serves.
pub const RESTORE_LABEL: &str = "haulage.dev/volume-restore";
/// Annotation holding the owner's full `namespace/name` (labels are
/// bounded to 63 characters, names are not).
pub const OWNER_ANNOTATION: &str = "haulage.dev/owner";
/// Label naming the node (bounded like every label value).
pub const NODE_LABEL: &str = "haulage.dev/node";
/// Annotation holding the full node name.
pub const NODE_ANNOTATION: &str = "haulage.dev/node";

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

/// The minimum a namespace's LimitRange sets for containers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceMinimum {
    /// Minimum CPU in millicores.
    pub cpu_millis: Option<u64>,
    /// Minimum memory in bytes.
    pub memory_bytes: Option<u64>,
}

/// What every stage pod of one backup or restore shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePodTemplate {
    /// Backup or restore.
    pub operation: Operation,
    /// Namespace of the VolumeBackup / VolumeRestore.
    pub owner_namespace: String,
    /// Name of the VolumeBackup / VolumeRestore.
    pub owner_name: String,
    /// Agent image.
    pub image: String,
    /// Service account the agent runs as (its Role allows get/patch on its
    /// own VolumeTransfers only).
    pub service_account: Option<String>,
    /// Backup identity (ignored for restore, which runs as root with the
    /// capabilities writing owners and modes needs).
    pub backup_identity: BackupIdentity,
    /// How the pod is pinned to its node.
    pub pinning: Pinning,
    /// Requests set by the StoragePolicy, if any.
    pub resources: ResourceOverride,
    /// Secret (in the stage pod's namespace) holding the storage
    /// credentials, mounted read-only at [`CREDENTIALS_PATH`] as a
    /// projected volume: the agent never needs `get secrets`.
    pub credentials_secret: Option<String>,
}

impl StagePodTemplate {
    /// A template with root backup identity, node-affinity pinning and
    /// default resources.
    pub fn new(
        operation: Operation,
        owner_namespace: impl Into<String>,
        owner_name: impl Into<String>,
        image: impl Into<String>,
    ) -> Self {
        StagePodTemplate {
            operation,
            owner_namespace: owner_namespace.into(),
            owner_name: owner_name.into(),
            image: image.into(),
            service_account: None,
            backup_identity: BackupIdentity::Root,
            pinning: Pinning::RequiredNodeAffinity,
            resources: ResourceOverride::default(),
            credentials_secret: None,
        }
    }
}

/// The requests a stage pod gets: the StoragePolicy's override or the
/// default, raised to the namespace's LimitRange minimum (a pod below it
/// would be refused at admission).
pub fn effective_requests(
    resources: ResourceOverride,
    minimum: Option<ResourceMinimum>,
) -> (u64, u64) {
    let minimum = minimum.unwrap_or_default();
    let cpu = resources
        .cpu_millis
        .unwrap_or(DEFAULT_CPU_REQUEST_MILLIS)
        .max(minimum.cpu_millis.unwrap_or(0));
    let memory = resources
        .memory_bytes
        .unwrap_or(DEFAULT_MEMORY_REQUEST_BYTES)
        .max(minimum.memory_bytes.unwrap_or(0));
    (cpu, memory)
}

/// The deterministic name of a stage pod: `haulage-<operation>-<owner>-
/// <node>` cut to fit, then a hash of everything that identifies the pod,
/// so the name is unique, at most [`MAX_NAME_LENGTH`] characters and a
/// valid DNS label.
pub fn stage_pod_name(template: &StagePodTemplate, stage: &StagePod) -> String {
    let digest = blake3::hash(
        [
            template.operation.as_str(),
            &template.owner_namespace,
            &template.owner_name,
            &stage.namespace,
            &stage.node,
        ]
        .join("\0")
        .as_bytes(),
    );
    let suffix = &digest.to_hex()[..10];
    let readable = format!(
        "haulage-{}-{}-{}",
        template.operation.as_str(),
        template.owner_name,
        stage.node
    );
    format!(
        "{}-{suffix}",
        dns_label_prefix(&readable, MAX_NAME_LENGTH - suffix.len() - 1)
    )
}

/// A label value for an arbitrary string: the string when it is a valid
/// value, else a readable prefix and a hash.
pub fn bounded_label_value(value: &str) -> String {
    let valid = value.len() <= MAX_NAME_LENGTH
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value
            .chars()
            .next()
            .is_none_or(|c| c.is_ascii_alphanumeric())
        && value
            .chars()
            .last()
            .is_none_or(|c| c.is_ascii_alphanumeric());
    if valid {
        return value.to_string();
    }
    let suffix = &blake3::hash(value.as_bytes()).to_hex()[..10];
    format!(
        "{}-{suffix}",
        dns_label_prefix(value, MAX_NAME_LENGTH - suffix.len() - 1)
    )
}

/// Lowercase, non-alphanumerics as `-`, at most `limit` characters, no
/// leading or trailing `-`.
fn dns_label_prefix(text: &str, limit: usize) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(limit)
        .collect();
    let trimmed = mapped.trim_matches('-');
    if trimmed.is_empty() {
        "haulage".to_string()
    } else {
        trimmed.to_string()
    }
}

/// The labels every stage pod of this template carries; select with them
/// to find a backup's or restore's pods.
pub fn stage_pod_labels(template: &StagePodTemplate, stage: &StagePod) -> BTreeMap<String, String> {
    let owner_label = match template.operation {
        Operation::Backup => BACKUP_LABEL,
        Operation::Restore => RESTORE_LABEL,
    };
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            "haulage-agent".to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "stage-pod".to_string(),
        ),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "haulage".to_string(),
        ),
        (
            OPERATION_LABEL.to_string(),
            template.operation.as_str().to_string(),
        ),
        (
            owner_label.to_string(),
            bounded_label_value(&template.owner_name),
        ),
        (NODE_LABEL.to_string(), bounded_label_value(&stage.node)),
    ])
}

/// Build the stage pod for one plan entry.
///
/// `node` is the node's facts when known: a stage pod placed on a cordoned
/// or NoSchedule-tainted node (for volumes already attached there)
/// tolerates exactly those NoSchedule taints; it never tolerates
/// NoExecute. `minimum` is the namespace's LimitRange minimum, if any.
pub fn build_stage_pod(
    template: &StagePodTemplate,
    stage: &StagePod,
    node: Option<&NodeFacts>,
    minimum: Option<ResourceMinimum>,
) -> Pod {
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
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    });
    mounts.push(VolumeMount {
        name: "scratch".to_string(),
        mount_path: SCRATCH_PATH.to_string(),
        ..VolumeMount::default()
    });
    if let Some(secret) = &template.credentials_secret {
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
                        name: secret.clone(),
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

    let (cpu_millis, memory_bytes) = effective_requests(template.resources, minimum);
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
        // glibc gives each thread that allocates its own arena and keeps
        // freed memory there: one volume after another on different
        // blocking threads then adds up (measured, docs/benchmarks.md).
        EnvVar {
            name: "MALLOC_ARENA_MAX".to_string(),
            value: Some(MALLOC_ARENA_MAX.to_string()),
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
            name: Some(stage_pod_name(template, stage)),
            namespace: Some(stage.namespace.clone()),
            labels: Some(stage_pod_labels(template, stage)),
            annotations: Some(BTreeMap::from([
                (
                    OWNER_ANNOTATION.to_string(),
                    format!("{}/{}", template.owner_namespace, template.owner_name),
                ),
                (NODE_ANNOTATION.to_string(), stage.node.clone()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name,
            affinity,
            tolerations: node.map(tolerations_for).filter(|list| !list.is_empty()),
            restart_policy: Some("OnFailure".to_string()),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_PERIOD_SECONDS),
            service_account_name: template.service_account.clone(),
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
                ..Container::default()
            }],
            volumes: Some(volumes),
            ..PodSpec::default()
        }),
        status: None,
    }
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

    fn container(pod: &Pod) -> &Container {
        &pod.spec.as_ref().expect("spec").containers[0]
    }

    #[test]
    fn backup_pod_mounts_claims_read_only_as_root_with_dac_override_only() {
        let template = StagePodTemplate::new(Operation::Backup, "haulage", "nightly", "agent:1");
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
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
        let ports = container(&pod).ports.as_ref().expect("ports");
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].name.as_deref(), Some(AGENT_METRICS_PORT_NAME));
        assert_eq!(ports[0].container_port, 9090);
    }

    #[test]
    fn restore_pod_mounts_read_write_with_the_capabilities_to_restore_owners() {
        let template = StagePodTemplate::new(Operation::Restore, "haulage", "move", "agent:1");
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
        let mounts = container(&pod).volume_mounts.as_ref().expect("mounts");
        assert!(mounts.iter().all(|mount| mount.read_only != Some(true)));
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
        let mut template =
            StagePodTemplate::new(Operation::Backup, "haulage", "nightly", "agent:1");
        let without = build_stage_pod(&template, &stage("node-a"), None, None);
        assert!(
            container(&without)
                .volume_mounts
                .iter()
                .flatten()
                .all(|mount| mount.mount_path != CREDENTIALS_PATH)
        );
        template.credentials_secret = Some("bsl-credentials".into());
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
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
            Some("bsl-credentials")
        );
        let mount = container(&pod)
            .volume_mounts
            .iter()
            .flatten()
            .find(|mount| mount.mount_path == CREDENTIALS_PATH)
            .expect("credentials mount");
        assert_eq!(mount.read_only, Some(true));
    }

    #[test]
    fn non_root_backup_has_no_capabilities() {
        let mut template =
            StagePodTemplate::new(Operation::Backup, "haulage", "nightly", "agent:1");
        template.backup_identity = BackupIdentity::NonRoot { user_id: 1000 };
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
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
            effective_requests(ResourceOverride::default(), None),
            (100, 128 << 20)
        );
        let minimum = ResourceMinimum {
            cpu_millis: Some(250),
            memory_bytes: Some(64 << 20),
        };
        assert_eq!(
            effective_requests(ResourceOverride::default(), Some(minimum)),
            (250, 128 << 20)
        );
        let policy = ResourceOverride {
            cpu_millis: Some(50),
            memory_bytes: Some(512 << 20),
        };
        assert_eq!(effective_requests(policy, Some(minimum)), (250, 512 << 20));
        let mut template =
            StagePodTemplate::new(Operation::Backup, "haulage", "nightly", "agent:1");
        template.resources = policy;
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
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
        let template = StagePodTemplate::new(
            Operation::Backup,
            "haulage",
            "a-very-long-backup-name-that-goes-on-and-on-and-on-forever-and-ever",
            "agent:1",
        );
        let long_node = "ip-10-0-0-1.eu-west-1.compute.internal.example.com";
        let first = stage_pod_name(&template, &stage(long_node));
        assert_eq!(first, stage_pod_name(&template, &stage(long_node)));
        assert!(first.len() <= MAX_NAME_LENGTH, "{first}");
        assert!(
            first
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        assert!(!first.starts_with('-') && !first.ends_with('-'));
        let other = stage_pod_name(
            &template,
            &stage("ip-10-0-0-2.eu-west-1.compute.internal.example.com"),
        );
        assert_ne!(first, other);
        let labels = stage_pod_labels(&template, &stage(long_node));
        assert!(labels.values().all(|value| value.len() <= MAX_NAME_LENGTH));
    }

    #[test]
    fn pinning_uses_node_affinity_by_default_and_node_name_on_request() {
        let mut template =
            StagePodTemplate::new(Operation::Backup, "haulage", "nightly", "agent:1");
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
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
        let pod = build_stage_pod(&template, &stage("node-a"), None, None);
        assert_eq!(
            pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref()),
            Some("node-a")
        );
    }

    #[test]
    fn cordoned_node_is_tolerated_but_no_execute_never() {
        let template = StagePodTemplate::new(Operation::Backup, "haulage", "nightly", "agent:1");
        let node = NodeFacts::new("node-a")
            .cordoned()
            .with_taint("dedicated", TaintEffect::NoSchedule)
            .with_taint("evict", TaintEffect::NoExecute);
        let pod = build_stage_pod(&template, &stage("node-a"), Some(&node), None);
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
}
