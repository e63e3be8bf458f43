"""InfiniBand and RoCE ports (the rails of multi-node jobs), from sysfs: `<sysfs>/class/infiniband/<device>/ports/
<n>/{state,phys_state,rate,link_layer}` and the port's error counters `<n>/counters/{link_downed,symbol_error,
port_rcv_errors,link_error_recovery}`. A rail that is down, trained below its rate, or flapping stalls or slows every
multi-node job on the node while all its GPUs are healthy.

Formats, from the kernel's Documentation/ABI/stable/sysfs-class-infiniband: `state` "4: ACTIVE" (1 DOWN, 2 INIT,
3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER), `phys_state` "5: LinkUp" (2 Polling, 3 Disabled, 7 LinkErrorRecovery, ...),
`rate` "400 Gb/sec (4X NDR)", `link_layer` "InfiniBand" or "Ethernet" (RoCE), each counter one decimal number.

Rails and front-end ports: a rail is an RDMA device that carries GPU traffic: one whose PCI function shares a PCIe
switch or root port with a GPU (below), one named in `railDevices` (names or globs), or, where the topology shows no
GPU beside any device (a virtual machine), the largest group of devices of one NIC model and link layer (a GPU
node has a rail per GPU or pair of GPUs, all of one model, and one or two front-end NICs). A virtual function (its
PCI function has a `physfn`) is a rail only when listed. Every other port is front-end (the node's own network, a
DPU, an unused port of a second NIC): read and shown, never judged. Every device is read (up to MAX_DEVICES; beyond
that the rest are counted and the node is "could not check", never True).

Judged GPUDegraded (the GPUs work; work over this rail does not, or slower), each naming the rail:
- a rail whose state is not ACTIVE or whose physical state is not LinkUp (`rail_down`); every rail of the node down
  (no usable rail left) is FabricNotReady (`rails_all_down`): no multi-node job can run;
- an active rail whose rate is below `ibMinRateGbps`, or, with that unset and `ibRatePeers` on, below the fastest
  active rail of the same NIC model (`hca_type`, else `board_id`) and link layer (`rail_slow`);
- fewer InfiniBand devices than `expectedNics` (unset: not judged) (`nic_missing`);
- a port that went down `ibFlapCount` times within `ibFlapWindow` seconds (`rail_flapping`): each increase of
  `link_downed` between two polls counts its increase, and a port seen ACTIVE at one poll and not at the next counts
  one when the counter did not move (a counter that reads lower than before was reset: a new baseline);
- with `requireGpuDirect`, no `nvidia_peermem` (or the older `nv_peer_mem`) module under `<sysfs>/module`
  (`gpudirect_missing`): NCCL then stages every transfer through host memory.
A node with no InfiniBand device has nothing to judge: no finding unless `expectedNics` asks for some. A port
whose state files exist but cannot be read or parsed is "could not check"; a counter that is absent (some RoCE
drivers) is not read, one that exists but does not read (a driver refusing it) is reported (info,
`counters_unreadable`): the port's state still judges the rail, and its flaps are then seen from state changes only.
A rail's counter that reads but is not a number is "could not check" (`counters_garbled`). A counter at the top of
its width (the kernel's PMA attributes: `link_downed` and `link_error_recovery` 8 bits, `symbol_error` and
`port_rcv_errors` 16 bits) has saturated: reported (info, `counter_saturated`, and in `check --json`); it no longer
moves, so that rail's flaps are seen from state changes only. Each file read is one bounded read under a deadline
(probes/sysfs.py): a read that does not answer (a wedged HCA) makes the probe "could not check", whichever file it
was; the ports, link layers and NIC model are read once per device (PortLayout). The error counters other than
`link_downed` are reported (metrics, `check --json`), not judged.

Each GPU's rail: the InfiniBand device whose PCI function shares the longest stretch of the GPU's sysfs path below
the root complex (the same PCIe switch or root port; nothing shared: no rail), resolved again only when the devices
or the GPUs change. `gpu-ready gpus` shows it."""

from __future__ import annotations

import fnmatch
import os
import re
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.probes.bounded import Blocked
from agent.probes.sysfs import READER, SysfsReader, read_bytes
from agent.settings import DAY, in_range, optional, positive, setting, to_bool, to_float, to_int, to_str

ACTIVE, LINK_UP = 4, 5
MAX_DEVICES = 1024  # InfiniBand devices read per cycle (an 8-rail node has 8 to 10; SR-IOV adds one per VF)
MAX_EXPECTED_NICS = 64  # the bound of expectedNics
MAX_RAIL_PATTERNS = 256
# Each counter's width in bits: the kernel's PortCounters PMA attributes (drivers/infiniband/core/sysfs.c): the value
# stops at its maximum (saturates) instead of wrapping.
COUNTER_BITS = {"link_downed": 8, "link_error_recovery": 8, "symbol_error": 16, "port_rcv_errors": 16}
MAX_PORTS = 8  # ports per device judged (a ConnectX has 1 or 2)
MAX_FLAPS = 256  # flap times kept per port (a bound on memory; the threshold is far below)
COUNTERS = ("link_downed", "symbol_error", "port_rcv_errors", "link_error_recovery")
_STATE = re.compile(r"^\s*(\d{1,2})\s*:\s*([A-Za-z_ ]{1,32})\s*$")
_RATE = re.compile(r"^\s*(\d{1,5}(?:\.\d{1,3})?)\s*Gb/sec")
_COUNTER = re.compile(r"^\s*(\d{1,20})\s*$")
_RAIL_PATTERN = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]{1,64}$")


@dataclass(frozen=True)
class Port:
    device: str
    port: str
    state: tuple[int, str]
    phys_state: tuple[int, str]
    rate_gbps: float | None  # None: the device gives no rate
    link_layer: str = ""  # "InfiniBand" / "Ethernet" (RoCE); "" when not given
    counters: Mapping[str, int] = field(default_factory=dict)  # the COUNTERS the port has
    counter_errors: tuple[str, ...] = ()  # counters there that did not read (why, one line each)
    nic: str = ""  # the NIC model: the device's hca_type (e.g. MT4129), else its board_id; "" when not given
    counter_garbled: tuple[str, ...] = ()  # counters that read but are not a number (why, one line each)

    @property
    def saturated(self) -> tuple[str, ...]:
        """The counters at the top of their width: they no longer move."""
        return tuple(n for n, v in self.counters.items() if n in COUNTER_BITS and v >= (1 << COUNTER_BITS[n]) - 1)

    @property
    def rail(self) -> str:
        return f"{self.device} port {self.port}"

    @property
    def up(self) -> bool:
        return self.state[0] == ACTIVE and self.phys_state[0] == LINK_UP


class Unreadable(Exception):
    pass


def _read(path: str) -> str | None:
    """The file's first line; None when it does not exist; Unreadable when it exists but cannot be read. A read that
    blocks (a wedged HCA) raises Blocked, which no caller here swallows: the whole signal is "could not check"."""
    try:
        return read_bytes(path).decode("ascii", "replace").partition("\n")[0]
    except FileNotFoundError:
        return None
    except Blocked:
        raise
    except OSError as e:
        raise Unreadable(f"{path}: {e.strerror}") from None


def _state(path: str) -> tuple[int, str]:
    text = _read(path)
    m = _STATE.match(text or "")
    if m is None:
        raise Unreadable(f"{path}: {'missing' if text is None else repr(text[:40])} is not '<n>: <NAME>'")
    return int(m[1]), m[2].strip()


def _counters(base: str) -> tuple[dict[str, int], tuple[str, ...], tuple[str, ...]]:
    """The counters that read; why the others there did not (a driver may refuse one, EINVAL on some RoCE devices:
    the port's state still judges the rail, so that is reported, not "could not check"); and those that read but are
    not a number (could not check, for a rail)."""
    out, errors, garbled = {}, [], []
    for name in COUNTERS:
        path = f"{base}/counters/{name}"
        try:
            text = _read(path)
        except Unreadable as e:
            errors.append(str(e))
            continue
        if text is None:
            continue
        m = _COUNTER.match(text)
        if m is None:
            garbled.append(f"{path}: {text[:40]!r} is not a number")
            continue
        out[name] = int(m[1])
    return out, tuple(errors), tuple(garbled)


class PortLayout:
    """What does not change while an InfiniBand device stays: its ports, each port's link layer and the device's NIC
    model (the port type changes only with a firmware reset, which re-creates the device). Kept per device with the
    inode of its entry under the class directory (a device removed and added again is another entry: read again);
    the state, the rate and the counters are read every poll."""

    def __init__(self) -> None:
        self.devices: dict[str, tuple[int, tuple[tuple[str, str], ...], str]] = {}
        self.total = 0  # devices under the class directory at the last read (beyond MAX_DEVICES: not read)


def _nic_model(root: str, dev: str) -> str:
    """The device's NIC model: its `hca_type` (e.g. MT4129), else its `board_id`; "" when neither reads."""
    for name in ("hca_type", "board_id"):
        try:
            text = (_read(f"{root}/{dev}/{name}") or "").strip()
        except Unreadable:
            continue
        if text:
            return text[:32]
    return ""


def _device_layout(root: str, dev: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """(port, link layer) of each port of `dev`, in port order, and its NIC model."""
    ports_dir = f"{root}/{dev}/ports"
    try:
        ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))[:MAX_PORTS]
    except OSError as e:
        raise Unreadable(f"{ports_dir}: {e.strerror}") from None
    layers = tuple((p, (_read(f"{ports_dir}/{p}/link_layer") or "").strip()[:16]) for p in ports)
    return layers, _nic_model(root, dev)


def read_ports(root: str, counters: bool = True, layout: PortLayout | None = None) -> list[Port]:
    """Every port of the InfiniBand devices under `root` (<sysfs>/class/infiniband), sorted: every device, up to
    MAX_DEVICES (`layout.total` says how many there were). Raises Unreadable when a port's state cannot be read,
    Blocked when a read does not answer; an absent `root` is no device. layout: the devices' ports, link layers and
    NIC models from earlier polls (kept and updated; None reads them all)."""
    try:
        with os.scandir(root) as it:
            entries = sorted((e.name, e.inode()) for e in it)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise Unreadable(f"{root}: {e.strerror}") from None
    known = layout.devices if layout is not None else {}
    fresh = {}
    out = []
    for dev, ino in entries[:MAX_DEVICES]:
        got = known.get(dev)
        if got is None or got[0] != ino:
            got = (ino, *_device_layout(root, dev))
        fresh[dev] = got
        for p, layer in got[1]:
            base = f"{root}/{dev}/ports/{p}"
            rate = _read(base + "/rate")
            m = _RATE.match(rate or "")
            values, errors, garbled = _counters(base) if counters else ({}, (), ())
            state, phys = _state(base + "/state"), _state(base + "/phys_state")
            rate_gbps = float(m[1]) if m else None
            out.append(Port(dev, p, state, phys, rate_gbps, layer, values, errors, got[2], garbled))
    if layout is not None:
        # only after every read answered: a call abandoned at its deadline changes nothing
        layout.devices, layout.total = fresh, len(entries)
    return out


def rail_devices(
    ports: Iterable[Port], affine: Iterable[str], patterns: Iterable[str] = (), vfs: Collection[str] = ()
) -> tuple[set[str], str]:
    """The devices that are rails, and how they were chosen: those with GPU affinity (the topology) and those named
    in `railDevices` (names or globs). With neither (a virtual machine, whose PCI topology shows no GPU beside any
    device): the largest group of devices of one NIC model and link layer, the InfiniBand one, then the faster one,
    on a tie: a GPU node has a rail per GPU or pair of GPUs, all of one model, and one or two front-end NICs.
    Virtual functions (`vfs`) are rails only when listed."""
    ports = list(ports)
    devices = {p.device for p in ports}
    listed = {d for d in devices if any(fnmatch.fnmatchcase(d, g) for g in patterns)}
    rails = (set(affine) & devices) | listed
    if rails:
        how = "topology and railDevices" if listed and rails - listed else "railDevices" if listed else "topology"
        return rails, how
    groups: dict[tuple[str, str], set[str]] = {}
    fastest: dict[tuple[str, str], float] = {}
    for p in ports:
        if p.device in vfs:
            continue
        key = (p.nic, p.link_layer)
        groups.setdefault(key, set()).add(p.device)
        fastest[key] = max(fastest.get(key, 0.0), p.rate_gbps or 0.0)
    if not groups:
        return set(), "no device"
    best = max(groups, key=lambda k: (len(groups[k]), k[1] == "InfiniBand", fastest[k], k))
    return groups[best], "the largest group of one NIC model and link layer (no GPU affinity found)"


def port_findings(
    ports: list[Port],
    expected_nics: int | None,
    min_rate_gbps: float | None,
    rate_peers: bool = False,
    rails: Collection[str] | None = None,
) -> list[Finding]:
    """The rails' findings. rails: the devices that are rails (`rail_devices`); None: every port is one. Front-end
    ports are not judged; they are counted in one info finding."""
    out = []
    judged = [p for p in ports if rails is None or p.device in rails]
    fastest: dict[tuple[str, str], float] = {}
    if min_rate_gbps is None and rate_peers:
        for p in judged:
            if p.up and p.rate_gbps is not None:
                key = (p.nic, p.link_layer)
                fastest[key] = max(fastest.get(key, 0.0), p.rate_gbps)
    for p in judged:
        if p.counter_garbled:
            out.append(
                Finding.unchecked(
                    Check.INFINIBAND, f"InfiniBand rail {p.rail}: {p.counter_garbled[0]}", kind="counters_garbled"
                )
            )
        if p.counter_errors:
            out.append(
                Finding.info(
                    Check.INFINIBAND,
                    f"InfiniBand rail {p.rail}: error counters unreadable, flaps seen from state changes only: "
                    f"{p.counter_errors[0]}",
                    kind="counters_unreadable",
                )
            )
        for name in p.saturated:
            out.append(
                Finding.info(
                    Check.INFINIBAND,
                    f"InfiniBand rail {p.rail}: counter {name} saturated at {p.counters[name]} (it no longer moves: "
                    "flaps seen from state changes only)",
                    kind="counter_saturated",
                )
            )
        expected = min_rate_gbps if min_rate_gbps is not None else fastest.get((p.nic, p.link_layer))
        if not p.up:
            out.append(
                Finding.fault(
                    Check.INFINIBAND,
                    Reason.GPU_DEGRADED,
                    f"InfiniBand rail {p.rail} is {p.state[1]} ({p.phys_state[1]})",
                    kind="rail_down",
                )
            )
        elif expected is not None and p.rate_gbps is not None and p.rate_gbps < expected:
            kind_of = " ".join(x for x in (p.nic, p.link_layer) if x)
            of = "" if min_rate_gbps is not None else f" (the node's other {kind_of + ' ' if kind_of else ''}rails)"
            out.append(
                Finding.fault(
                    Check.INFINIBAND,
                    Reason.GPU_DEGRADED,
                    f"InfiniBand rail {p.rail} at {p.rate_gbps:g} Gb/s, below {expected:g} Gb/s{of}",
                    kind="rail_slow",
                )
            )
    if judged and not any(p.up for p in judged):
        out.append(
            Finding.fault(
                Check.INFINIBAND,
                Reason.FABRIC_NOT_READY,
                f"no usable InfiniBand rail: all {len(judged)} rail ports down",
                kind="rails_all_down",
            )
        )
    front = [p for p in ports if rails is not None and p.device not in rails]
    if front:
        down = sum(1 for p in front if not p.up)
        out.append(
            Finding.info(
                Check.INFINIBAND,
                f"{len(front)} front-end RDMA ports not judged ({down} down): no GPU beside them and not in "
                f"railDevices ({', '.join(sorted({p.device for p in front})[:8])})",
                kind="front_end",
            )
        )
    devices = len({p.device for p in ports})
    if expected_nics is not None and devices < expected_nics:
        out.append(
            Finding.fault(
                Check.INFINIBAND,
                Reason.GPU_DEGRADED,
                f"{devices} InfiniBand devices, expected {expected_nics}",
                kind="nic_missing",
            )
        )
    return out


@dataclass(frozen=True)
class InfinibandSettings:
    """Settings of the InfiniBand probe (IbThresholds is built from them)."""

    infiniband: bool = setting(to_bool, True, "judge the InfiniBand/RoCE ports in sysfs (a rail down: GPUDegraded)")
    expected_nics: int | None = setting(
        optional(in_range(to_int, 0, MAX_EXPECTED_NICS)),
        None,
        "InfiniBand devices this node must have (unset: not judged)",
    )
    ib_min_rate_gbps: float | None = setting(
        optional(positive(to_float, 10_000)),
        None,
        "an active InfiniBand port below this rate (Gb/s) is degraded (unset: see ibRatePeers)",
    )
    ib_rate_peers: bool = setting(
        to_bool,
        True,
        "with ibMinRateGbps unset, an active port below the node's fastest port of its link layer is degraded",
    )
    ib_flap_count: int = setting(
        in_range(to_int, 1, MAX_FLAPS),
        3,
        "an InfiniBand port that went down this many times within ibFlapWindow is flapping (GPUDegraded)",
    )
    ib_flap_window: float = setting(
        positive(to_float, DAY), 600.0, "seconds over which InfiniBand link downs are counted"
    )
    require_gpu_direct: bool = setting(
        to_bool, False, "the nvidia_peermem module (GPUDirect RDMA) must be loaded; missing: GPUDegraded"
    )
    rail_devices: tuple[str, ...] | None = setting(
        optional(lambda v: rail_patterns(v)),
        None,
        "InfiniBand devices (names or globs) judged as rails besides those beside a GPU; others are front-end",
    )

    def thresholds(self) -> IbThresholds:
        """What the probe judges with, from these settings."""
        return IbThresholds(
            self.expected_nics,
            self.ib_min_rate_gbps,
            self.ib_rate_peers,
            FlapThresholds(self.ib_flap_count, self.ib_flap_window),
            self.require_gpu_direct,
            self.rail_devices or (),
        )


@dataclass(frozen=True)
class FlapThresholds:
    count: int = InfinibandSettings.ib_flap_count
    window_s: float = InfinibandSettings.ib_flap_window


class FlapTracker:
    """Link-down events per port within a sliding window, from two consecutive reads of each port."""

    def __init__(self, t: FlapThresholds) -> None:
        self.t = t
        self._last: dict[tuple[str, str], Port] = {}
        self._events: dict[tuple[str, str], deque[float]] = {}

    def observe(self, ports: Iterable[Port], now: float) -> None:
        seen = {}
        for p in ports:
            key = (p.device, p.port)
            seen[key] = p
            before = self._last.get(key)
            if before is None:
                continue  # the first read is the baseline: the counters count since boot
            new = 0
            old_c, new_c = before.counters.get("link_downed"), p.counters.get("link_downed")
            if old_c is not None and new_c is not None and new_c > old_c:
                new = new_c - old_c
            elif before.up and not p.up:
                new = 1  # seen going down without the counter (absent, saturated or not yet updated)
            if new:
                q = self._events.setdefault(key, deque(maxlen=MAX_FLAPS))
                q.extend([now] * min(new, MAX_FLAPS))
        self._last = seen
        for key in [k for k in self._events if k not in seen]:
            del self._events[key]  # a port that left is forgotten
        for q in self._events.values():
            while q and q[0] <= now - self.t.window_s:
                q.popleft()

    def flaps(self, device: str, port: str) -> int:
        return len(self._events.get((device, port), ()))

    def findings(self, rails: Collection[str] | None = None) -> list[Finding]:
        """Flapping rails (rails None: every port)."""
        out = []
        for (dev, port), q in sorted(self._events.items()):
            if len(q) >= self.t.count and (rails is None or dev in rails):
                out.append(
                    Finding.fault(
                        Check.INFINIBAND,
                        Reason.GPU_DEGRADED,
                        f"InfiniBand rail {dev} port {port} flapping: down {len(q)} times in "
                        f"{self.t.window_s:g} s (threshold {self.t.count})",
                        kind="rail_flapping",
                    )
                )
        return out


def _pci_chain(path: str) -> list[str]:
    """The PCI functions on a device's real sysfs path below the root complex (`pci0000:00`), outermost first."""
    parts = os.path.realpath(path).split(os.sep)
    start = next((i for i, c in enumerate(parts) if c.startswith("pci") and ":" in c), None)
    if start is None:
        return []
    return [c for c in parts[start + 1 :] if PciAddress.parse(c.rsplit(".", 1)[0]) is not None]


def rail_topology(
    root: str, sysfs_root: str, gpus: Iterable[PciAddress], devices: Iterable[str]
) -> tuple[dict[PciAddress, str], set[str], set[str]]:
    """Each GPU's rail (the device under `root` sharing the longest PCI path below the root complex with it), every
    device with GPU affinity (sharing at least a root port with some GPU; a virtual function, whose PCI function has
    a `physfn`, never: its physical function is the rail), and the virtual functions."""
    nics = {d: _pci_chain(os.path.join(root, d, "device")) for d in sorted(set(devices))}
    vfs = {d for d in nics if os.path.lexists(os.path.join(root, d, "device", "physfn"))}
    out, affine = {}, set()
    for g in gpus:
        name = f"{g.domain:04x}:{g.bus:02x}:{g.device:02x}.0"
        chain = _pci_chain(os.path.join(sysfs_root, "bus", "pci", "devices", name))
        best, best_len = None, 0
        for dev, nic in nics.items():
            if dev in vfs:
                continue  # a virtual function beside its physical one: the physical one is the GPU's rail
            n = 0
            while n < min(len(chain), len(nic)) - 1 and chain[n] == nic[n]:
                n += 1
            if n:
                affine.add(dev)
            if n > best_len:
                best, best_len = dev, n
        if best is not None:
            out[g] = best
    return out, affine, vfs


def gpu_rails(root: str, sysfs_root: str, gpus: Iterable[PciAddress], devices: Iterable[str]) -> dict[PciAddress, str]:
    """Each GPU's rail: the device (under `root`) sharing the longest PCI path below the root complex with it."""
    return rail_topology(root, sysfs_root, gpus, devices)[0]


def gpudirect_loaded(sysfs_root: str) -> bool:
    return any(os.path.isdir(os.path.join(sysfs_root, "module", m)) for m in ("nvidia_peermem", "nv_peer_mem"))


@dataclass
class RailReport:
    """What the probe read this cycle, for `check --json`, the metrics and `gpu-ready gpus`."""

    ports: list[Port] = field(default_factory=list)
    flaps: dict[tuple[str, str], int] = field(default_factory=dict)
    gpu_rails: dict[PciAddress, str] = field(default_factory=dict)
    gpudirect: bool | None = None  # None: not looked at
    rails: set[str] | None = None  # the devices judged as rails (None: every one)
    rails_from: str = ""  # how they were chosen (rail_devices)
    not_read: int = 0  # devices beyond MAX_DEVICES, not read

    def down_devices(self) -> set[str]:
        return {p.device for p in self.ports if not p.up}

    def rail_of(self, gpu: PciAddress | None) -> str:
        """`mlx5_0` / `mlx5_0 DOWN` / `-` for the `gpus` table."""
        dev = self.gpu_rails.get(gpu) if gpu is not None else None
        if dev is None:
            return "-"
        return f"{dev} DOWN" if dev in self.down_devices() else dev

    def to_json(self) -> dict[str, Any]:
        return {
            "ports": [
                {
                    "device": p.device,
                    "port": p.port,
                    "state": p.state[1],
                    "phys_state": p.phys_state[1],
                    "rate_gbps": p.rate_gbps,
                    "link_layer": p.link_layer or None,
                    "counters": dict(p.counters),
                    "flaps_in_window": self.flaps.get((p.device, p.port), 0),
                    "nic": p.nic or None,
                    "rail": self.rails is None or p.device in self.rails,
                    "saturated": list(p.saturated),
                }
                for p in self.ports
            ],
            "gpu_rails": {g.nvml: d for g, d in sorted(self.gpu_rails.items())},
            "gpudirect": self.gpudirect,
            "rails_from": self.rails_from or None,
            "not_read": self.not_read,
        }


@dataclass(frozen=True)
class IbThresholds:
    expected_nics: int | None = None
    min_rate_gbps: float | None = None
    rate_peers: bool = InfinibandSettings.ib_rate_peers
    flaps: FlapThresholds = FlapThresholds()
    require_gpudirect: bool = InfinibandSettings.require_gpu_direct
    rail_devices: tuple[str, ...] = ()  # names or globs of devices that are rails besides those beside a GPU


class InfinibandProbe:
    """The node's InfiniBand / RoCE ports, read every cycle (a few small sysfs files per port)."""

    check = Check.INFINIBAND

    def __init__(
        self,
        sysfs_root: str,
        expected_nics: int | None = None,
        min_rate_gbps: float | None = None,
        thresholds: IbThresholds | None = None,
        reader: SysfsReader = READER,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.reader, self.layout = reader, PortLayout()
        self.root = os.path.join(sysfs_root, "class", "infiniband")
        self.t = thresholds or IbThresholds(expected_nics, min_rate_gbps, rate_peers=False)
        self.tracker = FlapTracker(self.t.flaps)
        self._rails_key: tuple[tuple[str, ...], tuple[PciAddress, ...]] | None = None
        self._rails: dict[PciAddress, str] = {}
        self._affine: set[str] = set()
        self._vfs: set[str] = set()

    def read(self, context: ProbeContext) -> ProbeResult:
        try:
            ports = self.reader.run(read_ports, self.root, True, self.layout, what="reading the InfiniBand ports")
        except (Unreadable, Blocked) as e:
            return ProbeResult.of(Check.INFINIBAND, (Finding.unchecked(Check.INFINIBAND, f"InfiniBand: {e}"),))
        rails_map: dict[PciAddress, str] = {}
        affine: set[str] = set()
        if ports:
            # The topology is fixed while the devices and GPUs stay: the paths are resolved again when they change.
            key = (tuple(sorted({p.device for p in ports})), tuple(sorted(context.gpus())))
            if key != self._rails_key:
                self._rails_key = key
                self._rails, self._affine, self._vfs = rail_topology(self.root, self.sysfs_root, key[1], key[0])
            rails_map, affine = dict(self._rails), self._affine
        rails, how = rail_devices(ports, affine, self.t.rail_devices, self._vfs)
        findings = port_findings(ports, self.t.expected_nics, self.t.min_rate_gbps, self.t.rate_peers, rails)
        self.tracker.observe(ports, context.now)
        findings += self.tracker.findings(rails)
        report = RailReport(ports, {(p.device, p.port): self.tracker.flaps(p.device, p.port) for p in ports})
        report.gpu_rails, report.rails, report.rails_from = rails_map, rails, how
        report.not_read = max(0, self.layout.total - MAX_DEVICES)
        if report.not_read:
            findings.append(
                Finding.unchecked(
                    Check.INFINIBAND,
                    f"InfiniBand: {report.not_read} of {self.layout.total} devices not read (at most {MAX_DEVICES} "
                    "per cycle)",
                    kind="devices_not_read",
                )
            )
        if self.t.require_gpudirect:
            report.gpudirect = gpudirect_loaded(self.sysfs_root)
            if not report.gpudirect:
                findings.append(
                    Finding.fault(
                        Check.INFINIBAND,
                        Reason.GPU_DEGRADED,
                        "GPUDirect RDMA missing: no nvidia_peermem module loaded",
                        kind="gpudirect_missing",
                    )
                )
        return ProbeResult.of(Check.INFINIBAND, findings, payload=report)


def rail_patterns(v: Any) -> tuple[str, ...]:
    """`railDevices`: InfiniBand device names or globs (`mlx5_*`, `mlx5_[0-7]`), comma or space separated."""
    items = list(v) if isinstance(v, list | tuple) else to_str(v).replace(",", " ").split()
    if len(items) > MAX_RAIL_PATTERNS:
        raise ValueError(f"at most {MAX_RAIL_PATTERNS} names, got {len(items)}")
    out = []
    for x in items:
        x = str(x).strip()
        if not _RAIL_PATTERN.match(x):
            raise ValueError(f"expected an InfiniBand device name or glob, got {x[:60]!r}")
        out.append(x)
    return tuple(out)
