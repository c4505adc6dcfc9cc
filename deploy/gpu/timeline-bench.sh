#!/usr/bin/env bash
# Runs on the GPU machine: the timeline of llmq's decode step (issue 52's breakdown), each
# scenario under deploy/gpu/timeline/record.sh, each binary named in $BINS (default .gpu/bin/llmq)
# in turn, plus each binary's single-stream figure without the recorder (its overhead).
# Expects MLX's CUDA build unpacked (LD_LIBRARY_PATH), the recorder built into $TL
# (deploy/gpu/timeline/build.sh), nats-server on PATH for the batch, and $RESULTS for
# timeline.tar: the summaries (.txt), Chrome traces (.json.xz) and records (.tsv.xz).
#   SCENARIOS: any of single,q4,moe,batch,qwen35,qwen35-batch (default single,q4,moe,batch);
#   PEER_SCENARIOS: any of single,q4,moe,qwen35: mlx-lm's one-stream step of that shape under
#   the recorder too (default none; needs the peer unpacked); PLAIN=0 skips the figure without
#   the recorder
set -uo pipefail
BINS=${BINS:-.gpu/bin/llmq}
TL=${TL:-.gpu/tl}
WORK=${WORK:-/tmp/timeline}
RESULTS=${RESULTS:-${OUT:-/tmp/timeline-results}}
SCENARIOS=${SCENARIOS:-single,q4,moe,batch}
rec=deploy/gpu/timeline/record.sh
mkdir -p "$WORK" "$RESULTS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
has() { [[ ",$SCENARIOS," == *",$1,"* ]]; }
for bin in $BINS; do
  b=$(basename "$bin")
  if [ "${PLAIN:-1}" = 1 ]; then
    echo "== $b: single 8b bf16 without the recorder"
    "$bin" bench single --random-weights 8b --json
  fi
  if has single; then
    "$rec" "$TL" "$WORK/$b-single-8b" -- "$bin" bench single --random-weights 8b --json --output-tokens 64
  fi
  if has q4; then
    "$rec" "$TL" "$WORK/$b-single-8b-q4" -- "$bin" bench single --random-weights 8b --quantize 4 \
      --group-size 64 --json --output-tokens 64
  fi
  if has moe; then
    "$rec" "$TL" "$WORK/$b-single-moe" -- "$bin" bench single --random-weights moe --json --output-tokens 64
  fi
  if has qwen35; then
    "$rec" "$TL" "$WORK/$b-single-qwen35" -- "$bin" bench single --random-weights qwen35 --json --output-tokens 64
  fi
  if has qwen35-batch; then
    "$rec" "$TL" "$WORK/$b-batch-qwen35" -- "$bin" bench batch --random-weights qwen35 --json \
      --kv-budget-bytes 40000000000 --streams 64 --prompt-tokens 512 --output-tokens 128
  fi
  if has batch; then
    "$rec" "$TL" "$WORK/$b-batch-8b" -- "$bin" bench batch --random-weights 8b --json \
      --kv-budget-bytes 60000000000 --streams 64 --prompt-tokens 512 --output-tokens 128
  fi
done
for p in ${PEER_SCENARIOS//,/ }; do
  case $p in
    single) args=(--shape 8b) ;;
    q4) args=(--shape 8b --bits 4) ;;
    moe) args=(--shape moe) ;;
    qwen35) args=(--shape qwen35) ;;
    *) echo "timeline-bench.sh: unknown peer scenario $p" >&2; continue ;;
  esac
  "$rec" "$TL" "$WORK/mlx-lm-$p" -- python3 lab/peer/peer_mlx_lm.py "${args[@]}" --scenarios single
done
# One file back (a call returns few, and none over about 20 MB): the summaries, the traces, and
# the records, smallest first, while the whole stays under PACK_MAX bytes (default 15 MB), so
# that the summary can be run again here.
pack=$(mktemp -d)
cp "$WORK"/*.txt "$pack"/ 2>/dev/null
for j in "$WORK"/*.json "$WORK"/*.tsv; do [ -f "$j" ] && xz -T0 -c "$j" >"$pack/$(basename "$j").xz"; done
total=$(du -cb "$pack"/*.txt "$pack"/*.json.xz 2>/dev/null | tail -n 1 | cut -f1)
for r in $(ls -Sr "$pack"/*.tsv.xz 2>/dev/null); do
  size=$(stat -c %s "$r")
  if [ $((total + size)) -le "${PACK_MAX:-15000000}" ]; then total=$((total + size)); else rm "$r"; fi
done
tar cf "$RESULTS/timeline.tar" -C "$pack" .
tar tvf "$RESULTS/timeline.tar"
