//! What the agent writes into a VolumeTransfer's status, computed from the
//! engine's counters: pure functions, so "never backwards" and the final
//! figures are unit tests.

use haulage::api::Progress;
use haulage::engine::progress::ProgressSnapshot;

fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The progress to report now, from the engine's counters, the last
/// report and the seconds since it. Every counter is at least what was
/// reported before (an engine restart after a resume starts its counters
/// from zero; the status must not jump back), the rate is over the last
/// interval and the ETA follows from it.
pub fn next_progress(
    counters: &ProgressSnapshot,
    previous: Option<&Progress>,
    seconds_since_previous: f64,
) -> Progress {
    let previous = previous.cloned().unwrap_or_default();
    let bytes_done = signed(counters.bytes_done).max(previous.bytes_done);
    let total_bytes = signed(counters.total_bytes)
        .max(previous.total_bytes)
        .max(bytes_done);
    let rate = if seconds_since_previous > 0.0 {
        ((bytes_done - previous.bytes_done) as f64 / seconds_since_previous) as i64
    } else {
        previous.bytes_per_second
    };
    let left = total_bytes - bytes_done;
    let eta_seconds = if left == 0 {
        Some(0)
    } else if rate > 0 && counters.totals_known {
        Some(left / rate)
    } else {
        None
    };
    Progress {
        total_bytes,
        bytes_done,
        total_files: signed(counters.total_files).max(previous.total_files),
        files_done: signed(counters.files_done).max(previous.files_done),
        // Compressed bytes of new data packed for upload: the engine does
        // not count bytes the store acknowledged, and packing runs ahead
        // of a throttled upload by the packs queued behind it.
        bytes_uploaded: signed(counters.bytes_stored).max(previous.bytes_uploaded),
        bytes_per_second: rate.max(0),
        eta_seconds,
        percent: 0,
    }
    .with_percent(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(done: u64, total: u64) -> ProgressSnapshot {
        ProgressSnapshot {
            total_bytes: total,
            total_files: 10,
            totals_known: true,
            bytes_done: done,
            files_done: done / 10,
            bytes_transferred: done / 2,
            bytes_new: 0,
            bytes_stored: 0,
            warnings: 0,
        }
    }

    #[test]
    fn progress_reports_a_rate_and_an_eta() {
        let first = next_progress(&counters(100, 1000), None, 1.0);
        let second = next_progress(&counters(300, 1000), Some(&first), 2.0);
        assert_eq!(second.bytes_per_second, 100);
        assert_eq!(second.eta_seconds, Some(7));
        assert_eq!(second.percent, 30);
    }

    #[test]
    fn progress_never_goes_backwards_when_the_engine_restarts_its_counters() {
        let before = next_progress(&counters(800, 1000), None, 1.0);
        let after_restart = next_progress(&counters(50, 1000), Some(&before), 2.0);
        assert_eq!(after_restart.bytes_done, 800);
        assert_eq!(after_restart.files_done, before.files_done);
        assert_eq!(after_restart.bytes_per_second, 0);
    }
}
