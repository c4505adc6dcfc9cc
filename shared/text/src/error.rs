//! The error of reading a model's files and of checking a request's text-side parameters:
//! classified once, near the cause, keeping the file it came from and the source.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}: unsupported architecture {arch:?} (supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma2, gemma3_text; in GGUF: llama, mistral, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3)")]
    UnsupportedArch { path: PathBuf, arch: String },
    #[error("{path}: tensor {tensor:?} has unsupported type {kind} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        kind: String,
    },
    #[error("{path}: missing tensor {tensor:?}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor:?} has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        tensor: String,
        actual: Vec<i64>,
        expected: Vec<i64>,
    },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("unknown model {0:?}: give a path to a Hugging Face directory or a .gguf file, or one of: {1}")]
    UnknownModel(String, String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            message: message.into(),
        }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
