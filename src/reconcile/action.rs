//! What a decision asks the controller to do: the actions it returns, the
//! Kubernetes Events it wants recorded and when to look again. Plain
//! values; `haulage::controller` executes them in the order given.

use std::time::Duration;

use haulage_api::VolumeTransferStatus;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;

use crate::stage_pod::StagePodObjects;

/// When to reconcile an object again (besides its own events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeue {
    /// After this long.
    After(Duration),
    /// Only when the object or something it watches changes.
    OnChange,
}

impl Requeue {
    /// The sooner of two requeues.
    pub fn sooner(self, other: Requeue) -> Requeue {
        match (self, other) {
            (Requeue::After(a), Requeue::After(b)) => Requeue::After(a.min(b)),
            (Requeue::After(a), Requeue::OnChange) | (Requeue::OnChange, Requeue::After(a)) => {
                Requeue::After(a)
            }
            (Requeue::OnChange, Requeue::OnChange) => Requeue::OnChange,
        }
    }
}

/// Normal or Warning, as Kubernetes Events are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Something went as it should.
    Normal,
    /// Something a person may have to look at.
    Warning,
}

/// A Kubernetes Event about the reconciled object (`kubectl describe`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub kind: EventKind,
    /// The reason, one CamelCase word.
    pub reason: String,
    /// What the controller was doing (`Claim`, `SuperviseStagePod`, ...).
    pub action: &'static str,
    /// The sentence shown to the user.
    pub note: String,
}

impl Event {
    /// A Normal event.
    pub fn normal(
        reason: impl Into<String>,
        action: &'static str,
        note: impl Into<String>,
    ) -> Self {
        Event {
            kind: EventKind::Normal,
            reason: reason.into(),
            action,
            note: note.into(),
        }
    }

    /// A Warning event.
    pub fn warning(
        reason: impl Into<String>,
        action: &'static str,
        note: impl Into<String>,
    ) -> Self {
        Event {
            kind: EventKind::Warning,
            reason: reason.into(),
            action,
            note: note.into(),
        }
    }
}

/// A namespaced object, by name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ObjectName {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl ObjectName {
    /// `namespace/name`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ObjectName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for ObjectName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What is left to delete of one stage pod ([`Action::ReleaseStagePod`]).
/// The controller deletes the pod first and the Role last: the Role is
/// the first of a stage pod's objects to be created, so while it is in
/// the cache something of the pod's access may be left, and a release cut
/// short is decided again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePodRelease {
    /// The pod; its RoleBinding and Role have its name, its credentials
    /// copy a name made from it.
    pub pod: ObjectName,
    /// Delete the pod: it is in the cache and not being deleted yet, or
    /// the decision cannot tell (a cancel releases by the plan's names).
    pub delete_pod: bool,
    /// The pod's UID, when the cache showed it: once it is deleted the
    /// replica remembers it, so a cache that does not show the deletion
    /// yet does not get it deleted twice.
    pub pod_uid: Option<String>,
    /// Delete its RoleBinding, credentials copy and, last, its Role: the
    /// Role is in the cache, or the decision cannot tell.
    pub delete_access: bool,
    /// The Role's UID, when the cache showed it: once the release is done
    /// the replica remembers it, so a cache that does not show the Role's
    /// deletion yet does not get it released twice.
    pub role_uid: Option<String>,
}

impl StagePodRelease {
    /// The release of everything of `pod`, whatever the caches show.
    pub fn everything(pod: ObjectName) -> Self {
        StagePodRelease {
            pod,
            delete_pod: true,
            pod_uid: None,
            delete_access: true,
            role_uid: None,
        }
    }
}

/// One step a decision asks for, on objects other than the reconciled one
/// (whose status is written separately, last).
#[derive(Debug, Clone)]
pub enum Action {
    /// Create a stage pod and everything it needs, in the order
    /// [`StagePodObjects`] documents.
    CreateStagePod(Box<StagePodObjects>),
    /// Delete a stage pod (its volumes are final, or it is replaced). Its
    /// UID is remembered, so a cache that does not show the deletion yet
    /// gets it neither judged nor deleted twice.
    DeletePod {
        /// The pod.
        pod: ObjectName,
        /// Its UID, when known.
        uid: Option<String>,
        /// Whether it is deleted to be created again (else its volumes are
        /// final and it is stopped).
        replaced: bool,
    },
    /// Delete what is left of a stage pod: the pod and its access (its
    /// RoleBinding, credentials copy and Role).
    ReleaseStagePod(StagePodRelease),
    /// Apply this status to a VolumeTransfer (fail or cancel it); a
    /// transfer that is gone is fine.
    WriteTransferStatus {
        /// The transfer.
        transfer: ObjectName,
        /// Its new status.
        status: Box<VolumeTransferStatus>,
    },
    /// Record on a transfer how many stage pods were made for it before
    /// the next one (survives the pod's deletion; the agent does not write
    /// it).
    RecordAttempts {
        /// The transfer.
        transfer: ObjectName,
        /// Stage pods made so far.
        attempts: i32,
    },
    /// Delete a VolumeTransfer.
    DeleteTransfer(ObjectName),
    /// Create a namespace (a restore's destination, when its spec asks).
    CreateNamespace(String),
    /// Create a claim, complete (a restore's destination); one that exists
    /// already is fine.
    CreateClaim(Box<PersistentVolumeClaim>),
    /// Change a claim a restore wrote.
    ChangeClaim {
        /// The claim.
        claim: ObjectName,
        /// What to change.
        change: ClaimChange,
    },
    /// Change the volume bound to a claim a restore wrote.
    ChangeVolume {
        /// The PersistentVolume's name.
        volume: String,
        /// What to change.
        change: VolumeChange,
    },
    /// Record an Event on the reconciled object.
    Emit(Event),
}

/// A change to a claim a restore wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimChange {
    /// Label it `complete`: its data is written and verified.
    MarkComplete,
    /// A sync is about to write into it: label it `incomplete`, naming the
    /// snapshot it will hold, so a pass cut off half-way is never taken
    /// for a complete copy of any snapshot.
    BeginSync {
        /// The snapshot the sync writes.
        snapshot: String,
    },
    /// Delete it (the ReadWriteOnce claim a ReadOnlyMany one replaces).
    Delete,
}

/// A change to the volume of a claim being handed back ReadOnlyMany.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeChange {
    /// Keep it when its claim goes (`Retain`), remembering `original`.
    Retain {
        /// The reclaim policy to give back afterwards.
        original: String,
    },
    /// Let the claim of this name bind it (its old claim's UID removed
    /// from `spec.claimRef`).
    FreeForClaim {
        /// The new claim's namespace.
        namespace: String,
        /// The new claim's name.
        name: String,
    },
    /// Give it back its reclaim policy (the claim is bound again).
    RestoreReclaimPolicy(String),
}
