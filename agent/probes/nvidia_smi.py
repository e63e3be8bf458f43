"""nvidia-smi: one invocation with no arguments, under a hard timeout, and a parser for the default
table in every layout NVIDIA has shipped (79-column, 535/550 wide, 590+ `+---`, 610 `KMD Version`),
including the MIG devices section and output preceded by unrelated lines."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.model import Check, Finding, GpuIdentity, PciAddress, ProbeResult, Reason, Severity
from agent.probes.base import ProbeContext
from agent.settings import Setting, positive, to_float, to_str

# Every pattern here runs on one line cut to MAX_LINE characters, and none has two unbounded quantifiers
# that can match the same text, so parsing is linear in the input (issue 12 item 10).
BUS_ID_RE = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")
DRIVER_RE = re.compile(r"(?:Driver|KMD) Version: {0,20}(?P<v>[0-9][0-9.]{0,30})")
CUDA_RE = re.compile(r"CUDA (?:UMD )?Version: {0,20}(?P<v>[0-9][0-9.]{0,30})")
HANDLE_PREFIX = "unable to determine the device handle for gpu"
INFOROM_PREFIX = "warning: inforom is corrupted at gpu"
ADDRESS_CHARS = frozenset("0123456789abcdefABCDEF:.")
MAX_LINE = 1024  # the widest real table line is 91 characters; a longer line is cut before parsing
MAX_TEXT = 4 << 20  # characters of output parsed at all (the runner reads at most this many bytes)
MAX_INDEX_DIGITS = 4
WHOLE_RUN_MESSAGES: tuple[tuple[str, str], ...] = (
    ("No devices were found", "no_devices"),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", "driver_unreachable"),
    ("Failed to initialize NVML: Driver/library version mismatch", "driver_library_mismatch"),
    ("Failed to initialize NVML", "nvml_init_failed"),
)
EXIT_CODE_MEANING = {
    2: "invalid argument",
    3: "operation not available",
    4: "no permission",
    6: "query unsuccessful",
    8: "external power cables not attached",
    9: "driver not loaded",
    10: "interrupt issue",
    12: "NVML library not found",
    13: "NVML function not implemented",
    14: "infoROM corrupted",
    15: "GPU fell off the bus or became inaccessible",
    255: "internal driver error",
}
# Field names by cell and token position in the GPU block (same in every layout).
LINE2_CELL1 = ("Fan", "Temp", "Perf", "Pwr:Usage", "Pwr:Cap")
ERR = "ERR!"


@dataclass
class SmiGpu:
    index: int
    name: str
    address: PciAddress
    err_fields: list[str] = field(default_factory=list)
    mig_mode: str | None = None  # "Enabled" / "Disabled" / "N/A" / None (not shown)
    mig_devices: int = 0


@dataclass
class SmiTable:
    gpus: list[SmiGpu] = field(default_factory=list)
    driver_version: str | None = None
    cuda_version: str | None = None
    mig_section: bool = False
    handle_errors: list[tuple[str, str]] = field(default_factory=list)  # (address, error)
    inforom_corrupted: list[str] = field(default_factory=list)
    whole_run: list[tuple[str, str]] = field(default_factory=list)  # (kind, line)
    duplicates: list[tuple[PciAddress, int, int]] = field(default_factory=list)  # (bus id, first index, index)
    unattributed_err: list[str] = field(default_factory=list)  # ERR! that no GPU row owns

    @property
    def mig_devices(self) -> int:
        return sum(g.mig_devices for g in self.gpus)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _err_fields_line1(rest: str, disp: str, c3: str) -> list[str]:
    out = []
    tokens = rest.split()
    if tokens and tokens[-1] == ERR:
        out.append("Persistence-M")
        tokens = tokens[:-1]
    if ERR in tokens[:-1] or (tokens and tokens[0] == ERR):
        out.append("Name")
    if ERR in disp.split():
        out.append("Disp.A")
    if ERR in c3.split():
        out.append("Volatile Uncorr. ECC")
    return out


def _err_fields_line2(cells: list[str]) -> list[str]:
    out = []
    if cells:
        toks = [t for t in cells[0].split() if t != "/"]
        out += [LINE2_CELL1[i] if i < len(LINE2_CELL1) else f"field{i}" for i, t in enumerate(toks) if t == ERR]
    if len(cells) > 1 and ERR in cells[1].split():
        out.append("Memory-Usage")
    if len(cells) > 2:
        toks = cells[2].split()
        if toks and toks[0] == ERR:
            out.append("GPU-Util")
        if ERR in toks[1:]:
            out.append("Compute M.")
    return out


def _gpu_row(line: str) -> tuple[int, str, PciAddress, str, str] | None:
    """(index, rest of cell 1, bus id, rest of cell 2, cell 3) of a GPU's first row
    `|   0  NVIDIA H100 80GB HBM3   On  |   00000000:19:00.0 Off |   0 |`, else None."""
    if not line.startswith("|"):
        return None
    cells = line.split("|", 4)
    if len(cells) < 5:
        return None
    c1 = cells[1].split(None, 1)
    c2 = cells[2].split(None, 1)
    if not c1 or not c2 or not c1[0].isdigit() or len(c1[0]) > MAX_INDEX_DIGITS or not c1[0].isascii():
        return None
    if not BUS_ID_RE.fullmatch(c2[0]):
        return None
    addr = PciAddress.parse(c2[0])
    if addr is None:
        return None
    return int(c1[0]), c1[1] if len(c1) > 1 else "", addr, c2[1] if len(c2) > 1 else "", cells[3]


def _mig_row(line: str) -> tuple[int, int, int, int] | None:
    """(gpu, gi, ci, mig dev) of a MIG device's first row `|  0    2   0   0  | ...`, else None."""
    if not line.startswith("|"):
        return None
    ids = line.split("|", 2)[1].split()
    if len(ids) != 4 or not all(t.isdigit() and t.isascii() and len(t) <= MAX_INDEX_DIGITS for t in ids):
        return None
    return int(ids[0]), int(ids[1]), int(ids[2]), int(ids[3])


def _address_after(line: str, prefix: str) -> tuple[str, str] | None:
    """For `<prefix> 0000:34:00.0: Unknown Error`, `<prefix>0000:91:00.0: ...` and the newer
    `<prefix>1: 0000:34:00.0: ...` (a GPU index first): (address text, what follows). Case-insensitive."""
    at = line.lower().find(prefix)
    if at < 0:
        return None
    rest = line[at + len(prefix) :].lstrip(" ")
    digits = len(rest) - len(rest.lstrip("0123456789"))
    if 0 < digits <= MAX_INDEX_DIGITS and rest[digits : digits + 2] == ": ":
        rest = rest[digits + 2 :].lstrip(" ")  # "GPU1: 0000:34:00.0": the index, then the address
    n = 0
    while n < len(rest) and rest[n] in ADDRESS_CHARS:
        n += 1
    token = rest[:n].rstrip(":.")
    return token, rest[len(token) :].lstrip(":. ").strip()


def parse_smi_table(text: str) -> SmiTable:
    """Parses nvidia-smi's default output. Never raises; what it cannot read it leaves out. Linear in the
    input: at most MAX_TEXT characters, each line cut to MAX_LINE, no backtracking patterns."""
    table = SmiTable()
    text = text[:MAX_TEXT]
    for needle, kind in WHOLE_RUN_MESSAGES:
        idx = text.find(needle)
        if idx >= 0 and not any(k == "driver_library_mismatch" for k, _ in table.whole_run):
            end = text.find("\n", idx, idx + MAX_LINE)
            table.whole_run.append((kind, text[idx : end if end >= 0 else idx + MAX_LINE].strip()))
    if any(k == "driver_library_mismatch" for k, _ in table.whole_run):
        table.whole_run = [w for w in table.whole_run if w[0] != "nvml_init_failed"]

    section = "gpus"
    current: SmiGpu | None = None
    line_in_block = 0
    by_index: dict[int, SmiGpu] = {}
    by_address: dict[PciAddress, SmiGpu] = {}
    mig_owner: tuple[SmiGpu | None, str] | None = None  # the MIG device whose block we are in
    lowered = text.lower()  # the per-line searches below only where the whole output holds their words
    handles, inforom = HANDLE_PREFIX in lowered, INFOROM_PREFIX in lowered
    for line in text.splitlines():
        s = line[:MAX_LINE].rstrip()
        if table.driver_version is None and "Version:" in s and (m := DRIVER_RE.search(s)):
            table.driver_version = m["v"]
        if table.cuda_version is None and "CUDA" in s and (m := CUDA_RE.search(s)):
            table.cuda_version = m["v"]
        if handles and (h := _address_after(s, HANDLE_PREFIX)) is not None:
            table.handle_errors.append(h)
            continue
        if inforom and (h := _address_after(s, INFOROM_PREFIX)) is not None:
            table.inforom_corrupted.append(h[0])
            continue
        if "MIG devices:" in s:
            section, current, mig_owner = "mig", None, None
            table.mig_section = True
            continue
        if "Processes:" in s:
            section, current = "processes", None
            continue
        if section == "gpus":
            row = _gpu_row(s)
            if row is not None:
                index, rest, addr, disp, c3 = row
                tokens = rest.split()
                name = " ".join(tokens[:-1]) if len(tokens) > 1 else (tokens[0] if tokens else "")
                current = SmiGpu(index, name, addr, _err_fields_line1(rest, disp, c3))
                first = by_address.get(addr)
                if first is not None:
                    table.duplicates.append((addr, first.index, index))
                else:
                    by_address[addr] = current
                table.gpus.append(current)
                by_index.setdefault(index, current)
                line_in_block = 1
                continue
            if current is not None and s.startswith("|") and not s.startswith("|="):
                line_in_block += 1
                cells = _cells(s)
                if line_in_block == 2:
                    current.err_fields += _err_fields_line2(cells)
                elif line_in_block == 3 and len(cells) >= 3:
                    mig = cells[2]
                    current.mig_mode = mig or None
                    if mig == ERR:
                        current.err_fields.append("MIG M.")
                    elif ERR in " ".join(cells[:2]).split():
                        current.err_fields.append("unknown field")
            elif s.startswith("+") or not s.strip():
                current = None
        elif section == "mig":
            mrow = _mig_row(s)
            if mrow is not None:
                gpu_index, gi, ci, dev = mrow
                gpu = by_index.get(gpu_index)
                mig_owner = (gpu, f"MIG device {dev} (GI {gi}, CI {ci})")
                if gpu is not None:
                    gpu.mig_devices += 1
            elif s.startswith("+") or not s.strip():
                mig_owner = None
            if ERR in s.replace("|", " ").split():
                # A MIG device row or its continuation line shows ERR!: it belongs to that GPU.
                if mig_owner is not None and mig_owner[0] is not None:
                    mig_owner[0].err_fields.append(mig_owner[1])
                else:
                    table.unattributed_err.append("MIG devices section")
    return table


def smi_findings(table: SmiTable, exit_code: int, raw: str) -> list[Finding]:
    """Findings from one parsed run: whole-run failures and per-GPU `ERR!`."""
    out: list[Finding] = []
    f = Finding.fault
    for kind, line in table.whole_run:
        out.append(f(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_FAILED, f"nvidia-smi: {line}", kind=kind))
    for addr, err in table.handle_errors:
        out.append(
            f(
                Check.NVIDIA_SMI,
                Reason.NVIDIA_SMI_FAILED,
                f"nvidia-smi cannot get a handle for GPU {addr}: {err}",
                PciAddress.parse(addr),
                kind="device_handle",
            )
        )
    for addr in table.inforom_corrupted:
        out.append(
            f(
                Check.NVIDIA_SMI,
                Reason.NVIDIA_SMI_FAILED,
                f"infoROM is corrupted on GPU {addr}",
                PciAddress.parse(addr),
                kind="inforom_corrupted",
            )
        )
    if exit_code != 0:
        meaning = EXIT_CODE_MEANING.get(exit_code, "failed")
        out.append(
            f(
                Check.NVIDIA_SMI,
                Reason.NVIDIA_SMI_FAILED,
                f"nvidia-smi exited with code {exit_code} ({meaning})",
                kind=f"exit_code_{exit_code}",
            )
        )
    for dup, first, index in table.duplicates:
        out.append(
            f(
                Check.NVIDIA_SMI,
                Reason.NVIDIA_SMI_FAILED,
                f"nvidia-smi lists bus id {dup} twice (GPU {first} and GPU {index})",
                dup,
                kind="duplicate_bus_id",
            )
        )
    for where in dict.fromkeys(table.unattributed_err):
        out.append(f(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, f"ERR! in the {where}", kind="err_field"))
    for gpu in table.gpus:
        if gpu.err_fields:
            out.append(
                f(
                    Check.NVIDIA_SMI,
                    Reason.NVIDIA_SMI_ERR,
                    f"ERR! in {', '.join(dict.fromkeys(gpu.err_fields))}",
                    gpu.address,
                    kind="err_field",
                )
            )
    if exit_code == 0 and not out and not table.gpus:
        snippet = " ".join(raw.split())[:120]
        out.append(
            Finding.unchecked(
                Check.NVIDIA_SMI,
                f"nvidia-smi output could not be parsed (no GPU table): {snippet!r}",
                kind="unparseable",
            )
        )
    return out


@dataclass
class SmiRun:
    exit_code: int | None  # None: did not finish (timeout, output cap) or did not start
    output: str
    duration_s: float
    timed_out: bool = False
    error: str | None = None  # could not run at all (missing binary, still-hung previous run)
    hung_pid: int | None = None
    output_capped: bool = False  # wrote more than the cap: reading stopped and the run was killed


# How nvidia-smi runs, and why this way (issue 19).
#
# nvidia-smi is started by the agent itself (subprocess: vfork + exec, no copy of the agent) as the leader of
# a session and process group of its own, stdin /dev/null, stdout and stderr one pipe, and an environment
# variable naming this process (SMI_MARKER) that its descendants inherit. While it runs the agent is a child
# subreaper (prctl PR_SET_CHILD_SUBREAPER; in a container the agent is usually PID 1 and gets orphans anyway),
# so every process nvidia-smi leaves behind, even one that called setsid() to leave its group, is re-parented
# to the agent when its parent exits. When nvidia-smi has exited (a pidfd says so while the output is read,
# so a descendant that keeps the pipe open cannot stall the run), or at the timeout or output cap, the agent
# kills nvidia-smi's process group (nvidia-smi is not reaped yet, so its group id cannot have been reused),
# reaps it, then kills and reaps the children it gained that carry the marker (a zombie among them: one that
# started after nvidia-smi did) until none is left, and drops the subreaper flag again. Only descendants of
# nvidia-smi are ever signalled: another child of the process (a test process runs this code too) has no
# marker and is never touched. (The one thing the marker cannot tell: a zombie. In the agent every child is
# nvidia-smi's; in a process that starts children of its own while a run is in flight, one of them that has
# exited by the end of the run could be reaped here, and one orphaned during the run becomes its child.) A
# nvidia-smi that cannot be killed (D state) is abandoned, remembered, and no second one starts while it lives;
# the flag stays set until it has been reaped and cleaned up after.
#
# Measured per run around /bin/true on 2 cores, Python 3.11, in a process the agent's size (38 MiB; CPU of the
# processes a run starts besides /bin/true, and the agent's own extra CPU; bench.common.spawned_cpu_ms): the
# former supervisor, a fresh `python -I -S` per run, 17-20 ms; a supervisor forked from the agent (os.fork, no
# exec, keeping the separate subreaper), 3.6 ms in the child + 1.5 ms in the agent (copying a 38 MiB process's
# page tables and the copy-on-write faults cost that much even with nothing run in the child: fork + _exit
# alone measured 1.7 + 1.2 ms); os.posix_spawn from the agent, 0.2-0.3 ms in the agent; subprocess.Popen (this:
# vfork + exec too, and it closes the descriptors a library may have left inheritable), 0.2-0.3 ms in the
# agent; in both, 0.0-0.1 ms in other processes (noise).
SMI_MARKER = "GPU_READY_NVIDIA_SMI_OF"
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
_MAX_ENVIRON = 1 << 18  # bytes of a child's environment searched for the marker


class _Subreaper:
    """PR_SET_CHILD_SUBREAPER for this process while at least one nvidia-smi run (or an abandoned one) needs it;
    left alone when something else had already set it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._prctl: Any = None
        self._was_set = False

    def _call(self, option: int, arg: Any) -> int:
        """prctl(option, arg, 0, 0, 0); arg an int or a ctypes pointer. -1 where it cannot be called."""
        if self._prctl is None:
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).prctl
                fn.restype = ctypes.c_int
                self._prctl = fn
            except (OSError, AttributeError):
                self._prctl = False
        if not self._prctl:
            return -1
        import ctypes

        value = ctypes.c_ulong(arg) if isinstance(arg, int) else arg
        zero = ctypes.c_ulong(0)
        return int(self._prctl(option, value, zero, zero, zero))

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                import ctypes

                flag = ctypes.c_int(0)
                self._was_set = self._call(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) == 0 and bool(flag.value)
                if not self._was_set:
                    self._call(PR_SET_CHILD_SUBREAPER, 1)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and not self._was_set:
                self._call(PR_SET_CHILD_SUBREAPER, 0)


_SUBREAPER = _Subreaper()
_TOKEN = f"{os.getpid()}-{os.urandom(6).hex()}"  # this process's nvidia-smi descendants carry it (SMI_MARKER)


def _token() -> str:
    global _TOKEN
    if not _TOKEN.startswith(f"{os.getpid()}-"):  # a forked copy of the process: a token of its own
        _TOKEN = f"{os.getpid()}-{os.urandom(6).hex()}"
    return _TOKEN


def _read_proc(path: str, limit: int = 4096) -> bytes | None:
    """The first `limit` bytes of a /proc file with plain `os` calls (read once per nvidia-smi run); None when it
    cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        out = os.read(fd, limit)
        while out and len(out) < limit and (more := os.read(fd, limit - len(out))):
            out += more  # a file longer than one read gives (many children)
        return out
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]; None when gone."""
    raw = _read_proc(f"/proc/{pid}/stat")
    return None if raw is None else raw.rpartition(b")")[2].split()


def _own_children() -> set[int]:
    """Children of this process as its main thread (where the kernel re-parents orphans) and the calling thread
    (nvidia-smi's parent) list them."""
    me = os.getpid()
    out: set[int] = set()
    for tid in {me, threading.get_native_id()}:
        raw = _read_proc(f"/proc/{me}/task/{tid}/children", 1 << 20)
        if raw:
            out.update(int(p) for p in raw.split())
    return out


def _carries_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read(_MAX_ENVIRON)
    except OSError:
        return False
    return env.startswith(marker) or b"\0" + marker in env


class SmiProcess:
    """One nvidia-smi run: its pid (not reaped until cleanup(), so its process group id stays reserved), the
    read end of its output pipe, a pidfd when the kernel has them."""

    def __init__(self, popen: subprocess.Popen[bytes], out_r: int, before: frozenset[int] = frozenset()) -> None:
        self.popen, self.pid, self.out_r = popen, popen.pid, out_r
        self.before = before  # the process's children just before nvidia-smi started
        self.returncode: int | None = None
        self.reaped = False
        st = _stat_fields(self.pid)
        self.start_ticks = int(st[19]) if st and len(st) > 19 and st[19].isdigit() else 0
        try:
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            self.pidfd = None  # kernel before 5.3: exits are polled
        self._lock = threading.Lock()  # signalling never races the reaping (the group id is not reused)

    def exited(self) -> bool:
        """True once nvidia-smi has exited (it stays a zombie: not reaped here)."""
        if self.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def kill_group(self) -> None:
        with self._lock:
            if not self.reaped:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    pass

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(timeout, 0.0)
        pause = 0.0005
        while not self.exited():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], left)
            else:
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)
        return True

    def cleanup(self) -> int:
        """After nvidia-smi exited: kill its group, reap it, then kill and reap what it left behind. Returns its
        exit code (128 + N when killed by signal N)."""
        self.kill_group()
        with self._lock:
            if not self.reaped:
                try:
                    _, st = os.waitpid(self.pid, 0)
                    code = os.waitstatus_to_exitcode(st)
                except ChildProcessError:
                    code = 0
                self.returncode = code if code >= 0 else 128 - code
                self.popen.returncode = code  # reaped here: Popen must neither wait for it nor warn
                self.reaped = True
        marker = f"{SMI_MARKER}={_token()}".encode()
        for _ in range(10_000):  # each round kills what is there; what they leave comes up the next round
            kids = [p for p in _own_children() if p != self.pid and p not in self.before]
            left = []
            for pid in kids:
                fields = _stat_fields(pid)
                if fields is None:
                    continue
                zombie = fields[0] == b"Z"
                started = int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else -1
                if (zombie and started >= self.start_ticks) or (not zombie and _carries_marker(pid, marker)):
                    left.append(pid)
            if not left:
                break
            for pid in left:
                _signal(pid, signal.SIGKILL)
            for pid in left:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        assert self.returncode is not None
        return self.returncode

    def close(self) -> None:
        for fd in (self.out_r, self.pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


_ENV_CACHE: tuple[str, dict[bytes, bytes], dict[bytes, bytes]] | None = None  # (token, environ copy, env)


def _child_environment() -> dict[bytes, bytes]:
    """This process's environment with the marker first: built again only when the environment or the token
    changed (os.environ's own dict compared, a C-level comparison, instead of ~40 Python-level lookups)."""
    global _ENV_CACHE
    token, data = _token(), getattr(os.environ, "_data", None)
    cached = _ENV_CACHE
    if cached is not None and data is not None and cached[0] == token and cached[1] == data:
        return cached[2]
    marker = SMI_MARKER.encode()
    env = {marker: token.encode(), **{k: v for k, v in os.environb.items() if k != marker}}
    if isinstance(data, dict):
        _ENV_CACHE = (token, dict(data), env)
    return env


def spawn_nvidia_smi(exe: str, args: Sequence[str] = ()) -> SmiProcess:
    """Starts nvidia-smi (see above). The caller holds _SUBREAPER. Raises OSError when it cannot start.
    subprocess.Popen (vfork + exec, as os.posix_spawn) because it also closes every descriptor but the three
    standard ones in the child (a library may open some without close-on-exec) and resets SIGPIPE and SIGXFSZ,
    which Python ignores, to their defaults."""
    before = frozenset(_own_children())  # a zombie among these is not nvidia-smi's, whenever it started
    out_r, out_w = os.pipe()
    env = _child_environment()
    try:
        popen = subprocess.Popen(
            [exe, *args], stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, env=env, start_new_session=True
        )
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    return SmiProcess(popen, out_r, before)


class NvidiaSmiRunner:
    """Runs nvidia-smi under a hard timeout and an output cap and leaves no process behind (see
    spawn_nvidia_smi). On timeout or when the output passes the cap everything is killed; a run that cannot be
    reaped (nvidia-smi in D state) is abandoned, and no second nvidia-smi starts while it lives."""

    def __init__(
        self,
        path: str = "nvidia-smi",
        timeout_s: float = 30.0,
        reap_grace_s: float = 2.0,
        max_output_bytes: int = MAX_TEXT,
    ) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.reap_grace_s = reap_grace_s
        self.max_output_bytes = max_output_bytes
        self._abandoned: SmiProcess | None = None
        self._current: SmiProcess | None = None
        self._lock = threading.Lock()
        self._exe: str | None = None  # the executable found last time; looked up again when it fails to start

    def kill_running(self) -> None:
        """Stops the nvidia-smi in flight, if any, and its group (on shutdown)."""
        p = self._current
        if p is not None:
            p.kill_group()

    def _still_hung(self) -> int | None:
        p = self._abandoned
        if p is None:
            return None
        if not p.exited():
            return p.pid
        try:
            p.cleanup()  # the D state ended: reap it and whatever it left
        finally:
            p.close()
            self._abandoned = None
            _SUBREAPER.release()
        return None

    def _resolve(self) -> tuple[str | None, str | None]:
        """(executable, None) or (None, why it cannot run)."""
        exe = shutil.which(self.path)
        if exe is not None:
            return exe, None
        if os.sep in self.path and os.path.exists(self.path):
            return None, f"cannot run {self.path!r}: not an executable file"
        return None, f"nvidia-smi not found at {self.path!r}"

    def run(self, args: Sequence[str] = ()) -> SmiRun:
        """One nvidia-smi run (`args`: e.g. `-L` for the GPU list with UUIDs); never two at once."""
        with self._lock:
            start = time.monotonic()
            hung = self._still_hung()
            if hung is not None:
                return SmiRun(
                    None,
                    "",
                    0.0,
                    error=f"a previous nvidia-smi (pid {hung}) is still hung; not starting another",
                    hung_pid=hung,
                )
            exe, why = (self._exe, None) if self._exe is not None else self._resolve()
            if exe is None:
                return SmiRun(None, "", 0.0, error=why)
            _SUBREAPER.acquire()
            try:
                proc = spawn_nvidia_smi(exe, args)
            except OSError as e:
                _SUBREAPER.release()
                self._exe = None
                _, why = self._resolve()  # gone or no longer executable: say so as a first lookup would
                error = why or f"cannot run {self.path!r}: {e.strerror}"
                return SmiRun(None, "", time.monotonic() - start, error=error)
            self._exe = exe
            self._current = proc
            abandoned = False
            try:
                run = self._collect(proc, start)
                abandoned = self._abandoned is proc
                return run
            finally:
                self._current = None
                if not abandoned:
                    proc.close()
                    _SUBREAPER.release()

    def _collect(self, proc: SmiProcess, start: float) -> SmiRun:
        deadline = start + self.timeout_s
        out, capped, done = _read_capped(proc, self.max_output_bytes, deadline)
        text = out.decode("utf-8", "replace")
        if done and proc.wait_exit(deadline - time.monotonic()):
            code = proc.cleanup()
            return SmiRun(code, text, time.monotonic() - start)
        # Timed out or wrote too much: kill its group, then what it left once it is gone.
        proc.kill_group()
        hung_pid = None
        if proc.wait_exit(self.reap_grace_s):
            proc.cleanup()
        else:
            self._abandoned = proc  # nvidia-smi cannot be killed (D state): remember it
            hung_pid = proc.pid
        return SmiRun(
            None, text, time.monotonic() - start, timed_out=not capped, hung_pid=hung_pid, output_capped=capped
        )


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _read_capped(proc: SmiProcess, cap: int, deadline: float) -> tuple[bytes, bool, bool]:
    """Reads nvidia-smi's output until it has exited and the pipe is drained (or at end of file), the deadline
    or the cap: (first `cap` bytes at most, capped, done). A descendant that keeps the pipe open does not hold
    the run up: once nvidia-smi has exited, what the pipe holds is read and the run is done."""
    fd = proc.out_r
    buf = bytearray()
    watch = [fd] if proc.pidfd is None else [fd, proc.pidfd]
    gone = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(buf), False, False
        if gone:
            if not select.select([fd], [], [], 0)[0]:
                return bytes(buf), False, True  # exited and drained; a descendant may hold the pipe
        elif fd not in select.select(watch, [], [], left if proc.pidfd is not None else min(left, 0.05))[0]:
            gone = proc.exited()
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return bytes(buf), False, True
        if len(buf) + len(chunk) > cap:
            buf += chunk[: cap - len(buf)]
            return bytes(buf), True, False
        buf += chunk


def probe_nvidia_smi(runner: NvidiaSmiRunner) -> ProbeResult:
    """One nvidia-smi run as a ProbeResult: `ran` is False (and `count` None) when no GPU table came back."""
    run = runner.run()
    if run.error is not None:
        if run.hung_pid is not None:
            hung = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_FAILED, run.error, kind="hung")
            return ProbeResult(Check.NVIDIA_SMI, (hung,), ran=False)
        missing = Finding.unchecked(Check.NVIDIA_SMI, run.error, kind="not_found")
        return ProbeResult(Check.NVIDIA_SMI, (missing,), ran=False)
    if run.timed_out:
        state = " and could not be killed (D state)" if run.hung_pid else ""
        timeout = Finding.fault(
            Check.NVIDIA_SMI,
            Reason.NVIDIA_SMI_FAILED,
            f"nvidia-smi timed out after {runner.timeout_s:g}s{state}",
            kind="timeout",
        )
        return ProbeResult(Check.NVIDIA_SMI, (timeout,), ran=False, timed_out=True)
    if run.output_capped:
        too_large = Finding.fault(
            Check.NVIDIA_SMI,
            Reason.NVIDIA_SMI_FAILED,
            f"nvidia-smi wrote more than {runner.max_output_bytes} bytes; stopped reading and killed it",
            kind="output_too_large",
        )
        return ProbeResult(Check.NVIDIA_SMI, (too_large,), ran=False)
    assert run.exit_code is not None
    table = parse_smi_table(run.output)
    findings = tuple(smi_findings(table, run.exit_code, run.output))
    if any(f.severity is Severity.UNCHECKED for f in findings):
        return ProbeResult(Check.NVIDIA_SMI, findings, ran=False)
    gpus = tuple(
        GpuIdentity(
            g.address,
            g.index,
            g.name,
            None if g.mig_mode not in ("Enabled", "Disabled") else g.mig_mode == "Enabled",
            g.mig_devices,
        )
        for g in table.gpus
    )
    return ProbeResult(Check.NVIDIA_SMI, findings, gpus, len(gpus))


class NvidiaSmiProbe:
    """nvidia-smi's table, one run per cycle: the GPUs it lists are an inventory the verdict compares with PCI's."""

    check = Check.NVIDIA_SMI

    def __init__(self, runner: NvidiaSmiRunner) -> None:
        self.runner = runner

    def read(self, context: ProbeContext) -> ProbeResult:
        r = probe_nvidia_smi(self.runner)
        return replace(r, counts={"nvidia_smi": r.count}, inventory=True)


SETTINGS = (
    Setting("nvidia_smi", to_str, "nvidia-smi", "path of nvidia-smi"),
    Setting("nvidia_smi_timeout", positive(to_float, 3600), 30.0, "hard timeout for one nvidia-smi run, seconds"),
)
