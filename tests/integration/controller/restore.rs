//! VolumeRestores end to end: the snapshots of a VolumeBackup restored by
//! the controller and the real agents into new claims of other
//! namespaces, byte- and metadata-identical, each claim labelled complete
//! and each transfer verified against its snapshot's root tree; a cutover
//! pass (`existingClaim: Sync`) into the restored claim that writes only
//! what changed and removes what was deleted; and a restore agent killed
//! mid-way, whose restarted self finishes without writing again what was
//! already written; a StoragePolicy of one volume on the destination class
//! watched never exceeded by the restore's transfers, and the restore
//! deleted mid-way leaving no transfer, stage pod, credentials copy or
//! agent, and no claim marked complete.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use haulage::api::condition::{ConditionStatus, condition_type, find_condition, reason};
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::restore::VolumeRestorePhase;
use haulage::api::{VolumeBackup, VolumeRestore, VolumeTransfer, VolumeTransferPhase};
use haulage::reconcile::claims::{RESTORE_COMPLETE, RESTORE_STATE_LABEL, RESTORED_FROM_ANNOTATION};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, ListParams};
use serde_json::json;

use crate::engine::support::{
    assert_same_tree, haulage, make_fifo, random_bytes, set_xattr, write_sparse_file,
};
use crate::support::audit;
use crate::support::fixture::{
    BACKUP_DEADLINE, BUCKET, Fixture, PREFIX, PROVISIONER, bytes_done, create, create_backup,
    create_backup_of_claim, create_restore_of_backup, create_storage_policy, eventually,
    final_phase, no_leftovers, nothing_left_of_deleted,
};
use crate::support::minio::with_s3_credentials;

/// Entries of every kind a restore must bring back as they were, added to
/// a claim's sample data: owners, a setgid directory, a hard link, a
/// symlink, a FIFO, an extended attribute, a sparse file, an old mtime.
fn add_entries_of_every_kind(claim: &Path) -> anyhow::Result<()> {
    let special = claim.join("special");
    std::fs::create_dir_all(special.join("shared"))?;
    std::fs::write(special.join("owned"), b"owned by 1000:2000")?;
    std::os::unix::fs::chown(special.join("owned"), Some(1000), Some(2000))?;
    std::os::unix::fs::chown(special.join("shared"), Some(1000), Some(2000))?;
    std::fs::set_permissions(
        special.join("shared"),
        std::os::unix::fs::PermissionsExt::from_mode(0o2770),
    )?;
    std::fs::write(special.join("linked"), b"one inode, two names")?;
    std::fs::hard_link(special.join("linked"), special.join("shared/also-linked"))?;
    std::os::unix::fs::symlink("../large/app.log", special.join("log"))?;
    make_fifo(&special.join("pipe"), 0o620)?;
    set_xattr(&special.join("owned"), "user.origin", b"cluster-a")?;
    write_sparse_file(
        &special.join("sparse.img"),
        16 << 20,
        &random_bytes(9, 8192),
        8 << 20,
    )?;
    std::fs::File::options()
        .write(true)
        .open(special.join("linked"))?
        .set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1_500_000_000))?;
    Ok(())
}

/// `haulage ARGS` against the fixture's MinIO with the standard
/// variables, as a user on the destination side runs it.
fn haulage_against(fixture: &Fixture) -> std::process::Command {
    let mut command = haulage();
    with_s3_credentials(&mut command, &fixture.minio.endpoint());
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_volume_restore_restores_a_backups_snapshots_into_new_claims_verified_and_identical()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .volume_bytes(2 << 20)
        .provisioning()
        .audited()
        .start()
        .await?;
    let client = &fixture.client;
    add_entries_of_every_kind(&fixture.volumes.join("shop/db"))?;
    create_backup(client, "nightly").await?;
    fixture.completed_backup("nightly", BACKUP_DEADLINE).await?;

    // What the destination's team sees in the location before restoring.
    let listed = haulage_against(&fixture)
        .args([
            "snapshots",
            "--repo",
            &format!("s3://{BUCKET}/{PREFIX}"),
            "--namespace",
            "shop",
            "--backup",
            "nightly",
            "-o",
            "json",
        ])
        .output()?;
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&listed.stdout)?;
    let mut claims: Vec<&str> = listed
        .iter()
        .filter_map(|snapshot| snapshot["claim"]["name"].as_str())
        .collect();
    claims.sort_unstable();
    assert_eq!(claims, ["archive", "db", "uploads"], "{listed:#?}");
    for snapshot in &listed {
        assert_eq!(snapshot["claim"]["namespace"], "shop");
        assert_eq!(
            snapshot["claim"]["backup"],
            format!("{SYSTEM_NAMESPACE}/nightly")
        );
        assert!(
            snapshot["tree"]
                .as_str()
                .is_some_and(|tree| tree.len() == 64)
        );
    }

    create_restore_of_backup(client, "move", "nightly").await?;
    let status = fixture.completed_restore("move", BACKUP_DEADLINE).await?;
    let counts = status.volumes.clone().context("volume counts")?;
    assert_eq!((counts.total, counts.completed), (5, 5), "{status:#?}");
    assert_eq!(
        status.storage_location.as_deref(),
        Some("minio"),
        "the default location, recorded with the selection"
    );

    let repository = fixture.repository().await?;
    for result in &status.results {
        let destination = format!("{}/{}", result.namespace, result.pvc);
        let source_namespace = result
            .namespace
            .strip_suffix("-b")
            .context("a mapped namespace")?;
        // Byte- and metadata-identical to the claim that was backed up.
        assert_same_tree(
            &fixture.volumes.join(source_namespace).join(&result.pvc),
            &fixture.volumes.join(&result.namespace).join(&result.pvc),
        );
        // Labelled complete, never mistaken for a half-written one.
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &result.namespace);
        let claim = claims.get(&result.pvc).await?;
        assert_eq!(
            claim
                .metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get(RESTORE_STATE_LABEL))
                .map(String::as_str),
            Some(RESTORE_COMPLETE),
            "{destination}"
        );
        // Verified against the snapshot's root tree, by the agent.
        let snapshot = repository
            .load_snapshot(&repository.resolve_snapshot(&result.snapshot_id).await?)
            .await?;
        let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), &result.namespace);
        let transfer = transfers
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|transfer| transfer.spec.pvc == result.pvc)
            .with_context(|| format!("no transfer of {destination}"))?;
        let transfer_status = transfer.status.context("transfer status")?;
        assert_eq!(transfer_status.phase, Some(VolumeTransferPhase::Completed));
        assert_eq!(
            transfer_status.verified_tree.as_deref(),
            Some(snapshot.tree.to_hex().as_str()),
            "{destination}"
        );
        assert_eq!(result.verified_tree, transfer_status.verified_tree);
        let verified = find_condition(&transfer_status.conditions, condition_type::VERIFIED)
            .context("Verified condition")?;
        assert_eq!(
            (verified.status, verified.reason.as_str()),
            (ConditionStatus::True, reason::TREE_VERIFIED)
        );
        assert!(verified.message.contains(&snapshot.tree.to_hex()));
        let written = transfer_status.bytes_written.context("bytesWritten")?;
        assert!(
            written > 0 && written as u64 <= snapshot.summary.total_bytes,
            "{destination}: {written} of {}",
            snapshot.summary.total_bytes
        );
        let progress = transfer_status.progress.context("progress")?;
        assert_eq!(progress.percent, 100, "{destination}");
    }
    // The sparse file stayed sparse.
    let sparse = std::fs::metadata(fixture.volumes.join("shop-b/db/special/sparse.img"))?;
    assert!(sparse.blocks() * 512 < 1 << 20, "restored dense");

    no_leftovers(client).await?;
    // The backup's and the restore's stage pods were each released once:
    // no pod, RoleBinding, Role or credentials copy deleted twice.
    let controller = audit::service_account(SYSTEM_NAMESPACE, "haulage-controller");
    let repeated = audit::deleted_more_than_once(&fixture.cluster.audit_requests()?, &controller);
    assert!(repeated.is_empty(), "deleted more than once: {repeated:#?}");
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_restore_agent_is_restarted_and_finishes_without_writing_again_what_it_wrote()
-> anyhow::Result<()> {
    const VOLUME_BYTES: i64 = 12 << 20;
    // 12 MiB of random data in 1 MiB packs, written at 1 MiB/s (a
    // StoragePolicy on the destination class): the kill lands mid-way.
    let fixture = Fixture::builder()
        .volume_bytes(VOLUME_BYTES as u64)
        .random_data_in_small_packs()
        .provisioning()
        .start()
        .await?;
    let client = &fixture.client;
    create_backup_of_claim(client, "archive-only", "archive").await?;
    fixture
        .completed_backup("archive-only", BACKUP_DEADLINE)
        .await?;
    // Created after the backup, so only the restore's writes are capped.
    create_storage_policy(
        client,
        "slow-writes",
        json!({"provisioners": [PROVISIONER], "maxBytesPerSecond": 1 << 20}),
    )
    .await?;

    create_restore_of_backup(client, "resumed", "archive-only").await?;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), "shop-b");
    let victim = eventually(Duration::from_secs(120), || async {
        Ok(transfers
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|transfer| {
                let status = transfer.status.clone().unwrap_or_default();
                status.phase == Some(VolumeTransferPhase::InProgress)
                    && status
                        .progress
                        .is_some_and(|progress| progress.bytes_done >= 3 << 20)
            }))
    })
    .await
    .with_context(|| {
        format!(
            "the restore never got a quarter done:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    assert_eq!(
        victim.spec.granted_bytes_per_second,
        Some(1 << 20),
        "the policy's cap is the restore's grant"
    );
    let starts_before = fixture
        .kubelet
        .kill_running("shop-b", &victim.spec.stage_pod);

    fixture
        .completed_restore("resumed", BACKUP_DEADLINE)
        .await?;
    fixture.kubelet.assert_restarted_since(starts_before);
    let finished = transfers
        .get(&victim.metadata.name.clone().context("name")?)
        .await?
        .status
        .context("transfer status")?;
    let written = finished.bytes_written.context("bytesWritten")?;
    println!("the restarted agent wrote {written} of {VOLUME_BYTES} bytes");
    assert!(
        written + (2 << 20) <= VOLUME_BYTES,
        "the restarted agent wrote {written} of {VOLUME_BYTES} bytes: it rewrote what was there\n{}",
        fixture.kubelet.all_agent_logs()
    );
    assert!(finished.verified_tree.is_some(), "{finished:#?}");
    assert_same_tree(
        &fixture.volumes.join("shop/archive"),
        &fixture.volumes.join("shop-b/archive"),
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cutover_restore_into_the_restored_claim_writes_only_what_changed_and_removes_extras()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .volume_bytes(4 << 20)
        .provisioning()
        .start()
        .await?;
    let client = &fixture.client;
    let source = fixture.volumes.join("shop/db");
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let restores: Api<VolumeRestore> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    create_backup_of_claim(client, "first", "db").await?;
    final_phase(&backups, &fixture.kubelet, "first", BACKUP_DEADLINE).await?;
    create_restore_of_backup(client, "first", "first").await?;
    let first = final_phase(&restores, &fixture.kubelet, "first", BACKUP_DEADLINE).await?;
    let first = first.status.context("the first restore's status")?;
    assert_eq!(first.phase, Some(VolumeRestorePhase::Completed));
    let first_snapshot = first.selection[0].snapshot_id.clone();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "shop-b");
    let holds = |claim: &PersistentVolumeClaim| {
        (
            claim
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(RESTORE_STATE_LABEL).cloned()),
            claim
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(RESTORED_FROM_ANNOTATION).cloned()),
        )
    };
    assert_eq!(
        holds(&claims.get("db").await?),
        (
            Some(RESTORE_COMPLETE.to_string()),
            Some(first_snapshot.clone())
        ),
        "the restored claim says which snapshot it holds completely"
    );

    // The application goes on writing on the source side: one file added,
    // one rewritten, one deleted.
    const ADDED: usize = 100 << 10;
    const REWRITTEN: usize = 10 << 10;
    std::fs::write(source.join("added.bin"), random_bytes(77, ADDED))?;
    let small = crate::engine::support::files_under(&source.join("small"));
    std::fs::write(&small[0].0, random_bytes(78, REWRITTEN))?;
    std::fs::remove_file(&small[1].0)?;
    create_backup_of_claim(client, "cutover", "db").await?;
    final_phase(&backups, &fixture.kubelet, "cutover", BACKUP_DEADLINE).await?;
    create::<VolumeRestore>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeRestore",
            "metadata": {"name": "cutover", "namespace": SYSTEM_NAMESPACE},
            "spec": {"source": {"backup": "cutover"},
                "namespaceMap": {"shop": "shop-b"}, "existingClaim": "Sync"}}),
    )
    .await?;
    let status = fixture
        .completed_restore("cutover", BACKUP_DEADLINE)
        .await?;
    assert_eq!(
        status.selection[0].action,
        haulage::api::restore::ClaimAction::Sync
    );
    let transfer = Api::<VolumeTransfer>::namespaced(client.clone(), "shop-b")
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|transfer| transfer.spec.backup_ref.name.eq("cutover"))
        .context("the cutover's transfer")?;
    let transfer_status = transfer.status.context("transfer status")?;
    let written = transfer_status.bytes_written.context("bytesWritten")?;
    let total = crate::engine::support::files_under(&source)
        .iter()
        .map(|(_, size)| size)
        .sum::<u64>() as i64;
    println!("the cutover pass wrote {written} of {total} bytes");
    assert!(
        written >= (ADDED + REWRITTEN) as i64 && written <= (ADDED + REWRITTEN) as i64 + (64 << 10),
        "the cutover pass wrote {written} bytes for {} changed ({total} in the claim)",
        ADDED + REWRITTEN
    );
    assert!(
        transfer_status
            .entries_removed
            .is_some_and(|removed| removed >= 1)
    );
    assert!(
        transfer_status
            .files_unchanged
            .is_some_and(|unchanged| unchanged > 10)
    );
    assert!(transfer_status.verified_tree.is_some());
    assert_same_tree(&source, &fixture.volumes.join("shop-b/db"));
    // The pass read only what changed: the agent was told the snapshot the
    // claim held, skipped the rest in the sync and in its verification, and
    // the claim now says it holds the cutover's snapshot.
    assert_eq!(
        transfer.spec.since_snapshot.as_deref(),
        Some(first_snapshot.as_str())
    );
    let logs = fixture.kubelet.all_agent_logs();
    let unread: Vec<u64> = logs
        .match_indices("files_not_read=")
        .filter_map(|(at, key)| {
            logs[at + key.len()..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        unread.iter().filter(|files| **files > 10).count() >= 2,
        "the sync and its verification read every file ({unread:?}):\n{logs}"
    );
    assert_eq!(
        holds(&claims.get("db").await?),
        (
            Some(RESTORE_COMPLETE.to_string()),
            Some(status.selection[0].snapshot_id.clone())
        )
    );
    fixture.stop().await;
    Ok(())
}

/// The phases in which a transfer holds a slot of its StoragePolicy.
fn holds_a_slot(transfer: &VolumeTransfer) -> bool {
    matches!(
        transfer.phase(),
        VolumeTransferPhase::Admitted
            | VolumeTransferPhase::InProgress
            | VolumeTransferPhase::Finalizing
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storage_policy_caps_restores_and_a_restore_deleted_mid_way_leaves_nothing_running_or_complete()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .volume_bytes(4 << 20)
        .random_data_in_small_packs()
        .provisioning()
        .start()
        .await?;
    let client = &fixture.client;
    create_backup(client, "nightly").await?;
    fixture.completed_backup("nightly", BACKUP_DEADLINE).await?;
    // Created after the backup: one restored volume at a time, slowly.
    create_storage_policy(
        client,
        "one-restore-at-a-time",
        json!({"provisioners": [PROVISIONER], "maxConcurrentVolumes": 1,
                "maxBytesPerSecond": 512 << 10}),
    )
    .await?;
    create_restore_of_backup(client, "doomed", "nightly").await?;

    // Watched from the first transfer on: never two holding a slot.
    let destination_transfers = || async {
        let mut all = Vec::new();
        for namespace in ["shop-b", "web-b"] {
            let api: Api<VolumeTransfer> = Api::namespaced(client.clone(), namespace);
            all.extend(api.list(&ListParams::default()).await?.items);
        }
        anyhow::Ok(all)
    };
    // Errors inside `eventually` are retried, so a violation is recorded
    // here and asserted after each wait.
    let most_holding = AtomicUsize::new(0);
    let looks = AtomicUsize::new(0);
    let record = |holding: &[String]| {
        looks.fetch_add(1, Ordering::SeqCst);
        if most_holding.fetch_max(holding.len(), Ordering::SeqCst) < holding.len()
            && holding.len() > 1
        {
            println!("the policy of one volume was exceeded: {holding:?} hold slots at once");
        }
    };
    let queued = eventually(Duration::from_secs(120), || async {
        let transfers = destination_transfers().await?;
        let holding: Vec<String> = transfers
            .iter()
            .filter(|transfer| holds_a_slot(transfer))
            .filter_map(|transfer| transfer.metadata.name.clone())
            .collect();
        record(&holding);
        let moving = transfers.iter().any(|transfer| {
            transfer.phase() == VolumeTransferPhase::InProgress && bytes_done(transfer) >= 1 << 20
        });
        let queued = transfers
            .iter()
            .filter(|transfer| transfer.phase() == VolumeTransferPhase::Queued)
            .count();
        Ok((moving && queued >= 2).then_some(queued))
    })
    .await
    .with_context(|| {
        format!(
            "no restore transfer got going with others queued behind it:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    println!("one restore transfer moves, {queued} are queued behind it");
    assert!(fixture.kubelet.running_agents() > 0, "agents already done");

    let restores: Api<VolumeRestore> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    restores
        .delete("doomed", &kube::api::DeleteParams::default())
        .await?;
    eventually(Duration::from_secs(60), || async {
        let holding: Vec<String> = destination_transfers()
            .await?
            .iter()
            .filter(|transfer| holds_a_slot(transfer))
            .filter_map(|transfer| transfer.metadata.name.clone())
            .collect();
        record(&holding);
        Ok(restores.get_opt("doomed").await?.is_none().then_some(()))
    })
    .await
    .context("the deleted VolumeRestore's finalizer was not released")?;
    nothing_left_of_deleted(&fixture, "restore", async || {
        Ok(destination_transfers().await?.len())
    })
    .await?;
    // Its claims stay (what was written is not thrown away), none of them
    // marked complete.
    for namespace in ["shop-b", "web-b"] {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
        for claim in claims.list(&ListParams::default()).await?.items {
            let state = claim
                .metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get(RESTORE_STATE_LABEL).cloned());
            assert_ne!(
                state.as_deref(),
                Some(RESTORE_COMPLETE),
                "claim {namespace}/{} of a deleted restore is marked complete",
                claim.metadata.name.unwrap_or_default()
            );
        }
    }
    let (most, looks) = (
        most_holding.load(Ordering::SeqCst),
        looks.load(Ordering::SeqCst),
    );
    println!("at most {most} transfer held a slot of the policy over {looks} looks");
    assert!(
        most <= 1,
        "a policy of one volume had {most} restore transfers holding slots at once"
    );
    fixture.stop().await;
    Ok(())
}
