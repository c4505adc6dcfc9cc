//! Quantized matrix products of a few rows (a decode step of up to `MAX_ROWS` streams), as a
//! CUDA kernel (NVIDIA GPUs only): `out[m, n] = sum_k x[m, k] * (scale * q[n, k] + bias)`.
//!
//! Decode is a read of the weights: at 4 bits a step reads about a quarter of the bf16 bytes.
//! MLX's own kernel for this reads the packed weights at a fraction of the memory's speed,
//! leaving 4-bit decode as slow as bf16 (BENCHMARKS.md, "quantized to 4 bits"). This kernel gives
//! each warp one output row: its lanes take 32 consecutive packed values at a time (16 at 8 bits;
//! one 16-byte load, 8 at 2 bits, the warp's loads contiguous; two such loads issued before the
//! first is used, to keep the memory busy), multiply them against every row of `x` (read through
//! the cache, shared by all warps) as `scale * (q . x) + bias * sum(x)`, and reduce across the
//! warp at the end. The loop is the cost once the loads are in flight, so a value becomes a float
//! without an integer conversion (a byte permute under 2^23's exponent and one subtraction):
//! the first form of this kernel, with a shift, a mask and a conversion a value, took as long
//! at 4 bits as bf16's products for four times the bytes (BENCHMARKS.md, "Where a step's time
//! goes").
//!
//! Covers widths of 2, 4 and 8 bits in groups of a multiple of 32 and inputs of at most
//! `MAX_ROWS` rows; others go through MLX ([`QTensor::matmul_t`]).
//!
//! A second kernel dequantizes a whole matrix (for the products of many rows, which multiply
//! densely): each thread turns 16 packed values into 16 of the output dtype with 16-byte
//! stores, faster than MLX's own.

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::kernels::cuda::launch::{self, Kernel};
use crate::quant::QTensor;

/// Most rows of `x` one launch takes.
pub const MAX_ROWS: i32 = 8;

/// Warps per thread block (one output row each).
const WARPS: i32 = 8;

const SOURCE: &str = r#"
    // A lane's values at a time: 16 bytes of packed weights (8 at 2 bits).
    constexpr int VALS = BITS == 8 ? 16 : 32;
    constexpr int WORDS = VALS * BITS / 32;
    constexpr int PER_WORD = 32 / BITS;
    constexpr int PER_BYTE = 8 / BITS;
    constexpr unsigned BYTE_MASK = ((1u << BITS) - 1u) * 0x01010101u;
    constexpr int CHUNKS = 2;
    constexpr int XV = VALS * sizeof(T) / 16;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) {
        return;
    }
    const uint32_t* wr = w + (size_t)n * K * BITS / 32;
    const T* sr = scales + (size_t)n * (K / G);
    const T* br = biases + (size_t)n * (K / G);
    float acc[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; ++m) {
        acc[m] = 0.f;
    }
    // CHUNKS chunks of VALS values a lane at a time (each within one group), their loads issued
    // before any is used, so that each warp keeps several loads of the weights in flight.
    for (int k0 = lane * VALS; k0 < K; k0 += CHUNKS * 32 * VALS) {
        uint32_t words[CHUNKS][WORDS];
        float sb[CHUNKS][2];
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int k = k0 + c * 32 * VALS;
            if (k < K) {
                const uint32_t* wp = wr + (size_t)k * BITS / 32;
                if constexpr (WORDS == 4) {
                    const uint4 v = *reinterpret_cast<const uint4*>(wp);
                    words[c][0] = v.x; words[c][1] = v.y; words[c][2] = v.z; words[c][3] = v.w;
                } else {
                    const uint2 v = *reinterpret_cast<const uint2*>(wp);
                    words[c][0] = v.x; words[c][1] = v.y;
                }
                sb[c][0] = static_cast<float>(sr[k / G]);
                sb[c][1] = static_cast<float>(br[k / G]);
            }
        }
        #pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int k = k0 + c * 32 * VALS;
            if (k >= K) {
                break;
            }
            // Each value without an integer-to-float conversion: its byte placed under the
            // exponent of 2^23 (one byte permute), then 2^23 subtracted (exact).
            float q[VALS];
            #pragma unroll
            for (int i = 0; i < WORDS; ++i) {
                #pragma unroll
                for (int s = 0; s < PER_BYTE; ++s) {
                    const uint32_t part = (words[c][i] >> (s * BITS)) & BYTE_MASK;
                    #pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        q[i * PER_WORD + b * PER_BYTE + s] =
                            __int_as_float(__byte_perm(part, 0x4B000000u, 0x7540u | b)) - 8388608.f;
                    }
                }
            }
            #pragma unroll
            for (int m = 0; m < MAX_ROWS; ++m) {
                if (m < M) {
                    T xv[VALS];
                    const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
                    #pragma unroll
                    for (int e = 0; e < XV; ++e) {
                        reinterpret_cast<uint4*>(xv)[e] = xp[e];
                    }
                    float dot = 0.f;
                    float sum = 0.f;
                    #pragma unroll
                    for (int j = 0; j < VALS; ++j) {
                        const float xf = static_cast<float>(xv[j]);
                        dot = fmaf(q[j], xf, dot);
                        sum += xf;
                    }
                    acc[m] += sb[c][0] * dot + sb[c][1] * sum;
                }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MAX_ROWS; ++m) {
        if (m < M) {
            float v = acc[m];
            for (int off = 16; off > 0; off /= 2) {
                v += __shfl_xor_sync(0xffffffff, v, off);
            }
            if (lane == 0) {
                out[(size_t)m * N + n] = static_cast<T>(v);
            }
        }
    }
"#;

const DEQUANTIZE: &str = r#"
    constexpr int VALS = 16;
    constexpr int WORDS = VALS * BITS / 32;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const size_t K = (size_t)w_shape[1] * 32 / BITS;
    const size_t chunks = (size_t)w_shape[0] * K / VALS;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) {
        return;
    }
    const size_t k = i * VALS;
    const uint32_t* wp = w + k * BITS / 32;
    uint32_t words[WORDS];
    if constexpr (WORDS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(wp);
        words[0] = v.x; words[1] = v.y; words[2] = v.z; words[3] = v.w;
    } else if constexpr (WORDS == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(wp);
        words[0] = v.x; words[1] = v.y;
    } else {
        words[0] = wp[0];
    }
    const float s = static_cast<float>(scales[k / G]);
    const float b = static_cast<float>(biases[k / G]);
    T v[VALS];
    #pragma unroll
    for (int j = 0; j < VALS; ++j) {
        v[j] = static_cast<T>(s * static_cast<float>((words[(j * BITS) / 32] >> ((j * BITS) % 32)) & MASK) + b);
    }
    uint4* op = reinterpret_cast<uint4*>(out + k);
    #pragma unroll
    for (int e = 0; e < VALS * (int)sizeof(T) / 16; ++e) {
        op[e] = reinterpret_cast<const uint4*>(v)[e];
    }
"#;

/// The two kernels, made once per process (MLX compiles each form of their template arguments
/// the first time it runs); None without CUDA.
struct Kernels {
    qmv: Kernel,
    dequantize: Kernel,
}

fn kernels() -> Option<&'static Kernels> {
    static KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();
    crate::kernels::cuda::launch::once(&KERNELS, "quantized matrix kernels", || {
        let header = format!("constexpr int MAX_ROWS = {MAX_ROWS};\n");
        Ok(Kernels {
            qmv: Kernel::new(
                "llmq_qmv",
                &["x", "w", "scales", "biases"],
                &["out"],
                SOURCE,
                &header,
                0,
            )?,
            dequantize: Kernel::new(
                "llmq_dequantize",
                &["w", "scales", "biases"],
                &["out"],
                DEQUANTIZE,
                "",
                0,
            )?,
        })
    })
}

/// Widths whose values fill whole bytes, in groups of whole 32-value chunks (the product's
/// lanes take 16 or 32 values of one group at a time).
fn covered(q: &QTensor) -> bool {
    [2, 4, 8].contains(&q.spec.bits) && q.spec.group_size % 32 == 0 && q.w.ndim() == 2
}

/// Whether the kernels are compiled and can run (a GPU with CUDA).
pub fn ready() -> bool {
    kernels().is_some()
}

/// Whether [`dequantize`] takes `q`: a single matrix of 2, 4 or 8 bits.
pub fn dequantize_covers(q: &QTensor) -> bool {
    covered(q)
}

/// The matrix dequantized through the kernel, in the scales' dtype (`q` as
/// [`dequantize_covers`] takes).
pub fn dequantize(q: &QTensor) -> Result<Array, Exception> {
    let kernels = kernels().ok_or_else(launch::unavailable)?;
    let (n, words) = (q.w.shape()[0], q.w.shape()[1]);
    let k = words * 32 / q.spec.bits;
    let chunks = n as i64 * k as i64 / 16;
    let threads = 256;
    let blocks = ((chunks + threads as i64 - 1) / threads as i64) as i32;
    let ints = [("BITS", q.spec.bits), ("G", q.spec.group_size)];
    let run = || -> Result<Array, Exception> {
        let out = kernels.dequantize.apply(
            &[&q.w, &q.scales, &q.biases],
            &[(&[n, k], q.scales.dtype())],
            blocks,
            threads,
            q.scales.dtype(),
            &ints,
        )?;
        Ok(out.into_iter().next().unwrap())
    };
    run()
}

/// Whether [`matmul_t`] takes `x @ W^T`: `x` of at most `MAX_ROWS` rows (any leading shape) in
/// the scales' dtype, `q` a single matrix of 2, 4 or 8 bits.
pub fn covers(q: &QTensor, x: &Array) -> bool {
    let shape = x.shape();
    let rows: i32 = shape[..shape.len() - 1].iter().product();
    rows <= MAX_ROWS && covered(q) && x.dtype() == q.scales.dtype()
}

/// `x @ W^T` through the kernel (for what [`covers`] takes).
pub fn matmul_t(q: &QTensor, x: &Array) -> Result<Array, Exception> {
    let shape = x.shape();
    let (k, lead) = (shape[shape.len() - 1], &shape[..shape.len() - 1]);
    let rows: i32 = lead.iter().product();
    let kernel = &kernels().ok_or_else(launch::unavailable)?.qmv;
    let n = q.w.shape()[0];
    let run = || -> Result<Array, Exception> {
        let x2 = x.reshape(&[rows, k])?;
        let blocks = (n + WARPS - 1) / WARPS;
        let ints = [("BITS", q.spec.bits), ("G", q.spec.group_size)];
        let out = kernel.apply(
            &[&x2, &q.w, &q.scales, &q.biases],
            &[(&[rows, n], x.dtype())],
            blocks,
            WARPS * 32,
            x.dtype(),
            &ints,
        )?;
        let mut out_shape = lead.to_vec();
        out_shape.push(n);
        out.into_iter().next().unwrap().reshape(&out_shape)
    };
    run()
}
