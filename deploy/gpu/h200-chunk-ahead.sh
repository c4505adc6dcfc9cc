#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps: the burst (16 streams decoding, 4 x 8192-token
# prompts) and the 64-stream batch, alternating this branch's build (.gpu/bin/llmq) with main's
# (.gpu/bin/llmq-main), each run leaving its worker's tick log under $OUT (or /tmp). Expects
# both binaries and Debian's nats-server binary in .gpu/bin.
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
KV="--kv-budget-bytes 60000000000"
LOGS=${OUT:-/tmp}
for b in llmq llmq-main llmq llmq-main; do
  echo "# burst $b"
  LLMQ_TICK_LOG="$LOGS/burst-$b.log" timeout 150 "$b" bench burst --random-weights 8b --json $KV --chunk 256
done
for b in llmq llmq-main; do
  echo "# batch $b"
  timeout 150 "$b" bench batch --random-weights 8b --json $KV --streams 64 --prompt-tokens 512 --output-tokens 256
done
