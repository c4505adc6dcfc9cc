//! The shapes of random-weight models, for speed measurements that need no files. They match
//! lab/peer/peer_mlx_lm.py, so figures compare like for like.

use crate::config::{Arch, ModelConfig, MoeConfig};
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
    /// (experts, active, expert width): Qwen3-MoE layers (q/k norms, renormalised top-k).
    experts: Option<(usize, usize, usize)>,
}

const fn dense(
    name: &'static str,
    hidden: usize,
    layers: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    tied: bool,
) -> Shape {
    Shape {
        name,
        vocabulary: None,
        hidden,
        layers,
        intermediate,
        heads,
        kv_heads,
        head_dim: hidden / heads,
        vocab,
        tied,
        experts: None,
    }
}

const SHAPES: &[Shape] = &[
    dense("tiny", 256, 2, 512, 4, 2, 4096, true),
    dense("smollm2", 576, 30, 1536, 9, 3, 49152, true),
    Shape {
        vocabulary: Some("llama3"),
        ..dense("1b", 2048, 16, 8192, 32, 8, 128256, true)
    },
    Shape {
        vocabulary: Some("llama3"),
        ..dense("8b", 4096, 32, 14336, 32, 8, 128256, false)
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
        experts: Some((8, 2, 128)),
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
        experts: Some((128, 8, 768)),
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
    let moe = s.experts.map(|(experts, active, width)| MoeConfig {
        experts,
        experts_per_token: active,
        expert_size: width,
        renormalize: true,
        sparse_layers: vec![true; s.layers],
        shared_expert: None,
    });
    Ok(ModelConfig {
        arch: if moe.is_some() {
            Arch::Qwen3
        } else {
            Arch::Llama
        },
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.intermediate,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        rms_norm_eps: 1e-5,
        rope: RopeConfig::plain(
            if moe.is_some() {
                1_000_000.0
            } else {
                500_000.0
            },
            s.head_dim,
        ),
        tie_word_embeddings: s.tied,
        sliding_window: None,
        sliding_layers: vec![false; s.layers],
        rope_local: None,
        query_pre_attn_scalar: None,
        attn_logit_softcap: None,
        final_logit_softcap: None,
        moe,
        max_position_embeddings: 131072,
    })
}
