//! The controller and the mover agent end to end on a real kube-apiserver
//! and a real MinIO: manifests applied as a user would, a BSL and a
//! VolumeBackup created, the controller running with its own
//! ServiceAccount's token (so its RBAC is the real one), stage pods run by
//! the kubelet stand-in as real `mover-agent` processes with their own
//! TokenRequest tokens; every snapshot restores byte-identical, and nothing
//! is left behind.
//!
//! One module per concern; the fixture they share (cluster, MinIO, claims,
//! kubelet stand-in, BSL, controller) is `support::fixture`, started with
//! `Fixture::builder()...start()`. Run them all with
//! `cargo test --test integration controller::`, one concern with e.g.
//! `cargo test --test integration controller::supervision::`.
//!
//! - [`agent_kills`]: an agent killed again and again at random points
//!   of one backup, counted (each round resumes, no blob stored twice).
//! - [`backup`]: the happy path, resuming after a killed agent, cancel.
//! - [`benchmark`]: `haulage bench --claim`, measured in the stage pods
//!   that would back the claims up, nothing left behind.
//! - [`cancels`]: backups deleted in every phase of their transfers,
//!   counted (queued, admitted, a multipart pack in flight).
//! - [`deletion_policy`]: `deletionPolicy: Delete` forgets a deleted
//!   backup's snapshots (a failed forget keeps the finalizer), `ttl`.
//! - [`encrypted_locations`]: a BSL with `spec.encryption` (the
//!   repository sealed with its Secret's password, a wrong one named).
//! - [`maintenance`]: a BSL's scheduled prune (deletions deferred while
//!   the repository is in use, the status it leaves).
//! - [`outages`]: a storage outage longer than the retry budget mid-backup
//!   (paused, said so, resumed by itself; past `failAfterUnavailableSeconds`
//!   failed).
//! - [`restore`]: a VolumeRestore of a backup into new claims (verified,
//!   identical), resuming after a killed restore agent.
//! - [`storage_policies`]: admission under a StoragePolicy, the bandwidth
//!   split.
//! - [`replicas`]: two replicas, adoption of a crashed one's backup, the
//!   admission lease.
//! - [`replica_kills`]: controller processes killed and restarted at
//!   random over many backups created at once, counted (each completes
//!   once, no duplicate transfer or stage pod, no claim moved twice at
//!   once, no backup left without an owner).
//! - [`supervision`]: evicted, crash-looping and hung stage pods.
//! - [`storage_locations`]: BSL validation, waiting for storage, defaults,
//!   `haulage status`, TLS.
//! - [`health_and_metrics`]: `/metrics` and `/readyz`.
//!
//! The measurements behind docs/benchmarks.md are not here: they are in
//! `crate::measurements`, ignored by `cargo test`.

mod agent_kills;
mod backup;
mod benchmark;
mod cancels;
mod deletion_policy;
mod encrypted_locations;
mod health_and_metrics;
mod maintenance;
mod outages;
mod replica_kills;
mod replicas;
mod restore;
mod storage_locations;
mod storage_policies;
mod supervision;
