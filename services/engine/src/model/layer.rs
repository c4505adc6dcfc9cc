//! A decoder layer's parts: projections ([`Linear`]), the feed-forward part (a dense MLP or
//! experts), the norms around attention and MLP, the activations, and how a layer is loaded
//! from a checkpoint's names.

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::concatenate;
use mlx_rs::{Array, Dtype};

use llmq_text::config::ModelConfig;

use super::attention::Attention;
use super::moe::Experts;
use crate::arch::ArchOptions;
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

/// A layer's feed-forward part: one MLP, or experts chosen per token.
pub(super) enum FeedForward {
    Dense(Mlp),
    /// Boxed: experts hold many more arrays than an MLP.
    Experts(Box<Experts>),
}

impl FeedForward {
    fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Experts(e) => e.forward(x, false),
        }
    }

    /// Bytes of experts' weights (0 for a dense MLP).
    pub(super) fn expert_bytes(&self) -> usize {
        match self {
            FeedForward::Dense(_) => 0,
            FeedForward::Experts(e) => e.expert_bytes(),
        }
    }

    fn parameters(&self) -> Vec<&Array> {
        match self {
            FeedForward::Dense(m) => m.parameters(),
            FeedForward::Experts(e) => e.parameters(),
        }
    }
}

pub(super) struct Layer {
    pub(super) input_norm: Array,
    pub(super) attn: Attention,
    /// Gemma: the attention's output is normed before the residual add.
    pub(super) attn_out_norm: Option<Array>,
    /// The norm before the MLP (Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`).
    pub(super) mlp_norm: Array,
    pub(super) mlp: FeedForward,
    /// Gemma: the MLP's output is normed before the residual add.
    pub(super) mlp_out_norm: Option<Array>,
    /// Index of the layer's rope in [`Model::ropes`].
    pub(super) rope: usize,
}

impl Layer {
    /// Loads layer `i` from weights named as in Hugging Face checkpoints.
    pub(super) fn load(
        w: &mut Weights,
        c: &ModelConfig,
        i: usize,
        opts: ArchOptions,
    ) -> Result<Self> {
        let gemma = c.arch.is_gemma();
        let p = format!("model.layers.{i}");
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let norm =
            |w: &mut Weights, name: &str| norm_weight(w, &format!("{p}.{name}.weight"), h, gemma);
        let input_norm = norm(w, "input_layernorm")?;
        let attn = Attention::load(w, &format!("{p}.self_attn"), c, opts)?;
        let (attn_out_norm, mlp_norm, mlp_out_norm) = if gemma {
            (
                Some(norm(w, "post_attention_layernorm")?),
                norm(w, "pre_feedforward_layernorm")?,
                Some(norm(w, "post_feedforward_layernorm")?),
            )
        } else {
            (None, norm(w, "post_attention_layernorm")?, None)
        };
        let mlp = match c.moe.as_ref().filter(|m| m.sparse_layers[i]) {
            Some(m) => FeedForward::Experts(Box::new(Experts::load(w, &p, h, m)?)),
            None => FeedForward::Dense(Mlp::load(w, &format!("{p}.mlp"), h, f, opts.fused, gemma)?),
        };
        let rope = usize::from(c.rope_local.is_some() && c.window(i).is_some());
        Ok(Layer {
            input_norm,
            attn,
            attn_out_norm,
            mlp_norm,
            mlp,
            mlp_out_norm,
            rope,
        })
    }

    /// Every array the layer holds.
    pub(super) fn parameters(&self) -> Vec<&Array> {
        let mut p = vec![&self.input_norm, &self.mlp_norm];
        p.extend(self.attn_out_norm.iter().chain(&self.mlp_out_norm));
        let a = &self.attn;
        p.extend(a.qkv.parameters());
        p.extend(a.o.parameters());
        p.extend(self.mlp.parameters());
        p.extend(a.q_norm.as_ref());
        p.extend(a.k_norm.as_ref());
        p
    }
    /// `x` plus the attention's output `h` (normed first where the arch says).
    pub(super) fn add_attention(&self, x: &Array, h: Array, eps: f32) -> Result<Array> {
        let h = match &self.attn_out_norm {
            Some(n) => rms_norm(&h, Some(n), eps)?,
            None => h,
        };
        Ok(x.add(&h)?)
    }

    /// `x` plus the MLP's output over the normed `x`.
    pub(super) fn add_mlp(&self, x: &Array, eps: f32) -> Result<Array> {
        let h = self.mlp.forward(&rms_norm(x, Some(&self.mlp_norm), eps)?)?;
        let h = match &self.mlp_out_norm {
            Some(n) => rms_norm(&h, Some(n), eps)?,
            None => h,
        };
        Ok(x.add(&h)?)
    }
}

impl Mlp {
    /// `{prefix}.gate_proj`, `up_proj` (or, `fused`, `gate_up_proj`) and `down_proj`, `size` wide.
    pub(super) fn load(
        w: &mut Weights,
        prefix: &str,
        hidden: usize,
        size: usize,
        fused: bool,
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
                    (format!("{prefix}.gate_proj"), size),
                    (format!("{prefix}.up_proj"), size),
                ],
                hidden,
                false,
            )?
        };
        Ok(Mlp {
            gate_up,
            intermediate: size as i32,
            down: Linear::load(w, &format!("{prefix}.down_proj"), hidden, size, false)?,
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
