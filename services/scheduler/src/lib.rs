//! llmq's scheduling policy: the device's clock, with no model, no MLX and no actors.
//!
//! - `policy` the scheduler: decode first, then one bounded prefill chunk per tick, admission
//!   against the KV budget, prefill order; it drives any [`Executor`]
//! - [`executor`] what the scheduler asks of whatever runs its work ([`Executor`]) and what it
//!   gets back
//! - [`blocks`] the KV block pool's books: free blocks, reference counts, block tables
//! - `budget` prefill chunks sized to a time budget per tick (measured decode and chunk times)
//!
//! The worker's scheduler actor owns a [`Scheduler`] and drives its role actors through
//! [`Executor`]; the tests drive fakes with a fake clock.

pub mod blocks;
pub mod budget;
pub mod executor;
pub mod policy;

pub use executor::*;
pub use policy::*;
