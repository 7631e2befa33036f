//! haulage moves the data of Kubernetes PersistentVolumeClaims between
//! clusters, through an S3-compatible backup storage location, without
//! overrunning the shared storage other workloads live on.
//!
//! The map of the crate, pure cores first:
//!
//! - [`api`]: the custom resources (BackupStorageLocation, StoragePolicy,
//!   VolumeBackup, VolumeTransfer), their status values and generated CRDs.
//! - [`repo`]: the repository format (config, chunker, packs, indexes, trees,
//!   snapshots): pure encode/decode, no I/O.
//! - [`plan`]: the stage-pod planner, a pure function from cluster facts to a
//!   plan.
//! - [`store`]: the object-store trait, its backends (`s3://`, `file://`) and
//!   the wrappers around them (retries, request and bandwidth caps), the
//!   location probe.
//! - [`engine`]: backup, restore and verify of a directory tree against a
//!   repository held in a store: walk, chunk, hash, dedup, compress, pack,
//!   upload; restore writer; throttling; progress.
//! - [`sample`]: a reproducible sample tree for the demo and benchmarks.
//! - [`controller`]: `haulage controller`, the reconcilers over shared
//!   caches of the cluster (VolumeBackup, BackupStorageLocation), its
//!   health endpoints and metrics.
//! - [`metrics`]: the HTTP listener and Prometheus text exposition the
//!   controller and the mover agent share.
//! - [`cli`]: the `haulage` command line.
//!
//! Dependencies point inward: `cli` → `engine`/`plan` → `repo`/`store`.

pub mod api;
pub mod cli;
pub mod controller;
pub mod engine;
pub mod metrics;
pub mod plan;
pub mod repo;
pub mod sample;
pub mod store;

/// An error and its sources, `: `-joined, each cause's Display text once
/// (a cause already quoted in the text so far is not repeated): "failed to
/// apply Pod shop/x: ApiError: pods is forbidden: ..." rather than the
/// first line only.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
