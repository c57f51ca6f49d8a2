//! `lily quantize`: converts the original BF16 release into the MLX 4-bit
//! layout (see `lily_synth::convert`), with a progress bar on stderr and a
//! closing line giving the time taken and the bytes written.

use std::path::PathBuf;

use anyhow::Context;

use super::synth::{human_bytes, ByteBar};

/// Flags of `lily quantize`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory of the BF16 checkpoint (e.g. `hf download Qwen/Qwen3.6-35B-A3B`).
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Output directory (created if needed).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let bar = ByteBar::new("quantize");
    let progress = |p: lily_synth::Progress| {
        bar.set_total(p.bytes_total);
        bar.update(p);
    };
    let report = lily_synth::quantize_checkpoint(&args.input, &args.out, Some(&progress))
        .with_context(|| format!("quantizing {} into {}", args.input.display(), args.out.display()))?;
    bar.finish();
    if !report.missing.is_empty() {
        eprintln!("warning: the input has no {}; the output lacks it too", report.missing.join(", "));
    }
    eprintln!(
        "wrote {} ({} tensors in {} shards): {} in {:.1} s",
        report.out_dir.display(),
        report.tensors,
        report.shards,
        human_bytes(report.bytes_written),
        report.seconds
    );
    Ok(())
}
