//! A model's config from a GGUF file's metadata (`<architecture>.*` keys).

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};
use crate::rope::{self, RopeConfig, RopeScaling};

use super::{Arch, ConvConfig, DeltaNetConfig, ModelConfig, MoeConfig};

pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let path = f.path();
    let arch_name = f
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let arch = match arch_name.as_str() {
        "llama" | "mistral" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" | "qwen3moe" => Arch::Qwen3,
        "phi3" => Arch::Phi3,
        "gemma2" => Arch::Gemma2,
        "gemma3" => Arch::Gemma3,
        "lfm2" => Arch::Lfm2,
        "qwen35" => Arch::Qwen35,
        _ => {
            return Err(Error::UnsupportedArch {
                path: path.into(),
                arch: arch_name,
            })
        }
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
        .ok_or_else(|| Error::MissingTensor {
            path: path.into(),
            tensor: "token_embd.weight".into(),
        })?;
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
    let pattern = opt_uint("attention.sliding_window_pattern")
        .unwrap_or(6)
        .max(1);
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
    // LFM2's files give each layer its KV heads, 0 for a convolution layer.
    let kv_heads_per_layer: Option<Vec<usize>> = f
        .get(&key("attention.head_count_kv"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|v| v as usize)
                .collect()
        });
    let num_kv_heads = match &kv_heads_per_layer {
        Some(per_layer) => per_layer.iter().copied().max().unwrap_or(heads),
        None => opt_uint("attention.head_count_kv").unwrap_or(heads),
    };
    let conv = (arch == Arch::Lfm2).then(|| ConvConfig {
        kernel: opt_uint("shortconv.l_cache").unwrap_or(3),
        // llama.cpp's LFM2 has no convolution biases (nor have the published checkpoints).
        bias: false,
        layers: match &kv_heads_per_layer {
            Some(per_layer) => per_layer.iter().map(|&n| n == 0).collect(),
            None => vec![false; layers],
        },
    });
    let delta = match arch {
        Arch::Qwen35 => Some(gguf_delta(f, &key, layers)?),
        _ => None,
    };
    let cfg = ModelConfig {
        arch,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: uint("feed_forward_length")?,
        num_layers: uint("block_count")?,
        num_heads: heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: f
            .get(&key("attention.layer_norm_rms_epsilon"))
            .and_then(Value::as_f64)
            .unwrap_or(1e-5) as f32,
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
        conv,
        delta,
        attn_output_gate: arch == Arch::Qwen35,
        max_position_embeddings: max_positions,
    };
    cfg.validate(path)?;
    Ok(cfg)
}

/// Gated DeltaNet of llama.cpp's `qwen35` metadata: `ssm.group_count` key heads of
/// `ssm.state_size`, `ssm.time_step_rank` value heads sharing `ssm.inner_size`, the convolution's
/// `ssm.conv_kernel`; the recurrent layers from `attention.recurrent_layers`, or every layer but
/// each `full_attention_interval`-th. Its converter tiles the value heads over the key heads.
fn gguf_delta(f: &GgufFile, key: &dyn Fn(&str) -> String, layers: usize) -> Result<DeltaNetConfig> {
    let path = f.path();
    let uint = |k: &str| {
        f.get(&key(k))
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| Error::format(path, format!("missing metadata {}", key(k))))
    };
    let value_heads = uint("ssm.time_step_rank")?;
    let recurrent: Option<Vec<bool>> = f
        .get(&key("attention.recurrent_layers"))
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_bool().unwrap_or(false)).collect());
    let layers = match recurrent {
        Some(r) => r,
        None => DeltaNetConfig::all_but_every(uint("full_attention_interval")?, layers),
    };
    Ok(DeltaNetConfig {
        key_heads: uint("ssm.group_count")?,
        value_heads,
        key_dim: uint("ssm.state_size")?,
        value_dim: uint("ssm.inner_size")? / value_heads.max(1),
        conv_kernel: uint("ssm.conv_kernel")?,
        layers,
        value_heads_tiled: true,
    })
}

/// Experts of GGUF metadata: `expert_count` and `expert_used_count` (Mixtral's files are arch
/// `llama` with them), each expert's width `expert_feed_forward_length` (Qwen3-MoE) or the
/// model's `feed_forward_length` (Mixtral); the layers with a router (`ffn_gate_inp`) route.
/// The chosen experts' weights are renormalised as in the Hugging Face configs these files
/// come from (Mixtral always, Qwen3-MoE's `norm_topk_prob`, true in every published one),
/// unless `expert_weights_norm` says otherwise.
fn gguf_moe(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    layers: usize,
) -> Result<Option<MoeConfig>> {
    let uint = |k: &str| f.get(&key(k)).and_then(Value::as_u64).map(|v| v as usize);
    let Some(experts) = uint("expert_count").filter(|&n| n > 0) else {
        return Ok(None);
    };
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
        renormalize: f
            .get(&key("expert_weights_norm"))
            .and_then(Value::as_bool)
            .unwrap_or(true),
        sparse_layers: (0..layers)
            .map(|i| f.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some())
            .collect(),
        shared_expert: None,
    }))
}

/// The rope of GGUF metadata: `rope.freq_base`, `rope.dimension_count` (partial rotary) and
/// `rope.scaling.*` (linear, yarn); Llama 3.1+ files carry their scaling precomputed as the
/// tensor `rope_freqs.weight`, one divisor per pair of rotated dimensions; Phi-3's long RoPE
/// comes as the tensors `rope_factors_short.weight` and `rope_factors_long.weight`, with
/// `rope.scaling.original_context_length` and `rope.scaling.attn_factor`.
fn gguf_rope(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    head_dim: usize,
    max_positions: usize,
) -> Result<RopeConfig> {
    let path = f.path();
    let num = |k: &str| f.get(&key(k)).and_then(Value::as_f64).map(|v| v as f32);
    let theta = num("rope.freq_base").unwrap_or(10000.0);
    let dims = f
        .get(&key("rope.dimension_count"))
        .and_then(Value::as_u64)
        .map_or(head_dim, |v| v as usize);
    let kind = f
        .get(&key("rope.scaling.type"))
        .and_then(Value::as_str)
        .unwrap_or("none");
    let factor = num("rope.scaling.factor").unwrap_or(1.0);
    let original_max = f
        .get(&key("rope.scaling.original_context_length"))
        .and_then(Value::as_u64)
        .map_or(max_positions, |v| v as usize);
    let scaling = match kind {
        "none" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => {
            let json = serde_json::json!({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max});
            rope::from_hf(
                Some(&json),
                &key("rope.scaling"),
                theta,
                dims,
                max_positions,
                None,
            )
            .map_err(|e| Error::format(path, e.to_string()))?
            .scaling
        }
        other => {
            return Err(Error::format(
                path,
                format!(
                    "{} = {other:?}: unknown rope scaling type (llmq reads none, linear, yarn)",
                    key("rope.scaling.type")
                ),
            ))
        }
    };
    let factors = |name: &str| f.tensor(name).map(|t| f.read_f32(t));
    if let (Some(short), Some(long)) = (
        factors("rope_factors_short.weight"),
        factors("rope_factors_long.weight"),
    ) {
        let mut json = serde_json::json!({"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                          "original_max_position_embeddings": original_max});
        if let Some(a) = num("rope.scaling.attn_factor") {
            json["attention_factor"] = a.into();
        }
        let rope = rope::from_hf(
            Some(&json),
            &key("rope.scaling"),
            theta,
            dims,
            max_positions,
            None,
        )
        .map_err(|e| Error::format(path, e.to_string()))?;
        return Ok(RopeConfig {
            theta,
            dims,
            scaling: rope.scaling,
        });
    }
    let scaling = match (f.tensor("rope_freqs.weight"), scaling) {
        (Some(t), RopeScaling::None) => {
            let factors = f.read_f32(t);
            if factors.len() != dims / 2 {
                return Err(Error::format(
                    path,
                    format!(
                        "rope_freqs.weight has {} factors for {} rotary dimensions",
                        factors.len(),
                        dims
                    ),
                ));
            }
            RopeScaling::Factors { factors }
        }
        (_, s) => s,
    };
    Ok(RopeConfig {
        theta,
        dims,
        scaling,
    })
}
