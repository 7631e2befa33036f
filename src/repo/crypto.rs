//! Encryption at rest (format 2): the master key, the keys derived from it,
//! and sealing with AES-256-GCM.
//!
//! A repository of format 2 has one random 32-byte master key, never stored
//! in plaintext (key files wrap it, see [`crate::keyfile`]). From it, with
//! BLAKE3's key derivation, come the object key (AES-256-GCM, seals every
//! pack blob, pack trailer, index file, snapshot manifest, lock and
//! maintenance record), the chunk-id key and the chunker's gear seed.
//!
//! A sealed object is `nonce (12 random bytes) ‖ ciphertext ‖ tag (16
//! bytes)`. The associated data says what the object is ([`Sealed`]): a blob
//! is bound to its kind and id, other objects to their kind, so an object
//! moved to another name or kind is refused even when it was sealed with the
//! same key.
//!
//! Random nonces of 96 bits: the collision bound of AES-GCM keeps one key
//! safe for about 2^32 sealed objects (NIST SP 800-38D), which at the
//! default 1 MiB chunks is several PiB of unique data in one repository.
//!
//! Pure: the caller brings the randomness (`&mut impl CryptoRng`).

use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use rand_core::CryptoRng;
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::{BlobId, BlobKind};

/// Bytes of the random nonce in front of every sealed object.
pub const NONCE_BYTES: usize = 12;
/// Bytes of the authentication tag at the end of every sealed object.
pub const TAG_BYTES: usize = 16;
/// How many bytes sealing adds.
pub const SEAL_OVERHEAD: usize = NONCE_BYTES + TAG_BYTES;
/// Bytes of the master key.
pub const MASTER_KEY_BYTES: usize = 32;

/// Context strings for BLAKE3 key derivation from the master key; changing
/// one makes every repository of format 2 unreadable.
const OBJECT_KEY_CONTEXT: &str = "haulage 2026-12 repository v2 object key";
pub(crate) const CHUNK_ID_KEY_CONTEXT: &str = "haulage 2026-12 repository v2 chunk id key";
pub(crate) const GEAR_SEED_CONTEXT: &str = "haulage 2026-12 repository v2 chunker gear seed";

/// The AEAD a repository seals with, as recorded in its config and key files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cipher {
    /// AES-256 in Galois/Counter Mode (RustCrypto `aes-gcm`, AES-NI/VAES
    /// when the CPU has them): 3.5 GiB/s per core here against 1.3 GiB/s
    /// for XChaCha20-Poly1305 (docs/benchmarks.md).
    #[serde(rename = "aes-256-gcm")]
    Aes256Gcm,
}

impl Cipher {
    /// The name written into configs and key files.
    pub fn name(self) -> &'static str {
        match self {
            Cipher::Aes256Gcm => "aes-256-gcm",
        }
    }
}

/// The repository's random master key. Zeroed when dropped; `Debug` never
/// shows it.
#[derive(Clone)]
pub struct MasterKey(Zeroizing<[u8; MASTER_KEY_BYTES]>);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// A new random master key from `random` (the caller's OS entropy).
    pub fn generate(random: &mut impl CryptoRng) -> Self {
        let mut bytes = Zeroizing::new([0u8; MASTER_KEY_BYTES]);
        random.fill_bytes(bytes.as_mut());
        MasterKey(bytes)
    }

    /// A master key from its bytes (unwrapped from a key file).
    pub fn from_bytes(bytes: [u8; MASTER_KEY_BYTES]) -> Self {
        MasterKey(Zeroizing::new(bytes))
    }

    /// The raw bytes, for wrapping into a key file.
    pub fn as_bytes(&self) -> &[u8; MASTER_KEY_BYTES] {
        &self.0
    }

    /// A 32-byte key derived from the master key for `context`.
    pub(crate) fn derive(&self, context: &str) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(blake3::derive_key(context, self.0.as_ref()))
    }

    /// The key that seals objects.
    pub fn object_key(&self) -> ObjectKey {
        ObjectKey::new(&self.derive(OBJECT_KEY_CONTEXT))
    }
}

/// What a sealed object is: bound into the associated data so an object
/// presented as something else fails authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealed<'a> {
    /// A blob in a pack, bound to its kind and id.
    Blob {
        /// Data or tree.
        kind: BlobKind,
        /// The blob's id.
        id: &'a BlobId,
    },
    /// The trailer (blob list) of a pack.
    PackTrailer,
    /// An index file.
    Index,
    /// A snapshot manifest.
    Snapshot,
    /// A lock object.
    Lock,
    /// The record of packs waiting to be deleted by prune.
    DeletionCandidates,
    /// The repository config's parameters (sealed empty: an authenticator).
    Config,
    /// The master key inside a key file.
    MasterKey,
}

impl Sealed<'_> {
    /// The label that starts the associated data.
    fn label(&self) -> &'static [u8] {
        match self {
            Sealed::Blob { .. } => b"haulage v2 blob",
            Sealed::PackTrailer => b"haulage v2 pack trailer",
            Sealed::Index => b"haulage v2 index",
            Sealed::Snapshot => b"haulage v2 snapshot",
            Sealed::Lock => b"haulage v2 lock",
            Sealed::DeletionCandidates => b"haulage v2 deletion candidates",
            Sealed::Config => b"haulage v2 config",
            Sealed::MasterKey => b"haulage v2 master key",
        }
    }

    /// `label ‖ 0x00 ‖ extra`, where `extra` is the blob's kind code and
    /// id for a blob and `context` for the others.
    pub fn associated_data(&self, context: &[u8]) -> Vec<u8> {
        let label = self.label();
        let mut data = Vec::with_capacity(label.len() + 1 + 33 + context.len());
        data.extend_from_slice(label);
        data.push(0);
        if let Sealed::Blob { kind, id } = self {
            data.push(kind.code());
            data.extend_from_slice(&id.0);
        }
        data.extend_from_slice(context);
        data
    }

    /// For messages: what was being opened.
    pub fn describe(&self) -> String {
        match self {
            Sealed::Blob { kind, id } => format!("{kind:?} blob {id}").to_lowercase(),
            Sealed::PackTrailer => "pack trailer".into(),
            Sealed::Index => "index file".into(),
            Sealed::Snapshot => "snapshot manifest".into(),
            Sealed::Lock => "lock".into(),
            Sealed::DeletionCandidates => "deletion candidates record".into(),
            Sealed::Config => "repository config".into(),
            Sealed::MasterKey => "key file".into(),
        }
    }
}

/// A sealed object that does not open: damaged, truncated, swapped for
/// another object, or sealed with another key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Shorter than a nonce and a tag.
    #[error("sealed {what} is truncated: {length} bytes, at least {SEAL_OVERHEAD} expected")]
    Truncated {
        /// What was opened.
        what: String,
        /// Its length.
        length: usize,
    },
    /// The tag does not match.
    #[error(
        "sealed {what} failed authentication: its bytes were changed, truncated, or it is another object put in its place"
    )]
    Authentication {
        /// What was opened.
        what: String,
    },
}

/// The AES-256-GCM key that seals a repository's objects.
#[derive(Clone)]
pub struct ObjectKey {
    cipher: Aes256Gcm,
}

impl std::fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObjectKey(aes-256-gcm)")
    }
}

impl ObjectKey {
    /// A key from 32 bytes.
    pub fn new(key: &[u8; 32]) -> Self {
        ObjectKey {
            cipher: Aes256Gcm::new(key.into()),
        }
    }

    /// Encrypt `body` in place (it becomes the ciphertext followed by the
    /// tag) and return the nonce that goes in front of it. `body` grows by
    /// [`TAG_BYTES`]; give it that much spare capacity to avoid a copy.
    pub fn seal_in_place(
        &self,
        random: &mut impl CryptoRng,
        what: Sealed<'_>,
        context: &[u8],
        body: &mut Vec<u8>,
    ) -> [u8; NONCE_BYTES] {
        let mut nonce = [0u8; NONCE_BYTES];
        random.fill_bytes(&mut nonce);
        let associated = what.associated_data(context);
        let tag = self
            .cipher
            .encrypt_inout_detached(&Nonce::from(nonce), &associated, body.as_mut_slice().into())
            .expect("AES-GCM seals messages below 64 GiB");
        body.extend_from_slice(&tag);
        nonce
    }

    /// `nonce ‖ ciphertext ‖ tag` of `plaintext`.
    pub fn seal(
        &self,
        random: &mut impl CryptoRng,
        what: Sealed<'_>,
        context: &[u8],
        plaintext: &[u8],
    ) -> Vec<u8> {
        let mut body = Vec::with_capacity(plaintext.len() + SEAL_OVERHEAD);
        body.extend_from_slice(&[0u8; NONCE_BYTES]);
        body.extend_from_slice(plaintext);
        let mut nonce = [0u8; NONCE_BYTES];
        random.fill_bytes(&mut nonce);
        body[..NONCE_BYTES].copy_from_slice(&nonce);
        let associated = what.associated_data(context);
        let tag = self
            .cipher
            .encrypt_inout_detached(
                &Nonce::from(nonce),
                &associated,
                body[NONCE_BYTES..].as_mut().into(),
            )
            .expect("AES-GCM seals messages below 64 GiB");
        body.extend_from_slice(&tag);
        body
    }

    /// Check and decrypt `nonce ‖ ciphertext ‖ tag`.
    pub fn open(
        &self,
        what: Sealed<'_>,
        context: &[u8],
        sealed: &[u8],
    ) -> Result<Vec<u8>, OpenError> {
        if sealed.len() < SEAL_OVERHEAD {
            return Err(OpenError::Truncated {
                what: what.describe(),
                length: sealed.len(),
            });
        }
        let nonce: [u8; NONCE_BYTES] = sealed[..NONCE_BYTES].try_into().expect("12 bytes");
        let tag_start = sealed.len() - TAG_BYTES;
        let tag: [u8; TAG_BYTES] = sealed[tag_start..].try_into().expect("16 bytes");
        let mut plaintext = sealed[NONCE_BYTES..tag_start].to_vec();
        let associated = what.associated_data(context);
        self.cipher
            .decrypt_inout_detached(
                &Nonce::from(nonce),
                &associated,
                plaintext.as_mut_slice().into(),
                &Tag::from(tag),
            )
            .map_err(|_| OpenError::Authentication {
                what: what.describe(),
            })?;
        Ok(plaintext)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> ObjectKey {
        MasterKey::generate(&mut rand::rng()).object_key()
    }

    #[test]
    fn sealing_in_place_and_sealing_a_copy_open_alike() {
        let key = key();
        let id = BlobId([3; 32]);
        let what = Sealed::Blob {
            kind: BlobKind::Data,
            id: &id,
        };
        let mut body = b"secret chunk".to_vec();
        let nonce = key.seal_in_place(&mut rand::rng(), what, &[], &mut body);
        let mut stored = nonce.to_vec();
        stored.extend_from_slice(&body);
        assert_eq!(key.open(what, &[], &stored).unwrap(), b"secret chunk");
        let copy = key.seal(&mut rand::rng(), what, &[], b"secret chunk");
        assert_eq!(copy.len(), 12 + SEAL_OVERHEAD);
        assert_eq!(key.open(what, &[], &copy).unwrap(), b"secret chunk");
    }

    #[test]
    fn a_blob_opened_as_another_blob_or_kind_is_refused() {
        let key = key();
        let (first, second) = (BlobId([1; 32]), BlobId([2; 32]));
        let sealed = key.seal(
            &mut rand::rng(),
            Sealed::Blob {
                kind: BlobKind::Data,
                id: &first,
            },
            &[],
            b"x",
        );
        let other_id = Sealed::Blob {
            kind: BlobKind::Data,
            id: &second,
        };
        let other_kind = Sealed::Blob {
            kind: BlobKind::Tree,
            id: &first,
        };
        for what in [other_id, other_kind, Sealed::Index] {
            let error = key.open(what, &[], &sealed).expect_err("must refuse");
            assert!(matches!(error, OpenError::Authentication { .. }), "{error}");
        }
    }

    #[test]
    fn another_key_cannot_open() {
        let sealed = key().seal(&mut rand::rng(), Sealed::Snapshot, &[], b"manifest");
        let error = key()
            .open(Sealed::Snapshot, &[], &sealed)
            .expect_err("must refuse");
        assert!(error.to_string().contains("snapshot manifest"), "{error}");
    }

    proptest! {
        #[test]
        fn any_flipped_bit_or_truncation_is_refused(
            plaintext in proptest::collection::vec(any::<u8>(), 0..300),
            position in any::<usize>(),
            bit in 0u8..8,
            cut in any::<usize>(),
        ) {
            let key = key();
            let sealed = key.seal(&mut rand::rng(), Sealed::Index, b"ctx", &plaintext);
            prop_assert_eq!(key.open(Sealed::Index, b"ctx", &sealed).unwrap(), plaintext.clone());
            let mut flipped = sealed.clone();
            let position = position % flipped.len();
            flipped[position] ^= 1 << bit;
            prop_assert!(key.open(Sealed::Index, b"ctx", &flipped).is_err());
            let cut = cut % sealed.len();
            prop_assert!(key.open(Sealed::Index, b"ctx", &sealed[..cut]).is_err());
            prop_assert!(key.open(Sealed::Index, b"other", &sealed).is_err());
        }
    }
}
