//! The engine's error type: a model's files ([`llmq_text::Error`], naming the file), a call the
//! engine cannot serve, or MLX's own failure, keeping MLX's message.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Load(#[from] llmq_text::Error),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("reading a result back from the device: {0}")]
    Host(String),
    #[error("mlx: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
