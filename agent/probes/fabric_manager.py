"""The fabric manager on NVSwitch systems (HGX/DGX: NVSwitches on the node's PCI bus), read from what a DaemonSet
pod can see.

What is read, and why:
- the NVSwitches: `<sysfs>/bus/pci/devices/*/{vendor,class}`, NVIDIA (0x10de) functions of class 0x0680 (bridge,
  other), as `lspci` lists them ("Bridge: NVIDIA Corporation Device 22a3"). None: not an NVSwitch system, nothing
  to judge. The listing is read each poll; a function's two files only when it first appears.
- the GPUs' fabric state (the fabric probe's readings this cycle): the fabric manager trains the NVSwitch fabric
  and moves every GPU's state from Not Started through In Progress to Completed. On an NVSwitch system a GPU still
  Not Started means the fabric manager is not running (`fm_not_running`); In Progress means it has not finished
  (`fm_not_finished`). Both are FabricNotReady: CUDA returns error 802 "system not yet initialized" until then.
- with `fabricManagerAddress` set (its command interface, `FM_CMD_BIND_INTERFACE`/`FM_CMD_PORT_NUMBER` in
  fabricmanager.cfg, by default 127.0.0.1:6666; reachable from a pod with host networking): one TCP connect
  per poll under a 1 s deadline. Refused or unreachable: `fm_not_running` (FabricNotReady). This is the only
  signal on NVSwitch systems whose GPUs report no fabric state (A100 HGX).
- the kernel log's NVSwitch records (SXid) are judged by the kernel-log watcher, not here.
A PCI listing that exists but cannot be read, or an address whose host name does not resolve, is could not check.
On an NVSwitch system where no GPU reports a fabric state and no address is set, the fabric manager is not judged:
`check --json` says so (`fabric_manager.judged` false). A fabric probe that could not check leaves this probe
without a state; the fabric probe's own "could not check" already keeps the node from True."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.probes.bounded import Blocked
from agent.probes.fabric import FabricReport
from agent.probes.sysfs import READER, SysfsReader, read_bytes
from agent.settings import host_port, optional, setting, to_bool

NVIDIA = 0x10DE
NVSWITCH_CLASS = 0x0680  # bridge, other
MAX_FUNCTIONS = 4096
CONNECT_TIMEOUT_S = 1.0


@dataclass
class FabricManagerReport:
    nvswitches: list[str] = field(default_factory=list)
    judged: bool = False
    state: str = "not an NVSwitch system"

    def to_json(self) -> dict[str, Any]:
        return {"nvswitches": len(self.nvswitches), "judged": self.judged, "state": self.state}


def _hex(path: str) -> int | None:
    """A sysfs attribute such as `0x10de` (probes/sysfs.py, under the deadline); None when it cannot be read or
    parsed. A read that does not answer raises Blocked: the scan is then "could not check"."""
    try:
        return int(read_bytes(path, 32).strip() or b"x", 16)
    except Blocked:
        raise
    except (OSError, ValueError):
        return None


class NvswitchScanner:
    """The NVSwitches on PCI, by function name; a function's vendor and class are read once."""

    def __init__(self, sysfs_root: str, reader: SysfsReader = READER) -> None:
        self.root = os.path.join(sysfs_root, "bus", "pci", "devices")
        self.reader = reader
        self._known: dict[str, bool] = {}

    def scan(self) -> list[str]:
        """Raises OSError when the listing exists but cannot be read, or a new function's files do not answer within
        the deadline (Blocked: probes/sysfs.py, read on its worker in one hand-off): could not check."""
        try:
            names = sorted(os.listdir(self.root))[:MAX_FUNCTIONS]
        except FileNotFoundError:
            return []
        new = [n for n in names if n not in self._known]
        read = self.reader.run(self._nvswitch, new, what="reading the new PCI functions") if new else {}
        known = {n: read[n] if n in read else self._known[n] for n in names}
        self._known = known
        return [n for n, hit in known.items() if hit]

    def _nvswitch(self, names: list[str]) -> dict[str, bool]:
        out = {}
        for n in names:
            vendor, cls = _hex(f"{self.root}/{n}/vendor"), _hex(f"{self.root}/{n}/class")
            out[n] = vendor == NVIDIA and cls is not None and cls >> 8 == NVSWITCH_CLASS
        return out


class Unresolvable(Exception):
    pass


def fm_reachable(address: str) -> str | None:
    """None when the fabric manager's command port accepts a connection; else why not. Unresolvable when the host
    name does not resolve (nothing was asked of the fabric manager: could not check)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
            return None
    except socket.gaierror as e:
        raise Unresolvable(f"{host}: {e.strerror or e}") from None
    except OSError as e:
        return e.strerror or type(e).__name__


class FabricManagerProbe:
    check = Check.FABRIC_MANAGER

    def __init__(self, sysfs_root: str, address: str | None = None) -> None:
        self.scanner = NvswitchScanner(sysfs_root)
        self.address = address

    def read(self, context: ProbeContext) -> ProbeResult:
        try:
            report = FabricManagerReport(self.scanner.scan())
        except OSError as e:
            return self._unchecked(f"fabric manager: {self.scanner.root}: {e.strerror or e}")
        if not report.nvswitches:
            return ProbeResult.of(Check.FABRIC_MANAGER, payload=report)
        n = len(report.nvswitches)
        findings: list[Finding] = []
        fabric = context.payload(Check.FABRIC, FabricReport) if context.ran(Check.FABRIC) else None
        if fabric is not None and fabric.applicable:
            report.judged = True
            states = [g.state for g in fabric.gpus if g.applicable]
            waiting = {s: states.count(s) for s in ("Not Started", "In Progress") if s in states}
            if "Not Started" in waiting:
                report.state = "not running"
                findings.append(
                    Finding.fault(
                        Check.FABRIC_MANAGER,
                        Reason.FABRIC_NOT_READY,
                        f"fabric manager not running: {waiting['Not Started']} of {len(states)} GPUs' NVLink fabric "
                        f"not started ({n} NVSwitches)",
                        kind="fm_not_running",
                    )
                )
            elif "In Progress" in waiting:
                report.state = "not finished"
                findings.append(
                    Finding.fault(
                        Check.FABRIC_MANAGER,
                        Reason.FABRIC_NOT_READY,
                        f"fabric manager not finished: {waiting['In Progress']} of {len(states)} GPUs' NVLink fabric "
                        f"in progress ({n} NVSwitches)",
                        kind="fm_not_finished",
                    )
                )
            else:
                report.state = "fabric completed"
        if self.address is not None and not findings:
            report.judged = True
            try:
                why = fm_reachable(self.address)
            except Unresolvable as e:
                return self._unchecked(f"fabric manager: {e}")
            if why is not None:
                report.state = "not running"
                findings.append(
                    Finding.fault(
                        Check.FABRIC_MANAGER,
                        Reason.FABRIC_NOT_READY,
                        f"fabric manager not running: {self.address} {why} ({n} NVSwitches)",
                        kind="fm_not_running",
                    )
                )
            elif report.state == "not an NVSwitch system":
                report.state = "running"
        if not report.judged:
            report.state = "not judged: no GPU reports a fabric state and fabricManagerAddress is unset"
        return ProbeResult.of(Check.FABRIC_MANAGER, findings, payload=report)

    @staticmethod
    def _unchecked(message: str) -> ProbeResult:
        return ProbeResult.of(Check.FABRIC_MANAGER, (Finding.unchecked(Check.FABRIC_MANAGER, message),))


@dataclass(frozen=True)
class FabricManagerSettings:
    """Settings of the fabric manager probe."""

    fabric_manager: bool = setting(
        to_bool, True, "judge the fabric manager on NVSwitch systems (not running or not finished: FabricNotReady)"
    )
    fabric_manager_address: str | None = setting(
        optional(host_port),
        None,
        "the fabric manager's command port to connect to each poll, e.g. 127.0.0.1:6666 (host network; unset: off)",
    )
