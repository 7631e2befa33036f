//! `haulage demo`: the whole data path on the embedded default — a
//! generated sample tree, a `file://` repository, backup (full, then
//! incremental), verify, restore and a byte-for-byte comparison — in one
//! command, without a cluster.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tokio_util::sync::CancellationToken;

use super::Outcome;
use super::progress::{ProgressDisplay, human_bytes};
use crate::engine::backup::{BackupOptions, backup};
use crate::engine::progress::Progress;
use crate::engine::restore::{RestoreOptions, restore};
use crate::engine::verify::verify;
use crate::engine::{EngineError, Repository};
use crate::store::{StoreOptions, open_store};

/// Arguments of `haulage demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Working directory for the sample source, repository and restore.
    #[arg(long, default_value = "haulage-demo")]
    pub dir: PathBuf,
    /// Size of the generated sample tree (e.g. 256MiB, 2GiB).
    #[arg(long, default_value = "256MiB")]
    pub size: bytesize::ByteSize,
    /// Do not draw progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

pub async fn run(args: DemoArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let source = args.dir.join("source");
    let repo_dir = std::path::absolute(args.dir.join("repo"))?;
    let restored = args.dir.join("restored");
    if !source.exists() {
        println!(
            "1. generating a {} sample tree in {}",
            args.size.display().iec(),
            source.display()
        );
        let size = args.size.as_u64();
        let target = source.clone();
        let summary =
            tokio::task::spawn_blocking(move || crate::sample::generate(&target, size, 2026))
                .await?
                .with_context(|| format!("cannot generate sample data in {}", source.display()))?;
        println!("   {} files, {}", summary.files, human_bytes(summary.bytes));
    } else {
        println!("1. reusing the sample tree in {}", source.display());
    }
    let url = format!("file://{}", repo_dir.display());
    let store = open_store(&url, &StoreOptions::default()).await?;
    let repository = match Repository::open(store.clone()).await {
        Ok(repository) => repository,
        Err(EngineError::NotARepository { .. }) => {
            println!("2. creating repository {url}");
            Repository::init(store).await?
        }
        Err(error) => return Err(error.into()),
    };
    println!("3. first backup");
    let first = run_backup(&repository, &source, &cancel, args.no_progress).await?;
    super::backup::print_summary(&first, false);
    println!("4. second backup of the unchanged tree (incremental: nothing is read again)");
    let second = run_backup(&repository, &source, &cancel, args.no_progress).await?;
    super::backup::print_summary(&second, false);
    println!("5. verify");
    let report = verify(
        &repository,
        Some(second.snapshot_id),
        Arc::new(Progress::default()),
    )
    .await?;
    println!(
        "   {} data blobs in {} packs checked, {} problems",
        report.data_blobs,
        report.packs,
        report.problems.len()
    );
    println!("6. restore into {}", restored.display());
    if restored.exists() {
        std::fs::remove_dir_all(&restored)
            .with_context(|| format!("cannot clear {}", restored.display()))?;
    }
    let progress = Arc::new(Progress::default());
    let display = ProgressDisplay::start(progress.clone(), "restoring", !args.no_progress);
    let outcome = restore(
        &repository,
        &second.snapshot_id,
        RestoreOptions::new(&restored),
        progress,
        cancel.clone(),
    )
    .await;
    drop(display);
    let outcome = outcome?;
    super::restore::print_summary(&outcome, &restored, false);
    println!(
        "7. comparing {} with {}",
        source.display(),
        restored.display()
    );
    let differences = compare_trees(&source, &restored)?;
    if differences.is_empty() && report.problems.is_empty() && outcome.problems.is_empty() {
        println!("   identical. Repository: {url}");
        Ok(Outcome::Success)
    } else {
        for difference in &differences {
            println!("   differs: {difference}");
        }
        Ok(Outcome::DamagedData)
    }
}

async fn run_backup(
    repository: &Repository,
    source: &Path,
    cancel: &CancellationToken,
    no_progress: bool,
) -> anyhow::Result<crate::engine::backup::BackupOutcome> {
    let progress = Arc::new(Progress::default());
    let display = ProgressDisplay::start(progress.clone(), "backing up", !no_progress);
    let outcome = backup(
        repository,
        BackupOptions::new(source),
        progress,
        cancel.clone(),
    )
    .await;
    drop(display);
    Ok(outcome?)
}

/// Paths whose content or type differ between two trees.
fn compare_trees(left: &Path, right: &Path) -> anyhow::Result<Vec<String>> {
    let mut differences = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(relative) = stack.pop() {
        let mut names: Vec<_> = std::fs::read_dir(left.join(&relative))?
            .map(|entry| entry.map(|entry| entry.file_name()))
            .collect::<Result<_, _>>()?;
        let right_count = std::fs::read_dir(right.join(&relative))?.count();
        if right_count != names.len() {
            differences.push(format!(
                "{}: different number of entries",
                relative.display()
            ));
        }
        names.sort();
        for name in names {
            let path = relative.join(&name);
            let left_meta = std::fs::symlink_metadata(left.join(&path))?;
            if left_meta.is_dir() {
                stack.push(path);
            } else if left_meta.is_file() {
                let same = std::fs::read(right.join(&path))
                    .map(|content| content == std::fs::read(left.join(&path)).unwrap_or_default())
                    .unwrap_or(false);
                if !same {
                    differences.push(path.display().to_string());
                }
            }
        }
    }
    Ok(differences)
}
