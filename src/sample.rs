//! A reproducible sample tree for the demo and the benchmarks: many small
//! text and binary files, a few large random and log-like files, and exact
//! and shifted duplicates — the mix a real volume has, in a chosen size.

use std::fs;
use std::io::{self, Write};
use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// Words for text files: compressible like real text, not trivially so.
const WORDS: &[&str] = &[
    "volume",
    "claim",
    "cluster",
    "node",
    "storage",
    "backup",
    "restore",
    "chunk",
    "pack",
    "index",
    "snapshot",
    "migration",
    "replica",
    "namespace",
    "pod",
    "error",
    "warning",
    "request",
    "latency",
    "throughput",
    "ceph",
    "bucket",
    "object",
    "stage",
    "agent",
];
/// Files per directory.
const FILES_PER_DIRECTORY: usize = 200;

/// What [`generate`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleSummary {
    /// Regular files written.
    pub files: u64,
    /// Bytes written.
    pub bytes: u64,
}

/// Write a sample tree of about `total_bytes` into `root` (created if
/// missing), deterministic for a given `seed`. A quarter of the bytes go to
/// many small files, the rest to large random, log-like and duplicate files.
pub fn generate(root: &Path, total_bytes: u64, seed: u64) -> io::Result<SampleSummary> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut summary = SampleSummary::default();
    fs::create_dir_all(root)?;
    let small_budget = total_bytes / 4;
    let mut written_small = 0u64;
    let mut index = 0usize;
    while written_small < small_budget {
        let directory = root.join(format!(
            "small/d{:03}/e{:03}",
            index / (FILES_PER_DIRECTORY * 50),
            (index / FILES_PER_DIRECTORY) % 50
        ));
        if index % FILES_PER_DIRECTORY == 0 {
            fs::create_dir_all(&directory)?;
        }
        let bytes = if rng.random_bool(0.7) {
            let size = rng.random_range(256..16 * 1024);
            text(&mut rng, size)
        } else {
            let mut data = vec![0u8; rng.random_range(1024..64 * 1024)];
            rng.fill_bytes(&mut data);
            data
        };
        let extension = if bytes.is_ascii() { "txt" } else { "bin" };
        fs::write(directory.join(format!("f{index:06}.{extension}")), &bytes)?;
        written_small += bytes.len() as u64;
        summary.files += 1;
        index += 1;
    }
    summary.bytes += written_small;
    let large = root.join("large");
    fs::create_dir_all(&large)?;
    let part = (total_bytes - small_budget) / 4;
    // Random (incompressible, like media or already-compressed data).
    let random = write_with(&large.join("random.bin"), part, |buffer| {
        rng.fill_bytes(buffer)
    })?;
    // Log-like (compressible).
    let mut log_rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut line_number = 0u64;
    write_with(&large.join("app.log"), part, |buffer| {
        let mut filled = 0;
        while filled < buffer.len() {
            line_number += 1;
            let line = format!(
                "2026-11-29T10:{:02}:{:02}.{:03}Z level={} component={} request={} latency_ms={} {}\n",
                (line_number / 60) % 60,
                line_number % 60,
                line_number % 1000,
                ["info", "debug", "warn"][log_rng.random_range(0..3)],
                WORDS[log_rng.random_range(0..WORDS.len())],
                log_rng.random_range(0..1_000_000u32),
                log_rng.random_range(0..5000u32),
                String::from_utf8_lossy(&text(&mut log_rng, 40)),
            );
            let take = line.len().min(buffer.len() - filled);
            buffer[filled..filled + take].copy_from_slice(&line.as_bytes()[..take]);
            filled += take;
        }
    })?;
    // Exact duplicate and a copy shifted by an insertion at the front.
    let dup = root.join("duplicates");
    fs::create_dir_all(&dup)?;
    fs::copy(&random, dup.join("random-copy.bin"))?;
    let original = fs::read(&random)?;
    let mut shifted = fs::File::create(dup.join("random-shifted.bin"))?;
    shifted.write_all(b"inserted!!")?;
    shifted.write_all(&original)?;
    summary.files += 4;
    summary.bytes += part * 4 + 10;
    Ok(summary)
}

fn text(rng: &mut StdRng, size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size + 16);
    while out.len() < size {
        out.extend_from_slice(WORDS[rng.random_range(0..WORDS.len())].as_bytes());
        out.push(if rng.random_bool(0.1) { b'\n' } else { b' ' });
        if rng.random_bool(0.05) {
            out.extend_from_slice(rng.random_range(0..100_000u32).to_string().as_bytes());
            out.push(b' ');
        }
    }
    out.truncate(size);
    out
}

fn write_with(
    path: &Path,
    size: u64,
    mut fill: impl FnMut(&mut [u8]),
) -> io::Result<std::path::PathBuf> {
    let mut file = io::BufWriter::new(fs::File::create(path)?);
    let mut buffer = vec![0u8; 1024 * 1024];
    let mut left = size;
    while left > 0 {
        let step = left.min(buffer.len() as u64) as usize;
        fill(&mut buffer[..step]);
        file.write_all(&buffer[..step])?;
        left -= step as u64;
    }
    file.flush()?;
    Ok(path.to_path_buf())
}
