//! How a prefill chunk is spread over decode steps (stages sized by the tick budget), and the
//! chunk while it is in the decode actor's hands (lent by the prefill actor, between stages).
//! The decode actor's handling of it is in `chunk.rs`.

use llmq_engine::model::ChunkStage;
use llmq_engine::Model;
use llmq_scheduler::budget::ChunkSizer;
use llmq_scheduler::ReqId;
use mlx_rs::Array;

use crate::seq::Seq;

/// Steps a prefill chunk of `n` tokens is spread over while rows decode: one per
/// `stage_tokens` of it, at most `stages`. Each step then carries about `stage_tokens` tokens'
/// worth of prefill work through the whole model, whatever the chunk's length: a short chunk
/// (a short prompt, or a long one's end) is not held back for stages it does not need.
pub fn stages_for(n: usize, stage_tokens: usize, stages: usize) -> usize {
    n.div_ceil(stage_tokens.max(1)).clamp(1, stages.max(1))
}

/// The most steps a chunk's layers are spread over on `model` when `stages` are asked for: at
/// most one a layer, and 1 for a model without decode batches (soft-capped models decode row
/// by row: their chunks run whole).
pub fn chunk_stages(model: &Model, stages: usize) -> usize {
    if model.new_decode_batch().is_some() {
        stages.clamp(1, model.num_layers().max(1))
    } else {
        1
    }
}

/// How a chunk granted beside decoding rows is spread over steps. Fixed (no budget): one step
/// per `stage_tokens` of it, at most `most`, the stages asked (`stages_for`). With a tick budget (`budget` > 0 and
/// more than one stage), each step's share is sized to it instead: the work a step carries
/// (tokens' worth through the whole model) is chosen between `min_tokens` and `stage_tokens`
/// from measured step times ([`ChunkSizer::pick`]), so a chunk takes up to `most` steps. On a GPU
/// whose decode step is short, a 256-token share can cost more than the budget allows (it is
/// the device's time, not the host's), and a smaller share keeps the streams' gap within it.
#[derive(Debug, Clone, Copy)]
pub struct Staging {
    pub stage_tokens: usize,
    pub budget: f64,
    pub min_tokens: usize,
    /// The most steps a chunk takes.
    pub most: usize,
    /// Shares sized as the device computes them (see `cautious`).
    pub cautious: bool,
}

impl Staging {
    /// The staging of `model` for the settings asked (see `chunk_stages`): a budget only with
    /// more than one stage; never more steps than layers.
    pub fn new(
        model: &Model,
        stages: usize,
        stage_tokens: usize,
        budget: f64,
        min_tokens: usize,
    ) -> Self {
        let s = Self::for_layers(
            model.num_layers(),
            chunk_stages(model, stages),
            stage_tokens,
            budget,
            min_tokens,
        );
        if llmq_engine::on_gpu() {
            s
        } else {
            s.cautious()
        }
    }

    /// Shares for a device whose time for a share is its compute for the share's tokens (a
    /// CPU's): each share's layers carry the tokens' worth chosen (rounded down, at least one
    /// layer), and the choice is judged as a whole chunk's ([`ChunkSizer::with_cautious_shares`]).
    /// On a GPU a share's time is mostly the host's for its layers, and the layers are the
    /// chunk's spread evenly over its steps.
    pub fn cautious(mut self) -> Self {
        self.cautious = true;
        self
    }

    /// The staging of a model of `layers` layers whose chunks take `stages` steps at most at
    /// full work.
    pub fn for_layers(
        layers: usize,
        stages: usize,
        stage_tokens: usize,
        budget: f64,
        min_tokens: usize,
    ) -> Self {
        let stages = stages.max(1);
        let stage_tokens = stage_tokens.max(1);
        let budget = if stages > 1 { budget } else { 0.0 };
        let min_tokens = if budget > 0.0 {
            min_tokens.clamp(1, stage_tokens)
        } else {
            stage_tokens
        };
        let most = (stages * stage_tokens.div_ceil(min_tokens)).clamp(stages, layers.max(stages));
        Staging {
            stage_tokens,
            budget,
            min_tokens,
            most,
            cautious: false,
        }
    }

    /// The most steps a chunk of `n` tokens takes beside decoding rows.
    pub fn most_ticks(&self, n: usize) -> usize {
        stages_for(n, self.min_tokens, self.most)
    }

    /// Layers a step runs of a chunk of `n` tokens (of `layers`) when it carries `work` tokens'
    /// worth.
    pub fn stage_layers(&self, n: usize, work: usize, layers: usize) -> usize {
        if self.cautious {
            (work * layers / n.max(1)).clamp(1, layers)
        } else {
            layers.div_ceil(stages_for(n, work, self.most))
        }
    }

    /// The sizer of each step's work (off without a budget).
    pub(super) fn sizer(&self) -> ChunkSizer {
        let sizer = ChunkSizer::new(self.budget, self.min_tokens, self.stage_tokens);
        if self.cautious {
            sizer.with_cautious_shares()
        } else {
            sizer
        }
    }
}

/// A prefill chunk lent to a step: `n` more prompt tokens of request `id`.
pub struct Lent {
    pub id: ReqId,
    pub n: usize,
    pub seq: Box<Seq>,
}

/// The chunk granted to a step: a new one lent by the prefill actor, or the one in flight here
/// (its layers spread over steps) going on.
pub enum Grant {
    New(Lent),
    Continue(ReqId),
}

/// A chunk in the decode actor's hands: the lent chunk, the first layer of its next stage (0:
/// not started) and the hidden state entering that layer.
pub(super) struct InFlight {
    pub(super) lent: Lent,
    pub(super) next: usize,
    pub(super) hidden: Option<Array>,
}

impl InFlight {
    pub(super) fn new(lent: Lent) -> Self {
        InFlight {
            lent,
            next: 0,
            hidden: None,
        }
    }
    /// The sequence to give back to the prefill actor after a failed stage: none once a stage
    /// has run (its layers then hold different lengths, and a release there would remember
    /// them as a prefix); the request fails either way.
    pub(super) fn back(self) -> Option<Box<Seq>> {
        (self.next == 0).then_some(self.lent.seq)
    }

    /// Its stage up to layer `end` as the model takes it (`tokens`: the chunk's, from
    /// [`Seq::chunk`]); the hidden state goes with it.
    pub(super) fn stage<'a>(&'a mut self, tokens: &'a [u32], end: usize) -> ChunkStage<'a> {
        ChunkStage {
            tokens,
            cache: &mut self.lent.seq.cache,
            layers: self.next..end,
            hidden: self.hidden.take(),
        }
    }

    /// Whether the stage ending at layer `end` completes the prompt.
    pub(super) fn completes(&self, end: usize, layers: usize) -> bool {
        end == layers && self.lent.seq.prefilled + self.lent.n >= self.lent.seq.prompt.len()
    }
}
