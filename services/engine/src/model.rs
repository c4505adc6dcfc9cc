//! The decoder-only transformer that every supported architecture runs on.
//!
//! `forward` takes B sequences with T new tokens each and their caches: prefill is B = 1 with
//! a chunk of any size, continuing from the cache's offset; decode is T = 1 over a batch of
//! sequences at different positions. Projections and the MLP run batched; attention runs per
//! sequence against that sequence's own cache, so nothing is padded to the longest sequence.

use mlx_rs::fast::{rms_norm, rope, rope_dynamic, scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, sigmoid};
use mlx_rs::{Array, Dtype};

use llmq_text::config::ModelConfig;

use crate::arch::{self, ArchOptions};
use crate::batch::DecodeBatch;
use crate::cache::{AttnMask, KvCache, RotatingCache, SequenceCache, StandardCache};
use crate::error::{EngineError, Result};
use crate::row_attention::{RowAttention, RowPlan};
use crate::weights::Weights;

/// Copies an array to the host as f32, materialising views and casting first.
pub fn host_f32(a: &Array) -> Result<Vec<f32>> {
    let a = if a.dtype() == Dtype::Float32 { a.contiguous()? } else { a.as_dtype(Dtype::Float32)? };
    a.to_vec_exact::<f32>().map_err(|e| EngineError::Host(e.to_string()))
}

/// Cache growth step in tokens: decode reallocates once every this many tokens.
const CACHE_STEP: usize = 256;

/// On a GPU, prefill chunks end on multiples of this many positions (see `Model::chunk_grid`).
pub const GPU_CHUNK_GRID: usize = 256;

struct Linear {
    weight_t: Array,
    bias: Option<Array>,
}

impl Linear {
    /// Loads projections that read the same input as one: their weights are stacked along the
    /// output dimension, so one matmul (one kernel) computes them all. `parts` are
    /// (weight prefix, output size); callers split the output back by those sizes.
    fn load_fused(w: &mut Weights, parts: &[(String, usize)], in_dim: usize, bias: bool) -> Result<Self> {
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::with_capacity(parts.len());
        for (prefix, out_dim) in parts {
            weights.push(w.take(&format!("{prefix}.weight"), &[*out_dim, in_dim])?);
            if bias {
                biases.push(w.take(&format!("{prefix}.bias"), &[*out_dim])?);
            }
        }
        let stack = |v: Vec<Array>| -> Result<Array> {
            Ok(if v.len() == 1 { v.into_iter().next().unwrap() } else { concatenate(&v, 0)? })
        };
        let weight_t = stack(weights)?.t();
        let bias = if bias { Some(stack(biases)?) } else { None };
        Ok(Linear { weight_t, bias })
    }

    fn load(w: &mut Weights, prefix: &str, out_dim: usize, in_dim: usize, bias: bool) -> Result<Self> {
        Self::load_fused(w, &[(prefix.to_string(), out_dim)], in_dim, bias)
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let y = x.matmul(&self.weight_t)?;
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

struct Attention {
    /// q, k and v projections fused: [heads * d | kv_heads * d | kv_heads * d] outputs.
    qkv: Linear,
    o: Linear,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    rope_theta: f32,
    eps: f32,
}

struct Mlp {
    /// gate and up projections fused: [intermediate | intermediate] outputs.
    gate_up: Linear,
    intermediate: i32,
    down: Linear,
}

struct Layer {
    input_norm: Array,
    attn: Attention,
    post_norm: Array,
    mlp: Mlp,
}

pub struct Model {
    pub config: ModelConfig,
    embed: Array,
    layers: Vec<Layer>,
    norm: Array,
    /// None when the output projection is tied to the embedding.
    lm_head_t: Option<Array>,
    dtype: Dtype,
    chunk_grid: usize,
    /// Decode attention by row lengths (NVIDIA GPUs); None: masked attention.
    row_attention: Option<RowAttention>,
}

fn heads_first(x: Array, b: i32, t: i32, heads: i32, dim: i32, norm: Option<&Array>, eps: f32) -> Result<Array> {
    let x = x.reshape(&[b, t, heads, dim])?;
    let x = match norm {
        Some(w) => rms_norm(&x, Some(w), eps)?,
        None => x,
    };
    Ok(x.transpose_axes(&[0, 2, 1, 3])?)
}

impl Attention {
    fn load(w: &mut Weights, p: &str, c: &ModelConfig, o: ArchOptions) -> Result<Self> {
        let (h, kvh, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let parts = [(format!("{p}.q_proj"), h * d), (format!("{p}.k_proj"), kvh * d), (format!("{p}.v_proj"), kvh * d)];
        Ok(Attention {
            qkv: Linear::load_fused(w, &parts, c.hidden_size, o.qkv_bias)?,
            o: Linear::load(w, &format!("{p}.o_proj"), c.hidden_size, h * d, false)?,
            q_norm: if o.qk_norm { Some(w.take(&format!("{p}.q_norm.weight"), &[d])?) } else { None },
            k_norm: if o.qk_norm { Some(w.take(&format!("{p}.k_norm.weight"), &[d])?) } else { None },
            heads: h as i32,
            kv_heads: kvh as i32,
            head_dim: d as i32,
            scale: 1.0 / (d as f32).sqrt(),
            rope_theta: c.rope_theta,
            eps: c.rms_norm_eps,
        })
    }

    fn forward(&self, x: &Array, caches: &mut [&mut (dyn KvCache + 'static)]) -> Result<Array> {
        let b = x.shape()[0];
        let qkv = self.qkv.forward(x)?;
        let mut outs = Vec::with_capacity(caches.len());
        for (i, cache) in caches.iter_mut().enumerate() {
            let rows = if b == 1 {
                qkv.clone()
            } else {
                let i = i as i32;
                qkv.index(i..i + 1)
            };
            outs.push(self.attend_sequence(&rows, &mut **cache)?);
        }
        let o = if outs.len() == 1 { outs.pop().unwrap() } else { concatenate(&outs, 0)? };
        self.o.forward(&o)
    }
}

impl Attention {
    /// One sequence's attention: `qkv` [1, t, (heads + 2 kv_heads) * d] of its new tokens,
    /// appended to its cache. Returns [1, t, heads * d] (before the output projection).
    fn attend_sequence(&self, qkv: &Array, cache: &mut (dyn KvCache + 'static)) -> Result<Array> {
        let t = qkv.shape()[1];
        let d = self.head_dim;
        let (qe, ke) = (self.heads * d, (self.heads + self.kv_heads) * d);
        let q = heads_first(qkv.index((.., .., ..qe)), 1, t, self.heads, d, self.q_norm.as_ref(), self.eps)?;
        let k = heads_first(qkv.index((.., .., qe..ke)), 1, t, self.kv_heads, d, self.k_norm.as_ref(), self.eps)?;
        let v = heads_first(qkv.index((.., .., ke..)), 1, t, self.kv_heads, d, None, self.eps)?;
        let off = cache.offset() as i32;
        let q = rope(&q, d, false, self.rope_theta, 1.0, off, None)?;
        let k = rope(&k, d, false, self.rope_theta, 1.0, off, None)?;
        let o = self.attend_cached(&q, &k, &v, cache)?;
        Ok(o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[1, t, self.heads * d])?)
    }

    /// One sequence's new queries, keys and values [1, heads, t, d] (rotated): the keys and
    /// values appended to its cache, the queries attending over what the cache returns.
    fn attend_cached(&self, q: &Array, k: &Array, v: &Array, cache: &mut (dyn KvCache + 'static)) -> Result<Array> {
        let (keys, values, mask) = cache.update(k, v)?;
        self.attend(q, &keys, &values, &mask)
    }

    /// Queries [1, heads, t, d] over the keys and values a cache update returned, through
    /// MLX's fused attention.
    fn attend(&self, q: &Array, keys: &Array, values: &Array, mask: &AttnMask) -> Result<Array> {
        Ok(match mask {
            AttnMask::None => scaled_dot_product_attention(q, keys, values, self.scale, None, None)?,
            AttnMask::Causal => scaled_dot_product_attention(q, keys, values, self.scale, ScaledDotProductAttentionMask::Causal, None)?,
            AttnMask::Explicit(m) => scaled_dot_product_attention(q, keys, values, self.scale, m, None)?,
        })
    }
}

/// silu(g) * u as one fused kernel (MLX compiles the element-wise graph once per shape class).
fn swiglu(g: &Array, u: &Array) -> Result<Array> {
    let f = |(g, u): (&Array, &Array)| -> std::result::Result<Array, mlx_rs::error::Exception> {
        g.multiply(sigmoid(g)?)?.multiply(u)
    };
    let mut compiled = mlx_rs::transforms::compile::compile(f, true);
    Ok(compiled((g, u))?)
}

/// A prefill chunk's share of a step: its tokens, its sequence's cache, and the layers it runs
/// through in this step. A chunk's stages are consecutive ranges of layers ending at the last;
/// a stage after the first takes the hidden state the one before it gave (`hidden`, None for
/// a stage from layer 0). Each layer's cache takes the chunk's keys and values in the stage that
/// runs that layer, so between stages the layers hold different lengths: the sequence's cache
/// is whole again only after the last stage.
pub struct ChunkStage<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SequenceCache,
    pub layers: std::ops::Range<usize>,
    pub hidden: Option<Array>,
}

/// One decode batch's share of a grouped decode step: its rows' place in the step's rows, and
/// the inputs that make each row write and attend at its own position.
struct GroupStep<'a> {
    kv: &'a mut [(Array, Array)],
    offset: i32,
    slots: i32,
    write: Array,
    attend: GroupAttention,
}

/// How a group's rows attend (see `DecodeBatch::per_row_attention`).
enum GroupAttention {
    /// With every other group's, through the row attention kernel (`RowStep`).
    Rows,
    /// All rows at once over the whole capacity, masked past each row's length.
    Masked(Array),
    /// Row by row, unmasked, over each active row's length after this step's token.
    PerRow(Vec<i32>),
}

/// A decode step's attention through the row attention kernel: every group's rows in one
/// launch a layer, planned once for the step.
struct RowStep<'a> {
    kernel: &'a RowAttention,
    plan: RowPlan,
    slots: i32,
}

impl Attention {
    /// Rows' queries, keys and values [b, heads, 1, d] from their fused projections `rows`
    /// [b, 1, ...] (a row: a decode slot's token or one of a prefill chunk's), each rotated at
    /// its own position (`positions` [b] int32).
    fn row_heads(&self, rows: &Array, b: i32, positions: &Array) -> Result<(Array, Array, Array)> {
        let d = self.head_dim;
        let (qe, ke) = (self.heads * d, (self.heads + self.kv_heads) * d);
        let q = heads_first(rows.index((.., .., ..qe)), b, 1, self.heads, d, self.q_norm.as_ref(), self.eps)?;
        let k = heads_first(rows.index((.., .., qe..ke)), b, 1, self.kv_heads, d, self.k_norm.as_ref(), self.eps)?;
        let v = heads_first(rows.index((.., .., ke..)), b, 1, self.kv_heads, d, None, self.eps)?;
        let q = rope_dynamic(&q, d, false, self.rope_theta, 1.0, positions, None)?;
        let k = rope_dynamic(&k, d, false, self.rope_theta, 1.0, positions, None)?;
        Ok((q, k, v))
    }

    /// Attention output [b, heads, 1, d] as rows [b, 1, heads, d].
    fn rows_first(&self, o: &Array) -> Result<Array> {
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
    fn forward_grouped(
        &self,
        x: &Array,
        layer: usize,
        groups: &mut [GroupStep<'_>],
        rows_step: Option<&RowStep<'_>>,
        rotation: &Array,
        chunk: Option<(&mut (dyn KvCache + 'static), i32)>,
    ) -> Result<Array> {
        let d = self.head_dim;
        let n = x.shape()[0];
        let qkv = self.qkv.forward(x)?;
        // Every row's heads in one pass, each rotated at its own position (a chunk's rows at
        // theirs): one rotation of the queries and one of the keys a layer.
        let (q, k, v) = self.row_heads(&qkv, n, rotation)?;
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
            let (mut ks, mut vs) = if bounds.is_empty() { (vec![k.clone()], vec![v.clone()]) } else { (k.split_at_indices(&bounds, 0)?, v.split_at_indices(&bounds, 0)?) };
            let q = if n > b {
                let mut qs = q.split_at_indices(&[b], 0)?;
                chunk_qkv = Some((qs.pop().expect("two parts"), ks.pop().expect("a chunk part"), vs.pop().expect("a chunk part")));
                qs.pop().expect("two parts")
            } else {
                q.clone()
            };
            for (g, (gk, gv)) in groups.iter_mut().zip(ks.iter().zip(&vs)) {
                let kv = &mut g.kv[layer];
                kv.0 = kv.0.put_along_axis(&g.write, gk, 2)?;
                kv.1 = kv.1.put_along_axis(&g.write, gv, 2)?;
            }
            let bufs: Vec<(&Array, &Array)> = groups.iter().map(|g| (&g.kv[layer].0, &g.kv[layer].1)).collect();
            outs.push(self.rows_first(&rs.kernel.apply(&rs.plan, &q, &bufs)?)?);
        } else {
            for g in groups.iter_mut() {
                let b = g.slots;
                let span = g.offset..g.offset + b;
                let (q, k, v) = (q.index(span.clone()), k.index(span.clone()), v.index(span));
                let kv = &mut g.kv[layer];
                kv.0 = kv.0.put_along_axis(&g.write, &k, 2)?;
                kv.1 = kv.1.put_along_axis(&g.write, &v, 2)?;
                let o = match &g.attend {
                    GroupAttention::Masked(mask) => scaled_dot_product_attention(&q, &kv.0, &kv.1, self.scale, mask, None)?,
                    GroupAttention::Rows => unreachable!("a step attends through the row attention kernel whole or not at all"),
                    GroupAttention::PerRow(lens) => {
                        // Each active row over its own keys, unmasked (MLX's fused vector kernel);
                        // scratch rows get zeros.
                        let mut parts = Vec::with_capacity(lens.len() + 1);
                        for (r, &len) in lens.iter().enumerate() {
                            let r = r as i32;
                            let (k, v) = (kv.0.index((r..r + 1, .., ..len, ..)), kv.1.index((r..r + 1, .., ..len, ..)));
                            parts.push(scaled_dot_product_attention(&q.index(r..r + 1), &k, &v, self.scale, None, None)?);
                        }
                        let n = lens.len() as i32;
                        if n < b {
                            parts.push(mlx_rs::ops::zeros_dtype(&[b - n, self.heads, 1, d], q.dtype())?);
                        }
                        if parts.len() == 1 { parts.pop().expect("one") } else { concatenate(&parts, 0)? }
                    }
                };
                outs.push(self.rows_first(&o)?);
            }
        }
        if let Some((cache, t)) = chunk {
            // The chunk's keys and values into its sequence's cache (as one sequence [1, heads,
            // t, d], views of the rows' heads); its queries attend there through our kernel
            // (rows in, rows out) where the cache lays its buffers out for it, else through
            // MLX's. Its output, as rows [t, 1, heads, d], is laid out by the concatenation.
            let rows = |a: &Array| if t == n { a.clone() } else { a.index(n - t..) };
            let seq = |a: &Array| a.transpose_axes(&[2, 1, 0, 3]);
            let (cq, ck, cv) = match chunk_qkv.take() {
                Some(parts) => parts,
                None => (rows(&q), rows(&k), rows(&v)),
            };
            let (keys, values, mask) = cache.update(&seq(&ck)?, &seq(&cv)?)?;
            let o = self.attend(&seq(&cq)?, &keys, &values, &mask)?.transpose_axes(&[2, 0, 1, 3])?;
            outs.push(o);
        }
        let o = if outs.len() == 1 { outs.pop().unwrap() } else { concatenate(&outs, 0)? };
        self.o.forward(&o.reshape(&[n, 1, self.heads * d])?)
    }
}

impl Mlp {
    fn forward(&self, x: &Array) -> Result<Array> {
        let gu = self.gate_up.forward(x)?;
        let g = gu.index((.., .., ..self.intermediate));
        let u = gu.index((.., .., self.intermediate..));
        self.down.forward(&swiglu(&g, &u)?)
    }
}

impl Model {
    /// Builds the model from weights named as in Hugging Face checkpoints.
    pub fn load(config: ModelConfig, mut w: Weights) -> Result<Self> {
        let c = &config;
        let opts = arch::options(c.arch);
        let embed = w.take("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let (h, f) = (c.hidden_size, c.intermediate_size);
            layers.push(Layer {
                input_norm: w.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn: Attention::load(&mut w, &format!("{p}.self_attn"), c, opts)?,
                post_norm: w.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp: Mlp {
                    gate_up: Linear::load_fused(
                        &mut w,
                        &[(format!("{p}.mlp.gate_proj"), f), (format!("{p}.mlp.up_proj"), f)],
                        h,
                        false,
                    )?,
                    intermediate: f as i32,
                    down: Linear::load(&mut w, &format!("{p}.mlp.down_proj"), h, f, false)?,
                },
            });
        }
        let norm = w.take("model.norm.weight", &[c.hidden_size])?;
        let lm_head_t = if c.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.take("lm_head.weight", &[c.vocab_size, c.hidden_size])?.t())
        };
        let dtype = w.dtype();
        let chunk_grid = if crate::on_gpu() && config.sliding_window.is_none() { GPU_CHUNK_GRID } else { 1 };
        let scale = layers.first().map_or(1.0, |l| l.attn.scale);
        let row_attention = RowAttention::new(c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32, scale, dtype);
        let model = Model { config, embed, layers, norm, lm_head_t, dtype, chunk_grid, row_attention };
        mlx_rs::transforms::eval(model.parameters())?;
        Ok(model)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut p = vec![&self.embed, &self.norm];
        if let Some(h) = &self.lm_head_t {
            p.push(h);
        }
        for l in &self.layers {
            p.extend([&l.input_norm, &l.post_norm]);
            let a = &l.attn;
            for lin in [&a.qkv, &a.o, &l.mlp.gate_up, &l.mlp.down] {
                p.push(&lin.weight_t);
                p.extend(lin.bias.as_ref());
            }
            p.extend(a.q_norm.as_ref());
            p.extend(a.k_norm.as_ref());
        }
        p
    }

    /// Bytes of weights held on the device.
    pub fn weight_bytes(&self) -> usize {
        self.parameters().iter().map(|a| a.nbytes()).sum()
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Prefill chunks end on multiples of this many positions: a chunk that would end between
    /// two is padded with copies of its last token, run, and its cache rewound past the
    /// padding (the padding's keys are overwritten by the tokens that follow). A GPU plans its
    /// fused attention once per shape (40-70 ms each on an H200), and a chunk's shape is its
    /// length and where it ends: on the grid, a prompt's chunks reuse a few shapes instead of
    /// planning a new one for every prompt length. 1 (no padding) on a CPU, where padding is
    /// pure extra work, and for sliding-window caches, which cannot rewind.
    pub fn chunk_grid(&self) -> usize {
        self.chunk_grid
    }

    /// The same model with another chunk grid (tests check padding on a CPU with it).
    pub fn with_chunk_grid(mut self, grid: usize) -> Self {
        self.chunk_grid = if self.config.sliding_window.is_none() { grid.max(1) } else { 1 };
        self
    }

    /// The same model attending through MLX's attention throughout (decode batches masked)
    /// even where the row attention kernel would run (tests compare the two).
    pub fn with_masked_decode_attention(mut self) -> Self {
        self.row_attention = None;
        self
    }

    /// Whether decode batches attend through the row attention kernel.
    pub fn uses_row_attention(&self) -> bool {
        self.row_attention.is_some()
    }

    /// Shrinks the chunk grid to divide every one of `chunk_sizes`, so that chunks of those
    /// sizes started on the grid end on it without padding.
    pub fn fit_chunk_grid(&mut self, chunk_sizes: &[usize]) {
        fn gcd(a: usize, b: usize) -> usize {
            if b == 0 { a } else { gcd(b, a % b) }
        }
        self.chunk_grid = chunk_sizes.iter().fold(self.chunk_grid, |g, &n| gcd(g, n)).max(1);
    }

    /// How many padding tokens a chunk of `len` tokens written from position `offset` needs
    /// to end on the grid.
    fn chunk_padding(&self, offset: usize, len: usize) -> usize {
        if len < 2 {
            return 0;
        }
        (offset + len).div_ceil(self.chunk_grid) * self.chunk_grid - (offset + len)
    }

    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> SequenceCache {
        let layers = (0..self.config.num_layers)
            .map(|_| -> Box<dyn KvCache> {
                match self.config.sliding_window {
                    Some(w) => Box::new(RotatingCache::new(w)),
                    None => Box::new(StandardCache::new(CACHE_STEP)),
                }
            })
            .collect();
        SequenceCache { layers }
    }

    /// A cache holding the first `n` positions of `kv` (per layer [1, kv_heads, >=n, head_dim]),
    /// copied, with room for `capacity` tokens: a prefix-cache hit resumes prefill at position
    /// `n` of a prompt of `capacity` tokens.
    pub fn cache_from_prefix(&self, kv: &[(Array, Array)], n: usize, capacity: usize) -> Result<SequenceCache> {
        if kv.len() != self.config.num_layers {
            return Err(crate::EngineError::InvalidRequest(format!("a prefix of {} layers for a model of {}", kv.len(), self.config.num_layers)));
        }
        let layers = kv
            .iter()
            .map(|(k, v)| -> Result<Box<dyn KvCache>> {
                Ok(match self.config.sliding_window {
                    Some(w) => Box::new(RotatingCache::with_prefix(w, k, v, n)?),
                    None => Box::new(StandardCache::with_prefix(CACHE_STEP, k, v, n, capacity)?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SequenceCache { layers })
    }

    /// An empty decode batch for this model, or None for sliding-window models (their caches
    /// decode per sequence).
    pub fn new_decode_batch(&self) -> Option<DecodeBatch> {
        let c = &self.config;
        c.sliding_window.is_none().then(|| DecodeBatch::new(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype))
    }

    /// One decode step for every sequence of the batch: `tokens[i]` is row i's next input.
    /// Returns logits [len, 1, vocab] in the model's dtype (lazy).
    pub fn decode_batch(&self, tokens: &[u32], batch: &mut DecodeBatch) -> Result<Array> {
        self.decode_groups(&mut [(tokens, batch)])
    }

    /// One decode step over several decode batches at once (groups of sequences of similar
    /// length, so that short ones do not attend over the longest one's capacity). Weights are
    /// read once for all rows; attention runs per group. Returns logits [rows, 1, vocab], the
    /// groups' rows in order.
    pub fn decode_groups(&self, groups: &mut [(&[u32], &mut DecodeBatch)]) -> Result<Array> {
        self.step(groups, None)
    }

    /// One decode step over the groups and, with `chunk`, one prefill chunk of another sequence
    /// in the same pass: the weights are read once for both. Returns logits [rows (+1), 1,
    /// vocab]: the groups' rows in order, then (with a chunk) the chunk's last position.
    pub fn step(&self, groups: &mut [(&[u32], &mut DecodeBatch)], chunk: Option<(&[u32], &mut SequenceCache)>) -> Result<Array> {
        let layers = self.layers.len();
        Ok(self.step_inner(groups, None, chunk.map(|(tokens, cache)| ChunkStage { tokens, cache, layers: 0..layers, hidden: None }))?.0)
    }

    /// A step whose prefill chunk runs through only some of the layers (`ChunkStage`): a
    /// chunk's layers can be spread over several steps, each then carrying a part of its
    /// work. Returns the logits (the groups' rows, then the chunk's last position when this
    /// stage ends at the last layer) and, when it does not, the chunk's hidden state for the
    /// next stage. `tokens` as in `step_on_device` when given.
    pub fn step_staged(&self, groups: &mut [(&[u32], &mut DecodeBatch)], tokens: Option<&Array>, chunk: Option<ChunkStage>) -> Result<(Array, Option<Array>)> {
        self.step_inner(groups, tokens, chunk)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// A decode step whose inputs are still on the device: `tokens` [rows] int32, the groups'
    /// rows in order (the tokens the previous step chose), so the step can be queued before
    /// the previous one's results reach the host. The groups' host token slices only give the
    /// row counts. A prefill chunk (host tokens) may share the pass, as in `step`.
    pub fn step_on_device(&self, groups: &mut [(&[u32], &mut DecodeBatch)], tokens: &Array, chunk: Option<(&[u32], &mut SequenceCache)>) -> Result<Array> {
        let layers = self.layers.len();
        Ok(self.step_inner(groups, Some(tokens), chunk.map(|(tokens, cache)| ChunkStage { tokens, cache, layers: 0..layers, hidden: None }))?.0)
    }

    fn step_inner(
        &self,
        groups: &mut [(&[u32], &mut DecodeBatch)],
        device_tokens: Option<&Array>,
        chunk: Option<ChunkStage>,
    ) -> Result<(Array, Option<Array>)> {
        let mut toks: Vec<i32> = vec![];
        let mut active: Vec<i32> = vec![];
        let mut steps = Vec::with_capacity(groups.len());
        // Keys each decode slot attends over (its length after this step; scratch slots 0),
        // for the row attention kernel.
        let mut keys: Vec<usize> = vec![];
        for (tokens, batch) in groups.iter_mut() {
            let n = batch.len();
            if tokens.len() != n {
                return Err(EngineError::InvalidRequest(format!("decode: {} tokens for {n} rows", tokens.len())));
            }
            if n == 0 {
                continue;
            }
            let longest = batch.lens().iter().copied().max().unwrap_or(0);
            batch.reserve(n, longest + 1)?;
            let offset = toks.len() as i32;
            let slots = batch.slots();
            active.extend((0..n as i32).map(|r| offset + r));
            toks.extend(tokens.iter().map(|&t| t as i32));
            toks.resize(offset as usize + slots, 0);
            let positions = batch.positions();
            let write = batch.write_index(&positions)?;
            keys.extend(batch.lens().iter().map(|&l| l + 1));
            keys.resize(offset as usize + slots, 0);
            let attend = if self.row_attention.is_some() {
                GroupAttention::Rows
            } else if batch.per_row_attention() {
                GroupAttention::PerRow(batch.lens().iter().map(|&l| l as i32 + 1).collect())
            } else {
                let cap = batch.capacity() as i32;
                let keys = mlx_rs::ops::arange::<i32, i32>(None, cap, None)?.reshape(&[1, 1, 1, cap])?;
                GroupAttention::Masked(keys.lt(&positions.reshape(&[slots as i32, 1, 1, 1])?.add(Array::from_int(1))?)?)
            };
            steps.push(GroupStep { kv: &mut batch.layers[..], offset, slots: slots as i32, write, attend });
        }
        let decode_slots = toks.len();
        let decode_rows = active.len();
        let rows_step = self
            .row_attention
            .as_ref()
            .filter(|_| decode_slots > 0)
            .map(|kernel| RowStep { kernel, plan: kernel.plan(&keys), slots: decode_slots as i32 });
        // Where each row is rotated: a decode slot at its length before this step's token
        // (scratch slots 0), then, in the chunk's layers, the chunk's positions.
        let mut rotation: Vec<i32> = keys.iter().map(|&k| k.saturating_sub(1) as i32).collect();
        let mut chunk = chunk;
        let mut pad = 0;
        let n_layers = self.layers.len();
        let (range, mut hidden_in) = match chunk.as_mut() {
            Some(c) => (c.layers.clone(), c.hidden.take()),
            None => (0..0, None),
        };
        let last_stage = range.end == n_layers;
        if let Some(ChunkStage { tokens: c, cache, .. }) = &chunk {
            let (&last, _) = c.split_last().ok_or_else(|| EngineError::InvalidRequest("step: an empty prefill chunk".into()))?;
            if range.start >= range.end || range.end > n_layers || (range.start == 0) != hidden_in.is_none() {
                return Err(EngineError::InvalidRequest(format!("step: chunk stage over layers {range:?} of {n_layers}")));
            }
            if !last_stage && decode_slots == 0 {
                return Err(EngineError::InvalidRequest("step: a chunk stage short of the last layer needs decode rows".into()));
            }
            // Every layer of the stage holds the positions before the chunk.
            pad = self.chunk_padding(cache.layers[range.start].offset(), c.len());
            if range.start == 0 {
                toks.extend(c.iter().map(|&x| x as i32));
                toks.extend(std::iter::repeat_n(last as i32, pad));
            }
            if last_stage {
                active.push((decode_slots + c.len()) as i32 - 1);
            }
        }
        let t = chunk.as_ref().map_or(0, |c| (c.tokens.len() + pad) as i32);
        // The decode rows alone, for the layers outside the chunk's stage (all of them without a
        // chunk).
        let rotate_decode = (range != (0..n_layers)).then(|| Array::from_slice(&rotation, &[decode_slots as i32]));
        let rotate_all = chunk.as_ref().map(|c| {
            let off = c.cache.layers[range.start].offset() as i32;
            rotation.extend(off..off + t);
            Array::from_slice(&rotation, &[rotation.len() as i32])
        });
        if active.is_empty() {
            return Err(EngineError::InvalidRequest("decode: no rows".into()));
        }
        let x0 = match device_tokens {
            None => Array::from_slice(&toks, &[toks.len() as i32, 1]),
            Some(d) => {
                // Decode slot i takes device token k when it is the k-th active row; scratch
                // rows take the appended 0; a chunk's rows keep their host tokens.
                let zero = decode_rows as i32;
                let mut src = vec![zero; decode_slots];
                for (k, &slot) in active[..decode_rows].iter().enumerate() {
                    src[slot as usize] = k as i32;
                }
                let padded = concatenate(&[d.as_dtype(Dtype::Int32)?.reshape(&[-1])?, Array::from_slice(&[0i32], &[1])], 0)?;
                let rows = padded.take_axis(Array::from_slice(&src, &[decode_slots as i32]), 0)?;
                let rows = if toks.len() > decode_slots {
                    concatenate(&[rows, Array::from_slice(&toks[decode_slots..], &[(toks.len() - decode_slots) as i32])], 0)?
                } else {
                    rows
                };
                rows.reshape(&[toks.len() as i32, 1])?
            }
        };
        let eps = self.config.rms_norm_eps;
        // The rows: decode slots, then (in the stage's layers) the chunk's padded positions.
        let mut x = match (&hidden_in, decode_slots) {
            (Some(_), 0) => hidden_in.take().expect("matched"),
            _ => self.embed.take_axis(&x0, 0)?,
        };
        let mut hidden_out = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let in_stage = chunk.is_some() && range.contains(&li);
            if !in_stage && decode_slots == 0 {
                continue; // only the chunk's stage has rows here
            }
            if let Some(h) = hidden_in.take_if(|_| li == range.start) {
                x = concatenate(&[x, h], 0)?;
            }
            let part = chunk.as_mut().filter(|_| in_stage).map(|c| (&mut *c.cache.layers[li], t));
            let rotation = if in_stage { rotate_all.as_ref() } else { rotate_decode.as_ref() }.expect("built for these layers");
            let h = layer.attn.forward_grouped(&rms_norm(&x, Some(&layer.input_norm), eps)?, li, &mut steps, rows_step.as_ref(), rotation, part)?;
            x = x.add(&h)?;
            let h = layer.mlp.forward(&rms_norm(&x, Some(&layer.post_norm), eps)?)?;
            x = x.add(&h)?;
            if in_stage && li + 1 == range.end && !last_stage {
                hidden_out = Some(x.index(decode_slots as i32..));
                x = x.index(..decode_slots as i32);
            }
        }
        drop(steps);
        for (_, batch) in groups.iter_mut() {
            batch.advance();
        }
        if let Some(c) = chunk.as_mut() {
            for li in range.clone() {
                c.cache.layers[li].rewind(pad)?;
            }
        }
        // The output head runs over every decode slot (scratch ones too) and the chunk's last
        // position, then the active rows are picked: its shape follows the batch's slots, not
        // how many of them are in use, so the warm-up's rounds cover it (a new shape costs
        // tens of ms on a GPU the first time).
        let chunk_last = (active.len() > decode_rows).then(|| active[decode_rows]);
        let keep: Vec<i32> = (0..decode_slots as i32).chain(chunk_last).collect();
        let rows = if keep.len() as i32 == x.shape()[0] { x } else { x.take_axis(Array::from_slice(&keep, &[keep.len() as i32]), 0)? };
        let x = rms_norm(&rows, Some(&self.norm), eps)?;
        let logits = match &self.lm_head_t {
            Some(h) => x.matmul(h)?,
            None => x.matmul(self.embed.t())?,
        };
        // Active decode slots keep their index; the chunk's last position is the last row.
        let pick: Vec<i32> = active[..decode_rows].iter().copied().chain(chunk_last.map(|_| decode_slots as i32)).collect();
        let logits = if pick.len() == keep.len() { logits } else { logits.take_axis(Array::from_slice(&pick, &[pick.len() as i32]), 0)? };
        Ok((logits, hidden_out))
    }

    /// Runs `tokens` [B, T] (int32) through the model, appending to each sequence's cache.
    /// Returns logits [B, T, vocab] in the model's dtype, or [B, 1, vocab] for the last position.
    pub fn forward(&self, tokens: &Array, caches: &mut [&mut SequenceCache], last_only: bool) -> Result<Array> {
        let shape = tokens.shape();
        if shape.len() != 2 || shape[0] as usize != caches.len() || shape[1] == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "forward: tokens of shape {shape:?} for {} caches",
                caches.len()
            )));
        }
        // One sequence's chunk is padded to the grid like `step`'s (batches of sequences decode
        // one token each: nothing to pad).
        let t = shape[1];
        let pad = if caches.len() == 1 { self.chunk_padding(caches[0].offset(), t as usize) as i32 } else { 0 };
        let padded;
        let tokens = if pad > 0 {
            let last = tokens.index((.., t - 1..));
            padded = concatenate(&[tokens, &mlx_rs::ops::broadcast_to(&last, &[1, pad])?], 1)?;
            &padded
        } else {
            tokens
        };
        let eps = self.config.rms_norm_eps;
        let mut x = self.embed.take_axis(tokens, 0)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let mut per_seq: Vec<&mut (dyn KvCache + 'static)> = caches.iter_mut().map(|c| &mut *c.layers[li]).collect();
            let h = layer.attn.forward(&rms_norm(&x, Some(&layer.input_norm), eps)?, &mut per_seq)?;
            x = x.add(&h)?;
            let h = layer.mlp.forward(&rms_norm(&x, Some(&layer.post_norm), eps)?)?;
            x = x.add(&h)?;
        }
        for cache in caches.iter_mut() {
            cache.rewind(pad as usize)?;
        }
        if last_only && t + pad > 1 {
            x = x.index((.., t - 1..t, ..));
        } else if pad > 0 {
            x = x.index((.., ..t, ..));
        }
        let x = rms_norm(&x, Some(&self.norm), eps)?;
        Ok(match &self.lm_head_t {
            Some(h) => x.matmul(h)?,
            None => x.matmul(self.embed.t())?,
        })
    }
}
