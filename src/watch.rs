//! The one backoff of a failing Kubernetes watch, shared by the
//! controller's caches and the mover agent's watch of its transfer.

use std::time::Duration;

use futures::StreamExt;
use kube::runtime::watcher;

/// First wait of a failing watch; it doubles with each failure.
const WATCH_BACKOFF_FIRST: Duration = Duration::from_millis(800);
/// Longest wait of a failing watch.
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A watcher's `events`, backing off while they fail: 800 ms doubling to
/// 30 s (each wait jittered between half and all of it), back to 800 ms as
/// soon as the watch yields an object or completes a list, and only the
/// first wait after a 410 (the server answered: the cure is the new list
/// the watcher makes next). Not reset by `Event::Init`: the watcher yields
/// it before each list it tries, so a list failing again and again (the
/// API server down, the RBAC refusing it) would otherwise be retried every
/// 0.4–0.8 s for ever.
///
/// kube-runtime's default backoff waits its full delay after a 410 too and
/// keeps it for two minutes after the last error, so after an API server
/// outage each cache came back only after two 30 s waits, one to reconnect
/// and one after the 410 the restarted server answers the old watch with
/// (60 s in `controller::outages`, its status writes refused as stale
/// meanwhile).
pub fn backing_off<S, K>(
    events: S,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>
where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut delay = WATCH_BACKOFF_FIRST;
    events.then(move |event| {
        let wait = match &event {
            Ok(watcher::Event::Init) => Duration::ZERO,
            Ok(_) => {
                delay = WATCH_BACKOFF_FIRST;
                Duration::ZERO
            }
            Err(error) if error_code(error) == Some(410) => WATCH_BACKOFF_FIRST,
            Err(_) => {
                let wait = delay;
                delay = (delay * 2).min(WATCH_BACKOFF_MAX);
                wait
            }
        };
        let wait = wait.mul_f64(rand::random_range(0.5..=1.0));
        async move {
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            event
        }
    })
}

/// The API server's status code in a watch error, when it answered.
pub fn error_code(error: &watcher::Error) -> Option<u16> {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_failing_watch_backs_off_doubling_and_lists_again_soon_after_a_410() {
        let gone: kube::core::Status = serde_json::from_value(serde_json::json!({
            "status": "Failure", "code": 410, "reason": "Expired",
            "message": "too old resource version"}))
        .expect("a status");
        // Each list the watcher tries starts with `Init`: a list failing
        // again and again is Init, error, Init, error...
        let failed_list = || {
            [
                Ok(watcher::Event::Init),
                Err(watcher::Error::NoResourceVersion),
            ]
        };
        let mut events: Vec<Result<watcher::Event<()>, watcher::Error>> =
            (0..3).flat_map(|_| failed_list()).collect();
        events.push(Err(watcher::Error::WatchError(Box::new(gone))));
        events.extend([Ok(watcher::Event::InitDone), Ok(watcher::Event::Init)]);
        events.push(Err(watcher::Error::NoResourceVersion));
        events.extend((0..8).flat_map(|_| failed_list()));
        let events = backing_off(futures::stream::iter(events));
        let mut events = std::pin::pin!(events);
        // The wait before each error.
        let mut waits = Vec::new();
        let mut last = tokio::time::Instant::now();
        while let Some(event) = events.next().await {
            if event.is_err() {
                waits.push(last.elapsed());
            } else if !matches!(event, Ok(watcher::Event::Init)) {
                assert_eq!(last.elapsed(), Duration::ZERO, "events pass at once");
            }
            last = tokio::time::Instant::now();
        }
        let within = |wait: Duration, ceiling_ms: u64| {
            wait >= Duration::from_millis(ceiling_ms / 2)
                && wait <= Duration::from_millis(ceiling_ms)
        };
        assert!(within(waits[0], 800), "{waits:?}");
        assert!(within(waits[1], 1600), "doubled: {waits:?}");
        assert!(within(waits[2], 3200), "doubled, Init between: {waits:?}");
        assert!(within(waits[3], 800), "a 410 lists again soon: {waits:?}");
        assert!(within(waits[4], 800), "reset by the list: {waits:?}");
        assert!(within(waits[5], 1600), "{waits:?}");
        assert!(within(waits[12], 30_000), "at most 30 s: {waits:?}");
    }
}
