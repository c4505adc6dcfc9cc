#!/usr/bin/env bash
# Runs on the GPU machine (README: "Benchmarks on an H200"): llmq's single-stream decode beside
# mlx-lm's on the same MLX CUDA build, alternating ROUNDS times per shape (the machine is
# shared: alternation spreads its noise over both), then SmolLM2's greedy tokens on the GPU.
# Expects: the MLX CUDA build unpacked (LD_LIBRARY_PATH from unpack-mlx-cuda.sh), the llmq
# binary at $LLMQ, mlx-lm importable (unpack-mlx-cuda.sh peer), SmolLM2's GGUF at $SMOL.
set -uo pipefail
LLMQ=${LLMQ:-.gpu/bin/llmq}
PEER=${PEER:-lab/peer/peer_mlx_lm.py}
SMOL=${SMOL:-/tmp/smol/model.gguf}
ROUNDS=${ROUNDS:-3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for shape in 1b 8b; do
  for _ in $(seq "$ROUNDS"); do
    "$LLMQ" bench single --random-weights "$shape" --json
    python3 "$PEER" --shape "$shape" --scenarios single | tail -n 1
  done
done
if [ -f "$SMOL" ]; then
  q="What is the capital of France?"
  "$LLMQ" generate --local --model "$SMOL" --chat --prompt "$q" --max-tokens 24 --dtype f32 --json
  "$LLMQ" generate --local --model "$SMOL" --chat --prompt "$q" --max-tokens 24 --json
  "$LLMQ" bench single --model "$SMOL" --json
fi
