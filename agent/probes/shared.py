"""What the suite shares among its probes, and with the kernel-log watcher: built once by the suite's owner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeApi
from agent.kube.slice_cache import SliceCache
from agent.probes.nvidia_smi import NvidiaSmiRunner


@dataclass
class Shared:
    """What several probes, or a probe and the kernel-log watcher, share: built once by the suite's owner."""

    clock: Callable[[], float]
    smi: NvidiaSmiRunner
    xid_rate: Any  # kernel_log.rate.XidRateTracker: the watcher feeds it, the Xid-rate probe reads it
    api: KubeApi | None = None  # the node's ResourceSlices (DRA counting, fencing); None: not read
    slice_cache: SliceCache | None = None  # the runner's watch of them; None: a LIST when needed
    started: float = 0.0  # the suite's start on `clock` (the device plugin's start-up grace)
    kernel_log: Callable[[], str | None] = lambda: None  # why the kernel log cannot be read now; None: it can
    latch_store: Callable[[], str | None] = lambda: None  # why a latch would not survive a restart; None: it would
    node_name: str | None = None  # the own Node (dcgm-exporter's hostname label, the ResourceSlices' node)
    fencing: bool = False  # fencing is on: the ResourceSlices are read even when DRA counting is off
