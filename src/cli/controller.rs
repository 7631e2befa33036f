//! `haulage controller`: validate the arguments into a controller
//! configuration, connect with the in-cluster (or kubeconfig) credentials
//! and run until SIGTERM.

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::cli::Outcome;
use crate::controller::{ControllerArgs, run as run_controller};

/// Run the controller until `cancel`.
pub async fn run(arguments: ControllerArgs, cancel: CancellationToken) -> anyhow::Result<Outcome> {
    let config = arguments.into_config(std::env::var("HOSTNAME").ok())?;
    tracing::info!(identity = %config.identity, "connecting to the Kubernetes API");
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API (no in-cluster config or kubeconfig)")?;
    tracing::info!(
        default_namespace = %client.default_namespace(),
        "Kubernetes API client ready"
    );
    run_controller(config, client, cancel).await?;
    Ok(Outcome::Success)
}
