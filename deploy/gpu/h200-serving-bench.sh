#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (README: "Benchmarks on an H200"): the serving
# scenarios through nats-server, intake and a worker, beside mlx-lm's BatchGenerator.
# Expects the llmq binary and Debian's nats-server binary in .gpu/bin, the peer script in .gpu/.
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-warn}
SHAPES=${SHAPES:-8b}
KV="--kv-budget-bytes 60000000000"
for shape in $SHAPES; do
  timeout 240 llmq bench prefix --random-weights "$shape" --json $KV --prefix-tokens 4096 --streams 8
  timeout 240 llmq bench burst --random-weights "$shape" --json $KV
  timeout 240 llmq bench burst --random-weights "$shape" --json $KV --no-interleave
  timeout 240 python3 .gpu/peer_mlx_lm.py --shape "$shape" --scenarios burst | tail -n 1
  timeout 240 python3 .gpu/peer_mlx_lm.py --shape "$shape" --scenarios burst --prefill-step 256 --prefill-batch 1 | tail -n 1
  timeout 240 llmq bench batch --random-weights "$shape" --json $KV --streams 64 --prompt-tokens 512 --output-tokens 256
  timeout 240 python3 .gpu/peer_mlx_lm.py --shape "$shape" --scenarios batch | tail -n 1
  timeout 240 llmq bench static --random-weights "$shape" --json $KV --streams 16 --prompt-tokens 512 --output-tokens 128
done
