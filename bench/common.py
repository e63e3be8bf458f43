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
from typing import Any

import psutil

from testkit.controlplane import ControlPlane

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


class ProcSampler:
    """Samples a process's RSS and CPU time (psutil) every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []  # (t, rss bytes, cpu seconds)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ProcSampler:
        self.thread.start()
        return self

    def sample(self) -> tuple[float, float, float]:
        ct = self.proc.cpu_times()
        return time.monotonic(), float(self.proc.memory_info().rss), ct.user + ct.system

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.sample())
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("benchmark", "measured", "target", "result")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *[line(r) for r in rows]])


def save(name: str, data: dict[str, Any]) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=2))
