//! Scheduled maintenance of storage locations (`spec.maintenance`): the
//! replica holding the admission Lease looks at every location every
//! [`LOOK_SECONDS`] and prunes the repositories that are due
//! ([`crate::reconcile::maintenance`] decides), one prune per location at
//! a time, each in a task of its own so a long prune never holds the
//! others or the reconcilers back.
//!
//! A prune is the engine's ([`crate::engine::prune`], as `haulage prune`
//! runs it): planning and repacking under the repository's shared lock
//! beside running backups, deletions under its exclusive lock, taken only
//! when no transfer holds the shared one (the agents take it for each
//! volume). When transfers hold the repository for longer than
//! [`LOCK_WAIT_SECONDS`], the deletions are deferred to the next prune
//! and the status says `Deferred` with the holders.
//!
//! `status.maintenance` is written by server-side apply under its own
//! field manager ([`MAINTENANCE_FIELD_MANAGER`]), so the location
//! reconciler's status writes never undo it. The `Running` record is
//! applied with the resourceVersion the decision saw: of two replicas
//! during a hand-over of the Lease, only one starts (and the repository
//! refuses a second prune anyway).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::api::BackupStorageLocation;
use crate::api::location::MaintenanceStatus;
use crate::clock;
use crate::controller::Context;
use crate::controller::error::{Error, is_conflict};
use crate::controller::execute::emit;
use crate::controller::lease::Leadership;
use crate::controller::location::{OpenedRepository, apply_status, open_repository};
use crate::engine::prune::{PruneOptions, prune};
use crate::reconcile::maintenance::{
    MaintenanceStep, decide_maintenance, finished_event, finished_status, running_status,
};
use crate::repo::prune::PruneSettings;

/// Seconds between two looks at the locations' schedules.
pub const LOOK_SECONDS: u64 = 30;
/// How long a prune waits for the exclusive lock of its deletions (for
/// running transfers to finish) before deferring them.
pub const LOCK_WAIT_SECONDS: u64 = 10;
/// The field manager of `status.maintenance`.
pub const MAINTENANCE_FIELD_MANAGER: &str = "haulage-maintenance";

/// Prune the locations that are due, while this replica holds the
/// admission Lease, until `shutdown` (which also stops running prunes:
/// interrupted at any point, a prune loses nothing and the next one
/// finishes its work).
pub async fn run(context: Arc<Context>, leadership: Arc<Leadership>, shutdown: CancellationToken) {
    let mut running: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_secs(LOOK_SECONDS)) => {}
        }
        running.retain(|_, prune| !prune.is_finished());
        if !leadership.is_leader() {
            continue;
        }
        for location in context.stores.locations.state() {
            let key = location.uid().unwrap_or_else(|| location.name_any());
            if running.contains_key(&key) {
                continue;
            }
            match decide_maintenance(&location, &clock::now()) {
                MaintenanceStep::NotScheduled
                | MaintenanceStep::NotDue { .. }
                | MaintenanceStep::Refuse { status: None } => {}
                MaintenanceStep::Refuse {
                    status: Some(status),
                } => {
                    warn!(location = %location.name_any(), "{}", status.message.as_deref().unwrap_or_default());
                    if let Err(error) = write_maintenance(&location, &status, false, &context).await
                    {
                        warn!(location = %location.name_any(), "{}", crate::error_chain(&error));
                    }
                }
                MaintenanceStep::Run { settings } => {
                    let prune = prune_location(
                        location.clone(),
                        settings,
                        context.clone(),
                        shutdown.child_token(),
                    );
                    running.insert(key, tokio::spawn(prune));
                }
            }
        }
    }
    for (_, prune) in running {
        let _ = prune.await;
    }
}

/// Prune `location`'s repository with `settings` and record the outcome.
async fn prune_location(
    location: Arc<BackupStorageLocation>,
    settings: PruneSettings,
    context: Arc<Context>,
    cancel: CancellationToken,
) {
    let name = location.name_any();
    let started = running_status(&location, &context.config.identity, clock::now());
    match write_maintenance(&location, &started, true, &context).await {
        Ok(()) => {}
        Err(Error::Kube { source, .. }) if is_conflict(&source) => {
            debug!(location = %name, "the location changed since it was read; its maintenance is looked at again");
            return;
        }
        Err(error) => {
            warn!(location = %name, "not pruning now: {}", crate::error_chain(&error));
            return;
        }
    }
    info!(location = %name, margin_seconds = settings.safety_margin_seconds, "pruning the location's repository");
    let (outcome, secrets) = match open_repository(&location, &context.client).await {
        Err(error) => (Err(crate::error_chain(&error)), Vec::new()),
        Ok(Err(problem)) => (Err(problem), Vec::new()),
        Ok(Ok(OpenedRepository {
            repository,
            secrets,
            ..
        })) => {
            let options = PruneOptions {
                settings,
                dry_run: false,
                lock_wait: Duration::from_secs(LOCK_WAIT_SECONDS),
            };
            let outcome = prune(&repository, &options, &cancel)
                .await
                .map_err(|error| {
                    if cancel.is_cancelled() {
                        "the controller stopped before the prune finished".to_string()
                    } else {
                        crate::error_chain(&error)
                    }
                });
            (outcome, secrets)
        }
    };
    let redacted: Vec<&str> = secrets.iter().map(String::as_str).collect();
    let finished = finished_status(
        &started,
        outcome.as_ref().map_err(String::as_str),
        &redacted,
        clock::now(),
    );
    emit(location.as_ref(), &finished_event(&finished), &context).await;
    if let Err(error) = write_maintenance(&location, &finished, false, &context).await {
        warn!(location = %name, "the prune's outcome is not recorded: {}", crate::error_chain(&error));
    }
}

/// Apply `status` as the location's `status.maintenance`; with
/// `if_unchanged`, only while the location is as `location` shows it (its
/// resourceVersion), so a replica acting on an old copy fails with a
/// conflict.
async fn write_maintenance(
    location: &BackupStorageLocation,
    status: &MaintenanceStatus,
    if_unchanged: bool,
    context: &Context,
) -> Result<(), Error> {
    let mut patch = crate::api::status_apply::<BackupStorageLocation>(&json!({
        "maintenance": status,
    }));
    if if_unchanged {
        patch["metadata"] = json!({"resourceVersion": location.resource_version()});
    }
    apply_status(location, &patch, MAINTENANCE_FIELD_MANAGER, context).await
}
