//! An opened repository: the store, its config, derived keys and object
//! codec, and the operations every engine verb shares (load the index,
//! read blobs, trees and snapshots, write indexes and snapshots).
//!
//! How a repository is created ([`Encryption`]) and opened ([`KeySource`])
//! is always said explicitly: format 2 (encrypted, the CLI's default) needs
//! a password; format 1 (plaintext) needs none. The cluster's controller
//! and agent create and open a BackupStorageLocation's repository with the
//! password of its `spec.encryption` Secret, plaintext
//! ([`Encryption::None`], [`KeySource::PlaintextOnly`]) without one.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use zeroize::Zeroizing;

use super::EngineError;
use super::tree_packs::TreePacks;
use crate::repo::chunker::Chunker;
use crate::repo::codec::{ObjectCodec, RecordKind};
use crate::repo::config::{RepoConfig, RepoKeys};
use crate::repo::crypto::MasterKey;
use crate::repo::index::{BlobIndex, BlobIndexBuilder, BlobLocation, IndexFile};
use crate::repo::keyfile::{
    self, KEYS_PREFIX, KdfParameters, KeyFile, KeyFileError, KeyFileOrigin, SALT_BYTES,
};
use crate::repo::pack::{self, PackEntry, PackWriter};
use crate::repo::prune::{Candidate, DELETION_CANDIDATES_KEY, DeletionCandidates};
use crate::repo::snapshot::Snapshot;
use crate::repo::tree::Tree;
use crate::repo::{
    self, BlobId, CONFIG_KEY, Compression, DATA_PREFIX, INDEX_PREFIX, ObjectId, SNAPSHOT_PREFIX,
};
use crate::store::ranges::{DEFAULT_COALESCE_GAP_BYTES, get_ranges_capped};
use crate::store::{DynStore, PutMode};

/// Tree blobs larger than this are refused as damaged or hostile.
const MAX_TREE_BYTES: u32 = 512 * 1024 * 1024;
/// Largest merged read of [`Repository::load_trees`]: with the few reads
/// [`get_ranges_capped`] has in flight, loading trees holds at most a few
/// times this.
pub const MAX_TREE_READ_BYTES: u64 = 4 * 1024 * 1024;
/// Concurrent requests while loading small objects: index files, pack
/// trailers, snapshots (prune's inventory reads and deletes index files as
/// many at once).
pub(crate) const LOAD_CONCURRENCY: usize = 8;

/// A repository ready for use.
#[derive(Debug, Clone)]
pub struct Repository {
    store: DynStore,
    config: RepoConfig,
    keys: RepoKeys,
    codec: ObjectCodec,
    /// Format 2: the master key and the key file that unwrapped it.
    unlocked: Option<Arc<Unlocked>>,
    /// The indexes the engines of this process loaded, shared while one
    /// of them still holds it ([`Repository::load_index`]).
    shared_index: Arc<tokio::sync::Mutex<Vec<IndexShare>>>,
}

/// The most layers a shared index is made of ([`BlobIndex::layers`]): a
/// load over an index of this many is a layer over a lower one instead
/// (it reads again the files of the layers it leaves out), so a lookup
/// asks at most this many tables.
const MAX_INDEX_LAYERS: usize = 4;

/// An index loaded for one engine, kept for the next while the first
/// still holds it: the volumes one agent moves at once each need the
/// repository's index, which is the largest thing an engine holds in a
/// large repository (52 bytes a blob, 60–100 before it was a sorted
/// table, `repo::blob_table`), and four copies of it took
/// the agent past its memory request. Given again while the index files
/// and prune's deletion candidates are the ones it was loaded from, so it
/// says what a fresh load would, but for packs stored since that no index
/// file names yet (a backup then stores again what it would have
/// deduplicated against them). When other backups have written index
/// files since, the next engine gets a layer over it with the new files'
/// blobs ([`crate::repo::index::BlobIndexBuilder::on`]), not a copy of
/// its own; a prune's new marks, or index files gone (prune rewrote
/// them), make it load its own.
#[derive(Debug)]
struct IndexShare {
    /// The index files it was loaded from, sorted.
    index_keys: Vec<String>,
    /// What was loaded; the index itself only while an engine holds it.
    index: std::sync::Weak<BlobIndex>,
    /// [`BlobIndex::layers`] of the index.
    layers: usize,
    deletion_candidates: Vec<Candidate>,
    damaged_indexes: Vec<String>,
    unindexed_packs: Vec<(ObjectId, Vec<PackEntry>)>,
    damaged_packs: Vec<String>,
}

impl IndexShare {
    fn of(loaded: &LoadedIndex, index_keys: Vec<String>) -> Self {
        IndexShare {
            index_keys,
            index: Arc::downgrade(&loaded.index),
            layers: loaded.index.layers(),
            deletion_candidates: loaded.deletion_candidates.clone(),
            damaged_indexes: loaded.damaged_indexes.clone(),
            unindexed_packs: loaded.unindexed_packs.clone(),
            damaged_packs: loaded.damaged_packs.clone(),
        }
    }

    /// The index again, if it was loaded from `index_keys` with
    /// `deletion_candidates` and an engine still holds it.
    fn reuse(
        &self,
        index_keys: &[String],
        deletion_candidates: &[Candidate],
    ) -> Option<LoadedIndex> {
        if self.index_keys != index_keys || self.deletion_candidates != deletion_candidates {
            return None;
        }
        self.loaded()
    }

    /// What was loaded, if an engine still holds the index.
    fn loaded(&self) -> Option<LoadedIndex> {
        Some(LoadedIndex {
            index: self.index.upgrade()?,
            deletion_candidates: self.deletion_candidates.clone(),
            damaged_indexes: self.damaged_indexes.clone(),
            unindexed_packs: self.unindexed_packs.clone(),
            damaged_packs: self.damaged_packs.clone(),
        })
    }

    /// Whether a load of `index_keys` with `deletion_candidates` can be a
    /// layer over this index: it was loaded with the same candidates from
    /// some of these index files and no others, and has room for a layer.
    fn can_carry(&self, index_keys: &[String], deletion_candidates: &[Candidate]) -> bool {
        self.layers < MAX_INDEX_LAYERS
            && self.deletion_candidates == deletion_candidates
            && is_sorted_subset(&self.index_keys, index_keys)
    }

    /// This index as the base of a layer, if an engine still holds it.
    fn base(&self) -> Option<IndexBase> {
        Some(IndexBase {
            loaded: self.loaded()?,
            index_keys: self.index_keys.clone(),
        })
    }
}

/// A shared index a load adds a layer to, with how it was loaded: its
/// damaged index files stay damaged (the files are the same), its
/// unindexed packs stay so unless a new index file names them.
struct IndexBase {
    loaded: LoadedIndex,
    /// The index files it was loaded from, sorted: the load reads the
    /// others.
    index_keys: Vec<String>,
}

/// Whether every key of `part` is in `whole` (both sorted).
fn is_sorted_subset(part: &[String], whole: &[String]) -> bool {
    let mut rest = whole.iter();
    part.iter().all(|key| rest.any(|other| other == key))
}

#[derive(Debug)]
struct Unlocked {
    master: MasterKey,
    key_file: ObjectId,
}

/// A password, held zeroed-on-drop; `Debug` never shows it.
#[derive(Clone)]
pub struct Password(Zeroizing<String>);

impl Password {
    /// Wrap a password.
    pub fn new(text: impl Into<String>) -> Self {
        Password(Zeroizing::new(text.into()))
    }

    /// The password's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Password(..)")
    }
}

/// Where a password comes from when an encrypted repository is opened:
/// asked only then, so opening a plaintext repository never prompts.
pub trait PasswordSource: Send + Sync + fmt::Debug {
    /// The password, or why there is none (said to the user as is).
    fn password(&self) -> Result<Password, String>;
}

impl PasswordSource for Password {
    fn password(&self) -> Result<Password, String> {
        Ok(self.clone())
    }
}

/// How [`Repository::open`] gets the key of an encrypted repository.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// No key: opens plaintext (format 1) repositories, refuses encrypted
    /// ones. What the cluster's controller and agent use for a location
    /// without `spec.encryption`.
    PlaintextOnly,
    /// A password that opens one of the repository's key files.
    Password(Arc<dyn PasswordSource>),
}

impl KeySource {
    /// A fixed password.
    pub fn password(text: impl Into<String>) -> Self {
        KeySource::Password(Arc::new(Password::new(text)))
    }
}

/// How [`Repository::init`] creates a repository.
#[derive(Debug, Clone)]
pub enum Encryption {
    /// Format 1, plaintext: `repo init --insecure-no-encryption`, and the
    /// BackupStorageLocation controller for a location without
    /// `spec.encryption`.
    None,
    /// Format 2: a random master key, wrapped in a first key file by this
    /// password through Argon2id with these parameters.
    Password {
        /// The first key's password.
        password: Password,
        /// Argon2id cost ([`KdfParameters::default`] for people).
        kdf: KdfParameters,
    },
}

/// One key file, as `repo key list` shows it.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyInfo {
    /// The key file's id.
    pub id: String,
    /// True for the key that opened this session.
    pub current: bool,
    /// When it was made.
    pub created: String,
    /// Host it was made on.
    pub hostname: String,
    /// User who made it.
    pub username: String,
    /// Argon2id cost.
    pub kdf: KdfParameters,
}

fn key_file_origin() -> KeyFileOrigin {
    use rand::RngCore;
    let mut salt = [0u8; SALT_BYTES];
    rand::rng().fill_bytes(&mut salt);
    KeyFileOrigin {
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        hostname: super::hostname(),
        username: std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| format!("uid {}", rustix::process::geteuid().as_raw())),
        salt,
    }
}

/// A checkpoint of an unfinished backup as stored.
#[derive(Debug)]
pub struct StoredCheckpoint {
    /// Its object key.
    pub key: String,
    /// Its id (the hash of its stored bytes).
    pub id: ObjectId,
    /// Its manifest, or why it cannot be read.
    pub manifest: Result<Snapshot, EngineError>,
}

/// The blob index and what was noticed while loading it.
#[derive(Debug, Default)]
pub struct LoadedIndex {
    /// Every blob found; the blobs of packs prune has marked for deletion
    /// are readable but not deduplicated against
    /// ([`BlobIndex::add_leaving_pack`]). Shared with the other engines
    /// of this process that load it while this one holds it.
    pub index: Arc<BlobIndex>,
    /// The packs prune has marked for deletion.
    pub deletion_candidates: Vec<Candidate>,
    /// Index files that could not be used; their packs were read from their
    /// trailers instead.
    pub damaged_indexes: Vec<String>,
    /// Packs no index names (left by an interrupted or concurrent backup),
    /// with their blobs read from the pack trailers; packs marked for
    /// deletion are not among them (a backup adopts these into its index).
    pub unindexed_packs: Vec<(ObjectId, Vec<PackEntry>)>,
    /// Packs whose trailer could not be read.
    pub damaged_packs: Vec<String>,
}

impl Repository {
    /// Create a repository in an empty location, encrypted or not as
    /// `encryption` says. Fails without writing if a config is already
    /// there.
    pub async fn init(store: DynStore, encryption: Encryption) -> Result<Self, EngineError> {
        let location = store.location();
        match store.head(CONFIG_KEY).await {
            Ok(_) => return Err(EngineError::AlreadyInitialized { location }),
            Err(error) if error.is_not_found() => {}
            Err(error) => return Err(EngineError::store("check for a repository config", error)),
        }
        let (config, written_key) = match &encryption {
            Encryption::None => (RepoConfig::generate(&mut rand::rng()), None),
            Encryption::Password { password, kdf } => {
                let master = MasterKey::generate(&mut rand::rng());
                let config = RepoConfig::generate_encrypted(&mut rand::rng(), &master);
                let file = KeyFile::create(
                    &mut rand::rng(),
                    &master,
                    password.as_bytes(),
                    &config.repository_id,
                    *kdf,
                    key_file_origin(),
                )
                .map_err(|source| EngineError::KeyFile {
                    id: "new".into(),
                    source,
                })?;
                let (id, bytes) = file.encode();
                put_object(&store, &keyfile::key_file_key(&id), bytes, || {
                    format!("write key file {id}")
                })
                .await?;
                (config, Some((id, master)))
            }
        };
        match store
            .put(CONFIG_KEY, Bytes::from(config.to_json()), PutMode::Create)
            .await
        {
            Ok(()) => {}
            Err(error) => {
                // Another writer created a repository first: our key file
                // wraps a master key nobody uses.
                if let Some((id, _)) = &written_key {
                    let _ = store.delete(&keyfile::key_file_key(id)).await;
                }
                return Err(match error {
                    crate::store::StoreError::AlreadyExists { .. } => {
                        EngineError::AlreadyInitialized { location }
                    }
                    error => EngineError::store("write the repository config", error),
                });
            }
        }
        let master = written_key.as_ref().map(|(_, master)| master);
        let (keys, codec) = config
            .open(master)
            .map_err(|source| EngineError::Config { location, source })?;
        Ok(Repository {
            store,
            config,
            keys,
            codec,
            unlocked: written_key.map(|(key_file, master)| Arc::new(Unlocked { master, key_file })),
            shared_index: Arc::default(),
        })
    }

    /// Open an existing repository, refusing a newer format, and for an
    /// encrypted one a wrong password, before anything is written.
    pub async fn open(store: DynStore, key: &KeySource) -> Result<Self, EngineError> {
        let location = store.location();
        let bytes = match store.get(CONFIG_KEY, None).await {
            Ok(bytes) => bytes,
            Err(error) if error.is_not_found() => {
                return Err(EngineError::NotARepository { location });
            }
            Err(error) => return Err(EngineError::store("read the repository config", error)),
        };
        let config_error = |source| EngineError::Config {
            location: location.clone(),
            source,
        };
        let config = RepoConfig::from_json(&bytes).map_err(config_error)?;
        if !config.is_encrypted() {
            let (keys, codec) = config.open(None).map_err(config_error)?;
            return Ok(Repository {
                store,
                config,
                keys,
                codec,
                unlocked: None,
                shared_index: Arc::default(),
            });
        }
        let source = match key {
            KeySource::PlaintextOnly => return Err(EngineError::Encrypted { location }),
            KeySource::Password(source) => source,
        };
        let password = source
            .password()
            .map_err(|reason| EngineError::PasswordUnavailable { reason })?;
        let files = list_key_files(&store).await?;
        if files.is_empty() {
            return Err(EngineError::NoKeys { location });
        }
        let repository_id = config.repository_id.clone();
        let tried = files.len();
        let found = super::run_blocking(move || {
            for (id, file) in files {
                if let Ok(master) = file.open(password.as_bytes(), &repository_id) {
                    return Some((id, master));
                }
            }
            None
        })
        .await;
        let Some((key_file, master)) = found else {
            return Err(EngineError::WrongPassword { location, tried });
        };
        let (keys, codec) = config.open(Some(&master)).map_err(config_error)?;
        Ok(Repository {
            store,
            config,
            keys,
            codec,
            unlocked: Some(Arc::new(Unlocked { master, key_file })),
            shared_index: Arc::default(),
        })
    }

    /// The key files, newest first by creation time (the field is
    /// informational; an unreadable file is left out).
    pub async fn list_keys(&self) -> Result<Vec<KeyInfo>, EngineError> {
        let current = self.unlocked.as_ref().map(|unlocked| unlocked.key_file);
        let mut keys: Vec<_> = list_key_files(&self.store)
            .await?
            .into_iter()
            .map(|(id, file)| KeyInfo {
                id: id.to_hex(),
                current: Some(id) == current,
                created: file.created,
                hostname: file.hostname,
                username: file.username,
                kdf: file.kdf.parameters,
            })
            .collect();
        keys.sort_by(|a, b| b.created.cmp(&a.created).then(a.id.cmp(&b.id)));
        Ok(keys)
    }

    /// Wrap the master key with another password; returns the new key
    /// file's id.
    pub async fn add_key(
        &self,
        password: &Password,
        kdf: KdfParameters,
    ) -> Result<ObjectId, EngineError> {
        let unlocked = self
            .unlocked
            .as_ref()
            .ok_or(EngineError::KeysNeedEncryption {
                location: self.store.location(),
            })?;
        let master = unlocked.master.clone();
        let password = password.clone();
        let repository_id = self.config.repository_id.clone();
        let origin = key_file_origin();
        let file = super::run_blocking(move || {
            KeyFile::create(
                &mut rand::rng(),
                &master,
                password.as_bytes(),
                &repository_id,
                kdf,
                origin,
            )
        })
        .await
        .map_err(|source| EngineError::KeyFile {
            id: "new".into(),
            source,
        })?;
        let (id, bytes) = file.encode();
        put_object(&self.store, &keyfile::key_file_key(&id), bytes, || {
            format!("write key file {id}")
        })
        .await?;
        Ok(id)
    }

    /// Remove a key file (by full id or unique prefix). Refuses the last
    /// one (the data would be unreadable for good) and, unless
    /// `allow_current`, the one that opened this session. Returns the id
    /// removed.
    pub async fn remove_key(
        &self,
        prefix: &str,
        allow_current: bool,
    ) -> Result<ObjectId, EngineError> {
        let location = self.store.location();
        let unlocked = self
            .unlocked
            .as_ref()
            .ok_or(EngineError::KeysNeedEncryption {
                location: location.clone(),
            })?;
        let files = list_key_files(&self.store).await?;
        let lowered = prefix.to_ascii_lowercase();
        let matches: Vec<ObjectId> = files
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| lowered.len() >= 4 && id.to_hex().starts_with(&lowered))
            .collect();
        let id = match matches.as_slice() {
            [one] => *one,
            [] => {
                return Err(EngineError::KeyRemovalRefused {
                    reason: format!(
                        "no key file matches {prefix:?}; `haulage repo key list --repo {location}` lists them"
                    ),
                });
            }
            many => {
                return Err(EngineError::KeyRemovalRefused {
                    reason: format!(
                        "{prefix:?} matches {} key files; give more characters",
                        many.len()
                    ),
                });
            }
        };
        if files.len() == 1 {
            return Err(EngineError::KeyRemovalRefused {
                reason: format!(
                    "key {} is the repository's only key: without it nothing in {location} can be read again; add another key first",
                    id.short()
                ),
            });
        }
        if id == unlocked.key_file && !allow_current {
            return Err(EngineError::KeyRemovalRefused {
                reason: format!(
                    "key {} is the one this command was opened with; open with another key's password, or pass --allow-current",
                    id.short()
                ),
            });
        }
        self.store
            .delete(&keyfile::key_file_key(&id))
            .await
            .map_err(|error| EngineError::store(format!("remove key file {id}"), error))?;
        Ok(id)
    }

    /// The object codec: how this repository's objects are encoded.
    pub fn codec(&self) -> &ObjectCodec {
        &self.codec
    }

    /// The most bytes one data blob takes in a pack: a largest chunk that
    /// did not compress (zstd's bound) and what sealing adds.
    pub fn largest_stored_blob_bytes(&self) -> usize {
        zstd::zstd_safe::compress_bound(self.config.chunker.max_bytes as usize)
            + self.codec.blob_overhead()
    }

    /// An empty pack in this repository's format.
    pub fn pack_writer(&self, capacity: usize) -> PackWriter {
        self.codec.pack_writer(capacity)
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

    /// The bytes of the repository's index files, as listed: what a
    /// mover agent's memory plan counts the loaded index by
    /// ([`index_file_bytes`]).
    pub async fn index_file_bytes(&self) -> Result<u64, EngineError> {
        index_file_bytes(self.store.as_ref())
            .await
            .map_err(|error| EngineError::store("list index files", error))
    }

    /// Load every index file, then adopt packs that no index names by
    /// reading their trailers, so blobs stored by an interrupted backup are
    /// found and not uploaded again.
    ///
    /// The engines of one process share what they load ([`IndexShare`]):
    /// while one holds the index, another whose listing finds the same
    /// index files and deletion candidates is given the same index instead
    /// of a copy, and engines that start together load it once (they wait
    /// here for the first). When the listing finds more index files (other
    /// backups ended or checkpointed since), the next engine reads only
    /// those, into a layer over the index held, so the agent holds the
    /// blobs once however its volumes start.
    pub async fn load_index(&self) -> Result<LoadedIndex, EngineError> {
        let mut shares = self.shared_index.lock().await;
        shares.retain(|share| share.index.strong_count() > 0);
        let deletion_candidates = self.load_deletion_candidates().await?.candidates;
        let index_objects = self
            .store
            .list(INDEX_PREFIX)
            .await
            .map_err(|error| EngineError::store("list index files", error))?;
        let mut index_keys: Vec<String> =
            index_objects.iter().map(|meta| meta.key.clone()).collect();
        index_keys.sort_unstable();
        if let Some(loaded) = shares
            .iter()
            .find_map(|share| share.reuse(&index_keys, &deletion_candidates))
        {
            return Ok(loaded);
        }
        // The base with the most index files; what it was loaded with is
        // copied out of that one share only.
        let mut bases: Vec<&IndexShare> = shares
            .iter()
            .filter(|share| share.can_carry(&index_keys, &deletion_candidates))
            .collect();
        bases.sort_by_key(|share| share.index_keys.len());
        let base = bases.into_iter().rev().find_map(IndexShare::base);
        let loaded = self
            .read_index(deletion_candidates, index_objects, base)
            .await?;
        shares.push(IndexShare::of(&loaded, index_keys));
        Ok(loaded)
    }

    /// [`Repository::load_index`] from the listed index files, or from
    /// those `base` was not loaded from, as a layer over it.
    async fn read_index(
        &self,
        deletion_candidates: Vec<Candidate>,
        mut index_objects: Vec<crate::store::ObjectMeta>,
        base: Option<IndexBase>,
    ) -> Result<LoadedIndex, EngineError> {
        let leaving: HashSet<ObjectId> = deletion_candidates
            .iter()
            .map(|candidate| candidate.pack)
            .collect();
        let mut loaded = LoadedIndex {
            deletion_candidates,
            ..LoadedIndex::default()
        };
        // Of a layer: the packs its index files name, which are no longer
        // unindexed.
        let mut named_packs: HashSet<ObjectId> = HashSet::new();
        let mut base_unindexed_packs = Vec::new();
        let mut index = match base {
            Some(base) => {
                index_objects.retain(|meta| base.index_keys.binary_search(&meta.key).is_err());
                loaded.damaged_indexes = base.loaded.damaged_indexes;
                base_unindexed_packs = base.loaded.unindexed_packs;
                BlobIndexBuilder::on(base.loaded.index)
            }
            None => BlobIndexBuilder::new(),
        };
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
            let codec = self.codec.clone();
            let decoded =
                super::run_blocking(move || codec.decode_index(&bytes, &id.to_hex())).await;
            match decoded {
                Ok(file) => {
                    for (pack, entries) in &file.packs {
                        index.add_pack(*pack, entries, leaving.contains(pack));
                        if !base_unindexed_packs.is_empty() {
                            named_packs.insert(*pack);
                        }
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
                (!index.knows_pack(&id)).then_some((id, meta.size))
            })
            .collect();
        let mut trailers = futures::stream::iter(unindexed)
            .map(|(id, size)| async move { (id, self.read_pack_trailer(&id, size).await) })
            .buffer_unordered(LOAD_CONCURRENCY);
        while let Some((id, result)) = trailers.next().await {
            match result {
                Ok(entries) if leaving.contains(&id) => {
                    index.add_pack(id, &entries, true);
                }
                Ok(entries) => {
                    index.add_pack(id, &entries, false);
                    loaded.unindexed_packs.push((id, entries));
                }
                Err(EngineError::Store { source, .. }) if source.is_not_found() => {}
                Err(error) => loaded.damaged_packs.push(error.to_string()),
            }
        }
        loaded.unindexed_packs.extend(
            base_unindexed_packs
                .into_iter()
                .filter(|(id, _)| !named_packs.contains(id)),
        );
        loaded.unindexed_packs.sort_by_key(|(id, _)| *id);
        let index = index.finish();
        // Info: an agent's log says what each volume's index added to its
        // memory (the CLI shows warnings only).
        tracing::info!(
            blobs = index.len(),
            packs = index.pack_count(),
            bytes = index.memory_bytes(),
            layers = index.layers(),
            layer_bytes = index.layer_memory_bytes(),
            "loaded the repository's index"
        );
        loaded.index = Arc::new(index);
        Ok(loaded)
    }

    /// Prune's record of packs waiting for deletion. Missing is empty; an
    /// unreadable one is reported and read as empty (a backup then only
    /// deduplicates against more packs, which the safety margin covers,
    /// and prune starts a new record, which restarts every margin).
    pub async fn load_deletion_candidates(&self) -> Result<DeletionCandidates, EngineError> {
        let bytes = match self.store.get(DELETION_CANDIDATES_KEY, None).await {
            Ok(bytes) => bytes,
            Err(error) if error.is_not_found() => return Ok(DeletionCandidates::default()),
            Err(error) => {
                return Err(EngineError::store(
                    "read prune's deletion candidates",
                    error,
                ));
            }
        };
        let decoded = self
            .codec
            .decode_record(RecordKind::DeletionCandidates, &bytes)
            .map_err(|error| error.to_string())
            .and_then(|json| DeletionCandidates::from_json(&json));
        match decoded {
            Ok(candidates) => Ok(candidates),
            Err(error) => {
                tracing::warn!(%error, "prune's deletion candidates record is unreadable, ignored");
                Ok(DeletionCandidates::default())
            }
        }
    }

    /// Replace prune's record of packs waiting for deletion.
    pub async fn write_deletion_candidates(
        &self,
        candidates: &DeletionCandidates,
    ) -> Result<(), EngineError> {
        let bytes = self.codec.encode_record(
            RecordKind::DeletionCandidates,
            &candidates.to_json(),
            &mut rand::rng(),
        );
        put_object(&self.store, DELETION_CANDIDATES_KEY, bytes, || {
            "write prune's deletion candidates".into()
        })
        .await
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
        let tail_bytes = self.codec.pack_format().tail_bytes();
        if size < (pack::PACK_MAGIC.len() + tail_bytes) as u64 {
            return Err(damaged("pack is too short to hold a trailer".into()));
        }
        let tail = self
            .store
            .get(&key, Some(size - tail_bytes as u64..size))
            .await
            .map_err(|error| EngineError::store(format!("read the trailer of pack {id}"), error))?;
        let length = self
            .codec
            .pack_trailer_length(&tail, &id.to_hex())
            .map_err(|error| damaged(error.reason))? as u64;
        if length + pack::PACK_MAGIC.len() as u64 > size {
            return Err(damaged("trailer is longer than the pack".into()));
        }
        let trailer = self
            .store
            .get(&key, Some(size - length..size))
            .await
            .map_err(|error| EngineError::store(format!("read the trailer of pack {id}"), error))?;
        self.codec
            .decode_pack_trailer(&trailer, size, &id.to_hex())
            .map_err(|error| damaged(error.reason))
    }

    /// Decode a blob's stored bytes into its plaintext and check it against
    /// its id; the plaintext is returned in a new buffer. See
    /// [`Repository::decode_blob_into`], which this calls.
    pub fn decode_blob(
        &self,
        id: &BlobId,
        pack: &ObjectId,
        location: &BlobLocation,
        stored: &[u8],
    ) -> Result<Vec<u8>, EngineError> {
        let mut scratch = Vec::new();
        self.decode_blob_into(id, pack, location, stored, &mut scratch)
            .map(<[u8]>::to_vec)
    }

    /// Decode a blob's stored bytes (as read from its pack): open its seal
    /// (format 2, bound to the blob's kind and id), decompress, and check
    /// the plaintext against the blob's id. This is the one place where stored
    /// bytes become plaintext: every reader (restore's scatter, tree loads,
    /// verify) goes through it.
    ///
    /// The plaintext is either `stored` itself (a blob stored raw) or
    /// decoded into `scratch`, whose contents are replaced; callers use the
    /// returned slice and nothing else. `scratch` grows to at most
    /// `location.raw_length` (or keeps the larger capacity it had): a frame
    /// that decompresses to more is refused as damaged, so callers bound
    /// memory by bounding the lengths they accept, and a caller decoding
    /// many blobs reuses one buffer. zstd frames are decoded with a context
    /// kept per thread.
    pub fn decode_blob_into<'a>(
        &self,
        id: &BlobId,
        pack: &ObjectId,
        location: &BlobLocation,
        stored: &'a [u8],
        scratch: &'a mut Vec<u8>,
    ) -> Result<&'a [u8], EngineError> {
        let damaged = |reason: String| EngineError::BlobDamaged {
            pack: *pack,
            blob: *id,
            reason,
        };
        let raw_length = location.raw_length as usize;
        let opened = self
            .codec
            .open_blob(location.kind, id, stored)
            .map_err(|error| damaged(error.to_string()))?;
        let plaintext: &[u8] = match (opened, location.compression) {
            (Cow::Borrowed(raw), Compression::None) => raw,
            (Cow::Owned(raw), Compression::None) => {
                *scratch = raw;
                scratch
            }
            (opened, Compression::Zstd) => {
                scratch.clear();
                scratch.reserve_exact(raw_length);
                decompress_with_thread_context(&opened, scratch)
                    .map_err(|error| damaged(format!("cannot decompress: {error}")))?;
                scratch
            }
        };
        if plaintext.len() != raw_length {
            return Err(damaged(format!(
                "decoded to {} bytes, the index says {}",
                plaintext.len(),
                location.raw_length
            )));
        }
        if self.keys.blob_id(plaintext) != *id {
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

    /// Load several trees with as few requests as their packs allow: the
    /// tree blobs of one pack are read in merged ranged reads
    /// ([`get_ranges_capped`], gaps up to [`DEFAULT_COALESCE_GAP_BYTES`],
    /// reads up to [`MAX_TREE_READ_BYTES`]). A directory's subtrees lie
    /// between their files' data, so this reads some data that the restore
    /// reads again for the files: on 200,000 small files in 1,000
    /// directories that is about 120 MB more read, against 1,000 fewer
    /// requests (docs/benchmarks.md: each costs MinIO more CPU than a MiB).
    /// With `held`, a pack of trees only is read whole once and the trees
    /// cut from it ([`TreePacks`]). Returns one result per id, in order; a
    /// tree whose merged read failed is loaded alone by
    /// [`Repository::load_tree`], which says exactly what is wrong.
    /// Callers bound the memory by the trees they ask for at once, and by
    /// `packs_at_once`, the packs read at the same time (each read up to
    /// [`MAX_TREE_READ_BYTES`]).
    pub async fn load_trees(
        &self,
        index: &BlobIndex,
        ids: &[BlobId],
        held: Option<&TreePacks>,
        packs_at_once: usize,
    ) -> Vec<Result<Tree, EngineError>> {
        let mut by_pack: BTreeMap<ObjectId, Vec<(usize, BlobLocation)>> = BTreeMap::new();
        for (position, id) in ids.iter().enumerate() {
            if let Some(location) = index.get(id)
                && location.raw_length <= MAX_TREE_BYTES
            {
                by_pack
                    .entry(index.pack_of(location))
                    .or_default()
                    .push((position, *location));
            }
        }
        let mut stored: Vec<Option<(ObjectId, BlobLocation, Bytes)>> = vec![None; ids.len()];
        let mut reads = futures::stream::iter(by_pack)
            .map(|(pack, blobs)| async move {
                let whole = match held {
                    Some(held) => held.whole(self.store.as_ref(), index, &pack).await,
                    None => None,
                };
                if let Some(whole) = whole {
                    return blobs
                        .into_iter()
                        .filter_map(|(position, location)| {
                            let start = location.offset as usize;
                            let end = start + location.stored_length as usize;
                            (end <= whole.len())
                                .then(|| (position, (pack, location, whole.slice(start..end))))
                        })
                        .collect::<Vec<_>>();
                }
                let ranges: Vec<_> = blobs
                    .iter()
                    .map(|(_, location)| {
                        let start = u64::from(location.offset);
                        start..start + u64::from(location.stored_length)
                    })
                    .collect();
                match get_ranges_capped(
                    self.store.as_ref(),
                    &repo::pack_key(&pack),
                    &ranges,
                    DEFAULT_COALESCE_GAP_BYTES,
                    MAX_TREE_READ_BYTES,
                )
                .await
                {
                    Ok(pieces) => blobs
                        .into_iter()
                        .zip(pieces)
                        .map(|((position, location), bytes)| (position, (pack, location, bytes)))
                        .collect(),
                    Err(error) => {
                        tracing::debug!(pack = %pack, error = %error, "merged tree read failed, reading trees one by one");
                        Vec::new()
                    }
                }
            })
            .buffer_unordered(packs_at_once.max(1));
        while let Some(found) = reads.next().await {
            for (position, read) in found {
                stored[position] = Some(read);
            }
        }
        let mut trees = Vec::with_capacity(ids.len());
        for (id, stored) in ids.iter().zip(stored) {
            let tree = match stored {
                Some((pack, location, bytes)) => {
                    let this = self.clone();
                    let id = *id;
                    super::run_blocking(move || {
                        let plaintext = this.decode_blob(&id, &pack, &location, &bytes)?;
                        Tree::decode(&plaintext).map_err(|error| EngineError::TreeDamaged {
                            blob: id,
                            reason: error.to_string(),
                        })
                    })
                    .await
                }
                None => self.load_tree(index, id).await,
            };
            trees.push(tree);
        }
        trees
    }

    /// Write the index files of `packs`: one per
    /// [`repo::index::MAX_BLOBS_PER_INDEX_FILE`] blobs. Returns their ids.
    pub async fn write_index(
        &self,
        packs: Vec<(ObjectId, Vec<PackEntry>)>,
    ) -> Result<Vec<ObjectId>, EngineError> {
        let mut written = Vec::new();
        for packs in repo::index::index_file_groups(packs) {
            let file = IndexFile { packs };
            let codec = self.codec.clone();
            let (id, bytes) =
                super::run_blocking(move || codec.encode_index(&file, &mut rand::rng())).await;
            put_object(&self.store, &repo::index_key(&id), bytes, || {
                format!("write index file {id}")
            })
            .await?;
            written.push(id);
        }
        Ok(written)
    }

    /// Seal the blobs of `writer` into a pack (on the blocking pool) and
    /// store it; `what` names it in an error ("pack", "repacked pack").
    pub async fn upload_pack(
        &self,
        writer: PackWriter,
        what: &str,
    ) -> Result<(ObjectId, Vec<PackEntry>), EngineError> {
        let (id, entries, _) = self.upload_pack_keeping_buffer(writer, what).await?;
        Ok((id, entries))
    }

    /// [`Repository::upload_pack`], handing back the pack's buffer once the
    /// store let go of it (for the next pack: reusing it spares mapping
    /// and zeroing fresh memory for every pack).
    pub async fn upload_pack_keeping_buffer(
        &self,
        writer: PackWriter,
        what: &str,
    ) -> Result<(ObjectId, Vec<PackEntry>, Option<Vec<u8>>), EngineError> {
        let codec = self.codec.clone();
        let pack = super::run_blocking(move || codec.finish_pack(writer, &mut rand::rng())).await;
        let id = pack.id;
        let buffer = put_object_reclaiming(&self.store, &repo::pack_key(&id), pack.bytes, || {
            format!("upload {what} {id}")
        })
        .await?;
        Ok((id, pack.entries, buffer))
    }

    /// An empty pack written into `buffer`.
    pub fn pack_writer_in(&self, buffer: Vec<u8>) -> PackWriter {
        self.codec.pack_writer_in(buffer)
    }

    /// Write a snapshot manifest.
    pub async fn write_snapshot(&self, snapshot: &Snapshot) -> Result<ObjectId, EngineError> {
        self.write_manifest(snapshot, "snapshot", repo::snapshot_key)
            .await
    }

    /// Write a manifest (a snapshot's or a checkpoint's) under the key
    /// `key_of` its id gives; `what` names it in an error.
    async fn write_manifest(
        &self,
        manifest: &Snapshot,
        what: &str,
        key_of: impl FnOnce(&ObjectId) -> String,
    ) -> Result<ObjectId, EngineError> {
        let (id, bytes) = self.codec.encode_snapshot(manifest, &mut rand::rng());
        put_object(&self.store, &key_of(&id), bytes, || {
            format!("write {what} {id}")
        })
        .await?;
        Ok(id)
    }

    /// Read a snapshot manifest, checking it against its id.
    pub async fn load_snapshot(&self, id: &ObjectId) -> Result<Snapshot, EngineError> {
        self.read_manifest(&repo::snapshot_key(id), id, "snapshot")
            .await
    }

    /// Read the manifest at `key` (a snapshot's or a checkpoint's),
    /// checking it against its id; `what` names it in an error.
    async fn read_manifest(
        &self,
        key: &str,
        id: &ObjectId,
        what: &str,
    ) -> Result<Snapshot, EngineError> {
        let bytes = self
            .store
            .get(key, None)
            .await
            .map_err(|error| EngineError::store(format!("read {what} {id}"), error))?;
        if ObjectId::of(&bytes) != *id {
            return Err(EngineError::SnapshotDamaged {
                id: *id,
                reason: "content does not match its name (flipped or truncated bytes)".into(),
            });
        }
        self.codec
            .decode_snapshot(&bytes)
            .map_err(|error| EngineError::SnapshotDamaged {
                id: *id,
                reason: error.to_string(),
            })
    }

    /// Write the checkpoint of an unfinished backup: a manifest like a
    /// snapshot's whose tree holds what the backup has stored so far. Every
    /// pack and index it needs must be stored first.
    pub async fn write_checkpoint(&self, checkpoint: &Snapshot) -> Result<ObjectId, EngineError> {
        let group = self.source_group(&checkpoint.source, &checkpoint.hostname);
        self.write_manifest(checkpoint, "checkpoint", |id| {
            repo::checkpoint_key(&group, id)
        })
        .await
    }

    /// The folder of the checkpoints of `source` from `hostname` under
    /// `checkpoints/`, and of its heads under `heads/`: a keyed hash of the
    /// two, so it names neither.
    fn source_group(&self, source: &str, hostname: &str) -> String {
        let mut text = b"haulage checkpoint group\0".to_vec();
        text.extend_from_slice(source.as_bytes());
        text.push(0);
        text.extend_from_slice(hostname.as_bytes());
        self.keys.blob_id(&text).to_hex()[..32].to_string()
    }

    /// The checkpoints of unfinished backups of `source` from `hostname`,
    /// oldest first. One that cannot be read is skipped with a warning: it
    /// only spares reading files again.
    pub async fn checkpoints_of(
        &self,
        source: &str,
        hostname: &str,
    ) -> Result<Vec<(ObjectId, Snapshot)>, EngineError> {
        let group = self.source_group(source, hostname);
        let stored = self
            .checkpoints_under(&format!("{}{group}/", repo::CHECKPOINT_PREFIX))
            .await?;
        let mut found = Vec::new();
        for checkpoint in stored {
            match checkpoint.manifest {
                Ok(manifest) if manifest.source == source && manifest.hostname == hostname => {
                    found.push((checkpoint.id, manifest));
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(checkpoint = %checkpoint.id, %error, "checkpoint cannot be read, ignored");
                }
            }
        }
        found.sort_by(|a, b| a.1.time.cmp(&b.1.time).then(a.0.cmp(&b.0)));
        Ok(found)
    }

    /// Every checkpoint in the repository, of every source and host (for
    /// prune).
    pub async fn all_checkpoints(&self) -> Result<Vec<StoredCheckpoint>, EngineError> {
        self.checkpoints_under(repo::CHECKPOINT_PREFIX).await
    }

    /// The checkpoints stored under `prefix`, read.
    async fn checkpoints_under(&self, prefix: &str) -> Result<Vec<StoredCheckpoint>, EngineError> {
        let objects = self
            .store
            .list(prefix)
            .await
            .map_err(|error| EngineError::store("list checkpoints", error))?;
        let ids: Vec<(ObjectId, String)> = objects
            .into_iter()
            .filter_map(|meta| Some((repo::id_from_key(&meta.key, prefix)?, meta.key)))
            .collect();
        Ok(futures::stream::iter(ids)
            .map(|(id, key)| async move {
                let manifest = self.read_manifest(&key, &id, "checkpoint").await;
                StoredCheckpoint { key, id, manifest }
            })
            .buffer_unordered(LOAD_CONCURRENCY)
            .collect()
            .await)
    }

    /// Delete a checkpoint of `source` from `hostname`; one already gone
    /// is fine.
    pub async fn delete_checkpoint(
        &self,
        source: &str,
        hostname: &str,
        id: &ObjectId,
    ) -> Result<(), EngineError> {
        let group = self.source_group(source, hostname);
        self.delete_checkpoint_at(&repo::checkpoint_key(&group, id), id)
            .await
    }

    /// Delete the checkpoint `id` stored at `key`; one already gone is fine.
    pub async fn delete_checkpoint_at(&self, key: &str, id: &ObjectId) -> Result<(), EngineError> {
        match self.store.delete(key).await {
            Ok(()) => Ok(()),
            Err(error) if error.is_not_found() => Ok(()),
            Err(error) => Err(EngineError::store(format!("delete checkpoint {id}"), error)),
        }
    }

    /// The newest snapshot of `source` from `hostname` (a backup's parent),
    /// and the heads listed on the way, which the backup's own head
    /// replaces ([`Repository::replace_heads`]).
    ///
    /// From the source's heads (`heads/<group>/<id>`, one LIST and a read
    /// of the snapshot each names), so a backup in a repository of
    /// thousands of snapshots does not read all of them; only when no head
    /// names a readable snapshot of the source (a repository written before
    /// heads, a head whose snapshot was forgotten, a head not written) from
    /// every snapshot, keeping only the newest while they are read. A head
    /// is a hint: what it names is read and checked like any snapshot.
    pub async fn newest_snapshot_of(
        &self,
        source: &str,
        hostname: &str,
    ) -> Result<SourceHeads, EngineError> {
        let listed = self.heads_of(source, hostname).await;
        let mut newest = None;
        for id in &listed {
            match self.load_snapshot(id).await {
                Ok(snapshot) => keep_newest(&mut newest, *id, snapshot, source, hostname),
                // Forgotten since, or damaged: the scan below decides.
                Err(error) => {
                    tracing::debug!(head = %id, %error, "a head's snapshot cannot be read")
                }
            }
        }
        if newest.is_none() {
            newest = self.scan_newest_snapshot_of(source, hostname).await?;
        }
        Ok(SourceHeads { newest, listed })
    }

    /// The snapshots the heads of `source` from `hostname` name; none when
    /// they cannot be listed (a head only spares reads: without one every
    /// snapshot is read for the parent, and the new head replaces none).
    pub async fn heads_of(&self, source: &str, hostname: &str) -> Vec<ObjectId> {
        let prefix = format!(
            "{}{}/",
            repo::HEAD_PREFIX,
            self.source_group(source, hostname)
        );
        match self.store.list(&prefix).await {
            Ok(objects) => objects
                .iter()
                .filter_map(|meta| repo::id_from_key(&meta.key, &prefix))
                .collect(),
            Err(error) => {
                tracing::warn!(%error, "the heads of {source} cannot be listed");
                Vec::new()
            }
        }
    }

    /// The newest snapshot of `source` from `hostname` from every
    /// snapshot, holding only the newest so far (snapshots that cannot be
    /// read are passed over, as in [`Repository::list_snapshots`]).
    async fn scan_newest_snapshot_of(
        &self,
        source: &str,
        hostname: &str,
    ) -> Result<Option<(ObjectId, Snapshot)>, EngineError> {
        let mut newest = None;
        self.each_snapshot(|id, result| {
            if let Ok(snapshot) = result {
                keep_newest(&mut newest, id, snapshot, source, hostname);
            }
        })
        .await?;
        Ok(newest)
    }

    /// Make `id` the head of `source` from `hostname`, and delete the heads
    /// it replaces: those its backup listed before it started
    /// ([`SourceHeads::listed`]), all of snapshots written before. A head
    /// written meanwhile by another backup of the same source is left: the
    /// next reader takes the newer of the two.
    pub async fn replace_heads(
        &self,
        source: &str,
        hostname: &str,
        id: &ObjectId,
        replaced: &[ObjectId],
    ) -> Result<(), EngineError> {
        let group = self.source_group(source, hostname);
        put_object(&self.store, &repo::head_key(&group, id), Vec::new(), || {
            format!("write the head of snapshot {id}")
        })
        .await?;
        for old in replaced.iter().filter(|old| *old != id) {
            match self.store.delete(&repo::head_key(&group, old)).await {
                Ok(()) => {}
                Err(error) if error.is_not_found() => {}
                Err(error) => {
                    return Err(EngineError::store(
                        format!("delete the head of snapshot {old}"),
                        error,
                    ));
                }
            }
        }
        Ok(())
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
        let mut good = Vec::new();
        let mut bad = Vec::new();
        self.each_snapshot(|id, result| match result {
            Ok(snapshot) => good.push((id, snapshot)),
            Err(error) => bad.push(error),
        })
        .await?;
        good.sort_by(|(a_id, a), (b_id, b)| snapshot_order(a_id, a).cmp(&snapshot_order(b_id, b)));
        Ok((good, bad))
    }

    /// Read every snapshot, a few at once, and hand each to `visit` as it
    /// comes: its id, and the snapshot or why it cannot be read.
    async fn each_snapshot(
        &self,
        visit: impl FnMut(ObjectId, Result<Snapshot, EngineError>),
    ) -> Result<(), EngineError> {
        let ids = self.snapshot_ids().await?;
        self.each_snapshot_of(ids, visit).await;
        Ok(())
    }

    /// Read the snapshots `ids`, a few at once, and hand each to `visit`
    /// as it comes: its id, and the snapshot or why it cannot be read.
    pub(crate) async fn each_snapshot_of(
        &self,
        ids: Vec<ObjectId>,
        mut visit: impl FnMut(ObjectId, Result<Snapshot, EngineError>),
    ) {
        let mut loads = futures::stream::iter(ids)
            .map(|id| async move { (id, self.load_snapshot(&id).await) })
            .buffer_unordered(LOAD_CONCURRENCY);
        while let Some((id, result)) = loads.next().await {
            visit(id, result);
        }
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

/// The bytes of the index files in `store` (one listing of `index/`):
/// the stage pods' memory plan counts the index every agent loads by them
/// (`api::transfer::AgentMemory`).
pub async fn index_file_bytes(
    store: &dyn crate::store::ObjectStore,
) -> Result<u64, crate::store::StoreError> {
    Ok(store
        .list(INDEX_PREFIX)
        .await?
        .iter()
        .map(|meta| meta.size)
        .sum())
}

/// What [`Repository::newest_snapshot_of`] found.
#[derive(Debug, Default)]
pub struct SourceHeads {
    /// The source's newest snapshot, if it has one.
    pub newest: Option<(ObjectId, Snapshot)>,
    /// The heads listed (readable or not), which a new head replaces.
    pub listed: Vec<ObjectId>,
}

/// The order of snapshots, oldest first: by time, then id.
fn snapshot_order<'a>(id: &'a ObjectId, snapshot: &'a Snapshot) -> (&'a str, &'a ObjectId) {
    (&snapshot.time, id)
}

/// Keep `snapshot` in `newest` when it is of `source` from `hostname` and
/// newer ([`snapshot_order`]).
fn keep_newest(
    newest: &mut Option<(ObjectId, Snapshot)>,
    id: ObjectId,
    snapshot: Snapshot,
    source: &str,
    hostname: &str,
) {
    if snapshot.source != source || snapshot.hostname != hostname {
        return;
    }
    let newer = newest.as_ref().is_none_or(|(kept_id, kept)| {
        snapshot_order(&id, &snapshot) > snapshot_order(kept_id, kept)
    });
    if newer {
        *newest = Some((id, snapshot));
    }
}

/// Every key file that decodes, with its id; a file that does not match its
/// name or does not decode is skipped (it cannot open anything).
async fn list_key_files(store: &DynStore) -> Result<Vec<(ObjectId, KeyFile)>, EngineError> {
    let objects = store
        .list(KEYS_PREFIX)
        .await
        .map_err(|error| EngineError::store("list key files", error))?;
    let mut files = Vec::new();
    for meta in objects {
        let Some(id) = keyfile::key_file_id(&meta.key) else {
            continue;
        };
        let bytes = match store.get(&meta.key, None).await {
            Ok(bytes) => bytes,
            Err(error) if error.is_not_found() => continue,
            Err(error) => {
                return Err(EngineError::store(format!("read key file {id}"), error));
            }
        };
        if ObjectId::of(&bytes) != id {
            tracing::warn!(key = %id, "key file does not match its name, skipped");
            continue;
        }
        match KeyFile::decode(&bytes) {
            Ok(file) => files.push((id, file)),
            Err(error @ KeyFileError::TooNew { .. }) => {
                tracing::warn!(key = %id, %error, "key file skipped");
            }
            Err(error) => tracing::warn!(key = %id, %error, "key file skipped"),
        }
    }
    files.sort_by_key(|(id, _)| *id);
    Ok(files)
}

thread_local! {
    /// A zstd decompression context per thread: creating one per blob costs
    /// more than decoding a small blob.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// Decompress one zstd frame into `out` (empty), which never grows: the
/// frame must fit the capacity the caller reserved (at least the blob's
/// length), or decoding fails.
fn decompress_with_thread_context(frame: &[u8], out: &mut Vec<u8>) -> std::io::Result<()> {
    DECOMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        let decompressor = match cell.as_mut() {
            Some(decompressor) => decompressor,
            None => cell.insert(zstd::bulk::Decompressor::new()?),
        };
        decompressor.decompress_to_buffer(frame, out).map(|_| ())
    })
}

/// Store an object that may be overwritten (named by its content, or
/// replaced whole); `action` says what was being done, for the error.
async fn put_object(
    store: &DynStore,
    key: &str,
    bytes: Vec<u8>,
    action: impl FnOnce() -> String,
) -> Result<(), EngineError> {
    put_object_reclaiming(store, key, bytes, action).await?;
    Ok(())
}

/// [`put_object`], handing the buffer back once the store let go of it.
async fn put_object_reclaiming(
    store: &DynStore,
    key: &str,
    bytes: Vec<u8>,
    action: impl FnOnce() -> String,
) -> Result<Option<Vec<u8>>, EngineError> {
    let bytes = Bytes::from(bytes);
    store
        .put(key, bytes.clone(), PutMode::Overwrite)
        .await
        .map_err(|error| EngineError::store(action(), error))?;
    Ok(bytes.try_into_mut().ok().map(Vec::from))
}
