//! `lily generate`: its flags and its work.

/// Flags of `lily generate`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`lily generate` is still being built in this revision")
}
