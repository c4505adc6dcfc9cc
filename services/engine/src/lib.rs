//! llmq's engine: loads decoder-only LLMs and runs them through MLX (mlx-rs).
//!
//! Map of the crate:
//! Model files' metadata, tokenizers and sampling parameters are [`llmq_text`]'s (no MLX there).
//!
//! - `weights`   tensors by Hugging Face name, from safetensors (sharded or not) or GGUF
//! - `quant`     weights kept quantized on the device (MLX's affine form)
//! - `arch`      what distinguishes Llama, Qwen2 and Qwen3
//! - `model`     the transformer: chunked prefill and batched decode over per-sequence caches
//! - `cache`     the KV-cache trait, a growing cache and a sliding-window one
//! - `cpu_attention` a sequence's attention over its cache on a CPU (MLX's is unfused there)
//! - `cpu_elementwise` an MLP's gated activation (SiLU, GELU) on a CPU, and the `exp` it shares
//! - `cpu_matmul` products of up to 24 rows with dense f32 weights on a CPU (the BLAS repacks them)
//! - `host_blas` which kernels OpenBLAS (MLX's BLAS on a CPU) runs on this CPU
//! - `batch`     the decode batch: every running sequence as one row of shared KV buffers
//! - `row_attention` the decode batch's attention by row lengths, a CUDA kernel (GPU only)
//! - `qmv`       quantized matrix products of a few rows, a CUDA kernel (GPU only)
//! - `qmm`       quantized matrix products of a decode step's many rows, on tensor cores (GPU only)
//! - `experts`   a mixture of experts' routing and products grouped by expert, CUDA kernels (GPU only)
//! - `kernel`    how llmq's CUDA kernels are compiled and launched through MLX
//! - `mask`      logits restricted to the tokens a constraint allows (packed bit masks)
//! - `kv_bytes`  a chunk's KV as bytes, to travel between workers (prefill workers)
//! - `prefix`    the prefix cache: KV of earlier sequences, found again by their first tokens
//! - `generate`  one sequence end to end, for the CLI and the single-stream benchmark
//! - `shapes`    random-weight models of known shapes, for benchmarks
//!
//! All MLX work of one model runs on one thread: mlx-rs arrays are [`Send`] but not [`Sync`].

pub mod arch;
pub mod batch;
pub mod cache;
pub mod cpu_attention;
pub mod cpu_elementwise;
pub mod cpu_matmul;
pub mod error;
pub mod experts;
pub mod generate;
pub mod host_blas;
pub(crate) mod kernel;
pub mod kv_bytes;
pub mod mask;
pub mod model;
pub mod prefix;
pub mod qmm;
pub mod qmv;
pub mod quant;
pub mod row_attention;
pub mod shapes;
pub mod weights;

use std::path::{Path, PathBuf};

use llmq_text::{config, gguf, resolve_model, Tokenizer};

use mlx_rs::{Device, DeviceType, Dtype};

pub use error::{EngineError, Result};
pub use model::Model;
pub use quant::QuantSpec;
pub use weights::LoadOptions;

/// A loaded model with its tokenizer (absent only for tokenizer-less test checkpoints).
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Option<Tokenizer>,
    pub source: PathBuf,
}

/// The device MLX computes on: the GPU when the MLX build has one, otherwise the CPU.
pub fn on_gpu() -> bool {
    Device::try_default()
        .ok()
        .and_then(|d| d.get_type().ok())
        .is_some_and(|t| matches!(t, DeviceType::Gpu))
}

/// `!on_gpu()`, asked once per process: the CPU's own kernels (`cpu_matmul`,
/// `cpu_elementwise`) ask it on every product.
pub(crate) fn on_cpu_cached() -> bool {
    static ON_CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON_CPU.get_or_init(|| !on_gpu())
}

/// f32 on CPU (dense f32 is the fastest there), bf16 on GPU.
pub fn default_dtype() -> Dtype {
    if on_gpu() {
        Dtype::Bfloat16
    } else {
        Dtype::Float32
    }
}

pub fn parse_dtype(s: &str) -> Result<Dtype> {
    Ok(match s {
        "f32" | "float32" => Dtype::Float32,
        "f16" | "float16" => Dtype::Float16,
        "bf16" | "bfloat16" => Dtype::Bfloat16,
        other => {
            return Err(EngineError::InvalidRequest(format!(
                "unknown dtype {other:?} (f32, f16, bf16)"
            )))
        }
    })
}

/// Loads a model by name: `random:<shape>` (random weights, with the tokenizer of the
/// vocabulary the shape was modelled on when the set-up has it; see `shapes`), a known name,
/// or a path.
pub fn load_named(name: &str, opts: impl Into<LoadOptions>) -> Result<LoadedModel> {
    let opts = opts.into();
    if let Some(shape) = name.strip_prefix("random:") {
        let model = shapes::random_model(shape, opts, 0)?;
        let tokenizer = llmq_text::shapes::tokenizer(shape)?;
        return Ok(LoadedModel {
            model,
            tokenizer,
            source: PathBuf::from(name),
        });
    }
    load_model(&resolve_model(name)?, opts)
}

/// Loads a Hugging Face directory or a GGUF file as `opts` say (a dtype alone: its defaults).
pub fn load_model(path: &Path, opts: impl Into<LoadOptions>) -> Result<LoadedModel> {
    let opts = opts.into();
    let (model, tokenizer) = if path.is_dir() {
        let cfg = config::from_hf_json(&path.join("config.json"))?;
        let w = weights::load_hf_dir(path, opts)?;
        let tok = if path.join("tokenizer.json").is_file() {
            Some(Tokenizer::from_hf_dir(path)?)
        } else {
            None
        };
        (Model::load(cfg, w)?, tok)
    } else {
        let f = gguf::GgufFile::open(path)?;
        let cfg = config::from_gguf(&f)?;
        let tok = Tokenizer::from_gguf_metadata(path, &f.metadata)?;
        let w = weights::load_gguf(&f, &cfg, opts)?;
        (Model::load(cfg, w)?, Some(tok))
    };
    if let Some(t) = &tokenizer {
        let bound = t.max_id_bound();
        if bound > model.config.vocab_size {
            return Err(llmq_text::Error::Tokenizer {
                path: path.into(),
                message: format!(
                    "the tokenizer has ids up to {} but the embedding has only {} rows",
                    bound - 1,
                    model.config.vocab_size
                ),
            }
            .into());
        }
    }
    Ok(LoadedModel {
        model,
        tokenizer,
        source: path.into(),
    })
}
