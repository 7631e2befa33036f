//! A BackupStorageLocation with `spec.encryption`: the controller creates
//! the repository encrypted with the password from its Secret, the agents
//! back up into it with the password from their credentials copy, no
//! object holds a backed-up file's plaintext, `haulage restore` with the
//! password file restores it and so does a VolumeRestore from the
//! location; a location naming a wrong password is Unavailable with reason
//! `WrongPassword`, naming its Secret.

use std::time::Duration;

use anyhow::Context;
use haulage::api::BackupStorageLocation;
use haulage::api::condition::{condition_type, find_condition, reason};
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::restore::VolumeRestorePhase;
use haulage::api::{BackupStorageLocationPhase, VolumeRestore};
use haulage::engine::{EngineError, KeySource, Repository};
use haulage::store::open_store;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;

use crate::engine::support::assert_same_tree;
use crate::support::fixture::{
    BACKUP_DEADLINE, BUCKET, Fixture, create, create_backup_to, eventually, final_phase,
};
use crate::support::minio::{REGION, with_s3_credentials};

/// A marker no sample data contains, in a compressible text file (it would
/// show through zstd's literals if it were not sealed) and as a file name.
const MARKER: &str = "HAULAGE-PLAINTEXT-MARKER-in-cluster-5d1e";
const PASSWORD: &str = "sealed-in-cluster-password";
const PREFIX: &str = "sealed";

async fn password_secret(client: &kube::Client, name: &str, password: &str) -> anyhow::Result<()> {
    create::<Secret>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "stringData": {"password": format!("{password}\n")}}),
    )
    .await?;
    Ok(())
}

async fn encrypted_location(
    fixture: &Fixture,
    name: &str,
    secret: &str,
) -> anyhow::Result<BackupStorageLocation> {
    create::<BackupStorageLocation>(
        &fixture.client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "BackupStorageLocation",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"bucket": BUCKET, "prefix": PREFIX, "endpoint": fixture.minio.endpoint(),
                "region": REGION, "s3ForcePathStyle": true, "initialize": true,
                "credential": {"name": "s3-credentials", "key": "cloud"},
                "encryption": {"passwordSecretRef": {"name": secret, "key": "password"}},
                "validationFrequency": "10s"}}),
    )
    .await
}

/// The location once its probe decided: its phase and `Available` condition.
async fn probed(
    locations: &Api<BackupStorageLocation>,
    name: &str,
) -> anyhow::Result<(BackupStorageLocationPhase, String, String)> {
    eventually(Duration::from_secs(120), || async {
        let status = locations.get(name).await?.status.unwrap_or_default();
        Ok(status.phase.and_then(|phase| {
            find_condition(&status.conditions, condition_type::AVAILABLE)
                .map(|condition| (phase, condition.reason.clone(), condition.message.clone()))
        }))
    })
    .await
    .with_context(|| format!("BackupStorageLocation {name} was never probed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_encrypted_location_seals_every_object_and_a_wrong_password_is_named()
-> anyhow::Result<()> {
    let fixture = Fixture::builder().provisioning().start().await?;
    let client = &fixture.client;
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    password_secret(client, "repo-password", PASSWORD).await?;
    encrypted_location(&fixture, "sealed", "repo-password").await?;
    let (phase, why, message) = probed(&locations, "sealed").await?;
    assert_eq!(
        phase,
        BackupStorageLocationPhase::Available,
        "{why}: {message}"
    );

    // The claim gets the marker, then is backed up into the location.
    let source = fixture.volumes.join("shop").join("db");
    let mut text = String::new();
    for line in 0..2000 {
        text.push_str(&format!("line {line} {MARKER}\n"));
    }
    std::fs::write(source.join("marked.txt"), &text)?;
    std::fs::write(source.join(MARKER), b"name")?;
    create_backup_to(client, "sealed-db", "db", "sealed").await?;
    let status = fixture
        .completed_backup("sealed-db", BACKUP_DEADLINE)
        .await?;
    let snapshot = status.results[0]
        .snapshot_id
        .clone()
        .context("snapshot id")?;

    // Encrypted: no key, no entry; and no object shows the marker.
    let store = open_store(
        &format!("s3://{BUCKET}/{PREFIX}"),
        &fixture.minio.store_options(),
    )
    .await?;
    match Repository::open(store.clone(), &KeySource::PlaintextOnly).await {
        Err(EngineError::Encrypted { .. }) => {}
        Ok(_) => anyhow::bail!("the location's repository opened without a key: plaintext"),
        Err(other) => anyhow::bail!("expected an encrypted repository, got {other}"),
    }
    let objects = store.list("").await?;
    assert!(
        objects.iter().any(|object| object.key.starts_with("data/")),
        "no packs: {objects:?}"
    );
    for object in &objects {
        let bytes = store.get(&object.key, None).await?;
        assert!(
            !bytes
                .windows(MARKER.len())
                .any(|window| window == MARKER.as_bytes()),
            "{} holds the plaintext marker",
            object.key
        );
    }

    // `haulage restore` with the password file gives the claim back.
    let password_file = fixture.work.path().join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n"))?;
    let target = fixture.work.path().join("restored-sealed");
    let restored = with_s3_credentials(
        &mut std::process::Command::new(env!("CARGO_BIN_EXE_haulage")),
        &fixture.minio.endpoint(),
    )
    .args(["restore", &snapshot, "--no-progress", "--repo"])
    .arg(format!("s3://{BUCKET}/{PREFIX}"))
    .arg("--password-file")
    .arg(&password_file)
    .arg(&target)
    .env_remove("HAULAGE_PASSWORD")
    .output()?;
    assert!(
        restored.status.success(),
        "haulage restore: {}",
        String::from_utf8_lossy(&restored.stderr)
    );
    assert_same_tree(&source, &target);

    // A VolumeRestore from the location: its listing and its agents open
    // the repository with the Secret's password.
    create::<VolumeRestore>(
        client,
        Some(SYSTEM_NAMESPACE),
        json!({"apiVersion": "haulage.dev/v1alpha1", "kind": "VolumeRestore",
            "metadata": {"name": "unsealed", "namespace": SYSTEM_NAMESPACE},
            "spec": {"source": {"backup": "sealed-db"}, "storageLocation": "sealed",
                "namespaceMap": {"shop": "shop-b"}, "createNamespaces": true}}),
    )
    .await?;
    let restores: Api<VolumeRestore> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let restore = final_phase(&restores, &fixture.kubelet, "unsealed", BACKUP_DEADLINE).await?;
    let status = restore.status.clone().context("restore status")?;
    assert_eq!(
        status.phase,
        Some(VolumeRestorePhase::Completed),
        "{status:#?}\n{}",
        fixture.kubelet.all_agent_logs()
    );
    assert_same_tree(&source, &fixture.volumes.join("shop-b").join("db"));

    // The same repository with a wrong password: Unavailable, naming the
    // Secret.
    password_secret(client, "wrong-password", "not-the-password").await?;
    encrypted_location(&fixture, "sealed-wrong", "wrong-password").await?;
    let (phase, why, message) = probed(&locations, "sealed-wrong").await?;
    assert_eq!(phase, BackupStorageLocationPhase::Unavailable, "{message}");
    assert_eq!(why, reason::WRONG_PASSWORD, "{message}");
    assert!(message.contains("Secret wrong-password"), "{message}");
    assert!(!message.contains("not-the-password"), "{message}");
    fixture.stop().await;
    Ok(())
}
