"""GPUs served by a DRA driver: the node's ResourceSlices for the GPU driver (default `gpu.nvidia.com`), counted
and matched to the GPUs on PCI, and the rule by which the device-plugin check defers to them.

Facts from the NVIDIA DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu:cmd/gpu-kubelet-plugin/deviceinfo.go,
mig.go): one pool per node; a full GPU is device `gpu-<minor>` with
attributes `type=gpu`, `uuid` and `resource.kubernetes.io/pciBusID`; a MIG device is `gpu-<minor>-mig-...` with
`type=mig`, its own `uuid`, `parentUUID` (the GPU's uuid) and the parent's `pciBusID`. Bare attribute names are in
the driver's domain. Driver-owned taints (`gpu.nvidia.com/xid`, `gpu-lost`) sit in `devices[].taints`.

Why the device-plugin check must defer (KEP-5004, DRA extended resources, GA in 1.37): when a DRA driver serves
the GPUs, `node.status.capacity["nvidia.com/gpu"]` drops to zero, so "plugin capacity 0" no longer means "plugin
gone". `probe_gpu_serving` is the device-plugin check with that rule:

- the node has ResourceSlices of the GPU driver -> the DRA result replaces the plugin's (count `type=gpu`
  devices and GPUs behind MIG devices; a GPU on PCI missing from the slices is a GPUCountMismatch for that GPU;
  a device the driver tainted NoSchedule/NoExecute is the analogue of capacity - allocatable). Never
  DevicePluginUnhealthy for zero plugin capacity.
- the slices could not be read -> the plugin result when the plugin advertises GPUs; otherwise "could not check"
  (never a DevicePluginUnhealthy that may only mean "this is a DRA node").
- no slices of the driver for the node -> the plugin check exactly as before.

Pure parsing here (`parse_slices`, bounded: at most MAX_SLICES slices, MAX_DEVICES_PER_SLICE devices each, linear
in the input); the one read is `read_node_slices` (a LIST with field selectors spec.nodeName and spec.driver,
served from the apiserver's watch cache)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.kube.slices import DEFAULT_DRIVER, MAX_SLICES, SliceRead, read_node_slices
from agent.model import Check, Finding, PciAddress, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.probes.device_plugin import MigCounts, mig_counts, plugin_counts, probe_device_plugin
from agent.probes.shared import Shared
from agent.settings import WITH_NODE, dns_subdomain, setting, to_bool

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
TYPE_GPU, TYPE_MIG, TYPE_VFIO = "gpu", "mig", "vfio"
MAX_DEVICES_PER_SLICE = 128  # the API's own limit
MAX_TAINTS_PER_DEVICE = 16  # the API's own limit
MAX_STRING = 256
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


class MalformedSlice(ValueError):
    """A ResourceSlice list that does not have the shape of one."""


@dataclass(frozen=True)
class SliceTaint:
    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


@dataclass(frozen=True)
class DraDevice:
    """One device of a ResourceSlice, with the attributes gpu-ready reads."""

    driver: str
    pool: str
    name: str
    type: str  # gpu | mig | vfio | "" (no type attribute)
    uuid: str | None = None
    parent_uuid: str | None = None
    pci: PciAddress | None = None
    taints: tuple[SliceTaint, ...] = ()

    @property
    def blocking_taints(self) -> tuple[SliceTaint, ...]:
        return tuple(t for t in self.taints if t.effect in BLOCKING_EFFECTS)


@dataclass(frozen=True)
class DraGpu:
    """One physical GPU as the slices show it: its full-GPU device (absent when only MIG devices are published)
    and the MIG devices whose parentUUID is its uuid."""

    key: str  # uuid, else "pci:<bus id>", else "device:<name>"
    pool: str
    uuid: str | None
    pci: PciAddress | None
    device: DraDevice | None
    mig: tuple[DraDevice, ...] = ()

    @property
    def devices(self) -> tuple[DraDevice, ...]:
        """Every device that uses this GPU: the GPU first, then its MIG devices by name."""
        return ((self.device,) if self.device is not None else ()) + tuple(sorted(self.mig, key=lambda d: d.name))

    @property
    def label(self) -> str:
        return self.device.name if self.device is not None else (self.uuid or self.key)


@dataclass(frozen=True)
class DraInventory:
    driver: str
    devices: tuple[DraDevice, ...] = ()
    slices: int = 0  # slices read (at the newest generation of each pool)
    incomplete: tuple[str, ...] = ()  # pools with fewer slices than resourceSliceCount: why
    malformed: str | None = None
    truncated: bool = False  # more than MAX_SLICES slices: the rest were not read

    @property
    def gpus(self) -> tuple[DraGpu, ...]:
        return group_gpus(self.devices)

    @property
    def mig_devices(self) -> int:
        return sum(1 for d in self.devices if d.type == TYPE_MIG)


def node_inventory(slices: SliceRead | None, driver: str = DEFAULT_DRIVER) -> DraInventory | None:
    """The parsed slices of a read (None when DRA counting is off or the read failed)."""
    return parse_slices(slices.items, driver) if slices is not None and slices.ok else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= MAX_STRING else None


def _attr(attrs: dict[str, Any], name: str, driver: str) -> str | None:
    """A string attribute by its bare name (the driver's domain) or fully qualified `<driver>/<name>`."""
    v = attrs.get(name)
    if v is None:
        v = attrs.get(f"{driver}/{name}")
    return _str(v.get("string")) if isinstance(v, dict) else None


def _device(raw: Any, driver: str, pool: str) -> DraDevice:
    if not isinstance(raw, dict):
        raise MalformedSlice("a device that is not an object")
    name = _str(raw.get("name"))
    if name is None:
        raise MalformedSlice("a device without a name")
    attrs = raw.get("attributes", {})
    attrs = {} if attrs is None else attrs
    if not isinstance(attrs, dict):
        raise MalformedSlice(f"device {name}: attributes are not an object")
    pci_text = _attr(attrs, PCI_BUS_ID, driver)
    taints = []
    raw_taints = raw.get("taints", [])
    raw_taints = [] if raw_taints is None else raw_taints
    if not isinstance(raw_taints, list):
        raise MalformedSlice(f"device {name}: taints are not a list")
    for t in raw_taints[:MAX_TAINTS_PER_DEVICE]:
        if isinstance(t, dict) and _str(t.get("key")):
            taints.append(SliceTaint(str(t["key"]), _str(t.get("value")) or "", _str(t.get("effect")) or ""))
    return DraDevice(
        driver=driver,
        pool=pool,
        name=name,
        type=_attr(attrs, "type", driver) or "",
        uuid=_attr(attrs, "uuid", driver),
        parent_uuid=_attr(attrs, "parentUUID", driver),
        pci=PciAddress.parse(pci_text) if pci_text else None,
        taints=tuple(taints),
    )


def parse_slices(items: Any, driver: str = DEFAULT_DRIVER) -> DraInventory:
    """The devices of a ResourceSlice list's `items` for `driver`. Of each pool only the slices of its newest
    generation count (older ones are being replaced). Never raises: a malformed list sets `malformed`."""
    try:
        return _parse_slices(items, driver)
    except MalformedSlice as e:
        return DraInventory(driver, malformed=str(e))


def _parse_slices(items: Any, driver: str) -> DraInventory:
    if items is None:
        items = []
    if not isinstance(items, list):
        raise MalformedSlice("the ResourceSlice list's items are not a list")
    truncated = len(items) > MAX_SLICES
    per_pool: dict[str, list[tuple[int, int, list[Any]]]] = {}
    for s in items[:MAX_SLICES]:
        if not isinstance(s, dict) or not isinstance(s.get("spec"), dict):
            raise MalformedSlice("a ResourceSlice without a spec")
        spec = s["spec"]
        if spec.get("driver") != driver:
            continue  # the field selector already filters; a server that ignores it does not count others
        pool = spec.get("pool")
        if not isinstance(pool, dict) or _str(pool.get("name")) is None:
            raise MalformedSlice("a ResourceSlice without a pool name")
        gen, count = pool.get("generation", 0), pool.get("resourceSliceCount", 1)
        if not isinstance(gen, int) or not isinstance(count, int) or isinstance(gen, bool) or isinstance(count, bool):
            raise MalformedSlice(f"pool {pool['name']}: generation or resourceSliceCount is not a number")
        devices = spec.get("devices", [])
        devices = [] if devices is None else devices
        if not isinstance(devices, list):
            raise MalformedSlice(f"pool {pool['name']}: devices are not a list")
        per_pool.setdefault(str(pool["name"]), []).append((gen, count, devices[:MAX_DEVICES_PER_SLICE]))
    out: list[DraDevice] = []
    incomplete = []
    slices = 0
    for pool, entries in sorted(per_pool.items()):
        newest = max(g for g, _, _ in entries)
        current = [(c, d) for g, c, d in entries if g == newest]
        want = max(c for c, _ in current)
        if len(current) < want:
            incomplete.append(f"pool {pool}: {len(current)} of {want} ResourceSlices published")
        slices += len(current)
        for _, devices in current:
            out.extend(_device(d, driver, pool) for d in devices)
    return DraInventory(driver, tuple(out), slices, tuple(incomplete), None, truncated)


def group_gpus(devices: Iterable[DraDevice]) -> tuple[DraGpu, ...]:
    """Physical GPUs: a `type=gpu` (or vfio) device each, joined by the MIG devices whose parentUUID is its
    uuid; MIG devices whose parent is not published form a GPU of their own (keyed by parentUUID)."""
    gpus: dict[str, DraGpu] = {}
    migs: list[DraDevice] = []
    for d in devices:
        if d.type == TYPE_MIG:
            migs.append(d)
        elif d.type in (TYPE_GPU, TYPE_VFIO):
            key = d.uuid or (f"pci:{d.pci.nvml}" if d.pci else f"device:{d.name}")
            if key not in gpus:
                gpus[key] = DraGpu(key, d.pool, d.uuid, d.pci, d)
    by_parent: dict[str, list[DraDevice]] = {}
    for m in migs:
        key = m.parent_uuid or (f"pci:{m.pci.nvml}" if m.pci else f"device:{m.name}")
        by_parent.setdefault(key, []).append(m)
    for key, ms in by_parent.items():
        g = gpus.get(key)
        if g is not None:
            gpus[key] = DraGpu(g.key, g.pool, g.uuid, g.pci, g.device, tuple(ms))
        else:
            pci = next((m.pci for m in ms if m.pci is not None), None)
            gpus[key] = DraGpu(key, ms[0].pool, ms[0].parent_uuid, pci, None, tuple(ms))
    return tuple(sorted(gpus.values(), key=lambda g: (g.pci is None, g.pci or PciAddress(0, 0, 0), g.key)))


@dataclass(frozen=True)
class GpuMatch:
    """DRA GPUs matched to the GPUs on PCI (by pciBusID, else by uuid through `uuids`)."""

    matched: dict[PciAddress, DraGpu] = field(default_factory=dict)
    missing: tuple[PciAddress, ...] = ()  # on PCI, in no slice
    unplaced: tuple[DraGpu, ...] = ()  # in the slices, matching no GPU on PCI


def match_gpus(
    gpus: Iterable[DraGpu], pci: Iterable[PciAddress], uuids: Mapping[str, PciAddress] | None = None
) -> GpuMatch:
    on_pci = sorted(set(pci))
    wanted = set(on_pci)
    matched: dict[PciAddress, DraGpu] = {}
    unplaced = []
    for g in gpus:
        addr = g.pci if g.pci is not None else (uuids or {}).get(g.uuid or "")
        if addr is not None and addr in wanted and addr not in matched:
            matched[addr] = g
        else:
            unplaced.append(g)
    return GpuMatch(matched, tuple(a for a in on_pci if a not in matched), tuple(unplaced))


def probe_dra(
    inventory: DraInventory,
    pci: Iterable[PciAddress] | None,
    uuids: Mapping[str, PciAddress] | None = None,
) -> ProbeResult:
    """The device-plugin check on a DRA node: `count` is the physical GPUs the driver publishes. A GPU on PCI
    that no slice publishes is a GPUCountMismatch on that GPU; a driver taint NoSchedule/NoExecute is a
    DevicePluginUnhealthy on that GPU (what capacity - allocatable is for the plugin)."""
    check, drv = Check.DEVICE_PLUGIN, inventory.driver
    if inventory.malformed is not None:
        why = Finding.unchecked(check, f"cannot count the {drv} ResourceSlices: {inventory.malformed}", "dra_malformed")
        return ProbeResult(check, (why,), ran=False)
    if inventory.incomplete:
        why = Finding.unchecked(
            check, f"the {drv} ResourceSlices are being published: {'; '.join(inventory.incomplete)}", "dra_incomplete"
        )
        return ProbeResult(check, (why,), ran=False)
    gpus = inventory.gpus
    findings: list[Finding] = []
    if inventory.truncated:
        findings.append(Finding.info(check, f"more than {MAX_SLICES} {drv} ResourceSlices: the rest not read"))
    match = match_gpus(gpus, pci or (), uuids) if pci is not None else GpuMatch()
    for addr in match.missing:
        findings.append(
            Finding.fault(
                check, Reason.GPU_COUNT_MISMATCH, f"on PCI but in no {drv} ResourceSlice", addr, kind="dra_missing"
            )
        )
    if pci is not None:
        for g in match.unplaced:
            findings.append(
                Finding.info(check, f"{drv} publishes {g.label} but no GPU on PCI matches it", kind="dra_extra")
            )
    where = {id(g): a for a, g in match.matched.items()}
    tainted = 0
    for g in gpus:
        for d in g.devices:
            blocking = d.blocking_taints
            tainted += bool(blocking)
            if blocking:
                what = ", ".join(str(t) for t in blocking)
                findings.append(
                    Finding.fault(
                        check,
                        Reason.DEVICE_PLUGIN_UNHEALTHY,
                        f"the {drv} driver tainted {d.name}: {what}",
                        where.get(id(g), g.pci),
                        kind="dra_tainted",
                    )
                )
            elif d.taints:
                what = ", ".join(str(t) for t in d.taints)
                findings.append(Finding.info(check, f"{d.name} carries {what}", where.get(id(g), g.pci), "dra_taint"))
    counts: dict[str, int | None] = {
        "dra_gpus": len(gpus),
        "dra_mig_devices": inventory.mig_devices,
        "dra_tainted_devices": tainted,
    }
    return ProbeResult(check, tuple(findings), count=len(gpus), counts=counts)


def probe_gpu_serving(
    node: dict[str, Any] | None,
    node_error: str | None,
    slices: SliceRead | None,
    mig: MigCounts | None,
    strategy: str = "auto",
    replicas: int | None = None,
    grace_left_s: float = 0.0,
    pci: Iterable[PciAddress] | None = None,
    driver: str = DEFAULT_DRIVER,
    uuids: Mapping[str, PciAddress] | None = None,
    inventory: DraInventory | None = None,
) -> ProbeResult:
    """The device-plugin check with DRA: `slices` None = DRA counting off (the plugin check as before).
    `inventory`: `slices` already parsed (node_inventory), so a caller that keeps it parses the list once."""
    if slices is None:
        return probe_device_plugin(node, node_error, mig, strategy, replicas, grace_left_s)
    if slices.ok:
        inventory = inventory if inventory is not None else parse_slices(slices.items, driver)
        if inventory.slices or inventory.malformed is not None:
            result = probe_dra(inventory, pci, uuids)
            if node is not None:  # the plugin's numbers, for the record (0 is expected on a DRA node)
                pc = plugin_counts(node, mig, strategy, replicas)
                counts = {**result.counts, "plugin_capacity": pc.total_capacity}
                counts["plugin_allocatable"] = pc.total_allocatable
                return ProbeResult(result.check, result.findings, result.gpus, result.count, result.ran, counts=counts)
            return result
        return probe_device_plugin(node, node_error, mig, strategy, replicas, grace_left_s)
    plugin = probe_device_plugin(node, node_error, mig, strategy, replicas, grace_left_s)
    if plugin.ran and plugin.counts.get("plugin_capacity"):
        note = Finding.info(Check.DEVICE_PLUGIN, slices.error or "", kind="dra_unreadable")
        return ProbeResult(
            plugin.check, (*plugin.findings, note), plugin.gpus, plugin.count, plugin.ran, counts=plugin.counts
        )
    why = Finding.unchecked(
        Check.DEVICE_PLUGIN,
        f"the device plugin advertises no GPUs and whether a DRA driver serves them is unknown: {slices.error}",
        "dra_unreadable",
    )
    return ProbeResult(Check.DEVICE_PLUGIN, (why,), ran=False, counts=plugin.counts)


DRA_EMPTY_RELIST_S = 300.0  # a node without ResourceSlices lists them again after this long (a new DRA driver)


class GpuServingProbe:
    """What serves the GPUs to pods: the device plugin's resources on the Node, deferring to the node's DRA
    ResourceSlices where they exist. The slices come from the runner's watch (kube/slice_cache.py, no request)
    while it is kept; else a LIST from the apiserver's watch cache: every poll on a node that has slices, every
    DRA_EMPTY_RELIST_S on a node whose last LIST found none (most nodes: no DRA driver), so a plain device-plugin
    node costs the API 12 LISTs an hour, not 120. The payload is the parsed slices (DraInventory; None when not
    read), for fencing and the allocation map."""

    check = Check.DEVICE_PLUGIN

    def __init__(
        self,
        shared: Shared,
        *,
        node_name: str | None,
        dra_counting: bool,
        wants_slices: bool,
        driver: str,
        strategy: str,
        replicas: int | None,
        grace_s: float,
    ) -> None:
        self.shared, self.node_name = shared, node_name
        self.dra_counting, self.wants_slices, self.driver = dra_counting, wants_slices, driver
        self.strategy, self.replicas, self.grace_s = strategy, replicas, grace_s
        self._slices: SliceRead | None = None  # the last LIST, and when
        self._slices_at = 0.0

    def read(self, context: ProbeContext) -> ProbeResult:
        if not context.node_asked:
            return ProbeResult(Check.DEVICE_PLUGIN)
        node = dict(context.node) if context.node is not None else None
        nvml, smi = context.results.get(Check.NVML), context.results.get(Check.NVIDIA_SMI)
        mig = mig_counts(nvml.gpus if nvml else ()) or mig_counts(smi.gpus if smi else ())
        slices = self._slices_for(node, context.now)
        inventory = node_inventory(slices, self.driver)
        grace = 0.0 if context.one_shot else self.grace_s
        pci = context.ran(Check.PCI)
        r = probe_gpu_serving(
            node,
            context.node_error,
            slices if self.dra_counting else None,
            mig,
            self.strategy,
            self.replicas,
            grace - (context.now - self.shared.started),
            pci=pci.addresses if pci is not None else None,
            driver=self.driver,
            inventory=inventory,
        )
        dra = "dra_gpus" in r.counts  # the DRA driver's count: not "the device plugin serves N"
        counts = {**r.counts, "plugin_physical": None if dra else r.count, "dra": r.count if dra else None}
        return replace(r, counts=counts, payload=inventory)

    def _slices_for(self, node: dict[str, Any] | None, now: float) -> SliceRead | None:
        name = self.node_name or ((node or {}).get("metadata") or {}).get("name")
        api = self.shared.api
        if not self.wants_slices or api is None or node is None or not isinstance(name, str):
            return None
        cached = self.shared.slice_cache.items() if self.shared.slice_cache is not None else None
        if cached is not None:
            return cached  # the runner's watch: no request
        last = self._slices
        if last is not None and last.ok and not last.items and now - self._slices_at < DRA_EMPTY_RELIST_S:
            return last  # no DRA driver on this node a moment ago
        self._slices, self._slices_at = read_node_slices(api, name, self.driver), now
        return self._slices


@dataclass(frozen=True)
class DraSettings:
    """Settings of the DRA counting (and the driver fencing acts on)."""

    dra_counting: bool = setting(
        to_bool,
        True,
        "count GPUs from the node's DRA ResourceSlices where they exist (the device-plugin check defers to them; "
        "docs/fencing.md)",
        commands=WITH_NODE,
    )
    dra_driver: str = setting(
        dns_subdomain, DEFAULT_DRIVER, "DRA driver whose devices are counted and fenced", commands=WITH_NODE
    )
