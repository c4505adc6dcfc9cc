#!/usr/bin/env bash
# Runs on the GPU machine after the unpack steps (BENCHMARKS.md, "How to run them"): Qwen3.5's
# DeltaNet decode step in its two GPU forms, MLX's compiled operations (LLMQ_DELTA_STEP_KERNEL=0)
# and llmq's kernel (the default for steps of enough rows), alternated in one call, after the
# kernel's own test.
# Expects the llmq binary, Debian's nats-server and the engine's delta_step test binary (built
# here with `cargo test --release --workspace --test delta_step --no-run`, copied without its
# hash suffix) in .gpu/bin; with the peer unpacked, mlx-lm's figures beside them.
#   ROUNDS: default 2; PEER=0 skips mlx-lm.
set -uo pipefail
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=${LLMQ_LOG:-error}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
echo "== the kernel's test"
timeout 120 .gpu/bin/delta_step --ignored
for round in $(seq "${ROUNDS:-2}"); do
  for kernel in 0 1; do
    echo "== round $round, LLMQ_DELTA_STEP_KERNEL=$kernel"
    export LLMQ_DELTA_STEP_KERNEL=$kernel
    timeout 120 llmq bench single --random-weights qwen35 --json
    timeout 180 llmq bench batch --random-weights qwen35 --json --kv-budget-bytes 40000000000 \
      --streams 64 --prompt-tokens 512 --output-tokens 256
  done
done
unset LLMQ_DELTA_STEP_KERNEL
if [ "${PEER:-1}" = 1 ]; then
  timeout 300 python3 lab/peer/peer_mlx_lm.py --shape qwen35 --scenarios single | tail -n 1
  timeout 300 python3 lab/peer/peer_mlx_lm.py --shape qwen35 --scenarios batch --streams 64 | tail -n 1
fi
