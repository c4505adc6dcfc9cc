//! A chunk's KV as bytes, to travel between workers: every layer's keys then values for the
//! chunk's positions, each `[kv_heads, n, head_dim]` row-major in the model's dtype.
//!
//! Invariant: `from_bytes(to_bytes(kv), ..)` gives arrays equal to `kv` bit for bit.

use mlx_rs::{Array, Dtype};

use crate::error::Result;
use crate::EngineError;

/// What one token's KV is made of, for a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
}

impl KvLayout {
    /// Bytes of `n` positions' KV.
    pub fn bytes(&self, n: usize) -> usize {
        2 * self.layers * self.kv_heads * n * self.head_dim * self.elem_bytes()
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
        )
    }
}

/// The bytes of `layers` (one [1, kv_heads, n, head_dim] pair per layer), evaluated here.
pub fn to_bytes(layers: &[(Array, Array)]) -> Result<Vec<u8>> {
    let parts: Vec<Array> = layers
        .iter()
        .flat_map(|(k, v)| [k, v])
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

/// `n` positions' KV back from their bytes.
pub fn from_bytes(bytes: &[u8], layout: KvLayout, n: usize) -> Result<Vec<(Array, Array)>> {
    if bytes.len() != layout.bytes(n) {
        return Err(EngineError::InvalidRequest(format!(
            "{} bytes of KV for {n} positions, which take {}",
            bytes.len(),
            layout.bytes(n)
        )));
    }
    let shape = [1, layout.kv_heads as i32, n as i32, layout.head_dim as i32];
    let each = bytes.len() / (2 * layout.layers);
    let arrays: Vec<Array> = bytes
        .chunks_exact(each.max(1))
        // SAFETY: each chunk holds exactly the bytes of `shape` in `dtype` (checked above), and
        // MLX copies them into an array of its own.
        .map(|c| unsafe {
            Array::from_raw_data(c.as_ptr() as *const std::ffi::c_void, &shape, layout.dtype)
        })
        .collect();
    Ok(arrays
        .chunks_exact(2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect())
}
