//! llmq's kernels for a CPU, where MLX computes on the host's cores: each reads its inputs
//! from the host's memory and writes its output there, in f32.
//!
//! - [`attention`] a sequence's attention over its cache, and the decode rows' over theirs
//! - [`elementwise`] an MLP's gated activation (SiLU, GELU), and the `exp` it shares
//! - [`matmul`] products of up to [`matmul::MAX_ROWS`] rows with dense f32 weights
//! - [`blas`] which kernels OpenBLAS (MLX's BLAS on a CPU) runs on this CPU

pub mod attention;
pub mod blas;
pub mod elementwise;
pub mod matmul;
