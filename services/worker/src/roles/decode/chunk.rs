//! A prefill chunk in the decode actor's hands: lent by the prefill actor for a step, and
//! spread over several steps (stages) that each run it through a share of the layers, sized by
//! the tick budget; between two stages it stays here with its hidden state.

use llmq_scheduler::{PrefillResult, Prefilled};
use mlx_rs::Array;

use super::staging::{InFlight, Lent};
use super::DecodeActor;
use crate::roles::messages::Stage;
use crate::seq::{internal, run_chunk, Seq};

impl DecodeActor {
    /// Where the stage of `c` that runs in a step ends: while rows decode, the layers that
    /// carry this step's work (see [`Staging`]), every remaining layer otherwise.
    pub(super) fn stage_end(&self, c: &InFlight, rows: bool) -> usize {
        let layers = self.shared.model.num_layers();
        if rows {
            (c.next + self.staging.stage_layers(c.lent.n, self.stage_work, layers)).min(layers)
        } else {
            layers
        }
    }

    /// A prompt part-way through prefill keeps its recurrent states where its chunk ended, if
    /// that is a snapshot position ([`crate::seq::Shared::snapshot_at`]), as the prefill actor's
    /// chunks do.
    fn snapshot(&self, seq: &Seq) {
        let at = seq.cache.offset();
        if self.shared.snapshot_at(at, seq.prompt.len()) && at <= seq.prompt.len() {
            self.remember(seq.salt.clone(), &seq.prompt[..at], seq.layers());
        }
    }

    /// A chunk's stage is done (its work queued or run; `logits`: the chunk's last position's,
    /// after its last stage): part-way, it stays here; done, its prompt advances and it goes back
    /// to the prefill actor, or its completed prompt joins the batch now (`logits` given) or
    /// when the step queued ahead is delivered (not given; its first token is that step's).
    pub(super) fn stage_done(
        &mut self,
        mut c: InFlight,
        end: usize,
        hidden: Option<Array>,
        logits: Option<&Array>,
    ) -> (PrefillResult, Option<Box<Seq>>) {
        self.last_stage = Stage {
            layers: end.saturating_sub(c.next),
            work: self.stage_work,
        };
        if end < self.shared.model.num_layers() {
            c.next = end;
            c.hidden = hidden;
            self.staged = Some(c);
            self.stages_pending += 1;
            return (Ok(Prefilled::Pending), None);
        }
        let Lent { id, n, mut seq } = c.lent;
        seq.prefilled = (seq.prefilled + n).min(seq.prompt.len());
        if seq.prefilled < seq.prompt.len() {
            self.snapshot(&seq);
            return (Ok(Prefilled::Done(None)), Some(seq));
        }
        match logits {
            Some(l) => (
                self.complete(id, *seq, l)
                    .map(|first| Prefilled::Done(Some(first))),
                None,
            ),
            None => {
                self.chunks_ahead.completed_prompt += 1;
                let ahead = self.ahead.as_mut().expect("a step was queued");
                ahead.completing = Some((id, *seq));
                (Ok(Prefilled::Done(None)), None)
            }
        }
    }

    /// A chunk run to its end on its own pass (it could not share a step, or no row decodes):
    /// a new one as a plain prefill, one part-way through from its next layer; a completed
    /// prompt joins.
    pub(super) fn chunk_alone(&mut self, mut c: InFlight) -> (PrefillResult, Option<Box<Seq>>) {
        let layers = self.shared.model.num_layers();
        if c.next == 0 {
            let Lent { id, n, mut seq } = c.lent;
            return match run_chunk(&self.shared.model, &mut seq, n) {
                Ok(None) => {
                    self.snapshot(&seq);
                    (Ok(Prefilled::Done(None)), Some(seq))
                }
                Ok(Some(logits)) => (
                    self.complete(id, *seq, &logits)
                        .map(|first| Prefilled::Done(Some(first))),
                    None,
                ),
                Err(e) => (Err(e), Some(seq)),
            };
        }
        let toks = c.lent.seq.chunk(c.lent.n);
        match self
            .shared
            .model
            .step_staged(&mut [], None, Some(c.stage(&toks, layers)))
        {
            Ok((logits, _)) => self.stage_done(c, layers, None, Some(&logits)),
            Err(e) => (Err(internal(e)), c.back()),
        }
    }
}
