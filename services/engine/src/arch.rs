//! What distinguishes the supported architectures. They share one decoder graph
//! (`model.rs`); each differs only in the options below and in the weights it carries.
//!
//! | arch   | q/k/v bias | q/k RMS norm | window            | models                               |
//! |--------|------------|--------------|-------------------|--------------------------------------|
//! | llama  | no         | no           | Mistral's option  | Llama 2/3, SmolLM, TinyLlama, Mistral |
//! | qwen2  | yes        | no           | `use_sliding_window` | Qwen2, Qwen2.5                    |
//! | qwen3  | no         | yes          | `use_sliding_window` | Qwen3                             |

use llmq_text::config::Arch;

#[derive(Debug, Clone, Copy)]
pub struct ArchOptions {
    pub qkv_bias: bool,
    pub qk_norm: bool,
}

pub fn options(arch: Arch) -> ArchOptions {
    match arch {
        Arch::Llama => ArchOptions { qkv_bias: false, qk_norm: false },
        Arch::Qwen2 => ArchOptions { qkv_bias: true, qk_norm: false },
        Arch::Qwen3 => ArchOptions { qkv_bias: false, qk_norm: true },
    }
}
