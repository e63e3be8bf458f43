#!/usr/bin/env bash
# Build the real control plane used by the tests (kube-apiserver + etcd, kube-scheduler, kube-controller-manager, kubelet) and the chart/alert
# tooling (helm, promtool, kubectl), caching everything outside the repo keyed by version.
# A second run with the same versions costs nothing.
#
#   tools/k8s-testbin/build.sh            # build what is missing, print the bin dir
#   tools/k8s-testbin/build.sh demo       # only what `make demo` starts: kube-apiserver, etcd, kube-scheduler
#   tools/k8s-testbin/build.sh oldest     # also kube-apiserver at K8S_OLDEST_VERSION; prints a bin dir with it
#                                         # and every other binary of the current one (GPU_READY_TESTBIN_DIR)
#   GPU_READY_TESTBIN=/path  ...          # override the cache root
# A run whose binaries are all cached returns at once, before the lock. Two runs that build (two `make` targets,
# CI beside a developer) take turns on a lock in the cache root; each build writes to a temporary name of its own and renames it into place, so a binary is whole or absent.
set -euo pipefail
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false

here=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=$(awk -F'"' '/^K8S_VERSION=/{print $2}' "$here/versions.env")
HELM_VERSION=$(awk -F'"' '/^HELM_VERSION=/{print $2}' "$here/versions.env")
MINOR=$(echo "$K8S_VERSION" | cut -d. -f2)
ETCD_VERSION=$(awk '$1=="go.etcd.io/etcd/server/v3" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")
cache_root=${GPU_READY_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-ready-testbin}
bin="$cache_root/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION"
mkdir -p "$bin"
log() { echo "[k8s-testbin] $*" >&2; }
only=${1:-all}
case "$only" in all | demo | oldest) ;; *) echo "usage: $0 [all|demo|oldest]" >&2; exit 2 ;; esac
if [ "$only" = oldest ]; then
  # The oldest claimed minor: its kube-apiserver beside the current etcd (etcd 3.x serves both) and tools.
  # kube-controller-manager, kube-scheduler and kubelet stay at the current minor: only the apiserver's
  # admission and API behaviour are tested at the old minor (the tests that need the others skip there).
  "$0" all >/dev/null
  OLDEST=$(awk -F'"' '/^K8S_OLDEST_VERSION=/{print $2}' "$here/versions.env")
  old="$cache_root/k8s-$OLDEST-apiserver"
  combo="$bin-apiserver-$OLDEST"
  mkdir -p "$old" "$combo"
  if [ ! -x "$old/kube-apiserver" ]; then
    exec 9>"$cache_root/.build.lock"
    flock 9
    if [ ! -x "$old/kube-apiserver" ]; then
      log "kube-apiserver $OLDEST: building (first time on this machine; cached afterwards)"
      start=$SECONDS
      (cd "$here/k8s-1.32" && go build -trimpath -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=v$OLDEST \
        -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$OLDEST" | cut -d. -f2)" \
        -o "$old/kube-apiserver.tmp.$$" k8s.io/kubernetes/cmd/kube-apiserver)
      mv "$old/kube-apiserver.tmp.$$" "$old/kube-apiserver"
      log "kube-apiserver $OLDEST: built in $((SECONDS - start)) s"
    fi
  fi
  for f in "$bin"/*; do [ "$(basename "$f")" = kube-apiserver ] || ln -sfn "$f" "$combo/"; done
  ln -sfn "$old/kube-apiserver" "$combo/kube-apiserver"
  echo "$combo"
  exit 0
fi
# Everything this run needs already built: no lock to wait for (another run may be building the rest).
cached() {
  local names=(kube-apiserver etcd kube-scheduler)
  if [ "$only" = all ]; then names+=(kube-controller-manager kubelet helm promtool prometheus); fi
  for n in "${names[@]}"; do [ -x "$bin/$n" ] || return 1; done
  if [ "$only" = all ]; then
    [ "$(cat "$bin/helm.kube-version" 2>/dev/null)" = "1.$MINOR" ] || return 1
    [ -f "$bin/crds/monitoring.coreos.com_prometheusrules.yaml" ] || return 1
  fi
}
if cached; then
  echo "$bin"
  exit 0
fi
exec 9>"$cache_root/.build.lock"
if ! flock -n 9; then
  log "another build holds $cache_root/.build.lock; waiting for it"
  flock 9
fi

build() {  # build <output> <package> [ldflags]
  local out=$1 pkg=$2 ld=${3:-}
  if [ -x "$bin/$out" ]; then log "$out: cached"; return; fi
  log "$out: building $pkg (first time on this machine; cached afterwards)"
  local start=$SECONDS
  (cd "$here" && go build -trimpath -ldflags "-s -w $ld" -o "$bin/$out.tmp.$$" "$pkg")
  mv "$bin/$out.tmp.$$" "$bin/$out"
  log "$out: built in $((SECONDS - start)) s"
}

build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver \
  "-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$MINOR"
build etcd go.etcd.io/etcd/server/v3
# kube-scheduler and kube-controller-manager from the same module: the taint tests need the real scheduler
# (NoSchedule) and the real taint-eviction controller (NoExecute).
k8s_ld="-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$MINOR"
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "$k8s_ld"
if [ "$only" = demo ]; then
  echo "$bin"
  exit 0
fi
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$k8s_ld"
# kubelet (same module) for the real-node tests.
build kubelet k8s.io/kubernetes/cmd/kubelet "$k8s_ld"

# helm's default Kubernetes version (what `helm template` and `lint` assume without --kube-version) set to the
# one the tests run, instead of the v1.20 a plain `go install` gives.
if [ ! -x "$bin/helm" ] || [ "$(cat "$bin/helm.kube-version" 2>/dev/null)" != "1.$MINOR" ]; then
  log "helm: go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION (default Kubernetes 1.$MINOR)"
  tmp=$(mktemp -d)
  GOBIN="$tmp" go install -ldflags "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$MINOR" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$tmp/helm" "$bin/helm.tmp.$$" && mv "$bin/helm.tmp.$$" "$bin/helm"
  rmdir "$tmp"
  echo "1.$MINOR" > "$bin/helm.kube-version"
fi

# promtool + prometheus from Debian's package, extracted without installing the service.
if [ ! -x "$bin/promtool" ] || [ ! -x "$bin/prometheus" ]; then
  if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
    ln -sf "$(command -v promtool)" "$bin/promtool"; ln -sf "$(command -v prometheus)" "$bin/prometheus"
  else
    log "promtool/prometheus: extracting Debian's prometheus package"
    tmp=$(mktemp -d)
    (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get download prometheus >/dev/null; }; } \
      && dpkg -x prometheus_*.deb x)
    cp "$tmp/x/usr/bin/promtool" "$tmp/x/usr/bin/prometheus" "$bin/"
    rm -rf "$tmp"
  fi
fi
# prometheus-operator CRDs (ServiceMonitor, PrometheusRule), generated from their Go API types with
# controller-gen, for the chart's server-side dry-run.
crds="$bin/crds"
if [ ! -f "$crds/monitoring.coreos.com_prometheusrules.yaml" ]; then
  log "crds: generating prometheus-operator CRDs with controller-gen"
  mon=$(awk '$1=="github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring"{print $2; exit}' \
    "$here/../crdgen/go.mod")
  (cd "$here/../crdgen" && go tool controller-gen crd:maxDescLen=0 \
    "paths=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1" \
    "output:crd:dir=$crds.tmp.$$") && mv "$crds.tmp.$$" "$crds"
  echo "$mon" > "$crds/VERSION"
fi
echo "$bin"
