//! Decode attention over rows of different lengths, as one CUDA kernel (NVIDIA GPUs only).
//!
//! A decode batch keeps its rows in shared KV buffers [rows, kv_heads, capacity, head_dim];
//! each row attends over its own first `len` keys. MLX's fused attention takes no per-row
//! lengths: with a mask array it falls back to unfused matrix products over the whole
//! capacity, which on an H200 cost 18.9 ms a step for 64 rows over 1024 slots at the 8b shape
//! against 2.9 ms unmasked (RESULTS.md, seventh session). This kernel takes each row's length
//! instead of a mask and reads only those keys.
//!
//! The kernel (our own source, compiled by MLX through NVRTC the first time it runs): one
//! thread block per (row, kv head), all query heads of that kv head together (grouped-query
//! attention), so every key and value is read once. The block's warps take the keys in turn;
//! each lane holds `head_dim / 32` dimensions; scores use a running maximum (online softmax),
//! and the warps' partial results are merged in shared memory at the end. A row of length 0
//! (a scratch slot) gets zeros.
//!
//! Invariants: inputs are row-contiguous (MLX copies them otherwise, which is correct but
//! slow, so callers pass the batch's own buffers); `lens[r] <= capacity`; the output has the
//! queries' shape and dtype. On a machine without CUDA, `RowAttention::new` gives `None` and
//! callers use masked attention.

use std::ffi::{c_char, CString};

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, StreamOrDevice};

/// Warps per thread block.
const WARPS: i32 = 8;

/// Rows of keys a block takes at most before the keys are split over several blocks.
const KEYS_PER_BLOCK: i32 = 512;

/// Thread blocks that keep the GPU busy without splitting keys (an H200 has 132 SMs).
const ENOUGH_BLOCKS: i32 = 256;

/// The part every kernel shares: one block's share of one (row, kv head)'s keys, accumulated
/// with a running maximum by the warps in turn, then merged over the warps in shared memory,
/// leaving in `m[g]`, `total[g]` and `o` the block's maximum score, softmax sum and weighted
/// values (thread `t` holds dimension `t % D` of query head `t / D`). `SCALE`, `G` (query heads
/// per kv head), `D` (head dim) and `T` (dtype) are set per model. Inputs: `q` [rows, heads, 1,
/// D], `k`, `v` [rows, kv_heads, cap, D], `lens` [rows] int32. The grid holds `splits` blocks
/// per (row, kv head); block `s` takes the `s`-th of `splits` equal parts of the row's keys.
const ACCUMULATE: &str = r#"
    constexpr int PER = D / 32;
    const int kv_heads = k_shape[1];
    const int cap = k_shape[2];
    const int splits = gridDim.x / (q_shape[0] * kv_heads);
    const int pair = blockIdx.x / splits;
    const int split = blockIdx.x % splits;
    const int row = pair / kv_heads;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int len = min(lens[row], cap);
    const int share = (len + splits - 1) / splits;
    const int begin = split * share;
    const int end = min(len, begin + share);
    const size_t base = (size_t)pair * cap * D + lane * PER;
    const size_t qbase = (size_t)pair * G * D + lane * PER;
    float qr[G][PER];
    float acc[G][PER];
    float mx[G];
    float sum[G];
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < PER; ++i) {
            qr[g][i] = static_cast<float>(q[qbase + g * D + i]) * SCALE;
            acc[g][i] = 0.f;
        }
        mx[g] = -1e30f;
        sum[g] = 0.f;
    }
    for (int j = begin + warp; j < end; j += WARPS) {
        float kr[PER];
        float vr[PER];
        for (int i = 0; i < PER; ++i) {
            kr[i] = static_cast<float>(k[base + (size_t)j * D + i]);
            vr[i] = static_cast<float>(v[base + (size_t)j * D + i]);
        }
        for (int g = 0; g < G; ++g) {
            float s = 0.f;
            for (int i = 0; i < PER; ++i) {
                s += qr[g][i] * kr[i];
            }
            for (int off = 16; off > 0; off /= 2) {
                s += __shfl_xor_sync(0xffffffff, s, off);
            }
            const float m = fmaxf(mx[g], s);
            const float keep = __expf(mx[g] - m);
            const float p = __expf(s - m);
            sum[g] = sum[g] * keep + p;
            for (int i = 0; i < PER; ++i) {
                acc[g][i] = acc[g][i] * keep + p * vr[i];
            }
            mx[g] = m;
        }
    }
    __shared__ float part_max[WARPS][G];
    __shared__ float part_sum[WARPS][G];
    __shared__ float part_acc[WARPS][G][D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            part_max[warp][g] = mx[g];
            part_sum[warp][g] = sum[g];
        }
        for (int i = 0; i < PER; ++i) {
            part_acc[warp][g][lane * PER + i] = acc[g][i];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int g = t / D;
        const int d = t % D;
        float m = -1e30f;
        for (int w = 0; w < WARPS; ++w) {
            m = fmaxf(m, part_max[w][g]);
        }
        float total = 0.f;
        float o = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            if (part_sum[w][g] > 0.f) {
                const float c = __expf(part_max[w][g] - m);
                total += part_sum[w][g] * c;
                o += part_acc[w][g][d] * c;
            }
        }
"#;

/// One block per (row, kv head): the result goes straight to `out` (like `q`).
const WHOLE: &str = r#"
        out[(size_t)pair * G * D + t] = static_cast<T>(total > 0.f ? o / total : 0.f);
    }
"#;

/// Keys split over several blocks: each writes its normalised share to `part` (f32 [rows,
/// kv_heads, splits, G, D]) and its maximum and sum to `stats` (f32 [rows, kv_heads, splits,
/// G, 2]), for `MERGE`.
const SPLIT: &str = r#"
        part[(size_t)blockIdx.x * G * D + t] = total > 0.f ? o / total : 0.f;
        if (d == 0) {
            stats[((size_t)blockIdx.x * G + g) * 2] = m;
            stats[((size_t)blockIdx.x * G + g) * 2 + 1] = total;
        }
    }
"#;

/// Merges the splits' shares of each (row, kv head), one block each, into `out`.
const MERGE: &str = r#"
    const int splits = part_shape[2];
    const size_t pair = blockIdx.x;
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int g = t / D;
        const int d = t % D;
        float m = -1e30f;
        for (int s = 0; s < splits; ++s) {
            m = fmaxf(m, stats[((pair * splits + s) * G + g) * 2]);
        }
        float total = 0.f;
        float o = 0.f;
        for (int s = 0; s < splits; ++s) {
            const size_t at = (pair * splits + s) * G + g;
            const float l = stats[at * 2 + 1];
            if (l > 0.f) {
                const float c = __expf(stats[at * 2] - m) * l;
                total += c;
                o += part[at * D + d] * c;
            }
        }
        out[pair * G * D + t] = static_cast<T>(total > 0.f ? o / total : 0.f);
    }
"#;

/// One custom kernel of MLX (compiled through NVRTC the first time it runs), freed on drop.
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

// SAFETY: the handle is an immutable description of the kernel (its name, source and argument
// names); applying it only reads it, and MLX serialises the resulting work on its stream.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

fn failed(what: &str) -> Exception {
    Exception::custom(format!("row attention kernel: {what} failed"))
}

fn c_string(s: &str) -> Result<CString, Exception> {
    CString::new(s).map_err(|_| Exception::custom("row attention kernel: a string holds a NUL byte"))
}

fn check(status: i32, what: &str) -> Result<(), Exception> {
    if status == 0 {
        Ok(())
    } else {
        Err(failed(what))
    }
}

/// A C vector of strings, freed on drop.
struct Strings(mlx_sys::mlx_vector_string);

impl Strings {
    fn new(items: &[&str]) -> Result<Self, Exception> {
        let owned = items.iter().map(|s| c_string(s)).collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
        Ok(Strings(unsafe { mlx_sys::mlx_vector_string_new_data(ptrs.as_ptr() as *mut *const c_char, ptrs.len()) }))
    }
}

impl Drop for Strings {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_vector_string_free(self.0) };
    }
}

/// A launch's configuration, freed on drop.
struct Config(mlx_sys::mlx_fast_cuda_kernel_config);

impl Drop for Config {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_fast_cuda_kernel_config_free(self.0) };
    }
}

/// A C vector of arrays, freed on drop.
struct Arrays(mlx_sys::mlx_vector_array);

impl Drop for Arrays {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_vector_array_free(self.0) };
    }
}

impl Kernel {
    fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str, header: &str) -> Result<Self, Exception> {
        let (name, source, header) = (c_string(name)?, c_string(source)?, c_string(header)?);
        let (inputs, outputs) = (Strings::new(inputs)?, Strings::new(outputs)?);
        let raw = unsafe {
            mlx_sys::mlx_fast_cuda_kernel_new(name.as_ptr(), inputs.0, outputs.0, source.as_ptr(), header.as_ptr(), true, 0)
        };
        if raw.ctx.is_null() {
            return Err(failed("creating the kernel"));
        }
        Ok(Kernel(raw))
    }

    /// Queues the kernel over `inputs` with `blocks` blocks of `threads` threads; `T` is
    /// `dtype`, and the integer template arguments are `ints`.
    fn apply(&self, inputs: &[&Array], outputs: &[(&[i32], Dtype)], blocks: i32, threads: i32, dtype: Dtype, ints: &[(&str, i32)]) -> Result<Vec<Array>, Exception> {
        let config = Config(unsafe { mlx_sys::mlx_fast_cuda_kernel_config_new() });
        if config.0.ctx.is_null() {
            return Err(failed("creating a launch configuration"));
        }
        unsafe {
            for (shape, dtype) in outputs {
                check(mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(config.0, shape.as_ptr(), shape.len(), (*dtype).into()), "adding an output")?;
            }
            check(mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config.0, blocks * threads, 1, 1), "setting the grid")?;
            check(mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config.0, threads, 1, 1), "setting the block")?;
            for (name, value) in ints {
                let name = c_string(name)?;
                check(mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(config.0, name.as_ptr(), *value), "adding a template argument")?;
            }
            let t = c_string("T")?;
            check(mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(config.0, t.as_ptr(), dtype.into()), "adding the dtype")?;
        }
        let ptrs: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
        let ins = Arrays(unsafe { mlx_sys::mlx_vector_array_new_data(ptrs.as_ptr(), ptrs.len()) });
        let mut outs = Arrays(unsafe { mlx_sys::mlx_vector_array_new() });
        let stream = StreamOrDevice::default();
        check(unsafe { mlx_sys::mlx_fast_cuda_kernel_apply(&mut outs.0, self.0, ins.0, config.0, stream.as_ref().as_ptr()) }, "launching")?;
        let n = unsafe { mlx_sys::mlx_vector_array_size(outs.0) };
        if n != outputs.len() {
            return Err(failed("reading its outputs"));
        }
        (0..n)
            .map(|i| {
                let mut out = unsafe { mlx_sys::mlx_array_new() };
                // SAFETY: `out` receives a new reference, which the Array then owns (and frees).
                let got = unsafe { mlx_sys::mlx_vector_array_get(&mut out, outs.0, i) };
                let out = unsafe { Array::from_ptr(out) };
                check(got, "reading its outputs").map(|_| out)
            })
            .collect()
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

/// The kernels of one model's attention shape: `whole` (one block per row and kv head), and
/// `split` then `merge` (the keys of each spread over several blocks, for few long rows).
pub struct RowAttention {
    whole: Kernel,
    split: Kernel,
    merge: Kernel,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}

impl RowAttention {
    /// The kernels for `heads` query heads over `kv_heads` kv heads of `head_dim` dimensions,
    /// scores scaled by `scale`; `None` without CUDA or for a shape they do not cover
    /// (`head_dim` a multiple of 32 up to 256, `heads` a multiple of `kv_heads`), and when
    /// `LLMQ_MASKED_DECODE_ATTENTION` is set (to compare the two).
    pub fn new(heads: i32, kv_heads: i32, head_dim: i32, scale: f32) -> Option<Self> {
        let mut cuda = false;
        if unsafe { mlx_sys::mlx_cuda_is_available(&mut cuda) } != 0 || !cuda || !crate::on_gpu() {
            return None;
        }
        if head_dim % 32 != 0 || head_dim > 256 || kv_heads <= 0 || heads % kv_heads != 0 {
            return None;
        }
        if std::env::var_os("LLMQ_MASKED_DECODE_ATTENTION").is_some_and(|v| v != "0") {
            return None;
        }
        let header = format!("constexpr float SCALE = {scale:.9e}f;\nconstexpr int WARPS = {WARPS};\n");
        let made = (|| -> Result<RowAttention, Exception> {
            let inputs = ["q", "k", "v", "lens"];
            Ok(RowAttention {
                whole: Kernel::new("llmq_row_attention", &inputs, &["out"], &format!("{ACCUMULATE}{WHOLE}"), &header)?,
                split: Kernel::new("llmq_row_attention_split", &inputs, &["part", "stats"], &format!("{ACCUMULATE}{SPLIT}"), &header)?,
                merge: Kernel::new("llmq_row_attention_merge", &["part", "stats"], &["out"], MERGE, "")?,
                heads,
                kv_heads,
                head_dim,
            })
        })();
        match made {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "no row attention kernel; decode uses masked attention");
                None
            }
        }
    }

    /// Attention of each row's query `q` [rows, heads, 1, head_dim] over its first `lens[r]`
    /// keys and values of `k`, `v` [rows, kv_heads, capacity, head_dim]; `lens` int32 [rows],
    /// at most `longest`. Few long rows spread their keys over several blocks.
    pub fn apply(&self, q: &Array, k: &Array, v: &Array, lens: &Array, longest: usize) -> Result<Array, Exception> {
        let rows = q.shape()[0];
        if q.shape() != [rows, self.heads, 1, self.head_dim] || k.shape()[..2] != [rows, self.kv_heads] || lens.shape() != [rows] {
            return Err(Exception::custom(format!(
                "row attention kernel: shapes q {:?}, k {:?}, lens {:?} do not fit",
                q.shape(),
                k.shape(),
                lens.shape()
            )));
        }
        let g = self.heads / self.kv_heads;
        let ints = [("G", g), ("D", self.head_dim)];
        let pairs = rows * self.kv_heads;
        let up = |a: i32, b: i32| (a + b - 1) / b.max(1);
        let splits = up(longest as i32, KEYS_PER_BLOCK).min(up(ENOUGH_BLOCKS, pairs)).max(1);
        let (dtype, threads) = (q.dtype(), WARPS * 32);
        if splits == 1 {
            return Ok(self.whole.apply(&[q, k, v, lens], &[(q.shape(), dtype)], pairs, threads, dtype, &ints)?.remove(0));
        }
        let part_shape = [rows, self.kv_heads, splits, g, self.head_dim];
        let stats_shape = [rows, self.kv_heads, splits, g, 2];
        let f32 = Dtype::Float32;
        let parts = self.split.apply(&[q, k, v, lens], &[(&part_shape, f32), (&stats_shape, f32)], pairs * splits, threads, dtype, &ints)?;
        let merge_threads = (g * self.head_dim).min(1024);
        Ok(self.merge.apply(&[&parts[0], &parts[1]], &[(q.shape(), dtype)], pairs, merge_threads, dtype, &ints)?.remove(0))
    }
}
