//! One request's sequence as the prefill and decode actors hold it, and the pieces of work both
//! do on it: running a prompt chunk, choosing a token (within its constraint, if it has one),
//! stop checks and incremental text.
//!
//! Invariants: a [`Seq`] is held by exactly one actor at a time (the prefill actor until its
//! prompt is complete, the decode actor after; it moves between them only inside messages);
//! its `next` is the token the next decode step feeds; `history` is the prompt and every token
//! sampled so far; a constrained sequence's matcher has followed every token of its output.

use std::cell::Cell;
use std::rc::Rc;

use llmq_engine::cache::SequenceCache;
use llmq_engine::generate::Finisher;
use llmq_engine::mask::MaskLayout;
use llmq_engine::model::host_f32;
use llmq_engine::prefix::KvPrefix;
use llmq_engine::Model;
use llmq_protocol::{Constraint, ErrorClass, Job, TokenLogprob, WireError};
use llmq_text::constraint::{Grammars, Matcher};
use llmq_text::sampling::{Sampler, Sampling, StopConditions};
use llmq_text::Tokenizer;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{Array, Dtype};

use llmq_scheduler::{ReqId, StepOut};

/// What the prefill and decode actors share: the model (one per worker, on the device thread),
/// its tokenizer, and what constrained decoding needs of both.
#[derive(Clone)]
pub struct Shared {
    pub model: Rc<Model>,
    pub tokenizer: Option<Rc<Tokenizer>>,
    /// Why the model cannot take constraints, when it cannot.
    pub constraints: Rc<Result<Constraints, String>>,
    /// What computing constrained rows' masks has cost, since start.
    pub mask_times: Rc<Cell<MaskTimes>>,
    /// Whether the worker keeps a prefix cache (sequences' KV is then copied for it).
    pub remembers: bool,
    /// For a model with recurrent states and a prefix cache of blocks of this many tokens: a
    /// prompt's states are kept where a prefill chunk ends at this many tokens times a power of
    /// two and one token before its end (see [`Shared::snapshot_at`]).
    pub snapshot_block: Option<usize>,
}

/// Steps with constrained rows, those rows, the host's wall time computing their masks
/// (wherever it ran), the device thread's time waiting for masks computed beside it
/// ([`MasksAhead`]), and the time it then still waited for the step's tokens (the device's share
/// left after the masks: masks are hidden behind the step as long as this stays above zero).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MaskTimes {
    pub steps: u64,
    /// Of those steps, the ones queued ahead (their masks computed while they ran).
    pub ahead: u64,
    pub rows: u64,
    /// Of those rows' masks, the ones computed beside the device's thread.
    pub beside: u64,
    pub mask_ms: f64,
    pub blocked_ms: f64,
    pub wait_ms: f64,
}

impl Shared {
    pub fn new(model: Model, tokenizer: Option<Tokenizer>, remembers: bool) -> Self {
        let constraints = match &tokenizer {
            None => Err("the model has no tokenizer".to_string()),
            Some(t) => {
                let vocab = model.config.vocab_size;
                Grammars::new(t, vocab, &t.eos_ids)
                    .map(|grammars| Constraints {
                        grammars,
                        layout: MaskLayout::new(vocab),
                    })
                    .map_err(|e| e.to_string())
            }
        };
        Shared {
            model: Rc::new(model),
            tokenizer: tokenizer.map(Rc::new),
            constraints: Rc::new(constraints),
            mask_times: Rc::default(),
            remembers,
            snapshot_block: None,
        }
    }

    /// Keeps recurrent states at chunk ends too (see `snapshot_block`).
    pub fn with_snapshots(mut self, block: usize) -> Self {
        self.snapshot_block =
            (self.remembers && self.model.config.recurrent()).then_some(block.max(1));
        self
    }

    /// Whether a prompt of `len` tokens prefilled up to `at` keeps its states there: `at` is
    /// the block size times a power of two, or one token before the prompt's end (where the
    /// scheduler ends a chunk: `SchedulerConfig::last_token_apart`). A prefix shared by many
    /// prompts (a system prompt) then resumes from at least half its length, the same prompt
    /// sent again (`n` samples, a retry) from its last token, and a prompt's snapshots together
    /// copy at most about three times its keys and values (each holds the attention layers'
    /// keys and values up to it). The prompt's end itself is not kept: a prompt extending it
    /// resumes one token earlier, and the request's end is kept when it leaves.
    pub fn snapshot_at(&self, at: usize, len: usize) -> bool {
        self.snapshot_block.is_some_and(|b| {
            at > 0 && (at + 1 == len || at.is_multiple_of(b) && (at / b).is_power_of_two())
        })
    }

    /// Whether a completed prompt is kept whole in the prefix cache as it joins the decode
    /// batch (not a hybrid model's: its states are kept one token before the end instead).
    pub fn remembers_prompt_end(&self) -> bool {
        self.remembers && self.snapshot_block.is_none()
    }

    /// A copy of a sequence's KV (`layers`, as [`Seq::layers`] gives it) for the prefix cache, or
    /// `None` without one (or without KV to keep). The copy is queued on the device at once:
    /// queued before any later write to the buffers it reads, it leaves them with no other
    /// reader, so those writes stay in place (a view kept past them would make each one copy
    /// its whole buffer).
    pub fn prefix_copy(&self, layers: Option<Vec<(Array, Array)>>) -> Option<KvPrefix> {
        let layers = layers.filter(|_| self.remembers)?;
        KvPrefix::copy_of(layers, self.model.config.recurrent())
            .inspect_err(|e| tracing::warn!(error = %e, "could not copy a prefix"))
            .ok()
    }
}

/// Constrained decoding for one model: constraints compiled against its vocabulary, and the
/// layout of its token masks on the device.
pub struct Constraints {
    pub grammars: Grammars,
    pub layout: MaskLayout,
}

/// What a new request's sequence is made of (its parameters validated where the job entered).
pub struct SeqSpec {
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    pub stop: StopConditions,
    /// Prefixes are shared only between requests with the same salt.
    pub salt: Option<String>,
    pub constraint: Option<Constraint>,
}

impl SeqSpec {
    pub fn new(prompt: Vec<u32>, sampling: Sampling, stop: StopConditions) -> Self {
        SeqSpec {
            prompt,
            sampling,
            stop,
            salt: None,
            constraint: None,
        }
    }

    pub fn of_job(job: Job) -> Self {
        let Job {
            prompt_ids,
            sampling,
            stop,
            cache_salt,
            constraint,
            ..
        } = job;
        SeqSpec {
            prompt: prompt_ids,
            sampling,
            stop,
            salt: cache_salt,
            constraint,
        }
    }

    /// Sample `choice` of a job: the job's parameters, its seed (when it has one) moved by the
    /// sample's index so that seeded samples differ yet repeat.
    pub fn sample(job: &Job, choice: u32) -> Self {
        let mut spec = SeqSpec::of_job(job.clone());
        spec.sampling.seed = spec.sampling.seed.map(|s| s.wrapping_add(choice as u64));
        spec
    }
}

pub struct Seq {
    pub cache: SequenceCache,
    pub prompt: Vec<u32>,
    pub prefilled: usize,
    /// Prefixes are shared only between requests with the same salt.
    pub salt: Option<String>,
    pub sampler: Sampler,
    pub history: Vec<u32>,
    pub finisher: Finisher,
    /// The token sampled last: the next decode step's input.
    pub next: Option<u32>,
    /// (length group, row) in the decode batches, once it decodes there.
    pub row: Option<(usize, usize)>,
    /// Where its output stands in its constraint, if it has one.
    pub matcher: Option<Matcher>,
    /// The token taken last, which its matcher follows when the next mask is computed: the
    /// rows' matchers follow their tokens in parallel there, not one by one as tokens are taken.
    pub unfollowed: Option<u32>,
    /// Its next token's mask, computed ahead ([`MasksAhead`]): its matcher has followed every
    /// token taken.
    pub mask: Option<Vec<u32>>,
    /// Why its constraint allows no next token (found while masking): its step fails with it.
    pub stuck: Option<String>,
}

impl Seq {
    /// A new request's sequence. Its parameters were validated where the job entered the
    /// system; what only the loaded model can tell, that its prompt ids fit the vocabulary, is
    /// checked here, before any work is queued.
    pub fn new(shared: &Shared, spec: SeqSpec) -> Result<Seq, WireError> {
        let SeqSpec {
            prompt,
            sampling,
            stop,
            salt,
            constraint,
        } = spec;
        let invalid = |m: String| WireError::new(ErrorClass::InvalidRequest, m);
        llmq_engine::generate::check_ids(&shared.model, &prompt)
            .map_err(|e| invalid(e.to_string()))?;
        if prompt.is_empty() {
            return Err(invalid("empty prompt".into()));
        }
        let matcher = match constraint {
            None => None,
            Some(c) => {
                let cs = shared.constraints.as_ref().as_ref().map_err(|why| {
                    invalid(format!("this model cannot take a constraint: {why}"))
                })?;
                Some(
                    cs.grammars
                        .matcher(&c)
                        .map_err(|e| invalid(e.to_string()))?,
                )
            }
        };
        let eos = shared
            .tokenizer
            .as_ref()
            .map(|t| t.eos_ids.clone())
            .unwrap_or_default();
        Ok(Seq {
            // Room for the prompt and its first token: the cache never grows during prefill,
            // and joins the decode batch without a copy.
            cache: shared.model.new_cache_for(prompt.len() + 1),
            history: prompt.clone(),
            prompt,
            prefilled: 0,
            salt,
            sampler: Sampler::new(sampling),
            finisher: Finisher::new(stop, eos),
            next: None,
            row: None,
            matcher,
            unfollowed: None,
            mask: None,
            stuck: None,
        })
    }

    /// Whether its next token is the raw logits' argmax, which the device can pick and feed
    /// to the next step without the host (so never for a constrained sequence: its mask needs
    /// the host's matcher to have followed the token before).
    pub fn greedy(&self) -> bool {
        self.matcher.is_none() && self.device_greedy()
    }

    /// Whether its next token is the argmax of its logits (restricted to what its constraint
    /// allows, when it has one): the device picks it, no logits go to the host.
    pub fn device_greedy(&self) -> bool {
        self.sampler.params().is_plain_greedy()
    }

    /// The prompt tokens of a chunk of `n` starting where prefill stands.
    pub fn chunk(&self, n: usize) -> Vec<u32> {
        self.prompt[self.prefilled..(self.prefilled + n).min(self.prompt.len())].to_vec()
    }

    /// What the prefix cache keeps of its own cache: per layer views of every position, or a
    /// recurrent layer's state (None for a wrapped window; see
    /// [`llmq_engine::cache::SequenceCache::prefix_layers`]).
    pub fn layers(&self) -> Option<Vec<(Array, Array)>> {
        self.cache.prefix_layers()
    }

    /// Takes `id` as the sequence's next token and runs the stop checks.
    /// A constrained sequence's matcher follows the token later (or is following it already,
    /// away in [`MasksAhead`]).
    pub fn take_token(
        &mut self,
        tok: Option<&Tokenizer>,
        id: u32,
        lp: Option<TokenLogprob>,
    ) -> Result<StepOut, WireError> {
        if let Some(why) = self.stuck.take() {
            return Err(WireError::new(ErrorClass::ConstraintFailed, why));
        }
        if self.matcher.is_some() {
            self.unfollowed = Some(id);
        }
        self.history.push(id);
        self.next = Some(id);
        let (text, finished) = self.finisher.push(tok, id).map_err(internal)?;
        Ok(StepOut {
            ids: vec![id],
            text,
            logprobs: lp.into_iter().collect(),
            finished,
        })
    }

    /// After a preemption: its KV is gone; it is prefilled again over everything it has
    /// seen (its prompt and the tokens it generated), and the chunk that completes that samples
    /// its next token, as a decode step would have.
    pub fn start_over(&mut self, model: &Model) {
        self.prompt = self.history.clone();
        self.prefilled = 0;
        self.row = None;
        self.cache = model.new_cache_for(self.prompt.len() + 1);
    }

    /// Samples the first output token from the prompt's last logits.
    pub fn first_token(&mut self, logits: &Array, shared: &Shared) -> Result<StepOut, WireError> {
        let (t, lp) = choose(logits, &mut [&mut *self], shared)?
            .pop()
            .expect("one row");
        self.take_token(shared.tokenizer.as_deref(), t, lp)
    }
}

/// Prefills the next `n` prompt tokens of `seq` on its own (not beside a decode step). Returns
/// the prompt's last logits when the chunk completed it; otherwise the chunk's work has run.
pub fn run_chunk(model: &Model, seq: &mut Seq, n: usize) -> Result<Option<Array>, WireError> {
    let chunk: Vec<i32> = seq.chunk(n).iter().map(|&t| t as i32).collect();
    let x = Array::from_slice(&chunk, &[1, chunk.len() as i32]);
    let logits = model
        .forward(&x, &mut [&mut seq.cache], true)
        .map_err(internal)?;
    seq.prefilled += chunk.len();
    if seq.prefilled < seq.prompt.len() {
        // Materialise the cache now: the chunk's work belongs to this tick.
        logits.eval().map_err(internal)?;
        return Ok(None);
    }
    Ok(Some(logits))
}

pub fn internal(e: impl std::fmt::Display) -> WireError {
    WireError::new(ErrorClass::Internal, e.to_string())
}

pub fn unknown(what: &str, id: ReqId) -> WireError {
    internal(format!("{what} of unknown request {id}"))
}

/// The sampler's logprob with the token's and the alternatives' texts.
fn with_texts(mut lp: TokenLogprob, tok: Option<&Tokenizer>) -> TokenLogprob {
    let piece = |id: u32| {
        tok.and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_default()
    };
    lp.text = piece(lp.token);
    lp.top_text = lp.top.iter().map(|&(id, _)| piece(id)).collect();
    lp
}

/// Each row's token mask (`words` words; every token for an unconstrained row or a row without
/// a sequence): a mask computed ahead where the row has one, the other constrained rows'
/// computed here, in parallel on the host's cores. A row whose constraint allows nothing is
/// marked stuck (its mask then allows everything; its step fails).
fn token_masks<'a>(rows: impl IntoIterator<Item = Option<&'a mut Seq>>, words: usize) -> Vec<u32> {
    use rayon::prelude::*;
    let rows: Vec<Option<&mut Seq>> = rows.into_iter().collect();
    let mut masks = vec![u32::MAX; rows.len() * words];
    type Row<'r> = (
        &'r mut Matcher,
        Option<u32>,
        &'r mut Option<String>,
        &'r mut [u32],
    );
    let mut work: Vec<Row> = vec![];
    for (s, mask) in rows.into_iter().zip(masks.chunks_mut(words)) {
        let Some(Seq {
            matcher: Some(m),
            unfollowed,
            stuck,
            mask: ready,
            ..
        }) = s
        else {
            continue;
        };
        match ready.take() {
            _ if stuck.is_some() => {}
            Some(ready) if ready.len() == words && unfollowed.is_none() => {
                mask.copy_from_slice(&ready)
            }
            _ => work.push((m, unfollowed.take(), stuck, mask)),
        }
    }
    // Each row's matcher follows its last token, then writes what may come next.
    let one = |(m, last, stuck, mask): &mut Row| {
        if let Err(why) = follow(m, *last, mask) {
            **stuck = Some(why);
            mask.fill(u32::MAX);
        }
    };
    if work.len() == 1 {
        work.iter_mut().for_each(one);
    } else {
        work.par_iter_mut().for_each(one);
    }
    masks
}

/// A matcher follows `last` (when given), then writes into `mask` what may come next.
fn follow(m: &mut Matcher, last: Option<u32>, mask: &mut [u32]) -> Result<(), String> {
    last.map_or(Ok(()), |t| m.accept(t))
        .and_then(|()| m.allowed(mask))
}

/// What computing masks ahead gave back: each row's matcher and its next mask (or why its
/// constraint allows nothing), and the work's wall time (ms).
type Followed = (Vec<(Matcher, Result<Vec<u32>, String>)>, f64);

/// Constrained rows' next masks, computed on the host's other cores while the device's thread
/// goes on (launches the next step, hands out tokens): each row's matcher, moved out of its
/// sequence, follows the token just read and writes what may come next. `finish` puts
/// matchers and masks back before anything else needs them.
pub struct MasksAhead {
    ids: Vec<ReqId>,
    done: std::sync::mpsc::Receiver<Followed>,
}

impl MasksAhead {
    /// Starts the masks of `rows` (a sequence and the token just read for it; rows without a
    /// constraint, or already stuck, are left out); None when no row is left (or the model
    /// takes no constraints).
    pub fn start<'a>(
        shared: &Shared,
        rows: impl IntoIterator<Item = (ReqId, &'a mut Seq, u32)>,
    ) -> Option<MasksAhead> {
        use rayon::prelude::*;
        let words = shared.constraints.as_ref().as_ref().ok()?.layout.words();
        let mut ids = vec![];
        let mut work = vec![];
        for (id, s, token) in rows {
            if s.stuck.is_some() {
                continue;
            }
            let Some(m) = s.matcher.take() else { continue };
            // A token taken before without a mask after it (none is, as steps go) comes first.
            if let Some(t) = s.unfollowed.take() {
                work.push((m, vec![t, token]));
            } else {
                work.push((m, vec![token]));
            }
            s.mask = None;
            ids.push(id);
        }
        if ids.is_empty() {
            return None;
        }
        let (tx, done) = std::sync::mpsc::sync_channel(1);
        rayon::spawn(move || {
            let t0 = std::time::Instant::now();
            // A panic here loses the matchers (nothing is sent): `finish` marks their rows stuck.
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                work.into_par_iter()
                    .map(|(mut m, tokens)| {
                        let mut mask = vec![0u32; words];
                        let (last, before) = tokens.split_last().expect("one token at least");
                        let r = before
                            .iter()
                            .try_for_each(|&t| m.accept(t))
                            .and_then(|()| follow(&mut m, Some(*last), &mut mask))
                            .map(|()| mask);
                        (m, r)
                    })
                    .collect::<Vec<_>>()
            }));
            if let Ok(out) = out {
                let _ = tx.send((out, t0.elapsed().as_secs_f64() * 1000.0));
            }
        });
        Some(MasksAhead { ids, done })
    }

    /// Waits for the masks and puts them, with their matchers, back into the sequences still
    /// held in `seqs` (the others' are dropped); counts the work and the wait in `times`.
    pub fn finish(self, seqs: &mut std::collections::HashMap<ReqId, Seq>, times: &Cell<MaskTimes>) {
        let t0 = std::time::Instant::now();
        let got = self.done.recv();
        let mut m = times.get();
        m.blocked_ms += t0.elapsed().as_secs_f64() * 1000.0;
        match got {
            Ok((rows, ms)) => {
                m.mask_ms += ms;
                m.beside += rows.len() as u64;
                for (id, (matcher, mask)) in self.ids.into_iter().zip(rows) {
                    let Some(s) = seqs.get_mut(&id) else { continue };
                    s.matcher = Some(matcher);
                    match mask {
                        Ok(mask) => s.mask = Some(mask),
                        Err(why) => s.stuck = Some(why),
                    }
                }
            }
            Err(_) => {
                for id in self.ids {
                    if let Some(s) = seqs.get_mut(&id) {
                        s.stuck = Some("computing the constraint's next tokens failed".into());
                    }
                }
            }
        }
        times.set(m);
    }
}

/// `logits` [rows, ..] restricted, row by row, to what each row's constraint allows (`rows`: the
/// sequence of each row, None for a row without one), and the masks' cost counted. The masks
/// are computed while the device computes the logits.
pub fn restrict_rows<'a>(
    shared: &Shared,
    logits: &Array,
    rows: impl IntoIterator<Item = Option<&'a mut Seq>>,
) -> Result<Array, WireError> {
    masked(shared, logits, rows, |layout, masks| {
        layout.restrict(logits, masks)
    })
}

/// Each row's greedy token among those its constraint allows (int32 `[rows]`, lazy), as
/// `argmax_rows` of `restrict_rows` but without the restricted logits (see [`MaskLayout::argmax`]).
pub fn restricted_argmax<'a>(
    shared: &Shared,
    logits: &Array,
    rows: impl IntoIterator<Item = Option<&'a mut Seq>>,
) -> Result<Array, WireError> {
    masked(shared, logits, rows, |layout, masks| {
        layout.argmax(logits, masks)
    })
}

/// The rows' masks, computed while the device computes `logits` and counted, then `apply`
/// (its time counted as waited after the masks).
fn masked<'a>(
    shared: &Shared,
    logits: &Array,
    rows: impl IntoIterator<Item = Option<&'a mut Seq>>,
    apply: impl FnOnce(&MaskLayout, &[u32]) -> llmq_engine::Result<Array>,
) -> Result<Array, WireError> {
    let cs = shared.constraints.as_ref().as_ref().map_err(internal)?;
    mlx_rs::transforms::async_eval([logits]).map_err(internal)?;
    let t0 = std::time::Instant::now();
    let rows: Vec<Option<&mut Seq>> = rows.into_iter().collect();
    let constrained = rows
        .iter()
        .filter(|s| s.as_ref().is_some_and(|s| s.matcher.is_some()))
        .count();
    let masks = token_masks(rows, cs.layout.words());
    let mut m = shared.mask_times.get();
    m.steps += 1;
    m.rows += constrained as u64;
    m.mask_ms += t0.elapsed().as_secs_f64() * 1000.0;
    shared.mask_times.set(m);
    // On a CPU the argmax waits for the logits (it runs on the host): a wait after the masks.
    let t1 = std::time::Instant::now();
    let out = apply(&cs.layout, &masks).map_err(internal)?;
    waited_after_masks(shared, t1);
    Ok(out)
}

/// Counts the time the host waited for a masked step's results after its masks.
pub fn waited_after_masks(shared: &Shared, since: std::time::Instant) {
    let mut m = shared.mask_times.get();
    m.wait_ms += since.elapsed().as_secs_f64() * 1000.0;
    shared.mask_times.set(m);
}

/// Greedy token of every row of `logits` [rows, 1, vocab], on the device (int32, lazy).
pub fn argmax_rows(logits: &Array, rows: i32) -> Result<Array, WireError> {
    let am =
        argmax_axis(&logits.reshape(&[rows, -1]).map_err(internal)?, -1, None).map_err(internal)?;
    am.as_dtype(Dtype::Int32).map_err(internal)
}

/// Token ids of an int32 device array, read on the host (waits for the device).
pub fn host_ids(a: &Array) -> Result<Vec<u32>, WireError> {
    Ok(a.try_as_slice::<i32>()
        .map_err(internal)?
        .iter()
        .map(|&v| v as u32)
        .collect())
}

/// Picks each row's token: one device argmax for the whole batch, host sampling only for rows
/// that need it (temperature, penalties, logprobs). Constrained rows' logits are restricted to
/// the tokens their constraints allow; the masks are computed on the host while the device
/// computes the logits.
pub fn choose(
    logits: &Array,
    seqs: &mut [&mut Seq],
    shared: &Shared,
) -> Result<Vec<(u32, Option<TokenLogprob>)>, WireError> {
    let tok = shared.tokenizer.as_deref();
    let b = seqs.len() as i32;
    let mut rows = logits.reshape(&[b, -1]).map_err(internal)?;
    let masked = seqs.iter().any(|s| s.matcher.is_some());
    if masked && seqs.iter().all(|s| s.device_greedy()) {
        // No logits go to the host: the restricted greedy tokens straight from the device.
        let ids = restricted_argmax(shared, &rows, seqs.iter_mut().map(|s| Some(&mut **s)))?;
        let masks_done = std::time::Instant::now();
        let ids = host_ids(&ids)?;
        waited_after_masks(shared, masks_done);
        return Ok(ids.into_iter().map(|t| (t, None)).collect());
    }
    if masked {
        rows = restrict_rows(shared, &rows, seqs.iter_mut().map(|s| Some(&mut **s)))?;
    }
    let masks_done = std::time::Instant::now();
    let greedy_ids: Option<Vec<u32>> = if seqs.iter().any(|s| s.device_greedy()) {
        Some(host_ids(&argmax_rows(&rows, b)?)?)
    } else {
        None
    };
    if masked {
        if greedy_ids.is_none() {
            rows.eval().map_err(internal)?;
        }
        waited_after_masks(shared, masks_done);
    }
    let mut out = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter_mut().enumerate() {
        if s.device_greedy() {
            out.push((greedy_ids.as_ref().expect("computed above")[i], None));
        } else {
            let row = host_f32(&rows.index(i as i32)).map_err(internal)?;
            let (t, lp) = s.sampler.sample(&row, &s.history);
            out.push((t, lp.map(|lp| with_texts(lp, tok))));
        }
    }
    Ok(out)
}

/// Work time and calls of one actor since start (or since the counters were reset).
#[derive(Debug, Clone, Copy, Default)]
pub struct Busy {
    pub calls: u64,
    pub time: std::time::Duration,
}

impl Busy {
    /// Runs `f`, counting its time (and a call when `call`).
    pub fn time<T>(&mut self, call: bool, f: impl FnOnce() -> T) -> T {
        let t0 = std::time::Instant::now();
        let r = f();
        self.time += t0.elapsed();
        self.calls += call as u64;
        r
    }
    pub fn ms(&self) -> f64 {
        self.time.as_secs_f64() * 1000.0
    }
}

/// Runs an actor's handler body; a panic inside it becomes `Err` with its message (the caller
/// then resets the actor's state), so no panic crosses the actor's boundary.
pub fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(panic_text)
}

/// A panic's message.
pub fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}
