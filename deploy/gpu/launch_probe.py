"""Host time MLX spends launching one operation of each kind a decode step or a prefill chunk
uses, at the 8b shape (bf16), on whatever device MLX runs on.

For each kind, a chain of N dependent operations is built (`build`), handed to the device
with `mx.async_eval` from an idle device (`launch`, the host's share), then waited for
(`total`). Figures are microseconds per operation, medians of 5 runs after 2 untimed.
In-place kinds (KV writes) chain on one buffer: if MLX could not donate it, each write
would copy the whole buffer and `total` would grow with its capacity.

Usage: python3 deploy/gpu/launch_probe.py [--n 64]
"""
import argparse
import statistics
import time

import mlx.core as mx

p = argparse.ArgumentParser()
p.add_argument("--n", type=int, default=64)
a = p.parse_args()
N = a.n
dt = mx.bfloat16
H, KVH, D, HID, FF = 32, 8, 128, 4096, 14336


def probe(name, make):
    """make() returns a function that builds the chain and returns its output."""
    builds, launches, totals = [], [], []
    for i in range(7):
        f = make()
        t0 = time.perf_counter()
        out = f()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        if i >= 2:
            builds.append((t1 - t0) / N * 1e6)
            launches.append((t2 - t1) / N * 1e6)
            totals.append((t3 - t0) / N * 1e6)
    m = statistics.median
    print(f"{name:48s} build {m(builds):7.1f}  launch {m(launches):7.1f}  total {m(totals):8.1f} us/op", flush=True)


def kv_write(cap, rows, scatter):
    def make():
        buf = mx.zeros((rows, KVH, cap, D), dtype=dt)
        upd = mx.random.normal((rows, KVH, 1, D)).astype(dt)
        idx = mx.broadcast_to(mx.array([cap // 2] * rows, dtype=mx.int32).reshape(rows, 1, 1, 1), (rows, KVH, 1, D))
        mx.eval(buf, upd, idx)

        def f():
            b = buf
            for _ in range(N):
                if scatter:
                    b = mx.put_along_axis(b, idx, upd, axis=2)
                else:
                    b[:, :, cap // 2 : cap // 2 + 1, :] = upd
            return b

        return f

    return make


def unary(name, shape, op):
    def make():
        x = mx.random.normal(shape).astype(dt)
        mx.eval(x)

        def f():
            y = x
            for _ in range(N):
                y = op(y)
            return y

        return f

    probe(name, make)


def matmul(rows, out):
    def make():
        x = mx.random.normal((rows, HID)).astype(dt)
        w = (mx.random.normal((HID, out)) * 0.01).astype(dt)
        w2 = (mx.random.normal((out, HID)) * 0.01).astype(dt)
        mx.eval(x, w, w2)

        def f():
            y = x
            for i in range(N // 2):
                y = (y @ w) @ w2
            return y

        return f

    probe(f"matmul [{rows},{HID}]x[{HID},{out}] and back", make)


def sdpa(t, keys, cap):
    def make():
        q = mx.random.normal((1, H, t, D)).astype(dt)
        kb = mx.random.normal((1, KVH, cap, D)).astype(dt)
        vb = mx.random.normal((1, KVH, cap, D)).astype(dt)
        mx.eval(q, kb, vb)

        def f():
            y = q
            k, v = kb[:, :, :keys, :], vb[:, :, :keys, :]
            for _ in range(N):
                y = mx.fast.scaled_dot_product_attention(y, k, v, scale=D**-0.5, mask="causal" if t > 1 else None)
            return y

        return f

    probe(f"sdpa q[1,{H},{t},{D}] over {keys} keys of {cap}", make)


for cap in (512, 8448):
    for rows in (1, 16):
        probe(f"KV write put_along_axis rows {rows} cap {cap}", kv_write(cap, rows, True))
        probe(f"KV write slice_update rows {rows} cap {cap}", kv_write(cap, rows, False))
unary("add [16,1,4096]", (16, 1, HID), lambda y: y + y)
unary("add [1040,1,4096]", (1040, 1, HID), lambda y: y + y)
w = mx.ones((HID,), dtype=dt)
unary("rms_norm [16,1,4096]", (16, 1, HID), lambda y: mx.fast.rms_norm(y, w, 1e-5))
unary("rms_norm [1040,1,4096]", (1040, 1, HID), lambda y: mx.fast.rms_norm(y, w, 1e-5))
pos = mx.arange(1040, dtype=mx.int32)
unary("rope dynamic [1040,32,1,128]", (1040, H, 1, D), lambda y: mx.fast.rope(y, D, traditional=False, base=500000.0, scale=1.0, offset=pos))
unary("transpose copy [1040,32,1,128]->[1,32,1040,128]", (1040, H, 1, D), lambda y: mx.contiguous(y.transpose(2, 1, 0, 3)).transpose(2, 1, 0, 3))
unary("concatenate [16]+[1024] rows of 4096", (1040, HID), lambda y: mx.concatenate([y[:16], y[16:]], axis=0))
idx = mx.arange(16, dtype=mx.int32)
unary("take rows [1040,4096] -> 16 + back", (1040, HID), lambda y: mx.concatenate([mx.take(y, idx, axis=0), y[16:]], axis=0))
for rows in (16, 272, 1040):
    matmul(rows, 6144)
    matmul(rows, 2 * FF)
for t, keys in ((1024, 1024), (1024, 8192), (256, 8192), (16, 4096)):
    sdpa(t, keys, 8448)
sdpa(1, 8192, 8448)
