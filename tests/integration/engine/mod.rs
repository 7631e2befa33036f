//! The backup/restore/verify engine against real directories and a
//! `file://` repository, through the library and through the `haulage`
//! binary.

mod corruption;
mod faults;
mod malicious;
mod roundtrip;
pub mod support;
