//! The process's page faults, for the host memory tests.

/// Minor page faults of the whole process so far.
pub fn faults() -> i64 {
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
