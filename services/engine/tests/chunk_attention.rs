//! The chunk attention kernels (NVIDIA GPUs, bf16) against MLX's masked attention in f32,
//! an independent implementation (unfused matrix products): random queries, keys and values
//! at the 8b shape (32 query heads over 8 kv heads of 128), Llama-1b's (32 over 8 of 64) and
//! SmolLM2's (9 over 3 of 64); chunks at the start of a buffer and deep into it, of lengths
//! that fill 64-row tiles and that do not, of one token, and with the keys split over several
//! blocks or not.
//!
//! These tests need CUDA: `cargo test -p llmq-engine --test chunk_attention -- --ignored` on a
//! GPU machine (RESULTS.md records the run). On a CPU they are skipped by `#[ignore]`.

use llmq_engine::chunk_attention::ChunkAttention;
use mlx_rs::fast::scaled_dot_product_attention;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{random, Array, Dtype};

fn normal(shape: &[i32], seed: u64) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, 1.0, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap()
}

fn host(a: &Array) -> Vec<f32> {
    // (a reshape lays a transposed view out in order)
    a.as_dtype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap().to_vec_exact::<f32>().unwrap()
}

/// A chunk of `t` queries at positions `off..off + t` over a buffer of `cap` positions.
fn check(heads: i32, kv_heads: i32, dim: i32, off: i32, t: i32, cap: i32) {
    let scale = 1.0 / (dim as f32).sqrt();
    let kernel = ChunkAttention::build(heads, kv_heads, dim, scale, Dtype::Bfloat16).unwrap();
    let q = normal(&[t, heads, 1, dim], 1 + off as u64);
    let k = normal(&[1, kv_heads, cap, dim], 2 + t as u64);
    let v = normal(&[1, kv_heads, cap, dim], 3 + cap as u64);
    let got = kernel.apply(&q, &k, &v, off as usize).unwrap();
    assert_eq!(got.shape(), q.shape());
    assert_eq!(got.dtype(), Dtype::Bfloat16);
    let got = host(&got);
    // The reference: the same values in f32, queries [1, heads, t, dim] over the first off + t
    // keys, query i allowed keys 0..=off + i by an explicit mask (MLX's unfused path).
    let end = off + t;
    let f = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
    let qr = f(&q).transpose_axes(&[2, 1, 0, 3]).unwrap();
    let (kr, vr) = (f(&k.index((.., .., ..end, ..))), f(&v.index((.., .., ..end, ..))));
    let allowed: Vec<bool> = (0..t).flat_map(|i| (0..end).map(move |j| j <= off + i)).collect();
    let mask = Array::from_slice(&allowed, &[1, 1, t, end]);
    let want = scaled_dot_product_attention(&qr, &kr, &vr, scale, &mask, None).unwrap();
    let want = host(&want.transpose_axes(&[2, 1, 0, 3]).unwrap());
    assert_eq!(got.len(), want.len());
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 0.03, "heads {heads}/{kv_heads} dim {dim}, chunk {t} at {off} in {cap}: worst difference {worst}");
    assert!(got.iter().all(|x| x.is_finite()));
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn matches_masked_attention_at_the_8b_shape() {
    check(32, 8, 128, 0, 256, 256);
    check(32, 8, 128, 0, 256, 1024);
    check(32, 8, 128, 7936, 256, 8448);
    check(32, 8, 128, 300, 100, 512);
    check(32, 8, 128, 4096, 16, 4352);
    check(32, 8, 128, 1000, 1, 1024);
    check(32, 8, 128, 0, 1, 64);
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn matches_masked_attention_at_the_1b_and_smollm2_shapes() {
    check(32, 8, 64, 2048, 256, 2304);
    check(32, 8, 64, 13, 77, 128);
    check(9, 3, 64, 0, 128, 256);
    check(9, 3, 64, 640, 64, 768);
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_shape_it_does_not_cover_is_refused() {
    assert!(ChunkAttention::new(32, 8, 96, 0.1, Dtype::Bfloat16).is_none());
    assert!(ChunkAttention::new(32, 8, 128, 0.1, Dtype::Float32).is_none());
    let kernel = ChunkAttention::new(32, 8, 128, 0.1, Dtype::Bfloat16).unwrap();
    let q = normal(&[16, 32, 1, 128], 1);
    let k = normal(&[1, 8, 64, 128], 2);
    assert!(kernel.apply(&q, &k, &k, 56).is_err(), "a chunk past the buffer's capacity");
}
