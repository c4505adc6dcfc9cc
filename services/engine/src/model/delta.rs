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

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{broadcast_to, concatenate, zeros};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};

use llmq_text::config::{DeltaNetConfig, ModelConfig};

use super::attention::GroupStep;
use super::parts::{causal_depthwise, concat_rows, sequence_rows, Compiled, Linear};
use crate::cache::KvCache;
use crate::error::Result;
use crate::kernels::cuda::delta_step;
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
        let window = window.reshape(&[1, -1, c])?;
        let state = match cache.memory() {
            Some(s) => s.clone(),
            None => zeros::<f32>(&[1, self.value_heads, self.key_dim, self.value_dim])?,
        };
        if t == 1 {
            // One position continuing its sequence (a decode step of `Model::forward`): the
            // step's form, not a chunk of one.
            let (out, state) = self.decode(&window, &z, &b, &a, &state)?;
            cache.set_memory(state)?;
            return Ok(out);
        }
        let conv = self.convolve(&window, t)?;
        let inputs = self.rule_inputs(&conv, &b, &a, 1, t)?;
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
        let (q, k, v) = split_qkv(conv, hk * dk)?;
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
        let (g, beta) = decay_and_strength(a, b, &self.dt_bias, &self.neg_a)?;
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

    /// One position per row: the convolution's windows `window` [n, kernel, channels] (the kept
    /// inputs, then the new one), the projections z, b, a [n, 1, ..] and the rows' states
    /// `state` [n, heads, dk, dv]. Returns the gated output [n, 1, heads * dv] and the states
    /// after the step. On a CPU [`decode_graph`]; on a GPU, for enough rows
    /// ([`delta_step::covers`]), llmq's kernel between two compiled parts, else
    /// [`decode_graph`] compiled.
    fn decode(
        &self,
        window: &Array,
        z: &Array,
        b: &Array,
        a: &Array,
        state: &Array,
    ) -> Result<(Array, Array)> {
        let form = DecodeForm {
            eps: self.eps,
            l2_eps: self.l2_eps,
            tiled: self.tiled,
            key_heads: self.key_heads,
        };
        let (hk, hv, dk, dv) = (
            self.key_heads,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        );
        let rows = state.shape()[0];
        if crate::device::on_gpu() && delta_step::covers(hk, hv, dk, dv, rows) {
            let inputs = [
                window.clone(),
                self.taps.clone(),
                b.clone(),
                a.clone(),
                self.dt_bias.clone(),
                self.neg_a.clone(),
                self.q_weight.clone(),
                self.k_weight.clone(),
            ];
            let x = compiled(Part::Inputs, form, &inputs)?;
            let (o, state) =
                delta_step::step(&x[0], &x[1], &x[2], &x[3], &x[4], state, self.tiled)?;
            let n = o.shape()[0];
            let o = o.reshape(&[n, 1, hv, dv])?;
            let out = compiled(Part::Output, form, &[o, z.clone(), self.norm.clone()])?;
            return Ok((out.into_iter().next().expect("one output"), state));
        }
        let inputs = [
            window.clone(),
            self.taps.clone(),
            z.clone(),
            b.clone(),
            a.clone(),
            state.clone(),
            self.dt_bias.clone(),
            self.neg_a.clone(),
            self.q_weight.clone(),
            self.k_weight.clone(),
            self.norm.clone(),
        ];
        let mut out = if crate::device::on_gpu() {
            compiled(Part::Whole, form, &inputs)?
        } else {
            decode_graph(form, &inputs)?
        };
        let state = out.pop().expect("two outputs");
        Ok((out.pop().expect("two outputs"), state))
    }

    /// The output heads `o` [n, t, heads, dv] RMS-normed, times silu(z), as [n, t, heads * dv]
    /// in `dtype` ([`gated_norm`]).
    fn gated_norm(&self, o: &Array, z: &Array, dtype: Dtype) -> Result<Array> {
        Ok(gated_norm(o, z, &self.norm, self.eps, dtype)?)
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
            *window_state = window.index((.., .., 1.., ..));
            let (o, s) = self.decode(
                &window.reshape(&[g.slots, self.kernel, c])?,
                &z,
                &b,
                &a,
                state,
            )?;
            *state = s;
            outs.push(o);
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

/// The output heads `o` [n, t, heads, dv] RMS-normed (weight `norm`), times silu(z) (z [n, t,
/// heads * dv]), as [n, t, heads * dv] in `dtype`.
fn gated_norm(
    o: &Array,
    z: &Array,
    norm: &Array,
    eps: f32,
    dtype: Dtype,
) -> std::result::Result<Array, Exception> {
    let s = o.shape();
    let (n, t, heads, dv) = (s[0], s[1], s[2], s[3]);
    let normed = mlx_rs::fast::rms_norm(&o.as_dtype(dtype)?, Some(norm), eps)?;
    let z = z.reshape(&[n, t, heads, dv])?;
    let gated = normed
        .as_dtype(Dtype::Float32)?
        .multiply(&mlx_rs::nn::silu(&z.as_dtype(Dtype::Float32)?)?)?;
    gated.as_dtype(dtype)?.reshape(&[n, t, heads * dv])
}

/// What a layer's decode step depends on besides its inputs' shapes: the compiled parts are
/// traced once per form and shape.
#[derive(Clone, Copy, PartialEq)]
struct DecodeForm {
    eps: f32,
    l2_eps: f32,
    tiled: bool,
    key_heads: i32,
}

/// The parts of a decode step, each a graph MLX compiles on its own.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    /// [`decode_graph`]: the whole step in MLX operations.
    Whole,
    /// [`step_inputs`]: the convolution, q, k, v, g and beta (before the CUDA kernel).
    Inputs,
    /// [`gated_norm`] of the kernel's output.
    Output,
}

/// A decode step of `n` rows as one graph of element-wise operations and reductions, without
/// matrix products or copies, so that compiled it is a few fused kernels.
///
/// Inputs: the convolution's window [n, kernel, channels] and taps [kernel, channels]; z [n,
/// 1, heads * dv], b and a [n, 1, heads]; the states [n, heads, dk, dv] (float32); dt_bias and
/// -exp(A_log) [heads]; q's and k's norm weights [dk]; the output norm's weight [dv]. The
/// dimensions follow from the shapes. Outputs: the gated output [n, 1, heads * dv] in z's
/// dtype and the states after the step.
fn decode_graph(f: DecodeForm, x: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let [window, taps, z, b, a, state, dt_bias, neg_a, q_weight, k_weight, norm] = x else {
        return Err(Exception::custom("the DeltaNet step takes 11 inputs"));
    };
    let inputs = [window, taps, b, a, dt_bias, neg_a, q_weight, k_weight].map(Array::clone);
    let [q, k, v, g, beta] = <[Array; 5]>::try_from(step_inputs(f, &inputs)?)
        .map_err(|_| Exception::custom("five step inputs"))?;
    let (o, state) = rule_step(&q, &k, &v, &g, &beta, state, f.tiled)?;
    let s = o.shape();
    let o = o.reshape(&[s[0], 1, s[1], s[2]])?;
    Ok(vec![gated_norm(&o, z, norm, f.eps, z.dtype())?, state])
}

/// The rule's inputs for a decode step: from the convolution's window and taps, b, a, dt_bias,
/// -exp(A_log) and q's and k's norm weights ([`decode_graph`]'s shapes), q and k [n,
/// key_heads, dk] (normed, q scaled), v [n, heads, dv], g and beta [n, heads], all float32.
fn step_inputs(f: DecodeForm, x: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let [window, taps, b, a, dt_bias, neg_a, q_weight, k_weight] = x else {
        return Err(Exception::custom(
            "the DeltaNet step's inputs take 8 arrays",
        ));
    };
    let (n, c) = (window.shape()[0], window.shape()[2]);
    let (hv, dk, hk) = (dt_bias.shape()[0], q_weight.shape()[0], f.key_heads);
    let dv = (c - 2 * hk * dk) / hv;
    let conv = mlx_rs::nn::silu(causal_depthwise(window, taps, 1)?)?;
    let (q, k, v) = split_qkv(&conv, hk * dk)?;
    let key =
        |x: &Array, w: &Array| mlx_rs::fast::rms_norm(&x.reshape(&[n, hk, dk])?, Some(w), f.l2_eps);
    let (g, beta) = decay_and_strength(a, b, dt_bias, neg_a)?;
    Ok(vec![
        key(&q, q_weight)?,
        key(&k, k_weight)?,
        v.reshape(&[n, hv, dv])?,
        g.reshape(&[n, hv])?,
        beta.reshape(&[n, hv])?,
    ])
}

/// The convolution's output split into q, k and v (each key part `key_width` wide), float32.
fn split_qkv(
    conv: &Array,
    key_width: i32,
) -> std::result::Result<(Array, Array, Array), Exception> {
    let conv = conv.as_dtype(Dtype::Float32)?;
    let mut qkv = conv.split_at_indices(&[key_width, 2 * key_width], -1)?;
    let v = qkv.pop().expect("three parts");
    let k = qkv.pop().expect("three parts");
    let q = qkv.pop().expect("three parts");
    Ok((q, k, v))
}

/// Per value head, the log decay g = -exp(A_log) softplus(a + dt_bias) (`neg_a` is
/// -exp(A_log)) and the write strength beta = sigmoid(b), float32, in a's and b's shape.
fn decay_and_strength(
    a: &Array,
    b: &Array,
    dt_bias: &Array,
    neg_a: &Array,
) -> std::result::Result<(Array, Array), Exception> {
    let softplus = mlx_rs::ops::logaddexp(
        a.as_dtype(Dtype::Float32)?.add(dt_bias)?,
        Array::from_f32(0.0),
    )?;
    let beta = mlx_rs::ops::sigmoid(&b.as_dtype(Dtype::Float32)?)?;
    Ok((softplus.multiply(neg_a)?, beta))
}

/// The rule's step in element-wise operations and reductions (what
/// [`kernels::cuda::delta_step`](crate::kernels::cuda::delta_step) does in one pass): q, k [n,
/// key_heads, dk], v [n, heads, dv], g and beta [n, heads], state [n, heads, dk, dv]. Returns o
/// [n, heads, dv] and the states after the step.
fn rule_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
    tiled: bool,
) -> std::result::Result<(Array, Array), Exception> {
    let s = state.shape();
    let (n, hv, dk, dv) = (s[0], s[1], s[2], s[3]);
    let hk = q.shape()[1];
    let r = hv / hk;
    // Value heads as [A, B] = [key heads, value heads per key head] (grouped) or the reverse
    // (tiled), so that each key head broadcasts over the value heads it serves.
    let (heads, key_at): ([i32; 2], [i32; 2]) = if tiled {
        ([r, hk], [1, hk])
    } else {
        ([hk, r], [hk, 1])
    };
    let key = |x: &Array| x.reshape(&[n, key_at[0], key_at[1], dk, 1]);
    let (q, k) = (key(q)?, key(k)?);
    let per_head = |x: &Array, w: i32| x.reshape(&[n, heads[0], heads[1], 1, w]);
    let st = state
        .reshape(&[n, heads[0], heads[1], dk, dv])?
        .multiply(per_head(g, 1)?.exp()?)?;
    // k S: what the state recalls for k; the state moves toward v by beta.
    let recalled = st.multiply(&k)?.sum_axis(-2, true)?;
    let fresh = per_head(v, dv)?
        .subtract(&recalled)?
        .multiply(per_head(beta, 1)?)?;
    let st = st.add(&k.multiply(&fresh)?)?;
    let o = st.multiply(&q)?.sum_axis(-2, true)?.reshape(&[n, hv, dv])?;
    Ok((o, st.reshape(&[n, hv, dk, dv])?))
}

thread_local! {
    // One compiled function per part and form, kept for the thread's life (a function
    // compiled anew is traced anew: kernels/mod.rs says why).
    static COMPILED: RefCell<Vec<(Part, DecodeForm, Compiled)>> = const { RefCell::new(Vec::new()) };
}

/// `part` of a decode step over `x`, compiled: MLX fuses its element-wise runs into single
/// kernels.
fn compiled(part: Part, f: DecodeForm, x: &[Array]) -> Result<Vec<Array>> {
    COMPILED.with(|cell| {
        let mut all = cell.borrow_mut();
        let i = match all.iter().position(|(p, g, _)| *p == part && *g == f) {
            Some(i) => i,
            None => {
                let graph: Compiled = match part {
                    Part::Whole => Box::new(compile(move |x: &[Array]| decode_graph(f, x), false)),
                    Part::Inputs => Box::new(compile(move |x: &[Array]| step_inputs(f, x), false)),
                    Part::Output => Box::new(compile(
                        move |x: &[Array]| {
                            let [o, z, norm] = x else {
                                return Err(Exception::custom("the output takes 3 arrays"));
                            };
                            Ok(vec![gated_norm(o, z, norm, f.eps, z.dtype())?])
                        },
                        false,
                    )),
                };
                all.push((part, f, graph));
                all.len() - 1
            }
        };
        Ok((all[i].2)(x)?)
    })
}

#[cfg(test)]
mod tests {
    use super::super::parts::normal;
    use super::*;

    /// The compiled step computes what the plain graph does, for both orders of value heads
    /// and for batches of different sizes (each traced on its own).
    #[test]
    fn the_compiled_step_equals_the_plain_one() {
        let (hk, hv, dk, dv, kernel) = (2, 4, 8, 6, 4);
        let c = 2 * hk * dk + hv * dv;
        for tiled in [false, true] {
            let form = DecodeForm {
                eps: 1e-6,
                l2_eps: 1e-6 / dk as f32,
                tiled,
                key_heads: hk,
            };
            for n in [1, 3] {
                let inputs = [
                    normal(&[n, kernel, c], 1),
                    normal(&[kernel, c], 2),
                    normal(&[n, 1, hv * dv], 3),
                    normal(&[n, 1, hv], 4),
                    normal(&[n, 1, hv], 5),
                    normal(&[n, hv, dk, dv], 6),
                    normal(&[hv], 7),
                    normal(&[hv], 8).abs().unwrap().negative().unwrap(),
                    normal(&[dk], 9),
                    normal(&[dk], 10),
                    normal(&[dv], 11),
                ];
                let plain = decode_graph(form, &inputs).unwrap();
                let compiled = compiled(Part::Whole, form, &inputs).unwrap();
                for (p, q) in plain.iter().zip(&compiled) {
                    assert_eq!(p.shape(), q.shape());
                    let close = p.all_close(q, 1e-5, 1e-5, None).unwrap();
                    assert!(close, "tiled {tiled}, {n} rows");
                }
            }
        }
    }
}
