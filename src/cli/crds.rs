//! `haulage crds` (hidden): write the CRDs generated from `src/api` into a
//! directory (`manifests/crds/`), or check that the directory is current.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;

use crate::api::{REGENERATE_COMMAND, crd_manifests};
use crate::cli::Outcome;

/// Arguments of `haulage crds`.
#[derive(Debug, Args)]
pub struct CrdsArgs {
    /// Directory to write the CRD files and their kustomization into.
    #[arg(long, value_name = "DIR", default_value = "manifests/crds")]
    pub output_dir: PathBuf,
    /// Write nothing; fail when a file differs from what would be written.
    #[arg(long)]
    pub check: bool,
}

/// Write (or check) the CRD files.
pub fn run(args: &CrdsArgs) -> anyhow::Result<Outcome> {
    let files = crd_manifests()?;
    if args.check {
        let stale: Vec<&str> = files
            .iter()
            .filter(|(name, contents)| {
                std::fs::read_to_string(args.output_dir.join(name))
                    .ok()
                    .as_ref()
                    != Some(contents)
            })
            .map(|(name, _)| name.as_str())
            .collect();
        if !stale.is_empty() {
            bail!(
                "{} is stale ({}); regenerate with `{REGENERATE_COMMAND}`",
                args.output_dir.display(),
                stale.join(", ")
            );
        }
        return Ok(Outcome::Success);
    }
    std::fs::create_dir_all(&args.output_dir)
        .with_context(|| format!("failed to create {}", args.output_dir.display()))?;
    for (name, contents) in &files {
        let path = args.output_dir.join(name);
        std::fs::write(&path, contents)
            .with_context(|| format!("failed to write {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(Outcome::Success)
}
