//! How close the running transfers of one storage stay to their
//! StoragePolicy's `maxBytesPerSecond` (docs/benchmarks.md, "Bandwidth
//! split under a StoragePolicy").

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{VolumeBackup, VolumeTransfer, VolumeTransferPhase};
use kube::api::{Api, ListParams};
use serde_json::json;

use crate::engine::support::random_bytes;
use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, STORAGE_CLASS, create_backup, create_storage_policy, final_phase,
    watch_transfers,
};

/// The bandwidth split measured, not asserted (figures in
/// docs/benchmarks.md): five claims of 7 to 31 MiB of random data under a
/// StoragePolicy of 6 MiB/s. After every progress report, the sum of the
/// running agents' measured read rates (each over its last 2 s interval) is
/// a sample; a sample is steady when the running set and every grant have
/// not changed for 3 s, so each summed rate was measured under the grants
/// in force. Also the average over the whole backup. Run with
/// `cargo build -p mover-agent && cargo test --test integration
/// measurements::bandwidth_split -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~30 s), not a check"]
async fn measure_the_bandwidth_split_under_a_storage_policy() -> anyhow::Result<()> {
    const CAP: i64 = 6 << 20;
    /// How long grants and the running set must stand still for a sample
    /// to count as steady (agents report every 2 s).
    const STEADY: Duration = Duration::from_secs(3);
    let fixture = Fixture::builder()
        .random_data_in_small_packs()
        .start()
        .await?;
    let client = &fixture.client;
    let claims = [
        ("shop", "db"),
        ("shop", "uploads"),
        ("shop", "archive"),
        ("web", "content"),
        ("web", "logs"),
    ];
    for (index, (namespace, pvc)) in claims.iter().enumerate() {
        let size = (index + 1) * (6 << 20);
        std::fs::write(
            fixture.volumes.join(namespace).join(pvc).join("extra.bin"),
            random_bytes(100 + index as u64, size),
        )?;
    }
    create_storage_policy(
        client,
        "six-mebibytes",
        json!({"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": CAP}),
    )
    .await?;

    #[derive(Default)]
    struct Measured {
        /// Steady sums of the running transfers' reported rates.
        steady: Vec<i64>,
        /// Every sum with at least two running.
        all: Vec<i64>,
        first_start: Option<Instant>,
        last_end: Option<Instant>,
    }
    let measured = Arc::new(std::sync::Mutex::new(Measured::default()));
    let recorder = {
        let measured = measured.clone();
        // name → (running, grant, last reported rate)
        let mut latest: std::collections::BTreeMap<String, (bool, Option<i64>, i64)> =
            std::collections::BTreeMap::new();
        let mut last_change = Instant::now();
        watch_transfers(client, move |transfer| {
            let now = Instant::now();
            let status = transfer.status.clone().unwrap_or_default();
            let phase = status.phase.unwrap_or(VolumeTransferPhase::New);
            let running = phase == VolumeTransferPhase::InProgress;
            let grant = transfer.spec.granted_bytes_per_second;
            let rate = status.progress.as_ref().map_or(0, |p| p.bytes_per_second);
            let name = transfer.metadata.name.clone().unwrap_or_default();
            let before = latest.insert(name, (running, grant, rate));
            if before.is_none_or(|(was_running, old_grant, _)| {
                was_running != running || old_grant != grant
            }) {
                last_change = now;
            }
            let mut measured = measured.lock().expect("measured lock");
            if running {
                measured.first_start.get_or_insert(now);
            }
            if phase == VolumeTransferPhase::Completed {
                measured.last_end = Some(now);
            }
            let rates: Vec<i64> = latest
                .values()
                .filter(|(running, _, _)| *running)
                .map(|(_, _, rate)| *rate)
                .collect();
            if rates.len() >= 2 && rates.iter().all(|rate| *rate > 0) {
                let sum = rates.iter().sum();
                measured.all.push(sum);
                if now.duration_since(last_change) >= STEADY {
                    measured.steady.push(sum);
                }
            }
        })
    };

    create_backup(client, "measured").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(&backups, &fixture.kubelet, "measured", BACKUP_DEADLINE).await?;
    recorder.abort();
    let status = backup.status.context("status")?;
    assert_eq!(status.phase, Some(VolumeBackupPhase::Completed));
    let transfers: Api<VolumeTransfer> = Api::all(client.clone());
    let bytes_read: i64 = transfers
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|transfer| transfer.status.as_ref()?.bytes_read)
        .sum();

    let (mut steady, mut all, first, last) = {
        let measured = measured.lock().expect("measured lock");
        (
            measured.steady.clone(),
            measured.all.clone(),
            measured.first_start,
            measured.last_end,
        )
    };
    let (first, last) = (
        first.context("no start seen")?,
        last.context("no end seen")?,
    );
    let span = last.duration_since(first).as_secs_f64();
    assert!(
        !steady.is_empty() && bytes_read > 0,
        "nothing measured in steady state"
    );
    steady.sort_unstable();
    all.sort_unstable();
    let percent = |bytes: i64| 100.0 * bytes as f64 / CAP as f64;
    println!(
        "cap {} B/s; steady sums of reported rates: {} samples, min {:.1}%, median {:.1}%, \
         max {:.1}% of the cap; all sums with >= 2 running: {} samples, median {:.1}%, \
         max {:.1}%; whole backup: {} B read in {:.1} s from first start to last \
         completion = {:.1}% of the cap",
        CAP,
        steady.len(),
        percent(steady[0]),
        percent(steady[steady.len() / 2]),
        percent(steady[steady.len() - 1]),
        all.len(),
        percent(all[all.len() / 2]),
        percent(all[all.len() - 1]),
        bytes_read,
        span,
        100.0 * bytes_read as f64 / span / CAP as f64,
    );
    fixture.stop().await;
    Ok(())
}
