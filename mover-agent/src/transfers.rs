//! VolumeTransfer mode: the agent of a stage pod claims the transfers the
//! controller assigned to its pod (a resourceVersion-checked write, so a
//! transfer claimed by a live agent is never taken by another), backs each
//! volume up with the engine (a bounded number at once), reports progress
//! at most once per interval and never backwards, and writes the final
//! figures. SIGTERM cancels the engine and exits non-zero, leaving the
//! transfers InProgress: the restarted pod claims them again and the
//! engine adopts the packs already stored.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use haulage::api::condition::{Condition, ConditionStatus, condition_type, reason};
use haulage::api::labels::AGENT_FIELD_MANAGER;
use haulage::api::transfer::AgentClaim;
use haulage::api::{Progress as ApiProgress, VolumeTransfer, VolumeTransferPhase};
use haulage::engine::Repository;
use haulage::engine::backup::{BackupOptions, backup};
use haulage::engine::progress::Progress;
use haulage::engine::throttle::{ByteRate, Throttle};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::AgentMetrics;
use crate::report::next_progress;

/// Hostname recorded in every snapshot the agent writes: stable across
/// stage pods and nodes, so the next backup of the same claim (source
/// label `namespace/pvc`) finds its parent wherever it runs.
const SNAPSHOT_HOSTNAME: &str = "haulage-stage-pod";
/// Seconds between looks at a transfer that is not admitted yet.
const ADMISSION_POLL_SECONDS: u64 = 2;

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
    /// Volumes backed up at once.
    pub parallelism: usize,
    /// Least time between two progress writes of one transfer.
    pub progress_interval: Duration,
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn status_patch(status: serde_json::Value) -> serde_json::Value {
    haulage::api::status_apply::<VolumeTransfer>(&status)
}

/// Run every assigned transfer; Ok when each reached a final phase (its
/// own failure is recorded in its status, not in the exit code).
pub async fn run(
    assignment: Assignment,
    repository: Arc<Repository>,
    client: kube::Client,
    metrics: Arc<AgentMetrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
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
            // Admission first, then a place among the volumes this agent
            // moves at once: a transfer waiting for admission must not
            // hold a place an admitted one of the same pod needs (with a
            // cap of one, that would wait forever).
            let result = match wait_for_admission(&api, &name, &assignment.identity, &cancel).await
            {
                Ok(true) => {
                    let _permit = gate.acquire_owned().await;
                    run_one(&api, &name, &assignment, &repository, &metrics, &cancel).await
                }
                Ok(false) => Ok(()),
                Err(error) => Err(error),
            };
            (name, result)
        });
    }
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (name, result) = joined.context("a transfer task panicked")?;
        if let Err(error) = result {
            warn!(transfer = %name, "{error:#}");
            first_error.get_or_insert(error.context(format!("transfer {name}")));
        }
    }
    if cancel.is_cancelled() {
        anyhow::bail!("stopped by SIGTERM; the restarted agent resumes");
    }
    match first_error {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// Wait until the transfer is admitted (or further); false when there is
/// nothing to do (final already, claimed by another agent, or SIGTERM).
async fn wait_for_admission(
    api: &Api<VolumeTransfer>,
    name: &str,
    identity: &str,
    cancel: &CancellationToken,
) -> anyhow::Result<bool> {
    // A watch of this one object (the agent's Role allows watching it by
    // name): no polling, however many transfers wait in the queue.
    let events = watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff()
    .applied_objects();
    let mut events = std::pin::pin!(events);
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return Ok(false),
            next = events.next() => next,
        };
        match next {
            Some(Ok(transfer)) => {
                if let Some(admitted) = admission_decision(&transfer, name, identity) {
                    return Ok(admitted);
                }
            }
            Some(Err(error)) => warn!(
                transfer = name,
                "watch while waiting for admission: {error}"
            ),
            None => anyhow::bail!("the watch of VolumeTransfer {name} ended"),
        }
    }
}

/// What a waiting agent does on seeing `transfer`: `Some(true)` start (it
/// is admitted), `Some(false)` leave it (final, or another agent's),
/// `None` keep waiting.
fn admission_decision(transfer: &VolumeTransfer, name: &str, identity: &str) -> Option<bool> {
    let status = transfer.status.clone().unwrap_or_default();
    let phase = status.phase.unwrap_or(VolumeTransferPhase::New);
    if phase.is_final() {
        info!(transfer = name, ?phase, "already final");
        return Some(false);
    }
    if let Some(agent) = &status.agent
        && agent.identity != identity
    {
        info!(transfer = name, owner = %agent.identity, "claimed by another agent");
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

/// Follow the transfer's `spec.grantedBytesPerSecond` into `throttle`
/// until `stop`: a watch on this one object (the agent's Role allows
/// watching it by name), so a re-split applies within the watch's latency
/// and the copy never restarts.
fn follow_grant(
    api: Api<VolumeTransfer>,
    name: String,
    throttle: Throttle,
    mut granted: Option<ByteRate>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let events = watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .default_backoff()
        .applied_objects();
        let mut events = std::pin::pin!(events);
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => return,
                next = events.next() => next,
            };
            match next {
                Some(Ok(transfer)) => {
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
                Some(Err(error)) => warn!(transfer = %name, "watch of the grant: {error}"),
                None => return,
            }
        }
    })
}

/// Claim an admitted transfer. `None` when there is nothing to do (final
/// already, or claimed by another live agent).
async fn claim(
    api: &Api<VolumeTransfer>,
    name: &str,
    identity: &str,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<VolumeTransfer>> {
    loop {
        let transfer = api
            .get(name)
            .await
            .with_context(|| format!("failed to get VolumeTransfer {name}"))?;
        match admission_decision(&transfer, name, identity) {
            Some(true) => {}
            Some(false) => return Ok(None),
            None => {
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(Duration::from_secs(ADMISSION_POLL_SECONDS)) => continue,
                }
            }
        }
        let status = transfer.status.clone().unwrap_or_default();
        let time = now();
        let claim = serde_json::json!({
            "metadata": {"resourceVersion": transfer.resource_version()},
            "status": {
                "phase": VolumeTransferPhase::InProgress,
                "agent": AgentClaim {
                    identity: identity.to_string(),
                    claimed_at: status.agent.as_ref().map_or(time.clone(), |a| a.claimed_at.clone()),
                    heartbeat_time: time.clone(),
                },
                "startTime": status.start_time.clone().unwrap_or(time),
            },
        });
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&claim))
            .await
        {
            Ok(claimed) => return Ok(Some(claimed)),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                info!(transfer = name, "changed while claiming; looking again");
            }
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("failed to claim VolumeTransfer {name}"));
            }
        }
    }
}

async fn run_one(
    api: &Api<VolumeTransfer>,
    name: &str,
    assignment: &Assignment,
    repository: &Repository,
    metrics: &AgentMetrics,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    let Some(transfer) = claim(api, name, &assignment.identity, cancel).await? else {
        return Ok(());
    };
    let pvc = transfer.spec.pvc.clone();
    info!(transfer = name, pvc = %pvc, "claimed");
    let apply = PatchParams::apply(AGENT_FIELD_MANAGER).force();
    let progress = Arc::new(Progress::default());
    metrics.track(&assignment.namespace, &pvc, progress.clone());
    let volume_cancel = cancel.child_token();
    let reporter = {
        let api = api.clone();
        let name = name.to_string();
        let progress = progress.clone();
        let volume_cancel = volume_cancel.clone();
        let interval = assignment.progress_interval;
        let identity = assignment.identity.clone();
        let claimed_at = transfer
            .status
            .as_ref()
            .and_then(|status| status.agent.as_ref())
            .map_or_else(now, |agent| agent.claimed_at.clone());
        let apply = apply.clone();
        let mut last: Option<ApiProgress> = transfer
            .status
            .as_ref()
            .and_then(|status| status.progress.clone());
        tokio::spawn(async move {
            let mut last_time = Instant::now();
            loop {
                tokio::select! {
                    _ = volume_cancel.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
                let elapsed = last_time.elapsed().as_secs_f64();
                last_time = Instant::now();
                let report = next_progress(&progress.snapshot(), last.as_ref(), elapsed);
                let patch = status_patch(serde_json::json!({
                    "phase": VolumeTransferPhase::InProgress,
                    "progress": report,
                    "agent": AgentClaim {
                        identity: identity.clone(),
                        claimed_at: claimed_at.clone(),
                        heartbeat_time: now(),
                    },
                }));
                last = Some(report);
                match api.patch_status(&name, &apply, &Patch::Apply(&patch)).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 404 => {
                        warn!(transfer = %name, "transfer deleted; stopping");
                        volume_cancel.cancel();
                        return;
                    }
                    // The CRD refuses any write out of a final phase: the
                    // controller canceled or failed the transfer (its
                    // backup was deleted, or its stage pod gave up).
                    Err(kube::Error::Api(status)) if status.code == 422 => {
                        warn!(transfer = %name, "the controller ended this transfer ({}); stopping", status.message);
                        volume_cancel.cancel();
                        return;
                    }
                    Err(error) => warn!(transfer = %name, "progress not written: {error}"),
                }
            }
        })
    };

    // The grant limits reads from the claim's storage (a StoragePolicy caps
    // reads on backup), and follows the controller's re-splits live.
    let granted = granted_rate(&transfer);
    let throttle = Throttle::new(granted)
        .recording_wait_into(metrics.read_wait())
        .cancelled_by(volume_cancel.clone());
    let grant_follower = follow_grant(
        api.clone(),
        name.to_string(),
        throttle.clone(),
        granted,
        volume_cancel.clone(),
    );
    info!(
        transfer = name,
        bytes_per_second = granted.map(|ByteRate(bytes)| bytes),
        "bandwidth granted"
    );
    let mut options = BackupOptions::new(assignment.data_root.join(&pvc));
    options.read_throttle = throttle;
    options.source_label = Some(format!("{}/{pvc}", assignment.namespace));
    options.hostname = SNAPSHOT_HOSTNAME.to_string();
    if let Some(parent) = &transfer.spec.parent_snapshot {
        match repository.resolve_snapshot(parent).await {
            Ok(snapshot) => {
                options.parent = haulage::engine::backup::ParentPolicy::Snapshot(snapshot)
            }
            Err(error) => warn!(transfer = name, "parent {parent} not usable: {error}"),
        }
    }
    let result = backup(repository, options, progress.clone(), volume_cancel.clone()).await;
    let stopped_by_controller = volume_cancel.is_cancelled() && !cancel.is_cancelled();
    volume_cancel.cancel();
    let _ = reporter.await;
    let _ = grant_follower.await;
    if cancel.is_cancelled() {
        info!(
            transfer = name,
            "stopped by SIGTERM; stays InProgress for the restarted agent"
        );
        return Ok(());
    }
    if stopped_by_controller {
        return Ok(());
    }
    let last = transfer.status.as_ref().and_then(|s| s.progress.clone());
    let final_progress = next_progress(&progress.snapshot(), last.as_ref(), 0.0);
    let time = now();
    // Server-side apply drops fields this manager applied before and
    // leaves out now, so the claim is applied again with the final status.
    let agent = AgentClaim {
        identity: assignment.identity.clone(),
        claimed_at: transfer
            .status
            .as_ref()
            .and_then(|status| status.agent.as_ref())
            .map_or_else(|| time.clone(), |agent| agent.claimed_at.clone()),
        heartbeat_time: time.clone(),
    };
    let patch = match result {
        Ok(outcome) => {
            let summary = &outcome.snapshot.summary;
            let message = summary
                .warnings
                .first()
                .map(|warning| format!("{} warnings, first: {warning:?}", summary.warning_count));
            info!(
                transfer = name,
                snapshot = %outcome.snapshot_id,
                bytes_read = summary.bytes_read,
                bytes_new = summary.bytes_new,
                bytes_stored = summary.bytes_stored,
                "volume backed up"
            );
            let mut completed = final_progress.clone();
            completed.bytes_done = completed.total_bytes;
            completed.eta_seconds = Some(0);
            let signed = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
            status_patch(serde_json::json!({
                "phase": VolumeTransferPhase::Completed,
                "agent": agent,
                "progress": completed.with_percent(true),
                "snapshotId": outcome.snapshot_id.to_string(),
                "bytesRead": signed(summary.bytes_read),
                "bytesNew": signed(summary.bytes_new),
                "bytesStored": signed(summary.bytes_stored),
                "warnings": signed(summary.warning_count),
                "message": message.map(|m| haulage::api::condition::bounded_message(&m)),
                "completionTime": time.clone(),
                "conditions": [Condition::new(
                    condition_type::COMPLETE, ConditionStatus::True, reason::ALL_VOLUMES_COMPLETED,
                    "snapshot written", transfer.metadata.generation, time.clone())],
            }))
        }
        Err(error) => {
            let message = format!("{error:#}");
            warn!(transfer = name, "backup failed: {message}");
            status_patch(serde_json::json!({
                "phase": VolumeTransferPhase::Failed,
                "agent": agent,
                "progress": final_progress,
                "message": haulage::api::condition::bounded_message(&message),
                "completionTime": time.clone(),
                "conditions": [Condition::new(
                    condition_type::FAILED, ConditionStatus::True, reason::ALL_VOLUMES_FAILED,
                    &message, transfer.metadata.generation, time.clone())],
            }))
        }
    };
    match api.patch_status(name, &apply, &Patch::Apply(&patch)).await {
        Ok(_) => Ok(()),
        // Ended by the controller meanwhile (final phases are final): what
        // was stored stays in the repository for the next backup.
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 404 => {
            warn!(
                transfer = name,
                "not recording the outcome: the controller already ended this transfer ({})",
                status.message
            );
            Ok(())
        }
        Err(error) => Err(anyhow::Error::new(error).context(format!(
            "failed to write the final status of VolumeTransfer {name}"
        ))),
    }
}
