//! haulage's reconcile decisions: for each kind the controller reconciles,
//! a pure function from what it observed (read from the caches once into a
//! plain struct) and the time to the next status and the actions to take.
//! No client, no clock, no I/O: the controller (`haulage::controller`)
//! observes, calls these, and executes what they return.
//!
//! - [`backup`]: the VolumeBackup decisions (ownership, planning, children,
//!   supervision, the progress-write throttle, cancel, release);
//!   [`backup_status`]: its next status.
//! - [`restore`]: the VolumeRestore decisions (selection of snapshots,
//!   destination claims, plan, stage pods, verification, hand-back of
//!   ReadOnlyMany claims, cancel); [`claims`]: a claim's record and its
//!   destination on another cluster.
//! - [`location`]: the BackupStorageLocation decisions (when to probe, the
//!   status from a probe's outcome, the default among several);
//!   [`maintenance`]: when its repository is pruned and the status each
//!   prune leaves.
//! - [`admission`]: which transfers start under the caps, their bandwidth
//!   grants and queue positions, and the writes that carry them out.
//! - [`supervision`]: the verdict on one stage pod (healthy, recreate after
//!   a backoff, or fail its volumes with the pod's reason), and the
//!   supervision of all of a backup's or restore's stage pods.
//! - [`ownership`]: who acts on a backup or restore (keep, claim, adopt,
//!   wait).
//! - [`replicas`]: whether the replica owning an object is alive, from the
//!   liveness Leases; the admission Lease's next step.
//! - [`stage_pod`]: the complete desired objects of one stage pod.
//! - [`staging`]: what backups and restores decide alike (who acts, the
//!   stage pods to create, their supervision and release, the cancel, the
//!   progress-write throttle, the finish Event), from the part of their
//!   observations they share.
//! - [`action`]: the actions decisions return and the controller executes.

pub mod action;
pub mod admission;
pub mod backup;
pub mod backup_status;
pub mod claims;
pub mod location;
pub mod maintenance;
pub mod ownership;
pub mod replicas;
pub mod restore;
pub mod stage_pod;
pub mod staging;
pub mod supervision;
#[cfg(test)]
mod test_support;
