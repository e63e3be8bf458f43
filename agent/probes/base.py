"""The probe contract: one `Probe` per signal, one `ProbeResult` shape, one ordered registry (registry.py).

A probe reads one source and says what it saw; it never decides readiness, publishes or acts. `read(context)`
returns a `ProbeResult`, whatever happened: a source that could not be read is a result with `ran=False` and an
UNCHECKED finding saying why (the verdict turns that into Unknown, never True). A probe keeps whatever it needs
between cycles itself (a scanner's cache, a tracker's window); what it shares with the probes after it in the
same cycle goes in its result's `payload`, which the context hands on by check.

A probe module declares its own settings section beside it (a frozen dataclass of agent/settings.py `setting`
fields) and its registry row (registry.py) names it: flags, environment names, file keys, the chart schema's
check and docs/configuration.md follow. A probe is built from its own section, never from the whole Config."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from agent.model import Check, GpuIdentity, PciAddress, ProbeResult

T = TypeVar("T")


@dataclass
class ProbeContext:
    """What one cycle hands its probes: the own Node (or why it could not be read), the cycle's time on the
    suite's clock, and the results of the probes before this one, by check (the registry's order)."""

    node: Mapping[str, Any] | None = None
    node_error: str | None = None
    now: float = 0.0
    one_shot: bool = False  # `check` / `gpus`: no start-up grace, nothing carried to a next cycle
    results: dict[Check, ProbeResult] = field(default_factory=dict)

    def ran(self, check: Check) -> ProbeResult | None:
        """The result of `check` this cycle when it could read its source; None otherwise."""
        r = self.results.get(check)
        return r if r is not None and r.ran else None

    def payload(self, check: Check, kind: type[T]) -> T | None:
        """The payload of `check`'s result this cycle when it is a `kind`."""
        r = self.results.get(check)
        return r.payload if r is not None and isinstance(r.payload, kind) else None

    def gpu_readings(self, check: Check) -> Sequence[Any] | None:
        """The per-GPU readings in `check`'s payload this cycle (NVML's snapshot's `gpus`), None without one. The
        probes after NVML read its samples through this, not its module's types: NVML's module imports theirs."""
        r = self.results.get(check)
        gpus = getattr(r.payload, "gpus", None) if r is not None else None
        return gpus if isinstance(gpus, list | tuple) else None

    @property
    def node_asked(self) -> bool:
        """The Node is part of this run: read, or tried (`check` without --node reads no Node)."""
        return self.node is not None or self.node_error is not None

    def gpus(self) -> dict[PciAddress, GpuIdentity]:
        """Every GPU the sources that ran listed so far (merged_gpus)."""
        return merged_gpus(self.results.values())


def merged_gpus(results: Iterable[ProbeResult]) -> dict[PciAddress, GpuIdentity]:
    """Every GPU the sources that ran listed, in their order, the first source's identity winning (nvidia-smi's
    index and name)."""
    out: dict[PciAddress, GpuIdentity] = {}
    for r in results:
        if r.ran:
            for g in r.gpus:
                out.setdefault(g.address, g)
    return out


class Probe(Protocol):
    """One signal. `check` names it in findings, metrics and `check --json`."""

    check: Check

    def read(self, context: ProbeContext) -> ProbeResult: ...
