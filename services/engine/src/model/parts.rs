//! The building blocks of a decoder layer: projections ([`Linear`], full precision or kept
//! quantized), the gated MLP ([`Mlp`]), soft-capping, and norms' weights as a checkpoint stores
//! them.

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use crate::arch::Names;
use crate::error::Result;
use crate::kernels::{dense_matmul_t, gated};
use crate::quant::{Matrix, QTensor};
use crate::weights::Weights;

/// A projection: `x @ W^T + b`, the weight full precision (held transposed) or quantized.
pub(super) struct Linear {
    weight: Weight,
    pub(super) bias: Option<Array>,
}

enum Weight {
    /// The checkpoint's [out, in] (row-contiguous: [`crate::kernels::cpu::matmul`] reads it) and W^T, a view of
    /// it, for MLX's matmul.
    Dense {
        w: Array,
        t: Array,
    },
    Quantized(QTensor),
}

impl Linear {
    /// Loads projections that read the same input as one: their weights are stacked along the
    /// output dimension, so one matmul (one kernel) computes them all. `parts` are
    /// (weight prefix, output size); callers split the output back by those sizes.
    pub(super) fn load_fused(
        w: &mut Weights,
        parts: &[(String, usize)],
        in_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::with_capacity(parts.len());
        for (prefix, out_dim) in parts {
            weights.push(w.take_matrix(&format!("{prefix}.weight"), &[*out_dim, in_dim])?);
            if bias {
                biases.push(w.take(&format!("{prefix}.bias"), &[*out_dim])?);
            }
        }
        let weight = match Matrix::join(weights, false)? {
            Matrix::Dense(w) => {
                let t = w.t();
                Weight::Dense { w, t }
            }
            Matrix::Quantized(q) => Weight::Quantized(q),
        };
        let bias = if bias {
            Some(if biases.len() == 1 {
                biases.remove(0)
            } else {
                concatenate(&biases, 0)?
            })
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub(super) fn load(
        w: &mut Weights,
        prefix: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        Self::load_fused(w, &[(prefix.to_string(), out_dim)], in_dim, bias)
    }

    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            Weight::Dense { w, t } => dense_matmul_t(w, Some(t), x)?,
            Weight::Quantized(q) => q.matmul_t(x)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }

    pub(super) fn parameters(&self) -> Vec<&Array> {
        let mut p = match &self.weight {
            Weight::Dense { w, .. } => vec![w],
            Weight::Quantized(q) => q.parameters().to_vec(),
        };
        p.extend(self.bias.as_ref());
        p
    }
}

pub(super) struct Mlp {
    /// gate and up projections fused: [intermediate | intermediate] outputs.
    gate_up: Linear,
    intermediate: i32,
    down: Linear,
    /// GELU (tanh approximation) on the gate instead of SiLU (Gemma).
    gelu: bool,
}

impl Mlp {
    /// `{prefix}.gate_proj`, `up_proj` (or, `fused`, `gate_up_proj`) and `down_proj` (or the
    /// arch's names for them), `size` wide.
    pub(super) fn load(
        w: &mut Weights,
        prefix: &str,
        hidden: usize,
        size: usize,
        fused: bool,
        n: Names,
        gelu: bool,
    ) -> Result<Self> {
        let gate_up = if fused {
            Linear::load(
                w,
                &format!("{prefix}.gate_up_proj"),
                2 * size,
                hidden,
                false,
            )?
        } else {
            Linear::load_fused(
                w,
                &[
                    (format!("{prefix}.{}", n.gate), size),
                    (format!("{prefix}.{}", n.up), size),
                ],
                hidden,
                false,
            )?
        };
        Ok(Mlp {
            gate_up,
            intermediate: size as i32,
            down: Linear::load(w, &format!("{prefix}.{}", n.down), hidden, size, false)?,
            gelu,
        })
    }

    pub(super) fn parameters(&self) -> Vec<&Array> {
        [&self.gate_up, &self.down]
            .into_iter()
            .flat_map(Linear::parameters)
            .collect()
    }

    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        let gu = self.gate_up.forward(x)?;
        self.down
            .forward(&gated(&gu, self.intermediate, self.gelu)?)
    }
}

/// Sequence `i`'s rows [1, ...] of `x`, a batch of `b` sequences along the first axis (`x`
/// itself when it holds one: no slice is built).
pub(super) fn sequence_rows(x: &Array, b: i32, i: usize) -> Array {
    if b == 1 {
        x.clone()
    } else {
        let i = i as i32;
        x.index(i..i + 1)
    }
}

/// `parts` joined along the first axis (the one part itself when there is one).
pub(super) fn concat_rows(mut parts: Vec<Array>) -> Result<Array> {
    Ok(if parts.len() == 1 {
        parts.pop().expect("one")
    } else {
        concatenate(&parts, 0)?
    })
}

/// A decode step's function of arrays, compiled (`mlx_rs::transforms::compile`) and kept for a
/// thread's life by the recurrent layers (a function compiled anew is traced anew).
pub(super) type Compiled = Box<
    dyn for<'a> FnMut(&'a [Array]) -> std::result::Result<Vec<Array>, mlx_rs::error::Exception>,
>;

/// Random normal f32 values of `shape` (the layers' unit tests).
#[cfg(test)]
pub(super) fn normal(shape: &[i32], seed: u64) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
}

/// A causal depthwise convolution's output [rows, t, channels] for the last `t` positions of
/// `window` [rows, kernel - 1 + t, channels] (the kept inputs, then the new ones), with `taps`
/// [kernel, channels] (row j weighs the position `kernel - 1 - j` back): `kernel` shifted
/// products, not a loop over positions. (MLX's error, so that compiled graphs can call it.)
pub(super) fn causal_depthwise(
    window: &Array,
    taps: &Array,
    t: i32,
) -> std::result::Result<Array, mlx_rs::error::Exception> {
    if t == 1 {
        // One position (a decode step's): the window is the kernel's span.
        return window.multiply(taps)?.sum_axis(1, true);
    }
    let kernel = taps.shape()[0];
    let mut acc: Option<Array> = None;
    for j in 0..kernel {
        let term = window.index((.., j..j + t, ..)).multiply(taps.index(j))?;
        acc = Some(match acc {
            Some(a) => a.add(&term)?,
            None => term,
        });
    }
    Ok(acc.expect("a kernel of at least one position"))
}

/// `cap * tanh(x / cap)` (Gemma 2's soft-capping of scores and logits).
pub(super) fn softcap(x: &Array, cap: f32) -> Result<Array> {
    Ok(mlx_rs::ops::tanh(&x.divide(Array::from_f32(cap))?)?.multiply(Array::from_f32(cap))?)
}

/// A norm's weight as the layer multiplies by it: Gemma stores `w` for `1 + w` (computed in
/// f32, as transformers does, then cast).
pub(super) fn norm_weight(
    w: &mut Weights,
    name: &str,
    size: usize,
    plus_one: bool,
) -> Result<Array> {
    let a = w.take(name, &[size])?;
    if !plus_one || w.norms_include_one() {
        return Ok(a);
    }
    let dtype = a.dtype();
    Ok(a.as_dtype(Dtype::Float32)?
        .add(Array::from_f32(1.0))?
        .as_dtype(dtype)?)
}
