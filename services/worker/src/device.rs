//! The device thread's set-up and end: MLX's allocator limits, the model loaded there (it and
//! its arrays never leave that thread), the KV budget it leaves, and the thread stopped before
//! the process exits.

use actix::Arbiter;
use llmq_config::WorkerSettings;
use llmq_engine::{load_named, LoadOptions, LoadedModel};

use crate::error::WorkerError;
use crate::host_memory;

/// The KV budget when `scheduler.kv_budget_bytes` is unset: half of what MLX's memory limit
/// leaves beside the weights (the other half is for activations, the largest being a prefill
/// chunk's logits, and for MLX's cache of freed buffers), at least 256 MiB. Quantized weights
/// leave more, so the same device admits more streams.
pub fn auto_kv_budget(weight_bytes: usize) -> u64 {
    let limit = mlx_rs::memory::memory_limit().unwrap_or(0);
    (limit.saturating_sub(weight_bytes) as u64 / 2).max(256 << 20)
}

/// Sets MLX's allocator limits (`worker.mlx_memory_limit_bytes`, `worker.mlx_cache_limit_bytes`)
/// on the device thread, before the model loads; MLX keeps its own where a setting is absent.
fn set_mlx_limits(memory: Option<u64>, cache: Option<u64>) -> Result<(), WorkerError> {
    if let Some(b) = memory {
        mlx_rs::memory::set_memory_limit(b as usize).map_err(|source| WorkerError::MlxLimit {
            setting: "worker.mlx_memory_limit_bytes",
            source,
        })?;
    }
    if let Some(b) = cache {
        mlx_rs::memory::set_cache_limit(b as usize).map_err(|source| WorkerError::MlxLimit {
            setting: "worker.mlx_cache_limit_bytes",
            source,
        })?;
    }
    Ok(())
}

/// On the device thread, before anything else runs there: MLX's limits, the host memory kept
/// for reuse (on a CPU, when `reserve_host_memory`), then the model.
pub(crate) fn load_on_device(
    w: &WorkerSettings,
    reserve_host_memory: bool,
) -> Result<LoadedModel, WorkerError> {
    set_mlx_limits(w.mlx_memory_limit_bytes, w.mlx_cache_limit_bytes)?;
    if reserve_host_memory {
        let kept = host_memory::keep_freed(w.mlx_cache_limit_bytes).map_err(|source| {
            WorkerError::MlxLimit {
                setting: "worker.host_memory_reserve_bytes",
                source,
            }
        })?;
        tracing::debug!(kept, "freed host memory kept for reuse");
    }
    let load = |source| WorkerError::Load {
        model: w.model.clone(),
        source,
    };
    let opts = LoadOptions::from_settings(
        w.dtype.as_deref(),
        w.quantize,
        w.quantize_group_size,
        w.keep_quantized,
    )
    .map_err(load)?;
    load_named(&w.model, opts).map_err(load)
}

/// Stops the device thread and waits for it: its actors, the model and every array are
/// dropped there, before the process exits. (Exiting with the thread alive runs MLX's static
/// destructors while the thread still holds arrays: glibc saw the heap corrupted.)
pub(crate) async fn stop_device(device: Arbiter) {
    device.stop();
    if tokio::task::spawn_blocking(move || device.join())
        .await
        .map_or(true, |r| r.is_err())
    {
        tracing::error!("the device thread panicked while stopping");
    }
}
