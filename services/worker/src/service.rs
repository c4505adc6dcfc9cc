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
//! - `llm.v1.cache.clear`: drops the cached prefixes (answers [`CacheCleared`] if asked).
//! - heartbeats: [`WorkerStatus`] on `llm.v1.worker.<id>.status` every `worker.heartbeat_ms`: the
//!   actor's latest status snapshot, so they keep coming during a long tick.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use llmq_config::{SchedulerSettings, Settings};
use llmq_protocol::{subjects, CacheCleared, Cancel, ClearCache, Event, WorkerRole, WorkerStatus};
use tokio::sync::mpsc;

use crate::actor::{
    CancelRequest, ClearPrefixCache, Outbound, SchedulerActor, WarmUp, WorkerExecutor,
};
use crate::device::{auto_kv_budget, load_on_device, stop_device};
use crate::disaggregated::decode_side::RemotePrefill;
use crate::error::nats_err;
pub use crate::error::WorkerError;
use crate::held::HeldJobs;
use crate::held::Inflight;
use crate::host_memory;
use crate::jobs::{drain, hand_back, jobs_consumer, replay_cancels, Jobs, Scheduler};
use crate::placement::Placement;
use crate::roles::{PrefixOptions, RoleActors, RoleOptions};
use crate::stall::Watchdog;
use crate::time::unix_ms;
use llmq_scheduler::SchedulerConfig;

/// The default warm-up prompt on a GPU (capped by the model's context and the KV budget).
const GPU_WARM_UP_TOKENS: usize = 8192;

/// The scheduler's settings for a worker whose chunks beside decoding streams run in `stages`
/// stages: such a chunk spans them; with stages, the tick budget sizes each tick's share of a
/// chunk in the decode actor, so here it sizes nothing; without, the budget (set, or the
/// device's default: a CPU's) sizes whole chunks. On a CPU a model that cannot stage its chunks
/// (sliding windows) takes whole chunks up to a staged chunk's tokens, sized by the budget.
pub fn scheduler_config(
    c: &SchedulerSettings,
    gpu: bool,
    stages: usize,
    kv_budget_bytes: u64,
) -> SchedulerConfig {
    SchedulerConfig {
        prefill_chunk: c.chunk_tokens(gpu).saturating_mul(if gpu {
            stages
        } else {
            c.chunk_stages(gpu)
        }),
        idle_prefill_chunk: c.idle_chunk(gpu),
        max_batch: c.max_batch,
        kv_budget_bytes,
        // Set from the executor by the scheduler actor, as `state_tokens` and
        // `last_token_apart` are.
        kv_bytes_per_token: 1,
        state_tokens: 0,
        block_tokens: c.kv_block_tokens,
        lookahead_tokens: c.kv_lookahead_tokens,
        aging_tokens_per_s: c.aging_tokens_per_s,
        interleave: c.interleave,
        continuous: c.continuous,
        tick_budget: if stages > 1 { 0.0 } else { c.tick_budget(gpu) },
        min_prefill_chunk: c.min_chunk(gpu),
        // Set from the executor by the scheduler actor.
        last_token_apart: false,
    }
}

/// Runs a worker until `stop` completes (the binary passes SIGTERM or SIGINT): then it fetches
/// no more jobs, finishes those it holds for up to `worker.drain_timeout_s`, ends what is left
/// with `worker_lost` (acknowledged, so no other worker runs it again), and returns once every
/// held job's terminal event is out. Must be called inside an actix System.
pub async fn run(
    settings: Settings,
    stop: impl std::future::Future<Output = ()> + 'static,
) -> Result<(), WorkerError> {
    let worker_id = settings.worker.id.clone().unwrap_or_else(default_worker_id);
    let model_name = settings.worker.model.clone();
    let role = settings.worker.role;
    let client = llmq_protocol::connect(
        &settings.nats.url,
        settings.nats.ca_file.as_deref(),
        "llmq-worker",
    )
    .await
    .map_err(nats_err)?;
    if role == WorkerRole::Prefill {
        return crate::disaggregated::prefill_worker::run(settings, client, worker_id, stop).await;
    }
    let js = jetstream::new(client.clone());
    let consumer = jobs_consumer(&js, &settings).await?;
    let cancels_stream = subjects::cancels_stream(&js).await.map_err(nats_err)?;
    let handed_back = subjects::handed_back_stream(&js).await.map_err(nats_err)?;

    let (out_tx, out_rx) = mpsc::unbounded_channel::<Outbound>();
    let snapshot = Arc::new(Mutex::new(WorkerStatus::default()));
    let (remote, link) = match role {
        WorkerRole::Decode => {
            let (device_end, link_end) = RemotePrefill::new(
                &worker_id,
                Duration::from_millis(settings.worker.remote_prefill_timeout_ms),
            );
            (Some(device_end), Some(link_end))
        }
        _ => (None, None),
    };
    let (actor, device) =
        start_device(&settings, &worker_id, out_tx, snapshot.clone(), remote).await?;
    // Whatever ends the serving (a stop, an error), the device thread is stopped before the
    // process may exit.
    let served: Result<(), WorkerError> = async {
        let inflight = Arc::new(HeldJobs::new(Duration::from_millis(settings.worker.ack_wait_ms)));
        let placement = follow_peers(&client, &settings, &worker_id).await?;
        warm_up(&actor, &settings).await?;
        tracing::info!(%worker_id, model = %model_name, ?role, "worker ready");
        // Prompts go to prefill workers only after the warm-up (which runs here).
        if let Some(end) = link {
            let beat = Duration::from_millis(settings.worker.heartbeat_ms);
            let kv_client = llmq_protocol::connect(&settings.nats.url, settings.nats.ca_file.as_deref(), "llmq-worker-kv").await.map_err(nats_err)?;
            let direct = match settings.worker.kv_listen.as_str() {
                "" | "off" => None,
                addr => {
                    let (tx, rx) = mpsc::unbounded_channel();
                    let tls = settings.nats.ca_file.is_some() || settings.nats.url.starts_with("tls://");
                    let at = crate::disaggregated::kv_link::Listen { addr, advertise: settings.worker.kv_advertise.as_deref(), nats_url: &settings.nats.url, loopback_only: tls };
                    match crate::disaggregated::kv_link::listen(at, tx).await {
                        Ok(offer) => {
                            tracing::info!(addr = %offer.addr, "direct KV connections accepted");
                            Some((offer, rx))
                        }
                        Err(e) => {
                            tracing::warn!(addr, error = %e, "cannot listen for direct KV connections; the KV comes over NATS");
                            None
                        }
                    }
                }
            };
            let link = crate::disaggregated::decode_side::link(client.clone(), kv_client, end, worker_id.clone(), model_name.clone(), beat, direct);
            actix::spawn(async move {
                if let Err(e) = link.await {
                    tracing::error!(error = %e, "remote prefill stopped; prefilling here");
                }
            });
        }

        actix::spawn(publish_events(client.clone(), out_rx, inflight.clone(), actor.clone()));
        let cancels = client.subscribe(subjects::CANCEL).await.map_err(nats_err)?;
        actix::spawn(forward_cancels(cancels, actor.clone()));
        let clears = client.subscribe(subjects::CACHE_CLEAR).await.map_err(nats_err)?;
        actix::spawn(clear_caches(clears, actor.clone(), client.clone(), worker_id.clone(), model_name));
        actix::spawn(heartbeats(client.clone(), &settings, &worker_id, role, snapshot, inflight.clone()));
        // Cancels sent before this worker started, for jobs that may still be waiting in the stream
        // (the live subscription above covers everything from its start on; twice is harmless).
        match replay_cancels(&cancels_stream, &actor).await {
            Ok(n) => tracing::debug!(n, "stored cancels replayed"),
            Err(e) => tracing::warn!(error = %e, "could not replay stored cancels"),
        }

        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stopping.clone();
        actix::spawn(async move {
            stop.await;
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let jobs = Jobs { client: &client, consumer: &consumer, placement: &placement, inflight: &inflight, actor: &actor, handed_back: &handed_back };
        while !stopping.load(std::sync::atomic::Ordering::SeqCst) {
            jobs.fetch_one().await;
        }
        hand_back(&actor, &inflight, &js).await;
        drain(&actor, &inflight, Duration::from_secs(settings.worker.drain_timeout_s)).await;
        let _ = client.flush().await;
        Ok(())
    }
    .await;
    stop_device(device).await;
    served
}

/// Starts the device thread: the model is loaded there, and it and its arrays never leave it;
/// the scheduler actor and its role actors run there. Returns the scheduler actor and the
/// thread (to stop at exit).
async fn start_device(
    settings: &Settings,
    worker_id: &str,
    out: mpsc::UnboundedSender<Outbound>,
    snapshot: Arc<Mutex<WorkerStatus>>,
    remote: Option<RemotePrefill>,
) -> Result<(Scheduler, Arbiter), WorkerError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Scheduler, WorkerError>>();
    let gpu = llmq_engine::on_gpu();
    let sched = settings.scheduler.clone();
    let prefix = settings.prefix_cache.clone();
    let requested_stages = sched.chunk_stages(gpu);
    let (stage_budget, stage_tokens, min_stage_tokens) = (
        sched.tick_budget(gpu),
        sched.chunk_tokens(gpu),
        sched.min_chunk(gpu),
    );
    let w = settings.worker.clone();
    // On a CPU, memory faulted in once and reused (see `host_memory`).
    let reserve_host_memory = !gpu && w.host_memory_reserve_bytes != Some(0);
    let worker_id = worker_id.to_string();
    let device = Arbiter::new();
    device.spawn_fn(move || {
        let loaded = load_on_device(&w, reserve_host_memory);
        let _ = ready_tx.send(loaded.map(|m| {
            let mut model = m.model;
            // A chunk beside decoding streams spans the stages this model's decode actor runs
            // it in (fewer than asked for a sliding-window model, or one with fewer layers).
            let chunk_stages = crate::roles::decode::chunk_stages(&model, requested_stages);
            let kv_budget = sched
                .kv_budget_bytes
                .unwrap_or_else(|| auto_kv_budget(model.weight_bytes()));
            tracing::info!(
                kv_budget_bytes = kv_budget,
                weight_bytes = model.weight_bytes(),
                "KV budget"
            );
            let prefix_max = if prefix.max_bytes == 0 {
                kv_budget
            } else {
                prefix.max_bytes.min(kv_budget)
            };
            let cfg = scheduler_config(&sched, gpu, chunk_stages, kv_budget);
            // Whole chunks, of every size the tick budget grants, are never padded.
            let mut sizes = cfg.chunk_sizes();
            sizes.push(cfg.idle_prefill_chunk);
            model.fit_chunk_grid(&sizes);
            let prefix = prefix.enabled.then_some(PrefixOptions {
                block_tokens: prefix.block_tokens,
                max_bytes: prefix_max,
            });
            let opts = RoleOptions {
                decode_ahead: sched.decode_ahead,
                prefix,
                chunk_stages,
                stage_tokens,
                stage_budget,
                min_stage_tokens,
            };
            let mut roles = RoleActors::start(model, m.tokenizer, opts);
            if let Some(remote) = remote {
                roles = roles.with_remote_prefill(remote);
            }
            if reserve_host_memory {
                let reserve = w.host_memory_reserve_bytes.unwrap_or_else(|| {
                    host_memory::default_reserve(
                        roles.context_tokens(),
                        roles.kv_bytes_per_token(),
                        kv_budget,
                    )
                });
                let t = std::time::Instant::now();
                match host_memory::fault_in(reserve) {
                    Ok(()) => tracing::info!(
                        reserve_bytes = reserve,
                        ms = t.elapsed().as_millis() as u64,
                        "host memory faulted in"
                    ),
                    Err(e) => tracing::warn!(error = %e, "host memory not faulted in"),
                }
            }
            SchedulerActor::new(roles, cfg, out, worker_id, w.model.clone())
                .with_status_snapshot(snapshot)
                .with_tick_log(w.tick_log.as_deref())
                .start()
        }));
    });
    let started = match tokio::task::spawn_blocking(move || ready_rx.recv()).await {
        Ok(Ok(Ok(addr))) => Ok(addr),
        Ok(Ok(Err(e))) => Err(e),
        _ => Err(WorkerError::DeviceStopped),
    };
    match started {
        Ok(addr) => Ok((addr, device)),
        Err(e) => {
            stop_device(device).await;
            Err(e)
        }
    }
}

/// Follows the peers' heartbeats, from before the warm-up so that the peer set is known when
/// jobs are first fetched (see `placement`).
async fn follow_peers(
    client: &async_nats::Client,
    settings: &Settings,
    worker_id: &str,
) -> Result<Arc<Mutex<Placement>>, WorkerError> {
    let placement = Arc::new(Mutex::new(Placement::new(
        worker_id,
        &settings.worker.model,
        Duration::from_millis(settings.worker.heartbeat_ms),
        settings.scheduler.max_batch,
        settings.worker.max_queued,
    )));
    let mut beats = client
        .subscribe(subjects::WORKER_STATUS_ALL)
        .await
        .map_err(nats_err)?;
    let heard = placement.clone();
    actix::spawn(async move {
        while let Some(m) = beats.next().await {
            if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                heard.lock().unwrap().heard_at(s, std::time::Instant::now());
            }
        }
    });
    Ok(placement)
}

/// Runs the warm-up before the worker takes jobs. On a GPU a long warm-up prompt pays for
/// every cache size a burst of long prompts reaches (each new size's first chunk stalls while
/// MLX plans it), in one round for every size of the decode batch (a step's shapes follow it); on a
/// CPU one round of a short one is enough, its long prompts one tick's prefill work and a few
/// tokens (a chunk's shares take up to a tick a layer there, and the warm-up keeps the short
/// one decoding through the most: prompts of a whole chunk would double its time).
async fn warm_up(actor: &Scheduler, settings: &Settings) -> Result<(), WorkerError> {
    let sched = &settings.scheduler;
    let (default_tokens, rows) = if llmq_engine::on_gpu() {
        (
            GPU_WARM_UP_TOKENS,
            crate::actor::warm_up_rows(sched.max_batch),
        )
    } else {
        (sched.chunk_tokens(false) + 5, vec![1])
    };
    let tokens = settings.worker.warm_up_tokens.unwrap_or(default_tokens);
    if tokens == 0 {
        return Ok(());
    }
    match actor.send(WarmUp { tokens, rows }).await {
        Ok(Ok(ms)) => tracing::info!(ms, tokens, "warm-up done"),
        Ok(Err(e)) => tracing::warn!(error = %e, "warm-up failed; serving anyway"),
        Err(_) => return Err(WorkerError::DeviceStopped),
    }
    Ok(())
}

/// Publishes events in order, and acknowledges a job once its terminal event is out. While
/// the connection is down, events wait; a job given up meanwhile (`held`) gets none of them.
async fn publish_events(
    client: async_nats::Client,
    mut out: mpsc::UnboundedReceiver<Outbound>,
    inflight: Inflight,
    actor: Scheduler,
) {
    while let Some(o) = out.recv().await {
        while client.connection_state() != async_nats::connection::State::Connected {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (publish, given_up) = inflight.may_publish(&o.request_id, std::time::Instant::now());
        if !given_up.is_empty() {
            tracing::warn!(
                jobs = given_up.len(),
                "the server did not hear this worker for too long: its jobs go to others"
            );
            for id in given_up {
                actor.do_send(CancelRequest(id));
            }
        }
        match llmq_protocol::encode(&o.event) {
            Ok(bytes) if publish => {
                if let Err(e) = client.publish(o.subject.clone(), bytes.into()).await {
                    tracing::warn!(error = %e, "publishing an event");
                }
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "encoding an event"),
        }
        if o.last {
            if let Some((m, span)) = inflight.end(&o.request_id) {
                record_end(&span, &o.event.event);
                let _ = client.flush().await;
                if let Err(e) = m.ack().await {
                    tracing::warn!(error = %e, "acknowledging a job");
                }
            }
        }
    }
}

/// `llm.v1.cancel`, broadcast: the actor cancels what it holds and remembers the rest.
async fn forward_cancels(mut cancels: async_nats::Subscriber, actor: Scheduler) {
    while let Some(m) = cancels.next().await {
        if let Ok(c) = llmq_protocol::decode::<Cancel>(&m.payload) {
            actor.do_send(CancelRequest(c.request_id));
        }
    }
}

/// `llm.v1.cache.clear`: drops the cached prefixes of this worker's model (of every model if
/// none is named), answering [`CacheCleared`] when asked.
async fn clear_caches(
    mut clears: async_nats::Subscriber,
    actor: Scheduler,
    client: async_nats::Client,
    worker_id: String,
    model: String,
) {
    while let Some(m) = clears.next().await {
        let Ok(c) = llmq_protocol::decode::<ClearCache>(&m.payload) else {
            continue;
        };
        if c.model.as_ref().is_some_and(|x| *x != model) {
            continue;
        }
        let freed = actor.send(ClearPrefixCache).await.unwrap_or(0);
        if let Some(reply) = m.reply {
            if let Ok(bytes) = llmq_protocol::encode(&CacheCleared {
                worker_id: worker_id.clone(),
                freed_bytes: freed,
            }) {
                let _ = client.publish(reply, bytes.into()).await;
            }
        }
    }
}

/// Heartbeats every `worker.heartbeat_ms`, and progress acks for the jobs held six times per
/// ack wait, each asking the server for the reply that keeps its job this worker's (`held`). A
/// heartbeat is the actor's latest snapshot, not a message to it: a worker in a long tick (a big
/// prefill on a CPU takes seconds) must not look gone to intake, the gateway or its peers.
fn heartbeats(
    client: async_nats::Client,
    settings: &Settings,
    worker_id: &str,
    role: WorkerRole,
    snapshot: Arc<Mutex<WorkerStatus>>,
    inflight: Inflight,
) -> impl std::future::Future<Output = ()> {
    let beat_every = Duration::from_millis(settings.worker.heartbeat_ms);
    let progress_every = Duration::from_millis(settings.worker.ack_wait_ms / 6);
    let subject = subjects::worker_status(worker_id);
    let stall_limit = Duration::from_secs(settings.worker.stall_exit_s);
    async move {
        let mut last_progress = tokio::time::Instant::now();
        let mut last_beat: Option<tokio::time::Instant> = None;
        let mut watchdog = Watchdog::new(stall_limit, std::time::Instant::now());
        loop {
            // Work: what the scheduler last reported, or jobs held while the server hears this
            // worker (during an outage the ended jobs' acks wait for it, and the ticks rest).
            let (ticks, work) = {
                let s = snapshot.lock().unwrap();
                (s.ticks, s.active_streams + s.queued_requests > 0)
            };
            let connected = client.connection_state() == async_nats::connection::State::Connected;
            let now = std::time::Instant::now();
            if watchdog.stuck(ticks, work || (connected && !inflight.is_empty()), now) {
                tracing::error!(
                    stalled_s = watchdog.stalled_for(now).as_secs(),
                    jobs = inflight.len(),
                    "the device thread has run no tick for worker.stall_exit_s while holding \
                     jobs: exiting, its jobs unacknowledged for other workers to end"
                );
                std::process::exit(70);
            }
            if last_progress.elapsed() >= progress_every {
                last_progress = tokio::time::Instant::now();
                let sent = std::time::Instant::now();
                let within = inflight.reply_within();
                for (request_id, m) in inflight.messages() {
                    let Some(reply) = m.reply.clone() else {
                        continue;
                    };
                    let (client, held) = (client.clone(), inflight.clone());
                    // A later reply would not count: waiting longer is pointless.
                    actix::spawn(async move {
                        let ack = client.request(reply, AckKind::Progress.into());
                        if let Ok(Ok(_)) = tokio::time::timeout(within, ack).await {
                            held.confirmed(&request_id, sent, std::time::Instant::now());
                        }
                    });
                }
            }
            if last_beat.is_none_or(|t| t.elapsed() >= beat_every) {
                last_beat = Some(tokio::time::Instant::now());
                let mut status = snapshot.lock().unwrap().clone();
                status.sent_at_ms = unix_ms();
                status.role = role;
                if let Ok(bytes) = llmq_protocol::encode(&status) {
                    let _ = client.publish(subject.clone(), bytes.into()).await;
                }
            }
            tokio::time::sleep(beat_every.min(progress_every) / 2).await;
        }
    }
}

/// Puts a request's outcome on its span (which then closes).
fn record_end(span: &tracing::Span, event: &Event) {
    match event {
        Event::Done {
            finish_reason,
            usage,
            timings,
        } => {
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

/// `<host>-<random>`: the host names the machine or container in metrics and logs, the random
/// part tells a restarted worker from its predecessor.
pub(crate) fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = subjects::token(host.trim());
    format!(
        "{}-{:08x}",
        if host.is_empty() { "w" } else { &host },
        rand_u32()
    )
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_nanos() as u32) ^ (std::process::id().rotate_left(16))
}
