//! `lily agree`: its flags and its work.

/// Flags of `lily agree`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`lily agree` is still being built in this revision")
}
