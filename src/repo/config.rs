//! The repository config: format version, chunker parameters, pack size,
//! and what makes chunk ids and chunk boundaries specific to one repository.
//!
//! Format 1 (plaintext) keeps a random `secret` in the config, from which
//! the chunk-id key and the gear seed are derived: it keeps ids specific to
//! one repository, so the presence of a known file cannot be confirmed by
//! comparing ids across repositories, but whoever can read the bucket can
//! read it. Format 2 (encrypted) derives both from the master key instead
//! ([`crate::crypto`]) and records only the cipher and an authenticator:
//! the config's parameters sealed under the master key with an empty
//! plaintext, so a changed parameter, or a wrong master key, is refused.

use serde::{Deserialize, Serialize};

use super::chunker::ChunkerParameters;
use super::codec::ObjectCodec;
use super::crypto::{
    CHUNK_ID_KEY_CONTEXT as V2_CHUNK_ID_KEY_CONTEXT, Cipher,
    GEAR_SEED_CONTEXT as V2_GEAR_SEED_CONTEXT, MasterKey, OpenError, Sealed,
};

/// The newest format this build reads and writes.
pub const FORMAT_VERSION: u32 = 2;
/// Format 1: plaintext.
pub const FORMAT_VERSION_PLAINTEXT: u32 = 1;
/// Format 2: every object sealed under the master key.
pub const FORMAT_VERSION_ENCRYPTED: u32 = 2;

/// Default target size of a pack file, in bytes.
pub const DEFAULT_PACK_TARGET_BYTES: u32 = 16 * 1024 * 1024;

/// Context strings for BLAKE3 key derivation from a format 1 secret;
/// changing them changes every id.
const CHUNK_ID_KEY_CONTEXT: &str = "haulage 2026-11 repository v1 chunk id key";
const GEAR_SEED_CONTEXT: &str = "haulage 2026-11 repository v1 chunker gear seed";

/// The `config` object, stored as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RepoConfig {
    /// Format version of the repository; a binary refuses anything newer
    /// than [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Random id of the repository (hex), for messages and caches.
    pub repository_id: String,
    /// Content-defined chunking parameters; fixed for the repository's
    /// lifetime so that identical data always splits identically.
    pub chunker: ChunkerParameters,
    /// Target pack size in bytes.
    pub pack_target_bytes: u32,
    /// Format 1 only: 32 random bytes (hex) from which the chunk-id key
    /// and gear seed are derived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Format 2 only: the cipher and the config's authenticator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<EncryptionConfig>,
}

/// How a format 2 repository is sealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EncryptionConfig {
    /// The AEAD of every sealed object.
    pub cipher: Cipher,
    /// `nonce ‖ tag` (hex) of an empty plaintext sealed under the object
    /// key with the config's parameters as associated data.
    pub authenticator: String,
}

/// Why a config object could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The object is not a haulage config.
    #[error("repository config is not valid JSON of the expected shape: {0}")]
    Malformed(#[source] serde_json::Error),
    /// The repository was written by a newer haulage.
    #[error(
        "repository uses format version {found}, but this haulage supports up to version {supported}; \
         upgrade haulage to use this repository (nothing was written)"
    )]
    TooNew { found: u32, supported: u32 },
    /// A field holds a value no haulage writes.
    #[error("repository config field {field} is invalid: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// An encrypted repository was opened without its master key.
    #[error("repository is encrypted (format 2): a key is needed to open it")]
    KeyNeeded,
    /// The master key does not authenticate the config.
    #[error(
        "the master key does not open this repository's config: the config was changed, or the key belongs to another repository"
    )]
    KeyMismatch,
}

/// Keys derived from the repository secret or master key.
#[derive(Clone)]
pub struct RepoKeys {
    chunk_id_key: [u8; 32],
    /// Seed XORed into the chunker's gear table.
    pub gear_seed: u64,
}

impl std::fmt::Debug for RepoKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RepoKeys(..)")
    }
}

impl RepoKeys {
    /// The keyed hash that names a blob with this plaintext.
    pub fn blob_id(&self, plaintext: &[u8]) -> super::BlobId {
        super::BlobId(*blake3::keyed_hash(&self.chunk_id_key, plaintext).as_bytes())
    }

    fn derive(secret: &[u8; 32], id_context: &str, seed_context: &str) -> Self {
        let chunk_id_key = blake3::derive_key(id_context, secret);
        let seed_bytes = blake3::derive_key(seed_context, secret);
        let mut seed = u64::from_le_bytes(seed_bytes[..8].try_into().expect("8 bytes"));
        if seed == 0 {
            // A zero seed means "default gear table" to fastcdc.
            seed = 1;
        }
        RepoKeys {
            chunk_id_key,
            gear_seed: seed,
        }
    }
}

impl RepoConfig {
    /// A new plaintext (format 1) config with an id and a secret drawn from
    /// `random` (the caller brings the entropy: this crate reads no OS
    /// source).
    pub fn generate(random: &mut impl rand_core::RngCore) -> Self {
        let mut repository_id = [0u8; 16];
        let mut secret = [0u8; 32];
        random.fill_bytes(&mut repository_id);
        random.fill_bytes(&mut secret);
        RepoConfig {
            format_version: FORMAT_VERSION_PLAINTEXT,
            repository_id: hex::encode(repository_id),
            chunker: ChunkerParameters::default(),
            pack_target_bytes: DEFAULT_PACK_TARGET_BYTES,
            secret: Some(hex::encode(secret)),
            encryption: None,
        }
    }

    /// A new encrypted (format 2) config for `master`.
    pub fn generate_encrypted(random: &mut impl rand_core::CryptoRng, master: &MasterKey) -> Self {
        let mut repository_id = [0u8; 16];
        random.fill_bytes(&mut repository_id);
        let mut config = RepoConfig {
            format_version: FORMAT_VERSION_ENCRYPTED,
            repository_id: hex::encode(repository_id),
            chunker: ChunkerParameters::default(),
            pack_target_bytes: DEFAULT_PACK_TARGET_BYTES,
            secret: None,
            encryption: None,
        };
        let sealed = master.object_key().seal(
            random,
            Sealed::Config,
            &config.authenticated_parameters(Cipher::Aes256Gcm),
            &[],
        );
        config.encryption = Some(EncryptionConfig {
            cipher: Cipher::Aes256Gcm,
            authenticator: hex::encode(sealed),
        });
        config
    }

    /// True for format 2.
    pub fn is_encrypted(&self) -> bool {
        self.format_version >= FORMAT_VERSION_ENCRYPTED
    }

    /// The bytes a format 2 authenticator covers: every field but the
    /// authenticator, in a fixed order.
    fn authenticated_parameters(&self, cipher: Cipher) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&self.format_version.to_le_bytes());
        bytes.extend_from_slice(self.repository_id.as_bytes());
        bytes.push(0);
        for value in [
            self.chunker.min_bytes,
            self.chunker.average_bytes,
            self.chunker.max_bytes,
            u32::from(self.chunker.normalization),
            self.pack_target_bytes,
        ] {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        bytes.extend_from_slice(cipher.name().as_bytes());
        bytes
    }

    /// Serialize for storage.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("config serializes")
    }

    /// Parse and check a stored config. The format version is checked before
    /// anything else so a newer repository is refused with that reason.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct VersionOnly {
            format_version: u32,
        }
        let version: VersionOnly = serde_json::from_slice(bytes).map_err(ConfigError::Malformed)?;
        if version.format_version > FORMAT_VERSION {
            return Err(ConfigError::TooNew {
                found: version.format_version,
                supported: FORMAT_VERSION,
            });
        }
        let config: RepoConfig = serde_json::from_slice(bytes).map_err(ConfigError::Malformed)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        match self.format_version {
            0 => {
                return Err(ConfigError::Invalid {
                    field: "formatVersion",
                    reason: "must be at least 1".into(),
                });
            }
            FORMAT_VERSION_PLAINTEXT => {
                self.secret_bytes()?;
                if self.encryption.is_some() {
                    return Err(ConfigError::Invalid {
                        field: "encryption",
                        reason: "a format 1 repository is not encrypted".into(),
                    });
                }
            }
            _ => {
                if self.secret.is_some() {
                    return Err(ConfigError::Invalid {
                        field: "secret",
                        reason: "an encrypted repository keeps no plaintext secret".into(),
                    });
                }
                let Some(encryption) = &self.encryption else {
                    return Err(ConfigError::Invalid {
                        field: "encryption",
                        reason: "missing from a format 2 config".into(),
                    });
                };
                if hex::decode(&encryption.authenticator).is_err() {
                    return Err(ConfigError::Invalid {
                        field: "encryption.authenticator",
                        reason: "not hexadecimal".into(),
                    });
                }
            }
        }
        self.chunker
            .validate()
            .map_err(|reason| ConfigError::Invalid {
                field: "chunker",
                reason,
            })?;
        if self.pack_target_bytes < 1024 * 1024 || self.pack_target_bytes > 1024 * 1024 * 1024 {
            return Err(ConfigError::Invalid {
                field: "packTargetBytes",
                reason: format!("{} is outside 1 MiB..1 GiB", self.pack_target_bytes),
            });
        }
        Ok(())
    }

    fn secret_bytes(&self) -> Result<[u8; 32], ConfigError> {
        let mut secret = [0u8; 32];
        let text = self.secret.as_deref().ok_or_else(|| ConfigError::Invalid {
            field: "secret",
            reason: "missing from a format 1 config".into(),
        })?;
        hex::decode_to_slice(text, &mut secret).map_err(|_| ConfigError::Invalid {
            field: "secret",
            reason: "expected 64 hexadecimal characters".into(),
        })?;
        Ok(secret)
    }

    /// The keys of a plaintext (format 1) repository, derived from its
    /// secret. An encrypted repository needs [`RepoConfig::open`].
    pub fn keys(&self) -> Result<RepoKeys, ConfigError> {
        if self.is_encrypted() {
            return Err(ConfigError::KeyNeeded);
        }
        let secret = self.secret_bytes()?;
        Ok(RepoKeys::derive(
            &secret,
            CHUNK_ID_KEY_CONTEXT,
            GEAR_SEED_CONTEXT,
        ))
    }

    /// Everything needed to read and write the repository: its keys and the
    /// codec of its objects. A format 2 repository needs its master key,
    /// which is checked against the config's authenticator; a format 1
    /// repository ignores `master`.
    pub fn open(&self, master: Option<&MasterKey>) -> Result<(RepoKeys, ObjectCodec), ConfigError> {
        if !self.is_encrypted() {
            return Ok((self.keys()?, ObjectCodec::Plaintext));
        }
        let master = master.ok_or(ConfigError::KeyNeeded)?;
        let encryption = self.encryption.as_ref().ok_or(ConfigError::KeyNeeded)?;
        let sealed = hex::decode(&encryption.authenticator).map_err(|_| ConfigError::Invalid {
            field: "encryption.authenticator",
            reason: "not hexadecimal".into(),
        })?;
        let object_key = master.object_key();
        object_key
            .open(
                Sealed::Config,
                &self.authenticated_parameters(encryption.cipher),
                &sealed,
            )
            .map_err(|error| match error {
                OpenError::Truncated { .. } | OpenError::Authentication { .. } => {
                    ConfigError::KeyMismatch
                }
            })?;
        let keys = RepoKeys::derive(
            master.as_bytes(),
            V2_CHUNK_ID_KEY_CONTEXT,
            V2_GEAR_SEED_CONTEXT,
        );
        Ok((keys, ObjectCodec::Sealed(std::sync::Arc::new(object_key))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_format_is_refused_with_both_versions_named() {
        let mut config = RepoConfig::generate(&mut rand::rng());
        config.format_version = FORMAT_VERSION + 1;
        let error = RepoConfig::from_json(&config.to_json()).expect_err("must refuse");
        let message = error.to_string();
        assert!(
            message.contains(&format!("version {}", FORMAT_VERSION + 1)),
            "{message}"
        );
        assert!(message.contains("upgrade haulage"), "{message}");
    }

    #[test]
    fn config_round_trips_and_keys_differ_per_repository() {
        let first = RepoConfig::generate(&mut rand::rng());
        let parsed = RepoConfig::from_json(&first.to_json()).expect("parses");
        assert_eq!(parsed, first);
        let second = RepoConfig::generate(&mut rand::rng());
        let data = b"same plaintext";
        assert_ne!(
            first.keys().unwrap().blob_id(data),
            second.keys().unwrap().blob_id(data)
        );
    }

    #[test]
    fn an_encrypted_config_keeps_no_secret_and_opens_only_with_its_master_key() {
        let master = MasterKey::generate(&mut rand::rng());
        let config = RepoConfig::generate_encrypted(&mut rand::rng(), &master);
        let json = String::from_utf8(config.to_json()).unwrap();
        assert!(!json.contains("secret"), "{json}");
        assert!(!json.contains(&hex::encode(master.as_bytes())));
        let parsed = RepoConfig::from_json(json.as_bytes()).expect("parses");
        let (keys, codec) = parsed.open(Some(&master)).expect("opens");
        assert!(codec.is_encrypted());
        assert!(matches!(parsed.keys(), Err(ConfigError::KeyNeeded)));
        assert!(matches!(parsed.open(None), Err(ConfigError::KeyNeeded)));
        let other = MasterKey::generate(&mut rand::rng());
        assert!(matches!(
            parsed.open(Some(&other)),
            Err(ConfigError::KeyMismatch)
        ));
        // The keys come from the master key alone: a repository made with
        // the same master key (never done by init) would share its ids.
        let twin = RepoConfig::generate_encrypted(&mut rand::rng(), &master);
        let (twin_keys, _) = twin.open(Some(&master)).expect("opens");
        assert_eq!(keys.blob_id(b"x"), twin_keys.blob_id(b"x"));
    }

    #[test]
    fn a_changed_parameter_of_an_encrypted_config_is_refused() {
        let master = MasterKey::generate(&mut rand::rng());
        let mut config = RepoConfig::generate_encrypted(&mut rand::rng(), &master);
        config.pack_target_bytes *= 2;
        assert!(matches!(
            config.open(Some(&master)),
            Err(ConfigError::KeyMismatch)
        ));
    }
}
