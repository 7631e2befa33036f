//! The `s3://bucket/prefix` backend: any S3-compatible server (AWS, Ceph RGW,
//! MinIO, …) through `aws-sdk-s3`.
//!
//! Keys live under the URL's prefix (`s3://bucket/repo` stores `config` as
//! `repo/config`). Objects below the multipart threshold go up in one PUT;
//! larger ones as a multipart upload whose parts are sent a bounded number
//! at a time. Every multipart upload is completed or aborted: on error the
//! abort is awaited before `put` returns; when the `put` future is dropped
//! (cancellation) a guard spawns the abort on the current runtime. The
//! CreateMultipartUpload request itself runs as a background task, so a `put`
//! dropped while it is in flight still learns the upload id and aborts it.
//! Background aborts are tracked: [`ObjectStore::wait_for_cleanup`] waits for
//! them, so a cancelled process can finish them before it exits. An upload
//! that neither path could abort (the process was killed, or the server was
//! unreachable for every abort attempt) is what
//! [`ObjectStore::sweep_incomplete_uploads`] removes. Nothing is ever visible
//! under a key before the whole object is: S3 publishes an object only when
//! its PUT or CompleteMultipartUpload succeeds.
//!
//! Errors are classified into [`StoreError`] here and only here: 404 is
//! `NotFound`, 412 on a create is `AlreadyExists`, throttling (503 SlowDown),
//! 5xx, timeouts and connection failures are `Transient`, and a refused
//! request (403, missing bucket, unknown key id, bad signature, wrong region)
//! is `Permanent` with a message naming the bucket and what to check. The
//! SDK's own retries are off; [`super::retry::RetryStore`] is the one retry
//! layer. Messages never carry credentials, and since nothing is presigned
//! there are no signed URLs to leak.

use std::net::IpAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::BehaviorVersion;
use aws_config::meta::region::RegionProviderChain;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use aws_smithy_http_client::tls::{self, TlsContext, TrustStore, rustls_provider::CryptoMode};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use tokio_util::task::TaskTracker;

use super::{
    FailureCause, ObjectMeta, ObjectStore, OpenStoreError, PutMode, S3Credentials, S3Options,
    StoreError, SweepReport, validate_key,
};

/// Default size from which objects go up as multipart uploads. Above a
/// pack's size (16 MiB target plus at most one 4 MiB chunk), so a pack is one
/// PUT: against MinIO a 1 GiB backup's server CPU fell by a quarter (1.6 s to
/// 1.2 s) with the same or better throughput than three-part uploads
/// (docs/benchmarks.md).
pub const DEFAULT_MULTIPART_THRESHOLD_BYTES: u64 = 64 * 1024 * 1024;
/// Default size of one multipart part.
pub const DEFAULT_PART_SIZE_BYTES: u64 = 8 * 1024 * 1024;
/// Default number of parts of one object in flight at once.
pub const DEFAULT_PART_PARALLELISM: usize = 4;
/// Largest allowed part parallelism: more connections per object only adds
/// load on a shared server.
pub const MAX_PART_PARALLELISM: usize = 32;
/// S3's smallest part (all parts but the last).
pub const MIN_PART_SIZE_BYTES: u64 = 5 * 1024 * 1024;
/// S3's largest part.
pub const MAX_PART_SIZE_BYTES: u64 = 5 * 1024 * 1024 * 1024;
/// S3's largest number of parts in one upload.
pub const MAX_PARTS: u64 = 10_000;
/// Signing region when no option, variable or profile names one; S3-compatible
/// servers accept it.
pub const DEFAULT_REGION: &str = "us-east-1";
/// Time allowed to open a connection.
pub const CONNECT_TIMEOUT_SECONDS: u64 = 10;
/// Time allowed from sending a request (its body included) to the response
/// headers. Generous because a part goes up within it; stalled transfers are
/// caught sooner by the SDK's stalled-stream protection.
pub const READ_TIMEOUT_SECONDS: u64 = 300;
/// Longest server message kept in an error, so status texts stay bounded.
const MAX_MESSAGE_CHARS: usize = 300;
/// Attempts at aborting a multipart upload from the drop guard.
const ABORT_ATTEMPTS: u32 = 3;

/// How objects are uploaded, resolved from [`S3Options`] and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadSettings {
    /// Objects of at least this size use multipart uploads.
    pub multipart_threshold_bytes: u64,
    /// Size of each part but the last.
    pub part_size_bytes: u64,
    /// Parts of one object in flight at once.
    pub part_parallelism: usize,
    /// Whether [`PutMode::Create`] uses `If-None-Match: *`.
    pub conditional_create: bool,
}

impl UploadSettings {
    /// Resolve and check the upload options.
    pub fn from_options(options: &S3Options) -> Result<Self, OpenStoreError> {
        let part_size_bytes = options.part_size_bytes.unwrap_or(DEFAULT_PART_SIZE_BYTES);
        if !(MIN_PART_SIZE_BYTES..=MAX_PART_SIZE_BYTES).contains(&part_size_bytes) {
            return Err(OpenStoreError::InvalidOption {
                option: "part_size_bytes",
                message: format!(
                    "{part_size_bytes} is outside S3's part size range of {MIN_PART_SIZE_BYTES}..={MAX_PART_SIZE_BYTES} bytes"
                ),
            });
        }
        let part_parallelism = options.part_parallelism.unwrap_or(DEFAULT_PART_PARALLELISM);
        if !(1..=MAX_PART_PARALLELISM).contains(&part_parallelism) {
            return Err(OpenStoreError::InvalidOption {
                option: "part_parallelism",
                message: format!("{part_parallelism} is outside 1..={MAX_PART_PARALLELISM}"),
            });
        }
        let multipart_threshold_bytes = options
            .multipart_threshold_bytes
            .unwrap_or(DEFAULT_MULTIPART_THRESHOLD_BYTES)
            .max(1);
        Ok(UploadSettings {
            multipart_threshold_bytes,
            part_size_bytes,
            part_parallelism,
            conditional_create: options.conditional_create.unwrap_or(true),
        })
    }

    /// The part size for an object of `size` bytes: the configured one,
    /// raised if the object would otherwise need more than [`MAX_PARTS`].
    pub fn part_size_for(&self, size: u64) -> u64 {
        self.part_size_bytes.max(size.div_ceil(MAX_PARTS))
    }
}

/// Profile read from a credentials file when none is named.
pub const DEFAULT_PROFILE: &str = "default";

impl S3Credentials {
    /// Read one profile's credentials from an AWS credentials file: the
    /// format of `~/.aws/credentials` and of a Velero BSL Secret's `cloud`
    /// key (`[default]` then `aws_access_key_id = …`,
    /// `aws_secret_access_key = …`, optionally `aws_session_token = …`).
    /// Errors name the file and profile, never a value.
    pub fn from_credentials_file(
        path: &Path,
        profile: Option<&str>,
    ) -> Result<Self, OpenStoreError> {
        let profile = profile.unwrap_or(DEFAULT_PROFILE);
        let invalid = |message: String| OpenStoreError::InvalidOption {
            option: "credentials_file",
            message: format!("{}: {message}", path.display()),
        };
        let text =
            std::fs::read_to_string(path).map_err(|err| invalid(format!("cannot read: {err}")))?;
        Self::parse_credentials_file(&text, profile).map_err(invalid)
    }

    /// Parse the text of a credentials file; see
    /// [`S3Credentials::from_credentials_file`].
    pub fn parse_credentials_file(text: &str, profile: &str) -> Result<Self, String> {
        let mut in_profile = false;
        let mut found_profile = false;
        let (mut access_key_id, mut secret_access_key, mut session_token) = (None, None, None);
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            if let Some(section) = line
                .strip_prefix('[')
                .and_then(|rest| rest.strip_suffix(']'))
            {
                let section = section.trim();
                let name = section.strip_prefix("profile ").map_or(section, str::trim);
                in_profile = name == profile;
                found_profile |= in_profile;
                continue;
            }
            if !in_profile {
                continue;
            }
            let Some((name, value)) = line.split_once('=') else {
                continue;
            };
            let value = value.trim().to_string();
            match name.trim().to_ascii_lowercase().as_str() {
                "aws_access_key_id" => access_key_id = Some(value),
                "aws_secret_access_key" => secret_access_key = Some(value),
                "aws_session_token" => session_token = Some(value),
                _ => {}
            }
        }
        if !found_profile {
            return Err(format!("no [{profile}] profile"));
        }
        match (access_key_id, secret_access_key) {
            (Some(access_key_id), Some(secret_access_key))
                if !access_key_id.is_empty() && !secret_access_key.is_empty() =>
            {
                Ok(S3Credentials {
                    access_key_id,
                    secret_access_key,
                    session_token: session_token.filter(|token| !token.is_empty()),
                })
            }
            _ => Err(format!(
                "profile [{profile}] needs both aws_access_key_id and aws_secret_access_key"
            )),
        }
    }
}

/// Bucket and key prefix of an `s3://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Location {
    /// The bucket name.
    pub bucket: String,
    /// The key prefix without leading or trailing `/`; empty for the bucket root.
    pub prefix: String,
}

impl S3Location {
    /// Parse what follows `s3://`: `bucket`, `bucket/`, `bucket/some/prefix/`.
    pub fn parse(rest: &str) -> Result<Self, OpenStoreError> {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let invalid = |message: &str| OpenStoreError::Setup {
            url: format!("s3://{rest}"),
            message: message.to_string(),
        };
        if bucket.is_empty() {
            return Err(invalid(
                "the URL names no bucket (expected s3://bucket/prefix)",
            ));
        }
        if !prefix.is_empty() && !validate_key(prefix) {
            return Err(invalid(
                "the prefix must be /-separated names without empty, . or .. components",
            ));
        }
        Ok(S3Location {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// The prefix as keys start with it: `repo/`, or empty.
    fn key_root(&self) -> String {
        if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        }
    }
}

/// The `[user@]host[:port]` part of an endpoint URL.
fn endpoint_authority(endpoint: &str) -> &str {
    endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap_or("")
}

/// True for endpoints that need path-style addressing by default: IP
/// addresses and `localhost` have no per-bucket DNS names.
pub fn endpoint_wants_path_style(endpoint: &str) -> bool {
    let authority = endpoint_authority(endpoint);
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host = if let Some(bracketed) = host.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(host, _)| host)
    };
    host.eq_ignore_ascii_case("localhost")
        || host.to_ascii_lowercase().ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok()
}

/// A store in an S3 bucket, under a key prefix.
#[derive(Debug, Clone)]
pub struct S3Store {
    client: Client,
    location: S3Location,
    key_root: String,
    endpoint: Option<String>,
    region: String,
    upload: UploadSettings,
    list_page_size: Option<i32>,
    /// Multipart creations and aborts running after their `put` was dropped;
    /// shared by clones.
    background: TaskTracker,
}

/// Whether an upload to `uri` signs its body's SHA-256. Over HTTPS it does
/// not (`UNSIGNED-PAYLOAD`): TLS already guards the bytes on the way, and
/// hashing every pack for the signature cost a tenth of a first backup's
/// CPU (docs/benchmarks.md, "Uploads over HTTPS without a signed body").
/// minio-go, the S3 client of restic and kopia, makes the same choice. Over
/// plain HTTP the signed hash is the only check that the server stored
/// what was sent, so it stays.
pub fn signs_upload_bodies(uri: &str) -> bool {
    !uri.starts_with("https://")
}

/// Leaves an upload's body out of its signature when the request, as it
/// is about to be signed, goes over HTTPS ([`signs_upload_bodies`]): decided
/// from the request itself, so that whichever endpoint the SDK took (the
/// option, the environment, a profile's general or S3 section) decides.
#[derive(Debug)]
struct UnsignedBodiesOverHttps;

impl aws_sdk_s3::config::Intercept for UnsignedBodiesOverHttps {
    fn name(&self) -> &'static str {
        "UnsignedBodiesOverHttps"
    }

    fn modify_before_signing(
        &self,
        context: &mut aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextMut<'_>,
        _: &aws_sdk_s3::config::RuntimeComponents,
        cfg: &mut aws_sdk_s3::config::ConfigBag,
    ) -> Result<(), aws_sdk_s3::error::BoxError> {
        // An override already there (a streamed body's checksum trailer)
        // is the SDK's own: left as it is.
        if !signs_upload_bodies(context.request().uri())
            && cfg
                .load::<aws_runtime::auth::PayloadSigningOverride>()
                .is_none()
        {
            cfg.interceptor_state()
                .store_put(aws_runtime::auth::PayloadSigningOverride::unsigned_payload());
        }
        Ok(())
    }
}

impl S3Store {
    /// Set up a store for `url` (`s3://bucket/prefix`, or just
    /// `bucket/prefix`) with `options`, falling back to the standard AWS
    /// environment variables (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`,
    /// `AWS_REGION`, `AWS_DEFAULT_REGION`, `AWS_CA_BUNDLE`), the profile
    /// files and the credentials chain for what the options leave out. No
    /// request is made: a wrong bucket or bad credentials show on first use
    /// (or in [`super::probe::check_location`]).
    pub async fn open(url: &str, options: &S3Options) -> Result<Self, OpenStoreError> {
        let rest = url.strip_prefix("s3://").unwrap_or(url);
        let location = S3Location::parse(rest)?;
        let upload = UploadSettings::from_options(options)?;
        let url = format!("s3://{rest}");
        let endpoint = options
            .endpoint
            .clone()
            .or_else(|| non_empty_env("AWS_ENDPOINT_URL_S3"))
            .or_else(|| non_empty_env("AWS_ENDPOINT_URL"));
        if let Some(endpoint) = &endpoint
            && endpoint_authority(endpoint).contains('@')
        {
            // Not echoed: the user part may be a secret.
            return Err(OpenStoreError::InvalidOption {
                option: "endpoint",
                message: "the endpoint URL must not carry credentials (user:password@); pass them as credentials".to_string(),
            });
        }
        if let Some(endpoint) = &endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(OpenStoreError::InvalidOption {
                option: "endpoint",
                message: format!("{endpoint:?} must start with http:// or https://"),
            });
        }
        let path_style = options
            .path_style
            .unwrap_or_else(|| endpoint.as_deref().is_some_and(endpoint_wants_path_style));

        // Region: option, AWS_REGION / AWS_DEFAULT_REGION, profile, default.
        // The SDK's default chain would also ask the EC2 metadata service,
        // which makes no sense for an S3-compatible endpoint.
        let region = RegionProviderChain::first_try(options.region.clone().map(Region::new))
            .or_else(aws_config::environment::EnvironmentVariableRegionProvider::new())
            .or_else(aws_config::profile::ProfileFileRegionProvider::new())
            .or_else(Region::new(DEFAULT_REGION))
            .region()
            .await
            .unwrap_or_else(|| Region::new(DEFAULT_REGION));

        let mut trust_store = TrustStore::default();
        let ca_bundle = options
            .ca_bundle
            .clone()
            .or_else(|| non_empty_env("AWS_CA_BUNDLE").map(PathBuf::from));
        if let Some(path) = &ca_bundle {
            let pem = tokio::fs::read(path)
                .await
                .map_err(|err| OpenStoreError::Setup {
                    url: url.clone(),
                    message: format!("cannot read CA bundle {}: {err}", path.display()),
                })?;
            if !holds_a_pem_certificate(&pem) {
                return Err(OpenStoreError::Setup {
                    url: url.clone(),
                    message: format!("CA bundle {} holds no PEM certificate", path.display()),
                });
            }
            trust_store = trust_store.with_pem_certificate(pem);
        }
        if let Some(pem) = &options.ca_bundle_pem {
            if !holds_a_pem_certificate(pem) {
                return Err(OpenStoreError::Setup {
                    url: url.clone(),
                    message: "the inline CA bundle holds no PEM certificate".to_string(),
                });
            }
            trust_store = trust_store.with_pem_certificate(pem.clone());
        }
        let tls_context = TlsContext::builder()
            .with_trust_store(trust_store)
            .build()
            .map_err(|err| OpenStoreError::Setup {
                url: url.clone(),
                message: format!("cannot set up TLS: {err}"),
            })?;
        let http_client = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
            .tls_context(tls_context)
            .build_https();

        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http_client)
            .region(region.clone())
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(CONNECT_TIMEOUT_SECONDS))
                    .read_timeout(Duration::from_secs(READ_TIMEOUT_SECONDS))
                    .build(),
            );
        if let Some(credentials) = &options.credentials {
            loader = loader.credentials_provider(Credentials::new(
                credentials.access_key_id.clone(),
                credentials.secret_access_key.clone(),
                credentials.session_token.clone(),
                None,
                "haulage-explicit",
            ));
        }
        if let Some(endpoint) = &endpoint {
            loader = loader.endpoint_url(endpoint.clone());
        }
        let sdk_config = loader.load().await;
        let config = aws_sdk_s3::config::Builder::from(&sdk_config)
            .force_path_style(path_style)
            // Checksums only where S3 requires them: newer SDK defaults send
            // CRC headers that several S3-compatible servers reject, and the
            // repository verifies every blob's BLAKE3 on read anyway.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .build();
        Ok(S3Store {
            client: Client::from_conf(config),
            key_root: location.key_root(),
            location,
            endpoint,
            region: region.to_string(),
            upload,
            list_page_size: None,
            background: TaskTracker::new(),
        })
    }

    /// Ask for listings in pages of at most `keys` (S3's default and maximum
    /// is 1000). For servers with small page limits and for tests of
    /// pagination.
    pub fn with_list_page_size(mut self, keys: i32) -> Self {
        self.list_page_size = Some(keys.max(1));
        self
    }

    /// The bucket and prefix this store writes under.
    pub fn s3_location(&self) -> &S3Location {
        &self.location
    }

    /// The upload settings in force.
    pub fn upload_settings(&self) -> &UploadSettings {
        &self.upload
    }

    fn full_key(&self, operation: &'static str, key: &str) -> Result<String, StoreError> {
        if !validate_key(key) {
            return Err(self.permanent(operation, key, "invalid object key".to_string()));
        }
        Ok(format!("{}{key}", self.key_root))
    }

    fn endpoint_text(&self) -> String {
        match &self.endpoint {
            Some(endpoint) => format!("endpoint {endpoint}"),
            None => format!("the AWS endpoint of region {}", self.region),
        }
    }

    fn permanent(&self, operation: &'static str, key: &str, message: String) -> StoreError {
        StoreError::Permanent {
            location: self.location(),
            operation,
            key: key.to_string(),
            message,
            cause: FailureCause::Other,
        }
    }

    fn transient(&self, operation: &'static str, key: &str, message: String) -> StoreError {
        StoreError::Transient {
            location: self.location(),
            operation,
            key: key.to_string(),
            message,
            cause: FailureCause::Other,
        }
    }

    /// Turn an SDK error into a [`StoreError`]; see the module docs.
    fn classify<E>(
        &self,
        operation: &'static str,
        key: &str,
        error: SdkError<E, HttpResponse>,
    ) -> StoreError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let bucket = &self.location.bucket;
        let endpoint = self.endpoint_text();
        let detail = || error_chain(&error);
        match &error {
            SdkError::TimeoutError(_) => {
                return self
                    .transient(operation, key, format!("request to {endpoint} timed out"))
                    .with_cause(FailureCause::Unreachable);
            }
            SdkError::DispatchFailure(_) | SdkError::ConstructionFailure(_) => {
                let text = detail();
                // Found by its errno, before any reading of the text: a
                // socket or a credentials file this process could not open
                // for want of a descriptor is neither the endpoint's fault
                // nor missing credentials.
                if let Some(io) = super::out_of_descriptors_cause(&error) {
                    return self
                        .transient(
                            operation,
                            key,
                            format!(
                                "cannot open a connection to {endpoint} ({text}): {}",
                                super::out_of_descriptors_remedy_now(io)
                            ),
                        )
                        .with_cause(FailureCause::OutOfDescriptors);
                }
                let lower = text.to_ascii_lowercase();
                // Retrying cannot make an untrusted certificate trusted, nor
                // conjure credentials. (A failed identity lookup arrives as a
                // dispatch failure of kind "other".)
                if lower.contains("certificate") {
                    return self.permanent(
                        operation,
                        key,
                        format!(
                            "the TLS certificate of {endpoint} is not trusted ({text}): check the CA bundle option and that the endpoint's host name matches the certificate"
                        ),
                    )
                    .with_cause(FailureCause::Tls);
                }
                if lower.contains("credential") {
                    return self.permanent(
                        operation,
                        key,
                        format!(
                            "no usable credentials for bucket {bucket} ({text}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a credentials file or the location's credentials Secret"
                        ),
                    )
                    .with_cause(FailureCause::CredentialsMissing);
                }
                if let SdkError::DispatchFailure(failure) = &error
                    && !failure.is_user()
                {
                    return self
                        .transient(
                            operation,
                            key,
                            format!(
                            "connection to {endpoint} failed: {text}: check the endpoint URL and that the server runs and is reachable from here"
                        ),
                        )
                        .with_cause(FailureCause::Unreachable);
                }
                return self.permanent(
                    operation,
                    key,
                    format!(
                        "request for bucket {bucket} could not be sent ({text}): check the endpoint, region and credentials settings"
                    ),
                );
            }
            _ => {}
        }
        let status = error
            .raw_response()
            .map(|response| response.status().as_u16());
        let code = error.code().unwrap_or("").to_string();
        let server_message = bounded(error.message().unwrap_or(""));
        let described = || {
            if server_message.is_empty() {
                format!("{code} (HTTP {})", status.unwrap_or(0))
            } else {
                format!("{code} (HTTP {}): {server_message}", status.unwrap_or(0))
            }
        };
        let prefix = if self.location.prefix.is_empty() {
            "the bucket root".to_string()
        } else {
            format!("prefix {}", self.location.prefix)
        };
        match (status, code.as_str()) {
            (_, "NoSuchBucket") => self.permanent(
                operation,
                key,
                format!("bucket {bucket} does not exist at {endpoint}: check the bucket name and the endpoint"),
            ).with_cause(FailureCause::BucketNotFound),
            (_, "InvalidAccessKeyId") => self.permanent(
                operation,
                key,
                format!("{endpoint} does not know the access key id used for bucket {bucket}: check the credentials and that the endpoint is the intended server"),
            ).with_cause(FailureCause::AccessDenied),
            (_, "SignatureDoesNotMatch") => self.permanent(
                operation,
                key,
                format!("{endpoint} rejected the request signature for bucket {bucket}: check the secret access key and the region ({})", self.region),
            ).with_cause(FailureCause::AccessDenied),
            (_, "RequestTimeTooSkewed") => self.permanent(
                operation,
                key,
                format!("{endpoint} refused requests for bucket {bucket} because this machine's clock is too far from the server's: check the system clock"),
            ).with_cause(FailureCause::ClockSkew),
            (_, "ExpiredToken" | "InvalidToken" | "TokenRefreshRequired") => self.permanent(
                operation,
                key,
                format!("{endpoint} rejected the session token for bucket {bucket} ({code}): refresh the credentials"),
            ).with_cause(FailureCause::AccessDenied),
            (_, "AuthorizationHeaderMalformed" | "PermanentRedirect" | "IllegalLocationConstraintException")
            | (Some(301), _) => self.permanent(
                operation,
                key,
                format!("bucket {bucket} is not served by {endpoint} in region {} ({code}): check the region and the endpoint", self.region),
            ).with_cause(FailureCause::WrongRegion),
            (_, "NoSuchUpload") => self.transient(
                operation,
                key,
                "the multipart upload was aborted by someone else (a sweep?) before it completed".to_string(),
            ),
            (Some(412), _) | (_, "PreconditionFailed") if operation == "put" => StoreError::AlreadyExists {
                location: self.location(),
                key: key.to_string(),
            },
            (Some(404), _) | (_, "NoSuchKey" | "NotFound") => StoreError::NotFound {
                location: self.location(),
                key: key.to_string(),
            },
            (Some(416), _) | (_, "InvalidRange") => {
                self.permanent(operation, key, "the byte range is outside the object".to_string())
            }
            (Some(403), _) | (_, "AccessDenied" | "AllAccessDisabled") => self.permanent(
                operation,
                key,
                format!("access to bucket {bucket} at {endpoint} was denied ({code}): check that the credentials may {operation} objects under {prefix}"),
            ).with_cause(FailureCause::AccessDenied),
            (_, "SlowDown" | "RequestLimitExceeded" | "ServiceUnavailable")
            | (Some(429 | 503), _) => self
                .transient(operation, key, described())
                .with_cause(FailureCause::Throttled),
            (_, "RequestTimeout" | "InternalError" | "ConditionalRequestConflict" | "OperationAborted")
            | (Some(408 | 409), _)
            | (Some(500..=599), _)
            | (None, _) => self
                .transient(operation, key, described())
                .with_cause(FailureCause::ServerError),
            _ => self.permanent(operation, key, described()),
        }
    }

    /// `If-None-Match: *` for a create-only put, when the server honours
    /// it (otherwise the store checks with a HEAD first).
    fn if_none_match(&self, mode: PutMode) -> Option<String> {
        (mode == PutMode::Create && self.upload.conditional_create).then(|| "*".to_string())
    }

    /// What the request that ends a put (a PutObject, or the
    /// CompleteMultipartUpload) answered, as the put's outcome.
    fn put_outcome<T, E>(
        &self,
        key: &str,
        answer: Result<T, SdkError<E, HttpResponse>>,
    ) -> Result<(), StoreError>
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        answer
            .map(drop)
            .map_err(|error| self.classify("put", key, error))
    }

    async fn put_single(
        &self,
        key: &str,
        full_key: &str,
        data: Bytes,
        mode: PutMode,
    ) -> Result<(), StoreError> {
        let answer = self
            .client
            .put_object()
            .bucket(&self.location.bucket)
            .key(full_key)
            .content_length(data.len() as i64)
            .body(ByteStream::from(data))
            .set_if_none_match(self.if_none_match(mode))
            .customize()
            .interceptor(UnsignedBodiesOverHttps)
            .send()
            .await;
        self.put_outcome(key, answer)
    }

    async fn put_multipart(
        &self,
        key: &str,
        full_key: &str,
        data: Bytes,
        mode: PutMode,
    ) -> Result<(), StoreError> {
        // Run the creation as a tracked task: if this `put` is dropped while
        // the request is in flight, the task still gets the upload id and
        // aborts the upload instead of leaving it for a sweep.
        let (sender, receiver) = tokio::sync::oneshot::channel();
        let request = self
            .client
            .create_multipart_upload()
            .bucket(&self.location.bucket)
            .key(full_key);
        let (client, bucket, task_key) = (
            self.client.clone(),
            self.location.bucket.clone(),
            full_key.to_string(),
        );
        self.background.spawn(async move {
            let result = request.send().await;
            if let Err(Ok(created)) = sender.send(result)
                && let Some(upload_id) = created.upload_id()
            {
                abort_upload(client, bucket, task_key, upload_id.to_string()).await;
            }
        });
        let created = match receiver.await {
            Ok(result) => result.map_err(|error| self.classify("put", key, error))?,
            Err(_) => {
                return Err(self.transient(
                    "put",
                    key,
                    "the multipart upload could not be started (the runtime is shutting down)"
                        .to_string(),
                ));
            }
        };
        let Some(upload_id) = created.upload_id() else {
            return Err(self.permanent(
                "put",
                key,
                "the server started a multipart upload without an upload id".to_string(),
            ));
        };
        let guard = AbortGuard::new(
            self.client.clone(),
            self.background.clone(),
            &self.location.bucket,
            full_key,
            upload_id,
        );
        match self
            .upload_parts_and_complete(key, full_key, upload_id, data, mode)
            .await
        {
            Ok(()) => {
                guard.disarm();
                Ok(())
            }
            Err(error) => {
                tracing::debug!(key, error = %error, "multipart upload failed, aborting it");
                guard.abort_now().await;
                Err(error)
            }
        }
    }

    async fn upload_parts_and_complete(
        &self,
        key: &str,
        full_key: &str,
        upload_id: &str,
        data: Bytes,
        mode: PutMode,
    ) -> Result<(), StoreError> {
        let size = data.len() as u64;
        let part_size = self.upload.part_size_for(size);
        let parts = (0..size.div_ceil(part_size)).map(|index| {
            let start = index * part_size;
            let end = (start + part_size).min(size);
            (index as i32 + 1, data.slice(start as usize..end as usize))
        });
        let mut completed: Vec<CompletedPart> = futures::stream::iter(parts)
            .map(|(number, body)| async move {
                // A throttled part is sent again on its own (the server
                // took none of it); other failures fail the put, which
                // the retry layer starts over.
                let output = within_the_upload(|| async {
                    self.client
                        .upload_part()
                        .bucket(&self.location.bucket)
                        .key(full_key)
                        .upload_id(upload_id)
                        .part_number(number)
                        .content_length(body.len() as i64)
                        .body(ByteStream::from(body.clone()))
                        .customize()
                        .interceptor(UnsignedBodiesOverHttps)
                        .send()
                        .await
                        .map_err(|error| self.classify("put", key, error))
                })
                .await?;
                let Some(e_tag) = output.e_tag() else {
                    return Err(self.permanent(
                        "put",
                        key,
                        format!("the server returned no ETag for part {number}"),
                    ));
                };
                Ok(CompletedPart::builder()
                    .part_number(number)
                    .e_tag(e_tag)
                    .build())
            })
            .buffer_unordered(self.upload.part_parallelism)
            .try_collect()
            .await?;
        completed.sort_by_key(|part| part.part_number());
        let parts = CompletedMultipartUpload::builder()
            .set_parts(Some(completed))
            .build();
        // Likewise a throttled completion: another failure may hide a
        // completion that landed.
        within_the_upload(|| async {
            let answer = self
                .client
                .complete_multipart_upload()
                .bucket(&self.location.bucket)
                .key(full_key)
                .upload_id(upload_id)
                .multipart_upload(parts.clone())
                .set_if_none_match(self.if_none_match(mode))
                .send()
                .await;
            self.put_outcome(key, answer)
        })
        .await
    }

    /// A GET of the object or a range of it, into `buffer` (replacing what
    /// it held).
    async fn get_into(
        &self,
        key: &str,
        range: Option<Range<u64>>,
        mut buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        let full_key = self.full_key("get", key)?;
        tracing::trace!(key, ?range, "GET");
        let out_of_range = |size: Option<u64>, range: &Range<u64>| {
            let size = size.map_or_else(
                || "an object".to_string(),
                |size| format!("the object of {size} bytes"),
            );
            self.permanent(
                "get",
                key,
                format!(
                    "byte range {}..{} is outside {size}",
                    range.start, range.end
                ),
            )
        };
        if let Some(range) = &range {
            if range.start > range.end {
                return Err(out_of_range(None, range));
            }
            if range.start == range.end {
                // S3 cannot express an empty range; check the bounds instead.
                let size = self.head(key).await?.size;
                return if range.end <= size {
                    buffer.clear();
                    Ok(buffer)
                } else {
                    Err(out_of_range(Some(size), range))
                };
            }
        }
        let mut request = self
            .client
            .get_object()
            .bucket(&self.location.bucket)
            .key(&full_key);
        if let Some(range) = &range {
            request = request.range(format!("bytes={}-{}", range.start, range.end - 1));
        }
        let output = match request.send().await {
            Ok(output) => output,
            Err(error) => {
                let unsatisfiable = error
                    .raw_response()
                    .map(|response| response.status().as_u16())
                    == Some(416)
                    || error.code() == Some("InvalidRange");
                return Err(match &range {
                    Some(range) if unsatisfiable => {
                        let size = self.head(key).await.ok().map(|meta| meta.size);
                        out_of_range(size, range)
                    }
                    _ => self.classify("get", key, error),
                });
            }
        };
        let expected_length = output
            .content_length()
            .and_then(|length| u64::try_from(length).ok());
        let total = output.content_range().and_then(total_from_content_range);
        let ranged_reply = output.content_range().is_some();
        // Into one buffer of the announced length as the body arrives
        // (collecting the pieces and then joining them held a large object
        // twice), which may be the caller's, reused.
        let mut body_stream = output.body;
        // Never more than was asked for, whatever the server announces.
        let capacity = expected_length.unwrap_or(0).min(
            range
                .as_ref()
                .map_or(u64::MAX, |range| range.end - range.start),
        );
        buffer.clear();
        buffer.reserve_exact(capacity as usize);
        loop {
            match body_stream.try_next().await {
                Ok(Some(piece)) => buffer.extend_from_slice(&piece),
                Ok(None) => break,
                Err(error) => {
                    return Err(self.transient(
                        "get",
                        key,
                        format!("reading the response body failed: {}", error_chain(&error)),
                    ));
                }
            }
        }
        let mut body = buffer;
        if let Some(expected) = expected_length
            && body.len() as u64 != expected
        {
            return Err(self.transient(
                "get",
                key,
                format!(
                    "the response ended after {} of {expected} bytes",
                    body.len()
                ),
            ));
        }
        let Some(range) = range else {
            return Ok(body);
        };
        let wanted = range.end - range.start;
        if !ranged_reply {
            // The server ignored the Range header and sent the whole object.
            return if range.end <= body.len() as u64 {
                body.truncate(range.end as usize);
                body.drain(..range.start as usize);
                Ok(body)
            } else {
                Err(out_of_range(Some(body.len() as u64), &range))
            };
        }
        if body.len() as u64 != wanted {
            // S3 shortens a range that runs past the end instead of failing.
            return Err(out_of_range(total, &range));
        }
        Ok(body)
    }
}

/// Aborts a multipart upload unless disarmed: awaited on the error path,
/// spawned from `Drop` when the `put` future is cancelled.
struct AbortGuard {
    client: Client,
    background: TaskTracker,
    bucket: String,
    key: String,
    upload_id: String,
    armed: bool,
}

impl AbortGuard {
    fn new(
        client: Client,
        background: TaskTracker,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Self {
        AbortGuard {
            client,
            background,
            bucket: bucket.to_string(),
            key: key.to_string(),
            upload_id: upload_id.to_string(),
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }

    async fn abort_now(mut self) {
        self.armed = false;
        abort_upload(
            self.client.clone(),
            std::mem::take(&mut self.bucket),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.upload_id),
        )
        .await;
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (bucket, key, upload_id) = (
            std::mem::take(&mut self.bucket),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.upload_id),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                self.background.spawn_on(
                    abort_upload(self.client.clone(), bucket, key, upload_id),
                    &runtime,
                );
            }
            Err(_) => tracing::warn!(
                bucket,
                key,
                "multipart upload dropped outside a runtime; left for the sweep"
            ),
        }
    }
}

/// Attempts of one throttled request inside a multipart upload (a part, or
/// the completion: 503 SlowDown, 429, which the server answers without
/// taking the request) before the put fails. They are retried here rather
/// than by [`super::retry::RetryStore`] alone, which starts the whole
/// upload over:
/// a put of N requests against a store that throttles a share p of them
/// would then succeed with only (1 − p)^N per attempt (0.8⁴ ≈ 0.41 for a
/// pack of two parts, its creation and its completion at 20 %; before
/// this, a backup through a proxy answering every fifth request 503
/// SlowDown failed a pack after 14 whole attempts in 58 s).
const ATTEMPTS_WITHIN_AN_UPLOAD: u32 = 4;

/// Run `request` up to [`ATTEMPTS_WITHIN_AN_UPLOAD`] times while it is
/// throttled, with the store's default backoff between.
async fn within_the_upload<T, F, Fut>(mut request: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let policy = super::retry::RetryPolicy::default();
    let mut attempt = 0;
    loop {
        match request().await {
            Err(error)
                if attempt + 1 < ATTEMPTS_WITHIN_AN_UPLOAD
                    && error.cause() == FailureCause::Throttled =>
            {
                tracing::debug!(attempt, error = %error, "request of a multipart upload failed, sending it again");
                tokio::time::sleep(policy.backoff(attempt)).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

/// Abort one multipart upload, retrying briefly: after this only a sweep
/// removes it. A missing upload counts as aborted.
async fn abort_upload(client: Client, bucket: String, key: String, upload_id: String) {
    for attempt in 1..=ABORT_ATTEMPTS {
        let result = client
            .abort_multipart_upload()
            .bucket(&bucket)
            .key(&key)
            .upload_id(&upload_id)
            .send()
            .await;
        match result {
            Ok(_) => {
                tracing::debug!(bucket, key, "multipart upload aborted");
                return;
            }
            Err(error) if error.code() == Some("NoSuchUpload") => return,
            Err(error) => {
                tracing::warn!(
                    bucket,
                    key,
                    attempt,
                    error = %error_chain(&error),
                    "cannot abort multipart upload"
                );
                if attempt < ABORT_ATTEMPTS {
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
                }
            }
        }
    }
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

/// Cut `text` to [`MAX_MESSAGE_CHARS`] characters.
fn bounded(text: &str) -> String {
    if text.chars().count() <= MAX_MESSAGE_CHARS {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(MAX_MESSAGE_CHARS).collect();
    cut.push('…');
    cut
}

/// The error and its sources ([`crate::error_chain`]), bounded: the
/// Display texts only (the SDK's Debug forms repeat everything and can
/// carry request details).
fn error_chain(error: &dyn std::error::Error) -> String {
    bounded(&crate::error_chain(error))
}

/// `bytes first-last/total` → total.
fn total_from_content_range(content_range: &str) -> Option<u64> {
    content_range.rsplit_once('/')?.1.trim().parse().ok()
}

#[async_trait]
impl ObjectStore for S3Store {
    async fn wait_for_cleanup(&self) {
        self.background.close();
        self.background.wait().await;
        self.background.reopen();
    }

    async fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<(), StoreError> {
        let full_key = self.full_key("put", key)?;
        if mode == PutMode::Create && !self.upload.conditional_create {
            // Fallback for servers without conditional writes: not atomic, a
            // writer racing between the HEAD and the PUT can still win.
            match self.head(key).await {
                Ok(_) => {
                    return Err(StoreError::AlreadyExists {
                        location: self.location(),
                        key: key.to_string(),
                    });
                }
                Err(StoreError::NotFound { .. }) => {}
                Err(error) => return Err(error),
            }
        }
        if data.len() as u64 >= self.upload.multipart_threshold_bytes {
            self.put_multipart(key, &full_key, data, mode).await
        } else {
            self.put_single(key, &full_key, data, mode).await
        }
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes, StoreError> {
        self.get_into(key, range, Vec::new()).await.map(Bytes::from)
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        self.get_into(key, Some(range), buffer).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        let full_key = self.full_key("head", key)?;
        let output = self
            .client
            .head_object()
            .bucket(&self.location.bucket)
            .key(&full_key)
            .send()
            .await
            .map_err(|error| self.classify("head", key, error))?;
        let size = output
            .content_length()
            .and_then(|length| u64::try_from(length).ok())
            .ok_or_else(|| {
                self.transient(
                    "head",
                    key,
                    "the response carried no object size".to_string(),
                )
            })?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size,
        })
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        let full_prefix = format!("{}{prefix}", self.key_root);
        let mut objects = Vec::new();
        let mut continuation = None;
        loop {
            let output = self
                .client
                .list_objects_v2()
                .bucket(&self.location.bucket)
                .prefix(&full_prefix)
                .set_max_keys(self.list_page_size)
                .set_continuation_token(continuation.take())
                .send()
                .await
                .map_err(|error| self.classify("list", prefix, error))?;
            for object in output.contents() {
                let Some(relative) = object
                    .key()
                    .and_then(|key| key.strip_prefix(&self.key_root))
                else {
                    continue;
                };
                // Zero-byte "directory" markers some tools create are not objects.
                if relative.is_empty() || relative.ends_with('/') {
                    continue;
                }
                objects.push(ObjectMeta {
                    key: relative.to_string(),
                    size: object
                        .size()
                        .and_then(|size| u64::try_from(size).ok())
                        .unwrap_or(0),
                });
            }
            if output.is_truncated() != Some(true) {
                return Ok(objects);
            }
            match output.next_continuation_token() {
                Some(token) => continuation = Some(token.to_string()),
                None => {
                    return Err(self.transient(
                        "list",
                        prefix,
                        "the server said the listing is truncated but gave no continuation token"
                            .to_string(),
                    ));
                }
            }
        }
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let full_key = self.full_key("delete", key)?;
        match self
            .client
            .delete_object()
            .bucket(&self.location.bucket)
            .key(&full_key)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(error) => match self.classify("delete", key, error) {
                StoreError::NotFound { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn location(&self) -> String {
        if self.location.prefix.is_empty() {
            format!("s3://{}", self.location.bucket)
        } else {
            format!("s3://{}/{}", self.location.bucket, self.location.prefix)
        }
    }

    /// Abort the multipart uploads under the prefix that were initiated at
    /// least `older_than` ago (by the server's clock as it reports
    /// `Initiated`, compared with this machine's).
    ///
    /// The listing asks for every upload in the bucket and filters by prefix
    /// here: MinIO answers a prefixed ListMultipartUploads only when the
    /// prefix is exactly one object's key (minio/minio#20989), so a
    /// server-side prefix would silently find nothing to sweep.
    async fn sweep_incomplete_uploads(
        &self,
        older_than: Duration,
    ) -> Result<SweepReport, StoreError> {
        let now = DateTime::from(SystemTime::now());
        let threshold_seconds = i64::try_from(older_than.as_secs()).unwrap_or(i64::MAX);
        let mut report = SweepReport::default();
        let mut key_marker = None;
        let mut upload_id_marker = None;
        loop {
            let output = self
                .client
                .list_multipart_uploads()
                .bucket(&self.location.bucket)
                .set_key_marker(key_marker.take())
                .set_upload_id_marker(upload_id_marker.take())
                .send()
                .await
                .map_err(|error| self.classify("sweep", "", error))?;
            for upload in output.uploads() {
                let (Some(full_key), Some(upload_id)) = (upload.key(), upload.upload_id()) else {
                    continue;
                };
                let Some(relative) = full_key.strip_prefix(&self.key_root) else {
                    continue;
                };
                report.found += 1;
                let age_seconds = upload
                    .initiated()
                    .map(|initiated| now.secs().saturating_sub(initiated.secs()))
                    // No start time: treat it as old, the sweep exists for orphans.
                    .unwrap_or(i64::MAX);
                if age_seconds < threshold_seconds {
                    report.kept_recent += 1;
                    continue;
                }
                match self
                    .client
                    .abort_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(full_key)
                    .upload_id(upload_id)
                    .send()
                    .await
                {
                    Ok(_) => {}
                    Err(error) if error.code() == Some("NoSuchUpload") => {}
                    Err(error) => return Err(self.classify("sweep", relative, error)),
                }
                tracing::info!(
                    key = relative,
                    age_seconds,
                    "aborted stale multipart upload"
                );
                report.removed.push(relative.to_string());
            }
            if output.is_truncated() != Some(true) {
                return Ok(report);
            }
            key_marker = output.next_key_marker().map(str::to_string);
            upload_id_marker = output.next_upload_id_marker().map(str::to_string);
            if key_marker.is_none() && upload_id_marker.is_none() {
                return Err(self.transient(
                    "sweep",
                    "",
                    "the server said the upload listing is truncated but gave no marker"
                        .to_string(),
                ));
            }
        }
    }
}

/// Whether `pem` holds at least one PEM certificate block.
fn holds_a_pem_certificate(pem: &[u8]) -> bool {
    const BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----";
    pem.windows(BEGIN.len()).any(|window| window == BEGIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_bucket_and_prefix() {
        let parse = |rest| S3Location::parse(rest).expect("valid");
        assert_eq!(parse("b").prefix, "");
        assert_eq!(parse("b/").prefix, "");
        assert_eq!(parse("b/repo").prefix, "repo");
        assert_eq!(parse("b/team/repo/").prefix, "team/repo");
        assert_eq!(parse("b/team/repo").bucket, "b");
        assert_eq!(parse("b/team/repo").key_root(), "team/repo/");
        assert!(S3Location::parse("").is_err());
        assert!(S3Location::parse("/repo").is_err());
        assert!(S3Location::parse("b/a/../c").is_err());
        assert!(S3Location::parse("b/a//c").is_err());
    }

    #[test]
    fn upload_bodies_are_signed_over_plain_http_only() {
        assert!(signs_upload_bodies("http://127.0.0.1:9000/bucket/key"));
        assert!(signs_upload_bodies("http://rgw.ceph.svc:8080/bucket/key"));
        assert!(!signs_upload_bodies(
            "https://rgw.example.org:8443/bucket/key"
        ));
        assert!(!signs_upload_bodies(
            "https://bucket.s3.eu-west-1.amazonaws.com/key"
        ));
    }

    #[test]
    fn ip_and_localhost_endpoints_use_path_style() {
        assert!(endpoint_wants_path_style("http://127.0.0.1:9000"));
        assert!(endpoint_wants_path_style("http://localhost:9000/"));
        assert!(endpoint_wants_path_style("https://10.1.2.3"));
        assert!(endpoint_wants_path_style("http://[::1]:9000"));
        assert!(endpoint_wants_path_style("http://minio.localhost:9000"));
        assert!(!endpoint_wants_path_style(
            "https://s3.eu-west-1.amazonaws.com"
        ));
        assert!(!endpoint_wants_path_style("https://rgw.example.org:8443"));
    }

    #[tokio::test]
    async fn endpoints_with_credentials_in_them_are_refused_without_echoing_them() {
        let options = S3Options {
            endpoint: Some("http://user:hunter2@127.0.0.1:9000".to_string()),
            ..S3Options::default()
        };
        let error = S3Store::open("s3://bucket", &options)
            .await
            .expect_err("refused");
        assert!(!error.to_string().contains("hunter2"), "{error}");
        let options = S3Options {
            endpoint: Some("127.0.0.1:9000".to_string()),
            ..S3Options::default()
        };
        assert!(S3Store::open("s3://bucket", &options).await.is_err());
    }

    #[test]
    fn part_size_grows_to_stay_within_the_part_limit() {
        let settings =
            UploadSettings::from_options(&S3Options::default()).expect("defaults are valid");
        assert_eq!(settings.part_size_for(100), DEFAULT_PART_SIZE_BYTES);
        let huge = DEFAULT_PART_SIZE_BYTES * MAX_PARTS * 3;
        assert!(huge.div_ceil(settings.part_size_for(huge)) <= MAX_PARTS);
    }

    #[test]
    fn out_of_range_upload_options_are_refused() {
        let small_parts = S3Options {
            part_size_bytes: Some(1024),
            ..S3Options::default()
        };
        assert!(UploadSettings::from_options(&small_parts).is_err());
        let no_parallelism = S3Options {
            part_parallelism: Some(0),
            ..S3Options::default()
        };
        assert!(UploadSettings::from_options(&no_parallelism).is_err());
    }

    #[test]
    fn credentials_debug_hides_the_secret() {
        let credentials = crate::store::S3Credentials {
            access_key_id: "AKIDEXAMPLE".to_string(),
            secret_access_key: "very-secret-value".to_string(),
            session_token: Some("token-value".to_string()),
        };
        let printed = format!("{credentials:?}");
        assert!(!printed.contains("very-secret-value"));
        assert!(!printed.contains("token-value"));
    }

    #[test]
    fn credentials_files_yield_the_named_profile() {
        let text = "# velero style\n[default]\naws_access_key_id = AKID1\naws_secret_access_key=secret1\n\n[profile backup]\naws_access_key_id=AKID2\naws_secret_access_key = secret2\naws_session_token = token2\n";
        let default = S3Credentials::parse_credentials_file(text, "default").expect("default");
        assert_eq!(default.access_key_id, "AKID1");
        assert_eq!(default.secret_access_key, "secret1");
        assert_eq!(default.session_token, None);
        let backup = S3Credentials::parse_credentials_file(text, "backup").expect("backup");
        assert_eq!(backup.access_key_id, "AKID2");
        assert_eq!(backup.session_token.as_deref(), Some("token2"));
        let missing = S3Credentials::parse_credentials_file(text, "other").expect_err("no profile");
        assert!(missing.contains("[other]"), "{missing}");
        let partial =
            S3Credentials::parse_credentials_file("[default]\naws_access_key_id=x\n", "default")
                .expect_err("no secret");
        assert!(partial.contains("aws_secret_access_key"), "{partial}");
    }

    mod classification {
        use aws_sdk_s3::error::{ConnectorError, ErrorMetadata};
        use aws_sdk_s3::operation::list_objects_v2::ListObjectsV2Error;
        use aws_sdk_s3::primitives::SdkBody;
        use aws_smithy_runtime_api::http::StatusCode;

        use super::*;

        type ListError = SdkError<ListObjectsV2Error, HttpResponse>;

        async fn store() -> S3Store {
            let options = S3Options {
                endpoint: Some("http://127.0.0.1:9".to_string()),
                region: Some("us-east-1".to_string()),
                credentials: Some(S3Credentials {
                    access_key_id: "AKID".to_string(),
                    secret_access_key: "classified-secret".to_string(),
                    session_token: None,
                }),
                ..S3Options::default()
            };
            S3Store::open("s3://bucket/prefix", &options)
                .await
                .expect("open makes no request")
        }

        fn service_error(status: u16, code: &str) -> ListError {
            let response = HttpResponse::new(
                StatusCode::try_from(status).expect("valid status"),
                SdkBody::empty(),
            );
            let error = ListObjectsV2Error::generic(
                ErrorMetadata::builder()
                    .code(code)
                    .message("server says no")
                    .build(),
            );
            SdkError::service_error(error, response)
        }

        fn classify(store: &S3Store, operation: &'static str, error: ListError) -> StoreError {
            store.classify(operation, "k", error)
        }

        #[tokio::test]
        async fn throttling_and_server_errors_are_transient() {
            let store = store().await;
            for (status, code, cause) in [
                (503, "SlowDown", FailureCause::Throttled),
                (503, "", FailureCause::Throttled),
                (429, "", FailureCause::Throttled),
                (500, "InternalError", FailureCause::ServerError),
                (502, "", FailureCause::ServerError),
                (400, "RequestTimeout", FailureCause::ServerError),
            ] {
                let error = classify(&store, "get", service_error(status, code));
                assert!(error.is_transient(), "{status} {code}: {error}");
                assert_eq!(error.cause(), cause, "{status} {code}");
            }
        }

        #[tokio::test]
        async fn refusals_are_permanent_and_name_what_to_check() {
            let store = store().await;
            for (status, code, hint) in [
                (404, "NoSuchBucket", "check the bucket name"),
                (403, "AccessDenied", "check that the credentials may"),
                (403, "InvalidAccessKeyId", "check the credentials"),
                (403, "SignatureDoesNotMatch", "check the secret access key"),
                (403, "RequestTimeTooSkewed", "check the system clock"),
                (400, "AuthorizationHeaderMalformed", "check the region"),
                (400, "EntityTooSmall", "EntityTooSmall"),
            ] {
                let error = classify(&store, "put", service_error(status, code));
                assert!(
                    matches!(error, StoreError::Permanent { .. }),
                    "{code}: {error}"
                );
                let message = error.to_string();
                assert!(message.contains(hint), "{code}: {message}");
                assert!(!message.contains("classified-secret"), "{message}");
            }
        }

        #[tokio::test]
        async fn missing_objects_and_lost_create_races_have_their_own_variants() {
            let store = store().await;
            assert!(classify(&store, "get", service_error(404, "NoSuchKey")).is_not_found());
            assert!(classify(&store, "head", service_error(404, "")).is_not_found());
            assert!(matches!(
                classify(&store, "put", service_error(412, "PreconditionFailed")),
                StoreError::AlreadyExists { .. }
            ));
            assert!(matches!(
                classify(&store, "get", service_error(412, "PreconditionFailed")),
                StoreError::Permanent { .. }
            ));
        }

        #[tokio::test]
        async fn connection_failures_are_transient_but_missing_credentials_are_not() {
            let store = store().await;
            let refused: ListError = SdkError::dispatch_failure(ConnectorError::io(
                std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into(),
            ));
            assert!(classify(&store, "list", refused).is_transient());
            let timeout: ListError = SdkError::timeout_error("operation timed out");
            assert!(classify(&store, "list", timeout).is_transient());
            let no_credentials: ListError = SdkError::dispatch_failure(ConnectorError::other(
                "failed to load credentials: no providers in chain provided credentials".into(),
                None,
            ));
            let error = classify(&store, "list", no_credentials);
            assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
            assert!(error.to_string().contains("AWS_ACCESS_KEY_ID"), "{error}");
            let untrusted: ListError = SdkError::dispatch_failure(ConnectorError::io(
                "invalid peer certificate: UnknownIssuer".into(),
            ));
            let error = classify(&store, "list", untrusted);
            assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
            assert!(error.to_string().contains("CA bundle"), "{error}");
            // No descriptor for the socket: the process's want, not the
            // endpoint's, and said so.
            let no_socket: ListError = SdkError::dispatch_failure(ConnectorError::io(
                std::io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error()).into(),
            ));
            let error = classify(&store, "list", no_socket);
            assert!(error.is_transient(), "{error}");
            assert_eq!(error.cause(), FailureCause::OutOfDescriptors);
            assert!(
                error.to_string().contains("move fewer volumes at once")
                    && !error.to_string().contains("check the endpoint URL"),
                "{error}"
            );
        }
    }

    #[test]
    fn content_range_totals_parse() {
        assert_eq!(total_from_content_range("bytes 0-9/100"), Some(100));
        assert_eq!(total_from_content_range("bytes */100"), Some(100));
        assert_eq!(total_from_content_range("bytes 0-9/*"), None);
    }
}
