//! A flipped byte anywhere is found by verify and by restore, which
//! restores everything else.

use std::path::Path;

use haulage::engine::verify::verify;

use super::support::{TestRepo, assert_a_problem, files_under, random_bytes, the_only_file};

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
    let pack = repo.the_only_pack_of(haulage::repo::BlobKind::Data).await;
    // The first blob in the pack is victim.bin's first chunk (walk order).
    flip_byte(&pack, 100);

    let report = repo.verify(snapshot).await;
    let pack_name = pack.file_name().unwrap().to_string_lossy().into_owned();
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
    flip_byte(&the_only_file(&repo.root(), "index"), 20);
    assert_a_problem(&repo.verify(snapshot).await, |problem| {
        problem.message.contains("does not match its name")
    });
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
    assert_a_problem(&repo.verify(snapshot).await, |problem| {
        problem.object.starts_with("snapshot")
    });
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
    flip_byte(
        &repo.the_only_pack_of(haulage::repo::BlobKind::Data).await,
        5000,
    );
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

/// Where one counted flip lands.
#[derive(Debug, Clone, Copy)]
enum FlipTarget {
    DataBlob,
    TreeBlob,
    PackTrailer,
    Index,
    Snapshot,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_single_byte_flips_are_all_found_by_verify_and_none_reaches_a_restored_file() {
    use haulage::repo::BlobKind;
    use rand::{Rng, SeedableRng};
    let repo = TestRepo::new().await;
    let source = repo.dir.path().join("source");
    let mut originals = Vec::new();
    for (index, size) in [
        1 << 20,
        300 << 10,
        70 << 10,
        5 << 10,
        2 << 20,
        900,
        40 << 10,
        128 << 10,
    ]
    .into_iter()
    .enumerate()
    {
        let relative = format!("dir{}/file{index}.bin", index % 3);
        let path = source.join(&relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let bytes = random_bytes(100 + index as u64, size);
        std::fs::write(&path, &bytes).unwrap();
        originals.push((relative, bytes));
    }
    let snapshot = repo.backup(&source).await.snapshot_id;
    let packs = files_under(&repo.root().join("data"));
    let indexes = files_under(&repo.root().join("index"));
    let manifests = files_under(&repo.root().join("snapshots"));
    // Each pack's blobs by kind, as byte ranges, and where its trailer starts.
    let mut ranges: Vec<(std::path::PathBuf, BlobKind, std::ops::Range<u64>)> = Vec::new();
    let mut trailers = Vec::new();
    for (path, length) in &packs {
        let bytes = std::fs::read(path).unwrap();
        let entries = repo.repository.codec().decode_pack(&bytes, "pack").unwrap();
        let end = entries
            .iter()
            .map(|entry| u64::from(entry.offset) + u64::from(entry.stored_length))
            .max()
            .unwrap();
        for entry in entries {
            let start = u64::from(entry.offset);
            ranges.push((
                path.clone(),
                entry.kind,
                start..start + u64::from(entry.stored_length),
            ));
        }
        trailers.push((path.clone(), end..*length));
    }

    let mut random = rand::rngs::StdRng::seed_from_u64(50);
    let targets = [
        FlipTarget::DataBlob,
        FlipTarget::TreeBlob,
        FlipTarget::PackTrailer,
        FlipTarget::Index,
        FlipTarget::Snapshot,
    ];
    let (mut found, mut rounds) = (0, 0);
    let mut missed = Vec::new();
    for round in 0..50 {
        let target = targets[round % targets.len()];
        let (path, offset) = match target {
            FlipTarget::DataBlob | FlipTarget::TreeBlob => {
                let kind = if matches!(target, FlipTarget::TreeBlob) {
                    BlobKind::Tree
                } else {
                    BlobKind::Data
                };
                let of_kind: Vec<_> = ranges.iter().filter(|range| range.1 == kind).collect();
                let (path, _, range) = of_kind[random.random_range(0..of_kind.len())];
                (path.clone(), random.random_range(range.clone()))
            }
            FlipTarget::PackTrailer => {
                let (path, range) = &trailers[random.random_range(0..trailers.len())];
                (path.clone(), random.random_range(range.clone()))
            }
            FlipTarget::Index => {
                let (path, length) = &indexes[random.random_range(0..indexes.len())];
                (path.clone(), random.random_range(0..*length))
            }
            FlipTarget::Snapshot => {
                let (path, length) = &manifests[random.random_range(0..manifests.len())];
                (path.clone(), random.random_range(0..*length))
            }
        };
        let object = path.file_name().unwrap().to_string_lossy().into_owned();
        flip_byte(&path, offset);
        // Another process's view: nothing cached from before the flip.
        let repository = repo.reopen().await;
        let report = verify(&repository, Some(snapshot), Default::default())
            .await
            .unwrap();
        let named = report
            .problems
            .iter()
            .any(|problem| problem.object.contains(&object) || problem.message.contains(&object));
        if named {
            found += 1;
        } else {
            missed.push(format!(
                "round {round}: a flip at byte {offset} of {target:?} {object} was not named by verify: {:?}",
                report.problems
            ));
        }
        if matches!(target, FlipTarget::DataBlob | FlipTarget::TreeBlob) {
            assert!(
                report
                    .problems
                    .iter()
                    .any(|problem| !problem.affected_files.is_empty()),
                "round {round}: {target:?} damage names no affected file: {:?}",
                report.problems
            );
        }
        // No restored file differs from its source: damaged ones are left
        // out and reported (or the whole restore is refused).
        let restored = repo.dir.path().join(format!("restored-{round}"));
        let outcome = haulage::engine::restore::restore(
            &repository,
            &snapshot,
            haulage::engine::restore::RestoreOptions::new(&restored),
            Default::default(),
            Default::default(),
        )
        .await;
        for (relative, bytes) in &originals {
            if let Ok(content) = std::fs::read(restored.join(relative)) {
                assert!(
                    content == *bytes,
                    "round {round}: {relative} was restored with damaged content after a flip in {target:?} {object}"
                );
            } else if let Ok(outcome) = &outcome {
                assert!(
                    outcome
                        .problems
                        .iter()
                        .any(|problem| relative.ends_with(&problem.path)
                            || problem
                                .path
                                .starts_with(relative.split('/').next().unwrap())),
                    "round {round}: {relative} is missing and not reported: {:?}",
                    outcome.problems
                );
            }
        }
        let _ = std::fs::remove_dir_all(&restored);
        // Put the byte back for the next round.
        flip_byte(&path, offset);
        rounds += 1;
    }
    println!(
        "corruption counted: {found} of {rounds} single-byte flips found by verify, none reached a restored file"
    );
    assert!(
        found == rounds && rounds == 50,
        "{found} of {rounds} flips found:\n{}",
        missed.join("\n")
    );
}
