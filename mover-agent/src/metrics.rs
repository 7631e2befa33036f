//! The agent's `/metrics` (and `/healthz`): each transfer's live engine
//! counters and the time spent waiting on the rate limiters, read at scrape
//! time (the engine only bumps atomics; nothing here slows it down). Each
//! series is named and explained once here; docs/controller.md lists them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use haulage::api::transfer::TransferDirection;
use haulage::engine::progress::Progress;
use haulage::metrics::{NoLabels, Response, Series, encode_counters, encode_gauges};
use haulage::store::FailureCause;
use haulage::store::limits::WaitTime;
use haulage::store::outage::{Outage, OutageReport};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;

/// Port of `/metrics` in a stage pod (the container port named `metrics`).
pub const DEFAULT_METRICS_PORT: u16 = haulage::reconcile::stage_pod::AGENT_METRICS_PORT;

/// `haulage_agent_transfer_bytes_done{namespace,pvc}`.
pub const BYTES_DONE: Series = Series {
    name: "haulage_agent_transfer_bytes_done",
    help: "Bytes of the claim's content processed so far (read, or unchanged and taken from the parent snapshot)",
};
/// `haulage_agent_transfer_size_bytes{namespace,pvc}`.
pub const SIZE: Series = Series {
    name: "haulage_agent_transfer_size_bytes",
    help: "Bytes of the claim's content in total (grows while the scan runs)",
};
/// `haulage_agent_transfer_files_done{namespace,pvc}`.
pub const FILES_DONE: Series = Series {
    name: "haulage_agent_transfer_files_done",
    help: "Regular files of the claim processed so far",
};
/// `haulage_agent_transfer_files{namespace,pvc}`.
pub const FILES: Series = Series {
    name: "haulage_agent_transfer_files",
    help: "Regular files of the claim in total (grows while the scan runs)",
};
/// `haulage_agent_bytes_read_total{namespace,pvc}`.
pub const BYTES_READ: Series = Series {
    name: "haulage_agent_bytes_read",
    help: "Bytes read from the claim by this agent process",
};
/// `haulage_agent_bytes_written_total{namespace,pvc}`.
pub const BYTES_WRITTEN: Series = Series {
    name: "haulage_agent_bytes_written",
    help: "Bytes written into the claim by this agent process (restores)",
};
/// `haulage_agent_bytes_uploaded_total{namespace,pvc}`.
pub const BYTES_UPLOADED: Series = Series {
    name: "haulage_agent_bytes_uploaded",
    help: "Bytes of new data packed for upload after dedup and compression by this agent process",
};
/// `haulage_agent_throttle_wait_seconds_total{limiter}`.
pub const THROTTLE_WAIT: Series = Series {
    name: "haulage_agent_throttle_wait_seconds",
    help: "Seconds spent waiting on a rate limiter, summed over concurrent waiters; limiter upload is the storage location's upload cap, read and write the bandwidth granted to the backups and the restores",
};
/// `haulage_agent_storage_unavailable`.
pub const STORAGE_UNAVAILABLE: Series = Series {
    name: "haulage_agent_storage_unavailable",
    help: "1 while the storage location does not answer and the agent's volumes wait for it, else 0",
};
/// `haulage_agent_out_of_file_descriptors`.
pub const OUT_OF_FILE_DESCRIPTORS: Series = Series {
    name: "haulage_agent_out_of_file_descriptors",
    help: "1 while the agent's volumes wait because it has no file descriptor free to reach the storage location (its own or the node's limit of open files, not the location), else 0",
};
/// `haulage_agent_storage_outages_total`.
pub const STORAGE_OUTAGES: Series = Series {
    name: "haulage_agent_storage_outages",
    help: "Waits longer than the retry budget, for the storage location to answer or for a file descriptor to reach it, waited out by this agent process",
};
/// `haulage_agent_storage_unavailable_seconds_total`.
pub const STORAGE_UNAVAILABLE_SECONDS: Series = Series {
    name: "haulage_agent_storage_unavailable_seconds",
    help: "Seconds this agent process's volumes waited for the storage location to answer again, or for a file descriptor to reach it",
};

/// The values of [`STORAGE_UNAVAILABLE`] and [`OUT_OF_FILE_DESCRIPTORS`]
/// while `current` goes on: one of them is 1, by what the volumes wait
/// for, so that an alert on the location's silence does not fire for the
/// agent's own limit.
fn waiting_gauges(current: Option<&OutageReport>) -> (u64, u64) {
    match current {
        None => (0, 0),
        Some(current) if current.cause == FailureCause::OutOfDescriptors => (0, 1),
        Some(_) => (1, 0),
    }
}
/// `haulage_agent_storage_retries_total{cause}`.
pub const STORAGE_RETRIES: Series = Series {
    name: "haulage_agent_storage_retries",
    help: "Requests to the storage location that failed and were retried within the retry budget, by cause: throttled (503 SlowDown, 429) or other (cut connections, timeouts, 5xx)",
};
/// `haulage_agent_transfers`.
pub const TRANSFERS: Series = Series {
    name: "haulage_agent_transfers",
    help: "Transfers this agent process has started",
};

/// Where `/metrics` listens, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsAddress {
    /// No endpoint.
    Off,
    /// This address (port 0: any free port, logged at start).
    At(SocketAddr),
}

impl FromStr for MetricsAddress {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.eq_ignore_ascii_case("off") {
            return Ok(MetricsAddress::Off);
        }
        text.parse().map(MetricsAddress::At).map_err(|error| {
            format!("{text:?} is neither an address like 0.0.0.0:9090 nor `off`: {error}")
        })
    }
}

impl fmt::Display for MetricsAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsAddress::Off => f.write_str("off"),
            MetricsAddress::At(address) => write!(f, "{address}"),
        }
    }
}

type Transfers = Arc<Mutex<BTreeMap<(String, String), (TransferDirection, Arc<Progress>)>>>;

#[derive(Debug)]
struct AgentCollector {
    transfers: Transfers,
    upload_wait: WaitTime,
    read_wait: WaitTime,
    write_wait: WaitTime,
    outage: Outage,
}

impl Collector for AgentCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshots: Vec<_> = {
            let transfers = match self.transfers.lock() {
                Ok(transfers) => transfers,
                Err(poisoned) => poisoned.into_inner(),
            };
            transfers
                .iter()
                .map(|((namespace, pvc), (direction, progress))| {
                    (
                        [("namespace", namespace.clone()), ("pvc", pvc.clone())],
                        *direction,
                        progress.snapshot(),
                    )
                })
                .collect()
        };
        let rows = |value: fn(&haulage::engine::progress::ProgressSnapshot) -> u64| {
            snapshots
                .iter()
                .map(move |(labels, _, snapshot)| (labels.clone(), value(snapshot)))
        };
        let rows_of =
            |direction: TransferDirection,
             value: fn(&haulage::engine::progress::ProgressSnapshot) -> u64| {
                snapshots
                    .iter()
                    .filter(move |(_, of, _)| *of == direction)
                    .map(move |(labels, _, snapshot)| (labels.clone(), value(snapshot)))
            };
        encode_gauges(
            &mut encoder,
            TRANSFERS,
            [(NoLabels, snapshots.len() as u64)],
        )?;
        encode_gauges(&mut encoder, BYTES_DONE, rows(|s| s.bytes_done))?;
        encode_gauges(&mut encoder, SIZE, rows(|s| s.total_bytes))?;
        encode_gauges(&mut encoder, FILES_DONE, rows(|s| s.files_done))?;
        encode_gauges(&mut encoder, FILES, rows(|s| s.total_files))?;
        encode_counters(
            &mut encoder,
            BYTES_READ,
            rows_of(TransferDirection::Upload, |s| s.bytes_transferred),
        )?;
        encode_counters(
            &mut encoder,
            BYTES_WRITTEN,
            rows_of(TransferDirection::Download, |s| s.bytes_transferred),
        )?;
        encode_counters(
            &mut encoder,
            BYTES_UPLOADED,
            rows_of(TransferDirection::Upload, |s| s.bytes_stored),
        )?;
        encode_counters(
            &mut encoder,
            THROTTLE_WAIT,
            [
                (
                    [("limiter", "upload")],
                    self.upload_wait.total().as_secs_f64(),
                ),
                ([("limiter", "read")], self.read_wait.total().as_secs_f64()),
                (
                    [("limiter", "write")],
                    self.write_wait.total().as_secs_f64(),
                ),
            ],
        )?;
        let (unavailable, out_of_descriptors) = waiting_gauges(self.outage.current().as_ref());
        encode_gauges(&mut encoder, STORAGE_UNAVAILABLE, [(NoLabels, unavailable)])?;
        encode_gauges(
            &mut encoder,
            OUT_OF_FILE_DESCRIPTORS,
            [(NoLabels, out_of_descriptors)],
        )?;
        encode_counters(
            &mut encoder,
            STORAGE_OUTAGES,
            [(NoLabels, self.outage.outages())],
        )?;
        encode_counters(
            &mut encoder,
            STORAGE_UNAVAILABLE_SECONDS,
            [(NoLabels, self.outage.unavailable().as_secs_f64())],
        )?;
        let retries = self.outage.retries();
        encode_counters(
            &mut encoder,
            STORAGE_RETRIES,
            [
                ([("cause", "throttled")], retries.throttled),
                ([("cause", "other")], retries.other),
            ],
        )?;
        Ok(())
    }
}

/// The agent's metrics.
#[derive(Debug)]
pub struct AgentMetrics {
    registry: Registry,
    transfers: Transfers,
    read_wait: WaitTime,
    write_wait: WaitTime,
}

impl AgentMetrics {
    /// Metrics exporting the upload cap's waiting recorded into
    /// `upload_wait` and the storage location's outages recorded into
    /// `outage`.
    pub fn new(upload_wait: WaitTime, outage: Outage) -> Self {
        let transfers = Transfers::default();
        let read_wait = WaitTime::default();
        let write_wait = WaitTime::default();
        let mut registry = Registry::default();
        registry.register_collector(Box::new(AgentCollector {
            transfers: transfers.clone(),
            upload_wait,
            read_wait: read_wait.clone(),
            write_wait: write_wait.clone(),
            outage,
        }));
        AgentMetrics {
            registry,
            transfers,
            read_wait,
            write_wait,
        }
    }

    /// Where the read throttles (the bandwidth grants) record their
    /// waiting, exported as `limiter="read"`.
    pub fn read_wait(&self) -> WaitTime {
        self.read_wait.clone()
    }

    /// Where the write throttles (the restores' bandwidth grants) record
    /// their waiting, exported as `limiter="write"`.
    pub fn write_wait(&self) -> WaitTime {
        self.write_wait.clone()
    }

    /// Export the engine counters of the transfer of `namespace/pvc` (a
    /// backup's bytes as read, a restore's as written) from now on; kept
    /// after it ends, so its counters never drop while the process lives
    /// (a stage pod's agent exits after its transfers).
    pub fn track(
        &self,
        namespace: &str,
        pvc: &str,
        direction: TransferDirection,
        progress: Arc<Progress>,
    ) {
        let mut transfers = match self.transfers.lock() {
            Ok(transfers) => transfers,
            Err(poisoned) => poisoned.into_inner(),
        };
        transfers.insert(
            (namespace.to_string(), pvc.to_string()),
            (direction, progress),
        );
    }

    /// The answer for `path`.
    pub fn respond(&self, path: &str) -> Response {
        match path {
            "/metrics" => Response::metrics(&self.registry),
            "/healthz" | "/livez" => Response::text("200 OK", "ok\n"),
            _ => Response::not_found(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn addresses_parse_and_off_disables() {
        assert_eq!("off".parse::<MetricsAddress>(), Ok(MetricsAddress::Off));
        assert_eq!(
            "127.0.0.1:0".parse::<MetricsAddress>(),
            Ok(MetricsAddress::At("127.0.0.1:0".parse().expect("address")))
        );
        assert!("9090".parse::<MetricsAddress>().is_err());
        let default = MetricsAddress::At(SocketAddr::from(([0, 0, 0, 0], DEFAULT_METRICS_PORT)));
        assert_eq!(default.to_string().parse::<MetricsAddress>(), Ok(default));
    }

    #[test]
    fn a_scrape_reads_the_live_engine_counters_and_the_waits() {
        let upload_wait = WaitTime::default();
        let metrics = AgentMetrics::new(upload_wait.clone(), Outage::default());
        let progress = Arc::new(Progress::default());
        metrics.track("shop", "db", TransferDirection::Upload, progress.clone());
        let restoring = Arc::new(Progress::default());
        metrics.track(
            "shop-b",
            "db",
            TransferDirection::Download,
            restoring.clone(),
        );
        Progress::add(&restoring.bytes_transferred, 777);
        Progress::add(&progress.bytes_done, 4096);
        Progress::add(&progress.bytes_transferred, 3000);
        Progress::add(&progress.total_bytes, 10_000);
        upload_wait.add(Duration::from_millis(1500));
        let body = metrics.respond("/metrics").body;
        for line in [
            "haulage_agent_transfer_bytes_done{namespace=\"shop\",pvc=\"db\"} 4096",
            "haulage_agent_transfer_size_bytes{namespace=\"shop\",pvc=\"db\"} 10000",
            "haulage_agent_bytes_read_total{namespace=\"shop\",pvc=\"db\"} 3000",
            "haulage_agent_throttle_wait_seconds_total{limiter=\"upload\"} 1.5",
            "# TYPE haulage_agent_bytes_uploaded_total counter",
            "haulage_agent_transfers 2",
            "haulage_agent_bytes_written_total{namespace=\"shop-b\",pvc=\"db\"} 777",
            "haulage_agent_storage_unavailable 0",
            "haulage_agent_out_of_file_descriptors 0",
            "haulage_agent_storage_outages_total 0",
            "haulage_agent_storage_retries_total{cause=\"throttled\"} 0",
        ] {
            assert!(body.lines().any(|l| l == line), "{line} missing:\n{body}");
        }
        Progress::add(&progress.bytes_transferred, 1000);
        let body = metrics.respond("/metrics").body;
        assert!(
            body.contains("haulage_agent_bytes_read_total{namespace=\"shop\",pvc=\"db\"} 4000"),
            "{body}"
        );
        assert!(
            !body.contains("haulage_agent_bytes_read_total{namespace=\"shop-b\""),
            "a restore's writes are not reads: {body}"
        );
        assert_eq!(metrics.respond("/healthz").status, "200 OK");
    }

    #[test]
    fn a_want_of_descriptors_is_its_own_gauge_not_the_location_unavailable() {
        let mut current = OutageReport {
            since: std::time::UNIX_EPOCH,
            lasted: Duration::from_secs(40),
            error: "connection refused".to_string(),
            cause: FailureCause::Unreachable,
        };
        assert_eq!(waiting_gauges(None), (0, 0));
        assert_eq!(waiting_gauges(Some(&current)), (1, 0));
        current.cause = FailureCause::OutOfDescriptors;
        assert_eq!(waiting_gauges(Some(&current)), (0, 1));
    }
}
