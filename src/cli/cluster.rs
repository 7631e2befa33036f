//! How the cluster-side verbs (`status`, `plan`, `migrate`) reach a
//! cluster: the kubeconfig and context flags kubectl users expect, the
//! client built from them, and the listing of namespaced objects they
//! share.

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

/// A namespaced kind the verbs read through [`kube::Api::namespaced`]
/// (every kind with these bounds is one).
pub trait Namespaced:
    kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
{
}

impl<K> Namespaced for K where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
{
}

/// The objects of kind `K` in each of `namespaces`, one list per
/// namespace; `failed` words the error of a namespace's list.
pub async fn list_in_each_namespace<K: Namespaced>(
    client: &kube::Client,
    namespaces: &[String],
    failed: impl Fn(&str) -> String,
) -> anyhow::Result<Vec<K>> {
    let mut objects = Vec::new();
    for namespace in namespaces {
        let api: kube::Api<K> = kube::Api::namespaced(client.clone(), namespace);
        objects.extend(
            api.list(&kube::api::ListParams::default())
                .await
                .with_context(|| failed(namespace))?
                .items,
        );
    }
    Ok(objects)
}
