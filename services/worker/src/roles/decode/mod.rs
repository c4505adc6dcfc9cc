//! The decode actor: owns every request whose prompt is complete: the decode batches (rows
//! whose KV lives in a block pool; see `new_batches` for the length groups), each row's
//! sequence and sampler, and the decode step queued ahead on the device. Each [`Step`]
//! advances every row by one token; a sequence lent by the prefill actor rides in the same
//! pass over the weights for its chunk (and, when nothing needs the host in between, in the
//! step queued ahead). A sequence whose
//! prompt completes joins its batch here, by [`Join`] or in a [`Step`]; its prompt's KV goes
//! to the cache actor (on a CPU copied from its row a few layers a step: `copies`), as does a
//! sequence's KV when it is released.
//!
//! Invariants: a step feeds each row the token it sampled last; a join copies only the joining
//! sequence's own KV (no other row is padded or copied); a step queued ahead is always
//! consumed or waited for, never rolled back (its KV writes are real); a chunk part-way
//! through the model (its layers spread over steps) stays here until its last stage and is
//! never remembered as a prefix before; a panic in a handler drops the batches and every
//! sequence held here (those requests fail at their next step, the others go on) and never
//! escapes.

mod ahead;
mod chunk;
mod copies;
mod queued;
mod staging;
mod step;

use std::collections::HashMap;

use actix::prelude::*;
use llmq_engine::batch::DecodeBatch;
use llmq_engine::Model;
use llmq_protocol::WireError;
use llmq_scheduler::budget::ChunkSizer;
use llmq_scheduler::{PrefillResult, ReqId, StepOut};
use mlx_rs::Array;

use self::copies::Copies;
use self::queued::Ahead;
use self::staging::InFlight;
pub use self::staging::{chunk_stages, stages_for, Grant, Lent, Staging};
use crate::roles::cache::{CacheActor, Remember};
use crate::roles::messages::{
    ChunksAhead, InjectPanic, Preempt, Release, Reply, Report, Reset, ResetCounters, Stage,
    StepTimes,
};
use crate::seq::{guarded, internal, unknown, Busy, MasksAhead, Seq, Shared};

/// Length groups of the decode batches where a step attends through MLX (masked over the
/// longest row's keys, or row by row): a sequence joins the first group whose bound exceeds its
/// length (it stays there as it grows). Where llmq's attention reads each row's keys through
/// its table, one batch holds every row.
const GROUP_BOUNDS: [usize; 4] = [2048, 8192, 32768, usize::MAX];

/// Rows of a long length group (past the first) attend one by one while there are at most
/// this many: for a few long rows beside many short ones, that is faster than masked attention
/// over the group's capacity (measured on a GPU at the 8b shape).
const PER_ROW_UP_TO: usize = 8;

/// Steps slower than this are logged at debug level (with their parts), to find stalls.
const SLOW_MS: f64 = 80.0;

fn group_of(len: usize) -> usize {
    GROUP_BOUNDS
        .iter()
        .position(|&b| len < b)
        .unwrap_or(GROUP_BOUNDS.len() - 1)
}

pub struct DecodeActor {
    shared: Shared,
    cache: Addr<CacheActor>,
    seqs: HashMap<ReqId, Seq>,
    /// Decoding sequences as rows of decode batches, their KV in each batch's block pool: one
    /// batch where llmq's attention reads rows through their tables, else one per length group
    /// so that short sequences do not attend over the longest one's keys (None for models whose
    /// scores are soft-capped, whose sequences decode each against its own cache).
    batches: Option<Vec<DecodeBatch>>,
    /// rows[g][r]: the request in row r of group g.
    rows: Vec<Vec<ReqId>>,
    /// The next decode step, already queued on the device.
    ahead: Option<Ahead>,
    /// Constrained rows' next masks, being computed beside this thread: their matchers are
    /// away until `finish_masks` (the first thing a step does).
    masks_ahead: Option<MasksAhead>,
    /// Whether decode steps are queued ahead at all.
    decode_ahead: bool,
    chunks_ahead: ChunksAhead,
    /// Host time of the last step queued ahead's delivery (zeros for a synchronous one).
    times: StepTimes,
    /// The last queued step's host time building its graph and launching it (ms).
    launched: (f64, f64),
    busy: Busy,
    /// Requests dropped by a restart after a panic, with its message, until released: their
    /// steps fail with it while the other rows go on.
    lost: HashMap<ReqId, String>,
    /// How a chunk's layers are spread over steps while rows decode.
    staging: Staging,
    /// With a tick budget, sizes each step's share of a chunk from the steps' times (the
    /// interval from one [`Step`] to the next, while rows decode: the gap a stream sees).
    sizer: ChunkSizer,
    /// The work (tokens' worth) a stage of the current step carries.
    stage_work: usize,
    /// The origin of the sizer's clock.
    clock: std::time::Instant,
    /// The last step's chunk stage: layers run and the work it carried (0 without a stage).
    last_stage: Stage,
    /// The chunk part-way through the model, between two of its stages.
    staged: Option<InFlight>,
    /// Stages that left their chunk part-way (for tests and the tick log).
    stages_pending: u64,
    /// On a CPU, completed prompts copied for the prefix cache a few layers a step.
    copies: Option<Copies>,
}

/// One step of every decode row (`ids`: the scheduler's decode batch, each exactly once), with
/// the granted chunk (or its next stage) in the same pass when given.
#[derive(Message)]
#[rtype(result = "Reply<Stepped>")]
pub struct Step {
    pub ids: Vec<ReqId>,
    pub chunk: Option<Grant>,
}

pub struct Stepped {
    /// One result per id of the step, in order.
    pub outs: Vec<Result<StepOut, WireError>>,
    /// The chunk's result, and its sequence when it goes back to the prefill actor (its
    /// prompt is not complete, or the chunk failed). A chunk part-way through the model
    /// (`Prefilled::Pending`) stays here with its sequence.
    pub chunk: Option<ChunkOutcome>,
}

/// A chunk's result, and its sequence when it goes back to the prefill actor.
pub type ChunkOutcome = (PrefillResult, Option<Box<Seq>>);

impl Stepped {
    /// Every row and the chunk failed with `e` (the chunk's sequence goes back).
    fn failed(ids: &[ReqId], chunk: Option<InFlight>, e: WireError) -> Stepped {
        Stepped {
            outs: ids.iter().map(|_| Err(e.clone())).collect(),
            chunk: chunk.map(|c| (Err(e), c.back())),
        }
    }
}

/// A sequence whose prompt was completed by the prefill actor joins the decode batch.
#[derive(Message)]
#[rtype(result = "Reply<Result<(), WireError>>")]
pub struct Join {
    pub id: ReqId,
    pub seq: Box<Seq>,
}

fn new_batches(model: &Model) -> Option<Vec<DecodeBatch>> {
    if model.reads_tables() {
        // Every row attends over its own keys whatever the others' lengths: one batch, one
        // pool.
        return model.new_decode_batch().map(|b| vec![b]);
    }
    // Past the first group, few long rows: they attend one by one (see DecodeBatch).
    model.new_decode_batch().map(|_| {
        (0..GROUP_BOUNDS.len())
            .filter_map(|g| {
                model
                    .new_decode_batch()
                    .map(|b| b.with_per_row_attention(if g == 0 { 0 } else { PER_ROW_UP_TO }))
            })
            .collect()
    })
}

impl DecodeActor {
    /// `staging`: how a chunk's layers are spread over steps while rows decode.
    pub fn new(
        shared: Shared,
        cache: Addr<CacheActor>,
        decode_ahead: bool,
        staging: Staging,
    ) -> Self {
        let batches = new_batches(&shared.model);
        let shared_remembers = shared.remembers;
        DecodeActor {
            staging,
            sizer: staging.sizer(),
            stage_work: staging.stage_tokens,
            clock: std::time::Instant::now(),
            last_stage: Stage::default(),
            staged: None,
            stages_pending: 0,
            batches,
            rows: vec![vec![]; GROUP_BOUNDS.len()],
            shared,
            cache,
            seqs: HashMap::new(),
            ahead: None,
            masks_ahead: None,
            decode_ahead,
            chunks_ahead: ChunksAhead::default(),
            times: StepTimes::default(),
            launched: (0.0, 0.0),
            busy: Busy::default(),
            lost: HashMap::new(),
            copies: (shared_remembers && !llmq_engine::on_gpu()).then(Copies::default),
        }
    }

    /// The next layers of the oldest completed prompt waiting to be remembered (`copies`).
    fn advance_copies(&mut self) {
        let (Some(copies), seqs, batches) = (self.copies.as_mut(), &self.seqs, &self.batches)
        else {
            return;
        };
        let contents = |id: ReqId| {
            let (g, row) = seqs.get(&id)?.row?;
            batches.as_ref()?.get(g)?.row_contents(row)
        };
        if let Some(c) = copies.advance(contents) {
            self.cache.do_send(Remember {
                salt: c.salt,
                tokens: c.tokens,
                kv: c.kv,
            });
        }
    }

    fn reply<T>(&self, value: T) -> Reply<T> {
        let batch: u64 = self
            .batches
            .iter()
            .flatten()
            .map(|b| b.nbytes() as u64)
            .sum();
        let own: u64 = self.seqs.values().map(|s| s.cache.nbytes() as u64).sum();
        let joining = self
            .ahead
            .as_ref()
            .and_then(|a| a.completing.as_ref())
            .map_or(0, |(_, s)| s.cache.nbytes() as u64);
        let staged = self
            .staged
            .as_ref()
            .map_or(0, |c| c.lent.seq.cache.nbytes() as u64);
        let held = self.seqs.len()
            + self.ahead.as_ref().is_some_and(|a| a.completing.is_some()) as usize
            + self.staged.is_some() as usize;
        let report = Report {
            kv_bytes: batch + own + joining + staged,
            held,
            busy: self.busy,
            step: StepTimes {
                stage_layers: self.last_stage.layers,
                stage_work: self.last_stage.work,
                ..self.times
            },
            chunks_ahead: self.chunks_ahead,
            stages_pending: self.stages_pending,
            copies_pending: self.copies.as_ref().map_or(0, |c| c.len()),
            ..Default::default()
        };
        Reply { value, report }
    }

    /// After a panic: drops the batches and every sequence (waiting for any queued step
    /// first); their requests are remembered as lost.
    fn restart(&mut self, what: &str) {
        tracing::error!(
            what,
            "the decode actor panicked; dropping its sequences and batches"
        );
        let completing = self
            .ahead
            .as_ref()
            .and_then(|a| a.completing.as_ref())
            .map(|(id, _)| *id);
        let staged = self.staged.as_ref().map(|c| c.lent.id);
        for id in self.seqs.keys().copied().chain(completing).chain(staged) {
            self.lost.insert(id, what.to_string());
        }
        self.clear();
    }

    /// Back to no sequences, empty batches, nothing queued.
    fn clear(&mut self) {
        if let Some(a) = self.ahead.take() {
            let _ = guarded(|| a.tokens.eval());
        }
        self.masks_ahead = None;
        self.staged = None;
        self.seqs.clear();
        if let Some(copies) = self.copies.as_mut() {
            copies.clear();
        }
        self.batches = new_batches(&self.shared.model);
        self.rows = vec![vec![]; GROUP_BOUNDS.len()];
    }

    fn fault(what: &str) -> WireError {
        internal(format!("worker fault in decode: {what}"))
    }

    /// Runs a handler's work, timed (a call when `call`); a panic restarts the actor and comes
    /// back as its message.
    fn work<T>(&mut self, call: bool, f: impl FnOnce(&mut Self) -> T) -> Result<T, String> {
        let mut busy = self.busy;
        let r = busy.time(call, || guarded(|| f(self)));
        self.busy = busy;
        r.inspect_err(|what| self.restart(what))
    }

    fn remember(&self, salt: Option<String>, tokens: &[u32], layers: Option<Vec<(Array, Array)>>) {
        if let Some(kv) = self.shared.prefix_copy(layers) {
            self.cache.do_send(Remember {
                salt,
                tokens: tokens.to_vec(),
                kv,
            });
        }
    }

    /// A sequence whose prompt is complete: remembers the prompt's KV and moves it into its
    /// length group's decode batch (only its own KV is copied; its own cache goes).
    fn join(&mut self, id: ReqId, mut seq: Seq) -> Result<(), WireError> {
        let t0 = std::time::Instant::now();
        // With decode batches on a CPU, the prompt is copied from its row over the next steps
        // (but a recurrent state: the row's moves on with the next step).
        let later = self.batches.is_some()
            && self.copies.is_some()
            && !self.shared.model.config.recurrent();
        if !later && self.shared.remembers_prompt_end() {
            self.remember(seq.salt.clone(), &seq.prompt, seq.layers());
        }
        let result = match self.batches.as_mut() {
            Some(batches) => {
                let g = group_of(seq.cache.offset()).min(batches.len() - 1);
                batches[g].join(&seq.cache).map_err(internal).map(|row| {
                    seq.row = Some((g, row));
                    self.rows[g].push(id);
                    seq.cache = self.shared.model.new_cache();
                })
            }
            None => Ok(()),
        };
        if let (true, Ok(()), Some(copies)) = (later, &result, self.copies.as_mut()) {
            copies.push(id, seq.salt.clone(), seq.prompt.clone());
        }
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        if ms > SLOW_MS {
            tracing::debug!(request = id, prompt = seq.prompt.len(), ms, "slow join");
        }
        if result.is_ok() {
            self.seqs.insert(id, seq);
        }
        result
    }

    /// A completed prompt: its first token from the prompt's last logits, then the join.
    fn complete(&mut self, id: ReqId, mut seq: Seq, logits: &Array) -> Result<StepOut, WireError> {
        let first = seq.first_token(logits, &self.shared)?;
        self.join(id, seq)?;
        Ok(first)
    }

    /// Releases one sequence held here: what it fed the model stays reusable; its row leaves.
    fn release_seq(&mut self, mut seq: Seq) {
        self.leave(&mut seq);
    }

    /// What a sequence fed the model is remembered and its row leaves its decode batch.
    fn leave(&mut self, seq: &mut Seq) {
        let (fed, kv) = match (seq.row, self.batches.as_ref()) {
            (Some((g, row)), Some(b)) => (
                b[g].lens().get(row).copied().unwrap_or(0),
                b[g].row_prefix(row),
            ),
            _ => (seq.cache.offset(), seq.layers()),
        };
        self.remember(
            seq.salt.clone(),
            &seq.history[..fed.min(seq.history.len())],
            kv,
        );
        if let (Some((g, row)), Some(batches)) = (seq.row, self.batches.as_mut()) {
            match batches[g].leave(row) {
                Ok(moved) => {
                    self.rows[g].swap_remove(row);
                    if moved.is_some() {
                        let moved_id = self.rows[g][row];
                        if let Some(s) = self.seqs.get_mut(&moved_id) {
                            s.row = Some((g, row));
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, "leaving the decode batch"),
            }
        }
        seq.row = None;
    }

    /// Takes the sequences of `ids` out (decoding, completing in the step queued ahead, or
    /// part-way through a chunk), their KV remembered where it is whole and their rows gone:
    /// they go back to the prefill actor to start over. The tokens of a step queued ahead that
    /// they were in are never delivered (the sequences have not taken them).
    fn preempt(&mut self, ids: Vec<ReqId>) -> Vec<(ReqId, Box<Seq>)> {
        // Constrained rows' matchers come home first.
        self.finish_masks();
        let mut back = vec![];
        for id in ids {
            if self.staged.as_ref().is_some_and(|c| c.lent.id == id) {
                // Part-way through the model: nothing of it is remembered.
                let c = self.staged.take().expect("checked");
                back.push((id, c.lent.seq));
                continue;
            }
            if let Some(mut seq) = self.take_held(id) {
                self.leave(&mut seq);
                back.push((id, Box::new(seq)));
            }
        }
        self.discard_ahead_if_unused();
        back
    }

    fn release(&mut self, ids: Vec<ReqId>) {
        for id in ids {
            self.lost.remove(&id);
            if self.staged.as_ref().is_some_and(|c| c.lent.id == id) {
                // Part-way through the model its layers hold different lengths: nothing of it
                // is remembered.
                self.staged = None;
            }
            if let Some(seq) = self.take_held(id) {
                self.release_seq(seq);
            }
        }
        self.discard_ahead_if_unused();
    }

    /// Takes `id`'s sequence out: a decoding row's, or one whose prompt the step queued ahead
    /// completes (it would join at the next step).
    fn take_held(&mut self, id: ReqId) -> Option<Seq> {
        self.seqs.remove(&id).or_else(|| {
            self.ahead
                .as_mut()
                .filter(|a| a.completing.as_ref().is_some_and(|(c, _)| *c == id))
                .and_then(|a| a.completing.take())
                .map(|(_, seq)| seq)
        })
    }

    fn discard_ahead_if_unused(&mut self) {
        let joining = self.ahead.as_ref().is_some_and(|a| a.completing.is_some());
        if self.rows.iter().all(|g| g.is_empty()) && !joining {
            // Nobody is left to consume a step queued ahead.
            self.discard_ahead();
        }
    }
}

impl Actor for DecodeActor {
    type Context = Context<Self>;
}

impl Drop for DecodeActor {
    fn drop(&mut self) {
        let _ = guarded(|| self.discard_ahead());
    }
}

impl Handler<Step> for DecodeActor {
    type Result = MessageResult<Step>;
    fn handle(&mut self, Step { ids, chunk }: Step, _: &mut Context<Self>) -> Self::Result {
        // Rows lost to an earlier restart fail with its fault; the others step.
        let live: Vec<ReqId> = ids
            .iter()
            .copied()
            .filter(|id| !self.lost.contains_key(id))
            .collect();
        // The step's time runs to the next `Step`; with rows decoding, the scheduler sends
        // that at once (it is never idle while streams decode), so the interval is their gap.
        let started = self.clock.elapsed();
        self.last_stage = Stage::default();
        let chunk_id = chunk.as_ref().map(|g| match g {
            Grant::New(l) => l.id,
            Grant::Continue(id) => *id,
        });
        // The chunk in flight goes on only for its own request.
        let (chunk, mismatch) =
            match chunk {
                Some(Grant::New(l)) => (Some(InFlight::new(l)), None),
                Some(Grant::Continue(id)) => match self.staged.take_if(|c| c.lent.id == id) {
                    Some(c) => (Some(c), None),
                    None => (
                        None,
                        Some(self.lost.get(&id).map_or_else(
                            || unknown("chunk in flight", id),
                            |what| Self::fault(what),
                        )),
                    ),
                },
                None => (None, None),
            };
        // The offset of the chunk this step works on (its stages share it).
        let at = chunk.as_ref().map_or(0, |c| c.lent.seq.prefilled);
        if !live.is_empty() {
            self.sizer.tick_started(started);
            if self.sizer.enabled() {
                self.stage_work = self.sizer.pick(at);
            }
        }
        let mut stepped = self
            .work(true, |a| {
                a.advance_copies();
                a.step(&live, chunk)
            })
            .unwrap_or_else(|what| {
                let e = Self::fault(&what);
                Stepped {
                    outs: live.iter().map(|_| Err(e.clone())).collect(),
                    chunk: chunk_id.map(|_| (Err(e.clone()), None)),
                }
            });
        if live.len() < ids.len() {
            let mut outs = std::mem::take(&mut stepped.outs).into_iter();
            stepped.outs = ids
                .iter()
                .map(|id| match self.lost.get(id) {
                    Some(what) => Err(Self::fault(what)),
                    None => outs
                        .next()
                        .unwrap_or_else(|| Err(internal("missing step result"))),
                })
                .collect();
        }
        if let Some(e) = mismatch {
            stepped.chunk = Some((Err(e), None));
        }
        // The work of the stage this step ran (0 without one), at its chunk's offset (hopeful
        // shares' times are not moved along it: see `ChunkSizer::pick`).
        self.sizer.tick_ended(
            started,
            live.len(),
            self.last_stage.work,
            at,
            !live.is_empty(),
        );
        MessageResult(self.reply(stepped))
    }
}

impl Handler<Join> for DecodeActor {
    type Result = MessageResult<Join>;
    fn handle(&mut self, Join { id, seq }: Join, _: &mut Context<Self>) -> Self::Result {
        let r = self
            .work(false, |a| a.join(id, *seq))
            .unwrap_or_else(|what| Err(Self::fault(&what)));
        MessageResult(self.reply(r))
    }
}

impl Handler<Release> for DecodeActor {
    type Result = MessageResult<Release>;
    fn handle(&mut self, Release(ids): Release, _: &mut Context<Self>) -> Self::Result {
        // A sequence released is remembered whole (history and all): its prompt's copy stops.
        if let Some(copies) = self.copies.as_mut() {
            ids.iter().for_each(|&id| copies.forget(id));
        }
        // A panic restarts the actor: nothing of it is left to release.
        let _ = self.work(false, |a| a.release(ids));
        MessageResult(self.reply(()))
    }
}

impl Handler<Preempt> for DecodeActor {
    type Result = MessageResult<Preempt>;
    fn handle(&mut self, Preempt { ids, .. }: Preempt, _: &mut Context<Self>) -> Self::Result {
        if let Some(copies) = self.copies.as_mut() {
            ids.iter().for_each(|&id| copies.forget(id));
        }
        // A panic restarts the actor: those requests are lost, and fail when they run again.
        let back = self.work(false, |a| a.preempt(ids)).unwrap_or_default();
        MessageResult(self.reply(back))
    }
}

/// Copy every completed prompt still waiting to be remembered now (a request about to look its
/// prompt up in the prefix cache may start from one).
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct FinishCopies;

impl Handler<FinishCopies> for DecodeActor {
    type Result = MessageResult<FinishCopies>;
    fn handle(&mut self, _: FinishCopies, _: &mut Context<Self>) -> Self::Result {
        let _ = self.work(false, |a| {
            while a.copies.as_ref().is_some_and(|c| !c.is_empty()) {
                a.advance_copies();
            }
        });
        MessageResult(self.reply(()))
    }
}

impl Handler<Reset> for DecodeActor {
    type Result = MessageResult<Reset>;
    fn handle(&mut self, _: Reset, _: &mut Context<Self>) -> Self::Result {
        self.clear();
        self.lost.clear();
        MessageResult(self.reply(()))
    }
}

impl Handler<InjectPanic> for DecodeActor {
    type Result = ();
    fn handle(&mut self, _: InjectPanic, _: &mut Context<Self>) {
        let _ = self.work(false, |_| -> () { panic!("injected fault") });
    }
}

impl Handler<ResetCounters> for DecodeActor {
    type Result = MessageResult<ResetCounters>;
    fn handle(&mut self, _: ResetCounters, _: &mut Context<Self>) -> Self::Result {
        self.busy = Busy::default();
        self.chunks_ahead = ChunksAhead::default();
        self.stages_pending = 0;
        MessageResult(self.reply(()))
    }
}

#[cfg(test)]
mod tests {
    use super::{stages_for, Staging};

    #[test]
    fn a_tick_budget_spreads_a_chunk_over_more_steps_of_less_work() {
        // The 8b shape on a GPU: 32 layers, 1024-token chunks in 4 stages of 256 tokens' work,
        // down to 128 with the budget.
        let s = Staging::for_layers(32, 4, 256, 1.5, 128);
        assert_eq!((s.most, s.min_tokens), (8, 128));
        assert_eq!(
            s.stage_layers(1024, 256, 32),
            8,
            "256 tokens' work: a quarter of the layers"
        );
        assert_eq!(s.stage_layers(1024, 128, 32), 4, "128: an eighth");
        assert_eq!(
            s.stage_layers(512, 128, 32),
            8,
            "a 512-token chunk: 128 tokens' work in 8 layers"
        );
        assert_eq!(
            s.most_ticks(1024),
            8,
            "the warm-up plans for the most steps"
        );
        // Without a budget, stages as fixed: the work never shrinks.
        let fixed = Staging::for_layers(32, 4, 256, 0.0, 128);
        assert_eq!(
            (fixed.most, fixed.min_tokens, fixed.most_ticks(1024)),
            (4, 256, 4)
        );
        // One stage: no budget here (the scheduler sizes whole chunks instead).
        let one = Staging::for_layers(32, 1, 256, 1.5, 128);
        assert_eq!((one.budget, one.most, one.most_ticks(1024)), (0.0, 1, 1));
        // Never more steps than layers.
        let shallow = Staging::for_layers(6, 4, 256, 1.5, 16);
        assert_eq!((shallow.most, shallow.stage_layers(1024, 16, 6)), (6, 1));
    }

    #[test]
    fn cautious_shares_carry_the_work_chosen_and_no_more() {
        // SmolLM2 on a CPU: 30 layers, 256-token chunks in shares of 8 to 32 tokens' work.
        let s = Staging::for_layers(30, 8, 32, 2.0, 8).cautious();
        assert_eq!(
            s.stage_layers(256, 8, 30),
            1,
            "8 tokens' work: one layer of 256 tokens"
        );
        assert_eq!(
            s.stage_layers(256, 32, 30),
            3,
            "32: three layers (3.75 rounded down)"
        );
        assert_eq!(
            s.stage_layers(184, 8, 30),
            1,
            "a prompt's shorter last chunk: still one layer"
        );
        assert_eq!(s.stage_layers(64, 32, 30), 15);
        assert_eq!(
            s.stage_layers(8, 32, 30),
            30,
            "a short chunk: every layer at once"
        );
        // Spread evenly instead (a GPU's), the shorter chunk's share would be twice the work.
        let even = Staging::for_layers(30, 8, 32, 2.0, 8);
        assert_eq!(even.stage_layers(184, 8, 30), 2);
        assert!(s.sizer().enabled());
    }

    #[test]
    fn a_chunk_takes_one_stage_per_stage_tokens_up_to_the_most() {
        // 1024-token chunks in up to 4 stages of 256 tokens' work (a GPU's default).
        assert_eq!(stages_for(1024, 256, 4), 4);
        assert_eq!(
            stages_for(512, 256, 4),
            2,
            "a 512-token prompt: two ticks, not four"
        );
        assert_eq!(stages_for(257, 256, 4), 2);
        assert_eq!(stages_for(100, 256, 4), 1);
        assert_eq!(stages_for(1, 256, 4), 1);
        assert_eq!(stages_for(4096, 256, 4), 4, "never more than the most");
        assert_eq!(stages_for(1024, 256, 1), 1);
        assert_eq!(stages_for(7, 0, 3), 3, "0 tokens a stage counts as 1");
    }
}
