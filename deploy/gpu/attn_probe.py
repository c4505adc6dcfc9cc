#!/usr/bin/env python3
"""Which attention path MLX takes, and what it costs, for the shapes of an llmq tick (8b shape:
32 query heads, 8 KV heads, head dim 128, bf16, 32 layers). Diagnostic only: run on the GPU
machine inside the peer's environment (unpack-mlx-cuda.sh peer). Prints one JSON line per case:
milliseconds for the op repeated over 32 layers' buffers, median of 15 timed runs; then what the
first call of a new attention shape costs (MLX plans a cuDNN graph per shape) and what fresh
device buffers cost. RESULTS.md (fifth session) has its output."""
import json, time
import mlx.core as mx

H, KVH, D, LAYERS = 32, 8, 128, 32
DT = mx.bfloat16
SCALE = D ** -0.5


def timed(build, reps=15):
    mx.eval(build())  # warm-up (kernel and cuDNN graph builds)
    mx.eval(build())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(build())
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return round(ts[len(ts) // 2], 3)


def buffers(rows, cap):
    return [(mx.random.normal((rows, KVH, cap, D)).astype(DT), mx.random.normal((rows, KVH, cap, D)).astype(DT)) for _ in range(LAYERS)]


def manual(q, k, v, mask_add):
    # q [1, H, t, D] -> [1, KVH, rep * t, D]; one GEMM per KV head for scores, softmax, GEMM.
    t = q.shape[2]
    rep = H // KVH
    qg = (q * SCALE).reshape(1, KVH, rep * t, D)
    s = qg @ k.swapaxes(-1, -2)
    if mask_add is not None:
        s = s.reshape(1, KVH, rep, t, -1) + mask_add
        s = s.reshape(1, KVH, rep * t, -1)
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(DT)
    return (p @ v).reshape(1, H, t, D)


def chunk_cases():
    for off, cap in ((0, 256), (0, 512), (2048, 4096), (4096, 8192), (7168, 8192)):
        kv = buffers(1, cap)
        for t in (16, 64, 256, 512):
            e = off + t
            if e > cap:
                continue
            q = mx.random.normal((1, H, t, D)).astype(DT)
            qp = mx.arange(off, e).reshape(t, 1)
            bmask = mx.arange(cap).reshape(1, cap) <= qp
            amask = mx.where(bmask, 0.0, -float("inf")).astype(DT)
            bmask_e = mx.arange(e).reshape(1, e) <= qp
            amask_e = mx.where(bmask_e, 0.0, -float("inf")).astype(DT)
            mx.eval(q, bmask, amask, bmask_e, amask_e, *[a for p in kv for a in p])
            r = {"case": "chunk", "offset": off, "cap": cap, "t": t}
            r["bool_buffer"] = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=bmask) for k, v in kv])
            r["add_buffer"] = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=amask) for k, v in kv])
            r["causal_sliced"] = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k[:, :, :e], v[:, :, :e], scale=SCALE, mask="causal") for k, v in kv])
            r["manual_buffer"] = timed(lambda: [manual(q, k, v, amask) for k, v in kv])
            r["manual_sliced"] = timed(lambda: [manual(q, k[:, :, :e], v[:, :, :e], amask_e) for k, v in kv])
            print(json.dumps(r), flush=True)


def decode_cases():
    # One row of a long length group: query [1, H, 1, D] over its first `n` keys of a buffer of
    # `rows` rows.
    for rows, cap, n in ((1, 8448, 8200), (8, 8448, 8200), (1, 4352, 4100)):
        kv = buffers(rows, cap)
        q = mx.random.normal((1, H, 1, D)).astype(DT)
        mx.eval(q, *[a for p in kv for a in p])
        r = {"case": "decode_row", "rows": rows, "cap": cap, "len": n}
        r["vector_sliced"] = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k[0:1, :, :n], v[0:1, :, :n], scale=SCALE) for k, v in kv])
        r["manual_sliced"] = timed(lambda: [manual(q, k[0:1, :, :n], v[0:1, :, :n], None) for k, v in kv])
        print(json.dumps(r), flush=True)
    # A 16-row group of 128-token rows, masked (the first group).
    for rows, cap in ((16, 256), (16, 1024)):
        kv = buffers(rows, cap)
        q = mx.random.normal((rows, H, 1, D)).astype(DT)
        lens = mx.array([100 + i for i in range(rows)]).reshape(rows, 1, 1, 1)
        bmask = mx.arange(cap).reshape(1, 1, 1, cap) < lens
        amask = mx.where(bmask, 0.0, -float("inf")).astype(DT)
        mx.eval(q, bmask, amask, *[a for p in kv for a in p])
        r = {"case": "decode_group", "rows": rows, "cap": cap}
        r["bool_buffer"] = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=bmask) for k, v in kv])
        r["add_buffer"] = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=amask) for k, v in kv])
        print(json.dumps(r), flush=True)


def write_cases():
    # Writing one token per row into a group buffer: put_along_axis (what a decode step does).
    for rows, cap in ((16, 256), (1, 8448), (8, 8448)):
        kv = buffers(rows, cap)
        new = mx.random.normal((rows, KVH, 1, D)).astype(DT)
        idx = mx.array([120 + i for i in range(rows)]).reshape(rows, 1, 1, 1)
        mx.eval(new, idx)
        state = {"kv": kv}

        def step():
            nk = [(mx.put_along_axis(k, idx, new, axis=2), mx.put_along_axis(v, idx, new, axis=2)) for k, v in state["kv"]]
            state["kv"] = nk
            return [a for p in nk for a in p]

        print(json.dumps({"case": "write_scatter", "rows": rows, "cap": cap, "ms": timed(step)}), flush=True)


def ms_once(f):
    t0 = time.perf_counter()
    mx.eval(f())
    return round((time.perf_counter() - t0) * 1e3, 3)


def plan_cases():
    kv = buffers(1, 8192)
    mx.eval(*[a for p in kv for a in p])
    for t, e in ((256, 4608), (256, 4864), (200, 5064), (136, 5200), (256, 4608), (200, 5064)):
        q = mx.random.normal((1, H, t, D)).astype(DT)
        mx.eval(q)
        f = lambda: [mx.fast.scaled_dot_product_attention(q, k[:, :, :e], v[:, :, :e], scale=SCALE, mask="causal") for k, v in kv]
        print(json.dumps({"case": "causal_sliced_new_shape", "t": t, "e": e, "first_ms": ms_once(f), "second_ms": ms_once(f)}), flush=True)
    for t in (256, 200, 136, 256):
        q = mx.random.normal((1, H, t, D)).astype(DT)
        am = mx.where(mx.arange(8192).reshape(1, 8192) <= mx.arange(4000, 4000 + t).reshape(t, 1), 0.0, -float("inf")).astype(DT)
        mx.eval(q, am)
        f = lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=am) for k, v in kv]
        print(json.dumps({"case": "add_buffer_new_t", "t": t, "first_ms": ms_once(f), "second_ms": ms_once(f)}), flush=True)


def alloc_cases():
    for n in (1024, 4096, 8192):
        make = lambda: [mx.zeros((1, KVH, n, D), dtype=DT) for _ in range(64)]
        b = make()
        t0 = time.perf_counter(); mx.eval(*b); fresh = (time.perf_counter() - t0) * 1e3
        del b
        b = make()
        t0 = time.perf_counter(); mx.eval(*b); reused = (time.perf_counter() - t0) * 1e3
        del b
        print(json.dumps({"case": "alloc64", "tokens": n, "fresh_ms": round(fresh, 3), "reused_ms": round(reused, 3)}), flush=True)


if __name__ == "__main__":
    print(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device())}))
    chunk_cases()
    decode_cases()
    write_cases()
    plan_cases()
    alloc_cases()
