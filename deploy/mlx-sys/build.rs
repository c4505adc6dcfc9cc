//! llmq's build script for mlx-sys 0.7.0 on Linux, put in place of the crate's own
//! (which builds MLX from source for macOS and Metal) by deploy/setup/mlx-sys.sh.
//!
//! It builds mlx-c against the MLX of a PyPI wheel (LLMQ_MLX_DIR, the unpacked wheel's root),
//! links mlx-c statically and libmlx.so dynamically, and generates the bindings with
//! float16_t as a transparent u16 newtype (x86 has no native half type in C).
//! The final binaries' rpath is set by the workspace (.cargo/config.toml): a dependency's
//! build script cannot set it.

use std::{env, path::PathBuf};

#[path = "src/bindgen_config.rs"]
mod bindgen_config;

fn main() {
    println!("cargo:rerun-if-env-changed=LLMQ_MLX_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    let wheel = PathBuf::from(env::var("LLMQ_MLX_DIR").unwrap_or_else(|_| {
        panic!("LLMQ_MLX_DIR is not set: run deploy/setup/setup.sh (make setup) first")
    }));
    let cmake_dir = wheel.join("mlx/share/cmake/MLX");
    if !cmake_dir.join("MLXConfig.cmake").is_file() {
        panic!(
            "no MLX CMake package at {}: run deploy/setup/setup.sh (make setup)",
            cmake_dir.display()
        );
    }
    let lib_dir = wheel.join("mlx/lib");

    let mlx_c_root = PathBuf::from("src/mlx-c");
    let dst = cmake::Config::new(&mlx_c_root)
        .define("MLX_C_USE_SYSTEM_MLX", "ON")
        .define("MLX_DIR", &cmake_dir)
        .define("MLX_C_BUILD_EXAMPLES", "OFF")
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("CMAKE_INSTALL_LIBDIR", "lib")
        .profile("Release")
        .build();

    println!("cargo:rustc-link-search=native={}/lib", dst.display());
    println!("cargo:rustc-link-lib=static=mlxc");

    cc::Build::new()
        .file("src/mach_time.c")
        .compile("llmq_mach_time");

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo::metadata=libdir={}", lib_dir.display());

    let headers =
        bindgen_config::discover_headers(&mlx_c_root).expect("Unable to discover mlx-c headers");
    for header in &headers {
        println!("cargo:rerun-if-changed={}", header.display());
    }
    let bindings = bindgen_config::builder(&mlx_c_root, &headers)
        .new_type_alias("float16_t")
        .derive_default(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .expect("Unable to generate mlx-c bindings");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("Unable to write mlx-c bindings");
}
