//! Disaggregated prefill: a decode worker's prompts computed by prefill workers, other processes
//! on other devices. The decode worker's scheduler still grants one chunk a tick; the chunk's KV
//! comes back and is installed in the request's cache.
//!
//! - [`decode_side`] the decode worker's side: grants out, KV in, the fallback to local prefill
//! - [`prefill_side`] the prefill worker's device side: a session per prompt, chunks computed
//! - [`prefill_worker`] the prefill worker process: grants in, KV out in pieces, heartbeats
//! - [`kv_link`] prompt KV on a TCP connection beside NATS, from prefill worker to decoder

pub mod decode_side;
pub mod kv_link;
pub mod prefill_side;
pub mod prefill_worker;
