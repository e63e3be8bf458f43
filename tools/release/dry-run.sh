#!/usr/bin/env bash
# `make release-dry-run`: the release (.github/workflows/release.yml) on this machine, pushing nothing and needing
# no container registry:
#   1. the image from docker/Dockerfile, built the registry-free way of the real-node tests
#      (tools/node-image/build.sh: a local Debian bookworm base, wheels of requirements/runtime.lock; cached);
#   2. its digest: the image written as an OCI image layout (podman push to a local folder, gzip layers, as a
#      registry would get it), the manifest's sha256, checked against the blob in the layout;
#   3. the steps the workflow shares (tools/release/stage.sh): the chart packaged with version and appVersion =
#      VERSION and that digest, rendered and checked (repository@sha256:...), the SBOM of the image's Python
#      packages checked against the lock, the light Kubernetes client path on in the image.
# Only linux/amd64 (this machine's architecture) is built; the workflow builds linux/amd64 and linux/arm64.
#   tools/release/dry-run.sh [VERSION]      # default: agent.__version__ (agent/__init__.py)
#   REGISTRY=registry.example/team ...     # the registry the chart would point at (default: stage.sh's)
# Writes dist/release-dry-run/ (RELEASE_OUT overrides): the chart .tgz, sbom.cdx.json, rendered.yaml, summary.txt.
# Needs what tools/node-image/build.sh needs (podman, runc, mmdebstrap, gcc; root) and helm (make testbin).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
version=${1:-$(sed -n -E 's/^__version__ = "([^"]+)"$/\1/p' agent/__init__.py)}
out=${RELEASE_OUT:-$repo/dist/release-dry-run}
if [ -z "${HELM:-}" ]; then
  HELM="$(tools/k8s-testbin/build.sh 2>/dev/null)/helm"
  export HELM
fi
podman_opts=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)  # as tools/node-image/build.sh
log() { echo "[dry-run] $*" >&2; }
start=$SECONDS

# -- 1. the image ------------------------------------------------------------------------------------------------
built=$(tools/node-image/build.sh)
image=$(sed -n 's/^AGENT_IMAGE=//p' <<<"$built")
tar=$(sed -n 's/^AGENT_IMAGE_TAR=//p' <<<"$built")
if [ -z "$image" ] || [ ! -s "$tar" ]; then echo "dry-run: tools/node-image/build.sh gave no image" >&2; exit 1; fi
loaded=""
if ! podman image exists "$image"; then
  podman load --quiet -i "$tar" >/dev/null
  loaded=$image
fi
work=$(mktemp -d)
cleanup() {
  rm -rf "$work"
  if [ -n "$loaded" ]; then podman rmi --force "$loaded" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
log "image: $image (from $tar)"

# -- 2. its digest -------------------------------------------------------------------------------------------------
podman push --quiet --digestfile "$work/digest" "$image" "oci:$work/layout:$version" >/dev/null
digest=$(cat "$work/digest")
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "dry-run: podman push gave no digest ('$digest')" >&2; exit 1; }
blob="$work/layout/blobs/sha256/${digest#sha256:}"
if [ ! -s "$blob" ] || [ "sha256:$(sha256sum <"$blob" | cut -d' ' -f1)" != "$digest" ] ||
  ! grep -q "\"$digest\"" "$work/layout/index.json"; then
  echo "dry-run: the OCI layout does not hold a manifest with digest $digest" >&2
  exit 1
fi
log "digest: $digest (the OCI manifest of the image as pushed)"

# -- 3. the shared release steps -----------------------------------------------------------------------------------
rm -rf "$out"
CONTAINER_RUN="podman run ${podman_opts[*]}" tools/release/stage.sh \
  --version "$version" --digest "$digest" --image "$image" --out "$out"
echo "release dry run for $version passed in $((SECONDS - start)) s; nothing pushed; results in ${out#"$repo"/}/"
