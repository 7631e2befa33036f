//! What prune does to each pack: a pure function of the packs, the blobs
//! the snapshots reference, the packs already waiting for deletion, and the
//! time.
//!
//! Deletion is two-phase (as kopia's blob GC): a pack that nothing needs
//! is first *marked* (recorded in `maintenance/deletion-candidates` with the
//! time), and deleted only by a prune that runs at least the safety margin
//! later and finds it still not needed. While marked, backups do not
//! deduplicate against it (they store its blobs again), so a backup that
//! starts after the mark never comes to depend on it; the margin covers
//! backups that started before the mark without holding a lock.
//!
//! A pack is *needed* when it holds the copy chosen to keep (the *keeper*)
//! of a referenced blob. Keepers are chosen among packs not marked, the
//! pack whose bytes are most used first; a marked pack holding the only
//! copy of a referenced blob is unmarked (a snapshot came to use it).
//! Packs that hold no keeper are marked; packs whose unused share of blob
//! bytes is above the threshold are repacked (their keepers copied into new packs) and
//! then marked.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::pack::PackEntry;
use super::policy::parse_snapshot_time;
use super::snapshot::Snapshot;
use super::{BlobId, ObjectId};

/// Where prune keeps its record of packs waiting for deletion.
pub const DELETION_CANDIDATES_KEY: &str = "maintenance/deletion-candidates";

/// Why a pack was marked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MarkReason {
    /// No snapshot references any of its blobs.
    Unreferenced,
    /// Its referenced blobs were copied into new packs.
    Repacked,
}

/// A pack waiting for deletion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Candidate {
    /// The pack.
    pub pack: ObjectId,
    /// When a prune first found it not needed (seconds since the epoch).
    pub since_seconds: i64,
    /// Why.
    pub reason: MarkReason,
}

/// The `maintenance/deletion-candidates` record (JSON; sealed in format 2).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeletionCandidates {
    /// The packs, in pack id order.
    pub candidates: Vec<Candidate>,
}

impl DeletionCandidates {
    /// Serialize.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("candidates serialize")
    }

    /// Parse.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|error| error.to_string())
    }
}

/// One pack as prune sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackFacts {
    /// The pack.
    pub id: ObjectId,
    /// Its size in the store.
    pub size: u64,
    /// Its blobs.
    pub entries: Vec<PackEntry>,
}

/// Prune's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PruneSettings {
    /// A pack whose unused share of bytes is above this fraction (0..1) is
    /// repacked.
    pub repack_threshold: f64,
    /// A marked pack is deleted only this many seconds after its mark.
    pub safety_margin_seconds: i64,
    /// A checkpoint of an unfinished backup written at most this many
    /// seconds ago is kept with every blob it names, so the backup can
    /// still continue from it; an older one is deleted (its backup is not
    /// coming back) and its blobs are left to the marking.
    pub checkpoint_max_age_seconds: i64,
}

/// When a checkpoint was written (seconds since the epoch): its backup's
/// start plus the wall time it records; `None` when its time cannot be
/// read.
pub fn checkpoint_written_seconds(checkpoint: &Snapshot) -> Option<i64> {
    let (started, _) = parse_snapshot_time(&checkpoint.time)?;
    let ran = checkpoint.summary.duration_seconds;
    let ran = if ran.is_finite() && ran > 0.0 {
        ran.min(i64::MAX as f64) as i64
    } else {
        0
    };
    Some(started.saturating_add(ran))
}

/// Whether prune keeps `checkpoint` at `now` (and every blob it names)
/// rather than deleting it: written within the settings' maximum age. One
/// whose time cannot be read is not kept.
pub fn checkpoint_kept(checkpoint: &Snapshot, now: i64, settings: PruneSettings) -> bool {
    checkpoint_written_seconds(checkpoint)
        .is_some_and(|written| now.saturating_sub(written) <= settings.checkpoint_max_age_seconds)
}

/// The index files past what a rewrite needs from which prune gathers them
/// ([`index_worth_gathering`]).
pub const EXTRA_INDEX_FILES_GATHERED: usize = 32;

/// Whether prune gathers `existing` index files into the `needed` a
/// rewrite would write ([`crate::index::index_files_needed`]): when there
/// are more than twice as many and more than
/// [`EXTRA_INDEX_FILES_GATHERED`] too many. Every backup writes index
/// files of its own, so a location that hundreds of claims back up into
/// holds hundreds, and every backup, restore and prune reads all of them
/// before it starts (one GET each); rewriting them costs one upload of the
/// whole index, so a few files too many are left.
pub fn index_worth_gathering(existing: usize, needed: usize) -> bool {
    existing > 2 * needed && existing - needed > EXTRA_INDEX_FILES_GATHERED
}

/// What prune found and did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PruneReport {
    /// Only planned.
    pub dry_run: bool,
    /// Snapshots whose data was kept.
    pub snapshots: usize,
    /// Checkpoints of unfinished backups kept with their data (written
    /// within the maximum age).
    pub checkpoints_kept: usize,
    /// Older checkpoints deleted (or, dry run, to delete).
    pub checkpoints_deleted: usize,
    /// Checkpoints that cannot be read: left as they are, their data not
    /// kept (a backup ignores them too).
    pub checkpoints_unreadable: usize,
    /// Packs in the store before.
    pub packs: usize,
    /// Their bytes.
    pub total_bytes: u64,
    /// Bytes of the blobs the snapshots and kept checkpoints reference.
    pub used_bytes: u64,
    /// Packs rewritten (or, dry run, to rewrite).
    pub repacked_packs: usize,
    /// Bytes written into new packs by the repack.
    pub repacked_bytes_written: u64,
    /// Packs marked for deletion in this run.
    pub marked_packs: usize,
    /// Their bytes (freed once the safety margin has passed).
    pub marked_bytes: u64,
    /// Marked packs deleted (or, dry run, to delete now).
    pub deleted_packs: usize,
    /// Bytes freed.
    pub deleted_bytes: u64,
    /// Index files replaced.
    pub index_files_replaced: usize,
    /// Index files in the store before.
    pub index_files: usize,
    /// Index files written in their place (or, dry run, to write): when
    /// packs are deleted, or when the index files were gathered into fewer
    /// ([`index_worth_gathering`]).
    pub index_files_written: usize,
    /// Marked packs still within the margin.
    pub waiting_packs: usize,
    /// Their bytes.
    pub waiting_bytes: u64,
    /// Marked packs that snapshots came to need again.
    pub unmarked_packs: usize,
    /// Why the deletion phase did not run, if it did not.
    pub deletion_deferred: Option<String>,
    /// Packs whose blobs could not be read (kept, never deleted).
    pub damaged_packs: Vec<String>,
    /// Incomplete uploads (S3 multipart uploads, temporary files) older
    /// than the safety margin and than an hour whatever the margin, left
    /// by writers that died or were stopped
    /// while the store was away, removed (not looked for in a dry run).
    pub abandoned_uploads_removed: usize,
    /// Why they could not be looked for, if they could not (the prune
    /// itself goes on: a store may refuse to list its uploads).
    pub abandoned_uploads_problem: Option<String>,
}

/// A pack to rewrite: copy these blobs (its keepers) out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repack {
    /// The pack read.
    pub pack: ObjectId,
    /// Its size.
    pub size: u64,
    /// The blobs copied into new packs.
    pub keep: Vec<PackEntry>,
}

/// What prune does.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrunePlan {
    /// Packs to rewrite before they are marked.
    pub repack: Vec<Repack>,
    /// Packs not needed, marked now.
    pub mark: Vec<Candidate>,
    /// Marked packs needed again: their mark is dropped.
    pub unmark: Vec<ObjectId>,
    /// Marked packs past the margin and still not needed: deleted now.
    pub delete: Vec<(ObjectId, u64)>,
    /// Marked packs within the margin: still waiting.
    pub waiting: Vec<Candidate>,
    /// Referenced blobs no pack holds: prune must not delete anything.
    pub missing: Vec<BlobId>,
    /// Bytes of all packs.
    pub total_bytes: u64,
    /// Bytes of referenced blobs (their keepers).
    pub used_bytes: u64,
}

impl PrunePlan {
    /// Bytes freed by the deletions of this run.
    pub fn deleted_bytes(&self) -> u64 {
        self.delete.iter().map(|(_, size)| *size).sum()
    }

    /// Bytes of packs marked in this run (freed once the margin has passed).
    pub fn marked_bytes(&self, sizes: &HashMap<ObjectId, u64>) -> u64 {
        self.mark
            .iter()
            .map(|candidate| sizes.get(&candidate.pack).copied().unwrap_or(0))
            .sum()
    }

    /// The record of candidates after this run: the waiting ones, plus
    /// those marked now; deleted and unmarked ones are gone.
    pub fn remaining_candidates(&self) -> DeletionCandidates {
        let mut candidates: Vec<_> = self.waiting.iter().chain(&self.mark).copied().collect();
        candidates.sort_by_key(|candidate| candidate.pack);
        candidates.dedup_by_key(|candidate| candidate.pack);
        DeletionCandidates { candidates }
    }
}

/// Decide what prune does. `packs` are the packs in the store with their
/// blobs; `referenced` every blob some snapshot needs; `candidates` the
/// current record; `now` the time.
pub fn plan_prune(
    packs: &[PackFacts],
    referenced: &HashSet<BlobId>,
    candidates: &[Candidate],
    now: i64,
    settings: PruneSettings,
) -> PrunePlan {
    let mut plan = PrunePlan::default();
    let marked: HashMap<ObjectId, Candidate> = candidates
        .iter()
        .map(|candidate| (candidate.pack, *candidate))
        .collect();
    // Gross use: referenced bytes in each pack, duplicates counted in each.
    let gross: Vec<f64> = packs
        .iter()
        .map(|pack| {
            let used: u64 = pack
                .entries
                .iter()
                .filter(|entry| referenced.contains(&entry.id))
                .map(|entry| u64::from(entry.stored_length))
                .sum();
            used as f64 / pack.size.max(1) as f64
        })
        .collect();
    let mut leaving: Vec<bool> = packs
        .iter()
        .map(|pack| marked.contains_key(&pack.id))
        .collect();
    let better = |a: usize, b: usize, leaving: &[bool]| -> bool {
        // Is pack a a better keeper than pack b?
        (!leaving[a], gross[a], std::cmp::Reverse(packs[a].id))
            > (!leaving[b], gross[b], std::cmp::Reverse(packs[b].id))
    };
    // First pass: the best holder of each referenced blob; a marked pack
    // that is the best holder of some blob is needed again.
    let mut keeper: HashMap<BlobId, usize> = HashMap::with_capacity(referenced.len());
    for (position, pack) in packs.iter().enumerate() {
        for entry in &pack.entries {
            if !referenced.contains(&entry.id) {
                continue;
            }
            keeper
                .entry(entry.id)
                .and_modify(|current| {
                    if better(position, *current, &leaving) {
                        *current = position;
                    }
                })
                .or_insert(position);
        }
    }
    for position in keeper.values() {
        if leaving[*position] {
            leaving[*position] = false;
            plan.unmark.push(packs[*position].id);
        }
    }
    plan.unmark.sort();
    plan.unmark.dedup();
    if !plan.unmark.is_empty() {
        // Unmarked packs may now be better keepers for other blobs.
        for (position, pack) in packs.iter().enumerate() {
            if leaving[position] {
                continue;
            }
            for entry in &pack.entries {
                if let Some(current) = keeper.get_mut(&entry.id)
                    && better(position, *current, &leaving)
                {
                    *current = position;
                }
            }
        }
    }
    plan.missing = referenced
        .iter()
        .filter(|blob| !keeper.contains_key(blob))
        .copied()
        .collect();
    plan.missing.sort();

    for (position, pack) in packs.iter().enumerate() {
        plan.total_bytes += pack.size;
        let keep: Vec<PackEntry> = pack
            .entries
            .iter()
            .filter(|entry| keeper.get(&entry.id) == Some(&position))
            .copied()
            .collect();
        let used: u64 = keep
            .iter()
            .map(|entry| u64::from(entry.stored_length))
            .sum();
        plan.used_bytes += used;
        if leaving[position] {
            let candidate = marked[&pack.id];
            if now - candidate.since_seconds >= settings.safety_margin_seconds {
                plan.delete.push((pack.id, pack.size));
            } else {
                plan.waiting.push(candidate);
            }
            continue;
        }
        if keep.is_empty() {
            plan.mark.push(Candidate {
                pack: pack.id,
                since_seconds: now,
                reason: MarkReason::Unreferenced,
            });
            continue;
        }
        // The share of blob bytes not needed (the trailer does not count,
        // so a repacked pack, fully used, is never repacked again).
        let blob_bytes: u64 = pack
            .entries
            .iter()
            .map(|entry| u64::from(entry.stored_length))
            .sum();
        let unused = 1.0 - used as f64 / blob_bytes.max(1) as f64;
        if unused > settings.repack_threshold {
            plan.repack.push(Repack {
                pack: pack.id,
                size: pack.size,
                keep,
            });
        }
    }
    if !plan.missing.is_empty() {
        // Something referenced is already gone: delete nothing more.
        plan.waiting
            .extend(plan.delete.drain(..).map(|(pack, _)| marked[&pack]));
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlobKind, Compression};
    use proptest::prelude::*;

    #[test]
    fn index_files_are_gathered_only_when_far_more_than_needed() {
        // A location of one index file's worth of blobs, written by many
        // backups: gathered once 33 files too many.
        assert!(!index_worth_gathering(33, 1));
        assert!(index_worth_gathering(34, 1));
        // A large index: more than twice what it needs, too.
        assert!(!index_worth_gathering(60, 30));
        assert!(index_worth_gathering(63, 30));
        assert!(!index_worth_gathering(0, 0));
        assert!(!index_worth_gathering(1, 1));
    }

    fn entry(blob: u8, offset: u32) -> PackEntry {
        PackEntry {
            id: BlobId([blob; 32]),
            kind: BlobKind::Data,
            compression: Compression::None,
            offset,
            stored_length: 100,
            raw_length: 100,
        }
    }

    fn pack(id: u8, blobs: &[u8]) -> PackFacts {
        PackFacts {
            id: ObjectId([id; 32]),
            size: 100 * blobs.len() as u64 + 60,
            entries: blobs
                .iter()
                .enumerate()
                .map(|(i, blob)| entry(*blob, 8 + 100 * i as u32))
                .collect(),
        }
    }

    const SETTINGS: PruneSettings = PruneSettings {
        repack_threshold: 0.2,
        safety_margin_seconds: 3600,
        checkpoint_max_age_seconds: 7 * 86_400,
    };

    /// A checkpoint of a backup started at `time` that had run `ran`
    /// seconds when written.
    fn checkpoint_at(time: &str, ran: f64) -> Snapshot {
        Snapshot {
            format_version: 1,
            time: time.to_string(),
            hostname: "node-a".into(),
            source: "ns/data".into(),
            tree: BlobId([1; 32]),
            root: Default::default(),
            parent: None,
            tags: Default::default(),
            claim: None,
            summary: crate::snapshot::SnapshotSummary {
                duration_seconds: ran,
                ..Default::default()
            },
        }
    }

    #[test]
    fn a_checkpoint_is_kept_for_its_maximum_age_from_when_it_was_written() {
        // 2026-12-01T00:00:00Z
        let start = 1_796_083_200;
        let week = 7 * 86_400;
        let fresh = checkpoint_at("2026-12-01T00:00:00Z", 0.0);
        assert_eq!(checkpoint_written_seconds(&fresh), Some(start));
        assert!(checkpoint_kept(&fresh, start + week, SETTINGS));
        assert!(!checkpoint_kept(&fresh, start + week + 1, SETTINGS));
        // A backup that ran ten days wrote its last checkpoint at its end:
        // counted from there, not from the start.
        let long = checkpoint_at("2026-12-01T00:00:00.25Z", 10.0 * 86_400.0);
        assert!(checkpoint_kept(&long, start + 10 * 86_400 + week, SETTINGS));
        assert!(!checkpoint_kept(
            &long,
            start + 10 * 86_400 + week + 1,
            SETTINGS
        ));
        // A time that cannot be read is not kept; a maximum age of 0 keeps
        // only a checkpoint written this second.
        assert!(!checkpoint_kept(
            &checkpoint_at("yesterday", 0.0),
            start,
            SETTINGS
        ));
        let none = PruneSettings {
            checkpoint_max_age_seconds: 0,
            ..SETTINGS
        };
        assert!(checkpoint_kept(&fresh, start, none));
        assert!(!checkpoint_kept(&fresh, start + 1, none));
    }

    fn refs(blobs: &[u8]) -> HashSet<BlobId> {
        blobs.iter().map(|blob| BlobId([*blob; 32])).collect()
    }

    #[test]
    fn an_unused_pack_is_marked_first_and_deleted_only_after_the_margin() {
        let packs = vec![pack(1, &[1, 2]), pack(2, &[3])];
        let plan = plan_prune(&packs, &refs(&[1, 2]), &[], 1000, SETTINGS);
        assert!(plan.delete.is_empty());
        assert_eq!(plan.mark.len(), 1);
        assert_eq!(plan.mark[0].pack, ObjectId([2; 32]));
        let marked = plan.remaining_candidates().candidates;
        let early = plan_prune(&packs, &refs(&[1, 2]), &marked, 1000 + 3599, SETTINGS);
        assert!(early.delete.is_empty());
        assert_eq!(early.waiting, marked);
        let late = plan_prune(&packs, &refs(&[1, 2]), &marked, 1000 + 3600, SETTINGS);
        assert_eq!(late.delete, vec![(ObjectId([2; 32]), 160)]);
        assert!(late.remaining_candidates().candidates.is_empty());
    }

    #[test]
    fn a_marked_pack_that_a_snapshot_came_to_use_is_unmarked() {
        let packs = vec![pack(1, &[1]), pack(2, &[3])];
        let marked = vec![Candidate {
            pack: ObjectId([2; 32]),
            since_seconds: 0,
            reason: MarkReason::Unreferenced,
        }];
        let plan = plan_prune(&packs, &refs(&[1, 3]), &marked, 10_000, SETTINGS);
        assert_eq!(plan.unmark, vec![ObjectId([2; 32])]);
        assert!(plan.delete.is_empty());
        assert!(plan.remaining_candidates().candidates.is_empty());
    }

    #[test]
    fn a_mostly_unused_pack_is_repacked_and_its_copy_is_preferred_afterwards() {
        let packs = vec![pack(1, &[1, 2, 3, 4])];
        let plan = plan_prune(&packs, &refs(&[1]), &[], 0, SETTINGS);
        assert_eq!(plan.repack.len(), 1);
        assert_eq!(plan.repack[0].keep, vec![entry(1, 8)]);
        // After the copy (pack 9) and the mark, the old pack goes.
        let packs = vec![pack(1, &[1, 2, 3, 4]), pack(9, &[1])];
        let marked = vec![Candidate {
            pack: ObjectId([1; 32]),
            since_seconds: 0,
            reason: MarkReason::Repacked,
        }];
        let plan = plan_prune(&packs, &refs(&[1]), &marked, 3600, SETTINGS);
        assert_eq!(plan.delete, vec![(ObjectId([1; 32]), 460)]);
        assert!(plan.repack.is_empty() && plan.mark.is_empty());
        // A crash before the mark: the fully used copy is the keeper, the
        // old pack is marked rather than repacked again.
        let plan = plan_prune(&packs, &refs(&[1]), &[], 0, SETTINGS);
        assert!(plan.repack.is_empty());
        assert_eq!(plan.mark[0].pack, ObjectId([1; 32]));
    }

    #[test]
    fn nothing_is_deleted_when_a_referenced_blob_is_missing() {
        let packs = vec![pack(1, &[1]), pack(2, &[2])];
        let marked = vec![Candidate {
            pack: ObjectId([2; 32]),
            since_seconds: 0,
            reason: MarkReason::Unreferenced,
        }];
        let plan = plan_prune(&packs, &refs(&[1, 7]), &marked, 10_000, SETTINGS);
        assert_eq!(plan.missing, vec![BlobId([7; 32])]);
        assert!(plan.delete.is_empty());
    }

    fn arbitrary_repository()
    -> impl Strategy<Value = (Vec<PackFacts>, HashSet<BlobId>, Vec<Candidate>, i64)> {
        (
            proptest::collection::vec(proptest::collection::vec(0u8..30, 1..6), 1..12),
            proptest::collection::hash_set(0u8..30, 0..20),
            proptest::collection::vec((0usize..12, 0i64..5000), 0..6),
            0i64..10_000,
        )
            .prop_map(|(pack_blobs, referenced, marks, now)| {
                let packs: Vec<_> = pack_blobs
                    .iter()
                    .enumerate()
                    .map(|(i, blobs)| pack(i as u8, blobs))
                    .collect();
                let candidates: Vec<_> = marks
                    .into_iter()
                    .filter(|(i, _)| *i < packs.len())
                    .map(|(i, since)| {
                        (
                            packs[i].id,
                            Candidate {
                                pack: packs[i].id,
                                since_seconds: since,
                                reason: MarkReason::Unreferenced,
                            },
                        )
                    })
                    .collect::<HashMap<_, _>>()
                    .into_values()
                    .collect();
                let referenced = referenced.into_iter().map(|b| BlobId([b; 32])).collect();
                (packs, referenced, candidates, now)
            })
    }

    proptest! {
        #[test]
        fn no_referenced_blob_loses_its_last_copy_and_only_old_marks_are_deleted(
            (packs, referenced, candidates, now) in arbitrary_repository(),
        ) {
            let plan = plan_prune(&packs, &referenced, &candidates, now, SETTINGS);
            let deleted: HashSet<ObjectId> = plan.delete.iter().map(|(id, _)| *id).collect();
            let leaving: HashSet<ObjectId> = plan
                .remaining_candidates()
                .candidates
                .iter()
                .map(|c| c.pack)
                .chain(deleted.iter().copied())
                .collect();
            let repacked: HashSet<BlobId> = plan
                .repack
                .iter()
                .flat_map(|r| r.keep.iter().map(|e| e.id))
                .collect();
            // Every referenced blob stored anywhere keeps a copy in a pack
            // that is neither deleted nor waiting for deletion (or is
            // copied by a repack first).
            for blob in &referenced {
                let stored = packs.iter().any(|p| p.entries.iter().any(|e| e.id == *blob));
                if !stored {
                    prop_assert!(plan.missing.contains(blob));
                    prop_assert!(plan.delete.is_empty());
                    continue;
                }
                let kept = packs.iter().any(|p| {
                    !leaving.contains(&p.id) && p.entries.iter().any(|e| e.id == *blob)
                });
                prop_assert!(kept || repacked.contains(blob), "blob {blob:?} lost");
            }
            // Only packs marked at least the margin ago are deleted.
            for (pack, _) in &plan.delete {
                let mark = candidates.iter().find(|c| c.pack == *pack);
                prop_assert!(mark.is_some_and(|m| now - m.since_seconds >= SETTINGS.safety_margin_seconds));
            }
            // A pack marked now is not deleted in the same decision.
            for mark in &plan.mark {
                prop_assert!(!deleted.contains(&mark.pack));
            }
        }
    }
}
