//! The gated delta rule's decode step as one CUDA kernel (Qwen3.5's linear-attention layers;
//! the rule is in `model/delta.rs`).
//!
//! Each value head of each row keeps a float32 state S [dk, dv]; a step decays it, corrects it
//! toward the head's value by beta and reads it with q. In MLX operations that is several passes
//! over every state (a decay, a recall, a write, a read; about eight state-sized reads and writes
//! compiled); the states dominate a batch's memory traffic (64 rows of a Qwen3.5-9B shape hold
//! 3.2 GB). Here one thread block takes one (row, value head) and each of its `dv` threads one
//! column of S, kept in registers: the state is read once and written once, and the recall and
//! the read are each thread's own sums (no reduction across threads). q and k, shared by the
//! block, sit in shared memory.
//!
//! Inputs (float32, row-contiguous; MLX copies others): q, k [n, key_heads, dk] (normed, q
//! scaled), v [n, heads, dv], g (log decay) and beta [n, heads], state [n, heads, dk, dv].
//! Outputs: o [n, heads, dv] and the states after the step. Value head h reads key head
//! h / (heads / key_heads), or h % key_heads when the heads are tiled (llama.cpp's order).

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::kernels::cuda::launch::{self, Kernel};

const SOURCE: &str = r#"
    const int pair = blockIdx.x;
    const int row = pair / HEADS;
    const int h = pair % HEADS;
    const int kh = TILED ? h % KEY_HEADS : h / (HEADS / KEY_HEADS);
    const int j = threadIdx.x;
    __shared__ float ks[DK];
    __shared__ float qs[DK];
    const size_t kbase = ((size_t)row * KEY_HEADS + kh) * DK;
    for (int i = j; i < DK; i += DV) {
        ks[i] = k[kbase + i];
        qs[i] = q[kbase + i];
    }
    __syncthreads();
    const float decay = expf(g[pair]);
    const float b = beta[pair];
    const size_t base = (size_t)pair * DK * DV + j;
    float s[DK];
    float recalled = 0.f;
    #pragma unroll
    for (int i = 0; i < DK; ++i) {
        s[i] = state[base + (size_t)i * DV] * decay;
        recalled += ks[i] * s[i];
    }
    const float fresh = (v[(size_t)pair * DV + j] - recalled) * b;
    float o = 0.f;
    #pragma unroll
    for (int i = 0; i < DK; ++i) {
        s[i] += ks[i] * fresh;
        o += qs[i] * s[i];
        state_out[base + (size_t)i * DV] = s[i];
    }
    out[(size_t)pair * DV + j] = o;
"#;

fn kernel() -> Option<&'static Kernel> {
    static KERNEL: OnceLock<Option<Kernel>> = OnceLock::new();
    launch::once(&KERNEL, "delta rule step kernel", || {
        Kernel::new(
            "llmq_delta_step",
            &["q", "k", "v", "g", "beta", "state"],
            &["out", "state_out"],
            SOURCE,
            "",
            0,
        )
    })
}

/// Fewest (row, value head) blocks a step gives the kernel: with fewer than a GPU's
/// multiprocessors (132 on an H100) most of them idle and the memory is read far below its speed;
/// MLX's compiled operations, which spread a state over many blocks, are then faster (one row of
/// Qwen3.5-9B's 32 heads: 9.6 ms a token against 8.4; 64 rows: a 26 ms step against 39).
pub const MIN_BLOCKS: i32 = 128;

/// Whether the kernel takes a step of `rows` rows of a layer of these dimensions here: CUDA,
/// `dv` threads a block (32 to 1024, whole warps), `dk` columns in registers (at most 256),
/// value heads a multiple of key heads, at least [`MIN_BLOCKS`] blocks, and not switched off
/// (`LLMQ_DELTA_STEP_KERNEL=0`); otherwise the layer's step is MLX's compiled operations.
pub fn covers(key_heads: i32, heads: i32, dk: i32, dv: i32, rows: i32) -> bool {
    (32..=1024).contains(&dv)
        && dv % 32 == 0
        && (1..=256).contains(&dk)
        && key_heads > 0
        && heads % key_heads == 0
        && rows.saturating_mul(heads) >= MIN_BLOCKS
        && switched_on()
        && kernel().is_some()
}

/// Unless `LLMQ_DELTA_STEP_KERNEL=0`, read once (every DeltaNet layer of every step asks).
fn switched_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("LLMQ_DELTA_STEP_KERNEL").is_none_or(|v| v != "0"))
}

/// One step of every row (shapes in the module's comment). Returns (o, states after).
pub fn step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
    tiled: bool,
) -> Result<(Array, Array), Exception> {
    let kernel = kernel().ok_or_else(launch::unavailable)?;
    let s = state.shape();
    let (n, heads, dk, dv) = (s[0], s[1], s[2], s[3]);
    let key_heads = q.shape()[1];
    let ints = [
        ("HEADS", heads),
        ("KEY_HEADS", key_heads),
        ("DK", dk),
        ("DV", dv),
        ("TILED", tiled as i32),
    ];
    let mut out = kernel.apply(
        &[q, k, v, g, beta, state],
        &[(&[n, heads, dv], Dtype::Float32), (s, Dtype::Float32)],
        n * heads,
        dv,
        Dtype::Float32,
        &ints,
    )?;
    let state = out.pop().expect("two outputs");
    Ok((out.pop().expect("two outputs"), state))
}
