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
use crate::engine::{Encryption, EngineError, KeySource, Repository};
use crate::store::{StoreOptions, open_store};

/// Arguments of `haulage demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Working directory for the sample source, repository and restore
    /// (default: `haulage-demo` in the system's temporary directory, so the
    /// checkout it runs in stays clean; a second run reuses the sample).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Size of the generated sample tree (e.g. 256MiB, 2GiB).
    #[arg(long, default_value = "256MiB")]
    pub size: bytesize::ByteSize,
    /// Do not draw progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

/// Name of the demo's default working directory under the temporary one.
const DEFAULT_DIR_NAME: &str = "haulage-demo";

pub async fn run(args: DemoArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(DEFAULT_DIR_NAME));
    let source = dir.join("source");
    let repo_dir = std::path::absolute(dir.join("repo"))?;
    let restored = dir.join("restored");
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
    let repository = match Repository::open(store.clone(), &KeySource::PlaintextOnly).await {
        Ok(repository) => repository,
        Err(EngineError::NotARepository { .. }) => {
            println!(
                "2. creating repository {url} (plaintext for the demo; `haulage repo init` encrypts by default)"
            );
            Repository::init(store, Encryption::None).await?
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
    super::restore::print_summary(&outcome, None, &restored, false);
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

/// Arguments of the hidden `haulage sample-data` verb.
#[derive(Debug, Args)]
pub struct SampleDataArgs {
    /// Directory to write (created if missing).
    pub dir: PathBuf,
    /// Total size.
    #[arg(long, default_value = "2GiB")]
    pub size: bytesize::ByteSize,
    /// Seed; the same seed gives the same bytes.
    #[arg(long, default_value_t = 2026)]
    pub seed: u64,
}

pub async fn run_sample_data(args: SampleDataArgs) -> anyhow::Result<Outcome> {
    let dir = args.dir.clone();
    let summary = tokio::task::spawn_blocking(move || {
        crate::sample::generate(&dir, args.size.as_u64(), args.seed)
    })
    .await?
    .with_context(|| format!("cannot write sample data into {}", args.dir.display()))?;
    println!(
        "{} files, {} bytes in {}",
        summary.files,
        summary.bytes,
        args.dir.display()
    );
    Ok(Outcome::Success)
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
