//! StoragePolicy caps: admission of transfers under a policy's
//! `maxConcurrentVolumes` (one at a time, the rest queued with positions),
//! and its `maxBytesPerSecond` split into grants that are re-split as
//! transfers start and end, never adding up past the cap.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use haulage::api::backup::VolumeBackupPhase;
use haulage::api::labels::SYSTEM_NAMESPACE;
use haulage::api::{VolumeBackup, VolumeTransferPhase};
use kube::api::Api;
use serde_json::json;

use crate::support::fixture::{
    BACKUP_DEADLINE, Fixture, PROVISIONER, STORAGE_CLASS, create_backup, create_storage_policy,
    eventually, final_phase, is_running_phase, watch_transfers,
};

/// What a watch of every VolumeTransfer saw, event by event.
#[derive(Debug, Default)]
struct AdmissionRecord {
    /// Latest phase of each transfer.
    phases: std::collections::BTreeMap<(String, String), VolumeTransferPhase>,
    /// Most transfers Admitted, InProgress or Finalizing after any event.
    max_running: usize,
    /// Queue positions seen.
    positions: std::collections::BTreeSet<i32>,
    /// Messages of `Admitted=False` conditions seen.
    holds: std::collections::BTreeSet<String>,
    /// Grants of transfers seen running.
    grants: std::collections::BTreeSet<Option<i64>>,
    /// Events seen.
    events: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storage_policy_of_one_volume_admits_its_transfers_one_at_a_time_and_queues_the_rest()
-> anyhow::Result<()> {
    const POLICY_BYTES_PER_SECOND: i64 = 8 << 20;
    let fixture = Fixture::builder().volume_bytes(2 << 20).start().await?;
    let client = &fixture.client;
    // Selected by provisioner, so the StorageClass cache is what matches it.
    create_storage_policy(
        client,
        "one-at-a-time",
        json!({"provisioners": [PROVISIONER], "maxConcurrentVolumes": 1,
                "maxBytesPerSecond": POLICY_BYTES_PER_SECOND}),
    )
    .await?;
    // No wait for the controller to see the policy: admission reads the
    // policies from the API server before it admits, so the backup created
    // right after is capped from its first transfer.

    // Every change of every transfer, in the API server's order.
    let record = Arc::new(std::sync::Mutex::new(AdmissionRecord::default()));
    let recorder = {
        let record = record.clone();
        watch_transfers(client, move |transfer| {
            let mut record = record.lock().expect("record lock");
            let status = transfer.status.clone().unwrap_or_default();
            let phase = status.phase.unwrap_or(VolumeTransferPhase::New);
            let key = (
                transfer.metadata.namespace.clone().unwrap_or_default(),
                transfer.metadata.name.clone().unwrap_or_default(),
            );
            record.phases.insert(key, phase);
            let now_running = record
                .phases
                .values()
                .filter(|p| is_running_phase(**p))
                .count();
            record.max_running = record.max_running.max(now_running);
            record.events += 1;
            if let Some(position) = status.queue_position {
                record.positions.insert(position);
            }
            if is_running_phase(phase) {
                record.grants.insert(transfer.spec.granted_bytes_per_second);
            }
            if let Some(condition) = haulage::api::condition::find_condition(
                &status.conditions,
                haulage::api::condition::condition_type::ADMITTED,
            ) && condition.status == haulage::api::ConditionStatus::False
            {
                record.holds.insert(condition.message.clone());
            }
        })
    };

    create_backup(client, "serial").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(&backups, &fixture.kubelet, "serial", BACKUP_DEADLINE)
        .await
        .with_context(|| {
            format!(
                "admissions seen: {:#?}",
                record.lock().map(|r| format!("{r:?}"))
            )
        })?;
    let status = backup.status.context("status")?;
    assert_eq!(
        status.phase,
        Some(VolumeBackupPhase::Completed),
        "{status:#?}"
    );
    let counts = status.volumes.context("volume counts")?;
    assert_eq!((counts.total, counts.completed), (5, 5));

    // The policy's status settles at nothing running, nothing queued.
    let policies: Api<haulage::api::StoragePolicy> = Api::all(client.clone());
    eventually(Duration::from_secs(30), || async {
        let policy = policies.get("one-at-a-time").await?;
        let status = policy.status.unwrap_or_default();
        Ok((status.running_volumes == Some(0) && status.queued_volumes == Some(0)).then_some(()))
    })
    .await
    .context("the StoragePolicy status did not settle")?;
    recorder.abort();

    {
        let record = record.lock().expect("record lock");
        assert_eq!(record.phases.len(), 5, "{record:?}");
        assert_eq!(
            record.max_running, 1,
            "more than one transfer of the policy's storage ran at once: {record:?}"
        );
        // Four waited behind the first, numbered from 1.
        assert!(record.positions.contains(&1), "{record:?}");
        assert!(
            record.positions.iter().all(|p| (1..=4).contains(p)),
            "{record:?}"
        );
        assert!(
            record.holds.iter().any(|message| message
                .contains("held by StoragePolicy one-at-a-time: 1 of 1 volumes running")),
            "{record:?}"
        );
        // Alone under the policy, each running transfer got its whole bandwidth.
        assert_eq!(
            record.grants,
            std::collections::BTreeSet::from([Some(POLICY_BYTES_PER_SECOND)]),
            "{record:?}"
        );
    }
    fixture.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grants_are_re_split_as_transfers_start_and_end_never_adding_up_past_the_cap()
-> anyhow::Result<()> {
    const CAP: i64 = 4 << 20;
    let fixture = Fixture::builder().volume_bytes(4 << 20).start().await?;
    let client = &fixture.client;
    create_storage_policy(
        client,
        "four-mebibytes",
        json!({"storageClassNames": [STORAGE_CLASS], "maxBytesPerSecond": CAP}),
    )
    .await?;

    // After every event: the sum of the grants of the running transfers,
    // and each transfer's distinct grants while running.
    #[derive(Debug, Default)]
    struct Grants {
        max_sum: i64,
        unlimited_while_running: usize,
        per_transfer: std::collections::BTreeMap<String, std::collections::BTreeSet<i64>>,
    }
    let grants = Arc::new(std::sync::Mutex::new(Grants::default()));
    let recorder = {
        let grants = grants.clone();
        let mut latest: std::collections::BTreeMap<String, Option<i64>> =
            std::collections::BTreeMap::new();
        watch_transfers(client, move |transfer| {
            let name = transfer.metadata.name.clone().unwrap_or_default();
            let phase = transfer
                .status
                .as_ref()
                .and_then(|status| status.phase)
                .unwrap_or(VolumeTransferPhase::New);
            let running = is_running_phase(phase);
            let grant = transfer.spec.granted_bytes_per_second;
            let mut grants = grants.lock().expect("grants lock");
            if running {
                latest.insert(name.clone(), grant);
                match grant {
                    Some(bytes) => {
                        grants.per_transfer.entry(name).or_default().insert(bytes);
                    }
                    None => grants.unlimited_while_running += 1,
                }
            } else {
                latest.remove(&name);
            }
            let sum = latest
                .values()
                .map(|grant| grant.unwrap_or(i64::MAX))
                .fold(0i64, i64::saturating_add);
            grants.max_sum = grants.max_sum.max(sum);
        })
    };

    create_backup(client, "resplit").await?;
    let backups: Api<VolumeBackup> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let backup = final_phase(&backups, &fixture.kubelet, "resplit", BACKUP_DEADLINE).await?;
    recorder.abort();
    assert_eq!(
        backup.status.and_then(|status| status.phase),
        Some(VolumeBackupPhase::Completed)
    );
    let logs = fixture.kubelet.all_agent_logs();
    {
        let grants = grants.lock().expect("grants lock");
        assert_eq!(grants.unlimited_while_running, 0, "{grants:?}");
        assert!(
            grants.max_sum <= CAP,
            "the running transfers' grants added up to {} > {CAP}: {grants:?}",
            grants.max_sum
        );
        // Re-split while running: some transfer saw its grant change, and
        // its agent applied the change without restarting.
        let resplit = grants
            .per_transfer
            .values()
            .filter(|seen| seen.len() >= 2)
            .count();
        assert!(resplit > 0, "no grant changed while running: {grants:?}");
    }
    assert!(
        logs.contains("bandwidth grant changed"),
        "no agent followed a changed grant:\n{logs}"
    );
    fixture.stop().await;
    Ok(())
}
