//! LFM2's short gated convolution, the mixer of its layers that do not attend: the layer's input
//! projected to B, C and x (one projection, three parts), `y = C * conv(B * x)` where `conv` is
//! causal over the last `kernel` positions with one filter per channel, then projected out.
//!
//! Its per-sequence state is the last `kernel - 1` values of `B * x`, kept by a
//! [`ConvCache`](crate::cache::ConvCache): a chunk of any length convolves at once over that
//! state followed by the chunk (`kernel` shifted products, not a loop over positions). A decode
//! step (one position per row) is one graph of element-wise operations and the state's shift
//! ([`step_graph`]), compiled on a GPU so that its products fuse: a decode step's time there is
//! mostly the host's, a few microseconds an operation.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use llmq_text::config::{ConvConfig, ModelConfig};

use super::attention::GroupStep;
use super::parts::{causal_depthwise, concat_rows, sequence_rows, Compiled, Linear};
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
        let [bp, cp, xp] = self.projected(x)?;
        let mut outs = Vec::with_capacity(caches.len());
        for (i, cache) in caches.iter_mut().enumerate() {
            let part = |a: &Array| sequence_rows(a, b, i);
            let (bi, ci, xi) = (part(&bp), part(&cp), part(&xp));
            if let Some((state, _)) = cache.state().filter(|_| t == 1 && self.kernel > 1) {
                let [y, state] = self.step(&state, &bi, &ci, &xi)?;
                cache.install_state(&state, &Array::from_slice::<f32>(&[], &[0]), 1)?;
                outs.push(y);
                continue;
            }
            let rows = bi.multiply(&xi)?;
            let (window, _, _) = cache.update(&rows.reshape(&[1, 1, t, h])?, &rows)?;
            outs.push(ci.multiply(&self.convolve(&window.reshape(&[1, -1, h])?, t)?)?);
        }
        self.out_proj.forward(&concat_rows(outs)?)
    }

    /// B, C and x of the layer's input.
    fn projected(&self, x: &Array) -> Result<[Array; 3]> {
        let parts = self.in_proj.forward(x)?.split_equal(3, -1)?;
        let [b, c, x] = <[Array; 3]>::try_from(parts)
            .map_err(|_| crate::EngineError::Host("the input projection's three parts".into()))?;
        Ok([b, c, x])
    }

    /// One position of rows with states `state` [n, 1, kernel - 1, hidden] and their B, C and x
    /// [n, 1, hidden]: the gated output [n, 1, hidden] and the states after it.
    fn step(&self, state: &Array, b: &Array, c: &Array, x: &Array) -> Result<[Array; 2]> {
        let mut inputs = vec![
            state.clone(),
            b.clone(),
            c.clone(),
            x.clone(),
            self.taps.clone(),
        ];
        inputs.extend(self.bias.iter().cloned());
        let out = if crate::device::on_gpu() {
            compiled(self.bias.is_some(), &inputs)?
        } else {
            step_graph(&inputs)?
        };
        <[Array; 2]>::try_from(out)
            .map_err(|_| crate::EngineError::Host("a convolution step gives two arrays".into()))
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
        let [bp, cp, xp] = self.projected(x)?;
        let mut outs = Vec::with_capacity(groups.len() + 1);
        for g in groups.iter_mut() {
            let part = |a: &Array| a.index(g.offset..g.offset + g.slots);
            let state = &mut g.kv[layer];
            if self.kernel > 1 {
                let [y, after] = self.step(&state.0, &part(&bp), &part(&cp), &part(&xp))?;
                *state = (after.clone(), after);
                outs.push(y);
                continue;
            }
            let rows = part(&bp)
                .multiply(part(&xp))?
                .reshape(&[g.slots, 1, 1, h])?;
            let window = concatenate(&[&state.0, &rows], 2)?;
            let out = self.convolve(&window.reshape(&[g.slots, self.kernel, h])?, 1)?;
            outs.push(part(&cp).multiply(&out)?);
            let shifted = window.index((.., .., 1.., ..));
            *state = (shifted.clone(), shifted);
        }
        if let Some((cache, t)) = chunk {
            let rows = bp.index(n - t..).multiply(xp.index(n - t..))?;
            let rows = rows.reshape(&[1, 1, t, h])?;
            let (window, _, _) = cache.update(&rows, &rows)?;
            let out = self.convolve(&window.reshape(&[1, -1, h])?, t)?;
            outs.push(cp.index(n - t..).multiply(out.reshape(&[t, 1, h])?)?);
        }
        self.out_proj.forward(&concat_rows(outs)?)
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

/// A decode step's graph over `[state, b, c, x, taps]` (and the convolution's bias, where it has
/// one): `state` [n, 1, kernel - 1, hidden], b, c, x [n, 1, hidden], `taps` [kernel, hidden]. The
/// new input `b * x` is weighed by the last tap and each kept input by its own, as element-wise
/// products of slices (no reduction, so that a compiled step fuses them), gated by c; the
/// states move on by one. Returns [output, states after].
fn step_graph(x: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let (state, b, c, xin, taps, bias) = match x {
        [s, b, c, x, t] => (s, b, c, x, t, None),
        [s, b, c, x, t, bias] => (s, b, c, x, t, Some(bias)),
        _ => return Err(Exception::custom("a convolution step takes 5 or 6 arrays")),
    };
    let keep = state.shape()[2];
    let (n, h) = (b.shape()[0], b.shape()[2]);
    let bx = b.multiply(xin)?;
    let mut out = bx.multiply(taps.index(keep))?;
    for j in 0..keep {
        let kept = state.index((.., .., j, ..));
        out = out.add(kept.multiply(taps.index(j))?)?;
    }
    if let Some(bias) = bias {
        out = out.add(bias)?;
    }
    let y = c.multiply(&out)?;
    let after = concatenate(
        &[state.index((.., .., 1.., ..)), bx.reshape(&[n, 1, 1, h])?],
        2,
    )?;
    Ok(vec![y, after])
}

thread_local! {
    // One compiled step with a bias and one without, kept for the thread's life (a function
    // compiled anew is traced anew: kernels/mod.rs says why).
    static COMPILED: RefCell<[Option<Compiled>; 2]> = const { RefCell::new([None, None]) };
}

/// [`step_graph`] over `x`, compiled (traced once per shape).
fn compiled(bias: bool, x: &[Array]) -> Result<Vec<Array>> {
    COMPILED.with(|cell| {
        let mut all = cell.borrow_mut();
        let f = all[usize::from(bias)]
            .get_or_insert_with(|| Box::new(compile(|x: &[Array]| step_graph(x), false)));
        Ok(f(x)?)
    })
}

#[cfg(test)]
mod tests {
    use super::super::parts::normal;
    use super::*;

    /// The step's graph gives what the convolution over the window does, and the states
    /// shifted by the new input; compiled, the same.
    #[test]
    fn a_step_equals_the_convolution_over_its_window() {
        let (n, kernel, h) = (3, 3, 8);
        let state = normal(&[n, 1, kernel - 1, h], 1);
        let (b, c, x) = (
            normal(&[n, 1, h], 2),
            normal(&[n, 1, h], 3),
            normal(&[n, 1, h], 4),
        );
        let (taps, bias) = (normal(&[kernel, h], 5), normal(&[h], 6));
        let bx = b.multiply(&x).unwrap();
        let window = concatenate(&[&state, &bx.reshape(&[n, 1, 1, h]).unwrap()], 2).unwrap();
        let conv = causal_depthwise(&window.reshape(&[n, kernel, h]).unwrap(), &taps, 1).unwrap();
        let want = c.multiply(conv.add(&bias).unwrap()).unwrap();
        let inputs = [state, b, c, x, taps, bias];
        let close = |a: &Array, b: &Array| {
            let d = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
            d.item_exact::<f32>() < 1e-5
        };
        for out in [
            step_graph(&inputs).unwrap(),
            compiled(true, &inputs).unwrap(),
        ] {
            assert!(close(&out[0], &want), "output");
            assert!(close(&out[1], &window.index((.., .., 1.., ..))), "states");
        }
    }
}
