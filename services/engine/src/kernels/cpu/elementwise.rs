//! llmq's gated activation of an MLP on a CPU: `act(gate) * up` over a fused gate-and-up
//! product, SiLU (SwiGLU) or GELU's tanh form (GeGLU), and the `exp` it and the CPU attention
//! share.
//!
//! MLX's CPU build compiles such element-wise graphs at run time for one element at a time,
//! its `exp` through libm's `fmaf`: a sizeable part of a chunk's share of a layer
//! (BENCHMARKS.md, "An MLP's gated activation on the CPU"). Here `e^x` is plain arithmetic the compiler vectorizes (with AVX2
//! and FMA where the CPU has them), for `x <= 0` only, which is all a sigmoid or a tanh needs:
//! each is written over `e^-|x|`.

use mlx_rs::{Array, Dtype};
use rayon::prelude::*;

/// Gates per task (smaller products, a decode step's, run on the calling thread).
const PER_TASK: usize = 16 * 1024;

/// Whether [`gated`] takes `gu`: f32, `2 size` wide.
pub fn covers(gu: &Array, size: usize) -> bool {
    gu.dtype() == Dtype::Float32
        && size > 0
        && gu.shape().last().map(|&d| d as usize) == Some(2 * size)
}

/// `act(gu[.., :size]) * gu[.., size:]` for `gu` [..., 2 size] in f32, on the host (as
/// [`covers`] takes).
pub fn gated(gu: &Array, size: usize, gelu: bool) -> mlx_rs::error::Result<Array> {
    let shape = gu.shape();
    {
        let gu = gu.contiguous()?;
        let Ok(values) = gu.try_as_slice::<f32>() else {
            return Err(mlx_rs::error::Exception::custom(
                "the gate-and-up product could not be read on the host",
            ));
        };
        let mut out = vec![0.0f32; values.len() / 2];
        if out.len() <= PER_TASK {
            rows(values, size, gelu, &mut out);
        } else {
            let per = PER_TASK.div_ceil(size) * size;
            out.par_chunks_mut(per)
                .zip(values.par_chunks(2 * per))
                .for_each(|(o, v)| rows(v, size, gelu, o));
        }
        let mut out_shape = shape.to_vec();
        *out_shape.last_mut().expect("not empty") = size as i32;
        Ok(Array::from_slice(&out, &out_shape))
    }
}

/// Whole rows of `gu` (gate then up, `size` each) into `out` (`size` a row).
fn rows(gu: &[f32], size: usize, gelu: bool, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { rows_avx2(gu, size, gelu, out) };
    }
    rows_plain(gu, size, gelu, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(gu: &[f32], size: usize, gelu: bool, out: &mut [f32]) {
    rows_plain(gu, size, gelu, out)
}

#[inline(always)]
fn rows_plain(gu: &[f32], size: usize, gelu: bool, out: &mut [f32]) {
    for (o, row) in out.chunks_exact_mut(size).zip(gu.chunks_exact(2 * size)) {
        let (g, u) = row.split_at(size);
        if gelu {
            o.iter_mut()
                .zip(g)
                .zip(u)
                .for_each(|((o, &g), &u)| *o = gelu_tanh(g) * u);
        } else {
            o.iter_mut()
                .zip(g)
                .zip(u)
                .for_each(|((o, &g), &u)| *o = silu(g) * u);
        }
    }
}

/// `x * sigmoid(x)`, the sigmoid over `e = e^-|x|`: `1 / (1 + e)` for `x >= 0`, `e / (1 + e)`
/// below (no cancellation for large negative `x`).
#[inline(always)]
fn silu(x: f32) -> f32 {
    let e = exp_le0(-x.abs());
    let r = 1.0 / (1.0 + e);
    x * if x >= 0.0 { r } else { e * r }
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, the tanh over `e = e^-2|y|`:
/// `(1 - e) / (1 + e)` with `y`'s sign.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let e = exp_le0(-2.0 * y.abs());
    let t = (1.0 - e) / (1.0 + e);
    0.5 * x * (1.0 + if y >= 0.0 { t } else { -t })
}

/// `e^x` for `x <= 0` (and -inf: 0) in arithmetic the compiler vectorizes: `2^(x log2 e)`
/// split into a whole power, set in the float's exponent bits, and a fraction in
/// [-0.5, 0.5], a degree-6 polynomial. Relative error: below 1e-6 (a few ulps) down to -10,
/// growing with `|x|` (f32's rounding of `x log2 e`) to 1e-5 at -87; 0 below `2^-126`.
#[inline(always)]
pub(crate) fn exp_le0(x: f32) -> f32 {
    const C: [f32; 7] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
    ];
    let t = (x * std::f32::consts::LOG2_E).max(-127.0);
    let whole = (t + 0.5).floor();
    let f = t - whole;
    let p = C[0] + f * (C[1] + f * (C[2] + f * (C[3] + f * (C[4] + f * (C[5] + f * C[6])))));
    // whole is in [-127, 0]: -127 gives the bits of 0.
    let bits = ((whole as i32 + 127).max(0) as u32) << 23;
    p * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_the_standard_library() {
        let (mut near, mut far): (f32, f32) = (0.0, 0.0);
        for i in 0..=200_000 {
            let x = -(i as f32) * 0.0005;
            let (a, b) = (exp_le0(x), x.exp());
            let rel = ((a - b) / b).abs();
            if x >= -10.0 {
                near = near.max(rel);
            } else if b > 1e-30 {
                far = far.max(rel);
            }
        }
        assert!(near < 1e-6 && far < 1e-5, "relative error {near}, {far}");
        assert_eq!(exp_le0(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_le0(-200.0), 0.0);
        assert_eq!(exp_le0(0.0), 1.0);
    }

    #[test]
    fn gated_activations_match_their_definitions() {
        let xs: Vec<f32> = (-4000..=4000)
            .map(|i| i as f32 * 0.01)
            .chain([-120.0, -88.0, 88.0, 120.0])
            .collect();
        for &x in &xs {
            let (x64, ulp) = (x as f64, 1e-6 * (1.0 + (x as f64).abs()));
            let silu64 = x64 / (1.0 + (-x64).exp());
            let y = (2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3));
            let gelu64 = 0.5 * x64 * (1.0 + y.tanh());
            assert!(
                (silu(x) as f64 - silu64).abs() <= ulp,
                "silu({x}) = {} against {silu64}",
                silu(x)
            );
            assert!(
                (gelu_tanh(x) as f64 - gelu64).abs() <= ulp,
                "gelu({x}) = {} against {gelu64}",
                gelu_tanh(x)
            );
        }
        // Rows of [gate | up]: act(gate) * up, row by row, on the calling thread and in tasks.
        for (n, size) in [(3usize, 5usize), (64, 576)] {
            let gu: Vec<f32> = (0..n * 2 * size)
                .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
                .collect();
            let arr = Array::from_slice(&gu, &[1, n as i32, 2 * size as i32]);
            for gelu in [false, true] {
                assert!(covers(&arr, size));
                let out = gated(&arr, size, gelu).unwrap();
                assert_eq!(out.shape(), &[1, n as i32, size as i32]);
                let got = out.try_as_slice::<f32>().unwrap();
                for r in 0..n {
                    for j in 0..size {
                        let (g, u) = (gu[r * 2 * size + j], gu[r * 2 * size + size + j]);
                        let want = if gelu { gelu_tanh(g) } else { silu(g) } * u;
                        assert_eq!(got[r * size + j], want, "row {r}, gate {j}");
                    }
                }
            }
        }
        assert!(
            !covers(&Array::from_slice(&[1.0f32; 6], &[1, 6]), 2),
            "not 2 x size wide"
        );
    }
}
