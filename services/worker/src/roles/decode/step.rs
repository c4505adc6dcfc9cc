//! One step of every decode row, through the decode batches (length groups, the chunk's stage
//! in the same pass, the next step queued ahead when it can be) or, for models whose scores
//! are soft-capped, row by row against each sequence's own cache.

use llmq_engine::batch::DecodeBatch;
use llmq_engine::cache::SequenceCache;
use llmq_protocol::WireError;
use llmq_scheduler::{ReqId, StepOut};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::queued::{launch_step, Ahead};
use super::staging::InFlight;
use super::{DecodeActor, Stepped, SLOW_MS};
use crate::roles::messages::StepTimes;
use crate::seq::{
    argmax_rows, choose, host_ids, internal, restricted_argmax, waited_after_masks, MasksAhead, Seq,
};

/// What a synchronous step of the decode batches gave: each row's outcome, the chunk's last
/// logits when its stage completed the prompt, the chunk's hidden state when it did not reach
/// the last layer, and the step queued ahead, if any.
struct BatchStep {
    outs: Vec<(ReqId, Result<StepOut, WireError>)>,
    chunk_logits: Option<Array>,
    hidden: Option<Array>,
    next: Option<Ahead>,
}

impl DecodeActor {
    pub(super) fn step(&mut self, ids: &[ReqId], chunk: Option<InFlight>) -> Stepped {
        self.finish_masks();
        if ids.is_empty() {
            // No row to step (none left, or the rest were lost): the chunk runs on its own.
            return Stepped {
                outs: vec![],
                chunk: chunk.map(|c| self.chunk_alone(c)),
            };
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
        let mut batches = self.batches.take().expect("batch mode");
        let result = self.step_batches(&mut batches, ids, &mut pre, end);
        self.batches = Some(batches);
        let (outs, chunk) = match result {
            Err(e) => (Err(e.clone()), pre.map(|c| (Err(e), c.back()))),
            Ok(BatchStep {
                outs,
                chunk_logits,
                hidden,
                next,
            }) => {
                self.ahead = next;
                // A prompt completed here joins now: its logits are on hand.
                (
                    Ok(outs),
                    pre.map(|c| self.stage_done(c, end, hidden, chunk_logits.as_ref())),
                )
            }
        };
        let outs = match outs {
            Ok(mut outs) => ids
                .iter()
                .map(|id| {
                    let i = outs
                        .iter()
                        .position(|(x, _)| x == id)
                        .expect("every id has a row");
                    outs.swap_remove(i).1
                })
                .collect(),
            Err(e) => ids.iter().map(|_| Err(e.clone())).collect(),
        };
        Stepped { outs, chunk }
    }

    /// One synchronous step of every row of `batches`, with the chunk's stage up to layer `end`
    /// in the same pass; the next step is queued ahead when every row samples greedily and the
    /// chunk (if any) does not complete its prompt.
    fn step_batches(
        &mut self,
        batches: &mut [DecodeBatch],
        ids: &[ReqId],
        pre: &mut Option<InFlight>,
        end: usize,
    ) -> Result<BatchStep, WireError> {
        let layers = self.shared.model.num_layers();
        let order: Vec<ReqId> = self.rows.iter().flatten().copied().collect();
        if ids.len() != order.len()
            || ids
                .iter()
                .any(|id| self.seqs.get(id).and_then(|s| s.row).is_none())
        {
            return Err(internal("decode batch out of step with the scheduler"));
        }
        let toks: Vec<Vec<u32>> = self
            .rows
            .iter()
            .map(|g| g.iter().map(|id| self.seqs[id].next.unwrap_or(0)).collect())
            .collect();
        let mut groups: Vec<(&[u32], &mut DecodeBatch)> = toks
            .iter()
            .map(|t| &t[..])
            .zip(batches.iter_mut())
            .collect();
        let chunk_toks: Option<Vec<u32>> = pre.as_ref().map(|c| c.lent.seq.chunk(c.lent.n));
        let part = pre
            .as_mut()
            .zip(chunk_toks.as_ref())
            .map(|(c, t)| c.stage(t, end));
        let t0 = std::time::Instant::now();
        let (logits, hidden) = self
            .shared
            .model
            .step_staged(&mut groups, None, part)
            .map_err(internal)?;
        drop(groups);
        let built = t0.elapsed();
        let rows = order.len() as i32;
        let (logits, chunk_logits) = match pre {
            Some(_) if end == layers => (logits.index(..rows), Some(logits.index(rows..))),
            _ => (logits, None),
        };
        let mut taken: Vec<(ReqId, Seq)> = order
            .iter()
            .map(|id| (*id, self.seqs.remove(id).expect("checked")))
            .collect();
        // A chunk that does not complete its prompt needs nothing from the host, so the
        // next step can be queued after it as after a plain decode step.
        let chunk_is_final = pre.as_ref().is_some_and(|c| c.completes(end, layers));
        let speculate =
            self.decode_ahead && !chunk_is_final && taken.iter().all(|(_, s)| s.device_greedy());
        let mut next = None;
        let tok = self.shared.tokenizer.clone();
        let chosen = if speculate {
            // The next step is launched from this one's device tokens before the host reads
            // them, so the device never waits for the host in between. Constrained rows'
            // tokens come from their restricted logits; the next step then waits for its own
            // masks (see `Ahead`).
            let masked = taken.iter().any(|(_, s)| s.matcher.is_some());
            let dev = if masked {
                restricted_argmax(
                    &self.shared,
                    &logits,
                    taken.iter_mut().map(|(_, s)| Some(s)),
                )
            } else {
                argmax_rows(&logits, rows)
            };
            dev.and_then(|dev| {
                match launch_step(
                    &self.shared.model,
                    &self.rows,
                    batches,
                    &dev,
                    None,
                    masked,
                    &mut self.launched,
                ) {
                    Ok((tokens, _)) => {
                        next = Some(Ahead {
                            order: order.clone(),
                            tokens,
                            masked,
                            completing: None,
                        })
                    }
                    Err(e) => tracing::warn!(error = %e, "could not queue the next decode step"),
                }
                let masks_done = std::time::Instant::now();
                let host = host_ids(&dev)?;
                if masked {
                    waited_after_masks(&self.shared, masks_done);
                    // The next step's masks, beside this thread (see `Ahead`).
                    let rows = taken.iter_mut().zip(&host).map(|((id, s), &t)| (*id, s, t));
                    self.masks_ahead = MasksAhead::start(&self.shared, rows);
                }
                Ok(host.into_iter().map(|t| (t, None)).collect::<Vec<_>>())
            })
        } else {
            let mut seqs: Vec<&mut Seq> = taken.iter_mut().map(|(_, s)| s).collect();
            choose(&logits, &mut seqs, &self.shared)
        };
        let outs: Vec<(ReqId, Result<StepOut, WireError>)> = match chosen {
            Ok(chosen) => taken
                .iter_mut()
                .zip(chosen)
                .map(|((id, s), (t, lp))| (*id, s.take_token(tok.as_deref(), t, lp)))
                .collect(),
            Err(e) => taken.iter().map(|(id, _)| (*id, Err(e.clone()))).collect(),
        };
        let total = t0.elapsed();
        if total.as_secs_f64() * 1000.0 > SLOW_MS {
            // Each batch's pool: its blocks, and those free.
            let pools: Vec<(usize, usize)> = batches.iter().map(|b| b.pool_blocks()).collect();
            let (build_ms, total_ms) = (built.as_secs_f64() * 1000.0, total.as_secs_f64() * 1000.0);
            tracing::debug!(
                rows,
                chunk = chunk_toks.as_ref().map_or(0, |c| c.len()),
                build_ms,
                total_ms,
                ?pools,
                "slow decode step"
            );
        }
        self.seqs.extend(taken);
        Ok(BatchStep {
            outs,
            chunk_logits,
            hidden,
            next,
        })
    }

    /// Soft-capped models: every sequence decodes against its own cache; the chunk runs
    /// after the step, on its own.
    fn step_unbatched(&mut self, ids: &[ReqId], chunk: Option<InFlight>) -> Stepped {
        let mut taken: Vec<(ReqId, Seq)> = ids
            .iter()
            .filter_map(|id| self.seqs.remove(id).map(|s| (*id, s)))
            .collect();
        let tok = self.shared.tokenizer.clone();
        let result = (|| {
            if taken.len() != ids.len() {
                return Err(internal("decode of an unknown request"));
            }
            let toks: Vec<i32> = taken
                .iter()
                .map(|(_, s)| s.next.unwrap_or(0) as i32)
                .collect();
            let x = Array::from_slice(&toks, &[toks.len() as i32, 1]);
            let mut caches: Vec<&mut SequenceCache> =
                taken.iter_mut().map(|(_, s)| &mut s.cache).collect();
            let logits = self
                .shared
                .model
                .forward(&x, &mut caches, true)
                .map_err(internal)?;
            let mut seqs: Vec<&mut Seq> = taken.iter_mut().map(|(_, s)| s).collect();
            choose(&logits, &mut seqs, &self.shared)
        })();
        let outs = match result {
            Ok(chosen) => taken
                .iter_mut()
                .zip(chosen)
                .map(|((_, s), (t, lp))| s.take_token(tok.as_deref(), t, lp))
                .collect(),
            Err(e) => ids.iter().map(|_| Err(e.clone())).collect(),
        };
        for (id, s) in taken {
            self.seqs.insert(id, s);
        }
        Stepped {
            outs,
            chunk: chunk.map(|c| self.chunk_alone(c)),
        }
    }
}
