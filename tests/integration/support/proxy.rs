//! A fault-injecting proxy on 127.0.0.1 for storage fault tests.
//!
//! It forwards every connection to one upstream address and, on command,
//! drops all open connections, cuts the connection that carries the N-th
//! uploaded byte (client → server) from now on, or stalls uploads after N
//! bytes until resumed; those faults are counted on upload bytes, because
//! what they break is a request body in flight. It also reads the HTTP/1.1
//! requests it carries (their heads, and their bodies by
//! `Content-Length`; not with [`FaultProxy::start_opaque`], for a TLS
//! upstream such as kube-apiserver), so it can fault whole requests as an
//! S3 server under
//! load does: answer a share of them `503 SlowDown` (S3's throttling
//! answer, after reading the request's body), hold each for a latency, or
//! answer none for a while. It can also go down as a stopped server does:
//! every open connection closed, every new one closed as soon as it is
//! accepted (counted), until it comes back. A connection whose request has no
//! `Content-Length` (a chunked body) is forwarded as bytes from then on.
//! The proxy's tasks end when the handle drops.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What the proxy does to upload bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Forward everything.
    None,
    /// Close the connection that would carry upload byte number `at`
    /// (counted from the counter's value when armed), once.
    CutAt { at: u64 },
    /// Forward upload bytes up to number `at`, then hold the rest until
    /// [`FaultProxy::resume`].
    StallAt { at: u64 },
}

/// What the proxy does to whole requests.
#[derive(Debug, Clone, Copy, Default)]
struct RequestFaults {
    /// Answer this share of requests (0..=1) `503 SlowDown`, spread evenly
    /// over the requests (the n-th is answered so when `n * share` passes
    /// a whole number).
    slow_down_share: f64,
    /// Hold each request this long before forwarding it.
    latency: Duration,
    /// Answer no request until then.
    silent_until: Option<Instant>,
}

#[derive(Debug)]
struct Control {
    fault: Mutex<Fault>,
    requests: Mutex<RequestFaults>,
    uploaded: AtomicU64,
    connections: Mutex<CancellationToken>,
    resumed: Notify,
    cuts: AtomicU64,
    /// Requests seen (heads read), and those answered `503 SlowDown`.
    request_count: AtomicU64,
    slow_downs: AtomicU64,
    /// Down: connections are closed as soon as they are accepted.
    down: std::sync::atomic::AtomicBool,
    /// Connections closed so.
    refused: AtomicU64,
    /// Connections accepted, refused ones included.
    accepted: AtomicU64,
    /// Forward bytes without reading requests (a TLS upstream).
    opaque: bool,
}

impl Control {
    /// No fault, nothing counted.
    fn new(opaque: bool) -> Self {
        Control {
            opaque,
            fault: Mutex::new(Fault::None),
            requests: Mutex::new(RequestFaults::default()),
            uploaded: AtomicU64::new(0),
            connections: Mutex::new(CancellationToken::new()),
            resumed: Notify::new(),
            cuts: AtomicU64::new(0),
            request_count: AtomicU64::new(0),
            slow_downs: AtomicU64::new(0),
            down: std::sync::atomic::AtomicBool::new(false),
            refused: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        }
    }

    fn fault(&self) -> Fault {
        *self
            .fault
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn set_fault(&self, fault: Fault) {
        *self
            .fault
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = fault;
    }

    fn request_faults(&self) -> RequestFaults {
        *self
            .requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn change_request_faults(&self, change: impl FnOnce(&mut RequestFaults)) {
        change(
            &mut self
                .requests
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
    }

    /// Whether the request just counted as number `n` (from 1) is answered
    /// `503 SlowDown`.
    fn slows_down(&self, n: u64) -> bool {
        let share = self.request_faults().slow_down_share.clamp(0.0, 1.0);
        // Whole numbers passed by n * share: one every 1/share requests.
        (n as f64 * share).floor() > ((n - 1) as f64 * share).floor()
    }

    fn connection_token(&self) -> CancellationToken {
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// A running proxy; dropping it stops it and closes its connections.
pub struct FaultProxy {
    address: SocketAddr,
    control: Arc<Control>,
    shutdown: CancellationToken,
}

impl FaultProxy {
    /// Listen on a free 127.0.0.1 port and forward to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        Self::listen(upstream, false).await
    }

    /// Like [`FaultProxy::start`], forwarding bytes without reading
    /// requests: for a TLS upstream (kube-apiserver), whose requests it
    /// cannot read. The connection faults (going down, dropping every
    /// connection, cuts by byte count) work; the request faults do not.
    pub async fn start_opaque(upstream: SocketAddr) -> anyhow::Result<Self> {
        Self::listen(upstream, true).await
    }

    async fn listen(upstream: SocketAddr, opaque: bool) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let control = Arc::new(Control::new(opaque));
        let shutdown = CancellationToken::new();
        let accept_control = control.clone();
        let accept_shutdown = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = accept_shutdown.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                accept_control.accepted.fetch_add(1, Ordering::SeqCst);
                if accept_control.down.load(Ordering::SeqCst) {
                    accept_control.refused.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                let control = accept_control.clone();
                let stop = accept_shutdown.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let dropped = control.connection_token();
                    let (client_read, client_write) = client.into_split();
                    let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
                    let (server_read, server_write) = server.into_split();
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = dropped.cancelled() => {}
                        () = pump_upload(client_read, server_write, &client_write, &control) => {}
                        () = pump_download(server_read, &client_write) => {}
                    }
                    // Both halves of both sockets drop here: the connection closes.
                });
            }
        });
        Ok(FaultProxy {
            address,
            control,
            shutdown,
        })
    }

    /// `http://127.0.0.1:PORT` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The proxy's address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Upload bytes forwarded so far.
    pub fn uploaded_bytes(&self) -> u64 {
        self.control.uploaded.load(Ordering::SeqCst)
    }

    /// Connections cut by [`FaultProxy::cut_upload_after`] so far.
    pub fn cuts(&self) -> u64 {
        self.control.cuts.load(Ordering::SeqCst)
    }

    /// Close every open connection now; new ones are forwarded as before.
    pub fn drop_all_connections(&self) {
        let mut token = self
            .control
            .connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        token.cancel();
        *token = CancellationToken::new();
    }

    /// Once `bytes` more upload bytes have been forwarded, close the
    /// connection carrying the next one. One-shot: later connections pass.
    pub fn cut_upload_after(&self, bytes: u64) {
        let at = self.uploaded_bytes() + bytes;
        self.control.set_fault(Fault::CutAt { at });
    }

    /// Forward `bytes` more upload bytes, then hold all further upload bytes
    /// until [`FaultProxy::resume`].
    pub fn stall_upload_after(&self, bytes: u64) {
        let at = self.uploaded_bytes() + bytes;
        self.control.set_fault(Fault::StallAt { at });
    }

    /// Answer `share` (0..=1) of the requests from now on `503 SlowDown`,
    /// spread evenly; 0 stops it.
    pub fn slow_down(&self, share: f64) {
        self.control
            .change_request_faults(|faults| faults.slow_down_share = share);
    }

    /// Hold each request `latency` before forwarding it; zero stops it.
    pub fn delay_requests(&self, latency: Duration) {
        self.control
            .change_request_faults(|faults| faults.latency = latency);
    }

    /// Answer no request for `period` from now (requests wait, connections
    /// stay open), as a server that stopped answering does.
    pub fn go_silent_for(&self, period: Duration) {
        let until = Instant::now() + period;
        self.control
            .change_request_faults(|faults| faults.silent_until = Some(until));
    }

    /// Go down as a stopped server does: close every open connection, and
    /// each new one as soon as it is accepted, until [`FaultProxy::come_back`].
    pub fn go_down(&self) {
        self.control.down.store(true, Ordering::SeqCst);
        self.drop_all_connections();
    }

    /// Forward connections again after [`FaultProxy::go_down`].
    pub fn come_back(&self) {
        self.control.down.store(false, Ordering::SeqCst);
    }

    /// Connections closed unanswered while down, so far.
    pub fn refused(&self) -> u64 {
        self.control.refused.load(Ordering::SeqCst)
    }

    /// Connections accepted so far (refused ones included): each a
    /// client's attempt to reach the upstream.
    pub fn connections(&self) -> u64 {
        self.control.accepted.load(Ordering::SeqCst)
    }

    /// Requests seen so far (their heads read).
    pub fn requests(&self) -> u64 {
        self.control.request_count.load(Ordering::SeqCst)
    }

    /// Requests answered `503 SlowDown` so far.
    pub fn slow_downs(&self) -> u64 {
        self.control.slow_downs.load(Ordering::SeqCst)
    }

    /// Clear any fault and release stalled uploads.
    pub fn resume(&self) {
        self.control.set_fault(Fault::None);
        self.control.resumed.notify_waiters();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.control.resumed.notify_waiters();
    }
}

async fn pump_download(mut from: OwnedReadHalf, to: &tokio::sync::Mutex<OwnedWriteHalf>) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => {
                if to.lock().await.write_all(&buffer[..read]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Where the upload direction of a connection is in its HTTP/1.1 stream.
enum Framing {
    /// Reading a request's head (the bytes so far).
    Head(Vec<u8>),
    /// Forwarding (or, for a request answered by the proxy, dropping) this
    /// many more bytes of a request's body.
    Body { left: u64, dropped: bool },
    /// Forwarding bytes without reading them (a chunked body).
    Opaque,
}

/// Most bytes a request head may have before the connection is forwarded
/// as bytes.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The method and `Content-Length` of a request head, and whether its
/// body is chunked.
fn parse_head(head: &[u8]) -> (String, Option<u64>, bool) {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let method = lines
        .next()
        .and_then(|line| line.split(' ').next())
        .unwrap_or_default()
        .to_string();
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "content-length" {
            length = value.parse().ok();
        } else if name == "transfer-encoding" && value.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        }
    }
    (method, length, chunked)
}

/// S3's throttling answer, as a server under load sends it; the
/// connection is closed after it.
fn slow_down_response(method: &str) -> Vec<u8> {
    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                <Message>Please reduce your request rate.</Message>\
                <RequestId>fault-proxy</RequestId></Error>";
    let mut response = format!(
        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         x-amz-request-id: fault-proxy\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        response.extend_from_slice(body.as_bytes());
    }
    response
}

/// Forward the upload direction of one connection, request by request
/// ([`Framing`]), with the request faults and the byte faults applied.
async fn pump_upload(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    client: &tokio::sync::Mutex<OwnedWriteHalf>,
    control: &Control,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut framing = if control.opaque {
        Framing::Opaque
    } else {
        Framing::Head(Vec::new())
    };
    // The answer owed for a request whose body is being dropped.
    let mut answer: Option<Vec<u8>> = None;
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        let mut input: Vec<u8> = buffer[..read].to_vec();
        while !input.is_empty() {
            match &mut framing {
                Framing::Opaque => {
                    if !forward(&mut to, &input, control).await {
                        return;
                    }
                    input.clear();
                }
                Framing::Body { left, dropped } => {
                    let take = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(input.len());
                    if !*dropped && !forward(&mut to, &input[..take], control).await {
                        return;
                    }
                    *left -= take as u64;
                    input.drain(..take);
                    if *left == 0 {
                        if let Some(response) = answer.take() {
                            let _ = client.lock().await.write_all(&response).await;
                            return;
                        }
                        framing = Framing::Head(Vec::new());
                    }
                }
                Framing::Head(head) => {
                    head.append(&mut input);
                    let Some(end) = head.windows(4).position(|window| window == b"\r\n\r\n") else {
                        if head.len() > MAX_HEAD_BYTES {
                            let bytes = std::mem::take(head);
                            if !forward(&mut to, &bytes, control).await {
                                return;
                            }
                            framing = Framing::Opaque;
                        }
                        continue;
                    };
                    let mut bytes = std::mem::take(head);
                    // What follows the head is its body, or the next request.
                    input = bytes.split_off(end + 4);
                    let (method, length, chunked) = parse_head(&bytes);
                    let n = control.request_count.fetch_add(1, Ordering::SeqCst) + 1;
                    let faults = control.request_faults();
                    if let Some(until) = faults.silent_until {
                        tokio::time::sleep_until(until).await;
                    }
                    if !faults.latency.is_zero() {
                        tokio::time::sleep(faults.latency).await;
                    }
                    let slow_down = !chunked && control.slows_down(n);
                    if slow_down {
                        control.slow_downs.fetch_add(1, Ordering::SeqCst);
                        answer = Some(slow_down_response(&method));
                    } else if !forward(&mut to, &bytes, control).await {
                        return;
                    }
                    framing = match (chunked, length.unwrap_or(0)) {
                        (true, _) => Framing::Opaque,
                        (false, 0) => {
                            if let Some(response) = answer.take() {
                                let _ = client.lock().await.write_all(&response).await;
                                return;
                            }
                            Framing::Head(Vec::new())
                        }
                        (false, left) => Framing::Body {
                            left,
                            dropped: slow_down,
                        },
                    };
                }
            }
        }
    }
}

/// Forward `bytes` to the server with the byte faults applied; false when
/// the connection is to close (cut, or the server is gone).
async fn forward(to: &mut OwnedWriteHalf, bytes: &[u8], control: &Control) -> bool {
    let mut pending = bytes;
    while !pending.is_empty() {
        let uploaded = control.uploaded.load(Ordering::SeqCst);
        let allowed = match control.fault() {
            Fault::None => pending.len(),
            Fault::CutAt { at } | Fault::StallAt { at } => {
                usize::try_from(at.saturating_sub(uploaded))
                    .unwrap_or(usize::MAX)
                    .min(pending.len())
            }
        };
        if allowed > 0 {
            if to.write_all(&pending[..allowed]).await.is_err() {
                return false;
            }
            control.uploaded.fetch_add(allowed as u64, Ordering::SeqCst);
            pending = &pending[allowed..];
            continue;
        }
        match control.fault() {
            Fault::CutAt { .. } => {
                control.set_fault(Fault::None);
                control.cuts.fetch_add(1, Ordering::SeqCst);
                return false;
            }
            Fault::StallAt { .. } => {
                // Register before checking, so a resume in between is not missed.
                let resumed = control.resumed.notified();
                tokio::pin!(resumed);
                resumed.as_mut().enable();
                if matches!(control.fault(), Fault::StallAt { .. }) {
                    resumed.await;
                }
            }
            Fault::None => {}
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_of_requests_is_spread_evenly() {
        let control = Control::new(false);
        control.change_request_faults(|faults| faults.slow_down_share = 0.2);
        let slowed: Vec<u64> = (1..=20).filter(|n| control.slows_down(*n)).collect();
        assert_eq!(slowed, [5, 10, 15, 20]);
    }

    #[test]
    fn a_head_gives_its_method_and_body_length() {
        assert_eq!(
            parse_head(b"PUT /b/k HTTP/1.1\r\nHost: x\r\ncontent-length: 12\r\n\r\n"),
            ("PUT".to_string(), Some(12), false)
        );
        assert_eq!(
            parse_head(b"PUT /b/k HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            ("PUT".to_string(), None, true)
        );
    }
}
