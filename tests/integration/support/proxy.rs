//! A fault-injecting TCP proxy on 127.0.0.1 for storage fault tests.
//!
//! It forwards every connection to one upstream address and, on command,
//! drops all open connections, cuts the connection that carries the N-th
//! uploaded byte (client → server) from now on, or stalls uploads after N
//! bytes until resumed. Faults are counted on upload bytes only, because
//! what the tests need to break is a request body in flight. The proxy's
//! tasks end when the handle drops.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
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

#[derive(Debug)]
struct Control {
    fault: Mutex<Fault>,
    uploaded: AtomicU64,
    connections: Mutex<CancellationToken>,
    resumed: Notify,
    cuts: AtomicU64,
}

impl Control {
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
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let control = Arc::new(Control {
            fault: Mutex::new(Fault::None),
            uploaded: AtomicU64::new(0),
            connections: Mutex::new(CancellationToken::new()),
            resumed: Notify::new(),
            cuts: AtomicU64::new(0),
        });
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
                    let (server_read, server_write) = server.into_split();
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = dropped.cancelled() => {}
                        () = pump_upload(client_read, server_write, &control) => {}
                        () = pump_download(server_read, client_write) => {}
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

async fn pump_download(mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => {
                if to.write_all(&buffer[..read]).await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn pump_upload(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, control: &Control) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        let mut pending = &buffer[..read];
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
                    return;
                }
                control.uploaded.fetch_add(allowed as u64, Ordering::SeqCst);
                pending = &pending[allowed..];
                continue;
            }
            match control.fault() {
                Fault::CutAt { .. } => {
                    control.set_fault(Fault::None);
                    control.cuts.fetch_add(1, Ordering::SeqCst);
                    return;
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
    }
}
