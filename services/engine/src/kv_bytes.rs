//! A chunk's KV as bytes, to travel between workers: layer after layer, an attention layer's
//! keys then values for the chunk's positions, each `[kv_heads, n, head_dim]` row-major in the
//! model's dtype; a recurrent layer's state after the chunk, whole (the convolution's kept
//! inputs in the model's dtype, then a DeltaNet's memory in float32).
//!
//! Invariant: `from_bytes(to_bytes(kv), ..)` gives arrays equal to `kv` bit for bit.

use mlx_rs::{Array, Dtype};

use crate::batch::RowState;
use crate::error::Result;
use crate::EngineError;

/// What one token's KV, and a chunk's, are made of, for a model.
#[derive(Debug, Clone, PartialEq)]
pub struct KvLayout {
    /// Layers holding keys and values.
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    /// For a model with recurrent layers, every layer in order: None for attention, else the
    /// state a chunk carries, one sequence's (empty when every layer attends).
    pub states: Vec<Option<RowState>>,
}

impl KvLayout {
    /// Bytes of `n` positions' keys and values (states not included).
    pub fn bytes(&self, n: usize) -> usize {
        2 * self.layers * self.kv_heads * n * self.head_dim * self.elem_bytes()
    }

    /// Bytes of a chunk of `n` positions: their keys and values, and the recurrent layers'
    /// states after them (of 0 positions: one sequence's states alone).
    pub fn chunk_bytes(&self, n: usize) -> usize {
        self.bytes(n)
            + self
                .states
                .iter()
                .flatten()
                .map(|s| self.state_bytes(s))
                .sum::<usize>()
    }

    fn state_bytes(&self, s: &RowState) -> usize {
        let count = |d: [i32; 4]| d.iter().map(|&x| x as usize).product::<usize>();
        count(s.inputs_shape(1)) * self.elem_bytes() + s.memory_shape(1).map_or(0, |m| 4 * count(m))
    }

    fn elem_bytes(&self) -> usize {
        dtype_bytes(self.dtype)
    }
}

/// Bytes of one element of `dtype`.
pub(crate) fn dtype_bytes(dtype: Dtype) -> usize {
    match dtype {
        Dtype::Float32 | Dtype::Int32 | Dtype::Uint32 => 4,
        Dtype::Float64 | Dtype::Int64 | Dtype::Uint64 | Dtype::Complex64 => 8,
        Dtype::Bool | Dtype::Int8 | Dtype::Uint8 => 1,
        _ => 2,
    }
}

impl std::fmt::Display for KvLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "{} layers x {} KV heads x {} ({:?})",
            self.layers, self.kv_heads, self.head_dim, self.dtype
        )?;
        for (l, s) in self.states.iter().enumerate() {
            if let Some(s) = s {
                write!(f, "; layer {l} state {:?}", s.inputs_shape(1))?;
                if let Some(m) = s.memory_shape(1) {
                    write!(f, " + {m:?} (Float32)")?;
                }
            }
        }
        Ok(())
    }
}

/// The bytes of `layers` (a chunk's pair per layer, see [`from_bytes`]; a recurrent layer's
/// empty second array has none), evaluated here.
pub fn to_bytes(layers: &[(Array, Array)]) -> Result<Vec<u8>> {
    let parts: Vec<Array> = layers
        .iter()
        .flat_map(|(k, v)| [k, v])
        .filter(|a| a.size() > 0)
        .map(|a| a.contiguous())
        .collect::<std::result::Result<_, _>>()?;
    mlx_rs::transforms::eval(parts.iter())?;
    let mut out = Vec::with_capacity(parts.iter().map(|a| a.nbytes()).sum());
    for a in &parts {
        let bytes = a.view::<u8>()?;
        let slice = bytes
            .try_as_slice::<u8>()
            .map_err(|e| EngineError::InvalidRequest(format!("KV to bytes: {e}")))?;
        out.extend_from_slice(slice);
    }
    Ok(out)
}

/// A chunk of `n` positions back from its bytes: per layer (keys, values) [1, kv_heads, n,
/// head_dim], or a recurrent layer's state pair (its memory, or an empty array).
pub fn from_bytes(bytes: &[u8], layout: &KvLayout, n: usize) -> Result<Vec<(Array, Array)>> {
    if bytes.len() != layout.chunk_bytes(n) {
        return Err(EngineError::InvalidRequest(format!(
            "{} bytes of KV for {n} positions, which take {}",
            bytes.len(),
            layout.chunk_bytes(n)
        )));
    }
    let kv = [1, layout.kv_heads as i32, n as i32, layout.head_dim as i32];
    let layers: Vec<Option<RowState>> = if layout.states.is_empty() {
        vec![None; layout.layers]
    } else {
        layout.states.clone()
    };
    let mut rest = bytes;
    let mut take = |shape: &[i32], dtype: Dtype| -> Array {
        let len = shape.iter().map(|&d| d as usize).product::<usize>() * dtype_bytes(dtype);
        let (head, tail) = rest.split_at(len);
        rest = tail;
        // SAFETY: `head` holds exactly the bytes of `shape` in `dtype` (the total was checked
        // above and each part is cut to its own size), and MLX copies them into an array of
        // its own.
        unsafe { Array::from_raw_data(head.as_ptr() as *const std::ffi::c_void, shape, dtype) }
    };
    Ok(layers
        .iter()
        .map(|l| match l {
            None => (take(&kv, layout.dtype), take(&kv, layout.dtype)),
            Some(s) => (
                take(&s.inputs_shape(1), layout.dtype),
                s.memory_shape(1)
                    .map_or_else(crate::cache::empty, |m| take(&m, Dtype::Float32)),
            ),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hybrid chunk (attention, a convolution's state, a DeltaNet's state and memory) comes
    /// back bit for bit.
    #[test]
    fn a_chunk_with_states_comes_back_as_it_went() {
        let layout = KvLayout {
            layers: 1,
            kv_heads: 2,
            head_dim: 4,
            dtype: Dtype::Bfloat16,
            states: vec![
                None,
                Some(RowState {
                    keep: 2,
                    width: 8,
                    memory: None,
                }),
                Some(RowState {
                    keep: 3,
                    width: 6,
                    memory: Some([2, 4, 4]),
                }),
            ],
        };
        let n = 5;
        let key = mlx_rs::random::key(7).unwrap();
        let normal = |shape: &[i32], dtype: Dtype| {
            mlx_rs::random::normal::<f32>(shape, None, None, &key)
                .unwrap()
                .as_dtype(dtype)
                .unwrap()
        };
        let layers = vec![
            (
                normal(&[1, 2, n, 4], Dtype::Bfloat16),
                normal(&[1, 2, n, 4], Dtype::Bfloat16),
            ),
            (
                normal(&[1, 1, 2, 8], Dtype::Bfloat16),
                crate::cache::empty(),
            ),
            (
                normal(&[1, 1, 3, 6], Dtype::Bfloat16),
                normal(&[1, 2, 4, 4], Dtype::Float32),
            ),
        ];
        let bytes = to_bytes(&layers).unwrap();
        assert_eq!(bytes.len(), layout.chunk_bytes(n as usize));
        let back = from_bytes(&bytes, &layout, n as usize).unwrap();
        for ((a, b), (c, d)) in layers.iter().zip(&back) {
            for (x, y) in [(a, c), (b, d)] {
                assert_eq!(x.shape(), y.shape());
                assert_eq!(x.dtype(), y.dtype());
                assert!(x.size() == 0 || x.eq_values(y).unwrap());
            }
        }
        assert!(from_bytes(&bytes[1..], &layout, n as usize).is_err());
    }
}
