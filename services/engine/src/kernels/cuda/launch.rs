//! llmq's own CUDA kernels, compiled by MLX through NVRTC: a kernel's source, its inputs and
//! outputs by name, and its launch (grid, block, template arguments) through mlx-c's custom
//! kernel API. The kernels themselves are in the modules beside this one, and the masked argmax in
//! [`crate::mask`].

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, StreamOrDevice};

/// Whether llmq's kernels can run here: MLX has CUDA and computes on the GPU.
pub(crate) fn available() -> bool {
    let mut cuda = false;
    let status = unsafe { mlx_sys::mlx_cuda_is_available(&mut cuda) };
    status == 0 && cuda && crate::device::on_gpu()
}

/// The error of a kernel called where it cannot run (the dispatch in [`crate::kernels`] asks
/// each kernel's `ready` first, so this names a mistake there).
pub(crate) fn unavailable() -> Exception {
    Exception::custom("llmq's CUDA kernels are not available on this device")
}

/// Kernels made once per process where llmq's kernels can run (`available`): `make`'s result
/// kept in `cell`; None without CUDA, or when making them failed (logged as `what` unavailable,
/// so the callers take MLX's path).
pub(crate) fn once<K>(
    cell: &'static OnceLock<Option<K>>,
    what: &str,
    make: impl FnOnce() -> Result<K, Exception>,
) -> Option<&'static K> {
    cell.get_or_init(|| {
        if !available() {
            return None;
        }
        make()
            .inspect_err(|e| tracing::warn!(error = %e, "{what} unavailable; using MLX's path"))
            .ok()
    })
    .as_ref()
}

/// One custom kernel of MLX (compiled through NVRTC the first time it runs), freed on drop.
pub(crate) struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

// SAFETY: the handle is an immutable description of the kernel (its name, source and argument
// names); applying it only reads it, and MLX serialises the resulting work on its stream.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

fn failed(what: &str) -> Exception {
    Exception::custom(format!("custom kernel: {what} failed"))
}

fn c_string(s: &str) -> Result<CString, Exception> {
    CString::new(s).map_err(|_| Exception::custom("custom kernel: a string holds a NUL byte"))
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
        let owned = items
            .iter()
            .map(|s| c_string(s))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
        Ok(Strings(unsafe {
            mlx_sys::mlx_vector_string_new_data(ptrs.as_ptr() as *mut *const c_char, ptrs.len())
        }))
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
    /// A kernel over `inputs` into `outputs`, with `shared_bytes` of dynamic shared memory.
    pub(crate) fn new(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        shared_bytes: i32,
    ) -> Result<Self, Exception> {
        let (name, source, header) = (c_string(name)?, c_string(source)?, c_string(header)?);
        let (inputs, outputs) = (Strings::new(inputs)?, Strings::new(outputs)?);
        let raw = unsafe {
            mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                inputs.0,
                outputs.0,
                source.as_ptr(),
                header.as_ptr(),
                true,
                shared_bytes,
            )
        };
        if raw.ctx.is_null() {
            return Err(failed("creating the kernel"));
        }
        Ok(Kernel(raw))
    }

    /// Queues the kernel over `inputs` with `blocks` blocks of `threads` threads; `T` is
    /// `dtype`, and the integer template arguments are `ints`.
    pub(crate) fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        blocks: i32,
        threads: i32,
        dtype: Dtype,
        ints: &[(&str, i32)],
    ) -> Result<Vec<Array>, Exception> {
        let config = Config(unsafe { mlx_sys::mlx_fast_cuda_kernel_config_new() });
        if config.0.ctx.is_null() {
            return Err(failed("creating a launch configuration"));
        }
        unsafe {
            for (shape, dtype) in outputs {
                check(
                    mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                        config.0,
                        shape.as_ptr(),
                        shape.len(),
                        (*dtype).into(),
                    ),
                    "adding an output",
                )?;
            }
            check(
                mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config.0, blocks * threads, 1, 1),
                "setting the grid",
            )?;
            check(
                mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config.0, threads, 1, 1),
                "setting the block",
            )?;
            for (name, value) in ints {
                let name = c_string(name)?;
                check(
                    mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                        config.0,
                        name.as_ptr(),
                        *value,
                    ),
                    "adding a template argument",
                )?;
            }
            let t = c_string("T")?;
            check(
                mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                    config.0,
                    t.as_ptr(),
                    dtype.into(),
                ),
                "adding the dtype",
            )?;
        }
        let ptrs: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
        let ins = Arrays(unsafe { mlx_sys::mlx_vector_array_new_data(ptrs.as_ptr(), ptrs.len()) });
        let mut outs = Arrays(unsafe { mlx_sys::mlx_vector_array_new() });
        let stream = StreamOrDevice::default();
        check(
            unsafe {
                mlx_sys::mlx_fast_cuda_kernel_apply(
                    &mut outs.0,
                    self.0,
                    ins.0,
                    config.0,
                    stream.as_ref().as_ptr(),
                )
            },
            "launching",
        )?;
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
