//! Test harness shared by the integration tests: a real kube-apiserver and
//! etcd ([`kube`]), a real MinIO server ([`minio`]) and a fault-injecting
//! TCP proxy ([`proxy`]); scraping `/metrics` ([`scrape`]); the
//! apiserver's audit log, to count requests ([`audit`]); the log of
//! in-process controllers, shown when their test fails ([`logs`]); the
//! kubelet and provisioner stand-ins ([`kubelet`], [`provisioner`]); the
//! controller's end-to-end fixture built from all of them ([`fixture`]) and
//! its health endpoints ([`health`]); a real one-node cluster (kubelet,
//! containerd, scheduler, controller-manager, kube-proxy) shared by the
//! tests that need one ([`node`]);
//! two clusters sharing one MinIO for `haulage migrate` ([`migration`]);
//! the output of a command that must succeed ([`stdout_of_success`],
//! [`expect_success`]); the counts a repeated test reads from its
//! environment ([`number_from_env`]).

pub mod audit;
pub mod fixture;
pub mod health;
pub mod kube;
pub mod kubelet;
pub mod logs;
pub mod migration;
pub mod minio;
pub mod node;
pub mod provisioner;
pub mod proxy;
pub mod scrape;

/// A throwaway certificate authority named `common_name`, self-signed, to
/// issue the certificates of the test servers (MinIO over TLS, the
/// kube-apiserver).
pub fn test_ca(
    common_name: &str,
) -> anyhow::Result<rcgen::CertifiedIssuer<'static, rcgen::KeyPair>> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    Ok(CertifiedIssuer::self_signed(params, KeyPair::generate()?)?)
}

/// The whole number in the environment variable `name` (a repeated test's
/// count, e.g. `HAULAGE_KILL_ROUNDS=30`), or `default` when it is not
/// set; a value that is not a number fails the test naming it, rather
/// than running the small count while the user asked for the full one.
pub fn number_from_env(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(value) => value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a whole number")),
        Err(_) => default,
    }
}

/// The stdout of a command that succeeded, or an error naming `what` with
/// the command's exit status, stdout and stderr.
pub fn stdout_of_success(output: &std::process::Output, what: &str) -> anyhow::Result<String> {
    if !output.status.success() {
        anyhow::bail!(
            "{what} failed ({}):\nstdout: {}\nstderr: {}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// [`stdout_of_success`] for a test that stops at the first failure.
#[track_caller]
pub fn expect_success(output: &std::process::Output, what: &str) -> String {
    stdout_of_success(output, what).unwrap_or_else(|error| panic!("{error:#}"))
}
