#!/usr/bin/env bash
# Builds the timeline recorder (timeline.c) here, for carrying to the GPU machine.
#
#   deploy/gpu/timeline/build.sh DEST
#
# DEST gets libtimeline.so and the libcupti.so.13 it was built against (CUDA 13.0, the GPU
# machine's driver), taken with CUPTI's and CUDA's headers from NVIDIA's wheels on PyPI (cached
# in .gpu/wheels). On the GPU machine: deploy/gpu/timeline/record.sh DEST OUT -- COMMAND...
set -euo pipefail
dest=${1:?usage: build.sh DEST}
here=$(cd "$(dirname "$0")" && pwd)
cache=${TIMELINE_WHEELS:-$here/../../../.gpu/wheels}
mkdir -p "$cache" "$dest"
python3 -m pip download -q --no-deps -d "$cache" \
  nvidia-cuda-cupti==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 ||
  { echo "build.sh: could not get NVIDIA's CUPTI and CUDA header wheels from PyPI" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for w in "$cache"/nvidia_cuda_cupti-13.0.85-*.whl "$cache"/nvidia_cuda_crt-13.0.88-*.whl \
  "$cache"/nvidia_cuda_runtime-13.0.96-*.whl; do
  unzip -qo "$w" 'nvidia/cu13/include/*' 'nvidia/cu13/lib/libcupti.so.13' -d "$work" 2>/dev/null || true
done
cuda=$work/nvidia/cu13
gcc -O2 -Wall -Wextra -shared -fPIC -I"$cuda/include" "$here/timeline.c" \
  -L"$cuda/lib" -l:libcupti.so.13 -o "$dest/libtimeline.so"
cp "$cuda/lib/libcupti.so.13" "$dest/"
ls -la "$dest"
