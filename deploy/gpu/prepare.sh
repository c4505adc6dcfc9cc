#!/usr/bin/env bash
# Prepares, here, what a GPU machine that reaches no registry needs, in two carries of under
# about 60 MB each with the checkout (what one call may carry):
#
#   bash deploy/gpu/prepare.sh
#
# .gpu/ (kept out of git through .git/info/exclude) then holds
#   mlx/part1, mlx/part2   MLX's CUDA build (pack-mlx-cuda.sh), made once
#   one/                   mlx-lm's wheels (the peer) and the timeline recorder (timeline/build.sh)
#   bin/                   llmq and nats-server, xz-compressed, and env.sh
#   tests/                 the CUDA kernels' test binaries, xz-compressed
#
# On the GPU machine, calls within the machine's idle time of each other (each reuses what the
# ones before left in /tmp):
#   1. carry .gpu/mlx/part1 .gpu/one:
#        bash deploy/gpu/unpack-mlx-cuda.sh stash .gpu/mlx/part1 && cp -r .gpu/one /tmp/one
#   2. carry .gpu/mlx/part2 .gpu/bin:
#        source .gpu/bin/env.sh && bash deploy/gpu/hybrid-bench.sh ...
#   3. (the kernels' tests) carry .gpu/bin .gpu/tests:
#        source .gpu/bin/env.sh && bash deploy/gpu/kernel-tests.sh
# Later calls carry .gpu/bin (and .gpu/tests) and source env.sh again (MLX stays unpacked in
# /tmp). TESTS: the kernels' test binaries to build (default: every kernel's).
set -euo pipefail
cd "$(dirname "$0")/../.."
TESTS=${TESTS:-qmv qmm row_attention experts delta_step}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
[ -f .gpu/mlx/part2/VERSION ] || bash deploy/gpu/pack-mlx-cuda.sh .gpu/mlx
mkdir -p .gpu/one .gpu/bin .gpu/tests
rm -rf .gpu/one/peer && cp -r .gpu/mlx/peer .gpu/one/peer
[ -f .gpu/tl/libtimeline.so ] || bash deploy/gpu/timeline/build.sh .gpu/tl >/dev/null
tar cf - -C .gpu tl | xz -9 >.gpu/one/tl.tar.xz

make build
rm -f .gpu/bin/*.xz .gpu/tests/*.xz
pack() { strip -o "$3/$2" "$1" && xz -T0 -9 -f "$3/$2"; }
pack target/release/llmq llmq .gpu/bin
# Go's binary as it is (its runtime reads its own tables).
xz -T0 -9 -c "$(command -v nats-server)" >.gpu/bin/nats-server.xz
tests=()
for t in $TESTS; do tests+=(--test "$t"); done
# The test binaries' paths, from cargo's own report of what it built.
cargo test --release -p llmq-engine "${tests[@]}" --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
  while read -r name exe; do pack "$exe" "$name" .gpu/tests; done

cat >.gpu/bin/env.sh <<'EOF'
# Sourced at the start of every call on the GPU machine: MLX's CUDA build unpacked (once), the
# peer's Python path, the recorder in /tmp/tl, the binaries decompressed into .gpu/bin (on PATH).
eval "$(bash deploy/gpu/unpack-mlx-cuda.sh unpack .gpu/mlx/part2)"
if [ -d /tmp/mlx-site/mlx ]; then
  export PYTHONPATH=/tmp/mlx-site
else
  eval "$(bash deploy/gpu/unpack-mlx-cuda.sh peer /tmp/one/peer)"
fi
[ -d /tmp/tl ] || tar xJf /tmp/one/tl.tar.xz -C /tmp
for f in .gpu/bin/*.xz .gpu/tests/*.xz; do
  [ -f "$f" ] || continue
  n=.gpu/bin/$(basename "$f" .xz)
  xz -dc "$f" >"$n" && chmod +x "$n"
done
export PATH="$PWD/.gpu/bin:$PATH" TL=/tmp/tl BIN=.gpu/bin
EOF

size() { du -cb "$@" | tail -n 1 | cut -f1; }
tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
for carry in ".gpu/mlx/part1 .gpu/one" ".gpu/mlx/part2 .gpu/bin" ".gpu/bin .gpu/tests"; do
  # shellcheck disable=SC2086
  total=$((tree + $(size $carry)))
  echo "carry $carry: $((total / 1000000)) MB with the checkout"
  [ "$total" -lt 62000000 ] || echo "  over what one call has been seen to take (about 62 MB)" >&2
done
