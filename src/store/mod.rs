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
//! Backends: [`local::LocalStore`] (`file://` URLs and plain paths) and
//! [`s3::S3Store`] (`s3://bucket/prefix`). Wrappers: [`retry::RetryStore`]
//! (backoff on transient errors), [`limits::ConcurrencyLimitStore`] (a cap on
//! requests in flight) and [`limits::UploadRateLimitStore`] (an upload
//! bytes-per-second cap), the last two [`layer::Layered`] stores that act
//! before each request and pass it on. [`open_store`] assembles them from a URL and
//! [`StoreOptions`]; [`outage`] waits out a location that stops answering;
//! [`probe::check_location`] proves a location works;
//! [`ranges::get_ranges`] reads many ranges of one object in few requests.

pub mod layer;
pub mod limits;
pub mod local;
pub mod outage;
pub mod probe;
pub mod ranges;
pub mod retry;
pub mod s3;

use std::fmt;
use std::num::NonZeroU64;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    NotFound {
        /// Where the store points ([`ObjectStore::location`]).
        location: String,
        /// The key (or listing prefix) the operation was about.
        key: String,
    },
    /// A [`PutMode::Create`] put found the key already present.
    #[error("object {key} already exists in {location}")]
    AlreadyExists {
        /// Where the store points ([`ObjectStore::location`]).
        location: String,
        /// The key (or listing prefix) the operation was about.
        key: String,
    },
    /// The operation may succeed if tried again (timeouts, throttling,
    /// connection resets, 5xx).
    #[error("{operation} {key} on {location} failed, may succeed on retry: {message}")]
    Transient {
        /// Where the store points ([`ObjectStore::location`]).
        location: String,
        /// The operation that failed (`put`, `get`, `list`, …).
        operation: &'static str,
        /// The key (or listing prefix) the operation was about.
        key: String,
        /// What went wrong and what to check; bounded, no credentials.
        message: String,
        /// What the failure was about, as far as the backend could tell.
        cause: FailureCause,
    },
    /// The operation will not succeed without a change by the user
    /// (permissions, missing bucket, full disk, bad configuration).
    #[error("{operation} {key} on {location} failed: {message}")]
    Permanent {
        /// Where the store points ([`ObjectStore::location`]).
        location: String,
        /// The operation that failed (`put`, `get`, `list`, …).
        operation: &'static str,
        /// The key (or listing prefix) the operation was about.
        key: String,
        /// What went wrong and what to check; bounded, no credentials.
        message: String,
        /// What the failure was about, as far as the backend could tell.
        cause: FailureCause,
    },
}

/// What a [`StoreError::Transient`] or [`StoreError::Permanent`] was about,
/// as far as the backend could tell, so a caller can name the cause (the BSL
/// controller's condition reasons) without reading messages or backend
/// error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureCause {
    /// Nothing more specific is known.
    #[default]
    Other,
    /// The endpoint could not be reached: connection refused or reset, no
    /// route, DNS failure, or no answer in time.
    Unreachable,
    /// The TLS handshake failed: an untrusted or mismatched certificate.
    Tls,
    /// No credentials were available to sign requests.
    CredentialsMissing,
    /// The server refused the credentials or the request: unknown access
    /// key, bad signature, expired token, or no permission.
    AccessDenied,
    /// The bucket does not exist at the endpoint.
    BucketNotFound,
    /// The bucket is served in another region, or by another endpoint.
    WrongRegion,
    /// The server refused requests because the clocks disagree.
    ClockSkew,
    /// The server answered with an internal error.
    ServerError,
    /// The server throttled the request (503 SlowDown, 429): it asks the
    /// client to slow down, not to give up.
    Throttled,
    /// This process (EMFILE) or the node (ENFILE) had no file descriptor
    /// free to open a file or a connection: a want of the client's, which
    /// its other work frees, not a fault of the store.
    OutOfDescriptors,
}

/// Whose limit of descriptors `error` (EMFILE or ENFILE) reached, under
/// `limits` (soft, hard; `u64::MAX` for none), and what to do.
pub fn out_of_descriptors_remedy(error: &std::io::Error, (soft, hard): (u64, u64)) -> String {
    const FEWER_VOLUMES: &str = "move fewer volumes at once (a lower maxConcurrentVolumes, or less \
        memory for the stage pods in a StoragePolicy's stagePodResources)";
    if error.raw_os_error() == Some(rustix::io::Errno::NFILE.raw_os_error()) {
        return format!(
            "the node's table of open files is full (sysctl fs.file-max): raise it, or {FEWER_VOLUMES}"
        );
    }
    if soft == u64::MAX {
        return format!("the process has no file descriptor left: {FEWER_VOLUMES}");
    }
    if soft >= hard {
        // The binaries raise the soft limit to the hard one at start: only
        // the hard limit can give more.
        format!(
            "the process is at its limit of {soft} open files, which is also its hard limit: raise \
             the hard limit (the container runtime's or the service's LimitNOFILE, or `ulimit -Hn` \
             as root), or {FEWER_VOLUMES}"
        )
    } else {
        format!(
            "the process is at its limit of {soft} open files (its hard limit is {hard}): start it \
             under a higher `ulimit -n`, or {FEWER_VOLUMES}"
        )
    }
}

/// [`out_of_descriptors_remedy`] under the limits of open files in force
/// now: what a store's message says after a failure of
/// [`FailureCause::OutOfDescriptors`] (the cause is this process or the
/// node, not the object or the server).
pub fn out_of_descriptors_remedy_now(error: &std::io::Error) -> String {
    out_of_descriptors_remedy(error, open_file_limits_now())
}

/// The soft and hard limits of open files in force now (no limit:
/// `u64::MAX`).
pub fn open_file_limits_now() -> (u64, u64) {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (
        limit.current.unwrap_or(u64::MAX),
        limit.maximum.unwrap_or(u64::MAX),
    )
}

/// The I/O error of running out of file descriptors
/// ([`local::out_of_descriptors`]) that `error` is, or was caused by.
pub fn out_of_descriptors_cause<'e>(
    error: &'e (dyn std::error::Error + 'static),
) -> Option<&'e std::io::Error> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(io) = error
            .downcast_ref::<std::io::Error>()
            .filter(|io| local::out_of_descriptors(io))
        {
            return Some(io);
        }
        next = error.source();
    }
    None
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

    /// The same error with `cause` recorded (a `NotFound` or
    /// `AlreadyExists` is returned unchanged).
    pub fn with_cause(self, cause: FailureCause) -> Self {
        match self {
            StoreError::Transient {
                location,
                operation,
                key,
                message,
                ..
            } => StoreError::Transient {
                location,
                operation,
                key,
                message,
                cause,
            },
            StoreError::Permanent {
                location,
                operation,
                key,
                message,
                ..
            } => StoreError::Permanent {
                location,
                operation,
                key,
                message,
                cause,
            },
            other => other,
        }
    }

    /// What the failure was about ([`FailureCause::Other`] for `NotFound`
    /// and `AlreadyExists`, which are answers rather than failures).
    pub fn cause(&self) -> FailureCause {
        match self {
            StoreError::Transient { cause, .. } | StoreError::Permanent { cause, .. } => *cause,
            StoreError::NotFound { .. } | StoreError::AlreadyExists { .. } => FailureCause::Other,
        }
    }
}

/// The storage operations a repository needs. Keys are relative,
/// `/`-separated, and never start with `/` or contain `..` components.
///
/// Contract (checked by the conformance suite in `tests/integration/store_conformance.rs`
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
    /// Read a byte range of the object into `buffer`, replacing what it
    /// held, and hand the buffer back: a reader of many large ranges (a
    /// restore's pack reads) keeps a few buffers and reuses them, where a
    /// fresh allocation per read leaves freed megabytes cached by the
    /// allocator of whichever thread made it. Same contract as
    /// [`ObjectStore::get`] with that range. The default reads with `get`
    /// and copies; backends read into the buffer directly and wrappers
    /// forward to their inner store.
    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        mut buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        let bytes = self.get(key, Some(range)).await?;
        buffer.clear();
        buffer.extend_from_slice(&bytes);
        Ok(buffer)
    }
    /// Size of the object.
    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError>;
    /// All objects whose key starts with `prefix`.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError>;
    /// Remove the object; succeeds when it is already gone.
    async fn delete(&self, key: &str) -> Result<(), StoreError>;
    /// Where this store points, for messages (`file:///var/backups/repo`).
    /// Never contains credentials.
    fn location(&self) -> String;
    /// Whether a `put` is answered by a server across a network (S3)
    /// rather than by the local file system: a backup with the memory for
    /// it then keeps a second pack upload in flight
    /// (`engine::memory::BackupBuffers::pack_uploads`). Wrappers
    /// forward it; the default is local.
    fn is_remote(&self) -> bool {
        false
    }
    /// Remove what interrupted writers left behind (S3 multipart uploads,
    /// local temporary files) that is older than `older_than`.
    ///
    /// Age is the only sign of ownership a store has: pick a threshold longer
    /// than any live upload can take, or a live writer's upload is aborted
    /// (its `put` then fails and may be retried). The default does nothing,
    /// for backends whose writes leave nothing behind.
    async fn sweep_incomplete_uploads(
        &self,
        older_than: Duration,
    ) -> Result<SweepReport, StoreError> {
        let _ = older_than;
        Ok(SweepReport::default())
    }
    /// Wait until cleanup this store started in the background has finished
    /// (S3: aborts of multipart uploads whose `put` was dropped). Call it
    /// after cancelling uploads and before the process exits, so nothing is
    /// left behind. Wrappers forward it; the default has nothing to wait for.
    async fn wait_for_cleanup(&self) {}
}

/// What [`ObjectStore::sweep_incomplete_uploads`] found and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SweepReport {
    /// Incomplete uploads seen under the store's root, of any age.
    pub found: usize,
    /// Keys (relative to the store's root) whose stale uploads were removed.
    pub removed: Vec<String>,
    /// Incomplete uploads left alone because they are younger than the threshold.
    pub kept_recent: usize,
}

/// A shared, type-erased store.
pub type DynStore = Arc<dyn ObjectStore>;

/// Why a repository URL could not be turned into a store.
#[derive(Debug, thiserror::Error)]
pub enum OpenStoreError {
    /// The URL's scheme is not one haulage knows.
    #[error(
        "unsupported repository URL {url:?}: expected s3://bucket/prefix, file:///path or a local path"
    )]
    UnsupportedScheme {
        /// The URL as given.
        url: String,
    },
    /// The options are out of their allowed range.
    #[error("invalid storage option {option}: {message}")]
    InvalidOption {
        /// The option's field name.
        option: &'static str,
        /// Its allowed range or why it was refused; never a secret value.
        message: String,
    },
    /// The backend could not be set up.
    #[error("cannot open repository location {url}: {message}")]
    Setup {
        /// The location being opened.
        url: String,
        /// What failed.
        message: String,
    },
}

/// Explicit S3 credentials (from a Kubernetes Secret or a credentials file).
/// `Debug` never prints the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Credentials {
    /// The access key id.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// A session token for temporary credentials.
    pub session_token: Option<String>,
}

impl fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// How the S3 backend reaches its server. Every field is optional; `None`
/// means the standard AWS sources (`AWS_ENDPOINT_URL`, `AWS_REGION`, the
/// credentials chain) and then the documented default.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    /// Endpoint URL of an S3-compatible server (`http://10.0.0.5:9000`,
    /// `https://rgw.example`). `http://` turns TLS off.
    pub endpoint: Option<String>,
    /// Signing region; defaults to `us-east-1` when no source names one.
    pub region: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`). Default: on for IP
    /// address and `localhost` endpoints, off otherwise (virtual-hosted).
    pub path_style: Option<bool>,
    /// Explicit credentials; `None` uses the standard credentials chain.
    pub credentials: Option<S3Credentials>,
    /// PEM file of extra CA certificates to trust besides the system roots.
    pub ca_bundle: Option<PathBuf>,
    /// PEM certificates to trust, given inline (a BackupStorageLocation's
    /// `caBundle`); trusted together with [`S3Options::ca_bundle`].
    pub ca_bundle_pem: Option<Vec<u8>>,
    /// Objects of at least this many bytes go up as multipart uploads.
    /// Default [`s3::DEFAULT_MULTIPART_THRESHOLD_BYTES`].
    pub multipart_threshold_bytes: Option<u64>,
    /// Size of each multipart part, 5 MiB to 5 GiB. Default
    /// [`s3::DEFAULT_PART_SIZE_BYTES`].
    pub part_size_bytes: Option<u64>,
    /// Parts of one object uploaded at once, 1 to
    /// [`s3::MAX_PART_PARALLELISM`]. Default [`s3::DEFAULT_PART_PARALLELISM`].
    pub part_parallelism: Option<usize>,
    /// Use `If-None-Match: *` for [`PutMode::Create`] (default true). Turn it
    /// off only for servers that reject the header; the fallback checks with
    /// HEAD first, which is not safe against a concurrent writer.
    pub conditional_create: Option<bool>,
}

/// Everything [`open_store`] needs besides the URL: backend settings and
/// the wrappers to put around the backend.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// Settings used when the URL is `s3://`.
    pub s3: S3Options,
    /// Cap on store requests in flight at once ([`limits::ConcurrencyLimitStore`]).
    /// `None`: no cap beyond what the caller's pipeline allows.
    pub max_concurrent_requests: Option<usize>,
    /// Cap on uploaded bytes per second ([`limits::UploadRateLimitStore`]).
    pub upload_bytes_per_second: Option<NonZeroU64>,
    /// Where the upload cap records the time uploads wait for it; not
    /// recorded when `None`.
    pub upload_wait: Option<limits::WaitTime>,
    /// Retry budget for transient errors ([`retry::RetryStore`]); `None` is
    /// [`retry::RetryPolicy::default`].
    pub retry: Option<retry::RetryPolicy>,
    /// Wait out outages longer than the retry budget instead of failing
    /// ([`outage`]); `None` fails once the budget is spent.
    pub outages: Option<outage::OutageWait>,
}

/// Open the store a repository URL names, wrapped as `options` say:
/// `s3://bucket/prefix`, `file:///abs/path`, `file://rel` or a plain path.
///
/// The wrappers are stacked retry → upload rate limit → concurrency cap →
/// backend, so a request waiting out a backoff holds no connection slot, and
/// a retried upload pays for its bytes again.
pub async fn open_store(url: &str, options: &StoreOptions) -> Result<DynStore, OpenStoreError> {
    let backend: DynStore = if let Some(rest) = url.strip_prefix("s3://") {
        Arc::new(s3::S3Store::open(rest, &options.s3).await?)
    } else if let Some(path) = url.strip_prefix("file://") {
        Arc::new(local::LocalStore::new(path))
    } else if url.contains("://") {
        return Err(OpenStoreError::UnsupportedScheme {
            url: url.to_string(),
        });
    } else {
        Arc::new(local::LocalStore::new(url))
    };
    wrap_store(backend, options)
}

/// Put the wrappers `options` ask for around `backend` (see [`open_store`]).
pub fn wrap_store(backend: DynStore, options: &StoreOptions) -> Result<DynStore, OpenStoreError> {
    let mut store = backend;
    if let Some(max) = options.max_concurrent_requests {
        if max == 0 {
            return Err(OpenStoreError::InvalidOption {
                option: "max_concurrent_requests",
                message: "must be at least 1".to_string(),
            });
        }
        store = Arc::new(limits::ConcurrencyLimitStore::new(store, max));
    }
    if let Some(rate) = options.upload_bytes_per_second {
        let mut limited = limits::UploadRateLimitStore::new(store, rate).map_err(|err| {
            OpenStoreError::InvalidOption {
                option: "upload_bytes_per_second",
                message: err.to_string(),
            }
        })?;
        if let Some(waited) = &options.upload_wait {
            limited = limited.recording_wait_into(waited.clone());
        }
        store = Arc::new(limited);
    }
    let policy = options.retry.clone().unwrap_or_default();
    if let Some(wait) = &options.outages {
        store = Arc::new(retry::RetryStore::new(store, policy).waiting_out_outages(wait.clone()));
    } else if policy.max_attempts > 1 {
        store = Arc::new(retry::RetryStore::new(store, policy));
    }
    Ok(store)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unknown_schemes_are_refused_with_the_supported_ones_named() {
        let error = open_store("gs://bucket/repo", &StoreOptions::default())
            .await
            .expect_err("gs is not supported");
        assert!(matches!(error, OpenStoreError::UnsupportedScheme { .. }));
        assert!(error.to_string().contains("s3://bucket/prefix"), "{error}");
    }

    #[tokio::test]
    async fn a_zero_request_cap_is_refused() {
        let options = StoreOptions {
            max_concurrent_requests: Some(0),
            ..StoreOptions::default()
        };
        let error = open_store("/tmp/haulage-never-written", &options)
            .await
            .expect_err("zero cap");
        assert!(matches!(
            error,
            OpenStoreError::InvalidOption {
                option: "max_concurrent_requests",
                ..
            }
        ));
    }

    #[tokio::test]
    async fn s3_urls_without_a_bucket_are_refused() {
        let error = open_store("s3://", &StoreOptions::default())
            .await
            .expect_err("no bucket");
        assert!(error.to_string().contains("no bucket"), "{error}");
    }
}
