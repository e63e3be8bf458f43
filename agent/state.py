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

from agent.act.recovery.ladder import STEPS, GpuRecovery, Step
from agent.logs import get_logger
from agent.model import LatchedFault, PciAddress, XidEvent
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
        # Per-GPU recovery (act/recovery/ladder.py): the ladders in progress (dropped with the boot's faults), resets
        # of the retry budget (kept across boots), and how far the kernel log had been read when a GPU's own latch
        # was cleared by a proven reset (a replay of the ring buffer does not latch it again).
        self.recovery: dict[str, GpuRecovery] = {}
        self.legacy_resets: dict[str, tuple[float, ...]] = {}  # an older state file's budget (kept in the file)
        self.journal = ResetJournal(Path(state_dir) / "resets", boot_id)
        self.gpu_cleared_seq: dict[str, int] = {}
        # The NVLinks seen up in this boot, per GPU bus id (probes/nvml.py judges a link down only when something
        # says it should be up; one seen up earlier in the boot does): dropped with the boot.
        self.nvlink_up: dict[str, frozenset[int]] = {}
        self.gpu_records: dict[PciAddress, int] = {}  # in memory: the newest kernel-log record (seq) naming each GPU
        self.reset_unavailable = ""  # this boot's platform cannot reset one GPU alone (why); "" not known so
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
                    self.legacy_resets = _resets(data.get("resets"))  # the retry budget outlives a reboot
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
                self.legacy_resets = _resets(data.get("resets"))
                self.gpu_cleared_seq = {str(k): int(v) for k, v in (data.get("gpu_cleared_seq") or {}).items()}
                self.nvlink_up = _links(data.get("nvlink_up"))
                self.reset_unavailable = str(data.get("reset_unavailable") or "")[:300]
            self.save()  # the same content: proves the dir writable before the first verdict
            return "loaded"
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            aside = self.path.with_name(f"state.json.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError:
                aside = self.path
            self.load_problem = (
                f"corrupt state file ({e}); moved to {aside.name}: latched faults and ladders lost (the reset "
                "journal still holds the retry budget and any reset in flight)"
            )
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
                "resets": {k: list(v) for k, v in self.legacy_resets.items() if v},
                "gpu_cleared_seq": dict(self.gpu_cleared_seq),
                "nvlink_up": {k: sorted(v) for k, v in self.nvlink_up.items()},
                "reset_unavailable": self.reset_unavailable,
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
            self.journal.boot = _boot_tag(boot_id)
            self.faults = {}
            self._known.clear()
            self.cleared_before = 0.0
            self.cleared_seq = -1
            self.rejected_clears = set()
            self.recovery = {}  # the ladders were about this boot's faults; the budget's resets stay
            self.gpu_cleared_seq = {}
            self.nvlink_up = {}  # the links of the previous boot say nothing about this one
            self.reset_unavailable = ""  # a platform fact of the boot that ended
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
        """Stores one GPU's ladder (None drops it) and, with `reset_at`, counts a reset in its budget first (in the
        reset journal, durable before the reset starts). Returns whether it reached the disk; with `reset_at`, False
        when the journal could not record it (the reset must not start then)."""
        if reset_at is not None and not self.journal.begin(gpu, reset_at):
            self._write_failed(self.journal.problem or "cannot record a GPU reset")
            return False
        with self._lock:
            if rec is None:
                self.recovery.pop(gpu, None)
            else:
                self.recovery[gpu] = rec
        return self.save() or reset_at is not None

    @property
    def resets(self) -> dict[str, tuple[float, ...]]:
        """Per GPU (the NVML bus id): the resets that count in its budget (the journal's, and an older state
        file's)."""
        tags = {ResetJournal._gpu_tag(g): g for g in (*self.recovery, *self.legacy_resets)}
        out = {g: tuple(v) for g, v in self.legacy_resets.items()}
        for tag, times in self.journal.counted().items():
            g = tags.get(tag) or _gpu_of_tag(tag)
            out[g] = tuple(sorted({*out.get(g, ()), *times}))[-64:]
        return out

    def settle_reset(self, gpu: str, t: float, charged: bool) -> None:
        """The outcome of the reset started at `t`: charged (counts in the budget) or given back."""
        self.journal.settle(gpu, t, "charged" if charged else "free")

    def prune_resets(self, keep: Callable[[tuple[float, ...]], tuple[float, ...]], window_start: float) -> None:
        with self._lock:
            self.legacy_resets = {k: v for k, v in ((k, keep(v)) for k, v in self.legacy_resets.items()) if v}
        self.journal.prune(window_start)

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


class ResetJournal:
    """The resets of the retry budget, one empty file per reset in `<state dir>/resets/`, apart from the state file
    so that a state file cut in half (SIGKILL or power loss in the middle of a write) can neither reset the budget
    nor let a started reset run a second time. The file's name says everything (the content is never read, so a
    torn write of it cannot lose anything): `<ms>.<gpu>.<boot>.<how>`, created with O_EXCL and the directory
    fsynced **before** the reset starts; its outcome is a rename (atomic): `started` (no outcome recorded yet: in
    this boot, the reset may have run), `charged` (failed, hung, or succeeded: counts), `free` (refused,
    unsupported, needing its peers, no tool: given back). At most 64 per GPU; older than the window: removed."""

    STATES = ("started", "charged", "free")

    def __init__(self, path: Path, boot_id: str) -> None:
        self.path, self.boot = path, _boot_tag(boot_id)
        self.problem: str | None = None  # the last write's failure

    @staticmethod
    def _gpu_tag(gpu: str) -> str:
        return "".join(c if c.isalnum() else "_" for c in gpu)[:32]

    def entries(self) -> list[tuple[float, str, str, str]]:
        """(wall seconds, gpu tag, boot tag, state) of every entry; names that are not ours are ignored."""
        try:
            names = sorted(os.listdir(self.path))[-4096:]
        except OSError:
            return []
        out = []
        for n in names:
            parts = n.split(".")
            if len(parts) != 4 or parts[3] not in self.STATES or not parts[0].isdigit():
                continue
            out.append((int(parts[0]) / 1000.0, parts[1], parts[2], parts[3]))
        return out

    def _name(self, t: float, gpu: str, boot: str, state: str) -> Path:
        return self.path / f"{round(t * 1000)}.{self._gpu_tag(gpu)}.{boot}.{state}"

    def begin(self, gpu: str, t: float) -> bool:
        """Records a reset about to start; False when it could not be made durable (then it must not start)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._name(t, gpu, self.boot, "started"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(self.path)
        except OSError as e:
            self.problem = f"cannot record a GPU reset in {self.path}: {e.strerror or e}"
            return False
        self.problem = None
        return True

    def settle(self, gpu: str, t: float, state: str) -> None:
        """The outcome of the reset started at `t` (`charged` or `free`)."""
        tag = self._gpu_tag(gpu)
        for when, g, boot, st in self.entries():
            if g == tag and st == "started" and abs(when - t) < 0.0015:
                try:
                    os.replace(self._name(when, gpu, boot, st), self._name(when, gpu, boot, state))
                    _fsync_dir(self.path)
                except OSError as e:
                    self.problem = f"cannot record a GPU reset's outcome in {self.path}: {e.strerror or e}"

    def counted(self) -> dict[str, tuple[float, ...]]:
        """Per GPU tag: the resets that count in the budget (started or charged), oldest first."""
        out: dict[str, list[float]] = {}
        for when, g, _boot, st in self.entries():
            if st != "free":
                out.setdefault(g, []).append(when)
        return {g: tuple(sorted(v))[-64:] for g, v in out.items()}

    def in_flight(self, gpu: str) -> float | None:
        """When a reset of this GPU started in this boot with no outcome recorded (it may have run); None: none."""
        tag = self._gpu_tag(gpu)
        found = [w for w, g, boot, st in self.entries() if g == tag and boot == self.boot and st == "started"]
        return max(found) if found else None

    def prune(self, keep_after: float) -> None:
        for when, g, boot, st in self.entries():
            if when <= keep_after and not (st == "started" and boot == self.boot):
                try:
                    os.unlink(self.path / f"{round(when * 1000)}.{g}.{boot}.{st}")
                except OSError:
                    pass


def _gpu_of_tag(tag: str) -> str:
    """The NVML bus id a journal tag was made from (00000000_BB_00_0 -> 00000000:BB:00.0)."""
    p = tag.split("_")
    return f"{p[0]}:{p[1]}:{p[2]}.{p[3]}" if len(p) == 4 else tag


def _boot_tag(boot_id: str) -> str:
    return "".join(c for c in boot_id if c.isalnum())[:12] or "unknown"


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
            refusals=int(r.get("refusals", 0)),
            retry_at=float(r.get("retry_at", 0.0)),
            outcome=str(r.get("outcome") or "")[:32],
            fabric=bool(r.get("fabric")),
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
