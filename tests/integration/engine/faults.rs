//! Interrupted backups, unreadable files and refused repositories, through
//! the `haulage` binary as a user runs it.

use std::collections::HashSet;
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
    let mut first = haulage()
        .args([
            "backup",
            "--no-progress",
            "--limit-read",
            "40MiB",
            "--repo",
            &repo.url(),
        ])
        .arg(&source)
        .spawn()
        .unwrap();
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

    let output = haulage()
        .args(["backup", "--json", "--repo", &repo.url()])
        .arg(&source)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let bytes_new = summary["bytesNew"].as_u64().unwrap();
    assert!(
        bytes_new < 192 << 20,
        "the second run stored everything again ({bytes_new} bytes)"
    );
    let (total, unique) = blobs_in_packs(&repo);
    assert_eq!(total, unique.len(), "a blob was stored twice");

    repo.assert_cli_verifies();
    let target = repo.dir.path().join("restored");
    let id = summary["snapshotId"].as_str().unwrap();
    assert!(
        haulage()
            .args(["restore", id, "--no-progress", "--repo", &repo.url()])
            .arg(&target)
            .status()
            .unwrap()
            .success()
    );
    assert_same_tree(&source, &target);
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
