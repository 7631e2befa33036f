//! Interrupted backups, unreadable files and refused repositories, through
//! the `haulage` binary as a user runs it.

use std::collections::HashSet;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use super::support::{TestRepo, assert_same_tree, files_under, haulage, random_bytes};

/// Every blob id in every pack, counting duplicates.
fn blobs_in_packs(repo: &TestRepo) -> (usize, HashSet<haulage::repo::BlobId>) {
    let mut total = 0;
    let mut unique = HashSet::new();
    for (path, _) in files_under(&repo.root().join("data")) {
        let bytes = std::fs::read(&path).unwrap();
        for entry in repo.repository.codec().decode_pack(&bytes, "test").unwrap() {
            total += 1;
            unique.insert(entry.id);
        }
    }
    (total, unique)
}

/// `haulage backup SOURCE` slowed to 40 MiB/s so it can be killed mid-way,
/// with `extra` arguments; running.
fn slow_backup(repo: &TestRepo, source: &Path, extra: &[&str]) -> Child {
    haulage()
        .args(["backup", "--no-progress", "--limit-read", "40MiB"])
        .args(extra)
        .args(["--repo", &repo.url()])
        .arg(source)
        .spawn()
        .unwrap()
}

/// Wait (up to 2 minutes, while `first` runs) for a checkpoint of which
/// `held` says how many bytes it holds, if enough; those bytes.
fn checkpoint_holding(
    repo: &TestRepo,
    first: &mut Child,
    held: impl Fn(&haulage::repo::snapshot::Snapshot) -> Option<u64>,
) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        assert!(Instant::now() < deadline, "no checkpoint appeared");
        assert!(
            first.try_wait().unwrap().is_none(),
            "backup finished before it could be killed"
        );
        let found = files_under(&repo.root().join("checkpoints"))
            .iter()
            .find_map(|(path, _)| {
                let bytes = std::fs::read(path).ok()?;
                held(&repo.repository.codec().decode_snapshot(&bytes).ok()?)
            });
        if let Some(bytes) = found {
            return bytes;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `haulage backup SOURCE --json`, which must succeed: its summary.
fn backup_summary(repo: &TestRepo, source: &Path) -> serde_json::Value {
    let output = haulage()
        .args(["backup", "--json", "--repo", &repo.url()])
        .arg(source)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The repository verifies, and the snapshot of `summary` restores through
/// the CLI as `source` is.
fn assert_verifies_and_restores_as(repo: &TestRepo, summary: &serde_json::Value, source: &Path) {
    repo.assert_cli_verifies();
    let id = summary["snapshotId"].as_str().unwrap();
    let target = repo.dir.path().join(format!("restored-{id}"));
    assert!(
        haulage()
            .args(["restore", id, "--no-progress", "--repo", &repo.url()])
            .arg(&target)
            .status()
            .unwrap()
            .success()
    );
    assert_same_tree(source, &target);
}

#[test]
fn a_backup_killed_mid_way_is_completed_by_the_next_run_without_sending_stored_packs_again() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    for i in 0..12 {
        std::fs::write(
            source.join(format!("part{i:02}.bin")),
            random_bytes(100 + i, 16 << 20),
        )
        .unwrap();
    }
    // Slow the first run down so it can be killed between packs.
    let mut first = slow_backup(&repo, &source, &[]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while repo.pack_count() < 3 {
        assert!(Instant::now() < deadline, "no packs appeared");
        assert!(
            first.try_wait().unwrap().is_none(),
            "backup finished before it could be killed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    assert!(files_under(&repo.root().join("snapshots")).is_empty());
    let (stored_before, _) = blobs_in_packs(&repo);
    assert!(stored_before > 0);

    let summary = backup_summary(&repo, &source);
    let bytes_new = summary["bytesNew"].as_u64().unwrap();
    assert!(
        bytes_new < 192 << 20,
        "the second run stored everything again ({bytes_new} bytes)"
    );
    let (total, unique) = blobs_in_packs(&repo);
    assert_eq!(total, unique.len(), "a blob was stored twice");

    assert_verifies_and_restores_as(&repo, &summary, &source);
}

#[test]
fn a_backup_killed_after_a_checkpoint_is_continued_without_reading_again_what_it_had_stored() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = repo.dir.path().join("source");
    // Three directories, so the checkpoint holds trees of open directories
    // below the root.
    for (d, directory) in ["a", "b", "c"].iter().enumerate() {
        std::fs::create_dir_all(source.join(directory).join("deeper")).unwrap();
        for i in 0..16u64 {
            let seed = 1_000 + d as u64 * 100 + i;
            let place = if i % 4 == 3 { "deeper/" } else { "" };
            std::fs::write(
                source.join(format!("{directory}/{place}{i:02}.bin")),
                random_bytes(seed, 4 << 20),
            )
            .unwrap();
        }
    }
    let total: u64 = files_under(&source).iter().map(|(_, size)| size).sum();
    // Slow the first run down so it writes checkpoints and is killed
    // before it ends.
    let mut first = slow_backup(&repo, &source, &["--checkpoint-seconds", "1"]);
    let covered = checkpoint_holding(&repo, &mut first, |checkpoint| {
        (checkpoint.summary.files >= 8).then_some(checkpoint.summary.total_bytes)
    });
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    assert!(files_under(&repo.root().join("snapshots")).is_empty());
    // A file the checkpoint holds changes before the next run: it must be
    // read again, not taken from the checkpoint.
    std::fs::write(source.join("a/00.bin"), random_bytes(7, 4 << 20)).unwrap();

    let summary = backup_summary(&repo, &source);
    assert!(
        summary["resumedFrom"]["checkpoint"].is_string(),
        "the second run did not continue from the checkpoint: {summary}"
    );
    let bytes_read = summary["bytesRead"].as_u64().unwrap();
    assert!(
        bytes_read <= total - covered + (4 << 20),
        "the second run read {bytes_read} of {total} bytes; the checkpoint held {covered}"
    );
    // (Counted through the repository: a kill mid-write may have left a
    // temporary file, which `haulage repo sweep` removes.)
    let left = runtime.block_on(repo.repository.all_checkpoints()).unwrap();
    assert!(
        left.is_empty(),
        "checkpoints were left after the snapshot: {:?}",
        left.iter()
            .map(|checkpoint| &checkpoint.key)
            .collect::<Vec<_>>()
    );
    let (stored, unique) = blobs_in_packs(&repo);
    assert_eq!(stored, unique.len(), "a blob was stored twice");

    assert_verifies_and_restores_as(&repo, &summary, &source);
}

#[test]
fn a_large_file_half_read_when_the_backup_was_killed_is_read_on_from_its_checkpoint() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(source.join("db")).unwrap();
    // One file holds the volume, as a database's does; a hole in it, so
    // the part is found across data and holes.
    let mut data = random_bytes(42, 160 << 20);
    data[(40 << 20)..(48 << 20)].fill(0);
    std::fs::write(source.join("db/table.dat"), &data).unwrap();
    let total = data.len() as u64;
    let mut first = slow_backup(&repo, &source, &["--checkpoint-seconds", "1"]);
    let covered = checkpoint_holding(&repo, &mut first, |checkpoint| {
        let bytes = checkpoint.summary.total_bytes;
        (bytes >= 56 << 20).then_some(bytes)
    });
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    assert!(covered < total, "the checkpoint holds the whole file");

    let summary = backup_summary(&repo, &source);
    let bytes_read = summary["bytesRead"].as_u64().unwrap();
    assert!(
        bytes_read <= total - covered,
        "the second run read {bytes_read} of {total} bytes; the checkpoint held {covered}"
    );
    assert_eq!(summary["totalBytes"].as_u64(), Some(total), "{summary}");
    let (stored, unique) = blobs_in_packs(&repo);
    assert_eq!(stored, unique.len(), "a blob was stored twice");

    assert_verifies_and_restores_as(&repo, &summary, &source);
}

#[test]
fn a_backup_stopped_by_sigterm_stores_what_it_read_and_the_next_run_goes_on_from_there() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(source.join("a")).unwrap();
    std::fs::create_dir_all(source.join("z")).unwrap();
    for i in 0..8u64 {
        std::fs::write(
            source.join(format!("a/{i:02}.bin")),
            random_bytes(3_000 + i, 4 << 20),
        )
        .unwrap();
    }
    // A large file the stop comes in the middle of.
    std::fs::write(source.join("z/table.dat"), random_bytes(3_100, 128 << 20)).unwrap();
    let total: u64 = files_under(&source).iter().map(|(_, size)| size).sum();
    // No periodic checkpoint comes in this backup's time: only the one it
    // writes when stopped.
    let mut first = slow_backup(&repo, &source, &["--checkpoint-seconds", "3600"]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while repo.pack_bytes() < 48 << 20 {
        assert!(Instant::now() < deadline, "the backup stored too little");
        assert!(
            first.try_wait().unwrap().is_none(),
            "backup finished before it could be stopped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = std::process::Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let status = first.wait().unwrap();
    assert_eq!(status.code(), Some(130), "a stopped backup exits 130");
    assert!(files_under(&repo.root().join("snapshots")).is_empty());
    let checkpoints: Vec<_> = files_under(&repo.root().join("checkpoints"))
        .iter()
        .filter_map(|(path, _)| {
            let bytes = std::fs::read(path).ok()?;
            repo.repository.codec().decode_snapshot(&bytes).ok()
        })
        .collect();
    assert_eq!(checkpoints.len(), 1, "no last checkpoint was written");
    // At least what was in packs when the signal came, so into the file.
    let held = checkpoints[0].summary.total_bytes;
    assert!(
        held >= 44 << 20,
        "the last checkpoint holds only {held} bytes"
    );

    let summary = backup_summary(&repo, &source);
    assert!(
        summary["resumedFrom"]["checkpoint"].is_string(),
        "the next run did not go on from the last checkpoint: {summary}"
    );
    let bytes_read = summary["bytesRead"].as_u64().unwrap();
    assert!(
        bytes_read <= total - held,
        "the next run read {bytes_read} of {total} bytes; the last checkpoint held {held}"
    );
    let (stored, unique) = blobs_in_packs(&repo);
    assert_eq!(stored, unique.len(), "a blob was stored twice");
    assert_verifies_and_restores_as(&repo, &summary, &source);
}

/// `haulage prune --json --safety-margin 0s EXTRA`, which must succeed:
/// its report.
fn prune_now(repo: &TestRepo, extra: &[&str]) -> serde_json::Value {
    let output = haulage()
        .args(["prune", "--json", "--safety-margin", "0s"])
        .args(extra)
        .args(["--repo", &repo.url()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn prune_keeps_a_young_checkpoint_with_its_data_and_deletes_one_older_than_its_maximum_age() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    // Two sources, each killed after a checkpoint.
    let mut sources = Vec::new();
    let mut held = Vec::new();
    for (s, name) in ["kept", "expired"].iter().enumerate() {
        let source = repo.dir.path().join(name);
        std::fs::create_dir_all(&source).unwrap();
        for i in 0..16u64 {
            std::fs::write(
                source.join(format!("{i:02}.bin")),
                random_bytes(2_000 + s as u64 * 100 + i, 4 << 20),
            )
            .unwrap();
        }
        let mut first = slow_backup(&repo, &source, &["--checkpoint-seconds", "1"]);
        held.push(checkpoint_holding(&repo, &mut first, |checkpoint| {
            (checkpoint.source.ends_with(name) && checkpoint.summary.files >= 8)
                .then_some(checkpoint.summary.total_bytes)
        }));
        first.kill().unwrap(); // SIGKILL
        first.wait().unwrap();
        sources.push(source);
    }
    // A kill between writing a checkpoint and deleting the one it replaces
    // leaves both: one or two per source.
    // (A kill mid-write may leave a temporary file too: counted through
    // the repository, which passes over those.)
    let stored = runtime
        .block_on(repo.repository.all_checkpoints())
        .expect("list checkpoints");
    let per_source = |name: &str| {
        stored
            .iter()
            .filter(|checkpoint| {
                checkpoint
                    .manifest
                    .as_ref()
                    .expect("read checkpoint")
                    .source
                    .ends_with(name)
            })
            .count()
    };
    let (kept_source, expired_source) = (per_source("kept"), per_source("expired"));
    assert!(
        (1..=2).contains(&kept_source) && (1..=2).contains(&expired_source),
        "{kept_source} and {expired_source} checkpoints"
    );
    let written = kept_source + expired_source;

    // Deleting what no snapshot names at once, a prune keeps every
    // checkpoint (a day old at most) and the data they name (only the
    // trees of the checkpoints each backup replaced go).
    let report = prune_now(&repo, &["--keep-checkpoints-within", "1d"]);
    assert_eq!(report["checkpointsKept"], written, "{report}");
    assert_eq!(report["checkpointsDeleted"], 0, "{report}");
    let after = runtime.block_on(repo.repository.all_checkpoints()).unwrap();
    assert_eq!(after.len(), written);
    assert!(
        repo.pack_bytes() >= held[0] + held[1],
        "prune deleted data a checkpoint names ({} bytes left; the checkpoints held {} of random content): {report}",
        repo.pack_bytes(),
        held[0] + held[1]
    );

    // The first source's backup continues from its checkpoint.
    let total: u64 = files_under(&sources[0]).iter().map(|(_, size)| size).sum();
    let summary = backup_summary(&repo, &sources[0]);
    assert!(
        summary["resumedFrom"]["checkpoint"].is_string(),
        "the backup did not continue from the checkpoint prune kept: {summary}"
    );
    let bytes_read = summary["bytesRead"].as_u64().unwrap();
    assert!(
        bytes_read <= total - held[0],
        "the backup read {bytes_read} of {total} bytes; the checkpoint held {}",
        held[0]
    );
    assert_verifies_and_restores_as(&repo, &summary, &sources[0]);

    // A prune that keeps checkpoints for no time deletes the other one, and
    // the packs only it named.
    let stored_before = repo.pack_bytes();
    let report = prune_now(&repo, &["--keep-checkpoints-within", "0s"]);
    assert_eq!(report["checkpointsKept"], 0, "{report}");
    // The first source's went with its snapshot.
    assert_eq!(report["checkpointsDeleted"], expired_source, "{report}");
    assert!(
        runtime
            .block_on(repo.repository.all_checkpoints())
            .unwrap()
            .is_empty()
    );
    let reclaimed = report["deletedBytes"].as_u64().unwrap();
    assert!(
        reclaimed >= held[1] / 2 && repo.pack_bytes() < stored_before,
        "the expired checkpoint's data was not reclaimed ({reclaimed} bytes; it held {} of random content): {report}",
        held[1]
    );
    // Its source is then backed up whole, and both snapshots restore.
    let summary = backup_summary(&repo, &sources[1]);
    assert!(summary["resumedFrom"].is_null(), "{summary}");
    assert_verifies_and_restores_as(&repo, &summary, &sources[1]);
}

#[test]
fn unreadable_files_become_warnings_and_the_backup_completes_with_exit_code_3() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("readable"), b"ok").unwrap();
    std::fs::write(source.join("secret"), b"no").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        source.join("secret"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    // Run as an unprivileged user so permissions apply (tests may run as root).
    for path in [repo.dir.path().to_path_buf(), source.clone()] {
        std::process::Command::new("chmod")
            .args(["-R", "a+rwX"])
            .arg(&path)
            .status()
            .unwrap();
    }
    std::fs::set_permissions(
        source.join("secret"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    let mut command = haulage();
    let as_nobody = rustix::process::geteuid().is_root();
    let mut command = if as_nobody {
        let mut wrapped = std::process::Command::new("setpriv");
        wrapped.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            env!("CARGO_BIN_EXE_haulage"),
        ]);
        wrapped.env("HAULAGE_PASSWORD", super::support::TEST_PASSWORD);
        wrapped
    } else {
        std::mem::replace(&mut command, haulage())
    };
    let output = command
        .args(["backup", "--json", "--repo", &repo.url()])
        .arg(&source)
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(summary["status"], "completed with warnings");
    assert_eq!(summary["files"], 1);
    let warning = &summary["warnings"][0];
    assert_eq!(warning["path"], "secret");
    assert!(
        warning["message"]
            .as_str()
            .unwrap()
            .contains("Permission denied"),
        "{warning}"
    );
}

#[test]
fn a_repository_of_a_newer_format_is_refused_and_left_untouched() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let config_path = repo.root().join("config");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    let newer = haulage::repo::config::FORMAT_VERSION + 1;
    config["formatVersion"] = newer.into();
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let before = files_under(&repo.root());
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("f"), b"f").unwrap();
    let output = haulage()
        .args(["backup", "--repo", &repo.url()])
        .arg(&source)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(
        message.contains(&format!("format version {newer}")) && message.contains("upgrade haulage"),
        "{message}"
    );
    assert_eq!(files_under(&repo.root()), before, "something was written");
}

#[test]
fn init_refuses_an_existing_repository_and_commands_explain_a_missing_one() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let again = haulage()
        .args(["repo", "init", "--repo", &repo.url()])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let missing = format!("file://{}/nothing-here", repo.dir.path().display());
    let output = haulage()
        .args(["snapshots", "--repo", &missing])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("haulage repo init"));
}
