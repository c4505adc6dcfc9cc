//! llmq's engine worker: one model on one device, served by four actors on the device thread.
//! The scheduling policy they follow is [`llmq_scheduler`]'s; the model is [`llmq_engine`]'s.
//!
//! - [`actor`] the scheduler actor: the device's clock; it drives an executor once per tick
//!   ([`actor::WorkerExecutor`]: what it needs of one), its warm-up and the cancels it remembers
//! - [`roles`] the executor made of the three role actors (their messages: who lends what to
//!   whom each tick): [`roles::prefill`] (requests whose prompt is not complete, their own KV),
//!   [`roles::decode`] (the decode batches and their rows, the step queued ahead, a chunk lent
//!   to it and staged over steps) and [`roles::cache`] (the prefix cache)
//! - [`disaggregated`] prefill in other processes: a decode worker's grants out and KV in
//!   ([`disaggregated::decode_side`]), the prefill worker's device side and process
//!   ([`disaggregated::prefill_side`], [`disaggregated::prefill_worker`]), and the KV's direct
//!   TCP link ([`disaggregated::kv_link`])
//! - [`seq`] a request's sequence and the work the prefill and decode actors share
//! - [`placement`] how many jobs a worker holds, from its peers' heartbeats
//! - [`held`] the jobs a worker holds, and when it must give them up (cut off from the server)
//! - [`host_memory`] on a CPU, memory faulted in once and reused, so KV does not page-fault
//! - [`service`] the worker process: the device thread started, events out, cancels, cache
//!   clears, heartbeats
//! - [`device`] the device thread's set-up (MLX's limits, the model) and end
//! - [`error`] a worker's errors; [`time`] the protocol's wall-clock time
//! - [`jobs`] the jobs stream: taking jobs while there is room, handing back, draining
//! - [`tick_log`] one line per tick, for tuning (off unless `worker.tick_log` is set)
//! - [`stall`] the device thread's watchdog: a worker stuck in a call exits, its jobs go to others
//!
//! All MLX work of a worker runs on one thread: the device thread, which runs the four actors.

pub mod actor;
pub mod device;
pub mod disaggregated;
pub mod error;
pub mod held;
pub mod host_memory;
pub mod jobs;
pub mod placement;
pub mod roles;
pub mod seq;
pub mod service;
pub mod stall;
pub mod tick_log;
pub mod time;
