#!/usr/bin/env bash
# `make demo`: starts a local stack (nats-server, intake, one worker serving SmolLM2), streams the
# model's answer to a question through NATS, and stops the stack whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
llmq=target/release/llmq
question=${1:-"What is the capital of France?"}
out=$(mktemp)
"$llmq" up --model smollm2 >"$out" &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null; rm -f "$out"' EXIT
for _ in $(seq 1 600); do
  grep -q '^LLMQ_NATS_URL=' "$out" && break
  kill -0 $up 2>/dev/null || { echo "demo: llmq up exited" >&2; exit 1; }
  sleep 0.2
done
url=$(sed -n 's/^LLMQ_NATS_URL=//p' "$out")
[ -n "$url" ] || { echo "demo: the stack did not come up" >&2; exit 1; }
echo "demo: asking through NATS at $url: $question" >&2
"$llmq" generate --nats "$url" --model smollm2 --chat --prompt "$question" --max-tokens 64
