//! Restore throughput of one volume in the cluster (a VolumeRestore, the
//! controller, the real agent in a stage pod run by the kubelet stand-in)
//! against `haulage restore --verify` of the same snapshot from the same
//! MinIO on the same machine (the same work: a restore, then the written
//! tree re-read and compared with the snapshot), the agent's peak memory while it restores, and the
//! cutover pass (`existingClaim: Sync` after 1 % of the files changed)
//! against the full restore (docs/benchmarks.md, "Restore in the cluster
//! and the cutover").

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::restore::VolumeRestorePhase;
use haulage::api::{VolumeBackup, VolumeRestore};
use kube::api::Api;
use serde_json::json;

use crate::support::fixture::{
    BUCKET, Fixture, Layout, PREFIX, create, create_backup_in, final_phase,
};
use crate::support::minio::with_s3_credentials;

/// The `seconds=` figure of the agent log line containing `marker`.
fn logged_seconds(log: &str, marker: &str) -> Option<f64> {
    let line = log.lines().rev().find(|line| line.contains(marker))?;
    let value = line.split("seconds=").nth(1)?;
    value.split_whitespace().next()?.parse().ok()
}

/// Wait for the VolumeRestore `name` to finish, check it completed, and
/// return its (first) stage pod's name and that pod's agent log, the pod
/// running in `namespace`.
/// Write back what earlier steps left dirty in the page cache, so that a
/// timed restore on the disk does not pay for the one before it (each
/// writes a gigabyte; without this the step after a restore ran slower by
/// its writeback, whichever side it was).
fn write_back_earlier_steps() -> anyhow::Result<()> {
    let status = std::process::Command::new("sync").status()?;
    anyhow::ensure!(status.success(), "sync failed: {status}");
    Ok(())
}

async fn completed_restore_agent_log(
    fixture: &Fixture,
    restores: &Api<VolumeRestore>,
    name: &str,
    namespace: &str,
) -> anyhow::Result<(String, String)> {
    let restore = final_phase(restores, &fixture.kubelet, name, Duration::from_secs(900)).await?;
    let status = restore.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeRestorePhase::Completed),
        "{status:#?}"
    );
    let pod = status
        .plan
        .as_ref()
        .and_then(|plan| plan.stage_pods.first())
        .map(|pod| pod.pod_name.clone())
        .context("stage pod")?;
    let log = std::fs::read_to_string(
        fixture
            .work
            .path()
            .join("kubelet/pods")
            .join(namespace)
            .join(&pod)
            .join("agent.log"),
    )?;
    Ok((pod, log))
}

/// One claim of 1 GiB of sample data (a quarter small files, the rest
/// random, log-like and duplicated) backed up once, then restored in
/// turns, three times each: by a VolumeRestore into a new claim (the
/// agent's restore phase and its verification are read from its log; the
/// restore's own `durationSeconds` is the same clock `haulage restore`
/// reports), and by `haulage restore` into an empty directory. Both run
/// as root, restore owners, write into the same filesystem and read from
/// the same MinIO; no StoragePolicy caps the agent. Then 1 % of the
/// source's files are rewritten, backed up again and restored with
/// `existingClaim: Sync` into the last round's claim (the cutover), its
/// restore and verification phases set beside the full restore's. The binaries are the
/// debug builds next to the test unless `$HAULAGE_AGENT_BIN` and
/// `$HAULAGE_BIN` name others (release builds, for the figures). Run with
/// `cargo test --test integration measurements::restore_throughput --
/// --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~5 min with release builds, 4 GiB of temporary disk), not a check"]
async fn measure_restore_throughput_of_one_volume_in_the_cluster_and_with_the_cli()
-> anyhow::Result<()> {
    const VOLUME_BYTES: u64 = 1 << 30;
    const RUNS: usize = 3;
    let layout = Layout::solo(4242);
    let fixture = Fixture::builder()
        .layout(layout)
        .volume_bytes(VOLUME_BYTES)
        .provisioning()
        .start()
        .await?;
    let client = &fixture.client;
    create_backup_in(
        client,
        "source",
        &["solo"],
        json!({"matchLabels": {"claim": "data"}}),
    )
    .await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(
        &backups,
        &fixture.kubelet,
        "source",
        Duration::from_secs(900),
    )
    .await?;
    let backup_status = backup.status.context("status")?;
    assert_eq!(backup_status.phase, Some(VolumeBackupPhase::Completed));
    let snapshot = backup_status.results[0]
        .snapshot_id
        .clone()
        .context("snapshot")?;
    let cli = std::env::var_os("HAULAGE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_haulage")));
    let restores: Api<VolumeRestore> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mut rows = Vec::new();
    for run in 0..RUNS {
        // In the cluster.
        let name = format!("run-{run}");
        let namespace = format!("solo-r{run}");
        write_back_earlier_steps()?;
        create::<VolumeRestore>(
            client,
            Some(SYSTEM_NAMESPACE),
            json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeRestore",
                "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
                "spec": {"source": {"snapshots": [snapshot]},
                    "namespaceMap": {"solo": namespace}, "createNamespaces": true}}),
        )
        .await?;
        let (pod, log) =
            completed_restore_agent_log(&fixture, &restores, &name, &namespace).await?;
        let restored = logged_seconds(&log, "restored; verifying").context("restore seconds")?;
        let verified = logged_seconds(&log, "verified").context("verify seconds")?;
        let peak = fixture
            .kubelet
            .agent_peak_memory()
            .get(&(namespace.clone(), pod.clone()))
            .copied()
            .unwrap_or(0);
        // The CLI, from the same location, into the same filesystem.
        let target = fixture.work.path().join(format!("cli-{run}"));
        write_back_earlier_steps()?;
        let output = with_s3_credentials(
            &mut std::process::Command::new(&cli),
            &fixture.minio.endpoint(),
        )
        .args(["restore", &snapshot])
        .arg(&target)
        .args([
            "--repo",
            &format!("s3://{BUCKET}/{PREFIX}"),
            "--no-progress",
            "--json",
            "--verify",
        ])
        .env_remove("HAULAGE_REPO")
        .output()?;
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let outcome: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        let cli_seconds = outcome["durationSeconds"]
            .as_f64()
            .context("durationSeconds")?;
        let cli_verified = outcome["verification"]["durationSeconds"]
            .as_f64()
            .context("verification durationSeconds")?;
        assert_eq!(
            outcome["verification"]["mismatches"],
            json!([]),
            "haulage restore --verify"
        );
        let mib = VOLUME_BYTES as f64 / f64::from(1 << 20);
        println!(
            "run {run}: agent restore {restored:.2} s ({:.0} MiB/s), verify {verified:.2} s, \
             restore+verify {:.0} MiB/s, agent peak RSS {:.1} MiB; haulage restore --verify \
             {cli_seconds:.2} s ({:.0} MiB/s), verify {cli_verified:.2} s; agent/cli restore rate \
             {:.2}, restore+verify {:.2}",
            mib / restored,
            mib / (restored + verified),
            peak as f64 / f64::from(1 << 20),
            mib / cli_seconds,
            cli_seconds / restored,
            (cli_seconds + cli_verified) / (restored + verified)
        );
        rows.push((restored, verified, cli_seconds, cli_verified));
        std::fs::remove_dir_all(&target)?;
        if run + 1 < RUNS {
            std::fs::remove_dir_all(fixture.volumes.join(&namespace))?;
        }
    }
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let restored = median(rows.iter().map(|row| row.0).collect());
    let verified = median(rows.iter().map(|row| row.1).collect());
    let cli_seconds = median(rows.iter().map(|row| row.2).collect());
    let cli_verified = median(rows.iter().map(|row| row.3).collect());
    println!(
        "medians of {RUNS}: agent restore {restored:.2} s, verify {verified:.2} s; haulage restore \
         --verify {cli_seconds:.2} s, verify {cli_verified:.2} s; agent rate / cli rate: restore \
         {:.2}, restore+verify {:.2} (against the cli's restore alone {:.2})",
        cli_seconds / restored,
        (cli_seconds + cli_verified) / (restored + verified),
        cli_seconds / (restored + verified)
    );
    // Each round's agent and CLI ran back to back: their ratio is the
    // comparison the disk's changing pace disturbs least.
    let paired = median(
        rows.iter()
            .map(|&(restored, verified, cli, cli_verified)| {
                (cli + cli_verified) / (restored + verified)
            })
            .collect(),
    );
    println!("median of the {RUNS} rounds' agent / cli rates, restore+verify: {paired:.2}");

    // The cutover: 1 % of the source's files (those of at most 16 MiB, so
    // that 1 % of the files is about 1 % of the bytes) rewritten with new
    // bytes of the same length, backed up again, and restored with
    // `existingClaim: Sync` into the last round's claim.
    let source = fixture.volumes.join("solo/data");
    let mut files: Vec<_> = crate::engine::support::files_under(&source)
        .into_iter()
        .filter(|(_, size)| *size <= 16 << 20)
        .collect();
    files.sort();
    let mut changed = 0u64;
    for (index, (path, size)) in files.iter().enumerate().step_by(100) {
        std::fs::write(
            path,
            crate::engine::support::random_bytes(index as u64, *size as usize),
        )?;
        changed += size;
    }
    create_backup_in(
        client,
        "changed",
        &["solo"],
        json!({"matchLabels": {"claim": "data"}}),
    )
    .await?;
    let changed_backup = final_phase(
        &backups,
        &fixture.kubelet,
        "changed",
        Duration::from_secs(900),
    )
    .await?;
    let changed_snapshot = changed_backup
        .status
        .context("status")?
        .results
        .first()
        .and_then(|result| result.snapshot_id.clone())
        .context("snapshot")?;
    let namespace = format!("solo-r{}", RUNS - 1);
    write_back_earlier_steps()?;
    create::<VolumeRestore>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeRestore",
            "metadata": {"name": "cutover", "namespace": SYSTEM_NAMESPACE},
            "spec": {"source": {"snapshots": [changed_snapshot]},
                "namespaceMap": {"solo": namespace}, "existingClaim": "Sync"}}),
    )
    .await?;
    let (_, log) = completed_restore_agent_log(&fixture, &restores, "cutover", &namespace).await?;
    for line in log
        .lines()
        .filter(|line| line.contains("restored; verifying") || line.contains("verified"))
    {
        println!("cutover agent: {line}");
    }
    let synced = logged_seconds(&log, "restored; verifying").context("restore seconds")?;
    let synced_verified = logged_seconds(&log, "verified").context("verify seconds")?;
    println!(
        "cutover: {} of {} files ({:.1} MiB) changed; agent sync {synced:.2} s, verify \
         {synced_verified:.2} s; against the full restore's median {restored:.2} s + {verified:.2} s: \
         {:.1} % (sync alone {:.1} %)",
        files.len().div_ceil(100),
        files.len(),
        changed as f64 / f64::from(1 << 20),
        100.0 * (synced + synced_verified) / (restored + verified),
        100.0 * synced / restored
    );
    println!(
        "agent {}, cli {}",
        crate::support::kubelet::agent_binary()?.display(),
        cli.display()
    );
    fixture.stop().await;
    Ok(())
}
