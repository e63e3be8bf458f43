"""Per-GPU fencing on DRA nodes: one `DeviceTaintRule` (resource.k8s.io, KEP-5055) per device of a GPU with a fault
gpu-ready attributes to that GPU, so the scheduler keeps the node's other GPUs serving (docs/fencing.md).

- Which GPUs: a fatal Xid (or fallen off the bus), an nvidia-smi ERR! field or an NVML health fault on that GPU,
  as the published Verdict lists them per GPU (after hysteresis). Node-level faults (nvidia-smi cannot run, SXid,
  counts, the device plugin) fence nothing: they stay on the node condition.
- Which devices: the GPU's `type=gpu` device and every MIG device whose `parentUUID` is that GPU (the NVIDIA
  driver itself does not propagate a parent's fault: dra-driver-nvidia-gpu#1316). A rule's selector holds only
  driver, pool and device, hence one rule per device.
- The rule: name `gpu-ready.<node>.<n>`, n the lowest number from 0 to maxRules - 1 that none of the node's rules
  has (rules are cluster-scoped and no quota counts them: the chart's admission policy allows only these names, so
  a node can own at most maxRules rules); a node name over LONG_NODE characters is replaced by the Node's UID,
  `gpu-ready-uid.<uid>.<n>` (the policy cannot hash a name, but it sees the UID in the token), so the names of two
  nodes never collide. Labels `app.kubernetes.io/managed-by=gpu-ready` and `gpu-ready.io/node=<node>`, annotation
  `gpu-ready.io/gpu=<PCI bus id>`, taint `gpu-ready.io/unhealthy=<reason>` with effect None (dry run: the eviction
  controller only reports what NoExecute would do), NoSchedule, or NoExecute (opt-in). A rule is matched to its
  device by its selector (driver, pool, device), not by its name.
- Clearing: rules are found by label (and their pool) on every reconcile (not remembered), so a rule goes when its
  GPU is healthy
  again (recovery after hysteresis, `clear-before`, a new boot), also after an agent restart. A GPU whose health
  could not be checked (Unknown) keeps its rules; so does every rule while the slices cannot be read.

This module is the pure half: `fence_view`, the rule names, `plan_fencing` and what a reconcile did; the requests
are act/fencing/reporter.py's (`FenceReporter`, and `FenceWorker`, its thread)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from agent.model import Check, PciAddress, Reason, Status, Verdict
from agent.names import RULE_MANAGED_LABEL, RULE_MANAGED_VALUE
from agent.probes.dra import DEFAULT_DRIVER, DraGpu, DraInventory, match_gpus
from agent.settings import (
    DAY,
    RUN_ONLY,
    WITH_NODE,
    choice_exact,
    in_range,
    positive,
    setting,
    to_bool,
    to_float,
    to_int,
)

TAINT_KEY = "gpu-ready.io/unhealthy"
MANAGED_BY_LABEL = RULE_MANAGED_LABEL
MANAGED_BY = RULE_MANAGED_VALUE
NODE_LABEL = "gpu-ready.io/node"
GPU_ANNOTATION = "gpu-ready.io/gpu"
NAME_PREFIX = "gpu-ready."
UID_NAME_PREFIX = "gpu-ready-uid."  # never a prefix of a NAME_PREFIX name: the two forms cannot collide
GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta2")  # 1.37: v1; 1.36 with the DRADeviceTaintRules gate: v1beta2
FENCE_REASONS: tuple[Reason, ...] = (Reason.FATAL_XID, Reason.NVIDIA_SMI_ERR, Reason.NVML_HEALTH)
MAX_NAME = 253
MAX_LABEL_VALUE = 63
MAX_RULES_LISTED = 1000  # bounds the work on a malformed list
DEFAULT_MAX_RULES = 128  # per node: 8 GPUs with 7 MIG devices each need 64
MAX_SLOTS = 1024  # fencing_max_rules at most: rule numbers have at most 4 digits
# The longest node name for which gpu-ready.<node>.<n> fits 253 characters with n up to 1023 (the chart's
# fencing.yaml has the same number); a longer one is replaced by the Node's UID.
LONG_NODE = MAX_NAME - len(NAME_PREFIX) - len(f".{MAX_SLOTS - 1}")
_SLOT = re.compile(r"0|[1-9][0-9]{0,3}")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")

EventHook = Callable[[str, str, str, str, str], None]  # (reason, note, gpu, type, action): EventReporter.record


class FenceEffect(StrEnum):
    NONE = "None"  # dry run: the rule exists, the scheduler and the eviction controller ignore it
    NO_SCHEDULE = "NoSchedule"  # no new claims on the device; running pods stay
    NO_EXECUTE = "NoExecute"  # and pods using the device are evicted


@dataclass(frozen=True)
class FencingSection:
    """Settings of DRA fencing."""

    fencing: bool = setting(
        to_bool, False, "one DeviceTaintRule per device of a faulty GPU (DRA nodes; docs/fencing.md)", commands=RUN_ONLY
    )
    fencing_effect: str = setting(
        choice_exact("None", "NoSchedule", "NoExecute"),
        "None",
        "effect of the DeviceTaintRules: None (dry run), NoSchedule or NoExecute (evicts pods); spelled exactly",
        commands=WITH_NODE,
    )
    fencing_max_rules: int = setting(
        in_range(to_int, 1, 1024),
        DEFAULT_MAX_RULES,
        "DeviceTaintRules per node at most (1 to 1024)",
        commands=WITH_NODE,
    )
    fencing_resync: float = setting(
        positive(to_float, DAY),
        300.0,
        "re-list the DeviceTaintRules this often, seconds (while the verdict asks for the same rules)",
        commands=RUN_ONLY,
    )


DEFAULT_EFFECT = FenceEffect(FencingSection.fencing_effect)


@dataclass(frozen=True)
class FencingSettings:
    """What the plan and the reporter apply: FencingSection's values, typed (its defaults), and the DRA driver."""

    enabled: bool = FencingSection.fencing
    effect: FenceEffect = DEFAULT_EFFECT
    driver: str = DEFAULT_DRIVER
    max_rules: int = FencingSection.fencing_max_rules
    resync_s: float = FencingSection.fencing_resync  # re-list the rules at least this often when nothing changed

    @classmethod
    def of(cls, s: FencingSection, driver: str, enabled: bool = True) -> FencingSettings:
        """`enabled`: the reporter is built only where fencing runs (the agent with it on, `check`'s preview)."""
        return cls(enabled, FenceEffect(s.fencing_effect), driver, s.fencing_max_rules, s.fencing_resync)


# -- pure: what the verdict says about each GPU --------------------------------------------------------------


@dataclass(frozen=True)
class FenceView:
    """The verdict, per GPU, as fencing needs it."""

    faulty: Mapping[PciAddress, Reason] = field(default_factory=dict)  # GPU-attributed faults (first by priority)
    healthy: frozenset[PciAddress] = frozenset()  # checked and clean this cycle
    hold_all: bool = False  # the verdict is Unknown: nothing is cleared
    hold_reasons: frozenset[str] = frozenset()  # rules with these taint values are kept (see fence_view)
    unjudged: Mapping[PciAddress, frozenset[str]] = field(default_factory=dict)  # per GPU: taint values whose
    # source could not check it this cycle (an NVML rule while NVML cannot run): those rules are kept


# The source whose check can show a fenced fault gone. A latched FatalXid goes by a clear, a new boot or the
# recovery of the hold, not by a kernel-log read, so it has none.
REASON_SOURCE: Mapping[Reason, Check] = {Reason.NVIDIA_SMI_ERR: Check.NVIDIA_SMI, Reason.NVML_HEALTH: Check.NVML}


def fence_view(verdict: Verdict) -> FenceView:
    """faulty: GPUs whose row lists a FatalXid, NvidiaSmiErr or NvmlHealth reason; healthy: rows checked clean.
    A FatalXid that the verdict holds for the node without naming a GPU (a condition kept across a restart whose
    latch file was lost) keeps existing FatalXid rules: the rule is the only record of which GPU it was."""
    faulty: dict[PciAddress, Reason] = {}
    healthy = set()
    unjudged: dict[PciAddress, frozenset[str]] = {}
    named_fatal = False
    for row in verdict.gpus:
        addr = PciAddress.parse(row.pci_bus_id)
        if addr is None:
            continue
        named_fatal |= Reason.FATAL_XID in row.reasons
        fence = [r for r in FENCE_REASONS if r in row.reasons]
        if fence:
            faulty[addr] = fence[0]
        elif row.healthy is not None:  # checked this cycle (nvidia-smi ran) and no GPU-attributed fault
            healthy.add(addr)
        blind = frozenset(r.value for r, c in REASON_SOURCE.items() if c in row.unchecked)
        if blind:
            unjudged[addr] = blind
    hold = (
        frozenset({Reason.FATAL_XID.value}) if Reason.FATAL_XID in verdict.reasons and not named_fatal else frozenset()
    )
    return FenceView(faulty, frozenset(healthy), verdict.status is Status.UNKNOWN, hold, unjudged)


# -- pure: names and bodies ------------------------------------------------------------------------------------


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def rule_prefix(node: str, node_uid: str | None = None) -> str | None:
    """What every rule name of the node starts with: `gpu-ready.<node>.`, or `gpu-ready-uid.<uid>.` for a node name
    over LONG_NODE characters (None while its UID is unknown)."""
    if len(node) <= LONG_NODE:
        return f"{NAME_PREFIX}{node}."
    return f"{UID_NAME_PREFIX}{node_uid}." if node_uid else None


def slot_of(name: str, prefix: str | None, max_rules: int) -> int | None:
    """The rule number of `name` when it is one of the node's names (`<prefix><n>`, n below max_rules), else None."""
    if not prefix or not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    return int(rest) if _SLOT.fullmatch(rest) and int(rest) < max_rules else None


def node_label(node: str) -> str:
    """The gpu-ready.io/node label value: the node name when it is a valid label value, else a hash."""
    if len(node) <= MAX_LABEL_VALUE and _LABEL_VALUE.fullmatch(node):
        return node
    return f"sha256-{_digest(node, 40)}"


@dataclass(frozen=True)
class DesiredRule:
    name: str  # "" until plan_fencing gives it one of the node's names
    node: str
    driver: str
    pool: str
    device: str
    gpu: PciAddress
    reason: Reason
    effect: FenceEffect

    def spec(self, time_added: str | None = None) -> dict[str, Any]:
        taint: dict[str, Any] = {"key": TAINT_KEY, "value": self.reason.value, "effect": self.effect.value}
        if time_added:
            taint["timeAdded"] = time_added
        selector = {"driver": self.driver, "pool": self.pool, "device": self.device}
        return {"deviceSelector": selector, "taint": taint}

    def body(self, api_version: str, resource_version: str | None = None, time_added: str | None = None) -> dict:
        meta: dict[str, Any] = {
            "name": self.name,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: node_label(self.node)},
            "annotations": {GPU_ANNOTATION: self.gpu.nvml},
        }
        if resource_version:
            meta["resourceVersion"] = resource_version
        return {
            "apiVersion": f"{GROUP}/{api_version}",
            "kind": "DeviceTaintRule",
            "metadata": meta,
            "spec": self.spec(time_added),
        }


@dataclass(frozen=True)
class ExistingRule:
    """A DeviceTaintRule as listed (only the fields fencing compares)."""

    name: str
    uid: str
    resource_version: str
    driver: str
    pool: str
    device: str
    key: str
    value: str
    effect: str
    time_added: str | None
    gpu: PciAddress | None  # from the gpu-ready.io/gpu annotation

    def selects(self, d: DesiredRule) -> bool:
        return (self.driver, self.pool, self.device) == (d.driver, d.pool, d.device)

    def same_as(self, d: DesiredRule) -> bool:
        return (self.driver, self.pool, self.device, self.key, self.value, self.effect) == (
            d.driver,
            d.pool,
            d.device,
            TAINT_KEY,
            d.reason.value,
            d.effect.value,
        )


def _s(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def parse_rules(items: Any) -> list[ExistingRule]:
    """DeviceTaintRules from a list's `items`; entries without a name are skipped. Never raises."""
    out = []
    for r in (items if isinstance(items, list) else [])[:MAX_RULES_LISTED]:
        if not isinstance(r, dict):
            continue
        meta, spec = _obj(r.get("metadata")), _obj(r.get("spec"))
        sel, taint, ann = _obj(spec.get("deviceSelector")), _obj(spec.get("taint")), _obj(meta.get("annotations"))
        name = _s(meta.get("name"))
        if not name:
            continue
        out.append(
            ExistingRule(
                name,
                _s(meta.get("uid")),
                _s(meta.get("resourceVersion")),
                _s(sel.get("driver")),
                _s(sel.get("pool")),
                _s(sel.get("device")),
                _s(taint.get("key")),
                _s(taint.get("value")),
                _s(taint.get("effect")),
                _s(taint.get("timeAdded")) or None,
                PciAddress.parse(_s(ann.get(GPU_ANNOTATION))) if ann.get(GPU_ANNOTATION) else None,
            )
        )
    return out


# -- pure: the plan ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FencePlan:
    create: tuple[DesiredRule, ...] = ()
    update: tuple[tuple[ExistingRule, DesiredRule], ...] = ()
    delete: tuple[ExistingRule, ...] = ()
    keep: tuple[ExistingRule, ...] = ()  # as wanted, or held (health unknown)
    notes: tuple[str, ...] = ()  # faulty GPUs that cannot be fenced, and why
    waiting: int = 0  # rules wanted that got no name (every number taken): planned again after the deletes

    def __bool__(self) -> bool:
        return bool(self.create or self.update or self.delete)

    @property
    def writes(self) -> int:
        return len(self.create) + len(self.update) + len(self.delete)


def desired_rules(
    view: FenceView, inventory: DraInventory | None, node: str, settings: FencingSettings
) -> tuple[list[DesiredRule], list[str], set[PciAddress]]:
    """The rules the faulty GPUs need, notes on those that cannot be fenced, and the faulty GPUs whose devices
    are unknown (no inventory, or not in the slices): their existing rules are kept."""
    if inventory is None or inventory.malformed is not None or inventory.incomplete:
        why = "the ResourceSlices could not be read" if inventory is None else "the ResourceSlices are not usable"
        notes = [f"GPU {a.nvml}: {why}; existing rules kept" for a in sorted(view.faulty)]
        return [], notes, set(view.faulty)
    match = match_gpus(inventory.gpus, view.faulty)
    out: list[DesiredRule] = []
    notes = []
    unknown: set[PciAddress] = set()
    for addr in sorted(view.faulty):
        g: DraGpu | None = match.matched.get(addr)
        if g is None:
            notes.append(f"GPU {addr.nvml} is in no {inventory.driver} ResourceSlice: node-level only")
            unknown.add(addr)
            continue
        for d in g.devices:
            out.append(DesiredRule("", node, d.driver, d.pool, d.name, addr, view.faulty[addr], settings.effect))
    if len(out) > settings.max_rules:
        notes.append(f"{len(out)} devices to fence, more than maxRules {settings.max_rules}: the rest not fenced")
        out = out[: settings.max_rules]
    return out, notes, unknown


def plan_fencing(
    view: FenceView,
    inventory: DraInventory | None,
    existing: Iterable[ExistingRule],
    node: str,
    settings: FencingSettings,
    verdict_status: Status,
    node_uid: str | None = None,
) -> FencePlan:
    """Desired vs existing (found by label). Pure. A wanted rule keeps the name of the node's rule that selects its
    device, else gets the lowest free number. A rule not wanted any more is deleted when its GPU is healthy or its
    devices changed, and kept while its GPU's health is unknown."""
    want, notes, unknown = desired_rules(view, inventory, node, settings)
    prefix = rule_prefix(node, node_uid)
    if prefix is None and want:
        notes.append(f"the node name is over {LONG_NODE} characters and its UID is unknown: nothing fenced")
    named = [r for r in existing if slot_of(r.name, prefix, settings.max_rules) is not None]
    taken = {slot_of(r.name, prefix, settings.max_rules) for r in named}
    free = (n for n in range(settings.max_rules) if n not in taken)
    assigned: list[DesiredRule] = []
    waiting = 0
    for w in want if prefix is not None else []:
        have = next((r for r in named if r.selects(w) and r.name not in {a.name for a in assigned}), None)
        n = None if have is not None else next(free, None)
        if have is None and n is None:
            waiting += 1
            continue
        assigned.append(replace(w, name=have.name if have is not None else f"{prefix}{n}"))
    if waiting:
        notes.append(f"{waiting} devices wait for a free rule name (maxRules {settings.max_rules})")
    want = assigned
    by_name = {d.name: d for d in want}
    update: list[tuple[ExistingRule, DesiredRule]] = []
    delete: list[ExistingRule] = []
    keep: list[ExistingRule] = []
    seen = set()
    for r in sorted(existing, key=lambda r: r.name):
        seen.add(r.name)
        d = by_name.get(r.name)
        if d is not None:
            if r.same_as(d):
                keep.append(r)
            else:
                update.append((r, d))
            continue
        if (
            view.hold_all
            or r.value in view.hold_reasons
            or (r.gpu is not None and (r.gpu in unknown or r.value in view.unjudged.get(r.gpu, ())))
        ):
            held = True
        elif r.gpu is not None and (r.gpu in view.faulty or r.gpu in view.healthy):
            held = False  # healthy again, or its devices changed (a new MIG layout)
        else:  # no row for its GPU (or no annotation): only a healthy node clears it
            held = verdict_status is not Status.TRUE
        (keep if held else delete).append(r)
    create = [d for d in want if d.name not in seen]
    return FencePlan(tuple(create), tuple(update), tuple(delete), tuple(keep), tuple(notes), waiting)


# -- what a reconcile did ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FencedDevice:
    rule: str
    device: str
    gpu: str  # PCI bus id ("" when the rule has no gpu-ready.io/gpu annotation)
    reason: str
    effect: str

    def to_json(self) -> dict[str, str]:
        return {"rule": self.rule, "device": self.device, "gpu": self.gpu, "reason": self.reason, "effect": self.effect}


@dataclass
class FenceResult:
    plan: FencePlan = field(default_factory=FencePlan)
    writes: int = 0  # POST/PUT/DELETE requests made
    reads: int = 0  # LIST/GET requests made (discovery included)
    fenced: tuple[FencedDevice, ...] = ()  # the node's rules after this reconcile
    errors: list[str] = field(default_factory=list)
    unsupported: str | None = None  # the cluster serves no DeviceTaintRule API: why
    skipped: bool = False  # nothing changed since the last reconcile: no request made
    changed: dict[str, int] = field(default_factory=dict)  # rules "created", "updated", "deleted" (succeeded)

    def summary(self) -> str:
        """For the condition message: `fenced gpu-3, gpu-3-mig-1g10gb-19-0 (NoSchedule)`; "" when none."""
        if not self.fenced:
            return ""
        effects = sorted({f.effect for f in self.fenced})
        names = ", ".join(f.device for f in self.fenced[:8]) + (
            f" (+{len(self.fenced) - 8} more)" if len(self.fenced) > 8 else ""
        )
        return f"fenced {names} ({'/'.join(effects)})"

    def to_json(self) -> dict[str, Any]:
        return {
            "fenced": [f.to_json() for f in self.fenced],
            "notes": list(self.plan.notes),
            "errors": list(self.errors),
            "unsupported": self.unsupported,
            "writes": self.writes,
            "plan": {
                "create": [d.device for d in self.plan.create],
                "update": [d.device for _, d in self.plan.update],
                "delete": [r.device for r in self.plan.delete],
            },
        }
