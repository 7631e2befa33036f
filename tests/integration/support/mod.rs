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
//! two clusters sharing one MinIO for `haulage migrate` ([`migration`]).

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
