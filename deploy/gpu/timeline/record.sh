#!/usr/bin/env bash
# Runs a command on the GPU machine with the timeline recorder injected (see timeline.c), then
# summarizes what it recorded.
#
#   deploy/gpu/timeline/record.sh LIBDIR OUT [SUMMARY OPTIONS] -- COMMAND...
#
# LIBDIR holds build.sh's outputs; OUT is a path prefix: OUT.<pid>.tsv (the records),
# OUT.<pid>.json (a Chrome trace of a few steady steps: chrome://tracing or ui.perfetto.dev)
# and OUT.<pid>.txt (the per-step breakdown summarize.py prints) for each process that used CUDA.
set -uo pipefail
lib=$(cd "${1:?usage: record.sh LIBDIR OUT [SUMMARY OPTIONS] -- COMMAND...}" && pwd)
out=${2:?usage: record.sh LIBDIR OUT [SUMMARY OPTIONS] -- COMMAND...}
shift 2
opts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
shift
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$(dirname "$out")"
rm -f "$out".*.tsv
CUDA_INJECTION64_PATH=$lib/libtimeline.so NVTX_INJECTION64_PATH=$lib/libcupti.so.13 \
  LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} LLMQ_TIMELINE=$out "$@"
status=$?
for tsv in "$out".*.tsv; do
  [ -s "$tsv" ] || continue
  python3 "$here/summarize.py" "$tsv" --trace "${tsv%.tsv}.json" "${opts[@]}" | tee "${tsv%.tsv}.txt"
done
exit $status
