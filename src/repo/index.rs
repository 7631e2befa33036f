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

use super::pack::{MAX_BLOBS_PER_PACK, PackEntry};
use super::{BlobId, BlobKind, Compression, ID_LENGTH, ObjectId};

/// First bytes of every index file.
pub const INDEX_MAGIC: &[u8; 8] = b"HLGIDX01";
const INDEX_ENTRY_BYTES: usize = ID_LENGTH + 1 + 1 + 4 + 4 + 4;
/// An index file never decompresses to more than this; larger is corrupt or
/// hostile.
pub(crate) const MAX_INDEX_DECOMPRESSED_BYTES: u64 = 1 << 30;

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
        let mut body = Vec::new();
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
        let mut body = Vec::new();
        zstd::stream::read::Decoder::new(compressed)
            .map_err(|error| damaged(format!("cannot decompress: {error}")))?
            .take(MAX_INDEX_DECOMPRESSED_BYTES)
            .read_to_end(&mut body)
            .map_err(|error| damaged(format!("cannot decompress: {error}")))?;
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

/// All known blobs, for dedup and for reading. Packs are interned so an
/// entry costs about 50 bytes.
///
/// A pack can be marked *leaving* (prune has recorded it for deletion): its
/// blobs are still readable ([`BlobIndex::get`] falls back to them), but a
/// blob whose only copy is in a leaving pack does not count as stored for
/// deduplication ([`BlobIndex::contains`]), so a backup stores it again
/// instead of referencing a pack about to be deleted.
#[derive(Debug, Default, Clone)]
pub struct BlobIndex {
    pack_ids: Vec<ObjectId>,
    pack_positions: HashMap<ObjectId, u32>,
    leaving: Vec<bool>,
    /// Per pack: where its last blob ends, and whether it holds data.
    pack_extents: Vec<PackExtent>,
    blobs: HashMap<BlobId, BlobLocation>,
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
        let position = match self.pack_positions.get(&pack) {
            Some(position) => *position,
            None => {
                self.pack_ids.push(pack);
                self.leaving.push(leaving);
                self.pack_extents.push(PackExtent::default());
                let position = (self.pack_ids.len() - 1) as u32;
                self.pack_positions.insert(pack, position);
                position
            }
        };
        let leaving = self.leaving[position as usize];
        let extent = &mut self.pack_extents[position as usize];
        for entry in entries {
            extent.end = extent
                .end
                .max(u64::from(entry.offset) + u64::from(entry.stored_length));
            extent.holds_data |= entry.kind == BlobKind::Data;
        }
        self.blobs.reserve(entries.len());
        for entry in entries {
            let location = BlobLocation {
                pack: position,
                offset: entry.offset,
                stored_length: entry.stored_length,
                raw_length: entry.raw_length,
                kind: entry.kind,
                compression: entry.compression,
            };
            match self.blobs.entry(entry.id) {
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(location);
                }
                std::collections::hash_map::Entry::Occupied(mut slot) => {
                    if !leaving && self.leaving[slot.get().pack as usize] {
                        slot.insert(location);
                    }
                }
            }
        }
    }

    /// Where a blob is, if known (in a pack that is not leaving, if any
    /// has it).
    pub fn get(&self, id: &BlobId) -> Option<&BlobLocation> {
        self.blobs.get(id)
    }

    /// True when the blob is stored in a pack that is not leaving: a
    /// backup may reference it without storing it again.
    pub fn contains(&self, id: &BlobId) -> bool {
        self.blobs
            .get(id)
            .is_some_and(|location| !self.leaving[location.pack as usize])
    }

    /// True when prune has marked this pack for deletion.
    pub fn is_leaving(&self, pack: &ObjectId) -> bool {
        self.pack_positions
            .get(pack)
            .is_some_and(|position| self.leaving[*position as usize])
    }

    /// The pack a location points into.
    pub fn pack_of(&self, location: &BlobLocation) -> ObjectId {
        self.pack_ids[location.pack as usize]
    }

    /// Where the blobs of `pack` end, if it is known and holds trees only:
    /// the bytes a read of the whole tree pack takes (from its start).
    pub fn tree_pack_end(&self, pack: &ObjectId) -> Option<u64> {
        let extent = self.pack_extents[*self.pack_positions.get(pack)? as usize];
        (!extent.holds_data).then_some(extent.end)
    }

    /// Where the last blob of `pack` known to the index ends, if the pack
    /// is known.
    pub fn blobs_end(&self, pack: &ObjectId) -> Option<u64> {
        Some(self.pack_extents[*self.pack_positions.get(pack)? as usize].end)
    }

    /// True when some index names this pack.
    pub fn knows_pack(&self, pack: &ObjectId) -> bool {
        self.pack_positions.contains_key(pack)
    }

    /// Number of blobs known.
    pub fn len(&self) -> usize {
        self.blobs.len()
    }

    /// True when no blob is known.
    pub fn is_empty(&self) -> bool {
        self.blobs.is_empty()
    }

    /// Number of packs known.
    pub fn pack_count(&self) -> usize {
        self.pack_ids.len()
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
