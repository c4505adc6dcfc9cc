//! Which kernel computes each operation, decided here and nowhere else: llmq's CPU kernels
//! ([`cpu`]) where MLX computes on the host and they cover the shapes, llmq's CUDA kernels
//! ([`cuda`]) on a GPU where they cover the shapes and have compiled, and MLX's own operations
//! otherwise. The device is [`crate::device::current`], read once per process; each kernel says
//! which shapes it takes (`covers`) and computes only those.
//!
//! Attention is chosen once per model at load ([`crate::model::Model`]: llmq's CPU attention,
//! the CUDA row kernels of the decode batch, or MLX's fused attention), since it decides how
//! the model's caches are read.

pub mod cpu;
pub mod cuda;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{dequantize, quantized_matmul, sigmoid, tanh};
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;
use std::cell::RefCell;

use crate::device::{current, Device};
use crate::error::Result;
use crate::quant::{Matrix, QTensor};

/// Rows from which a quantized product that no CUDA kernel covers dequantizes its weights and
/// multiplies densely: MLX's quantized kernels for many rows are far slower than its dense
/// GEMM.
const DENSE_FROM_ROWS: usize = 8;

fn rows_of(x: &Array) -> i32 {
    let shape = x.shape();
    shape[..shape.len() - 1].iter().product()
}

/// `x @ w^T` for a dense weight `w` [n, k]; `wt`, its transpose where the caller keeps one.
/// Few rows on a CPU go through llmq's loop ([`cpu::matmul`]), each weight row read once.
pub fn dense_matmul_t(w: &Array, wt: Option<&Array>, x: &Array) -> Result<Array> {
    if current() == Device::Cpu && cpu::matmul::covers(w, x) {
        return Ok(cpu::matmul::matmul_t(w, x)?);
    }
    Ok(match wt {
        Some(t) => x.matmul(t)?,
        None => x.matmul(w.t())?,
    })
}

impl QTensor {
    /// The full-precision matrix, in the scales' dtype (through llmq's kernel on a GPU).
    pub fn dequantize(&self) -> Result<Array> {
        if cuda::qmv::dequantize_covers(self) && cuda::qmv::ready() {
            return Ok(cuda::qmv::dequantize(self)?);
        }
        Ok(dequantize(
            &self.w,
            &self.scales,
            &self.biases,
            self.spec.group_size,
            self.spec.bits,
        )?)
    }

    /// `x @ W^T`: x [..., cols] to [..., rows]. A decode step's rows multiply reading only the
    /// packed weights: on a GPU through llmq's kernels ([`cuda::qmv`] for a few rows,
    /// [`cuda::qmm`] on tensor cores for more), elsewhere through MLX's quantized matmul; from
    /// `DENSE_FROM_ROWS` rows on (prefill chunks, or what the kernels do not cover) the weights
    /// are dequantized into a temporary and multiplied densely.
    pub fn matmul_t(&self, x: &Array) -> Result<Array> {
        if cuda::qmv::covers(self, x) && cuda::qmv::ready() {
            return Ok(cuda::qmv::matmul_t(self, x)?);
        }
        let rows = rows_of(x);
        if cuda::qmm::covers(self, rows, x.dtype()) && cuda::qmm::ready() {
            return Ok(cuda::qmm::matmul_t(self, x)?);
        }
        if rows as usize >= DENSE_FROM_ROWS {
            return Ok(x.matmul(self.dequantize()?.t())?);
        }
        Ok(quantized_matmul(
            x,
            &self.w,
            &self.scales,
            &self.biases,
            true,
            self.spec.group_size,
            self.spec.bits,
        )?)
    }
}

impl Matrix {
    /// `x @ W^T`.
    pub fn matmul_t(&self, x: &Array) -> Result<Array> {
        match self {
            Matrix::Dense(a) => dense_matmul_t(a, None, x),
            Matrix::Quantized(q) => q.matmul_t(x),
        }
    }

    /// Full precision (dequantized if needed).
    pub fn into_dense(self) -> Result<Array> {
        match self {
            Matrix::Dense(a) => Ok(a),
            Matrix::Quantized(q) => q.dequantize(),
        }
    }
}

/// `act(gate) * up` of a fused gate-and-up product `gu` [..., 2 size] (gate first): GELU's
/// tanh form or SiLU. On a CPU in f32 through llmq's own loop ([`cpu::elementwise`]), else as
/// one compiled MLX function.
pub fn gated(gu: &Array, size: i32, gelu: bool) -> Result<Array> {
    if current() == Device::Cpu && cpu::elementwise::covers(gu, size as usize) {
        return Ok(cpu::elementwise::gated(gu, size as usize, gelu)?);
    }
    let (g, u) = (gu.index((Ellipsis, ..size)), gu.index((Ellipsis, size..)));
    if gelu {
        geglu(&g, &u)
    } else {
        swiglu(&g, &u)
    }
}

/// A compiled MLX function of two arrays, kept for the life of the thread that built it.
type Compiled2 =
    Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> std::result::Result<Array, Exception>>;

thread_local! {
    // Kept, not rebuilt per call: mlx-rs gives each compiled function a fresh id and erases
    // MLX's trace of it when dropped, so a function compiled anew on every call is traced anew
    // on every call (tens of µs of the host's time, each layer of each step).
    static SWIGLU: RefCell<Compiled2> = RefCell::new(Box::new(compile(swiglu_graph, true)));
    static GEGLU: RefCell<Compiled2> = RefCell::new(Box::new(compile(geglu_graph, true)));
}

/// silu(g) * u as one fused kernel (MLX compiles the element-wise graph once per shape class).
fn swiglu(g: &Array, u: &Array) -> Result<Array> {
    Ok(SWIGLU.with(|f| (f.borrow_mut())((g, u)))?)
}

/// gelu_tanh(g) * u (Gemma's MLP), fused like `swiglu`.
fn geglu(g: &Array, u: &Array) -> Result<Array> {
    Ok(GEGLU.with(|f| (f.borrow_mut())((g, u)))?)
}

fn swiglu_graph((g, u): (&Array, &Array)) -> std::result::Result<Array, Exception> {
    g.multiply(sigmoid(g)?)?.multiply(u)
}

/// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u.
fn geglu_graph((g, u): (&Array, &Array)) -> std::result::Result<Array, Exception> {
    let inner = g
        .add(
            g.multiply(g)?
                .multiply(g)?
                .multiply(Array::from_f32(0.044715))?,
        )?
        .multiply(Array::from_f32((2.0 / std::f32::consts::PI).sqrt()))?;
    let cdf = tanh(&inner)?
        .add(Array::from_f32(1.0))?
        .multiply(Array::from_f32(0.5))?;
    g.multiply(cdf)?.multiply(u)
}
