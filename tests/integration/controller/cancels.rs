//! Cancel by delete in every phase of a transfer, counted: round after
//! round a VolumeBackup of two claims under a StoragePolicy of one volume
//! at a time is deleted while one of its transfers is `Queued`, while one
//! is `Admitted` (its stage pod not yet claiming it), or while a pack is
//! in flight as an S3 multipart upload (packs of 80 MiB, above the store's
//! 64 MiB multipart threshold, uploaded at 8 MiB/s, so the check can
//! fail). After each: the finalizer is released, and once every agent
//! has exited no stage pod, no copy of the credentials, no VolumeTransfer
//! and no multipart upload (ListMultipartUploads) is left: the pack in
//! flight was completed or aborted before its agent exited (the test fails
//! with an agent that exits at once on SIGTERM), and no canceled backup
//! wrote a snapshot (before the engine's last uploads stopped at a cancel,
//! every backup deleted with a pack in flight finished its volume and
//! wrote one). It counts the rounds whose pack in flight was completed
//! rather than aborted.
//!
//! In CI: 2 rounds of each phase. The full count of docs/benchmarks.md:
//! `HAULAGE_CANCEL_ROUNDS=20 cargo test --test integration
//! controller::cancels -- --nocapture`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{VolumeBackup, VolumeTransfer, VolumeTransferPhase};
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;

use crate::support::fixture::{
    BUCKET, Fixture, Layout, PROVISIONER, create_backup_in, create_storage_policy, eventually,
    nothing_left_of_deleted,
};

/// The phase a backup is deleted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Moment {
    /// One of its transfers waits for the policy's one place.
    Queued,
    /// One is admitted and its agent has not claimed it yet.
    Admitted,
    /// A pack is in flight as a multipart upload.
    UploadingMultipart,
}

/// Whether the backup's transfers or the bucket show `moment` now.
async fn reached(
    fixture: &Fixture,
    transfers: &Api<VolumeTransfer>,
    moment: Moment,
) -> anyhow::Result<bool> {
    let phases: Vec<VolumeTransferPhase> = transfers
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(VolumeTransfer::phase)
        .collect();
    Ok(match moment {
        Moment::Queued => phases.contains(&VolumeTransferPhase::Queued),
        Moment::Admitted => phases.contains(&VolumeTransferPhase::Admitted),
        Moment::UploadingMultipart => !fixture
            .minio
            .multipart_uploads(BUCKET, "")
            .await?
            .is_empty(),
    })
}

/// Remove what the canceled backups stored (a pack in flight at the
/// cancel may have been completed before its agent exited), so the next
/// round uploads its first pack again, as a multipart upload; returns the
/// objects removed and, among them, the snapshots (none is expected).
async fn forget_stored_data(fixture: &Fixture) -> anyhow::Result<(usize, usize)> {
    let (mut removed, mut snapshots) = (0, 0);
    for prefix in [
        haulage::repo::SNAPSHOT_PREFIX,
        haulage::repo::INDEX_PREFIX,
        haulage::repo::DATA_PREFIX,
    ] {
        for object in fixture.store.list(prefix).await? {
            fixture.store.delete(&object.key).await?;
            removed += 1;
            if prefix == haulage::repo::SNAPSHOT_PREFIX {
                snapshots += 1;
            }
        }
    }
    Ok((removed, snapshots))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_deleted_in_every_phase_of_its_transfers_leaves_nothing_behind_counted()
-> anyhow::Result<()> {
    let rounds = crate::support::number_from_env("HAULAGE_CANCEL_ROUNDS", 2) as usize;
    let claims = ["one", "two"];
    let layout = Layout {
        namespaces: vec!["solo".to_string()],
        claims: claims
            .iter()
            .zip(1_u64..)
            .map(|(name, seed)| ("solo".to_string(), name.to_string(), "ReadWriteOnce", seed))
            .collect(),
        nodes: vec!["node-0".to_string()],
        app_pods: Vec::new(),
    };
    // 96 MiB of random data per claim in 80 MiB packs: the first pack of
    // a transfer is a multipart upload of 10 s at 8 MiB/s; what a round
    // stored is removed after it, so every round starts from an empty
    // repository.
    let fixture = Fixture::builder()
        .layout(layout)
        .volume_bytes(96 << 20)
        .random_data_in_packs_of(80 << 20)
        .upload_bytes_per_second(8 << 20)
        .start()
        .await?;
    let client = &fixture.client;
    create_storage_policy(
        client,
        "one-at-a-time",
        // Memory for whole 80 MiB packs: the stage pod's two engines each
        // get at most a whole engine's share, where the default 128Mi
        // would give each half of what it leaves, and packs under 40 MiB
        // (no multipart upload to cancel).
        json!({"provisioners": [PROVISIONER], "maxConcurrentVolumes": 1,
            "stagePodResources": {"requests": {"memory": "256Mi"}}}),
    )
    .await?;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), "solo");
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mut hit: BTreeMap<Moment, usize> = BTreeMap::new();
    let mut missed: BTreeMap<Moment, usize> = BTreeMap::new();
    // Multipart rounds whose pack in flight was completed, not aborted.
    let mut packs_completed = 0;
    // Snapshots the canceled backups' agents wrote before they stopped.
    let mut snapshots_written = 0;
    let began = Instant::now();
    let moments = [Moment::Queued, Moment::Admitted, Moment::UploadingMultipart];
    for round in 0..rounds {
        for moment in moments {
            let name = format!("cancel-{round}-{}", format!("{moment:?}").to_lowercase());
            create_backup_in(client, &name, &["solo"], json!({})).await?;
            // Looked for every 20 ms: an admitted transfer is claimed
            // within a few hundred milliseconds.
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut seen = false;
            while Instant::now() < deadline {
                if reached(&fixture, &transfers, moment).await? {
                    seen = true;
                    break;
                }
                let finished = transfers
                    .list(&ListParams::default())
                    .await?
                    .items
                    .iter()
                    .any(|transfer| transfer.phase() >= VolumeTransferPhase::InProgress);
                if finished && moment == Moment::Admitted {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            *(if seen { &mut hit } else { &mut missed })
                .entry(moment)
                .or_default() += 1;
            assert!(
                seen || moment == Moment::Admitted,
                "round {round}: {moment:?} never seen:\n{}",
                fixture.kubelet.all_agent_logs()
            );
            backups.delete(&name, &DeleteParams::default()).await?;
            eventually(Duration::from_secs(60), || async {
                Ok(backups.get_opt(&name).await?.is_none().then_some(()))
            })
            .await
            .with_context(|| format!("round {round}, {moment:?}: the finalizer stayed"))?;
            nothing_left_of_deleted(&fixture, &name, async || {
                Ok(transfers.list(&ListParams::default()).await?.items.len())
            })
            .await?;
            // Every agent has exited: what is left now stays.
            let uploads = fixture.minio.multipart_uploads(BUCKET, "").await?;
            assert!(
                uploads.is_empty(),
                "round {round}, {moment:?}: multipart uploads left in the bucket: {uploads:?}"
            );
            let (removed, snapshots) = forget_stored_data(&fixture).await?;
            if moment == Moment::UploadingMultipart && removed > 0 {
                packs_completed += 1;
            }
            snapshots_written += snapshots;
        }
    }
    let backups_deleted = rounds * moments.len();
    println!(
        "cancels: {backups_deleted} backups deleted in {:.0} s ({:.1} s a round), by phase hit {hit:?}, an admitted transfer claimed before the delete {missed:?}; nothing left after any; the pack in flight completed in {packs_completed} of the {rounds} multipart rounds, aborted in the others; {snapshots_written} snapshots written by canceled backups",
        began.elapsed().as_secs_f64(),
        began.elapsed().as_secs_f64() / backups_deleted as f64
    );
    assert_eq!(snapshots_written, 0, "canceled backups wrote snapshots");
    assert_eq!(
        hit.get(&Moment::UploadingMultipart),
        Some(&rounds),
        "every multipart round was hit"
    );
    fixture.stop().await;
    Ok(())
}
