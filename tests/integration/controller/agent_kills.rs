//! An agent SIGKILLed again and again during one backup, counted: every
//! kill lands at a random point (while the agent starts and claims the
//! transfer again, or at a random share of the volume while it moves
//! data), the stand-in restarts it as a kubelet would, and each round the
//! restarted agent resumes. At the end the backup is `Completed` (the
//! controller does not take crashes that only slow the agent down for a
//! crash loop), no blob is stored twice in the repository's packs, and the
//! snapshot restores byte-identical.
//!
//! In CI: 6 kills over a 96 MiB sample tree uploaded at 4 MiB/s (the
//! BSL's cap, so that each kill lands mid-way). The full count of
//! docs/benchmarks.md: `HAULAGE_KILL_ROUNDS=30 HAULAGE_KILL_VOLUME_MIB=1024
//! cargo test --test integration controller::agent_kills -- --nocapture`;
//! `HAULAGE_KILL_SEED` repeats a run's kill points (each run prints its
//! seed).

use std::time::{Duration, Instant};

use anyhow::Context;
use haulage::api::{VolumeTransfer, VolumeTransferPhase};
use kube::api::Api;
use serde_json::json;

use crate::engine::support::assert_snapshot_restores_as;
use crate::support::fixture::{Fixture, Layout, create_backup_in, eventually, transfer_of};
use crate::support::number_from_env;

/// A whole number from the environment variable `name`, or `default`.
/// The bytes done and the phase of the claim's transfer.
async fn moved(transfers: &Api<VolumeTransfer>) -> anyhow::Result<(i64, i64, VolumeTransferPhase)> {
    let transfer = transfer_of(transfers, "data").await?;
    let progress = transfer
        .status
        .as_ref()
        .and_then(|status| status.progress.clone())
        .unwrap_or_default();
    Ok((progress.bytes_done, progress.total_bytes, transfer.phase()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_at_random_points_resumes_every_time_and_stores_no_blob_twice()
-> anyhow::Result<()> {
    let rounds = number_from_env("HAULAGE_KILL_ROUNDS", 6);
    let volume_bytes = number_from_env("HAULAGE_KILL_VOLUME_MIB", 96) << 20;
    // The BSL's upload cap makes the backup last long enough for every
    // kill to land mid-way (unthrottled, 96 MiB take 2 s).
    let upload_bytes_per_second = number_from_env("HAULAGE_KILL_UPLOAD_MIB_PER_SECOND", 4) << 20;
    let seed = number_from_env(
        "HAULAGE_KILL_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs(),
    );
    println!(
        "agent kills: {rounds} rounds over {} MiB uploaded at {} MiB/s, seed {seed}",
        volume_bytes >> 20,
        upload_bytes_per_second >> 20
    );
    let mut random = fastrand::Rng::with_seed(seed);
    let layout = Layout::solo(77);
    let fixture = Fixture::builder()
        .layout(layout)
        .volume_bytes(volume_bytes)
        .upload_bytes_per_second(upload_bytes_per_second)
        .start()
        .await?;
    let client = &fixture.client;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), "solo");
    let began = Instant::now();
    create_backup_in(
        client,
        "killed-again-and-again",
        &["solo"],
        json!({"matchLabels": {"claim": "data"}}),
    )
    .await?;
    let total = eventually(Duration::from_secs(120), || async {
        let (done, total, _) = moved(&transfers).await?;
        Ok((done > 0).then_some(total))
    })
    .await
    .with_context(|| {
        format!(
            "the backup never got going:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    let stage_pod = transfer_of(&transfers, "data").await?.spec.stage_pod;

    let (mut while_starting, mut while_moving) = (0, 0);
    let mut killed_at = Vec::new();
    for round in 0..rounds {
        // Every third kill lands while the restarted agent starts, claims
        // the transfer again and reads its volume up to where it had been;
        // the others at a random share of the volume, later each round
        // (at most 90 %, so the kill lands before the snapshot is written).
        if round % 3 == 2 {
            tokio::time::sleep(Duration::from_millis(random.u64(0..1500))).await;
            while_starting += 1;
        } else {
            let share = 0.9 * (round as f64 + random.f64()) / rounds as f64;
            let target = (total as f64 * share) as i64;
            // A final phase ends the wait too, and fails below.
            eventually(Duration::from_secs(300), || async {
                let (done, _, phase) = moved(&transfers).await?;
                Ok((done >= target || phase.is_final()).then_some(()))
            })
            .await
            .with_context(|| {
                format!(
                    "round {round}: the restarted agent never got past {target} bytes:\n{}",
                    fixture.kubelet.all_agent_logs()
                )
            })?;
            while_moving += 1;
        }
        let (done, _, phase) = moved(&transfers).await?;
        assert!(
            !phase.is_final(),
            "round {round}: the transfer ended as {phase:?} before its kill:\n{}",
            fixture.kubelet.all_agent_logs()
        );
        let starts_before = fixture.kubelet.kill_running("solo", &stage_pod);
        killed_at.push(done);
        // The stand-in starts it again, as a kubelet would.
        eventually(Duration::from_secs(60), || async {
            Ok((fixture.kubelet.starts() > starts_before).then_some(()))
        })
        .await
        .with_context(|| format!("round {round}: the killed agent was not restarted"))?;
    }

    let status = fixture
        .completed_backup("killed-again-and-again", Duration::from_secs(900))
        .await?;
    let seconds = began.elapsed().as_secs_f64();
    let transfer = transfer_of(&transfers, "data").await?;
    let final_status = transfer.status.context("transfer status")?;
    assert_eq!(final_status.phase, Some(VolumeTransferPhase::Completed));
    let copies = fixture.stored_blobs().await?;
    let twice: Vec<_> = copies.iter().filter(|(_, count)| **count > 1).collect();
    let packs = fixture
        .repository()
        .await?
        .store()
        .list(haulage::repo::DATA_PREFIX)
        .await?
        .len();
    println!(
        "agent kills: {} kills ({while_starting} while starting, {while_moving} while moving, at {killed_at:?} of {total} bytes done), every round resumed; completed in {seconds:.0} s ({:.1} s a round); {packs} packs, {} blobs, {} stored more than once",
        while_starting + while_moving,
        seconds / (rounds + 1) as f64,
        copies.len(),
        twice.len(),
    );
    assert!(twice.is_empty(), "blobs stored more than once: {twice:?}");
    let snapshot = status.results[0].snapshot_id.clone().context("snapshot")?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &snapshot,
        &fixture.volumes.join("solo").join("data"),
        &fixture.work.path().join("restored"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

/// The checkpoints in the fixture's bucket: (file bytes held, source).
async fn checkpoints_held(fixture: &Fixture) -> anyhow::Result<Vec<(u64, String)>> {
    let repository = fixture.repository().await?;
    let mut held = Vec::new();
    for object in repository
        .store()
        .list(haulage::repo::CHECKPOINT_PREFIX)
        .await?
    {
        let bytes = repository.store().get(&object.key, None).await?;
        let checkpoint = repository.codec().decode_snapshot(&bytes)?;
        held.push((checkpoint.summary.total_bytes, checkpoint.source));
    }
    Ok(held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_after_a_checkpoint_does_not_read_again_what_the_volume_had_stored()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .layout(Layout::solo(78))
        .volume_bytes(96 << 20)
        .upload_bytes_per_second(4 << 20)
        .checkpoint_seconds(1)
        .start()
        .await?;
    let client = &fixture.client;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), "solo");
    create_backup_in(
        client,
        "checkpointed",
        &["solo"],
        json!({"matchLabels": {"claim": "data"}}),
    )
    .await?;
    // Killed once a checkpoint holds a quarter of the volume.
    let covered = eventually(Duration::from_secs(180), || async {
        let (_, total, phase) = moved(&transfers).await?;
        anyhow::ensure!(
            !phase.is_final(),
            "the transfer ended as {phase:?} before its kill"
        );
        let held = checkpoints_held(&fixture).await?;
        Ok(held
            .into_iter()
            .find(|(bytes, _)| total > 0 && *bytes >= total as u64 / 4))
    })
    .await
    .with_context(|| {
        format!(
            "no checkpoint came to hold a quarter of the volume:\n{}",
            fixture.kubelet.all_agent_logs()
        )
    })?;
    assert_eq!(covered.1, "solo/data", "the checkpoint names its claim");
    let stage_pod = transfer_of(&transfers, "data").await?.spec.stage_pod;
    let starts_before = fixture.kubelet.kill_running("solo", &stage_pod);
    eventually(Duration::from_secs(60), || async {
        Ok((fixture.kubelet.starts() > starts_before).then_some(()))
    })
    .await
    .context("the killed agent was not restarted")?;

    let status = fixture
        .completed_backup("checkpointed", Duration::from_secs(600))
        .await?;
    let transfer = transfer_of(&transfers, "data").await?;
    let final_status = transfer.status.context("transfer status")?;
    let total = final_status
        .progress
        .clone()
        .unwrap_or_default()
        .total_bytes as u64;
    let bytes_read = final_status.bytes_read.context("bytes read")? as u64;
    println!(
        "checkpoint held {} of {total} bytes when the agent was killed; the restarted agent read {bytes_read}",
        covered.0
    );
    assert!(
        bytes_read <= total - covered.0,
        "the restarted agent read {bytes_read} of {total} bytes; the checkpoint held {}",
        covered.0
    );
    assert!(
        checkpoints_held(&fixture).await?.is_empty(),
        "checkpoints were left after the snapshot"
    );
    let snapshot = status.results[0].snapshot_id.clone().context("snapshot")?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &snapshot,
        &fixture.volumes.join("solo").join("data"),
        &fixture.work.path().join("restored"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_stopped_by_sigterm_writes_a_last_checkpoint_and_its_restart_reads_only_the_rest()
-> anyhow::Result<()> {
    let fixture = Fixture::builder()
        .layout(Layout::solo(79))
        .volume_bytes(96 << 20)
        .upload_bytes_per_second(4 << 20)
        // No periodic checkpoint comes in this backup's time: only the one
        // the agent writes when stopped.
        .checkpoint_seconds(3600)
        .start()
        .await?;
    let client = &fixture.client;
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), "solo");
    create_backup_in(
        client,
        "drained",
        &["solo"],
        json!({"matchLabels": {"claim": "data"}}),
    )
    .await?;
    // Stopped as a node drain stops it, once a third of the volume is read.
    let done = eventually(Duration::from_secs(180), || async {
        let (done, total, phase) = moved(&transfers).await?;
        anyhow::ensure!(
            !phase.is_final(),
            "the transfer ended as {phase:?} before its stop"
        );
        Ok((total > 0 && done >= total / 3).then_some(done))
    })
    .await
    .context("the backup did not get a third of the way")?;
    let stage_pod = transfer_of(&transfers, "data").await?.spec.stage_pod;
    let starts_before = fixture.kubelet.starts();
    let took = fixture
        .kubelet
        .terminate_running("solo", &stage_pod, Duration::from_secs(60))
        .await?
        .with_context(|| {
            format!(
                "the agent was still running 60 s after SIGTERM:\n{}",
                fixture.kubelet.all_agent_logs()
            )
        })?;
    let held = checkpoints_held(&fixture).await?;
    let covered = held.first().map_or(0, |(bytes, _)| *bytes);
    println!(
        "SIGTERM after {done} bytes read: the agent exited {:.2} s later; its last checkpoint holds {covered} bytes",
        took.as_secs_f64()
    );
    assert_eq!(
        held.len(),
        1,
        "the stopped agent wrote no last checkpoint:\n{}",
        fixture.kubelet.all_agent_logs()
    );
    // What was read then, less the part of a chunk not cut yet (at most
    // the largest chunk, 4 MiB) and the reads after the last progress
    // report (which lag the reads).
    assert!(
        covered + (4 << 20) >= done as u64,
        "the last checkpoint holds {covered} bytes of the {done} read before SIGTERM"
    );
    eventually(Duration::from_secs(60), || async {
        Ok((fixture.kubelet.starts() > starts_before).then_some(()))
    })
    .await
    .context("the stopped agent was not restarted")?;

    let status = fixture
        .completed_backup("drained", Duration::from_secs(600))
        .await?;
    let transfer = transfer_of(&transfers, "data").await?;
    let final_status = transfer.status.context("transfer status")?;
    let total = final_status
        .progress
        .clone()
        .unwrap_or_default()
        .total_bytes as u64;
    let bytes_read = final_status.bytes_read.context("bytes read")? as u64;
    println!("the restarted agent read {bytes_read} of {total} bytes");
    assert!(
        bytes_read <= total - covered,
        "the restarted agent read {bytes_read} of {total} bytes; the last checkpoint held {covered}"
    );
    let snapshot = status.results[0].snapshot_id.clone().context("snapshot")?;
    assert_snapshot_restores_as(
        &fixture.repository().await?,
        &snapshot,
        &fixture.volumes.join("solo").join("data"),
        &fixture.work.path().join("restored"),
    )
    .await?;
    fixture.stop().await;
    Ok(())
}
