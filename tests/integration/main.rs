//! Integration tests of haulage against real parts: a real kube-apiserver
//! and etcd for the API, a real MinIO server for the S3 backend, local
//! directories for the `file://` backend and the engine. One binary so the
//! harness compiles once; each module is one area.

mod api;
mod controller;
mod engine;
mod s3;
mod store_conformance;
mod support;
