//! haulage moves the data of Kubernetes PersistentVolumeClaims between
//! clusters, through an S3-compatible backup storage location, without
//! overrunning the shared storage other workloads live on.
//!
//! The map (docs/architecture.md has the picture), pure cores first; each
//! pure core is a crate of its own, re-exported here:
//!
//! - [`api`] (crate `haulage-api`): the custom resources
//!   (BackupStorageLocation, StoragePolicy, VolumeBackup, VolumeTransfer),
//!   their status values, conditions, labels, the DNS-name sanitiser and
//!   the generated CRDs. Values only.
//! - [`plan`] (crate `haulage-plan`): the stage-pod planner, a pure
//!   function from cluster facts to a plan; `plan::objects` turns
//!   Kubernetes objects into facts.
//! - [`repo`] (crate `haulage-repo`): the repository *format* (config,
//!   chunker, packs, indexes, trees, snapshots, sealing and key files,
//!   locks, retention policy, prune plan): pure encode and decode, and the
//!   decisions on them.
//! - [`reconcile`] (crate `haulage-reconcile`): the reconcile decisions,
//!   pure functions from an observation and the time to the next status
//!   and actions, and the complete desired objects of a stage pod.
//! - [`store`]: the object-store trait, its backends (`s3://`, `file://`)
//!   and the wrappers around them (retries; the request and upload caps,
//!   each a `store::layer::Layer` of one forwarding wrapper), the location
//!   probe.
//! - [`throttle`]: the one byte-rate limiter (engine reads and writes,
//!   store uploads).
//! - [`engine`]: an open repository in a store ([`engine::Repository`]),
//!   backup, restore and verify of a directory tree (walk, chunk, hash,
//!   dedup, compress, seal, pack, upload), the directory scan, progress;
//!   forget, prune and the repository's locks.
//! - [`controller`]: `haulage controller`: the observe and apply halves of
//!   the reconcilers over shared caches, the admission loop, replica
//!   leases, health endpoints and metrics.
//! - [`clock`]: the one place the time is read.
//! - [`watch`]: the one backoff of a failing Kubernetes watch (the
//!   controller's caches, the agent's watch of its transfer).
//! - [`metrics`]: the HTTP listener and Prometheus text exposition the
//!   controller and the mover agent share.
//! - [`sample`]: a reproducible sample tree for the demo and benchmarks.
//! - [`cli`]: the `haulage` command line.
//!
//! The agent, `mover-agent` (its own binary crate), uses the engine, the
//! store and the API types.
//!
//! Dependencies point inward: `cli`, `controller` and `mover-agent` →
//! `engine` → `store`, `throttle`; everything → `reconcile` → `api` →
//! `plan`; `engine` → `repo`. No pure crate reaches tokio, a kube client,
//! the AWS SDK, the file system, the network or the clock
//! (`tests/architecture.rs`).

pub mod allocator;
pub mod bench;
pub use haulage_api as api;
pub mod cli;
pub mod clock;
pub mod controller;
pub mod engine;
pub mod metrics;
pub use haulage_plan as plan;
pub use haulage_reconcile as reconcile;
pub use haulage_repo as repo;
pub mod sample;
pub mod store;
pub mod throttle;
pub mod watch;

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
