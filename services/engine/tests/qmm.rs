//! The tensor-core quantized product of a decode step's many rows (NVIDIA GPUs only) against
//! MLX's dequantization followed by a product on the host in f64, an independent path: random
//! weights quantized by MLX at 4 and 8 bits in groups of 32, 64 and 128; 9 to 32 rows (with a
//! leading batch shape); output columns that do not fill the last block; k-ranges split across
//! blocks and not.
//!
//! These tests need CUDA: `cargo test -p llmq-engine --test qmm -- --ignored` on a GPU machine.
//! On a CPU they are skipped by `#[ignore]`.

mod common;

use llmq_engine::kernels::cuda::qmm;
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

/// `x @ dense^T` on the host in f64: x [rows, k], dense [n, k].
fn reference(x: &[f32], dense: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
    (0..rows * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            x[r * k..][..k]
                .iter()
                .zip(&dense[c * k..][..k])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

#[test]
#[ignore = "needs CUDA"]
fn kernel_matches_dequantized_matmul() {
    // (n, k): a partial last block of columns; a k-range split many ways; a short one.
    for (n, k) in [(1000, 4096), (256, 4096), (1536, 640)] {
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                if k % group != 0 {
                    continue;
                }
                let spec = QuantSpec::new(bits, group).unwrap();
                let q = QTensor::quantize(&normal(&[n, k], Dtype::Bfloat16, 1), spec).unwrap();
                let dense = host(&q.dequantize().unwrap());
                for rows in [9, 24, 32] {
                    let x = normal(&[rows, 1, k], Dtype::Bfloat16, 2 + rows as u64);
                    assert!(
                        qmm::covers(&q, rows, Dtype::Bfloat16) && qmm::ready(),
                        "the kernel applies"
                    );
                    let got = qmm::matmul_t(&q, &x).unwrap();
                    assert_eq!(got.shape(), &[rows, 1, n]);
                    assert_eq!(got.dtype(), Dtype::Bfloat16);
                    let want = reference(&host(&x), &dense, rows as usize, n as usize, k as usize);
                    let g = host(&got);
                    // Sums of up to 4096 products of size ~1-3 (values up to ~300): the bf16
                    // output rounds by 0.4% of the value; the dequantized weight is rounded to
                    // bf16 as MLX's dequantization rounds it.
                    let d = g
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                        .fold(0.0, f32::max);
                    assert!(
                        d < 0.01,
                        "{spec} n {n} k {k} rows {rows}: max relative diff {d}"
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
        QuantSpec::new(4, 32).unwrap(),
    )
    .unwrap();
    assert!(!qmm::covers(&q, 8, Dtype::Bfloat16), "8 rows (qmv's)");
    assert!(!qmm::covers(&q, 33, Dtype::Bfloat16), "33 rows");
    assert!(!qmm::covers(&q, 16, Dtype::Float32), "f32");
    let q = QTensor::quantize(
        &normal(&[64, 256], Dtype::Bfloat16, 1),
        QuantSpec::new(2, 32).unwrap(),
    )
    .unwrap();
    assert!(!qmm::covers(&q, 16, Dtype::Bfloat16), "2 bits");
}

/// Not a test of speed (nothing here is asserted): prints the kernel's time beside the paths it
/// replaces, for the 8b shape's matrices (q, k and v fused, gate and up fused) at 4 bits,
/// groups of 64.
/// `cargo test --release -p llmq-engine --test qmm -- --ignored --nocapture times`
#[test]
#[ignore = "needs CUDA; a measurement"]
fn times() {
    let spec = QuantSpec::new(4, 64).unwrap();
    for (name, n, k) in [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
    ] {
        let dense_w = normal(&[n, k], Dtype::Bfloat16, 1);
        let q = QTensor::quantize(&dense_w, spec).unwrap();
        for rows in [16, 32] {
            let x = normal(&[rows, k], Dtype::Bfloat16, 2);
            let kernel = common::time_ms(&|| qmm::matmul_t(&q, &x).unwrap());
            let dequant = common::time_ms(&|| x.matmul(q.dequantize().unwrap().t()).unwrap());
            let bf16 = common::time_ms(&|| x.matmul(dense_w.t()).unwrap());
            let gb = (n as f64 * k as f64 * (0.5 + 4.0 / 64.0)) / 1e9;
            println!(
                "{name:8} {n:5}x{k:5} rows {rows:3}: kernel {kernel:.3} ms ({:.0} GB/s of packed weights), dequantize+matmul {dequant:.3} ms, bf16 {bf16:.3} ms",
                gb / (kernel / 1000.0)
            );
        }
    }
}
