//! On a CPU, memory faulted in by `host_memory` on one thread serves buffers that MLX makes for
//! another, once every thread allocates from one heap. Its own `main` (no test harness): the
//! setting must come before any other thread allocates.

mod faults;

use faults::faults;
use llmq_worker::host_memory;

fn main() {
    assert!(host_memory::one_heap(), "glibc took the setting");
    assert!(
        host_memory::keep_freed(None).unwrap(),
        "glibc took the settings"
    );
    host_memory::fault_in(96 << 20).unwrap();
    for mb in [10usize, 23] {
        // A thread of its own, as the worker's device thread is not the one that started it.
        let n = std::thread::spawn(move || {
            let before = faults();
            let a = mlx_rs::ops::zeros::<f32>(&[(mb << 18) as i32])
                .unwrap()
                .add(mlx_rs::Array::from_f32(2.0))
                .unwrap();
            a.eval().unwrap();
            assert_eq!(a.as_slice::<f32>()[(mb << 18) - 1], 2.0);
            faults() - before
        })
        .join()
        .unwrap();
        let pages = (mb << 20) as i64 / 4096;
        assert!(
            n < pages / 10,
            "{n} faults for a {mb} MB buffer made on another thread after the reserve"
        );
    }
    println!("one_heap: ok");
}
