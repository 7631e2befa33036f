//! The controller's errors: one variant per failed call, naming the object,
//! with the kube error as source, and a verdict on whether trying again
//! can help (transient) or the user has to change something (permanent).

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
    /// A write to the API server failed.
    #[error("failed to {action} {kind} {name}")]
    Kube {
        /// What was attempted (`apply`, `create`, `delete`, `claim`, ...).
        action: &'static str,
        /// Kind of the object.
        kind: &'static str,
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
    /// The cluster caches could not be turned into planner facts.
    #[error("cannot plan from the cluster state")]
    Facts {
        /// The conversion error, naming the object and field.
        #[source]
        source: crate::plan::dump::DumpError,
    },
    /// The planner refused the facts.
    #[error("cannot plan stage pods")]
    Plan {
        /// The planner's error.
        #[source]
        source: crate::plan::PlanError,
    },
    /// The VolumeBackup's selector cannot be used.
    #[error("invalid selector in VolumeBackup {name}: {message}")]
    Selector {
        /// The backup.
        name: String,
        /// What is wrong.
        message: String,
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
            | Error::Facts { .. }
            | Error::Plan { .. }
            | Error::Selector { .. } => false,
        }
    }

    /// Every value [`Error::label`] returns: the error counters start at
    /// zero for each, so a rate or an alert works before the first error.
    pub const LABELS: [&'static str; 7] = [
        "missing_field",
        "kube",
        "credentials",
        "facts",
        "plan",
        "selector",
        "finalizer",
    ];

    /// Short name of the variant, for metrics and logs (one of
    /// [`Error::LABELS`]).
    pub fn label(&self) -> &'static str {
        match self {
            Error::MissingField { .. } => "missing_field",
            Error::Kube { .. } => "kube",
            Error::Credentials { .. } => "credentials",
            Error::Facts { .. } => "facts",
            Error::Plan { .. } => "plan",
            Error::Selector { .. } => "selector",
            Error::Finalizer { .. } => "finalizer",
        }
    }
}

/// A closure that wraps a kube error with what was attempted on which object.
pub(crate) fn kube_error(
    action: &'static str,
    kind: &'static str,
    name: impl Into<String>,
) -> impl FnOnce(kube::Error) -> Error {
    let name = name.into();
    move |source| Error::Kube {
        action,
        kind,
        name,
        source,
    }
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
            action: "apply",
            kind: "Pod",
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
    }
}
