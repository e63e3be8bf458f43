"""Latched faults on disk, keyed by boot ID, written atomically.

A fatal Xid keeps the node not ready until the boot ID changes (a reboot) or an operator clears it
with the `gpu-ready.io/clear-before=<RFC 3339>` annotation. `cleared_seq` remembers how far the kernel
log had been read when a clear was applied, so replaying the ring buffer after an agent restart does
not latch a cleared fault again; `rejected_clears` remembers clear values refused in this boot (dated
in the future when seen) so that they never apply later in the same boot. A corrupt file is moved
aside (kept for inspection) and replaced.

Writes are serialised by one lock; each goes to its own temporary file, is fsynced, renamed over the
state file and the directory is fsynced. A failed write is logged once per distinct problem, counted
through `on_write_failure`, kept in `write_problem` (shown on /healthz) and retried by `retry()`."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agent.logs import get_logger
from agent.model import LatchedFault, PciAddress, XidEvent
from agent.recovery import STEPS, GpuRecovery, Step
from agent.settings import read_text_file

STATE_VERSION = 1
STATE_FILE_LIMIT = 16 << 20  # bytes; a node's latched faults are a few KiB
MAX_NVLINK_GPUS = 1024  # GPUs whose links seen up are kept
MAX_NVLINKS_PER_GPU = 64


def read_boot_id(path: str) -> str:
    """The boot ID; "unknown" when it cannot be read, and for anything but a regular file (a FIFO would block
    the loop, a device never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return "unknown"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "unknown"
        return os.read(fd, 128).decode("utf-8", "replace").strip() or "unknown"
    except OSError:
        return "unknown"
    finally:
        os.close(fd)


def read_boot_time(stat_path: str = "/proc/stat") -> float | None:
    """When this boot started (Unix seconds), from the kernel's `btime`; None when unknown."""
    try:
        with open(stat_path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class LatchState:
    def __init__(self, state_dir: str, boot_id: str, on_write_failure: Callable[[str], None] | None = None) -> None:
        self.path = Path(state_dir) / "state.json"
        self.boot_id = boot_id
        self.faults: dict[str, LatchedFault] = {}
        self.cleared_before: float = 0.0
        self.cleared_seq: int = -1
        self.rejected_clears: set[str] = set()
        # Per-GPU recovery (agent/recovery.py): the ladders in progress (dropped with the boot's faults), the resets
        # of the retry budget (kept across boots), and how far the kernel log had been read when a GPU's own latch
        # was cleared by a proven reset (a replay of the ring buffer does not latch it again).
        self.recovery: dict[str, GpuRecovery] = {}
        self.resets: dict[str, tuple[float, ...]] = {}
        self.gpu_cleared_seq: dict[str, int] = {}
        # The NVLinks seen up in this boot, per GPU bus id (probes/nvml.py judges a link down only when something
        # says it should be up; one seen up earlier in the boot does): dropped with the boot.
        self.nvlink_up: dict[str, frozenset[int]] = {}
        self.gpu_records: dict[PciAddress, int] = {}  # in memory: the newest kernel-log record (seq) naming each GPU
        self.load_problem: str | None = None  # what went wrong reading the file, for logs/metrics
        self.write_problem: str | None = None  # the last write's failure; None once a write succeeds
        self.write_failures = 0
        self.dirty = False  # the file is behind the memory (a write failed)
        self.on_write_failure = on_write_failure
        self._known: set[tuple[bool, int, object]] = set()  # quick keys of latched faults
        self._lock = threading.Lock()  # the in-memory state
        self._write_lock = threading.Lock()  # one writer at a time; the newest snapshot wins
        self.log = get_logger(path=str(self.path))

    # -- persistence ----------------------------------------------------------------------------------

    def load(self) -> str:
        """Loads the file; returns what happened ("new", "loaded", "boot_changed", "corrupt"). Temporary files a
        crash left behind are removed first, and the state is written back at once, so that a state dir that
        cannot be written is known (`write_problem`) before the first verdict, not only at the first latch."""
        self._remove_stale_temp_files()
        try:
            raw = read_text_file(str(self.path), STATE_FILE_LIMIT)  # a FIFO or a device is refused, never waited on
        except (FileNotFoundError, NotADirectoryError):  # nothing there (a file where the dir should be)
            self.save()
            return "new"
        except (OSError, UnicodeDecodeError, ValueError) as e:
            self.load_problem = f"cannot read {self.path}: {getattr(e, 'strerror', None) or e}"
            return "corrupt"
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError("unknown layout")
            if data.get("boot_id") != self.boot_id:
                with self._lock:
                    self.resets = _resets(data.get("resets"))  # the retry budget outlives a reboot
                self.save()
                return "boot_changed"
            faults = {}
            for f in data.get("faults", []):
                gpu = PciAddress.parse(f["gpu"]) if f.get("gpu") else None
                lf = LatchedFault(
                    int(f["xid"]),
                    str(f["raw_address"]),
                    gpu,
                    str(f["source"]),
                    str(f["text"]),
                    float(f["since"]),
                    str(f.get("action") or ""),
                )
                faults[lf.key] = lf
            with self._lock:
                self.faults = faults
                self.cleared_before = float(data.get("cleared_before", 0.0))
                self.cleared_seq = int(data.get("cleared_seq", -1))
                self.rejected_clears = {str(x) for x in data.get("rejected_clears", [])}
                self.recovery = _ladders(data.get("recovery"))
                self.resets = _resets(data.get("resets"))
                self.gpu_cleared_seq = {str(k): int(v) for k, v in (data.get("gpu_cleared_seq") or {}).items()}
                self.nvlink_up = _links(data.get("nvlink_up"))
            self.save()  # the same content: proves the dir writable before the first verdict
            return "loaded"
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            aside = self.path.with_name(f"state.json.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError:
                aside = self.path
            self.load_problem = f"corrupt state file ({e}); moved to {aside.name} and started fresh"
            self.save()
            return "corrupt"

    def _remove_stale_temp_files(self) -> None:
        """Removes `.state.json.*.tmp` files (save()'s own naming) that a crash between the write and the
        rename left behind; they are never read (the rename is what makes a state current)."""
        with self._write_lock:
            try:
                stale = list(self.path.parent.glob(f".{self.path.name}.*.tmp"))
            except OSError:
                return
            for p in stale:
                try:
                    p.unlink()
                except OSError:
                    pass
                else:
                    self.log.info("removed a temporary state file left by an earlier crash", file=p.name)

    def _snapshot_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": STATE_VERSION,
                "boot_id": self.boot_id,
                "cleared_before": self.cleared_before,
                "cleared_seq": self.cleared_seq,
                "rejected_clears": sorted(self.rejected_clears),
                "faults": [{**asdict(f), "gpu": f.gpu.nvml if f.gpu else None} for f in self.faults.values()],
                "recovery": [asdict(r) for r in self.recovery.values()],
                "resets": {k: list(v) for k, v in self.resets.items() if v},
                "gpu_cleared_seq": dict(self.gpu_cleared_seq),
                "nvlink_up": {k: sorted(v) for k, v in self.nvlink_up.items()},
            }

    def save(self) -> bool:
        """Writes the current state; returns whether it reached the disk."""
        with self._write_lock:
            data = self._snapshot_json()  # taken under the write lock: a later writer writes a later state
            tmp: str | None = None
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".state.json.", suffix=".tmp", dir=self.path.parent)
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(data, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
                tmp = None
                _fsync_dir(self.path.parent)
            except OSError as e:
                if tmp is not None:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                self._write_failed(f"cannot write {self.path}: {e.strerror or e}")
                return False
            if self.write_problem is not None:
                self.log.info("state file written again", previous=self.write_problem)
            self.write_problem, self.dirty = None, False
            return True

    def _write_failed(self, problem: str) -> None:
        self.write_failures += 1
        self.dirty = True
        if problem != self.write_problem:
            self.log.error("latched faults cannot be saved; they are kept in memory only", problem=problem)
        self.write_problem = problem
        if self.on_write_failure is not None:
            self.on_write_failure(problem)

    def retry(self) -> bool:
        """Writes again if an earlier write failed; returns whether the file is up to date."""
        return self.save() if self.dirty else True

    # -- changes ------------------------------------------------------------------------------------

    def latch(self, ev: XidEvent, now: float) -> LatchedFault | None:
        """Latches a fatal event; returns the new fault, or None if already latched or cleared."""
        if not ev.fatal:
            return None
        if ev.seq is not None and ev.seq <= self.cleared_seq:
            return None  # read before an operator's clear: replayed from the ring buffer
        if ev.seq is not None and ev.address is not None and ev.seq <= self.gpu_cleared_seq.get(ev.address.nvml, -1):
            return None  # read before this GPU's proven reset cleared it: replayed from the ring buffer
        quick = (ev.source == "sxid" or ev.address is None, ev.xid, ev.address or ev.raw_address)
        if quick in self._known:
            return None  # a storm repeats the same fault: no allocation, no key formatting
        lf = LatchedFault(ev.xid, ev.raw_address, ev.address, ev.source, ev.text[:300], now, ev.action)
        with self._lock:
            self._known.add(quick)
            if lf.key in self.faults:
                return None
            self.faults[lf.key] = lf
        self.save()
        return lf

    def clear_before(self, before: float, read_seq: int | None) -> list[LatchedFault]:
        """Applies an operator clear: drops every fault first seen before `before`."""
        with self._lock:
            if before <= self.cleared_before:
                return []
            gone = [f for f in self.faults.values() if f.since < before]
            for f in gone:
                del self.faults[f.key]
            self._known.clear()
            self.cleared_before = before
            if read_seq is not None:
                self.cleared_seq = max(self.cleared_seq, read_seq)
        self.save()
        return gone

    def reject_clear(self, value: str) -> bool:
        """Remembers a clear value refused in this boot; returns whether it is new."""
        with self._lock:
            if value in self.rejected_clears or len(self.rejected_clears) >= 64:
                return False
            self.rejected_clears.add(value)
        self.save()
        return True

    def new_boot(self, boot_id: str) -> int:
        with self._lock:
            n = len(self.faults)
            self.boot_id = boot_id
            self.faults = {}
            self._known.clear()
            self.cleared_before = 0.0
            self.cleared_seq = -1
            self.rejected_clears = set()
            self.recovery = {}  # the ladders were about this boot's faults; the budget's resets stay
            self.gpu_cleared_seq = {}
            self.nvlink_up = {}  # the links of the previous boot say nothing about this one
        self.save()
        return n

    def snapshot(self) -> list[LatchedFault]:
        with self._lock:
            return list(self.faults.values())

    # -- NVLinks seen up in this boot (probes/nvml.py) ------------------------------------------------

    def nvlinks_seen_up(self, gpu: str) -> frozenset[int]:
        with self._lock:
            return self.nvlink_up.get(gpu, frozenset())

    def note_nvlinks_up(self, gpu: str, links: Collection[int]) -> None:
        """Links of `gpu` seen up now; written when they add to what the file holds."""
        with self._lock:
            before = self.nvlink_up.get(gpu, frozenset())
            after = before | frozenset(int(x) for x in links)
            if after == before or (gpu not in self.nvlink_up and len(self.nvlink_up) >= MAX_NVLINK_GPUS):
                return
            self.nvlink_up[gpu] = after
        self.save()

    # -- per-GPU recovery -------------------------------------------------------------------------------

    def note_gpu_record(self, gpu: PciAddress, seq: int) -> None:
        """A kernel-log record named this GPU (any Xid, fatal or not): the proof wants the log quiet for it."""
        if seq > self.gpu_records.get(gpu, -1):
            self.gpu_records[gpu] = seq

    def set_ladder(self, rec: GpuRecovery | None, gpu: str, *, reset_at: float | None = None) -> bool:
        """Stores one GPU's ladder (None drops it) and, with `reset_at`, counts a reset in its budget, in one write
        (a reset is counted before it starts). Returns whether it reached the disk."""
        with self._lock:
            if rec is None:
                self.recovery.pop(gpu, None)
            else:
                self.recovery[gpu] = rec
            if reset_at is not None:
                self.resets[gpu] = (*self.resets.get(gpu, ())[-63:], reset_at)
        return self.save()

    def prune_resets(self, keep: Callable[[tuple[float, ...]], tuple[float, ...]]) -> None:
        with self._lock:
            self.resets = {k: v for k, v in ((k, keep(v)) for k, v in self.resets.items()) if v}

    def clear_gpu(self, gpu: PciAddress, read_seq: int | None) -> list[LatchedFault]:
        """A proven reset: drops this GPU's latched faults only (every other fault stays)."""
        with self._lock:
            gone = [f for f in self.faults.values() if f.gpu == gpu and f.source != "sxid"]
            for f in gone:
                del self.faults[f.key]
            self._known = {k for k in self._known if k[2] != gpu}
            if read_seq is not None:
                self.gpu_cleared_seq[gpu.nvml] = max(self.gpu_cleared_seq.get(gpu.nvml, -1), read_seq)
        self.save()
        return gone

    def ladders(self) -> dict[str, GpuRecovery]:
        with self._lock:
            return dict(self.recovery)


def _ladders(raw: Any) -> dict[str, GpuRecovery]:
    out: dict[str, GpuRecovery] = {}
    for r in (raw or [])[:1024]:
        step = Step(str(r["step"]))
        if step not in STEPS:
            raise ValueError(f"unknown recovery step {step}")
        rec = GpuRecovery(
            gpu=str(r["gpu"]),
            step=step,
            since=float(r["since"]),
            step_since=float(r["step_since"]),
            faults=tuple(str(x) for x in r.get("faults") or ()),
            reset_started=None if r.get("reset_started") is None else float(r["reset_started"]),
            reset_done=None if r.get("reset_done") is None else float(r["reset_done"]),
            reset_seq=int(r.get("reset_seq", -1)),
            why=str(r.get("why") or "")[:300],
            evicted=bool(r.get("evicted")),
        )
        out[rec.gpu] = rec
    return out


def _links(raw: Any) -> dict[str, frozenset[int]]:
    if not isinstance(raw, dict):
        return {}
    return {
        str(k)[:64]: frozenset(int(x) for x in v[:MAX_NVLINKS_PER_GPU])
        for k, v in list(raw.items())[:MAX_NVLINK_GPUS]
        if isinstance(v, list)
    }


def _resets(raw: Any) -> dict[str, tuple[float, ...]]:
    if not isinstance(raw, dict):
        return {}
    return {str(k): tuple(float(t) for t in v)[-64:] for k, v in list(raw.items())[:1024] if isinstance(v, list)}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
