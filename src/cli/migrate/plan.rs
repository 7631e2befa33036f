//! What a migration will do, decided from the two clusters' objects
//! before anything is written: the VolumeBackup and VolumeRestore specs of
//! each pass ([`backup_spec`], [`restore_spec`]), the checks that refuse
//! bad input by name ([`check`]: a storage location missing on either
//! side or pointing at another repository, a namespace map that collides
//! or names a namespace not migrated, a class map to a class missing on
//! the destination, a destination claim that exists, a ReadWriteOncePod
//! claim in use without `--quiesce`, a workload that cannot be quiesced,
//! an object of an earlier run with another spec), and the `--dry-run`
//! plans ([`render_dry_run`]): the source's stage pods as `haulage plan`
//! shows them, the destination's claims as the controller will create
//! them ([`crate::reconcile::claims::destination_of`]) and its restore
//! stage pods ([`crate::plan::plan_restore`]). Pure: the CLI reads the
//! facts and writes the objects.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector as KubeLabelSelector, LabelSelectorRequirement,
};
use kube::ResourceExt;

use super::quiesce::{ClaimKey, Workload, single_pod_claims_in_use, workloads_of};
use super::settings::{MigrateSettings, Pass};
use crate::api::backup::{ParentPolicy, VolumeBackupSpec};
use crate::api::labels::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::api::restore::{ExistingClaimPolicy, RestoreSource, SizeChoice, VolumeRestoreSpec};
use crate::api::{BackupStorageLocation, VolumeBackup, VolumeRestore};
use crate::cli::text::access_modes;
use crate::plan::objects::{ClusterObjects, DumpError, facts_from_objects};
use crate::plan::quantity::format_bytes;
use crate::plan::selector::LabelRequirement;
use crate::plan::{
    LabelSelector, PlanError, RestoreClaim, Selection, StagePlan, UnplaceableReason, plan_restore,
    plan_stage_pods,
};
use crate::reconcile::claims::{Destination, DestinationError, claim_record, destination_of};
use crate::reconcile::location::resolve_location;
use crate::reconcile::stage_pod::repository_url;
use crate::repo::snapshot::ClaimRecord;

/// Label on the VolumeBackups and VolumeRestores a migration creates: its
/// name.
pub const MIGRATION_LABEL: &str = "haulage.dev/migration";

/// What the migration reads of the source cluster.
#[derive(Debug, Clone, Default)]
pub struct SourceFacts {
    /// Nodes, volumes and classes; pods and claims of the migrated
    /// namespaces.
    pub objects: ClusterObjects,
    /// ReplicaSets of the migrated namespaces (whose Deployment runs a pod).
    pub replica_sets: Vec<ReplicaSet>,
    /// BackupStorageLocations of the controller's namespace.
    pub locations: Vec<Arc<BackupStorageLocation>>,
    /// The migration's VolumeBackups that exist already.
    pub backups: Vec<VolumeBackup>,
}

/// What the migration reads of the destination cluster.
#[derive(Debug, Clone, Default)]
pub struct DestinationFacts {
    /// Nodes, volumes and classes; pods and claims of the destination
    /// namespaces.
    pub objects: ClusterObjects,
    /// Names of its namespaces.
    pub namespaces: BTreeSet<String>,
    /// BackupStorageLocations of the controller's namespace.
    pub locations: Vec<Arc<BackupStorageLocation>>,
    /// The migration's VolumeRestores that exist already.
    pub restores: Vec<VolumeRestore>,
}

/// The migration's object of `pass` among `objects`, if it exists.
fn of_pass<'a, K: kube::Resource>(
    objects: &'a [K],
    settings: &MigrateSettings,
    pass: Pass,
) -> Option<&'a K> {
    let name = pass.object_name(&settings.name);
    objects
        .iter()
        .find(|object| object.meta().name.as_deref() == Some(name.as_str()))
}

impl SourceFacts {
    /// The migration's VolumeBackup of `pass`, if it exists.
    pub fn backup(&self, settings: &MigrateSettings, pass: Pass) -> Option<&VolumeBackup> {
        of_pass(&self.backups, settings, pass)
    }
}

impl DestinationFacts {
    /// The migration's VolumeRestore of `pass`, if it exists.
    pub fn restore(&self, settings: &MigrateSettings, pass: Pass) -> Option<&VolumeRestore> {
        of_pass(&self.restores, settings, pass)
    }
}

/// A migration refused before anything was written: every reason, each
/// naming the object and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("haulage migrate refused (nothing was changed):\n- {}", reasons.join("\n- "))]
pub struct Refused {
    /// One sentence per problem.
    pub reasons: Vec<String>,
}

/// One claim's move: the source claim, its record (what the snapshot
/// will carry) and its destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimMove {
    /// The source claim.
    pub source: ClaimKey,
    /// Its record, as the controller will write it into the snapshot.
    pub record: ClaimRecord,
    /// Where it goes on the destination.
    pub destination: Destination,
}

/// What [`check`] found the migration will do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationPlan {
    /// Every selected claim's move, sorted by source.
    pub moves: Vec<ClaimMove>,
    /// ReadWriteOncePod claims in use, (claim, pod): left to the final
    /// pass, after quiescing (their first-pass volumes fail as
    /// unplaceable).
    pub deferred: Vec<(String, String)>,
    /// The workloads `--quiesce` scales to zero.
    pub workloads: BTreeSet<Workload>,
    /// The source's stage-pod plan, as `haulage plan` shows it.
    pub source_plan: StagePlan,
    /// The source location's repository URL.
    pub repository: String,
}

impl MigrationPlan {
    /// The selected claims.
    pub fn claims(&self) -> BTreeSet<ClaimKey> {
        self.moves
            .iter()
            .map(|claim| claim.source.clone())
            .collect()
    }

    /// The claims whose first-pass volume may fail without stopping a
    /// `--quiesce` migration: every ReadWriteOncePod claim, in use now or
    /// when the first pass ran (a rerun after the quiesce sees no pod
    /// using it any more, but its first backup still failed it). The
    /// final pass moves them. Empty without `--quiesce`.
    pub fn deferred_claims(&self, settings: &MigrateSettings) -> BTreeSet<ClaimKey> {
        if !settings.quiesce {
            return BTreeSet::new();
        }
        self.moves
            .iter()
            .filter(|claim| {
                claim
                    .record
                    .access_modes
                    .iter()
                    .any(|mode| mode == "ReadWriteOncePod")
            })
            .map(|claim| claim.source.clone())
            .collect()
    }
}

/// The `namespace/name` a migration's VolumeBackup is recorded under in
/// its snapshots (what its VolumeRestore's `source.backup` names).
pub fn recorded_backup_name(settings: &MigrateSettings, pass: Pass) -> String {
    format!(
        "{}/{}",
        settings.controller_namespace,
        pass.object_name(&settings.name)
    )
}

/// A parsed kubectl selector as a Kubernetes `LabelSelector`; `None`
/// for the empty selector (every claim).
pub fn kube_selector(labels: &LabelSelector) -> Option<KubeLabelSelector> {
    if labels.requirements.is_empty() {
        return None;
    }
    let mut match_labels = BTreeMap::new();
    let mut expressions = Vec::new();
    let expression =
        |key: &str, operator: &str, values: Option<Vec<String>>| LabelSelectorRequirement {
            key: key.to_string(),
            operator: operator.to_string(),
            values,
        };
    for requirement in &labels.requirements {
        match requirement {
            LabelRequirement::Equals(key, value) => {
                match match_labels.insert(key.clone(), value.clone()) {
                    // `a=x,a=y` matches nothing; keep both as expressions.
                    Some(previous) if previous != *value => {
                        expressions.push(expression(key, "In", Some(vec![previous])));
                        expressions.push(expression(key, "In", Some(vec![value.clone()])));
                    }
                    _ => {}
                }
            }
            LabelRequirement::NotEquals(key, value) => {
                expressions.push(expression(key, "NotIn", Some(vec![value.clone()])));
            }
            LabelRequirement::In(key, values) => {
                expressions.push(expression(key, "In", Some(values.clone())));
            }
            LabelRequirement::NotIn(key, values) => {
                expressions.push(expression(key, "NotIn", Some(values.clone())));
            }
            LabelRequirement::Exists(key) => expressions.push(expression(key, "Exists", None)),
            LabelRequirement::DoesNotExist(key) => {
                expressions.push(expression(key, "DoesNotExist", None));
            }
        }
    }
    Some(KubeLabelSelector {
        match_labels: (!match_labels.is_empty()).then_some(match_labels),
        match_expressions: (!expressions.is_empty()).then_some(expressions),
    })
}

/// The tags of a pass's snapshots: which migration and which pass.
fn tags(settings: &MigrateSettings, pass: Pass) -> Vec<String> {
    let pass = match pass {
        Pass::First => "1",
        Pass::Final => "final",
    };
    vec![
        format!("migration={}", settings.name),
        format!("pass={pass}"),
    ]
}

/// The VolumeBackup of `pass` on the source: the migrated namespaces and
/// selector into the source location, incremental to each claim's latest
/// snapshot (so the final pass reads only what changed).
pub fn backup_spec(settings: &MigrateSettings, pass: Pass) -> VolumeBackupSpec {
    VolumeBackupSpec {
        namespaces: settings.namespaces.clone(),
        selector: kube_selector(&settings.labels),
        storage_location: settings.from_location.clone(),
        parent_policy: ParentPolicy::Latest,
        tags: tags(settings, pass),
        fail_after_unavailable_seconds: None,
        agent_user: None,
        // The migration's backups are its record of what moved: kept.
        deletion_policy: crate::api::backup::DeletionPolicy::Retain,
        ttl: None,
        claim_names: Vec::new(),
        benchmark: None,
    }
}

/// The VolumeRestore of `pass` on the destination: the snapshots of that
/// pass's VolumeBackup, with the maps. The first pass refuses existing
/// claims (`Fail`); the final pass writes only the differences into the
/// first pass's claims (`Sync`). With `--quiesce` the first pass keeps a
/// ReadOnlyMany claim writable, so the final pass can sync into it before
/// it is handed back ReadOnlyMany.
pub fn restore_spec(settings: &MigrateSettings, pass: Pass) -> VolumeRestoreSpec {
    let (existing_claim, keep_writable) = match pass {
        Pass::First => (
            ExistingClaimPolicy::Fail,
            settings.keep_writable || settings.quiesce,
        ),
        Pass::Final => (ExistingClaimPolicy::Sync, settings.keep_writable),
    };
    VolumeRestoreSpec {
        storage_location: settings.to_location.clone(),
        source: RestoreSource {
            backup: Some(recorded_backup_name(settings, pass)),
            ..RestoreSource::default()
        },
        namespace_map: settings.namespace_map.clone(),
        create_namespaces: settings.create_namespaces,
        storage_class_map: settings.storage_class_map.clone(),
        provisioner_map: settings.provisioner_map.clone(),
        keep_writable,
        size: settings.size.clone(),
        existing_claim,
        fail_after_unavailable_seconds: None,
    }
}

/// The claims the migration moves: those of its namespaces its selector
/// matches, sorted.
pub fn selected_claims<'a>(
    settings: &MigrateSettings,
    objects: &'a ClusterObjects,
) -> Vec<&'a PersistentVolumeClaim> {
    let selection = Selection {
        namespaces: settings.namespaces.iter().cloned().collect(),
        labels: settings.labels.clone(),
        ..Selection::default()
    };
    let mut claims: Vec<&PersistentVolumeClaim> = objects
        .claims
        .iter()
        .filter(|claim| {
            selection.selects(
                &claim.namespace().unwrap_or_default(),
                &claim.name_any(),
                claim.labels(),
            )
        })
        .collect();
    claims.sort_by_key(|claim| (claim.namespace(), claim.name_any()));
    claims
}

/// The objects without haulage's own stage pods (which are not the
/// workload and do not hold the claims for good).
fn without_stage_pods(objects: &ClusterObjects) -> ClusterObjects {
    let mut objects = objects.clone();
    objects
        .pods
        .retain(|pod| pod.labels().get(MANAGED_BY_LABEL).map(String::as_str) != Some(MANAGED_BY));
    objects
}

/// The source's stage-pod plan for the migrated claims.
pub fn source_plan(
    settings: &MigrateSettings,
    source: &SourceFacts,
) -> Result<StagePlan, DumpError> {
    let facts = facts_from_objects(&without_stage_pods(&source.objects))?;
    let selection = Selection {
        namespaces: settings.namespaces.iter().cloned().collect(),
        labels: settings.labels.clone(),
        ..Selection::default()
    };
    // The facts come from one list per kind: no duplicates to refuse.
    Ok(plan_stage_pods(&facts, &selection).unwrap_or_default())
}

/// Whether an existing object's spec is the one this run would create
/// (compared as JSON, as the API server stores it).
fn same_spec<T: serde::Serialize>(existing: &T, desired: &T) -> bool {
    serde_json::to_value(existing).ok() == serde_json::to_value(desired).ok()
}

/// Whether an existing restore of `pass` is the one this run would
/// create. A first pass made without `--quiesce` (ReadOnlyMany claims
/// handed back at once) is still this migration's when the cutover is
/// asked for later.
fn is_this_runs_restore(
    settings: &MigrateSettings,
    pass: Pass,
    existing: &VolumeRestoreSpec,
) -> bool {
    let desired = restore_spec(settings, pass);
    same_spec(existing, &desired)
        || (pass == Pass::First
            && settings.quiesce
            && !settings.keep_writable
            && same_spec(
                existing,
                &VolumeRestoreSpec {
                    keep_writable: false,
                    ..desired
                },
            ))
}

fn check_locations(
    settings: &MigrateSettings,
    source: &SourceFacts,
    destination: &DestinationFacts,
    reasons: &mut Vec<String>,
) -> String {
    let namespace = &settings.controller_namespace;
    let (_, from) = resolve_location(
        namespace,
        settings.from_location.as_deref(),
        &source.locations,
    );
    let (_, to) = resolve_location(
        namespace,
        settings.to_location.as_deref(),
        &destination.locations,
    );
    let missing = |wanted: &Option<String>, side: &str, flag: &str| match wanted {
        Some(name) => format!(
            "BackupStorageLocation {namespace}/{name} does not exist on the {side} cluster: create it there (docs/api.md) or name another with {flag}"
        ),
        None => format!(
            "the {side} cluster has no default BackupStorageLocation in namespace {namespace}: create one marked `default: true` (docs/api.md) or name one with {flag}"
        ),
    };
    if from.is_none() {
        reasons.push(missing(
            &settings.from_location,
            "source",
            "--from-location",
        ));
    }
    if to.is_none() {
        reasons.push(missing(
            &settings.to_location,
            "destination",
            "--to-location",
        ));
    }
    let from_url = from.map(|location| repository_url(&location.spec));
    if let (Some(from), Some(to), Some(from_url)) = (from, to, from_url.as_ref()) {
        let to_url = repository_url(&to.spec);
        if *from_url != to_url {
            reasons.push(format!(
                "the source's BackupStorageLocation {} is {from_url} but the destination's {} is {to_url}: the restore reads the backup's snapshots, so both must name the same bucket and prefix",
                from.name_any(),
                to.name_any()
            ));
        }
    }
    from_url.unwrap_or_default()
}

fn check_namespace_map(settings: &MigrateSettings, reasons: &mut Vec<String>) {
    for source in settings.namespace_map.keys() {
        if !settings.namespaces.contains(source) {
            reasons.push(format!(
                "--namespace-map {source}={}: namespace {source} is not migrated (add -n {source} or drop the entry)",
                settings.namespace_map[source]
            ));
        }
    }
    let mut by_destination: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for namespace in &settings.namespaces {
        by_destination
            .entry(settings.destination_namespace(namespace))
            .or_default()
            .push(namespace);
    }
    for (destination, sources) in by_destination {
        if sources.len() > 1 {
            reasons.push(format!(
                "namespaces {} would all be migrated into namespace {destination} on the destination: give each its own destination with --namespace-map",
                sources.join(" and ")
            ));
        }
    }
}

fn check_class_maps(
    settings: &MigrateSettings,
    destination: &DestinationFacts,
    reasons: &mut Vec<String>,
) {
    let known: BTreeSet<String> = destination
        .objects
        .storage_classes
        .iter()
        .map(|class| class.name_any())
        .collect();
    for (flag, map) in [
        ("--storage-class-map", &settings.storage_class_map),
        ("--provisioner-map", &settings.provisioner_map),
    ] {
        for (source, class) in map {
            if !known.contains(class) {
                reasons.push(format!(
                    "{flag} {source}={class}: storage class {class} does not exist on the destination cluster (it has {}): create it there or map to one of those",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.iter().cloned().collect::<Vec<_>>().join(", ")
                    }
                ));
            }
        }
    }
}

fn destination_refusal(error: &DestinationError) -> String {
    match error {
        DestinationError::StorageClassNotFound {
            class,
            source_claim,
            mapped_from,
        } => format!(
            "storage class {class} (for claim {source_claim}) does not exist on the destination cluster: create it there, or map {mapped_from} to an existing class with --storage-class-map {mapped_from}=CLASS (by class) or --provisioner-map PROVISIONER=CLASS (by provisioner)"
        ),
    }
}

/// Check the migration against both clusters and say what it will do, or
/// refuse with every problem found. `backup`/`restore` objects of an
/// earlier run are taken as this run's when their spec is the one it
/// would create (and refused otherwise).
pub fn check(
    settings: &MigrateSettings,
    source: &SourceFacts,
    destination: &DestinationFacts,
) -> Result<MigrationPlan, Refused> {
    let mut reasons = Vec::new();
    let repository = check_locations(settings, source, destination, &mut reasons);
    check_namespace_map(settings, &mut reasons);
    check_class_maps(settings, destination, &mut reasons);

    for pass in [Pass::First, Pass::Final] {
        if let Some(existing) = source.backup(settings, pass)
            && !same_spec(&existing.spec, &backup_spec(settings, pass))
        {
            reasons.push(format!(
                "VolumeBackup {}/{} exists on the source with another spec (an earlier migration with other flags): run with its flags again, pick another --name, or delete it",
                settings.controller_namespace,
                pass.object_name(&settings.name)
            ));
        }
        if let Some(existing) = destination.restore(settings, pass)
            && !is_this_runs_restore(settings, pass, &existing.spec)
        {
            reasons.push(format!(
                "VolumeRestore {}/{} exists on the destination with another spec (an earlier migration with other flags): run with its flags again, pick another --name, or delete it",
                settings.controller_namespace,
                pass.object_name(&settings.name)
            ));
        }
    }

    let claims = selected_claims(settings, &source.objects);
    if claims.is_empty() {
        reasons.push(format!(
            "no claim in namespace{} {} matches{}: nothing to migrate",
            if settings.namespaces.len() == 1 {
                ""
            } else {
                "s"
            },
            settings.namespaces.join(", "),
            settings
                .selector
                .as_deref()
                .map_or_else(String::new, |selector| format!(" --selector {selector}"))
        ));
    }
    let source_classes: Vec<_> = source.objects.storage_classes.iter().collect();
    let destination_classes: Vec<_> = destination.objects.storage_classes.iter().collect();
    // The claims as the migration leaves them: with --quiesce the first
    // pass keeps a ReadOnlyMany claim writable and the final pass hands it
    // back, so the modes are those of `--keep-writable` either way.
    let restore = VolumeRestoreSpec {
        keep_writable: settings.keep_writable,
        ..restore_spec(settings, Pass::First)
    };
    let recorded = recorded_backup_name(settings, Pass::First);
    let first_restore_exists = destination.restore(settings, Pass::First).is_some();
    let mut moves = Vec::with_capacity(claims.len());
    let mut missing_namespaces = BTreeSet::new();
    for claim in &claims {
        let record = claim_record(claim, &source_classes, &recorded, None);
        let key = (record.namespace.clone(), record.name.clone());
        match destination_of(&record, 0, &restore, &destination_classes) {
            Ok(target) => {
                if !settings.create_namespaces
                    && !destination.namespaces.contains(&target.namespace)
                {
                    missing_namespaces.insert(target.namespace.clone());
                }
                let exists = destination.objects.claims.iter().any(|existing| {
                    existing.namespace().as_deref() == Some(target.namespace.as_str())
                        && existing.name_any() == target.name
                });
                if exists && !first_restore_exists {
                    reasons.push(format!(
                        "claim {}/{} (for {}/{}) already exists on the destination cluster: delete it, or migrate into another namespace with --namespace-map",
                        target.namespace, target.name, key.0, key.1
                    ));
                }
                moves.push(ClaimMove {
                    source: key,
                    record,
                    destination: target,
                });
            }
            Err(error) => reasons.push(destination_refusal(&error)),
        }
    }
    for namespace in missing_namespaces {
        reasons.push(format!(
            "namespace {namespace} does not exist on the destination cluster: create it, map to another with --namespace-map, or pass --create-namespaces"
        ));
    }

    let in_use = single_pod_claims_in_use(&claims, &source.objects.pods);
    if !settings.quiesce {
        for (claim, pod) in &in_use {
            reasons.push(format!(
                "claim {claim} is ReadWriteOncePod and pod {pod} uses it: it can be read only once that pod is gone, so migrate it with --quiesce"
            ));
        }
    }
    let keys: BTreeSet<ClaimKey> = moves.iter().map(|claim| claim.source.clone()).collect();
    let workloads = if settings.quiesce {
        match workloads_of(&keys, &source.objects.pods, &source.replica_sets) {
            Ok(workloads) => workloads,
            Err(refusals) => {
                reasons.extend(refusals);
                BTreeSet::new()
            }
        }
    } else {
        BTreeSet::new()
    };

    let source_plan = match source_plan(settings, source) {
        Ok(plan) => plan,
        Err(error) => {
            reasons.push(format!(
                "cannot read the source cluster's objects for the plan: {}",
                crate::error_chain(&error)
            ));
            StagePlan::default()
        }
    };
    if source.backup(settings, Pass::First).is_none() {
        // A ReadWriteOncePod claim in use is refused above without
        // --quiesce, and left to the final pass with it.
        for unplaceable in &source_plan.unplaceable {
            if !matches!(
                unplaceable.reason,
                UnplaceableReason::SinglePodVolumeInUse { .. }
            ) {
                reasons.push(format!(
                    "claim {}/{} cannot be read on the source: {}",
                    unplaceable.namespace, unplaceable.pvc, unplaceable.reason
                ));
            }
        }
    }

    if reasons.is_empty() {
        Ok(MigrationPlan {
            moves,
            deferred: if settings.quiesce { in_use } else { Vec::new() },
            workloads,
            source_plan,
            repository,
        })
    } else {
        Err(Refused { reasons })
    }
}

/// The destination's restore stage-pod plan for the moves, as the
/// controller's planner will make it for claims not created yet.
pub fn destination_plan(
    plan: &MigrationPlan,
    destination: &DestinationFacts,
) -> Result<StagePlan, String> {
    let facts = facts_from_objects(&without_stage_pods(&destination.objects))
        .map_err(|error| crate::error_chain(&error))?;
    let claims: Vec<RestoreClaim> = plan
        .moves
        .iter()
        .map(|claim| {
            let restore = RestoreClaim::new(
                &claim.destination.namespace,
                &claim.destination.name,
                claim.record.requested_bytes,
            );
            match &claim.destination.storage_class {
                Some(class) => restore.with_storage_class(class),
                None => restore,
            }
        })
        .collect();
    plan_restore(&facts, &claims).map_err(|error: PlanError| error.to_string())
}

/// The size column of a destination claim: the bytes when they are known
/// now, else how the controller will size it from the snapshot.
fn size_text(settings: &MigrateSettings, claim: &ClaimMove) -> String {
    match settings.size.policy {
        SizeChoice::Requested => format_bytes(claim.destination.request_bytes),
        SizeChoice::UsedPlusHeadroom => format!(
            "used+{}% (from the snapshot)",
            settings
                .size
                .headroom_percent
                .unwrap_or(crate::reconcile::claims::DEFAULT_HEADROOM_PERCENT)
        ),
    }
}

fn write_table(out: &mut String, rows: &[Vec<String>]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|column| {
            rows.iter()
                .filter_map(|row| row.get(column))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (column, cell) in row.iter().enumerate() {
            if column + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ", width = widths[column]);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

/// The `--dry-run` text: both plans, and what the migration would then do.
pub fn render_dry_run(
    settings: &MigrateSettings,
    plan: &MigrationPlan,
    destination_plan: &StagePlan,
) -> String {
    let mut out = String::new();
    let namespace = &settings.controller_namespace;
    let _ = writeln!(
        out,
        "haulage migrate {} (dry run: nothing is changed)\n",
        settings.name
    );
    let _ = writeln!(
        out,
        "SOURCE: VolumeBackup {namespace}/{} into {}",
        Pass::First.object_name(&settings.name),
        plan.repository
    );
    out.push_str(&plan.source_plan.to_table());
    let _ = writeln!(
        out,
        "\nDESTINATION: VolumeRestore {namespace}/{} of backup {}",
        Pass::First.object_name(&settings.name),
        recorded_backup_name(settings, Pass::First)
    );
    let mut rows = vec![
        [
            "SOURCE",
            "NAMESPACE",
            "CLAIM",
            "CLASS",
            "ACCESS MODES",
            "SIZE",
        ]
        .map(str::to_string)
        .to_vec(),
    ];
    for claim in &plan.moves {
        let destination = &claim.destination;
        let modes = access_modes(
            &destination.access_modes,
            &destination.final_access_modes,
            |first, last| format!("{first} (then {last})"),
        );
        rows.push(vec![
            format!("{}/{}", claim.source.0, claim.source.1),
            destination.namespace.clone(),
            destination.name.clone(),
            destination
                .storage_class
                .clone()
                .unwrap_or_else(|| "(default)".to_string()),
            modes,
            size_text(settings, claim),
        ]);
    }
    write_table(&mut out, &rows);
    let created: BTreeSet<&str> = plan
        .moves
        .iter()
        .map(|claim| claim.destination.namespace.as_str())
        .collect();
    if settings.create_namespaces {
        let _ = writeln!(
            out,
            "namespaces created when missing: {}",
            created.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    let _ = writeln!(out, "\nrestore stage pods:");
    out.push_str(&destination_plan.to_table());
    if settings.quiesce {
        let _ = writeln!(
            out,
            "\nCUTOVER (--quiesce): scale to zero, then VolumeBackup and VolumeRestore {namespace}/{} (existingClaim: Sync)",
            Pass::Final.object_name(&settings.name)
        );
        if plan.workloads.is_empty() {
            let _ = writeln!(out, "no workload uses the migrated claims");
        }
        for workload in &plan.workloads {
            let _ = writeln!(out, "- {workload}");
        }
        for (claim, pod) in &plan.deferred {
            let _ = writeln!(
                out,
                "claim {claim} (ReadWriteOncePod, used by pod {pod}) moves in the final pass only"
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::BackupStorageLocationSpec;
    use crate::cli::migrate::settings::RawSettings;
    use k8s_openapi::api::core::v1::{Node, PersistentVolume, Pod};
    use k8s_openapi::api::storage::v1::StorageClass;
    use serde_json::json;

    fn settings(configure: impl FnOnce(&mut RawSettings)) -> MigrateSettings {
        let mut raw = RawSettings {
            namespaces: vec!["shop".to_string(), "web".to_string()],
            size: "requested".to_string(),
            controller_namespace: "haulage-system".to_string(),
            namespace_map: vec!["shop=shop-b".to_string(), "web=web-b".to_string()],
            storage_class_map: vec!["fast=gp3".to_string()],
            ..RawSettings::default()
        };
        configure(&mut raw);
        raw.validate().expect("valid settings")
    }

    fn location(name: &str, prefix: &str, default: bool) -> Arc<BackupStorageLocation> {
        let mut location = BackupStorageLocation::test(name);
        location.spec = BackupStorageLocationSpec {
            prefix: Some(prefix.to_string()),
            is_default: default,
            ..location.spec
        };
        Arc::new(location)
    }

    fn class(name: &str, provisioner: &str) -> StorageClass {
        serde_json::from_value(json!({"metadata": {"name": name}, "provisioner": provisioner}))
            .expect("class")
    }

    fn claim(namespace: &str, name: &str, mode: &str, class: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": {"accessModes": [mode], "storageClassName": class,
                "volumeName": format!("pv-{namespace}-{name}"),
                "resources": {"requests": {"storage": "2Gi"}}},
            "status": {"phase": "Bound"},
        }))
        .expect("claim")
    }

    fn volume(namespace: &str, name: &str, mode: &str, class: &str) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": format!("pv-{namespace}-{name}")},
            "spec": {"accessModes": [mode], "storageClassName": class,
                "capacity": {"storage": "2Gi"},
                "csi": {"driver": "test.csi", "volumeHandle": name},
                "claimRef": {"namespace": namespace, "name": name}},
        }))
        .expect("volume")
    }

    fn node(name: &str) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
        .expect("node")
    }

    fn pod(namespace: &str, name: &str, claim: &str, owner: Option<(&str, &str)>) -> Pod {
        let owners: Vec<serde_json::Value> = owner
            .iter()
            .map(|(kind, name)| json!({"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "u", "controller": true}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace, "ownerReferences": owners},
            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]},
            "status": {"phase": "Running"},
        }))
        .expect("pod")
    }

    /// Two namespaces: an RWO claim in use, an RWX one, a ROX one, in two
    /// classes; the destination has gp3 and standard.
    fn clusters() -> (SourceFacts, DestinationFacts) {
        let claims = [
            ("shop", "db", "ReadWriteOnce", "fast"),
            ("shop", "uploads", "ReadWriteMany", "shared"),
            ("web", "assets", "ReadOnlyMany", "shared"),
        ];
        let source = SourceFacts {
            objects: ClusterObjects {
                nodes: vec![node("node-a"), node("node-b")],
                pods: vec![pod("shop", "db-0", "db", Some(("StatefulSet", "db")))],
                claims: claims
                    .iter()
                    .map(|(ns, name, mode, class)| claim(ns, name, mode, class))
                    .collect(),
                volumes: claims
                    .iter()
                    .map(|(ns, name, mode, class)| volume(ns, name, mode, class))
                    .collect(),
                storage_classes: vec![class("fast", "rbd.csi"), class("shared", "cephfs.csi")],
                ..ClusterObjects::default()
            },
            locations: vec![location("a", "repo", true)],
            ..SourceFacts::default()
        };
        let destination = DestinationFacts {
            objects: ClusterObjects {
                nodes: vec![node("node-x")],
                storage_classes: vec![class("gp3", "ebs.csi"), class("shared", "efs.csi")],
                ..ClusterObjects::default()
            },
            namespaces: ["shop-b", "web-b"].map(str::to_string).into(),
            locations: vec![location("b", "repo", true)],
            ..DestinationFacts::default()
        };
        (source, destination)
    }

    #[test]
    fn each_claim_gets_its_mapped_namespace_class_access_modes_and_size() {
        let (source, destination) = clusters();
        let plan = check(&settings(|_| {}), &source, &destination).expect("accepted");
        let moved: Vec<String> = plan
            .moves
            .iter()
            .map(|claim| {
                let d = &claim.destination;
                format!(
                    "{}/{} {} {} then {} {}",
                    d.namespace,
                    d.name,
                    d.storage_class.as_deref().unwrap_or("-"),
                    d.access_modes.join(","),
                    d.final_access_modes.join(","),
                    d.request_bytes
                )
            })
            .collect();
        assert_eq!(
            moved,
            [
                "shop-b/db gp3 ReadWriteOnce then  2147483648",
                "shop-b/uploads shared ReadWriteMany then  2147483648",
                "web-b/assets shared ReadWriteOnce then ReadOnlyMany 2147483648",
            ]
        );
        assert_eq!(plan.repository, "s3://haulage/repo");
        assert!(
            plan.source_plan.unplaceable.is_empty(),
            "{:?}",
            plan.source_plan
        );
        assert_eq!(plan.source_plan.placed_volume_count(), 3);
    }

    fn refusals(
        settings: &MigrateSettings,
        source: &SourceFacts,
        destination: &DestinationFacts,
    ) -> String {
        check(settings, source, destination)
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn a_class_map_to_a_class_missing_on_the_destination_is_refused_by_name() {
        let (source, destination) = clusters();
        let text = refusals(
            &settings(|raw| raw.storage_class_map = vec!["fast=premium".to_string()]),
            &source,
            &destination,
        );
        assert!(
            text.contains("--storage-class-map fast=premium: storage class premium does not exist on the destination cluster (it has gp3, shared)"),
            "{text}"
        );
        assert!(
            text.contains("storage class premium (for claim shop/db)"),
            "the claim is named too: {text}"
        );
        // Unmapped: the source's class name is kept, and missing there.
        let text = refusals(
            &settings(|raw| raw.storage_class_map.clear()),
            &source,
            &destination,
        );
        assert!(
            text.contains(
                "storage class fast (for claim shop/db) does not exist on the destination cluster"
            ) && text.contains("--storage-class-map fast=CLASS"),
            "{text}"
        );
    }

    #[test]
    fn a_provisioner_map_places_a_claim_whose_class_is_not_mapped() {
        let (source, destination) = clusters();
        let plan = check(
            &settings(|raw| {
                raw.storage_class_map.clear();
                raw.provisioner_map = vec!["rbd.csi=gp3".to_string()];
            }),
            &source,
            &destination,
        )
        .expect("accepted");
        assert_eq!(
            plan.moves[0].destination.storage_class.as_deref(),
            Some("gp3")
        );
    }

    #[test]
    fn a_namespace_map_that_collides_or_names_an_unmigrated_namespace_is_refused() {
        let (source, destination) = clusters();
        let text = refusals(
            &settings(|raw| {
                raw.namespace_map = vec!["shop=web-b".to_string(), "web=web-b".to_string()]
            }),
            &source,
            &destination,
        );
        assert!(
            text.contains("namespaces shop and web would all be migrated into namespace web-b"),
            "{text}"
        );
        let text = refusals(
            &settings(|raw| raw.namespace_map.push("blog=blog-b".to_string())),
            &source,
            &destination,
        );
        assert!(
            text.contains("--namespace-map blog=blog-b: namespace blog is not migrated"),
            "{text}"
        );
    }

    #[test]
    fn an_existing_destination_claim_is_refused_on_the_first_pass_only() {
        let (source, mut destination) = clusters();
        destination
            .objects
            .claims
            .push(claim("shop-b", "db", "ReadWriteOnce", "gp3"));
        let text = refusals(&settings(|_| {}), &source, &destination);
        assert!(
            text.contains(
                "claim shop-b/db (for shop/db) already exists on the destination cluster"
            ),
            "{text}"
        );
        // Once the first restore exists, the claim is its own.
        let settings = settings(|_| {});
        let mut restore = VolumeRestore::test(&Pass::First.object_name(&settings.name));
        restore.spec = restore_spec(&settings, Pass::First);
        destination.restores.push(restore);
        assert!(check(&settings, &source, &destination).is_ok());
    }

    #[test]
    fn a_missing_location_on_either_side_or_another_repository_is_refused() {
        let (mut source, mut destination) = clusters();
        source.locations.clear();
        let text = refusals(
            &settings(|raw| raw.to_location = Some("offsite".to_string())),
            &source,
            &destination,
        );
        assert!(
            text.contains("the source cluster has no default BackupStorageLocation in namespace haulage-system"),
            "{text}"
        );
        assert!(
            text.contains("BackupStorageLocation haulage-system/offsite does not exist on the destination cluster"),
            "{text}"
        );
        source.locations.push(location("a", "repo", true));
        destination.locations = vec![location("b", "other", true)];
        let text = refusals(&settings(|_| {}), &source, &destination);
        assert!(
            text.contains("is s3://haulage/repo but the destination's b is s3://haulage/other"),
            "{text}"
        );
    }

    #[test]
    fn a_missing_destination_namespace_is_refused_unless_created() {
        let (source, mut destination) = clusters();
        destination.namespaces.remove("web-b");
        let text = refusals(&settings(|_| {}), &source, &destination);
        assert!(
            text.contains("namespace web-b does not exist on the destination cluster"),
            "{text}"
        );
        assert!(
            check(
                &settings(|raw| raw.create_namespaces = true),
                &source,
                &destination
            )
            .is_ok()
        );
    }

    fn single_pod_source() -> SourceFacts {
        let (mut source, _) = clusters();
        source
            .objects
            .claims
            .push(claim("shop", "ledger", "ReadWriteOncePod", "fast"));
        source
            .objects
            .volumes
            .push(volume("shop", "ledger", "ReadWriteOncePod", "fast"));
        source.objects.pods.push(pod(
            "shop",
            "ledger-0",
            "ledger",
            Some(("StatefulSet", "ledger")),
        ));
        source
    }

    #[test]
    fn a_single_pod_claim_in_use_moves_only_with_quiesce() {
        let source = single_pod_source();
        let (_, destination) = clusters();
        let text = refusals(&settings(|_| {}), &source, &destination);
        assert!(
            text.contains("claim shop/ledger is ReadWriteOncePod and pod shop/ledger-0 uses it")
                && text.contains("--quiesce"),
            "{text}"
        );
        let plan = check(&settings(|raw| raw.quiesce = true), &source, &destination)
            .expect("accepted with --quiesce");
        assert_eq!(
            plan.deferred,
            [("shop/ledger".to_string(), "shop/ledger-0".to_string())]
        );
        let workloads: Vec<String> = plan.workloads.iter().map(ToString::to_string).collect();
        assert_eq!(
            workloads,
            ["StatefulSet shop/db", "StatefulSet shop/ledger"]
        );
        let with_quiesce = settings(|raw| raw.quiesce = true);
        assert_eq!(
            plan.deferred_claims(&with_quiesce),
            [("shop".to_string(), "ledger".to_string())].into()
        );
        // Resumed after the quiesce: no pod uses it, its first backup
        // still failed it, and the migration goes on.
        let mut quiesced = source.clone();
        quiesced.objects.pods.clear();
        let plan = check(&with_quiesce, &quiesced, &destination).expect("accepted");
        assert!(plan.deferred.is_empty());
        assert_eq!(
            plan.deferred_claims(&with_quiesce),
            [("shop".to_string(), "ledger".to_string())].into()
        );
        assert!(plan.deferred_claims(&settings(|_| {})).is_empty());
        // Its workloads are found by their quiesced-by annotation then,
        // not through pods.
        assert!(plan.workloads.is_empty());
    }

    #[test]
    fn a_workload_that_cannot_be_quiesced_is_refused_with_quiesce_only() {
        let (mut source, destination) = clusters();
        source.objects.pods.push(pod(
            "web",
            "assets-agent",
            "assets",
            Some(("DaemonSet", "assets-agent")),
        ));
        assert!(check(&settings(|_| {}), &source, &destination).is_ok());
        let text = refusals(&settings(|raw| raw.quiesce = true), &source, &destination);
        assert!(text.contains("DaemonSet web/assets-agent"), "{text}");
    }

    #[test]
    fn an_earlier_runs_objects_are_followed_only_with_the_same_spec() {
        let (mut source, destination) = clusters();
        let settings = settings(|_| {});
        let mut backup = VolumeBackup::test(&Pass::First.object_name(&settings.name));
        backup.spec = backup_spec(&settings, Pass::First);
        source.backups.push(backup.clone());
        assert!(check(&settings, &source, &destination).is_ok());
        backup.spec.namespaces = vec!["shop".to_string()];
        source.backups = vec![backup];
        let text = refusals(&settings, &source, &destination);
        assert!(
            text.contains("VolumeBackup haulage-system/migrate-shop-web-1 exists on the source with another spec"),
            "{text}"
        );
    }

    #[test]
    fn a_first_pass_made_without_quiesce_is_followed_by_a_later_cutover() {
        let (source, mut destination) = clusters();
        let first_run = settings(|_| {});
        let mut restore = VolumeRestore::test(&Pass::First.object_name(&first_run.name));
        restore.spec = restore_spec(&first_run, Pass::First);
        destination.restores.push(restore);
        let cutover = settings(|raw| raw.quiesce = true);
        assert!(check(&cutover, &source, &destination).is_ok());
        let writable = settings(|raw| {
            raw.quiesce = true;
            raw.keep_writable = true;
        });
        let text = refusals(&writable, &source, &destination);
        assert!(
            text.contains("VolumeRestore haulage-system/migrate-shop-web-1 exists on the destination with another spec"),
            "{text}"
        );
    }

    #[test]
    fn no_matching_claim_is_refused() {
        let (source, destination) = clusters();
        let text = refusals(
            &settings(|raw| raw.selector = Some("app=nothing".to_string())),
            &source,
            &destination,
        );
        assert!(
            text.contains("no claim in namespaces shop, web matches --selector app=nothing"),
            "{text}"
        );
    }

    #[test]
    fn the_passes_specs_name_the_backup_and_sync_only_the_cutover() {
        let settings = settings(|raw| {
            raw.quiesce = true;
            raw.from_location = Some("a".to_string());
            raw.to_location = Some("b".to_string());
            raw.selector = Some("app=db,tier!=cache".to_string());
        });
        let backup = backup_spec(&settings, Pass::Final);
        assert_eq!(backup.namespaces, ["shop", "web"]);
        assert_eq!(backup.storage_location.as_deref(), Some("a"));
        assert_eq!(backup.parent_policy, ParentPolicy::Latest);
        assert_eq!(backup.tags, ["migration=migrate-shop-web", "pass=final"]);
        let selector = backup.selector.expect("a selector");
        assert_eq!(
            selector.match_labels,
            Some([("app".to_string(), "db".to_string())].into())
        );
        let expressions = selector.match_expressions.expect("expressions");
        assert_eq!(
            (
                expressions[0].key.as_str(),
                expressions[0].operator.as_str()
            ),
            ("tier", "NotIn")
        );

        let first = restore_spec(&settings, Pass::First);
        assert_eq!(
            first.source.backup.as_deref(),
            Some("haulage-system/migrate-shop-web-1")
        );
        assert_eq!(first.existing_claim, ExistingClaimPolicy::Fail);
        assert!(first.keep_writable, "ROX stays writable until the cutover");
        let last = restore_spec(&settings, Pass::Final);
        assert_eq!(
            last.source.backup.as_deref(),
            Some("haulage-system/migrate-shop-web-final")
        );
        assert_eq!(last.existing_claim, ExistingClaimPolicy::Sync);
        assert!(
            !last.keep_writable,
            "handed back ReadOnlyMany after the cutover"
        );
        assert_eq!(last.storage_location.as_deref(), Some("b"));
        assert_eq!(
            last.namespace_map.get("shop").map(String::as_str),
            Some("shop-b")
        );
        assert_eq!(
            last.storage_class_map.get("fast").map(String::as_str),
            Some("gp3")
        );

        let without = settings_without_quiesce();
        assert!(!restore_spec(&without, Pass::First).keep_writable);
    }

    fn settings_without_quiesce() -> MigrateSettings {
        settings(|_| {})
    }

    #[test]
    fn the_dry_run_shows_both_plans_with_the_destination_claims() {
        let (source, destination) = clusters();
        let settings = settings(|raw| raw.quiesce = true);
        let plan = check(&settings, &source, &destination).expect("accepted");
        let restore_plan = destination_plan(&plan, &destination).expect("planned");
        assert_eq!(restore_plan.placed_volume_count(), 3);
        let text = render_dry_run(&settings, &plan, &restore_plan);
        assert!(text.contains("node-a"), "source plan: {text}");
        assert!(text.contains("node-x"), "destination plan: {text}");
        let row = text
            .lines()
            .find(|line| line.starts_with("web/assets"))
            .expect("the ROX claim's row");
        assert!(
            row.contains("web-b")
                && row.contains("shared")
                && row.contains("ReadWriteOnce (then ReadOnlyMany)")
                && row.contains("2Gi"),
            "{row}"
        );
        assert!(text.contains("- StatefulSet shop/db"), "{text}");
        let used = settings_with_used_size();
        let plan = check(&used, &source, &destination).expect("accepted");
        let text = render_dry_run(&used, &plan, &restore_plan);
        assert!(text.contains("used+30% (from the snapshot)"), "{text}");
    }

    fn settings_with_used_size() -> MigrateSettings {
        settings(|raw| raw.size = "used+30%".to_string())
    }

    #[test]
    fn kubectl_selectors_become_label_selectors_with_the_same_meaning() {
        let parsed =
            LabelSelector::parse("app=db,env in (prod,staging),!legacy,backup").expect("parses");
        let selector = kube_selector(&parsed).expect("not empty");
        let back = crate::reconcile::backup::label_selector_of(Some(&selector))
            .expect("valid")
            .expect("some");
        for labels in [
            vec![("app", "db"), ("env", "prod"), ("backup", "")],
            vec![("app", "db"), ("env", "dev"), ("backup", "")],
            vec![
                ("app", "db"),
                ("env", "prod"),
                ("backup", ""),
                ("legacy", "1"),
            ],
            vec![("env", "prod"), ("backup", "")],
        ] {
            let labels: BTreeMap<String, String> = labels
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(parsed.matches(&labels), back.matches(&labels), "{labels:?}");
        }
        assert_eq!(kube_selector(&LabelSelector::default()), None);
    }
}
