//! A model's config from a Hugging Face `config.json` (transformers 4's and 5's layouts).

use std::path::Path;

use crate::error::{Error, Result};
use crate::rope::{self, RopeConfig};
use serde::Deserialize;

use super::{Arch, ConvConfig, DeltaNetConfig, ModelConfig, MoeConfig};

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: Option<usize>,
    /// LFM2's name for `intermediate_size` in its own checkpoints.
    block_ff_dim: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f32>,
    /// LFM2's name for `rms_norm_eps`.
    norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    /// transformers 5: the rope's base, type and scaling in one object.
    rope_parameters: Option<serde_json::Value>,
    /// transformers 4: the scaling beside `rope_theta`.
    rope_scaling: Option<serde_json::Value>,
    partial_rotary_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    /// LFM2's name for `tie_word_embeddings`.
    tie_embedding: Option<bool>,
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
    /// LFM2: the convolution's length and biases, the layers that attend (when `layer_types`
    /// does not say), and how its MLP's width follows from `intermediate_size`.
    #[serde(rename = "conv_L_cache")]
    conv_l_cache: Option<usize>,
    conv_bias: Option<bool>,
    full_attn_idxs: Option<Vec<usize>>,
    block_auto_adjust_ff_dim: Option<bool>,
    block_ffn_dim_multiplier: Option<f32>,
    block_multiple_of: Option<usize>,
    /// Qwen3.5's gated DeltaNet layers (`layer_types` "linear_attention", else every layer but
    /// each `full_attention_interval`-th).
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
    full_attention_interval: Option<usize>,
}

/// A config's text model: the whole config, or, for a multimodal checkpoint of a family served
/// as text (Qwen3.5's, `model_type` "qwen3_5"), its `text_config`, which takes the outer
/// `tie_word_embeddings` where it has none.
fn text_model(mut v: serde_json::Value) -> serde_json::Value {
    let multimodal = v.get("model_type").and_then(|t| t.as_str()) == Some("qwen3_5");
    match v
        .get_mut("text_config")
        .filter(|_| multimodal)
        .map(serde_json::Value::take)
    {
        Some(mut text) => {
            if let (Some(t), Some(tie)) = (text.as_object_mut(), v.get("tie_word_embeddings")) {
                t.entry("tie_word_embeddings").or_insert(tie.clone());
            }
            text
        }
        None => v,
    }
}

pub fn from_hf_json(path: &Path) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let raw: HfConfig = serde_json::from_str(&text)
        .map(text_model)
        .and_then(serde_json::from_value)
        .map_err(|e| Error::format(path, e.to_string()))?;
    let name = raw
        .model_type
        .clone()
        .or_else(|| raw.architectures.as_ref().and_then(|a| a.first().cloned()))
        .unwrap_or_default();
    let arch = match name.as_str() {
        "llama" | "mistral" | "mixtral" | "LlamaForCausalLM" | "MistralForCausalLM"
        | "MixtralForCausalLM" => Arch::Llama,
        "qwen2" | "qwen2_moe" | "Qwen2ForCausalLM" | "Qwen2MoeForCausalLM" => Arch::Qwen2,
        "qwen3" | "qwen3_moe" | "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM" => Arch::Qwen3,
        "phi3" | "Phi3ForCausalLM" => Arch::Phi3,
        "gemma2" | "Gemma2ForCausalLM" => Arch::Gemma2,
        "gemma3_text" | "Gemma3ForCausalLM" => Arch::Gemma3,
        "lfm2" | "Lfm2ForCausalLM" => Arch::Lfm2,
        "qwen3_5_text" | "Qwen3_5ForCausalLM" => Arch::Qwen35,
        other => {
            return Err(Error::UnsupportedArch {
                path: path.into(),
                arch: other.to_string(),
            })
        }
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
    let intermediate_size = match (arch, raw.intermediate_size.or(raw.block_ff_dim)) {
        (Arch::Lfm2, Some(n)) => lfm2_mlp_width(&raw, n),
        (_, Some(n)) => n,
        (_, None) => {
            return Err(Error::format(path, "no intermediate_size".to_string()));
        }
    };
    let conv = (arch == Arch::Lfm2).then(|| ConvConfig {
        kernel: raw.conv_l_cache.unwrap_or(3),
        bias: raw.conv_bias.unwrap_or(false),
        layers: match (&raw.layer_types, &raw.full_attn_idxs) {
            (Some(types), _) => types.iter().map(|t| t == "conv").collect(),
            (None, Some(attn)) => (0..layers).map(|i| !attn.contains(&i)).collect(),
            (None, None) => vec![false; layers],
        },
    });
    let delta = (arch == Arch::Qwen35).then(|| DeltaNetConfig {
        key_heads: raw.linear_num_key_heads.unwrap_or(16),
        value_heads: raw.linear_num_value_heads.unwrap_or(32),
        key_dim: raw.linear_key_head_dim.unwrap_or(128),
        value_dim: raw.linear_value_head_dim.unwrap_or(128),
        conv_kernel: raw.linear_conv_kernel_dim.unwrap_or(4),
        layers: match &raw.layer_types {
            Some(types) => types.iter().map(|t| t == "linear_attention").collect(),
            None => DeltaNetConfig::all_but_every(raw.full_attention_interval.unwrap_or(4), layers),
        },
        value_heads_tiled: false,
    });
    let moe = hf_moe(&raw, &name, layers, intermediate_size);
    let activation = raw
        .hidden_activation
        .as_deref()
        .or(raw.hidden_act.as_deref())
        .unwrap_or(if arch.is_gemma() {
            "gelu_pytorch_tanh"
        } else {
            "silu"
        });
    let expected = if arch.is_gemma() {
        "gelu_pytorch_tanh"
    } else {
        "silu"
    };
    if activation != expected && !(arch.is_gemma() && activation == "gelu_tanh") {
        return Err(Error::format(
            path,
            format!("hidden_act = {activation:?}: this architecture runs {expected}"),
        ));
    }
    let cfg = ModelConfig {
        arch,
        vocab_size: raw.vocab_size,
        hidden_size: raw.hidden_size,
        intermediate_size,
        num_layers: raw.num_hidden_layers,
        num_heads: heads,
        num_kv_heads: raw.num_key_value_heads.unwrap_or(heads),
        head_dim,
        rms_norm_eps: raw.rms_norm_eps.or(raw.norm_eps).unwrap_or(1e-6),
        rope,
        tie_word_embeddings: raw
            .tie_word_embeddings
            .or(raw.tie_embedding)
            .unwrap_or(arch.is_gemma() || arch == Arch::Lfm2),
        sliding_window,
        sliding_layers,
        rope_local,
        query_pre_attn_scalar: raw.query_pre_attn_scalar.filter(|_| arch.is_gemma()),
        attn_logit_softcap: raw.attn_logit_softcapping.filter(|_| arch == Arch::Gemma2),
        final_logit_softcap: raw.final_logit_softcapping.filter(|_| arch.is_gemma()),
        moe,
        conv,
        delta,
        attn_output_gate: arch == Arch::Qwen35,
        max_position_embeddings: max_positions,
    };
    cfg.validate(path)?;
    Ok(cfg)
}

/// Mixtral's experts (every layer, renormalised) or Qwen3-MoE's (every `decoder_sparse_step`-th
/// layer not in `mlp_only_layers`, renormalised with `norm_topk_prob`).
fn hf_moe(raw: &HfConfig, name: &str, layers: usize, dense_size: usize) -> Option<MoeConfig> {
    match name {
        "mixtral" | "MixtralForCausalLM" => Some(MoeConfig {
            experts: raw.num_local_experts.unwrap_or(8),
            experts_per_token: raw.num_experts_per_tok.unwrap_or(2),
            expert_size: dense_size,
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
                sparse_layers: (0..layers)
                    .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                    .collect(),
                shared_expert: if matches!(name, "qwen2_moe" | "Qwen2MoeForCausalLM") {
                    raw.shared_expert_intermediate_size.filter(|&n| n > 0)
                } else {
                    None
                },
            })
        }
        _ => None,
    }
}

/// LFM2's MLP width: with `block_auto_adjust_ff_dim` (its default), two thirds of the stated
/// size, times `block_ffn_dim_multiplier` (1), rounded up to a multiple of `block_multiple_of`
/// (256).
fn lfm2_mlp_width(raw: &HfConfig, stated: usize) -> usize {
    if !raw.block_auto_adjust_ff_dim.unwrap_or(true) {
        return stated;
    }
    let scaled = (raw.block_ffn_dim_multiplier.unwrap_or(1.0) * (2 * stated / 3) as f32) as usize;
    let multiple = raw.block_multiple_of.unwrap_or(256).max(1);
    scaled.div_ceil(multiple) * multiple
}

/// The ropes of a Hugging Face config: transformers 5's `rope_parameters` (base, type and
/// scaling together; Gemma 3's per layer type), else transformers 4's `rope_theta` with
/// `rope_scaling` (and Gemma 3's `rope_local_base_freq`). Returns the rope of full-attention
/// layers and, where it differs, that of sliding ones.
fn hf_ropes(
    raw: &HfConfig,
    arch: Arch,
    head_dim: usize,
    max_positions: usize,
) -> std::result::Result<(RopeConfig, Option<RopeConfig>), rope::RopeError> {
    let params = raw.rope_parameters.as_ref().filter(|p| !p.is_null());
    let num = |p: Option<&serde_json::Value>, k: &str| {
        p.and_then(|p| p.get(k))
            .and_then(serde_json::Value::as_f64)
            .map(|v| v as f32)
    };
    let partial = raw
        .partial_rotary_factor
        .or_else(|| num(params, "partial_rotary_factor"))
        .unwrap_or(1.0);
    let dims = (head_dim as f32 * partial) as usize;
    let one = |field: &str, desc: Option<&serde_json::Value>, default_theta: f32| {
        let theta = num(desc, "rope_theta")
            .or(raw
                .rope_theta
                .filter(|_| field != "rope_parameters.sliding_attention"))
            .unwrap_or(default_theta);
        rope::from_hf(
            desc,
            field,
            theta,
            dims,
            max_positions,
            raw.original_max_position_embeddings,
        )
    };
    match (arch, params) {
        (Arch::Gemma3, Some(p))
            if p.get("full_attention").is_some() || p.get("sliding_attention").is_some() =>
        {
            let global = one(
                "rope_parameters.full_attention",
                p.get("full_attention"),
                1_000_000.0,
            )?;
            let local = one(
                "rope_parameters.sliding_attention",
                p.get("sliding_attention"),
                10_000.0,
            )?;
            Ok((global, Some(local)))
        }
        (Arch::Gemma3, _) => {
            let global = one(
                "rope_scaling",
                raw.rope_scaling.as_ref().or(params),
                1_000_000.0,
            )?;
            let local = RopeConfig::plain(raw.rope_local_base_freq.unwrap_or(10_000.0), dims);
            Ok((global, Some(local)))
        }
        (_, Some(p)) => Ok((one("rope_parameters", Some(p), 10_000.0)?, None)),
        (_, None) => Ok((
            one("rope_scaling", raw.rope_scaling.as_ref(), 10_000.0)?,
            None,
        )),
    }
}
