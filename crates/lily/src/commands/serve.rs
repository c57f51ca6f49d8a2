//! `lily serve`: its flags and its work.

/// Flags of `lily serve`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`lily serve` is still being built in this revision")
}
