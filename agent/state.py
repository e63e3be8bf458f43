"""Latched faults on disk, keyed by boot ID, written atomically.

A fatal Xid keeps the node not ready until the boot ID changes (a reboot) or an operator clears it
with the `gpu-ready.io/clear-before=<RFC 3339>` annotation. `cleared_seq` remembers how far the kernel
log had been read when a clear was applied, so replaying the ring buffer after an agent restart does
not latch a cleared fault again. A corrupt file is moved aside (kept for inspection) and replaced."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agent.model import LatchedFault, PciAddress, XidEvent

STATE_VERSION = 1


def read_boot_id(path: str) -> str:
    try:
        return Path(path).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


class LatchState:
    def __init__(self, state_dir: str, boot_id: str) -> None:
        self.path = Path(state_dir) / "state.json"
        self.boot_id = boot_id
        self.faults: dict[str, LatchedFault] = {}
        self.cleared_before: float = 0.0
        self.cleared_seq: int = -1
        self.load_problem: str | None = None  # what went wrong reading the file, for logs/metrics
        self.write_problem: str | None = None
        self._known: set[tuple[bool, int, object]] = set()  # quick keys of latched faults
        self._lock = threading.Lock()

    # -- persistence ----------------------------------------------------------------------------------

    def load(self) -> str:
        """Loads the file; returns what happened ("new", "loaded", "boot_changed", "corrupt")."""
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return "new"
        except OSError as e:
            self.load_problem = f"cannot read {self.path}: {e.strerror}"
            return "corrupt"
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError("unknown layout")
            if data.get("boot_id") != self.boot_id:
                self.save()
                return "boot_changed"
            faults = {}
            for f in data.get("faults", []):
                gpu = PciAddress.parse(f["gpu"]) if f.get("gpu") else None
                lf = LatchedFault(
                    int(f["xid"]), str(f["raw_address"]), gpu, str(f["source"]), str(f["text"]), float(f["since"])
                )
                faults[lf.key] = lf
            self.faults = faults
            self.cleared_before = float(data.get("cleared_before", 0.0))
            self.cleared_seq = int(data.get("cleared_seq", -1))
            return "loaded"
        except (ValueError, KeyError, TypeError) as e:
            aside = self.path.with_name(f"state.json.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError:
                aside = self.path
            self.load_problem = f"corrupt state file ({e}); moved to {aside.name} and started fresh"
            self.save()
            return "corrupt"

    def save(self) -> bool:
        with self._lock:
            data: dict[str, Any] = {
                "version": STATE_VERSION,
                "boot_id": self.boot_id,
                "cleared_before": self.cleared_before,
                "cleared_seq": self.cleared_seq,
                "faults": [{**asdict(f), "gpu": f.gpu.nvml if f.gpu else None} for f in self.faults.values()],
            }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".state.json.{os.getpid()}.tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            self.write_problem = None
            return True
        except OSError as e:
            self.write_problem = f"cannot write {self.path}: {e.strerror}"
            return False

    # -- changes ------------------------------------------------------------------------------------

    def latch(self, ev: XidEvent, now: float) -> LatchedFault | None:
        """Latches a fatal event; returns the new fault, or None if already latched or cleared."""
        if not ev.fatal:
            return None
        if ev.seq is not None and ev.seq <= self.cleared_seq:
            return None  # read before an operator's clear: replayed from the ring buffer
        quick = (ev.source == "sxid" or ev.address is None, ev.xid, ev.address or ev.raw_address)
        if quick in self._known:
            return None  # a storm repeats the same fault: no allocation, no key formatting
        lf = LatchedFault(ev.xid, ev.raw_address, ev.address, ev.source, ev.text[:300], now)
        with self._lock:
            self._known.add(quick)
            if lf.key in self.faults:
                return None
            self.faults[lf.key] = lf
        self.save()
        return lf

    def clear_before(self, before: float, read_seq: int | None) -> list[LatchedFault]:
        """Applies an operator clear: drops every fault first seen before `before`."""
        if before <= self.cleared_before:
            return []
        with self._lock:
            gone = [f for f in self.faults.values() if f.since < before]
            for f in gone:
                del self.faults[f.key]
            self._known.clear()
            self.cleared_before = before
            if read_seq is not None:
                self.cleared_seq = max(self.cleared_seq, read_seq)
        self.save()
        return gone

    def new_boot(self, boot_id: str) -> int:
        with self._lock:
            n = len(self.faults)
            self.boot_id = boot_id
            self.faults = {}
            self._known.clear()
            self.cleared_before = 0.0
            self.cleared_seq = -1
        self.save()
        return n

    def snapshot(self) -> list[LatchedFault]:
        with self._lock:
            return list(self.faults.values())
