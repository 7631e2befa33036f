//! An opened repository: the store, its config and derived keys, and the
//! operations every engine verb shares (load the index, read blobs, trees
//! and snapshots, write indexes and snapshots).

use std::collections::{BTreeMap, HashMap, HashSet};

use bytes::Bytes;
use futures::StreamExt;

use super::EngineError;
use crate::repo::chunker::Chunker;
use crate::repo::config::{RepoConfig, RepoKeys};
use crate::repo::index::{BlobIndex, BlobLocation, IndexFile};
use crate::repo::pack::{self, PackEntry, TRAILER_TAIL_BYTES};
use crate::repo::snapshot::Snapshot;
use crate::repo::tree::Tree;
use crate::repo::{
    self, BlobId, CONFIG_KEY, Compression, DATA_PREFIX, INDEX_PREFIX, ObjectId, SNAPSHOT_PREFIX,
};
use crate::store::ranges::{DEFAULT_COALESCE_GAP_BYTES, get_ranges_capped};
use crate::store::{DynStore, PutMode};

/// Tree blobs larger than this are refused as damaged or hostile.
const MAX_TREE_BYTES: u32 = 512 * 1024 * 1024;
/// Concurrent requests while loading indexes and pack trailers.
const LOAD_CONCURRENCY: usize = 8;
/// Largest single merged read of [`Repository::read_blobs`]: with the
/// caller's batch of at most a few MiB of blobs and 1 MiB gaps, a read
/// never holds more than this.
pub const MAX_BLOB_READ_BYTES: u64 = 8 * 1024 * 1024;

/// A repository ready for use.
#[derive(Debug, Clone)]
pub struct Repository {
    store: DynStore,
    config: RepoConfig,
    keys: RepoKeys,
}

/// The blob index and what was noticed while loading it.
#[derive(Debug, Default)]
pub struct LoadedIndex {
    /// Every blob found.
    pub index: BlobIndex,
    /// Index files that could not be used; their packs were read from their
    /// trailers instead.
    pub damaged_indexes: Vec<String>,
    /// Packs no index names (left by an interrupted or concurrent backup),
    /// with their blobs read from the pack trailers.
    pub unindexed_packs: Vec<(ObjectId, Vec<PackEntry>)>,
    /// Packs whose trailer could not be read.
    pub damaged_packs: Vec<String>,
}

impl Repository {
    /// Create a repository in an empty location. Fails without writing if
    /// a config is already there.
    pub async fn init(store: DynStore) -> Result<Self, EngineError> {
        let config = RepoConfig::generate();
        match store
            .put(CONFIG_KEY, Bytes::from(config.to_json()), PutMode::Create)
            .await
        {
            Ok(()) => {}
            Err(crate::store::StoreError::AlreadyExists { .. }) => {
                return Err(EngineError::AlreadyInitialized {
                    location: store.location(),
                });
            }
            Err(error) => return Err(EngineError::store("write the repository config", error)),
        }
        let keys = config.keys().map_err(|source| EngineError::Config {
            location: store.location(),
            source,
        })?;
        Ok(Repository {
            store,
            config,
            keys,
        })
    }

    /// Open an existing repository, refusing a newer format before anything
    /// is written.
    pub async fn open(store: DynStore) -> Result<Self, EngineError> {
        let bytes = match store.get(CONFIG_KEY, None).await {
            Ok(bytes) => bytes,
            Err(error) if error.is_not_found() => {
                return Err(EngineError::NotARepository {
                    location: store.location(),
                });
            }
            Err(error) => return Err(EngineError::store("read the repository config", error)),
        };
        let config_error = |source| EngineError::Config {
            location: store.location(),
            source,
        };
        let config = RepoConfig::from_json(&bytes).map_err(config_error)?;
        let keys = config.keys().map_err(config_error)?;
        Ok(Repository {
            store,
            config,
            keys,
        })
    }

    /// The store.
    pub fn store(&self) -> &DynStore {
        &self.store
    }

    /// The config.
    pub fn config(&self) -> &RepoConfig {
        &self.config
    }

    /// The derived keys.
    pub fn keys(&self) -> &RepoKeys {
        &self.keys
    }

    /// A chunker with this repository's parameters and seed.
    pub fn chunker(&self) -> Chunker {
        Chunker::new(self.config.chunker, self.keys.gear_seed)
    }

    /// Load every index file, then adopt packs that no index names by
    /// reading their trailers, so blobs stored by an interrupted backup are
    /// found and not uploaded again.
    pub async fn load_index(&self) -> Result<LoadedIndex, EngineError> {
        let mut loaded = LoadedIndex::default();
        let index_objects = self
            .store
            .list(INDEX_PREFIX)
            .await
            .map_err(|error| EngineError::store("list index files", error))?;
        let mut results = futures::stream::iter(index_objects.into_iter().filter_map(|meta| {
            repo::id_from_key(&meta.key, INDEX_PREFIX).map(|id| (id, meta.key))
        }))
        .map(|(id, key)| async move {
            let bytes = self
                .store
                .get(&key, None)
                .await
                .map_err(|error| EngineError::store(format!("read index file {id}"), error))?;
            Ok::<_, EngineError>((id, bytes))
        })
        .buffer_unordered(LOAD_CONCURRENCY);
        while let Some(result) = results.next().await {
            let (id, bytes) = result?;
            if ObjectId::of(&bytes) != id {
                loaded
                    .damaged_indexes
                    .push(format!("index file {id}: content does not match its name"));
                continue;
            }
            let decoded =
                super::run_blocking(move || IndexFile::decode(&bytes, &id.to_hex())).await;
            match decoded {
                Ok(file) => {
                    for (pack, entries) in &file.packs {
                        loaded.index.add_pack(*pack, entries);
                    }
                }
                Err(error) => loaded.damaged_indexes.push(error.to_string()),
            }
        }
        drop(results);

        let packs = self
            .store
            .list(DATA_PREFIX)
            .await
            .map_err(|error| EngineError::store("list packs", error))?;
        let unindexed: Vec<_> = packs
            .into_iter()
            .filter_map(|meta| {
                let id = repo::id_from_key(&meta.key, DATA_PREFIX)?;
                (!loaded.index.knows_pack(&id)).then_some((id, meta.size))
            })
            .collect();
        let mut trailers = futures::stream::iter(unindexed)
            .map(|(id, size)| async move { (id, self.read_pack_trailer(&id, size).await) })
            .buffer_unordered(LOAD_CONCURRENCY);
        while let Some((id, result)) = trailers.next().await {
            match result {
                Ok(entries) => {
                    loaded.index.add_pack(id, &entries);
                    loaded.unindexed_packs.push((id, entries));
                }
                Err(EngineError::Store { source, .. }) if source.is_not_found() => {}
                Err(error) => loaded.damaged_packs.push(error.to_string()),
            }
        }
        loaded.unindexed_packs.sort_by_key(|(id, _)| *id);
        Ok(loaded)
    }

    /// Read a pack's blob list from its trailer (two ranged reads).
    pub async fn read_pack_trailer(
        &self,
        id: &ObjectId,
        size: u64,
    ) -> Result<Vec<PackEntry>, EngineError> {
        let key = repo::pack_key(id);
        let damaged = |reason: String| EngineError::BlobDamaged {
            pack: *id,
            blob: BlobId([0; 32]),
            reason,
        };
        if size < (pack::PACK_MAGIC.len() + TRAILER_TAIL_BYTES) as u64 {
            return Err(damaged("pack is too short to hold a trailer".into()));
        }
        let tail = self
            .store
            .get(&key, Some(size - TRAILER_TAIL_BYTES as u64..size))
            .await
            .map_err(|error| EngineError::store(format!("read the trailer of pack {id}"), error))?;
        let length = pack::trailer_length(&tail, &id.to_hex())
            .map_err(|error| damaged(error.reason))? as u64;
        if length + pack::PACK_MAGIC.len() as u64 > size {
            return Err(damaged("trailer is longer than the pack".into()));
        }
        let trailer = self
            .store
            .get(&key, Some(size - length..size))
            .await
            .map_err(|error| EngineError::store(format!("read the trailer of pack {id}"), error))?;
        pack::decode_trailer(&trailer, size, &id.to_hex()).map_err(|error| damaged(error.reason))
    }

    /// Decompress a blob's stored bytes and check them against its id.
    pub fn decode_blob(
        &self,
        id: &BlobId,
        pack: &ObjectId,
        location: &BlobLocation,
        stored: &[u8],
    ) -> Result<Vec<u8>, EngineError> {
        let damaged = |reason: String| EngineError::BlobDamaged {
            pack: *pack,
            blob: *id,
            reason,
        };
        let plaintext = match location.compression {
            Compression::None => stored.to_vec(),
            Compression::Zstd => zstd::bulk::decompress(stored, location.raw_length as usize)
                .map_err(|error| damaged(format!("cannot decompress: {error}")))?,
        };
        if plaintext.len() != location.raw_length as usize {
            return Err(damaged(format!(
                "decoded to {} bytes, the index says {}",
                plaintext.len(),
                location.raw_length
            )));
        }
        if self.keys.blob_id(&plaintext) != *id {
            return Err(damaged("content does not match its hash".into()));
        }
        Ok(plaintext)
    }

    /// Fetch, decompress and check one blob.
    pub async fn read_blob(&self, index: &BlobIndex, id: &BlobId) -> Result<Vec<u8>, EngineError> {
        let location = *index.get(id).ok_or_else(|| EngineError::BlobMissing {
            blob: *id,
            context: "a snapshot".into(),
        })?;
        let pack = index.pack_of(&location);
        let start = u64::from(location.offset);
        let stored = self
            .store
            .get(
                &repo::pack_key(&pack),
                Some(start..start + u64::from(location.stored_length)),
            )
            .await
            .map_err(|error| {
                EngineError::store(format!("read blob {id} from pack {pack}"), error)
            })?;
        let this = self.clone();
        let id = *id;
        super::run_blocking(move || this.decode_blob(&id, &pack, &location, &stored)).await
    }

    /// Fetch many blobs with as few requests as the packs allow: the blobs
    /// of one pack are read with merged ranged reads ([`get_ranges_capped`],
    /// gaps up to [`DEFAULT_COALESCE_GAP_BYTES`], reads up to
    /// [`MAX_BLOB_READ_BYTES`]), then each is decompressed and checked
    /// against its id.
    ///
    /// Best effort: a blob that is unknown, whose pack could not be read, or
    /// that does not decode is left out of the answer, and the caller reads
    /// it with [`Repository::read_blob`], which reports exactly what is wrong.
    /// Memory is the stored plus decoded bytes of `ids`, so callers bound it
    /// by the batch they ask for.
    pub async fn read_blobs(&self, index: &BlobIndex, ids: &[BlobId]) -> HashMap<BlobId, Vec<u8>> {
        let mut by_pack: BTreeMap<ObjectId, Vec<(BlobId, BlobLocation)>> = BTreeMap::new();
        let mut seen = HashSet::new();
        for id in ids {
            if let Some(location) = index.get(id)
                && seen.insert(*id)
            {
                by_pack
                    .entry(index.pack_of(location))
                    .or_default()
                    .push((*id, *location));
            }
        }
        let mut blobs = HashMap::with_capacity(seen.len());
        for (pack, wanted) in by_pack {
            let ranges: Vec<_> = wanted
                .iter()
                .map(|(_, location)| {
                    let start = u64::from(location.offset);
                    start..start + u64::from(location.stored_length)
                })
                .collect();
            let stored = match get_ranges_capped(
                self.store.as_ref(),
                &repo::pack_key(&pack),
                &ranges,
                DEFAULT_COALESCE_GAP_BYTES,
                MAX_BLOB_READ_BYTES,
            )
            .await
            {
                Ok(stored) => stored,
                Err(error) => {
                    tracing::debug!(pack = %pack, error = %error, "batched blob read failed, reading blobs one by one");
                    continue;
                }
            };
            let this = self.clone();
            let decoded = super::run_blocking(move || {
                wanted
                    .into_iter()
                    .zip(stored)
                    .filter_map(|((id, location), bytes)| {
                        this.decode_blob(&id, &pack, &location, &bytes)
                            .ok()
                            .map(|plaintext| (id, plaintext))
                    })
                    .collect::<Vec<_>>()
            })
            .await;
            blobs.extend(decoded);
        }
        blobs
    }

    /// Fetch and decode a tree blob.
    pub async fn load_tree(&self, index: &BlobIndex, id: &BlobId) -> Result<Tree, EngineError> {
        if let Some(location) = index.get(id)
            && location.raw_length > MAX_TREE_BYTES
        {
            return Err(EngineError::TreeDamaged {
                blob: *id,
                reason: format!("claims {} bytes", location.raw_length),
            });
        }
        let bytes = self.read_blob(index, id).await?;
        Tree::decode(&bytes).map_err(|error| EngineError::TreeDamaged {
            blob: *id,
            reason: error.to_string(),
        })
    }

    /// Write an index file for `packs`.
    pub async fn write_index(
        &self,
        packs: Vec<(ObjectId, Vec<PackEntry>)>,
    ) -> Result<ObjectId, EngineError> {
        let file = IndexFile { packs };
        let (id, bytes) = super::run_blocking(move || file.encode()).await;
        self.store
            .put(
                &repo::index_key(&id),
                Bytes::from(bytes),
                PutMode::Overwrite,
            )
            .await
            .map_err(|error| EngineError::store(format!("write index file {id}"), error))?;
        Ok(id)
    }

    /// Write a snapshot manifest.
    pub async fn write_snapshot(&self, snapshot: &Snapshot) -> Result<ObjectId, EngineError> {
        let (id, bytes) = snapshot.encode();
        self.store
            .put(
                &repo::snapshot_key(&id),
                Bytes::from(bytes),
                PutMode::Overwrite,
            )
            .await
            .map_err(|error| EngineError::store(format!("write snapshot {id}"), error))?;
        Ok(id)
    }

    /// Read a snapshot manifest, checking it against its id.
    pub async fn load_snapshot(&self, id: &ObjectId) -> Result<Snapshot, EngineError> {
        let bytes = self
            .store
            .get(&repo::snapshot_key(id), None)
            .await
            .map_err(|error| EngineError::store(format!("read snapshot {id}"), error))?;
        if ObjectId::of(&bytes) != *id {
            return Err(EngineError::SnapshotDamaged {
                id: *id,
                reason: "content does not match its name (flipped or truncated bytes)".into(),
            });
        }
        Snapshot::decode(&bytes).map_err(|error| EngineError::SnapshotDamaged {
            id: *id,
            reason: error.to_string(),
        })
    }

    /// Ids of all snapshots.
    pub async fn snapshot_ids(&self) -> Result<Vec<ObjectId>, EngineError> {
        let objects = self
            .store
            .list(SNAPSHOT_PREFIX)
            .await
            .map_err(|error| EngineError::store("list snapshots", error))?;
        let mut ids: Vec<_> = objects
            .iter()
            .filter_map(|meta| repo::id_from_key(&meta.key, SNAPSHOT_PREFIX))
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// All snapshots that can be read, oldest first, and the ones that
    /// cannot, with the reason.
    pub async fn list_snapshots(
        &self,
    ) -> Result<(Vec<(ObjectId, Snapshot)>, Vec<EngineError>), EngineError> {
        let ids = self.snapshot_ids().await?;
        let mut good = Vec::new();
        let mut bad = Vec::new();
        let mut loads = futures::stream::iter(ids)
            .map(|id| async move { (id, self.load_snapshot(&id).await) })
            .buffer_unordered(LOAD_CONCURRENCY);
        while let Some((id, result)) = loads.next().await {
            match result {
                Ok(snapshot) => good.push((id, snapshot)),
                Err(error) => bad.push(error),
            }
        }
        good.sort_by(|a, b| a.1.time.cmp(&b.1.time).then(a.0.cmp(&b.0)));
        Ok((good, bad))
    }

    /// Resolve a full id or a unique prefix (at least 4 hex characters), or
    /// `latest`.
    pub async fn resolve_snapshot(&self, text: &str) -> Result<ObjectId, EngineError> {
        let location = self.store.location();
        if text == "latest" {
            let (snapshots, _) = self.list_snapshots().await?;
            return snapshots
                .last()
                .map(|(id, _)| *id)
                .ok_or(EngineError::SnapshotNotFound {
                    prefix: text.into(),
                    location,
                });
        }
        let lowered = text.to_ascii_lowercase();
        let matches: Vec<_> = self
            .snapshot_ids()
            .await?
            .into_iter()
            .filter(|id| lowered.len() >= 4 && id.to_hex().starts_with(&lowered))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        match matches.as_slice() {
            [one] => Ok(*one),
            [] => Err(EngineError::SnapshotNotFound {
                prefix: text.into(),
                location,
            }),
            many => Err(EngineError::AmbiguousSnapshot {
                prefix: text.into(),
                candidates: many
                    .iter()
                    .map(ObjectId::short)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }
}
