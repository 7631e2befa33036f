//! A real MinIO server for one test: started from the binary that
//! `tests/infra/build.sh minio` builds, on 127.0.0.1 on a free port, with its
//! data in a temporary directory, and killed (by its own PID) when the
//! handle drops. A test can stop it and start it again on the same port and
//! data directory to play a server outage.
//!
//! [`MinioServer::start_tls`] serves HTTPS with a certificate for
//! 127.0.0.1 issued by a throwaway CA, whose PEM file the test hands to the
//! client as its CA bundle. [`MinioServer::start_on`] listens on another
//! local address (the real node's pods reach the host at its side of the
//! node's network, docs/test-infra.md).
//!
//! The binary is `$HAULAGE_MINIO_BIN`, or the newest
//! `${HAULAGE_INFRA_CACHE:-$HOME/.cache/haulage-infra}/minio-*/bin/minio`.

use std::fs::File;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use haulage::store::retry::RetryPolicy;
use haulage::store::{S3Credentials, S3Options, StoreOptions};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Root user of every test server. Not a secret: the server listens on
/// loopback only and lives as long as one test.
pub const ACCESS_KEY: &str = "haulage-test";
/// Root password of every test server; tests check it never shows up in
/// error messages.
pub const SECRET_KEY: &str = "haulage-test-secret-7f3a9c";
/// Region the tests sign for.
pub const REGION: &str = "us-east-1";
/// Point `command` (a `haulage` run) at the S3 server at `endpoint` with
/// the test servers' root credentials in the standard variables, and keep
/// the caller's own AWS profile and session token out of it.
pub fn with_s3_credentials<'a>(command: &'a mut Command, endpoint: &str) -> &'a mut Command {
    command
        .env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_REGION", REGION)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_SESSION_TOKEN")
}
/// How long a server may take to report ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the MinIO binary is, or a message saying how to build it.
pub fn minio_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("HAULAGE_MINIO_BIN") {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        bail!("HAULAGE_MINIO_BIN={} is not a file", path.display());
    }
    let cache = match std::env::var_os("HAULAGE_INFRA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").context("HOME is not set")?;
            Path::new(&home).join(".cache/haulage-infra")
        }
    };
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(&cache)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("minio-"))
        .map(|entry| entry.path().join("bin/minio"))
        .filter(|path| path.is_file())
        .collect();
    candidates.sort();
    candidates.pop().with_context(|| {
        format!(
            "no MinIO binary under {}/minio-*/bin/minio: run `tests/infra/build.sh minio` first \
             (or point HAULAGE_MINIO_BIN at a minio binary)",
            cache.display()
        )
    })
}

/// A free TCP port on 127.0.0.1 (free when asked; the server binds it right after).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("bind an ephemeral port")?;
    Ok(listener.local_addr()?.port())
}

/// The port of a stopped server, kept from everything else on the
/// machine until it starts again: bound, never listening, so connections
/// to it are refused as they are by a stopped server, while neither
/// another test's [`free_port`] nor an outgoing connection's local port
/// can take it. Without it, a port left free for a minute or more (the
/// listener's TIME_WAIT sockets kept it for the first one) is taken by
/// the many connections the other tests open, and the server cannot come
/// back on the port its clients know. Drop it right before the server
/// binds the port again.
pub struct HeldPort {
    _socket: tokio::net::TcpSocket,
}

impl HeldPort {
    /// Hold `address`'s port (SO_REUSEADDR, so that the stopped server's
    /// TIME_WAIT sockets do not refuse it, and so that the server binds it
    /// again once this is dropped).
    pub fn hold(address: std::net::SocketAddr) -> anyhow::Result<Self> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket
            .bind(address)
            .with_context(|| format!("hold {address} while its server is stopped"))?;
        Ok(HeldPort { _socket: socket })
    }
}

/// Starts of a server whose port was taken before it bound it.
pub const PORT_ATTEMPTS: u32 = 5;

/// Whether a server failed to start because the port [`free_port`] found
/// was taken before it bound it (the server exited saying so).
pub fn lost_its_port(error: &anyhow::Error) -> bool {
    let text = format!("{error:#}");
    text.contains("already in use") && text.contains("before it was ready")
}

/// One running (or stopped) MinIO server.
pub struct MinioServer {
    binary: PathBuf,
    data_dir: TempDir,
    log_dir: TempDir,
    /// The local address it listens on.
    address: Ipv4Addr,
    port: u16,
    child: Option<Child>,
    /// While stopped: its port, kept for its restart.
    held_port: Option<HeldPort>,
    starts: u32,
    /// With TLS: the directory MinIO reads `public.crt`/`private.key` from,
    /// and the CA's PEM file.
    tls: Option<(TempDir, PathBuf)>,
}

/// A throwaway CA and a server certificate it issued for 127.0.0.1 and
/// localhost, with the server's key.
pub struct TestCertificates {
    /// The CA's certificate (PEM), for the client's CA bundle.
    pub ca_pem: String,
    /// The server's certificate.
    pub server: rcgen::Certificate,
    /// The server's key.
    pub server_key: rcgen::KeyPair,
}

impl TestCertificates {
    pub fn new() -> anyhow::Result<Self> {
        use rcgen::{CertificateParams, KeyPair};
        let ca = super::test_ca("haulage test CA")?;
        let server_key = KeyPair::generate()?;
        let server_params =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
        let server = server_params.signed_by(&server_key, &ca)?;
        Ok(TestCertificates {
            ca_pem: ca.pem(),
            server,
            server_key,
        })
    }
}

/// Write [`TestCertificates`] where MinIO reads them (`public.crt`,
/// `private.key` in `certs_dir`); returns the CA's PEM file.
fn write_test_certificates(certs_dir: &Path) -> anyhow::Result<PathBuf> {
    let certificates = TestCertificates::new()?;
    std::fs::write(certs_dir.join("public.crt"), certificates.server.pem())?;
    std::fs::write(
        certs_dir.join("private.key"),
        certificates.server_key.serialize_pem(),
    )?;
    let ca_path = certs_dir.join("test-ca.pem");
    std::fs::write(&ca_path, certificates.ca_pem)?;
    Ok(ca_path)
}

impl MinioServer {
    /// Start a server on a free port with an empty data directory and wait
    /// until it is ready.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(false, Ipv4Addr::LOCALHOST).await
    }

    /// Like [`MinioServer::start`], listening on `address` (an address of
    /// this machine) instead of 127.0.0.1.
    pub async fn start_on(address: Ipv4Addr) -> anyhow::Result<Self> {
        Self::start_with(false, address).await
    }

    /// Like [`MinioServer::start`], serving HTTPS with a certificate from a
    /// throwaway CA ([`MinioServer::ca_bundle`]).
    pub async fn start_tls() -> anyhow::Result<Self> {
        Self::start_with(true, Ipv4Addr::LOCALHOST).await
    }

    async fn start_with(tls: bool, address: Ipv4Addr) -> anyhow::Result<Self> {
        let tls = if tls {
            let certs_dir = tempfile::Builder::new()
                .prefix("haulage-minio-certs")
                .tempdir()?;
            let ca_path = write_test_certificates(certs_dir.path())?;
            Some((certs_dir, ca_path))
        } else {
            None
        };
        let mut server = MinioServer {
            binary: minio_binary()?,
            data_dir: tempfile::Builder::new()
                .prefix("haulage-minio-data")
                .tempdir()?,
            log_dir: tempfile::Builder::new()
                .prefix("haulage-minio-log")
                .tempdir()?,
            address,
            port: free_port()?,
            child: None,
            held_port: None,
            starts: 0,
            tls,
        };
        // A port found free can be taken by another process before MinIO
        // binds it: then it exits saying so, and is started on another.
        let mut attempts = 0;
        while let Err(error) = server.spawn_and_wait().await {
            attempts += 1;
            if attempts >= PORT_ATTEMPTS || !lost_its_port(&error) {
                return Err(error);
            }
            eprintln!(
                "minio's port {} was taken meanwhile; starting it on another",
                server.port
            );
            server.port = free_port()?;
        }
        Ok(server)
    }

    /// The CA certificate (PEM file) that issued a TLS server's certificate.
    pub fn ca_bundle(&self) -> Option<&Path> {
        self.tls.as_ref().map(|(_, ca_path)| ca_path.as_path())
    }

    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        self.held_port = None;
        self.starts += 1;
        let log_path = self
            .log_dir
            .path()
            .join(format!("minio-{}.log", self.starts));
        let log = File::create(&log_path)?;
        let mut command = Command::new(&self.binary);
        command.arg("server");
        if let Some((certs_dir, _)) = &self.tls {
            command.arg("--certs-dir").arg(certs_dir.path());
        }
        let child = command
            .arg("--quiet")
            .arg("--address")
            .arg(format!("{}:{}", self.address, self.port))
            .arg("--console-address")
            .arg(format!("{}:{}", self.address, free_port()?))
            .arg(self.data_dir.path())
            .env("MINIO_ROOT_USER", ACCESS_KEY)
            .env("MINIO_ROOT_PASSWORD", SECRET_KEY)
            .env("MINIO_BROWSER", "off")
            .env("MINIO_UPDATE", "off")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.binary.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                bail!(
                    "minio exited with {status} before it was ready; its log:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            if self.is_ready().await {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                bail!(
                    "minio was not ready within {READY_TIMEOUT:?}; its log:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn is_ready(&self) -> bool {
        if self.tls.is_some() {
            // Same readiness, asked over TLS through the SDK.
            return matches!(
                tokio::time::timeout(
                    Duration::from_secs(2),
                    self.admin_client().list_buckets().send()
                )
                .await,
                Ok(Ok(_))
            );
        }
        let probe = async {
            let mut stream = tokio::net::TcpStream::connect((self.address, self.port)).await?;
            stream
                .write_all(
                    b"GET /minio/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                )
                .await?;
            let mut response = Vec::new();
            stream.read_to_end(&mut response).await?;
            Ok::<_, std::io::Error>(response.starts_with(b"HTTP/1.1 200"))
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(2), probe).await,
            Ok(Ok(true))
        )
    }

    /// Kill the server (SIGKILL to its own PID) and wait for it; the data
    /// directory stays for [`MinioServer::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            self.held_port = HeldPort::hold((self.address, self.port).into())
                .map_err(|error| {
                    eprintln!("MinIO's port may be taken while it is stopped: {error:#}")
                })
                .ok();
        }
    }

    /// Start the stopped server again on the same port and data directory.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.spawn_and_wait().await
    }

    /// The port the server listens on.
    /// The directory MinIO keeps its objects in (to grep raw bytes).
    pub fn data_dir(&self) -> &Path {
        self.data_dir.path()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://ADDRESS:PORT` (ADDRESS 127.0.0.1 unless started with
    /// [`MinioServer::start_on`]), or `https://` with TLS.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.address, self.port)
    }

    /// The root credentials.
    pub fn credentials(&self) -> S3Credentials {
        S3Credentials {
            access_key_id: ACCESS_KEY.to_string(),
            secret_access_key: SECRET_KEY.to_string(),
            session_token: None,
        }
    }

    /// S3 options for this server at `endpoint` (the server's own, or a proxy's).
    pub fn s3_options_via(&self, endpoint: &str) -> S3Options {
        S3Options {
            endpoint: Some(endpoint.to_string()),
            region: Some(REGION.to_string()),
            credentials: Some(self.credentials()),
            ..S3Options::default()
        }
    }

    /// S3 options for this server, direct.
    pub fn s3_options(&self) -> S3Options {
        self.s3_options_via(&self.endpoint())
    }

    /// Store options for this server with retries off, so a test sees each
    /// request's own outcome.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            s3: self.s3_options(),
            retry: Some(RetryPolicy {
                max_attempts: 1,
                ..RetryPolicy::default()
            }),
            ..StoreOptions::default()
        }
    }

    /// A plain SDK client for setting up and inspecting the server behind
    /// the store's back (bucket creation, multipart listings).
    pub fn admin_client(&self) -> aws_sdk_s3::Client {
        let http_client = match self.ca_bundle().map(std::fs::read) {
            None => aws_smithy_http_client::Builder::new().build_http(),
            Some(ca_pem) => {
                use aws_smithy_http_client::tls::{
                    self, TlsContext, TrustStore, rustls_provider::CryptoMode,
                };
                let trust = TrustStore::empty().with_pem_certificate(ca_pem.unwrap_or_default());
                let context = TlsContext::builder()
                    .with_trust_store(trust)
                    .build()
                    .unwrap_or_default();
                aws_smithy_http_client::Builder::new()
                    .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
                    .tls_context(context)
                    .build_https()
            }
        };
        let config = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(self.endpoint())
            .region(Region::new(REGION))
            .credentials_provider(Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"))
            .force_path_style(true)
            .http_client(http_client)
            .build();
        aws_sdk_s3::Client::from_conf(config)
    }

    /// Create `bucket`. MinIO can report ready before its object layer is
    /// (`XMinioServerNotInitialized`, seen once in a CI run): that answer
    /// is retried until [`READY_TIMEOUT`].
    pub async fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + READY_TIMEOUT;
        loop {
            let result = self
                .admin_client()
                .create_bucket()
                .bucket(bucket)
                .send()
                .await;
            match result {
                Err(error)
                    if std::time::Instant::now() < deadline
                        && format!("{error:?}").contains("XMinioServerNotInitialized") =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                result => {
                    result.with_context(|| format!("create bucket {bucket}"))?;
                    return Ok(());
                }
            }
        }
    }

    /// Start a multipart upload of `key` in `bucket`, send one part and never
    /// complete it: what a writer killed in the middle of a pack leaves.
    pub async fn leave_unfinished_upload(&self, bucket: &str, key: &str) -> anyhow::Result<()> {
        let admin = self.admin_client();
        let created = admin
            .create_multipart_upload()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .context("create multipart upload")?;
        admin
            .upload_part()
            .bucket(bucket)
            .key(key)
            .upload_id(created.upload_id().context("no upload id")?)
            .part_number(1)
            .body(vec![7u8; 1024].into())
            .send()
            .await
            .context("upload part")?;
        Ok(())
    }

    /// Every incomplete multipart upload in `bucket` whose key starts with
    /// `prefix`, as (key, upload id). Lists the whole bucket and filters here,
    /// because MinIO's prefixed listing only matches exact keys.
    pub async fn multipart_uploads(
        &self,
        bucket: &str,
        prefix: &str,
    ) -> anyhow::Result<Vec<(String, String)>> {
        let output = self
            .admin_client()
            .list_multipart_uploads()
            .bucket(bucket)
            .send()
            .await
            .context("list multipart uploads")?;
        if output.is_truncated() == Some(true) {
            bail!("more multipart uploads than one page; the tests never make that many");
        }
        Ok(output
            .uploads()
            .iter()
            .filter_map(|upload| Some((upload.key()?.to_string(), upload.upload_id()?.to_string())))
            .filter(|(key, _)| key.starts_with(prefix))
            .collect())
    }
}

impl Drop for MinioServer {
    fn drop(&mut self) {
        self.stop();
    }
}
