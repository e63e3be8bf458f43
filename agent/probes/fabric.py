"""The NVLink fabric each GPU reports: NVML's `nvmlDeviceGetGpuFabricInfoV` (read by the NVML probe, one call per GPU),
or, where NVML is not used, the "Fabric" block of `nvidia-smi -q`:

    Fabric
        State                             : Completed
        Status                            : Success
        CliqueId                          : 0
        ClusterUUID                       : 00000000-0000-0000-0000-000000000000
        Health
            Bandwidth                     : N/A

On NVSwitch and multi-node NVLink systems (HGX/DGX H100 and later, GB200 NVL) a GPU joins the fabric when the
fabric manager has trained it; until then CUDA cannot start on it (error 802, "system not yet initialized").

Judged, per GPU:
- state Not Started or In Progress: FabricNotReady (`fabric_not_ready`): no CUDA work can start;
- state Completed with a status other than Success (e.g. NVML's Insufficient Resources, which comes with clique ID 0):
  FabricNotReady (`fabric_failed`);
- a health field that reports an incorrect configuration (wrong system GUID or chassis, no partition, too few
  NVLinks, incompatible firmware, invalid location or GPU state): FabricNotReady (`fabric_misconfigured`);
- a health summary Unhealthy: FabricNotReady (`fabric_unhealthy`): NVIDIA's DRA driver leaves such a GPU out of its
  clique, so multi-node work cannot use it. NVML gives the summary in its v3 fabric structure (read first; a driver
  that predates it answers a version mismatch and the v2 structure, without a summary, is read instead);
- a health field that reports degraded bandwidth, a route recovery in progress, an unhealthy route, an access
  timeout recovery, a disconnected global fabric manager or a summary of limited capacity: GPUDegraded
  (`fabric_degraded`): work runs, slower or on fewer routes.
State N/A (NVML NOT_SUPPORTED: PCIe GPUs, systems without a fabric), or a GPU section without a Fabric block (a
driver that reports no fabric state), is "not applicable": nothing is reported. A GPU whose fabric call fails
otherwise, an `nvidia-smi -q` that fails, or one whose output is not what nvidia-smi prints (empty, binary, indented
with tabs, a GPU section twice, a GPU nvidia-smi lists without a section) is "could not check", never "no fabric",
and is not remembered as one. The clique ID and cluster UUID of each GPU are in `check --json`
and the metric `gpu_ready_fabric_info` (the GPUs of one NVLink domain share them)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.settings import choice, setting

NOT_APPLICABLE = "N/A"
NOT_APPLICABLE_WORDS = frozenset({NOT_APPLICABLE, "Not Supported", ""})  # how nvidia-smi says "no fabric"
STATE_NAMES = {0: NOT_APPLICABLE, 1: "Not Started", 2: "In Progress", 3: "Completed"}
# Health values that say nothing is wrong, in nvidia-smi's words and in the ones decode_health gives NVML's bits.
HEALTHY_VALUES = frozenset({"N/A", "False", "None", "Healthy", "Full", "Not Supported", "Connected", "No", ""})
MISCONFIGURATION_FIELD = "Incorrect Configuration"
SUMMARY_FIELD = "Summary"
UNHEALTHY = "Unhealthy"
SUMMARY_NAMES = {1: "Healthy", 2: UNHEALTHY, 3: "Limited Capacity"}  # NVML_GPU_FABRIC_HEALTH_SUMMARY_*; 0: none
VERSION_MISMATCH = 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH: the driver predates the structure's version
# nvmlGpuFabricInfo healthMask fields (nvml.h, NVML_GPU_FABRIC_HEALTH_MASK_*): name, shift, width, bad value(s).
_TRUE = 1
INCORRECT_CONFIGURATION = {
    2: "Incorrect SysGuid",
    3: "Incorrect Chassis SN",
    4: "No Partition",
    5: "Insufficient NVLinks",
    6: "Incompatible GPU Firmware",
    7: "Invalid Location",
    8: "GPU State Invalid",
}
MAX_LINE = 1024
MAX_GPUS = 64
NA_REFRESH_S = 600.0  # without NVML, a node whose GPUs showed no fabric runs `nvidia-smi -q` again this often
_GPU_LINE = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_KEY_VALUE = re.compile(r"^( {4,16})([A-Za-z][A-Za-z ]{0,60}?)\s*:\s?(.{0,200})$")
_HEADING = re.compile(r"^( {4,16})([A-Za-z][A-Za-z ]{0,60}?)\s*$")


@dataclass(frozen=True)
class FabricInfo:
    gpu: PciAddress
    state: str = NOT_APPLICABLE  # "Completed", "In Progress", "Not Started", "N/A"
    status: str = NOT_APPLICABLE  # "Success" or the failure; "N/A"
    clique_id: int | None = None
    cluster_uuid: str | None = None
    health: Mapping[str, str] = field(default_factory=dict)  # nvidia-smi's names and words

    @property
    def applicable(self) -> bool:
        return self.state != NOT_APPLICABLE

    def to_json(self) -> dict[str, Any]:
        return {
            "pci_bus_id": self.gpu.nvml,
            "state": self.state if self.applicable else "not applicable",
            "status": self.status,
            "clique_id": self.clique_id,
            "cluster_uuid": self.cluster_uuid,
            "health": dict(self.health),
        }


@dataclass
class FabricReport:
    """One cycle's fabric readings (`check --json`, the metrics and the fabric-manager probe)."""

    source: str  # "nvml", "nvidia-smi"
    gpus: list[FabricInfo] = field(default_factory=list)

    @property
    def applicable(self) -> bool:
        return any(g.applicable for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "applicable": self.applicable, "gpus": [g.to_json() for g in self.gpus]}


def _uuid(raw: Any) -> str | None:
    b = bytes(raw)
    if len(b) != 16:
        return None
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _field(mask: int, shift: int, width: int) -> int:
    return (mask >> shift) & width


def decode_health(mask: int, summary: int = 0) -> dict[str, str]:
    """NVML's fabric health mask and summary in nvidia-smi's names; fields the GPU does not support are left out."""
    out: dict[str, str] = {}
    if summary in SUMMARY_NAMES:
        out[SUMMARY_FIELD] = SUMMARY_NAMES[summary]
    elif summary:
        out[SUMMARY_FIELD] = f"code {summary}"
    for name, shift, yes, no in (
        ("Bandwidth", 0, "Degraded", "Full"),
        ("Route Recovery in progress", 2, "True", "False"),
        ("Route Unhealthy", 4, "True", "False"),
        ("Access Timeout Recovery", 6, "True", "False"),
    ):
        v = _field(mask, shift, 0x3)
        if v:
            out[name] = yes if v == _TRUE else no
    v = _field(mask, 8, 0xF)
    if v:
        out[MISCONFIGURATION_FIELD] = "None" if v == 1 else INCORRECT_CONFIGURATION.get(v, f"code {v}")
    v = _field(mask, 14, 0x3)
    if v:
        out["Global Fabric Manager"] = "Connected" if v == 1 else "Disconnected"
    return out


def nvml_fabric(nv: Any, handle: Any, address: PciAddress) -> FabricInfo:
    """One GPU's fabric through NVML (called in the NVML probe's worker): the v3 structure (with the health summary),
    else, on a driver that answers a version mismatch, the v2 one. NOT_SUPPORTED, or a library without the call:
    not applicable. Another NVML error raises it (the GPU's fabric could not be read)."""
    get = getattr(nv, "nvmlDeviceGetGpuFabricInfoV", None)
    structs: list[Any] = [
        x for x in (getattr(nv, n, None) for n in ("c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfoV_t")) if x
    ]
    if get is None or not structs:
        return FabricInfo(address)
    for i, struct in enumerate(structs):
        info = struct()
        try:
            get(handle, nv.byref(info))
            break
        except nv.NVMLError as e:
            code = getattr(e, "value", None)
            if code == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3):
                return FabricInfo(address)
            if code != getattr(nv, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", VERSION_MISMATCH) or i == len(structs) - 1:
                raise
    state = STATE_NAMES.get(int(info.state), f"state {int(info.state)}")
    if state == NOT_APPLICABLE:
        return FabricInfo(address)
    status = int(info.status)
    return FabricInfo(
        address,
        state,
        "Success" if status == 0 else _nvml_error_name(nv, status),
        int(info.cliqueId),
        _uuid(info.clusterUuid),
        decode_health(int(getattr(info, "healthMask", 0)), int(getattr(info, "healthSummary", 0))),
    )


def _nvml_error_name(nv: Any, code: int) -> str:
    for name in dir(nv):
        if name.startswith("NVML_ERROR_") and getattr(nv, name) == code:
            return name[len("NVML_ERROR_") :].replace("_", " ").title()
    return f"NVML error {code}"


def parse_smi_q(text: str) -> dict[PciAddress, FabricInfo]:
    """The Fabric block of each GPU in `nvidia-smi -q` output (linear: one pass, every line cut to MAX_LINE). A GPU
    without a Fabric block is left out."""
    out: dict[PciAddress, FabricInfo] = {}
    gpu: PciAddress | None = None
    block: dict[str, str] | None = None
    health: dict[str, str] = {}
    block_indent = sub_indent = 0
    in_health = False

    def flush() -> None:
        if gpu is not None and block is not None and len(out) < MAX_GPUS:
            out[gpu] = _info(gpu, block, health)

    for raw in text.splitlines():
        line = raw[:MAX_LINE].rstrip()
        m = _GPU_LINE.match(line)
        if m:
            flush()
            gpu, block, health, in_health = PciAddress.parse(m[1]), None, {}, False
            continue
        if gpu is None or not line:
            continue
        indent = len(line) - len(line.lstrip(" "))
        if block is None:
            h = _HEADING.match(line)
            if h and h[2] == "Fabric":
                block, block_indent, in_health = {}, len(h[1]), False
            continue
        if indent <= block_indent:
            flush()
            block, health, gpu = None, {}, None if indent == 0 else gpu
            continue
        kv = _KEY_VALUE.match(line)
        if kv:
            if in_health and indent > sub_indent:
                health[kv[2].strip()] = kv[3].strip()
            else:
                in_health = False
                block[kv[2].strip()] = kv[3].strip()
            continue
        h = _HEADING.match(line)
        if h and h[2] == "Health":
            in_health, sub_indent = True, indent
    flush()
    return out


def smi_q_problem(text: str, gpus: Iterable[PciAddress]) -> str | None:
    """Why `nvidia-smi -q` output is not what nvidia-smi prints for these GPUs; None when it is (one linear pass):
    empty, binary (NUL, other control characters, undecodable bytes), indented with tabs (nvidia-smi indents with
    spaces), a GPU's section twice, or a GPU the table listed without a section."""
    if not text.strip():
        return "is empty"
    if _BINARY.search(text):
        return "is not text (control characters or undecodable bytes)"
    seen: set[PciAddress] = set()
    for raw in text.splitlines():
        if raw.startswith("\t") or raw.startswith(" \t"):
            return "is indented with tabs, not as nvidia-smi prints it"
        m = _GPU_LINE.match(raw[:MAX_LINE].rstrip())
        if m:
            addr = PciAddress.parse(m[1])
            if addr in seen:
                return f"lists GPU {m[1]} twice"
            if addr is not None:
                seen.add(addr)
    missing = sorted(set(gpus) - seen)
    if missing:
        return f"has no section for {len(missing)} GPUs nvidia-smi lists (e.g. {missing[0].nvml})"
    return None


_BINARY = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")


def _info(gpu: PciAddress, block: Mapping[str, str], health: Mapping[str, str]) -> FabricInfo:
    state = block.get("State", NOT_APPLICABLE)
    if state in NOT_APPLICABLE_WORDS:
        return FabricInfo(gpu)
    clique = block.get("CliqueId", "")
    return FabricInfo(
        gpu,
        state,
        block.get("Status", NOT_APPLICABLE),
        int(clique) if clique.isdigit() and len(clique) <= 10 else None,
        block.get("ClusterUUID") if block.get("ClusterUUID", NOT_APPLICABLE) != NOT_APPLICABLE else None,
        dict(health),
    )


def fabric_findings(infos: Iterable[FabricInfo]) -> list[Finding]:
    out = []
    for g in infos:
        if not g.applicable:
            continue
        if g.state != "Completed":
            out.append(
                Finding.fault(
                    Check.FABRIC,
                    Reason.FABRIC_NOT_READY,
                    f"NVLink fabric state {g.state}: CUDA cannot start on this GPU until it completes",
                    g.gpu,
                    kind="fabric_not_ready",
                )
            )
            continue
        if g.status != "Success":
            out.append(
                Finding.fault(
                    Check.FABRIC,
                    Reason.FABRIC_NOT_READY,
                    f"NVLink fabric failed: {g.status} (clique {g.clique_id if g.clique_id is not None else '-'})",
                    g.gpu,
                    kind="fabric_failed",
                )
            )
            continue
        wrong = g.health.get(MISCONFIGURATION_FIELD, "N/A")
        if wrong not in HEALTHY_VALUES:
            out.append(
                Finding.fault(
                    Check.FABRIC,
                    Reason.FABRIC_NOT_READY,
                    f"NVLink fabric incorrectly configured: {wrong}",
                    g.gpu,
                    kind="fabric_misconfigured",
                )
            )
            continue
        bad = [f"{k}: {v}" for k, v in g.health.items() if k != MISCONFIGURATION_FIELD and v not in HEALTHY_VALUES]
        if g.health.get(SUMMARY_FIELD) == UNHEALTHY:
            out.append(
                Finding.fault(
                    Check.FABRIC,
                    Reason.FABRIC_NOT_READY,
                    f"NVLink fabric health: {', '.join(bad)}: NVIDIA's DRA driver leaves this GPU out of its clique",
                    g.gpu,
                    kind="fabric_unhealthy",
                )
            )
            continue
        if bad:
            out.append(
                Finding.fault(
                    Check.FABRIC,
                    Reason.GPU_DEGRADED,
                    f"NVLink fabric health: {', '.join(bad)}",
                    g.gpu,
                    kind="fabric_degraded",
                )
            )
    return out


class FabricProbe:
    """The fabric of every GPU: from the NVML probe's readings when NVML was read this cycle, else from `nvidia-smi
    -q` (mode auto or nvidia-smi)."""

    check = Check.FABRIC

    def __init__(self, mode: str, smi: Any) -> None:
        self.mode, self.smi = mode, smi
        # nvidia-smi's GPUs when the last `nvidia-smi -q` showed no fabric on any of them, and when: a GPU without a
        # fabric does not grow one, so -q runs again only when the GPUs change or NA_REFRESH_S has passed.
        self._na: tuple[tuple[PciAddress, ...], float] | None = None

    def read(self, context: ProbeContext) -> ProbeResult:
        nvml = context.ran(Check.NVML)
        snap = nvml.payload if nvml is not None else None
        if self.mode in ("auto", "nvml") and snap is not None and getattr(snap, "gpus", None):
            return self._from_nvml(snap.gpus)
        if self.mode == "nvml":
            return self._unchecked("NVLink fabric: NVML was not read this cycle")
        return self._from_smi(context)

    def _from_nvml(self, gpus: Iterable[Any]) -> ProbeResult:
        report = FabricReport("nvml")
        unread = []
        for g in gpus:
            if g.address is None:
                continue
            if g.fabric is None:
                if g.fabric_error is not None:  # else NVML stopped before it (a lost GPU: its own fault)
                    unread.append(f"{g.address}: {g.fabric_error}")
                continue
            report.gpus.append(g.fabric)
        findings = fabric_findings(report.gpus)
        if unread:
            findings.append(
                Finding.unchecked(Check.FABRIC, f"NVLink fabric could not be read: {'; '.join(unread[:4])}")
            )
        return ProbeResult.of(Check.FABRIC, findings, payload=report)

    def _from_smi(self, context: ProbeContext) -> ProbeResult:
        smi = context.ran(Check.NVIDIA_SMI)
        if smi is None:
            return self._unchecked("NVLink fabric: nvidia-smi did not run this cycle")
        key = tuple(sorted(g.address for g in smi.gpus))
        if not key:  # nvidia-smi listed no GPU: no fabric to ask about (its own finding says why)
            return ProbeResult.of(Check.FABRIC, payload=FabricReport("nvidia-smi"))
        if self._na is not None and self._na[0] == key and context.now - self._na[1] < NA_REFRESH_S:
            return ProbeResult.of(Check.FABRIC, payload=FabricReport("nvidia-smi", [FabricInfo(a) for a in key]))
        run = self.smi.run(("-q",))
        if run.exit_code != 0 or run.output_capped:
            why = run.error or ("timed out" if run.timed_out else f"exit code {run.exit_code}")
            return self._unchecked(f"NVLink fabric: nvidia-smi -q failed: {why}")
        problem = smi_q_problem(run.output, key)
        if problem is not None:  # not what nvidia-smi prints: could not check, and not remembered as "no fabric"
            return self._unchecked(f"NVLink fabric: nvidia-smi -q output {problem}")
        infos = parse_smi_q(run.output)
        # A GPU without a Fabric block: a driver that reports no fabric state (not applicable, as N/A is).
        for g in smi.gpus:
            infos.setdefault(g.address, FabricInfo(g.address))
        report = FabricReport("nvidia-smi", [infos[a] for a in sorted(infos)])
        self._na = None if report.applicable else (key, context.now)
        return ProbeResult.of(Check.FABRIC, fabric_findings(report.gpus), payload=report)

    @staticmethod
    def _unchecked(message: str) -> ProbeResult:
        return ProbeResult.of(Check.FABRIC, (Finding.unchecked(Check.FABRIC, message),))


@dataclass(frozen=True)
class FabricSettings:
    """Settings of the NVLink fabric probe."""

    fabric: str = setting(
        choice("auto", "nvml", "nvidia-smi", "off"),
        "auto",
        "NVLink fabric state per GPU: auto = NVML when read, else nvidia-smi -q (docs/fabric.md)",
    )
