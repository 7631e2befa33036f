//! The architecture, checked: haulage's pure cores (the API types, the
//! planner, the repository format and the reconcile decisions) reach no
//! async runtime, Kubernetes client, AWS SDK, HTTP stack, file system,
//! network or clock. Their manifests are the first line (tokio, kube's
//! client and the AWS SDK are simply not dependencies, so using them does
//! not compile); `clippy.toml` beside each refuses the clock, `std::fs`
//! and `std::net` calls under `-D warnings`; this test checks the
//! dependency trees as cargo resolves them for each crate alone, and scans
//! the sources. docs/architecture.md says why the line is drawn here.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The pure crates and where their sources are.
const PURE_CRATES: [(&str, &str); 4] = [
    ("haulage-api", "src/api"),
    ("haulage-plan", "src/plan"),
    ("haulage-repo", "src/repo"),
    ("haulage-reconcile", "src/reconcile"),
];

/// Crates a pure crate must not depend on, even indirectly: an async
/// runtime, an HTTP or TLS stack, a Kubernetes client, the AWS SDK, an OS
/// entropy source.
const FORBIDDEN_DEPENDENCIES: [&str; 14] = [
    "tokio",
    "mio",
    "hyper",
    "hyper-util",
    "reqwest",
    "rustls",
    "kube-client",
    "kube-runtime",
    "aws-config",
    "aws-sdk-s3",
    "aws-smithy-runtime",
    "tower",
    "getrandom",
    "socket2",
];

/// Text that names I/O or the clock in a pure crate's non-test code.
const FORBIDDEN_SOURCE: [&str; 10] = [
    "std::fs",
    "std::net",
    "std::env",
    "std::process",
    "tokio::",
    "SystemTime",
    "Instant::now",
    "Timestamp::now",
    "rand::rng",
    "thread::sleep",
];

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The packages `crate_name` depends on (normal and build dependencies),
/// resolved with its own features only, as `cargo tree -p` shows them.
fn dependency_names(crate_name: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = Command::new(cargo)
        .current_dir(workspace_root())
        .args([
            "tree",
            "--locked",
            "--offline",
            "-p",
            crate_name,
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo tree -p {crate_name} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Every `.rs` file under `dir`, but for a `tests/` directory (test code).
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable source directory") {
            let path = entry.expect("readable entry").path();
            if path.is_dir() {
                // A crate's own tests/ (its integration tests) is test code,
                // like its `#[cfg(test)]` modules.
                if path.file_name().is_some_and(|name| name != "tests") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files
}

/// The lines of `text` outside its `#[cfg(test)]` module (by the house
/// style, the unit tests close each file) and outside comments.
fn production_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .take_while(|(_, line)| line.trim() != "#[cfg(test)]")
        .filter(|(_, line)| {
            let trimmed = line.trim_start();
            !trimmed.starts_with("//")
        })
        .map(|(index, line)| (index + 1, line))
}

/// Names of forbidden dependencies among `names`.
fn forbidden_among(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|name| FORBIDDEN_DEPENDENCIES.contains(&name.as_str()))
        .cloned()
        .collect()
}

/// `file:line: text` of each forbidden use in `text`.
fn forbidden_uses(file: &str, text: &str) -> Vec<String> {
    production_lines(text)
        .filter(|(_, line)| FORBIDDEN_SOURCE.iter().any(|needle| line.contains(needle)))
        .map(|(number, line)| format!("{file}:{number}: {}", line.trim()))
        .collect()
}

#[test]
fn the_pure_crates_depend_on_no_runtime_client_sdk_or_entropy_source() {
    let mut offenders = Vec::new();
    for (crate_name, _) in PURE_CRATES {
        for name in forbidden_among(&dependency_names(crate_name)) {
            offenders.push(format!("{crate_name} depends on {name}"));
        }
    }
    assert!(
        offenders.is_empty(),
        "pure crates reach I/O through their dependencies (see docs/architecture.md):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_pure_crates_sources_name_no_file_system_network_clock_or_environment() {
    let root = workspace_root();
    let mut offenders = Vec::new();
    for (_, dir) in PURE_CRATES {
        for file in sources(&root.join(dir)) {
            let text = std::fs::read_to_string(&file).expect("readable source");
            let shown = file
                .strip_prefix(&root)
                .unwrap_or(&file)
                .display()
                .to_string();
            offenders.extend(forbidden_uses(&shown, &text));
        }
    }
    assert!(
        offenders.is_empty(),
        "pure crates do I/O or read the clock (see docs/architecture.md); take it as an argument instead:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_checks_catch_what_they_look_for() {
    // The checks themselves, on text that breaks the rules, so a check that
    // silently matches nothing fails here.
    let leaking = "use std::fs;\nfn f() { let _ = std::time::Instant::now(); }\n\
                   // std::fs in a comment is fine\n#[cfg(test)]\nmod tests { use std::fs; }\n";
    let uses = forbidden_uses("src/repo/leak.rs", leaking);
    assert_eq!(uses.len(), 2, "{uses:?}");
    assert!(uses[0].starts_with("src/repo/leak.rs:1:"));
    assert_eq!(
        forbidden_among(&["serde".to_string(), "tokio".to_string()]),
        ["tokio"]
    );
    let root_dependencies = dependency_names("haulage");
    assert!(
        root_dependencies.iter().any(|name| name == "tokio"),
        "cargo tree lists the root crate's tokio, so it would list a pure crate's"
    );
}
