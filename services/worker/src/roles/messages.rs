//! What the role actors (prefill, decode, cache) have in common: the report every answer
//! carries, and the messages more than one of them answers.
//!
//! Invariant: every answer of a role actor carries its report as of the end of that message,
//! so the scheduler's figures (KV bytes, work time) are never older than its last exchange.

use actix::prelude::*;

use crate::seq::Busy;
use llmq_scheduler::ReqId;

/// What an actor reports with every answer: its KV bytes, how many sequences (or entries) it
/// holds, its work time, and role-specific counters (zero where they do not apply).
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub kv_bytes: u64,
    pub held: usize,
    pub busy: Busy,
    pub prefix: llmq_engine::prefix::PrefixStats,
    /// The decode actor's host time in the last step it delivered.
    pub step: StepTimes,
    /// The decode actor's prefill chunks run in a step queued ahead.
    pub chunks_ahead: ChunksAhead,
    /// The decode actor's chunk stages that left their chunk part-way through the model.
    pub stages_pending: u64,
    /// The decode actor's completed prompts not yet copied whole for the prefix cache.
    pub copies_pending: usize,
}

/// Drop these requests' KV (what they fed the model stays reusable in the prefix cache) but
/// keep their sequences, to be prefilled again ([`llmq_scheduler::Executor::preempt`]). The
/// decode actor answers with the sequences it held; the prefill actor takes them back with its
/// own.
#[derive(Message)]
#[rtype(result = "Reply<Vec<(ReqId, Box<crate::seq::Seq>)>>")]
pub struct Preempt {
    pub ids: Vec<ReqId>,
    /// The sequences the decode actor gave back (empty when sent to the decode actor).
    pub back: Vec<(ReqId, Box<crate::seq::Seq>)>,
}

/// Prefill chunks the decode actor ran in a step queued ahead (counted when their last layer
/// ran), and of those the ones that completed their prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunksAhead {
    pub run: u64,
    pub completed_prompt: u64,
}

/// A chunk stage: the layers a step ran a chunk through, and the work (tokens' worth) it
/// carried; zeros without one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stage {
    pub layers: usize,
    pub work: usize,
}

/// The decode actor's host time (ms) in the step queued ahead that it last delivered: picking
/// its constrained rows' tokens (`masks`: the masks copied out, the argmax under them
/// launched), joining a completed prompt (`join`), queuing the next step (`queue`, of which
/// `build`: making its MLX graph, `launch`: MLX evaluating it), waiting for this step's tokens
/// (`wait`), handling them and any chunk run on its own (`rest`); zeros for a step run
/// synchronously. And the chunk stage that step launched: its layers and the tokens' worth of
/// work it carried.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTimes {
    pub masks: f64,
    pub join: f64,
    pub queue: f64,
    pub build: f64,
    pub launch: f64,
    pub wait: f64,
    pub rest: f64,
    pub stage_layers: usize,
    pub stage_work: usize,
}

/// An answer and its actor's report.
pub struct Reply<T> {
    pub value: T,
    pub report: Report,
}

/// Forget these requests (ended): the prefill and decode actors drop what they hold of them
/// and send what each computed to the cache actor.
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct Release(pub Vec<ReqId>);

/// Drop every request's state (after a fault elsewhere).
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct Reset;

/// Zero the work counters (after the warm-up).
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct ResetCounters;

/// Makes the actor panic inside a handler, as a bug would (for tests of its recovery).
#[doc(hidden)]
#[derive(Message)]
#[rtype(result = "()")]
pub struct InjectPanic;
