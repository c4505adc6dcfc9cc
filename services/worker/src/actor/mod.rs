//! The scheduler actor: owns the scheduler (the policy) on the device thread, and is the
//! device's clock. It ticks while there is work and sleeps on its mailbox when there is none.
//! A tick is one asynchronous exchange with the executor, the prefill, decode and cache actors
//! (see `executor`), during which this actor handles no other message: [`Submit`] and
//! [`CancelRequest`] are handled between ticks, so a cancel lands within one tick. Outgoing
//! events leave through a channel to the NATS side, in order.
//!
//! Invariants: events of a request carry consecutive sequence numbers from 0; a panic inside a
//! tick never escapes the actor: every request it held ends with an `Error` event, the executor
//! is reset (its actors drop every request's state), and the worker goes on.

mod cancels;
mod executor;
mod warm_up;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix::prelude::*;
use futures::FutureExt;
use llmq_protocol::{ErrorClass, Event, Job, StreamEvent, WireError, WorkerStatus};
use llmq_scheduler::{Admission, Emit, ReqId, Scheduler, SchedulerConfig, TickReport};
use tokio::sync::mpsc::UnboundedSender;

use self::cancels::RecentCancels;
pub use self::cancels::CANCEL_MEMORY;
pub use self::executor::{CallTimes, KvReceived, WorkerExecutor};
pub use self::warm_up::{warm_up_rows, WarmUp, WarmUpError};
use crate::seq::{panic_text, SeqSpec};
use crate::tick_log::TickLog;

/// An event ready to publish; `last` (the terminal event of the job's last sample to end)
/// tells the NATS side to acknowledge the job.
#[derive(Debug)]
pub struct Outbound {
    pub request_id: String,
    pub subject: String,
    pub event: StreamEvent,
    pub last: bool,
}

/// One sample of a job: the scheduler's request for it.
struct Meta {
    request_id: String,
    choice: u32,
}

/// A job held here: its event stream, and its samples not ended yet.
struct JobStream {
    subject: String,
    seq: u64,
    ids: Vec<ReqId>,
}

pub struct SchedulerActor<E: WorkerExecutor + Unpin + 'static> {
    scheduler: Scheduler,
    /// None only while an exchange with it is under way (no other message is handled then).
    executor: Option<E>,
    cfg: SchedulerConfig,
    meta: HashMap<ReqId, Meta>,
    jobs: HashMap<String, JobStream>,
    next_id: ReqId,
    tick_pending: bool,
    /// Start of the tick in progress while the scheduler is busy.
    tick_started: Option<std::time::Instant>,
    ticks: u64,
    tick_wall: Duration,
    /// Requests ended (terminal events published) since start.
    ended: u64,
    /// Moving average of tick durations, to tell a stall from the usual.
    tick_ema_ms: f64,
    out: UnboundedSender<Outbound>,
    /// Cancels of requests not held here (yet): a job still waiting in the jobs stream when its
    /// cancel went out is ended with [`Cancelled`] when it arrives instead of run.
    cancelled: RecentCancels,
    /// The latest status, refreshed after every message, for heartbeats that must not wait for
    /// a long tick (a worker busy in one is alive, not gone).
    snapshot: Option<std::sync::Arc<std::sync::Mutex<WorkerStatus>>>,
    /// One line per tick, when the worker's settings ask for it (`with_tick_log`).
    tick_log: Option<TickLog>,
    pub worker_id: String,
    pub model_name: String,
}

/// A sequence's recurrent states counted as positions of KV (see
/// [`SchedulerConfig::state_tokens`]).
pub fn state_tokens(executor: &impl WorkerExecutor) -> usize {
    executor
        .state_bytes_per_sequence()
        .div_ceil(executor.kv_bytes_per_token().max(1)) as usize
}

/// `cfg` with what only the executor knows: a token's KV bytes, a sequence's states counted as
/// positions, and whether a prompt's last token comes apart.
pub fn fitted_to(executor: &impl WorkerExecutor, cfg: SchedulerConfig) -> SchedulerConfig {
    SchedulerConfig {
        kv_bytes_per_token: executor.kv_bytes_per_token(),
        state_tokens: state_tokens(executor),
        last_token_apart: executor.last_token_apart(),
        ..cfg
    }
}

impl<E: WorkerExecutor + Unpin + 'static> SchedulerActor<E> {
    pub fn new(
        executor: E,
        cfg: SchedulerConfig,
        out: UnboundedSender<Outbound>,
        worker_id: String,
        model_name: String,
    ) -> Self {
        let cfg = fitted_to(&executor, cfg);
        SchedulerActor {
            scheduler: Scheduler::new(cfg.clone()),
            executor: Some(executor),
            cfg,
            meta: HashMap::new(),
            jobs: HashMap::new(),
            next_id: 0,
            tick_pending: false,
            tick_started: None,
            ticks: 0,
            tick_wall: Duration::ZERO,
            ended: 0,
            tick_ema_ms: 0.0,
            out,
            cancelled: RecentCancels::default(),
            snapshot: None,
            tick_log: None,
            worker_id,
            model_name,
        }
    }

    /// Writes one line per tick to `<path>.<worker id>` (see `tick_log`); a log that cannot be
    /// created is warned of, and the worker runs without it.
    pub fn with_tick_log(mut self, path: Option<&std::path::Path>) -> Self {
        self.tick_log = path.and_then(|p| {
            TickLog::create(p, &self.worker_id)
                .map_err(|e| tracing::warn!(path = ?p, error = %e, "cannot write the tick log"))
                .ok()
        });
        self
    }

    /// Keeps `shared` up to date with this actor's status (after every tick and message).
    pub fn with_status_snapshot(
        mut self,
        shared: std::sync::Arc<std::sync::Mutex<WorkerStatus>>,
    ) -> Self {
        self.snapshot = Some(shared);
        self.refresh_snapshot();
        self
    }

    fn refresh_snapshot(&self) {
        if let Some(s) = &self.snapshot {
            let status = self.status();
            if let Ok(mut g) = s.lock() {
                *g = status;
            }
        }
    }

    fn publish(&mut self, emits: Vec<Emit>) {
        for e in emits {
            let terminal = e.event.is_terminal();
            let Some(m) = self.meta.get(&e.id) else {
                continue;
            };
            let Some(job) = self.jobs.get_mut(&m.request_id) else {
                continue;
            };
            let event = StreamEvent {
                request_id: m.request_id.clone(),
                seq: job.seq,
                event: e.event,
                choice: m.choice,
            };
            job.seq += 1;
            if terminal {
                job.ids.retain(|x| *x != e.id);
            }
            let last = terminal && job.ids.is_empty();
            let _ = self.out.send(Outbound {
                request_id: m.request_id.clone(),
                subject: job.subject.clone(),
                event,
                last,
            });
            if terminal {
                let m = self.meta.remove(&e.id).expect("looked up above");
                if last {
                    self.ended += 1;
                    self.jobs.remove(&m.request_id);
                }
            }
        }
    }

    fn schedule_tick(&mut self, ctx: &mut Context<Self>) {
        self.refresh_snapshot();
        if !self.tick_pending && !self.scheduler.is_idle() {
            self.tick_pending = true;
            // Through the mailbox, behind any Submit or Cancel already waiting.
            ctx.address().do_send(Tick);
        }
    }

    /// After a panic (the executor already reset): end every held request with an error and
    /// start from clean state.
    fn recover(&mut self, what: &str) {
        tracing::error!(
            what,
            "scheduler panicked; failing its requests and resetting"
        );
        let ids: Vec<ReqId> = self.meta.keys().copied().collect();
        let emits = ids
            .into_iter()
            .map(|id| Emit {
                id,
                event: Event::Error {
                    error: WireError::new(ErrorClass::Internal, format!("worker fault: {what}")),
                },
            })
            .collect();
        self.scheduler = Scheduler::new(self.cfg.clone());
        self.publish(emits);
    }

    /// Runs `work` on the executor while this actor handles nothing else, then `then` with its
    /// result (the executor is back in place by then); `busy` answers if the executor is away.
    fn exchange<T: 'static, R: 'static, F>(
        &mut self,
        busy: R,
        work: impl FnOnce(E) -> F,
        then: impl FnOnce(T, &mut Self, &mut Context<Self>) -> R + 'static,
    ) -> AtomicResponse<Self, R>
    where
        F: std::future::Future<Output = (E, T)> + 'static,
    {
        let Some(executor) = self.executor.take() else {
            tracing::error!("the executor is busy in another exchange");
            return AtomicResponse::new(Box::pin(actix::fut::ready(busy)));
        };
        AtomicResponse::new(Box::pin(work(executor).into_actor(self).map(
            move |(executor, r), act, ctx| {
                act.executor = Some(executor);
                then(r, act, ctx)
            },
        )))
    }

    pub fn status(&self) -> WorkerStatus {
        let Some(executor) = self.executor.as_ref() else {
            // Mid-exchange (never seen by a message handler): the last snapshot.
            return self
                .snapshot
                .as_ref()
                .and_then(|s| s.lock().ok().map(|g| g.clone()))
                .unwrap_or_default();
        };
        let used = executor.kv_bytes_in_use();
        let prefix = executor.prefix_stats();
        let calls = executor.call_times();
        let received = executor.kv_received();
        let masks = executor.mask_times();
        WorkerStatus {
            worker_id: self.worker_id.clone(),
            model: self.model_name.clone(),
            kv_bytes_received: received.bytes,
            kv_transfer_ms: received.transfer_ms,
            context_tokens: executor.context_tokens() as u32,
            active_streams: self.scheduler.active_streams() as u32,
            queued_requests: self.scheduler.queued_requests() as u32,
            ended_requests: self.ended,
            queued_prefill_tokens: self.scheduler.queued_prefill_tokens(),
            kv_bytes_used: used,
            kv_bytes_free: self
                .cfg
                .kv_budget_bytes
                .saturating_sub(self.scheduler.held_kv_bytes()),
            kv_bytes_per_token: executor.kv_bytes_per_token(),
            kv_blocks_total: self.scheduler.pool().total() as u64,
            kv_blocks_used: self.scheduler.pool().used() as u64,
            preemptions: self.scheduler.preemptions(),
            max_batch: self.cfg.max_batch as u32,
            prefix_hit_rate: prefix.hit_rate(),
            prefix_bytes: prefix.held_bytes,
            prefix_entries: prefix.entries,
            prefix_reused_tokens: prefix.reused_tokens,
            prefix_evictions: prefix.evictions,
            sent_at_ms: now().as_millis() as u64,
            ticks: self.ticks,
            // Up to now: the time since the last tick started counts as between-tick time.
            tick_wall_ms: (self.tick_wall
                + self.tick_started.map_or(Duration::ZERO, |s| s.elapsed()))
            .as_secs_f64()
                * 1000.0,
            engine_ms: executor.engine_ms(),
            prefill_calls: calls.prefill_calls,
            prefill_ms: calls.prefill_ms,
            decode_calls: calls.decode_calls,
            decode_ms: calls.decode_ms,
            constrained_steps: masks.steps,
            constrained_rows: masks.rows,
            mask_ms: masks.mask_ms,
            mask_blocked_ms: masks.blocked_ms,
            mask_wait_ms: masks.wait_ms,
            ..Default::default()
        }
    }
}

/// The wall clock as the scheduler's clock (jobs carry their acceptance time as UNIX ms).
fn now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

impl<E: WorkerExecutor + Unpin + 'static> Actor for SchedulerActor<E> {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Tick;

/// A job taken from the jobs stream, and the `seq` its first event gets (0, or where the worker
/// that handed it back left off).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Submit {
    pub job: Job,
    pub first_seq: u64,
}

/// A stopping worker's: removes the requests not started yet (only `Queued` sent) and answers
/// their ids with the `seq` their next event must have, for another worker to go on from.
#[derive(Message)]
#[rtype(result = "Vec<HandedBack>")]
pub struct HandBack;

/// A job handed back unstarted, and the `seq` its next event must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedBack {
    pub request_id: String,
    pub next_seq: u64,
}

impl<E: WorkerExecutor + Unpin + 'static> Handler<HandBack> for SchedulerActor<E> {
    type Result = Vec<HandedBack>;
    fn handle(&mut self, _: HandBack, _: &mut Context<Self>) -> Self::Result {
        // A job's samples are taken together or not at all (see `Scheduler::take_waiting`).
        let taken = self.scheduler.take_waiting();
        let mut back = vec![];
        for id in taken {
            let Some(m) = self.meta.remove(&id) else {
                continue;
            };
            if let Some(job) = self.jobs.get_mut(&m.request_id) {
                job.ids.retain(|x| *x != id);
                if job.ids.is_empty() {
                    let seq = job.seq;
                    self.jobs.remove(&m.request_id);
                    back.push(HandedBack {
                        request_id: m.request_id,
                        next_seq: seq,
                    });
                }
            }
        }
        self.refresh_snapshot();
        back
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct CancelRequest(pub String);

#[derive(Message)]
#[rtype(result = "WorkerStatus")]
pub struct GetStatus;

/// Drops every cached prefix; answers with the bytes freed.
#[derive(Message)]
#[rtype(result = "u64")]
pub struct ClearPrefixCache;

impl<E: WorkerExecutor + Unpin + 'static> Handler<Submit> for SchedulerActor<E> {
    type Result = AtomicResponse<Self, ()>;
    fn handle(&mut self, Submit { job, first_seq }: Submit, _: &mut Context<Self>) -> Self::Result {
        if self.jobs.contains_key(&job.request_id) {
            return AtomicResponse::new(Box::pin(actix::fut::ready(()))); // a duplicate delivery of a job already running here
        }
        // One scheduler request per sample; the first prefills the prompt, the others wait for
        // it and find its KV in the prefix cache.
        let n = job.n.clamp(1, llmq_protocol::MAX_CHOICES);
        let ids: Vec<ReqId> = (0..n as ReqId).map(|i| self.next_id + i).collect();
        self.next_id += n as ReqId;
        for (choice, &id) in ids.iter().enumerate() {
            self.meta.insert(
                id,
                Meta {
                    request_id: job.request_id.clone(),
                    choice: choice as u32,
                },
            );
        }
        self.jobs.insert(
            job.request_id.clone(),
            JobStream {
                subject: job.stream_subject.clone(),
                seq: first_seq,
                ids: ids.clone(),
            },
        );
        let end_all = |error: WireError| {
            ids.iter()
                .map(|&id| Emit {
                    id,
                    event: Event::Error {
                        error: error.clone(),
                    },
                })
                .collect::<Vec<_>>()
        };
        if self.cancelled.take(&job.request_id) {
            self.publish(end_all(WireError::new(
                ErrorClass::Cancelled,
                "cancelled before it started",
            )));
            return AtomicResponse::new(Box::pin(actix::fut::ready(())));
        }
        let admissions: Vec<Admission> = ids
            .iter()
            .map(|&id| Admission {
                id,
                prompt_tokens: job.prompt_ids.len(),
                max_tokens: job.stop.max_tokens as usize,
                accepted_at: Duration::from_millis(job.accepted_at_ms),
                after: (id != ids[0]).then_some(ids[0]),
            })
            .collect();
        if let Some(error) = self.scheduler.refusal(&admissions[0]) {
            self.publish(end_all(error));
            return AtomicResponse::new(Box::pin(actix::fut::ready(())));
        }
        let specs: Vec<SeqSpec> = (0..n).map(|i| SeqSpec::sample(&job, i)).collect();
        self.exchange(
            (),
            move |mut executor| async move {
                let mut results = vec![];
                for (&id, spec) in ids.iter().zip(specs) {
                    let registered = AssertUnwindSafe(executor.register(id, spec))
                        .catch_unwind()
                        .await;
                    if !matches!(registered, Ok(Ok(()))) {
                        // Whatever the executor made of it goes.
                        executor.release(&[id]).await;
                    }
                    results.push(registered);
                }
                (executor, results)
            },
            move |results, act, ctx| {
                let mut emits = vec![];
                for (registered, admission) in results.into_iter().zip(admissions) {
                    let id = admission.id;
                    match registered {
                        Ok(Ok(())) => emits.extend(act.scheduler.submit(admission)),
                        Ok(Err(error)) => emits.push(Emit {
                            id,
                            event: Event::Error { error },
                        }),
                        Err(_) => emits.push(Emit {
                            id,
                            event: Event::Error {
                                error: WireError::new(
                                    ErrorClass::Internal,
                                    "worker fault while registering",
                                ),
                            },
                        }),
                    }
                }
                act.publish(emits);
                act.schedule_tick(ctx);
            },
        )
    }
}

impl<E: WorkerExecutor + Unpin + 'static> Handler<CancelRequest> for SchedulerActor<E> {
    type Result = ();
    fn handle(&mut self, CancelRequest(request_id): CancelRequest, ctx: &mut Context<Self>) {
        if let Some(job) = self.jobs.get(&request_id) {
            for &id in &job.ids {
                self.scheduler.cancel(id);
            }
            self.schedule_tick(ctx);
        } else {
            self.cancelled
                .remember(request_id, std::time::Instant::now());
        }
    }
}

/// Ends every request held here with `0` (the worker is stopping and its grace period is
/// over); each still gets exactly one terminal event.
#[derive(Message)]
#[rtype(result = "()")]
pub struct EndAll(pub WireError);

impl<E: WorkerExecutor + Unpin + 'static> Handler<EndAll> for SchedulerActor<E> {
    type Result = ();
    fn handle(&mut self, EndAll(error): EndAll, ctx: &mut Context<Self>) {
        self.scheduler.end_all(&error);
        self.schedule_tick(ctx);
    }
}

impl<E: WorkerExecutor + Unpin + 'static> Handler<Tick> for SchedulerActor<E> {
    type Result = AtomicResponse<Self, ()>;
    fn handle(&mut self, _: Tick, _: &mut Context<Self>) -> Self::Result {
        self.tick_pending = false;
        let started = std::time::Instant::now();
        if let Some(prev) = self.tick_started.replace(started) {
            self.tick_wall += started - prev;
        }
        self.ticks += 1;
        let now = now();
        // The policy's state goes with the exchange and comes back with it.
        let mut scheduler = std::mem::take(&mut self.scheduler);
        self.exchange(
            (),
            move |mut executor| async move {
                let ticked = AssertUnwindSafe(scheduler.tick(&mut executor, now))
                    .catch_unwind()
                    .await;
                if ticked.is_err() {
                    executor.reset().await;
                }
                (executor, (scheduler, ticked))
            },
            move |(scheduler, ticked), act, ctx| {
                act.scheduler = scheduler;
                match ticked {
                    Ok((emits, report)) => {
                        act.log_tick(started, &report);
                        act.publish(emits)
                    }
                    Err(p) => act.recover(&panic_text(p)),
                }
                if act.scheduler.is_idle() {
                    if let Some(s) = act.tick_started.take() {
                        act.tick_wall += s.elapsed();
                    }
                }
                act.schedule_tick(ctx);
            },
        )
    }
}

impl<E: WorkerExecutor + Unpin + 'static> SchedulerActor<E> {
    /// Warns of a stall, and writes the tick's line to the tick log if there is one.
    fn log_tick(&mut self, started: std::time::Instant, report: &TickReport) {
        // A stall: a tick four times slower than the recent ones (and over 100 ms).
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        if ms > 100.0 && self.tick_ema_ms > 0.0 && ms > 4.0 * self.tick_ema_ms {
            tracing::warn!(
                ms,
                usual_ms = self.tick_ema_ms,
                decoded = report.decoded,
                prefill_tokens = report.prefill_tokens,
                "slow tick"
            );
        }
        self.tick_ema_ms = if self.tick_ema_ms == 0.0 {
            ms
        } else {
            0.9 * self.tick_ema_ms + 0.1 * ms
        };
        if let Some(log) = self.tick_log.as_mut() {
            log.write(
                started,
                ms,
                report,
                self.executor.as_ref().and_then(|e| e.last_step()),
            );
        }
    }
}

impl<E: WorkerExecutor + Unpin + 'static> Handler<GetStatus> for SchedulerActor<E> {
    type Result = MessageResult<GetStatus>;
    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.status())
    }
}

impl<E: WorkerExecutor + Unpin + 'static> Handler<ClearPrefixCache> for SchedulerActor<E> {
    type Result = AtomicResponse<Self, u64>;
    fn handle(&mut self, _: ClearPrefixCache, _: &mut Context<Self>) -> Self::Result {
        self.exchange(
            0,
            |mut executor| async move {
                let freed = executor.prefix_clear().await;
                (executor, freed)
            },
            |freed, act, _| {
                act.refresh_snapshot();
                freed
            },
        )
    }
}
