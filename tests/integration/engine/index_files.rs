//! Index files: a writer splits what it indexes so that no index file holds
//! more than `MAX_BLOBS_PER_INDEX_FILE` blobs, and a load finds every blob
//! of every file.

use super::support::haulage;
use haulage::repo::index::{IndexFile, MAX_BLOBS_PER_INDEX_FILE};
use haulage::repo::pack::PackEntry;
use haulage::repo::{BlobId, BlobKind, Compression, ObjectId};

use std::sync::Arc;

use haulage::engine::{KeySource, Repository};
use haulage::store::DynStore;
use haulage::store::local::LocalStore;

use super::support::{TEST_PASSWORD, TestRepo, counting_store, random_bytes};
use crate::support::expect_success;

/// A pack numbered `number` listing `blobs` blobs, each with an id of its
/// own.
fn pack(number: u8, blobs: u32) -> (ObjectId, Vec<PackEntry>) {
    let entries = (0..blobs)
        .map(|k| {
            let mut id = [number; 32];
            id[..4].copy_from_slice(&k.wrapping_mul(2_654_435_761).to_be_bytes());
            id[4..8].copy_from_slice(&k.to_le_bytes());
            PackEntry {
                id: BlobId(id),
                kind: BlobKind::Data,
                compression: Compression::Zstd,
                offset: 8 + k * 100,
                stored_length: 100,
                raw_length: 300,
            }
        })
        .collect();
    (ObjectId([number; 32]), entries)
}

#[tokio::test]
async fn index_files_hold_at_most_65536_blobs_each_and_a_load_finds_every_blob() {
    assert_eq!(MAX_BLOBS_PER_INDEX_FILE, 65_536);
    let repo = TestRepo::plaintext().await;
    // Two packs that share a file, one that would pass the bound with
    // them, and one larger than the bound, alone in its file.
    let packs = vec![
        pack(1, 30_000),
        pack(2, 30_000),
        pack(3, 30_000),
        pack(4, 70_000),
    ];
    let written = repo
        .repository
        .write_index(packs.clone())
        .await
        .expect("index written");
    assert_eq!(written.len(), 3, "index files written: {written:?}");

    let mut blobs_per_file = Vec::new();
    for entry in std::fs::read_dir(repo.root().join("index")).expect("index files") {
        let path = entry.expect("entry").path();
        let bytes = std::fs::read(&path).expect("index file");
        let file = IndexFile::decode(&bytes, &path.display().to_string()).expect("decodes");
        blobs_per_file.push(
            file.packs
                .iter()
                .map(|(_, entries)| entries.len())
                .sum::<usize>(),
        );
    }
    blobs_per_file.sort_unstable();
    assert_eq!(blobs_per_file, [30_000, 60_000, 70_000]);

    let loaded = repo.reopen().await.load_index().await.expect("loads");
    assert_eq!(loaded.index.len(), 160_000);
    for (pack, entries) in &packs {
        for entry in entries.iter().step_by(97) {
            let location = loaded.index.get(&entry.id).expect("every blob found");
            assert_eq!(loaded.index.pack_of(location), *pack);
            assert_eq!(location.offset, entry.offset);
        }
    }
}

/// Every backup writes index files of its own; prune gathers the many small
/// files of a location that many backups wrote into as few as the index
/// needs, loses no blob, and leaves them alone the next time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_gathers_the_index_files_of_many_backups_into_as_few_as_needed() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    for round in 0..40u64 {
        std::fs::write(source.join(format!("f{round}")), random_bytes(round, 4096)).unwrap();
        repo.backup(&source).await;
    }
    let index_dir = repo.root().join("index");
    let index_files = || std::fs::read_dir(&index_dir).unwrap().count();
    let written = index_files();
    assert!(written >= 40, "{written} index files after 40 backups");
    let blobs = repo.repository.load_index().await.unwrap().index.len();

    let prune = |dry_run: bool| {
        let mut command = haulage();
        command.args(["prune", "--repo", &repo.url()]);
        if dry_run {
            command.arg("--dry-run");
        }
        let output = command.output().expect("run haulage prune");
        expect_success(&output, "haulage prune");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let planned = prune(true);
    assert!(
        planned.contains(&format!("would gather {written} index files into 1")),
        "{planned}"
    );
    assert_eq!(index_files(), written, "a dry run writes nothing");

    let pruned = prune(false);
    assert!(
        pruned.contains(&format!("gathered {written} index files into 1")),
        "{pruned}"
    );
    assert_eq!(index_files(), 1);
    let reopened = Repository::open(
        Arc::new(LocalStore::new(repo.root())) as DynStore,
        &KeySource::password(TEST_PASSWORD),
    )
    .await
    .unwrap();
    assert_eq!(
        reopened.load_index().await.unwrap().index.len(),
        blobs,
        "every blob still indexed"
    );
    repo.assert_cli_verifies();

    let again = prune(false);
    assert!(!again.contains("gather"), "{again}");
    assert_eq!(index_files(), 1);
}

/// The memory a stage pod plans for the index every agent loads is
/// counted from the bytes of the index files alone
/// (`api::transfer::index_memory_bytes`), and must not count less than the
/// loaded index holds, whatever the files are like: here 6,000 small files
/// all of one length (whose records compress best: only the ids are left),
/// then files of many lengths and a large one cut into chunks.
#[tokio::test]
async fn the_index_memory_counted_from_its_files_is_never_less_than_the_loaded_index() {
    use haulage::api::transfer::index_memory_bytes;
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    let alike = source.join("alike");
    std::fs::create_dir_all(&alike).unwrap();
    for file in 0..6_000u64 {
        std::fs::write(alike.join(format!("f{file}")), random_bytes(file, 4096)).unwrap();
    }
    let check = |stage: &'static str| {
        let repo = &repo;
        async move {
            let file_bytes = repo.repository.index_file_bytes().await.unwrap();
            let listed: u64 = std::fs::read_dir(repo.root().join("index"))
                .unwrap()
                .map(|entry| entry.unwrap().metadata().unwrap().len())
                .sum();
            assert_eq!(file_bytes, listed, "{stage}: the listing's bytes");
            let loaded = repo.repository.load_index().await.unwrap();
            let held = loaded.index.memory_bytes() as u64;
            let counted = index_memory_bytes(file_bytes);
            println!(
                "{stage}: {} blobs, {file_bytes} bytes of index files, {held} bytes held, {counted} counted",
                loaded.index.len()
            );
            assert!(
                counted >= held,
                "{stage}: {counted} bytes counted for an index holding {held}"
            );
            assert!(
                counted <= 2 * held,
                "{stage}: {counted} bytes counted for an index holding {held}: too far above"
            );
        }
    };
    repo.backup(&source).await;
    check("6,000 files of 4 KiB").await;
    let varied = source.join("varied");
    std::fs::create_dir_all(&varied).unwrap();
    for file in 0..3_000u64 {
        let length = 256 + (file as usize * 7_919) % 3_840;
        std::fs::write(
            varied.join(format!("f{file}")),
            random_bytes(10_000 + file, length),
        )
        .unwrap();
    }
    std::fs::write(source.join("large"), random_bytes(99, 24 << 20)).unwrap();
    repo.backup(&source).await;
    check("then 3,000 of 256 bytes to 4 KiB and one of 24 MiB").await;
}

/// Prune's second phase, under the exclusive lock, reads only what was
/// written since its first phase listed: every index file, snapshot and
/// pack of trees is read once in a prune that gathers the index files of
/// 40 backups and deletes a forgotten one's pack (before, each was read
/// once a phase), and every snapshot left still verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_reads_each_index_file_snapshot_and_tree_pack_once() {
    use haulage::engine::prune::{PruneOptions, prune};
    use haulage::repo::prune::PruneSettings;
    use tokio_util::sync::CancellationToken;

    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let mut snapshots = Vec::new();
    for round in 0..40u64 {
        std::fs::write(
            source.join(format!("f{round}")),
            random_bytes(round, 64 << 10),
        )
        .unwrap();
        snapshots.push(repo.backup(&source).await.snapshot_id);
    }
    // The last file's only snapshot is forgotten: its pack is no one's.
    std::fs::remove_file(source.join("f39")).unwrap();
    let forgotten = snapshots.pop().unwrap();
    std::fs::remove_file(repo.root().join("snapshots").join(forgotten.to_hex())).unwrap();

    let counted = counting_store(Arc::new(LocalStore::new(repo.root())) as DynStore);
    let repository = Repository::open(
        counted.clone() as DynStore,
        &KeySource::password(TEST_PASSWORD),
    )
    .await
    .unwrap();
    counted.layer().take_reads();
    let report = prune(
        &repository,
        &PruneOptions {
            settings: PruneSettings {
                repack_threshold: 0.1,
                safety_margin_seconds: 0,
                checkpoint_max_age_seconds: 3600,
            },
            dry_run: false,
            lock_wait: std::time::Duration::from_secs(5),
        },
        &CancellationToken::new(),
    )
    .await
    .expect("prune");
    assert!(report.deleted_packs >= 1, "{report:?}");
    assert_eq!(report.index_files_written, 1, "{report:?}");
    let reads = counted.layer().take_reads();
    let mut times_read: std::collections::BTreeMap<&str, usize> = Default::default();
    for read in &reads {
        *times_read.entry(read.key.as_str()).or_default() += 1;
    }
    let read_twice: Vec<_> = times_read
        .iter()
        .filter(|(key, times)| {
            **times > 1
                && (key.starts_with("index/")
                    || key.starts_with("snapshots/")
                    || key.starts_with("data/"))
        })
        .collect();
    assert!(
        read_twice.is_empty(),
        "read more than once by one prune: {read_twice:?}"
    );
    for prefix in ["index/", "snapshots/"] {
        let read = times_read
            .keys()
            .filter(|key| key.starts_with(prefix))
            .count();
        assert!(read >= 39, "{read} objects under {prefix} read");
    }
    assert_eq!(snapshots.len(), 39);
    repo.assert_cli_verifies();
}
