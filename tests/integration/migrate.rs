//! `haulage migrate` on two real clusters (each its own etcd and
//! kube-apiserver) sharing one real MinIO, with the controller running
//! against each and the kubelet stand-in on each
//! (`support::migration::TwoClusters`): the dry run and the refusals, the
//! first pass (the VolumeBackup on the source, the VolumeRestore created
//! on the destination with the right spec, an interrupted run resumed),
//! quiescing and unquiescing a Deployment and a StatefulSet, and the whole
//! migration end to end with its cutover.
//!
//! Run them with `cargo test --test integration migrate::`.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::restore::{ExistingClaimPolicy, SizeChoice};
use haulage::api::{
    VolumeBackup, VolumeBackupPhase, VolumeRestore, VolumeRestorePhase, VolumeTransfer,
};
use haulage::cli::migrate::display::Display;
use haulage::cli::migrate::quiesce::{QUIESCED_BY_ANNOTATION, QUIESCED_REPLICAS_ANNOTATION};
use haulage::cli::migrate::settings::RawSettings;
use haulage::cli::migrate::{quiesce_source, unquiesce};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolumeClaim, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::engine::support::{assert_same_tree, random_bytes};
use crate::support::fixture::{create, eventually};
use crate::support::migration::{
    CLAIM_SIZE, PASS_DEADLINE, SOURCE_CLAIMS, TwoClusters, running_pod,
};

/// The flags every test migrates with: both namespaces renamed, the
/// `fast` class mapped to `gp3` (`shared` exists on both), namespaces
/// created.
const MAPS: [&str; 14] = [
    "-n",
    "shop",
    "-n",
    "web",
    "--namespace-map",
    "shop=shop-b",
    "--namespace-map",
    "web=web-b",
    "--storage-class-map",
    "fast=gp3",
    "--create-namespaces",
    "--name",
    "move",
    "--no-progress",
];

fn with_maps(extra: &[&'static str]) -> Vec<&'static str> {
    MAPS.iter().chain(extra).copied().collect()
}

/// [`with_maps`], with the map `map` replaced by `replacement`.
fn with_map_replaced(
    map: &str,
    replacement: &'static str,
    extra: &[&'static str],
) -> anyhow::Result<Vec<&'static str>> {
    let mut arguments = with_maps(extra);
    let at = arguments.iter().position(|a| *a == map).context("map")?;
    arguments[at] = replacement;
    Ok(arguments)
}

/// Neither a VolumeBackup on the source nor a VolumeRestore on the
/// destination exists.
async fn assert_no_backup_and_no_restore(
    backups: &Api<VolumeBackup>,
    restores: &Api<VolumeRestore>,
) -> anyhow::Result<()> {
    assert!(backups.list(&ListParams::default()).await?.items.is_empty());
    assert!(
        restores
            .list(&ListParams::default())
            .await?
            .items
            .is_empty()
    );
    Ok(())
}

fn destination_of(namespace: &str) -> String {
    format!("{namespace}-b")
}

/// The replicas and recorded replica counts of the source's StatefulSet
/// shop/db and Deployment shop/uploader, in that order.
async fn shop_workloads(source: &kube::Client) -> anyhow::Result<[(i32, Option<String>); 2]> {
    let sets: Api<StatefulSet> = Api::namespaced(source.clone(), "shop");
    let deployments: Api<Deployment> = Api::namespaced(source.clone(), "shop");
    Ok([
        replicas_and_record(&sets, "db").await?,
        replicas_and_record(&deployments, "uploader").await?,
    ])
}

/// [`shop_workloads`] running as created: 1 and 2 replicas, nothing recorded.
fn running_as_created() -> [(i32, Option<String>); 2] {
    [(1, None), (2, None)]
}

/// [`shop_workloads`] quiesced: no replicas, the counts they had recorded.
fn quiesced() -> [(i32, Option<String>); 2] {
    [(0, Some("1".to_string())), (0, Some("2".to_string()))]
}

async fn replicas_and_record<K>(api: &Api<K>, name: &str) -> anyhow::Result<(i32, Option<String>)>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + serde::Serialize,
{
    let object = serde_json::to_value(api.get(name).await?)?;
    Ok((
        object["spec"]["replicas"].as_i64().unwrap_or(1) as i32,
        object["metadata"]["annotations"][QUIESCED_REPLICAS_ANNOTATION]
            .as_str()
            .map(str::to_string),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dry_run_prints_both_plans_changes_nothing_and_bad_input_is_refused_by_name()
-> anyhow::Result<()> {
    let clusters = TwoClusters::builder()
        .without_destination_agents()
        .start()
        .await?;
    let (code, stdout, stderr) = clusters
        .run_migrate(&with_maps(&["--quiesce", "--dry-run"]))
        .await?;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    // The source's plan: the claim in use on node-a is read there.
    assert!(
        stdout.contains("SOURCE: VolumeBackup haulage-system/move-1"),
        "{stdout}"
    );
    assert!(stdout.contains("node-a"), "{stdout}");
    // The destination's claims, as the controller will create them.
    let row = |source: &str| {
        stdout
            .lines()
            .find(|line| line.starts_with(source))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        row("shop/db "),
        "shop/db shop-b db gp3 ReadWriteOnce 64Mi",
        "{stdout}"
    );
    assert_eq!(
        row("shop/uploads"),
        "shop/uploads shop-b uploads shared ReadWriteMany 64Mi",
        "{stdout}"
    );
    assert_eq!(
        row("web/assets"),
        "web/assets web-b assets shared ReadWriteOnce (then ReadOnlyMany) 64Mi",
        "{stdout}"
    );
    assert_eq!(
        row("web/scratch"),
        "web/scratch web-b scratch gp3 ReadWriteOnce 64Mi",
        "{stdout}"
    );
    assert!(stdout.contains("restore stage pods:"), "{stdout}");
    assert!(
        stdout.contains("4 volumes"),
        "both plans place all four: {stdout}"
    );
    assert!(stdout.contains("- StatefulSet shop/db"), "{stdout}");
    assert!(stdout.contains("- Deployment shop/uploader"), "{stdout}");

    // Nothing changed on either cluster.
    let source = &clusters.source.client;
    let destination = &clusters.destination.client;
    let backups = clusters.source_backups();
    let restores = clusters.destination_restores();
    assert_no_backup_and_no_restore(&backups, &restores).await?;
    let namespaces: Api<Namespace> = Api::all(destination.clone());
    assert!(namespaces.get_opt("shop-b").await?.is_none());
    let sets: Api<StatefulSet> = Api::namespaced(source.clone(), "shop");
    assert_eq!(replicas_and_record(&sets, "db").await?, (1, None));

    // Each refusal names the object, and nothing is created.
    let refused = |arguments: Vec<&'static str>, expected: &'static str| {
        let clusters = &clusters;
        async move {
            let (code, stdout, stderr) = clusters.run_migrate(&arguments).await?;
            assert_eq!(
                code, 1,
                "{arguments:?} was not refused:\n{stdout}\n{stderr}"
            );
            assert!(
                stderr.contains(expected),
                "{arguments:?}: expected {expected:?} in\n{stderr}"
            );
            anyhow::Ok(())
        }
    };
    for (arguments, expected) in [
        (
            with_map_replaced("fast=gp3", "fast=premium", &["--dry-run"])?,
            "--storage-class-map fast=premium: storage class premium does not exist on the destination cluster",
        ),
        (
            with_maps(&["--namespace-map", "blog=blog-b"]),
            "namespace blog is not migrated",
        ),
        (
            with_map_replaced("shop=shop-b", "shop=web-b", &[])?,
            "namespaces shop and web would all be migrated into namespace web-b",
        ),
        (
            with_maps(&["--to-location", "offsite"]),
            "BackupStorageLocation haulage-system/offsite does not exist on the destination cluster",
        ),
        (
            with_maps(&["--from-location", "nearby"]),
            "BackupStorageLocation haulage-system/nearby does not exist on the source cluster",
        ),
    ] {
        refused(arguments, expected).await?;
    }

    // A claim that exists on the destination (first pass).
    create::<Namespace>(
        destination,
        None,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop-b"}}),
    )
    .await?;
    create::<PersistentVolumeClaim>(
        destination,
        Some("shop-b"),
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "db", "namespace": "shop-b"},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "gp3",
                "resources": {"requests": {"storage": "1Gi"}}}}),
    )
    .await?;
    refused(
        with_maps(&[]),
        "claim shop-b/db (for shop/db) already exists on the destination cluster",
    )
    .await?;

    // A ReadWriteOncePod claim in use moves only with --quiesce; a
    // DaemonSet cannot be quiesced.
    create::<PersistentVolumeClaim>(
        source,
        Some("web"),
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "ledger", "namespace": "web"},
            "spec": {"accessModes": ["ReadWriteOncePod"], "storageClassName": "fast",
                "resources": {"requests": {"storage": CLAIM_SIZE}}}}),
    )
    .await?;
    let daemon = json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ledger-agent",
        "uid": "0d9e2b4c-6f1e-4c5a-9a57-3c1b2a7d8e90", "controller": true});
    running_pod(source, "web", "ledger-agent-x", "node-b", "ledger", &daemon).await?;
    refused(
        with_maps(&["--dry-run"]),
        "claim web/ledger is ReadWriteOncePod and pod web/ledger-agent-x uses it",
    )
    .await?;
    refused(
        with_maps(&["--dry-run", "--quiesce"]),
        "belongs to DaemonSet web/ledger-agent, which cannot be scaled to zero",
    )
    .await?;
    assert_no_backup_and_no_restore(&backups, &restores).await?;
    clusters.stop().await;
    Ok(())
}

/// Lines a `haulage migrate` process wrote to `path` so far.
fn written(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = std::fs::File::open(path) {
        let _ = file.read_to_string(&mut text);
    }
    text
}

/// Start `haulage migrate` with [`with_maps`], its output written to
/// `log_name` in the clusters' work directory; returns the process and
/// the log's path.
fn spawn_migrate_logging(
    clusters: &TwoClusters,
    log_name: &str,
) -> anyhow::Result<(tokio::process::Child, std::path::PathBuf)> {
    let log = clusters.work.path().join(log_name);
    let child = clusters
        .migrate(&with_maps(&[]))
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::process::Stdio::inherit())
        .spawn()?;
    Ok((child, log))
}

/// SIGTERM the process (by its id) and return its exit code.
async fn interrupt(child: &mut tokio::process::Child) -> anyhow::Result<i32> {
    let pid = child.id().context("the process already exited")?;
    let status = tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    anyhow::ensure!(status.success(), "kill -TERM {pid} failed");
    let exit = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    Ok(exit.code().unwrap_or(-1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_pass_backs_up_the_source_creates_the_restore_and_a_rerun_resumes_it()
-> anyhow::Result<()> {
    // No agent on the destination: the restore is created, selected and
    // planned, and stays there (until the agent restores, nothing more
    // can be checked of it here; the end-to-end test below does).
    let clusters = TwoClusters::builder()
        .without_destination_agents()
        .start()
        .await?;
    let destination = &clusters.destination.client;
    let backups = clusters.source_backups();
    let restores = clusters.destination_restores();
    let (mut first, first_log) = spawn_migrate_logging(&clusters, "first.log")?;
    let restore = eventually(PASS_DEADLINE, || async {
        Ok(restores.get_opt("move-1").await?)
    })
    .await
    .with_context(|| {
        format!(
            "no VolumeRestore move-1 on the destination:\n{}",
            written(&first_log)
        )
    })?;

    // The restore is made only once the backup completed.
    let backup = backups.get("move-1").await?;
    let status = backup.status.clone().context("backup status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{status:#?}"
    );
    assert_eq!(status.volumes.as_ref().map(|v| v.completed), Some(4));
    assert_eq!(backup.spec.namespaces, ["shop", "web"]);
    assert_eq!(backup.spec.tags, ["migration=move", "pass=1"]);
    assert_eq!(
        backup
            .labels()
            .get("haulage.dev/migration")
            .map(String::as_str),
        Some("move")
    );

    // The restore's spec: the backup's snapshots, the maps, Fail.
    let spec = &restore.spec;
    assert_eq!(spec.source.backup.as_deref(), Some("haulage-system/move-1"));
    assert_eq!(spec.existing_claim, ExistingClaimPolicy::Fail);
    assert_eq!(
        spec.namespace_map,
        [("shop", "shop-b"), ("web", "web-b")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .into()
    );
    assert_eq!(
        spec.storage_class_map,
        [("fast".to_string(), "gp3".to_string())].into()
    );
    assert!(spec.create_namespaces);
    assert!(!spec.keep_writable);
    assert_eq!(spec.size.policy, SizeChoice::Requested);
    assert_eq!(spec.storage_location, None, "the default location");

    // The destination's controller selects the backup's four snapshots
    // from the shared repository and maps each claim.
    let selected = eventually(Duration::from_secs(120), || async {
        let status = restores.get("move-1").await?.status.unwrap_or_default();
        Ok((status.selection.len() == 4).then_some(status.selection))
    })
    .await
    .context("the destination's restore never selected the four snapshots")?;
    let classes: Vec<String> = selected
        .iter()
        .map(|volume| {
            format!(
                "{}/{} {} {} then {}",
                volume.namespace,
                volume.pvc,
                volume.storage_class.as_deref().unwrap_or("-"),
                volume.access_modes.join(","),
                volume.final_access_modes.join(",")
            )
        })
        .collect();
    assert_eq!(
        classes,
        [
            "shop-b/db gp3 ReadWriteOnce then ",
            "shop-b/uploads shared ReadWriteMany then ",
            "web-b/assets shared ReadWriteOnce then ReadOnlyMany",
            "web-b/scratch gp3 ReadWriteOnce then ",
        ]
    );
    for volume in &selected {
        assert!(volume.request_bytes >= volume.data_bytes, "{volume:?}");
        assert_eq!(
            volume.request_bytes,
            64 << 20,
            "the source's request: {volume:?}"
        );
    }
    // Its claims are created in the new namespaces, labelled incomplete.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(destination.clone(), "shop-b");
    let db = eventually(Duration::from_secs(60), || async {
        Ok(claims.get_opt("db").await?)
    })
    .await
    .context("claim shop-b/db was not created")?;
    assert_eq!(
        db.labels()
            .get("haulage.dev/restore-state")
            .map(String::as_str),
        Some("incomplete")
    );
    assert_eq!(
        db.labels().get("app").map(String::as_str),
        Some("db"),
        "the source's labels"
    );
    assert_eq!(
        db.annotations().get("team").map(String::as_str),
        Some("payments"),
        "the source's annotations"
    );

    // Interrupted, the command leaves the objects working.
    assert_eq!(interrupt(&mut first).await?, 130, "{}", written(&first_log));
    let log = written(&first_log);
    assert!(
        log.contains("created VolumeBackup haulage-system/move-1 on the source"),
        "{log}"
    );
    assert!(
        log.contains("created VolumeRestore haulage-system/move-1 on the destination"),
        "{log}"
    );
    assert!(log.contains("restore move-1: "), "{log}");

    // Run again: it follows the same objects, creates nothing.
    let (mut second, second_log) = spawn_migrate_logging(&clusters, "second.log")?;
    eventually(Duration::from_secs(60), || async {
        Ok(written(&second_log)
            .contains("restore move-1: ")
            .then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "the rerun does not follow the restore:\n{}",
            written(&second_log)
        )
    })?;
    assert_eq!(interrupt(&mut second).await?, 130);
    let log = written(&second_log);
    assert!(log.contains("backup move-1: Completed"), "{log}");
    assert!(!log.contains("created"), "nothing is created again:\n{log}");
    assert_eq!(backups.get("move-1").await?.uid(), backup.uid());
    assert_eq!(restores.get("move-1").await?.uid(), restore.uid());
    assert_eq!(backups.list(&ListParams::default()).await?.items.len(), 1);
    assert_eq!(restores.list(&ListParams::default()).await?.items.len(), 1);

    // Other flags than the objects': refused, naming the object.
    let mut other = with_maps(&[]);
    other.retain(|argument| *argument != "--create-namespaces");
    let (code, _, stderr) = clusters.run_migrate(&other).await?;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(
            "VolumeRestore haulage-system/move-1 exists on the destination with another spec"
        ),
        "{stderr}"
    );
    clusters.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quiescing_records_the_replica_counts_and_unquiescing_gives_them_back() -> anyhow::Result<()>
{
    let clusters = TwoClusters::builder()
        .without_destination_agents()
        .start()
        .await?;
    let source = &clusters.source.client;
    let settings = RawSettings {
        namespaces: vec!["shop".to_string(), "web".to_string()],
        name: Some("move".to_string()),
        size: "requested".to_string(),
        controller_namespace: SYSTEM_NAMESPACE.to_string(),
        quiesce: true,
        ..RawSettings::default()
    }
    .validate()?;
    let claims: BTreeSet<(String, String)> = SOURCE_CLAIMS
        .iter()
        .map(|(namespace, name, ..)| (namespace.to_string(), name.to_string()))
        .collect();
    let sets: Api<StatefulSet> = Api::namespaced(source.clone(), "shop");
    let deployments: Api<Deployment> = Api::namespaced(source.clone(), "shop");
    let replica_sets: Api<ReplicaSet> = Api::namespaced(source.clone(), "shop");
    let pods: Api<Pod> = Api::namespaced(source.clone(), "shop");
    assert_eq!(shop_workloads(source).await?, running_as_created());

    let mut display = Display::new(true);
    let cancel = CancellationToken::new();
    let timeout = Duration::from_secs(120);
    // One of the Deployment's pods is stuck terminating: the quiesce
    // records and scales, then waits for it and gives up, naming it.
    let stuck = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "uploader-5d8f",
        "uid": replica_sets.get("uploader-5d8f").await?.uid(), "controller": true});
    running_pod(
        source,
        "shop",
        "uploader-5d8f-stuck",
        "node-a",
        "uploads",
        &stuck,
    )
    .await?;
    pods.patch(
        "uploader-5d8f-stuck",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"metadata": {"labels": {"stuck": "yes"}}})),
    )
    .await?;
    let short = Duration::from_secs(3);
    let error = quiesce_source(source, &settings, &claims, short, &cancel, &mut display)
        .await
        .expect_err("a pod stays");
    assert!(
        format!("{error:#}").contains("pods still use the migrated claims")
            && format!("{error:#}").contains("shop/uploader-5d8f-stuck"),
        "{error:#}"
    );
    assert_eq!(shop_workloads(source).await?, quiesced());
    // Run again while the pod is still there: the Deployment is quiesced
    // again, and the count recorded before is kept, not its zero.
    quiesce_source(source, &settings, &claims, short, &cancel, &mut display)
        .await
        .expect_err("the pod still stays");
    assert_eq!(
        replicas_and_record(&deployments, "uploader").await?,
        (0, Some("2".to_string()))
    );
    // Once it is gone the quiesce completes.
    pods.delete(
        "uploader-5d8f-stuck",
        &kube::api::DeleteParams::default().grace_period(0),
    )
    .await?;
    quiesce_source(source, &settings, &claims, timeout, &cancel, &mut display).await?;
    assert_eq!(
        deployments
            .get("uploader")
            .await?
            .annotations()
            .get(QUIESCED_BY_ANNOTATION)
            .map(String::as_str),
        Some("move")
    );
    assert_eq!(
        replicas_and_record(&replica_sets, "uploader-5d8f").await?,
        (2, None),
        "a Deployment's ReplicaSet is scaled through the Deployment"
    );
    let left = pods
        .list(&ListParams::default().labels("workload=yes"))
        .await?;
    assert!(left.items.is_empty(), "the pods are gone when it returns");

    // `haulage migrate --unquiesce` gives them back.
    let (code, stdout, stderr) = clusters
        .run_migrate(&["-n", "shop", "-n", "web", "--name", "move", "--unquiesce"])
        .await?;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("scaled StatefulSet shop/db back to 1 replicas"),
        "{stdout}"
    );
    assert!(
        stdout.contains("scaled Deployment shop/uploader back to 2 replicas"),
        "{stdout}"
    );
    assert_eq!(shop_workloads(source).await?, running_as_created());
    assert!(
        deployments
            .get("uploader")
            .await?
            .annotations()
            .get(QUIESCED_BY_ANNOTATION)
            .is_none()
    );
    // Nothing left to give back.
    assert_eq!(unquiesce(source, &settings, &|_| {}).await?, 0);

    // A pod that cannot be scaled: refused by name, nothing scaled.
    let daemon = json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "log-shipper",
        "uid": "5b1f0c2e-8d4a-4b7e-9c3f-1a2b3c4d5e6f", "controller": true});
    running_pod(source, "web", "log-shipper-x", "node-c", "scratch", &daemon).await?;
    let error = quiesce_source(source, &settings, &claims, timeout, &cancel, &mut display)
        .await
        .expect_err("a DaemonSet cannot be quiesced");
    assert!(
        format!("{error:#}").contains("DaemonSet web/log-shipper"),
        "{error:#}"
    );
    assert_eq!(replicas_and_record(&sets, "db").await?, (1, None));
    clusters.stop().await;
    Ok(())
}

/// The regular files of `root` with one link and more than 4 KiB,
/// sorted: candidates to change in place or remove.
fn files_to_change(root: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    use std::os::unix::fs::MetadataExt as _;
    let mut stack = vec![root.to_path_buf()];
    let mut files = Vec::new();
    while let Some(directory) = stack.pop() {
        for entry in std::fs::read_dir(&directory)? {
            let entry = entry?;
            let metadata = std::fs::symlink_metadata(entry.path())?;
            if metadata.is_dir() {
                stack.push(entry.path());
            } else if metadata.is_file() && metadata.nlink() == 1 && metadata.len() > 4096 {
                files.push(entry.path());
            }
        }
    }
    files.sort();
    anyhow::ensure!(
        files.len() >= 2,
        "fewer than two files to change under {}",
        root.display()
    );
    Ok(files)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_namespace_pair_moves_to_another_cluster_and_the_cutover_writes_only_the_changes()
-> anyhow::Result<()> {
    let clusters = TwoClusters::builder().volume_bytes(2 << 20).start().await?;
    let source = &clusters.source.client;
    let destination = &clusters.destination.client;
    let restores = clusters.destination_restores();

    // The first pass, to its end, while the workloads run.
    let (code, stdout, stderr) =
        tokio::time::timeout(PASS_DEADLINE * 2, clusters.run_migrate(&with_maps(&[])))
            .await
            .context("the first pass did not finish")??;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("MIGRATION move"), "{stdout}");
    assert!(stdout.contains("no cutover yet"), "{stdout}");
    let first = restores.get("move-1").await?;
    let status = first.status.clone().context("restore status")?;
    assert_eq!(
        status.phase,
        Some(VolumeRestorePhase::Completed),
        "{status:#?}"
    );

    // Every claim on the destination: mapped class, access modes (the
    // ReadOnlyMany one handed back on the volume that was written), a
    // size that holds the data, complete, and the data identical.
    let expected = [
        ("shop", "db", "gp3", "ReadWriteOnce"),
        ("shop", "uploads", "shared", "ReadWriteMany"),
        ("web", "assets", "shared", "ReadOnlyMany"),
        ("web", "scratch", "gp3", "ReadWriteOnce"),
    ];
    for (namespace, name, class, mode) in expected {
        let target = destination_of(namespace);
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(destination.clone(), &target);
        let claim = claims.get(name).await?;
        let spec = claim.spec.clone().context("claim spec")?;
        assert_eq!(
            spec.storage_class_name.as_deref(),
            Some(class),
            "{target}/{name}"
        );
        assert_eq!(
            spec.access_modes.clone().unwrap_or_default(),
            [mode],
            "{target}/{name}"
        );
        assert_eq!(
            claim
                .labels()
                .get("haulage.dev/restore-state")
                .map(String::as_str),
            Some("complete"),
            "{target}/{name}"
        );
        let selected = status
            .selection
            .iter()
            .find(|volume| volume.namespace == target && volume.pvc == name)
            .context("selected")?;
        assert!(
            selected.request_bytes >= selected.data_bytes,
            "{selected:?}"
        );
        let result = status
            .results
            .iter()
            .find(|result| result.namespace == target && result.pvc == name)
            .context("result")?;
        assert!(result.verified_tree.is_some(), "{result:?}");
        assert_same_tree(
            &clusters.source.volumes.join(namespace).join(name),
            &clusters.destination.volumes.join(&target).join(name),
        );
    }
    // The ReadOnlyMany claim is a new claim bound to the volume that was
    // provisioned for (and written through) the ReadWriteOnce one.
    let assets = Api::<PersistentVolumeClaim>::namespaced(destination.clone(), "web-b")
        .get("assets")
        .await?;
    let uid = assets.uid().unwrap_or_default();
    let volume = assets
        .spec
        .as_ref()
        .and_then(|spec| spec.volume_name.clone())
        .context("the ROX claim is bound")?;
    assert_ne!(
        volume,
        format!("pvc-{}", &uid[..uid.len().min(18)]),
        "not a volume of its own"
    );

    // Change files on the source: one rewritten, one added, one removed.
    let db = clusters.source.volumes.join("shop/db");
    let candidates = files_to_change(&db)?;
    let changed = &candidates[0];
    let changed_bytes = std::fs::metadata(changed)?.len();
    std::fs::File::options()
        .write(true)
        .open(changed)?
        .write_all(&random_bytes(99, changed_bytes as usize))?;
    let added_bytes = 300 << 10;
    std::fs::write(db.join("added.bin"), random_bytes(98, added_bytes))?;
    std::fs::remove_file(&candidates[candidates.len() - 1])?;

    // The cutover: quiesce, final backup, Sync restore, report.
    let (code, stdout, stderr) = tokio::time::timeout(
        PASS_DEADLINE * 2,
        clusters.run_migrate(&with_maps(&["--quiesce"])),
    )
    .await
    .context("the cutover did not finish")??;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("downtime: "), "{stdout}");
    assert!(stdout.contains("final pass"), "{stdout}");
    assert_eq!(shop_workloads(source).await?, quiesced());
    let last = restores.get("move-final").await?;
    let status = last.status.clone().context("final status")?;
    assert_eq!(
        status.phase,
        Some(VolumeRestorePhase::Completed),
        "{status:#?}"
    );
    assert_eq!(last.spec.existing_claim, ExistingClaimPolicy::Sync);
    for result in &status.results {
        let expected = if (result.namespace.as_str(), result.pvc.as_str()) == ("shop-b", "db") {
            (changed_bytes + added_bytes as u64) as i64
        } else {
            0
        };
        assert_eq!(
            result.bytes_written,
            Some(expected),
            "{}/{} writes only what changed",
            result.namespace,
            result.pvc
        );
    }
    let transfers: Api<VolumeTransfer> = Api::namespaced(destination.clone(), "shop-b");
    let removed_entries: i64 = transfers
        .list(&ListParams::default().labels(&format!(
            "haulage.dev/owner-uid={}",
            last.uid().unwrap_or_default()
        )))
        .await?
        .items
        .iter()
        .filter_map(|transfer| transfer.status.as_ref()?.entries_removed)
        .sum();
    assert!(
        removed_entries >= 1,
        "the removed file is removed on the destination"
    );
    for (namespace, name, ..) in expected {
        assert_same_tree(
            &clusters.source.volumes.join(namespace).join(name),
            &clusters
                .destination
                .volumes
                .join(destination_of(namespace))
                .join(name),
        );
    }

    assert!(
        clusters
            .minio
            .multipart_uploads(crate::support::migration::BUCKET, "")
            .await?
            .is_empty(),
        "no upload left open"
    );

    // Rolled back on the source when asked.
    let (code, stdout, stderr) = clusters
        .run_migrate(&["-n", "shop", "-n", "web", "--name", "move", "--unquiesce"])
        .await?;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert_eq!(shop_workloads(source).await?, running_as_created());
    clusters.stop().await;
    Ok(())
}
