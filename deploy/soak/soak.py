"""`make soak`: the compose stack with three workers under a steady mixed load for a while
(default 30 minutes), a worker killed or restarted every few minutes and the NATS container
restarted once; then a report.

Load (a fixed number of clients, each starting its next request when the last one ends):
streams through NATS (the Python client, clients/python) and through the gateway (the `openai`
package, streamed), cancels mid-stream, clients that disconnect mid-stream, bad requests, and
requests that resend a long shared prefix (prefix cache reuse).

The report: requests sent, completed, typed errors by class, refused, cancelled or disconnected
as asked, and lost (accepted, yet no terminal event within `--lost-after-s`: must be 0); each
service's resident memory at the start of the load and at the end, beside each worker's KV
bytes held and its prefix cache's share (what the memory growth is made of); time to first token and
total time percentiles per phase (steady, the minute after a worker fault, the minute after the
NATS restart). Written to .cache/soak/report-<time>.json and printed.

Run with set-up's Python (.cache/pyclient), after `make image`:
    .cache/pyclient/bin/python deploy/soak/soak.py [--seconds 1800] [--clients 12]
"""

import argparse
import asyncio
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))

import openai  # noqa: E402
from llmq_client import Client, Done, JobFailed, Rejected, Tokens  # noqa: E402

PROJECT = "llmqsoak"
MODEL = "smollm2"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is photosynthesis?",
    "List five fruits.",
    "How many days are in a leap year?",
    "What does a compiler do?",
    "Why do we have seasons?",
    "What are the planets of the solar system?",
]
# A long system prompt several requests share (the prefix cache serves its KV).
PREFIX = "You are a careful assistant for a library. " + " ".join(
    f"Rule {i}: answer briefly, cite the shelf number, and never invent a title." for i in range(40)
)


def free_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


class Stack:
    """The compose project this soak runs (torn down at the end, whatever happens)."""

    def __init__(self):
        self.nats = free_port()
        self.gateway = free_port()
        self.env = dict(os.environ)
        env_file = ROOT / ".env"
        if not env_file.exists():
            sys.exit("soak: .env missing: run make image")
        for line in env_file.read_text().splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                self.env[k] = v
        self.env.update(
            LLMQ_NATS_PUBLISH=self.nats,
            LLMQ_GATEWAY_PUBLISH=self.gateway,
            LLMQ_MODELS=str(ROOT / ".cache" / "models"),
        )

    def compose(self, *args, check=True):
        cmd = ["docker-compose", "-p", PROJECT, "-f", "docker-compose.yml", *args]
        r = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr}")
        return r.stdout

    def containers(self, service):
        out = self.compose("ps", "-q", service)
        return [c for c in out.split() if c]

    def password(self, user):
        return self.env[f"LLMQ_NATS_{user.upper()}_PASSWORD"]

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(f"http://{self.gateway}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    def kv_mib(self) -> dict:
        """Each live worker's KV bytes held (its sequences and its prefix cache) and its prefix
        cache's share, from the gateway's /metrics (MiB)."""
        out = {}
        for line in self.metrics().splitlines():
            for name, key in [
                ("llmq_worker_kv_bytes_used{", "kv_held"),
                ("llmq_worker_prefix_cache_bytes{", "prefix_cache"),
            ]:
                if line.startswith(name):
                    worker = line.split('worker="', 1)[1].split('"', 1)[0]
                    mib = round(float(line.rsplit(" ", 1)[1]) / 2**20, 1)
                    out.setdefault(worker, {})[key] = mib
        return out

    def live_workers(self) -> int:
        for line in self.metrics().splitlines():
            if line.startswith("llmq_gateway_live_workers "):
                return int(float(line.split()[1]))
        return 0

    def rss(self) -> dict:
        """Resident memory of each running container's main process, by service (MiB)."""
        out = {}
        for service in ["nats", "intake", "worker", "gateway"]:
            for c in self.containers(service):
                r = subprocess.run(
                    ["docker", "inspect", "-f", "{{.State.Pid}} {{.Name}}", c],
                    capture_output=True,
                    text=True,
                )
                pid, name = r.stdout.split()
                try:
                    status = pathlib.Path(f"/proc/{pid}/status").read_text()
                    kb = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS"))
                except (OSError, StopIteration):
                    continue
                out[name.lstrip("/")] = round(kb / 1024, 1)
        return out


class Tally:
    def __init__(self):
        self.sent = 0
        self.completed = 0
        self.errors = {}
        self.refused = {}
        self.asked_ends = {"cancelled": 0, "disconnected": 0}
        self.lost = []
        self.latencies = {}  # phase -> [(ttft, total)]

    def error(self, cls):
        self.errors[cls] = self.errors.get(cls, 0) + 1

    def latency(self, phase, ttft, total):
        self.latencies.setdefault(phase, []).append((ttft, total))


class Soak:
    def __init__(self, stack: Stack, args):
        self.stack = stack
        self.args = args
        self.tally = Tally()
        self.phase = "steady"
        self.phase_until = 0.0
        self.end_at = 0.0

    def current_phase(self):
        return self.phase if time.monotonic() < self.phase_until else "steady"

    async def run(self):
        nc = await Client.connect(
            f"nats://{self.stack.nats}",
            user="client1",
            password=self.stack.password("client1"),
            inbox_prefix="_INBOX.client1",
            bound_s=120,
        )
        http = openai.AsyncOpenAI(base_url=f"http://{self.stack.gateway}/v1", api_key="none", max_retries=0)
        rss_start = (self.stack.rss(), self.stack.kv_mib())
        self.end_at = time.monotonic() + self.args.seconds
        faults = asyncio.ensure_future(self.faults())
        clients = [asyncio.ensure_future(self.client(i, nc, http)) for i in range(self.args.clients)]
        await asyncio.gather(*clients)
        faults.cancel()
        rss_end = (self.stack.rss(), self.stack.kv_mib())
        await nc.close()
        return rss_start, rss_end

    async def faults(self):
        every = self.args.fault_every_s
        nats_at = time.monotonic() + self.args.seconds / 2
        n = 0
        while True:
            await asyncio.sleep(every)
            n += 1
            workers = self.stack.containers("worker")
            if workers:
                victim = random.choice(workers)
                if n % 2:
                    print(f"soak: killing worker {victim[:12]}", flush=True)
                    subprocess.run(["docker", "kill", victim], capture_output=True)
                    await asyncio.sleep(10)
                    self.stack.compose("up", "-d", "--no-recreate", "--scale", "worker=3")
                else:
                    print(f"soak: restarting worker {victim[:12]}", flush=True)
                    await asyncio.to_thread(subprocess.run, ["docker", "restart", victim], capture_output=True)
                self.phase, self.phase_until = "after a worker fault", time.monotonic() + 60
            if nats_at and time.monotonic() >= nats_at:
                nats_at = 0
                print("soak: restarting nats", flush=True)
                await asyncio.to_thread(self.stack.compose, "restart", "nats")
                self.phase, self.phase_until = "after the NATS restart", time.monotonic() + 60

    async def client(self, i, nc, http):
        rng = random.Random(i)
        kinds = ["nats"] * 8 + ["http"] * 5 + ["cancel"] * 2 + ["disconnect"] * 2 + ["bad"] + ["prefix"] * 2
        while time.monotonic() < self.end_at:
            kind = rng.choice(kinds)
            try:
                await asyncio.wait_for(self.one(kind, rng, nc, http), self.args.lost_after_s)
            except asyncio.TimeoutError:
                self.tally.lost.append(kind)
            except (openai.APIConnectionError, ConnectionError, OSError) as e:
                # The gateway unreachable (or the NATS connection down) before acceptance.
                self.tally.refused[type(e).__name__] = self.tally.refused.get(type(e).__name__, 0) + 1
                await asyncio.sleep(1)

    async def one(self, kind, rng, nc, http):
        q = rng.choice(QUESTIONS)
        t0 = time.monotonic()
        phase = self.current_phase()
        self.tally.sent += 1
        if kind in ("http", "disconnect"):
            await self.http_stream(http, q, kind == "disconnect", t0, phase)
            return
        if kind == "bad":
            try:
                await nc.submit(MODEL, prompt=q, temperature=-1.0)
                self.tally.error("accepted a bad request")
            except Rejected as e:
                self.tally.refused[e.error_class] = self.tally.refused.get(e.error_class, 0) + 1
            return
        messages = [{"role": "user", "content": q}]
        if kind == "prefix":
            messages.insert(0, {"role": "system", "content": PREFIX})
        try:
            job = await nc.submit(MODEL, messages=messages, max_tokens=rng.choice([16, 48, 128]))
        except Rejected as e:
            self.tally.refused[e.error_class] = self.tally.refused.get(e.error_class, 0) + 1
            return
        first = None
        try:
            async for ev in job:
                if isinstance(ev, Tokens) and first is None:
                    first = time.monotonic() - t0
                    if kind == "cancel":
                        await job.cancel()
                if isinstance(ev, Done):
                    self.tally.completed += 1
                    self.tally.latency(phase, first, time.monotonic() - t0)
            if kind == "cancel":
                self.tally.error("a cancelled job ended normally")
        except JobFailed as e:
            if kind == "cancel" and e.error_class == "cancelled":
                self.tally.asked_ends["cancelled"] += 1
            else:
                self.tally.error(e.error_class)

    async def http_stream(self, http, q, disconnect, t0, phase):
        first = None
        try:
            stream = await http.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": q}],
                max_tokens=64,
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.monotonic() - t0
                    if disconnect:
                        await stream.close()
                        self.tally.asked_ends["disconnected"] += 1
                        return
            self.tally.completed += 1
            self.tally.latency(phase, first, time.monotonic() - t0)
        except openai.APIConnectionError:
            raise
        except openai.APIError as e:
            # A refusal (a status) or an error event in the stream, with its class as `code`.
            body = e.body if isinstance(e.body, dict) else {}
            code = getattr(e, "code", None) or body.get("code") or body.get("type")
            self.tally.error(f"http {getattr(e, 'status_code', 'stream')} {code}")


def percentiles(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    pick = lambda p: round(xs[min(len(xs) - 1, int(p * len(xs)))], 3)  # noqa: E731
    return {"n": len(xs), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(xs[-1], 3)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 1800)))
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--fault-every-s", type=float, default=240)
    p.add_argument("--lost-after-s", type=float, default=300)
    args = p.parse_args()
    stack = Stack()
    started = time.strftime("%Y-%m-%dT%H-%M-%S")
    try:
        stack.compose("down", "-v", "-t", "1", check=False)
        stack.compose("up", "-d", "--scale", "worker=3")
        t = time.monotonic()
        while stack.live_workers() < 3:
            if time.monotonic() - t > 300:
                sys.exit("soak: three workers never reported")
            time.sleep(1)
        soak = Soak(stack, args)
        rss_start, rss_end = asyncio.run(soak.run())
    finally:
        stack.compose("down", "-v", "-t", "2", "--remove-orphans", check=False)
    tally = soak.tally
    report = {
        "started": started,
        "seconds": args.seconds,
        "clients": args.clients,
        "sent": tally.sent,
        "completed": tally.completed,
        "typed_errors": tally.errors,
        "refused": tally.refused,
        "ended_as_asked": tally.asked_ends,
        "lost": len(tally.lost),
        "rss_mib_start": rss_start[0],
        "rss_mib_end": rss_end[0],
        "kv_mib_start": rss_start[1],
        "kv_mib_end": rss_end[1],
        "phases": {
            phase: {
                "ttft_s": percentiles([a for a, _ in xs]),
                "total_s": percentiles([b for _, b in xs]),
            }
            for phase, xs in tally.latencies.items()
        },
    }
    out = ROOT / ".cache" / "soak"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"report-{started}.json"
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"soak: report in {path}")
    if tally.lost:
        sys.exit(f"soak: {len(tally.lost)} requests lost")


if __name__ == "__main__":
    main()
