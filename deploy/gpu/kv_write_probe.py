# Does a KV write (slice_update / put_along_axis) copy the whole buffer when the previous step,
# which read the buffer, is still in flight (steps queued ahead with async_eval)?
import time, mlx.core as mx
L, R, H, T, D = 32, 16, 8, 4096, 128
def run(mode, pipelined, steps=40):
    bufs = [mx.zeros((R, H, T, D), dtype=mx.bfloat16) for _ in range(L)]
    mx.eval(bufs)
    q = mx.ones((R, 32, 1, D), dtype=mx.bfloat16)
    def step(i):
        outs = []
        for l in range(L):
            upd = mx.full((R, H, 1, D), 0.01 * (l + 1), dtype=mx.bfloat16)
            if mode == "slice":
                bufs[l] = mx.slice_update(bufs[l], upd, mx.array([0, 0, i, 0]), axes=(0, 1, 2, 3))
            else:
                idx = mx.full((R, H, 1, D), i, dtype=mx.int32)
                bufs[l] = mx.put_along_axis(bufs[l], idx, upd, axis=2)
            k = bufs[l][:, :, : i + 1, :]
            outs.append(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1).sum())
        return mx.stack(outs).sum()
    # warm
    for i in range(3):
        mx.eval(step(i))
    t0 = time.perf_counter()
    if pipelined:
        s = step(3); mx.async_eval(s)
        for i in range(4, 4 + steps):
            n = step(i); mx.async_eval(n)
            s.item(); s = n
        s.item()
    else:
        for i in range(3, 3 + steps):
            step(i).item()
    return (time.perf_counter() - t0) / steps * 1000
for mode in ["slice", "scatter"]:
    for p in [False, True, False, True]:
        print(f"{mode:8s} pipelined={p}: {run(mode, p):.2f} ms/step", flush=True)
