//! llmq's CUDA kernels, compiled and launched through MLX (`launch`); each runs only where
//! MLX computes on a GPU with CUDA (`ready`), on the shapes it `covers`.
//!
//! - [`row_attention`] the decode batch's attention by row lengths
//! - [`qmv`] quantized products of a few rows, and dequantization
//! - [`qmm`] quantized products of a decode step's many rows, on tensor cores
//! - [`experts`] a mixture of experts' routing and products grouped by expert
//! - [`delta_step`] the gated delta rule's decode step (Qwen3.5's linear attention)

pub mod delta_step;
pub mod experts;
pub(crate) mod launch;
pub mod qmm;
pub mod qmv;
pub mod row_attention;
