//! Stage-pod supervision: an evicted stage pod is recreated, a crash-looping
//! one fails its volume with the agent's last log line, and a hung agent is
//! noticed by its silence and its pod recreated.

use std::time::Duration;

use anyhow::Context;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{VolumeBackup, VolumeTransfer, VolumeTransferPhase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::json;

use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, create_backup_of, create_backup_of_claim, eventually, final_phase,
    leftovers, transfer_of,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicted_stage_pod_is_recreated_and_a_crash_looping_one_fails_its_volume_with_the_last_log_line()
-> anyhow::Result<()> {
    // 12 MiB per claim at 1 MiB/s: both transfers run long enough to be
    // interrupted. "archive" (shop) and "content" (web) are in different
    // namespaces, so in different stage pods.
    let fixture = Fixture::builder().long_running_transfers().start().await?;
    let client = fixture.client.clone();
    create_backup_of(
        &client,
        "supervised",
        json!({"matchExpressions": [{"key": "claim", "operator": "In", "values": ["archive", "content"]}]}),
    )
    .await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let stage_pod_of = |pvc: &'static str| {
        let transfers = transfers.clone();
        async move {
            let list = transfers.list(&ListParams::default()).await?;
            let transfer = list
                .items
                .into_iter()
                .find(|transfer| transfer.spec.pvc == pvc)
                .filter(|transfer| {
                    transfer.status.as_ref().and_then(|status| status.phase)
                        == Some(VolumeTransferPhase::InProgress)
                });
            anyhow::Ok(transfer.map(|transfer| {
                (
                    transfer.metadata.namespace.clone().unwrap_or_default(),
                    transfer.spec.stage_pod.clone(),
                )
            }))
        }
    };
    let (archive_namespace, archive_pod) =
        eventually(Duration::from_secs(120), || stage_pod_of("archive"))
            .await
            .context("archive never started")?;
    let (content_namespace, content_pod) =
        eventually(Duration::from_secs(120), || stage_pod_of("content"))
            .await
            .context("content never started")?;

    // The node evicts archive's stage pod: the controller recreates it
    // after its backoff and the transfer resumes.
    fixture
        .kubelet
        .evict(&archive_namespace, &archive_pod)
        .await?;

    // content's agent keeps dying: each time it is up again, it is killed,
    // until the kubelet reports five restarts; then its volume fails.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &content_namespace);
    let kills = std::sync::atomic::AtomicI32::new(0);
    eventually(Duration::from_secs(120), || {
        let pods = pods.clone();
        let kubelet = &fixture.kubelet;
        let content_namespace = content_namespace.clone();
        let content_pod = content_pod.clone();
        let kills = &kills;
        async move {
            // Gone: the controller already stopped it after the fifth restart.
            let Some(pod) = pods.get_opt(&content_pod).await? else {
                return Ok(Some(()));
            };
            let container = pod
                .status
                .and_then(|status| status.container_statuses)
                .and_then(|statuses| statuses.into_iter().next());
            let Some(container) = container else {
                return Ok(None);
            };
            if container.restart_count >= 5 {
                return Ok(Some(()));
            }
            let running = container.state.is_some_and(|state| state.running.is_some());
            // Kill each incarnation once: the one the kubelet reports
            // running after as many restarts as there were kills.
            if running
                && container.restart_count == kills.load(std::sync::atomic::Ordering::SeqCst)
                && kubelet.kill(&content_namespace, &content_pod)
            {
                kills.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Ok(None)
        }
    })
    .await
    .context("content's agent was not restarted five times")?;

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(&backups, &fixture.kubelet, "supervised", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::PartiallyFailed),
        "{:?}",
        status.results
    );
    let result = |pvc: &str| {
        status
            .results
            .iter()
            .find(|result| result.pvc == pvc)
            .cloned()
            .with_context(|| format!("no result for {pvc}"))
    };
    let archive = result("archive")?;
    assert_eq!(archive.phase, VolumeTransferPhase::Completed, "{archive:?}");
    assert!(archive.snapshot_id.is_some());
    let content = result("content")?;
    assert_eq!(content.phase, VolumeTransferPhase::Failed);
    let message = content.message.unwrap_or_default();
    assert!(
        message.contains(&format!("the agent in stage pod {content_pod} crashed"))
            && message.contains("last: exit code 137 (Error): "),
        "{message}"
    );
    let archive_transfer = transfer_of(&transfers, "archive").await?;
    assert_eq!(
        archive_transfer.status.and_then(|status| status.attempts),
        Some(1),
        "one earlier stage pod for archive"
    );
    // `kubectl describe vbk supervised` tells the story as Events.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let reasons = eventually(Duration::from_secs(30), || async {
        let reasons: std::collections::BTreeSet<String> = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|event| {
                event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("supervised")
            })
            .filter_map(|event| event.reason)
            .collect();
        Ok([
            "ClaimedByReplica",
            "StagePodRecreated",
            "StagePodFailed",
            "PartiallyFailed",
        ]
        .iter()
        .all(|reason| reasons.contains(*reason))
        .then_some(reasons))
    })
    .await
    .context("the backup's events are missing")?;
    assert!(reasons.contains("StagePodFailed"), "{reasons:?}");
    eventually(Duration::from_secs(60), || async {
        Ok((leftovers(&client).await? == (0, 0)).then_some(()))
    })
    .await
    .context("stage pods or credential copies remain")?;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_agent_is_noticed_by_its_silence_and_its_stage_pod_is_recreated()
-> anyhow::Result<()> {
    // 12 MiB at 1 MiB/s, so the transfer is running when its agent hangs.
    let fixture = Fixture::builder().long_running_transfers().start().await?;
    let client = fixture.client.clone();
    // The fixture's controller stops cleanly (releasing its leases); this
    // one counts an agent silent for 10 s as lost (the default is 300 s).
    fixture.shutdown.cancel();
    eventually(Duration::from_secs(30), || async {
        Ok(fixture.controller.is_finished().then_some(()))
    })
    .await
    .context("the fixture's controller did not stop")?;
    let (shutdown, controller) = fixture
        .spawn_controller(haulage::controller::Config {
            agent_lost_seconds: haulage::controller::MIN_AGENT_LOST_SECONDS,
            ..Fixture::controller_config("controller-watchful")?
        })
        .await?;

    create_backup_of_claim(&client, "hung", "archive").await?;
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let (namespace, pod) = eventually(Duration::from_secs(120), || async {
        let running = transfers
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|transfer| {
                transfer.spec.pvc == "archive"
                    && transfer.status.as_ref().and_then(|status| status.phase)
                        == Some(VolumeTransferPhase::InProgress)
            });
        Ok(running.map(|transfer| {
            (
                transfer.metadata.namespace.clone().unwrap_or_default(),
                transfer.spec.stage_pod.clone(),
            )
        }))
    })
    .await
    .context("the transfer never started")?;
    assert!(
        fixture.kubelet.freeze(&namespace, &pod).await,
        "no agent process to freeze"
    );

    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(&backups, &fixture.kubelet, "hung", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{:?}",
        status.results
    );
    let transfer = transfer_of(&transfers, "archive").await?;
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let notes: Vec<String> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|event| Some(format!("{:?} {:?}", event.reason?, event.note)))
        .collect();
    // Exactly one replacement: the new pod's agent is judged from when its
    // container started, not from the pod's creation (the old frozen
    // process takes its grace period to stop before the new one starts).
    let attempts = transfer.status.and_then(|status| status.attempts);
    assert_eq!(
        attempts,
        Some(1),
        "attempts {attempts:?}: {notes:#?}\n{}",
        fixture.kubelet.all_agent_logs()
    );
    let recreated = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|event| {
            event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("hung")
                && event.reason.as_deref() == Some("StagePodRecreated")
        })
        .filter_map(|event| event.note)
        .collect::<Vec<_>>();
    assert!(
        recreated
            .iter()
            .any(|note| note.contains("has not reported")),
        "{recreated:?}"
    );
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), controller).await;
    fixture.stop().await;
    Ok(())
}
