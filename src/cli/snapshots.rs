//! `haulage snapshots --repo URL [-n NS]... [--backup NAME] [--claim NAME]
//! [-o table|json]`: the snapshots of a repository, oldest first, chosen by
//! the claim each one records (its namespace, the VolumeBackup that read
//! it, its name), with that record in the JSON form, so a destination
//! cluster's team can see what a storage location holds before writing a
//! VolumeRestore.

use clap::{Args, ValueEnum};
use serde_json::json;

use super::progress::human_bytes;
use super::{Outcome, RepoArgs};
use crate::repo::ObjectId;
use crate::repo::snapshot::Snapshot;

/// Arguments of `haulage snapshots`.
#[derive(Debug, Args)]
pub struct SnapshotsArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    /// Only snapshots of claims in this source namespace; repeat for
    /// several.
    #[arg(short = 'n', long = "namespace", value_name = "NAMESPACE")]
    pub namespaces: Vec<String>,
    /// Only snapshots read by this VolumeBackup: `namespace/name`, or the
    /// name alone.
    #[arg(long, value_name = "NAME")]
    pub backup: Option<String>,
    /// Only snapshots of this claim: `namespace/name`, or the name alone.
    #[arg(long, value_name = "NAME")]
    pub claim: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = SnapshotsFormat::Table)]
    pub output: SnapshotsFormat,
    /// The same as `-o json`.
    #[arg(long)]
    pub json: bool,
}

/// How `haulage snapshots` prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SnapshotsFormat {
    /// One line per snapshot.
    Table,
    /// A JSON array: id, time, source, tree, summary and claim record of
    /// each.
    Json,
}

/// Which snapshots to list: every one when nothing is set; otherwise only
/// those whose claim record matches every filter set (a snapshot of a
/// directory records no claim and matches none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotFilter {
    /// Source namespaces (any of them).
    pub namespaces: Vec<String>,
    /// The VolumeBackup.
    pub backup: Option<String>,
    /// The claim.
    pub claim: Option<String>,
}

impl SnapshotFilter {
    /// Whether `snapshot` is listed.
    pub fn matches(&self, snapshot: &Snapshot) -> bool {
        if self.namespaces.is_empty() && self.backup.is_none() && self.claim.is_none() {
            return true;
        }
        let Some(record) = &snapshot.claim else {
            return false;
        };
        (self.namespaces.is_empty() || self.namespaces.contains(&record.namespace))
            && self
                .backup
                .as_deref()
                .is_none_or(|wanted| record.is_from_backup(wanted))
            && self
                .claim
                .as_deref()
                .is_none_or(|wanted| record.is_claim(wanted))
    }
}

/// One snapshot as `-o json` prints it. The summary's per-file warnings
/// are left out (`warningCount` says how many; `haulage restore` and the
/// manifest have them).
pub fn snapshot_json(id: &ObjectId, snapshot: &Snapshot) -> serde_json::Value {
    let mut summary = snapshot.summary.clone();
    summary.warnings.clear();
    json!({
        "id": id.to_hex(),
        "time": snapshot.time,
        "hostname": snapshot.hostname,
        "source": snapshot.source,
        "tree": snapshot.tree.to_hex(),
        "parent": snapshot.parent.map(|id| id.to_hex()),
        "tags": snapshot.tags,
        "files": snapshot.summary.files,
        "totalBytes": snapshot.summary.total_bytes,
        "warningCount": snapshot.summary.warning_count,
        "summary": summary,
        "claim": snapshot.claim,
    })
}

pub async fn run(args: SnapshotsArgs) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    let (snapshots, damaged) = repository.list_snapshots().await?;
    let filter = SnapshotFilter {
        namespaces: args.namespaces.clone(),
        backup: args.backup.clone(),
        claim: args.claim.clone(),
    };
    let chosen: Vec<_> = snapshots
        .iter()
        .filter(|(_, snapshot)| filter.matches(snapshot))
        .collect();
    if args.json || args.output == SnapshotsFormat::Json {
        let list: Vec<_> = chosen
            .iter()
            .map(|(id, snapshot)| snapshot_json(id, snapshot))
            .collect();
        println!("{}", serde_json::Value::Array(list));
    } else {
        println!(
            "{:<10} {:<21} {:<16} {:>8} {:>11}  SOURCE",
            "ID", "TIME", "HOST", "FILES", "SIZE"
        );
        for (id, snapshot) in &chosen {
            println!(
                "{:<10} {:<21} {:<16} {:>8} {:>11}  {}",
                id.short(),
                snapshot.time_to_the_second(),
                snapshot.hostname.chars().take(16).collect::<String>(),
                snapshot.summary.files,
                human_bytes(snapshot.summary.total_bytes),
                snapshot.source
            );
        }
        if chosen.len() == snapshots.len() {
            println!("{} snapshots", snapshots.len());
        } else {
            println!("{} of {} snapshots", chosen.len(), snapshots.len());
        }
    }
    for error in &damaged {
        eprintln!("warning: {error}");
    }
    Ok(Outcome::damaged_if(!damaged.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo::snapshot::{ClaimRecord, RootAttributes, SnapshotSummary};

    fn snapshot(claim: Option<(&str, &str, &str)>) -> Snapshot {
        Snapshot {
            format_version: 1,
            time: "2026-12-01T00:00:00Z".to_string(),
            hostname: "haulage-stage-pod".to_string(),
            source: claim.map_or("/srv".to_string(), |(namespace, name, _)| {
                format!("{namespace}/{name}")
            }),
            tree: crate::repo::BlobId([7; 32]),
            root: RootAttributes::default(),
            parent: None,
            tags: Default::default(),
            claim: claim.map(|(namespace, name, backup)| ClaimRecord {
                namespace: namespace.to_string(),
                name: name.to_string(),
                backup: Some(backup.to_string()),
                storage_class: Some("fast".to_string()),
                requested_bytes: 1 << 30,
                ..ClaimRecord::default()
            }),
            summary: SnapshotSummary {
                files: 3,
                total_bytes: 300,
                ..SnapshotSummary::default()
            },
        }
    }

    #[test]
    fn no_filter_lists_every_snapshot_a_filter_only_matching_claim_records() {
        let db = snapshot(Some(("shop", "db", "ops/nightly")));
        let logs = snapshot(Some(("web", "logs", "ops/weekly")));
        let directory = snapshot(None);
        let everything = SnapshotFilter::default();
        assert!(
            [&db, &logs, &directory]
                .iter()
                .all(|s| everything.matches(s))
        );

        let shop_nightly = SnapshotFilter {
            namespaces: vec!["shop".to_string()],
            backup: Some("nightly".to_string()),
            claim: None,
        };
        assert!(shop_nightly.matches(&db));
        assert!(!shop_nightly.matches(&logs));
        assert!(!shop_nightly.matches(&directory));

        let two_namespaces = SnapshotFilter {
            namespaces: vec!["shop".to_string(), "web".to_string()],
            ..SnapshotFilter::default()
        };
        assert!(two_namespaces.matches(&db) && two_namespaces.matches(&logs));

        let by_claim = SnapshotFilter {
            claim: Some("web/logs".to_string()),
            ..SnapshotFilter::default()
        };
        assert!(by_claim.matches(&logs) && !by_claim.matches(&db));
        let wrong_backup = SnapshotFilter {
            backup: Some("other/nightly".to_string()),
            ..SnapshotFilter::default()
        };
        assert!(!wrong_backup.matches(&db));
    }

    #[test]
    fn the_json_form_carries_the_tree_summary_and_claim_record() {
        let mut db = snapshot(Some(("shop", "db", "ops/nightly")));
        db.summary.warning_count = 1;
        db.summary
            .warnings
            .push(crate::repo::snapshot::FileWarning {
                path: "secret".to_string(),
                message: "permission denied".to_string(),
            });
        let value = snapshot_json(&ObjectId([1; 32]), &db);
        assert_eq!(value["id"], ObjectId([1; 32]).to_hex());
        assert_eq!(value["tree"], crate::repo::BlobId([7; 32]).to_hex());
        assert_eq!(value["source"], "shop/db");
        assert_eq!(value["summary"]["files"], 3);
        assert_eq!(value["summary"]["warningCount"], 1);
        assert!(value["summary"].get("warnings").is_none());
        assert_eq!(value["claim"]["namespace"], "shop");
        assert_eq!(value["claim"]["backup"], "ops/nightly");
        assert_eq!(value["claim"]["storageClass"], "fast");
        assert_eq!(value["claim"]["requestedBytes"], 1 << 30);
        assert!(snapshot_json(&ObjectId([1; 32]), &snapshot(None))["claim"].is_null());
    }
}
