//! Configs of the shapes published checkpoints carry, and the errors of bad ones.

use super::*;
use crate::rope::RopeScaling;
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
    c.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    c
}

#[test]
fn published_configs_of_each_family_parse_to_their_options() {
    let llama31 = parse("llama31", base("llama", json!({"rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}))).unwrap();
    assert!(matches!(
        llama31.rope.scaling,
        RopeScaling::Llama3 {
            original_max: 8192,
            ..
        }
    ));
    assert_eq!(llama31.rope.theta, 500000.0);

    let qwen_yarn = parse("yarn", base("qwen2", json!({"rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}))).unwrap();
    assert!(matches!(
        qwen_yarn.rope.scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_max: 32768,
            ..
        }
    ));

    let phi4 = parse("phi4mini", base("phi3", json!({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", "short_factor": vec![1.0; 24], "long_factor": vec![2.0; 24]}}))).unwrap();
    assert_eq!(
        (phi4.arch, phi4.rope.dims, phi4.head_dim),
        (Arch::Phi3, 48, 64)
    );
    assert!(matches!(
        phi4.rope.scaling,
        RopeScaling::LongRope {
            original_max: 4096,
            ..
        }
    ));

    let gemma2 = parse("gemma2", base("gemma2", json!({"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}))).unwrap();
    assert_eq!(
        gemma2.sliding_layers,
        [true, false, true, false, true, false]
    );
    assert_eq!(
        (
            gemma2.attn_logit_softcap,
            gemma2.final_logit_softcap,
            gemma2.query_pre_attn_scalar
        ),
        (Some(50.0), Some(30.0), Some(256.0))
    );
    assert!(gemma2.tie_word_embeddings && gemma2.rope_local.is_none());

    let gemma3 = parse("gemma3", base("gemma3_text", json!({"rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "sliding_window": 512,
        "sliding_window_pattern": 6, "head_dim": 256, "query_pre_attn_scalar": 256, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}))).unwrap();
    assert_eq!(gemma3.sliding_layers, [true, true, true, true, true, false]);
    assert_eq!(gemma3.rope_of(0).theta, 10000.0);
    assert_eq!(gemma3.rope_of(0).scaling, RopeScaling::None);
    assert_eq!(gemma3.rope_of(5).theta, 1000000.0);
    assert_eq!(
        gemma3.rope_of(5).scaling,
        RopeScaling::Linear { factor: 8.0 }
    );

    let mixtral = parse(
        "mixtral",
        base(
            "mixtral",
            json!({"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": null}),
        ),
    )
    .unwrap();
    let m = mixtral.moe.clone().unwrap();
    assert_eq!(
        (m.experts, m.experts_per_token, m.expert_size, m.renormalize),
        (8, 2, 512, true)
    );
    assert!(!mixtral.any_sliding());

    let qwen3_moe = parse(
        "qwen3moe",
        base(
            "qwen3_moe",
            json!({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": true, "decoder_sparse_step": 2, "mlp_only_layers": [5], "head_dim": 128}),
        ),
    )
    .unwrap();
    assert_eq!(qwen3_moe.arch, Arch::Qwen3);
    let m = qwen3_moe.moe.unwrap();
    assert_eq!(
        (m.experts, m.experts_per_token, m.expert_size, m.renormalize),
        (128, 8, 768, true)
    );
    assert_eq!(m.sparse_layers, [false, true, false, true, false, false]);
}

#[test]
fn what_a_family_cannot_run_is_refused_with_the_field() {
    let err = parse("act", base("llama", json!({"hidden_act": "gelu"})))
        .unwrap_err()
        .to_string();
    assert!(err.contains("hidden_act = \"gelu\""), "{err}");
    let err = parse(
        "rope",
        base(
            "llama",
            json!({"rope_scaling": {"type": "su-scaled", "factor": 2.0}}),
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rope_scaling.rope_type = \"su-scaled\""),
        "{err}"
    );
    let err = parse(
        "experts",
        base(
            "qwen3_moe",
            json!({"num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 64}),
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("8 of 4 experts"), "{err}");
}

/// LFM2-1.2B's own config.json: its names for the MLP's width, the norm's epsilon and the tied
/// embedding, the attention layers by index, and the MLP width rule (12288 stated, 8192 used).
#[test]
fn lfm2_s_published_config_parses_to_its_layers_and_widths() {
    let c = parse(
        "lfm2",
        json!({"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536,
               "hidden_size": 2048, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": true,
               "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-5,
               "conv_L_cache": 3, "conv_bias": false, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
               "rope_theta": 1000000.0, "tie_embedding": true, "max_position_embeddings": 128000}),
    )
    .unwrap();
    assert_eq!(c.arch, Arch::Lfm2);
    assert_eq!(c.intermediate_size, 8192);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.head_dim, 64);
    let conv = c.conv.as_ref().unwrap();
    assert_eq!((conv.kernel, conv.bias), (3, false));
    let attention: Vec<usize> = (0..16).filter(|&i| !c.conv_layer(i)).collect();
    assert_eq!(attention, vec![2, 5, 8, 10, 12, 14]);
    assert_eq!(c.attention_layers(), 6);
    assert!(c.recurrent() && !c.caches_rewind());
    // A multiplier other than 1 scales two thirds of the stated width before the rounding up.
    let scaled = parse(
        "lfm2-scaled",
        base("lfm2", json!({"intermediate_size": 3000, "block_ffn_dim_multiplier": 1.5,
                            "block_multiple_of": 128, "layer_types": ["conv", "full_attention", "conv",
                            "conv", "full_attention", "conv"]})),
    )
    .unwrap();
    assert_eq!(scaled.intermediate_size, 3072); // 2000 * 1.5 = 3000, up to 24 * 128
    assert_eq!(scaled.attention_layers(), 2);
}

/// Qwen3.5-9B's config.json as published (a multimodal checkpoint): the text model in
/// `text_config`, three gated DeltaNet layers to one of gated attention, a quarter of each head
/// rotated; the vision config beside it is ignored.
#[test]
fn qwen3_5_s_published_config_parses_its_text_model() {
    let c = parse(
        "qwen3_5",
        json!({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": false, "vision_config": {"depth": 27, "hidden_size": 1152},
               "text_config": {"model_type": "qwen3_5_text", "vocab_size": 248320,
               "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
               "linear_num_key_heads": 16, "linear_num_value_heads": 32,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128,
               "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
               "hidden_act": "silu", "max_position_embeddings": 262144,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                   "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                   "mrope_interleaved": true}}}),
    )
    .unwrap();
    assert_eq!(c.arch, Arch::Qwen35);
    assert!(c.arch.norms_add_one() && c.attn_output_gate);
    assert!(!c.tie_word_embeddings);
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (16, 4, 256));
    assert_eq!(c.rope.dims, 64);
    let d = c.delta.as_ref().unwrap();
    assert_eq!(
        (
            d.key_heads,
            d.value_heads,
            d.key_dim,
            d.value_dim,
            d.conv_kernel
        ),
        (16, 32, 128, 128, 4)
    );
    assert_eq!(d.conv_channels(), 8192);
    let attention: Vec<usize> = (0..32).filter(|&i| !c.recurrent_layer(i)).collect();
    assert_eq!(attention, vec![3, 7, 11, 15, 19, 23, 27, 31]);
    assert!(c.recurrent() && !c.caches_rewind());
}
