//! Printing: progress bars on stderr, results on stdout (text or JSON).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sealed_store::Progress;
use sealed_store::progress::Phase;

use crate::context::OutputFormat;

/// `-o`, set once from the command line, so every command's document is printed alike.
static FORMAT: OnceLock<OutputFormat> = OnceLock::new();

pub fn set_document_format(format: OutputFormat) {
    let _ = FORMAT.set(format);
}

pub fn bytes(n: u64) -> String {
    humansize::format_size(n, humansize::BINARY)
}

/// Prints `value` as the `-o` document: YAML for `-o yaml`, JSON otherwise.
pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    if FORMAT.get() == Some(&OutputFormat::Yaml) {
        let yaml = serde_saphyr::to_string(value)?;
        print!("{yaml}");
        if !yaml.ends_with('\n') {
            println!();
        }
    } else {
        println!("{}", serde_json::to_string_pretty(value)?);
    }
    Ok(())
}

/// Progress bars on stderr (hidden when stderr is not a terminal or output is JSON).
pub struct Bars {
    bar: ProgressBar,
    enabled: bool,
    uploaded: AtomicU64,
    reused: AtomicU64,
}

impl Bars {
    pub fn new(enabled: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if enabled {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        Bars {
            bar,
            enabled,
            uploaded: AtomicU64::new(0),
            reused: AtomicU64::new(0),
        }
    }
}

impl Progress for Bars {
    fn start(&self, phase: Phase, total_bytes: u64) {
        if !self.enabled {
            return;
        }
        let label = match phase {
            Phase::Scan => "chunking",
            Phase::Upload => "uploading",
            Phase::Download => "pulling",
            Phase::Verify => "verifying",
        };
        self.bar.reset();
        self.bar.set_length(total_bytes);
        self.bar.set_position(0);
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix:>10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}",
        ) {
            self.bar.set_style(style.progress_chars("=> "));
        }
        self.bar.set_prefix(label);
    }
    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn uploaded(&self, bytes: u64) {
        let up = self.uploaded.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.bar.set_message(format!(
            "new {} reused {}",
            self::bytes(up),
            self::bytes(self.reused.load(Ordering::Relaxed))
        ));
    }
    fn reused(&self, bytes: u64) {
        self.reused.fetch_add(bytes, Ordering::Relaxed);
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
