//! The in-memory blob index (`haulage::repo::index::BlobIndex`) at the
//! sizes a migration's repository reaches: the bytes it holds a blob once
//! loaded and at its peak while loading, how long the load takes, and how
//! long a lookup takes (a backup asks once a chunk, a restore once a blob).
//! Every engine of an agent shares one index, so its bytes come out of the
//! stage pod's memory before any volume's buffers do.
//!
//! `cargo bench --bench index` (`-- 100000 1000000` for other sizes);
//! figures in docs/benchmarks.md ("The blob index's memory").
//!
//! The blobs are built as a load builds them (`BlobIndexBuilder`): one
//! `add_pack` a pack, in the order the index files list them, with random ids (a keyed BLAKE3
//! is uniformly distributed). The bytes are counted by an allocator
//! that tracks the peak since a reset, so the figures are the index's own,
//! exact and the same on every run: the peak while loading, and what a
//! copy of the loaded index allocates (a copy has the same table sizes).

use std::alloc::System;
use std::time::Instant;

use haulage::repo::index::BlobIndexBuilder;
use haulage::repo::pack::PackEntry;
use haulage::repo::{BlobId, BlobKind, Compression, ObjectId};
use peakmem_alloc::{PeakMemAlloc, PeakMemAllocTrait};
use rand::{Rng, RngCore, SeedableRng};

#[global_allocator]
static ALLOCATOR: &PeakMemAlloc<System> = &peakmem_alloc::INSTRUMENTED_SYSTEM;

/// Blobs a pack lists: a data pack of 16 MiB holds 16 to 4,096 chunks, a
/// pack of small files' chunks hundreds; this mixes the two.
fn blobs_in_pack(rng: &mut impl Rng) -> usize {
    rng.random_range(16..=1024)
}

fn packs(blobs: usize, seed: u64) -> Vec<(ObjectId, Vec<PackEntry>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut packs = Vec::new();
    let mut made = 0;
    while made < blobs {
        let count = blobs_in_pack(&mut rng).min(blobs - made);
        let mut pack = [0u8; 32];
        rng.fill_bytes(&mut pack);
        let mut offset = 8u32;
        let entries = (0..count)
            .map(|_| {
                let mut id = [0u8; 32];
                rng.fill_bytes(&mut id);
                let stored_length = rng.random_range(512..65_536);
                let entry = PackEntry {
                    id: BlobId(id),
                    kind: BlobKind::Data,
                    compression: Compression::Zstd,
                    offset,
                    stored_length,
                    raw_length: stored_length * 2,
                };
                offset += stored_length;
                entry
            })
            .collect();
        packs.push((ObjectId(pack), entries));
        made += count;
    }
    packs
}

fn measure(blobs: usize) {
    let packs = packs(blobs, blobs as u64);
    ALLOCATOR.reset_peak_memory();
    let started = Instant::now();
    let mut builder = BlobIndexBuilder::new();
    for (pack, entries) in &packs {
        builder.add_pack(*pack, entries, false);
    }
    let index = builder.finish();
    let load = started.elapsed();
    let peak = ALLOCATOR.get_peak_memory();
    ALLOCATOR.reset_peak_memory();
    let copy = index.clone();
    let held = ALLOCATOR.get_peak_memory();
    drop(copy);
    assert_eq!(index.len(), blobs);

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let probes: Vec<BlobId> = (0..1_000_000)
        .map(|_| {
            let (_, entries) = &packs[rng.random_range(0..packs.len())];
            entries[rng.random_range(0..entries.len())].id
        })
        .collect();
    let started = Instant::now();
    let found = probes.iter().filter(|id| index.contains(id)).count();
    let present = started.elapsed();
    assert_eq!(found, probes.len());
    let absent: Vec<BlobId> = (0..1_000_000)
        .map(|_| {
            let mut id = [0u8; 32];
            rng.fill_bytes(&mut id);
            BlobId(id)
        })
        .collect();
    let started = Instant::now();
    let found = absent.iter().filter(|id| index.contains(id)).count();
    let missing = started.elapsed();
    assert_eq!(found, 0);

    let per_blob = |bytes: usize| bytes as f64 / blobs as f64;
    println!(
        "| {blobs} | {} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} |",
        packs.len(),
        held as f64 / (1 << 20) as f64,
        per_blob(held),
        per_blob(peak),
        load.as_secs_f64() * 1000.0,
        present.as_nanos() as f64 / probes.len() as f64,
        missing.as_nanos() as f64 / absent.len() as f64,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; anything numeric is a size.
    let mut sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|argument| argument.parse().ok())
        .collect();
    if sizes.is_empty() {
        sizes = vec![100_000, 1_000_000, 4_000_000];
    }
    println!(
        "| blobs | packs | index MiB | bytes a blob | peak bytes a blob while loading | load ms | lookup ns (present) | lookup ns (absent) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for blobs in sizes {
        measure(blobs);
    }
}
