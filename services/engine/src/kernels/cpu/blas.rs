//! Which kernels OpenBLAS runs on this CPU. On a CPU, MLX's matrix products go to OpenBLAS
//! (all of a prefill chunk's; `cpu_matmul` takes a decode step's few rows), and OpenBLAS picks
//! its kernels once, when the library loads, from the CPU's family and model numbers. A model
//! newer than the library gets its oldest x86-64 kernels (SSE3, "Prescott"): Debian bookworm's
//! OpenBLAS 0.3.21 on an Intel Xeon of model 207 (Emerald Rapids, AVX-512) did, and SmolLM2's two
//! 3,000-token prompts took 44-49 s to prefill on 2 cores instead of 30 with its AVX-512
//! kernels. `OPENBLAS_CORETYPE` names the kernels instead, but only when set before the library
//! loads, so the binary sets it and runs itself again (`kernels_to_ask`, called first in `main`).

use std::ffi::{c_char, c_void, CStr};

/// OpenBLAS's x86-64 cores older than AVX: where it lands on a CPU it does not know.
const PRE_AVX: [&str; 12] = [
    "unknown",
    "katmai",
    "coppermine",
    "northwood",
    "prescott",
    "banias",
    "atom",
    "core2",
    "penryn",
    "dunnington",
    "nehalem",
    "nano",
];

/// The kernels to ask OpenBLAS for, when it chose kernels older than AVX on a CPU with AVX2 and
/// FMA: `SkylakeX` with AVX-512 (F, BW, DQ, VL), `Haswell` otherwise. None where it chose
/// newer ones, where `OPENBLAS_CORETYPE` is already set (the user's choice, or this process is
/// the run again), or where the process has no OpenBLAS.
pub fn kernels_to_ask() -> Option<&'static str> {
    if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
        return None;
    }
    better_kernels(&openblas_core()?, &cpu_features())
}

/// The CPU features that decide OpenBLAS's x86-64 kernels.
#[derive(Debug, Default, Clone, Copy)]
pub struct Features {
    pub avx2_fma: bool,
    pub avx512: bool,
}

fn cpu_features() -> Features {
    #[cfg(target_arch = "x86_64")]
    {
        Features {
            avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            avx512: is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    Features::default()
}

/// The kernels to ask for instead of `core` (OpenBLAS's name for its choice) on a CPU with
/// `features`.
pub fn better_kernels(core: &str, features: &Features) -> Option<&'static str> {
    if !PRE_AVX.contains(&core.to_ascii_lowercase().as_str()) || !features.avx2_fma {
        return None;
    }
    Some(if features.avx512 {
        "SkylakeX"
    } else {
        "Haswell"
    })
}

/// The name of the kernels OpenBLAS chose, when the process has OpenBLAS (looked up at run time:
/// it comes in with MLX's library, and another BLAS may stand in its place).
fn openblas_core() -> Option<String> {
    extern "C" {
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
    // SAFETY: dlsym with glibc's RTLD_DEFAULT (null) and a NUL-terminated name; the function
    // found has OpenBLAS's signature `char *openblas_get_corename(void)` and returns a static
    // NUL-terminated string.
    unsafe {
        let f = dlsym(std::ptr::null_mut(), c"openblas_get_corename".as_ptr());
        if f.is_null() {
            return None;
        }
        let get: extern "C" fn() -> *const c_char = std::mem::transmute(f);
        let name = get();
        (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pre_avx_kernels_on_an_avx2_cpu_are_replaced() {
        let avx512 = Features {
            avx2_fma: true,
            avx512: true,
        };
        let avx2 = Features {
            avx2_fma: true,
            avx512: false,
        };
        let old = Features::default();
        assert_eq!(better_kernels("Prescott", &avx512), Some("SkylakeX"));
        assert_eq!(better_kernels("prescott", &avx2), Some("Haswell"));
        assert_eq!(better_kernels("Core2", &avx2), Some("Haswell"));
        assert_eq!(
            better_kernels("Prescott", &old),
            None,
            "a CPU without AVX2 keeps them"
        );
        assert_eq!(
            better_kernels("Haswell", &avx512),
            None,
            "a choice with AVX stands"
        );
        assert_eq!(better_kernels("Zen", &avx2), None);
        assert_eq!(better_kernels("SkylakeX", &avx512), None);
    }
}
