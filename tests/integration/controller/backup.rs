//! VolumeBackups end to end: every selected claim moved and restorable
//! byte-identical (the happy path, with `haulage plan` and `haulage
//! describe`), a killed agent resuming without sending stored packs again
//! (incremental), and a backup deleted mid-transfer (cancel) leaving
//! nothing behind.

use std::time::Duration;

use anyhow::Context;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{VolumeBackup, VolumeTransfer, VolumeTransferPhase};
use haulage::engine::Repository;
use kube::api::{Api, DeleteParams, ListParams};

use crate::engine::support::assert_snapshot_restores_as;
use crate::support::fixture::{
    BACKUP_DEADLINE, BUCKET, Fixture, create_backup, create_backup_of_claim, eventually,
    no_leftovers, nothing_left_of_deleted,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_volume_backup_moves_every_selected_claim_into_the_storage_location() -> anyhow::Result<()>
{
    let fixture = Fixture::builder().volume_bytes(2 << 20).start().await?;
    let Fixture {
        client,
        kubelet: _,
        volumes,
        store,
        minio,
        work,
        ..
    } = &fixture;
    // `haulage plan` against the live cluster (the current kubeconfig
    // context), before the backup: read-only lists, the same planner.
    let planned = std::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args(["plan", "-n", "shop", "-n", "web", "-o", "json"])
        .env("KUBECONFIG", fixture.cluster.kubeconfig())
        .output()?;
    assert!(
        planned.status.success(),
        "haulage plan: {}",
        String::from_utf8_lossy(&planned.stderr)
    );
    let live_plan: serde_json::Value = serde_json::from_slice(&planned.stdout)?;
    create_backup(client, "nightly").await?;
    let status = fixture.completed_backup("nightly", BACKUP_DEADLINE).await?;

    // The plan: the RWO claim in use on node-a is read there, the RWX one
    // by exactly one stage pod, every claim placed.
    let plan = status.plan.clone().context("plan in status")?;
    assert!(plan.unplaceable.is_empty(), "{plan:#?}");
    let pod_of = |namespace: &str, pvc: &str| {
        plan.stage_pods
            .iter()
            .filter(|pod| {
                pod.stage.namespace == namespace && pod.stage.volumes.iter().any(|v| v == pvc)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(pod_of("shop", "db").len(), 1);
    assert_eq!(pod_of("shop", "db")[0].stage.node, "node-a");
    assert_eq!(pod_of("shop", "uploads").len(), 1);
    assert!(["node-b", "node-c"].contains(&pod_of("shop", "uploads")[0].stage.node.as_str()));
    // The CLI's plan of the live cluster is the controller's plan.
    let placements = |pods: Vec<(String, String, Vec<String>)>| {
        pods.into_iter()
            .map(|(namespace, node, mut volumes)| {
                volumes.sort();
                (namespace, node, volumes)
            })
            .collect::<std::collections::BTreeSet<_>>()
    };
    let from_cli = placements(
        live_plan["stagePods"]
            .as_array()
            .context("stagePods")?
            .iter()
            .map(|pod| {
                (
                    pod["namespace"].as_str().unwrap_or_default().to_string(),
                    pod["node"].as_str().unwrap_or_default().to_string(),
                    pod["volumes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|volume| volume.as_str().map(str::to_string))
                        .collect(),
                )
            })
            .collect(),
    );
    let from_controller = placements(
        plan.stage_pods
            .iter()
            .map(|pod| {
                (
                    pod.stage.namespace.clone(),
                    pod.stage.node.clone(),
                    pod.stage.volumes.clone(),
                )
            })
            .collect(),
    );
    assert_eq!(from_cli, from_controller, "{live_plan:#}");

    let counts = status.volumes.clone().context("volume counts")?;
    assert_eq!((counts.total, counts.completed, counts.failed), (5, 5, 0));
    let progress = status.progress.clone().context("progress")?;
    assert!(
        progress.total_bytes > 0 && progress.bytes_done == progress.total_bytes,
        "{progress:?}"
    );
    assert_eq!(status.results.len(), 5);

    // `haulage describe backup` shows the plan and every volume, from status.
    let described = std::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args(["describe", "backup", "nightly"])
        .env("KUBECONFIG", fixture.cluster.kubeconfig())
        .output()?;
    let text = String::from_utf8_lossy(&described.stdout);
    assert!(
        described.status.success(),
        "{}",
        String::from_utf8_lossy(&described.stderr)
    );
    assert!(text.contains("Phase:     Completed"), "{text}");
    assert!(text.contains("5 total: 5 completed"), "{text}");
    for (namespace, pvc) in [("shop", "db"), ("shop", "uploads"), ("web", "logs")] {
        assert!(
            text.lines().any(|line| line.starts_with(namespace)
                && line.contains(pvc)
                && line.contains("100%")),
            "{pvc} missing:\n{text}"
        );
    }

    // Every snapshot restores byte-identical.
    let repository =
        Repository::open(store.clone(), &haulage::engine::KeySource::PlaintextOnly).await?;
    for result in &status.results {
        assert_snapshot_restores_as(
            &repository,
            result.snapshot_id.as_deref().context("snapshot id")?,
            &volumes.join(&result.namespace).join(&result.pvc),
            &work
                .path()
                .join("restored")
                .join(&result.namespace)
                .join(&result.pvc),
        )
        .await?;
    }

    // Nothing left behind: stage pods, credentials copies, uploads.
    no_leftovers(client).await?;
    assert!(minio.multipart_uploads(BUCKET, "").await?.is_empty());
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_volume_backup_mid_transfer_stops_its_agents_and_leaves_nothing_behind()
-> anyhow::Result<()> {
    // Slow uploads (256 KiB/s per agent) keep the transfers running.
    let fixture = Fixture::builder()
        .upload_bytes_per_second(256 << 10)
        .volume_bytes(4 << 20)
        .start()
        .await?;
    let client = &fixture.client;
    create_backup(client, "doomed").await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    eventually(Duration::from_secs(120), || async {
        let list = transfers.list(&ListParams::default()).await?;
        Ok(list
            .items
            .iter()
            .any(|transfer| {
                let status = transfer.status.clone().unwrap_or_default();
                status.phase == Some(VolumeTransferPhase::InProgress)
                    && status
                        .progress
                        .is_some_and(|progress| progress.bytes_done > 0)
            })
            .then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "no transfer got going:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    assert!(fixture.kubelet.running_agents() > 0, "agents already done");

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    backups.delete("doomed", &DeleteParams::default()).await?;
    eventually(Duration::from_secs(60), || async {
        Ok(backups.get_opt("doomed").await?.is_none().then_some(()))
    })
    .await
    .context("the finalizer was not released")?;

    nothing_left_of_deleted(&fixture, "backup", async || {
        Ok(transfers.list(&ListParams::default()).await?.items.len())
    })
    .await?;
    assert!(
        fixture
            .minio
            .multipart_uploads(BUCKET, "")
            .await?
            .is_empty()
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_agent_is_restarted_and_resumes_without_sending_stored_packs_again()
-> anyhow::Result<()> {
    // 12 MiB of random data per claim in 1 MiB packs, uploaded at 1 MiB/s:
    // the kill lands well before the snapshot is written.
    let fixture = Fixture::builder().long_running_transfers().start().await?;
    let client = &fixture.client;
    // One claim only, so every pack in the bucket is this transfer's.
    create_backup_of_claim(client, "resumed", "archive").await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    // A pack object exists only once fully uploaded: kill after two.
    fixture.packs_stored_at_least(2).await?;
    let victim = transfers
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .next()
        .context("no transfer")?;
    let phase = victim.status.clone().and_then(|status| status.phase);
    assert_eq!(
        phase,
        Some(VolumeTransferPhase::InProgress),
        "finished before the kill"
    );
    let namespace = victim.metadata.namespace.clone().context("namespace")?;
    // The agent holds the repository's shared lock while it moves the
    // volume, so a prune anywhere defers its deletions.
    let locks = haulage::engine::lock::list_locks(&fixture.repository().await?).await?;
    let purpose = format!("backup of claim {namespace}/{}", victim.spec.pvc);
    assert!(
        locks.iter().any(|lock| lock.is_live()
            && lock
                .record
                .as_ref()
                .is_some_and(|record| record.purpose.starts_with(&purpose))),
        "no live lock for {purpose}: {locks:?}"
    );
    let starts_before = fixture
        .kubelet
        .kill_running(&namespace, &victim.spec.stage_pod);

    fixture.completed_backup("resumed", BACKUP_DEADLINE).await?;
    fixture.kubelet.assert_restarted_since(starts_before);
    // The transfers are kept until the backup is deleted.
    let resumed = Api::<VolumeTransfer>::namespaced(client.clone(), &namespace)
        .get(&victim.metadata.name.clone().context("name")?)
        .await?;
    let final_status = resumed.status.context("transfer status")?;
    let bytes_read = final_status.bytes_read.context("bytesRead")?;
    let bytes_new = final_status.bytes_new.context("bytesNew")?;
    assert!(
        bytes_new + (1 << 20) <= bytes_read,
        "the restarted agent sent stored data again: {bytes_new} new of {bytes_read} read\n{}",
        fixture.kubelet.all_agent_logs()
    );

    let repository = fixture.repository().await?;
    assert_snapshot_restores_as(
        &repository,
        &final_status.snapshot_id.context("snapshot id")?,
        &fixture.volumes.join(&namespace).join(&resumed.spec.pvc),
        &fixture.work.path().join("restored-victim"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

/// A stage pod's agent moves as many of its claims at once as its memory
/// request holds (four in the default 128Mi), and the caps decide the
/// rest: three claims of one namespace on one node, one stage pod; the
/// node's cap of two (the controller's default `--max-volumes-per-node`)
/// lets two of them move at once, the third waits for the node, and the
/// agent shares its memory budget between the two engines. Until the
/// budget was shared, an agent moved one volume at a time and admission
/// held the second claim for the stage pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stage_pod_moves_its_claims_at_once_as_far_as_its_memory_and_the_caps_allow()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .layout(crate::support::fixture::Layout::many(3, 1, 1))
        .long_running_transfers()
        .volume_bytes(6 << 20)
        .start()
        .await?;
    let client = &fixture.client;
    crate::support::fixture::create_backup_in(
        client,
        "together",
        &["team-0"],
        serde_json::json!({"matchLabels": {"backup": "yes"}}),
    )
    .await?;
    let watched = watch_until_completed(client, "together", "team-0").await?;
    assert_eq!(
        watched.stage_pods.len(),
        1,
        "one stage pod for the three claims: {:?}",
        watched.stage_pods
    );
    assert_eq!(
        watched.most_at_once, 2,
        "two of the stage pod's claims move at once, as the node's cap allows"
    );
    let held = watched
        .queued_message_containing("node node-0")
        .context("the third claim never waited for the node's cap")?;
    assert!(held.contains("2 of 2 volumes running"), "{held}");
    fixture.stop().await;
    Ok(())
}

/// What [`watch_until_completed`] saw of a backup's transfers.
struct WatchedTransfers {
    /// The most transfers InProgress at once.
    most_at_once: usize,
    /// The stage pods the transfers named.
    stage_pods: std::collections::BTreeSet<String>,
    /// The condition messages of queued transfers.
    queued_messages: std::collections::BTreeSet<String>,
}

impl WatchedTransfers {
    /// The first message of a queued transfer that contains `text`.
    fn queued_message_containing(&self, text: &str) -> Option<&String> {
        self.queued_messages
            .iter()
            .find(|message| message.contains(text))
    }
}

/// Look at the transfers of VolumeBackup `backup` in `namespace` every
/// 100 ms until it completes.
async fn watch_until_completed(
    client: &kube::Client,
    backup: &str,
    namespace: &str,
) -> anyhow::Result<WatchedTransfers> {
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), namespace);
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mut watched = WatchedTransfers {
        most_at_once: 0,
        stage_pods: Default::default(),
        queued_messages: Default::default(),
    };
    let deadline = std::time::Instant::now() + BACKUP_DEADLINE;
    loop {
        let list = transfers.list(&ListParams::default()).await?;
        let running = list
            .items
            .iter()
            .filter(|transfer| transfer.phase() == VolumeTransferPhase::InProgress)
            .count();
        watched.most_at_once = watched.most_at_once.max(running);
        for transfer in &list.items {
            watched.stage_pods.insert(transfer.spec.stage_pod.clone());
            if transfer.phase() == VolumeTransferPhase::Queued {
                watched.queued_messages.extend(
                    transfer
                        .status
                        .iter()
                        .flat_map(|status| status.conditions.iter())
                        .map(|condition| condition.message.clone()),
                );
            }
        }
        let phase = backups
            .get(backup)
            .await?
            .status
            .and_then(|status| status.phase);
        if phase == Some(haulage::api::backup::VolumeBackupPhase::Completed) {
            return Ok(watched);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the backup did not complete: {phase:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The index every agent loads takes its part of the stage pod's memory:
/// the location's probe lists its index files (`status.indexBytes`), the
/// stage pod gives that figure to its agent, and the agent and admission
/// plan the same fewer volumes at once. A repository whose index files
/// hold 700,000 blobs (24 MB, counted as 38 MB in memory) leaves a 128Mi
/// stage pod room for two volumes where it holds four with a small index:
/// three claims on one node with no node cap in the way, two move at once
/// and the third waits for the stage pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_index_leaves_a_stage_pod_room_for_fewer_volumes_at_once() -> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .layout(crate::support::fixture::Layout::many(3, 1, 1))
        .max_volumes_per_node(Some(8))
        .long_running_transfers()
        .volume_bytes(6 << 20)
        .start()
        .await?;
    let client = &fixture.client;
    let index_bytes = fixture.write_index_of_unstored_blobs(700_000).await?;
    let probed = fixture.location_index_bytes_at_least(index_bytes).await?;
    assert_eq!(probed, index_bytes, "the probe lists what is there");
    let memory = haulage::api::transfer::AgentMemory {
        budget_bytes: 128 << 20,
        index_file_bytes: index_bytes,
    };
    assert_eq!(
        memory.volumes_at_once(),
        2,
        "{index_bytes} bytes of index files"
    );

    crate::support::fixture::create_backup_in(
        client,
        "beside-a-large-index",
        &["team-0"],
        serde_json::json!({"matchLabels": {"backup": "yes"}}),
    )
    .await?;
    let watched = watch_until_completed(client, "beside-a-large-index", "team-0").await?;
    assert_eq!(watched.stage_pods.len(), 1, "{:?}", watched.stage_pods);
    assert_eq!(
        watched.most_at_once, 2,
        "two volumes at once beside the index (four without it)"
    );
    let held = watched
        .queued_message_containing("stage pod")
        .context("the third claim never waited for the stage pod")?;
    assert!(
        held.contains("moves 2 volumes at a time") && held.contains("moving 2 now"),
        "{held}"
    );
    // The agent planned the same two, with the figure its pod gave it.
    let planned = fixture
        .kubelet
        .agent_log_lines_containing("volumes planned within the memory budget");
    assert_eq!(planned.len(), 1, "{planned:?}");
    assert!(
        planned[0].contains(&format!("index_file_bytes={index_bytes}"))
            && planned[0].contains("volumes_at_once=2"),
        "{}",
        planned[0]
    );
    fixture.stop().await;
    Ok(())
}
