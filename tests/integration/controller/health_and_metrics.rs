//! The controller's and the agents' `/metrics` moving with a backup, and
//! `/readyz` following the API server, not the storage location.

use std::time::Duration;

use anyhow::Context;
use haulage::api::labels::SYSTEM_NAMESPACE;

use crate::support::fixture::{BACKUP_DEADLINE, Fixture, create_backup, eventually, stage_pods};
use crate::support::health::{http_get, http_status, wait_until_ready};
use crate::support::scrape::{Exposition, scrape};

/// One agent's scrape with every per-transfer series of its volume, bytes
/// read and time waited on the upload cap.
struct AgentScrape {
    address: std::net::SocketAddr,
    namespace: String,
    pvc: String,
    exposition: Exposition,
}

/// Scrape the running agents until one shows bytes read and time waited on
/// the upload cap for one of its volumes.
async fn scrape_a_busy_agent(fixture: &Fixture) -> anyhow::Result<AgentScrape> {
    eventually(BACKUP_DEADLINE, || async {
        for (namespace, pod) in stage_pods(&fixture.client).await? {
            let Some(address) = fixture.kubelet.agent_metrics_address(&namespace, &pod) else {
                continue;
            };
            // The agent may have finished and exited since.
            let Ok(exposition) = scrape(address).await else {
                continue;
            };
            let waited = exposition.sum(
                "haulage_agent_throttle_wait_seconds_total",
                &[("limiter", "upload")],
            );
            let busy = exposition
                .find(
                    "haulage_agent_bytes_read_total",
                    &[("namespace", &namespace)],
                )
                .find(|sample| sample.value > 0.0)
                .map(|sample| sample.labels["pvc"].clone());
            if let Some(pvc) = busy
                && waited > 0.0
            {
                return Ok(Some(AgentScrape {
                    address,
                    namespace,
                    pvc,
                    exposition,
                }));
            }
        }
        Ok(None)
    })
    .await
    .with_context(|| format!("no busy agent seen:\n{}", fixture.kubelet.all_agent_logs()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_controller_and_agent_metrics_exist_and_move_with_a_volume_backup() -> anyhow::Result<()>
{
    // Incompressible data behind a 512 KiB/s upload cap per agent: uploads
    // wait on the cap, and agents live long enough to be scraped.
    let fixture = Fixture::builder()
        .upload_bytes_per_second(512 << 10)
        .volume_bytes(3 << 20)
        .random_data_in_small_packs()
        .start()
        .await?;
    let client = &fixture.client;
    let location = [("namespace", SYSTEM_NAMESPACE), ("location", "minio")];

    let before = scrape(fixture.health_address).await?;
    assert_eq!(
        before.value("haulage_storage_location_available", &location)?,
        1.0
    );
    assert!(before.value("haulage_storage_location_probe_latency_seconds", &location)? > 0.0);
    assert!(
        before.value(
            "haulage_storage_location_last_validation_timestamp_seconds",
            &location
        )? > 1.7e9
    );
    assert!(
        before.sum(
            "haulage_reconcile_duration_seconds_count",
            &[("controller", "backupstoragelocation")]
        ) > 0.0
    );
    // Families computed at scrape time are declared even while empty; the
    // byte counters appear with their first series.
    for (family, kind) in [
        ("haulage_reconcile_duration_seconds", "histogram"),
        ("haulage_volume_transfers", "gauge"),
        ("haulage_transfer_queue_length", "gauge"),
        ("haulage_transfer_throughput_bytes_per_second", "gauge"),
        ("haulage_volume_backups", "gauge"),
        ("haulage_waiting_volume_backups", "gauge"),
    ] {
        assert_eq!(
            before.types.get(family).map(String::as_str),
            Some(kind),
            "{family}"
        );
    }
    let read_before = before.sum("haulage_transfer_bytes_read_total", &[]);
    let uploaded_before = before.sum("haulage_transfer_bytes_uploaded_total", &[]);

    create_backup(client, "observed").await?;

    // An agent mid-transfer: its per-volume series, and counters that only
    // grow between two scrapes.
    let first = scrape_a_busy_agent(&fixture).await?;
    let volume = [
        ("namespace", first.namespace.as_str()),
        ("pvc", first.pvc.as_str()),
    ];
    for family in [
        "haulage_agent_transfer_bytes_done",
        "haulage_agent_transfer_size_bytes",
        "haulage_agent_transfer_files_done",
        "haulage_agent_transfer_files",
        "haulage_agent_bytes_read_total",
        "haulage_agent_bytes_uploaded_total",
    ] {
        first.exposition.value(family, &volume)?;
    }
    assert!(
        first
            .exposition
            .value("haulage_agent_transfer_size_bytes", &volume)?
            >= first
                .exposition
                .value("haulage_agent_transfer_bytes_done", &volume)?
    );
    if let Ok(second) = scrape(first.address).await {
        for (family, labels) in [
            ("haulage_agent_bytes_read_total", &volume[..]),
            ("haulage_agent_bytes_uploaded_total", &volume[..]),
            (
                "haulage_agent_throttle_wait_seconds_total",
                &[("limiter", "upload")][..],
            ),
        ] {
            assert!(
                second.value(family, labels)? >= first.exposition.value(family, labels)?,
                "{family} went down"
            );
        }
    }

    fixture
        .completed_backup("observed", BACKUP_DEADLINE)
        .await?;

    // The controller saw the bytes move and the transfers and the backup
    // complete (its gauges read its caches, which may show the backup's
    // final status a moment after the transfers').
    let after = eventually(Duration::from_secs(30), || async {
        let after = scrape(fixture.health_address).await?;
        let completed = after.sum(
            "haulage_volume_transfers",
            &[("phase", "Completed"), ("direction", "Upload")],
        );
        let backup_completed = after.sum("haulage_volume_backups", &[("phase", "Completed")]);
        Ok((completed == 5.0 && backup_completed == 1.0).then_some(after))
    })
    .await
    .context("the gauges never showed five completed uploads and one completed backup")?;
    for family in [
        "haulage_transfer_bytes_read_total",
        "haulage_transfer_bytes_uploaded_total",
    ] {
        assert_eq!(
            after.types.get(family).map(String::as_str),
            Some("counter"),
            "{family}"
        );
    }
    let read_after = after.sum(
        "haulage_transfer_bytes_read_total",
        &[("location", "minio")],
    );
    assert!(
        read_after >= read_before + 5.0 * f64::from(3 << 20),
        "bytes read {read_before} -> {read_after}"
    );
    assert!(
        after.sum(
            "haulage_transfer_bytes_uploaded_total",
            &[("location", "minio")]
        ) > uploaded_before
    );
    assert!(
        after.sum(
            "haulage_reconcile_duration_seconds_count",
            &[("controller", "volumebackup")]
        ) > 0.0
    );
    assert_eq!(
        after.value("haulage_volume_backups", &[("phase", "Completed")])?,
        1.0
    );
    assert_eq!(after.value("haulage_transfer_queue_length", &[])?, 0.0);
    assert_eq!(after.value("haulage_waiting_volume_backups", &[])?, 0.0);
    assert_eq!(
        after.value("haulage_storage_location_available", &location)?,
        1.0
    );
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_follows_the_api_server_and_not_the_storage_location() -> anyhow::Result<()> {
    let mut fixture = Fixture::builder().start().await?;
    let address = fixture.health_address;
    let location = [("namespace", SYSTEM_NAMESPACE), ("location", "minio")];
    wait_until_ready(address.port(), Duration::from_secs(60))
        .await
        .context("never ready")?;

    // The storage goes away: the location turns Unavailable and its gauge
    // 0, and the controller stays ready.
    fixture.minio.stop();
    eventually(Duration::from_secs(90), || async {
        let exposition = scrape(address).await?;
        Ok(
            (exposition.value("haulage_storage_location_available", &location)? == 0.0)
                .then_some(()),
        )
    })
    .await
    .context("the location's gauge never fell to 0")?;
    assert_eq!(http_status(address.port(), "/readyz").await, Some(200));

    // The API server goes away: not ready (within the 10 s check interval
    // and its 5 s timeout), still alive, metrics still served from the
    // caches.
    fixture.cluster.stop_apiserver();
    let body = eventually(Duration::from_secs(60), || async {
        Ok(http_get(address.port(), "/readyz")
            .await
            .filter(|(status, _)| *status == 503)
            .map(|(_, body)| body))
    })
    .await
    .context("still ready without an API server")?;
    assert!(body.starts_with("API server not reachable: "), "{body}");
    assert_eq!(http_status(address.port(), "/healthz").await, Some(200));
    assert_eq!(
        scrape(address)
            .await?
            .value("haulage_storage_location_available", &location)?,
        0.0
    );
    fixture.stop().await;
    Ok(())
}
