//! llmq's engine: loads decoder-only LLMs and runs them through MLX (mlx-rs).
//! Model files' metadata, tokenizers and sampling parameters are [`llmq_text`]'s (no MLX there).
//!
//! Map of the crate:
//!
//! - [`load`]      a model by name, from a Hugging Face directory or a GGUF file
//! - [`device`]    the device MLX computes on, read once
//! - [`weights`]   tensors by Hugging Face name, from safetensors (sharded or not) or GGUF
//! - [`quant`]     weights kept quantized on the device (MLX's affine form)
//! - [`arch`]      what distinguishes the families' layers
//! - [`model`]     the transformer: chunked prefill and batched decode over per-sequence caches
//! - [`kernels`]   which kernel computes each product, attention and activation, decided in
//!   one place; llmq's own CPU kernels ([`kernels::cpu`]) and CUDA kernels ([`kernels::cuda`])
//! - [`cache`]     the KV-cache trait, a growing cache and a sliding-window one
//! - [`batch`]     the decode batch: every running sequence as one row of shared KV buffers
//! - [`mask`]      logits restricted to the tokens a constraint allows (packed bit masks)
//! - [`kv_bytes`]  a chunk's KV as bytes, to travel between workers (prefill workers)
//! - [`prefix`]    the prefix cache: KV of earlier sequences, found again by their first tokens
//! - [`generate`]  one sequence end to end, for the CLI and the single-stream benchmark
//! - [`shapes`]    random-weight models of known shapes, for benchmarks
//!
//! All MLX work of one model runs on one thread: mlx-rs arrays are [`Send`] but not [`Sync`].

pub mod arch;
pub mod batch;
pub mod cache;
pub mod device;
pub mod error;
pub mod generate;
pub mod kernels;
pub mod kv_bytes;
pub mod load;
pub mod mask;
pub mod model;
pub mod prefix;
pub mod quant;
pub mod shapes;
pub mod weights;

pub use device::{default_dtype, on_gpu};
pub use error::{EngineError, Result};
pub use load::{load_model, load_named, parse_dtype, LoadedModel};
pub use model::Model;
pub use quant::QuantSpec;
pub use weights::LoadOptions;
