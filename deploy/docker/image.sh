#!/usr/bin/env bash
# Builds llmq's image (tag llmq:local) on a Docker without registry access: the base image from
# set-up, and the binary and MLX libraries of this checkout's release build (`make build`).
# The context is staged in .cache/image/context, so Docker is sent a few files, not the tree.
#   bash deploy/docker/image.sh [tag]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tag=${1:-llmq:local}
bin="$root/target/release/llmq"
mlx="$root/.cache/mlx/cpu"
die() { echo "image: FAILED: $*" >&2; exit 1; }
[ -x "$bin" ] || die "$bin missing: run make build"
[ -f "$mlx/mlx/lib/libmlx.so" ] || die "MLX missing in $mlx: run make setup"
docker image inspect llmq-base:latest >/dev/null 2>&1 || die "no llmq-base image: run deploy/setup/setup.sh image"

ctx="$root/.cache/image/context"
rm -rf "$ctx" && mkdir -p "$ctx/mlx/mlx"
cp "$root/deploy/docker/Dockerfile" "$ctx/"
strip -o "$ctx/llmq" "$bin"
cp -a "$mlx/mlx/lib" "$ctx/mlx/mlx/"
# The wheel's own libraries, without the reference BLAS set-up moved aside (libblas-*.so is a
# link to Debian's OpenBLAS, which the base image has at the same path).
mkdir -p "$ctx/mlx/mlx_cpu.libs"
find "$mlx/mlx_cpu.libs" -maxdepth 1 ! -name '*.reference' ! -type d -exec cp -a {} "$ctx/mlx/mlx_cpu.libs/" \;
docker build --network none -t "$tag" "$ctx" >"$ctx.log" 2>&1 || { cat "$ctx.log" >&2; die "docker build"; }
docker run --rm --network none "$tag" llmq --version >/dev/null || die "the image's llmq does not start"
echo "image: $tag, $(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=si)B"
