"""InfiniBand and RoCE ports (the rails of multi-node jobs), from sysfs: `<sysfs>/class/infiniband/<device>/ports/
<n>/{state,phys_state,rate}`. A rail that is down, or trained below its rate, stalls or slows every multi-node
job on the node while all its GPUs are healthy.

Formats, from the kernel's Documentation/ABI/stable/sysfs-class-infiniband: `state` "4: ACTIVE" (1 DOWN, 2 INIT,
3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER), `phys_state` "5: LinkUp" (2 Polling, 3 Disabled, 7 LinkErrorRecovery, ...),
`rate` "400 Gb/sec (4X NDR)".

Judged GPUDegraded (the GPUs work; work over this rail does not, or slower), each naming the rail:
- a port whose state is not ACTIVE or whose physical state is not LinkUp;
- a port whose rate is below `ibMinRateGbps` (unset: not judged);
- fewer InfiniBand devices than `expectedNics` (unset: not judged).
A node with no InfiniBand device has nothing to judge: no finding unless `expectedNics` asks for some. A port
whose files exist but cannot be read or parsed is "could not check". Each file read is one bounded read."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from agent.model import Check, Finding, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.settings import Setting, in_range, optional, positive, to_bool, to_float, to_int

ACTIVE, LINK_UP = 4, 5
MAX_DEVICES = 64  # InfiniBand devices judged (an 8-rail node has 8 to 10)
MAX_PORTS = 8  # ports per device judged (a ConnectX has 1 or 2)
_STATE = re.compile(r"^\s*(\d{1,2})\s*:\s*([A-Za-z_ ]{1,32})\s*$")
_RATE = re.compile(r"^\s*(\d{1,5}(?:\.\d{1,3})?)\s*Gb/sec")


@dataclass(frozen=True)
class Port:
    device: str
    port: str
    state: tuple[int, str]
    phys_state: tuple[int, str]
    rate_gbps: float | None  # None: the device gives no rate

    @property
    def rail(self) -> str:
        return f"{self.device} port {self.port}"


class Unreadable(Exception):
    pass


def _read(path: str) -> str | None:
    """The file's first line; None when it does not exist; Unreadable when it exists but cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(f"{path}: {e.strerror}") from None
    try:
        return os.read(fd, 64).decode("ascii", "replace").partition("\n")[0]
    except OSError as e:
        raise Unreadable(f"{path}: {e.strerror}") from None
    finally:
        os.close(fd)


def _state(path: str) -> tuple[int, str]:
    text = _read(path)
    m = _STATE.match(text or "")
    if m is None:
        raise Unreadable(f"{path}: {'missing' if text is None else repr(text[:40])} is not '<n>: <NAME>'")
    return int(m[1]), m[2].strip()


def read_ports(root: str) -> list[Port]:
    """Every port of every InfiniBand device under `root` (<sysfs>/class/infiniband), sorted. Raises Unreadable
    when a port's state cannot be read; an absent `root` is no device."""
    try:
        devices = sorted(os.listdir(root))[:MAX_DEVICES]
    except FileNotFoundError:
        return []
    except OSError as e:
        raise Unreadable(f"{root}: {e.strerror}") from None
    out = []
    for dev in devices:
        ports_dir = os.path.join(root, dev, "ports")
        try:
            ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))[:MAX_PORTS]
        except OSError as e:
            raise Unreadable(f"{ports_dir}: {e.strerror}") from None
        for p in ports:
            base = os.path.join(ports_dir, p)
            rate = _read(os.path.join(base, "rate"))
            m = _RATE.match(rate or "")
            out.append(Port(dev, p, _state(base + "/state"), _state(base + "/phys_state"), float(m[1]) if m else None))
    return out


def port_findings(ports: list[Port], expected_nics: int | None, min_rate_gbps: float | None) -> list[Finding]:
    out = []
    for p in ports:
        if p.state[0] != ACTIVE or p.phys_state[0] != LINK_UP:
            out.append(
                Finding.fault(
                    Check.INFINIBAND,
                    Reason.GPU_DEGRADED,
                    f"InfiniBand rail {p.rail} is {p.state[1]} ({p.phys_state[1]})",
                    kind="rail_down",
                )
            )
        elif min_rate_gbps is not None and p.rate_gbps is not None and p.rate_gbps < min_rate_gbps:
            out.append(
                Finding.fault(
                    Check.INFINIBAND,
                    Reason.GPU_DEGRADED,
                    f"InfiniBand rail {p.rail} at {p.rate_gbps:g} Gb/s, below {min_rate_gbps:g} Gb/s",
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


class InfinibandProbe:
    """The node's InfiniBand / RoCE ports, read every cycle (a few small sysfs files per port)."""

    check = Check.INFINIBAND

    def __init__(self, sysfs_root: str, expected_nics: int | None, min_rate_gbps: float | None) -> None:
        self.root = os.path.join(sysfs_root, "class", "infiniband")
        self.expected_nics, self.min_rate_gbps = expected_nics, min_rate_gbps

    def read(self, context: ProbeContext) -> ProbeResult:
        try:
            ports = read_ports(self.root)
        except Unreadable as e:
            return ProbeResult.of(Check.INFINIBAND, (Finding.unchecked(Check.INFINIBAND, f"InfiniBand: {e}"),))
        return ProbeResult.of(Check.INFINIBAND, port_findings(ports, self.expected_nics, self.min_rate_gbps))


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
        "an active InfiniBand port below this rate (Gb/s) is degraded (unset: not judged)",
    ),
)
