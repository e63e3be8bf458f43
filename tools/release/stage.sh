#!/usr/bin/env bash
# The steps of a release between building the image and pushing anything, shared by the release workflow
# (.github/workflows/release.yml) and `make release-dry-run` (tools/release/dry-run.sh). Pushes nothing.
#   1. the chart: a copy of charts/gpu-ready with version and appVersion = VERSION, image.repository =
#      $REGISTRY/gpu-ready and image.digest = DIGEST in its values.yaml; `helm lint`, `helm package` into OUT;
#   2. the packaged chart rendered (`helm template`): every image of the DaemonSet and of the preflight Job is
#      $REGISTRY/gpu-ready@DIGEST; with image.digest unset it is $REGISTRY/gpu-ready:VERSION (the tag follows);
#   3. the image: an SBOM of its Python packages made inside it (tools/release/sbom.py, CycloneDX JSON) and
#      checked against requirements/runtime.lock (tools/release/check_sbom.py); the agent's light Kubernetes
#      client path is on in it (with the locked client it must be: agent/lazy.py falls back silently otherwise).
# Writes OUT/gpu-ready-VERSION.tgz, OUT/sbom.cdx.json, OUT/rendered.yaml, OUT/summary.txt; prints the summary.
#   tools/release/stage.sh --version 1.2.3 --digest sha256:<64 hex> --image IMAGE --out DIR
# Environment: REGISTRY (default ghcr.io/gpu-ready: the one place the release registry is named), HELM (helm
# binary, default helm), CONTAINER_RUN (how to run a container, default "docker run"; the dry run passes
# podman's), PYTHON (3.11+, default the repository's .venv or python3), KUBE_VERSION (for helm template).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
REGISTRY=${REGISTRY:-ghcr.io/gpu-ready}
HELM=${HELM:-helm}
read -ra container_run <<<"${CONTAINER_RUN:-docker run}"
py=${PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
kube_version=${KUBE_VERSION:-$(awk -F'"' '/^K8S_VERSION=/{print $2}' "$repo/tools/k8s-testbin/versions.env")}
log() { echo "[release] $*" >&2; }
fail() { echo "[release] FAILED: $*" >&2; exit 1; }

version="" digest="" image="" out=""
while [ $# -gt 0 ]; do
  case $1 in
    --version) version=$2; shift 2 ;;
    --digest) digest=$2; shift 2 ;;
    --image) image=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: $0 --version X.Y.Z --digest sha256:<hex> --image IMAGE --out DIR" >&2; exit 2 ;;
  esac
done
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || fail "--version '$version' is not X.Y.Z"
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "--digest '$digest' is not sha256:<64 hex>"
if [ -z "$image" ] || [ -z "$out" ]; then fail "--image and --out are required"; fi
[[ $REGISTRY =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] || fail "REGISTRY '$REGISTRY' is not host[:port][/path]"
repository="$REGISTRY/gpu-ready"
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# -- 1. the chart --------------------------------------------------------------------------------------------
cp -r "$repo/charts/gpu-ready" "$work/gpu-ready"
chart="$work/gpu-ready"
sed -i -E "s|^version: .*|version: $version|; s|^appVersion: .*|appVersion: \"$version\"|" "$chart/Chart.yaml"
# only inside the top-level image: block of values.yaml
sed -i -E "/^image:/,/^[^ #]/ { s|^  repository: .*|  repository: $repository|; s|^  digest: [^#]*(#.*)?$|  digest: \"$digest\"   \\1| }" \
  "$chart/values.yaml"
"$HELM" lint --quiet --kube-version "$kube_version" "$chart" >/dev/null || fail "helm lint"
rm -f "$out/gpu-ready-$version.tgz"
"$HELM" package "$chart" -d "$out" >/dev/null
tgz="$out/gpu-ready-$version.tgz"
[ -s "$tgz" ] || fail "helm package made no $tgz"
shown=$("$HELM" show chart "$tgz")
if ! grep -qx "version: $version" <<<"$shown" || ! grep -qx "appVersion: \"\?$version\"\?" <<<"$shown"; then
  fail "the packaged chart's version/appVersion are not $version"
fi
log "chart: $tgz (version $version, image $repository@$digest)"

# -- 2. the rendered chart -----------------------------------------------------------------------------------
images() {  # the distinct image: values of a rendered manifest on stdin, one a line
  sed -n -E 's/^[[:space:]]*(- )?image: *"?([^" ]+)"?[[:space:]]*$/\2/p' | sort -u
}
render() { "$HELM" template gpu-ready "$tgz" -n gpu-ready --kube-version "$kube_version" "$@"; }
render >"$out/rendered.yaml"
daemonset=$(render --show-only templates/daemonset.yaml | images)
[ "$daemonset" = "$repository@$digest" ] || fail "the DaemonSet's image is '$daemonset', not $repository@$digest"
preflight=$(render --set preflight.enabled=true --set preflight.nodeName=node-1 --show-only templates/preflight.yaml | images)
[ "$preflight" = "$repository@$digest" ] || fail "the preflight Job's image is '$preflight', not $repository@$digest"
by_tag=$(render --set image.digest=null --show-only templates/daemonset.yaml | images)
[ "$by_tag" = "$repository:$version" ] || fail "without a digest the image is '$by_tag', not $repository:$version"
log "render: DaemonSet and preflight Job run $repository@$digest; without the digest $repository:$version"

# -- 3. the image ----------------------------------------------------------------------------------------------
in_image() { "${container_run[@]}" --rm -i --network none --entrypoint /opt/gpu-ready/bin/python "$image" "$@"; }
in_image - --extras podresources <"$repo/tools/release/sbom.py" >"$out/sbom.cdx.json" || fail "the SBOM (sbom.py in $image)"
sbom_summary=$("$py" "$repo/tools/release/check_sbom.py" "$out/sbom.cdx.json") || fail "the SBOM does not match requirements/runtime.lock"
log "$sbom_summary"
probe='import json, sys
import agent
from agent.kube.client import client_layer
light = client_layer().light
print(json.dumps({"version": agent.__version__, "light": light, "whole_client": "kubernetes.client.models" in sys.modules}))'
facts=$(in_image -c "$probe") || fail "could not run the agent's Python in $image"
grep -q '"light": true, "whole_client": false' <<<"$facts" ||
  fail "the light Kubernetes client path is off in the image ($facts): the locked kubernetes fell back to the whole client"
image_version=$(sed -E 's/.*"version": "([^"]*)".*/\1/' <<<"$facts")
[ "$image_version" = "$version" ] || log "note: the image's agent reports version $image_version, the chart says $version"
log "image: gpu-ready $image_version, light Kubernetes client path on"
contents=$(in_image - <"$repo/tools/release/image_facts.py") || fail "could not read the image's contents ($image)"
fact() { sed -E "s/.*\"$1\": ([0-9]+).*/\1/" <<<"$contents"; }
grep -q '"packaging_tools": \[\]' <<<"$contents" ||
  fail "packaging tools in the image's runtime environment: $(sed -E 's/.*"packaging_tools": //' <<<"$contents")"
image_line="$(( $(fact bytes) / 1048576 )) MiB uncompressed ($(fact files) files), $(fact debian_packages) Debian and $(fact python_packages) Python packages, no pip/setuptools/wheel"
log "image contents: $image_line"

{
  echo "version:    $version"
  echo "image:      $repository@$digest"
  echo "chart:      $tgz"
  echo "render:     DaemonSet + preflight Job -> $repository@$digest"
  echo "sbom:       $out/sbom.cdx.json"
  echo "            $sbom_summary"
  echo "light path: on (gpu-ready $image_version in the image)"
  echo "contents:   $image_line"
} | tee "$out/summary.txt"
