//! The warm-up: dummy requests through a private scheduler before the worker takes jobs, so
//! that MLX has planned the kernels of every kind of step a burst of long prompts meets.

use std::panic::AssertUnwindSafe;

use actix::prelude::*;
use futures::FutureExt;
use llmq_protocol::{Event, WireError};
use llmq_scheduler::{Admission, ReqId, Scheduler, SchedulerConfig};
use llmq_text::sampling::{Sampling, StopConditions};

use super::{now, SchedulerActor, WorkerExecutor};
use crate::seq::{panic_text, SeqSpec};

/// Runs dummy requests through a private scheduler before the worker takes jobs, so that MLX
/// has built the kernels (and the allocator holds the buffers) of every kind of step before the
/// first user's request: a long one (`tokens`) prefilled alone, then one round per entry of
/// `rows`: that many short ones prefilled and decoding, and two long ones prefilled chunk by
/// chunk in the same steps as their decode, the first then decoding in a length group of its
/// own beside the second's chunks, everything to its end. On a GPU the first step of each new
/// shape otherwise stalls the streams while MLX plans it (a burst's first chunks, the tick in
/// which a long prompt joins many decoding streams). Answers with the milliseconds it took. Leaves nothing behind.
#[derive(Message)]
#[rtype(result = "Result<f64, WarmUpError>")]
pub struct WarmUp {
    /// Prompt tokens of the long dummy requests (capped by the context and the KV budget).
    pub tokens: usize,
    /// Short requests decoding in each round (at least one round).
    pub rows: Vec<usize>,
}

/// Why a warm-up did not complete (the worker then serves anyway, its first requests slower).
#[derive(Debug, thiserror::Error)]
pub enum WarmUpError {
    #[error("the executor is busy")]
    Busy,
    #[error("a dummy request was refused: {0}")]
    Refused(WireError),
    #[error("a dummy request ended with {0:?}")]
    Ended(Event),
    #[error("the dummy requests did not finish")]
    Stuck,
    #[error("panic during warm-up: {0}")]
    Panic(String),
}

/// Rows of the warm-up's rounds on a GPU: one round for each size the decode batch's buffers
/// take up to `max_batch` (they grow by doubling from 4 rows), so that every row count's step
/// shapes (the matrix products' sizes follow the batch's slots) have run once: 1, 5, 9, 17, 33
/// rows for a batch of 64, leaving room for the two long prompts.
pub fn warm_up_rows(max_batch: usize) -> Vec<usize> {
    let mut rows = vec![1];
    let mut slots = 8;
    while slots / 2 + 1 + 2 <= max_batch {
        rows.push(slots / 2 + 1);
        slots *= 2;
    }
    rows
}

/// The warm-up's dummy requests, through a private scheduler and `executor`, to their end.
async fn warm_up<E: WorkerExecutor>(
    executor: &mut E,
    cfg: SchedulerConfig,
    w: WarmUp,
) -> Result<(), WarmUpError> {
    // Chunks of a fixed size per round (the tick budget's choices depend on measured times).
    let fixed = |size: usize| SchedulerConfig {
        prefill_chunk: size,
        tick_budget: 0.0,
        ..cfg.clone()
    };
    let mut s = Scheduler::new(fixed(cfg.prefill_chunk));
    let sizes = cfg.chunk_sizes();
    let context = executor.context_tokens().saturating_sub(8);
    let fits = (cfg.kv_budget_bytes / executor.kv_bytes_per_token().max(1)) as usize;
    let short = 16.min(context / 4).max(1);
    let most_rows = w
        .rows
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .clamp(1, cfg.max_batch.saturating_sub(2).max(1));
    // Ticks of one long prefill in chunks of `size` beside decoding rows (a chunk may take
    // several: its stages).
    let ticks = |executor: &E, size: usize, tokens: usize| {
        tokens.div_ceil(size.max(1)) * executor.chunk_ticks(size)
    };
    // The short ones' reservations, at most (their outputs last two long prefills in the
    // chunks that take the most ticks).
    let most_chunks = sizes
        .iter()
        .map(|&size| ticks(executor, size, w.tokens))
        .max()
        .unwrap_or(1);
    // Each running request's recurrent states count as `state_tokens` positions too.
    let short_room = most_rows * (short + 2 * most_chunks + 8 + most_rows + cfg.state_tokens);
    let long_room = fits
        .saturating_sub(short_room)
        .saturating_sub(2 * cfg.state_tokens);
    let long = w.tokens.min(context).min(long_room * 3 / 8).max(1);
    // MLX plans kernels, cuDNN attention and matrix products once per shape, tens of ms each on
    // a GPU. The phases below make the shapes a burst of long prompts meets: a long prompt
    // alone (the idle executor's large prefill steps); then, per round, short ones decoding
    // throughout and two long ones together, the first chunked beside the short ones' decode,
    // then decoding as a length group of its own beside the second's chunks. One round per
    // size of the decode batch with the largest chunks, then one with each smaller chunk size
    // the tick budget may grant (its attention shapes; the decode batch's are met already; a
    // CPU plans nothing).
    let out = |n: usize| n.min(context.saturating_sub(long.max(short))).max(1);
    // (chunk size, short requests decoding) per round
    let mut rounds: Vec<(usize, usize)> = w
        .rows
        .iter()
        .chain(w.rows.is_empty().then_some(&1))
        .map(|&n| (cfg.prefill_chunk, n))
        .collect();
    if llmq_engine::on_gpu() {
        rounds.extend(
            sizes
                .iter()
                .filter(|&&size| size != cfg.prefill_chunk)
                .map(|&size| (size, 1)),
        );
    }
    let dummy = |prompt, max_tokens| Dummy { prompt, max_tokens };
    let mut phases = vec![Phase {
        requests: vec![dummy(long, 1)],
        until_decoding: false,
        chunk: cfg.prefill_chunk,
    }];
    for (size, n) in rounds {
        let n = n.clamp(1, most_rows);
        let chunks = ticks(executor, size, long);
        phases.push(Phase {
            requests: vec![dummy(short, out(2 * chunks + 8 + n)); n],
            until_decoding: true,
            chunk: size,
        });
        phases.push(Phase {
            requests: vec![dummy(long, out(chunks + 4)), dummy(long, 4)],
            until_decoding: false,
            chunk: size,
        });
    }
    let dummies: usize = phases.iter().map(|p| p.requests.len()).sum();
    let mut id = ReqId::MAX - dummies as ReqId - 1;
    for phase in &phases {
        let (until_decoding, size) = (&phase.until_decoding, &phase.chunk);
        if *size != s.config().prefill_chunk && s.is_idle() {
            s = Scheduler::new(fixed(*size));
        }
        for &Dummy {
            prompt: len,
            max_tokens,
        } in &phase.requests
        {
            id += 1;
            let prompt: Vec<u32> = (0..len as u32)
                .map(|i| 1 + (i * 7 + (id % 50) as u32) % 50)
                .collect();
            let stop = StopConditions {
                max_tokens: max_tokens as u32,
                ignore_eos: true,
                ..Default::default()
            };
            executor
                .register(id, SeqSpec::new(prompt, Sampling::default(), stop))
                .await
                .map_err(WarmUpError::Refused)?;
            let a = Admission {
                id,
                prompt_tokens: len,
                max_tokens,
                accepted_at: now(),
                after: None,
            };
            if let Some(e) = s.submit(a).into_iter().find(|e| e.event.is_terminal()) {
                return Err(WarmUpError::Ended(e.event));
            }
        }
        // A phase of short ones ends when none is waiting or prefilling any more (all decode,
        // unless one already finished); the others run to their end.
        let mut ticks = 0;
        while if *until_decoding {
            s.queued_requests() > 0
        } else {
            !s.is_idle()
        } {
            let (emits, _) = s.tick(executor, now()).await;
            if let Some(e) = emits
                .into_iter()
                .find(|e| matches!(e.event, Event::Error { .. }))
            {
                return Err(WarmUpError::Ended(e.event));
            }
            ticks += 1;
            if ticks > 1_000_000 {
                return Err(WarmUpError::Stuck);
            }
        }
    }
    executor.prefix_clear().await;
    executor.reset_counters().await;
    Ok(())
}

impl<E: WorkerExecutor + Unpin + 'static> Handler<WarmUp> for SchedulerActor<E> {
    type Result = AtomicResponse<Self, Result<f64, WarmUpError>>;
    fn handle(&mut self, w: WarmUp, _: &mut Context<Self>) -> Self::Result {
        let started = std::time::Instant::now();
        let cfg = self.cfg.clone();
        self.exchange(
            Err(WarmUpError::Busy),
            move |mut executor| async move {
                let run = AssertUnwindSafe(warm_up(&mut executor, cfg, w))
                    .catch_unwind()
                    .await;
                let run = run.unwrap_or_else(|p| Err(WarmUpError::Panic(panic_text(p))));
                if run.is_err() {
                    // Nothing of it stays behind.
                    executor.reset().await;
                    executor.prefix_clear().await;
                }
                (executor, run)
            },
            move |run, act, _| {
                act.refresh_snapshot();
                run.map(|()| started.elapsed().as_secs_f64() * 1000.0)
            },
        )
    }
}

/// A dummy request of the warm-up: its prompt's tokens and the most it generates.
#[derive(Debug, Clone, Copy)]
struct Dummy {
    prompt: usize,
    max_tokens: usize,
}

/// Dummy requests submitted together; the phase ends when they all decode (`until_decoding`)
/// or when they have all ended; `chunk`: the prefill chunk size the scheduler grants.
struct Phase {
    requests: Vec<Dummy>,
    until_decoding: bool,
    chunk: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_rounds_cover_every_size_of_the_decode_batch() {
        // The batch's buffers hold 4, 8, 16, ... rows: one round with a row count of each size.
        assert_eq!(warm_up_rows(64), vec![1, 5, 9, 17, 33]);
        assert_eq!(warm_up_rows(8), vec![1, 5]);
        assert_eq!(warm_up_rows(4), vec![1]);
        assert_eq!(warm_up_rows(1), vec![1]);
    }
}
