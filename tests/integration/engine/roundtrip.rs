//! Trees round-trip byte- and metadata-identical; dedup and incremental
//! backups store only what is new.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use haulage::engine::backup::ParentPolicy;
use haulage::engine::restore::RestoreOptions;
use proptest::prelude::*;

use super::support::{
    TestRepo, assert_same_tree, fingerprint, haulage, make_fifo, random_bytes, set_xattr,
    write_sparse_file,
};

/// Names: ASCII, unicode, non-UTF-8 bytes, leading dots.
fn name_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[a-z]{1,8}".prop_map(String::into_bytes),
        "[é日本ü-]{1,4}".prop_map(String::into_bytes),
        proptest::collection::vec(0x80u8..=0xff, 1..6),
        "\\.[a-z]{1,5}".prop_map(String::into_bytes),
    ]
}

#[derive(Debug, Clone)]
enum Node {
    File { size: usize, seed: u64, mode: u32 },
    Sparse { data_at: u64, length: u64 },
    Dir(Vec<(Vec<u8>, Node)>),
    Symlink(Vec<u8>),
}

fn node_strategy() -> impl Strategy<Value = Node> {
    let chunk = 512 * 1024usize;
    let leaf = prop_oneof![
        4 => (prop_oneof![Just(0usize), 1usize..5000, Just(chunk), Just(chunk * 8), Just(chunk * 8 + 1)], any::<u64>(), prop_oneof![Just(0o644u32), Just(0o600), Just(0o4755), Just(0o2750), Just(0o400)])
            .prop_map(|(size, seed, mode)| Node::File { size, seed, mode }),
        1 => (0u64..(64 << 20), 1u64..100_000).prop_map(|(data_at, length)| Node::Sparse { data_at, length }),
        1 => prop_oneof![
            Just(b"../../outside".to_vec()),
            Just(b"/etc/passwd".to_vec()),
            Just(b"loop".to_vec()),
            Just(b"dangling/target".to_vec()),
            proptest::collection::vec(1u8..=255, 1..20).prop_map(|bytes| bytes.into_iter().filter(|b| *b != b'/').chain(std::iter::once(b'x')).collect()),
        ].prop_map(Node::Symlink),
    ];
    leaf.prop_recursive(4, 40, 6, |inner| {
        proptest::collection::btree_map(name_strategy(), inner, 0..6)
            .prop_map(|children| Node::Dir(children.into_iter().collect()))
    })
}

fn build(path: &Path, node: &Node) {
    match node {
        Node::File { size, seed, mode } => {
            std::fs::write(path, random_bytes(*seed, *size)).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(*mode)).unwrap();
        }
        Node::Sparse { data_at, length } => {
            write_sparse_file(
                path,
                data_at + length + (16 << 20),
                &random_bytes(*data_at, *length as usize),
                *data_at,
            )
            .unwrap();
        }
        Node::Dir(children) => {
            std::fs::create_dir(path).unwrap();
            for (name, child) in children {
                build(&path.join(OsStr::from_bytes(name)), child);
            }
        }
        Node::Symlink(target) => {
            std::os::unix::fs::symlink(OsStr::from_bytes(target), path).unwrap()
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]

    #[test]
    fn random_trees_round_trip_byte_and_metadata_identical(children in proptest::collection::btree_map(name_strategy(), node_strategy(), 1..8)) {
        runtime().block_on(async {
            let repo = TestRepo::new().await;
            let source = repo.dir.path().join("source");
            build(&source, &Node::Dir(children.into_iter().collect()));
            let outcome = repo.backup(&source).await;
            assert_eq!(outcome.snapshot.summary.warning_count, 0, "{:?}", outcome.snapshot.summary.warnings);
            let target = repo.dir.path().join("restored");
            let restored = repo.restore(&outcome.snapshot_id, &target).await;
            assert!(restored.problems.is_empty(), "{:?}", restored.problems);
            assert_same_tree(&source, &target);
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardlinks_xattrs_fifos_times_and_sparse_files_are_restored() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(source.join("a/deep/er")).unwrap();
    std::fs::create_dir_all(source.join("b")).unwrap();
    std::fs::create_dir(source.join("empty")).unwrap();
    std::fs::write(source.join("a/deep/er/linked"), b"shared content").unwrap();
    std::fs::hard_link(
        source.join("a/deep/er/linked"),
        source.join("b/also-linked"),
    )
    .unwrap();
    std::fs::write(source.join("tagged"), b"x").unwrap();
    set_xattr(&source.join("tagged"), "user.comment", b"hello").unwrap();
    set_xattr(&source.join("a"), "user.dir", b"on a directory").unwrap();
    // Names listing to more than the kibibyte the backup first asks the
    // list into, and a value longer than the one it first asks into.
    std::fs::write(source.join("many-tags"), b"y").unwrap();
    for tag in 0..10 {
        let name = format!("user.{tag:02}-{}", "n".repeat(110));
        set_xattr(&source.join("many-tags"), &name, tag.to_string().as_bytes()).unwrap();
    }
    set_xattr(&source.join("many-tags"), "user.long", &[b'v'; 1500]).unwrap();
    make_fifo(&source.join("pipe"), 0o640).unwrap();
    std::os::unix::fs::symlink("loop", source.join("loop")).unwrap();
    // 1 GiB sparse file with 4 KiB of data in the middle.
    write_sparse_file(
        &source.join("sparse.img"),
        1 << 30,
        &random_bytes(1, 4096),
        500 << 20,
    )
    .unwrap();
    std::fs::set_permissions(
        source.join("a/deep"),
        std::fs::Permissions::from_mode(0o555),
    )
    .unwrap();

    let outcome = repo.backup(&source).await;
    assert!(
        repo.pack_bytes() < 1 << 20,
        "the hole cost storage: {} bytes",
        repo.pack_bytes()
    );
    let target = repo.dir.path().join("restored");
    let restored = repo.restore(&outcome.snapshot_id, &target).await;
    assert!(restored.problems.is_empty(), "{:?}", restored.problems);
    assert_same_tree(&source, &target);
    use std::os::unix::fs::MetadataExt;
    let restored_sparse = std::fs::metadata(target.join("sparse.img")).unwrap();
    assert!(
        restored_sparse.blocks() * 512 < 1 << 20,
        "sparse file restored dense"
    );
    let prints = fingerprint(&target);
    assert_eq!(
        prints[&b"b/also-linked".to_vec()].hardlink_group,
        Some(b"a/deep/er/linked".to_vec())
    );
}

/// A backup after one reuses what did not change (file contents and
/// extended attributes from the parent snapshot, its subtrees read ahead)
/// and still finds every change: an extended attribute set on a file or a
/// directory, a directory renamed (its files are matched by path, so read
/// again, whichever subtree was read ahead), one added, a mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_after_another_reuses_only_what_did_not_change() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    for directory in ["d1", "d2", "d3", "d4"] {
        for file in ["f1", "f2", "f3"] {
            let path = source.join(directory).join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, format!("{directory}/{file}")).unwrap();
        }
    }
    set_xattr(&source.join("d1/f1"), "user.note", b"first").unwrap();
    set_xattr(&source.join("d3"), "user.note", b"a directory").unwrap();
    let first = repo.backup(&source).await;
    assert_eq!(first.snapshot.summary.files_unchanged, 0);

    set_xattr(&source.join("d1/f1"), "user.note", b"second").unwrap();
    set_xattr(&source.join("d1/f2"), "user.added", b"new").unwrap();
    set_xattr(&source.join("d3"), "user.note", b"changed").unwrap();
    std::fs::rename(source.join("d2"), source.join("d21")).unwrap();
    std::fs::create_dir(source.join("d22")).unwrap();
    std::fs::write(source.join("d22/f1"), b"new directory").unwrap();
    std::fs::set_permissions(source.join("d4/f3"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let second = repo.backup(&source).await;
    // d1/f3, d3's three files, d4/f1 and d4/f2: untouched since the first.
    assert_eq!(second.snapshot.summary.files_unchanged, 6);
    let target = repo.dir.path().join("restored");
    let restored = repo.restore(&second.snapshot_id, &target).await;
    assert!(restored.problems.is_empty(), "{:?}", restored.problems);
    assert_same_tree(&source, &target);
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The tree id of every directory of a snapshot, by path.
async fn directory_trees(
    repo: &TestRepo,
    outcome: &haulage::engine::backup::BackupOutcome,
) -> std::collections::BTreeMap<String, haulage::repo::BlobId> {
    let repository = &repo.repository;
    let index = repository.load_index().await.unwrap().index;
    let mut trees = std::collections::BTreeMap::new();
    let mut pending = vec![(String::new(), outcome.snapshot.tree)];
    while let Some((path, id)) = pending.pop() {
        let tree = repository.load_tree(&index, &id).await.unwrap();
        for entry in &tree.entries {
            if let Some(subtree) = entry.subtree {
                let name = String::from_utf8_lossy(&entry.name);
                pending.push((format!("{path}/{name}"), subtree));
            }
        }
        trees.insert(path, id);
    }
    trees
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_walked_unchanged_keeps_its_tree_and_a_change_at_any_depth_is_stored() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    for path in [
        "top/mid/deep/f1",
        "top/mid/deep/f2",
        "top/mid/g1",
        "top/h1",
        "other/x",
    ] {
        let path = source.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, path.to_string_lossy().as_bytes()).unwrap();
    }
    std::os::unix::fs::symlink("deep/f1", source.join("top/mid/link")).unwrap();
    let mut last = repo.backup(&source).await;
    let mut last_trees = directory_trees(&repo, &last).await;
    // Each step changes one thing, below which directories it names; every
    // other directory keeps its tree, these get new ones.
    type Change = fn(&Path);
    let steps: [(&str, Change, &[&str]); 6] = [
        (
            "a directory's mode, two levels down",
            |source| set_mode(&source.join("top/mid/deep"), 0o700),
            &["", "/top", "/top/mid"],
        ),
        (
            "a directory's extended attribute",
            |source| set_xattr(&source.join("top/mid/deep"), "user.note", b"x").unwrap(),
            &["", "/top", "/top/mid"],
        ),
        (
            "a file's mode, three levels down",
            |source| set_mode(&source.join("top/mid/deep/f2"), 0o600),
            &["", "/top", "/top/mid", "/top/mid/deep"],
        ),
        (
            "a file removed",
            |source| std::fs::remove_file(source.join("top/mid/g1")).unwrap(),
            &["", "/top", "/top/mid"],
        ),
        (
            "a symlink pointed elsewhere",
            |source| {
                std::fs::remove_file(source.join("top/mid/link")).unwrap();
                std::os::unix::fs::symlink("deep/f2", source.join("top/mid/link")).unwrap();
            },
            &["", "/top", "/top/mid"],
        ),
        (
            "a file added",
            |source| std::fs::write(source.join("other/y"), b"new").unwrap(),
            &["", "/other"],
        ),
    ];
    for (what, change, changed) in steps {
        // Times kept apart from the last backup's (same-second changes).
        std::thread::sleep(std::time::Duration::from_millis(20));
        change(&source);
        let next = repo.backup(&source).await;
        let trees = directory_trees(&repo, &next).await;
        for (path, tree) in &trees {
            let kept = last_trees.get(path) == Some(tree);
            assert_eq!(
                kept,
                !changed.contains(&path.as_str()),
                "after {what}: the tree of `{path}` {}",
                if kept { "was kept" } else { "changed" }
            );
        }
        let target = repo
            .dir
            .path()
            .join(format!("restored-{}", next.snapshot_id));
        let restored = repo.restore(&next.snapshot_id, &target).await;
        assert!(
            restored.problems.is_empty(),
            "{what}: {:?}",
            restored.problems
        );
        assert_same_tree(&source, &target);
        (last, last_trees) = (next, trees);
    }
    assert_eq!(last.snapshot.summary.files, 5);
}

/// A tree of many tiny files in many directories backs up under a low
/// limit of open descriptors: the backup holds a bounded number of source
/// files open, however far its walker runs ahead of the jobs that read
/// them, and the totals scan beside it one directory at a time.
#[test]
fn many_tiny_files_back_up_under_a_low_limit_of_open_files() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = tiny_files_in_directories(&repo);
    let (summary, _) = back_up_under_open_file_limit(&repo, &source, 128);
    assert_eq!(summary["warningCount"], 0, "{}", summary["warnings"]);
    assert_eq!(summary["files"], 3_000);
}

/// Under a limit of open files so low that the process has almost none
/// left beside its own (16: the backup's 8 places at once are more than
/// are free), an open that finds none waits for one instead of skipping
/// the file: every file is in the snapshot, none is a warning. Skipped,
/// 2,935 of the 3,000 were warnings ("cannot open, skipped: Too many open
/// files").
#[test]
fn a_backup_out_of_descriptors_waits_for_one_and_skips_no_file() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = tiny_files_in_directories(&repo);
    let (summary, log) = back_up_under_open_file_limit(&repo, &source, 16);
    // The limit was reached (else this checks nothing).
    assert!(
        log.contains("waiting for a file descriptor to come free"),
        "{log}"
    );
    assert_eq!(summary["warningCount"], 0, "{}", summary["warnings"]);
    assert_eq!(summary["files"], 3_000);
    let target = repo.dir.path().join("restored");
    let snapshot = summary["snapshotId"]
        .as_str()
        .expect("snapshotId")
        .parse()
        .unwrap();
    runtime.block_on(repo.restore(&snapshot, &target));
    assert_same_tree(&source, &target);
}

/// A restore under a limit of open files far below the usual 1,024 holds
/// a share of it (`descriptors::restore_share`): every file is restored.
/// With 80 directories a batch and 256 open files whatever the limit, the
/// 200 directories below under `ulimit -n 64` held the limit, every read
/// of a pack failed with EMFILE, and none of the 3,000 files was restored
/// ("its data could not be read: ... Too many open files").
#[test]
fn a_restore_under_a_low_limit_of_open_files_restores_every_file() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let repo = runtime.block_on(TestRepo::new());
    let source = tiny_files_in_directories(&repo);
    let snapshot = runtime.block_on(repo.backup(&source)).snapshot_id;
    let target = repo.dir.path().join("restored");
    let output = under_open_file_limit(64)
        .args(["restore", "--no-progress", "--repo", &repo.url()])
        .arg(snapshot.to_hex())
        .arg(&target)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert_same_tree(&source, &target);
}

/// 3,000 tiny files, 15 to a directory.
fn tiny_files_in_directories(repo: &TestRepo) -> std::path::PathBuf {
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    for i in 0..3_000 {
        let directory = source.join(format!("d{:03}", i / 15));
        std::fs::create_dir_all(&directory).unwrap();
        std::fs::write(directory.join(format!("f{i:04}")), format!("tiny file {i}")).unwrap();
    }
    source
}

/// The summary of `haulage backup --json` of `source` run under
/// `ulimit -n limit` (soft and hard, so the binary cannot raise it), and
/// its log.
fn back_up_under_open_file_limit(
    repo: &TestRepo,
    source: &std::path::Path,
    limit: u32,
) -> (serde_json::Value, String) {
    let output = under_open_file_limit(limit)
        .args(["backup", "--json", "--repo", &repo.url()])
        .arg(source)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{log}");
    (serde_json::from_slice(&output.stdout).unwrap(), log)
}

/// The `haulage` command, run under `ulimit -n limit` (soft and hard, so
/// the binary cannot raise it).
fn under_open_file_limit(limit: u32) -> std::process::Command {
    let inner = haulage();
    let mut command = std::process::Command::new("sh");
    command
        .arg("-c")
        .arg(format!("ulimit -n {limit} && exec \"$0\" \"$@\""))
        .arg(inner.get_program());
    for (name, value) in inner.get_envs() {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_copy_of_a_file_adds_almost_nothing_and_a_front_insertion_only_a_few_chunks() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    let data = random_bytes(7, 100 << 20);
    std::fs::write(source.join("original"), &data).unwrap();
    repo.backup(&source).await;
    let after_first = repo.pack_bytes();

    std::fs::write(source.join("copy"), &data).unwrap();
    repo.backup(&source).await;
    let after_copy = repo.pack_bytes();
    assert!(
        (after_copy - after_first) * 100 < after_first,
        "copy added {} bytes to {}",
        after_copy - after_first,
        after_first
    );

    let mut shifted = b"0123456789".to_vec();
    shifted.extend_from_slice(&data);
    std::fs::write(source.join("shifted"), &shifted).unwrap();
    let outcome = repo.backup(&source).await;
    // Chunks average 1 MiB and are at most 4 MiB: a few new chunks at most.
    assert!(
        outcome.snapshot.summary.bytes_new < 12 << 20,
        "front insertion stored {} new bytes",
        outcome.snapshot.summary.bytes_new
    );
}

/// Every file is cut where chunking its whole content at once would cut
/// it, whichever way the backup reads it (a small file whole in one job, a
/// larger one a prefix at a time), so its chunks dedup against any other
/// copy of the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_cut_where_their_whole_content_would_be_cut() {
    let repo = TestRepo::new().await;
    let source = tempfile::tempdir().unwrap();
    let chunker = repo.repository.chunker();
    // Each repository keys its own cut points: random bytes of this size
    // whose content this repository cuts at least once (about one seed in
    // seven is a single chunk of 2 MiB).
    let several_chunks = |first_seed: u64, length: usize| {
        (first_seed..)
            .step_by(100)
            .map(|seed| random_bytes(seed, length))
            .find(|data| chunker.chunk_lengths(data).len() > 1)
            .unwrap()
    };
    let text: Vec<u8> = (0..200_000u32)
        .flat_map(|line| format!("{line:08} GET /api/v1/items/{} 200\n", line % 977).into_bytes())
        .collect();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("small-several-chunks.bin", several_chunks(11, 2 << 20)),
        ("between.bin", several_chunks(12, 3 << 20)),
        ("large.bin", random_bytes(13, 21 << 20)),
        ("text.log", text),
    ];
    for (name, data) in &files {
        std::fs::write(source.path().join(name), data).unwrap();
    }
    let outcome = repo.backup(source.path()).await;
    let repository = &repo.repository;
    let index = repository.load_index().await.unwrap().index;
    let tree = repository
        .load_tree(&index, &outcome.snapshot.tree)
        .await
        .unwrap();
    for (name, data) in &files {
        let entry = tree.find(name.as_bytes()).expect("file in the tree");
        let lengths: Vec<usize> = entry
            .content
            .iter()
            .map(|extent| extent.length() as usize)
            .collect();
        let expected = chunker.chunk_lengths(data);
        assert!(expected.len() > 1, "{name}: {} chunks", expected.len());
        assert_eq!(lengths, expected, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_tree_makes_no_new_pack_and_reads_nothing() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    haulage::sample::generate(&source, 8 << 20, 3).unwrap();
    let first = repo.backup(&source).await;
    let packs = repo.pack_count();
    let second = repo.backup(&source).await;
    assert_eq!(second.snapshot.parent, Some(first.snapshot_id));
    assert_eq!(second.snapshot.summary.packs_written, 0);
    assert_eq!(second.snapshot.summary.bytes_read, 0);
    assert_eq!(
        second.snapshot.summary.files_unchanged,
        first.snapshot.summary.files
    );
    assert_eq!(repo.pack_count(), packs);
    assert_eq!(second.snapshot.tree, first.snapshot.tree);

    // Touching one file makes only that file be read again.
    std::fs::write(source.join("large/app.log"), b"changed").unwrap();
    let third = repo.backup(&source).await;
    assert_eq!(third.snapshot.summary.bytes_read, 7);
    let full = repo.backup_with(&source, ParentPolicy::None).await;
    assert_eq!(
        full.snapshot.summary.bytes_read,
        full.snapshot.summary.total_bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_restore_leaves_identical_files_untouched_and_rewrites_only_what_differs() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    haulage::sample::generate(&source, 8 << 20, 4).unwrap();
    let first = repo.backup(&source).await;
    let target = repo.dir.path().join("restored");
    repo.restore(&first.snapshot_id, &target).await;

    // The source moves on: one file changed, one added, one removed.
    std::fs::write(source.join("large/app.log"), b"rotated").unwrap();
    std::fs::write(source.join("new-file"), b"new").unwrap();
    std::fs::remove_file(source.join("duplicates/random-copy.bin")).unwrap();
    // The target got an extra file that must go.
    std::fs::write(target.join("stray"), b"stray").unwrap();
    let second = repo.backup(&source).await;

    let untouched = target.join("large/random.bin");
    let inode_before = std::fs::metadata(&untouched)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let ctime_before = std::fs::metadata(&untouched)
        .map(|m| std::os::unix::fs::MetadataExt::ctime_nsec(&m))
        .unwrap();
    let mut options = RestoreOptions::new(&target);
    options.sync = true;
    let outcome = repo.restore_with(&second.snapshot_id, options).await;
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_same_tree(&source, &target);
    assert_eq!(
        outcome.entries_removed, 2,
        "the stray file and the removed copy"
    );
    assert_eq!(outcome.bytes_written, 7 + 3);
    let after = std::fs::metadata(&untouched).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::ino(&after), inode_before);
    assert_eq!(
        std::os::unix::fs::MetadataExt::ctime_nsec(&after),
        ctime_before,
        "identical file was touched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_since_the_earlier_snapshot_reads_only_what_changed_and_still_finds_every_change() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    haulage::sample::generate(&source, 4 << 20, 9).unwrap();
    let first = repo.backup(&source).await;
    let target = repo.dir.path().join("restored");
    repo.restore(&first.snapshot_id, &target).await;
    let files = super::support::files_under(&source).len() as u64;

    // At the source: one file rewritten with its size and time put back
    // (`touch -r`: only its ctime tells, and only the snapshots' content
    // can tell the restore), one changed the usual way.
    let small = super::support::files_under(&source)
        .into_iter()
        .map(|(path, _)| path)
        .find(|path| path.extension().is_some_and(|e| e == "txt"))
        .expect("a small text file");
    let modified = std::fs::metadata(&small).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&small).unwrap();
    for byte in bytes.iter_mut().take(8) {
        *byte ^= 0x55;
    }
    std::fs::write(&small, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&small)
        .unwrap()
        .set_modified(modified)
        .unwrap();
    std::fs::write(source.join("large/app.log"), b"rotated").unwrap();
    // In the target, a file written since the first restore (its time
    // moves): compared and put right although the snapshots agree on it.
    std::fs::write(target.join("duplicates/random-copy.bin"), b"scribbled").unwrap();
    let second = repo.backup(&source).await;

    let mut options = RestoreOptions::new(&target);
    options.sync = true;
    options.since = Some(first.snapshot_id);
    let verify_options = haulage::engine::verify_tree::TreeVerifyOptions::for_restore(&options);
    let outcome = repo.restore_with(&second.snapshot_id, options).await;
    let verify_options = verify_options.after(&outcome);
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_eq!(
        outcome.since.as_deref(),
        Some(first.snapshot_id.to_hex().as_str())
    );
    assert_same_tree(&source, &target);
    assert_eq!(
        outcome.files_not_read,
        files - 3,
        "all but the three changed files are left unread"
    );
    let verification = haulage::engine::verify_tree::verify_tree(
        &repo.repository,
        &second.snapshot_id,
        &target,
        &verify_options,
        Default::default(),
    )
    .await
    .unwrap();
    assert!(
        verification.mismatches.is_empty(),
        "{:?}",
        verification.mismatches
    );
    assert_eq!(verification.files_not_read, files - 3);
    assert_eq!(
        verification.files, 3,
        "what the sync wrote is re-read, the file put right in the target included"
    );

    // A since snapshot that is not there only costs a full comparison.
    std::fs::write(source.join("large/app.log"), b"rotated again").unwrap();
    let third = repo.backup(&source).await;
    let mut options = RestoreOptions::new(&target);
    options.sync = true;
    options.since = Some(haulage::repo::ObjectId::of(b"no such snapshot"));
    let outcome = repo.restore_with(&third.snapshot_id, options).await;
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_eq!(outcome.since, None);
    assert!(
        outcome
            .since_not_used
            .as_deref()
            .is_some_and(|reason| reason.contains("every file is compared")),
        "{:?}",
        outcome.since_not_used
    );
    assert_eq!(outcome.files_not_read, 0);
    assert_same_tree(&source, &target);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_into_a_non_empty_directory_is_refused_without_sync() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("f"), b"f").unwrap();
    let outcome = repo.backup(&source).await;
    let target = repo.dir.path().join("busy");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("precious"), b"keep me").unwrap();
    let error = haulage::engine::restore::restore(
        &repo.repository,
        &outcome.snapshot_id,
        RestoreOptions::new(&target),
        Default::default(),
        Default::default(),
    )
    .await
    .expect_err("must refuse");
    assert!(error.to_string().contains("not empty"), "{error}");
    assert_eq!(std::fs::read(target.join("precious")).unwrap(), b"keep me");
}

#[test]
fn two_concurrent_backups_into_one_repository_both_verify_and_restore() {
    let runtime = runtime();
    let repo = runtime.block_on(TestRepo::new());
    let sources: Vec<PathBuf> = (0..2)
        .map(|i| repo.dir.path().join(format!("source{i}")))
        .collect();
    for (i, source) in sources.iter().enumerate() {
        haulage::sample::generate(source, 16 << 20, 10 + i as u64).unwrap();
    }
    let children: Vec<_> = sources
        .iter()
        .map(|source| {
            super::support::haulage()
                .args(["backup", "--json", "--repo", &repo.url()])
                .arg(source)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut ids = Vec::new();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success());
        let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        ids.push(summary["snapshotId"].as_str().unwrap().to_string());
    }
    repo.assert_cli_verifies();
    for (id, source) in ids.iter().zip(&sources) {
        let target = repo.dir.path().join(format!("restored-{id}"));
        let status = super::support::haulage()
            .args(["restore", id, "--no-progress", "--repo", &repo.url()])
            .arg(&target)
            .status()
            .unwrap();
        assert!(status.success());
        assert_same_tree(source, &target);
    }
}

/// Regression: each read of a file was charged to the read throttle for
/// the block it asked for (256 KiB), not for the bytes the file holds, so
/// under a bandwidth grant a tree of small files was read at a fraction of
/// the grant (the 100-claim measurement in docs/benchmarks.md: 1 MiB
/// sample trees took ~25 s each at a 200 KiB/s grant). 64 files of 2 KiB
/// are 128 KiB, within the throttle's first burst at 1 MiB/s: no wait.
/// Charged a block each they would be 16 MiB, ~16 s of waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_files_are_charged_their_size_against_the_read_throttle_not_a_read_block_each() {
    use haulage::engine::backup::BackupOptions;
    use haulage::engine::throttle::{ByteRate, Throttle};
    use haulage::store::limits::WaitTime;
    let repo = TestRepo::new().await;
    let source = tempfile::tempdir().expect("temp dir");
    for index in 0..64 {
        std::fs::write(
            source.path().join(format!("f{index:02}")),
            random_bytes(index, 2048),
        )
        .expect("write");
    }
    let waited = WaitTime::default();
    let mut options = BackupOptions::new(source.path());
    options.read_throttle =
        Throttle::new(Some(ByteRate(1 << 20))).recording_wait_into(waited.clone());
    repo.backup_with_options(options).await;
    assert!(
        waited.total() < std::time::Duration::from_secs(2),
        "128 KiB of small files waited {:?} for a 1 MiB/s throttle",
        waited.total()
    );
}

/// Small files `fNN` of 1,000 bytes under `source`, one for each of
/// `indexes`.
fn write_small_files(source: &Path, indexes: std::ops::Range<u64>) {
    for index in indexes {
        std::fs::write(
            source.join(format!("f{index:02}")),
            random_bytes(index, 1000),
        )
        .unwrap();
    }
}

/// A backup of `options` into `repo` running on its own task, reporting
/// into `progress`, read through a 1 MiB/s throttle so that it lasts while
/// the test watches its progress.
fn spawn_slow_backup(
    repo: &TestRepo,
    mut options: haulage::engine::backup::BackupOptions,
    progress: &std::sync::Arc<haulage::engine::progress::Progress>,
) -> tokio::task::JoinHandle<
    Result<haulage::engine::backup::BackupOutcome, haulage::engine::EngineError>,
> {
    use haulage::engine::throttle::{ByteRate, Throttle};
    options.read_throttle = Throttle::new(Some(ByteRate(1 << 20)));
    let (repository, progress) = (repo.repository.clone(), progress.clone());
    tokio::spawn(async move {
        haulage::engine::backup::backup(
            &repository,
            options,
            progress,
            tokio_util::sync::CancellationToken::new(),
        )
        .await
    })
}

/// A backup after another starts its progress totals from the parent
/// snapshot's (an ETA at once, and no second stat of every file on the
/// source's storage) and ends with the totals of what it walked. The
/// rewritten file is read through a 1 MiB/s throttle so the backup lasts
/// a few seconds: a scan beside it would have made its first known totals
/// the source's 26 files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_after_another_starts_from_its_parents_totals_and_ends_with_its_own() {
    use std::sync::Arc;

    use haulage::engine::backup::BackupOptions;
    use haulage::engine::progress::Progress;
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    write_small_files(&source, 0..20);
    std::fs::write(source.join("slow.bin"), random_bytes(100, 2 << 20)).unwrap();
    let first = repo.backup(&source).await;
    assert_eq!(first.snapshot.summary.files, 21);

    write_small_files(&source, 20..25);
    std::fs::write(source.join("slow.bin"), random_bytes(101, 2 << 20)).unwrap();
    let progress = Arc::new(Progress::default());
    let running = spawn_slow_backup(&repo, BackupOptions::new(&source), &progress);
    let first_known = loop {
        let now = progress.snapshot();
        if now.totals_known {
            break (now.total_files, now.total_bytes);
        }
        assert!(
            !running.is_finished(),
            "the backup ended before its totals were known"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    };
    let second = running.await.unwrap().expect("second backup");
    assert_eq!(
        first_known,
        (21, first.snapshot.summary.total_bytes),
        "the first totals known are the parent snapshot's"
    );
    let last = progress.snapshot();
    assert_eq!(second.snapshot.summary.files, 26);
    assert_eq!(
        (last.total_files, last.total_bytes),
        (26, second.snapshot.summary.total_bytes),
        "the totals at the end are what the backup walked"
    );
}

/// A first backup scans its source for the progress totals beside its
/// walk, so they are known long before a slow walk ends; with
/// `scan_for_totals` off (nothing shows the progress: `haulage backup
/// --no-progress`) the source is not stat'ed twice and the totals are
/// the walk's, known only once it has read every file. A 2 MiB file read
/// through a 1 MiB/s throttle makes each backup last two seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_backup_scans_for_its_totals_only_when_they_are_shown() {
    use std::sync::Arc;

    use haulage::engine::backup::BackupOptions;
    use haulage::engine::progress::Progress;
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    write_small_files(&source, 0..20);
    std::fs::write(source.join("slow.bin"), random_bytes(100, 2 << 20)).unwrap();
    for scan_for_totals in [true, false] {
        let progress = Arc::new(Progress::default());
        let mut options = BackupOptions::new(&source);
        options.parent = ParentPolicy::None;
        options.scan_for_totals = scan_for_totals;
        let running = spawn_slow_backup(&repo, options, &progress);
        let mut known_before_the_walk_ended = false;
        while !running.is_finished() {
            let now = progress.snapshot();
            known_before_the_walk_ended |= now.totals_known && now.files_done < 21;
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        let outcome = running.await.unwrap().expect("backup");
        assert_eq!(
            known_before_the_walk_ended, scan_for_totals,
            "totals known before the walk ended, with scan_for_totals {scan_for_totals}"
        );
        let last = progress.snapshot();
        assert_eq!(
            (last.totals_known, last.total_files, last.total_bytes),
            (true, 21, outcome.snapshot.summary.total_bytes),
            "the totals at the end are what the backup walked"
        );
    }
}

/// A backup limited to some files (what `haulage bench` samples) stores
/// those files and the directories on their way, and nothing else: the
/// restore holds exactly them, byte-identical.
#[tokio::test]
async fn a_backup_of_a_selection_stores_only_the_selected_files_and_their_directories() {
    use haulage::engine::backup::{BackupOptions, Selection};
    let repo = TestRepo::new().await;
    let source = tempfile::tempdir().expect("temp dir");
    for directory in ["a/b", "a/c", "d"] {
        std::fs::create_dir_all(source.path().join(directory)).expect("mkdir");
    }
    for (index, file) in ["a/b/one", "a/b/two", "a/c/three", "d/four", "five"]
        .iter()
        .enumerate()
    {
        std::fs::write(
            source.path().join(file),
            random_bytes(index as u64, 3000 + index * 1000),
        )
        .expect("write");
    }
    std::os::unix::fs::symlink("five", source.path().join("link")).expect("symlink");
    let selected = ["a/b/two", "five"].map(PathBuf::from);
    let mut options = BackupOptions::new(source.path());
    options.only = Some(std::sync::Arc::new(Selection::of_files(selected.clone())));
    let outcome = repo.backup_with_options(options).await;
    let target = tempfile::tempdir().expect("temp dir");
    let restored = target.path().join("restored");
    repo.restore(&outcome.snapshot_id, &restored).await;
    let restored_entries = fingerprint(&restored);
    let paths: Vec<&[u8]> = restored_entries.keys().map(Vec::as_slice).collect();
    assert_eq!(
        paths,
        ["a", "a/b", "a/b/two", "five"].map(str::as_bytes).to_vec()
    );
    let source_entries = fingerprint(source.path());
    for file in selected {
        let key = file.as_os_str().as_bytes();
        assert_eq!(
            restored_entries[key].content,
            source_entries[key].content,
            "{}",
            file.display()
        );
    }
}
