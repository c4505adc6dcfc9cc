//! The shapes of random-weight models, for speed measurements that need no files. They match
//! lab/peer/peer_mlx_lm.py, so figures compare like for like.

use crate::config::{Arch, ConvConfig, DeltaNetConfig, ModelConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::rope::RopeConfig;

struct Shape {
    name: &'static str,
    /// The vocabulary the shape was modelled on, in the set-up's tokenizer cache (see
    /// `tokenizer`), where it has one.
    vocabulary: Option<&'static str>,
    hidden: usize,
    layers: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    tied: bool,
    /// Qwen3-MoE layers (q/k norms, renormalised top-k).
    experts: Option<Experts>,
    /// LFM2: the layers that attend; every other one is a short convolution (3 positions).
    attention_layers: Option<&'static [usize]>,
    /// Qwen3.5: gated DeltaNet in every layer but each fourth (gated attention, a quarter of
    /// the head rotated, rope base 10^7).
    delta: Option<Delta>,
}

/// A gated DeltaNet's shape: key heads, value heads, their widths (convolution of 4).
struct Delta {
    key_heads: usize,
    value_heads: usize,
    key_dim: usize,
    value_dim: usize,
}

/// A mixture of experts' shape: experts per layer, experts a token runs, an expert's width.
struct Experts {
    count: usize,
    active: usize,
    width: usize,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "tiny",
        vocabulary: None,
        hidden: 256,
        layers: 2,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        vocab: 4096,
        tied: true,
        experts: None,
        attention_layers: None,
        delta: None,
    },
    Shape {
        name: "smollm2",
        vocabulary: None,
        hidden: 576,
        layers: 30,
        intermediate: 1536,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        vocab: 49152,
        tied: true,
        experts: None,
        attention_layers: None,
        delta: None,
    },
    Shape {
        name: "1b",
        vocabulary: Some("llama3"),
        hidden: 2048,
        layers: 16,
        intermediate: 8192,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        vocab: 128256,
        tied: true,
        experts: None,
        attention_layers: None,
        delta: None,
    },
    Shape {
        name: "8b",
        vocabulary: Some("llama3"),
        hidden: 4096,
        layers: 32,
        intermediate: 14336,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        vocab: 128256,
        tied: false,
        experts: None,
        attention_layers: None,
        delta: None,
    },
    Shape {
        name: "tiny-moe",
        vocabulary: None,
        hidden: 256,
        layers: 2,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        vocab: 4096,
        tied: false,
        experts: Some(Experts {
            count: 8,
            active: 2,
            width: 128,
        }),
        attention_layers: None,
        delta: None,
    },
    // Qwen3-30B-A3B
    Shape {
        name: "moe",
        vocabulary: Some("qwen3"),
        hidden: 2048,
        layers: 48,
        intermediate: 6144,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        vocab: 151936,
        tied: false,
        experts: Some(Experts {
            count: 128,
            active: 8,
            width: 768,
        }),
        attention_layers: None,
        delta: None,
    },
    // LFM2 as the peer builds it: the MLP's stated 768 is 512 after LFM2's adjustment.
    Shape {
        name: "tiny-lfm2",
        vocabulary: None,
        hidden: 256,
        layers: 4,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        vocab: 4096,
        tied: true,
        experts: None,
        attention_layers: Some(&[2]),
        delta: None,
    },
    // LiquidAI's LFM2-1.2B: 10 convolution layers and 6 attention layers, the MLP's stated
    // 12288 adjusted to 8192.
    Shape {
        name: "lfm2",
        vocabulary: None,
        hidden: 2048,
        layers: 16,
        intermediate: 8192,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        vocab: 65536,
        tied: true,
        experts: None,
        attention_layers: Some(&[2, 5, 8, 10, 12, 14]),
        delta: None,
    },
    Shape {
        name: "tiny-qwen35",
        vocabulary: None,
        hidden: 256,
        layers: 4,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        vocab: 4096,
        tied: true,
        experts: None,
        attention_layers: None,
        delta: Some(Delta {
            key_heads: 2,
            value_heads: 4,
            key_dim: 64,
            value_dim: 64,
        }),
    },
    // Qwen3.5-9B's text model: 24 DeltaNet layers and 8 of gated attention.
    Shape {
        name: "qwen35",
        vocabulary: None,
        hidden: 4096,
        layers: 32,
        intermediate: 12288,
        heads: 16,
        kv_heads: 4,
        head_dim: 256,
        vocab: 248320,
        tied: false,
        experts: None,
        attention_layers: None,
        delta: Some(Delta {
            key_heads: 16,
            value_heads: 32,
            key_dim: 128,
            value_dim: 128,
        }),
    },
];

pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.name).collect()
}

fn shape(name: &str) -> Result<&'static Shape> {
    SHAPES.iter().find(|s| s.name == name).ok_or_else(|| {
        Error::InvalidRequest(format!(
            "unknown shape {name:?} (known: {})",
            shape_names().join(", ")
        ))
    })
}

/// The tokenizer of the vocabulary a shape was modelled on (Llama 3's for 1b and 8b, Qwen3's
/// for moe), when the set-up has fetched it (`.cache/tokenizers` beside the models
/// directory): random weights then still take text, detokenize and take constraints with a
/// real vocabulary's costs. None for shapes without one, or when it is not there.
pub fn tokenizer(name: &str) -> Result<Option<crate::Tokenizer>> {
    let Some(vocab) = shape(name)?.vocabulary else {
        return Ok(None);
    };
    let dir = crate::models_dir()
        .parent()
        .map(|p| p.join("tokenizers").join(vocab));
    match dir.filter(|d| d.join("tokenizer.json").is_file()) {
        Some(d) => crate::Tokenizer::from_hf_dir(&d).map(Some),
        None => Ok(None),
    }
}

pub fn config(name: &str) -> Result<ModelConfig> {
    let s = shape(name)?;
    let moe = s.experts.as_ref().map(|e| MoeConfig {
        experts: e.count,
        experts_per_token: e.active,
        expert_size: e.width,
        renormalize: true,
        sparse_layers: vec![true; s.layers],
        shared_expert: None,
    });
    let conv = s.attention_layers.map(|attn| ConvConfig {
        kernel: 3,
        bias: false,
        layers: (0..s.layers).map(|i| !attn.contains(&i)).collect(),
    });
    let delta = s.delta.as_ref().map(|d| DeltaNetConfig {
        key_heads: d.key_heads,
        value_heads: d.value_heads,
        key_dim: d.key_dim,
        value_dim: d.value_dim,
        conv_kernel: 4,
        layers: DeltaNetConfig::all_but_every(4, s.layers),
        value_heads_tiled: false,
    });
    let rope = match (&moe, &conv, &delta) {
        (_, _, Some(_)) => RopeConfig::plain(10_000_000.0, s.head_dim / 4),
        (Some(_), _, _) | (_, Some(_), _) => RopeConfig::plain(1_000_000.0, s.head_dim),
        _ => RopeConfig::plain(500_000.0, s.head_dim),
    };
    Ok(ModelConfig {
        arch: match (&moe, &conv, &delta) {
            (Some(_), _, _) => Arch::Qwen3,
            (_, Some(_), _) => Arch::Lfm2,
            (_, _, Some(_)) => Arch::Qwen35,
            _ => Arch::Llama,
        },
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.intermediate,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        rms_norm_eps: if delta.is_some() { 1e-6 } else { 1e-5 },
        rope,
        tie_word_embeddings: s.tied,
        sliding_window: None,
        sliding_layers: vec![false; s.layers],
        rope_local: None,
        query_pre_attn_scalar: None,
        attn_logit_softcap: None,
        final_logit_softcap: None,
        moe,
        conv,
        attn_output_gate: delta.is_some(),
        delta,
        max_position_embeddings: 131072,
    })
}
