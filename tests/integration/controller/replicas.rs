//! High availability: two replicas (one of them the `haulage controller`
//! binary) each writing only the backups they own, a crashed replica's
//! backup adopted by another, and the admission lease never held by two
//! replicas at once.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use haulage::api::VolumeBackup;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use tokio_util::sync::CancellationToken;

use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, controller_process, create_backup, create_backup_of_claim,
    eventually, final_phase, leftovers,
};
use crate::support::health::{http_status, wait_until_ready};
use crate::support::kube::KubeCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_one_of_them_the_binary_complete_backups_each_written_only_by_its_owner()
-> anyhow::Result<()> {
    let fixture = Fixture::builder().start().await?;
    let client = &fixture.client;
    // The second replica: `haulage controller` as the Deployment runs it,
    // with the controller ServiceAccount's token.
    let kubeconfig = fixture
        .cluster
        .service_account_kubeconfig(
            SYSTEM_NAMESPACE,
            "haulage-controller",
            &fixture.work.path().join("replica-1.kubeconfig"),
        )
        .await?;
    let port = crate::support::minio::free_port()?;
    let log_path = fixture.work.path().join("replica-1.log");
    let mut replica = controller_process(
        Path::new(env!("CARGO_BIN_EXE_haulage")),
        &kubeconfig,
        "controller-1",
        port,
        &log_path,
        &[],
    )?;
    if let Err(not_ready) = wait_until_ready(port, Duration::from_secs(60)).await {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        anyhow::bail!("the binary never became ready: {not_ready:#}; its log:\n{log}");
    }
    assert_eq!(http_status(port, "/healthz").await, Some(200));

    for name in ["first", "second", "third"] {
        create_backup(client, name).await?;
    }
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for name in ["first", "second", "third"] {
        let backup = final_phase(&backups, &fixture.kubelet, name, BACKUP_DEADLINE).await?;
        let status = backup.status.context("status")?;
        assert_eq!(status.phase, Some(VolumeBackupPhase::Completed), "{name}");
        let owner = status.owner.context("owner")?.replica;
        assert!(["controller-0", "controller-1"].contains(&owner.as_str()));
        let claimed = haulage::api::condition::find_condition(
            &status.conditions,
            haulage::api::condition::condition_type::CLAIMED,
        )
        .context("Claimed condition")?;
        assert_eq!(
            claimed.message,
            format!("claimed by replica {owner}"),
            "{name}: the status was written by a replica that does not own it"
        );
    }

    // SIGTERM stops the binary cleanly.
    let pid = replica.id().context("pid")?;
    tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    let exit = tokio::time::timeout(Duration::from_secs(30), replica.wait()).await??;
    assert!(exit.success(), "haulage controller exited with {exit}");
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_replicas_backup_is_adopted_by_another_and_completes() -> anyhow::Result<()> {
    // 12 MiB per claim at 1 MiB/s: the backup is still running when its
    // owner crashes.
    let fixture = Fixture::builder().long_running_transfers().start().await?;
    let client = fixture.client.clone();
    create_backup_of_claim(&client, "adopted", "archive").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(120), || async {
        let backup = backups.get("adopted").await?;
        let status = backup.status.unwrap_or_default();
        let owned = status
            .owner
            .is_some_and(|owner| owner.replica == "controller-0");
        let running = status
            .volumes
            .is_some_and(|volumes| volumes.in_progress > 0);
        Ok((owned && running).then_some(()))
    })
    .await
    .context("controller-0 never started the backup")?;

    // The crash: the replica's future is dropped, with every task it
    // spawned; nothing runs on the way out, so its lease stays behind.
    fixture.controller.abort();
    eventually(Duration::from_secs(10), || async {
        Ok(fixture.controller.is_finished().then_some(()))
    })
    .await
    .context("the aborted controller did not stop")?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    assert!(
        leases
            .get_opt(&haulage::reconcile::replicas::lease_name("controller-0"))
            .await?
            .is_some(),
        "a crashed replica's lease stays until it expires"
    );

    let (shutdown, successor) = fixture
        .spawn_controller(Fixture::controller_config("controller-1")?)
        .await?;

    let status = fixture.completed_backup("adopted", BACKUP_DEADLINE).await?;
    let owner = status.owner.context("owner")?;
    assert_eq!(owner.replica, "controller-1");
    assert_eq!(owner.adopted_from.as_deref(), Some("controller-0"));
    let claimed = haulage::api::condition::find_condition(
        &status.conditions,
        haulage::api::condition::condition_type::CLAIMED,
    )
    .context("Claimed condition")?;
    assert_eq!(
        claimed.reason,
        haulage::api::condition::reason::ADOPTED_FROM_REPLICA
    );
    assert_eq!(status.results.len(), 1);
    assert!(
        status.results[0].snapshot_id.is_some(),
        "{:?}",
        status.results
    );
    // Nothing left: the successor released the stage pod and its secrets.
    eventually(Duration::from_secs(60), || async {
        Ok((leftovers(&client).await? == (0, 0)).then_some(()))
    })
    .await
    .context("stage pods or credential copies remain")?;

    // A clean stop releases the lease at once.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), successor).await???;
    assert!(
        leases
            .get_opt(&haulage::reconcile::replicas::lease_name("controller-1"))
            .await?
            .is_none(),
        "a stopped replica deletes its lease"
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_never_both_hold_the_admission_lease_and_a_dead_holders_lease_is_taken_over()
-> anyhow::Result<()> {
    use haulage::controller::lease::{self, LEASE_DURATION_SECONDS, Leadership};
    let cluster = KubeCluster::start().await?;
    let client = cluster.client().await?;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "default");
    let replica = |identity: &str| {
        let leadership = Arc::new(Leadership::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(lease::run(
            leases.clone(),
            identity.to_string(),
            leadership.clone(),
            shutdown.clone(),
        ));
        (leadership, shutdown, task)
    };
    let (a, a_shutdown, a_task) = replica("replica-a");
    let (b, b_shutdown, b_task) = replica("replica-b");
    // Sampled every 20 ms: never both leaders.
    let sample = |a: &Leadership, b: &Leadership| {
        let led = (a.is_leader(), b.is_leader());
        assert!(!(led.0 && led.1), "both replicas admit at once");
        led
    };
    let start = Instant::now();
    let mut leader = None;
    while start.elapsed() < Duration::from_secs(6) {
        match sample(&a, &b) {
            (true, _) => leader = leader.or(Some('a')),
            (_, true) => leader = leader.or(Some('b')),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leader = leader.context("no replica took the admission lease")?;
    let (holder, holder_task, other, other_shutdown, other_task) = match leader {
        'a' => (a, a_task, b, b_shutdown, b_task),
        _ => (b, b_task, a, a_shutdown, a_task),
    };
    // The holder dies without releasing (its task is aborted): its own
    // deadline passes before the other may take over, after the lease's
    // duration of standing still.
    holder_task.abort();
    let died = Instant::now();
    loop {
        let (_, other_led) = sample(&holder, &other);
        if other_led {
            break;
        }
        if died.elapsed() > Duration::from_secs(LEASE_DURATION_SECONDS + 15) {
            bail!("the other replica never took over the dead holder's lease");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = died.elapsed();
    assert!(
        took >= Duration::from_secs(LEASE_DURATION_SECONDS - 2),
        "taken over after {took:?}, before the lease could expire"
    );
    let lease = leases.get(lease::ADMISSION_LEASE).await?;
    let spec = lease.spec.context("lease spec")?;
    assert_ne!(spec.holder_identity, None);
    assert_eq!(spec.lease_transitions, Some(1));

    // A replica that stops releases the lease (holder cleared).
    other_shutdown.cancel();
    other_task.await?;
    let released = leases.get(lease::ADMISSION_LEASE).await?;
    assert_eq!(
        released.spec.and_then(|spec| spec.holder_identity),
        None,
        "the stopping holder did not release the lease"
    );
    drop(cluster);
    Ok(())
}
