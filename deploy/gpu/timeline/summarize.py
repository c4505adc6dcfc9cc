#!/usr/bin/env python3
"""Where a step's time goes, from the records of timeline.c (one process's .tsv).

The launching thread is the one that launches the most kernels (the thread that evaluates MLX's
graphs). Each kernel, copy and set is placed at the start of the call that launched it. A step
runs from one launch of a kernel launched once a step (`--marker`: greedy sampling's argmax) to
the next; without one, the host's waits (synchronizing calls) cut that thread's time into
windows, and a step begins with a window that launches the most kernels (a forward) and takes
the smaller windows after it (sampling, reading the token back). Steady steps are those within
2% of the median kernel count, the first two left out. For them it prints medians:

  wall               the step, from the wait before its forward to the wait before the next
  host outside CUDA  host time in no CUDA call: llmq's code building the graph of operations,
                     MLX preparing each operation, sampling, bookkeeping
  launch calls       host time inside kernel and graph launches
  other calls        host time inside other CUDA calls (allocation, events)
  wait               host time blocked in synchronizing calls
  device work        device time of the kernels, copies and sets the step launched
  device busy/idle   wall time the device ran anything / nothing

then kernels by device time and by count, the host's time by the operation launched (from the
previous launch to this one, and the launch call), and API calls by host time. With --trace, a Chrome
trace of a few steady steps (chrome://tracing, ui.perfetto.dev), NVTX ranges included when the
program marks any (MLX's CUDA backend marks few).

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
    ap.add_argument("--min-kernels", type=int, default=8, help="steps launching fewer kernels are not steps")
    ap.add_argument(
        "--marker",
        default="arg_reduce",
        help="a kernel launched once a step (its name contains this); '' or fewer than 8: steps "
        "are cut at the host's waits",
    )
    a = ap.parse_args()

    kernels, device, api, ranges = parse(a.tsv)
    launches_by_tid = collections.Counter(x[2] for x in api if "aunch" in x[5])
    if not launches_by_tid:
        sys.exit("summarize: no launches recorded")
    main_tid = launches_by_tid.most_common(1)[0][0]
    my_api = [x for x in api if x[2] == main_tid]
    # Each kernel, copy and set belongs to the call that launched it (same correlation id; a
    # graph's kernels carry its launch's); it is placed at that call's start.
    launched_at = {x[3]: x[0] for x in my_api}
    mine_k = sorted((launched_at[k[3]], k) for k in kernels if k[3] in launched_at)
    mine_d = sorted((launched_at[d[3]], d) for d in device if d[3] in launched_at)
    at = [t for t, _ in mine_k]
    count = lambda lo, hi: bisect.bisect_left(at, hi) - bisect.bisect_left(at, lo)
    names = demangle(k[5] for k in kernels)
    marks = [t for t, k in mine_k if a.marker and a.marker in names.get(k[5], k[5])]
    if len(marks) >= 8:
        # A step runs from one launch of the marker kernel to the next (greedy sampling's
        # argmax: one a step, in llmq and in mlx-lm, whose steps overlap the host's waits).
        starts = marks
    else:
        syncs = [e for s, e, _, _, _, n in my_api if "ynchronize" in n]
        if len(syncs) < 3:
            sys.exit("summarize: no marker kernel and fewer than 3 synchronizing calls")
        # Windows between the host's waits; a step is a window that launches the most kernels
        # (the forward) together with the smaller windows after it (sampling, the token read).
        wins = [(lo, hi, count(lo, hi)) for lo, hi in zip(syncs, syncs[1:])]
        sizes = sorted(c for _, _, c in wins)
        big = max(a.min_kernels, sizes[int(0.9 * (len(sizes) - 1))] // 2)
        starts = [lo for lo, _, c in wins if c >= big] + [wins[-1][1]]
    steps = [(lo, hi, count(lo, hi)) for lo, hi in zip(starts, starts[1:])]
    med = statistics.median(c for _, _, c in steps)
    steady = [w for w in steps[2:] if abs(w[2] - med) <= 0.02 * med]
    if not steady:
        sys.exit("summarize: no steady steps")

    all_k = Sorted(kernels)
    k_sorted = Sorted([(t,) + k for t, k in mine_k])
    d_sorted = Sorted([(t,) + d for t, d in mine_d])
    a_sorted = Sorted(my_api)
    rows = collections.defaultdict(list)
    kern = collections.defaultdict(lambda: [0, 0])
    apis = collections.defaultdict(lambda: [0, 0])
    # The host's time for each operation: from the previous launch (or wait) to this launch, and
    # the launch call itself, under the name of the kernel it launched.
    named = {k[3]: k[5] for k in kernels}
    ops = collections.defaultdict(lambda: [0, 0, 0])
    for lo, hi, _ in steady:
        wall = hi - lo
        ks = [x[1:] for x in k_sorted.window(lo, hi)]
        ds = [x[1:] for x in d_sorted.window(lo, hi)]
        calls = a_sorted.window(lo, hi)
        waits = [(s, e) for s, e, _, _, _, n in calls if "ynchronize" in n]
        launch = [(s, e) for s, e, _, _, _, n in calls if "aunch" in n]
        api_t, wait_t, launch_t = (union(x, lo, hi) for x in ([(c[0], c[1]) for c in calls], waits, launch))
        # The device time of this step's own work, wherever it ran, and the wall time the
        # device was busy with anything.
        own = union([(k[0], k[1]) for k in ks] + [(d[0], d[1]) for d in ds], 0, 1 << 62)
        busy = union(
            [(k[0], k[1]) for k in all_k.window(lo - 50_000_000, hi)] + [(d[0], d[1]) for d in ds], lo, hi
        )
        rows["wall"].append(wall)
        rows["host outside CUDA"].append(wall - api_t)
        rows["launch calls"].append(launch_t)
        rows["other calls"].append(api_t - launch_t - wait_t)
        rows["wait"].append(wait_t)
        rows["device work"].append(own)
        rows["device busy"].append(busy)
        rows["device idle"].append(wall - busy)
        rows["kernels"].append(len(ks))
        rows["launches"].append(sum(1 for c in calls if "aunch" in c[5]))
        for k in ks:
            kk = kern[k[5]]
            kk[0] += 1
            kk[1] += k[1] - k[0]
        for s, e, _, _, kind, n in calls:
            aa = apis[f"{kind} {n}"]
            aa[0] += 1
            aa[1] += e - s
        prev = lo
        for s, e, _, corr, _, n in calls:
            if "ynchronize" in n:
                prev = e
            elif "aunch" in n and (corr in named or "Graph" in n):
                op = ops["(a CUDA graph)" if "Graph" in n else named[corr]]
                op[0] += 1
                op[1] += max(0, s - prev)
                op[2] += e - s
                prev = e

    merged = collections.defaultdict(lambda: [0, 0])
    for raw, (c, d) in kern.items():
        m = merged[short(names.get(raw, raw))]
        m[0] += c
        m[1] += d
    host_ops = collections.defaultdict(lambda: [0, 0, 0])
    for raw, vals in ops.items():
        m = host_ops[short(names.get(raw, raw))]
        for i in range(3):
            m[i] += vals[i]
    n = len(steady)
    print(f"{a.tsv}: {len(steps)} steps, {n} steady (median {med:.0f} kernels); thread {main_tid}")
    print("\nmedian per steady step (µs; counts for kernels and launches):")
    for key, vals in rows.items():
        v = statistics.median(vals)
        print(f"  {key:18s} {v if key in ('kernels', 'launches') else v / 1000:10.1f}")
    for by, key in (("device time", 1), ("count", 0)):
        print(f"\nkernels a step (top {a.top} by {by}): count, device µs a step, µs a kernel")
        for name, (c, d) in sorted(merged.items(), key=lambda x: -x[1][key])[: a.top]:
            print(f"  {c / n:7.1f} {d / n / 1000:9.1f} {d / c / 1000:8.2f}  {name}")
    print(
        f"\nhost time a step by the kernel launched (top {a.top}): launches, µs before the launch "
        "(building and preparing it), µs in the launch call, µs a launch in all"
    )
    for name, (c, b, l) in sorted(host_ops.items(), key=lambda x: -(x[1][1] + x[1][2]))[: a.top]:
        print(f"  {c / n:7.1f} {b / n / 1000:9.1f} {l / n / 1000:9.1f} {(b + l) / c / 1000:8.2f}  {name}")
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
            if lo <= s < hi + 50_000_000:
                ev.append({"name": short(names.get(name, name)), "ph": "X", "ts": us(s), "dur": (e - s) / 1000, "pid": "device", "tid": f"stream {stream}", "args": {"corr": corr, "graph": graph, "kernel": names.get(name, name)}})
        for s, e, stream, corr, kind in device:
            if lo <= s < hi:
                ev.append({"name": "memcpy" if kind == "C" else "memset", "ph": "X", "ts": us(s), "dur": (e - s) / 1000, "pid": "device", "tid": f"stream {stream}", "args": {"corr": corr}})
        with open(a.trace, "w") as f:
            json.dump({"traceEvents": ev, "displayTimeUnit": "ns"}, f)
        print(f"\ntrace of {len(pick)} steady steps ({len(ev)} events): {a.trace}")


if __name__ == "__main__":
    main()
