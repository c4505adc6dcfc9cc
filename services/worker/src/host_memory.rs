//! Host memory when the device is a CPU. There MLX's buffers are the process's heap, and a
//! buffer of memory the process has not touched before costs a page fault per 4 KB page: a
//! long prompt's KV met fresh memory at its first chunk, a stall of one tick on the cores the
//! streams decode on (BENCHMARKS.md, "A long prompt arriving while streams decode"). MLX's cache of freed buffers reuses a buffer only for a request of nearly its size,
//! so a new prompt length meets fresh memory again.
//!
//! So on a CPU the worker (1) keeps freed memory in the process: glibc serves buffers up to
//! 32 MB from its heap and keeps up to 2 GB of freed heap instead of giving it back; (2) gives
//! every thread that one heap: glibc otherwise gives threads that allocate at the same time
//! heaps (arenas) of their own, and a buffer made on a thread whose heap is not the reserve's
//! meets fresh memory (the decode batch's growth when rows join); (3) lets MLX free buffers at once (cache limit 0), so that
//! glibc reuses them for any size; (4) faults its reserve in once at start, through MLX's own
//! allocations, so that the first long prompt finds it.

/// glibc's `mallopt` parameters (malloc.h).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    pub const M_TRIM_THRESHOLD: i32 = -1;
    pub const M_MMAP_THRESHOLD: i32 = -3;
    pub const M_ARENA_MAX: i32 = -8;
    extern "C" {
        pub fn mallopt(param: i32, value: i32) -> i32;
    }
}

/// The largest buffer glibc may serve from its heap (its ceiling for the mmap threshold).
const LARGEST_HEAP_BUFFER: usize = 32 << 20;

/// Freed memory stays in the process for reuse (see the module's doc); MLX frees buffers at
/// once unless `mlx_cache_limit` says otherwise. Whether glibc took the settings (false on
/// another C library: then only MLX's cache is changed).
pub fn keep_freed(mlx_cache_limit: Option<u64>) -> Result<bool, mlx_rs::error::Exception> {
    if mlx_cache_limit.is_none() {
        mlx_rs::memory::set_cache_limit(0)?;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters; the values are in their ranges.
        let ok = unsafe {
            glibc::mallopt(glibc::M_MMAP_THRESHOLD, LARGEST_HEAP_BUFFER as i32) == 1
                && glibc::mallopt(glibc::M_TRIM_THRESHOLD, i32::MAX) == 1
        };
        Ok(ok)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    Ok(false)
}

/// Gives every thread of the process glibc's one main heap (see the module's doc): call it
/// first thing in `main`, before other threads exist, since a thread keeps the heap it first
/// allocated from. Whether glibc took the setting.
pub fn one_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter; 1 is in its range.
        unsafe { glibc::mallopt(glibc::M_ARENA_MAX, 1) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Faults `bytes` of memory in through MLX's allocator (buffers just under the largest heap
/// buffer, written once, then freed), so that later buffers reuse it: any buffer glibc serves
/// from its heap then fits in one freed piece, whatever small allocations came to sit between
/// the pieces. Call after `keep_freed`.
pub fn fault_in(bytes: u64) -> Result<(), mlx_rs::error::Exception> {
    const PIECE: usize = (LARGEST_HEAP_BUFFER - (64 << 10)) / 4; // f32 elements
    let pieces = (bytes as usize).div_ceil(PIECE * 4);
    let one = mlx_rs::Array::from_f32(1.0);
    let mut held = Vec::with_capacity(pieces);
    for _ in 0..pieces {
        // `zeros` alone is a broadcast scalar: adding one makes MLX write every element.
        let a = mlx_rs::ops::zeros::<f32>(&[PIECE as i32])?.add(&one)?;
        a.eval()?;
        held.push(a);
    }
    drop(held);
    mlx_rs::memory::clear_cache()
}

/// The reserve a CPU worker faults in by default: one sequence of the whole context and its
/// prefix-cache copy, at most the KV budget.
pub fn default_reserve(context_tokens: usize, kv_bytes_per_token: u64, kv_budget: u64) -> u64 {
    (2 * context_tokens as u64 * kv_bytes_per_token).min(kv_budget)
}
