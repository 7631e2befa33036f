//! A flipped byte anywhere is found by verify and by restore, which
//! restores everything else.

use std::path::Path;

use haulage::engine::verify::verify;

use super::support::{TestRepo, files_under, random_bytes};

fn flip_byte(path: &Path, offset_from_start: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    let position = (offset_from_start as usize).min(bytes.len() - 1);
    bytes[position] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

async fn repo_with_two_files() -> (TestRepo, haulage::repo::ObjectId) {
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(source.join("victim.bin"), random_bytes(1, 3 << 20)).unwrap();
    std::fs::write(source.join("bystander.txt"), b"unrelated".repeat(1000)).unwrap();
    let outcome = repo.backup(&source).await;
    (repo, outcome.snapshot_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_a_pack_is_named_by_verify_and_fails_only_the_affected_file_on_restore() {
    let (repo, snapshot) = repo_with_two_files().await;
    let packs = files_under(&repo.root().join("data"));
    assert_eq!(packs.len(), 1);
    // The first blob in the pack is victim.bin's first chunk (walk order).
    flip_byte(&packs[0].0, 100);

    let report = verify(&repo.repository, Some(snapshot), Default::default())
        .await
        .unwrap();
    let pack_name = packs[0]
        .0
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let problem = report
        .problems
        .iter()
        .find(|problem| problem.object.contains(&pack_name) && problem.object.starts_with("blob"))
        .unwrap_or_else(|| panic!("no blob problem naming the pack: {:?}", report.problems));
    assert!(
        problem
            .affected_files
            .iter()
            .any(|file| file.ends_with("/victim.bin")),
        "{problem:?}"
    );

    let target = repo.dir.path().join("restored");
    let outcome = repo.restore(&snapshot, &target).await;
    assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
    assert_eq!(outcome.problems[0].path, "victim.bin");
    assert!(outcome.problems[0].message.contains("damaged"));
    assert!(
        !target.join("victim.bin").exists(),
        "a damaged file was left behind"
    );
    assert_eq!(
        std::fs::read(target.join("bystander.txt")).unwrap(),
        b"unrelated".repeat(1000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_an_index_is_reported_and_restore_still_works_from_pack_trailers() {
    let (repo, snapshot) = repo_with_two_files().await;
    let indexes = files_under(&repo.root().join("index"));
    assert_eq!(indexes.len(), 1);
    flip_byte(&indexes[0].0, 20);
    let report = verify(&repo.repository, Some(snapshot), Default::default())
        .await
        .unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|problem| problem.message.contains("does not match its name")),
        "{:?}",
        report.problems
    );
    let target = repo.dir.path().join("restored");
    let outcome = repo.restore(&snapshot, &target).await;
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert_eq!(
        std::fs::read(target.join("victim.bin")).unwrap(),
        random_bytes(1, 3 << 20)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_a_snapshot_is_reported_by_verify_and_refused_by_restore() {
    let (repo, snapshot) = repo_with_two_files().await;
    let manifests = files_under(&repo.root().join("snapshots"));
    flip_byte(&manifests[0].0, 30);
    let report = verify(&repo.repository, Some(snapshot), Default::default())
        .await
        .unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|problem| problem.object.starts_with("snapshot")),
        "{:?}",
        report.problems
    );
    let error = haulage::engine::restore::restore(
        &repo.repository,
        &snapshot,
        haulage::engine::restore::RestoreOptions::new(repo.dir.path().join("restored")),
        Default::default(),
        Default::default(),
    )
    .await
    .expect_err("must refuse");
    assert!(error.to_string().contains("damaged"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_exits_with_code_4_and_names_the_pack_blob_and_file() {
    let (repo, _) = repo_with_two_files().await;
    let packs = files_under(&repo.root().join("data"));
    flip_byte(&packs[0].0, 5000);
    let output = super::support::haulage()
        .args(["verify", "--repo", &repo.url()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(4));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("in pack") && text.contains("victim.bin"),
        "{text}"
    );
}
