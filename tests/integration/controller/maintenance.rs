//! A BackupStorageLocation's scheduled maintenance on the real API server
//! and MinIO: with `spec.maintenance`, the controller prunes the
//! repository (the data of a deleted `deletionPolicy: Delete` backup goes),
//! defers its deletions while a transfer holds the repository's shared
//! lock (naming the holder), records each prune in `status.maintenance`,
//! and every snapshot left verifies.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use haulage::api::BackupStorageLocation;
use haulage::api::VolumeBackup;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::location::{MaintenanceResult, MaintenanceStatus};
use haulage::engine::lock::RepositoryLock;
use haulage::engine::progress::Progress;
use haulage::repo::lock::LockKind;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, create_backup_with_spec, eventually, final_phase,
};

/// How long a scheduled prune may take to show: the maintenance loop's
/// look, the exclusive lock's wait and the prune itself.
const MAINTENANCE_DEADLINE: Duration = Duration::from_secs(150);

/// Bytes of the repository's packs in the bucket.
async fn stored_pack_bytes(fixture: &Fixture) -> anyhow::Result<u64> {
    let repository = fixture.repository().await?;
    let packs = repository.store().list(haulage::repo::DATA_PREFIX).await?;
    Ok(packs.iter().map(|pack| pack.size).sum())
}

/// Wait until `status.maintenance` of the location `minio` records a
/// prune that ended with `result` for the location's current generation.
async fn prune_recorded(
    locations: &Api<BackupStorageLocation>,
    result: MaintenanceResult,
) -> anyhow::Result<MaintenanceStatus> {
    eventually(MAINTENANCE_DEADLINE, || async {
        let location = locations.get("minio").await?;
        let maintenance = location
            .status
            .and_then(|status| status.maintenance)
            .filter(|maintenance| {
                maintenance.result == Some(result)
                    && maintenance.observed_generation == location.metadata.generation
            });
        Ok(maintenance)
    })
    .await
    .with_context(|| format!("no {result:?} prune was recorded"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_controller_prunes_a_location_on_schedule_and_defers_deletions_while_it_is_in_use()
-> anyhow::Result<()> {
    let fixture = Fixture::builder().start().await?;
    let client = &fixture.client;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let selecting = |claims: &[&str]| {
        json!({"namespaces": ["shop", "web"],
            "selector": {"matchExpressions": [{"key": "claim", "operator": "In", "values": claims}]}})
    };
    let mut doomed = selecting(&["db", "archive"]);
    doomed["deletionPolicy"] = json!("Delete");
    create_backup_with_spec(client, "doomed", doomed).await?;
    create_backup_with_spec(client, "kept", selecting(&["content"])).await?;
    final_phase(&backups, &fixture.kubelet, "doomed", BACKUP_DEADLINE).await?;
    let kept = final_phase(&backups, &fixture.kubelet, "kept", BACKUP_DEADLINE).await?;
    let kept_ids: BTreeSet<String> = kept
        .status
        .context("kept's status")?
        .results
        .iter()
        .filter_map(|result| result.snapshot_id.clone())
        .collect();
    assert_eq!(kept_ids.len(), 1);
    backups.delete("doomed", &DeleteParams::default()).await?;
    eventually(Duration::from_secs(120), || async {
        Ok(backups.get_opt("doomed").await?.is_none().then_some(()))
    })
    .await
    .context("doomed's snapshots were not forgotten")?;
    let before = stored_pack_bytes(&fixture).await?;

    // A transfer of another cluster holds the repository: the scheduled
    // prune plans and marks, and defers its deletions naming the holder.
    let repository = fixture.repository().await?;
    let holder = RepositoryLock::acquire(
        &repository,
        LockKind::Shared,
        "backup of claim shop/orders on cluster b",
        Duration::from_secs(5),
    )
    .await?;
    locations
        .patch(
            "minio",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"maintenance": {"interval": "1h", "safetyMargin": "0"}}}),
            ),
        )
        .await?;
    let deferred = prune_recorded(&locations, MaintenanceResult::Deferred).await?;
    let message = deferred.message.clone().unwrap_or_default();
    assert!(
        message.contains("shop/orders on cluster b"),
        "the holder is named: {message}"
    );
    assert_eq!(deferred.deleted_packs, Some(0), "{deferred:#?}");
    assert_eq!(
        stored_pack_bytes(&fixture).await?,
        before,
        "nothing deleted"
    );
    assert!(deferred.last_start_time.is_some() && deferred.last_completion_time.is_some());

    // Free again; an edit of the location runs the next prune at once, and
    // it deletes what only the forgotten snapshots needed.
    holder.release().await?;
    locations
        .patch(
            "minio",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"maintenance": {"safetyMargin": "0s"}}})),
        )
        .await?;
    let pruned = prune_recorded(&locations, MaintenanceResult::Succeeded).await?;
    let after = stored_pack_bytes(&fixture).await?;
    assert!(
        pruned.deleted_packs.unwrap_or(0) > 0,
        "the forgotten snapshots' packs go: {pruned:#?}"
    );
    assert_eq!(
        pruned.reclaimed_bytes,
        Some(i64::try_from(before - after)?),
        "the status reports the bytes the bucket lost: {pruned:#?}"
    );
    let location = locations.get("minio").await?;
    assert!(
        location.status.as_ref().is_some_and(
            |status| status.phase == Some(haulage::api::BackupStorageLocationPhase::Available)
        ),
        "the location reconciler keeps its own status beside the prune's: {:?}",
        location.status
    );
    assert_eq!(
        location.status.and_then(|status| status.maintenance),
        Some(pruned.clone()),
        "the location's probes do not undo the prune's record"
    );

    // What is left is exactly the kept backup's snapshot, and it verifies.
    let repository = fixture.repository().await?;
    let (snapshots, damaged) = repository.list_snapshots().await?;
    assert!(damaged.is_empty(), "{damaged:?}");
    let left: BTreeSet<String> = snapshots.iter().map(|(id, _)| id.to_hex()).collect();
    assert_eq!(left, kept_ids);
    let report =
        haulage::engine::verify::verify(&repository, None, Arc::new(Progress::default())).await?;
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.snapshots, 1);
    assert!(
        haulage::engine::lock::list_locks(&repository)
            .await?
            .is_empty(),
        "every lock (agents', prune's) is released"
    );
    fixture.stop().await;
    Ok(())
}
