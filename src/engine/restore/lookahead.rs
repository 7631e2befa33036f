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
//! loaded ahead; it only costs its load.

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
    /// Raw tree bytes of the windows started and not taken, at most.
    budget: u64,
    /// Loads ahead at once, at most.
    requests: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// No load starts any more.
    closed: bool,
    /// Raw tree bytes of the windows in `started`.
    bytes: u64,
    /// Loads ahead running now.
    running: usize,
    /// Windows known and not started, by the place of their directory.
    known: BTreeMap<Place, Vec<BlobId>>,
    /// Ids in `known`.
    known_ids: usize,
    /// The place of each window in `known` or `started`.
    places: HashMap<Vec<BlobId>, Place>,
    /// Windows started ahead and not taken, with their raw bytes.
    started: HashMap<Vec<BlobId>, (u64, WindowLoad)>,
}

impl Lookahead {
    /// Windows of up to `budget` raw tree bytes ahead, `requests` loads
    /// at once.
    pub(super) fn new(budget: u64, requests: usize) -> Self {
        Lookahead {
            budget,
            requests,
            state: Mutex::default(),
        }
    }

    /// The load of the window of `ids`, if it was started ahead; its bytes
    /// leave the bound (the walker holds it now). Whatever the walk has
    /// passed is forgotten, and more windows start in the room freed.
    pub(super) fn take(
        shared: &Arc<Shared>,
        index: &Arc<BlobIndex>,
        ids: &[BlobId],
    ) -> Option<WindowLoad> {
        let mut state = shared.lookahead.state.lock().expect("lookahead");
        let place = state.places.remove(ids)?;
        // The walk is at `place`: the windows before it are behind.
        let ahead = state.known.split_off(&place);
        for behind in std::mem::replace(&mut state.known, ahead).into_values() {
            state.known_ids -= behind.len();
            state.places.remove(&behind);
        }
        let taken = match state.started.remove(ids) {
            Some((bytes, load)) => {
                state.bytes -= bytes;
                Some(load)
            }
            None => {
                // Known, not started: the walker loads it itself.
                let ids = state
                    .known
                    .remove(&place)
                    .expect("a place is known or started");
                state.known_ids -= ids.len();
                None
            }
        };
        shared.lookahead.start_known(&mut state, shared, index);
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
        let mut state = shared.lookahead.state.lock().expect("lookahead");
        if state.closed || shared.cancel.is_cancelled() {
            return;
        }
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
            let (end, _) = window_end(index, &ids, 0);
            ids.truncate(end);
            if state.places.contains_key(&ids) {
                continue;
            }
            let mut child = place.clone();
            child.push(u32::try_from(first + position).unwrap_or(u32::MAX));
            state.known_ids += ids.len();
            state.places.insert(ids.clone(), child.clone());
            state.known.insert(child, ids);
        }
        // Forget the windows the walk reaches last beyond the bound.
        while state.known_ids > MAX_KNOWN_IDS {
            let Some((_, ids)) = state.known.pop_last() else {
                break;
            };
            state.known_ids -= ids.len();
            state.places.remove(&ids);
        }
        shared.lookahead.start_known(&mut state, shared, index);
    }

    /// Start the known windows the walk enters first, while the bounds
    /// allow.
    fn start_known(&self, state: &mut State, shared: &Arc<Shared>, index: &Arc<BlobIndex>) {
        while !state.closed && state.running < self.requests {
            let Some(entry) = state.known.first_entry() else {
                return;
            };
            let bytes = window_bytes(index, entry.get());
            if state.bytes + bytes > self.budget {
                return;
            }
            let (place, ids) = entry.remove_entry();
            state.known_ids -= ids.len();
            state.bytes += bytes;
            state.running += 1;
            let load = spawn_window_load(
                shared.clone(),
                index.clone(),
                ids.clone(),
                Some((place, 0)),
                true,
            );
            state.started.insert(ids, (bytes, load));
        }
    }

    /// Stop: the loads not taken are aborted and none starts after.
    pub(super) fn close(&self) {
        let mut state = self.state.lock().expect("lookahead");
        state.closed = true;
        for (_, (_, load)) in state.started.drain() {
            load.abort();
        }
        state.known.clear();
        state.places.clear();
        state.bytes = 0;
        state.known_ids = 0;
    }
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

fn window_bytes(index: &BlobIndex, ids: &[BlobId]) -> u64 {
    ids.iter().map(|id| raw_length(index, id)).sum()
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
    tokio::spawn(async move {
        let trees = shared
            .trees
            .load_and_keep(&shared.repository, &index, &ids)
            .await;
        if ahead {
            shared.lookahead.state.lock().expect("lookahead").running -= 1;
        }
        if let Some((place, first)) = window {
            Lookahead::know_below(&shared, &index, &place, first, &trees);
        }
        trees
    })
}
