//! Gated DeltaNet (Qwen3.5's linear-attention layers): the layer's input is projected to q, k,
//! v (through a causal depthwise convolution of `kernel` positions and SiLU), an output gate z,
//! and per value head a write strength beta = sigmoid(b) and a decay g = -exp(A_log) *
//! softplus(a + dt_bias). Each value head keeps a state S [key_dim, value_dim] that every
//! position first decays, then corrects toward its value (the delta rule):
//!
//! ```text
//! S = exp(g) S;   S += k (beta (v - k S));   o = q S
//! ```
//!
//! with q and k L2-normed (q also scaled by key_dim^-1/2) and each key head serving
//! value_heads / key_heads consecutive value heads. The output is RMS-normed per head, times
//! silu(z), then projected out.
//!
//! A chunk of T positions is computed in blocks of positions at once (`block`; the chunked form
//! of the rule: within a block the corrections are one triangular system, solved by products of
//! the system's powers, and the state is read and written once a block); only the blocks follow
//! one another. A decode step updates every row's state in one pass. States are float32.
//!
//! Per sequence a layer keeps the convolution's last `kernel - 1` inputs and S, in a
//! [`ConvCache`](crate::cache::ConvCache) with a memory.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{broadcast_to, concatenate, zeros};
use mlx_rs::{Array, Dtype};

use llmq_text::config::{DeltaNetConfig, ModelConfig};

use super::attention::GroupStep;
use super::parts::{causal_depthwise, concat_rows, sequence_rows, Linear};
use crate::cache::KvCache;
use crate::error::Result;
use crate::weights::Weights;

/// Positions computed together in the chunked form: larger blocks do more work per position
/// (the triangular system grows as the square) but follow one another fewer times. On the CPU,
/// where each block's work is small and the ops are cheap to issue, 16 prefilled a 4096-token
/// prompt fastest (BENCHMARKS.md); on a GPU, where each block's steps are launches the host
/// pays for, 64 (the chunk of the reference kernels), not yet measured there.
fn block() -> i32 {
    if crate::device::on_gpu() {
        64
    } else {
        16
    }
}

pub(super) struct DeltaNet {
    /// q|k|v (the convolution's channels), z, b and a together.
    in_proj: Linear,
    out_proj: Linear,
    /// The convolution's filters as [kernel, channels]: row j weighs the position `kernel - 1 -
    /// j` back.
    taps: Array,
    /// -exp(A_log) [value_heads], float32.
    neg_a: Array,
    /// [value_heads], float32.
    dt_bias: Array,
    /// The per-head output norm's weight [value_dim].
    norm: Array,
    /// q's and k's L2 norms as RMS norms ([`Self::rule_inputs`]): their weights (1/key_dim and
    /// key_dim^-1/2 in every place, q's also scaling it by key_dim^-1/2) and epsilon.
    q_weight: Array,
    k_weight: Array,
    l2_eps: f32,
    eps: f32,
    key_heads: i32,
    value_heads: i32,
    key_dim: i32,
    value_dim: i32,
    kernel: i32,
    /// Value heads tile the key heads (head j reads key head j % key_heads) instead of grouping
    /// (j / (value_heads / key_heads)): llama.cpp's order.
    tiled: bool,
}

/// A chunk's inputs to the rule, heads first: q, k [1, value_heads, T, key_dim] (normed,
/// repeated over value heads, q scaled), v [1, value_heads, T, value_dim], g and beta [1,
/// value_heads, T]; all float32.
struct RuleInputs {
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
}

impl DeltaNet {
    /// `{p}.linear_attn.*` of a Hugging Face checkpoint (or mlx-lm's conversion: the
    /// convolution's filters in its layout).
    pub(super) fn load(
        w: &mut Weights,
        p: &str,
        c: &ModelConfig,
        d: &DeltaNetConfig,
    ) -> Result<Self> {
        let h = c.hidden_size;
        let p = format!("{p}.linear_attn");
        let channels = d.conv_channels();
        let (hv, dv) = (d.value_heads, d.value_dim);
        let f32_of = |a: Array| -> Result<Array> { Ok(a.as_dtype(Dtype::Float32)?) };
        let a_log = f32_of(w.take(&format!("{p}.A_log"), &[hv])?)?;
        Ok(DeltaNet {
            in_proj: Linear::load_fused(
                w,
                &[
                    (format!("{p}.in_proj_qkv"), channels),
                    (format!("{p}.in_proj_z"), hv * dv),
                    (format!("{p}.in_proj_b"), hv),
                    (format!("{p}.in_proj_a"), hv),
                ],
                h,
                false,
            )?,
            out_proj: Linear::load(w, &format!("{p}.out_proj"), h, hv * dv, false)?,
            taps: w.take_conv_taps(&format!("{p}.conv1d.weight"), channels, d.conv_kernel)?,
            neg_a: a_log.exp()?.negative()?,
            dt_bias: f32_of(w.take(&format!("{p}.dt_bias"), &[hv])?)?,
            norm: w.take(&format!("{p}.norm.weight"), &[dv])?,
            q_weight: mlx_rs::ops::full::<f32>(
                &[d.key_dim as i32],
                Array::from_f32(1.0 / d.key_dim as f32),
            )?,
            k_weight: mlx_rs::ops::full::<f32>(
                &[d.key_dim as i32],
                Array::from_f32(1.0 / (d.key_dim as f32).sqrt()),
            )?,
            l2_eps: 1e-6 / d.key_dim as f32,
            eps: c.rms_norm_eps,
            key_heads: d.key_heads as i32,
            value_heads: hv as i32,
            key_dim: d.key_dim as i32,
            value_dim: dv as i32,
            kernel: d.conv_kernel as i32,
            tiled: d.value_heads_tiled,
        })
    }

    pub(super) fn parameters(&self) -> Vec<&Array> {
        let mut p = self.in_proj.parameters();
        p.extend(self.out_proj.parameters());
        p.extend([&self.taps, &self.neg_a, &self.dt_bias, &self.norm]);
        p.extend([&self.q_weight, &self.k_weight]);
        p
    }

    fn channels(&self) -> i32 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// `x` [B, T, hidden]: B sequences of T new positions each, sequence i continuing from its
    /// convolution inputs and state in `caches[i]` (which take the new ones). Returns [B, T,
    /// hidden].
    pub(super) fn forward(
        &self,
        x: &Array,
        caches: &mut [&mut (dyn KvCache + 'static)],
    ) -> Result<Array> {
        let b = x.shape()[0];
        let proj = self.in_proj.forward(x)?;
        let mut outs = Vec::with_capacity(caches.len());
        for (i, cache) in caches.iter_mut().enumerate() {
            outs.push(self.sequence(&sequence_rows(&proj, b, i), &mut **cache)?);
        }
        self.out_proj.forward(&concat_rows(outs)?)
    }

    /// One sequence's chunk: its projections `proj` [1, T, ...] continuing its cache. Returns
    /// the normed, gated output [1, T, value_heads * value_dim] (before the output projection).
    fn sequence(&self, proj: &Array, cache: &mut (dyn KvCache + 'static)) -> Result<Array> {
        let t = proj.shape()[1];
        let c = self.channels();
        let (mixed, z, b, a) = self.parts(proj)?;
        let rows = mixed.reshape(&[1, 1, t, c])?;
        let (window, _, _) = cache.update(&rows, &rows)?;
        let conv = self.convolve(&window.reshape(&[1, -1, c])?, t)?;
        let inputs = self.rule_inputs(&conv, &b, &a, 1, t)?;
        let state = match cache.memory() {
            Some(s) => s.clone(),
            None => zeros::<f32>(&[1, self.value_heads, self.key_dim, self.value_dim])?,
        };
        let (o, state) = self.chunked(&inputs, state)?;
        cache.set_memory(state)?;
        // [1, heads, T, dv] -> [1, T, heads, dv]
        let o = o.transpose_axes(&[0, 2, 1, 3])?;
        self.gated_norm(&o, &z, proj.dtype())
    }

    /// The projections' parts: the convolution's input [.., channels], z, b and a.
    fn parts(&self, proj: &Array) -> Result<(Array, Array, Array, Array)> {
        let c = self.channels();
        let zv = self.value_heads * self.value_dim;
        let hv = self.value_heads;
        let mut parts = proj.split_at_indices(&[c, c + zv, c + zv + hv], -1)?;
        let a = parts.pop().expect("four parts");
        let b = parts.pop().expect("four parts");
        let z = parts.pop().expect("four parts");
        let mixed = parts.pop().expect("four parts");
        Ok((mixed, z, b, a))
    }

    /// SiLU of the convolution's output [rows, t, channels] for the last `t` positions of
    /// `window` [rows, kernel - 1 + t, channels] (the kept inputs, then the new ones).
    fn convolve(&self, window: &Array, t: i32) -> Result<Array> {
        Ok(mlx_rs::nn::silu(causal_depthwise(window, &self.taps, t)?)?)
    }

    /// The rule's inputs for `n` rows of `t` positions each, from the convolution's output
    /// `conv` [n, t, channels] and the projections b, a [n, t, value_heads]: heads first
    /// ([n, value_heads, t, ...]), float32.
    fn rule_inputs(
        &self,
        conv: &Array,
        b: &Array,
        a: &Array,
        n: i32,
        t: i32,
    ) -> Result<RuleInputs> {
        let (hk, hv, dk, dv) = (
            self.key_heads,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        );
        let conv = conv.as_dtype(Dtype::Float32)?;
        let ke = hk * dk;
        let mut qkv = conv.split_at_indices(&[ke, 2 * ke], -1)?;
        let v = qkv.pop().expect("three parts");
        let k = qkv.pop().expect("three parts");
        let q = qkv.pop().expect("three parts");
        // `x * rsqrt(sum(x^2) + 1e-6)` (the reference's L2 norm) is an RMS norm with epsilon
        // 1e-6 / dk and weight dk^-1/2: one fused op (q's weight also holds its scale). Each
        // key head serves `hv / hk` value heads, consecutive ones or (tiled) every hk-th.
        let heads = |x: Array, weight: &Array| -> Result<Array> {
            let (normed, repeated) = if self.tiled {
                ([n, t, 1, hk, dk], [n, t, hv / hk, hk, dk])
            } else {
                ([n, t, hk, 1, dk], [n, t, hk, hv / hk, dk])
            };
            let x = mlx_rs::fast::rms_norm(&x.reshape(&normed)?, Some(weight), self.l2_eps)?;
            let x = broadcast_to(&x, &repeated)?.reshape(&[n, t, hv, dk])?;
            Ok(x.transpose_axes(&[0, 2, 1, 3])?)
        };
        let q = heads(q, &self.q_weight)?;
        let k = heads(k, &self.k_weight)?;
        let v = v.reshape(&[n, t, hv, dv])?.transpose_axes(&[0, 2, 1, 3])?;
        let beta = mlx_rs::ops::sigmoid(&b.as_dtype(Dtype::Float32)?)?;
        let softplus = mlx_rs::ops::logaddexp(
            a.as_dtype(Dtype::Float32)?.add(&self.dt_bias)?,
            Array::from_f32(0.0),
        )?;
        let g = softplus.multiply(&self.neg_a)?;
        Ok(RuleInputs {
            q,
            k,
            v,
            g: g.transpose_axes(&[0, 2, 1])?,
            beta: beta.transpose_axes(&[0, 2, 1])?,
        })
    }

    /// The rule over one sequence's chunk in its chunked form, from `state` [1, heads, dk, dv].
    /// Returns the output [1, heads, T, dv] and the state after the chunk.
    fn chunked(&self, x: &RuleInputs, mut state: Array) -> Result<(Array, Array)> {
        let hv = self.value_heads;
        let (dk, dv) = (self.key_dim, self.value_dim);
        let t = x.q.shape()[2];
        // Blocks of `block()` positions (one of t when shorter); the last padded with positions
        // that neither write (beta 0, k 0) nor decay (g 0).
        let size = t.min(block());
        let blocks = (t + size - 1) / size;
        let pad = blocks * size - t;
        let padded = |a: &Array, width: Option<i32>| -> Result<Array> {
            if pad == 0 {
                return Ok(a.clone());
            }
            let shape: Vec<i32> = match width {
                Some(w) => vec![1, hv, pad, w],
                None => vec![1, hv, pad],
            };
            Ok(concatenate(&[a, &zeros::<f32>(&shape)?], 2)?)
        };
        let in_blocks = |a: &Array, w: i32| -> Result<Array> {
            Ok(padded(a, Some(w))?.reshape(&[hv, blocks, size, w])?)
        };
        let (q, k, v) = (
            in_blocks(&x.q, dk)?,
            in_blocks(&x.k, dk)?,
            in_blocks(&x.v, dv)?,
        );
        let beta = padded(&x.beta, None)?.reshape(&[hv, blocks, size, 1])?;
        let g = padded(&x.g, None)?.reshape(&[hv, blocks, size])?;
        // Decay from the block's start through each position, and between positions.
        let cum = g.cumsum(-1, None, None)?;
        let decay_to = cum.exp()?.reshape(&[hv, blocks, size, 1])?;
        let last = cum.index((.., .., size - 1..size));
        let decay_rest = last
            .subtract(&cum)?
            .exp()?
            .reshape(&[hv, blocks, size, 1])?;
        let block_decay = last.exp()?.reshape(&[hv, blocks, 1, 1])?;
        let between = cum
            .reshape(&[hv, blocks, size, 1])?
            .subtract(&cum.reshape(&[hv, blocks, 1, size])?)?;
        let lower = mlx_rs::ops::tri::<bool>(size, None, Some(0))?;
        // exp of positive differences (above the diagonal) could overflow: masked first.
        let between =
            mlx_rs::ops::select(&lower, &between, Array::from_f32(f32::NEG_INFINITY))?.exp()?;
        let kt = k.transpose_axes(&[0, 1, 3, 2])?;
        let (kb, vb) = (k.multiply(&beta)?, v.multiply(&beta)?);
        // Within a block, each position's correction reads the state as the earlier positions'
        // corrections left it: (I + L) U = beta v with L the strictly lower part of
        // (beta k)·k decayed.
        let l = mlx_rs::ops::tril(kb.matmul(&kt)?.multiply(&between)?, -1)?;
        let inverse = unit_lower_inverse(&l, size)?;
        let u = inverse.matmul(&vb)?;
        let w = inverse.matmul(&kb.multiply(&decay_to)?)?;
        let qd = q.multiply(&decay_to)?;
        let kd = k.multiply(&decay_rest)?;
        let within = q.matmul(&kt)?.multiply(&between)?;
        let state3 = |s: &Array| s.reshape(&[hv, dk, dv]);
        let mut outs = Vec::with_capacity(blocks as usize);
        let mut s = state3(&state)?;
        for i in 0..blocks {
            let at = |a: &Array| a.index((.., i));
            let fresh = at(&u).subtract(&at(&w).matmul(&s)?)?;
            outs.push(at(&qd).matmul(&s)?.add(&at(&within).matmul(&fresh)?)?);
            s = s
                .multiply(at(&block_decay))?
                .add(&at(&kd).transpose_axes(&[0, 2, 1])?.matmul(&fresh)?)?;
        }
        state = s.reshape(&[1, hv, dk, dv])?;
        let o = concatenate(&outs, 1)?
            .index((.., ..t, ..))
            .reshape(&[1, hv, t, dv])?;
        Ok((o, state))
    }

    /// One position per row: `x` (t = 1) over `state` [n, heads, dk, dv]. Returns the output
    /// [n, heads, 1, dv] and the rows' states after it.
    fn step(&self, x: &RuleInputs, state: &Array) -> Result<(Array, Array)> {
        let n = state.shape()[0];
        let hv = self.value_heads;
        let decay = x.g.exp()?.reshape(&[n, hv, 1, 1])?;
        let beta = x.beta.reshape(&[n, hv, 1, 1])?;
        let s = state.multiply(&decay)?;
        // k S: what the state recalls for k; the state moves toward v by beta.
        let recalled = x.k.matmul(&s)?;
        let fresh = x.v.subtract(&recalled)?.multiply(&beta)?;
        let s = s.add(&x.k.transpose_axes(&[0, 1, 3, 2])?.matmul(&fresh)?)?;
        Ok((x.q.matmul(&s)?, s))
    }

    /// The output heads `o` [n, t, heads, dv] RMS-normed, times silu(z) (z [n, t, heads *
    /// dv]), as [n, t, heads * dv] in `dtype`.
    fn gated_norm(&self, o: &Array, z: &Array, dtype: Dtype) -> Result<Array> {
        let s = o.shape();
        let (n, t) = (s[0], s[1]);
        let normed = mlx_rs::fast::rms_norm(&o.as_dtype(dtype)?, Some(&self.norm), self.eps)?;
        let z = z.reshape(&[n, t, self.value_heads, self.value_dim])?;
        let gated = normed
            .as_dtype(Dtype::Float32)?
            .multiply(&mlx_rs::nn::silu(&z.as_dtype(Dtype::Float32)?)?)?;
        Ok(gated
            .as_dtype(dtype)?
            .reshape(&[n, t, self.value_heads * self.value_dim])?)
    }

    /// A step's rows `x` [n, 1, hidden]: every group's slots, each continuing its row's
    /// convolution inputs and state in the group's layer `layer` (both replaced), then, with
    /// `chunk`, the last `t` rows are a prefill chunk continuing its sequence's cache. Returns
    /// [n, 1, hidden].
    pub(super) fn forward_rows(
        &self,
        x: &Array,
        layer: usize,
        groups: &mut [GroupStep<'_>],
        chunk: Option<(&mut (dyn KvCache + 'static), i32)>,
    ) -> Result<Array> {
        let n = x.shape()[0];
        let c = self.channels();
        let proj = self.in_proj.forward(x)?;
        let mut outs = Vec::with_capacity(groups.len() + 1);
        for g in groups.iter_mut() {
            let rows = proj.index(g.offset..g.offset + g.slots);
            let (mixed, z, b, a) = self.parts(&rows)?;
            let (window_state, state) = &mut g.kv[layer];
            let window = concatenate(&[&*window_state, &mixed.reshape(&[g.slots, 1, 1, c])?], 2)?;
            let conv = self.convolve(&window.reshape(&[g.slots, self.kernel, c])?, 1)?;
            *window_state = window.index((.., .., 1.., ..));
            let inputs = self.rule_inputs(&conv, &b, &a, g.slots, 1)?;
            let (o, s) = self.step(&inputs, state)?;
            *state = s;
            outs.push(self.gated_norm(&o.transpose_axes(&[0, 2, 1, 3])?, &z, x.dtype())?);
        }
        if let Some((cache, t)) = chunk {
            let rows = proj.index(n - t..).reshape(&[1, t, -1])?;
            let o = self.sequence(&rows, cache)?;
            outs.push(o.reshape(&[t, 1, -1])?);
        }
        self.out_proj.forward(&concat_rows(outs)?)
    }
}

/// (I + L)^-1 for strictly lower triangular `l` [.., size, size]: with M = -L nilpotent
/// (M^size = 0), (I + L)^-1 = I + M + M^2 + ... = (I + M)(I + M^2)(I + M^4)..., a few
/// matrix products instead of a substitution row by row.
fn unit_lower_inverse(l: &Array, size: i32) -> Result<Array> {
    let eye = mlx_rs::ops::eye::<f32>(size, None, None)?;
    let mut power = l.negative()?;
    let mut inverse = eye.add(&power)?;
    let mut reach = 2;
    while reach < size {
        power = power.matmul(&power)?;
        inverse = inverse.add(&inverse.matmul(&power)?)?;
        reach *= 2;
    }
    Ok(inverse)
}
