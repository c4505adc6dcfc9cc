//! A decode step queued ahead on the device: what it holds ([`Ahead`]) and how it is built and
//! launched. The decode actor's handling of it (queuing, delivering) is in `ahead.rs`.

use llmq_engine::batch::DecodeBatch;
use llmq_engine::model::ChunkStage;
use llmq_engine::Model;
use llmq_protocol::WireError;
use llmq_scheduler::ReqId;
use mlx_rs::Array;

use crate::seq::{argmax_rows, internal, Seq};

/// A decode step queued ahead: built from the previous step's greedy tokens while they were
/// still on the device, so the device starts it before the host has read those tokens, handled
/// them and come back for the next step (the host's share of a step is then hidden behind the
/// device's). Only when every row decodes greedily. A lent prefill chunk may share it; when
/// that chunk completes its prompt (a greedy request), the request's first token is the step's
/// last token, and its sequence (kept here) joins the decode batch when the step is delivered.
/// Rows that leave before it is consumed are simply ignored.
pub(super) struct Ahead {
    /// The requests it steps, in row order when it was queued.
    pub(super) order: Vec<ReqId>,
    /// Their tokens `[rows]` (int32, being evaluated), then the chunk's greedy token if a chunk
    /// shares the step; when `masked`, the step's logits instead (being evaluated), whose
    /// argmax is taken once its constrained rows' masks apply.
    pub(super) tokens: Array,
    pub(super) masked: bool,
    /// The request whose prompt the step's chunk completes, with its sequence: its first token
    /// is `tokens[rows]`.
    pub(super) completing: Option<(ReqId, Seq)>,
}

/// The graph of a decode step, built and not yet launched: its greedy tokens, one a row, then
/// the greedy token after the chunk (its logits instead when masked), the chunk's hidden state
/// when its stage stops short of the last layer, and the host's ms building it.
pub(super) struct Built {
    next: Array,
    hidden: Option<Array>,
    build_ms: f64,
}

/// Builds the decode step that follows one whose greedy tokens are `tokens` (on the device,
/// one a row), with a prefill chunk in the same pass when given.
pub(super) fn build_step(
    model: &Model,
    rows: &[Vec<ReqId>],
    batches: &mut [DecodeBatch],
    tokens: &Array,
    chunk: Option<ChunkStage>,
    masked: bool,
) -> Result<Built, WireError> {
    let t0 = std::time::Instant::now();
    let counts: Vec<Vec<u32>> = rows.iter().map(|g| vec![0; g.len()]).collect();
    let mut groups: Vec<(&[u32], &mut DecodeBatch)> = counts
        .iter()
        .map(|t| &t[..])
        .zip(batches.iter_mut())
        .collect();
    let (logits, hidden) = model
        .step_staged(&mut groups, Some(tokens), chunk)
        .map_err(internal)?;
    let next = if masked {
        logits
    } else {
        argmax_rows(&logits, logits.shape()[0])?
    };
    Ok(Built {
        next,
        hidden,
        build_ms: t0.elapsed().as_secs_f64() * 1000.0,
    })
}

impl Built {
    /// Launches the step without waiting for it; returns what it computes (being evaluated).
    /// `took`: the host's ms building the step's graph and launching it.
    pub(super) fn launch(self, took: &mut (f64, f64)) -> Result<(Array, Option<Array>), WireError> {
        let t1 = std::time::Instant::now();
        let mut pending = vec![&self.next];
        pending.extend(self.hidden.as_ref());
        mlx_rs::transforms::async_eval(pending).map_err(internal)?;
        *took = (self.build_ms, t1.elapsed().as_secs_f64() * 1000.0);
        Ok((self.next, self.hidden))
    }
}

/// Builds and launches, without waiting for it, the decode step that follows one whose greedy
/// tokens are `tokens` (see `build_step`, [`Built::launch`]).
pub(super) fn launch_step(
    model: &Model,
    rows: &[Vec<ReqId>],
    batches: &mut [DecodeBatch],
    tokens: &Array,
    chunk: Option<ChunkStage>,
    masked: bool,
    took: &mut (f64, f64),
) -> Result<(Array, Option<Array>), WireError> {
    build_step(model, rows, batches, tokens, chunk, masked)?.launch(took)
}
