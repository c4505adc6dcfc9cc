//! llmq's product of a few rows with a dense f32 weight on a CPU: `x @ W^T` for every linear
//! layer and the output head when a step has at most `MAX_ROWS` rows (a decode step, with or
//! without a small prefill chunk), each weight row read once from memory for all of them.
//!
//! MLX's CPU matmul goes through the BLAS, which packs the whole weight into its own layout
//! for every product: for a handful of rows that is three passes over the weights where one
//! is enough.

use mlx_rs::{Array, Dtype};
use rayon::prelude::*;

/// Most rows a product takes here; more go to the BLAS, which is as fast from about here on
/// (measured on SmolLM2's products).
pub const MAX_ROWS: usize = 24;
/// Output columns per task.
const COLS_PER_TASK: usize = 64;

/// Whether [`matmul_t`] takes `x @ w^T`: `x` [..., k] f32 of 1 to `MAX_ROWS` rows, `w` [n, k]
/// f32, `k` a multiple of 8.
pub fn covers(w: &Array, x: &Array) -> bool {
    let (ws, xs) = (w.shape(), x.shape());
    if w.dtype() != Dtype::Float32 || x.dtype() != Dtype::Float32 || ws.len() != 2 || xs.is_empty()
    {
        return false;
    }
    let k = ws[1] as usize;
    let rows: usize = xs[..xs.len() - 1].iter().map(|&d| d as usize).product();
    rows > 0 && rows <= MAX_ROWS && xs[xs.len() - 1] as usize == k && k.is_multiple_of(8)
}

/// `x @ w^T` on the host, for what [`covers`] takes.
pub fn matmul_t(w: &Array, x: &Array) -> mlx_rs::error::Result<Array> {
    let (ws, xs) = (w.shape(), x.shape());
    let (n, k) = (ws[0] as usize, ws[1] as usize);
    let rows: usize = xs[..xs.len() - 1].iter().map(|&d| d as usize).product();
    let x = x.reshape(&[rows as i32, k as i32])?;
    // (Taking the slices evaluates both.)
    let (Ok(xv), Ok(wv)) = (x.try_as_slice::<f32>(), w.try_as_slice::<f32>()) else {
        return x.matmul(w.t())?.reshape(&out_shape(xs, n));
    };
    let y = product(xv, wv, rows, n, k);
    Ok(Array::from_slice(&y, &out_shape(xs, n)))
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

fn block(
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { block_avx2(x, w, rows, k, cols, out) };
    }
    block_rows(x, w, rows, k, cols, out, Portable)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
) {
    block_rows(x, w, rows, k, cols, out, avx2::Avx2)
}

/// Rows of `x` per tile.
const TILE_ROWS: usize = 4;

/// A tile's products: `C` weight rows against `R` rows of `x` (every slice k long, k a multiple
/// of 8), each step of 8 along k loading each vector once for all the tile's products (the sums
/// in registers). `next` is where the weight rows after these begin: they are fetched into the
/// cache meanwhile, so that the memory streams while the tile multiplies.
trait Tile: Copy {
    fn tile<const C: usize, const R: usize>(
        self,
        ws: [&[f32]; C],
        xs: [&[f32]; R],
        next: *const f32,
    ) -> [[f32; C]; R];
}

/// Every row of `x` against the weight rows of `cols`. Up to `TILE_ROWS` rows, one weight row
/// at a time (the rows' sums are enough independent chains to hide the multiply-add's latency);
/// more rows, two weight rows at a time, so that each load of a row of `x` serves two. A tile's
/// weight rows stay in the L1 cache while the groups of rows pass over them: each weight row
/// comes from memory once.
#[inline(always)]
fn block_rows(
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    t: impl Tile,
) {
    if rows <= TILE_ROWS {
        columns::<1>(x, w, rows, k, cols, out, t)
    } else {
        columns::<2>(x, w, rows, k, cols, out, t)
    }
}

#[inline(always)]
fn columns<const C: usize>(
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    t: impl Tile,
) {
    let width = cols.len();
    for j in (0..width).step_by(C) {
        // A last short tile repeats its last weight row (that result is dropped).
        let ws: [&[f32]; C] =
            std::array::from_fn(|c| &w[(cols.start + j + c).min(cols.end - 1) * k..][..k]);
        let next = w.as_ptr().wrapping_add((cols.start + j + C) * k);
        for r in (0..rows).step_by(TILE_ROWS) {
            let xr = |q: usize| &x[(r + q) * k..][..k];
            let mut put = |y: &[[f32; C]]| {
                for (q, yr) in y.iter().enumerate() {
                    for (c, v) in yr.iter().enumerate().take(width - j) {
                        out[(r + q) * width + j + c] = *v;
                    }
                }
            };
            match rows - r {
                1 => put(&t.tile(ws, [xr(0)], next)),
                2 => put(&t.tile(ws, [xr(0), xr(1)], next)),
                3 => put(&t.tile(ws, [xr(0), xr(1), xr(2)], next)),
                _ => put(&t.tile(ws, [xr(0), xr(1), xr(2), xr(3)], next)),
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Portable;

impl Tile for Portable {
    fn tile<const C: usize, const R: usize>(
        self,
        ws: [&[f32]; C],
        xs: [&[f32]; R],
        _next: *const f32,
    ) -> [[f32; C]; R] {
        let mut acc = [[[0.0f32; 8]; C]; R];
        for i in (0..ws[0].len()).step_by(8) {
            for (a, x) in acc.iter_mut().zip(xs) {
                for (ac, w) in a.iter_mut().zip(ws) {
                    for l in 0..8 {
                        ac[l] += x[i + l] * w[i + l];
                    }
                }
            }
        }
        acc.map(|a| a.map(|ac| ac.iter().sum()))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Tile;

    /// Made only where the CPU has AVX2 and FMA (`block_avx2`).
    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    impl Tile for Avx2 {
        #[inline(always)]
        fn tile<const C: usize, const R: usize>(
            self,
            ws: [&[f32]; C],
            xs: [&[f32]; R],
            next: *const f32,
        ) -> [[f32; C]; R] {
            // SAFETY: an Avx2 exists only on a CPU with the features.
            unsafe { tile(ws, xs, next) }
        }
    }

    /// The tile with its `C * R` sums in AVX2 registers (at most 8 of the 16).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const C: usize, const R: usize>(
        ws: [&[f32]; C],
        xs: [&[f32]; R],
        next: *const f32,
    ) -> [[f32; C]; R] {
        let k = ws[0].len();
        assert!(k.is_multiple_of(8) && ws.iter().chain(&xs).all(|s| s.len() == k));
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for i in (0..k).step_by(8) {
            if i % 16 == 0 {
                // One cache line of each next weight row (a prefetch never faults).
                for c in 0..C {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(c * k + i) as *const i8);
                }
            }
            // SAFETY: every slice holds k values and i + 8 <= k.
            let w: [__m256; C] =
                std::array::from_fn(|c| unsafe { _mm256_loadu_ps(ws[c].as_ptr().add(i)) });
            for q in 0..R {
                let x = _mm256_loadu_ps(xs[q].as_ptr().add(i));
                for c in 0..C {
                    acc[q][c] = _mm256_fmadd_ps(x, w[c], acc[q][c]);
                }
            }
        }
        let mut out = [[0.0f32; C]; R];
        for q in 0..R {
            for c in 0..C {
                let mut v = [0.0f32; 8];
                _mm256_storeu_ps(v.as_mut_ptr(), acc[q][c]);
                out[q][c] = v.iter().sum();
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_rows_equal_the_definition_and_others_are_left_to_the_blas() {
        // An odd number of columns (the last pair's short), rows in groups of 4 and not.
        let (n, k) = (71usize, 96usize);
        let mut seed = 5u64;
        let mut random = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
                })
                .collect()
        };
        let wv = random(n * k);
        let w = Array::from_slice(&wv, &[n as i32, k as i32]);
        for shape in [
            vec![1, k as i32],
            vec![3, k as i32],
            vec![2, 2, k as i32],
            vec![5, k as i32],
            vec![4, 2, k as i32],
            vec![MAX_ROWS as i32, k as i32],
        ] {
            let rows = shape[..shape.len() - 1].iter().product::<i32>() as usize;
            let xv = random(rows * k);
            let x = Array::from_slice(&xv, &shape);
            assert!(covers(&w, &x), "few rows");
            let y = matmul_t(&w, &x).unwrap();
            assert_eq!(y.shape()[..shape.len() - 1], shape[..shape.len() - 1]);
            let yv = y.as_slice::<f32>();
            for r in 0..rows {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| xv[r * k + i] as f64 * wv[c * k + i] as f64)
                        .sum();
                    assert!(
                        (yv[r * n + c] as f64 - want).abs() < 1e-4,
                        "row {r} col {c}"
                    );
                }
            }
        }
        let many = Array::from_slice(
            &random((MAX_ROWS + 1) * k),
            &[MAX_ROWS as i32 + 1, k as i32],
        );
        assert!(!covers(&w, &many), "more rows go to the BLAS");
    }

    /// The path of CPUs without AVX2 (here called directly) against the definition.
    #[test]
    fn the_portable_tiles_equal_the_definition() {
        let (n, k) = (9usize, 32usize);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0)
            .collect();
        for rows in [1, 3, 6] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let mut out = vec![0.0f32; rows * n];
            block_rows(&x, &w, rows, k, 0..n, &mut out, Portable);
            for r in 0..rows {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                        .sum();
                    assert!(
                        (out[r * n + c] as f64 - want).abs() < 1e-4,
                        "{rows} rows: row {r} col {c}"
                    );
                }
            }
        }
    }
}
