//! The controller's HTTP endpoints, on one listener (`--health-address`):
//! `/healthz` (the process answers), `/readyz` (every cache synced and the
//! API server answered recently; never a storage location) and `/metrics`
//! (the Prometheus series of [`super::metrics`]).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::metrics::ControllerMetrics;
use crate::metrics::Response;
use crate::reconcile::supervision::ApiOutage;

/// Seconds between two looks at the API server's `/version`.
pub const API_CHECK_INTERVAL_SECONDS: u64 = 10;
/// Seconds a look at `/version` may take before it counts as failed.
pub const API_CHECK_TIMEOUT_SECONDS: u64 = 5;

/// What `/readyz` reports on, and which caches have synced.
///
/// Code that needs a synced cache waits here ([`Readiness::wait_for_cache`]),
/// never on kube-runtime's `Store::wait_until_ready`: that one wakes only
/// the last of several tasks waiting at once (its `DelayedInit` keeps one
/// waker), and each kube-runtime `Controller` already waits on its own
/// store, so a second waiter could leave that controller, or this one,
/// asleep for good. Seen here as a replica that never became ready and
/// never reconciled (CI, 2026-11-29).
#[derive(Debug)]
pub struct Readiness {
    /// The caches whose first list has not finished yet, by kind.
    unsynced_caches: watch::Sender<BTreeSet<&'static str>>,
    /// `None` while the API server answers, else what the last look got.
    api_problem: Mutex<Option<String>>,
    /// The API server's outages as this replica saw them, oldest first
    /// (the last [`OUTAGES_KEPT`]), and its last answer.
    api_outages: Mutex<(Vec<ApiOutage>, Option<i64>)>,
}

/// Outages of the API server kept for judging agents' silence: more than
/// fit in any `--agent-lost-seconds` of looks every 10 s that fail now and
/// then.
const OUTAGES_KEPT: usize = 256;

impl Readiness {
    /// Not ready until each of `caches` has synced and the API server has
    /// answered once. A kind not listed here counts as synced.
    pub fn new(caches: impl IntoIterator<Item = &'static str>) -> Self {
        Readiness {
            unsynced_caches: watch::Sender::new(caches.into_iter().collect()),
            api_problem: Mutex::new(Some("no answer yet (first check pending)".to_string())),
            // Until its first answer: what happened before the start, this
            // replica cannot tell.
            api_outages: Mutex::new((
                vec![ApiOutage {
                    from: i64::MIN,
                    to: None,
                }],
                None,
            )),
        }
    }

    /// The cache of `kind` has finished its first list.
    pub fn set_cache_synced(&self, kind: &'static str) {
        self.unsynced_caches
            .send_if_modified(|unsynced| unsynced.remove(kind));
    }

    /// Whether every cache has finished its first list (without waiting:
    /// a reconcile that waited would hold a slot of its controller, which
    /// then stops taking the shared caches' events, which holds up the
    /// caches it waits for).
    pub fn caches_synced(&self) -> bool {
        self.unsynced_caches.borrow().is_empty()
    }

    /// Wait until the cache of `kind` has finished its first list (at once
    /// when it has); any number of tasks may wait.
    pub async fn wait_for_cache(&self, kind: &'static str) {
        let mut synced = self.unsynced_caches.subscribe();
        // The sender lives as long as `self`: this only ends when synced.
        let _ = synced.wait_for(|unsynced| !unsynced.contains(kind)).await;
    }

    /// The last look at the API server: `None` when it answered, else why
    /// not.
    pub fn set_api_problem(&self, problem: Option<String>) {
        let now = crate::clock::timestamp().as_second();
        let mut guard = lock(&self.api_outages);
        let (outages, last_answer) = &mut *guard;
        let ongoing = outages.last_mut().filter(|outage| outage.to.is_none());
        match (&problem, ongoing) {
            (None, Some(outage)) => outage.to = Some(now),
            (Some(_), None) => {
                outages.push(ApiOutage {
                    from: last_answer.unwrap_or(now),
                    to: None,
                });
                if outages.len() > OUTAGES_KEPT {
                    outages.remove(0);
                }
            }
            _ => {}
        }
        if problem.is_none() {
            *last_answer = Some(now);
        }
        drop(guard);
        *lock(&self.api_problem) = problem;
    }

    /// The API server's outages as this replica saw them (the time before
    /// its first answer included): what the agents wrote meanwhile could
    /// not reach it.
    pub fn api_outages(&self) -> Vec<ApiOutage> {
        lock(&self.api_outages).0.clone()
    }

    /// `None` when ready, else why not: the API server's problem first
    /// (when it is down, every cache waits on it), then the caches still
    /// listing (a cache that never syncs is a watch that keeps failing:
    /// the controller's warnings name its error).
    pub fn problem(&self) -> Option<String> {
        let mut problems = String::new();
        if let Some(problem) = lock(&self.api_problem).as_ref() {
            problems.push_str(&format!("API server not reachable: {problem}\n"));
        }
        let unsynced: Vec<&str> = self.unsynced_caches.borrow().iter().copied().collect();
        if !unsynced.is_empty() {
            problems.push_str(&format!("caches not synced: {}\n", unsynced.join(", ")));
        }
        (!problems.is_empty()).then_some(problems)
    }
}

/// The guarded value, also after a panic elsewhere (it is only read and
/// replaced whole).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The answer for `path`.
pub fn respond(path: &str, readiness: &Readiness, metrics: &ControllerMetrics) -> Response {
    match path {
        "/healthz" | "/livez" => Response::text("200 OK", "ok\n"),
        "/readyz" => match readiness.problem() {
            None => Response::text("200 OK", "ok\n"),
            Some(problem) => Response::text("503 Service Unavailable", problem),
        },
        "/metrics" => metrics.encode(),
        _ => Response::not_found(),
    }
}

/// Serve the endpoints until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    readiness: Arc<Readiness>,
    metrics: Arc<ControllerMetrics>,
    shutdown: CancellationToken,
) {
    crate::metrics::serve(
        listener,
        move |path: &str| respond(path, &readiness, &metrics),
        shutdown,
    )
    .await;
}

/// Ask the API server for `/version` every [`API_CHECK_INTERVAL_SECONDS`]
/// (bounded by [`API_CHECK_TIMEOUT_SECONDS`]) and record whether it
/// answered, until `shutdown`. Cheap: the answer is a few hundred bytes and
/// every authenticated client may read it.
pub async fn watch_api_server(
    client: kube::Client,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(API_CHECK_INTERVAL_SECONDS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_reachable = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let answer = tokio::time::timeout(
            Duration::from_secs(API_CHECK_TIMEOUT_SECONDS),
            client.apiserver_version(),
        )
        .await;
        let problem = match answer {
            Ok(Ok(_)) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!(
                "no answer to /version within {API_CHECK_TIMEOUT_SECONDS}s"
            )),
        };
        let reachable = problem.is_none();
        if was_reachable != Some(reachable) {
            match &problem {
                None => info!("API server reachable"),
                Some(problem) => warn!(%problem, "API server not reachable; not ready"),
            }
        }
        was_reachable = Some(reachable);
        readiness.set_api_problem(problem);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_run_from_the_last_answer_to_the_next_and_the_start_counts_as_one() {
        let readiness = Readiness::new([]);
        let outages = readiness.api_outages();
        assert_eq!(outages.len(), 1);
        assert_eq!((outages[0].from, outages[0].to), (i64::MIN, None));
        readiness.set_api_problem(None);
        let first_answer = readiness.api_outages()[0].to.expect("ended by the answer");
        readiness.set_api_problem(None);
        assert_eq!(readiness.api_outages().len(), 1, "answers are no outage");
        readiness.set_api_problem(Some("connection refused".into()));
        readiness.set_api_problem(Some("connection refused".into()));
        let outages = readiness.api_outages();
        assert_eq!(outages.len(), 2, "one outage however many looks fail");
        assert!(outages[1].from >= first_answer && outages[1].to.is_none());
        readiness.set_api_problem(None);
        assert!(readiness.api_outages()[1].to.is_some());
    }

    #[tokio::test]
    async fn every_task_waiting_for_a_cache_wakes_when_it_syncs() {
        let readiness = Arc::new(Readiness::new(["leases", "pods"]));
        readiness.set_api_problem(None);
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let readiness = readiness.clone();
                tokio::spawn(async move { readiness.wait_for_cache("leases").await })
            })
            .collect();
        tokio::task::yield_now().await;
        readiness.set_cache_synced("leases");
        for waiter in waiters {
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("every waiter wakes")
                .expect("the waiter did not panic");
        }
        // A cache that synced before anyone waited: no wait at all.
        tokio::time::timeout(Duration::from_secs(5), readiness.wait_for_cache("leases"))
            .await
            .expect("already synced");
        assert_eq!(
            readiness.problem().as_deref(),
            Some("caches not synced: pods\n")
        );
        assert!(!readiness.caches_synced());
        readiness.set_cache_synced("pods");
        assert!(readiness.caches_synced());
    }

    #[test]
    fn readiness_needs_synced_caches_and_a_reachable_api_server() {
        let readiness = Readiness::new(["pods", "volumebackups"]);
        let metrics = ControllerMetrics::new(None);
        let answer = respond("/readyz", &readiness, &metrics);
        assert_eq!(answer.status, "503 Service Unavailable");
        assert_eq!(
            answer.body,
            "API server not reachable: no answer yet (first check pending)\ncaches not synced: pods, volumebackups\n"
        );
        readiness.set_api_problem(None);
        readiness.set_cache_synced("pods");
        assert_eq!(
            respond("/readyz", &readiness, &metrics).body,
            "caches not synced: volumebackups\n"
        );
        readiness.set_cache_synced("volumebackups");
        assert_eq!(respond("/readyz", &readiness, &metrics).status, "200 OK");
        readiness.set_api_problem(Some("connection refused".to_string()));
        let answer = respond("/readyz", &readiness, &metrics);
        assert_eq!(answer.status, "503 Service Unavailable");
        assert_eq!(
            answer.body,
            "API server not reachable: connection refused\n"
        );
        assert_eq!(respond("/healthz", &readiness, &metrics).status, "200 OK");
        assert_eq!(
            respond("/metrics", &readiness, &metrics).content_type,
            crate::metrics::METRICS_CONTENT_TYPE
        );
        assert_eq!(
            respond("/other", &readiness, &metrics).status,
            "404 Not Found"
        );
    }
}
