#!/usr/bin/env python3
"""Where a step's time goes, from the records of timeline.c (one process's .tsv).

A step is the time between the ends of two consecutive "gpu::finalize" ranges on the thread
that evaluates MLX's graphs (MLX commits its launches there once per eval call; a decode step is
one call). Steady steps are those with the most common kernel count. For them it prints medians:

  wall        the step, end of one commit to the end of the next
  build       host time outside MLX's evaluation and waits: the caller's code (llmq's) building
              the graph of operations, sampling, bookkeeping
  eval        host time inside "gpu::eval" ranges: MLX preparing and launching each operation
  api         host time inside CUDA runtime/driver calls on that thread (part of eval)
  wait        host time blocked in synchronizing calls
  busy        device time with a kernel, copy or set running (union over streams)
  idle        wall - busy: the device waiting for the host

then per operation (named by the kernels it launched): calls a step, host µs a call, device µs
a call; kernels by device time; API calls by host time. With --trace, a Chrome trace of a few
steady steps (chrome://tracing, ui.perfetto.dev).

Standard library only: runs on the GPU machine's python3 or here.
"""

import argparse
import bisect
import collections
import json
import re
import shutil
import statistics
import subprocess
import sys


def parse(path):
    kernels, device, api, starts, ranges = [], [], [], {}, []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            kind = p[0]
            if kind == "K":
                kernels.append((int(p[1]), int(p[2]), int(p[3]), int(p[4]), int(p[5]), p[6]))
            elif kind in ("C", "S"):
                device.append((int(p[1]), int(p[2]), int(p[3]), int(p[4]), kind))
            elif kind in ("R", "D"):
                api.append((int(p[1]), int(p[2]), int(p[3]), int(p[4]), kind, p[6]))
            elif kind == "N":
                ts, flags, rid, tid, name = int(p[1]), int(p[2]), int(p[3]), int(p[4]), p[6]
                if flags & 2:
                    starts[rid] = (ts, tid, name)
                elif flags & 4 and rid in starts:
                    s, t, n = starts.pop(rid)
                    ranges.append((s, ts, t, n))
    kernels.sort()
    device.sort()
    api.sort()
    ranges.sort()
    return kernels, device, api, ranges


def demangle(names):
    names = sorted(set(names))
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.split("\n")
    return {n: (lines[i] if i < len(lines) and lines[i] else n) for i, n in enumerate(names)}


def short(name):
    """A kernel's name without its template arguments, parameters and namespaces."""
    s = re.sub(r"^void ", "", name)
    depth, cut = 0, []
    for ch in s:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            cut.append(ch)
    s = "".join(cut).split("::")[-1].strip() or name
    return s[:48]


def union(intervals, lo, hi):
    """Total length of the union of intervals clipped to [lo, hi)."""
    total, end = 0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


class Sorted:
    """Records sorted by start time, for taking those that start in a window."""

    def __init__(self, items):
        self.items = items
        self.starts = [x[0] for x in items]

    def window(self, lo, hi):
        return self.items[bisect.bisect_left(self.starts, lo) : bisect.bisect_left(self.starts, hi)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv")
    ap.add_argument("--trace", help="write a Chrome trace of a few steady steps here")
    ap.add_argument("--trace-steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-kernels", type=int, default=8, help="windows with fewer kernels are not steps")
    a = ap.parse_args()

    kernels, device, api, ranges = parse(a.tsv)
    evals = collections.Counter(t for _, _, t, n in ranges if n == "gpu::eval")
    if evals:
        main_tid = evals.most_common(1)[0][0]
    elif api:
        main_tid = collections.Counter(x[2] for x in api).most_common(1)[0][0]
    else:
        sys.exit("summarize: no API calls or NVTX ranges recorded")
    mine = [r for r in ranges if r[2] == main_tid]
    my_api = [x for x in api if x[2] == main_tid]
    bounds = [e for s, e, _, n in mine if n == "gpu::finalize"]
    if len(bounds) < 3:
        bounds = [e for s, e, _, _, _, n in my_api if "ynchronize" in n]
    if len(bounds) < 3:
        sys.exit("summarize: too few step boundaries (no gpu::finalize ranges: was NVTX_INJECTION64_PATH set?)")

    names = demangle(k[5] for k in kernels)
    by_corr = collections.defaultdict(list)
    for k in kernels:
        by_corr[k[3]].append(k)
    launches = [x for x in my_api if "aunch" in x[5]]
    launch_starts = [x[0] for x in launches]

    # Device work that starts up to 50 ms before a step may still run in it.
    k_sorted, d_sorted, a_sorted = Sorted(kernels), Sorted(device), Sorted(my_api)
    r_sorted = Sorted(mine)
    windows = []
    for lo, hi in zip(bounds, bounds[1:]):
        ks = k_sorted.window(lo, hi)
        if len(ks) < a.min_kernels:
            continue
        windows.append((lo, hi, ks))
    if not windows:
        sys.exit("summarize: no window between commits launched enough kernels to be a step")
    counts = collections.Counter(len(w[2]) for w in windows)
    mode = counts.most_common(1)[0][0]
    steady = [w for w in windows if len(w[2]) == mode]

    rows = collections.defaultdict(list)
    ops = collections.defaultdict(lambda: [0, 0, 0])  # calls, host ns, device ns
    kern = collections.defaultdict(lambda: [0, 0])
    apis = collections.defaultdict(lambda: [0, 0])
    for lo, hi, ks in steady:
        wall = hi - lo
        here = r_sorted.window(lo - 50_000_000, hi)
        ev = [(s, e) for s, e, _, n in here if n == "gpu::eval" and lo <= s]
        fin = [(s, e) for s, e, _, n in here if n == "gpu::finalize" and lo < e <= hi]
        sync_r = [(s, e) for s, e, _, n in here if n == "gpu::synchronize" and lo <= s]
        calls = a_sorted.window(lo, hi)
        waits = [(s, e) for s, e, _, _, _, n in calls if "ynchronize" in n] + sync_r
        eval_t, fin_t, wait_t = union(ev, lo, hi), union(fin, lo, hi), union(waits, lo, hi)
        busy = union(
            [(k[0], k[1]) for k in k_sorted.window(lo - 50_000_000, hi)]
            + [(d[0], d[1]) for d in d_sorted.window(lo - 50_000_000, hi)],
            lo,
            hi,
        )
        rows["wall"].append(wall)
        rows["build"].append(wall - eval_t - fin_t - wait_t)
        rows["eval"].append(eval_t)
        rows["commit"].append(fin_t)
        rows["api"].append(union([(x[0], x[1]) for x in calls], lo, hi))
        rows["wait"].append(wait_t)
        rows["busy"].append(busy)
        rows["idle"].append(wall - busy)
        rows["eval ranges"].append(len(ev))
        rows["kernels"].append(len(ks))
        for s, e in ev:
            i = bisect.bisect_left(launch_starts, s)
            label, dev = [], 0
            while i < len(launches) and launches[i][0] < e:
                for k in by_corr.get(launches[i][3], []):
                    n = short(names.get(k[5], k[5]))
                    if n not in label:
                        label.append(n)
                    dev += k[1] - k[0]
                i += 1
            op = ops["+".join(label) or "(no kernel)"]
            op[0] += 1
            op[1] += e - s
            op[2] += dev
        for k in ks:
            kk = kern[short(names.get(k[5], k[5]))]
            kk[0] += 1
            kk[1] += k[1] - k[0]
        for s, e, _, _, kind, n in calls:
            aa = apis[f"{kind} {n}"]
            aa[0] += 1
            aa[1] += e - s

    n = len(steady)
    print(f"{a.tsv}: {len(windows)} steps, {n} steady ({mode} kernels each); thread {main_tid}")
    print(f"kernel counts of other steps: {dict(sorted((c, m) for c, m in counts.items() if c != mode))}")
    print("\nmedian per steady step (µs):")
    for key, vals in rows.items():
        v = statistics.median(vals)
        print(f"  {key:12s} {v / 1000 if key not in ('eval ranges', 'kernels') else v:10.1f}")
    print(f"\noperations a step (top {a.top} by host time): calls, host µs a call, device µs a call, host µs a step")
    for name, (c, h, d) in sorted(ops.items(), key=lambda x: -x[1][1])[: a.top]:
        print(f"  {c / n:7.1f} {h / c / 1000:8.2f} {d / c / 1000:8.2f} {h / n / 1000:9.1f}  {name}")
    print(f"\nkernels a step (top {a.top} by device time): count, device µs a step")
    for name, (c, d) in sorted(kern.items(), key=lambda x: -x[1][1])[: a.top]:
        print(f"  {c / n:7.1f} {d / n / 1000:9.1f}  {name}")
    print("\nAPI calls a step on that thread: count, host µs a step")
    for name, (c, d) in sorted(apis.items(), key=lambda x: -x[1][1])[: a.top]:
        print(f"  {c / n:7.1f} {d / n / 1000:9.1f}  {name}")

    if a.trace:
        mid = max(0, len(steady) // 2 - a.trace_steps // 2)
        pick = steady[mid : mid + a.trace_steps]
        lo, hi = pick[0][0], pick[-1][1]
        us = lambda t: (t - lo) / 1000.0
        ev = []
        for s, e, tid, name in ranges:
            if lo <= s < hi:
                ev.append({"name": name, "ph": "X", "ts": us(s), "dur": (e - s) / 1000, "pid": "host", "tid": f"nvtx {tid}"})
        for s, e, tid, corr, kind, name in api:
            if lo <= s < hi:
                ev.append({"name": name, "ph": "X", "ts": us(s), "dur": (e - s) / 1000, "pid": "host", "tid": f"{kind} {tid}", "args": {"corr": corr}})
        for s, e, stream, corr, graph, name in kernels:
            if lo <= s < hi:
                ev.append({"name": short(names.get(name, name)), "ph": "X", "ts": us(s), "dur": (e - s) / 1000, "pid": "device", "tid": f"stream {stream}", "args": {"corr": corr, "graph": graph, "kernel": names.get(name, name)}})
        for s, e, stream, corr, kind in device:
            if lo <= s < hi:
                ev.append({"name": "memcpy" if kind == "C" else "memset", "ph": "X", "ts": us(s), "dur": (e - s) / 1000, "pid": "device", "tid": f"stream {stream}", "args": {"corr": corr}})
        with open(a.trace, "w") as f:
            json.dump({"traceEvents": ev, "displayTimeUnit": "ns"}, f)
        print(f"\ntrace of {len(pick)} steady steps ({len(ev)} events): {a.trace}")


if __name__ == "__main__":
    main()
