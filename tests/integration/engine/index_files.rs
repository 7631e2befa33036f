//! Index files: a writer splits what it indexes so that no index file holds
//! more than `MAX_BLOBS_PER_INDEX_FILE` blobs, and a load finds every blob
//! of every file.

use haulage::repo::index::{IndexFile, MAX_BLOBS_PER_INDEX_FILE};
use haulage::repo::pack::PackEntry;
use haulage::repo::{BlobId, BlobKind, Compression, ObjectId};

use super::support::TestRepo;

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
