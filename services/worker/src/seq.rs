//! One request's sequence as the prefill and decode actors hold it, and the pieces of work both
//! do on it: running a prompt chunk, sampling a token, stop checks and incremental text.
//!
//! Invariants: a `Seq` is held by exactly one actor at a time (the prefill actor until its
//! prompt is complete, the decode actor after; it moves between them only inside messages);
//! its `next` is the token the next decode step feeds; `history` is the prompt and every token
//! sampled so far.

use std::rc::Rc;

use llmq_engine::cache::SequenceCache;
use llmq_engine::generate::Finisher;
use llmq_engine::model::host_f32;
use llmq_text::sampling::{Sampler, Sampling, StopConditions};
use llmq_engine::Model;
use llmq_text::Tokenizer;
use llmq_protocol::{ErrorClass, TokenLogprob, WireError};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{Array, Dtype};

use llmq_scheduler::{ReqId, StepOut};

/// What the prefill and decode actors share: the model (one per worker, on the device thread)
/// and its tokenizer.
#[derive(Clone)]
pub struct Shared {
    pub model: Rc<Model>,
    pub tokenizer: Option<Rc<Tokenizer>>,
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
}

impl Seq {
    /// A new request's sequence. Its parameters were validated where the job entered the
    /// system; what only the loaded model can tell, that its prompt ids fit the vocabulary, is
    /// checked here, before any work is queued.
    pub fn new(shared: &Shared, prompt: Vec<u32>, sampling: Sampling, stop: StopConditions, salt: Option<String>) -> Result<Seq, WireError> {
        llmq_engine::generate::check_ids(&shared.model, &prompt)
            .map_err(|e| WireError::new(ErrorClass::InvalidRequest, e.to_string()))?;
        if prompt.is_empty() {
            return Err(WireError::new(ErrorClass::InvalidRequest, "empty prompt"));
        }
        let eos = shared.tokenizer.as_ref().map(|t| t.eos_ids.clone()).unwrap_or_default();
        Ok(Seq {
            cache: shared.model.new_cache(),
            history: prompt.clone(),
            prompt,
            prefilled: 0,
            salt,
            sampler: Sampler::new(sampling),
            finisher: Finisher::new(stop, eos),
            next: None,
            row: None,
        })
    }

    pub fn greedy(&self) -> bool {
        self.sampler.params().is_plain_greedy()
    }

    /// The prompt tokens of a chunk of `n` starting where prefill stands.
    pub fn chunk(&self, n: usize) -> Vec<u32> {
        self.prompt[self.prefilled..(self.prefilled + n).min(self.prompt.len())].to_vec()
    }

    /// Per-layer views of every position its own cache holds (None for a wrapped window).
    pub fn layers(&self, layers: usize) -> Option<Vec<(Array, Array)>> {
        (0..layers).map(|l| self.cache.contents(l)).collect()
    }

    /// Takes `id` as the sequence's next token and runs the stop checks.
    pub fn take_token(&mut self, tok: Option<&Tokenizer>, id: u32, lp: Option<TokenLogprob>) -> Result<StepOut, WireError> {
        self.history.push(id);
        self.next = Some(id);
        let (text, finished) = self.finisher.push(tok, id).map_err(internal)?;
        Ok(StepOut { ids: vec![id], text, logprobs: lp.into_iter().collect(), finished })
    }

    /// Samples the first output token from the prompt's last logits.
    pub fn first_token(&mut self, logits: &Array, tok: Option<&Tokenizer>) -> Result<StepOut, WireError> {
        let (t, lp) = choose(logits, &mut [&mut *self], tok)?.pop().expect("one row");
        self.take_token(tok, t, lp)
    }
}

/// Prefills the next `n` prompt tokens of `seq` on its own (not beside a decode step). Returns
/// the prompt's last logits when the chunk completed it; otherwise the chunk's work has run.
pub fn run_chunk(model: &Model, seq: &mut Seq, n: usize) -> Result<Option<Array>, WireError> {
    let chunk: Vec<i32> = seq.chunk(n).iter().map(|&t| t as i32).collect();
    let x = Array::from_slice(&chunk, &[1, chunk.len() as i32]);
    let logits = model.forward(&x, &mut [&mut seq.cache], true).map_err(internal)?;
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
    let piece = |id: u32| tok.and_then(|t| t.decode(&[id], false).ok()).unwrap_or_default();
    lp.text = piece(lp.token);
    lp.top_text = lp.top.iter().map(|&(id, _)| piece(id)).collect();
    lp
}

/// Greedy token of every row of `logits` [rows, 1, vocab], on the device (int32, lazy).
pub fn argmax_rows(logits: &Array, rows: i32) -> Result<Array, WireError> {
    let am = argmax_axis(&logits.reshape(&[rows, -1]).map_err(internal)?, -1, None).map_err(internal)?;
    am.as_dtype(Dtype::Int32).map_err(internal)
}

/// Token ids of an int32 device array, read on the host (waits for the device).
pub fn host_ids(a: &Array) -> Result<Vec<u32>, WireError> {
    Ok(a.try_as_slice::<i32>().map_err(internal)?.iter().map(|&v| v as u32).collect())
}

/// Picks each row's token: one device argmax for the whole batch, host sampling only for rows
/// that need it (temperature, penalties, logprobs).
pub fn choose(logits: &Array, seqs: &mut [&mut Seq], tok: Option<&Tokenizer>) -> Result<Vec<(u32, Option<TokenLogprob>)>, WireError> {
    let b = seqs.len() as i32;
    let rows = logits.reshape(&[b, -1]).map_err(internal)?;
    let greedy_ids: Option<Vec<u32>> = if seqs.iter().any(|s| s.greedy()) { Some(host_ids(&argmax_rows(logits, b)?)?) } else { None };
    let mut out = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter_mut().enumerate() {
        if s.greedy() {
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
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into())
}
