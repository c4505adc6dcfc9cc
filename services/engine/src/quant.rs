//! Weights kept quantized on the device, in MLX's affine form: a matrix's rows are cut into
//! groups of `group_size` elements, each element an unsigned `bits`-bit integer `q`, each group
//! one scale and one bias (`w = scale * q + bias`). Products with them are [`crate::kernels`]'
//! (through the packed weights where a kernel covers the shapes), and embeddings dequantize only
//! the rows they look up, so a step reads the packed weights, not a full-precision copy.
//!
//! Three sources end here: checkpoints written by mlx-lm (already in this form), GGUF blocks that
//! are affine groups of 32 ([`llmq_text::affine`], converted without changing a value), and
//! full-precision weights quantized at load (`--quantize`).
//!
//! Packing is MLX's: a row's integers form one little-endian bit stream, element j in bits
//! [j * bits, (j + 1) * bits), stored as u32 words (a test checks it against MLX's dequantize).

use std::fmt;

use mlx_rs::ops::{concatenate, dequantize, quantize, stack};
use mlx_rs::{Array, Dtype};

use llmq_text::affine::Affine;

use crate::error::{EngineError, Result};

/// A quantized form: integer width and group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QuantSpec {
    pub bits: i32,
    pub group_size: i32,
}

impl QuantSpec {
    /// The widths and group sizes MLX's affine kernels take.
    pub const BITS: [i32; 6] = [2, 3, 4, 5, 6, 8];
    pub const GROUP_SIZES: [i32; 3] = [32, 64, 128];

    pub fn new(bits: i32, group_size: i32) -> Result<Self> {
        if !Self::BITS.contains(&bits) {
            return Err(EngineError::InvalidRequest(format!(
                "quantization bits {bits}: must be one of {:?}",
                Self::BITS
            )));
        }
        if !Self::GROUP_SIZES.contains(&group_size) {
            return Err(EngineError::InvalidRequest(format!(
                "quantization group size {group_size}: must be one of {:?}",
                Self::GROUP_SIZES
            )));
        }
        Ok(QuantSpec { bits, group_size })
    }

    /// u32 words a row of `cols` elements packs into.
    fn words(self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }
}

impl fmt::Display for QuantSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-bit, groups of {}", self.bits, self.group_size)
    }
}

/// A quantized matrix, or a stack of them ([..., rows, cols] logically): packed integers
/// [..., rows, cols * bits / 32] (u32), scales and biases [..., rows, cols / group_size].
pub struct QTensor {
    pub w: Array,
    pub scales: Array,
    pub biases: Array,
    pub spec: QuantSpec,
}

impl QTensor {
    /// Quantizes a full-precision matrix (or stack) whose rows are a multiple of the group size.
    pub fn quantize(dense: &Array, spec: QuantSpec) -> Result<Self> {
        let (w, scales, biases) = quantize(dense, spec.group_size, spec.bits)?;
        Ok(QTensor {
            w,
            scales,
            biases,
            spec,
        })
    }

    /// A [rows, cols] matrix from affine groups of 32, packed at `bits` (at least the groups'
    /// own width; wider is exact too), scales and biases in `dtype`.
    pub fn from_affine(
        a: &Affine,
        rows: usize,
        cols: usize,
        bits: i32,
        dtype: Dtype,
    ) -> Result<Self> {
        let spec = QuantSpec::new(bits.max(a.bits as i32), llmq_text::affine::GROUP as i32)?;
        let packed: Vec<u32> = a
            .values
            .chunks_exact(cols)
            .flat_map(|row| pack(row, spec.bits))
            .collect();
        let groups = (cols / spec.group_size as usize) as i32;
        let (r, c) = (rows as i32, cols as i32);
        let w = Array::from_slice(&packed, &[r, spec.words(cols) as i32]);
        let scales = Array::from_slice(&a.scales, &[r, groups]).as_dtype(dtype)?;
        let biases = Array::from_slice(&a.biases, &[r, groups]).as_dtype(dtype)?;
        debug_assert_eq!(c as usize * r as usize, a.values.len());
        Ok(QTensor {
            w,
            scales,
            biases,
            spec,
        })
    }

    /// The logical shape: the packed one with its last dimension unpacked.
    pub fn shape(&self) -> Vec<usize> {
        let mut s: Vec<usize> = self.w.shape().iter().map(|&d| d as usize).collect();
        let last = s.len() - 1;
        s[last] = s[last] * 32 / self.spec.bits as usize;
        s
    }

    pub fn dtype(&self) -> Dtype {
        self.scales.dtype()
    }

    /// Rows `idx` (any shape) dequantized: [idx..., cols]. An embedding lookup.
    pub fn rows(&self, idx: &Array) -> Result<Array> {
        let take = |a: &Array| a.take_axis(idx, 0);
        Ok(dequantize(
            take(&self.w)?,
            take(&self.scales)?,
            &take(&self.biases)?,
            self.spec.group_size,
            self.spec.bits,
        )?)
    }

    pub fn nbytes(&self) -> usize {
        self.w.nbytes() + self.scales.nbytes() + self.biases.nbytes()
    }

    pub fn parameters(&self) -> [&Array; 3] {
        [&self.w, &self.scales, &self.biases]
    }

    /// The same values packed at a wider `bits` (exact: the integers, scales and biases stay).
    fn widen(&self, bits: i32) -> Result<Self> {
        if bits == self.spec.bits {
            return Ok(QTensor {
                w: self.w.clone(),
                scales: self.scales.clone(),
                biases: self.biases.clone(),
                spec: self.spec,
            });
        }
        let spec = QuantSpec::new(bits, self.spec.group_size)?;
        let shape = self.shape();
        let cols = shape[shape.len() - 1];
        let words = self
            .w
            .as_dtype(Dtype::Uint32)?
            .to_vec_exact::<u32>()
            .map_err(|e| EngineError::Host(e.to_string()))?;
        let packed: Vec<u32> = words
            .chunks_exact(self.spec.words(cols))
            .flat_map(|row| pack(&unpack(row, self.spec.bits, cols), bits))
            .collect();
        let mut wshape: Vec<i32> = self.w.shape().to_vec();
        *wshape.last_mut().unwrap() = spec.words(cols) as i32;
        Ok(QTensor {
            w: Array::from_slice(&packed, &wshape),
            scales: self.scales.clone(),
            biases: self.biases.clone(),
            spec,
        })
    }

    /// Joins matrices (or stacks) along their rows (fused projections), or stacks them along a
    /// new leading axis (experts). Parts of different widths are widened to the widest; they must share
    /// the group size.
    pub fn join(parts: Vec<QTensor>, new_axis: bool) -> Result<Self> {
        let group_size = parts[0].spec.group_size;
        if parts.iter().any(|p| p.spec.group_size != group_size) {
            return Err(EngineError::InvalidRequest(
                "quantized parts of one projection with different group sizes".into(),
            ));
        }
        let bits = parts.iter().map(|p| p.spec.bits).max().unwrap_or(4);
        let parts = parts
            .iter()
            .map(|p| p.widen(bits))
            .collect::<Result<Vec<_>>>()?;
        let join = |f: fn(&QTensor) -> &Array| -> Result<Array> {
            let v: Vec<&Array> = parts.iter().map(f).collect();
            Ok(if new_axis {
                stack(&v, 0)?
            } else {
                concatenate(&v, -2)?
            })
        };
        Ok(QTensor {
            w: join(|p| &p.w)?,
            scales: join(|p| &p.scales)?,
            biases: join(|p| &p.biases)?,
            spec: QuantSpec { bits, group_size },
        })
    }
}

/// `values` (each below 2^bits) as MLX packs them: one little-endian bit stream in u32 words.
pub fn pack(values: &[u8], bits: i32) -> Vec<u32> {
    let bits = bits as usize;
    let mut out = vec![0u32; (values.len() * bits).div_ceil(32)];
    for (j, &v) in values.iter().enumerate() {
        let at = j * bits;
        let (word, shift) = (at / 32, at % 32);
        out[word] |= (v as u32) << shift;
        if shift + bits > 32 {
            out[word + 1] |= (v as u32) >> (32 - shift);
        }
    }
    out
}

/// The inverse of `pack`: `n` values of `bits` bits.
pub fn unpack(words: &[u32], bits: i32, n: usize) -> Vec<u8> {
    let bits = bits as usize;
    let mask = (1u64 << bits) - 1;
    (0..n)
        .map(|j| {
            let at = j * bits;
            let (word, shift) = (at / 32, at % 32);
            let lo = words[word] as u64;
            let hi = words.get(word + 1).copied().unwrap_or(0) as u64;
            (((lo | (hi << 32)) >> shift) & mask) as u8
        })
        .collect()
}

/// A weight matrix as loaded: full precision, or quantized.
pub enum Matrix {
    Dense(Array),
    Quantized(QTensor),
}

impl Matrix {
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Matrix::Dense(a) => a.shape().iter().map(|&d| d as usize).collect(),
            Matrix::Quantized(q) => q.shape(),
        }
    }

    pub fn nbytes(&self) -> usize {
        match self {
            Matrix::Dense(a) => a.nbytes(),
            Matrix::Quantized(q) => q.nbytes(),
        }
    }

    pub fn parameters(&self) -> Vec<&Array> {
        match self {
            Matrix::Dense(a) => vec![a],
            Matrix::Quantized(q) => q.parameters().to_vec(),
        }
    }

    /// Rows `idx` in full precision (an embedding lookup).
    pub fn rows(&self, idx: &Array) -> Result<Array> {
        match self {
            Matrix::Dense(a) => Ok(a.take_axis(idx, 0)?),
            Matrix::Quantized(q) => q.rows(idx),
        }
    }

    /// Joins matrices (see [`QTensor::join`]); any dense part makes the result dense.
    pub fn join(parts: Vec<Matrix>, new_axis: bool) -> Result<Self> {
        if parts.len() == 1 && !new_axis {
            return Ok(parts.into_iter().next().unwrap());
        }
        if parts.iter().all(|p| matches!(p, Matrix::Quantized(_))) {
            let q = parts.into_iter().map(|p| match p {
                Matrix::Quantized(q) => q,
                Matrix::Dense(_) => unreachable!(),
            });
            return Ok(Matrix::Quantized(QTensor::join(q.collect(), new_axis)?));
        }
        let dense = parts
            .into_iter()
            .map(Matrix::into_dense)
            .collect::<Result<Vec<_>>>()?;
        Ok(Matrix::Dense(if new_axis {
            stack(&dense, 0)?
        } else {
            concatenate(&dense, -2)?
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_and_unpack_are_inverse_for_every_width() {
        for bits in QuantSpec::BITS {
            let values: Vec<u8> = (0..96u32)
                .map(|i| ((i * 37 + 11) % (1 << bits)) as u8)
                .collect();
            assert_eq!(
                unpack(&pack(&values, bits), bits, values.len()),
                values,
                "{bits} bits"
            );
        }
    }

    /// The packing matches MLX's: MLX dequantizes what `pack` wrote to scale * q + bias.
    #[test]
    fn packing_is_mlxs() {
        for bits in QuantSpec::BITS {
            for group in QuantSpec::GROUP_SIZES {
                let (rows, cols) = (3usize, 256usize);
                let values: Vec<u8> = (0..rows * cols)
                    .map(|i| ((i * 7 + i / 5) % (1 << bits)) as u8)
                    .collect();
                let groups = rows * cols / group as usize;
                let scales: Vec<f32> = (0..groups).map(|g| 0.5 + g as f32 * 0.25).collect();
                let biases: Vec<f32> = (0..groups).map(|g| -(g as f32)).collect();
                let packed: Vec<u32> = values
                    .chunks_exact(cols)
                    .flat_map(|r| pack(r, bits))
                    .collect();
                let spec = QuantSpec::new(bits, group).unwrap();
                let q = QTensor {
                    w: Array::from_slice(&packed, &[rows as i32, spec.words(cols) as i32]),
                    scales: Array::from_slice(
                        &scales,
                        &[rows as i32, (cols / group as usize) as i32],
                    ),
                    biases: Array::from_slice(
                        &biases,
                        &[rows as i32, (cols / group as usize) as i32],
                    ),
                    spec,
                };
                let got = q.dequantize().unwrap().to_vec_exact::<f32>().unwrap();
                let want: Vec<f32> = (0..rows * cols)
                    .map(|i| {
                        scales[i / group as usize] * values[i] as f32 + biases[i / group as usize]
                    })
                    .collect();
                assert_eq!(got, want, "{bits} bits, groups of {group}");
                assert_eq!(q.shape(), vec![rows, cols]);
            }
        }
    }

    #[test]
    fn widening_keeps_every_value() {
        let dense = Array::from_slice(
            &(0..4 * 128)
                .map(|i| ((i * 13) % 29) as f32 / 7.0 - 2.0)
                .collect::<Vec<_>>(),
            &[4, 128],
        );
        let q = QTensor::quantize(&dense, QuantSpec::new(4, 32).unwrap()).unwrap();
        let wide = q.widen(8).unwrap();
        assert_eq!(wide.spec.bits, 8);
        assert_eq!(
            q.dequantize().unwrap().to_vec_exact::<f32>().unwrap(),
            wide.dequantize().unwrap().to_vec_exact::<f32>().unwrap()
        );
    }

    #[test]
    fn unsupported_forms_are_refused() {
        assert!(QuantSpec::new(7, 64).is_err());
        assert!(QuantSpec::new(4, 16).is_err());
        assert!(QuantSpec::new(4, 64).is_ok());
    }
}
