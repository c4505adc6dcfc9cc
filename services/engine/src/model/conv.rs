//! LFM2's short gated convolution, the mixer of its layers that do not attend: the layer's input
//! projected to B, C and x (one projection, three parts), `y = C * conv(B * x)` where `conv` is
//! causal over the last `kernel` positions with one filter per channel, then projected out.
//!
//! Its per-sequence state is the last `kernel - 1` values of `B * x`, kept by a
//! [`ConvCache`](crate::cache::ConvCache): a chunk of any length convolves at once over that
//! state followed by the chunk (`kernel` shifted products, not a loop over positions).

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use llmq_text::config::{ConvConfig, ModelConfig};

use super::attention::GroupStep;
use super::parts::{causal_depthwise, concat_rows, sequence_rows, Linear};
use crate::cache::KvCache;
use crate::error::Result;
use crate::weights::Weights;

pub(super) struct ShortConv {
    /// B, C and x together: [3 hidden] outputs.
    in_proj: Linear,
    out_proj: Linear,
    /// The filters as [kernel, hidden]: row j weighs the position `kernel - 1 - j` back.
    taps: Array,
    bias: Option<Array>,
    hidden: i32,
    kernel: i32,
}

impl ShortConv {
    /// `{p}.conv.in_proj`, `{p}.conv.out_proj` and the filters `{p}.conv.conv.weight` [hidden, 1,
    /// kernel] (or mlx-lm's [hidden, kernel, 1]; with `.bias` where the config says).
    pub(super) fn load(
        w: &mut Weights,
        p: &str,
        c: &ModelConfig,
        conv: &ConvConfig,
    ) -> Result<Self> {
        let h = c.hidden_size;
        Ok(ShortConv {
            in_proj: Linear::load(w, &format!("{p}.conv.in_proj"), 3 * h, h, conv.bias)?,
            out_proj: Linear::load(w, &format!("{p}.conv.out_proj"), h, h, conv.bias)?,
            taps: w.take_conv_taps(&format!("{p}.conv.conv.weight"), h, conv.kernel)?,
            bias: if conv.bias {
                Some(w.take(&format!("{p}.conv.conv.bias"), &[h])?)
            } else {
                None
            },
            hidden: h as i32,
            kernel: conv.kernel as i32,
        })
    }

    pub(super) fn parameters(&self) -> Vec<&Array> {
        let mut p = self.in_proj.parameters();
        p.extend(self.out_proj.parameters());
        p.push(&self.taps);
        p.extend(self.bias.as_ref());
        p
    }

    /// `x` [B, T, hidden]: B sequences of T new positions each, sequence i continuing from its
    /// state in `caches[i]` (which takes the new positions' `B * x`). Returns [B, T, hidden].
    pub(super) fn forward(
        &self,
        x: &Array,
        caches: &mut [&mut (dyn KvCache + 'static)],
    ) -> Result<Array> {
        let (b, t, h) = (x.shape()[0], x.shape()[1], self.hidden);
        let (bx, gate_out) = self.gated_input(x)?;
        let mut outs = Vec::with_capacity(caches.len());
        for (i, cache) in caches.iter_mut().enumerate() {
            let rows = sequence_rows(&bx, b, i);
            let (window, _, _) = cache.update(&rows.reshape(&[1, 1, t, h])?, &rows)?;
            outs.push(self.convolve(&window.reshape(&[1, -1, h])?, t)?);
        }
        self.output(outs, &gate_out)
    }

    /// `B * x` and `C` of the layer's input.
    fn gated_input(&self, x: &Array) -> Result<(Array, Array)> {
        let parts = self.in_proj.forward(x)?.split_equal(3, -1)?;
        Ok((parts[0].multiply(&parts[2])?, parts[1].clone()))
    }

    /// The layer's output from the convolution's outputs `outs` (in the order of the rows) and
    /// `C`.
    fn output(&self, outs: Vec<Array>, gate_out: &Array) -> Result<Array> {
        self.out_proj
            .forward(&gate_out.multiply(&concat_rows(outs)?)?)
    }

    /// A step's rows `x` [n, 1, hidden]: every group's slots, each continuing its row's state in
    /// the group's layer `layer` (replaced by the state shifted by the row's input), then, with
    /// `chunk`, the last `t` rows are a prefill chunk continuing its sequence's state. Returns
    /// [n, 1, hidden].
    pub(super) fn forward_rows(
        &self,
        x: &Array,
        layer: usize,
        groups: &mut [GroupStep<'_>],
        chunk: Option<(&mut (dyn KvCache + 'static), i32)>,
    ) -> Result<Array> {
        let (n, h) = (x.shape()[0], self.hidden);
        let (bx, gate_out) = self.gated_input(x)?;
        let mut outs = Vec::with_capacity(groups.len() + 1);
        for g in groups.iter_mut() {
            let rows = bx
                .index(g.offset..g.offset + g.slots)
                .reshape(&[g.slots, 1, 1, h])?;
            let state = &mut g.kv[layer];
            let window = concatenate(&[&state.0, &rows], 2)?;
            outs.push(self.convolve(&window.reshape(&[g.slots, self.kernel, h])?, 1)?);
            let shifted = window.index((.., .., 1.., ..));
            *state = (shifted.clone(), shifted);
        }
        if let Some((cache, t)) = chunk {
            let rows = bx.index(n - t..).reshape(&[1, 1, t, h])?;
            let (window, _, _) = cache.update(&rows, &rows)?;
            let out = self.convolve(&window.reshape(&[1, -1, h])?, t)?;
            outs.push(out.reshape(&[t, 1, h])?);
        }
        self.output(outs, &gate_out)
    }

    /// The convolution's output [rows, t, hidden] for the last `t` positions of `window` [rows,
    /// kernel - 1 + t, hidden] (the state, then the new positions).
    fn convolve(&self, window: &Array, t: i32) -> Result<Array> {
        let out = causal_depthwise(window, &self.taps, t)?;
        Ok(match &self.bias {
            Some(b) => out.add(b)?,
            None => out,
        })
    }
}
