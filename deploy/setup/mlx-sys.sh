#!/usr/bin/env bash
# Makes .cache/mlx-sys: mlx-sys 0.7.0 from crates.io with llmq's Linux changes, used by the
# workspace through [patch.crates-io]. Nothing of mlx-sys is committed; only these changes are.
#   1. build.rs: llmq's own (deploy/mlx-sys/build.rs): mlx-c against the MLX wheel, no Metal.
#   2. src/mach_time.c: mach_approximate_time() for Linux (mlx-rs seeds its RNG with it).
#   3. mlx/c/private/io.h: GCC 12 has no <format>; std::format -> a small local formatter.
#   4. mlx/c/half.h: 16-bit float16_t/bfloat16_t typedefs where the CPU has no half types.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache="$root/.cache"
dest="$cache/mlx-sys"
stamp="$dest/.llmq-patched"
version=0.7.0
recipe_hash=$(cat "$0" "$root/deploy/mlx-sys/build.rs" "$root/deploy/mlx-sys/mach_time.c" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe_hash" ]; then
  exit 0
fi

# Fetch the crate with cargo itself, through a throwaway manifest.
fetch="$cache/downloads/fetch-mlx-sys"
mkdir -p "$fetch/src"
cat >"$fetch/Cargo.toml" <<TOML
[package]
name = "fetch-mlx-sys"
version = "0.0.0"
edition = "2021"
[dependencies]
mlx-sys = "=$version"
[workspace]
TOML
echo 'fn main() {}' >"$fetch/src/main.rs"
(cd "$fetch" && cargo fetch -q) || { echo "setup: could not fetch mlx-sys $version from crates.io" >&2; exit 1; }
crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/mlx-sys-$version.crate 2>/dev/null | head -n1)
[ -n "$crate" ] || { echo "setup: mlx-sys-$version.crate not found in cargo's cache" >&2; exit 1; }

rm -rf "$dest" "$dest.tmp"
mkdir -p "$dest.tmp"
tar xzf "$crate" -C "$dest.tmp"
mv "$dest.tmp/mlx-sys-$version" "$dest"
rmdir "$dest.tmp"

cp "$root/deploy/mlx-sys/build.rs" "$dest/build.rs"
cp "$root/deploy/mlx-sys/mach_time.c" "$dest/src/mach_time.c"

io="$dest/src/mlx-c/mlx/c/private/io.h"
grep -q 'std::format' "$io" || { echo "setup: $io no longer uses std::format: review the patch" >&2; exit 1; }
perl -0pi -e 's/std::format\(/llmq_compat::format(/g' "$io"
perl -0pi -e 's|#include <streambuf>\n|#include <streambuf>\n#include <sstream>\n#include <string>\n\n// llmq: GCC 12 lacks <format>; "{}" placeholders are filled in order.\nnamespace llmq_compat {\ninline void format_into(std::ostringstream\& out, const char* f) {\n  out << f;\n}\ntemplate <typename T, typename... Rest>\nvoid format_into(std::ostringstream\& out, const char* f, const T\& v, const Rest\&... rest) {\n  for (; *f; ++f) {\n    if (f[0] == \x27{\x27 \&\& f[1] == \x27}\x27) {\n      out << v;\n      format_into(out, f + 2, rest...);\n      return;\n    }\n    out << *f;\n  }\n}\ntemplate <typename... Args>\nstd::string format(const char* f, const Args\&... args) {\n  std::ostringstream out;\n  format_into(out, f, args...);\n  return out.str();\n}\n} // namespace llmq_compat\n|' "$io"
grep -q 'namespace llmq_compat' "$io" || { echo "setup: could not patch $io" >&2; exit 1; }

half="$dest/src/mlx-c/mlx/c/half.h"
perl -0pi -e 's|#ifdef __cplusplus\n}\n#endif\n\n#endif|/* llmq: CPUs without native half types carry them as their 16 raw bits. */\n#include <stdint.h>\n#ifndef HAS_FLOAT16\n#define HAS_FLOAT16\ntypedef uint16_t float16_t;\n#endif\n#ifndef HAS_BFLOAT16\n#define HAS_BFLOAT16\ntypedef uint16_t bfloat16_t;\n#endif\n\n#ifdef __cplusplus\n}\n#endif\n\n#endif|' "$half"
grep -q 'typedef uint16_t float16_t' "$half" || { echo "setup: could not patch $half" >&2; exit 1; }

echo "$recipe_hash" >"$stamp"
echo "setup: mlx-sys $version patched for Linux in $dest"
