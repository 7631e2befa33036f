//! Key files (`keys/<id>`): the master key wrapped by a password.
//!
//! A key file is JSON. The password goes through Argon2id with the
//! parameters and salt recorded in the file; the 32-byte result seals the
//! master key with AES-256-GCM. The associated data binds the repository id
//! and the KDF parameters, so a key file copied from another repository, or
//! with its parameters changed, is refused. Several key files may wrap the
//! same master key (one per person or machine); removing one revokes that
//! password without rewriting any data. The file's id is the BLAKE3 of its
//! bytes, like every content-named object.
//!
//! Pure: salt, nonce and creation time come in as arguments.

use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::crypto::{Cipher, MASTER_KEY_BYTES, MasterKey, ObjectKey, OpenError, Sealed};
use super::{ID_LENGTH, ObjectId};

/// The key file layout this build writes and reads.
pub const KEY_FILE_VERSION: u32 = 1;
/// Bytes of a key file's random salt.
pub const SALT_BYTES: usize = 16;
/// Prefix under which key files live.
pub const KEYS_PREFIX: &str = "keys/";

/// Object key of a key file.
pub fn key_file_key(id: &ObjectId) -> String {
    format!("{KEYS_PREFIX}{}", id.to_hex())
}

/// Most Argon2 memory a key file may ask: four times what haulage writes
/// ([`KdfParameters::default`]), within a stage pod's 256Mi limit.
pub const MAX_KDF_MEMORY_KIB: u32 = 4 * 64 * 1024;
/// Most Argon2 passes a key file may ask.
pub const MAX_KDF_ITERATIONS: u32 = 12;
/// Most Argon2 work (memory times passes) a key file may ask: four times
/// what haulage writes, about half a second on one core here.
pub const MAX_KDF_WORK_KIB: u64 = 4 * 64 * 1024 * 3;

/// Argon2id cost parameters, recorded in each key file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KdfParameters {
    /// Memory in KiB.
    pub memory_kib: u32,
    /// Passes over the memory.
    pub iterations: u32,
    /// Lanes.
    pub parallelism: u32,
}

impl Default for KdfParameters {
    /// RFC 9106's second recommended option (64 MiB, 3 passes, 4 lanes):
    /// 0.13 s on one core here in a release build, memory-hard enough that
    /// guessing passwords on GPUs is slow.
    fn default() -> Self {
        KdfParameters {
            memory_kib: 64 * 1024,
            iterations: 3,
            parallelism: 4,
        }
    }
}

impl KdfParameters {
    /// The cheapest parameters Argon2 accepts, for tests only: a key file
    /// made with them is as strong as its password and no stronger.
    pub fn insecure_for_tests() -> Self {
        KdfParameters {
            memory_kib: 64,
            iterations: 1,
            parallelism: 1,
        }
    }

    /// Refuse parameters that would make opening a key file cost more
    /// than [`MAX_KDF_MEMORY_KIB`] of memory or [`MAX_KDF_WORK_KIB`] of
    /// memory passes (a hostile key file in the bucket must not stall or
    /// OOM-kill every agent that opens the repository), or that Argon2
    /// refuses.
    pub fn validate(&self) -> Result<(), String> {
        if self.parallelism == 0 || self.parallelism > 64 {
            return Err(format!("parallelism {} is outside 1..64", self.parallelism));
        }
        if self.memory_kib < 8 * self.parallelism || self.memory_kib > MAX_KDF_MEMORY_KIB {
            return Err(format!(
                "memory {} KiB is outside {}..{MAX_KDF_MEMORY_KIB} KiB (haulage writes {} KiB)",
                self.memory_kib,
                8 * self.parallelism,
                KdfParameters::default().memory_kib
            ));
        }
        if self.iterations == 0 || self.iterations > MAX_KDF_ITERATIONS {
            return Err(format!(
                "iterations {} is outside 1..{MAX_KDF_ITERATIONS} (haulage writes {})",
                self.iterations,
                KdfParameters::default().iterations
            ));
        }
        let work = u64::from(self.memory_kib) * u64::from(self.iterations);
        if work > MAX_KDF_WORK_KIB {
            return Err(format!(
                "memory {} KiB times {} iterations is above {MAX_KDF_WORK_KIB} KiB, four times \
                 what haulage writes",
                self.memory_kib, self.iterations
            ));
        }
        Ok(())
    }

    /// The 32-byte key-encryption key for `password` and `salt`.
    fn derive(&self, password: &[u8], salt: &[u8]) -> Result<Zeroizing<[u8; 32]>, String> {
        self.validate()?;
        let params =
            argon2::Params::new(self.memory_kib, self.iterations, self.parallelism, Some(32))
                .map_err(|error| error.to_string())?;
        let argon =
            argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
        let mut output = Zeroizing::new([0u8; 32]);
        argon
            .hash_password_into(password, salt, output.as_mut())
            .map_err(|error| error.to_string())?;
        Ok(output)
    }
}

/// The KDF section of a key file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KdfRecord {
    /// Always `argon2id`.
    pub algorithm: String,
    /// Argon2 version, 19 (0x13).
    pub version: u32,
    /// Cost parameters.
    #[serde(flatten)]
    pub parameters: KdfParameters,
    /// Random salt (hex).
    pub salt: String,
}

/// A key file as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyFile {
    /// Layout version, [`KEY_FILE_VERSION`].
    pub key_file_version: u32,
    /// The repository whose master key this wraps.
    pub repository_id: String,
    /// When it was made (RFC 3339), for `repo key list`.
    pub created: String,
    /// Host it was made on, for `repo key list`.
    pub hostname: String,
    /// User who made it, for `repo key list`.
    pub username: String,
    /// How the password becomes the wrapping key.
    pub kdf: KdfRecord,
    /// The AEAD of the wrapping.
    pub cipher: Cipher,
    /// `nonce ‖ sealed master key ‖ tag` (hex).
    pub wrapped_master_key: String,
}

/// Why a key file could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyFileError {
    /// Not a key file of the expected shape.
    #[error("key file is not valid: {0}")]
    Malformed(String),
    /// Made by a newer haulage.
    #[error(
        "key file version {found} is newer than this haulage supports ({KEY_FILE_VERSION}); upgrade haulage"
    )]
    TooNew {
        /// The version found.
        found: u32,
    },
    /// Wraps the key of another repository.
    #[error("key file belongs to repository {found}, not {expected}")]
    OtherRepository {
        /// The repository this file names.
        found: String,
        /// The repository being opened.
        expected: String,
    },
    /// The password does not open it (or the file was changed).
    #[error("the password does not open this key file")]
    WrongPassword,
}

/// Everything random or situational a new key file needs, from the caller.
#[derive(Debug, Clone)]
pub struct KeyFileOrigin {
    /// When (RFC 3339).
    pub created: String,
    /// Host name.
    pub hostname: String,
    /// User name.
    pub username: String,
    /// Random salt.
    pub salt: [u8; SALT_BYTES],
}

fn associated_context(repository_id: &str, kdf: &KdfRecord) -> Vec<u8> {
    let mut context = Vec::new();
    context.extend_from_slice(repository_id.as_bytes());
    context.push(0);
    context.extend_from_slice(kdf.algorithm.as_bytes());
    context.push(0);
    for value in [
        kdf.version,
        kdf.parameters.memory_kib,
        kdf.parameters.iterations,
        kdf.parameters.parallelism,
    ] {
        context.extend_from_slice(&value.to_le_bytes());
    }
    context.extend_from_slice(kdf.salt.as_bytes());
    context
}

impl KeyFile {
    /// Wrap `master` with `password`.
    pub fn create(
        random: &mut impl rand_core::CryptoRng,
        master: &MasterKey,
        password: &[u8],
        repository_id: &str,
        parameters: KdfParameters,
        origin: KeyFileOrigin,
    ) -> Result<Self, KeyFileError> {
        let kdf = KdfRecord {
            algorithm: "argon2id".into(),
            version: 0x13,
            parameters,
            salt: hex::encode(origin.salt),
        };
        let wrapping = parameters
            .derive(password, &origin.salt)
            .map_err(KeyFileError::Malformed)?;
        let sealed = ObjectKey::new(&wrapping).seal(
            random,
            Sealed::MasterKey,
            &associated_context(repository_id, &kdf),
            master.as_bytes(),
        );
        Ok(KeyFile {
            key_file_version: KEY_FILE_VERSION,
            repository_id: repository_id.to_string(),
            created: origin.created,
            hostname: origin.hostname,
            username: origin.username,
            kdf,
            cipher: Cipher::Aes256Gcm,
            wrapped_master_key: hex::encode(sealed),
        })
    }

    /// Serialize; returns the bytes and the file's id.
    pub fn encode(&self) -> (ObjectId, Vec<u8>) {
        let bytes = serde_json::to_vec_pretty(self).expect("key file serializes");
        (ObjectId::of(&bytes), bytes)
    }

    /// Parse a stored key file.
    pub fn decode(bytes: &[u8]) -> Result<Self, KeyFileError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct VersionOnly {
            key_file_version: u32,
        }
        let version: VersionOnly = serde_json::from_slice(bytes)
            .map_err(|error| KeyFileError::Malformed(error.to_string()))?;
        if version.key_file_version > KEY_FILE_VERSION {
            return Err(KeyFileError::TooNew {
                found: version.key_file_version,
            });
        }
        let file: KeyFile = serde_json::from_slice(bytes)
            .map_err(|error| KeyFileError::Malformed(error.to_string()))?;
        if file.kdf.algorithm != "argon2id" || file.kdf.version != 0x13 {
            return Err(KeyFileError::Malformed(format!(
                "unknown KDF {} version {}",
                file.kdf.algorithm, file.kdf.version
            )));
        }
        file.kdf
            .parameters
            .validate()
            .map_err(KeyFileError::Malformed)?;
        Ok(file)
    }

    /// Unwrap the master key with `password`. Costs one Argon2 run.
    pub fn open(&self, password: &[u8], repository_id: &str) -> Result<MasterKey, KeyFileError> {
        if self.repository_id != repository_id {
            return Err(KeyFileError::OtherRepository {
                found: self.repository_id.clone(),
                expected: repository_id.to_string(),
            });
        }
        let mut salt = [0u8; SALT_BYTES];
        hex::decode_to_slice(&self.kdf.salt, &mut salt)
            .map_err(|_| KeyFileError::Malformed("salt is not 32 hex characters".into()))?;
        let sealed = hex::decode(&self.wrapped_master_key)
            .map_err(|_| KeyFileError::Malformed("wrappedMasterKey is not hex".into()))?;
        let wrapping = self
            .kdf
            .parameters
            .derive(password, &salt)
            .map_err(KeyFileError::Malformed)?;
        let plaintext = Zeroizing::new(
            ObjectKey::new(&wrapping)
                .open(
                    Sealed::MasterKey,
                    &associated_context(repository_id, &self.kdf),
                    &sealed,
                )
                .map_err(|error| match error {
                    OpenError::Truncated { .. } => {
                        KeyFileError::Malformed("wrappedMasterKey is truncated".into())
                    }
                    OpenError::Authentication { .. } => KeyFileError::WrongPassword,
                })?,
        );
        let bytes: [u8; MASTER_KEY_BYTES] = plaintext
            .as_slice()
            .try_into()
            .map_err(|_| KeyFileError::Malformed("wrapped key is not 32 bytes".into()))?;
        Ok(MasterKey::from_bytes(bytes))
    }
}

/// Parse the id out of a `keys/<64 hex>` object key.
pub fn key_file_id(key: &str) -> Option<ObjectId> {
    let name = key.strip_prefix(KEYS_PREFIX)?;
    (name.len() == 2 * ID_LENGTH)
        .then(|| name.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> KeyFileOrigin {
        KeyFileOrigin {
            created: "2026-12-01T00:00:00Z".into(),
            hostname: "host".into(),
            username: "user".into(),
            salt: [5; SALT_BYTES],
        }
    }

    fn key_file(master: &MasterKey, password: &[u8]) -> KeyFile {
        KeyFile::create(
            &mut rand::rng(),
            master,
            password,
            "repo-1",
            KdfParameters::insecure_for_tests(),
            origin(),
        )
        .expect("creates")
    }

    #[test]
    fn the_right_password_unwraps_the_master_key_and_a_wrong_one_is_refused() {
        let master = MasterKey::generate(&mut rand::rng());
        let file = key_file(&master, b"correct horse");
        let (id, bytes) = file.encode();
        assert_eq!(id, ObjectId::of(&bytes));
        let decoded = KeyFile::decode(&bytes).expect("decodes");
        let opened = decoded.open(b"correct horse", "repo-1").expect("opens");
        assert_eq!(opened.as_bytes(), master.as_bytes());
        assert_eq!(
            decoded.open(b"wrong", "repo-1").expect_err("refused"),
            KeyFileError::WrongPassword
        );
        assert!(!String::from_utf8_lossy(&bytes).contains(&hex::encode(master.as_bytes())));
    }

    #[test]
    fn a_key_file_of_another_repository_or_with_changed_parameters_is_refused() {
        let master = MasterKey::generate(&mut rand::rng());
        let file = key_file(&master, b"pw");
        assert!(matches!(
            file.open(b"pw", "repo-2"),
            Err(KeyFileError::OtherRepository { .. })
        ));
        let mut changed = file.clone();
        changed.kdf.parameters.iterations += 1;
        assert_eq!(
            changed.open(b"pw", "repo-1").expect_err("refused"),
            KeyFileError::WrongPassword
        );
    }

    #[test]
    fn kdf_parameters_up_to_four_times_what_haulage_writes_are_accepted_and_no_more() {
        let written = KdfParameters::default();
        assert_eq!(written.validate(), Ok(()));
        let at = |memory_kib, iterations, parallelism| KdfParameters {
            memory_kib,
            iterations,
            parallelism,
        };
        for accepted in [
            at(4 * written.memory_kib, written.iterations, 4),
            at(written.memory_kib, 4 * written.iterations, 4),
            at(64, 1, 1),
        ] {
            assert_eq!(accepted.validate(), Ok(()), "{accepted:?}");
        }
        for (refused, names) in [
            (at(4 * 1024 * 1024, 1, 4), "memory 4194304 KiB"),
            (at(4 * written.memory_kib + 1, 1, 4), "memory 262145 KiB"),
            (at(written.memory_kib, 13, 4), "iterations 13"),
            (at(4 * written.memory_kib, 4, 4), "times 4 iterations"),
            (at(64, 1, 0), "parallelism 0"),
        ] {
            let why = refused.validate().expect_err("refused");
            assert!(why.contains(names), "{refused:?}: {why}");
        }
    }

    #[test]
    fn hostile_kdf_parameters_are_refused_before_any_work() {
        let master = MasterKey::generate(&mut rand::rng());
        let mut file = key_file(&master, b"pw");
        file.kdf.parameters.memory_kib = u32::MAX;
        let (_, bytes) = file.encode();
        assert!(matches!(
            KeyFile::decode(&bytes),
            Err(KeyFileError::Malformed(_))
        ));
    }
}
