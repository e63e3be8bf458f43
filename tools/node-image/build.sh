#!/usr/bin/env bash
# Builds the images the real-node tests load into containerd, with no container registry:
#   1. a Debian bookworm root filesystem with python3 + venv, made by mmdebstrap from this machine's own apt
#      source, imported into podman as localhost/gpu-ready-base:bookworm (a local name: never the real
#      base image's name);
#   2. the agent image from the unchanged docker/Dockerfile with BASE_IMAGE=<that base>, the build container
#      without any network (--network none): pip installs from wheels downloaded on the host beforehand;
#   3. a sandbox ("pause") image: pause.c, static, in a scratch image.
# Each result is an image archive cached outside the repo, keyed by a hash of its inputs, so a second run with
# unchanged inputs costs nothing. Prints three lines: KEY=archive path (AGENT_IMAGE_TAR, PAUSE_IMAGE_TAR) and
# AGENT_IMAGE=<the image's name>.
#   tools/node-image/build.sh            # build what is missing
#   GPU_READY_TESTBIN=/path  ...         # override the cache root
# Needs (Debian): podman, runc, mmdebstrap, gcc + libc6-dev; root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache="${GPU_READY_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-ready-testbin}/node-image"
py=${PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
log() { echo "[node-image] $*" >&2; }
for cmd in podman runc mmdebstrap gcc; do
  command -v "$cmd" >/dev/null || { echo "node-image: $cmd not found (apt-get install podman runc mmdebstrap gcc)" >&2; exit 2; }
done
mkdir -p "$cache"
# Two runs at once take turns (podman's store and the archives are shared); the second finds them built.
exec 9>"$cache/.build.lock"
if ! flock -n 9; then
  log "another build holds $cache/.build.lock; waiting for it"
  flock 9
fi
# podman on a cgroup v1 (hybrid) host without CAP_SYS_RESOURCE: crun refuses hybrid cgroups (runc works), and
# the default rlimits cannot be raised (explicit low ones can be set).
podman_run_opts=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)

hash_of() { sha256sum | cut -c1-16; }

# -- 1. base root filesystem -------------------------------------------------------------------------------
sources=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
  if [ -s "$f" ]; then sources=$f; break; fi
done
[ -n "$sources" ] || { echo "node-image: no apt source on this machine" >&2; exit 2; }
base_key=$({ cat "$sources"; echo "essential python3 python3-venv v1"; } | hash_of)
base_tar="$cache/base-bookworm-$base_key.tar"
base_image="localhost/gpu-ready-base:bookworm-$base_key"
if [ ! -s "$base_tar" ]; then
  log "base: mmdebstrap bookworm (python3, python3-venv) from $sources"
  start=$SECONDS
  mmdebstrap --quiet --format=tar --variant=essential --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/etc/apt/sources.list.d/* "$1"/etc/apt/sources.list' \
    bookworm "$base_tar.tmp" "$sources"
  mv "$base_tar.tmp" "$base_tar"
  log "base: built in $((SECONDS - start)) s"
fi
if ! podman image exists "$base_image"; then
  podman import --quiet "$base_tar" "$base_image" >/dev/null
fi

# -- 2. the agent image ------------------------------------------------------------------------------------
inputs=(pyproject.toml README.md LICENSE requirements/runtime.lock docker/Dockerfile docker/install.sh)
agent_key=$({
  echo "$base_key"
  (cd "$repo" && find agent -type f ! -path '*/__pycache__/*' ! -name '*.pyc' | LC_ALL=C sort; printf '%s\n' "${inputs[@]}") |
    while read -r f; do echo "$f"; cat "$repo/$f"; done
} | hash_of)
agent_image="localhost/gpu-ready:test-$agent_key"
agent_tar="$cache/gpu-ready-$agent_key.tar"
if [ ! -s "$agent_tar" ]; then
  start=$SECONDS
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The build context: exactly the files the Dockerfile copies.
  mkdir -p "$work/ctx/docker" "$work/ctx/requirements" "$work/wheels"
  cp -r "$repo/agent" "$repo/pyproject.toml" "$repo/README.md" "$repo/LICENSE" "$work/ctx/"
  cp "$repo/docker/install.sh" "$work/ctx/docker/"
  cp "$repo/requirements/runtime.lock" "$work/ctx/requirements/"
  find "$work/ctx" -name __pycache__ -prune -exec rm -rf {} +
  # Wheels for the image's Python (3.11, glibc x86_64), downloaded here with the host's pip and its trust
  # settings: the runtime set as requirements/runtime.lock pins and hashes it, and the build backend
  # (build-system.requires) that builds gpu-ready itself; the build container then installs with no index and no
  # network.
  mapfile -t build_reqs < <("$py" -c 'import sys, tomllib
print(*tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"], sep="\n")' "$repo/pyproject.toml")
  download=("$py" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --dest "$work/wheels"
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
    --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)
  log "agent: downloading the wheels of requirements/runtime.lock and ${build_reqs[*]}"
  "${download[@]}" --require-hashes -r "$repo/requirements/runtime.lock"
  "${download[@]}" "${build_reqs[@]}"
  printf '[global]\nno-index = true\nfind-links = /wheels\n' >"$work/pip.conf"
  log "agent: podman build (BASE_IMAGE=$base_image, no network)"
  podman build --quiet "${podman_run_opts[@]}" --pull=never --network=none \
    --build-arg "BASE_IMAGE=$base_image" \
    -v "$work/wheels:/wheels:ro" -v "$work/pip.conf:/etc/pip.conf:ro" \
    -f "$repo/docker/Dockerfile" -t "$agent_image" "$work/ctx" >/dev/null
  podman run --rm "${podman_run_opts[@]}" --network=none "$agent_image" --version >&2
  podman save --quiet --format docker-archive -o "$agent_tar.tmp" "$agent_image"
  mv "$agent_tar.tmp" "$agent_tar"
  # Keep podman's storage small: the archive is the cache.
  podman rmi --force "$agent_image" >/dev/null 2>&1 || true
  podman image prune --force >/dev/null 2>&1 || true
  log "agent: built in $((SECONDS - start)) s, $(du -m "$agent_tar" | cut -f1) MB archive"
  # Only the newest agent archive is kept (each is ~350 MB; a changed source makes a new one).
  find "$cache" -maxdepth 1 -name 'gpu-ready-*.tar' ! -path "$agent_tar" -delete
fi

# -- 3. the sandbox image ----------------------------------------------------------------------------------
pause_key=$(hash_of <"$here/pause.c")
pause_tar="$cache/pause-$pause_key.tar"
if [ ! -s "$pause_tar" ]; then
  work=$(mktemp -d)
  mkdir -p "$work/root"
  gcc -static -Os -Wall -Wextra -o "$work/root/pause" "$here/pause.c"
  strip "$work/root/pause"
  tar -C "$work/root" -cf "$work/pause-root.tar" pause
  podman import --quiet --change 'ENTRYPOINT ["/pause"]' "$work/pause-root.tar" localhost/pause:local >/dev/null
  podman save --quiet --format docker-archive -o "$pause_tar.tmp" localhost/pause:local
  mv "$pause_tar.tmp" "$pause_tar"
  rm -rf "$work"
fi
echo "AGENT_IMAGE=$agent_image"
echo "AGENT_IMAGE_TAR=$agent_tar"
echo "PAUSE_IMAGE=localhost/pause:local"
echo "PAUSE_IMAGE_TAR=$pause_tar"
