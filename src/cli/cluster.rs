//! How the cluster-side verbs (`status`, `plan`) reach a cluster: the
//! kubeconfig and context flags kubectl users expect, and the client built
//! from them.

use anyhow::Context as _;
use clap::Args;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// `--kubeconfig` and `--context`, as kubectl takes them.
#[derive(Debug, Clone, Default, Args)]
pub struct ClusterArgs {
    /// Kubeconfig file (default: `$KUBECONFIG`, then `~/.kube/config`, then
    /// the in-cluster configuration).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context (default: the current one).
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
}

/// A client for the cluster the flags name.
pub async fn client(arguments: &ClusterArgs) -> anyhow::Result<kube::Client> {
    let options = KubeConfigOptions {
        context: arguments.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &arguments.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options).await?
        }
        None if arguments.context.is_some() => kube::Config::from_kubeconfig(&options).await?,
        None => kube::Config::infer().await?,
    };
    kube::Client::try_from(config).context("cannot build a Kubernetes client")
}
