//! `haulage bench` through the binary, against a `file://` location and a
//! real MinIO server: the report has every figure, and nothing the bench
//! wrote is left at the location. Timings are not asserted (speed lives in
//! benchmarks); only that each figure was measured.

use std::path::Path;
use std::process::Output;

use crate::engine::support::{files_under, haulage, random_bytes};
use crate::support::minio::{MinioServer, with_s3_credentials};

const BUCKET: &str = "haulage-bench";

fn small_source(root: &Path) {
    std::fs::create_dir_all(root.join("sub")).expect("mkdir");
    for index in 0..6u64 {
        std::fs::write(
            root.join(format!("file-{index}.bin")),
            random_bytes(index, 300_000),
        )
        .expect("write");
    }
    // A file the engine chunks as a stream (larger than its small files),
    // compressible.
    let mut large = "line of a large log file\n"
        .repeat((3 << 20) / 25)
        .into_bytes();
    large.resize(3 << 20, b'.');
    std::fs::write(root.join("sub/large.log"), large).expect("write");
    // Compressible data, so the sample's ratio is below 1.
    std::fs::write(
        root.join("sub/text.log"),
        "line of a log file\n".repeat(50_000),
    )
    .expect("write");
}

fn bench_json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "bench failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("bench --json prints JSON")
}

/// Every figure is there and was measured on something.
fn assert_report_complete(report: &serde_json::Value, source_bytes: u64) {
    assert_eq!(report["source"]["bytes"].as_u64(), Some(source_bytes));
    assert_eq!(report["source"]["files"].as_u64(), Some(8));
    for rate in [
        &report["readSingle"],
        &report["readParallel"],
        &report["cpu"]["chunking"],
        &report["cpu"]["hashing"],
        &report["cpu"]["compression"],
        &report["storage"]["upload"],
        &report["storage"]["download"],
    ] {
        assert!(rate["bytes"].as_u64().expect("bytes") > 0, "{rate}");
        assert!(
            rate["bytesPerSecond"].as_f64().expect("rate") > 0.0,
            "{rate}"
        );
    }
    // Both kinds of files were backed up by the engine, and the two kinds
    // are the whole source.
    let samples = &report["samples"];
    for kind in ["smallFiles", "largeFiles"] {
        let sample = &samples[kind];
        assert!(
            sample["rate"]["bytes"].as_u64().expect("bytes") > 0,
            "{sample}"
        );
        assert!(sample["rate"]["bytesPerSecond"].as_f64().expect("rate") > 0.0);
        assert!(
            sample["coresBusy"].as_f64().expect("cores") > 0.0,
            "{sample}"
        );
        let stored = sample["storedRatio"].as_f64().expect("ratio");
        assert!(stored > 0.0 && stored < 1.1, "{sample}");
    }
    {
        let stored = samples["largeFiles"]["storedRatio"]
            .as_f64()
            .expect("ratio");
        assert!(stored < 0.5, "a log compresses: {stored}");
    }
    assert!(samples["smallFiles"]["files"].as_u64().expect("files") > 0);
    assert_eq!(
        samples["smallFileBytes"].as_u64().expect("bytes")
            + samples["largeFileBytes"].as_u64().expect("bytes"),
        source_bytes
    );
    assert_eq!(samples["largeFileBytes"].as_u64(), Some(3 << 20));
    let ratio = report["cpu"]["compressionRatio"].as_f64().expect("ratio");
    assert!(ratio > 0.0 && ratio < 1.0, "ratio {ratio}");
    assert_eq!(report["storage"]["objects"].as_u64(), Some(2));
    for latency in ["putLatency", "getLatency", "headLatency"] {
        let latency = &report["storage"][latency];
        assert!(latency["requests"].as_u64().expect("requests") > 0);
        assert!(
            latency["p99Milliseconds"].as_f64().expect("p99")
                >= latency["p50Milliseconds"].as_f64().expect("p50")
        );
    }
    assert_eq!(report["storage"]["objectsLeft"].as_u64(), Some(0));
    let estimate = &report["estimate"];
    assert_eq!(estimate["bytes"].as_u64(), Some(10 << 30));
    let limits = estimate["limits"].as_array().expect("limits");
    let names: Vec<_> = limits
        .iter()
        .map(|limit| limit[0].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["read", "backup pipeline", "upload", "read cap"]);
    // The read cap (1 MiB/s) is far below anything measured here.
    assert_eq!(estimate["bottleneck"].as_str(), Some("read cap"));
    assert_eq!(
        estimate["seconds"].as_f64().expect("seconds").round(),
        10.0 * 1024.0
    );
}

fn source_bytes(root: &Path) -> u64 {
    files_under(root).iter().map(|(_, size)| size).sum()
}

const BENCH_ARGS: [&str; 9] = [
    "--json",
    "--objects",
    "2",
    "--size",
    "2MiB",
    "--estimate-bytes",
    "10GiB",
    "--limit-read",
    "1MiB",
];

#[test]
fn bench_against_a_directory_location_reports_every_stage_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let source = dir.path().join("source");
    small_source(&source);
    let location = dir.path().join("location");
    std::fs::create_dir(&location).expect("mkdir");
    let started = std::time::Instant::now();
    let output = haulage()
        .arg("bench")
        .args(BENCH_ARGS)
        .arg("--source")
        .arg(&source)
        .arg("--repo")
        .arg(format!("file://{}", location.display()))
        .output()
        .expect("run bench");
    let took = started.elapsed();
    let report = bench_json(&output);
    assert_report_complete(&report, source_bytes(&source));
    // Its reads of the source average at most --limit-read (1 MiB/s):
    // the read tests' bytes alone take that long. Not a speed budget: a
    // lower bound the rests guarantee however fast the machine.
    let read: u64 = ["readSingle", "readParallel"]
        .iter()
        .map(|test| report[test]["bytes"].as_u64().expect("bytes read"))
        .sum();
    assert!(
        took.as_secs_f64() >= read as f64 / f64::from(1 << 20),
        "read {read} bytes in {took:?}, faster than --limit-read 1MiB"
    );
    // And its figures are still the source's, not the cap's.
    let single = report["readSingle"]["bytesPerSecond"]
        .as_f64()
        .expect("rate");
    assert!(single > 4.0 * f64::from(1 << 20), "read rate {single}");
    assert_eq!(
        files_under(&location),
        Vec::new(),
        "bench left files behind"
    );
}

#[test]
fn options_of_the_other_kind_of_benchmark_are_refused_before_anything_is_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let location = dir.path().join("location");
    std::fs::create_dir(&location).expect("mkdir");
    let repo = format!("file://{}", location.display());
    let source = dir.path().display().to_string();
    for (extra, says) in [
        (vec!["--keep"], "--keep is for a benchmark in the cluster"),
        (
            vec!["--context", "prod"],
            "--context is for a benchmark in the cluster",
        ),
        (
            vec!["--location", "s3"],
            "--location is for a benchmark in the cluster",
        ),
    ] {
        let output = haulage()
            .args(["bench", "--source", &source, "--repo", &repo])
            .args(&extra)
            .output()
            .expect("run bench");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{extra:?} was accepted");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
    // With --claim, the options only a benchmark here has.
    let output = haulage()
        .args(["bench", "--claim", "shop/db", "--readers", "2"])
        .output()
        .expect("run bench");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot be used with"), "{stderr}");
    assert_eq!(files_under(&location), Vec::new(), "something was written");
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_against_minio_reports_every_stage_and_deletes_its_objects() {
    let server = MinioServer::start().await.expect("start minio");
    server.create_bucket(BUCKET).await.expect("bucket");
    let dir = tempfile::tempdir().expect("tempdir");
    let source = dir.path().join("source");
    small_source(&source);
    let output = with_s3_credentials(&mut haulage(), &server.endpoint())
        .arg("bench")
        .args(BENCH_ARGS)
        .arg("--source")
        .arg(&source)
        .args(["--repo", &format!("s3://{BUCKET}/team")])
        .output()
        .expect("run bench");
    let report = bench_json(&output);
    assert_report_complete(&report, source_bytes(&source));
    let left = server
        .admin_client()
        .list_objects_v2()
        .bucket(BUCKET)
        .send()
        .await
        .expect("list");
    assert!(
        left.contents().is_empty(),
        "bench left objects: {:?}",
        left.contents()
    );

    // The table form names each stage.
    let table = with_s3_credentials(&mut haulage(), &server.endpoint())
        .args(["bench", "--objects", "1", "--size", "1MiB", "--source"])
        .arg(&source)
        .args(["--repo", &format!("s3://{BUCKET}/team")])
        .output()
        .expect("run bench");
    assert!(table.status.success());
    let text = String::from_utf8_lossy(&table.stdout);
    for stage in [
        "read, 1 reader",
        "read, 4 readers",
        "chunking (FastCDC)",
        "hashing (keyed BLAKE3)",
        "compression (zstd level 1)",
        "backup sample, small files",
        "backup sample, large files",
        "upload",
        "download",
        "p99",
        "estimate:",
    ] {
        assert!(text.contains(stage), "{stage:?} missing from:\n{text}");
    }
}
