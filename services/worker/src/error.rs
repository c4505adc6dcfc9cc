//! A worker's errors: loading its model, MLX's limits, its device thread, NATS.

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("loading the model {model}: {source}")]
    Load {
        model: String,
        #[source]
        source: llmq_engine::EngineError,
    },
    #[error("{setting}: {source}")]
    MlxLimit {
        setting: &'static str,
        #[source]
        source: mlx_rs::error::Exception,
    },
    #[error("the device thread stopped")]
    DeviceStopped,
    #[error("NATS: {0}")]
    Nats(#[source] Box<dyn std::error::Error + Send + Sync>),
}

pub(crate) fn nats_err(e: impl std::error::Error + Send + Sync + 'static) -> WorkerError {
    WorkerError::Nats(Box::new(e))
}
