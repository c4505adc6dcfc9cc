# Where a batched decode step's GPU time goes on MLX's CUDA backend (8b shape: 32 layers, 32
# query heads over 8 kv heads of 128): the four projections at M rows, and the attention of a
# decode batch over its shared KV buffers, with a mask array (one row per length, as llmq's
# decode batch needed before its own kernel) and without. Run in mlx-lm's environment on the GPU
# machine (after the peer unpack step): `python3 deploy/gpu/decode_attention_probe.py`.
# Seventh session: masked 18.90 ms for 64 rows over 1024 slots, unmasked 2.92 ms (RESULTS.md).
import time
import mlx.core as mx

LAYERS = 32
PROJECTIONS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (in, out)


def timed(build, iters=20):
    for _ in range(3):
        mx.eval(build())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(build())
    mx.synchronize()
    return (time.perf_counter() - t0) / iters * 1000


def projections(m, weights):
    xs = [mx.random.normal((m, i)).astype(mx.bfloat16) for (i, _) in PROJECTIONS]
    return lambda: [x @ w.T for layer in weights for x, w in zip(xs, layer)]


def attention(rows, cap, masked):
    keys = [mx.random.normal((rows, 8, cap, 128)).astype(mx.bfloat16) for _ in range(LAYERS)]
    q = mx.random.normal((rows, 32, 1, 128)).astype(mx.bfloat16)
    lengths = mx.array([cap // 2 + r for r in range(rows)])
    mask = mx.arange(cap).reshape(1, 1, 1, cap) < (lengths.reshape(rows, 1, 1, 1) + 1)
    mx.eval(keys, q, mask)
    m = mask if masked else None
    return lambda: [mx.fast.scaled_dot_product_attention(q, k, k, scale=0.088, mask=m) for k in keys]


if __name__ == "__main__":
    weights = [[(mx.random.normal((o, i)) * 0.01).astype(mx.bfloat16) for (i, o) in PROJECTIONS] for _ in range(LAYERS)]
    mx.eval(weights)
    for m in [1, 16, 32, 64, 128, 256]:
        print(f"projections, {m} rows: {timed(projections(m, weights)):.2f} ms a step", flush=True)
    for rows, cap in [(16, 1024), (64, 1024), (64, 2048), (16, 4096)]:
        print(f"attention, {rows} rows over {cap} slots: masked {timed(attention(rows, cap, True)):.2f} ms, "
              f"unmasked {timed(attention(rows, cap, False)):.2f} ms", flush=True)
