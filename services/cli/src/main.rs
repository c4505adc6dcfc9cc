//! `llmq`: the command line. Thin: parses arguments, sets up logging, hands off to a module.

mod bench;
mod client;
mod generate;
mod nats_server;
mod serve;

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
    /// Run an engine worker (one model on one device).
    Worker(serve::WorkerArgs),
    /// Run an intake service.
    Intake(serve::ServiceArgs),
    /// Run the OpenAI-compatible HTTP gateway (`gateway.listen`).
    Gateway(serve::ServiceArgs),
    /// Start a local stack: nats-server, intake, workers (and the gateway); Ctrl-C stops it.
    Up(serve::UpArgs),
}

fn main() -> std::process::ExitCode {
    // OpenBLAS chose its kernels when it loaded, before `main`: where it fell back to generic
    // ones on a CPU it does not know, run again with better ones named (`llmq_engine::kernels::cpu::blas`).
    if let Some(kernels) = llmq_engine::kernels::cpu::blas::kernels_to_ask() {
        use std::os::unix::process::CommandExt;
        std::env::set_var("OPENBLAS_CORETYPE", kernels);
        let mut args = std::env::args_os();
        let err = std::process::Command::new("/proc/self/exe")
            .arg0(args.next().unwrap_or_default())
            .args(args)
            .exec();
        eprintln!("llmq: could not run again with OpenBLAS's {kernels} kernels ({err}); going on with its generic ones");
    }
    // MLX's CUDA backend caches a CUDA graph per distinct step shape, and raises an error when
    // more than 400 shapes alternate. Serving steps vary in batch size and cache length, so
    // give it room (before MLX initialises; a user's own setting wins).
    if std::env::var_os("MLX_CUDA_GRAPH_CACHE_SIZE").is_none() {
        std::env::set_var("MLX_CUDA_GRAPH_CACHE_SIZE", "8192");
    }
    // MLX's CUDA graphs off: each new graph structure takes tens of ms to instantiate, and a
    // serving engine meets new structures all the time (a long prompt joining, another length
    // group decoding beside a chunk), so with them on the streams stall in a burst. Off costs
    // some steady decode throughput (BENCHMARKS.md); `MLX_USE_CUDA_GRAPHS=1` trades back.
    if std::env::var_os("MLX_USE_CUDA_GRAPHS").is_none() {
        std::env::set_var("MLX_USE_CUDA_GRAPHS", "0");
    }
    // MLX's CUDA caches (graphs, cuDNN attention plans, convolutions) count their misses over
    // the process's whole life and throw once the count passes twice their size, failing every
    // later step: a worker that serves for days meets that many shapes in the end. Without the
    // check a miss only costs the time to plan again (a user's own setting wins).
    if std::env::var_os("MLX_ENABLE_CACHE_THRASHING_CHECK").is_none() {
        std::env::set_var("MLX_ENABLE_CACHE_THRASHING_CHECK", "0");
    }
    let command = Cli::parse().command;
    // A CPU worker's buffers come from the memory it faulted in at start, which only works
    // when every thread allocates from the same heap (`host_memory`).
    if matches!(command, Command::Worker(_) | Command::Generate(_)) && !llmq_engine::on_gpu() {
        llmq_worker::host_memory::one_heap();
    }
    let service = match command {
        Command::Worker(_) => "llmq-worker",
        Command::Intake(_) => "llmq-intake",
        Command::Gateway(_) => "llmq-gateway",
        _ => "llmq",
    };
    let _traces = llmq_telemetry::init(
        "warn,llmq_worker=info,llmq_intake=info,llmq_gateway=info",
        service,
    );
    let result = match command {
        Command::Generate(a) => generate::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Worker(a) => serve::worker(a),
        Command::Intake(a) => serve::intake(a),
        Command::Gateway(a) => serve::gateway(a),
        Command::Up(a) => serve::up(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llmq: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
