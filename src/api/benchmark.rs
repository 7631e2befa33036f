//! A VolumeBackup's `spec.benchmark`: measure, in the stage pod that would
//! read each claim, what its first backup into the storage location would
//! take, instead of backing it up (`haulage bench --claim NS/NAME`). The
//! figures come back per claim in `status.results[].benchmark`, and per
//! storage class in `status.benchmarks`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The default of `sizeBytes`.
pub const DEFAULT_BENCHMARK_SIZE_BYTES: i64 = 256 * 1024 * 1024;
/// Most `sizeBytes` may ask for: the two sample backups store at most
/// this much in the stage pod's scratch space (an emptyDir of 1 GiB).
pub const MAX_BENCHMARK_SIZE_BYTES: i64 = 512 * 1024 * 1024;

/// Measure instead of back up.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BenchmarkRequest {
    /// Bytes of each claim read by the read tests and backed up by the two
    /// sample backups together (into a throwaway repository in the stage
    /// pod's scratch space, deleted afterwards); 256 MiB when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1048576, max = 536870912))]
    pub size_bytes: Option<i64>,
}

impl BenchmarkRequest {
    /// The bytes to measure with.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
            .unwrap_or(DEFAULT_BENCHMARK_SIZE_BYTES)
            .clamp(1, MAX_BENCHMARK_SIZE_BYTES) as u64
    }
}

/// What the benchmark of one claim measured, and the estimate of its
/// first backup. Rates are bytes of the claim per second.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimBenchmark {
    /// The claim's storage class (`spec.storageClassName`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
    /// Regular files in the claim.
    pub files: i64,
    /// Their bytes.
    pub bytes: i64,
    /// Reading the claim with one reader.
    pub read_one_reader_bytes_per_second: i64,
    /// Reading the claim with several readers (the backup's read figure).
    pub read_bytes_per_second: i64,
    /// The backup pipeline (chunking, hashing, compression, encryption,
    /// packs) on samples of the claim's small and large files.
    pub pipeline_bytes_per_second: i64,
    /// Thousandths of a core the sample backups kept busy, of `cores`.
    pub pipeline_millicores_busy: i64,
    /// Cores the stage pod's agent sees.
    pub cores: i64,
    /// Stored bytes per 100 bytes of the claim, in the samples.
    pub stored_percent: i64,
    /// Upload to the storage location, bytes of objects per second.
    pub upload_bytes_per_second: i64,
    /// Download from the storage location, bytes of objects per second.
    pub download_bytes_per_second: i64,
    /// Median latency of a small PUT, microseconds.
    pub put_p50_microseconds: i64,
    /// Median latency of a small GET, microseconds.
    pub get_p50_microseconds: i64,
    /// The first backup's estimated pace, the slowest of read, pipeline,
    /// upload and the caps granted to the benchmark.
    pub estimate_bytes_per_second: i64,
    /// The first backup's estimated duration, seconds.
    pub estimate_seconds: i64,
    /// The stage that limits it.
    #[schemars(length(max = 256))]
    pub limited_by: String,
}

/// The benchmarks of one storage class's claims, summed up.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageClassBenchmark {
    /// The storage class; empty for claims without one.
    pub storage_class: String,
    /// Claims measured.
    pub claims: i32,
    /// Their bytes.
    pub bytes: i64,
    /// The slowest claim's read figure.
    pub read_bytes_per_second: i64,
    /// The slowest claim's pipeline figure.
    pub pipeline_bytes_per_second: i64,
    /// The slowest claim's upload figure.
    pub upload_bytes_per_second: i64,
    /// The class's bytes at its slowest claim's estimated pace, one
    /// volume after the other, seconds.
    pub estimate_seconds: i64,
    /// What limits that slowest claim.
    #[schemars(length(max = 256))]
    pub limited_by: String,
}

/// The per-class summary of claims' benchmarks, sorted by class.
pub fn by_storage_class<'a>(
    claims: impl IntoIterator<Item = &'a ClaimBenchmark>,
) -> Vec<StorageClassBenchmark> {
    let mut classes: std::collections::BTreeMap<String, Vec<&ClaimBenchmark>> =
        std::collections::BTreeMap::new();
    for claim in claims {
        classes
            .entry(claim.storage_class.clone().unwrap_or_default())
            .or_default()
            .push(claim);
    }
    classes
        .into_iter()
        .map(|(storage_class, claims)| {
            let slowest = claims
                .iter()
                .min_by_key(|claim| claim.estimate_bytes_per_second)
                .expect("a class has a claim");
            let bytes: i64 = claims.iter().map(|claim| claim.bytes).sum();
            let least = |figure: fn(&ClaimBenchmark) -> i64| {
                claims.iter().map(|claim| figure(claim)).min().unwrap_or(0)
            };
            StorageClassBenchmark {
                storage_class,
                claims: claims.len() as i32,
                bytes,
                read_bytes_per_second: least(|claim| claim.read_bytes_per_second),
                pipeline_bytes_per_second: least(|claim| claim.pipeline_bytes_per_second),
                upload_bytes_per_second: least(|claim| claim.upload_bytes_per_second),
                estimate_seconds: if slowest.estimate_bytes_per_second > 0 {
                    (bytes + slowest.estimate_bytes_per_second - 1)
                        / slowest.estimate_bytes_per_second
                } else {
                    i64::MAX
                },
                limited_by: slowest.limited_by.clone(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(class: Option<&str>, bytes: i64, pace: i64, read: i64) -> ClaimBenchmark {
        ClaimBenchmark {
            storage_class: class.map(str::to_string),
            bytes,
            read_bytes_per_second: read,
            pipeline_bytes_per_second: 2 * pace,
            upload_bytes_per_second: 3 * pace,
            estimate_bytes_per_second: pace,
            limited_by: format!("read at {pace}"),
            ..ClaimBenchmark::default()
        }
    }

    #[test]
    fn a_class_is_estimated_at_its_slowest_claims_pace_and_gets_its_least_figures() {
        let claims = [
            claim(Some("ceph-block"), 1000, 100, 500),
            claim(Some("local"), 50, 10, 20),
            claim(Some("ceph-block"), 1000, 40, 900),
            claim(None, 7, 7, 7),
        ];
        let classes = by_storage_class(&claims);
        let names: Vec<_> = classes.iter().map(|c| c.storage_class.as_str()).collect();
        assert_eq!(names, ["", "ceph-block", "local"]);
        let ceph = &classes[1];
        assert_eq!(ceph.claims, 2);
        assert_eq!(ceph.bytes, 2000);
        assert_eq!(ceph.estimate_seconds, 50, "2000 bytes at the slowest 40/s");
        assert_eq!(ceph.limited_by, "read at 40");
        assert_eq!(ceph.read_bytes_per_second, 500);
        assert_eq!(ceph.pipeline_bytes_per_second, 80);
        assert_eq!(ceph.upload_bytes_per_second, 120);
        assert_eq!(classes[2].estimate_seconds, 5);
    }

    #[test]
    fn the_size_defaults_and_stays_within_the_scratch_space() {
        assert_eq!(
            BenchmarkRequest::default().size_bytes(),
            DEFAULT_BENCHMARK_SIZE_BYTES as u64
        );
        let huge = BenchmarkRequest {
            size_bytes: Some(1 << 40),
        };
        assert_eq!(huge.size_bytes(), MAX_BENCHMARK_SIZE_BYTES as u64);
    }
}
