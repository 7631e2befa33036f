//! Names that tie objects together and that manifests, the controller and
//! the agents must agree on: label keys, the finalizer, field managers.
//! `manifests/admission-policy.yaml` spells [`CREDENTIALS_COPY_LABEL`] out;
//! a unit test keeps the two equal.

/// Label on the controller's copies of BSL credentials in stage-pod
/// namespaces (value `"true"`); the only Secrets it may create or delete
/// there.
pub const CREDENTIALS_COPY_LABEL: &str = "haulage.dev/credentials-copy";
/// Label on every object created for a backup or restore (stage pods,
/// VolumeTransfers, Roles, credential copies): the owner's namespace.
pub const OWNER_NAMESPACE_LABEL: &str = "haulage.dev/owner-namespace";
/// Label with the owner's name (see [`OWNER_NAMESPACE_LABEL`]).
pub const OWNER_NAME_LABEL: &str = "haulage.dev/owner-name";
/// Label with the owner's UID, so objects of a deleted and re-created
/// VolumeBackup of the same name are told apart.
pub const OWNER_UID_LABEL: &str = "haulage.dev/owner-uid";

/// Whether `object` (a stage pod, a VolumeTransfer) carries
/// [`OWNER_UID_LABEL`] with `owner_uid`: it is a child of that object.
pub fn labelled_as_owned_by(object: &impl kube::ResourceExt, owner_uid: &str) -> bool {
    object.labels().get(OWNER_UID_LABEL).map(String::as_str) == Some(owner_uid)
}

/// Standard label naming the manager of an object (value [`MANAGED_BY`]).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "haulage";
/// Finalizer on VolumeBackups (and later VolumeRestores): released once
/// agents are stopped and stage pods and credential copies are gone.
pub const CANCEL_FINALIZER: &str = "haulage.dev/cancel";
/// Finalizer on VolumeBackups whose `deletionPolicy` is `Delete`: released
/// once their snapshots are forgotten from the storage location.
pub const FORGET_FINALIZER: &str = "haulage.dev/forget-snapshots";
/// Server-side apply field manager of the controller.
pub const CONTROLLER_FIELD_MANAGER: &str = "haulage-controller";
/// Server-side apply field manager of the mover agent.
pub const AGENT_FIELD_MANAGER: &str = "haulage-agent";
/// Namespace the manifests install the controller, BSLs and VolumeBackups into.
pub const SYSTEM_NAMESPACE: &str = "haulage-system";
/// Label on stage pods naming the operation (`backup` or `restore`).
pub const OPERATION_LABEL: &str = "haulage.dev/operation";
/// Label on stage pods naming the VolumeBackup they serve.
pub const BACKUP_LABEL: &str = "haulage.dev/volume-backup";
/// Label on stage pods naming the VolumeRestore they serve.
pub const RESTORE_LABEL: &str = "haulage.dev/volume-restore";
/// Annotation holding a stage pod owner's full `namespace/name` (labels
/// are bounded to 63 characters, names are not).
pub const OWNER_ANNOTATION: &str = "haulage.dev/owner";
/// Label on stage pods naming their node (bounded like every label value).
pub const NODE_LABEL: &str = "haulage.dev/node";
/// Annotation on stage pods and VolumeTransfers holding the full node name
/// (admission counts a transfer against its node's cap with it).
pub const NODE_ANNOTATION: &str = "haulage.dev/node";
