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
    let (filter, bad) = match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(f) => (f, None),
        Err(e) => {
            // Unset: the default, quietly. Set but not valid: the default, and the log says
            // why (before, the directives asked for were dropped without a word).
            let set = std::env::var_os("RUST_LOG").is_some_and(|v| !v.is_empty());
            let bad = set.then(|| (std::env::var("RUST_LOG").unwrap_or_default(), e));
            (default.into(), bad)
        }
    };
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
    if let Some((value, error)) = bad {
        tracing::warn!(
            RUST_LOG = %value,
            %error,
            "RUST_LOG is not a valid filter; logging at `{default}` instead"
        );
    }
}
