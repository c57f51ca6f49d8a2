//! `lily synth`: writes a synthetic checkpoint in the real format (see
//! `lily_synth`), with a progress bar on stderr and a closing line giving the
//! time taken and the bytes written.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lily_core::Format;
use lily_synth::{synth, Preset, Progress, SynthOptions};

/// Flags of `lily synth`.
#[derive(clap::Args)]
pub struct Args {
    /// `tiny` (hidden 128, 8 layers, ~40 MB in 4-bit) or `full` (the real
    /// shapes, ~20 GB in 4-bit).
    #[arg(long)]
    pub preset: Preset,
    /// Number of layers, a multiple of 4 (default: 8 for tiny, 40 for full).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Seed of the random weights; the same seed gives identical bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `mlx-q4` (MLX affine 4-bit, like mlx-community's release) or
    /// `hf-bf16` (the original BF16 release's layout).
    #[arg(long, default_value = "mlx-q4", value_parser = parse_format)]
    pub format: Format,
    /// Output directory (created if needed).
    #[arg(long)]
    pub out: PathBuf,
}

fn parse_format(s: &str) -> Result<Format, String> {
    match s {
        "mlx-q4" => Ok(Format::MlxQ4),
        "hf-bf16" => Ok(Format::HfBf16),
        other => Err(format!("unknown format {other:?}; expected \"mlx-q4\" or \"hf-bf16\"")),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let bar = Arc::new(ByteBar::new("synth"));
    let mut opts = SynthOptions::new(args.preset, &args.out);
    opts.layers = args.layers;
    opts.seed = args.seed;
    opts.format = args.format;
    let plan = opts.plan()?;
    bar.set_total(plan.total_file_bytes());
    let cb = bar.clone();
    opts.progress = Some(Arc::new(move |p| cb.update(p)));
    let report = synth(&opts).with_context(|| format!("writing {}", args.out.display()))?;
    bar.finish();
    eprintln!(
        "wrote {} ({} preset, {} layers, {} tensors in {} shards): {} in {:.1} s",
        report.out_dir.display(),
        args.preset.name(),
        report.config.num_layers,
        report.tensors,
        report.shards,
        human_bytes(report.bytes_written),
        report.seconds
    );
    Ok(())
}

/// A byte-count progress bar on stderr, fed from writer threads (shared
/// with `lily quantize`).
pub struct ByteBar {
    bar: ProgressBar,
    /// Reports from worker threads can arrive out of order; the bar only
    /// moves forward.
    high: AtomicU64,
}

impl ByteBar {
    pub fn new(label: &'static str) -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("{prefix} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(label);
        ByteBar { bar, high: AtomicU64::new(0) }
    }

    pub fn set_total(&self, bytes: u64) {
        if self.bar.length() != Some(bytes) {
            self.bar.set_length(bytes);
        }
    }

    pub fn update(&self, p: Progress) {
        let before = self.high.fetch_max(p.bytes_done, Ordering::Relaxed);
        if p.bytes_done > before {
            self.bar.set_position(p.bytes_done);
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `1.23 GB` style sizes (decimal units, like `du --si` and the releases).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {} ({n} bytes)", UNITS[u])
    }
}
