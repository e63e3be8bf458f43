"""A simulated GPU host in a directory, for tests and the demo.

- `sys/bus/pci/devices/<dddd:bb:dd.f>/{vendor,class,device}` with N GPUs (3D controllers bound to
  `nvidia`), optionally the non-GPU NVIDIA functions real nodes have (HD audio, NVSwitch bridges,
  USB), SR-IOV virtual functions (`physfn` link) and vfio-pci-bound GPUs;
- `bin/nvidia-smi`, a stand-in that on every call reads `smi/scenario.json` and prints a captured
  fixture or a table generated for the simulated GPUs in the real 550 layout, with a chosen exit
  code, or hangs, or prints garbage;
- `kmsg`, a file in the real /dev/kmsg record format, to which records are appended;
- `boot_id`.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.model import PciAddress
from agent.probes.kmsg import format_record

# Bus ids of the 8-GPU H100 node in shared/fixtures/smi-table-healthy-h100x8-550.90.07-gpud-fixture.txt
H100X8_BUSES = (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)

STANDIN = r"""#!{python}
# nvidia-smi stand-in for gpu-ready's simulated host: replays the scenario in {scenario}.
import json, sys, time
try:
    with open({scenario!r}) as fh:
        sc = json.load(fh)
except Exception as e:
    print(f"stand-in: cannot read scenario: {{e}}", file=sys.stderr); sys.exit(255)
if sc.get("count_file"):
    try:
        n = int(open(sc["count_file"]).read() or 0)
    except (OSError, ValueError):
        n = 0
    open(sc["count_file"], "w").write(str(n + 1))
if "--query-gpu" in sys.argv[1:] or any(a.startswith("--query-gpu=") for a in sys.argv[1:]):
    sys.stdout.write(sc.get("query_output", "")); sys.exit(int(sc.get("query_exit_code", 0)))
if "nvlink" in sys.argv[1:]:
    sys.stdout.write(sc.get("nvlink_output", "")); sys.exit(0)
if sc.get("hang"):
    sys.stdout.write(sc.get("output", "")[:200]); sys.stdout.flush()
    time.sleep(float(sc.get("hang_seconds", 3600)))
sys.stdout.write(sc.get("output", ""))
sys.stdout.flush()
sys.exit(int(sc.get("exit_code", 0)))
"""


@dataclass
class SimGpu:
    address: PciAddress
    name: str = "NVIDIA H100 80GB HBM3"
    device_id: int = 0x2330
    memory_mib: int = 81559
    err_fields: tuple[str, ...] = ()
    mig_devices: int = 0  # >0: MIG enabled with this many devices
    in_smi: bool = True  # shown by nvidia-smi
    pcie_gen: int = 5
    pcie_width: int = 16
    ecc: bool = True
    nvlink_up: int = 18
    nvlink_total: int = 18


QUERY_FIELDS = (
    "index,pci.bus_id,name,memory.total,driver_version,mig.mode.current,pcie.link.gen.max,"
    "pcie.link.width.max,ecc.mode.current"
)


def smi_query_csv(gpus: list[SimGpu], driver: str = "550.90.07") -> str:
    """`nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits` for the given GPUs."""
    rows = []
    for i, g in enumerate([g for g in gpus if g.in_smi]):
        rows.append(
            f"{i}, {g.address.nvml}, {g.name}, {g.memory_mib}, {driver}, "
            f"{'Enabled' if g.mig_devices else 'Disabled'}, {g.pcie_gen}, {g.pcie_width}, "
            f"{'Enabled' if g.ecc else 'Disabled'}"
        )
    return "\n".join(rows) + "\n"


def smi_nvlink_status(gpus: list[SimGpu]) -> str:
    """`nvidia-smi nvlink --status` in the real layout."""
    out = []
    for i, g in enumerate([g for g in gpus if g.in_smi]):
        out.append(f"GPU {i}: {g.name} (UUID: GPU-00000000-0000-0000-0000-00000000000{i})")
        if g.nvlink_up == 0 and g.nvlink_total:
            out.append("\t NVML: Unable to retrieve NVLink information as all links are inactive")
            continue
        for link in range(g.nvlink_total):
            out.append(f"\t Link {link}: " + ("26.562 GB/s" if link < g.nvlink_up else "<inactive>"))
    return "\n".join(out) + "\n"


def smi_table(gpus: list[SimGpu], driver: str = "550.90.07", cuda: str = "12.4") -> str:
    """A default nvidia-smi table in the real 550 layout for the given GPUs."""

    def e(field: str, gpu: SimGpu, value: str) -> str:
        return "ERR!" if field in gpu.err_fields else value

    lines = [
        "Mon Jan 20 10:18:26 2025       ",
        "+-----------------------------------------------------------------------------------------+",
        f"| NVIDIA-SMI {driver:<22} Driver Version: {driver:<14} CUDA Version: {cuda:<9}|",
        "|-----------------------------------------+------------------------+----------------------+",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    shown = [g for g in gpus if g.in_smi]
    for i, g in enumerate(shown):
        mig = g.mig_devices > 0
        name = e("Name", g, g.name)[:28]
        c1 = f"{i:>4}  {name:<28} {e('Persistence-M', g, 'On'):>4} "
        c2 = f"   {g.address.nvml} {e('Disp.A', g, 'Off')} "
        c3 = f"{e('Volatile Uncorr. ECC', g, 'On' if mig else '0'):>21} "
        lines.append(f"|{c1:<41}|{c2:<24}|{c3:<22}|")
        pwr = f"{e('Pwr:Usage', g, '72W'):>5} / {e('Pwr:Cap', g, '700W'):>5}"
        c1 = f" {e('Fan', g, 'N/A'):<4}  {e('Temp', g, '27C'):>4}   {e('Perf', g, 'P0'):<4}      {pwr:>17} "
        mem = "N/A" if mig else f"{e('Memory-Usage', g, '1MiB'):>6} / {g.memory_mib:>6}MiB"
        c2 = f"{mem:>23} "
        c3 = f"{e('GPU-Util', g, 'N/A' if mig else '0%'):>8}      {e('Compute M.', g, 'Default'):<7} "
        lines.append(f"|{c1:<41}|{c2:<24}|{c3:<22}|")
        c3 = f"{e('MIG M.', g, 'Enabled' if mig else 'Disabled'):>21} "
        lines.append(f"|{'':<41}|{'':<24}|{c3:<22}|")
        lines.append("+-----------------------------------------+------------------------+----------------------+")
    if any(g.mig_devices for g in shown):
        lines += [
            "",
            "+-----------------------------------------------------------------------------------------+",
            "| MIG devices:                                                                            |",
            "+------------------+----------------------------------+-----------+-----------------------+",
            "| GPU  GI  CI  MIG |                     Memory-Usage |        Vol|      Shared           |",
            "|==================+==================================+===========+=======================|",
        ]
        for i, g in enumerate(shown):
            for d in range(g.mig_devices):
                lines.append(
                    f"|{i:>3}{d + 1:>5}   0 {d:>3}  |{'9MiB / 9984MiB':>33} | 16      0 |  1   0    1    0    1 |"
                )
                lines.append(
                    "+------------------+----------------------------------+-----------+-----------------------+"
                )
    lines += [
        "",
        "+-----------------------------------------------------------------------------------------+",
        "| Processes:                                                                              |",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|=========================================================================================|",
        "|  No running processes found                                                             |",
        "+-----------------------------------------------------------------------------------------+",
    ]
    return "\n".join(lines) + "\n"


class SimHost:
    def __init__(
        self,
        root: str | Path,
        gpus: int = 8,
        buses: tuple[int, ...] | None = None,
        name: str = "NVIDIA H100 80GB HBM3",
        extra_functions: bool = True,
        domain: int = 0,
    ) -> None:
        self.root = Path(root)
        self.sysfs = self.root / "sys"
        self.devices = self.sysfs / "bus" / "pci" / "devices"
        self.bin = self.root / "bin"
        self.nvidia_smi = self.bin / "nvidia-smi"
        self.scenario = self.root / "smi" / "scenario.json"
        self.smi_calls = self.root / "smi" / "calls"
        self.kmsg = self.root / "kmsg"
        self.boot_id_file = self.root / "boot_id"
        self.state_dir = self.root / "state"
        buses = buses or (H100X8_BUSES[:gpus] if gpus <= 8 else tuple(range(0x10, 0x10 + gpus)))
        self.gpus = [SimGpu(PciAddress(domain, b, 0), name) for b in buses]
        self._seq = 0
        self._usec = 5_000_000
        for d in (self.devices, self.bin, self.scenario.parent, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.sysfs / "bus" / "pci" / "drivers").mkdir(exist_ok=True)
        for g in self.gpus:
            self.add_pci_function(g.address, 0, 0x030200, g.device_id, driver="nvidia")
        if extra_functions:
            for g in self.gpus:
                self.add_pci_function(g.address, 1, 0x040300, 0x22A3, driver="snd_hda_intel")
            for i in range(4):
                self.add_pci_function(PciAddress(domain, 0x05 + i, 0), 0, 0x068000, 0x22A3, driver="nvidia-nvswitch")
            self.add_pci_function(PciAddress(domain, 0x02, 0), 2, 0x0C0330, 0x1ADA, driver="xhci_hcd")
            self.add_pci_function(PciAddress(domain, 0x02, 0), 3, 0x0C8000, 0x1ADB, driver=None)
            self.add_pci_function(PciAddress(domain, 0x03, 0), 0, 0x020000, 0x1017, vendor=0x15B3, driver="mlx5_core")
        self.nvidia_smi.write_text(STANDIN.format(python=sys.executable, scenario=str(self.scenario)))
        self.nvidia_smi.chmod(0o755)
        self.kmsg.write_text("")
        self.boot_id_file.write_text(str(uuid.uuid4()) + "\n")
        self.set_smi()

    # -- PCI ---------------------------------------------------------------------------------------

    def add_pci_function(
        self,
        addr: PciAddress,
        function: int,
        cls: int,
        device: int,
        vendor: int = 0x10DE,
        driver: str | None = "nvidia",
        physfn: str | None = None,
    ) -> Path:
        d = self.devices / f"{addr.domain:04x}:{addr.bus:02x}:{addr.device:02x}.{function}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "vendor").write_text(f"0x{vendor:04x}\n")
        (d / "class").write_text(f"0x{cls:06x}\n")
        (d / "device").write_text(f"0x{device:04x}\n")
        if driver:
            drv = self.sysfs / "bus" / "pci" / "drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            link = d / "driver"
            if link.is_symlink():
                link.unlink()
            link.symlink_to(os.path.relpath(drv, d))
        if physfn:
            (d / "physfn").symlink_to(os.path.relpath(self.devices / physfn, d))
        return d

    def add_virtual_function(self, parent: PciAddress, bus: int) -> None:
        self.add_pci_function(
            PciAddress(parent.domain, bus, 0),
            0,
            0x030200,
            0x2330,
            physfn=f"{parent.domain:04x}:{parent.bus:02x}:{parent.device:02x}.0",
        )

    def bind_vfio(self, addr: PciAddress) -> None:
        self.add_pci_function(addr, 0, 0x030200, 0x2330, driver="vfio-pci")

    # -- nvidia-smi ------------------------------------------------------------------------------------

    def set_smi(
        self,
        *,
        output: str | None = None,
        fixture: str | Path | None = None,
        exit_code: int = 0,
        hang: bool = False,
        hang_seconds: float = 3600,
        garbage: bool = False,
        err: dict[int, tuple[str, ...]] | None = None,
        hidden: tuple[int, ...] = (),
        mig: dict[int, int] | None = None,
    ) -> None:
        """Chooses what the stand-in prints next. err: {gpu position: fields showing ERR!};
        hidden: GPU positions nvidia-smi does not show; mig: {gpu position: MIG devices}."""
        for i, g in enumerate(self.gpus):
            g.err_fields = tuple((err or {}).get(i, ()))
            g.in_smi = i not in hidden
            g.mig_devices = (mig or {}).get(i, 0)
        if garbage:
            text = "\x00\x1b[31m\ufffd garbage \x7f\n|||| +---+ ERR! 12:34\n" * 3
        elif fixture is not None:
            text = Path(fixture).read_text(encoding="utf-8", errors="replace")
        elif output is not None:
            text = output
        else:
            text = smi_table(self.gpus)
        sc: dict[str, Any] = {
            "output": text,
            "exit_code": exit_code,
            "hang": hang,
            "hang_seconds": hang_seconds,
            "count_file": str(self.smi_calls),
            "query_output": smi_query_csv(self.gpus),
            "nvlink_output": smi_nvlink_status(self.gpus),
        }
        tmp = self.scenario.with_suffix(".tmp")
        tmp.write_text(json.dumps(sc))
        os.replace(tmp, self.scenario)

    def smi_call_count(self) -> int:
        try:
            return int(self.smi_calls.read_text() or 0)
        except (OSError, ValueError):
            return 0

    # -- kernel log ----------------------------------------------------------------------------------

    def append_kmsg(self, *texts: str, facility: int = 0, level: int = 3) -> None:
        with open(self.kmsg, "a", encoding="utf-8") as fh:
            for t in texts:
                self._seq += 1
                self._usec += 1000
                fh.write(format_record(t, self._seq, self._usec, facility, level))

    def skip_seq(self, n: int) -> None:
        """Simulates records overwritten before they were read (the next seq jumps by n)."""
        self._seq += n

    def xid_line(self, xid: int, gpu: int = 0, text: str | None = None) -> str:
        a = self.gpus[gpu].address
        default = {79: "GPU has fallen off the bus."}.get(xid, "Graphics Exception")
        return f"NVRM: Xid (PCI:{a.kernel}): {xid}, pid='<unknown>', name=<unknown>, {text or default}"

    def append_xid(self, xid: int, gpu: int = 0, text: str | None = None) -> None:
        self.append_kmsg(self.xid_line(xid, gpu, text))

    def new_boot(self) -> str:
        bid = str(uuid.uuid4())
        self.boot_id_file.write_text(bid + "\n")
        return bid

    def agent_args(self) -> list[str]:
        """Flags that point gpu-ready at this host."""
        return [
            "--nvidia-smi",
            str(self.nvidia_smi),
            "--sysfs-root",
            str(self.sysfs),
            "--kmsg",
            str(self.kmsg),
            "--nvml",
            "off",
            "--state-dir",
            str(self.state_dir),
            "--boot-id-file",
            str(self.boot_id_file),
        ]

    def check_args(self) -> list[str]:
        """Flags that point `gpu-ready check` at this host."""
        return [
            "--nvidia-smi",
            str(self.nvidia_smi),
            "--sysfs-root",
            str(self.sysfs),
            "--kmsg",
            str(self.kmsg),
            "--nvml",
            "off",
        ]

    def plugin_resources(self, n: int | None = None) -> dict[str, str]:
        return {"nvidia.com/gpu": str(len(self.gpus) if n is None else n)}
