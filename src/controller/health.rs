//! The controller's HTTP endpoints, on one listener (`--health-address`):
//! `/healthz` (the process answers), `/readyz` (every cache synced and the
//! API server answered recently; never a storage location) and `/metrics`
//! (the Prometheus series of [`super::metrics`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::metrics::ControllerMetrics;
use crate::metrics::Response;

/// Seconds between two looks at the API server's `/version`.
pub const API_CHECK_INTERVAL_SECONDS: u64 = 10;
/// Seconds a look at `/version` may take before it counts as failed.
pub const API_CHECK_TIMEOUT_SECONDS: u64 = 5;

/// What `/readyz` reports on.
#[derive(Debug, Default)]
pub struct Readiness {
    caches_synced: AtomicBool,
    api_reachable: AtomicBool,
}

impl Readiness {
    /// Every shared cache has finished its first list.
    pub fn set_caches_synced(&self) {
        self.caches_synced.store(true, Ordering::SeqCst);
    }

    /// Whether the last look at the API server got an answer.
    pub fn set_api_reachable(&self, reachable: bool) {
        self.api_reachable.store(reachable, Ordering::SeqCst);
    }

    /// `None` when ready, else why not.
    pub fn problem(&self) -> Option<&'static str> {
        match (
            self.caches_synced.load(Ordering::SeqCst),
            self.api_reachable.load(Ordering::SeqCst),
        ) {
            (true, true) => None,
            (false, _) => Some("caches not synced\n"),
            (true, false) => Some("API server not reachable\n"),
        }
    }
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
        let reachable = matches!(answer, Ok(Ok(_)));
        if was_reachable != Some(reachable) {
            match answer {
                Ok(Ok(_)) => info!("API server reachable"),
                Ok(Err(error)) => warn!(%error, "API server not reachable; not ready"),
                Err(_) => warn!(
                    timeout_seconds = API_CHECK_TIMEOUT_SECONDS,
                    "API server did not answer; not ready"
                ),
            }
        }
        was_reachable = Some(reachable);
        readiness.set_api_reachable(reachable);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_needs_synced_caches_and_a_reachable_api_server() {
        let readiness = Readiness::default();
        let metrics = ControllerMetrics::new(None);
        assert_eq!(
            respond("/readyz", &readiness, &metrics).status,
            "503 Service Unavailable"
        );
        readiness.set_api_reachable(true);
        assert_eq!(
            respond("/readyz", &readiness, &metrics).body,
            "caches not synced\n"
        );
        readiness.set_caches_synced();
        assert_eq!(respond("/readyz", &readiness, &metrics).status, "200 OK");
        readiness.set_api_reachable(false);
        let answer = respond("/readyz", &readiness, &metrics);
        assert_eq!(answer.status, "503 Service Unavailable");
        assert_eq!(answer.body, "API server not reachable\n");
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
