//! A model's shape and options, read from a Hugging Face `config.json` or from GGUF metadata.
//! One struct for every architecture: each arch module says which options it uses. `hf` reads
//! `config.json`, `gguf` a GGUF file's metadata.

mod gguf;
mod hf;
#[cfg(test)]
mod tests;

pub use self::gguf::from_gguf;
pub use self::hf::from_hf_json;

use std::path::Path;

use crate::error::{Error, Result};
use crate::rope::RopeConfig;

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
    /// LFM2: short gated convolutions in most layers ([`ConvConfig`]), grouped-query attention
    /// with q/k norms in the others.
    Lfm2,
    /// Qwen3.5 (text): gated DeltaNet in three layers of four ([`DeltaNetConfig`]), gated
    /// attention (q_proj also yields a sigmoid gate on the output; q/k norms; partial rope) in
    /// the others; every RMS norm but DeltaNet's own scales by 1 + w.
    Qwen35,
}

impl Arch {
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// Whether the model's RMS norms (around layers, and q/k norms) scale by 1 + w rather
    /// than w.
    pub fn norms_add_one(self) -> bool {
        self.is_gemma() || self == Arch::Qwen35
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

/// Layers that mix positions by a short causal convolution instead of attention (LFM2): the
/// layer's input projected to B, C and x, `C * conv(B * x)` over the last `kernel` positions,
/// one filter per channel. Such a layer keeps the last `kernel - 1` inputs of its convolution
/// per sequence, not keys and values.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvConfig {
    pub kernel: usize,
    /// The projections and the convolution carry biases.
    pub bias: bool,
    /// Which layers convolve (one entry a layer).
    pub layers: Vec<bool>,
}

/// Gated DeltaNet layers (Qwen3.5): linear attention whose per-sequence state is a matrix per
/// value head, updated by the gated delta rule at every position. The layer's input is projected
/// to q, k, v (passed through a causal depthwise convolution of `conv_kernel` positions and
/// SiLU), a gate z, and per value head a write strength (beta) and a decay. A layer keeps per
/// sequence the convolution's last `conv_kernel - 1` inputs and the state [value_heads,
/// key_dim, value_dim] in float32.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetConfig {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    /// Which layers are DeltaNet layers (one entry a layer).
    pub layers: Vec<bool>,
    /// How value heads share key heads: Hugging Face's checkpoints group them (value head j
    /// reads key head j / (value_heads / key_heads)); llama.cpp's GGUF files reorder every
    /// value-head axis so that they tile (j reads key head j % key_heads).
    pub value_heads_tiled: bool,
}

impl DeltaNetConfig {
    /// Which of `layers` layers are DeltaNet layers when one layer in every `interval` attends
    /// (the last of each run: `full_attention_interval`).
    pub fn all_but_every(interval: usize, layers: usize) -> Vec<bool> {
        let every = interval.max(1);
        (0..layers).map(|i| (i + 1) % every != 0).collect()
    }

    /// The convolution's channels: q, k and v side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
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
    /// Convolution layers (LFM2).
    pub conv: Option<ConvConfig>,
    /// Gated DeltaNet layers (Qwen3.5).
    pub delta: Option<DeltaNetConfig>,
    /// Attention's output is gated per head by a sigmoid of a second half of q_proj (Qwen3.5).
    pub attn_output_gate: bool,
    pub max_position_embeddings: usize,
}

impl ModelConfig {
    /// A layer's attention window, None when it attends to everything before it.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding_layers.get(layer).copied().unwrap_or(false))
    }

    /// Whether every layer's cache can rewind and be cut back to a prefix: no layer slides and
    /// none keeps a recurrent state. Such a model decodes in batches and pads chunks to a grid.
    pub fn caches_rewind(&self) -> bool {
        !self.any_sliding() && !self.recurrent()
    }

    /// Whether any layer slides (its caches cannot rewind, and it decodes per sequence).
    pub fn any_sliding(&self) -> bool {
        self.sliding_window.is_some() && self.sliding_layers.iter().any(|&s| s)
    }

    /// Layer `layer`'s convolution, when it convolves instead of attending.
    pub fn conv_at(&self, layer: usize) -> Option<&ConvConfig> {
        self.conv
            .as_ref()
            .filter(|c| c.layers.get(layer).copied().unwrap_or(false))
    }

    /// Whether layer `layer` convolves instead of attending.
    pub fn conv_layer(&self, layer: usize) -> bool {
        self.conv_at(layer).is_some()
    }

    /// Layer `layer`'s gated DeltaNet, when it is one.
    pub fn delta_at(&self, layer: usize) -> Option<&DeltaNetConfig> {
        self.delta
            .as_ref()
            .filter(|d| d.layers.get(layer).copied().unwrap_or(false))
    }

    /// Whether layer `layer` keeps a recurrent state (a convolution's, a DeltaNet's) instead of
    /// keys and values.
    pub fn recurrent_layer(&self, layer: usize) -> bool {
        self.conv_at(layer).is_some() || self.delta_at(layer).is_some()
    }

    /// Whether some layer keeps a recurrent state instead of keys and values (a state that
    /// cannot be cut back to a shorter prefix, nor rewound).
    pub fn recurrent(&self) -> bool {
        (0..self.num_layers).any(|l| self.recurrent_layer(l))
    }

    /// Layers that attend (and hold keys and values).
    pub fn attention_layers(&self) -> usize {
        (0..self.num_layers)
            .filter(|&i| !self.recurrent_layer(i))
            .count()
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
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} attention heads do not group over {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.hidden_size == 0
            || self.num_layers == 0
            || self.vocab_size == 0
            || self.head_dim == 0
        {
            return bad("zero-sized model dimension".into());
        }
        if self.sliding_layers.len() != self.num_layers {
            return bad(format!(
                "{} layer types for {} layers",
                self.sliding_layers.len(),
                self.num_layers
            ));
        }
        if let Some(m) = &self.moe {
            if m.experts == 0
                || m.experts_per_token == 0
                || m.experts_per_token > m.experts
                || m.expert_size == 0
            {
                return bad(format!(
                    "{} of {} experts a token, {} wide",
                    m.experts_per_token, m.experts, m.expert_size
                ));
            }
            if m.sparse_layers.len() != self.num_layers {
                return bad(format!(
                    "{} expert layer flags for {} layers",
                    m.sparse_layers.len(),
                    self.num_layers
                ));
            }
        }
        if let Some(c) = &self.conv {
            if c.kernel == 0 || c.layers.len() != self.num_layers {
                return bad(format!(
                    "a convolution of {} positions with {} layer flags for {} layers",
                    c.kernel,
                    c.layers.len(),
                    self.num_layers
                ));
            }
        }
        if let Some(d) = &self.delta {
            if d.conv_kernel == 0
                || d.key_heads == 0
                || !d.value_heads.is_multiple_of(d.key_heads)
                || d.key_dim == 0
                || d.value_dim == 0
                || d.layers.len() != self.num_layers
            {
                return bad(format!(
                    "gated DeltaNet of {} key heads ({} wide), {} value heads ({} wide), a \
                     convolution of {} positions, {} layer flags for {} layers",
                    d.key_heads,
                    d.key_dim,
                    d.value_heads,
                    d.value_dim,
                    d.conv_kernel,
                    d.layers.len(),
                    self.num_layers
                ));
            }
        }
        if self.sliding_window == Some(0) {
            return bad("a sliding window of 0 tokens".into());
        }
        if !self.rope.dims.is_multiple_of(2)
            || self.rope.dims == 0
            || self.rope.dims > self.head_dim
        {
            return bad(format!("{} rotary dimensions of a {}-wide head: rotary embeddings need pairs within the head", self.rope.dims, self.head_dim));
        }
        Ok(())
    }
}
