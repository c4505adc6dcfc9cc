#!/usr/bin/env bash
# Runs on the two-GPU machine (nvidia-h200-x2) after the unpack steps: issue 6's scale-out
# measurement, one worker against two behind one intake, alternated so that drift on the shared
# machine hits both. Then (optional, BURST_DEBUG=1) the burst scenario on GPU 0 with the worker's
# slow-step log, with and without the prefix cache, to attribute the burst's worst ticks.
# Expects the llmq binary and Debian's nats-server binary in .gpu/bin. Output: JSON lines on
# stdout; logs under $OUT (or /tmp).
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
KV="--kv-budget-bytes 60000000000"
LOGS=${OUT:-/tmp}
# Three rounds, two workers first, the single worker on GPU 0, 1, 0.
for round in 1 2 3; do
  for n in 2 1; do
    gpus=0; [ "$n" = 2 ] && gpus=0,1; [ "$round" = 2 ] && [ "$n" = 1 ] && gpus=1
    echo "# round $round, workers $n, GPUs $gpus"
    timeout 200 llmq bench batch --random-weights 8b --json $KV --streams 128 --prompt-tokens 512 \
      --output-tokens 256 --workers "$n" --gpus "$gpus"
  done
done
if [ -n "${BURST_DEBUG:-}" ]; then
  for prefix in true false; do
    echo "# burst, prefix cache $prefix"
    LLMQ_LOG="error,llmq_worker=debug" LLMQ__PREFIX_CACHE__ENABLED=$prefix timeout 200 \
      llmq bench burst --random-weights 8b --json $KV --gpus 0 2> "$LOGS/burst-prefix-$prefix.log"
  done
fi
