"""nvidia-smi: one invocation with no arguments, under a hard timeout, and a parser for the default
table in every layout NVIDIA has shipped (79-column, 535/550 wide, 590+ `+---`, 610 `KMD Version`),
including the MIG devices section and output preceded by unrelated lines."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from agent.model import Check, Finding, GpuIdentity, PciAddress, ProbeResult, Reason, Severity
from agent.probes.base import ProbeContext
from agent.proc import Run, SupervisedRunner
from agent.settings import positive, setting, to_float, to_str

# Every pattern here runs on one line cut to MAX_LINE characters, and none has two unbounded quantifiers
# that can match the same text, so parsing is linear in the input.
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


class NvidiaSmiRunner(SupervisedRunner):
    """nvidia-smi under the supervisor (agent/proc.py): a hard timeout, an output cap, no process left behind."""

    def __init__(
        self,
        path: str = "nvidia-smi",
        timeout_s: float = 30.0,
        reap_grace_s: float = 2.0,
        max_output_bytes: int = MAX_TEXT,
    ) -> None:
        super().__init__(path, timeout_s, reap_grace_s, max_output_bytes, name="nvidia-smi")
        self.paused = False  # a GPU reset runs: no nvidia-smi beside it (agent/probes/nvml_pause.py)

    def run(self, args: Sequence[str] = ()) -> Run:
        if self.paused:
            return Run(None, "", 0.0, error="nvidia-smi paused while a GPU reset runs")
        return super().run(args)


class NvidiaSmiProbe:
    """nvidia-smi's table, one run per cycle: the GPUs it lists are an inventory the verdict compares with PCI's."""

    check = Check.NVIDIA_SMI

    def __init__(self, runner: NvidiaSmiRunner) -> None:
        self.runner = runner

    def read(self, context: ProbeContext) -> ProbeResult:
        r = probe_nvidia_smi(self.runner)
        return replace(r, counts={"nvidia_smi": r.count}, inventory=True)


@dataclass(frozen=True)
class NvidiaSmiSettings:
    """Settings of the nvidia-smi probe."""

    nvidia_smi: str = setting(to_str, "nvidia-smi", "path of nvidia-smi")
    nvidia_smi_timeout: float = setting(positive(to_float, 3600), 30.0, "hard timeout for one nvidia-smi run, seconds")
