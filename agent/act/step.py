"""The action contract: what every publish/act step is and what it is handed (the ordered list is act/steps.py).

A step is built once from the `Wiring` (the settings, the API, the clock, the channels every step shares: the
Event writer, the condition reporter, the fleet brake), started and closed with the agent, and run once per
published verdict with one `Snapshot`. It returns the snapshot the next step gets: the same, or with a note for
the condition message (`note`) or a fresher copy of the Node (`node`). It declares its settings (the settings section
of its module, or None) and the chart's ValidatingAdmissionPolicies its writes rely on (`policies`, the name after the
release's prefix: `<release>-own-node-only` is "own-node-only"), so that a step is one class and one row of STEPS.

A step's own waits are one moment (`deadline`), which the publisher folds into its `next_deadline`."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from agent.act.brake import Brake
from agent.allocation import AllocationMap
from agent.clock import Clock
from agent.config import Config
from agent.kube.client import KubeApi
from agent.model import GpuIdentity, PciAddress, Verdict, XidEvent
from agent.probes.dra import DraInventory
from agent.report.condition import ConditionReporter
from agent.report.events import EventPublisher
from agent.report.metrics import Metrics


@dataclass(frozen=True)
class Snapshot:
    """One published verdict and what the steps act on, read once for all of them."""

    verdict: Verdict
    latched: int = 0  # latched faults (the state file's count)
    latched_fatal: bool = False  # a GPU fault is latched (the needs-preflight label, the taint's NoExecute)
    gate_open: bool = True  # the start-up gate (RecoveryGate) lets the taint go
    gpus: Mapping[PciAddress, GpuIdentity] = field(default_factory=dict)  # the newest observation's GPUs
    fresh: Sequence[XidEvent] = ()  # kernel-log faults latched since the last publish
    inventory: DraInventory | None = None  # the node's DRA devices (None: not read)
    allocation: AllocationMap | None = None  # the pods on each GPU (None: not read)
    node: tuple[dict[str, Any], float] | None = None  # the freshest own Node and when it was read (monotonic)
    brake_engaged: bool = False  # the fleet brake holds this node's disruptive actions (read once per publish)
    note: str = ""  # a step's note for the condition message: the publisher appends it before the next step


@dataclass(frozen=True)
class Wiring:
    """What a step is built from: the agent's settings and clients, and the channels all steps share."""

    cfg: Config
    api: KubeApi
    metrics: Metrics
    clock: Clock
    log: Any
    rng: random.Random
    wake: Callable[[], None]  # wakes the agent's loop (a step whose own thread changed what the message says)
    events: EventPublisher  # the one Event writer (its own thread); `record` queues an Event
    condition: ConditionReporter  # the node condition (the condition step writes it; others read what it shows)
    brake: Brake  # the fleet brake's watch


class ActionStep(Protocol):
    """One publish/act step. Class attributes: `name` (logs), `settings` (its settings section, a frozen
    dataclass of `setting` fields; None for a step without settings of its own), `policies` (the
    chart's admission policies its writes rely on; () for a step that writes nothing to the cluster)."""

    name: ClassVar[str]
    settings: ClassVar[type | None]
    policies: ClassVar[tuple[str, ...]]

    def __init__(self, w: Wiring) -> None: ...

    def start(self) -> None: ...

    def close(self) -> None: ...

    def deadline(self, now: float) -> float | None:
        """The soonest moment a write this step holds back may go (a backoff ends); None: none."""
        ...

    def run(self, snap: Snapshot) -> Snapshot:
        """Acts on one published verdict; returns the snapshot the next step gets."""
        ...


@dataclass(frozen=True)
class StepSpec:
    """One row of STEPS: the step's class and whether it runs under these settings."""

    kind: type[ActionStep]
    enabled: Callable[[Config], bool] = lambda cfg: True


class Quiet:
    """The defaults of a step with no thread of its own and no held write."""

    def start(self) -> None:
        return None

    def close(self) -> None:
        return None

    def deadline(self, now: float) -> float | None:
        return None
