//! The API requests and status writes of a 100-claim VolumeBackup, from
//! the apiserver's audit log (docs/benchmarks.md, "API requests of a
//! 100-claim VolumeBackup").

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context;
use haulage::api::VolumeTransfer;
use haulage::api::backup::VolumeBackupStatus;
use haulage::api::labels::SYSTEM_NAMESPACE;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use serde_json::json;

use super::spread;
use crate::support::audit::{self, Request, count_by_verb_and_resource, table};
use crate::support::fixture::{
    Fixture, FixtureBuilder, Layout, STORAGE_CLASS, create_backup_in, create_storage_policy,
    no_leftovers_within,
};

/// The API requests of a VolumeBackup of 100 claims, counted from the
/// apiserver's audit log (level Metadata, every request): the controller's
/// by verb and resource (before the backup: its start; during the backup:
/// per claim), its lists and watches, the agents' requests and status
/// writes per transfer and per minute of transfer time, and the agents'
/// peak resident memory sampled by the kubelet stand-in. 100 claims of
/// 1 MiB of sample data in 4 namespaces on 5 nodes (20 stage pods), under a
/// StoragePolicy of 2 MiB/s so that transfers last long enough for the
/// progress writes to show their rate. Prints the figures; asserts only
/// that the backup completed. Run with
/// `cargo build -p mover-agent && cargo test --test integration
/// measurements::api_requests -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~1.5 min), not a check"]
async fn measure_api_requests_and_status_writes_of_a_100_claim_backup() -> anyhow::Result<()> {
    let fixture = hundred_claims().start().await?;
    let client = &fixture.client;
    cap_the_class_at_two_mebibytes_per_second(client).await?;
    let created = Timestamp::now();
    let status = back_up_the_hundred_claims(&fixture).await?;
    let completed = Timestamp::now();
    let backup_seconds = completed.duration_since(created).as_secs_f64();
    // The release (stage pods, Roles, bindings, credentials copies) comes
    // after the final status: it is part of the backup's requests.
    no_leftovers_within(
        client,
        Duration::from_secs(120),
        "stage pods or credentials copies left behind",
    )
    .await?;
    let finished = Timestamp::now();

    let transfers: Vec<VolumeTransfer> = Api::<VolumeTransfer>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    assert_eq!(transfers.len(), CLAIMS);
    let transfer_seconds = transfer_seconds(&transfers)?;

    let requests = fixture.cluster.audit_requests()?;
    let controller = audit::service_account(SYSTEM_NAMESPACE, "haulage-controller");
    let is_controller = |user: &str| user == controller;
    let controller_requests = audit::select(&requests, is_controller, ..);
    let before = audit::select(&requests, is_controller, ..created);
    let during = audit::select(&requests, is_controller, created..=finished);
    let agent_requests = audit::select(&requests, audit::is_agent, ..);

    println!(
        "\n{CLAIMS} claims of {VOLUME_BYTES} B in {NAMESPACES} namespaces on {NODES} nodes, \
         StoragePolicy {CAP} B/s; backup Completed {backup_seconds:.1} s after it was created; \
         {} stage pods; transfer time {}  s",
        status.plan.as_ref().map_or(0, |plan| plan.stage_pods.len()),
        spread(&mut transfer_seconds.clone()),
    );
    println!(
        "\ncontroller ({controller}), from its start to the backup's creation \
         ({} requests):\n{}",
        before.len(),
        table(&count_by_verb_and_resource(before), 1, "start")
    );
    print_controller_requests_per_claim(
        &during,
        &format!(
            "controller from the backup's creation until its stage pods and copies were gone \
             ({:.1} s",
            finished.duration_since(created).as_secs_f64()
        ),
    );
    let controller_start = controller_requests
        .first()
        .map(|r| r.received)
        .context("no controller request")?;
    print_lists_and_watches(
        &controller_requests,
        "over the whole run",
        controller_start,
        "the controller's first request",
    );
    print_agent_requests(&agent_requests, CLAIMS, &transfer_seconds);
    print_transfer_status_patches(&requests, &transfers, &controller);
    print_status_patches_until(&during, "volumebackups/status", completed, backup_seconds);
    print_agent_peak_memory(fixture.kubelet.agent_peak_memory().into_values());
    fixture.stop().await;
    Ok(())
}

/// The claims of the API-request measurements, of [`VOLUME_BYTES`] each, in
/// [`NAMESPACES`] namespaces `team-N` on [`NODES`] nodes (20 stage pods).
pub(super) const CLAIMS: usize = 100;
pub(super) const NAMESPACES: usize = 4;
pub(super) const NODES: usize = 5;
pub(super) const VOLUME_BYTES: u64 = 1 << 20;
/// The StoragePolicy's cap on the fixture class, in bytes per second.
pub(super) const CAP: i64 = 2 << 20;

/// An audited fixture of [`CLAIMS`] claims of sample data in [`NAMESPACES`]
/// namespaces on [`NODES`] nodes, to start.
pub(super) fn hundred_claims() -> FixtureBuilder {
    Fixture::builder()
        .layout(Layout::many(CLAIMS, NAMESPACES, NODES))
        .audited()
        .volume_bytes(VOLUME_BYTES)
}

/// The namespaces of [`hundred_claims`]: `team-0` to `team-3`.
pub(super) fn team_namespaces() -> Vec<String> {
    (0..NAMESPACES).map(|n| format!("team-{n}")).collect()
}

/// The StoragePolicy `two-mebibytes`: [`CAP`] on the fixture's class.
pub(super) async fn cap_the_class_at_two_mebibytes_per_second(
    client: &kube::Client,
) -> anyhow::Result<()> {
    create_storage_policy(
        client,
        "two-mebibytes",
        json!({"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": CAP}),
    )
    .await
}

/// Back up the labelled claims of every [`team_namespaces`] namespace as
/// VolumeBackup `hundred`, asserting it Completed within 15 minutes; its
/// status.
pub(super) async fn back_up_the_hundred_claims(
    fixture: &Fixture,
) -> anyhow::Result<VolumeBackupStatus> {
    let namespaces = team_namespaces();
    let namespaces: Vec<&str> = namespaces.iter().map(String::as_str).collect();
    create_backup_in(
        &fixture.client,
        "hundred",
        &namespaces,
        json!({"matchLabels": {"backup": "yes"}}),
    )
    .await?;
    fixture
        .completed_backup("hundred", Duration::from_secs(900))
        .await
}

/// Print the controller's requests `during` a run by verb and resource,
/// total and per claim of [`CLAIMS`], under `heading` (which the count
/// of requests closes).
pub(super) fn print_controller_requests_per_claim(during: &[&Request], heading: &str) {
    println!(
        "{heading}, {} requests):\n{}",
        during.len(),
        table(
            &count_by_verb_and_resource(during.iter().copied()),
            CLAIMS,
            "claim"
        )
    );
}

/// Print how many patches of `resource` (a kind's status) the
/// controller's requests `during` a run made until `completed`, and their
/// rate over `seconds`.
pub(super) fn print_status_patches_until(
    during: &[&Request],
    resource: &str,
    completed: Timestamp,
    seconds: f64,
) {
    let writes = during
        .iter()
        .filter(|r| r.verb == "patch" && r.resource == resource && r.received <= completed)
        .count();
    println!(
        "{resource} patches by the controller: {writes} in {seconds:.1} s = {:.2} per second",
        writes as f64 / seconds
    );
}

/// How long each of `transfers` ran, from its `startTime` to its
/// `completionTime`, in seconds.
pub(super) fn transfer_seconds(transfers: &[VolumeTransfer]) -> anyhow::Result<Vec<f64>> {
    transfers
        .iter()
        .map(|transfer| {
            let status = transfer.status.as_ref().context("transfer status")?;
            let start = status.start_time.as_ref().context("startTime")?.0;
            let end = status.completion_time.as_ref().context("completionTime")?.0;
            Ok(end.duration_since(start).as_secs_f64())
        })
        .collect()
}

/// Print how many of the controller's `requests` are lists and watches,
/// and when each came, in seconds after `origin` (`origin_name`).
pub(super) fn print_lists_and_watches(
    requests: &[&Request],
    over: &str,
    origin: Timestamp,
    origin_name: &str,
) {
    let count = |verb: &str| requests.iter().filter(|r| r.verb == verb).count();
    println!(
        "controller list calls {over}: {}; watches: {}",
        count("list"),
        count("watch")
    );
    for request in requests
        .iter()
        .filter(|r| r.verb == "list" || r.verb == "watch")
    {
        println!(
            "  {:>6.1} s after {origin_name}: {} {} ({:?})",
            request.received.duration_since(origin).as_secs_f64(),
            request.verb,
            request.resource,
            request.code
        );
    }
}

/// Print the agents' `requests` by verb and resource per transfer (of
/// `transfers`), and their status writes per transfer and per minute of
/// the transfers' summed time (`transfer_seconds`).
pub(super) fn print_agent_requests(
    requests: &[&Request],
    transfers: usize,
    transfer_seconds: &[f64],
) {
    let status_writes = requests
        .iter()
        .filter(|r| {
            (r.verb == "patch" || r.verb == "update") && r.resource == "volumetransfers/status"
        })
        .count();
    let transfer_minutes: f64 = transfer_seconds.iter().sum::<f64>() / 60.0;
    println!(
        "\nagents ({} service accounts, {} requests):\n{}",
        requests
            .iter()
            .map(|r| r.user.as_str())
            .collect::<BTreeSet<_>>()
            .len(),
        requests.len(),
        table(
            &count_by_verb_and_resource(requests.iter().copied()),
            transfers,
            "transfer"
        )
    );
    println!(
        "agent status writes: {status_writes} = {:.2} per transfer; transfer time {:.1} min \
         in all = {:.1} status writes per transfer per minute of transfer time",
        status_writes as f64 / transfers.max(1) as f64,
        transfer_minutes,
        status_writes as f64 / transfer_minutes,
    );
}

/// Print who patches the status of each of `transfers` how often: the
/// agent (claim, progress, completion) and the `controller` (admission,
/// queue position), as a spread over the transfers.
pub(super) fn print_transfer_status_patches(
    requests: &[Request],
    transfers: &[VolumeTransfer],
    controller: &str,
) {
    let is_controller = |user: &str| user == controller;
    for (who, filter) in [
        ("controller", &is_controller as &dyn Fn(&str) -> bool),
        ("agents", &audit::is_agent),
    ] {
        let mut per_transfer: BTreeMap<(&str, &str), f64> = transfers
            .iter()
            .filter_map(|transfer| {
                Some((
                    transfer.metadata.namespace.as_deref()?,
                    transfer.metadata.name.as_deref()?,
                ))
            })
            .map(|key| (key, 0.0))
            .collect();
        for request in requests {
            if filter(&request.user)
                && request.verb == "patch"
                && request.resource == "volumetransfers/status"
                && let (Some(namespace), Some(name)) =
                    (request.namespace.as_deref(), request.name.as_deref())
                && let Some(count) = per_transfer.get_mut(&(namespace, name))
            {
                *count += 1.0;
            }
        }
        let mut counts: Vec<f64> = per_transfer.into_values().collect();
        println!(
            "volumetransfers/status patches by the {who} per transfer: {}",
            spread(&mut counts)
        );
    }
}

/// Print the spread of the agents' peak resident memory, `peaks` in bytes.
pub(super) fn print_agent_peak_memory(peaks: impl IntoIterator<Item = u64>) {
    let mut mebibytes: Vec<f64> = peaks
        .into_iter()
        .map(|bytes| bytes as f64 / f64::from(1 << 20))
        .collect();
    println!(
        "agent peak RSS (VmHWM sampled every 100 ms) over {} agents: {} MiB",
        mebibytes.len(),
        spread(&mut mebibytes)
    );
}
