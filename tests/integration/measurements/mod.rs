//! Measurements, not checks: end-to-end runs on the same real
//! kube-apiserver, MinIO and kubelet stand-in as the controller's tests
//! (`support::fixture`), which print the figures quoted in
//! docs/benchmarks.md and assert only that the run completed. Each is
//! `#[ignore]`d, so `cargo test` (and CI) never runs them; run one with
//!
//! ```sh
//! cargo build -p mover-agent   # the tests do not rebuild the agent
//! cargo test --test integration measurements::bandwidth_split -- --ignored --nocapture
//! cargo test --test integration measurements::api_requests -- --ignored --nocapture
//! cargo test --test integration measurements::restore_api_requests -- --ignored --nocapture
//! cargo test --test integration measurements::agent_memory -- --ignored --nocapture
//! cargo test --test integration measurements::controller_memory -- --ignored --nocapture
//! cargo test --test integration measurements::restore_throughput -- --ignored --nocapture
//! cargo test --test integration measurements::bench_claim -- --ignored --nocapture
//! ```
//!
//! (`HAULAGE_AGENT_BIN` / `HAULAGE_CONTROLLER_BIN` / `HAULAGE_BIN` name release builds
//! instead of the debug ones next to the test). Run them one at a time:
//! together they would share the two cores and each other's memory.
//! docs/benchmarks.md has the figures and how to read them.

mod agent_memory;
mod api_requests;
mod bandwidth_split;
mod bench_claim;
mod controller_memory;
mod restore_api_requests;
mod restore_throughput;

/// The medians and maximum of `values` (sorted in place), for a printout.
pub fn spread(values: &mut [f64]) -> String {
    if values.is_empty() {
        return "none".to_string();
    }
    values.sort_by(f64::total_cmp);
    format!(
        "min {:.1} / median {:.1} / max {:.1}",
        values[0],
        values[values.len() / 2],
        values[values.len() - 1]
    )
}
