//! Trees a restore loaded, kept for the verification that follows it.
//!
//! A restore that is verified walks the snapshot's trees twice: once to
//! write, once to compare. Without this the verification loads every tree
//! again — a request, a decryption, a decompression and a decode per tree
//! window, for both snapshots of a sync given its since snapshot — which is
//! most of what a cutover pass costs when little changed. The restore puts
//! each tree it loads here, within a bound of raw tree bytes; the
//! verification takes each out as it visits its directory (it visits each
//! once), so the memory goes as the verification goes. A tree over the
//! bound, or one the restore did not load, is loaded from the repository
//! as before: the cache changes how often trees are read, never what.

use std::collections::HashMap;
use std::sync::Mutex;

use super::EngineError;
use super::repository::Repository;
use super::tree_packs::TreePacks;
use crate::repo::BlobId;
use crate::repo::index::BlobIndex;
use crate::repo::tree::Tree;

/// Raw tree bytes a restore keeps for its verification: the trees of
/// about 25,000 files (a 1 GiB claim of the reference kind has 3 MiB);
/// the rest is loaded again.
pub const VERIFY_TREE_CACHE_BYTES: u64 = 5 << 20;

/// Decoded trees by id, at most `budget` raw bytes of them.
#[derive(Debug, Default)]
pub struct TreeCache {
    budget: u64,
    state: Mutex<Cached>,
}

#[derive(Debug, Default)]
struct Cached {
    /// Raw bytes of the trees held.
    bytes: u64,
    trees: HashMap<BlobId, (Tree, u64)>,
}

impl TreeCache {
    /// A cache that keeps up to `budget` raw tree bytes (0: keeps nothing).
    pub fn new(budget: u64) -> Self {
        TreeCache {
            budget,
            state: Mutex::default(),
        }
    }

    /// Keep a copy of `tree` (id `id`, `raw_bytes` long) if it fits.
    fn keep(&self, id: BlobId, tree: &Tree, raw_bytes: u64) {
        if self.budget == 0 {
            return;
        }
        let mut cached = self.state.lock().expect("tree cache");
        if cached.trees.contains_key(&id) || cached.bytes.saturating_add(raw_bytes) > self.budget {
            return;
        }
        cached.bytes += raw_bytes;
        cached.trees.insert(id, (tree.clone(), raw_bytes));
    }

    /// Take tree `id` out, if it is held.
    fn take(&self, id: &BlobId) -> Option<Tree> {
        let mut cached = self.state.lock().expect("tree cache");
        let (tree, raw_bytes) = cached.trees.remove(id)?;
        cached.bytes -= raw_bytes;
        Some(tree)
    }

    /// Trees held now.
    pub fn len(&self) -> usize {
        self.state.lock().expect("tree cache").trees.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Load trees for the restore ([`Repository::load_trees`], cut from
    /// the tree packs it holds), keeping a copy of each while the bound
    /// allows.
    pub async fn load_and_keep(
        &self,
        repository: &Repository,
        index: &BlobIndex,
        ids: &[BlobId],
        held: &TreePacks,
    ) -> Vec<Result<Tree, EngineError>> {
        let trees = repository.load_trees(index, ids, Some(held), 1).await;
        for (id, tree) in ids.iter().zip(&trees) {
            if let Ok(tree) = tree {
                self.keep(*id, tree, raw_length(index, id));
            }
        }
        trees
    }

    /// [`TreeCache::load_and_keep`] of one tree.
    pub async fn load_one_and_keep(
        &self,
        repository: &Repository,
        index: &BlobIndex,
        id: &BlobId,
    ) -> Result<Tree, EngineError> {
        let tree = repository.load_tree(index, id).await?;
        self.keep(*id, &tree, raw_length(index, id));
        Ok(tree)
    }

    /// Trees for the verification: those held are taken out, the others
    /// loaded together from the repository; one result per id, in order.
    pub async fn take_or_load(
        &self,
        repository: &Repository,
        index: &BlobIndex,
        ids: &[BlobId],
    ) -> Vec<Result<Tree, EngineError>> {
        let mut results: Vec<Option<Result<Tree, EngineError>>> =
            ids.iter().map(|id| self.take(id).map(Ok)).collect();
        let missing: Vec<BlobId> = ids
            .iter()
            .zip(&results)
            .filter(|(_, result)| result.is_none())
            .map(|(id, _)| *id)
            .collect();
        if !missing.is_empty() {
            let mut loaded = repository
                .load_trees(index, &missing, None, 1)
                .await
                .into_iter();
            for result in results.iter_mut().filter(|result| result.is_none()) {
                *result = loaded.next();
            }
        }
        results
            .into_iter()
            .map(|result| result.expect("load_trees answers once per id"))
            .collect()
    }

    /// [`TreeCache::take_or_load`] of one tree.
    pub async fn take_or_load_one(
        &self,
        repository: &Repository,
        index: &BlobIndex,
        id: &BlobId,
    ) -> Result<Tree, EngineError> {
        match self.take(id) {
            Some(tree) => Ok(tree),
            None => repository.load_tree(index, id).await,
        }
    }
}

/// The raw length the index gives a tree (0 when it does not know it: the
/// load then fails anyway).
fn raw_length(index: &BlobIndex, id: &BlobId) -> u64 {
    index
        .get(id)
        .map_or(0, |location| u64::from(location.raw_length))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo::tree::{Entry, EntryKind};

    fn tree(name: &str) -> Tree {
        Tree {
            entries: vec![Entry::new(name.as_bytes(), EntryKind::File)],
        }
    }

    fn id(byte: u8) -> BlobId {
        BlobId([byte; 32])
    }

    #[test]
    fn trees_are_kept_within_the_bound_and_taken_once() {
        let cache = TreeCache::new(100);
        cache.keep(id(1), &tree("a"), 60);
        cache.keep(id(2), &tree("b"), 60);
        cache.keep(id(3), &tree("c"), 40);
        assert_eq!(cache.len(), 2, "the second tree does not fit");
        assert_eq!(cache.take(&id(1)), Some(tree("a")));
        assert_eq!(cache.take(&id(1)), None, "taken once");
        assert_eq!(cache.take(&id(2)), None, "never kept");
        cache.keep(id(2), &tree("b"), 60);
        assert_eq!(
            cache.take(&id(2)),
            Some(tree("b")),
            "room again after a take"
        );
    }

    #[test]
    fn a_cache_without_a_budget_keeps_nothing() {
        let cache = TreeCache::new(0);
        cache.keep(id(1), &tree("a"), 1);
        assert!(cache.is_empty());
    }
}
