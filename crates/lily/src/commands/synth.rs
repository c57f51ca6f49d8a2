//! `lily synth`: its flags and its work.

/// Flags of `lily synth`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`lily synth` is still being built in this revision")
}
