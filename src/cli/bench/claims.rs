//! `haulage bench --claim NAMESPACE/NAME`: the benchmark in the cluster.
//! One VolumeBackup with `spec.benchmark` per namespace of the claims
//! (`claimNames` picks them), created in the controller's namespace with a
//! ttl of an hour (so one left behind by an interrupted run goes by
//! itself), followed until it is final, its figures printed per claim and
//! per storage class, then deleted (`--keep` keeps it). Ctrl-C deletes
//! it, which stops its stage pods.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use tokio_util::sync::CancellationToken;

use super::BenchArgs;
use crate::api::backup::{DeletionPolicy, VolumeResult};
use crate::api::benchmark::{
    BenchmarkRequest, ClaimBenchmark, MAX_BENCHMARK_SIZE_BYTES, StorageClassBenchmark,
};
use crate::api::{VolumeBackup, VolumeBackupPhase, VolumeBackupSpec};
use crate::cli::Outcome;
use crate::cli::progress::human_bytes;

/// Label of the VolumeBackups one run creates: its run id.
pub const BENCHMARK_LABEL: &str = "haulage.dev/benchmark";
/// How long a benchmark's VolumeBackup is kept after it finished, when the
/// CLI that created it did not delete it.
const KEPT_FOR: &str = "1h";
/// Between two reads of the VolumeBackups.
const POLL_INTERVAL: Duration = Duration::from_secs(2);
/// After how long a VolumeBackup no replica claimed gets a hint.
const UNCLAIMED_HINT_AFTER: Duration = Duration::from_secs(60);
/// Least bytes a benchmark measures with.
const MIN_SIZE_BYTES: u64 = 1024 * 1024;

/// What the run prints with `--json`.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ClaimsReport {
    /// One entry per claim, with its figures once measured.
    claims: Vec<VolumeResult>,
    /// The figures per storage class.
    storage_classes: Vec<StorageClassBenchmark>,
}

pub(super) async fn run(args: &BenchArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    if args.repo.is_some() && std::env::var_os("HAULAGE_REPO").is_none() {
        anyhow::bail!(
            "--repo names a repository for a benchmark on this machine; with --claim the stage pod measures against a BackupStorageLocation: name it with --location"
        );
    }
    let size = args.size.as_u64();
    if !(MIN_SIZE_BYTES..=MAX_BENCHMARK_SIZE_BYTES as u64).contains(&size) {
        anyhow::bail!(
            "--size {} is out of range with --claim: between 1MiB and 512MiB (the sample backups are stored in the stage pod's scratch space of 1 GiB)",
            args.size
        );
    }
    let client = crate::cli::cluster::client(&args.cluster).await?;
    let mut by_namespace: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (namespace, name) in &args.claims {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
        let found = claims
            .get_opt(name)
            .await
            .with_context(|| format!("cannot read PersistentVolumeClaim {namespace}/{name}"))?;
        if found.is_none() {
            anyhow::bail!(
                "PersistentVolumeClaim {namespace}/{name} does not exist: name claims as NAMESPACE/NAME (`kubectl get pvc -A` lists them)"
            );
        }
        let names = by_namespace.entry(namespace).or_default();
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    let backups: Api<VolumeBackup> = Api::namespaced(client, &args.controller_namespace);
    let run_id = hex::encode(rand::random::<[u8; 4]>());
    let mut created = Vec::new();
    let mut result = Ok(());
    for (index, (namespace, claim_names)) in by_namespace.into_iter().enumerate() {
        let name = format!("bench-{run_id}-{index}");
        let mut backup = VolumeBackup::new(
            &name,
            VolumeBackupSpec {
                namespaces: vec![namespace.to_string()],
                selector: None,
                claim_names: claim_names.clone(),
                storage_location: args.location.clone(),
                parent_policy: Default::default(),
                tags: Vec::new(),
                fail_after_unavailable_seconds: None,
                agent_user: None,
                deletion_policy: DeletionPolicy::Retain,
                ttl: Some(KEPT_FOR.to_string()),
                benchmark: Some(BenchmarkRequest {
                    size_bytes: Some(size as i64),
                }),
            },
        );
        backup.metadata.namespace = Some(args.controller_namespace.clone());
        backup.metadata.labels = Some([(BENCHMARK_LABEL.to_string(), run_id.clone())].into());
        match backups.create(&PostParams::default(), &backup).await {
            Ok(_) => {
                eprintln!(
                    "created VolumeBackup {}/{name}: benchmark of {} in namespace {namespace}",
                    args.controller_namespace,
                    claim_names.join(", ")
                );
                created.push(name);
            }
            Err(error) => {
                result = Err(anyhow::Error::new(error).context(format!(
                    "cannot create VolumeBackup {}/{name} (is haulage installed, with its CRDs, in namespace {}?)",
                    args.controller_namespace, args.controller_namespace
                )));
                break;
            }
        }
    }
    let finished = match result {
        Ok(()) => follow(&backups, &created, &cancel).await,
        Err(error) => Err(error),
    };
    if !args.keep || finished.is_err() {
        for name in &created {
            match backups.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => eprintln!(
                    "warning: VolumeBackup {}/{name} was not deleted ({error}); it goes an hour after it finished, or delete it with kubectl",
                    args.controller_namespace
                ),
            }
        }
    }
    let finished = finished?;
    let claims: Vec<VolumeResult> = finished
        .iter()
        .flat_map(|backup| {
            backup
                .status
                .iter()
                .flat_map(|status| status.results.clone())
        })
        .collect();
    let storage_classes = crate::api::benchmark::by_storage_class(
        claims.iter().filter_map(|claim| claim.benchmark.as_ref()),
    );
    let all_measured = finished.iter().all(|backup| {
        backup.status.as_ref().and_then(|status| status.phase) == Some(VolumeBackupPhase::Completed)
    });
    let report = ClaimsReport {
        claims,
        storage_classes,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_claims(&report, &finished);
    }
    Ok(if all_measured {
        Outcome::Success
    } else {
        Outcome::Failed
    })
}

/// Read `names` until every one is final, saying each phase change on
/// standard error.
async fn follow(
    backups: &Api<VolumeBackup>,
    names: &[String],
    cancel: &CancellationToken,
) -> anyhow::Result<Vec<VolumeBackup>> {
    use crate::cli::transfer_owner::TransferOwner as _;
    let mut shown: BTreeMap<&str, String> = BTreeMap::new();
    let started = std::time::Instant::now();
    let mut hinted = false;
    loop {
        let mut finished = Vec::new();
        for name in names {
            let backup = backups
                .get(name)
                .await
                .with_context(|| format!("cannot read VolumeBackup {name}"))?;
            let line = match backup.message() {
                Some(message) => format!("{}: {message}", backup.shown_phase()),
                None => backup.shown_phase(),
            };
            if shown.get(name.as_str()) != Some(&line) {
                eprintln!("VolumeBackup {name}: {line}");
                shown.insert(name, line);
            }
            if backup.phase().is_none() && !hinted && started.elapsed() >= UNCLAIMED_HINT_AFTER {
                eprintln!(
                    "VolumeBackup {name}: no controller replica has claimed it after {}s: is `haulage controller` running, watching namespace {}? (`kubectl -n {} get pods`)",
                    UNCLAIMED_HINT_AFTER.as_secs(),
                    backups.namespace().unwrap_or_default(),
                    backups.namespace().unwrap_or_default()
                );
                hinted = true;
            }
            if backup.is_finished() {
                finished.push(backup);
            }
        }
        if finished.len() == names.len() {
            return Ok(finished);
        }
        tokio::select! {
            _ = cancel.cancelled() => anyhow::bail!("interrupted: the benchmark's VolumeBackups are deleted, which stops their stage pods"),
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
}

/// A figure of the status, bytes per second.
fn rate(bytes_per_second: i64) -> String {
    super::per_second(bytes_per_second as f64)
}

/// An estimate of the status, whole seconds (`i64::MAX`: never).
fn duration(seconds: i64) -> String {
    super::about(if seconds == i64::MAX {
        f64::INFINITY
    } else {
        seconds as f64
    })
}

fn print_claims(report: &ClaimsReport, backups: &[VolumeBackup]) {
    for backup in backups {
        if let Some(status) = &backup.status
            && status.phase != Some(VolumeBackupPhase::Completed)
        {
            println!(
                "VolumeBackup {}: {:?}: {}",
                kube::ResourceExt::name_any(backup),
                status.phase,
                status.message.as_deref().unwrap_or("")
            );
        }
    }
    println!(
        "{:<32} {:<16} {:>10} {:>12} {:>12} {:>12} {:>12}  limited by",
        "claim", "storage class", "bytes", "read", "pipeline", "upload", "estimate"
    );
    for claim in &report.claims {
        let name = format!("{}/{}", claim.namespace, claim.pvc);
        match &claim.benchmark {
            Some(figures) => print_claim(&name, figures),
            None => println!(
                "{name:<32} {:?}: {}",
                claim.phase,
                claim.message.as_deref().unwrap_or("not measured")
            ),
        }
    }
    if report.storage_classes.is_empty() {
        return;
    }
    println!();
    for class in &report.storage_classes {
        let name = if class.storage_class.is_empty() {
            "(no storage class)"
        } else {
            &class.storage_class
        };
        println!(
            "{name}: {} {}, {}; read {}, pipeline {}, upload {} (slowest claim); a first backup takes about {} one volume after the other at its slowest claim's pace, limited by {}",
            class.claims,
            if class.claims == 1 { "claim" } else { "claims" },
            human_bytes(class.bytes.max(0) as u64),
            rate(class.read_bytes_per_second),
            rate(class.pipeline_bytes_per_second),
            rate(class.upload_bytes_per_second),
            duration(class.estimate_seconds),
            class.limited_by
        );
    }
}

fn print_claim(name: &str, figures: &ClaimBenchmark) {
    println!(
        "{name:<32} {:<16} {:>10} {:>12} {:>12} {:>12} {:>12}  {}",
        figures.storage_class.as_deref().unwrap_or("-"),
        human_bytes(figures.bytes.max(0) as u64),
        rate(figures.read_bytes_per_second),
        rate(figures.pipeline_bytes_per_second),
        rate(figures.upload_bytes_per_second),
        duration(figures.estimate_seconds),
        figures.limited_by
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_claim_is_named_namespace_slash_name() {
        assert_eq!(
            super::super::parse_claim("shop/db"),
            Ok(("shop".to_string(), "db".to_string()))
        );
        for wrong in ["db", "/db", "shop/", "a/b/c"] {
            assert!(super::super::parse_claim(wrong).is_err(), "{wrong}");
        }
    }
}
