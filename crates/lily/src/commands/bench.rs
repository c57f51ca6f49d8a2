//! `lily bench`: its flags and its work.

/// Flags of `lily bench`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`lily bench` is still being built in this revision")
}
