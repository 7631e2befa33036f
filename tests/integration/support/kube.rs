//! A real Kubernetes control plane for one test: etcd and kube-apiserver
//! from the binaries `tests/infra/build.sh etcd` and `tests/infra/build.sh
//! kube` build, on 127.0.0.1 on free ports, with everything (certificates,
//! tokens, etcd data, logs, kubeconfig) in a temporary directory. Both
//! processes are killed by their own PIDs when the handle drops.
//!
//! What runs is what `tests/infra/start-kube.sh` runs (docs/test-infra.md):
//! TLS with a throwaway CA, a static token file with an admin user in
//! `system:masters` and an unprivileged user, a service-account signing
//! key, RBAC authorization. No scheduler, controller-manager or kubelet: pods
//! stay Pending, no garbage collection, no default ServiceAccounts.
//!
//! Cost: about 3 s from start to `/readyz` (measured 2–4 s; longer on a
//! loaded machine), ~300 MB of memory and ~120 MB of etcd data per cluster.
//! Tests that can share a cluster should, e.g. one cluster per test
//! function covering several checks of one area.
//!
//! Binaries: `$HAULAGE_ETCD_BIN`, `$HAULAGE_KUBE_APISERVER_BIN` and
//! `$HAULAGE_KUBECTL_BIN`, or the newest
//! `${HAULAGE_INFRA_CACHE:-$HOME/.cache/haulage-infra}/{etcd,kube}-*/bin/*`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::audit;
use super::minio::{PORT_ATTEMPTS, free_port, lost_its_port};

/// The repository's `manifests/`: what a user applies with
/// `kubectl apply -k` (CRDs, RBAC, the controller's Deployment, examples).
pub fn manifests() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("manifests")
}

/// The CRDs `manifests/` installs.
pub const HAULAGE_CRDS: [&str; 5] = [
    "crd/backupstoragelocations.haulage.dev",
    "crd/storagepolicies.haulage.dev",
    "crd/volumebackups.haulage.dev",
    "crd/volumerestores.haulage.dev",
    "crd/volumetransfers.haulage.dev",
];

/// User name of the admin token (group `system:masters`, bypasses RBAC).
pub const ADMIN_USER: &str = "haulage-admin";
/// User name of the unprivileged token (no groups beyond
/// `system:authenticated`; RBAC applies).
pub const UNPRIVILEGED_USER: &str = "haulage-user";
/// Kubeconfig context of the admin user (the current context).
pub const ADMIN_CONTEXT: &str = "haulage-admin";
/// Kubeconfig context of the unprivileged user.
pub const UNPRIVILEGED_CONTEXT: &str = "haulage-user";
/// How long etcd and the apiserver may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Issuer and audience of service-account tokens.
const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// The three binaries a cluster needs.
#[derive(Debug, Clone)]
pub struct KubeBinaries {
    /// `etcd`.
    pub etcd: PathBuf,
    /// `kube-apiserver`.
    pub kube_apiserver: PathBuf,
    /// `kubectl`.
    pub kubectl: PathBuf,
}

fn infra_cache() -> anyhow::Result<PathBuf> {
    Ok(match std::env::var_os("HAULAGE_INFRA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").context("HOME is not set")?;
            Path::new(&home).join(".cache/haulage-infra")
        }
    })
}

/// `$env` if set, else the newest `CACHE/prefix-*/bin/name`.
fn infra_binary(env: &str, prefix: &str, name: &str, component: &str) -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        bail!("{env}={} is not a file", path.display());
    }
    let cache = infra_cache()?;
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(&cache)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .starts_with(&format!("{prefix}-"))
        })
        .map(|entry| entry.path().join("bin").join(name))
        .filter(|path| path.is_file())
        .collect();
    candidates.sort();
    candidates.pop().with_context(|| {
        format!(
            "no {name} binary under {}/{prefix}-*/bin/: run `tests/infra/build.sh etcd && tests/infra/build.sh kube` first \
             (or set {env} to the path of a {name} binary built by `build.sh {component}`)",
            cache.display()
        )
    })
}

impl KubeBinaries {
    /// Find the binaries, or say how to build them.
    pub fn find() -> anyhow::Result<Self> {
        Ok(KubeBinaries {
            etcd: infra_binary("HAULAGE_ETCD_BIN", "etcd", "etcd", "etcd")?,
            kube_apiserver: infra_binary(
                "HAULAGE_KUBE_APISERVER_BIN",
                "kube",
                "kube-apiserver",
                "kube",
            )?,
            kubectl: infra_binary("HAULAGE_KUBECTL_BIN", "kube", "kubectl", "kube")?,
        })
    }
}

/// A running etcd + kube-apiserver.
pub struct KubeCluster {
    binaries: KubeBinaries,
    dir: TempDir,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    server: String,
    kubeconfig: PathBuf,
    /// The CA certificate the apiserver's certificate is signed with.
    ca_pem: String,
    /// Where the audit log goes, when the cluster was started audited.
    audit_log: Option<PathBuf>,
    /// How the running apiserver was started, to start it again
    /// ([`KubeCluster::restart_apiserver`]): its port, etcd's, the PKI and
    /// the token file.
    apiserver_start: Option<(u16, u16, Pki, PathBuf)>,
    /// The server address and admin kubeconfig given to the product's
    /// processes (controllers, agents) when they go through a proxy
    /// ([`KubeCluster::route_processes_through`]).
    routed: Option<(String, PathBuf)>,
    /// While the apiserver is stopped: its port, kept for its restart.
    held_port: Option<super::minio::HeldPort>,
}

/// Files of the throwaway PKI.
#[derive(Clone)]
struct Pki {
    ca_pem: String,
    server_cert: PathBuf,
    server_key: PathBuf,
    service_account_key: PathBuf,
    service_account_public_key: PathBuf,
}

fn write_pki(dir: &Path) -> anyhow::Result<Pki> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, SanType};
    std::fs::create_dir_all(dir)?;
    let ca = super::test_ca("haulage test cluster CA")?;
    let server_key = KeyPair::generate()?;
    let mut server_params = CertificateParams::new(vec![
        "localhost".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
    ])?;
    server_params
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    server_params
        .subject_alt_names
        .push(SanType::IpAddress([10, 0, 0, 1].into()));
    server_params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = server_params.signed_by(&server_key, &ca)?;
    // ECDSA P-256 (ES256) signs service-account tokens as well as RSA does.
    let service_account = KeyPair::generate()?;
    let pki = Pki {
        ca_pem: ca.pem(),
        server_cert: dir.join("apiserver.crt"),
        server_key: dir.join("apiserver.key"),
        service_account_key: dir.join("sa.key"),
        service_account_public_key: dir.join("sa.pub"),
    };
    std::fs::write(dir.join("ca.crt"), &pki.ca_pem)?;
    std::fs::write(&pki.server_cert, server_cert.pem())?;
    std::fs::write(&pki.server_key, server_key.serialize_pem())?;
    std::fs::write(&pki.service_account_key, service_account.serialize_pem())?;
    std::fs::write(
        &pki.service_account_public_key,
        service_account.public_key_pem(),
    )?;
    Ok(pki)
}

fn random_token() -> String {
    use rand::RngCore;
    let mut bytes = [0_u8; 24];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

fn kubeconfig_yaml(server: &str, ca_pem: &str, admin_token: &str, user_token: &str) -> String {
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: haulage-test\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
         users:\n- name: {ADMIN_USER}\n  user:\n    token: {admin_token}\n- name: {UNPRIVILEGED_USER}\n  user:\n    token: {user_token}\n\
         contexts:\n- name: {ADMIN_CONTEXT}\n  context:\n    cluster: haulage-test\n    user: {ADMIN_USER}\n\
         - name: {UNPRIVILEGED_CONTEXT}\n  context:\n    cluster: haulage-test\n    user: {UNPRIVILEGED_USER}\n\
         current-context: {ADMIN_CONTEXT}\n"
    )
}

/// The last lines of a log file, for failure messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// `GET http://127.0.0.1:port/health` answers `"health":"true"`.
async fn etcd_healthy(port: u16) -> bool {
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&response).contains("\"health\":\"true\""))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), probe).await,
        Ok(Ok(true))
    )
}

/// Fail with the process's log when it has exited.
fn check_running(child: &mut Option<Child>, what: &str, log: &Path) -> anyhow::Result<()> {
    if let Some(process) = child.as_mut()
        && let Some(status) = process.try_wait()?
    {
        *child = None;
        bail!(
            "{what} exited with {status} before it was ready; the end of its log:\n{}",
            log_tail(log)
        );
    }
    Ok(())
}

impl KubeCluster {
    /// Start etcd and kube-apiserver and wait until `/readyz` says `ok`
    /// (by then the RBAC bootstrap roles exist).
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with_audit(false).await
    }

    /// Two independent clusters (each its own etcd, apiserver, PKI,
    /// tokens and ports), started side by side: the source and the
    /// destination of a migration.
    pub async fn start_two() -> anyhow::Result<(Self, Self)> {
        let (first, second) = tokio::join!(Self::start(), Self::start());
        Ok((first?, second?))
    }

    /// Like [`KubeCluster::start`], with the apiserver writing an audit log
    /// of every request (policy [`audit::POLICY`], blocking mode, so a
    /// request is in the log before its response is sent); read it with
    /// [`KubeCluster::audit_requests`]. Only for measurements: the log
    /// costs the apiserver a write per request.
    pub async fn start_audited() -> anyhow::Result<Self> {
        Self::start_with_audit(true).await
    }

    async fn start_with_audit(audit: bool) -> anyhow::Result<Self> {
        let binaries = KubeBinaries::find()?;
        let dir = tempfile::Builder::new().prefix("haulage-kube").tempdir()?;
        let pki = write_pki(&dir.path().join("pki"))?;
        let admin_token = random_token();
        let user_token = random_token();
        let tokens = dir.path().join("pki/tokens.csv");
        // token,user,uid,"groups"
        std::fs::write(
            &tokens,
            format!(
                "{admin_token},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n\
                 {user_token},{UNPRIVILEGED_USER},{UNPRIVILEGED_USER}\n"
            ),
        )?;

        let etcd_port = free_port()?;
        let mut peer_port = free_port()?;
        while peer_port == etcd_port {
            peer_port = free_port()?;
        }
        let api_port = loop {
            let port = free_port()?;
            if port != etcd_port && port != peer_port {
                break port;
            }
        };
        let server = format!("https://127.0.0.1:{api_port}");
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_yaml(&server, &pki.ca_pem, &admin_token, &user_token),
        )?;
        let mut cluster = KubeCluster {
            binaries,
            etcd: None,
            apiserver: None,
            server,
            kubeconfig,
            ca_pem: pki.ca_pem.clone(),
            audit_log: None,
            apiserver_start: None,
            routed: None,
            held_port: None,
            dir,
        };
        if audit {
            let policy = cluster.dir.path().join("audit-policy.yaml");
            std::fs::write(&policy, audit::POLICY)?;
            cluster.audit_log = Some(cluster.dir.path().join("audit.log"));
        }
        let started = Instant::now();
        // A port found free can be taken by another process before the
        // server binds it (the other tests start servers all the time):
        // then the server exits saying so, and is started again on another.
        let (mut etcd_port, mut peer_port) = (etcd_port, peer_port);
        let mut attempts = 0;
        while let Err(error) = cluster.start_etcd(etcd_port, peer_port).await {
            attempts += 1;
            if attempts >= PORT_ATTEMPTS || !lost_its_port(&error) {
                return Err(error);
            }
            eprintln!("etcd's port was taken meanwhile; starting it on others");
            let _ = std::fs::remove_dir_all(cluster.dir.path().join("etcd-data"));
            (etcd_port, peer_port) = (free_port()?, free_port()?);
        }
        let mut api_port = api_port;
        let mut attempts = 0;
        while let Err(error) = cluster
            .start_apiserver(api_port, etcd_port, &pki, &tokens)
            .await
        {
            attempts += 1;
            if attempts >= PORT_ATTEMPTS || !lost_its_port(&error) {
                return Err(error);
            }
            eprintln!(
                "kube-apiserver's port {api_port} was taken meanwhile; starting it on another"
            );
            api_port = free_port()?;
            cluster.server = format!("https://127.0.0.1:{api_port}");
            std::fs::write(
                &cluster.kubeconfig,
                kubeconfig_yaml(&cluster.server, &pki.ca_pem, &admin_token, &user_token),
            )?;
        }
        cluster.apiserver_start = Some((api_port, etcd_port, pki.clone(), tokens.clone()));
        eprintln!(
            "kube-apiserver ready at {} after {:.1}s",
            cluster.server,
            started.elapsed().as_secs_f64()
        );
        Ok(cluster)
    }

    async fn start_etcd(&mut self, port: u16, peer_port: u16) -> anyhow::Result<()> {
        let log_path = self.dir.path().join("etcd.log");
        let log = File::create(&log_path)?;
        let client_url = format!("http://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let child = Command::new(&self.binaries.etcd)
            .arg("--name=haulage")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("etcd-data").display()
            ))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=haulage={peer_url}"))
            .arg("--unsafe-no-fsync")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.binaries.etcd.display()))?;
        self.etcd = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            check_running(&mut self.etcd, "etcd", &log_path)?;
            if etcd_healthy(port).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd was not healthy within {READY_TIMEOUT:?}; the end of its log:\n{}",
                    log_tail(&log_path)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn start_apiserver(
        &mut self,
        port: u16,
        etcd_port: u16,
        pki: &Pki,
        tokens: &Path,
    ) -> anyhow::Result<()> {
        self.held_port = None;
        let log_path = self.dir.path().join("kube-apiserver.log");
        // Appended to: a restarted apiserver keeps the earlier log.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let child = Command::new(&self.binaries.kube_apiserver)
            .arg(format!("--etcd-servers=http://127.0.0.1:{etcd_port}"))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={port}"))
            .arg(format!("--tls-cert-file={}", pki.server_cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                pki.server_key.display()
            ))
            .arg(format!("--token-auth-file={}", tokens.display()))
            .arg("--authorization-mode=RBAC")
            .arg(format!("--service-account-issuer={SERVICE_ACCOUNT_ISSUER}"))
            .arg(format!(
                "--service-account-key-file={}",
                pki.service_account_public_key.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.service_account_key.display()
            ))
            .arg(format!("--api-audiences={SERVICE_ACCOUNT_ISSUER}"))
            .arg("--service-cluster-ip-range=10.0.0.0/24")
            .arg("--allow-privileged=true")
            // No controller-manager creates `default` ServiceAccounts.
            .arg("--disable-admission-plugins=ServiceAccount")
            .args(self.audit_log.iter().flat_map(|log| {
                [
                    format!(
                        "--audit-policy-file={}",
                        self.dir.path().join("audit-policy.yaml").display()
                    ),
                    format!("--audit-log-path={}", log.display()),
                    "--audit-log-format=json".to_string(),
                    "--audit-log-mode=blocking".to_string(),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.binaries.kube_apiserver.display()))?;
        self.apiserver = Some(child);
        let client = self.client().await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            check_running(&mut self.apiserver, "kube-apiserver", &log_path)?;
            let request = http::Request::get("/readyz").body(Vec::new())?;
            let ready = tokio::time::timeout(Duration::from_secs(5), client.request_text(request));
            if let Ok(Ok(body)) = ready.await
                && body.trim() == "ok"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver was not ready within {READY_TIMEOUT:?}; the end of its log:\n{}",
                    log_tail(&log_path)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn client_for(&self, context: &str) -> anyhow::Result<kube::Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("read {}", self.kubeconfig.display()))?;
        let options = KubeConfigOptions {
            context: Some(context.to_string()),
            ..KubeConfigOptions::default()
        };
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .context("kubeconfig to client config")?;
        kube::Client::try_from(config).context("build kube client")
    }

    /// A client with the admin token (`system:masters`). Make one per test:
    /// a client belongs to the async runtime it was made on.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        self.client_for(ADMIN_CONTEXT).await
    }

    /// A client with the unprivileged token, subject to RBAC.
    pub async fn unprivileged_client(&self) -> anyhow::Result<kube::Client> {
        self.client_for(UNPRIVILEGED_CONTEXT).await
    }

    /// The kubeconfig file (admin is the current context; the unprivileged
    /// user is context [`UNPRIVILEGED_CONTEXT`]).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A `kubectl` command already pointed at this cluster as the admin.
    pub fn kubectl(&self) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.binaries.kubectl);
        command
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// Install haulage as a user would, `kubectl apply -k manifests/`, and
    /// wait until its CRDs ([`HAULAGE_CRDS`]) are Established; a failed
    /// apply carries the end of the apiserver's log.
    pub async fn install_manifests(&self) -> anyhow::Result<()> {
        self.kubectl_ok(&["apply", "-k", &manifests().to_string_lossy()], None)
            .await
            .with_context(|| {
                format!(
                    "kubectl apply -k manifests/; the end of the apiserver's log:\n{}",
                    self.apiserver_log_tail()
                )
            })?;
        self.wait_for_crds(&HAULAGE_CRDS).await
    }

    /// Wait until `crds` are Established. `kubectl wait` right after the
    /// CRDs were created can fail with ".status.conditions accessor error"
    /// before the API server wrote any condition; that is retried.
    pub async fn wait_for_crds(&self, crds: &[&str]) -> anyhow::Result<()> {
        let mut arguments = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        arguments.extend(crds.iter().copied());
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.kubectl_ok(&arguments, None).await {
                Ok(_) => return Ok(()),
                Err(error) if attempt < 5 && format!("{error:#}").contains("accessor error") => {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Run kubectl with `args` (and `stdin`, if given) and return its output,
    /// whatever the exit status.
    pub async fn kubectl_output(
        &self,
        args: &[&str],
        stdin: Option<&str>,
    ) -> anyhow::Result<Output> {
        let mut command = self.kubectl();
        command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if stdin.is_some() {
            command.stdin(Stdio::piped());
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("start kubectl {}", args.join(" ")))?;
        if let Some(input) = stdin
            && let Some(mut pipe) = child.stdin.take()
        {
            pipe.write_all(input.as_bytes()).await?;
            drop(pipe);
        }
        let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
            .await
            .with_context(|| format!("kubectl {} timed out", args.join(" ")))??;
        Ok(output)
    }

    /// Run kubectl and return its stdout; fail with its stderr when it fails.
    pub async fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        let output = self.kubectl_output(args, stdin).await?;
        super::stdout_of_success(&output, &format!("kubectl {}", args.join(" ")))
    }

    /// Kill the kube-apiserver (etcd keeps running), as an outage a
    /// client sees as refused connections.
    pub fn stop_apiserver(&mut self) {
        if let Some(mut apiserver) = self.apiserver.take() {
            let _ = apiserver.kill();
            let _ = apiserver.wait();
            self.held_port = self
                .apiserver_address()
                .and_then(super::minio::HeldPort::hold)
                .map_err(|error| {
                    eprintln!("kube-apiserver's port may be taken while it is stopped: {error:#}")
                })
                .ok();
        }
    }

    /// Kill the kube-apiserver and start it again on the same port, with
    /// the same etcd, PKI and tokens, as a restart of the control plane
    /// does; returns once it is ready. Clients see refused connections
    /// meanwhile, and their watches end.
    pub async fn restart_apiserver(&mut self) -> anyhow::Result<()> {
        self.restart_apiserver_after(Duration::ZERO).await
    }

    /// [`Self::restart_apiserver`], the apiserver staying away for `down`
    /// before it starts again: an outage of the control plane.
    pub async fn restart_apiserver_after(&mut self, down: Duration) -> anyhow::Result<()> {
        let (api_port, etcd_port, pki, tokens) = self
            .apiserver_start
            .clone()
            .context("the apiserver was never started")?;
        self.stop_apiserver();
        tokio::time::sleep(down).await;
        self.start_apiserver(api_port, etcd_port, &pki, &tokens)
            .await
    }

    /// Every request the apiserver has answered so far, from its audit log
    /// (fails unless started with [`KubeCluster::start_audited`]).
    pub fn audit_requests(&self) -> anyhow::Result<Vec<audit::Request>> {
        let log = self
            .audit_log
            .as_ref()
            .context("the cluster was not started with an audit log (start_audited)")?;
        audit::read(log)
    }

    /// Where the apiserver listens.
    pub fn apiserver_address(&self) -> anyhow::Result<std::net::SocketAddr> {
        let (api_port, ..) = self
            .apiserver_start
            .as_ref()
            .context("the apiserver was never started")?;
        Ok(([127, 0, 0, 1], *api_port).into())
    }

    /// Give the product's processes (the controllers and agents whose
    /// kubeconfigs this cluster writes, [`Self::service_account_kubeconfig`]
    /// and [`Self::processes_kubeconfig`]) the address `proxy` (a TCP proxy
    /// to [`Self::apiserver_address`]) instead of the apiserver's; the
    /// test's own clients keep the direct one, so what the proxy sees is
    /// the product's traffic alone.
    pub fn route_processes_through(&mut self, proxy: std::net::SocketAddr) -> anyhow::Result<()> {
        let routed = format!("https://{proxy}");
        let text = std::fs::read_to_string(&self.kubeconfig)?.replace(&self.server, &routed);
        let path = self.dir.path().join("routed.kubeconfig");
        std::fs::write(&path, text)?;
        self.routed = Some((routed, path));
        Ok(())
    }

    /// The admin kubeconfig with the address the product's processes are
    /// given (the proxy's when routed, else the apiserver's): for the
    /// kubelet stand-in, which hands it on to the agents.
    pub fn processes_kubeconfig(&self) -> &Path {
        self.routed
            .as_ref()
            .map_or(&self.kubeconfig, |(_, path)| path)
    }

    /// Write a kubeconfig at `path` holding a TokenRequest token (one
    /// hour) of the service account `namespace/account`, for a process
    /// that should run with that account's RBAC (through the proxy when
    /// routed, [`Self::route_processes_through`]).
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        account: &str,
        path: &Path,
    ) -> anyhow::Result<PathBuf> {
        let server = self
            .routed
            .as_ref()
            .map_or(&self.server, |(server, _)| server);
        service_account_kubeconfig(
            &self.client().await?,
            server,
            &self.ca_pem,
            namespace,
            account,
            path,
        )
        .await
    }

    /// This cluster's admin entries for a kubeconfig holding several
    /// clusters: (cluster, user, context) YAML values, all named `name`.
    fn admin_entries(&self, name: &str) -> anyhow::Result<[serde_yaml::Value; 3]> {
        let config: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&self.kubeconfig)?)?;
        let cluster = config["clusters"][0]["cluster"].clone();
        let user = config["users"]
            .as_sequence()
            .and_then(|users| users.iter().find(|user| user["name"] == ADMIN_USER))
            .context("the kubeconfig has no admin user")?["user"]
            .clone();
        let entry = |key: &str, value: serde_yaml::Value| {
            let mut map = serde_yaml::Mapping::new();
            map.insert("name".into(), name.into());
            map.insert(key.into(), value);
            serde_yaml::Value::Mapping(map)
        };
        let mut context = serde_yaml::Mapping::new();
        context.insert("cluster".into(), name.into());
        context.insert("user".into(), name.into());
        Ok([
            entry("cluster", cluster),
            entry("user", user),
            entry("context", serde_yaml::Value::Mapping(context)),
        ])
    }

    /// The apiserver's log so far, for a failing test's message.
    pub fn apiserver_log_tail(&self) -> String {
        log_tail(&self.dir.path().join("kube-apiserver.log"))
    }
}

/// Write one kubeconfig at `path` with the admin context of each cluster
/// under its name (`kubectl --context NAME`), as a user with access to
/// several clusters has; the first one is the current context.
pub fn write_kubeconfig_of(clusters: &[(&str, &KubeCluster)], path: &Path) -> anyhow::Result<()> {
    let mut entries = [Vec::new(), Vec::new(), Vec::new()];
    for (name, cluster) in clusters {
        for (list, entry) in entries.iter_mut().zip(cluster.admin_entries(name)?) {
            list.push(entry);
        }
    }
    let [cluster_entries, user_entries, context_entries] = entries;
    let mut config = serde_yaml::Mapping::new();
    config.insert("apiVersion".into(), "v1".into());
    config.insert("kind".into(), "Config".into());
    config.insert("clusters".into(), cluster_entries.into());
    config.insert("users".into(), user_entries.into());
    config.insert("contexts".into(), context_entries.into());
    if let Some((first, _)) = clusters.first() {
        config.insert("current-context".into(), (*first).into());
    }
    std::fs::write(path, serde_yaml::to_string(&config)?)?;
    Ok(())
}

/// Write a kubeconfig at `path` for `server` (whose certificate `ca_pem`
/// signs) holding a TokenRequest token of the service account
/// `namespace/account`, requested with `client`.
pub async fn service_account_kubeconfig(
    client: &kube::Client,
    server: &str,
    ca_pem: &str,
    namespace: &str,
    account: &str,
    path: &Path,
) -> anyhow::Result<PathBuf> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let accounts: kube::Api<ServiceAccount> = kube::Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![SERVICE_ACCOUNT_ISSUER.to_string()],
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    let response: TokenRequest = accounts
        .create_subresource(
            "token",
            account,
            &kube::api::PostParams::default(),
            &request,
        )
        .await
        .map_err(|error| anyhow::anyhow!("TokenRequest for {namespace}/{account}: {error:?}"))?;
    let token = response
        .status
        .context("TokenRequest without status")?
        .token;
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
             users:\n- name: account\n  user:\n    token: {token}\n\
             contexts:\n- name: account\n  context:\n    cluster: c\n    user: account\n    namespace: {namespace}\n\
             current-context: account\n"
        ),
    )?;
    Ok(path.to_path_buf())
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        // The apiserver first, so it does not spend its last seconds
        // retrying a vanished etcd.
        for child in [self.apiserver.take(), self.etcd.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
