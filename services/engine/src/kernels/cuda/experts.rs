//! A mixture of experts' decode step as CUDA kernels (NVIDIA GPUs only): the router's top k, and
//! the experts' two products grouped by expert, so that the rows of a step that chose the same
//! expert share one read of its weights.
//!
//! MLX's gathered matmul runs each (row, expert) pair as its own matrix-vector product when the
//! pairs are unsorted, and a grouped GEMM of tensor-core tiles when they are sorted; for a decode
//! step both read an expert's weights at a small fraction of the memory's speed (BENCHMARKS.md,
//! "Mixture of experts"), and the routing around them (softmax, partition, gathers, sorts) is a dozen small operations a layer.
//! Here a layer's experts are four launches:
//!
//! - `route`: one warp a row takes the router's logits, their softmax and its k largest (ties to
//!   the lower index), renormalised over the k where the config says: each row's experts and
//!   weights.
//! - the gated product (`gate_up`): a block takes one expert and a few columns of its hidden
//!   layer; it first finds the pairs that chose its expert (in pair order, so the result does not
//!   depend on timing), then each warp reads its column's gate and up rows once for up to `ROWS`
//!   of them at a time (16-byte loads, four issued before the first is used), and writes
//!   `act(gate . x) * (up . x)`.
//! - the down product (`down`): the same kernel over the hidden layer's values, each pair's
//!   output scaled by its routing weight; the k outputs of a row are then summed by MLX.
//!
//! Blocks go to experts that some pair chose: with fewer pairs than experts (a step of a few
//! rows), block slot s stands for pair s's expert if no earlier pair chose it, and ends at once
//! otherwise. Steps of more than `MAX_PAIRS` pairs (prefill chunks) stay on MLX's grouped GEMM,
//! which multiplies many rows on tensor cores.

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::kernels::cuda::launch::Kernel;

/// Most (row, expert) pairs a step may have to take the kernels.
pub const MAX_PAIRS: i32 = 1024;

/// Most experts a model may have (the router's kernel holds a row's logits in one warp).
const MAX_EXPERTS: i32 = 256;

/// Pairs of one expert multiplied together (their sums held in registers).
const ROWS: i32 = 8;

/// Warps per block of the products (one column at a time each).
const WARPS: i32 = 8;

/// Warps per block of the router's kernel (one row each).
const ROUTE_WARPS: i32 = 4;

const ROUTE: &str = r#"
    const float NEG_INF = __int_as_float(0xff800000);
    const int n = logits_shape[0];
    const int E = logits_shape[1];
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= n) {
        return;
    }
    float v[PER_LANE];
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int e = i * 32 + lane;
        v[i] = e < E ? static_cast<float>(logits[(size_t)row * E + e]) : NEG_INF;
    }
    float top = NEG_INF;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        top = fmaxf(top, v[i]);
    }
    for (int off = 16; off > 0; off /= 2) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    }
    float total = 0.f;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        total += i * 32 + lane < E ? __expf(v[i] - top) : 0.f;
    }
    for (int off = 16; off > 0; off /= 2) {
        total += __shfl_xor_sync(0xffffffffu, total, off);
    }
    float picked[TOPK];
    float kept = 0.f;
    for (int t = 0; t < TOPK; ++t) {
        // The largest logit left, the lower index on ties; its lane then drops it.
        float best = NEG_INF;
        int at = 0x7fffffff;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            if (v[i] > best) {
                best = v[i];
                at = i * 32 + lane;
            }
        }
        for (int off = 16; off > 0; off /= 2) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, off);
            const int oa = __shfl_xor_sync(0xffffffffu, at, off);
            if (ob > best || (ob == best && oa < at)) {
                best = ob;
                at = oa;
            }
        }
        if (at % 32 == lane) {
            #pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                if (i == at / 32) {
                    v[i] = NEG_INF;
                }
            }
        }
        picked[t] = __expf(best - top) / total;
        kept += picked[t];
        if (lane == 0) {
            experts[(size_t)row * TOPK + t] = (uint32_t)at;
        }
    }
    if (lane == 0) {
        for (int t = 0; t < TOPK; ++t) {
            weights[(size_t)row * TOPK + t] = RENORMALIZE ? picked[t] / kept : picked[t];
        }
    }
"#;

const PRODUCT: &str = r#"
    constexpr int VALS = 16 / sizeof(T);
    constexpr int CHUNKS = 4;
    const int pairs_n = experts_shape[0] * experts_shape[1];
    const int topk = experts_shape[1];
    const int E = w_shape[0];
    const int K = w_shape[2];
    const int N = GATED ? w_shape[1] / 2 : w_shape[1];
    const int slots = pairs_n < E ? pairs_n : E;
    const int slot = blockIdx.x % slots;
    const int tile = blockIdx.x / slots;
    const int warps = blockDim.x / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    __shared__ int pairs[MAX_PAIRS];
    __shared__ int counts[32];
    __shared__ int taken;

    // This block's expert: slot s's, or pair s's when it is the first pair to choose it.
    uint32_t e = slot;
    if (pairs_n < E) {
        e = experts[slot];
        if (threadIdx.x == 0) {
            taken = 0;
        }
        __syncthreads();
        for (int p = threadIdx.x; p < slot; p += blockDim.x) {
            if (experts[p] == e) {
                taken = 1;
            }
        }
        __syncthreads();
        if (taken) {
            return;
        }
    }
    // The pairs that chose it, in pair order.
    int count = 0;
    for (int base = 0; base < pairs_n; base += blockDim.x) {
        const int p = base + threadIdx.x;
        const bool hit = p < pairs_n && experts[p] == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) {
            counts[warp] = __popc(ballot);
        }
        __syncthreads();
        int at = count;
        int added = 0;
        for (int i = 0; i < warps; ++i) {
            at += i < warp ? counts[i] : 0;
            added += counts[i];
        }
        if (hit) {
            pairs[at + __popc(ballot & ((1u << lane) - 1u))] = p;
        }
        __syncthreads();
        count += added;
    }
    if (count == 0) {
        return;
    }

    for (int c = 0; c < COLS; ++c) {
        const int j = (tile * COLS + c) * warps + warp;
        if (j >= N) {
            break;
        }
        const T* w0 = w + ((size_t)e * w_shape[1] + j) * K;
        const T* w1 = w0 + (size_t)N * K;
        for (int g = 0; g < count; g += ROWS) {
            const int rows = min(ROWS, count - g);
            const T* xr[ROWS];
            float a0[ROWS];
            float a1[ROWS];
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int p = pairs[g + (r < rows ? r : 0)];
                xr[r] = x + (size_t)(GATED ? p / topk : p) * K;
                a0[r] = 0.f;
                a1[r] = 0.f;
            }
            for (int k0 = lane * VALS; k0 < K; k0 += CHUNKS * 32 * VALS) {
                uint4 wa[CHUNKS];
                uint4 wb[CHUNKS];
                #pragma unroll
                for (int s = 0; s < CHUNKS; ++s) {
                    const int k = k0 + s * 32 * VALS;
                    if (k < K) {
                        wa[s] = *reinterpret_cast<const uint4*>(w0 + k);
                        if (GATED) {
                            wb[s] = *reinterpret_cast<const uint4*>(w1 + k);
                        }
                    }
                }
                #pragma unroll
                for (int s = 0; s < CHUNKS; ++s) {
                    const int k = k0 + s * 32 * VALS;
                    if (k >= K) {
                        break;
                    }
                    float fa[VALS];
                    float fb[VALS];
                    #pragma unroll
                    for (int i = 0; i < VALS; ++i) {
                        fa[i] = static_cast<float>(reinterpret_cast<const T*>(&wa[s])[i]);
                        fb[i] = GATED ? static_cast<float>(reinterpret_cast<const T*>(&wb[s])[i]) : 0.f;
                    }
                    #pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        if (r < rows) {
                            const uint4 xv = *reinterpret_cast<const uint4*>(xr[r] + k);
                            #pragma unroll
                            for (int i = 0; i < VALS; ++i) {
                                const float xf = static_cast<float>(reinterpret_cast<const T*>(&xv)[i]);
                                a0[r] += fa[i] * xf;
                                if (GATED) {
                                    a1[r] += fb[i] * xf;
                                }
                            }
                        }
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rows) {
                    float u = a0[r];
                    float v = a1[r];
                    for (int off = 16; off > 0; off /= 2) {
                        u += __shfl_xor_sync(0xffffffffu, u, off);
                        if (GATED) {
                            v += __shfl_xor_sync(0xffffffffu, v, off);
                        }
                    }
                    if (lane == 0) {
                        const int p = pairs[g + r];
                        float y;
                        if (GATED) {
                            // SiLU, or GELU's tanh form (Gemma's experts).
                            const float act = GELU
                                ? 0.5f * u * (1.f + tanhf(0.7978845608f * (u + 0.044715f * u * u * u)))
                                : u / (1.f + __expf(-u));
                            y = act * v;
                        } else {
                            y = weights[p] * u;
                        }
                        out[(size_t)p * N + j] = static_cast<T>(y);
                    }
                }
            }
        }
    }
"#;

struct Kernels {
    route: Kernel,
    product: Kernel,
}

fn kernels() -> Option<&'static Kernels> {
    static KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();
    crate::kernels::cuda::launch::once(&KERNELS, "mixture-of-experts kernels", || {
        let header =
            format!("constexpr int MAX_PAIRS = {MAX_PAIRS};\nconstexpr int ROWS = {ROWS};\n");
        Ok(Kernels {
            route: Kernel::new(
                "llmq_route",
                &["logits"],
                &["experts", "weights"],
                ROUTE,
                "",
                0,
            )?,
            product: Kernel::new(
                "llmq_expert_product",
                &["x", "w", "experts", "weights"],
                &["out"],
                PRODUCT,
                &header,
                0,
            )?,
        })
    })
}

/// Whether the kernels take a step of `pairs` (row, expert) pairs with these stacked weights
/// (`[experts, out, in]`, row-contiguous in memory) in `dtype`.
pub fn applies(pairs: i32, w: &Array, dtype: Dtype) -> bool {
    let vals = match dtype {
        Dtype::Float32 => 4,
        _ => 8,
    };
    pairs <= MAX_PAIRS
        && w.ndim() == 3
        && w.shape()[0] <= MAX_EXPERTS
        && w.shape()[2] % vals == 0
        && w.dtype() == dtype
        && matches!(dtype, Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
        && kernels().is_some()
}

/// Each row's `k` experts and their weights from the router's `logits` [n, experts]: the softmax's
/// k largest (ties to the lower index), renormalised over the k if `renormalize`. Experts [n, k]
/// as u32, weights [n, k] as f32.
pub fn route(logits: &Array, k: i32, renormalize: bool) -> Result<(Array, Array), Exception> {
    let kernels =
        kernels().ok_or_else(|| Exception::custom("mixture-of-experts kernels unavailable"))?;
    let (n, experts) = (logits.shape()[0], logits.shape()[1]);
    if experts > MAX_EXPERTS || k > experts {
        return Err(Exception::custom(format!(
            "routing {k} of {experts} experts"
        )));
    }
    let blocks = (n + ROUTE_WARPS - 1) / ROUTE_WARPS;
    let ints = [
        ("TOPK", k),
        ("PER_LANE", (experts + 31) / 32),
        ("RENORMALIZE", renormalize as i32),
    ];
    let out = kernels.route.apply(
        &[logits],
        &[(&[n, k], Dtype::Uint32), (&[n, k], Dtype::Float32)],
        blocks,
        ROUTE_WARPS * 32,
        logits.dtype(),
        &ints,
    )?;
    let mut out = out.into_iter();
    Ok((out.next().unwrap(), out.next().unwrap()))
}

/// `act(gate . x) * (up . x)` for every (row, expert) pair: `x` [n, in], `w` the stacked gate
/// and up rows [experts, 2 * size, in], `experts` [n, k] from `route`. Returns [n * k, size], pair
/// `i` being row `i / k`'s `i % k`-th expert.
pub fn gate_up(
    x: &Array,
    w: &Array,
    experts: &Array,
    weights: &Array,
    gelu: bool,
) -> Result<Array, Exception> {
    product(x, w, experts, weights, Some(gelu))
}

/// Each pair's hidden values `h` [n * k, size] through its expert's down rows `w` [experts, out,
/// size], scaled by the pair's routing weight: [n * k, out].
pub fn down(h: &Array, w: &Array, experts: &Array, weights: &Array) -> Result<Array, Exception> {
    product(h, w, experts, weights, None)
}

/// The product kernel, gated (`Some(gelu)`) or not.
fn product(
    x: &Array,
    w: &Array,
    experts: &Array,
    weights: &Array,
    gelu: Option<bool>,
) -> Result<Array, Exception> {
    let kernels =
        kernels().ok_or_else(|| Exception::custom("mixture-of-experts kernels unavailable"))?;
    let pairs = experts.shape()[0] * experts.shape()[1];
    let n = if gelu.is_some() {
        w.shape()[1] / 2
    } else {
        w.shape()[1]
    };
    let slots = pairs.min(w.shape()[0]);
    // A few rows a step: blocks of one column a warp, for enough blocks to fill the GPU; many:
    // four, so that fewer blocks each search the pairs.
    let cols = if pairs < w.shape()[0] { 1 } else { 4 };
    let tiles = (n + WARPS * cols - 1) / (WARPS * cols);
    let ints = [
        ("GATED", gelu.is_some() as i32),
        ("GELU", gelu.unwrap_or(false) as i32),
        ("COLS", cols),
    ];
    let out = kernels.product.apply(
        &[x, w, experts, weights],
        &[(&[pairs, n], x.dtype())],
        slots * tiles,
        WARPS * 32,
        x.dtype(),
        &ints,
    )?;
    Ok(out.into_iter().next().unwrap())
}
