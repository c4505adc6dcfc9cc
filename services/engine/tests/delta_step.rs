//! The delta rule's step kernel (NVIDIA GPUs only) against the rule written here in MLX's
//! matrix products, head by head (an independent form: the kernel keeps columns of the state
//! in registers): random inputs at Qwen3.5-9B's shape (16 key heads, 32 value heads of 128)
//! and a small odd one, value heads grouped and tiled, one row and many.
//!
//! These tests need CUDA, and the kernel not switched off (`LLMQ_DELTA_STEP_KERNEL=0`):
//! `cargo test -p llmq-engine --test delta_step -- --ignored` on a GPU machine. On a CPU they
//! are skipped by `#[ignore]`.

use llmq_engine::kernels::cuda::delta_step;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{random, Array, Dtype};

fn normal(shape: &[i32], seed: u64) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, 1.0, &key).unwrap()
}

fn host(a: &Array) -> Vec<f32> {
    a.as_dtype(Dtype::Float32)
        .unwrap()
        .to_vec_exact::<f32>()
        .unwrap()
}

fn close(got: &Array, want: &Array, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (host(got), host(want));
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "{what}: worst relative error {worst}");
}

fn check(n: i32, key_heads: i32, heads: i32, dk: i32, dv: i32, tiled: bool) {
    // The kernel runs here whatever the rows; a layer hands it only steps of enough rows.
    assert!(
        delta_step::covers(key_heads, heads, dk, dv, delta_step::MIN_BLOCKS),
        "CUDA and a covered shape"
    );
    // Normed keys (as the layer gives them) keep the state bounded, like the model's.
    let unit = |x: Array| {
        let norm = x
            .square()
            .unwrap()
            .sum_axis(-1, true)
            .unwrap()
            .sqrt()
            .unwrap();
        x.divide(&norm).unwrap()
    };
    let q = unit(normal(&[n, key_heads, dk], 1));
    let k = unit(normal(&[n, key_heads, dk], 2));
    let v = normal(&[n, heads, dv], 3);
    let g = normal(&[n, heads], 4).abs().unwrap().negative().unwrap();
    let beta = mlx_rs::ops::sigmoid(normal(&[n, heads], 5)).unwrap();
    let state = normal(&[n, heads, dk, dv], 6);
    let (o, after) = delta_step::step(&q, &k, &v, &g, &beta, &state, tiled).unwrap();
    let r = heads / key_heads;
    for row in 0..n {
        for h in 0..heads {
            let kh = if tiled { h % key_heads } else { h / r };
            let kq = |x: &Array| x.index((row, kh)).reshape(&[1, dk]).unwrap();
            let (qh, kk) = (kq(&q), kq(&k));
            let s = state
                .index((row, h))
                .multiply(g.index((row, h)).exp().unwrap())
                .unwrap();
            let recalled = kk.matmul(&s).unwrap();
            let fresh = v
                .index((row, h))
                .reshape(&[1, dv])
                .unwrap()
                .subtract(&recalled)
                .unwrap()
                .multiply(beta.index((row, h)))
                .unwrap();
            let s = s
                .add(kk.transpose().unwrap().matmul(&fresh).unwrap())
                .unwrap();
            let want_o = qh.matmul(&s).unwrap().reshape(&[dv]).unwrap();
            let what = format!("row {row} head {h} (tiled {tiled})");
            close(&o.index((row, h)), &want_o, &format!("{what}: output"));
            close(&after.index((row, h)), &s, &format!("{what}: state"));
        }
    }
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn one_row_of_the_9b_shape() {
    check(1, 16, 32, 128, 128, false);
    check(1, 16, 32, 128, 128, true);
}

#[test]
#[ignore = "needs CUDA (run on the GPU machine)"]
fn many_rows_of_a_small_shape() {
    check(5, 2, 6, 64, 32, false);
    check(5, 2, 6, 64, 32, true);
}
