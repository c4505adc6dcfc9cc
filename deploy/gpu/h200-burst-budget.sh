#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (README: "Benchmarks on an H200"): the burst
# scenario (16 streams decoding, 4 x 8192-token prompts arriving) with fixed 256-token chunks
# against chunks sized to a time budget per tick (`scheduler.tick_budget`), then mlx-lm's default
# run in the same call. Each llmq run leaves its worker's tick log (LLMQ_TICK_LOG: start ms,
# tick ms, rows decoded, chunk tokens, prompt tokens done) under $OUT (or /tmp).
# BUDGETS (default "0 2 1.7"): the tick budgets to run, 0 = fixed chunks. CHUNK: the largest chunk.
# Expects the llmq binary and Debian's nats-server binary in .gpu/bin, the peer script in .gpu/
# and the peer's environment already set up (unpack-mlx-cuda.sh peer) unless NO_PEER=1.
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
KV="--kv-budget-bytes 60000000000"
LOGS=${OUT:-/tmp}
CHUNK=${CHUNK:-256}
for budget in ${BUDGETS:-0 2 1.7}; do
  echo "# tick budget $budget, largest chunk $CHUNK ${EXTRA_ENV:-}"
  env ${EXTRA_ENV:-} LLMQ_TICK_LOG="$LOGS/ticks-$budget-$CHUNK.log" LLMQ__SCHEDULER__TICK_BUDGET=$budget \
    timeout 200 llmq bench burst --random-weights 8b --json $KV --chunk "$CHUNK"
done
if [ -z "${NO_PEER:-}" ]; then
  echo "# mlx-lm default"
  timeout 240 python3 .gpu/peer_mlx_lm.py --shape 8b --scenarios burst | tail -n 1
fi
