//! `llmq bench`: speed scenarios with the field names of lab/peer/peer_mlx_lm.py, so figures
//! print side by side with the peer's. Weights may be random: only speed is measured. `single`
//! runs in process; the others run through the real stack (nats-server, intake, workers and
//! their scheduler actors), measured by a NATS client from the token events.
//!
//! - burst: `active` streams decode; then `burst` prompts of `burst_tokens` arrive at once. The
//!   active streams' steady gap (median before), worst gap (during) and the time until the last
//!   burst prompt's first token; with `short`, that many 64-token prompts arrive half a second
//!   after the burst, and the time until the last one's first token (from its arrival).
//! - batch: `streams` requests of `prompt_tokens` submitted together, `output_tokens` each: the
//!   output tokens/s while all streams decode. With `--constrained json`, the batch runs twice
//!   in one stack, free then with every stream under a JSON-schema constraint: both rates side
//!   by side, and the worker's mask time per step and what of it the step's logits outlasted.
//! - static: the same arrivals (half at once, half spread over the first ones' decode) with
//!   continuous batching and with static batching: mean time to first token of each.
//! - gateway: `streams` requests of `prompt_tokens`, `output_tokens` each, half through NATS and
//!   half through the HTTP gateway (streamed completions), submitted alternately in one run:
//!   time to first token and inter-token gap of each half, and what the gateway adds.
//! - capacity: `streams` chat requests allowing `max_tokens` each, far more than their answers
//!   take, against the KV budget: the most streams decoding at once, output tokens/s,
//!   preemptions, and what reserving prompt + max_tokens per request would have admitted.
//! - prefix: one request with a `prefix_tokens` prefix, then `streams` requests, one at a time,
//!   that resend it with short different suffixes (`suffix_tokens`; none: the same prompt
//!   resent whole): median time to first token with the prefix
//!   cache (hits) and on a stack with the cache off (misses: the same prompts recomputed).
//!
//! Files: [`single`]; [`stack`] (the stack and its client) and the scenarios on it, [`burst`],
//! [`batch`] (and static), [`capacity`], [`constrained`], [`gateway`], [`prefix`]; [`measure`].

mod args;
mod batch;
mod burst;
mod capacity;
mod constrained;
mod gateway;
mod measure;
mod prefix;
mod single;
mod stack;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use args::{
    BatchArgs, BurstArgs, CapacityArgs, ModelArgs, PrefixArgs, RequestsArgs, SingleArgs, StackArgs,
};
use measure::{print, round};
use stack::{twice, with_stack, Knobs};

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
    /// Chat requests allowing far more tokens than they take, against the KV budget: the most
    /// decoding at once, output tokens/s and preemptions.
    Capacity(CapacityArgs),
    /// The same arrivals with continuous and with static batching: mean time to first token.
    Static(RequestsArgs),
    /// A long prefix, then requests resending it: time to first token, hits against misses.
    Prefix(PrefixArgs),
    /// Half the requests through NATS, half through the HTTP gateway: what the gateway adds.
    Gateway(RequestsArgs),
}

/// A scenario through NATS: the stack started (or the one at `--nats`) with the workers' settings
/// the flags give.
fn through_nats(
    scenario: &str,
    m: &ModelArgs,
    st: &StackArgs,
    shape: Knobs,
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
    if scenario == "capacity" {
        if m.random_weights.is_some() {
            bail!("capacity needs a model whose answers end (--model), not random weights");
        }
        set(
            "LLMQ__WORKER__HEARTBEAT_MS",
            capacity::HEARTBEAT_MS.to_string(),
        );
    }
    let most = shape.streams.max(shape.active + shape.burst + shape.short);
    set("LLMQ__SCHEDULER__MAX_BATCH", most.to_string());
    set("LLMQ__WORKER__MAX_QUEUED", (2 * most).to_string());
    let knobs = Knobs {
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
    let mut v = run_on_stack(scenario, &knobs)?;
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

pub fn run(a: Args) -> Result<()> {
    use Knobs;
    let (name, m, st, shape) = match a.scenario {
        Scenario::Single(s) => return single::run(s),
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
        Scenario::Capacity(c) => (
            "capacity",
            c.model,
            c.stack,
            Knobs {
                streams: c.streams,
                output_tokens: c.max_tokens,
                ..Knobs::default()
            },
        ),
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
                suffix_tokens: p.suffix_tokens,
                streams: p.streams,
                ..Knobs::default()
            },
        ),
    };
    let v = through_nats(name, &m, &st, shape)?;
    print(&v, m.json)
}

/// Runs a scenario against `url`, or against a stack started for it.
fn run_on_stack(scenario: &str, k: &Knobs) -> Result<Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut env = k.worker_env.clone();
    if let Some(chunk) = k.chunk {
        env.push((
            "LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS".into(),
            chunk.to_string(),
        ));
    }
    env.push((
        "LLMQ__SCHEDULER__INTERLEAVE".into(),
        k.interleave.to_string(),
    ));
    match scenario {
        "burst" => rt.block_on(with_stack(k, &env, |c| Box::pin(burst::burst(c, k)))),
        "batch" => match &k.constrained {
            None => rt.block_on(with_stack(k, &env, |(mut c, mut rx)| {
                Box::pin(async move { batch::batch(&mut c, &mut rx, k, 7).await })
            })),
            Some(kind) => rt.block_on(with_stack(k, &env, |c| {
                Box::pin(constrained::constrained_batch(c, k, kind))
            })),
        },
        "static" => {
            let (_, _, c, s) = twice(
                &rt,
                k,
                &env,
                "LLMQ__SCHEDULER__CONTINUOUS",
                "mean_ttft_ms",
                |c| Box::pin(batch::arrivals(c, k)),
            )?;
            Ok(json!({
                "scenario": "static", "requests": k.streams, "prompt_tokens": k.prompt_tokens,
                "output_tokens": k.output_tokens,
                "continuous_mean_ttft_ms": round(c, 2), "static_mean_ttft_ms": round(s, 2),
                "static_over_continuous": round(s / c, 2),
            }))
        }
        "capacity" => rt.block_on(with_stack(k, &env, |(mut c, mut rx)| {
            Box::pin(async move { capacity::capacity(&mut c, &mut rx, k).await })
        })),
        "gateway" => rt.block_on(with_stack(k, &env, |c| Box::pin(gateway::gateway(c, k)))),
        "prefix" => {
            let (hit, miss, h, m) = twice(
                &rt,
                k,
                &env,
                "LLMQ__PREFIX_CACHE__ENABLED",
                "median_ttft_ms",
                |c| Box::pin(prefix::prefix(c, k)),
            )?;
            Ok(json!({
                "scenario": "prefix", "prefix_tokens": k.prefix_tokens, "suffix_tokens": k.suffix_tokens,
                "requests": k.streams, "hit_ttft_ms": round(h, 2), "miss_ttft_ms": round(m, 2),
                "hit_over_miss": round(h / m, 3), "hit_cached_tokens": hit["median_cached"],
                "miss_cached_tokens": miss["median_cached"],
            }))
        }
        other => bail!("unknown scenario {other:?}"),
    }
}
