//! The row attention kernel (NVIDIA GPUs only) against MLX's own masked attention, which is
//! an independent implementation (unfused matrix products): random queries, keys and values
//! at the 8b shape (32 query heads over 8 kv heads of 128) and SmolLM2's (9 over 3 of 64), in
//! bf16 and f32, with rows of length 0 (a scratch slot), 1, whole blocks and between, read
//! through block tables in a shuffled order, rows of one group's pool and of several in one
//! launch, in one thread block per row and kv head and with the keys split over several.
//!
//! These tests need CUDA: `cargo test -p llmq-engine --test row_attention -- --ignored` on a
//! GPU machine. On a CPU they are skipped by `#[ignore]`.

use llmq_engine::batch::BLOCK_TOKENS;
use llmq_engine::kernels::cuda::row_attention::RowAttention;
use mlx_rs::fast::scaled_dot_product_attention;
use mlx_rs::ops::indexing::IndexOp;
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

/// Rows in `groups` (each its pool's spare positions, in blocks no row holds, and its rows'
/// lengths) attended in one launch through block tables handed out in a shuffled order, each
/// row against MLX's masked attention over its own keys gathered in order.
fn check(heads: i32, kv_heads: i32, dim: i32, groups: &[(i32, &[usize])], dtype: Dtype, tol: f32) {
    let scale = 1.0 / (dim as f32).sqrt();
    let kernel =
        RowAttention::new(heads, kv_heads, dim, scale, dtype).expect("CUDA and a covered shape");
    let bs = BLOCK_TOKENS;
    let lens: Vec<usize> = groups.iter().flat_map(|(_, l)| l.iter().copied()).collect();
    let rows = lens.len() as i32;
    let width = lens
        .iter()
        .map(|l| l.div_ceil(bs))
        .max()
        .unwrap_or(1)
        .max(1);
    let q = normal(&[rows, heads, 1, dim], dtype, 1);
    let mut tables = vec![0i32; lens.len() * width];
    let mut row_group = vec![];
    let mut pools = vec![];
    let mut r = 0;
    let mut seed = 99u64;
    for (i, (spare, l)) in groups.iter().enumerate() {
        let need: usize = l.iter().map(|n| n.div_ceil(bs)).sum();
        let blocks = 1 + need + *spare as usize / bs;
        // Blocks 1.. shuffled (block 0 is the scratch block).
        let mut order: Vec<i32> = (1..blocks as i32).collect();
        for j in (1..order.len()).rev() {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(j, (seed >> 33) as usize % (j + 1));
        }
        let mut taken = order.into_iter();
        for &n in l.iter() {
            for b in 0..n.div_ceil(bs) {
                tables[r * width + b] = taken.next().unwrap();
            }
            row_group.push(i as i32);
            r += 1;
        }
        let shape = [(blocks * bs) as i32, kv_heads, dim];
        pools.push((
            normal(&shape, dtype, 2 + 2 * i as u64),
            normal(&shape, dtype, 3 + 2 * i as u64),
        ));
    }
    let table = Array::from_slice(&tables, &[rows, width as i32]);
    let kv: Vec<(&Array, &Array)> = pools.iter().map(|(k, v)| (k, v)).collect();
    let got = kernel
        .apply(&kernel.plan(&lens, &row_group, None), &q, &kv, &table)
        .unwrap();
    assert_eq!(got.shape(), q.shape());
    assert_eq!(got.dtype(), dtype);
    let got = host(&got);
    let per_row = (heads * dim) as usize;
    for (r, &len) in lens.iter().enumerate() {
        let row = &got[r * per_row..(r + 1) * per_row];
        if len == 0 {
            assert!(
                row.iter().all(|&x| x == 0.0),
                "a row of length 0 gives zeros"
            );
            continue;
        }
        // The reference: this row alone over its first `len` keys gathered in order, through
        // MLX's masked path (a mask that keeps every key forces the unfused implementation).
        let slots: Vec<i32> = (0..len)
            .map(|p| tables[r * width + p / bs] * bs as i32 + (p % bs) as i32)
            .collect();
        let idx = Array::from_slice(&slots, &[len as i32]);
        let (k, v) = &pools[row_group[r] as usize];
        let own = |a: &Array| {
            a.take_axis(&idx, 0)
                .unwrap()
                .transpose_axes(&[1, 0, 2])
                .unwrap()
                .expand_dims(0)
                .unwrap()
        };
        let len = len as i32;
        let mask = Array::from_slice(&vec![true; len as usize], &[1, 1, 1, len]);
        let qr = q.index(r as i32..r as i32 + 1);
        let want =
            host(&scaled_dot_product_attention(&qr, own(k), own(v), scale, &mask, None).unwrap());
        let d = row
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            d < tol,
            "heads {heads}/{kv_heads} dim {dim} {dtype:?} row {r} len {len}: max |diff| {d}"
        );
    }
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn matches_masked_attention_at_the_8b_shape() {
    let lens = [0, 1, 2, 17, 255, 256, 300, 511, 512, 100, 7, 64];
    for (dtype, tol) in [(Dtype::Float32, 1e-4), (Dtype::Bfloat16, 2e-2)] {
        // 32 rows of one group: every row one item.
        let many: Vec<usize> = lens.iter().cycle().take(32).copied().collect();
        check(32, 8, 128, &[(512, &many)], dtype, tol);
        // Few rows, some long: their keys are split over several blocks, then merged.
        check(32, 8, 128, &[(8704, &[8193, 0, 3000, 1])], dtype, tol);
        // Three groups of different capacities in one launch, split and not.
        check(
            32,
            8,
            128,
            &[(512, &lens[..8]), (2304, &[2049, 2300]), (8448, &[8200])],
            dtype,
            tol,
        );
        check(32, 8, 128, &[(1024, &many), (4096, &[3000])], dtype, tol);
    }
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn matches_masked_attention_at_smollm2s_shape() {
    let lens = [1, 0, 33, 128, 129, 1000, 1024, 3];
    check(9, 3, 64, &[(1024, &lens)], Dtype::Float32, 1e-4);
    check(9, 3, 64, &[(1024, &lens)], Dtype::Bfloat16, 2e-2);
    check(9, 3, 64, &[(4096, &[4000, 513])], Dtype::Float32, 1e-4);
    check(
        9,
        3,
        64,
        &[
            (256, &[5, 200]),
            (4096, &[4000]),
            (1024, &[700, 0]),
            (8192, &[8000]),
        ],
        Dtype::Float32,
        1e-4,
    );
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_shape_it_does_not_cover_is_refused() {
    assert!(
        RowAttention::new(32, 8, 16, 0.25, Dtype::Bfloat16).is_none(),
        "head_dim 16 is not a multiple of 32"
    );
    assert!(
        RowAttention::new(30, 8, 128, 0.1, Dtype::Bfloat16).is_none(),
        "30 heads do not group over 8"
    );
}

/// A whole model's decode step through the kernel and through masked attention: a
/// random-weight model of SmolLM2's shape (head_dim 64, bf16) decodes six sequences of
/// different lengths in two decode batches (length groups; the long one's rows attend one by
/// one on the masked side) for six steps both ways, fed the same tokens (masked attention's
/// greedy ones); the logits agree to bf16 precision.
#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_decode_step_gives_the_same_logits_through_the_kernel() {
    let (fast, masked) = kernel_and_masked_models();
    let vocab = fast.config.vocab_size;
    let lens = [5usize, 40, 300, 17, 1500, 2600];
    let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| prompt(n)).collect();
    let mut batches = vec![];
    for model in [&fast, &masked] {
        let mut short = model.new_decode_batch().unwrap();
        let mut long = model.new_decode_batch().unwrap().with_per_row_attention(8);
        for p in &prompts {
            let cache = prefilled(model, p);
            if p.len() < 1000 {
                short.join(&cache).unwrap()
            } else {
                long.join(&cache).unwrap()
            };
        }
        batches.push((short, long));
    }
    let split = lens.iter().filter(|&&n| n < 1000).count();
    let mut toks: Vec<u32> = vec![1; prompts.len()];
    for step in 0..6 {
        let mut out = vec![];
        for (model, (short, long)) in [&fast, &masked].into_iter().zip(batches.iter_mut()) {
            let (a, b) = toks.split_at(split);
            out.push(host(
                &model.decode_groups(&mut [(a, short), (b, long)]).unwrap(),
            ));
        }
        let b = &out[1];
        assert_close(&out[0], b, step);
        let top = |l: &[f32]| {
            l.iter()
                .enumerate()
                .fold((0, f32::MIN), |m, (i, &x)| if x > m.1 { (i, x) } else { m })
                .0 as u32
        };
        toks = (0..toks.len())
            .map(|r| top(&b[r * vocab..(r + 1) * vocab]))
            .collect();
    }
}

/// The same random-weight model of SmolLM2's shape (bf16) twice: through the row attention
/// kernel, and through MLX's attention throughout.
fn kernel_and_masked_models() -> (llmq_engine::Model, llmq_engine::Model) {
    use llmq_engine::shapes::random_model;
    let fast = random_model("smollm2", Dtype::Bfloat16, 7).unwrap();
    let masked = random_model("smollm2", Dtype::Bfloat16, 7)
        .unwrap()
        .with_masked_decode_attention();
    assert!(fast.uses_row_attention() && !masked.uses_row_attention());
    (fast, masked)
}

/// A deterministic prompt of `n` tokens.
fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 31 + n as u32) % 1000 + 1)
        .collect()
}

/// A sequence's cache after `model` prefilled `p` in one piece.
fn prefilled(model: &llmq_engine::Model, p: &[u32]) -> llmq_engine::cache::SequenceCache {
    let mut cache = model.new_cache();
    let x = Array::from_slice(
        &p.iter().map(|&t| t as i32).collect::<Vec<_>>(),
        &[1, p.len() as i32],
    );
    model
        .forward(&x, &mut [&mut cache], true)
        .unwrap()
        .eval()
        .unwrap();
    cache
}

/// Logits through the kernel (`a`) and through masked attention (`b`) agree to bf16 precision.
fn assert_close(a: &[f32], b: &[f32], step: usize) {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(
        d <= 0.02 * scale.max(1.0),
        "step {step}: max |diff| {d} (logits up to {scale})"
    );
}

/// A step that carries a prefill chunk (its rows rotated with the decode rows', its attention
/// over its own cache) gives the same logits, decode rows and chunk, through the kernel as
/// through masked attention, chunk after chunk.
#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_step_with_a_prefill_chunk_gives_the_same_logits_through_the_kernel() {
    let (fast, masked) = kernel_and_masked_models();
    let prompts: Vec<Vec<u32>> = [5usize, 40, 300, 17].iter().map(|&n| prompt(n)).collect();
    let long: Vec<u32> = (0..1024u32).map(|i| (i * 17) % 1000 + 1).collect();
    let mut state = vec![];
    for model in [&fast, &masked] {
        let mut batch = model.new_decode_batch().unwrap();
        for p in &prompts {
            batch.join(&prefilled(model, p)).unwrap();
        }
        state.push((batch, model.new_cache()));
    }
    let toks: Vec<u32> = vec![1; prompts.len()];
    for (step, chunk) in long.chunks(256).enumerate() {
        let mut out = vec![];
        for (model, (batch, cache)) in [&fast, &masked].into_iter().zip(state.iter_mut()) {
            out.push(host(
                &model
                    .step(&mut [(&toks[..], batch)], Some((chunk, cache)))
                    .unwrap(),
            ));
        }
        assert_close(&out[0], &out[1], step);
    }
}

/// A step with two length groups and a prefill chunk (the rows' keys and values cut into each
/// group's share and the chunk's), the chunk attending through MLX's attention:
/// the same logits through the row kernel as through masked attention, chunk after chunk.
#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn a_step_with_two_groups_and_a_chunk_gives_the_same_logits_through_the_kernel() {
    use llmq_engine::shapes::random_model;
    let fast = random_model("smollm2", Dtype::Bfloat16, 7).unwrap();
    let masked = random_model("smollm2", Dtype::Bfloat16, 7)
        .unwrap()
        .with_masked_decode_attention();
    assert!(fast.uses_row_attention());
    let (short_lens, long_lens) = ([5usize, 40, 300, 17], [1500usize]);
    let long_prompt: Vec<u32> = (0..1024u32).map(|i| (i * 13) % 1000 + 1).collect();
    let mut state = vec![];
    for model in [&fast, &masked] {
        let mut short = model.new_decode_batch().unwrap();
        let mut long = model.new_decode_batch().unwrap().with_per_row_attention(8);
        for &n in &short_lens {
            short.join(&prefilled(model, &prompt(n))).unwrap();
        }
        for &n in &long_lens {
            long.join(&prefilled(model, &prompt(n))).unwrap();
        }
        state.push((short, long, model.new_cache()));
    }
    let (a, b) = (vec![1u32; short_lens.len()], vec![2u32; long_lens.len()]);
    for (step, chunk) in long_prompt.chunks(256).enumerate() {
        let mut out = vec![];
        for (model, (short, long, cache)) in [&fast, &masked].into_iter().zip(state.iter_mut()) {
            out.push(host(
                &model
                    .step(&mut [(&a[..], short), (&b[..], long)], Some((chunk, cache)))
                    .unwrap(),
            ));
        }
        assert_close(&out[0], &out[1], step);
    }
}
