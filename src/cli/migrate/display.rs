//! The one progress display of a migration: a row per pass object
//! (`backup shop-1`, `restore shop-1`, …) with bytes, files, rate and ETA
//! as the controller reports them. On a terminal these are indicatif bars
//! on standard output; otherwise (or with `--no-progress`) plain lines:
//! one when a row's phase changes and, unless `--no-progress`, one per
//! row every [`PLAIN_PROGRESS_INTERVAL`] while it runs.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::report::progress_text;
use crate::api::Progress;

/// How often a running row is printed in plain line mode.
pub const PLAIN_PROGRESS_INTERVAL: Duration = Duration::from_secs(10);

enum Mode {
    Bars {
        bars: MultiProgress,
        rows: BTreeMap<String, ProgressBar>,
    },
    Lines {
        progress_lines: bool,
        last: BTreeMap<String, (String, Instant)>,
    },
}

/// The display; rows are added as they are first shown.
pub struct Display {
    mode: Mode,
}

impl Display {
    /// Bars when standard output is a terminal and `no_progress` is not
    /// set, plain lines otherwise (phase changes only with `no_progress`).
    pub fn new(no_progress: bool) -> Self {
        let mode = if !no_progress && std::io::stdout().is_terminal() {
            Mode::Bars {
                bars: MultiProgress::with_draw_target(ProgressDrawTarget::stdout()),
                rows: BTreeMap::new(),
            }
        } else {
            Mode::Lines {
                progress_lines: !no_progress,
                last: BTreeMap::new(),
            }
        };
        Display { mode }
    }

    /// Show `row` in `phase` with `progress`.
    pub fn show(&mut self, row: &str, phase: &str, progress: Option<&Progress>) {
        let text = progress_text(phase, progress);
        match &mut self.mode {
            Mode::Bars { bars, rows } => {
                let bar = rows.entry(row.to_string()).or_insert_with(|| {
                    let bar = bars.add(ProgressBar::new(0));
                    bar.set_style(
                        ProgressStyle::with_template("{prefix:<28} [{bar:30}] {msg}")
                            .expect("valid template")
                            .progress_chars("=> "),
                    );
                    bar.set_prefix(row.to_string());
                    bar
                });
                if let Some(progress) = progress {
                    let total = u64::try_from(progress.total_bytes).unwrap_or(0);
                    let done = u64::try_from(progress.bytes_done).unwrap_or(0);
                    bar.set_length(total.max(done).max(1));
                    bar.set_position(done);
                }
                bar.set_message(text);
            }
            Mode::Lines {
                progress_lines,
                last,
            } => {
                let now = Instant::now();
                let due = match last.get(row) {
                    None => true,
                    Some((previous, _)) if previous != phase => true,
                    Some((_, at)) => {
                        *progress_lines && now.duration_since(*at) >= PLAIN_PROGRESS_INTERVAL
                    }
                };
                if due {
                    println!("{row}: {text}");
                    last.insert(row.to_string(), (phase.to_string(), now));
                }
            }
        }
    }

    /// Print a line (above the bars, when there are bars).
    pub fn line(&self, text: &str) {
        match &self.mode {
            Mode::Bars { bars, .. } => {
                if bars.println(text).is_err() {
                    println!("{text}");
                }
            }
            Mode::Lines { .. } => println!("{text}"),
        }
    }

    /// Leave the bars as they are drawn, before the report is printed.
    pub fn finish(&mut self) {
        if let Mode::Bars { rows, .. } = &mut self.mode {
            for bar in rows.values() {
                bar.abandon();
            }
        }
    }
}
