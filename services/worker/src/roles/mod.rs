//! The executor the scheduler drives ([`llmq_scheduler::Executor`]), made of the worker's three
//! role actors: [`prefill::PrefillActor`], [`decode::DecodeActor`] and [`cache::CacheActor`], all
//! on the device thread (MLX work of a worker runs on one thread; each actor still owns its
//! state and is reached only by messages). [`RoleActors`] turns the scheduler's calls into
//! their messages ([`messages`]: what they share):
//!
//! - register and admit: the prefill actor (which asks the cache actor for a cached prefix);
//! - a tick with decode rows: the granted chunk's sequence is lent by the prefill actor to the
//!   decode actor, which steps every row and runs the chunk in the same pass over the weights,
//!   and gives the sequence back unless the chunk completed its prompt (it then joins the
//!   decode batch there);
//! - a tick without decode rows: the prefill actor runs the chunk; a completed prompt's
//!   sequence moves to the decode actor (`Join`);
//! - releases go to both role actors (each forgets what it holds); trims to the cache actor;
//! - on a decode worker ([`crate::disaggregated::decode_side`]), a chunk of a request prefilled by a prefill worker is
//!   granted to it instead, and the KV that arrives is installed in the prefill actor.
//!
//! Invariants: every call waits for its answers, so the scheduler's next call sees their
//! effects; a lost actor (its mailbox closed) turns into internal errors for the requests of
//! the call, never a panic; the figures it reports are those of each actor's last answer.

pub mod cache;
pub mod decode;
pub mod messages;
pub mod prefill;

use actix::prelude::*;
use llmq_engine::prefix::PrefixCache;
use llmq_engine::Model;
use llmq_protocol::WireError;
use llmq_text::Tokenizer;

use crate::actor::{CallTimes, KvReceived, WorkerExecutor};
use crate::disaggregated::decode_side::{Install, Plan, RemotePrefill};
use crate::seq::{internal, MaskTimes, SeqSpec, Shared};
use cache::CacheActor;
use decode::{DecodeActor, Grant, Lent, Step};
use llmq_scheduler::{Executor, PrefillResult, Prefilled, ReqId, StepOut};
use messages::{ChunksAhead, Preempt, Release, Reply, Report, Reset, ResetCounters, StepTimes};
use prefill::{Chunked, PrefillActor};

/// How the role actors are set up.
#[derive(Debug, Clone)]
pub struct RoleOptions {
    /// Queue decode steps ahead on the device (see the decode actor's `Ahead`).
    pub decode_ahead: bool,
    /// The prefix cache; None: off.
    pub prefix: Option<PrefixOptions>,
    /// Steps a prefill chunk's layers are spread over at most while streams decode (1: every
    /// layer of a chunk in one step), and a chunk's tokens per step: a chunk of n tokens is
    /// spread over n / `stage_tokens` steps, rounded up, at most `chunk_stages`.
    pub chunk_stages: usize,
    pub stage_tokens: usize,
    /// With more than one stage, each step's share of a chunk is sized to this tick budget
    /// (0: off), down to `min_stage_tokens` tokens' worth (see `decode::Staging`).
    pub stage_budget: f64,
    pub min_stage_tokens: usize,
}

/// The prefix cache's shape: tokens per index block and the most bytes it may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixOptions {
    pub block_tokens: usize,
    pub max_bytes: u64,
}

impl Default for RoleOptions {
    fn default() -> Self {
        RoleOptions {
            decode_ahead: true,
            prefix: None,
            chunk_stages: 1,
            stage_tokens: 256,
            stage_budget: 0.0,
            min_stage_tokens: 128,
        }
    }
}

pub struct RoleActors {
    pub prefill: Addr<PrefillActor>,
    pub decode: Addr<DecodeActor>,
    pub cache: Addr<CacheActor>,
    context_tokens: usize,
    /// The last report of each actor.
    reports: Reports,
    /// The request whose chunk the decode actor has part-way through the model.
    staged: Option<ReqId>,
    /// How the decode actor spreads a chunk over steps.
    staging: decode::Staging,
    /// What constrained rows' masks have cost (the role actors add to it; same thread).
    mask_times: std::rc::Rc<std::cell::Cell<MaskTimes>>,
    /// Prefill by prefill workers (a decode worker's).
    remote: Option<RemotePrefill>,
    kv_layout: llmq_engine::kv_bytes::KvLayout,
    /// The actors keep a hybrid prompt's states one token before its end (see
    /// [`Shared::snapshot_at`]).
    last_token_apart: bool,
}

/// How long a tick with nothing else to do waits for a prefill worker's KV.
const REMOTE_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// One of the three role actors, naming whose report an answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
    Cache,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Cache => "cache",
        }
    }
}

/// The last report each role actor sent with an answer.
#[derive(Debug, Default)]
struct Reports {
    prefill: Report,
    decode: Report,
    cache: Report,
}

impl Reports {
    fn of(&mut self, role: Role) -> &mut Report {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
            Role::Cache => &mut self.cache,
        }
    }

    fn all(&self) -> [&Report; 3] {
        [&self.prefill, &self.decode, &self.cache]
    }
}

impl RoleActors {
    /// Starts the three actors on the current thread (the device thread) around `model`.
    pub fn start(model: Model, tokenizer: Option<Tokenizer>, opts: RoleOptions) -> Self {
        let kv_layout = model.kv_layout();
        let context_tokens = model.config.max_position_embeddings;
        // Hits in whole chunk-grid blocks, so that the chunks after one start on the grid (see
        // `Model::chunk_grid`).
        let cache = CacheActor::new(opts.prefix.map(|p| {
            PrefixCache::new(p.block_tokens, p.max_bytes).with_reuse_unit(model.chunk_grid())
        }))
        .start();
        let block = opts.prefix.map_or(1, |p| p.block_tokens);
        let shared = Shared::new(model, tokenizer, opts.prefix.is_some()).with_snapshots(block);
        let mask_times = shared.mask_times.clone();
        let last_token_apart = shared.snapshot_block.is_some();
        let prefill = PrefillActor::new(shared.clone(), cache.clone()).start();
        let staging = decode::Staging::new(
            &shared.model,
            opts.chunk_stages,
            opts.stage_tokens,
            opts.stage_budget,
            opts.min_stage_tokens,
        );
        let decode = DecodeActor::new(shared, cache.clone(), opts.decode_ahead, staging).start();
        RoleActors {
            prefill,
            decode,
            cache,
            context_tokens,
            reports: Default::default(),
            staged: None,
            staging,
            mask_times,
            remote: None,
            kv_layout,
            last_token_apart,
        }
    }

    /// Prompts are prefilled by prefill workers while one is live (a decode worker).
    pub fn with_remote_prefill(mut self, mut remote: RemotePrefill) -> Self {
        remote.set_kv_layout(self.kv_layout.to_string());
        self.remote = Some(remote);
        self
    }

    /// Writes a prefill worker's chunk into its request's cache.
    async fn install(&mut self, i: Install) {
        let Install {
            key,
            start,
            n,
            bytes,
            transfer,
        } = i;
        let layers =
            llmq_engine::kv_bytes::from_bytes(&bytes, &self.kv_layout, n).map_err(internal);
        let installed = match layers {
            Ok(layers) => {
                let answer = self
                    .prefill
                    .send(prefill::Install {
                        id: key,
                        start,
                        n,
                        layers,
                    })
                    .await;
                self.take(Role::Prefill, answer, Err)
            }
            Err(e) => Err(e),
        };
        if let Some(remote) = self.remote.as_mut() {
            match installed {
                Ok(()) => remote.installed(key, n, bytes.len(), transfer),
                Err(e) => remote.failed(key, e.message),
            }
        }
    }

    /// A tick's work on a decode worker: installs the KV that arrived; a chunk of a request
    /// prefilled remotely is granted to its prefill worker ([`Pending`] until computed), or run
    /// here (its last position, or all of it after a fallback).
    async fn step_with_remote(
        &mut self,
        ids: &[ReqId],
        chunk: Option<(ReqId, usize)>,
    ) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        let Some(remote) = self.remote.as_mut() else {
            return self.step_here(ids, chunk).await;
        };
        let remote_chunk = chunk.filter(|(id, _)| remote.is_remote(*id));
        // With nothing else to do this tick, wait a little for the prefill worker.
        let wait =
            (ids.is_empty() && remote_chunk.is_some() && remote.waiting()).then_some(REMOTE_POLL);
        for i in remote.arrived(wait).await {
            self.install(i).await;
        }
        let Some((id, n)) = remote_chunk else {
            return self.step_here(ids, chunk).await;
        };
        let plan = self
            .remote
            .as_mut()
            .map_or(Plan::Local(n), |r| r.plan(id, n));
        let prefilled = match plan {
            Plan::Local(m) => return self.step_here(ids, Some((id, m))).await,
            Plan::Pending => Prefilled::Pending,
            Plan::Done => Prefilled::Done(None),
        };
        let (outs, _) = self.step_here(ids, None).await;
        (outs, Some(Ok(prefilled)))
    }

    /// KV installed from prefill workers since start.
    pub fn kv_received(&self) -> KvReceived {
        self.remote
            .as_ref()
            .map_or(KvReceived::default(), |r| KvReceived {
                bytes: r.received_bytes,
                transfer_ms: r.transfer.as_secs_f64() * 1000.0,
            })
    }

    /// An answer's value, its report noted; a lost actor gives `lost`.
    fn take<T>(
        &mut self,
        role: Role,
        answer: Result<Reply<T>, MailboxError>,
        lost: impl FnOnce(WireError) -> T,
    ) -> T {
        match answer {
            Ok(r) => {
                *self.reports.of(role) = r.report;
                r.value
            }
            Err(e) => lost(internal(format!("{} actor lost: {e}", role.name()))),
        }
    }

    /// Requests held by the prefill and decode actors.
    pub fn held(&self) -> usize {
        self.reports.prefill.held + self.reports.decode.held
    }

    /// Prefill chunks run in a step queued ahead, and of those the ones that completed their
    /// prompt.
    pub fn chunks_queued_ahead(&self) -> ChunksAhead {
        self.reports.decode.chunks_ahead
    }

    /// Chunk stages that left their chunk part-way through the model (its layers spread over
    /// steps).
    pub fn stages_pending(&self) -> u64 {
        self.reports.decode.stages_pending
    }

    /// A chunk with no decode step beside it, run by the prefill actor; a completed prompt's
    /// sequence joins the decode batch.
    async fn prefill_alone(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError> {
        let answer = self.prefill.send(prefill::Chunk { id, n }).await;
        match self.take(Role::Prefill, answer, Err)? {
            Chunked::Partial => Ok(None),
            Chunked::Complete { first, seq } => {
                let answer = self.decode.send(decode::Join { id, seq }).await;
                self.take(Role::Decode, answer, Err)?;
                Ok(Some(first))
            }
        }
    }
}

impl Executor for RoleActors {
    async fn prefill(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError> {
        self.prefill_alone(id, n).await
    }

    async fn decode(&mut self, ids: &[ReqId]) -> Vec<Result<StepOut, WireError>> {
        self.step(ids, None).await.0
    }

    async fn step(
        &mut self,
        ids: &[ReqId],
        chunk: Option<(ReqId, usize)>,
    ) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        self.step_with_remote(ids, chunk).await
    }

    async fn release(&mut self, ids: &[ReqId]) {
        if let Some(remote) = self.remote.as_mut() {
            ids.iter().for_each(|&id| remote.forget(id));
        }
        self.release_here(ids).await
    }

    async fn preempt(&mut self, ids: &[ReqId]) {
        if let Some(remote) = self.remote.as_mut() {
            // It starts over here: its prompt is now its prompt and what it generated.
            ids.iter().for_each(|&id| remote.forget(id));
        }
        if self.staged.is_some_and(|s| ids.contains(&s)) {
            self.staged = None;
        }
        let ids = ids.to_vec();
        let answer = self
            .decode
            .send(Preempt {
                ids: ids.clone(),
                back: vec![],
            })
            .await;
        let back = self.take(Role::Decode, answer, |_| vec![]);
        let answer = self.prefill.send(Preempt { ids, back }).await;
        self.take(Role::Prefill, answer, |_| vec![]);
    }

    async fn admit(&mut self, id: ReqId) -> usize {
        // A prompt completed moments ago may be what this one starts with.
        if self.reports.decode.copies_pending > 0 {
            let answer = self.decode.send(decode::FinishCopies).await;
            self.take(Role::Decode, answer, |_| ());
        }
        let answer = self.prefill.send(prefill::Admit(id)).await;
        let reused = self.take(Role::Prefill, answer, |_| 0);
        if let Some(remote) = self.remote.as_mut() {
            remote.admitted(id, reused);
        }
        reused
    }

    async fn prefix_trim(&mut self, max_bytes: u64) -> u64 {
        let answer = self.cache.send(cache::Trim(max_bytes)).await;
        self.take(Role::Cache, answer, |_| 0)
    }
}

impl RoleActors {
    /// A tick's work on this worker's device: the decode step, and the chunk in the same pass.
    async fn step_here(
        &mut self,
        ids: &[ReqId],
        chunk: Option<(ReqId, usize)>,
    ) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        // A chunk part-way through the model goes on where it is, in the decode actor.
        let going_on = chunk.filter(|(id, _)| self.staged == Some(*id));
        if ids.is_empty() && going_on.is_none() {
            let pre = match chunk {
                Some((id, n)) => Some(self.prefill_alone(id, n).await.map(Prefilled::Done)),
                None => None,
            };
            return (vec![], pre);
        }
        let mut lend_error = None;
        let grant = match (chunk, going_on) {
            (_, Some((id, _))) => Some(Grant::Continue(id)),
            (Some((id, n)), None) => {
                let answer = self.prefill.send(prefill::Lend(id)).await;
                match self.take(Role::Prefill, answer, Err) {
                    Ok(seq) => Some(Grant::New(Lent { id, n, seq })),
                    Err(e) => {
                        lend_error = Some(e);
                        None
                    }
                }
            }
            (None, None) => None,
        };
        let answer = self
            .decode
            .send(Step {
                ids: ids.to_vec(),
                chunk: grant,
            })
            .await;
        let stepped = self.take(Role::Decode, answer, |e| decode::Stepped {
            outs: ids.iter().map(|_| Err(e.clone())).collect(),
            chunk: chunk.map(|_| (Err(e.clone()), None)),
        });
        self.staged = match (&stepped.chunk, chunk) {
            (Some((Ok(Prefilled::Pending), _)), Some((id, _))) => Some(id),
            _ => None,
        };
        let pre = match (stepped.chunk, chunk) {
            (Some((result, back)), Some((id, _))) => {
                if let Some(seq) = back {
                    let answer = self.prefill.send(prefill::Return { id, seq }).await;
                    self.take(Role::Prefill, answer, |_| ());
                }
                Some(result)
            }
            _ => lend_error.map(Err),
        };
        (stepped.outs, pre)
    }

    async fn release_here(&mut self, ids: &[ReqId]) {
        if self.staged.is_some_and(|s| ids.contains(&s)) {
            self.staged = None;
        }
        let answer = self.prefill.send(Release(ids.to_vec())).await;
        self.take(Role::Prefill, answer, |_| ());
        let answer = self.decode.send(Release(ids.to_vec())).await;
        self.take(Role::Decode, answer, |_| ());
    }
}

impl WorkerExecutor for RoleActors {
    async fn register(&mut self, id: ReqId, spec: SeqSpec) -> Result<(), WireError> {
        let remote = self
            .remote
            .as_ref()
            .map(|_| (spec.prompt.clone(), spec.salt.clone()));
        let answer = self.prefill.send(prefill::Register { id, spec }).await;
        self.take(Role::Prefill, answer, Err)?;
        if let (Some(r), Some((prompt, salt))) = (self.remote.as_mut(), remote) {
            r.register(id, &prompt, salt);
        }
        Ok(())
    }

    async fn reset(&mut self) {
        self.staged = None;
        if let Some(remote) = self.remote.as_mut() {
            remote.forget_all();
        }
        let answer = self.prefill.send(Reset).await;
        self.take(Role::Prefill, answer, |_| ());
        let answer = self.decode.send(Reset).await;
        self.take(Role::Decode, answer, |_| ());
    }

    /// KV bytes one token takes across all layers (keys and values).
    fn kv_bytes_per_token(&self) -> u64 {
        self.kv_layout.bytes(1) as u64
    }

    fn state_bytes_per_sequence(&self) -> u64 {
        self.kv_layout.chunk_bytes(0) as u64
    }

    fn last_token_apart(&self) -> bool {
        self.last_token_apart
    }

    /// KV bytes the actors held at their last answers.
    fn kv_bytes_in_use(&self) -> u64 {
        self.reports.all().into_iter().map(|r| r.kv_bytes).sum()
    }

    fn context_tokens(&self) -> usize {
        self.context_tokens
    }

    fn chunk_ticks(&self, n: usize) -> usize {
        self.staging.most_ticks(n)
    }

    /// Milliseconds of work in the three actors since start: prefill and decode calls, and the
    /// KV bookkeeping of admissions, joins, releases and prefix-cache trims.
    fn engine_ms(&self) -> f64 {
        self.reports.all().into_iter().map(|r| r.busy.ms()).sum()
    }

    fn mask_times(&self) -> MaskTimes {
        self.mask_times.get()
    }

    fn call_times(&self) -> CallTimes {
        let (p, d) = (&self.reports.prefill.busy, &self.reports.decode.busy);
        CallTimes {
            prefill_calls: p.calls,
            prefill_ms: p.ms(),
            decode_calls: d.calls,
            decode_ms: d.ms(),
        }
    }

    fn prefix_stats(&self) -> llmq_engine::prefix::PrefixStats {
        self.reports.cache.prefix
    }

    async fn prefix_clear(&mut self) -> u64 {
        let answer = self.cache.send(cache::Clear).await;
        self.take(Role::Cache, answer, |_| 0)
    }

    fn kv_received(&self) -> KvReceived {
        RoleActors::kv_received(self)
    }

    fn last_step(&self) -> Option<StepTimes> {
        Some(self.reports.decode.step)
    }

    async fn reset_counters(&mut self) {
        let answer = self.prefill.send(ResetCounters).await;
        self.take(Role::Prefill, answer, |_| ());
        let answer = self.decode.send(ResetCounters).await;
        self.take(Role::Decode, answer, |_| ());
        let answer = self.cache.send(ResetCounters).await;
        self.take(Role::Cache, answer, |_| ());
        self.mask_times.set(MaskTimes::default());
    }
}
