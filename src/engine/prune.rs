//! Prune: reclaim the space of packs no snapshot needs, safely beside
//! backups running elsewhere. The decisions are
//! [`crate::repo::prune::plan_prune`]; this module gathers the facts and
//! carries the plan out, in an order where an interruption at any point
//! leaves every referenced blob readable and a re-run finishes the work
//! (docs/storage.md, "Prune").
//!
//! 1. Under a shared lock (backups go on): list packs and index files,
//!    walk every snapshot's trees, and those of the checkpoints of
//!    unfinished backups written within the maximum age, to find the
//!    referenced blobs, plan; delete the older checkpoints.
//!    Repack: copy the needed blobs of mostly unused packs into new packs
//!    (sealed bytes are copied as they are: a blob's seal is bound to its
//!    id, not its pack), write their index, then record the old packs and
//!    the unused ones as deletion candidates.
//! 2. Under an exclusive lock (no lock-holding backup runs): gather and
//!    plan again, reading only what was written since the first phase
//!    listed (index files, packs no index names, snapshots and the trees
//!    they reach; what the first phase read cannot have changed under its
//!    id, and what it found reachable stays so, or was forgotten and is
//!    kept one prune longer); delete only candidates marked at least the
//!    safety margin ago that are still not needed: first write index files
//!    for every pack that stays, then delete the old index files, then the
//!    packs, then update the candidates record. The index files are
//!    rewritten the same way, deleting nothing, when there are far more of
//!    them than the index needs (every backup writes its own:
//!    [`crate::repo::prune::index_worth_gathering`]).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::lock::{RepositoryLock, list_locks, unix_now};
use super::repository::LOAD_CONCURRENCY;
use super::{EngineError, Repository, run_blocking};
use crate::repo::index::{BlobIndex, BlobIndexBuilder};
use crate::repo::lock::LockKind;
use crate::repo::pack::PackEntry;
pub use crate::repo::prune::PruneReport;
use crate::repo::prune::{
    Candidate, MarkReason, PackFacts, PrunePlan, PruneSettings, checkpoint_kept,
    index_worth_gathering, plan_prune,
};
use crate::repo::tree::{EntryKind, Extent};
use crate::repo::{self, BlobId, DATA_PREFIX, INDEX_PREFIX, ObjectId};

/// Packs read at once while finding what snapshots reference: every
/// backup stores its trees in a pack of its own, so the trees of a batch lie
/// in as many packs as it has snapshots (at most 4 MiB a read,
/// `MAX_TREE_READ_BYTES`: 32 MiB at most in flight).
const TREE_PACKS_READ_AT_ONCE: usize = 8;
/// Tree blobs fetched per batch while finding what snapshots reference.
const TREES_PER_BATCH: usize = 256;
/// The lock purpose prune records, and looks for to refuse a second prune.
pub const PRUNE_PURPOSE: &str = "prune";

/// The youngest incomplete upload a prune aborts, however short its
/// safety margin: a margin of 0 deletes marked packs at once, but a live
/// writer's upload in flight (a lock being written, a pack going up as a
/// multipart upload at a throttled rate) must never be taken from it.
pub const ABANDONED_UPLOAD_MIN_AGE: Duration = Duration::from_secs(3600);

/// How prune runs.
#[derive(Debug, Clone)]
pub struct PruneOptions {
    /// Threshold and margin.
    pub settings: PruneSettings,
    /// Plan and report only.
    pub dry_run: bool,
    /// How long to wait for the exclusive lock (backups to finish).
    pub lock_wait: Duration,
}

/// Everything in the store prune decides on.
#[derive(Debug, Default)]
struct Inventory {
    packs: Vec<PackFacts>,
    index_files: Vec<ObjectId>,
    damaged_packs: Vec<String>,
}

impl Inventory {
    fn blob_index(&self, candidates: &[Candidate]) -> BlobIndex {
        let leaving: HashSet<ObjectId> = candidates.iter().map(|c| c.pack).collect();
        let mut index = BlobIndexBuilder::new();
        for pack in &self.packs {
            index.add_pack(pack.id, &pack.entries, leaving.contains(&pack.id));
        }
        index.finish()
    }

    /// Index files a rewrite of the packs but `leaving` writes.
    fn index_files_needed(&self, leaving: &HashSet<ObjectId>) -> usize {
        repo::index::index_files_needed(
            self.packs
                .iter()
                .filter(|pack| !leaving.contains(&pack.id))
                .map(|pack| pack.entries.len()),
        )
    }

    fn sizes(&self) -> HashMap<ObjectId, u64> {
        self.packs.iter().map(|pack| (pack.id, pack.size)).collect()
    }
}

/// List the index files and packs and learn every pack's blobs. With
/// `before` (the first phase's inventory), the index files it read are not
/// read again and the packs it knew keep the blobs it found (an index
/// file's or a pack's content never changes under its id): only what was
/// written since is read.
async fn take_inventory(
    repository: &Repository,
    before: Option<Inventory>,
) -> Result<Inventory, EngineError> {
    let store = repository.store();
    let mut inventory = Inventory::default();
    let mut known: HashMap<ObjectId, Vec<PackEntry>> = HashMap::new();
    let (read_before, mut packs_before): (HashSet<ObjectId>, HashMap<ObjectId, Vec<PackEntry>>) =
        match before {
            Some(before) => (
                before.index_files.into_iter().collect(),
                before
                    .packs
                    .into_iter()
                    .map(|pack| (pack.id, pack.entries))
                    .collect(),
            ),
            None => Default::default(),
        };
    let index_objects = store
        .list(INDEX_PREFIX)
        .await
        .map_err(|error| EngineError::store("list index files", error))?;
    let ids: Vec<(ObjectId, String)> = index_objects
        .into_iter()
        .filter_map(|meta| Some((repo::id_from_key(&meta.key, INDEX_PREFIX)?, meta.key)))
        .collect();
    inventory.index_files = ids.iter().map(|(id, _)| *id).collect();
    let ids: Vec<(ObjectId, String)> = ids
        .into_iter()
        .filter(|(id, _)| !read_before.contains(id))
        .collect();
    // Read a few at once (a location of many backups holds hundreds of
    // small index files), decoded in the order listed.
    let mut reads = futures::stream::iter(ids)
        .map(|(id, key)| async move {
            match store.get(&key, None).await {
                Ok(bytes) => Ok(Some((id, bytes))),
                Err(error) if error.is_not_found() => Ok(None),
                Err(error) => Err(EngineError::store(format!("read index file {id}"), error)),
            }
        })
        .buffered(LOAD_CONCURRENCY);
    while let Some(read) = reads.next().await {
        let Some((id, bytes)) = read? else {
            continue;
        };
        if ObjectId::of(&bytes) != id {
            continue;
        }
        let codec = repository.codec().clone();
        if let Ok(file) = run_blocking(move || codec.decode_index(&bytes, &id.to_hex())).await {
            for (pack, entries) in file.packs {
                known.entry(pack).or_insert(entries);
            }
        }
    }
    let packs = store
        .list(DATA_PREFIX)
        .await
        .map_err(|error| EngineError::store("list packs", error))?;
    for meta in packs {
        let Some(id) = repo::id_from_key(&meta.key, DATA_PREFIX) else {
            continue;
        };
        let entries = match known.remove(&id).or_else(|| packs_before.remove(&id)) {
            Some(entries) => entries,
            None => match repository.read_pack_trailer(&id, meta.size).await {
                Ok(entries) => entries,
                Err(EngineError::Store { source, .. }) if source.is_not_found() => continue,
                Err(error) => {
                    inventory.damaged_packs.push(error.to_string());
                    continue;
                }
            },
        };
        inventory.packs.push(PackFacts {
            id,
            size: meta.size,
            entries,
        });
    }
    inventory.packs.sort_by_key(|pack| pack.id);
    Ok(inventory)
}

/// The checkpoints of unfinished backups, as prune judges them.
#[derive(Debug, Default)]
struct CheckpointSurvey {
    /// The root trees of those kept: written within the maximum age.
    kept: Vec<BlobId>,
    /// The key and id of those older, to delete.
    expired: Vec<(String, ObjectId)>,
    /// Those whose manifest is damaged: left as they are.
    unreadable: usize,
}

/// Read every checkpoint and judge it at `now`. A checkpoint that cannot be
/// fetched stops prune (it might be one to keep); one gone since the listing
/// is passed over; a damaged one is left and counted (a backup ignores it
/// too).
async fn survey_checkpoints(
    repository: &Repository,
    settings: PruneSettings,
    now: i64,
) -> Result<CheckpointSurvey, EngineError> {
    let mut survey = CheckpointSurvey::default();
    for stored in repository.all_checkpoints().await? {
        match stored.manifest {
            Ok(manifest) if checkpoint_kept(&manifest, now, settings) => {
                survey.kept.push(manifest.tree);
            }
            Ok(_) => survey.expired.push((stored.key, stored.id)),
            Err(EngineError::SnapshotDamaged { id, reason }) => {
                tracing::warn!(checkpoint = %id, %reason, "checkpoint cannot be read; left as it is, its data not kept");
                survey.unreadable += 1;
            }
            // Replaced since the listing by the newer checkpoint of a
            // running backup (each rotates its own once a minute): that
            // backup's blobs are protected as a running backup's are.
            Err(EngineError::Store { source, .. }) if source.is_not_found() => {}
            Err(error) => return Err(error),
        }
    }
    Ok(survey)
}

/// The snapshots read and the blobs found reachable from them and from
/// the kept checkpoints.
#[derive(Debug, Default)]
struct Reached {
    /// The snapshots whose trees were walked.
    snapshots: HashSet<ObjectId>,
    /// Every blob reachable from them.
    referenced: HashSet<BlobId>,
}

/// Every blob the snapshots and the kept checkpoints (`checkpoint_trees`)
/// reference: their trees and file chunks, and the number of snapshots.
/// Any snapshot or tree of one that cannot be read stops prune (it could
/// not know what that snapshot needs); a checkpoint keeps only what of it
/// is still stored (a backup reads again whatever of a checkpoint is gone).
/// With `before` (the first phase's), only the snapshots written since are
/// read and walked, and the trees already walked are not again; a
/// snapshot forgotten since keeps its blobs until the next prune.
async fn referenced_blobs(
    repository: &Repository,
    index: &BlobIndex,
    checkpoint_trees: &[BlobId],
    before: Option<Reached>,
) -> Result<(usize, Reached), EngineError> {
    let ids = repository.snapshot_ids().await?;
    let Reached {
        snapshots: read_before,
        mut referenced,
    } = before.unwrap_or_default();
    let unread: Vec<ObjectId> = ids
        .iter()
        .filter(|id| !read_before.contains(id))
        .copied()
        .collect();
    let mut roots = Vec::with_capacity(unread.len());
    let mut damaged = None;
    repository
        .each_snapshot_of(unread, |_, result| match result {
            Ok(snapshot) => roots.push(snapshot.tree),
            Err(error) => {
                damaged.get_or_insert(error);
            }
        })
        .await;
    if let Some(error) = damaged {
        return Err(error);
    }
    add_reachable(repository, index, &roots, Reach::Required, &mut referenced).await?;
    add_reachable(
        repository,
        index,
        checkpoint_trees,
        Reach::WhatIsStored,
        &mut referenced,
    )
    .await?;
    Ok((
        ids.len(),
        Reached {
            snapshots: ids.into_iter().collect(),
            referenced,
        },
    ))
}

/// How [`add_reachable`] treats a blob the store no longer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// A snapshot's: an error (its restore needs it).
    Required,
    /// A checkpoint's: passed over.
    WhatIsStored,
}

/// Add to `referenced` every blob reachable from the trees `roots`.
async fn add_reachable(
    repository: &Repository,
    index: &BlobIndex,
    roots: &[BlobId],
    reach: Reach,
    referenced: &mut HashSet<BlobId>,
) -> Result<(), EngineError> {
    let wanted = |blob: &BlobId| reach == Reach::Required || index.get(blob).is_some();
    let mut pending: Vec<BlobId> = Vec::new();
    for root in roots {
        if wanted(root) && referenced.insert(*root) {
            pending.push(*root);
        }
    }
    while !pending.is_empty() {
        let take = pending.len().min(TREES_PER_BATCH);
        let batch: Vec<BlobId> = pending.drain(pending.len() - take..).collect();
        let trees = repository
            .load_trees(index, &batch, None, TREE_PACKS_READ_AT_ONCE)
            .await;
        for (tree, id) in trees.into_iter().zip(&batch) {
            let tree = match (tree, reach) {
                (Ok(tree), _) => tree,
                (Err(error), Reach::Required) => return Err(error),
                (Err(error), Reach::WhatIsStored) => {
                    tracing::warn!(tree = %id, %error, "a checkpoint's tree cannot be read; what is below it is not kept");
                    continue;
                }
            };
            for entry in tree.entries {
                match entry.kind {
                    EntryKind::Directory => {
                        if let Some(subtree) = entry.subtree
                            && wanted(&subtree)
                            && referenced.insert(subtree)
                        {
                            pending.push(subtree);
                        }
                    }
                    EntryKind::File => {
                        for extent in entry.content {
                            if let Extent::Chunk(blob, _) = extent
                                && wanted(&blob)
                            {
                                referenced.insert(blob);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// What prune found, and its plan.
struct Gathered {
    inventory: Inventory,
    reached: Reached,
    snapshots: usize,
    checkpoints: CheckpointSurvey,
    plan: PrunePlan,
    candidates: Vec<Candidate>,
}

/// What the first phase read, which the second does not read again.
struct ReadBefore {
    inventory: Inventory,
    reached: Reached,
}

/// Gather the facts and plan; with `before`, reading only what was
/// written since it.
async fn gather_and_plan(
    repository: &Repository,
    settings: PruneSettings,
    before: Option<ReadBefore>,
) -> Result<Gathered, EngineError> {
    let (inventory_before, reached_before) = match before {
        Some(before) => (Some(before.inventory), Some(before.reached)),
        None => (None, None),
    };
    let inventory = take_inventory(repository, inventory_before).await?;
    let candidates = repository.load_deletion_candidates().await?.candidates;
    let index = inventory.blob_index(&candidates);
    let checkpoints = survey_checkpoints(repository, settings, unix_now()).await?;
    let (snapshots, reached) =
        referenced_blobs(repository, &index, &checkpoints.kept, reached_before).await?;
    let plan = plan_prune(
        &inventory.packs,
        &reached.referenced,
        &candidates,
        unix_now(),
        settings,
    );
    if let Some(first) = plan.missing.first() {
        return Err(EngineError::ReferencedDataMissing {
            count: plan.missing.len(),
            first: *first,
        });
    }
    Ok(Gathered {
        inventory,
        reached,
        snapshots,
        checkpoints,
        plan,
        candidates,
    })
}

/// Run prune.
pub async fn prune(
    repository: &Repository,
    options: &PruneOptions,
    cancel: &CancellationToken,
) -> Result<PruneReport, EngineError> {
    let shared = RepositoryLock::acquire(
        repository,
        LockKind::Shared,
        PRUNE_PURPOSE,
        options.lock_wait,
    )
    .await?;
    let result = first_phase(repository, options, &shared, cancel).await;
    let (mut report, deletion_due, gather, read_before) = match result {
        Ok(outcome) => outcome,
        Err(error) => {
            let _ = shared.release().await;
            return Err(error);
        }
    };
    shared.release().await?;
    if options.dry_run || !(deletion_due || gather) {
        return Ok(report);
    }
    let exclusive = match RepositoryLock::acquire(
        repository,
        LockKind::Exclusive,
        PRUNE_PURPOSE,
        options.lock_wait,
    )
    .await
    {
        Ok(lock) => lock,
        Err(EngineError::Locked { holders, .. }) => {
            let later = match (deletion_due, gather) {
                (true, true) => "the marked packs are deleted, and the index files gathered,",
                (true, false) => "the marked packs are deleted",
                _ => "the index files are gathered",
            };
            report.deletion_deferred = Some(format!(
                "the repository is in use ({holders}); {later} by a later prune"
            ));
            return Ok(report);
        }
        Err(error) => return Err(error),
    };
    let result = second_phase(
        repository,
        options,
        &exclusive,
        &mut report,
        read_before,
        cancel,
    )
    .await;
    let released = exclusive.release().await;
    result?;
    released?;
    Ok(report)
}

/// Plan, repack and mark. Returns the report, whether a deletion phase
/// has packs to delete, whether it is to gather the index files, and what
/// this phase read.
async fn first_phase(
    repository: &Repository,
    options: &PruneOptions,
    lock: &RepositoryLock,
    cancel: &CancellationToken,
) -> Result<(PruneReport, bool, bool, ReadBefore), EngineError> {
    let others = list_locks(repository).await?;
    if let Some(other) = others.iter().find(|other| {
        other.key != lock.key()
            && other.is_live()
            && other
                .record
                .as_ref()
                .is_some_and(|record| record.purpose == PRUNE_PURPOSE)
    }) {
        return Err(EngineError::Locked {
            location: repository.store().location(),
            holders: format!("another prune is running: {}", other.description),
        });
    }
    let Gathered {
        inventory,
        reached,
        snapshots,
        checkpoints,
        plan,
        candidates,
    } = gather_and_plan(repository, options.settings, None).await?;
    let sizes = inventory.sizes();
    let mut report = PruneReport {
        dry_run: options.dry_run,
        snapshots,
        checkpoints_kept: checkpoints.kept.len(),
        checkpoints_deleted: checkpoints.expired.len(),
        checkpoints_unreadable: checkpoints.unreadable,
        packs: inventory.packs.len(),
        total_bytes: plan.total_bytes,
        used_bytes: plan.used_bytes,
        repacked_packs: plan.repack.len(),
        repacked_bytes_written: plan
            .repack
            .iter()
            .flat_map(|repack| &repack.keep)
            .map(|entry| u64::from(entry.stored_length))
            .sum(),
        marked_packs: plan.mark.len() + plan.repack.len(),
        marked_bytes: plan.marked_bytes(&sizes)
            + plan.repack.iter().map(|repack| repack.size).sum::<u64>(),
        deleted_packs: plan.delete.len(),
        deleted_bytes: plan.deleted_bytes(),
        waiting_packs: plan.waiting.len(),
        waiting_bytes: plan
            .waiting
            .iter()
            .map(|candidate| sizes.get(&candidate.pack).copied().unwrap_or(0))
            .sum(),
        unmarked_packs: plan.unmark.len(),
        damaged_packs: inventory.damaged_packs.clone(),
        index_files: inventory.index_files.len(),
        ..PruneReport::default()
    };
    // Many small index files (each backup writes its own) are gathered
    // into as few as the index needs, under the exclusive lock, as the
    // deletion phase rewrites them.
    let index_files_needed = inventory.index_files_needed(&HashSet::new());
    let gather = index_worth_gathering(inventory.index_files.len(), index_files_needed);
    if options.dry_run {
        if gather {
            report.index_files_written = index_files_needed;
        }
        if options.settings.safety_margin_seconds <= 0 {
            // This run would delete what it marks, too.
            report.deleted_packs += report.marked_packs;
            report.deleted_bytes += report.marked_bytes;
        }
        return Ok((report, false, false, ReadBefore { inventory, reached }));
    }
    // Uploads a writer began and never finished (a stage pod killed, or
    // stopped while the location was away) cost storage until aborted:
    // those older than the margin a marked pack gets, and than
    // ABANDONED_UPLOAD_MIN_AGE whatever the margin, are nobody's.
    let margin = Duration::from_secs(options.settings.safety_margin_seconds.max(0) as u64);
    let abandoned_after = margin.max(ABANDONED_UPLOAD_MIN_AGE);
    match repository
        .store()
        .sweep_incomplete_uploads(abandoned_after)
        .await
    {
        Ok(swept) => report.abandoned_uploads_removed = swept.removed.len(),
        Err(error) => {
            report.abandoned_uploads_problem = Some(format!(
                "the abandoned incomplete uploads could not be listed or removed ({error}); run `haulage repo sweep` when the store allows it"
            ))
        }
    }
    // The expired checkpoints go first: the plan keeps none of their data,
    // so their packs are marked now and deleted a margin later, and no
    // checkpoint is ever left naming a deleted blob by prune.
    for (key, id) in &checkpoints.expired {
        lock.check()?;
        repository.delete_checkpoint_at(key, id).await?;
    }
    let now = unix_now();
    let repacked = repack(repository, &plan, lock, cancel, &mut report).await?;
    // Waiting and newly marked packs, the packs due for deletion (still
    // candidates until the deletion phase removes them, with their first
    // mark time), and the packs just repacked.
    let previous: HashMap<ObjectId, Candidate> = candidates
        .into_iter()
        .map(|candidate| (candidate.pack, candidate))
        .collect();
    let mut marks = plan.remaining_candidates().candidates;
    marks.extend(plan.delete.iter().map(|(pack, _)| previous[pack]));
    marks.extend(repacked.into_iter().map(|pack| Candidate {
        pack,
        since_seconds: now,
        reason: MarkReason::Repacked,
    }));
    marks.sort_by_key(|candidate| candidate.pack);
    marks.dedup_by_key(|candidate| candidate.pack);
    lock.check()?;
    repository
        .write_deletion_candidates(&crate::repo::prune::DeletionCandidates {
            candidates: marks.clone(),
        })
        .await?;
    let margin = options.settings.safety_margin_seconds;
    let due = marks
        .iter()
        .any(|candidate| unix_now() - candidate.since_seconds >= margin);
    // The counts of the deletion phase replace the first plan's.
    report.deleted_packs = 0;
    report.deleted_bytes = 0;
    Ok((report, due, gather, ReadBefore { inventory, reached }))
}

/// Copy the needed blobs of the packs to repack into new packs and index
/// them. Returns the packs fully copied (to be marked).
async fn repack(
    repository: &Repository,
    plan: &PrunePlan,
    lock: &RepositoryLock,
    cancel: &CancellationToken,
    report: &mut PruneReport,
) -> Result<Vec<ObjectId>, EngineError> {
    let target = repository.config().pack_target_bytes as usize;
    let capacity = target + repository.config().chunker.max_bytes as usize + 64 * 1024;
    let mut writer = repository.pack_writer(capacity);
    let mut written: Vec<(ObjectId, Vec<PackEntry>)> = Vec::new();
    let mut copied = Vec::new();
    report.repacked_bytes_written = 0;
    for job in &plan.repack {
        if cancel.is_cancelled() {
            return Err(EngineError::Cancelled);
        }
        lock.check()?;
        let bytes = repository
            .store()
            .get(&repo::pack_key(&job.pack), None)
            .await
            .map_err(|error| {
                EngineError::store(format!("read pack {} to repack", job.pack), error)
            })?;
        let mut complete = true;
        // The locations of this pack's copies (another pack's copy of a
        // blob may be compressed differently).
        let mut index = BlobIndex::new();
        index.add_pack(job.pack, &job.keep);
        for entry in &job.keep {
            let start = entry.offset as usize;
            let Some(stored) = bytes.get(start..start + entry.stored_length as usize) else {
                complete = false;
                continue;
            };
            let location = index.get(&entry.id).copied();
            let checked = match location {
                Some(location) => repository
                    .decode_blob(&entry.id, &job.pack, &location, stored)
                    .is_ok(),
                None => false,
            };
            if !checked {
                report.damaged_packs.push(format!(
                    "blob {} in pack {} does not decode; pack kept",
                    entry.id, job.pack
                ));
                complete = false;
                continue;
            }
            writer.add(
                entry.id,
                entry.kind,
                entry.compression,
                stored,
                entry.raw_length,
            );
            report.repacked_bytes_written += u64::from(entry.stored_length);
            if writer.len() >= target {
                let full = std::mem::replace(&mut writer, repository.pack_writer(capacity));
                written.push(repository.upload_pack(full, "repacked pack").await?);
            }
        }
        if complete {
            copied.push(job.pack);
        }
    }
    if !writer.is_empty() {
        written.push(repository.upload_pack(writer, "repacked pack").await?);
    }
    if !written.is_empty() {
        repository.write_index(written).await?;
    }
    report.repacked_packs = copied.len();
    Ok(copied)
}

/// Under the exclusive lock: plan again and delete what is due.
async fn second_phase(
    repository: &Repository,
    options: &PruneOptions,
    lock: &RepositoryLock,
    report: &mut PruneReport,
    read_before: ReadBefore,
    cancel: &CancellationToken,
) -> Result<(), EngineError> {
    let Gathered {
        inventory, plan, ..
    } = gather_and_plan(repository, options.settings, Some(read_before)).await?;
    report.unmarked_packs += plan.unmark.len();
    report.waiting_packs = plan.waiting.len();
    let sizes = inventory.sizes();
    report.waiting_bytes = plan
        .waiting
        .iter()
        .map(|candidate| sizes.get(&candidate.pack).copied().unwrap_or(0))
        .sum();
    let deleting: HashSet<ObjectId> = plan.delete.iter().map(|(pack, _)| *pack).collect();
    report.index_files = inventory.index_files.len();
    let gather = index_worth_gathering(
        inventory.index_files.len(),
        inventory.index_files_needed(&deleting),
    );
    if plan.delete.is_empty() && !gather {
        lock.check()?;
        return repository
            .write_deletion_candidates(&plan.remaining_candidates())
            .await;
    }
    // 1. Index files for every pack that stays.
    let staying: Vec<(ObjectId, Vec<PackEntry>)> = inventory
        .packs
        .iter()
        .filter(|pack| !deleting.contains(&pack.id))
        .map(|pack| (pack.id, pack.entries.clone()))
        .collect();
    let mut new_index_files = HashSet::new();
    for group in repo::index::index_file_groups(staying) {
        if cancel.is_cancelled() {
            return Err(EngineError::Cancelled);
        }
        lock.check()?;
        new_index_files.extend(repository.write_index(group).await?);
    }
    report.index_files_written = new_index_files.len();
    // 2. The old index files (those this phase read; one written since by
    // a backup without a lock names only its own packs, which stay).
    let replaced: Vec<ObjectId> = inventory
        .index_files
        .iter()
        .filter(|id| !new_index_files.contains(*id))
        .copied()
        .collect();
    let mut deletions = futures::stream::iter(replaced)
        .map(|id| async move {
            lock.check()?;
            repository
                .store()
                .delete(&repo::index_key(&id))
                .await
                .map_err(|error| EngineError::store(format!("delete index file {id}"), error))
        })
        .buffer_unordered(LOAD_CONCURRENCY);
    while let Some(deleted) = deletions.next().await {
        deleted?;
        report.index_files_replaced += 1;
    }
    // 3. The packs.
    for (pack, size) in &plan.delete {
        if cancel.is_cancelled() {
            return Err(EngineError::Cancelled);
        }
        lock.check()?;
        repository
            .store()
            .delete(&repo::pack_key(pack))
            .await
            .map_err(|error| EngineError::store(format!("delete pack {pack}"), error))?;
        report.deleted_packs += 1;
        report.deleted_bytes += size;
    }
    // 4. The record.
    repository
        .write_deletion_candidates(&plan.remaining_candidates())
        .await
}
