//! On a CPU, memory faulted in by `host_memory` is reused by MLX's later buffers: a buffer of
//! a size never allocated before costs (almost) no page faults. Its own test binary: the
//! allocator settings are the process's.

mod faults;

use faults::faults;
use llmq_worker::host_memory;

/// Page faults while MLX writes a new buffer of `bytes` (its elements each set, as a KV
/// cache's first chunk writes its buffer).
fn faults_of_new_buffer(bytes: usize) -> i64 {
    let before = faults();
    let a = mlx_rs::ops::zeros::<f32>(&[(bytes / 4) as i32])
        .unwrap()
        .add(mlx_rs::Array::from_f32(2.0))
        .unwrap();
    a.eval().unwrap();
    assert_eq!(a.as_slice::<f32>()[bytes / 4 - 1], 2.0);
    faults() - before
}

#[test]
fn faulted_in_memory_serves_later_buffers_of_any_size() {
    let pages = |bytes: usize| (bytes / 4096) as i64;
    // Fresh memory: a fault per page.
    let fresh = faults_of_new_buffer(12 << 20);
    assert!(
        fresh >= pages(12 << 20) * 3 / 4,
        "{fresh} faults for a fresh 12 MB buffer"
    );
    assert!(
        host_memory::keep_freed(None).unwrap(),
        "glibc took the settings"
    );
    host_memory::fault_in(96 << 20).unwrap();
    // Sizes the reserve's 4 MB pieces never had.
    for mb in [10, 7, 23] {
        let n = faults_of_new_buffer(mb << 20);
        assert!(
            n < pages(mb << 20) / 10,
            "{n} faults for a {mb} MB buffer after the reserve"
        );
    }
}
