//! `haulage prune`: reclaim the space of data no snapshot references.

use std::time::Duration;

use clap::Args;
use tokio_util::sync::CancellationToken;

use super::progress::human_bytes;
use super::{LockArgs, Outcome, RepoArgs};
use crate::api::location::DEFAULT_KEEP_CHECKPOINTS_WITHIN;
use crate::engine::prune::{PruneOptions, prune};
use crate::repo::prune::PruneSettings;

/// Default safety margin: longer than any backup that holds no lock (an
/// older haulage's agents, which took none) is expected to run.
pub const DEFAULT_SAFETY_MARGIN: &str = "24h";

/// Arguments of `haulage prune`.
#[derive(Debug, Args)]
pub struct PruneArgs {
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub lock: LockArgs,
    /// A pack unneeded now is deleted only by a prune at least this much
    /// later (0s deletes at once: safe when every writer takes locks, as
    /// the CLI and the cluster's agents of this version do).
    #[arg(long, value_name = "DURATION", default_value = DEFAULT_SAFETY_MARGIN, value_parser = humantime::parse_duration)]
    pub safety_margin: Duration,
    /// Keep the checkpoint of an unfinished backup (and the data it names,
    /// so that backup can still continue from it) written within this;
    /// delete older ones (0s deletes every checkpoint not written this
    /// second).
    #[arg(long, value_name = "DURATION", default_value = DEFAULT_KEEP_CHECKPOINTS_WITHIN, value_parser = humantime::parse_duration)]
    pub keep_checkpoints_within: Duration,
    /// Repack packs whose unused share of bytes is above this (percent).
    #[arg(long, value_name = "PERCENT", default_value = "10%", value_parser = parse_percent)]
    pub repack_threshold: f64,
    /// Only show what would be repacked, marked and deleted, and the bytes.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn parse_percent(text: &str) -> Result<f64, String> {
    let number = text.strip_suffix('%').unwrap_or(text).trim();
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a percentage like 10%"))?;
    if !(0.0..=100.0).contains(&value) {
        return Err(format!("{text:?} must be between 0% and 100%"));
    }
    Ok(value / 100.0)
}

pub async fn run(args: PruneArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let repository = args.repo.open().await?;
    let options = PruneOptions {
        settings: PruneSettings {
            repack_threshold: args.repack_threshold,
            safety_margin_seconds: args.safety_margin.as_secs() as i64,
            checkpoint_max_age_seconds: i64::try_from(args.keep_checkpoints_within.as_secs())
                .unwrap_or(i64::MAX),
        },
        dry_run: args.dry_run,
        lock_wait: args.lock.retry_lock,
    };
    let report = prune(&repository, &options, &cancel).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(Outcome::Success);
    }
    let dry = if report.dry_run {
        " (dry run: nothing changed)"
    } else {
        ""
    };
    println!(
        "{} snapshots{} reference {} of {} in {} packs{dry}",
        report.snapshots,
        if report.checkpoints_kept > 0 {
            format!(" and {} checkpoints", report.checkpoints_kept)
        } else {
            String::new()
        },
        human_bytes(report.used_bytes),
        human_bytes(report.total_bytes),
        report.packs
    );
    let would = |done: &str, planned: &str| {
        if report.dry_run {
            planned.to_string()
        } else {
            done.to_string()
        }
    };
    println!(
        "  {} {} packs ({} of needed blobs copied into new packs)",
        would("repacked", "would repack"),
        report.repacked_packs,
        human_bytes(report.repacked_bytes_written)
    );
    println!(
        "  {} {} packs for deletion ({}), deleted after the safety margin of {}",
        would("marked", "would mark"),
        report.marked_packs,
        human_bytes(report.marked_bytes),
        humantime::format_duration(args.safety_margin)
    );
    println!(
        "  {} {} packs, {} reclaimed{}",
        would("deleted", "would delete now"),
        report.deleted_packs,
        human_bytes(report.deleted_bytes),
        if report.index_files_replaced > 0 {
            format!(" ({} index files rewritten)", report.index_files_replaced)
        } else {
            String::new()
        }
    );
    if report.index_files_written > 0 && report.deleted_packs == 0 {
        println!(
            "  {} {} index files into {} (every backup writes its own; fewer make every backup, restore and prune start with fewer reads)",
            would("gathered", "would gather"),
            report.index_files,
            report.index_files_written
        );
    }
    if report.checkpoints_kept + report.checkpoints_deleted > 0 {
        println!(
            "  kept {} checkpoints of unfinished backups written within {} (and their data), {} {} older ones",
            report.checkpoints_kept,
            humantime::format_duration(args.keep_checkpoints_within),
            would("deleted", "would delete"),
            report.checkpoints_deleted
        );
    }
    if report.checkpoints_unreadable > 0 {
        eprintln!(
            "warning: {} checkpoints cannot be read (damaged); left as they are, their data not kept, and a backup ignores them",
            report.checkpoints_unreadable
        );
    }
    if report.waiting_packs > 0 {
        println!(
            "  {} packs ({}) wait for their safety margin",
            report.waiting_packs,
            human_bytes(report.waiting_bytes)
        );
    }
    if report.unmarked_packs > 0 {
        println!(
            "  {} marked packs are needed again and stay",
            report.unmarked_packs
        );
    }
    if report.abandoned_uploads_removed > 0 {
        println!(
            "  removed {} incomplete uploads older than the safety margin and an hour (left by writers that died)",
            report.abandoned_uploads_removed
        );
    }
    if let Some(problem) = &report.abandoned_uploads_problem {
        eprintln!("warning: {problem}");
    }
    if let Some(reason) = &report.deletion_deferred {
        println!("  deletion deferred: {reason}");
    }
    for problem in &report.damaged_packs {
        eprintln!("warning: {problem}");
    }
    Ok(Outcome::damaged_if(!report.damaged_packs.is_empty()))
}
