#!/bin/sh
# Installs gpu-ready into a fresh virtual environment. The Dockerfile runs exactly this; so does the
# test that checks the image's install steps without a Docker engine.
#   docker/install.sh <prefix> [source dir]
set -eu
prefix=${1:?usage: install.sh PREFIX [SRC]}
src=${2:-$(cd "$(dirname "$0")/.." && pwd)}
python3 -m venv "$prefix"
pip="$prefix/bin/python -m pip --no-cache-dir --disable-pip-version-check --quiet"
# The runtime set (the dependencies and the podresources extra) exactly as requirements/runtime.lock pins it, each
# file checked against the lock's hashes, wheels only; then gpu-ready itself without dependencies, so nothing
# unpinned comes in (pip check: the lock holds every dependency gpu-ready declares).
$pip install --require-hashes --only-binary=:all: -r "$src/requirements/runtime.lock"
$pip install --no-deps "$src"
"$prefix/bin/python" -m pip check --disable-pip-version-check >/dev/null
# No packaging tools in the runtime environment: scanners flag pip, setuptools and wheel, and the agent never
# installs anything. pip goes last (it removes itself).
"$prefix/bin/python" -m pip uninstall --yes --quiet --disable-pip-version-check setuptools wheel pip 2>/dev/null
for tool in pip setuptools wheel; do
  if "$prefix/bin/python" -c "import $tool" 2>/dev/null; then echo "install.sh: $tool is still in $prefix" >&2; exit 1; fi
done
# Bytecode compiled once here, optimised: without column tables (PYTHONNODEBUGRANGES: smaller code
# objects in memory), as the plain .pyc and as the -OO one (no docstrings or asserts) that an interpreter run
# with PYTHONOPTIMIZE=2 loads. The image runs with PYTHONDONTWRITEBYTECODE, so nothing is compiled at run time.
site=$("$prefix/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYTHONNODEBUGRANGES=1 "$prefix/bin/python" -m compileall -q -f -j 0 -o 0 -o 2 "$site" >/dev/null
"$prefix/bin/gpu-ready" --version
PYTHONOPTIMIZE=2 "$prefix/bin/gpu-ready" --version >/dev/null
