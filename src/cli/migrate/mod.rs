//! `haulage migrate`: move namespaces' claims from a source cluster to a
//! destination cluster with haulage's own resources. It creates the
//! VolumeBackup `<name>-1` on the source and, once it completed, the
//! VolumeRestore `<name>-1` on the destination, and follows both with one
//! progress display. With `--quiesce` it then scales the workloads using
//! the claims to zero (recording their replica counts), waits until their
//! pods are gone, and runs the cutover pass `<name>-final` (an
//! incremental backup and a `Sync` restore); then it prints the report.
//!
//! Every step's state is in the clusters' objects, named from `--name`,
//! so running the same command again resumes: an object that exists is
//! followed, a completed pass is skipped. `--unquiesce` (and any failure
//! after quiescing) gives the workloads their replica counts back.
//!
//! The decisions are pure and tested in the submodules: [`settings`]
//! (flags), [`plan`] (specs, checks, the dry run), [`quiesce`] (which
//! workloads, the patches), [`report`] (outcomes, the report); this
//! module reads, writes and waits.

pub mod display;
pub mod plan;
pub mod quiesce;
pub mod report;
pub mod settings;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use clap::Args;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use self::display::Display;
use self::plan::{
    DestinationFacts, MIGRATION_LABEL, MigrationPlan, SourceFacts, backup_spec, check,
    destination_plan, render_dry_run, restore_spec,
};
use self::quiesce::{
    ClaimKey, QUIESCED_AT_ANNOTATION, Workload, WorkloadKind, WorkloadState, pods_using,
    quiesce_patch, quiesced_since, unquiesce_patch, workloads_of,
};
use self::report::{PassObjects, backup_outcome, build_report, render_report, restore_outcome};
use self::settings::{MigrateSettings, Pass, RawSettings};
use crate::api::labels::SYSTEM_NAMESPACE;
use crate::api::{BackupStorageLocation, VolumeBackup, VolumeRestore, VolumeTransfer};
use crate::cli::Outcome;
use crate::cli::cluster::{ClusterArgs, Namespaced, client, list_in_each_namespace};
use crate::cli::transfer_owner::{TransferOwner, owned_transfers};

/// Seconds between two looks at a pass's objects or the quiesced pods.
const POLL_INTERVAL_SECONDS: u64 = 2;
/// Default of `--quiesce-timeout`.
const DEFAULT_QUIESCE_TIMEOUT: &str = "10m";

/// Arguments of `haulage migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Kubeconfig of the source cluster (default: `$KUBECONFIG`, then
    /// `~/.kube/config`).
    #[arg(long, value_name = "FILE")]
    pub from_kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context of the source cluster (default: the file's
    /// current context).
    #[arg(
        long,
        value_name = "CONTEXT",
        required_unless_present = "from_kubeconfig"
    )]
    pub from_context: Option<String>,
    /// Kubeconfig of the destination cluster.
    #[arg(long, value_name = "FILE")]
    pub to_kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context of the destination cluster.
    #[arg(
        long,
        value_name = "CONTEXT",
        required_unless_present_any = ["to_kubeconfig", "unquiesce"]
    )]
    pub to_context: Option<String>,
    /// Namespace to migrate; repeat for several.
    #[arg(
        short = 'n',
        long = "namespace",
        value_name = "NAMESPACE",
        required = true
    )]
    pub namespaces: Vec<String>,
    /// Which claims of those namespaces (kubectl syntax, e.g. `app=db`);
    /// all when absent.
    #[arg(short = 'l', long)]
    pub selector: Option<String>,
    /// Source storage class → destination storage class; repeatable.
    #[arg(long = "storage-class-map", value_name = "SRC=DST")]
    pub storage_class_map: Vec<String>,
    /// Source provisioner → destination storage class, for claims whose
    /// class is not in `--storage-class-map`; repeatable.
    #[arg(long = "provisioner-map", value_name = "PROVISIONER=CLASS")]
    pub provisioner_map: Vec<String>,
    /// Source namespace → destination namespace; repeatable. A namespace
    /// not listed keeps its name.
    #[arg(long = "namespace-map", value_name = "SRC=DST")]
    pub namespace_map: Vec<String>,
    /// Create destination namespaces that do not exist.
    #[arg(long)]
    pub create_namespaces: bool,
    /// Keep ReadOnlyMany claims ReadWriteOnce on the destination instead
    /// of handing them back ReadOnlyMany.
    #[arg(long)]
    pub keep_writable: bool,
    /// Size of the destination claims: `requested` (the source's request),
    /// `used` (bytes in use plus 20 %) or `used+N%`; never smaller than
    /// the data.
    #[arg(long, value_name = "requested|used[+N%]", default_value = "requested")]
    pub size: String,
    /// BackupStorageLocation on the source (default: its default one).
    #[arg(long, value_name = "NAME")]
    pub from_location: Option<String>,
    /// BackupStorageLocation on the destination (default: its default
    /// one); it must name the same bucket and prefix.
    #[arg(long, value_name = "NAME")]
    pub to_location: Option<String>,
    /// The migration's name: its objects are `<name>-1` and
    /// `<name>-final` (default: `migrate-` and the namespaces).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Namespace of the controller, its locations, backups and restores
    /// on both clusters.
    #[arg(long, value_name = "NAMESPACE", default_value = SYSTEM_NAMESPACE)]
    pub controller_namespace: String,
    /// After the first pass, scale the workloads using the claims to zero,
    /// then run the final incremental backup and `Sync` restore.
    #[arg(long)]
    pub quiesce: bool,
    /// Give the workloads quiesced by this migration their replica counts
    /// back (source cluster only), and stop.
    #[arg(long, conflicts_with_all = ["quiesce", "dry_run"])]
    pub unquiesce: bool,
    /// How long the quiesced workloads' pods may take to go away.
    #[arg(long, value_name = "DURATION", default_value = DEFAULT_QUIESCE_TIMEOUT, value_parser = humantime::parse_duration)]
    pub quiesce_timeout: Duration,
    /// Print both plans (the source's stage pods, the destination's claims
    /// and stage pods) and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// No progress bars; plain lines for phase changes only.
    #[arg(long)]
    pub no_progress: bool,
}

impl MigrateArgs {
    fn raw_settings(&self) -> RawSettings {
        RawSettings {
            namespaces: self.namespaces.clone(),
            selector: self.selector.clone(),
            namespace_map: self.namespace_map.clone(),
            storage_class_map: self.storage_class_map.clone(),
            provisioner_map: self.provisioner_map.clone(),
            create_namespaces: self.create_namespaces,
            keep_writable: self.keep_writable,
            size: self.size.clone(),
            from_location: self.from_location.clone(),
            to_location: self.to_location.clone(),
            name: self.name.clone(),
            controller_namespace: self.controller_namespace.clone(),
            quiesce: self.quiesce,
        }
    }
}

/// Both clusters' clients.
struct Clusters {
    source: kube::Client,
    destination: kube::Client,
}

/// Run `haulage migrate`.
pub async fn run(arguments: MigrateArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let settings = arguments.raw_settings().validate()?;
    let source = client(&ClusterArgs {
        kubeconfig: arguments.from_kubeconfig.clone(),
        context: arguments.from_context.clone(),
    })
    .await
    .context("cannot reach the source cluster (check --from-kubeconfig and --from-context)")?;
    if arguments.unquiesce {
        let restored = unquiesce(&source, &settings, &|text| println!("{text}")).await?;
        if restored == 0 {
            println!(
                "no workload in namespaces {} was quiesced by migration {}",
                settings.namespaces.join(", "),
                settings.name
            );
        }
        return Ok(Outcome::Success);
    }
    let destination = client(&ClusterArgs {
        kubeconfig: arguments.to_kubeconfig.clone(),
        context: arguments.to_context.clone(),
    })
    .await
    .context("cannot reach the destination cluster (check --to-kubeconfig and --to-context)")?;
    let clusters = Clusters {
        source,
        destination,
    };
    let source_facts = read_source(&clusters.source, &settings).await?;
    let destination_facts = read_destination(&clusters.destination, &settings).await?;
    let plan = check(&settings, &source_facts, &destination_facts)?;
    if arguments.dry_run {
        let restore_plan = destination_plan(&plan, &destination_facts)
            .map_err(|error| anyhow!("cannot plan the destination's stage pods: {error}"))?;
        print!("{}", render_dry_run(&settings, &plan, &restore_plan));
        return Ok(Outcome::Success);
    }
    let mut display = Display::new(arguments.no_progress);
    let migration = Migration {
        clusters: &clusters,
        settings: &settings,
        plan: &plan,
        cancel: &cancel,
        quiesce_timeout: arguments.quiesce_timeout,
    };
    let result = migration.run(&mut display).await;
    display.finish();
    if let Err(error) = result {
        if cancel.is_cancelled() {
            // What goes on in the clusters, before the CLI's generic line.
            eprintln!("{error:#}");
        }
        return Err(error);
    }
    let report = migration.report().await?;
    print!("{}", render_report(&report));
    Ok(Outcome::Success)
}

/// One run of a migration.
struct Migration<'a> {
    clusters: &'a Clusters,
    settings: &'a MigrateSettings,
    plan: &'a MigrationPlan,
    cancel: &'a CancellationToken,
    quiesce_timeout: Duration,
}

impl Migration<'_> {
    fn backups(&self) -> Api<VolumeBackup> {
        Api::namespaced(
            self.clusters.source.clone(),
            &self.settings.controller_namespace,
        )
    }

    fn restores(&self) -> Api<VolumeRestore> {
        Api::namespaced(
            self.clusters.destination.clone(),
            &self.settings.controller_namespace,
        )
    }

    fn interrupted(&self) -> anyhow::Error {
        anyhow!(
            "interrupted: the VolumeBackup and VolumeRestore of migration {} go on in the clusters (the workloads stay as they are); run the same `haulage migrate` again to follow them, or `haulage migrate --unquiesce` to bring quiesced workloads back",
            self.settings.name
        )
    }

    async fn wait(&self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.cancel.cancelled() => Err(self.interrupted()),
            _ = tokio::time::sleep(Duration::from_secs(POLL_INTERVAL_SECONDS)) => Ok(()),
        }
    }

    /// Follow `name` through `api` until it is finished, showing it.
    async fn follow<K: TransferOwner>(
        &self,
        api: &Api<K>,
        name: &str,
        display: &mut Display,
    ) -> anyhow::Result<K> {
        let row = format!("{} {name}", K::NOUN);
        loop {
            let object = api
                .get(name)
                .await
                .with_context(|| format!("cannot read {row}"))?;
            display.show(&row, &object.shown_phase(), object.progress());
            if object.is_finished() {
                return Ok(object);
            }
            self.wait().await?;
        }
    }

    /// The pass's VolumeBackup, like [`Migration::pass`].
    async fn backup_pass(
        &self,
        pass: Pass,
        annotations: BTreeMap<String, String>,
        display: &mut Display,
    ) -> anyhow::Result<VolumeBackup> {
        let name = pass.object_name(&self.settings.name);
        let mut backup = VolumeBackup::new(&name, backup_spec(self.settings, pass));
        backup.metadata.annotations = (!annotations.is_empty()).then_some(annotations);
        self.pass(&self.backups(), backup, "source", display).await
    }

    /// The pass's VolumeRestore, like [`Migration::pass`].
    async fn restore_pass(
        &self,
        pass: Pass,
        display: &mut Display,
    ) -> anyhow::Result<VolumeRestore> {
        let name = pass.object_name(&self.settings.name);
        let restore = VolumeRestore::new(&name, restore_spec(self.settings, pass));
        self.pass(&self.restores(), restore, "destination", display)
            .await
    }

    /// A pass's object on the `side` cluster: `object`, with the
    /// migration's namespace and labels, created when none of its name
    /// exists yet (an existing one's spec was checked to be this run's),
    /// then followed.
    async fn pass<K>(
        &self,
        api: &Api<K>,
        mut object: K,
        side: &str,
        display: &mut Display,
    ) -> anyhow::Result<K>
    where
        K: TransferOwner + serde::Serialize,
    {
        let name = object.name_any();
        if api.get_opt(&name).await?.is_none() {
            object.meta_mut().namespace = Some(self.settings.controller_namespace.clone());
            object.meta_mut().labels = Some(self.labels());
            let created = format!(
                "{} {}/{name} on the {side}",
                K::kind(&()),
                self.settings.controller_namespace
            );
            create_once(api, &object)
                .await
                .with_context(|| format!("cannot create {created}"))?;
            display.line(&format!("created {created}"));
        }
        self.follow(api, &name, display).await
    }

    fn labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([(MIGRATION_LABEL.to_string(), self.settings.name.clone())])
    }

    async fn run(&self, display: &mut Display) -> anyhow::Result<()> {
        let backup = self
            .backup_pass(Pass::First, BTreeMap::new(), display)
            .await?;
        backup_outcome(&backup, &self.plan.deferred_claims(self.settings))
            .map_err(|error| anyhow!(error))?;
        let restore = self.restore_pass(Pass::First, display).await?;
        restore_outcome(&restore).map_err(|error| anyhow!(error))?;
        if !self.settings.quiesce {
            return Ok(());
        }
        let finished = self
            .restores()
            .get_opt(&Pass::Final.object_name(&self.settings.name))
            .await?
            .is_some_and(|restore| restore.is_finished() && restore_outcome(&restore).is_ok());
        if finished {
            return Ok(());
        }
        match self.cutover(display).await {
            Ok(()) => Ok(()),
            Err(error) if self.cancel.is_cancelled() => Err(error),
            Err(error) => {
                display.line(&format!("the cutover failed: {error:#}"));
                display.line("giving the quiesced workloads their replica counts back");
                let restored = unquiesce(&self.clusters.source, self.settings, &|text| {
                    display.line(text)
                })
                .await;
                match restored {
                    Ok(_) => Err(error.context(
                        "the cutover failed; the workloads on the source run again with their recorded replica counts",
                    )),
                    Err(unquiesce_error) => Err(error.context(format!(
                        "the cutover failed, and the workloads could not be scaled back ({unquiesce_error:#}): run `haulage migrate --unquiesce` with the same -n and --name"
                    ))),
                }
            }
        }
    }

    /// Quiesce, then the final backup and the `Sync` restore.
    async fn cutover(&self, display: &mut Display) -> anyhow::Result<()> {
        let quiesced_at = quiesce_source(
            &self.clusters.source,
            self.settings,
            &self.plan.claims(),
            self.quiesce_timeout,
            self.cancel,
            display,
        )
        .await?;
        let annotations = BTreeMap::from([(QUIESCED_AT_ANNOTATION.to_string(), quiesced_at)]);
        let backup = self.backup_pass(Pass::Final, annotations, display).await?;
        backup_outcome(&backup, &Default::default()).map_err(|error| anyhow!(error))?;
        let restore = self.restore_pass(Pass::Final, display).await?;
        restore_outcome(&restore).map_err(|error| anyhow!(error))
    }

    /// The report from the passes' objects as they are now.
    async fn report(&self) -> anyhow::Result<report::MigrationReport> {
        let transfers: Api<VolumeTransfer> = Api::all(self.clusters.source.clone());
        let mut objects = Vec::new();
        for pass in [Pass::First, Pass::Final] {
            let name = pass.object_name(&self.settings.name);
            let backup = self.backups().get_opt(&name).await?;
            let restore = self.restores().get_opt(&name).await?;
            let owned = match &backup {
                Some(backup) => owned_transfers(&transfers, backup)
                    .await
                    .with_context(|| format!("cannot list the VolumeTransfers of {name}"))?,
                None => Vec::new(),
            };
            objects.push((pass, backup, owned, restore));
        }
        let quiesced_at = objects
            .iter()
            .find(|(pass, ..)| *pass == Pass::Final)
            .and_then(|(_, backup, ..)| backup.as_ref())
            .and_then(|backup| backup.annotations().get(QUIESCED_AT_ANNOTATION).cloned());
        let passes: Vec<PassObjects<'_>> = objects
            .iter()
            .map(|(pass, backup, transfers, restore)| PassObjects {
                pass: *pass,
                backup: backup.as_ref(),
                transfers,
                restore: restore.as_ref(),
            })
            .collect();
        Ok(build_report(
            &self.settings.name,
            &passes,
            quiesced_at.as_deref(),
        ))
    }
}

/// Scale the workloads of `settings`' namespaces whose pods use `claims`
/// to zero, recording their replica counts (once: a workload quiesced
/// before keeps its count), and wait until those pods are gone (at most
/// `timeout`). Returns when the quiesce started (RFC 3339). Nothing is
/// scaled when one of the pods cannot be (a DaemonSet's, a bare pod).
pub async fn quiesce_source(
    client: &kube::Client,
    settings: &MigrateSettings,
    claims: &BTreeSet<ClaimKey>,
    timeout: Duration,
    cancel: &CancellationToken,
    display: &mut Display,
) -> anyhow::Result<String> {
    let pods = list_pods(client, &settings.namespaces).await?;
    let replica_sets = list_namespaced::<ReplicaSet>(client, &settings.namespaces).await?;
    let workloads = workloads_of(claims, &pods, &replica_sets).map_err(|refusals| {
        anyhow!(
            "cannot quiesce the source (nothing was scaled):\n- {}",
            refusals.join("\n- ")
        )
    })?;
    let now = crate::clock::timestamp().to_string();
    for workload in &workloads {
        let state = workload_state(client, workload).await?;
        if let Some(patch) = quiesce_patch(&state, &settings.name, &now) {
            patch_workload(client, &state, &patch).await?;
            display.line(&format!(
                "scaled {workload} to 0 (recorded {} replicas in {})",
                state.recorded_replicas().unwrap_or(state.replicas),
                quiesce::QUIESCED_REPLICAS_ANNOTATION
            ));
        }
    }
    let started = Instant::now();
    loop {
        let pods = list_pods(client, &settings.namespaces).await?;
        let left: Vec<String> = pods_using(claims, &pods)
            .into_iter()
            .map(|(pod, _)| format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any()))
            .collect();
        let shown = if left.is_empty() {
            "pods gone".to_string()
        } else {
            format!("waiting for {} pods to stop", left.len())
        };
        display.show(&format!("quiesce {}", settings.name), &shown, None);
        if left.is_empty() {
            break;
        }
        if started.elapsed() > timeout {
            bail!(
                "pods still use the migrated claims {}s after quiescing: {} (a workload haulage did not scale, or pods stuck terminating); raise --quiesce-timeout or stop them",
                timeout.as_secs(),
                left.join(", ")
            );
        }
        tokio::select! {
            _ = cancel.cancelled() => bail!(
                "interrupted while waiting for the quiesced pods of migration {} to stop: run the same `haulage migrate --quiesce` again to go on, or `haulage migrate --unquiesce` to bring the workloads back",
                settings.name
            ),
            _ = tokio::time::sleep(Duration::from_secs(POLL_INTERVAL_SECONDS)) => {}
        }
    }
    let states = quiesced_workloads(client, &settings.namespaces).await?;
    Ok(quiesced_since(&states, &settings.name).unwrap_or(now))
}

/// Create `object`; one created meanwhile by another run is taken as it.
async fn create_once<K>(api: &Api<K>, object: &K) -> Result<(), kube::Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(error) => Err(error),
    }
}

/// The objects of kind `K` in `namespaces`.
async fn list_namespaced<K: Namespaced>(
    client: &kube::Client,
    namespaces: &[String],
) -> anyhow::Result<Vec<K>> {
    list_in_each_namespace(client, namespaces, |namespace| {
        format!("cannot list {} in namespace {namespace}", K::plural(&()))
    })
    .await
}

async fn list_pods(client: &kube::Client, namespaces: &[String]) -> anyhow::Result<Vec<Pod>> {
    list_namespaced::<Pod>(client, namespaces).await
}

/// The kinds a migration scales.
trait Scaled: Namespaced {
    /// Its kind.
    const KIND: WorkloadKind;
    /// Its `spec.replicas`.
    fn replicas(&self) -> Option<i32>;
}

impl Scaled for Deployment {
    const KIND: WorkloadKind = WorkloadKind::Deployment;
    fn replicas(&self) -> Option<i32> {
        self.spec.as_ref()?.replicas
    }
}

impl Scaled for StatefulSet {
    const KIND: WorkloadKind = WorkloadKind::StatefulSet;
    fn replicas(&self) -> Option<i32> {
        self.spec.as_ref()?.replicas
    }
}

impl Scaled for ReplicaSet {
    const KIND: WorkloadKind = WorkloadKind::ReplicaSet;
    fn replicas(&self) -> Option<i32> {
        self.spec.as_ref()?.replicas
    }
}

fn state_of<K: Scaled>(object: &K) -> WorkloadState {
    WorkloadState::new(K::KIND, object.meta(), object.replicas())
}

/// The state of `workload` as the API server returns it: read, or, with
/// `patch`, merge-patched with it.
async fn call_workload(
    client: &kube::Client,
    workload: &Workload,
    patch: Option<&serde_json::Value>,
) -> kube::Result<WorkloadState> {
    async fn call<K: Scaled>(
        client: &kube::Client,
        workload: &Workload,
        patch: Option<&serde_json::Value>,
    ) -> kube::Result<WorkloadState> {
        let api = Api::<K>::namespaced(client.clone(), &workload.namespace);
        let object = match patch {
            None => api.get(&workload.name).await?,
            Some(patch) => {
                api.patch(
                    &workload.name,
                    &PatchParams::default(),
                    &Patch::Merge(patch),
                )
                .await?
            }
        };
        Ok(state_of(&object))
    }
    match workload.kind {
        WorkloadKind::Deployment => call::<Deployment>(client, workload, patch).await,
        WorkloadKind::StatefulSet => call::<StatefulSet>(client, workload, patch).await,
        WorkloadKind::ReplicaSet => call::<ReplicaSet>(client, workload, patch).await,
    }
}

async fn workload_state(
    client: &kube::Client,
    workload: &Workload,
) -> anyhow::Result<WorkloadState> {
    call_workload(client, workload, None)
        .await
        .with_context(|| format!("cannot read {workload}"))
}

async fn patch_workload(
    client: &kube::Client,
    state: &WorkloadState,
    patch: &serde_json::Value,
) -> anyhow::Result<()> {
    call_workload(client, &state.workload, Some(patch))
        .await
        .map(drop)
        .with_context(|| format!("cannot scale {}", state.workload))
}

/// Every Deployment, StatefulSet and ReplicaSet of `namespaces`, with
/// their replica counts and annotations.
async fn quiesced_workloads(
    client: &kube::Client,
    namespaces: &[String],
) -> anyhow::Result<Vec<WorkloadState>> {
    async fn states_of<K: Scaled>(
        client: &kube::Client,
        namespaces: &[String],
    ) -> anyhow::Result<Vec<WorkloadState>> {
        Ok(list_namespaced::<K>(client, namespaces)
            .await?
            .iter()
            .map(state_of)
            .collect())
    }
    let mut states = states_of::<Deployment>(client, namespaces).await?;
    states.extend(states_of::<StatefulSet>(client, namespaces).await?);
    states.extend(states_of::<ReplicaSet>(client, namespaces).await?);
    Ok(states)
}

/// Give every workload of the migration's namespaces that this migration
/// quiesced its recorded replica count back, removing the annotations;
/// returns how many. One quiesced by another migration is left alone
/// (and said so).
pub async fn unquiesce(
    client: &kube::Client,
    settings: &MigrateSettings,
    say: &dyn Fn(&str),
) -> anyhow::Result<usize> {
    let mut restored = 0;
    for state in quiesced_workloads(client, &settings.namespaces).await? {
        let Some(patch) = unquiesce_patch(&state) else {
            continue;
        };
        if state.quiesced_by() != Some(settings.name.as_str()) {
            say(&format!(
                "{} was quiesced by migration {}, not {}: left as it is",
                state.workload,
                state.quiesced_by().unwrap_or("(unknown)"),
                settings.name
            ));
            continue;
        }
        patch_workload(client, &state, &patch).await?;
        say(&format!(
            "scaled {} back to {} replicas",
            state.workload,
            state.recorded_replicas().unwrap_or(1)
        ));
        restored += 1;
    }
    Ok(restored)
}

async fn list_locations(
    client: &kube::Client,
    settings: &MigrateSettings,
    side: &str,
) -> anyhow::Result<Vec<Arc<BackupStorageLocation>>> {
    let api: Api<BackupStorageLocation> =
        Api::namespaced(client.clone(), &settings.controller_namespace);
    Ok(api
        .list(&ListParams::default())
        .await
        .with_context(|| {
            format!(
                "cannot list BackupStorageLocations in namespace {} on the {side} cluster: is haulage installed there (`kubectl apply -k manifests/`), and is --controller-namespace right?",
                settings.controller_namespace
            )
        })?
        .items
        .into_iter()
        .map(Arc::new)
        .collect())
}

async fn read_source(
    client: &kube::Client,
    settings: &MigrateSettings,
) -> anyhow::Result<SourceFacts> {
    let objects = crate::cli::plan::read_cluster(client, &settings.namespaces)
        .await
        .context("cannot read the source cluster")?;
    let replica_sets = list_namespaced::<ReplicaSet>(client, &settings.namespaces).await?;
    let locations = list_locations(client, settings, "source").await?;
    let backups = pass_objects::<VolumeBackup>(client, settings, "source").await?;
    Ok(SourceFacts {
        objects,
        replica_sets,
        locations,
        backups,
    })
}

/// The migration's objects of kind `K` that exist on one side, first pass
/// then final (`NAME-1`, `NAME-final` in the controller's namespace).
async fn pass_objects<K: Namespaced>(
    client: &kube::Client,
    settings: &MigrateSettings,
    side: &str,
) -> anyhow::Result<Vec<K>> {
    let api: Api<K> = Api::namespaced(client.clone(), &settings.controller_namespace);
    let mut objects = Vec::new();
    for pass in [Pass::First, Pass::Final] {
        let name = pass.object_name(&settings.name);
        if let Some(object) = api
            .get_opt(&name)
            .await
            .with_context(|| format!("cannot read {} {name} on the {side}", K::kind(&())))?
        {
            objects.push(object);
        }
    }
    Ok(objects)
}

async fn read_destination(
    client: &kube::Client,
    settings: &MigrateSettings,
) -> anyhow::Result<DestinationFacts> {
    let objects = crate::cli::plan::read_cluster(client, &settings.destination_namespaces())
        .await
        .context("cannot read the destination cluster")?;
    let namespaces = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context(
            "cannot list the destination's namespaces (haulage migrate needs list on namespaces)",
        )?
        .items
        .iter()
        .map(|namespace| namespace.name_any())
        .collect();
    let locations = list_locations(client, settings, "destination").await?;
    let restores = pass_objects::<VolumeRestore>(client, settings, "destination").await?;
    Ok(DestinationFacts {
        objects,
        namespaces,
        locations,
        restores,
    })
}
