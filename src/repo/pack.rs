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
//!
//! Format 2 (encrypted) packs:
//!
//! ```text
//! "HLGPACK2"                                   8 bytes
//! sealed blobs, back to back                   each: nonce [12] | ciphertext | tag [16]
//! sealed trailer                               nonce [12] | sealed (entries ‖ count) | tag [16]
//! sealed trailer length u32                    4 bytes
//! "HLGPEND2"                                   8 bytes
//! ```
//!
//! Each blob is sealed on its own (bound to its kind and id), so one ranged
//! read of its stored bytes still reads one blob; the stored length in the
//! entries is the sealed length.

use rand_core::CryptoRng;

use super::crypto::{ObjectKey, SEAL_OVERHEAD, Sealed};
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
/// First bytes of every format 2 pack.
pub const SEALED_PACK_MAGIC: &[u8; 8] = b"HLGPACK2";
/// Last bytes of every format 2 pack.
pub const SEALED_PACK_END_MAGIC: &[u8; 8] = b"HLGPEND2";
/// Size of the fixed end of a format 2 pack (trailer length, magic).
pub const SEALED_TRAILER_TAIL_BYTES: usize = 4 + 8;

/// Which pack layout: the repository's format decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackFormat {
    /// Format 1: plaintext blobs, checksummed trailer.
    Plain,
    /// Format 2: sealed blobs, sealed trailer.
    Sealed,
}

impl PackFormat {
    /// The first 8 bytes of a pack of this format.
    pub fn magic(self) -> &'static [u8; 8] {
        match self {
            PackFormat::Plain => PACK_MAGIC,
            PackFormat::Sealed => SEALED_PACK_MAGIC,
        }
    }

    /// How many bytes at the end of a pack say how long its trailer is.
    pub fn tail_bytes(self) -> usize {
        match self {
            PackFormat::Plain => TRAILER_TAIL_BYTES,
            PackFormat::Sealed => SEALED_TRAILER_TAIL_BYTES,
        }
    }
}

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
    format: PackFormat,
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
        Self::with_format(bytes, PackFormat::Plain)
    }

    /// An empty pack of `format` whose buffer holds `bytes` without growing.
    pub fn with_format(bytes: usize, format: PackFormat) -> Self {
        Self::in_buffer(Vec::with_capacity(bytes), format)
    }

    /// An empty pack of `format` written into `buffer` (what it held is
    /// dropped; its capacity kept: a writer of many packs reuses the
    /// buffer of the last one stored, whose memory is already mapped).
    pub fn in_buffer(mut buffer: Vec<u8>, format: PackFormat) -> Self {
        buffer.clear();
        buffer.extend_from_slice(format.magic());
        PackWriter {
            bytes: buffer,
            entries: Vec::new(),
            format,
        }
    }

    /// The layout this pack is written in.
    pub fn format(&self) -> PackFormat {
        self.format
    }

    /// Append a blob's stored bytes (for a sealed pack: already sealed).
    pub fn add(
        &mut self,
        id: BlobId,
        kind: BlobKind,
        compression: Compression,
        stored: &[u8],
        raw_length: u32,
    ) {
        self.add_parts(id, kind, compression, &[stored], raw_length);
    }

    /// Append a blob whose stored bytes come in pieces (a sealed blob's
    /// nonce, then its ciphertext and tag), without joining them first.
    pub fn add_parts(
        &mut self,
        id: BlobId,
        kind: BlobKind,
        compression: Compression,
        parts: &[&[u8]],
        raw_length: u32,
    ) {
        let offset = self.bytes.len() as u32;
        let mut stored_length = 0;
        for part in parts {
            self.bytes.extend_from_slice(part);
            stored_length += part.len();
        }
        self.entries.push(PackEntry {
            id,
            kind,
            compression,
            offset,
            stored_length: stored_length as u32,
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

    /// Append the trailer and name the pack: plaintext for a plain pack,
    /// sealed with `key` for a sealed one.
    pub fn finish_with(self, key: Option<&ObjectKey>, random: &mut impl CryptoRng) -> FinishedPack {
        match (self.format, key) {
            (PackFormat::Sealed, Some(key)) => self.finish_sealed(key, random),
            (PackFormat::Plain, _) => self.finish(),
            (PackFormat::Sealed, None) => panic!("a sealed pack needs its key to finish"),
        }
    }

    fn finish_sealed(mut self, key: &ObjectKey, random: &mut impl CryptoRng) -> FinishedPack {
        let mut trailer = Vec::with_capacity(self.entries.len() * TRAILER_ENTRY_BYTES + 4);
        for entry in &self.entries {
            encode_entry(entry, &mut trailer);
        }
        trailer.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        let sealed = key.seal(random, Sealed::PackTrailer, &[], &trailer);
        self.bytes.extend_from_slice(&sealed);
        self.bytes
            .extend_from_slice(&(sealed.len() as u32).to_le_bytes());
        self.bytes.extend_from_slice(SEALED_PACK_END_MAGIC);
        FinishedPack {
            id: ObjectId::of(&self.bytes),
            bytes: self.bytes,
            entries: self.entries,
        }
    }

    /// Append the plaintext trailer and name the pack (format 1).
    pub fn finish(mut self) -> FinishedPack {
        assert_eq!(
            self.format,
            PackFormat::Plain,
            "a sealed pack finishes with finish_with"
        );
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
    let damaged = damaged_pack(pack);
    let tail = last_bytes(tail, TRAILER_TAIL_BYTES, pack)?;
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
    let damaged = damaged_pack(pack);
    exactly_the_trailer(trailer, trailer_length(trailer, pack)?, "its count", pack)?;
    let body_end = trailer.len() - 40;
    let checksum = &trailer[body_end..body_end + 32];
    if blake3::hash(&trailer[..body_end]).as_bytes() != checksum {
        return Err(damaged("trailer checksum mismatch"));
    }
    let count = read_u32(&trailer[body_end - 4..body_end]) as usize;
    entries_filling_the_pack(
        &trailer[..count * TRAILER_ENTRY_BYTES],
        PACK_MAGIC.len() as u64,
        trailer.len(),
        pack_length,
        &damaged,
    )
}

/// Decode the trailer of a whole pack held in memory.
pub fn decode_pack(bytes: &[u8], pack: &str) -> Result<Vec<PackEntry>, PackError> {
    let trailer = trailer_of_whole_pack(
        bytes,
        (PACK_MAGIC, "not a pack"),
        TRAILER_TAIL_BYTES,
        trailer_length,
        pack,
    )?;
    decode_trailer(trailer, bytes.len() as u64, pack)
}

/// The trailer's entry records decoded ([`decode_entries`], offsets from
/// after the magic) if, after the magic, they and the trailer cover the
/// pack exactly: what both formats' trailers must satisfy.
fn entries_filling_the_pack(
    records: &[u8],
    magic_length: u64,
    trailer_length: usize,
    pack_length: u64,
    damaged: &dyn Fn(&str) -> PackError,
) -> Result<Vec<PackEntry>, PackError> {
    let entries = decode_entries(records, magic_length, damaged)?;
    covering_the_pack(entries, magic_length, trailer_length, pack_length, damaged)
}

/// `entries` if, after the magic, they and the trailer cover the pack
/// exactly (no gap, no overlap, nothing after the trailer).
fn covering_the_pack(
    entries: Vec<PackEntry>,
    magic_length: u64,
    trailer_length: usize,
    pack_length: u64,
    damaged: &dyn Fn(&str) -> PackError,
) -> Result<Vec<PackEntry>, PackError> {
    let end = entries
        .last()
        .map(|entry| u64::from(entry.offset) + u64::from(entry.stored_length))
        .unwrap_or(magic_length);
    if end + trailer_length as u64 != pack_length {
        return Err(damaged(&format!(
            "blobs and trailer cover {} bytes but the pack has {pack_length}",
            end + trailer_length as u64
        )));
    }
    Ok(entries)
}

/// Decode trailer entry records, giving each its offset: `first_offset`
/// plus the stored lengths before it.
fn decode_entries(
    records: &[u8],
    first_offset: u64,
    damaged: &dyn Fn(&str) -> PackError,
) -> Result<Vec<PackEntry>, PackError> {
    let mut entries = Vec::with_capacity(records.len() / TRAILER_ENTRY_BYTES);
    let mut offset = first_offset;
    for record in records.chunks_exact(TRAILER_ENTRY_BYTES) {
        let id = BlobId(record[..32].try_into().expect("32 bytes"));
        let kind = BlobKind::from_code(record[32]).ok_or_else(|| {
            damaged(&format!(
                "blob {} has unknown kind {}",
                id.short(),
                record[32]
            ))
        })?;
        let compression = Compression::from_code(record[33]).ok_or_else(|| {
            damaged(&format!(
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
            offset: u32::try_from(offset).map_err(|_| damaged("blob offsets exceed 4 GiB"))?,
            stored_length,
            raw_length,
        });
        offset += u64::from(stored_length);
    }
    Ok(entries)
}

/// From the last [`SEALED_TRAILER_TAIL_BYTES`] of a format 2 pack, the
/// length of the sealed trailer plus that tail.
pub fn sealed_trailer_length(tail: &[u8], pack: &str) -> Result<usize, PackError> {
    let damaged = damaged_pack(pack);
    let tail = last_bytes(tail, SEALED_TRAILER_TAIL_BYTES, pack)?;
    if &tail[4..12] != SEALED_PACK_END_MAGIC {
        return Err(damaged(
            "end marker missing (truncated, not a pack, or a plaintext pack)",
        ));
    }
    let sealed = read_u32(&tail[..4]) as usize;
    let most = MAX_BLOBS_PER_PACK as usize * TRAILER_ENTRY_BYTES + 4 + SEAL_OVERHEAD;
    if sealed < SEAL_OVERHEAD + 4 || sealed > most {
        return Err(damaged("trailer claims an impossible length"));
    }
    Ok(sealed + SEALED_TRAILER_TAIL_BYTES)
}

/// Open and decode a format 2 trailer (the last [`sealed_trailer_length`]
/// bytes of a pack of `pack_length` bytes), checking that the blobs exactly
/// fill the space before it.
pub fn decode_sealed_trailer(
    key: &ObjectKey,
    trailer: &[u8],
    pack_length: u64,
    pack: &str,
) -> Result<Vec<PackEntry>, PackError> {
    let damaged = damaged_pack(pack);
    exactly_the_trailer(
        trailer,
        sealed_trailer_length(trailer, pack)?,
        "its length field",
        pack,
    )?;
    let plain = key
        .open(
            Sealed::PackTrailer,
            &[],
            &trailer[..trailer.len() - SEALED_TRAILER_TAIL_BYTES],
        )
        .map_err(|error| damaged(&error.to_string()))?;
    if plain.len() < 4 {
        return Err(damaged("trailer has no entry count"));
    }
    let count = read_u32(&plain[plain.len() - 4..]) as usize;
    if count * TRAILER_ENTRY_BYTES + 4 != plain.len() {
        return Err(damaged(&format!(
            "trailer holds {} bytes of entries, its count says {count}",
            plain.len() - 4
        )));
    }
    entries_filling_the_pack(
        &plain[..count * TRAILER_ENTRY_BYTES],
        SEALED_PACK_MAGIC.len() as u64,
        trailer.len(),
        pack_length,
        &damaged,
    )
}

/// Decode the trailer of a whole format 2 pack held in memory.
pub fn decode_sealed_pack(
    key: &ObjectKey,
    bytes: &[u8],
    pack: &str,
) -> Result<Vec<PackEntry>, PackError> {
    let trailer = trailer_of_whole_pack(
        bytes,
        (SEALED_PACK_MAGIC, "not an encrypted pack"),
        SEALED_TRAILER_TAIL_BYTES,
        sealed_trailer_length,
        pack,
    )?;
    decode_sealed_trailer(key, trailer, bytes.len() as u64, pack)
}

/// A [`PackError`] for `pack` from a reason.
fn damaged_pack(pack: &str) -> impl Fn(&str) -> PackError + '_ {
    move |reason| PackError {
        pack: pack.to_string(),
        reason: reason.to_string(),
    }
}

/// The last `length` bytes of `tail`, or an error when it is shorter.
fn last_bytes<'a>(tail: &'a [u8], length: usize, pack: &str) -> Result<&'a [u8], PackError> {
    if tail.len() < length {
        return Err(damaged_pack(pack)("shorter than a trailer"));
    }
    Ok(&tail[tail.len() - length..])
}

/// An error unless `trailer` is the `expected` length that `field` gave.
fn exactly_the_trailer(
    trailer: &[u8],
    expected: usize,
    field: &str,
    pack: &str,
) -> Result<(), PackError> {
    if trailer.len() != expected {
        return Err(damaged_pack(pack)(&format!(
            "trailer is {} bytes, {field} says {expected}",
            trailer.len()
        )));
    }
    Ok(())
}

/// The trailer of a whole pack in memory: after its start marker `magic`
/// (`not_one` says what it is without), the last bytes `trailer_length`
/// reads from its tail of `tail_bytes`.
fn trailer_of_whole_pack<'a>(
    bytes: &'a [u8],
    (magic, not_one): (&[u8], &str),
    tail_bytes: usize,
    trailer_length: fn(&[u8], &str) -> Result<usize, PackError>,
    pack: &str,
) -> Result<&'a [u8], PackError> {
    let damaged = damaged_pack(pack);
    if bytes.len() < magic.len() + tail_bytes || &bytes[..magic.len()] != magic {
        return Err(damaged(&format!("start marker missing ({not_one})")));
    }
    let length = trailer_length(bytes, pack)?;
    if length > bytes.len() - magic.len() {
        return Err(damaged("trailer longer than the pack"));
    }
    Ok(&bytes[bytes.len() - length..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pack_written_into_a_used_buffer_is_the_pack_a_fresh_one_makes() {
        let mut used = PackWriter::with_capacity(4096);
        used.add(
            BlobId([9; 32]),
            BlobKind::Data,
            Compression::None,
            b"left over",
            9,
        );
        let buffer = used.finish().bytes;
        let capacity = buffer.capacity();
        let mut reused = PackWriter::in_buffer(buffer, PackFormat::Plain);
        let mut fresh = PackWriter::with_capacity(4096);
        for writer in [&mut reused, &mut fresh] {
            writer.add(
                BlobId([1; 32]),
                BlobKind::Data,
                Compression::None,
                b"hello",
                5,
            );
        }
        assert_eq!(
            reused.bytes.capacity(),
            capacity,
            "the buffer was not reused"
        );
        let (reused, fresh) = (reused.finish(), fresh.finish());
        assert_eq!(reused.bytes, fresh.bytes);
        assert_eq!(reused.id, fresh.id);
    }

    /// A plaintext pack writer holding one uncompressed data blob, `hello`.
    fn writer_with_hello() -> PackWriter {
        let mut writer = PackWriter::new();
        writer.add(
            BlobId([1; 32]),
            BlobKind::Data,
            Compression::None,
            b"hello",
            5,
        );
        writer
    }

    #[test]
    fn a_pack_is_described_by_its_own_trailer() {
        let mut writer = writer_with_hello();
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
        let mut bytes = writer_with_hello().finish().bytes;
        let position = bytes.len() - TRAILER_TAIL_BYTES - 3;
        bytes[position] ^= 0x40;
        let error = decode_pack(&bytes, "p").expect_err("must fail");
        assert!(error.to_string().contains("checksum"), "{error}");
    }

    #[test]
    fn a_sealed_pack_is_described_by_its_sealed_trailer_and_hides_it() {
        let key = crate::crypto::MasterKey::generate(&mut rand::rng()).object_key();
        let mut writer = PackWriter::with_format(1024, PackFormat::Sealed);
        let id = BlobId([1; 32]);
        let sealed = key.seal(
            &mut rand::rng(),
            Sealed::Blob {
                kind: BlobKind::Data,
                id: &id,
            },
            &[],
            b"hello",
        );
        writer.add(id, BlobKind::Data, Compression::None, &sealed, 5);
        let pack = writer.finish_with(Some(&key), &mut rand::rng());
        assert_eq!(&pack.bytes[..8], SEALED_PACK_MAGIC);
        let entries = decode_sealed_pack(&key, &pack.bytes, "p").expect("decodes");
        assert_eq!(entries, pack.entries);
        assert!(
            !pack.bytes.windows(32).any(|window| window == id.0),
            "the blob id is visible in the pack"
        );
        let mut flipped = pack.bytes.clone();
        let position = flipped.len() - SEALED_TRAILER_TAIL_BYTES - 3;
        flipped[position] ^= 1;
        let error = decode_sealed_pack(&key, &flipped, "p").expect_err("must fail");
        assert!(error.to_string().contains("authentication"), "{error}");
        let truncated = &pack.bytes[..pack.bytes.len() - 1];
        assert!(decode_sealed_pack(&key, truncated, "p").is_err());
    }
}
