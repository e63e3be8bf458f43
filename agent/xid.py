"""Kernel-log GPU errors: Xid, NVSwitch SXid and "fallen off the bus" lines, and the Xid catalog.

Parses message text only; reading /dev/kmsg is probes/kmsg.py's job. Formats and sources:
shared/reference/gpu-signals.md section 2.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources

from agent.model import PciAddress, XidEvent

# Every Xid shape the driver has printed: with or without "PCI:", with " GPU-I:nn"/" GPU-CI:nn" inside
# the parentheses, with or without pid/name, NVLink5 subcodes in the free text.
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<addr>[0-9A-Fa-f:.]+)[^)]*\): (?P<xid>\d+)")
SXID_RE = re.compile(
    r"nvidia-nvswitch\d*: SXid \((?:PCI:)?(?P<addr>[0-9A-Fa-f:.]+)\): (?P<xid>\d+), (?P<sev>[A-Za-z-]+)"
)
# "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus."
FOB_GPU_RE = re.compile(r"NVRM: GPU (?P<addr>[0-9A-Fa-f:.]+): GPU has fallen off the bus")
# "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system has\n
#  NVRM: fallen off the bus and is not responding to commands." (one record or several)
FOB_THE_GPU_RE = re.compile(r"NVRM: The NVIDIA GPU (?P<addr>[0-9A-Fa-f:.]+)")
FOB_TAIL = "fallen off the bus and is not responding"
NVLINK5_TOKEN_RE = re.compile(r"\b(Fatal|Nonfatal|Non-fatal)\b")
ACTION_CODE_RE = re.compile(r"\bto (0x[0-9A-Fa-f]+)")
FALLEN_OFF_BUS_XID = 79


@dataclass(frozen=True)
class CatalogEntry:
    xid: int
    name: str
    action: str
    fatal: bool
    decide_by: str
    why: str


def load_catalog() -> dict[int, CatalogEntry]:
    text = resources.files("agent").joinpath("data/xid_catalog.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if line and not line.startswith("#"))
    return {
        int(r["xid"]): CatalogEntry(
            int(r["xid"]), r["name"], r["action"], r["fatal"] == "true", r["decide_by"], r["why"]
        )
        for r in rows
    }


class XidClassifier:
    """Decides whether an Xid is fatal for the node: config overrides, then the catalog."""

    def __init__(
        self,
        fatal: Iterable[int] = (),
        ignore: Iterable[int] = (),
        unknown_fatal: bool = True,
        catalog: dict[int, CatalogEntry] | None = None,
    ) -> None:
        self.catalog = catalog if catalog is not None else load_catalog()
        self.fatal = frozenset(fatal)
        self.ignore = frozenset(ignore)
        self.unknown_fatal = unknown_fatal
        both = self.fatal & self.ignore
        if both:
            raise ValueError(f"Xids {sorted(both)} are in both the fatal and the ignore list")

    def classify(self, xid: int, text: str) -> tuple[bool, str, str]:
        """Returns (fatal, name, action)."""
        entry = self.catalog.get(xid)
        name = entry.name if entry else "UNKNOWN_XID"
        action = entry.action if entry else "CONTACT_SUPPORT"
        if xid in self.ignore:
            return False, name, "IGNORED_BY_CONFIG"
        if xid in self.fatal:
            return True, name, action
        if entry is None:
            return self.unknown_fatal, name, action
        if entry.decide_by == "token":
            m = NVLINK5_TOKEN_RE.search(text)
            if m:
                return m.group(1) == "Fatal", name, action
        elif entry.decide_by == "action_code":
            m = ACTION_CODE_RE.search(text)
            if m:
                code = int(m.group(1), 16)
                return code != 0, name, f"RECOVERY_ACTION_0x{code:x}"
            return True, name, action  # unreadable action: do not assume it is harmless
        return entry.fatal, name, action


class KernelLogParser:
    """Turns kernel-log message texts into XidEvents. Keeps a little state so that a
    fallen-off-the-bus message split over several records is still recognised."""

    def __init__(self, classifier: XidClassifier | None = None) -> None:
        self.classifier = classifier or XidClassifier()
        self._pending_fob: tuple[str, int] | None = None  # (address, records left to see the tail)

    def feed(self, text: str, seq: int | None = None, usec: int | None = None) -> list[XidEvent]:
        # Fast path: almost every kernel record is unrelated to GPUs.
        if "NVRM" not in text and "SXid" not in text and FOB_TAIL not in text:
            self._age_pending()
            return []
        if "\n" not in text:
            ev = self._feed_line(text, seq, usec)
            return [] if ev is None else [ev]
        events: list[XidEvent] = []
        for line in text.split("\n"):
            ev = self._feed_line(line, seq, usec)
            if ev is not None:
                events.append(ev)
        return events

    def _age_pending(self) -> None:
        if self._pending_fob is not None:
            addr, left = self._pending_fob
            self._pending_fob = (addr, left - 1) if left > 1 else None

    def _feed_line(self, line: str, seq: int | None, usec: int | None) -> XidEvent | None:
        m = XID_RE.search(line)
        if m:
            xid = int(m["xid"])
            fatal, name, action = self.classifier.classify(xid, line)
            raw = m["addr"]
            return XidEvent(xid, PciAddress.parse(raw), raw, fatal, line.strip(), "xid", name, action, seq, usec)
        m = SXID_RE.search(line)
        if m:
            sev = m["sev"]
            if sev not in ("Fatal", "Non-fatal", "Nonfatal"):
                return None  # continuation record ("Severity 1 ...", "Data {...}")
            sxid = int(m["xid"])
            return XidEvent(
                sxid,
                None,
                m["addr"],
                sev == "Fatal",
                line.strip(),
                "sxid",
                "NVSWITCH_SXID",
                "RESTART_BM" if sev == "Fatal" else "IGNORE",
                seq,
                usec,
            )
        if "Xid" in line:
            return None  # the Xid line itself carries the event; do not count it twice
        m = FOB_GPU_RE.search(line)
        if m:
            return self._fallen_off_bus(m["addr"], line, seq, usec)
        m = FOB_THE_GPU_RE.search(line)
        if m:
            self._pending_fob = (m["addr"], 4)
            if FOB_TAIL in line:
                return self._fallen_off_bus(m["addr"], line, seq, usec)
            return None
        if FOB_TAIL in line and self._pending_fob is not None:
            addr = self._pending_fob[0]
            return self._fallen_off_bus(addr, f"NVRM: The NVIDIA GPU {addr} ... {line.strip()}", seq, usec)
        self._age_pending()
        return None

    def _fallen_off_bus(self, raw: str, line: str, seq: int | None, usec: int | None) -> XidEvent:
        self._pending_fob = None
        fatal, name, action = self.classifier.classify(FALLEN_OFF_BUS_XID, line)
        return XidEvent(
            FALLEN_OFF_BUS_XID,
            PciAddress.parse(raw),
            raw,
            fatal,
            line.strip(),
            "fallen_off_bus",
            name,
            action,
            seq,
            usec,
        )
