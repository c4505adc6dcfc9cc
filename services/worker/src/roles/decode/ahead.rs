//! The decode step queued ahead: launched from the previous step's greedy tokens while they
//! are still on the device, delivered at the next [`Step`] (a completed prompt joining, the next
//! step queued, then this one's tokens read). With constrained rows, the step is queued without
//! its tokens: its logits wait for the rows' masks. Those are computed beside the device's
//! thread ([`MasksAhead`]), from the tokens read just before the next step's launch (its graph
//! built meanwhile), so they are ready at the next delivery and only their copy to the device
//! stands between the step's logits and its tokens.

use std::collections::HashMap;

use llmq_protocol::WireError;
use llmq_scheduler::ReqId;
use mlx_rs::Array;

use super::queued::{build_step, Ahead};
use super::staging::InFlight;
use super::{ChunkOutcome, DecodeActor, Stepped};
use crate::roles::messages::StepTimes;
use crate::seq::{
    host_ids, internal, restricted_argmax, unknown, waited_after_masks, MasksAhead, Seq,
};

impl DecodeActor {
    /// Drops a step queued ahead, after waiting for it: no device work queued here outlives
    /// its use (a step still running on MLX's stream thread when the process exits can meet
    /// freed memory; a test binary once aborted at exit with a corrupted heap).
    pub(super) fn discard_ahead(&mut self) {
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

    /// Queues the decode step that follows one whose greedy tokens are `tokens` (on the
    /// device), for the rows `order`, with the granted chunk's next stage (see
    /// `chunk_can_queue`) in the same pass; the stage then counts as done. `before_launch` runs
    /// between the step's graph being built and its launch. On failure nothing is queued (the
    /// next step is built as usual) and the chunk comes back with the error.
    pub(super) fn queue_ahead(
        &mut self,
        order: Vec<ReqId>,
        tokens: &Array,
        mut chunk: Option<InFlight>,
        before_launch: impl FnOnce(&mut Self),
    ) -> Result<Option<ChunkOutcome>, (WireError, Option<InFlight>)> {
        let Some(mut batches) = self.batches.take() else {
            return Err((internal("no decode batches"), chunk));
        };
        let end = chunk.as_ref().map_or(0, |c| self.stage_end(c, true));
        let toks: Option<Vec<u32>> = chunk.as_ref().map(|c| c.lent.seq.chunk(c.lent.n));
        let part = chunk
            .as_mut()
            .zip(toks.as_ref())
            .map(|(c, t)| c.stage(t, end));
        let masked = order
            .iter()
            .any(|id| self.seqs.get(id).is_some_and(|s| s.matcher.is_some()));
        let built = build_step(
            &self.shared.model,
            &self.rows,
            &mut batches,
            tokens,
            part,
            masked,
        );
        self.batches = Some(batches);
        let queued = built.and_then(|b| {
            before_launch(self);
            b.launch(&mut self.launched)
        });
        match queued {
            Ok((tokens, hidden)) => {
                self.ahead = Some(Ahead {
                    order,
                    tokens,
                    masked,
                    completing: None,
                });
                Ok(chunk.map(|c| {
                    self.chunks_ahead.run += (end == self.shared.model.num_layers()) as u64;
                    self.stage_done(c, end, hidden, None)
                }))
            }
            Err(e) => Err((e, chunk)),
        }
    }

    /// The tokens of a masked step queued ahead for the rows `order` (then any row of a chunk
    /// sharing the step, unconstrained): the argmax of its `logits` restricted by the rows'
    /// constraints (rows that left since are not masked; their tokens are ignored), launched
    /// at once so that they can be read as soon as the step is done.
    fn masked_tokens(&mut self, order: &[ReqId], logits: &Array) -> Result<Array, WireError> {
        let rows = logits.shape()[0];
        let mut by_id: HashMap<ReqId, &mut Seq> =
            self.seqs.iter_mut().map(|(id, s)| (*id, s)).collect();
        let seqs: Vec<Option<&mut Seq>> = order
            .iter()
            .map(|id| by_id.remove(id))
            .chain(std::iter::repeat_with(|| None))
            .take(rows as usize)
            .collect();
        let tokens = restricted_argmax(&self.shared, logits, seqs)?;
        mlx_rs::transforms::async_eval([&tokens]).map_err(internal)?;
        let mut m = self.shared.mask_times.get();
        m.ahead += 1;
        self.shared.mask_times.set(m);
        Ok(tokens)
    }

    /// The step's tokens `tokens` read on the host (the device's work before them waited for),
    /// and the masks after them started beside this thread for the constrained rows among
    /// `pos` (a request and its row in `tokens`).
    pub(super) fn read_tokens(
        &mut self,
        tokens: &Array,
        pos: &HashMap<ReqId, usize>,
    ) -> Result<Vec<u32>, WireError> {
        let host = host_ids(tokens)?;
        self.finish_masks();
        let rows = self
            .seqs
            .iter_mut()
            .filter_map(|(id, s)| Some((*id, s, *host.get(*pos.get(id)?)?)));
        self.masks_ahead = MasksAhead::start(&self.shared, rows);
        Ok(host)
    }

    /// Masks computed ahead are back in their sequences (waited for if still running).
    pub(super) fn finish_masks(&mut self) {
        if let Some(m) = self.masks_ahead.take() {
            m.finish(&mut self.seqs, &self.shared.mask_times);
        }
    }

    /// Whether the chunk's next stage can share a step queued ahead: either it does not
    /// complete the prompt or the request samples greedily (its first token is then the step's
    /// greedy token after the chunk; other sampling needs the host).
    pub(super) fn chunk_can_queue(&self, c: &InFlight) -> bool {
        !c.completes(self.stage_end(c, true), self.shared.model.num_layers()) || c.lent.seq.greedy()
    }

    /// A step queued ahead is delivered: a request whose prompt that step completed joins the
    /// decode batch; the next step is queued, with the chunk's next stage in the same pass when
    /// it can be (`chunk_can_queue`); then this one's tokens are read (the joined request's
    /// first token among them). A chunk that cannot share the step runs on its own after, and
    /// nothing is queued behind it.
    pub(super) fn deliver_ahead(
        &mut self,
        ahead: Ahead,
        ids: &[ReqId],
        chunk: Option<InFlight>,
    ) -> Stepped {
        let Ahead {
            order: ahead_order,
            tokens,
            masked,
            completing,
        } = ahead;
        let t0 = std::time::Instant::now();
        let tokens = match masked {
            false => tokens,
            // The rows' masks (their matchers have followed every token read so far) while the
            // device runs the step; then its tokens from the restricted logits.
            true => match self.masked_tokens(&ahead_order, &tokens) {
                Ok(t) => t,
                Err(e) => {
                    let _ = tokens.eval();
                    if let Some((_, seq)) = completing {
                        self.release_seq(seq);
                    }
                    return Stepped::failed(ids, chunk, e);
                }
            },
        };
        let tm = std::time::Instant::now();
        let mut pos: HashMap<ReqId, usize> = ahead_order
            .iter()
            .enumerate()
            .map(|(i, id)| (*id, i))
            .collect();
        let mut failed_join = None;
        if let Some((id, seq)) = completing {
            pos.insert(id, ahead_order.len());
            if let Err(e) = self.join(id, seq) {
                failed_join = Some((id, e));
            }
        }
        let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
        let decode: Vec<ReqId> = ids
            .iter()
            .copied()
            .filter(|id| failed_join.as_ref().is_none_or(|(f, _)| f != id))
            .collect();
        if decode.len() != order.len()
            || order.iter().any(|id| !pos.contains_key(id))
            || decode.iter().any(|id| !order.contains(id))
        {
            let _ = tokens.eval();
            return Stepped::failed(
                ids,
                chunk,
                internal("the queued decode step is out of step with the scheduler"),
            );
        }
        let t1 = std::time::Instant::now();
        // This delivery's own launch only (a step launched synchronously earlier set it too).
        self.launched = (0.0, 0.0);
        // With constrained rows the tokens are read before the next step's launch (its graph
        // built), so that their next masks are computed while it launches; a plain step's
        // tokens are read after it (they were computed by the step before: nothing waits).
        let mut read: Option<(Result<Vec<u32>, WireError>, std::time::Duration)> = None;
        let (folded, alone) = self.queue_next(order, &pos, &tokens, chunk, |a: &mut Self| {
            if masked {
                let t = std::time::Instant::now();
                read = Some((a.read_tokens(&tokens, &pos), t.elapsed()));
                waited_after_masks(&a.shared, t);
            }
        });
        let t2 = std::time::Instant::now();
        let (host, early) = match read {
            Some((host, took)) => (host, took),
            None => {
                let host = self.read_tokens(&tokens, &pos);
                if masked {
                    waited_after_masks(&self.shared, t2);
                }
                (host, std::time::Duration::ZERO)
            }
        };
        let t3 = std::time::Instant::now();
        let tok = self.shared.tokenizer.clone();
        let outs = ids
            .iter()
            .map(|id| {
                if let Some((_, e)) = failed_join.as_ref().filter(|(f, _)| f == id) {
                    return Err(e.clone());
                }
                let t = host.as_ref().map_err(Clone::clone)?[pos[id]];
                let seq = self
                    .seqs
                    .get_mut(id)
                    .ok_or_else(|| unknown("decode", *id))?;
                seq.take_token(tok.as_deref(), t, None)
            })
            .collect();
        let chunk = folded.or_else(|| alone.map(|c| self.chunk_alone(c)));
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        let (build, launch) = self.launched;
        self.times = StepTimes {
            masks: ms(tm - t0),
            join: ms(t1 - tm),
            queue: ms(t2 - t1) - ms(early),
            build,
            launch,
            wait: ms(t3 - t2) + ms(early),
            rest: ms(t3.elapsed()),
            ..StepTimes::default()
        };
        Stepped { outs, chunk }
    }

    /// Queues the next step ahead (the current rows, their tokens just sampled, picked out of
    /// `tokens` by `pos`), with the chunk's stage where it can ride in it. The chunk's outcome
    /// when it rode (first), or the chunk still to run alone (second).
    fn queue_next(
        &mut self,
        order: Vec<ReqId>,
        pos: &HashMap<ReqId, usize>,
        tokens: &Array,
        chunk: Option<InFlight>,
        before_launch: impl FnOnce(&mut Self),
    ) -> (Option<ChunkOutcome>, Option<InFlight>) {
        if chunk.as_ref().is_some_and(|c| !self.chunk_can_queue(c)) {
            return (None, chunk);
        }
        let idx: Vec<i32> = order.iter().map(|id| pos[id] as i32).collect();
        match tokens.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0) {
            Ok(current) => match self.queue_ahead(order, &current, chunk, before_launch) {
                Ok(outcome) => (outcome, None),
                Err((e, c)) => {
                    tracing::warn!(error = %e, "could not queue the next decode step");
                    (c.map(|c| (Err(e), c.back())), None)
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "could not queue the next decode step");
                (None, chunk)
            }
        }
    }
}
