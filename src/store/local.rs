//! The `file://` backend: a repository in a local (or mounted) directory.
//!
//! Writes are atomic: the bytes go to a hidden temporary file in the target
//! directory, are fsynced, and are then renamed (or hard-linked, for
//! [`PutMode::Create`]) into place, and the directory is fsynced. Packs
//! are written with `O_DIRECT` where the filesystem allows it and is not
//! a network filesystem ([`write_new_file`], `NETWORK_FILESYSTEMS`). Two
//! processes writing the same repository therefore never see each other's
//! half-written objects, and a crash leaves at most a temporary file that
//! listings ignore and [`ObjectStore::sweep_incomplete_uploads`] removes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    FailureCause, ObjectMeta, ObjectStore, PutMode, StoreError, SweepReport,
    out_of_descriptors_remedy_now, validate_key,
};

/// Prefix of temporary files; listings skip them.
const TEMP_PREFIX: &str = ".tmp-";

/// A store rooted at a local directory.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
}

impl LocalStore {
    /// A store rooted at `root`. The directory is created on the first write.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalStore { root: root.into() }
    }

    /// The directory this store writes into.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path_of(&self, operation: &'static str, key: &str) -> Result<PathBuf, StoreError> {
        if !validate_key(key) {
            return Err(StoreError::Permanent {
                location: self.location(),
                operation,
                key: key.to_string(),
                message: "invalid object key".to_string(),
                cause: FailureCause::Other,
            });
        }
        Ok(self.root.join(key))
    }

    fn classify(&self, operation: &'static str, key: &str, err: io::Error) -> StoreError {
        let location = self.location();
        let key = key.to_string();
        // Out of descriptors: other work of the process holds them, and
        // closes them; retried like a timeout.
        if out_of_descriptors(&err) {
            return StoreError::Transient {
                location,
                operation,
                key,
                message: format!("{err}: {}", out_of_descriptors_remedy_now(&err)),
                cause: FailureCause::OutOfDescriptors,
            };
        }
        let transient = matches!(
            err.kind(),
            io::ErrorKind::Interrupted | io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        );
        match err.kind() {
            io::ErrorKind::NotFound => StoreError::NotFound { location, key },
            io::ErrorKind::AlreadyExists => StoreError::AlreadyExists { location, key },
            _ if transient => StoreError::Transient {
                location,
                operation,
                key,
                message: err.to_string(),
                cause: FailureCause::Other,
            },
            _ => StoreError::Permanent {
                location,
                operation,
                key,
                message: err.to_string(),
                cause: FailureCause::Other,
            },
        }
    }
}

/// Whether `error` is the process's limit of open files (EMFILE) or the
/// system's (ENFILE): a want of descriptors, which other work frees, not a
/// fault of the file. The local store retries it; a backup's walker waits
/// for one (`engine::backup`).
pub fn out_of_descriptors(error: &io::Error) -> bool {
    [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE]
        .iter()
        .any(|errno| error.raw_os_error() == Some(errno.raw_os_error()))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(join_error) => std::panic::resume_unwind(join_error.into_panic()),
    }
}

/// Read `range` of the file at `path` into `buffer` (replacing what it
/// held, without zero-filling it first); a range past the end is an error.
fn read_range_into(path: &Path, range: Range<u64>, mut buffer: Vec<u8>) -> io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    let size = file.metadata()?.len();
    if range.start > range.end || range.end > size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "byte range {}..{} is outside the object of {size} bytes",
                range.start, range.end
            ),
        ));
    }
    file.seek(SeekFrom::Start(range.start))?;
    let length = range.end - range.start;
    buffer.clear();
    buffer.reserve_exact(length as usize);
    file.take(length).read_to_end(&mut buffer)?;
    if buffer.len() as u64 != length {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "the object ended {} bytes into the range {}..{}",
                buffer.len(),
                range.start,
                range.end
            ),
        ));
    }
    Ok(buffer)
}

fn write_atomically(final_path: &Path, data: &[u8], mode: PutMode) -> io::Result<()> {
    let dir = final_path
        .parent()
        .ok_or_else(|| io::Error::other("object path has no parent directory"))?;
    fs::create_dir_all(dir)?;
    let temp_path = dir.join(format!("{TEMP_PREFIX}{:016x}", rand::random::<u64>()));
    let result = (|| {
        write_new_file(&temp_path, data)?;
        match mode {
            PutMode::Overwrite => fs::rename(&temp_path, final_path),
            PutMode::Create => {
                // link(2) fails with EEXIST instead of replacing, which is
                // exactly the create-only semantics we need.
                fs::hard_link(&temp_path, final_path)?;
                fs::remove_file(&temp_path)
            }
        }
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp_path);
    }
    result?;
    File::open(dir)?.sync_all()
}

/// Write `data` into a new file at `path` and fsync it. An object of at
/// least [`DIRECT_WRITE_MIN_BYTES`] (a pack) goes past the page cache
/// where the filesystem allows it; see [`write_direct`].
fn write_new_file(path: &Path, data: &[u8]) -> io::Result<()> {
    if data.len() >= DIRECT_WRITE_MIN_BYTES && takes_direct_writes(path) {
        match write_direct(path, data) {
            Ok(()) => return Ok(()),
            // The filesystem (or its device's alignment) refuses direct
            // I/O: write it as any other file.
            Err(err) if err.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                let _ = fs::remove_file(path);
            }
            Err(err) => return Err(err),
        }
    }
    let mut file = OpenOptions::new().write(true).create_new(true).open(path)?;
    file.write_all(data)?;
    file.sync_all()
}

/// Objects this large are written with `O_DIRECT`: packs, which nothing
/// reads again soon. Written through the page cache, each byte is first
/// copied into it (on this project's test machine that copy alone cost a
/// sixth of a first backup's CPU, docs/benchmarks.md), and the packs of a
/// large backup would push the node's other workloads out of the cache.
const DIRECT_WRITE_MIN_BYTES: usize = 1 << 20;
/// Bytes per direct write, from one aligned buffer.
const DIRECT_BLOCK_BYTES: usize = 1 << 20;
/// The memory, offset and length alignment of a direct write: the largest
/// logical block size of common devices, a multiple of the others.
const DIRECT_ALIGN: usize = 4096;

/// Network filesystems (by `statfs` type): NFS, CephFS, SMB/CIFS (three
/// types), 9p, AFS (two), Lustre and GPFS. A direct write there is a
/// request to the server that the writer waits for (NFS adds a COMMIT to
/// stable storage), block after block, where through the page cache the
/// client sends many at once and the fsync waits for them together. Packs
/// go through the page cache on these, as every object did before direct
/// writes: none of them can be mounted on the machine the direct writes
/// were measured on (its kernel has no nfs, ceph, cifs or 9p), so this is
/// reasoned, not measured. FUSE is not among them: on fuse-overlayfs a
/// first backup took 4.28 s with direct writes and 5.15 s through the cache
/// (medians of three, docs/benchmarks.md).
const NETWORK_FILESYSTEMS: [u32; 10] = [
    0x6969,      // NFS_SUPER_MAGIC
    0x00c3_6400, // CEPH_SUPER_MAGIC
    0xfe53_4d42, // SMB2_SUPER_MAGIC
    0xff53_4d42, // CIFS_SUPER_MAGIC
    0x517b,      // SMB_SUPER_MAGIC
    0x0102_1997, // V9FS_MAGIC
    0x5346_414f, // AFS_SUPER_MAGIC
    0x6b41_4653, // AFS_FS_MAGIC
    0x0bd0_0bd0, // Lustre
    0x4750_4653, // GPFS
];

/// Whether an object written at `path` may go past the page cache: not on
/// a network filesystem, nor where the filesystem's type cannot be read.
fn takes_direct_writes(path: &Path) -> bool {
    path.parent()
        .and_then(|dir| rustix::fs::statfs(dir).ok())
        // The magic numbers are 32 bits whatever the width of `f_type`.
        .is_some_and(|stat| filesystem_takes_direct_writes(stat.f_type as u32))
}

/// Whether a filesystem of this `statfs` type gets packs past the page
/// cache (see [`NETWORK_FILESYSTEMS`]).
fn filesystem_takes_direct_writes(f_type: u32) -> bool {
    !NETWORK_FILESYSTEMS.contains(&f_type)
}

/// Write `data` into a new file at `path` with `O_DIRECT`, a block at a
/// time through one aligned buffer; the last block is padded with zeros
/// and the file then cut to `data`'s length.
fn write_direct(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)?;
    let mut buffer = vec![0u8; DIRECT_BLOCK_BYTES + DIRECT_ALIGN];
    let start = buffer.as_ptr().align_offset(DIRECT_ALIGN);
    let block = &mut buffer[start..start + DIRECT_BLOCK_BYTES];
    let mut offset = 0u64;
    for piece in data.chunks(DIRECT_BLOCK_BYTES) {
        let padded = piece.len().next_multiple_of(DIRECT_ALIGN);
        block[..piece.len()].copy_from_slice(piece);
        block[piece.len()..padded].fill(0);
        file.write_all_at(&block[..padded], offset)?;
        offset += piece.len() as u64;
    }
    file.set_len(offset)?;
    file.sync_all()
}

/// Call `on_file` with every regular file under `dir`, depth first; a
/// directory that is gone (removed meanwhile, or never made) holds none.
fn each_file(
    dir: &Path,
    on_file: &mut impl FnMut(&fs::DirEntry) -> io::Result<()>,
) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err),
    };
    for entry in entries {
        let entry = entry?;
        let file_type = entry.file_type()?;
        if file_type.is_dir() {
            each_file(&entry.path(), on_file)?;
        } else if file_type.is_file() {
            on_file(&entry)?;
        }
    }
    Ok(())
}

/// The entry's metadata; `None` when the file went meanwhile.
fn metadata_if_present(entry: &fs::DirEntry) -> io::Result<Option<fs::Metadata>> {
    match entry.metadata() {
        Ok(meta) => Ok(Some(meta)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err),
    }
}

fn list_into(root: &Path, dir: &Path, out: &mut Vec<ObjectMeta>) -> io::Result<()> {
    each_file(dir, &mut |entry| {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Ok(());
        };
        if name.starts_with(TEMP_PREFIX) {
            return Ok(());
        }
        let Some(meta) = metadata_if_present(entry)? else {
            return Ok(());
        };
        let path = entry.path();
        if let Some(key) = path.strip_prefix(root).ok().and_then(Path::to_str) {
            out.push(ObjectMeta {
                key: key.to_string(),
                size: meta.len(),
            });
        }
        Ok(())
    })
}

/// Remove the temporary files of interrupted writes under `dir` that were
/// last modified at least `older_than` ago.
fn sweep_temp_files(
    root: &Path,
    dir: &Path,
    older_than: Duration,
    now: SystemTime,
    report: &mut SweepReport,
) -> io::Result<()> {
    each_file(dir, &mut |entry| {
        if !entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            return Ok(());
        }
        report.found += 1;
        let Some(meta) = metadata_if_present(entry)? else {
            return Ok(());
        };
        // A modification time in the future counts as age zero.
        let age = now
            .duration_since(meta.modified()?)
            .unwrap_or(Duration::ZERO);
        if age < older_than {
            report.kept_recent += 1;
            return Ok(());
        }
        let path = entry.path();
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(err),
        }
        let relative = path.strip_prefix(root).unwrap_or(&path);
        report.removed.push(relative.to_string_lossy().into_owned());
        Ok(())
    })
}

#[async_trait]
impl ObjectStore for LocalStore {
    async fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<(), StoreError> {
        let path = self.path_of("put", key)?;
        let this = self.clone();
        let key = key.to_string();
        blocking(move || {
            write_atomically(&path, &data, mode).map_err(|err| this.classify("put", &key, err))
        })
        .await
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes, StoreError> {
        let path = self.path_of("get", key)?;
        let this = self.clone();
        let key = key.to_string();
        blocking(move || {
            let read = || -> io::Result<Vec<u8>> {
                match range {
                    None => {
                        let mut buffer = Vec::new();
                        File::open(&path)?.read_to_end(&mut buffer)?;
                        Ok(buffer)
                    }
                    Some(range) => read_range_into(&path, range, Vec::new()),
                }
            };
            read()
                .map(Bytes::from)
                .map_err(|err| this.classify("get", &key, err))
        })
        .await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        let path = self.path_of("get", key)?;
        let this = self.clone();
        let key = key.to_string();
        blocking(move || {
            read_range_into(&path, range, buffer).map_err(|err| this.classify("get", &key, err))
        })
        .await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        let path = self.path_of("head", key)?;
        let this = self.clone();
        let key = key.to_string();
        blocking(move || match fs::metadata(&path) {
            Ok(meta) if meta.is_file() => Ok(ObjectMeta {
                key,
                size: meta.len(),
            }),
            Ok(_) => Err(StoreError::NotFound {
                location: this.location(),
                key,
            }),
            Err(err) => Err(this.classify("head", &key, err)),
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        let this = self.clone();
        let prefix = prefix.to_string();
        blocking(move || {
            // Start from the deepest directory the prefix names, then filter.
            let dir_part = match prefix.rfind('/') {
                Some(index) => &prefix[..index],
                None => "",
            };
            let start = if dir_part.is_empty() {
                this.root.clone()
            } else {
                this.root.join(dir_part)
            };
            let mut out = Vec::new();
            list_into(&this.root, &start, &mut out)
                .map_err(|err| this.classify("list", &prefix, err))?;
            out.retain(|meta| meta.key.starts_with(&prefix));
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.path_of("delete", key)?;
        let this = self.clone();
        let key = key.to_string();
        blocking(move || match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(this.classify("delete", &key, err)),
        })
        .await
    }

    /// Remove `.tmp-*` files of writes that crashed before their rename,
    /// when last modified at least `older_than` ago.
    async fn sweep_incomplete_uploads(
        &self,
        older_than: Duration,
    ) -> Result<SweepReport, StoreError> {
        let this = self.clone();
        blocking(move || {
            let mut report = SweepReport::default();
            sweep_temp_files(
                &this.root,
                &this.root,
                older_than,
                SystemTime::now(),
                &mut report,
            )
            .map_err(|err| this.classify("sweep", "", err))?;
            Ok(report)
        })
        .await
    }

    fn location(&self) -> String {
        let absolute = std::path::absolute(&self.root).unwrap_or_else(|_| self.root.clone());
        format!("file://{}", absolute.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_is_transient_and_a_refusal_permanent() {
        let store = LocalStore::new("/nowhere");
        for errno in [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE] {
            let error = store.classify(
                "put",
                "data/ab",
                io::Error::from_raw_os_error(errno.raw_os_error()),
            );
            assert!(matches!(error, StoreError::Transient { .. }), "{errno:?}");
            assert_eq!(error.cause(), FailureCause::OutOfDescriptors);
            // Whose limit it is and what to raise depend on the limits in
            // force (`out_of_descriptors_remedy`); every remedy ends so.
            assert!(
                error.to_string().contains("move fewer volumes at once"),
                "{error}"
            );
            if errno == rustix::io::Errno::NFILE {
                assert!(error.to_string().contains("fs.file-max"), "{error}");
            }
        }
        let refused = io::Error::from(io::ErrorKind::PermissionDenied);
        assert!(matches!(
            store.classify("put", "data/ab", refused),
            StoreError::Permanent { .. }
        ));
    }

    /// The bytes of `path` in the page cache, as util-linux's `fincore`
    /// counts them.
    fn resident_bytes(path: &Path) -> u64 {
        let output = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--output", "RES"])
            .arg(path)
            .output()
            .expect("run fincore (util-linux)");
        assert!(output.status.success(), "fincore: {output:?}");
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .expect("fincore's RES")
    }

    #[tokio::test]
    async fn packs_are_written_exactly_and_past_the_page_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        // tmpfs keeps every file in the page cache however it is written.
        let in_memory = rustix::fs::statfs(dir.path()).expect("statfs").f_type == 0x0102_1994; // TMPFS_MAGIC
        let store = LocalStore::new(dir.path());
        let sizes = [
            DIRECT_WRITE_MIN_BYTES - 1,
            DIRECT_WRITE_MIN_BYTES,
            DIRECT_WRITE_MIN_BYTES + 1,
            3 * DIRECT_BLOCK_BYTES + DIRECT_ALIGN + 17,
        ];
        for (n, size) in sizes.into_iter().enumerate() {
            let data: Vec<u8> = (0..size).map(|i| (i * 31 + n) as u8).collect();
            let key = format!("data/ab/object-{n}");
            store
                .put(&key, Bytes::from(data.clone()), PutMode::Create)
                .await
                .expect("put");
            let path = dir.path().join(&key);
            if !in_memory {
                let resident = resident_bytes(&path);
                if size >= DIRECT_WRITE_MIN_BYTES {
                    assert_eq!(resident, 0, "{size} bytes written past the page cache");
                } else {
                    assert!(
                        resident > 0,
                        "a smaller object is written through the cache"
                    );
                }
            }
            let read = store.get(&key, None).await.expect("get");
            assert_eq!(read.len(), size);
            assert!(read == data, "the {size} bytes read back differ");
        }
    }

    /// ramfs refuses `O_DIRECT` at open (after creating the file). Needs
    /// root for the mount, as the integration tests do.
    #[tokio::test]
    async fn a_filesystem_without_direct_io_gets_its_packs_through_the_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mount = |args: &[&str]| {
            let status = std::process::Command::new(args[0])
                .args(&args[1..])
                .status()
                .expect("run mount");
            assert!(status.success(), "{args:?} (the test runs as root)");
        };
        let root = dir.path().to_str().expect("utf-8 path");
        mount(&["mount", "-t", "ramfs", "ramfs", root]);
        let store = LocalStore::new(dir.path());
        let data: Vec<u8> = (0..DIRECT_WRITE_MIN_BYTES + 5).map(|i| i as u8).collect();
        let put = store
            .put("data/cd/pack", Bytes::from(data.clone()), PutMode::Create)
            .await;
        let read = store.get("data/cd/pack", None).await;
        let mut names = Vec::new();
        each_file(dir.path(), &mut |entry| {
            names.push(entry.file_name());
            Ok(())
        })
        .expect("list");
        mount(&["umount", root]);
        put.expect("put on ramfs");
        assert!(read.expect("get") == data, "the bytes read back differ");
        assert_eq!(names, ["pack"], "no temporary file is left");
    }

    /// The types are those `statfs` gives (linux/magic.h); no network
    /// filesystem can be mounted here (the kernel has none), and
    /// `packs_are_written_exactly_and_past_the_page_cache` covers the
    /// local filesystem the tests write to.
    #[test]
    fn packs_on_a_network_filesystem_go_through_the_cache_and_elsewhere_past_it() {
        let network = [
            ("nfs", 0x6969),
            ("ceph", 0x00c3_6400),
            ("cifs", 0xff53_4d42),
            ("smb2", 0xfe53_4d42),
            ("9p", 0x0102_1997),
        ];
        for (name, f_type) in network {
            assert!(!filesystem_takes_direct_writes(f_type), "{name}");
        }
        let local = [
            ("ext4", 0xef53),
            ("xfs", 0x5846_5342),
            ("btrfs", 0x9123_683e),
            ("fuse", 0x6573_5546),
            ("tmpfs", 0x0102_1994),
        ];
        for (name, f_type) in local {
            assert!(filesystem_takes_direct_writes(f_type), "{name}");
        }
    }

    #[tokio::test]
    async fn sweep_removes_old_temporary_files_and_keeps_objects() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = LocalStore::new(dir.path());
        store
            .put(
                "data/ab/object",
                Bytes::from_static(b"kept"),
                PutMode::Overwrite,
            )
            .await
            .expect("put");
        let leftover = dir
            .path()
            .join("data/ab")
            .join(format!("{TEMP_PREFIX}0123456789abcdef"));
        fs::write(&leftover, b"half a pack").expect("write leftover");

        let young = store
            .sweep_incomplete_uploads(Duration::from_secs(3600))
            .await
            .expect("sweep");
        assert_eq!((young.found, young.kept_recent), (1, 1));
        assert!(young.removed.is_empty());
        assert!(leftover.exists());

        let swept = store
            .sweep_incomplete_uploads(Duration::ZERO)
            .await
            .expect("sweep");
        assert_eq!(
            swept.removed,
            [format!("data/ab/{TEMP_PREFIX}0123456789abcdef")]
        );
        assert!(!leftover.exists());
        assert_eq!(
            store
                .get("data/ab/object", None)
                .await
                .expect("object stays"),
            Bytes::from_static(b"kept")
        );
    }
}
