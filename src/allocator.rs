//! How the process's allocator keeps freed memory: set once at the start of
//! each binary (the CLI, the controller and the mover agent).
//!
//! glibc's defaults cost a backup a quarter of its memory budget in memory
//! that is free but kept: each thread that allocates gets an arena of its
//! own, and the size from which an allocation gets pages of its own (given
//! back when freed) grows to the largest buffer freed, a 16–20 MiB pack, so
//! up to twice that stays on the heap. A first backup of 200,000 small
//! files peaked at 131 MiB with the defaults and at 78 MiB with the
//! settings below, in the same time (docs/benchmarks.md, "Small files in
//! runs"); an agent moving four claims at once stays under its stage
//! pod's 128Mi request only with them.
//!
//! glibc reads these settings from the environment when the process starts
//! (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`), and the project forbids
//! `unsafe` code (so no `mallopt`): [`keep_freed_memory_small`] sets what
//! is unset and executes the same binary again, once, with the same
//! arguments and process id. A setting given in the environment is left as
//! given; children the process starts inherit both.

use std::ffi::OsString;

/// glibc malloc arenas: two, for the async runtime's threads and the
/// blocking pool's to share.
pub const ARENAS: u32 = 2;
/// Allocations from this size on get pages of their own, given back when
/// freed: packs and the largest chunk buffers.
pub const MMAP_THRESHOLD_BYTES: u32 = 4 << 20;

/// The settings, by the environment variable glibc reads each from.
pub fn settings() -> [(&'static str, String); 2] {
    [
        ("MALLOC_ARENA_MAX", ARENAS.to_string()),
        ("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD_BYTES.to_string()),
    ]
}

/// The settings the environment `lookup` gives does not set yet.
pub fn missing_settings(lookup: impl Fn(&str) -> Option<OsString>) -> Vec<(&'static str, String)> {
    settings()
        .into_iter()
        .filter(|(name, _)| lookup(name).is_none())
        .collect()
}

/// Apply [`ARENAS`] and [`MMAP_THRESHOLD_BYTES`] where the environment
/// does not set them, by executing this binary again with them; returns
/// only when nothing was missing or the binary could not be executed again
/// (it then runs on with glibc's defaults). Call first in `main`, before
/// anything else is done.
pub fn keep_freed_memory_small() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        let missing = missing_settings(|name| std::env::var_os(name));
        if missing.is_empty() {
            return;
        }
        let Ok(binary) = std::env::current_exe() else {
            return;
        };
        let mut arguments = std::env::args_os();
        let mut command = std::process::Command::new(binary);
        if let Some(name) = arguments.next() {
            command.arg0(name);
        }
        command.args(arguments).envs(missing);
        // Returns only if the binary could not be executed.
        let _ = command.exec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_environment_does_not_set_is_set() {
        assert_eq!(
            missing_settings(|_| None),
            vec![
                ("MALLOC_ARENA_MAX", "2".to_string()),
                ("MALLOC_MMAP_THRESHOLD_", "4194304".to_string()),
            ]
        );
        let arenas_given =
            missing_settings(|name| (name == "MALLOC_ARENA_MAX").then(|| "8".into()));
        assert_eq!(
            arenas_given,
            vec![("MALLOC_MMAP_THRESHOLD_", "4194304".to_string())]
        );
        assert!(missing_settings(|_| Some("1".into())).is_empty());
    }
}
