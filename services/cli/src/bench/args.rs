//! Each scenario's flags: the model, the stack and its workers' settings, the requests.

use anyhow::{bail, Result};

use super::stack::Knobs;

/// The model a scenario runs, and how its results print.
#[derive(clap::Args)]
pub(super) struct ModelArgs {
    /// A known model name or a path.
    #[arg(long, conflicts_with = "random_weights")]
    pub(super) model: Option<String>,
    /// A model shape with random weights: tiny, smollm2, 1b, 8b, tiny-moe, moe, tiny-lfm2, lfm2,
    /// tiny-qwen35, qwen35.
    #[arg(long)]
    pub(super) random_weights: Option<String>,
    #[command(flatten)]
    pub(super) weights: crate::generate::WeightArgs,
    /// One JSON line (otherwise pretty-printed).
    #[arg(long)]
    pub(super) json: bool,
}

impl ModelArgs {
    /// The worker's `worker.model`: a name, a path or `random:<shape>`.
    pub(super) fn worker_model(&self) -> Result<String> {
        match (&self.model, &self.random_weights) {
            (_, Some(shape)) => Ok(format!("random:{shape}")),
            (Some(m), None) => Ok(m.clone()),
            (None, None) => bail!("give --model NAME or --random-weights SHAPE"),
        }
    }
}

/// The stack a NATS scenario runs on, and its workers' scheduling settings.
#[derive(clap::Args)]
pub(super) struct StackArgs {
    /// Use a running stack instead of starting one.
    #[arg(long)]
    pub(super) nats: Option<String>,
    /// Workers in the stack the benchmark starts.
    #[arg(long, default_value_t = 1)]
    pub(super) workers: usize,
    /// Prefill workers besides (the workers then decode only, their prompts prefilled by these).
    #[arg(long, default_value_t = 0)]
    pub(super) prefill_workers: usize,
    /// GPUs to spread those workers over, one each in turn (e.g. 0,1), prefill workers last.
    #[arg(long, value_delimiter = ',')]
    pub(super) gpus: Vec<u32>,
    /// KV budget of the worker in bytes (default: the worker's).
    #[arg(long)]
    pub(super) kv_budget_bytes: Option<u64>,
    /// Prefill tokens' worth of work per decode tick (`scheduler.prefill_chunk_tokens`;
    /// default: the worker's).
    #[arg(long)]
    pub(super) chunk: Option<usize>,
    /// Ticks a chunk's layers are spread over (`scheduler.prefill_chunk_stages`; default: the
    /// worker's).
    #[arg(long)]
    pub(super) stages: Option<usize>,
    /// Tick budget (`scheduler.tick_budget`; 0: off; default: the worker's).
    #[arg(long)]
    pub(super) tick_budget: Option<f64>,
    /// The synchronous baseline: prefill whole prompts at once, even while streams decode.
    #[arg(long)]
    pub(super) no_interleave: bool,
}

/// How many requests of what size.
#[derive(clap::Args)]
pub(super) struct RequestsArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[command(flatten)]
    pub(super) stack: StackArgs,
    /// Requests.
    #[arg(long, default_value_t = 64)]
    pub(super) streams: usize,
    #[arg(long, default_value_t = 128)]
    pub(super) prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub(super) output_tokens: usize,
}

impl RequestsArgs {
    pub(super) fn split(self, constrained: Option<String>) -> (ModelArgs, StackArgs, Knobs) {
        let knobs = Knobs {
            streams: self.streams,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            constrained,
            ..Default::default()
        };
        (self.model, self.stack, knobs)
    }
}

#[derive(clap::Args)]
pub(super) struct SingleArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[arg(long, default_value_t = 128)]
    pub(super) prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub(super) output_tokens: usize,
}

#[derive(clap::Args)]
pub(super) struct BurstArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[command(flatten)]
    pub(super) stack: StackArgs,
    /// Streams decoding when the burst arrives.
    #[arg(long, default_value_t = 16)]
    pub(super) active: usize,
    /// Prompts arriving at once.
    #[arg(long, default_value_t = 4)]
    pub(super) burst: usize,
    /// Tokens of each burst prompt.
    #[arg(long, default_value_t = 8192)]
    pub(super) burst_tokens: usize,
    /// Short prompts (64 tokens) arriving half a second after the burst.
    #[arg(long, default_value_t = 0)]
    pub(super) short: usize,
}

#[derive(clap::Args)]
pub(super) struct BatchArgs {
    #[command(flatten)]
    pub(super) requests: RequestsArgs,
    /// Run the batch again with every stream under a constraint of this kind (json) and
    /// report both (the model needs a tokenizer: a named model, or a shape with a vocabulary).
    #[arg(long)]
    pub(super) constrained: Option<String>,
}

#[derive(clap::Args)]
pub(super) struct CapacityArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[command(flatten)]
    pub(super) stack: StackArgs,
    /// Chat requests, submitted together.
    #[arg(long, default_value_t = 32)]
    pub(super) streams: usize,
    /// The max_tokens each asks for (its answer stops at end of sequence, far sooner).
    #[arg(long, default_value_t = 4096)]
    pub(super) max_tokens: usize,
}

#[derive(clap::Args)]
pub(super) struct PrefixArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[command(flatten)]
    pub(super) stack: StackArgs,
    /// Tokens of the shared prefix.
    #[arg(long, default_value_t = 4096)]
    pub(super) prefix_tokens: usize,
    /// New tokens after the prefix, different in each request (0: every request is the same
    /// prompt, resent whole, as `n` samples and retries send it).
    #[arg(long, default_value_t = 32)]
    pub(super) suffix_tokens: usize,
    /// Requests that reuse the prefix, one at a time.
    #[arg(long, default_value_t = 64)]
    pub(super) streams: usize,
}
