//! What the scheduler actor needs of an executor beyond the work itself ([`WorkerExecutor`]): the
//! real one is [`crate::roles::RoleActors`], tests use fakes.

use llmq_engine::prefix::PrefixStats;
use llmq_protocol::WireError;
use llmq_scheduler::{Executor, ReqId};

use crate::roles::messages::StepTimes;
use crate::seq::{MaskTimes, SeqSpec};

/// Calls of an executor's prefill and decode work since start, and their time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CallTimes {
    pub prefill_calls: u64,
    pub prefill_ms: f64,
    pub decode_calls: u64,
    pub decode_ms: f64,
}

/// Prompt KV bytes received from prefill workers, and the ms their chunks' pieces took to
/// arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvReceived {
    pub bytes: u64,
    pub transfer_ms: f64,
}

/// What the scheduler actor needs of an executor beyond the work itself: admitting requests and
/// reporting on memory and time. `RoleActors` is the real one; tests use fakes. The reports
/// are what the executor knew after its last call (the real one's actors send theirs with every
/// answer).
#[allow(async_fn_in_trait)]
pub trait WorkerExecutor: Executor {
    /// Creates a request's state, validating its parameters.
    async fn register(&mut self, id: ReqId, spec: SeqSpec) -> Result<(), WireError>;
    /// Drops every request's state (after a fault: the executor starts again from clean state,
    /// its prefix cache aside).
    async fn reset(&mut self);
    fn kv_bytes_per_token(&self) -> u64;
    /// Bytes of one sequence's recurrent states (a hybrid model's; 0 for attention alone).
    fn state_bytes_per_sequence(&self) -> u64 {
        0
    }
    fn kv_bytes_in_use(&self) -> u64;
    /// Whether a prompt's last token must come in a chunk of its own (see
    /// [`llmq_scheduler::SchedulerConfig::last_token_apart`]): a hybrid model's executor with a prefix cache
    /// keeps its states one token before each prompt's end.
    fn last_token_apart(&self) -> bool {
        false
    }
    /// Ticks a prefill chunk of `n` tokens takes beside decoding rows (an executor that spreads
    /// a chunk's layers over steps takes more than one).
    fn chunk_ticks(&self, _n: usize) -> usize {
        1
    }
    fn context_tokens(&self) -> usize;
    /// Milliseconds inside the executor since start: prefill and decode calls, and the KV
    /// bookkeeping of admissions, releases and prefix-cache trims.
    fn engine_ms(&self) -> f64;
    /// The prefill and decode calls since start, and their time.
    fn call_times(&self) -> CallTimes;
    /// What constrained rows' token masks have cost (nothing by default).
    fn mask_times(&self) -> MaskTimes {
        MaskTimes::default()
    }
    /// The prefix cache's counters (all zero without one).
    fn prefix_stats(&self) -> PrefixStats {
        Default::default()
    }
    /// Drops every cached prefix; returns the bytes freed.
    async fn prefix_clear(&mut self) -> u64 {
        0
    }
    /// Zeroes the counters behind `call_times` and `prefix_stats` (after the warm-up).
    async fn reset_counters(&mut self) {}
    /// Prompt KV received from prefill workers since start (none by default).
    fn kv_received(&self) -> KvReceived {
        KvReceived::default()
    }
    /// The host's time in the last step, for the tick log (none by default).
    fn last_step(&self) -> Option<StepTimes> {
        None
    }
}
