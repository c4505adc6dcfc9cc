//! llmq's text side, free of MLX: what intake, the gateway's helpers and the engine share.
//!
//! Map of the crate:
//! - `gguf`          reads llama.cpp's GGUF files (metadata, tensor directory)
//! - `quants`        GGML's quantized blocks (Q4_0..Q8_0, Q2_K..Q6_K) decoded to f32
//! - `affine`        the blocks that are affine groups of 32 (MLX's quantized form), as such
//! - `config`        a model's shape, from `config.json` or GGUF metadata
//! - `rope`          rotary embeddings' base, rotated dimensions and scaling (linear, llama3, ...)
//! - `shapes`        the shapes of random-weight benchmark models
//! - `tokenizer`     tokenizers (`tokenizer.json`, or rebuilt from GGUF) and chat templates
//! - `sentencepiece` SentencePiece's `tokenizer.model`, read as GGUF tokenizer metadata
//! - `detok`         incremental detokenization
//! - `sampling`      sampling and stop parameters, their validation, the sampler
//! - `constraint`    constrained decoding: JSON schemas, regular expressions and grammars as
//!   token masks (llguidance); `json_keys`: no JSON object of such an output repeats a key
//! - `schema`        JSON Schemas closed as OpenAI's strict mode reads them, and their layout
//! - `tools`         tools in chat templates, and the grammar of a required call
//!
//! And where named models live (`resolve_model`), and a model's tokenizer and context without
//! its weights (`load_tokenizer`).

pub mod affine;
pub mod config;
pub mod constraint;
pub mod detok;
pub mod error;
pub mod gguf;
pub mod json_keys;
pub mod quants;
pub mod rope;
pub mod sampling;
pub mod schema;
pub mod sentencepiece;
pub mod shapes;
pub mod tokenizer;
pub mod tools;

use std::path::{Path, PathBuf};

pub use error::{Error, Result};
pub use tokenizer::Tokenizer;

/// Models known by name; `llmq` finds their files in the set-up's model cache.
pub const KNOWN_MODELS: &[(&str, &str)] = &[
    ("smollm2", "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3-270m", "gemma3-270m/gemma-3-270m-q4_k_m.gguf"),
];

/// Where named models live: $LLMQ_MODELS_DIR, else `.cache/models` of the checkout holding
/// the running binary, else of the current directory.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LLMQ_MODELS_DIR") {
        return PathBuf::from(d);
    }
    let exe_dirs = std::env::current_exe().ok().into_iter().flat_map(|p| {
        p.ancestors()
            .skip(1)
            .map(Path::to_path_buf)
            .collect::<Vec<_>>()
    });
    for d in exe_dirs.chain(std::env::current_dir().ok()) {
        let cand = d.join(".cache/models");
        if cand.is_dir() {
            return cand;
        }
    }
    PathBuf::from(".cache/models")
}

/// A model name from `KNOWN_MODELS`, or a path to a Hugging Face directory or a GGUF file.
pub fn resolve_model(name: &str) -> Result<PathBuf> {
    if let Some((_, rel)) = KNOWN_MODELS.iter().find(|(n, _)| *n == name) {
        let p = models_dir().join(rel);
        if !p.is_file() {
            return Err(Error::io(
                &p,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "model not fetched: run `make setup`",
                ),
            ));
        }
        return Ok(p);
    }
    let p = PathBuf::from(name);
    if p.exists() {
        return Ok(p);
    }
    let names: Vec<&str> = KNOWN_MODELS.iter().map(|(n, _)| *n).collect();
    Err(Error::UnknownModel(name.into(), names.join(", ")))
}

/// A model's tokenizer and context length, without its weights (for intake).
pub fn load_tokenizer(path: &Path) -> Result<(Tokenizer, usize)> {
    if path.is_dir() {
        let cfg = config::from_hf_json(&path.join("config.json"))?;
        Ok((Tokenizer::from_hf_dir(path)?, cfg.max_position_embeddings))
    } else {
        let f = gguf::GgufFile::open(path)?;
        let cfg = config::from_gguf(&f)?;
        Ok((
            Tokenizer::from_gguf_metadata(path, &f.metadata)?,
            cfg.max_position_embeddings,
        ))
    }
}
