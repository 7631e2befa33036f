//! The agent binary as a stage pod starts it. (This test also makes
//! `cargo test --workspace` build the binary that the end-to-end tests of
//! the root package run under the kubelet stand-in.)

use std::process::Command;

#[test]
fn transfers_mode_without_its_downward_api_identity_is_refused_naming_the_variable() {
    let output = Command::new(env!("CARGO_BIN_EXE_mover-agent"))
        .args([
            "transfers",
            "--repo",
            "file:///nonexistent",
            "--transfers",
            "a",
        ])
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .output()
        .expect("the agent runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--pod-name"), "{stderr}");
}
