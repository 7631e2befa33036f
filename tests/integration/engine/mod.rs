//! The backup/restore/verify engine against real directories and a
//! `file://` repository, through the library and through the `haulage`
//! binary; and the tree verification of a restored directory
//! ([`verify_tree`]).

mod batches;
mod checkpoints;
mod corruption;
mod encryption;
mod faults;
mod heads;
mod index_files;
mod malicious;
mod many_at_once;
mod roundtrip;
mod scatter;
pub mod support;
mod verify_tree;
