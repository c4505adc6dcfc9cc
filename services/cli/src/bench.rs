//! `llmq bench`: speed scenarios with the field names of lab/peer/peer_mlx_lm.py, so
//! figures print side by side with the peer's. Weights may be random: only speed is measured.

use std::time::Instant;

use anyhow::{bail, Result};
use llmq_engine::generate::{generate, GenerateRequest};
use llmq_engine::{load_model, on_gpu, shapes, Model};
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};

use crate::bench_nats::{median, round};

/// H200 HBM bandwidth: the single-stream decode roofline is the bytes a token reads / this.
const HBM_BYTES_PER_S: f64 = 4.8e12;

#[derive(clap::Args)]
pub struct Args {
    /// single (in process), or burst, batch, static, prefix, gateway (through NATS and the
    /// worker's actors; gateway also through the HTTP gateway)
    scenario: String,
    #[arg(long)]
    local: bool,
    /// A known model name or a path.
    #[arg(long, conflicts_with = "random_weights")]
    model: Option<String>,
    /// A model shape with random weights: tiny, smollm2, 1b, 8b.
    #[arg(long)]
    random_weights: Option<String>,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    output_tokens: usize,
    #[command(flatten)]
    weights: crate::generate::WeightArgs,
    #[arg(long)]
    json: bool,
    /// burst: streams decoding when the burst arrives.
    #[arg(long, default_value_t = 16)]
    active: usize,
    /// burst: prompts arriving at once.
    #[arg(long, default_value_t = 4)]
    burst: usize,
    /// burst: tokens of each burst prompt.
    #[arg(long, default_value_t = 8192)]
    burst_tokens: usize,
    /// burst: short prompts (64 tokens) arriving half a second after the burst.
    #[arg(long, default_value_t = 0)]
    short: usize,
    /// Prefill tokens' worth of work per decode tick (`scheduler.prefill_chunk_tokens`; default:
    /// the worker's, 256 on a GPU and 32 on a CPU).
    #[arg(long)]
    chunk: Option<usize>,
    /// Ticks a chunk's layers are spread over (`scheduler.prefill_chunk_stages`; default: the
    /// worker's, 4 on a GPU and 8 on a CPU).
    #[arg(long)]
    stages: Option<usize>,
    /// Tick budget (`scheduler.tick_budget`; 0: off; default: the worker's, 1.3 on a GPU with
    /// stages, 2.0 on a CPU).
    #[arg(long)]
    tick_budget: Option<f64>,
    /// The synchronous baseline: prefill whole prompts at once, even while streams decode.
    #[arg(long)]
    no_interleave: bool,
    /// prefix: tokens of the shared prefix.
    #[arg(long, default_value_t = 4096)]
    prefix_tokens: usize,
    /// batch, static: number of requests; prefix: requests that reuse the prefix.
    #[arg(long, default_value_t = 64)]
    streams: usize,
    /// Use a running stack instead of starting one.
    #[arg(long)]
    nats: Option<String>,
    /// Workers in the stack the benchmark starts (burst, batch, static, prefix, gateway).
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
    /// batch: run it again with every stream under a constraint of this kind (json) and
    /// report both (the model needs a tokenizer: a named model, or a shape with a vocabulary).
    #[arg(long)]
    constrained: Option<String>,
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

fn single(model: &Model, a: &Args) -> Result<serde_json::Value> {
    let req = GenerateRequest {
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
        &GenerateRequest {
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

fn through_nats(a: &Args) -> Result<serde_json::Value> {
    let model = match (&a.model, &a.random_weights) {
        (_, Some(shape)) => format!("random:{shape}"),
        (Some(m), None) => m.clone(),
        (None, None) => bail!("give --model NAME or --random-weights SHAPE"),
    };
    let mut worker_env = vec![];
    let w = &a.weights;
    w.options()?; // refused here, before any process starts
    if let Some(d) = &w.dtype {
        worker_env.push(("LLMQ__WORKER__DTYPE".to_string(), d.clone()));
    }
    if let Some(bits) = w.quantize {
        worker_env.push(("LLMQ__WORKER__QUANTIZE".to_string(), bits.to_string()));
        worker_env.push((
            "LLMQ__WORKER__QUANTIZE_GROUP_SIZE".to_string(),
            w.group_size.to_string(),
        ));
    }
    if let Some(k) = w.keep_quantized {
        worker_env.push(("LLMQ__WORKER__KEEP_QUANTIZED".to_string(), k.to_string()));
    }
    if let Some(b) = a.kv_budget_bytes {
        worker_env.push((
            "LLMQ__SCHEDULER__KV_BUDGET_BYTES".to_string(),
            b.to_string(),
        ));
    }
    if let Some(n) = a.stages {
        worker_env.push((
            "LLMQ__SCHEDULER__PREFILL_CHUNK_STAGES".to_string(),
            n.to_string(),
        ));
    }
    if let Some(b) = a.tick_budget {
        worker_env.push(("LLMQ__SCHEDULER__TICK_BUDGET".to_string(), b.to_string()));
    }
    let most = a.streams.max(a.active + a.burst + a.short);
    worker_env.push(("LLMQ__SCHEDULER__MAX_BATCH".to_string(), most.to_string()));
    worker_env.push((
        "LLMQ__WORKER__MAX_QUEUED".to_string(),
        (2 * most).to_string(),
    ));
    let knobs = crate::bench_nats::Knobs {
        model: model.clone(),
        active: a.active,
        burst: a.burst,
        burst_tokens: a.burst_tokens,
        short: a.short,
        chunk: a.chunk,
        interleave: !a.no_interleave,
        streams: a.streams,
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.output_tokens,
        prefix_tokens: a.prefix_tokens,
        workers: a.workers.max(1),
        prefill_workers: a.prefill_workers,
        gpus: a.gpus.clone(),
        gateway: (a.scenario == "gateway").then(|| "127.0.0.1:0".to_string()),
        nats: a.nats.clone(),
        worker_env,
        constrained: a.constrained.clone(),
    };
    let mut v = crate::bench_nats::run(&a.scenario, &knobs)?;
    let obj = v.as_object_mut().expect("object");
    let key = if a.random_weights.is_some() {
        "shape"
    } else {
        "model"
    };
    obj.insert(
        key.into(),
        a.random_weights.clone().or(a.model.clone()).into(),
    );
    obj.insert("engine".into(), "llmq".into());
    obj.insert(
        "prefill_stages".into(),
        a.stages
            .map_or_else(|| "worker default".into(), serde_json::Value::from),
    );
    obj.insert(
        "tick_budget".into(),
        a.tick_budget
            .map_or_else(|| "worker default".into(), serde_json::Value::from),
    );
    Ok(v)
}

pub fn run(a: Args) -> Result<()> {
    if a.scenario != "single" {
        let v = through_nats(&a)?;
        if a.json {
            println!("{v}");
        } else {
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        return Ok(());
    }
    if !a.local {
        bail!(
            "the {} scenario runs the engine in process: add --local",
            a.scenario
        );
    }
    let opts = a.weights.options()?;
    let dtype = opts.dtype;
    let t0 = Instant::now();
    let (model, label, random) = match (&a.model, &a.random_weights) {
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
    let mut res = match a.scenario.as_str() {
        "single" => single(&model, &a)?,
        other => bail!("unknown scenario {other:?}: single, burst, batch, static, prefix, gateway"),
    };
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
    if a.json {
        println!("{res}");
    } else {
        println!("{}", serde_json::to_string_pretty(&res)?);
    }
    Ok(())
}
