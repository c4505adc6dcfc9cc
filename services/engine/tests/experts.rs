//! The mixture-of-experts kernels (NVIDIA GPUs only) against the definition computed on the host
//! in f64: the router's top k of a softmax (renormalised or not), each pair's gated product with
//! SiLU and GELU, the down product scaled by the routing weight. Shapes cover fewer pairs than
//! experts (a few decode rows), as many, and more (a 64-row step, several groups of one expert);
//! Mixtral's 8 experts with 2 active and Qwen3-MoE's 128 with 8.
//!
//! These tests need CUDA: `cargo test -p llmq-engine --test experts -- --ignored` on a GPU
//! machine. On a CPU they are skipped by `#[ignore]`.

mod common;

use llmq_engine::kernels::cuda::experts;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{random, Array, Dtype};

fn normal(shape: &[i32], dtype: Dtype, seed: u64, scale: f32) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, 0.0, scale, &key)
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

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(a, b)| *a as f64 * *b as f64).sum()
}

/// Row `r`'s k experts (largest first, lower index on ties) and their weights.
fn route_on_host(
    logits: &[f32],
    experts: usize,
    k: usize,
    renormalize: bool,
) -> Vec<(Vec<u32>, Vec<f64>)> {
    logits
        .chunks(experts)
        .map(|row| {
            let top = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let total: f64 = row.iter().map(|v| (*v as f64 - top).exp()).sum();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|a, b| row[*b].partial_cmp(&row[*a]).unwrap().then(a.cmp(b)));
            let chosen: Vec<u32> = order[..k].iter().map(|e| *e as u32).collect();
            let mut w: Vec<f64> = order[..k]
                .iter()
                .map(|e| (row[*e] as f64 - top).exp() / total)
                .collect();
            if renormalize {
                let s: f64 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= s);
            }
            (chosen, w)
        })
        .collect()
}

fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).abs() / (1.0 + b.abs()))
        .fold(0.0, f64::max)
}

#[test]
#[ignore = "needs CUDA"]
fn routing_matches_the_softmaxs_top_k() {
    for (experts, k) in [(8, 2), (128, 8), (60, 4)] {
        for renormalize in [false, true] {
            for n in [1, 5, 64] {
                let logits = normal(&[n, experts], Dtype::Bfloat16, 7 + n as u64, 2.0);
                let (chosen, weights) = experts::route(&logits, k, renormalize).unwrap();
                assert_eq!(
                    (chosen.shape(), chosen.dtype()),
                    (&[n, k][..], Dtype::Uint32)
                );
                assert_eq!(
                    (weights.shape(), weights.dtype()),
                    (&[n, k][..], Dtype::Float32)
                );
                let (chosen, weights) = (
                    chosen.to_vec_exact::<u32>().unwrap(),
                    weights.to_vec_exact::<f32>().unwrap(),
                );
                let want = route_on_host(&host(&logits), experts as usize, k as usize, renormalize);
                for (r, (e, w)) in want.iter().enumerate() {
                    let at = r * k as usize;
                    assert_eq!(
                        &chosen[at..at + k as usize],
                        &e[..],
                        "{experts} experts, row {r}"
                    );
                    let d = max_rel(&weights[at..at + k as usize], w);
                    assert!(
                        d < 1e-5,
                        "{experts} experts, renormalize {renormalize}, row {r}: weights off by {d}"
                    );
                }
            }
        }
    }
}

/// The gated and down products against the host for `n` rows, `experts` experts of which each
/// row takes `k`, hidden size `hidden` and expert width `size`.
fn check_products(n: i32, experts: i32, k: i32, hidden: i32, size: i32, gelu: bool) {
    let what = format!("{n} rows, {experts} experts, top {k}, gelu {gelu}");
    let x = normal(&[n, hidden], Dtype::Bfloat16, 1, 1.0);
    let gate_up = normal(&[experts, 2 * size, hidden], Dtype::Bfloat16, 2, 0.05);
    let down = normal(&[experts, hidden, size], Dtype::Bfloat16, 3, 0.05);
    // Rows concentrated on few experts, so that some expert has more than one group of rows.
    let logits = normal(&[n, experts], Dtype::Bfloat16, 4, 1.0)
        .add(normal(&[1, experts], Dtype::Bfloat16, 5, 3.0))
        .unwrap();
    let (chosen, weights) = experts::route(&logits, k, true).unwrap();
    assert!(
        experts::applies(n * k, &gate_up, Dtype::Bfloat16),
        "{what}: the kernels apply"
    );
    let h = experts::gate_up(&x, &gate_up, &chosen, &weights, gelu).unwrap();
    let y = experts::down(&h, &down, &chosen, &weights).unwrap();
    assert_eq!(h.shape(), &[n * k, size]);
    assert_eq!(y.shape(), &[n * k, hidden]);

    let (xs, gu, dw) = (host(&x), host(&gate_up), host(&down));
    let (chosen, weights) = (
        chosen.to_vec_exact::<u32>().unwrap(),
        weights.to_vec_exact::<f32>().unwrap(),
    );
    let (hidden, size) = (hidden as usize, size as usize);
    let hs = host(&h);
    let mut want_h = vec![0f64; hs.len()];
    for (p, e) in chosen.iter().enumerate() {
        let xr = &xs[p / k as usize * hidden..][..hidden];
        let base = *e as usize * 2 * size * hidden;
        for j in 0..size {
            let g = dot(&gu[base + j * hidden..][..hidden], xr);
            let u = dot(&gu[base + (size + j) * hidden..][..hidden], xr);
            let act = if gelu {
                0.5 * g
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
            } else {
                g / (1.0 + (-g).exp())
            };
            want_h[p * size + j] = act * u;
        }
    }
    // The bf16 output rounds by 0.4% of its value.
    let d = max_rel(&hs, &want_h);
    assert!(d < 0.01, "{what}: gated product off by {d}");
    // The down product from the kernel's own (rounded) hidden values.
    let ys = host(&y);
    let mut want_y = vec![0f64; ys.len()];
    for (p, e) in chosen.iter().enumerate() {
        let hr = &hs[p * size..][..size];
        for j in 0..hidden {
            want_y[p * hidden + j] =
                weights[p] as f64 * dot(&dw[(*e as usize * hidden + j) * size..][..size], hr);
        }
    }
    let d = max_rel(&ys, &want_y);
    assert!(d < 0.01, "{what}: down product off by {d}");
}

#[test]
#[ignore = "needs CUDA"]
fn products_match_the_definition() {
    // Fewer pairs than experts, as many, more (up to the most the kernels take).
    for n in [1, 3, 16, 64, 128] {
        check_products(n, 128, 8, 256, 96, false);
    }
    check_products(1, 8, 2, 512, 192, false);
    check_products(40, 8, 2, 512, 192, true);
}

#[test]
#[ignore = "needs CUDA"]
fn kernels_decline_what_they_do_not_cover() {
    let w = normal(&[8, 64, 256], Dtype::Bfloat16, 1, 1.0);
    assert!(experts::applies(64, &w, Dtype::Bfloat16));
    assert!(
        !experts::applies(experts::MAX_PAIRS + 1, &w, Dtype::Bfloat16),
        "a prefill chunk's pairs"
    );
    assert!(
        !experts::applies(64, &w, Dtype::Float16),
        "another dtype than the weights'"
    );
    assert!(
        !experts::applies(
            64,
            &normal(&[8, 64, 252], Dtype::Bfloat16, 1, 1.0),
            Dtype::Bfloat16
        ),
        "rows not in 16 bytes"
    );
    assert!(
        experts::route(&normal(&[2, 300], Dtype::Bfloat16, 1, 1.0), 8, true).is_err(),
        "300 experts"
    );
}

/// Not a test of speed (nothing here is asserted): prints the kernels' time beside MLX's gathered
/// matmul for Qwen3-30B-A3B's experts (128 of width 768, 8 active, hidden 2048) at 1, 16 and 64
/// rows, spread over the experts (bias 0) or mostly on the same few (bias 3).
/// `cargo test --release -p llmq-engine --test experts -- --ignored --nocapture times`
#[test]
#[ignore = "needs CUDA; a measurement"]
fn times() {
    let (experts, k, hidden, size) = (128, 8, 2048, 768);
    let gate_up = normal(&[experts, 2 * size, hidden], Dtype::Bfloat16, 2, 0.05);
    let down = normal(&[experts, hidden, size], Dtype::Bfloat16, 3, 0.05);
    let (gate_up_t, down_t) = (
        gate_up.swap_axes(-1, -2).unwrap(),
        down.swap_axes(-1, -2).unwrap(),
    );
    for n in [1, 16, 64] {
        let x = normal(&[n, hidden], Dtype::Bfloat16, 1, 1.0);
        for bias in [0.0f32, 3.0] {
            let logits = normal(&[n, experts], Dtype::Bfloat16, 4, 1.0)
                .add(normal(&[1, experts], Dtype::Bfloat16, 5, bias))
                .unwrap();
            let kernels = common::time_ms(&|| {
                let (chosen, weights) = experts::route(&logits, k, true).unwrap();
                let h = experts::gate_up(&x, &gate_up, &chosen, &weights, false).unwrap();
                experts::down(&h, &down, &chosen, &weights)
                    .unwrap()
                    .reshape(&[n, k, hidden])
                    .unwrap()
                    .sum_axis(1, false)
                    .unwrap()
            });
            let (chosen, _) = experts::route(&logits, k, true).unwrap();
            let sorted = n * k >= 64;
            let mlx = common::time_ms(&|| {
                let (idx, xs) = if sorted {
                    let flat = chosen.reshape(&[n * k]).unwrap();
                    let order = mlx_rs::ops::argsort_axis(&flat, 0).unwrap();
                    let rows = order.floor_divide(Array::from_int(k)).unwrap();
                    (
                        flat.take_axis(&order, 0).unwrap(),
                        x.take_axis(&rows, 0)
                            .unwrap()
                            .reshape(&[n * k, 1, hidden])
                            .unwrap(),
                    )
                } else {
                    (chosen.clone(), x.reshape(&[n, 1, 1, hidden]).unwrap())
                };
                let h = mlx_rs::ops::gather_mm(&xs, &gate_up_t, None, &idx, sorted).unwrap();
                let h = if sorted {
                    h.index((.., .., ..size))
                } else {
                    h.index((.., .., .., ..size))
                };
                mlx_rs::ops::gather_mm(&h, &down_t, None, &idx, sorted).unwrap()
            });
            let gb = (n * k).min(experts) as f64 * 3.0 * size as f64 * hidden as f64 * 2.0 / 1e9;
            println!("bias {bias}: experts of a layer, {n:2} rows: kernels {kernels:.3} ms ({:.0} GB/s of distinct experts at most), MLX's gathered matmuls {mlx:.3} ms", gb / (kernels / 1000.0));
        }
    }
}
