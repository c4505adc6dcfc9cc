//! The worker process: loads the model on a dedicated device thread (the scheduler actor's
//! arbiter) and connects it to NATS.
//!
//! - jobs: one durable JetStream pull consumer per model, shared by every worker of that model.
//!   A worker fetches one job at a time, and only while it holds fewer than `placement` allows:
//!   `scheduler.max_batch` (it can start each at once) while a live peer has a free slot by the
//!   heartbeats, else up to `worker.max_queued` (held with `Queued` until a slot frees). So a job
//!   goes to a worker that can start it whenever one exists, a full worker takes nothing, and a
//!   stopped one simply stops asking (back-pressure is the placement). A job is
//!   acknowledged when its terminal event is published; while it runs, progress acks keep it.
//!   A job delivered a second time (its worker died before finishing it) is ended with
//!   `Error { class: worker_lost }` rather than run again under a stream that already has events.
//! - cancels: `llm.v1.cancel`, broadcast; the actor cancels what it holds and remembers the
//!   other ids for an hour, so a job cancelled while it still waited in the jobs stream ends with
//!   `Cancelled` when it arrives instead of running. At start the worker replays the cancels the
//!   server stored (stream `LLMQ_CANCELS_V1`), so this holds for workers started later too.
//! - `llm.v1.cache.clear`: drops the cached prefixes (answers `CacheCleared` if asked).
//! - heartbeats: `WorkerStatus` on `llm.v1.worker.<id>.status` every `worker.heartbeat_ms`: the
//!   actor's latest status snapshot, so they keep coming during a long tick.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use llmq_config::{SchedulerSettings, Settings};
use llmq_engine::{default_dtype, load_named, parse_dtype};
use llmq_protocol::{subjects, CacheCleared, Cancel, ClearCache, ErrorClass, Event, Job, StreamEvent, WireError, WorkerStatus};
use tokio::sync::mpsc;

use crate::actor::{CancelRequest, ClearPrefixCache, Outbound, SchedulerActor, Submit, WarmUp};
use crate::engine::{ActorEngine, EngineOptions};
use crate::placement::Placement;
use llmq_scheduler::SchedulerConfig;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("loading the model: {0}")]
    Model(String),
    #[error("NATS: {0}")]
    Nats(String),
}

/// The default warm-up prompt on a GPU (capped by the model's context and the KV budget).
const GPU_WARM_UP_TOKENS: usize = 8192;

fn nats_err(e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Nats(e.to_string())
}


/// The scheduler's settings for a worker whose chunks beside decoding streams run in `stages`
/// stages: such a chunk spans them; with stages, the tick budget sizes each tick's share of a
/// chunk in the decode actor, so here it sizes nothing; without, a budget set (the default one
/// is for stages only) sizes whole chunks.
pub fn scheduler_config(c: &SchedulerSettings, stages: usize) -> SchedulerConfig {
    SchedulerConfig {
        prefill_chunk: c.prefill_chunk_tokens.saturating_mul(stages),
        idle_prefill_chunk: c.idle_prefill_chunk_tokens,
        max_batch: c.max_batch,
        kv_budget_bytes: c.kv_budget_bytes,
        kv_bytes_per_token: 1,
        aging_tokens_per_s: c.aging_tokens_per_s,
        interleave: c.interleave,
        continuous: c.continuous,
        tick_budget: if stages > 1 { 0.0 } else { c.tick_budget.unwrap_or(0.0) },
        min_prefill_chunk: c.min_prefill_chunk_tokens,
    }
}

/// Sets MLX's allocator limits (`worker.mlx_memory_limit_bytes`, `worker.mlx_cache_limit_bytes`)
/// on the device thread, before the model loads; MLX keeps its own where a setting is absent.
fn set_mlx_limits(memory: Option<u64>, cache: Option<u64>) -> Result<(), String> {
    if let Some(b) = memory {
        mlx_rs::memory::set_memory_limit(b as usize).map_err(|e| format!("worker.mlx_memory_limit_bytes: {e}"))?;
    }
    if let Some(b) = cache {
        mlx_rs::memory::set_cache_limit(b as usize).map_err(|e| format!("worker.mlx_cache_limit_bytes: {e}"))?;
    }
    Ok(())
}

/// Runs a worker until the process is stopped. Must be called inside an actix System.
pub async fn run(settings: Settings) -> Result<(), WorkerError> {
    let worker_id = settings.worker.id.clone().unwrap_or_else(|| format!("w{:08x}", rand_u32()));
    let model_name = settings.worker.model.clone();
    let client = async_nats::connect(&settings.nats.url).await.map_err(nats_err)?;
    let js = jetstream::new(client.clone());
    let stream = subjects::jobs_stream(&js).await.map_err(nats_err)?;
    let cancels_stream = subjects::cancels_stream(&js).await.map_err(nats_err)?;
    let consumer: jetstream::consumer::Consumer<pull::Config> = stream
        .get_or_create_consumer(
            &subjects::jobs_consumer(&model_name),
            pull::Config {
                durable_name: Some(subjects::jobs_consumer(&model_name)),
                filter_subject: subjects::jobs(&model_name),
                ack_wait: Duration::from_millis(settings.worker.ack_wait_ms),
                ..Default::default()
            },
        )
        .await
        .map_err(nats_err)?;

    // The device thread: the model is loaded there, and it and its arrays never leave it.
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Outbound>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Addr<SchedulerActor<ActorEngine>>, String>>();
    let device = Arbiter::new();
    let gpu = llmq_engine::on_gpu();
    let sched = settings.scheduler.clone();
    let cfg = scheduler_config(&sched, sched.chunk_stages(gpu));
    let cfg_chunk = cfg.prefill_chunk;
    let prefix = settings.prefix_cache.clone();
    let decode_ahead = settings.scheduler.decode_ahead;
    let (chunk_stages, stage_tokens) = (settings.scheduler.chunk_stages(gpu), settings.scheduler.prefill_chunk_tokens);
    let (stage_budget, min_stage_tokens) = (settings.scheduler.tick_budget(gpu), settings.scheduler.min_prefill_chunk_tokens);
    let prefix_max = if prefix.max_bytes == 0 { cfg.kv_budget_bytes } else { prefix.max_bytes.min(cfg.kv_budget_bytes) };
    let (wid, mname, model_ref, dtype) =
        (worker_id.clone(), model_name.clone(), settings.worker.model.clone(), settings.worker.dtype.clone());
    let (mlx_memory_limit, mlx_cache_limit) = (settings.worker.mlx_memory_limit_bytes, settings.worker.mlx_cache_limit_bytes);
    let tick_log = settings.worker.tick_log.clone();
    let snapshot = Arc::new(Mutex::new(WorkerStatus::default()));
    let hb_snapshot = snapshot.clone();
    device.spawn_fn(move || {
        let loaded = (|| {
            set_mlx_limits(mlx_memory_limit, mlx_cache_limit)?;
            let dtype = dtype.as_deref().map(parse_dtype).transpose().map_err(|e| e.to_string())?.unwrap_or_else(default_dtype);
            load_named(&model_ref, dtype).map_err(|e| format!("{model_ref}: {e}"))
        })();
        let _ = ready_tx.send(loaded.map(|m| {
            let mut model = m.model;
            // A chunk beside decoding streams spans the stages this model's decode actor runs
            // it in (fewer than asked for a sliding-window model, or one with fewer layers).
            let chunk_stages = crate::decode::chunk_stages(&model, chunk_stages);
            let cfg = scheduler_config(&sched, chunk_stages);
            // Whole chunks, of every size the tick budget grants, are never padded.
            let mut sizes = cfg.chunk_sizes();
            sizes.push(cfg.idle_prefill_chunk);
            model.fit_chunk_grid(&sizes);
            let prefix = prefix.enabled.then_some((prefix.block_tokens, prefix_max));
            let opts = EngineOptions { decode_ahead, prefix, chunk_stages, stage_tokens, stage_budget, min_stage_tokens };
            let engine = ActorEngine::start(model, m.tokenizer, opts);
            SchedulerActor::new(engine, cfg, out_tx, wid, mname).with_status_snapshot(snapshot).with_tick_log(tick_log.as_deref()).start()
        }));
    });
    let actor = match tokio::task::spawn_blocking(move || ready_rx.recv()).await {
        Ok(Ok(Ok(addr))) => addr,
        Ok(Ok(Err(e))) => return Err(WorkerError::Model(e)),
        _ => return Err(WorkerError::Model("the device thread stopped".into())),
    };
    // Peers' heartbeats, heard from before the warm-up so that the peer set is known when jobs
    // are first fetched (see `placement`).
    let placement = Arc::new(Mutex::new(Placement::new(
        &worker_id,
        &model_name,
        Duration::from_millis(settings.worker.heartbeat_ms),
        settings.scheduler.max_batch,
        settings.worker.max_queued,
    )));
    let mut beats = client.subscribe(subjects::WORKER_STATUS_ALL).await.map_err(nats_err)?;
    let heard = placement.clone();
    actix::spawn(async move {
        while let Some(m) = beats.next().await {
            if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                heard.lock().unwrap().heard_at(s, std::time::Instant::now());
            }
        }
    });

    // On a GPU a long warm-up prompt pays for every cache size a burst of long prompts reaches
    // (each new size's first chunk costs 100+ ms there), in one round for every size of the
    // decode batch (a step's shapes follow it); on a CPU one round of a short one is enough (it
    // runs three long prompts: about 6 s of SmolLM2 at 261 tokens on a 2-core CPU).
    let (default_tokens, rows) = if gpu {
        (GPU_WARM_UP_TOKENS, crate::actor::warm_up_rows(settings.scheduler.max_batch))
    } else {
        (cfg_chunk + 5, vec![1])
    };
    let warm_up = settings.worker.warm_up_tokens.unwrap_or(default_tokens);
    if warm_up > 0 {
        match actor.send(WarmUp { tokens: warm_up, rows }).await {
            Ok(Ok(ms)) => tracing::info!(ms, tokens = warm_up, "warm-up done"),
            Ok(Err(e)) => tracing::warn!(error = %e, "warm-up failed; serving anyway"),
            Err(e) => return Err(WorkerError::Model(format!("the device thread stopped: {e}"))),
        }
    }
    tracing::info!(%worker_id, model = %model_name, "worker ready");

    // Jobs held here, by request id, until their terminal event is out, with their trace spans.
    let inflight: Arc<Mutex<HashMap<String, (jetstream::Message, tracing::Span)>>> = Arc::default();

    // Publisher: events in order; acks on terminal events.
    let (pub_client, pub_inflight) = (client.clone(), inflight.clone());
    actix::spawn(async move {
        while let Some(o) = out_rx.recv().await {
            let terminal = o.event.event.is_terminal();
            match llmq_protocol::encode(&o.event) {
                Ok(bytes) => {
                    if let Err(e) = pub_client.publish(o.subject.clone(), bytes.into()).await {
                        tracing::warn!(error = %e, "publishing an event");
                    }
                }
                Err(e) => tracing::error!(error = %e, "encoding an event"),
            }
            if terminal {
                let held = pub_inflight.lock().unwrap().remove(&o.request_id);
                if let Some((m, span)) = held {
                    record_end(&span, &o.event.event);
                    let _ = pub_client.flush().await;
                    if let Err(e) = m.ack().await {
                        tracing::warn!(error = %e, "acknowledging a job");
                    }
                }
            }
        }
    });

    // Cancels.
    let mut cancels = client.subscribe(subjects::CANCEL).await.map_err(nats_err)?;
    let cancel_actor = actor.clone();
    actix::spawn(async move {
        while let Some(m) = cancels.next().await {
            if let Ok(c) = llmq_protocol::decode::<Cancel>(&m.payload) {
                cancel_actor.do_send(CancelRequest(c.request_id));
            }
        }
    });

    // Prefix cache clears.
    let mut clears = client.subscribe(subjects::CACHE_CLEAR).await.map_err(nats_err)?;
    let (clear_actor, clear_client, clear_wid, clear_model) = (actor.clone(), client.clone(), worker_id.clone(), model_name.clone());
    actix::spawn(async move {
        while let Some(m) = clears.next().await {
            let Ok(c) = llmq_protocol::decode::<ClearCache>(&m.payload) else { continue };
            if c.model.as_ref().is_some_and(|x| *x != clear_model) {
                continue;
            }
            let freed = clear_actor.send(ClearPrefixCache).await.unwrap_or(0);
            if let Some(reply) = m.reply {
                if let Ok(bytes) = llmq_protocol::encode(&CacheCleared { worker_id: clear_wid.clone(), freed_bytes: freed }) {
                    let _ = clear_client.publish(reply, bytes.into()).await;
                }
            }
        }
    });

    // Heartbeats and progress acks.
    let (hb_client, hb_inflight) = (client.clone(), inflight.clone());
    let hb_every = Duration::from_millis(settings.worker.heartbeat_ms);
    let progress_every = Duration::from_millis(settings.worker.ack_wait_ms / 6);
    let status_subject = subjects::worker_status(&worker_id);
    actix::spawn(async move {
        let mut last_progress = tokio::time::Instant::now();
        let mut last_beat: Option<tokio::time::Instant> = None;
        loop {
            if last_beat.is_none_or(|t| t.elapsed() >= hb_every) {
                last_beat = Some(tokio::time::Instant::now());
                // The actor's latest snapshot, not a message to it: a worker in a long tick (a
                // big prefill on a CPU takes seconds) must not look gone to intake, the gateway
                // or its peers.
                let mut status = hb_snapshot.lock().unwrap().clone();
                status.sent_at_ms =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
                if let Ok(bytes) = llmq_protocol::encode(&status) {
                    let _ = hb_client.publish(status_subject.clone(), bytes.into()).await;
                }
            }
            if last_progress.elapsed() >= progress_every {
                last_progress = tokio::time::Instant::now();
                let msgs: Vec<_> = hb_inflight.lock().unwrap().values().map(|(m, _)| m.clone()).collect();
                for m in msgs {
                    let _ = m.ack_with(AckKind::Progress).await;
                }
            }
            tokio::time::sleep(hb_every.min(progress_every) / 2).await;
        }
    });

    // Cancels sent before this worker started, for jobs that may still be waiting in the stream
    // (the live subscription above covers everything from its start on; twice is harmless).
    match replay_cancels(&cancels_stream, &actor).await {
        Ok(n) => tracing::debug!(n, "stored cancels replayed"),
        Err(e) => tracing::warn!(error = %e, "could not replay stored cancels"),
    }
    // Fetch loop: take jobs while there is room.
    loop {
        let limit = placement.lock().unwrap().limit_at(std::time::Instant::now());
        let room = limit.saturating_sub(inflight.lock().unwrap().len());
        if room == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        // One job per fetch: the server hands jobs to the workers' waiting fetches in turn, so
        // equal workers share a burst evenly, and a worker without room asks for nothing.
        let batch = consumer.fetch().max_messages(1).expires(Duration::from_millis(500)).messages().await;
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "fetching jobs");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while let Some(msg) = batch.next().await {
            let Ok(msg) = msg else { continue };
            let job = match llmq_protocol::decode::<Job>(&msg.payload) {
                Ok(j) => j,
                Err(e) => {
                    tracing::error!(error = %e, "undecodable job; dropping it");
                    let _ = msg.ack_with(AckKind::Term).await;
                    continue;
                }
            };
            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
            if delivered > 1 {
                // Its first worker may have streamed events already: end it, do not replay it.
                let ev = StreamEvent {
                    request_id: job.request_id.clone(),
                    seq: llmq_protocol::SEQ_FROM_ANOTHER_WORKER,
                    event: Event::Error {
                        error: WireError::new(ErrorClass::WorkerLost, "the worker running this request stopped"),
                    },
                };
                if let Ok(bytes) = llmq_protocol::encode(&ev) {
                    let _ = client.publish(job.stream_subject.clone(), bytes.into()).await;
                    let _ = client.flush().await;
                }
                let _ = msg.ack().await;
                continue;
            }
            let span = tracing::info_span!(
                "worker.request",
                request_id = %job.request_id,
                prompt_tokens = job.prompt_ids.len() as i64,
                cached_tokens = tracing::field::Empty,
                completion_tokens = tracing::field::Empty,
                finish_reason = tracing::field::Empty,
                queue_ms = tracing::field::Empty,
                ttft_ms = tracing::field::Empty,
                error = tracing::field::Empty
            );
            llmq_telemetry::extract(&span, msg.headers.as_ref());
            inflight.lock().unwrap().insert(job.request_id.clone(), (msg, span));
            actor.do_send(Submit(job));
        }
    }
}

/// Hands every cancel the cancels stream holds to the actor (which remembers those of requests
/// it does not hold, and ends such a job with `Cancelled` if it ever arrives). Returns how many.
async fn replay_cancels(stream: &jetstream::stream::Stream, actor: &Addr<SchedulerActor<ActorEngine>>) -> Result<usize, String> {
    let consumer = stream
        .create_consumer(pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ack_policy: jetstream::consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut n = 0;
    loop {
        let mut batch = consumer.fetch().max_messages(1000).messages().await.map_err(|e| e.to_string())?;
        let mut got = 0;
        while let Some(Ok(m)) = batch.next().await {
            got += 1;
            if let Ok(c) = llmq_protocol::decode::<Cancel>(&m.payload) {
                actor.do_send(CancelRequest(c.request_id));
            }
        }
        n += got;
        if got == 0 {
            return Ok(n);
        }
    }
}

/// Puts a request's outcome on its span (which then closes).
fn record_end(span: &tracing::Span, event: &Event) {
    match event {
        Event::Done { finish_reason, usage, timings } => {
            span.record("cached_tokens", usage.cached as i64);
            span.record("completion_tokens", usage.completion as i64);
            span.record("finish_reason", tracing::field::debug(finish_reason));
            span.record("queue_ms", timings.queue_ms);
            span.record("ttft_ms", timings.ttft_ms);
        }
        Event::Error { error } => {
            span.record("error", tracing::field::debug(error.class));
        }
        _ => {}
    }
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (t.as_nanos() as u32) ^ (std::process::id().rotate_left(16))
}
