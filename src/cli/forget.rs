//! `haulage forget`: forget snapshots by a retention policy or by id.

use clap::Args;
use serde_json::json;

use super::{LockArgs, Outcome, RepoArgs};
use crate::engine::forget::{forget_snapshots, plan_forget};
use crate::repo::lock::LockKind;
use crate::repo::policy::{GroupBy, KeepCount, RetentionPolicy, TagMatch};

/// Arguments of `haulage forget`.
#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// Snapshots to forget by id or prefix (instead of a policy).
    #[arg(conflicts_with_all = ["keep_last", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly", "keep_yearly", "keep_tag"])]
    pub snapshots: Vec<String>,
    #[command(flatten)]
    pub repo: RepoArgs,
    #[command(flatten)]
    pub lock: LockArgs,
    /// Keep the N newest snapshots (-1: all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_last: Option<i64>,
    /// Keep the newest snapshot of each of the N newest hours (-1: all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_hourly: Option<i64>,
    /// Keep the newest snapshot of each of the N newest days (-1: all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_daily: Option<i64>,
    /// Keep the newest snapshot of each of the N newest ISO weeks (-1: all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_weekly: Option<i64>,
    /// Keep the newest snapshot of each of the N newest months (-1: all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_monthly: Option<i64>,
    /// Keep the newest snapshot of each of the N newest years (-1: all).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_yearly: Option<i64>,
    /// Keep every snapshot that has all these tags (KEY or KEY=VALUE,
    /// comma-separated); repeatable, any one set keeps.
    #[arg(long, value_name = "TAGS")]
    pub keep_tag: Vec<String>,
    /// Apply the policy to each group of snapshots sharing these: source,
    /// host, tags (comma-separated; empty: all snapshots together).
    #[arg(long, value_name = "FIELDS", default_value = "source")]
    pub group_by: String,
    /// Only show what would be forgotten and why the rest is kept.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn count(flag: &str, value: Option<i64>) -> anyhow::Result<KeepCount> {
    match value {
        None => Ok(KeepCount::None),
        Some(value) => KeepCount::from_restic(value)
            .ok_or_else(|| anyhow::anyhow!("--{flag} {value}: expected -1 (all), 0 or a count")),
    }
}

impl ForgetArgs {
    fn policy(&self) -> anyhow::Result<RetentionPolicy> {
        let mut tags = Vec::new();
        for set in &self.keep_tag {
            let parsed: Result<Vec<_>, _> =
                set.split(',').map(str::trim).map(TagMatch::parse).collect();
            tags.push(parsed.map_err(anyhow::Error::msg)?);
        }
        Ok(RetentionPolicy {
            last: count("keep-last", self.keep_last)?,
            hourly: count("keep-hourly", self.keep_hourly)?,
            daily: count("keep-daily", self.keep_daily)?,
            weekly: count("keep-weekly", self.keep_weekly)?,
            monthly: count("keep-monthly", self.keep_monthly)?,
            yearly: count("keep-yearly", self.keep_yearly)?,
            tags,
        })
    }
}

pub async fn run(args: ForgetArgs) -> anyhow::Result<Outcome> {
    let policy = args.policy()?;
    let group_by = GroupBy::parse(&args.group_by).map_err(anyhow::Error::msg)?;
    if args.snapshots.is_empty() && policy.is_empty() {
        anyhow::bail!(
            "no policy given and no snapshot named: nothing would be kept, so nothing is forgotten; \
             give --keep-last/--keep-hourly/--keep-daily/--keep-weekly/--keep-monthly/--keep-yearly/--keep-tag, or snapshot ids"
        );
    }
    let repository = args.repo.open().await?;
    let lock = super::take_lock(&repository, LockKind::Shared, "forget", &args.lock).await?;
    let result = forget(&args, &repository, &policy, group_by).await;
    lock.release().await?;
    result
}

async fn forget(
    args: &ForgetArgs,
    repository: &crate::engine::Repository,
    policy: &RetentionPolicy,
    group_by: GroupBy,
) -> anyhow::Result<Outcome> {
    let verb = if args.dry_run {
        "would forget"
    } else {
        "forgot"
    };
    if !args.snapshots.is_empty() {
        let mut ids = Vec::new();
        for text in &args.snapshots {
            ids.push(repository.resolve_snapshot(text).await?);
        }
        if !args.dry_run {
            forget_snapshots(repository, &ids).await?;
        }
        if args.json {
            let list: Vec<_> = ids.iter().map(|id| id.to_hex()).collect();
            println!("{}", json!({ "dryRun": args.dry_run, "removed": list }));
        } else {
            for id in &ids {
                println!("{verb} snapshot {}", id.short());
            }
        }
        return Ok(Outcome::Success);
    }
    let plan = plan_forget(repository, policy, group_by).await?;
    let removals = plan.removals();
    if args.json {
        let groups: Vec<_> = plan
            .groups
            .iter()
            .map(|group| {
                let (keep, remove): (Vec<_>, Vec<_>) =
                    group.decisions.iter().partition(|decision| decision.keep);
                let describe = |decision: &&crate::repo::policy::Decision| {
                    json!({
                        "id": decision.id.to_hex(),
                        "time": plan.snapshot(decision).map(|s| s.time.clone()),
                        "reasons": decision.reasons,
                    })
                };
                json!({
                    "group": group.group,
                    "keep": keep.iter().map(describe).collect::<Vec<_>>(),
                    "remove": remove.iter().map(describe).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            json!({ "dryRun": args.dry_run, "groups": groups, "unreadable": plan.unreadable })
        );
    } else {
        for group in &plan.groups {
            let kept = group.decisions.iter().filter(|d| d.keep).count();
            println!(
                "{}: keep {kept}, {verb} {}",
                group.group,
                group.decisions.len() - kept
            );
            for decision in &group.decisions {
                let time = plan
                    .snapshot(decision)
                    .map(|snapshot| snapshot.time_to_the_second())
                    .unwrap_or_default();
                if decision.keep {
                    println!(
                        "  keep    {}  {time}  {}",
                        decision.id.short(),
                        decision.reasons.join(", ")
                    );
                } else {
                    println!(
                        "  {}  {}  {time}  matches no keep rule",
                        if args.dry_run { "forget?" } else { "forget " },
                        decision.id.short()
                    );
                }
            }
        }
        for message in &plan.unreadable {
            eprintln!("warning: {message}");
        }
        println!(
            "{verb} {} of {} snapshots{}",
            removals.len(),
            plan.snapshots.len(),
            if args.dry_run {
                " (dry run: nothing deleted)"
            } else {
                "; `haulage prune` reclaims their space"
            }
        );
    }
    if !args.dry_run {
        forget_snapshots(repository, &removals).await?;
    }
    Ok(Outcome::Success)
}
