"""Raw public text turned into what the probes read, deterministically (docs/agent.md, "Bundles from raw text").

A bundle assembled from published captures has no NVML record, no sysfs tree and no kmsg file; it has the text of
`nvidia-smi -q`, `nvidia-smi nvlink -s`, `ibstat`, a sysfs listing, `lspci`, `dmesg`. Each function here reads one
such text (linear, line by line, every line cut to MAX_LINE) and writes the inputs the probes take:
- `nvml_from_smi_q`: the NVML calls the probe makes, answered as `nvidia-smi -q` shows them (nvidia-smi reads the
  same library): the GPU count, each GPU's bus id, name, UUID, recovery action, remapped rows, MIG mode, PCIe link
  and utilisation and fabric state, health and summary; the NVLink states from `nvlink -s`. A reading the text does
  not show is left out of the record (the replay then lists it as not captured);
- `pci_from_lspci`: PCI functions (class, vendor, device, bound driver, link width and speed from `-vvv`);
- `infiniband_from_ibstat`, `infiniband_from_listing`, `infiniband_from_ibv_devinfo`: the InfiniBand ports in the
  kernel's sysfs formats;
- `kmsg_from_dmesg`: kernel-log lines in any common timestamp form as /dev/kmsg records.
Nothing is invented: what the text lacks stays absent."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC
from typing import Any

from agent.bundle_nvml import FORMAT as NVML_FORMAT
from agent.kernel_log.source import format_record
from agent.model import PciAddress
from agent.probes.fabric import INCORRECT_CONFIGURATION, MISCONFIGURATION_FIELD
from agent.probes.nvidia_smi import parse_smi_table

MAX_LINE = 1024
MAX_GPUS = 64
FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NOT_SUPPORTED = 3
ENABLED, DISABLED = 1, 0
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS: links a probe asks about at most
_GPU_LINE = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_KV = re.compile(r"^( *)([A-Za-z0-9][^:]{0,80}?)\s*:\s?(.{0,300})$")
_HEAD = re.compile(r"^( *)([A-Za-z][A-Za-z0-9 ./()-]{0,80}?)\s*$")
RECOVERY = {"none": 0, "gpu reset": 1, "node reboot": 2, "drain p2p": 3, "drain and reset": 4}
FABRIC_STATE = {"not started": 1, "in progress": 2, "completed": 3}
SUMMARY = {"healthy": 1, "unhealthy": 2, "limited capacity": 3}


def _lines(text: str) -> Iterator[str]:
    for raw in text.splitlines():
        yield raw[:MAX_LINE].rstrip().expandtabs(4)


def parse_smi_q_sections(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str]]]]:
    """(top-level keys, [(bus id, {"Section/Key": value})]) of `nvidia-smi -q` text; the first value of a key wins."""
    top: dict[str, str] = {}
    gpus: list[tuple[str, dict[str, str]]] = []
    cur: dict[str, str] | None = None
    stack: list[tuple[int, str]] = []
    for line in _lines(text):
        m = _GPU_LINE.match(line)
        if m:
            if len(gpus) >= MAX_GPUS:
                break
            cur, stack = {}, []
            gpus.append((m[1], cur))
            continue
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if cur is None or indent == 0:
            kv = _KV.match(line)
            if kv and indent == 0:
                cur = None
                top.setdefault(kv[2].strip(), kv[3].strip())
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        kv = _KV.match(line)
        if kv:
            key = "/".join([*(s for _, s in stack), kv[2].strip()])
            cur.setdefault(key, kv[3].strip())
            continue
        h = _HEAD.match(line)
        if h:
            stack.append((indent, h[2].strip()))
    return top, gpus


XML_KEYS = {
    "product_name": "Product Name",
    "uuid": "GPU UUID",
    "gpu_recovery_action": "GPU Recovery Action",
    "mig_mode/current_mig": "MIG Mode/Current",
    "mig_mode/pending_mig": "MIG Mode/Pending",
    "remapped_rows/remapped_row_corr": "Remapped Rows/Correctable Error",
    "remapped_rows/remapped_row_unc": "Remapped Rows/Uncorrectable Error",
    "remapped_rows/remapped_row_pending": "Remapped Rows/Pending",
    "remapped_rows/remapped_row_failure": "Remapped Rows/Remapping Failure Occurred",
    "utilization/gpu_util": "Utilization/Gpu",
    "utilization/memory_util": "Utilization/Memory",
    "pci/pci_gpu_link_info/pcie_gen/max_link_gen": "GPU Link Info/PCIe Generation/Max",
    "pci/pci_gpu_link_info/pcie_gen/current_link_gen": "GPU Link Info/PCIe Generation/Current",
    "pci/pci_gpu_link_info/link_widths/max_link_width": "GPU Link Info/Link Width/Max",
    "pci/pci_gpu_link_info/link_widths/current_link_width": "GPU Link Info/Link Width/Current",
    "fabric/state": "Fabric/State",
    "fabric/status": "Fabric/Status",
    "fabric/cliqueId": "Fabric/CliqueId",
    "fabric/clusterUuid": "Fabric/ClusterUUID",
}
XML_HEALTH = {
    "bandwidth": "Bandwidth",
    "route_recovery_in_progress": "Route Recovery in progress",
    "route_unhealthy": "Route Unhealthy",
    "access_timeout_recovery": "Access Timeout Recovery",
    "incorrect_configuration": MISCONFIGURATION_FIELD,
    "summary": "Summary",
}
MAX_XML = 8 << 20


def parse_smi_q_xml(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str]]], dict[str, int]]:
    """`nvidia-smi -q -x` as parse_smi_q_sections gives the text (the same keys), and each GPU's MIG devices. A
    document with entity declarations is refused (nothing is expanded); a broken one gives what was read: nothing."""
    import xml.etree.ElementTree as ET

    if len(text) > MAX_XML or "<!ENTITY" in text:
        return {}, [], {}
    body = re.sub(r"<!DOCTYPE[^>\[]{0,300}>", "", text, count=1)
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return {}, [], {}
    top = {"Driver Version": (root.findtext("driver_version") or "").strip()}
    gpus: list[tuple[str, dict[str, str]]] = []
    migs: dict[str, int] = {}
    for g in root.findall("gpu")[:MAX_GPUS]:
        bus = g.get("id", "")
        keys = {}
        for path, key in XML_KEYS.items():
            v = g.findtext(path)
            if v is not None and v.strip():
                keys[key] = v.strip()
        health = g.find("fabric/health")
        for child in list(health) if health is not None else []:
            name = XML_HEALTH.get(child.tag)
            if name and child.text:
                keys[f"Fabric/Health/{name}"] = child.text.strip()
        if keys.get("Remapped Rows/Pending") is None and (g.findtext("remapped_rows") or "").strip() == "N/A":
            keys["Remapped Rows/Pending"] = keys["Remapped Rows/Remapping Failure Occurred"] = "N/A"
        migs[bus] = len(g.findall("mig_devices/mig_device"))
        gpus.append((bus, keys))
    return top, gpus, migs


def parse_nvlink_status(text: str) -> dict[int, list[int] | None]:
    """`nvidia-smi nvlink -s`: per GPU index, each link's state (1 up, 0 inactive), or None for "all links are
    inactive"."""
    out: dict[int, list[int] | None] = {}
    gpu: int | None = None
    for line in _lines(text):
        s = line.strip()
        m = re.match(r"^GPU (\d{1,4}):", s)
        if m:
            gpu = int(m[1])
            out[gpu] = []
            continue
        if gpu is None:
            continue
        if "all links are inactive" in s:
            out[gpu] = None
            continue
        m = re.match(r"^Link (\d{1,2}):\s*(.{0,60})$", s)
        if m and out[gpu] is not None:
            links = out[gpu]
            assert links is not None
            links.append(DISABLED if "inactive" in m[2].lower() else ENABLED)
    return out


def _int(v: str | None) -> int | None:
    if v is None:
        return None
    m = re.match(r"^\s*(\d{1,10})", v)
    return int(m[1]) if m else None


def _call(name: str, args: list[Any], **outcome: Any) -> dict[str, Any]:
    return {"call": name, "args": args, **outcome}


def _uuid_bytes(text: str | None) -> list[int] | None:
    h = (text or "").replace("-", "")
    if len(h) != 32 or not all(c in "0123456789abcdefABCDEF" for c in h):
        return None
    return list(bytes.fromhex(h))


def encode_health(health: dict[str, str]) -> int:
    """nvidia-smi's fabric Health words as NVML's health mask (the inverse of probes/fabric.decode_health)."""
    mask = 0
    for name, shift, yes, no in (
        ("Bandwidth", 0, "Degraded", "Full"),
        ("Route Recovery in progress", 2, "True", "False"),
        ("Route Unhealthy", 4, "True", "False"),
        ("Access Timeout Recovery", 6, "True", "False"),
    ):
        v = health.get(name)
        if v == yes:
            mask |= 1 << shift
        elif v == no:
            mask |= 2 << shift
    wrong = health.get(MISCONFIGURATION_FIELD)
    codes = {v: k for k, v in INCORRECT_CONFIGURATION.items()}
    if wrong == "None":
        mask |= 1 << 8
    elif wrong in codes:
        mask |= codes[wrong] << 8
    gfm = health.get("Global Fabric Manager")
    if gfm in ("Connected", "Disconnected"):
        mask |= (1 if gfm == "Connected" else 2) << 14
    return mask


def _fabric(keys: dict[str, str]) -> dict[str, Any] | None:
    """The fabric structure NVML fills, from the GPU's Fabric block; None when the block is absent."""
    state = keys.get("Fabric/State")
    if state is None:
        return None
    code = FABRIC_STATE.get(state.lower())
    if code is None:
        return _call("nvmlDeviceGetGpuFabricInfoV", [{"_handle": ""}, "&"], error=NOT_SUPPORTED)
    status_text = keys.get("Fabric/Status", "Success")
    status = 0 if status_text in ("Success", "N/A") else _nvml_error_code(status_text)
    health = {k.split("/", 2)[2]: v for k, v in keys.items() if k.startswith("Fabric/Health/")}
    fields: dict[str, Any] = {
        "state": code,
        "status": status,
        "cliqueId": _int(keys.get("Fabric/CliqueId")) or 0,
        "healthMask": encode_health(health),
    }
    summary = SUMMARY.get(health.get("Summary", "").lower())
    if summary is not None:
        fields["healthSummary"] = summary
    uuid = _uuid_bytes(keys.get("Fabric/ClusterUUID"))
    if uuid is not None:
        fields["clusterUuid"] = uuid
    return _call("nvmlDeviceGetGpuFabricInfoV", [{"_handle": ""}, "&"], out={"_struct": fields})


def _nvml_error_code(words: str) -> int:
    import pynvml

    name = "NVML_ERROR_" + re.sub(r"[^A-Z0-9]+", "_", words.upper()).strip("_")
    return int(getattr(pynvml, name, 999))


def nvlink_names(text: str) -> dict[int, str]:
    """The GPU names `nvlink -s` prints (`GPU 6: NVIDIA A100-SXM4-80GB (UUID: ...)`), by index."""
    out = {}
    for line in _lines(text):
        m = re.match(r"^GPU (\d{1,4}): (.{1,80}?)(?: \(UUID: [^)]{0,80}\))?$", line.strip())
        if m:
            out[int(m[1])] = m[2].strip()
    return out


def gpus_without_q(
    table_text: str | None, lspci_text: str | None, nvlink_text: str | None = None
) -> list[tuple[str, dict[str, str]]]:
    """The GPUs in NVML's index order where no `nvidia-smi -q` was published: the table's (by index), else lspci's
    NVIDIA display functions in PCI bus order (the order NVML enumerates them), else the GPUs `nvlink -s` lists, in
    its order, with no bus id (not shown there: NVML's PCI reading stays not captured)."""
    if table_text is not None:
        table = parse_smi_table(table_text)
        if table.gpus:
            return [(g.address.nvml, {"Product Name": g.name}) for g in sorted(table.gpus, key=lambda g: g.index)]
    if lspci_text is not None:
        fns = pci_from_lspci(lspci_text)
        addrs = [PciAddress.parse(n) for n, f in fns.items() if f["vendor"] == 0x10DE and f["class"] >> 16 == 0x03]
        if addrs:
            return [(a.nvml, {}) for a in sorted(a for a in addrs if a is not None)]
    if nvlink_text is not None:
        return [
            ("", {"Product Name": name, "nvlink index": str(i)})
            for i, name in sorted(nvlink_names(nvlink_text).items())
        ]
    return []


def nvml_from_raw(
    q_text: str | None,
    nvlink_text: str | None = None,
    table_text: str | None = None,
    lspci_text: str | None = None,
    dmesg_text: str | None = None,
    xml_text: str | None = None,
) -> dict[str, Any] | None:
    """An NVML record from the raw views: `nvidia-smi -q` (nvml_from_smi_q), else `nvidia-smi -q -x`; without
    either, the NVLink states of `nvlink -s` on the GPUs of the table, lspci or `nvlink -s` itself. None when none of
    them names a GPU (NVML's readings would then say nothing the other probes do not)."""
    if q_text is not None:
        record = nvml_from_smi_q(q_text, nvlink_text, table_text, driver=driver_version(table_text, dmesg_text))
        if record["gpus"]:
            return record
    if xml_text is not None:
        top, gpus, migs = parse_smi_q_xml(xml_text)
        if gpus:
            record = nvml_from_smi_q(
                "", nvlink_text, table_text, gpus=gpus, driver=top.get("Driver Version") or None, mig_devices=migs
            )
            record["derived"] = "nvidia-smi -q -x"
            return record
    if nvlink_text is None:
        return None
    gpus = gpus_without_q(table_text, lspci_text, nvlink_text)
    if not gpus:
        return None
    record = nvml_from_smi_q("", nvlink_text, table_text, gpus=gpus, driver=driver_version(table_text, dmesg_text))
    record["derived"] = "nvlink -s"
    return record


def nvml_from_smi_q(
    q_text: str,
    nvlink_text: str | None = None,
    table_text: str | None = None,
    gpus: list[tuple[str, dict[str, str]]] | None = None,
    driver: str | None = None,
    mig_devices: dict[str, int] | None = None,
) -> dict[str, Any]:
    """An NVML record (agent/bundle_nvml.py) of what `nvidia-smi -q` (and `nvlink -s`, and the table's MIG devices)
    show; each GPU in the order -q lists them, which is NVML's index order (`gpus`: that list from elsewhere)."""
    top, from_q = parse_smi_q_sections(q_text)
    gpus = from_q if gpus is None else gpus
    links = parse_nvlink_status(nvlink_text) if nvlink_text is not None else {}
    names = nvlink_names(nvlink_text) if nvlink_text is not None else {}
    for i, (_, keys) in enumerate(gpus):
        if "Product Name" not in keys and i in names:
            keys["Product Name"] = names[i]
    migs: dict[PciAddress, int] = {}
    for bus, n in (mig_devices or {}).items():
        if (a := PciAddress.parse(bus)) is not None:
            migs[a] = n
    if table_text is not None:
        migs.update({g.address: g.mig_devices for g in parse_smi_table(table_text).gpus})
    system = [_call("nvmlInit", [], value=None)]
    # The probe reads the driver version with the GPU count: where no text names it, an empty answer (says nothing).
    version = top.get("Driver Version") or driver or ""
    system.append(_call("nvmlSystemGetDriverVersion", [], value=version))
    system.append(_call("nvmlDeviceGetCount", [], value=len(gpus)))
    out = []
    for i, (bus, keys) in enumerate(gpus):
        h = f"gpu{i}"
        calls = [_call("nvmlDeviceGetHandleByIndex", [i])]

        def add(name: str, *args: Any, h: str = h, calls: list[dict[str, Any]] = calls, **outcome: Any) -> None:
            calls.append(_call(name, [{"_handle": h}, *args], **outcome))

        if bus:
            add("nvmlDeviceGetPciInfo", value={"_struct": {"busId": bus}})
        if "Product Name" in keys:
            add("nvmlDeviceGetName", value=keys["Product Name"])
        if keys.get("GPU UUID", "N/A") != "N/A":
            add("nvmlDeviceGetUUID", value=keys["GPU UUID"])
        action = keys.get("GPU Recovery Action")
        if action is not None and action.lower() in RECOVERY:
            value = {"_struct": {"uiVal": RECOVERY[action.lower()]}}
            add(
                "nvmlDeviceGetFieldValues",
                [FI_DEV_GET_GPU_RECOVERY_ACTION],
                value=[{"_struct": {"nvmlReturn": 0, "value": value}}],
            )
        rr = [keys.get(f"Remapped Rows/{k}") for k in ("Correctable Error", "Uncorrectable Error", "Pending")]
        failure = keys.get("Remapped Rows/Remapping Failure Occurred")
        if rr[2] is not None and failure is not None:
            if "N/A" in (rr[2], failure):
                add("nvmlDeviceGetRemappedRows", error=NOT_SUPPORTED)
            else:
                pending, failed = rr[2] == "Yes", failure == "Yes"
                add("nvmlDeviceGetRemappedRows", value=[_int(rr[0]) or 0, _int(rr[1]) or 0, pending, failed])
        mig = keys.get("MIG Mode/Current")
        if mig is not None:
            if mig in ("Enabled", "Disabled"):
                add(
                    "nvmlDeviceGetMigMode",
                    value=[int(mig == "Enabled"), int(keys.get("MIG Mode/Pending") == "Enabled")],
                )
            else:
                add("nvmlDeviceGetMigMode", error=NOT_SUPPORTED)
            addr = PciAddress.parse(bus)
            if mig == "Enabled" and addr is not None and addr in migs:
                n = migs[addr]
                add("nvmlDeviceGetMaxMigDeviceCount", value=n)
                for k in range(n):
                    add("nvmlDeviceGetMigDeviceHandleByIndex", k)
        at = int(keys.get("nvlink index", i))  # nvlink -s's own index where the GPU list came from it
        if at in links:
            states = links[at]
            if states is None:  # "all links are inactive": each link answers disabled, as the library does
                states = [DISABLED] * MAX_LINKS
            for k, st in enumerate(states[:MAX_LINKS]):
                add("nvmlDeviceGetNvLinkState", k, value=st)
            if len(states) < MAX_LINKS:
                add("nvmlDeviceGetNvLinkState", len(states), error=NOT_SUPPORTED)
        util = _int(keys.get("Utilization/Gpu"))
        if util is not None:
            add(
                "nvmlDeviceGetUtilizationRates",
                value={"_struct": {"gpu": util, "memory": _int(keys.get("Utilization/Memory")) or 0}},
            )
        for fn, key in (
            ("nvmlDeviceGetCurrPcieLinkGeneration", "GPU Link Info/PCIe Generation/Current"),
            ("nvmlDeviceGetMaxPcieLinkGeneration", "GPU Link Info/PCIe Generation/Max"),
            ("nvmlDeviceGetCurrPcieLinkWidth", "GPU Link Info/Link Width/Current"),
            ("nvmlDeviceGetMaxPcieLinkWidth", "GPU Link Info/Link Width/Max"),
        ):
            v = _int(keys.get(key))
            if v is not None:
                add(fn, value=v)
        fab = _fabric(keys)
        if fab is not None:
            fab["args"][0] = {"_handle": h}
            calls.append(fab)
        out.append({"gpu": h, "calls": calls})
    return {"format": NVML_FORMAT, "derived": "nvidia-smi -q", "calls": system, "gpus": out}


# -- PCI -------------------------------------------------------------------------------------------------

CLASS_NAMES = {
    "3d controller": 0x030200,
    "vga compatible controller": 0x030000,
    "display controller": 0x038000,
    "bridge": 0x068000,
    "pci bridge": 0x060400,
    "infiniband controller": 0x020700,
    "ethernet controller": 0x020000,
    "network controller": 0x028000,
    "audio device": 0x040300,
    "usb controller": 0x0C0330,
    "serial bus controller": 0x0C8000,
}
VENDOR_NAMES = {"nvidia": 0x10DE, "mellanox": 0x15B3, "intel": 0x8086, "broadcom": 0x14E4, "amd": 0x1022}
_LSPCI_HEAD = re.compile(
    r"^(?:([0-9A-Fa-f]{4,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])\s+([^:\[]{1,60}?)\s*(?:\[([0-9A-Fa-f]{4})\])?:\s*(.{0,300})$"
)
_IDS = re.compile(r"\[([0-9A-Fa-f]{4}):([0-9A-Fa-f]{4})\]")
_DEVICE_WORD = re.compile(r"\bDevice ([0-9A-Fa-f]{4})\b")
_LNK = re.compile(r"Speed ([0-9.]{1,5})GT/s[^,]{0,30}, Width x(\d{1,2})")


def pci_from_lspci(text: str) -> dict[str, dict[str, Any]]:
    """{"dddd:bb:dd.f": {class, vendor, device, driver, link fields}} of the functions `lspci` lists."""
    out: dict[str, dict[str, Any]] = {}
    cur: dict[str, Any] | None = None
    for line in _lines(text):
        m = _LSPCI_HEAD.match(line)
        if m:
            dom = int(m[1] or "0", 16)
            name = f"{dom:04x}:{m[2].lower()}:{m[3].lower()}.{m[4]}"
            rest = m[7]
            cls = int(m[6], 16) << 8 if m[6] else CLASS_NAMES.get(m[5].strip().lower())
            ids = _IDS.search(rest)
            vendor = (
                int(ids[1], 16)
                if ids
                else next((v for k, v in VENDOR_NAMES.items() if rest.lower().startswith(k)), None)
            )
            dev = int(ids[2], 16) if ids else (int(d[1], 16) if (d := _DEVICE_WORD.search(rest)) else None)
            if cls is None or vendor is None or len(out) >= 4096:
                cur = None
                continue
            cur = {"class": cls, "vendor": vendor, "device": dev or 0}
            out[name] = cur
            continue
        if cur is None:
            continue
        s = line.strip()
        if s.startswith("Kernel driver in use:"):
            cur["driver"] = s.split(":", 1)[1].strip()[:64]
        elif s.startswith("LnkCap:") and (lk := _LNK.search(s)):
            cur["max_link_speed"], cur["max_link_width"] = f"{float(lk[1]):.1f} GT/s PCIe", lk[2]
        elif s.startswith("LnkSta:") and (lk := _LNK.search(s)):
            cur["current_link_speed"], cur["current_link_width"] = f"{float(lk[1]):.1f} GT/s PCIe", lk[2]
    return out


def sys_from_pci(functions: dict[str, dict[str, Any]]) -> dict[str, bytes]:
    """sysfs files for the PCI functions (each a plain folder under bus/pci/devices, no bridges: lspci's flat list
    does not say which switch a function sits below) and a folder per bound driver."""
    files: dict[str, bytes] = {}
    for name, f in functions.items():
        d = f"sys/bus/pci/devices/{name}"
        files[f"{d}/vendor"] = f"0x{f['vendor']:04x}\n".encode()
        files[f"{d}/class"] = f"0x{f['class']:06x}\n".encode()
        files[f"{d}/device"] = f"0x{f['device']:04x}\n".encode()
        for k in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width"):
            if k in f:
                files[f"{d}/{k}"] = f"{f[k]}\n".encode()
    return files


def pci_driver_links(functions: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {
        f"sys/bus/pci/devices/{name}/driver": f"../../drivers/{f['driver']}"
        for name, f in functions.items()
        if f.get("driver") and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f["driver"])
    }


# -- InfiniBand ------------------------------------------------------------------------------------------

IB_STATE = {"down": "1: DOWN", "initializing": "2: INIT", "init": "2: INIT", "armed": "3: ARMED", "active": "4: ACTIVE"}
IB_PHYS = {
    "sleep": "1: Sleep",
    "polling": "2: Polling",
    "disabled": "3: Disabled",
    "portconfigurationtraining": "4: PortConfigurationTraining",
    "linkup": "5: LinkUp",
    "linkerrorrecovery": "6: LinkErrorRecovery",
    "phytest": "7: Phy Test",
}
IB_FILES = re.compile(
    r"^(?:hca_type|board_id|fw_ver|node_type|ports/\d{1,3}/(?:state|phys_state|rate|link_layer|counters/[a-z_]{1,40}"
    r"|hw_counters/[a-z_]{1,40}|gid_attrs/ndevs/\d{1,3}))$"
)
_DEV = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _ib_file(dev: str, rel: str, value: str) -> tuple[str, bytes] | None:
    if not _DEV.match(dev) or not IB_FILES.match(rel):
        return None
    return f"sys/class/infiniband/{dev}/{rel}", (value.strip()[:200] + "\n").encode()


def infiniband_from_ibstat(text: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    dev: str | None = None
    port: str | None = None
    for line in _lines(text):
        s = line.strip()
        m = re.match(r"^CA '([^']{1,64})'$", s)
        if m:
            dev, port = m[1], None
            continue
        if dev is None:
            continue
        m = re.match(r"^Port (\d{1,3}):$", s)
        if m:
            port = m[1]
            continue
        key, _, value = s.partition(":")
        key, value = key.strip().lower(), value.strip()
        got: tuple[str, str] | None = None
        if port is None and key == "ca type":
            got = ("hca_type", value)
        elif port is not None and key == "state" and value.lower() in IB_STATE:
            got = (f"ports/{port}/state", IB_STATE[value.lower()])
        elif port is not None and key == "physical state" and value.lower() in IB_PHYS:
            got = (f"ports/{port}/phys_state", IB_PHYS[value.lower()])
        elif port is not None and key == "rate" and re.fullmatch(r"\d{1,4}(?:\.\d{1,3})?", value):
            got = (f"ports/{port}/rate", f"{value} Gb/sec")
        elif port is not None and key == "link layer":
            got = (f"ports/{port}/link_layer", value)
        if got is not None and (f := _ib_file(dev, *got)) is not None:
            files[f[0]] = f[1]
    return files


def infiniband_from_listing(text: str) -> dict[str, bytes]:
    """`path: value` or `path value` lines of /sys/class/infiniband files (as `grep . .../*` prints them), the path
    whole (`/sys/class/infiniband/mlx5_0/ports/1/state`) or from the device on (`mlx5_0/ports/1/state`)."""
    files: dict[str, bytes] = {}
    for line in _lines(text):
        at = line.find("class/infiniband/")
        rest = line[at + len("class/infiniband/") :] if at >= 0 else line.strip()
        path, _, value = rest.partition(" ")
        if path.endswith(":"):
            path = path[:-1]
        elif ":" in path:  # `grep . file` without a space: path:value
            path, _, v2 = path.partition(":")
            value = f"{v2} {value}".strip()
        dev, _, rel = path.partition("/")
        if (f := _ib_file(dev, rel, value)) is not None:
            files[f[0]] = f[1]
    return files


def infiniband_from_ibv_devinfo(text: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    dev: str | None = None
    port: str | None = None
    width: int | None = None
    for line in _lines(text):
        s = line.strip()
        key, _, value = s.partition(":")
        key, value = key.strip(), value.strip()
        got: list[tuple[str, str]] = []
        if key == "hca_id":
            dev, port = value, None
        elif dev is None:
            continue
        elif key == "port":
            port, width = value if value.isdigit() else None, None
        elif key == "board_id" and port is None:
            got.append(("board_id", value))
        elif key == "vendor_part_id" and port is None and value.isdigit():
            got.append(("hca_type", f"MT{value}"))
        elif port is not None and key == "state" and (m := re.search(r"\((\d)\)", value)):
            name = {"1": "DOWN", "2": "INIT", "3": "ARMED", "4": "ACTIVE"}.get(m[1])
            if name:
                got.append((f"ports/{port}/state", f"{m[1]}: {name}"))
        elif port is not None and key == "phys_state" and (m := re.search(r"\((\d)\)", value)):
            name = next((v for v in IB_PHYS.values() if v.startswith(m[1] + ":")), None)
            if name:
                got.append((f"ports/{port}/phys_state", name))
        elif port is not None and key == "link_layer":
            got.append((f"ports/{port}/link_layer", value))
        elif port is not None and key == "active_width" and (m := re.match(r"(\d{1,2})X", value)):
            width = int(m[1])
        elif port is not None and key == "active_speed" and width and (m := re.match(r"([0-9.]{1,6}) Gbps", value)):
            got.append((f"ports/{port}/rate", f"{float(m[1]) * width:g} Gb/sec"))
        for rel, v in got:
            if dev is not None and (f := _ib_file(dev, rel, v)) is not None:
                files[f[0]] = f[1]
    return files


# -- kernel log -------------------------------------------------------------------------------------------

_BRACKET_TS = re.compile(r"^\[\s{0,12}(\d{1,10})\.(\d{1,9})\]\s?")
_BRACKET_CTIME = re.compile(r"^\[([A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2} \d{4})\]\s?")
_BRACKET_ANY = re.compile(r"^\[[^\]]{1,40}\]\s?")
_ISO_TS = re.compile(r"(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2}:\d{2})(?:[.,](\d{1,9}))?([+-]\d{2}:?\d{2}|Z)?\s")
_SYSLOG_TS = re.compile(r"^([A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2}) ")
_FACILITY = re.compile(r"^[a-z]{2,8}\s{0,2}:[a-z]{2,8}\s{0,2}: ")  # dmesg -x: "kern  :warn  : "
_KERNEL = re.compile(r"^.{0,120}?\bkernel:\s?")
MAX_RECORDS = 100_000


def _wall_seconds(line: str) -> tuple[float | None, str]:
    """A wall-clock stamp at the line's head (ISO, `[Mon Jan 20 10:18:26 2025]`, syslog `Jan 20 10:18:26`) in
    seconds, and the line without it."""
    from datetime import datetime

    m = _ISO_TS.match(line)
    if m:
        try:
            t = datetime.strptime(f"{m[1]} {m[2]}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
        except ValueError:
            return None, line
        return t + (int(m[3].ljust(6, "0")[:6]) / 1e6 if m[3] else 0.0), line[m.end() :]
    for pattern, fmt in ((_BRACKET_CTIME, "%a %b %d %H:%M:%S %Y"), (_SYSLOG_TS, "%b %d %H:%M:%S")):
        m = pattern.match(line)
        if m:
            try:
                t = datetime.strptime(" ".join(m[1].split()), fmt).replace(tzinfo=UTC).timestamp()
            except ValueError:
                return None, line
            return t, line[m.end() :]
    return None, line


def kmsg_from_dmesg(text: str) -> str:
    """Kernel-log lines as /dev/kmsg records: syslog and journal prefixes (`... kernel: `), `dmesg -x` facility
    columns and the stamps taken off. A record's time: the monotonic `[   12.345678]` stamp where there is one, else
    the wall-clock stamp's distance from the first one (ISO, ctime or syslog forms), else the lines keep their order
    one millisecond apart."""
    out = []
    usec = 0
    first: float | None = None
    for seq, line in enumerate(_lines(text)):
        if seq >= MAX_RECORDS:
            break
        s = _FACILITY.sub("", line.strip(), count=1)
        if not s:
            continue
        wall, s = _wall_seconds(s)
        s = _KERNEL.sub("", s, count=1)
        m = _BRACKET_TS.match(s)
        if m:
            usec = max(usec, int(m[1]) * 1_000_000 + int(m[2].ljust(6, "0")[:6]))
            s = s[m.end() :]
        elif wall is not None:
            first = wall if first is None else first
            usec = max(usec, 1_000_000 + int((wall - first) * 1e6))
            s = _BRACKET_ANY.sub("", s, count=1)
        else:
            s = _BRACKET_ANY.sub("", s, count=1)
            usec += 1000
        if s:
            out.append(format_record(s, seq + 1, usec, 0, 3))
    return "".join(out)


_NVRM_VERSION = re.compile(r"Kernel Module(?: for [a-z0-9_]{1,20})?\s{1,4}([0-9]{2,4}\.[0-9]{1,4}(?:\.[0-9]{1,4})?)")


def driver_version(table_text: str | None, dmesg_text: str | None) -> str | None:
    """The driver version where the table or the kernel log's NVRM load line names it."""
    if table_text is not None and (v := parse_smi_table(table_text).driver_version):
        return v
    for line in _lines(dmesg_text or ""):
        if "NVRM" in line and (m := _NVRM_VERSION.search(line)):
            return m[1]
    return None
