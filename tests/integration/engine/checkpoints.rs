//! A checkpoint names only what is stored: every blob its trees name (data
//! and trees) is in a pack some index file named when its manifest was
//! written. Checkpoints written as often as the engine can, over many small
//! files whose contents repeat across the jobs that hash them in parallel,
//! so a file is often assembled naming a chunk a later, not yet assembled
//! file stores.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use haulage::engine::backup::{BackupOptions, backup};
use haulage::engine::progress::Progress;
use haulage::engine::{KeySource, Repository};
use haulage::repo::BlobId;
use haulage::repo::tree::Extent;
use haulage::store::DynStore;
use haulage::store::layer::{Layer, Layered, Request};
use haulage::store::local::LocalStore;
use tokio_util::sync::CancellationToken;

use super::support::{TEST_PASSWORD, TestRepo, random_bytes};

/// Watches a local repository's checkpoints: when one is written, which
/// index files exist; when one is deleted, its bytes.
#[derive(Debug)]
struct CheckpointWatch {
    root: PathBuf,
    indexes_at_write: Mutex<BTreeMap<String, Vec<PathBuf>>>,
    deleted: Mutex<BTreeMap<String, Vec<u8>>>,
}

#[async_trait::async_trait]
impl Layer for CheckpointWatch {
    type Held = ();

    async fn before(&self, request: Request<'_>) {
        match request {
            Request::Put { key, .. } if key.starts_with("checkpoints/") => {
                let indexes = std::fs::read_dir(self.root.join("index"))
                    .map(|entries| {
                        entries
                            .flatten()
                            .map(|entry| entry.path())
                            .filter(|path| {
                                !path
                                    .file_name()
                                    .unwrap()
                                    .to_string_lossy()
                                    .starts_with(".tmp")
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                self.indexes_at_write
                    .lock()
                    .unwrap()
                    .insert(key.to_string(), indexes);
            }
            Request::Delete { key } if key.starts_with("checkpoints/") => {
                if let Ok(bytes) = std::fs::read(self.root.join(key)) {
                    self.deleted.lock().unwrap().insert(key.to_string(), bytes);
                }
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_names_only_blobs_stored_and_indexed_before_it() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    // 960 files of 12 KiB, 24 contents each repeated 40 times (each file
    // many times its entry in the tree, so every item is worth a
    // checkpoint).
    for index in 0..960u64 {
        std::fs::write(
            source.join(format!("f{index:04}")),
            random_bytes(index % 24, 12 * 1024),
        )
        .unwrap();
    }
    let watch = Arc::new(Layered::wrap(
        Arc::new(LocalStore::new(repo.root())) as DynStore,
        CheckpointWatch {
            root: repo.root(),
            indexes_at_write: Mutex::default(),
            deleted: Mutex::default(),
        },
    ));
    let repository = Repository::open(watch.clone(), &KeySource::password(TEST_PASSWORD))
        .await
        .unwrap();
    let mut options = BackupOptions::new(&source);
    options.checkpoint_every = Some(Duration::ZERO);
    backup(
        &repository,
        options,
        Arc::new(Progress::default()),
        CancellationToken::new(),
    )
    .await
    .expect("backup");

    let index = repository.load_index().await.unwrap().index;
    let written = watch.layer().indexes_at_write.lock().unwrap().clone();
    let deleted = watch.layer().deleted.lock().unwrap().clone();
    assert!(
        deleted.len() >= 10,
        "only {} checkpoints were written and deleted",
        deleted.len()
    );
    let mut checked = 0;
    // Index files are never rewritten: each is read once.
    let mut named: BTreeMap<PathBuf, Vec<BlobId>> = BTreeMap::new();
    for (key, bytes) in &deleted {
        let Some(index_files) = written.get(key) else {
            continue;
        };
        let mut stored: HashSet<BlobId> = HashSet::new();
        for path in index_files {
            let ids = named.entry(path.clone()).or_insert_with(|| {
                let bytes = std::fs::read(path).unwrap();
                let file = repository
                    .codec()
                    .decode_index(&bytes, &path.display().to_string())
                    .unwrap();
                file.packs
                    .into_iter()
                    .flat_map(|(_, entries)| entries.into_iter().map(|entry| entry.id))
                    .collect()
            });
            stored.extend(ids.iter().copied());
        }
        let checkpoint = repository.codec().decode_snapshot(bytes).unwrap();
        let mut trees = vec![checkpoint.tree];
        while let Some(id) = trees.pop() {
            assert!(
                stored.contains(&id),
                "{key} names tree {id:?}, not stored before it"
            );
            let tree = repository.load_tree(&index, &id).await.unwrap();
            for entry in tree.entries {
                trees.extend(entry.subtree);
                for extent in &entry.content {
                    if let Extent::Chunk(chunk, _) = extent {
                        assert!(
                            stored.contains(chunk),
                            "{key} names a chunk of {} that was not stored before it",
                            String::from_utf8_lossy(&entry.name)
                        );
                    }
                }
            }
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} checkpoints checked");
}

/// Deletes each checkpoint just before it is read, as a running backup
/// replacing its checkpoint between a prune's listing and its read does.
#[derive(Debug)]
struct CheckpointReplacedAfterListing {
    root: PathBuf,
}

#[async_trait::async_trait]
impl Layer for CheckpointReplacedAfterListing {
    type Held = ();

    async fn before(&self, request: Request<'_>) {
        if let Request::Get { key, .. } = request
            && key.starts_with("checkpoints/")
        {
            let _ = std::fs::remove_file(self.root.join(key));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_passes_over_a_checkpoint_replaced_after_its_listing() {
    use haulage::engine::prune::{PruneOptions, prune};
    use haulage::repo::prune::PruneSettings;

    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("a"), random_bytes(1, 64 * 1024)).unwrap();
    let outcome = repo.backup(&source).await;
    // A checkpoint of a backup of another source, as a running one writes.
    let mut checkpoint = outcome.snapshot.clone();
    checkpoint.source = "ns/elsewhere".into();
    repo.repository.write_checkpoint(&checkpoint).await.unwrap();

    let layered = Arc::new(Layered::wrap(
        Arc::new(LocalStore::new(repo.root())) as DynStore,
        CheckpointReplacedAfterListing { root: repo.root() },
    ));
    let repository = Repository::open(layered, &KeySource::password(TEST_PASSWORD))
        .await
        .unwrap();
    let options = PruneOptions {
        settings: PruneSettings {
            repack_threshold: 0.1,
            safety_margin_seconds: 0,
            checkpoint_max_age_seconds: 3600,
        },
        dry_run: false,
        lock_wait: Duration::from_secs(5),
    };
    let report = prune(&repository, &options, &CancellationToken::new())
        .await
        .expect("a checkpoint gone since the listing does not stop prune");
    assert_eq!(report.checkpoints_kept, 0, "{report:?}");
    assert_eq!(report.snapshots, 1);
    repo.assert_cli_verifies();
}
