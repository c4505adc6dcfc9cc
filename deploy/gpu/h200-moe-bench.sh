#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (README: "Benchmarks on an H200"): a mixture of
# experts of Qwen3-30B-A3B's shape (48 layers, 128 experts, 8 active, random bf16 weights) beside
# mlx-lm's qwen3_moe on the same MLX build, and the dense 8b shape as the check that the dense
# path did not slow. Expects the llmq binary and Debian's nats-server in .gpu/bin, the peer
# script in .gpu/ and, for the peer, `eval "$(bash deploy/gpu/unpack-mlx-cuda.sh peer .gpu/mlx/peer)"`.
# PARTS picks what runs (default: single batch burst dense).
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
# The KV budget: 40 GB on an H200, 8 GB beside the 61 GB of weights on an 80 GB H100.
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
  KV="--kv-budget-bytes 40000000000"
else
  KV="--kv-budget-bytes 8000000000"
fi
peer() { timeout 300 python3 lab/peer/peer_mlx_lm.py "$@" | tail -n 1; }
for part in ${PARTS:-single batch burst dense}; do
  case $part in
    single)
      timeout 300 llmq bench single --random-weights moe --json
      peer --shape moe --scenarios single ;;
    batch)
      timeout 300 llmq bench batch --random-weights moe --json $KV --streams 64 --prompt-tokens 512 --output-tokens 256
      peer --shape moe --scenarios batch ;;
    burst)
      timeout 300 llmq bench burst --random-weights moe --json $KV
      peer --shape moe --scenarios burst ;;
    dense)
      timeout 200 llmq bench single --random-weights 8b --json
      peer --shape 8b --scenarios single
      timeout 240 llmq bench batch --random-weights 8b --json --kv-budget-bytes 60000000000 --streams 64 --prompt-tokens 512 --output-tokens 256 ;;
  esac
done
