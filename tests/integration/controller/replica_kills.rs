//! Controller replicas killed at random, counted: many VolumeBackups are
//! created at once while several `haulage controller` processes (real
//! processes, the binary as the Deployment runs it) are SIGKILLed and
//! restarted at random, half of the time under the same identity (a
//! container restarted in its pod), half under a new one (the pod
//! replaced). Watched throughout, in the API server's order:
//!
//! - no VolumeTransfer is ever created twice for one backup's claim, and
//!   no stage pod twice for one backup's node and namespace (a second one
//!   would be two agents moving the same volume);
//! - no claim is ever moved by two transfers at once (four backups of each
//!   claim contend for it), and never more volumes run than the cluster
//!   cap (`HAULAGE_MAX_CONCURRENT_VOLUMES`) allows;
//! - no backup stays without a live owner for longer than the replica
//!   lease and an adoption check allow;
//! - a Completed backup stays Completed, with its completion time, and each
//!   backup stored exactly one snapshot; every agent ran once.
//!
//! In CI: 40 backups, 3 replicas. The full count of docs/benchmarks.md:
//! `HAULAGE_REPLICA_KILL_BACKUPS=200 HAULAGE_REPLICAS=5 cargo test --test
//! integration controller::replica_kills -- --nocapture` (set
//! `HAULAGE_REPLICA_KILL_SEED` to repeat a run's kills).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::{BACKUP_LABEL, NODE_LABEL, SYSTEM_NAMESPACE};
use haulage::api::{VolumeBackup, VolumeTransfer};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use serde_json::json;

use crate::support::fixture::{
    Fixture, Layout, STORAGE_CLASS, controller_process, create_backup_in, create_storage_policy,
    eventually, is_running_phase, no_leftovers_within, watch_objects, watch_transfers,
};
use crate::support::number_from_env;

/// Backups of each claim (they contend for it).
const BACKUPS_PER_CLAIM: usize = 2;
/// Namespaces and nodes the claims are spread over.
const NAMESPACES: usize = 4;
const NODES: usize = 5;
/// Bytes of sample data per claim, read at [`POLICY_BYTES_PER_SECOND`]
/// (all volumes together), so that backups run while replicas die.
const VOLUME_BYTES: u64 = 1 << 20;
const POLICY_BYTES_PER_SECOND: u64 = 1 << 20;
/// The cluster cap the replicas run with.
const CLUSTER_CAP: usize = 4;
/// The replicas' lease (the shortest allowed).
const LEASE_SECONDS: u64 = haulage::controller::MIN_LEASE_SECONDS as u64;
/// Longest a backup may go without a live owner: a dead owner's lease
/// expiring, the next adoption check, and a reconcile under load.
const ORPHAN_SECONDS: u64 =
    LEASE_SECONDS + haulage::reconcile::ownership::ADOPTION_CHECK_SECONDS + 25;

/// What the watches saw go wrong, and what they counted.
#[derive(Default)]
struct Watched {
    /// VolumeTransfer UIDs per (backup, namespace, claim).
    transfers: BTreeMap<(String, String, String), BTreeSet<String>>,
    /// Transfers running now per (namespace, claim), by UID.
    running_per_claim: BTreeMap<(String, String), BTreeSet<String>>,
    /// Transfers running now, by UID.
    running: BTreeSet<String>,
    /// The most transfers seen running at once.
    most_running: usize,
    /// Stage pod UIDs per (backup, namespace, node).
    stage_pods: BTreeMap<(String, String, String), BTreeSet<String>>,
    /// Completion time per Completed backup.
    completed: BTreeMap<String, String>,
    /// Backups adopted from another replica.
    adopted: BTreeSet<String>,
    /// Everything that broke a guarantee, as it was seen.
    violations: Vec<String>,
}

impl Watched {
    fn transfer(&mut self, transfer: &VolumeTransfer) {
        let uid = transfer.metadata.uid.clone().unwrap_or_default();
        let namespace = transfer.metadata.namespace.clone().unwrap_or_default();
        let claim = (namespace.clone(), transfer.spec.pvc.clone());
        let key = (
            transfer.spec.backup_ref.name.clone(),
            namespace,
            transfer.spec.pvc.clone(),
        );
        let uids = self.transfers.entry(key.clone()).or_default();
        uids.insert(uid.clone());
        if uids.len() > 1 {
            self.violations
                .push(format!("two VolumeTransfers of {key:?}: {uids:?}"));
        }
        let running = self.running_per_claim.entry(claim.clone()).or_default();
        if is_running_phase(transfer.phase()) {
            running.insert(uid.clone());
            self.running.insert(uid);
        } else {
            running.remove(&uid);
            self.running.remove(&uid);
        }
        if running.len() > 1 {
            self.violations.push(format!(
                "claim {claim:?} moved by {} transfers at once: {running:?}",
                running.len()
            ));
        }
        self.most_running = self.most_running.max(self.running.len());
        if self.running.len() > CLUSTER_CAP {
            self.violations.push(format!(
                "{} transfers running at once, over the cluster cap of {CLUSTER_CAP}",
                self.running.len()
            ));
        }
    }

    fn stage_pod(&mut self, pod: &Pod) {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let key = (
            labels.get(BACKUP_LABEL).cloned().unwrap_or_default(),
            pod.metadata.namespace.clone().unwrap_or_default(),
            labels.get(NODE_LABEL).cloned().unwrap_or_default(),
        );
        let uids = self.stage_pods.entry(key.clone()).or_default();
        uids.insert(pod.metadata.uid.clone().unwrap_or_default());
        if uids.len() > 1 {
            self.violations
                .push(format!("two stage pods of {key:?}: {uids:?}"));
        }
    }

    fn backup(&mut self, backup: &VolumeBackup) {
        let name = backup.metadata.name.clone().unwrap_or_default();
        let status = backup.status.clone().unwrap_or_default();
        if status
            .owner
            .as_ref()
            .is_some_and(|owner| owner.adopted_from.is_some())
        {
            self.adopted.insert(name.clone());
        }
        let completion = status
            .completion_time
            .map(|time| time.0.to_string())
            .unwrap_or_default();
        match (self.completed.get(&name), status.phase) {
            (None, Some(VolumeBackupPhase::Completed)) => {
                self.completed.insert(name, completion);
            }
            (Some(first), Some(VolumeBackupPhase::Completed)) if *first == completion => {}
            (Some(first), phase) => self.violations.push(format!(
                "backup {name} Completed at {first}, then {phase:?} completed at {completion:?}"
            )),
            (None, _) => {}
        }
    }
}

/// The watches' record, also when a watch task panicked holding it (the
/// test then fails on its own assertions, not on a poisoned lock).
fn lock(watched: &Mutex<Watched>) -> std::sync::MutexGuard<'_, Watched> {
    watched
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One replica slot: the process running now (if any) and its identity.
struct Replica {
    identity: String,
    process: Option<tokio::process::Child>,
    generation: usize,
}

/// Start `haulage controller` as `identity`, logging to `logs/identity.log`
/// (appended across restarts).
fn start_replica(
    kubeconfig: &Path,
    logs: &Path,
    identity: &str,
) -> anyhow::Result<tokio::process::Child> {
    let log: PathBuf = logs.join(format!("{identity}.log"));
    let port = crate::support::minio::free_port()?;
    controller_process(
        Path::new(env!("CARGO_BIN_EXE_haulage")),
        kubeconfig,
        identity,
        port,
        &log,
        &[
            ("HAULAGE_REPLICA_LEASE_SECONDS", &LEASE_SECONDS.to_string()),
            ("HAULAGE_MAX_CONCURRENT_VOLUMES", &CLUSTER_CAP.to_string()),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backups_created_at_once_complete_exactly_once_while_replicas_are_killed_at_random()
-> anyhow::Result<()> {
    let backups_wanted = number_from_env("HAULAGE_REPLICA_KILL_BACKUPS", 40) as usize;
    let replica_count = number_from_env("HAULAGE_REPLICAS", 3) as usize;
    let seed = number_from_env("HAULAGE_REPLICA_KILL_SEED", fastrand::u64(..));
    anyhow::ensure!(
        (3..=5).contains(&replica_count),
        "HAULAGE_REPLICAS must be 3 to 5"
    );
    println!("replica kills: seed {seed} (HAULAGE_REPLICA_KILL_SEED={seed} repeats the kills)");
    let mut random = fastrand::Rng::with_seed(seed);

    let claims = backups_wanted.div_ceil(BACKUPS_PER_CLAIM);
    let layout = Layout::many(claims, NAMESPACES, NODES);
    let fixture = Fixture::builder()
        .layout(layout.clone())
        .volume_bytes(VOLUME_BYTES)
        .start()
        .await?;
    let client = &fixture.client;
    create_storage_policy(
        client,
        "one-mebibyte",
        json!({"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": POLICY_BYTES_PER_SECOND}),
    )
    .await?;
    // The fixture's in-process controller steps aside: every replica is a
    // `haulage controller` process that can be killed.
    fixture.shutdown.cancel();
    eventually(Duration::from_secs(30), || async {
        Ok(fixture.controller.is_finished().then_some(()))
    })
    .await
    .context("the fixture's controller did not stop")?;
    let kubeconfig = fixture
        .cluster
        .service_account_kubeconfig(
            SYSTEM_NAMESPACE,
            "haulage-controller",
            &fixture.work.path().join("replicas.kubeconfig"),
        )
        .await?;
    let logs = fixture.work.path().join("replica-logs");
    std::fs::create_dir_all(&logs)?;
    let mut replicas = Vec::new();
    for slot in 0..replica_count {
        let identity = format!("replica-{slot}");
        replicas.push(Replica {
            process: Some(start_replica(&kubeconfig, &logs, &identity)?),
            identity,
            generation: 0,
        });
    }

    let watched = Arc::new(Mutex::new(Watched::default()));
    let transfer_watch = {
        let watched = watched.clone();
        watch_transfers(client, move |transfer| lock(&watched).transfer(transfer))
    };
    let pod_watch = {
        let watched = watched.clone();
        watch_objects(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().labels("app.kubernetes.io/name=haulage-agent"),
            move |pod| lock(&watched).stage_pod(pod),
        )
    };
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup_watch = {
        let watched = watched.clone();
        watch_objects(backups.clone(), watcher::Config::default(), move |backup| {
            lock(&watched).backup(backup)
        })
    };

    // Every backup at once, each of one claim (each claim in two).
    let started = Instant::now();
    let names: Vec<String> = (0..backups_wanted)
        .map(|index| format!("b-{index:03}"))
        .collect();
    futures::stream::iter(names.iter().enumerate())
        .map(|(index, name)| {
            let (namespace, claim, _, _) = &layout.claims[index % claims];
            async move {
                create_backup_in(
                    client,
                    name,
                    &[namespace],
                    json!({"matchLabels": {"claim": claim}}),
                )
                .await
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<()>>>()?;
    println!(
        "{backups_wanted} VolumeBackups created in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Kill a replica every 1 to 6 s and start it again 0.5 to 3 s later,
    // until every backup is final; meanwhile no backup may go without a
    // live owner for longer than ORPHAN_SECONDS.
    let deadline = Duration::from_secs(120 + 6 * backups_wanted as u64);
    let mut owned_since: BTreeMap<String, Instant> = BTreeMap::new();
    let mut longest_without_owner = Duration::ZERO;
    let (mut kills, mut same_identity) = (0, 0);
    let mut next_kill = Instant::now() + Duration::from_millis(random.u64(1000..=6000));
    let mut restart: Option<(usize, Instant)> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = Instant::now();
        if now >= next_kill && restart.is_none() {
            let slot = random.usize(..replicas.len());
            let replica = &mut replicas[slot];
            if let Some(mut process) = replica.process.take() {
                process.start_kill()?;
                process.wait().await?;
                kills += 1;
                restart = Some((slot, now + Duration::from_millis(random.u64(500..=3000))));
            }
        }
        if let Some((slot, at)) = restart
            && now >= at
        {
            let replica = &mut replicas[slot];
            if random.bool() {
                same_identity += 1;
            } else {
                replica.generation += 1;
                replica.identity = format!("replica-{slot}-{}", replica.generation);
            }
            replica.process = Some(start_replica(&kubeconfig, &logs, &replica.identity)?);
            restart = None;
            next_kill = now + Duration::from_millis(random.u64(1000..=6000));
        }

        let live: BTreeSet<&str> = replicas
            .iter()
            .filter(|replica| replica.process.is_some())
            .map(|replica| replica.identity.as_str())
            .collect();
        let listed = backups.list(&ListParams::default()).await;
        let Ok(listed) = listed else { continue };
        let mut unfinished = 0;
        for backup in &listed.items {
            let name = backup.metadata.name.clone().unwrap_or_default();
            let status = backup.status.clone().unwrap_or_default();
            if status.phase.is_some_and(|phase| phase.is_final()) {
                owned_since.remove(&name);
                continue;
            }
            unfinished += 1;
            let owner_live = status
                .owner
                .as_ref()
                .is_some_and(|owner| live.contains(owner.replica.as_str()));
            let since = *owned_since.entry(name.clone()).or_insert(now);
            if owner_live {
                owned_since.insert(name, now);
            } else {
                let without = now.duration_since(since);
                longest_without_owner = longest_without_owner.max(without);
                if without > Duration::from_secs(ORPHAN_SECONDS) {
                    lock(&watched).violations.push(format!(
                        "backup {name} without a live owner for {:.0} s (owner {:?}, live {live:?})",
                        without.as_secs_f64(),
                        status.owner.as_ref().map(|owner| &owner.replica)
                    ));
                    owned_since.insert(name, now);
                }
            }
        }
        if listed.items.len() == backups_wanted && unfinished == 0 {
            break;
        }
        // A guarantee broken: no need to wait for the rest.
        if !lock(&watched).violations.is_empty() {
            break;
        }
        if started.elapsed() > deadline {
            let logs = std::fs::read_dir(&logs)?
                .filter_map(Result::ok)
                .map(|entry| {
                    let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(15).collect();
                    format!("{:?}:\n{}", entry.file_name(), tail.join("\n"))
                })
                .collect::<Vec<_>>()
                .join("\n\n");
            anyhow::bail!(
                "{unfinished} of {backups_wanted} backups still unfinished after {:.0} s; \
                 the replicas' last log lines:\n{logs}",
                started.elapsed().as_secs_f64()
            );
        }
    }
    let elapsed = started.elapsed();
    let violations = lock(&watched).violations.clone();
    assert!(
        violations.is_empty(),
        "guarantees broken after {:.0} s:\n{}",
        elapsed.as_secs_f64(),
        violations.join("\n")
    );

    no_leftovers_within(
        client,
        Duration::from_secs(120),
        "stage pods or credentials copies left behind",
    )
    .await?;
    transfer_watch.abort();
    pod_watch.abort();
    backup_watch.abort();

    let listed = backups.list(&ListParams::default()).await?.items;
    let not_completed: Vec<String> = listed
        .iter()
        .filter(|backup| {
            backup.status.as_ref().and_then(|status| status.phase)
                != Some(VolumeBackupPhase::Completed)
        })
        .map(|backup| {
            format!(
                "{}: {:?}",
                backup.metadata.name.clone().unwrap_or_default(),
                backup
                    .status
                    .as_ref()
                    .and_then(|status| status.message.clone())
            )
        })
        .collect();
    let snapshots = fixture
        .store
        .list(haulage::repo::SNAPSHOT_PREFIX)
        .await?
        .len();
    let transfers = Api::<VolumeTransfer>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .len();
    let watched = std::mem::take(&mut *lock(&watched));
    let stage_pods: usize = watched.stage_pods.values().map(BTreeSet::len).sum();
    let nodes: BTreeSet<&str> = watched
        .stage_pods
        .keys()
        .map(|(_, _, node)| node.as_str())
        .collect();
    let agents = fixture.kubelet.starts();
    println!(
        "replica kills: {backups_wanted} backups of {claims} claims, {replica_count} replicas, \
         {kills} kills ({same_identity} restarted under the same identity), {} backups adopted; \
         all final in {:.0} s; {snapshots} snapshots, {transfers} transfers, {stage_pods} stage \
         pods on {} nodes, {agents} agents started; at most {} volumes running at once (cap \
         {CLUSTER_CAP}); \
         longest without a live owner {:.0} s; {} violations",
        watched.adopted.len(),
        elapsed.as_secs_f64(),
        nodes.len(),
        watched.most_running,
        longest_without_owner.as_secs_f64(),
        watched.violations.len(),
    );
    assert!(
        watched.violations.is_empty(),
        "guarantees broken:\n{}",
        watched.violations.join("\n")
    );
    assert!(not_completed.is_empty(), "not Completed: {not_completed:?}");
    assert_eq!(watched.completed.len(), backups_wanted);
    assert_eq!(snapshots, backups_wanted, "one snapshot per backup");
    assert_eq!(transfers, backups_wanted, "one transfer per backup");
    assert_eq!(stage_pods, backups_wanted, "one stage pod per backup");
    assert_eq!(agents, stage_pods, "each stage pod's agent ran once");
    assert!(kills > 0, "no replica was killed");
    for replica in &mut replicas {
        if let Some(process) = &mut replica.process {
            process.start_kill()?;
        }
    }
    fixture.stop().await;
    Ok(())
}
