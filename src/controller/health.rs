//! `/healthz` (the process answers) and `/readyz` (the caches have synced)
//! over plain HTTP/1.1, enough for kubelet probes; no web framework.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Bytes of a request read before answering (probes send one short line).
const REQUEST_BUFFER_BYTES: usize = 1024;
/// A client that sends nothing for this long is dropped.
const READ_TIMEOUT_SECONDS: u64 = 5;

/// The response to a request line: status line and body.
pub fn respond(request_line: &str, ready: bool) -> (&'static str, &'static str) {
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    match path {
        "/healthz" | "/livez" => ("200 OK", "ok\n"),
        "/readyz" if ready => ("200 OK", "ok\n"),
        "/readyz" => ("503 Service Unavailable", "caches not synced\n"),
        _ => ("404 Not Found", "not found\n"),
    }
}

/// Serve the health endpoints until `shutdown`.
pub async fn serve(listener: TcpListener, ready: Arc<AtomicBool>, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut stream, _)) = accepted else {
            continue;
        };
        let ready = ready.load(Ordering::SeqCst);
        tokio::spawn(async move {
            let mut buffer = vec![0_u8; REQUEST_BUFFER_BYTES];
            let read = tokio::time::timeout(
                Duration::from_secs(READ_TIMEOUT_SECONDS),
                stream.read(&mut buffer),
            )
            .await;
            let Ok(Ok(length)) = read else {
                return;
            };
            let text = String::from_utf8_lossy(&buffer[..length]);
            let (status, body) = respond(text.lines().next().unwrap_or(""), ready);
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_cache_sync() {
        assert_eq!(
            respond("GET /readyz HTTP/1.1", false).0,
            "503 Service Unavailable"
        );
        assert_eq!(respond("GET /readyz HTTP/1.1", true).0, "200 OK");
        assert_eq!(respond("GET /healthz HTTP/1.1", false).0, "200 OK");
        assert_eq!(respond("GET /metrics HTTP/1.1", true).0, "404 Not Found");
    }
}
