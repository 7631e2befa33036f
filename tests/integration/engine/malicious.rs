//! Hand-crafted snapshots that try to write outside the target are refused
//! and nothing is written outside.

use std::os::unix::ffi::OsStrExt;

use bytes::Bytes;
use haulage::engine::Repository;
use haulage::repo::pack::PackWriter;
use haulage::repo::snapshot::{RootAttributes, Snapshot, SnapshotSummary};
use haulage::repo::tree::{Entry, EntryKind, Extent, Tree};
use haulage::repo::{BlobId, BlobKind, Compression, ObjectId, pack_key};
use haulage::store::PutMode;
use serde_bytes::ByteBuf;

use super::support::TestRepo;

/// Stores blobs in one pack with an index, as a hostile writer holding the
/// repository's key could.
struct Forger {
    pack: PackWriter,
}

impl Forger {
    fn new(repository: &Repository) -> Self {
        Forger {
            pack: repository.pack_writer(1 << 20),
        }
    }

    fn blob(&mut self, repository: &Repository, kind: BlobKind, bytes: &[u8]) -> BlobId {
        let id = repository.keys().blob_id(bytes);
        let mut body = bytes.to_vec();
        let prefix = repository
            .codec()
            .seal_blob_in_place(&mut rand::rng(), kind, &id, &mut body);
        self.pack.add_parts(
            id,
            kind,
            Compression::None,
            &[prefix.as_bytes(), &body],
            bytes.len() as u32,
        );
        id
    }

    async fn finish(self, repository: &Repository, root: BlobId) -> ObjectId {
        let pack = repository.codec().finish_pack(self.pack, &mut rand::rng());
        repository
            .store()
            .put(
                &pack_key(&pack.id),
                Bytes::from(pack.bytes),
                PutMode::Overwrite,
            )
            .await
            .unwrap();
        repository
            .write_index(vec![(pack.id, pack.entries)])
            .await
            .unwrap();
        repository
            .write_snapshot(&Snapshot {
                format_version: 1,
                time: "2026-11-29T00:00:00Z".into(),
                hostname: "attacker".into(),
                source: "/".into(),
                tree: root,
                root: RootAttributes {
                    mode: 0o755,
                    ..Default::default()
                },
                parent: None,
                tags: Default::default(),
                claim: None,
                summary: SnapshotSummary::default(),
            })
            .await
            .unwrap()
    }
}

fn entry(name: &[u8], kind: EntryKind) -> Entry {
    Entry {
        mode: 0o644,
        ..Entry::new(name, kind)
    }
}

fn file(name: &[u8], content: BlobId, length: u32) -> Entry {
    let mut file = entry(name, EntryKind::File);
    file.content = vec![Extent::Chunk(content, length)];
    file.size = u64::from(length);
    file
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_escape_and_symlink_then_write_sequences_are_refused() {
    let repo = TestRepo::new().await;
    let repository = &repo.repository;
    let base = repo.dir.path();
    let outside = base.join("outside");
    std::fs::create_dir(&outside).unwrap();
    let mut forger = Forger::new(repository);
    let payload = forger.blob(repository, BlobKind::Data, b"pwned");

    // A directory named like the symlink, holding a file: if the symlink
    // were followed, "pwned" would land in `outside`.
    let inner = forger.blob(
        repository,
        BlobKind::Tree,
        &Tree {
            entries: vec![file(b"pwned", payload, 5)],
        }
        .encode(),
    );
    let mut evil_link = entry(b"evil", EntryKind::Symlink);
    evil_link.link_target = Some(ByteBuf::from(outside.as_os_str().as_bytes().to_vec()));
    let mut evil_dir = entry(b"evil", EntryKind::Directory);
    evil_dir.subtree = Some(inner);
    let mut dotdot_dir = entry(b"..", EntryKind::Directory);
    dotdot_dir.subtree = Some(inner);
    let root = Tree {
        entries: vec![
            file(b"", payload, 5),
            file(b".", payload, 5),
            file(b"..", payload, 5),
            dotdot_dir,
            file(b"../outside/pwned", payload, 5),
            file(outside.join("abs").as_os_str().as_bytes(), payload, 5),
            file(b"nul\0byte", payload, 5),
            evil_link,
            evil_dir,
            file(b"fine", payload, 5),
        ],
    };
    let root_id = forger.blob(repository, BlobKind::Tree, &root.encode());
    let snapshot = forger.finish(repository, root_id).await;

    let target = base.join("target");
    let outcome = repo.restore(&snapshot, &target).await;
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "something was written outside the target"
    );
    assert!(!base.join("pwned").exists());
    // The seven bad names and the duplicate "evil" are refused, each named.
    let refused: Vec<_> = outcome
        .problems
        .iter()
        .filter(|p| p.message.starts_with("refused"))
        .collect();
    assert_eq!(refused.len(), 8, "{:?}", outcome.problems);
    assert_eq!(std::fs::read(target.join("fine")).unwrap(), b"pwned");
    // The first "evil" won and is a symlink, created by the restore itself.
    assert!(
        std::fs::symlink_metadata(target.join("evil"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_already_in_the_target_is_not_followed_by_a_sync_restore() {
    let repo = TestRepo::new().await;
    let base = repo.dir.path();
    let source = base.join("source");
    std::fs::create_dir_all(source.join("data")).unwrap();
    std::fs::write(source.join("data/file"), b"real content").unwrap();
    let outcome = repo.backup(&source).await;

    let outside = base.join("outside");
    std::fs::create_dir(&outside).unwrap();
    let target = base.join("target");
    std::fs::create_dir(&target).unwrap();
    // Someone replaced the directory with a symlink pointing outside.
    std::os::unix::fs::symlink(&outside, target.join("data")).unwrap();
    let mut options = haulage::engine::restore::RestoreOptions::new(&target);
    options.sync = true;
    let restored = repo.restore_with(&outcome.snapshot_id, options).await;
    assert!(restored.problems.is_empty(), "{:?}", restored.problems);
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "wrote through the symlink"
    );
    assert!(
        std::fs::symlink_metadata(target.join("data"))
            .unwrap()
            .is_dir()
    );
    assert_eq!(
        std::fs::read(target.join("data/file")).unwrap(),
        b"real content"
    );
}

/// Bytes held by the files under `dir` (blocks, not lengths: holes cost none).
fn allocated_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        total += meta.blocks() * 512;
        if meta.is_dir() {
            total += allocated_bytes(&entry.path());
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_and_holes_that_lie_or_overflow_write_nothing_and_are_reported() {
    let repo = TestRepo::new().await;
    let repository = &repo.repository;
    let base = repo.dir.path();
    let mut forger = Forger::new(repository);
    let payload = forger.blob(repository, BlobKind::Data, b"pwned");
    // Holes that overflow a u64 offset when added up.
    let mut overflowing = entry(b"overflowing-holes", EntryKind::File);
    overflowing.content = vec![
        Extent::Hole(u64::MAX),
        Extent::Hole(u64::MAX),
        Extent::Chunk(payload, 5),
    ];
    overflowing.size = 5;
    // A size far beyond its content.
    let mut lying = file(b"size-beyond-content", payload, 5);
    lying.size = 1 << 50;
    // A hole of a petabyte.
    let mut huge_hole = entry(b"petabyte-hole", EntryKind::File);
    huge_hole.content = vec![Extent::Hole(1 << 50)];
    huge_hole.size = 1 << 50;
    let mut entries = vec![overflowing, lying, huge_hole, file(b"fine", payload, 5)];
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let root = forger.blob(repository, BlobKind::Tree, &Tree { entries }.encode());
    let snapshot = forger.finish(repository, root).await;

    let target = base.join("target");
    let outcome = repo.restore(&snapshot, &target).await;
    assert_eq!(std::fs::read(target.join("fine")).unwrap(), b"pwned");
    // Nothing of any size was allocated for the hostile files.
    assert!(
        allocated_bytes(&target) < 1 << 20,
        "the restore allocated {} bytes",
        allocated_bytes(&target)
    );
    for name in ["overflowing-holes", "size-beyond-content"] {
        assert!(
            outcome.problems.iter().any(|problem| problem.path == name),
            "{name} is not reported: {:?}",
            outcome.problems
        );
        assert!(
            !target.join(name).exists(),
            "{name} was restored although its content does not add up to its size"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_nodes_are_not_made_unless_asked_and_a_hardlink_never_reaches_outside() {
    let repo = TestRepo::new().await;
    let repository = &repo.repository;
    let base = repo.dir.path();
    let outside = base.join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"secret").unwrap();
    let mut forger = Forger::new(repository);
    let payload = forger.blob(repository, BlobKind::Data, b"pwned");
    // The disk itself, as a block and a character device.
    let mut block = entry(b"sda", EntryKind::BlockDevice);
    block.rdev = 8 << 8;
    let mut character = entry(b"mem", EntryKind::CharDevice);
    character.rdev = (1 << 8) | 1;
    // Two names of one inode: the first escapes (refused), so the second
    // must not become a link to anything it names.
    let mut escaping = file(b"../outside/secret", payload, 5);
    escaping.inode = 42;
    escaping.links = 2;
    let mut inside = file(b"linked", payload, 5);
    inside.inode = 42;
    inside.links = 2;
    let root = forger.blob(
        repository,
        BlobKind::Tree,
        &Tree {
            entries: vec![escaping, inside, character, block],
        }
        .encode(),
    );
    let snapshot = forger.finish(repository, root).await;

    let target = base.join("target");
    let outcome = repo.restore(&snapshot, &target).await;
    assert!(!target.join("sda").exists() && !target.join("mem").exists());
    for name in ["sda", "mem"] {
        assert!(
            outcome
                .problems
                .iter()
                .any(|problem| problem.path == name
                    && problem.message.contains("pass --allow-devices")),
            "{name} is not reported as refused: {:?}",
            outcome.problems
        );
    }
    use std::os::unix::fs::MetadataExt;
    // Asked for, they are made as recorded (a user without CAP_MKNOD gets
    // the kernel's refusal, reported).
    let mut asked = haulage::engine::restore::RestoreOptions::new(base.join("asked"));
    asked.allow_devices = true;
    let with_devices = repo.restore_with(&snapshot, asked).await;
    for (name, rdev, is_block) in [("sda", 8 << 8, true), ("mem", (1 << 8) | 1, false)] {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(base.join("asked").join(name)) {
            Ok(made) => {
                assert_eq!(made.rdev(), rdev, "{name}");
                assert_eq!(made.file_type().is_block_device(), is_block, "{name}");
                assert_eq!(made.file_type().is_char_device(), !is_block, "{name}");
            }
            Err(_) => assert!(
                with_devices
                    .problems
                    .iter()
                    .any(|problem| problem.path == name
                        && !problem.message.contains("pass --allow-devices")),
                "{name} was neither made nor reported: {:?}",
                with_devices.problems
            ),
        }
    }
    assert_eq!(std::fs::read(outside.join("secret")).unwrap(), b"secret");
    assert_eq!(
        std::fs::metadata(outside.join("secret")).unwrap().nlink(),
        1
    );
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    assert_eq!(std::fs::read(target.join("linked")).unwrap(), b"pwned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_nested_thousands_deep_is_restored_down_to_the_limit_and_refused_below_it() {
    let repo = TestRepo::new().await;
    let repository = &repo.repository;
    let base = repo.dir.path();
    let mut forger = Forger::new(repository);
    let payload = forger.blob(repository, BlobKind::Data, b"bottom");
    let mut tree = forger.blob(
        repository,
        BlobKind::Tree,
        &Tree {
            entries: vec![file(b"file", payload, 6)],
        }
        .encode(),
    );
    const DEPTH: usize = 3_000;
    for _ in 0..DEPTH {
        let mut directory = entry(b"d", EntryKind::Directory);
        directory.mode = 0o755;
        directory.subtree = Some(tree);
        tree = forger.blob(
            repository,
            BlobKind::Tree,
            &Tree {
                entries: vec![directory],
            }
            .encode(),
        );
    }
    let snapshot = forger.finish(repository, tree).await;
    let target = base.join("target");
    let outcome = repo.restore(&snapshot, &target).await;
    // Everything stays inside the target, however deep it went.
    let entries_in_base: Vec<_> = std::fs::read_dir(base)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert!(
        entries_in_base
            .iter()
            .all(|name| name == "target" || name == "repo"),
        "{entries_in_base:?}"
    );
    // Down to the limit, and the first directory below it refused, named.
    let limit = haulage::engine::restore::MAX_DIRECTORY_DEPTH;
    assert_eq!(outcome.directories, limit as u64);
    assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
    let problem = &outcome.problems[0];
    assert_eq!(problem.path, vec!["d"; limit + 1].join("/"));
    assert!(
        problem.message.contains("nested deeper than 1024"),
        "{problem:?}"
    );
}
