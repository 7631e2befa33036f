//! Object storage behind a repository: a narrow async trait and its backends.
//!
//! A repository is a set of immutable objects named by `/`-separated keys
//! (`config`, `data/ab/ab12…`, `index/…`, `snapshots/…`). Every backend
//! implements [`ObjectStore`]; cross-cutting behaviour (rate limits, caps,
//! retries) wraps a backend and implements the same trait, so the backends
//! themselves contain no throttling logic. Errors are classified into
//! [`StoreError`] variants so the engine never looks at a backend's own error
//! codes.
//!
//! Backends: [`local::LocalStore`] (`file://` URLs and plain paths).

pub mod local;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

/// How a [`ObjectStore::put`] treats an existing object under the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Replace whatever is there. Used for content-named objects, where a
    /// replacement has the same bytes by construction.
    Overwrite,
    /// Fail with [`StoreError::AlreadyExists`] if the key exists. Used where
    /// two writers must not both succeed (the repository config).
    Create,
}

/// What a listing or a `head` says about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// The object's key relative to the store's root, `/`-separated.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
}

/// A storage failure, classified so callers can decide to retry or give up.
///
/// Messages name the store location and key but never credentials or signed
/// URLs.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object does not exist.
    #[error("object {key} not found in {location}")]
    NotFound { location: String, key: String },
    /// A [`PutMode::Create`] put found the key already present.
    #[error("object {key} already exists in {location}")]
    AlreadyExists { location: String, key: String },
    /// The operation may succeed if tried again (timeouts, throttling,
    /// connection resets, 5xx).
    #[error("{operation} {key} on {location} failed, may succeed on retry: {message}")]
    Transient {
        location: String,
        operation: &'static str,
        key: String,
        message: String,
    },
    /// The operation will not succeed without a change by the user
    /// (permissions, missing bucket, full disk, bad configuration).
    #[error("{operation} {key} on {location} failed: {message}")]
    Permanent {
        location: String,
        operation: &'static str,
        key: String,
        message: String,
    },
}

impl StoreError {
    /// True when retrying the same request may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Transient { .. })
    }

    /// True when the error says the object is missing.
    pub fn is_not_found(&self) -> bool {
        matches!(self, StoreError::NotFound { .. })
    }
}

/// The storage operations a repository needs. Keys are relative,
/// `/`-separated, and never start with `/` or contain `..` components.
///
/// Contract (checked by the conformance suite in `tests/engine/store_conformance.rs`
/// for every backend):
/// - a `put` is atomic: a reader sees the whole object or nothing, also when
///   the writer crashes or is cancelled mid-way;
/// - `get` with a range returns exactly those bytes; a range past the end is
///   an error, not a short read;
/// - `list` returns every object under the prefix (recursively), in no
///   particular order, and never in-progress uploads;
/// - `delete` of a missing key succeeds.
#[async_trait]
pub trait ObjectStore: Send + Sync + fmt::Debug {
    /// Store `data` under `key`.
    async fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<(), StoreError>;
    /// Read the object, or the byte range of it.
    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes, StoreError>;
    /// Size of the object.
    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError>;
    /// All objects whose key starts with `prefix`.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError>;
    /// Remove the object; succeeds when it is already gone.
    async fn delete(&self, key: &str) -> Result<(), StoreError>;
    /// Where this store points, for messages (`file:///var/backups/repo`).
    /// Never contains credentials.
    fn location(&self) -> String;
}

/// A shared, type-erased store.
pub type DynStore = Arc<dyn ObjectStore>;

/// Why a repository URL could not be turned into a store.
#[derive(Debug, thiserror::Error)]
pub enum OpenStoreError {
    /// The URL's scheme is not one haulage knows.
    #[error(
        "unsupported repository URL {url:?}: expected file:///path or a local path{hint}"
    )]
    UnsupportedScheme { url: String, hint: &'static str },
    /// The backend could not be set up.
    #[error("cannot open repository location {url}: {message}")]
    Setup { url: String, message: String },
}

/// Open the store a repository URL names: `file:///abs/path`, `file://rel`
/// or a plain path for a local directory.
pub fn open_store(url: &str) -> Result<DynStore, OpenStoreError> {
    if let Some(path) = url.strip_prefix("file://") {
        return Ok(Arc::new(local::LocalStore::new(path)));
    }
    if let Some((scheme, _)) = url.split_once("://") {
        return Err(OpenStoreError::UnsupportedScheme {
            url: url.to_string(),
            hint: if scheme == "s3" {
                " (s3:// locations are not supported by this build yet)"
            } else {
                ""
            },
        });
    }
    Ok(Arc::new(local::LocalStore::new(url)))
}

/// Check that `key` is a relative, normalised object key, so no backend can
/// be tricked into reaching outside its root.
pub(crate) fn validate_key(key: &str) -> bool {
    !key.is_empty()
        && !key.starts_with('/')
        && key
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}
