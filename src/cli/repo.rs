//! `haulage repo`: create repositories, manage their keys, probe and
//! clean their locations.

use clap::Subcommand;

use super::password::new_password;
use super::{Outcome, RepoArgs};
use crate::engine::{Encryption, Repository};
use crate::repo::keyfile::KdfParameters;

/// Repository management verbs.
#[derive(Debug, Subcommand)]
pub enum RepoCommand {
    /// Create a new, empty repository (refuses if one exists). Encrypted by
    /// default: asks for a password (or takes --password-file,
    /// HAULAGE_PASSWORD_FILE, HAULAGE_PASSWORD).
    Init {
        #[command(flatten)]
        repo: RepoArgs,
        /// Create a plaintext (format 1) repository: whoever can read the
        /// bucket can read the data.
        #[arg(long)]
        insecure_no_encryption: bool,
    },
    /// Manage the passwords (key files) of an encrypted repository.
    #[command(subcommand)]
    Key(KeyCommand),
    /// List the repository's locks and remove the stale ones (expired, or
    /// held by a process of this host that is gone).
    Unlock {
        #[command(flatten)]
        repo: RepoArgs,
        /// Remove every lock, also live ones (only when you know their
        /// holders are gone: a running prune or backup loses its lock).
        #[arg(long)]
        remove_all: bool,
    },
    /// Probe a storage location with a real write, read, list and delete of
    /// a small object, and report each step's latency.
    CheckLocation {
        #[command(flatten)]
        repo: RepoArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Abort incomplete multipart uploads (and remove stale temporary
    /// files) older than a threshold, left by writers that died.
    Sweep {
        #[command(flatten)]
        repo: RepoArgs,
        /// Only uploads older than this are removed (e.g. 24h, 90m).
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        older_than: std::time::Duration,
    },
}

/// `haulage repo key …`.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Add a password: a new key file wrapping the same master key (opens
    /// with an existing password first).
    Add {
        #[command(flatten)]
        repo: RepoArgs,
        /// Read the new password from the first line of this file (else
        /// asked twice on the terminal).
        #[arg(long, value_name = "FILE")]
        new_password_file: Option<std::path::PathBuf>,
    },
    /// List the key files; the one that opened this command is marked.
    List {
        #[command(flatten)]
        repo: RepoArgs,
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Remove a key file, revoking its password. The last key is never
    /// removed; the one in use only with --allow-current.
    Remove {
        /// Key id or unique prefix (at least 4 characters).
        id: String,
        #[command(flatten)]
        repo: RepoArgs,
        /// Also remove the key this command was opened with.
        #[arg(long)]
        allow_current: bool,
    },
}

pub async fn run(command: RepoCommand) -> anyhow::Result<Outcome> {
    match command {
        RepoCommand::Init {
            repo,
            insecure_no_encryption,
        } => {
            let store = repo.store().await?;
            let encryption = if insecure_no_encryption {
                Encryption::None
            } else {
                let password = new_password(repo.password_file.as_deref(), true, &repo.url)
                    .map_err(anyhow::Error::msg)?;
                Encryption::Password {
                    password,
                    kdf: KdfParameters::default(),
                }
            };
            let repository = Repository::init(store, encryption).await?;
            println!(
                "created {} repository {} at {}",
                if repository.codec().is_encrypted() {
                    "encrypted"
                } else {
                    "PLAINTEXT (not encrypted)"
                },
                repository.config().repository_id,
                repository.store().location()
            );
            if repository.codec().is_encrypted() {
                println!(
                    "keep the password safe: without it (or another key's) the data cannot be read"
                );
            }
            Ok(Outcome::Success)
        }
        RepoCommand::Key(command) => run_key(command).await,
        RepoCommand::Unlock { repo, remove_all } => {
            let repository = repo.open().await?;
            let locks = crate::engine::lock::list_locks(&repository).await?;
            let removed = crate::engine::lock::remove_locks(&repository, remove_all).await?;
            for lock in &locks {
                let gone = removed.iter().any(|removed| removed.key == lock.key);
                println!(
                    "{} {} ({}): {}",
                    if gone { "removed" } else { "kept   " },
                    lock.key,
                    lock.state,
                    lock.description
                );
            }
            println!("{} locks, {} removed", locks.len(), removed.len());
            Ok(Outcome::Success)
        }
        RepoCommand::CheckLocation { repo, json } => {
            let store = repo.store().await?;
            let report = crate::store::probe::check_location(store.as_ref()).await;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("probing {}", report.location);
                for step in &report.steps {
                    println!("  {}", serde_json::to_string(step)?);
                }
                println!(
                    "{}",
                    if report.is_ok() {
                        "location works"
                    } else {
                        "location does NOT work"
                    }
                );
            }
            Ok(if report.is_ok() {
                Outcome::Success
            } else {
                Outcome::Failed
            })
        }
        RepoCommand::Sweep { repo, older_than } => {
            let store = repo.store().await?;
            let report = store.sweep_incomplete_uploads(older_than).await?;
            println!(
                "{} incomplete uploads found, {} removed, {} younger than {} kept",
                report.found,
                report.removed.len(),
                report.kept_recent,
                humantime::format_duration(older_than)
            );
            for key in &report.removed {
                println!("  removed {key}");
            }
            Ok(Outcome::Success)
        }
    }
}

async fn run_key(command: KeyCommand) -> anyhow::Result<Outcome> {
    match command {
        KeyCommand::Add {
            repo,
            new_password_file,
        } => {
            let repository = repo.open().await?;
            if !repository.codec().is_encrypted() {
                return Err(crate::engine::EngineError::KeysNeedEncryption {
                    location: repository.store().location(),
                }
                .into());
            }
            let password = new_password(new_password_file.as_deref(), false, &repo.url)
                .map_err(anyhow::Error::msg)?;
            let id = repository
                .add_key(&password, KdfParameters::default())
                .await?;
            println!("added key {}", id.short());
            Ok(Outcome::Success)
        }
        KeyCommand::List { repo, json } => {
            let repository = repo.open().await?;
            let keys = repository.list_keys().await?;
            if json {
                println!("{}", serde_json::to_string(&keys)?);
            } else {
                println!(
                    "  {:<10} {:<21} {:<16} {:<12} KDF",
                    "ID", "CREATED", "HOST", "USER"
                );
                for key in &keys {
                    println!(
                        "{} {:<10} {:<21} {:<16} {:<12} argon2id {} MiB, {} passes, {} lanes",
                        if key.current { "*" } else { " " },
                        &key.id[..8],
                        key.created,
                        key.hostname.chars().take(16).collect::<String>(),
                        key.username.chars().take(12).collect::<String>(),
                        key.kdf.memory_kib / 1024,
                        key.kdf.iterations,
                        key.kdf.parallelism
                    );
                }
                println!("{} keys (* opened this command)", keys.len());
            }
            Ok(Outcome::Success)
        }
        KeyCommand::Remove {
            id,
            repo,
            allow_current,
        } => {
            let repository = repo.open().await?;
            let removed = repository.remove_key(&id, allow_current).await?;
            println!("removed key {}", removed.short());
            Ok(Outcome::Success)
        }
    }
}
