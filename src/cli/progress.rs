//! Progress bars on standard error for interactive runs; hidden when
//! standard error is not a terminal or `--no-progress` is given.

use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::engine::progress::Progress;

/// How often the bar is redrawn.
const REFRESH_MILLISECONDS: u64 = 200;

/// A bar that follows a [`Progress`] until dropped.
pub struct ProgressDisplay {
    bar: ProgressBar,
    task: tokio::task::JoinHandle<()>,
}

impl ProgressDisplay {
    /// Start showing `progress` with `verb` ("backing up", "restoring").
    pub fn start(progress: Arc<Progress>, verb: &'static str, enabled: bool) -> Self {
        let target = if enabled {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(None, target);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
            )
            .expect("valid template"),
        );
        bar.set_prefix(verb);
        let shown = bar.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(REFRESH_MILLISECONDS));
            loop {
                tick.tick().await;
                let now = progress.snapshot();
                if now.totals_known {
                    shown.set_length(now.total_bytes.max(now.bytes_done));
                }
                shown.set_position(now.bytes_done);
                let files = if now.totals_known {
                    format!("{}/{} files", now.files_done, now.total_files)
                } else {
                    format!("{} files (counting)", now.files_done)
                };
                let warnings = if now.warnings > 0 {
                    format!(", {} warnings", now.warnings)
                } else {
                    String::new()
                };
                shown.set_message(format!("{files}{warnings}"));
            }
        });
        ProgressDisplay { bar, task }
    }
}

impl Drop for ProgressDisplay {
    fn drop(&mut self) {
        self.task.abort();
        self.bar.finish_and_clear();
    }
}

/// Bytes for humans, binary units.
pub fn human_bytes(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}
