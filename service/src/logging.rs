//! Logs for every binary: to stderr, filtered by `SEALED_LOG` (an `EnvFilter`, e.g.
//! `sealed_mount=debug,info`), plain text or JSON lines.

/// The environment variable every binary reads its log filter from.
pub const LOG_ENV: &str = "SEALED_LOG";

/// The default filter for `-v` given `verbose` times, starting from `quiet` (the level with
/// no `-v`): `warn` → `info` → `debug`; `info` → `debug`.
pub fn verbosity(quiet: &'static str, verbose: u8) -> &'static str {
    const LADDER: [&str; 3] = ["warn", "info", "debug"];
    let start = LADDER.iter().position(|l| *l == quiet).unwrap_or(1);
    LADDER[(start + usize::from(verbose)).min(LADDER.len() - 1)]
}

/// Installs the global subscriber. `SEALED_LOG`, when set and valid, replaces `default`.
/// A second call (tests starting several servers in one process) keeps the first.
pub fn init(default: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: container logs and files stay plain, greppable text.
        .with_ansi(!json && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

#[cfg(test)]
mod tests {
    use super::verbosity;

    #[test]
    fn each_v_is_one_level_more_and_debug_is_the_most() {
        assert_eq!(verbosity("warn", 0), "warn");
        assert_eq!(verbosity("warn", 1), "info");
        assert_eq!(verbosity("warn", 2), "debug");
        assert_eq!(verbosity("warn", 200), "debug");
        assert_eq!(verbosity("info", 0), "info");
        assert_eq!(verbosity("info", 1), "debug");
    }
}
