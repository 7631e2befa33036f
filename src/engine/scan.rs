//! The lstat-only walk of a directory tree: every regular file under a
//! root with its size, symlinks not followed, unreadable directories
//! skipped. The backup's progress totals and `haulage bench`'s view of a
//! source are both this walk; a restore and a verification list a
//! directory they hold open with [`list_directory`] and reach one with
//! [`open_directory_at`].

use std::fs;
use std::io;
use std::path::Path;

use tokio_util::sync::CancellationToken;

/// Call `on_file` with the path and size of every regular file under
/// `root`, until `cancel` (when given) is cancelled. Only an unreadable
/// `root` is an error; a directory below it that cannot be read is
/// skipped (the backup reports it as a warning when it gets there).
pub fn scan_regular_files(
    root: &Path,
    cancel: Option<&CancellationToken>,
    mut on_file: impl FnMut(&Path, u64),
) -> io::Result<()> {
    // Directories still to list, by path: one is open at a time (a stack
    // of open listings held a descriptor for every subdirectory of a wide
    // directory at once, and took the backup's own opens past the
    // process's limit).
    let mut listing = Some(fs::read_dir(root)?);
    let mut directories = Vec::new();
    while let Some(entries) = listing.take() {
        for entry in entries.flatten() {
            if cancel.is_some_and(CancellationToken::is_cancelled) {
                return Ok(());
            }
            let Ok(file_type) = entry.file_type() else {
                continue;
            };
            if file_type.is_dir() {
                directories.push(entry.path());
            } else if file_type.is_file()
                && let Ok(metadata) = entry.metadata()
            {
                on_file(&entry.path(), metadata.len());
            }
        }
        // The next directory that can be listed.
        listing = std::iter::from_fn(|| directories.pop()).find_map(|path| fs::read_dir(path).ok());
    }
    Ok(())
}

/// The names in the open directory `fd`, without `.` and `..`: what a
/// restore and a verification compare with the snapshot's tree.
pub(crate) fn list_directory(fd: &std::os::fd::OwnedFd) -> Result<Vec<Vec<u8>>, rustix::io::Errno> {
    use rustix::fs::{Mode, OFlags};
    let dup = rustix::fs::openat(
        fd,
        ".",
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut dir = rustix::fs::Dir::read_from(&dup)?;
    let mut names = Vec::new();
    while let Some(entry) = dir.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    Ok(names)
}

/// Open the directory at `components` below the open directory `root`,
/// following no symlink on the way: what a restore and a verification
/// reach a directory of the target with.
pub(crate) fn open_directory_at(
    root: &std::os::fd::OwnedFd,
    components: &[impl AsRef<[u8]>],
) -> Result<std::os::fd::OwnedFd, rustix::io::Errno> {
    use rustix::fs::{Mode, OFlags};
    let mut current = rustix::fs::openat(
        root,
        ".",
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for part in components {
        current = rustix::fs::openat(
            &current,
            part.as_ref(),
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
    }
    Ok(current)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Descriptors this process holds open on `root` or below it.
    fn descriptors_under(root: &Path) -> usize {
        fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .flatten()
            .filter(|fd| fs::read_link(fd.path()).is_ok_and(|target| target.starts_with(root)))
            .count()
    }

    #[test]
    fn a_wide_directory_is_scanned_one_listing_at_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        for i in 0..300 {
            let below = root.join(format!("d{i:03}"));
            fs::create_dir(&below).expect("dir");
            fs::write(below.join("file"), b"x").expect("file");
        }
        let (mut files, mut most_open) = (0, 0);
        scan_regular_files(root, None, |_, _| {
            files += 1;
            most_open = most_open.max(descriptors_under(root));
        })
        .expect("readable");
        assert_eq!(files, 300);
        assert!(most_open <= 2, "{most_open} descriptors open at once");
    }

    #[test]
    fn every_regular_file_is_seen_once_and_symlinks_are_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        fs::create_dir_all(root.join("a/b")).expect("dirs");
        fs::write(root.join("top"), b"12345").expect("file");
        fs::write(root.join("a/b/deep"), b"123").expect("file");
        std::os::unix::fs::symlink(root.join("a"), root.join("loop")).expect("symlink");
        let mut seen = Vec::new();
        scan_regular_files(root, None, |path, size| {
            seen.push((path.strip_prefix(root).expect("below").to_path_buf(), size));
        })
        .expect("readable");
        seen.sort();
        assert_eq!(
            seen,
            [
                (Path::new("a/b/deep").to_path_buf(), 3),
                (Path::new("top").to_path_buf(), 5)
            ]
        );
        assert!(scan_regular_files(&root.join("missing"), None, |_, _| {}).is_err());
    }

    #[test]
    fn a_cancelled_scan_stops() {
        let dir = tempfile::tempdir().expect("tempdir");
        for index in 0..10 {
            fs::write(dir.path().join(format!("f{index}")), b"x").expect("file");
        }
        let cancel = CancellationToken::new();
        cancel.cancel();
        let mut count = 0;
        scan_regular_files(dir.path(), Some(&cancel), |_, _| count += 1).expect("readable");
        assert_eq!(count, 0);
    }
}
