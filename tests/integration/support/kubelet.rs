//! A kubelet stand-in: registers fake Nodes, watches haulage stage pods
//! pinned to them (`spec.nodeName` or the builder's node-affinity pin),
//! and runs the real `mover-agent` binary as a local process per pod: env
//! from the pod spec (downward API fields resolved), each claim's
//! directory as its mount, the projected credentials Secret written to a
//! file, and a service-account token from the TokenRequest API in a
//! kubeconfig, so the agent's RBAC is the real one. It reports phase, exit
//! code and restarts in the pod status, restarts failed containers
//! (`restartPolicy: OnFailure`), stops a deleted pod's process with SIGTERM
//! and confirms the deletion, and can kill a pod's process on demand. It
//! samples each agent's peak resident memory (`VmHWM`) while it runs.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// Label selecting stage pods (what the builder puts on them).
const STAGE_POD_SELECTOR: &str = "app.kubernetes.io/name=haulage-agent";
/// How often the stand-in looks at pods and processes.
const SYNC_INTERVAL: Duration = Duration::from_millis(300);
/// First delay before a crashed agent is started again; doubled per
/// restart up to [`MAX_RESTART_DELAY`] (the kubelet's 10 s → 5 min
/// CrashLoopBackOff, compressed for tests). Like a kubelet with
/// `restartPolicy: OnFailure`, the stand-in never gives up on its own.
const RESTART_DELAY: Duration = Duration::from_millis(200);
/// Longest delay between restarts.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(3);
/// How often the agents' peak resident memory is sampled. `VmHWM` is the
/// kernel's high-water mark since the process started, so a sample is the
/// true peak so far; what a sample can miss is a new peak in an agent's
/// last interval before it exits.
const MEMORY_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
/// Bytes of the log tail a `FallbackToLogsOnError` termination message
/// holds (the kubelet's limit).
const TERMINATION_MESSAGE_BYTES: usize = 2048;

/// The `mover-agent` binary: `$HAULAGE_AGENT_BIN` if set (a release
/// build, for a measurement), else the one next to the test binary.
/// `cargo test --workspace` builds it first (mover-agent has an
/// integration test, so its binary is built); `cargo test --test
/// integration` alone does not rebuild it: run `cargo build -p
/// mover-agent` after changing the agent.
pub fn agent_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("HAULAGE_AGENT_BIN") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("HAULAGE_AGENT_BIN={} is not a file", path.display());
        }
        return Ok(path);
    }
    let test_binary = std::env::current_exe()?;
    let directory = test_binary
        .parent()
        .and_then(Path::parent)
        .context("test binary has no target directory")?;
    let agent = directory.join("mover-agent");
    if !agent.exists() {
        bail!(
            "{} is missing: run `cargo build -p mover-agent` (or `cargo test --workspace`)",
            agent.display()
        );
    }
    Ok(agent)
}

struct Running {
    /// The pod's UID: a pod deleted and created again under the same name
    /// is a new pod.
    uid: String,
    child: Option<Child>,
    restarts: i32,
    finished: bool,
    /// While crash-looping: when the next start is due.
    restart_at: Option<std::time::Instant>,
    /// The last termination, reported as `lastState`.
    last_termination: serde_json::Value,
}

/// The stand-in; stops its processes when dropped.
pub struct Kubelet {
    client: kube::Client,
    server: String,
    ca_pem: String,
    root: PathBuf,
    volumes: PathBuf,
    nodes: Vec<String>,
    processes: Arc<Mutex<HashMap<(String, String), Running>>>,
    stop: CancellationToken,
    /// Agents started so far (restarts included).
    pub starts: Arc<std::sync::atomic::AtomicUsize>,
    /// Agents sent SIGTERM that have not exited yet (their processes no
    /// longer in `processes`).
    terminating: Arc<std::sync::atomic::AtomicUsize>,
    /// The highest `VmHWM` sampled per pod (namespace, name), in bytes,
    /// over all its agent's starts.
    peak_memory: Arc<Mutex<BTreeMap<(String, String), u64>>>,
}

/// `VmHWM` of a process, in bytes; `None` once it has exited (a zombie's
/// status has no memory lines).
fn peak_resident_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn running_state() -> serde_json::Value {
    json!({"running": {"startedAt": k8s_openapi::jiff::Timestamp::now().to_string()}})
}

fn pinned_node(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    if let Some(node) = &spec.node_name {
        return Some(node.clone());
    }
    let terms = &spec
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms;
    terms.iter().find_map(|term| {
        term.match_fields.as_ref()?.iter().find_map(|field| {
            (field.key == "metadata.name" && field.operator == "In")
                .then(|| field.values.as_ref()?.first().cloned())
                .flatten()
        })
    })
}

/// Register `nodes` as Ready, schedulable nodes (what a kubelet does when
/// it joins): for a cluster whose nodes run no agents, and for the
/// stand-in's own nodes.
pub async fn register_nodes(client: &kube::Client, nodes: &[&str]) -> anyhow::Result<()> {
    let node_api: Api<Node> = Api::all(client.clone());
    for name in nodes {
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }))?;
        node_api.create(&PostParams::default(), &node).await?;
        // The TaintNodesByCondition admission plugin taints a new node
        // not-ready:NoSchedule; the node lifecycle controller (not
        // running here) would lift it once the node reports Ready.
        node_api
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"taints": null}})),
            )
            .await?;
        node_api
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady",
                     "message": "kubelet stand-in", "lastHeartbeatTime": null}
                ]}})),
            )
            .await?;
    }
    Ok(())
}

impl Kubelet {
    /// Register `nodes` (Ready) and start watching. `volumes` holds each
    /// claim's data at `<volumes>/<namespace>/<pvc>`.
    pub async fn start(
        client: kube::Client,
        kubeconfig: &Path,
        nodes: &[&str],
        volumes: &Path,
        root: &Path,
    ) -> anyhow::Result<Self> {
        let config: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(kubeconfig)?)?;
        let cluster = &config["clusters"][0]["cluster"];
        let server = cluster["server"].as_str().context("server")?.to_string();
        let ca_data = cluster["certificate-authority-data"]
            .as_str()
            .context("certificate-authority-data")?;
        use base64::Engine;
        let ca_pem = String::from_utf8(base64::engine::general_purpose::STANDARD.decode(ca_data)?)?;
        register_nodes(&client, nodes).await?;
        let kubelet = Kubelet {
            client,
            server,
            ca_pem,
            root: root.to_path_buf(),
            volumes: volumes.to_path_buf(),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            processes: Arc::new(Mutex::new(HashMap::new())),
            stop: CancellationToken::new(),
            starts: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            terminating: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            peak_memory: Arc::new(Mutex::new(BTreeMap::new())),
        };
        kubelet.spawn_loop();
        kubelet.spawn_memory_sampler();
        Ok(kubelet)
    }

    fn spawn_loop(&self) {
        let this = self.handle();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = this.stop.cancelled() => return,
                    _ = tokio::time::sleep(SYNC_INTERVAL) => {}
                }
                if let Err(error) = this.sync().await {
                    eprintln!("kubelet stand-in: {error:#}");
                }
            }
        });
    }

    fn spawn_memory_sampler(&self) {
        let processes = self.processes.clone();
        let peak_memory = self.peak_memory.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(MEMORY_SAMPLE_INTERVAL) => {}
                }
                let pids: Vec<((String, String), u32)> = processes
                    .lock()
                    .expect("lock")
                    .iter()
                    .filter_map(|(key, running)| Some((key.clone(), running.child.as_ref()?.id()?)))
                    .collect();
                for (key, pid) in pids {
                    if let Some(bytes) = peak_resident_bytes(pid) {
                        let mut peaks = peak_memory.lock().expect("lock");
                        let peak = peaks.entry(key).or_insert(0);
                        *peak = (*peak).max(bytes);
                    }
                }
            }
        });
    }

    /// The highest peak resident memory (`VmHWM`, bytes) sampled of each
    /// pod's agent so far, by (namespace, pod name).
    pub fn agent_peak_memory(&self) -> BTreeMap<(String, String), u64> {
        self.peak_memory.lock().expect("lock").clone()
    }

    fn handle(&self) -> Kubelet {
        Kubelet {
            client: self.client.clone(),
            server: self.server.clone(),
            ca_pem: self.ca_pem.clone(),
            root: self.root.clone(),
            volumes: self.volumes.clone(),
            nodes: self.nodes.clone(),
            processes: self.processes.clone(),
            stop: self.stop.clone(),
            starts: self.starts.clone(),
            terminating: self.terminating.clone(),
            peak_memory: self.peak_memory.clone(),
        }
    }

    /// SIGKILL the agent of a pod (the stand-in restarts it, as a kubelet
    /// would). Returns whether a process was running.
    pub fn kill(&self, namespace: &str, pod: &str) -> bool {
        let mut processes = self.processes.lock().expect("lock");
        match processes
            .get_mut(&(namespace.to_string(), pod.to_string()))
            .and_then(|running| running.child.as_mut())
        {
            Some(child) => child.start_kill().is_ok(),
            None => false,
        }
    }

    /// SIGTERM the running agent of a pod, as a kubelet stopping its
    /// container does, and wait for the process to exit: how long it took,
    /// or `None` when it was still running after `within` (it is then
    /// SIGKILLed). The stand-in restarts it as after any exit.
    pub async fn terminate_running(
        &self,
        namespace: &str,
        pod: &str,
        within: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        let pid = {
            let processes = self.processes.lock().expect("lock");
            processes
                .get(&(namespace.to_string(), pod.to_string()))
                .and_then(|running| running.child.as_ref())
                .and_then(|child| child.id())
                .with_context(|| format!("no agent runs for pod {namespace}/{pod}"))?
        };
        // Gone, or a zombie until the stand-in reaps it.
        let exited = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
                stat.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            })
        };
        let started = std::time::Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "kill -TERM {pid} failed: {status}");
        while started.elapsed() < within {
            if exited() {
                return Ok(Some(started.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill(namespace, pod);
        Ok(None)
    }

    /// SIGKILL the running agent of a pod, asserting there was one, and
    /// return how many agents had started before; hand that to
    /// [`Self::assert_restarted_since`].
    pub fn kill_running(&self, namespace: &str, pod: &str) -> usize {
        let starts_before = self.starts.load(std::sync::atomic::Ordering::SeqCst);
        assert!(self.kill(namespace, pod), "the agent had already exited");
        starts_before
    }

    /// How many agent processes the stand-in has started so far.
    pub fn starts(&self) -> usize {
        self.starts.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Assert an agent started after `starts_before` (from
    /// [`Self::kill_running`]): the killed one was restarted.
    pub fn assert_restarted_since(&self, starts_before: usize) {
        assert!(
            self.starts.load(std::sync::atomic::Ordering::SeqCst) > starts_before,
            "the killed agent was not restarted"
        );
    }

    /// Freeze a pod's agent (SIGSTOP), as a process hung on a stuck volume
    /// mount would be: it stays "running" but reports nothing. Returns
    /// whether a process was running.
    pub async fn freeze(&self, namespace: &str, pod: &str) -> bool {
        let pid = self
            .processes
            .lock()
            .expect("lock")
            .get(&(namespace.to_string(), pod.to_string()))
            .and_then(|running| running.child.as_ref().and_then(Child::id));
        let Some(pid) = pid else {
            return false;
        };
        Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .await
            .is_ok_and(|status| status.success())
    }

    /// Evict a pod as a kubelet under memory pressure does: kill its agent
    /// and leave the pod `Failed` with reason `Evicted` (never restarted).
    pub async fn evict(&self, namespace: &str, pod: &str) -> anyhow::Result<()> {
        let key = (namespace.to_string(), pod.to_string());
        let child = {
            let mut processes = self.processes.lock().expect("lock");
            let running = processes.get_mut(&key).context("no such pod running")?;
            running.finished = true;
            running.child.take()
        };
        if let Some(mut child) = child {
            let _ = child.kill().await;
        }
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        api.patch_status(
            pod,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Failed", "reason": "Evicted",
                "message": "The node was low on resource: memory.",
                "containerStatuses": [{
                    "name": "agent", "image": "mover-agent", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 137, "reason": "Error",
                        "finishedAt": now}},
                }],
            }})),
        )
        .await
        .with_context(|| format!("evict pod {namespace}/{pod}"))?;
        Ok(())
    }

    async fn sync(&self) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let list = pods
            .list(&ListParams::default().labels(STAGE_POD_SELECTOR))
            .await?;
        let mut seen = Vec::new();
        let mut terminating = Vec::new();
        for pod in list.items {
            let Some(node) = pinned_node(&pod) else {
                continue;
            };
            if !self.nodes.contains(&node) {
                continue;
            }
            let namespace = pod.namespace().unwrap_or_default();
            let name = pod.name_any();
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let key = (namespace.clone(), name.clone());
            seen.push(key.clone());
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
            if pod.metadata.deletion_timestamp.is_some() {
                // Stopped together after this pass, as a kubelet stops
                // pods in parallel (each within its grace period).
                terminating.push((key, api, name));
                continue;
            }
            let replaced = self
                .processes
                .lock()
                .expect("lock")
                .get(&key)
                .is_some_and(|running| running.uid != uid);
            if replaced {
                self.terminate(&key).await;
                self.processes.lock().expect("lock").remove(&key);
            }
            let exists = self.processes.lock().expect("lock").contains_key(&key);
            if !exists {
                let child = self.launch(&pod, &node).await?;
                self.processes.lock().expect("lock").insert(
                    key.clone(),
                    Running {
                        uid,
                        child: Some(child),
                        restarts: 0,
                        finished: false,
                        restart_at: None,
                        last_termination: json!({}),
                    },
                );
                self.report(&api, &name, "Running", running_state(), json!({}), 0)
                    .await?;
                continue;
            }
            // A crash-looping agent whose backoff is over starts again.
            let due = {
                let processes = self.processes.lock().expect("lock");
                let running = processes.get(&key).context("tracked")?;
                (!running.finished
                    && running.child.is_none()
                    && running
                        .restart_at
                        .is_some_and(|at| at <= std::time::Instant::now()))
                .then(|| (running.restarts, running.last_termination.clone()))
            };
            if let Some((restarts, last)) = due {
                let child = self.launch(&pod, &node).await?;
                if let Some(running) = self.processes.lock().expect("lock").get_mut(&key) {
                    running.child = Some(child);
                    running.restart_at = None;
                }
                self.report(&api, &name, "Running", running_state(), last, restarts)
                    .await?;
                continue;
            }
            let exited = {
                let mut processes = self.processes.lock().expect("lock");
                let running = processes.get_mut(&key).context("tracked")?;
                match running.child.as_mut().map(Child::try_wait) {
                    Some(Ok(Some(status))) => {
                        running.child = None;
                        Some(status.code().unwrap_or(137))
                    }
                    _ => None,
                }
            };
            let Some(code) = exited else {
                continue;
            };
            let now = k8s_openapi::jiff::Timestamp::now().to_string();
            if code == 0 {
                let restarts = {
                    let mut processes = self.processes.lock().expect("lock");
                    let running = processes.get_mut(&key).context("tracked")?;
                    running.finished = true;
                    running.restarts
                };
                let state = json!({"terminated": {"exitCode": 0, "reason": "Completed",
                    "finishedAt": now}});
                self.report(&api, &name, "Succeeded", state, json!({}), restarts)
                    .await?;
                continue;
            }
            // Crashed: the termination message is the log's tail
            // (`terminationMessagePolicy: FallbackToLogsOnError`).
            let log = std::fs::read(
                self.root
                    .join("pods")
                    .join(&namespace)
                    .join(&name)
                    .join("agent.log"),
            )
            .unwrap_or_default();
            let tail = String::from_utf8_lossy(
                &log[log.len().saturating_sub(TERMINATION_MESSAGE_BYTES)..],
            )
            .into_owned();
            let termination = json!({"terminated": {"exitCode": code,
                "reason": "Error",
                "message": tail, "finishedAt": now}});
            let restarts = {
                let mut processes = self.processes.lock().expect("lock");
                let running = processes.get_mut(&key).context("tracked")?;
                running.restarts += 1;
                let delay = RESTART_DELAY
                    .saturating_mul(1 << (running.restarts - 1).clamp(0, 16))
                    .min(MAX_RESTART_DELAY);
                running.restart_at = Some(std::time::Instant::now() + delay);
                running.last_termination = termination.clone();
                running.restarts
            };
            let waiting = json!({"waiting": {"reason": "CrashLoopBackOff",
                "message": "back-off restarting failed container agent"}});
            self.report(&api, &name, "Running", waiting, termination, restarts)
                .await?;
        }
        // Pods gone from the API: stop their processes.
        let gone: Vec<(String, String)> = self
            .processes
            .lock()
            .expect("lock")
            .keys()
            .filter(|key| !seen.contains(key))
            .cloned()
            .collect();
        futures::future::join_all(
            terminating
                .iter()
                .map(|(key, _, _)| key)
                .chain(gone.iter())
                .map(|key| self.terminate(key)),
        )
        .await;
        for (_, api, name) in &terminating {
            let _ = api
                .delete(name, &DeleteParams::default().grace_period(0))
                .await;
        }
        for key in gone {
            self.processes.lock().expect("lock").remove(&key);
        }
        Ok(())
    }

    /// SIGTERM, then SIGKILL after a grace period.
    async fn terminate(&self, key: &(String, String)) {
        // Counted as terminating in the same lock that takes the process
        // out of the running ones (`running_agents`, reading both in that
        // lock, never misses it), until it exited, also when this future
        // is dropped.
        struct Terminating<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Terminating<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let taken = {
            let mut processes = self.processes.lock().expect("lock");
            processes
                .get_mut(key)
                .and_then(|running| running.child.take())
                .map(|child| {
                    self.terminating
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    (child, Terminating(&self.terminating))
                })
        };
        if let Some((mut child, _terminating)) = taken {
            if let Some(pid) = child.id() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
            if tokio::time::timeout(Duration::from_secs(20), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }

    async fn report(
        &self,
        api: &Api<Pod>,
        name: &str,
        phase: &str,
        state: serde_json::Value,
        last_state: serde_json::Value,
        restarts: i32,
    ) -> anyhow::Result<()> {
        let ready = phase == "Running" && state.get("running").is_some();
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": phase,
                "containerStatuses": [{
                    "name": "agent", "image": "mover-agent", "imageID": "", "ready": ready,
                    "restartCount": restarts, "state": state, "lastState": last_state,
                }],
            }})),
        )
        .await
        .with_context(|| format!("report pod {name} {phase}"))?;
        Ok(())
    }

    /// A kubeconfig with a fresh token of the pod's service account.
    async fn agent_kubeconfig(&self, pod: &Pod, directory: &Path) -> anyhow::Result<PathBuf> {
        let namespace = pod.namespace().unwrap_or_default();
        let account = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.service_account_name.clone())
            .unwrap_or_else(|| "default".to_string());
        super::kube::service_account_kubeconfig(
            &self.client,
            &self.server,
            &self.ca_pem,
            &namespace,
            &account,
            &directory.join("kubeconfig"),
        )
        .await
    }

    async fn launch(&self, pod: &Pod, node: &str) -> anyhow::Result<Child> {
        let namespace = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let spec = pod.spec.as_ref().context("pod without spec")?;
        let container = spec.containers.first().context("pod without container")?;
        let directory = self.root.join("pods").join(&namespace).join(&name);
        let scratch = directory.join("scratch");
        let credentials = directory.join("credentials");
        std::fs::create_dir_all(&scratch)?;
        std::fs::create_dir_all(&credentials)?;
        // The projected Secret volume, as the kubelet would mount it.
        for volume in spec.volumes.iter().flatten() {
            for source in volume
                .projected
                .iter()
                .flat_map(|p| p.sources.iter().flatten())
            {
                if let Some(secret) = &source.secret {
                    let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &namespace);
                    let copy = secrets
                        .get(&secret.name)
                        .await
                        .with_context(|| format!("credentials copy {namespace}/{}", secret.name))?;
                    for (key, value) in copy.data.unwrap_or_default() {
                        std::fs::write(credentials.join(key), value.0)?;
                    }
                }
            }
        }
        let kubeconfig = self.agent_kubeconfig(pod, &directory).await?;
        let mut environment = BTreeMap::new();
        for variable in container.env.iter().flatten() {
            let value = match (&variable.value, &variable.value_from) {
                (Some(value), _) => value.clone(),
                (None, Some(source)) => {
                    match source.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                        Some("metadata.name") => name.clone(),
                        Some("metadata.namespace") => namespace.clone(),
                        Some("spec.nodeName") => node.to_string(),
                        // The container's own requests, in bytes, as the
                        // kubelet gives them (divisor 1).
                        _ => match source.resource_field_ref.as_ref() {
                            Some(selector) => match selector.resource.strip_prefix("requests.") {
                                Some(resource) => {
                                    let Some(quantity) = container
                                        .resources
                                        .as_ref()
                                        .and_then(|r| r.requests.as_ref())
                                        .and_then(|requests| requests.get(resource))
                                    else {
                                        continue;
                                    };
                                    haulage::plan::quantity::parse_quantity(&quantity.0)
                                        .with_context(|| {
                                            format!("{resource} request {}", quantity.0)
                                        })?
                                        .to_string()
                                }
                                None => continue,
                            },
                            None => continue,
                        },
                    }
                }
                _ => continue,
            };
            environment.insert(variable.name.clone(), value);
        }
        environment.insert("NODE_NAME".to_string(), node.to_string());
        environment.insert(
            "HAULAGE_DATA_ROOT".to_string(),
            self.volumes.join(&namespace).to_string_lossy().into_owned(),
        );
        environment.insert("TMPDIR".to_string(), scratch.to_string_lossy().into_owned());
        environment.insert(
            "KUBECONFIG".to_string(),
            kubeconfig.to_string_lossy().into_owned(),
        );
        environment.insert("HAULAGE_LOG".to_string(), "info".to_string());
        // Every agent on this one machine gets a free port of its own (in a
        // cluster each pod has its own network namespace); the agent logs
        // the port it bound, see `agent_metrics_address`.
        environment.insert(
            "HAULAGE_METRICS_ADDRESS".to_string(),
            "127.0.0.1:0".to_string(),
        );
        let arguments: Vec<String> = container
            .args
            .iter()
            .flatten()
            .map(|argument| match argument.strip_prefix("/credentials/") {
                Some(rest) => credentials.join(rest).to_string_lossy().into_owned(),
                None => argument.clone(),
            })
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(directory.join("agent.log"))?;
        let child = Command::new(agent_binary()?)
            .args(&arguments)
            .env_clear()
            .envs(&environment)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("start mover-agent")?;
        self.starts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(child)
    }

    /// Agent processes running now, those stopping after SIGTERM
    /// included (until they exit, as a kubelet keeps a terminating pod).
    pub fn running_agents(&self) -> usize {
        let processes = self.processes.lock().expect("lock");
        let running = processes
            .values()
            .filter(|running| running.child.is_some())
            .count();
        running + self.terminating.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The `/metrics` address of the agent of a pod, from its log (the
    /// agent binds a free port and logs it); the latest start's when the
    /// agent was restarted.
    pub fn agent_metrics_address(
        &self,
        namespace: &str,
        pod: &str,
    ) -> Option<std::net::SocketAddr> {
        let log = std::fs::read_to_string(
            self.root
                .join("pods")
                .join(namespace)
                .join(pod)
                .join("agent.log"),
        )
        .ok()?;
        log.lines().rev().find_map(|line| {
            let value = line.split("metrics endpoint listening on ").nth(1)?;
            value.split_whitespace().next()?.parse().ok()
        })
    }

    /// Every agent's log with its pod's directory.
    fn agent_logs(&self) -> Vec<(PathBuf, String)> {
        let mut logs = Vec::new();
        for namespace in std::fs::read_dir(self.root.join("pods"))
            .into_iter()
            .flatten()
            .flatten()
        {
            for pod in std::fs::read_dir(namespace.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let log = std::fs::read_to_string(pod.path().join("agent.log")).unwrap_or_default();
                logs.push((pod.path(), log));
            }
        }
        logs
    }

    /// The last lines of every agent log, for failure messages.
    pub fn all_agent_logs(&self) -> String {
        let mut text = String::new();
        for (pod, log) in self.agent_logs() {
            let lines: Vec<&str> = log.lines().collect();
            text.push_str(&format!(
                "--- {}:\n{}\n",
                pod.display(),
                lines[lines.len().saturating_sub(20)..].join("\n")
            ));
        }
        text
    }

    /// The lines of every agent log that contain `text`.
    pub fn agent_log_lines_containing(&self, text: &str) -> Vec<String> {
        self.agent_logs()
            .into_iter()
            .flat_map(|(_, log)| {
                log.lines()
                    .filter(|line| line.contains(text))
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
