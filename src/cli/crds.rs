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

/// These read the repository's files, so they live beside the command that
/// writes them rather than in the pure API crate.
#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use crate::api::{BackupStorageLocation, StoragePolicy, VolumeBackup, VolumeTransfer};

    #[test]
    fn the_examples_read_as_the_rust_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/examples");
        let mut kinds = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("manifests/examples exists") {
            let path = entry.expect("readable directory").path();
            let text = std::fs::read_to_string(&path).expect("readable example");
            for document in serde_yaml::Deserializer::from_str(&text) {
                let value = serde_yaml::Value::deserialize(document).expect("valid YAML");
                let kind = value["kind"].as_str().unwrap_or_default().to_string();
                let parsed = match kind.as_str() {
                    "BackupStorageLocation" => {
                        serde_yaml::from_value::<BackupStorageLocation>(value).map(|_| ())
                    }
                    "StoragePolicy" => serde_yaml::from_value::<StoragePolicy>(value).map(|_| ()),
                    "VolumeBackup" => serde_yaml::from_value::<VolumeBackup>(value).map(|_| ()),
                    "VolumeTransfer" => serde_yaml::from_value::<VolumeTransfer>(value).map(|_| ()),
                    _ => Ok(()),
                };
                if let Err(error) = parsed {
                    panic!("{}: {kind}: {error}", path.display());
                }
                kinds.push(kind);
            }
        }
        for kind in [
            "BackupStorageLocation",
            "StoragePolicy",
            "VolumeBackup",
            "Secret",
        ] {
            assert!(kinds.iter().any(|k| k == kind), "no {kind} example");
        }
    }

    #[test]
    fn manifests_in_the_repository_match_the_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/crds");
        let mut stale = Vec::new();
        let files = crate::api::crd_manifests().expect("CRDs render");
        for (name, expected) in &files {
            let committed = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
            if &committed != expected {
                stale.push(name.clone());
            }
        }
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| !files.iter().any(|(file, _)| file == name))
            .collect();
        on_disk.sort();
        assert!(
            stale.is_empty() && on_disk.is_empty(),
            "manifests/crds is stale (differs: {stale:?}, not generated: {on_disk:?}); \
             regenerate with `{}`",
            crate::api::REGENERATE_COMMAND
        );
    }

    use crate::api::labels::{CREDENTIALS_COPY_LABEL, SYSTEM_NAMESPACE};

    #[test]
    fn the_admission_policy_names_the_credentials_copy_label() {
        let policy = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("manifests/admission-policy.yaml"),
        )
        .expect("manifests/admission-policy.yaml is readable");
        assert!(
            policy.contains(&format!("'{CREDENTIALS_COPY_LABEL}'")),
            "admission-policy.yaml does not check {CREDENTIALS_COPY_LABEL}"
        );
        assert!(policy.contains(&format!("request.namespace != '{SYSTEM_NAMESPACE}'")));
    }
}
