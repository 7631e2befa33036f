//! Index files (which blob is where) and the in-memory blob index built from
//! them.
//!
//! An index file is immutable and named by the BLAKE3 of its bytes:
//!
//! ```text
//! "HLGIDX01"
//! one zstd frame of, per pack:
//!     pack id [32] | blob count u32 |
//!     per blob: blob id [32] | kind u8 | compression u8 | offset u32 | stored length u32 | raw length u32
//! ```
//!
//! A backup writes index files after the packs they describe (checkpoints
//! while it runs, the rest at the end), and the snapshot last.

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;

use super::blob_table::BlobTable;
use super::pack::{MAX_BLOBS_PER_PACK, PackEntry};
use super::{BlobId, BlobKind, Compression, ID_LENGTH, ObjectId};

/// First bytes of every index file.
pub const INDEX_MAGIC: &[u8; 8] = b"HLGIDX01";
const INDEX_ENTRY_BYTES: usize = ID_LENGTH + 1 + 1 + 4 + 4 + 4;
/// An index file never decompresses to more than this; larger is corrupt or
/// hostile.
pub(crate) const MAX_INDEX_DECOMPRESSED_BYTES: u64 = 1 << 30;
/// The most blobs a writer puts in one index file (a pack with more has a
/// file of its own): 3 MiB of records, so a load decodes a few MiB at a
/// time however large the repository. restic's index files hold at most
/// 50,000 (150,000 in its compressed format). Before 2026-12-06 a backup
/// wrote one index file per 32 packs and prune one per 1,024, so a
/// repository of small files had index files of 500,000 blobs and more,
/// each decoded whole (23 MiB of records, twice that while decompressing).
pub const MAX_BLOBS_PER_INDEX_FILE: usize = 65_536;

/// The blobs of some packs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexFile {
    /// Each pack with its blobs.
    pub packs: Vec<(ObjectId, Vec<PackEntry>)>,
}

/// An index file that cannot be decoded.
#[derive(Debug, thiserror::Error)]
#[error("index file {index} is damaged: {reason}")]
pub struct IndexError {
    /// The index object's id.
    pub index: String,
    /// What is wrong.
    pub reason: String,
}

impl IndexFile {
    /// Encode as format 1, returning the bytes and their id.
    pub fn encode(&self) -> (ObjectId, Vec<u8>) {
        let body = self.encode_body();
        let mut bytes = INDEX_MAGIC.to_vec();
        bytes.extend_from_slice(&zstd::bulk::compress(&body, 3).expect("in-memory compression"));
        (ObjectId::of(&bytes), bytes)
    }

    /// The uncompressed records (what both formats compress).
    pub fn encode_body(&self) -> Vec<u8> {
        let records = self
            .packs
            .iter()
            .map(|(_, entries)| ID_LENGTH + 4 + entries.len() * INDEX_ENTRY_BYTES)
            .sum();
        let mut body = Vec::with_capacity(records);
        for (pack, entries) in &self.packs {
            body.extend_from_slice(&pack.0);
            body.extend_from_slice(&(entries.len() as u32).to_le_bytes());
            for entry in entries {
                body.extend_from_slice(&entry.id.0);
                body.push(entry.kind.code());
                body.push(entry.compression.code());
                body.extend_from_slice(&entry.offset.to_le_bytes());
                body.extend_from_slice(&entry.stored_length.to_le_bytes());
                body.extend_from_slice(&entry.raw_length.to_le_bytes());
            }
        }
        body
    }

    /// Decode a format 1 index file's bytes; `index` names it in errors.
    pub fn decode(bytes: &[u8], index: &str) -> Result<Self, IndexError> {
        let damaged = |reason: String| IndexError {
            index: index.to_string(),
            reason,
        };
        let compressed = bytes
            .strip_prefix(INDEX_MAGIC.as_slice())
            .ok_or_else(|| damaged("start marker missing".into()))?;
        let body = decompress_body(compressed).map_err(damaged)?;
        Self::decode_body(&body, index)
    }

    /// Decode the uncompressed records.
    pub fn decode_body(body: &[u8], index: &str) -> Result<Self, IndexError> {
        let damaged = |reason: String| IndexError {
            index: index.to_string(),
            reason,
        };
        let mut rest = body;
        let mut packs = Vec::new();
        while !rest.is_empty() {
            if rest.len() < ID_LENGTH + 4 {
                return Err(damaged("truncated pack record".into()));
            }
            let pack = ObjectId(rest[..32].try_into().expect("32 bytes"));
            let count = u32::from_le_bytes(rest[32..36].try_into().expect("4 bytes"));
            rest = &rest[36..];
            if count > MAX_BLOBS_PER_PACK || rest.len() < count as usize * INDEX_ENTRY_BYTES {
                return Err(damaged(format!(
                    "pack {} record is truncated",
                    pack.short()
                )));
            }
            let mut entries = Vec::with_capacity(count as usize);
            for record in rest[..count as usize * INDEX_ENTRY_BYTES].chunks_exact(INDEX_ENTRY_BYTES)
            {
                let field =
                    |at: usize| u32::from_le_bytes(record[at..at + 4].try_into().expect("4"));
                entries.push(PackEntry {
                    id: BlobId(record[..32].try_into().expect("32 bytes")),
                    kind: BlobKind::from_code(record[32])
                        .ok_or_else(|| damaged("unknown blob kind".into()))?,
                    compression: Compression::from_code(record[33])
                        .ok_or_else(|| damaged("unknown compression".into()))?,
                    offset: field(34),
                    stored_length: field(38),
                    raw_length: field(42),
                });
            }
            rest = &rest[count as usize * INDEX_ENTRY_BYTES..];
            packs.push((pack, entries));
        }
        Ok(IndexFile { packs })
    }
}

/// The records of an index file from its zstd frame, at most
/// [`MAX_INDEX_DECOMPRESSED_BYTES`]. The buffer is sized from the size the
/// frame declares (a buffer grown by doubling held up to twice the
/// records), but never above 64 bytes a compressed byte and 4 MiB, so a
/// hostile declaration allocates no more than the data could fill.
pub(crate) fn decompress_body(compressed: &[u8]) -> Result<Vec<u8>, String> {
    let declared = zstd::zstd_safe::get_frame_content_size(compressed)
        .ok()
        .flatten()
        .unwrap_or(0);
    let most = (compressed.len() as u64)
        .saturating_mul(64)
        .saturating_add(4 << 20)
        .min(MAX_INDEX_DECOMPRESSED_BYTES);
    let mut body = Vec::with_capacity(declared.min(most) as usize);
    zstd::stream::read::Decoder::new(compressed)
        .map_err(|error| format!("cannot decompress: {error}"))?
        .take(MAX_INDEX_DECOMPRESSED_BYTES)
        .read_to_end(&mut body)
        .map_err(|error| format!("cannot decompress: {error}"))?;
    Ok(body)
}

/// Packs grouped into index files of at most [`MAX_BLOBS_PER_INDEX_FILE`]
/// blobs each (a pack with more alone), in the order given.
pub fn index_file_groups(
    packs: Vec<(ObjectId, Vec<PackEntry>)>,
) -> Vec<Vec<(ObjectId, Vec<PackEntry>)>> {
    let mut groups: Vec<Vec<(ObjectId, Vec<PackEntry>)>> = Vec::new();
    let mut filling = IndexFileFilling::default();
    for (pack, entries) in packs {
        let starts_a_file = filling.starts_a_file(entries.len());
        match groups.last_mut() {
            Some(last) if !starts_a_file => last.push((pack, entries)),
            _ => groups.push(vec![(pack, entries)]),
        }
    }
    groups
}

/// How many index files [`index_file_groups`] makes of packs holding
/// `blob_counts` blobs.
pub fn index_files_needed(blob_counts: impl IntoIterator<Item = usize>) -> usize {
    let mut filling = IndexFileFilling::default();
    blob_counts
        .into_iter()
        .filter(|blobs| filling.starts_a_file(*blobs))
        .count()
}

/// The blobs of the index file being filled, packs added in turn.
#[derive(Debug, Default)]
struct IndexFileFilling {
    /// `None` before the first pack.
    blobs: Option<usize>,
}

impl IndexFileFilling {
    /// Add a pack of `blobs` blobs: whether it starts a new index file (the
    /// first pack, or one that would take the file past
    /// [`MAX_BLOBS_PER_INDEX_FILE`]).
    fn starts_a_file(&mut self, blobs: usize) -> bool {
        match self.blobs {
            Some(filled) if filled + blobs <= MAX_BLOBS_PER_INDEX_FILE => {
                self.blobs = Some(filled + blobs);
                false
            }
            _ => {
                self.blobs = Some(blobs);
                true
            }
        }
    }
}

/// Where one blob is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobLocation {
    /// Position of the pack in [`BlobIndex::pack_ids`].
    pack: u32,
    /// Offset of the stored bytes in the pack.
    pub offset: u32,
    /// Length of the stored bytes.
    pub stored_length: u32,
    /// Length of the plaintext.
    pub raw_length: u32,
    /// Data or tree.
    pub kind: BlobKind,
    /// How it is stored.
    pub compression: Compression,
}

impl BlobLocation {
    /// Where `entry` is, in the pack at `pack` of the index.
    fn of(pack: u32, entry: &PackEntry) -> Self {
        BlobLocation {
            pack,
            offset: entry.offset,
            stored_length: entry.stored_length,
            raw_length: entry.raw_length,
            kind: entry.kind,
            compression: entry.compression,
        }
    }
}

/// All known blobs, for dedup and for reading: a location each, in 52
/// bytes a blob ([`BlobTable`]; a load builds it at once with a
/// [`BlobIndexBuilder`], and [`BlobIndex::add_pack`] adds to it one pack at
/// a time). Packs are interned: a blob names its pack by position.
///
/// A pack can be marked *leaving* (prune has recorded it for deletion): its
/// blobs are still readable ([`BlobIndex::get`] falls back to them), but a
/// blob whose only copy is in a leaving pack does not count as stored for
/// deduplication ([`BlobIndex::contains`]), so a backup stores it again
/// instead of referencing a pack about to be deleted.
///
/// An index can be a *layer* over another ([`BlobIndexBuilder::on`]): it
/// holds only the packs its base does not, and answers for both, so an
/// engine that starts after new index files were written shares the index
/// the engines before it hold and adds only the new files' blobs, where a
/// load of its own would hold a second copy of everything
/// ([`BlobIndex::layers`]). A layer's packs take the positions after its
/// base's.
#[derive(Debug, Default, Clone)]
pub struct BlobIndex {
    /// The index this one is a layer over.
    base: Option<Arc<BlobIndex>>,
    /// The position of this layer's first pack: the packs below it are
    /// the base's.
    first_position: u32,
    pack_ids: Vec<ObjectId>,
    /// This layer's packs, by their positions (from `first_position`).
    pack_positions: HashMap<ObjectId, u32>,
    leaving: Vec<bool>,
    /// Per pack: where its last blob ends, and whether it holds data.
    pack_extents: Vec<PackExtent>,
    blobs: BlobTable<BlobLocation>,
}

/// Where a pack's blobs end, and whether any of them is data.
#[derive(Debug, Default, Clone, Copy)]
struct PackExtent {
    end: u64,
    holds_data: bool,
}

impl BlobIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record a pack's blobs. A blob already known keeps its first
    /// location, unless that one is in a leaving pack and this one is not.
    pub fn add_pack(&mut self, pack: ObjectId, entries: &[PackEntry]) {
        self.add_pack_marked(pack, entries, false);
    }

    /// Record the blobs of a pack prune has marked for deletion: used only
    /// where no other pack has the blob, and never for deduplication.
    pub fn add_leaving_pack(&mut self, pack: ObjectId, entries: &[PackEntry]) {
        self.add_pack_marked(pack, entries, true);
    }

    fn add_pack_marked(&mut self, pack: ObjectId, entries: &[PackEntry], leaving: bool) {
        if self.base_knows_pack(&pack) {
            return;
        }
        let (position, leaving) = self.intern_pack(pack, entries, leaving);
        let first_position = self.first_position;
        for entry in entries {
            let location = BlobLocation::of(position, entry);
            if let Some(known) = self.blobs.insert_or_get(entry.id, location)
                && !leaving
                && self.leaving[(known.pack - first_position) as usize]
            {
                *known = location;
            }
        }
    }

    /// Note `pack` in this layer (leaving or not, as it was first noted)
    /// and where its `entries` end; returns its position and whether it is
    /// leaving.
    fn intern_pack(&mut self, pack: ObjectId, entries: &[PackEntry], leaving: bool) -> (u32, bool) {
        let position = match self.pack_positions.get(&pack) {
            Some(position) => *position,
            None => {
                self.pack_ids.push(pack);
                self.leaving.push(leaving);
                self.pack_extents.push(PackExtent::default());
                let position = self.first_position + (self.pack_ids.len() - 1) as u32;
                self.pack_positions.insert(pack, position);
                position
            }
        };
        let own = (position - self.first_position) as usize;
        let extent = &mut self.pack_extents[own];
        for entry in entries {
            extent.end = extent
                .end
                .max(u64::from(entry.offset) + u64::from(entry.stored_length));
            extent.holds_data |= entry.kind == BlobKind::Data;
        }
        (position, self.leaving[own])
    }

    /// True when a layer below this one holds `pack`: its blobs are known,
    /// and a pack's blobs never change, so it is not noted again.
    fn base_knows_pack(&self, pack: &ObjectId) -> bool {
        self.base.as_ref().is_some_and(|base| base.knows_pack(pack))
    }

    /// The position of `pack`, in this layer or below it.
    fn position_of(&self, pack: &ObjectId) -> Option<u32> {
        match self.pack_positions.get(pack) {
            Some(position) => Some(*position),
            None => self.base.as_ref()?.position_of(pack),
        }
    }

    /// The index (this layer or one below) whose packs hold `position`.
    fn layer_of(&self, position: u32) -> &BlobIndex {
        let mut layer = self;
        while position < layer.first_position {
            layer = layer
                .base
                .as_deref()
                .expect("a position below a layer's first is its base's");
        }
        layer
    }

    /// Whether the pack at `position` is leaving.
    fn leaving_at(&self, position: u32) -> bool {
        let layer = self.layer_of(position);
        layer.leaving[(position - layer.first_position) as usize]
    }

    /// Where the blobs of the pack at `position` end.
    fn extent_at(&self, position: u32) -> PackExtent {
        let layer = self.layer_of(position);
        layer.pack_extents[(position - layer.first_position) as usize]
    }

    /// The number of indexes that answer for this one: 1, or 1 and its
    /// base's layers.
    pub fn layers(&self) -> usize {
        1 + self.base.as_ref().map_or(0, |base| base.layers())
    }

    /// The index this one is a layer over, if any.
    pub fn base(&self) -> Option<&Arc<BlobIndex>> {
        self.base.as_ref()
    }

    /// Merge what was added into the sorted blobs, so that the index holds
    /// 52 bytes a blob and nothing spare ([`BlobTable::compact`]); lookups
    /// are right either way.
    pub fn compact(&mut self) {
        self.blobs.compact();
    }

    /// Where a blob is, if known (in a pack that is not leaving, if any
    /// has it; of a layer, the base's location first, as a load of every
    /// pack would have noted the base's packs first).
    pub fn get(&self, id: &BlobId) -> Option<&BlobLocation> {
        let below = match &self.base {
            Some(base) => match base.get(id) {
                Some(location) if !base.leaving_at(location.pack) => return Some(location),
                below => below,
            },
            None => None,
        };
        match self.blobs.get(id) {
            Some(own) if below.is_none() || !self.leaving_at(own.pack) => Some(own),
            _ => below,
        }
    }

    /// True when the blob is stored in a pack that is not leaving: a
    /// backup may reference it without storing it again.
    pub fn contains(&self, id: &BlobId) -> bool {
        self.get(id)
            .is_some_and(|location| !self.leaving_at(location.pack))
    }

    /// True when prune has marked this pack for deletion.
    pub fn is_leaving(&self, pack: &ObjectId) -> bool {
        self.position_of(pack)
            .is_some_and(|position| self.leaving_at(position))
    }

    /// The pack a location points into.
    pub fn pack_of(&self, location: &BlobLocation) -> ObjectId {
        let layer = self.layer_of(location.pack);
        layer.pack_ids[(location.pack - layer.first_position) as usize]
    }

    /// Where the blobs of `pack` end, if it is known and holds trees only:
    /// the bytes a read of the whole tree pack takes (from its start).
    pub fn tree_pack_end(&self, pack: &ObjectId) -> Option<u64> {
        let extent = self.extent_at(self.position_of(pack)?);
        (!extent.holds_data).then_some(extent.end)
    }

    /// Where the last blob of `pack` known to the index ends, if the pack
    /// is known.
    pub fn blobs_end(&self, pack: &ObjectId) -> Option<u64> {
        Some(self.extent_at(self.position_of(pack)?).end)
    }

    /// True when some index names this pack.
    pub fn knows_pack(&self, pack: &ObjectId) -> bool {
        self.position_of(pack).is_some()
    }

    /// Number of blob locations held: the blobs known, but for a blob
    /// stored again in a pack of a later layer, which counts once in each.
    pub fn len(&self) -> usize {
        self.blobs.len() + self.base.as_ref().map_or(0, |base| base.len())
    }

    /// True when no blob is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of packs known.
    pub fn pack_count(&self) -> usize {
        self.first_position as usize + self.pack_ids.len()
    }

    /// The bytes the index holds, about, with the layers below it: its
    /// blobs (52 bytes each once compacted) and its packs.
    pub fn memory_bytes(&self) -> usize {
        self.layer_memory_bytes() + self.base.as_ref().map_or(0, |base| base.memory_bytes())
    }

    /// The bytes this layer alone holds: what loading it added to the
    /// base's.
    pub fn layer_memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let pack = size_of::<ObjectId>() + size_of::<bool>() + size_of::<PackExtent>();
        // A hash map's bucket: the entry and one control byte.
        let pack_bucket = size_of::<(ObjectId, u32)>() + 1;
        self.blobs.memory_bytes()
            + self.pack_ids.capacity() * pack
            + self.pack_positions.capacity() * pack_bucket
    }
}

/// A [`BlobIndex`] built from many packs at once, as a load builds it:
/// their blobs are gathered as they come and sorted once at the end, where
/// [`BlobIndex::add_pack`] looks each blob up as it adds it and merges
/// every so often (a load of a million blobs took twice as long that way).
/// It gives the same answers: of a blob listed more than once, the index
/// keeps a location in a pack that is not leaving if there is one (the one
/// in the pack noted first), else the one in the leaving pack noted first.
#[derive(Debug, Default)]
pub struct BlobIndexBuilder {
    /// The packs noted so far; no blobs yet.
    index: BlobIndex,
    /// Every blob listed, in the order listed, with duplicates.
    blobs: Vec<(BlobId, BlobLocation)>,
}

impl BlobIndexBuilder {
    /// A builder with no packs.
    pub fn new() -> Self {
        Self::default()
    }

    /// A builder of a layer over `base`: the index it finishes answers
    /// for `base`'s packs and the packs noted here ([`BlobIndex::layers`]).
    pub fn on(base: Arc<BlobIndex>) -> Self {
        BlobIndexBuilder {
            index: BlobIndex {
                first_position: u32::try_from(base.pack_count())
                    .expect("fewer than 2^32 packs in an index"),
                base: Some(base),
                ..BlobIndex::default()
            },
            blobs: Vec::new(),
        }
    }

    /// Note a pack's blobs; `leaving` when prune has marked the pack for
    /// deletion ([`BlobIndex::add_pack`], [`BlobIndex::add_leaving_pack`]).
    /// A pack the base of a layer holds is not noted again: its blobs are
    /// known, and a pack's blobs never change.
    pub fn add_pack(&mut self, pack: ObjectId, entries: &[PackEntry], leaving: bool) {
        if self.index.base_knows_pack(&pack) {
            return;
        }
        let (position, _) = self.index.intern_pack(pack, entries, leaving);
        self.blobs.extend(
            entries
                .iter()
                .map(|entry| (entry.id, BlobLocation::of(position, entry))),
        );
    }

    /// True when some pack noted so far is `pack`.
    pub fn knows_pack(&self, pack: &ObjectId) -> bool {
        self.index.knows_pack(pack)
    }

    /// The index: the blobs sorted by id, one location each.
    pub fn finish(self) -> BlobIndex {
        let BlobIndexBuilder {
            mut index,
            mut blobs,
        } = self;
        // By id, then by the order their packs were noted in.
        blobs.sort_unstable_by_key(|(id, location)| (id.0, location.pack));
        let (leaving, first_position) = (&index.leaving, index.first_position);
        let is_kept = |location: &BlobLocation| !leaving[(location.pack - first_position) as usize];
        let mut kept = 0;
        let mut start = 0;
        while start < blobs.len() {
            let id = blobs[start].0;
            let mut end = start + 1;
            while end < blobs.len() && blobs[end].0 == id {
                end += 1;
            }
            let chosen = (start..end)
                .find(|at| is_kept(&blobs[*at].1))
                .unwrap_or(start);
            blobs[kept] = blobs[chosen];
            kept += 1;
            start = end;
        }
        blobs.truncate(kept);
        index.blobs = BlobTable::from_sorted(blobs);
        index
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_files_round_trip() {
        let entry = PackEntry {
            id: BlobId([9; 32]),
            kind: BlobKind::Tree,
            compression: Compression::Zstd,
            offset: 8,
            stored_length: 100,
            raw_length: 300,
        };
        let file = IndexFile {
            packs: vec![
                (ObjectId([1; 32]), vec![entry]),
                (ObjectId([2; 32]), vec![]),
            ],
        };
        let (id, bytes) = file.encode();
        assert_eq!(id, ObjectId::of(&bytes));
        assert_eq!(IndexFile::decode(&bytes, "i").expect("decodes"), file);
        let mut index = BlobIndex::new();
        for (pack, entries) in &file.packs {
            index.add_pack(*pack, entries);
        }
        let location = index.get(&entry.id).expect("known");
        assert_eq!(index.pack_of(location), ObjectId([1; 32]));
    }

    #[test]
    fn a_blob_only_in_a_leaving_pack_is_readable_but_not_deduplicated_against() {
        let entry = |id: u8| PackEntry {
            id: BlobId([id; 32]),
            kind: BlobKind::Data,
            compression: Compression::None,
            offset: 8,
            stored_length: 1,
            raw_length: 1,
        };
        let (leaving, kept) = (ObjectId([1; 32]), ObjectId([2; 32]));
        let mut index = BlobIndex::new();
        index.add_leaving_pack(leaving, &[entry(1), entry(2)]);
        index.add_pack(kept, &[entry(2)]);
        assert!(!index.contains(&BlobId([1; 32])));
        assert_eq!(index.pack_of(index.get(&BlobId([1; 32])).unwrap()), leaving);
        // The kept copy wins, whichever order the packs came in.
        assert!(index.contains(&BlobId([2; 32])));
        assert_eq!(index.pack_of(index.get(&BlobId([2; 32])).unwrap()), kept);
        assert!(index.is_leaving(&leaving) && !index.is_leaving(&kept));
    }

    /// Blob `k` of the model: ids spread over every prefix, so lookups go
    /// through the prefix table once enough are sorted.
    fn model_id(k: u16) -> BlobId {
        let mut id = [0u8; 32];
        id[..8].copy_from_slice(&(u64::from(k).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_be_bytes());
        id[31] = k as u8;
        BlobId(id)
    }

    proptest::proptest! {
        /// Whatever packs come in, kept or leaving, and wherever merges
        /// happen, every lookup answers what a plain map with the same rule
        /// answers (the first location of a blob, unless that is in a
        /// leaving pack and a later one is not).
        #[test]
        fn lookups_answer_what_a_map_of_every_blob_answers(
            packs in proptest::collection::vec(
                (
                    0u8..40,
                    proptest::bool::weighted(0.2),
                    proptest::collection::vec(0u16..3000, 0..400),
                    proptest::bool::weighted(0.3),
                ),
                1..30,
            ),
        ) {
            let mut index = BlobIndex::new();
            let mut builder = BlobIndexBuilder::new();
            let mut model: HashMap<BlobId, (ObjectId, u32)> = HashMap::new();
            let mut leaving_packs: HashMap<ObjectId, bool> = HashMap::new();
            // Per blob, the packs that list it; per pack, when it was first noted.
            let mut listed: HashMap<BlobId, Vec<ObjectId>> = HashMap::new();
            let mut noted: HashMap<ObjectId, usize> = HashMap::new();
            for (number, (pack, leaving, blobs, compact_after)) in packs.iter().enumerate() {
                let pack = ObjectId([*pack; 32]);
                let leaving = *leaving_packs.entry(pack).or_insert(*leaving);
                let entries: Vec<PackEntry> = blobs
                    .iter()
                    .map(|k| PackEntry {
                        id: model_id(*k),
                        kind: BlobKind::Data,
                        compression: Compression::Zstd,
                        offset: number as u32,
                        stored_length: u32::from(*k),
                        raw_length: 1,
                    })
                    .collect();
                if leaving {
                    index.add_leaving_pack(pack, &entries);
                } else {
                    index.add_pack(pack, &entries);
                }
                builder.add_pack(pack, &entries, leaving);
                let order = noted.len();
                noted.entry(pack).or_insert(order);
                for entry in &entries {
                    listed.entry(entry.id).or_default().push(pack);
                }
                for entry in &entries {
                    let replace = match model.get(&entry.id) {
                        None => true,
                        Some((known, _)) => !leaving && leaving_packs[known],
                    };
                    if replace {
                        model.insert(entry.id, (pack, entry.offset));
                    }
                }
                if *compact_after {
                    index.compact();
                }
                proptest::prop_assert_eq!(index.len(), model.len());
            }
            // Built at once: the same blobs, each in the first noted of its
            // packs that is not leaving, else the first noted.
            let built = builder.finish();
            proptest::prop_assert_eq!(built.len(), model.len());
            proptest::prop_assert_eq!(built.pack_count(), index.pack_count());
            for (id, packs) in &listed {
                let first = |kept: bool| {
                    packs
                        .iter()
                        .filter(|pack| !kept || !leaving_packs[*pack])
                        .min_by_key(|pack| noted[*pack])
                        .copied()
                };
                let expected = first(true).or_else(|| first(false));
                let found = built.get(id).map(|location| built.pack_of(location));
                proptest::prop_assert_eq!(found, expected);
                proptest::prop_assert_eq!(built.contains(id), index.contains(id));
            }
            for k in 0..3000u16 {
                let id = model_id(k);
                let found = index.get(&id).map(|location| (index.pack_of(location), location.offset));
                proptest::prop_assert_eq!(found, model.get(&id).copied(), "blob {}", k);
                let stored = model.get(&id).is_some_and(|(pack, _)| !leaving_packs[pack]);
                proptest::prop_assert_eq!(index.contains(&id), stored, "blob {}", k);
            }
        }
    }

    proptest::proptest! {
        /// An index loaded in layers (the packs split between a base and
        /// the layers over it, some of the base's packs named again above
        /// it) answers every question as the index of all packs built at
        /// once does, and its layers hold each pack once.
        #[test]
        fn an_index_in_layers_answers_as_one_built_at_once(
            packs in proptest::collection::vec(
                (
                    proptest::bool::weighted(0.2),
                    proptest::bool::weighted(0.2),
                    proptest::collection::vec(0u16..2000, 0..300),
                    0usize..3,
                    proptest::bool::weighted(0.2),
                ),
                1..30,
            ),
        ) {
            let pack_id = |number: usize| ObjectId([number as u8 + 1; 32]);
            let entries_of = |number: usize| -> Vec<PackEntry> {
                let (_, trees, blobs, _, _) = &packs[number];
                blobs
                    .iter()
                    .map(|k| PackEntry {
                        id: model_id(*k),
                        kind: if *trees { BlobKind::Tree } else { BlobKind::Data },
                        compression: Compression::Zstd,
                        offset: 8 + number as u32,
                        stored_length: 1 + u32::from(*k),
                        raw_length: 1,
                    })
                    .collect()
            };
            // In the order a load notes them: layer by layer.
            let mut order: Vec<usize> = (0..packs.len()).collect();
            order.sort_by_key(|number| packs[*number].3);
            let mut flat = BlobIndexBuilder::new();
            for number in &order {
                flat.add_pack(pack_id(*number), &entries_of(*number), packs[*number].0);
            }
            let flat = flat.finish();
            // The first two layers built at once, the third grown pack by
            // pack ([`BlobIndex::add_pack`]).
            let mut layered: Option<Arc<BlobIndex>> = None;
            for layer in 0..3 {
                let mut builder = match &layered {
                    Some(base) => BlobIndexBuilder::on(base.clone()),
                    None => BlobIndexBuilder::new(),
                };
                let mut grown = None;
                for number in &order {
                    let (leaving, _, _, in_layer, named_again) = packs[*number];
                    if in_layer == layer || (in_layer < layer && named_again) {
                        let (pack, entries) = (pack_id(*number), entries_of(*number));
                        if layer < 2 {
                            builder.add_pack(pack, &entries, leaving);
                            continue;
                        }
                        let index = grown.get_or_insert_with(|| {
                            std::mem::take(&mut builder).finish()
                        });
                        if leaving {
                            index.add_leaving_pack(pack, &entries);
                        } else {
                            index.add_pack(pack, &entries);
                        }
                    }
                }
                layered = Some(Arc::new(grown.unwrap_or_else(|| builder.finish())));
            }
            let layered = layered.expect("three layers");
            proptest::prop_assert_eq!(layered.layers(), 3);
            proptest::prop_assert_eq!(layered.pack_count(), flat.pack_count());
            proptest::prop_assert_eq!(layered.pack_count(), packs.len());
            for number in 0..packs.len() {
                let pack = pack_id(number);
                proptest::prop_assert!(layered.knows_pack(&pack));
                proptest::prop_assert_eq!(layered.is_leaving(&pack), flat.is_leaving(&pack));
                proptest::prop_assert_eq!(layered.blobs_end(&pack), flat.blobs_end(&pack));
                proptest::prop_assert_eq!(layered.tree_pack_end(&pack), flat.tree_pack_end(&pack));
            }
            proptest::prop_assert!(!layered.knows_pack(&ObjectId([0; 32])));
            for k in 0..2000u16 {
                let id = model_id(k);
                let found = |index: &BlobIndex| {
                    index.get(&id).map(|location| (index.pack_of(location), *location))
                };
                // The same positions too: a layer's packs follow its base's.
                proptest::prop_assert_eq!(found(&layered), found(&flat), "blob {}", k);
                proptest::prop_assert_eq!(layered.contains(&id), flat.contains(&id), "blob {}", k);
            }
        }
    }

    #[test]
    fn an_index_grown_and_compacted_finds_every_blob_in_52_bytes_each() {
        let entries: Vec<PackEntry> = (0..20_000u32)
            .map(|k| {
                let mut id = [0u8; 32];
                id[..4].copy_from_slice(&k.wrapping_mul(2_654_435_761).to_be_bytes());
                id[4..8].copy_from_slice(&k.to_le_bytes());
                PackEntry {
                    id: BlobId(id),
                    kind: BlobKind::Data,
                    compression: Compression::None,
                    offset: k,
                    stored_length: 1,
                    raw_length: 1,
                }
            })
            .collect();
        let mut index = BlobIndex::new();
        for (number, pack) in entries.chunks(300).enumerate() {
            index.add_pack(ObjectId([number as u8; 32]), pack);
        }
        index.compact();
        assert!(index.blobs.is_compact());
        for entry in &entries {
            assert_eq!(
                index.get(&entry.id).map(|location| location.offset),
                Some(entry.offset)
            );
        }
        assert_eq!(index.len(), entries.len());
        assert_eq!(std::mem::size_of::<(BlobId, BlobLocation)>(), 52);
    }

    #[test]
    fn packs_are_grouped_into_index_files_of_at_most_the_bound_in_their_order() {
        let pack = |number: u8, blobs: usize| {
            let entry = PackEntry {
                id: BlobId([number; 32]),
                kind: BlobKind::Data,
                compression: Compression::None,
                offset: 8,
                stored_length: 1,
                raw_length: 1,
            };
            (ObjectId([number; 32]), vec![entry; blobs])
        };
        let most = MAX_BLOBS_PER_INDEX_FILE;
        let groups = index_file_groups(vec![
            pack(1, most / 2),
            pack(2, most / 2),
            pack(3, 1),
            pack(4, most + 1),
            pack(5, 0),
            pack(6, most),
        ]);
        let numbers: Vec<Vec<u8>> = groups
            .iter()
            .map(|group| group.iter().map(|(pack, _)| pack.0[0]).collect())
            .collect();
        assert_eq!(numbers, [vec![1, 2], vec![3], vec![4], vec![5, 6]]);
        assert!(index_file_groups(Vec::new()).is_empty());
        assert_eq!(
            index_files_needed([most / 2, most / 2, 1, most + 1, 0, most]),
            4,
            "as many as the groups"
        );
        assert_eq!(index_files_needed([]), 0);
    }

    #[test]
    fn a_pack_of_trees_only_tells_where_its_blobs_end() {
        let entry = |id: u8, kind, offset, stored_length| PackEntry {
            id: BlobId([id; 32]),
            kind,
            compression: Compression::Zstd,
            offset,
            stored_length,
            raw_length: 1,
        };
        let (trees, mixed) = (ObjectId([1; 32]), ObjectId([2; 32]));
        let mut index = BlobIndex::new();
        index.add_pack(
            trees,
            &[
                entry(1, BlobKind::Tree, 500, 20),
                entry(2, BlobKind::Tree, 8, 40),
            ],
        );
        // Listed again by a second index: the blob already known counts.
        index.add_pack(trees, &[entry(1, BlobKind::Tree, 500, 20)]);
        index.add_pack(
            mixed,
            &[
                entry(3, BlobKind::Tree, 8, 10),
                entry(4, BlobKind::Data, 18, 10),
            ],
        );
        assert_eq!(index.tree_pack_end(&trees), Some(520));
        assert_eq!(index.tree_pack_end(&mixed), None, "holds data");
        assert_eq!(index.tree_pack_end(&ObjectId([3; 32])), None, "unknown");
    }
}
