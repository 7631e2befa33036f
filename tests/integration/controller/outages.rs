//! Storage outages longer than the retry budget, through the fault proxy
//! the BSL points at: a backup whose location goes down for a minute
//! pauses (its transfer says so in a `StorageAvailable=False` condition,
//! the BSL turns Unavailable through its probe, the agent's metrics show
//! it), sends about one request per probe interval while it waits, and
//! resumes by itself when the location is back, its snapshot restoring
//! byte-identical; a backup whose location stays away longer than its
//! `failAfterUnavailableSeconds` fails with `StorageUnavailableTimeout`,
//! saying so. A restore whose location goes down mid-way waits the same
//! way and finishes verified. A location throttling a fifth of the
//! requests (503 SlowDown) slows a backup that completes identical, the
//! retried requests counted in the agent's metrics and the transfer's
//! `StorageAvailable` condition. An agent stopped by SIGTERM while it waits
//! an outage out exits at once, and the backup completes after it. And a backup across two restarts of
//! kube-apiserver, or across a 2-minute outage of it, completes with its
//! progress never going back, its agent never restarted; and an outage of
//! it longer than `--agent-lost-seconds` does not make the agent lost.
//! Agents refused by the API server for a while (403, as a restarted
//! server refuses until its RBAC caches are filled) keep the claim they
//! were making and the outcome they were writing, and are never restarted.

use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::condition::{ConditionStatus, condition_type, find_condition, reason};
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::location::BackupStorageLocationPhase;
use haulage::api::{BackupStorageLocation, VolumeBackup, VolumeTransfer, VolumeTransferPhase};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::engine::support::{assert_same_tree, assert_snapshot_restores_as};
use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, PROVISIONER, bytes_done, create_backup_of, create_backup_of_claim,
    create_backup_with_spec, create_restore_of_backup, create_storage_policy, eventually,
    final_phase, transfer_of, watch_transfers,
};
use crate::support::scrape::scrape;

/// How long the location is down mid-backup: 60 s, or
/// `HAULAGE_OUTAGE_SECONDS` (the 5-minute run of docs/benchmarks.md).
fn outage() -> Duration {
    Duration::from_secs(crate::support::number_from_env(
        "HAULAGE_OUTAGE_SECONDS",
        60,
    ))
}

/// The `StorageAvailable` condition of a transfer, if any.
fn storage_condition(transfer: &VolumeTransfer) -> Option<haulage::api::condition::Condition> {
    let status = transfer.status.as_ref()?;
    find_condition(&status.conditions, condition_type::STORAGE_AVAILABLE).cloned()
}

/// Wait up to two minutes for the transfer of claim `pvc` among
/// `transfers` to have done at least `bytes`; a timeout says the `what`
/// never got going, with every agent's log.
async fn moved_at_least(
    fixture: &Fixture,
    transfers: &Api<VolumeTransfer>,
    pvc: &str,
    bytes: i64,
    what: &str,
) -> anyhow::Result<()> {
    eventually(Duration::from_secs(120), || async {
        let transfer = transfer_of(transfers, pvc).await?;
        Ok(transfer
            .status
            .and_then(|status| status.progress)
            .is_some_and(|progress| progress.bytes_done >= bytes)
            .then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "the {what} never got going:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })
}

/// Wait up to a minute for the transfer of claim `pvc` among `transfers`
/// to say it waits for the storage (`StorageAvailable=False`), and return
/// it as it said so; a timeout names the `what`, with every agent's log.
async fn paused_for_storage(
    fixture: &Fixture,
    transfers: &Api<VolumeTransfer>,
    pvc: &str,
    what: &str,
) -> anyhow::Result<VolumeTransfer> {
    eventually(Duration::from_secs(60), || async {
        let transfer = transfer_of(transfers, pvc).await?;
        Ok(storage_condition(&transfer)
            .is_some_and(|condition| condition.status == ConditionStatus::False)
            .then_some(transfer))
    })
    .await
    .with_context(|| {
        format!(
            "the {what} never said it waits for the storage:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })
}

/// A fixture whose location is behind the fault proxy, and the backup
/// `name` of claim `archive` under way in it (two packs stored): the
/// fixture, every transfer, and the backup's transfer as it was then. 12
/// MiB of random data per claim in 1 MiB packs, uploaded at 1 MiB/s: an
/// outage from here lands mid-transfer.
async fn archive_backup_under_way(
    name: &str,
) -> anyhow::Result<(Fixture, Api<VolumeTransfer>, VolumeTransfer)> {
    let fixture = Fixture::builder()
        .long_running_transfers()
        .through_fault_proxy()
        .start()
        .await?;
    let transfers: Api<VolumeTransfer> = Api::all(fixture.client.clone());
    create_backup_of_claim(&fixture.client, name, "archive").await?;
    fixture.packs_stored_at_least(2).await?;
    let before = transfer_of(&transfers, "archive").await?;
    Ok((fixture, transfers, before))
}

/// The `bytesDone` of each progress report of claim `pvc`'s transfer, as
/// a watch sees them, across apiserver restarts and outages.
struct ProgressReports {
    seen: std::sync::Arc<std::sync::Mutex<Vec<i64>>>,
    watch: tokio::task::JoinHandle<()>,
}

impl ProgressReports {
    fn watch(client: &kube::Client, pvc: &'static str) -> Self {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let watch = {
            let seen = seen.clone();
            watch_transfers(client, move |transfer| {
                if transfer.spec.pvc != pvc {
                    return;
                }
                if let Some(progress) = transfer.status.as_ref().and_then(|s| s.progress.as_ref()) {
                    seen.lock().expect("lock").push(progress.bytes_done);
                }
            })
        };
        ProgressReports { seen, watch }
    }

    /// Stop watching and return the reports seen, asserting none was lower
    /// than the one before.
    fn never_backwards(self) -> Vec<i64> {
        self.watch.abort();
        let seen = self.seen.lock().expect("lock").clone();
        assert!(
            seen.windows(2).all(|pair| pair[0] <= pair[1]),
            "progress went backwards: {seen:?}"
        );
        seen
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storage_outage_pauses_a_backup_until_the_location_is_back_and_one_past_its_limit_fails()
-> anyhow::Result<()> {
    let (fixture, transfers, before) = archive_backup_under_way("through-an-outage").await?;
    let client = &fixture.client;
    let proxy = fixture.proxy.as_ref().context("the fixture's proxy")?;
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let phase = before.status.as_ref().and_then(|status| status.phase);
    assert_eq!(
        phase,
        Some(VolumeTransferPhase::InProgress),
        "finished before the outage"
    );
    let namespace = before.metadata.namespace.clone().context("namespace")?;
    let metrics_address = fixture
        .kubelet
        .agent_metrics_address(&namespace, &before.spec.stage_pod)
        .context("the agent's metrics address")?;

    proxy.go_down();
    let down_at = Instant::now();
    let refused_before = proxy.refused();
    // The transfer pauses and says so; the location turns Unavailable.
    let paused = paused_for_storage(&fixture, &transfers, "archive", "transfer").await?;
    let condition = storage_condition(&paused).context("condition")?;
    assert_eq!(condition.reason, reason::STORAGE_LOCATION_UNAVAILABLE);
    assert!(
        condition.message.contains("paused") && condition.message.contains("as long as it takes"),
        "{}",
        condition.message
    );
    let paused_status = paused.status.clone().context("status")?;
    assert_eq!(paused_status.phase, Some(VolumeTransferPhase::InProgress));
    let paused_progress = paused_status.progress.clone().unwrap_or_default();
    eventually(Duration::from_secs(60), || async {
        let location = locations.get("minio").await?;
        Ok((location.status.and_then(|status| status.phase)
            == Some(BackupStorageLocationPhase::Unavailable))
        .then_some(()))
    })
    .await
    .context("the BSL never turned Unavailable")?;
    let scraped = scrape(metrics_address).await?;
    assert_eq!(
        scraped.value("haulage_agent_storage_unavailable", &[])?,
        1.0
    );
    assert_eq!(
        scraped.value("haulage_agent_storage_outages_total", &[])?,
        1.0
    );

    // Down for a minute in all: the transfer waits, its progress kept.
    let outage = outage();
    while down_at.elapsed() < outage {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let transfer = transfer_of(&transfers, "archive").await?;
        let status = transfer.status.context("status")?;
        assert_eq!(
            status.phase,
            Some(VolumeTransferPhase::InProgress),
            "the outage ended the transfer: {status:#?}\n{}",
            fixture.kubelet.all_agent_logs()
        );
        let progress = status.progress.unwrap_or_default();
        assert!(
            progress.bytes_done >= paused_progress.bytes_done,
            "progress went backwards"
        );
    }
    let refused = proxy.refused() - refused_before;
    let minutes = down_at.elapsed().as_secs_f64() / 60.0;
    let per_minute = refused as f64 / minutes;
    println!(
        "outage: {refused} connections in {:.0} s while the location was down ({per_minute:.1} per minute: the agent's probes and the controller's BSL validation)",
        down_at.elapsed().as_secs_f64()
    );
    // Without waiting out (every upload and read retrying on its own,
    // six attempts in a few seconds, over and over), hundreds a minute.
    assert!(per_minute < 60.0, "{per_minute:.1} requests per minute");

    proxy.come_back();
    let back_at = Instant::now();
    eventually(Duration::from_secs(120), || async {
        let transfer = transfer_of(&transfers, "archive").await?;
        let moved = transfer
            .status
            .as_ref()
            .and_then(|status| status.progress.as_ref())
            .is_some_and(|progress| progress.bytes_done > paused_progress.bytes_done);
        let final_phase = transfer
            .status
            .as_ref()
            .and_then(|status| status.phase)
            .is_some_and(|phase| phase != VolumeTransferPhase::InProgress);
        Ok((moved || final_phase).then_some(()))
    })
    .await
    .context("the transfer never moved again")?;
    println!(
        "outage: the transfer moved again {:.1} s after the location came back",
        back_at.elapsed().as_secs_f64()
    );
    let status = fixture
        .completed_backup("through-an-outage", BACKUP_DEADLINE)
        .await?;
    assert!(status.completion_time.is_some());
    let finished = transfer_of(&transfers, "archive").await?;
    let condition = storage_condition(&finished).context("the outage is kept in the status")?;
    assert_eq!(condition.status, ConditionStatus::True);
    assert_eq!(condition.reason, reason::STORAGE_LOCATION_AVAILABLE);
    assert!(
        condition.message.contains("outage of"),
        "{}",
        condition.message
    );
    let final_status = finished.status.context("status")?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &final_status.snapshot_id.context("snapshot id")?,
        &fixture.volumes.join(&namespace).join("archive"),
        &fixture.work.path().join("restored-archive"),
    )
    .await?;

    // A backup whose location stays away past its limit fails, saying so.
    create_backup_with_spec(
        client,
        "past-its-limit",
        json!({"namespaces": ["shop", "web"], "selector": {"matchLabels": {"claim": "logs"}},
            "failAfterUnavailableSeconds": 20}),
    )
    .await?;
    moved_at_least(&fixture, &transfers, "logs", 1, "second backup").await?;
    proxy.go_down();
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let failed = final_phase(
        &backups,
        &fixture.kubelet,
        "past-its-limit",
        BACKUP_DEADLINE,
    )
    .await?;
    proxy.come_back();
    let phase = failed.status.as_ref().and_then(|status| status.phase);
    assert_eq!(
        phase,
        Some(VolumeBackupPhase::Failed),
        "{:#?}",
        failed.status
    );
    let transfer = transfer_of(&transfers, "logs").await?;
    let status = transfer.status.context("status")?;
    let failure = find_condition(&status.conditions, condition_type::FAILED).context("Failed")?;
    assert_eq!(failure.reason, reason::STORAGE_UNAVAILABLE_TIMEOUT);
    let message = status.message.unwrap_or_default();
    assert!(
        message.contains("longer than failAfterUnavailableSeconds (20)"),
        "{message}"
    );
    fixture.stop().await;
    Ok(())
}

/// How long an agent stopped by SIGTERM while it waits out a storage
/// outage may take to exit: well within the stage pod's grace period
/// (60 s), so it is never SIGKILLed mid-write.
const SIGTERM_EXIT_WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_stopped_by_sigterm_while_it_waits_out_an_outage_exits_at_once_and_the_backup_completes()
-> anyhow::Result<()> {
    let (fixture, transfers, before) = archive_backup_under_way("sigterm-in-an-outage").await?;
    let proxy = fixture.proxy.as_ref().context("the fixture's proxy")?;
    let namespace = before.metadata.namespace.clone().context("namespace")?;
    let pod = before.spec.stage_pod.clone();

    proxy.go_down();
    let paused = paused_for_storage(&fixture, &transfers, "archive", "transfer").await?;
    let paused_progress = paused
        .status
        .and_then(|status| status.progress)
        .unwrap_or_default();
    // Stopped as a node drain or an eviction stops it, while its uploads
    // and its reads wait for the location.
    let exited = fixture
        .kubelet
        .terminate_running(&namespace, &pod, SIGTERM_EXIT_WITHIN)
        .await?;
    let took = exited.with_context(|| {
        format!(
            "the agent was still running {SIGTERM_EXIT_WITHIN:?} after SIGTERM while the location was down:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    println!(
        "outage: the agent exited {:.2} s after SIGTERM",
        took.as_secs_f64()
    );
    let transfer = transfer_of(&transfers, "archive").await?;
    let status = transfer.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeTransferPhase::InProgress),
        "a stopped agent ends nothing: {status:#?}"
    );
    assert!(
        status.progress.unwrap_or_default().bytes_done >= paused_progress.bytes_done,
        "progress went backwards"
    );

    // The restarted agent waits the rest of the outage out and finishes.
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.come_back();
    let status = fixture
        .completed_backup("sigterm-in-an-outage", BACKUP_DEADLINE)
        .await?;
    assert!(status.completion_time.is_some());
    let finished = transfer_of(&transfers, "archive").await?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &finished
            .status
            .and_then(|status| status.snapshot_id)
            .context("snapshot id")?,
        &fixture.volumes.join(&namespace).join("archive"),
        &fixture.work.path().join("restored-archive"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_across_two_apiserver_restarts_completes_its_progress_never_going_back()
-> anyhow::Result<()> {
    // 24 MiB of random data in 1 MiB packs at 1 MiB/s: about 24 s of
    // transfer, long enough for two restarts.
    let mut fixture = Fixture::builder()
        .long_running_transfers()
        .volume_bytes(24 << 20)
        .start()
        .await?;
    let client = fixture.client.clone();
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let reports = ProgressReports::watch(&client, "archive");
    create_backup_of_claim(&client, "across-restarts", "archive").await?;
    moved_at_least(&fixture, &transfers, "archive", 4 << 20, "backup").await?;
    let starts = fixture.kubelet.starts();
    for restart in 1..=2 {
        let started = Instant::now();
        fixture.cluster.restart_apiserver().await?;
        println!(
            "apiserver restart {restart}: ready again after {:.1} s",
            started.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let during = transfer_of(&transfers, "archive").await?;
    assert_eq!(
        during.status.as_ref().and_then(|status| status.phase),
        Some(VolumeTransferPhase::InProgress),
        "the backup ended before the second restart was over: make it longer"
    );
    let status = fixture
        .completed_backup("across-restarts", BACKUP_DEADLINE)
        .await?;
    assert!(status.completion_time.is_some());
    let seen = reports.never_backwards();
    assert!(seen.len() >= 5, "too few progress reports seen: {seen:?}");
    assert_eq!(
        fixture.kubelet.starts(),
        starts,
        "an agent was restarted:\n{}",
        fixture.kubelet.all_agent_logs()
    );
    let finished = transfer_of(&transfers, "archive").await?;
    let final_status = finished.status.context("status")?;
    println!(
        "apiserver restarts: {} progress reports seen, attempts {:?}",
        seen.len(),
        final_status.attempts
    );
    let namespace = finished.metadata.namespace.clone().context("namespace")?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &final_status.snapshot_id.context("snapshot id")?,
        &fixture.volumes.join(&namespace).join("archive"),
        &fixture.work.path().join("restored-archive"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

/// Most connection attempts a minute to an API server that is away, from
/// one controller and one agent (about 2 a second are expected).
const MOST_API_CONNECTIONS_PER_MINUTE_DURING_AN_OUTAGE: f64 = 400.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_across_a_two_minute_apiserver_outage_completes_its_outcome_written_once_the_server_is_back()
-> anyhow::Result<()> {
    // 24 MiB of random data in 1 MiB packs at 1 MiB/s: the agent moves
    // the rest of the volume while the API server is away, keeps its
    // outcome and writes it once the server answers. The controller and
    // the agent reach the server through a proxy that counts their
    // connection attempts while it is away: bounded, no retry storm.
    let down = Duration::from_secs(crate::support::number_from_env(
        "HAULAGE_APISERVER_OUTAGE_SECONDS",
        120,
    ));
    let mut fixture = Fixture::builder()
        .long_running_transfers()
        .volume_bytes(24 << 20)
        .api_server_through_fault_proxy()
        .start()
        .await?;
    // Kept out of the fixture (whose cluster the test restarts), alive
    // until the end: the agent and the controller go through it.
    let api_proxy = fixture.api_proxy.take().context("the API server proxy")?;
    let connections = || api_proxy.connections();
    let client = fixture.client.clone();
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let reports = ProgressReports::watch(&client, "archive");
    create_backup_of_claim(&client, "across-an-outage", "archive").await?;
    moved_at_least(&fixture, &transfers, "archive", 4 << 20, "backup").await?;
    let starts = fixture.kubelet.starts();
    let started = Instant::now();
    let connections_before = connections();
    fixture.cluster.restart_apiserver_after(down).await?;
    let attempts = connections() - connections_before;
    let away_minutes = started.elapsed().as_secs_f64() / 60.0;
    let per_minute = attempts as f64 / away_minutes;
    println!(
        "apiserver outage: away {} s, ready again after {:.1} s; the controller and the agent \
         tried {attempts} connections meanwhile, {per_minute:.0} a minute",
        down.as_secs(),
        started.elapsed().as_secs_f64()
    );
    // The controller's 13 watches back off to one try in 30 s, its leases
    // and health check try every 10 s, the agent reports every 2 s and
    // retries its final status every 5 s at most: about 2 a second in all.
    // A watch or a writer without backoff makes hundreds a second.
    assert!(
        per_minute < MOST_API_CONNECTIONS_PER_MINUTE_DURING_AN_OUTAGE,
        "{attempts} connection attempts in {away_minutes:.1} min: a retry storm"
    );
    let back_at = Instant::now();
    let status = fixture
        .completed_backup("across-an-outage", BACKUP_DEADLINE)
        .await?;
    let completed_after = back_at.elapsed().as_secs_f64();
    assert!(status.completion_time.is_some());
    let seen = reports.never_backwards();
    let logs = fixture.kubelet.all_agent_logs();
    assert_eq!(
        fixture.kubelet.starts(),
        starts,
        "an agent was restarted: the outage cost a second pass over the volume\n{logs}"
    );
    assert!(
        logs.contains("written once the API server answers"),
        "the volume was not done before the server came back: make it longer\n{logs}"
    );
    let repository = fixture.repository().await?;
    let snapshots = repository.snapshot_ids().await?;
    assert_eq!(snapshots.len(), 1, "one snapshot, not one per pass");
    let finished = transfer_of(&transfers, "archive").await?;
    let final_status = finished.status.context("status")?;
    println!(
        "apiserver outage: {} progress reports seen, never lower than the one before; the backup Completed {completed_after:.1} s after the server was back, its agent never restarted",
        seen.len()
    );
    let namespace = finished.metadata.namespace.clone().context("namespace")?;
    assert_snapshot_restores_as(
        &repository,
        &final_status.snapshot_id.context("snapshot id")?,
        &fixture.volumes.join(&namespace).join("archive"),
        &fixture.work.path().join("restored-archive"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_apiserver_outage_longer_than_agent_lost_seconds_does_not_make_the_running_agent_lost()
-> anyhow::Result<()> {
    // A controller that counts an agent silent for 10 s as lost, and the
    // API server away for 40 s while a 64 MiB backup moves at 1 MiB/s: the
    // agent cannot report meanwhile, and it is not lost for that.
    let mut fixture = Fixture::builder()
        .long_running_transfers()
        .volume_bytes(64 << 20)
        .agent_lost_seconds(haulage::controller::MIN_AGENT_LOST_SECONDS)
        .start()
        .await?;
    let client = fixture.client.clone();
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    create_backup_of_claim(&client, "across-a-long-outage", "archive").await?;
    moved_at_least(&fixture, &transfers, "archive", 4 << 20, "backup").await?;
    let starts = fixture.kubelet.starts();
    let down = Duration::from_secs(40);
    fixture.cluster.restart_apiserver_after(down).await?;
    let running = transfer_of(&transfers, "archive").await?.phase();
    assert!(
        !running.is_final(),
        "the volume ended during the outage: make it longer"
    );
    let status = fixture
        .completed_backup("across-a-long-outage", BACKUP_DEADLINE)
        .await?;
    assert!(status.completion_time.is_some());
    let logs = fixture.kubelet.all_agent_logs();
    assert_eq!(
        fixture.kubelet.starts(),
        starts,
        "the agent was judged lost after the outage and its stage pod recreated\n{logs}"
    );
    assert_one_stage_pod(&transfer_of(&transfers, "archive").await?);
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storage_outage_mid_restore_pauses_it_and_it_finishes_verified_once_the_location_is_back()
-> anyhow::Result<()> {
    // 12 MiB of random data in 1 MiB packs, written at 1 MiB/s (a
    // StoragePolicy on the destination class): the outage lands mid-way.
    let fixture = Fixture::builder()
        .volume_bytes(12 << 20)
        .random_data_in_small_packs()
        .provisioning()
        .through_fault_proxy()
        .start()
        .await?;
    let client = &fixture.client;
    let proxy = fixture.proxy.as_ref().context("the fixture's proxy")?;
    create_backup_of_claim(client, "archive-only", "archive").await?;
    fixture
        .completed_backup("archive-only", BACKUP_DEADLINE)
        .await?;
    create_storage_policy(
        client,
        "slow-writes",
        json!({"provisioners": [PROVISIONER], "maxBytesPerSecond": 1 << 20}),
    )
    .await?;
    create_restore_of_backup(client, "through-an-outage", "archive-only").await?;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), "shop-b");
    moved_at_least(&fixture, &transfers, "archive", 3 << 20, "restore").await?;
    proxy.go_down();
    let down_at = Instant::now();
    let paused = paused_for_storage(&fixture, &transfers, "archive", "restore").await?;
    assert_eq!(
        paused.status.as_ref().and_then(|status| status.phase),
        Some(VolumeTransferPhase::InProgress)
    );
    let down_for = Duration::from_secs(30);
    if let Some(left) = down_for.checked_sub(down_at.elapsed()) {
        tokio::time::sleep(left).await;
    }
    proxy.come_back();
    fixture
        .completed_restore("through-an-outage", BACKUP_DEADLINE)
        .await?;
    let finished = transfer_of(&transfers, "archive").await?;
    let condition = storage_condition(&finished).context("the outage is kept in the status")?;
    assert_eq!(condition.status, ConditionStatus::True);
    let status = finished.status.context("status")?;
    assert!(status.verified_tree.is_some(), "{status:#?}");
    assert_same_tree(
        &fixture.volumes.join("shop/archive"),
        &fixture.volumes.join("shop-b/archive"),
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_location_throttling_a_fifth_of_the_requests_slows_a_backup_that_completes_identical_saying_so()
-> anyhow::Result<()> {
    // 12 MiB of random data in 1 MiB packs at 1 MiB/s, every fifth
    // request to the location (the controller's probes included) answered
    // 503 SlowDown from before the backup to its end.
    let fixture = Fixture::builder()
        .long_running_transfers()
        .through_fault_proxy()
        .start()
        .await?;
    let client = &fixture.client;
    let proxy = fixture.proxy.as_ref().context("the fixture's proxy")?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    proxy.slow_down(0.2);
    let requests_before = proxy.requests();
    let began = Instant::now();
    create_backup_of_claim(client, "throttled", "archive").await?;
    fixture.packs_stored_at_least(2).await?;
    let running = transfer_of(&transfers, "archive").await?;
    let namespace = running.metadata.namespace.clone().context("namespace")?;
    let metrics_address = fixture
        .kubelet
        .agent_metrics_address(&namespace, &running.spec.stage_pod)
        .context("the agent's metrics address")?;
    let scraped = scrape(metrics_address).await?;
    let throttled_scraped = scraped.value(
        "haulage_agent_storage_retries_total",
        &[("cause", "throttled")],
    )?;
    assert!(
        throttled_scraped >= 1.0,
        "no throttled request counted while the agent moves the volume"
    );
    assert_eq!(
        scraped.value("haulage_agent_storage_outages_total", &[])?,
        0.0,
        "a fifth of the requests throttled is not an outage"
    );

    let status = fixture
        .completed_backup("throttled", BACKUP_DEADLINE)
        .await?;
    let seconds = began.elapsed().as_secs_f64();
    let (requests, slow_downs) = (proxy.requests() - requests_before, proxy.slow_downs());
    proxy.slow_down(0.0);
    let finished = transfer_of(&transfers, "archive").await?;
    let condition = storage_condition(&finished).context("the throttling is in the status")?;
    assert_eq!(condition.status, ConditionStatus::True);
    assert_eq!(condition.reason, reason::STORAGE_REQUESTS_RETRIED);
    assert!(
        condition.message.contains("503 SlowDown"),
        "{}",
        condition.message
    );
    println!(
        "throttled: {slow_downs} of {requests} requests answered 503 SlowDown; the backup completed in {seconds:.0} s; the agent scraped at {throttled_scraped} throttled retries; its final status: {}",
        condition.message
    );
    assert!(status.completion_time.is_some());
    let final_status = finished.status.context("status")?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &final_status.snapshot_id.context("snapshot id")?,
        &fixture.volumes.join(&namespace).join("archive"),
        &fixture.work.path().join("restored-archive"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

/// Assert `transfer` took one stage pod (its first attempt, or none
/// counted).
fn assert_one_stage_pod(transfer: &VolumeTransfer) {
    let attempts = transfer.status.as_ref().and_then(|status| status.attempts);
    assert!(
        attempts.unwrap_or(1) <= 1,
        "{} took {attempts:?} stage pods",
        transfer.name_any()
    );
}

/// The RoleBinding of the stage pod `pod` in `namespace`, deleted: the
/// binding as it was, for [`bind_again`]. Its agent's requests are then
/// refused (403) as a restarted API server refuses them until its RBAC
/// caches are filled; a watch it had open goes on.
async fn unbind(client: &kube::Client, namespace: &str, pod: &str) -> anyhow::Result<RoleBinding> {
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    let binding = bindings
        .get(pod)
        .await
        .with_context(|| format!("the RoleBinding of stage pod {namespace}/{pod}"))?;
    bindings.delete(pod, &DeleteParams::default()).await?;
    Ok(binding)
}

/// Create `binding` again (as [`unbind`] left it).
async fn bind_again(client: &kube::Client, binding: &RoleBinding) -> anyhow::Result<()> {
    let mut binding = binding.clone();
    let metadata = &mut binding.metadata;
    metadata.resource_version = None;
    metadata.uid = None;
    metadata.creation_timestamp = None;
    metadata.managed_fields = None;
    let namespace = metadata.namespace.clone().context("namespace")?;
    Api::<RoleBinding>::namespaced(client.clone(), &namespace)
        .create(&PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// Wait up to a minute for an agent's log line holding every one of
/// `parts`; a timeout names the `what`, with every agent's log.
async fn agent_said(fixture: &Fixture, parts: &[&str], what: &str) -> anyhow::Result<String> {
    eventually(Duration::from_secs(60), || async {
        Ok(fixture
            .kubelet
            .agent_log_lines_containing(parts[0])
            .into_iter()
            .find(|line| parts.iter().all(|part| line.contains(part))))
    })
    .await
    .with_context(|| format!("no agent {what}:\n{}", fixture.kubelet.all_agent_logs()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_refused_by_the_api_server_for_a_while_keep_their_claim_and_outcome_and_are_never_restarted()
-> anyhow::Result<()> {
    // Two claims in two namespaces (two stage pods), one volume at a time:
    // one moves, the other's agent waits to be admitted. Both agents then
    // lose their RBAC, as after a restart of the API server before its
    // caches are filled: the moving one until its final status has been
    // refused, the waiting one until its claim has been. Neither exits
    // (a restart costs a pass over the volume, or the kubelet's backoff).
    let fixture = Fixture::builder().long_running_transfers().start().await?;
    let client = &fixture.client;
    create_storage_policy(
        client,
        "one-at-a-time",
        json!({"provisioners": [PROVISIONER], "maxConcurrentVolumes": 1}),
    )
    .await?;
    create_backup_of(
        client,
        "refused-for-a-while",
        json!({"matchExpressions": [
            {"key": "claim", "operator": "In", "values": ["archive", "content"]}]}),
    )
    .await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let (moving, waiting) = eventually(Duration::from_secs(120), || async {
        let list = transfers.list(&ListParams::default()).await?.items;
        let moving = list.iter().find(|transfer| {
            transfer.phase() == VolumeTransferPhase::InProgress && bytes_done(transfer) > 0
        });
        let waiting = list
            .iter()
            .find(|transfer| transfer.phase() < VolumeTransferPhase::Admitted);
        let (Some(moving), Some(waiting)) = (moving, waiting) else {
            return Ok(None);
        };
        // Its agent's watch has shown it the transfer.
        let seen = fixture
            .kubelet
            .agent_log_lines_containing("waiting to be admitted")
            .iter()
            .any(|line| line.contains(&waiting.name_any()));
        Ok(seen.then(|| (moving.clone(), waiting.clone())))
    })
    .await
    .with_context(|| {
        format!(
            "no volume moved while the other waited:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    let starts = fixture.kubelet.starts();
    let pod_of = |transfer: &VolumeTransfer| -> anyhow::Result<(String, String)> {
        let namespace = transfer.namespace().context("namespace")?;
        Ok((namespace, transfer.spec.stage_pod.clone()))
    };
    let (moving_namespace, moving_pod) = pod_of(&moving)?;
    let (waiting_namespace, waiting_pod) = pod_of(&waiting)?;
    let moving_binding = unbind(client, &moving_namespace, &moving_pod).await?;
    let waiting_binding = unbind(client, &waiting_namespace, &waiting_pod).await?;

    let moving_name = moving.name_any();
    agent_said(
        &fixture,
        &["write the final status of", &moving_name, "forbidden"],
        "was refused the final status of the moving volume",
    )
    .await?;
    bind_again(client, &moving_binding).await?;
    let waiting_name = waiting.name_any();
    agent_said(
        &fixture,
        &["failed to get VolumeTransfer", &waiting_name, "forbidden"],
        "was refused the claim of the waiting volume",
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    bind_again(client, &waiting_binding).await?;

    fixture
        .completed_backup("refused-for-a-while", BACKUP_DEADLINE)
        .await?;
    let logs = fixture.kubelet.all_agent_logs();
    assert_eq!(
        fixture.kubelet.starts(),
        starts,
        "an agent exited on a refusal and was restarted\n{logs}"
    );
    for (namespace, name) in [
        (&moving_namespace, &moving_name),
        (&waiting_namespace, &waiting_name),
    ] {
        let namespaced: Api<VolumeTransfer> = Api::namespaced(client.clone(), namespace);
        assert_one_stage_pod(&namespaced.get(name).await?);
    }
    fixture.stop().await;
    Ok(())
}
