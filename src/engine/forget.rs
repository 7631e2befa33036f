//! Forget: decide with a retention policy ([`crate::repo::policy`]) which
//! snapshots go, and delete their manifests. The data they alone
//! referenced stays until `prune`.

use super::{EngineError, Repository};
use crate::repo::ObjectId;
use crate::repo::policy::{
    Decision, GroupBy, GroupDecisions, RetentionPolicy, SnapshotFacts, apply_policy,
    parse_snapshot_time,
};
use crate::repo::snapshot::Snapshot;

/// The policy's decisions, with the manifests they were made from.
#[derive(Debug, Clone)]
pub struct ForgetPlan {
    /// Decisions per group, newest first.
    pub groups: Vec<GroupDecisions>,
    /// Every readable snapshot.
    pub snapshots: Vec<(ObjectId, Snapshot)>,
    /// Snapshots that could not be read, or whose time could not be read:
    /// never forgotten by a policy.
    pub unreadable: Vec<String>,
}

impl ForgetPlan {
    /// The snapshots the policy forgets.
    pub fn removals(&self) -> Vec<ObjectId> {
        self.groups
            .iter()
            .flat_map(|group| &group.decisions)
            .filter(|decision| !decision.keep)
            .map(|decision| decision.id)
            .collect()
    }

    /// The manifest of a decision.
    pub fn snapshot(&self, decision: &Decision) -> Option<&Snapshot> {
        self.snapshots
            .iter()
            .find(|(id, _)| *id == decision.id)
            .map(|(_, snapshot)| snapshot)
    }
}

/// Apply `policy` to every snapshot of the repository.
pub async fn plan_forget(
    repository: &Repository,
    policy: &RetentionPolicy,
    group_by: GroupBy,
) -> Result<ForgetPlan, EngineError> {
    let (snapshots, damaged) = repository.list_snapshots().await?;
    let mut unreadable: Vec<String> = damaged.iter().map(ToString::to_string).collect();
    let mut facts = Vec::with_capacity(snapshots.len());
    for (id, snapshot) in &snapshots {
        match parse_snapshot_time(&snapshot.time) {
            Some((time_seconds, subsecond_nanos)) => facts.push(SnapshotFacts {
                id: *id,
                time_seconds,
                subsecond_nanos,
                source: snapshot.source.clone(),
                hostname: snapshot.hostname.clone(),
                tags: snapshot.tags.clone(),
            }),
            None => unreadable.push(format!(
                "snapshot {id}: its time {:?} cannot be read; kept",
                snapshot.time
            )),
        }
    }
    Ok(ForgetPlan {
        groups: apply_policy(&facts, policy, group_by),
        snapshots,
        unreadable,
    })
}

/// Delete snapshot manifests.
pub async fn forget_snapshots(
    repository: &Repository,
    ids: &[ObjectId],
) -> Result<(), EngineError> {
    for id in ids {
        repository
            .store()
            .delete(&crate::repo::snapshot_key(id))
            .await
            .map_err(|error| EngineError::store(format!("delete snapshot {id}"), error))?;
    }
    Ok(())
}
