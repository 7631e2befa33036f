//! Tables keyed by blob id that hold a blob in its id and its value and
//! nothing more: the index of a repository ([`super::index::BlobIndex`], a
//! location each) and the set of blobs a backup has claimed
//! ([`BlobSet`]). Both grow to millions of blobs in a migration's
//! repository, and their memory comes out of a stage pod's.
//!
//! Most blobs are held in one vector sorted by id, with no spare capacity:
//! 52 bytes a blob with a location, 32 without (a hash map of the same
//! entries holds 60 to 120 and 33 to 70, with its empty buckets, and half
//! as much again while it grows). A blob added goes to a small hash map
//! first and is merged into the vector when enough have come
//! ([`MERGE_SHARE`]); [`BlobTable::compact`] merges the rest. The vector
//! is searched through a table of where each prefix of the id starts.

use std::collections::HashMap;
use std::mem::size_of;

use super::BlobId;

/// Blobs added since the last merge wait in a hash map until they are
/// more than this share of the sorted ones (or than [`MERGE_AT_LEAST`]):
/// the map's slack and the merge's copy stay under a few bytes a blob,
/// and each blob is moved about nine times while a table grows from
/// nothing.
const MERGE_SHARE: usize = 8;
/// The fewest blobs waiting that make a merge worth its pass over the
/// sorted ones.
const MERGE_AT_LEAST: usize = 4096;
/// The sorted blobs are found through a table of where each leading-bits
/// prefix of the id starts, with 2^(log2(blobs) - this) prefixes: 4 to 8
/// blobs a prefix (ids are keyed hashes, spread evenly), so a lookup reads
/// the table and two or three blobs; half a byte to a byte a blob.
const BLOBS_PER_PREFIX_BITS: u32 = 2;
/// The most leading bits the prefix table uses (16 Mi prefixes, 64 MiB).
const MAX_PREFIX_BITS: u32 = 24;

/// Values by blob id, each held once.
#[derive(Debug, Clone)]
pub struct BlobTable<V> {
    /// Most blobs, sorted by id; none of them also in `recent`.
    sorted: Vec<(BlobId, V)>,
    /// Where in `sorted` the ids starting with each `prefix_bits`-bit
    /// prefix begin, and one more: the end. Empty while `prefix_bits` is 0
    /// (all of `sorted` is searched).
    prefix_starts: Vec<u32>,
    prefix_bits: u32,
    /// Blobs added since the last merge.
    recent: HashMap<BlobId, V>,
}

impl<V> Default for BlobTable<V> {
    fn default() -> Self {
        BlobTable {
            sorted: Vec::new(),
            prefix_starts: Vec::new(),
            prefix_bits: 0,
            recent: HashMap::new(),
        }
    }
}

/// The first `bits` bits of an id (0 when `bits` is 0).
fn id_prefix(id: &BlobId, bits: u32) -> usize {
    if bits == 0 {
        return 0;
    }
    let leading = u64::from_be_bytes(id.0[..8].try_into().expect("8 bytes"));
    (leading >> (64 - bits)) as usize
}

impl<V: Copy> BlobTable<V> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// A table of `blobs`, which are sorted by id with no id twice (what a
    /// load builds at once, [`super::index::BlobIndexBuilder`]).
    pub fn from_sorted(mut blobs: Vec<(BlobId, V)>) -> Self {
        debug_assert!(blobs.windows(2).all(|pair| pair[0].0.0 < pair[1].0.0));
        blobs.shrink_to_fit();
        let mut table = BlobTable {
            sorted: blobs,
            ..BlobTable::default()
        };
        table.index_prefixes();
        table
    }

    /// The value of `id`, if held.
    pub fn get(&self, id: &BlobId) -> Option<&V> {
        match self.sorted_position(id) {
            Some(at) => Some(&self.sorted[at].1),
            None => self.recent.get(id),
        }
    }

    /// Hold `value` for `id` if `id` is not held yet, and return `None`;
    /// else leave the table as it is and return the value held, to change
    /// in place if the caller will.
    pub fn insert_or_get(&mut self, id: BlobId, value: V) -> Option<&mut V> {
        if self.recent.len() >= (self.sorted.len() / MERGE_SHARE).max(MERGE_AT_LEAST) {
            self.compact();
        }
        if let Some(at) = self.sorted_position(&id) {
            return Some(&mut self.sorted[at].1);
        }
        match self.recent.entry(id) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(value);
                None
            }
            std::collections::hash_map::Entry::Occupied(slot) => Some(slot.into_mut()),
        }
    }

    /// Merge the blobs added since the last merge into the sorted ones, so
    /// that the table holds nothing spare. Lookups are right either way.
    pub fn compact(&mut self) {
        if self.recent.is_empty() {
            return;
        }
        let mut added: Vec<(BlobId, V)> = std::mem::take(&mut self.recent).into_iter().collect();
        added.sort_unstable_by_key(|(id, _)| id.0);
        // Grow by exactly what is added, then merge from the back: the
        // sorted blobs move up into the new room as the added ones fill
        // the gaps, and none is overwritten before it has moved.
        let kept = self.sorted.len();
        self.sorted.reserve_exact(added.len());
        self.sorted.extend_from_slice(&added);
        let (mut from_kept, mut from_added) = (kept, added.len());
        for to in (0..self.sorted.len()).rev() {
            if from_added == 0 {
                break;
            }
            if from_kept > 0 && self.sorted[from_kept - 1].0.0 > added[from_added - 1].0.0 {
                self.sorted[to] = self.sorted[from_kept - 1];
                from_kept -= 1;
            } else {
                self.sorted[to] = added[from_added - 1];
                from_added -= 1;
            }
        }
        self.index_prefixes();
    }

    /// Rebuild the table of where each prefix starts in `sorted`.
    fn index_prefixes(&mut self) {
        let blobs = self.sorted.len();
        self.prefix_starts = Vec::new();
        self.prefix_bits = blobs
            .checked_ilog2()
            .unwrap_or(0)
            .saturating_sub(BLOBS_PER_PREFIX_BITS)
            .min(MAX_PREFIX_BITS);
        let Ok(end) = u32::try_from(blobs) else {
            // Past 4 Gi blobs (hundreds of GiB of table) every lookup
            // searches the whole vector.
            self.prefix_bits = 0;
            return;
        };
        if self.prefix_bits == 0 {
            return;
        }
        let prefixes = 1usize << self.prefix_bits;
        let mut starts = Vec::with_capacity(prefixes + 1);
        let mut at = 0;
        for prefix in 0..prefixes {
            while at < blobs && id_prefix(&self.sorted[at].0, self.prefix_bits) < prefix {
                at += 1;
            }
            // `at` is at most `blobs`, which fits.
            starts.push(at as u32);
        }
        starts.push(end);
        self.prefix_starts = starts;
    }

    /// Where `id` is in `sorted`, if there.
    fn sorted_position(&self, id: &BlobId) -> Option<usize> {
        let (start, end) = if self.prefix_starts.is_empty() {
            (0, self.sorted.len())
        } else {
            let prefix = id_prefix(id, self.prefix_bits);
            (
                self.prefix_starts[prefix] as usize,
                self.prefix_starts[prefix + 1] as usize,
            )
        };
        self.sorted[start..end]
            .binary_search_by(|(held, _)| held.0.cmp(&id.0))
            .ok()
            .map(|at| start + at)
    }

    /// Number of blobs held.
    pub fn len(&self) -> usize {
        self.sorted.len() + self.recent.len()
    }

    /// True when no blob is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the table holds, about: the sorted blobs, the prefix
    /// table, and the blobs waiting for a merge with their map's empty
    /// buckets.
    pub fn memory_bytes(&self) -> usize {
        // A hash map's bucket: the entry and one control byte.
        self.sorted.capacity() * size_of::<(BlobId, V)>()
            + self.prefix_starts.capacity() * size_of::<u32>()
            + self.recent.capacity() * (size_of::<(BlobId, V)>() + 1)
    }

    /// True when every blob is in the sorted vector, which has no spare
    /// capacity, and the prefix table is in use when there are enough.
    #[cfg(test)]
    pub(crate) fn is_compact(&self) -> bool {
        self.recent.is_empty()
            && self.sorted.capacity() == self.sorted.len()
            && (self.sorted.len() < 8 || self.prefix_bits > 0)
            && self.sorted.windows(2).all(|pair| pair[0].0.0 < pair[1].0.0)
    }
}

/// Blob ids, each held once, in 32 bytes a blob ([`BlobTable`]).
#[derive(Debug, Clone, Default)]
pub struct BlobSet(BlobTable<()>);

impl BlobSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `id`; true if it was not in the set.
    pub fn insert(&mut self, id: BlobId) -> bool {
        self.0.insert_or_get(id, ()).is_none()
    }

    /// True when `id` is in the set.
    pub fn contains(&self, id: &BlobId) -> bool {
        self.0.get(id).is_some()
    }

    /// Number of ids held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes the set holds, about.
    pub fn memory_bytes(&self) -> usize {
        self.0.memory_bytes()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Blob `k`: ids spread over every prefix, so lookups go through the
    /// prefix table once enough are sorted.
    fn spread_id(k: u32) -> BlobId {
        let mut id = [0u8; 32];
        id[..8].copy_from_slice(&(u64::from(k).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_be_bytes());
        id[28..].copy_from_slice(&k.to_le_bytes());
        BlobId(id)
    }

    proptest::proptest! {
        /// Whatever is inserted, and wherever merges happen, the table
        /// answers what a hash map answers, and keeps the first value of
        /// each blob unless the caller changes it.
        #[test]
        fn a_table_answers_what_a_map_answers(
            steps in proptest::collection::vec(
                (proptest::collection::vec(0u32..3000, 0..500), proptest::bool::weighted(0.3)),
                1..20,
            ),
        ) {
            let mut table = BlobTable::new();
            let mut map: HashMap<BlobId, u32> = HashMap::new();
            for (number, (ids, compact_after)) in steps.iter().enumerate() {
                for k in ids {
                    let id = spread_id(*k);
                    let value = number as u32 * 10_000 + k;
                    let held = table.insert_or_get(id, value).copied();
                    proptest::prop_assert_eq!(held, map.get(&id).copied());
                    map.entry(id).or_insert(value);
                }
                if *compact_after {
                    table.compact();
                    proptest::prop_assert!(table.is_compact());
                }
                proptest::prop_assert_eq!(table.len(), map.len());
            }
            for k in 0..3000 {
                let id = spread_id(k);
                proptest::prop_assert_eq!(table.get(&id).copied(), map.get(&id).copied(), "blob {}", k);
            }
        }
    }

    #[test]
    fn a_set_grown_past_its_merges_holds_every_id_once_in_32_bytes() {
        let mut set = BlobSet::new();
        let mut model = HashSet::new();
        for k in 0..100_000u32 {
            // The last 20,000 come again, after merges.
            let id = spread_id(k % 80_000);
            assert_eq!(set.insert(id), model.insert(id), "id {k}");
        }
        assert!(!set.0.sorted.is_empty(), "merged while growing");
        assert!(set.0.recent.len() < model.len() / 4);
        set.0.compact();
        assert!(set.0.is_compact());
        assert_eq!(set.len(), model.len());
        assert!(model.iter().all(|id| set.contains(id)));
        assert!(!set.contains(&spread_id(200_000)));
        assert_eq!(size_of::<(BlobId, ())>(), 32);
        // The ids and a prefix table of at most a byte an id.
        assert!(
            set.memory_bytes() <= 33 * set.len(),
            "{}",
            set.memory_bytes()
        );
    }
}
