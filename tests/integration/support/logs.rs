//! The log of in-process controller replicas, kept with the test that
//! started them: libtest shows it when that test fails (its runtime's
//! threads inherit the test's output capture), so a failure says what the
//! controller saw. `HAULAGE_TEST_LOG` overrides the filter.

use std::sync::Once;

/// Install the test binary's log subscriber (once; later calls do nothing).
pub fn capture() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("HAULAGE_TEST_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,haulage=info"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .with_ansi(false)
            .try_init();
    });
}
