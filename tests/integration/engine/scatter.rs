//! Restore reads each pack once and scatters its blobs to every file that
//! needs them: counted through a wrapper over the real local store, with
//! shared and repeated chunks, hard links, sparse files, damaged and
//! missing data, sync mode and snapshots larger than one batch.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use haulage::engine::Repository;
use haulage::engine::restore::{RestoreOptions, RestoreOutcome, restore};
use haulage::repo::index::BlobIndex;
use haulage::repo::tree::{EntryKind, Extent};
use haulage::repo::{BlobId, ObjectId};
use haulage::store::layer::{Layer, Layered};
use haulage::store::local::LocalStore;
use haulage::store::{DynStore, ObjectMeta, ObjectStore, PutMode, StoreError};

use super::support::{
    CountingStore, ReadLog, TestRepo, assert_same_tree, data_reads_per_pack, pack_entries,
    packs_with_data, random_bytes, tree_reads, trees_only, write_sparse_file,
};

/// The repository of `repo`, opened again through a [`CountingStore`].
async fn counted(repo: &TestRepo) -> (Arc<CountingStore>, Repository) {
    open_through(local_store(repo), ReadLog::default()).await
}

/// The store of `repo`, a directory.
fn local_store(repo: &TestRepo) -> DynStore {
    Arc::new(LocalStore::new(repo.root()))
}

/// The repository in `store`, opened through `layer`.
async fn open_through<L: Layer + 'static>(
    store: DynStore,
    layer: L,
) -> (Arc<Layered<L>>, Repository) {
    let layered = Arc::new(Layered::wrap(store, layer));
    let repository = Repository::open(
        layered.clone(),
        &haulage::engine::KeySource::password(super::support::TEST_PASSWORD),
    )
    .await
    .expect("open");
    (layered, repository)
}

async fn restore_with(
    repository: &Repository,
    snapshot: &ObjectId,
    options: RestoreOptions,
) -> RestoreOutcome {
    restore(
        repository,
        snapshot,
        options,
        Default::default(),
        Default::default(),
    )
    .await
    .expect("restore")
}

/// Restore by `options` and check that it reported no problem and that
/// its target holds the same tree as `source`.
async fn restore_intact(
    repository: &Repository,
    snapshot: &ObjectId,
    options: RestoreOptions,
    source: &Path,
) -> RestoreOutcome {
    let target = options.target.clone();
    let outcome = restore_with(repository, snapshot, options).await;
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_same_tree(source, &target);
    outcome
}

/// Every regular file of a snapshot (relative path) with its chunks.
async fn files_of(
    repository: &Repository,
    index: &BlobIndex,
    snapshot: &ObjectId,
) -> BTreeMap<String, Vec<BlobId>> {
    let snapshot = repository.load_snapshot(snapshot).await.expect("snapshot");
    let mut files = BTreeMap::new();
    let mut pending = vec![(String::new(), snapshot.tree)];
    while let Some((prefix, tree)) = pending.pop() {
        let tree = repository.load_tree(index, &tree).await.expect("tree");
        for entry in tree.entries {
            let path = format!("{prefix}{}", String::from_utf8_lossy(&entry.name));
            match entry.kind {
                EntryKind::Directory => {
                    pending.push((format!("{path}/"), entry.subtree.expect("subtree")))
                }
                EntryKind::File => {
                    let chunks = entry
                        .content
                        .iter()
                        .filter_map(|extent| match extent {
                            Extent::Chunk(id, _) => Some(*id),
                            Extent::Hole(_) => None,
                        })
                        .collect();
                    files.insert(path, chunks);
                }
                _ => {}
            }
        }
    }
    files
}

/// A tree of the shapes a scatter must get right: many small files, large
/// files over several packs, 40 copies of one file (chunks shared by many
/// files), a file repeating one block (a chunk at several offsets of one
/// file), hard links and a sparse file.
fn write_shared_chunk_tree(source: &Path) {
    haulage::sample::generate(&source.join("sample"), 40 << 20, 21).expect("sample");
    std::fs::write(source.join("random.bin"), random_bytes(4, 24 << 20)).expect("random");
    let shared = random_bytes(5, 3 << 20);
    std::fs::create_dir_all(source.join("copies")).expect("mkdir");
    for copy in 0..40 {
        std::fs::write(source.join(format!("copies/copy-{copy:02}.bin")), &shared).expect("copy");
    }
    let block = random_bytes(6, 3 << 20);
    std::fs::write(source.join("repeated.bin"), block.repeat(5)).expect("repeated");
    std::fs::write(source.join("copies/linked"), random_bytes(8, 70_000)).expect("linked");
    std::fs::hard_link(source.join("copies/linked"), source.join("also-linked")).expect("link");
    write_sparse_file(
        &source.join("sparse.img"),
        256 << 20,
        &random_bytes(9, 100_000),
        100 << 20,
    )
    .expect("sparse file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_reads_each_pack_once_however_many_files_and_offsets_share_its_blobs() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    write_shared_chunk_tree(&source);
    let backup = repo.backup(&source).await;
    assert!(repo.pack_count() >= 3, "{} packs", repo.pack_count());

    let (counter, repository) = counted(&repo).await;
    let packs = pack_entries(&repository).await;
    counter.layer().take_reads();
    let target = repo.dir.path().join("restored");
    restore_intact(
        &repository,
        &backup.snapshot_id,
        RestoreOptions::new(&target),
        &source,
    )
    .await;
    let restored_sparse = std::fs::metadata(target.join("sparse.img")).expect("sparse");
    assert!(
        restored_sparse.blocks() * 512 < 4 << 20,
        "sparse file restored dense"
    );
    assert_eq!(
        std::fs::metadata(target.join("also-linked"))
            .expect("link")
            .ino(),
        std::fs::metadata(target.join("copies/linked"))
            .expect("linked")
            .ino()
    );

    let reads = counter.layer().take_reads();
    let per_pack = data_reads_per_pack(&reads, &packs);
    assert_eq!(
        per_pack.len(),
        packs_with_data(&packs),
        "every data pack holds data of the tree"
    );
    for (pack, (count, bytes)) in &per_pack {
        assert_eq!(
            *count, 1,
            "pack {pack} was read {count} times ({bytes} bytes) for one restore"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_chunk_shared_by_many_files_removes_exactly_those_files() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(source.join("copies")).expect("mkdir");
    let shared = random_bytes(11, 600_000);
    for copy in 0..25 {
        std::fs::write(source.join(format!("copies/copy-{copy:02}")), &shared).expect("copy");
    }
    for other in 0..25 {
        std::fs::write(
            source.join(format!("other-{other:02}")),
            random_bytes(100 + other, 50_000),
        )
        .expect("other");
    }
    let backup = repo.backup(&source).await;

    let loaded = repo.repository.load_index().await.expect("index");
    let files = files_of(&repo.repository, &loaded.index, &backup.snapshot_id).await;
    let victim = files["copies/copy-00"][0];
    let location = *loaded.index.get(&victim).expect("located");
    let pack = loaded.index.pack_of(&location);
    let pack_path = repo.root().join(haulage::repo::pack_key(&pack));
    let mut bytes = std::fs::read(&pack_path).expect("pack");
    bytes[location.offset as usize + location.stored_length as usize / 2] ^= 0x40;
    std::fs::write(&pack_path, bytes).expect("damage");

    let target = repo.dir.path().join("restored");
    let (outcome, failed) = restore_with_failures(&repo, &backup.snapshot_id, &target).await;
    let expected: BTreeSet<String> = files
        .iter()
        .filter(|(_, chunks)| chunks.contains(&victim))
        .map(|(path, _)| path.clone())
        .collect();
    assert_eq!(expected.len(), 25, "the chunk is shared by every copy");
    assert_eq!(failed, expected, "{:?}", outcome.problems);
    for problem in &outcome.problems {
        assert!(
            problem.message.contains("damaged") && problem.message.contains(&victim.to_string()),
            "{problem:?}"
        );
        assert!(
            !target.join(&problem.path).exists(),
            "{} was left behind",
            problem.path
        );
    }
    for other in 0..25u64 {
        assert_eq!(
            std::fs::read(target.join(format!("other-{other:02}"))).expect("restored"),
            random_bytes(100 + other, 50_000)
        );
    }
    assert_eq!(outcome.files, 25);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_pack_fails_only_the_files_with_chunks_in_it() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).expect("mkdir");
    for file in 0..4u64 {
        std::fs::write(
            source.join(format!("volume-{file}.img")),
            random_bytes(200 + file, 12 << 20),
        )
        .expect("write");
    }
    let backup = repo.backup(&source).await;
    let loaded = repo.repository.load_index().await.expect("index");
    let files = files_of(&repo.repository, &loaded.index, &backup.snapshot_id).await;
    let packs = pack_entries(&repo.repository).await;
    // A pack of data only (the tree is in the last one written).
    let (lost, _) = packs
        .iter()
        .find(|(_, entries)| {
            entries
                .iter()
                .all(|entry| entry.kind == haulage::repo::BlobKind::Data)
        })
        .expect("a pack without trees");
    std::fs::remove_file(repo.root().join(haulage::repo::pack_key(lost))).expect("remove pack");
    let expected: BTreeSet<String> = files
        .iter()
        .filter(|(_, chunks)| {
            chunks.iter().any(|chunk| {
                loaded
                    .index
                    .pack_of(loaded.index.get(chunk).expect("known"))
                    == *lost
            })
        })
        .map(|(path, _)| path.clone())
        .collect();
    assert!(!expected.is_empty() && expected.len() < files.len());

    let target = repo.dir.path().join("restored");
    let (outcome, failed) = restore_with_failures(&repo, &backup.snapshot_id, &target).await;
    assert_eq!(failed, expected, "{:?}", outcome.problems);
    for problem in &outcome.problems {
        assert!(
            problem.message.contains("could not be read")
                && problem.message.contains(&lost.to_string()),
            "{problem:?}"
        );
        assert!(!target.join(&problem.path).exists());
    }
    for file in 0..4u64 {
        let name = format!("volume-{file}.img");
        if !expected.contains(&name) {
            assert_eq!(
                std::fs::read(target.join(&name)).expect("restored"),
                random_bytes(200 + file, 12 << 20)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subtrees_of_a_directory_are_loaded_in_one_read_however_much_data_lies_between_them() {
    // 24 directories, each with more data than the read-through gap: with
    // the trees in the data packs, each tree sat after its directory's
    // files and took a read of its own (25 tree reads here).
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    for directory in 0..24u64 {
        let path = source.join(format!("d{directory:02}"));
        std::fs::create_dir_all(&path).expect("mkdir");
        std::fs::write(path.join("data.bin"), random_bytes(directory, 1_300_000)).expect("file");
    }
    let backup = repo.backup(&source).await;
    let (counter, repository) = counted(&repo).await;
    let packs = pack_entries(&repository).await;
    let tree_packs = packs.len() - packs_with_data(&packs);
    assert_eq!(tree_packs, 1, "the trees have a pack of their own");
    counter.layer().take_reads();
    let target = repo.dir.path().join("restored");
    restore_intact(
        &repository,
        &backup.snapshot_id,
        RestoreOptions::new(&target),
        &source,
    )
    .await;
    // The root's tree, then its 24 subtrees together.
    assert_eq!(tree_reads(&counter.layer().take_reads(), &packs), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_restore_reads_only_the_chunks_that_differ() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    write_shared_chunk_tree(&source);
    let first = repo.backup(&source).await;
    let target = repo.dir.path().join("restored");
    repo.restore(&first.snapshot_id, &target).await;

    // The target drifts: one copy is overwritten in its middle.
    let mut drifted = std::fs::read(target.join("copies/copy-07.bin")).expect("read");
    drifted[1 << 20] ^= 0xff;
    std::fs::write(target.join("copies/copy-07.bin"), drifted).expect("write");

    let (counter, repository) = counted(&repo).await;
    let packs = pack_entries(&repository).await;
    counter.layer().take_reads();
    let mut options = RestoreOptions::new(&target);
    options.sync = true;
    let outcome = restore_intact(&repository, &first.snapshot_id, options, &source).await;
    assert!(outcome.bytes_written > 0 && outcome.bytes_written <= 4 << 20);
    let per_pack = data_reads_per_pack(&counter.layer().take_reads(), &packs);
    let (reads, bytes) = per_pack
        .values()
        .fold((0, 0), |(reads, bytes), (r, b)| (reads + r, bytes + b));
    // One chunk (at most 4 MiB) and the neighbours read through a gap.
    assert_eq!(reads, 1, "{per_pack:?}");
    assert!(
        bytes <= 6 << 20,
        "read {bytes} bytes of packs for one chunk"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_more_files_than_one_batch_restores_with_links_across_batches() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    // 5,200 files in 130 directories: more than one batch's files (4,096),
    // and more directories than a batch holds under a soft limit of 1,024
    // open files (80).
    for directory in 0..130 {
        let path = source.join(format!("d{directory:03}"));
        std::fs::create_dir_all(&path).expect("mkdir");
        for file in 0..40 {
            std::fs::write(
                path.join(format!("f{file:02}")),
                format!("{directory}/{file}"),
            )
            .expect("write");
        }
    }
    std::fs::hard_link(source.join("d000/f00"), source.join("d129/z-link")).expect("link");
    let backup = repo.backup(&source).await;
    let target = repo.dir.path().join("restored");
    let outcome = repo.restore(&backup.snapshot_id, &target).await;
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_eq!(outcome.files, 5_200);
    assert_same_tree(&source, &target);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_of_many_small_directories_reads_each_data_pack_once() {
    // As the binaries do: a batch holds more than 128 directories only
    // when the open-file limit leaves room for them.
    haulage::engine::descriptors::raise_open_file_limit();
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    // 700 directories of three small files each: one batch's worth of
    // files, and far more directories than the 128 a batch held whatever
    // the limit, which cut it into six batches reading the same packs.
    for directory in 0..700u64 {
        let path = source.join(format!("d{:02}/d{directory:03}", directory % 10));
        std::fs::create_dir_all(&path).expect("mkdir");
        for file in 0..3u64 {
            let seed = directory * 3 + file;
            std::fs::write(
                path.join(format!("f{file}")),
                random_bytes(seed, 4_096 + (seed as usize * 131) % 8_192),
            )
            .expect("write");
        }
    }
    let backup = repo.backup(&source).await;
    let (packs, outcome, per_pack) =
        restore_counting_data_pack_reads(&repo, &backup.snapshot_id, &source).await;
    assert!(packs >= 2, "{packs} packs of data");
    assert_eq!(outcome.files, 2_100);
    for (pack, (count, bytes)) in &per_pack {
        assert_eq!(
            *count, 1,
            "pack {pack} was read {count} times ({bytes} bytes): the directories were cut into \
             batches each reading it again"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pack_whose_files_span_three_batches_is_read_in_one_request() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    // 9,000 files of 1-1.5 KiB of random bytes: three batches of files
    // (4,096 each at most), about 11 MiB stored, so one data pack of the
    // default size holds the files of all three, and each batch alone
    // would read its own range of it.
    for directory in 0..30u64 {
        let path = source.join(format!("d{directory:02}"));
        std::fs::create_dir_all(&path).expect("mkdir");
        for file in 0..300u64 {
            let seed = directory * 300 + file;
            std::fs::write(
                path.join(format!("f{file:03}")),
                random_bytes(seed, 1_024 + (seed as usize * 37) % 512),
            )
            .expect("write");
        }
    }
    let backup = repo.backup(&source).await;
    let (_, outcome, per_pack) =
        restore_counting_data_pack_reads(&repo, &backup.snapshot_id, &source).await;
    assert_eq!(outcome.files, 9_000);
    for (pack, (count, bytes)) in &per_pack {
        assert_eq!(
            *count, 1,
            "pack {pack} was read in {count} requests ({bytes} bytes): each batch read its own \
             range of it"
        );
    }
}

/// Restore `snapshot` of `source` intact through a [`CountingStore`]: the
/// repository's packs holding data, the outcome, and for each of those
/// packs (every one is read) the requests that read it and their bytes.
async fn restore_counting_data_pack_reads(
    repo: &TestRepo,
    snapshot: &ObjectId,
    source: &Path,
) -> (usize, RestoreOutcome, BTreeMap<ObjectId, (usize, u64)>) {
    let (counter, repository) = counted(repo).await;
    let packs = pack_entries(&repository).await;
    counter.layer().take_reads();
    let target = repo.dir.path().join("restored");
    let outcome = restore_intact(&repository, snapshot, RestoreOptions::new(&target), source).await;
    let per_pack = data_reads_per_pack(&counter.layer().take_reads(), &packs);
    assert_eq!(per_pack.len(), packs_with_data(&packs));
    (packs_with_data(&packs), outcome, per_pack)
}

/// Restore `snapshot` into `target`: the outcome and the paths that failed.
async fn restore_with_failures(
    repo: &TestRepo,
    snapshot: &ObjectId,
    target: &Path,
) -> (RestoreOutcome, BTreeSet<String>) {
    let outcome = repo.restore(snapshot, target).await;
    let failed = outcome
        .problems
        .iter()
        .map(|problem| problem.path.clone())
        .collect();
    (outcome, failed)
}

/// An engine given the smallest memory share (one of several volumes in a
/// stage pod) stores and restores the same content with smaller buffers:
/// its backup closes data packs before they pass a few MiB where the
/// default share fills them to 16 MiB, and its restore reads a 16 MiB pack
/// in several ranges of at most a few MiB where the default share reads
/// it whole. Identical files either way, and a repository that verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_smallest_memory_share_moves_the_same_data_in_smaller_packs_and_reads() {
    use haulage::engine::backup::{BackupOptions, backup};
    use haulage::engine::memory::EngineMemory;
    const MIB: u64 = 1024 * 1024;
    let source = tempfile::tempdir().expect("source");
    std::fs::write(source.path().join("random.bin"), random_bytes(41, 20 << 20)).expect("write");
    std::fs::create_dir(source.path().join("small")).expect("dir");
    for index in 0..200u64 {
        std::fs::write(
            source.path().join("small").join(format!("{index}.txt")),
            random_bytes(index, 1_000 + index as usize * 37),
        )
        .expect("write");
    }
    let smallest = EngineMemory::new(0);
    let mut largest_packs = Vec::new();
    for memory in [EngineMemory::default(), smallest] {
        let repo = TestRepo::new().await;
        let mut options = BackupOptions::new(source.path());
        options.memory = memory;
        let outcome = backup(
            &repo.repository,
            options,
            Default::default(),
            Default::default(),
        )
        .await
        .expect("backup");
        let largest = super::support::files_under(&repo.root().join("data"))
            .iter()
            .map(|(_, size)| *size)
            .max()
            .expect("packs");
        largest_packs.push((largest, repo.pack_count()));
        let target = tempfile::tempdir().expect("target");
        let mut options = RestoreOptions::new(target.path().join("restored"));
        options.memory = memory;
        repo.restore_with(&outcome.snapshot_id, options).await;
        assert_same_tree(source.path(), &target.path().join("restored"));
        assert!(repo.verify(outcome.snapshot_id).await.problems.is_empty());
    }
    let ((default_largest, default_packs), (small_largest, small_packs)) =
        (largest_packs[0], largest_packs[1]);
    assert!(default_largest > 16 * MIB, "{largest_packs:?}");
    assert!(small_largest < 6 * MIB, "{largest_packs:?}");
    assert!(small_packs > default_packs, "{largest_packs:?}");

    // Both shares restore a backup made with the default share (its 16
    // MiB packs): the default reads each pack whole, the smallest in
    // ranges of a few MiB.
    let repo = TestRepo::new().await;
    let snapshot = repo.backup(source.path()).await.snapshot_id;
    let (counter, repository) = counted(&repo).await;
    let packs = pack_entries(&repository).await;
    for (memory, most_bytes_per_read) in [(EngineMemory::default(), 21 * MIB), (smallest, 6 * MIB)]
    {
        let target = tempfile::tempdir().expect("target");
        let mut options = RestoreOptions::new(target.path().join("restored"));
        options.memory = memory;
        counter.layer().take_reads();
        restore_with(&repository, &snapshot, options).await;
        assert_same_tree(source.path(), &target.path().join("restored"));
        let reads = data_reads_per_pack(&counter.layer().take_reads(), &packs);
        let (requests, bytes): (usize, u64) =
            reads.values().fold((0, 0), |(requests, bytes), (r, b)| {
                (requests + r, bytes + b)
            });
        assert!(
            bytes <= requests as u64 * most_bytes_per_read,
            "{memory:?}: {requests} reads of {bytes} bytes"
        );
        if memory == smallest {
            let longest = reads
                .values()
                .map(|(r, b)| b / *r as u64)
                .max()
                .unwrap_or(0);
            assert!(
                requests > packs_with_data(&packs) && longest < 6 * MIB,
                "{requests} reads for {} packs",
                packs_with_data(&packs)
            );
        } else {
            assert_eq!(requests, packs_with_data(&packs), "one read per pack");
        }
    }
}

/// A repository with one backup of a directory `source` holding one file
/// of random bytes from `seed`; the source and the snapshot's tree.
async fn backed_up_once(seed: u64) -> (TestRepo, std::path::PathBuf, BlobId) {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).expect("mkdir");
    std::fs::write(source.join("a"), random_bytes(seed, 300_000)).expect("write");
    let tree = repo.backup(&source).await.snapshot.tree;
    (repo, source, tree)
}

/// The engines of one process (the volumes an agent moves at once) share
/// one copy of the repository's index: loads that start together read
/// the index files once and get the same index, and so does a later load
/// while an engine still holds it. After a new index file (another backup
/// finished) the next load reads only that file, into a layer over the
/// index held; new marks of prune make the next load its own, which sees
/// them; once no engine holds the index it is freed and read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_of_one_process_share_the_index_while_one_holds_it() {
    use haulage::repo::prune::{Candidate, DeletionCandidates, MarkReason};
    let (repo, source, first_tree) = backed_up_once(61).await;
    let (counter, repository) = counted(&repo).await;
    let index_reads = || {
        counter
            .layer()
            .take_reads()
            .iter()
            .filter(|read| read.key.starts_with(haulage::repo::INDEX_PREFIX))
            .count()
    };

    let together = futures::future::join_all((0..4).map(|_| repository.load_index())).await;
    let together: Vec<_> = together
        .into_iter()
        .map(|loaded| loaded.expect("index").index)
        .collect();
    assert!(
        together
            .iter()
            .all(|index| Arc::ptr_eq(index, &together[0])),
        "four loads at once, four copies"
    );
    assert_eq!(index_reads(), 1, "the one index file read once");
    let again = repository.load_index().await.expect("index").index;
    assert!(Arc::ptr_eq(&again, &together[0]));
    assert_eq!(index_reads(), 0);

    // Another backup's index file: a layer over the index held, with the
    // new file's blobs only, which finds the blobs of both.
    std::fs::write(source.join("b"), random_bytes(62, 300_000)).expect("write");
    let second = repo.backup(&source).await;
    let after_backup = repository.load_index().await.expect("index").index;
    assert!(!Arc::ptr_eq(&after_backup, &together[0]));
    assert!(
        after_backup
            .base()
            .is_some_and(|base| Arc::ptr_eq(base, &together[0])),
        "a second copy of the index held, not a layer over it"
    );
    assert!(after_backup.contains(&second.snapshot.tree));
    assert!(after_backup.contains(&first_tree));
    assert!(!together[0].contains(&second.snapshot.tree));
    assert_eq!(index_reads(), 1, "only the new index file read");
    assert!(after_backup.layer_memory_bytes() < after_backup.memory_bytes());

    // Prune marks a pack: the next load sees it leaving.
    let pack = after_backup.pack_of(after_backup.get(&second.snapshot.tree).expect("tree"));
    repository
        .write_deletion_candidates(&DeletionCandidates {
            candidates: vec![Candidate {
                pack,
                since_seconds: 0,
                reason: MarkReason::Unreferenced,
            }],
        })
        .await
        .expect("mark");
    let after_mark = repository.load_index().await.expect("index").index;
    assert!(!Arc::ptr_eq(&after_mark, &after_backup));
    assert!(after_mark.base().is_none(), "a load of its own");
    assert!(after_mark.is_leaving(&pack) && !after_backup.is_leaving(&pack));
    assert_eq!(index_reads(), 2);

    // Held by no engine: freed, and read again by the next.
    drop((together, again, after_backup, after_mark));
    repository.load_index().await.expect("index");
    assert_eq!(index_reads(), 2);
}

/// Packs no index file named when the index was loaded (a backup that was
/// interrupted, or still running) are read from their trailers and handed
/// to the engine as unindexed, for its backup to adopt. Once index files
/// name them, the next load is a layer over the index held that no longer
/// calls them unindexed and holds none of them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_hands_over_no_pack_that_its_index_files_name() {
    let (repo, _source, first_tree) = backed_up_once(63).await;
    // The backup's index files set aside: its packs are unindexed.
    let index_dir = repo.root().join("index");
    let aside = repo.dir.path().join("index-aside");
    std::fs::rename(&index_dir, &aside).expect("set the index files aside");
    std::fs::create_dir(&index_dir).expect("mkdir index");
    let (_counter, repository) = counted(&repo).await;
    let held = repository.load_index().await.expect("index");
    assert!(
        !held.unindexed_packs.is_empty(),
        "packs found by their trailers"
    );
    assert!(held.index.contains(&first_tree));

    for entry in std::fs::read_dir(&aside).expect("index files") {
        let entry = entry.expect("entry");
        std::fs::rename(entry.path(), index_dir.join(entry.file_name())).expect("put back");
    }
    let layered = repository.load_index().await.expect("index");
    assert!(
        layered
            .index
            .base()
            .is_some_and(|base| Arc::ptr_eq(base, &held.index)),
        "a layer over the index held"
    );
    assert!(
        layered.unindexed_packs.is_empty(),
        "packs the index files name handed over as unindexed: {:?}",
        layered
            .unindexed_packs
            .iter()
            .map(|(pack, _)| pack)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        layered.index.pack_count(),
        held.index.pack_count(),
        "the layer holds packs its base holds"
    );
    assert!(layered.index.contains(&first_tree));
}

/// An index made of as many layers as a lookup may ask (four) gets no
/// layer over it: the next load is a layer over a lower one, reading
/// again the index files of the layer left out, and finds every blob.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_index_is_made_of_four_layers_at_most() {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir_all(&source).expect("mkdir");
    let (_counter, repository) = counted(&repo).await;
    let mut held = Vec::new();
    let mut trees = Vec::new();
    for round in 0..5u8 {
        std::fs::write(
            source.join(format!("f{round}")),
            random_bytes(70 + u64::from(round), 100_000),
        )
        .expect("write");
        trees.push(repo.backup(&source).await.snapshot.tree);
        held.push(repository.load_index().await.expect("index").index);
    }
    let layers: Vec<usize> = held.iter().map(|index| index.layers()).collect();
    assert_eq!(layers, [1, 2, 3, 4, 4]);
    assert!(
        held[4]
            .base()
            .is_some_and(|base| Arc::ptr_eq(base, &held[2])),
        "the fifth load is a layer over the third"
    );
    assert!(trees.iter().all(|tree| held[4].contains(tree)));
}

/// Requests of one kind held back by a delay, as by a store some way off,
/// with how many there were and how many ran at once at most.
#[derive(Debug)]
struct SlowRequests {
    which: Slowed,
    delay: std::time::Duration,
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    most_in_flight: std::sync::atomic::AtomicUsize,
    count: std::sync::atomic::AtomicUsize,
}

/// Which requests [`SlowRequests`] holds back.
#[derive(Debug)]
enum Slowed {
    /// Reads of these packs (of trees).
    TreePackReads(BTreeSet<ObjectId>),
    /// Uploads of packs, as a server answers a PUT only once it has
    /// stored the object.
    PackUploads,
}

impl SlowRequests {
    fn new(which: Slowed, delay: std::time::Duration) -> Self {
        SlowRequests {
            which,
            delay,
            in_flight: Arc::default(),
            most_in_flight: Default::default(),
            count: Default::default(),
        }
    }
}

/// One held request in flight, until dropped.
struct RequestInFlight(Option<Arc<std::sync::atomic::AtomicUsize>>);

impl Drop for RequestInFlight {
    fn drop(&mut self) {
        if let Some(in_flight) = &self.0 {
            in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

#[async_trait::async_trait]
impl haulage::store::layer::Layer for SlowRequests {
    type Held = RequestInFlight;

    async fn before(&self, request: haulage::store::layer::Request<'_>) -> RequestInFlight {
        use haulage::store::layer::Request;
        use std::sync::atomic::Ordering::SeqCst;
        let pack = |key| haulage::repo::id_from_key(key, haulage::repo::DATA_PREFIX);
        let held = match (&self.which, request) {
            (Slowed::TreePackReads(tree_packs), Request::Get { key, .. }) => {
                pack(key).is_some_and(|pack| tree_packs.contains(&pack))
            }
            (Slowed::PackUploads, Request::Put { key, .. }) => pack(key).is_some(),
            _ => false,
        };
        if !held {
            return RequestInFlight(None);
        }
        self.count.fetch_add(1, SeqCst);
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.most_in_flight.fetch_max(now, SeqCst);
        tokio::time::sleep(self.delay).await;
        RequestInFlight(Some(self.in_flight.clone()))
    }
}

/// A store that refuses to read a pack of trees whole (from its start to
/// the end of its last blob), as one whose packs of trees are too large to
/// hold would never ask: the restore reads their trees in windows.
#[derive(Debug)]
struct WholeTreePacksRefused {
    inner: DynStore,
    /// Where the blobs of each pack of trees end.
    tree_pack_ends: BTreeMap<ObjectId, u64>,
}

impl WholeTreePacksRefused {
    fn check(&self, key: &str, range: Option<&std::ops::Range<u64>>) -> Result<(), StoreError> {
        let whole = haulage::repo::id_from_key(key, haulage::repo::DATA_PREFIX)
            .and_then(|pack| self.tree_pack_ends.get(&pack))
            .is_some_and(|end| range.is_none_or(|range| range.start == 0 && range.end >= *end));
        if whole {
            return Err(StoreError::Permanent {
                location: self.location(),
                operation: "get",
                key: key.to_string(),
                message: "whole tree packs refused by this test".into(),
                cause: Default::default(),
            });
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl ObjectStore for WholeTreePacksRefused {
    async fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<(), StoreError> {
        self.inner.put(key, data, mode).await
    }

    async fn get(
        &self,
        key: &str,
        range: Option<std::ops::Range<u64>>,
    ) -> Result<Bytes, StoreError> {
        self.check(key, range.as_ref())?;
        self.inner.get(key, range).await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        self.check(key, Some(&range))?;
        self.inner.get_range_into(key, range, buffer).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        self.inner.head(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        self.inner.list(prefix).await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.inner.delete(key).await
    }

    fn location(&self) -> String {
        self.inner.location()
    }
}

/// 156 directories under `source`, five wide and four deep, a small file
/// in each; returns how many have subdirectories (31).
fn write_directories_five_wide(source: &Path) -> usize {
    let mut directories = 0;
    let mut with_subdirectories = 0;
    let mut level = vec![source.to_path_buf()];
    for depth in 0..4 {
        for directory in &level {
            std::fs::create_dir_all(directory).expect("mkdir");
            std::fs::write(directory.join("file"), format!("directory {directories}\n"))
                .expect("file");
            directories += 1;
        }
        if depth == 3 {
            break;
        }
        with_subdirectories += level.len();
        level = level
            .iter()
            .flat_map(|directory| (0..5).map(move |child| directory.join(format!("d{child}"))))
            .collect();
    }
    assert_eq!(directories, 156);
    assert_eq!(with_subdirectories, 31);
    with_subdirectories
}

/// Where the blobs of each pack of trees only end.
async fn tree_pack_ends(repository: &Repository) -> BTreeMap<ObjectId, u64> {
    pack_entries(repository)
        .await
        .into_iter()
        .filter(|(_, entries)| trees_only(entries))
        .map(|(pack, entries)| {
            let end = entries
                .iter()
                .map(|entry| u64::from(entry.offset) + u64::from(entry.stored_length))
                .max()
                .unwrap_or(0);
            (pack, end)
        })
        .collect()
}

/// The five-wide directories backed up, their trees in one pack.
struct FiveWide {
    repo: TestRepo,
    source: std::path::PathBuf,
    snapshot: ObjectId,
    /// Where the blobs of the pack of trees end.
    tree_packs: BTreeMap<ObjectId, u64>,
    with_subdirectories: usize,
}

impl FiveWide {
    async fn backed_up() -> Self {
        let repo = TestRepo::new().await;
        let source = repo.dir.path().join("source");
        let with_subdirectories = write_directories_five_wide(&source);
        let snapshot = repo.backup(&source).await.snapshot_id;
        let tree_packs = tree_pack_ends(&repo.repository).await;
        assert_eq!(tree_packs.len(), 1, "the trees have a pack of their own");
        FiveWide {
            repo,
            source,
            snapshot,
            tree_packs,
            with_subdirectories,
        }
    }

    /// Restore it from `store` with its tree-pack reads held 20 ms each;
    /// the reads, counted.
    async fn restore_from(&self, store: DynStore) -> Arc<Layered<SlowRequests>> {
        let slow = SlowRequests::new(
            Slowed::TreePackReads(self.tree_packs.keys().copied().collect()),
            std::time::Duration::from_millis(20),
        );
        let (slow, repository) = open_through(store, slow).await;
        restore_intact(
            &repository,
            &self.snapshot,
            RestoreOptions::new(self.repo.dir.path().join("restored")),
            &self.source,
        )
        .await;
        slow
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pack_of_trees_is_read_whole_once_however_many_windows_it_serves() {
    let tree = FiveWide::backed_up().await;
    let slow = tree.restore_from(local_store(&tree.repo)).await;
    // The root's tree, then the pack whole: 31 windows cut from it.
    let reads = slow.layer().count.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(reads, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subtrees_of_directories_not_yet_entered_are_loaded_ahead_each_once() {
    // Entering a directory loads its subtrees in one read, from the pack
    // of trees held, or, where it cannot be held, from the store; walked
    // one directory after the other, the latter was 31 round trips to the
    // store one after the other here (over 20 s for 11,111 directories
    // 20 ms away).
    let tree = FiveWide::backed_up().await;
    let with_subdirectories = tree.with_subdirectories;
    let slow = tree
        .restore_from(Arc::new(WholeTreePacksRefused {
            inner: local_store(&tree.repo),
            tree_pack_ends: tree.tree_packs.clone(),
        }))
        .await;
    let layer = slow.layer();
    use std::sync::atomic::Ordering::SeqCst;
    // Each directory's subtrees in one read, and none twice: the root's
    // tree, the pack asked whole (refused), then one read per directory
    // with subdirectories.
    assert_eq!(layer.count.load(SeqCst), 2 + with_subdirectories);
    assert!(
        layer.most_in_flight.load(SeqCst) > 1,
        "the subtrees of directories not yet entered were loaded while the walk waited for \
         others: at most {} tree read(s) ran at once",
        layer.most_in_flight.load(SeqCst)
    );
}

/// Into a remote store (MinIO), a backup with the default memory share
/// keeps two pack uploads in flight, so the pipeline does not wait for the
/// server's answer to each pack; into a local one, and with a share of
/// several volumes, one at a time. Each upload is held 200 ms more, and
/// the packs (closed past 1 MiB, so of one or two chunks) fill in a few
/// milliseconds each, so the next upload is always waiting for its place.
/// What is stored is the same either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_into_a_remote_store_keeps_two_pack_uploads_in_flight() {
    use haulage::engine::backup::{BackupOptions, backup};
    use haulage::engine::memory::EngineMemory;
    use std::sync::atomic::Ordering::SeqCst;
    const BUCKET: &str = "uploads";
    let server = crate::support::minio::MinioServer::start()
        .await
        .expect("start MinIO");
    server.create_bucket(BUCKET).await.expect("bucket");
    let source = tempfile::tempdir().expect("source");
    std::fs::write(source.path().join("random.bin"), random_bytes(77, 8 << 20)).expect("write");
    let share_of_four = EngineMemory::new(haulage::api::transfer::DEFAULT_VOLUME_SHARE_BYTES / 4);
    let local = tempfile::tempdir().expect("repository");
    let mut most_in_flight = Vec::new();
    for (round, remote, memory) in [
        (0, true, EngineMemory::default()),
        (1, false, EngineMemory::default()),
        (2, true, share_of_four),
    ] {
        let store: DynStore = if remote {
            haulage::store::open_store(
                &format!("s3://{BUCKET}/round-{round}"),
                &server.store_options(),
            )
            .await
            .expect("open the bucket")
        } else {
            Arc::new(LocalStore::new(local.path()))
        };
        // Packs of 1 MiB (the least a repository takes), so that 8 MiB
        // make several.
        let mut config = haulage::repo::config::RepoConfig::generate(&mut rand::rng());
        config.pack_target_bytes = 1 << 20;
        store
            .put(
                haulage::repo::CONFIG_KEY,
                config.to_json().into(),
                PutMode::Create,
            )
            .await
            .expect("config");
        let (slow, repository) = open_through(
            store,
            SlowRequests::new(Slowed::PackUploads, std::time::Duration::from_millis(200)),
        )
        .await;
        let mut options = BackupOptions::new(source.path());
        options.memory = memory;
        let outcome = backup(&repository, options, Default::default(), Default::default())
            .await
            .expect("backup");
        let target = tempfile::tempdir().expect("target");
        restore_intact(
            &repository,
            &outcome.snapshot_id,
            RestoreOptions::new(target.path().join("restored")),
            source.path(),
        )
        .await;
        most_in_flight.push(slow.layer().most_in_flight.load(SeqCst));
    }
    assert_eq!(
        most_in_flight,
        [2, 1, 1],
        "pack uploads in flight at most: remote with the default share, local, remote with a quarter of it"
    );
}
