//! How each kind of object is written and read in a repository of a given
//! format: the one place that knows whether objects are sealed.
//!
//! [`ObjectCodec::Plaintext`] is format 1, byte for byte as before
//! encryption existed; [`ObjectCodec::Sealed`] is format 2: every blob,
//! pack trailer, index file, snapshot manifest, lock and maintenance record
//! sealed with the repository's object key ([`crate::crypto`]), bound to
//! what it is. Names stay the BLAKE3 of the stored (sealed) bytes.

use std::borrow::Cow;
use std::sync::Arc;

use rand_core::CryptoRng;

use super::crypto::{NONCE_BYTES, ObjectKey, OpenError, SEAL_OVERHEAD, Sealed};
use super::index::{IndexError, IndexFile};
use super::pack::{self, PackEntry, PackError, PackFormat, PackWriter};
use super::snapshot::{Snapshot, SnapshotError};
use super::{BlobId, BlobKind, ObjectId};

/// First bytes of a format 2 index file.
pub const SEALED_INDEX_MAGIC: &[u8; 8] = b"HLGIDX02";
/// First bytes of a format 2 snapshot manifest.
pub const SEALED_SNAPSHOT_MAGIC: &[u8; 8] = b"HLGSNP02";
/// First bytes of a format 2 lock or maintenance record.
pub const SEALED_RECORD_MAGIC: &[u8; 8] = b"HLGREC02";

/// The kinds of small JSON records besides snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A lock object (`locks/<id>`).
    Lock,
    /// Prune's record of packs waiting to be deleted.
    DeletionCandidates,
}

impl RecordKind {
    fn sealed(self) -> Sealed<'static> {
        match self {
            RecordKind::Lock => Sealed::Lock,
            RecordKind::DeletionCandidates => Sealed::DeletionCandidates,
        }
    }
}

/// A record (lock, maintenance record) that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is damaged: {reason}")]
pub struct RecordError {
    /// What was read.
    pub what: String,
    /// What is wrong.
    pub reason: String,
}

/// How objects are encoded in one repository.
#[derive(Debug, Clone)]
pub enum ObjectCodec {
    /// Format 1: nothing sealed.
    Plaintext,
    /// Format 2: everything sealed with this key (shared: the codec is
    /// cloned into every blocking task).
    Sealed(Arc<ObjectKey>),
}

impl ObjectCodec {
    /// True for format 2.
    pub fn is_encrypted(&self) -> bool {
        matches!(self, ObjectCodec::Sealed(_))
    }

    fn key(&self) -> Option<&ObjectKey> {
        match self {
            ObjectCodec::Plaintext => None,
            ObjectCodec::Sealed(key) => Some(key),
        }
    }

    /// The pack layout of this format.
    pub fn pack_format(&self) -> PackFormat {
        match self {
            ObjectCodec::Plaintext => PackFormat::Plain,
            ObjectCodec::Sealed(_) => PackFormat::Sealed,
        }
    }

    /// Bytes sealing adds to each blob (0 in format 1).
    pub fn blob_overhead(&self) -> usize {
        match self {
            ObjectCodec::Plaintext => 0,
            ObjectCodec::Sealed(_) => SEAL_OVERHEAD,
        }
    }

    /// Seal a blob's stored form (raw or zstd) in place, returning the
    /// prefix that goes in front of it in the pack: the nonce in format 2,
    /// nothing in format 1. `body` grows by the tag.
    pub fn seal_blob_in_place(
        &self,
        random: &mut impl CryptoRng,
        kind: BlobKind,
        id: &BlobId,
        body: &mut Vec<u8>,
    ) -> BlobPrefix {
        match self {
            ObjectCodec::Plaintext => BlobPrefix::None,
            ObjectCodec::Sealed(key) => {
                BlobPrefix::Nonce(key.seal_in_place(random, Sealed::Blob { kind, id }, &[], body))
            }
        }
    }

    /// A blob's stored form (raw or zstd) from its bytes in the pack,
    /// checking its seal in format 2. This is all the decryption a blob
    /// needs; decompressing and checking the id are the caller's.
    pub fn open_blob<'a>(
        &self,
        kind: BlobKind,
        id: &BlobId,
        stored: &'a [u8],
    ) -> Result<Cow<'a, [u8]>, OpenError> {
        match self {
            ObjectCodec::Plaintext => Ok(Cow::Borrowed(stored)),
            ObjectCodec::Sealed(key) => key
                .open(Sealed::Blob { kind, id }, &[], stored)
                .map(Cow::Owned),
        }
    }

    /// An empty pack of this format.
    pub fn pack_writer(&self, capacity: usize) -> PackWriter {
        PackWriter::with_format(capacity, self.pack_format())
    }

    /// An empty pack of this format, written into `buffer`.
    pub fn pack_writer_in(&self, buffer: Vec<u8>) -> PackWriter {
        PackWriter::in_buffer(buffer, self.pack_format())
    }

    /// Append the trailer and name the pack.
    pub fn finish_pack(
        &self,
        writer: PackWriter,
        random: &mut impl CryptoRng,
    ) -> pack::FinishedPack {
        writer.finish_with(self.key(), random)
    }

    /// From the pack's last [`PackFormat::tail_bytes`] bytes, the length of
    /// the whole trailer.
    pub fn pack_trailer_length(&self, tail: &[u8], pack: &str) -> Result<usize, PackError> {
        match self {
            ObjectCodec::Plaintext => pack::trailer_length(tail, pack),
            ObjectCodec::Sealed(_) => pack::sealed_trailer_length(tail, pack),
        }
    }

    /// Decode a pack's trailer (its last [`ObjectCodec::pack_trailer_length`] bytes).
    pub fn decode_pack_trailer(
        &self,
        trailer: &[u8],
        pack_length: u64,
        pack: &str,
    ) -> Result<Vec<PackEntry>, PackError> {
        match self {
            ObjectCodec::Plaintext => pack::decode_trailer(trailer, pack_length, pack),
            ObjectCodec::Sealed(key) => {
                pack::decode_sealed_trailer(key, trailer, pack_length, pack)
            }
        }
    }

    /// Decode the trailer of a whole pack held in memory.
    pub fn decode_pack(&self, bytes: &[u8], pack: &str) -> Result<Vec<PackEntry>, PackError> {
        match self {
            ObjectCodec::Plaintext => pack::decode_pack(bytes, pack),
            ObjectCodec::Sealed(key) => pack::decode_sealed_pack(key, bytes, pack),
        }
    }

    /// Encode an index file, returning its id and bytes.
    pub fn encode_index(
        &self,
        file: &IndexFile,
        random: &mut impl CryptoRng,
    ) -> (ObjectId, Vec<u8>) {
        match self {
            ObjectCodec::Plaintext => file.encode(),
            ObjectCodec::Sealed(key) => {
                let compressed =
                    zstd::bulk::compress(&file.encode_body(), 3).expect("in-memory compression");
                let mut bytes = SEALED_INDEX_MAGIC.to_vec();
                bytes.extend_from_slice(&key.seal(random, Sealed::Index, &[], &compressed));
                (ObjectId::of(&bytes), bytes)
            }
        }
    }

    /// Decode an index file's bytes; `index` names it in errors.
    pub fn decode_index(&self, bytes: &[u8], index: &str) -> Result<IndexFile, IndexError> {
        let key = match self {
            ObjectCodec::Plaintext => return IndexFile::decode(bytes, index),
            ObjectCodec::Sealed(key) => key,
        };
        let damaged = |reason: String| IndexError {
            index: index.to_string(),
            reason,
        };
        let sealed = bytes
            .strip_prefix(SEALED_INDEX_MAGIC.as_slice())
            .ok_or_else(|| damaged("start marker of an encrypted index missing".into()))?;
        let compressed = key
            .open(Sealed::Index, &[], sealed)
            .map_err(|error| damaged(error.to_string()))?;
        let body = super::index::decompress_body(&compressed).map_err(damaged)?;
        IndexFile::decode_body(&body, index)
    }

    /// Encode a snapshot manifest, returning its id and bytes.
    pub fn encode_snapshot(
        &self,
        snapshot: &Snapshot,
        random: &mut impl CryptoRng,
    ) -> (ObjectId, Vec<u8>) {
        match self {
            ObjectCodec::Plaintext => snapshot.encode(),
            ObjectCodec::Sealed(key) => {
                let json = serde_json::to_vec(snapshot).expect("snapshot serializes");
                let mut bytes = SEALED_SNAPSHOT_MAGIC.to_vec();
                bytes.extend_from_slice(&key.seal(random, Sealed::Snapshot, &[], &json));
                (ObjectId::of(&bytes), bytes)
            }
        }
    }

    /// Decode a snapshot manifest.
    pub fn decode_snapshot(&self, bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        match self {
            ObjectCodec::Plaintext => Snapshot::decode(bytes),
            ObjectCodec::Sealed(key) => {
                let sealed = bytes
                    .strip_prefix(SEALED_SNAPSHOT_MAGIC.as_slice())
                    .ok_or_else(|| {
                        SnapshotError::Sealed(
                            "start marker of an encrypted manifest missing".into(),
                        )
                    })?;
                let json = key
                    .open(Sealed::Snapshot, &[], sealed)
                    .map_err(|error| SnapshotError::Sealed(error.to_string()))?;
                Snapshot::decode(&json)
            }
        }
    }

    /// Encode a JSON record (lock, maintenance record).
    pub fn encode_record(
        &self,
        kind: RecordKind,
        json: &[u8],
        random: &mut impl CryptoRng,
    ) -> Vec<u8> {
        match self {
            ObjectCodec::Plaintext => json.to_vec(),
            ObjectCodec::Sealed(key) => {
                let mut bytes = SEALED_RECORD_MAGIC.to_vec();
                bytes.extend_from_slice(&key.seal(random, kind.sealed(), &[], json));
                bytes
            }
        }
    }

    /// The JSON of a stored record.
    pub fn decode_record(&self, kind: RecordKind, bytes: &[u8]) -> Result<Vec<u8>, RecordError> {
        match self {
            ObjectCodec::Plaintext => Ok(bytes.to_vec()),
            ObjectCodec::Sealed(key) => {
                let what = kind.sealed().describe();
                let sealed = bytes
                    .strip_prefix(SEALED_RECORD_MAGIC.as_slice())
                    .ok_or_else(|| RecordError {
                        what: what.clone(),
                        reason: "start marker of an encrypted record missing".into(),
                    })?;
                key.open(kind.sealed(), &[], sealed)
                    .map_err(|error| RecordError {
                        what,
                        reason: error.to_string(),
                    })
            }
        }
    }
}

/// What goes in front of a blob's body in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobPrefix {
    /// Format 1: nothing.
    None,
    /// Format 2: the nonce.
    Nonce([u8; NONCE_BYTES]),
}

impl BlobPrefix {
    /// The prefix's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            BlobPrefix::None => &[],
            BlobPrefix::Nonce(nonce) => nonce,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypto::MasterKey;
    use crate::index::IndexFile;
    use crate::snapshot::{RootAttributes, SnapshotSummary};

    fn sealed() -> ObjectCodec {
        ObjectCodec::Sealed(Arc::new(MasterKey::generate(&mut rand::rng()).object_key()))
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            format_version: 2,
            time: "2026-12-01T00:00:00Z".into(),
            hostname: "host".into(),
            source: "ns/claim-with-a-marker".into(),
            tree: BlobId([4; 32]),
            root: RootAttributes::default(),
            parent: None,
            tags: Default::default(),
            claim: None,
            summary: SnapshotSummary::default(),
        }
    }

    #[test]
    fn sealed_indexes_snapshots_and_records_round_trip_and_hide_their_content() {
        let codec = sealed();
        let entry = PackEntry {
            id: BlobId([9; 32]),
            kind: BlobKind::Tree,
            compression: crate::Compression::Zstd,
            offset: 8,
            stored_length: 100,
            raw_length: 300,
        };
        let file = IndexFile {
            packs: vec![(ObjectId([1; 32]), vec![entry])],
        };
        let (id, bytes) = codec.encode_index(&file, &mut rand::rng());
        assert_eq!(id, ObjectId::of(&bytes));
        assert_eq!(codec.decode_index(&bytes, "i").unwrap(), file);

        let (id, bytes) = codec.encode_snapshot(&snapshot(), &mut rand::rng());
        assert_eq!(id, ObjectId::of(&bytes));
        assert!(!bytes.windows(6).any(|window| window == b"marker"));
        assert_eq!(codec.decode_snapshot(&bytes).unwrap(), snapshot());

        let record = codec.encode_record(RecordKind::Lock, b"{\"host\":1}", &mut rand::rng());
        assert_eq!(
            codec.decode_record(RecordKind::Lock, &record).unwrap(),
            b"{\"host\":1}"
        );
        // A lock presented as a deletion record is refused.
        assert!(
            codec
                .decode_record(RecordKind::DeletionCandidates, &record)
                .is_err()
        );
    }

    #[test]
    fn a_snapshot_moved_into_the_index_is_refused() {
        let codec = sealed();
        let (_, bytes) = codec.encode_snapshot(&snapshot(), &mut rand::rng());
        let mut as_index = SEALED_INDEX_MAGIC.to_vec();
        as_index.extend_from_slice(&bytes[8..]);
        let error = codec.decode_index(&as_index, "i").expect_err("refused");
        assert!(error.to_string().contains("authentication"), "{error}");
    }

    #[test]
    fn plaintext_objects_are_the_format_1_bytes() {
        let codec = ObjectCodec::Plaintext;
        let (_, bytes) = codec.encode_snapshot(&snapshot(), &mut rand::rng());
        assert_eq!(bytes, snapshot().encode().1);
        let file = IndexFile::default();
        assert_eq!(
            codec.encode_index(&file, &mut rand::rng()).1,
            file.encode().1
        );
    }
}
