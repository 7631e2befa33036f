//! The haulage API on a real kube-apiserver: the manifests install with
//! `kubectl apply -k manifests/` as a user would, the examples are
//! accepted, malformed specs are refused at admission with a message that
//! names the field, printer columns show status, and the RBAC gives the
//! controller and the agents what they need and nothing more.
//!
//! Each test starts its own cluster (~3 s) and covers one area in steps.

use anyhow::{Context, bail};
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::condition::{condition_type, reason};
use haulage::api::labels::{AGENT_FIELD_MANAGER, CONTROLLER_FIELD_MANAGER};
use haulage::api::labels::{CREDENTIALS_COPY_LABEL, SYSTEM_NAMESPACE};
use haulage::api::location::DEFAULT_VALIDATION_FREQUENCY;
use haulage::api::transfer::AgentClaim;
use haulage::api::{
    BackupStorageLocation, Condition, ConditionStatus, GROUP, Progress, StoragePolicy, VERSION,
    VolumeBackup, VolumeTransfer, VolumeTransferPhase, VolumeTransferStatus, set_condition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::json;

use crate::support::kube::{KubeCluster, UNPRIVILEGED_CONTEXT, UNPRIVILEGED_USER, manifests};

/// The controller's identity, for `kubectl --as`.
const CONTROLLER: &str = "system:serviceaccount:haulage-system:haulage-controller";

/// An untyped API for one of the haulage kinds, to send specs the Rust
/// types could not even express.
fn dynamic_api(client: &kube::Client, kind: &str, namespace: Option<&str>) -> Api<DynamicObject> {
    let resource = match kind {
        "BackupStorageLocation" => ApiResource::erase::<BackupStorageLocation>(&()),
        "StoragePolicy" => ApiResource::erase::<StoragePolicy>(&()),
        "VolumeBackup" => ApiResource::erase::<VolumeBackup>(&()),
        "VolumeTransfer" => ApiResource::erase::<VolumeTransfer>(&()),
        other => panic!("not a haulage kind: {other}"),
    };
    match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// Create `kind`/`name` with `spec`; return the API server's refusal
/// message, or fail when it accepted the object.
async fn refusal(
    client: &kube::Client,
    kind: &str,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<String> {
    let namespaced = kind != "StoragePolicy";
    let api = dynamic_api(client, kind, namespaced.then_some(SYSTEM_NAMESPACE));
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }))?;
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => bail!("{kind} {name} was accepted; expected a refusal"),
        Err(kube::Error::Api(status)) if status.code == 422 => Ok(status.message),
        Err(error) => Err(error).with_context(|| format!("create {kind} {name}")),
    }
}

fn valid_location() -> serde_json::Value {
    json!({"bucket": "b", "credential": {"name": "s3-credentials"}})
}

fn valid_transfer() -> serde_json::Value {
    json!({
        "direction": "Upload",
        "pvc": "data",
        "backupRef": {"namespace": SYSTEM_NAMESPACE, "name": "shop-nightly"},
        "storageLocation": {"namespace": SYSTEM_NAMESPACE, "name": "s3"},
        "stagePod": "haulage-stage-node-a",
    })
}

fn with(mut base: serde_json::Value, key: &str, value: serde_json::Value) -> serde_json::Value {
    base[key] = value;
    base
}

fn without(mut base: serde_json::Value, key: &str) -> serde_json::Value {
    if let Some(map) = base.as_object_mut() {
        map.remove(key);
    }
    base
}

#[tokio::test(flavor = "multi_thread")]
async fn manifests_install_with_kustomize_and_bad_specs_are_refused_naming_the_field()
-> anyhow::Result<()> {
    let cluster = KubeCluster::start().await?;
    cluster.install_manifests().await?;
    // Applying again changes nothing (no object gets a new resourceVersion),
    // so re-running the install is safe. kubectl's own "configured" lines
    // are no guide: it always re-sends a PodDisruptionBudget's selector.
    let dir = manifests().to_string_lossy().into_owned();
    let versions = r#"-o=jsonpath={range .items[*]}{.kind}/{.metadata.name}={.metadata.resourceVersion}{"\n"}{end}"#;
    let before = cluster
        .kubectl_ok(&["get", "-k", &dir, versions], None)
        .await?;
    cluster.kubectl_ok(&["apply", "-k", &dir], None).await?;
    let after = cluster
        .kubectl_ok(&["get", "-k", &dir, versions], None)
        .await?;
    assert!(before.lines().count() >= 15, "{before}");
    assert_eq!(before, after, "a second apply changed objects");
    let client = cluster.client().await?;

    // The examples a user copies are accepted as they are.
    cluster
        .kubectl_ok(
            &[
                "apply",
                "-f",
                &manifests().join("examples").to_string_lossy(),
            ],
            None,
        )
        .await
        .context("apply manifests/examples")?;

    // Typed reads work, and schema defaults are filled in by the server.
    let locations: Api<BackupStorageLocation> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let example = locations.get("s3").await?;
    assert!(example.spec.is_default);
    assert_eq!(example.spec.s3_force_path_style, Some(true));
    // Sent untyped, so the defaults come from the CRD, not from serde.
    let minimal: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": "BackupStorageLocation",
        "metadata": {"name": "minimal"},
        "spec": valid_location(),
    }))?;
    let stored = dynamic_api(&client, "BackupStorageLocation", Some(SYSTEM_NAMESPACE))
        .create(&PostParams::default(), &minimal)
        .await?;
    assert_eq!(
        stored.data["spec"]["validationFrequency"],
        json!(DEFAULT_VALIDATION_FREQUENCY)
    );
    assert_eq!(stored.data["spec"]["credential"]["key"], json!("cloud"));
    assert_eq!(stored.data["spec"]["default"], json!(false));
    let typed = locations.get("minimal").await?;
    assert_eq!(
        typed.spec.validation_interval()?,
        Some(std::time::Duration::from_secs(60))
    );

    // Each kind of malformed spec is refused with the field in the message.
    let cases: Vec<(&str, serde_json::Value, &[&str])> = vec![
        (
            "BackupStorageLocation",
            without(valid_location(), "bucket"),
            &["spec.bucket", "Required value"],
        ),
        (
            "BackupStorageLocation",
            with(valid_location(), "bucket", json!("")),
            &["spec.bucket", "at least 1 chars long"],
        ),
        (
            "BackupStorageLocation",
            with(valid_location(), "validationFrequency", json!("soon")),
            &["spec.validationFrequency", "must be a duration"],
        ),
        (
            "BackupStorageLocation",
            with(valid_location(), "validationFrequency", json!("1d")),
            &["spec.validationFrequency", "must be a duration"],
        ),
        (
            "BackupStorageLocation",
            with(valid_location(), "endpoint", json!("ftp://s3.example")),
            &["spec.endpoint", "http:// or https://"],
        ),
        (
            "BackupStorageLocation",
            without(valid_location(), "credential"),
            &["spec.credential", "Required value"],
        ),
        (
            "BackupStorageLocation",
            with(valid_location(), "uploadBytesPerSecond", json!(0)),
            &["spec.uploadBytesPerSecond", "greater than or equal to 1"],
        ),
        (
            "StoragePolicy",
            json!({"storageClassNames": ["ceph-block"], "maxConcurrentVolumes": 0}),
            &["spec.maxConcurrentVolumes", "greater than or equal to 1"],
        ),
        (
            "StoragePolicy",
            json!({"maxConcurrentVolumes": 2}),
            &["spec", "must select storage"],
        ),
        (
            "VolumeBackup",
            json!({"namespaces": []}),
            &["spec.namespaces", "at least 1 items"],
        ),
        (
            "VolumeBackup",
            json!({"namespaces": ["shop", "Not_A_Namespace"]}),
            &["spec.namespaces[1]", "should match"],
        ),
        (
            "VolumeBackup",
            json!({"namespaces": ["shop"], "parentPolicy": "Sometimes"}),
            &["spec.parentPolicy", "Unsupported value"],
        ),
        (
            "VolumeTransfer",
            with(valid_transfer(), "direction", json!("Sideways")),
            &["spec.direction", "Unsupported value", "Upload", "Download"],
        ),
        (
            "VolumeTransfer",
            with(valid_transfer(), "direction", json!("Download")),
            &[
                "spec.snapshot",
                "snapshot is required when direction is Download",
            ],
        ),
        (
            "VolumeTransfer",
            without(valid_transfer(), "pvc"),
            &["spec.pvc", "Required value"],
        ),
    ];
    for (index, (kind, spec, expected)) in cases.into_iter().enumerate() {
        let name = format!("bad-{index}");
        let message = refusal(&client, kind, &name, spec.clone()).await?;
        for part in expected {
            assert!(
                message.contains(part),
                "{kind} {spec}: refusal does not mention {part:?}: {message}"
            );
        }
    }
    // A valid transfer, and a download with its snapshot, are accepted.
    let transfers = dynamic_api(&client, "VolumeTransfer", Some(SYSTEM_NAMESPACE));
    for (name, spec) in [
        ("upload", valid_transfer()),
        (
            "download",
            with(
                with(valid_transfer(), "direction", json!("Download")),
                "snapshot",
                json!("0123abcd"),
            ),
        ),
    ] {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": "VolumeTransfer",
            "metadata": {"name": name},
            "spec": spec,
        }))?;
        transfers
            .create(&PostParams::default(), &object)
            .await
            .with_context(|| format!("create VolumeTransfer {name}"))?;
    }

    // The controller and the agent write different parts of a transfer's
    // status with server-side apply; conditions merge by type, so each
    // keeps its own. Typed values prove the Rust shapes fit the schema.
    write_transfer_status_as_controller_and_agent(&client).await?;

    // A VolumeBackup's spec cannot change under a running backup.
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let change = backups
        .patch(
            "shop-nightly",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"namespaces": ["other"]}})),
        )
        .await;
    match change {
        Err(kube::Error::Api(status)) => assert!(
            status.message.contains("spec") && status.message.contains("is immutable"),
            "{}",
            status.message
        ),
        other => bail!("changing a VolumeBackup's spec was not refused: {other:?}"),
    }
    // Neither can an optional field be added; but what happens after the
    // backup (deletionPolicy, ttl) may change at any time.
    let added = backups
        .patch(
            "shop-nightly",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"agentUser": 1000}})),
        )
        .await;
    assert!(
        matches!(&added, Err(kube::Error::Api(status)) if status.message.contains("is immutable")),
        "adding agentUser was not refused: {added:?}"
    );
    let relaxed = backups
        .patch(
            "shop-nightly",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"deletionPolicy": "Delete", "ttl": "72h"}})),
        )
        .await
        .context("deletionPolicy and ttl may change")?;
    assert_eq!(
        relaxed.spec.deletion_policy,
        haulage::api::backup::DeletionPolicy::Delete
    );
    let bad_ttl = backups
        .patch(
            "shop-nightly",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ttl": "3 days"}})),
        )
        .await;
    assert!(
        matches!(&bad_ttl, Err(kube::Error::Api(status)) if status.message.contains("must be a duration")),
        "a ttl that is no duration was not refused: {bad_ttl:?}"
    );

    // Status written through the status subresource shows in `kubectl get`.
    backups
        .patch_status(
            "shop-nightly",
            &PatchParams::apply("haulage-test").force(),
            &Patch::Apply(json!({
                "apiVersion": format!("{GROUP}/{VERSION}"),
                "kind": "VolumeBackup",
                "status": {
                    "phase": "InProgress",
                    "progress": {"totalBytes": 4000, "bytesDone": 1680, "percent": 42},
                    "volumes": {"total": 3, "pending": 1, "inProgress": 2},
                },
            })),
        )
        .await
        .context("apply VolumeBackup status")?;
    let read_back = backups.get_status("shop-nightly").await?;
    let status = read_back.status.context("status was not stored")?;
    assert_eq!(status.phase, Some(VolumeBackupPhase::InProgress));
    let table = cluster
        .kubectl_ok(&["get", "vbk", "-n", SYSTEM_NAMESPACE], None)
        .await?;
    assert_columns(
        &table,
        &[
            "NAME",
            "PHASE",
            "PROGRESS",
            "BYTES DONE",
            "TOTAL BYTES",
            "VOLUMES",
            "AGE",
        ],
    )?;
    assert_row(
        &table,
        "shop-nightly",
        &["InProgress", "42", "1680", "4000", "3"],
    )?;

    locations
        .patch_status(
            "s3",
            &PatchParams::apply("haulage-test").force(),
            &Patch::Apply(json!({
                "apiVersion": format!("{GROUP}/{VERSION}"),
                "kind": "BackupStorageLocation",
                "status": {"phase": "Available", "lastValidationTime": "2026-01-01T00:00:00Z"},
            })),
        )
        .await
        .context("apply BSL status")?;
    let table = cluster
        .kubectl_ok(&["get", "bsl", "-n", SYSTEM_NAMESPACE], None)
        .await?;
    assert_columns(
        &table,
        &["NAME", "PHASE", "BUCKET", "LAST VALIDATED", "AGE"],
    )?;
    assert_row(&table, "s3", &["Available", "haulage-backups"])?;

    let table = cluster
        .kubectl_ok(&["get", "vxf", "-n", SYSTEM_NAMESPACE], None)
        .await?;
    assert_columns(
        &table,
        &[
            "NAME",
            "PHASE",
            "PVC",
            "DIRECTION",
            "PROGRESS",
            "BYTES DONE",
            "AGE",
        ],
    )?;
    assert_row(&table, "download", &["data", "Download"])?;
    // Transfers can be selected by stage pod, claim and direction.
    let downloads = cluster
        .kubectl_ok(
            &[
                "get",
                "vxf",
                "-n",
                SYSTEM_NAMESPACE,
                "-o",
                "name",
                "--field-selector",
                "spec.direction=Download,spec.pvc=data",
            ],
            None,
        )
        .await?;
    assert_eq!(downloads.trim(), "volumetransfer.haulage.dev/download");
    let table = cluster
        .kubectl_ok(&["get", "storagepolicies"], None)
        .await?;
    assert_columns(&table, &["NAME", "MAX VOLUMES", "MAX BYTES/S", "AGE"])?;
    assert_row(&table, "ceph", &["4", "209715200"])?;
    // The category lists every haulage kind at once.
    let all = cluster
        .kubectl_ok(&["get", "haulage", "-A", "-o", "name"], None)
        .await?;
    for kind in [
        "backupstoragelocation",
        "storagepolicy",
        "volumebackup",
        "volumetransfer",
    ] {
        assert!(
            all.contains(&format!("{kind}.haulage.dev/")),
            "{kind} missing:\n{all}"
        );
    }
    Ok(())
}

/// The header line of a `kubectl get` table has these columns, in order.
fn assert_columns(table: &str, columns: &[&str]) -> anyhow::Result<()> {
    let header = table.lines().next().context("empty table")?;
    let mut rest = header;
    for column in columns {
        let at = rest
            .find(column)
            .with_context(|| format!("column {column:?} missing or out of order in {header:?}"))?;
        rest = &rest[at + column.len()..];
    }
    Ok(())
}

/// The row of `name` holds these cells.
fn assert_row(table: &str, name: &str, cells: &[&str]) -> anyhow::Result<()> {
    let row = table
        .lines()
        .find(|line| line.split_whitespace().next() == Some(name))
        .with_context(|| format!("no row {name} in\n{table}"))?;
    let words: Vec<&str> = row.split_whitespace().collect();
    for cell in cells {
        if !words.contains(cell) {
            bail!("row {name} lacks {cell:?}: {row:?}");
        }
    }
    Ok(())
}

/// `kubectl auth can-i VERB RESOURCE... --as=USER` says `expected`.
async fn assert_can(
    cluster: &KubeCluster,
    user: &str,
    arguments: &[&str],
    expected: bool,
) -> anyhow::Result<()> {
    let as_user = format!("--as={user}");
    let mut args = vec!["auth", "can-i", &as_user];
    args.extend_from_slice(arguments);
    let output = cluster.kubectl_output(&args, None).await?;
    let answer = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let allowed = match answer.as_str() {
        "yes" => true,
        "no" => false,
        _ => bail!(
            "kubectl {} answered {answer:?}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ),
    };
    if allowed != expected {
        bail!(
            "{user} {} {}: expected {}",
            if allowed { "can" } else { "cannot" },
            arguments.join(" "),
            if expected { "yes" } else { "no" }
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_controller_and_agents_get_what_they_need_and_no_more() -> anyhow::Result<()> {
    let cluster = KubeCluster::start().await?;
    cluster.install_manifests().await?;
    cluster
        .kubectl_ok(&["create", "namespace", "shop"], None)
        .await?;

    let can: &[&[&str]] = &[
        &["watch", "volumebackups.haulage.dev", "-A"],
        &[
            "patch",
            "volumebackups.haulage.dev",
            "--subresource=status",
            "-n",
            SYSTEM_NAMESPACE,
        ],
        &[
            "update",
            "volumebackups.haulage.dev",
            "--subresource=finalizers",
            "-n",
            SYSTEM_NAMESPACE,
        ],
        &["create", "volumetransfers.haulage.dev", "-n", "shop"],
        &["delete", "volumetransfers.haulage.dev", "-n", "shop"],
        &[
            "patch",
            "backupstoragelocations.haulage.dev",
            "--subresource=status",
            "-n",
            SYSTEM_NAMESPACE,
        ],
        &["list", "storagepolicies.haulage.dev"],
        &["create", "pods", "-n", "shop"],
        &["delete", "pods", "-n", "shop"],
        &["watch", "pods", "-A"],
        &["watch", "roles.rbac.authorization.k8s.io", "-A"],
        &["list", "persistentvolumeclaims", "-A"],
        // A restore creates its destination claims, labels them, and hands
        // a ReadOnlyMany one back by replacing its ReadWriteOnce claim
        // (deleted once written) with one bound to the same volume.
        &["create", "persistentvolumeclaims", "-n", "shop"],
        &["delete", "persistentvolumeclaims", "-n", "shop"],
        &["patch", "persistentvolumes"],
        &["watch", "persistentvolumes"],
        &["list", "nodes"],
        &["watch", "storageclasses.storage.k8s.io"],
        &["list", "csinodes.storage.k8s.io"],
        &["create", "events", "-n", "shop"],
        &["create", "events.events.k8s.io", "-n", "shop"],
        &[
            "update",
            "leases.coordination.k8s.io",
            "-n",
            SYSTEM_NAMESPACE,
        ],
        &["get", "secrets", "-n", SYSTEM_NAMESPACE],
        &["create", "secrets", "-n", "shop"],
        &["delete", "secrets", "-n", "shop"],
        &["create", "serviceaccounts", "-n", "shop"],
        &["create", "roles.rbac.authorization.k8s.io", "-n", "shop"],
        &[
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            "-n",
            "shop",
        ],
    ];
    for arguments in can {
        assert_can(&cluster, CONTROLLER, arguments, true).await?;
    }
    let cannot: &[&[&str]] = &[
        &["create", "pods", "--subresource=exec", "-n", "shop"],
        &["get", "pods", "--subresource=exec", "-n", "shop"],
        &["create", "pods", "--subresource=attach", "-n", "shop"],
        &["create", "pods", "--subresource=portforward", "-n", "shop"],
        &["get", "pods", "--subresource=log", "-n", "shop"],
        &["get", "secrets", "-n", "shop"],
        &["list", "secrets", "-A"],
        &["watch", "secrets", "-n", "shop"],
        &["patch", "secrets", "-n", "shop"],
        &["update", "secrets", "-n", SYSTEM_NAMESPACE],
        &["update", "leases.coordination.k8s.io", "-n", "shop"],
        &["create", "persistentvolumes"],
        &["delete", "nodes"],
        &["update", "deployments.apps", "-n", "shop"],
        &["create", "clusterroles.rbac.authorization.k8s.io"],
        &["create", "clusterrolebindings.rbac.authorization.k8s.io"],
        &["escalate", "roles.rbac.authorization.k8s.io", "-n", "shop"],
        &["bind", "clusterroles.rbac.authorization.k8s.io"],
        &["impersonate", "serviceaccounts", "-n", "shop"],
        &[
            "create",
            "serviceaccounts",
            "--subresource=token",
            "-n",
            "shop",
        ],
        &["delete", "customresourcedefinitions.apiextensions.k8s.io"],
    ];
    for arguments in cannot {
        assert_can(&cluster, CONTROLLER, arguments, false).await?;
    }

    // The controller can grant an agent its own VolumeTransfers (it holds
    // those rights), but RBAC refuses it a Role with more than it holds.
    let as_controller = format!("--as={CONTROLLER}");
    let agent_role = "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  \
        name: haulage-agent-stage-a\n  namespace: shop\nrules:\n\
        - apiGroups: [haulage.dev]\n  resources: [volumetransfers]\n  \
          resourceNames: [data, logs]\n  verbs: [get, list, watch]\n\
        - apiGroups: [haulage.dev]\n  resources: [volumetransfers/status]\n  \
          resourceNames: [data, logs]\n  verbs: [get, update, patch]\n";
    cluster
        .kubectl_ok(&["create", "-f", "-", &as_controller], Some(agent_role))
        .await
        .context("the controller creates an agent Role")?;
    let escalation = cluster
        .kubectl_output(
            &[
                "create",
                "role",
                "steal-secrets",
                "-n",
                "shop",
                "--verb=get",
                "--resource=secrets",
                &as_controller,
            ],
            None,
        )
        .await?;
    assert!(
        !escalation.status.success(),
        "the controller granted get secrets"
    );
    let stderr = String::from_utf8_lossy(&escalation.stderr);
    assert!(stderr.contains("forbidden"), "{stderr}");

    // The admission policy narrows the controller's Secret writes outside
    // its namespace to labelled credential copies.
    let unlabelled = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: plain\n  namespace: shop\nstringData:\n  cloud: x\n";
    let refused = cluster
        .kubectl_output(&["create", "-f", "-", &as_controller], Some(unlabelled))
        .await?;
    assert!(
        !refused.status.success(),
        "an unlabelled Secret was created by the controller"
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains(CREDENTIALS_COPY_LABEL), "{stderr}");
    let copy = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: haulage-credentials\n  namespace: shop\n  \
         labels:\n    {CREDENTIALS_COPY_LABEL}: \"true\"\nstringData:\n  cloud: x\n"
    );
    cluster
        .kubectl_ok(&["create", "-f", "-", &as_controller], Some(&copy))
        .await
        .context("the controller creates a labelled credentials copy")?;
    cluster
        .kubectl_ok(&["create", "-f", "-"], Some(unlabelled))
        .await
        .context("the admin creates an unlabelled Secret")?;
    let refused = cluster
        .kubectl_output(
            &["delete", "secret", "plain", "-n", "shop", &as_controller],
            None,
        )
        .await?;
    assert!(
        !refused.status.success(),
        "the controller deleted a user's Secret"
    );
    cluster
        .kubectl_ok(
            &[
                "delete",
                "secret",
                "haulage-credentials",
                "-n",
                "shop",
                &as_controller,
            ],
            None,
        )
        .await
        .context("the controller deletes its copy")?;

    // An agent bound to the agent rules reads and reports on transfers and
    // reads nothing else.
    cluster
        .kubectl_ok(
            &["create", "serviceaccount", "haulage-agent", "-n", "shop"],
            None,
        )
        .await?;
    cluster
        .kubectl_ok(
            &[
                "create",
                "rolebinding",
                "haulage-agent",
                "-n",
                "shop",
                "--clusterrole=haulage-agent",
                "--serviceaccount=shop:haulage-agent",
            ],
            None,
        )
        .await?;
    let agent = "system:serviceaccount:shop:haulage-agent";
    for arguments in [
        &["get", "volumetransfers.haulage.dev", "-n", "shop"][..],
        &["watch", "volumetransfers.haulage.dev", "-n", "shop"],
        &[
            "patch",
            "volumetransfers.haulage.dev",
            "--subresource=status",
            "-n",
            "shop",
        ],
    ] {
        assert_can(&cluster, agent, arguments, true).await?;
    }
    for arguments in [
        &["get", "secrets", "-n", "shop"][..],
        &["list", "pods", "-n", "shop"],
        &["patch", "volumetransfers.haulage.dev", "-n", "shop"],
        &["get", "volumetransfers.haulage.dev", "-n", SYSTEM_NAMESPACE],
        &[
            "get",
            "backupstoragelocations.haulage.dev",
            "-n",
            SYSTEM_NAMESPACE,
        ],
        &["create", "pods", "--subresource=exec", "-n", "shop"],
    ] {
        assert_can(&cluster, agent, arguments, false).await?;
    }

    // The harness's unprivileged token is subject to RBAC, through kubectl
    // with the kubeconfig file as through the Rust client.
    let kubeconfig = cluster.kubeconfig().to_string_lossy().into_owned();
    let forbidden = cluster
        .kubectl_output(
            &[
                "--kubeconfig",
                &kubeconfig,
                "--context",
                UNPRIVILEGED_CONTEXT,
                "get",
                "vbk",
                "-n",
                SYSTEM_NAMESPACE,
            ],
            None,
        )
        .await?;
    assert!(!forbidden.status.success());
    let stderr = String::from_utf8_lossy(&forbidden.stderr);
    assert!(
        stderr.contains("Forbidden") && stderr.contains(UNPRIVILEGED_USER),
        "{stderr}"
    );
    let unprivileged = cluster.unprivileged_client().await?;
    let backups: Api<VolumeBackup> = Api::namespaced(unprivileged, SYSTEM_NAMESPACE);
    match backups.list(&Default::default()).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{}", status.message),
        other => bail!("the unprivileged user listed VolumeBackups: {other:?}"),
    }
    Ok(())
}

async fn write_transfer_status_as_controller_and_agent(
    client: &kube::Client,
) -> anyhow::Result<()> {
    let now = Time(Timestamp::now());
    let transfers: Api<VolumeTransfer> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let apply = |status: VolumeTransferStatus| {
        json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": "VolumeTransfer",
            "status": status,
        })
    };
    let mut controller_conditions = Vec::new();
    set_condition(
        &mut controller_conditions,
        Condition::new(
            condition_type::ADMITTED,
            ConditionStatus::True,
            reason::CAPACITY_GRANTED,
            "",
            Some(1),
            now.clone(),
        ),
        now.clone(),
    );
    let controller_status = VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::Admitted),
        attempts: Some(1),
        conditions: controller_conditions,
        ..VolumeTransferStatus::default()
    };
    transfers
        .patch_status(
            "upload",
            &PatchParams::apply(CONTROLLER_FIELD_MANAGER),
            &Patch::Apply(apply(controller_status)),
        )
        .await
        .context("controller applies transfer status")?;
    let agent_status = VolumeTransferStatus {
        phase: Some(VolumeTransferPhase::InProgress),
        agent: Some(AgentClaim {
            identity: "haulage-stage-node-a/5c0ffee".to_string(),
            claimed_at: now.clone(),
            heartbeat_time: now.clone(),
            progress_time: None,
        }),
        progress: Some(
            Progress {
                total_bytes: 1000,
                bytes_done: 250,
                ..Progress::default()
            }
            .with_percent(false),
        ),
        conditions: vec![Condition::new(
            condition_type::PROGRESSING,
            ConditionStatus::True,
            reason::TRANSFERS_RUNNING,
            "reading",
            Some(1),
            now.clone(),
        )],
        ..VolumeTransferStatus::default()
    };
    // The agent takes the phase over from the controller: force, as a
    // claim does after its resourceVersion check.
    transfers
        .patch_status(
            "upload",
            &PatchParams::apply(AGENT_FIELD_MANAGER).force(),
            &Patch::Apply(apply(agent_status)),
        )
        .await
        .context("agent applies transfer status")?;
    let status = transfers
        .get_status("upload")
        .await?
        .status
        .context("transfer status was not stored")?;
    assert_eq!(status.phase, Some(VolumeTransferPhase::InProgress));
    assert_eq!(status.attempts, Some(1));
    assert_eq!(status.progress.map(|p| p.percent), Some(25));
    let types: Vec<&str> = status.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert!(
        types.contains(&condition_type::ADMITTED) && types.contains(&condition_type::PROGRESSING),
        "conditions of one writer were lost: {types:?}"
    );
    Ok(())
}
