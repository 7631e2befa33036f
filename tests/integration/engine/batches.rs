//! A restore keeps at most `descriptors::MAX_BATCHES_ALIVE` batches alive,
//! each holding its directories open: a target slower than the reads
//! would otherwise let the batches whose blobs wait to be written add up,
//! and with them the open descriptors.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use haulage::engine::descriptors::{FREE_BATCH_DIRECTORIES, MAX_BATCHES_ALIVE};

use super::support::{TEST_PASSWORD, TestRepo, assert_same_tree, random_bytes};

/// An ext4 image mounted with every write synchronous: a real target much
/// slower than a restore reads a local repository. Unmounted when dropped.
struct SlowTarget {
    mount_point: PathBuf,
    _dir: tempfile::TempDir,
}

impl SlowTarget {
    fn mount() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("image");
        fs::File::create(&image)
            .and_then(|file| file.set_len(1 << 30))
            .expect("image file");
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        let mount_point = dir.path().join("mnt");
        fs::create_dir(&mount_point).expect("mount point");
        run(Command::new("mount")
            .args(["-o", "loop,sync,dirsync"])
            .arg(&image)
            .arg(&mount_point));
        SlowTarget {
            mount_point,
            _dir: dir,
        }
    }
}

impl Drop for SlowTarget {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount_point).status();
    }
}

fn run(command: &mut Command) {
    let status = command.status().expect("start the command");
    assert!(
        status.success(),
        "{command:?}: {status} (the test runs as root)"
    );
}

/// Directories under `target` that process `pid` holds open now.
fn directories_open_under(pid: u32, target: &Path) -> usize {
    let Ok(entries) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    entries
        .filter_map(|entry| fs::read_link(entry.ok()?.path()).ok())
        .filter(|path| path.starts_with(target) && path.is_dir())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_into_a_slow_target_keeps_its_batches_directories_within_the_bound() {
    // 2,000 directories with a file each: a batch takes at most 80 of
    // them under a limit of 1,024 descriptors, so they come in 25 batches,
    // each about one scatter job of blobs.
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    for n in 0..2_000u64 {
        let directory = source.join(format!("d{:02}/e{n:04}", n / 100));
        fs::create_dir_all(&directory).expect("directory");
        fs::write(directory.join("f"), random_bytes(n, 16 * 1024)).expect("file");
    }
    let snapshot = repo.backup(&source).await.snapshot_id;

    let slow = SlowTarget::mount();
    let target = slow.mount_point.join("restored");
    // The soft and hard limits both 1,024, as a restore meets them in a
    // container that does not raise them.
    let mut restore = Command::new("prlimit")
        .arg("--nofile=1024:1024")
        .arg(env!("CARGO_BIN_EXE_haulage"))
        .args([
            "restore",
            &snapshot.to_hex(),
            "--no-progress",
            "--repo",
            &repo.url(),
        ])
        .arg(&target)
        .env_remove("HAULAGE_REPO")
        .env_remove("HAULAGE_PASSWORD_FILE")
        .env("HAULAGE_PASSWORD", TEST_PASSWORD)
        .stdout(Stdio::null())
        .spawn()
        .expect("start haulage restore");
    let mut most_open = 0;
    let status = loop {
        if let Some(status) = restore.try_wait().expect("wait for haulage restore") {
            break status;
        }
        most_open = most_open.max(directories_open_under(restore.id(), &target));
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(status.success(), "haulage restore: {status}");
    assert_same_tree(&source, &target);

    // The batches' directories, and those the walk is inside, which no
    // batch counts: the target and a `dNN`, and one `eNNNN` being opened.
    let walk_depth = 3;
    let bound = MAX_BATCHES_ALIVE * FREE_BATCH_DIRECTORIES + walk_depth;
    println!("most directories open at once: {most_open} (bound {bound})");
    assert!(
        most_open > 2 * FREE_BATCH_DIRECTORIES,
        "several batches were seen alive ({most_open} directories open at most)"
    );
    assert!(
        most_open <= bound,
        "{most_open} directories open at once, more than {MAX_BATCHES_ALIVE} batches of {FREE_BATCH_DIRECTORIES} and the walk's {walk_depth}"
    );
}
