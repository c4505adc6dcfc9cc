//! A prefill chunk's attention inside a decode step, as CUDA kernels on the tensor cores
//! (NVIDIA GPUs, bf16 only).
//!
//! Why: with MLX's CUDA graphs off, MLX runs a chunk's causal attention through cuDNN, and
//! each call instantiates a CUDA graph on the host; a step with a chunk took 4-8 ms longer to
//! launch than a decode step, and these kernels cost one MLX custom-kernel launch each.
//! Measured on an H200 (RESULTS.md, tenth session), they did not pay: in the serving loop a
//! tick with a 256-token chunk launched no faster and took 3-4 ms longer on the device (our
//! tiles read each kv head's keys once per query head, with `mma.sync`; cuDNN does better).
//! So they are off unless `LLMQ_CHUNK_ATTENTION_KERNEL` is set (`ChunkAttention::wanted`).
//!
//! What: the chunk's `t` queries (rows of the step, [t, heads, 1, head_dim], positions
//! `off..off + t`) attend over their sequence's cache buffers ([1, kv_heads, capacity,
//! head_dim], already holding the chunk's own keys and values): query i sees keys
//! `0..=off + i` (causal, bottom-right). The output has the queries' shape.
//!
//! How: a thread block takes 64 queries of one query head (4 warps of 16 rows) over one share
//! of the keys those queries need (`splits` shares, so that a short chunk still fills the
//! GPU); tiles of 64 keys and their values are copied into shared memory asynchronously, the
//! next while this one is used; scores and the weighted sum are `mma.m16n8k16` bf16 products
//! with f32 accumulators, their operands loaded by `ldmatrix` (the values transposed on the
//! way); softmax is online (running maximum per row, base 2). Each share writes its rows' normalised partial
//! output and (maximum, sum) in f32; the merge kernel weighs the shares into the output.
//!
//! Invariants: a query never sees a key after its own position, nor one past the buffer's
//! capacity; keys of a tile past what the block needs are read as zeros and never weigh in;
//! rows past `t` (a partial last tile) are computed from the last row's query and never
//! written; a share none of whose keys a row may see leaves that row's sum at 0 (merged as
//! nothing). On a machine without CUDA, or for a shape these kernels do not cover,
//! `ChunkAttention::new` gives `None` and callers use MLX's attention.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::row_attention::Kernel;

/// Queries a block takes (4 warps of 16 rows).
const BLOCK_ROWS: i32 = 64;
/// Keys a tile holds (the splits are counted in tiles).
const TILE_KEYS: i32 = 64;
/// Blocks that fill an H200 (132 SMs) a few times over: the keys are split until a step has
/// about this many.
const ENOUGH_BLOCKS: i32 = 528;

/// Device helpers (PTX): asynchronous copies to shared memory, matrix fragment loads, one
/// tensor-core product, and the packing of two floats into a bf16 pair.
const HEADER: &str = r#"
#define LLMQ_NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ unsigned int llmq_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
}
__device__ __forceinline__ unsigned int llmq_ld(const __nv_bfloat16* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}
__device__ __forceinline__ unsigned int llmq_smem(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
// 16 bytes from global to shared memory without registers; `bytes` 0 writes zeros.
__device__ __forceinline__ void llmq_cp16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(llmq_smem(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void llmq_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void llmq_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
// Four 8x8 b16 matrices from shared memory (lane l gives row l % 8 of matrix l / 8), as is
// or transposed.
__device__ __forceinline__ void llmq_ldm4(unsigned int* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(llmq_smem(p)) : "memory");
}
__device__ __forceinline__ void llmq_ldm4t(unsigned int* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(llmq_smem(p)) : "memory");
}
// d (16x8, f32) += a (16x16, bf16, row-major) * b (16x8, bf16, column-major)
__device__ __forceinline__ void llmq_mma(float* d, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"#;

/// One block: 64 rows of one query head over one share of their keys. Inputs `q` [t, heads,
/// 1, D], `k`, `v` [1, kv_heads, cap, D], `pos` int32 [3] (off, t, splits); outputs `part` f32
/// [splits, t, heads, D] and `stats` f32 [splits, t, heads, 2] (maximum in base 2, sum).
/// Key tiles are double-buffered (the next one copied in while this one is used). Fragment
/// layouts are PTX's for m16n8k16: lane = 4 * g + c; an A fragment holds rows g and g + 8,
/// columns 2c, 2c + 1 (+ 8); a B fragment column g, rows 2c, 2c + 1 (+ 8); an accumulator
/// rows g and g + 8, columns 2c, 2c + 1. Keys' B fragments come from the key tile as stored
/// (ldmatrix), values' from the value tile transposed (ldmatrix.trans).
const ATTEND: &str = r#"
    constexpr int BQ = 64;
    constexpr int BK = 64;
    constexpr int KP = D + 8;
    constexpr int DT = D / 16;
    constexpr int NT = D / 8;
    // Two key tiles and two value tiles (dynamic shared memory: 4 * BK * KP bf16).
    extern __shared__ __align__(16) __nv_bfloat16 llmq_tiles[];
    __nv_bfloat16* ks[2] = {llmq_tiles, llmq_tiles + BK * KP};
    __nv_bfloat16* vs[2] = {llmq_tiles + 2 * BK * KP, llmq_tiles + 3 * BK * KP};
    const int heads = q_shape[1];
    const int kv_heads = k_shape[1];
    const int cap = k_shape[2];
    const int off = pos[0];
    const int t = pos[1];
    const int splits = pos[2];
    const int tiles = (t + BQ - 1) / BQ;
    const int sp = blockIdx.x % splits;
    const int h = (blockIdx.x / splits) / tiles;
    const int qt = (blockIdx.x / splits) % tiles;
    const int kh = h / (heads / kv_heads);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int r0 = qt * BQ + warp * 16 + g;
    const int r1 = r0 + 8;
    unsigned int qf[DT][4];
    {
        const __nv_bfloat16* p0 = q + ((size_t)min(r0, t - 1) * heads + h) * D + 2 * c;
        const __nv_bfloat16* p1 = q + ((size_t)min(r1, t - 1) * heads + h) * D + 2 * c;
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
            qf[kk][0] = llmq_ld(p0 + kk * 16);
            qf[kk][1] = llmq_ld(p1 + kk * 16);
            qf[kk][2] = llmq_ld(p0 + kk * 16 + 8);
            qf[kk][3] = llmq_ld(p1 + kk * 16 + 8);
        }
    }
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f;
    }
    float m0 = LLMQ_NEG_INF, m1 = LLMQ_NEG_INF, l0 = 0.f, l1 = 0.f;
    const float sl2 = SCALE * 1.4426950408889634f;
    const int p0 = off + r0;
    const int p1 = off + r1;
    // Keys the block's rows may see, this share of them, and the warp's last row's position.
    const int kend = min(off + min(t, (qt + 1) * BQ), cap);
    const int ntiles = (kend + BK - 1) / BK;
    const int per = (ntiles + splits - 1) / splits;
    const int kfirst = sp * per * BK;
    const int klast = min(kend, (sp + 1) * per * BK);
    const int wlast = off + min(t - 1, qt * BQ + warp * 16 + 15);
    const __nv_bfloat16* kb = k + (size_t)kh * cap * D;
    const __nv_bfloat16* vb = v + (size_t)kh * cap * D;
    // Lane l's row address within a tile for ldmatrix: keys' (row l % 8 of key block
    // l / 16, dims half (l / 8) % 2) and values' (key l % 16, dims block l / 16).
    const int krow = (lane / 16) * 8 + lane % 8;
    const int kcol = ((lane / 8) % 2) * 8;
    const int vrow = lane % 16;
    const int vcol = (lane / 16) * 8;
    int buf = 0;
    if (kfirst < klast) {
        for (int i = threadIdx.x; i < BK * (D / 8); i += blockDim.x) {
            const int j = i / (D / 8);
            const int d = (i % (D / 8)) * 8;
            const bool in = kfirst + j < klast;
            const size_t at = in ? (size_t)(kfirst + j) * D + d : 0;
            llmq_cp16(&ks[0][j * KP + d], kb + at, in ? 16 : 0);
            llmq_cp16(&vs[0][j * KP + d], vb + at, in ? 16 : 0);
        }
        llmq_commit();
    }
    for (int k0 = kfirst; k0 < klast; k0 += BK) {
        if (k0 + BK < klast) {
            const int k1 = k0 + BK;
            for (int i = threadIdx.x; i < BK * (D / 8); i += blockDim.x) {
                const int j = i / (D / 8);
                const int d = (i % (D / 8)) * 8;
                const bool in = k1 + j < klast;
                const size_t at = in ? (size_t)(k1 + j) * D + d : 0;
                llmq_cp16(&ks[buf ^ 1][j * KP + d], kb + at, in ? 16 : 0);
                llmq_cp16(&vs[buf ^ 1][j * KP + d], vb + at, in ? 16 : 0);
            }
            llmq_commit();
            llmq_wait<1>();
        } else {
            llmq_wait<0>();
        }
        __syncthreads();
        if (k0 <= wlast) {
            const __nv_bfloat16* kt = ks[buf];
            const __nv_bfloat16* vt = vs[buf];
            float s[BK / 8][4];
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                s[j][0] = 0.f; s[j][1] = 0.f; s[j][2] = 0.f; s[j][3] = 0.f;
            }
#pragma unroll
            for (int j = 0; j < BK / 8; j += 2) {
#pragma unroll
                for (int kk = 0; kk < DT; ++kk) {
                    unsigned int b[4];
                    llmq_ldm4(b, &kt[(j * 8 + krow) * KP + kk * 16 + kcol]);
                    llmq_mma(s[j], qf[kk], b[0], b[1]);
                    llmq_mma(s[j + 1], qf[kk], b[2], b[3]);
                }
            }
            float x0 = m0, x1 = m1;
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + j * 8 + 2 * c + e;
                    const bool in = key < klast;
                    s[j][e] = (in && key <= p0) ? s[j][e] * sl2 : LLMQ_NEG_INF;
                    s[j][2 + e] = (in && key <= p1) ? s[j][2 + e] * sl2 : LLMQ_NEG_INF;
                    x0 = fmaxf(x0, s[j][e]);
                    x1 = fmaxf(x1, s[j][2 + e]);
                }
            }
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, 1));
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, 2));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, 1));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, 2));
            const float b0 = x0 == LLMQ_NEG_INF ? 0.f : x0;
            const float b1 = x1 == LLMQ_NEG_INF ? 0.f : x1;
            const float a0 = exp2f(m0 - b0);
            const float a1 = exp2f(m1 - b1);
            m0 = x0;
            m1 = x1;
            l0 *= a0;
            l1 *= a1;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                o[n][0] *= a0; o[n][1] *= a0; o[n][2] *= a1; o[n][3] *= a1;
            }
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const float e0 = exp2f(s[2 * kk][0] - b0), e1 = exp2f(s[2 * kk][1] - b0);
                const float e2 = exp2f(s[2 * kk][2] - b1), e3 = exp2f(s[2 * kk][3] - b1);
                const float f0 = exp2f(s[2 * kk + 1][0] - b0), f1 = exp2f(s[2 * kk + 1][1] - b0);
                const float f2 = exp2f(s[2 * kk + 1][2] - b1), f3 = exp2f(s[2 * kk + 1][3] - b1);
                l0 += e0 + e1 + f0 + f1;
                l1 += e2 + e3 + f2 + f3;
                const unsigned int pa[4] = {llmq_pack(e0, e1), llmq_pack(e2, e3), llmq_pack(f0, f1), llmq_pack(f2, f3)};
#pragma unroll
                for (int n = 0; n < NT; n += 2) {
                    unsigned int b[4];
                    llmq_ldm4t(b, &vt[(kk * 16 + vrow) * KP + n * 8 + vcol]);
                    llmq_mma(o[n], pa, b[0], b[1]);
                    llmq_mma(o[n + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();
        buf ^= 1;
    }
    l0 += __shfl_xor_sync(0xffffffff, l0, 1);
    l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1);
    l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f;
    const float i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    if (r0 < t) {
        float* dst = part + (((size_t)sp * t + r0) * heads + h) * D + 2 * c;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            dst[n * 8] = o[n][0] * i0;
            dst[n * 8 + 1] = o[n][1] * i0;
        }
        if (c == 0) {
            float* st = stats + (((size_t)sp * t + r0) * heads + h) * 2;
            st[0] = m0;
            st[1] = l0;
        }
    }
    if (r1 < t) {
        float* dst = part + (((size_t)sp * t + r1) * heads + h) * D + 2 * c;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            dst[n * 8] = o[n][2] * i1;
            dst[n * 8 + 1] = o[n][3] * i1;
        }
        if (c == 0) {
            float* st = stats + (((size_t)sp * t + r1) * heads + h) * 2;
            st[0] = m1;
            st[1] = l1;
        }
    }
"#;

/// Weighs each (row, head)'s shares into the output [t, heads, 1, D]: one block per row and
/// head, one thread per dimension.
const MERGE: &str = r#"
    const int splits = part_shape[0];
    const int rows_heads = part_shape[1] * part_shape[2];
    const int rh = blockIdx.x;
    const int d = threadIdx.x;
    float m = LLMQ_NEG_INF;
    for (int s = 0; s < splits; ++s) {
        const float* st = stats + ((size_t)s * rows_heads + rh) * 2;
        if (st[1] > 0.f) {
            m = fmaxf(m, st[0]);
        }
    }
    float total = 0.f;
    float acc = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float* st = stats + ((size_t)s * rows_heads + rh) * 2;
        if (st[1] > 0.f) {
            const float w = exp2f(st[0] - m) * st[1];
            total += w;
            acc += w * part[((size_t)s * rows_heads + rh) * D + d];
        }
    }
    out[(size_t)rh * D + d] = static_cast<T>(total > 0.f ? acc / total : 0.f);
"#;

/// The kernels for one model's attention shape, compiled when the model loads.
pub struct ChunkAttention {
    attend: Kernel,
    merge: Kernel,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}

impl ChunkAttention {
    /// Whether a model loads these kernels: only when `LLMQ_CHUNK_ATTENTION_KERNEL` is set
    /// (not 0). Off by default: on an H200 they take longer on the device than MLX's cuDNN
    /// attention for 256-token chunks and saved no host time in the serving loop (RESULTS.md,
    /// tenth session), so ticks with a chunk got slower.
    pub fn wanted() -> bool {
        std::env::var_os("LLMQ_CHUNK_ATTENTION_KERNEL").is_some_and(|v| v != "0")
    }

    /// The kernels for `heads` query heads over `kv_heads` kv heads of `head_dim` dimensions,
    /// scores scaled by `scale`, compiled; `None` without CUDA, for a dtype other than bf16,
    /// and for a shape they do not cover (`head_dim` 64 or 128, `heads` a multiple of
    /// `kv_heads`).
    pub fn new(heads: i32, kv_heads: i32, head_dim: i32, scale: f32, dtype: Dtype) -> Option<Self> {
        let mut cuda = false;
        if unsafe { mlx_sys::mlx_cuda_is_available(&mut cuda) } != 0 || !cuda || !crate::on_gpu() {
            return None;
        }
        if dtype != Dtype::Bfloat16 || !(head_dim == 64 || head_dim == 128) || kv_heads <= 0 || heads % kv_heads != 0 {
            return None;
        }
        match Self::build(heads, kv_heads, head_dim, scale, dtype) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "no chunk attention kernel; chunks attend through MLX");
                None
            }
        }
    }

    /// The kernels, compiled (an error says why not: NVRTC's message, say).
    pub fn build(heads: i32, kv_heads: i32, head_dim: i32, scale: f32, dtype: Dtype) -> Result<Self, Exception> {
        let header = format!("{HEADER}constexpr float SCALE = {scale:.9e}f;\n");
        // Two tiles of keys and two of values, rows padded by 8 (conflict-free ldmatrix).
        let tiles_bytes = 4 * TILE_KEYS * (head_dim + 8) * 2;
        (|| -> Result<ChunkAttention, Exception> {
            let r = ChunkAttention {
                attend: Kernel::new("llmq_chunk_attention", &["q", "k", "v", "pos"], &["part", "stats"], ATTEND, &header, tiles_bytes)?,
                merge: Kernel::new("llmq_chunk_attention_merge", &["part", "stats"], &["out"], MERGE, &header, 0)?,
                heads,
                kv_heads,
                head_dim,
            };
            // Compile both now (NVRTC, about a second each): one query over one key.
            let q = mlx_rs::ops::zeros_dtype(&[1, heads, 1, head_dim], dtype)?;
            let kv = mlx_rs::ops::zeros_dtype(&[1, kv_heads, 1, head_dim], dtype)?;
            r.apply(&q, &kv, &kv, 0)?.eval()?;
            Ok(r)
        })()
    }

    /// Attention of the chunk's queries `q` [t, heads, 1, head_dim] at positions `off..off +
    /// t` over the keys and values in `k`, `v` ([1, kv_heads, capacity, head_dim], holding at
    /// least `off + t` positions), causal. Returns [t, heads, 1, head_dim] in `q`'s dtype.
    pub fn apply(&self, q: &Array, k: &Array, v: &Array, off: usize) -> Result<Array, Exception> {
        let t = q.shape()[0];
        let fits = q.shape() == [t, self.heads, 1, self.head_dim]
            && k.shape().len() == 4
            && k.shape()[..2] == [1, self.kv_heads]
            && k.shape()[3] == self.head_dim
            && k.shape() == v.shape()
            && off as i64 + t as i64 <= k.shape()[2] as i64
            && t > 0;
        if !fits {
            return Err(Exception::custom(format!(
                "chunk attention kernel: q {:?} at {off} over k {:?} does not fit",
                q.shape(),
                k.shape()
            )));
        }
        let tiles = (t + BLOCK_ROWS - 1) / BLOCK_ROWS;
        let blocks = tiles * self.heads;
        let key_tiles = (off as i32 + t + TILE_KEYS - 1) / TILE_KEYS;
        let splits = ((ENOUGH_BLOCKS + blocks - 1) / blocks).clamp(1, key_tiles.max(1));
        let pos = Array::from_slice(&[off as i32, t, splits], &[3]);
        let f32 = Dtype::Float32;
        let ints = [("D", self.head_dim)];
        let part_shape = [splits, t, self.heads, self.head_dim];
        let stats_shape = [splits, t, self.heads, 2];
        let parts = self.attend.apply(&[q, k, v, &pos], &[(&part_shape, f32), (&stats_shape, f32)], blocks * splits, 128, q.dtype(), &ints)?;
        let out = self.merge.apply(&[&parts[0], &parts[1]], &[(q.shape(), q.dtype())], t * self.heads, self.head_dim, q.dtype(), &ints)?;
        Ok(out.into_iter().next().expect("one output"))
    }
}
