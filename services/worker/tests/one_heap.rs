//! On a CPU, memory faulted in by `host_memory` on one thread serves buffers that MLX makes for
//! another, once every thread allocates from one heap. Its own `main` (no test harness): the
//! setting must come before any other thread allocates.

use llmq_worker::host_memory;

/// Minor page faults of the whole process so far.
fn faults() -> i64 {
    #[repr(C)]
    struct Rusage([i64; 18]);
    extern "C" {
        fn getrusage(who: i32, usage: *mut Rusage) -> i32;
    }
    let mut r = Rusage([0; 18]);
    // SAFETY: getrusage(RUSAGE_SELF) fills the struct it is given (18 longs on x86-64 and arm64).
    assert_eq!(unsafe { getrusage(0, &mut r) }, 0);
    r.0[8] // ru_minflt, after two timevals and four longs
}

fn main() {
    assert!(host_memory::one_heap(), "glibc took the setting");
    assert!(host_memory::keep_freed(None).unwrap(), "glibc took the settings");
    host_memory::fault_in(96 << 20).unwrap();
    for mb in [10usize, 23] {
        // A thread of its own, as the worker's device thread is not the one that started it.
        let n = std::thread::spawn(move || {
            let before = faults();
            let a = mlx_rs::ops::zeros::<f32>(&[(mb << 18) as i32]).unwrap().add(mlx_rs::Array::from_f32(2.0)).unwrap();
            a.eval().unwrap();
            assert_eq!(a.as_slice::<f32>()[(mb << 18) - 1], 2.0);
            faults() - before
        })
        .join()
        .unwrap();
        let pages = (mb << 20) as i64 / 4096;
        assert!(n < pages / 10, "{n} faults for a {mb} MB buffer made on another thread after the reserve");
    }
    println!("one_heap: ok");
}
