//! More volumes moved at once by one process than the blocking pool has
//! threads, as a mover agent with a large memory budget moves them: every
//! backup and restore finishes, each with its own data.

use std::path::PathBuf;
use std::time::Duration;

use haulage::engine::backup::BackupOptions;
use haulage::engine::memory::EngineMemory;
use haulage::engine::restore::RestoreOptions;
use haulage::repo::ObjectId;

use super::support::{TestRepo, assert_same_tree, random_bytes};

/// Volumes at once: more than [`haulage::engine::MAX_BLOCKING_THREADS`],
/// as an agent given 1Gi moves ten claims of its stage pod
/// (`AgentMemory::volumes_at_once` is 42 there).
const VOLUMES: u64 = 10;

/// Not a measure of speed: a backup or restore that waits for a thread
/// that never comes waits forever, and this says so instead of hanging CI.
const STALLED_AFTER: Duration = Duration::from_secs(300);

/// Run `test` on the runtime of the mover agent and the CLI (the engine's
/// blocking threads), with two workers, as a two-core node gives it. A
/// stall (`Err`) fails the test without waiting for the stalled threads:
/// dropping the runtime would wait for its blocking threads for ever.
fn on_agent_runtime(test: impl std::future::Future<Output = Result<(), String>>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .max_blocking_threads(haulage::engine::MAX_BLOCKING_THREADS)
        .build()
        .unwrap();
    if let Err(stalled) = runtime.block_on(test) {
        runtime.shutdown_background();
        panic!("{stalled}");
    }
}

/// A volume's data: a file larger than an engine's chunk budget in the
/// smallest share, so its walker waits for its chunks to be hashed, and a
/// directory of small files.
fn write_volume(root: &std::path::Path, volume: u64) -> PathBuf {
    let source = root.join(format!("source-{volume}"));
    std::fs::create_dir_all(source.join("small")).unwrap();
    std::fs::write(source.join("large"), random_bytes(volume, 24 << 20)).unwrap();
    for file in 0..300 {
        std::fs::write(
            source.join("small").join(format!("f{file}")),
            random_bytes(volume * 1000 + file, 3000),
        )
        .unwrap();
    }
    source
}

/// Back up each source at once into `repo`, each engine in the smallest
/// share.
async fn back_up_at_once(repo: &TestRepo, sources: &[PathBuf]) -> Result<Vec<ObjectId>, String> {
    let backups = sources.iter().map(|source| {
        let mut options = BackupOptions::new(source);
        options.memory = EngineMemory::new(0);
        repo.backup_with_options(options)
    });
    let outcomes = tokio::time::timeout(STALLED_AFTER, futures::future::join_all(backups))
        .await
        .map_err(|_| "the backups stalled: each waits for work no thread runs")?;
    Ok(outcomes
        .into_iter()
        .map(|outcome| outcome.snapshot_id)
        .collect())
}

#[test]
fn more_backups_at_once_than_blocking_threads_all_finish() {
    on_agent_runtime(async {
        let repo = TestRepo::new().await;
        let sources: Vec<_> = (0..VOLUMES)
            .map(|volume| write_volume(repo.dir.path(), volume))
            .collect();
        let snapshots = back_up_at_once(&repo, &sources).await?;
        // Each snapshot holds its own source, restored one at a time.
        for (volume, snapshot) in snapshots.iter().enumerate() {
            let target = repo.dir.path().join(format!("target-{volume}"));
            repo.restore(snapshot, &target).await;
            assert_same_tree(&sources[volume], &target);
        }
        Ok(())
    });
}

#[test]
fn more_restores_at_once_than_blocking_threads_all_finish() {
    on_agent_runtime(async {
        let repo = TestRepo::new().await;
        let mut sources = Vec::new();
        let mut snapshots = Vec::new();
        for volume in 0..VOLUMES {
            let source = write_volume(repo.dir.path(), volume);
            snapshots.push(repo.backup(&source).await.snapshot_id);
            sources.push(source);
        }
        let restores = snapshots.iter().enumerate().map(|(volume, snapshot)| {
            let mut options = RestoreOptions::new(repo.dir.path().join(format!("target-{volume}")));
            options.memory = EngineMemory::new(0);
            repo.restore_with(snapshot, options)
        });
        let outcomes = tokio::time::timeout(STALLED_AFTER, futures::future::join_all(restores))
            .await
            .map_err(|_| "the restores stalled: each waits for work no thread runs")?;
        for (volume, outcome) in outcomes.iter().enumerate() {
            assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
            assert_same_tree(
                &sources[volume],
                &repo.dir.path().join(format!("target-{volume}")),
            );
        }
        Ok(())
    });
}
