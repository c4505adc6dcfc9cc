#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (README: "Benchmarks on an H200"): the 8b shape
# quantized to 4 bits in groups of 64 at load (random weights) beside mlx-lm's 4-bit model on
# the same MLX build, and llmq's own bf16 batch in the same call (a quantized model must not be
# slower than the dense one). Expects the llmq binary and Debian's nats-server in .gpu/bin, the
# peer script in lab/peer/ and, for the peer, `eval "$(bash deploy/gpu/unpack-mlx-cuda.sh peer .gpu/mlx/peer)"`.
# PARTS picks what runs (default: single batch dense burst); SHAPE (8b) and BITS (4) the model.
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
SHAPE=${SHAPE:-8b} BITS=${BITS:-4}
Q="--quantize $BITS --group-size 64"
KV="--kv-budget-bytes 40000000000"
BATCH="--streams 64 --prompt-tokens 512 --output-tokens 256"
peer() { timeout 300 python3 lab/peer/peer_mlx_lm.py --shape "$SHAPE" --bits "$BITS" "$@" | tail -n 1; }
for part in ${PARTS:-single batch dense burst}; do
  case $part in
    single)
      timeout 200 llmq bench single --random-weights "$SHAPE" $Q --json
      peer --scenarios single ;;
    batch)
      timeout 240 llmq bench batch --random-weights "$SHAPE" $Q --json $KV $BATCH
      peer --scenarios batch ;;
    dense)
      timeout 240 llmq bench batch --random-weights "$SHAPE" --json $KV $BATCH ;;
    burst)
      timeout 240 llmq bench burst --random-weights "$SHAPE" $Q --json $KV
      peer --scenarios burst ;;
  esac
done
