//! Decode attention over rows of different lengths, as CUDA kernels (NVIDIA GPUs only).
//!
//! A decode step's rows live in one or more decode batches (length groups), each with its own
//! pool of keys and values as token slots [pool slots, kv_heads, head_dim] in blocks of
//! `BLOCK_TOKENS` ([`crate::batch`]); each row attends over its own first `len` positions,
//! position p at slot `table[p / BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS` of its
//! group's pool. MLX's fused attention takes no per-row lengths nor tables: it would need the
//! keys gathered and a mask, which falls back to unfused matrix products over the longest row,
//! several times the unmasked time. These kernels attend every row of every group in one
//! launch, reading only each row's keys, through its table.
//!
//! The kernels (our own source, compiled by MLX through NVRTC when the model loads): the
//! step's work is a list of items (row, first key, end key), one thread block per item and kv
//! head, every query head of that kv head together (grouped-query attention), so each key and
//! value is read once. A row's keys form one item, or several when a few long rows would leave
//! the GPU idle (`plan`); a second kernel then merges the items of each row. Within a block the
//! warps take the keys in turn; each lane holds `head_dim / 32` dimensions; scores keep a
//! running maximum (online softmax), and the warps' partial results are merged in shared memory.
//! A row of length 0 (a scratch slot) gets zeros.
//!
//! Invariants: the pools are row-contiguous (MLX copies them otherwise, which is correct but
//! slow, so callers pass the batches' own pools); an item never reads past its table (its end
//! is clamped to the table's width); the output has the queries' shape and dtype. On a machine
//! without CUDA, [`RowAttention::new`] gives `None` and callers use masked attention.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::batch::BLOCK_TOKENS;
use crate::kernels::cuda::launch::Kernel;

/// Warps per thread block.
const WARPS: i32 = 8;

/// Keys one block takes at most when rows are cut into items (see [`RowAttention::plan`]).
const KEYS_PER_BLOCK: i32 = 512;

/// Thread blocks that keep the GPU busy without splitting keys (an H200 has 132 SMs).
const ENOUGH_BLOCKS: i32 = 256;

/// The part both attention kernels share: one block's item (keys `begin..end` of one row) for
/// one kv head, accumulated with a running maximum by the warps in turn, then merged over the
/// warps in shared memory, leaving in `m`, `total` and `o` the block's maximum score, softmax
/// sum and weighted values (thread `t` holds dimension `t % D` of query head `t / D`). [`SCALE`],
/// `BS` (positions a block), `G` (query heads per kv head), `D` (head dim) and `T` (dtype) are
/// set per model. Inputs: `q` [rows, heads, 1, D] (every group's rows in order), `work` [items,
/// 4] int32 (row, first key, end key, group), `tables` [rows, width] int32 block ids, and each
/// group's pool `k<i>`, `v<i>` [slots, kv_heads, D]; `@SELECT@` becomes the choice of the
/// item's group.
const ACCUMULATE: &str = r#"
    constexpr int PER = D / 32;
    const int kv_heads = k0_shape[1];
    const int width = tables_shape[1];
    const int item = blockIdx.x / kv_heads;
    const int head = blockIdx.x % kv_heads;
    const int row = work[item * 4];
    const int begin = work[item * 4 + 1];
    const int end = work[item * 4 + 2];
    const int group = work[item * 4 + 3];
    const int pair = row * kv_heads + head;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const T* kp;
    const T* vp;
@SELECT@
    const int stop = min(end, width * BS);
    const int* table = tables + (size_t)row * width;
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
    for (int j = begin + warp; j < stop; j += WARPS) {
        const size_t slot = (size_t)table[j / BS] * BS + j % BS;
        const size_t at = (slot * kv_heads + head) * D + lane * PER;
        float kr[PER];
        float vr[PER];
        for (int i = 0; i < PER; ++i) {
            kr[i] = static_cast<float>(kp[at + i]);
            vr[i] = static_cast<float>(vp[at + i]);
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

/// Every row one item: the result goes straight to `out` (like `q`).
const WHOLE: &str = r#"
        out[(size_t)pair * G * D + t] = static_cast<T>(total > 0.f ? o / total : 0.f);
    }
"#;

/// Rows over several items: each block writes its normalised share to `part` (f32 [items,
/// kv_heads, G, D]) and its maximum and sum to `stats` (f32 [items, kv_heads, G, 2]).
const SPLIT: &str = r#"
        part[(size_t)blockIdx.x * G * D + t] = total > 0.f ? o / total : 0.f;
        if (d == 0) {
            stats[((size_t)blockIdx.x * G + g) * 2] = m;
            stats[((size_t)blockIdx.x * G + g) * 2 + 1] = total;
        }
    }
"#;

/// Merges each row's items (`spans` [rows, 2] int32: first item, count) into `out`, one
/// block per (row, kv head).
const MERGE: &str = r#"
    const int kv_heads = part_shape[1];
    const int row = blockIdx.x / kv_heads;
    const int head = blockIdx.x % kv_heads;
    const int first = spans[row * 2];
    const int count = spans[row * 2 + 1];
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int g = t / D;
        const int d = t % D;
        float m = -1e30f;
        for (int s = 0; s < count; ++s) {
            m = fmaxf(m, stats[(((size_t)(first + s) * kv_heads + head) * G + g) * 2]);
        }
        float total = 0.f;
        float o = 0.f;
        for (int s = 0; s < count; ++s) {
            const size_t at = ((size_t)(first + s) * kv_heads + head) * G + g;
            const float l = stats[at * 2 + 1];
            if (l > 0.f) {
                const float c = __expf(stats[at * 2] - m) * l;
                total += c;
                o += part[at * D + d] * c;
            }
        }
        out[(size_t)blockIdx.x * G * D + t] = static_cast<T>(total > 0.f ? o / total : 0.f);
    }
"#;

/// Most length groups one launch covers (the worker has four).
pub const MAX_GROUPS: usize = 4;

/// The source that points `kp` and `vp` at the pool of the item's group (of `groups`).
fn select_group(groups: usize) -> String {
    let mut src = String::from("    switch (group) {\n");
    for i in 0..groups {
        let label = if i + 1 < groups {
            format!("case {i}")
        } else {
            "default".to_string()
        };
        src.push_str(&format!("    {label}: kp = k{i}; vp = v{i}; break;\n"));
    }
    src.push_str("    }\n");
    src
}

/// The kernels of one model's attention shape: `whole` (every row one item) and `split` (rows
/// over several items, then `merge`). Both attention kernels take `MAX_GROUPS` groups' pools;
/// a step with fewer passes `spare` (one zero block, never read) for the rest, so each kernel
/// has one form, compiled when the model loads (`new` runs each once): a kernel's first run
/// compiles it (NVRTC, about a second), which a form first met while serving would stall every
/// stream for.
pub struct RowAttention {
    whole: Kernel,
    split: Kernel,
    merge: Kernel,
    spare: Array,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}

/// A decode step's work for the kernels, made once a step ([`RowAttention::plan`]) and used by
/// every layer: the items, and with split rows each row's items.
pub struct RowPlan {
    work: Array,
    items: i32,
    rows: i32,
    spans: Option<Array>,
}

impl RowAttention {
    /// The kernels for `heads` query heads over `kv_heads` kv heads of `head_dim` dimensions
    /// in `dtype`, scores scaled by `scale`, compiled; `None` without CUDA or for a shape they
    /// do not cover (`head_dim` a multiple of 32 up to 256, `heads` a multiple of `kv_heads`),
    /// and when `LLMQ_MASKED_DECODE_ATTENTION` is set (to compare the two).
    pub fn new(heads: i32, kv_heads: i32, head_dim: i32, scale: f32, dtype: Dtype) -> Option<Self> {
        if !crate::kernels::cuda::launch::available() {
            return None;
        }
        if head_dim % 32 != 0 || head_dim > 256 || kv_heads <= 0 || heads % kv_heads != 0 {
            return None;
        }
        if std::env::var_os("LLMQ_MASKED_DECODE_ATTENTION").is_some_and(|v| v != "0") {
            return None;
        }
        let header = format!(
            "constexpr float SCALE = {scale:.9e}f;\nconstexpr int WARPS = {WARPS};\nconstexpr int BS = {BLOCK_TOKENS};\n"
        );
        let made = (|| -> Result<RowAttention, Exception> {
            let mut inputs = vec!["q".to_string(), "work".to_string(), "tables".to_string()];
            for i in 0..MAX_GROUPS {
                inputs.extend([format!("k{i}"), format!("v{i}")]);
            }
            let inputs: Vec<&str> = inputs.iter().map(|s| s.as_str()).collect();
            let body = ACCUMULATE.replace("@SELECT@", &select_group(MAX_GROUPS));
            let r = RowAttention {
                whole: Kernel::new(
                    "llmq_row_attention",
                    &inputs,
                    &["out"],
                    &format!("{body}{WHOLE}"),
                    &header,
                    0,
                )?,
                split: Kernel::new(
                    "llmq_row_attention_split",
                    &inputs,
                    &["part", "stats"],
                    &format!("{body}{SPLIT}"),
                    &header,
                    0,
                )?,
                merge: Kernel::new(
                    "llmq_row_attention_merge",
                    &["part", "stats", "spans"],
                    &["out"],
                    MERGE,
                    "",
                    0,
                )?,
                spare: mlx_rs::ops::zeros_dtype(&[BLOCK_TOKENS as i32, kv_heads, head_dim], dtype)?,
                heads,
                kv_heads,
                head_dim,
            };
            // Compile both forms now: one row over one key, whole, then split.
            let q = mlx_rs::ops::zeros_dtype(&[1, heads, 1, head_dim], dtype)?;
            let spare = r.spare.clone();
            let table = Array::from_slice(&[0i32], &[1, 1]);
            for split in [false, true] {
                let plan = RowPlan {
                    work: Array::from_slice(&[0i32, 0, 1, 0], &[1, 4]),
                    items: 1,
                    rows: 1,
                    spans: split.then(|| Array::from_slice(&[0i32, 1], &[1, 2])),
                };
                r.apply(&plan, &q, &[(&spare, &spare)], &table)?.eval()?;
            }
            Ok(r)
        })();
        match made {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "no row attention kernel; decode uses masked attention");
                None
            }
        }
    }

    /// The work of a step whose rows (every group's slots in order, row r in group
    /// `groups[r]`) attend over `lens` keys each (0 for a scratch slot), or with a `window`
    /// over the last that many of them. Every row is one item, unless the rows with keys leave
    /// fewer than `ENOUGH_BLOCKS` blocks and some row is longer than `KEYS_PER_BLOCK`: rows are
    /// then cut into items of at most that many keys.
    pub fn plan(&self, lens: &[usize], groups: &[i32], window: Option<usize>) -> RowPlan {
        let rows = lens.len() as i32;
        let first = |len: usize| window.map_or(0, |w| len.saturating_sub(w));
        let longest = lens.iter().map(|&l| l - first(l)).max().unwrap_or(0);
        let per = KEYS_PER_BLOCK as usize;
        // Scratch slots (no keys) take no time: only rows with keys count toward a busy GPU.
        let live = lens.iter().filter(|&&l| l > 0).count() as i32;
        let split = live * self.kv_heads < ENOUGH_BLOCKS && longest > per;
        let (mut work, mut spans) = (vec![], vec![]);
        for (r, &len) in lens.iter().enumerate() {
            let from = first(len);
            let keys = len - from;
            let n = if split { keys.div_ceil(per).max(1) } else { 1 };
            spans.extend([(work.len() / 4) as i32, n as i32]);
            let group = groups.get(r).copied().unwrap_or(0);
            for i in 0..n {
                let (b, e) = (from + keys * i / n, from + keys * (i + 1) / n);
                work.extend([r as i32, b as i32, e as i32, group]);
            }
        }
        let items = (work.len() / 4) as i32;
        RowPlan {
            work: Array::from_slice(&work, &[items, 4]),
            items,
            rows,
            spans: split.then(|| Array::from_slice(&spans, &[rows, 2])),
        }
    }

    /// Attention of each row's query `q` [rows, heads, 1, head_dim] (every group's slots in
    /// order) over its keys and values in its group's pool `kv` ([pool slots, kv_heads,
    /// head_dim] each) through its table (`tables` [rows, width] int32), as `plan` laid out.
    pub fn apply(
        &self,
        plan: &RowPlan,
        q: &Array,
        kv: &[(&Array, &Array)],
        tables: &Array,
    ) -> Result<Array, Exception> {
        let rows = q.shape()[0];
        let shapes_fit = q.shape() == [rows, self.heads, 1, self.head_dim]
            && rows == plan.rows
            && tables.ndim() == 2
            && tables.shape()[0] == rows
            && tables.dtype() == Dtype::Int32
            && kv.iter().all(|(k, v)| {
                k.ndim() == 3
                    && k.shape()[1] == self.kv_heads
                    && k.shape()[2] == self.head_dim
                    && k.shape() == v.shape()
            });
        if !shapes_fit || kv.is_empty() || kv.len() > MAX_GROUPS {
            return Err(Exception::custom(format!(
                "row attention kernel: q {:?} over {} pools, tables {:?}, does not fit",
                q.shape(),
                kv.len(),
                tables.shape()
            )));
        }
        let g = self.heads / self.kv_heads;
        let ints = [("G", g), ("D", self.head_dim)];
        let mut inputs = vec![q, &plan.work, tables];
        for i in 0..MAX_GROUPS {
            // Spare pools stand for absent groups, which no item names.
            let (k, v) = kv.get(i).copied().unwrap_or((&self.spare, &self.spare));
            inputs.extend([k, v]);
        }
        let (dtype, threads) = (q.dtype(), WARPS * 32);
        let blocks = plan.items * self.kv_heads;
        let Some(spans) = plan.spans.as_ref() else {
            return Ok(self
                .whole
                .apply(
                    &inputs,
                    &[(q.shape(), dtype)],
                    blocks,
                    threads,
                    dtype,
                    &ints,
                )?
                .remove(0));
        };
        let part_shape = [plan.items, self.kv_heads, g, self.head_dim];
        let stats_shape = [plan.items, self.kv_heads, g, 2];
        let f32 = Dtype::Float32;
        let parts = self.split.apply(
            &inputs,
            &[(&part_shape, f32), (&stats_shape, f32)],
            blocks,
            threads,
            dtype,
            &ints,
        )?;
        let merge_threads = (g * self.head_dim).min(1024);
        let out = self.merge.apply(
            &[&parts[0], &parts[1], spans],
            &[(q.shape(), dtype)],
            rows * self.kv_heads,
            merge_threads,
            dtype,
            &ints,
        )?;
        Ok(out.into_iter().next().expect("one output"))
    }
}
