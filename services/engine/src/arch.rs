//! What distinguishes the supported architectures. They share one decoder graph
//! (`model.rs`); each differs only in the options below and in the weights it carries.
//!
//! | arch   | q/k/v bias | q/k RMS norm | fused q/k/v, gate/up | window            | models                       |
//! |--------|------------|--------------|----------------------|-------------------|------------------------------|
//! | llama  | no         | no           | no                   | Mistral's option  | Llama 2/3.x, SmolLM, TinyLlama, Mistral |
//! | qwen2  | yes        | no           | no                   | `use_sliding_window` | Qwen2, Qwen2.5            |
//! | qwen3  | no         | yes          | no                   | `use_sliding_window` | Qwen3                     |
//! | phi3   | no         | no           | yes                  | `sliding_window`  | Phi-3, Phi-3.5, Phi-4-mini   |
//! | gemma2 | no         | no           | no                   | every other layer | Gemma 2                      |
//! | gemma3 | no         | yes          | no                   | 5 of every 6 layers | Gemma 3 (text)             |
//! | lfm2   | no         | yes          | no                   | none              | LFM2 (most layers convolve) |
//! | qwen35 | no         | yes          | no                   | none              | Qwen3.5 text (3 of 4 layers DeltaNet) |
//!
//! Gemma's layers differ beyond these options (`ModelConfig::arch.is_gemma()`): norms after
//! attention and MLP too, norm weights as 1 + w, GELU (tanh), embeddings scaled by
//! sqrt(hidden), the score scale from `query_pre_attn_scalar`; Gemma 2 soft-caps scores and
//! logits, Gemma 3 gives its sliding layers their own rope base.
//!
//! LFM2's layers mostly mix positions by a short gated convolution ([`crate::model`]'s `conv`)
//! instead of attention, and its weights have names of their own ([`Names`]). Qwen3.5's mostly
//! by a gated DeltaNet (`delta`); its attention gates its output, and its norms scale by 1 + w.
//!
//! Rotary scaling (llama3, yarn, linear, dynamic, longrope) and partial rotation are the
//! config's, whatever the arch ([`llmq_text::rope`]).

use llmq_text::config::Arch;

#[derive(Debug, Clone, Copy)]
pub struct ArchOptions {
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// q/k/v as one stored projection (`qkv_proj`), gate/up as one (`gate_up_proj`).
    pub fused: bool,
    pub names: Names,
}

/// What a checkpoint calls the parts of a layer (within `model.layers.{i}`) and the final norm.
#[derive(Debug, Clone, Copy)]
pub struct Names {
    /// The norm before attention (or convolution), and the one before the MLP (Llama's
    /// `post_attention_layernorm`; Gemma's `pre_feedforward_layernorm` is its own).
    pub input_norm: &'static str,
    pub mlp_norm: &'static str,
    /// The attention's output projection and its q/k norms.
    pub attn_out: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    /// The MLP and its gate, up and down projections.
    pub mlp: &'static str,
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
    /// The norm after the last layer.
    pub final_norm: &'static str,
}

impl Names {
    /// Hugging Face's names, as Llama has them.
    pub const HF: Names = Names {
        input_norm: "input_layernorm",
        mlp_norm: "post_attention_layernorm",
        attn_out: "o_proj",
        q_norm: "q_norm",
        k_norm: "k_norm",
        mlp: "mlp",
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
        final_norm: "model.norm.weight",
    };

    pub const LFM2: Names = Names {
        input_norm: "operator_norm",
        mlp_norm: "ffn_norm",
        attn_out: "out_proj",
        q_norm: "q_layernorm",
        k_norm: "k_layernorm",
        mlp: "feed_forward",
        gate: "w1",
        up: "w3",
        down: "w2",
        final_norm: "model.embedding_norm.weight",
    };
}

pub fn options(arch: Arch) -> ArchOptions {
    match arch {
        Arch::Llama => ArchOptions {
            qkv_bias: false,
            qk_norm: false,
            fused: false,
            names: Names::HF,
        },
        Arch::Qwen2 => ArchOptions {
            qkv_bias: true,
            qk_norm: false,
            fused: false,
            names: Names::HF,
        },
        Arch::Qwen3 => ArchOptions {
            qkv_bias: false,
            qk_norm: true,
            fused: false,
            names: Names::HF,
        },
        Arch::Phi3 => ArchOptions {
            qkv_bias: false,
            qk_norm: false,
            fused: true,
            names: Names::HF,
        },
        Arch::Gemma2 => ArchOptions {
            qkv_bias: false,
            qk_norm: false,
            fused: false,
            names: Names::HF,
        },
        Arch::Gemma3 => ArchOptions {
            qkv_bias: false,
            qk_norm: true,
            fused: false,
            names: Names::HF,
        },
        Arch::Qwen35 => ArchOptions {
            qkv_bias: false,
            qk_norm: true,
            fused: false,
            names: Names::HF,
        },
        Arch::Lfm2 => ArchOptions {
            qkv_bias: false,
            qk_norm: true,
            fused: false,
            names: Names::LFM2,
        },
    }
}
