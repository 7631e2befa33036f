//! Test harness shared by the integration tests: a real MinIO server
//! ([`minio`]) and a fault-injecting TCP proxy ([`proxy`]).

pub mod minio;
pub mod proxy;
