#!/bin/sh
# Installs gpu-ready into a fresh virtual environment. The Dockerfile runs exactly this; so does the
# test that checks the image's install steps without a Docker engine.
#   docker/install.sh <prefix> [source dir]
set -eu
prefix=${1:?usage: install.sh PREFIX [SRC]}
src=${2:-$(cd "$(dirname "$0")/.." && pwd)}
python3 -m venv "$prefix"
"$prefix/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --quiet "$src"
"$prefix/bin/gpu-ready" --version
