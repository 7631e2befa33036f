//! The controller's errors: one variant per failed call, naming the object,
//! with the kube error as source, and a verdict on whether trying again
//! can help (transient) or the user has to change something (permanent).

/// One call to the API server the controller makes: what a failed call
/// names in its message ("failed to apply Pod shop/x") and its metrics
/// label (`apply_pod`), so an alert says which operation fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiCall {
    /// Server-side apply of the agents' ServiceAccount.
    ApplyServiceAccount,
    /// Server-side apply of a stage pod's Role.
    ApplyRole,
    /// Server-side apply of a stage pod's RoleBinding.
    ApplyRoleBinding,
    /// Create of a stage pod's credentials copy.
    CreateCredentialsCopy,
    /// Server-side apply of a VolumeTransfer.
    ApplyTransfer,
    /// Server-side apply of a stage pod.
    ApplyPod,
    /// Delete of a stage pod.
    DeletePod,
    /// Delete of a stage pod's Role.
    DeleteRole,
    /// Delete of a stage pod's RoleBinding.
    DeleteRoleBinding,
    /// Delete of a stage pod's credentials copy.
    DeleteCredentialsCopy,
    /// Delete of a VolumeTransfer.
    DeleteTransfer,
    /// Status apply of a VolumeTransfer (failed, canceled).
    WriteTransferStatus,
    /// Status patch of a transfer's stage-pod attempts.
    RecordAttempts,
    /// The resourceVersion-checked ownership claim of a VolumeBackup.
    ClaimBackup,
    /// Status apply of a VolumeBackup.
    WriteBackupStatus,
    /// Read of a BackupStorageLocation's credentials Secret.
    ReadCredentials,
    /// Status apply of a BackupStorageLocation.
    WriteLocationStatus,
    /// List of the StoragePolicies (admission's fresh read).
    ListPolicies,
    /// Write of a transfer's bandwidth grant.
    WriteGrant,
    /// Status apply of a transfer's admission (phase, queue position).
    WriteAdmission,
    /// Status apply of a StoragePolicy (its usage).
    WritePolicyStatus,
    /// The resourceVersion-checked ownership claim of a VolumeRestore.
    ClaimRestore,
    /// Status apply of a VolumeRestore.
    WriteRestoreStatus,
    /// Create of a restore's destination namespace.
    CreateNamespace,
    /// Create of a restore's destination claim.
    CreateClaim,
    /// Patch of a restored claim (labelled complete).
    PatchClaim,
    /// Delete of the claim a ReadOnlyMany claim replaces.
    DeleteClaim,
    /// Patch of a restored claim's volume (reclaim policy, claim reference).
    PatchVolume,
    /// The resourceVersion-checked patch of a VolumeBackup's finalizers
    /// (`haulage.dev/forget-snapshots`).
    WriteBackupFinalizers,
    /// Delete of a VolumeBackup whose ttl is over.
    DeleteBackup,
}

impl ApiCall {
    /// Every call, for the metrics that start at zero.
    pub const ALL: [ApiCall; 30] = [
        ApiCall::ApplyServiceAccount,
        ApiCall::ApplyRole,
        ApiCall::ApplyRoleBinding,
        ApiCall::CreateCredentialsCopy,
        ApiCall::ApplyTransfer,
        ApiCall::ApplyPod,
        ApiCall::DeletePod,
        ApiCall::DeleteRole,
        ApiCall::DeleteRoleBinding,
        ApiCall::DeleteCredentialsCopy,
        ApiCall::DeleteTransfer,
        ApiCall::WriteTransferStatus,
        ApiCall::RecordAttempts,
        ApiCall::ClaimBackup,
        ApiCall::WriteBackupStatus,
        ApiCall::ReadCredentials,
        ApiCall::WriteLocationStatus,
        ApiCall::ListPolicies,
        ApiCall::WriteGrant,
        ApiCall::WriteAdmission,
        ApiCall::WritePolicyStatus,
        ApiCall::ClaimRestore,
        ApiCall::WriteRestoreStatus,
        ApiCall::CreateNamespace,
        ApiCall::CreateClaim,
        ApiCall::PatchClaim,
        ApiCall::DeleteClaim,
        ApiCall::PatchVolume,
        ApiCall::WriteBackupFinalizers,
        ApiCall::DeleteBackup,
    ];

    /// What was attempted and on which kind, for the message.
    pub fn describe(self) -> (&'static str, &'static str) {
        match self {
            ApiCall::ApplyServiceAccount => ("apply", "ServiceAccount"),
            ApiCall::ApplyRole => ("apply", "Role"),
            ApiCall::ApplyRoleBinding => ("apply", "RoleBinding"),
            ApiCall::CreateCredentialsCopy => ("create", "Secret"),
            ApiCall::ApplyTransfer => ("apply", "VolumeTransfer"),
            ApiCall::ApplyPod => ("apply", "Pod"),
            ApiCall::DeletePod => ("delete", "Pod"),
            ApiCall::DeleteRole => ("delete", "Role"),
            ApiCall::DeleteRoleBinding => ("delete", "RoleBinding"),
            ApiCall::DeleteCredentialsCopy => ("delete", "Secret"),
            ApiCall::DeleteTransfer => ("delete", "VolumeTransfer"),
            ApiCall::WriteTransferStatus => ("apply status of", "VolumeTransfer"),
            ApiCall::RecordAttempts => ("record attempts on", "VolumeTransfer"),
            ApiCall::ClaimBackup => ("claim", "VolumeBackup"),
            ApiCall::WriteBackupStatus => ("apply status of", "VolumeBackup"),
            ApiCall::ReadCredentials => ("get", "Secret"),
            ApiCall::WriteLocationStatus => ("apply status of", "BackupStorageLocation"),
            ApiCall::ListPolicies => ("list", "StoragePolicy"),
            ApiCall::WriteGrant => ("write the bandwidth grant of", "VolumeTransfer"),
            ApiCall::WriteAdmission => ("apply the admission status of", "VolumeTransfer"),
            ApiCall::WritePolicyStatus => ("apply status of", "StoragePolicy"),
            ApiCall::ClaimRestore => ("claim", "VolumeRestore"),
            ApiCall::WriteRestoreStatus => ("apply status of", "VolumeRestore"),
            ApiCall::CreateNamespace => ("create", "Namespace"),
            ApiCall::CreateClaim => ("create", "PersistentVolumeClaim"),
            ApiCall::PatchClaim => ("patch", "PersistentVolumeClaim"),
            ApiCall::DeleteClaim => ("delete", "PersistentVolumeClaim"),
            ApiCall::PatchVolume => ("patch", "PersistentVolume"),
            ApiCall::WriteBackupFinalizers => ("write the finalizers of", "VolumeBackup"),
            ApiCall::DeleteBackup => ("delete", "VolumeBackup"),
        }
    }

    /// The metrics label of a failure of this call.
    pub fn label(self) -> &'static str {
        match self {
            ApiCall::ApplyServiceAccount => "apply_serviceaccount",
            ApiCall::ApplyRole => "apply_role",
            ApiCall::ApplyRoleBinding => "apply_rolebinding",
            ApiCall::CreateCredentialsCopy => "create_credentials_copy",
            ApiCall::ApplyTransfer => "apply_volumetransfer",
            ApiCall::ApplyPod => "apply_pod",
            ApiCall::DeletePod => "delete_pod",
            ApiCall::DeleteRole => "delete_role",
            ApiCall::DeleteRoleBinding => "delete_rolebinding",
            ApiCall::DeleteCredentialsCopy => "delete_credentials_copy",
            ApiCall::DeleteTransfer => "delete_volumetransfer",
            ApiCall::WriteTransferStatus => "write_volumetransfer_status",
            ApiCall::RecordAttempts => "record_attempts",
            ApiCall::ClaimBackup => "claim_volumebackup",
            ApiCall::WriteBackupStatus => "write_volumebackup_status",
            ApiCall::ReadCredentials => "read_credentials",
            ApiCall::WriteLocationStatus => "write_backupstoragelocation_status",
            ApiCall::ListPolicies => "list_storagepolicies",
            ApiCall::WriteGrant => "write_grant",
            ApiCall::WriteAdmission => "write_admission",
            ApiCall::WritePolicyStatus => "write_storagepolicy_status",
            ApiCall::ClaimRestore => "claim_volumerestore",
            ApiCall::WriteRestoreStatus => "write_volumerestore_status",
            ApiCall::CreateNamespace => "create_namespace",
            ApiCall::CreateClaim => "create_claim",
            ApiCall::PatchClaim => "patch_claim",
            ApiCall::DeleteClaim => "delete_claim",
            ApiCall::PatchVolume => "patch_volume",
            ApiCall::WriteBackupFinalizers => "write_volumebackup_finalizers",
            ApiCall::DeleteBackup => "delete_volumebackup",
        }
    }
}

impl std::fmt::Display for ApiCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (verb, kind) = self.describe();
        write!(f, "{verb} {kind}")
    }
}

/// A reconcile step that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object has no name, namespace or UID (never for objects read
    /// from the API server, which sets them; guards against bad caches).
    #[error("{kind} is missing {field}")]
    MissingField {
        /// Kind of the object.
        kind: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A call to the API server failed.
    #[error("failed to {call} {name}")]
    Kube {
        /// The call.
        call: ApiCall,
        /// `namespace/name` of the object.
        name: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// The BSL's credentials Secret could not be read or used.
    #[error("credentials of BackupStorageLocation {location}: {message}")]
    Credentials {
        /// The BSL.
        location: String,
        /// What is wrong.
        message: String,
    },
    /// The VolumeBackup's spec or the cluster's objects cannot be decided
    /// on (a bad selector, an object the planner cannot read).
    #[error("cannot decide on VolumeBackup {name}")]
    Backup {
        /// `namespace/name` of the backup.
        name: String,
        /// Why.
        #[source]
        source: crate::reconcile::backup::BackupError,
    },
    /// The VolumeRestore or the cluster's objects cannot be decided on.
    #[error("cannot decide on VolumeRestore {name}")]
    Restore {
        /// `namespace/name` of the restore.
        name: String,
        /// Why.
        #[source]
        source: crate::reconcile::restore::RestoreError,
    },
    /// The finalizer machinery failed (adding or removing it, or a step).
    #[error("finalizer of {name} failed")]
    Finalizer {
        /// `namespace/name` of the object.
        name: String,
        /// kube-runtime's error.
        #[source]
        source: Box<kube::runtime::finalizer::Error<Error>>,
    },
}

impl Error {
    /// The error with every cause, `a: b: c`, for logs: "failed to apply
    /// Pod shop/x: ApiError: pods is forbidden: ..." rather than the first
    /// line only.
    pub fn chain(&self) -> String {
        crate::error_chain(self)
    }

    /// Whether the same call may succeed later without a user changing
    /// anything: API server hiccups, conflicts and throttling are; a
    /// refused object (validation, forbidden) or bad input is not.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Kube { source, .. } => match source {
                kube::Error::Api(status) => {
                    status.code == 409 || status.code == 429 || status.code >= 500
                }
                _ => true,
            },
            Error::Finalizer { source, .. } => match source.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(inner)
                | kube::runtime::finalizer::Error::CleanupFailed(inner) => inner.is_transient(),
                _ => true,
            },
            Error::MissingField { .. }
            | Error::Credentials { .. }
            | Error::Backup { .. }
            | Error::Restore { .. } => false,
        }
    }

    /// Every value [`Error::label`] returns: the error counters start at
    /// zero for each, so a rate or an alert works before the first error.
    pub fn labels() -> impl Iterator<Item = &'static str> {
        [
            "missing_field",
            "credentials",
            "selector",
            "ttl",
            "facts",
            "plan",
            "finalizer",
        ]
        .into_iter()
        .chain(ApiCall::ALL.into_iter().map(ApiCall::label))
    }

    /// Short name of what failed, for metrics and logs: the API call, or
    /// the variant (one of [`Error::labels`]). A finalizer's failed step
    /// is labelled by that step.
    pub fn label(&self) -> &'static str {
        use crate::reconcile::backup::BackupError;
        use crate::reconcile::restore::RestoreError;
        match self {
            Error::MissingField { .. } => "missing_field",
            Error::Kube { call, .. } => call.label(),
            Error::Credentials { .. } => "credentials",
            Error::Backup { source, .. } => match source {
                BackupError::MissingField { .. } => "missing_field",
                BackupError::Selector { .. } => "selector",
                BackupError::Ttl { .. } => "ttl",
                BackupError::Facts { .. } => "facts",
                BackupError::Plan { .. } => "plan",
            },
            Error::Restore { source, .. } => match source {
                RestoreError::MissingField { .. } => "missing_field",
                RestoreError::Facts { .. } => "facts",
                RestoreError::Plan { .. } => "plan",
            },
            Error::Finalizer { source, .. } => match source.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(inner)
                | kube::runtime::finalizer::Error::CleanupFailed(inner) => inner.label(),
                _ => "finalizer",
            },
        }
    }
}

/// A closure that wraps a kube error with what was attempted on which object.
pub(crate) fn kube_error(
    call: ApiCall,
    name: impl Into<String>,
) -> impl FnOnce(kube::Error) -> Error {
    let name = name.into();
    move |source| Error::Kube { call, name, source }
}

/// Whether a kube error is the API server's 404.
pub(crate) fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

/// Whether a kube error is a 409 (a failed precondition or an existing name).
pub(crate) fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_line_carries_every_cause() {
        let error = Error::Kube {
            call: ApiCall::ApplyPod,
            name: "shop/stage-a".to_string(),
            source: kube::Error::Api(
                kube::core::Status::failure(
                    "pods \"stage-a\" is forbidden: exceeded quota",
                    "Forbidden",
                )
                .boxed(),
            ),
        };
        let line = error.chain();
        assert!(
            line.starts_with("failed to apply Pod shop/stage-a: "),
            "{line}"
        );
        assert!(line.contains("exceeded quota"), "{line}");
        assert_eq!(error.label(), "apply_pod");
    }

    #[test]
    fn every_call_has_its_own_label_and_a_finalizer_failure_is_labelled_by_its_step() {
        let labels: std::collections::BTreeSet<&str> = Error::labels().collect();
        assert_eq!(labels.len(), Error::labels().count(), "labels are distinct");
        let step = Error::Kube {
            call: ApiCall::DeletePod,
            name: "shop/stage-a".to_string(),
            source: kube::Error::Api(kube::core::Status::failure("gone", "Gone").boxed()),
        };
        let wrapped = Error::Finalizer {
            name: "haulage-system/nightly".to_string(),
            source: Box::new(kube::runtime::finalizer::Error::CleanupFailed(step)),
        };
        assert_eq!(wrapped.label(), "delete_pod");
        assert!(labels.contains(wrapped.label()));
    }
}
