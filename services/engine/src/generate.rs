//! One sequence from prompt to finish: chunked prefill, then decode with sampling and stop
//! conditions. This is the in-process path (`llmq generate --local`, `llmq bench single`);
//! the serving scheduler drives the same [`Model::forward`] tick by tick.
//!
//! Greedy decoding keeps one step in flight: the next step's graph is built on the device's
//! not-yet-read token and queued before the host reads the current one, so graph building
//! and the host's bookkeeping overlap the device's work.

use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::transforms::async_eval;
use mlx_rs::{Array, Dtype};

use llmq_text::detok::Detokenizer;
use llmq_text::sampling::{FinishReason, Sampler, Sampling, StopConditions, TokenLogprob};
use llmq_text::tokenizer::Tokenizer;

use crate::cache::SequenceCache;
use crate::error::{EngineError, Result};
use crate::model::{host_f32, Model};

#[derive(Debug, Clone)]
pub struct LocalRequest {
    pub prompt_ids: Vec<u32>,
    pub sampling: Sampling,
    pub stop: StopConditions,
    /// Prefill chunk size in tokens.
    pub prefill_chunk: usize,
}

#[derive(Debug, Clone)]
pub struct LocalOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub logprobs: Vec<TokenLogprob>,
    /// Prompt submitted to first token known on the host.
    pub ttft: Duration,
    /// Time between first and last token, over (tokens - 1) gaps.
    pub decode_time: Duration,
}

impl LocalOutput {
    pub fn ms_per_token(&self) -> f64 {
        let gaps = self.token_ids.len().saturating_sub(1).max(1);
        self.decode_time.as_secs_f64() * 1000.0 / gaps as f64
    }
}

/// Prefills `ids` into `cache` in chunks of at most `chunk` tokens; returns the last position's
/// logits [1, 1, vocab] (lazy).
pub fn prefill(
    model: &Model,
    cache: &mut SequenceCache,
    ids: &[u32],
    chunk: usize,
) -> Result<Array> {
    if ids.is_empty() {
        return Err(EngineError::InvalidRequest("empty prompt".into()));
    }
    let chunk = chunk.max(1);
    let mut last = None;
    for (i, part) in ids.chunks(chunk).enumerate() {
        let toks: Vec<i32> = part.iter().map(|&t| t as i32).collect();
        let x = Array::from_slice(&toks, &[1, toks.len() as i32]);
        let logits = model.forward(&x, &mut [&mut *cache], true)?;
        let is_last = (i + 1) * chunk >= ids.len();
        if is_last {
            last = Some(logits);
        } else {
            // Materialise this chunk's cache before building the next chunk's graph, so memory
            // stays bounded by one chunk's activations.
            mlx_rs::transforms::eval(&[logits])?;
        }
    }
    Ok(last.expect("ids is not empty"))
}

pub fn check_ids(model: &Model, ids: &[u32]) -> Result<()> {
    let vocab = model.config.vocab_size as u32;
    if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
        return Err(EngineError::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary ({vocab})"
        )));
    }
    Ok(())
}

/// Tracks one sequence's output text, stop strings, stop tokens and length limit.
pub struct Finisher {
    detok: Detokenizer,
    stop: StopConditions,
    eos: Vec<u32>,
    text: String,
    produced: usize,
}

impl Finisher {
    /// `eos`: the model's end-of-sequence ids (ignored when `stop.ignore_eos`).
    pub fn new(stop: StopConditions, eos: Vec<u32>) -> Self {
        let detok = if stop.special_text {
            Detokenizer::with_special_text()
        } else {
            Detokenizer::new()
        };
        Finisher {
            detok,
            stop,
            eos,
            text: String::new(),
            produced: 0,
        }
    }

    /// All text released so far (stop strings cut off).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Adds a generated token; returns the text to show and whether the sequence is finished.
    pub fn push(
        &mut self,
        tok: Option<&Tokenizer>,
        id: u32,
    ) -> Result<(String, Option<FinishReason>)> {
        self.produced += 1;
        if self.stop.stop_token_ids.contains(&id)
            || (!self.stop.ignore_eos && self.eos.contains(&id))
        {
            let rest = match tok {
                Some(t) => self.detok.flush(t)?,
                None => String::new(),
            };
            self.text.push_str(&rest);
            return Ok((rest, Some(FinishReason::Stop)));
        }
        let mut piece = match tok {
            Some(t) => self.detok.push(t, id)?,
            None => String::new(),
        };
        let before = self.text.len();
        self.text.push_str(&piece);
        // A stop string may straddle pieces: search the tail that could contain it.
        for s in &self.stop.stop {
            let from = before.saturating_sub(s.len());
            let from = (0..=from)
                .rev()
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(0);
            if let Some(pos) = self.text[from..].find(s.as_str()) {
                let cut = from + pos;
                self.text.truncate(cut);
                piece = if cut > before {
                    piece[..cut - before].to_string()
                } else {
                    String::new()
                };
                return Ok((piece, Some(FinishReason::Stop)));
            }
        }
        if self.produced >= self.stop.max_tokens as usize {
            return Ok((piece, Some(FinishReason::Length)));
        }
        Ok((piece, None))
    }
}

/// Generates one sequence, calling `on_token` with each token id and the text it completes.
/// The caller has validated the parameters ([`llmq_text::sampling::validate`]).
pub fn generate(
    model: &Model,
    tok: Option<&Tokenizer>,
    req: &LocalRequest,
    mut on_token: impl FnMut(u32, &str),
) -> Result<LocalOutput> {
    check_ids(model, &req.prompt_ids)?;
    let start = Instant::now();
    let mut cache = model.new_cache();
    let mut fin = Finisher::new(
        req.stop.clone(),
        tok.map(|t| t.eos_ids.clone()).unwrap_or_default(),
    );
    let mut out_ids = Vec::new();
    let mut logprobs = Vec::new();
    let mut first_at = None;
    let finish;
    let logits = prefill(model, &mut cache, &req.prompt_ids, req.prefill_chunk)?;

    if req.sampling.is_plain_greedy() {
        let next = |l: &Array| -> Result<Array> {
            Ok(argmax_axis(l.index((.., -1, ..)), -1, None)?.as_dtype(Dtype::Int32)?)
        };
        let mut y = next(&logits)?;
        async_eval([&y])?;
        loop {
            let y_next = next(&model.forward(&y.reshape(&[1, 1])?, &mut [&mut cache], true)?)?;
            async_eval([&y_next])?;
            let id = y.item_exact::<i32>() as u32;
            first_at.get_or_insert_with(Instant::now);
            out_ids.push(id);
            let (piece, done) = fin.push(tok, id)?;
            on_token(id, &piece);
            if let Some(r) = done {
                // Let the step in flight finish: nothing may still run on the device when the
                // cache and the arrays it writes are dropped.
                y_next.eval()?;
                finish = r;
                break;
            }
            y = y_next;
        }
    } else {
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut history = req.prompt_ids.clone();
        let mut logits = logits;
        loop {
            let row = host_f32(&logits.index((0, -1, ..)))?;
            let (id, lp) = sampler.sample(&row, &history);
            first_at.get_or_insert_with(Instant::now);
            out_ids.push(id);
            history.push(id);
            logprobs.extend(lp);
            let (piece, done) = fin.push(tok, id)?;
            on_token(id, &piece);
            if let Some(r) = done {
                finish = r;
                break;
            }
            logits = model.forward(
                &Array::from_slice(&[id as i32], &[1, 1]),
                &mut [&mut cache],
                true,
            )?;
        }
    }
    let now = Instant::now();
    let first_at = first_at.unwrap_or(now);
    Ok(LocalOutput {
        token_ids: out_ids,
        text: fin.text().to_string(),
        finish_reason: finish,
        logprobs,
        ttft: first_at - start,
        decode_time: now - first_at,
    })
}
