//! Logging and tracing set-up shared by every llmq binary, so all of them read the same
//! variable (`LLMQ_LOG`, an `EnvFilter` directive such as `info` or `llmq_engine=debug`) and
//! log to stderr, leaving stdout to the program's output.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; `default` applies when `LLMQ_LOG` is unset or invalid.
/// Calling it twice is harmless (the second call changes nothing).
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_env("LLMQ_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
