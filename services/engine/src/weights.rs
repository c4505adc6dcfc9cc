//! Weight loading: Hugging Face safetensors directories (single or sharded) and GGUF files,
//! both into one map keyed by Hugging Face tensor names, in the compute dtype.
//!
//! Invariants: GGUF tensors are renamed to Hugging Face names and Llama Q/K rows are put back
//! in Hugging Face's rotary order (llama.cpp interleaves them); Gemma's norms keep llama.cpp's
//! 1 + w (`norms_include_one`); `take` checks shapes, so an architecture never runs on a
//! tensor of the wrong size.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};

use llmq_text::config::{Arch, ModelConfig};
use llmq_text::gguf::GgufFile;

use crate::error::Result;

pub struct Weights {
    source: PathBuf,
    map: HashMap<String, Array>,
    dtype: Dtype,
    /// Gemma's norm weights already hold `1 + w` (llama.cpp stores them so).
    norms_include_one: bool,
}

impl Weights {
    pub fn new(source: impl Into<PathBuf>, dtype: Dtype) -> Self {
        Weights { source: source.into(), map: HashMap::new(), dtype, norms_include_one: false }
    }

    pub fn norms_include_one(&self) -> bool {
        self.norms_include_one
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    pub fn insert(&mut self, name: impl Into<String>, a: Array) -> Result<()> {
        let a = if a.dtype() == self.dtype { a } else { a.as_dtype(self.dtype)? };
        self.map.insert(name.into(), a);
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Array> {
        let a = self
            .map
            .remove(name)
            .ok_or_else(|| llmq_text::Error::MissingTensor { path: self.source.clone(), tensor: name.into() })?;
        let actual: Vec<i64> = a.shape().iter().map(|&d| d as i64).collect();
        let expected: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        if actual != expected {
            return Err(llmq_text::Error::TensorShape { path: self.source.clone(), tensor: name.into(), actual, expected }.into());
        }
        Ok(a)
    }

    pub fn source(&self) -> &Path {
        &self.source
    }
}

/// Loads `model.safetensors` or the shards listed in `model.safetensors.index.json`.
pub fn load_hf_dir(dir: &Path, dtype: Dtype) -> Result<Weights> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| llmq_text::Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| llmq_text::Error::format(&index, e.to_string()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| llmq_text::Error::format(&index, "no weight_map"))?;
        let mut names: Vec<String> = map.values().filter_map(|s| s.as_str().map(String::from)).collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut w = Weights::new(dir, dtype);
    for file in files {
        if !file.is_file() {
            return Err(llmq_text::Error::io(&file, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file")).into());
        }
        let arrays = Array::load_safetensors(&file).map_err(|e| llmq_text::Error::format(&file, format!("bad safetensors file: {e}")))?;
        for (name, a) in arrays {
            w.insert(name, a)?;
        }
    }
    Ok(w)
}

fn gguf_to_hf(name: &str, arch: Arch) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (stem, suffix) = part.rsplit_once('.')?;
    let hf = match stem {
        "attn_norm" => "input_layernorm",
        // Gemma's norm before the MLP; Llama's, named after the attention it follows.
        "ffn_norm" if arch.is_gemma() => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undoes llama.cpp's Q/K row order: per head it stores the two rotary halves interleaved.
fn unpermute_rows(a: &Array, heads: usize) -> Result<Array> {
    let rows = a.shape()[0];
    let cols = a.shape()[1];
    let h = heads as i32;
    let r = a.reshape(&[h, rows / h / 2, 2, cols])?;
    Ok(r.transpose_axes(&[0, 2, 1, 3])?.reshape(&[rows, cols])?)
}

pub fn load_gguf(f: &GgufFile, cfg: &ModelConfig, dtype: Dtype) -> Result<Weights> {
    let mut w = Weights::new(f.path(), dtype);
    // llama.cpp stores Gemma's norm weights as 1 + w.
    w.norms_include_one = cfg.arch.is_gemma();
    for info in &f.tensors {
        let Some(hf) = gguf_to_hf(&info.name, cfg.arch) else {
            tracing::debug!(tensor = %info.name, "ignoring GGUF tensor");
            continue;
        };
        let data = f.read_f32(info);
        let shape: Vec<i32> = info.shape.iter().map(|&d| d as i32).collect();
        let mut a = Array::from_slice(&data, &shape);
        if cfg.arch == Arch::Llama && hf.ends_with("self_attn.q_proj.weight") {
            a = unpermute_rows(&a, cfg.num_heads)?;
        } else if cfg.arch == Arch::Llama && hf.ends_with("self_attn.k_proj.weight") {
            a = unpermute_rows(&a, cfg.num_kv_heads)?;
        }
        w.insert(hf, a)?;
    }
    Ok(w)
}
