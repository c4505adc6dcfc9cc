//! Attention: fused q/k/v projections, rotary positions, the KV cache write and the attention
//! itself, for one sequence's chunk (`forward`) and for a step's rows in length groups beside a
//! chunk (`forward_grouped`: through the row attention kernel, masked, or row by row).

use mlx_rs::fast::{rms_norm, scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use llmq_text::config::ModelConfig;

use super::parts::{concat_rows, norm_weight, sequence_rows, softcap, Linear};
use super::rope::{Rope, Rotation};
use crate::arch::ArchOptions;
use crate::batch::{slots_of, take_rows, take_slots};
use crate::cache::{AttnMask, KvCache};
use crate::error::{EngineError, Result};
use crate::kernels::cpu::attention::{causal_attention, rows_attention, Shape};
use crate::kernels::cuda::row_attention::{RowAttention, RowPlan};
use crate::weights::Weights;

pub(super) struct Attention {
    /// q, k and v projections fused: [heads * d | kv_heads * d | kv_heads * d] outputs.
    pub(super) qkv: Linear,
    pub(super) o: Linear,
    pub(super) q_norm: Option<Array>,
    pub(super) k_norm: Option<Array>,
    pub(super) heads: i32,
    pub(super) kv_heads: i32,
    pub(super) head_dim: i32,
    pub(super) scale: f32,
    /// Scores soft-capped before the softmax (Gemma 2): attention then runs unfused.
    pub(super) softcap: Option<f32>,
    pub(super) eps: f32,
    /// On a CPU, scores not soft-capped: attention in f32 runs in [`crate::kernels::cpu::attention`].
    pub(super) cpu: bool,
    /// The output is gated per head by a sigmoid of q_proj's second half (Qwen3.5): q_proj's
    /// rows are then, per head, d of the query and d of the gate.
    pub(super) gated: bool,
}

/// An f32 array's data on the host (evaluated first).
fn f32_slice(a: &Array) -> Result<&[f32]> {
    a.try_as_slice::<f32>()
        .map_err(|e| EngineError::Host(format!("attention input: {e}")))
}

pub(super) fn heads_first(
    x: Array,
    b: i32,
    t: i32,
    heads: i32,
    dim: i32,
    norm: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    let x = x.reshape(&[b, t, heads, dim])?;
    let x = match norm {
        Some(w) => rms_norm(&x, Some(w), eps)?,
        None => x,
    };
    Ok(x.transpose_axes(&[0, 2, 1, 3])?)
}

impl Attention {
    pub(super) fn load(w: &mut Weights, p: &str, c: &ModelConfig, o: ArchOptions) -> Result<Self> {
        let (h, kvh, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let gemma = c.arch.norms_add_one();
        let q_rows = if c.attn_output_gate { 2 * h * d } else { h * d };
        let parts = if o.fused {
            vec![(format!("{p}.qkv_proj"), (h + 2 * kvh) * d)]
        } else {
            vec![
                (format!("{p}.q_proj"), q_rows),
                (format!("{p}.k_proj"), kvh * d),
                (format!("{p}.v_proj"), kvh * d),
            ]
        };
        Ok(Attention {
            qkv: Linear::load_fused(w, &parts, c.hidden_size, o.qkv_bias)?,
            o: Linear::load(
                w,
                &format!("{p}.{}", o.names.attn_out),
                c.hidden_size,
                h * d,
                false,
            )?,
            q_norm: if o.qk_norm {
                Some(norm_weight(
                    w,
                    &format!("{p}.{}.weight", o.names.q_norm),
                    d,
                    gemma,
                )?)
            } else {
                None
            },
            k_norm: if o.qk_norm {
                Some(norm_weight(
                    w,
                    &format!("{p}.{}.weight", o.names.k_norm),
                    d,
                    gemma,
                )?)
            } else {
                None
            },
            heads: h as i32,
            kv_heads: kvh as i32,
            head_dim: d as i32,
            scale: 1.0 / c.query_pre_attn_scalar.unwrap_or(d as f32).sqrt(),
            softcap: c.attn_logit_softcap,
            eps: c.rms_norm_eps,
            cpu: !crate::device::on_gpu() && c.attn_logit_softcap.is_none(),
            gated: c.attn_output_gate,
        })
    }

    /// Queries [b, heads, t, d] (normed), keys and values [b, kv_heads, t, d] (keys normed),
    /// not yet rotated, and the output gate [b, t, heads * d] where the model has one, from the
    /// fused projections `qkv` [b, t, ...].
    fn project_heads(
        &self,
        qkv: &Array,
        b: i32,
        t: i32,
    ) -> Result<(Array, Array, Array, Option<Array>)> {
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let qe = if self.gated { 2 * h * d } else { h * d };
        let ke = qe + kvh * d;
        let (q, gate) = if self.gated {
            let qg = qkv.index((.., .., ..qe)).reshape(&[b, t, h, 2 * d])?;
            let gate = qg.index((.., .., .., d..)).reshape(&[b, t, h * d])?;
            (qg.index((.., .., .., ..d)), Some(gate))
        } else {
            (qkv.index((.., .., ..qe)), None)
        };
        let q = heads_first(q, b, t, h, d, self.q_norm.as_ref(), self.eps)?;
        let k = heads_first(
            qkv.index((.., .., qe..ke)),
            b,
            t,
            kvh,
            d,
            self.k_norm.as_ref(),
            self.eps,
        )?;
        let v = heads_first(
            qkv.index((.., .., ke..ke + kvh * d)),
            b,
            t,
            kvh,
            d,
            None,
            self.eps,
        )?;
        Ok((q, k, v, gate))
    }

    /// The attention's output `o` [b, t, heads * d] times its gate's sigmoid, where it has one.
    fn gated_output(o: Array, gate: Option<Array>) -> Result<Array> {
        Ok(match gate {
            Some(g) => o.multiply(&mlx_rs::ops::sigmoid(&g)?)?,
            None => o,
        })
    }

    pub(super) fn forward(
        &self,
        x: &Array,
        rope: &Rope,
        caches: &mut [&mut (dyn KvCache + 'static)],
    ) -> Result<Array> {
        let b = x.shape()[0];
        let qkv = self.qkv.forward(x)?;
        let mut outs = Vec::with_capacity(caches.len());
        for (i, cache) in caches.iter_mut().enumerate() {
            let rows = sequence_rows(&qkv, b, i);
            outs.push(self.attend_sequence(&rows, rope, &mut **cache)?);
        }
        let o = concat_rows(outs)?;
        self.o.forward(&o)
    }
}

impl Attention {
    /// One sequence's attention: `qkv` [1, t, (heads + 2 kv_heads) * d] of its new tokens,
    /// appended to its cache. Returns [1, t, heads * d] (before the output projection).
    pub(super) fn attend_sequence(
        &self,
        qkv: &Array,
        rope: &Rope,
        cache: &mut (dyn KvCache + 'static),
    ) -> Result<Array> {
        let t = qkv.shape()[1];
        let (q, k, v, gate) = self.project_heads(qkv, 1, t)?;
        let rotation = rope.at_offset(cache.offset() as i32, t)?;
        let (q, k) = (rotation.apply(&q)?, rotation.apply(&k)?);
        let o = self.attend_cached(&q, &k, &v, cache)?;
        let o = o
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[1, t, self.heads * self.head_dim])?;
        Self::gated_output(o, gate)
    }

    /// One sequence's new queries, keys and values [1, heads, t, d] (rotated): the keys and
    /// values appended to its cache, the queries attending over what the cache returns.
    pub(super) fn attend_cached(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        cache: &mut (dyn KvCache + 'static),
    ) -> Result<Array> {
        let (keys, values, mask) = cache.update(k, v)?;
        if let Some(o) = self.attend_on_cpu(q, &*cache, &mask)? {
            return Ok(o);
        }
        self.attend(q, &keys, &values, &mask)
    }

    /// On a CPU, queries [1, heads, t, d] in f32 over a cache that keeps its positions in
    /// order, causal or unmasked, through llmq's attention ([`crate::kernels::cpu::attention`]); `None`
    /// elsewhere (soft-capped scores, explicit masks, a GPU, another dtype).
    fn attend_on_cpu(
        &self,
        q: &Array,
        cache: &(dyn KvCache + 'static),
        mask: &AttnMask,
    ) -> Result<Option<Array>> {
        let Some((keys, values)) = cache
            .buffers()
            .filter(|_| self.cpu && q.dtype() == Dtype::Float32)
        else {
            return Ok(None);
        };
        if matches!(mask, AttnMask::Explicit(_)) || keys.dtype() != Dtype::Float32 {
            return Ok(None);
        }
        let t = q.shape()[2] as usize;
        let shape = Shape {
            heads: self.heads as usize,
            kv_heads: self.kv_heads as usize,
            t,
            len: cache.offset(),
            cap: keys.shape()[2] as usize,
            d: self.head_dim as usize,
        };
        let q = q.contiguous()?;
        let o = causal_attention(
            f32_slice(&q)?,
            f32_slice(keys)?,
            f32_slice(values)?,
            shape,
            self.scale,
        );
        Ok(Some(Array::from_slice(
            &o,
            &[1, self.heads, t as i32, self.head_dim],
        )))
    }

    /// Queries [1, heads, t, d] over the keys and values a cache update returned, through
    /// MLX's fused attention.
    pub(super) fn attend(
        &self,
        q: &Array,
        keys: &Array,
        values: &Array,
        mask: &AttnMask,
    ) -> Result<Array> {
        if let Some(cap) = self.softcap {
            return self.attend_softcapped(q, keys, values, mask, cap);
        }
        Ok(match mask {
            AttnMask::None => {
                scaled_dot_product_attention(q, keys, values, self.scale, None, None)?
            }
            AttnMask::Causal => scaled_dot_product_attention(
                q,
                keys,
                values,
                self.scale,
                ScaledDotProductAttentionMask::Causal,
                None,
            )?,
            AttnMask::Explicit(m) => {
                scaled_dot_product_attention(q, keys, values, self.scale, m, None)?
            }
        })
    }
}

impl Attention {
    /// `attend` with scores soft-capped (`cap * tanh(s / cap)`) before the mask and softmax,
    /// unfused: queries [1, heads, t, d] grouped over their kv head, softmax in f32.
    fn attend_softcapped(
        &self,
        q: &Array,
        keys: &Array,
        values: &Array,
        mask: &AttnMask,
        cap: f32,
    ) -> Result<Array> {
        let (t, d, kvh) = (q.shape()[2], self.head_dim, self.kv_heads);
        let groups = self.heads / kvh;
        let len = keys.shape()[2];
        let q = q
            .multiply(Array::from_f32(self.scale))?
            .reshape(&[1, kvh, groups * t, d])?;
        let scores = q
            .matmul(keys.transpose_axes(&[0, 1, 3, 2])?)?
            .as_dtype(mlx_rs::Dtype::Float32)?;
        let scores = softcap(&scores, cap)?.reshape(&[1, kvh, groups, t, len])?;
        let allowed = match mask {
            AttnMask::None => None,
            AttnMask::Causal => {
                // Query i (of the last t positions) sees keys up to len - t + i.
                let qpos = mlx_rs::ops::arange::<i32, i32>(len - t, len, None)?.reshape(&[t, 1])?;
                let kpos = mlx_rs::ops::arange::<i32, i32>(None, len, None)?.reshape(&[1, len])?;
                Some(kpos.le(&qpos)?)
            }
            AttnMask::Explicit(m) => Some(m.clone()),
        };
        let scores = match allowed {
            Some(m) => mlx_rs::ops::select(&m, &scores, Array::from_f32(f32::NEG_INFINITY))?,
            None => scores,
        };
        let p = mlx_rs::ops::softmax_axis(&scores, -1, None)?
            .as_dtype(values.dtype())?
            .reshape(&[1, kvh, groups * t, len])?;
        Ok(p.matmul(values)?.reshape(&[1, self.heads, t, d])?)
    }
}

/// One decode batch's share of a grouped decode step: its rows' place in the step's rows, and
/// the inputs that make each row write and attend at its own position.
pub(super) struct GroupStep<'a> {
    pub(super) kv: &'a mut [(Array, Array)],
    pub(super) offset: i32,
    pub(super) slots: i32,
    pub(super) write: Array,
    pub(super) attend: GroupAttention,
}

/// How a group's rows attend (see [`DecodeBatch::per_row_attention`]).
pub(super) enum GroupAttention {
    /// With every other group's, through the row attention kernel ([`RowStep`]).
    Rows,
    /// All rows at once over keys gathered from the pool (`index`, `keys` a row, from
    /// [`DecodeBatch::gather_index`]), masked past each row's length (`mask`), and for a
    /// sliding-window layer also before its window (`windowed`).
    Masked {
        mask: Array,
        windowed: Option<Array>,
        index: Array,
        keys: i32,
    },
    /// Row by row, unmasked, over each active row's keys through its block table.
    PerRow(RowTables),
}

/// A group's active rows' keys: their lengths after this step's token, and their block tables
/// ([rows, width] block ids, flat).
pub(super) struct RowTables {
    pub(super) lens: Vec<usize>,
    pub(super) tables: Vec<i32>,
    pub(super) width: usize,
}

/// A decode step's attention through the row attention kernel: every group's rows in one
/// launch a layer, planned once for the step.
pub(super) struct RowStep<'a> {
    pub(super) kernel: &'a RowAttention,
    pub(super) plan: RowPlan,
    /// The plan of a sliding-window layer (each row over its window), for a model that has one.
    pub(super) windowed: Option<RowPlan>,
    /// Every slot's block table [slots, width] (int32).
    pub(super) tables: Array,
    pub(super) slots: i32,
}

impl Attention {
    /// Rows' queries, keys and values [b, heads, 1, d] from their fused projections `rows`
    /// [b, 1, ...] (a row: a decode slot's token or one of a prefill chunk's), each rotated at
    /// its own position (`rotation`, laid out as rows), and their output gate [b, 1, heads * d]
    /// where the model has one.
    pub(super) fn row_heads(
        &self,
        rows: &Array,
        b: i32,
        rotation: &Rotation,
    ) -> Result<(Array, Array, Array, Option<Array>)> {
        let (q, k, v, gate) = self.project_heads(rows, b, 1)?;
        let (q, k) = (rotation.apply(&q)?, rotation.apply(&k)?);
        Ok((q, k, v, gate))
    }

    /// Attention output [b, heads, 1, d] as rows [b, 1, heads, d].
    pub(super) fn rows_first(&self, o: &Array) -> Result<Array> {
        Ok(o.transpose_axes(&[0, 2, 1, 3])?)
    }

    /// One decode step for every row of every group: projections once over all rows, then per
    /// group each row's token is written at its own position (one scatter per buffer) and
    /// attends over its row: every group's rows in one launch of the row attention kernel when
    /// the model has it (`rows_step`), else group by group, masked past each row's length or
    /// row by row.
    ///
    /// With `chunk`, the last `t` rows are one sequence's prefill chunk (one token per row):
    /// they attend over that sequence's cache, so a decode step and a prefill chunk share one
    /// pass over the weights.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_grouped(
        &self,
        x: &Array,
        layer: usize,
        window: Option<usize>,
        groups: &mut [GroupStep<'_>],
        rows_step: Option<&RowStep<'_>>,
        rotation: &Rotation,
        chunk: Option<(&mut (dyn KvCache + 'static), i32)>,
    ) -> Result<Array> {
        let d = self.head_dim;
        let n = x.shape()[0];
        let qkv = self.qkv.forward(x)?;
        // Every row's heads in one pass, each rotated at its own position (a chunk's rows at
        // theirs): one rotation of the queries and one of the keys a layer.
        let (q, k, v, gate) = self.row_heads(&qkv, n, rotation)?;
        let mut outs = Vec::with_capacity(groups.len() + 1);
        // With the row attention kernel, the rows' keys and values are cut once into each
        // group's share and the chunk's (one split, not a slice per piece: each graph node
        // costs the host several microseconds a layer).
        let mut chunk_qkv = None;
        if let Some(rs) = rows_step {
            // Every group's rows together: one attention launch; only the KV writes go group
            // by group.
            let b = rs.slots;
            let mut bounds: Vec<i32> = groups.iter().skip(1).map(|g| g.offset).collect();
            if n > b {
                bounds.push(b);
            }
            let (mut ks, mut vs) = if bounds.is_empty() {
                (vec![k.clone()], vec![v.clone()])
            } else {
                (
                    k.split_at_indices(&bounds, 0)?,
                    v.split_at_indices(&bounds, 0)?,
                )
            };
            let q = if n > b {
                let mut qs = q.split_at_indices(&[b], 0)?;
                chunk_qkv = Some((
                    qs.pop().expect("two parts"),
                    ks.pop().expect("a chunk part"),
                    vs.pop().expect("a chunk part"),
                ));
                qs.pop().expect("two parts")
            } else {
                q.clone()
            };
            for (g, (gk, gv)) in groups.iter_mut().zip(ks.iter().zip(&vs)) {
                self.write_slots(&mut g.kv[layer], &g.write, gk, gv)?;
            }
            let pools: Vec<(&Array, &Array)> = groups
                .iter()
                .map(|g| (&g.kv[layer].0, &g.kv[layer].1))
                .collect();
            let plan = match (window, &rs.windowed) {
                (Some(_), Some(p)) => p,
                _ => &rs.plan,
            };
            outs.push(self.rows_first(&rs.kernel.apply(plan, &q, &pools, &rs.tables)?)?);
        } else {
            for g in groups.iter_mut() {
                let b = g.slots;
                let span = g.offset..g.offset + b;
                let (q, k, v) = (q.index(span.clone()), k.index(span.clone()), v.index(span));
                let kv = &mut g.kv[layer];
                self.write_slots(kv, &g.write, &k, &v)?;
                let o = match &g.attend {
                    GroupAttention::Masked {
                        mask,
                        windowed,
                        index,
                        keys,
                    } => {
                        let mask = match (window, windowed) {
                            (Some(_), Some(w)) => w,
                            _ => mask,
                        };
                        let (gk, gv) = take_rows(kv, index, b, *keys)?;
                        scaled_dot_product_attention(&q, &gk, &gv, self.scale, mask, None)?
                    }
                    GroupAttention::Rows => unreachable!(
                        "a step attends through the row attention kernel whole or not at all"
                    ),
                    GroupAttention::PerRow(rows) => match self.rows_on_cpu(&q, kv, rows, window)? {
                        Some(o) => o,
                        None => self.attend_per_row(&q, kv, rows, window, b)?,
                    },
                };
                outs.push(self.rows_first(&o)?);
            }
        }
        if let Some((cache, t)) = chunk {
            // The chunk's keys and values into its sequence's cache (as one sequence [1, heads,
            // t, d], views of the rows' heads); its queries attend there through MLX's
            // attention. Its output, as rows [t, 1, heads, d], is laid out by the concatenation.
            let rows = |a: &Array| if t == n { a.clone() } else { a.index(n - t..) };
            let seq = |a: &Array| a.transpose_axes(&[2, 1, 0, 3]);
            let (cq, ck, cv) = match chunk_qkv.take() {
                Some(parts) => parts,
                None => (rows(&q), rows(&k), rows(&v)),
            };
            let o = self
                .attend_cached(&seq(&cq)?, &seq(&ck)?, &seq(&cv)?, cache)?
                .transpose_axes(&[2, 0, 1, 3])?;
            outs.push(o);
        }
        let o = concat_rows(outs)?.reshape(&[n, 1, self.heads * d])?;
        self.o.forward(&Self::gated_output(o, gate)?)
    }

    /// Writes each slot's new key and value (`k`, `v` [slots, kv_heads, 1, d]) into `pool` at
    /// its slot (`write`, from [`DecodeBatch::write_index`]).
    fn write_slots(
        &self,
        pool: &mut (Array, Array),
        write: &Array,
        k: &Array,
        v: &Array,
    ) -> Result<()> {
        let rows = |a: &Array| a.reshape(&[-1, self.kv_heads, self.head_dim]);
        pool.0 = pool.0.put_along_axis(write, rows(k)?, 0)?;
        pool.1 = pool.1.put_along_axis(write, rows(v)?, 0)?;
        Ok(())
    }

    /// On a CPU in f32, a group's rows [slots, heads, 1, d] over the pool `kv`, each over its
    /// first `lens` positions through its table, through [`crate::kernels::cpu::attention`]
    /// (scratch rows zeros); `None` elsewhere.
    fn rows_on_cpu(
        &self,
        q: &Array,
        kv: &(Array, Array),
        rows: &RowTables,
        window: Option<usize>,
    ) -> Result<Option<Array>> {
        if !self.cpu || q.dtype() != Dtype::Float32 || kv.0.dtype() != Dtype::Float32 {
            return Ok(None);
        }
        let s = q.shape();
        let shape = Shape {
            heads: self.heads as usize,
            kv_heads: self.kv_heads as usize,
            t: 1,
            len: 0,
            cap: 0,
            d: self.head_dim as usize,
        };
        let q = q.contiguous()?;
        let o = rows_attention(
            f32_slice(&q)?,
            f32_slice(&kv.0)?,
            f32_slice(&kv.1)?,
            &rows.tables,
            rows.width,
            &rows.lens,
            window,
            shape,
            self.scale,
        );
        Ok(Some(Array::from_slice(&o, s)))
    }

    /// A group's active rows, each over its own keys (with a `window`, its last that many)
    /// gathered from the pool through its table, unmasked (MLX's fused vector kernel), its
    /// scratch rows zeros: [slots, heads, 1, d].
    fn attend_per_row(
        &self,
        q: &Array,
        kv: &(Array, Array),
        rows: &RowTables,
        window: Option<usize>,
        slots: i32,
    ) -> Result<Array> {
        let (lens, width) = (&rows.lens, rows.width);
        let mut parts = Vec::with_capacity(lens.len() + 1);
        for (r, &len) in lens.iter().enumerate() {
            let first = window.map_or(0, |w| len.saturating_sub(w));
            let own: Vec<i32> = slots_of(&rows.tables[r * width..][..width], len)
                .skip(first)
                .collect();
            let (k, v) = take_slots(kv, &own)?;
            let r = r as i32;
            parts.push(scaled_dot_product_attention(
                q.index(r..r + 1),
                &k,
                &v,
                self.scale,
                None,
                None,
            )?);
        }
        let n = lens.len() as i32;
        if n < slots {
            parts.push(mlx_rs::ops::zeros_dtype(
                &[slots - n, self.heads, 1, self.head_dim],
                q.dtype(),
            )?);
        }
        concat_rows(parts)
    }
}
