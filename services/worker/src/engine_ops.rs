//! The real work behind the scheduler, on an `llmq_engine::Model`: each request's KV cache,
//! prefill chunks, one batched decode step over every running sequence, sampling, stop
//! conditions and incremental text.
//!
//! The prefix cache lives here too: a request admitted with a known prefix starts with a copy of
//! that prefix's KV; a sequence's KV is remembered when its prompt is complete and again when it
//! ends (prompt and output), so later requests that resend it skip its prefill.
//!
//! Invariants: a request's cache exists from `register` to `release` and is touched by nothing
//! else; a decode step feeds each sequence the token it sampled last; the batch never pads or
//! copies another sequence's cache (each sequence attends over its own cache); prefix entries
//! are copies, so a hit never shares memory with a running sequence.

use std::collections::HashMap;

use llmq_engine::batch::DecodeBatch;
use llmq_engine::cache::SequenceCache;
use llmq_engine::generate::Finisher;
use llmq_engine::model::host_f32;
use llmq_engine::prefix::{KvPrefix, PrefixCache, PrefixStats};
use llmq_engine::sampling::{Sampler, SamplingParams, StopParams};
use llmq_engine::{Model, Tokenizer};
use llmq_protocol::{ErrorClass, TokenLogprob, WireError};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{Array, Dtype};

use crate::scheduler::{step_separately, EngineOps, PrefillResult, ReqId, StepOut, WorkerEngine};

struct Seq {
    cache: SequenceCache,
    prompt: Vec<u32>,
    prefilled: usize,
    /// Prefixes are shared only between requests with the same salt.
    salt: Option<String>,
    sampler: Sampler,
    history: Vec<u32>,
    finisher: Finisher,
    /// The token sampled last: the next decode step's input.
    next: Option<u32>,
    /// (length group, row) in the decode batches, once prefill is complete.
    row: Option<(usize, usize)>,
}

pub struct ModelEngine {
    model: Model,
    tokenizer: Option<Tokenizer>,
    seqs: HashMap<ReqId, Seq>,
    /// Time spent in prefill and decode calls since start, and how many calls.
    prefill_time: std::time::Duration,
    prefill_calls: u64,
    decode_time: std::time::Duration,
    decode_calls: u64,
    /// Time spent on KV bookkeeping outside those calls: admissions (prefix lookups), releases
    /// (remembering a sequence's KV, leaving the batch) and prefix-cache trims.
    kv_time: std::time::Duration,
    /// Decoding sequences as rows of shared KV buffers, one batch per length group so that
    /// short sequences do not attend over the longest one's capacity (None for sliding-window
    /// models, whose sequences decode each against its own cache).
    batches: Option<Vec<DecodeBatch>>,
    /// rows[g][r]: the request in row r of group g.
    rows: Vec<Vec<ReqId>>,
    prefix: Option<PrefixCache<KvPrefix>>,
    /// The next decode step, already queued on the device.
    ahead: Option<Ahead>,
    /// Whether decode steps are queued ahead at all.
    decode_ahead: bool,
    /// Prefill chunks that ran in a step queued ahead, and how many of them completed their
    /// prompt.
    chunks_ahead: u64,
    completions_ahead: u64,
    /// Host time of the last step queued ahead's delivery: joining a completed prompt,
    /// queuing the next step, waiting for the tokens, and the rest (handling the tokens, and a
    /// chunk run on its own if any) (ms).
    parts: [f64; 4],
}

/// A decode step queued ahead: built from the previous step's greedy tokens while they were
/// still on the device, so the device starts it before the host has read those tokens, handled
/// them and come back for the next step (the host's share of a step is then hidden behind the
/// device's). Only when every row decodes greedily. A prefill chunk may share it; when that
/// chunk completes its prompt (a greedy request), the request's first token is the step's last
/// token, and the request joins the decode batch when the step is delivered. Rows that leave
/// before it is consumed are simply ignored; its KV writes are real (the batch is already
/// advanced), so it is always consumed, never rolled back.
struct Ahead {
    /// The requests it steps, in row order when it was queued.
    order: Vec<ReqId>,
    /// Their tokens [rows] (int32, being evaluated), then the chunk's greedy token if a chunk
    /// shares the step.
    tokens: Array,
    /// The request whose prompt the step's chunk completes: its first token is `tokens[rows]`.
    completing: Option<ReqId>,
}

/// Length groups of the decode batches: a sequence joins the first group whose bound exceeds
/// its length (it stays there as it grows).
const GROUP_BOUNDS: [usize; 4] = [2048, 8192, 32768, usize::MAX];

/// Rows of a long length group (past the first) attend one by one while there are at most
/// this many: on an H200, a decode step of 16 short rows plus one 8192-token row in a group of
/// its own took 15.2-18.8 ms against 22.4-25.0 ms masked (RESULTS.md).
const PER_ROW_UP_TO: usize = 8;

/// Engine calls slower than this are logged at debug level (with their parts), to find stalls.
const SLOW_MS: f64 = 80.0;

fn group_of(len: usize) -> usize {
    GROUP_BOUNDS.iter().position(|&b| len < b).unwrap_or(GROUP_BOUNDS.len() - 1)
}

fn internal(e: impl std::fmt::Display) -> WireError {
    WireError::new(ErrorClass::Internal, e.to_string())
}

fn wire_logprob(lp: llmq_engine::sampling::TokenLogprob, tok: Option<&Tokenizer>) -> TokenLogprob {
    let piece = |id: u32| tok.and_then(|t| t.decode(&[id], false).ok()).unwrap_or_default();
    let top_text = lp.top.iter().map(|&(id, _)| piece(id)).collect();
    TokenLogprob { token: lp.token, logprob: lp.logprob, text: piece(lp.token), top: lp.top, top_text }
}

impl ModelEngine {
    pub fn new(model: Model, tokenizer: Option<Tokenizer>) -> Self {
        // Past the first group, few long rows: they attend one by one (see DecodeBatch).
        let batches = model.new_decode_batch().map(|_| {
            (0..GROUP_BOUNDS.len())
                .filter_map(|g| model.new_decode_batch().map(|b| b.with_per_row_attention(if g == 0 { 0 } else { PER_ROW_UP_TO })))
                .collect::<Vec<_>>()
        });
        let zero = std::time::Duration::ZERO;
        ModelEngine {
            model,
            tokenizer,
            seqs: HashMap::new(),
            prefill_time: zero,
            prefill_calls: 0,
            decode_time: zero,
            decode_calls: 0,
            kv_time: zero,
            batches,
            rows: vec![vec![]; GROUP_BOUNDS.len()],
            prefix: None,
            ahead: None,
            decode_ahead: true,
            chunks_ahead: 0,
            completions_ahead: 0,
            parts: [0.0; 4],
        }
    }

    /// How many prefill chunks have run in decode steps queued ahead, and how many of those
    /// completed their prompt.
    pub fn chunks_queued_ahead(&self) -> (u64, u64) {
        (self.chunks_ahead, self.completions_ahead)
    }

    /// Turns queuing decode steps ahead on or off (on by default).
    pub fn with_decode_ahead(mut self, on: bool) -> Self {
        self.decode_ahead = on;
        self
    }

    /// Turns the prefix cache on: `block` tokens per index block, at most `max_bytes` held (the
    /// scheduler also trims it to the KV budget left over by running requests); hits come in
    /// whole blocks of the model's chunk grid.
    pub fn with_prefix_cache(mut self, block: usize, max_bytes: u64) -> Self {
        // Hits in whole chunk-grid blocks, so that the chunks after one start on the grid (see
        // `Model::chunk_grid`).
        self.prefix = Some(PrefixCache::new(block, max_bytes).with_reuse_unit(self.model.chunk_grid()));
        self
    }

    /// Remembers the KV of `tokens` (per-layer views, copied if kept).
    fn remember(prefix: &mut Option<PrefixCache<KvPrefix>>, salt: Option<&str>, tokens: &[u32], layers: Option<Vec<(Array, Array)>>) {
        let (Some(cache), Some(layers)) = (prefix.as_mut(), layers) else { return };
        if let Err(e) = cache.insert(salt, tokens, || KvPrefix::copy_of(layers)) {
            tracing::warn!(error = %e, "could not store a prefix");
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn held(&self) -> usize {
        self.seqs.len()
    }

    /// Samples from one row of logits [vocab] (device) and runs the stop checks.
    fn take_token(&self, seq: &mut Seq, id: u32, lp: Option<TokenLogprob>) -> Result<StepOut, WireError> {
        seq.history.push(id);
        seq.next = Some(id);
        let (text, finished) = seq.finisher.push(self.tokenizer.as_ref(), id).map_err(internal)?;
        let finished = finished.map(|r| match r {
            llmq_engine::sampling::FinishReason::Stop => llmq_protocol::FinishReason::Stop,
            llmq_engine::sampling::FinishReason::Length => llmq_protocol::FinishReason::Length,
        });
        Ok(StepOut { ids: vec![id], text, logprobs: lp.into_iter().collect(), finished })
    }
}

/// Greedy token of every row of `logits` [rows, 1, vocab], on the device (int32, lazy).
fn argmax_rows(logits: &Array, rows: i32) -> Result<Array, WireError> {
    let am = argmax_axis(&logits.reshape(&[rows, -1]).map_err(internal)?, -1, None).map_err(internal)?;
    am.as_dtype(Dtype::Int32).map_err(internal)
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

/// Token ids of an int32 device array, read on the host (waits for the device).
fn host_ids(a: &Array) -> Result<Vec<u32>, WireError> {
    Ok(a.try_as_slice::<i32>().map_err(internal)?.iter().map(|&v| v as u32).collect())
}

/// Picks each row's token: one device argmax for the whole batch, host sampling only for rows
/// that need it (temperature, penalties, logprobs).
fn choose(logits: &Array, seqs: &mut [&mut Seq], tok: Option<&Tokenizer>) -> Result<Vec<(u32, Option<TokenLogprob>)>, WireError> {
    let b = seqs.len() as i32;
    let rows = logits.reshape(&[b, -1]).map_err(internal)?;
    let greedy_ids: Option<Vec<u32>> = if seqs.iter().any(|s| s.sampler.params().is_plain_greedy()) {
        Some(host_ids(&argmax_rows(logits, b)?)?)
    } else {
        None
    };
    let mut out = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter_mut().enumerate() {
        if s.sampler.params().is_plain_greedy() {
            out.push((greedy_ids.as_ref().expect("computed above")[i], None));
        } else {
            let row = host_f32(&rows.index(i as i32)).map_err(internal)?;
            let (t, lp) = s.sampler.sample(&row, &s.history);
            out.push((t, lp.map(|lp| wire_logprob(lp, tok))));
        }
    }
    Ok(out)
}

impl WorkerEngine for ModelEngine {
    /// KV bytes one token takes across all layers (keys and values).
    fn kv_bytes_per_token(&self) -> u64 {
        let c = &self.model.config;
        let elem = match self.model.dtype() {
            Dtype::Float32 => 4,
            _ => 2,
        };
        2 * (c.num_layers * c.num_kv_heads * c.head_dim * elem) as u64
    }

    /// KV bytes the caches hold now.
    fn kv_bytes_in_use(&self) -> u64 {
        let batch: u64 = self.batches.iter().flatten().map(|b| b.nbytes() as u64).sum();
        let prefix = self.prefix.as_ref().map_or(0, |p| p.held_bytes());
        batch + prefix + self.seqs.values().map(|s| s.cache.nbytes() as u64).sum::<u64>()
    }

    /// Milliseconds spent in the engine since start: prefill and decode calls, and the KV
    /// bookkeeping of admissions, releases and prefix-cache trims.
    fn engine_ms(&self) -> f64 {
        (self.prefill_time + self.decode_time + self.kv_time).as_secs_f64() * 1000.0
    }

    /// (prefill calls, their ms, decode calls, their ms) since start.
    fn call_times(&self) -> (u64, f64, u64, f64) {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        (self.prefill_calls, ms(self.prefill_time), self.decode_calls, ms(self.decode_time))
    }

    /// Creates a request's state; parameters are validated here, before any work is queued.
    fn register(&mut self, id: ReqId, prompt: Vec<u32>, sampling: SamplingParams, stop: StopParams, salt: Option<String>) -> Result<(), WireError> {
        let invalid = |e: llmq_engine::EngineError| WireError::new(ErrorClass::InvalidRequest, e.to_string());
        sampling.validate().map_err(invalid)?;
        stop.validate().map_err(invalid)?;
        llmq_engine::generate::check_ids(&self.model, &prompt).map_err(invalid)?;
        if prompt.is_empty() {
            return Err(WireError::new(ErrorClass::InvalidRequest, "empty prompt"));
        }
        let eos = self.tokenizer.as_ref().map(|t| t.eos_ids.clone()).unwrap_or_default();
        let seq = Seq {
            cache: self.model.new_cache(),
            history: prompt.clone(),
            prompt,
            prefilled: 0,
            salt,
            sampler: Sampler::new(sampling),
            finisher: Finisher::new(stop, eos),
            next: None,
            row: None,
        };
        self.seqs.insert(id, seq);
        Ok(())
    }

    fn context_tokens(&self) -> usize {
        self.model.config.max_position_embeddings
    }

    fn prefix_stats(&self) -> PrefixStats {
        self.prefix.as_ref().map(|p| p.stats()).unwrap_or_default()
    }

    fn prefix_clear(&mut self) -> u64 {
        self.prefix.as_mut().map_or(0, |p| p.clear())
    }

    fn step_parts(&self) -> Vec<(&'static str, f64)> {
        ["join", "queue", "wait", "rest"].into_iter().zip(self.parts).collect()
    }

    fn reset_counters(&mut self) {
        let zero = std::time::Duration::ZERO;
        (self.prefill_time, self.prefill_calls, self.decode_time, self.decode_calls, self.kv_time) = (zero, 0, zero, 0, zero);
        if let Some(p) = self.prefix.as_mut() {
            p.reset_stats();
        }
    }
}

impl EngineOps for ModelEngine {
    fn prefill(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError> {
        let t0 = std::time::Instant::now();
        let r = self.prefill_inner(id, n);
        let dt = t0.elapsed();
        self.prefill_time += dt;
        self.prefill_calls += 1;
        r
    }

    fn decode(&mut self, ids: &[ReqId]) -> Vec<Result<StepOut, WireError>> {
        let t0 = std::time::Instant::now();
        let r = self.decode_inner(ids);
        let dt = t0.elapsed();
        self.decode_time += dt;
        self.decode_calls += 1;
        r
    }

    /// With decode batches, the decode step and the prefill chunk run as one pass over the
    /// weights (timed as a decode call), and a step with no chunk queues the next one ahead
    /// (see `Ahead`); otherwise decode and prefill run one after the other.
    fn step(&mut self, decode: &[ReqId], prefill: Option<(ReqId, usize)>) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        if decode.is_empty() {
            self.discard_ahead();
        }
        if self.batches.is_none() || decode.is_empty() {
            return step_separately(self, decode, prefill);
        }
        let t0 = std::time::Instant::now();
        let r = self.decode_rows(decode, prefill);
        self.decode_time += t0.elapsed();
        self.decode_calls += 1;
        r
    }

    /// Looks the prompt up in the prefix cache; a hit becomes the start of the request's cache.
    fn admit(&mut self, id: ReqId) -> usize {
        let t0 = std::time::Instant::now();
        let n = self.admit_inner(id);
        self.kv_time += t0.elapsed();
        n
    }

    fn prefix_trim(&mut self, max_bytes: u64) -> u64 {
        let t0 = std::time::Instant::now();
        let held = self.prefix.as_mut().map_or(0, |p| p.trim(max_bytes));
        self.kv_time += t0.elapsed();
        held
    }

    fn release(&mut self, id: ReqId) {
        let t0 = std::time::Instant::now();
        self.release_inner(id);
        self.kv_time += t0.elapsed();
    }
}

impl ModelEngine {
    fn admit_inner(&mut self, id: ReqId) -> usize {
        let (Some(seq), Some(prefix)) = (self.seqs.get_mut(&id), self.prefix.as_mut()) else { return 0 };
        let Some((n, kv)) = prefix.lookup(seq.salt.as_deref(), &seq.prompt) else { return 0 };
        match self.model.cache_from_prefix(&kv.layers, n, seq.prompt.len()) {
            Ok(cache) => {
                seq.cache = cache;
                seq.prefilled = n;
                n
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not reuse a cached prefix");
                0
            }
        }
    }

    fn release_inner(&mut self, id: ReqId) {
        let Some(seq) = self.seqs.remove(&id) else { return };
        // What it fed the model so far (prompt, then outputs but the last) stays reusable.
        let (fed, layers) = match (seq.row, self.batches.as_ref()) {
            (Some((g, row)), Some(b)) => (b[g].lens().get(row).copied().unwrap_or(0), b[g].row_contents(row)),
            _ => (seq.cache.offset(), (0..self.model.config.num_layers).map(|l| seq.cache.contents(l)).collect()),
        };
        Self::remember(&mut self.prefix, seq.salt.as_deref(), &seq.history[..fed.min(seq.history.len())], layers);
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
        let joining = self.ahead.as_ref().and_then(|a| a.completing).is_some_and(|c| self.seqs.contains_key(&c));
        if self.rows.iter().all(|g| g.is_empty()) && !joining {
            // Nobody is left to consume a step queued ahead.
            self.discard_ahead();
        }
    }
}

impl Drop for ModelEngine {
    fn drop(&mut self) {
        self.discard_ahead();
    }
}

impl ModelEngine {
    /// Drops a step queued ahead, after waiting for it: no device work an engine queued
    /// outlives its use (a step still running on MLX's stream thread when the process exits
    /// can meet freed memory; a test binary once aborted at exit with a corrupted heap).
    fn discard_ahead(&mut self) {
        if let Some(a) = self.ahead.take() {
            if let Err(e) = a.tokens.eval() {
                tracing::warn!(error = %e, "a step queued ahead failed");
            }
        }
    }

    fn prefill_inner(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError> {
        let mut seq = self.seqs.remove(&id).ok_or_else(|| internal(format!("prefill of unknown request {id}")))?;
        let result = (|| {
            let end = (seq.prefilled + n).min(seq.prompt.len());
            let chunk: Vec<i32> = seq.prompt[seq.prefilled..end].iter().map(|&t| t as i32).collect();
            let x = Array::from_slice(&chunk, &[1, chunk.len() as i32]);
            let logits = self.model.forward(&x, &mut [&mut seq.cache], true).map_err(internal)?;
            seq.prefilled = end;
            if end < seq.prompt.len() {
                // Materialise the cache now: the chunk's work belongs to this tick.
                logits.eval().map_err(internal)?;
                return Ok(None);
            }
            self.complete_prompt(id, &mut seq, &logits).map(Some)
        })();
        self.seqs.insert(id, seq);
        result
    }

    /// A sequence whose prompt is now complete: samples its first token from the prompt's last
    /// logits, remembers the prompt's KV, and moves the sequence into its length group's decode
    /// batch (only its own KV is copied; its own cache goes).
    fn complete_prompt(&mut self, id: ReqId, seq: &mut Seq, logits: &Array) -> Result<StepOut, WireError> {
        let t0 = std::time::Instant::now();
        let (t, lp) = choose(logits, &mut [&mut *seq], self.tokenizer.as_ref())?.pop().expect("one row");
        let out = self.take_token(seq, t, lp)?;
        let sample = t0.elapsed();
        self.join_batch(id, seq, sample)?;
        Ok(out)
    }

    /// The rest of a prompt's completion, its first token aside: remembers the prompt's KV and
    /// moves the sequence into its length group's decode batch.
    fn join_batch(&mut self, id: ReqId, seq: &mut Seq, sample: std::time::Duration) -> Result<(), WireError> {
        let t1 = std::time::Instant::now();
        let layers = (0..self.model.config.num_layers).map(|l| seq.cache.contents(l)).collect();
        Self::remember(&mut self.prefix, seq.salt.as_deref(), &seq.prompt, layers);
        let t2 = std::time::Instant::now();
        if let Some(batches) = self.batches.as_mut() {
            let g = group_of(seq.cache.offset());
            seq.row = Some((g, batches[g].join(&seq.cache).map_err(internal)?));
            self.rows[g].push(id);
            seq.cache = self.model.new_cache();
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        let (sample, remember, join) = (ms(sample), ms(t2 - t1), ms(t2.elapsed()));
        if sample + remember + join > SLOW_MS {
            tracing::debug!(request = id, prompt = seq.prompt.len(), sample, remember, join, "slow prompt completion (ms)");
        }
        Ok(())
    }

    /// One step of the decode batches, in the same pass as `chunk`'s prefill tokens when given;
    /// decode results in the order of `ids`.
    fn decode_rows(&mut self, ids: &[ReqId], chunk: Option<(ReqId, usize)>) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        if let Some(ahead) = self.ahead.take() {
            return self.deliver_ahead(ahead, ids, chunk);
        }
        self.parts = [0.0; 4];
        let mut pre = match chunk.map(|(id, n)| (id, n, self.seqs.remove(&id))) {
            Some((id, n, Some(seq))) => Some((id, n, seq)),
            Some((id, _, None)) => {
                let (outs, _) = self.decode_rows(ids, None);
                return (outs, Some(Err(internal(format!("prefill of unknown request {id}")))));
            }
            None => None,
        };
        let mut batches = self.batches.take().expect("batch mode");
        let result = (|| {
            let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
            if ids.len() != order.len() || ids.iter().any(|id| self.seqs.get(id).and_then(|s| s.row).is_none()) {
                return Err(internal("decode batch out of step with the scheduler"));
            }
            let toks: Vec<Vec<u32>> =
                self.rows.iter().map(|g| g.iter().map(|id| self.seqs[id].next.unwrap_or(0)).collect()).collect();
            let mut groups: Vec<(&[u32], &mut DecodeBatch)> = toks.iter().map(|t| &t[..]).zip(batches.iter_mut()).collect();
            let chunk_toks: Option<Vec<u32>> =
                pre.as_ref().map(|(_, n, s)| s.prompt[s.prefilled..(s.prefilled + n).min(s.prompt.len())].to_vec());
            let part = pre.as_mut().zip(chunk_toks.as_ref()).map(|((_, _, s), c)| (&c[..], &mut s.cache));
            let t0 = std::time::Instant::now();
            let logits = self.model.step(&mut groups, part).map_err(internal)?;
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
            let chunk_is_final = pre.as_ref().is_some_and(|(_, n, s)| s.prefilled + n >= s.prompt.len());
            let speculate = self.decode_ahead && !chunk_is_final && taken.iter().all(|(_, s)| s.sampler.params().is_plain_greedy());
            let mut next = None;
            let chosen = if speculate {
                // The next step is launched from this one's device tokens before the host reads
                // them, so the device never waits for the host in between.
                argmax_rows(&logits, rows).and_then(|dev| {
                    match launch_step(&self.model, &self.rows, &mut batches, &dev, None) {
                        Ok(tokens) => next = Some(Ahead { order: order.clone(), tokens, completing: None }),
                        Err(e) => tracing::warn!(error = %e, "could not queue the next decode step"),
                    }
                    let host = host_ids(&dev)?;
                    Ok(host.into_iter().map(|t| (t, None)).collect::<Vec<_>>())
                })
            } else {
                let mut seqs: Vec<&mut Seq> = taken.iter_mut().map(|(_, s)| s).collect();
                choose(&logits, &mut seqs, self.tokenizer.as_ref())
            };
            let outs: Vec<(ReqId, Result<StepOut, WireError>)> = match chosen {
                Ok(chosen) => taken.iter_mut().zip(chosen).map(|((id, s), (t, lp))| (*id, self.take_token(s, t, lp))).collect(),
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
        let pre_result = pre.map(|(id, n, mut seq)| {
            let r = match &result {
                Err(e) => Err(e.clone()),
                Ok((_, logits)) => {
                    seq.prefilled = (seq.prefilled + n).min(seq.prompt.len());
                    match logits {
                        Some(l) if seq.prefilled == seq.prompt.len() => self.complete_prompt(id, &mut seq, l).map(Some),
                        _ => Ok(None),
                    }
                }
            };
            self.seqs.insert(id, seq);
            r
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
        (outs, pre_result)
    }

    /// Queues the decode step that follows one whose greedy tokens are `tokens` (on the device),
    /// for the rows `order`, with `chunk` (a request and a token count, see `chunk_can_queue`)
    /// in the same pass; the chunk then counts as done. On failure nothing is queued (the next
    /// step is built as usual); a failed chunk is the request's error.
    fn queue_ahead(&mut self, order: Vec<ReqId>, tokens: &Array, chunk: Option<(ReqId, usize)>) -> Result<(), WireError> {
        let Some(mut batches) = self.batches.take() else { return Ok(()) };
        let mut pre = chunk.and_then(|(id, n)| self.seqs.remove(&id).map(|seq| (id, n, seq)));
        let queued = (|| -> Result<Array, WireError> {
            if chunk.is_some() && pre.is_none() {
                return Err(internal("prefill of an unknown request"));
            }
            let toks: Option<Vec<u32>> = pre.as_ref().map(|(_, n, s)| s.prompt[s.prefilled..s.prefilled + n].to_vec());
            let part = pre.as_mut().zip(toks.as_ref()).map(|((_, _, s), c)| (&c[..], &mut s.cache));
            launch_step(&self.model, &self.rows, &mut batches, tokens, part)
        })();
        self.batches = Some(batches);
        let r = match queued {
            Ok(tokens) => {
                let mut completing = None;
                if let Some((id, n, seq)) = pre.as_mut() {
                    seq.prefilled += *n;
                    self.chunks_ahead += 1;
                    completing = (seq.prefilled == seq.prompt.len()).then_some(*id);
                    self.completions_ahead += completing.is_some() as u64;
                }
                self.ahead = Some(Ahead { order, tokens, completing });
                Ok(())
            }
            Err(e) => Err(e),
        };
        if let Some((id, _, seq)) = pre {
            self.seqs.insert(id, seq);
        }
        r
    }

    /// Whether a granted chunk can share a step queued ahead: its request is prefilling, and
    /// either the chunk does not complete the prompt or the request samples greedily (its first
    /// token is then the step's greedy token after the chunk; other sampling needs the host).
    fn chunk_can_queue(&self, id: ReqId, n: usize) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| s.row.is_none() && (s.prefilled + n < s.prompt.len() || s.sampler.params().is_plain_greedy()))
    }

    /// A tick whose decode step was queued ahead: a request whose prompt that step completed
    /// joins the decode batch; the next step is queued, with the granted prefill chunk in the
    /// same pass when it can be (`chunk_can_queue`); then this one's tokens are read (the joined
    /// request's first token among them). A chunk that cannot share the step runs on its own
    /// after, and nothing is queued behind it.
    fn deliver_ahead(&mut self, ahead: Ahead, ids: &[ReqId], chunk: Option<(ReqId, usize)>) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        let mut pos: HashMap<ReqId, usize> = ahead.order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let mut failed_join = None;
        let t0 = std::time::Instant::now();
        if let Some(id) = ahead.completing {
            if let Some(mut seq) = self.seqs.remove(&id) {
                pos.insert(id, ahead.order.len());
                if let Err(e) = self.join_batch(id, &mut seq, std::time::Duration::ZERO) {
                    failed_join = Some((id, e));
                }
                self.seqs.insert(id, seq);
            }
        }
        let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
        let decode: Vec<ReqId> = ids.iter().copied().filter(|id| failed_join.as_ref().is_none_or(|(f, _)| f != id)).collect();
        if decode.len() != order.len() || order.iter().any(|id| !pos.contains_key(id)) || decode.iter().any(|id| !order.contains(id)) {
            let e = internal("the queued decode step is out of step with the scheduler");
            return (ids.iter().map(|_| Err(e.clone())).collect(), chunk.map(|_| Err(e.clone())));
        }
        let t1 = std::time::Instant::now();
        let fold = chunk.filter(|&(id, n)| self.chunk_can_queue(id, n));
        let mut folded = None;
        if chunk.is_none() || fold.is_some() {
            let idx: Vec<i32> = order.iter().map(|id| pos[id] as i32).collect();
            match ahead.tokens.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0) {
                Ok(current) => match self.queue_ahead(order, &current, fold) {
                    Ok(()) => folded = fold.map(|_| Ok(None)),
                    Err(e) => {
                        tracing::warn!(error = %e, "could not queue the next decode step");
                        folded = fold.map(|_| Err(e));
                    }
                },
                Err(e) => tracing::warn!(error = %e, "could not queue the next decode step"),
            }
        }
        let t2 = std::time::Instant::now();
        let host = host_ids(&ahead.tokens);
        let t3 = std::time::Instant::now();
        let outs = ids
            .iter()
            .map(|id| {
                if let Some((_, e)) = failed_join.as_ref().filter(|(f, _)| f == id) {
                    return Err(e.clone());
                }
                let t = host.as_ref().map_err(Clone::clone)?[pos[id]];
                let mut seq = self.seqs.remove(id).ok_or_else(|| internal(format!("decode of unknown request {id}")))?;
                let out = self.take_token(&mut seq, t, None);
                self.seqs.insert(*id, seq);
                out
            })
            .collect();
        let pre = match folded {
            Some(r) => Some(r),
            None => chunk.map(|(id, n)| self.prefill_inner(id, n)),
        };
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        self.parts = [ms(t1 - t0), ms(t2 - t1), ms(t3 - t2), ms(t3.elapsed())];
        (outs, pre)
    }

    fn decode_inner(&mut self, ids: &[ReqId]) -> Vec<Result<StepOut, WireError>> {
        if self.batches.is_some() {
            return self.decode_rows(ids, None).0;
        }
        let mut taken: Vec<(ReqId, Seq)> = ids.iter().filter_map(|id| self.seqs.remove(id).map(|s| (*id, s))).collect();
        let result = (|| {
            if taken.len() != ids.len() {
                return Err(internal("decode of an unknown request"));
            }
            let toks: Vec<i32> = taken.iter().map(|(_, s)| s.next.unwrap_or(0) as i32).collect();
            let x = Array::from_slice(&toks, &[toks.len() as i32, 1]);
            let mut caches: Vec<&mut SequenceCache> = taken.iter_mut().map(|(_, s)| &mut s.cache).collect();
            let logits = self.model.forward(&x, &mut caches, true).map_err(internal)?;
            let mut seqs: Vec<&mut Seq> = taken.iter_mut().map(|(_, s)| s).collect();
            choose(&logits, &mut seqs, self.tokenizer.as_ref())
        })();
        let out = match result {
            Ok(chosen) => taken
                .iter_mut()
                .zip(chosen)
                .map(|((_, s), (t, lp))| self.take_token(s, t, lp))
                .collect(),
            Err(e) => ids.iter().map(|_| Err(e.clone())).collect(),
        };
        for (id, s) in taken {
            self.seqs.insert(id, s);
        }
        out
    }

}
