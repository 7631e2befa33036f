//! Verify: re-read everything a snapshot references and check it.
//!
//! Checks the snapshot manifest against its name, every index file against
//! its name, every tree (decodes, names valid), and every pack that holds a
//! referenced blob: the whole pack against its name, and each referenced
//! blob (decompresses to its length, hashes to its id). A problem names the
//! pack, the blob and the files it affects.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use serde::Serialize;

use super::progress::Progress;
use super::repository::Repository;
use super::{EngineError, run_blocking};
use crate::repo::index::BlobIndex;
use crate::repo::tree::{EntryKind, Extent, validate_name};
use crate::repo::{self, BlobId, ObjectId};

/// Packs fetched and checked at once (each is held whole in memory).
const PARALLEL_PACK_CHECKS: usize = 2;
/// Files named per damaged blob.
const MAX_FILES_NAMED: usize = 5;

/// One thing found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyProblem {
    /// The damaged object: `snapshot ID`, `index ID`, `pack ID`, `blob ID in pack ID`.
    pub object: String,
    /// What is wrong.
    pub message: String,
    /// Files (snapshot-relative, prefixed with the short snapshot id) whose
    /// content or listing is affected.
    pub affected_files: Vec<String>,
}

/// What verify checked and found.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyReport {
    /// Snapshots checked.
    pub snapshots: u64,
    /// Tree blobs checked.
    pub trees: u64,
    /// Data blobs checked.
    pub data_blobs: u64,
    /// Packs read whole.
    pub packs: u64,
    /// Packs holding referenced blobs (all of them are read unless a
    /// subset was asked for).
    pub packs_total: u64,
    /// Bytes read from the store.
    pub bytes_read: u64,
    /// Everything found wrong; empty means the snapshots are intact.
    pub problems: Vec<VerifyProblem>,
}

/// Which packs verify reads whole (`--read-data-subset`). Trees are
/// always all checked; the subset chooses the packs whose data blobs are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DataSubset {
    /// Every pack.
    All,
    /// A random share (0..=1) of the packs, at least one.
    Fraction(f64),
    /// Bucket `n` (1-based) of `m`: the packs whose id's first 4 bytes
    /// (big-endian) are `n - 1` modulo `m`. Running 1/m … m/m checks every
    /// pack once.
    Bucket {
        /// Which bucket, 1..=m.
        n: u32,
        /// How many buckets.
        m: u32,
    },
}

impl std::str::FromStr for DataSubset {
    type Err = String;

    /// `5%`, `0.5%`, `N/M`.
    fn from_str(text: &str) -> Result<Self, String> {
        if let Some(percent) = text.strip_suffix('%') {
            let value: f64 = percent
                .trim()
                .parse()
                .map_err(|_| format!("{text:?} is not a percentage like 5%"))?;
            if !(value > 0.0 && value <= 100.0) {
                return Err(format!("{text:?} must be above 0% and at most 100%"));
            }
            return Ok(DataSubset::Fraction(value / 100.0));
        }
        if let Some((n, m)) = text.split_once('/') {
            let (n, m): (u32, u32) = match (n.trim().parse(), m.trim().parse()) {
                (Ok(n), Ok(m)) => (n, m),
                _ => return Err(format!("{text:?} is not N/M with whole numbers")),
            };
            if m == 0 || n == 0 || n > m {
                return Err(format!("{text:?} needs 1 <= N <= M"));
            }
            return Ok(DataSubset::Bucket { n, m });
        }
        Err(format!(
            "{text:?} is neither a percentage (5%) nor N/M (1/20)"
        ))
    }
}

impl DataSubset {
    /// The packs of `packs` to read.
    pub fn select(&self, packs: &[ObjectId]) -> HashSet<ObjectId> {
        match *self {
            DataSubset::All => packs.iter().copied().collect(),
            DataSubset::Fraction(share) => {
                let count = ((packs.len() as f64 * share).ceil() as usize)
                    .clamp(usize::from(!packs.is_empty()), packs.len());
                rand::seq::index::sample(&mut rand::rng(), packs.len(), count)
                    .into_iter()
                    .map(|position| packs[position])
                    .collect()
            }
            DataSubset::Bucket { n, m } => packs
                .iter()
                .filter(|pack| {
                    u32::from_be_bytes(pack.0[..4].try_into().expect("4 bytes")) % m == n - 1
                })
                .copied()
                .collect(),
        }
    }
}

/// Verify one snapshot, or all of them, reading every pack.
pub async fn verify(
    repository: &Repository,
    snapshot: Option<ObjectId>,
    progress: Arc<Progress>,
) -> Result<VerifyReport, EngineError> {
    verify_subset(repository, snapshot, DataSubset::All, progress).await
}

/// Verify one snapshot, or all of them: every tree, and the data blobs of
/// the packs `subset` selects.
pub async fn verify_subset(
    repository: &Repository,
    snapshot: Option<ObjectId>,
    subset: DataSubset,
    progress: Arc<Progress>,
) -> Result<VerifyReport, EngineError> {
    let mut report = VerifyReport::default();
    let ids = match snapshot {
        Some(id) => vec![id],
        None => repository.snapshot_ids().await?,
    };
    let loaded = repository.load_index().await?;
    for message in loaded.damaged_indexes.iter().chain(&loaded.damaged_packs) {
        report.problems.push(VerifyProblem {
            object: "index".into(),
            message: message.clone(),
            affected_files: Vec::new(),
        });
    }
    let index = loaded.index;

    // Which files use which blob.
    let mut users: HashMap<BlobId, Vec<String>> = HashMap::new();
    for id in ids {
        let snapshot = match repository.load_snapshot(&id).await {
            Ok(snapshot) => snapshot,
            Err(error) => {
                report.problems.push(VerifyProblem {
                    object: format!("snapshot {id}"),
                    message: error.to_string(),
                    affected_files: Vec::new(),
                });
                continue;
            }
        };
        report.snapshots += 1;
        let mut stack = vec![(snapshot.tree, format!("{}:", id.short()))];
        while let Some((tree_id, path)) = stack.pop() {
            note_user(&mut users, tree_id, format!("{path}/"));
            report.trees += 1;
            let tree = match repository.load_tree(&index, &tree_id).await {
                Ok(tree) => tree,
                Err(error) => {
                    report.problems.push(problem_for(
                        &index,
                        &tree_id,
                        &error,
                        vec![format!("{path}/")],
                    ));
                    continue;
                }
            };
            for entry in &tree.entries {
                let name = String::from_utf8_lossy(&entry.name);
                let child = format!("{path}/{name}");
                if let Err(error) = validate_name(&entry.name) {
                    report.problems.push(VerifyProblem {
                        object: format!("tree {tree_id}"),
                        message: format!("invalid entry name: {error}"),
                        affected_files: vec![child.clone()],
                    });
                    continue;
                }
                match entry.kind {
                    EntryKind::Directory => {
                        if let Some(subtree) = entry.subtree {
                            stack.push((subtree, child));
                        }
                    }
                    EntryKind::File => {
                        for extent in &entry.content {
                            if let Extent::Chunk(blob, _) = extent {
                                note_user(&mut users, *blob, child.clone());
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    // Group by pack; blobs no index knows are problems of their own.
    let mut by_pack: BTreeMap<ObjectId, Vec<BlobId>> = BTreeMap::new();
    for (blob, files) in &users {
        match index.get(blob) {
            Some(location) => by_pack
                .entry(index.pack_of(location))
                .or_default()
                .push(*blob),
            None => report.problems.push(VerifyProblem {
                object: format!("blob {blob}"),
                message: "referenced but not stored in any pack".into(),
                affected_files: files.clone(),
            }),
        }
    }
    report.packs_total = by_pack.len() as u64;
    let all_packs: Vec<ObjectId> = by_pack.keys().copied().collect();
    let selected = subset.select(&all_packs);
    by_pack.retain(|pack, _| selected.contains(pack));
    let users = Arc::new(users);
    let mut checks = futures::stream::iter(by_pack)
        .map(|(pack, blobs)| {
            let repository = repository.clone();
            let index = index.clone();
            let users = users.clone();
            let progress = progress.clone();
            async move { check_pack(&repository, &index, &users, pack, blobs, &progress).await }
        })
        .buffer_unordered(PARALLEL_PACK_CHECKS);
    while let Some(result) = checks.next().await {
        let (bytes, blobs, problems) = result;
        report.packs += 1;
        report.bytes_read += bytes;
        report.data_blobs += blobs;
        report.problems.extend(problems);
    }
    report.problems.sort_by(|a, b| a.object.cmp(&b.object));
    Ok(report)
}

fn note_user(users: &mut HashMap<BlobId, Vec<String>>, blob: BlobId, file: String) {
    let files = users.entry(blob).or_default();
    if files.len() < MAX_FILES_NAMED {
        files.push(file);
    }
}

fn problem_for(
    index: &BlobIndex,
    blob: &BlobId,
    error: &EngineError,
    files: Vec<String>,
) -> VerifyProblem {
    let object = match index.get(blob) {
        Some(location) => format!("blob {blob} in pack {}", index.pack_of(location)),
        None => format!("blob {blob}"),
    };
    VerifyProblem {
        object,
        message: error.to_string(),
        affected_files: files,
    }
}

/// Read a whole pack, check it against its name and each referenced blob
/// against its id. Returns (bytes read, blobs checked, problems).
async fn check_pack(
    repository: &Repository,
    index: &BlobIndex,
    users: &HashMap<BlobId, Vec<String>>,
    pack: ObjectId,
    blobs: Vec<BlobId>,
    progress: &Progress,
) -> (u64, u64, Vec<VerifyProblem>) {
    let mut problems = Vec::new();
    let bytes = match repository.store().get(&repo::pack_key(&pack), None).await {
        Ok(bytes) => bytes,
        Err(error) => {
            let affected = blobs
                .iter()
                .flat_map(|blob| users[blob].clone())
                .take(MAX_FILES_NAMED)
                .collect();
            problems.push(VerifyProblem {
                object: format!("pack {pack}"),
                message: format!("cannot be read: {error}"),
                affected_files: affected,
            });
            return (0, 0, problems);
        }
    };
    Progress::add(&progress.bytes_transferred, bytes.len() as u64);
    let length = bytes.len() as u64;
    let locations: Vec<_> = blobs
        .iter()
        .filter_map(|blob| index.get(blob).map(|location| (*blob, *location)))
        .collect();
    let repository = repository.clone();
    let (whole_ok, blob_results) = run_blocking(move || {
        let whole_ok = ObjectId::of(&bytes) == pack;
        let results: Vec<_> = locations
            .iter()
            .map(|(blob, location)| {
                let start = location.offset as usize;
                let end = start + location.stored_length as usize;
                let result = match bytes.get(start..end) {
                    Some(stored) => repository
                        .decode_blob(blob, &pack, location, stored)
                        .map(|_| ()),
                    None => Err(EngineError::BlobDamaged {
                        pack,
                        blob: *blob,
                        reason: "lies beyond the end of the pack".into(),
                    }),
                };
                (*blob, result)
            })
            .collect();
        (whole_ok, results)
    })
    .await;
    let checked = blob_results.len() as u64;
    let mut damaged_blobs = 0;
    for (blob, result) in blob_results {
        if let Err(error) = result {
            damaged_blobs += 1;
            problems.push(VerifyProblem {
                object: format!("blob {blob} in pack {pack}"),
                message: error.to_string(),
                affected_files: users[&blob].clone(),
            });
        }
    }
    if !whole_ok && damaged_blobs == 0 {
        problems.push(VerifyProblem {
            object: format!("pack {pack}"),
            message: "content does not match its name; the referenced blobs are intact, \
                      the damage is in unreferenced bytes or the trailer"
                .into(),
            affected_files: Vec::new(),
        });
    }
    (length, checked, problems)
}
