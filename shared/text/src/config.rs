//! A model's shape and options, read from a Hugging Face `config.json` or from GGUF metadata.
//! One struct for every architecture: each arch module says which options it uses.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};
use crate::rope::{self, RopeConfig, RopeScaling};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM, TinyLlama, Mistral (with a sliding window).
    Llama,
    /// Qwen2: biases on q/k/v.
    Qwen2,
    /// Qwen3: RMS norms on q and k per head.
    Qwen3,
    /// Phi-3, Phi-4-mini: q/k/v and gate/up stored as one projection each.
    Phi3,
    /// Gemma 2: norms around attention and MLP (weights as 1 + w), GELU (tanh), scaled
    /// embeddings, soft-capped attention scores and logits, alternating sliding layers.
    Gemma2,
    /// Gemma 3 text: Gemma 2's layer without soft-capping, with q/k norms, five sliding layers
    /// (their own rope base) to one global.
    Gemma3,
}

impl Arch {
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }
}

/// Mixture of experts: a router picks `experts_per_token` of `experts` MLPs for each token, and
/// their outputs are summed weighted by the router's softmax.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub experts_per_token: usize,
    /// Each expert's intermediate width.
    pub expert_size: usize,
    /// The chosen experts' weights rescaled to sum to 1 (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub renormalize: bool,
    /// Which layers route through experts; the others run a dense MLP of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
    /// A shared expert every token runs beside its k, this wide, its output scaled by a sigmoid
    /// gate of its own (Qwen2-MoE).
    pub shared_expert: Option<usize>,
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
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    /// Sliding layers look back this many tokens, the current one included.
    pub sliding_window: Option<usize>,
    /// Which layers slide (one entry a layer; none without a window).
    pub sliding_layers: Vec<bool>,
    /// The rope of sliding layers where it differs from `rope` (Gemma 3's local base).
    pub rope_local: Option<RopeConfig>,
    /// Attention scores scaled by `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2` (Gemma).
    pub query_pre_attn_scalar: Option<f32>,
    /// Scores and final logits soft-capped: `cap * tanh(x / cap)` (Gemma 2).
    pub attn_logit_softcap: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    /// Mixture-of-experts layers (Mixtral, Qwen3-MoE).
    pub moe: Option<MoeConfig>,
    pub max_position_embeddings: usize,
}

impl ModelConfig {
    /// A layer's attention window, None when it attends to everything before it.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.sliding_layers.get(layer).copied().unwrap_or(false))
    }

    /// Whether any layer slides (its caches cannot rewind, and it decodes per sequence).
    pub fn any_sliding(&self) -> bool {
        self.sliding_window.is_some() && self.sliding_layers.iter().any(|&s| s)
    }

    /// A layer's rope.
    pub fn rope_of(&self, layer: usize) -> &RopeConfig {
        match &self.rope_local {
            Some(local) if self.window(layer).is_some() => local,
            _ => &self.rope,
        }
    }

    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::format(path, m));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 {
            return bad(format!("{} attention heads do not group over {} kv heads", self.num_heads, self.num_kv_heads));
        }
        if self.hidden_size == 0 || self.num_layers == 0 || self.vocab_size == 0 || self.head_dim == 0 {
            return bad("zero-sized model dimension".into());
        }
        if self.sliding_layers.len() != self.num_layers {
            return bad(format!("{} layer types for {} layers", self.sliding_layers.len(), self.num_layers));
        }
        if let Some(m) = &self.moe {
            if m.experts == 0 || m.experts_per_token == 0 || m.experts_per_token > m.experts || m.expert_size == 0 {
                return bad(format!("{} of {} experts a token, {} wide", m.experts_per_token, m.experts, m.expert_size));
            }
            if m.sparse_layers.len() != self.num_layers {
                return bad(format!("{} expert layer flags for {} layers", m.sparse_layers.len(), self.num_layers));
            }
        }
        if self.sliding_window == Some(0) {
            return bad("a sliding window of 0 tokens".into());
        }
        if self.rope.dims % 2 != 0 || self.rope.dims == 0 || self.rope.dims > self.head_dim {
            return bad(format!("{} rotary dimensions of a {}-wide head: rotary embeddings need pairs within the head", self.rope.dims, self.head_dim));
        }
        Ok(())
    }
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
    /// transformers 5: the rope's base, type and scaling in one object.
    rope_parameters: Option<serde_json::Value>,
    /// transformers 4: the scaling beside `rope_theta`.
    rope_scaling: Option<serde_json::Value>,
    partial_rotary_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    /// transformers 5: "sliding_attention" or "full_attention" for each layer.
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f32>,
    hidden_activation: Option<String>,
    hidden_act: Option<String>,
    query_pre_attn_scalar: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    /// The expert count (transformers 4 calls it `num_experts` for Qwen3-MoE).
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
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
        "llama" | "mistral" | "mixtral" | "LlamaForCausalLM" | "MistralForCausalLM" | "MixtralForCausalLM" => Arch::Llama,
        "qwen2" | "qwen2_moe" | "Qwen2ForCausalLM" | "Qwen2MoeForCausalLM" => Arch::Qwen2,
        "qwen3" | "qwen3_moe" | "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM" => Arch::Qwen3,
        "phi3" | "Phi3ForCausalLM" => Arch::Phi3,
        "gemma2" | "Gemma2ForCausalLM" => Arch::Gemma2,
        "gemma3_text" | "Gemma3ForCausalLM" => Arch::Gemma3,
        other => return Err(Error::UnsupportedArch { path: path.into(), arch: other.to_string() }),
    };
    let heads = raw.num_attention_heads;
    let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads.max(1));
    let max_positions = raw.max_position_embeddings.unwrap_or(4096);
    let rope_err = |e: rope::RopeError| Error::format(path, e.to_string());
    let (rope, rope_local) = hf_ropes(&raw, arch, head_dim, max_positions).map_err(rope_err)?;
    let sliding_window = match arch {
        Arch::Qwen2 | Arch::Qwen3 if raw.use_sliding_window != Some(true) => None,
        _ => raw.sliding_window,
    };
    let layers = raw.num_hidden_layers;
    let sliding_layers: Vec<bool> = match (&raw.layer_types, sliding_window) {
        (_, None) => vec![false; layers],
        (Some(types), Some(_)) => types.iter().map(|t| t == "sliding_attention").collect(),
        (None, Some(_)) => (0..layers)
            .map(|i| match arch {
                Arch::Gemma2 => i % 2 == 0,
                Arch::Gemma3 => (i + 1) % raw.sliding_window_pattern.unwrap_or(6) != 0,
                Arch::Qwen2 | Arch::Qwen3 => i >= raw.max_window_layers.unwrap_or(0),
                _ => true,
            })
            .collect(),
    };
    let moe = hf_moe(&raw, &name, layers);
    let activation = raw.hidden_activation.as_deref().or(raw.hidden_act.as_deref()).unwrap_or(if arch.is_gemma() { "gelu_pytorch_tanh" } else { "silu" });
    let expected = if arch.is_gemma() { "gelu_pytorch_tanh" } else { "silu" };
    if activation != expected && !(arch.is_gemma() && activation == "gelu_tanh") {
        return Err(Error::format(path, format!("hidden_act = {activation:?}: this architecture runs {expected}")));
    }
    let cfg = ModelConfig {
        arch,
        vocab_size: raw.vocab_size,
        hidden_size: raw.hidden_size,
        intermediate_size: raw.intermediate_size,
        num_layers: raw.num_hidden_layers,
        num_heads: heads,
        num_kv_heads: raw.num_key_value_heads.unwrap_or(heads),
        head_dim,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
        rope,
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(arch.is_gemma()),
        sliding_window,
        sliding_layers,
        rope_local,
        query_pre_attn_scalar: raw.query_pre_attn_scalar.filter(|_| arch.is_gemma()),
        attn_logit_softcap: raw.attn_logit_softcapping.filter(|_| arch == Arch::Gemma2),
        final_logit_softcap: raw.final_logit_softcapping.filter(|_| arch.is_gemma()),
        moe,
        max_position_embeddings: max_positions,
    };
    cfg.validate(path)?;
    Ok(cfg)
}

/// Mixtral's experts (every layer, renormalised) or Qwen3-MoE's (every `decoder_sparse_step`-th
/// layer not in `mlp_only_layers`, renormalised with `norm_topk_prob`).
fn hf_moe(raw: &HfConfig, name: &str, layers: usize) -> Option<MoeConfig> {
    match name {
        "mixtral" | "MixtralForCausalLM" => Some(MoeConfig {
            experts: raw.num_local_experts.unwrap_or(8),
            experts_per_token: raw.num_experts_per_tok.unwrap_or(2),
            expert_size: raw.intermediate_size,
            renormalize: true,
            sparse_layers: vec![true; layers],
            shared_expert: None,
        }),
        "qwen2_moe" | "Qwen2MoeForCausalLM" | "qwen3_moe" | "Qwen3MoeForCausalLM" => {
            let step = raw.decoder_sparse_step.unwrap_or(1).max(1);
            let dense = raw.mlp_only_layers.clone().unwrap_or_default();
            Some(MoeConfig {
                experts: raw.num_experts.or(raw.num_local_experts).unwrap_or(0),
                experts_per_token: raw.num_experts_per_tok.unwrap_or(0),
                expert_size: raw.moe_intermediate_size.unwrap_or(0),
                renormalize: raw.norm_topk_prob.unwrap_or(false),
                sparse_layers: (0..layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect(),
                shared_expert: if matches!(name, "qwen2_moe" | "Qwen2MoeForCausalLM") { raw.shared_expert_intermediate_size.filter(|&n| n > 0) } else { None },
            })
        }
        _ => None,
    }
}

/// The ropes of a Hugging Face config: transformers 5's `rope_parameters` (base, type and
/// scaling together; Gemma 3's per layer type), else transformers 4's `rope_theta` with
/// `rope_scaling` (and Gemma 3's `rope_local_base_freq`). Returns the rope of full-attention
/// layers and, where it differs, that of sliding ones.
fn hf_ropes(raw: &HfConfig, arch: Arch, head_dim: usize, max_positions: usize) -> std::result::Result<(RopeConfig, Option<RopeConfig>), rope::RopeError> {
    let params = raw.rope_parameters.as_ref().filter(|p| !p.is_null());
    let num = |p: Option<&serde_json::Value>, k: &str| p.and_then(|p| p.get(k)).and_then(serde_json::Value::as_f64).map(|v| v as f32);
    let partial = raw.partial_rotary_factor.or_else(|| num(params, "partial_rotary_factor")).unwrap_or(1.0);
    let dims = (head_dim as f32 * partial) as usize;
    let one = |field: &str, desc: Option<&serde_json::Value>, default_theta: f32| {
        let theta = num(desc, "rope_theta").or(raw.rope_theta.filter(|_| field != "rope_parameters.sliding_attention")).unwrap_or(default_theta);
        rope::from_hf(desc, field, theta, dims, max_positions, raw.original_max_position_embeddings)
    };
    match (arch, params) {
        (Arch::Gemma3, Some(p)) if p.get("full_attention").is_some() || p.get("sliding_attention").is_some() => {
            let global = one("rope_parameters.full_attention", p.get("full_attention"), 1_000_000.0)?;
            let local = one("rope_parameters.sliding_attention", p.get("sliding_attention"), 10_000.0)?;
            Ok((global, Some(local)))
        }
        (Arch::Gemma3, _) => {
            let global = one("rope_scaling", raw.rope_scaling.as_ref().or(params), 1_000_000.0)?;
            let local = RopeConfig::plain(raw.rope_local_base_freq.unwrap_or(10_000.0), dims);
            Ok((global, Some(local)))
        }
        (_, Some(p)) => Ok((one("rope_parameters", Some(p), 10_000.0)?, None)),
        (_, None) => Ok((one("rope_scaling", raw.rope_scaling.as_ref(), 10_000.0)?, None)),
    }
}

pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let path = f.path();
    let arch_name = f.get("general.architecture").and_then(Value::as_str).unwrap_or("").to_string();
    let arch = match arch_name.as_str() {
        "llama" | "mistral" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" | "qwen3moe" => Arch::Qwen3,
        "phi3" => Arch::Phi3,
        "gemma2" => Arch::Gemma2,
        "gemma3" => Arch::Gemma3,
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
    let max_positions = opt_uint("context_length").unwrap_or(4096);
    let rope = gguf_rope(f, &key, head_dim, max_positions)?;
    let rotary_dims = rope.dims;
    let layers = uint("block_count")?;
    let window = opt_uint("attention.sliding_window");
    // GGUF does not say which layers slide: Gemma 2 alternates, Gemma 3 has one global layer
    // in every `sliding_window_pattern` (6), other archs slide everywhere when windowed.
    let pattern = opt_uint("attention.sliding_window_pattern").unwrap_or(6).max(1);
    let sliding_layers = (0..layers)
        .map(|i| {
            window.is_some()
                && match arch {
                    Arch::Gemma2 => i % 2 == 0,
                    Arch::Gemma3 => (i + 1) % pattern != 0,
                    _ => true,
                }
        })
        .collect();
    let float = |k: &str| f.get(&key(k)).and_then(Value::as_f64).map(|v| v as f32);
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
        rope,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        sliding_window: window,
        sliding_layers,
        // Gemma 3's sliding layers rotate with base 10000 (transformers' default: GGUF has no key).
        rope_local: (arch == Arch::Gemma3).then(|| RopeConfig::plain(10_000.0, rotary_dims)),
        // GGUF has no query_pre_attn_scalar: Gemma's is the head size (but for Gemma 3 27B).
        query_pre_attn_scalar: arch.is_gemma().then_some(head_dim as f32),
        attn_logit_softcap: float("attn_logit_softcapping").filter(|_| arch == Arch::Gemma2),
        final_logit_softcap: float("final_logit_softcapping").filter(|_| arch.is_gemma()),
        moe: gguf_moe(f, &key, layers)?,
        max_position_embeddings: max_positions,
    };
    cfg.validate(path)?;
    Ok(cfg)
}

/// Experts of GGUF metadata: `expert_count` and `expert_used_count` (Mixtral's files are arch
/// `llama` with them), each expert's width `expert_feed_forward_length` (Qwen3-MoE) or the
/// model's `feed_forward_length` (Mixtral); the layers with a router (`ffn_gate_inp`) route.
/// The chosen experts' weights are renormalised as in the Hugging Face configs these files
/// come from (Mixtral always, Qwen3-MoE's `norm_topk_prob`, true in every published one),
/// unless `expert_weights_norm` says otherwise.
fn gguf_moe(f: &GgufFile, key: &dyn Fn(&str) -> String, layers: usize) -> Result<Option<MoeConfig>> {
    let uint = |k: &str| f.get(&key(k)).and_then(Value::as_u64).map(|v| v as usize);
    let Some(experts) = uint("expert_count").filter(|&n| n > 0) else { return Ok(None) };
    let path = f.path();
    let missing = |k: &str| Error::format(path, format!("missing metadata {}", key(k)));
    let expert_size = match uint("expert_feed_forward_length") {
        Some(n) => n,
        None => uint("feed_forward_length").ok_or_else(|| missing("feed_forward_length"))?,
    };
    Ok(Some(MoeConfig {
        experts,
        experts_per_token: uint("expert_used_count").ok_or_else(|| missing("expert_used_count"))?,
        expert_size,
        renormalize: f.get(&key("expert_weights_norm")).and_then(Value::as_bool).unwrap_or(true),
        sparse_layers: (0..layers).map(|i| f.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some()).collect(),
        shared_expert: None,
    }))
}

/// The rope of GGUF metadata: `rope.freq_base`, `rope.dimension_count` (partial rotary) and
/// `rope.scaling.*` (linear, yarn); Llama 3.1+ files carry their scaling precomputed as the
/// tensor `rope_freqs.weight`, one divisor per pair of rotated dimensions; Phi-3's long RoPE
/// comes as the tensors `rope_factors_short.weight` and `rope_factors_long.weight`, with
/// `rope.scaling.original_context_length` and `rope.scaling.attn_factor`.
fn gguf_rope(f: &GgufFile, key: &dyn Fn(&str) -> String, head_dim: usize, max_positions: usize) -> Result<RopeConfig> {
    let path = f.path();
    let num = |k: &str| f.get(&key(k)).and_then(Value::as_f64).map(|v| v as f32);
    let theta = num("rope.freq_base").unwrap_or(10000.0);
    let dims = f.get(&key("rope.dimension_count")).and_then(Value::as_u64).map_or(head_dim, |v| v as usize);
    let kind = f.get(&key("rope.scaling.type")).and_then(Value::as_str).unwrap_or("none");
    let factor = num("rope.scaling.factor").unwrap_or(1.0);
    let original_max = f.get(&key("rope.scaling.original_context_length")).and_then(Value::as_u64).map_or(max_positions, |v| v as usize);
    let scaling = match kind {
        "none" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => {
            let json = serde_json::json!({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max});
            rope::from_hf(Some(&json), &key("rope.scaling"), theta, dims, max_positions, None).map_err(|e| Error::format(path, e.to_string()))?.scaling
        }
        other => return Err(Error::format(path, format!("{} = {other:?}: unknown rope scaling type (llmq reads none, linear, yarn)", key("rope.scaling.type")))),
    };
    let factors = |name: &str| f.tensor(name).map(|t| f.read_f32(t));
    if let (Some(short), Some(long)) = (factors("rope_factors_short.weight"), factors("rope_factors_long.weight")) {
        let mut json = serde_json::json!({"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                          "original_max_position_embeddings": original_max});
        if let Some(a) = num("rope.scaling.attn_factor") {
            json["attention_factor"] = a.into();
        }
        let rope = rope::from_hf(Some(&json), &key("rope.scaling"), theta, dims, max_positions, None).map_err(|e| Error::format(path, e.to_string()))?;
        return Ok(RopeConfig { theta, dims, scaling: rope.scaling });
    }
    let scaling = match (f.tensor("rope_freqs.weight"), scaling) {
        (Some(t), RopeScaling::None) => {
            let factors = f.read_f32(t);
            if factors.len() != dims / 2 {
                return Err(Error::format(path, format!("rope_freqs.weight has {} factors for {} rotary dimensions", factors.len(), dims)));
            }
            RopeScaling::Factors { factors }
        }
        (_, s) => s,
    };
    Ok(RopeConfig { theta, dims, scaling })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Parses a config.json of the shape published checkpoints have (transformers 4's fields).
    fn parse(name: &str, cfg: serde_json::Value) -> Result<ModelConfig> {
        let dir = std::env::temp_dir().join(format!("llmq-config-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        from_hf_json(&path)
    }

    fn base(model_type: &str, extra: serde_json::Value) -> serde_json::Value {
        let mut c = json!({"model_type": model_type, "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2});
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    }

    #[test]
    fn published_configs_of_each_family_parse_to_their_options() {
        let llama31 = parse("llama31", base("llama", json!({"rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}))).unwrap();
        assert!(matches!(llama31.rope.scaling, RopeScaling::Llama3 { original_max: 8192, .. }));
        assert_eq!(llama31.rope.theta, 500000.0);

        let qwen_yarn = parse("yarn", base("qwen2", json!({"rope_theta": 1000000.0, "max_position_embeddings": 32768,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}))).unwrap();
        assert!(matches!(qwen_yarn.rope.scaling, RopeScaling::Yarn { factor: 4.0, original_max: 32768, .. }));

        let phi4 = parse("phi4mini", base("phi3", json!({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", "short_factor": vec![1.0; 24], "long_factor": vec![2.0; 24]}}))).unwrap();
        assert_eq!((phi4.arch, phi4.rope.dims, phi4.head_dim), (Arch::Phi3, 48, 64));
        assert!(matches!(phi4.rope.scaling, RopeScaling::LongRope { original_max: 4096, .. }));

        let gemma2 = parse("gemma2", base("gemma2", json!({"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}))).unwrap();
        assert_eq!(gemma2.sliding_layers, [true, false, true, false, true, false]);
        assert_eq!((gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.query_pre_attn_scalar), (Some(50.0), Some(30.0), Some(256.0)));
        assert!(gemma2.tie_word_embeddings && gemma2.rope_local.is_none());

        let gemma3 = parse("gemma3", base("gemma3_text", json!({"rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "sliding_window": 512,
            "sliding_window_pattern": 6, "head_dim": 256, "query_pre_attn_scalar": 256, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}))).unwrap();
        assert_eq!(gemma3.sliding_layers, [true, true, true, true, true, false]);
        assert_eq!(gemma3.rope_of(0).theta, 10000.0);
        assert_eq!(gemma3.rope_of(0).scaling, RopeScaling::None);
        assert_eq!(gemma3.rope_of(5).theta, 1000000.0);
        assert_eq!(gemma3.rope_of(5).scaling, RopeScaling::Linear { factor: 8.0 });

        let mixtral = parse("mixtral", base("mixtral", json!({"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": null}))).unwrap();
        let m = mixtral.moe.clone().unwrap();
        assert_eq!((m.experts, m.experts_per_token, m.expert_size, m.renormalize), (8, 2, 512, true));
        assert!(!mixtral.any_sliding());

        let qwen3_moe = parse("qwen3moe", base("qwen3_moe", json!({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "norm_topk_prob": true, "decoder_sparse_step": 2, "mlp_only_layers": [5], "head_dim": 128}))).unwrap();
        assert_eq!(qwen3_moe.arch, Arch::Qwen3);
        let m = qwen3_moe.moe.unwrap();
        assert_eq!((m.experts, m.experts_per_token, m.expert_size, m.renormalize), (128, 8, 768, true));
        assert_eq!(m.sparse_layers, [false, true, false, true, false, false]);
    }

    #[test]
    fn what_a_family_cannot_run_is_refused_with_the_field() {
        let err = parse("act", base("llama", json!({"hidden_act": "gelu"}))).unwrap_err().to_string();
        assert!(err.contains("hidden_act = \"gelu\""), "{err}");
        let err = parse("rope", base("llama", json!({"rope_scaling": {"type": "su-scaled", "factor": 2.0}}))).unwrap_err().to_string();
        assert!(err.contains("rope_scaling.rope_type = \"su-scaled\""), "{err}");
        let err = parse("experts", base("qwen3_moe", json!({"num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 64}))).unwrap_err().to_string();
        assert!(err.contains("8 of 4 experts"), "{err}");
    }
}
