//! The `haulage` binary: parse, set up tracing, run, map errors to exit codes.

fn main() -> std::process::ExitCode {
    haulage::allocator::keep_freed_memory_small();
    // As the Go runtime does: restores hold a batch's directories open.
    haulage::engine::descriptors::raise_open_file_limit();
    haulage::cli::main()
}
