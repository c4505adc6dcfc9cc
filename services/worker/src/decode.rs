//! The decode actor: owns every request whose prompt is complete: the decode batches (rows of
//! shared KV buffers, one batch per length group), each row's sequence and sampler, and the
//! decode step queued ahead on the device. Each `Step` advances every row by one token; a
//! sequence lent by the prefill actor rides in the same pass over the weights for its chunk
//! (and, when nothing needs the host in between, in the step queued ahead). A sequence whose
//! prompt completes joins its length group here, by `Join` or in a `Step`; its prompt's KV goes
//! to the cache actor, as does a sequence's KV when it is released.
//!
//! Invariants: a step feeds each row the token it sampled last; a join copies only the joining
//! sequence's own KV (no other row is padded or copied); a step queued ahead is always
//! consumed or waited for, never rolled back (its KV writes are real); a chunk part-way
//! through the model (its layers spread over steps) stays here until its last stage and is
//! never remembered as a prefix before; a panic in a handler drops the batches and every
//! sequence held here (those requests fail at their next step, the others go on) and never
//! escapes.

use std::collections::HashMap;

use actix::prelude::*;
use llmq_engine::batch::DecodeBatch;
use llmq_engine::cache::SequenceCache;
use llmq_engine::model::ChunkStage;
use llmq_engine::Model;
use llmq_protocol::WireError;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use llmq_scheduler::budget::ChunkSizer;
use crate::cache::{CacheActor, Remember};
use crate::messages::{InjectPanic, Release, Reply, Report, Reset, ResetCounters, StepTimes};
use llmq_scheduler::{PrefillResult, Prefilled, ReqId, StepOut};
use crate::seq::{argmax_rows, choose, guarded, host_ids, internal, run_chunk, unknown, Busy, Seq, Shared};

/// Length groups of the decode batches: a sequence joins the first group whose bound exceeds
/// its length (it stays there as it grows).
const GROUP_BOUNDS: [usize; 4] = [2048, 8192, 32768, usize::MAX];

/// Rows of a long length group (past the first) attend one by one while there are at most
/// this many: on an H200, a decode step of 16 short rows plus one 8192-token row in a group of
/// its own took 15.2-18.8 ms against 22.4-25.0 ms masked.
const PER_ROW_UP_TO: usize = 8;

/// Steps slower than this are logged at debug level (with their parts), to find stalls.
const SLOW_MS: f64 = 80.0;

/// Steps a prefill chunk of `n` tokens is spread over while rows decode: one per
/// `stage_tokens` of it, at most `stages`. Each step then carries about `stage_tokens` tokens'
/// worth of prefill work through the whole model, whatever the chunk's length: a short chunk
/// (a short prompt, or a long one's end) is not held back for stages it does not need.
pub fn stages_for(n: usize, stage_tokens: usize, stages: usize) -> usize {
    n.div_ceil(stage_tokens.max(1)).clamp(1, stages.max(1))
}

/// The most steps a chunk's layers are spread over on `model` when `stages` are asked for: at
/// most one a layer, and 1 for a model without decode batches (sliding-window models decode
/// row by row: their chunks run whole).
pub fn chunk_stages(model: &Model, stages: usize) -> usize {
    if model.new_decode_batch().is_some() { stages.clamp(1, model.num_layers().max(1)) } else { 1 }
}

/// How a chunk granted beside decoding rows is spread over steps. Fixed (no budget): one step
/// per `stage_tokens` of it, at most `most`, the stages asked (`stages_for`). With a tick budget (`budget` > 0 and
/// more than one stage), each step's share is sized to it instead: the work a step carries
/// (tokens' worth through the whole model) is chosen between `min_tokens` and `stage_tokens`
/// from measured step times (`ChunkSizer::pick`), so a chunk takes up to `most` steps. On a GPU
/// whose decode step is short, a 256-token share can cost more than the budget allows (it is
/// the device's time, not the host's), and a smaller share keeps the streams' gap within it.
#[derive(Debug, Clone, Copy)]
pub struct Staging {
    pub stage_tokens: usize,
    pub budget: f64,
    pub min_tokens: usize,
    /// The most steps a chunk takes.
    pub most: usize,
}

impl Staging {
    /// The staging of `model` for the settings asked (see `chunk_stages`): a budget only with
    /// more than one stage; never more steps than layers.
    pub fn new(model: &Model, stages: usize, stage_tokens: usize, budget: f64, min_tokens: usize) -> Self {
        Self::for_layers(model.num_layers(), chunk_stages(model, stages), stage_tokens, budget, min_tokens)
    }

    /// The staging of a model of `layers` layers whose chunks take `stages` steps at most at
    /// full work.
    pub fn for_layers(layers: usize, stages: usize, stage_tokens: usize, budget: f64, min_tokens: usize) -> Self {
        let stages = stages.max(1);
        let stage_tokens = stage_tokens.max(1);
        let budget = if stages > 1 { budget } else { 0.0 };
        let min_tokens = if budget > 0.0 { min_tokens.clamp(1, stage_tokens) } else { stage_tokens };
        let most = (stages * stage_tokens.div_ceil(min_tokens)).clamp(stages, layers.max(stages));
        Staging { stage_tokens, budget, min_tokens, most }
    }

    /// The most steps a chunk of `n` tokens takes beside decoding rows.
    pub fn most_ticks(&self, n: usize) -> usize {
        stages_for(n, self.min_tokens, self.most)
    }

    /// Layers a step runs of a chunk of `n` tokens (of `layers`) when it carries `work` tokens'
    /// worth.
    pub fn stage_layers(&self, n: usize, work: usize, layers: usize) -> usize {
        layers.div_ceil(stages_for(n, work, self.most))
    }

    /// The sizer of each step's work (off without a budget).
    fn sizer(&self) -> ChunkSizer {
        ChunkSizer::new(self.budget, self.min_tokens, self.stage_tokens)
    }
}

fn group_of(len: usize) -> usize {
    GROUP_BOUNDS.iter().position(|&b| len < b).unwrap_or(GROUP_BOUNDS.len() - 1)
}

pub struct DecodeActor {
    shared: Shared,
    cache: Addr<CacheActor>,
    seqs: HashMap<ReqId, Seq>,
    /// Decoding sequences as rows of shared KV buffers, one batch per length group so that
    /// short sequences do not attend over the longest one's capacity (None for sliding-window
    /// models, whose sequences decode each against its own cache).
    batches: Option<Vec<DecodeBatch>>,
    /// rows[g][r]: the request in row r of group g.
    rows: Vec<Vec<ReqId>>,
    /// The next decode step, already queued on the device.
    ahead: Option<Ahead>,
    /// Whether decode steps are queued ahead at all.
    decode_ahead: bool,
    chunks_ahead: (u64, u64),
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
    /// interval from one `Step` to the next, while rows decode: the gap a stream sees).
    sizer: ChunkSizer,
    /// The work (tokens' worth) a stage of the current step carries.
    stage_work: usize,
    /// The origin of the sizer's clock.
    clock: std::time::Instant,
    /// The last step's chunk stage: layers run and the work it carried (0 without a stage).
    last_stage: (usize, usize),
    /// The chunk part-way through the model, between two of its stages.
    staged: Option<InFlight>,
    /// Stages that left their chunk part-way (for tests and the tick log).
    stages_pending: u64,
}

/// A decode step queued ahead: built from the previous step's greedy tokens while they were
/// still on the device, so the device starts it before the host has read those tokens, handled
/// them and come back for the next step (the host's share of a step is then hidden behind the
/// device's). Only when every row decodes greedily. A lent prefill chunk may share it; when
/// that chunk completes its prompt (a greedy request), the request's first token is the step's
/// last token, and its sequence (kept here) joins the decode batch when the step is delivered.
/// Rows that leave before it is consumed are simply ignored.
struct Ahead {
    /// The requests it steps, in row order when it was queued.
    order: Vec<ReqId>,
    /// Their tokens [rows] (int32, being evaluated), then the chunk's greedy token if a chunk
    /// shares the step.
    tokens: Array,
    /// The request whose prompt the step's chunk completes, with its sequence: its first token
    /// is `tokens[rows]`.
    completing: Option<(ReqId, Seq)>,
}

/// A prefill chunk lent to a step: `n` more prompt tokens of request `id`.
pub struct Lent {
    pub id: ReqId,
    pub n: usize,
    pub seq: Box<Seq>,
}

/// The chunk granted to a step: a new one lent by the prefill actor, or the one in flight here
/// (its layers spread over steps) going on.
pub enum Grant {
    New(Lent),
    Continue(ReqId),
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
    pub chunk: Option<(PrefillResult, Option<Box<Seq>>)>,
}

/// A chunk in the decode actor's hands: the lent chunk, the first layer of its next stage (0:
/// not started) and the hidden state entering that layer.
struct InFlight {
    lent: Lent,
    next: usize,
    hidden: Option<Array>,
}

impl InFlight {
    fn new(lent: Lent) -> Self {
        InFlight { lent, next: 0, hidden: None }
    }
    /// The sequence to give back to the prefill actor after a failed stage: none once a stage
    /// has run (its layers then hold different lengths, and a release there would remember
    /// them as a prefix); the request fails either way.
    fn back(self) -> Option<Box<Seq>> {
        (self.next == 0).then_some(self.lent.seq)
    }

    /// Its stage up to layer `end` as the model takes it (`tokens`: the chunk's, from
    /// `Seq::chunk`); the hidden state goes with it.
    fn stage<'a>(&'a mut self, tokens: &'a [u32], end: usize) -> ChunkStage<'a> {
        ChunkStage { tokens, cache: &mut self.lent.seq.cache, layers: self.next..end, hidden: self.hidden.take() }
    }

    /// Whether the stage ending at layer `end` completes the prompt.
    fn completes(&self, end: usize, layers: usize) -> bool {
        end == layers && self.lent.seq.prefilled + self.lent.n >= self.lent.seq.prompt.len()
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
    // Past the first group, few long rows: they attend one by one (see DecodeBatch).
    model.new_decode_batch().map(|_| {
        (0..GROUP_BOUNDS.len())
            .filter_map(|g| model.new_decode_batch().map(|b| b.with_per_row_attention(if g == 0 { 0 } else { PER_ROW_UP_TO })))
            .collect()
    })
}

/// Builds and launches, without waiting for it, the decode step that follows one whose greedy
/// tokens are `tokens` (on the device, one a row), with a prefill chunk in the same pass when
/// given; returns that step's greedy tokens (being evaluated): one a row, then the greedy token
/// after the chunk. `took`: the host's ms building the step's graph and launching it.
fn launch_step(
    model: &Model,
    rows: &[Vec<ReqId>],
    batches: &mut [DecodeBatch],
    tokens: &Array,
    chunk: Option<ChunkStage>,
    took: &mut (f64, f64),
) -> Result<(Array, Option<Array>), WireError> {
    let t0 = std::time::Instant::now();
    let counts: Vec<Vec<u32>> = rows.iter().map(|g| vec![0; g.len()]).collect();
    let mut groups: Vec<(&[u32], &mut DecodeBatch)> = counts.iter().map(|t| &t[..]).zip(batches.iter_mut()).collect();
    let (logits, hidden) = model.step_staged(&mut groups, Some(tokens), chunk).map_err(internal)?;
    let next = argmax_rows(&logits, logits.shape()[0])?;
    let mut pending = vec![&next];
    pending.extend(hidden.as_ref());
    let t1 = std::time::Instant::now();
    mlx_rs::transforms::async_eval(pending).map_err(internal)?;
    *took = ((t1 - t0).as_secs_f64() * 1000.0, t1.elapsed().as_secs_f64() * 1000.0);
    Ok((next, hidden))
}

impl DecodeActor {
    /// `staging`: how a chunk's layers are spread over steps while rows decode.
    pub fn new(shared: Shared, cache: Addr<CacheActor>, decode_ahead: bool, staging: Staging) -> Self {
        let batches = new_batches(&shared.model);
        DecodeActor {
            staging,
            sizer: staging.sizer(),
            stage_work: staging.stage_tokens,
            clock: std::time::Instant::now(),
            last_stage: (0, 0),
            staged: None,
            stages_pending: 0,
            batches,
            rows: vec![vec![]; GROUP_BOUNDS.len()],
            shared,
            cache,
            seqs: HashMap::new(),
            ahead: None,
            decode_ahead,
            chunks_ahead: (0, 0),
            times: StepTimes::default(),
            launched: (0.0, 0.0),
            busy: Busy::default(),
            lost: HashMap::new(),
        }
    }

    fn reply<T>(&self, value: T) -> Reply<T> {
        let batch: u64 = self.batches.iter().flatten().map(|b| b.nbytes() as u64).sum();
        let own: u64 = self.seqs.values().map(|s| s.cache.nbytes() as u64).sum();
        let joining = self.ahead.as_ref().and_then(|a| a.completing.as_ref()).map_or(0, |(_, s)| s.cache.nbytes() as u64);
        let staged = self.staged.as_ref().map_or(0, |c| c.lent.seq.cache.nbytes() as u64);
        let held = self.seqs.len() + self.ahead.as_ref().is_some_and(|a| a.completing.is_some()) as usize + self.staged.is_some() as usize;
        let report = Report {
            kv_bytes: batch + own + joining + staged,
            held,
            busy: self.busy,
            step: StepTimes { stage_layers: self.last_stage.0, stage_work: self.last_stage.1, ..self.times },
            chunks_ahead: self.chunks_ahead,
            stages_pending: self.stages_pending,
            stage: self.last_stage,
            ..Default::default()
        };
        Reply { value, report }
    }

    /// After a panic: drops the batches and every sequence (waiting for any queued step
    /// first); their requests are remembered as lost.
    fn restart(&mut self, what: &str) {
        tracing::error!(what, "the decode actor panicked; dropping its sequences and batches");
        let completing = self.ahead.as_ref().and_then(|a| a.completing.as_ref()).map(|(id, _)| *id);
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
        self.staged = None;
        self.seqs.clear();
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
        self.cache.do_send(Remember { salt, tokens: tokens.to_vec(), layers });
    }

    /// Drops a step queued ahead, after waiting for it: no device work queued here outlives
    /// its use (a step still running on MLX's stream thread when the process exits can meet
    /// freed memory; a test binary once aborted at exit with a corrupted heap).
    fn discard_ahead(&mut self) {
        if let Some(a) = self.ahead.take() {
            if let Err(e) = a.tokens.eval() {
                tracing::warn!(error = %e, "a step queued ahead failed");
            }
            if let Some((_, seq)) = a.completing {
                // Not consumed: the request was released (or the batch restarted).
                self.release_seq(seq);
            }
        }
    }

    /// A sequence whose prompt is complete: remembers the prompt's KV and moves it into its
    /// length group's decode batch (only its own KV is copied; its own cache goes).
    fn join(&mut self, id: ReqId, mut seq: Seq) -> Result<(), WireError> {
        let t0 = std::time::Instant::now();
        self.remember(seq.salt.clone(), &seq.prompt, seq.layers(self.shared.model.config.num_layers));
        let result = match self.batches.as_mut() {
            Some(batches) => {
                let g = group_of(seq.cache.offset());
                batches[g].join(&seq.cache).map_err(internal).map(|row| {
                    seq.row = Some((g, row));
                    self.rows[g].push(id);
                    seq.cache = self.shared.model.new_cache();
                })
            }
            None => Ok(()),
        };
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
        let first = seq.first_token(logits, self.shared.tokenizer.as_deref())?;
        self.join(id, seq)?;
        Ok(first)
    }

    /// Releases one sequence held here: what it fed the model stays reusable; its row leaves.
    fn release_seq(&mut self, seq: Seq) {
        let layers = self.shared.model.config.num_layers;
        let (fed, kv) = match (seq.row, self.batches.as_ref()) {
            (Some((g, row)), Some(b)) => (b[g].lens().get(row).copied().unwrap_or(0), b[g].row_contents(row)),
            _ => (seq.cache.offset(), seq.layers(layers)),
        };
        self.remember(seq.salt.clone(), &seq.history[..fed.min(seq.history.len())], kv);
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
    }

    fn release(&mut self, ids: Vec<ReqId>) {
        for id in ids {
            self.lost.remove(&id);
            if self.staged.as_ref().is_some_and(|c| c.lent.id == id) {
                // Part-way through the model its layers hold different lengths: nothing of it
                // is remembered.
                self.staged = None;
            }
            if let Some(seq) = self.seqs.remove(&id) {
                self.release_seq(seq);
            } else if let Some(a) = self.ahead.as_mut().filter(|a| a.completing.as_ref().is_some_and(|(c, _)| *c == id)) {
                if let Some((_, seq)) = a.completing.take() {
                    self.release_seq(seq);
                }
            }
        }
        let joining = self.ahead.as_ref().is_some_and(|a| a.completing.is_some());
        if self.rows.iter().all(|g| g.is_empty()) && !joining {
            // Nobody is left to consume a step queued ahead.
            self.discard_ahead();
        }
    }

    /// Where the stage of `c` that runs in a step ends: while rows decode, the layers that
    /// carry this step's work (see `Staging`), every remaining layer otherwise.
    fn stage_end(&self, c: &InFlight, rows: bool) -> usize {
        let layers = self.shared.model.num_layers();
        if rows { (c.next + self.staging.stage_layers(c.lent.n, self.stage_work, layers)).min(layers) } else { layers }
    }

    /// A chunk's stage is done (its work queued or run; `logits`: the chunk's last position's,
    /// after its last stage): part-way, it stays here; done, its prompt advances and it goes back
    /// to the prefill actor, or its completed prompt joins the batch now (`logits` given) or
    /// when the step queued ahead is delivered (not given; its first token is that step's).
    fn stage_done(&mut self, mut c: InFlight, end: usize, hidden: Option<Array>, logits: Option<&Array>) -> (PrefillResult, Option<Box<Seq>>) {
        self.last_stage = (end.saturating_sub(c.next), self.stage_work);
        if end < self.shared.model.num_layers() {
            c.next = end;
            c.hidden = hidden;
            self.staged = Some(c);
            self.stages_pending += 1;
            return (Ok(Prefilled::Pending), None);
        }
        let Lent { id, n, mut seq } = c.lent;
        seq.prefilled = (seq.prefilled + n).min(seq.prompt.len());
        if seq.prefilled < seq.prompt.len() {
            return (Ok(Prefilled::Done(None)), Some(seq));
        }
        match logits {
            Some(l) => (self.complete(id, *seq, l).map(|first| Prefilled::Done(Some(first))), None),
            None => {
                self.chunks_ahead.1 += 1;
                let ahead = self.ahead.as_mut().expect("a step was queued");
                ahead.completing = Some((id, *seq));
                (Ok(Prefilled::Done(None)), None)
            }
        }
    }

    fn step(&mut self, ids: &[ReqId], chunk: Option<InFlight>) -> Stepped {
        if ids.is_empty() {
            // No row to step (none left, or the rest were lost): the chunk runs on its own.
            return Stepped { outs: vec![], chunk: chunk.map(|c| self.chunk_alone(c)) };
        }
        if self.batches.is_none() {
            return self.step_unbatched(ids, chunk);
        }
        if let Some(ahead) = self.ahead.take() {
            return self.deliver_ahead(ahead, ids, chunk);
        }
        self.times = StepTimes::default();
        let mut pre = chunk;
        let end = pre.as_ref().map_or(0, |c| self.stage_end(c, true));
        let layers = self.shared.model.num_layers();
        let mut batches = self.batches.take().expect("batch mode");
        let result = (|| {
            let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
            if ids.len() != order.len() || ids.iter().any(|id| self.seqs.get(id).and_then(|s| s.row).is_none()) {
                return Err(internal("decode batch out of step with the scheduler"));
            }
            let toks: Vec<Vec<u32>> =
                self.rows.iter().map(|g| g.iter().map(|id| self.seqs[id].next.unwrap_or(0)).collect()).collect();
            let mut groups: Vec<(&[u32], &mut DecodeBatch)> = toks.iter().map(|t| &t[..]).zip(batches.iter_mut()).collect();
            let chunk_toks: Option<Vec<u32>> = pre.as_ref().map(|c| c.lent.seq.chunk(c.lent.n));
            let part = pre.as_mut().zip(chunk_toks.as_ref()).map(|(c, t)| c.stage(t, end));
            let t0 = std::time::Instant::now();
            let (logits, hidden) = self.shared.model.step_staged(&mut groups, None, part).map_err(internal)?;
            drop(groups);
            let built = t0.elapsed();
            let rows = order.len() as i32;
            let (logits, chunk_logits) = match pre {
                Some(_) if end == layers => (logits.index(..rows), Some(logits.index(rows..))),
                _ => (logits, None),
            };
            let mut taken: Vec<(ReqId, Seq)> = order.iter().map(|id| (*id, self.seqs.remove(id).expect("checked"))).collect();
            // A chunk that does not complete its prompt needs nothing from the host, so the
            // next step can be queued after it as after a plain decode step.
            let chunk_is_final = pre.as_ref().is_some_and(|c| c.completes(end, layers));
            let speculate = self.decode_ahead && !chunk_is_final && taken.iter().all(|(_, s)| s.greedy());
            let mut next = None;
            let tok = self.shared.tokenizer.clone();
            let chosen = if speculate {
                // The next step is launched from this one's device tokens before the host reads
                // them, so the device never waits for the host in between.
                argmax_rows(&logits, rows).and_then(|dev| {
                    match launch_step(&self.shared.model, &self.rows, &mut batches, &dev, None, &mut self.launched) {
                        Ok((tokens, _)) => next = Some(Ahead { order: order.clone(), tokens, completing: None }),
                        Err(e) => tracing::warn!(error = %e, "could not queue the next decode step"),
                    }
                    let host = host_ids(&dev)?;
                    Ok(host.into_iter().map(|t| (t, None)).collect::<Vec<_>>())
                })
            } else {
                let mut seqs: Vec<&mut Seq> = taken.iter_mut().map(|(_, s)| s).collect();
                choose(&logits, &mut seqs, tok.as_deref())
            };
            let outs: Vec<(ReqId, Result<StepOut, WireError>)> = match chosen {
                Ok(chosen) => taken.iter_mut().zip(chosen).map(|((id, s), (t, lp))| (*id, s.take_token(tok.as_deref(), t, lp))).collect(),
                Err(e) => taken.iter().map(|(id, _)| (*id, Err(e.clone()))).collect(),
            };
            let total = t0.elapsed();
            if total.as_secs_f64() * 1000.0 > SLOW_MS {
                let capacity: Vec<usize> = batches.iter().map(|b| b.capacity()).collect();
                tracing::debug!(
                    rows,
                    chunk = chunk_toks.as_ref().map_or(0, |c| c.len()),
                    build_ms = built.as_secs_f64() * 1000.0,
                    total_ms = total.as_secs_f64() * 1000.0,
                    ?capacity,
                    "slow decode step"
                );
            }
            for (id, s) in taken {
                self.seqs.insert(id, s);
            }
            Ok((outs, chunk_logits, hidden, next))
        })();
        self.batches = Some(batches);
        let result = result.map(|(outs, logits, hidden, next)| {
            self.ahead = next;
            (outs, logits, hidden)
        });
        let (result, chunk) = match result {
            Err(e) => (Err(e.clone()), pre.map(|c| (Err(e), c.back()))),
            // A prompt completed here joins now: its logits are on hand.
            Ok((outs, logits, hidden)) => (Ok(outs), pre.map(|c| self.stage_done(c, end, hidden, logits.as_ref()))),
        };
        let outs = match result {
            Ok(mut outs) => ids
                .iter()
                .map(|id| {
                    let i = outs.iter().position(|(x, _)| x == id).expect("every id has a row");
                    outs.swap_remove(i).1
                })
                .collect(),
            Err(e) => ids.iter().map(|_| Err(e.clone())).collect(),
        };
        Stepped { outs, chunk }
    }

    /// Queues the decode step that follows one whose greedy tokens are `tokens` (on the
    /// device), for the rows `order`, with the granted chunk's next stage (see
    /// `chunk_can_queue`) in the same pass; the stage then counts as done. On failure nothing
    /// is queued (the next step is built as usual) and the chunk comes back with the error.
    fn queue_ahead(&mut self, order: Vec<ReqId>, tokens: &Array, mut chunk: Option<InFlight>) -> Result<Option<(PrefillResult, Option<Box<Seq>>)>, (WireError, Option<InFlight>)> {
        let Some(mut batches) = self.batches.take() else { return Err((internal("no decode batches"), chunk)) };
        let end = chunk.as_ref().map_or(0, |c| self.stage_end(c, true));
        let toks: Option<Vec<u32>> = chunk.as_ref().map(|c| c.lent.seq.chunk(c.lent.n));
        let part = chunk.as_mut().zip(toks.as_ref()).map(|(c, t)| c.stage(t, end));
        let queued = launch_step(&self.shared.model, &self.rows, &mut batches, tokens, part, &mut self.launched);
        self.batches = Some(batches);
        match queued {
            Ok((tokens, hidden)) => {
                self.ahead = Some(Ahead { order, tokens, completing: None });
                Ok(chunk.map(|c| {
                    self.chunks_ahead.0 += (end == self.shared.model.num_layers()) as u64;
                    self.stage_done(c, end, hidden, None)
                }))
            }
            Err(e) => Err((e, chunk)),
        }
    }

    /// Whether the chunk's next stage can share a step queued ahead: either it does not
    /// complete the prompt or the request samples greedily (its first token is then the step's
    /// greedy token after the chunk; other sampling needs the host).
    fn chunk_can_queue(&self, c: &InFlight) -> bool {
        !c.completes(self.stage_end(c, true), self.shared.model.num_layers()) || c.lent.seq.greedy()
    }

    /// A step queued ahead is delivered: a request whose prompt that step completed joins the
    /// decode batch; the next step is queued, with the chunk's next stage in the same pass when
    /// it can be (`chunk_can_queue`); then this one's tokens are read (the joined request's
    /// first token among them). A chunk that cannot share the step runs on its own after, and
    /// nothing is queued behind it.
    fn deliver_ahead(&mut self, ahead: Ahead, ids: &[ReqId], chunk: Option<InFlight>) -> Stepped {
        let Ahead { order: ahead_order, tokens, completing } = ahead;
        let mut pos: HashMap<ReqId, usize> = ahead_order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let mut failed_join = None;
        let t0 = std::time::Instant::now();
        if let Some((id, seq)) = completing {
            pos.insert(id, ahead_order.len());
            if let Err(e) = self.join(id, seq) {
                failed_join = Some((id, e));
            }
        }
        let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
        let decode: Vec<ReqId> = ids.iter().copied().filter(|id| failed_join.as_ref().is_none_or(|(f, _)| f != id)).collect();
        if decode.len() != order.len() || order.iter().any(|id| !pos.contains_key(id)) || decode.iter().any(|id| !order.contains(id)) {
            let e = internal("the queued decode step is out of step with the scheduler");
            let _ = tokens.eval();
            return Stepped { outs: ids.iter().map(|_| Err(e.clone())).collect(), chunk: chunk.map(|c| (Err(e.clone()), c.back())) };
        }
        let t1 = std::time::Instant::now();
        // This delivery's own launch only (a step launched synchronously earlier set it too).
        self.launched = (0.0, 0.0);
        // The chunk's outcome when its stage rode in the queued step; otherwise it is still to run.
        let mut folded = None;
        let mut alone = None;
        match chunk {
            Some(c) if !self.chunk_can_queue(&c) => alone = Some(c),
            chunk => {
                let idx: Vec<i32> = order.iter().map(|id| pos[id] as i32).collect();
                match tokens.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0) {
                    Ok(current) => match self.queue_ahead(order, &current, chunk) {
                        Ok(outcome) => folded = outcome,
                        Err((e, c)) => {
                            tracing::warn!(error = %e, "could not queue the next decode step");
                            folded = c.map(|c| (Err(e), c.back()));
                        }
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "could not queue the next decode step");
                        alone = chunk;
                    }
                }
            }
        }
        let t2 = std::time::Instant::now();
        let host = host_ids(&tokens);
        let t3 = std::time::Instant::now();
        let tok = self.shared.tokenizer.clone();
        let outs = ids
            .iter()
            .map(|id| {
                if let Some((_, e)) = failed_join.as_ref().filter(|(f, _)| f == id) {
                    return Err(e.clone());
                }
                let t = host.as_ref().map_err(Clone::clone)?[pos[id]];
                let seq = self.seqs.get_mut(id).ok_or_else(|| unknown("decode", *id))?;
                seq.take_token(tok.as_deref(), t, None)
            })
            .collect();
        let chunk = folded.or_else(|| alone.map(|c| self.chunk_alone(c)));
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        let (build, launch) = self.launched;
        self.times = StepTimes {
            join: ms(t1 - t0),
            queue: ms(t2 - t1),
            build,
            launch,
            wait: ms(t3 - t2),
            rest: ms(t3.elapsed()),
            ..StepTimes::default()
        };
        Stepped { outs, chunk }
    }

    /// A chunk run to its end on its own pass (it could not share a step, or no row decodes):
    /// a new one as a plain prefill, one part-way through from its next layer; a completed
    /// prompt joins.
    fn chunk_alone(&mut self, mut c: InFlight) -> (PrefillResult, Option<Box<Seq>>) {
        let layers = self.shared.model.num_layers();
        if c.next == 0 {
            let Lent { id, n, mut seq } = c.lent;
            return match run_chunk(&self.shared.model, &mut seq, n) {
                Ok(None) => (Ok(Prefilled::Done(None)), Some(seq)),
                Ok(Some(logits)) => (self.complete(id, *seq, &logits).map(|first| Prefilled::Done(Some(first))), None),
                Err(e) => (Err(e), Some(seq)),
            };
        }
        let toks = c.lent.seq.chunk(c.lent.n);
        match self.shared.model.step_staged(&mut [], None, Some(c.stage(&toks, layers))) {
            Ok((logits, _)) => self.stage_done(c, layers, None, Some(&logits)),
            Err(e) => (Err(internal(e)), c.back()),
        }
    }

    /// Sliding-window models: every sequence decodes against its own cache; the chunk runs
    /// after the step, on its own.
    fn step_unbatched(&mut self, ids: &[ReqId], chunk: Option<InFlight>) -> Stepped {
        let mut taken: Vec<(ReqId, Seq)> = ids.iter().filter_map(|id| self.seqs.remove(id).map(|s| (*id, s))).collect();
        let tok = self.shared.tokenizer.clone();
        let result = (|| {
            if taken.len() != ids.len() {
                return Err(internal("decode of an unknown request"));
            }
            let toks: Vec<i32> = taken.iter().map(|(_, s)| s.next.unwrap_or(0) as i32).collect();
            let x = Array::from_slice(&toks, &[toks.len() as i32, 1]);
            let mut caches: Vec<&mut SequenceCache> = taken.iter_mut().map(|(_, s)| &mut s.cache).collect();
            let logits = self.shared.model.forward(&x, &mut caches, true).map_err(internal)?;
            let mut seqs: Vec<&mut Seq> = taken.iter_mut().map(|(_, s)| s).collect();
            choose(&logits, &mut seqs, tok.as_deref())
        })();
        let outs = match result {
            Ok(chosen) => taken.iter_mut().zip(chosen).map(|((_, s), (t, lp))| s.take_token(tok.as_deref(), t, lp)).collect(),
            Err(e) => ids.iter().map(|_| Err(e.clone())).collect(),
        };
        for (id, s) in taken {
            self.seqs.insert(id, s);
        }
        Stepped { outs, chunk: chunk.map(|c| self.chunk_alone(c)) }
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
        let live: Vec<ReqId> = ids.iter().copied().filter(|id| !self.lost.contains_key(id)).collect();
        // The step's time runs to the next `Step`; with rows decoding, the scheduler sends
        // that at once (it is never idle while streams decode), so the interval is their gap.
        let started = self.clock.elapsed();
        self.last_stage = (0, 0);
        if !live.is_empty() {
            self.sizer.tick_started(started);
            if self.sizer.enabled() {
                self.stage_work = self.sizer.pick();
            }
        }
        let chunk_id = chunk.as_ref().map(|g| match g {
            Grant::New(l) => l.id,
            Grant::Continue(id) => *id,
        });
        // The chunk in flight goes on only for its own request.
        let (chunk, mismatch) = match chunk {
            Some(Grant::New(l)) => (Some(InFlight::new(l)), None),
            Some(Grant::Continue(id)) => match self.staged.take_if(|c| c.lent.id == id) {
                Some(c) => (Some(c), None),
                None => (None, Some(self.lost.get(&id).map_or_else(|| unknown("chunk in flight", id), |what| Self::fault(what)))),
            },
            None => (None, None),
        };
        let mut stepped = self.work(true, |a| a.step(&live, chunk)).unwrap_or_else(|what| {
            let e = Self::fault(&what);
            Stepped { outs: live.iter().map(|_| Err(e.clone())).collect(), chunk: chunk_id.map(|_| (Err(e.clone()), None)) }
        });
        if live.len() < ids.len() {
            let mut outs = std::mem::take(&mut stepped.outs).into_iter();
            stepped.outs = ids
                .iter()
                .map(|id| match self.lost.get(id) {
                    Some(what) => Err(Self::fault(what)),
                    None => outs.next().unwrap_or_else(|| Err(internal("missing step result"))),
                })
                .collect();
        }
        if let Some(e) = mismatch {
            stepped.chunk = Some((Err(e), None));
        }
        // The work of the stage this step ran (0 without one).
        self.sizer.tick_ended(started, live.len(), self.last_stage.1, !live.is_empty());
        MessageResult(self.reply(stepped))
    }
}

impl Handler<Join> for DecodeActor {
    type Result = MessageResult<Join>;
    fn handle(&mut self, Join { id, seq }: Join, _: &mut Context<Self>) -> Self::Result {
        let r = self.work(false, |a| a.join(id, *seq)).unwrap_or_else(|what| Err(Self::fault(&what)));
        MessageResult(self.reply(r))
    }
}

impl Handler<Release> for DecodeActor {
    type Result = MessageResult<Release>;
    fn handle(&mut self, Release(ids): Release, _: &mut Context<Self>) -> Self::Result {
        // A panic restarts the actor: nothing of it is left to release.
        let _ = self.work(false, |a| a.release(ids));
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
        self.chunks_ahead = (0, 0);
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
        assert_eq!(s.stage_layers(1024, 256, 32), 8, "256 tokens' work: a quarter of the layers");
        assert_eq!(s.stage_layers(1024, 128, 32), 4, "128: an eighth");
        assert_eq!(s.stage_layers(512, 128, 32), 8, "a 512-token chunk: 128 tokens' work in 8 layers");
        assert_eq!(s.most_ticks(1024), 8, "the warm-up plans for the most steps");
        // Without a budget, stages as fixed: the work never shrinks.
        let fixed = Staging::for_layers(32, 4, 256, 0.0, 128);
        assert_eq!((fixed.most, fixed.min_tokens, fixed.most_ticks(1024)), (4, 256, 4));
        // One stage: no budget here (the scheduler sizes whole chunks instead).
        let one = Staging::for_layers(32, 1, 256, 1.5, 128);
        assert_eq!((one.budget, one.most, one.most_ticks(1024)), (0.0, 1, 1));
        // Never more steps than layers.
        let shallow = Staging::for_layers(6, 4, 256, 1.5, 16);
        assert_eq!((shallow.most, shallow.stage_layers(1024, 16, 6)), (6, 1));
    }

    #[test]
    fn a_chunk_takes_one_stage_per_stage_tokens_up_to_the_most() {
        // 1024-token chunks in up to 4 stages of 256 tokens' work (a GPU's default).
        assert_eq!(stages_for(1024, 256, 4), 4);
        assert_eq!(stages_for(512, 256, 4), 2, "a 512-token prompt: two ticks, not four");
        assert_eq!(stages_for(257, 256, 4), 2);
        assert_eq!(stages_for(100, 256, 4), 1);
        assert_eq!(stages_for(1, 256, 4), 1);
        assert_eq!(stages_for(4096, 256, 4), 4, "never more than the most");
        assert_eq!(stages_for(1024, 256, 1), 1);
        assert_eq!(stages_for(7, 0, 3), 3, "0 tokens a stage counts as 1");
    }
}
