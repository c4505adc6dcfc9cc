//! A model's shape and options, read from a Hugging Face `config.json` or from GGUF metadata.
//! One struct for every architecture: each arch module says which options it uses.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM, TinyLlama, Mistral (with a sliding window).
    Llama,
    /// Qwen2: biases on q/k/v.
    Qwen2,
    /// Qwen3: RMS norms on q and k per head.
    Qwen3,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub tie_word_embeddings: bool,
    /// Attention looks back this many tokens, the current one included (Mistral, Qwen2 option).
    pub sliding_window: Option<usize>,
    pub max_position_embeddings: usize,
}

impl ModelConfig {
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::format(path, m));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 {
            return bad(format!("{} attention heads do not group over {} kv heads", self.num_heads, self.num_kv_heads));
        }
        if self.hidden_size == 0 || self.num_layers == 0 || self.vocab_size == 0 || self.head_dim == 0 {
            return bad("zero-sized model dimension".into());
        }
        if self.head_dim % 2 != 0 {
            return bad(format!("head_dim {} is odd: rotary embeddings need pairs", self.head_dim));
        }
        Ok(())
    }
}

#[derive(Deserialize)]
struct RopeParameters {
    rope_theta: Option<f32>,
    rope_type: Option<String>,
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_position_embeddings: Option<usize>,
}

pub fn from_hf_json(path: &Path) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let raw: HfConfig = serde_json::from_str(&text).map_err(|e| Error::format(path, e.to_string()))?;
    let name = raw
        .model_type
        .clone()
        .or_else(|| raw.architectures.as_ref().and_then(|a| a.first().cloned()))
        .unwrap_or_default();
    let arch = match name.as_str() {
        "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM" => Arch::Llama,
        "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
        "qwen3" | "Qwen3ForCausalLM" => Arch::Qwen3,
        other => return Err(Error::UnsupportedArch { path: path.into(), arch: other.to_string() }),
    };
    let scaled = raw.rope_scaling.as_ref().is_some_and(|v| !v.is_null())
        || raw.rope_parameters.as_ref().and_then(|p| p.rope_type.as_deref()).is_some_and(|t| t != "default");
    if scaled {
        return Err(Error::format(path, "rope scaling (llama3/yarn/linear) is not supported yet"));
    }
    let rope_theta = raw
        .rope_theta
        .or_else(|| raw.rope_parameters.as_ref().and_then(|p| p.rope_theta))
        .unwrap_or(10000.0);
    let sliding_window = match arch {
        Arch::Qwen2 | Arch::Qwen3 if raw.use_sliding_window != Some(true) => None,
        _ => raw.sliding_window,
    };
    let heads = raw.num_attention_heads;
    let cfg = ModelConfig {
        arch,
        vocab_size: raw.vocab_size,
        hidden_size: raw.hidden_size,
        intermediate_size: raw.intermediate_size,
        num_layers: raw.num_hidden_layers,
        num_heads: heads,
        num_kv_heads: raw.num_key_value_heads.unwrap_or(heads),
        head_dim: raw.head_dim.unwrap_or(raw.hidden_size / heads.max(1)),
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
        rope_theta,
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        sliding_window,
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
    };
    cfg.validate(path)?;
    Ok(cfg)
}

pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let path = f.path();
    let arch_name = f.get("general.architecture").and_then(Value::as_str).unwrap_or("").to_string();
    let arch = match arch_name.as_str() {
        "llama" | "mistral" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        _ => return Err(Error::UnsupportedArch { path: path.into(), arch: arch_name }),
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let uint = |k: &str| -> Result<usize> {
        f.get(&key(k))
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| Error::format(path, format!("missing metadata {}", key(k))))
    };
    let opt_uint = |k: &str| f.get(&key(k)).and_then(Value::as_u64).map(|v| v as usize);
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| Error::MissingTensor { path: path.into(), tensor: "token_embd.weight".into() })?;
    let hidden = uint("embedding_length")?;
    let heads = uint("attention.head_count")?;
    let vocab = opt_uint("vocab_size").unwrap_or(embd.shape[0] as usize);
    let head_dim = opt_uint("attention.key_length").unwrap_or(hidden / heads.max(1));
    let cfg = ModelConfig {
        arch,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: uint("feed_forward_length")?,
        num_layers: uint("block_count")?,
        num_heads: heads,
        num_kv_heads: opt_uint("attention.head_count_kv").unwrap_or(heads),
        head_dim,
        rms_norm_eps: f.get(&key("attention.layer_norm_rms_epsilon")).and_then(Value::as_f64).unwrap_or(1e-5) as f32,
        rope_theta: f.get(&key("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10000.0) as f32,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        sliding_window: opt_uint("attention.sliding_window"),
        max_position_embeddings: opt_uint("context_length").unwrap_or(4096),
    };
    if f.get(&key("rope.scaling.type")).and_then(Value::as_str).is_some_and(|t| t != "none") {
        return Err(Error::format(path, "rope scaling is not supported yet"));
    }
    cfg.validate(path)?;
    Ok(cfg)
}
