"""Shared pieces of the benchmarks: a real control plane, a watch on a Node, percentiles, the table."""

from __future__ import annotations

import json
import os
import platform
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from testkit.controlplane import ControlPlane

if TYPE_CHECKING:
    from testkit.harness import AgentProc

OUT = Path(__file__).resolve().parent / "out"


def machine() -> str:
    mem = psutil.virtual_memory().total / 2**30
    cpu = platform.processor() or platform.machine()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model or cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 1),
        "p90_ms": round(percentile(ms, 90), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "max_ms": round(max(ms), 1),
    }


class NodeWatch:
    """A real watch (GET /api/v1/nodes?watch=1) on one Node; calls `on_event(node, t)` for every event."""

    def __init__(self, cp: ControlPlane, node: str, on_event: Callable[[dict[str, Any], float], None]) -> None:
        self.cp, self.node, self.on_event = cp, node, on_event
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="node-watch")
        self.ready = threading.Event()

    def start(self) -> NodeWatch:
        self.thread.start()
        self.ready.wait(10)
        return self

    def _run(self) -> None:
        ctx = ssl.create_default_context(cafile=self.cp.ca_file)
        while not self._stop.is_set():
            url = (
                f"{self.cp.host}/api/v1/nodes?watch=1&allowWatchBookmarks=false"
                f"&fieldSelector=metadata.name%3D{self.node}&timeoutSeconds=600"
            )
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.cp.admin_token}"})
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=700) as r:
                    self.ready.set()
                    for line in r:
                        t = time.monotonic()
                        if self._stop.is_set():
                            return
                        ev = json.loads(line)
                        self.on_event(ev["object"], t)
            except OSError:
                time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()


def condition(node: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU time of a whole process (every thread, those that exited included; not its children) from the
    kernel's CPU-time clock of that process (clock_getcpuclockid's clock: ((~pid) << 3) | CPUCLOCK_SCHED),
    nanosecond precision. /proc/PID/stat, psutil's source, counts in 10 ms ticks: over a 600 s window one tick
    is 0.017 millicores, a tenth of what is compared. None where the clock cannot be read."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError):
        return None


class ProcSampler:
    """Samples a process's RSS and CPU time every `interval` seconds. `samples` hold the process's own CPU
    (process_cpu_seconds; psutil's 10 ms ticks where that clock cannot be read); `children` the CPU of its
    children that it has waited for (for the agent: every nvidia-smi run, here the simulated nvidia-smi, a
    Python script, and whatever it left behind), sampled at the same times."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []  # (t, rss bytes, cpu seconds)
        self.children: list[float] = []  # children's cpu seconds at each sample
        self._last_children = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ProcSampler:
        self.thread.start()
        return self

    def sample(self) -> tuple[float, float, float]:
        ct = self.proc.cpu_times()
        self._last_children = ct.children_user + ct.children_system
        own = process_cpu_seconds(self.proc.pid)
        return time.monotonic(), float(self.proc.memory_info().rss), ct.user + ct.system if own is None else own

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.sample()
            except psutil.Error:
                return
            self.samples.append(s)
            self.children.append(self._last_children)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def millicores(cpu_s: float, seconds: float) -> float:
    return round(cpu_s / max(seconds, 1e-9) * 1000, 3)


def window(sampler: ProcSampler, t_from: float, t_to: float | None = None) -> dict[str, float]:
    """A sampler's figures between two monotonic times: median RSS (MiB), own and children's CPU
    (millicores) over the samples inside the window."""
    idx = [i for i, s in enumerate(sampler.samples) if s[0] >= t_from and (t_to is None or s[0] <= t_to)]
    if len(idx) < 2:
        raise RuntimeError(f"fewer than 2 samples in the window ({len(sampler.samples)} in all)")
    a, b = sampler.samples[idx[0]], sampler.samples[idx[-1]]
    secs = b[0] - a[0]
    kids = sampler.children[idx[-1]] - sampler.children[idx[0]] if len(sampler.children) > idx[-1] else 0.0
    return {
        "seconds": round(secs, 1),
        "rss_median_mib": round(percentile([sampler.samples[i][1] for i in idx], 50) / 2**20, 1),
        "cpu_millicores": millicores(b[2] - a[2], secs),
        "children_cpu_millicores": millicores(kids, secs),
    }


SPAWNED_COST = r"""
import os, resource, sys, threading, time
import agent.kube.client, agent.runner  # the agent's size
from agent.probes.nvidia_smi import NvidiaSmiRunner
runs, true = int(sys.argv[1]), "/bin/true"
def cost(fn):
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
    for _ in range(runs):
        fn()
    r1, t1 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / runs, (t1 - t0) / runs
def plain():
    os.waitpid(os.posix_spawn(true, [true], os.environ), 0)
runner = NvidiaSmiRunner(true)
def supervised():
    assert runner.run().exit_code == 0
for _ in range(5):
    plain(), supervised()
(kids_plain, own_plain), (kids_run, own_run) = cost(plain), cost(supervised)
print(max(0.0, kids_run - kids_plain) * 1000, max(0.0, own_run - own_plain) * 1000)
"""


def spawned_cpu_ms(runs: int = 100) -> dict[str, float]:
    """What one nvidia-smi run costs besides nvidia-smi itself, measured in a fresh process the agent's size
    (it imports what `gpu-ready run` imports): `runs` runs of agent/probes/nvidia_smi.py's runner around
    /bin/true against as many plain spawns of /bin/true. `spawned_ms`: the CPU of every other process a run
    starts (when a supervisor ran nvidia-smi: a `python -I -S` process per poll, 17-20 ms; now none, so about
    0: measured, not assumed); `agent_ms`: the extra CPU of the agent process itself (already inside its own CPU
    figure)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", SPAWNED_COST, str(runs)],
        capture_output=True,
        text=True,
        check=True,
        cwd=OUT.parent.parent,
        timeout=300,
    ).stdout.split()
    return {"spawned_ms": round(float(out[0]), 3), "agent_ms": round(float(out[1]), 3)}


def runtime_python() -> str:
    """runtime_python_unlocked under a lock: benchmarks started together (make bench runs some at once) build or
    refresh the environment one at a time."""
    import fcntl

    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / ".runtime-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return runtime_python_unlocked()


def runtime_python_unlocked() -> str:
    """A Python that sees only what the image installs: a virtual environment (made once, no network) whose
    site-packages links to the dev environment's copies of gpu-ready's runtime dependencies and nothing
    else. The dev environment also holds the linters and test tools, and one of them (rich, pulled in by
    import-linter) is imported by structlog when present: +84 modules, +4.8 MiB the image does not have."""
    import importlib.metadata as md
    import shutil
    import subprocess
    import sys
    import sysconfig

    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    todo = ["gpu-ready"]
    while todo:
        d = md.distribution(todo.pop())
        key = str(d.metadata["Name"]).lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = d
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    site = Path(sysconfig.get_paths()["purelib"])
    names: set[str] = set()
    for d in seen.values():
        for f in d.files or []:
            top = f.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                names.add(top)
    root = OUT / "runtime-venv"
    stamp = ",".join(sorted(names)) + sys.version
    py = root / "bin" / "python"
    if not ((root / "stamp").exists() and (root / "stamp").read_text() == stamp):
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        dest = Path(
            subprocess.check_output(
                [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
            ).strip()
        )
        for name in sorted(names | {"__pycache__"}):  # __pycache__: the single-file modules' bytecode
            if name != "agent" and (site / name).exists():
                (dest / name).symlink_to(site / name)
        (root / "stamp").write_text(stamp)
    # gpu-ready itself as the image has it: a copy of the package (not the editable source tree), its bytecode
    # compiled as docker/install.sh compiles it
    dest = next(root.glob("lib/python*/site-packages"))
    src = OUT.parent.parent / "agent"
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(src.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes())
    copied = dest / "agent" / ".source-digest"
    if copied.exists() and copied.read_text() == digest.hexdigest():
        return str(py)  # the same sources: a running agent of another benchmark keeps its files
    shutil.rmtree(dest / "agent", ignore_errors=True)
    shutil.copytree(src, dest / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(
        [str(py), "-m", "compileall", "-q", "-o", "0", "-o", "2", str(dest / "agent")],
        env={**env, "PYTHONNODEBUGRANGES": "1"},
        check=True,
        stdout=subprocess.DEVNULL,
    )
    copied.write_text(digest.hexdigest())
    return str(py)


AGENT_DEFAULTS = {  # `gpu-ready run` at its default intervals (the harness's are fast, for tests)
    "--poll-interval": "30",
    "--heartbeat-interval": "300",
    "--nvidia-smi-timeout": "30",
    "--event-interval": "300",
    "--plugin-grace": "300",
    "--api-timeout": "10",
}


def launch(
    cp: ControlPlane,
    workdir: Path,
    name_prefix: str,
    extra: dict[str, str] | None = None,
    kmsg: str | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> AgentProc:
    """testkit.harness.launch_agent with the agent run by `python` (default: runtime_python(), what the
    image installs). Returns the started AgentProc."""
    import secrets

    from testkit.cluster import AGENT_RULES, create_node, service_account_client
    from testkit.harness import AgentProc
    from testkit.simhost import SimHost

    admin = cp.admin()
    try:
        host = SimHost(workdir / "host", gpus=8)
        node = f"{name_prefix}-{secrets.token_hex(3)}"
        create_node(admin, node, {"nvidia.com/gpu.present": "true"}, host.plugin_resources())
        _, info = service_account_client(admin, AGENT_RULES, pod_on_node=node)
    finally:
        admin.close()
    agent = AgentProc(cp, host, node, info["token"], extra=extra, workdir=workdir, kmsg=kmsg, env=env)
    agent.args[0] = python or runtime_python()
    return agent.start()


def table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("benchmark", "measured", "target", "result")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *[line(r) for r in rows]])


def save(name: str, data: dict[str, Any]) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=2))
