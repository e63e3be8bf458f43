"""nvidia-smi: one invocation with no arguments, under a hard timeout, and a parser for the default
table in every layout NVIDIA has shipped (79-column, 535/550 wide, 590+ `+---`, 610 `KMD Version`),
including the MIG devices section and output preceded by unrelated lines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from agent.model import Check, Finding, PciAddress, Reason

BUS_ID = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]"
GPU_ROW_RE = re.compile(
    rf"^\|\s*(?P<index>\d+)\s+(?P<rest>.*?)\|\s*(?P<bus>{BUS_ID})\b(?P<disp>[^|]*)\|(?P<c3>[^|]*)\|"
)
MIG_ROW_RE = re.compile(r"^\|\s*(?P<gpu>\d+)\s+(?P<gi>\d+)\s+(?P<ci>\d+)\s+(?P<dev>\d+)\s*\|")
DRIVER_RE = re.compile(r"(?:Driver|KMD) Version:\s*(?P<v>[0-9][0-9.]*)")
CUDA_RE = re.compile(r"CUDA (?:UMD )?Version:\s*(?P<v>[0-9][0-9.]*)")
HANDLE_RE = re.compile(
    r"Unable to determine the device handle for gpu ?(?P<addr>[0-9A-Fa-f:.]+): (?P<err>[^\n]*)", re.IGNORECASE
)
INFOROM_RE = re.compile(r"WARNING: infoROM is corrupted at gpu (?P<addr>[0-9A-Fa-f:.]+)", re.IGNORECASE)
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


def parse_smi_table(text: str) -> SmiTable:
    """Parses nvidia-smi's default output. Never raises; what it cannot read it leaves out."""
    table = SmiTable()
    if m := DRIVER_RE.search(text):
        table.driver_version = m["v"]
    if m := CUDA_RE.search(text):
        table.cuda_version = m["v"]
    for m in HANDLE_RE.finditer(text):
        table.handle_errors.append((m["addr"], m["err"].strip()))
    for m in INFOROM_RE.finditer(text):
        table.inforom_corrupted.append(m["addr"])
    for needle, kind in WHOLE_RUN_MESSAGES:
        idx = text.find(needle)
        if idx >= 0 and not any(k == "driver_library_mismatch" for k, _ in table.whole_run):
            end = text.find("\n", idx)
            table.whole_run.append((kind, text[idx : end if end >= 0 else None].strip()))
    if any(k == "driver_library_mismatch" for k, _ in table.whole_run):
        table.whole_run = [w for w in table.whole_run if w[0] != "nvml_init_failed"]

    section = "gpus"
    current: SmiGpu | None = None
    line_in_block = 0
    by_index: dict[int, SmiGpu] = {}
    for line in text.splitlines():
        s = line.rstrip()
        if "MIG devices:" in s:
            section, current = "mig", None
            table.mig_section = True
            continue
        if "Processes:" in s:
            section, current = "processes", None
            continue
        if section == "gpus":
            m = GPU_ROW_RE.match(s)
            if m:
                rest = m["rest"]
                tokens = rest.split()
                name = " ".join(tokens[:-1]) if len(tokens) > 1 else (tokens[0] if tokens else "")
                addr = PciAddress.parse(m["bus"])
                if addr is None:
                    continue
                current = SmiGpu(int(m["index"]), name, addr, _err_fields_line1(rest, m["disp"], m["c3"]))
                table.gpus.append(current)
                by_index[current.index] = current
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
            m = MIG_ROW_RE.match(s)
            if m:
                gpu = by_index.get(int(m["gpu"]))
                if gpu is not None:
                    gpu.mig_devices += 1
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
    exit_code: int | None  # None: did not finish (timeout) or did not start
    output: str
    duration_s: float
    timed_out: bool = False
    error: str | None = None  # could not run at all (missing binary, still-hung previous run)
    hung_pid: int | None = None


class NvidiaSmiRunner:
    """Runs nvidia-smi with a hard timeout. On timeout the child's process group is killed; a child
    that cannot be reaped (D state) is abandoned, and no second nvidia-smi starts while it lives."""

    def __init__(self, path: str = "nvidia-smi", timeout_s: float = 30.0, reap_grace_s: float = 2.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.reap_grace_s = reap_grace_s
        self._abandoned: subprocess.Popen[bytes] | None = None
        self._current: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def kill_running(self) -> None:
        """Kills the nvidia-smi in flight, if any (on shutdown)."""
        p = self._current
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _still_hung(self) -> int | None:
        p = self._abandoned
        if p is None:
            return None
        if p.poll() is None:
            return p.pid
        self._abandoned = None
        return None

    def run(self) -> SmiRun:
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
            try:
                proc = subprocess.Popen(
                    [self.path],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except FileNotFoundError:
                return SmiRun(None, "", 0.0, error=f"nvidia-smi not found at {self.path!r}")
            except OSError as e:
                return SmiRun(None, "", 0.0, error=f"cannot run {self.path!r}: {e.strerror}")
            self._current = proc
            try:
                out, _ = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    out, _ = proc.communicate(timeout=self.reap_grace_s)
                except subprocess.TimeoutExpired:
                    self._abandoned = proc  # uninterruptible: leave it, remember it
                    out = b""
                return SmiRun(
                    None,
                    out.decode("utf-8", "replace"),
                    time.monotonic() - start,
                    timed_out=True,
                    hung_pid=proc.pid if self._abandoned is proc else None,
                )
            return SmiRun(proc.returncode, out.decode("utf-8", "replace"), time.monotonic() - start)


def probe_nvidia_smi(runner: NvidiaSmiRunner) -> tuple[list[Finding], SmiTable | None, SmiRun]:
    run = runner.run()
    if run.error is not None:
        if run.hung_pid is not None:
            return ([Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_FAILED, run.error, kind="hung")], None, run)
        return [Finding.unchecked(Check.NVIDIA_SMI, run.error, kind="not_found")], None, run
    if run.timed_out:
        state = " and could not be killed (D state)" if run.hung_pid else ""
        return (
            [
                Finding.fault(
                    Check.NVIDIA_SMI,
                    Reason.NVIDIA_SMI_FAILED,
                    f"nvidia-smi timed out after {runner.timeout_s:g}s{state}",
                    kind="timeout",
                )
            ],
            None,
            run,
        )
    assert run.exit_code is not None
    table = parse_smi_table(run.output)
    return smi_findings(table, run.exit_code, run.output), table, run
