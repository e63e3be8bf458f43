"""A simulated GPU host in a directory, for tests and the demo.

- `sys/bus/pci/devices/<dddd:bb:dd.f>/{vendor,class,device}` with N GPUs (3D controllers bound to
  `nvidia`), optionally the non-GPU NVIDIA functions real nodes have (HD audio, NVSwitch bridges,
  USB), SR-IOV virtual functions (`physfn` link) and vfio-pci-bound GPUs;
- `bin/nvidia-smi`, a stand-in that on every call reads `smi/scenario.json` and prints a captured
  fixture or a table generated for the simulated GPUs in the real 550 layout, with a chosen exit
  code, or hangs, or prints garbage;
- `kmsg`, a file in the real /dev/kmsg record format, to which records are appended;
- `boot_id`;
- PCIe link fields (`{current,max}_link_{width,speed}`) on every GPU and, with `pcie_bridges=True`, the
  GPU placed below an upstream bridge in a real `sys/devices/pci<dom>:<bus>/<bridge>/<gpu>` tree with
  `bus/pci/devices` entries as symbolic links, as on a real host;
- `dev/` with the NVIDIA device nodes (`make_dev_nodes`) and `proc/driver/nvidia/gpus/<bdf>/information`
  with each GPU's minor number. Character devices are made with mknod when the process may (root with
  CAP_MKNOD); otherwise each node is a symbolic link to /dev/null, which is a real character device, so
  the probe's "is a character device" check runs unchanged (it follows links, as it must for
  /run/nvidia/driver/dev) without root;
- `DcgmExporterStandIn`, a dcgm-exporter stand-in serving metric text over HTTP on loopback;
- the multi-node sources (docs/fabric.md): `nvidia-smi -q` answered with each GPU's Fabric block (`smi_q`, or a
  captured `-q` through `set_smi_q`; counted apart from the table runs, `smi_q_call_count`), InfiniBand ports with
  their error counters (`set_ib_port`, `set_ib_counters`) and ConnectX functions beside the GPUs (`add_rail`, with
  pcie_bridges=True), kernel modules (`load_module`: nvidia_peermem) and the IMEX control tool (`set_imex`);
- a wedged file (`wedge`): any file of the tree replaced with a FIFO no one writes, so that opening it blocks, a
  stand-in for a sysfs attribute whose driver does not answer (a wedged HCA); `unwedge` lets the readers go.
"""

from __future__ import annotations

import http.server
import json
import os
import stat
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.kernel_log.source import KmsgSource, format_record
from agent.model import PciAddress

# Bus ids of the 8-GPU H100 node in tests/fixtures/smi-table-healthy-h100x8-550.90.07-gpud-fixture.txt
H100X8_BUSES = (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)

STANDIN = r"""#!{python}
# nvidia-smi stand-in for gpu-ready's simulated host: replays the scenario in {scenario}.
import json, os, sys, time
try:
    with open({scenario!r}) as fh:
        sc = json.load(fh)
except (OSError, ValueError) as e:
    print(f"stand-in: cannot read scenario: {{e}}", file=sys.stderr); sys.exit(255)
if sys.argv[1:] == ["-q"]:  # the fabric probe's read: counted apart from the table runs (one per check cycle)
    if sc.get("q_count_file"):
        try:
            n = int(open(sc["q_count_file"]).read() or 0)
        except (OSError, ValueError):
            n = 0
        open(sc["q_count_file"], "w").write(str(n + 1))
    if sc.get("q_pending"):  # after a reset: these reads first, one per call (the last one stays)
        text = sc["q_pending"][0]
        if len(sc["q_pending"]) > 1:
            sc["q_pending"] = sc["q_pending"][1:]
        else:
            sc["q_pending"] = []
            sc["q_output"] = text
        tmp = {scenario!r} + ".q"
        with open(tmp, "w") as fh:
            json.dump(sc, fh)
        os.replace(tmp, {scenario!r})
        sys.stdout.write(text); sys.exit(0)
    sys.stdout.write(sc.get("q_output", "")); sys.exit(int(sc.get("q_exit_code", 0)))
if sc.get("count_file"):
    try:
        n = int(open(sc["count_file"]).read() or 0)
    except (OSError, ValueError):
        n = 0
    open(sc["count_file"], "w").write(str(n + 1))
def save(sc):
    tmp = {scenario!r} + ".w" + str(os.getpid())
    with open(tmp, "w") as fh:
        json.dump(sc, fh)
    os.replace(tmp, {scenario!r})
bus = sys.argv[sys.argv.index("-i") + 1] if "-i" in sys.argv[1:-1] else ""
if "-pm" in sys.argv[1:]:  # persistence mode on/off for one GPU (what `nvidia-smi -i <bus> -pm 0|1` does)
    on = sys.argv[sys.argv.index("-pm") + 1] == "1"
    sc.setdefault("pm", {{}})[bus] = "Enabled" if on else "Disabled"
    with open(sc["reset_log"] + ".pm", "a") as fh:
        fh.write(bus + " " + ("1" if on else "0") + "\n")
    save(sc)
    print("Enabled" if on else "Disabled", "persistence mode for GPU", bus + ".")
    print("All done."); sys.exit(0)
if any(a == "--query-gpu=persistence_mode" for a in sys.argv[1:]):
    print((sc.get("pm") or {{}}).get(bus, "Disabled")); sys.exit(0)
if "-r" in sys.argv[1:] or "--gpu-reset" in sys.argv[1:]:
    r = sc.get("reset") or {{}}
    with open(sc["reset_log"], "a") as fh:
        fh.write(" ".join(sys.argv[1:]) + "\n")
    mode = r.get("mode", "ok")
    if mode == "hang":
        time.sleep(float(r.get("seconds", 3600)))
    if mode == "fail":  # an answer that is neither a refusal nor "not supported": a failed reset
        print("Unable to reset GPU " + sys.argv[-1] + ": the GPU did not recover", file=sys.stderr); sys.exit(255)
    held = r.get("held_by_pm") and (sc.get("pm") or {{}}).get(bus) == "Enabled"
    held = held or any(os.path.exists(f) for f in r.get("held_by_files") or ())
    if mode == "answer" or held:  # a real answer, word for word (tests/fixtures/reset-*.txt)
        sys.stdout.write(r["answer"] if mode == "answer" else r["refused"])
        sys.exit(int(r.get("exit_code", 255)))
    if r.get("output_after") is not None:
        sc["output"] = r["output_after"]
    if r.get("q_after") is not None:  # the fabric trains again for a few -q reads after the reset
        sc["q_pending"] = list(r["q_after"])
    save(sc)
    print("GPU " + sys.argv[-1] + " was successfully reset."); sys.exit(0)
if any(a.startswith("--query-compute-apps") for a in sys.argv[1:]):
    sys.stdout.write(sc.get("compute_apps", "")); sys.exit(0)
if "--query-gpu" in sys.argv[1:] or any(a.startswith("--query-gpu=") for a in sys.argv[1:]):
    sys.stdout.write(sc.get("query_output", "")); sys.exit(int(sc.get("query_exit_code", 0)))
if "-L" in sys.argv[1:] or "--list-gpus" in sys.argv[1:]:
    sys.stdout.write(sc.get("list_output", "")); sys.exit(0)
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
    minor: int = 0
    fabric_state: str = "N/A"  # nvidia-smi -q's Fabric block (N/A: no fabric)
    fabric_status: str = "N/A"
    clique_id: int | None = None
    cluster_uuid: str | None = None
    fabric_health: tuple[tuple[str, str], ...] = ()

    @property
    def uuid(self) -> str:
        """A stable NVML-style UUID, `GPU-<8-4-4-4-12 hex>`, derived from the bus id (same on every run)."""
        return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"gpu-ready-sim-gpu:{self.address.nvml}"))

    @property
    def mig_uuids(self) -> list[str]:
        """Stable `MIG-<uuid>` UUIDs of this GPU's MIG devices, in NVML MIG handle-index order."""
        return [
            "MIG-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"gpu-ready-sim-mig:{self.address.nvml}:{d}"))
            for d in range(self.mig_devices)
        ]


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
        out.append(f"GPU {i}: {g.name} (UUID: {g.uuid})")
        if g.nvlink_up == 0 and g.nvlink_total:
            out.append("\t NVML: Unable to retrieve NVLink information as all links are inactive")
            continue
        for link in range(g.nvlink_total):
            out.append(f"\t Link {link}: " + ("26.562 GB/s" if link < g.nvlink_up else "<inactive>"))
    return "\n".join(out) + "\n"


def smi_q(gpus: list[SimGpu], driver: str = "550.90.07") -> str:
    """`nvidia-smi -q` for the given GPUs: the banner, and per GPU its heading, a few identity lines and the Fabric
    block, in the layout of the 535-era captures in tests/fixtures (smi-q-535.161.08-gpud-fixture.txt; the CliqueId,
    ClusterUUID and Health lines as the 560/590 captures print them). Constructed, not captured."""
    shown = [g for g in gpus if g.in_smi]
    out = [
        "",
        "==============NVSMI LOG==============",
        "",
        "Timestamp                                 : Mon Jan 20 10:18:26 2025",
        f"Driver Version                            : {driver}",
        "CUDA Version                              : 12.4",
        "",
        f"Attached GPUs                             : {len(shown)}",
    ]
    for g in shown:
        out += [
            f"GPU {g.address.nvml}",
            f"    Product Name                          : {g.name}",
            f"    GPU UUID                              : {g.uuid}",
            f"    Minor Number                          : {g.minor}",
            "    Fabric",
            f"        State                             : {g.fabric_state}",
            f"        Status                            : {g.fabric_status}",
            f"        CliqueId                          : {'N/A' if g.clique_id is None else g.clique_id}",
            f"        ClusterUUID                       : {g.cluster_uuid or 'N/A'}",
            "        Health",
            *(f"            {k:<30}: {v}" for k, v in (g.fabric_health or (("Bandwidth", "N/A"),))),
            "    Processes                             : None",
            "",
        ]
    return "\n".join(out)


def smi_list(gpus: list[SimGpu]) -> str:
    """`nvidia-smi -L` in the real layout: one line per GPU, one per MIG device below it."""
    out = []
    for i, g in enumerate([g for g in gpus if g.in_smi]):
        out.append(f"GPU {i}: {g.name} (UUID: {g.uuid})")
        for d, m in enumerate(g.mig_uuids):
            out.append(f"  MIG 1g.10gb     Device  {d}: (UUID: {m})")
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
        pcie_bridges: bool = False,
    ) -> None:
        self.root = Path(root)
        self.sysfs = self.root / "sys"
        self.devices = self.sysfs / "bus" / "pci" / "devices"
        self.bin = self.root / "bin"
        self.nvidia_smi = self.bin / "nvidia-smi"
        self.scenario = self.root / "smi" / "scenario.json"
        self.smi_calls = self.root / "smi" / "calls"
        self.smi_q_calls = self.root / "smi" / "q_calls"
        self.imex_ctl = self.root / "bin" / "nvidia-imex-ctl"
        self.imex_state = self.root / "imex" / "state"
        self.q_fixture: str | None = None  # a captured `nvidia-smi -q` the stand-in prints instead of smi_q
        self.reset_log = self.root / "smi" / "resets"  # one line per `nvidia-smi -r` run: its arguments
        self._reset: dict[str, Any] = {"mode": "ok"}
        self._apps: dict[int, tuple[int, ...]] = {}
        self._wedged: set[Path] = set()  # FIFOs placed by wedge()
        self.kmsg = self.root / "kmsg"
        self.boot_id_file = self.root / "boot_id"
        self.state_dir = self.root / "state"
        self.dev = self.root / "dev"
        self.proc = self.root / "proc"
        self.pcie_bridges = pcie_bridges
        buses = buses or (H100X8_BUSES[:gpus] if gpus <= 8 else tuple(range(0x10, 0x10 + gpus)))
        self.gpus = [SimGpu(PciAddress(domain, b, 0), name, minor=i) for i, b in enumerate(buses)]
        self._seq = 0
        self._usec = 5_000_000
        for d in (self.devices, self.bin, self.scenario.parent, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.sysfs / "bus" / "pci" / "drivers").mkdir(exist_ok=True)
        for i, g in enumerate(self.gpus):
            parent = None
            if pcie_bridges:
                root_port = PciAddress(domain, 0, 1 + i)
                parent = self.add_pci_function(
                    root_port, 0, 0x060400, 0x1BBE, vendor=0x8086, driver="pcieport", parent=self.pci_root(domain)
                )
                self.set_link(root_port)
            self.add_pci_function(g.address, 0, 0x030200, g.device_id, driver="nvidia", parent=parent)
            self.set_link(g.address)
            info = self.proc / "driver" / "nvidia" / "gpus" / self.sysfs_name(g.address) / "information"
            info.parent.mkdir(parents=True, exist_ok=True)
            info.write_text(f"Model: \t\t {g.name}\nIRQ:   \t\t 140\nDevice Minor: \t {g.minor}\n")
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

    @staticmethod
    def sysfs_name(addr: PciAddress, function: int = 0) -> str:
        return f"{addr.domain:04x}:{addr.bus:02x}:{addr.device:02x}.{function}"

    def pci_root(self, domain: int = 0) -> Path:
        d = self.sysfs / "devices" / f"pci{domain:04x}:00"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def add_pci_function(
        self,
        addr: PciAddress,
        function: int,
        cls: int,
        device: int,
        vendor: int = 0x10DE,
        driver: str | None = "nvidia",
        physfn: str | None = None,
        parent: Path | None = None,
    ) -> Path:
        """parent: a real directory (a bridge's) to create the function under, with a symbolic link in
        bus/pci/devices as on a real host; None keeps the function as a plain directory there."""
        entry = self.devices / self.sysfs_name(addr, function)
        if parent is not None and not entry.exists():
            real = parent / entry.name
            real.mkdir(parents=True, exist_ok=True)
            entry.symlink_to(os.path.relpath(real, self.devices))
        entry.mkdir(parents=True, exist_ok=True)
        d = Path(os.path.realpath(entry))
        (d / "vendor").write_text(f"0x{vendor:04x}\n")
        (d / "class").write_text(f"0x{cls:06x}\n")
        (d / "device").write_text(f"0x{device:04x}\n")
        if driver:
            drv = self.sysfs / "bus" / "pci" / "drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            link = d / "driver"
            if link.is_symlink():
                link.unlink()
            link.symlink_to(os.path.relpath(os.path.realpath(drv), d))
        if physfn:
            (d / "physfn").symlink_to(os.path.relpath(os.path.realpath(self.devices / physfn), d))
        return d

    # -- PCIe link fields ------------------------------------------------------------------------------

    def set_link(
        self,
        addr: PciAddress,
        current_width: int | None = 16,
        max_width: int | None = 16,
        current_gts: float | None = 32.0,
        max_gts: float | None = 32.0,
        function: int = 0,
    ) -> None:
        """Writes the four link fields in the kernel's format (`16`, `32.0 GT/s PCIe`); None removes one."""
        d = self.devices / self.sysfs_name(addr, function)
        values = {
            "current_link_width": None if current_width is None else str(current_width),
            "max_link_width": None if max_width is None else str(max_width),
            "current_link_speed": None if current_gts is None else f"{current_gts:.1f} GT/s PCIe",
            "max_link_speed": None if max_gts is None else f"{max_gts:.1f} GT/s PCIe",
        }
        for name, value in values.items():
            f = d / name
            if value is None:
                f.unlink(missing_ok=True)
            else:
                f.write_text(value + "\n")

    def upstream_bridge(self, gpu: int) -> PciAddress:
        """The root port above GPU `gpu` (only with pcie_bridges=True)."""
        real = Path(os.path.realpath(self.devices / self.sysfs_name(self.gpus[gpu].address)))
        addr = PciAddress.parse(real.parent.name)
        if addr is None:
            raise ValueError("this SimHost has no upstream bridges (pcie_bridges=False)")
        return addr

    # -- device nodes ----------------------------------------------------------------------------------

    def make_dev_nodes(self, mig: bool = False, skip: tuple[str, ...] = ()) -> Path:
        """The NVIDIA device nodes a healthy host has, under dev/ (skip: names not to create)."""
        self.dev.mkdir(exist_ok=True)
        nodes = {"nvidiactl": (195, 255), "nvidia-uvm": (510, 0), "nvidia-uvm-tools": (510, 1)}
        for g in self.gpus:
            nodes[f"nvidia{g.minor}"] = (195, g.minor)
        if mig:
            nodes["nvidia-caps/nvidia-cap1"] = (237, 1)
            nodes["nvidia-caps/nvidia-cap2"] = (237, 2)
        for name, (major, minor) in nodes.items():
            if name not in skip:
                self.make_char_device(self.dev / name, major, minor)
        return self.dev

    @staticmethod
    def make_char_device(path: Path, major: int, minor: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        except (PermissionError, OSError):
            path.symlink_to("/dev/null")  # a real character device, no privilege needed

    def remove_dev_node(self, name: str) -> None:
        (self.dev / name).unlink()

    def replace_dev_node_with_file(self, name: str) -> None:
        p = self.dev / name
        p.unlink(missing_ok=True)
        p.write_text("")

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

    def set_ib_port(
        self,
        device: str,
        port: int = 1,
        state: str = "4: ACTIVE",
        phys_state: str = "5: LinkUp",
        rate: str | None = "400 Gb/sec (4X NDR)",
        link_layer: str | None = "InfiniBand",
    ) -> Path:
        """An InfiniBand port under <sysfs>/class/infiniband, in the kernel's formats
        (Documentation/ABI/stable/sysfs-class-infiniband); its error counters start at 0 the first time (a later
        call changes the state and keeps them, as a link going down does)."""
        d = self.sysfs / "class" / "infiniband" / device / "ports" / str(port)
        d.mkdir(parents=True, exist_ok=True)
        (d / "state").write_text(state + "\n")
        (d / "phys_state").write_text(phys_state + "\n")
        if rate is not None:
            (d / "rate").write_text(rate + "\n")
        if link_layer is not None:
            (d / "link_layer").write_text(link_layer + "\n")
        if not (d / "counters").exists():
            self.set_ib_counters(device, port, link_downed=0, symbol_error=0, port_rcv_errors=0, link_error_recovery=0)
        return d

    def add_rail(self, device: str, gpu: int | None = None, port: int = 1, **port_fields: Any) -> Path:
        """An InfiniBand device whose PCI function (a ConnectX, 15b3:1021) sits beside GPU `gpu` (under the same
        upstream bridge: needs pcie_bridges=True), or on its own root port with gpu None, with one port."""
        n = (
            len(list((self.sysfs / "class" / "infiniband").glob("*")))
            if (self.sysfs / "class" / "infiniband").exists()
            else 0
        )
        if gpu is not None:
            parent = Path(os.path.realpath(self.devices / self.sysfs_name(self.gpus[gpu].address))).parent
            bus = 0x80 + n
        else:
            parent, bus = self.pci_root(0), 0xE0 + n
        fn = self.add_pci_function(
            PciAddress(0, bus, 0), 0, 0x020700, 0x1021, vendor=0x15B3, driver="mlx5_core", parent=parent
        )
        d = self.sysfs / "class" / "infiniband" / device
        d.mkdir(parents=True, exist_ok=True)
        link = d / "device"
        if link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(fn, d))
        return self.set_ib_port(device, port, **port_fields)

    def set_ib_counters(self, device: str, port: int = 1, **counters: int | str) -> None:
        """The port's error counters (`link_downed=3`): one decimal number per file, as the kernel writes them."""
        d = self.sysfs / "class" / "infiniband" / device / "ports" / str(port) / "counters"
        d.mkdir(parents=True, exist_ok=True)
        for name, value in counters.items():
            (d / name).write_text(f"{value}\n")

    def ib_port_file(self, device: str, name: str, port: int = 1) -> Path:
        """A file of an InfiniBand port: `state`, `rate`, `link_layer`, `counters/link_downed`, ..."""
        return self.sysfs / "class" / "infiniband" / device / "ports" / str(port) / name

    def link_file(self, gpu: int, name: str = "current_link_width") -> Path:
        """A PCIe link file of GPU `gpu` (its real directory)."""
        return Path(os.path.realpath(self.devices / self.sysfs_name(self.gpus[gpu].address))) / name

    def wedge(self, path: Path) -> Path:
        """Replaces the file at `path` with a FIFO no one writes: a reader's open() blocks until `unwedge`, as a
        read of an attribute whose driver does not answer does."""
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        self._wedged.add(path)
        return path

    def unwedge(self, path: Path | None = None, content: str | None = None) -> None:
        """Lets the readers blocked on the FIFO at `path` (every wedged one when None) go: they read an empty file.
        content: a regular file with it takes the FIFO's place (None: the FIFO stays, a later open blocks again)."""
        for p in [path] if path is not None else sorted(self._wedged):
            try:
                fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)  # only succeeds while a reader waits in open()
                os.close(fd)
            except OSError:
                pass  # no reader blocked now
            if content is not None:
                p.unlink(missing_ok=True)
                p.write_text(content)
                self._wedged.discard(p)

    def load_module(self, name: str, loaded: bool = True) -> None:
        """A kernel module as /sys/module/<name> shows a loaded one (nvidia_peermem)."""
        d = self.sysfs / "module" / name
        if loaded:
            d.mkdir(parents=True, exist_ok=True)
        elif d.exists():
            d.rmdir()

    def set_fabric(
        self,
        state: str = "Completed",
        status: str = "Success",
        clique_id: int | None = 0,
        cluster_uuid: str | None = None,
        health: tuple[tuple[str, str], ...] = (),
        gpus: tuple[int, ...] | None = None,
    ) -> None:
        """The Fabric block nvidia-smi -q shows for the given GPU positions (all by default)."""
        for i, g in enumerate(self.gpus):
            if gpus is None or i in gpus:
                g.fabric_state, g.fabric_status, g.clique_id = state, status, clique_id
                g.cluster_uuid, g.fabric_health = cluster_uuid, health
        self._rewrite(q_output=self.q_fixture if self.q_fixture is not None else smi_q(self.gpus))

    def set_smi_q(self, fixture: str | Path | None = None, exit_code: int = 0) -> None:
        """A captured `nvidia-smi -q` for the fabric read (None: back to the generated one), and its exit code."""
        self.q_fixture = None if fixture is None else Path(fixture).read_text(encoding="utf-8", errors="replace")
        self._rewrite(
            q_output=self.q_fixture if self.q_fixture is not None else smi_q(self.gpus), q_exit_code=exit_code
        )

    def _rewrite(self, **fields: Any) -> None:
        sc = json.loads(self.scenario.read_text())
        sc.update(fields)
        tmp = self.scenario.with_suffix(".tmp")
        tmp.write_text(json.dumps(sc))
        os.replace(tmp, self.scenario)

    def set_imex(self, state: str | None = "READY", exit_code: int = 0) -> Path:
        """The IMEX control tool stand-in: `-q` prints `state` (first line) and exits `exit_code`; state None
        removes the tool."""
        if state is None:
            self.imex_ctl.unlink(missing_ok=True)
            return self.imex_ctl
        self.imex_state.parent.mkdir(parents=True, exist_ok=True)
        self.imex_state.write_text(json.dumps({"output": state + "\n", "exit_code": exit_code}))
        self.imex_ctl.write_text(
            f"#!{sys.executable}\nimport json, sys\nsc = json.load(open({str(self.imex_state)!r}))\n"
            "sys.stdout.write(sc['output']); sys.exit(sc['exit_code'])\n"
        )
        self.imex_ctl.chmod(0o755)
        return self.imex_ctl

    def smi_q_call_count(self) -> int:
        try:
            return int(self.smi_q_calls.read_text() or 0)
        except (OSError, ValueError):
            return 0

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
            "list_output": smi_list(self.gpus),
            "q_output": self.q_fixture if self.q_fixture is not None else smi_q(self.gpus),
            "q_count_file": str(self.smi_q_calls),
            "reset": self._reset,
            "reset_log": str(self.reset_log),
            "compute_apps": "".join(
                f"{self.gpus[i].address.nvml}, {pid}\n" for i, pids in sorted(self._apps.items()) for pid in pids
            ),
        }
        tmp = self.scenario.with_suffix(".tmp")
        tmp.write_text(json.dumps(sc))
        os.replace(tmp, self.scenario)

    def set_reset(
        self,
        mode: str = "ok",
        *,
        seconds: float = 3600,
        after_err: dict[int, tuple[str, ...]] | None = None,
        answer: str | None = None,
        exit_code: int = 255,
        refused: str | None = None,
        held_by_pm: bool = False,
        held_by_files: tuple[str | Path, ...] = (),
        fabric_after: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """What `nvidia-smi -r -i <bus id>` does next: "ok" (exit 0, and the table shows the GPUs healthy, or with
        `after_err`'s ERR! fields: a GPU that came back broken), "fail" (exit 255 with words that are neither a refusal
        nor "not supported": a failed reset),
        "hang" (sleeps `seconds`), "answer" (prints `answer`, a real reset's words, and exits `exit_code`).
        With "ok", the reset is refused with `refused` (exit 255) while persistence mode is on for that GPU
        (`held_by_pm`) or while any of `held_by_files` exists (a holder: a pod, a daemon); `fabric_after`: the
        (state, status) of every GPU's fabric for the `nvidia-smi -q` reads after the reset, one per read, the
        last one staying."""
        saved = [g.err_fields for g in self.gpus]
        for i, g in enumerate(self.gpus):
            g.err_fields = tuple((after_err or {}).get(i, ()))
        after = smi_table(self.gpus)
        for g, e in zip(self.gpus, saved, strict=True):
            g.err_fields = e
        q_after = None
        if fabric_after:
            keep = [(g.fabric_state, g.fabric_status) for g in self.gpus]
            q_after = []
            for state, status in fabric_after:
                for g in self.gpus:
                    g.fabric_state, g.fabric_status = state, status
                q_after.append(smi_q(self.gpus))
            for g, (state, status) in zip(self.gpus, keep, strict=True):
                g.fabric_state, g.fabric_status = state, status
        self._reset = {
            "mode": mode, "seconds": seconds, "output_after": after, "answer": answer, "exit_code": exit_code,
            "refused": refused, "held_by_pm": held_by_pm, "held_by_files": [str(f) for f in held_by_files],
            "q_after": q_after,
        }  # fmt: skip
        self._rewrite_recovery()

    def set_persistence(self, gpu: int, on: bool = True) -> None:
        """Persistence mode of one GPU as `nvidia-smi --query-gpu=persistence_mode` reports it."""
        sc = json.loads(self.scenario.read_text())
        sc.setdefault("pm", {})[self.gpus[gpu].address.nvml] = "Enabled" if on else "Disabled"
        self._rewrite(pm=sc["pm"])

    def persistence(self, gpu: int) -> str:
        return str((json.loads(self.scenario.read_text()).get("pm") or {}).get(self.gpus[gpu].address.nvml, "Disabled"))

    def persistence_changes(self) -> list[str]:
        """`<bus id> 0|1` per `nvidia-smi -pm` run so far."""
        try:
            return Path(str(self.reset_log) + ".pm").read_text().splitlines()
        except OSError:
            return []

    def hold_dev_node(self, gpu: int, pid: int, comm: str) -> Path:
        """A process (in the simulated /proc) with /dev/nvidia<minor> of GPU `gpu` open; returns its /proc dir."""
        d = self.proc / str(pid)
        (d / "fd").mkdir(parents=True, exist_ok=True)
        (d / "comm").write_text(comm + "\n")
        link = d / "fd" / "3"
        if not link.is_symlink():
            link.symlink_to(self.dev / f"nvidia{self.gpus[gpu].minor}")
        return d

    def hold_gpu(self, gpu: int, *pids: int) -> None:
        """Processes with GPU `gpu` open, as `nvidia-smi --query-compute-apps` lists them (none: released)."""
        if pids:
            self._apps[gpu] = pids
        else:
            self._apps.pop(gpu, None)
        self._rewrite_recovery()

    def _rewrite_recovery(self) -> None:
        self._rewrite(
            reset=self._reset,
            compute_apps="".join(
                f"{self.gpus[i].address.nvml}, {pid}\n" for i, pids in sorted(self._apps.items()) for pid in pids
            ),
        )

    def resets(self) -> list[str]:
        """The arguments of every `nvidia-smi -r` run so far."""
        try:
            return self.reset_log.read_text().splitlines()
        except OSError:
            return []

    def smi_call_count(self) -> int:
        try:
            return int(self.smi_calls.read_text() or 0)
        except (OSError, ValueError):
            return 0

    # -- kernel log ----------------------------------------------------------------------------------

    def append_kmsg(self, *texts: str, facility: int = 0, level: int = 3, apart_s: float = 0.001) -> None:
        """Appends records `apart_s` seconds apart in kernel-log time (1 ms: one burst, as a fault prints it)."""
        with open(self.kmsg, "a", encoding="utf-8") as fh:
            for t in texts:
                self._seq += 1
                self._usec += max(1, int(apart_s * 1_000_000))
                fh.write(format_record(t, self._seq, self._usec, facility, level))

    def skip_seq(self, n: int) -> None:
        """Simulates records overwritten before they were read (the next seq jumps by n)."""
        self._seq += n

    def xid_line(self, xid: int, gpu: int = 0, text: str | None = None) -> str:
        a = self.gpus[gpu].address
        default = {79: "GPU has fallen off the bus."}.get(xid, "Graphics Exception")
        return f"NVRM: Xid (PCI:{a.kernel}): {xid}, pid='<unknown>', name=<unknown>, {text or default}"

    def append_xid(self, xid: int, gpu: int = 0, text: str | None = None, apart_s: float = 0.001) -> None:
        """One Xid record, `apart_s` seconds of kernel-log time after the previous record (give a few seconds for
        a separate occurrence: records within a second of each other are one burst to the Xid rate)."""
        self.append_kmsg(self.xid_line(xid, gpu, text), apart_s=apart_s)

    def new_boot(self) -> str:
        bid = str(uuid.uuid4())
        self.boot_id_file.write_text(bid + "\n")
        return bid

    def check_args(self) -> list[str]:
        """Flags that point `gpu-ready check` at this host (a healthy set of device nodes, nvidia-caps included,
        is made unless dev/ exists)."""
        if not self.dev.exists():
            self.make_dev_nodes(mig=True)
        return [
            *("--dev-root", str(self.dev), "--proc-root", str(self.proc)),
            *("--nvidia-smi", str(self.nvidia_smi), "--sysfs-root", str(self.sysfs)),
            *("--kmsg", str(self.kmsg), "--nvml", "off"),
        ]

    def agent_args(self) -> list[str]:
        """Flags that point `gpu-ready run` at this host: check_args plus the state directory and boot ID."""
        return [*self.check_args(), "--state-dir", str(self.state_dir), "--boot-id-file", str(self.boot_id_file)]

    def gpu_uuids(self) -> list[tuple[PciAddress, str, list[str]]]:
        """(bus id, `GPU-...` UUID, [`MIG-...` UUIDs]) per simulated GPU, in bus order; the MIG UUIDs follow the
        MIG devices of the last `set_smi(mig=...)`. Stable across runs (derived from the bus id)."""
        return [(g.address, g.uuid, g.mig_uuids) for g in self.gpus]

    def plugin_resources(self, n: int | None = None) -> dict[str, str]:
        return {"nvidia.com/gpu": str(len(self.gpus) if n is None else n)}


class DcgmExporterStandIn:
    """Serves dcgm-exporter metric text on 127.0.0.1 (`/metrics`), as the real exporter does on :9400.
    `text` is served as set; `status` other than 200 answers with that HTTP status."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.status = 200
        self.requests = 0
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in.requests += 1
                body = stand_in.text.encode()
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                if stand_in.status != 200:
                    self.send_error(stand_in.status)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="dcgm-standin", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> DcgmExporterStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def buses_free_in_kmsg(n: int = 8, device: str = "/dev/kmsg") -> tuple[int, ...]:
    """`n` random PCI bus numbers that no record in the machine's real kernel ring buffer names. The ring buffer
    lives as long as the machine, and earlier test runs (or another run going on) wrote Xid records there: a
    simulated GPU on one of those buses would read as failed before its test writes anything."""
    import random

    from agent.kernel_log.xid import KernelLogParser

    used: set[int] = set()
    src, parser = KmsgSource(device, trust_user=True), KernelLogParser()
    try:
        for records in src.drain():
            used |= {ev.address.bus for r in records for ev in parser.feed(r.text) if ev.address is not None}
    finally:
        src.close()
    free = [b for b in range(0x10, 0xF0) if b not in used]
    return tuple(sorted(random.sample(free, n)))
