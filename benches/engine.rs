//! Per-stage CPU throughput of the backup pipeline: FastCDC chunking,
//! keyed BLAKE3, zstd at levels 1 and 3, on random and log-like data; the
//! sealing of format 2 (AES-256-GCM, as used) beside XChaCha20-Poly1305
//! (the other RustCrypto candidate, measured to choose); the whole
//! pipeline into a plaintext and an encrypted repository.
//! `cargo bench --bench engine`; figures in docs/benchmarks.md.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use haulage::repo::chunker::{Chunker, ChunkerParameters};
use haulage::repo::config::RepoConfig;
use rand::{RngCore, SeedableRng};

const SIZE: usize = 64 * 1024 * 1024;

fn random_data() -> Vec<u8> {
    let mut data = vec![0u8; SIZE];
    rand::rngs::StdRng::seed_from_u64(1).fill_bytes(&mut data);
    data
}

fn log_data() -> Vec<u8> {
    let mut data = Vec::with_capacity(SIZE);
    let mut line = 0u64;
    while data.len() < SIZE {
        line += 1;
        data.extend_from_slice(
            format!(
                "2026-11-29T10:{:02}:{:02}Z level=info component=mover request={} latency_ms={} volume=pvc-{}\n",
                (line / 60) % 60,
                line % 60,
                line.wrapping_mul(2654435761) % 1_000_000,
                line % 5000,
                line % 97
            )
            .as_bytes(),
        );
    }
    data.truncate(SIZE);
    data
}

fn stages(c: &mut Criterion) {
    let config = RepoConfig::generate(&mut rand::rng());
    let keys = config.keys().expect("keys");
    let chunker = Chunker::new(ChunkerParameters::default(), keys.gear_seed);
    for (name, data) in [("random", random_data()), ("log", log_data())] {
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.sample_size(10);
        group.bench_function("fastcdc", |b| b.iter(|| chunker.chunk_lengths(&data).len()));
        group.bench_function("blake3_keyed", |b| b.iter(|| keys.blob_id(&data)));
        for level in [1, 3] {
            group.bench_function(format!("zstd_{level}"), |b| {
                b.iter(|| {
                    data.chunks(1024 * 1024)
                        .map(|chunk| zstd::bulk::compress(chunk, level).expect("compress").len())
                        .sum::<usize>()
                })
            });
        }
        group.finish();
    }
}

/// The whole backup pipeline (walk, chunk, hash, dedup, compress, seal,
/// pack, write) of a 128 MiB sample tree into a fresh `file://` repository,
/// plaintext (format 1) and encrypted (format 2).
fn pipeline(c: &mut Criterion) {
    use std::sync::Arc;
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let work = tempfile::tempdir().expect("temp dir");
    let source = work.path().join("source");
    let summary = haulage::sample::generate(&source, 128 << 20, 7).expect("sample");
    let mut group = c.benchmark_group("pipeline");
    group.throughput(Throughput::Bytes(summary.bytes));
    group.sample_size(10);
    for (name, encryption) in [
        (
            "backup_128MiB_sample_full",
            haulage::engine::Encryption::None,
        ),
        (
            "backup_128MiB_sample_full_encrypted",
            haulage::engine::Encryption::Password {
                password: haulage::engine::Password::new("bench"),
                kdf: haulage::repo::keyfile::KdfParameters::insecure_for_tests(),
            },
        ),
    ] {
        group.bench_function(name, |b| {
            b.iter_with_setup(
                || {
                    let repo = work.path().join(format!("repo-{}", rand::random::<u64>()));
                    let store: haulage::store::DynStore =
                        Arc::new(haulage::store::local::LocalStore::new(&repo));
                    let repository = runtime
                        .block_on(haulage::engine::Repository::init(store, encryption.clone()))
                        .expect("init");
                    (repo, repository)
                },
                |(repo, repository)| {
                    let mut options = haulage::engine::backup::BackupOptions::new(&source);
                    options.parent = haulage::engine::backup::ParentPolicy::None;
                    runtime
                        .block_on(haulage::engine::backup::backup(
                            &repository,
                            options,
                            Arc::default(),
                            Default::default(),
                        ))
                        .expect("backup");
                    std::fs::remove_dir_all(repo).expect("clean up");
                },
            )
        });
    }
    group.finish();
}

/// Sealing 1 MiB chunks in place, as a backup does.
fn sealing(c: &mut Criterion) {
    use chacha20poly1305::aead::{AeadInOut, KeyInit};
    use haulage::repo::crypto::{MasterKey, Sealed};
    let data = random_data();
    let key = MasterKey::generate(&mut rand::rng()).object_key();
    let xchacha = chacha20poly1305::XChaCha20Poly1305::new(&[7u8; 32].into());
    let id = haulage::repo::BlobId([1; 32]);
    let mut group = c.benchmark_group("seal");
    group.throughput(Throughput::Bytes(data.len() as u64));
    group.sample_size(10);
    let mut buffer = Vec::with_capacity(1 << 21);
    group.bench_function("aes_256_gcm", |b| {
        b.iter(|| {
            for chunk in data.chunks(1 << 20) {
                buffer.clear();
                buffer.extend_from_slice(chunk);
                key.seal_in_place(
                    &mut rand::rng(),
                    Sealed::Blob {
                        kind: haulage::repo::BlobKind::Data,
                        id: &id,
                    },
                    &[],
                    &mut buffer,
                );
            }
        })
    });
    group.bench_function("xchacha20_poly1305", |b| {
        b.iter(|| {
            for chunk in data.chunks(1 << 20) {
                buffer.clear();
                buffer.extend_from_slice(chunk);
                let nonce = chacha20poly1305::XNonce::from([3u8; 24]);
                let tag = xchacha
                    .encrypt_inout_detached(&nonce, b"ad", buffer.as_mut_slice().into())
                    .expect("seal");
                buffer.extend_from_slice(&tag);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, stages, sealing, pipeline);
criterion_main!(benches);
