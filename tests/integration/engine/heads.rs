//! A backup finds its parent, the newest snapshot of its source, by the
//! source's head (docs/format.md, "Heads"): one listing and one snapshot
//! read, however many snapshots of other sources the repository holds;
//! a head whose snapshot is gone sends it back to reading every snapshot,
//! and its own head replaces the ones it found.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use haulage::engine::backup::{BackupOptions, ParentPolicy, backup};
use haulage::engine::progress::Progress;
use haulage::engine::{KeySource, Repository};
use haulage::repo::ObjectId;
use haulage::store::DynStore;
use haulage::store::local::LocalStore;
use tokio_util::sync::CancellationToken;

use super::support::{TEST_PASSWORD, TestRepo, counting_store};

const HOSTNAME: &str = "stage-pod";

/// Back up `source` as `label` into `repository`; the snapshot's id and
/// its parent.
async fn back_up(
    repository: &Repository,
    source: &Path,
    label: &str,
) -> (ObjectId, Option<ObjectId>, u64) {
    let mut options = BackupOptions::new(source);
    options.source_label = Some(label.to_string());
    options.hostname = HOSTNAME.to_string();
    options.parent = ParentPolicy::LatestForSource;
    let outcome = backup(
        repository,
        options,
        Arc::new(Progress::default()),
        CancellationToken::new(),
    )
    .await
    .unwrap_or_else(|error| panic!("backup of {label}: {error}"));
    (
        outcome.snapshot_id,
        outcome.snapshot.parent,
        outcome.snapshot.summary.files_unchanged,
    )
}

/// The snapshot ids the heads of the repository at `root` name, of every
/// source.
fn heads(root: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for group in std::fs::read_dir(root.join("heads")).into_iter().flatten() {
        for head in std::fs::read_dir(group.unwrap().path()).unwrap() {
            names.push(head.unwrap().file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    names
}

fn source_with_files(repo: &TestRepo) -> PathBuf {
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    for index in 0..5 {
        std::fs::write(source.join(format!("f{index}")), format!("file {index}")).unwrap();
    }
    source
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_reads_one_snapshot_for_its_parent_among_many_of_other_sources() {
    let repo = TestRepo::new().await;
    let source = source_with_files(&repo);
    for other in 0..30 {
        back_up(&repo.repository, &source, &format!("ns/other-{other}")).await;
    }
    let (first, _, _) = back_up(&repo.repository, &source, "ns/claim").await;
    assert_eq!(heads(&repo.root()).len(), 31, "one head per source");

    let counted = counting_store(Arc::new(LocalStore::new(repo.root())) as DynStore);
    let repository = Repository::open(counted.clone(), &KeySource::password(TEST_PASSWORD))
        .await
        .unwrap();
    counted.layer().take_reads();
    let (second, parent, unchanged) = back_up(&repository, &source, "ns/claim").await;
    assert_eq!(parent, Some(first), "the newest snapshot of the source");
    assert_eq!(unchanged, 5, "the parent spared reading the files");
    let snapshot_reads: Vec<String> = counted
        .layer()
        .take_reads()
        .into_iter()
        .map(|read| read.key)
        .filter(|key| key.starts_with("snapshots/"))
        .collect();
    assert_eq!(
        snapshot_reads,
        vec![haulage::repo::snapshot_key(&first)],
        "the parent found by its head, not by reading the 31 snapshots"
    );
    let all = heads(&repo.root());
    assert!(
        all.contains(&second.to_hex()) && !all.contains(&first.to_hex()),
        "the second snapshot's head replaced the first's: {all:?}"
    );
    assert_eq!(all.len(), 31, "still one head per source");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_whose_snapshot_is_gone_sends_the_backup_to_every_snapshot_and_is_replaced() {
    let repo = TestRepo::new().await;
    let source = source_with_files(&repo);
    let root = repo.root();
    let (first, _, _) = back_up(&repo.repository, &source, "ns/claim").await;
    let (second, parent, _) = back_up(&repo.repository, &source, "ns/claim").await;
    assert_eq!(parent, Some(first));
    back_up(&repo.repository, &source, "ns/other").await;

    // Two heads of one source (two backups of it that ran at once): the
    // newer is the parent.
    let group = std::fs::read_dir(root.join("heads"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|group| group.join(second.to_hex()).exists())
        .expect("the source's heads");
    std::fs::write(group.join(first.to_hex()), b"").unwrap();
    let (third, parent, _) = back_up(&repo.repository, &source, "ns/claim").await;
    assert_eq!(parent, Some(second), "the newer of two heads");
    assert_eq!(
        std::fs::read_dir(&group).unwrap().count(),
        1,
        "the new head replaced both"
    );

    // The head's snapshot forgotten: the newest one left is found among
    // every snapshot, and the stale head goes.
    std::fs::remove_file(root.join(haulage::repo::snapshot_key(&third))).unwrap();
    let (fourth, parent, unchanged) = back_up(&repo.repository, &source, "ns/claim").await;
    assert_eq!(
        parent,
        Some(second),
        "the newest snapshot left of the source"
    );
    assert_eq!(unchanged, 5);
    let names: Vec<String> = std::fs::read_dir(&group)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![fourth.to_hex()], "only the new head is left");

    // A repository written before heads: the parent still found.
    std::fs::remove_dir_all(root.join("heads")).unwrap();
    let (_, parent, _) = back_up(&repo.repository, &source, "ns/claim").await;
    assert_eq!(parent, Some(fourth));
}
