#!/usr/bin/env bash
# Builds node-problem-detector (for the side-by-side benchmark) once, cached outside the repo by version.
set -euo pipefail
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
here=$(cd "$(dirname "$0")" && pwd)
ver=$(awk '$1=="k8s.io/node-problem-detector" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")
out="${GPU_READY_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-ready-testbin}/npd-$ver"
if [ ! -x "$out/node-problem-detector" ]; then
  mkdir -p "$out"
  echo "[npd] building node-problem-detector $ver (first time; cached afterwards)" >&2
  start=$SECONDS
  # disable_* tags leave out the journald (cgo) and system-stats plugins; the kmsg monitor stays in.
  (cd "$here" && go build -trimpath -tags "disable_system_log_monitor_journald disable_stackdriver_exporter" \
     -ldflags "-s -w" -o "$out/node-problem-detector.tmp" k8s.io/node-problem-detector/cmd/nodeproblemdetector)
  mv "$out/node-problem-detector.tmp" "$out/node-problem-detector"
  echo "[npd] built in $((SECONDS - start)) s" >&2
fi
echo "$out/node-problem-detector"
