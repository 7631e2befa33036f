//! The controller's health endpoints over plain HTTP: one `GET`, and a
//! wait for `/readyz`.

use std::time::Duration;

use anyhow::Context;

use crate::support::fixture::eventually;

/// `GET path` on 127.0.0.1:port; the status code and body, if it answered.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// Poll `/readyz` on 127.0.0.1:`port` until it answers 200; after
/// `deadline` the error carries its last answer (which names the caches
/// still listing or the API server's problem).
pub async fn wait_until_ready(port: u16, deadline: Duration) -> anyhow::Result<()> {
    let last = std::sync::Mutex::new(None);
    let ready = eventually(deadline, || async {
        let answer = http_get(port, "/readyz").await;
        let ready = matches!(answer, Some((200, _)));
        *last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = answer;
        Ok(ready.then_some(()))
    })
    .await;
    let last = last
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    ready.with_context(|| match last {
        Some((status, body)) => format!("/readyz last answered {status}: {}", body.trim_end()),
        None => "/readyz never answered".to_string(),
    })
}

/// `GET path` on 127.0.0.1:port; the status code, if it answered.
pub async fn http_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).await.map(|(status, _)| status)
}
