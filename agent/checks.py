"""The check suite: every probe of the registry (agent/probes/registry.py), in order, once per cycle, into one
Observation.

This module combines results and never looks inside findings: counts by name, GPUs from the sources that ran,
the sources' inventories for the verdict. Adding a signal is a probe module and one registry row, not a line
here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from agent.allocation import AllocationMap
from agent.config import Config
from agent.kernel_log.rate import XidRateThresholds, XidRateTracker
from agent.kube.client import KubeApi
from agent.model import Check, Counts, Observation, ProbeResult
from agent.probes.base import Probe, ProbeContext, merged_gpus
from agent.probes.dra import DraInventory
from agent.probes.nvidia_smi import NvidiaSmiRunner, NvidiaSmiSettings
from agent.probes.nvml import NvmlProbe
from agent.probes.registry import build_probes, nvml_reads
from agent.probes.shared import Shared

COUNT_NAMES = frozenset(f.name for f in fields(Counts))


@dataclass
class CycleStats:
    durations: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # checks that could not run this cycle
    timed_out: set[str] = field(default_factory=set)  # checks whose source timed out this cycle


def combine(results: Iterable[ProbeResult], expected_gpus: int | None) -> Observation:
    """One Observation from a cycle's results, in registry order (the first source's GPU identity wins)."""
    results = list(results)
    obs = Observation(expected_gpus=expected_gpus, gpus=merged_gpus(results))
    for r in results:
        obs.findings += r.findings
        for k, v in r.counts.items():
            if k in COUNT_NAMES:
                setattr(obs.counts, k, v)
        if r.ran and r.inventory:
            obs.seen[r.check] = r.addresses
    return obs


class CheckSuite:
    """The registry's probes for one node, kept across cycles (each keeps its own caches and windows)."""

    def __init__(
        self,
        cfg: Config,
        nvml: NvmlProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
        api: KubeApi | None = None,
        *,
        kernel_log: Callable[[], str | None] = lambda: None,
        latch_store: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.cfg, self.clock = cfg, clock
        smi = cfg[NvidiaSmiSettings]
        self.shared = Shared(
            clock=clock,
            smi=NvidiaSmiRunner(smi.nvidia_smi, smi.nvidia_smi_timeout),
            xid_rate=XidRateTracker(cfg[XidRateThresholds]),
            api=api,
            started=clock(),
            kernel_log=kernel_log,
            latch_store=latch_store,
            node_name=cfg.node_name,
            fencing=cfg.fencing,
        )
        given = {Check.NVML: nvml_reads(cfg, nvml)} if nvml is not None else None
        self.probes: Sequence[Probe] = build_probes(cfg, self.shared, given)
        self.results: dict[Check, ProbeResult] = {}  # the newest cycle's, by check

    def probe(self, check: Check) -> Any:
        """The probe of `check` (None when these settings turn it off)."""
        return next((p for p in self.probes if p.check is check), None)

    @property
    def smi(self) -> NvidiaSmiRunner:
        return self.shared.smi

    @property
    def xid_rate(self) -> XidRateTracker:
        return self.shared.xid_rate

    @property
    def slice_cache(self) -> Any:
        return self.shared.slice_cache

    @slice_cache.setter
    def slice_cache(self, cache: Any) -> None:
        self.shared.slice_cache = cache

    @property
    def inventory(self) -> DraInventory | None:
        """The newest cycle's parsed ResourceSlices (for fencing); None when not read."""
        r = self.results.get(Check.DEVICE_PLUGIN)
        return r.payload if r is not None and isinstance(r.payload, DraInventory) else None

    @property
    def allocation(self) -> AllocationMap | None:
        """The newest cycle's allocation map (pod-resources); None when off or unreadable."""
        r = self.results.get(Check.POD_RESOURCES)
        return r.payload if r is not None and isinstance(r.payload, AllocationMap) else None

    def run(
        self, node: dict[str, Any] | None, node_error: str | None = None, *, one_shot: bool = False
    ) -> tuple[Observation, CycleStats]:
        """node: the own Node (None when it could not be read: `node_error` says why)."""
        stats = CycleStats()
        ctx = ProbeContext(node, node_error, self.clock(), one_shot)
        for probe in self.probes:
            t0 = time.monotonic()
            r = probe.read(ctx)
            stats.durations[str(r.check)] = time.monotonic() - t0
            ctx.results[r.check] = r
            if not r.ran:
                stats.failed.add(str(r.check))
            if r.timed_out:
                stats.timed_out.add(str(r.check))
        self.results = ctx.results
        return combine(ctx.results.values(), self.cfg.expected_gpus), stats


class ChecksThread:
    """Runs the check suite off the loop thread, one run at a time. Every probe is bounded by its own deadline, and a
    cycle may still take as long as the slowest of them (nvidia-smi's timeout, NVML's, a wedged sysfs read's): the
    loop meanwhile keeps publishing, so a fault the kernel log latched reaches the Node while the cycle runs."""

    def __init__(self, run: Callable[..., Any], finished: Callable[[], None]) -> None:
        self._run, self._finished = run, finished
        self._go = threading.Event()
        self._lock = threading.Lock()
        self._request: tuple[Any, ...] = ()
        self._result: tuple[Any, BaseException | None] | None = None
        self._stopping = False
        self.busy = False  # a run was submitted and its result not taken yet (the loop thread's view)
        self.thread: threading.Thread | None = None

    def submit(self, *args: Any) -> None:
        self.busy = True
        self._request = args
        if self.thread is None:
            self.thread = threading.Thread(target=self._main, name="agent-checks", daemon=True)
            self.thread.start()
        self._go.set()

    def take(self) -> tuple[Any, BaseException | None] | None:
        """The finished run's (result, error), once; None while it runs or when none was submitted. `busy` stays
        set until the caller has handled it (`done()`)."""
        with self._lock:
            got, self._result = self._result, None
        return got

    def done(self) -> None:
        self.busy = False

    def _main(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stopping:
                return
            try:
                got: tuple[Any, BaseException | None] = (self._run(*self._request), None)
            except Exception as e:  # handed to the loop, which logs it as it logs its own
                got = (None, e)
            with self._lock:
                self._result = got
            self._finished()  # wakes the loop

    def stop(self) -> None:
        self._stopping = True
        self._go.set()
