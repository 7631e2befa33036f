//! The S3 backend against a real MinIO server: the conformance suite, then
//! what only S3 can show — multipart uploads that never leave a partial
//! object or a pending upload behind (on error, on a dropped connection, on
//! cancellation), the sweep of orphaned uploads, fast and clear permanent
//! errors, and transient errors while the server is down.
//!
//! Every test starts its own server (a second or two), so tests stay
//! independent and a stopped server never hurts a neighbour.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use haulage::store::layer::{Layer, Layered, Request};
use haulage::store::probe::{ProbeFailureKind, ProbeStepKind, check_location};
use haulage::store::ranges::{DEFAULT_COALESCE_GAP_BYTES, get_ranges};
use haulage::store::retry::{RetryPolicy, RetryStore};
use haulage::store::s3::S3Store;
use haulage::store::{
    DynStore, FailureCause, ObjectStore, PutMode, S3Credentials, S3Options, StoreError,
    StoreOptions, open_store,
};

use crate::store_conformance::{check_store, pattern};
use crate::support::minio::{MinioServer, SECRET_KEY, TestCertificates};
use crate::support::proxy::FaultProxy;

const BUCKET: &str = "haulage-test";
const PREFIX: &str = "team/repo";
/// Parts of this size make a 12 MiB object a three-part upload.
const PART_BYTES: u64 = 5 * 1024 * 1024;
const MULTIPART_OBJECT_BYTES: usize = 12 * 1024 * 1024;
/// How long a spawned abort may take to show on the server.
const ABORT_DEADLINE: Duration = Duration::from_secs(20);

async fn server_with_bucket() -> MinioServer {
    let server = MinioServer::start().await.expect("start minio");
    server.create_bucket(BUCKET).await.expect("create bucket");
    server
}

/// Options that send objects of at least 5 MiB as 5 MiB parts, two at a time.
fn multipart_options(mut options: S3Options) -> S3Options {
    options.multipart_threshold_bytes = Some(PART_BYTES);
    options.part_size_bytes = Some(PART_BYTES);
    options.part_parallelism = Some(2);
    options
}

async fn s3_store(options: &S3Options, location: &str) -> S3Store {
    S3Store::open(location, options)
        .await
        .expect("open s3 store")
}

fn upstream(server: &MinioServer) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], server.port()))
}

/// Wait (bounded) until no multipart upload is pending under `prefix`.
async fn assert_no_pending_uploads(server: &MinioServer, prefix: &str) {
    let deadline = Instant::now() + ABORT_DEADLINE;
    loop {
        let pending = server
            .multipart_uploads(BUCKET, prefix)
            .await
            .expect("list uploads");
        if pending.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "uploads still pending after {ABORT_DEADLINE:?}: {pending:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Counts the calls that reach the wrapped store, to prove what a retry
/// layer above it did.
type CountingStore = Layered<CallCount>;

/// `inner` behind a [`CallCount`].
fn counting_store(inner: DynStore) -> Arc<CountingStore> {
    Arc::new(Layered::wrap(inner, CallCount::default()))
}

/// The calls a [`CountingStore`] passed on.
#[derive(Debug, Default)]
struct CallCount {
    calls: AtomicU32,
}

impl CallCount {
    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Layer for CallCount {
    type Held = ();

    async fn before(&self, _: Request<'_>) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 5,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        max_elapsed: Duration::from_secs(10),
    }
}

#[tokio::test]
async fn s3_store_under_a_prefix_passes_the_conformance_suite() {
    let server = server_with_bucket().await;
    let store = s3_store(&server.s3_options(), &format!("{BUCKET}/{PREFIX}")).await;
    check_store(Arc::new(store)).await;
    // Everything the suite wrote stayed under the prefix.
    let all = server
        .admin_client()
        .list_objects_v2()
        .bucket(BUCKET)
        .send()
        .await
        .expect("list bucket");
    for object in all.contents() {
        let key = object.key().unwrap_or_default();
        assert!(key.starts_with("team/repo/"), "{key} escaped the prefix");
    }
}

#[tokio::test]
async fn s3_store_at_the_bucket_root_passes_the_conformance_suite() {
    let server = server_with_bucket().await;
    let store = open_store(&format!("s3://{BUCKET}"), &server.store_options())
        .await
        .expect("open");
    assert_eq!(store.location(), format!("s3://{BUCKET}"));
    check_store(store).await;
}

#[tokio::test]
async fn s3_store_behind_every_wrapper_passes_the_conformance_suite() {
    let server = server_with_bucket().await;
    let options = haulage::store::StoreOptions {
        max_concurrent_requests: Some(3),
        upload_bytes_per_second: std::num::NonZeroU64::new(512 * 1024 * 1024),
        retry: Some(haulage::store::retry::RetryPolicy::default()),
        ..server.store_options()
    };
    let store = open_store(&format!("s3://{BUCKET}/wrapped"), &options)
        .await
        .expect("open");
    check_store(store).await;
}

#[tokio::test]
async fn s3_store_sending_every_object_as_multipart_passes_the_conformance_suite() {
    let server = server_with_bucket().await;
    let mut options = server.s3_options();
    // Every non-empty object becomes a (single-part) multipart upload, so the
    // suite's creates go through CompleteMultipartUpload with If-None-Match.
    options.multipart_threshold_bytes = Some(1);
    let store = s3_store(&options, &format!("{BUCKET}/{PREFIX}")).await;
    check_store(Arc::new(store)).await;
    assert_no_pending_uploads(&server, "").await;
}

#[tokio::test]
async fn s3_store_with_the_fallback_create_passes_the_conformance_suite() {
    let server = server_with_bucket().await;
    let mut options = server.s3_options();
    options.conditional_create = Some(false);
    let store = s3_store(&options, &format!("{BUCKET}/fallback")).await;
    check_store(Arc::new(store)).await;
}

#[tokio::test]
async fn large_objects_go_up_in_parts_and_read_back_across_part_boundaries() {
    let server = server_with_bucket().await;
    let store = s3_store(
        &multipart_options(server.s3_options()),
        &format!("{BUCKET}/{PREFIX}"),
    )
    .await;
    let data = pattern(MULTIPART_OBJECT_BYTES, 11);
    store
        .put("data/big", data.clone(), PutMode::Overwrite)
        .await
        .expect("multipart put");
    assert_eq!(store.get("data/big", None).await.expect("get"), data);
    let boundary = PART_BYTES;
    let across = boundary - 100..boundary + 100;
    assert_eq!(
        store
            .get("data/big", Some(across.clone()))
            .await
            .expect("ranged get"),
        data.slice(across.start as usize..across.end as usize)
    );
    // MinIO reports multipart ETags as "<md5>-<parts>".
    let head = server
        .admin_client()
        .head_object()
        .bucket(BUCKET)
        .key("team/repo/data/big")
        .send()
        .await
        .expect("head");
    assert!(
        head.e_tag().unwrap_or_default().ends_with("-3\""),
        "{:?}",
        head.e_tag()
    );
    // Create over an existing multipart object is refused at completion.
    let error = store
        .put(
            "data/big",
            pattern(MULTIPART_OBJECT_BYTES, 12),
            PutMode::Create,
        )
        .await
        .expect_err("create over existing");
    assert!(matches!(error, StoreError::AlreadyExists { .. }), "{error}");
    assert_eq!(
        store.get("data/big", None).await.expect("get"),
        data,
        "the original stays"
    );
    assert_no_pending_uploads(&server, "").await;
}

#[tokio::test]
async fn listings_follow_continuation_tokens() {
    let server = server_with_bucket().await;
    let store = s3_store(&server.s3_options(), &format!("{BUCKET}/{PREFIX}"))
        .await
        .with_list_page_size(7);
    for index in 0..25 {
        store
            .put(
                &format!("index/{index:03}"),
                pattern(index + 1, index as u64),
                PutMode::Overwrite,
            )
            .await
            .expect("put");
    }
    let mut listed = store.list("index/").await.expect("list");
    listed.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(listed.len(), 25);
    for (index, meta) in listed.iter().enumerate() {
        assert_eq!(meta.key, format!("index/{index:03}"));
        assert_eq!(meta.size, index as u64 + 1);
    }
}

#[tokio::test]
async fn a_connection_cut_mid_multipart_upload_leaves_no_object_and_no_pending_upload() {
    let server = server_with_bucket().await;
    let proxy = FaultProxy::start(upstream(&server)).await.expect("proxy");
    let store = s3_store(
        &multipart_options(server.s3_options_via(&proxy.endpoint())),
        &format!("{BUCKET}/{PREFIX}"),
    )
    .await;
    proxy.cut_upload_after(7 * 1024 * 1024);
    let error = store
        .put(
            "data/cut",
            pattern(MULTIPART_OBJECT_BYTES, 21),
            PutMode::Overwrite,
        )
        .await
        .expect_err("the cut fails the put");
    assert_eq!(proxy.cuts(), 1, "the proxy cut one connection");
    assert!(
        error.is_transient(),
        "a dropped connection is transient: {error}"
    );
    let missing = store.head("data/cut").await.expect_err("no object");
    assert!(missing.is_not_found(), "{missing}");
    assert!(store.list("").await.expect("list").is_empty());
    // The failed put awaited its abort before returning.
    assert!(
        server
            .multipart_uploads(BUCKET, "")
            .await
            .expect("uploads")
            .is_empty()
    );
}

#[tokio::test]
async fn a_connection_cut_mid_single_put_leaves_no_object() {
    let server = server_with_bucket().await;
    let proxy = FaultProxy::start(upstream(&server)).await.expect("proxy");
    let store = s3_store(
        &server.s3_options_via(&proxy.endpoint()),
        &format!("{BUCKET}/{PREFIX}"),
    )
    .await;
    proxy.cut_upload_after(300 * 1024);
    let error = store
        .put("data/single", pattern(1024 * 1024, 22), PutMode::Overwrite)
        .await
        .expect_err("the cut fails the put");
    assert!(error.is_transient(), "{error}");
    assert!(
        store
            .head("data/single")
            .await
            .expect_err("no object")
            .is_not_found()
    );
}

#[tokio::test]
async fn retries_carry_a_put_through_dropped_connections_and_the_object_is_intact() {
    let server = server_with_bucket().await;
    let proxy = FaultProxy::start(upstream(&server)).await.expect("proxy");
    let backend: DynStore = Arc::new(
        s3_store(
            &multipart_options(server.s3_options_via(&proxy.endpoint())),
            &format!("{BUCKET}/{PREFIX}"),
        )
        .await,
    );
    let counted = counting_store(backend);
    let store = RetryStore::new(counted.clone(), quick_retries());
    let data = pattern(MULTIPART_OBJECT_BYTES, 23);
    proxy.cut_upload_after(6 * 1024 * 1024);
    store
        .put("data/retried", data.clone(), PutMode::Overwrite)
        .await
        .expect("put succeeds on retry");
    assert_eq!(proxy.cuts(), 1);
    assert_eq!(
        counted.layer().calls(),
        2,
        "one failed attempt, one good one"
    );
    assert_eq!(store.get("data/retried", None).await.expect("get"), data);
    assert_no_pending_uploads(&server, "").await;
}

#[tokio::test]
async fn dropping_a_put_mid_multipart_aborts_its_upload() {
    let server = server_with_bucket().await;
    let proxy = FaultProxy::start(upstream(&server)).await.expect("proxy");
    let store = Arc::new(
        s3_store(
            &multipart_options(server.s3_options_via(&proxy.endpoint())),
            &format!("{BUCKET}/{PREFIX}"),
        )
        .await,
    );
    // Let the upload start and a few MiB through, then hold the rest.
    proxy.stall_upload_after(3 * 1024 * 1024);
    let put = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .put(
                    "data/cancelled",
                    pattern(MULTIPART_OBJECT_BYTES, 24),
                    PutMode::Overwrite,
                )
                .await
        }
    });
    let deadline = Instant::now() + ABORT_DEADLINE;
    while server
        .multipart_uploads(BUCKET, "")
        .await
        .expect("uploads")
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "the multipart upload never started"
        );
        assert!(
            !put.is_finished(),
            "the put finished while the proxy stalled it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    put.abort();
    let joined = put.await;
    assert!(
        joined.is_err_and(|error| error.is_cancelled()),
        "the put was cancelled mid-way"
    );
    // Stalled connections go; the abort the guard spawned gets through.
    proxy.resume();
    proxy.drop_all_connections();
    assert_no_pending_uploads(&server, "").await;
    assert!(
        store
            .head("data/cancelled")
            .await
            .expect_err("no object")
            .is_not_found()
    );
}

#[tokio::test]
async fn sweep_aborts_old_uploads_under_the_prefix_only() {
    let server = server_with_bucket().await;
    for key in [
        "team/repo/data/orphan-1",
        "team/repo/data/orphan-2",
        "team/other/data/not-ours",
    ] {
        server
            .leave_unfinished_upload(BUCKET, key)
            .await
            .expect("upload left");
    }
    let store = open_store(&format!("s3://{BUCKET}/{PREFIX}"), &server.store_options())
        .await
        .expect("open");

    let young = store
        .sweep_incomplete_uploads(Duration::from_secs(3600))
        .await
        .expect("sweep");
    assert_eq!(young.found, 2, "{young:?}");
    assert_eq!(young.kept_recent, 2);
    assert!(young.removed.is_empty());

    let swept = store
        .sweep_incomplete_uploads(Duration::ZERO)
        .await
        .expect("sweep");
    let mut removed = swept.removed.clone();
    removed.sort();
    assert_eq!(removed, ["data/orphan-1", "data/orphan-2"], "{swept:?}");
    assert!(
        server
            .multipart_uploads(BUCKET, "team/repo/")
            .await
            .expect("uploads")
            .is_empty()
    );
    let others = server
        .multipart_uploads(BUCKET, "team/other/")
        .await
        .expect("uploads");
    assert_eq!(
        others.len(),
        1,
        "another prefix's upload is not ours to sweep"
    );
}

#[tokio::test]
async fn a_missing_bucket_fails_at_once_with_a_message_naming_it() {
    let server = server_with_bucket().await;
    let backend: DynStore = Arc::new(s3_store(&server.s3_options(), "no-such-bucket/repo").await);
    let counted = counting_store(backend);
    let store = RetryStore::new(counted.clone(), quick_retries());
    let started = Instant::now();
    let error = store
        .put("config", Bytes::from_static(b"x"), PutMode::Create)
        .await
        .expect_err("no bucket");
    assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
    assert_eq!(error.cause(), FailureCause::BucketNotFound, "{error}");
    assert_eq!(
        counted.layer().calls(),
        1,
        "a permanent error is not retried"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let message = error.to_string();
    assert!(message.contains("no-such-bucket"), "{message}");
    assert!(message.contains("check the bucket name"), "{message}");
    assert!(message.contains(&server.endpoint()), "{message}");
    assert!(!message.contains(SECRET_KEY), "{message}");
}

#[tokio::test]
async fn wrong_credentials_fail_at_once_without_leaking_the_secret() {
    let server = server_with_bucket().await;
    let wrong_secret = "definitely-not-the-secret-42";
    let cases = [
        (
            S3Credentials {
                access_key_id: "haulage-test".to_string(),
                secret_access_key: wrong_secret.to_string(),
                session_token: None,
            },
            "secret access key",
        ),
        (
            S3Credentials {
                access_key_id: "unknown-key-id".to_string(),
                secret_access_key: wrong_secret.to_string(),
                session_token: None,
            },
            "check the credentials",
        ),
    ];
    for (credentials, hint) in cases {
        let mut options = server.s3_options();
        options.credentials = Some(credentials);
        let backend: DynStore = Arc::new(s3_store(&options, &format!("{BUCKET}/{PREFIX}")).await);
        let counted = counting_store(backend);
        let store = RetryStore::new(counted.clone(), quick_retries());
        let error = store.list("").await.expect_err("refused");
        assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
        assert_eq!(error.cause(), FailureCause::AccessDenied, "{error}");
        assert_eq!(
            counted.layer().calls(),
            1,
            "a permanent error is not retried: {error}"
        );
        let message = error.to_string();
        assert!(message.contains(BUCKET), "{message}");
        assert!(message.contains(hint), "{message}");
        assert!(!message.contains(wrong_secret), "{message}");
        assert!(!message.contains(SECRET_KEY), "{message}");
    }
}

#[tokio::test]
async fn a_stopped_server_gives_transient_errors_and_a_restart_recovers() {
    let mut server = server_with_bucket().await;
    let store = s3_store(&server.s3_options(), &format!("{BUCKET}/{PREFIX}")).await;
    store
        .put("before", pattern(100, 1), PutMode::Overwrite)
        .await
        .expect("put");
    server.stop();
    for result in [
        store.head("before").await.map(drop),
        store
            .put("during", pattern(100, 2), PutMode::Overwrite)
            .await,
        store.list("").await.map(drop),
    ] {
        let error = result.expect_err("server is down");
        assert!(error.is_transient(), "{error}");
        assert_eq!(error.cause(), FailureCause::Unreachable, "{error}");
        assert!(error.to_string().contains(&server.endpoint()), "{error}");
    }
    server.restart().await.expect("restart");
    // A server that has just come back may still answer 503 for a moment
    // (MinIO reports ready before every subsystem is); that is what the
    // retry budget is for.
    let store = RetryStore::new(Arc::new(store), quick_retries());
    assert_eq!(
        store.get("before", None).await.expect("get after restart"),
        pattern(100, 1)
    );
}

#[tokio::test]
async fn retries_ride_out_a_short_outage() {
    let mut server = server_with_bucket().await;
    let backend: DynStore = Arc::new(
        s3_store(
            &multipart_options(server.s3_options()),
            &format!("{BUCKET}/{PREFIX}"),
        )
        .await,
    );
    let counted = counting_store(backend);
    let store = RetryStore::new(
        counted.clone(),
        RetryPolicy {
            max_attempts: 30,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(1),
            max_elapsed: Duration::from_secs(60),
        },
    );
    server.stop();
    let data = pattern(MULTIPART_OBJECT_BYTES, 31);
    let put = store.put("data/outage", data.clone(), PutMode::Overwrite);
    let restart = async {
        // The first attempts fail against the stopped server first.
        let deadline = Instant::now() + Duration::from_secs(20);
        while counted.layer().calls() < 2 {
            assert!(Instant::now() < deadline, "no attempt reached the store");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server.restart().await.expect("restart");
    };
    let (result, ()) = tokio::join!(put, restart);
    result.expect("the put succeeds once the server is back");
    assert!(
        counted.layer().calls() >= 2,
        "at least one retry: {}",
        counted.layer().calls()
    );
    assert_eq!(store.get("data/outage", None).await.expect("get"), data);
    assert_no_pending_uploads(&server, "").await;
}

#[tokio::test]
async fn check_location_passes_on_a_working_bucket_and_leaves_nothing() {
    let server = server_with_bucket().await;
    let store = open_store(&format!("s3://{BUCKET}/{PREFIX}"), &server.store_options())
        .await
        .expect("open");
    let report = check_location(store.as_ref()).await;
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.location, format!("s3://{BUCKET}/{PREFIX}"));
    assert!(
        store.list("").await.expect("list").is_empty(),
        "the probe cleaned up"
    );
}

#[tokio::test]
async fn check_location_reports_a_permanent_write_failure_for_a_missing_bucket() {
    let server = server_with_bucket().await;
    let store = open_store("s3://missing-bucket/repo", &server.store_options())
        .await
        .expect("open");
    let report = check_location(store.as_ref()).await;
    let (step, failure) = report.first_failure().expect("a failure");
    assert_eq!(step, ProbeStepKind::Write);
    assert_eq!(failure.kind, ProbeFailureKind::Permanent);
    assert!(
        failure.message.contains("missing-bucket"),
        "{}",
        failure.message
    );
}

#[tokio::test]
async fn open_store_stacks_the_caps_on_an_s3_store() {
    let server = server_with_bucket().await;
    let options = StoreOptions {
        max_concurrent_requests: Some(2),
        upload_bytes_per_second: std::num::NonZeroU64::new(64 * 1024 * 1024),
        ..server.store_options()
    };
    let store = open_store(&format!("s3://{BUCKET}/{PREFIX}"), &options)
        .await
        .expect("open");
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..8u64 {
        let store = store.clone();
        tasks.spawn(async move {
            store
                .put(
                    &format!("capped/{index}"),
                    pattern(64 * 1024, index),
                    PutMode::Overwrite,
                )
                .await
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("put");
    }
    assert_eq!(store.list("capped/").await.expect("list").len(), 8);
}

#[tokio::test]
async fn https_endpoints_work_with_a_ca_bundle_and_fail_clearly_without_one() {
    let server = MinioServer::start_tls()
        .await
        .expect("start minio with TLS");
    server.create_bucket(BUCKET).await.expect("create bucket");
    assert!(server.endpoint().starts_with("https://"));
    let ca_bundle = server
        .ca_bundle()
        .expect("a TLS server has a CA")
        .to_path_buf();

    let mut trusted = server.s3_options();
    trusted.ca_bundle = Some(ca_bundle.clone());
    let store = s3_store(&trusted, &format!("{BUCKET}/{PREFIX}")).await;
    check_store(Arc::new(store)).await;

    // Over HTTPS the bodies go up unsigned (`UNSIGNED-PAYLOAD`, the SDK's
    // hash of each left out): the server takes a single put and the parts
    // of a multipart one so, and gives the bytes back.
    let mut in_parts = trusted.clone();
    in_parts.multipart_threshold_bytes = Some(5 << 20);
    in_parts.part_size_bytes = Some(5 << 20);
    let store = s3_store(&in_parts, &format!("{BUCKET}/{PREFIX}")).await;
    let large: Vec<u8> = (0..(6u32 << 20)).map(|at| (at % 251) as u8).collect();
    store
        .put(
            "data/unsigned-parts",
            large.clone().into(),
            PutMode::Overwrite,
        )
        .await
        .expect("a multipart put over HTTPS");
    let back = store
        .get("data/unsigned-parts", None)
        .await
        .expect("get it back");
    assert!(
        back.as_ref() == large.as_slice(),
        "the parts came back as sent"
    );

    let untrusted = s3_store(&server.s3_options(), &format!("{BUCKET}/{PREFIX}")).await;
    let error = untrusted.list("").await.expect_err("unknown CA");
    assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
    assert_eq!(error.cause(), FailureCause::Tls, "{error}");
    assert!(error.to_string().contains("CA bundle"), "{error}");

    // The same CA given inline, as a BackupStorageLocation's caBundle.
    let mut inline = server.s3_options();
    inline.ca_bundle_pem = Some(std::fs::read(&ca_bundle).expect("read the CA"));
    let store = s3_store(&inline, &format!("{BUCKET}/{PREFIX}")).await;
    store
        .list("")
        .await
        .expect("trusted through the inline CA bundle");

    let mut not_pem = server.s3_options();
    not_pem.ca_bundle = Some(
        server
            .ca_bundle()
            .expect("ca")
            .with_file_name("public.crt.missing"),
    );
    assert!(
        S3Store::open(&format!("{BUCKET}/{PREFIX}"), &not_pem)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn neighbouring_blob_ranges_are_read_in_one_request() {
    let server = server_with_bucket().await;
    let backend: DynStore =
        Arc::new(s3_store(&server.s3_options(), &format!("{BUCKET}/{PREFIX}")).await);
    let data = pattern(2 * 1024 * 1024, 41);
    backend
        .put("data/pack", data.clone(), PutMode::Overwrite)
        .await
        .expect("put");
    let counted = counting_store(backend);
    // Ten blobs back to back with small gaps, and one far away.
    let mut ranges: Vec<std::ops::Range<u64>> = (0..10u64)
        .map(|index| index * 5000..index * 5000 + 4000)
        .collect();
    ranges.push(1_900_000..1_950_000);
    let blobs = get_ranges(
        counted.as_ref(),
        "data/pack",
        &ranges,
        DEFAULT_COALESCE_GAP_BYTES / 16,
    )
    .await
    .expect("ranged reads");
    assert_eq!(
        counted.layer().calls(),
        2,
        "one read for the neighbours, one for the far blob"
    );
    for (range, blob) in ranges.iter().zip(&blobs) {
        assert_eq!(
            blob,
            &data.slice(range.start as usize..range.end as usize),
            "{range:?}"
        );
    }
}

/// Requests seen by [`recording_server`]: method with path and query,
/// and `x-amz-content-sha256`.
type Seen = Arc<std::sync::Mutex<Vec<(String, String)>>>;

/// Answer the requests of one connection of [`recording_server`].
async fn answer_puts(
    socket: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    recorded: Seen,
) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let mut socket = BufReader::new(socket);
    loop {
        let mut request_line = String::new();
        if socket.read_line(&mut request_line).await.unwrap_or(0) == 0 {
            return;
        }
        let (mut length, mut sha) = (0usize, String::new());
        loop {
            let mut line = String::new();
            socket.read_line(&mut line).await.expect("header");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').expect("header line");
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().expect("length"),
                "x-amz-content-sha256" => sha = value.trim().to_string(),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        socket.read_exact(&mut body).await.expect("body");
        let target = request_line
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        let reply = if target.starts_with("POST") && target.ends_with("?uploads") {
            "<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>u1</UploadId></InitiateMultipartUploadResult>"
        } else if target.starts_with("POST") {
            "<CompleteMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><ETag>\"e\"</ETag></CompleteMultipartUploadResult>"
        } else {
            ""
        };
        recorded.lock().expect("requests").push((target, sha));
        let response = format!(
            "HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: {}\r\n\r\n{reply}",
            reply.len()
        );
        socket.write_all(response.as_bytes()).await.expect("reply");
        socket.flush().await.expect("flush");
    }
}

/// A server on 127.0.0.1 that answers every request of a put (a single
/// PUT, or a multipart upload's creation, parts and completion) with
/// success and records it; plain HTTP, or HTTPS with a certificate of a
/// throwaway CA when `tls` (the CA's PEM returned with the endpoint).
async fn recording_server(tls: bool) -> (String, Option<Vec<u8>>, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let seen: Seen = Default::default();
    let recorded = seen.clone();
    let (acceptor, ca) = if tls {
        let certificates = TestCertificates::new().expect("certificates");
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![certificates.server.der().clone()],
                tokio_rustls::rustls::pki_types::PrivateKeyDer::Pkcs8(
                    certificates.server_key.serialize_der().into(),
                ),
            )
            .expect("server config");
        (
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
            Some(certificates.ca_pem.into_bytes()),
        )
    } else {
        (None, None)
    };
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let recorded = recorded.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                match acceptor {
                    Some(acceptor) => {
                        if let Ok(socket) = acceptor.accept(socket).await {
                            answer_puts(socket, recorded).await;
                        }
                    }
                    None => answer_puts(socket, recorded).await,
                }
            });
        }
    });
    let scheme = if tls { "https" } else { "http" };
    (format!("{scheme}://{address}"), ca, seen)
}

#[tokio::test]
async fn a_put_signs_its_body_over_plain_http_and_sends_it_unsigned_over_https() {
    let sha256 = |data: &[u8]| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(data))
    };
    let small = Bytes::from_static(b"a small object");
    let large = Bytes::from(vec![
        7u8;
        haulage::store::s3::MIN_PART_SIZE_BYTES as usize + 1024
    ]);
    for tls in [false, true] {
        let (endpoint, ca, seen) = recording_server(tls).await;
        let options = S3Options {
            endpoint: Some(endpoint),
            region: Some("us-east-1".to_string()),
            credentials: Some(S3Credentials {
                access_key_id: "AKID".to_string(),
                secret_access_key: "secret".to_string(),
                session_token: None,
            }),
            ca_bundle_pem: ca,
            multipart_threshold_bytes: Some(haulage::store::s3::MIN_PART_SIZE_BYTES),
            part_size_bytes: Some(haulage::store::s3::MIN_PART_SIZE_BYTES),
            ..S3Options::default()
        };
        let store = S3Store::open("s3://bucket/prefix", &options)
            .await
            .expect("open");
        store
            .put("data/small", small.clone(), PutMode::Overwrite)
            .await
            .expect("single put");
        store
            .put("data/large", large.clone(), PutMode::Overwrite)
            .await
            .expect("multipart put");
        let requests = seen.lock().expect("requests").clone();
        let body_of = |target: &str| {
            requests
                .iter()
                .filter(|(seen, _)| seen.starts_with(target))
                .map(|(_, sha)| sha.clone())
                .collect::<Vec<_>>()
        };
        let single = body_of("PUT /bucket/prefix/data/small");
        let mut parts = body_of("PUT /bucket/prefix/data/large?");
        assert_eq!((single.len(), parts.len()), (1, 2), "{requests:?}");
        if tls {
            assert_eq!(single[0], "UNSIGNED-PAYLOAD");
            assert!(
                parts.iter().all(|sha| sha == "UNSIGNED-PAYLOAD"),
                "{parts:?}"
            );
        } else {
            assert_eq!(single[0], sha256(&small));
            // The parts go up at once, in either order.
            let mut expected = vec![
                sha256(&large[..haulage::store::s3::MIN_PART_SIZE_BYTES as usize]),
                sha256(&large[haulage::store::s3::MIN_PART_SIZE_BYTES as usize..]),
            ];
            parts.sort();
            expected.sort();
            assert_eq!(parts, expected);
        }
    }
}
