//! The `lily` command. Each subcommand lives in `commands/<name>.rs`, which
//! owns its flags and its work; this file only dispatches.

mod backend;
mod commands;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "lily", version, about = "Lily: an inference server for Qwen3.6-35B-A3B")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve(commands::serve::Args),
    /// Generate text from a prompt or a chat message.
    Generate(commands::generate::Args),
    /// Write a synthetic checkpoint in the real format.
    Synth(commands::synth::Args),
    /// Convert the original BF16 release into the MLX 4-bit layout.
    Quantize(commands::quantize::Args),
    /// Run the benchmark contract (docs/design.md §7.1).
    Bench(commands::bench::Args),
    /// Top-1 agreement of a 4-bit model with its unquantised reference.
    Agree(commands::agree::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(a) => commands::serve::run(a),
        Command::Generate(a) => commands::generate::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Quantize(a) => commands::quantize::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Agree(a) => commands::agree::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
