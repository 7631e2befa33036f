//! Test harness shared by the integration tests: a real kube-apiserver and
//! etcd ([`kube`]), a real MinIO server ([`minio`]) and a fault-injecting
//! TCP proxy ([`proxy`]); scraping `/metrics` ([`scrape`]); the
//! apiserver's audit log, to count requests ([`audit`]); the log of
//! in-process controllers, shown when their test fails ([`logs`]).

pub mod audit;
pub mod kube;
pub mod kubelet;
pub mod logs;
pub mod minio;
pub mod proxy;
pub mod scrape;
