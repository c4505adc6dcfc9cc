//! The decoder-only transformer that every supported architecture runs on.
//!
//! `forward` takes B sequences with T new tokens each and their caches: prefill is B = 1 with
//! a chunk of any size, continuing from the cache's offset; decode is T = 1 over a batch of
//! sequences at different positions. Projections and the MLP run batched; attention runs per
//! sequence against that sequence's own cache, so nothing is padded to the longest sequence.

mod attention;
mod conv;
mod delta;
mod layer;
mod moe;
mod parts;
mod rope;
mod step;

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;

use self::layer::{Layer, Mixer};
use self::parts::{norm_weight, softcap};
use self::rope::Rope;
use mlx_rs::{Array, Dtype};

use llmq_text::config::ModelConfig;

use crate::arch;
use crate::batch::{DecodeBatch, RowState};
use crate::cache::{ConvCache, KvCache, RotatingCache, SequenceCache, StandardCache};
use crate::error::{EngineError, Result};
use crate::kernels::cuda::row_attention::RowAttention;
use crate::quant::Matrix;
use crate::weights::Weights;

/// Copies an array to the host as f32, materialising views and casting first.
pub fn host_f32(a: &Array) -> Result<Vec<f32>> {
    let a = if a.dtype() == Dtype::Float32 {
        a.contiguous()?
    } else {
        a.as_dtype(Dtype::Float32)?
    };
    a.to_vec_exact::<f32>()
        .map_err(|e| EngineError::Host(e.to_string()))
}

/// Cache growth step in tokens: decode reallocates once every this many tokens.
const CACHE_STEP: usize = 256;

/// On a GPU, prefill chunks end on multiples of this many positions (see [`Model::chunk_grid`]).
pub const GPU_CHUNK_GRID: usize = 256;

pub struct Model {
    pub config: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    /// The ropes layers rotate with: one, or (Gemma 3) the global layers' then the sliding ones'.
    ropes: Vec<Rope>,
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden), rounded to the dtype).
    embed_scale: Option<Array>,
    norm: Array,
    /// None when the output projection is tied to the embedding.
    lm_head: Option<Matrix>,
    dtype: Dtype,
    chunk_grid: usize,
    /// Decode attention by row lengths (NVIDIA GPUs); None: masked attention.
    row_attention: Option<RowAttention>,
    /// On a CPU in f32 (scores not soft-capped): a sequence's attention and the decode rows'
    /// run in [`crate::kernels::cpu::attention`].
    cpu_attention: bool,
    /// What the checkpoint's weights became at load ([`Weights::summary`]).
    weights: String,
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

impl Model {
    /// Builds the model from weights named as in Hugging Face checkpoints.
    pub fn load(config: ModelConfig, mut w: Weights) -> Result<Self> {
        let c = &config;
        let opts = arch::options(c.arch);
        // mlx-lm's conversions of Qwen3.5 store the convolution's filters in its own layout
        // [channels, kernel, 1] and the norms with their 1 added.
        if let Some((l, d)) = (0..c.num_layers).find_map(|l| c.delta_at(l).map(|d| (l, d))) {
            let name = format!("model.layers.{l}.linear_attn.conv1d.weight");
            if w.shape_of(&name) == Some(vec![d.conv_channels(), d.conv_kernel, 1]) {
                w.set_norms_include_one(true);
            }
        }
        let embed = w.take_matrix("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        let gemma = c.arch.is_gemma();
        let layers = (0..c.num_layers)
            .map(|i| Layer::load(&mut w, c, i, opts))
            .collect::<Result<Vec<_>>>()?;
        let norm = norm_weight(
            &mut w,
            opts.names.final_norm,
            c.hidden_size,
            c.arch.norms_add_one(),
        )?;
        let lm_head = if c.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.take_matrix("lm_head.weight", &[c.vocab_size, c.hidden_size])?)
        };
        let dtype = w.dtype();
        let chunk_grid = if crate::device::on_gpu() && config.caches_rewind() {
            GPU_CHUNK_GRID
        } else {
            1
        };
        let attention = |l: &Layer| match &l.mixer {
            Mixer::Attention(a) => Some((a.scale, a.cpu)),
            Mixer::Conv(_) | Mixer::Delta(_) => None,
        };
        let scale = layers.iter().find_map(attention).map_or(1.0, |(s, _)| s);
        // Soft-capped scores are not what the kernel computes.
        let row_attention = RowAttention::new(
            c.num_heads as i32,
            c.num_kv_heads as i32,
            c.head_dim as i32,
            scale,
            dtype,
        )
        .filter(|_| c.attn_logit_softcap.is_none());
        let embed_scale = gemma
            .then(|| Array::from_f32((c.hidden_size as f32).sqrt()).as_dtype(dtype))
            .transpose()?;
        let mut ropes = vec![Rope::new(config.rope.clone(), config.head_dim)];
        ropes.extend(
            config
                .rope_local
                .clone()
                .map(|r| Rope::new(r, config.head_dim)),
        );
        let weights = w.summary();
        tracing::info!(source = %w.source().display(), %weights, "weights loaded");
        let cpu_attention = layers
            .iter()
            .find_map(attention)
            .is_some_and(|(_, cpu)| cpu)
            && dtype == Dtype::Float32;
        let model = Model {
            config,
            embed,
            layers,
            ropes,
            embed_scale,
            norm,
            lm_head,
            dtype,
            chunk_grid,
            row_attention,
            cpu_attention,
            weights,
        };
        mlx_rs::transforms::eval(model.parameters())?;
        Ok(model)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut p = self.embed.parameters();
        p.push(&self.norm);
        if let Some(h) = &self.lm_head {
            p.extend(h.parameters());
        }
        for l in &self.layers {
            p.extend(l.parameters());
        }
        p
    }

    /// Bytes of weights held on the device.
    pub fn weight_bytes(&self) -> usize {
        self.parameters().iter().map(|a| a.nbytes()).sum()
    }

    /// Bytes one decoded token reads, for the single-stream roofline: every weight for a dense
    /// model (as the peer's benchmark counts); for experts, only the k of each layer's experts
    /// a token runs, and not the embedding table (unless it is also the output layer).
    pub fn bytes_read_per_token(&self) -> usize {
        let expert_bytes: usize = self.layers.iter().map(|l| l.mlp.expert_bytes()).sum();
        let Some(m) = self.config.moe.as_ref().filter(|_| expert_bytes > 0) else {
            return self.weight_bytes();
        };
        let embed = if self.lm_head.is_some() {
            self.embed.nbytes()
        } else {
            0
        };
        self.weight_bytes() - embed - expert_bytes + expert_bytes * m.experts_per_token / m.experts
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// What a chunk's KV is made of, as it travels between workers (see
    /// [`crate::kv_bytes`]).
    pub fn kv_layout(&self) -> crate::kv_bytes::KvLayout {
        let c = &self.config;
        let states = if c.recurrent() {
            (0..c.num_layers).map(|l| self.state_of_layer(l)).collect()
        } else {
            vec![]
        };
        crate::kv_bytes::KvLayout {
            layers: c.attention_layers(),
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype: self.dtype,
            states,
        }
    }

    /// What the checkpoint's weights became at load, counted by kind: e.g.
    /// "169 x Q4_K (exact) -> 4-bit, groups of 32; 25 x Q6_K (requantized) -> 8-bit, groups of 32".
    pub fn weights_summary(&self) -> &str {
        &self.weights
    }

    /// Prefill chunks end on multiples of this many positions: a chunk that would end between
    /// two is padded with copies of its last token, run, and its cache rewound past the
    /// padding (the padding's keys are overwritten by the tokens that follow). A GPU plans its
    /// fused attention once per shape (tens of ms each), and a chunk's shape is its
    /// length and where it ends: on the grid, a prompt's chunks reuse a few shapes instead of
    /// planning a new one for every prompt length. 1 (no padding) on a CPU, where padding is
    /// pure extra work, and for sliding-window caches and convolution states, which cannot
    /// rewind.
    pub fn chunk_grid(&self) -> usize {
        self.chunk_grid
    }

    /// The same model with another chunk grid (tests check padding on a CPU with it).
    pub fn with_chunk_grid(mut self, grid: usize) -> Self {
        self.chunk_grid = if !self.config.caches_rewind() {
            1
        } else {
            grid.max(1)
        };
        self
    }

    /// The same model attending through MLX's attention throughout (decode batches masked,
    /// or row by row where a batch says so) even where the row attention kernel or llmq's CPU
    /// attention would run (tests compare them).
    pub fn with_masked_decode_attention(mut self) -> Self {
        self.row_attention = None;
        self.cpu_attention = false;
        self
    }

    /// Whether decode steps attend through llmq's own attention (the CUDA row kernel, or the
    /// CPU's), which reads each row's keys through its block table: rows of any lengths then
    /// share one batch at no cost to the short ones.
    pub fn reads_tables(&self) -> bool {
        self.row_attention.is_some() || self.cpu_attention
    }

    /// Whether decode batches attend through the row attention kernel.
    pub fn uses_row_attention(&self) -> bool {
        self.row_attention.is_some()
    }

    /// Shrinks the chunk grid to divide every one of `chunk_sizes`, so that chunks of those
    /// sizes started on the grid end on it without padding.
    pub fn fit_chunk_grid(&mut self, chunk_sizes: &[usize]) {
        fn gcd(a: usize, b: usize) -> usize {
            if b == 0 {
                a
            } else {
                gcd(b, a % b)
            }
        }
        self.chunk_grid = chunk_sizes
            .iter()
            .fold(self.chunk_grid, |g, &n| gcd(g, n))
            .max(1);
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
        self.new_cache_for(0)
    }

    /// A fresh, empty cache for one sequence that will hold at least `positions` (its prompt and
    /// first token): its buffers are made that large at once, not grown (and copied) on the way.
    pub fn new_cache_for(&self, positions: usize) -> SequenceCache {
        let layers = (0..self.config.num_layers)
            .map(|i| -> Box<dyn KvCache> {
                match (self.state_of_layer(i), self.config.window(i)) {
                    (Some(s), _) => Box::new(ConvCache::new(s.kernel())),
                    (_, Some(w)) => Box::new(RotatingCache::new(w)),
                    (_, None) => Box::new(StandardCache::with_room(CACHE_STEP, positions)),
                }
            })
            .collect();
        SequenceCache { layers }
    }

    /// A cache holding the first `n` positions of `kv` (per layer [1, kv_heads, >=n, head_dim]),
    /// copied, with room for `capacity` tokens: a prefix-cache hit resumes prefill at position
    /// `n` of a prompt of `capacity` tokens.
    pub fn cache_from_prefix(
        &self,
        kv: &[(Array, Array)],
        n: usize,
        capacity: usize,
    ) -> Result<SequenceCache> {
        if kv.len() != self.config.num_layers {
            return Err(crate::EngineError::InvalidRequest(format!(
                "a prefix of {} layers for a model of {}",
                kv.len(),
                self.config.num_layers
            )));
        }
        let layers = kv
            .iter()
            .enumerate()
            .map(|(i, (k, v))| -> Result<Box<dyn KvCache>> {
                Ok(match (self.state_of_layer(i), self.config.window(i)) {
                    // A state resumes only where it was taken (the prefix cache's exact-only
                    // entries): `n` is that entry's length. A DeltaNet layer's memory is the
                    // pair's second array.
                    (Some(s), _) => {
                        let memory = s.memory.map(|_| v);
                        Box::new(ConvCache::resumed(s.kernel(), k, memory, n))
                    }
                    (_, Some(w)) => Box::new(RotatingCache::with_prefix(w, k, v, n)?),
                    (_, None) => {
                        Box::new(StandardCache::with_prefix(CACHE_STEP, k, v, n, capacity)?)
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SequenceCache { layers })
    }

    /// What recurrent layer `layer` keeps per sequence (None for attention).
    fn state_of_layer(&self, layer: usize) -> Option<RowState> {
        let c = &self.config;
        match (c.conv_at(layer), c.delta_at(layer)) {
            (Some(k), _) => Some(RowState {
                keep: k.kernel as i32 - 1,
                width: c.hidden_size as i32,
                memory: None,
            }),
            (_, Some(d)) => Some(RowState {
                keep: d.conv_kernel as i32 - 1,
                width: d.conv_channels() as i32,
                memory: Some([d.value_heads as i32, d.key_dim as i32, d.value_dim as i32]),
            }),
            _ => None,
        }
    }

    /// An empty decode batch for this model (a recurrent layer's rows hold its states; a
    /// sliding-window layer's rows attend over their window), or None for soft-capped
    /// attention (which the batch's kernels do not compute: such models decode per sequence).
    pub fn new_decode_batch(&self) -> Option<DecodeBatch> {
        let c = &self.config;
        let states = (0..c.num_layers).map(|l| self.state_of_layer(l)).collect();
        let windows = (0..c.num_layers).map(|l| c.window(l)).collect();
        c.attn_logit_softcap.is_none().then(|| {
            DecodeBatch::new(
                c.num_layers,
                c.num_kv_heads,
                c.head_dim,
                self.dtype,
                states,
                windows,
            )
        })
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
    pub fn step(
        &self,
        groups: &mut [(&[u32], &mut DecodeBatch)],
        chunk: Option<(&[u32], &mut SequenceCache)>,
    ) -> Result<Array> {
        let layers = self.layers.len();
        Ok(self
            .step_inner(
                groups,
                None,
                chunk.map(|(tokens, cache)| ChunkStage {
                    tokens,
                    cache,
                    layers: 0..layers,
                    hidden: None,
                }),
            )?
            .0)
    }

    /// A step whose prefill chunk runs through only some of the layers ([`ChunkStage`]): a
    /// chunk's layers can be spread over several steps, each then carrying a part of its
    /// work. Returns the logits (the groups' rows, then the chunk's last position when this
    /// stage ends at the last layer) and, when it does not, the chunk's hidden state for the
    /// next stage. `tokens` as in `step_on_device` when given.
    pub fn step_staged(
        &self,
        groups: &mut [(&[u32], &mut DecodeBatch)],
        tokens: Option<&Array>,
        chunk: Option<ChunkStage>,
    ) -> Result<(Array, Option<Array>)> {
        self.step_inner(groups, tokens, chunk)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// A decode step whose inputs are still on the device: `tokens` `[rows]` int32, the groups'
    /// rows in order (the tokens the previous step chose), so the step can be queued before
    /// the previous one's results reach the host. The groups' host token slices only give the
    /// row counts. A prefill chunk (host tokens) may share the pass, as in `step`.
    pub fn step_on_device(
        &self,
        groups: &mut [(&[u32], &mut DecodeBatch)],
        tokens: &Array,
        chunk: Option<(&[u32], &mut SequenceCache)>,
    ) -> Result<Array> {
        let layers = self.layers.len();
        Ok(self
            .step_inner(
                groups,
                Some(tokens),
                chunk.map(|(tokens, cache)| ChunkStage {
                    tokens,
                    cache,
                    layers: 0..layers,
                    hidden: None,
                }),
            )?
            .0)
    }

    /// Runs `tokens` [B, T] (int32) through the model, appending to each sequence's cache.
    /// Returns logits [B, T, vocab] in the model's dtype, or [B, 1, vocab] for the last position.
    pub fn forward(
        &self,
        tokens: &Array,
        caches: &mut [&mut SequenceCache],
        last_only: bool,
    ) -> Result<Array> {
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
        let pad = if caches.len() == 1 {
            self.chunk_padding(caches[0].offset(), t as usize) as i32
        } else {
            0
        };
        let padded;
        let tokens = if pad > 0 {
            let last = tokens.index((.., t - 1..));
            padded = concatenate(&[tokens, &mlx_rs::ops::broadcast_to(&last, &[1, pad])?], 1)?;
            &padded
        } else {
            tokens
        };
        let eps = self.config.rms_norm_eps;
        let mut x = self.embed_tokens(tokens)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let mut per_seq: Vec<&mut (dyn KvCache + 'static)> =
                caches.iter_mut().map(|c| &mut *c.layers[li]).collect();
            let normed = rms_norm(&x, Some(&layer.input_norm), eps)?;
            let h = match &layer.mixer {
                Mixer::Attention(a) => a.forward(&normed, &self.ropes[layer.rope], &mut per_seq)?,
                Mixer::Conv(c) => c.forward(&normed, &mut per_seq)?,
                Mixer::Delta(d) => d.forward(&normed, &mut per_seq)?,
            };
            x = layer.add_attention(&x, h, eps)?;
            x = layer.add_mlp(&x, eps)?;
        }
        for cache in caches.iter_mut() {
            cache.rewind(pad as usize)?;
        }
        if last_only && t + pad > 1 {
            x = x.index((.., t - 1..t, ..));
        } else if pad > 0 {
            x = x.index((.., ..t, ..));
        }
        self.logits(&rms_norm(&x, Some(&self.norm), eps)?)
    }

    /// Token embeddings (scaled where the arch says).
    fn embed_tokens(&self, tokens: &Array) -> Result<Array> {
        let x = self.embed.rows(tokens)?;
        Ok(match &self.embed_scale {
            Some(s) => x.multiply(s)?,
            None => x,
        })
    }

    /// The output head over normed hidden states (soft-capped where the arch says).
    fn logits(&self, x: &Array) -> Result<Array> {
        let logits = self.lm_head.as_ref().unwrap_or(&self.embed).matmul_t(x)?;
        match self.config.final_logit_softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }
}
