//! Open file descriptors: the process's limit, raised once at the start of
//! each binary, the share of it that restores may hold for their batches'
//! directories, and the source files a backup holds open.
//!
//! A restore keeps each directory of a batch of files open (its files are
//! created and reopened relative to it, never through a path), so a batch
//! holds a descriptor per directory. With the usual soft limit of 1,024 a
//! batch holds at most 80 ([`FREE_BATCH_DIRECTORIES`]; it was 128 when
//! fewer batches were alive at once), and a tree of many small directories
//! was cut into a batch every 128 directories: 87 batches and 102 GETs for
//! the 11,111 directories and 30,000 files of the deep tree of
//! docs/benchmarks.md, where about 11 batches (25 GETs then) do.
//!
//! The hard limit is usually far higher (524,288 for a container under
//! containerd 2 and systemd; the soft limit stays 1,024 for programs that
//! use `select`). The binaries raise the soft limit towards the hard one,
//! as the Go runtime does for every Go program, and batches then take
//! directories beyond those they hold freely from [`batch_directories`], a
//! budget of what the limit leaves once each running restore's own
//! descriptors and the rest of the process's are set aside.
//!
//! The engines of one process (an agent moving several volumes at once)
//! share its limit: a restore holds freely a share of its part of it
//! ([`restore_share`]), a backup an eighth of its part
//! ([`backup_open_files`]). Under a hard limit of 1,024 that cannot be
//! raised, what they hold freely stays within three quarters of it for up
//! to 42 restores at once (the agent's most in a stage pod of 1Gi) and
//! under two thirds of it for 42 backups; many more at once would reach it
//! (a backup never holds fewer than [`MIN_BACKUP_OPEN_FILES`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Batches of one restore alive at once, at most: one filled by the walk,
/// one queued, one planned and fetched, two whose last reads were held
/// back to be fetched with it (`restore::plan::MAX_BATCHES_PER_READ`), and
/// one whose last blobs are being written. A batch lives until the last
/// scatter job writing to it is done, and up to eight jobs can be pending,
/// so with a slow target the batches whose jobs are pending could add up:
/// the walk waits for a place before it starts a batch, and there are this
/// many places.
pub const MAX_BATCHES_ALIVE: usize = 6;

/// Directories one batch may hold open without taking from the budget of
/// [`batch_directories`], with one restore running under a soft limit of
/// 1,024 or more: the [`MAX_BATCHES_ALIVE`] batches hold 480, which with a
/// restore's [`MAX_RESTORE_OPEN_FILES`] stays under a soft limit of 1,024.
/// Under a lower limit, or beside other restores, a batch holds fewer
/// ([`restore_share`]).
pub const FREE_BATCH_DIRECTORIES: usize = 80;

/// Restored files one restore keeps open between two of their writes, with
/// one restore running under a soft limit of 1,024 or more; beyond them a
/// file is closed after each write and opened again for the next. Fewer
/// under a lower limit or beside other restores ([`restore_share`]).
pub const MAX_RESTORE_OPEN_FILES: usize = 256;

/// Descriptors one running restore holds besides its batches' extra
/// directories: the first [`FREE_BATCH_DIRECTORIES`] of its batches alive
/// at once (480), its open files (256), the directories its walk is in and
/// a verification's files.
const DESCRIPTORS_PER_RESTORE: u64 = 1_024;
/// Descriptors kept for the rest of the process: the store's and the API
/// server's connections, the runtime's own, a backup's open files.
const DESCRIPTORS_OF_THE_PROCESS: u64 = 2_048;

/// The soft limit [`raise_open_file_limit`] asks for at most: room for
/// four restores with batches of 1,024 directories (about 22,500 with
/// what is set aside), and no more, since some programs close every descriptor up to
/// the limit before they execute another (containerd's reasons for a soft
/// limit of 1,024, containerd/containerd#8924).
const RAISED_SOFT_LIMIT: u64 = 65_536;

/// Raise the soft limit of open files towards the hard limit (at most
/// [`RAISED_SOFT_LIMIT`]), once at the start of a binary; returns the soft
/// limit now in force. A limit that cannot be raised is kept: restores then
/// batch [`FREE_BATCH_DIRECTORIES`] directories at most, as before.
pub fn raise_open_file_limit() -> u64 {
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    let wanted = limit.maximum.unwrap_or(u64::MAX).min(RAISED_SOFT_LIMIT);
    if soft < wanted
        && setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(wanted),
                maximum: limit.maximum,
            },
        )
        .is_ok()
    {
        return wanted;
    }
    soft
}

/// Descriptors taken by everyone who shares a limit, and the restores
/// running meanwhile (whose own descriptors the limit must leave room for).
#[derive(Debug, Default)]
pub struct DescriptorBudget {
    taken: AtomicUsize,
    restores: AtomicUsize,
}

impl DescriptorBudget {
    /// A budget none of which is taken, with no restore running.
    pub const fn new() -> Self {
        DescriptorBudget {
            taken: AtomicUsize::new(0),
            restores: AtomicUsize::new(0),
        }
    }

    /// Count a restore as running until the guard is dropped.
    pub fn restore_running(&'static self) -> RunningRestore {
        self.restores.fetch_add(1, Ordering::AcqRel);
        RunningRestore(self)
    }

    /// Restores running now.
    pub fn restores(&self) -> usize {
        self.restores.load(Ordering::Acquire)
    }

    /// Take one descriptor unless `limit` are taken already.
    pub fn try_take(&self, limit: usize) -> bool {
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |taken| {
                (taken < limit).then_some(taken + 1)
            })
            .is_ok()
    }

    /// Give back `count` taken descriptors.
    pub fn give_back(&self, count: usize) {
        self.taken.fetch_sub(count, Ordering::AcqRel);
    }

    /// Descriptors taken now.
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }
}

/// A restore counted as running by its [`DescriptorBudget`].
#[derive(Debug)]
pub struct RunningRestore(&'static DescriptorBudget);

impl Drop for RunningRestore {
    fn drop(&mut self) {
        self.0.restores.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a soft limit of `soft_limit` open files leaves for the extra
/// directories of batches while `restores` restores run (at least one is
/// counted: the one asking).
pub fn batch_directories_limit(soft_limit: u64, restores: usize) -> usize {
    let set_aside = DESCRIPTORS_OF_THE_PROCESS + DESCRIPTORS_PER_RESTORE * restores.max(1) as u64;
    usize::try_from(soft_limit.saturating_sub(set_aside)).unwrap_or(usize::MAX)
}

/// The extra directories (beyond [`FREE_BATCH_DIRECTORIES`] each) that the
/// batches of every restore in the process hold open.
pub fn batch_directories() -> &'static DescriptorBudget {
    static BUDGET: DescriptorBudget = DescriptorBudget::new();
    &BUDGET
}

/// [`batch_directories_limit`] of the soft limit in force now and the
/// restores running now.
pub fn batch_directories_limit_now() -> usize {
    batch_directories_limit(soft_limit_now(), batch_directories().restores())
}

/// What one restore holds open without asking: the directories each of its
/// batches holds freely, and the restored files it keeps open between
/// writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreShare {
    /// Directories a batch holds before it takes from [`batch_directories`].
    pub free_batch_directories: usize,
    /// Restored files kept open between two of their writes.
    pub open_files: usize,
}

/// [`RestoreShare`] of one of `restores` restores running under a soft
/// limit of `soft_limit` open files: each gets an equal part of the limit,
/// of which its [`MAX_BATCHES_ALIVE`] batches hold 30/64 freely and its
/// open files 16/64 (80 and 256 of a part of 1,024 or more, at most), the
/// rest left for its walk, its reads of the store and the process. Fixed at
/// 80 and 256, a restore under a limit of 64 held more directories than the
/// limit and every read of a pack failed with EMFILE: no file was
/// restored. Two restores under a hard limit of 1,024, as an agent moving
/// two volumes at once in such a container runs them, held 1,472.
pub fn restore_share(soft_limit: u64, restores: usize) -> RestoreShare {
    let part = soft_limit / restores.max(1) as u64;
    let of_part = |sixty_fourths: u64, most: usize| {
        usize::try_from(part.saturating_mul(sixty_fourths) / 64)
            .unwrap_or(usize::MAX)
            .clamp(1, most)
    };
    RestoreShare {
        free_batch_directories: of_part(5, FREE_BATCH_DIRECTORIES),
        open_files: of_part(16, MAX_RESTORE_OPEN_FILES),
    }
}

/// The soft limit of open files in force now (no limit: `u64::MAX`).
pub fn soft_limit_now() -> u64 {
    open_file_limits_now().0
}

/// Read in the store, whose messages name the limits too.
pub use crate::store::open_file_limits_now;

/// The fewest source files a backup holds open at once (the walker waits
/// for up to this many places at a time).
pub const MIN_BACKUP_OPEN_FILES: usize = 8;
/// The most source files a backup holds open at once.
pub const MAX_BACKUP_OPEN_FILES: usize = 128;

/// Source files one backup holds open at once under a soft limit of
/// `soft_limit` open files, `backups` backups running in the process with
/// it: an eighth of its part of the limit, from [`MIN_BACKUP_OPEN_FILES`]
/// to [`MAX_BACKUP_OPEN_FILES`]. Each small file
/// stays open from the walker's open until its job has read it, and the
/// walker runs ahead of the jobs; without a bound the batches of tiny
/// files queued for their jobs held thousands open, and files that could
/// not be opened were skipped with a warning. 64 kept the jobs of a first
/// backup of small files short of files; 128 is faster (docs/benchmarks.md,
/// "Where a first backup's cores wait"). A backup's share is fixed when it
/// starts, from the backups running then (itself among them): backups that
/// start one after another in an agent take 1/8, 1/16, 1/24... of the
/// limit, together less than two thirds of it for 42 at once. With an
/// eighth each whatever ran beside, eight backups at once under a soft
/// limit of 1,024 that cannot be raised (a hard limit of 1,024) held all
/// of it, and each open then waited for another to close.
pub fn backup_open_files(soft_limit: u64, backups: usize) -> usize {
    let eighth = soft_limit / backups.max(1) as u64 / 8;
    usize::try_from(eighth)
        .unwrap_or(usize::MAX)
        .clamp(MIN_BACKUP_OPEN_FILES, MAX_BACKUP_OPEN_FILES)
}

/// Backups running in the process.
static BACKUPS_RUNNING: AtomicUsize = AtomicUsize::new(0);

/// A backup counted among those running ([`backup_open_files`]) until it
/// is dropped.
#[derive(Debug)]
pub struct RunningBackup(());

impl RunningBackup {
    /// Count a backup as running, and its share of open source files under
    /// the soft limit in force now beside the backups running.
    pub fn start() -> (RunningBackup, usize) {
        let backups = BACKUPS_RUNNING.fetch_add(1, Ordering::AcqRel) + 1;
        (
            RunningBackup(()),
            backup_open_files(soft_limit_now(), backups),
        )
    }
}

impl Drop for RunningBackup {
    fn drop(&mut self) {
        BACKUPS_RUNNING.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_holds_open_an_eighth_of_its_part_of_the_limit_up_to_128_files() {
        assert_eq!(backup_open_files(1_024, 1), 128);
        assert_eq!(backup_open_files(1_024, 0), 128);
        assert_eq!(backup_open_files(65_536, 1), 128);
        assert_eq!(backup_open_files(u64::MAX, 1), 128);
        assert_eq!(backup_open_files(512, 1), 64);
        assert_eq!(backup_open_files(128, 1), 16);
        assert_eq!(backup_open_files(16, 1), 8);
        assert_eq!(backup_open_files(1_024, 2), 64);
        assert_eq!(backup_open_files(1_024, 8), 16);
        assert_eq!(backup_open_files(65_536, 64), 128);
        // Backups started one after another, each beside those before it,
        // hold less than the limit together.
        for (limit, backups) in [(1_024, 8), (1_024, 42), (4_096, 42), (65_536, 100)] {
            let held: usize = (1..=backups).map(|n| backup_open_files(limit, n)).sum();
            assert!(
                (held as u64) < limit * 3 / 4,
                "{backups} backups under {limit}: {held}"
            );
        }
    }

    #[test]
    fn a_restore_holds_a_share_of_the_limit_that_its_batches_and_files_stay_within() {
        let share = |free_batch_directories, open_files| RestoreShare {
            free_batch_directories,
            open_files,
        };
        assert_eq!(restore_share(1_024, 1), share(80, 256));
        assert_eq!(restore_share(65_536, 1), share(80, 256));
        assert_eq!(restore_share(u64::MAX, 1), share(80, 256));
        assert_eq!(restore_share(1_024, 0), share(80, 256));
        assert_eq!(restore_share(1_024, 2), share(40, 128));
        assert_eq!(restore_share(64, 1), share(5, 16));
        assert_eq!(restore_share(16, 1), share(1, 4));
        assert_eq!(restore_share(16, 8), share(1, 1));
        // What each restore holds freely stays within its part of the
        // limit, with room left for its walk and reads.
        for (limit, restores) in [
            (1_024, 1),
            (1_024, 2),
            (1_024, 10),
            (1_024, 42),
            (20_000, 3),
            (64, 1),
        ] {
            let share = restore_share(limit, restores);
            let held = MAX_BATCHES_ALIVE * share.free_batch_directories + share.open_files;
            assert!(
                (held * restores) as u64 <= limit * 3 / 4,
                "{restores} restores under {limit}: {held} each"
            );
        }
    }

    #[test]
    fn the_usual_soft_limit_leaves_no_extra_directories_and_a_raised_one_leaves_the_rest() {
        assert_eq!(batch_directories_limit(1_024, 1), 0);
        assert_eq!(batch_directories_limit(3_072, 1), 0);
        assert_eq!(batch_directories_limit(20_000, 0), 16_928);
        assert_eq!(batch_directories_limit(20_000, 1), 16_928);
        assert!(!DescriptorBudget::new().try_take(batch_directories_limit(1_024, 1)));
    }

    #[test]
    fn each_running_restore_sets_its_own_descriptors_aside() {
        // Ten restores under a hard limit of 20,000: what their batches may
        // take beyond their first directories, with their own and the
        // process's, stays within the limit.
        assert_eq!(batch_directories_limit(20_000, 10), 7_712);
        assert_eq!(
            batch_directories_limit(20_000, 10) as u64
                + 10 * DESCRIPTORS_PER_RESTORE
                + DESCRIPTORS_OF_THE_PROCESS,
            20_000
        );
        assert_eq!(batch_directories_limit(20_000, 20), 0);
        let budget: &'static DescriptorBudget = Box::leak(Box::new(DescriptorBudget::new()));
        let first = budget.restore_running();
        let second = budget.restore_running();
        assert_eq!(budget.restores(), 2);
        drop(first);
        assert_eq!(budget.restores(), 1);
        drop(second);
        assert_eq!(budget.restores(), 0);
    }

    #[test]
    fn a_budget_gives_out_no_more_than_its_limit_and_takes_back_what_is_given_back() {
        let budget = DescriptorBudget::new();
        assert!((0..3).all(|_| budget.try_take(3)));
        assert!(!budget.try_take(3));
        assert_eq!(budget.taken(), 3);
        budget.give_back(2);
        assert!(budget.try_take(3));
        assert_eq!(budget.taken(), 2);
    }

    #[test]
    fn raising_the_limit_leaves_a_soft_limit_no_lower_than_before_and_no_higher_than_the_hard_one()
    {
        let before = getrlimit(Resource::Nofile);
        let soft = raise_open_file_limit();
        let after = getrlimit(Resource::Nofile);
        assert_eq!(after.current, Some(soft));
        assert!(after.current >= before.current);
        assert!(after.current <= after.maximum.or(Some(u64::MAX)));
    }
}
