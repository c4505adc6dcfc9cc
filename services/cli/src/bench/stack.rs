//! The stack a NATS scenario runs on (nats-server, intake, workers, the gateway, started for
//! it or already running) and the client that submits its requests and follows their events.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use futures::StreamExt;
use llmq_protocol::{
    subjects, Cancel, Constraint, Event, GenerateReply, GenerateRequest, StreamEvent, WorkerStatus,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::measure::round;
use crate::serve::{start_stack, wait_for_workers, StackSpec};

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
    pub suffix_tokens: usize,
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
            suffix_tokens: 32,
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
pub(super) struct Seen {
    pub(super) stream: usize,
    pub(super) at: Instant,
    pub(super) tokens: usize,
    pub(super) terminal: bool,
    /// Done's usage.cached.
    pub(super) cached: Option<u32>,
    /// Done's usage.prompt.
    pub(super) prompt: Option<u32>,
}

pub(super) struct Client {
    pub(super) nc: async_nats::Client,
    /// Held by every request submitted while set.
    pub(super) constraint: Option<Constraint>,
    pub(super) tx: mpsc::UnboundedSender<Seen>,
    pub(super) ids: Vec<String>,
    /// The stack's gateway address, when it runs one.
    pub(super) gateway: Option<String>,
}

impl Client {
    /// Submits one request of `prompt_ids` that generates `max_tokens` (past end of sequence,
    /// unless constrained); its events feed the shared channel tagged with its index.
    pub(super) async fn submit(
        &mut self,
        model: &str,
        prompt_ids: Vec<u32>,
        max_tokens: usize,
    ) -> Result<usize> {
        let req = GenerateRequest {
            model: model.into(),
            prompt_ids: Some(prompt_ids),
            max_tokens: Some(max_tokens as i64),
            // A constrained stream ends only where its constraint is complete (see
            // `bench_constraint`: not within max_tokens).
            ignore_eos: self.constraint.is_none(),
            constraint: self.constraint.clone(),
            requires: self
                .constraint
                .iter()
                .map(|_| "constraint".to_string())
                .collect(),
            ..Default::default()
        };
        self.submit_request(req).await
    }

    /// Submits `req` (its stream subject set here); its events feed the shared channel tagged
    /// with its index.
    pub(super) async fn submit_request(&mut self, mut req: GenerateRequest) -> Result<usize> {
        let idx = self.ids.len();
        let inbox = self.nc.new_inbox();
        let mut sub = self.nc.subscribe(inbox.clone()).await?;
        req.stream_subject = Some(inbox);
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
                let (cached, prompt) = match &ev.event {
                    Event::Done { usage, .. } => (Some(usage.cached), Some(usage.prompt)),
                    _ => (None, None),
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
                    prompt,
                });
                if terminal {
                    break;
                }
            }
        });
        Ok(idx)
    }

    pub(super) async fn cancel_all(&self) -> Result<()> {
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
    pub(super) async fn ended_per_worker(&self, workers: usize) -> Result<Vec<u64>> {
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
    pub(super) async fn status(&self) -> Result<WorkerStatus> {
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

pub(super) fn overhead(before: &WorkerStatus, after: &WorkerStatus) -> Value {
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
pub(super) fn kv_room(before: &WorkerStatus, k: &Knobs) -> Value {
    let per_request = before.kv_bytes_per_token * (k.prompt_tokens + k.output_tokens) as u64;
    json!({
        "kv_budget_bytes": before.kv_bytes_free,
        "requests_admitted": before.kv_bytes_free.checked_div(per_request).unwrap_or(0),
    })
}

pub(super) type Fut<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Value>> + 'a>>;

/// Runs a scenario on a stack as configured, then on one whose workers have `switch` = false;
/// returns both results and their `field`.
pub(super) fn twice<'a>(
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

pub(super) async fn with_stack<'a>(
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
