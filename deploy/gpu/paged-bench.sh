#!/usr/bin/env bash
# Runs on the GPU machine: the decode batch's block pool beside the code before it ($OLD, built
# from the commit before the pool), alternated ROUNDS times in one call at the 8b shape: one
# stream, 64 streams of 512-token prompts, and the burst (16 streams decoding, four 8192-token
# prompts arriving). Each line is one run's JSON, after a "== binary scenario" line.
#   source .gpu/bin/env.sh && OLD=.gpu/bin/llmq-old bash deploy/gpu/paged-bench.sh
set -uo pipefail
NEW=${NEW:-.gpu/bin/llmq}
OLD=${OLD:-.gpu/bin/llmq-old}
ROUNDS=${ROUNDS:-2}
SCENARIOS=${SCENARIOS:-single batch burst}
SHAPE=${SHAPE:-8b}
BUDGET=${BUDGET:-60000000000}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for _ in $(seq "$ROUNDS"); do
  for s in $SCENARIOS; do
    case $s in
      single) args=(single --random-weights "$SHAPE" --json) ;;
      batch) args=(batch --random-weights "$SHAPE" --json --kv-budget-bytes "$BUDGET" --streams 64
        --prompt-tokens 512 --output-tokens 256) ;;
      burst) args=(burst --random-weights "$SHAPE" --json --kv-budget-bytes "$BUDGET") ;;
      *) echo "unknown scenario $s" >&2; exit 2 ;;
    esac
    for bin in "$NEW" "$OLD"; do
      echo "== $(basename "$bin") $s"
      timeout 300 "$bin" bench "${args[@]}" 2>/dev/null | tail -n 1
    done
  done
done
