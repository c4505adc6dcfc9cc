//! Quantized matrix products of a decode step's many rows (more than `qmv::MAX_ROWS`, at most
//! `MAX_ROWS`), on the tensor cores of NVIDIA GPUs: `out[m, n] = sum_k x[m, k] * (scale * q[n, k]
//! + bias)` with the packed weights read once and dequantized in registers.
//!
//! A decode step of 64 rows at 8b multiplies every weight by 64 rows: the tensor cores' work is
//! small, the read is what costs. Dequantizing the whole matrix into a bf16 temporary and
//! multiplying densely reads the packed weights, writes the full-precision ones and reads them
//! again: more than the bf16 model's own step. Here a block of 4 warps takes up to 64 rows
//! of `x` and 128 output columns (32 a warp): each k-chunk of 64, the rows' chunk goes through
//! shared memory (double-buffered, the next chunk's loads issued before this one's products) and
//! each lane turns its own 16 packed values of a column into bf16 pairs laid out as
//! `mma.sync`'s B operand (`m16n8k16`, f32 accumulation). Where the output alone gives too few
//! blocks to fill the GPU, the k-range is split across blocks and a second kernel sums their f32
//! partials in a fixed order (so results do not depend on timing).
//!
//! Used up to `MAX_ROWS` rows, where it was measured at least as fast as dequantizing and
//! multiplying densely (BENCHMARKS.md, "quantized to 4 bits"). Its time barely moves with the
//! rows: a block's chunks are
//! latency-bound (32 bytes of each weight row per chunk, one chunk of loads in flight), which is
//! where it has to get faster before it can take a batch of 64.
//!
//! Covers bf16 inputs, 4 and 8 bits, groups of 32, 64 and 128, a k-dimension that is a multiple
//! of 64 and of the group, output columns a multiple of 8; the rest goes through
//! [`QTensor::matmul_t`]'s other paths.

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::kernels::cuda::launch::{self, Kernel};
use crate::quant::QTensor;

/// Most rows one call takes (larger steps, prefill chunks among them, dequantize and multiply
/// densely: see the module's figures).
pub const MAX_ROWS: i32 = 32;

/// Warps per block, rows and output columns a block takes (the kernel's [`WARPS`], [`BM`], [`BN`]).
const WARPS: i32 = 4;
const BLOCK_ROWS: i32 = 64;
const BLOCK_COLUMNS: i32 = 128;

/// Blocks worth launching at least (two per SM of an H200), reached by splitting the k-range.
const TARGET_BLOCKS: i32 = 264;

/// k-values a chunk takes (the kernel's [`CHUNK`]).
const CHUNK: i32 = 64;

/// Chunks a split keeps at least.
const MIN_CHUNKS_PER_SPLIT: i32 = 4;

const SOURCE: &str = r#"
    constexpr int WARPS = 4;
    constexpr int CHUNK = 64;
    constexpr int LW = BITS / 2;
    constexpr int MT = 4;
    constexpr int BM = MT * 16;
    constexpr int NT = 4;
    constexpr int BN = WARPS * NT * 8;
    constexpr int PAD = CHUNK + 4;
    constexpr unsigned QM = (1u << BITS) - 1u;
    __shared__ __align__(16) unsigned short xs[2][BM][PAD];

    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const size_t KW = (size_t)K * BITS / 32;
    const size_t KG = (size_t)K / G;
    const int nblocks = (N + BN - 1) / BN;
    const int mblocks = (M + BM - 1) / BM;
    const int nb = blockIdx.x % nblocks;
    const int mb = (blockIdx.x / nblocks) % mblocks;
    const int split = blockIdx.x / (nblocks * mblocks);
    const int chunks = K / CHUNK;
    const int c_begin = split * chunks / SPLIT;
    const int c_end = (split + 1) * chunks / SPLIT;
    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int m0 = mb * BM;
    const int mts = min(MT, (M - m0 + 15) / 16);
    const int nw = nb * BN + (tid / 32) * NT * 8;

    float acc[MT][NT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[mt][j][e] = 0.f;
            }
        }
    }

    // Registers of the chunk being multiplied (c) and of the next one (loads in flight): each
    // lane the 16 packed values k = 16t .. 16t + 15 of its column g of each n-tile, with their
    // group's scale and bias; and the next chunk of the rows, on its way to shared memory.
    uint32_t wc[NT][LW], wn[NT][LW];
    float sc[NT], bc[NT], sn[NT], bn[NT];
    uint4 xr[MT];
    for (int c = c_begin - 1; c < c_end; ++c) {
        const int next = c + 1;
        if (next < c_end) {
            #pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int idx = tid + i * WARPS * 32;
                const int m = m0 + idx / 8;
                xr[i] = make_uint4(0u, 0u, 0u, 0u);
                if (m < M) {
                    xr[i] = *reinterpret_cast<const uint4*>(x + (size_t)m * K + (size_t)next * CHUNK + (idx % 8) * 8);
                }
            }
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = nw + j * 8 + g;
                #pragma unroll
                for (int v = 0; v < LW; ++v) {
                    wn[j][v] = 0u;
                }
                sn[j] = 0.f;
                bn[j] = 0.f;
                if (n < N) {
                    const uint32_t* p = w + (size_t)n * KW + ((size_t)next * CHUNK + 16 * t) * BITS / 32;
                    if constexpr (LW == 2) {
                        const uint2 q = *reinterpret_cast<const uint2*>(p);
                        wn[j][0] = q.x;
                        wn[j][1] = q.y;
                    } else {
                        const uint4 q = *reinterpret_cast<const uint4*>(p);
                        wn[j][0] = q.x;
                        wn[j][1] = q.y;
                        wn[j][2] = q.z;
                        wn[j][3] = q.w;
                    }
                    const size_t gi = (size_t)n * KG + ((size_t)next * CHUNK + 16 * t) / G;
                    sn[j] = static_cast<float>(scales[gi]);
                    bn[j] = static_cast<float>(biases[gi]);
                }
            }
        }
        if (c >= c_begin) {
            const int buf = (c - c_begin) & 1;
            // Four k-steps of 16. In step ks, lane (g, t)'s k-slots 2t, 2t + 1 and 2t + 8, 2t + 9
            // of mma's operands hold k = 16t + 4ks + {0, 1} and {2, 3} of the chunk, for the
            // rows (A) and the columns (B) alike: a permutation of the chunk's k, so that each
            // lane's share of the packed values is 8 (or 16) contiguous bytes.
            #pragma unroll
            for (int ks = 0; ks < CHUNK / 16; ++ks) {
                uint32_t a[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (mt < mts) {
                        const uint2 lo = *reinterpret_cast<const uint2*>(&xs[buf][mt * 16 + g][16 * t + 4 * ks]);
                        const uint2 hi = *reinterpret_cast<const uint2*>(&xs[buf][mt * 16 + g + 8][16 * t + 4 * ks]);
                        a[mt][0] = lo.x;
                        a[mt][1] = hi.x;
                        a[mt][2] = lo.y;
                        a[mt][3] = hi.y;
                    }
                }
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    uint32_t word;
                    if constexpr (BITS == 4) {
                        word = wc[j][ks / 2] >> (16 * (ks % 2));
                    } else {
                        word = wc[j][ks];
                    }
                    float f[4];
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        f[e] = sc[j] * (__uint_as_float(0x4B000000u | ((word >> (BITS * e)) & QM)) - 8388608.f) + bc[j];
                    }
                    uint32_t b0, b1;
                    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(b0) : "f"(f[1]), "f"(f[0]));
                    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(b1) : "f"(f[3]), "f"(f[2]));
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        if (mt < mts) {
                            asm volatile(
                                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                                : "+f"(acc[mt][j][0]), "+f"(acc[mt][j][1]), "+f"(acc[mt][j][2]), "+f"(acc[mt][j][3])
                                : "r"(a[mt][0]), "r"(a[mt][1]), "r"(a[mt][2]), "r"(a[mt][3]), "r"(b0), "r"(b1));
                        }
                    }
                }
            }
        }
        if (next < c_end) {
            const int buf = (next - c_begin) & 1;
            #pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int idx = tid + i * WARPS * 32;
                uint2* d = reinterpret_cast<uint2*>(&xs[buf][idx / 8][(idx % 8) * 8]);
                d[0] = make_uint2(xr[i].x, xr[i].y);
                d[1] = make_uint2(xr[i].z, xr[i].w);
            }
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                #pragma unroll
                for (int v = 0; v < LW; ++v) {
                    wc[j][v] = wn[j][v];
                }
                sc[j] = sn[j];
                bc[j] = bn[j];
            }
        }
        __syncthreads();
    }

    // Lane (g, t) holds rows g and g + 8 of each m-tile, columns 2t and 2t + 1 of each n-tile.
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = nw + j * 8 + 2 * t;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + mt * 16 + g + 8 * h;
                if (m < M && n < N) {
                    if constexpr (SPLIT == 1) {
                        out[(size_t)m * N + n] = static_cast<T>(acc[mt][j][2 * h]);
                        out[(size_t)m * N + n + 1] = static_cast<T>(acc[mt][j][2 * h + 1]);
                    } else {
                        float* o = reinterpret_cast<float*>(out) + ((size_t)split * M + m) * N + n;
                        o[0] = acc[mt][j][2 * h];
                        o[1] = acc[mt][j][2 * h + 1];
                    }
                }
            }
        }
    }
"#;

/// Sums the splits' partials [SPLIT, M, N] (f32) in order into [M, N] of `T`.
const REDUCE: &str = r#"
    const size_t total = (size_t)part_shape[1] * part_shape[2];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) {
        return;
    }
    float v = 0.f;
    for (int s = 0; s < part_shape[0]; ++s) {
        v += part[(size_t)s * total + i];
    }
    out[i] = static_cast<T>(v);
"#;

struct Kernels {
    qmm: Kernel,
    reduce: Kernel,
}

fn kernels() -> Option<&'static Kernels> {
    static KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();
    crate::kernels::cuda::launch::once(&KERNELS, "the quantized tensor-core kernel", || {
        Ok(Kernels {
            qmm: Kernel::new(
                "llmq_qmm",
                &["x", "w", "scales", "biases"],
                &["out"],
                SOURCE,
                "",
                0,
            )?,
            reduce: Kernel::new("llmq_qmm_reduce", &["part"], &["out"], REDUCE, "", 0)?,
        })
    })
}

/// How many ways the k-range splits: enough blocks to fill the GPU, each split at least
/// `MIN_CHUNKS_PER_SPLIT` chunks.
fn splits(blocks: i32, chunks: i32) -> i32 {
    let wanted = (TARGET_BLOCKS + blocks - 1) / blocks;
    wanted.min(chunks / MIN_CHUNKS_PER_SPLIT).max(1)
}

/// Whether the kernel takes this product: `rows` rows of `x` (dtype `dtype`) against `q`.
pub fn covers(q: &QTensor, rows: i32, dtype: Dtype) -> bool {
    let (bits, group) = (q.spec.bits, q.spec.group_size);
    if q.w.ndim() != 2
        || !(super::qmv::MAX_ROWS + 1..=MAX_ROWS).contains(&rows)
        || ![4, 8].contains(&bits)
    {
        return false;
    }
    let (n, k) = (q.w.shape()[0], q.w.shape()[1] * 32 / bits);
    dtype == Dtype::Bfloat16
        && q.scales.dtype() == Dtype::Bfloat16
        && [32, 64, 128].contains(&group)
        && k % CHUNK == 0
        && k % group == 0
        && n % 8 == 0
}

/// Whether the kernels are compiled and can run (a GPU with CUDA).
pub fn ready() -> bool {
    kernels().is_some()
}

/// `x @ W^T` through the kernel for `x` of more than `qmv::MAX_ROWS` and at most `MAX_ROWS`
/// rows (any leading shape), as [`covers`] takes.
pub fn matmul_t(q: &QTensor, x: &Array) -> Result<Array, Exception> {
    let shape = x.shape();
    let (k, lead) = (shape[shape.len() - 1], &shape[..shape.len() - 1]);
    let rows: i32 = lead.iter().product();
    let kernels = kernels().ok_or_else(launch::unavailable)?;
    let n = q.w.shape()[0];
    let run = || -> Result<Array, Exception> {
        let x2 = x.reshape(&[rows, k])?;
        let blocks =
            ((n + BLOCK_COLUMNS - 1) / BLOCK_COLUMNS) * ((rows + BLOCK_ROWS - 1) / BLOCK_ROWS);
        let split = splits(blocks, k / CHUNK);
        let ints = [
            ("BITS", q.spec.bits),
            ("G", q.spec.group_size),
            ("SPLIT", split),
        ];
        let inputs = [&x2, &q.w, &q.scales, &q.biases];
        let out = if split == 1 {
            kernels.qmm.apply(
                &inputs,
                &[(&[rows, n], x.dtype())],
                blocks,
                WARPS * 32,
                x.dtype(),
                &ints,
            )?
        } else {
            let part = kernels.qmm.apply(
                &inputs,
                &[(&[split, rows, n], Dtype::Float32)],
                blocks * split,
                WARPS * 32,
                x.dtype(),
                &ints,
            )?;
            let total = rows as i64 * n as i64;
            let threads = 256;
            let reduce_blocks = ((total + threads as i64 - 1) / threads as i64) as i32;
            kernels.reduce.apply(
                &[&part[0]],
                &[(&[rows, n], x.dtype())],
                reduce_blocks,
                threads,
                x.dtype(),
                &[],
            )?
        };
        let mut out_shape = lead.to_vec();
        out_shape.push(n);
        out.into_iter().next().unwrap().reshape(&out_shape)
    };
    run()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_gpu_without_slicing_the_k_range_thin() {
        // 8b's o projection: 32 blocks of 128 columns, 64 chunks: 9 splits.
        assert_eq!(splits(32, 64), 9);
        // Its fused gate and up projections: 224 blocks: 2 splits.
        assert_eq!(splits(224, 64), 2);
        // The output layer: 1002 blocks: none.
        assert_eq!(splits(1002, 64), 1);
        // A short k-range keeps 4 chunks a split.
        assert_eq!(splits(8, 9), 2);
        assert_eq!(splits(8, 3), 1);
    }
}
