#!/usr/bin/env bash
# Smoke test of docker-compose.yml on a machine whose Docker cannot pull the build stage's
# rust image: builds the image's run stage from this checkout's already built binary and
# .cache (make build first), starts the stack with two workers, asks the gateway, and removes
# the stack. Needs a local debian:bookworm-slim image, docker and docker-compose.
#   bash deploy/docker/smoke.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
ctx=$(mktemp -d)
trap 'docker-compose -f "$root/docker-compose.yml" -p llmqsmoke down -v >/dev/null 2>&1 || true; rm -rf "$ctx"' EXIT
sed -n '/^FROM debian:bookworm-slim AS runtime/,/^CMD/p' "$root/deploy/docker/Dockerfile" >"$ctx/Dockerfile"
cat >>"$ctx/Dockerfile" <<'DOCKERFILE'
COPY opt/llmq /opt/llmq
RUN ln -s /opt/llmq/target/release/llmq /usr/local/bin/llmq && llmq --help >/dev/null
DOCKERFILE
mkdir -p "$ctx/opt/llmq/target/release" "$ctx/opt/llmq/.cache/mlx"
cp "$root/target/release/llmq" "$ctx/opt/llmq/target/release/"
cp -a "$root/.cache/mlx/cpu" "$ctx/opt/llmq/.cache/mlx/"
cp -a "$root/.cache/models" "$ctx/opt/llmq/.cache/"
docker build -q --network host -t llmq:local "$ctx"
docker-compose -f "$root/docker-compose.yml" -p llmqsmoke up -d --no-build --scale worker=2
for _ in $(seq 120); do
  curl -sf localhost:8000/health >/dev/null && break
  sleep 1
done
curl -sS --max-time 120 localhost:8000/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model":"smollm2","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":20}'
echo
echo "workers reporting: $(curl -sS localhost:8000/metrics | grep -c '^llmq_worker_active_streams{')"
