//! A VolumeBackup's `deletionPolicy` and `ttl` on the real API server and
//! MinIO: deleting a backup with `Delete` forgets exactly its snapshots
//! (another backup's, with `Retain`, stay); a forget that cannot reach the
//! repository keeps the finalizer and says so in a condition until the
//! policy is set to `Retain`; a finished backup is deleted when its ttl is
//! over.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::condition::{condition_type, find_condition, reason};
use haulage::api::labels::{FORGET_FINALIZER, SYSTEM_NAMESPACE};
use haulage::api::{ConditionStatus, VolumeBackup};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, create_backup_with_spec, eventually, final_phase,
};

/// Create the VolumeBackup `name` of the claims named in `claims`, with
/// the given extra spec fields (`deletionPolicy`, `ttl`).
async fn create_backup_with(
    client: &kube::Client,
    name: &str,
    claims: &[&str],
    extra: serde_json::Value,
) -> anyhow::Result<()> {
    let mut spec = json!({"namespaces": ["shop", "web"],
        "selector": {"matchExpressions": [{"key": "claim", "operator": "In", "values": claims}]}});
    for (key, value) in extra.as_object().into_iter().flatten() {
        spec[key] = value.clone();
    }
    create_backup_with_spec(client, name, spec).await
}

/// The snapshot ids of a completed backup's volumes.
fn snapshot_ids(backup: &VolumeBackup) -> anyhow::Result<BTreeSet<String>> {
    let status = backup.status.clone().context("status")?;
    anyhow::ensure!(
        status.phase == Some(VolumeBackupPhase::Completed),
        "{} did not complete: {status:#?}",
        backup.name_any()
    );
    // Planned for the default location, which is recorded.
    anyhow::ensure!(
        status.storage_location.as_deref() == Some("minio"),
        "{} records no location: {status:#?}",
        backup.name_any()
    );
    status
        .results
        .iter()
        .map(|result| result.snapshot_id.clone().context("snapshot id"))
        .collect()
}

/// Every snapshot id in the fixture's repository.
async fn repository_snapshots(fixture: &Fixture) -> anyhow::Result<BTreeSet<String>> {
    let repository = fixture.repository().await?;
    let (snapshots, damaged) = repository.list_snapshots().await?;
    anyhow::ensure!(damaged.is_empty(), "damaged snapshots: {damaged:?}");
    Ok(snapshots.iter().map(|(id, _)| id.to_hex()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_backup_with_deletion_policy_delete_forgets_exactly_its_snapshots()
-> anyhow::Result<()> {
    let fixture = Fixture::builder().start().await?;
    let client = &fixture.client;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    create_backup_with(
        client,
        "doomed",
        &["db", "archive"],
        json!({"deletionPolicy": "Delete"}),
    )
    .await?;
    create_backup_with(client, "kept", &["content"], json!({})).await?;
    create_backup_with(
        client,
        "stuck",
        &["logs"],
        json!({"deletionPolicy": "Delete"}),
    )
    .await?;
    let doomed = final_phase(&backups, &fixture.kubelet, "doomed", BACKUP_DEADLINE).await?;
    let kept = final_phase(&backups, &fixture.kubelet, "kept", BACKUP_DEADLINE).await?;
    let stuck = final_phase(&backups, &fixture.kubelet, "stuck", BACKUP_DEADLINE).await?;
    let (doomed_ids, kept_ids, stuck_ids) = (
        snapshot_ids(&doomed)?,
        snapshot_ids(&kept)?,
        snapshot_ids(&stuck)?,
    );
    assert_eq!(
        (doomed_ids.len(), kept_ids.len(), stuck_ids.len()),
        (2, 1, 1)
    );
    assert!(
        doomed.finalizers().iter().any(|f| f == FORGET_FINALIZER),
        "{:?}",
        doomed.finalizers()
    );
    assert!(
        !kept.finalizers().iter().any(|f| f == FORGET_FINALIZER),
        "{:?}",
        kept.finalizers()
    );
    let all: BTreeSet<String> = doomed_ids
        .iter()
        .chain(&kept_ids)
        .chain(&stuck_ids)
        .cloned()
        .collect();
    assert_eq!(repository_snapshots(&fixture).await?, all);

    // Deleting `doomed` forgets its two snapshots, and only those.
    backups.delete("doomed", &DeleteParams::default()).await?;
    eventually(Duration::from_secs(120), || async {
        Ok(backups.get_opt("doomed").await?.is_none().then_some(()))
    })
    .await
    .context("the forget finalizer was not released")?;
    let remaining = repository_snapshots(&fixture).await?;
    let expected: BTreeSet<String> = kept_ids.union(&stuck_ids).cloned().collect();
    assert_eq!(remaining, expected, "doomed's were {doomed_ids:?}");

    // A forget that cannot reach the repository (the credentials now
    // refused) keeps the finalizer and says what to do ...
    let secrets: Api<Secret> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    secrets
        .patch(
            "s3-credentials",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"cloud":
                "[default]\naws_access_key_id = nobody\naws_secret_access_key = wrong-secret\n"}})),
        )
        .await?;
    backups.delete("stuck", &DeleteParams::default()).await?;
    let message = eventually(Duration::from_secs(120), || async {
        let backup = backups.get("stuck").await?;
        let status = backup.status.unwrap_or_default();
        Ok(
            find_condition(&status.conditions, condition_type::SNAPSHOTS_FORGOTTEN)
                .filter(|condition| {
                    condition.status == ConditionStatus::False
                        && condition.reason == reason::FORGET_FAILED
                })
                .map(|condition| condition.message.clone()),
        )
    })
    .await
    .context("no ForgetFailed condition on the deleted backup")?;
    for needle in [
        "VolumeBackup haulage-system/stuck",
        "BackupStorageLocation minio",
        "deletionPolicy: Retain",
    ] {
        assert!(message.contains(needle), "{needle}: {message}");
    }
    assert!(!message.contains("wrong-secret"), "{message}");
    assert_eq!(repository_snapshots(&fixture).await?, expected);

    // ... and setting the policy to Retain lets it go with its snapshot.
    backups
        .patch(
            "stuck",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"deletionPolicy": "Retain"}})),
        )
        .await?;
    eventually(Duration::from_secs(60), || async {
        Ok(backups.get_opt("stuck").await?.is_none().then_some(()))
    })
    .await
    .context("setting deletionPolicy Retain did not release the finalizer")?;
    assert_eq!(repository_snapshots(&fixture).await?, expected);
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_finished_backup_is_deleted_when_its_ttl_is_over() -> anyhow::Result<()> {
    let fixture = Fixture::builder().start().await?;
    let client = &fixture.client;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    // Long enough to see it Completed first; Delete, so its snapshot goes
    // with it. A backup without a ttl stays.
    create_backup_with(
        client,
        "brief",
        &["db"],
        json!({"ttl": "20s", "deletionPolicy": "Delete"}),
    )
    .await?;
    create_backup_with(client, "lasting", &["content"], json!({})).await?;
    let brief = final_phase(&backups, &fixture.kubelet, "brief", BACKUP_DEADLINE).await?;
    let lasting = final_phase(&backups, &fixture.kubelet, "lasting", BACKUP_DEADLINE).await?;
    let (brief_ids, lasting_ids) = (snapshot_ids(&brief)?, snapshot_ids(&lasting)?);
    eventually(Duration::from_secs(120), || async {
        Ok(backups.get_opt("brief").await?.is_none().then_some(()))
    })
    .await
    .context("the backup was not deleted after its ttl")?;
    assert!(backups.get_opt("lasting").await?.is_some());
    assert_eq!(
        repository_snapshots(&fixture).await?,
        lasting_ids,
        "brief's were {brief_ids:?}"
    );
    fixture.stop().await;
    Ok(())
}
