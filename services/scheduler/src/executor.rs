//! What the scheduler asks of an executor ([`Executor`]) and what it gets back: a decode step's
//! outputs and a prefill chunk's outcome. The worker's role actors implement it through
//! messages; the tests implement it with fakes.

use llmq_protocol::{FinishReason, TokenLogprob, WireError};

/// A request's id inside the scheduler and its executor (one per sample of a job).
pub type ReqId = u64;

/// What one decode step or the end of a prefill produced for one sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOut {
    pub ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finished: Option<FinishReason>,
}

/// What a granted prefill chunk gave in a tick.
#[derive(Debug, Clone, PartialEq)]
pub enum Prefilled {
    /// The chunk is part-way through the model (an executor may spread a chunk's layers over
    /// several ticks, each carrying a part of its work): none of its tokens is done yet, and
    /// the scheduler grants the same chunk again at the next tick.
    Pending,
    /// The chunk is done; with the first output token when it completed the prompt. A chunk
    /// that completed its prompt may also give `None`: its first token then comes as that
    /// request's result of the next decode step (an executor that runs the chunk in a step queued
    /// ahead of the host does that).
    Done(Option<StepOut>),
}

pub type PrefillResult = Result<Prefilled, WireError>;

/// A tick's work done as two calls: the decode step, then the prefill chunk.
pub async fn step_separately<E: Executor + ?Sized>(
    executor: &mut E,
    decode: &[ReqId],
    prefill: Option<(ReqId, usize)>,
) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
    let outs = if decode.is_empty() {
        vec![]
    } else {
        executor.decode(decode).await
    };
    let pre = match prefill {
        Some((id, n)) => Some(executor.prefill(id, n).await.map(Prefilled::Done)),
        None => None,
    };
    (outs, pre)
}

/// The work the scheduler hands out. Implemented by the worker's prefill, decode and cache
/// actors (`llmq_worker::roles::RoleActors`, through messages) and by tests' fakes. Asynchronous because
/// the real work is done by other actors; a fake answers at once.
#[allow(async_fn_in_trait)]
pub trait Executor {
    /// Prefills the next `n` prompt tokens of `id`. When they complete the prompt, also samples
    /// the first output token and returns it (see [`Prefilled::Done`] for the one exception).
    async fn prefill(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError>;
    /// One batched decode step over `ids`; one result per id, in order.
    async fn decode(&mut self, ids: &[ReqId]) -> Vec<Result<StepOut, WireError>>;
    /// A tick's work: one decode step over `decode` and the prefill chunk, if any. An executor
    /// may run both in one pass (the decode results come first either way).
    async fn step(
        &mut self,
        decode: &[ReqId],
        prefill: Option<(ReqId, usize)>,
    ) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        step_separately(self, decode, prefill).await
    }
    /// Frees everything held for `ids` (each request once, whatever its end; an id the executor
    /// does not hold is ignored).
    async fn release(&mut self, ids: &[ReqId]);
    /// Drops the KV of `ids` but keeps everything else of them (sampler, constraint, the
    /// tokens generated): each is admitted again later ([`Executor::admit`]) and prefilled
    /// anew over its prompt and the tokens it generated before its next decode step. A chunk
    /// of theirs part-way through the model is abandoned.
    async fn preempt(&mut self, ids: &[ReqId]);
    /// Prepares an admitted request's prefill: returns how many of its prompt tokens were
    /// reused from the prefix cache (less than the prompt). An executor without one reuses none.
    async fn admit(&mut self, _id: ReqId) -> usize {
        0
    }
    /// Evicts cached prefixes until at most `max_bytes` are held; returns the bytes held.
    async fn prefix_trim(&mut self, _max_bytes: u64) -> u64 {
        0
    }
}
