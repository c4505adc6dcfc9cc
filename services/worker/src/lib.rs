//! llmq's engine worker: one model on one device, served by four actors on the device thread.
//! The scheduling policy they follow is `llmq_scheduler`'s; the model is `llmq_engine`'s.
//!
//! - `actor` the scheduler actor: the device's clock; it drives the engine once per tick
//!   (`WorkerEngine`: what it needs of one); its warm-up and the cancels it remembers
//! - `engine` the engine the scheduler drives, made of the three role actors below (their
//!   messages: who lends what to whom each tick)
//! - `prefill` the prefill actor: requests whose prompt is not complete, their own KV caches
//! - `decode` the decode actor: the decode batches and their rows (`step`), the step queued
//!   ahead (`ahead`), a chunk lent to it and staged over steps (`chunk`)
//! - `cache` the cache actor: the prefix cache
//! - `remote` a decode worker's prompts prefilled by prefill workers: grants out, KV in
//! - `direct_kv` prompt KV on a TCP connection beside NATS, from prefill worker to decoder
//! - `prefill_server` a prefill worker's device side: sessions of prompts computed for decoders
//! - `prefill_service` the prefill worker process: grants in, KV out in pieces, heartbeats
//! - `messages` what the role actors share: the report every answer carries, common messages
//! - `seq` a request's sequence and the work the prefill and decode actors share
//! - `placement` how many jobs a worker holds, from its peers' heartbeats
//! - `held` the jobs a worker holds, and when it must give them up (cut off from the server)
//! - `host_memory` on a CPU, memory faulted in once and reused, so KV does not page-fault
//! - `service` the worker process: the device thread, events out, cancels, cache clears, heartbeats
//! - `jobs` the jobs stream: taking jobs while there is room, handing back, draining
//! - `tick_log` one line per tick, for tuning (off unless `worker.tick_log` is set)
//!
//! All MLX work of a worker runs on one thread: the device thread, which runs the four actors.

pub mod actor;
pub mod cache;
pub mod decode;
pub mod direct_kv;
pub mod engine;
pub mod held;
pub mod host_memory;
pub mod jobs;
pub mod messages;
pub mod placement;
pub mod prefill;
pub mod prefill_server;
pub mod prefill_service;
pub mod remote;
pub mod seq;
pub mod service;
pub mod tick_log;
