//! llmq's engine worker: one model on one device.
//!
//! - `scheduler` the device's clock: decode first, then one bounded prefill chunk per tick
//!   (both in one engine call)
//! - `engine_ops` the real work behind the scheduler: prefill chunks fused with the batched
//!   decode step, decode steps queued ahead, KV caches and the prefix cache, on an
//!   `llmq_engine::Model`
//!
//! - `actor` the scheduler actor: the device's clock, on the device thread; its warm-up
//! - `placement` how many jobs a worker holds, from its peers' heartbeats
//! - `service` the worker process: model loading, NATS jobs, cancels, cache clears, heartbeats
//!
//! All MLX work of a worker runs on one thread.

pub mod actor;
pub mod engine_ops;
pub mod placement;
pub mod scheduler;
pub mod service;
