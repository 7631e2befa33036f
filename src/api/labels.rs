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
/// Standard label naming the manager of an object (value [`MANAGED_BY`]).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "haulage";
/// Finalizer on VolumeBackups (and later VolumeRestores): released once
/// agents are stopped and stage pods and credential copies are gone.
pub const CANCEL_FINALIZER: &str = "haulage.dev/cancel";
/// Server-side apply field manager of the controller.
pub const CONTROLLER_FIELD_MANAGER: &str = "haulage-controller";
/// Server-side apply field manager of the mover agent.
pub const AGENT_FIELD_MANAGER: &str = "haulage-agent";
/// Namespace the manifests install the controller, BSLs and VolumeBackups into.
pub const SYSTEM_NAMESPACE: &str = "haulage-system";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admission_policy_names_the_credentials_copy_label() {
        let policy = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("manifests/admission-policy.yaml"),
        )
        .expect("manifests/admission-policy.yaml is readable");
        assert!(
            policy.contains(&format!("'{CREDENTIALS_COPY_LABEL}'")),
            "admission-policy.yaml does not check {CREDENTIALS_COPY_LABEL}"
        );
        assert!(policy.contains(&format!("request.namespace != '{SYSTEM_NAMESPACE}'")));
    }
}
