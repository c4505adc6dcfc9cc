//! `llmq bench`: speed scenarios with the field names of lab/peer/peer_mlx_lm.py, so
//! figures print side by side with the peer's. Weights may be random: only speed is measured.

use std::time::Instant;

use anyhow::{bail, Result};
use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::{load_model, on_gpu, shapes, Model};
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};

use crate::bench_nats::{median, round};

/// H200 HBM bandwidth: the single-stream decode roofline is the bytes a token reads / this.
const HBM_BYTES_PER_S: f64 = 4.8e12;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(clap::Subcommand)]
enum Scenario {
    /// One stream, greedy, in process (no NATS): ms per token at steady state.
    Single(SingleArgs),
    /// `--active` streams decode; then `--burst` prompts of `--burst-tokens` arrive at once:
    /// the streams' steady and worst gaps, and the burst prompts' first tokens.
    Burst(BurstArgs),
    /// `--streams` requests submitted together: output tokens/s while all of them decode.
    Batch(BatchArgs),
    /// The same arrivals with continuous and with static batching: mean time to first token.
    Static(RequestsArgs),
    /// A long prefix, then requests resending it: time to first token, hits against misses.
    Prefix(PrefixArgs),
    /// Half the requests through NATS, half through the HTTP gateway: what the gateway adds.
    Gateway(RequestsArgs),
}

/// The model a scenario runs, and how its results print.
#[derive(clap::Args)]
struct ModelArgs {
    /// A known model name or a path.
    #[arg(long, conflicts_with = "random_weights")]
    model: Option<String>,
    /// A model shape with random weights: tiny, smollm2, 1b, 8b, moe.
    #[arg(long)]
    random_weights: Option<String>,
    #[command(flatten)]
    weights: crate::generate::WeightArgs,
    /// One JSON line (otherwise pretty-printed).
    #[arg(long)]
    json: bool,
}

impl ModelArgs {
    /// The worker's `worker.model`: a name, a path or `random:<shape>`.
    fn worker_model(&self) -> Result<String> {
        match (&self.model, &self.random_weights) {
            (_, Some(shape)) => Ok(format!("random:{shape}")),
            (Some(m), None) => Ok(m.clone()),
            (None, None) => bail!("give --model NAME or --random-weights SHAPE"),
        }
    }
}

/// The stack a NATS scenario runs on, and its workers' scheduling settings.
#[derive(clap::Args)]
struct StackArgs {
    /// Use a running stack instead of starting one.
    #[arg(long)]
    nats: Option<String>,
    /// Workers in the stack the benchmark starts.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Prefill workers besides (the workers then decode only, their prompts prefilled by these).
    #[arg(long, default_value_t = 0)]
    prefill_workers: usize,
    /// GPUs to spread those workers over, one each in turn (e.g. 0,1), prefill workers last.
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<u32>,
    /// KV budget of the worker in bytes (default: the worker's).
    #[arg(long)]
    kv_budget_bytes: Option<u64>,
    /// Prefill tokens' worth of work per decode tick (`scheduler.prefill_chunk_tokens`;
    /// default: the worker's).
    #[arg(long)]
    chunk: Option<usize>,
    /// Ticks a chunk's layers are spread over (`scheduler.prefill_chunk_stages`; default: the
    /// worker's).
    #[arg(long)]
    stages: Option<usize>,
    /// Tick budget (`scheduler.tick_budget`; 0: off; default: the worker's).
    #[arg(long)]
    tick_budget: Option<f64>,
    /// The synchronous baseline: prefill whole prompts at once, even while streams decode.
    #[arg(long)]
    no_interleave: bool,
}

/// How many requests of what size.
#[derive(clap::Args)]
struct RequestsArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    stack: StackArgs,
    /// Requests.
    #[arg(long, default_value_t = 64)]
    streams: usize,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    output_tokens: usize,
}

impl RequestsArgs {
    fn split(
        self,
        constrained: Option<String>,
    ) -> (ModelArgs, StackArgs, crate::bench_nats::Knobs) {
        let knobs = crate::bench_nats::Knobs {
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
struct SingleArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    output_tokens: usize,
}

#[derive(clap::Args)]
struct BurstArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    stack: StackArgs,
    /// Streams decoding when the burst arrives.
    #[arg(long, default_value_t = 16)]
    active: usize,
    /// Prompts arriving at once.
    #[arg(long, default_value_t = 4)]
    burst: usize,
    /// Tokens of each burst prompt.
    #[arg(long, default_value_t = 8192)]
    burst_tokens: usize,
    /// Short prompts (64 tokens) arriving half a second after the burst.
    #[arg(long, default_value_t = 0)]
    short: usize,
}

#[derive(clap::Args)]
struct BatchArgs {
    #[command(flatten)]
    requests: RequestsArgs,
    /// Run the batch again with every stream under a constraint of this kind (json) and
    /// report both (the model needs a tokenizer: a named model, or a shape with a vocabulary).
    #[arg(long)]
    constrained: Option<String>,
}

#[derive(clap::Args)]
struct PrefixArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    stack: StackArgs,
    /// Tokens of the shared prefix.
    #[arg(long, default_value_t = 4096)]
    prefix_tokens: usize,
    /// Requests that reuse the prefix, one at a time.
    #[arg(long, default_value_t = 64)]
    streams: usize,
}

/// The peer's prompt: token ids drawn from [10, 4000), fixed seed.
pub(crate) fn random_prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            10 + ((x >> 33) % 3990) as u32
        })
        .collect()
}

fn single(model: &Model, a: &SingleArgs) -> Result<serde_json::Value> {
    let req = LocalRequest {
        prompt_ids: random_prompt(a.prompt_tokens, 1),
        sampling: Sampling::default(),
        stop: StopConditions {
            max_tokens: a.output_tokens as u32,
            ignore_eos: true,
            ..Default::default()
        },
        prefill_chunk: 4096,
    };
    // Warm-up: the first run compiles kernels and allocates.
    generate(
        model,
        None,
        &LocalRequest {
            stop: StopConditions {
                max_tokens: 16,
                ..req.stop.clone()
            },
            ..req.clone()
        },
        |_, _| {},
    )?;
    let mut times = Vec::with_capacity(a.output_tokens);
    generate(model, None, &req, |_, _| times.push(Instant::now()))?;
    let gaps: Vec<f64> = times
        .windows(2)
        .skip(10)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1000.0)
        .collect();
    if gaps.is_empty() {
        bail!("--output-tokens must be above 12 to measure steady gaps");
    }
    let ms = median(gaps);
    Ok(serde_json::json!({
        "scenario": "single",
        "ms_per_token": round(ms, 3),
        "tokens_per_s": (10000.0 / ms).round() / 10.0,
    }))
}

/// A scenario through NATS: the stack started (or the one at `--nats`) with the workers' settings
/// the flags give.
fn through_nats(
    scenario: &str,
    m: &ModelArgs,
    st: &StackArgs,
    shape: crate::bench_nats::Knobs,
) -> Result<serde_json::Value> {
    let model = m.worker_model()?;
    let mut worker_env = vec![];
    let w = &m.weights;
    w.options()?; // refused here, before any process starts
    let mut set = |key: &str, value: String| worker_env.push((key.to_string(), value));
    if let Some(d) = &w.dtype {
        set("LLMQ__WORKER__DTYPE", d.clone());
    }
    if let Some(bits) = w.quantize {
        set("LLMQ__WORKER__QUANTIZE", bits.to_string());
        set(
            "LLMQ__WORKER__QUANTIZE_GROUP_SIZE",
            w.group_size.to_string(),
        );
    }
    if let Some(k) = w.keep_quantized {
        set("LLMQ__WORKER__KEEP_QUANTIZED", k.to_string());
    }
    if let Some(b) = st.kv_budget_bytes {
        set("LLMQ__SCHEDULER__KV_BUDGET_BYTES", b.to_string());
    }
    if let Some(n) = st.stages {
        set("LLMQ__SCHEDULER__PREFILL_CHUNK_STAGES", n.to_string());
    }
    if let Some(b) = st.tick_budget {
        set("LLMQ__SCHEDULER__TICK_BUDGET", b.to_string());
    }
    if let Some(chunk) = st.chunk {
        set("LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS", chunk.to_string());
    }
    set(
        "LLMQ__SCHEDULER__INTERLEAVE",
        (!st.no_interleave).to_string(),
    );
    let most = shape.streams.max(shape.active + shape.burst + shape.short);
    set("LLMQ__SCHEDULER__MAX_BATCH", most.to_string());
    set("LLMQ__WORKER__MAX_QUEUED", (2 * most).to_string());
    let knobs = crate::bench_nats::Knobs {
        model,
        chunk: st.chunk,
        interleave: !st.no_interleave,
        workers: st.workers.max(1),
        prefill_workers: st.prefill_workers,
        gpus: st.gpus.clone(),
        gateway: (scenario == "gateway").then(|| "127.0.0.1:0".to_string()),
        nats: st.nats.clone(),
        worker_env,
        ..shape
    };
    let mut v = crate::bench_nats::run(scenario, &knobs)?;
    let obj = v.as_object_mut().expect("object");
    let key = if m.random_weights.is_some() {
        "shape"
    } else {
        "model"
    };
    obj.insert(
        key.into(),
        m.random_weights.clone().or(m.model.clone()).into(),
    );
    obj.insert("engine".into(), "llmq".into());
    obj.insert(
        "prefill_stages".into(),
        st.stages
            .map_or_else(|| "worker default".into(), serde_json::Value::from),
    );
    obj.insert(
        "tick_budget".into(),
        st.tick_budget
            .map_or_else(|| "worker default".into(), serde_json::Value::from),
    );
    Ok(v)
}

fn print(v: &serde_json::Value, json: bool) -> Result<()> {
    if json {
        println!("{v}");
    } else {
        println!("{}", serde_json::to_string_pretty(v)?);
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    use crate::bench_nats::Knobs;
    let (name, m, st, shape) = match a.scenario {
        Scenario::Single(s) => return run_single(s),
        Scenario::Burst(b) => (
            "burst",
            b.model,
            b.stack,
            Knobs {
                active: b.active,
                burst: b.burst,
                burst_tokens: b.burst_tokens,
                short: b.short,
                ..Knobs::default()
            },
        ),
        Scenario::Batch(b) => {
            let (m, st, knobs) = b.requests.split(b.constrained);
            ("batch", m, st, knobs)
        }
        Scenario::Static(r) => {
            let (m, st, knobs) = r.split(None);
            ("static", m, st, knobs)
        }
        Scenario::Gateway(r) => {
            let (m, st, knobs) = r.split(None);
            ("gateway", m, st, knobs)
        }
        Scenario::Prefix(p) => (
            "prefix",
            p.model,
            p.stack,
            Knobs {
                prefix_tokens: p.prefix_tokens,
                streams: p.streams,
                ..Knobs::default()
            },
        ),
    };
    let v = through_nats(name, &m, &st, shape)?;
    print(&v, m.json)
}

fn run_single(a: SingleArgs) -> Result<()> {
    let m = &a.model;
    let opts = m.weights.options()?;
    let dtype = opts.dtype;
    let t0 = Instant::now();
    let (model, label, random) = match (&m.model, &m.random_weights) {
        (_, Some(shape)) => (shapes::random_model(shape, opts, 0)?, shape.clone(), true),
        (Some(name), None) => (
            load_model(&resolve_model(name)?, opts)?.model,
            name.clone(),
            false,
        ),
        (None, None) => bail!("give --model NAME or --random-weights SHAPE"),
    };
    let load_s = t0.elapsed().as_secs_f64();
    let nbytes = model.weight_bytes();
    let read_per_token = model.bytes_read_per_token();
    let mut res = single(&model, &a)?;
    let obj = res.as_object_mut().expect("object");
    let key = if random { "shape" } else { "model" };
    obj.insert(key.into(), label.into());
    obj.insert("engine".into(), "llmq".into());
    obj.insert("device".into(), if on_gpu() { "gpu" } else { "cpu" }.into());
    obj.insert("dtype".into(), format!("{dtype:?}").into());
    obj.insert("weights".into(), model.weights_summary().into());
    obj.insert("weight_bytes".into(), nbytes.into());
    obj.insert("load_s".into(), round(load_s, 2).into());
    if let (true, Some(ms)) = (random, obj.get("ms_per_token").and_then(|v| v.as_f64())) {
        let roof = read_per_token as f64 / HBM_BYTES_PER_S * 1000.0;
        obj.insert("hbm_roofline_ms".into(), round(roof, 3).into());
        // Six decimals: tiny shapes on a CPU are far below the H200 roofline, and still above 0.
        obj.insert(
            "fraction_of_roofline".into(),
            ((roof / ms * 1e6).round() / 1e6).into(),
        );
    }
    print(&res, m.json)
}
