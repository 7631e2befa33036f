//! haulage's integration tests, in one binary so they compile once.

mod engine;
