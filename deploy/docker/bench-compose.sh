#!/usr/bin/env bash
# The same batch benchmark on `llmq up` (processes on the host) and through the compose stack
# (one worker container; bench connects to its NATS as the gateway user, which may follow the
# workers' heartbeats), alternating, in one run. Needs make image. Prints one JSON line per run
# with "via": "llmq up" or "compose".
#   bash deploy/docker/bench-compose.sh [rounds] [bench options...]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
rounds=${1:-2}; shift || true
opts=(--model smollm2 --streams 16 --prompt-tokens 128 --output-tokens 64 "$@")
llmq=target/release/llmq
[ -f .env ] || { echo "no .env: run make image" >&2; exit 1; }
set -a; . ./.env; set +a
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export LLMQ_NATS_PUBLISH=127.0.0.1:$port LLMQ_GATEWAY_PUBLISH=127.0.0.1:0
project=llmqbench$$
trap 'docker-compose -p $project down -v -t 2 >/dev/null 2>&1 || true' EXIT
docker-compose -p $project up -d --scale worker=1 >/dev/null 2>&1
url="nats://gateway:$LLMQ_NATS_GATEWAY_PASSWORD@127.0.0.1:$port"
# Ready once a worker's heartbeat reaches the bench's connection: a one-request warm run.
for _ in $(seq 60); do
  $llmq bench batch --nats "$url" --model smollm2 --streams 1 --prompt-tokens 8 --output-tokens 4 --json >/dev/null 2>&1 && break
  sleep 2
done
for _ in $(seq "$rounds"); do
  $llmq bench batch "${opts[@]}" --json 2>/dev/null | tail -n1 | sed 's/^{/{"via":"llmq up",/'
  $llmq bench batch --nats "$url" "${opts[@]}" --json 2>/dev/null | tail -n1 | sed 's/^{/{"via":"compose",/'
done
