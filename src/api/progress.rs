//! Shared status values: transfer progress (one struct for a VolumeTransfer
//! and for the roll-up into its VolumeBackup) and the Go-style duration
//! strings the specs carry (`validationFrequency: 1m`).

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How far a transfer (or a whole backup) has come. Counters only grow
/// while a transfer runs; `percent` is derived from the bytes by
/// [`Progress::with_percent`] so `kubectl get` can show it as a column.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Bytes to read in total (file sizes of the source, or of the snapshot).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub total_bytes: i64,
    /// Bytes read (upload) or written (download) so far.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub bytes_done: i64,
    /// Files in total.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub total_files: i64,
    /// Files finished so far.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub files_done: i64,
    /// Bytes sent to the storage location (after dedup and compression).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub bytes_uploaded: i64,
    /// Recent rate of `bytesDone`.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub bytes_per_second: i64,
    /// Estimated seconds left at the recent rate; absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub eta_seconds: Option<i64>,
    /// `bytesDone` as a whole percentage of `totalBytes` (0–100).
    #[serde(default)]
    #[schemars(range(min = 0, max = 100))]
    pub percent: i32,
}

impl Progress {
    /// This progress with `percent` recomputed from the bytes: rounded down,
    /// so 100 means every byte is done; an empty transfer that is done
    /// counts as 100 only when `complete`.
    pub fn with_percent(mut self, complete: bool) -> Self {
        self.percent = if self.total_bytes > 0 {
            let done = self.bytes_done.clamp(0, self.total_bytes) as i128;
            (done * 100 / self.total_bytes as i128) as i32
        } else if complete {
            100
        } else {
            0
        };
        self
    }

    /// The sum of several transfers' progress: counters and rates add up,
    /// the ETA is the longest one (unknown if any is unknown while work is
    /// left), and the percentage is recomputed.
    pub fn sum<'a>(parts: impl IntoIterator<Item = &'a Progress>) -> Progress {
        let mut total = Progress::default();
        let mut eta = Some(0_i64);
        for part in parts {
            total.total_bytes = total.total_bytes.saturating_add(part.total_bytes);
            total.bytes_done = total.bytes_done.saturating_add(part.bytes_done);
            total.total_files = total.total_files.saturating_add(part.total_files);
            total.files_done = total.files_done.saturating_add(part.files_done);
            total.bytes_uploaded = total.bytes_uploaded.saturating_add(part.bytes_uploaded);
            total.bytes_per_second = total.bytes_per_second.saturating_add(part.bytes_per_second);
            let finished = part.total_bytes > 0 && part.bytes_done >= part.total_bytes;
            eta = match (eta, part.eta_seconds) {
                (Some(so_far), Some(this)) => Some(so_far.max(this)),
                (Some(so_far), None) if finished => Some(so_far),
                _ => None,
            };
        }
        total.eta_seconds = eta;
        let complete = total.total_bytes == 0 && total.total_files == total.files_done;
        total.with_percent(complete)
    }
}

/// A `validationFrequency`-style duration that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {text:?}: {problem} (write e.g. 30s, 5m, 1h30m, or 0)")]
pub struct DurationError {
    /// The text as given.
    pub text: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

/// The regular expression the CRDs check duration strings against; the
/// subset of Go's `time.ParseDuration` that [`parse_duration`] reads.
pub const DURATION_PATTERN: &str = "^(0|([0-9]+(h|m|s|ms))+)$";

/// Read a Go-style duration of whole hours, minutes, seconds and
/// milliseconds (`1h30m`, `90s`, `250ms`, `0`), as the CRDs accept it.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let fail = |problem| DurationError {
        text: text.to_string(),
        problem,
    };
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.is_empty() {
        return Err(fail("it is empty"));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(fail("a number must come before each unit"));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| fail("a number is too large"))?;
        rest = &rest[digits..];
        let (unit, length) = if rest.starts_with("ms") {
            (Duration::from_millis(1), 2)
        } else if rest.starts_with('h') {
            (Duration::from_secs(3600), 1)
        } else if rest.starts_with('m') {
            (Duration::from_secs(60), 1)
        } else if rest.starts_with('s') {
            (Duration::from_secs(1), 1)
        } else {
            return Err(fail("each number needs a unit: h, m, s or ms"));
        };
        rest = &rest[length..];
        let part = u32::try_from(number)
            .ok()
            .and_then(|n| unit.checked_mul(n))
            .ok_or_else(|| fail("it is too long"))?;
        total = total
            .checked_add(part)
            .ok_or_else(|| fail("it is too long"))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_go() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m250ms"), Ok(Duration::from_millis(60_250)));
    }

    #[test]
    fn malformed_durations_are_refused_with_the_text() {
        for bad in ["", "5", "m", "1d", "-1m", "1.5h", "1m ", "99999999999h"] {
            let error = parse_duration(bad).expect_err(bad);
            assert!(error.to_string().contains(&format!("{bad:?}")), "{error}");
        }
    }

    #[test]
    fn percent_rounds_down_and_is_bounded() {
        let progress = Progress {
            total_bytes: 3,
            bytes_done: 2,
            ..Progress::default()
        };
        assert_eq!(progress.clone().with_percent(false).percent, 66);
        let overshoot = Progress {
            total_bytes: 3,
            bytes_done: 5,
            ..Progress::default()
        };
        assert_eq!(overshoot.with_percent(false).percent, 100);
        assert_eq!(Progress::default().with_percent(false).percent, 0);
        assert_eq!(Progress::default().with_percent(true).percent, 100);
    }

    #[test]
    fn sum_adds_counters_and_takes_the_longest_eta() {
        let a = Progress {
            total_bytes: 100,
            bytes_done: 50,
            total_files: 2,
            files_done: 1,
            bytes_uploaded: 10,
            bytes_per_second: 5,
            eta_seconds: Some(10),
            percent: 50,
        };
        let b = Progress {
            total_bytes: 300,
            bytes_done: 50,
            eta_seconds: Some(60),
            bytes_per_second: 1,
            ..Progress::default()
        };
        let total = Progress::sum([&a, &b]);
        assert_eq!(total.total_bytes, 400);
        assert_eq!(total.bytes_done, 100);
        assert_eq!(total.bytes_per_second, 6);
        assert_eq!(total.eta_seconds, Some(60));
        assert_eq!(total.percent, 25);
        let unknown = Progress {
            total_bytes: 10,
            ..Progress::default()
        };
        assert_eq!(Progress::sum([&a, &unknown]).eta_seconds, None);
    }
}
