"""Samples every thread's CPU time on the machine (from /proc) until killed, and prints, per
interval, the threads that used at least a tenth of a CPU: when the machine's busy time grows
in a burst (the tick log's `busy`), this says which threads took it.

Usage: python3 deploy/gpu/thread_cpu.py [PERIOD_S] > FILE   (kill it when done)
Lines: seconds since start, then `process/thread:tid=ms` for each busy thread, busiest first.
"""
import os, sys, time
period = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
hz = os.sysconf("SC_CLK_TCK")

def sample():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            proc = open(f"/proc/{pid}/comm").read().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                s = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = s[s.index("(") + 1:s.rindex(")")]
                f = s[s.rindex(")") + 2:].split()
                out[(proc, name, tid)] = (int(f[11]) + int(f[12])) * 1000.0 / hz
        except (OSError, ValueError):
            continue
    return out

t0 = time.time()
last = sample()
while True:
    time.sleep(period)
    now = sample()
    busy = sorted(((v - last.get(k, v), k) for k, v in now.items()), reverse=True)
    line = " ".join(f"{p}/{n}:{t}={ms:.0f}" for ms, (p, n, t) in busy if ms >= 100 * period)
    print(f"{time.time() - t0:.2f} {line}", flush=True)
    last = now
