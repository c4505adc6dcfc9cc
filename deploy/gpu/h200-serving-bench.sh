#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (README: "Benchmarks on an H200"): the serving
# scenarios through nats-server, intake and a worker, beside mlx-lm's BatchGenerator.
# Expects the llmq binary and Debian's nats-server binary in .gpu/bin, the peer script in lab/peer/,
# and, for the peer, `eval "$(bash deploy/gpu/unpack-mlx-cuda.sh peer .gpu/mlx/peer)"` done first.
# SHAPES (default 8b), and WORKERS/GPUS for the scale-out batch (e.g. WORKERS=2 GPUS=0,1).
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
SHAPES=${SHAPES:-8b}
KV="--kv-budget-bytes 60000000000"
for shape in $SHAPES; do
  timeout 240 llmq bench prefix --random-weights "$shape" --json $KV --prefix-tokens 4096 --streams 8
  for chunk in 256 512; do
    for ahead in true false; do
      LLMQ__SCHEDULER__DECODE_AHEAD=$ahead timeout 240 llmq bench burst --random-weights "$shape" --json $KV --chunk $chunk
    done
  done
  timeout 240 llmq bench burst --random-weights "$shape" --json $KV --no-interleave
  timeout 240 python3 lab/peer/peer_mlx_lm.py --shape "$shape" --scenarios burst | tail -n 1
  timeout 240 llmq bench batch --random-weights "$shape" --json $KV --streams 64 --prompt-tokens 512 --output-tokens 256
  timeout 240 python3 lab/peer/peer_mlx_lm.py --shape "$shape" --scenarios batch | tail -n 1
  for ahead in true false; do
    LLMQ__SCHEDULER__DECODE_AHEAD=$ahead timeout 240 llmq bench static --random-weights "$shape" --json $KV --streams 16 --prompt-tokens 512 --output-tokens 128
  done
done
if [ -n "${WORKERS:-}" ]; then
  for n in 1 "$WORKERS"; do
    timeout 300 llmq bench batch --random-weights 8b --json $KV --streams 128 --prompt-tokens 512 --output-tokens 256 --workers "$n" --gpus "${GPUS:-0}"
  done
fi
