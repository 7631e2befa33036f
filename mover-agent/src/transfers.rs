//! VolumeTransfer mode: the agent of a stage pod claims the transfers the
//! controller assigned to its pod (a resourceVersion-checked write, so a
//! transfer claimed by a live agent is never taken by another), moves each
//! volume with the engine (a bounded number at once) the way its
//! `spec.direction` says — Upload: backs the claim up; Download: restores
//! `spec.snapshot` into the claim, then verifies the written tree against
//! the snapshot's, entry by entry ([`restore_and_verify`]) — reports progress
//! at most once per interval and never backwards, and writes the final
//! figures, each write a typed [`VolumeTransferStatus`] from
//! [`crate::report`].
//!
//! One watch per transfer ([`follow`]) carries everything the controller
//! says to the agent: admission, the bandwidth grant (re-split live), and
//! the end of a transfer it canceled or failed (the volume's engine stops
//! at once, not at its next progress write; also while a backup stopped
//! by SIGTERM stores what it read). SIGTERM stops a backup, which stores
//! what it read with a last checkpoint, and cancels a restore; the agent
//! exits non-zero, leaving the transfers InProgress: the restarted pod
//! claims them again; a backup adopts the packs already stored, a restore
//! continues in sync mode and leaves the files already written alone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use haulage::api::benchmark::ClaimBenchmark;
use haulage::api::labels::AGENT_FIELD_MANAGER;
use haulage::api::transfer::{AgentClaim, TransferDirection};
use haulage::api::{Progress as ApiProgress, VolumeTransfer, VolumeTransferPhase};
use haulage::clock::now;
use haulage::engine::Repository;
use haulage::engine::backup::{BackupOptions, backup};
use haulage::engine::lock::RepositoryLock;
use haulage::engine::memory::EngineMemory;
use haulage::engine::progress::Progress;
use haulage::engine::restore::{LoadedSnapshot, RestoreOptions, restore_loaded};
use haulage::engine::throttle::{ByteRate, Throttle};
use haulage::engine::verify_tree::{TreeVerifyOptions, verify_tree_loaded};
use haulage::repo::lock::LockKind;
use haulage::store::outage::OutageWait;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::AgentMetrics;
use crate::patience::Tries;
use crate::report::{
    BackupFigures, Ending, RestoreFigures, RestoreVerdict, StorageSeen, agent_claim, claim_status,
    completed_status, failed_status, measured_status, moved_forward, next_progress,
    progress_status, restore_verdict, restored_status, storage_condition,
};

/// Hostname recorded in every snapshot the agent writes: stable across
/// stage pods and nodes, so the next backup of the same claim (source
/// label `namespace/pvc`) finds its parent wherever it runs.
const SNAPSHOT_HOSTNAME: &str = "haulage-stage-pod";
/// A restore's problems and mismatches written to the log, each.
const MAX_PROBLEMS_LOGGED: usize = 20;

/// Who the agent is and what it works on.
#[derive(Debug, Clone)]
pub struct Assignment {
    /// Pod name (downward API `POD_NAME`): the agent's identity.
    pub identity: String,
    /// Pod namespace (`POD_NAMESPACE`), the transfers' namespace.
    pub namespace: String,
    /// Node (`NODE_NAME`), for logs.
    pub node: Option<String>,
    /// Names of the transfers of this stage pod.
    pub transfers: Vec<String>,
    /// Where the claims are mounted (`<root>/<pvc>`).
    pub data_root: PathBuf,
    /// Volumes moved at once.
    pub parallelism: usize,
    /// What each volume's engine may hold.
    pub memory: EngineMemory,
    /// Least time between two progress writes of one transfer.
    pub progress_interval: Duration,
    /// How often a backup writes its checkpoint (`None`: never).
    pub checkpoint_every: Option<Duration>,
    /// How the agent's store waits out the storage location's outages
    /// (the state it records them into, and the limit), for the reports.
    pub storage: OutageWait,
}

/// What the reports say now of the storage location's outages that the
/// store waiting as `wait` says records.
fn storage_seen(wait: &OutageWait) -> StorageSeen {
    StorageSeen {
        current: wait.outage.current(),
        last_ended: wait.outage.last_ended(),
        give_up_after_seconds: wait.give_up_after.map(|limit| limit.as_secs()),
        gave_up: wait.outage.gave_up(),
        retries: wait.outage.retries(),
    }
}

/// Something the agent could not do with a transfer.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A call to the API server failed.
    #[error("failed to {action} VolumeTransfer {transfer}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// The transfer.
        transfer: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// The watch of a transfer ended (the API server went away for good).
    #[error("the watch of VolumeTransfer {transfer} ended")]
    WatchEnded {
        /// The transfer.
        transfer: String,
    },
    /// A transfer's task panicked.
    #[error("the task of VolumeTransfer {transfer} panicked")]
    Panicked {
        /// The transfer.
        transfer: String,
    },
}

impl AgentError {
    /// Whether the API server refused who the agent is or what it may do
    /// (401, 403).
    pub fn is_refused_access(&self) -> bool {
        matches!(
            self,
            AgentError::Api { source: kube::Error::Api(status), .. }
                if status.code == 401 || status.code == 403
        )
    }

    /// Whether a restarted agent may succeed without anyone changing
    /// anything: an unreachable, overloaded or conflicting API server is
    /// transient; a refusal (forbidden, invalid) is permanent, and the
    /// pod's RBAC or the transfer must be fixed.
    pub fn is_transient(&self) -> bool {
        match self {
            AgentError::Api { source, .. } => match source {
                kube::Error::Api(status) => {
                    status.code == 409 || status.code == 429 || status.code >= 500
                }
                _ => true,
            },
            AgentError::WatchEnded { .. } => true,
            AgentError::Panicked { .. } => false,
        }
    }
}

/// Why [`run`] stopped before every transfer was final.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// SIGTERM: the restarted agent resumes.
    #[error("stopped by SIGTERM; the restarted agent resumes")]
    Stopped,
    /// A transfer could not be worked on.
    #[error(transparent)]
    Transfer(#[from] AgentError),
}

impl RunError {
    /// Whether a restart may help (SIGTERM and transient failures).
    pub fn is_transient(&self) -> bool {
        match self {
            RunError::Stopped => true,
            RunError::Transfer(error) => error.is_transient(),
        }
    }
}

/// Run every assigned transfer; Ok when each reached a final phase (its
/// own failure is recorded in its status, not in the exit code).
pub async fn run(
    assignment: Assignment,
    repository: Arc<Repository>,
    client: kube::Client,
    metrics: Arc<AgentMetrics>,
    cancel: CancellationToken,
) -> Result<(), RunError> {
    info!(
        agent = %assignment.identity,
        node = assignment.node.as_deref().unwrap_or("-"),
        transfers = assignment.transfers.len(),
        "agent started"
    );
    let api: Api<VolumeTransfer> = Api::namespaced(client, &assignment.namespace);
    let gate = Arc::new(Semaphore::new(assignment.parallelism.max(1)));
    let mut tasks = JoinSet::new();
    for name in assignment.transfers.clone() {
        let api = api.clone();
        let repository = repository.clone();
        let assignment = assignment.clone();
        let cancel = cancel.clone();
        let gate = gate.clone();
        let metrics = metrics.clone();
        tasks.spawn(async move {
            let result = move_volume(
                &api,
                &name,
                &assignment,
                &repository,
                &metrics,
                &gate,
                &cancel,
            )
            .await;
            (name, result)
        });
    }
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (name, result) = match joined {
            Ok(outcome) => outcome,
            Err(_) => (
                String::new(),
                Err(AgentError::Panicked {
                    transfer: "(unknown)".to_string(),
                }),
            ),
        };
        if let Err(error) = result {
            warn!(
                transfer = %name,
                transient = error.is_transient(),
                "{}",
                haulage::error_chain(&error)
            );
            first_error.get_or_insert(error);
        }
    }
    if cancel.is_cancelled() {
        return Err(RunError::Stopped);
    }
    match first_error {
        Some(error) => Err(RunError::Transfer(error)),
        None => Ok(()),
    }
}

/// The latest state of one transfer, as its watch shows it: `None` until
/// the first event, then the object, or [`Watched::Deleted`].
#[derive(Debug, Clone)]
enum Watched {
    /// No event yet.
    Unknown,
    /// The transfer as last seen.
    Seen(Arc<VolumeTransfer>),
    /// It was deleted (its backup was).
    Deleted,
}

/// Watch one transfer (the agent's Role allows watching it by name) until
/// `stop`, publishing each state: no polling, however long it waits in the
/// queue, and the controller's changes arrive within the watch's latency.
fn follow(
    api: Api<VolumeTransfer>,
    name: String,
    stop: CancellationToken,
) -> (watch::Receiver<Watched>, tokio::task::JoinHandle<()>) {
    let (sender, receiver) = watch::channel(Watched::Unknown);
    let task = tokio::spawn(async move {
        let events = haulage::watch::backing_off(watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        ));
        let mut events = std::pin::pin!(events);
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => return,
                next = events.next() => next,
            };
            match next {
                Some(Ok(watcher::Event::Apply(transfer) | watcher::Event::InitApply(transfer))) => {
                    sender.send_replace(Watched::Seen(Arc::new(transfer)));
                }
                Some(Ok(watcher::Event::Delete(_))) => {
                    sender.send_replace(Watched::Deleted);
                }
                Some(Ok(watcher::Event::Init | watcher::Event::InitDone)) => {}
                Some(Err(error)) => warn!(transfer = %name, "watch: {error}"),
                None => return,
            }
        }
    });
    (receiver, task)
}

/// What a waiting agent does on seeing `transfer`: `Some(true)` start (it
/// is admitted), `Some(false)` leave it (final, or another agent's),
/// `None` keep waiting.
fn admission_decision(transfer: &VolumeTransfer, identity: &str) -> Option<bool> {
    let status = transfer.status.clone().unwrap_or_default();
    let phase = transfer.phase();
    if phase.is_final() {
        return Some(false);
    }
    if let Some(agent) = &status.agent
        && agent.identity != identity
    {
        return Some(false);
    }
    (phase >= VolumeTransferPhase::Admitted).then_some(true)
}

/// The bandwidth the controller grants a transfer (`None`: unlimited).
fn granted_rate(transfer: &VolumeTransfer) -> Option<ByteRate> {
    transfer
        .spec
        .granted_bytes_per_second
        .and_then(|bytes| u64::try_from(bytes).ok())
        .map(ByteRate)
}

/// Wait on the watch until the transfer is admitted; false when there is
/// nothing to do (final already, claimed by another agent, deleted, or
/// SIGTERM).
async fn wait_for_admission(
    watched: &mut watch::Receiver<Watched>,
    name: &str,
    identity: &str,
    cancel: &CancellationToken,
) -> Result<bool, AgentError> {
    let mut said_waiting = false;
    loop {
        let (decision, seen) = match &*watched.borrow_and_update() {
            Watched::Unknown => (None, false),
            Watched::Deleted => (Some(false), true),
            Watched::Seen(transfer) => (admission_decision(transfer, identity), true),
        };
        match decision {
            Some(true) => return Ok(true),
            Some(false) => {
                info!(
                    transfer = name,
                    "nothing to do: final, deleted or another agent's"
                );
                return Ok(false);
            }
            None if seen && !said_waiting => {
                info!(transfer = name, "waiting to be admitted under the caps");
                said_waiting = true;
            }
            None => {}
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(false),
            changed = watched.changed() => {
                if changed.is_err() {
                    return Err(AgentError::WatchEnded { transfer: name.to_string() });
                }
            }
        }
    }
}

/// Follow the watch while the volume moves, until `done`: apply each new
/// grant to `throttle` live (the copy never restarts), and stop the volume
/// (`volume_cancel`, and `ended`) when the controller ends the transfer
/// (canceled or failed: final phases are the controller's while the agent
/// runs) or deletes it. Also after SIGTERM: a backup stopped by it stores
/// what it read for the restarted agent, unless the transfer ends
/// meanwhile (its VolumeBackup deleted with the stage pod).
fn supervise_volume(
    mut watched: watch::Receiver<Watched>,
    name: String,
    throttle: Throttle,
    mut granted: Option<ByteRate>,
    (volume_cancel, ended, done): (CancellationToken, CancellationToken, CancellationToken),
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let state = watched.borrow_and_update().clone();
            match state {
                Watched::Unknown => {}
                Watched::Deleted => {
                    warn!(transfer = %name, "transfer deleted; stopping");
                    ended.cancel();
                    volume_cancel.cancel();
                    return;
                }
                Watched::Seen(transfer) => {
                    if transfer.phase().is_final() {
                        warn!(
                            transfer = %name,
                            phase = ?transfer.phase(),
                            "the controller ended this transfer; stopping"
                        );
                        ended.cancel();
                        volume_cancel.cancel();
                        return;
                    }
                    let rate = granted_rate(&transfer);
                    if rate != granted {
                        info!(
                            transfer = %name,
                            bytes_per_second = rate.map(|ByteRate(bytes)| bytes),
                            "bandwidth grant changed"
                        );
                        throttle.set_rate(rate);
                        granted = rate;
                    }
                }
            }
            tokio::select! {
                _ = done.cancelled() => return,
                changed = watched.changed() => if changed.is_err() { return },
            }
        }
    })
}

/// Claim an admitted transfer, starting from the watched object (a
/// resourceVersion-checked merge patch). `None` when there is nothing to
/// do (final already, deleted, or claimed by another live agent). A read
/// or write the API server does not answer or refuses is tried again, as
/// [`crate::patience`] says: the transfer waits for this agent meanwhile.
async fn claim(
    api: &Api<VolumeTransfer>,
    name: &str,
    identity: &str,
    watched: &mut watch::Receiver<Watched>,
    cancel: &CancellationToken,
) -> Result<Option<VolumeTransfer>, AgentError> {
    let mut tries = Tries::start();
    loop {
        let transfer = match api.get(name).await {
            Ok(transfer) => transfer,
            Err(kube::Error::Api(status)) if status.code == 404 => {
                info!(transfer = name, "nothing to do: deleted before its claim");
                return Ok(None);
            }
            Err(source) => {
                let error = AgentError::Api {
                    action: "get",
                    transfer: name.to_string(),
                    source,
                };
                tries.wait_after(error, name, CLAIM_KEPT, cancel).await?;
                continue;
            }
        };
        match admission_decision(&transfer, identity) {
            Some(true) => {}
            Some(false) => return Ok(None),
            None => {
                if !wait_for_admission(watched, name, identity, cancel).await? {
                    return Ok(None);
                }
                continue;
            }
        }
        let status = claim_status(
            &transfer.status.clone().unwrap_or_default(),
            identity,
            &now(),
        );
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": transfer.resource_version()},
            "status": status,
        });
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(claimed) => return Ok(Some(claimed)),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                info!(transfer = name, "changed while claiming; looking again");
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {
                info!(transfer = name, "nothing to do: deleted before its claim");
                return Ok(None);
            }
            Err(source) => {
                let error = AgentError::Api {
                    action: "claim",
                    transfer: name.to_string(),
                    source,
                };
                tries.wait_after(error, name, CLAIM_KEPT, cancel).await?;
            }
        }
    }
}

/// Wait for admission, then for a place among the volumes this agent moves
/// at once, then claim and move the volume. Admission comes first: a
/// transfer waiting for admission must not hold a place an admitted one of
/// the same pod needs (with a cap of one, that would wait forever).
async fn move_volume(
    api: &Api<VolumeTransfer>,
    name: &str,
    assignment: &Assignment,
    repository: &Repository,
    metrics: &AgentMetrics,
    gate: &Semaphore,
    cancel: &CancellationToken,
) -> Result<(), AgentError> {
    // Ended with the volume's work, not at SIGTERM: the supervisor follows
    // the transfer while a stopped backup stores what it read.
    let stop_watch = CancellationToken::new();
    let (mut watched, watch_task) = follow(api.clone(), name.to_string(), stop_watch.clone());
    let result = async {
        if !wait_for_admission(&mut watched, name, &assignment.identity, cancel).await? {
            return Ok(());
        }
        let _permit = gate.acquire().await;
        let Some(transfer) = claim(api, name, &assignment.identity, &mut watched, cancel).await?
        else {
            return Ok(());
        };
        let claimed = Claimed {
            api,
            name,
            transfer,
            watched: watched.clone(),
            assignment,
            repository,
            metrics,
            cancel,
        };
        move_claimed(claimed).await
    }
    .await;
    stop_watch.cancel();
    let _ = watch_task.await;
    result
}

/// A transfer this agent claimed, with what moving its volume needs.
struct Claimed<'a> {
    api: &'a Api<VolumeTransfer>,
    name: &'a str,
    /// The transfer as the claim left it.
    transfer: VolumeTransfer,
    watched: watch::Receiver<Watched>,
    assignment: &'a Assignment,
    repository: &'a Repository,
    metrics: &'a AgentMetrics,
    cancel: &'a CancellationToken,
}

/// What the run of one claimed transfer shares, whichever way its data
/// goes: the engine's counters, the volume's own cancel, the progress
/// reporter (which also renews the claim's heartbeat) and the supervisor
/// that follows the watch (the bandwidth grant, re-split live, applied to
/// `throttle`; the end of the transfer by the controller).
struct VolumeRun {
    progress: Arc<Progress>,
    volume_cancel: CancellationToken,
    /// Cancelled when the controller ends the transfer (canceled, failed)
    /// or deletes it, SIGTERM or not.
    ended: CancellationToken,
    /// Cancelled when the engine is done: ends the supervisor.
    done: CancellationToken,
    throttle: Throttle,
    /// The claim as the transfer showed it when the run began.
    earlier_claim: Option<AgentClaim>,
    reported: Option<ApiProgress>,
    /// Ends with the last report it wrote (or tried to).
    reporter: tokio::task::JoinHandle<Option<LastReport>>,
    supervisor: tokio::task::JoinHandle<()>,
}

/// Why a run ended without the agent writing a final status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Interrupted {
    /// SIGTERM: the transfer stays InProgress for the restarted agent.
    Sigterm,
    /// The controller ended the transfer (canceled, failed) or deleted it.
    ByController,
}

impl VolumeRun {
    /// Start reporting and supervising the `claimed` transfer; the
    /// throttle's waiting is recorded into `waited`.
    fn start(claimed: &Claimed<'_>, waited: haulage::store::limits::WaitTime) -> Self {
        let &Claimed {
            api,
            name,
            ref transfer,
            assignment,
            metrics,
            cancel,
            ..
        } = claimed;
        let progress = Arc::new(Progress::default());
        metrics.track(
            &assignment.namespace,
            &transfer.spec.pvc,
            transfer.spec.direction,
            progress.clone(),
        );
        let volume_cancel = cancel.child_token();
        let earlier_claim = transfer
            .status
            .as_ref()
            .and_then(|status| status.agent.clone());
        let reported: Option<ApiProgress> = transfer
            .status
            .as_ref()
            .and_then(|status| status.progress.clone());
        let reporter = spawn_reporter(
            api.clone(),
            name.to_string(),
            progress.clone(),
            reported.clone(),
            (assignment.identity.clone(), earlier_claim.clone()),
            assignment.progress_interval,
            (assignment.storage.clone(), transfer.metadata.generation),
            volume_cancel.clone(),
        );
        let granted = granted_rate(transfer);
        let throttle = Throttle::new(granted)
            .recording_wait_into(waited)
            .cancelled_by(volume_cancel.clone());
        let (ended, done) = (CancellationToken::new(), CancellationToken::new());
        let supervisor = supervise_volume(
            claimed.watched.clone(),
            name.to_string(),
            throttle.clone(),
            granted,
            (volume_cancel.clone(), ended.clone(), done.clone()),
        );
        info!(
            transfer = name,
            bytes_per_second = granted.map(|ByteRate(bytes)| bytes),
            "bandwidth granted"
        );
        VolumeRun {
            progress,
            volume_cancel,
            ended,
            done,
            throttle,
            earlier_claim,
            reported,
            reporter,
            supervisor,
        }
    }

    /// Stop the reporter and the supervisor once the engine is done; `Err`
    /// when the run was interrupted and must write no final status.
    fn finish(&self, name: &str, cancel: &CancellationToken) -> Result<(), Interrupted> {
        let stopped_by_controller = self.volume_cancel.is_cancelled() && !cancel.is_cancelled();
        self.volume_cancel.cancel();
        self.done.cancel();
        if cancel.is_cancelled() {
            info!(
                transfer = name,
                "stopped by SIGTERM; stays InProgress for the restarted agent"
            );
            return Err(Interrupted::Sigterm);
        }
        if stopped_by_controller {
            return Err(Interrupted::ByController);
        }
        Ok(())
    }

    /// End the run once the engine is done: stop the reporter and the
    /// supervisor and wait for them. `None` when the run was interrupted
    /// and must write no final status; else how the `claimed` transfer
    /// ended, for its final status.
    async fn end(self, claimed: &Claimed<'_>) -> Option<Ending> {
        let finished = self.finish(claimed.name, claimed.cancel);
        let last = self.reporter.await.ok().flatten();
        let _ = self.supervisor.await;
        finished.ok()?;
        let (reported, claim) = match last {
            Some(LastReport { progress, claim }) => (Some(progress), Some(claim)),
            None => (self.reported, self.earlier_claim),
        };
        let progress = next_progress(&self.progress.snapshot(), reported.as_ref(), 0.0);
        let moved = moved_forward(&progress, reported.as_ref());
        let time = now();
        Some(Ending {
            progress,
            agent: agent_claim(&claimed.assignment.identity, claim.as_ref(), moved, &time),
            generation: claimed.transfer.metadata.generation,
            time,
        })
    }
}

/// What a failed claim leaves, as the log says while it is tried again.
const CLAIM_KEPT: &str = "the claim is tried again once the API server answers";
/// What a failed final status leaves, as the log says while it is tried
/// again.
const OUTCOME_KEPT: &str = "the outcome is kept and written once the API server answers";

/// Write the final status of a transfer, trying again while the API
/// server does not answer or refuses for a while ([`crate::patience`]),
/// until `cancel` (SIGTERM): the outcome is kept in memory meanwhile, so
/// an API server outage at the end of a volume costs no second pass over
/// it. Server-side apply drops fields this manager applied before and
/// leaves out now, so `status` carries the claim again.
async fn write_final_status(
    api: &Api<VolumeTransfer>,
    name: &str,
    status: &haulage::api::VolumeTransferStatus,
    cancel: &CancellationToken,
) -> Result<(), AgentError> {
    let apply = PatchParams::apply(AGENT_FIELD_MANAGER).force();
    let patch = haulage::api::status_apply::<VolumeTransfer>(status);
    let mut tries = Tries::start();
    loop {
        let source = match api.patch_status(name, &apply, &Patch::Apply(&patch)).await {
            Ok(_) => return Ok(()),
            // Ended by the controller meanwhile (final phases are final):
            // what was moved stays (stored packs are reused by the next
            // backup; a restore's written files by the next Sync restore).
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 404 => {
                warn!(
                    transfer = name,
                    "not recording the outcome: the controller already ended this transfer ({})",
                    status.message
                );
                return Ok(());
            }
            Err(source) => source,
        };
        let error = AgentError::Api {
            action: "write the final status of",
            transfer: name.to_string(),
            source,
        };
        tries.wait_after(error, name, OUTCOME_KEPT, cancel).await?;
    }
}

/// Move the volume of a `claimed` transfer the way its direction says,
/// and write the outcome (none when the run was interrupted).
async fn move_claimed(claimed: Claimed<'_>) -> Result<(), AgentError> {
    let &Claimed {
        name,
        ref transfer,
        assignment,
        metrics,
        ..
    } = &claimed;
    let pvc = &transfer.spec.pvc;
    let waited = match transfer.spec.direction {
        TransferDirection::Upload => {
            info!(transfer = name, pvc = %pvc, "claimed");
            // The grant limits reads from the claim's storage (a
            // StoragePolicy caps reads on backup), and follows the
            // controller's re-splits live.
            metrics.read_wait()
        }
        TransferDirection::Download => {
            info!(transfer = name, pvc = %pvc, snapshot = transfer.spec.snapshot.as_deref().unwrap_or("-"), "claimed");
            // The grant limits writes into the claim's storage (a
            // StoragePolicy caps writes on restore), and follows the
            // controller's re-splits live.
            metrics.write_wait()
        }
    };
    let run = VolumeRun::start(&claimed, waited);
    let volume = assignment.data_root.join(pvc);
    let direction = transfer.spec.direction;
    let moved = match take_shared_lock(&claimed, &run).await {
        Err(message) => Moved::failed(direction, message),
        Ok(lock) => {
            // The engine stops when the lock is lost: a prune elsewhere may
            // then treat the lock as stale and delete what it reads.
            let work = lock.cancel_on_loss(&run.volume_cancel);
            let moved = match direction {
                TransferDirection::Upload if transfer.spec.benchmark.is_some() => {
                    Moved::Measured(benchmark(&claimed, &volume, &run, &work).await)
                }
                TransferDirection::Upload => {
                    Moved::BackedUp(back_up(&claimed, &volume, &run, &work).await)
                }
                TransferDirection::Download => {
                    Moved::Restored(restore_and_verify(&claimed, &volume, &run, &work).await)
                }
            };
            let lost = lock.check();
            if let Err(error) = lock.release().await {
                warn!(
                    transfer = name,
                    "the repository lock stays until it expires: {}",
                    haulage::error_chain(&error)
                );
            }
            match lost {
                Ok(()) => moved,
                Err(error) => Moved::failed(
                    direction,
                    format!(
                        "stopped: {} (it could not be refreshed in time, so a prune may treat it as stale); nothing already stored is lost, run the {} again",
                        haulage::error_chain(&error),
                        if direction == TransferDirection::Upload {
                            "backup"
                        } else {
                            "restore (Sync)"
                        }
                    ),
                ),
            }
        }
    };
    let Some(ending) = run.end(&claimed).await else {
        return Ok(());
    };
    let generation = ending.generation;
    let seen = storage_seen(&assignment.storage);
    let mut status = moved.final_status(name, ending, &seen);
    status
        .conditions
        .extend(storage_condition(&seen, generation));
    write_final_status(claimed.api, name, &status, claimed.cancel).await
}

/// How long a transfer waits for the repository's shared lock while a
/// prune deletes (its exclusive phase): longer than a lock's expiry, so a
/// prune that died holding its lock never stops a transfer.
const SHARED_LOCK_WAIT: Duration =
    Duration::from_secs(haulage::repo::lock::LOCK_EXPIRY_SECONDS + 5 * 60);

/// Take the repository's shared lock for the claimed transfer, as `haulage
/// backup` and `haulage restore` do, so that a prune (the location's
/// scheduled maintenance, or `haulage prune` anywhere) never deletes data
/// this transfer writes or reads. Waits while a prune deletes; `Err` says
/// why the transfer cannot start. The wait ends early when the volume is
/// stopped.
async fn take_shared_lock(
    claimed: &Claimed<'_>,
    run: &VolumeRun,
) -> Result<RepositoryLock, String> {
    let &Claimed {
        name,
        ref transfer,
        assignment,
        repository,
        ..
    } = claimed;
    let verb = match transfer.spec.direction {
        TransferDirection::Upload => "backup",
        TransferDirection::Download => "restore",
    };
    let purpose = format!(
        "{verb} of claim {}/{} (VolumeTransfer {name}, agent {})",
        assignment.namespace, transfer.spec.pvc, assignment.identity
    );
    let acquire = RepositoryLock::acquire(repository, LockKind::Shared, &purpose, SHARED_LOCK_WAIT);
    let lock = tokio::select! {
        lock = acquire => lock,
        _ = run.volume_cancel.cancelled() => {
            return Err(format!("stopped while waiting for the repository's shared lock ({verb} not started)"));
        }
    };
    match lock {
        Ok(lock) => {
            for stale in &lock.stale {
                warn!(transfer = name, lock = %stale.key, state = %stale.state, "ignoring a stale repository lock: {}", stale.description);
            }
            Ok(lock)
        }
        Err(error) => Err(format!(
            "the {verb} did not start: {}; it waited {} minutes for the repository's shared lock: a prune holds the repository (`haulage repo unlock --repo URL` lists the holders and removes stale ones), run the {verb} again when it is done",
            haulage::error_chain(&error),
            SHARED_LOCK_WAIT.as_secs() / 60
        )),
    }
}

/// What the engine made of a claimed volume, the error as a message.
enum Moved {
    /// An Upload: the volume backed up.
    BackedUp(Result<BackupFigures, String>),
    /// A Download: the snapshot restored into the volume, and verified.
    Restored(Result<(RestoreFigures, RestoreVerdict), String>),
    /// An Upload with `spec.benchmark`: the volume measured.
    Measured(Result<ClaimBenchmark, String>),
}

impl Moved {
    /// A volume that could not be moved the way `direction` says.
    fn failed(direction: TransferDirection, message: String) -> Self {
        match direction {
            TransferDirection::Upload => Moved::BackedUp(Err(message)),
            TransferDirection::Download => Moved::Restored(Err(message)),
        }
    }

    /// The final status of the transfer `name` that ended so, logged;
    /// `storage` says whether a failure was the storage location's.
    fn final_status(
        self,
        name: &str,
        ending: Ending,
        storage: &StorageSeen,
    ) -> haulage::api::VolumeTransferStatus {
        match self {
            Moved::BackedUp(Ok(figures)) => {
                info!(
                    transfer = name,
                    snapshot = %figures.snapshot_id,
                    bytes_read = figures.bytes_read,
                    bytes_new = figures.bytes_new,
                    bytes_stored = figures.bytes_stored,
                    "volume backed up"
                );
                completed_status(ending, &figures)
            }
            Moved::BackedUp(Err(message)) => {
                warn!(transfer = name, "backup failed: {message}");
                failed_status(ending, &message, storage)
            }
            Moved::Restored(Ok((figures, verdict))) => restored_status(ending, &figures, &verdict),
            Moved::Measured(Ok(figures)) => {
                info!(
                    transfer = name,
                    estimate_seconds = figures.estimate_seconds,
                    limited_by = %figures.limited_by,
                    "volume measured"
                );
                measured_status(ending, figures)
            }
            Moved::Measured(Err(message)) => {
                warn!(transfer = name, "benchmark failed: {message}");
                failed_status(ending, &message, storage)
            }
            Moved::Restored(Err(message)) => {
                warn!(transfer = name, "restore failed: {message}");
                failed_status(ending, &message, storage)
            }
        }
    }
}

/// Back up the `claimed` transfer's volume, mounted at `volume`, within
/// `run`.
async fn back_up(
    claimed: &Claimed<'_>,
    volume: &std::path::Path,
    run: &VolumeRun,
    cancel: &CancellationToken,
) -> Result<BackupFigures, String> {
    let &Claimed {
        name,
        ref transfer,
        assignment,
        repository,
        ..
    } = claimed;
    let mut options = BackupOptions::new(volume);
    options.claim = transfer.spec.claim.clone().map(|mut record| {
        record.used_bytes = used_bytes(volume);
        record
    });
    options.read_throttle = run.throttle.clone();
    options.memory = assignment.memory;
    options.checkpoint_every = assignment.checkpoint_every;
    options.source_label = Some(format!("{}/{}", assignment.namespace, transfer.spec.pvc));
    options.hostname = SNAPSHOT_HOSTNAME.to_string();
    options.tags = transfer.spec.tags.clone();
    if transfer.spec.parent_policy == haulage::api::backup::ParentPolicy::Full {
        // The VolumeBackup's parentPolicy: Full: read every file again.
        options.parent = haulage::engine::backup::ParentPolicy::None;
    }
    if let Some(parent) = &transfer.spec.parent_snapshot {
        match repository.resolve_snapshot(parent).await {
            Ok(snapshot) => {
                options.parent = haulage::engine::backup::ParentPolicy::Snapshot(snapshot)
            }
            Err(error) => warn!(transfer = name, "parent {parent} not usable: {error}"),
        }
    }
    // SIGTERM (a node drain, the stage pod deleted) stops the backup
    // keeping what it read, with a last checkpoint the restarted agent goes
    // on from; the controller ending the transfer (before SIGTERM or
    // while the stopped backup stores what it read), or the lock lost,
    // stops it at once.
    options.stop = claimed.cancel.clone();
    let (engine_cancel, follower) = cancel_unless_sigterm(cancel, claimed.cancel, &run.ended);
    let outcome = backup(repository, options, run.progress.clone(), engine_cancel).await;
    follower.abort();
    let outcome = outcome.map_err(|error| haulage::error_chain(&error))?;
    let summary = &outcome.snapshot.summary;
    Ok(BackupFigures {
        snapshot_id: outcome.snapshot_id.to_string(),
        bytes_read: summary.bytes_read,
        bytes_new: summary.bytes_new,
        bytes_stored: summary.bytes_stored,
        warning_count: summary.warning_count,
        first_warning: summary
            .warnings
            .first()
            .map(|warning| format!("{warning:?}")),
    })
}

/// A token cancelled with `work` (a child of `sigterm`) when `sigterm` is
/// not what cancelled it, and after SIGTERM when `ended` is (the
/// controller ended the transfer: what a stopped backup would store is
/// then of no use); and the task that follows them (to abort once the
/// engine is done).
fn cancel_unless_sigterm(
    work: &CancellationToken,
    sigterm: &CancellationToken,
    ended: &CancellationToken,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let engine = CancellationToken::new();
    let follower = {
        let (work, sigterm, ended, engine) =
            (work.clone(), sigterm.clone(), ended.clone(), engine.clone());
        // A parent's cancel marks it cancelled before it wakes its
        // children's waiters, so SIGTERM is seen here as the cause.
        tokio::spawn(async move {
            work.cancelled().await;
            if sigterm.is_cancelled() {
                ended.cancelled().await;
            }
            engine.cancel();
        })
    };
    (engine, follower)
}

/// Why a volume cannot be moved when its mount cannot be read: the stage
/// pod does not mount the claim there (and nothing is written into the
/// pod's own filesystem).
fn unreadable_mount(volume: &std::path::Path, error: &std::io::Error) -> String {
    format!(
        "the claim's mount {} cannot be read in the stage pod ({error}): the pod does not mount the claim there",
        volume.display()
    )
}

/// Most bytes of a claim a benchmark keeps in memory for its CPU stages:
/// the stage pod's agent runs within 128 MiB.
const BENCHMARK_CPU_SAMPLE_BYTES: usize = 16 * 1024 * 1024;

/// Measure the `claimed` transfer's claim, mounted at `volume`, against
/// its storage location instead of backing it up (`spec.benchmark`): the
/// reads, the backup pipeline on samples of its files (into a throwaway
/// repository in the pod's scratch space) and the upload, its objects
/// under `bench/` deleted afterwards; the bandwidth granted to the
/// transfer is the read cap, which the estimate applies and the reads
/// average (each phase at full speed, then a rest), and what was read is
/// the transfer's progress.
async fn benchmark(
    claimed: &Claimed<'_>,
    volume: &std::path::Path,
    run: &VolumeRun,
    cancel: &CancellationToken,
) -> Result<ClaimBenchmark, String> {
    let &Claimed {
        name,
        ref transfer,
        assignment,
        repository,
        ..
    } = claimed;
    if let Err(error) = std::fs::read_dir(volume) {
        return Err(unreadable_mount(volume, &error));
    }
    let request = transfer.spec.benchmark.clone().unwrap_or_default();
    let mut settings = haulage::bench::BenchSettings::new(volume);
    settings.size = request.size_bytes();
    settings.limit_read = granted_rate(transfer);
    settings.memory = assignment.memory;
    settings.cpu_sample_bytes = BENCHMARK_CPU_SAMPLE_BYTES;
    settings.cancel = cancel.clone();
    settings.progress = Some(run.progress.clone());
    let report = haulage::bench::measure(&settings, repository.store().clone())
        .await
        .map_err(|error| haulage::error_chain(&error))?;
    if report.storage.objects_left > 0 {
        warn!(
            transfer = name,
            "{} benchmark objects could not be deleted under {} of {}",
            report.storage.objects_left,
            haulage::bench::BENCH_PREFIX,
            report.storage.location
        );
    }
    let storage_class = transfer
        .spec
        .claim
        .as_ref()
        .and_then(|claim| claim.storage_class.clone());
    Ok(report.claim_benchmark(storage_class))
}

/// Restore the `claimed` transfer's snapshot into the claim mounted at
/// `volume`, within the agent's memory share per volume, and verify it.
/// The mount must exist (the stage pod mounts the claim there; a missing
/// directory means it does not, and nothing is written into the pod's
/// own filesystem). An empty claim is restored as a new copy; one that
/// holds anything (a killed agent's partial restore, a cutover pass, the
/// `lost+found` of a fresh filesystem) in sync mode, which writes only
/// what differs and removes what the snapshot does not have. Owners are
/// restored (the restore stage pod runs as root with `CHOWN`, `FOWNER`,
/// `DAC_OVERRIDE` and `FSETID`), every chunk is checked before it is
/// written, and the grant limits the writes. `since` (the snapshot a
/// claim being synced holds completely) spares reading the files both
/// snapshots hold unchanged, in the sync and in its verification.
async fn restore_and_verify(
    claimed: &Claimed<'_>,
    volume: &std::path::Path,
    run: &VolumeRun,
    cancel: &CancellationToken,
) -> Result<(RestoreFigures, RestoreVerdict), String> {
    let &Claimed {
        name,
        ref transfer,
        assignment,
        repository,
        ..
    } = claimed;
    let memory = assignment.memory;
    let snapshot = transfer.spec.snapshot.as_deref();
    let since = transfer.spec.since_snapshot.as_deref();
    let snapshot = snapshot
        .filter(|text| !text.is_empty())
        .ok_or_else(|| {
            format!("VolumeTransfer {name} is a Download without spec.snapshot: the controller must name the snapshot to restore")
        })?;
    let snapshot = repository
        .resolve_snapshot(snapshot)
        .await
        .map_err(|error| haulage::error_chain(&error))?;
    let empty = match std::fs::read_dir(volume) {
        Ok(mut entries) => entries.next().is_none(),
        Err(error) => return Err(unreadable_mount(volume, &error)),
    };
    let mut options = RestoreOptions::new(volume);
    options.sync = !empty;
    if let Some(since) = since.filter(|_| options.sync) {
        // One that cannot be found only costs comparing every file.
        match repository.resolve_snapshot(since).await {
            Ok(id) => options.since = Some(id),
            Err(error) => warn!(
                transfer = name,
                since,
                "comparing every file: the claim's earlier snapshot cannot be used: {}",
                haulage::error_chain(&error)
            ),
        }
    }
    options.restore_owners = true;
    options.write_throttle = run.throttle.clone();
    options.memory = memory;
    let verify_options = TreeVerifyOptions::for_restore(&options);
    info!(
        transfer = name,
        snapshot = %snapshot,
        sync = options.sync,
        since = options.since.map(|id| id.to_hex()).as_deref().unwrap_or("-"),
        "restoring"
    );
    // Loaded once for the restore and its verification: the index is
    // not read and decoded twice, nor (within a bound) the trees.
    let loaded = LoadedSnapshot::load(repository, &snapshot)
        .await
        .map_err(|error| haulage::error_chain(&error))?
        .keeping_trees_for_verification(memory);
    let outcome = restore_loaded(
        repository,
        &loaded,
        options,
        run.progress.clone(),
        cancel.clone(),
    )
    .await
    .map_err(|error| haulage::error_chain(&error))?;
    info!(
        transfer = name,
        files = outcome.files,
        bytes_written = outcome.bytes_written,
        files_unchanged = outcome.files_unchanged,
        files_not_read = outcome.files_not_read,
        entries_removed = outcome.entries_removed,
        problems = outcome.problems.len(),
        seconds = outcome.duration_seconds,
        "restored; verifying the written tree"
    );
    if let Some(reason) = &outcome.since_not_used {
        warn!(transfer = name, "{reason}");
    }
    for problem in outcome.problems.iter().take(MAX_PROBLEMS_LOGGED) {
        warn!(transfer = name, path = %problem.path, "{}", problem.message);
    }
    let verify_options = verify_options.after(&outcome);
    let verification =
        verify_tree_loaded(repository, &loaded, volume, &verify_options, cancel.clone())
            .await
            .map_err(|error| haulage::error_chain(&error))?;
    info!(
        transfer = name,
        root_tree = %verification.root_tree,
        entries = verification.entries,
        bytes_verified = verification.bytes_verified,
        files_not_read = verification.files_not_read,
        mismatches = verification.mismatches.len(),
        seconds = verification.duration_seconds,
        "verified"
    );
    for mismatch in verification.mismatches.iter().take(MAX_PROBLEMS_LOGGED) {
        warn!(transfer = name, "{mismatch}");
    }
    let figures = RestoreFigures {
        snapshot_id: snapshot.to_hex(),
        bytes_written: outcome.bytes_written,
        files_unchanged: outcome.files_unchanged,
        entries_removed: outcome.entries_removed,
    };
    Ok((figures, restore_verdict(&outcome, &verification)))
}

/// Bytes in use on the filesystem mounted at `path` (its blocks less the
/// free ones), for the claim's record; `None` when it cannot be read.
fn used_bytes(path: &std::path::Path) -> Option<u64> {
    let stats = rustix::fs::statvfs(path).ok()?;
    Some(
        stats
            .f_blocks
            .saturating_sub(stats.f_bfree)
            .saturating_mul(stats.f_frsize),
    )
}

/// The last report of a run's reporter.
struct LastReport {
    progress: ApiProgress,
    claim: AgentClaim,
}

/// Report progress every `interval` until `stop`: the engine's counters,
/// never below what was reported before, with the claim of agent
/// `identity` renewed from the earlier one (the heartbeat, and when the
/// volume last moved forward), and the `StorageAvailable` condition once
/// the storage location had an outage (for the transfer's generation).
/// Returns the last report.
#[allow(
    clippy::too_many_arguments,
    reason = "the parts of one reporter, named"
)]
fn spawn_reporter(
    api: Api<VolumeTransfer>,
    name: String,
    progress: Arc<Progress>,
    mut last: Option<ApiProgress>,
    (identity, mut claim): (String, Option<AgentClaim>),
    interval: Duration,
    (storage, generation): (OutageWait, Option<i64>),
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Option<LastReport>> {
    let apply = PatchParams::apply(AGENT_FIELD_MANAGER).force();
    tokio::spawn(async move {
        let mut last_time = Instant::now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    return last
                        .zip(claim)
                        .map(|(progress, claim)| LastReport { progress, claim });
                }
                _ = tokio::time::sleep(interval) => {}
            }
            let elapsed = last_time.elapsed().as_secs_f64();
            last_time = Instant::now();
            let report = next_progress(&progress.snapshot(), last.as_ref(), elapsed);
            let renewed = agent_claim(
                &identity,
                claim.as_ref(),
                moved_forward(&report, last.as_ref()),
                &now(),
            );
            claim = Some(renewed.clone());
            let mut status = progress_status(report.clone(), renewed);
            status
                .conditions
                .extend(storage_condition(&storage_seen(&storage), generation));
            last = Some(report);
            let patch = haulage::api::status_apply::<VolumeTransfer>(&status);
            match api.patch_status(&name, &apply, &Patch::Apply(&patch)).await {
                Ok(_) => {}
                // The watch stops the volume when the controller ends the
                // transfer; a refused write in the meantime is that race.
                Err(kube::Error::Api(status)) if status.code == 422 || status.code == 404 => {
                    info!(transfer = %name, "progress not written: the transfer ended ({})", status.message);
                }
                Err(error) => warn!(transfer = %name, "progress not written: {error}"),
            }
        }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[tokio::test]
    async fn the_engine_stops_at_once_when_the_controller_ends_the_transfer_but_not_at_sigterm() {
        // The controller (or a lost lock) cancels the volume's work.
        let sigterm = CancellationToken::new();
        let work = sigterm.child_token();
        let ended = CancellationToken::new();
        let (engine, follower) = cancel_unless_sigterm(&work, &sigterm, &ended);
        work.cancel();
        tokio::time::timeout(Duration::from_secs(5), engine.cancelled())
            .await
            .expect("the engine is cancelled with the volume's work");
        let _ = follower.await;
        // SIGTERM cancels the work as its parent: the engine is only
        // stopped (BackupOptions::stop), to store what it read first...
        let sigterm = CancellationToken::new();
        let work = sigterm.child_token();
        let ended = CancellationToken::new();
        let (engine, follower) = cancel_unless_sigterm(&work, &sigterm, &ended);
        sigterm.cancel();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(work.is_cancelled());
        assert!(!engine.is_cancelled(), "SIGTERM cancelled the engine");
        // ...unless the controller ends the transfer meanwhile.
        ended.cancel();
        tokio::time::timeout(Duration::from_secs(5), engine.cancelled())
            .await
            .expect("the transfer ended after SIGTERM does not cancel the engine");
        follower.await.expect("the follower ends");
    }

    #[tokio::test]
    async fn a_transfer_deleted_after_sigterm_still_ends_the_volume_while_it_stores_what_it_read() {
        let (sender, receiver) = watch::channel(Watched::Unknown);
        let sigterm = CancellationToken::new();
        let volume_cancel = sigterm.child_token();
        let (ended, done) = (CancellationToken::new(), CancellationToken::new());
        let supervisor = supervise_volume(
            receiver,
            "t".to_string(),
            Throttle::new(None),
            None,
            (volume_cancel.clone(), ended.clone(), done.clone()),
        );
        sender.send_replace(Watched::Seen(Arc::new(transfer(
            Some(VolumeTransferPhase::InProgress),
            Some("a"),
        ))));
        sigterm.cancel();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!ended.is_cancelled(), "SIGTERM is not the transfer's end");
        sender.send_replace(Watched::Deleted);
        tokio::time::timeout(Duration::from_secs(5), ended.cancelled())
            .await
            .expect("the deletion after SIGTERM was not seen");
        supervisor.await.expect("the supervisor ends");
        // And the run's end ends the supervisor.
        let (_sender, receiver) = watch::channel(Watched::Unknown);
        let supervisor = supervise_volume(
            receiver,
            "t".to_string(),
            Throttle::new(None),
            None,
            (CancellationToken::new(), ended.clone(), done.clone()),
        );
        done.cancel();
        tokio::time::timeout(Duration::from_secs(5), supervisor)
            .await
            .expect("the supervisor outlived its run")
            .expect("the supervisor ends");
    }

    fn transfer(phase: Option<VolumeTransferPhase>, agent: Option<&str>) -> VolumeTransfer {
        let mut transfer: VolumeTransfer = serde_json::from_value(serde_json::json!({
            "apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeTransfer",
            "metadata": {"name": "t", "namespace": "shop"},
            "spec": {"direction": "Upload", "pvc": "data",
                "backupRef": {"namespace": "ops", "name": "nightly"},
                "storageLocation": {"namespace": "ops", "name": "minio"},
                "stagePod": "stage-a"},
        }))
        .expect("valid transfer");
        if phase.is_some() || agent.is_some() {
            transfer.status = Some(haulage::api::VolumeTransferStatus {
                phase,
                agent: agent.map(|identity| haulage::api::transfer::AgentClaim {
                    identity: identity.to_string(),
                    claimed_at: now(),
                    heartbeat_time: now(),
                    progress_time: None,
                }),
                ..Default::default()
            });
        }
        transfer
    }

    #[test]
    fn the_agent_starts_only_admitted_transfers_that_are_its_own() {
        assert_eq!(admission_decision(&transfer(None, None), "a"), None);
        assert_eq!(
            admission_decision(&transfer(Some(VolumeTransferPhase::Queued), None), "a"),
            None
        );
        assert_eq!(
            admission_decision(&transfer(Some(VolumeTransferPhase::Admitted), None), "a"),
            Some(true)
        );
        assert_eq!(
            admission_decision(
                &transfer(Some(VolumeTransferPhase::InProgress), Some("a")),
                "a"
            ),
            Some(true),
            "its own, after a restart"
        );
        assert_eq!(
            admission_decision(
                &transfer(Some(VolumeTransferPhase::InProgress), Some("b")),
                "a"
            ),
            Some(false)
        );
        assert_eq!(
            admission_decision(&transfer(Some(VolumeTransferPhase::Canceled), None), "a"),
            Some(false)
        );
    }

    /// [`supervise_volume`] of transfer `t`, no grant yet, stopping
    /// `volume_cancel`; its other tokens unused.
    fn supervise(
        receiver: watch::Receiver<Watched>,
        throttle: Throttle,
        volume_cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let unused = (CancellationToken::new(), CancellationToken::new());
        supervise_volume(
            receiver,
            "t".to_string(),
            throttle,
            None,
            (volume_cancel, unused.0, unused.1),
        )
    }

    #[tokio::test]
    async fn a_cancel_seen_on_the_watch_stops_the_volume_and_a_grant_change_reaches_the_throttle() {
        let (sender, receiver) = watch::channel(Watched::Unknown);
        let throttle = Throttle::new(None);
        let volume_cancel = CancellationToken::new();
        let supervisor = supervise(receiver, throttle.clone(), volume_cancel.clone());
        let mut granted = transfer(Some(VolumeTransferPhase::InProgress), Some("a"));
        granted.spec.granted_bytes_per_second = Some(4096);
        sender.send_replace(Watched::Seen(Arc::new(granted)));
        tokio::time::timeout(Duration::from_secs(5), async {
            while throttle.rate() != Some(ByteRate(4096)) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the grant reaches the throttle");
        assert!(!volume_cancel.is_cancelled());
        sender.send_replace(Watched::Seen(Arc::new(transfer(
            Some(VolumeTransferPhase::Canceled),
            Some("a"),
        ))));
        tokio::time::timeout(Duration::from_secs(5), volume_cancel.cancelled())
            .await
            .expect("a cancel on the watch stops the volume");
        supervisor.await.expect("the supervisor ends");
    }

    #[tokio::test]
    async fn a_deleted_transfer_stops_its_volume() {
        let (sender, receiver) = watch::channel(Watched::Unknown);
        let volume_cancel = CancellationToken::new();
        let supervisor = supervise(receiver, Throttle::new(None), volume_cancel.clone());
        sender.send_replace(Watched::Deleted);
        tokio::time::timeout(Duration::from_secs(5), volume_cancel.cancelled())
            .await
            .expect("a deletion stops the volume");
        supervisor.await.expect("the supervisor ends");
    }

    /// The API server's answer `code` to `action` on a transfer.
    pub(crate) fn api_error(action: &'static str, code: u16) -> AgentError {
        AgentError::Api {
            action,
            transfer: "shop/t".to_string(),
            source: kube::Error::Api(
                kube::core::Status::failure("no", "Reason")
                    .with_code(code)
                    .boxed(),
            ),
        }
    }

    #[test]
    fn api_errors_are_transient_unless_the_server_refused_the_request() {
        let error = |code: u16| api_error("claim", code);
        assert!(error(503).is_transient());
        assert!(error(409).is_transient());
        assert!(error(429).is_transient());
        assert!(!error(403).is_transient());
        assert!(!error(422).is_transient());
        assert!(
            AgentError::WatchEnded {
                transfer: "shop/t".to_string()
            }
            .is_transient()
        );
        assert!(RunError::Stopped.is_transient());
    }
}
