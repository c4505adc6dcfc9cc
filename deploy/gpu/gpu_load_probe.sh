#!/usr/bin/env bash
# Runs on the GPU machine in the recipe's second call (with .gpu/mlx/peer carried): does GPU
# work alone slow the host's memory? The speed probe (memory_probe, a process of its own) runs
# throughout while a Python MLX process goes through four phases: idle; large bf16 matrix
# products (the GPU busy, the host waiting); idle; chains of small element-wise operations
# (the host busy launching, the GPU nearly idle). nvidia-smi samples the GPU's power and
# clock. Prints the probe's median walk per phase (RESULTS.md, "Fourteenth session").
set -uo pipefail
eval "$(bash .gpu/unpack-mlx-cuda.sh unpack .gpu/mlx/part2)"
[ -x .gpu/bin/memory_probe ] || tar -C .gpu -xJf .gpu/binpack/bin.tar.xz
eval "$(bash .gpu/unpack-mlx-cuda.sh peer .gpu/mlx/peer)"
mkdir -p $OUT/r
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,utilization.gpu --format=csv,noheader -lms 200 > $OUT/r/smi.txt 2>&1 &
smi=$!
.gpu/bin/memory_probe 10 45 > $OUT/r/load.probe &
probe=$!
python3 - > $OUT/r/phases.txt <<'EOF'
import time
import mlx.core as mx
def mark(name): print(name, int(time.time() * 1000), flush=True)
a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
b = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
x = mx.ones((16, 4096)).astype(mx.bfloat16)
mx.eval(a, b, x)
mark("idle"); time.sleep(6)
mark("gemm"); t = time.time()
while time.time() - t < 8:
    c = a
    for _ in range(8):
        c = (c @ b) * 0.001
    mx.eval(c)
mark("idle2"); time.sleep(6)
mark("small"); t = time.time()
while time.time() - t < 8:
    y = x
    for _ in range(300):
        y = y * 1.0001 + 0.0001
    mx.eval(y)
mark("end")
EOF
wait $probe; kill $smi
python3 - $OUT/r/phases.txt $OUT/r/load.probe $OUT/r/smi.txt <<'EOF'
import sys, statistics as st
marks = [(l.split()[0], int(l.split()[1])) for l in open(sys.argv[1]) if l.strip()]
probe = [tuple(map(float, l.split())) for l in open(sys.argv[2]) if l.strip()]
for (name, t0), (_, t1) in zip(marks, marks[1:]):
    w = [p[2] for p in probe if t0 + 500 <= p[0] < t1]
    print(f"{name:6s} {(t1 - t0) / 1000:4.1f} s: walk median {st.median(w):6.1f} us  p90 {sorted(w)[int(0.9 * len(w))]:6.1f}  alu {st.median(p[1] for p in probe if t0 + 500 <= p[0] < t1):5.1f} (n={len(w)})")
print("gpu power/clock/util samples:", open(sys.argv[3]).read().count("\n"))
EOF
awk -F', ' 'NR % 10 == 1 {print $2, $3, $4}' $OUT/r/smi.txt | head -30
