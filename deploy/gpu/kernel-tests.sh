#!/usr/bin/env bash
# Runs on the GPU machine: llmq's CUDA kernels' tests (ignored elsewhere: they need CUDA).
# Expects the engine's test binaries in $BIN (built here with `cargo test --release -p
# llmq-engine --test qmv --test qmm --test row_attention --test experts --test delta_step --no-run` and copied
# from target/release/deps/ without their hash suffix) and MLX's CUDA build unpacked
# (`eval "$(bash deploy/gpu/unpack-mlx-cuda.sh unpack DIR/part2)"`). The tests find the
# repository's fixtures where it was built, so /work/main is linked to this checkout.
set -uo pipefail
BIN=${BIN:-.gpu/bin}
mkdir -p /work 2>/dev/null && [ -e /work/main ] || ln -sfn "$PWD" /work/main 2>/dev/null
status=0
for t in qmv qmm row_attention experts delta_step; do
  echo "== $t"
  timeout 300 "$BIN/$t" --ignored || status=1
done
exit $status
