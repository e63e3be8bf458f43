"""`gpu-ready preflight`: five gates before a new or repaired GPU node takes work.

Gates: spec (the node matches a declared profile), burn-in, NVLink/P2P bandwidth, CUDA runtime, serving.
Each ends pass, fail or skipped (with the reason), with evidence, its duration and its own timeout.
With --node the outcome is recorded on the Node: all pass -> label <key>=passed, annotate the time and a
short report, uncordon if preflight cordoned it; a gate fails -> label <key>=failed, keep it cordoned
(cordon it if needed) and emit an Event naming the gate and the evidence."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import yaml

from agent.kube import ApiError, KubeApi
from agent.probes.kmsg import KmsgSource
from agent.probes.nvidia_smi import parse_smi_table
from agent.report.events import EventReporter
from agent.xid import KernelLogParser, XidClassifier

GATES = ("spec", "burnin", "nvlink", "cuda", "serving")
PASS, FAIL, SKIP = "pass", "fail", "skipped"
CORDONED_BY = "gpu-ready.io/preflight-cordoned"
TIME_ANNOTATION = "gpu-ready.io/preflight-time"
REPORT_ANNOTATION = "gpu-ready.io/preflight-report"
QUERY = (
    "index,pci.bus_id,name,memory.total,driver_version,mig.mode.current,pcie.link.gen.max,"
    "pcie.link.width.max,ecc.mode.current"
)


class ProfileError(ValueError):
    pass


@dataclass
class Profile:
    gpu_model: str | None = None  # substring of the GPU name, e.g. "H100"
    gpu_count: int | None = None
    memory_per_gpu_mib: int | None = None  # minimum
    driver_version: str | None = None  # e.g. ">=550.90, <600"
    cuda_version: str | None = None  # e.g. ">=12.4"
    mig_mode: str | None = None  # "enabled" | "disabled"
    nvlink_links_per_gpu: int | None = None
    pcie_gen: int | None = None  # minimum max-link generation
    pcie_width: int | None = None  # minimum max-link width
    ecc_enabled: bool | None = None
    allow_skip: list[str] = field(default_factory=lambda: ["serving"])
    timeouts: dict[str, float] = field(default_factory=dict)
    burnin_seconds: float = 300.0
    burnin_command: str | None = None  # e.g. "dcgmi diag -r 3" or "gpu_burn 300"
    p2p_min_gbps: float | None = None
    serving: dict[str, Any] = field(default_factory=dict)  # command, maxLatencySeconds, expectOutput

    KEYS = {
        "gpuModel": "gpu_model",
        "gpuCount": "gpu_count",
        "memoryPerGpuMiB": "memory_per_gpu_mib",
        "driverVersion": "driver_version",
        "cudaVersion": "cuda_version",
        "migMode": "mig_mode",
        "nvlinkLinksPerGpu": "nvlink_links_per_gpu",
        "pcieGen": "pcie_gen",
        "pcieWidth": "pcie_width",
        "eccEnabled": "ecc_enabled",
        "allowSkip": "allow_skip",
        "timeouts": "timeouts",
        "burnInSeconds": "burnin_seconds",
        "burnInCommand": "burnin_command",
        "p2pMinGBps": "p2p_min_gbps",
        "serving": "serving",
    }

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError("the profile must be a mapping")
        unknown = sorted(set(data) - set(cls.KEYS))
        if unknown:
            raise ProfileError(f"unknown profile keys: {', '.join(unknown)} (known: {', '.join(cls.KEYS)})")
        p = cls(**{cls.KEYS[k]: v for k, v in data.items()})
        bad = [g for g in p.allow_skip if g not in GATES] + [g for g in p.timeouts if g not in GATES]
        if bad:
            raise ProfileError(f"unknown gate names {bad}; gates are {', '.join(GATES)}")
        if p.mig_mode not in (None, "enabled", "disabled"):
            raise ProfileError("migMode must be enabled or disabled")
        for spec in (p.driver_version, p.cuda_version):
            if spec:
                version_matches("0", spec)  # raises on a malformed range
        return p

    @classmethod
    def load(cls, path: str) -> Profile:
        try:
            with open(path, encoding="utf-8") as fh:
                return cls.from_mapping(yaml.safe_load(fh) or {})
        except (OSError, yaml.YAMLError) as e:
            raise ProfileError(f"cannot read profile {path}: {e}") from e


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def version_matches(version: str, spec: str) -> bool:
    """spec: comma-separated constraints like ">=550.90, <600" or "==12.4"."""
    ok = True
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|>|<|=)?\s*([0-9][0-9.]*)\s*", part)
        if not m:
            raise ProfileError(f"bad version constraint {part!r} in {spec!r}")
        op, want = m.group(1) or ">=", _vtuple(m.group(2))
        have = _vtuple(version)
        ok &= {
            ">=": have >= want,
            "<=": have <= want,
            "==": have == want,
            "=": have == want,
            ">": have > want,
            "<": have < want,
        }[op]
    return ok


@dataclass
class GateResult:
    gate: str
    status: str
    reason: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    timeout_s: float = 0.0


@dataclass
class GpuSpec:
    index: int
    bus_id: str
    name: str
    memory_mib: int | None
    driver: str | None
    mig: str | None
    pcie_gen: int | None
    pcie_width: int | None
    ecc: str | None
    nvlink_up: int | None = None


def _int(v: str) -> int | None:
    m = re.search(r"\d+", v)
    return int(m.group()) if m else None


def read_spec_nvidia_smi(nvidia_smi: str, timeout_s: float = 30) -> tuple[list[GpuSpec], str | None]:
    """The fallback reader: `nvidia-smi --query-gpu` (values with or without units), the table header for
    the CUDA version, `nvidia-smi nvlink --status` for NVLink links."""

    def run(*args: str) -> str:
        r = subprocess.run([nvidia_smi, *args], capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"nvidia-smi {' '.join(args)} exited {r.returncode}: {r.stdout.strip()[:200]}")
        return r.stdout

    gpus = []
    for line in run(f"--query-gpu={QUERY}", "--format=csv,noheader,nounits").splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 9 or not f[0].isdigit():
            continue
        gpus.append(GpuSpec(int(f[0]), f[1], f[2], _int(f[3]), f[4], f[5], _int(f[6]), _int(f[7]), f[8]))
    cuda = parse_smi_table(run()).cuda_version
    current = None
    for line in run("nvlink", "--status").splitlines():
        m = re.match(r"GPU (\d+):", line)
        if m:
            current = next((g for g in gpus if g.index == int(m.group(1))), None)
            if current is not None:
                current.nvlink_up = 0
        elif current is not None and re.search(r"Link \d+: [0-9.]+ GB/s", line):
            current.nvlink_up = (current.nvlink_up or 0) + 1
    return gpus, cuda


def read_spec_nvml(nv: Any) -> tuple[list[GpuSpec], str | None]:
    """The primary reader: NVML (nvidia-ml-py, or a stand-in with the same calls)."""

    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    driver = text(nv.nvmlSystemGetDriverVersion())
    cu = int(nv.nvmlSystemGetCudaDriverVersion_v2())
    cuda = f"{cu // 1000}.{cu % 1000 // 10}"
    gpus = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mig = ecc = None
        try:
            mig = "Enabled" if nv.nvmlDeviceGetMigMode(h)[0] == 1 else "Disabled"
        except nv.NVMLError:
            mig = "N/A"
        try:
            ecc = "Enabled" if nv.nvmlDeviceGetEccMode(h)[0] == 1 else "Disabled"
        except nv.NVMLError:
            ecc = "N/A"
        up = 0
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                up += nv.nvmlDeviceGetNvLinkState(h, link) == 1
            except nv.NVMLError:
                break
        gpus.append(
            GpuSpec(
                i,
                text(nv.nvmlDeviceGetPciInfo(h).busId),
                text(nv.nvmlDeviceGetName(h)),
                int(nv.nvmlDeviceGetMemoryInfo(h).total) // 2**20,
                driver,
                mig,
                int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                int(nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
                ecc,
                up,
            )
        )
    return gpus, cuda


def read_spec(nvidia_smi: str, nv: Any = None) -> tuple[list[GpuSpec], str | None, str]:
    """NVML first, nvidia-smi when NVML is not there or fails; returns (gpus, cuda, source)."""
    if nv is not None:
        try:
            gpus, cuda = read_spec_nvml(nv)
            return gpus, cuda, "nvml"
        except Exception:  # NVML present but broken for this query: fall back
            pass
    gpus, cuda = read_spec_nvidia_smi(nvidia_smi)
    return gpus, cuda, "nvidia-smi"


def check_spec(profile: Profile, gpus: list[GpuSpec], cuda: str | None) -> GateResult:
    problems: list[str] = []
    p = profile
    if p.gpu_count is not None and len(gpus) != p.gpu_count:
        problems.append(f"expected {p.gpu_count} GPUs, found {len(gpus)}")
    if p.cuda_version and (cuda is None or not version_matches(cuda, p.cuda_version)):
        problems.append(f"CUDA {cuda} does not satisfy {p.cuda_version}")
    for g in gpus:
        who = f"GPU {g.index} ({g.bus_id})"
        if p.gpu_model and p.gpu_model.lower() not in g.name.lower():
            problems.append(f"{who}: model {g.name!r} is not {p.gpu_model!r}")
        if p.memory_per_gpu_mib and (g.memory_mib or 0) < p.memory_per_gpu_mib:
            problems.append(f"{who}: {g.memory_mib} MiB < {p.memory_per_gpu_mib} MiB")
        if p.driver_version and (not g.driver or not version_matches(g.driver, p.driver_version)):
            problems.append(f"{who}: driver {g.driver} does not satisfy {p.driver_version}")
        if p.mig_mode and (g.mig or "").lower() != p.mig_mode:
            problems.append(f"{who}: MIG {g.mig}, expected {p.mig_mode}")
        if p.nvlink_links_per_gpu is not None and g.nvlink_up != p.nvlink_links_per_gpu:
            problems.append(f"{who}: {g.nvlink_up} NVLink links up, expected {p.nvlink_links_per_gpu}")
        if p.pcie_gen and (g.pcie_gen or 0) < p.pcie_gen:
            problems.append(f"{who}: PCIe gen {g.pcie_gen} < {p.pcie_gen}")
        if p.pcie_width and (g.pcie_width or 0) < p.pcie_width:
            problems.append(f"{who}: PCIe x{g.pcie_width} < x{p.pcie_width}")
        if p.ecc_enabled is not None and ((g.ecc or "").lower() == "enabled") != p.ecc_enabled:
            problems.append(f"{who}: ECC {g.ecc}, expected {'enabled' if p.ecc_enabled else 'disabled'}")
    evidence = {"gpus": [asdict(g) for g in gpus], "cuda_version": cuda}
    if problems:
        return GateResult("spec", FAIL, "; ".join(problems)[:900], evidence)
    return GateResult("spec", PASS, f"{len(gpus)} GPUs match the profile", evidence)


def run_command_gate(
    gate: str,
    command: str,
    timeout_s: float,
    max_latency_s: float | None = None,
    expect_output: str | None = None,
    sample: Callable[[], None] | None = None,
) -> GateResult:
    """A configured external command (dcgmi diag, gpu-burn, a serving check), judged by exit code, an
    optional latency bound and an optional output regex. `sample` is called every second while it runs."""
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return GateResult(gate, FAIL, f"cannot run {command!r}: {e.strerror}")
    while True:
        try:
            stdout, _ = p.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 > timeout_s:
                p.kill()
                p.communicate()
                return GateResult(gate, FAIL, f"{command!r} timed out after {timeout_s:g}s")
            if sample is not None:
                sample()
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, "")
    took = time.monotonic() - t0
    out = (r.stdout + r.stderr)[-2000:]
    ev = {"command": command, "exit_code": r.returncode, "seconds": round(took, 3), "output_tail": out[-400:]}
    if r.returncode != 0:
        return GateResult(gate, FAIL, f"{command!r} exited {r.returncode}", ev)
    if max_latency_s is not None and took > max_latency_s:
        return GateResult(gate, FAIL, f"took {took:.2f}s, more than {max_latency_s:g}s", ev)
    if expect_output and not re.search(expect_output, r.stdout):
        return GateResult(gate, FAIL, f"output does not match {expect_output!r}", ev)
    return GateResult(gate, PASS, f"{command!r} passed in {took:.2f}s", ev)


def load_cuda() -> Any:
    """The optional CUDA binding (cupy); None when it is not installed or no GPU is usable."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:
        return None


def cuda_kernel_check(cp: Any) -> GateResult:
    """Compiles (NVRTC) and runs a small kernel on every GPU and checks the result."""
    src = r"""extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
        int i = blockDim.x * blockIdx.x + threadIdx.x; if (i < n) y[i] = a * x[i] + b; }"""
    n, per_gpu = 1 << 20, {}
    for dev in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(dev):
            k = cp.RawKernel(src, "axpb")
            x = cp.arange(n, dtype=cp.float32)
            y = cp.empty_like(x)
            k(((n + 255) // 256,), (256,), (x, y, cp.float32(2.0), cp.float32(1.0), cp.int32(n)))
            ok = bool(cp.allclose(y, 2.0 * x + 1.0))
            per_gpu[dev] = ok
    bad = [d for d, ok in per_gpu.items() if not ok]
    if bad:
        return GateResult("cuda", FAIL, f"wrong kernel result on GPUs {bad}", {"per_gpu": per_gpu})
    return GateResult("cuda", PASS, f"kernel compiled and correct on {len(per_gpu)} GPUs", {"per_gpu": per_gpu})


def cuda_burnin(cp: Any, seconds: float, sample: Callable[[], None] | None = None) -> GateResult:
    """Sustained FP32 matmul on every GPU; checks each result against a reference, reports TFLOP/s."""
    size, per_gpu = 8192, {}
    for dev in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(dev):
            a = cp.random.rand(size, size, dtype=cp.float32)
            b = cp.random.rand(size, size, dtype=cp.float32)
            ref = a @ b
            cp.cuda.Device(dev).synchronize()
            t0, n, wrong = time.monotonic(), 0, 0
            while time.monotonic() - t0 < seconds / max(1, cp.cuda.runtime.getDeviceCount()):
                c = a @ b
                n += 1
                if n % 10 == 0 and not bool(cp.allclose(c, ref, rtol=1e-3)):
                    wrong += 1
                if n % 20 == 0 and sample is not None:
                    sample()
            cp.cuda.Device(dev).synchronize()
            took = time.monotonic() - t0
            per_gpu[dev] = {"tflops": round(2 * size**3 * n / took / 1e12, 1), "iterations": n, "wrong": wrong}
    bad = [d for d, v in per_gpu.items() if v["wrong"]]
    if bad:
        return GateResult("burnin", FAIL, f"wrong matmul results on GPUs {bad}", {"per_gpu": per_gpu})
    return GateResult("burnin", PASS, f"{len(per_gpu)} GPUs sustained load", {"per_gpu": per_gpu})


def cuda_p2p(cp: Any, min_gbps: float | None) -> GateResult:
    """Peer-to-peer copy bandwidth between every GPU pair."""
    n = cp.cuda.runtime.getDeviceCount()
    nbytes, pairs, low = 256 << 20, {}, []
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            if not cp.cuda.runtime.deviceCanAccessPeer(dst, src):
                low.append(f"{src}->{dst}: no peer access")
                continue
            with cp.cuda.Device(src):
                a = cp.empty(nbytes, dtype=cp.uint8)
            with cp.cuda.Device(dst):
                b = cp.empty(nbytes, dtype=cp.uint8)
                cp.cuda.runtime.memcpyPeer(b.data.ptr, dst, a.data.ptr, src, nbytes)
                cp.cuda.Device(dst).synchronize()
                t0 = time.monotonic()
                for _ in range(5):
                    cp.cuda.runtime.memcpyPeer(b.data.ptr, dst, a.data.ptr, src, nbytes)
                cp.cuda.Device(dst).synchronize()
                gbps = 5 * nbytes / (time.monotonic() - t0) / 1e9
            pairs[f"{src}->{dst}"] = round(gbps, 1)
            if min_gbps is not None and gbps < min_gbps:
                low.append(f"{src}->{dst}: {gbps:.1f} GB/s < {min_gbps:g}")
    if low:
        return GateResult("nvlink", FAIL, "; ".join(low)[:900], {"gbps": pairs})
    return GateResult(
        "nvlink", PASS, f"{len(pairs)} pairs, min {min(pairs.values(), default=0):.1f} GB/s", {"gbps": pairs}
    )


# -- burn-in watch: Xids, ECC, retired pages / remapped rows, throttling ------------------------------------

# NVML clock-event (throttle) reasons. The power cap and software thermal slowdown are the configured
# limits a GPU under full load is expected to hit; idle/application/sync-boost/display are benign.
THROTTLE_REASONS = {
    0x1: "GpuIdle",
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}
ALLOWED_THROTTLE = frozenset(
    {"GpuIdle", "ApplicationsClocksSetting", "SwPowerCap", "SyncBoost", "SwThermalSlowdown", "DisplayClockSetting"}
)


class BurnInWatch:
    """Watches a burn-in: any Xid in the kernel log during it, an uncorrected ECC error increment, a new
    retired page or remapped row, or clocks throttled for reasons other than the power and thermal limits.
    NVML is required (`nvml` is the pynvml module, or a stand-in); without it the burn-in cannot be judged."""

    def __init__(
        self, nvml: Any, kmsg_path: str | None, allowed: frozenset[str] = ALLOWED_THROTTLE, trust_user: bool = False
    ) -> None:
        self.nv, self.allowed = nvml, allowed
        self.kmsg = KmsgSource(kmsg_path, trust_user) if kmsg_path else None
        self.before: dict[int, tuple[int, int, int]] = {}
        self.throttled: dict[int, set[str]] = {}
        self.handles: list[Any] = []

    def _counters(self, h: Any) -> tuple[int, int, int]:
        nv = self.nv
        unc = int(nv.nvmlDeviceGetTotalEccErrors(h, 1, 0))  # uncorrected, volatile
        retired = sum(len(nv.nvmlDeviceGetRetiredPages(h, cause)) for cause in (0, 1))
        try:
            corr_rows, unc_rows, _pending, _failure = nv.nvmlDeviceGetRemappedRows(h)
            remapped = int(corr_rows) + int(unc_rows)
        except nv.NVMLError:
            remapped = 0  # not supported (pre-Ampere, MIG)
        return unc, retired, remapped

    def start(self) -> None:
        nv = self.nv
        nv.nvmlInit()
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self.before = {i: self._counters(h) for i, h in enumerate(self.handles)}
        if self.kmsg is not None:
            self.kmsg.open()
            for _skipped in self.kmsg.drain():
                pass  # what was logged before the burn-in does not count

    def sample(self) -> None:
        for i, h in enumerate(self.handles):
            mask = int(self.nv.nvmlDeviceGetCurrentClocksEventReasons(h))
            bad = {name for bit, name in THROTTLE_REASONS.items() if mask & bit and name not in self.allowed}
            if bad:
                self.throttled.setdefault(i, set()).update(bad)

    def finish(self) -> list[str]:
        problems = []
        for i, h in enumerate(self.handles):
            (u0, r0, m0), (u1, r1, m1) = self.before[i], self._counters(h)
            if u1 > u0:
                problems.append(f"GPU {i}: {u1 - u0} uncorrected ECC errors during burn-in")
            if r1 > r0:
                problems.append(f"GPU {i}: {r1 - r0} new retired pages")
            if m1 > m0:
                problems.append(f"GPU {i}: {m1 - m0} new remapped rows")
        for i, reasons in sorted(self.throttled.items()):
            problems.append(f"GPU {i}: clocks throttled by {', '.join(sorted(reasons))}")
        if self.kmsg is not None:
            parser = KernelLogParser(XidClassifier(unknown_fatal=True))
            for recs in self.kmsg.drain():
                for r in recs:
                    for ev in parser.feed(r.text, r.seq, r.usec):
                        problems.append(f"Xid {ev.xid} on {ev.raw_address} during burn-in: {ev.text[:120]}")
            self.kmsg.close()
        return problems


def watched(gate: str, run: Callable[[Callable[[], None]], GateResult], watch: BurnInWatch | None) -> GateResult:
    """Runs a burn-in under the watch; `run` gets a callback to sample throttling while it works."""
    if watch is None:
        return GateResult(gate, FAIL, "cannot watch the burn-in (ECC, retired pages, throttling): NVML unavailable")
    try:
        watch.start()
    except Exception as e:
        return GateResult(gate, FAIL, f"cannot watch the burn-in: NVML: {e}")
    res = run(watch.sample)
    problems = watch.finish()
    res.evidence["watch"] = problems
    if problems and res.status == PASS:
        res.status, res.reason = FAIL, "; ".join(problems)[:900]
    return res


def load_nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


# -- orchestration ---------------------------------------------------------------------------------------

GateFn = Callable[[], GateResult]


def run_gates(gates: dict[str, GateFn], timeouts: dict[str, float]) -> list[GateResult]:
    """Runs each gate under its own timeout; a gate that raises or overruns fails with the reason."""
    results = []
    for name in GATES:
        fn = gates.get(name)
        if fn is None:
            continue
        limit = timeouts.get(name, DEFAULT_TIMEOUTS[name])
        t0 = time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gate-{name}")
        fut = pool.submit(fn)
        try:
            res = fut.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            res = GateResult(name, FAIL, f"gate timed out after {limit:g}s")
        except Exception as e:
            res = GateResult(name, FAIL, f"gate error: {type(e).__name__}: {e}")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        res.gate, res.duration_s, res.timeout_s = name, round(time.monotonic() - t0, 3), limit
        results.append(res)
    return results


DEFAULT_TIMEOUTS = {"spec": 60.0, "burnin": 900.0, "nvlink": 300.0, "cuda": 120.0, "serving": 900.0}


def build_gates(
    profile: Profile,
    nvidia_smi: str,
    cuda: Any = None,
    nvml: Any = None,
    kmsg: str | None = "/dev/kmsg",
    kmsg_trust_user: bool = False,
) -> dict[str, GateFn]:
    def spec() -> GateResult:
        gpus, ver, source = read_spec(nvidia_smi, nvml)
        res = check_spec(profile, gpus, ver)
        res.evidence["source"] = source
        return res

    def burnin() -> GateResult:
        if not profile.burnin_command and cuda is None:
            return GateResult("burnin", SKIP, "no CUDA binding (pip install gpu-ready[cuda]) and no burnInCommand")
        watch = BurnInWatch(nvml, kmsg, trust_user=kmsg_trust_user) if nvml is not None else None
        if profile.burnin_command:
            cmd, limit = profile.burnin_command, profile.timeouts.get("burnin", DEFAULT_TIMEOUTS["burnin"])
            return watched("burnin", lambda s: run_command_gate("burnin", cmd, limit, sample=s), watch)
        return watched("burnin", lambda s: cuda_burnin(cuda, profile.burnin_seconds, s), watch)

    def nvlink() -> GateResult:
        if cuda is None:
            return GateResult(
                "nvlink",
                SKIP,
                "no CUDA binding for the P2P bandwidth test (NVLink link counts are checked by the spec gate)",
            )
        return cuda_p2p(cuda, profile.p2p_min_gbps)

    def cuda_gate() -> GateResult:
        if cuda is None:
            return GateResult("cuda", SKIP, "no CUDA binding (pip install gpu-ready[cuda])")
        return cuda_kernel_check(cuda)

    def serving() -> GateResult:
        cmd = profile.serving.get("command")
        if not cmd:
            return GateResult("serving", SKIP, "no serving command configured")
        return run_command_gate(
            "serving",
            cmd,
            profile.timeouts.get("serving", DEFAULT_TIMEOUTS["serving"]),
            profile.serving.get("maxLatencySeconds"),
            profile.serving.get("expectOutput"),
        )

    return {"spec": spec, "burnin": burnin, "nvlink": nvlink, "cuda": cuda_gate, "serving": serving}


def passed(results: list[GateResult], allow_skip: list[str]) -> tuple[bool, list[GateResult]]:
    """All gates pass; a skipped gate counts as passed only where the profile allows it."""
    blocking = [r for r in results if r.status == FAIL or (r.status == SKIP and r.gate not in allow_skip)]
    return not blocking, blocking


# -- onboarding on the Node ---------------------------------------------------------------------------------


def short_report(results: list[GateResult]) -> str:
    return json.dumps(
        {r.gate: {"status": r.status, "reason": r.reason[:160], "s": r.duration_s} for r in results},
        separators=(",", ":"),
    )[:4000]


def record_on_node(
    api: KubeApi,
    node: str,
    results: list[GateResult],
    ok: bool,
    blocking: list[GateResult],
    label_key: str = "preflight",
    needs_label: str | None = None,
    cordoned_by_us: bool = False,
) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta: dict[str, Any] = {
        "labels": {label_key: "passed" if ok else "failed"},
        "annotations": {TIME_ANNOTATION: now, REPORT_ANNOTATION: short_report(results)},
    }
    patch: dict[str, Any] = {"metadata": meta}
    if needs_label and ok:
        meta["labels"][needs_label] = None
    if ok and cordoned_by_us:
        patch["spec"] = {"unschedulable": False}
        meta["annotations"][CORDONED_BY] = None
    if not ok:
        patch["spec"] = {"unschedulable": True}  # keep it cordoned, or cordon it
    out = api.patch_node(node, patch)
    if not ok:
        ev = EventReporter(api, node, interval_s=0, node_uid=out["metadata"].get("uid"))
        first = blocking[0]
        evidence = json.dumps(first.evidence, default=str)[:400] if first.evidence else ""
        ev.record(
            "PreflightFailed",
            f"preflight gate {first.gate} {first.status}: {first.reason} {evidence}".strip(),
            action="Preflight",
        )
        ev.flush()
    return out


def cordon_for_preflight(api: KubeApi, node: str) -> bool:
    """Cordons the node unless it already is; returns whether preflight did it."""
    obj = api.get_node(node)
    if (obj.get("spec") or {}).get("unschedulable"):
        return (obj["metadata"].get("annotations") or {}).get(CORDONED_BY) == "true"
    api.patch_node(node, {"spec": {"unschedulable": True}, "metadata": {"annotations": {CORDONED_BY: "true"}}})
    return True


def onboard(
    api: KubeApi,
    node: str,
    gates: dict[str, GateFn],
    profile: Profile,
    label_key: str = "preflight",
    needs_label: str | None = None,
) -> tuple[bool, list[GateResult]]:
    by_us = cordon_for_preflight(api, node)
    results = run_gates(gates, profile.timeouts)
    ok, blocking = passed(results, profile.allow_skip)
    record_on_node(api, node, results, ok, blocking, label_key, needs_label, by_us)
    return ok, results


def render(results: list[GateResult], ok: bool) -> str:
    lines = [f"{'GATE':<8} {'STATUS':<8} {'TIME':>8}  REASON"]
    for r in results:
        lines.append(f"{r.gate:<8} {r.status:<8} {r.duration_s:>7.2f}s  {r.reason}")
    lines.append(f"preflight {'PASSED' if ok else 'FAILED'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="profile YAML (docs/preflight.md)")
    p.add_argument("--node", help="record the outcome on this Node (label, annotations, cordon, Event)")
    p.add_argument("--nvidia-smi", default="nvidia-smi")
    p.add_argument("--kmsg", default="/dev/kmsg", help="kernel log watched for Xids during burn-in")
    p.add_argument("--label-key", default="preflight")
    p.add_argument(
        "--needs-label",
        default="gpu-ready.io/needs-preflight",
        help="label removed from the Node when preflight passes",
    )
    p.add_argument("--gates", default=",".join(GATES), help="comma list of gates to run")
    p.add_argument("--kubeconfig")
    p.add_argument("--json", action="store_true", help="print one JSON report")


def main(args: argparse.Namespace) -> int:
    try:
        profile = Profile.load(args.profile)
    except ProfileError as e:
        print(f"gpu-ready preflight: {e}", file=sys.stderr)
        return 2
    wanted = [g.strip() for g in args.gates.split(",") if g.strip()]
    bad = [g for g in wanted if g not in GATES]
    if bad:
        print(f"gpu-ready preflight: unknown gates {bad}; gates are {', '.join(GATES)}", file=sys.stderr)
        return 2
    gates = {
        k: v
        for k, v in build_gates(profile, args.nvidia_smi, load_cuda(), load_nvml(), args.kmsg).items()
        if k in wanted
    }
    if args.node:
        try:
            api = KubeApi.from_environment(args.kubeconfig)
            ok, results = onboard(api, args.node, gates, profile, args.label_key, args.needs_label)
        except ApiError as e:
            print(f"gpu-ready preflight: cannot update Node {args.node}: {e}", file=sys.stderr)
            return 2
    else:
        results = run_gates(gates, profile.timeouts)
        ok, _ = passed(results, profile.allow_skip)
    if args.json:
        print(json.dumps({"passed": ok, "gates": [asdict(r) for r in results]}, indent=2, default=str))
    else:
        print(render(results, ok))
    return 0 if ok else 1
