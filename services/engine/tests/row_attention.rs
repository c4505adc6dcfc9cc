//! The row attention kernel (NVIDIA GPUs only) against MLX's own masked attention, which is
//! an independent implementation (unfused matrix products): random queries, keys and values
//! at the 8b shape (32 query heads over 8 kv heads of 128) and SmolLM2's (9 over 3 of 64), in
//! bf16 and f32, with rows of length 0 (a scratch slot), 1, the whole capacity and between,
//! in one block per row and kv head and with the keys split over several.
//!
//! These tests need CUDA: `cargo test -p llmq-engine --test row_attention -- --ignored` on a
//! GPU machine (RESULTS.md records the run). On a CPU they are skipped by `#[ignore]`.

use llmq_engine::row_attention::RowAttention;
use mlx_rs::fast::scaled_dot_product_attention;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{random, Array, Dtype};

fn normal(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, 1.0, &key).unwrap().as_dtype(dtype).unwrap()
}

fn host(a: &Array) -> Vec<f32> {
    a.as_dtype(Dtype::Float32).unwrap().to_vec_exact::<f32>().unwrap()
}

fn check(heads: i32, kv_heads: i32, dim: i32, cap: i32, lens: &[i32], dtype: Dtype, tol: f32) {
    let scale = 1.0 / (dim as f32).sqrt();
    let kernel = RowAttention::new(heads, kv_heads, dim, scale).expect("CUDA and a covered shape");
    let rows = lens.len() as i32;
    let q = normal(&[rows, heads, 1, dim], dtype, 1);
    let k = normal(&[rows, kv_heads, cap, dim], dtype, 2);
    let v = normal(&[rows, kv_heads, cap, dim], dtype, 3);
    let longest = lens.iter().copied().max().unwrap_or(0) as usize;
    let got = kernel.apply(&q, &k, &v, &Array::from_slice(lens, &[rows]), longest).unwrap();
    assert_eq!(got.shape(), q.shape());
    assert_eq!(got.dtype(), dtype);
    let got = host(&got);
    let per_row = (heads * dim) as usize;
    for (r, &len) in lens.iter().enumerate() {
        let row = &got[r * per_row..(r + 1) * per_row];
        if len == 0 {
            assert!(row.iter().all(|&x| x == 0.0), "a row of length 0 gives zeros");
            continue;
        }
        // The reference: this row alone over its first `len` keys, through MLX's masked path
        // (a mask that keeps every key forces the unfused implementation).
        let r = r as i32;
        let (kr, vr) = (k.index((r..r + 1, .., ..len, ..)), v.index((r..r + 1, .., ..len, ..)));
        let mask = Array::from_slice(&vec![true; len as usize], &[1, 1, 1, len]);
        let want = host(&scaled_dot_product_attention(&q.index(r..r + 1), &kr, &vr, scale, &mask, None).unwrap());
        let d = row.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d < tol, "heads {heads}/{kv_heads} dim {dim} {dtype:?} row {r} len {len}: max |diff| {d}");
    }
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn matches_masked_attention_at_the_8b_shape() {
    let lens = [0, 1, 2, 17, 255, 256, 300, 511, 512, 100, 7, 64];
    check(32, 8, 128, 512, &lens, Dtype::Float32, 1e-4);
    check(32, 8, 128, 512, &lens, Dtype::Bfloat16, 2e-2);
    // Few long rows: their keys are split over several blocks, then merged.
    let long = [8193, 0, 3000, 1];
    check(32, 8, 128, 8704, &long, Dtype::Float32, 1e-4);
    check(32, 8, 128, 8704, &long, Dtype::Bfloat16, 2e-2);
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn matches_masked_attention_at_smollm2s_shape() {
    let lens = [1, 0, 33, 128, 129, 1000, 1024, 3];
    check(9, 3, 64, 1024, &lens, Dtype::Float32, 1e-4);
    check(9, 3, 64, 1024, &lens, Dtype::Bfloat16, 2e-2);
    check(9, 3, 64, 4096, &[4000, 513], Dtype::Float32, 1e-4);
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_shape_it_does_not_cover_is_refused() {
    assert!(RowAttention::new(32, 8, 16, 0.25).is_none(), "head_dim 16 is not a multiple of 32");
    assert!(RowAttention::new(30, 8, 128, 0.1).is_none(), "30 heads do not group over 8");
}

/// A whole model's decode batch through the kernel and through masked attention: a
/// random-weight model of SmolLM2's shape (head_dim 64, bf16) decodes five sequences of
/// different lengths (the longest splits its keys over blocks) for six steps both ways, fed the same tokens (masked attention's greedy
/// ones); the logits agree to bf16 precision.
#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_decode_batch_gives_the_same_logits_through_the_kernel() {
    use llmq_engine::shapes::random_model;
    let fast = random_model("smollm2", Dtype::Bfloat16, 7).unwrap();
    let masked = random_model("smollm2", Dtype::Bfloat16, 7).unwrap().with_masked_decode_attention();
    assert!(fast.uses_row_attention() && !masked.uses_row_attention());
    let vocab = fast.config.vocab_size;
    let prompts: Vec<Vec<u32>> = [5usize, 40, 300, 17, 1500].iter().map(|&n| (0..n as u32).map(|i| (i * 31 + n as u32) % 1000 + 1).collect()).collect();
    let mut batches = vec![];
    for model in [&fast, &masked] {
        let mut batch = model.new_decode_batch().unwrap();
        for p in &prompts {
            let mut cache = model.new_cache();
            let x = Array::from_slice(&p.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, p.len() as i32]);
            model.forward(&x, &mut [&mut cache], true).unwrap().eval().unwrap();
            batch.join(&cache).unwrap();
        }
        batches.push(batch);
    }
    let mut toks: Vec<u32> = vec![1; prompts.len()];
    for step in 0..6 {
        let a = host(&fast.decode_batch(&toks, &mut batches[0]).unwrap());
        let b = host(&masked.decode_batch(&toks, &mut batches[1]).unwrap());
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(d <= 0.02 * scale.max(1.0), "step {step}: max |diff| {d} (logits up to {scale})");
        let top = |l: &[f32]| l.iter().enumerate().fold((0, f32::MIN), |m, (i, &x)| if x > m.1 { (i, x) } else { m }).0 as u32;
        toks = (0..toks.len()).map(|r| top(&b[r * vocab..(r + 1) * vocab])).collect();
    }
}
