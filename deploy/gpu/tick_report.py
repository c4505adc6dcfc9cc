"""Summarises worker tick logs (`worker.tick_log`, e.g. LLMQ__WORKER__TICK_LOG=PATH) of the burst benchmark.

Usage: python3 deploy/gpu/tick_report.py [--rows N] TICKLOG...

N: the active streams of the scenario (the benchmark's `--active`, 16 by default); ticks with
at least N rows are the ones the streams see.

A tick log line starts with: tick start (ms), tick duration (ms), rows decoded, chunk tokens,
prompt tokens done. Tick times here are intervals from one tick's start to the next (the gap a
stream sees). Printed per log: the decode-only ticks before the burst, the burst's ticks by
chunk size (median, p90, max, max over the decode-only median), the six longest, every tick
with N or more rows by rows and whether it carried a chunk (with the decode actor's host
time parts: queueing the next step, of it building and launching, waiting), chunk ticks by chunk size
and offset into the prompt, and burst ticks by the layers of the chunk stage they launched
(the tick budget's choice).
"""
import sys, statistics as st
def pct(xs, p):
    xs = sorted(xs); return xs[min(len(xs)-1, int(p*len(xs)))] if xs else float('nan')
args = sys.argv[1:]
ACTIVE = 16
if args[:1] == ["--rows"]:
    ACTIVE, args = int(args[1]), args[2:]
for path in args:
    rows, parts = [], []
    for line in open(path):
        f = line.split()
        if len(f) < 5: continue
        rows.append((float(f[0]), float(f[1]), int(f[2]), int(f[3]), int(f[4])))
        parts.append({k: float(v) for k, v in (x.split("=", 1) for x in f[5:] if "=" in x)})
    # burst phase: from the first tick with every active stream and a chunk
    start = next((i for i, r in enumerate(rows) if r[2] >= ACTIVE and r[3] > 0), None)
    if start is None:
        print(path, "no burst"); continue
    # intervals between consecutive tick starts
    iv = [(rows[i+1][0] - rows[i][0], rows[i]) for i in range(len(rows)-1)]
    dec = [d for d, r in iv[:start] if r[2] >= ACTIVE and r[3] == 0]
    burst = [(d, r) for d, r in iv[start:] if r[2] >= ACTIVE]
    end = max(i for i, (d, r) in enumerate(burst) if r[3] > 0)
    burst = burst[:end+2]
    by = {}
    for d, r in burst:
        by.setdefault(r[3], []).append(d)
    D = st.median(dec[-200:]) if dec else float('nan')
    print(f"{path}: decode-only before burst median {D:.2f} ms (n={len(dec)})")
    for n, ds in sorted(by.items()):
        print(f"  chunk {n:5d}: n={len(ds):4d} median {st.median(ds):6.2f} p90 {pct(ds,0.9):6.2f} max {max(ds):6.2f}  ({max(ds)/D:.2f}x)")
    # the longest intervals, each with the parts of the tick that started it
    idx = {id(r): i for i, r in enumerate(rows)}
    top = sorted(burst, key=lambda x: -x[0])[:6]
    for d, r in top:
        p = parts[idx[id(r)]]
        print(f"  top {d:6.1f}ms rows={r[2]} chunk={r[3]} done={r[4]} "
              + " ".join(f"{n}={p[n]:.1f}" for n in ("masks", "join", "queue", "build", "launch", "wait", "rest") if n in p))
    # chunk tick by done offset bucket (size 256/128 both)
    buck = {}
    for d, r in burst:
        if r[3] > 0:
            buck.setdefault((r[3], min(r[4] // 2048, 3)), []).append(d)
    kinds = {}
    for i, (d, r) in enumerate(iv):
        if r[2] >= ACTIVE:
            kinds.setdefault((r[2], r[3] > 0), []).append((d, parts[i]))
    for k, v in sorted(kinds.items()):
        ds = [d for d, _ in v]
        named = {n: st.median(p.get(n, 0.0) for _, p in v) for n in ("queue", "build", "launch", "wait")}
        print(f"  rows {k[0]}{'+c' if k[1] else '  '}: n={len(v):4d} median {st.median(ds):5.1f} max {max(ds):5.1f}  "
              + " ".join(f"{n} {x:.2f}" for n, x in named.items()))
    print("  by offset:", "; ".join(f"{k[0]}@{k[1]*2}-{k[1]*2+2}k {st.median(v):.1f}" for k, v in sorted(buck.items())))
    # burst ticks by the layers of the chunk stage they launched (tick budget; 0: none)
    lay = {}
    for d, r in burst:
        p = parts[idx[id(r)]]
        if "layers" in p:
            lay.setdefault((r[2], int(p["layers"])), []).append(d)
    if lay:
        print("  by stage layers:", "; ".join(f"{k[0]} rows L={k[1]} n={len(v)} median {st.median(v):.1f} max {max(v):.1f}" for k, v in sorted(lay.items())))
    # The host's pace by phase: decode-only steps before the burst, during it, after it.
    # build: the decode step's graph building (ms, median of decode-only ticks); churn: MLX's
    # cache moved a tick (GB, up or down); mem: MLX's in-use plus cached GB at most.
    b0 = start
    b1 = idx[id(burst[-1][1])] if burst else len(rows) - 1
    phases = {"before": range(max(0, b0 - 200), b0), "burst": range(b0, b1 + 1), "after": range(b1 + 1, len(rows))}
    for name, rng in phases.items():
        sel = [i for i in rng if rows[i][2] >= ACTIVE]
        if not sel:
            continue
        build = [parts[i]["build"] for i in sel if rows[i][3] == 0 and "build" in parts[i]]
        churn = [abs(parts[i].get("cache_gb", 0) - parts[i - 1].get("cache_gb", 0)) for i in sel if i > 0]
        mem = [parts[i].get("active_gb", 0) + parts[i].get("cache_gb", 0) for i in sel]
        print(f"  phase {name:6s}: ticks {len(sel):4d} build {st.median(build) if build else float('nan'):.2f} ms "
              f"churn {st.median(churn) if churn else 0:.2f} GB mem {max(mem):.1f} GB")
