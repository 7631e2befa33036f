//! BackupStorageLocations: validation and its reasons (unreachable, no
//! bucket, wrong credentials), a backup waiting for an unavailable or
//! missing location, the default location and its conflicts, `haulage
//! status`, and a location behind a private CA (TLS).

use std::time::Duration;

use anyhow::{Context, bail};
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{BackupStorageLocation, BackupStorageLocationPhase, VolumeBackup};
use haulage::engine::Repository;
use haulage::store::open_store;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::fixture::{
    BACKUP_DEADLINE, BUCKET, Fixture, PREFIX, create, create_backup, create_backup_of_claim,
    create_backup_to, eventually, final_phase,
};
use crate::support::health::{http_status, wait_until_ready};
use crate::support::kube::KubeCluster;
use crate::support::minio::{ACCESS_KEY, MinioServer, REGION, SECRET_KEY};

/// A BSL in the controller's namespace, validated every 5 s.
fn location_object(name: &str, endpoint: &str, bucket: &str, secret: &str) -> serde_json::Value {
    json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
        "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
        "spec": {"bucket": bucket, "prefix": PREFIX, "endpoint": endpoint,
            "region": REGION, "s3ForcePathStyle": true, "initialize": true,
            "credential": {"name": secret, "key": "cloud"},
            "validationFrequency": "5s"}})
}

/// The phase and `Available` reason of every BSL.
async fn location_states(
    client: &kube::Client,
) -> anyhow::Result<std::collections::BTreeMap<String, (Option<BackupStorageLocationPhase>, String)>>
{
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    Ok(locations
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|location| {
            let status = location.status.clone().unwrap_or_default();
            let why = haulage::api::condition::find_condition(
                &status.conditions,
                haulage::api::condition::condition_type::AVAILABLE,
            )
            .map(|condition| condition.reason.clone())
            .unwrap_or_default();
            (
                location.metadata.name.clone().unwrap_or_default(),
                (status.phase, why),
            )
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_waits_with_a_condition_while_its_location_is_unavailable_and_runs_once_fixed()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .secret_key("wrong-secret-key")
        .start()
        .await?;
    let client = &fixture.client;
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    create_backup(client, "patient").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(60), || async {
        let location = locations.get("minio").await?;
        let backup = backups.get("patient").await?;
        let status = backup.status.unwrap_or_default();
        let storage = haulage::api::condition::find_condition(
            &status.conditions,
            haulage::api::condition::condition_type::STORAGE_AVAILABLE,
        )
        .cloned();
        Ok(
            (location.status.and_then(|s| s.phase)
                == Some(BackupStorageLocationPhase::Unavailable)
                && status.phase == Some(VolumeBackupPhase::WaitingForStorage)
                && storage.is_some_and(|condition| {
                    condition.status == haulage::api::ConditionStatus::False
                        && condition.reason
                            == haulage::api::condition::reason::STORAGE_LOCATION_UNAVAILABLE
                }))
            .then_some(()),
        )
    })
    .await
    .context("the backup did not wait for the unavailable location with a condition")?;
    let pods: Api<Pod> = Api::all(client.clone());
    assert!(
        pods.list(&ListParams::default().labels("app.kubernetes.io/name=haulage-agent"))
            .await?
            .items
            .is_empty(),
        "stage pods created for an unavailable location"
    );

    // The user fixes the credentials; the next probe (every 10 s) finds it.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    secrets
        .patch(
            "s3-credentials",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"cloud": format!(
                "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")}})),
        )
        .await?;
    fixture.completed_backup("patient", BACKUP_DEADLINE).await?;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_storage_locations_get_their_reasons_while_the_controller_stays_ready_and_a_stopped_server_recovers()
-> anyhow::Result<()> {
    // A second S3 server with a bucket, stopped before the controller
    // starts; restarted later on the same port and data directory.
    let mut stopped = MinioServer::start().await?;
    stopped.create_bucket(BUCKET).await?;
    stopped.stop();
    let wrong_credentials = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "wrong-credentials", "namespace": SYSTEM_NAMESPACE},
        "stringData": {"cloud": format!(
            "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = not-the-secret\n")}});
    // The good server's endpoint is only known once the fixture started
    // it, so the two BSLs on it are created right after; the stopped one
    // exists before the controller starts.
    let fixture = Fixture::builder()
        .object(wrong_credentials)
        .object(location_object(
            "stopped",
            &stopped.endpoint(),
            BUCKET,
            "s3-credentials",
        ))
        .start()
        .await?;
    let client = &fixture.client;
    let endpoint = fixture.minio.endpoint();
    // The wrong bucket is also marked default: two defaults, the older
    // (the fixture's `minio`) wins.
    let mut wrong_bucket = location_object(
        "wrong-bucket",
        &endpoint,
        "no-such-bucket",
        "s3-credentials",
    );
    wrong_bucket["spec"]["default"] = json!(true);
    for object in [
        wrong_bucket,
        location_object("wrong-credentials", &endpoint, BUCKET, "wrong-credentials"),
    ] {
        create::<BackupStorageLocation>(client, Some(SYSTEM_NAMESPACE), object).await?;
    }
    wait_until_ready(fixture.health_address.port(), Duration::from_secs(60))
        .await
        .context("the controller never became ready")?;
    fixture.assert_controller_up("at start").await;

    let expected = [
        ("stopped", "EndpointUnreachable"),
        ("wrong-bucket", "BucketNotFound"),
        ("wrong-credentials", "AccessDenied"),
    ];
    let reasons = eventually(Duration::from_secs(120), || async {
        let states = location_states(client).await?;
        let all = expected.iter().all(|(name, why)| {
            states.get(*name).is_some_and(|(phase, reason)| {
                *phase == Some(BackupStorageLocationPhase::Unavailable) && reason == why
            })
        });
        Ok(all.then_some(()))
    })
    .await;
    if let Err(error) = reasons {
        bail!(
            "the bad locations did not get their reasons ({error}): {:#?}",
            location_states(client).await?
        );
    }
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    for (name, _) in expected {
        let message = locations
            .get(name)
            .await?
            .status
            .and_then(|status| status.message)
            .unwrap_or_default();
        assert!(!message.contains(SECRET_KEY), "{name}: {message}");
        assert!(!message.contains("not-the-secret"), "{name}: {message}");
        assert!(message.len() <= 1024, "{name}: {} bytes", message.len());
    }
    fixture
        .assert_controller_up("with three bad locations")
        .await;

    // Both defaults carry the conflict, each naming the other.
    let default_condition = |name: &'static str| {
        let locations = locations.clone();
        async move {
            let status = locations.get(name).await?.status.unwrap_or_default();
            anyhow::Ok(
                haulage::api::condition::find_condition(
                    &status.conditions,
                    haulage::api::condition::condition_type::UNIQUE_DEFAULT,
                )
                .cloned(),
            )
        }
    };
    let conflict = eventually(Duration::from_secs(60), || async {
        let winner = default_condition("minio").await?;
        let loser = default_condition("wrong-bucket").await?;
        Ok(match (winner, loser) {
            (Some(winner), Some(loser))
                if winner.reason == haulage::api::condition::reason::DEFAULT_CONFLICT
                    && loser.reason == haulage::api::condition::reason::DEFAULT_CONFLICT =>
            {
                Some((winner, loser))
            }
            _ => None,
        })
    })
    .await;
    let (winner, loser) = match conflict {
        Ok(pair) => pair,
        Err(error) => bail!(
            "no DefaultConflict on both defaults ({error}): minio {:?}, wrong-bucket {:?}",
            default_condition("minio").await?,
            default_condition("wrong-bucket").await?
        ),
    };
    assert_eq!(winner.status, haulage::api::ConditionStatus::False);
    assert!(
        winner
            .message
            .contains("wrong-bucket is also marked default"),
        "{}",
        winner.message
    );
    assert!(
        loser.message.contains("minio is older"),
        "{}",
        loser.message
    );

    // A backup to the good location completes; one to the stopped server
    // waits with a condition.
    create_backup_to(client, "to-good", "logs", "minio").await?;
    create_backup_to(client, "to-stopped", "content", "stopped").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let finished = final_phase(&backups, &fixture.kubelet, "to-good", BACKUP_DEADLINE)
        .await?
        .status
        .and_then(|status| status.phase);
    assert_eq!(finished, Some(VolumeBackupPhase::Completed));
    let waiting = backups.get("to-stopped").await?.status.unwrap_or_default();
    assert_eq!(waiting.phase, Some(VolumeBackupPhase::WaitingForStorage));
    let storage = haulage::api::condition::find_condition(
        &waiting.conditions,
        haulage::api::condition::condition_type::STORAGE_AVAILABLE,
    )
    .context("StorageAvailable condition")?;
    assert_eq!(storage.status, haulage::api::ConditionStatus::False);
    assert_eq!(
        storage.reason,
        haulage::api::condition::reason::STORAGE_LOCATION_UNAVAILABLE
    );
    assert!(storage.message.contains("stopped"), "{}", storage.message);

    // `haulage status -o json` shows the four locations from status.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args([
            "status",
            "-o",
            "json",
            "--namespace",
            SYSTEM_NAMESPACE,
            "--kubeconfig",
        ])
        .arg(fixture.cluster.kubeconfig())
        .output()
        .await?;
    assert!(
        output.status.success(),
        "haulage status exited with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let phases: std::collections::BTreeMap<String, (String, String)> = report["locations"]
        .as_array()
        .context("locations array")?
        .iter()
        .map(|location| {
            (
                location["name"].as_str().unwrap_or_default().to_string(),
                (
                    location["phase"].as_str().unwrap_or_default().to_string(),
                    location["reason"].as_str().unwrap_or_default().to_string(),
                ),
            )
        })
        .collect();
    assert_eq!(phases.len(), 4, "{report:#}");
    assert_eq!(phases["minio"].0, "Available", "{report:#}");
    for (name, why) in expected {
        assert_eq!(
            phases[name],
            ("Unavailable".to_string(), why.to_string()),
            "{report:#}"
        );
    }
    assert_eq!(report["defaultLocation"], "minio");
    assert!(
        report["problems"]
            .as_array()
            .is_some_and(|problems| problems.iter().any(|problem| problem
                .as_str()
                .is_some_and(|text| text.contains("several locations are marked default")))),
        "{report:#}"
    );
    assert!(
        report["queuedBackups"]
            .as_array()
            .is_some_and(|queued| queued.iter().any(|backup| backup["name"] == "to-stopped")),
        "{report:#}"
    );

    // The conflict is fixed: the remaining default says it is the only one.
    locations
        .patch(
            "wrong-bucket",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"default": false}})),
        )
        .await?;
    eventually(Duration::from_secs(60), || async {
        let winner = default_condition("minio").await?;
        let loser = default_condition("wrong-bucket").await?;
        Ok((loser.is_none()
            && winner.is_some_and(|condition| {
                condition.status == haulage::api::ConditionStatus::True
                    && condition.reason == haulage::api::condition::reason::SINGLE_DEFAULT
            }))
        .then_some(()))
    })
    .await
    .context("the default conditions did not follow the fix")?;

    // The server comes back: the next probe (every 5 s) initialises the
    // repository there (spec.initialize) and the waiting backup runs.
    stopped.restart().await?;
    eventually(Duration::from_secs(60), || async {
        let states = location_states(client).await?;
        Ok(states
            .get("stopped")
            .is_some_and(|(phase, _)| *phase == Some(BackupStorageLocationPhase::Available))
            .then_some(()))
    })
    .await
    .context("the restarted server's location never became Available")?;
    let finished = final_phase(&backups, &fixture.kubelet, "to-stopped", BACKUP_DEADLINE)
        .await?
        .status
        .and_then(|status| status.phase);
    assert_eq!(finished, Some(VolumeBackupPhase::Completed));
    let store = open_store(&format!("s3://{BUCKET}/{PREFIX}"), &stopped.store_options()).await?;
    let repository = Repository::open(store, &haulage::engine::KeySource::PlaintextOnly).await?;
    assert_eq!(repository.snapshot_ids().await?.len(), 1);

    // The winning default is deleted: the other default, probed only on
    // change (validationFrequency 0, so no periodic probe would ever
    // correct it), learns it is now the only one from the deletion. The
    // locations still probed every 5 s go first: any change of a location
    // also re-evaluates the defaults, which would hide a missed deletion.
    for name in ["stopped", "wrong-credentials"] {
        locations
            .delete(name, &kube::api::DeleteParams::default())
            .await?;
    }
    locations
        .patch(
            "wrong-bucket",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"default": true, "validationFrequency": "0"}})),
        )
        .await?;
    eventually(Duration::from_secs(60), || async {
        Ok(default_condition("wrong-bucket")
            .await?
            .is_some_and(|condition| {
                condition.reason == haulage::api::condition::reason::DEFAULT_CONFLICT
            })
            .then_some(()))
    })
    .await
    .context("the second default did not get its conflict back")?;
    locations
        .delete("minio", &kube::api::DeleteParams::default())
        .await?;
    eventually(Duration::from_secs(60), || async {
        Ok(default_condition("wrong-bucket")
            .await?
            .is_some_and(|condition| {
                condition.status == haulage::api::ConditionStatus::True
                    && condition.reason == haulage::api::condition::reason::SINGLE_DEFAULT
            })
            .then_some(()))
    })
    .await
    .context("deleting the winning default did not update the other default's condition")?;
    fixture.assert_controller_up("at the end").await;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_any_storage_location_the_controller_is_ready_backups_wait_and_status_exits_5()
-> anyhow::Result<()> {
    let cluster = KubeCluster::start().await?;
    cluster.install_manifests().await?;
    let client = cluster.client().await?;
    // The admin client: this test is about having no location, not about
    // RBAC, which the fixture's tests cover with the controller's own token.
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let health_port = health.local_addr()?.port();
    let config = haulage::controller::Config {
        agent_image: "mover-agent:test".to_string(),
        health_address: format!("127.0.0.1:{health_port}").parse()?,
        concurrency: 2,
        replica_lease_seconds: haulage::controller::MIN_LEASE_SECONDS,
        ..haulage::controller::Config::new(SYSTEM_NAMESPACE, "controller-0")
    };
    let shutdown = CancellationToken::new();
    let controller = tokio::spawn(haulage::controller::run_with_listener(
        config,
        client.clone(),
        health,
        shutdown.clone(),
    ));
    wait_until_ready(health_port, Duration::from_secs(60))
        .await
        .context("the controller never became ready without a location")?;

    create_backup(&client, "orphan").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(60), || async {
        let status = backups.get("orphan").await?.status.unwrap_or_default();
        let waiting = status.phase == Some(VolumeBackupPhase::WaitingForStorage)
            && haulage::api::condition::find_condition(
                &status.conditions,
                haulage::api::condition::condition_type::STORAGE_AVAILABLE,
            )
            .is_some_and(|condition| {
                condition.reason == haulage::api::condition::reason::STORAGE_LOCATION_NOT_FOUND
            });
        Ok(waiting.then_some(()))
    })
    .await
    .context("the backup did not wait for a location with a condition")?;

    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .args([
            "status",
            "-o",
            "json",
            "-n",
            SYSTEM_NAMESPACE,
            "--kubeconfig",
        ])
        .arg(cluster.kubeconfig())
        .output()
        .await?;
    assert_eq!(
        output.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    assert_eq!(report["locations"], json!([]), "{report:#}");
    assert_eq!(report["queuedBackups"][0]["name"], "orphan", "{report:#}");
    assert!(
        report["problems"]
            .as_array()
            .is_some_and(|problems| problems.iter().any(|problem| problem
                .as_str()
                .is_some_and(|text| text.contains("no BackupStorageLocation")))),
        "{report:#}"
    );

    assert!(!controller.is_finished(), "the controller task exited");
    assert_eq!(http_status(health_port, "/readyz").await, Some(200));
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(30), controller).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "the controller did not stop cleanly: {stopped:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_to_a_location_behind_a_private_ca_completes() -> anyhow::Result<()> {
    // MinIO serves HTTPS with a certificate from a throwaway CA that only
    // the BSL's caBundle carries: the probe and every agent must trust it.
    let fixture = Fixture::builder().tls().start().await?;
    let client = &fixture.client;
    assert!(fixture.minio.endpoint().starts_with("https://"));
    create_backup_of_claim(client, "private-ca", "db").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(&backups, &fixture.kubelet, "private-ca", BACKUP_DEADLINE).await?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{:?}\n{}",
        status.results,
        fixture.kubelet.all_agent_logs()
    );
    assert!(status.results[0].snapshot_id.is_some());
    fixture.stop().await;
    Ok(())
}
