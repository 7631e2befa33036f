//! Tree verification against real directories: a restored tree verifies
//! against its snapshot's root tree, and each kind of difference made to
//! it afterwards (names, kinds, modes, owners, times, content of the same
//! size, holes, symlink targets, hard links, extended attributes) is
//! found and named, without following a symlink; the report is bounded.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use haulage::engine::restore::RestoreOptions;
use haulage::engine::verify_tree::{TreeVerification, TreeVerifyOptions, verify_tree};
use haulage::repo::ObjectId;
use rustix::fs::{AtFlags, Timestamps};
use tokio_util::sync::CancellationToken;

use super::support::{TestRepo, make_fifo, random_bytes, set_xattr, write_sparse_file};

/// A repository with a snapshot of a tree holding every kind of entry
/// the verification compares, and that tree restored.
struct Restored {
    repo: TestRepo,
    snapshot: ObjectId,
    target: PathBuf,
}

async fn restored_tree() -> Restored {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(source.join("dir/sub")).unwrap();
    std::fs::write(source.join("dir/sub/data.bin"), random_bytes(1, 3 << 20)).unwrap();
    std::fs::write(source.join("dir/small.txt"), b"small file").unwrap();
    std::fs::write(source.join("linked"), b"one inode, two names").unwrap();
    std::fs::hard_link(source.join("linked"), source.join("dir/also-linked")).unwrap();
    std::fs::write(source.join("twin-a"), b"same bytes").unwrap();
    std::fs::write(source.join("twin-b"), b"same bytes").unwrap();
    for twin in ["twin-a", "twin-b"] {
        set_mtime(&source.join(twin), 1_600_000_000, 500);
    }
    std::os::unix::fs::symlink("dir/small.txt", source.join("pointer")).unwrap();
    make_fifo(&source.join("pipe"), 0o640).unwrap();
    // 64 MiB with 4 KiB of data in the middle.
    let sparse_data = random_bytes(2, 4096);
    write_sparse_file(&source.join("sparse.img"), 64 << 20, &sparse_data, 32 << 20).unwrap();
    set_xattr(&source.join("dir/small.txt"), "user.comment", b"kept").unwrap();
    std::os::unix::fs::chown(source.join("dir/small.txt"), Some(1000), Some(1000)).unwrap();
    std::fs::set_permissions(
        source.join("dir/sub"),
        std::os::unix::fs::PermissionsExt::from_mode(0o2750),
    )
    .unwrap();
    let outcome = repo.backup(&source).await;
    let target = repo.dir.path().join("restored");
    let restored = repo.restore(&outcome.snapshot_id, &target).await;
    assert!(restored.problems.is_empty(), "{:?}", restored.problems);
    Restored {
        repo,
        snapshot: outcome.snapshot_id,
        target,
    }
}

fn options() -> TreeVerifyOptions {
    TreeVerifyOptions::for_restore(&RestoreOptions::new("/unused"))
}

impl Restored {
    async fn verify_with(&self, options: &TreeVerifyOptions) -> TreeVerification {
        verify_tree(
            &self.repo.repository,
            &self.snapshot,
            &self.target,
            options,
            CancellationToken::new(),
        )
        .await
        .expect("verification runs")
    }

    async fn verify(&self) -> TreeVerification {
        self.verify_with(&options()).await
    }

    /// Change the target with `change`, keeping the modification times of
    /// `untouched` (relative paths), so only what the change is about
    /// differs.
    fn tamper(&self, untouched: &[&str], change: impl FnOnce(&Path)) {
        let times: Vec<(PathBuf, std::fs::Metadata)> = untouched
            .iter()
            .map(|path| {
                let full = self.target.join(path);
                let metadata = std::fs::symlink_metadata(&full).unwrap();
                (full, metadata)
            })
            .collect();
        change(&self.target);
        for (path, metadata) in times {
            set_mtime(&path, metadata.mtime(), metadata.mtime_nsec());
        }
    }
}

fn set_mtime(path: &Path, seconds: i64, nanos: i64) {
    let time = rustix::fs::Timespec {
        tv_sec: seconds,
        tv_nsec: nanos,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &Timestamps {
            last_access: time,
            last_modification: time,
        },
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

/// The report's mismatches as `path: what`, sorted.
fn mismatches(report: &TreeVerification) -> Vec<String> {
    let mut found: Vec<String> = report.mismatches.iter().map(ToString::to_string).collect();
    found.sort();
    found
}

/// Exactly one mismatch, at `path`, whose words contain `words`.
fn assert_one_mismatch(report: &TreeVerification, path: &str, words: &str) {
    let found = mismatches(report);
    assert!(
        found.len() == 1 && found[0].starts_with(&format!("{path}: ")) && found[0].contains(words),
        "expected only `{path}: …{words}…`, found {found:#?}"
    );
    assert_eq!(report.verified_tree(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_tree_verifies_against_its_snapshots_root_tree() {
    let restored = restored_tree().await;
    let report = restored.verify().await;
    assert_eq!(mismatches(&report), Vec::<String>::new());
    let snapshot = restored
        .repo
        .repository
        .load_snapshot(&restored.snapshot)
        .await
        .unwrap();
    assert_eq!(
        report.verified_tree(),
        Some(snapshot.tree.to_hex().as_str())
    );
    assert_eq!(report.files, 7, "{report:?}");
    assert_eq!(report.bytes_verified, snapshot.summary.total_bytes);
    assert!(!report.stopped_at_limit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_the_snapshot_does_not_have_is_named() {
    let restored = restored_tree().await;
    restored.tamper(&["dir"], |target| {
        std::fs::write(target.join("dir/stray"), b"").unwrap()
    });
    assert_one_mismatch(&restored.verify().await, "dir/stray", "not in the snapshot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_entry_is_named_with_its_kind() {
    let restored = restored_tree().await;
    restored.tamper(&["."], |target| {
        std::fs::remove_file(target.join("pipe")).unwrap()
    });
    assert_one_mismatch(&restored.verify().await, "pipe", "missing (a FIFO");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_kind_of_entry_under_the_same_name_is_named() {
    let restored = restored_tree().await;
    restored.tamper(&["dir"], |target| {
        std::fs::remove_file(target.join("dir/small.txt")).unwrap();
        std::fs::create_dir(target.join("dir/small.txt")).unwrap();
    });
    assert_one_mismatch(
        &restored.verify().await,
        "dir/small.txt",
        "is a directory, the snapshot has a regular file",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_mode_is_named() {
    let restored = restored_tree().await;
    restored.tamper(&[], |target| {
        std::fs::set_permissions(
            target.join("dir/sub"),
            std::os::unix::fs::PermissionsExt::from_mode(0o750),
        )
        .unwrap()
    });
    assert_one_mismatch(
        &restored.verify().await,
        "dir/sub",
        "mode 0750, the snapshot has 2750",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_owner_is_named_when_owners_were_restored() {
    let restored = restored_tree().await;
    restored.tamper(&[], |target| {
        std::os::unix::fs::lchown(target.join("dir/small.txt"), Some(4242), None).unwrap()
    });
    assert_one_mismatch(
        &restored.verify().await,
        "dir/small.txt",
        "owner 4242:1000, the snapshot has 1000:1000",
    );
    let without_owners = TreeVerifyOptions {
        check_owners: false,
        ..options()
    };
    assert_eq!(
        mismatches(&restored.verify_with(&without_owners).await),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_modification_time_is_named() {
    let restored = restored_tree().await;
    let path = restored.target.join("pointer");
    let before = std::fs::symlink_metadata(&path).unwrap();
    set_mtime(&path, before.mtime() + 60, before.mtime_nsec());
    assert_one_mismatch(&restored.verify().await, "pointer", "modified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_of_the_same_size_and_time_is_rehashed_and_a_changed_chunk_named() {
    let restored = restored_tree().await;
    restored.tamper(&["dir/sub/data.bin"], |target| {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(target.join("dir/sub/data.bin"))
            .unwrap();
        file.write_all_at(b"X", (2 << 20) + 17).unwrap();
    });
    let report = restored.verify().await;
    assert_one_mismatch(&report, "dir/sub/data.bin", "content differs in the");
    let haulage::engine::verify_tree::Difference::Content { offset, length } =
        report.mismatches[0].difference
    else {
        panic!("{report:?}");
    };
    assert!(
        offset <= (2 << 20) + 17 && (2 << 20) + 17 < offset + length,
        "the named chunk {offset}+{length} holds the changed byte"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_zero_byte_in_a_hole_is_named() {
    let restored = restored_tree().await;
    restored.tamper(&["sparse.img"], |target| {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(target.join("sparse.img"))
            .unwrap();
        file.write_all_at(b"\x01", 50 << 20).unwrap();
    });
    assert_one_mismatch(
        &restored.verify().await,
        "sparse.img",
        &format!(
            "byte {} is not zero, the snapshot has a hole there",
            50 << 20
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_pointing_elsewhere_is_named() {
    let restored = restored_tree().await;
    let before = std::fs::symlink_metadata(restored.target.join("pointer")).unwrap();
    restored.tamper(&["."], |target| {
        std::fs::remove_file(target.join("pointer")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", target.join("pointer")).unwrap();
    });
    set_mtime(
        &restored.target.join("pointer"),
        before.mtime(),
        before.mtime_nsec(),
    );
    assert_one_mismatch(
        &restored.verify().await,
        "pointer",
        "points to \"/etc/passwd\", the snapshot's points to \"dir/small.txt\"",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_link_replaced_by_a_copy_is_named() {
    let restored = restored_tree().await;
    let before = std::fs::metadata(restored.target.join("linked")).unwrap();
    restored.tamper(&["dir"], |target| {
        std::fs::remove_file(target.join("dir/also-linked")).unwrap();
        std::fs::copy(target.join("linked"), target.join("dir/also-linked")).unwrap();
    });
    for path in ["linked", "dir/also-linked"] {
        set_mtime(
            &restored.target.join(path),
            before.mtime(),
            before.mtime_nsec(),
        );
    }
    let report = restored.verify().await;
    let found = mismatches(&report);
    assert!(
        found.len() == 1 && found[0].contains("is not a hard link of"),
        "{found:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_the_snapshot_keeps_apart_joined_by_a_hard_link_are_named() {
    let restored = restored_tree().await;
    restored.tamper(&["."], |target| {
        std::fs::remove_file(target.join("twin-b")).unwrap();
        std::fs::hard_link(target.join("twin-a"), target.join("twin-b")).unwrap();
    });
    let found = mismatches(&restored.verify().await);
    assert!(
        found.len() == 1 && found[0].contains("which the snapshot has as a separate file"),
        "{found:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_extended_attribute_is_named() {
    let restored = restored_tree().await;
    set_xattr(
        &restored.target.join("dir/small.txt"),
        "user.comment",
        b"changed",
    )
    .unwrap();
    assert_one_mismatch(
        &restored.verify().await,
        "dir/small.txt",
        "extended attribute user.comment: differs",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_replaced_by_a_symlink_is_not_followed() {
    let restored = restored_tree().await;
    let copy = restored.repo.dir.path().join("copy-of-dir");
    let before = std::fs::metadata(restored.target.join("dir")).unwrap();
    restored.tamper(&["."], |target| {
        std::fs::rename(target.join("dir"), &copy).unwrap();
        std::os::unix::fs::symlink(&copy, target.join("dir")).unwrap();
    });
    set_mtime(
        &restored.target.join("dir"),
        before.mtime(),
        before.mtime_nsec(),
    );
    // Through the symlink everything would match; without it, "dir" is a
    // symlink, and the hard link partner inside it is not seen at all.
    assert_one_mismatch(
        &restored.verify().await,
        "dir",
        "is a symlink, the snapshot has a directory",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_is_bounded_and_says_it_stopped() {
    let restored = restored_tree().await;
    for index in 0..20 {
        std::fs::write(restored.target.join(format!("stray-{index:02}")), b"").unwrap();
    }
    let report = restored
        .verify_with(&TreeVerifyOptions {
            max_mismatches: 5,
            ..options()
        })
        .await;
    assert_eq!(report.mismatches.len(), 5);
    assert!(report.stopped_at_limit);
    assert_eq!(report.verified_tree(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_the_restore_cannot_create_is_counted_not_a_mismatch() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("file"), b"data").unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(source.join("app.sock")).unwrap();
    let outcome = repo.backup(&source).await;
    let target = repo.dir.path().join("restored");
    let restored = repo.restore(&outcome.snapshot_id, &target).await;
    assert_eq!(restored.problems.len(), 1, "{:?}", restored.problems);
    let report = verify_tree(
        &repo.repository,
        &outcome.snapshot_id,
        &target,
        &options(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(mismatches(&report), Vec::<String>::new());
    assert_eq!(report.not_restorable, 1);
    assert_eq!(report.not_restorable_paths, vec!["app.sock".to_string()]);
}

/// `haulage restore --verify` ends the restore as the in-cluster agent
/// does: the written tree re-read and compared with the snapshot, the
/// verification in the JSON summary; a `--sync --since` pass re-reads only
/// what it wrote. Without `--verify` there is no verification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_restore_verifies_what_it_wrote_when_asked() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(source.join("dir")).unwrap();
    for index in 0..20u64 {
        std::fs::write(
            source.join(format!("dir/file-{index:02}")),
            random_bytes(index, 4096 + index as usize),
        )
        .unwrap();
    }
    let first = repo.backup(&source).await.snapshot_id;
    let restore = |snapshot: &ObjectId, target: &Path, extra: &[&str]| {
        let output = super::support::haulage()
            .args(["restore", &snapshot.to_hex(), "--no-progress", "--json"])
            .arg(target)
            .args(["--repo", &repo.url()])
            .args(extra)
            .output()
            .unwrap();
        crate::support::expect_success(&output, "haulage restore");
        serde_json::from_slice::<serde_json::Value>(&output.stdout).unwrap()
    };
    let target = repo.dir.path().join("restored");
    let summary = restore(&first, &target, &["--verify"]);
    let tree = repo
        .repository
        .load_snapshot(&first)
        .await
        .unwrap()
        .tree
        .to_hex();
    let verification = &summary["verification"];
    assert_eq!(verification["rootTree"], tree.as_str(), "{summary}");
    assert_eq!(
        verification["mismatches"],
        serde_json::json!([]),
        "{summary}"
    );
    assert_eq!(verification["files"], 20, "{summary}");
    let bytes: u64 = (0..20).map(|index| 4096 + index).sum();
    assert_eq!(verification["bytesVerified"], bytes, "{summary}");

    std::fs::write(source.join("dir/file-03"), random_bytes(99, 5000)).unwrap();
    let second = repo.backup(&source).await.snapshot_id;
    let summary = restore(
        &second,
        &target,
        &["--sync", "--since", &first.to_hex(), "--verify"],
    );
    let verification = &summary["verification"];
    assert_eq!(summary["bytesWritten"], 5000, "{summary}");
    assert_eq!(
        verification["mismatches"],
        serde_json::json!([]),
        "{summary}"
    );
    assert_eq!(verification["files"], 1, "{summary}");
    assert_eq!(verification["filesNotRead"], 19, "{summary}");
    assert_eq!(verification["bytesVerified"], 5000, "{summary}");

    let plain = restore(&second, &repo.dir.path().join("again"), &[]);
    assert!(plain.get("verification").is_none(), "{plain}");
}
