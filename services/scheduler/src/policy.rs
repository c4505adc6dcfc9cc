//! The scheduler: the device's clock. Each `tick`:
//!
//! 1. cancellations are applied (queued, mid-prefill or decoding), freeing KV memory;
//! 2. waiting requests are admitted while the KV budget and the batch limit allow; an admitted
//!    request's prompt is looked up in the prefix cache and its prefill starts after the reused
//!    tokens;
//! 3. exactly one prefill chunk is chosen, for one request: `prefill_chunk` tokens while
//!    anything decodes (ending on a multiple of `prefill_chunk`, so a prefix hit off that grid
//!    is first brought back onto it), `idle_prefill_chunk` when nothing does (the idle fast
//!    path); a chunk
//!    the executor has part-way through (its layers spread over ticks: [`Prefilled::Pending`]) is
//!    granted again until it is done; with a `tick_budget`, a chunk beside decoding streams is
//!    sized to it from measured tick times instead (`budget`);
//! 4. the active decode batch steps once and the chunk is prefilled, in one executor call (the
//!    real executor runs both in one pass over the weights); every running stream's token is
//!    delivered first. A request whose prompt completes joins the decode batch at the next
//!    tick; its first token comes with the chunk that completed the prompt or, from an executor
//!    that ran that chunk in a step queued ahead, with its first decode step.
//!
//! Prefill order: shortest remaining prompt first, with aging (a request's remaining tokens
//! count down by `aging_tokens_per_s` for every second it has waited), so short prompts do not
//! wait behind a long one and a long one is not starved.
//!
//! Memory: the KV budget is a pool of blocks of `block_tokens` positions ([`BlockPool`]). A
//! request is admitted when the blocks for its prompt plus `lookahead_tokens` (plus, for a model
//! with recurrent layers, `state_tokens`: its state's bytes counted as positions) are free, not
//! for what it might generate; a decoding sequence's table grows a block at a time, before the step
//! that needs it. When the pool cannot grow a sequence, the request that arrived last among
//! those running is preempted: its blocks are freed, the executor keeps its state
//! ([`Executor::preempt`]), and it waits again in its arrival place, to be prefilled anew from
//! its prompt and the tokens it generated (through the prefix cache where that kept them), so
//! its stream sees only a longer gap. The oldest request is never preempted for a younger one,
//! so requests finish in arrival order however small the pool; one alone that outgrows the
//! whole pool ends with `length`. No request is admitted in a tick that preempted.
//!
//! Invariants: every admitted request ends with exactly one terminal event (`Done` or `Error`);
//! a request holds blocks from admission until it ends or is preempted, so after all requests
//! end no block is held; a request whose prompt could never fit the pool is refused at once.
//! The prefix cache lives in what the tables leave: it is trimmed (least recently used first)
//! to the free blocks' bytes after every admission and tick. The scheduler never touches a
//! model: [`Executor`] does the work, so the policy is tested against a fake executor and a
//! fake clock.

use std::collections::HashMap;
use std::time::Duration;

use llmq_protocol::{ErrorClass, Event, FinishReason, Timings, Usage, WireError};

use crate::blocks::BlockPool;
use crate::budget::ChunkSizer;
use crate::executor::{Executor, PrefillResult, Prefilled, ReqId, StepOut};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Prefill tokens granted per tick while streams are decoding.
    pub prefill_chunk: usize,
    /// Prefill tokens granted per tick when nothing decodes.
    pub idle_prefill_chunk: usize,
    /// Most sequences decoding and prefilling at once.
    pub max_batch: usize,
    /// KV memory the pool's blocks take, in all.
    pub kv_budget_bytes: u64,
    /// KV bytes one token takes in every layer (keys and values).
    pub kv_bytes_per_token: u64,
    /// Positions per KV block.
    pub block_tokens: usize,
    /// Positions a running sequence holds beyond the tokens it has: the next step's write and
    /// one step the executor may run ahead.
    pub lookahead_tokens: usize,
    /// Positions' worth of KV a running sequence's recurrent state takes (a hybrid model's
    /// convolution and DeltaNet states, whatever its length; 0 for attention alone): its table
    /// holds blocks for them beside its tokens, so states count in the same pool.
    pub state_tokens: usize,
    /// Aging of waiting prefills, in prompt tokens per second waited.
    pub aging_tokens_per_s: f64,
    /// False: the synchronous baseline, whole prompts prefilled in one go even while streams
    /// decode (what interleaving is measured against).
    pub interleave: bool,
    /// False: static batching, the baseline of the `static` benchmark: a new batch is admitted
    /// only when the previous one has entirely finished.
    pub continuous: bool,
    /// Time a tick carrying a prefill chunk may take, as a multiple of a decode-only tick: the
    /// chunk is sized to it, between `min_prefill_chunk` and `prefill_chunk` tokens (see
    /// `budget`). 0: every chunk beside decoding streams is `prefill_chunk` tokens.
    pub tick_budget: f64,
    /// The smallest chunk the tick budget sizes down to.
    pub min_prefill_chunk: usize,
    /// A prompt's last token is prefilled in a chunk of its own: the chunk before ends one
    /// token short of the prompt, where a hybrid model's executor keeps its recurrent states,
    /// so that the same prompt sent again resumes there (a state serves only its own length,
    /// and the last token is always computed for the first output token's logits).
    pub last_token_apart: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            prefill_chunk: 256,
            idle_prefill_chunk: 4096,
            max_batch: 64,
            kv_budget_bytes: 4 << 30,
            kv_bytes_per_token: 1,
            block_tokens: 64,
            lookahead_tokens: 2,
            state_tokens: 0,
            aging_tokens_per_s: 1000.0,
            interleave: true,
            continuous: true,
            tick_budget: 0.0,
            min_prefill_chunk: 128,
            last_token_apart: false,
        }
    }
}

impl SchedulerConfig {
    /// The sizes prefill chunks take beside decoding streams: those the tick budget chooses
    /// from, or the one fixed size.
    pub fn chunk_sizes(&self) -> Vec<usize> {
        if self.tick_budget > 0.0 {
            ChunkSizer::sizes(self.min_prefill_chunk, self.prefill_chunk)
        } else {
            vec![self.prefill_chunk]
        }
    }
}

#[derive(Debug, Clone)]
pub struct Admission {
    pub id: ReqId,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// When intake accepted it, on the scheduler's clock.
    pub accepted_at: Duration,
    /// Another sample of the same prompt: admitted only once that request's prompt is
    /// complete (or it has ended), so that its prompt's KV is found in the prefix cache.
    pub after: Option<ReqId>,
}

#[derive(Debug)]
struct Req {
    a: Admission,
    /// Tokens to prefill: the prompt, or after a preemption the prompt and the tokens generated
    /// before it.
    target: usize,
    /// Times preempted.
    preempted: u32,
    prefilled: usize,
    /// Prompt tokens reused from the prefix cache (known at admission).
    cached: usize,
    completion: usize,
    admitted_at: Option<Duration>,
    first_token_at: Option<Duration>,
}

impl Req {
    fn remaining(&self) -> usize {
        self.target - self.prefilled
    }
    /// Tokens it has: its prompt and those it generated.
    fn tokens(&self) -> usize {
        self.a.prompt_tokens + self.completion
    }
    /// Arrival order: the oldest request first.
    fn arrival(&self) -> (Duration, ReqId) {
        (self.a.accepted_at, self.a.id)
    }
}

/// An event for one request, in the order it must be published.
#[derive(Debug, Clone, PartialEq)]
pub struct Emit {
    pub id: ReqId,
    pub event: Event,
}

/// What a tick did, for metrics and benchmarks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TickReport {
    pub decoded: usize,
    pub prefill_tokens: usize,
    pub prefill_request: Option<ReqId>,
    /// That request's prompt tokens done after the chunk.
    pub prefill_done: usize,
    /// Requests preempted in this tick.
    pub preempted: usize,
}

#[derive(Default)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    reqs: HashMap<ReqId, Req>,
    /// Not admitted yet, in arrival order.
    waiting: Vec<ReqId>,
    /// Admitted, prompt not complete.
    prefilling: Vec<ReqId>,
    /// In the decode batch, in join order.
    decoding: Vec<ReqId>,
    /// Requests to end at the next tick, with the error each ends with.
    cancels: HashMap<ReqId, WireError>,
    pool: BlockPool,
    /// Preemptions since start.
    preemptions: u64,
    /// Preempted in this tick, not yet told to the executor.
    to_preempt: Vec<ReqId>,
    /// Ended, not yet released in the executor.
    ended: Vec<ReqId>,
    /// The chunk the executor has part-way through ([`Prefilled::Pending`]): granted again until
    /// it is done, so only one prefill advances at a time.
    in_flight: Option<(ReqId, usize)>,
    sizer: ChunkSizer,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        let sizer = ChunkSizer::new(cfg.tick_budget, cfg.min_prefill_chunk, cfg.prefill_chunk);
        let block_tokens = cfg.block_tokens.max(1);
        let block_bytes = (block_tokens as u64 * cfg.kv_bytes_per_token).max(1);
        let pool = BlockPool::new((cfg.kv_budget_bytes / block_bytes) as usize, block_tokens);
        Scheduler {
            cfg,
            sizer,
            pool,
            ..Default::default()
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The block pool's books.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Positions a running sequence's table covers with `tokens` of its own: them, the
    /// lookahead and its recurrent state's worth.
    fn need(&self, tokens: usize) -> usize {
        tokens + self.cfg.lookahead_tokens + self.cfg.state_tokens
    }

    fn block_bytes(&self) -> u64 {
        self.pool.block_tokens() as u64 * self.cfg.kv_bytes_per_token
    }

    /// Why a request can never run here (its prompt could never fit the pool, or it is empty),
    /// if so.
    pub fn refusal(&self, a: &Admission) -> Option<WireError> {
        let need = self.pool.blocks_for(self.need(a.prompt_tokens));
        if a.prompt_tokens == 0 {
            Some(WireError::new(ErrorClass::InvalidRequest, "empty prompt"))
        } else if need > self.pool.total() {
            Some(WireError::new(
                ErrorClass::NeverFits,
                format!(
                    "a prompt of {} tokens needs {need} KV blocks of {} positions, more than \
                     the worker's whole pool of {}",
                    a.prompt_tokens,
                    self.pool.block_tokens(),
                    self.pool.total()
                ),
            ))
        } else {
            None
        }
    }

    /// Queues a request. Returns its first events: `Queued`, or an `Error` for a request that
    /// could never run (see `refusal`; it is then already finished).
    pub fn submit(&mut self, a: Admission) -> Vec<Emit> {
        let id = a.id;
        if let Some(error) = self.refusal(&a) {
            return vec![Emit {
                id,
                event: Event::Error { error },
            }];
        }
        let position = self.waiting.len() as u32;
        self.reqs.insert(
            id,
            Req {
                target: a.prompt_tokens,
                preempted: 0,
                a,
                prefilled: 0,
                cached: 0,
                completion: 0,
                admitted_at: None,
                first_token_at: None,
            },
        );
        self.waiting.push(id);
        vec![Emit {
            id,
            event: Event::Queued { position },
        }]
    }

    /// Marks a request for cancellation; it is dropped at the start of the next tick.
    /// Returns false when the scheduler does not hold it.
    pub fn cancel(&mut self, id: ReqId) -> bool {
        if self.reqs.contains_key(&id) {
            self.cancels.entry(id).or_insert_with(|| {
                WireError::new(ErrorClass::Cancelled, "cancelled by the client")
            });
            true
        } else {
            false
        }
    }

    /// Ends every request held, at the next tick, with `error` (a worker that stops before
    /// finishing them); a request already being cancelled keeps its own error.
    pub fn end_all(&mut self, error: &WireError) {
        for &id in self.reqs.keys() {
            self.cancels.entry(id).or_insert_with(|| error.clone());
        }
    }

    /// Removes the requests not admitted yet (they have had no event but `Queued`) and returns
    /// them, in arrival order: a stopping worker hands them back to the jobs stream.
    pub fn take_waiting(&mut self) -> Vec<ReqId> {
        // Those being cancelled stay, to end with their own error; so do samples whose first
        // sample runs here (they share its prompt), and preempted requests (their streams have
        // begun).
        let mut taken: Vec<ReqId> = vec![];
        let mut keep = vec![];
        for &id in &self.waiting {
            let after = self.reqs[&id].a.after;
            let leader_stays =
                after.is_some_and(|l| self.reqs.contains_key(&l) && !taken.contains(&l));
            if self.cancels.contains_key(&id) || leader_stays || self.reqs[&id].preempted > 0 {
                keep.push(id);
            } else {
                taken.push(id);
            }
        }
        self.waiting = keep;
        for id in &taken {
            self.reqs.remove(id);
        }
        taken
    }

    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty()
    }
    pub fn active_streams(&self) -> usize {
        self.decoding.len()
    }
    pub fn queued_requests(&self) -> usize {
        self.waiting.len() + self.prefilling.len()
    }
    pub fn queued_prefill_tokens(&self) -> u64 {
        self.waiting
            .iter()
            .chain(&self.prefilling)
            .map(|id| self.reqs[id].remaining() as u64)
            .sum()
    }
    /// KV bytes in the blocks requests hold.
    pub fn held_kv_bytes(&self) -> u64 {
        self.pool.used() as u64 * self.block_bytes()
    }
    /// Requests preempted since start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Ends a request: its blocks are returned at once, and the executor frees what it holds
    /// for it at the next `release_ended` (before any more work is handed out).
    fn finish(&mut self, id: ReqId, event: Event, out: &mut Vec<Emit>) {
        if self.reqs.remove(&id).is_some() {
            self.pool.release(id);
            self.waiting.retain(|&x| x != id);
            self.prefilling.retain(|&x| x != id);
            self.decoding.retain(|&x| x != id);
            if self.in_flight.is_some_and(|(f, _)| f == id) {
                self.in_flight = None;
            }
            self.ended.push(id);
            out.push(Emit { id, event });
        }
    }

    /// Tells the executor to free the requests ended since the last call, in one call.
    async fn release_ended(&mut self, executor: &mut impl Executor) {
        if !self.ended.is_empty() {
            let ids = std::mem::take(&mut self.ended);
            executor.release(&ids).await;
        }
    }

    fn done_event(&self, id: ReqId, reason: FinishReason, now: Duration) -> Event {
        let r = &self.reqs[&id];
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        // A preempted request's usage counts its prompt once, and what the prefix cache gave
        // it at its first admission.
        let acc = r.a.accepted_at;
        Event::Done {
            finish_reason: reason,
            usage: Usage {
                prompt: r.a.prompt_tokens as u32,
                completion: r.completion as u32,
                cached: r.cached as u32,
            },
            timings: Timings {
                queue_ms: ms(r.admitted_at.unwrap_or(now).saturating_sub(acc)),
                ttft_ms: ms(r.first_token_at.unwrap_or(now).saturating_sub(acc)),
                total_ms: ms(now.saturating_sub(acc)),
            },
        }
    }

    /// Handles one sequence's output: a Tokens event, then Done if it finished.
    fn deliver(&mut self, id: ReqId, step: StepOut, now: Duration, out: &mut Vec<Emit>) {
        let finished = step.finished;
        if let Some(r) = self.reqs.get_mut(&id) {
            r.completion += step.ids.len();
            r.first_token_at.get_or_insert(now);
        }
        if !step.ids.is_empty() || !step.text.is_empty() {
            out.push(Emit {
                id,
                event: Event::Tokens {
                    ids: step.ids,
                    text: step.text,
                    logprobs: step.logprobs,
                },
            });
        }
        if let Some(reason) = finished {
            let ev = self.done_event(id, reason, now);
            self.finish(id, ev, out);
        }
    }

    /// One turn of the clock. `now` is the scheduler clock's time.
    pub async fn tick(
        &mut self,
        executor: &mut impl Executor,
        now: Duration,
    ) -> (Vec<Emit>, TickReport) {
        let mut out = Vec::new();
        let mut report = TickReport::default();
        self.sizer.tick_started(now);

        // 1. cancellations
        for (id, error) in std::mem::take(&mut self.cancels) {
            self.finish(id, Event::Error { error }, &mut out);
        }
        self.release_ended(executor).await;

        // 2. the decode batch's tables grow for this step, preempting the youngest where the
        //    pool runs out; then admission, in arrival order, within the free blocks and the
        //    batch limit (none in a tick that preempted: memory is short)
        report.preempted = self.grow_tables(now, &mut out);
        self.release_ended(executor).await;
        if report.preempted > 0 {
            let ids = std::mem::take(&mut self.to_preempt);
            executor.preempt(&ids).await;
        } else {
            self.admit_waiting(executor, now, &mut out).await;
        }

        // 3. exactly one prefill chunk, to one request: the one in flight, or a new one
        let in_flight = self
            .in_flight
            .take()
            .filter(|(id, _)| self.prefilling.contains(id));
        let chunk =
            in_flight.or_else(|| self.pick_prefill(now).map(|id| (id, self.chunk_size(id))));
        let prefill_at = chunk
            .and_then(|(id, _)| self.reqs.get(&id))
            .map_or(0, |r| r.prefilled);

        // 4. the work: the decode batch steps (its tokens are delivered first), and the chunk
        //    is prefilled, in one executor call
        let ids = self.decoding.clone();
        let (results, prefilled) = executor.step(&ids, chunk).await;
        report.decoded = ids.len();
        for (id, res) in ids.into_iter().zip(results) {
            match res {
                Ok(step) => self.deliver(id, step, now, &mut out),
                Err(error) => self.finish(id, Event::Error { error }, &mut out),
            }
        }
        if let (Some((id, n)), Some(result)) = (chunk, prefilled) {
            report.prefill_tokens = n;
            report.prefill_request = Some(id);
            report.prefill_done = self.prefilled(id, n, result, now, &mut out);
        }
        self.release_ended(executor).await;
        // Sequences that ended or completed their prompt this tick were remembered.
        executor.prefix_trim(self.free_kv_bytes()).await;
        self.sizer.tick_ended(
            now,
            report.decoded,
            report.prefill_tokens,
            prefill_at,
            !self.is_idle(),
        );
        (out, report)
    }

    fn free_kv_bytes(&self) -> u64 {
        self.pool.free() as u64 * self.block_bytes()
    }

    /// Grows each decoding sequence's table to hold its tokens and the lookahead, oldest
    /// first; where the pool runs short, preempts the youngest running request (possibly the
    /// one growing) until it fits, and ends a sequence that the whole pool cannot hold with
    /// `length`. Returns the requests preempted.
    fn grow_tables(&mut self, now: Duration, out: &mut Vec<Emit>) -> usize {
        let mut order = self.decoding.clone();
        order.sort_by_key(|id| self.reqs[id].arrival());
        let mut preempted = 0;
        for id in order {
            while let Some(r) = self.reqs.get(&id).filter(|_| self.decoding.contains(&id)) {
                let need = self.need(r.tokens());
                if self.pool.reserve(id, need).is_ok() {
                    break;
                }
                let victim = self
                    .decoding
                    .iter()
                    .chain(&self.prefilling)
                    .copied()
                    .max_by_key(|v| self.reqs[v].arrival())
                    .expect("the growing sequence runs");
                if victim == id && self.decoding.len() + self.prefilling.len() == 1 {
                    let ev = self.done_event(id, FinishReason::Length, now);
                    self.finish(id, ev, out);
                    break;
                }
                self.preempt(victim);
                preempted += 1;
            }
        }
        preempted
    }

    /// Takes a running request back to the waiting queue, in its arrival place, with its
    /// blocks freed: it will be prefilled again from its prompt and the tokens it generated.
    fn preempt(&mut self, id: ReqId) {
        self.pool.release(id);
        self.decoding.retain(|&x| x != id);
        self.prefilling.retain(|&x| x != id);
        if self.in_flight.is_some_and(|(f, _)| f == id) {
            self.in_flight = None;
        }
        let r = self.reqs.get_mut(&id).expect("running ids are held");
        r.target = r.tokens();
        r.prefilled = 0;
        r.preempted += 1;
        let arrival = r.arrival();
        let at = self
            .waiting
            .partition_point(|w| self.reqs[w].arrival() < arrival);
        self.waiting.insert(at, id);
        self.to_preempt.push(id);
        self.preemptions += 1;
    }

    /// Admits waiting requests in arrival order while the KV budget and the batch limit allow
    /// (none behind one that does not fit); tells the rest their new places.
    async fn admit_waiting(
        &mut self,
        executor: &mut impl Executor,
        now: Duration,
        out: &mut Vec<Emit>,
    ) {
        let mut still_waiting = Vec::new();
        // A sample waits for its first sample's prompt (see `Admission::after`) without
        // holding up those behind it.
        let unfinished: std::collections::HashSet<ReqId> = self
            .waiting
            .iter()
            .chain(&self.prefilling)
            .copied()
            .collect();
        let mut blocked = false;
        let batch_open =
            self.cfg.continuous || (self.decoding.is_empty() && self.prefilling.is_empty());
        for id in std::mem::take(&mut self.waiting) {
            if self.reqs[&id]
                .a
                .after
                .is_some_and(|l| unfinished.contains(&l))
            {
                still_waiting.push(id);
                continue;
            }
            let need = self.need(self.reqs[&id].target);
            let running = self.decoding.len() + self.prefilling.len();
            if batch_open
                && !blocked
                && running < self.cfg.max_batch
                && self.pool.reserve(id, need).is_ok()
            {
                let cached = executor
                    .admit(id)
                    .await
                    .min(self.reqs[&id].target.saturating_sub(1));
                let r = self.reqs.get_mut(&id).expect("waiting ids are held");
                r.admitted_at.get_or_insert(now);
                r.prefilled = cached;
                if r.preempted == 0 {
                    r.cached = cached;
                }
                self.prefilling.push(id);
                executor.prefix_trim(self.free_kv_bytes()).await;
            } else {
                blocked = true;
                still_waiting.push(id);
            }
        }
        if still_waiting.len() != self.waiting.len() {
            for (pos, &id) in still_waiting.iter().enumerate() {
                // A preempted request's stream has begun: it sees a longer gap, nothing else.
                if self.reqs[&id].preempted > 0 {
                    continue;
                }
                out.push(Emit {
                    id,
                    event: Event::Queued {
                        position: pos as u32,
                    },
                });
            }
        }
        self.waiting = still_waiting;
    }

    /// The tokens of `id`'s next chunk: the rest of its prompt when not interleaving, a large
    /// step when nothing decodes, else sized to the tick budget or one chunk on its grid; with
    /// `last_token_apart`, never the prompt's last token beside others.
    fn chunk_size(&self, id: ReqId) -> usize {
        let remaining = self.reqs[&id].remaining();
        let n = self.chunk_size_within(id, remaining);
        if self.cfg.last_token_apart && n == remaining && n > 1 {
            n - 1
        } else {
            n
        }
    }

    fn chunk_size_within(&self, id: ReqId, remaining: usize) -> usize {
        if !self.cfg.interleave {
            remaining
        } else if self.decoding.is_empty() {
            remaining.min(self.cfg.idle_prefill_chunk)
        } else if self.sizer.enabled() {
            self.sizer.size(self.reqs[&id].prefilled, remaining)
        } else {
            // On the grid of its own size: a chunk after a prefix hit off that grid first
            // brings the prompt back onto it, so a GPU meets the shapes it planned at warm-up.
            let at = self.reqs[&id].prefilled % self.cfg.prefill_chunk.max(1);
            remaining.min(self.cfg.prefill_chunk - at)
        }
    }

    /// Takes the outcome of `id`'s chunk of `n` tokens: progress, and on its prompt's end the
    /// move to the decode batch (with the first token when the executor gave it). Returns the
    /// prompt tokens done.
    fn prefilled(
        &mut self,
        id: ReqId,
        n: usize,
        result: PrefillResult,
        now: Duration,
        out: &mut Vec<Emit>,
    ) -> usize {
        match result {
            Ok(Prefilled::Pending) => {
                let r = self.reqs.get(&id).map_or(0, |r| r.prefilled);
                if self.reqs.contains_key(&id) {
                    self.in_flight = Some((id, n));
                }
                r
            }
            Ok(Prefilled::Done(first)) if self.reqs.contains_key(&id) => {
                let r = self.reqs.get_mut(&id).expect("checked");
                r.prefilled += n;
                let (done, total) = (r.prefilled as u32, r.target as u32);
                // A resumed request's stream sees no prefill again, only a longer gap.
                if r.preempted == 0 {
                    out.push(Emit {
                        id,
                        event: Event::PrefillProgress { done, total },
                    });
                }
                if done == total {
                    self.prefilling.retain(|&x| x != id);
                    self.decoding.push(id);
                    // Without a first token now, it comes from the next decode step.
                    if let Some(step) = first {
                        self.deliver(id, step, now, out);
                    }
                }
                done as usize
            }
            Ok(_) => 0,
            Err(error) => {
                self.finish(id, Event::Error { error }, out);
                0
            }
        }
    }

    /// Shortest remaining prefill first, aged by waiting time; ties go to the earlier arrival.
    fn pick_prefill(&self, now: Duration) -> Option<ReqId> {
        let key = |id: &ReqId| {
            let r = &self.reqs[id];
            let waited = now.saturating_sub(r.a.accepted_at).as_secs_f64();
            (
                r.remaining() as f64 - waited * self.cfg.aging_tokens_per_s,
                r.a.accepted_at,
                *id,
            )
        };
        self.prefilling
            .iter()
            .min_by(|a, b| {
                key(a)
                    .partial_cmp(&key(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
            .copied()
    }
}
