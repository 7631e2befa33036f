//! Pack files: many blobs in one object, with a trailer that lists them so
//! the index can be rebuilt from the pack alone.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! "HLGPACK1"                                   8 bytes
//! blob bytes, back to back                     (stored form: raw or one zstd frame)
//! trailer entries, one per blob, in order:     42 bytes each
//!     blob id [32] | kind u8 | compression u8 | stored length u32 | raw length u32
//! entry count u32
//! BLAKE3 of (entries ‖ count) [32]
//! "HLGPEND1"                                   8 bytes
//! ```
//!
//! A blob's offset is implied by the order: 8 plus the stored lengths of the
//! blobs before it. The pack's name is the BLAKE3 of all its bytes.

use super::{BlobId, BlobKind, Compression, ID_LENGTH, ObjectId};

/// First bytes of every pack.
pub const PACK_MAGIC: &[u8; 8] = b"HLGPACK1";
/// Last bytes of every pack.
pub const PACK_END_MAGIC: &[u8; 8] = b"HLGPEND1";
/// Size of one trailer entry.
pub const TRAILER_ENTRY_BYTES: usize = ID_LENGTH + 1 + 1 + 4 + 4;
/// Size of the fixed end of the trailer (count, checksum, magic).
pub const TRAILER_TAIL_BYTES: usize = 4 + 32 + 8;
/// Upper bound on blobs in one pack; a trailer claiming more is corrupt.
pub const MAX_BLOBS_PER_PACK: u32 = 1 << 20;

/// One blob of a pack, as the trailer and the index describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackEntry {
    /// Keyed hash of the plaintext.
    pub id: BlobId,
    /// Data chunk or tree.
    pub kind: BlobKind,
    /// How the bytes are stored.
    pub compression: Compression,
    /// Offset of the stored bytes in the pack.
    pub offset: u32,
    /// Length of the stored bytes.
    pub stored_length: u32,
    /// Length of the plaintext.
    pub raw_length: u32,
}

/// A pack whose trailer or structure is not what this format writes.
#[derive(Debug, thiserror::Error)]
#[error("pack {pack} is damaged: {reason}")]
pub struct PackError {
    /// The pack, when known.
    pub pack: String,
    /// What is wrong.
    pub reason: String,
}

/// Builds one pack in memory.
#[derive(Debug)]
pub struct PackWriter {
    bytes: Vec<u8>,
    entries: Vec<PackEntry>,
}

impl Default for PackWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl PackWriter {
    /// An empty pack.
    pub fn new() -> Self {
        Self::with_capacity(1024 * 1024)
    }

    /// An empty pack whose buffer holds `bytes` without growing, so a pack
    /// filled to its target never doubles its buffer.
    pub fn with_capacity(bytes: usize) -> Self {
        let mut bytes = Vec::with_capacity(bytes);
        bytes.extend_from_slice(PACK_MAGIC);
        PackWriter {
            bytes,
            entries: Vec::new(),
        }
    }

    /// Append a blob's stored bytes.
    pub fn add(
        &mut self,
        id: BlobId,
        kind: BlobKind,
        compression: Compression,
        stored: &[u8],
        raw_length: u32,
    ) {
        let offset = self.bytes.len() as u32;
        self.bytes.extend_from_slice(stored);
        self.entries.push(PackEntry {
            id,
            kind,
            compression,
            offset,
            stored_length: stored.len() as u32,
            raw_length,
        });
    }

    /// Bytes so far (without the trailer).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// True when no blob was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Append the trailer and name the pack.
    pub fn finish(mut self) -> FinishedPack {
        let trailer_start = self.bytes.len();
        for entry in &self.entries {
            encode_entry(entry, &mut self.bytes);
        }
        self.bytes
            .extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        let checksum = blake3::hash(&self.bytes[trailer_start..]);
        self.bytes.extend_from_slice(checksum.as_bytes());
        self.bytes.extend_from_slice(PACK_END_MAGIC);
        FinishedPack {
            id: ObjectId::of(&self.bytes),
            bytes: self.bytes,
            entries: self.entries,
        }
    }
}

/// A complete pack, ready to store.
#[derive(Debug)]
pub struct FinishedPack {
    /// The pack's name.
    pub id: ObjectId,
    /// All bytes of the pack.
    pub bytes: Vec<u8>,
    /// Its blobs.
    pub entries: Vec<PackEntry>,
}

fn encode_entry(entry: &PackEntry, out: &mut Vec<u8>) {
    out.extend_from_slice(&entry.id.0);
    out.push(entry.kind.code());
    out.push(entry.compression.code());
    out.extend_from_slice(&entry.stored_length.to_le_bytes());
    out.extend_from_slice(&entry.raw_length.to_le_bytes());
}

fn read_u32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"))
}

/// From the last [`TRAILER_TAIL_BYTES`] of a pack, the length of the whole
/// trailer (entries plus tail), so a reader can fetch exactly that range.
pub fn trailer_length(tail: &[u8], pack: &str) -> Result<usize, PackError> {
    let damaged = |reason: &str| PackError {
        pack: pack.to_string(),
        reason: reason.to_string(),
    };
    if tail.len() < TRAILER_TAIL_BYTES {
        return Err(damaged("shorter than a trailer"));
    }
    let tail = &tail[tail.len() - TRAILER_TAIL_BYTES..];
    if &tail[36..44] != PACK_END_MAGIC {
        return Err(damaged("end marker missing (truncated or not a pack)"));
    }
    let count = read_u32(&tail[..4]);
    if count > MAX_BLOBS_PER_PACK {
        return Err(damaged("trailer claims an impossible number of blobs"));
    }
    Ok(count as usize * TRAILER_ENTRY_BYTES + TRAILER_TAIL_BYTES)
}

/// Decode a trailer (the last [`trailer_length`] bytes of a pack of
/// `pack_length` bytes) into entries with offsets, checking its checksum and
/// that the blobs exactly fill the space before it.
pub fn decode_trailer(
    trailer: &[u8],
    pack_length: u64,
    pack: &str,
) -> Result<Vec<PackEntry>, PackError> {
    let damaged = |reason: String| PackError {
        pack: pack.to_string(),
        reason,
    };
    let expected = trailer_length(trailer, pack)?;
    if trailer.len() != expected {
        return Err(damaged(format!(
            "trailer is {} bytes, its count says {expected}",
            trailer.len()
        )));
    }
    let body_end = trailer.len() - 40;
    let checksum = &trailer[body_end..body_end + 32];
    if blake3::hash(&trailer[..body_end]).as_bytes() != checksum {
        return Err(damaged("trailer checksum mismatch".into()));
    }
    let count = read_u32(&trailer[body_end - 4..body_end]) as usize;
    let mut entries = Vec::with_capacity(count);
    let mut offset = PACK_MAGIC.len() as u64;
    for record in trailer[..count * TRAILER_ENTRY_BYTES].chunks_exact(TRAILER_ENTRY_BYTES) {
        let id = BlobId(record[..32].try_into().expect("32 bytes"));
        let kind = BlobKind::from_code(record[32]).ok_or_else(|| {
            damaged(format!(
                "blob {} has unknown kind {}",
                id.short(),
                record[32]
            ))
        })?;
        let compression = Compression::from_code(record[33]).ok_or_else(|| {
            damaged(format!(
                "blob {} has unknown compression {}",
                id.short(),
                record[33]
            ))
        })?;
        let stored_length = read_u32(&record[34..38]);
        let raw_length = read_u32(&record[38..42]);
        entries.push(PackEntry {
            id,
            kind,
            compression,
            offset: u32::try_from(offset)
                .map_err(|_| damaged("blob offsets exceed 4 GiB".into()))?,
            stored_length,
            raw_length,
        });
        offset += u64::from(stored_length);
    }
    if offset + trailer.len() as u64 != pack_length {
        return Err(damaged(format!(
            "blobs and trailer cover {} bytes but the pack has {pack_length}",
            offset + trailer.len() as u64
        )));
    }
    Ok(entries)
}

/// Decode the trailer of a whole pack held in memory.
pub fn decode_pack(bytes: &[u8], pack: &str) -> Result<Vec<PackEntry>, PackError> {
    if bytes.len() < PACK_MAGIC.len() + TRAILER_TAIL_BYTES || &bytes[..8] != PACK_MAGIC {
        return Err(PackError {
            pack: pack.to_string(),
            reason: "start marker missing (not a pack)".into(),
        });
    }
    let length = trailer_length(bytes, pack)?;
    if length > bytes.len() - PACK_MAGIC.len() {
        return Err(PackError {
            pack: pack.to_string(),
            reason: "trailer longer than the pack".into(),
        });
    }
    decode_trailer(&bytes[bytes.len() - length..], bytes.len() as u64, pack)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pack_is_described_by_its_own_trailer() {
        let mut writer = PackWriter::new();
        writer.add(
            BlobId([1; 32]),
            BlobKind::Data,
            Compression::None,
            b"hello",
            5,
        );
        writer.add(
            BlobId([2; 32]),
            BlobKind::Tree,
            Compression::Zstd,
            b"xyz",
            40,
        );
        let pack = writer.finish();
        let entries = decode_pack(&pack.bytes, "test").expect("decodes");
        assert_eq!(entries, pack.entries);
        assert_eq!(&pack.bytes[entries[1].offset as usize..][..3], b"xyz");
        assert_eq!(pack.id, ObjectId::of(&pack.bytes));
    }

    #[test]
    fn a_flipped_trailer_byte_is_detected() {
        let mut writer = PackWriter::new();
        writer.add(
            BlobId([1; 32]),
            BlobKind::Data,
            Compression::None,
            b"hello",
            5,
        );
        let mut bytes = writer.finish().bytes;
        let position = bytes.len() - TRAILER_TAIL_BYTES - 3;
        bytes[position] ^= 0x40;
        let error = decode_pack(&bytes, "p").expect_err("must fail");
        assert!(error.to_string().contains("checksum"), "{error}");
    }
}
