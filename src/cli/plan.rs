//! `haulage plan`: show where a backup's stage pods would run, from a
//! `kubectl get nodes,pods,pvc,pv,storageclasses,csinodes -A -o yaml` dump,
//! without touching a cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use bytesize::ByteSize;
use clap::{Args, ValueEnum};

use crate::plan::{LabelSelector, Selection, StagePlan, dump, plan_stage_pods};

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
        OutputFormat::Table => Ok(table(&plan)),
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

fn human_bytes(bytes: u64) -> String {
    ByteSize::b(bytes).display().iec().to_string()
}

/// The plan as a table: one row per node (stage pods, volumes, bytes,
/// namespaces), a total, then each unplaceable claim with its reason.
pub fn table(plan: &StagePlan) -> String {
    #[derive(Default)]
    struct NodeRow<'p> {
        pods: usize,
        volumes: usize,
        bytes: u64,
        namespaces: BTreeSet<&'p str>,
    }
    let mut rows: BTreeMap<&str, NodeRow> = BTreeMap::new();
    for pod in &plan.stage_pods {
        let row = rows.entry(pod.node.as_str()).or_default();
        row.pods += 1;
        row.volumes += pod.volumes.len();
        row.bytes += pod.bytes;
        row.namespaces.insert(&pod.namespace);
    }
    let mut lines: Vec<[String; 5]> = vec![[
        "NODE".into(),
        "STAGE PODS".into(),
        "VOLUMES".into(),
        "BYTES".into(),
        "NAMESPACES".into(),
    ]];
    for (node, row) in &rows {
        lines.push([
            node.to_string(),
            row.pods.to_string(),
            row.volumes.to_string(),
            human_bytes(row.bytes),
            row.namespaces.iter().copied().collect::<Vec<_>>().join(","),
        ]);
    }
    let mut out = String::new();
    write_columns(&mut out, &lines);
    let _ = writeln!(
        out,
        "\n{} stage pods on {} nodes: {} volumes, {}",
        plan.stage_pods.len(),
        rows.len(),
        plan.placed_volume_count(),
        human_bytes(plan.total_bytes())
    );
    if !plan.unplaceable.is_empty() {
        let _ = writeln!(out, "\nUNPLACEABLE ({})", plan.unplaceable.len());
        let mut lines: Vec<[String; 3]> = vec![["NAMESPACE".into(), "PVC".into(), "REASON".into()]];
        for claim in &plan.unplaceable {
            lines.push([
                claim.namespace.clone(),
                claim.pvc.clone(),
                claim.reason.to_string(),
            ]);
        }
        write_columns(&mut out, &lines);
    }
    out
}

fn write_columns<const WIDTH: usize>(out: &mut String, lines: &[[String; WIDTH]]) {
    let mut widths = [0; WIDTH];
    for line in lines {
        for (width, cell) in widths.iter_mut().zip(line) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for line in lines {
        let mut text = String::new();
        for (index, (cell, width)) in line.iter().zip(widths).enumerate() {
            if index + 1 == WIDTH {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}  ");
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    }
}
