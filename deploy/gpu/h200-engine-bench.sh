#!/usr/bin/env bash
# Runs on the GPU machine (see README, "Benchmarks on an H200"): llmq's single-stream decode
# beside mlx-lm's on the same MLX CUDA build, and SmolLM2's greedy tokens on the GPU.
# Expects: the MLX CUDA build unpacked (LD_LIBRARY_PATH set by unpack-mlx-cuda.sh), the llmq
# binary at $LLMQ, mlx-lm importable (unpack-mlx-cuda.sh peer), SmolLM2's GGUF at $SMOL.
set -uo pipefail
LLMQ=${LLMQ:-.gpu/bin/llmq}
PEER=${PEER:-.gpu/peer_mlx_lm.py}
SMOL=${SMOL:-/tmp/smol/model.gguf}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for shape in 1b 8b; do
  "$LLMQ" bench single --local --random-weights "$shape" --json
  python3 "$PEER" --shape "$shape" --scenarios single
done
if [ -f "$SMOL" ]; then
  q="What is the capital of France?"
  "$LLMQ" generate --local --model "$SMOL" --chat --prompt "$q" --max-tokens 24 --dtype f32 --json
  "$LLMQ" generate --local --model "$SMOL" --chat --prompt "$q" --max-tokens 24 --json
  "$LLMQ" bench single --local --model "$SMOL" --json
fi
