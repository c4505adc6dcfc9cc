#!/usr/bin/env bash
# Runs on the GPU machine. Puts MLX's CUDA build back together from the two parts that
# pack-mlx-cuda.sh made, and prints the environment under which a binary linked against
# libmlx.so runs on the GPU.
#
#   bash deploy/gpu/unpack-mlx-cuda.sh stash DIR/part1      # keeps part1 in /tmp/mlx-parts
#   eval "$(bash deploy/gpu/unpack-mlx-cuda.sh unpack DIR/part2)"
#   eval "$(bash deploy/gpu/unpack-mlx-cuda.sh peer DIR/peer)"   # after unpack: mlx-lm in Python
#
# The CUDA libraries that MLX needs (cuBLAS, cuDNN, NVRTC, NCCL from the nvidia-* Python
# packages, CUDA 13) are looked up in the GPU machine's own Python.
set -euo pipefail
stash=/tmp/mlx-parts
root=/tmp/mlx-cuda
case "${1:-}" in
  stash)
    mkdir -p "$stash"
    cp "$2"/* "$stash"/
    echo "stashed: $(ls "$stash")" >&2
    ;;
  unpack)
    if [ ! -f "$root/mlx/lib/libmlx.so" ]; then
      cp "$2"/mlx-cuda.tar.xz.part.* "$stash"/ 2>/dev/null || true
      ls "$stash"/mlx-cuda.tar.xz.part.aa "$stash"/mlx-cuda.tar.xz.part.ab >/dev/null \
        || { echo "a part is missing from $stash: run the stash step first" >&2; exit 1; }
      mkdir -p "$root"
      cat "$stash"/mlx-cuda.tar.xz.part.* | xz -d -T0 | tar xf - -C "$root"
    fi
    nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')
    libs="$root/mlx/lib:$root/mlx_cuda_13.libs"
    for d in "$nv"/cu13/lib "$nv"/cudnn/lib "$nv"/nccl/lib; do [ -d "$d" ] && libs="$libs:$d"; done
    echo "export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export MLX_CUDA_ROOT=$root"
    ;;
  peer)
    [ -f "$root/mlx/lib/libmlx.so" ] || { echo "run the unpack step first" >&2; exit 1; }
    site=/tmp/mlx-site
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$2"/*.whl >&2
    cp -r "$root/mlx/lib" "$root/mlx/include" "$site/mlx/"
    cp -r "$root/mlx_cuda_13.libs" "$site/"
    echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  *)
    echo "usage: unpack-mlx-cuda.sh stash PART1_DIR | unpack PART2_DIR | peer PEER_DIR" >&2
    exit 2
    ;;
esac
