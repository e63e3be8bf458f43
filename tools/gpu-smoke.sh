#!/usr/bin/env bash
# `make gpu-smoke`: on a machine with NVIDIA GPUs, capture real nvidia-smi output (table, -q, --query-gpu CSV,
# nvlink --status), the PCIe link fields and device nodes, run `gpu-ready check --json` with NVML on and
# `gpu-ready preflight` with an example profile (spec, burn-in, NVLink and CUDA gates), all into one folder
# named with the GPU model and driver version, and a node bundle written by `gpu-ready capture` (redacted) with the
# verdict its replay gives, so the run can join the node corpus (tests/fixtures/nodes/, docs/corpus.md: copy the
# bundle folder there, add `expect`, `sources` and `notes` to its bundle.json). Commit what is useful as test
# fixtures (tests/fixtures, with a SOURCES.md row). Without NVIDIA GPUs it prints "no NVIDIA GPU here" and exits 0.
#
# Environment: NVIDIA_SMI (default nvidia-smi), GPU_SMOKE_OUT (parent folder, default ./gpu-smoke),
# GPU_SMOKE_PROFILE (default examples/preflight/h100x8-profile.yaml), GPU_SMOKE_GATES (default
# spec,burnin,nvlink,cuda), GPU_SMOKE_BURNIN (burn-in seconds, default 20), GPU_SMOKE_DEV (default /dev),
# PY (python with gpu-ready installed; default .venv/bin/python, else python3).
set -u

SMI=${NVIDIA_SMI:-nvidia-smi}
DEV=${GPU_SMOKE_DEV:-/dev}
if ! command -v "$SMI" >/dev/null 2>&1; then
    echo "nvidia-smi not found"
    echo "no NVIDIA GPU here"
    exit 0
fi
list=$("$SMI" -L 2>&1)
rc=$?
if [[ $rc -ne 0 || $list != *"GPU 0:"* ]]; then
    echo "nvidia-smi -L (exit $rc): ${list:0:200}"
    echo "no NVIDIA GPU here"
    exit 0
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[[ -x $PY ]] || PY=python3
PROFILE=${GPU_SMOKE_PROFILE:-$ROOT/examples/preflight/h100x8-profile.yaml}
GATES=${GPU_SMOKE_GATES:-spec,burnin,nvlink,cuda}

first() { "$SMI" --query-gpu="$1" --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '\r'; }
slug() { tr -c 'A-Za-z0-9.\n' '-' | sed -e 's/--*/-/g' -e 's/^-//' -e 's/-$//'; }
driver=$(first driver_version | slug)
model=$(first name | sed -e 's/^NVIDIA //' | slug)
count=$(printf '%s\n' "$list" | sed -n '/^GPU [0-9]/p' | sed -n '$=')
tag="${model:-gpu}x${count:-0}-${driver:-unknown}"
OUT=${GPU_SMOKE_OUT:-$ROOT/gpu-smoke}/gpu-smoke-$tag-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
echo "capturing into $OUT"

# capture NAME CMD...: stdout+stderr into NAME, the exit code into exit-codes.txt
capture() {
    local name=$1
    shift
    "$@" >"$OUT/$name" 2>&1
    local code=$?
    echo "$code $name: $*" >>"$OUT/exit-codes.txt"
    echo "  $name (exit $code)"
}

CORE=index,pci.bus_id,name,uuid,driver_version,memory.total,mig.mode.current,pcie.link.gen.max,pcie.link.width.max,ecc.mode.current
LINK=index,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.gen.gpumax,pcie.link.width.current,pcie.link.width.max,utilization.gpu
CLOCKS=index,pci.bus_id,clocks_event_reasons.active,clocks_event_reasons.hw_slowdown,clocks_event_reasons.hw_thermal_slowdown,clocks_event_reasons.hw_power_brake_slowdown,temperature.gpu
capture "smi-table-$tag.txt" "$SMI"
capture "smi-q-$tag.txt" "$SMI" -q
capture "smi-L-$tag.txt" "$SMI" -L
capture "smi-csv-core-$tag.txt" "$SMI" --query-gpu=$CORE --format=csv
capture "smi-csv-core-noheader-nounits-$tag.txt" "$SMI" --query-gpu=$CORE --format=csv,noheader,nounits
capture "smi-csv-pcie-link-$tag.txt" "$SMI" --query-gpu=$LINK --format=csv
capture "smi-csv-clock-events-$tag.txt" "$SMI" --query-gpu=$CLOCKS --format=csv
capture "smi-nvlink-status-$tag.txt" "$SMI" nvlink --status
capture "smi-topo-m-$tag.txt" "$SMI" topo -m
capture "dev-nodes-$tag.txt" ls -lR "$DEV"/nvidia-caps "$DEV"/nvidiactl "$DEV"/nvidia-uvm "$DEV"/nvidia-uvm-tools
ls -l "$DEV"/nvidia[0-9]* >>"$OUT/dev-nodes-$tag.txt" 2>&1

# PCIe link fields of every NVIDIA GPU and of each PCI device above it (what agent/probes/pcie.py reads).
{
    for d in /sys/bus/pci/devices/*; do
        [[ $(cat "$d/vendor" 2>/dev/null) == 0x10de ]] || continue
        [[ $(cat "$d/class" 2>/dev/null) == 0x030* ]] || continue
        p=$(cd "$d" && pwd -P)
        while [[ $(basename "$p") =~ ^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$ ]]; do
            echo "$p"
            for f in current_link_width max_link_width current_link_speed max_link_speed; do
                echo "  $f: $(cat "$p/$f" 2>&1)"
            done
            p=$(dirname "$p")
        done
    done
} >"$OUT/sysfs-pcie-links-$tag.txt" 2>&1

capture "gpu-ready-check-$tag.json" "$PY" -m agent.cli check --json --nvml on --nvidia-smi "$SMI"
# The node bundle: every reading the check makes, recorded (NVML included), and its replay's verdict beside it.
capture "gpu-ready-capture-$tag.txt" "$PY" -m agent.cli capture -o "$OUT/bundle-$tag" --nvml on --nvidia-smi "$SMI"
capture "gpu-ready-replay-$tag.json" "$PY" -m agent.cli check --json --replay "$OUT/bundle-$tag"
sed -e "s/^burnInSeconds:.*/burnInSeconds: ${GPU_SMOKE_BURNIN:-20}/" "$PROFILE" >"$OUT/profile.yaml"
capture "gpu-ready-preflight-$tag.json" "$PY" -m agent.cli preflight --profile "$OUT/profile.yaml" --json \
    --gates "$GATES" --nvidia-smi "$SMI"
{
    echo "gpu-smoke $tag"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "kernel: $(uname -r)"
    echo "profile: $PROFILE (burnInSeconds ${GPU_SMOKE_BURNIN:-20}), gates: $GATES"
    "$PY" -m agent.cli --version 2>&1
} >"$OUT/README.txt"
echo "done: $OUT"
echo "node bundle: $OUT/bundle-$tag (to add it to the corpus: docs/corpus.md)"
