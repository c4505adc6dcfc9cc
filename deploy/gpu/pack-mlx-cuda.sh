#!/usr/bin/env bash
# Packs MLX's CUDA 13 build (the mlx-cuda-13 wheel from PyPI) into two parts of under 40 MB each,
# for copying to a Linux machine with an NVIDIA GPU that cannot reach a package registry.
#
#   deploy/gpu/pack-mlx-cuda.sh DEST [VERSION]
#
# DEST gets part1/ and part2/. unpack-mlx-cuda.sh, run on the GPU machine, puts them back together.
# DEST/peer/ gets the mlx (CPython 3.12) and mlx-lm wheels of the same version, for running
# mlx-lm side by side on that machine (see unpack-mlx-cuda.sh peer).
set -euo pipefail
dest=${1:?usage: pack-mlx-cuda.sh DEST [VERSION]}
version=${2:-0.32.2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
  "mlx-cuda-13==$version" -d "$work/whl"
mkdir -p "$work/x"
unzip -q "$work"/whl/mlx_cuda_13-*.whl -d "$work/x"
mkdir -p "$dest/part1" "$dest/part2"
rm -f "$dest"/part1/* "$dest"/part2/*
(cd "$work/x" && tar cf - mlx mlx_cuda_13.libs) | xz -T0 -9 >"$work/mlx-cuda.tar.xz"
split -b 38M "$work/mlx-cuda.tar.xz" "$work/mlx-cuda.tar.xz.part."
mv "$work/mlx-cuda.tar.xz.part.aa" "$dest/part1/"
mv "$work/mlx-cuda.tar.xz.part.ab" "$dest/part2/"
echo "$version" >"$dest/part2/VERSION"
mkdir -p "$dest/peer"
rm -f "$dest"/peer/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 "mlx==$version" -d "$dest/peer"
python3 -m pip download -q --no-deps --only-binary=:all: "mlx-lm==$version" -d "$dest/peer"
du -sh "$dest"/part1 "$dest"/part2 "$dest"/peer
