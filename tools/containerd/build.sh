#!/usr/bin/env bash
# Builds containerd 2.x (containerd, containerd-shim-runc-v2, ctr) for the real-node tests, from Go modules,
# cached outside the repo keyed by version. A second run with the same version costs nothing; two at once take
# turns on a lock (only when something is missing).
#   tools/containerd/build.sh            # build what is missing, print the bin dir
#   GPU_READY_TESTBIN=/path  ...         # override the cache root
# CGO_ENABLED=0 with the snapshotters that need cgo or extra libraries left out (overlayfs and native stay).
set -euo pipefail
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
here=$(cd "$(dirname "$0")" && pwd)
ver=$(awk '$1=="github.com/containerd/containerd/v2" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")
bin="${GPU_READY_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-ready-testbin}/containerd-$ver"
log() { echo "[containerd] $*" >&2; }
mkdir -p "$bin"
missing=()
for cmd in containerd containerd-shim-runc-v2 ctr; do [ -x "$bin/$cmd" ] || missing+=("$cmd"); done
if [ ${#missing[@]} -gt 0 ]; then
  # Two runs at once take turns (the second finds the binaries built and builds nothing).
  exec 9>"$bin/../.containerd-build.lock"
  if ! flock -n 9; then
    log "another build holds $bin/../.containerd-build.lock; waiting for it"
    flock 9
  fi
  missing=()
  for cmd in containerd containerd-shim-runc-v2 ctr; do [ -x "$bin/$cmd" ] || missing+=("$cmd"); done
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "building ${missing[*]} $ver (first time on this machine; cached afterwards)"
  start=$SECONDS
  tmp=$(mktemp -d "$bin/.build.XXXXXX")
  pkgs=()
  for cmd in "${missing[@]}"; do pkgs+=("github.com/containerd/containerd/v2/cmd/$cmd"); done
  (cd "$here" && go build -trimpath -tags "no_btrfs,no_devmapper,no_zfs,urfave_cli_no_docs" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$ver" -o "$tmp/" "${pkgs[@]}")
  for cmd in "${missing[@]}"; do mv "$tmp/$cmd" "$bin/$cmd"; done
  rmdir "$tmp"
  log "built in $((SECONDS - start)) s"
fi
echo "$bin"
