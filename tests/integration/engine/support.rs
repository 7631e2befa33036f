//! Helpers: repositories in temp dirs, running the engine, fingerprinting
//! trees so two trees can be compared entry by entry.

use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use haulage::engine::backup::{BackupOptions, BackupOutcome, ParentPolicy, backup};
use haulage::engine::progress::Progress;
use haulage::engine::restore::{RestoreOptions, RestoreOutcome, restore};
use haulage::engine::verify::{VerifyProblem, VerifyReport, verify};
use haulage::engine::{Encryption, KeySource, Password, Repository};
use haulage::repo::ObjectId;
use haulage::repo::keyfile::KdfParameters;
use haulage::store::DynStore;
use haulage::store::layer::{Layer, Layered, Request};
use haulage::store::local::LocalStore;
use tokio_util::sync::CancellationToken;

/// A fresh repository in its own temp dir.
pub struct TestRepo {
    pub dir: tempfile::TempDir,
    pub repository: Repository,
}

/// The password of every encrypted test repository; [`haulage`] passes it
/// to the binary in `HAULAGE_PASSWORD`.
pub const TEST_PASSWORD: &str = "test password";

impl TestRepo {
    /// An encrypted repository (the default format), with the cheapest KDF.
    pub async fn new() -> Self {
        Self::with_encryption(Encryption::Password {
            password: Password::new(TEST_PASSWORD),
            kdf: KdfParameters::insecure_for_tests(),
        })
        .await
    }

    /// A plaintext (format 1) repository.
    pub async fn plaintext() -> Self {
        Self::with_encryption(Encryption::None).await
    }

    pub async fn with_encryption(encryption: Encryption) -> Self {
        // As the binaries do at their start: the engines of this process
        // (every test's) share its limit of open files, and under a soft
        // limit of 1,024 ten restores of one test would leave another's
        // batches a tenth of their directories (and its reads of packs
        // split between more batches than the scatter tests count).
        haulage::engine::descriptors::raise_open_file_limit();
        let dir = tempfile::tempdir().expect("temp dir");
        let store: DynStore = Arc::new(LocalStore::new(dir.path().join("repo")));
        let repository = Repository::init(store, encryption).await.expect("init");
        TestRepo { dir, repository }
    }

    /// The repository opened again from its store, as another process would.
    pub async fn reopen(&self) -> Repository {
        Repository::open(
            self.repository.store().clone(),
            &KeySource::password(TEST_PASSWORD),
        )
        .await
        .expect("reopen")
    }

    pub fn root(&self) -> PathBuf {
        self.dir.path().join("repo")
    }

    /// `verify` of `snapshot`, which must run to its report.
    pub async fn verify(&self, snapshot: ObjectId) -> VerifyReport {
        verify(&self.repository, Some(snapshot), Default::default())
            .await
            .expect("verify")
    }

    /// Loading `snapshot`'s manifest is refused, naming the snapshot.
    pub async fn assert_snapshot_refused(&self, snapshot: &ObjectId) {
        let error = self
            .repository
            .load_snapshot(snapshot)
            .await
            .expect_err("refused");
        assert!(error.to_string().contains(&snapshot.to_hex()), "{error}");
    }

    pub fn url(&self) -> String {
        format!("file://{}", self.root().display())
    }

    /// `haulage verify` of the whole repository succeeds.
    pub fn assert_cli_verifies(&self) {
        let verify = haulage()
            .args(["verify", "--repo", &self.url()])
            .output()
            .expect("run haulage verify");
        crate::support::expect_success(&verify, "haulage verify");
    }

    pub async fn backup(&self, source: &Path) -> BackupOutcome {
        self.backup_with(source, ParentPolicy::LatestForSource)
            .await
    }

    pub async fn backup_with(&self, source: &Path, parent: ParentPolicy) -> BackupOutcome {
        let mut options = BackupOptions::new(source);
        options.parent = parent;
        self.backup_with_options(options).await
    }

    pub async fn backup_with_options(&self, options: BackupOptions) -> BackupOutcome {
        backup(
            &self.repository,
            options,
            Arc::new(Progress::default()),
            CancellationToken::new(),
        )
        .await
        .expect("backup")
    }

    pub async fn restore(&self, snapshot: &ObjectId, target: &Path) -> RestoreOutcome {
        self.restore_with(snapshot, RestoreOptions::new(target))
            .await
    }

    pub async fn restore_with(
        &self,
        snapshot: &ObjectId,
        options: RestoreOptions,
    ) -> RestoreOutcome {
        restore(
            &self.repository,
            snapshot,
            options,
            Arc::new(Progress::default()),
            CancellationToken::new(),
        )
        .await
        .expect("restore")
    }

    /// Total bytes of all packs.
    pub fn pack_bytes(&self) -> u64 {
        files_under(&self.root().join("data"))
            .iter()
            .map(|(_, size)| size)
            .sum()
    }

    pub fn pack_count(&self) -> usize {
        files_under(&self.root().join("data")).len()
    }

    /// The one pack holding blobs of `kind` (a small backup writes one
    /// pack of data blobs and one of tree blobs), by its trailer.
    pub async fn the_only_pack_of(&self, kind: haulage::repo::BlobKind) -> PathBuf {
        let mut found = Vec::new();
        for (path, size) in files_under(&self.root().join("data")) {
            let name = path.file_name().expect("pack name").to_string_lossy();
            let id: ObjectId = name.parse().expect("pack id");
            let entries = self
                .repository
                .read_pack_trailer(&id, size)
                .await
                .expect("pack trailer");
            if entries.iter().all(|entry| entry.kind == kind) {
                found.push(path);
            }
        }
        assert_eq!(found.len(), 1, "packs of {kind:?}: {found:?}");
        found.remove(0)
    }
}

/// Regular files under a directory with their sizes.
pub fn files_under(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let meta = entry.metadata().expect("metadata");
            if meta.is_dir() {
                stack.push(entry.path());
            } else if !entry.file_name().as_bytes().starts_with(b".tmp-") {
                out.push((entry.path(), meta.len()));
            }
        }
    }
    out.sort();
    out
}

/// What is compared between a source and a restored tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: (i64, i64),
    pub size: u64,
    pub content: Option<blake3::Hash>,
    pub link_target: Option<Vec<u8>>,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// For multiply-linked files: the first path (in sorted order) sharing the inode.
    pub hardlink_group: Option<Vec<u8>>,
}

/// Every entry under `root` (not the root itself), by relative path bytes.
pub fn fingerprint(root: &Path) -> BTreeMap<Vec<u8>, Fingerprint> {
    let mut out = BTreeMap::new();
    let mut first_of_inode: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut paths = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(relative) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&relative)).expect("read dir") {
            let entry = entry.expect("entry");
            let path = relative.join(entry.file_name());
            if entry.file_type().expect("type").is_dir() {
                stack.push(path.clone());
            }
            paths.push(path);
        }
    }
    paths.sort_by(|a, b| a.as_os_str().as_bytes().cmp(b.as_os_str().as_bytes()));
    for path in paths {
        let full = root.join(&path);
        let meta = std::fs::symlink_metadata(&full).expect("lstat");
        let file_type = meta.file_type();
        use std::os::unix::fs::FileTypeExt;
        let kind = if file_type.is_dir() {
            "dir"
        } else if file_type.is_symlink() {
            "symlink"
        } else if file_type.is_fifo() {
            "fifo"
        } else if file_type.is_file() {
            "file"
        } else {
            "other"
        };
        let key = path.as_os_str().as_bytes().to_vec();
        let hardlink_group = (kind == "file" && meta.nlink() > 1).then(|| {
            first_of_inode
                .entry(meta.ino())
                .or_insert_with(|| key.clone())
                .clone()
        });
        let mut xattrs = BTreeMap::new();
        if (kind == "file" || kind == "dir")
            && let Ok(names) = xattr_names(&full)
        {
            for name in names.into_iter().filter(|name| name.starts_with(b"user.")) {
                let mut value = vec![0u8; 65536];
                let length =
                    rustix::fs::lgetxattr(&full, name.as_slice(), &mut value).expect("getxattr");
                value.truncate(length);
                xattrs.insert(name, value);
            }
        }
        out.insert(
            key,
            Fingerprint {
                kind,
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
                mtime: if kind == "symlink" || kind == "dir" || kind == "file" || kind == "fifo" {
                    (meta.mtime(), meta.mtime_nsec())
                } else {
                    (0, 0)
                },
                size: if kind == "dir" { 0 } else { meta.len() },
                content: (kind == "file")
                    .then(|| blake3::hash(&std::fs::read(&full).expect("read"))),
                link_target: (kind == "symlink").then(|| {
                    std::fs::read_link(&full)
                        .expect("readlink")
                        .as_os_str()
                        .as_bytes()
                        .to_vec()
                }),
                xattrs,
                hardlink_group,
            },
        );
    }
    out
}

fn xattr_names(path: &Path) -> rustix::io::Result<Vec<Vec<u8>>> {
    let mut buffer = vec![0u8; 65536];
    let length = rustix::fs::llistxattr(path, &mut buffer)?;
    Ok(buffer[..length]
        .split(|byte| *byte == 0)
        .filter(|name| !name.is_empty())
        .map(<[u8]>::to_vec)
        .collect())
}

/// Assert two trees are identical entry by entry, naming the first difference.
pub fn assert_same_tree(source: &Path, restored: &Path) {
    let left = fingerprint(source);
    let right = fingerprint(restored);
    for (path, expected) in &left {
        let shown = String::from_utf8_lossy(path);
        let actual = right
            .get(path)
            .unwrap_or_else(|| panic!("{shown} missing from the restore"));
        assert_eq!(actual, expected, "{shown} differs");
    }
    for path in right.keys() {
        assert!(
            left.contains_key(path),
            "{} appeared in the restore",
            String::from_utf8_lossy(path)
        );
    }
}

/// Restore the snapshot `snapshot_id` (full or short) of `repository` with
/// the haulage library into `target`, and assert it is `source` entry by
/// entry.
pub async fn assert_snapshot_restores_as(
    repository: &Repository,
    snapshot_id: &str,
    source: &Path,
    target: &Path,
) -> anyhow::Result<()> {
    let snapshot = repository.resolve_snapshot(snapshot_id).await?;
    restore(
        repository,
        &snapshot,
        RestoreOptions::new(target),
        Arc::new(Progress::default()),
        CancellationToken::new(),
    )
    .await?;
    assert_same_tree(source, target);
    Ok(())
}

/// The `haulage` binary built for these tests.
/// The one file under `root/prefix` (a repository's `data`, `index`, …).
pub fn the_only_file(root: &Path, prefix: &str) -> PathBuf {
    let files = files_under(&root.join(prefix));
    assert_eq!(files.len(), 1, "{prefix}: {files:?}");
    files[0].0.clone()
}

/// `report` has a problem that is `expected`.
pub fn assert_a_problem(report: &VerifyReport, expected: impl Fn(&VerifyProblem) -> bool) {
    assert!(
        report.problems.iter().any(expected),
        "{:?}",
        report.problems
    );
}

/// A sparse file of `length` bytes at `path` whose only data is `data` at
/// `offset`.
pub fn write_sparse_file(
    path: &Path,
    length: u64,
    data: &[u8],
    offset: u64,
) -> std::io::Result<()> {
    let file = std::fs::File::create(path)?;
    file.set_len(length)?;
    std::os::unix::fs::FileExt::write_all_at(&file, data, offset)
}

/// A named pipe at `path` with the permission bits `mode`.
pub fn make_fifo(path: &Path, mode: u32) -> rustix::io::Result<()> {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(mode),
        0,
    )
}

/// Set the extended attribute `name` of `path` to `value`.
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) -> rustix::io::Result<()> {
    rustix::fs::setxattr(path, name, value, rustix::fs::XattrFlags::empty())
}

pub fn haulage() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_haulage"));
    command.env_remove("HAULAGE_REPO");
    command.env_remove("HAULAGE_PASSWORD_FILE");
    command.env("HAULAGE_PASSWORD", TEST_PASSWORD);
    command
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(seed: u64, length: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut data = vec![0u8; length];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    data
}

/// One read a [`CountingStore`] passed on: the key and the bytes asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub key: String,
    pub range: Option<std::ops::Range<u64>>,
}

/// The real store of a repository, recording every read it passes on (by
/// `get` or `get_range_into`), so tests can count what a restore fetched.
pub type CountingStore = Layered<ReadLog>;

/// `inner` behind a [`ReadLog`].
pub fn counting_store(inner: DynStore) -> Arc<CountingStore> {
    Arc::new(Layered::wrap(inner, ReadLog::default()))
}

/// The reads of a [`CountingStore`].
#[derive(Debug, Default)]
pub struct ReadLog {
    reads: std::sync::Mutex<Vec<Read>>,
}

impl ReadLog {
    /// The reads so far, and forget them.
    pub fn take_reads(&self) -> Vec<Read> {
        std::mem::take(&mut *self.reads.lock().expect("reads"))
    }
}

#[async_trait::async_trait]
impl Layer for ReadLog {
    type Held = ();

    async fn before(&self, request: Request<'_>) {
        if let Request::Get { key, range } = request {
            self.reads.lock().expect("reads").push(Read {
                key: key.to_string(),
                range,
            });
        }
    }
}

/// How a restore read the packs' data: for each pack, the reads made for
/// data blobs and their bytes. A read is for data when it starts at a data
/// blob (the restore's pack reads start and end at the blobs it needs);
/// tree loads start at a tree blob and are left out, even when they read
/// through data to reach the next tree. `packs` lists every pack's entries
/// (its trailer).
pub fn data_reads_per_pack(
    reads: &[Read],
    packs: &BTreeMap<ObjectId, Vec<haulage::repo::pack::PackEntry>>,
) -> BTreeMap<ObjectId, (usize, u64)> {
    let mut per_pack = BTreeMap::new();
    for read in reads {
        let Some(pack) = haulage::repo::id_from_key(&read.key, haulage::repo::DATA_PREFIX) else {
            continue;
        };
        let range = read.range.clone().unwrap_or(0..u64::MAX);
        let starts_at_data = packs[&pack].iter().any(|entry| {
            entry.kind == haulage::repo::BlobKind::Data && u64::from(entry.offset) == range.start
        });
        if starts_at_data {
            let counted: &mut (usize, u64) = per_pack.entry(pack).or_default();
            counted.0 += 1;
            counted.1 += range.end - range.start;
        }
    }
    per_pack
}

/// Reads that started at a tree blob, or at the start of a pack of trees
/// only (read whole): the restore's tree loads.
pub fn tree_reads(
    reads: &[Read],
    packs: &BTreeMap<ObjectId, Vec<haulage::repo::pack::PackEntry>>,
) -> usize {
    reads
        .iter()
        .filter(|read| {
            let Some(pack) = haulage::repo::id_from_key(&read.key, haulage::repo::DATA_PREFIX)
            else {
                return false;
            };
            let start = read.range.as_ref().map_or(0, |range| range.start);
            let entries = &packs[&pack];
            (trees_only(entries) && start == 0)
                || entries.iter().any(|entry| {
                    entry.kind == haulage::repo::BlobKind::Tree && u64::from(entry.offset) == start
                })
        })
        .count()
}

/// How many of `packs` hold data blobs (the others hold trees only).
pub fn packs_with_data(packs: &BTreeMap<ObjectId, Vec<haulage::repo::pack::PackEntry>>) -> usize {
    packs
        .values()
        .filter(|entries| !trees_only(entries))
        .count()
}

/// Whether a pack of these entries holds trees only.
pub fn trees_only(entries: &[haulage::repo::pack::PackEntry]) -> bool {
    entries
        .iter()
        .all(|entry| entry.kind == haulage::repo::BlobKind::Tree)
}

/// Every pack of `repository` with its entries, read from the trailers.
pub async fn pack_entries(
    repository: &Repository,
) -> BTreeMap<ObjectId, Vec<haulage::repo::pack::PackEntry>> {
    let mut packs = BTreeMap::new();
    for meta in repository
        .store()
        .list(haulage::repo::DATA_PREFIX)
        .await
        .expect("list packs")
    {
        let id =
            haulage::repo::id_from_key(&meta.key, haulage::repo::DATA_PREFIX).expect("pack key");
        let entries = repository
            .read_pack_trailer(&id, meta.size)
            .await
            .expect("pack trailer");
        packs.insert(id, entries);
    }
    packs
}
