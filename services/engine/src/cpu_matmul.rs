//! llmq's product of a few rows with a dense f32 weight on a CPU: `x @ W^T` for the decode
//! step's rows, each weight row read once from memory for all of them.
//!
//! MLX's CPU matmul goes through the BLAS, which packs the whole weight into its own layout
//! for every product: for a handful of rows that is three passes over the weights where one
//! is enough (SmolLM2's 538 MB of f32 weights a step).

use mlx_rs::{Array, Dtype};
use rayon::prelude::*;

use crate::cpu_attention::madd;

/// Most rows a product takes here; more go to the BLAS (at 8 rows this loop took twice the
/// BLAS's time).
pub const MAX_ROWS: usize = 4;
/// Output columns per task.
const COLS_PER_TASK: usize = 64;

/// `x @ w^T` for `x` [..., k] f32 of at most `MAX_ROWS` rows and `w` [n, k] f32, on the host;
/// None where this does not apply (then the caller's own product).
pub fn matmul_t(w: &Array, x: &Array) -> Option<mlx_rs::error::Result<Array>> {
    static ON_CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let (ws, xs) = (w.shape(), x.shape());
    if !*ON_CPU.get_or_init(|| !crate::on_gpu()) || w.dtype() != Dtype::Float32 || x.dtype() != Dtype::Float32 || ws.len() != 2 || xs.is_empty() {
        return None;
    }
    let (n, k) = (ws[0] as usize, ws[1] as usize);
    let rows: usize = xs[..xs.len() - 1].iter().map(|&d| d as usize).product();
    if rows == 0 || rows > MAX_ROWS || xs[xs.len() - 1] as usize != k || k % 8 != 0 {
        return None;
    }
    Some((|| {
        let x = x.reshape(&[rows as i32, k as i32])?;
        // (Taking the slices evaluates both.)
        let (Ok(xv), Ok(wv)) = (x.try_as_slice::<f32>(), w.try_as_slice::<f32>()) else {
            return Ok(x.matmul(w.t())?.reshape(&out_shape(xs, n))?);
        };
        let y = product(xv, wv, rows, n, k);
        Ok(Array::from_slice(&y, &out_shape(xs, n)))
    })())
}

fn out_shape(xs: &[i32], n: usize) -> Vec<i32> {
    let mut s = xs.to_vec();
    *s.last_mut().expect("not empty") = n as i32;
    s
}

/// y [rows, n] = x [rows, k] @ w [n, k]^T, tasks over blocks of output columns.
fn product(x: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
    let blocks: Vec<Vec<f32>> = (0..n.div_ceil(COLS_PER_TASK))
        .into_par_iter()
        .map(|b| {
            let cols = b * COLS_PER_TASK..((b + 1) * COLS_PER_TASK).min(n);
            let mut out = vec![0.0f32; rows * cols.len()];
            block(x, w, rows, k, cols, &mut out);
            out
        })
        .collect();
    let mut y = vec![0.0f32; rows * n];
    for (b, out) in blocks.iter().enumerate() {
        let c0 = b * COLS_PER_TASK;
        let width = out.len() / rows;
        for r in 0..rows {
            y[r * n + c0..][..width].copy_from_slice(&out[r * width..][..width]);
        }
    }
    y
}

fn block(x: &[f32], w: &[f32], rows: usize, k: usize, cols: std::ops::Range<usize>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { block_avx2(x, w, rows, k, cols, out) };
    }
    block_rows::<false>(x, w, rows, k, cols, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(x: &[f32], w: &[f32], rows: usize, k: usize, cols: std::ops::Range<usize>, out: &mut [f32]) {
    block_rows::<true>(x, w, rows, k, cols, out)
}

/// Each weight row of `cols` against every row of `x` (at most `MAX_ROWS`): a weight vector
/// loaded once for all the rows' accumulators.
#[inline(always)]
fn block_rows<const FMA: bool>(x: &[f32], w: &[f32], rows: usize, k: usize, cols: std::ops::Range<usize>, out: &mut [f32]) {
    let width = cols.len();
    for (j, c) in cols.enumerate() {
        let mut acc = [[0.0f32; 8]; MAX_ROWS];
        for (i, wv) in w[c * k..][..k].chunks_exact(8).enumerate() {
            for (q, a) in acc.iter_mut().enumerate().take(rows) {
                let xv = &x[q * k + i * 8..][..8];
                for l in 0..8 {
                    a[l] = madd::<FMA>(xv[l], wv[l], a[l]);
                }
            }
        }
        for (q, a) in acc.iter().enumerate().take(rows) {
            out[q * width + j] = a.iter().sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_rows_equal_the_definition_and_others_are_left_to_the_blas() {
        let (n, k) = (70usize, 96usize);
        let mut seed = 5u64;
        let mut random = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
                })
                .collect()
        };
        let wv = random(n * k);
        let w = Array::from_slice(&wv, &[n as i32, k as i32]);
        for shape in [vec![1, k as i32], vec![3, k as i32], vec![2, 2, k as i32]] {
            let rows = shape[..shape.len() - 1].iter().product::<i32>() as usize;
            let xv = random(rows * k);
            let x = Array::from_slice(&xv, &shape);
            let y = matmul_t(&w, &x).expect("few rows").unwrap();
            assert_eq!(y.shape()[..shape.len() - 1], shape[..shape.len() - 1]);
            let yv = y.as_slice::<f32>();
            for r in 0..rows {
                for c in 0..n {
                    let want: f64 = (0..k).map(|i| xv[r * k + i] as f64 * wv[c * k + i] as f64).sum();
                    assert!((yv[r * n + c] as f64 - want).abs() < 1e-4, "row {r} col {c}");
                }
            }
        }
        let many = Array::from_slice(&random(5 * k), &[5, k as i32]);
        assert!(matmul_t(&w, &many).is_none(), "five rows go to the BLAS");
    }
}
