//! The pack read plan of one restore batch: which packs to read, which byte
//! ranges of each, and which file offsets each blob's plaintext goes to.
//!
//! Pure (no I/O, no clock), so its rules are checked here with plain values:
//! every chunk a file needs is written exactly once, from a blob read exactly
//! once however many files and offsets share it; the reads of one pack are
//! disjoint, so no byte of a pack is fetched twice in a batch; neighbouring
//! blobs share a read ([`coalesce_ranges`]), so a pack the batch needs
//! whole comes in one request when it fits [`PlanLimits::max_read_bytes`];
//! no read is longer than that, so the bytes a restore holds are bounded by
//! the reads it lets be in flight; and a file with a blob that is missing or
//! whose index entry cannot be right gets no reads at all. Across batches,
//! [`schedule_reads`] holds back the read that ends a pack's part in one
//! batch and joins it with the next batch's reads of that pack, so a pack
//! split between two batches still comes in one request.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use crate::repo::index::BlobLocation;
use crate::repo::{BlobId, ObjectId};
use crate::store::ranges::{coalesce_ranges, fit_one_read};

/// One chunk one file needs: the blob's plaintext goes at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkNeed {
    /// Position of the file in its batch.
    pub file: u32,
    /// Where in the file the chunk starts.
    pub offset: u64,
    /// The chunk's blob.
    pub blob: BlobId,
    /// Plaintext length the snapshot records for it.
    pub length: u32,
}

/// Where a blob's plaintext is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// Position of the file in its batch.
    pub file: u32,
    /// Offset in that file.
    pub offset: u64,
}

/// A blob read by a [`PackRead`] and everywhere it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBlob {
    /// The blob.
    pub id: BlobId,
    /// Where it is stored (within [`PackRead::pack`]).
    pub location: BlobLocation,
    /// Every file offset that gets its plaintext, sorted.
    pub targets: Vec<Target>,
}

impl PlannedBlob {
    /// The blob's stored bytes in the pack.
    pub fn stored_range(&self) -> Range<u64> {
        let start = u64::from(self.location.offset);
        start..start + u64::from(self.location.stored_length)
    }

    /// Plaintext bytes this blob writes in all.
    pub fn written_bytes(&self) -> u64 {
        u64::from(self.location.raw_length) * self.targets.len() as u64
    }
}

/// One ranged read of one pack and the blobs it carries, sorted by offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackRead {
    /// The pack.
    pub pack: ObjectId,
    /// The bytes read.
    pub range: Range<u64>,
    /// The blobs inside `range`.
    pub blobs: Vec<PlannedBlob>,
}

impl PackRead {
    /// The smallest file position any of its blobs is written to: reads are
    /// done in this order, so files complete roughly in walk order.
    fn first_file(&self) -> u32 {
        self.blobs
            .iter()
            .filter_map(|blob| blob.targets.first())
            .map(|target| target.file)
            .min()
            .unwrap_or(u32::MAX)
    }
}

/// Why a file cannot be restored, found while planning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unrestorable {
    /// No index or pack trailer names the blob.
    Missing {
        /// The blob.
        blob: BlobId,
    },
    /// The index entry cannot describe this chunk.
    Damaged {
        /// The blob.
        blob: BlobId,
        /// The pack the index places it in.
        pack: ObjectId,
        /// What is wrong.
        reason: String,
    },
}

/// Bounds a plan keeps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Longest read; a blob stored longer than this is refused as damaged.
    pub max_read_bytes: u64,
    /// Longest gap between two needed blobs of a pack read through rather
    /// than paid for with another request.
    pub max_gap_bytes: u64,
    /// Longest plaintext a chunk can have (the repository's largest chunk);
    /// an index entry claiming more is refused as damaged, so decoding never
    /// allocates more than this per blob.
    pub max_chunk_bytes: u32,
}

/// What a batch reads and writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadPlan {
    /// The reads, in the order to issue them.
    pub reads: Vec<PackRead>,
    /// Writes each file of the batch receives, by file position.
    pub writes_per_file: Vec<u32>,
    /// Files that cannot be restored, with the first reason found, by file
    /// position; they receive no writes.
    pub unrestorable: Vec<(u32, Unrestorable)>,
}

/// Plan the reads of a batch of `file_count` files from the chunks they
/// need. `locate` answers where a blob is stored (the blob index).
pub fn plan_pack_reads(
    file_count: u32,
    needs: &[ChunkNeed],
    locate: impl Fn(&BlobId) -> Option<(ObjectId, BlobLocation)>,
    limits: &PlanLimits,
) -> ReadPlan {
    let mut located: HashMap<BlobId, Option<(ObjectId, BlobLocation)>> = HashMap::new();
    let mut unrestorable: BTreeMap<u32, Unrestorable> = BTreeMap::new();
    for need in needs {
        let place = *located
            .entry(need.blob)
            .or_insert_with(|| locate(&need.blob));
        if let Err(problem) = check_need(need, place, limits) {
            unrestorable.entry(need.file).or_insert(problem);
        }
    }
    // Blobs of a pack never overlap in a pack this format writes; refusing
    // ones that do keeps every read within the cap (overlapping ranges
    // could only be read together).
    let overlapping = overlapping_blobs(&located);
    for need in needs {
        if let Some(problem) = overlapping.get(&need.blob) {
            unrestorable
                .entry(need.file)
                .or_insert_with(|| problem.clone());
        }
    }

    let mut writes_per_file = vec![0u32; file_count as usize];
    let mut blobs: HashMap<BlobId, (ObjectId, PlannedBlob)> = HashMap::new();
    for need in needs {
        if unrestorable.contains_key(&need.file) {
            continue;
        }
        let Some(Some((pack, location))) = located.get(&need.blob) else {
            continue;
        };
        writes_per_file[need.file as usize] += 1;
        blobs
            .entry(need.blob)
            .or_insert_with(|| {
                (
                    *pack,
                    PlannedBlob {
                        id: need.blob,
                        location: *location,
                        targets: Vec::new(),
                    },
                )
            })
            .1
            .targets
            .push(Target {
                file: need.file,
                offset: need.offset,
            });
    }

    let mut by_pack: BTreeMap<ObjectId, Vec<PlannedBlob>> = BTreeMap::new();
    for (_, (pack, mut blob)) in blobs {
        blob.targets.sort_unstable();
        by_pack.entry(pack).or_default().push(blob);
    }
    let mut reads = Vec::new();
    for (pack, mut pack_blobs) in by_pack {
        pack_blobs.sort_unstable_by_key(|blob| (blob.stored_range().start, blob.id));
        let ranges: Vec<Range<u64>> = pack_blobs.iter().map(PlannedBlob::stored_range).collect();
        let merged = coalesce_ranges(&ranges, limits.max_gap_bytes, limits.max_read_bytes);
        let mut pack_reads: Vec<PackRead> = merged
            .into_iter()
            .map(|range| PackRead {
                pack,
                range,
                blobs: Vec::new(),
            })
            .collect();
        // Blobs and reads are both sorted by start, and every blob lies in
        // exactly one read: walk them together.
        let mut holder = 0;
        for blob in pack_blobs {
            let range = blob.stored_range();
            while pack_reads[holder].range.end < range.end
                || pack_reads[holder].range.start > range.start
            {
                holder += 1;
            }
            pack_reads[holder].blobs.push(blob);
        }
        reads.extend(pack_reads);
    }
    reads.sort_by_cached_key(|read| (read.first_file(), read.pack, read.range.start));
    ReadPlan {
        reads,
        writes_per_file,
        unrestorable: unrestorable.into_iter().collect(),
    }
}

/// A read of one pack serving the blobs of one batch, or of up to
/// [`MAX_BATCHES_PER_READ`]: a read held back from earlier batches and
/// joined with the next batch's reads of the same pack
/// ([`schedule_reads`]). `B` is what stands for a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchedRead<B> {
    /// The pack.
    pub pack: ObjectId,
    /// The bytes read.
    pub range: Range<u64>,
    /// The blobs inside `range`, by the batch whose files they go to,
    /// earlier batch first.
    pub parts: Vec<(B, Vec<PlannedBlob>)>,
}

impl<B> BatchedRead<B> {
    /// A read of one batch.
    pub fn alone(batch: B, read: PackRead) -> Self {
        BatchedRead {
            pack: read.pack,
            range: read.range,
            parts: vec![(batch, read.blobs)],
        }
    }
}

/// Most batches one read serves: a read held back and joined with the
/// next batch's is held again, for the batch after, while it serves
/// fewer. A pack of small files spans a few batches (a deep tree of
/// 30,000 files of about 9 KiB: up to three), and a batch whose last read
/// is held waits for at most this many minus one batches (each keeps its
/// files' bookkeeping and directories open meanwhile).
pub const MAX_BATCHES_PER_READ: usize = 3;

/// What to fetch now for a batch, and what to hold back for the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledReads<B> {
    /// Reads to fetch now, in order: the reads held back from the previous
    /// batch (joined with this batch's where they could be), then this
    /// batch's.
    pub fetch: Vec<BatchedRead<B>>,
    /// Reads to fetch with the next batch: each serves this batch, and
    /// perhaps earlier ones.
    pub hold: Vec<BatchedRead<B>>,
}

/// Schedule the planned `reads` of `batch`, with the reads `held` back
/// from the previous batch.
///
/// A batch ends where its limits say, not where a pack ends, so the last
/// files of one batch and the first of the next are often stored in the
/// same pack, and each batch would read its own range of it: two requests
/// for one pack, and a range starting inside an object makes the server
/// read and check the block around its start again (docs/benchmarks.md).
/// So each held read is joined with this batch's reads of the same pack
/// that can share its request (the two overlap, or are at most
/// [`PlanLimits::max_gap_bytes`] apart, and together within
/// [`PlanLimits::max_read_bytes`]); and the last read of each pack that
/// serves this batch is held back when the pack's blobs go on past its end
/// (`blobs_end`: where a pack's last blob ends, from the index) and it
/// serves fewer than [`MAX_BATCHES_PER_READ`] batches: the next batch most
/// likely needs what follows, since a backup packs files in the order it
/// walks them and a restore walks in the same order. Every other read is
/// fetched now, held ones first.
pub fn schedule_reads<B: Clone>(
    held: Vec<BatchedRead<B>>,
    batch: B,
    reads: Vec<PackRead>,
    blobs_end: impl Fn(&ObjectId) -> Option<u64>,
    limits: &PlanLimits,
) -> ScheduledReads<B> {
    let mut reads_of_pack: HashMap<ObjectId, Vec<usize>> = HashMap::new();
    for (position, read) in reads.iter().enumerate() {
        reads_of_pack.entry(read.pack).or_default().push(position);
    }
    let mut reads: Vec<Option<PackRead>> = reads.into_iter().map(Some).collect();
    let mut scheduled: Vec<BatchedRead<B>> = Vec::with_capacity(held.len() + reads.len());
    // Whether each of `scheduled` serves this batch.
    let mut serves_this_batch = Vec::with_capacity(held.len() + reads.len());
    for mut joined in held {
        let mut joined_blobs = Vec::new();
        let candidates = reads_of_pack
            .get(&joined.pack)
            .map_or(&[][..], Vec::as_slice);
        // Joining one read can bring another within reach: go on until
        // none joins.
        while let Some(position) = candidates.iter().copied().find(|position| {
            reads[*position].as_ref().is_some_and(|read| {
                fit_one_read(
                    &joined.range,
                    &read.range,
                    limits.max_gap_bytes,
                    limits.max_read_bytes,
                )
            })
        }) {
            let read = reads[position].take().expect("a read not yet joined");
            joined.range =
                joined.range.start.min(read.range.start)..joined.range.end.max(read.range.end);
            joined_blobs.extend(read.blobs);
        }
        serves_this_batch.push(!joined_blobs.is_empty());
        if !joined_blobs.is_empty() {
            joined.parts.push((batch.clone(), joined_blobs));
        }
        scheduled.push(joined);
    }
    scheduled.extend(
        reads
            .into_iter()
            .flatten()
            .map(|read| BatchedRead::alone(batch.clone(), read)),
    );

    // Of each pack, the read serving this batch that starts last (a held
    // read joined to nothing does not serve it).
    let mut last_of_pack: HashMap<ObjectId, usize> = HashMap::new();
    serves_this_batch.resize(scheduled.len(), true);
    for (position, read) in scheduled.iter().enumerate() {
        if !serves_this_batch[position] {
            continue;
        }
        let last = last_of_pack.entry(read.pack).or_insert(position);
        if scheduled[*last].range.start < read.range.start {
            *last = position;
        }
    }
    let mut to_hold = vec![false; scheduled.len()];
    for (pack, position) in &last_of_pack {
        let read = &scheduled[*position];
        to_hold[*position] = read.parts.len() < MAX_BATCHES_PER_READ
            && read.range.end < blobs_end(pack).unwrap_or(0);
    }
    let (mut fetch, mut hold) = (Vec::new(), Vec::new());
    for (read, to_hold) in scheduled.into_iter().zip(to_hold) {
        if to_hold {
            hold.push(read)
        } else {
            fetch.push(read)
        }
    }
    ScheduledReads { fetch, hold }
}

/// Blobs whose stored bytes overlap those of another blob of the same pack
/// (the later one of each overlapping pair, by offset).
fn overlapping_blobs(
    located: &HashMap<BlobId, Option<(ObjectId, BlobLocation)>>,
) -> HashMap<BlobId, Unrestorable> {
    let mut by_pack: BTreeMap<ObjectId, Vec<(Range<u64>, BlobId)>> = BTreeMap::new();
    for (id, place) in located {
        if let Some((pack, location)) = place {
            let start = u64::from(location.offset);
            by_pack
                .entry(*pack)
                .or_default()
                .push((start..start + u64::from(location.stored_length), *id));
        }
    }
    let mut overlapping = HashMap::new();
    for (pack, mut blobs) in by_pack {
        blobs.sort_unstable_by_key(|(range, id)| (range.start, range.end, *id));
        let mut end_so_far = 0;
        for (range, id) in blobs {
            if range.start < end_so_far {
                overlapping.insert(
                    id,
                    Unrestorable::Damaged {
                        blob: id,
                        pack,
                        reason: "its bytes overlap another blob of the pack".into(),
                    },
                );
            }
            end_so_far = end_so_far.max(range.end);
        }
    }
    overlapping
}

/// Whether the index entry found for a chunk can describe it.
fn check_need(
    need: &ChunkNeed,
    place: Option<(ObjectId, BlobLocation)>,
    limits: &PlanLimits,
) -> Result<(), Unrestorable> {
    let Some((pack, location)) = place else {
        return Err(Unrestorable::Missing { blob: need.blob });
    };
    let damaged = |reason: String| Unrestorable::Damaged {
        blob: need.blob,
        pack,
        reason,
    };
    if location.raw_length != need.length {
        return Err(damaged(format!(
            "the index says {} bytes, the snapshot {}",
            location.raw_length, need.length
        )));
    }
    if location.raw_length > limits.max_chunk_bytes {
        return Err(damaged(format!(
            "the index says {} bytes, more than the repository's largest chunk ({})",
            location.raw_length, limits.max_chunk_bytes
        )));
    }
    if u64::from(location.stored_length) > limits.max_read_bytes {
        return Err(damaged(format!(
            "the index says it is stored in {} bytes, more than any chunk needs",
            location.stored_length
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;
    use crate::repo::index::BlobIndex;
    use crate::repo::pack::PackEntry;
    use crate::repo::{BlobKind, Compression};

    const LIMITS: PlanLimits = PlanLimits {
        max_read_bytes: 1000,
        max_gap_bytes: 50,
        max_chunk_bytes: 400,
    };

    fn blob(n: u32) -> BlobId {
        let mut id = [0u8; 32];
        id[..4].copy_from_slice(&n.to_le_bytes());
        BlobId(id)
    }

    fn pack(n: u8) -> ObjectId {
        ObjectId([n; 32])
    }

    /// Packs by number with their blobs.
    type Packs = Vec<(u8, PackBlobs)>;
    /// (blob number, stored length, raw length) of one pack's blobs.
    type PackBlobs = Vec<(u32, u32, u32)>;

    /// An index of `packs`, their blobs laid out back to back from offset 8
    /// as a pack writer does.
    fn index(packs: &[(u8, PackBlobs)]) -> BlobIndex {
        let mut index = BlobIndex::new();
        for (pack_number, blobs) in packs {
            let mut offset = 8;
            let entries: Vec<PackEntry> = blobs
                .iter()
                .map(|&(number, stored, raw)| {
                    let entry = PackEntry {
                        id: blob(number),
                        kind: BlobKind::Data,
                        compression: Compression::Zstd,
                        offset,
                        stored_length: stored,
                        raw_length: raw,
                    };
                    offset += stored;
                    entry
                })
                .collect();
            index.add_pack(pack(*pack_number), &entries);
        }
        index
    }

    fn locate(index: &BlobIndex) -> impl Fn(&BlobId) -> Option<(ObjectId, BlobLocation)> + '_ {
        |id| {
            index
                .get(id)
                .map(|location| (index.pack_of(location), *location))
        }
    }

    fn need(file: u32, offset: u64, number: u32, length: u32) -> ChunkNeed {
        ChunkNeed {
            file,
            offset,
            blob: blob(number),
            length,
        }
    }

    #[test]
    fn a_pack_needed_whole_is_read_once_in_one_range() {
        let index = index(&[(1, vec![(1, 100, 300), (2, 100, 300), (3, 100, 300)])]);
        let needs = [need(0, 0, 1, 300), need(0, 300, 2, 300), need(1, 0, 3, 300)];
        let plan = plan_pack_reads(2, &needs, locate(&index), &LIMITS);
        assert_eq!(plan.reads.len(), 1, "{plan:?}");
        assert_eq!(plan.reads[0].range, 8..308);
        assert_eq!(plan.reads[0].blobs.len(), 3);
        assert_eq!(plan.writes_per_file, [2, 1]);
        assert!(plan.unrestorable.is_empty());
    }

    #[test]
    fn a_chunk_shared_by_many_files_is_read_once_and_written_everywhere() {
        let index = index(&[(1, vec![(7, 100, 200)])]);
        let needs: Vec<_> = (0..50).map(|file| need(file, 200, 7, 200)).collect();
        let plan = plan_pack_reads(50, &needs, locate(&index), &LIMITS);
        assert_eq!(plan.reads.len(), 1);
        assert_eq!(plan.reads[0].blobs.len(), 1);
        let targets = &plan.reads[0].blobs[0].targets;
        assert_eq!(targets.len(), 50);
        assert!(targets.iter().all(|target| target.offset == 200));
        assert_eq!(plan.writes_per_file, vec![1; 50]);
    }

    #[test]
    fn a_chunk_repeated_inside_one_file_gets_a_target_per_offset() {
        let index = index(&[(1, vec![(7, 100, 200)])]);
        let needs = [
            need(0, 0, 7, 200),
            need(0, 200, 7, 200),
            need(0, 400, 7, 200),
        ];
        let plan = plan_pack_reads(1, &needs, locate(&index), &LIMITS);
        assert_eq!(plan.reads.len(), 1);
        let offsets: Vec<u64> = plan.reads[0].blobs[0]
            .targets
            .iter()
            .map(|target| target.offset)
            .collect();
        assert_eq!(offsets, [0, 200, 400]);
        assert_eq!(plan.writes_per_file, [3]);
    }

    #[test]
    fn a_file_with_a_missing_or_mis_sized_blob_gets_no_reads_and_others_are_planned() {
        let index = index(&[(1, vec![(1, 100, 300), (2, 100, 300)])]);
        let needs = [
            need(0, 0, 1, 300),
            need(0, 300, 99, 300), // in no index
            need(1, 0, 2, 300),
            need(2, 0, 1, 300),
            need(2, 300, 2, 299), // the snapshot disagrees with the index
        ];
        let plan = plan_pack_reads(3, &needs, locate(&index), &LIMITS);
        assert_eq!(plan.writes_per_file, [0, 1, 0]);
        assert_eq!(plan.unrestorable.len(), 2);
        assert_eq!(
            plan.unrestorable[0],
            (0, Unrestorable::Missing { blob: blob(99) })
        );
        assert!(
            matches!(&plan.unrestorable[1], (2, Unrestorable::Damaged { reason, .. }) if reason.contains("299")),
            "{:?}",
            plan.unrestorable
        );
        let planned: Vec<BlobId> = plan
            .reads
            .iter()
            .flat_map(|read| read.blobs.iter().map(|blob| blob.id))
            .collect();
        assert_eq!(planned, [blob(2)], "only file 1's blob is read");
    }

    #[test]
    fn index_entries_larger_than_any_chunk_are_refused_before_anything_is_allocated() {
        let index = index(&[(1, vec![(1, 100, 4000), (2, 2000, 300)])]);
        let needs = [need(0, 0, 1, 4000), need(1, 0, 2, 300)];
        let plan = plan_pack_reads(2, &needs, locate(&index), &LIMITS);
        assert!(plan.reads.is_empty());
        assert_eq!(plan.writes_per_file, [0, 0]);
        assert_eq!(plan.unrestorable.len(), 2, "{:?}", plan.unrestorable);
    }

    #[test]
    fn a_blob_overlapping_another_in_its_pack_is_refused() {
        let mut index = BlobIndex::new();
        let entry = |number, offset| PackEntry {
            id: blob(number),
            kind: BlobKind::Data,
            compression: Compression::Zstd,
            offset,
            stored_length: 100,
            raw_length: 100,
        };
        index.add_pack(pack(1), &[entry(1, 8), entry(2, 58), entry(3, 158)]);
        let needs = [need(0, 0, 1, 100), need(1, 0, 2, 100), need(2, 0, 3, 100)];
        let plan = plan_pack_reads(3, &needs, locate(&index), &LIMITS);
        assert_eq!(plan.writes_per_file, [1, 0, 1]);
        assert!(
            matches!(&plan.unrestorable[..], [(1, Unrestorable::Damaged { reason, .. })] if reason.contains("overlap")),
            "{:?}",
            plan.unrestorable
        );
    }

    #[test]
    fn reads_follow_the_files_that_need_them_and_split_at_the_read_cap() {
        // Pack 2 is needed by file 0, pack 1 by file 1: pack 2 comes first.
        // Pack 1's blobs span 1,200 bytes: two reads under a 1,000-byte cap.
        let index = index(&[
            (1, vec![(1, 400, 400), (2, 400, 400), (3, 400, 400)]),
            (2, vec![(4, 10, 10)]),
        ]);
        let needs = [
            need(0, 0, 4, 10),
            need(1, 0, 1, 400),
            need(1, 400, 2, 400),
            need(1, 800, 3, 400),
        ];
        let plan = plan_pack_reads(2, &needs, locate(&index), &LIMITS);
        let order: Vec<(ObjectId, Range<u64>)> = plan
            .reads
            .iter()
            .map(|read| (read.pack, read.range.clone()))
            .collect();
        assert_eq!(
            order,
            [(pack(2), 8..18), (pack(1), 8..808), (pack(1), 808..1208)]
        );
    }

    #[test]
    fn distant_blobs_of_one_pack_are_read_separately_not_through_the_gap() {
        let index = index(&[(1, vec![(1, 10, 10), (2, 300, 300), (3, 10, 10)])]);
        let needs = [need(0, 0, 1, 10), need(0, 10, 3, 10)];
        let plan = plan_pack_reads(1, &needs, locate(&index), &LIMITS);
        let ranges: Vec<_> = plan.reads.iter().map(|read| read.range.clone()).collect();
        assert_eq!(ranges, [8..18, 318..328]);
    }

    /// A random batch: packs of blobs, and files made of random blobs (some
    /// repeated, some unknown to the index).
    fn batch() -> impl Strategy<Value = (Packs, Vec<Vec<u32>>)> {
        let packs =
            prop::collection::vec(prop::collection::vec((1u32..300, 1u32..400), 1..12), 1..6)
                .prop_map(|packs| {
                    let mut number = 0;
                    packs
                        .into_iter()
                        .enumerate()
                        .map(|(pack_number, blobs)| {
                            let blobs: Vec<(u32, u32, u32)> = blobs
                                .into_iter()
                                .map(|(stored, raw)| {
                                    number += 1;
                                    (number, stored, raw)
                                })
                                .collect();
                            (pack_number as u8, blobs)
                        })
                        .collect::<Vec<_>>()
                });
        packs.prop_flat_map(|packs| {
            let count = packs.iter().map(|(_, blobs)| blobs.len()).sum::<usize>() as u32;
            // Blob numbers past `count` are unknown to the index.
            let files = prop::collection::vec(prop::collection::vec(1..count + 3, 0..10), 0..20);
            (Just(packs), files)
        })
    }

    fn needs_of(index: &BlobIndex, files: &[Vec<u32>]) -> Vec<ChunkNeed> {
        let mut needs = Vec::new();
        for (file, blobs) in files.iter().enumerate() {
            let mut offset = 0;
            for number in blobs {
                let length = index.get(&blob(*number)).map_or(1, |l| l.raw_length);
                needs.push(need(file as u32, offset, *number, length));
                offset += u64::from(length);
            }
        }
        needs
    }

    proptest! {
        #[test]
        fn every_needed_chunk_is_written_once_from_a_blob_read_once(
            (packs, files) in batch(),
            max_read in 1u64..2000,
            max_gap in 0u64..500,
        ) {
            let index = index(&packs);
            let needs = needs_of(&index, &files);
            let limits = PlanLimits {
                max_read_bytes: max_read.max(400),
                max_gap_bytes: max_gap,
                max_chunk_bytes: 400,
            };
            let plan = plan_pack_reads(files.len() as u32, &needs, locate(&index), &limits);
            let failed: HashSet<u32> = plan.unrestorable.iter().map(|(file, _)| *file).collect();

            // Exactly the needs of restorable files, each once, from the right blob.
            let mut expected: Vec<(u32, u64, BlobId)> = needs
                .iter()
                .filter(|need| !failed.contains(&need.file))
                .map(|need| (need.file, need.offset, need.blob))
                .collect();
            let mut planned: Vec<(u32, u64, BlobId)> = plan
                .reads
                .iter()
                .flat_map(|read| read.blobs.iter())
                .flat_map(|blob| blob.targets.iter().map(|t| (t.file, t.offset, blob.id)))
                .collect();
            expected.sort();
            planned.sort();
            prop_assert_eq!(&planned, &expected);
            for (file, count) in plan.writes_per_file.iter().enumerate() {
                let wanted = expected.iter().filter(|(f, _, _)| *f == file as u32).count();
                prop_assert_eq!(*count as usize, wanted);
            }

            // A file fails only for a real reason: an unknown blob.
            for (file, problem) in &plan.unrestorable {
                let Unrestorable::Missing { blob: missing } = problem else {
                    return Err(TestCaseError::fail(format!("unexpected {problem:?}")));
                };
                prop_assert!(index.get(missing).is_none());
                prop_assert!(files[*file as usize].contains(&u32::from_le_bytes(missing.0[..4].try_into().unwrap())));
            }

            // Each blob is planned once; the reads of a pack are disjoint,
            // hold their blobs, and keep to the cap unless one blob is longer.
            let mut seen = HashSet::new();
            let mut by_pack: BTreeMap<ObjectId, Vec<Range<u64>>> = BTreeMap::new();
            for read in &plan.reads {
                prop_assert!(!read.blobs.is_empty());
                for blob in &read.blobs {
                    prop_assert!(seen.insert(blob.id), "blob planned twice");
                    let range = blob.stored_range();
                    prop_assert!(read.range.start <= range.start && range.end <= read.range.end);
                }
                prop_assert!(read.range.end - read.range.start <= limits.max_read_bytes || read.blobs.len() == 1);
                by_pack.entry(read.pack).or_default().push(read.range.clone());
            }
            for ranges in by_pack.values_mut() {
                ranges.sort_by_key(|range| range.start);
                for pair in ranges.windows(2) {
                    prop_assert!(pair[0].end <= pair[1].start, "reads of a pack overlap: {:?}", pair);
                }
            }

            // Reads are issued in the order of the first file that needs them.
            let firsts: Vec<u32> = plan.reads.iter().map(PackRead::first_file).collect();
            prop_assert!(firsts.windows(2).all(|pair| pair[0] <= pair[1]));
        }

        #[test]
        fn a_pack_whose_needed_blobs_fit_one_read_is_read_once(
            (packs, files) in batch(),
        ) {
            let index = index(&packs);
            let needs = needs_of(&index, &files);
            // Packs here are at most 12 * 300 bytes: everything fits one read
            // when gaps are read through.
            let limits = PlanLimits { max_read_bytes: 4000, max_gap_bytes: 4000, max_chunk_bytes: 400 };
            let plan = plan_pack_reads(files.len() as u32, &needs, locate(&index), &limits);
            let mut reads_per_pack: HashMap<ObjectId, usize> = HashMap::new();
            for read in &plan.reads {
                *reads_per_pack.entry(read.pack).or_default() += 1;
            }
            prop_assert!(reads_per_pack.values().all(|count| *count == 1), "{:?}", reads_per_pack);
        }

        /// Batches after batches, each planned and scheduled with what the
        /// one before held back: every blob a batch plans is fetched once
        /// for that batch, inside its read, and no read is longer than the
        /// cap, whatever is held and joined.
        #[test]
        fn scheduled_reads_fetch_every_planned_blob_once_for_its_batch(
            (packs, files) in batch(),
            cuts in prop::collection::vec(0usize..20, 0..4),
        ) {
            let index = index(&packs);
            let limits = PlanLimits { max_read_bytes: 1000, max_gap_bytes: 50, max_chunk_bytes: 400 };
            let mut cuts: Vec<usize> = cuts.into_iter().map(|cut| cut.min(files.len())).collect();
            cuts.push(0);
            cuts.push(files.len());
            cuts.sort_unstable();
            let mut planned = Vec::new();
            let mut fetched = Vec::new();
            let mut held = Vec::new();
            for (batch, window) in cuts.windows(2).enumerate() {
                let batch_files = &files[window[0]..window[1]];
                let needs = needs_of(&index, batch_files);
                let plan = plan_pack_reads(batch_files.len() as u32, &needs, locate(&index), &limits);
                for read in &plan.reads {
                    for blob in &read.blobs {
                        planned.push((batch, blob.id, blob.targets.clone()));
                    }
                }
                let scheduled = schedule(&index, held, batch, plan.reads, &limits);
                // A held read can still serve one more batch.
                for read in &scheduled.hold {
                    prop_assert!(read.parts.len() < MAX_BATCHES_PER_READ, "{read:?}");
                    prop_assert_eq!(read.parts.last().map(|(held, _)| *held), Some(batch));
                }
                fetched.extend(scheduled.fetch);
                held = scheduled.hold;
            }
            fetched.extend(held);

            let mut got = Vec::new();
            for read in &fetched {
                prop_assert!(read.range.end - read.range.start <= limits.max_read_bytes, "{read:?}");
                // At most the most batches, each once, earlier first, none
                // without blobs.
                prop_assert!(read.parts.len() <= MAX_BATCHES_PER_READ, "{read:?}");
                prop_assert!(read.parts.windows(2).all(|pair| pair[0].0 < pair[1].0), "{read:?}");
                prop_assert!(read.parts.iter().all(|(_, blobs)| !blobs.is_empty()), "{read:?}");
                for (batch, blobs) in &read.parts {
                    for blob in blobs {
                        let stored = blob.stored_range();
                        prop_assert!(read.range.start <= stored.start && stored.end <= read.range.end, "{read:?}");
                        got.push((*batch, blob.id, blob.targets.clone()));
                    }
                }
            }
            planned.sort();
            got.sort();
            prop_assert_eq!(got, planned);
        }
    }

    /// [`schedule_reads`] with where `index` says each pack's blobs end.
    fn schedule<B: Clone>(
        index: &BlobIndex,
        held: Vec<BatchedRead<B>>,
        batch: B,
        reads: Vec<PackRead>,
        limits: &PlanLimits,
    ) -> ScheduledReads<B> {
        schedule_reads(held, batch, reads, |pack| index.blobs_end(pack), limits)
    }

    /// The pack and range of each read.
    fn places<B>(reads: &[BatchedRead<B>]) -> Vec<(ObjectId, Range<u64>)> {
        reads
            .iter()
            .map(|read| (read.pack, read.range.clone()))
            .collect()
    }

    /// A pack whose blobs are split between two batches, `first` needing
    /// `first_blobs` and the next the rest.
    fn split_pack(first_blobs: u32) -> (BlobIndex, ScheduledReads<&'static str>, Vec<PackRead>) {
        let index = index(&[(1, (1..=4).map(|number| (number, 100, 100)).collect())]);
        let needs: Vec<_> = (1..=first_blobs)
            .map(|number| need(0, u64::from(number) * 100, number, 100))
            .collect();
        let first = plan_pack_reads(1, &needs, locate(&index), &LIMITS);
        let first = schedule(&index, Vec::new(), "first", first.reads, &LIMITS);
        let needs: Vec<_> = (first_blobs + 1..=4)
            .map(|number| need(0, u64::from(number) * 100, number, 100))
            .collect();
        let next = plan_pack_reads(1, &needs, locate(&index), &LIMITS).reads;
        (index, first, next)
    }

    #[test]
    fn a_pack_split_between_two_batches_is_read_in_one_request() {
        let (index, first, next) = split_pack(2);
        assert!(first.fetch.is_empty(), "{first:?}");
        assert_eq!(first.hold.len(), 1);
        assert_eq!(first.hold[0].range, 8..208);
        let next = schedule(&index, first.hold, "next", next, &LIMITS);
        assert!(next.hold.is_empty(), "{next:?}");
        assert_eq!(next.fetch.len(), 1, "{next:?}");
        let read = &next.fetch[0];
        assert_eq!(read.range, 8..408);
        let parts: Vec<(&str, Vec<BlobId>)> = read
            .parts
            .iter()
            .map(|(batch, blobs)| (*batch, blobs.iter().map(|blob| blob.id).collect()))
            .collect();
        assert_eq!(
            parts,
            [
                ("first", vec![blob(1), blob(2)]),
                ("next", vec![blob(3), blob(4)])
            ]
        );
    }

    #[test]
    fn a_read_that_ends_its_pack_is_fetched_at_once() {
        let index = index(&[
            (1, vec![(1, 100, 100), (2, 100, 100)]),
            (2, vec![(3, 100, 100), (4, 100, 100)]),
        ]);
        // Pack 1 is needed to its end, pack 2 only for its first blob.
        let needs = [need(0, 0, 1, 100), need(0, 100, 2, 100), need(1, 0, 3, 100)];
        let plan = plan_pack_reads(2, &needs, locate(&index), &LIMITS);
        let scheduled = schedule(&index, Vec::new(), 0, plan.reads, &LIMITS);
        assert_eq!(places(&scheduled.fetch), [(pack(1), 8..208)]);
        assert_eq!(places(&scheduled.hold), [(pack(2), 8..108)]);
    }

    #[test]
    fn a_held_read_the_next_batch_cannot_join_is_fetched_first_on_its_own() {
        // Too long together: the first batch's 100 bytes and the next
        // batch's 300 would make a read of 400 under a cap of 350.
        let (index, first, next) = split_pack(1);
        let limits = PlanLimits {
            max_read_bytes: 350,
            ..LIMITS
        };
        let next = schedule(&index, first.hold, "next", next, &limits);
        let fetched: Vec<_> = next
            .fetch
            .iter()
            .map(|read| {
                (
                    read.range.clone(),
                    read.parts
                        .iter()
                        .map(|(batch, _)| *batch)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        assert_eq!(fetched, [(8..108, vec!["first"]), (108..408, vec!["next"])]);
        // Nor when a pack the next batch does not need comes between: it
        // is not the same pack.
        let other = index_with_two_packs();
        let plan_of =
            |number| plan_pack_reads(1, &[need(0, 0, number, 100)], locate(&other), &LIMITS).reads;
        let first = schedule(&other, Vec::new(), "first", plan_of(1), &LIMITS);
        let next = schedule(&other, first.hold, "next", plan_of(3), &LIMITS);
        assert_eq!(places(&next.fetch), [(pack(1), 8..108), (pack(2), 8..108)]);
    }

    fn index_with_two_packs() -> BlobIndex {
        index(&[
            (1, vec![(1, 100, 100), (2, 100, 100)]),
            (2, vec![(3, 100, 100)]),
        ])
    }

    #[test]
    fn a_read_is_held_from_batch_to_batch_until_it_serves_the_most_batches() {
        // One batch per blob of one pack of four blobs: the first three
        // batches share one request, the fourth reads the rest alone.
        assert_eq!(MAX_BATCHES_PER_READ, 3);
        let index = index(&[(1, (1..=4).map(|number| (number, 100, 100)).collect())]);
        let plan_of =
            |number| plan_pack_reads(1, &[need(0, 0, number, 100)], locate(&index), &LIMITS).reads;
        let mut held = Vec::new();
        let mut fetched = Vec::new();
        for batch in 1..=4 {
            let scheduled = schedule(&index, held, batch, plan_of(batch), &LIMITS);
            for read in &scheduled.fetch {
                let batches: Vec<u32> = read.parts.iter().map(|(batch, _)| *batch).collect();
                fetched.push((batch, read.range.clone(), batches));
            }
            held = scheduled.hold;
        }
        assert!(held.is_empty(), "{held:?}");
        assert_eq!(
            fetched,
            [(3, 8..308, vec![1, 2, 3]), (4, 308..408, vec![4])]
        );
    }
}
