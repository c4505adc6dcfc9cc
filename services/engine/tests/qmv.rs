//! The quantized matmul kernel for a few rows (NVIDIA GPUs only) against MLX's dequantization
//! followed by a product on the host in f64, an independent path: random weights quantized by MLX at
//! 2, 4 and 8 bits in groups of 32, 64 and 128, inputs of 1 to 8 rows (with a leading batch
//! shape), in bf16 and f32, output rows not a multiple of the block's.
//!
//! These tests need CUDA: `cargo test -p llmq-engine --test qmv -- --ignored` on a GPU machine.
//! On a CPU they are skipped by `#[ignore]`.

use llmq_engine::kernels::cuda::qmv;
use llmq_engine::quant::{QTensor, QuantSpec};
use mlx_rs::{random, Array, Dtype};

fn normal(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, 1.0, &key)
        .unwrap()
        .as_dtype(dtype)
        .unwrap()
}

fn host(a: &Array) -> Vec<f32> {
    a.as_dtype(Dtype::Float32)
        .unwrap()
        .to_vec_exact::<f32>()
        .unwrap()
}

#[test]
#[ignore = "needs CUDA"]
fn kernel_matches_dequantized_matmul() {
    let (n, k) = (1000, 4096);
    for dtype in [Dtype::Bfloat16, Dtype::Float32] {
        for bits in [2, 4, 8] {
            for group in [32, 64, 128] {
                let spec = QuantSpec::new(bits, group).unwrap();
                let q = QTensor::quantize(&normal(&[n, k], dtype, 1), spec).unwrap();
                let dense = host(&q.dequantize().unwrap());
                for rows in [1, 3, 8] {
                    let x = normal(&[rows, 1, k], dtype, 2 + rows as u64);
                    assert!(qmv::covers(&q, &x) && qmv::ready(), "the kernel applies");
                    let got = qmv::matmul_t(&q, &x).unwrap();
                    assert_eq!(got.shape(), &[rows, 1, n]);
                    assert_eq!(got.dtype(), dtype);
                    // The reference on the host in f64 (MLX's f32 matmul on a GPU may round
                    // through TF32).
                    let xs = host(&x);
                    let w: Vec<f32> = (0..rows as usize * n as usize)
                        .map(|i| {
                            let (r, c) = (i / n as usize, i % n as usize);
                            let (xr, wr) = (
                                &xs[r * k as usize..][..k as usize],
                                &dense[c * k as usize..][..k as usize],
                            );
                            xr.iter()
                                .zip(wr)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>() as f32
                        })
                        .collect();
                    let g = host(&got);
                    // Sums of 4096 products of size ~1-3 (up to ~300): f32 accumulation differs
                    // by ~1e-3; bf16 output rounding by 0.4% of the value.
                    let tol = if dtype == Dtype::Bfloat16 { 1.5 } else { 1e-2 };
                    let d = g
                        .iter()
                        .zip(&w)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    assert!(d < tol, "{dtype:?} {spec} rows {rows}: max |diff| {d}");
                }
            }
        }
    }
}

/// The dequantizing kernel against the values computed on the host from the packed words.
#[test]
#[ignore = "needs CUDA"]
fn dequantize_kernel_gives_scale_times_q_plus_bias() {
    let (n, k) = (300, 1024);
    for dtype in [Dtype::Bfloat16, Dtype::Float32] {
        for bits in [2, 4, 8] {
            for group in [32, 64, 128] {
                let spec = QuantSpec::new(bits, group).unwrap();
                let q = QTensor::quantize(&normal(&[n, k], dtype, 3), spec).unwrap();
                assert!(
                    qmv::dequantize_covers(&q) && qmv::ready(),
                    "the kernel applies"
                );
                let got = qmv::dequantize(&q).unwrap();
                assert_eq!((got.shape(), got.dtype()), (&[n, k][..], dtype));
                let words =
                    q.w.as_dtype(Dtype::Uint32)
                        .unwrap()
                        .to_vec_exact::<u32>()
                        .unwrap();
                let (s, b) = (host(&q.scales), host(&q.biases));
                let values: Vec<u8> = words
                    .chunks(k as usize * bits as usize / 32)
                    .flat_map(|row| llmq_engine::quant::unpack(row, bits, k as usize))
                    .collect();
                let g = host(&got);
                for (i, &v) in values.iter().enumerate() {
                    let want = s[i / group as usize] * v as f32 + b[i / group as usize];
                    let tol = if dtype == Dtype::Bfloat16 {
                        1e-2 * want.abs() + 1e-3
                    } else {
                        1e-5 * want.abs() + 1e-6
                    };
                    assert!(
                        (g[i] - want).abs() <= tol,
                        "{dtype:?} {spec}: element {i}: {} vs {want}",
                        g[i]
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs CUDA"]
fn kernel_declines_what_it_does_not_cover() {
    let q = QTensor::quantize(
        &normal(&[64, 256], Dtype::Bfloat16, 1),
        QuantSpec::new(5, 32).unwrap(),
    )
    .unwrap();
    assert!(
        !qmv::covers(&q, &normal(&[1, 256], Dtype::Bfloat16, 2)),
        "5 bits"
    );
    let q = QTensor::quantize(
        &normal(&[64, 256], Dtype::Bfloat16, 1),
        QuantSpec::new(4, 32).unwrap(),
    )
    .unwrap();
    assert!(
        !qmv::covers(&q, &normal(&[9, 256], Dtype::Bfloat16, 2)),
        "9 rows"
    );
}
