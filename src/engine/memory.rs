//! The memory one engine (a backup or a restore, with its verification)
//! may use for its buffers, and the sizes of those buffers that follow
//! from it. One place decides them, so that several engines in one
//! process (the volumes a stage pod's agent moves at once) can share the
//! process's budget: each is given a share ([`EngineMemory`]), and every
//! buffer of its own is sized from that share.
//!
//! The default share is what one engine alone had before shares existed
//! (a backup's 16 MiB packs and 16 MiB of chunks in flight, a restore's
//! whole-pack reads), so the CLI, which runs one engine, is unchanged,
//! except that into S3 it holds 12 MiB of chunks in flight and uploads two
//! packs at once ([`BackupBuffers::pack_uploads`]). A
//! smaller share closes data packs before they pass a smaller target,
//! keeps fewer chunks and pack reads in flight, writes with fewer scatter
//! workers and batches fewer files; none of that changes what is stored
//! or restored, only how much of it is held at once. The parts are those
//! of one engine in the repository as it is configured: a repository
//! whose packs aim at more than the default 16 MiB takes proportionally
//! more in every share (its packs shrink only below the default share).
//! The figures behind
//! the split are in docs/benchmarks.md ("Several volumes in one stage
//! pod").

use haulage_api::transfer::{DEFAULT_VOLUME_SHARE_BYTES, SMALLEST_VOLUME_SHARE_BYTES};

use super::restore::{
    BATCH_BOOKKEEPING_BYTES, DECODE_BUFFER_BYTES, MAX_BATCH_CHUNKS, MAX_BATCH_FILES,
    MAX_PACK_READ_BYTES, PACK_BYTES_IN_FLIGHT, TREE_LOOKAHEAD_BYTES,
};
use super::tree_cache::VERIFY_TREE_CACHE_BYTES;
use super::tree_packs::TREE_PACKS_HELD_BYTES;
use super::verify_tree::{PARALLEL_FILE_CHECKS, READ_BYTES};

const MIB: u64 = 1024 * 1024;

/// A backup's chunk plaintext bytes between reading and packing with the
/// default share. With 4 MiB maximum chunks this is at least 4 chunks in
/// flight (16 with the 1 MiB average), enough to keep two cores busy, and
/// bounds the pipeline's chunk memory.
const CHUNK_BYTES_IN_FLIGHT: u64 = 16 * MIB;
/// The same with the default share into a remote store, where 4 MiB of
/// chunks and four of the buffers kept make room for a second pack upload
/// in flight ([`BackupBuffers::pack_uploads`]).
const REMOTE_CHUNK_BYTES_IN_FLIGHT: u64 = 12 * MIB;
/// Idle chunk buffers a backup keeps for reuse with the default share:
/// enough for the chunks and compressed outputs in flight with average
/// chunks.
const CHUNK_BUFFERS_KEPT: usize = 6;
/// Target of a pack of tree blobs with the default share.
const TREE_PACK_TARGET_BYTES: u64 = 4 * MIB;
/// The least target of a tree pack.
const SMALLEST_TREE_PACK_TARGET_BYTES: u64 = MIB;
/// The least files of a restore's batch.
const SMALLEST_BATCH_FILES: u64 = 512;
/// The least trees kept for a verification.
const SMALLEST_VERIFY_TREE_CACHE_BYTES: u64 = MIB;
/// The least raw bytes of subtree windows a restore loads ahead.
const SMALLEST_TREE_LOOKAHEAD_BYTES: u64 = 256 * 1024;
/// The least bytes of tree packs a restore holds: a pack of trees as the
/// smallest share writes it (1 MiB, and the blob that passed that).
const SMALLEST_TREE_PACKS_HELD_BYTES: u64 = 2 * MIB;

/// Bytes of buffers one engine may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineMemory {
    bytes: u64,
}

impl Default for EngineMemory {
    fn default() -> Self {
        EngineMemory {
            bytes: DEFAULT_VOLUME_SHARE_BYTES,
        }
    }
}

/// The buffers of a backup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BackupBuffers {
    /// Chunk bytes read and not yet packed (buffer capacity counted).
    pub chunk_bytes_in_flight: u32,
    /// Chunk buffers kept for reuse.
    pub chunk_buffers_kept: usize,
    /// A data pack closes once it holds this much (at most the
    /// repository's target), or before a blob that would take it past its
    /// buffer.
    pub data_pack_target_bytes: usize,
    /// The capacity of a data pack's buffer (one filled, and one for
    /// each upload in flight).
    pub data_pack_buffer_bytes: usize,
    /// Packs uploaded at once (data packs, and tree packs in the same
    /// places): two into a remote store with the whole
    /// default share (one engine alone: the CLI, or an agent whose stage
    /// pod has 130 MiB or more and moves one volume), when it holds a
    /// third data pack buffer (packs that aim at 19 MiB or less); else
    /// one. Each S3
    /// PUT is answered only once the server has stored the object; with
    /// one in flight the pipeline waited for every pack's answer (a first
    /// backup to MinIO on this machine took 5.48 s with one, 4.74 s with
    /// two, docs/benchmarks.md). A local directory's write is not worth
    /// the memory: the same trade made a backup to disk 3 % slower.
    pub pack_uploads: usize,
    /// A tree pack closes once it holds this much.
    pub tree_pack_target_bytes: usize,
}

/// The buffers of a restore and of its verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RestoreBuffers {
    /// Longest single pack read.
    pub max_pack_read_bytes: u64,
    /// Capacity of all pack read buffers together.
    pub pack_bytes_in_flight: u64,
    /// Plaintext buffers of all scatter workers together.
    pub decode_buffer_bytes: u64,
    /// Files of one batch.
    pub batch_files: usize,
    /// Chunks of one batch.
    pub batch_chunks: usize,
    /// Raw bytes of the subtree windows loaded ahead of the walk.
    pub tree_lookahead_bytes: u64,
    /// Bytes of packs of trees read whole and held.
    pub tree_packs_held_bytes: u64,
}

/// Room in a pack's buffer for its trailer (a pack's trailer is a few
/// dozen bytes per blob).
pub(crate) const PACK_TRAILER_ROOM: usize = 64 * 1024;

impl EngineMemory {
    /// A share of `bytes`, at least [`SMALLEST_VOLUME_SHARE_BYTES`] (below
    /// that an engine cannot hold a largest chunk, a pack and a read) and
    /// at most [`DEFAULT_VOLUME_SHARE_BYTES`] (one engine alone, whose
    /// buffers grow no further).
    pub fn new(bytes: u64) -> Self {
        EngineMemory {
            bytes: bytes.clamp(SMALLEST_VOLUME_SHARE_BYTES, DEFAULT_VOLUME_SHARE_BYTES),
        }
    }

    /// The bytes of the share.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What this share gives to a part that takes `default_bytes` of the
    /// default share: the same proportion.
    fn part(&self, default_bytes: u64) -> u64 {
        (u128::from(self.bytes) * u128::from(default_bytes)
            / u128::from(DEFAULT_VOLUME_SHARE_BYTES)) as u64
    }

    /// A backup's buffers in a repository whose largest stored chunk
    /// takes `max_chunk_buffer` bytes and whose packs aim at
    /// `pack_target` bytes, into a remote store (S3) or a local one. Every
    /// share holds the walker's read buffer and one compression output (a
    /// largest chunk each). The default share gives 16 MiB of chunks in
    /// flight, six buffers kept, and packs of the repository's target
    /// closed after the blob that reaches it (their buffer has room for a
    /// largest chunk past it), one uploaded while the next fills: 92 MiB
    /// with two data packs and a tree pack. Into a remote store it gives 12
    /// MiB of chunks in flight and two buffers kept instead, so that a
    /// third data pack fits and two uploads are in flight: 92 MiB again. A
    /// smaller share (an agent of the default 128Mi gives its one volume 92
    /// MiB) uploads one pack at a time, scales the chunks in
    /// flight and the packs down, to one largest chunk in flight, data
    /// packs of a largest chunk whose buffer has no room past the target
    /// (a pack closes before a blob that would not fit) and tree packs of
    /// 1 MiB, and keeps as many buffers as the rest holds (none in the
    /// smallest).
    pub(crate) fn backup(
        &self,
        max_chunk_buffer: usize,
        pack_target: usize,
        remote_store: bool,
    ) -> BackupBuffers {
        let max_chunk = max_chunk_buffer as u64;
        let working = 2 * max_chunk;
        let default_pack_buffer = pack_target + max_chunk_buffer + PACK_TRAILER_ROOM;
        let tree_pack_target_bytes = self
            .part(TREE_PACK_TARGET_BYTES)
            .clamp(SMALLEST_TREE_PACK_TARGET_BYTES, TREE_PACK_TARGET_BYTES)
            as usize;
        let tree_pack = (tree_pack_target_bytes + PACK_TRAILER_ROOM) as u64;
        // Into a remote store, with the whole default share, a second
        // upload when three full data packs fit beside fewer chunks in
        // flight. Not with less: an agent of the default 128Mi gives its
        // one volume 92 MiB, and a stage pod's agent backing up a claim of
        // random data alone peaked at 127.6 MiB of its 128Mi request
        // (docs/benchmarks.md, "The agent's memory in its cgroup").
        let two_uploads = (remote_store && self.bytes >= DEFAULT_VOLUME_SHARE_BYTES)
            .then(|| REMOTE_CHUNK_BYTES_IN_FLIGHT.max(max_chunk))
            .filter(|chunks| {
                working + chunks + 3 * default_pack_buffer as u64 + tree_pack <= self.bytes
            });
        let (chunk_bytes_in_flight, data_pack_target_bytes, data_pack_buffer_bytes, pack_uploads) =
            match two_uploads {
                Some(chunks) => (chunks, pack_target, default_pack_buffer, 2),
                None => {
                    let chunks = self
                        .part(CHUNK_BYTES_IN_FLIGHT)
                        .min(CHUNK_BYTES_IN_FLIGHT)
                        .max(max_chunk);
                    // Two data packs (one filled, one uploaded).
                    let pack_room = (self.part(2 * default_pack_buffer as u64) / 2) as usize;
                    if pack_room >= default_pack_buffer {
                        (chunks, pack_target, default_pack_buffer, 1)
                    } else {
                        let buffer = pack_room.max(max_chunk_buffer + PACK_TRAILER_ROOM);
                        let target = (buffer - PACK_TRAILER_ROOM).min(pack_target);
                        (chunks, target, buffer, 1)
                    }
                }
            };
        let rest = self.bytes.saturating_sub(
            working
                + chunk_bytes_in_flight
                + (1 + pack_uploads as u64) * data_pack_buffer_bytes as u64
                + tree_pack,
        );
        let chunk_buffers_kept = (rest / max_chunk.max(1)).min(CHUNK_BUFFERS_KEPT as u64) as usize;
        BackupBuffers {
            chunk_bytes_in_flight: u32::try_from(chunk_bytes_in_flight).unwrap_or(u32::MAX),
            chunk_buffers_kept,
            data_pack_target_bytes,
            data_pack_buffer_bytes,
            pack_uploads,
            tree_pack_target_bytes,
        }
    }

    /// A restore's buffers in a repository whose largest chunk is
    /// `max_chunk` bytes and whose largest stored blob takes
    /// `max_blob_read` bytes. The default share gives whole-pack reads of
    /// 21 MiB, two of them in flight, 16 MiB for the scatter workers,
    /// batches of 4,096 files and 16,384 chunks (24 MiB of bookkeeping)
    /// (see [`EngineMemory::verify_tree_cache_bytes`]) 5 MiB of trees
    /// kept for the verification, 2 MiB of subtree windows loaded ahead
    /// of the walk and 5 MiB of tree packs held whole: 94 MiB. A smaller
    /// share reads packs in several ranges of at least a largest blob,
    /// writes with fewer workers (at least one), batches fewer files (at
    /// least 512), keeps fewer trees (at least 1 MiB), loads fewer ahead
    /// (at least 256 KiB) and holds fewer tree packs (at least 2 MiB).
    pub(crate) fn restore(&self, max_chunk: u64, max_blob_read: u64) -> RestoreBuffers {
        let reads = PACK_BYTES_IN_FLIGHT / MAX_PACK_READ_BYTES;
        let max_pack_read_bytes = (self.part(PACK_BYTES_IN_FLIGHT) / reads)
            .clamp(max_blob_read, MAX_PACK_READ_BYTES.max(max_blob_read));
        let decode_buffer_bytes = self
            .part(DECODE_BUFFER_BYTES)
            .clamp(max_chunk, DECODE_BUFFER_BYTES.max(max_chunk));
        let tree_lookahead_bytes = self
            .part(TREE_LOOKAHEAD_BYTES)
            .clamp(SMALLEST_TREE_LOOKAHEAD_BYTES, TREE_LOOKAHEAD_BYTES);
        let tree_packs_held_bytes = self
            .part(TREE_PACKS_HELD_BYTES)
            .clamp(SMALLEST_TREE_PACKS_HELD_BYTES, TREE_PACKS_HELD_BYTES);
        // The batches get what the reads, the workers and the trees kept,
        // loaded ahead and held leave (a worker holds a largest chunk
        // however small the share).
        let batch_bytes = self.bytes.saturating_sub(
            reads * max_pack_read_bytes
                + decode_buffer_bytes
                + self.verify_tree_cache_bytes()
                + tree_lookahead_bytes
                + tree_packs_held_bytes,
        );
        let batch_files = (batch_bytes * MAX_BATCH_FILES as u64 / BATCH_BOOKKEEPING_BYTES)
            .clamp(SMALLEST_BATCH_FILES, MAX_BATCH_FILES as u64) as usize;
        RestoreBuffers {
            max_pack_read_bytes,
            pack_bytes_in_flight: reads * max_pack_read_bytes,
            decode_buffer_bytes,
            batch_files,
            batch_chunks: batch_files * (MAX_BATCH_CHUNKS / MAX_BATCH_FILES),
            tree_lookahead_bytes,
            tree_packs_held_bytes,
        }
    }

    /// Files a verification re-reads at once, each with a read buffer of
    /// a few MiB: four with the default share, at least one. It runs after
    /// the restore's buffers are freed, beside the trees kept.
    pub fn verify_parallel_checks(&self) -> usize {
        (self.part((PARALLEL_FILE_CHECKS * READ_BYTES) as u64) / READ_BYTES as u64)
            .clamp(1, PARALLEL_FILE_CHECKS as u64) as usize
    }

    /// Raw tree bytes a restore keeps for the verification after it: 5
    /// MiB with the default share (the trees of about 25,000 files), at
    /// least 1 MiB.
    pub fn verify_tree_cache_bytes(&self) -> u64 {
        self.part(VERIFY_TREE_CACHE_BYTES)
            .clamp(SMALLEST_VERIFY_TREE_CACHE_BYTES, VERIFY_TREE_CACHE_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_CHUNK: u64 = 4 * MIB;
    /// zstd's bound for a largest chunk, and the blob's framing.
    const MAX_CHUNK_BUFFER: usize = 4 * 1024 * 1024 + 16 * 1024 + 64;
    const PACK_TARGET: usize = 16 * 1024 * 1024;

    #[test]
    fn the_default_share_gives_the_buffers_one_engine_always_had() {
        let backup = EngineMemory::default().backup(MAX_CHUNK_BUFFER, PACK_TARGET, false);
        assert_eq!(backup.chunk_bytes_in_flight, 16 << 20);
        assert_eq!(backup.chunk_buffers_kept, 6, "{backup:?}");
        assert_eq!(backup.pack_uploads, 1);
        assert_eq!(backup.data_pack_target_bytes, PACK_TARGET);
        assert_eq!(
            backup.data_pack_buffer_bytes,
            PACK_TARGET + MAX_CHUNK_BUFFER + PACK_TRAILER_ROOM
        );
        assert_eq!(backup.tree_pack_target_bytes, 4 << 20);
        let restore = EngineMemory::default().restore(MAX_CHUNK, MAX_CHUNK + MIB / 64);
        assert_eq!(restore.max_pack_read_bytes, 21 * MIB);
        assert_eq!(restore.pack_bytes_in_flight, 42 * MIB);
        assert_eq!(restore.decode_buffer_bytes, 16 * MIB);
        assert_eq!((restore.batch_files, restore.batch_chunks), (4_096, 16_384));
        assert_eq!(restore.tree_lookahead_bytes, 2 * MIB);
        assert_eq!(restore.tree_packs_held_bytes, 5 * MIB);
        assert_eq!(EngineMemory::default().verify_tree_cache_bytes(), 5 * MIB);
        assert_eq!(EngineMemory::default().verify_parallel_checks(), 4);
    }

    #[test]
    fn the_default_share_uploads_two_packs_at_once_into_a_remote_store() {
        let local = EngineMemory::default().backup(MAX_CHUNK_BUFFER, PACK_TARGET, false);
        let remote = EngineMemory::default().backup(MAX_CHUNK_BUFFER, PACK_TARGET, true);
        assert_eq!(remote.pack_uploads, 2, "{remote:?}");
        assert_eq!(remote.chunk_bytes_in_flight, 12 << 20);
        assert_eq!(remote.chunk_buffers_kept, 2, "{remote:?}");
        // The same packs, and what the third costs taken from the chunks.
        assert_eq!(remote.data_pack_target_bytes, local.data_pack_target_bytes);
        assert_eq!(remote.data_pack_buffer_bytes, local.data_pack_buffer_bytes);
        assert_eq!(remote.tree_pack_target_bytes, local.tree_pack_target_bytes);
        assert!(
            backup_total(&remote, MAX_CHUNK_BUFFER) <= DEFAULT_VOLUME_SHARE_BYTES,
            "{remote:?}"
        );
        // Less than the whole default share: one upload at a time, as
        // into a local store. That is the share of one volume in an agent
        // of the default 128Mi (whose peak has no room for a third pack),
        // and of several.
        let one_volume_of_an_agent =
            haulage_api::transfer::AgentMemory::of_budget(128 * MIB).volume_share_bytes(1);
        for share in [one_volume_of_an_agent, DEFAULT_VOLUME_SHARE_BYTES / 2] {
            let smaller = EngineMemory::new(share);
            assert_eq!(
                smaller.backup(MAX_CHUNK_BUFFER, PACK_TARGET, true),
                smaller.backup(MAX_CHUNK_BUFFER, PACK_TARGET, false)
            );
        }
    }

    /// What the buffers of one engine add up to: the walker's buffer and a
    /// compression output, the data packs (one filled, one for each upload
    /// in flight), the tree pack, the chunks in
    /// flight and kept; the reads, the workers'
    /// buffers, the batches, the trees kept, those loaded ahead and the
    /// tree packs held.
    fn backup_total(buffers: &BackupBuffers, max_chunk_buffer: usize) -> u64 {
        2 * max_chunk_buffer as u64
            + (1 + buffers.pack_uploads as u64) * buffers.data_pack_buffer_bytes as u64
            + (buffers.tree_pack_target_bytes + PACK_TRAILER_ROOM) as u64
            + u64::from(buffers.chunk_bytes_in_flight)
            + (buffers.chunk_buffers_kept * max_chunk_buffer) as u64
    }

    fn restore_total(buffers: &RestoreBuffers, memory: &EngineMemory) -> u64 {
        buffers.pack_bytes_in_flight
            + buffers.decode_buffer_bytes
            + buffers.batch_files as u64 * BATCH_BOOKKEEPING_BYTES / MAX_BATCH_FILES as u64
            + memory.verify_tree_cache_bytes()
            + buffers.tree_lookahead_bytes
            + buffers.tree_packs_held_bytes
    }

    #[test]
    fn every_share_holds_its_buffers_and_a_largest_chunk() {
        let mut share = SMALLEST_VOLUME_SHARE_BYTES;
        while share <= 2 * DEFAULT_VOLUME_SHARE_BYTES {
            let memory = EngineMemory::new(share);
            for remote_store in [false, true] {
                let backup = memory.backup(MAX_CHUNK_BUFFER, PACK_TARGET, remote_store);
                assert!(
                    backup_total(&backup, MAX_CHUNK_BUFFER) <= share,
                    "a backup in {share} bytes holds {} ({backup:?})",
                    backup_total(&backup, MAX_CHUNK_BUFFER)
                );
                assert!(u64::from(backup.chunk_bytes_in_flight) >= MAX_CHUNK_BUFFER as u64);
                assert!(backup.data_pack_buffer_bytes >= MAX_CHUNK_BUFFER + PACK_TRAILER_ROOM);
                assert!(backup.data_pack_target_bytes <= PACK_TARGET);
                assert!((1..=2).contains(&backup.pack_uploads));
            }
            let restore = memory.restore(MAX_CHUNK, MAX_CHUNK_BUFFER as u64);
            assert!(
                restore_total(&restore, &memory) <= share,
                "a restore in {share} bytes holds {} ({restore:?})",
                restore_total(&restore, &memory)
            );
            assert!(restore.max_pack_read_bytes >= MAX_CHUNK_BUFFER as u64);
            assert!(restore.tree_lookahead_bytes >= SMALLEST_TREE_LOOKAHEAD_BYTES);
            assert!(restore.tree_packs_held_bytes >= SMALLEST_TREE_PACKS_HELD_BYTES);
            let verification = memory.verify_parallel_checks() as u64 * READ_BYTES as u64
                + memory.verify_tree_cache_bytes();
            assert!(
                verification <= share,
                "a verification in {share} bytes holds {verification}"
            );
            assert!(restore.decode_buffer_bytes >= MAX_CHUNK);
            share += MIB / 2;
        }
    }

    /// A repository may cut chunks of up to 16 MiB (FastCDC's largest) and
    /// aim at packs of up to a gigabyte: every share plans a backup for
    /// it, with a largest chunk in flight at least, and two uploads only
    /// where the three packs fit in the share.
    #[test]
    fn every_chunk_and_pack_size_a_repository_takes_gets_a_plan() {
        for max_chunk in [64 * 1024, MAX_CHUNK, 12 * MIB, 16 * MIB] {
            let max_chunk_buffer = zstd::zstd_safe::compress_bound(max_chunk as usize) + 64;
            for pack_target in [MIB, 16 * MIB, 64 * MIB, 1024 * MIB] {
                for share in [
                    SMALLEST_VOLUME_SHARE_BYTES,
                    DEFAULT_VOLUME_SHARE_BYTES / 2,
                    DEFAULT_VOLUME_SHARE_BYTES,
                ] {
                    for remote_store in [false, true] {
                        let backup = EngineMemory::new(share).backup(
                            max_chunk_buffer,
                            pack_target as usize,
                            remote_store,
                        );
                        assert!(
                            u64::from(backup.chunk_bytes_in_flight) >= max_chunk_buffer as u64,
                            "{backup:?}"
                        );
                        if backup.pack_uploads == 2 {
                            assert!(remote_store);
                            assert!(
                                backup_total(&backup, max_chunk_buffer) <= share,
                                "{backup:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_share_below_the_smallest_is_the_smallest() {
        assert_eq!(
            EngineMemory::new(0),
            EngineMemory::new(SMALLEST_VOLUME_SHARE_BYTES)
        );
    }
}
