"""`gpu-ready check --replay <bundle>`: a bundle judged as the node would have been judged (docs/agent.md, "Capture
and replay").

The same probes, the same suite and the same decide() as a live `check`; only their sources change:
- the NVML probe gets the recorded library (agent/bundle_nvml.py): `nvml.json`, or the record derived from
  `nvidia-smi -q` (agent/bundle_raw.py);
- every supervised program a probe runs (nvidia-smi's table and `-q`, the IMEX tool) answers what the bundle
  recorded (`runs.json`), or the raw file of that command (`nvidia-smi.txt`, `nvidia-smi-q.txt`);
- the sysfs, /dev and /proc roots the probes already take point at a fresh folder written from the bundle (its
  `sys/` tree, or one derived from `lspci` and the InfiniBand listings; `dev.json`; `proc/`);
- the kernel log is `kmsg.txt`, or `dmesg.txt` turned into records.
The settings are the bundle's (`bundle.json` "settings"), then a `--config` file, then the flags given. A source the
bundle lacks is "not captured": the probe that reads it is left out and a line on stderr says so; nothing is
invented for it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent import config as config_mod
from agent.bundle import Bundle, BundleError, load, materialize
from agent.bundle_nvml import RecordedNvml, RecordError
from agent.bundle_raw import (
    infiniband_from_ibstat,
    infiniband_from_ibv_devinfo,
    infiniband_from_listing,
    kmsg_from_dmesg,
    nvml_from_raw,
    pci_driver_links,
    pci_from_lspci,
    sys_from_pci,
)
from agent.model import Check
from agent.probes.nvidia_smi import NvidiaSmiRunner
from agent.probes.nvml import NvmlProbe
from agent.probes.registry import REGISTRY
from agent.proc import Run, SupervisedRunner

RUNS_FORMAT = "gpu-ready-runs/1"
# Checks that read no source of their own (the Node's plugin counts, the MIG layout judged from the GPU sources).
DERIVED = frozenset({Check.DEVICE_PLUGIN, Check.MIG_LAYOUT})
# A program's runs from raw files, by (program, arguments), when runs.json does not hold them.
RAW_RUNS = {("nvidia-smi", ()): "nvidia-smi.txt", ("nvidia-smi", ("-q",)): "nvidia-smi-q.txt"}
# Settings that point at the node's own files and programs: a replay points them at the bundle.
PATH_SETTINGS = ("sysfs_root", "dev_root", "proc_root", "kmsg", "nvidia_smi", "imex_ctl", "kubeconfig")


class RecordedRunner(NvidiaSmiRunner):
    """A supervised program's runs as the bundle recorded them, by arguments; a run it lacks says so (the probe
    that asked is left out of the replay, so this is only met by a probe asking something new)."""

    def __init__(self, program: str, runs: Mapping[tuple[str, ...], Run], timeout_s: float = 30.0) -> None:
        super().__init__(program, timeout_s)
        self.name = program
        self.runs = dict(runs)

    def run(self, args: Sequence[str] = ()) -> Run:
        key = tuple(args)
        got = self.runs.get(key)
        if got is None:
            return Run(None, "", 0.0, error=f"{self.name} {' '.join(key)}: not captured in the bundle".rstrip())
        return got


def run_from_json(r: Mapping[str, Any]) -> Run:
    code = r.get("exit_code")
    return Run(
        int(code) if isinstance(code, int) else None,
        str(r.get("output", ""))[: 8 << 20],
        0.0,
        timed_out=bool(r.get("timed_out")),
        error=str(r["error"])[:300] if r.get("error") else None,
        hung_pid=int(r["hung_pid"]) if isinstance(r.get("hung_pid"), int) else None,
        output_capped=bool(r.get("output_capped")),
    )


def run_to_json(program: str, args: Sequence[str], run: Run) -> dict[str, Any]:
    return {
        "program": program,
        "args": list(args),
        "exit_code": run.exit_code,
        "output": run.output,
        "timed_out": run.timed_out,
        "error": run.error,
        "hung_pid": run.hung_pid,
        "output_capped": run.output_capped,
    }


def recorded_runs(b: Bundle) -> dict[str, dict[tuple[str, ...], Run]]:
    """Every program's runs: runs.json first, the raw command files where it has none."""
    out: dict[str, dict[tuple[str, ...], Run]] = {}
    data = b.json("runs.json")
    if data is not None:
        if not isinstance(data, dict) or data.get("format") != RUNS_FORMAT or not isinstance(data.get("runs"), list):
            raise BundleError(f"runs.json: not a {RUNS_FORMAT} record")
        for r in data["runs"]:
            if not isinstance(r, dict) or not isinstance(r.get("program"), str) or not isinstance(r.get("args"), list):
                raise BundleError("runs.json: a run needs a program and a list of arguments")
            out.setdefault(r["program"], {})[tuple(str(a) for a in r["args"])] = run_from_json(r)
    for (program, args), name in RAW_RUNS.items():
        text = b.text(name)
        if text is not None:
            out.setdefault(program, {}).setdefault(args, Run(0, text, 0.0))
    return out


def nvml_record(b: Bundle) -> tuple[dict[str, Any] | None, str]:
    """The NVML record and where it came from; None when the bundle has neither nvml.json nor `nvidia-smi -q`."""
    data = b.json("nvml.json")
    if data is not None:
        return data, "nvml.json"
    q, x = b.text("nvidia-smi-q.txt"), b.text("nvidia-smi-q.xml")
    record = nvml_from_raw(
        q, b.text("nvlink-s.txt"), b.text("nvidia-smi.txt"), b.text("lspci.txt"), b.text("dmesg.txt"), x
    )
    if record is None:
        return None, ""
    return record, str(record.get("derived", "nvlink -s"))


@dataclass
class Inputs:
    """What a bundle gives the probes, written under `root`, and the checks it cannot feed."""

    root: str
    pci: bool = False
    infiniband: bool = False
    dev: bool = False
    kmsg: bool = False
    derived: list[str] = field(default_factory=list)  # what was derived from raw text, for the output


def write_inputs(b: Bundle, root: str) -> Inputs:
    got = Inputs(root)
    sysroot = os.path.join(root, "sys")
    os.makedirs(sysroot)
    captured = b.meta.get("captured") if isinstance(b.meta.get("captured"), dict) else None
    if b.has_tree("sys"):
        materialize(b, "sys", root)
        got.pci = True
        # A captured node with no InfiniBand device has none: the capture looked (bundle.json says so).
        got.infiniband = b.has_tree("sys/class/infiniband") or bool(captured and "sys" in captured.get("sources", []))
    else:
        lspci = b.text("lspci.txt")
        if lspci is not None:
            functions = pci_from_lspci(lspci)
            for name, data in sys_from_pci(functions).items():
                _write(root, name, data)
            for name, target in pci_driver_links(functions).items():
                drv = os.path.normpath(os.path.join(root, os.path.dirname(name), target))
                os.makedirs(drv, exist_ok=True)
                os.symlink(target, os.path.join(root, name))
            got.pci = bool(functions)
            got.derived.append(f"PCI functions from lspci.txt ({len(functions)})")
        ib: dict[str, bytes] = {}
        for fname, fn in (
            ("ibv_devinfo.txt", infiniband_from_ibv_devinfo),
            ("ibstat.txt", infiniband_from_ibstat),
            ("sys-class-infiniband.txt", infiniband_from_listing),
        ):
            text = b.text(fname)
            if text is not None:
                ib.update(fn(text))
                got.infiniband = True
                got.derived.append(f"InfiniBand ports from {fname}")
        for name, data in ib.items():
            _write(root, name, data)
    os.makedirs(os.path.join(root, "dev"))
    os.makedirs(os.path.join(root, "proc"))
    if b.has_tree("proc"):
        materialize(b, "proc", root)
    dev = b.json("dev.json")
    if dev is not None:
        make_dev(dev, os.path.join(root, "dev"))
        got.dev = True
    kmsg = b.text("kmsg.txt")
    if kmsg is None and (dmesg := b.text("dmesg.txt")) is not None:
        kmsg = kmsg_from_dmesg(dmesg)
        got.derived.append("kernel log records from dmesg.txt")
    with open(os.path.join(root, "kmsg"), "w", encoding="utf-8") as fh:
        fh.write(kmsg or "")
    got.kmsg = kmsg is not None
    return got


def _write(root: str, name: str, data: bytes) -> None:
    full = os.path.join(root, name)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as fh:
        fh.write(data)


def make_dev(listing: Any, dev: str) -> None:
    """dev.json's NVIDIA device nodes under `dev`. A character device is a symbolic link to /dev/null, a real
    character device (the probe asks only "is it a character device", following links as it must for a driver
    container's dev root), so a bundle never makes a device node of its choosing on the replaying machine."""
    if not isinstance(listing, dict) or not isinstance(listing.get("nodes"), list):
        raise BundleError('dev.json: expected {"nodes": [...]}')
    for n in listing["nodes"][:4096]:
        if not isinstance(n, dict) or not isinstance(n.get("name"), str):
            raise BundleError("dev.json: a node needs a name")
        name = n["name"]
        parts = name.split("/")
        if len(parts) > 2 or any(p in ("", ".", "..") for p in parts) or not parts[0].startswith("nvidia"):
            raise BundleError(f"dev.json: bad device name {name[:60]!r}")
        path = os.path.join(dev, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        kind = n.get("type")
        if os.path.lexists(path):
            continue
        if kind == "char":
            os.symlink("/dev/null", path)
        elif kind == "dir":
            os.makedirs(path, exist_ok=True)
        else:  # a regular file or anything else where a device node should be: the probe reports it
            with open(path, "w"):
                pass


def settings_of(b: Bundle) -> dict[str, Any]:
    """bundle.json's settings (file keys, camelCase) by setting name."""
    raw = b.meta.get("settings", {})
    if not isinstance(raw, dict):
        raise BundleError("bundle.json: settings must be an object")
    keys = {s.file_key: s.name for s in config_mod.SETTINGS if s.public}
    names = {s.name for s in config_mod.SETTINGS if s.public}
    out = {}
    for k, v in raw.items():
        name = keys.get(str(k)) or (str(k) if str(k) in names else None)
        if name is None:
            raise BundleError(f"bundle.json: unknown setting {str(k)[:60]!r}")
        out[name] = v
    return out


@dataclass
class Replay:
    """One replay: the settings, the NVML probe on the record, the recorded runs and the checks left out."""

    cfg: config_mod.Config
    bundle: Bundle
    inputs: Inputs
    nvml: NvmlProbe | None
    runs: dict[str, dict[tuple[str, ...], Run]]
    skipped: dict[Check, str]
    notes: list[str]
    node: dict[str, Any] | None = None

    def attach(self, suite: Any) -> None:
        """Points the suite's supervised programs at the recorded runs and leaves out the checks not captured."""
        shared = suite.shared
        old = shared.smi
        shared.smi = RecordedRunner("nvidia-smi", self.runs.get("nvidia-smi", {}), old.timeout_s)
        for p in suite.probes:
            for attr, val in list(vars(p).items()):
                if val is old:
                    setattr(p, attr, shared.smi)
                elif isinstance(val, SupervisedRunner):
                    setattr(p, attr, RecordedRunner(val.name, self.runs.get(val.name, {}), val.timeout_s))
        suite.probes = [p for p in suite.probes if p.check not in self.skipped]

    def report(self) -> list[str]:
        """Lines for stderr before the verdict: where the inputs came from, what was not captured (and left out)."""
        lines = [f"gpu-ready: replay of {self.bundle.source}: {', '.join(self.notes)}" if self.notes else ""]
        lines += [f"gpu-ready: replay: {c.value} not captured: {why}; left out" for c, why in self.skipped.items()]
        return [x for x in lines if x]

    def report_after(self) -> list[str]:
        """Lines for stderr after the verdict: the NVML readings the probes asked for that the record lacks."""
        lines = []
        missing = getattr(self.nvml._nvml, "missing", []) if self.nvml is not None else []
        if missing:
            shown = ", ".join(list(dict.fromkeys(k.split("[", 1)[0] for k in missing))[:6])
            lines.append(
                f"gpu-ready: replay: NVML readings not captured (answered NOT_SUPPORTED): {len(missing)} ({shown})"
            )
        return [x for x in lines if x]

    def close(self) -> None:
        shutil.rmtree(self.inputs.root, ignore_errors=True)


def open_replay(args: argparse.Namespace, bundle_path: str) -> Replay:
    """The replay of `bundle_path` with the flags in `args`; BundleError or ConfigError (one line) otherwise."""
    b = load(bundle_path)
    root = tempfile.mkdtemp(prefix="gpu-ready-replay-")
    try:
        return _open(args, b, root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _open(args: argparse.Namespace, b: Bundle, root: str) -> Replay:
    inputs = write_inputs(b, root)
    values = settings_of(b)
    if getattr(args, "config", None):
        keys = {s.file_key: s.name for s in config_mod.SETTINGS if s.public}
        for k, v in config_mod._read_file(args.config).items():
            values[keys.get(str(k), str(k))] = v
    for s in config_mod.SETTINGS:
        if getattr(args, s.name, None) is not None:
            values[s.name] = getattr(args, s.name)
    for name in PATH_SETTINGS:
        values.pop(name, None)
    values.update(
        sysfs_root=os.path.join(root, "sys"),
        dev_root=os.path.join(root, "dev"),
        proc_root=os.path.join(root, "proc"),
        kmsg=os.path.join(root, "kmsg"),
        kmsg_trust_user=False,
    )
    skipped: dict[Check, str] = {}
    record, record_from = nvml_record(b)
    notes = list(inputs.derived)
    cfg = config_mod.load(None, environ={}, overrides=values)
    if record is None and cfg.nvml != "off":
        skipped[Check.NVML] = "no nvml.json, nvidia-smi -q or nvlink -s"
    elif record_from != "nvml.json" and cfg.nvml != "off":
        notes.append(f"NVML readings from {record_from}")
    nvml: NvmlProbe | None = None
    if record is not None and cfg.nvml != "off":
        try:
            backend = RecordedNvml(record)
        except RecordError as e:
            raise BundleError(str(e)) from None
        nvml = NvmlProbe(cfg.nvml, cfg.nvml_timeout, cfg.nvml_nvlink, nvml=backend)
    runs = recorded_runs(b)
    smi = runs.get("nvidia-smi", {})
    if () not in smi:
        skipped[Check.NVIDIA_SMI] = "no nvidia-smi table"
    if not inputs.pci:
        skipped[Check.PCI] = "no sys/ tree or lspci.txt"
        skipped[Check.PCIE] = "no sys/ tree or lspci.txt"
    if not inputs.dev:
        skipped[Check.DEVICE_NODES] = "no dev.json"
    if not inputs.kmsg:
        skipped[Check.XID] = skipped[Check.XID_RATE] = "no kmsg.txt or dmesg.txt"
    if not inputs.infiniband:
        skipped[Check.INFINIBAND] = "no sys/class/infiniband, ibstat.txt, ibv_devinfo.txt or listing"
    if Check.NVML in skipped:
        skipped[Check.CLOCKS] = "no NVML readings"
    fabric_read = record_from in ("nvml.json", "nvidia-smi -q", "nvidia-smi -q -x") or {(), ("-q",)} <= set(smi)
    if not fabric_read and cfg.fabric != "off":
        skipped[Check.FABRIC] = "no nvml.json or nvidia-smi -q naming its GPUs (the Fabric block)"
    if cfg.imex and ("-q",) not in runs.get(os.path.basename(cfg.imex_ctl), {}):
        skipped[Check.IMEX] = "no recorded nvidia-imex-ctl -q"
    if cfg.dcgm_exporter is not None:
        skipped[Check.DCGM] = "dcgm-exporter's metrics are not in a bundle"
    if cfg.pod_resources:
        skipped[Check.POD_RESOURCES] = "kubelet's pod-resources are not in a bundle"
    if cfg.fabric_manager and not inputs.pci:
        skipped[Check.FABRIC_MANAGER] = "no NVSwitch list (sys/ tree or lspci.txt)"
    elif cfg.fabric_manager_address is not None:
        cfg = cfg.with_values(fabric_manager_address=None)
        notes.append("the fabric manager's port is not in a bundle: judged from the fabric states only")
    node = b.json("node.json")
    if node is not None and not isinstance(node, dict):
        raise BundleError("node.json is not an object")
    # A bundle that feeds no check would read True on nothing: refused, as an unreadable one is.
    fed = [s.check for s in REGISTRY if s.on(cfg) and s.check not in skipped and s.check not in DERIVED]
    if not fed and node is None:
        raise BundleError(
            "nothing in it feeds a check (no nvidia-smi output, NVML reading, sysfs, lspci or kernel log)"
        )
    return Replay(cfg, b, inputs, nvml, runs, skipped, notes, node)


def print_report(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)


def dumps(data: Any) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=False) + "\n").encode()
