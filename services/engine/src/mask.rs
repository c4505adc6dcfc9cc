//! Token masks: rows of logits restricted to the tokens a constraint allows. Masks come from
//! the host packed 32 tokens to a word (bit `i % 32` of word `i / 32` allows token `i`), and
//! cross to the device as the words that differ from their row's default where that is
//! smaller (`Sparse`): a step uploads a few kilobytes a row, often far less. `restrict`
//! unpacks them on the device beside the logits and sets every disallowed token's logit to
//! -inf (rows that sample). For greedy rows `argmax` picks each row's best allowed token
//! directly: on a GPU in one kernel of llmq's (one read of the logits and the masks), on a CPU
//! on the host, where the logits already are.

use std::sync::OnceLock;

use mlx_rs::ops::{floor_divide, remainder, select};
use mlx_rs::{Array, Dtype};

use crate::error::{EngineError, Result};
use crate::kernels::cuda::launch::Kernel;

/// One block a row: each thread scans a stride of the vocabulary for its best allowed token
/// (the lowest index among equals, as an argmax), then the block reduces the threads' bests.
const ARGMAX_SOURCE: &str = r#"
    const int row = blockIdx.x;
    const T* l = logits + (size_t)row * VOCAB;
    const uint32_t* m = masks + (size_t)row * WORDS;
    const int none = 0x7fffffff;
    float best = 0.0f;
    int at = none;
    for (int i = threadIdx.x; i < VOCAB; i += blockDim.x) {
        if ((m[i >> 5] >> (i & 31)) & 1u) {
            const float v = static_cast<float>(l[i]);
            if (at == none || v > best) {
                best = v;
                at = i;
            }
        }
    }
    __shared__ float best_of[32];
    __shared__ int at_of[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int round = 0; round < 2; ++round) {
        for (int off = 16; off > 0; off >>= 1) {
            const float v = __shfl_down_sync(0xffffffffu, best, off);
            const int j = __shfl_down_sync(0xffffffffu, at, off);
            if (j != none && (at == none || v > best || (v == best && j < at))) {
                best = v;
                at = j;
            }
        }
        if (round == 1) {
            break;
        }
        if (lane == 0) {
            best_of[warp] = best;
            at_of[warp] = at;
        }
        __syncthreads();
        if (warp != 0) {
            return;
        }
        const bool here = lane < (int)(blockDim.x >> 5);
        best = here ? best_of[lane] : 0.0f;
        at = here ? at_of[lane] : none;
    }
    if (threadIdx.x == 0) {
        out[row] = at == none ? 0 : at;
    }
"#;

const ARGMAX_THREADS: i32 = 1024;

/// The masked argmax kernel, made once per process; None without CUDA.
fn argmax_kernel() -> Option<&'static Kernel> {
    static KERNEL: OnceLock<Option<Kernel>> = OnceLock::new();
    crate::kernels::cuda::launch::once(&KERNEL, "the masked argmax kernel", || {
        Kernel::new(
            "llmq_masked_argmax",
            &["logits", "masks"],
            &["out"],
            ARGMAX_SOURCE,
            "",
            0,
        )
    })
}

/// Each row's best allowed token (the lowest index among equals, as an argmax; 0 where the
/// mask allows none, as the kernel): `logits` and `masks` row after row. Where the logits are
/// in host memory this beats unpacking the masks through MLX's CPU operations, which would be
/// on every step's path, and it skips the words that allow nothing, most of a constraint's.
fn host_argmax(logits: &[f32], masks: &[u32], vocab: usize, words: usize) -> Vec<i32> {
    logits
        .chunks(vocab)
        .zip(masks.chunks(words))
        .map(|(row, mask)| {
            let mut best: Option<(usize, f32)> = None;
            for (w, &bits) in mask.iter().enumerate() {
                let mut left = bits;
                while left != 0 {
                    let i = w * 32 + left.trailing_zeros() as usize;
                    left &= left - 1;
                    if let Some(&v) = row.get(i) {
                        if best.is_none_or(|(_, b)| v > b) {
                            best = Some((i, v));
                        }
                    }
                }
            }
            best.map_or(0, |(i, _)| i as i32)
        })
        .collect()
}

/// Masks as the words that differ from their row's default (0, every token refused, or all
/// ones, every token allowed: whichever fewer of the row's words differ from), each with its
/// place among all rows' words.
#[derive(Debug, PartialEq)]
struct Sparse {
    defaults: Vec<u32>,
    places: Vec<i32>,
    values: Vec<u32>,
}

impl Sparse {
    /// The sparse form of `masks` (`words` a row), or None where it is not at most half the
    /// bytes of the masks themselves (a place and a value are two words).
    fn of(masks: &[u32], words: usize) -> Option<Sparse> {
        let rows = masks.len() / words.max(1);
        let mut out = Sparse {
            defaults: Vec::with_capacity(rows),
            places: vec![],
            values: vec![],
        };
        let budget = masks.len() / 4;
        for (r, row) in masks.chunks(words.max(1)).enumerate() {
            let allowing_some = row.iter().filter(|&&w| w != 0).count();
            let refusing_some = row.iter().filter(|&&w| w != u32::MAX).count();
            let default = if allowing_some <= refusing_some {
                0
            } else {
                u32::MAX
            };
            if out.places.len() + allowing_some.min(refusing_some) > budget {
                return None;
            }
            out.defaults.push(default);
            for (i, &w) in row.iter().enumerate().filter(|(_, &w)| w != default) {
                out.places.push((r * words + i) as i32);
                out.values.push(w);
            }
        }
        Some(out)
    }
}

/// Where each token's bit sits: its word and its place value within it, for a vocabulary.
pub struct MaskLayout {
    vocab: usize,
    word: Array,
    place: Array,
}

impl MaskLayout {
    pub fn new(vocab: usize) -> Self {
        let word = Array::from_iter((0..vocab).map(|i| (i / 32) as i32), &[vocab as i32]);
        let place = Array::from_iter((0..vocab).map(|i| 1u32 << (i % 32)), &[vocab as i32]);
        MaskLayout { vocab, word, place }
    }

    /// Words per row.
    pub fn words(&self) -> usize {
        self.vocab.div_ceil(32)
    }

    /// `logits` [rows, .., vocab] with every token not allowed by its row's mask at -inf;
    /// `masks`: `words()` words a row, row after row.
    pub fn restrict(&self, logits: &Array, masks: &[u32]) -> Result<Array> {
        let shape = logits.shape().to_vec();
        let packed = self.packed(logits, masks)?;
        let per_token = packed.take_axis(&self.word, 1)?;
        let bit = remainder(
            floor_divide(&per_token, &self.place)?,
            Array::from_int(2).as_dtype(Dtype::Uint32)?,
        )?;
        let allowed = bit
            .eq(Array::from_int(1).as_dtype(Dtype::Uint32)?)?
            .reshape(&shape)?;
        let floor = Array::from_f32(f32::NEG_INFINITY).as_dtype(logits.dtype())?;
        Ok(select(&allowed, logits, &floor)?)
    }

    /// Each row's greedy token among those its mask allows (int32 `[rows]`): on a GPU in llmq's
    /// kernel (lazy), elsewhere on the host once the logits are computed (see `host_argmax`).
    pub fn argmax(&self, logits: &Array, masks: &[u32]) -> Result<Array> {
        let rows = logits.shape()[0];
        let Some(kernel) = argmax_kernel() else {
            self.check(logits, masks)?;
            let tokens = host_argmax(
                &crate::model::host_f32(logits)?,
                masks,
                self.vocab,
                self.words(),
            );
            return Ok(Array::from_slice(&tokens, &[rows]));
        };
        let packed = self.packed(logits, masks)?;
        let ints = [("VOCAB", self.vocab as i32), ("WORDS", self.words() as i32)];
        let out = kernel.apply(
            &[logits, &packed],
            &[(&[rows], Dtype::Int32)],
            rows,
            ARGMAX_THREADS,
            logits.dtype(),
            &ints,
        )?;
        Ok(out.into_iter().next().expect("one output"))
    }

    /// The masks as an array [rows, words], checked against the layout and the logits' rows.
    /// Host memory reaches a GPU at a cost by the byte (more than the kernel that reads the
    /// masks takes), and most of a constraint's words are alike (every token refused, or every one allowed): where
    /// it is fewer bytes, only the words that differ from their row's commoner kind cross, with
    /// their places, and the device writes them over the rows' defaults ([`Sparse`]).
    fn packed(&self, logits: &Array, masks: &[u32]) -> Result<Array> {
        self.check(logits, masks)?;
        let (rows, words) = (logits.shape()[0], self.words() as i32);
        let Some(sparse) = Sparse::of(masks, self.words()) else {
            return Ok(Array::from_slice(masks, &[rows, words]));
        };
        let defaults = Array::from_slice(&sparse.defaults, &[rows, 1]);
        let base = mlx_rs::ops::broadcast_to(&defaults, &[rows, words])?;
        if sparse.places.is_empty() {
            return Ok(base);
        }
        let n = sparse.places.len() as i32;
        Ok(base.put_along_axis(
            Array::from_slice(&sparse.places, &[n]),
            Array::from_slice(&sparse.values, &[n]),
            None,
        )?)
    }

    /// Whether `masks` has `words()` words for each row of `logits` and the logits this layout's
    /// vocabulary.
    fn check(&self, logits: &Array, masks: &[u32]) -> Result<()> {
        let shape = logits.shape();
        let rows = shape[0];
        let vocab = *shape.last().unwrap_or(&0) as usize;
        if vocab != self.vocab || masks.len() != rows as usize * self.words() {
            return Err(EngineError::Host(format!(
                "token masks of {} words for {rows} rows of {vocab} logits (expected {} words a row of {})",
                masks.len(),
                self.words(),
                self.vocab
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::host_f32;

    #[test]
    fn only_the_allowed_tokens_keep_their_logits() {
        let vocab = 70;
        let layout = MaskLayout::new(vocab);
        assert_eq!(layout.words(), 3);
        let logits = Array::from_iter((0..2 * vocab).map(|i| i as f32), &[2, 1, vocab as i32]);
        // Row 0 allows tokens 0, 31, 32 and 69; row 1 allows everything.
        let masks = [1 | 1 << 31, 1, 1 << 5, u32::MAX, u32::MAX, u32::MAX];
        let out = host_f32(&layout.restrict(&logits, &masks).unwrap()).unwrap();
        for (i, v) in out.iter().enumerate() {
            let (row, tok) = (i / vocab, i % vocab);
            let allowed = row == 1 || [0, 31, 32, 69].contains(&tok);
            assert_eq!(v.is_finite(), allowed, "row {row} token {tok}");
            if allowed {
                assert_eq!(*v, i as f32);
            }
        }
        assert!(
            layout.restrict(&logits, &masks[..3]).is_err(),
            "too few words"
        );
    }

    /// The masks as the device sees them, read back.
    fn uploaded(layout: &MaskLayout, rows: usize, masks: &[u32]) -> Vec<u32> {
        let logits = Array::zeros::<f32>(&[rows as i32, 1, layout.vocab as i32]).unwrap();
        let packed = layout.packed(&logits, masks).unwrap();
        assert_eq!(packed.shape(), &[rows as i32, layout.words() as i32]);
        // A row-major copy (the kernel takes its inputs so; a broadcast default is a view).
        let flat = packed.reshape(&[-1]).unwrap();
        flat.eval().unwrap();
        flat.as_slice::<u32>().to_vec()
    }

    #[test]
    fn masks_cross_as_the_words_that_differ_from_their_rows_default() {
        let (vocab, words) = (32 * 16, 16);
        let layout = MaskLayout::new(vocab);
        // Row 0 allows a few tokens (two words), row 1 all but a few (one word), row 2 all.
        let mut masks = vec![0u32; 3 * words];
        masks[3] = 1 << 7;
        masks[9] = u32::MAX;
        masks[words..2 * words].fill(u32::MAX);
        masks[words + 5] = !(1 << 2);
        masks[2 * words..].fill(u32::MAX);
        let sparse = Sparse::of(&masks, words).expect("sparse");
        assert_eq!(
            sparse,
            Sparse {
                defaults: vec![0, u32::MAX, u32::MAX],
                places: vec![3, 9, 21],
                values: vec![1 << 7, u32::MAX, !(1 << 2)]
            }
        );
        assert_eq!(uploaded(&layout, 3, &masks), masks);
        // Every row at its default: nothing but the defaults crosses.
        let plain: Vec<u32> = (0..2 * words)
            .map(|i| if i < words { 0 } else { u32::MAX })
            .collect();
        assert_eq!(
            Sparse::of(&plain, words).expect("sparse").places,
            Vec::<i32>::new()
        );
        assert_eq!(uploaded(&layout, 2, &plain), plain);
        // Words that all differ: the masks cross whole.
        let mixed: Vec<u32> = (0..2 * words as u32)
            .map(|i| i.wrapping_mul(2654435761) | 1)
            .collect();
        assert!(Sparse::of(&mixed, words).is_none());
        assert_eq!(uploaded(&layout, 2, &mixed), mixed);
    }
}
