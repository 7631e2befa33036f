//! What the controller and the mover agent share to be observed: a plain
//! HTTP/1.1 listener (enough for kubelet probes and a Prometheus scrape; no
//! web framework) and the Prometheus text exposition of a
//! `prometheus-client` registry. Which series each process serves is its
//! own: `controller::metrics` and the agent's `metrics` module.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
    LabelSetEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// `Content-Type` of `/metrics`: the Prometheus text format 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
/// `Content-Type` of every other answer.
const TEXT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";
/// Bytes of a request read at most while looking for its first line
/// (probes and scrapers send a short request line and a few headers).
const REQUEST_BUFFER_BYTES: usize = 4096;
/// A client that sends no complete request line for this long is dropped.
const READ_TIMEOUT_SECONDS: u64 = 5;

/// A series' name (without `_total`, which the encoder adds to counters)
/// and help text (without a final full stop, which registering adds; the
/// scrape-time encoders below add it too).
#[derive(Debug, Clone, Copy)]
pub struct Series {
    /// Name.
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
}

/// An empty label set, for a series of one sample.
#[derive(Debug, Clone, Copy)]
pub struct NoLabels;

impl EncodeLabelSet for NoLabels {
    fn encode(&self, _encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        Ok(())
    }
}

/// Write a gauge family of `series` from labelled values, at scrape time
/// (a `prometheus_client` collector).
pub fn encode_gauges<L: EncodeLabelSet, N: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    series: Series,
    rows: impl IntoIterator<Item = (L, N)>,
) -> Result<(), std::fmt::Error> {
    let gauges = rows
        .into_iter()
        .map(|(labels, value)| (labels, ConstGauge::new(value)));
    encode_family(encoder, series, MetricType::Gauge, gauges)
}

/// Write a counter family of `series` from labelled values, at scrape time;
/// the caller guarantees each value never decreases while the process runs.
pub fn encode_counters<L: EncodeLabelSet, N: EncodeCounterValue>(
    encoder: &mut DescriptorEncoder,
    series: Series,
    rows: impl IntoIterator<Item = (L, N)>,
) -> Result<(), std::fmt::Error> {
    let counters = rows
        .into_iter()
        .map(|(labels, value)| (labels, ConstCounter::new(value)));
    encode_family(encoder, series, MetricType::Counter, counters)
}

/// Write the family of `series` of type `metric_type`: its descriptor
/// (the help text with its final full stop), then each labelled metric.
fn encode_family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    series: Series,
    metric_type: MetricType,
    metrics: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let help = format!("{}.", series.help);
    let mut family = encoder.encode_descriptor(series.name, &help, None, metric_type)?;
    for (labels, metric) in metrics {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// An answer: status line, content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code and reason, such as `200 OK`.
    pub status: &'static str,
    /// `Content-Type` header.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

impl Response {
    /// A plain-text answer.
    pub fn text(status: &'static str, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type: TEXT_CONTENT_TYPE,
            body: body.into(),
        }
    }

    /// `404 Not Found`.
    pub fn not_found() -> Self {
        Self::text("404 Not Found", "not found\n")
    }

    /// The registry's series in the Prometheus text format; a `500` when a
    /// collector fails to encode.
    pub fn metrics(registry: &Registry) -> Self {
        let mut body = String::new();
        match prometheus_client::encoding::prometheus_text::encode(&mut body, registry) {
            Ok(()) => Response {
                status: "200 OK",
                content_type: METRICS_CONTENT_TYPE,
                body,
            },
            Err(_) => Self::text("500 Internal Server Error", "metrics not encoded\n"),
        }
    }
}

/// The path of an HTTP request line (`GET /metrics HTTP/1.1` → `/metrics`),
/// without its query string.
pub fn request_path(request_line: &str) -> &str {
    let target = request_line.split_whitespace().nth(1).unwrap_or("");
    target.split('?').next().unwrap_or("")
}

/// Answer every connection on `listener` with `respond(path)` until
/// `shutdown`; one request per connection (`Connection: close`).
pub async fn serve<F>(listener: TcpListener, respond: F, shutdown: CancellationToken)
where
    F: Fn(&str) -> Response + Send + Sync + 'static,
{
    let respond = Arc::new(respond);
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut stream, _)) = accepted else {
            continue;
        };
        let respond = respond.clone();
        tokio::spawn(async move {
            let read = tokio::time::timeout(
                Duration::from_secs(READ_TIMEOUT_SECONDS),
                read_request_line(&mut stream),
            )
            .await;
            let Ok(Some(line)) = read else {
                return;
            };
            let response = respond(request_path(&line));
            let head = format!(
                "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                response.status,
                response.content_type,
                response.body.len()
            );
            // A client that stops reading does not hold the task (and the
            // caches it references) forever.
            let _ = tokio::time::timeout(Duration::from_secs(READ_TIMEOUT_SECONDS), async {
                if stream.write_all(head.as_bytes()).await.is_ok() {
                    let _ = stream.write_all(response.body.as_bytes()).await;
                }
                let _ = stream.shutdown().await;
            })
            .await;
        });
    }
}

/// Read until the end of the request line (or the buffer is full, or the
/// peer stops sending); `None` when nothing arrived.
async fn read_request_line(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let mut buffer = vec![0_u8; REQUEST_BUFFER_BYTES];
    let mut length = 0;
    while length < buffer.len() {
        let read = stream.read(&mut buffer[length..]).await.ok()?;
        if read == 0 {
            break;
        }
        length += read;
        if buffer[..length].contains(&b'\n') {
            break;
        }
    }
    if length == 0 {
        return None;
    }
    let text = String::from_utf8_lossy(&buffer[..length]);
    Some(text.lines().next().unwrap_or("").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn the_path_leaves_out_method_version_and_query() {
        assert_eq!(request_path("GET /metrics HTTP/1.1"), "/metrics");
        assert_eq!(request_path("GET /readyz?verbose HTTP/1.1"), "/readyz");
        assert_eq!(request_path(""), "");
    }

    #[test]
    fn a_registry_is_served_in_the_prometheus_text_format() {
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        registry.register("haulage_example", "An example", counter.clone());
        counter.inc_by(3);
        let response = Response::metrics(&registry);
        assert_eq!(response.status, "200 OK");
        assert_eq!(response.content_type, METRICS_CONTENT_TYPE);
        assert!(
            response
                .body
                .contains("# TYPE haulage_example_total counter"),
            "{}",
            response.body
        );
        assert!(
            response.body.contains("\nhaulage_example_total 3\n"),
            "{}",
            response.body
        );
    }

    #[tokio::test]
    async fn every_connection_gets_the_answer_for_its_path() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            |path: &str| match path {
                "/hello" => Response::text("200 OK", "hi\n"),
                _ => Response::not_found(),
            },
            shutdown.clone(),
        ));
        for (path, expected) in [("/hello", "HTTP/1.1 200 OK"), ("/x", "HTTP/1.1 404")] {
            let mut stream = tokio::net::TcpStream::connect(address)
                .await
                .expect("connect");
            // The request line in two writes, as a slow client sends it.
            stream.write_all(b"GET ").await.expect("write");
            stream
                .write_all(format!("{path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .expect("write");
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.expect("read");
            assert!(answer.starts_with(expected), "{path}: {answer}");
        }
        shutdown.cancel();
    }
}
