//! Integration tests of haulage against real parts: a real kube-apiserver
//! and etcd for the API, a real MinIO server for the S3 backend, local
//! directories for the `file://` backend and the engine, and a real node
//! (kubelet, containerd, scheduler) for the install path (`real_node`).
//! One binary so the harness compiles once; each module is one area.

mod api;
mod bench;
mod controller;
mod engine;
mod engine_s3;
mod lifecycle;
mod measurements;
mod migrate;
mod real_node;
mod s3;
mod store_conformance;
mod support;
