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
//!
//! Gemma's layers differ beyond these options (`ModelConfig::arch.is_gemma()`): norms after
//! attention and MLP too, norm weights as 1 + w, GELU (tanh), embeddings scaled by
//! sqrt(hidden), the score scale from `query_pre_attn_scalar`; Gemma 2 soft-caps scores and
//! logits, Gemma 3 gives its sliding layers their own rope base.
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
}

pub fn options(arch: Arch) -> ArchOptions {
    match arch {
        Arch::Llama => ArchOptions {
            qkv_bias: false,
            qk_norm: false,
            fused: false,
        },
        Arch::Qwen2 => ArchOptions {
            qkv_bias: true,
            qk_norm: false,
            fused: false,
        },
        Arch::Qwen3 => ArchOptions {
            qkv_bias: false,
            qk_norm: true,
            fused: false,
        },
        Arch::Phi3 => ArchOptions {
            qkv_bias: false,
            qk_norm: false,
            fused: true,
        },
        Arch::Gemma2 => ArchOptions {
            qkv_bias: false,
            qk_norm: false,
            fused: false,
        },
        Arch::Gemma3 => ArchOptions {
            qkv_bias: false,
            qk_norm: true,
            fused: false,
        },
    }
}
