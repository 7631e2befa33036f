//! The repository format, versions 1 (plaintext) and 2 (encrypted): pure
//! encode and decode, no I/O, no clock, no entropy source of its own.
//!
//! A repository is a set of immutable objects in a store (see
//! `docs/format.md` for the byte layout):
//!
//! - `config`: format version, chunker parameters and the per-repository
//!   secret or the encryption settings ([`config`]);
//! - `keys/<id>`: format 2 only, the master key wrapped by a password
//!   ([`keyfile`], [`crypto`]);
//! - `data/xx/<pack id>`: pack files holding compressed blobs and a trailer
//!   that describes them ([`pack`]);
//! - `index/<index id>`: which blob lives in which pack ([`index`]);
//! - `snapshots/<snapshot id>`: one manifest per backup ([`snapshot`]),
//!   pointing at a root tree blob ([`tree`]);
//! - `locks/<id>` and `maintenance/`: who is using the repository and what
//!   prune has marked for deletion ([`lock`], [`prune`]).
//!
//! [`codec`] is the one place that knows how each object is encoded in
//! each format; [`policy`] decides which snapshots `forget` keeps.
//!
//! Blobs are named by a keyed BLAKE3 hash of their plaintext ([`BlobId`]);
//! packs, indexes and snapshots by the unkeyed BLAKE3 hash of their bytes
//! ([`ObjectId`]), so every object can be checked against its own name.

pub mod blob_table;
pub mod chunker;
pub mod codec;
pub mod config;
pub mod crypto;
pub mod index;
pub mod keyfile;
pub mod lock;
pub mod pack;
pub mod policy;
pub mod prune;
pub mod snapshot;
pub mod tree;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Length in bytes of every id in the repository.
pub const ID_LENGTH: usize = 32;

/// A 32-byte BLAKE3 digest shown as 64 lowercase hex characters.
macro_rules! define_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; ID_LENGTH]);

        impl $name {
            /// The id as 64 lowercase hex characters.
            pub fn to_hex(&self) -> String {
                hex::encode(self.0)
            }

            /// The first 8 hex characters, for humans.
            pub fn short(&self) -> String {
                hex::encode(&self.0[..4])
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.short())
            }
        }

        impl FromStr for $name {
            type Err = IdParseError;
            fn from_str(text: &str) -> Result<Self, Self::Err> {
                let mut bytes = [0u8; ID_LENGTH];
                hex::decode_to_slice(text, &mut bytes).map_err(|_| IdParseError {
                    text: text.chars().take(80).collect(),
                })?;
                Ok($name(bytes))
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                if serializer.is_human_readable() {
                    serializer.serialize_str(&self.to_hex())
                } else {
                    serializer.serialize_bytes(&self.0)
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                if deserializer.is_human_readable() {
                    let text = String::deserialize(deserializer)?;
                    text.parse().map_err(serde::de::Error::custom)
                } else {
                    let bytes = serde_bytes::ByteBuf::deserialize(deserializer)?;
                    let array: [u8; ID_LENGTH] = bytes.as_slice().try_into().map_err(|_| {
                        serde::de::Error::invalid_length(bytes.len(), &"32 bytes")
                    })?;
                    Ok($name(array))
                }
            }
        }
    };
}

define_id!(
    /// Names a blob (a chunk of file content or a tree): the BLAKE3 hash of
    /// its plaintext keyed with the repository's chunk-id key.
    BlobId
);
define_id!(
    /// Names a pack, index or snapshot object: the unkeyed BLAKE3 hash of the
    /// object's bytes as stored.
    ObjectId
);

impl ObjectId {
    /// The id of `bytes` as stored.
    pub fn of(bytes: &[u8]) -> Self {
        ObjectId(*blake3::hash(bytes).as_bytes())
    }
}

/// A string that is not 64 hex characters was given as an id.
#[derive(Debug, thiserror::Error)]
#[error("{text:?} is not a valid id: expected 64 hexadecimal characters")]
pub struct IdParseError {
    text: String,
}

/// What a blob holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlobKind {
    /// A chunk of file content.
    Data,
    /// A directory listing ([`tree::Tree`]).
    Tree,
}

impl BlobKind {
    /// On-disk code.
    pub fn code(self) -> u8 {
        match self {
            BlobKind::Data => 0,
            BlobKind::Tree => 1,
        }
    }

    /// Decode an on-disk code.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(BlobKind::Data),
            1 => Some(BlobKind::Tree),
            _ => None,
        }
    }
}

/// How a blob's bytes are stored in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Compression {
    /// Stored as is (compression would not have made it smaller).
    None,
    /// One zstd frame.
    Zstd,
}

impl Compression {
    /// On-disk code.
    pub fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Zstd => 1,
        }
    }

    /// Decode an on-disk code.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Compression::None),
            1 => Some(Compression::Zstd),
            _ => None,
        }
    }
}

/// Object key of a pack.
pub fn pack_key(id: &ObjectId) -> String {
    let hex = id.to_hex();
    format!("data/{}/{}", &hex[..2], hex)
}

/// Object key of an index file.
pub fn index_key(id: &ObjectId) -> String {
    format!("index/{}", id.to_hex())
}

/// Object key of a snapshot manifest.
pub fn snapshot_key(id: &ObjectId) -> String {
    format!("snapshots/{}", id.to_hex())
}

/// Object key of a backup's checkpoint: a manifest like a snapshot's,
/// naming the trees of what an unfinished backup has stored so far, under
/// the `group` of its source and host (a keyed hash: a backup lists only
/// its own source's).
pub fn checkpoint_key(group: &str, id: &ObjectId) -> String {
    format!("checkpoints/{group}/{}", id.to_hex())
}

/// Key of a head: an empty object whose name says that snapshot `id` is
/// the newest of the source and host of `group` (the checkpoints' group),
/// so a backup finds its parent without reading every snapshot.
pub fn head_key(group: &str, id: &ObjectId) -> String {
    format!("{HEAD_PREFIX}{group}/{}", id.to_hex())
}

/// Key of the repository config object.
pub const CONFIG_KEY: &str = "config";
/// Prefix under which packs live.
pub const DATA_PREFIX: &str = "data/";
/// Prefix under which index files live.
pub const INDEX_PREFIX: &str = "index/";
/// Prefix under which snapshot manifests live.
pub const SNAPSHOT_PREFIX: &str = "snapshots/";
/// Prefix under which the checkpoints of unfinished backups live.
pub const CHECKPOINT_PREFIX: &str = "checkpoints/";
/// Prefix under which the heads of the sources live ([`head_key`]).
pub const HEAD_PREFIX: &str = "heads/";

/// Parse the id out of an object key under `prefix`, ignoring anything that
/// is not a well-formed id (foreign files, temporary names).
pub fn id_from_key(key: &str, prefix: &str) -> Option<ObjectId> {
    let rest = key.strip_prefix(prefix)?;
    let name = rest.rsplit('/').next()?;
    name.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_hex_and_cbor() {
        let id = BlobId([7; 32]);
        let parsed: BlobId = id.to_hex().parse().expect("hex parses");
        assert_eq!(parsed, id);
        let mut encoded = Vec::new();
        ciborium::into_writer(&id, &mut encoded).expect("encode");
        // A byte string of 32 bytes: one header byte, one length byte.
        assert_eq!(encoded.len(), 34);
        let decoded: BlobId = ciborium::from_reader(encoded.as_slice()).expect("decode");
        assert_eq!(decoded, id);
    }

    #[test]
    fn keys_are_parsed_back_into_ids() {
        let id = ObjectId::of(b"pack");
        assert_eq!(id_from_key(&pack_key(&id), DATA_PREFIX), Some(id));
        assert_eq!(id_from_key("data/ab/.tmp-123", DATA_PREFIX), None);
    }
}
