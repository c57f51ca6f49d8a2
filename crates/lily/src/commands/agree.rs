//! `lily agree`: top-1 agreement of the 4-bit model with its unquantised
//! reference over N positions of real text (docs/design.md §7.3).
//!
//! It owns the flags, reading and tokenising the text (with the 4-bit
//! checkpoint's tokenizer) and printing; the comparison itself is
//! `lily_engine::agree`, tested there on tiny checkpoints.

use std::path::PathBuf;

use anyhow::{bail, Context};
use lily_core::tokenizer::Tokenizer;

use crate::backend::{open_backend, Device};

/// Flags of `lily agree`.
#[derive(clap::Args)]
pub struct Args {
    /// The 4-bit (MLX) checkpoint under test.
    #[arg(long)]
    model: PathBuf,
    /// The unquantised (BF16) checkpoint it is compared with.
    #[arg(long)]
    reference: PathBuf,
    /// UTF-8 text file; its first `--positions` tokens are used.
    #[arg(long)]
    text: PathBuf,
    #[arg(long, default_value_t = 192)]
    positions: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Where the model under test runs.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Where the reference runs.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    reference_device: Device,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let tokenizer = Tokenizer::from_dir(&args.model).with_context(|| format!("loading the tokenizer of {}", args.model.display()))?;
    let text = std::fs::read_to_string(&args.text).with_context(|| format!("reading {}", args.text.display()))?;
    let tokens = tokenizer.encode(&text)?;
    if tokens.len() < args.positions {
        bail!("{} has {} tokens; --positions {} needs at least that many", args.text.display(), tokens.len(), args.positions);
    }

    let mut model = open_backend(&args.model, args.device, Some(args.positions), &mut |_, _| {})?;
    let mut reference = open_backend(&args.reference, args.reference_device, Some(args.positions), &mut |_, _| {})?;
    // Honest refusal instead of remapping ids: a model whose vocabulary is
    // smaller than its tokenizer cannot be measured on real text.
    for (dir, backend) in [(&args.model, &model), (&args.reference, &reference)] {
        let vocab = backend.config().vocab_size;
        if tokenizer.vocab_size() > vocab {
            bail!(
                "{}: the model's vocabulary has {vocab} ids but the tokenizer defines {}; agreement on real text needs a checkpoint with the full vocabulary",
                dir.display(),
                tokenizer.vocab_size()
            );
        }
    }

    let report = lily_engine::agree::agree(model.as_mut(), reference.as_mut(), &tokens, args.positions)?;
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(obj) = v.as_object_mut() {
            obj.insert("model".into(), args.model.display().to_string().into());
            obj.insert("reference".into(), args.reference.display().to_string().into());
            obj.insert("text".into(), args.text.display().to_string().into());
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("model:     {}", args.model.display());
        println!("reference: {}", args.reference.display());
        print!("{}", report.to_text());
    }
    Ok(())
}
