//! `haulage plan`: show where a backup's stage pods would run, from the
//! current kubeconfig context (read-only: lists, never writes) or from a
//! `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml` dump.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use crate::plan::{LabelSelector, Selection, objects, plan_stage_pods};

/// Arguments of `haulage plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Cluster dump to plan from: the output of
    /// `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml` (or `-o json`).
    /// Without it, the cluster of the current kubeconfig context is read.
    #[arg(long, value_name = "DUMP", conflicts_with_all = ["kubeconfig", "context"])]
    pub from_file: Option<PathBuf>,
    /// The cluster to read when no `--from-file` is given.
    #[command(flatten)]
    pub cluster: crate::cli::cluster::ClusterArgs,
    /// Label selector for the claims to back up (kubectl syntax, e.g. `app=db,tier!=cache`).
    #[arg(short = 'l', long)]
    pub selector: Option<String>,
    /// Namespace to back up; repeat for several. Default: every namespace.
    #[arg(short = 'n', long = "namespace", value_name = "NAMESPACE")]
    pub namespaces: Vec<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// How `haulage plan` prints the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Per node: stage pods, volumes, bytes; then the unplaceable claims.
    Table,
    /// `{"stagePods":[...],"unplaceable":[...]}`.
    Json,
    /// The JSON shape, as YAML.
    Yaml,
}

/// Run `haulage plan`; errors go to stderr with their causes.
pub async fn run(arguments: &PlanArgs) -> ExitCode {
    match render(arguments).await {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("haulage plan: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn render(arguments: &PlanArgs) -> anyhow::Result<String> {
    let labels = LabelSelector::parse(arguments.selector.as_deref().unwrap_or(""))
        .context("failed to parse --selector")?;
    let selection = Selection {
        namespaces: arguments.namespaces.iter().cloned().collect(),
        labels,
        ..Selection::default()
    };
    let facts = match &arguments.from_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("failed to read {}", path.display()))?;
            objects::parse_dump(&text)
                .with_context(|| format!("failed to read cluster facts from {}", path.display()))?
        }
        None => {
            let client = crate::cli::cluster::client(&arguments.cluster)
                .await
                .context("cannot reach the Kubernetes API (check --kubeconfig/--context, or plan from a dump with --from-file)")?;
            let objects = read_cluster(&client, &arguments.namespaces).await?;
            objects::facts_from_objects(&objects).context("failed to read cluster facts")?
        }
    };
    let plan = plan_stage_pods(&facts, &selection).context("failed to plan stage pods")?;
    match arguments.output {
        OutputFormat::Table => Ok(plan.to_table()),
        OutputFormat::Json => {
            let mut json =
                serde_json::to_string_pretty(&plan).context("failed to encode the plan as JSON")?;
            json.push('\n');
            Ok(json)
        }
        OutputFormat::Yaml => {
            serde_yaml::to_string(&plan).context("failed to encode the plan as YAML")
        }
    }
}

/// What the planner needs from a live cluster: nodes, CSINodes, PVs and
/// StorageClasses, and pods and claims of the selected namespaces (all when
/// none is selected). One list per kind; nothing is written.
pub(crate) async fn read_cluster(
    client: &kube::Client,
    namespaces: &[String],
) -> anyhow::Result<objects::ClusterObjects> {
    use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
    use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
    use kube::Api;
    use kube::api::ListParams;

    use crate::cli::cluster::{Namespaced, list_in_each_namespace};

    fn refused(what: &str) -> String {
        format!("cannot list {what} (check your RBAC: haulage plan needs list on it)")
    }
    async fn list_all<K>(api: Api<K>, what: &str) -> anyhow::Result<Vec<K>>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        Ok(api
            .list(&ListParams::default())
            .await
            .with_context(|| refused(what))?
            .items)
    }
    async fn in_namespaces<K: Namespaced>(
        client: &kube::Client,
        namespaces: &[String],
        what: &str,
    ) -> anyhow::Result<Vec<K>> {
        if namespaces.is_empty() {
            return list_all(Api::<K>::all(client.clone()), what).await;
        }
        list_in_each_namespace(client, namespaces, |namespace| {
            refused(&format!("{what} in {namespace}"))
        })
        .await
    }
    // A cluster without CSI drivers may not serve CSINodes to this user;
    // attach limits are then unknown rather than an error.
    let csi_nodes = match Api::<CSINode>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        Err(error) => {
            eprintln!(
                "haulage plan: warning: cannot list CSINodes ({error}); CSI attach limits are not checked"
            );
            Vec::new()
        }
    };
    Ok(objects::ClusterObjects {
        nodes: list_all(Api::<Node>::all(client.clone()), "Nodes").await?,
        csi_nodes,
        pods: in_namespaces::<Pod>(client, namespaces, "Pods").await?,
        claims: in_namespaces::<PersistentVolumeClaim>(
            client,
            namespaces,
            "PersistentVolumeClaims",
        )
        .await?,
        volumes: list_all(
            Api::<PersistentVolume>::all(client.clone()),
            "PersistentVolumes",
        )
        .await?,
        storage_classes: list_all(Api::<StorageClass>::all(client.clone()), "StorageClasses")
            .await?,
        limit_ranges: Vec::new(),
    })
}
