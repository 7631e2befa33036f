//! Stage pod supervision as a pure function: from a stage pod as the cache
//! shows it, the attempts already spent on its transfers and the clock,
//! decide whether it is healthy, should be recreated (after a backoff), or
//! has failed for good with a reason a user can act on.
//!
//! Who retries what:
//! - a crashing agent container is restarted by the kubelet
//!   (`restartPolicy: OnFailure`, the kubelet's own 10 s → 5 min backoff);
//!   after [`MAX_CONTAINER_RESTARTS`] restarts (about 5 minutes of kubelet
//!   backoff) the controller stops it, even if it is up again, and
//!   fails its volumes with the last exit code, reason and log line, since
//!   the next restart would most likely crash the same way — unless the
//!   crashes only slow it down: an agent that moved its volume forward
//!   within [`CRASH_LOOP_WINDOW_SECONDS`] before its latest crash (its
//!   transfers' `agent.progressTime`), or has been running that long since,
//!   is left to the kubelet (an agent OOM-killed now and then over a
//!   day-long volume, each run resuming further, is not a crash loop);
//! - a pod the kubelet gave up on (phase `Failed`: evicted, node shut down,
//!   preempted) is deleted and created again by the controller, after
//!   [`RECREATE_BACKOFF_SECONDS`] × 2^attempts, at most
//!   [`MAX_POD_ATTEMPTS`] times in all;
//! - a pod that cannot start (image cannot be pulled, container cannot be
//!   created, cannot be scheduled) fails its volumes after
//!   [`PENDING_TIMEOUT_SECONDS`], or at once when the image name is invalid.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use haulage_api::condition::{Condition, ConditionStatus, bounded_message, condition_type, reason};
use haulage_api::{VolumeTransfer, VolumeTransferPhase, VolumeTransferStatus};
use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::action::{Action, Event, ObjectName};

/// Container restarts after which a crash-looping agent's volumes fail.
pub const MAX_CONTAINER_RESTARTS: i32 = 5;
/// Seconds of running, or of moving the volume forward before a crash,
/// after which an agent's restarts are not a crash loop (the kubelet too
/// resets its restart backoff after a container ran 10 minutes).
pub const CRASH_LOOP_WINDOW_SECONDS: i64 = 600;
/// Stage pods made for the same volumes, the first one included.
pub const MAX_POD_ATTEMPTS: i32 = 3;
/// Seconds before the first re-creation of a failed pod; doubled each time.
pub const RECREATE_BACKOFF_SECONDS: i64 = 10;
/// Seconds a pod may stay unable to start before its volumes fail.
pub const PENDING_TIMEOUT_SECONDS: i64 = 300;

/// Waiting reasons of a container whose image cannot be pulled.
const IMAGE_PULL_REASONS: &[&str] = &["ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"];
/// Waiting reasons of a container that cannot be created.
const CREATE_REASONS: &[&str] = &["CreateContainerConfigError", "CreateContainerError"];

/// What to do with a stage pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Running, starting, or finished well: nothing to do.
    Healthy,
    /// Failed, with attempts left: delete it so it is created again, once
    /// `after_seconds` have passed (0: now).
    Recreate {
        /// The attempt number the new pod will be (2 for the first retry).
        attempt: i32,
        /// Seconds to wait before deleting it.
        after_seconds: i64,
        /// Why the pod failed.
        message: String,
    },
    /// Its volumes fail with this message.
    Fail {
        /// What went wrong and what to do.
        message: String,
    },
}

/// Judge `pod`, `attempts` pods having been made for its volumes before
/// this one (0 for the first), its agent having last moved one of them
/// forward at `last_moved`, at `now` (all times in seconds since the
/// epoch).
pub fn verdict(pod: &Pod, attempts: i32, last_moved: Option<i64>, now: i64) -> Verdict {
    let name = pod.metadata.name.as_deref().unwrap_or("<unnamed>");
    let Some(status) = pod.status.as_ref() else {
        return Verdict::Healthy;
    };
    let created = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(now, |time| time.0.as_second());
    let age = now - created;
    let container = status.container_statuses.iter().flatten().next();

    if status.phase.as_deref() == Some("Failed") {
        let terminated = container
            .and_then(|container| container.state.as_ref())
            .and_then(|state| state.terminated.as_ref());
        let detail = match terminated {
            Some(state) => describe_termination(state),
            None => status
                .message
                .clone()
                .or_else(|| status.reason.clone())
                .unwrap_or_else(|| "no reason given".to_string()),
        };
        let this_attempt = attempts + 1;
        if this_attempt >= MAX_POD_ATTEMPTS {
            return Verdict::Fail {
                message: format!("stage pod {name} failed {this_attempt} times; last: {detail}"),
            };
        }
        let failed_at = terminated
            .and_then(|state| state.finished_at.as_ref())
            .map_or(now, |time| time.0.as_second());
        let backoff = RECREATE_BACKOFF_SECONDS << attempts.clamp(0, 10);
        return Verdict::Recreate {
            attempt: this_attempt + 1,
            after_seconds: (failed_at + backoff - now).max(0),
            message: format!("stage pod {name} failed: {detail}"),
        };
    }

    if let Some(container) = container {
        if container.restart_count >= MAX_CONTAINER_RESTARTS
            && crash_looping(container, last_moved, now)
        {
            let last = container
                .last_state
                .as_ref()
                .and_then(|state| state.terminated.as_ref())
                .or_else(|| {
                    container
                        .state
                        .as_ref()
                        .and_then(|state| state.terminated.as_ref())
                })
                .map(describe_termination)
                .unwrap_or_else(|| "no exit recorded".to_string());
            return Verdict::Fail {
                message: format!(
                    "the agent in stage pod {name} crashed {} times; last: {last}",
                    container.restart_count
                ),
            };
        }
        if let Some(waiting) = container
            .state
            .as_ref()
            .and_then(|state| state.waiting.as_ref())
        {
            let reason = waiting.reason.as_deref().unwrap_or_default();
            let detail = waiting.message.as_deref().unwrap_or(reason);
            if reason == "InvalidImageName" {
                return Verdict::Fail {
                    message: format!(
                        "stage pod {name}: invalid agent image {:?}: {detail}; fix --agent-image (HAULAGE_AGENT_IMAGE) of the controller",
                        container.image
                    ),
                };
            }
            if IMAGE_PULL_REASONS.contains(&reason) && age > PENDING_TIMEOUT_SECONDS {
                return Verdict::Fail {
                    message: format!(
                        "stage pod {name}: agent image {} cannot be pulled ({reason}: {detail}); check --agent-image (HAULAGE_AGENT_IMAGE), the registry and its pull secret",
                        container.image
                    ),
                };
            }
            if CREATE_REASONS.contains(&reason) && age > PENDING_TIMEOUT_SECONDS {
                return Verdict::Fail {
                    message: format!(
                        "stage pod {name}: the agent container cannot be created ({reason}: {detail})"
                    ),
                };
            }
        }
    }

    let unschedulable = status.conditions.iter().flatten().find(|condition| {
        condition.type_ == "PodScheduled"
            && condition.status == "False"
            && condition.reason.as_deref() == Some("Unschedulable")
    });
    if let Some(condition) = unschedulable
        && age > PENDING_TIMEOUT_SECONDS
    {
        return Verdict::Fail {
            message: format!(
                "stage pod {name} cannot be scheduled: {}; check the node's taints, resources and the volume's topology",
                condition.message.as_deref().unwrap_or("no message")
            ),
        };
    }
    Verdict::Healthy
}

/// Whether an agent container restarted [`MAX_CONTAINER_RESTARTS`] times
/// crashes in a loop: not when it has been running for
/// [`CRASH_LOOP_WINDOW_SECONDS`] since its latest start, nor when its
/// latest run before a crash lasted that long (a resumed volume re-reads
/// what it stored before it moves past its earlier high-water mark, which
/// on a large volume takes longer than the window), nor when it moved its
/// volume forward (`last_moved`) within that window before its latest
/// crash.
fn crash_looping(container: &ContainerStatus, last_moved: Option<i64>, now: i64) -> bool {
    let seconds = |time: &Time| time.0.as_second();
    let running_since = container
        .state
        .as_ref()
        .and_then(|state| state.running.as_ref())
        .and_then(|running| running.started_at.as_ref())
        .map(seconds);
    if running_since.is_some_and(|since| now - since >= CRASH_LOOP_WINDOW_SECONDS) {
        return false;
    }
    let latest_run_seconds = [&container.last_state, &container.state]
        .into_iter()
        .flatten()
        .filter_map(|state| {
            let ended = state.terminated.as_ref()?;
            Some(seconds(ended.finished_at.as_ref()?) - seconds(ended.started_at.as_ref()?))
        })
        .max();
    if latest_run_seconds.is_some_and(|run| run >= CRASH_LOOP_WINDOW_SECONDS) {
        return false;
    }
    let latest_crash = [&container.last_state, &container.state]
        .into_iter()
        .flatten()
        .filter_map(|state| state.terminated.as_ref()?.finished_at.as_ref())
        .map(seconds)
        .max()
        .unwrap_or(now);
    last_moved.is_none_or(|moved| moved < latest_crash - CRASH_LOOP_WINDOW_SECONDS)
}

/// The statuses of the pod's agent container (one, or none yet).
fn agent_containers(pod: &Pod) -> impl Iterator<Item = &ContainerStatus> {
    pod.status
        .as_ref()
        .and_then(|status| status.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter(|container| container.name == crate::stage_pod::AGENT_CONTAINER)
}

/// Default seconds without a heartbeat after which a running agent counts
/// as lost (it reports every 2 s, throttled or not).
pub const DEFAULT_AGENT_LOST_SECONDS: u32 = 300;

/// A running pod whose agent stopped reporting (a hung process, a stuck
/// mount, a pod that lost the API server) is treated like a failed pod:
/// recreated while attempts remain, then its volumes fail. `heartbeats`
/// are the `agent.heartbeatTime` (seconds) of the pod's InProgress
/// transfers; `None` when the agent is fine (or nothing runs).
pub fn lost_agent(
    pod: &Pod,
    heartbeats: &[i64],
    attempts: i32,
    now: i64,
    watch: AgentWatch<'_>,
) -> Option<Verdict> {
    // While the API server does not answer, no heartbeat can reach it.
    if watch.api_outages.iter().any(|outage| outage.to.is_none()) {
        return None;
    }
    let name = pod.metadata.name.as_deref().unwrap_or("<unnamed>");
    let running = pod
        .status
        .as_ref()
        .and_then(|status| status.phase.as_deref())
        == Some("Running");
    // A pod being deleted is already handled; a new pod (recreated, or a
    // restarted container) is given the whole interval from the moment its
    // agent container started running. Not from the pod's creation or
    // `startTime`: pulling the image, or waiting for the node to stop the
    // replaced pod's process, would count as the agent's silence (the
    // end-to-end test saw a recreated pod judged lost again the moment it
    // ran, its old process having taken 20 s to stop).
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    // An agent container not running (waiting to be restarted after a
    // crash, the kubelet's backoff up to 5 minutes) is not silent but
    // stopped: the crash-loop rule of [`verdict`] judges it.
    let agent_stopped = agent_containers(pod).any(|container| {
        container
            .state
            .as_ref()
            .is_some_and(|state| state.running.is_none())
    });
    if agent_stopped {
        return None;
    }
    let agent_started = agent_containers(pod)
        .filter_map(|container| {
            container
                .state
                .as_ref()?
                .running
                .as_ref()?
                .started_at
                .as_ref()
        })
        .map(|time| time.0.as_second())
        .max();
    let started = agent_started
        .or_else(|| {
            pod.status
                .as_ref()
                .and_then(|status| status.start_time.as_ref())
                .or(pod.metadata.creation_timestamp.as_ref())
                .map(|time| time.0.as_second())
        })
        .unwrap_or(i64::MIN);
    let latest = heartbeats.iter().copied().max()?.max(started);
    let silent = now - latest;
    // The silence counted is what fell while the API server answered
    // (and its watches had caught up): an agent's heartbeats cannot reach
    // a server that does not answer.
    let away = time_away(watch.api_outages, latest, now);
    let counted = silent - away;
    if !running || counted <= i64::from(watch.lost_after_seconds) {
        return None;
    }
    let message = if away > 0 {
        format!(
            "the agent in stage pod {name} has not reported for {silent}s, {counted}s of them while the API server answered (a hung process or a stuck volume mount?)"
        )
    } else {
        format!(
            "the agent in stage pod {name} has not reported for {silent}s (a hung process or a stuck volume mount?)"
        )
    };
    let this_attempt = attempts + 1;
    Some(if this_attempt >= MAX_POD_ATTEMPTS {
        Verdict::Fail {
            message: format!("{message}; gave up after {this_attempt} stage pods"),
        }
    } else {
        Verdict::Recreate {
            attempt: this_attempt + 1,
            after_seconds: 0,
            message,
        }
    })
}

/// How agents are judged lost ([`lost_agent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentWatch<'a> {
    /// Seconds an agent may go without reporting (`--agent-lost-seconds`).
    pub lost_after_seconds: u32,
    /// When this replica saw the API server not answering, oldest first:
    /// no agent's silence is counted in them, nor while one lasts.
    pub api_outages: &'a [ApiOutage],
}

/// A time (seconds since the epoch) the API server did not answer this
/// replica: from its last answer before to its first after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiOutage {
    /// The last answer before (`i64::MIN`: before this replica started,
    /// which could not see whether the agents could report).
    pub from: i64,
    /// The first answer after; `None` while it lasts.
    pub to: Option<i64>,
}

/// Seconds after an outage ends during which an agent's silence is not
/// counted either: its watches take that long to bring the heartbeats
/// written since into the caches (8–13 s measured after a 2-minute outage).
pub const API_CATCH_UP_SECONDS: i64 = 30;

/// Seconds of `[from, to]` that fell in `outages` (each lengthened by
/// [`API_CATCH_UP_SECONDS`]), overlaps counted once.
fn time_away(outages: &[ApiOutage], from: i64, to: i64) -> i64 {
    let mut spans: Vec<(i64, i64)> = outages
        .iter()
        .map(|outage| {
            let end = outage
                .to
                .map_or(i64::MAX, |end| end.saturating_add(API_CATCH_UP_SECONDS));
            (outage.from.max(from), end.min(to))
        })
        .filter(|(start, end)| start < end)
        .collect();
    spans.sort_unstable();
    let mut away = 0;
    let mut covered_to = i64::MIN;
    for (start, end) in spans {
        let start = start.max(covered_to);
        if end > start {
            away += end - start;
            covered_to = end;
        }
    }
    away
}

/// "exit code 137 (OOMKilled): last log line", and what to do about an
/// agent that ran out of memory.
fn describe_termination(state: &ContainerStateTerminated) -> String {
    let mut detail = format!("exit code {}", state.exit_code);
    if let Some(reason) = state.reason.as_deref().filter(|reason| !reason.is_empty()) {
        detail.push_str(&format!(" ({reason})"));
    }
    if let Some(message) = state.message.as_deref() {
        let last = message.lines().rev().find(|line| !line.trim().is_empty());
        if let Some(last) = last {
            detail.push_str(&format!(": {}", last.trim()));
        }
    }
    if state.reason.as_deref() == Some("OOMKilled") {
        detail.push_str(OUT_OF_MEMORY_ADVICE);
    }
    detail
}

/// Said of an agent killed for its memory: what its stage pod's request
/// must hold grows with the repository's index (52 bytes a blob, 50 MiB
/// a million), which the agent's baseline covers only up to a few
/// hundred thousand blobs.
const OUT_OF_MEMORY_ADVICE: &str = " (the stage pod's memory is too small for this repository's index or its volumes at once: give the stage pods of these claims more memory with a StoragePolicy's spec.stagePodResources)";

/// The transfers of one stage pod.
pub fn transfers_of<'a>(
    transfers: &'a [Arc<VolumeTransfer>],
    namespace: &str,
    pod_name: &str,
) -> Vec<&'a Arc<VolumeTransfer>> {
    transfers
        .iter()
        .filter(|transfer| {
            transfer.spec.stage_pod == pod_name
                && transfer.namespace().as_deref() == Some(namespace)
        })
        .collect()
}

/// `namespace/name` of a transfer.
pub fn transfer_name_of(transfer: &VolumeTransfer) -> ObjectName {
    ObjectName::new(
        transfer.namespace().unwrap_or_default(),
        transfer.name_any(),
    )
}

/// The status of a transfer failed by its stage pod's verdict.
pub fn failed_transfer_status(
    transfer: &VolumeTransfer,
    message: &str,
    now: &Time,
) -> VolumeTransferStatus {
    VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::Failed),
        message: Some(bounded_message(message)),
        completion_time: Some(now.clone()),
        conditions: vec![Condition::new(
            condition_type::FAILED,
            ConditionStatus::True,
            reason::STAGE_POD_FAILED,
            message,
            transfer.metadata.generation,
            now.clone(),
        )],
        ..VolumeTransferStatus::default()
    }
}

/// Supervise a backup's or restore's stage pods ([`verdict`]): recreate
/// a failed one after its backoff, fail the open volumes of one that
/// cannot work, and stop a pod whose volumes are all final but which did
/// not finish (so a crash-looping agent stops). Returns the actions and
/// when to look again, if a backoff is running.
pub fn supervise_stage_pods(
    pods: &[Arc<Pod>],
    transfers: &[Arc<VolumeTransfer>],
    deleted_pods: &BTreeSet<String>,
    watch: AgentWatch<'_>,
    now: &Time,
) -> (Vec<Action>, Option<Duration>) {
    let mut actions = Vec::new();
    let mut next_look: Option<Duration> = None;
    let time = now.0.as_second();
    for pod in pods {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_name = pod.name_any();
        let of_pod = transfers_of(transfers, &namespace, &pod_name);
        let open: Vec<&Arc<VolumeTransfer>> = of_pod
            .iter()
            .copied()
            .filter(|transfer| !transfer.phase().is_final())
            .collect();
        let finished = pod
            .status
            .as_ref()
            .and_then(|status| status.phase.as_deref())
            == Some("Succeeded");
        // A pod on its way out was judged already (by this replica, even if
        // the cache does not show its deletion yet: the audit log of
        // `controller::restore` once saw a finished pod deleted twice, 73 ms
        // apart); its replacement is judged once it exists.
        let pod_uid = pod.uid().unwrap_or_default();
        let on_its_way_out = pod.metadata.deletion_timestamp.is_some()
            || (!pod_uid.is_empty() && deleted_pods.contains(&pod_uid));
        if open.is_empty() {
            if !of_pod.is_empty() && !finished && !on_its_way_out {
                actions.push(Action::DeletePod {
                    pod: ObjectName::new(&namespace, &pod_name),
                    uid: (!pod_uid.is_empty()).then(|| pod_uid.clone()),
                    replaced: false,
                });
            }
            continue;
        }
        if on_its_way_out {
            continue;
        }
        let attempts = of_pod
            .iter()
            .filter_map(|transfer| transfer.status.as_ref().and_then(|status| status.attempts))
            .max()
            .unwrap_or(0);
        let heartbeats: Vec<i64> = open
            .iter()
            .filter(|transfer| transfer.phase() == VolumeTransferPhase::InProgress)
            .filter_map(|transfer| {
                let agent = transfer.status.as_ref()?.agent.as_ref()?;
                Some(agent.heartbeat_time.0.as_second())
            })
            .collect();
        let last_moved = open
            .iter()
            .filter_map(|transfer| {
                let agent = transfer.status.as_ref()?.agent.as_ref()?;
                Some(agent.progress_time.as_ref()?.0.as_second())
            })
            .max();
        let verdict = match verdict(pod, attempts, last_moved, time) {
            Verdict::Healthy => {
                lost_agent(pod, &heartbeats, attempts, time, watch).unwrap_or(Verdict::Healthy)
            }
            other => other,
        };
        match verdict {
            Verdict::Healthy => {}
            Verdict::Fail { message } => {
                actions.push(Action::Emit(Event::warning(
                    reason::STAGE_POD_FAILED,
                    "SuperviseStagePod",
                    &message,
                )));
                for transfer in open {
                    actions.push(Action::WriteTransferStatus {
                        transfer: transfer_name_of(transfer),
                        status: Box::new(failed_transfer_status(transfer, &message, now)),
                    });
                }
            }
            Verdict::Recreate {
                attempt,
                after_seconds,
                message,
            } => {
                if after_seconds > 0 {
                    let wait = Duration::from_secs(after_seconds.unsigned_abs());
                    next_look = Some(next_look.map_or(wait, |other| other.min(wait)));
                    continue;
                }
                actions.push(Action::Emit(Event::warning(
                    "StagePodRecreated",
                    "SuperviseStagePod",
                    format!(
                        "{message}; creating it again (attempt {attempt} of {})",
                        MAX_POD_ATTEMPTS
                    ),
                )));
                for transfer in &of_pod {
                    actions.push(Action::RecordAttempts {
                        transfer: transfer_name_of(transfer),
                        attempts: attempt - 1,
                    });
                }
                actions.push(Action::DeletePod {
                    pod: ObjectName::new(&namespace, &pod_name),
                    uid: Some(pod_uid),
                    replaced: true,
                });
            }
        }
    }
    (actions, next_look)
}

/// What a status says about stage pods the API server refused:
/// `(pod, answer)` each. The message names each pod and the answer, and
/// what to do when it is Pod Security (run non-root).
pub fn refused_stage_pods_message(refused: &[(String, String)]) -> String {
    let mut message = refused
        .iter()
        .map(|(pod, answer)| format!("stage pod {pod} refused by the API server: {answer}"))
        .collect::<Vec<_>>()
        .join("; ");
    if refused
        .iter()
        .any(|(_, answer)| answer.contains("PodSecurity"))
    {
        message.push_str(
            "; the namespace's Pod Security level forbids the root agent: set spec.agentUser to a non-root uid that can read the claims (docs/controller.md, \"Running as non-root\")",
        );
    }
    message
}

/// What a status says when the API server refused stage pods (Pod
/// Security, a quota): its `StagePodsCreated` condition `False` and its
/// message naming each pod and the answer (with `spec.agentUser` as the
/// way out of Pod Security), and the Warning Event to record. The same for
/// backups and restores; the next reconcile tries the pods again.
pub fn note_refused_stage_pods(
    conditions: &mut Vec<Condition>,
    message: &mut Option<String>,
    refused: &[(String, String)],
    generation: Option<i64>,
    now: &Time,
) -> Event {
    note_stage_pods(conditions, refused, false, generation, now);
    let text = refused_stage_pods_message(refused);
    *message = Some(bounded_message(&text));
    Event::warning(reason::STAGE_POD_REFUSED, "CreateStagePod", text)
}

/// `conditions` with `StagePodsCreated` set: `False` with the refusals
/// when there are any, else `True` once a `False` one is stale (every
/// stage pod of the plan exists); left alone otherwise.
pub fn note_stage_pods(
    conditions: &mut Vec<Condition>,
    refused: &[(String, String)],
    all_exist: bool,
    generation: Option<i64>,
    now: &Time,
) -> bool {
    let current =
        haulage_api::condition::find_condition(conditions, condition_type::STAGE_PODS_CREATED)
            .map(|condition| condition.status);
    let next = if !refused.is_empty() {
        Some((
            ConditionStatus::False,
            reason::STAGE_POD_REFUSED,
            refused_stage_pods_message(refused),
        ))
    } else if all_exist && current == Some(ConditionStatus::False) {
        Some((
            ConditionStatus::True,
            reason::STAGE_PODS_EXIST,
            "every stage pod of the plan exists".to_string(),
        ))
    } else {
        None
    };
    match next {
        Some((state, why, message)) => haulage_api::condition::set_condition(
            conditions,
            Condition::new(
                condition_type::STAGE_PODS_CREATED,
                state,
                why,
                &message,
                generation,
                now.clone(),
            ),
            now.clone(),
        ),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default interval, the API server answering since long before.
    const WATCH: AgentWatch<'static> = AgentWatch {
        lost_after_seconds: 300,
        api_outages: &[],
    };

    const T0: i64 = 1_800_000_000;

    fn at(seconds: i64) -> String {
        k8s_openapi::jiff::Timestamp::from_second(T0 + seconds)
            .expect("valid")
            .to_string()
    }

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "stage-a", "creationTimestamp": at(0)},
            "status": status,
        }))
        .expect("valid pod")
    }

    fn container(
        state: serde_json::Value,
        last: serde_json::Value,
        restarts: i32,
    ) -> serde_json::Value {
        serde_json::json!({
            "name": "agent", "image": "ghcr.io/haulage-dev/mover-agent:0.1.0", "imageID": "",
            "ready": false, "restartCount": restarts, "state": state, "lastState": last,
        })
    }

    #[test]
    fn no_agent_is_lost_while_the_api_server_does_not_answer_and_each_gets_the_interval_after() {
        let running = pod(serde_json::json!({"phase": "Running"}));
        // The last heartbeat at T0; the API server away from T0 + 5 to
        // T0 + 600 (longer than the interval): the agents could not report.
        let ongoing = [ApiOutage {
            from: T0 + 5,
            to: None,
        }];
        let away = AgentWatch {
            api_outages: &ongoing,
            ..WATCH
        };
        assert_eq!(lost_agent(&running, &[T0], 0, T0 + 600, away), None);
        let ended = [ApiOutage {
            from: T0 + 5,
            to: Some(T0 + 600),
        }];
        let back = AgentWatch {
            api_outages: &ended,
            ..WATCH
        };
        // 5 s before, and after the 30 s the watches take to catch up.
        assert_eq!(lost_agent(&running, &[T0], 0, T0 + 925, back), None);
        let Some(Verdict::Recreate { message, .. }) =
            lost_agent(&running, &[T0], 0, T0 + 926, back)
        else {
            panic!("an agent still silent the whole interval after the server came back is lost");
        };
        assert!(
            message
                .contains("has not reported for 926s, 301s of them while the API server answered"),
            "{message}"
        );
    }

    #[test]
    fn an_api_server_failing_now_and_then_does_not_keep_a_hung_agent_from_being_lost() {
        let running = pod(serde_json::json!({"phase": "Running"}));
        // A look failing every 100 s, answered 10 s later: each takes 40 s
        // (with the catch-up) off the silence, not the whole interval.
        let flapping: Vec<ApiOutage> = (1..=20)
            .map(|n| ApiOutage {
                from: T0 + n * 100,
                to: Some(T0 + n * 100 + 10),
            })
            .collect();
        let watch = AgentWatch {
            api_outages: &flapping,
            ..WATCH
        };
        // By T0 + 560: 5 outages, 200 s away, 360 s counted.
        assert!(lost_agent(&running, &[T0], 0, T0 + 560, watch).is_some());
        // By T0 + 440: 4 outages, 160 s away, 280 s counted.
        assert_eq!(lost_agent(&running, &[T0], 0, T0 + 440, watch), None);
    }

    #[test]
    fn a_replica_just_started_gives_each_agent_the_interval_from_its_first_answer() {
        let running = pod(serde_json::json!({"phase": "Running"}));
        // Started at T0 + 1000, its first look answered: whether the
        // agents could report before, it cannot tell.
        let started = [ApiOutage {
            from: i64::MIN,
            to: Some(T0 + 1000),
        }];
        let watch = AgentWatch {
            api_outages: &started,
            ..WATCH
        };
        assert_eq!(lost_agent(&running, &[T0], 0, T0 + 1330, watch), None);
        assert!(lost_agent(&running, &[T0], 0, T0 + 1331, watch).is_some());
    }

    #[test]
    fn a_silent_agent_is_recreated_then_given_up_on() {
        let running = pod(serde_json::json!({"phase": "Running"}));
        assert_eq!(lost_agent(&running, &[T0], 0, T0 + 300, WATCH), None);
        assert_eq!(
            lost_agent(&running, &[], 0, T0 + 3000, WATCH),
            None,
            "nothing runs"
        );
        let Some(Verdict::Recreate {
            attempt: 2,
            after_seconds: 0,
            message,
        }) = lost_agent(&running, &[T0 - 50, T0], 0, T0 + 301, WATCH)
        else {
            panic!("recreated");
        };
        assert!(message.contains("has not reported for 301s"), "{message}");
        assert!(matches!(
            lost_agent(&running, &[T0], 2, T0 + 301, WATCH),
            Some(Verdict::Fail { .. })
        ));
        let pending = pod(serde_json::json!({"phase": "Pending"}));
        assert_eq!(lost_agent(&pending, &[T0], 0, T0 + 3000, WATCH), None);
        // A pod created after the last heartbeat gets the whole interval.
        let recreated = pod(serde_json::json!({"phase": "Running", "startTime": at(1000)}));
        assert_eq!(lost_agent(&recreated, &[T0], 1, T0 + 1200, WATCH), None);
        // Counted from when its agent container started running, not from
        // the pod's start: an image pull (or the old process taking long to
        // stop) is not the agent's silence. A restarted container likewise.
        let pulled_long = pod(
            serde_json::json!({"phase": "Running", "startTime": at(1000),
            "containerStatuses": [container(
                serde_json::json!({"running": {"startedAt": at(1500)}}), serde_json::json!({}), 0)]}),
        );
        assert_eq!(lost_agent(&pulled_long, &[T0], 1, T0 + 1700, WATCH), None);
        assert!(lost_agent(&pulled_long, &[T0], 1, T0 + 1801, WATCH).is_some());
        let restarted = pod(serde_json::json!({"phase": "Running", "startTime": at(0),
            "containerStatuses": [container(
                serde_json::json!({"running": {"startedAt": at(2000)}}), serde_json::json!({}), 1)]}));
        assert_eq!(
            lost_agent(&restarted, &[T0 + 100], 0, T0 + 2200, WATCH),
            None
        );
        let mut deleting = running.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(T0 + 10).expect("valid"),
            ));
        assert_eq!(
            lost_agent(&deleting, &[T0], 0, T0 + 3000, WATCH),
            None,
            "being deleted"
        );
    }

    #[test]
    fn a_running_or_finished_pod_is_healthy() {
        let running = pod(
            serde_json::json!({"phase": "Running", "containerStatuses": [
            container(serde_json::json!({"running": {"startedAt": at(1)}}), serde_json::json!({}), 2)]}),
        );
        assert_eq!(verdict(&running, 0, None, T0 + 1000), Verdict::Healthy);
        let done = pod(serde_json::json!({"phase": "Succeeded"}));
        assert_eq!(verdict(&done, 0, None, T0 + 1000), Verdict::Healthy);
    }

    #[test]
    fn a_crash_looping_agent_fails_with_its_last_exit_reason_and_log_line() {
        let looping = pod(
            serde_json::json!({"phase": "Running", "containerStatuses": [container(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            serde_json::json!({"terminated": {"exitCode": 137, "reason": "OOMKilled",
                "message": "reading /data/db\nerror: out of memory\n"}}),
            5)]}),
        );
        assert_eq!(
            verdict(&looping, 0, None, T0 + 60),
            Verdict::Fail {
                message: format!(
                    "the agent in stage pod stage-a crashed 5 times; last: exit code 137 (OOMKilled): error: out of memory{OUT_OF_MEMORY_ADVICE}"
                )
            }
        );
        // Another reason, no advice about memory.
        let failing = pod(
            serde_json::json!({"phase": "Running", "containerStatuses": [container(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            serde_json::json!({"terminated": {"exitCode": 1,
                "message": "error: cannot reach the Kubernetes API\n"}}),
            5)]}),
        );
        assert_eq!(
            verdict(&failing, 0, None, T0 + 60),
            Verdict::Fail {
                message: "the agent in stage pod stage-a crashed 5 times; last: exit code 1: error: cannot reach the Kubernetes API".to_string()
            }
        );
        let fewer = pod(
            serde_json::json!({"phase": "Running", "containerStatuses": [container(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            serde_json::json!({"terminated": {"exitCode": 1}}), 4)]}),
        );
        assert_eq!(verdict(&fewer, 0, None, T0 + 60), Verdict::Healthy);
    }

    #[test]
    fn an_agent_whose_crashes_only_slow_it_down_is_not_a_crash_loop() {
        // Killed 30 times (the OOM killer, a node under pressure), its
        // latest crash at 1000 s.
        let crashed = |state: serde_json::Value| {
            pod(
                serde_json::json!({"phase": "Running", "containerStatuses": [container(
                state,
                serde_json::json!({"terminated": {"exitCode": 137, "reason": "OOMKilled",
                    "finishedAt": at(1000)}}),
                30)]}),
            )
        };
        let waiting = crashed(serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}));
        assert_eq!(
            verdict(&waiting, 0, Some(T0 + 990), T0 + 1010),
            Verdict::Healthy,
            "it moved its volume forward 10 s before the crash"
        );
        assert_eq!(
            verdict(
                &waiting,
                0,
                Some(T0 + 1000 - CRASH_LOOP_WINDOW_SECONDS),
                T0 + 1010
            ),
            Verdict::Healthy,
            "just within the window"
        );
        for last_moved in [None, Some(T0 + 999 - CRASH_LOOP_WINDOW_SECONDS)] {
            let Verdict::Fail { message } = verdict(&waiting, 0, last_moved, T0 + 1010) else {
                panic!("no progress for longer than the window before its crash: a loop");
            };
            assert!(message.contains("crashed 30 times"), "{message}");
        }
        // Up again: a crash loop until it has run for the window.
        let running = crashed(serde_json::json!({"running": {"startedAt": at(1010)}}));
        assert!(matches!(
            verdict(&running, 0, None, T0 + 1100),
            Verdict::Fail { .. }
        ));
        assert_eq!(
            verdict(&running, 0, None, T0 + 1010 + CRASH_LOOP_WINDOW_SECONDS),
            Verdict::Healthy
        );
        // Its latest run lasted the window before it crashed (re-reading a
        // large volume below its earlier high-water mark, so `last_moved`
        // is old): not a loop. One second shorter, and it is.
        let long_run = |started: i64| {
            pod(
                serde_json::json!({"phase": "Running", "containerStatuses": [container(
                serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
                serde_json::json!({"terminated": {"exitCode": 137, "reason": "OOMKilled",
                    "startedAt": at(started), "finishedAt": at(1000)}}),
                30)]}),
            )
        };
        assert_eq!(
            verdict(
                &long_run(1000 - CRASH_LOOP_WINDOW_SECONDS),
                0,
                None,
                T0 + 1010
            ),
            Verdict::Healthy
        );
        assert!(matches!(
            verdict(
                &long_run(1001 - CRASH_LOOP_WINDOW_SECONDS),
                0,
                None,
                T0 + 1010
            ),
            Verdict::Fail { .. }
        ));
    }

    #[test]
    fn an_agent_waiting_to_be_restarted_after_a_crash_is_not_lost() {
        // The kubelet's restart backoff reaches 5 minutes, as long as
        // `--agent-lost-seconds` by default: the agent is stopped, not
        // silent, and the crash-loop rule judges it.
        let waiting = pod(serde_json::json!({"phase": "Running", "startTime": at(0),
            "containerStatuses": [container(
                serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
                serde_json::json!({"terminated": {"exitCode": 137, "finishedAt": at(700)}}), 7)]}));
        assert_eq!(lost_agent(&waiting, &[T0 + 690], 0, T0 + 1100, WATCH), None);
        let running_again = pod(serde_json::json!({"phase": "Running", "startTime": at(0),
            "containerStatuses": [container(
                serde_json::json!({"running": {"startedAt": at(1000)}}),
                serde_json::json!({"terminated": {"exitCode": 137, "finishedAt": at(700)}}), 7)]}));
        assert!(
            lost_agent(&running_again, &[T0 + 690], 0, T0 + 1301, WATCH).is_some(),
            "silent for longer than the interval once it runs again"
        );
    }

    #[test]
    fn a_failed_pod_is_recreated_after_a_doubling_backoff_then_fails_for_good() {
        let failed = pod(serde_json::json!({"phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory.",
            "containerStatuses": [container(
                serde_json::json!({"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": at(100)}}),
                serde_json::json!({}), 0)]}));
        assert_eq!(
            verdict(&failed, 0, None, T0 + 100),
            Verdict::Recreate {
                attempt: 2,
                after_seconds: 10,
                message: "stage pod stage-a failed: exit code 137 (Error)".to_string()
            }
        );
        assert!(matches!(
            verdict(&failed, 1, None, T0 + 100),
            Verdict::Recreate {
                attempt: 3,
                after_seconds: 20,
                ..
            }
        ));
        assert!(matches!(
            verdict(&failed, 1, None, T0 + 500),
            Verdict::Recreate {
                after_seconds: 0,
                ..
            }
        ));
        let Verdict::Fail { message } = verdict(&failed, 2, None, T0 + 500) else {
            panic!("the third failure is final");
        };
        assert!(
            message.starts_with("stage pod stage-a failed 3 times"),
            "{message}"
        );
        let evicted = pod(serde_json::json!({"phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory."}));
        assert!(matches!(
            verdict(&evicted, 0, None, T0),
            Verdict::Recreate { message, .. } if message.ends_with("The node was low on resource: memory.")
        ));
    }

    #[test]
    fn a_pod_that_cannot_start_fails_after_the_timeout_and_an_invalid_image_at_once() {
        let pulling = pod(
            serde_json::json!({"phase": "Pending", "containerStatuses": [container(
            serde_json::json!({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}),
            serde_json::json!({}), 0)]}),
        );
        assert_eq!(verdict(&pulling, 0, None, T0 + 60), Verdict::Healthy);
        let Verdict::Fail { message } =
            verdict(&pulling, 0, None, T0 + PENDING_TIMEOUT_SECONDS + 1)
        else {
            panic!("pulling for too long fails");
        };
        assert!(
            message.contains("cannot be pulled (ImagePullBackOff: Back-off pulling image)"),
            "{message}"
        );
        let invalid = pod(
            serde_json::json!({"phase": "Pending", "containerStatuses": [container(
            serde_json::json!({"waiting": {"reason": "InvalidImageName"}}), serde_json::json!({}), 0)]}),
        );
        assert!(matches!(
            verdict(&invalid, 0, None, T0 + 1),
            Verdict::Fail { .. }
        ));
        let unschedulable = pod(serde_json::json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 1 node(s) had untolerated taint"}]}));
        assert_eq!(verdict(&unschedulable, 0, None, T0 + 10), Verdict::Healthy);
        let Verdict::Fail { message } = verdict(&unschedulable, 0, None, T0 + 301) else {
            panic!("unschedulable for too long fails");
        };
        assert!(
            message.contains("1 node(s) had untolerated taint"),
            "{message}"
        );
    }

    #[test]
    fn a_refused_stage_pod_is_named_with_the_answer_and_cleared_once_every_pod_exists() {
        let now = Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).expect("valid"));
        let mut conditions = Vec::new();
        let refused = vec![(
            "shop/haulage-backup-x".to_string(),
            "pods is forbidden: violates PodSecurity \"restricted:latest\"".to_string(),
        )];
        assert!(note_stage_pods(
            &mut conditions,
            &refused,
            false,
            Some(1),
            &now
        ));
        let condition = &conditions[0];
        assert_eq!(condition.status, ConditionStatus::False);
        assert!(condition.message.contains("shop/haulage-backup-x"));
        assert!(
            condition.message.contains("spec.agentUser"),
            "{}",
            condition.message
        );
        assert!(
            !note_stage_pods(&mut conditions, &[], false, Some(1), &now),
            "kept while pods are missing"
        );
        assert!(note_stage_pods(&mut conditions, &[], true, Some(1), &now));
        assert_eq!(conditions[0].status, ConditionStatus::True);
        let mut untouched = Vec::new();
        assert!(!note_stage_pods(&mut untouched, &[], true, Some(1), &now));
        assert!(untouched.is_empty(), "no condition until a refusal happens");
    }

    #[test]
    fn refused_stage_pods_go_into_the_condition_the_message_and_a_warning_event() {
        let now = Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).expect("valid"));
        let mut conditions = Vec::new();
        let mut message = None;
        let refused = vec![(
            "shop/haulage-restore-x".to_string(),
            "exceeded quota: pods=10".to_string(),
        )];
        let event = note_refused_stage_pods(&mut conditions, &mut message, &refused, Some(2), &now);
        assert_eq!(conditions[0].status, ConditionStatus::False);
        let message = message.expect("the status message");
        assert!(
            message.contains(
                "stage pod shop/haulage-restore-x refused by the API server: exceeded quota"
            ),
            "{message}"
        );
        assert!(
            !message.contains("agentUser"),
            "not a Pod Security refusal: {message}"
        );
        assert_eq!(event.kind, crate::action::EventKind::Warning);
        assert_eq!(event.reason, reason::STAGE_POD_REFUSED);
        assert_eq!(event.note, message);
    }
}
