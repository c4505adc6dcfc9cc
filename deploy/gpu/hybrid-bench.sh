#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (README: "Benchmarks on an H200"): the hybrid
# families (issue 50) beside mlx-lm's own lfm2 and qwen3_5 on the same MLX build, random bf16
# weights of LFM2-1.2B's and Qwen3.5-9B's text shapes: one stream, 64 streams, the burst (16
# streams decoding, four 8192-token prompts arriving) and a 4096-token prefix hit against its
# miss, with new tokens after it and resent whole. Expects the llmq binary and Debian's nats-server in .gpu/bin and, for the peer,
# `eval "$(bash deploy/gpu/unpack-mlx-cuda.sh peer .gpu/mlx/peer)"`.
#   SHAPES: default "lfm2 qwen35" (tiny-lfm2 tiny-qwen35 on a CPU); PARTS: any of single batch
#   burst prefix (default all); PEER=0 skips mlx-lm.
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
KV="--kv-budget-bytes ${KV_BYTES:-40000000000}"
peer() {
  [ "${PEER:-1}" = 1 ] || return 0
  timeout 300 python3 lab/peer/peer_mlx_lm.py "$@" | tail -n 1
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
for shape in ${SHAPES:-lfm2 qwen35}; do
  echo "== $shape"
  for part in ${PARTS:-single batch burst prefix}; do
    case $part in
      single)
        timeout 300 llmq bench single --random-weights "$shape" --json
        peer --shape "$shape" --scenarios single ;;
      batch)
        timeout 300 llmq bench batch --random-weights "$shape" --json $KV --streams 64 \
          --prompt-tokens 512 --output-tokens 256
        peer --shape "$shape" --scenarios batch --streams 64 ;;
      burst)
        timeout 300 llmq bench burst --random-weights "$shape" --json $KV --active 16 --burst 4 \
          --burst-tokens 8192
        peer --shape "$shape" --scenarios burst --burst-tokens 8192 ;;
      prefix)
        timeout 300 llmq bench prefix --random-weights "$shape" --json --prefix-tokens 4096
        timeout 300 llmq bench prefix --random-weights "$shape" --json --prefix-tokens 4096 \
          --suffix-tokens 0 --streams 8 ;;
    esac
  done
done
