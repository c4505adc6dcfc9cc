//! `llmq bench burst|batch|static`: scenarios through the real stack (nats-server, intake, a
//! worker and its scheduler actor), measured by a NATS client from the token events, with the
//! field names of lab/peer/peer_mlx_lm.py.
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
//! - prefix: one request with a `prefix_tokens` prefix, then `streams` requests, one at a time,
//!   that resend it with short different suffixes: median time to first token with the prefix
//!   cache (hits) and on a stack with the cache off (misses: the same prompts recomputed).

mod burst;
mod constrained;
mod gateway;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use futures::StreamExt;
use llmq_protocol::{
    subjects, Cancel, Constraint, Event, GenerateReply, GenerateRequest, StreamEvent, WorkerStatus,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::bench::random_prompt as prompt;
use crate::serve::{start_stack, wait_for_workers, StackSpec};
use burst::burst;
use constrained::constrained_batch;

/// What a scenario runs: the stack, and the requests (each scenario reads its own fields; the
/// others keep `llmq bench`'s defaults, which also size the worker's batch).
pub struct Knobs {
    pub model: String,
    pub active: usize,
    pub burst: usize,
    pub burst_tokens: usize,
    pub short: usize,
    pub chunk: Option<usize>,
    pub interleave: bool,
    pub streams: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub prefix_tokens: usize,
    /// Also start the HTTP gateway, listening here (port 0: one the system picks).
    pub gateway: Option<String>,
    /// Workers to start, and the GPUs to spread them over.
    pub workers: usize,
    /// Prefill workers besides (the workers then decode only).
    pub prefill_workers: usize,
    pub gpus: Vec<u32>,
    pub nats: Option<String>,
    pub worker_env: Vec<(String, String)>,
    /// batch: also run every stream under this kind of constraint (json), in the same stack.
    pub constrained: Option<String>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            model: String::new(),
            active: 16,
            burst: 4,
            burst_tokens: 8192,
            short: 0,
            chunk: None,
            interleave: true,
            streams: 64,
            prompt_tokens: 128,
            output_tokens: 256,
            prefix_tokens: 4096,
            gateway: None,
            workers: 1,
            prefill_workers: 0,
            gpus: vec![],
            nats: None,
            worker_env: vec![],
            constrained: None,
        }
    }
}

/// A token event as the client saw it.
struct Seen {
    stream: usize,
    at: Instant,
    tokens: usize,
    terminal: bool,
    /// Done's usage.cached.
    cached: Option<u32>,
}

struct Client {
    nc: async_nats::Client,
    /// Held by every request submitted while set.
    constraint: Option<Constraint>,
    tx: mpsc::UnboundedSender<Seen>,
    ids: Vec<String>,
    /// The stack's gateway address, when it runs one.
    gateway: Option<String>,
}

impl Client {
    /// Submits one request; its events feed the shared channel tagged with its index.
    async fn submit(
        &mut self,
        model: &str,
        prompt_ids: Vec<u32>,
        max_tokens: usize,
    ) -> Result<usize> {
        let idx = self.ids.len();
        let inbox = self.nc.new_inbox();
        let mut sub = self.nc.subscribe(inbox.clone()).await?;
        let req = GenerateRequest {
            model: model.into(),
            prompt_ids: Some(prompt_ids),
            max_tokens: Some(max_tokens as i64),
            // A constrained stream ends only where its constraint is complete (see
            // `bench_constraint`: not within max_tokens).
            ignore_eos: self.constraint.is_none(),
            stream_subject: Some(inbox),
            constraint: self.constraint.clone(),
            requires: self
                .constraint
                .iter()
                .map(|_| "constraint".to_string())
                .collect(),
            ..Default::default()
        };
        let reply = self
            .nc
            .request(subjects::GENERATE, llmq_protocol::encode(&req)?.into())
            .await?;
        let id = match llmq_protocol::decode::<GenerateReply>(&reply.payload)? {
            GenerateReply::Accepted { request_id, .. } => request_id,
            GenerateReply::Rejected { error } => bail!("rejected: {error}"),
        };
        self.ids.push(id);
        let tx = self.tx.clone();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                let at = Instant::now();
                let Ok(ev) = llmq_protocol::decode::<StreamEvent>(&m.payload) else {
                    continue;
                };
                let cached = if let Event::Done { usage, .. } = &ev.event {
                    Some(usage.cached)
                } else {
                    None
                };
                let (tokens, terminal) = match &ev.event {
                    Event::Tokens { ids, .. } => (ids.len(), false),
                    e if e.is_terminal() => {
                        if let Event::Error { error } = e {
                            if error.class != llmq_protocol::ErrorClass::Cancelled {
                                eprintln!("llmq bench: stream {idx} failed: {error}");
                            }
                        }
                        (0, true)
                    }
                    _ => continue,
                };
                let _ = tx.send(Seen {
                    stream: idx,
                    at,
                    tokens,
                    terminal,
                    cached,
                });
                if terminal {
                    break;
                }
            }
        });
        Ok(idx)
    }

    async fn cancel_all(&self) -> Result<()> {
        for id in &self.ids {
            self.nc
                .publish(
                    subjects::CANCEL,
                    llmq_protocol::encode(&Cancel {
                        request_id: id.clone(),
                    })?
                    .into(),
                )
                .await?;
        }
        self.nc.flush().await?;
        Ok(())
    }

    /// Requests each worker has ended, from every worker's next heartbeat (sorted).
    async fn ended_per_worker(&self, workers: usize) -> Result<Vec<u64>> {
        let mut sub = self.nc.subscribe(subjects::WORKER_STATUS_ALL).await?;
        let mut seen: HashMap<String, u64> = HashMap::new();
        while seen.len() < workers {
            let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("no status"))?;
            let s: WorkerStatus = llmq_protocol::decode(&m.payload)?;
            seen.insert(s.worker_id, s.ended_requests);
        }
        let mut v: Vec<u64> = seen.into_values().collect();
        v.sort_unstable();
        Ok(v)
    }

    /// The next heartbeat of a worker that takes jobs (not a prefill worker's).
    async fn status(&self) -> Result<WorkerStatus> {
        let mut sub = self.nc.subscribe(subjects::WORKER_STATUS_ALL).await?;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("no status"))?;
            let s: WorkerStatus = llmq_protocol::decode(&m.payload)?;
            if s.role.takes_jobs() {
                return Ok(s);
            }
        }
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}

fn overhead(before: &WorkerStatus, after: &WorkerStatus) -> Value {
    let wall = after.tick_wall_ms - before.tick_wall_ms;
    let engine = after.engine_ms - before.engine_ms;
    let ticks = after.ticks - before.ticks;
    let per = |ms: f64, n: u64| round(ms / n.max(1) as f64, 3);
    let (kv, kv_ms) = (
        after.kv_bytes_received - before.kv_bytes_received,
        after.kv_transfer_ms - before.kv_transfer_ms,
    );
    json!({
        // A decode worker's prompt KV from prefill workers, and its rate over NATS.
        "kv_bytes_received": kv,
        "kv_gb_per_s": if kv_ms > 0.0 { round(kv as f64 / kv_ms / 1e6, 3) } else { 0.0 },
        "ticks": ticks,
        "tick_ms": round(wall / ticks.max(1) as f64, 3),
        "control_overhead_fraction": round(1.0 - engine / wall.max(1e-9), 4),
        "prefill_chunk_ms": per(after.prefill_ms - before.prefill_ms, after.prefill_calls - before.prefill_calls),
        "decode_step_ms": per(after.decode_ms - before.decode_ms, after.decode_calls - before.decode_calls),
    })
}

/// The worker's KV budget (all free before the run) and how many requests of the scenario's
/// size (prompt and output tokens) it admits at once: quantized weights leave a larger default.
fn kv_room(before: &WorkerStatus, k: &Knobs) -> Value {
    let per_request = before.kv_bytes_per_token * (k.prompt_tokens + k.output_tokens) as u64;
    json!({
        "kv_budget_bytes": before.kv_bytes_free,
        "requests_admitted": before.kv_bytes_free.checked_div(per_request).unwrap_or(0),
    })
}

/// Runs a scenario against `url`, or against a stack started for it.
pub fn run(scenario: &str, k: &Knobs) -> Result<Value> {
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
        "burst" => rt.block_on(with_stack(k, &env, |c| Box::pin(burst(c, k)))),
        "batch" => match &k.constrained {
            None => rt.block_on(with_stack(k, &env, |(mut c, mut rx)| {
                Box::pin(async move { batch(&mut c, &mut rx, k, 7).await })
            })),
            Some(kind) => rt.block_on(with_stack(k, &env, |c| {
                Box::pin(constrained_batch(c, k, kind))
            })),
        },
        "static" => {
            let (_, _, c, s) = twice(
                &rt,
                k,
                &env,
                "LLMQ__SCHEDULER__CONTINUOUS",
                "mean_ttft_ms",
                |c| Box::pin(arrivals(c, k)),
            )?;
            Ok(json!({
                "scenario": "static", "requests": k.streams, "prompt_tokens": k.prompt_tokens,
                "output_tokens": k.output_tokens,
                "continuous_mean_ttft_ms": round(c, 2), "static_mean_ttft_ms": round(s, 2),
                "static_over_continuous": round(s / c, 2),
            }))
        }
        "gateway" => rt.block_on(with_stack(k, &env, |c| Box::pin(gateway::gateway(c, k)))),
        "prefix" => {
            let (hit, miss, h, m) = twice(
                &rt,
                k,
                &env,
                "LLMQ__PREFIX_CACHE__ENABLED",
                "median_ttft_ms",
                |c| Box::pin(prefix(c, k)),
            )?;
            Ok(json!({
                "scenario": "prefix", "prefix_tokens": k.prefix_tokens, "suffix_tokens": SUFFIX_TOKENS,
                "requests": k.streams, "hit_ttft_ms": round(h, 2), "miss_ttft_ms": round(m, 2),
                "hit_over_miss": round(h / m, 3), "hit_cached_tokens": hit["median_cached"],
                "miss_cached_tokens": miss["median_cached"],
            }))
        }
        other => bail!("unknown scenario {other:?}"),
    }
}

type Fut<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Value>> + 'a>>;

/// Runs a scenario on a stack as configured, then on one whose workers have `switch` = false;
/// returns both results and their `field`.
fn twice<'a>(
    rt: &tokio::runtime::Runtime,
    k: &'a Knobs,
    env: &[(String, String)],
    switch: &str,
    field: &str,
    f: impl Fn((Client, mpsc::UnboundedReceiver<Seen>)) -> Fut<'a>,
) -> Result<(Value, Value, f64, f64)> {
    let on = rt.block_on(with_stack(k, env, &f))?;
    let mut off_env = env.to_vec();
    off_env.push((switch.into(), "false".into()));
    let off = rt.block_on(with_stack(k, &off_env, &f))?;
    let (a, b) = (
        on[field].as_f64().unwrap_or(f64::NAN),
        off[field].as_f64().unwrap_or(f64::NAN),
    );
    Ok((on, off, a, b))
}

async fn with_stack<'a>(
    k: &'a Knobs,
    env: &[(String, String)],
    f: impl FnOnce((Client, mpsc::UnboundedReceiver<Seen>)) -> Fut<'a>,
) -> Result<Value> {
    let mut stack = None;
    let url = match &k.nats {
        Some(u) => u.clone(),
        None => {
            let spec = StackSpec {
                model: &k.model,
                workers: k.workers,
                prefill_workers: k.prefill_workers,
                worker_env: env,
                gateway: k.gateway.as_deref(),
                gpus: &k.gpus,
                ..Default::default()
            };
            let s = start_stack(spec)?;
            let u = s.url.clone();
            stack = Some(s);
            u
        }
    };
    let nc = llmq_protocol::connect(&url, None, "llmq-bench").await?;
    if let Some(s) = stack.as_mut() {
        wait_for_workers(&nc, k.workers + k.prefill_workers, &mut s.children).await?;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let client = Client {
        nc,
        constraint: None,
        tx,
        ids: vec![],
        gateway: stack.as_ref().and_then(|s| s.gateway.clone()),
    };
    let r = f((client, rx)).await;
    drop(stack);
    r
}

/// `seed`: the first stream's prompt seed (the others follow it), so that a second batch in the
/// same stack can have prompts of its own (none of them found in the prefix cache).
async fn batch(
    c: &mut Client,
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    k: &Knobs,
    seed: u64,
) -> Result<Value> {
    let t0 = Instant::now();
    let status0 = c.status().await?;
    for i in 0..k.streams {
        c.submit(
            &k.model,
            prompt(k.prompt_tokens, seed + i as u64),
            k.output_tokens,
        )
        .await?;
    }
    let (mut produced, mut ended) = (0usize, 0usize);
    let mut started: HashMap<usize, Instant> = HashMap::new();
    let mut events: Vec<(Instant, usize)> = vec![];
    let mut first_end = None;
    while let Some(s) = rx.recv().await {
        if s.tokens > 0 {
            produced += s.tokens;
            started.entry(s.stream).or_insert(s.at);
            events.push((s.at, s.tokens));
        }
        if s.terminal {
            ended += 1;
            first_end.get_or_insert(s.at);
            if ended == k.streams {
                break;
            }
        }
    }
    let total = t0.elapsed().as_secs_f64();
    let status1 = c.status().await?;
    // Steady state: every stream has started and none has ended.
    let all_started = started.values().max().copied();
    let steady = match (all_started, first_end) {
        (Some(a), Some(e)) if e > a => {
            let n: usize = events
                .iter()
                .filter(|(t, _)| *t > a && *t <= e)
                .map(|x| x.1)
                .sum();
            n as f64 / (e - a).as_secs_f64()
        }
        _ => f64::NAN,
    };
    let mut v = json!({
        "scenario": "batch", "streams": k.streams, "prompt_tokens": k.prompt_tokens,
        "output_tokens": k.output_tokens, "wall_s": round(total, 3),
        "overall_output_tokens_per_s": round(produced as f64 / total, 1),
        "steady_output_tokens_per_s": round(steady, 1),
    });
    // Heartbeats are per worker: the overhead split is only meaningful with one.
    if k.workers == 1 {
        v.as_object_mut()
            .unwrap()
            .extend(overhead(&status0, &status1).as_object().unwrap().clone());
        v.as_object_mut()
            .unwrap()
            .extend(kv_room(&status0, k).as_object().unwrap().clone());
    }
    v.as_object_mut()
        .unwrap()
        .insert("workers".into(), k.workers.into());
    v.as_object_mut().unwrap().insert(
        "requests_per_worker".into(),
        json!(c.ended_per_worker(k.workers).await?),
    );
    Ok(v)
}

/// Half the requests at once, the other half one by one while the first half decodes.
async fn arrivals(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
) -> Result<Value> {
    let n = k.streams.max(2);
    let mut submitted: HashMap<usize, Instant> = HashMap::new();
    for i in 0..n / 2 {
        let at = Instant::now();
        submitted.insert(
            c.submit(
                &k.model,
                prompt(k.prompt_tokens, 50 + i as u64),
                k.output_tokens,
            )
            .await?,
            at,
        );
    }
    let mut next = n / 2;
    let mut ttft: HashMap<usize, f64> = HashMap::new();
    let mut ended = 0;
    let mut tokens_seen = 0usize;
    while let Some(s) = rx.recv().await {
        if s.tokens > 0 && !ttft.contains_key(&s.stream) {
            ttft.insert(
                s.stream,
                (s.at - submitted[&s.stream]).as_secs_f64() * 1000.0,
            );
        }
        tokens_seen += s.tokens;
        // A late arrival every output_tokens/4 tokens of the first wave.
        if next < n && tokens_seen >= (next - n / 2 + 1) * (k.output_tokens / 4).max(1) {
            let at = Instant::now();
            submitted.insert(
                c.submit(
                    &k.model,
                    prompt(k.prompt_tokens, 50 + next as u64),
                    k.output_tokens,
                )
                .await?,
                at,
            );
            next += 1;
        }
        if s.terminal {
            ended += 1;
            if ended == n {
                break;
            }
        }
    }
    let mean = ttft.values().sum::<f64>() / ttft.len().max(1) as f64;
    Ok(json!({ "mean_ttft_ms": mean }))
}

const SUFFIX_TOKENS: usize = 32;

/// One request to fill the cache with the prefix, then `streams` requests one after another,
/// each the prefix plus its own suffix: their times to first token and cached tokens.
async fn prefix(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
) -> Result<Value> {
    let shared = prompt(k.prefix_tokens, 4242);
    let (mut ttft, mut cached) = (vec![], vec![]);
    for i in 0..=k.streams {
        let p = [&shared[..], &prompt(SUFFIX_TOKENS, 9000 + i as u64)].concat();
        let at = Instant::now();
        let idx = c.submit(&k.model, p, 1).await?;
        let mut first = None;
        while let Some(s) = rx.recv().await {
            if s.stream != idx {
                continue;
            }
            if s.tokens > 0 {
                first.get_or_insert(s.at);
            }
            if s.terminal {
                match (first, s.cached) {
                    (Some(f), Some(n)) if i > 0 => {
                        ttft.push((f - at).as_secs_f64() * 1000.0);
                        cached.push(n as f64);
                    }
                    (Some(_), Some(_)) => {}
                    _ => bail!("prefix request {i} failed"),
                }
                break;
            }
        }
    }
    Ok(json!({ "median_ttft_ms": median(ttft), "median_cached": median(cached) }))
}
