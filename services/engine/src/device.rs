//! The device MLX computes on, read once per process. llmq never moves a model between devices,
//! so every choice that depends on the device (which kernel computes a product, the default
//! dtype, the prefill chunk grid) is made against this one answer.

use std::sync::OnceLock;

use mlx_rs::{DeviceType, Dtype};

/// Where MLX computes: an NVIDIA GPU (MLX's CUDA build) or the host's cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

/// MLX's default device: the GPU when the MLX build has one, otherwise the CPU. Asked of MLX
/// once; later calls return the same answer.
pub fn current() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    *DEVICE.get_or_init(|| {
        let gpu = mlx_rs::Device::try_default()
            .ok()
            .and_then(|d| d.get_type().ok())
            .is_some_and(|t| matches!(t, DeviceType::Gpu));
        if gpu {
            Device::Gpu
        } else {
            Device::Cpu
        }
    })
}

/// Whether MLX computes on a GPU.
pub fn on_gpu() -> bool {
    current() == Device::Gpu
}

/// f32 on a CPU (dense f32 is the fastest there), bf16 on a GPU.
pub fn default_dtype() -> Dtype {
    match current() {
        Device::Gpu => Dtype::Bfloat16,
        Device::Cpu => Dtype::Float32,
    }
}
