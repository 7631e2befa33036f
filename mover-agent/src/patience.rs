//! How long the agent keeps trying a call to the API server that a
//! transfer cannot go on without: its claim, and its final status.
//!
//! Exiting on a failed call is costly. After a claim, the kubelet's
//! restart backoff (10 s doubling to 5 min) delays the volume long after
//! the server is back. After a volume, its outcome and a whole pass over
//! it are thrown away. So the agent waits instead, while waiting can help:
//! - a server that does not answer, is overloaded or conflicts (transient,
//!   [`AgentError::is_transient`]) is tried again for [`PATIENCE`];
//! - a refusal of who the agent is or what it may do (401, 403,
//!   [`AgentError::is_refused_access`]) is tried again for
//!   [`REFUSAL_PATIENCE`] from the first of the refusals in a row. A
//!   kube-apiserver just restarted answers before its authentication and
//!   RBAC caches are filled, and refuses until they are what it allows
//!   seconds later (kubernetes/kubernetes#121635); a Role the controller
//!   just created reaches the authorizer's cache the same way. A refusal
//!   that lasts is the pod's RBAC to fix: the agent then exits saying so.
//!
//! Tries are 1 s apart, doubling to [`MAX_BACKOFF`]: one request per
//! waiting call every 5 s at most, so an outage brings no retry storm, and
//! a call lands within seconds of the server's return.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::transfers::AgentError;

/// How long a call is tried again while its failures are worth waiting
/// out (the overall limit, refusals included).
pub const PATIENCE: Duration = Duration::from_secs(10 * 60);
/// How long a call is tried again while the API server refuses it (401,
/// 403), counted from the first refusal in a row.
pub const REFUSAL_PATIENCE: Duration = Duration::from_secs(120);
/// First pause between two tries.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest pause between two tries. Short: while the agent waits on its
/// final status it writes no heartbeat, and once the API server is back
/// the controller judges an agent silent for `--agent-lost-seconds` lost,
/// so what it waited to write must land within seconds of the server's
/// return.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Whether a call that failed with `error` is tried again after
/// `backoff`: `elapsed` since its first try, `refused_for` since the
/// first of the refusals in a row (when this failure is one).
pub fn tried_again(
    error: &AgentError,
    elapsed: Duration,
    refused_for: Option<Duration>,
    backoff: Duration,
) -> bool {
    let worth_it = error.is_transient()
        || refused_for.is_some_and(|refused| refused + backoff <= REFUSAL_PATIENCE);
    worth_it && elapsed + backoff <= PATIENCE
}

/// The tries of one call: since when, since when it is refused, and the
/// next pause.
#[derive(Debug)]
pub struct Tries {
    started: Instant,
    first_refusal: Option<Instant>,
    backoff: Duration,
}

impl Tries {
    /// The first try is about to be made.
    pub fn start() -> Self {
        Tries {
            started: Instant::now(),
            first_refusal: None,
            backoff: FIRST_BACKOFF,
        }
    }

    /// After a failed try of `what` on `transfer`: wait for the next try
    /// (saying so in the log, with `kept`: what the agent keeps
    /// meanwhile), or give the error back when trying again cannot help,
    /// or on `cancel` (SIGTERM).
    pub async fn wait_after(
        &mut self,
        error: AgentError,
        transfer: &str,
        kept: &str,
        cancel: &CancellationToken,
    ) -> Result<(), AgentError> {
        self.first_refusal = error
            .is_refused_access()
            .then(|| self.first_refusal.unwrap_or_else(Instant::now));
        let refused_for = self.first_refusal.map(|first| first.elapsed());
        if !tried_again(&error, self.started.elapsed(), refused_for, self.backoff) {
            return Err(error);
        }
        warn!(
            transfer,
            retry_in_seconds = self.backoff.as_secs(),
            "{}; {kept}",
            haulage::error_chain(&error)
        );
        tokio::select! {
            _ = cancel.cancelled() => return Err(error),
            _ = tokio::time::sleep(self.backoff) => {}
        }
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfers::tests::api_error;

    #[test]
    fn a_call_refused_by_a_server_just_back_is_tried_again_for_a_while() {
        let error = |code: u16| api_error("write the final status of", code);
        let second = Duration::from_secs(1);
        let five = Duration::from_secs(5);
        // Refusals are told apart from other answers.
        assert!(error(401).is_refused_access() && error(403).is_refused_access());
        assert!(!error(422).is_refused_access() && !error(503).is_refused_access());
        // After a two-minute outage, the restarted server refuses at first.
        let outage = Duration::from_secs(125);
        for code in [401, 403] {
            assert!(tried_again(
                &error(code),
                outage,
                Some(Duration::ZERO),
                five
            ));
            assert!(tried_again(
                &error(code),
                outage,
                Some(Duration::from_secs(110)),
                five
            ));
            assert!(!tried_again(
                &error(code),
                outage,
                Some(Duration::from_secs(118)),
                five
            ));
        }
        // Other refusals are final at once; unreachable servers are waited
        // for, all within the overall patience.
        assert!(!tried_again(&error(422), outage, None, five));
        assert!(tried_again(&error(503), outage, None, five));
        assert!(!tried_again(&error(503), PATIENCE, None, second));
        assert!(!tried_again(
            &error(403),
            PATIENCE,
            Some(Duration::ZERO),
            second
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn tries_back_off_to_five_seconds_and_give_up_on_a_refusal_that_lasts() {
        let cancel = CancellationToken::new();
        let mut tries = Tries::start();
        let mut pauses = Vec::new();
        loop {
            let before = tokio::time::Instant::now();
            if tries
                .wait_after(api_error("get", 403), "shop/t", "kept", &cancel)
                .await
                .is_err()
            {
                break;
            }
            pauses.push(before.elapsed().as_secs());
        }
        assert_eq!(&pauses[..4], &[1, 2, 4, 5]);
        // Two minutes of refusals at most, 5 s apart once backed off.
        let waited: u64 = pauses.iter().sum();
        assert!((115..=120).contains(&waited), "{pauses:?}");
        // A server that does not answer is waited for longer.
        let mut tries = Tries::start();
        let mut waited = 0;
        while tries
            .wait_after(api_error("get", 503), "shop/t", "kept", &cancel)
            .await
            .is_ok()
        {
            waited += 1;
        }
        assert!(waited > 100, "{waited} tries");
        // SIGTERM ends the wait at once.
        cancel.cancel();
        let mut tries = Tries::start();
        assert!(
            tries
                .wait_after(api_error("get", 503), "shop/t", "kept", &cancel)
                .await
                .is_err()
        );
    }
}
