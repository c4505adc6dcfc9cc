#!/usr/bin/env bash
# Runs on the GPU machine in the recipe's second call (README: "On an NVIDIA GPU"): burst and
# batch runs alternated in one call, with their tick logs, for comparing chunk settings
# (RESULTS.md, "Eleventh session"). Expects .gpu/mlx/part2 (after the stash step),
# .gpu/binpack/bin.tar.xz (llmq and Debian's nats-server in bin/), and for PEER=1 .gpu/mlx/peer
# and .gpu/peer_mlx_lm.py; test binaries in bin/tests run first (GPU-only tests). PLAN: run names (see below), e.g. PLAN="b8def b8s1 b8def".
set -uo pipefail
eval "$(bash .gpu/unpack-mlx-cuda.sh unpack .gpu/mlx/part2)"
[ -x .gpu/bin/llmq ] || tar -C .gpu -xJf .gpu/binpack/bin.tar.xz
export PATH="$PWD/.gpu/bin:$PATH" LLMQ_LOG=error
KV="--kv-budget-bytes 60000000000"
# GPU-only test binaries carried in bin/tests (cargo test --no-run), run first.
for t in .gpu/bin/tests/*; do [ -x "$t" ] && { echo "## $t"; "$t" --ignored --test-threads=1 2>&1 | tail -n 15; }; done
mkdir -p $OUT/r
# The machine's CPUs: NUMA nodes, caches, where the GPU sits (for reading `core` in tick logs).
{ lscpu; grep . /sys/devices/system/node/node*/cpulist; nvidia-smi topo -m; } > $OUT/r/machine.txt 2>&1
grep -i "model name\|^CPU(s)\|NUMA node\|L3\|Thread(s)" $OUT/r/machine.txt
i=0
for name in $PLAN; do
  i=$((i+1))
  e=""
  # NAME~: without a tick log (what it costs shows in the control overhead); NAME^: with every
  # thread's CPU time sampled beside it (deploy/gpu/thread_cpu.py, into NAME.threads); NAME%:
  # with the speed probe in a process of its own beside it (memory_probe, into NAME.probe).
  tag=${name//[~^%]/_}
  base=${name%[~^%]}
  log="LLMQ_TICK_LOG=$OUT/r/$i-$tag.ticks"
  [[ $name == *~* ]] && log=""
  case $base in
    b8cache0) a="burst --random-weights 8b"; e="LLMQ__WORKER__MLX_CACHE_LIMIT_BYTES=0";;
    b8cache8) a="burst --random-weights 8b"; e="LLMQ__WORKER__MLX_CACHE_LIMIT_BYTES=8000000000";;
    b8mem140) a="burst --random-weights 8b"; e="LLMQ__WORKER__MLX_MEMORY_LIMIT_BYTES=140000000000";;
    b8def) a="burst --random-weights 8b";;
    b8s1) a="burst --random-weights 8b --stages 1";;
    b8nb) a="burst --random-weights 8b --tick-budget 0";;
    b8b17) a="burst --random-weights 8b --tick-budget 1.7";;
    b8b13) a="burst --random-weights 8b --tick-budget 1.3";;
    b8c128) a="burst --random-weights 8b --chunk 128 --stages 8";;
    b8c512) a="burst --random-weights 8b --chunk 512 --stages 2";;
    b8c192) a="burst --random-weights 8b --chunk 192 --stages 4";;
    bat8nb) a="batch --random-weights 8b --streams 64 --prompt-tokens 512 --output-tokens 256 --tick-budget 0";;
    bat8def) a="batch --random-weights 8b --streams 64 --prompt-tokens 512 --output-tokens 256";;
    bat8c128) a="batch --random-weights 8b --streams 64 --prompt-tokens 512 --output-tokens 256 --chunk 128 --stages 8";;
    b1def) a="burst --random-weights 1b";;
    t8) a="ticks --local --random-weights 8b";;
    *) echo "unknown $name"; continue;;
  esac
  sampler=""
  [[ $name == *^* ]] && { python3 deploy/gpu/thread_cpu.py 0.25 > $OUT/r/$i-$tag.threads & sampler=$!; }
  [[ $name == *%* ]] && { .gpu/bin/memory_probe 10 200 > $OUT/r/$i-$tag.probe & sampler=$!; }
  t0=$(date +%s)
  env $e $log timeout 200 llmq bench $a --json $KV > $OUT/r/$i-$tag.json 2> $OUT/r/$i-$tag.err
  rc=$?
  [ -n "$sampler" ] && kill $sampler
  [ $base = t8 ] && python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("decode_ms", d["decode_ms"]); [print(h) for h in d["host_ms"] if "alone" not in h["step"]]' $OUT/r/$i-$tag.json
  echo "== $i $name rc=$rc $(( $(date +%s) - t0 ))s"; python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ["worst_gap_ms","steady_gap_ms","worst_over_steady","last_burst_first_token_s","steady_gap_after_ms","steady_output_tokens_per_s","output_tokens_per_s","control_overhead_fraction"] if k in d})' $OUT/r/$i-$tag.json 2>&1 | tail -1
done
if [ -n "${PEER:-}" ]; then
  ( eval "$(bash .gpu/unpack-mlx-cuda.sh peer .gpu/mlx/peer)"; timeout 300 python3 .gpu/peer_mlx_lm.py --shape 8b --scenarios ${PEER_SCEN:-batch,burst} 2>&1 | tail -n 6 ) > $OUT/r/peer.txt 2>&1
  cat $OUT/r/peer.txt
fi
for f in $OUT/r/*b8*.ticks* $OUT/r/*b1*.ticks*; do [ -f $f ] && { echo "## $f"; python3 deploy/gpu/tick_report.py $f 2>&1 | grep -v "^  top\|by offset\|by stage\|^  rows"; }; done
tar -C $OUT -czf $OUT/r.tgz r
