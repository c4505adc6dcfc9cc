//! `llmq`: the command line. Thin: parses arguments, sets up logging, hands off to a module.

mod bench;
mod generate;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "llmq", version, about = "LLM inference over NATS, on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(generate::Args),
    /// Measure speed; prints JSON lines with the peer benchmark's field names.
    Bench(bench::Args),
}

fn main() -> std::process::ExitCode {
    llmq_telemetry::init("warn");
    let result = match Cli::parse().command {
        Command::Generate(a) => generate::run(a),
        Command::Bench(a) => bench::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llmq: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
