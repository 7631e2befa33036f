//! Encryption at rest (format 2): nothing readable in the raw objects,
//! every changed, swapped or truncated object refused with its name, keys
//! added and removed through the binary, and plaintext (format 1)
//! repositories still read and written.

use std::path::Path;

use haulage::engine::{EngineError, KeySource, Repository};
use haulage::repo::ObjectId;

use super::support::{
    TEST_PASSWORD, TestRepo, assert_a_problem, assert_same_tree, files_under, haulage,
    the_only_file,
};

/// A marker no random data contains, in a compressible text file (so it
/// would show through zstd's literals if it were not sealed).
const MARKER: &[u8] = b"HAULAGE-PLAINTEXT-MARKER-7f3a9c";

fn write_marked_source(source: &Path) {
    std::fs::create_dir_all(source.join("dir")).unwrap();
    let mut text = Vec::new();
    for line in 0..2000 {
        text.extend_from_slice(format!("line {line} ").as_bytes());
        text.extend_from_slice(MARKER);
        text.push(b'\n');
    }
    std::fs::write(source.join("dir/marked.txt"), &text).unwrap();
    // Small enough to be stored inline in its tree's pack.
    std::fs::write(source.join("small.txt"), MARKER).unwrap();
    // The marker as a file name too: it lives in a tree blob.
    std::fs::write(
        source.join(String::from_utf8_lossy(MARKER).as_ref()),
        b"name",
    )
    .unwrap();
}

/// Objects under the repository whose raw bytes contain `needle`.
fn objects_containing(root: &Path, needle: &[u8]) -> Vec<String> {
    files_under(root)
        .into_iter()
        .filter(|(path, _)| {
            let bytes = std::fs::read(path).unwrap();
            bytes.windows(needle.len()).any(|window| window == needle)
        })
        .map(|(path, _)| path.strip_prefix(root).unwrap().display().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_plaintext_of_a_backed_up_file_appears_in_any_object_of_an_encrypted_repository() {
    let encrypted = TestRepo::new().await;
    let plaintext = TestRepo::plaintext().await;
    for repo in [&encrypted, &plaintext] {
        let source = repo.dir.path().join("source");
        write_marked_source(&source);
        let outcome = repo.backup(&source).await;
        let target = repo.dir.path().join("restored");
        repo.restore(&outcome.snapshot_id, &target).await;
        assert_same_tree(&source, &target);
    }
    assert_eq!(
        objects_containing(&encrypted.root(), MARKER),
        Vec::<String>::new()
    );
    // The check can fail: the plaintext format shows the marker (in the
    // pack holding the small file and the tree naming the file).
    assert!(
        !objects_containing(&plaintext.root(), MARKER).is_empty(),
        "the marker should be visible in a plaintext repository"
    );
    // Nor the source path, which a snapshot manifest names.
    let source = encrypted.dir.path().join("source");
    let path = source.to_string_lossy();
    assert_eq!(
        objects_containing(&encrypted.root(), path.as_bytes()),
        Vec::<String>::new()
    );
}

fn flip_byte(path: &Path, position: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let position = position.min(bytes.len() - 1);
    bytes[position] ^= 0x20;
    std::fs::write(path, bytes).unwrap();
}

fn name_of(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

async fn repo_with_one_backup() -> (TestRepo, ObjectId) {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    write_marked_source(&source);
    let outcome = repo.backup(&source).await;
    (repo, outcome.snapshot_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_any_sealed_object_is_refused_naming_the_object() {
    // A blob of the pack: verify names the blob and the pack.
    let (repo, snapshot) = repo_with_one_backup().await;
    let pack = repo.the_only_pack_of(haulage::repo::BlobKind::Data).await;
    flip_byte(&pack, 20);
    assert_a_problem(&repo.verify(snapshot).await, |problem| {
        problem
            .object
            .contains(&format!("in pack {}", name_of(&pack)))
            && problem.message.contains("failed authentication")
    });

    // The pack's trailer: a reader that has no index for the pack (here:
    // the index removed) refuses the trailer, naming the pack.
    let (repo, _) = repo_with_one_backup().await;
    let pack = repo.the_only_pack_of(haulage::repo::BlobKind::Data).await;
    let length = std::fs::metadata(&pack).unwrap().len() as usize;
    flip_byte(&pack, length - 20);
    std::fs::remove_file(the_only_file(&repo.root(), "index")).unwrap();
    let loaded = repo.repository.load_index().await.unwrap();
    assert!(
        loaded
            .damaged_packs
            .iter()
            .any(|message| message.contains(&name_of(&pack))
                && message.contains("failed authentication")),
        "{:?}",
        loaded.damaged_packs
    );

    // The index file: its name no longer matches; the packs' trailers
    // stand in for it.
    let (repo, snapshot) = repo_with_one_backup().await;
    let index = the_only_file(&repo.root(), "index");
    flip_byte(&index, 30);
    let loaded = repo.repository.load_index().await.unwrap();
    assert!(
        loaded.damaged_indexes[0].contains(&name_of(&index)),
        "{:?}",
        loaded.damaged_indexes
    );
    let target = repo.dir.path().join("restored");
    assert!(repo.restore(&snapshot, &target).await.problems.is_empty());

    // The snapshot manifest.
    let (repo, snapshot) = repo_with_one_backup().await;
    flip_byte(&the_only_file(&repo.root(), "snapshots"), 40);
    repo.assert_snapshot_refused(&snapshot).await;

    // The config's authenticator: the repository does not open.
    let (repo, _) = repo_with_one_backup().await;
    let config_path = repo.root().join("config");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config["packTargetBytes"] = (32u32 << 20).into();
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let error = Repository::open(
        repo.repository.store().clone(),
        &KeySource::password(TEST_PASSWORD),
    )
    .await
    .expect_err("refused");
    assert!(error.to_string().contains("config was changed"), "{error}");

    // The key file: it no longer matches its name and opens nothing.
    let (repo, _) = repo_with_one_backup().await;
    flip_byte(&the_only_file(&repo.root(), "keys"), 200);
    let error = Repository::open(
        repo.repository.store().clone(),
        &KeySource::password(TEST_PASSWORD),
    )
    .await
    .expect_err("refused");
    assert!(matches!(error, EngineError::NoKeys { .. }), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_or_truncated_object_is_refused_naming_the_object() {
    // A snapshot manifest dressed as an index file (the index's start
    // marker, named by its hash): the name matches, the seal does not.
    let (repo, _) = repo_with_one_backup().await;
    let manifest = std::fs::read(the_only_file(&repo.root(), "snapshots")).unwrap();
    let mut dressed = haulage::repo::codec::SEALED_INDEX_MAGIC.to_vec();
    dressed.extend_from_slice(&manifest[8..]);
    let as_index = ObjectId::of(&dressed);
    std::fs::write(repo.root().join("index").join(as_index.to_hex()), &dressed).unwrap();
    let loaded = repo.repository.load_index().await.unwrap();
    assert!(
        loaded
            .damaged_indexes
            .iter()
            .any(|message| message.contains(&as_index.to_hex())
                && message.contains("authentication")),
        "{:?}",
        loaded.damaged_indexes
    );

    // Two blobs of the same length swapped in their pack: each sealed
    // blob is bound to its id, so both are refused by their seal (before
    // the id check after decompression would catch them).
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("a"), super::support::random_bytes(1, 100_000)).unwrap();
    std::fs::write(source.join("b"), super::support::random_bytes(2, 100_000)).unwrap();
    let snapshot = repo.backup(&source).await.snapshot_id;
    let pack = repo.the_only_pack_of(haulage::repo::BlobKind::Data).await;
    let mut bytes = std::fs::read(&pack).unwrap();
    let entries = repo.repository.codec().decode_pack(&bytes, "pack").unwrap();
    let (first, second) = (entries[0], entries[1]);
    assert_eq!(first.stored_length, second.stored_length);
    let length = first.stored_length as usize;
    let (a, b) = (first.offset as usize, second.offset as usize);
    let first_bytes = bytes[a..a + length].to_vec();
    bytes.copy_within(b..b + length, a);
    bytes[b..b + length].copy_from_slice(&first_bytes);
    std::fs::write(&pack, &bytes).unwrap();
    let report = repo.verify(snapshot).await;
    for entry in [first, second] {
        assert!(
            report
                .problems
                .iter()
                .any(|problem| problem.object.contains(&format!(
                    "blob {} in pack {}",
                    entry.id,
                    name_of(&pack)
                )) && problem.message.contains("failed authentication")),
            "{:?}",
            report.problems
        );
    }

    // A truncated pack and a truncated snapshot.
    let (repo, snapshot) = repo_with_one_backup().await;
    let pack = repo.the_only_pack_of(haulage::repo::BlobKind::Data).await;
    let bytes = std::fs::read(&pack).unwrap();
    std::fs::write(&pack, &bytes[..bytes.len() / 2]).unwrap();
    assert_a_problem(&repo.verify(snapshot).await, |problem| {
        problem.object.contains(&name_of(&pack))
    });
    let manifest = the_only_file(&repo.root(), "snapshots");
    let bytes = std::fs::read(&manifest).unwrap();
    std::fs::write(&manifest, &bytes[..bytes.len() - 1]).unwrap();
    repo.assert_snapshot_refused(&snapshot).await;
}

fn run(args: &[&str], password: Option<&str>) -> std::process::Output {
    let mut command = haulage();
    match password {
        Some(password) => command.env("HAULAGE_PASSWORD", password),
        None => command.env_remove("HAULAGE_PASSWORD"),
    };
    command.args(args).output().unwrap()
}

fn succeeds(args: &[&str], password: Option<&str>) -> String {
    let output = run(args, password);
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn fails(args: &[&str], password: Option<&str>) -> String {
    let output = run(args, password);
    assert_eq!(output.status.code(), Some(1), "{args:?} should fail");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn keys_are_added_listed_and_removed_and_a_removed_password_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let repo = repo.to_str().unwrap();
    let source = dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("file"), b"content").unwrap();
    let new_password = dir.path().join("second");
    std::fs::write(&new_password, "second password\n").unwrap();
    let new_password = new_password.to_str().unwrap();

    succeeds(&["repo", "init", "--repo", repo], Some("first"));
    succeeds(
        &[
            "backup",
            "--no-progress",
            "--repo",
            repo,
            source.to_str().unwrap(),
        ],
        Some("first"),
    );
    // Init without any password source and no terminal: refused, nothing made.
    let other = dir.path().join("other");
    let message = fails(&["repo", "init", "--repo", other.to_str().unwrap()], None);
    assert!(message.contains("no terminal"), "{message}");
    assert!(!other.exists());

    succeeds(
        &[
            "repo",
            "key",
            "add",
            "--repo",
            repo,
            "--new-password-file",
            new_password,
        ],
        Some("first"),
    );
    let listed: serde_json::Value = serde_json::from_str(&succeeds(
        &["repo", "key", "list", "--json", "--repo", repo],
        Some("first"),
    ))
    .unwrap();
    let keys = listed.as_array().unwrap();
    assert_eq!(keys.len(), 2);
    let first_key = keys.iter().find(|key| key["current"] == true).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();

    // The key in use is not removed without the flag.
    let message = fails(
        &["repo", "key", "remove", &first_key[..8], "--repo", repo],
        Some("first"),
    );
    assert!(message.contains("--allow-current"), "{message}");
    // Opened with the second password, the first key goes.
    succeeds(
        &[
            "repo",
            "key",
            "remove",
            &first_key[..8],
            "--repo",
            repo,
            "--password-file",
            new_password,
        ],
        None,
    );
    let message = fails(&["snapshots", "--repo", repo], Some("first"));
    assert!(message.contains("wrong password"), "{message}");
    let listing = succeeds(
        &["snapshots", "--repo", repo, "--password-file", new_password],
        Some("ignored: the file comes first"),
    );
    assert!(listing.contains("1 snapshots"), "{listing}");
    // The last key is never removed.
    let listed: serde_json::Value = serde_json::from_str(&succeeds(
        &["repo", "key", "list", "--json", "--repo", repo],
        Some("second password"),
    ))
    .unwrap();
    let last = listed[0]["id"].as_str().unwrap().to_string();
    let message = fails(
        &[
            "repo",
            "key",
            "remove",
            &last,
            "--allow-current",
            "--repo",
            repo,
        ],
        Some("second password"),
    );
    assert!(message.contains("only key"), "{message}");
    assert_eq!(files_under(&Path::new(repo).join("keys")).len(), 1);
}

#[test]
fn a_wrong_password_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let source = dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("file"), b"content").unwrap();
    let repo_text = repo.to_str().unwrap();
    succeeds(&["repo", "init", "--repo", repo_text], Some("right"));
    let before = files_under(&repo);
    let message = fails(
        &["backup", "--repo", repo_text, source.to_str().unwrap()],
        Some("wrong"),
    );
    assert!(message.contains("wrong password"), "{message}");
    assert_eq!(files_under(&repo), before, "something was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_repository_is_read_and_written_as_format_1() {
    let repo = TestRepo::plaintext().await;
    let source = repo.dir.path().join("source");
    write_marked_source(&source);
    let first = repo.backup(&source).await;
    assert_eq!(first.snapshot.format_version, 1);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo.root().join("config")).unwrap()).unwrap();
    assert_eq!(config["formatVersion"], 1);
    assert!(config["secret"].is_string());
    // Opened as the cluster opens it: no key.
    let reopened = repo.reopen().await;
    assert!(!reopened.codec().is_encrypted());
    let target = repo.dir.path().join("restored");
    repo.restore(&first.snapshot_id, &target).await;
    assert_same_tree(&source, &target);
    // An encrypted repository opened without a key says why.
    let encrypted = TestRepo::new().await;
    let error = Repository::open(
        encrypted.repository.store().clone(),
        &KeySource::PlaintextOnly,
    )
    .await
    .expect_err("refused");
    assert!(error.to_string().contains("is encrypted"), "{error}");
}
