#!/usr/bin/env bash
# Builds llmq's image (tag llmq:local) on a Docker without registry access: the base image from
# set-up, and the binary and MLX libraries of this checkout's release build (`make build`).
# Writes .env with the compose stack's NATS passwords if there is none.
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
# The compose stack's NATS passwords, one per role and client user, random, in .env (gitignored;
# docker-compose reads it): written once, never overwritten. nats-server reads a variable as a
# configuration value, so a password starts with letters (a leading digit would make a number).
if [ ! -f "$root/.env" ]; then
  umask 077
  for who in INTAKE WORKER GATEWAY CLIENT1 CLIENT2; do
    echo "LLMQ_NATS_${who}_PASSWORD=pw$(head -c 32 /dev/urandom | base64 | tr -dc A-Za-z0-9 | head -c 24)"
  done >"$root/.env"
  echo "image: wrote $root/.env (the compose stack's NATS passwords)"
fi
echo "image: $tag, $(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=si)B"
