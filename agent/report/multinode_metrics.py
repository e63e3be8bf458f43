"""The multi-node probes' readings as metrics (docs/metrics.md, docs/fabric.md): per InfiniBand/RoCE port, per GPU's
NVLink fabric, the fabric manager. A collector serving the newest cycle's readings: a port or GPU that leaves loses
its series at once; a probe that is off or could not read its source has none. Label values are bounded: device
names and ports from sysfs (at most 64 devices of 8 ports, names cut to 32 characters), bus ids, fabric states."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.model import Check
from agent.probes.fabric import FabricReport
from agent.probes.fabric_manager import FabricManagerReport
from agent.probes.infiniband import COUNTERS, RailReport

NAME_MAX = 32


class MultinodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._results: Mapping[Any, Any] = {}
        if registry is not None:
            registry.register(self)

    def publish(self, results: Mapping[Check, Any]) -> None:
        """The cycle's results by check (CheckSuite.results); replaced whole, read whole by collect()."""
        self._results = {c: results.get(c) for c in (Check.INFINIBAND, Check.FABRIC, Check.FABRIC_MANAGER)}

    def describe(self) -> list[Metric]:
        return []

    def _payload(self, check: Check, kind: type) -> Any:
        r = self._results.get(check)
        return r.payload if r is not None and r.ran and isinstance(r.payload, kind) else None

    def collect(self) -> Iterator[Metric]:
        rails = self._payload(Check.INFINIBAND, RailReport)
        if rails is not None and rails.ports:
            labels = ["device", "port"]
            up = GaugeMetricFamily("gpu_ready_ib_port_up", "1 when the port is ACTIVE and LinkUp", labels=labels)
            rate = GaugeMetricFamily("gpu_ready_ib_port_rate_gbps", "The port's rate (Gb/s)", labels=labels)
            flaps = GaugeMetricFamily(
                "gpu_ready_ib_port_flaps", "Link downs of the port within ibFlapWindow", labels=labels
            )
            errors = CounterMetricFamily(
                "gpu_ready_ib_port_errors",
                "The port's error counters as the kernel counts them (since boot or the last reset)",
                labels=[*labels, "counter"],
            )
            for p in rails.ports:
                key = [p.device[:NAME_MAX], p.port[:8]]
                up.add_metric(key, 1 if p.up else 0)
                if p.rate_gbps is not None:
                    rate.add_metric(key, p.rate_gbps)
                flaps.add_metric(key, rails.flaps.get((p.device, p.port), 0))
                for name in COUNTERS:
                    if name in p.counters:
                        errors.add_metric([*key, name], p.counters[name])
            yield from (up, rate, flaps, errors)
        fabric = self._payload(Check.FABRIC, FabricReport)
        if fabric is not None and fabric.applicable:
            info = GaugeMetricFamily(
                "gpu_ready_fabric_info",
                "1 per GPU on an NVLink fabric: its state, status, clique and cluster (GPUs of one NVLink domain "
                "share the cluster UUID and clique ID)",
                labels=["pci_bus_id", "state", "status", "clique_id", "cluster_uuid"],
            )
            for g in fabric.gpus:
                if g.applicable:
                    clique = "" if g.clique_id is None else str(g.clique_id)
                    info.add_metric([g.gpu.nvml, g.state[:32], g.status[:32], clique, (g.cluster_uuid or "")[:36]], 1)
            yield info
        fm = self._payload(Check.FABRIC_MANAGER, FabricManagerReport)
        if fm is not None and fm.nvswitches and fm.judged:
            r = self._results.get(Check.FABRIC_MANAGER)
            ok = r is not None and not r.findings
            yield GaugeMetricFamily(
                "gpu_ready_fabric_manager_ready",
                "1 when the fabric manager has trained the fabric (NVSwitch systems where it can be judged)",
                1 if ok else 0,
            )
