"""What a KV pool of token slots costs on MLX (issue 49's paged storage), before llmq builds on it.

One layer's pool is [slots, kv_heads, head_dim]. A decode step scatters each row's new key into
its slot; prefill attention gathers a sequence's keys through its block table. Measured here:
- a step's scatter of 32 rows into pools of 3 MB to 400 MB: alone, after an evaluated read of
  the pool, and while an unevaluated read of it is still alive (MLX then copies the whole pool
  instead of writing in place, because the scatter's input is shared);
- gathering 256 to 4096 tokens through a table of 16-token blocks spread over the pool, against
  copying a contiguous slice of the same size.

Run with the peer's venv (MLX's CPU build, the same C++ library llmq links):
  .cache/pypeer/bin/python lab/paged-kv/pool_costs.py
"""
import time

import mlx.core as mx

HEADS, DIM, ROWS, REPEAT = 3, 64, 32, 50


def timed(step):
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(REPEAT):
        step()
    return (time.perf_counter() - t) / REPEAT * 1e3


def scatter():
    new = mx.random.normal((ROWS, HEADS, DIM))
    idx = mx.arange(0, ROWS * 7, 7, dtype=mx.int32)
    mx.eval(new, idx)
    for slots in [4096, 65536, 524288]:
        state = {"pool": mx.zeros((slots, HEADS, DIM))}
        mx.eval(state["pool"])

        def write():
            state["pool"][idx] = new
            mx.eval(state["pool"])

        def read_then_write():
            g = state["pool"][idx]
            mx.eval(g)
            state["pool"][idx] = new
            mx.eval(state["pool"])

        def write_with_read_alive():
            g = state["pool"][idx]
            state["pool"][idx] = new
            mx.eval(state["pool"], g)

        mb = slots * HEADS * DIM * 4 / 1e6
        print(f"scatter of {ROWS} rows into a {mb:.0f} MB pool: alone {timed(write):.3f} ms, after an "
              f"evaluated read {timed(read_then_write):.3f} ms, with an unevaluated read alive "
              f"{timed(write_with_read_alive):.3f} ms")


def gather():
    slots, block = 524288, 16
    pool = mx.random.normal((slots, HEADS, DIM))
    contiguous = mx.random.normal((4096, HEADS, DIM))
    mx.eval(pool, contiguous)
    for tokens in [256, 1024, 4096]:
        blocks = mx.random.permutation(slots // block)[: tokens // block]
        idx = (blocks[:, None] * block + mx.arange(block)[None, :]).reshape(-1).astype(mx.int32)
        mx.eval(idx)
        g = timed(lambda: mx.eval(mx.take(pool, idx, axis=0)))
        c = timed(lambda: mx.eval(contiguous[:tokens] * 1.0))
        print(f"{tokens} tokens: gathered through a block table {g:.3f} ms, a contiguous copy {c:.3f} ms")


if __name__ == "__main__":
    scatter()
    gather()
