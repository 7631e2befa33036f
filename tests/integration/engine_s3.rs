//! The engine over `s3://` against a real MinIO server, through the
//! `haulage` binary with the standard `AWS_*` variables, as a user runs it:
//! a byte-identical round trip, a server stopped mid-backup, connections cut
//! mid-upload, 503 SlowDown for a fifth of the requests and a silent
//! server, a cancelled backup, and a restore that reads each pack once.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use haulage::engine::Repository;
use haulage::engine::progress::Progress;
use haulage::engine::restore::{RestoreOptions, restore};
use haulage::repo::codec::ObjectCodec;
use haulage::repo::{BlobId, DATA_PREFIX, ObjectId};
use haulage::store::{DynStore, open_store};
use tokio_util::sync::CancellationToken;

use crate::engine::support::{
    assert_same_tree, counting_store, data_reads_per_pack, haulage, pack_entries, packs_with_data,
    random_bytes,
};
use crate::support::expect_success;
use crate::support::minio::{MinioServer, SECRET_KEY, with_s3_credentials};
use crate::support::proxy::FaultProxy;

const BUCKET: &str = "haulage-engine";
const PREFIX: &str = "cluster-a/repo";
/// How long a backup process may take in these tests before it counts as hung.
const PROCESS_DEADLINE: Duration = Duration::from_secs(300);

fn repo_url() -> String {
    format!("s3://{BUCKET}/{PREFIX}")
}

async fn server_with_bucket() -> MinioServer {
    let server = MinioServer::start().await.expect("start minio");
    server.create_bucket(BUCKET).await.expect("create bucket");
    server
}

/// A fault-injecting proxy in front of `server`.
async fn proxy_in_front_of(server: &MinioServer) -> FaultProxy {
    FaultProxy::start(([127, 0, 0, 1], server.port()).into())
        .await
        .expect("start proxy")
}

/// `haulage ARGS` with the repository at `endpoint`, credentials from the
/// standard variables.
fn haulage_at(endpoint: &str) -> Command {
    let mut command = haulage();
    // Packs (16 MiB) as multipart uploads, so the fault tests cut and
    // cancel multipart uploads, not only single PUTs.
    with_s3_credentials(&mut command, endpoint).env("HAULAGE_S3_MULTIPART_THRESHOLD", "8MiB");
    command
}

fn assert_success(output: &Output, what: &str) {
    expect_success(output, what);
}

fn init_repo(endpoint: &str) {
    let output = haulage_at(endpoint)
        .args(["repo", "init", "--repo", &repo_url()])
        .output()
        .expect("run haulage repo init");
    assert_success(&output, "repo init");
}

/// A repository initialised on `server` and, in a fresh temporary directory
/// (returned to keep it alive), a source tree written by [`write_source`].
fn initialised_repo_and_source(
    server: &MinioServer,
    large: u64,
    large_bytes: usize,
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let source = dir.path().join("source");
    write_source(&source, large, large_bytes);
    init_repo(&server.endpoint());
    (dir, source)
}

/// Start `haulage backup FLAGS --repo … SOURCE` against `endpoint` with its
/// output captured.
fn spawn_backup(endpoint: &str, flags: &[&str], source: &Path) -> Child {
    haulage_at(endpoint)
        .arg("backup")
        .args(flags)
        .args(["--repo", &repo_url()])
        .arg(source)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start backup")
}

/// The snapshot id in a `backup --json` summary.
fn snapshot_id(summary: &serde_json::Value) -> &str {
    summary["snapshotId"].as_str().expect("id")
}

/// Back up `source`; returns the JSON summary.
fn backup_json(endpoint: &str, source: &Path) -> serde_json::Value {
    let output = haulage_at(endpoint)
        .args(["backup", "--json", "--repo", &repo_url()])
        .arg(source)
        .output()
        .expect("run haulage backup");
    assert_success(&output, "backup");
    serde_json::from_slice(&output.stdout).expect("backup --json prints JSON")
}

/// `haulage verify` succeeds and `backup`'s snapshot restores into
/// `work/restored` as `source`.
fn verify_and_restore(
    server: &MinioServer,
    backup: &serde_json::Value,
    source: &Path,
    work: &Path,
) {
    let endpoint = &server.endpoint();
    let snapshot = snapshot_id(backup);
    let target = &work.join("restored");
    let verify = haulage_at(endpoint)
        .args(["verify", "--repo", &repo_url()])
        .output()
        .expect("run haulage verify");
    assert_success(&verify, "verify");
    let restored = haulage_at(endpoint)
        .args(["restore", snapshot, "--no-progress", "--repo", &repo_url()])
        .arg(target)
        .output()
        .expect("run haulage restore");
    assert_success(&restored, "restore");
    assert_same_tree(source, target);
}

/// A tree that needs several packs (multipart uploads) and many small
/// objects' worth of files: `large` random files of `large_bytes`, plus
/// small files, an empty file, a symlink and a nested directory.
fn write_source(root: &Path, large: u64, large_bytes: usize) {
    std::fs::create_dir_all(root.join("nested/deeper")).expect("mkdir");
    for index in 0..large {
        std::fs::write(
            root.join(format!("volume-{index:02}.img")),
            random_bytes(7_000 + index, large_bytes),
        )
        .expect("write large file");
    }
    for index in 0..200u64 {
        let size = 100 + (index as usize * 997) % 40_000;
        std::fs::write(
            root.join("nested").join(format!("small-{index:03}.txt")),
            random_bytes(index, size),
        )
        .expect("write small file");
    }
    std::fs::write(root.join("nested/deeper/empty"), b"").expect("write empty file");
    std::os::unix::fs::symlink("../volume-00.img", root.join("nested/link")).expect("symlink");
}

/// Every object under `PREFIX/data/` as (key, bytes), read behind the
/// store's back.
async fn stored_packs(server: &MinioServer) -> Vec<(String, Vec<u8>)> {
    let client = server.admin_client();
    let mut packs = Vec::new();
    let mut token = None;
    loop {
        let page = client
            .list_objects_v2()
            .bucket(BUCKET)
            .prefix(format!("{PREFIX}/{DATA_PREFIX}"))
            .set_continuation_token(token.take())
            .send()
            .await
            .expect("list packs");
        for object in page.contents() {
            let key = object.key().expect("key").to_string();
            let body = client
                .get_object()
                .bucket(BUCKET)
                .key(&key)
                .send()
                .await
                .expect("get pack")
                .body
                .collect()
                .await
                .expect("read pack")
                .into_bytes()
                .to_vec();
            packs.push((key, body));
        }
        match page.next_continuation_token() {
            Some(next) => token = Some(next.to_string()),
            None => return packs,
        }
    }
}

async fn pack_count(server: &MinioServer) -> usize {
    server
        .admin_client()
        .list_objects_v2()
        .bucket(BUCKET)
        .prefix(format!("{PREFIX}/{DATA_PREFIX}"))
        .send()
        .await
        .map(|page| page.contents().len())
        .unwrap_or(0)
}

/// How the repository the CLI created encodes its objects.
async fn repo_codec(server: &MinioServer) -> ObjectCodec {
    open_repository(repo_store(server).await)
        .await
        .codec()
        .clone()
}

/// The repository's store on `server`, as the CLI opens it.
async fn repo_store(server: &MinioServer) -> DynStore {
    open_store(&repo_url(), &server.store_options())
        .await
        .expect("open store")
}

/// The repository in `store`, opened with the test password.
async fn open_repository(store: DynStore) -> Repository {
    Repository::open(
        store,
        &haulage::engine::KeySource::password(crate::engine::support::TEST_PASSWORD),
    )
    .await
    .expect("open the repository")
}

/// Check that every stored pack is whole: its bytes hash to its name and
/// its trailer decodes. Returns (blobs counted with duplicates, distinct blobs).
fn assert_packs_whole(
    codec: &ObjectCodec,
    packs: &[(String, Vec<u8>)],
) -> (usize, HashSet<BlobId>) {
    let mut total = 0;
    let mut unique = HashSet::new();
    for (key, bytes) in packs {
        let name = key.rsplit('/').next().expect("pack name");
        assert_eq!(
            ObjectId::of(bytes).to_hex(),
            name,
            "pack {key} does not match its name: a partial or corrupt object is visible"
        );
        let entries = codec
            .decode_pack(bytes, name)
            .unwrap_or_else(|error| panic!("pack {key}: {error}"));
        for entry in entries {
            total += 1;
            unique.insert(entry.id);
        }
    }
    (total, unique)
}

/// [`assert_packs_whole`] over the packs stored on `server`.
async fn assert_stored_packs_whole(server: &MinioServer) -> (usize, HashSet<BlobId>) {
    assert_packs_whole(&repo_codec(server).await, &stored_packs(server).await)
}

/// Every stored pack is whole and no blob is stored in two of them.
async fn assert_packs_whole_and_each_blob_stored_once(server: &MinioServer) {
    let (total, unique) = assert_stored_packs_whole(server).await;
    assert_eq!(total, unique.len(), "a blob was stored twice");
}

/// No multipart upload is left pending under the repository.
async fn assert_no_multipart_upload_pending(server: &MinioServer, what: &str) {
    let pending = server
        .multipart_uploads(BUCKET, PREFIX)
        .await
        .expect("list uploads");
    assert!(
        pending.is_empty(),
        "{what} left multipart uploads pending: {pending:?}"
    );
}

/// Wait (bounded) for `condition`, checking the backup process is still running.
async fn wait_while_running(
    child: &mut Child,
    what: &str,
    mut condition: impl AsyncFnMut() -> bool,
) {
    let deadline = Instant::now() + PROCESS_DEADLINE;
    while !condition().await {
        assert!(
            child.try_wait().expect("poll backup").is_none(),
            "the backup ended before {what}"
        );
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn wait_with_output(child: Child) -> Output {
    child.wait_with_output().expect("wait for haulage")
}

#[tokio::test(flavor = "multi_thread")]
async fn backup_verify_and_restore_through_s3_are_byte_identical_and_leave_no_upload_behind() {
    let server = server_with_bucket().await;
    let (dir, source) = initialised_repo_and_source(&server, 3, 12 << 20);

    let summary = backup_json(&server.endpoint(), &source);
    assert!(summary["packsWritten"].as_u64().expect("packs") >= 2);
    verify_and_restore(&server, &summary, &source, dir.path());

    // A second backup of the unchanged tree stores nothing new.
    let again = backup_json(&server.endpoint(), &source);
    assert_eq!(again["bytesNew"].as_u64(), Some(0), "{again}");
    assert_packs_whole_and_each_blob_stored_once(&server).await;
    assert_no_multipart_upload_pending(&server, "the backups").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_stopped_mid_backup_fails_it_naming_the_endpoint_and_the_rerun_sends_only_missing_packs()
 {
    let mut server = server_with_bucket().await;
    let (dir, source) = initialised_repo_and_source(&server, 8, 16 << 20);

    // Slow reading so the server can be stopped between packs.
    let mut first = spawn_backup(
        &server.endpoint(),
        &["--no-progress", "--limit-read", "40MiB"],
        &source,
    );
    wait_while_running(&mut first, "two packs were stored", async || {
        pack_count(&server).await >= 2
    })
    .await;
    server.stop();
    let output = wait_with_output(first);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("127.0.0.1:{}", server.port())),
        "the error does not name the endpoint: {stderr}"
    );
    assert!(
        !stderr.contains(SECRET_KEY),
        "the error shows the secret: {stderr}"
    );

    server.restart().await.expect("restart minio");
    let (stored_before, _) = assert_stored_packs_whole(&server).await;
    assert!(stored_before > 0);
    let summary = backup_json(&server.endpoint(), &source);
    let bytes_new = summary["bytesNew"].as_u64().expect("bytesNew");
    let total_bytes = summary["totalBytes"].as_u64().expect("totalBytes");
    assert!(
        bytes_new < total_bytes,
        "the rerun stored everything again ({bytes_new} of {total_bytes} bytes)"
    );
    assert_packs_whole_and_each_blob_stored_once(&server).await;
    verify_and_restore(&server, &summary, &source, dir.path());
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_cut_mid_upload_never_make_a_corrupt_object_visible() {
    let server = server_with_bucket().await;
    let proxy = proxy_in_front_of(&server).await;
    let (dir, source) = initialised_repo_and_source(&server, 4, 12 << 20);

    let mut backup = spawn_backup(
        &proxy.endpoint(),
        &["--json", "--no-progress", "--limit-read", "40MiB"],
        &source,
    );
    // Cut three upload connections, each a few MiB into whatever is in flight.
    for cut in 1..=3u64 {
        proxy.cut_upload_after(3 << 20);
        wait_while_running(&mut backup, "the connection was cut", async || {
            proxy.cuts() >= cut
        })
        .await;
        // Nothing visible is ever partial, also while the backup runs.
        assert_stored_packs_whole(&server).await;
    }
    let output = wait_with_output(backup);
    assert_success(&output, "backup through the cutting proxy");
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_packs_whole_and_each_blob_stored_once(&server).await;
    verify_and_restore(&server, &summary, &source, dir.path());
    assert_no_multipart_upload_pending(&server, "the backups").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_throttles_a_fifth_of_its_requests_slows_backup_and_restore_but_fails_neither()
{
    let server = server_with_bucket().await;
    let proxy = proxy_in_front_of(&server).await;
    let (dir, source) = initialised_repo_and_source(&server, 4, 12 << 20);
    // One request in five answered 503 SlowDown for the whole backup and
    // restore, as S3 answers a client above its request rate.
    proxy.slow_down(0.2);
    let summary = backup_json(&proxy.endpoint(), &source);
    let backup_requests = proxy.requests();
    let backup_slow_downs = proxy.slow_downs();
    // The restore also waits out a server that answers nothing for 3 s and
    // then answers slowly.
    proxy.go_silent_for(Duration::from_secs(3));
    proxy.delay_requests(Duration::from_millis(20));
    let target = dir.path().join("restored-throttled");
    let restored = haulage_at(&proxy.endpoint())
        .args([
            "restore",
            snapshot_id(&summary),
            "--no-progress",
            "--repo",
            &repo_url(),
        ])
        .arg(&target)
        .output()
        .expect("run haulage restore");
    assert_success(&restored, "restore through the throttling proxy");
    assert_same_tree(&source, &target);
    println!(
        "backup: {backup_slow_downs} of {backup_requests} requests answered 503 SlowDown; \
         restore: {} of {}",
        proxy.slow_downs() - backup_slow_downs,
        proxy.requests() - backup_requests
    );
    // Every fifth request, the retries included.
    assert!(backup_slow_downs > 0);
    assert_eq!(backup_slow_downs, backup_requests / 5);
    assert_eq!(proxy.slow_downs(), proxy.requests() / 5);
    assert!(proxy.slow_downs() > backup_slow_downs);
    assert_packs_whole_and_each_blob_stored_once(&server).await;
    verify_and_restore(&server, &summary, &source, dir.path());
    assert_no_multipart_upload_pending(&server, "the throttled backup").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_stopped_by_sigterm_mid_upload_leaves_whole_packs_a_last_checkpoint_and_no_multipart_upload()
 {
    let server = server_with_bucket().await;
    let proxy = proxy_in_front_of(&server).await;
    let (_dir, source) = initialised_repo_and_source(&server, 4, 16 << 20);

    // Hold every upload byte after the first few MiB, so multipart uploads
    // are in flight when the signal arrives.
    proxy.stall_upload_after(6 << 20);
    let mut backup = spawn_backup(&proxy.endpoint(), &["--no-progress"], &source);
    wait_while_running(
        &mut backup,
        "a multipart upload was in flight",
        async || {
            proxy.uploaded_bytes() >= 6 << 20
                && !server
                    .multipart_uploads(BUCKET, PREFIX)
                    .await
                    .unwrap_or_default()
                    .is_empty()
        },
    )
    .await;
    let signalled = Command::new("kill")
        .args(["-TERM", &backup.id().to_string()])
        .status()
        .expect("run kill");
    assert!(signalled.success());
    // The stopped backup completes the uploads in flight (or, past its
    // save's time, aborts them) through the proxy too: let them pass. The
    // process must wait for them before it exits.
    proxy.resume();
    let output = wait_with_output(backup);
    assert_eq!(
        output.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_no_multipart_upload_pending(&server, "the stopped backup").await;
    assert_stored_packs_whole(&server).await;
    let repository = open_repository(repo_store(&server).await).await;
    let checkpoints = repository
        .all_checkpoints()
        .await
        .expect("list checkpoints");
    assert_eq!(
        checkpoints.len(),
        1,
        "the stopped backup wrote no last checkpoint"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_through_s3_reads_each_pack_once() {
    let server = server_with_bucket().await;
    let (dir, source) = initialised_repo_and_source(&server, 3, 12 << 20);
    let summary = backup_json(&server.endpoint(), &source);
    let snapshot: ObjectId = snapshot_id(&summary).parse().expect("snapshot id");

    let counter = counting_store(repo_store(&server).await);
    let repository = open_repository(counter.clone()).await;
    let packs = pack_entries(&repository).await;
    assert!(packs.len() >= 2, "{} packs", packs.len());
    counter.layer().take_reads();
    let target = dir.path().join("restored");
    let outcome = restore(
        &repository,
        &snapshot,
        RestoreOptions::new(&target),
        Arc::new(Progress::default()),
        CancellationToken::new(),
    )
    .await
    .expect("restore");
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_same_tree(&source, &target);
    let per_pack = data_reads_per_pack(&counter.layer().take_reads(), &packs);
    assert_eq!(per_pack.len(), packs_with_data(&packs));
    for (pack, (reads, bytes)) in &per_pack {
        assert_eq!(
            *reads, 1,
            "pack {pack} was read {reads} times ({bytes} bytes)"
        );
    }
}
