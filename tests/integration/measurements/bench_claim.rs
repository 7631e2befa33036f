//! `haulage bench --claim` against the first backup it estimates, in the
//! cluster: one claim of 1 GiB of sample data (a quarter small files, the
//! rest random, log-like and duplicated), measured by the benchmark in its
//! stage pod, then backed up for the first time by a VolumeBackup of the
//! same claim, from the same node into the same (empty) MinIO; a fresh
//! cluster and bucket each round, so each backup is a first one
//! (docs/benchmarks.md, "`haulage bench --claim` in the cluster").

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::VolumeBackup;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use kube::api::Api;
use serde_json::json;

use super::spread;
use crate::support::fixture::{Fixture, Layout, create_backup_in, final_phase};

/// The highest agent peak of the stage pods in `namespace` whose name
/// starts with `prefix`, MiB.
fn peak_mib(fixture: &Fixture, namespace: &str, prefix: &str) -> f64 {
    fixture
        .kubelet
        .agent_peak_memory()
        .iter()
        .filter(|((pod_namespace, pod), _)| pod_namespace == namespace && pod.starts_with(prefix))
        .map(|(_, bytes)| *bytes)
        .max()
        .unwrap_or(0) as f64
        / (1 << 20) as f64
}

/// Three rounds of: a fresh fixture (cluster, MinIO, one claim `solo/data`
/// of 1 GiB on one node), `haulage bench --claim solo/data --json` (the
/// default 256 MiB of samples), then a VolumeBackup of the claim; the
/// estimate (the claim's bytes at the estimated pace) beside the backup's
/// own duration (its snapshot's `durationSeconds`). The binaries are the
/// debug builds next to the test unless `$HAULAGE_AGENT_BIN` and
/// `$HAULAGE_BIN` name others (release builds, for the figures). Run with
/// `cargo test --test integration measurements::bench_claim -- --ignored
/// --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~3 min with release builds), not a check"]
async fn measure_bench_claim_against_the_first_backup_of_the_same_claim() -> anyhow::Result<()> {
    const VOLUME_BYTES: u64 = 1 << 30;
    const RUNS: usize = 3;
    let cli = std::env::var_os("HAULAGE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_haulage")));
    let mut rows = Vec::new();
    let (mut ratios, mut bench_peaks, mut backup_peaks) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..RUNS {
        let layout = Layout::solo(4242);
        let fixture = Fixture::builder()
            .layout(layout)
            .volume_bytes(VOLUME_BYTES)
            .start()
            .await?;
        let started = Instant::now();
        let output = tokio::process::Command::new(&cli)
            .args(["bench", "--claim", "solo/data", "--json"])
            .env("KUBECONFIG", fixture.cluster.kubeconfig())
            .env_remove("HAULAGE_REPO")
            .output()
            .await?;
        let bench_seconds = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            output.status.success(),
            "haulage bench --claim: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            fixture.kubelet.all_agent_logs()
        );
        let report: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        let figures = report["claims"][0]["benchmark"].clone();
        let bytes = figures["bytes"].as_f64().context("bytes")?;
        let pace = figures["estimateBytesPerSecond"]
            .as_f64()
            .context("estimate")?;
        let estimate = bytes / pace;
        let bench_peak = peak_mib(&fixture, "solo", "haulage-backup-bench-");

        create_backup_in(
            &fixture.client,
            "first",
            &["solo"],
            json!({"matchLabels": {"claim": "data"}}),
        )
        .await?;
        let backups: Api<VolumeBackup> = Api::namespaced(fixture.client.clone(), SYSTEM_NAMESPACE);
        let backup = final_phase(
            &backups,
            &fixture.kubelet,
            "first",
            Duration::from_secs(900),
        )
        .await?;
        let status = backup.status.context("status")?;
        anyhow::ensure!(
            status.phase == Some(VolumeBackupPhase::Completed),
            "{status:#?}"
        );
        let repository = fixture.repository().await?;
        let (snapshots, _) = repository.list_snapshots().await?;
        let summary = &snapshots
            .first()
            .context("the backup's snapshot")?
            .1
            .summary;
        let backup_seconds = summary.duration_seconds;
        let stored_percent = 100.0 * summary.bytes_stored as f64 / summary.bytes_read as f64;
        let backup_peak = peak_mib(&fixture, "solo", "haulage-backup-first-");
        let ratio = estimate / backup_seconds;
        rows.push(format!(
            "{run:>3} {estimate:>10.2} {backup_seconds:>10.2} {ratio:>7.2}  {bench_seconds:>8.1} {bench_peak:>10.1} {backup_peak:>11.1}  {}  (read {:.0} MiB/s, pipeline {:.0} MiB/s, upload {:.0} MiB/s; stored {}% in the samples, {stored_percent:.0}% in the backup)",
            figures["limitedBy"].as_str().unwrap_or(""),
            figures["readBytesPerSecond"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
            figures["pipelineBytesPerSecond"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
            figures["uploadBytesPerSecond"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
            figures["storedPercent"],
        ));
        ratios.push(ratio);
        bench_peaks.push(bench_peak);
        backup_peaks.push(backup_peak);
        fixture.stop().await;
    }
    println!("run  estimate s  backup s  ratio  bench s  bench MiB  backup MiB  limited by");
    for row in &rows {
        println!("{row}");
    }
    println!("estimate / backup: {}", spread(&mut ratios));
    println!("bench agent peak MiB: {}", spread(&mut bench_peaks));
    println!("backup agent peak MiB: {}", spread(&mut backup_peaks));
    Ok(())
}
