//! Subtree windows loaded ahead of the walk.
//!
//! The walker loads a directory's subtrees a window at a time when it
//! enters the directory ([`super::Subtrees`]). On its own that is one
//! round trip to the store per directory that has subdirectories, one
//! after the other: against an S3 endpoint 20 ms away, a restore of
//! 11,111 small directories waited over 20 s for its trees alone. So each
//! window that arrives makes known, here, the first window of each of its
//! trees' own subdirectories, and the windows known are loaded ahead of
//! the walk in the order the walk will enter their directories (depth
//! first: a directory's place is the path of subdirectory positions
//! leading to it), a few at once; those do the same when they arrive. The
//! walk finds the windows of the directories it enters loaded or loading.
//!
//! Bounds: the windows loaded ahead and not yet entered hold at most the
//! engine's share of [`super::TREE_LOOKAHEAD_BYTES`] raw tree bytes, at
//! most [`super::TREE_LOOKAHEAD_REQUESTS`] loads run at once, and the
//! windows known but not started keep at most [`MAX_KNOWN_IDS`] ids (the
//! ones the walk reaches last are forgotten first; the walk loads what it
//! finds missing when it gets there, as it did without this). A window is
//! found by the exact ids it loads, so a window the walker cuts
//! differently (a tree with refused names) is never mistaken for one
//! loaded ahead; it only costs its load, and is dropped, bytes and all,
//! once the walk has passed its place.
//!
//! The bookkeeping ([`Windows`]) is apart from the loads it starts, and
//! tested on its own.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::{EngineError, Shared};
use crate::repo::BlobId;
use crate::repo::index::BlobIndex;
use crate::repo::tree::{EntryKind, Tree};

/// A window's load: its trees, one result per id, in order.
pub(super) type WindowLoad = tokio::task::JoinHandle<Vec<Result<Tree, EngineError>>>;

/// Where a directory comes in the walk: the positions, among their
/// parents' subdirectories, of the directories leading to it (the root's
/// is empty). Ordered as the walk enters them.
pub(super) type Place = Vec<u32>;

/// Ids of the windows known but not started, at most (a few MiB).
const MAX_KNOWN_IDS: usize = 65_536;

/// The windows known and loaded ahead of the walk (see the module
/// documentation).
pub(super) struct Lookahead {
    windows: Mutex<Windows<WindowLoad>>,
}

/// A window started: where its directory comes in the walk and its raw
/// tree bytes.
struct Window {
    place: Place,
    bytes: u64,
}

/// Which windows are known, which are started with their loads `L`, and
/// the bounds on them; no I/O (the loads are started by the caller).
struct Windows<L> {
    /// Raw tree bytes of the started windows, at most.
    budget: u64,
    /// Loads ahead at once, at most.
    requests: usize,
    /// No load starts any more.
    closed: bool,
    /// Raw tree bytes of the windows in `started`.
    bytes: u64,
    /// Loads ahead running now.
    running: usize,
    /// Windows known and not started, by the place of their directory:
    /// their ids and raw tree bytes.
    known: BTreeMap<Place, (Vec<BlobId>, u64)>,
    /// Ids in `known`.
    known_ids: usize,
    /// The place of each window in `known`, by its ids.
    known_places: HashMap<Vec<BlobId>, Place>,
    /// Windows started and not taken, by their ids, with their loads.
    started: HashMap<Vec<BlobId>, (Window, L)>,
}

impl<L> Windows<L> {
    fn new(budget: u64, requests: usize) -> Self {
        Windows {
            budget,
            requests,
            closed: false,
            bytes: 0,
            running: 0,
            known: BTreeMap::new(),
            known_ids: 0,
            known_places: HashMap::new(),
            started: HashMap::new(),
        }
    }

    /// Make known the window of `ids` (`bytes` raw bytes) of the directory
    /// at `place`, unless its ids or its place are known already (a window
    /// the walker cut differently gave its place to another: the first one
    /// stays). Beyond [`MAX_KNOWN_IDS`], the windows the walk reaches last
    /// are forgotten.
    fn know(&mut self, place: Place, ids: Vec<BlobId>, bytes: u64) {
        if self.closed
            || self.known_places.contains_key(&ids)
            || self.started.contains_key(&ids)
            || self.known.contains_key(&place)
        {
            return;
        }
        self.known_ids += ids.len();
        self.known_places.insert(ids.clone(), place.clone());
        self.known.insert(place, (ids, bytes));
        while self.known_ids > MAX_KNOWN_IDS {
            let Some((_, (ids, _))) = self.known.pop_last() else {
                break;
            };
            self.known_ids -= ids.len();
            self.known_places.remove(&ids);
        }
    }

    /// The walk has reached the window of `ids`: its load if it was
    /// started (its bytes leave the bound: the walker holds it now). The
    /// windows before its place are behind the walk: forgotten, and the
    /// loads of those started returned in the second place, to be stopped.
    fn take(&mut self, ids: &[BlobId]) -> (Option<L>, Vec<L>) {
        let (place, taken) = if let Some((window, load)) = self.started.remove(ids) {
            self.bytes -= window.bytes;
            (window.place, Some(load))
        } else if let Some(place) = self.known_places.remove(ids) {
            // Known, not started: the walker loads it itself.
            self.known.remove(&place);
            self.known_ids -= ids.len();
            (place, None)
        } else {
            return (None, Vec::new());
        };
        let ahead = self.known.split_off(&place);
        for (behind, _) in std::mem::replace(&mut self.known, ahead).into_values() {
            self.known_ids -= behind.len();
            self.known_places.remove(&behind);
        }
        let behind: Vec<L> = self
            .started
            .extract_if(|_, (window, _)| window.place < place)
            .map(|(_, (window, load))| {
                self.bytes -= window.bytes;
                load
            })
            .collect();
        (taken, behind)
    }

    /// Start, by `start`, the known windows the walk enters first, while
    /// the bounds allow.
    fn start_known(&mut self, mut start: impl FnMut(Place, Vec<BlobId>) -> L) {
        while !self.closed && self.running < self.requests {
            let Some(entry) = self.known.first_entry() else {
                return;
            };
            if self.bytes + entry.get().1 > self.budget {
                return;
            }
            let (place, (ids, bytes)) = entry.remove_entry();
            self.known_places.remove(&ids);
            self.known_ids -= ids.len();
            self.bytes += bytes;
            self.running += 1;
            let load = start(place.clone(), ids.clone());
            self.started.insert(ids, (Window { place, bytes }, load));
        }
    }

    /// A load started here has ended.
    fn finished(&mut self) {
        self.running -= 1;
    }

    /// Stop: nothing starts after; the loads not taken are returned, to be
    /// stopped.
    fn close(&mut self) -> Vec<L> {
        self.closed = true;
        self.known.clear();
        self.known_places.clear();
        self.known_ids = 0;
        self.bytes = 0;
        self.started.drain().map(|(_, (_, load))| load).collect()
    }
}

impl Lookahead {
    /// Windows of up to `budget` raw tree bytes ahead, `requests` loads
    /// at once.
    pub(super) fn new(budget: u64, requests: usize) -> Self {
        Lookahead {
            windows: Mutex::new(Windows::new(budget, requests)),
        }
    }

    /// The load of the window of `ids`, if it was started ahead. Whatever
    /// the walk has passed is forgotten, and more windows start in the
    /// room freed.
    pub(super) fn take(
        shared: &Arc<Shared>,
        index: &Arc<BlobIndex>,
        ids: &[BlobId],
    ) -> Option<WindowLoad> {
        let mut windows = shared.lookahead.windows.lock().expect("lookahead");
        let (taken, behind) = windows.take(ids);
        windows.start_known(|place, ids| start_ahead(shared, index, place, ids));
        // Stopped with the lock released: a stopped load frees its slot.
        drop(windows);
        for load in behind {
            load.abort();
        }
        taken
    }

    /// Make known the first window of each subdirectory of `trees`, the
    /// window at `first` of the subdirectories of the directory at
    /// `place`, and start what the bounds allow.
    fn know_below(
        shared: &Arc<Shared>,
        index: &Arc<BlobIndex>,
        place: &Place,
        first: usize,
        trees: &[Result<Tree, EngineError>],
    ) {
        if shared.cancel.is_cancelled() {
            return;
        }
        let mut windows = shared.lookahead.windows.lock().expect("lookahead");
        for (position, tree) in trees.iter().enumerate() {
            let Ok(tree) = tree else { continue };
            let mut ids: Vec<BlobId> = tree
                .entries
                .iter()
                .filter(|entry| entry.kind == EntryKind::Directory)
                .filter_map(|entry| entry.subtree)
                .collect();
            if ids.is_empty() {
                continue;
            }
            let (end, bytes) = window_end(index, &ids, 0);
            ids.truncate(end);
            let mut child = place.clone();
            child.push(u32::try_from(first + position).unwrap_or(u32::MAX));
            windows.know(child, ids, bytes);
        }
        windows.start_known(|place, ids| start_ahead(shared, index, place, ids));
    }

    /// Stop: the loads not taken are aborted and none starts after.
    pub(super) fn close(&self) {
        let started = self.windows.lock().expect("lookahead").close();
        for load in started {
            load.abort();
        }
    }
}

fn start_ahead(
    shared: &Arc<Shared>,
    index: &Arc<BlobIndex>,
    place: Place,
    ids: Vec<BlobId>,
) -> WindowLoad {
    spawn_window_load(shared.clone(), index.clone(), ids, Some((place, 0)), true)
}

/// Where the window of `ids` starting at `start` ends, and its raw bytes:
/// up to [`super::TREE_PREFETCH_BYTES`], at least one tree.
pub(super) fn window_end(index: &BlobIndex, ids: &[BlobId], start: usize) -> (usize, u64) {
    let mut end = start;
    let mut bytes = 0u64;
    while end < ids.len() && (end == start || bytes < super::TREE_PREFETCH_BYTES) {
        bytes += raw_length(index, &ids[end]);
        end += 1;
    }
    (end, bytes)
}

fn raw_length(index: &BlobIndex, id: &BlobId) -> u64 {
    index
        .get(id)
        .map_or(0, |location| u64::from(location.raw_length))
}

/// Load the trees `ids` on the runtime (kept for a verification). With a
/// `window` (the place of the directory whose subdirectories they are,
/// and the position of the first of them there), they are trees of the
/// snapshot restored: once here, the windows below them are made known
/// and loaded ahead ([`Lookahead::know_below`]); `ahead` says this load
/// is one of those, which frees its slot when done.
pub(super) fn spawn_window_load(
    shared: Arc<Shared>,
    index: Arc<BlobIndex>,
    ids: Vec<BlobId>,
    window: Option<(Place, usize)>,
    ahead: bool,
) -> WindowLoad {
    // Frees the load's slot when it ends, stopped or not (even before it
    // began: the task's future owns it).
    let slot = ahead.then(|| AheadSlot(shared.clone()));
    tokio::spawn(async move {
        let trees = shared
            .trees
            .load_and_keep(&shared.repository, &index, &ids, &shared.tree_packs)
            .await;
        drop(slot);
        if let Some((place, first)) = window {
            Lookahead::know_below(&shared, &index, &place, first, &trees);
        }
        trees
    })
}

/// The slot of a load ahead, freed when dropped: when the load ends, or
/// when it is stopped (its task dropped).
struct AheadSlot(Arc<Shared>);

impl Drop for AheadSlot {
    fn drop(&mut self) {
        self.0
            .lookahead
            .windows
            .lock()
            .expect("lookahead")
            .finished();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(seed: u8, count: u8) -> Vec<BlobId> {
        (0..count)
            .map(|n| BlobId([seed.wrapping_add(n); 32]))
            .collect()
    }

    /// Windows of 100 bytes, up to 300 bytes and `requests` loads ahead;
    /// a load is the number of the window started.
    fn windows(requests: usize) -> (Windows<u32>, Vec<Place>) {
        (Windows::new(300, requests), Vec::new())
    }

    fn start(windows: &mut Windows<u32>, started: &mut Vec<Place>) {
        windows.start_known(|place, _| {
            started.push(place);
            started.len() as u32
        });
    }

    #[test]
    fn windows_start_in_walk_order_within_the_bounds_and_a_taken_one_frees_its_room() {
        let (mut windows, mut started) = windows(2);
        windows.know(vec![1], ids(10, 2), 100);
        windows.know(vec![0, 3], ids(20, 1), 100);
        windows.know(vec![0], ids(30, 1), 100);
        start(&mut windows, &mut started);
        assert_eq!(started, [vec![0], vec![0, 3]], "two loads at once");
        windows.finished();
        windows.finished();
        start(&mut windows, &mut started);
        assert_eq!(started.len(), 3, "300 bytes: the third fits");
        windows.know(vec![2], ids(40, 1), 100);
        start(&mut windows, &mut started);
        assert_eq!(
            started.len(),
            3,
            "the bytes are spent until a window is taken"
        );
        assert_eq!(windows.take(&ids(30, 1)), (Some(1), Vec::new()));
        start(&mut windows, &mut started);
        assert_eq!(started.last(), Some(&vec![2]));
        assert_eq!(windows.take(&ids(99, 1)), (None, Vec::new()), "never known");
    }

    #[test]
    fn the_windows_the_walk_has_passed_are_forgotten_and_their_loads_returned() {
        let (mut windows, mut started) = windows(2);
        windows.know(vec![0], ids(10, 1), 100);
        windows.know(vec![2], ids(20, 1), 100);
        start(&mut windows, &mut started);
        windows.know(vec![1], ids(30, 1), 100);
        windows.know(vec![3], ids(40, 1), 100);
        // The walk enters [0] with other ids than those started for it (a
        // tree with refused names), then reaches the window of [1], known
        // and not started: [0] is behind, [2] and [3] ahead.
        assert_eq!(windows.take(&ids(30, 1)), (None, vec![1]));
        assert_eq!(windows.bytes, 100, "only [2] holds its bytes");
        assert_eq!(windows.known.keys().collect::<Vec<_>>(), [&vec![3]]);
        assert_eq!(windows.take(&ids(10, 1)), (None, Vec::new()), "forgotten");
        assert_eq!(windows.take(&ids(20, 1)), (Some(2), Vec::new()));
        assert_eq!(windows.bytes, 0);
    }

    #[test]
    fn a_place_known_keeps_its_first_window_and_the_second_is_never_taken() {
        let (mut windows, mut started) = windows(4);
        windows.know(vec![0, 0], ids(10, 1), 100);
        // The same place from a window the walker cut differently.
        windows.know(vec![0, 0], ids(20, 1), 100);
        start(&mut windows, &mut started);
        assert_eq!(started, [vec![0, 0]], "one window per place");
        assert_eq!(windows.take(&ids(10, 1)), (Some(1), Vec::new()));
        assert_eq!(windows.take(&ids(20, 1)), (None, Vec::new()));
        assert!(windows.known.is_empty() && windows.known_places.is_empty());
        assert!(windows.started.is_empty());
        assert_eq!((windows.known_ids, windows.bytes), (0, 0));
    }

    #[test]
    fn beyond_the_known_bound_the_windows_the_walk_reaches_last_are_forgotten() {
        let (mut windows, _) = windows(0);
        let per_window = 255u8;
        let count = MAX_KNOWN_IDS / usize::from(per_window) + 1;
        for n in 0..count {
            let place = vec![u32::try_from(n).expect("small")];
            let mut window = ids(0, per_window);
            window[0].0[1] = (n % 256) as u8;
            window[0].0[2] = (n / 256) as u8;
            windows.know(place, window, 100);
        }
        assert!(windows.known_ids <= MAX_KNOWN_IDS);
        assert_eq!(windows.known.len(), count - 1);
        assert!(
            !windows
                .known
                .contains_key(&vec![u32::try_from(count - 1).expect("small")])
        );
    }

    #[test]
    fn after_close_nothing_is_known_or_started() {
        let (mut windows, mut started) = windows(4);
        windows.know(vec![0], ids(10, 1), 100);
        start(&mut windows, &mut started);
        assert_eq!(windows.close(), vec![1]);
        windows.know(vec![1], ids(20, 1), 100);
        assert!(windows.known.is_empty(), "nothing known after close");
        start(&mut windows, &mut started);
        assert_eq!(started.len(), 1);
    }
}
