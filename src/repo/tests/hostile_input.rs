//! Hostile bytes given to every parser of the repository format: arbitrary
//! input, and valid objects with bytes flipped, cut, repeated or inserted.
//! Whoever can write to the bucket can put these in front of a restore, so
//! each parser must answer with an error (or a value), never panic, and
//! never hold more memory than a stated bound while it reads them.
//!
//! The bound is [`bound_for`]: 64 bytes per input byte plus 4 MiB, and for
//! the parsers that decompress (a format 1 index file) the decompression
//! cap on top. A parser that allocates beyond it fails the run naming the
//! input.
//!
//! The count of cases per parser is proptest's (`PROPTEST_CASES`, 256 by
//! default); run longer with, for example,
//! `PROPTEST_CASES=20000 cargo test --release -p haulage-repo --test hostile_input`
//! (docs/testing.md).

use std::alloc::System;

use haulage_repo::codec::{ObjectCodec, RecordKind};
use haulage_repo::config::RepoConfig;
use haulage_repo::crypto::MasterKey;
use haulage_repo::index::IndexFile;
use haulage_repo::keyfile::{KdfParameters, KeyFile, KeyFileOrigin};
use haulage_repo::lock::LockRecord;
use haulage_repo::pack::{self, PackEntry};
use haulage_repo::prune::DeletionCandidates;
use haulage_repo::snapshot::{Snapshot, SnapshotSummary};
use haulage_repo::tree::Tree;
use haulage_repo::{BlobId, BlobKind, Compression};
use peakmem_alloc::{PeakMemAlloc, PeakMemAllocTrait};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_bytes::ByteBuf;

/// Counts the bytes allocated, so a case can see the most it held: the
/// peak is reset before each case, so every case is measured on its own.
#[global_allocator]
static ALLOCATOR: &PeakMemAlloc<System> = &peakmem_alloc::INSTRUMENTED_SYSTEM;

/// The most a parser may hold at once while reading `input_length` bytes:
/// 64 bytes per input byte plus 4 MiB, plus `decompressed` for a parser
/// that inflates its input (capped by the format).
fn bound_for(input_length: usize, decompressed: usize) -> usize {
    64 * input_length + (4 << 20) + decompressed
}

/// Run `parse` on `input` and fail when it held more than its bound. Only
/// this test runs in its binary (one `#[test]`), so the allocator's peak
/// (reset before each case) is the parser's own.
fn within_bound(what: &str, input: &[u8], decompressed: usize, parse: impl FnOnce(&[u8])) {
    ALLOCATOR.reset_peak_memory();
    parse(input);
    let held = ALLOCATOR.get_peak_memory();
    let bound = bound_for(input.len(), decompressed);
    assert!(
        held <= bound,
        "{what}: reading {} hostile bytes held {held} bytes at once, above its bound of {bound}: {:02x?}",
        input.len(),
        &input[..input.len().min(64)]
    );
}

fn rng() -> StdRng {
    StdRng::seed_from_u64(7)
}

fn master() -> MasterKey {
    MasterKey::from_bytes([9; 32])
}

fn sealed_codec() -> ObjectCodec {
    ObjectCodec::Sealed(std::sync::Arc::new(master().object_key()))
}

fn entries() -> Vec<(BlobId, BlobKind, Compression, Vec<u8>)> {
    vec![
        (
            BlobId([1; 32]),
            BlobKind::Data,
            Compression::None,
            b"hello".to_vec(),
        ),
        (
            BlobId([2; 32]),
            BlobKind::Tree,
            Compression::Zstd,
            vec![7; 40],
        ),
        (
            BlobId([3; 32]),
            BlobKind::Data,
            Compression::None,
            Vec::new(),
        ),
    ]
}

fn pack_bytes(codec: &ObjectCodec) -> (Vec<u8>, Vec<PackEntry>) {
    let mut writer = codec.pack_writer(1024);
    for (id, kind, compression, bytes) in entries() {
        writer.add(id, kind, compression, &bytes, bytes.len() as u32);
    }
    let finished = codec.finish_pack(writer, &mut rng());
    (finished.bytes, finished.entries)
}

fn index_file() -> IndexFile {
    let (_, entries) = pack_bytes(&ObjectCodec::Plaintext);
    IndexFile {
        packs: vec![
            (haulage_repo::ObjectId([4; 32]), entries.clone()),
            (haulage_repo::ObjectId([5; 32]), entries),
        ],
    }
}

fn snapshot() -> Snapshot {
    Snapshot {
        format_version: 1,
        time: "2026-12-01T10:00:00Z".into(),
        hostname: "stage-pod".into(),
        source: "shop/data".into(),
        tree: BlobId([6; 32]),
        root: Default::default(),
        parent: None,
        tags: [("pass".to_string(), "1".to_string())].into(),
        claim: None,
        summary: SnapshotSummary {
            files: 3,
            total_bytes: 45,
            ..SnapshotSummary::default()
        },
    }
}

fn tree() -> Tree {
    let mut file = snapshot().root_attributes();
    file.name = ByteBuf::from(b"a-file".to_vec());
    file.kind = haulage_repo::tree::EntryKind::File;
    file.size = 5;
    let mut directory = snapshot().root_attributes();
    directory.name = ByteBuf::from(b"sub".to_vec());
    directory.subtree = Some(BlobId([8; 32]));
    Tree {
        entries: vec![file, directory],
    }
}

fn key_file() -> Vec<u8> {
    let origin = KeyFileOrigin {
        created: "2026-12-01T10:00:00Z".into(),
        hostname: "host".into(),
        username: "user".into(),
        salt: [3; 16],
    };
    KeyFile::create(
        &mut rng(),
        &master(),
        b"password",
        "repository",
        KdfParameters::insecure_for_tests(),
        origin,
    )
    .expect("key file")
    .encode()
    .1
}

/// One valid encoding of every kind of object the repository stores, with
/// the parser that reads it back.
struct Seeds {
    plain_pack: Vec<u8>,
    sealed_pack: Vec<u8>,
    plain_index: Vec<u8>,
    sealed_index: Vec<u8>,
    tree: Vec<u8>,
    plain_snapshot: Vec<u8>,
    sealed_snapshot: Vec<u8>,
    plain_config: Vec<u8>,
    sealed_config: Vec<u8>,
    key_file: Vec<u8>,
    lock: Vec<u8>,
    sealed_lock: Vec<u8>,
    candidates: Vec<u8>,
}

fn seeds() -> Seeds {
    let sealed = sealed_codec();
    let lock = LockRecord::new(
        haulage_repo::lock::LockKind::Shared,
        "host",
        7,
        "backup",
        1_000,
    )
    .to_json();
    Seeds {
        plain_pack: pack_bytes(&ObjectCodec::Plaintext).0,
        sealed_pack: pack_bytes(&sealed).0,
        plain_index: index_file().encode().1,
        sealed_index: sealed.encode_index(&index_file(), &mut rng()).1,
        tree: tree().encode(),
        plain_snapshot: snapshot().encode().1,
        sealed_snapshot: sealed.encode_snapshot(&snapshot(), &mut rng()).1,
        plain_config: RepoConfig::generate(&mut rng()).to_json(),
        sealed_config: RepoConfig::generate_encrypted(&mut rng(), &master()).to_json(),
        key_file: key_file(),
        sealed_lock: sealed.encode_record(RecordKind::Lock, &lock, &mut rng()),
        lock,
        candidates: DeletionCandidates::default().to_json(),
    }
}

/// Every parser of the format on `input`, in both formats where there are
/// two.
fn parse_everything(input: &[u8]) {
    let plain = ObjectCodec::Plaintext;
    let sealed = sealed_codec();
    let length = input.len() as u64;
    for codec in [&plain, &sealed] {
        within_bound("pack", input, 0, |input| {
            let _ = codec.decode_pack(input, "hostile");
        });
        within_bound("pack trailer", input, 0, |input| {
            if let Ok(trailer) = codec.pack_trailer_length(input, "hostile") {
                let from = input.len().saturating_sub(trailer);
                let _ = codec.decode_pack_trailer(&input[from..], length, "hostile");
            }
            let _ = codec.decode_pack_trailer(input, length, "hostile");
        });
        within_bound("index file", input, INDEX_DECOMPRESSED_BOUND, |input| {
            let _ = codec.decode_index(input, "hostile");
        });
        within_bound("snapshot manifest", input, 0, |input| {
            let _ = codec.decode_snapshot(input);
        });
        within_bound("lock", input, 0, |input| {
            if let Ok(json) = codec.decode_record(RecordKind::Lock, input) {
                let _ = LockRecord::from_json(&json);
            }
        });
    }
    within_bound("tree", input, 0, |input| {
        let _ = Tree::decode(input);
    });
    within_bound("config", input, 0, |input| {
        if let Ok(config) = RepoConfig::from_json(input) {
            let _ = config.open(Some(&master()));
            let _ = config.open(None);
        }
    });
    within_bound("key file", input, 0, |input| {
        let _ = KeyFile::decode(input);
    });
    within_bound("deletion candidates", input, 0, |input| {
        let _ = DeletionCandidates::from_json(input);
    });
    let _ = pack::trailer_length(input, "hostile");
    let _ = pack::sealed_trailer_length(input, "hostile");
}

/// What a format 1 index file may decompress to while it is read, on top
/// of [`bound_for`]: the format's cap on the decompressed body.
const INDEX_DECOMPRESSED_BOUND: usize = 1 << 30;

/// A way to damage a valid object.
#[derive(Debug, Clone)]
enum Damage {
    Flip {
        at: usize,
        bits: u8,
    },
    Cut {
        keep: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Repeat {
        from: usize,
        length: usize,
        times: usize,
    },
    Overwrite {
        at: usize,
        bytes: Vec<u8>,
    },
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, bits)| Damage::Flip { at, bits }),
        any::<usize>().prop_map(|keep| Damage::Cut { keep }),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..64)
        )
            .prop_map(|(at, bytes)| Damage::Insert { at, bytes }),
        (any::<usize>(), 1usize..64, 1usize..32).prop_map(|(from, length, times)| Damage::Repeat {
            from,
            length,
            times
        }),
        // Large counts and lengths where the formats keep their u32s.
        (
            any::<usize>(),
            prop_oneof![
                Just(vec![0xff, 0xff, 0xff, 0xff]),
                Just(vec![0xff, 0xff, 0xff, 0x7f]),
                Just(vec![0x00, 0x00, 0x01, 0x00]),
                proptest::collection::vec(any::<u8>(), 4..9),
            ]
        )
            .prop_map(|(at, bytes)| Damage::Overwrite { at, bytes }),
    ]
}

fn damaged(mut bytes: Vec<u8>, damages: &[Damage]) -> Vec<u8> {
    for damage in damages {
        if bytes.is_empty() {
            break;
        }
        let len = bytes.len();
        match damage {
            Damage::Flip { at, bits } => bytes[at % len] ^= bits,
            Damage::Cut { keep } => bytes.truncate(keep % len),
            Damage::Insert { at, bytes: new } => {
                let at = at % (len + 1);
                bytes.splice(at..at, new.iter().copied());
            }
            Damage::Repeat {
                from,
                length,
                times,
            } => {
                let from = from % len;
                let piece = bytes[from..(from + length).min(len)].to_vec();
                for _ in 0..*times {
                    bytes.splice(from..from, piece.iter().copied());
                }
            }
            Damage::Overwrite { at, bytes: new } => {
                let at = at % len;
                for (offset, byte) in new.iter().enumerate() {
                    if let Some(slot) = bytes.get_mut(at + offset) {
                        *slot = *byte;
                    }
                }
            }
        }
    }
    bytes
}

#[test]
fn every_parser_refuses_hostile_bytes_without_panicking_or_holding_more_than_its_bound() {
    let seeds = seeds();
    // The seeds themselves parse: the damaged inputs start from real objects.
    let sealed = sealed_codec();
    assert_eq!(
        ObjectCodec::Plaintext
            .decode_pack(&seeds.plain_pack, "seed")
            .expect("plain pack")
            .len(),
        3
    );
    assert_eq!(
        sealed
            .decode_pack(&seeds.sealed_pack, "seed")
            .expect("sealed pack")
            .len(),
        3
    );
    assert_eq!(
        ObjectCodec::Plaintext
            .decode_index(&seeds.plain_index, "seed")
            .expect("plain index")
            .packs
            .len(),
        2
    );
    sealed
        .decode_index(&seeds.sealed_index, "seed")
        .expect("sealed index");
    assert_eq!(Tree::decode(&seeds.tree).expect("tree"), tree());
    assert_eq!(
        Snapshot::decode(&seeds.plain_snapshot).expect("snapshot"),
        snapshot()
    );
    sealed
        .decode_snapshot(&seeds.sealed_snapshot)
        .expect("sealed snapshot");
    RepoConfig::from_json(&seeds.plain_config).expect("config");
    RepoConfig::from_json(&seeds.sealed_config).expect("sealed config");
    KeyFile::decode(&seeds.key_file).expect("key file");
    LockRecord::from_json(&seeds.lock).expect("lock");
    sealed
        .decode_record(RecordKind::Lock, &seeds.sealed_lock)
        .expect("sealed lock");
    DeletionCandidates::from_json(&seeds.candidates).expect("candidates");

    let all = [
        seeds.plain_pack,
        seeds.sealed_pack,
        seeds.plain_index,
        seeds.sealed_index,
        seeds.tree,
        seeds.plain_snapshot,
        seeds.sealed_snapshot,
        seeds.plain_config,
        seeds.sealed_config,
        seeds.key_file,
        seeds.lock,
        seeds.sealed_lock,
        seeds.candidates,
    ];
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    });
    let cases = runner.config().cases;
    // Damaged real objects: most of the hostile input a parser meets gets
    // past its first checks only this way.
    runner
        .run(
            &(0..all.len(), proptest::collection::vec(damage(), 1..4)),
            |(seed, damages)| {
                parse_everything(&damaged(all[seed].clone(), &damages));
                Ok(())
            },
        )
        .expect("damaged objects");
    // Arbitrary bytes, and bytes behind each format's magic.
    runner
        .run(
            &(
                prop_oneof![
                    Just(&b""[..]),
                    Just(&pack::PACK_MAGIC[..]),
                    Just(&pack::SEALED_PACK_MAGIC[..]),
                    Just(&haulage_repo::index::INDEX_MAGIC[..]),
                    Just(&haulage_repo::codec::SEALED_INDEX_MAGIC[..]),
                    Just(&haulage_repo::codec::SEALED_SNAPSHOT_MAGIC[..]),
                    Just(&haulage_repo::codec::SEALED_RECORD_MAGIC[..]),
                ],
                proptest::collection::vec(any::<u8>(), 0..2048),
            ),
            |(magic, rest)| {
                let mut input = magic.to_vec();
                input.extend_from_slice(&rest);
                parse_everything(&input);
                Ok(())
            },
        )
        .expect("arbitrary bytes");
    println!(
        "hostile input: {} damaged objects and {} arbitrary inputs, each through every parser: no panic, none above its bound",
        cases, cases
    );
}
