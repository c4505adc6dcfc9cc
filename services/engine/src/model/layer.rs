//! A decoder layer: its mixer (attention, LFM2's short convolution or a gated DeltaNet), its feed-forward part
//! (a dense MLP or experts), the norms around them, and how a layer is loaded from a
//! checkpoint's names. The building blocks are in [`super::parts`].

use mlx_rs::fast::rms_norm;
use mlx_rs::Array;

use llmq_text::config::ModelConfig;

use super::attention::Attention;
use super::conv::ShortConv;
use super::delta::DeltaNet;
use super::moe::Experts;
use super::parts::{norm_weight, Mlp};
use crate::arch::ArchOptions;
use crate::error::Result;
use crate::weights::Weights;

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

/// How a layer mixes positions.
pub(super) enum Mixer {
    Attention(Attention),
    Conv(ShortConv),
    Delta(DeltaNet),
}

pub(super) struct Layer {
    pub(super) input_norm: Array,
    pub(super) mixer: Mixer,
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
        let plus_one = c.arch.norms_add_one();
        let p = format!("model.layers.{i}");
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let norm = |w: &mut Weights, name: &str| {
            norm_weight(w, &format!("{p}.{name}.weight"), h, plus_one)
        };
        let names = opts.names;
        let input_norm = norm(w, names.input_norm)?;
        let mixer = match (c.conv_at(i), c.delta_at(i)) {
            (Some(conv), _) => Mixer::Conv(ShortConv::load(w, &p, c, conv)?),
            (_, Some(d)) => Mixer::Delta(DeltaNet::load(w, &p, c, d)?),
            _ => Mixer::Attention(Attention::load(w, &format!("{p}.self_attn"), c, opts)?),
        };
        let (attn_out_norm, mlp_norm, mlp_out_norm) = if gemma {
            (
                Some(norm(w, "post_attention_layernorm")?),
                norm(w, "pre_feedforward_layernorm")?,
                Some(norm(w, "post_feedforward_layernorm")?),
            )
        } else {
            (None, norm(w, names.mlp_norm)?, None)
        };
        let mlp = match c.moe.as_ref().filter(|m| m.sparse_layers[i]) {
            Some(m) => FeedForward::Experts(Box::new(Experts::load(w, &p, h, m)?)),
            None => FeedForward::Dense(Mlp::load(
                w,
                &format!("{p}.{}", names.mlp),
                h,
                f,
                opts.fused,
                names,
                gemma,
            )?),
        };
        let rope = usize::from(c.rope_local.is_some() && c.window(i).is_some());
        Ok(Layer {
            input_norm,
            mixer,
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
        match &self.mixer {
            Mixer::Attention(a) => {
                p.extend(a.qkv.parameters());
                p.extend(a.o.parameters());
                p.extend(a.q_norm.as_ref());
                p.extend(a.k_norm.as_ref());
            }
            Mixer::Conv(c) => p.extend(c.parameters()),
            Mixer::Delta(d) => p.extend(d.parameters()),
        }
        p.extend(self.mlp.parameters());
        p
    }

    /// `x` plus the mixer's output `h` (attention's or the convolution's; normed first where the
    /// arch says).
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
