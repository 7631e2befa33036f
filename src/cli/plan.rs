//! `haulage plan`: show where a backup's stage pods would run, from a
//! `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml` dump,
//! without touching a cluster.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use crate::plan::{LabelSelector, Selection, dump, plan_stage_pods};

/// Arguments of `haulage plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Cluster dump to plan from: the output of
    /// `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml` (or `-o json`).
    #[arg(long, value_name = "DUMP")]
    pub from_file: PathBuf,
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
pub fn run(arguments: &PlanArgs) -> ExitCode {
    match render(arguments) {
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

fn render(arguments: &PlanArgs) -> anyhow::Result<String> {
    let labels = LabelSelector::parse(arguments.selector.as_deref().unwrap_or(""))
        .context("failed to parse --selector")?;
    let selection = Selection {
        namespaces: arguments.namespaces.iter().cloned().collect(),
        labels,
    };
    let text = std::fs::read_to_string(&arguments.from_file)
        .with_context(|| format!("failed to read {}", arguments.from_file.display()))?;
    let facts = dump::parse_dump(&text).with_context(|| {
        format!(
            "failed to read cluster facts from {}",
            arguments.from_file.display()
        )
    })?;
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
