//! The `haulage` binary: parse, set up tracing, run, map errors to exit codes.

fn main() -> std::process::ExitCode {
    haulage::allocator::keep_freed_memory_small();
    haulage::cli::main()
}
