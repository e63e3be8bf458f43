"""The spec gate: the node matches the declared profile (GPU model, count, memory, driver and CUDA versions,
MIG mode, NVLink links, PCIe, ECC). NVML first, nvidia-smi when NVML is missing or fails."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from agent.preflight.profile import Profile, version_matches
from agent.preflight.result import FAIL, PASS, GateResult
from agent.probes.nvidia_smi import parse_smi_table
from agent.proc import run_command

QUERY = (
    "index,pci.bus_id,name,memory.total,driver_version,mig.mode.current,pcie.link.gen.max,"
    "pcie.link.width.max,ecc.mode.current"
)


@dataclass
class GpuSpec:
    index: int
    bus_id: str
    name: str
    memory_mib: int | None
    driver: str | None
    mig: str | None
    pcie_gen: int | None
    pcie_width: int | None
    ecc: str | None
    nvlink_up: int | None = None


def _int(v: str) -> int | None:
    m = re.search(r"\d{1,12}", v)
    return int(m.group()) if m else None


def read_spec_nvidia_smi(nvidia_smi: str, timeout_s: float = 30) -> tuple[list[GpuSpec], str | None]:
    """The fallback reader: `nvidia-smi --query-gpu` (values with or without units), the table header for
    the CUDA version, `nvidia-smi nvlink --status` for NVLink links."""

    def run(*args: str) -> str:
        out = run_command([nvidia_smi, *args], timeout_s)
        if out.exit_code is None:
            raise RuntimeError(f"nvidia-smi {' '.join(args)} timed out after {timeout_s:g}s")
        if out.exit_code != 0:
            raise RuntimeError(f"nvidia-smi {' '.join(args)} exited {out.exit_code}: {out.output.strip()[:200]}")
        return out.output

    gpus = []
    for line in run(f"--query-gpu={QUERY}", "--format=csv,noheader,nounits").splitlines():
        f = [x.strip() for x in line[:4096].split(",")]
        if len(f) < 9 or not f[0].isdigit() or len(f[0]) > 6:
            continue
        gpus.append(GpuSpec(int(f[0]), f[1], f[2], _int(f[3]), f[4], f[5], _int(f[6]), _int(f[7]), f[8]))
    cuda = parse_smi_table(run()).cuda_version
    current = None
    for line in run("nvlink", "--status").splitlines():
        line = line[:4096]
        m = re.match(r"GPU (\d{1,6}):", line)
        if m:
            current = next((g for g in gpus if g.index == int(m.group(1))), None)
            if current is not None:
                current.nvlink_up = 0
        elif current is not None and re.search(r"Link \d{1,4}: [0-9.]{1,32} GB/s", line):
            current.nvlink_up = (current.nvlink_up or 0) + 1
    return gpus, cuda


def read_spec_nvml(nv: Any) -> tuple[list[GpuSpec], str | None]:
    """The primary reader: NVML (nvidia-ml-py, or a stand-in with the same calls)."""

    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    driver = text(nv.nvmlSystemGetDriverVersion())
    cu = int(nv.nvmlSystemGetCudaDriverVersion_v2())
    cuda = f"{cu // 1000}.{cu % 1000 // 10}"
    gpus = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mig = ecc = None
        try:
            mig = "Enabled" if nv.nvmlDeviceGetMigMode(h)[0] == 1 else "Disabled"
        except nv.NVMLError:
            mig = "N/A"
        try:
            ecc = "Enabled" if nv.nvmlDeviceGetEccMode(h)[0] == 1 else "Disabled"
        except nv.NVMLError:
            ecc = "N/A"
        up = 0
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                up += nv.nvmlDeviceGetNvLinkState(h, link) == 1
            except nv.NVMLError:
                break
        gpus.append(
            GpuSpec(
                i,
                text(nv.nvmlDeviceGetPciInfo(h).busId),
                text(nv.nvmlDeviceGetName(h)),
                int(nv.nvmlDeviceGetMemoryInfo(h).total) // 2**20,
                driver,
                mig,
                int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                int(nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
                ecc,
                up,
            )
        )
    return gpus, cuda


def read_spec(nvidia_smi: str, nv: Any = None) -> tuple[list[GpuSpec], str | None, str]:
    """NVML first, nvidia-smi when NVML is not there or fails; returns (gpus, cuda, source)."""
    if nv is not None:
        try:
            gpus, cuda = read_spec_nvml(nv)
            return gpus, cuda, "nvml"
        except Exception:  # NVML present but broken for this query: fall back
            pass
    gpus, cuda = read_spec_nvidia_smi(nvidia_smi)
    return gpus, cuda, "nvidia-smi"


def check_spec(profile: Profile, gpus: list[GpuSpec], cuda: str | None) -> GateResult:
    problems: list[str] = []
    p = profile
    if p.gpu_count is not None and len(gpus) != p.gpu_count:
        problems.append(f"expected {p.gpu_count} GPUs, found {len(gpus)}")
    if p.cuda_version and (cuda is None or not version_matches(cuda, p.cuda_version)):
        problems.append(f"CUDA {cuda} does not satisfy {p.cuda_version}")
    for g in gpus:
        who = f"GPU {g.index} ({g.bus_id})"
        if p.gpu_model and p.gpu_model.lower() not in g.name.lower():
            problems.append(f"{who}: model {g.name!r} is not {p.gpu_model!r}")
        if p.memory_per_gpu_mib and (g.memory_mib or 0) < p.memory_per_gpu_mib:
            problems.append(f"{who}: {g.memory_mib} MiB < {p.memory_per_gpu_mib} MiB")
        if p.driver_version and (not g.driver or not version_matches(g.driver, p.driver_version)):
            problems.append(f"{who}: driver {g.driver} does not satisfy {p.driver_version}")
        if p.mig_mode and (g.mig or "").lower() != p.mig_mode:
            problems.append(f"{who}: MIG {g.mig}, expected {p.mig_mode}")
        if p.nvlink_links_per_gpu is not None and g.nvlink_up != p.nvlink_links_per_gpu:
            problems.append(f"{who}: {g.nvlink_up} NVLink links up, expected {p.nvlink_links_per_gpu}")
        if p.pcie_gen and (g.pcie_gen or 0) < p.pcie_gen:
            problems.append(f"{who}: PCIe gen {g.pcie_gen} < {p.pcie_gen}")
        if p.pcie_width and (g.pcie_width or 0) < p.pcie_width:
            problems.append(f"{who}: PCIe x{g.pcie_width} < x{p.pcie_width}")
        if p.ecc_enabled is not None and ((g.ecc or "").lower() == "enabled") != p.ecc_enabled:
            problems.append(f"{who}: ECC {g.ecc}, expected {'enabled' if p.ecc_enabled else 'disabled'}")
    evidence = {"gpus": [asdict(g) for g in gpus], "cuda_version": cuda}
    if problems:
        return GateResult("spec", FAIL, "; ".join(problems)[:900], evidence)
    return GateResult("spec", PASS, f"{len(gpus)} GPUs match the profile", evidence)


def spec_gate(profile: Profile, nvidia_smi: str, nvml: Any = None) -> GateResult:
    gpus, ver, source = read_spec(nvidia_smi, nvml)
    res = check_spec(profile, gpus, ver)
    res.evidence["source"] = source
    return res
