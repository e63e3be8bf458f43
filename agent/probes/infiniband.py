"""InfiniBand and RoCE ports (the rails of multi-node jobs), from sysfs: `<sysfs>/class/infiniband/<device>/ports/
<n>/{state,phys_state,rate,link_layer}` and the port's error counters `<n>/counters/{link_downed,symbol_error,
port_rcv_errors,link_error_recovery}`. A rail that is down, trained below its rate, or flapping stalls or slows every
multi-node job on the node while all its GPUs are healthy.

Formats, from the kernel's Documentation/ABI/stable/sysfs-class-infiniband: `state` "4: ACTIVE" (1 DOWN, 2 INIT,
3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER), `phys_state` "5: LinkUp" (2 Polling, 3 Disabled, 7 LinkErrorRecovery, ...),
`rate` "400 Gb/sec (4X NDR)", `link_layer` "InfiniBand" or "Ethernet" (RoCE), each counter one decimal number.

Judged GPUDegraded (the GPUs work; work over this rail does not, or slower), each naming the rail:
- a port whose state is not ACTIVE or whose physical state is not LinkUp (`rail_down`);
- an active port whose rate is below `ibMinRateGbps`, or, with that unset and `ibRatePeers` on, below the fastest
  active port of the same link layer on the node (the rails of one node are one SKU) (`rail_slow`);
- fewer InfiniBand devices than `expectedNics` (unset: not judged) (`nic_missing`);
- a port that went down `ibFlapCount` times within `ibFlapWindow` seconds (`rail_flapping`): each increase of
  `link_downed` between two polls counts its increase, and a port seen ACTIVE at one poll and not at the next counts
  one when the counter did not move (a counter that reads lower than before was reset: a new baseline);
- with `requireGpuDirect`, no `nvidia_peermem` (or the older `nv_peer_mem`) module under `<sysfs>/module`
  (`gpudirect_missing`): NCCL then stages every transfer through host memory.
A node with no InfiniBand device has nothing to judge: no finding unless `expectedNics` asks for some. A port
whose state files exist but cannot be read or parsed is "could not check"; a counter that is absent (some RoCE
drivers) is not read, one that exists but does not read or parse is reported (info, `counters_unreadable`): the
port's state still judges the rail, and its flaps are then seen from state changes only. Each file read is one bounded
read under a deadline (probes/sysfs.py): a read that does not answer (a wedged HCA) makes the probe "could not
check", whichever file it was; the ports and link layers are read once per device (PortLayout). The error
counters other than `link_downed` are reported (metrics, `check --json`), not judged.

Each GPU's rail: the InfiniBand device whose PCI function shares the longest stretch of the GPU's sysfs path below
the root complex (the same PCIe switch or root port; nothing shared: no rail), resolved again only when the devices
or the GPUs change. `gpu-ready gpus` shows it."""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.probes.bounded import Blocked
from agent.probes.sysfs import READER, SysfsReader, read_bytes
from agent.settings import DAY, Setting, in_range, optional, positive, to_bool, to_float, to_int

ACTIVE, LINK_UP = 4, 5
MAX_DEVICES = 64  # InfiniBand devices judged (an 8-rail node has 8 to 10)
MAX_PORTS = 8  # ports per device judged (a ConnectX has 1 or 2)
MAX_FLAPS = 256  # flap times kept per port (a bound on memory; the threshold is far below)
COUNTERS = ("link_downed", "symbol_error", "port_rcv_errors", "link_error_recovery")
_STATE = re.compile(r"^\s*(\d{1,2})\s*:\s*([A-Za-z_ ]{1,32})\s*$")
_RATE = re.compile(r"^\s*(\d{1,5}(?:\.\d{1,3})?)\s*Gb/sec")
_COUNTER = re.compile(r"^\s*(\d{1,20})\s*$")


@dataclass(frozen=True)
class Port:
    device: str
    port: str
    state: tuple[int, str]
    phys_state: tuple[int, str]
    rate_gbps: float | None  # None: the device gives no rate
    link_layer: str = ""  # "InfiniBand" / "Ethernet" (RoCE); "" when not given
    counters: Mapping[str, int] = field(default_factory=dict)  # the COUNTERS the port has
    counter_errors: tuple[str, ...] = ()  # counters there that did not read or parse (why, one line each)

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


def _counters(base: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """The counters that read, and why the others there did not: a driver may refuse one (EINVAL on some RoCE
    devices); the port's state still judges the rail, so that is reported, not "could not check"."""
    out, errors = {}, []
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
            errors.append(f"{path}: {text[:40]!r} is not a number")
            continue
        out[name] = int(m[1])
    return out, tuple(errors)


class PortLayout:
    """What does not change while an InfiniBand device stays: its ports and each port's link layer (the port type
    changes only with a firmware reset, which re-creates the device). Kept per device with the inode of its entry
    under the class directory (a device removed and added again is another entry: read again); the state, the rate
    and the counters are read every poll."""

    def __init__(self) -> None:
        self.devices: dict[str, tuple[int, tuple[tuple[str, str], ...]]] = {}


def _device_layout(root: str, dev: str) -> tuple[tuple[str, str], ...]:
    """(port, link layer) of each port of `dev`, in port order."""
    ports_dir = f"{root}/{dev}/ports"
    try:
        ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))[:MAX_PORTS]
    except OSError as e:
        raise Unreadable(f"{ports_dir}: {e.strerror}") from None
    return tuple((p, (_read(f"{ports_dir}/{p}/link_layer") or "").strip()[:16]) for p in ports)


def read_ports(root: str, counters: bool = True, layout: PortLayout | None = None) -> list[Port]:
    """Every port of every InfiniBand device under `root` (<sysfs>/class/infiniband), sorted. Raises Unreadable
    when a port's state cannot be read, Blocked when a read does not answer; an absent `root` is no device.
    layout: the devices' ports and link layers from earlier polls (kept and updated; None reads them all)."""
    try:
        with os.scandir(root) as it:
            devices = sorted((e.name, e.inode()) for e in it)[:MAX_DEVICES]
    except FileNotFoundError:
        return []
    except OSError as e:
        raise Unreadable(f"{root}: {e.strerror}") from None
    known = layout.devices if layout is not None else {}
    fresh = {}
    out = []
    for dev, ino in devices:
        got = known.get(dev)
        if got is None or got[0] != ino:
            got = (ino, _device_layout(root, dev))
        fresh[dev] = got
        for p, layer in got[1]:
            base = f"{root}/{dev}/ports/{p}"
            rate = _read(base + "/rate")
            m = _RATE.match(rate or "")
            values, errors = _counters(base) if counters else ({}, ())
            state, phys = _state(base + "/state"), _state(base + "/phys_state")
            out.append(Port(dev, p, state, phys, float(m[1]) if m else None, layer, values, errors))
    if layout is not None:
        layout.devices = fresh  # only after every read answered: a call abandoned at its deadline changes nothing
    return out


def port_findings(
    ports: list[Port], expected_nics: int | None, min_rate_gbps: float | None, rate_peers: bool = False
) -> list[Finding]:
    out = []
    fastest: dict[str, float] = {}
    if min_rate_gbps is None and rate_peers:
        for p in ports:
            if p.up and p.rate_gbps is not None:
                fastest[p.link_layer] = max(fastest.get(p.link_layer, 0.0), p.rate_gbps)
    for p in ports:
        if p.counter_errors:
            out.append(
                Finding.info(
                    Check.INFINIBAND,
                    f"InfiniBand rail {p.rail}: error counters unreadable, flaps seen from state changes only: "
                    f"{p.counter_errors[0]}",
                    kind="counters_unreadable",
                )
            )
        expected = min_rate_gbps if min_rate_gbps is not None else fastest.get(p.link_layer)
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
            of = "" if min_rate_gbps is not None else " (the node's other rails)"
            out.append(
                Finding.fault(
                    Check.INFINIBAND,
                    Reason.GPU_DEGRADED,
                    f"InfiniBand rail {p.rail} at {p.rate_gbps:g} Gb/s, below {expected:g} Gb/s{of}",
                    kind="rail_slow",
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
class FlapThresholds:
    count: int = 3
    window_s: float = 600.0


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

    def findings(self) -> list[Finding]:
        out = []
        for (dev, port), q in sorted(self._events.items()):
            if len(q) >= self.t.count:
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


def gpu_rails(root: str, sysfs_root: str, gpus: Iterable[PciAddress], devices: Iterable[str]) -> dict[PciAddress, str]:
    """Each GPU's rail: the device (under `root`) sharing the longest PCI path below the root complex with it."""
    nics = {d: _pci_chain(os.path.join(root, d, "device")) for d in sorted(set(devices))}
    out = {}
    for g in gpus:
        name = f"{g.domain:04x}:{g.bus:02x}:{g.device:02x}.0"
        chain = _pci_chain(os.path.join(sysfs_root, "bus", "pci", "devices", name))
        best, best_len = None, 0
        for dev, nic in nics.items():
            n = 0
            while n < min(len(chain), len(nic)) - 1 and chain[n] == nic[n]:
                n += 1
            if n > best_len:
                best, best_len = dev, n
        if best is not None:
            out[g] = best
    return out


def gpudirect_loaded(sysfs_root: str) -> bool:
    return any(os.path.isdir(os.path.join(sysfs_root, "module", m)) for m in ("nvidia_peermem", "nv_peer_mem"))


@dataclass
class RailReport:
    """What the probe read this cycle, for `check --json`, the metrics and `gpu-ready gpus`."""

    ports: list[Port] = field(default_factory=list)
    flaps: dict[tuple[str, str], int] = field(default_factory=dict)
    gpu_rails: dict[PciAddress, str] = field(default_factory=dict)
    gpudirect: bool | None = None  # None: not looked at

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
                }
                for p in self.ports
            ],
            "gpu_rails": {g.nvml: d for g, d in sorted(self.gpu_rails.items())},
            "gpudirect": self.gpudirect,
        }


@dataclass(frozen=True)
class IbThresholds:
    expected_nics: int | None = None
    min_rate_gbps: float | None = None
    rate_peers: bool = True
    flaps: FlapThresholds = FlapThresholds()
    require_gpudirect: bool = False


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

    def read(self, context: ProbeContext) -> ProbeResult:
        try:
            ports = self.reader.run(read_ports, self.root, True, self.layout, what="reading the InfiniBand ports")
        except (Unreadable, Blocked) as e:
            return ProbeResult.of(Check.INFINIBAND, (Finding.unchecked(Check.INFINIBAND, f"InfiniBand: {e}"),))
        findings = port_findings(ports, self.t.expected_nics, self.t.min_rate_gbps, self.t.rate_peers)
        self.tracker.observe(ports, context.now)
        findings += self.tracker.findings()
        report = RailReport(ports, {(p.device, p.port): self.tracker.flaps(p.device, p.port) for p in ports})
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
        if ports:
            # The topology is fixed while the devices and GPUs stay: the paths are resolved again when they change.
            key = (tuple(sorted({p.device for p in ports})), tuple(sorted(context.gpus())))
            if key != self._rails_key:
                self._rails_key, self._rails = key, gpu_rails(self.root, self.sysfs_root, key[1], key[0])
            report.gpu_rails = dict(self._rails)
        return ProbeResult.of(Check.INFINIBAND, findings, payload=report)


SETTINGS = (
    Setting("infiniband", to_bool, True, "judge the InfiniBand/RoCE ports in sysfs (a rail down: GPUDegraded)"),
    Setting(
        "expected_nics",
        optional(in_range(to_int, 0, MAX_DEVICES)),
        None,
        "InfiniBand devices this node must have (unset: not judged)",
    ),
    Setting(
        "ib_min_rate_gbps",
        optional(positive(to_float, 10_000)),
        None,
        "an active InfiniBand port below this rate (Gb/s) is degraded (unset: see ibRatePeers)",
    ),
    Setting(
        "ib_rate_peers",
        to_bool,
        True,
        "with ibMinRateGbps unset, an active port below the node's fastest port of its link layer is degraded",
    ),
    Setting(
        "ib_flap_count",
        in_range(to_int, 1, MAX_FLAPS),
        3,
        "an InfiniBand port that went down this many times within ibFlapWindow is flapping (GPUDegraded)",
    ),
    Setting("ib_flap_window", positive(to_float, DAY), 600.0, "seconds over which InfiniBand link downs are counted"),
    Setting(
        "require_gpu_direct",
        to_bool,
        False,
        "the nvidia_peermem module (GPUDirect RDMA) must be loaded; missing: GPUDegraded",
    ),
)
