//! A real one-node Kubernetes cluster, started once per test binary run and
//! shared by the tests that need a real kubelet (`real_node`): etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler, and a node with
//! containerd + runc, the kubelet, kube-proxy and the CNI bridge, in a
//! network namespace of its own — what `tests/infra/start-node.sh` starts
//! (docs/test-infra.md, "A real node"). Before it starts, the images are
//! built from the binaries of this build with `tests/infra/build-images.sh`
//! and imported into the node's containerd, so the manifests run exactly
//! the images a user would build.
//!
//! The node outlives any one test: `start-node.sh --watch PID` stops it
//! and removes its directory once this test process has exited (statics
//! are never dropped). Each test works in namespaces of its own and
//! removes them; the haulage install (`kubectl apply -k`) is shared too
//! ([`RealNode::install_haulage`]).
//!
//! Needs root, Debian's containerd, runc, containernetworking-plugins,
//! iptables and buildah (`.ci/run` installs them) and
//! `tests/infra/build.sh kube node`. The image binaries are the ones next
//! to the test binary (`target/debug`), or `$HAULAGE_IMAGE_BIN_DIR` (e.g.
//! `target/release`, for a measurement).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::io::AsyncWriteExt;

/// A running node (see the module documentation).
pub struct RealNode {
    /// Where start-node.sh keeps everything (removed after the test run).
    pub dir: PathBuf,
    kubeconfig: PathBuf,
    kubectl: PathBuf,
    /// The node's name (also its `kubernetes.io/hostname` label).
    pub node_name: String,
    /// The host's side of the node's network: where kube-apiserver listens
    /// and where a server must listen for pods to reach it.
    pub host_ip: Ipv4Addr,
    /// A directory for the local PersistentVolumes' data.
    pub volumes: PathBuf,
    /// The StorageClass of local PersistentVolumes (no provisioner,
    /// `Immediate` binding), created with the node.
    pub storage_class: String,
    containerd_socket: PathBuf,
    /// The kubelet's cgroupRoot (`/haulage-ID`).
    cgroup_root: String,
    /// The images built and imported: controller, agent.
    pub controller_image: String,
    /// The agent image.
    pub agent_image: String,
    /// The sandbox image, also the image of test workloads that only hold
    /// a volume mounted (its process sleeps until killed).
    pub pause_image: String,
    /// Seconds from the start of start-node.sh to a Ready node.
    pub start_seconds: f64,
    /// `(seconds from kubectl apply -k to Ready controller pods, output)`,
    /// once installed.
    install: tokio::sync::OnceCell<Result<f64, String>>,
}

static NODE: OnceLock<Result<RealNode, String>> = OnceLock::new();

fn repository_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The shared node, started on the first call (about 15 s, plus the image
/// build); every later call gets the same one, or the same start error.
pub async fn shared() -> anyhow::Result<&'static RealNode> {
    let node = tokio::task::spawn_blocking(|| {
        NODE.get_or_init(|| RealNode::start().map_err(|error| format!("{error:#}")))
    })
    .await?;
    match node {
        Ok(node) => Ok(node),
        Err(error) => bail!("the real node did not start: {error}"),
    }
}

/// Run `command`, failing with its output unless it succeeds.
fn run(command: &mut Command, what: &str) -> anyhow::Result<Output> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("start {what}"))?;
    super::stdout_of_success(&output, what)?;
    Ok(output)
}

/// The directory holding both `haulage` and `mover-agent` of this build.
fn image_binaries() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("HAULAGE_IMAGE_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_BIN_EXE_haulage"))
            .parent()
            .context("the haulage binary has no directory")?
            .to_path_buf(),
    };
    for binary in ["haulage", "mover-agent"] {
        if !dir.join(binary).is_file() {
            bail!(
                "{} is missing: run `cargo build -p mover-agent` (or `cargo test --workspace`), \
                 or point HAULAGE_IMAGE_BIN_DIR at a directory with both binaries",
                dir.join(binary).display()
            );
        }
    }
    Ok(dir)
}

impl RealNode {
    fn start() -> anyhow::Result<Self> {
        if !rustix::process::geteuid().is_root() {
            bail!(
                "the real node needs root (containerd, network namespaces, cgroups); \
                 run the tests as root, as .ci/run does"
            );
        }
        let infra = repository_root().join("tests/infra");
        let dir = tempfile::Builder::new()
            .prefix("haulage-node")
            .tempdir()?
            .keep();
        // The images of this build, as a user builds them.
        let built = run(
            Command::new(infra.join("build-images.sh"))
                .arg("--bin-dir")
                .arg(image_binaries()?)
                .arg("--out")
                .arg(dir.join("images")),
            "tests/infra/build-images.sh",
        )?;
        let images: BTreeMap<String, String> = String::from_utf8_lossy(&built.stdout)
            .lines()
            .filter_map(|line| line.split_once(' '))
            .map(|(name, archive)| (name.to_string(), archive.to_string()))
            .collect();
        let image = |repository: &str| {
            images
                .keys()
                .find(|name| name.contains(&format!("/{repository}:")))
                .cloned()
                .with_context(|| format!("build-images.sh built no {repository} image: {images:?}"))
        };
        let controller_image = image("haulage")?;
        let agent_image = image("mover-agent")?;

        let started = Instant::now();
        let mut command = Command::new(infra.join("start-node.sh"));
        command
            .arg(&dir)
            .arg("--watch")
            .arg(std::process::id().to_string());
        for archive in images.values() {
            command.arg("--image").arg(archive);
        }
        let output = run(&mut command, "tests/infra/start-node.sh")?;
        let start_seconds = started.elapsed().as_secs_f64();
        let kubeconfig = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        let environment: BTreeMap<String, String> = std::fs::read_to_string(dir.join("node.env"))?
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect();
        let value = |key: &str| {
            environment
                .get(key)
                .cloned()
                .with_context(|| format!("{key} missing from node.env"))
        };
        let kube_binaries = run(
            Command::new(infra.join("build.sh")).arg("kube"),
            "tests/infra/build.sh kube",
        )?;
        let kubectl = String::from_utf8_lossy(&kube_binaries.stdout)
            .lines()
            .find(|line| line.ends_with("/kubectl"))
            .map(PathBuf::from)
            .context("build.sh kube printed no kubectl")?;
        eprintln!(
            "real node {} ready in {start_seconds:.1}s (host side {}, {})",
            value("NODE_NAME")?,
            value("HOST_IP")?,
            dir.display()
        );
        Ok(RealNode {
            kubeconfig,
            kubectl,
            node_name: value("NODE_NAME")?,
            host_ip: value("HOST_IP")?.parse()?,
            volumes: PathBuf::from(value("VOLUMES")?),
            storage_class: value("STORAGE_CLASS")?,
            containerd_socket: PathBuf::from(value("CONTAINERD_SOCKET")?),
            cgroup_root: value("CGROUP_ROOT")?,
            controller_image,
            agent_image,
            pause_image: "localhost/haulage-test/pause:3.10.1".to_string(),
            start_seconds,
            install: tokio::sync::OnceCell::new(),
            dir,
        })
    }

    /// An admin client. Make one per test: a client belongs to the async
    /// runtime it was made on.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// Run kubectl (as the admin) with `args` and `stdin`; its stdout, or
    /// an error with its output.
    pub async fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        let mut command = tokio::process::Command::new(&self.kubectl);
        command
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().context("start kubectl")?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes()).await?;
        }
        let output = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
            .await
            .with_context(|| format!("kubectl {} timed out", args.join(" ")))??;
        super::stdout_of_success(&output, &format!("kubectl {}", args.join(" ")))
    }

    /// `kubectl apply -k manifests/` as a user installs haulage (the
    /// kustomization names the images this build made), then wait until
    /// every controller pod is Ready; once per test run. Returns the
    /// seconds from the apply to Ready pods.
    pub async fn install_haulage(&self) -> anyhow::Result<f64> {
        let installed = self
            .install
            .get_or_init(|| async {
                let install = async {
                    let started = Instant::now();
                    let manifests = repository_root().join("manifests");
                    self.kubectl_ok(&["apply", "-k", &manifests.to_string_lossy()], None)
                        .await?;
                    self.kubectl_ok(
                        &[
                            "-n",
                            haulage::api::labels::SYSTEM_NAMESPACE,
                            "wait",
                            "--for=condition=Available",
                            "--timeout=170s",
                            "deployment/haulage-controller",
                        ],
                        None,
                    )
                    .await?;
                    self.kubectl_ok(
                        &[
                            "-n",
                            haulage::api::labels::SYSTEM_NAMESPACE,
                            "wait",
                            "--for=condition=Ready",
                            "--timeout=170s",
                            "pod",
                            "-l",
                            "app.kubernetes.io/component=controller",
                        ],
                        None,
                    )
                    .await?;
                    anyhow::Ok(started.elapsed().as_secs_f64())
                };
                install.await.map_err(|error| format!("{error:#}"))
            })
            .await;
        match installed {
            Ok(seconds) => Ok(*seconds),
            Err(error) => bail!("installing haulage with kubectl apply -k failed: {error}"),
        }
    }

    /// The controller pods (with their restarts), the last lines of each
    /// one's log, the node's conditions and the last events (for a failing
    /// test's message).
    pub async fn controller_logs(&self) -> String {
        let pods = self
            .kubectl_ok(
                &[
                    "-n",
                    haulage::api::labels::SYSTEM_NAMESPACE,
                    "get",
                    "pods",
                    "-o",
                    "wide",
                ],
                None,
            )
            .await
            .unwrap_or_else(|error| format!("(no pods: {error:#})"));
        let logs = self
            .kubectl_ok(
                &[
                    "-n",
                    haulage::api::labels::SYSTEM_NAMESPACE,
                    "logs",
                    "-l",
                    "app.kubernetes.io/component=controller",
                    "--tail=60",
                    "--prefix",
                ],
                None,
            )
            .await
            .unwrap_or_else(|error| format!("(no controller logs: {error:#})"));
        // Why a pod ended or waits: the node's conditions and taints
        // (pressure), and the recent events of every namespace (evictions,
        // scheduling failures, kills).
        let node = self
            .kubectl_ok(
                &[
                    "get",
                    "nodes",
                    "-o",
                    "jsonpath={range .items[*]}{.metadata.name}: taints {.spec.taints}; \
                     {range .status.conditions[*]}{.type}={.status} ({.reason}) {end}{end}",
                ],
                None,
            )
            .await
            .unwrap_or_else(|error| format!("(no node: {error:#})"));
        let events = self
            .kubectl_ok(&["get", "events", "-A", "--sort-by=.lastTimestamp"], None)
            .await
            .map(|events| {
                let lines: Vec<&str> = events.lines().collect();
                lines[lines.len().saturating_sub(40)..].join("\n")
            })
            .unwrap_or_else(|error| format!("(no events: {error:#})"));
        format!(
            "{pods}\n{logs}\nnode {node}\nlast events:\n{events}\n(every component's log: {}/*.log)",
            self.dir.display()
        )
    }

    /// Run `ctr` against the node's containerd (namespace `k8s.io`).
    pub fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = run(
            Command::new("ctr")
                .arg("--address")
                .arg(&self.containerd_socket)
                .args(["--namespace", "k8s.io"])
                .args(args),
            &format!("ctr {}", args.join(" ")),
        )?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// SIGKILL the container `container_id` (a pod status's `containerID`,
    /// with or without `containerd://`) from outside, as the kernel's OOM
    /// killer or a crash would end it.
    pub fn kill_container(&self, container_id: &str) -> anyhow::Result<()> {
        let id = container_id.trim_start_matches("containerd://");
        self.ctr(&["tasks", "kill", "--signal", "SIGKILL", id])?;
        Ok(())
    }

    /// The host PID of container `container_id`'s process.
    pub fn container_pid(&self, container_id: &str) -> anyhow::Result<u32> {
        let id = container_id.trim_start_matches("containerd://");
        let tasks = self.ctr(&["tasks", "ls"])?;
        tasks
            .lines()
            .find(|line| line.split_whitespace().next() == Some(id))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|pid| pid.parse().ok())
            .with_context(|| format!("no running task for container {id}:\n{tasks}"))
    }

    /// The memory cgroup (v1) of container `container_id`, while it exists
    /// (the kubelet's cgroupfs layout: ROOT/kubepods[/QOS]/podUID/ID).
    pub fn container_memory_cgroup(&self, container_id: &str) -> Option<PathBuf> {
        let id = container_id.trim_start_matches("containerd://");
        let kubepods = Path::new("/sys/fs/cgroup/memory")
            .join(self.cgroup_root.trim_start_matches('/'))
            .join("kubepods");
        let mut pending = vec![kubepods];
        while let Some(directory) = pending.pop() {
            for entry in std::fs::read_dir(&directory)
                .into_iter()
                .flatten()
                .flatten()
            {
                let path = entry.path();
                if !path.is_dir() {
                    continue;
                }
                if entry.file_name().to_string_lossy() == id {
                    return Some(path);
                }
                pending.push(path);
            }
        }
        None
    }
}

/// Read a number from a cgroup file (`memory.max_usage_in_bytes`, ...).
pub fn cgroup_value(cgroup: &Path, file: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(cgroup.join(file))
        .with_context(|| format!("read {}", cgroup.join(file).display()))?;
    text.trim()
        .parse()
        .with_context(|| format!("{} is not a number: {text:?}", cgroup.join(file).display()))
}
