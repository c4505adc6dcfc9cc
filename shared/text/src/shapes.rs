//! The shapes of random-weight Llama models, for speed measurements that need no files. They
//! match ../shared/bench/peer_mlx_lm.py, so figures compare like for like.

use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};

/// (name, hidden, layers, intermediate, heads, kv heads, vocab, tied embeddings)
const SHAPES: &[(&str, usize, usize, usize, usize, usize, usize, bool)] = &[
    ("tiny", 256, 2, 512, 4, 2, 4096, true),
    ("smollm2", 576, 30, 1536, 9, 3, 49152, true),
    ("1b", 2048, 16, 8192, 32, 8, 128256, true),
    ("8b", 4096, 32, 14336, 32, 8, 128256, false),
];

pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.0).collect()
}

pub fn config(name: &str) -> Result<ModelConfig> {
    let &(_, h, l, f, nh, kv, v, tied) = SHAPES.iter().find(|s| s.0 == name).ok_or_else(|| {
        Error::InvalidRequest(format!("unknown shape {name:?} (known: {})", shape_names().join(", ")))
    })?;
    Ok(ModelConfig {
        arch: Arch::Llama,
        vocab_size: v,
        hidden_size: h,
        intermediate_size: f,
        num_layers: l,
        num_heads: nh,
        num_kv_heads: kv,
        head_dim: h / nh,
        rms_norm_eps: 1e-5,
        rope: crate::rope::RopeConfig::plain(500000.0, h / nh),
        tie_word_embeddings: tied,
        sliding_window: None,
        sliding_layers: vec![false; l],
        rope_local: None,
        query_pre_attn_scalar: None,
        attn_logit_softcap: None,
        final_logit_softcap: None,
        max_position_embeddings: 131072,
    })
}

