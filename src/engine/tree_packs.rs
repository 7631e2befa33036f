//! Packs of trees a restore reads whole, once.
//!
//! A restore needs every tree of its snapshot, a window of neighbouring
//! subtrees at a time ([`super::restore`]); each window is a read of a few
//! KiB from a pack of trees. A tree of 11,111 small directories made 1,112
//! such reads of one 1 MiB pack, and the store served each one (an S3
//! server spends about as much CPU on a small ranged GET as on a large
//! one). So a pack that holds only trees, and fits the room below, is
//! read whole by the first window that needs it, from its first byte to
//! the end of its last blob, and the windows after are cut from the bytes
//! held. When another pack needs the room, the one used least recently is
//! dropped and never read whole again (a walk that comes back to it reads
//! its windows in ranges, as before): a restore reads each tree pack
//! whole at most once, so it never reads more bytes of trees than there
//! are packs of trees, plus the ranges of the packs it could not hold.
//! A pack that does not fit, or holds data, or failed to come whole, is
//! read in ranges.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::OnceCell;

use crate::repo::index::BlobIndex;
use crate::repo::{self, ObjectId};
use crate::store::ObjectStore;

/// Bytes of tree packs a restore holds with the default share: a pack of
/// trees as the backup writes it (4 MiB, and the blob that passed that).
pub const TREE_PACKS_HELD_BYTES: u64 = 5 << 20;

/// The tree packs held by one restore (see the module documentation).
#[derive(Debug)]
pub struct TreePacks {
    /// Bytes of packs held or being read, at most.
    budget: u64,
    state: Mutex<Held>,
}

/// A pack's bytes, read once by whichever window needs it first; `None`
/// when the read failed.
type WholePack = Arc<OnceCell<Option<Bytes>>>;

#[derive(Debug, Default)]
struct Held {
    /// Bytes of the packs in `packs`.
    bytes: u64,
    /// Packs held or being read, with their sizes, used least recently
    /// first.
    packs: Vec<(ObjectId, u64, WholePack)>,
    /// Packs dropped or failed: read in ranges from now on.
    let_go: HashSet<ObjectId>,
}

impl TreePacks {
    /// Hold up to `budget` bytes of tree packs (0: read every window in
    /// ranges).
    pub fn new(budget: u64) -> Self {
        TreePacks {
            budget,
            state: Mutex::default(),
        }
    }

    /// The bytes of `pack`, from its start to the end of its last blob, if
    /// it holds only trees and is held (read whole now if it fits and was
    /// never let go of); `None`: read its blobs in ranges.
    pub async fn whole(
        &self,
        store: &dyn ObjectStore,
        index: &BlobIndex,
        pack: &ObjectId,
    ) -> Option<Bytes> {
        let end = index.tree_pack_end(pack)?;
        let whole = self.room_for(pack, end)?;
        let bytes = whole
            .get_or_init(|| async {
                match store.get(&repo::pack_key(pack), Some(0..end)).await {
                    Ok(bytes) if bytes.len() as u64 == end => Some(bytes),
                    Ok(bytes) => {
                        tracing::debug!(pack = %pack, read = bytes.len(), expected = end, "a tree pack came short, reading its trees in ranges");
                        None
                    }
                    Err(error) => {
                        tracing::debug!(pack = %pack, error = %error, "a tree pack could not be read whole, reading its trees in ranges");
                        None
                    }
                }
            })
            .await
            .clone();
        if bytes.is_none() {
            self.let_go(pack);
        }
        bytes
    }

    /// The pack's place among those held, made for it (the packs used
    /// least recently let go of) unless it does not fit or was let go of.
    fn room_for(&self, pack: &ObjectId, end: u64) -> Option<WholePack> {
        if end > self.budget {
            return None;
        }
        let mut held = self.state.lock().expect("tree packs");
        if let Some(position) = held.packs.iter().position(|(id, ..)| id == pack) {
            let used = held.packs.remove(position);
            let whole = used.2.clone();
            held.packs.push(used);
            return Some(whole);
        }
        if held.let_go.contains(pack) {
            return None;
        }
        while held.bytes + end > self.budget && !held.packs.is_empty() {
            let (dropped, bytes, _) = held.packs.remove(0);
            held.bytes -= bytes;
            held.let_go.insert(dropped);
        }
        let whole = WholePack::default();
        held.bytes += end;
        held.packs.push((*pack, end, whole.clone()));
        Some(whole)
    }

    /// Read `pack` in ranges from now on, and free its room.
    fn let_go(&self, pack: &ObjectId) {
        let mut held = self.state.lock().expect("tree packs");
        if let Some(position) = held.packs.iter().position(|(id, ..)| id == pack) {
            let (_, bytes, _) = held.packs.remove(position);
            held.bytes -= bytes;
        }
        held.let_go.insert(*pack);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(n: u8) -> ObjectId {
        ObjectId([n; 32])
    }

    #[test]
    fn a_pack_is_held_once_and_the_least_recently_used_let_go_of_for_good() {
        let packs = TreePacks::new(10);
        let first = packs.room_for(&pack(1), 4).expect("fits");
        assert!(
            Arc::ptr_eq(&first, &packs.room_for(&pack(1), 4).expect("held")),
            "one read per pack"
        );
        packs.room_for(&pack(2), 4).expect("fits beside");
        // Pack 1 was used before pack 2 last: it is the one let go of.
        packs.room_for(&pack(1), 4).expect("held");
        packs.room_for(&pack(3), 4).expect("room made");
        assert!(packs.room_for(&pack(2), 4).is_none(), "let go of: ranges");
        assert!(packs.room_for(&pack(1), 4).is_some());
        assert!(packs.room_for(&pack(4), 11).is_none(), "never fits");
        let held = packs.state.lock().expect("held");
        assert_eq!(held.bytes, 8);
    }

    #[test]
    fn a_pack_that_failed_to_come_whole_frees_its_room_and_is_read_in_ranges() {
        let packs = TreePacks::new(10);
        packs.room_for(&pack(1), 8).expect("fits");
        packs.let_go(&pack(1));
        assert!(packs.room_for(&pack(1), 8).is_none());
        packs.room_for(&pack(2), 10).expect("its room is free");
        assert_eq!(packs.state.lock().expect("held").packs.len(), 1);
    }

    #[test]
    fn nothing_is_held_without_room() {
        assert!(TreePacks::new(0).room_for(&pack(1), 1).is_none());
    }
}
