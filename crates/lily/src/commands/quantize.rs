//! `lily quantize`: its flags and its work.

/// Flags of `lily quantize`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`lily quantize` is still being built in this revision")
}
