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
//! consumed or waited for, never rolled back (its KV writes are real); a panic in a handler
//! drops the batches and every sequence held here (the step's requests fail) and never
//! escapes.

use std::collections::HashMap;

use actix::prelude::*;
use llmq_engine::batch::DecodeBatch;
use llmq_engine::cache::SequenceCache;
use llmq_engine::Model;
use llmq_protocol::WireError;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::cache::{CacheActor, Remember, Report, Reply};
use crate::scheduler::{PrefillResult, ReqId, StepOut};
use crate::seq::{argmax_rows, choose, guarded, host_ids, internal, run_chunk, unknown, Busy, Seq, Shared};

/// Length groups of the decode batches: a sequence joins the first group whose bound exceeds
/// its length (it stays there as it grows).
const GROUP_BOUNDS: [usize; 4] = [2048, 8192, 32768, usize::MAX];

/// Rows of a long length group (past the first) attend one by one while there are at most
/// this many: on an H200, a decode step of 16 short rows plus one 8192-token row in a group of
/// its own took 15.2-18.8 ms against 22.4-25.0 ms masked (RESULTS.md).
const PER_ROW_UP_TO: usize = 8;

/// Steps slower than this are logged at debug level (with their parts), to find stalls.
const SLOW_MS: f64 = 80.0;

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
    /// Host time of the last step queued ahead's delivery: joining a completed prompt, queuing
    /// the next step, waiting for the tokens, and the rest (ms).
    parts: [f64; 4],
    busy: Busy,
    /// Requests dropped by a restart after a panic, with its message, until released: their
    /// steps fail with it while the other rows go on.
    lost: HashMap<ReqId, String>,
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

/// One step of every decode row (`ids`: the scheduler's decode batch, each exactly once), with
/// a lent chunk in the same pass when given.
#[derive(Message)]
#[rtype(result = "Reply<Stepped>")]
pub struct Step {
    pub ids: Vec<ReqId>,
    pub chunk: Option<Lent>,
}

pub struct Stepped {
    /// One result per id of the step, in order.
    pub outs: Vec<Result<StepOut, WireError>>,
    /// The lent chunk's result, and its sequence when it goes back to the prefill actor (its
    /// prompt is not complete, or the chunk failed).
    pub chunk: Option<(PrefillResult, Option<Box<Seq>>)>,
}

/// A sequence whose prompt was completed by the prefill actor joins the decode batch.
#[derive(Message)]
#[rtype(result = "Reply<Result<(), WireError>>")]
pub struct Join {
    pub id: ReqId,
    pub seq: Box<Seq>,
}

/// Forget these requests (ended): their rows leave the batch; their KV goes to the cache actor.
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct Release(pub Vec<ReqId>);

/// Drop every sequence and the batches (after a fault elsewhere).
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct Reset;

/// Zero the work counters (after the warm-up).
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct ResetCounters;

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
/// after the chunk.
fn launch_step(model: &Model, rows: &[Vec<ReqId>], batches: &mut [DecodeBatch], tokens: &Array, chunk: Option<(&[u32], &mut SequenceCache)>) -> Result<Array, WireError> {
    let counts: Vec<Vec<u32>> = rows.iter().map(|g| vec![0; g.len()]).collect();
    let mut groups: Vec<(&[u32], &mut DecodeBatch)> = counts.iter().map(|t| &t[..]).zip(batches.iter_mut()).collect();
    let logits = model.step_on_device(&mut groups, tokens, chunk).map_err(internal)?;
    let next = argmax_rows(&logits, logits.shape()[0])?;
    mlx_rs::transforms::async_eval([&next]).map_err(internal)?;
    Ok(next)
}

impl DecodeActor {
    pub fn new(shared: Shared, cache: Addr<CacheActor>, decode_ahead: bool) -> Self {
        DecodeActor {
            batches: new_batches(&shared.model),
            rows: vec![vec![]; GROUP_BOUNDS.len()],
            shared,
            cache,
            seqs: HashMap::new(),
            ahead: None,
            decode_ahead,
            chunks_ahead: (0, 0),
            parts: [0.0; 4],
            busy: Busy::default(),
            lost: HashMap::new(),
        }
    }

    fn reply<T>(&self, value: T) -> Reply<T> {
        let batch: u64 = self.batches.iter().flatten().map(|b| b.nbytes() as u64).sum();
        let own: u64 = self.seqs.values().map(|s| s.cache.nbytes() as u64).sum();
        let joining = self.ahead.as_ref().and_then(|a| a.completing.as_ref()).map_or(0, |(_, s)| s.cache.nbytes() as u64);
        let held = self.seqs.len() + self.ahead.as_ref().is_some_and(|a| a.completing.is_some()) as usize;
        let report = Report {
            kv_bytes: batch + own + joining,
            held,
            busy: self.busy,
            parts: self.parts,
            chunks_ahead: self.chunks_ahead,
            ..Default::default()
        };
        Reply { value, report }
    }

    /// After a panic: drops the batches and every sequence (waiting for any queued step
    /// first); their requests are remembered as lost.
    fn restart(&mut self, what: &str) {
        tracing::error!(what, "the decode actor panicked; dropping its sequences and batches");
        let completing = self.ahead.as_ref().and_then(|a| a.completing.as_ref()).map(|(id, _)| *id);
        for id in self.seqs.keys().copied().chain(completing) {
            self.lost.insert(id, what.to_string());
        }
        self.clear();
    }

    /// Back to no sequences, empty batches, nothing queued.
    fn clear(&mut self) {
        if let Some(a) = self.ahead.take() {
            let _ = guarded(|| a.tokens.eval());
        }
        self.seqs.clear();
        self.batches = new_batches(&self.shared.model);
        self.rows = vec![vec![]; GROUP_BOUNDS.len()];
    }

    fn fault(what: &str) -> WireError {
        internal(format!("worker fault in decode: {what}"))
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

    fn step(&mut self, ids: &[ReqId], chunk: Option<Lent>) -> Stepped {
        if ids.is_empty() {
            // No row left to step (the rest were lost): the chunk runs on its own.
            return Stepped { outs: vec![], chunk: chunk.map(|l| self.chunk_alone(l)) };
        }
        if self.batches.is_none() {
            return self.step_unbatched(ids, chunk);
        }
        if let Some(ahead) = self.ahead.take() {
            return self.deliver_ahead(ahead, ids, chunk);
        }
        self.parts = [0.0; 4];
        let mut pre = chunk;
        let mut batches = self.batches.take().expect("batch mode");
        let result = (|| {
            let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
            if ids.len() != order.len() || ids.iter().any(|id| self.seqs.get(id).and_then(|s| s.row).is_none()) {
                return Err(internal("decode batch out of step with the scheduler"));
            }
            let toks: Vec<Vec<u32>> =
                self.rows.iter().map(|g| g.iter().map(|id| self.seqs[id].next.unwrap_or(0)).collect()).collect();
            let mut groups: Vec<(&[u32], &mut DecodeBatch)> = toks.iter().map(|t| &t[..]).zip(batches.iter_mut()).collect();
            let chunk_toks: Option<Vec<u32>> = pre.as_ref().map(|l| l.seq.chunk(l.n));
            let part = pre.as_mut().zip(chunk_toks.as_ref()).map(|(l, c)| (&c[..], &mut l.seq.cache));
            let t0 = std::time::Instant::now();
            let logits = self.shared.model.step(&mut groups, part).map_err(internal)?;
            drop(groups);
            let built = t0.elapsed();
            let rows = order.len() as i32;
            let (logits, chunk_logits) = match pre {
                Some(_) => (logits.index(..rows), Some(logits.index(rows..))),
                None => (logits, None),
            };
            let mut taken: Vec<(ReqId, Seq)> = order.iter().map(|id| (*id, self.seqs.remove(id).expect("checked"))).collect();
            // A chunk that does not complete its prompt needs nothing from the host, so the
            // next step can be queued after it as after a plain decode step.
            let chunk_is_final = pre.as_ref().is_some_and(|l| l.seq.prefilled + l.n >= l.seq.prompt.len());
            let speculate = self.decode_ahead && !chunk_is_final && taken.iter().all(|(_, s)| s.greedy());
            let mut next = None;
            let tok = self.shared.tokenizer.clone();
            let chosen = if speculate {
                // The next step is launched from this one's device tokens before the host reads
                // them, so the device never waits for the host in between.
                argmax_rows(&logits, rows).and_then(|dev| {
                    match launch_step(&self.shared.model, &self.rows, &mut batches, &dev, None) {
                        Ok(tokens) => next = Some(Ahead { order: order.clone(), tokens, completing: None }),
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
            Ok((outs, chunk_logits, next))
        })();
        self.batches = Some(batches);
        let result = result.map(|(outs, logits, next)| {
            self.ahead = next;
            (outs, logits)
        });
        let chunk = pre.map(|Lent { id, n, mut seq }| match &result {
            Err(e) => (Err(e.clone()), Some(seq)),
            Ok((_, logits)) => {
                seq.prefilled = (seq.prefilled + n).min(seq.prompt.len());
                match logits {
                    Some(l) if seq.prefilled == seq.prompt.len() => (self.complete(id, *seq, l).map(Some), None),
                    _ => (Ok(None), Some(seq)),
                }
            }
        });
        let outs = match result {
            Ok((mut outs, _)) => ids
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
    /// device), for the rows `order`, with a lent chunk (see `chunk_can_queue`) in the same
    /// pass; the chunk then counts as done. On failure nothing is queued (the next step is
    /// built as usual) and the chunk comes back with the error.
    fn queue_ahead(&mut self, order: Vec<ReqId>, tokens: &Array, mut chunk: Option<Lent>) -> Result<Option<Lent>, (WireError, Option<Lent>)> {
        let Some(mut batches) = self.batches.take() else { return Ok(chunk) };
        let toks: Option<Vec<u32>> = chunk.as_ref().map(|l| l.seq.chunk(l.n));
        let part = chunk.as_mut().zip(toks.as_ref()).map(|(l, c)| (&c[..], &mut l.seq.cache));
        let queued = launch_step(&self.shared.model, &self.rows, &mut batches, tokens, part);
        self.batches = Some(batches);
        match queued {
            Ok(tokens) => {
                let mut completing = None;
                let mut back = None;
                if let Some(mut l) = chunk {
                    l.seq.prefilled += l.n;
                    self.chunks_ahead.0 += 1;
                    if l.seq.prefilled == l.seq.prompt.len() {
                        self.chunks_ahead.1 += 1;
                        completing = Some((l.id, *l.seq));
                    } else {
                        back = Some(l);
                    }
                }
                self.ahead = Some(Ahead { order, tokens, completing });
                Ok(back)
            }
            Err(e) => Err((e, chunk)),
        }
    }

    /// Whether a lent chunk can share a step queued ahead: either it does not complete the
    /// prompt or the request samples greedily (its first token is then the step's greedy token
    /// after the chunk; other sampling needs the host).
    fn chunk_can_queue(l: &Lent) -> bool {
        l.seq.prefilled + l.n < l.seq.prompt.len() || l.seq.greedy()
    }

    /// A step queued ahead is delivered: a request whose prompt that step completed joins the
    /// decode batch; the next step is queued, with the lent chunk in the same pass when it can
    /// be (`chunk_can_queue`); then this one's tokens are read (the joined request's first
    /// token among them). A chunk that cannot share the step runs on its own after, and
    /// nothing is queued behind it.
    fn deliver_ahead(&mut self, ahead: Ahead, ids: &[ReqId], chunk: Option<Lent>) -> Stepped {
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
            return Stepped { outs: ids.iter().map(|_| Err(e.clone())).collect(), chunk: chunk.map(|l| (Err(e.clone()), Some(l.seq))) };
        }
        let t1 = std::time::Instant::now();
        // The chunk's outcome when it rode in the queued step; otherwise it is still to run.
        let mut folded: Option<(PrefillResult, Option<Box<Seq>>)> = None;
        let mut alone = None;
        match chunk {
            Some(l) if !Self::chunk_can_queue(&l) => alone = Some(l),
            chunk => {
                let idx: Vec<i32> = order.iter().map(|id| pos[id] as i32).collect();
                match tokens.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0) {
                    Ok(current) => match self.queue_ahead(order, &current, chunk) {
                        Ok(back) => folded = back.map(|l| (Ok(None), Some(l.seq))).or(self.ahead.as_ref().and_then(|a| a.completing.as_ref()).map(|_| (Ok(None), None))),
                        Err((e, l)) => {
                            tracing::warn!(error = %e, "could not queue the next decode step");
                            folded = l.map(|l| (Err(e), Some(l.seq)));
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
        let chunk = folded.or_else(|| alone.map(|l| self.chunk_alone(l)));
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        self.parts = [ms(t1 - t0), ms(t2 - t1), ms(t3 - t2), ms(t3.elapsed())];
        Stepped { outs, chunk }
    }

    /// A lent chunk run on its own pass (it could not share a step); a completed prompt joins.
    fn chunk_alone(&mut self, Lent { id, n, mut seq }: Lent) -> (PrefillResult, Option<Box<Seq>>) {
        match run_chunk(&self.shared.model, &mut seq, n) {
            Ok(None) => (Ok(None), Some(seq)),
            Ok(Some(logits)) => (self.complete(id, *seq, &logits).map(Some), None),
            Err(e) => (Err(e), Some(seq)),
        }
    }

    /// Sliding-window models: every sequence decodes against its own cache; a lent chunk runs
    /// after the step, on its own.
    fn step_unbatched(&mut self, ids: &[ReqId], chunk: Option<Lent>) -> Stepped {
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
        Stepped { outs, chunk: chunk.map(|l| self.chunk_alone(l)) }
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
        let mut busy = self.busy;
        let chunk_id = chunk.as_ref().map(|l| l.id);
        let r = busy.time(true, || guarded(|| self.step(&live, chunk)));
        self.busy = busy;
        let mut stepped = r.unwrap_or_else(|what| {
            self.restart(&what);
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
        MessageResult(self.reply(stepped))
    }
}

impl Handler<Join> for DecodeActor {
    type Result = MessageResult<Join>;
    fn handle(&mut self, Join { id, seq }: Join, _: &mut Context<Self>) -> Self::Result {
        let mut busy = self.busy;
        let r = busy.time(false, || guarded(|| self.join(id, *seq)));
        self.busy = busy;
        let r = r.unwrap_or_else(|what| {
            self.restart(&what);
            Err(internal(format!("worker fault in decode: {what}")))
        });
        MessageResult(self.reply(r))
    }
}

impl Handler<Release> for DecodeActor {
    type Result = MessageResult<Release>;
    fn handle(&mut self, Release(ids): Release, _: &mut Context<Self>) -> Self::Result {
        let mut busy = self.busy;
        let r = busy.time(false, || guarded(|| self.release(ids)));
        self.busy = busy;
        if let Err(what) = r {
            self.restart(&what);
        }
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

/// Makes the actor panic inside a handler, as a bug would (for tests of its recovery).
#[doc(hidden)]
#[derive(Message)]
#[rtype(result = "()")]
pub struct InjectPanic;

impl Handler<InjectPanic> for DecodeActor {
    type Result = ();
    fn handle(&mut self, _: InjectPanic, _: &mut Context<Self>) {
        if let Err(what) = guarded(|| panic!("injected fault")) {
            self.restart(&what);
        }
    }
}

impl Handler<ResetCounters> for DecodeActor {
    type Result = MessageResult<ResetCounters>;
    fn handle(&mut self, _: ResetCounters, _: &mut Context<Self>) -> Self::Result {
        self.busy = Busy::default();
        self.chunks_ahead = (0, 0);
        MessageResult(self.reply(()))
    }
}
