//! The repository config: format version, chunker parameters, pack size and
//! the per-repository secret from which the chunk-id key and the chunker's
//! gear seed are derived.
//!
//! The secret keeps chunk ids and chunk boundaries specific to one
//! repository, so the presence of a known file cannot be confirmed by
//! comparing ids across repositories. It is not encryption: whoever can read
//! the repository can read the secret.

use serde::{Deserialize, Serialize};

use super::chunker::ChunkerParameters;

/// The newest format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// Default target size of a pack file, in bytes.
pub const DEFAULT_PACK_TARGET_BYTES: u32 = 16 * 1024 * 1024;

/// Context strings for BLAKE3 key derivation; changing them changes every id.
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
    /// 32 random bytes (hex) from which the chunk-id key and gear seed are
    /// derived.
    pub secret: String,
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
}

/// Keys derived from the repository secret.
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
}

impl RepoConfig {
    /// A new config with fresh random id and secret.
    pub fn generate() -> Self {
        RepoConfig {
            format_version: FORMAT_VERSION,
            repository_id: hex::encode(rand::random::<[u8; 16]>()),
            chunker: ChunkerParameters::default(),
            pack_target_bytes: DEFAULT_PACK_TARGET_BYTES,
            secret: hex::encode(rand::random::<[u8; 32]>()),
        }
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
        if self.format_version == 0 {
            return Err(ConfigError::Invalid {
                field: "formatVersion",
                reason: "must be at least 1".into(),
            });
        }
        self.secret_bytes()?;
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
        hex::decode_to_slice(&self.secret, &mut secret).map_err(|_| ConfigError::Invalid {
            field: "secret",
            reason: "expected 64 hexadecimal characters".into(),
        })?;
        Ok(secret)
    }

    /// The keys derived from the secret.
    pub fn keys(&self) -> Result<RepoKeys, ConfigError> {
        let secret = self.secret_bytes()?;
        let chunk_id_key = blake3::derive_key(CHUNK_ID_KEY_CONTEXT, &secret);
        let seed_bytes = blake3::derive_key(GEAR_SEED_CONTEXT, &secret);
        let mut seed = u64::from_le_bytes(seed_bytes[..8].try_into().expect("8 bytes"));
        if seed == 0 {
            // A zero seed means "default gear table" to fastcdc.
            seed = 1;
        }
        Ok(RepoKeys {
            chunk_id_key,
            gear_seed: seed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_format_is_refused_with_both_versions_named() {
        let mut config = RepoConfig::generate();
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
        let first = RepoConfig::generate();
        let parsed = RepoConfig::from_json(&first.to_json()).expect("parses");
        assert_eq!(parsed, first);
        let second = RepoConfig::generate();
        let data = b"same plaintext";
        assert_ne!(
            first.keys().unwrap().blob_id(data),
            second.keys().unwrap().blob_id(data)
        );
    }
}
