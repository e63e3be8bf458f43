#!/bin/sh
# Preflight serving gate for vLLM: start a small model on the node's GPUs, send one completion request,
# print the answer, stop the server. gpu-ready judges the exit code, the latency bound and the output.
# Needs an image with vLLM and the model in a local directory (no hub access at run time), e.g.
#   MODEL_DIR=/models/Qwen2.5-0.5B-Instruct
set -eu
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-8011}
TP=${TP:-$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)}
export HF_HUB_OFFLINE=1
python3 -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name check \
  --tensor-parallel-size "$TP" --port "$PORT" --max-model-len 2048 >/tmp/vllm.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
i=0
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  i=$((i + 1)); [ "$i" -lt 300 ] || { tail -50 /tmp/vllm.log >&2; exit 1; }
  kill -0 "$server" 2>/dev/null || { tail -50 /tmp/vllm.log >&2; exit 1; }
  sleep 2
done
curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"check","prompt":"The capital of France is","max_tokens":8,"temperature":0}'
