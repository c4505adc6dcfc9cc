//! Rotary position embeddings on the device, for every scaling type of [`llmq_text::rope`].
//!
//! Frequencies that are the same at every position (none, linear, llama3, yarn) go through
//! MLX's fused kernel, at an offset (a sequence's chunk) or at each row's own position (a decode
//! step). Position-dependent ones (dynamic, longrope) do too while every row of the pass shares
//! its frequencies (all within the original context, or all past it); a pass that straddles the
//! switch rotates through cos/sin tables computed on the host for its positions.

use mlx_rs::fast::{rope, rope_dynamic};
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use llmq_text::rope::{RopeConfig, RopeScaling};

use crate::error::Result;

pub(crate) struct Rope {
    config: RopeConfig,
    head_dim: i32,
    /// The kernel's frequencies (MLX takes periods, 1 / inverse frequency): None for plain and
    /// linear scaling (MLX computes them from the base); for the position-dependent types,
    /// those within the original context.
    freqs: Option<Array>,
    /// Past the switch position, for the position-dependent types: None for dynamic (its
    /// frequencies change with every position there).
    freqs_after: Option<Array>,
}

/// Where a pass's rows rotate, prepared once for every layer of the pass that shares the rope.
pub(crate) struct Rotation {
    dims: i32,
    head_dim: i32,
    attention_factor: f32,
    /// MLX's base and position scale, when `freqs` is None.
    base: f32,
    scale: f32,
    freqs: Option<Array>,
    at: At,
}

enum At {
    /// A sequence's chunk [1, heads, t, d] from this position on, through the kernel.
    Offset(i32),
    /// Each row `[n, heads, 1, d]` at its own position `[n]`, through the kernel.
    Rows(Array),
    /// cos and sin [.., half] laid out to broadcast over the rows (attention factor included).
    Table(Array, Array),
}

/// How a pass lays out its rows: one sequence's chunk [1, heads, t, d], or rows [n, heads, 1, d].
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Layout {
    Sequence,
    Rows,
}

fn periods(inv_freq: &[f32]) -> Array {
    let p: Vec<f32> = inv_freq.iter().map(|f| 1.0 / f).collect();
    Array::from_slice(&p, &[p.len() as i32])
}

impl Rope {
    pub(crate) fn new(config: RopeConfig, head_dim: usize) -> Rope {
        let (freqs, freqs_after) = match &config.scaling {
            RopeScaling::None | RopeScaling::Linear { .. } => (None, None),
            RopeScaling::LongRope { original_max, .. } => (
                Some(periods(&config.inv_freq_at(0))),
                Some(periods(&config.inv_freq_at(*original_max))),
            ),
            _ => (Some(periods(&config.inv_freq_at(0))), None),
        };
        Rope {
            config,
            head_dim: head_dim as i32,
            freqs,
            freqs_after,
        }
    }

    fn rotation(&self, freqs: Option<Array>, at: At) -> Rotation {
        let c = &self.config;
        let scale = match c.scaling {
            RopeScaling::Linear { factor } => 1.0 / factor,
            _ => 1.0,
        };
        Rotation {
            dims: c.dims as i32,
            head_dim: self.head_dim,
            attention_factor: c.attention_factor(),
            base: c.theta,
            scale,
            freqs,
            at,
        }
    }

    /// The rotation of rows at `positions` (host), laid out as `layout`: a sequence's chunk
    /// (consecutive positions from the first) or one row per position.
    pub(crate) fn at(&self, positions: &[i32], layout: Layout) -> Result<Rotation> {
        let (lo, hi) = match (positions.iter().min(), positions.iter().max()) {
            (Some(&lo), Some(&hi)) => (lo as usize, hi as usize),
            _ => (0, 0),
        };
        let freqs = match self.config.switch_position() {
            None => self.freqs.clone(),
            Some(switch) if hi < switch => self.freqs.clone(),
            Some(switch) if lo >= switch && self.freqs_after.is_some() => self.freqs_after.clone(),
            Some(_) => return self.table(positions, layout),
        };
        Ok(match layout {
            Layout::Sequence => {
                self.rotation(freqs, At::Offset(positions.first().copied().unwrap_or(0)))
            }
            Layout::Rows => self.rotation(
                freqs,
                At::Rows(Array::from_slice(positions, &[positions.len() as i32])),
            ),
        })
    }

    /// A sequence's chunk of `len` tokens from `offset`.
    pub(crate) fn at_offset(&self, offset: i32, len: i32) -> Result<Rotation> {
        if self.config.switch_position().is_none() {
            return Ok(self.rotation(self.freqs.clone(), At::Offset(offset)));
        }
        let positions: Vec<i32> = (offset..offset + len).collect();
        self.at(&positions, Layout::Sequence)
    }

    fn table(&self, positions: &[i32], layout: Layout) -> Result<Rotation> {
        let half = self.config.dims / 2;
        let af = self.config.attention_factor() as f64;
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions.len() * half),
            Vec::with_capacity(positions.len() * half),
        );
        for &p in positions {
            for f in self.config.inv_freq_at(p as usize) {
                let angle = p as f64 * f as f64;
                cos.push((angle.cos() * af) as f32);
                sin.push((angle.sin() * af) as f32);
            }
        }
        let (n, h) = (positions.len() as i32, half as i32);
        let shape: &[i32] = match layout {
            Layout::Sequence => &[1, 1, n, h],
            Layout::Rows => &[n, 1, 1, h],
        };
        Ok(self.rotation(
            None,
            At::Table(
                Array::from_slice(&cos, shape),
                Array::from_slice(&sin, shape),
            ),
        ))
    }
}

impl Rotation {
    /// `x` [b, heads, t, head_dim] rotated.
    pub(crate) fn apply(&self, x: &Array) -> Result<Array> {
        let (dims, af) = (self.dims, self.attention_factor);
        // The fused kernel rotates the first `dims` dimensions; the attention factor scales
        // only those (it multiplies transformers' cos and sin).
        let scaled = || -> Result<Array> {
            if af == 1.0 {
                Ok(x.clone())
            } else if dims == self.head_dim {
                Ok(x.multiply(Array::from_f32(af))?)
            } else {
                let rot = x
                    .index((.., .., .., ..dims))
                    .multiply(Array::from_f32(af))?;
                Ok(concatenate(&[rot, x.index((.., .., .., dims..))], 3)?)
            }
        };
        let base = if self.freqs.is_some() {
            None
        } else {
            Some(self.base)
        };
        Ok(match &self.at {
            At::Offset(off) => rope(
                scaled()?,
                dims,
                false,
                base,
                self.scale,
                *off,
                self.freqs.as_ref(),
            )?,
            At::Rows(pos) => rope_dynamic(
                scaled()?,
                dims,
                false,
                base,
                self.scale,
                pos,
                self.freqs.as_ref(),
            )?,
            At::Table(cos, sin) => {
                let half = dims / 2;
                let (cos, sin) = (cos.as_dtype(x.dtype())?, sin.as_dtype(x.dtype())?);
                let x1 = x.index((.., .., .., ..half));
                let x2 = x.index((.., .., .., half..dims));
                let a = x1.multiply(&cos)?.subtract(x2.multiply(&sin)?)?;
                let b = x2.multiply(&cos)?.add(x1.multiply(&sin)?)?;
                let mut parts = vec![a, b];
                if dims < self.head_dim {
                    parts.push(x.index((.., .., .., dims..)));
                }
                concatenate(&parts, 3)?
            }
        })
    }
}
