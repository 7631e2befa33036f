//! The API requests of a 100-claim VolumeRestore on the destination
//! cluster, from the apiserver's audit log (docs/benchmarks.md, "API
//! requests of a 100-claim VolumeRestore"), next to those of the backup
//! (`api_requests`).

use std::time::Duration;

use haulage::api::VolumeTransfer;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::transfer::TransferDirection;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};

use super::api_requests::{
    CAP, CLAIMS, NAMESPACES, NODES, VOLUME_BYTES, back_up_the_hundred_claims,
    cap_the_class_at_two_mebibytes_per_second, hundred_claims, print_agent_peak_memory,
    print_agent_requests, print_controller_requests_per_claim, print_lists_and_watches,
    print_status_patches_until, print_transfer_status_patches, team_namespaces, transfer_seconds,
};
use super::spread;
use crate::support::audit;
use crate::support::fixture::{create_restore_of_backup_into, no_leftovers_within};

/// The API requests of a VolumeRestore of 100 claims, counted from the
/// apiserver's audit log from the restore's creation until its stage pods
/// and credentials copies were gone: the controller's by verb and
/// resource (total and per claim), its lists and watches, the restore
/// agents' requests and status writes per transfer, and who patches each
/// transfer's status how often. The same layout as the backup's
/// measurement (100 claims of 1 MiB of sample data in 4 namespaces on 5
/// nodes, 20 stage pods) is backed up first, unpaced; then a StoragePolicy
/// of 2 MiB/s on the storage class paces the restore's transfers only, and
/// the VolumeRestore of that backup maps each `team-N` to `team-N-b`
/// (created) and has the provisioner stand-in bind its new claims. Prints
/// the figures; asserts only that the restore completed. Run with
/// `cargo build -p mover-agent && cargo test --test integration
/// measurements::restore_api_requests -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement for docs/benchmarks.md (~2 min), not a check"]
async fn measure_api_requests_of_a_100_claim_restore() -> anyhow::Result<()> {
    let fixture = hundred_claims().provisioning().start().await?;
    let client = &fixture.client;
    back_up_the_hundred_claims(&fixture).await?;
    // The backup's release is over before the restore starts, so nothing
    // of it is counted as the restore's.
    no_leftovers_within(
        client,
        Duration::from_secs(120),
        "the backup's stage pods or credentials copies left behind",
    )
    .await?;
    // Created after the backup, so only the restore's transfers are paced.
    cap_the_class_at_two_mebibytes_per_second(client).await?;

    let namespaces = team_namespaces();
    let namespaces: Vec<&str> = namespaces.iter().map(String::as_str).collect();
    let created = Timestamp::now();
    create_restore_of_backup_into(client, "hundred", "hundred", &namespaces).await?;
    let status = fixture
        .completed_restore("hundred", Duration::from_secs(900))
        .await?;
    let completed = Timestamp::now();
    let restore_seconds = completed.duration_since(created).as_secs_f64();
    // The release (stage pods, Roles, bindings, credentials copies) comes
    // after the final status: it is part of the restore's requests.
    no_leftovers_within(
        client,
        Duration::from_secs(120),
        "the restore's stage pods or credentials copies left behind",
    )
    .await?;
    let finished = Timestamp::now();

    let transfers: Vec<VolumeTransfer> = Api::<VolumeTransfer>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|transfer| transfer.spec.direction == TransferDirection::Download)
        .collect();
    let transfer_seconds = transfer_seconds(&transfers)?;

    let requests = fixture.cluster.audit_requests()?;
    let controller = audit::service_account(SYSTEM_NAMESPACE, "haulage-controller");
    let during = audit::select(&requests, |user| user == controller, created..=finished);
    let agent_requests = audit::select(&requests, audit::is_agent, created..=finished);

    println!(
        "\n{CLAIMS} claims of {VOLUME_BYTES} B from {NAMESPACES} namespaces restored into \
         {NAMESPACES} new ones on {NODES} nodes, StoragePolicy {CAP} B/s; {} restore transfers; \
         restore Completed {restore_seconds:.1} s after it was created; {} stage pods; \
         transfer time {}  s",
        transfers.len(),
        status.plan.as_ref().map_or(0, |plan| plan.stage_pods.len()),
        spread(&mut transfer_seconds.clone()),
    );
    print_controller_requests_per_claim(
        &during,
        &format!(
            "\ncontroller ({controller}) from the restore's creation until its stage pods and \
             copies were gone ({:.1} s",
            finished.duration_since(created).as_secs_f64()
        ),
    );
    print_lists_and_watches(
        &during,
        "from the restore's creation on",
        created,
        "the restore's creation",
    );
    print_agent_requests(&agent_requests, transfers.len(), &transfer_seconds);
    print_transfer_status_patches(&requests, &transfers, &controller);
    print_status_patches_until(&during, "volumerestores/status", completed, restore_seconds);
    let destinations: Vec<String> = namespaces.iter().map(|n| format!("{n}-b")).collect();
    print_agent_peak_memory(
        fixture
            .kubelet
            .agent_peak_memory()
            .into_iter()
            .filter(|((namespace, _), _)| destinations.contains(namespace))
            .map(|(_, bytes)| bytes),
    );
    fixture.stop().await;
    Ok(())
}
