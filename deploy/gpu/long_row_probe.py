# Cost of one long row's decode attention over 32 layers (8b shape: 32 q heads, 8 kv heads),
# keys updated in the same graph as in llmq's decode step: "none" writes the keys only; "q1"
# attends the row sliced from its group's buffer (what llmq does); "q1contig" copies it
# contiguous first; "q4causal" pads the query to 4 positions with a causal mask (cuDNN).
import time, mlx.core as mx
L, H, HQ, D = 32, 8, 32, 128
def run(variant, length, cap=8704, rows=4, iters=30):
    bufs = [mx.random.normal((rows, H, cap, D)).astype(mx.bfloat16) for _ in range(L)]
    mx.eval(bufs)
    def step(i):
        outs = []
        n = length + i
        for l in range(L):
            upd = mx.full((rows, H, 1, D), 0.01, dtype=mx.bfloat16)
            idx = mx.full((rows, H, 1, D), n - 1, dtype=mx.int32)
            bufs[l] = mx.put_along_axis(bufs[l], idx, upd, axis=2)
            if variant == "none":
                outs.append(bufs[l][0, 0, 0, 0]); continue
            k = bufs[l][0:1, :, :n, :]
            if variant == "q1":
                q = mx.ones((1, HQ, 1, D), dtype=mx.bfloat16)
                o = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.08)
            elif variant == "q1contig":
                q = mx.ones((1, HQ, 1, D), dtype=mx.bfloat16)
                o = mx.fast.scaled_dot_product_attention(q, mx.contiguous(k), mx.contiguous(k), scale=0.08)
            elif variant == "q4causal":
                q = mx.ones((1, HQ, 4, D), dtype=mx.bfloat16)
                o = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.08, mask="causal")[:, :, 3:]
            outs.append(o.sum())
        return mx.stack(outs).sum()
    for i in range(3):
        mx.eval(step(i))
    t0 = time.perf_counter()
    for i in range(3, 3 + iters):
        step(i).item()
    return (time.perf_counter() - t0) / iters * 1000
for v in ["none", "q1", "q1contig", "q4causal", "none", "q1", "q4causal"]:
    for n in [2048, 8192]:
        print(f"{v:9s} len {n}: {run(v, n):.2f} ms/step", flush=True)
