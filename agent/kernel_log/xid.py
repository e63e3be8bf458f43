"""Kernel-log GPU errors: Xid, NVSwitch SXid and "fallen off the bus" lines, the Xid catalog and the NVLink5
(Xid 144-150) decode table.

Parses message text only; reading /dev/kmsg is source.py's job. The formats, the catalog's sources and the policy
are docs/xid-policy.md.

Every regular expression here is anchored on a literal and has bounded quantifiers, and every line is cut to
MAX_LINE characters before it is matched, so parsing is linear in the input whatever it holds.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources

from agent.model import PciAddress, XidEvent
from agent.settings import setting, to_bool, to_int_list

# printk() cuts a message at 1024 bytes (LOG_LINE_MAX); nothing the driver prints is longer.
MAX_LINE = 1024
# The driver prints the code with %d: at most 10 digits. Longer numbers are not driver records.
_XID_NUM = r"(?P<xid>\d{1,10})(?!\d)"
_ADDR = r"(?P<addr>[0-9A-Fa-f:.]{1,24})"

# Every Xid shape the driver has printed: with or without "PCI:", with " GPU-I:nn"/" GPU-CI:nn" inside
# the parentheses, with or without pid/name, NVLink5 unit and registers in the free text.
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?" + _ADDR + r"(?: [^()]{0,48})?\): " + _XID_NUM)
SXID_RE = re.compile(r"nvidia-nvswitch\d{0,4}: SXid \((?:PCI:)?" + _ADDR + r"\): " + _XID_NUM + r", ")
SXID_SEVERITY_RE = re.compile(r"(Fatal|Non-fatal|Nonfatal)\b")
# NVSwitch SOE (the switch's management micro-controller) lines carry no severity word. The driver prints them
# with NVSWITCH_PRINT_SXID (NVIDIA/open-gpu-kernel-modules src/common/nvswitch/kernel/ls10/soe_ls10.c):
# 26006 "SOE HALTED" (followed by "SOE HALT data[n] = ..." dumps) and 26008 "SOE Watchdog error".
SOE_FATAL = {26006: "SOE HALTED", 26008: "SOE Watchdog error"}
# "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus."
FOB_GPU_RE = re.compile(r"NVRM: GPU " + _ADDR + r": GPU has fallen off the bus")
# "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system has\n
#  NVRM: fallen off the bus and is not responding to commands." (one record or several)
FOB_THE_GPU_RE = re.compile(r"NVRM: The NVIDIA GPU " + _ADDR)
FOB_TAIL = "fallen off the bus and is not responding"
NVLINK5_TOKEN_RE = re.compile(r"\b(Fatal|Nonfatal|Non-fatal)\b")
# After "<xid>, ": "<unit> <Fatal|Nonfatal> XC0 i0 Link 13 (<intrInfo> <errorStatus> ...)"
# (pid/name come first on some drivers: "145, pid=876767, name=ray::WorkerDict, RLW_RXPIPE Nonfatal ...")
NVLINK5_UNIT_RE = re.compile(
    r",\s{0,8}(?:pid=[^,]{0,32},\s{0,8}name=[^,]{0,64},\s{0,8})?(?P<unit>[A-Za-z][A-Za-z0-9_/]{0,63})"
)
NVLINK5_REGS_RE = re.compile(r"\((?P<intr>0x[0-9A-Fa-f]{1,8})\s{1,8}(?P<status>0x[0-9A-Fa-f]{1,8})\b")
ACTION_CODE_RE = re.compile(r"\bto (0x[0-9A-Fa-f]{1,8})\b")
FALLEN_OFF_BUS_XID = 79
# One failure, one fault: an Xid 79 and its "fallen off the bus" companion for the same GPU are one event when
# they are this close (kernel timestamps when both have them, else records fed in between).
BURST_USEC = 10_000_000
BURST_RECORDS = 64
# A storm repeats a few lines thousands of times: the parser keeps what it made of each recent line whose outcome
# depends on the line alone (an Xid other than 79, an SXid, an unparseable Xid line), at most this many lines
# (cut to MAX_LINE characters: bounded memory), and forgets them all when full.
LINE_MEMO = 256
EventFields = tuple[int, PciAddress | None, str, bool, str, str, str, str]  # an XidEvent's fields but seq and usec

# NVLink5 decode table actions that latch. IGNORE does not; XID_154_EVAL means RESTART_APP unless an Xid 154
# says more, and that 154 is judged by itself.
NVLINK5_LATCH_ACTIONS = frozenset({"RESET_GPU"})


@dataclass(frozen=True)
class CatalogEntry:
    xid: int
    name: str
    action: str
    fatal: bool
    decide_by: str
    why: str
    investigatory: str = ""
    exception: str = ""


def load_catalog() -> dict[int, CatalogEntry]:
    text = resources.files("agent").joinpath("data/xid_catalog.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if line and not line.startswith("#"))
    return {
        int(r["xid"]): CatalogEntry(
            int(r["xid"]),
            r["name"],
            r["action"],
            r["fatal"] == "true",
            r["decide_by"],
            r["why"],
            r.get("investigatory") or "",
            r.get("exception") or "",
        )
        for r in rows
    }


@dataclass(frozen=True)
class BitPattern:
    """A 32-character intrInfo pattern from the decode table: '0'/'1' fixed bits, '-' any, MSB first."""

    mask: int
    value: int

    @classmethod
    def parse(cls, text: str) -> BitPattern | None:
        if not text:
            return None
        if len(text) != 32 or set(text) - set("01-"):
            raise ValueError(f"bad intrInfo pattern {text!r}")
        mask = int("".join("0" if c == "-" else "1" for c in text), 2)
        value = int("".join("1" if c == "1" else "0" for c in text), 2)
        return cls(mask, value)

    def matches(self, word: int) -> bool:
        return word & self.mask == self.value


@dataclass(frozen=True)
class Nvlink5Rule:
    xid: int
    units: tuple[str, ...]  # the V1 and V2 spellings of the unit, upper case
    v1: BitPattern
    v2: BitPattern
    status: int | None  # None: any error status
    action: str
    action2_v1: BitPattern | None
    action2_v2: BitPattern | None
    action2: str
    severity: str


def load_nvlink5_table() -> dict[int, list[Nvlink5Rule]]:
    text = resources.files("agent").joinpath("data/nvlink5_decode.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if line and not line.startswith("#"))
    table: dict[int, list[Nvlink5Rule]] = {}
    for r in rows:
        v1, v2 = BitPattern.parse(r["v1_intrinfo"]), BitPattern.parse(r["v2_intrinfo"])
        if v1 is None or v2 is None:
            raise ValueError(f"NVLink5 row without intrInfo patterns: {r}")
        rule = Nvlink5Rule(
            int(r["xid"]),
            tuple(u.strip().upper() for u in r["unit"].split("/")),
            v1,
            v2,
            int(r["error_status"], 16) if r["error_status"] else None,
            r["action"],
            BitPattern.parse(r["action2_v1_intrinfo"]),
            BitPattern.parse(r["action2_v2_intrinfo"]),
            r["action2"],
            r["severity"],
        )
        table.setdefault(rule.xid, []).append(rule)
    return table


@dataclass(frozen=True)
class Nvlink5Record:
    """The decodable parts of an Xid 144-150 record."""

    unit: str | None
    word: str | None  # "Fatal" / "Nonfatal" / "Non-fatal" as printed
    intr: int | None
    status: int | None


def parse_nvlink5(text: str) -> Nvlink5Record:
    """Reads unit, severity word and the first two registers from the text after "<xid>" (bounded input)."""
    m = NVLINK5_UNIT_RE.match(text)
    unit = m["unit"].upper() if m else None
    if unit is not None and unit.startswith(("FATAL", "NONFATAL", "NON-FATAL")):
        unit = None
    w = NVLINK5_TOKEN_RE.search(text)
    r = NVLINK5_REGS_RE.search(text)
    intr = int(r["intr"], 16) if r else None
    status = int(r["status"], 16) if r else None
    return Nvlink5Record(unit, w.group(1) if w else None, intr, status)


def decode_nvlink5(table: dict[int, list[Nvlink5Rule]], xid: int, rec: Nvlink5Record) -> str | None:
    """NVIDIA's immediate action for one NVLink5 record, or None where the decode table has no row.

    A row needs the record's Xid and error status. intrInfo then picks the row by the V1 (<R575) or V2 (>=R575)
    bit pattern (the two never collide: V1 keeps Xid-143 in bits 4:0, V2 the unit in bits 6:0). Where intrInfo
    matches no row, the unit name printed in the record picks the rows, if they agree on one action."""
    if rec.status is None:
        return None
    rows = [r for r in table.get(xid, ()) if r.status is None or r.status == rec.status]
    if rec.intr is not None:
        for r in rows:
            if r.v1.matches(rec.intr) or r.v2.matches(rec.intr):
                return r.action
            if (r.action2_v1 and r.action2_v1.matches(rec.intr)) or (r.action2_v2 and r.action2_v2.matches(rec.intr)):
                return r.action2
    if rec.unit is not None:
        actions = {r.action for r in rows if rec.unit in r.units}
        if len(actions) == 1:
            return actions.pop()
    return None


class XidClassifier:
    """Decides whether an Xid is fatal for the node: config overrides, then the catalog (and, for NVLink5 and
    Xid 154, what the record itself says)."""

    def __init__(
        self,
        fatal: Iterable[int] = (),
        ignore: Iterable[int] = (),
        unknown_fatal: bool = True,
        catalog: dict[int, CatalogEntry] | None = None,
        nvlink5: dict[int, list[Nvlink5Rule]] | None = None,
    ) -> None:
        self.catalog = catalog if catalog is not None else load_catalog()
        self.nvlink5 = nvlink5 if nvlink5 is not None else load_nvlink5_table()
        self.fatal = frozenset(fatal)
        self.ignore = frozenset(ignore)
        self.unknown_fatal = unknown_fatal
        both = self.fatal & self.ignore
        if both:
            raise ValueError(f"Xids {sorted(both)} are in both the fatal and the ignore list")

    def classify(self, xid: int, text: str) -> tuple[bool, str, str]:
        """Returns (fatal, name, action). `text` is the record after the Xid number (or the whole line)."""
        entry = self.catalog.get(xid)
        name = entry.name if entry else "UNKNOWN_XID"
        action = entry.action if entry else "CONTACT_SUPPORT"
        if xid in self.ignore:
            return False, name, "IGNORED_BY_CONFIG"
        if xid in self.fatal:
            return True, name, action
        if entry is None:
            return self.unknown_fatal, name, action
        if entry.decide_by == "nvlink5":
            rec = parse_nvlink5(text)
            decoded = decode_nvlink5(self.nvlink5, xid, rec)
            if decoded is not None:
                return decoded in NVLINK5_LATCH_ACTIONS, name, decoded
            if rec.word is not None:  # no row in the table: the record's own word decides
                return rec.word == "Fatal", name, "RESET_GPU" if rec.word == "Fatal" else "IGNORE"
            return entry.fatal, name, action
        if entry.decide_by == "action_code":
            m = ACTION_CODE_RE.search(text)
            if m:
                code = int(m.group(1), 16)
                return code != 0, name, f"RECOVERY_ACTION_0x{code:x}"
            return entry.fatal, name, action  # unreadable action: do not assume it is harmless
        return entry.fatal, name, action


class KernelLogParser:
    """Turns kernel-log message texts into XidEvents. Keeps a little state so that a fallen-off-the-bus message
    split over several records is still recognised, and so that an Xid 79 and its fallen-off-the-bus companion
    for the same GPU in one burst are one event."""

    def __init__(self, classifier: XidClassifier | None = None) -> None:
        self.classifier = classifier or XidClassifier()
        self._pending_fob: tuple[str, int] | None = None  # (address, records left to see the tail)
        self._records = 0
        self._off_bus: dict[PciAddress, tuple[int, int | None, str]] = {}  # GPU -> (record number, usec, kind)
        self._memo: dict[str, EventFields | None] = {}  # line -> its event (None: no event); see LINE_MEMO

    def feed(self, text: str, seq: int | None = None, usec: int | None = None) -> list[XidEvent]:
        self._records += 1
        # Fast path: almost every kernel record is unrelated to GPUs.
        if "NVRM" not in text and "SXid" not in text and FOB_TAIL not in text:
            self._age_pending()
            return []
        if (fields := self._memo.get(text)) is not None:  # a repeated line (one line, not cut: what _feed_line gets)
            return [XidEvent(*fields, seq, usec)]
        if "\n" not in text:
            ev = self._feed_line(text[:MAX_LINE], seq, usec)
            return [] if ev is None else [ev]
        events: list[XidEvent] = []
        for line in text.split("\n"):
            ev = self._feed_line(line[:MAX_LINE], seq, usec)
            if ev is not None:
                events.append(ev)
        return events

    def _age_pending(self) -> None:
        if self._pending_fob is not None:
            addr, left = self._pending_fob
            self._pending_fob = (addr, left - 1) if left > 1 else None

    def _feed_line(self, line: str, seq: int | None, usec: int | None) -> XidEvent | None:
        memo = self._memo
        if line in memo:
            fields = memo[line]
            return None if fields is None else XidEvent(*fields, seq, usec)
        m = XID_RE.search(line)
        if m:
            xid = int(m["xid"])
            fatal, name, action = self.classifier.classify(xid, line[m.end() :])
            raw = m["addr"]
            addr = PciAddress.parse(raw)
            if xid == FALLEN_OFF_BUS_XID:  # paired with its fallen-off-the-bus companion: not memoised
                if not self._first_of_burst(addr, usec, "xid"):
                    return None
                return XidEvent(xid, addr, raw, fatal, line.strip(), "xid", name, action, seq, usec)
            return self._remember(line, (xid, addr, raw, fatal, line.strip(), "xid", name, action), seq, usec)
        m = SXID_RE.search(line)
        if m:
            return self._remember(line, self._sxid(m, line), seq, usec)
        if "Xid" in line:
            return self._remember(line, None, seq, usec)  # an unparseable Xid line (e.g. an absurd number)
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
            raw = self._pending_fob[0]
            return self._fallen_off_bus(raw, f"NVRM: The NVIDIA GPU {raw} ... {line.strip()}", seq, usec)
        self._age_pending()
        return None

    def _remember(
        self,
        line: str,
        fields: EventFields | None,
        seq: int | None,
        usec: int | None,
    ) -> XidEvent | None:
        """The event of a line whose outcome depends on the line alone (None: no event), kept for its repeats."""
        if len(self._memo) >= LINE_MEMO:
            self._memo.clear()
        self._memo[line] = fields
        return None if fields is None else XidEvent(*fields, seq, usec)

    @staticmethod
    def _sxid(m: re.Match[str], line: str) -> EventFields | None:
        """An SXid record's event fields (all but seq and usec), or None for a continuation record."""
        sxid = int(m["xid"])
        rest = line[m.end() :]
        sev = SXID_SEVERITY_RE.match(rest)
        if sev is not None:
            fatal = sev.group(1) == "Fatal"
            action = "RESET_NVSWITCH" if fatal else "IGNORE"
            return (sxid, None, m["addr"], fatal, line.strip(), "sxid", "NVSWITCH_SXID", action)
        soe = SOE_FATAL.get(sxid)
        if soe is not None and rest.startswith(soe):
            # No severity word; judged fatal: see docs/xid-policy.md "NVSwitch SOE".
            return (sxid, None, m["addr"], True, line.strip(), "sxid", "NVSWITCH_SOE", "RESET_NVSWITCH")
        return None  # continuation record ("Severity 1 ...", "Data {...}", "SOE HALT data[0] = ...")

    def _first_of_burst(self, addr: PciAddress | None, usec: int | None, source: str) -> bool:
        """False when this record is the companion of the other kind (an Xid 79 and a fallen-off-the-bus message)
        for the same GPU in the current burst: the pair is one failure. Two records of the same kind stay two
        events (the latch keeps one fault; a repeat after an operator's clear is a new one)."""
        if addr is None:
            return True
        prev = self._off_bus.get(addr)
        if prev is not None:
            n, t, kind = prev
            close = (
                abs(usec - t) <= BURST_USEC
                if usec is not None and t is not None
                else self._records - n <= BURST_RECORDS
            )
            if close and kind != source:
                del self._off_bus[addr]  # the pair is complete: a later record starts a new one
                return False
        if len(self._off_bus) >= 256:  # bounded whatever the input: forget bursts that are over
            self._off_bus.clear()
        self._off_bus[addr] = (self._records, usec, source)
        return True

    def _fallen_off_bus(self, raw: str, line: str, seq: int | None, usec: int | None) -> XidEvent | None:
        self._pending_fob = None
        addr = PciAddress.parse(raw)
        if not self._first_of_burst(addr, usec, "fallen_off_bus"):
            return None
        fatal, name, action = self.classifier.classify(FALLEN_OFF_BUS_XID, line)
        return XidEvent(FALLEN_OFF_BUS_XID, addr, raw, fatal, line.strip(), "fallen_off_bus", name, action, seq, usec)


@dataclass(frozen=True)
class XidSettings:
    """Settings of the Xid classification."""

    xid_fatal: tuple[int, ...] = setting(to_int_list, (), "Xids fatal in addition to the catalog's (comma list)")
    xid_ignore: tuple[int, ...] = setting(to_int_list, (), "Xids never fatal (comma list)")
    unknown_xid_fatal: bool = setting(to_bool, True, "treat Xids missing from the catalog as fatal")
