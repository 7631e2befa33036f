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

/// Restore each snapshot at once from `repo` into `target-N`, each engine
/// in the smallest share.
async fn restore_at_once(
    repo: &TestRepo,
    snapshots: &[ObjectId],
) -> Result<Vec<haulage::engine::restore::RestoreOutcome>, String> {
    let restores = snapshots.iter().enumerate().map(|(volume, snapshot)| {
        let mut options = RestoreOptions::new(repo.dir.path().join(format!("target-{volume}")));
        options.memory = EngineMemory::new(0);
        repo.restore_with(snapshot, options)
    });
    tokio::time::timeout(STALLED_AFTER, futures::future::join_all(restores))
        .await
        .map_err(|_| "the restores stalled: each waits for work no thread runs".to_string())
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
        let outcomes = restore_at_once(&repo, &snapshots).await?;
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

/// Volumes moved at once under [`HARD_LIMIT_OF_OPEN_FILES`].
const VOLUMES_UNDER_A_HARD_LIMIT: u64 = 8;
/// The limit of open files, soft and hard, of the process that moves
/// [`VOLUMES_UNDER_A_HARD_LIMIT`] volumes at once: a container whose hard
/// limit is 1,024, which the binaries cannot raise.
const HARD_LIMIT_OF_OPEN_FILES: u64 = 1_024;
/// What a backup says when an open found no descriptor free.
const WAITED_FOR_A_DESCRIPTOR: &str = "waiting for a file descriptor to come free";
/// Set by [`volumes_moved_at_once_share_a_hard_limit_of_1024_open_files`]
/// for its child: the child lowers its process's limit for good, so it
/// refuses to run where other tests run (`cargo test -- --ignored`).
const IN_A_CHILD_UNDER_A_LIMIT: &str = "HAULAGE_TEST_CHILD_UNDER_A_LIMIT";

/// Eight backups, then eight restores, at once in one process whose limit
/// of open files is 1,024 soft and hard, of volumes of 600 directories of
/// two small files: the engines share the limit
/// (`descriptors::backup_open_files`, `descriptors::restore_share`), no
/// backup waits for a descriptor, and every restore restores every file.
/// With a fixed share each whatever ran beside (128 open source files a
/// backup; 80 directories a batch and 256 open files a restore), the
/// backups waited for descriptors and the restores failed files ("its data
/// could not be read: ... Too many open files").
///
/// The limit is lowered in a child process of this test binary, which runs
/// [`engine_volumes_at_once_under_a_hard_limit_of_1024_open_files`] alone:
/// the limit of the test process is every test's.
#[test]
fn volumes_moved_at_once_share_a_hard_limit_of_1024_open_files() {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "engine::many_at_once::engine_volumes_at_once_under_a_hard_limit_of_1024_open_files",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IN_A_CHILD_UNDER_A_LIMIT, "1")
        // The wait's warning must be logged for its absence to mean anything.
        .env("HAULAGE_TEST_LOG", "warn")
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{log}");
    assert!(log.contains("1 passed"), "the child ran no test:\n{log}");
    assert!(!log.contains(WAITED_FOR_A_DESCRIPTOR), "{log}");
}

/// The child's part of [`volumes_moved_at_once_share_a_hard_limit_of_1024_open_files`]:
/// lowers this process's limit of open files, so it runs only there.
#[test]
#[ignore = "run in a child process by volumes_moved_at_once_share_a_hard_limit_of_1024_open_files"]
fn engine_volumes_at_once_under_a_hard_limit_of_1024_open_files() {
    use rustix::process::{Resource, Rlimit, setrlimit};
    assert!(
        std::env::var_os(IN_A_CHILD_UNDER_A_LIMIT).is_some(),
        "this lowers the process's limit of open files for every test in it: \
         run volumes_moved_at_once_share_a_hard_limit_of_1024_open_files, which runs it alone"
    );
    crate::support::logs::capture();
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(HARD_LIMIT_OF_OPEN_FILES),
            maximum: Some(HARD_LIMIT_OF_OPEN_FILES),
        },
    )
    .expect("lower the limit of open files");
    on_agent_runtime(async {
        let repo = TestRepo::new().await;
        let sources: Vec<_> = (0..VOLUMES_UNDER_A_HARD_LIMIT)
            .map(|volume| {
                let source = repo.dir.path().join(format!("source-{volume}"));
                for directory in 0..600 {
                    let directory = source.join(format!("d{directory:03}"));
                    std::fs::create_dir_all(&directory).unwrap();
                    for file in 0..2 {
                        std::fs::write(
                            directory.join(format!("f{file}")),
                            format!("volume {volume}, {directory:?}, file {file}"),
                        )
                        .unwrap();
                    }
                }
                source
            })
            .collect();
        let snapshots = back_up_at_once(&repo, &sources).await?;
        let outcomes = restore_at_once(&repo, &snapshots).await?;
        for (volume, outcome) in outcomes.iter().enumerate() {
            assert!(
                outcome.problems.is_empty(),
                "volume {volume}: {} problems, the first {:?}",
                outcome.problems.len(),
                outcome.problems.first()
            );
            assert_same_tree(
                &sources[volume],
                &repo.dir.path().join(format!("target-{volume}")),
            );
        }
        Ok(())
    });
}
