//! Log setup for every command: `tracing` lines on stderr, text or JSON, filtered with
//! `RUST_LOG`, coloured only on a terminal and never with `NO_COLOR` set.

use shardwire_config::LogFormat;

/// Sets up logging on stderr; `RUST_LOG` syntax, default `info`.
pub fn init(format: LogFormat) {
    init_with(format, "info");
}

/// Text logging with a default filter (RUST_LOG still wins).
pub fn init_filter(default: &str) {
    init_with(LogFormat::Text, default);
}

fn init_with(format: LogFormat, default: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    // Colour only on a terminal, and never with NO_COLOR set (https://no-color.org).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}
