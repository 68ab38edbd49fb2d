//! Logs for every binary: to stderr, filtered by `SEALED_LOG` (an `EnvFilter`, e.g.
//! `sealed_mount=debug,info`), plain text or JSON lines (`SEALED_LOG_JSON=true`, or a binary's
//! own `--log-json`).

/// The environment variable every binary reads its log filter from.
pub const LOG_ENV: &str = "SEALED_LOG";
/// The environment variable that turns JSON lines on for every binary.
pub const LOG_JSON_ENV: &str = "SEALED_LOG_JSON";

/// Whether a `SEALED_LOG_JSON` value asks for JSON: `true`, `1`, `yes` or `on`, in any case.
pub fn json_requested(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        ["true", "1", "yes", "on"]
            .iter()
            .any(|yes| v.trim().eq_ignore_ascii_case(yes))
    })
}

/// The default filter for `-v` given `verbose` times, starting from `quiet` (the level with
/// no `-v`): `warn` → `info` → `debug`; `info` → `debug`.
pub fn verbosity(quiet: &'static str, verbose: u8) -> &'static str {
    const LADDER: [&str; 3] = ["warn", "info", "debug"];
    let start = LADDER.iter().position(|l| *l == quiet).unwrap_or(1);
    LADDER[(start + usize::from(verbose)).min(LADDER.len() - 1)]
}

/// Installs the global subscriber. `SEALED_LOG`, when set and valid, replaces `default`;
/// lines are JSON when `json` or `SEALED_LOG_JSON` says so. A second call (tests starting
/// several servers in one process) keeps the first.
pub fn init(default: &str, json: bool) {
    let json = json || json_requested(std::env::var(LOG_JSON_ENV).ok().as_deref());
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
    use super::{json_requested, verbosity};

    #[test]
    fn json_is_asked_for_by_the_usual_yes_words_only() {
        for yes in ["true", "TRUE", "1", "yes", " on "] {
            assert!(json_requested(Some(yes)), "{yes}");
        }
        for no in ["", "false", "0", "no", "json"] {
            assert!(!json_requested(Some(no)), "{no}");
        }
        assert!(!json_requested(None));
    }

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
