//! `haulage bench --claim NAMESPACE/NAME`: each named claim (and no other)
//! measured in the stage pod that would back it up, against the default
//! location, its figures printed per claim and per storage class; no
//! snapshot written, no benchmark object left in the bucket, and the
//! VolumeBackups, stage pods and copies of credentials gone afterwards.

use std::time::Duration;

use anyhow::Context;
use haulage::api::VolumeBackup;
use haulage::api::labels::SYSTEM_NAMESPACE;
use kube::api::{Api, ListParams};

use crate::support::fixture::{BACKUP_DEADLINE, Fixture, STORAGE_CLASS, eventually, no_leftovers};

/// Regular files and their bytes under `root`.
fn files_and_bytes(root: &std::path::Path) -> anyhow::Result<(i64, i64)> {
    let (mut files, mut bytes) = (0, 0);
    let mut directories = vec![root.to_path_buf()];
    while let Some(directory) = directories.pop() {
        for entry in std::fs::read_dir(&directory)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                directories.push(entry.path());
            } else if kind.is_file() {
                files += 1;
                bytes += entry.metadata()?.len() as i64;
            }
        }
    }
    Ok((files, bytes))
}

/// `haulage bench ARGS` against the fixture's cluster, killed after
/// [`BACKUP_DEADLINE`].
async fn haulage_bench(fixture: &Fixture, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_haulage"))
        .arg("bench")
        .args(args)
        .env("KUBECONFIG", fixture.cluster.kubeconfig())
        .env_remove("HAULAGE_REPO")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(BACKUP_DEADLINE, run)
        .await
        .with_context(|| {
            format!(
                "haulage bench {} did not end within {BACKUP_DEADLINE:?}:\n{}",
                args.join(" "),
                fixture.kubelet.all_agent_logs()
            )
        })?
        .context("haulage bench")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn haulage_bench_claim_measures_the_named_claims_in_their_stage_pods_and_leaves_nothing()
-> anyhow::Result<()> {
    let fixture = Fixture::builder().volume_bytes(4 << 20).start().await?;

    // A claim that does not exist is refused before anything is created.
    let missing = haulage_bench(&fixture, &["--claim", "shop/nope"]).await?;
    assert!(!missing.status.success());
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(
        said.contains("PersistentVolumeClaim shop/nope does not exist"),
        "{said}"
    );

    let output = haulage_bench(
        &fixture,
        &[
            "--claim", "shop/db", "--claim", "web/logs", "--size", "2MiB", "--json",
        ],
    )
    .await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "haulage bench --claim: {stderr}\n{}",
        fixture.kubelet.all_agent_logs()
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("JSON report: {}", String::from_utf8_lossy(&output.stdout)))?;
    let claims = report["claims"].as_array().context("claims")?;
    let named: Vec<String> = claims
        .iter()
        .map(|claim| format!("{}/{}", claim["namespace"], claim["pvc"]).replace('"', ""))
        .collect();
    // Only the named claims: shop's uploads and archive, web's content are
    // not measured.
    assert_eq!(named, ["shop/db", "web/logs"], "{report:#}");
    let mut total = 0;
    for claim in claims {
        let name = format!("{}/{}", claim["namespace"], claim["pvc"]).replace('"', "");
        assert_eq!(claim["phase"], "Completed", "{name}: {claim:#}");
        assert!(claim.get("snapshotId").is_none(), "{name} has a snapshot");
        let figures = &claim["benchmark"];
        let (files, bytes) = files_and_bytes(&fixture.volumes.join(&name))?;
        assert_eq!(figures["files"], files, "{name}: {figures:#}");
        assert_eq!(figures["bytes"], bytes, "{name}: {figures:#}");
        assert_eq!(figures["storageClass"], STORAGE_CLASS, "{name}");
        for rate in [
            "readBytesPerSecond",
            "pipelineBytesPerSecond",
            "uploadBytesPerSecond",
            "downloadBytesPerSecond",
            "estimateBytesPerSecond",
        ] {
            assert!(
                figures[rate].as_i64().is_some_and(|rate| rate > 0),
                "{name}: {rate} in {figures:#}"
            );
        }
        assert!(
            figures["limitedBy"].as_str().is_some_and(|s| !s.is_empty()),
            "{name}: {figures:#}"
        );
        total += bytes;
    }
    let classes = report["storageClasses"].as_array().context("classes")?;
    assert_eq!(classes.len(), 1, "{report:#}");
    assert_eq!(classes[0]["storageClass"], STORAGE_CLASS);
    assert_eq!(classes[0]["claims"], 2);
    assert_eq!(classes[0]["bytes"], total);

    // The table: a row per claim, a line per storage class.
    let table = haulage_bench(&fixture, &["--claim", "web/content", "--size", "1MiB"]).await?;
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    let row = text
        .lines()
        .find(|line| line.starts_with("web/content "))
        .with_context(|| format!("no row of web/content in\n{text}"))?;
    assert!(row.contains(STORAGE_CLASS), "{row}");
    assert!(
        text.lines().any(
            |line| line.starts_with(&format!("{STORAGE_CLASS}: 1 claim,"))
                && line.contains("a first backup takes about")
        ),
        "{text}"
    );

    // Nothing that lasts: no snapshot, no benchmark object, no
    // VolumeBackup, stage pod or copy of credentials.
    let repository = fixture.repository().await?;
    let (snapshots, _) = repository.list_snapshots().await?;
    assert!(snapshots.is_empty(), "a benchmark wrote {snapshots:?}");
    let objects = fixture.store.list(haulage::bench::BENCH_PREFIX).await?;
    assert!(objects.is_empty(), "benchmark objects left: {objects:?}");
    let backups: Api<VolumeBackup> = Api::namespaced(fixture.client.clone(), SYSTEM_NAMESPACE);
    eventually(Duration::from_secs(60), || async {
        let left = backups
            .list(&ListParams::default().labels("haulage.dev/benchmark"))
            .await?;
        Ok(left.items.is_empty().then_some(()))
    })
    .await
    .context("the benchmark's VolumeBackups were not deleted")?;
    no_leftovers(&fixture.client).await?;
    fixture.stop().await;
    Ok(())
}
