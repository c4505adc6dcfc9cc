# bf16 GEMM time on the 8b shapes by rows M (32 layers of the four projections, timed on the device).
# Run in mlx-lm's environment on the GPU machine: python3 deploy/gpu/gemm_probe.py
import time, mlx.core as mx
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ws = {k: [mx.random.normal((n, k_)).astype(mx.bfloat16) * 0.01 for _ in range(4)] for k, (k_, n) in [(k, (v[0], v[1])) for k, v in shapes.items()]}
mx.eval([w for v in ws.values() for w in v])
def run(M, reps=5):
    xs = {k: mx.random.normal((M, kk)).astype(mx.bfloat16) for k, (kk, n) in shapes.items()}
    mx.eval(list(xs.values()))
    times = []
    for r in range(reps + 2):
        mx.synchronize(); t0 = time.perf_counter()
        outs = []
        for l in range(32):
            for k in shapes:
                outs.append(xs[k] @ ws[k][l % 4].T)
        mx.eval(outs); mx.synchronize()
        if r >= 2: times.append((time.perf_counter() - t0) * 1e3)
    times.sort(); t = times[len(times) // 2]
    flop = 2 * M * sum(kk * n for kk, n in shapes.values()) * 32
    print(f"M={M:4d}: {t:7.2f} ms for 32 layers ({flop / t / 1e9:6.0f} TFLOP/s)")
for M in (16, 128, 144, 256, 272, 288, 320, 384, 512):
    run(M)
