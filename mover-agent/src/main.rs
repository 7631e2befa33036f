//! haulage's mover agent.

fn main() {}
