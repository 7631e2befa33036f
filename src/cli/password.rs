//! Where the CLI gets passwords, in the order restic users expect:
//! `--password-file FILE` (or `HAULAGE_PASSWORD_FILE`), then
//! `HAULAGE_PASSWORD`, then a prompt on the terminal. Asked only when the
//! repository is encrypted.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use crate::engine::{Password, PasswordSource};

/// Environment variable holding the password itself.
pub const PASSWORD_VARIABLE: &str = "HAULAGE_PASSWORD";

/// The password of an existing repository, from the CLI's sources.
#[derive(Debug, Clone)]
pub struct CliPassword {
    /// `--password-file` / `HAULAGE_PASSWORD_FILE`.
    pub file: Option<PathBuf>,
    /// The repository, for the prompt and messages.
    pub location: String,
}

impl PasswordSource for CliPassword {
    fn password(&self) -> Result<Password, String> {
        if let Some(file) = &self.file {
            return read_password_file(file);
        }
        if let Some(password) = password_from_environment()? {
            return Ok(password);
        }
        prompt(
            &format!("enter password for repository {}: ", self.location),
            &self.location,
        )
    }
}

fn password_from_environment() -> Result<Option<Password>, String> {
    match std::env::var(PASSWORD_VARIABLE) {
        Ok(text) if text.is_empty() => Err(format!("{PASSWORD_VARIABLE} is set but empty")),
        Ok(text) => Ok(Some(Password::new(text))),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("{PASSWORD_VARIABLE} is not valid UTF-8"))
        }
    }
}

/// The first line of `path`, without its line ending.
pub fn read_password_file(path: &Path) -> Result<Password, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read the password file {}: {error}", path.display()))?;
    first_line_password(&text).ok_or_else(|| {
        format!(
            "the password file {} is empty (its first line is the password)",
            path.display()
        )
    })
}

/// The password a file or a Secret's value holds: its first line, without
/// its line ending; `None` when that is empty.
pub fn first_line_password(text: &str) -> Option<Password> {
    let line = text.lines().next().unwrap_or("");
    (!line.is_empty()).then(|| Password::new(line))
}

fn prompt(question: &str, location: &str) -> Result<Password, String> {
    if !std::io::stdin().is_terminal() {
        return Err(format!(
            "the repository at {location} needs a password and there is no terminal to ask on: \
             give --password-file FILE, HAULAGE_PASSWORD_FILE or HAULAGE_PASSWORD"
        ));
    }
    let text = rpassword::prompt_password(question)
        .map_err(|error| format!("cannot read the password from the terminal: {error}"))?;
    if text.is_empty() {
        return Err("an empty password was entered".into());
    }
    Ok(Password::new(text))
}

/// A new password (for `repo init` and `repo key add`): from `file`, then
/// (for init only) `HAULAGE_PASSWORD`, else asked twice on the terminal.
pub fn new_password(
    file: Option<&Path>,
    use_environment: bool,
    location: &str,
) -> Result<Password, String> {
    if let Some(file) = file {
        return read_password_file(file);
    }
    if use_environment && let Some(password) = password_from_environment()? {
        return Ok(password);
    }
    let first = prompt(
        &format!("enter a new password for repository {location}: "),
        location,
    )?;
    let second = prompt("enter it again: ", location)?;
    if first.as_bytes() != second.as_bytes() {
        return Err("the two passwords differ; nothing was written".into());
    }
    Ok(first)
}
