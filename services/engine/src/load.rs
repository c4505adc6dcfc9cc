//! Loading a model: by name, from a Hugging Face directory or a GGUF file, with its tokenizer.

use std::path::{Path, PathBuf};

use llmq_text::{config, gguf, resolve_model, Tokenizer};
use mlx_rs::Dtype;

use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::shapes;
use crate::weights::{self, LoadOptions};

/// A loaded model with its tokenizer (absent only for tokenizer-less test checkpoints).
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Option<Tokenizer>,
    pub source: PathBuf,
}

pub fn parse_dtype(s: &str) -> Result<Dtype> {
    Ok(match s {
        "f32" | "float32" => Dtype::Float32,
        "f16" | "float16" => Dtype::Float16,
        "bf16" | "bfloat16" => Dtype::Bfloat16,
        other => {
            return Err(EngineError::InvalidRequest(format!(
                "unknown dtype {other:?} (f32, f16, bf16)"
            )))
        }
    })
}

/// Loads a model by name: `random:<shape>` (random weights, with the tokenizer of the
/// vocabulary the shape was modelled on when the set-up has it; see `shapes`), a known name,
/// or a path.
pub fn load_named(name: &str, opts: impl Into<LoadOptions>) -> Result<LoadedModel> {
    let opts = opts.into();
    if let Some(shape) = name.strip_prefix("random:") {
        let model = shapes::random_model(shape, opts, 0)?;
        let tokenizer = llmq_text::shapes::tokenizer(shape)?;
        return Ok(LoadedModel {
            model,
            tokenizer,
            source: PathBuf::from(name),
        });
    }
    load_model(&resolve_model(name)?, opts)
}

/// Loads a Hugging Face directory or a GGUF file as `opts` say (a dtype alone: its defaults).
pub fn load_model(path: &Path, opts: impl Into<LoadOptions>) -> Result<LoadedModel> {
    let opts = opts.into();
    let (model, tokenizer) = if path.is_dir() {
        let cfg = config::from_hf_json(&path.join("config.json"))?;
        let w = weights::load_hf_dir(path, opts)?;
        let tok = if path.join("tokenizer.json").is_file() {
            Some(Tokenizer::from_hf_dir(path)?)
        } else {
            None
        };
        (Model::load(cfg, w)?, tok)
    } else {
        let f = gguf::GgufFile::open(path)?;
        let cfg = config::from_gguf(&f)?;
        let tok = Tokenizer::from_gguf_metadata(path, &f.metadata)?;
        let w = weights::load_gguf(&f, &cfg, opts)?;
        (Model::load(cfg, w)?, Some(tok))
    };
    if let Some(t) = &tokenizer {
        let bound = t.max_id_bound();
        if bound > model.config.vocab_size {
            return Err(llmq_text::Error::Tokenizer {
                path: path.into(),
                message: format!(
                    "the tokenizer has ids up to {} but the embedding has only {} rows",
                    bound - 1,
                    model.config.vocab_size
                ),
            }
            .into());
        }
    }
    Ok(LoadedModel {
        model,
        tokenizer,
        source: path.into(),
    })
}
