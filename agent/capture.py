"""`gpu-ready capture`: one bundle of everything the probes read on this node (docs/agent.md, "Capture and replay").

The node is judged once, as `gpu-ready check` judges it, with the NVML library and every supervised program
wrapped so that each reading is written down (agent/bundle_nvml.py, `runs.json`); the verdict it gave is kept in
`bundle.json`. Then the raw views a person reads (`nvidia-smi -q` as text and XML, the CSV query, `nvlink -s`,
`topo -m`, the IMEX tool), the sysfs subset the probes read (each PCI function's identity, driver and PCIe link
files along its path, `class/infiniband` and `class/net`, the peer-memory modules), the /dev/nvidia* listing, the GPU
minor numbers under /proc, the newest kernel-log records about GPUs, NVSwitches and NICs, versions and the settings.
Host names, serial numbers, UUIDs, IP and MAC addresses are replaced (`--no-redact` keeps them): each distinct value
by the same stand-in throughout the bundle, so a replay judges it the same way.

Bounded: every program under the supervisor (agent/proc.py) with its timeout and output cap, the whole capture
under `--max-seconds` (what is left when it runs out is skipped and said), the kernel log to `--kmsg-records`
records, the bundle to agent/bundle.MAX_TOTAL bytes. Progress goes to stderr, the bundle's path to stdout; an
error is one line and exit 2."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import secrets
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agent import __version__
from agent import bundle as bundle_mod
from agent import config as config_mod
from agent.bundle_nvml import RecordingNvml
from agent.kernel_log.source import KmsgSource, KmsgUnavailable, format_record
from agent.probes.nvml import NvmlProbe
from agent.proc import Run, SupervisedRunner
from agent.replay import RUNS_FORMAT, run_to_json

KMSG_RECORDS = 2000
MAX_SECONDS = 300.0
KMSG_WORDS = re.compile(r"NVRM|nvidia|NVSwitch|nvswitch|SXid|Xid|mlx5|fallen off the bus|pcieport|AER|infiniband|IMEX")
# The raw views, beside what the probes ran: (file, arguments).
SPEC_QUERY = (
    "index,pci.bus_id,name,memory.total,driver_version,mig.mode.current,pcie.link.gen.max,"
    "pcie.link.width.max,ecc.mode.current"
)
SMI_VIEWS = (
    ("nvidia-smi-q.txt", ("-q",)),
    ("nvidia-smi-q.xml", ("-q", "-x")),
    # the CSV queries the agent runs: preflight's spec gate (agent/preflight/spec.py's QUERY, with its header line;
    # a test holds the two equal) and recovery's holders of a GPU
    ("nvidia-smi-query-gpu.csv", (f"--query-gpu={SPEC_QUERY}", "--format=csv")),
    ("nvidia-smi-query-compute-apps.csv", ("--query-compute-apps=gpu_bus_id,pid", "--format=csv")),
    ("nvlink-s.txt", ("nvlink", "-s")),
    ("topo-m.txt", ("topo", "-m")),
)
PCI_FILES = (
    "vendor",
    "device",
    "class",
    "subsystem_vendor",
    "subsystem_device",
    "current_link_speed",
    "current_link_width",
    "max_link_speed",
    "max_link_width",
    "numa_node",
)
IB_DEVICE_FILES = ("hca_type", "board_id", "fw_ver", "node_type")
IB_PORT_FILES = ("state", "phys_state", "rate", "link_layer")
NET_FILES = ("operstate", "speed", "carrier", "type", "mtu")
MAX_SYS_ENTRIES = 4096
FM_LOG = "/var/log/fabricmanager.log"  # the fabric manager's default log, where it runs on this host
FM_TAIL = 64 << 10


class Recorder:
    """A supervised program wrapped: each run passes through and is written down."""

    def __init__(self, live: SupervisedRunner, runs: list[dict[str, Any]]) -> None:
        self.live, self.runs = live, runs
        self.name, self.timeout_s, self.max_output_bytes = live.name, live.timeout_s, live.max_output_bytes

    def run(self, args: Iterable[str] = ()) -> Run:
        args = tuple(args)
        r = self.live.run(args)
        self.runs.append(run_to_json(self.name, args, r))
        return r

    def kill_running(self) -> None:
        self.live.kill_running()


def attach_recorders(suite: Any, runs: list[dict[str, Any]]) -> None:
    """Every supervised program of the suite's probes (and the shared nvidia-smi) wrapped in a Recorder."""
    old = suite.shared.smi
    suite.shared.smi = Recorder(old, runs)
    for p in suite.probes:
        for attr, val in list(vars(p).items()):
            if val is old:
                setattr(p, attr, suite.shared.smi)
            elif isinstance(val, SupervisedRunner):
                setattr(p, attr, Recorder(val, runs))


# -- redaction --------------------------------------------------------------------------------------------

_UUID = re.compile(r"\b((?:GPU|MIG)-)?([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})\b")
_IPV4 = re.compile(r"(?<![\w.])((?:25[0-5]|2[0-4]\d|1?\d?\d)(?:\.(?:25[0-5]|2[0-4]\d|1?\d?\d)){3})(?![\w.])")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){1,7}:?(?::?[0-9a-fA-F]{1,4}){1,7}(?![\w:])")
_MAC = re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}(?![\w:])")
_SERIAL_LINE = re.compile(r"^(\s*(?:Serial Number|Board Serial Number|Module Serial Number)\s*:\s*)(\S.*)$", re.M)
_SERIAL_XML = re.compile(r"(<serial>)([^<]{1,100})(</serial>)")
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
COMMON_WORDS = frozenset({"node", "host", "localhost", "nvidia", "kernel", "linux", "server", "worker", "master"})


@dataclass
class Redactor:
    """Each distinct identifier replaced by one stand-in throughout the bundle (same value, same stand-in)."""

    names: tuple[str, ...] = ()
    salt: str = field(default_factory=lambda: secrets.token_hex(16))
    seen: dict[str, str] = field(default_factory=dict)

    def _uuid(self, m: re.Match[str]) -> str:
        prefix, value = m[1] or "", m[2].lower()
        if value == ZERO_UUID:
            return m[0]
        stand_in = str(uuid.UUID(bytes=hashlib.sha256((self.salt + value).encode()).digest()[:16], version=4))
        self.seen[value] = stand_in
        return prefix + stand_in

    def _ipv6(self, m: re.Match[str]) -> str:
        text = m[0]
        if text.count(":") < 2 or ("::" not in text and text.count(":") < 7):
            return text  # times, PCI addresses and counters are not addresses
        return "::"

    def text(self, s: str) -> str:
        for name in self.names:
            if len(name) >= 4 and name.lower() not in COMMON_WORDS:  # a host named like a word the outputs use
                s = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", "node-redacted", s)
        s = _UUID.sub(self._uuid, s)
        s = _SERIAL_LINE.sub(lambda m: m[1] + "REDACTED", s)
        s = _SERIAL_XML.sub(lambda m: m[1] + "REDACTED" + m[3], s)
        s = _MAC.sub("00:00:00:00:00:00", s)
        s = _IPV4.sub("192.0.2.1", s)
        return _IPV6.sub(self._ipv6, s)

    def value(self, v: Any) -> Any:
        """A JSON value with every string redacted; a 16-byte UUID array (a fabric's cluster UUID) too."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            if len(v) == 16 and all(isinstance(x, int) and 0 <= x < 256 for x in v) and any(v):
                u = str(uuid.UUID(bytes=bytes(v)))
                return list(uuid.UUID(self.text(u)).bytes)
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {k: self.value(x) for k, x in v.items()}
        return v


# -- the capture ------------------------------------------------------------------------------------------


@dataclass
class Capture:
    files: dict[str, bytes] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    deadline: float = 0.0
    progress: Callable[[str], None] = lambda s: None

    def add(self, name: str, data: str | bytes) -> None:
        self.files[name] = data.encode() if isinstance(data, str) else data

    def time_left(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            self.progress(what)
            return True
        self.skipped.append(f"{what}: the capture's time ran out")
        return False


def _read_small(path: str, limit: int = 64 << 10) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def capture_sys(c: Capture, sysfs_root: str) -> None:
    """The sysfs the probes read, with its links (bus/pci/devices entries into the device tree, drivers, physfn,
    class/infiniband/*/device), every path kept inside the bundle's sys/."""
    root = os.path.realpath(sysfs_root)

    def rel(real: str) -> str | None:
        return os.path.relpath(real, root) if real == root or real.startswith(root + os.sep) else None

    def copy_dir(real: str, names: Iterable[str]) -> None:
        r = rel(real)
        if r is None:
            return
        for n in names:
            data = _read_small(os.path.join(real, n))
            if data is not None:
                c.files[f"sys/{r}/{n}"] = data

    def link(at: str, target_real: str) -> None:
        t = rel(target_real)
        if t is not None:
            c.links[f"sys/{at}"] = os.path.relpath(f"/{t}", os.path.dirname(f"/{at}"))

    devices = os.path.join(root, "bus", "pci", "devices")
    try:
        entries = sorted(os.listdir(devices))[:MAX_SYS_ENTRIES]
    except OSError as e:
        c.skipped.append(f"sys/bus/pci/devices: {e.strerror}")
        entries = []
    for name in entries:
        entry = os.path.join(devices, name)
        real = os.path.realpath(entry)
        r = rel(real)
        if r is None:
            continue
        chain = [real]
        up = os.path.dirname(real)
        while rel(up) not in (None, ".", "devices") and len(chain) < 16:
            chain.append(up)
            up = os.path.dirname(up)
        for d in chain:
            copy_dir(d, PCI_FILES)
            c.files.setdefault(f"sys/{rel(d)}/.keep", b"")
        if r != f"bus/pci/devices/{name}":
            link(f"bus/pci/devices/{name}", real)
        for sub in ("driver", "physfn"):
            p = os.path.join(real, sub)
            if os.path.islink(p):
                target = os.path.realpath(p)
                if sub == "driver":
                    c.files.setdefault(f"sys/bus/pci/drivers/{os.path.basename(target)}/.keep", b"")
                    target = os.path.join(root, "bus", "pci", "drivers", os.path.basename(target))
                link(f"{r}/{sub}", target)
    ib = os.path.join(root, "class", "infiniband")
    for dev in _listdir(ib):
        d = os.path.join(ib, dev)
        copy_dir(d, IB_DEVICE_FILES)
        c.files.setdefault(f"sys/class/infiniband/{dev}/.keep", b"")
        if os.path.islink(os.path.join(d, "device")):
            link(f"class/infiniband/{dev}/device", os.path.realpath(os.path.join(d, "device")))
        for port in _listdir(os.path.join(d, "ports")):
            pd = os.path.join(d, "ports", port)
            copy_dir(pd, IB_PORT_FILES)
            copy_dir(os.path.join(pd, "counters"), _listdir(os.path.join(pd, "counters")))
            copy_dir(os.path.join(pd, "gid_attrs", "ndevs"), _listdir(os.path.join(pd, "gid_attrs", "ndevs"))[:4])
    net = os.path.join(root, "class", "net")
    for ifname in _listdir(net):
        d = os.path.join(net, ifname)
        copy_dir(os.path.realpath(d), NET_FILES)
        if os.path.islink(os.path.join(d, "device")):
            c.files.setdefault(f"sys/class/net/{ifname}/.keep", b"")
            link(f"class/net/{ifname}/device", os.path.realpath(os.path.join(d, "device")))
    for m in ("nvidia_peermem", "nv_peer_mem", "nvidia", "nvidia_uvm"):
        if os.path.isdir(os.path.join(root, "module", m)):
            c.files[f"sys/module/{m}/.keep"] = b""
    c.files.setdefault("sys/.keep", b"")
    c.sources.append("sys")


def _tail(path: str, limit: int = FM_TAIL) -> bytes | None:
    """The last `limit` bytes of a regular file, from its first whole line; None when it is not there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        start = max(0, st.st_size - limit)
        data = os.pread(fd, limit, start)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data[data.find(b"\n") + 1 :] if start else data


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))[:MAX_SYS_ENTRIES]
    except OSError:
        return []


def capture_dev(c: Capture, dev_root: str, proc_root: str) -> None:
    nodes = []
    for name in _listdir(dev_root):
        if not name.startswith("nvidia"):
            continue
        p = os.path.join(dev_root, name)
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            nodes.append({"name": name, "type": "dir"})
            for sub in _listdir(p):
                try:
                    s2 = os.stat(os.path.join(p, sub))
                except OSError:
                    continue
                nodes.append(_dev_entry(f"{name}/{sub}", s2))
        else:
            nodes.append(_dev_entry(name, st))
    c.add("dev.json", json.dumps({"root": dev_root, "nodes": nodes}, indent=1) + "\n")
    gpus = os.path.join(proc_root, "driver", "nvidia", "gpus")
    for bdf in _listdir(gpus):
        data = _read_small(os.path.join(gpus, bdf, "information"))
        if data is not None and re.fullmatch(r"[0-9a-fA-F:.]{1,20}", bdf):
            c.files[f"proc/driver/nvidia/gpus/{bdf}/information"] = data
    version = _read_small(os.path.join(proc_root, "driver", "nvidia", "version"))
    if version is not None:
        c.files["proc/driver/nvidia/version"] = version
    c.sources += ["dev", "proc"]


def _dev_entry(name: str, st: os.stat_result) -> dict[str, Any]:
    if stat.S_ISCHR(st.st_mode):
        return {"name": name, "type": "char", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)}
    return {"name": name, "type": "dir" if stat.S_ISDIR(st.st_mode) else "file"}


def capture_kmsg(c: Capture, path: str, trust_user: bool, keep: int) -> None:
    """The newest `keep` records about GPUs, NVSwitches and NICs. Read from /dev/kmsg, the last record is a note
    stamped with the kernel's clock at this moment (a user-facility record no parser takes for an event), so a
    replay measures each event's age from the capture, as the live check did, not from the newest event."""
    src = KmsgSource(path, trust_user=trust_user)
    kept: list[str] = []
    try:
        src.open()
        for batch in src.drain():
            for r in batch:
                if KMSG_WORDS.search(r.text):
                    kept.append(format_record(r.text, r.seq or 0, r.usec or 0, r.facility or 0, r.level or 4))
            del kept[:-keep]
    except (OSError, KmsgUnavailable) as e:
        c.skipped.append(f"kernel log {path}: {getattr(e, 'strerror', None) or e}")
        return
    finally:
        src.close()
    if src.is_device:
        now = int(time.monotonic() * 1e6)
        kept.append(format_record("gpu-ready capture: the kernel log as read at this moment", 0, now, 1, 6))
    c.add("kmsg.txt", "".join(kept))
    c.sources.append("kmsg")


def settings_json(cfg: config_mod.Config) -> tuple[dict[str, Any], list[str]]:
    """The settings that differ from the defaults, by file key, each in a form that loads back to the same value
    (checked); and the names of those that do not (said in bundle.json)."""
    out: dict[str, Any] = {}
    lost = []
    for s in config_mod.SETTINGS:
        v = getattr(cfg, s.name)
        if not s.public or v == s.default:
            continue
        for form in _forms(v):
            try:
                if getattr(config_mod.load(None, environ={}, overrides={s.name: form}), s.name) == v:
                    out[s.file_key] = form
                    break
            except (config_mod.ConfigError, TypeError, ValueError):
                continue
        else:
            lost.append(s.file_key)
    return out, lost


def _forms(v: Any) -> list[Any]:
    """A setting's value as JSON can hold it: as it is, as a list, as a mapping of pairs, as a comma list."""
    if not isinstance(v, tuple | list | frozenset | set):
        return [v]
    items = sorted(v) if isinstance(v, frozenset | set) else list(v)
    forms: list[Any] = [items]
    if items and all(isinstance(x, tuple) and len(x) == 2 for x in items):
        forms.append({str(k): x for k, x in items})
        forms.append(",".join(f"{k}={x}" for k, x in items))
    else:
        forms.append(",".join(str(x) for x in items))
    return forms


def cmd_capture(args: argparse.Namespace, judge: Callable[..., Any], read_node: Callable[[str], dict[str, Any]]) -> int:
    """`judge(cfg, node, nvml=..., attach=...)`: the check's one cycle (agent/cli.judge_once); `read_node`: a saved
    Node (`--node-json`, agent/cli.read_node_json). A capture is what a user runs when something already looks wrong:
    whatever fails in it is one line and exit 2, never a traceback."""
    cfg = config_mod.load(args)
    try:
        return _capture(args, cfg, judge, read_node)
    except (OSError, ValueError, RuntimeError) as e:
        print(
            f"gpu-ready: capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
            file=sys.stderr,
        )
        return 2


def _capture(
    args: argparse.Namespace,
    cfg: config_mod.Config,
    judge: Callable[..., Any],
    read_node: Callable[[str], dict[str, Any]],
) -> int:
    out = args.output or f"gpu-ready-bundle-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.tar.gz"
    if os.path.lexists(out):
        print(f"gpu-ready: capture: {out} exists; not overwriting it", file=sys.stderr)
        return 2

    def progress(what: str) -> None:
        if not args.quiet:
            print(f"gpu-ready capture: {what}", file=sys.stderr, flush=True)

    node: dict[str, Any] | None = None
    if args.node_json:
        try:
            node = read_node(args.node_json)
        except ValueError as e:
            print(f"gpu-ready: capture: cannot read --node-json {args.node_json}: {e}", file=sys.stderr)
            return 2
    c = Capture(deadline=time.monotonic() + args.max_seconds, progress=progress)
    runs: list[dict[str, Any]] = []
    recorder = RecordingNvml(_pynvml()) if cfg.nvml != "off" else None
    nvml = NvmlProbe(cfg.nvml, cfg.nvml_timeout, cfg.nvml_nvlink, nvml=recorder) if recorder is not None else None
    progress("judging the node once, every reading recorded")
    verdict = judge(cfg, node, nvml=nvml, attach=lambda suite: attach_recorders(suite, runs))[0]
    if node is not None:
        c.add("node.json", json.dumps(node, indent=1) + "\n")
        c.sources.append("node")
    if recorder is not None:
        c.add("nvml.json", json.dumps(recorder.to_json(), indent=1) + "\n")
        c.sources.append("nvml")
    c.add("runs.json", json.dumps({"format": RUNS_FORMAT, "runs": runs}, indent=1) + "\n")
    table = next((r for r in runs if r["program"] == "nvidia-smi" and r["args"] == []), None)
    if table is not None and table["exit_code"] is not None:  # it ran (runs.json says why when it did not)
        c.add("nvidia-smi.txt", table["output"])
    smi = SupervisedRunner(cfg.nvidia_smi, cfg.nvidia_smi_timeout, name="nvidia-smi")
    for name, argv in SMI_VIEWS:
        if c.time_left(f"nvidia-smi {' '.join(argv)}"):
            smi.timeout_s = max(0.1, min(cfg.nvidia_smi_timeout, c.deadline - time.monotonic()))
            r = smi.run(argv)
            if r.exit_code is not None and r.error is None:
                c.add(name, r.output)
            else:
                c.skipped.append(f"nvidia-smi {' '.join(argv)}: {r.error or 'timed out'}")
    imex = SupervisedRunner(cfg.imex_ctl, cfg.imex_timeout, max_output_bytes=256 << 10)
    if imex._resolve()[0] is not None and c.time_left("nvidia-imex-ctl -N"):
        r = imex.run(("-N",))
        if r.exit_code is not None:
            c.add("nvidia-imex-ctl.txt", r.output)
    fm = _tail(FM_LOG)
    if fm is not None:
        c.add("fabricmanager.txt", fm)
    if c.time_left("sysfs"):
        capture_sys(c, cfg.sysfs_root)
    if c.time_left("device nodes"):
        capture_dev(c, cfg.dev_root, cfg.proc_root)
    if c.time_left("kernel log"):
        capture_kmsg(c, cfg.kmsg, cfg.kmsg_trust_user, args.kmsg_records)
    hosts = {socket.gethostname(), socket.getfqdn(), cfg.node_name or "", os.environ.get("NODE_NAME", "")}
    names = tuple(sorted((n for n in hosts if n), key=len, reverse=True))  # the FQDN before the short name
    redactor = Redactor(names) if not args.no_redact else None
    settings, lost = settings_json(cfg)
    c.skipped += [f"setting {k}: its value does not load back from JSON" for k in lost]
    meta = {
        "format": bundle_mod.FORMAT,
        "config": _config_line(verdict),
        "captured": {
            "by": f"gpu-ready {__version__} capture",
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "redacted": redactor is not None,
            "sources": c.sources,
            "skipped": c.skipped,
        },
        "versions": {
            "gpu-ready": __version__,
            "python": platform.python_version(),
            "kernel": platform.release(),
            "machine": platform.machine(),
        },
        "verdict": {"status": verdict.status.value, "reason": verdict.reason.value, "message": verdict.message},
        "settings": settings,
    }
    if redactor is not None:
        meta["settings"] = redactor.value(settings)
        for name, data in list(c.files.items()):
            if name.endswith(".json"):
                c.files[name] = (json.dumps(redactor.value(json.loads(data)), indent=1) + "\n").encode()
            else:
                c.files[name] = redactor.text(data.decode("utf-8", "replace")).encode()
        meta["verdict"] = redactor.value(meta["verdict"])
    c.add("bundle.json", json.dumps(meta, indent=1) + "\n")
    total = sum(len(v) for v in c.files.values())
    if total > bundle_mod.MAX_TOTAL:
        print(f"gpu-ready: capture: {total >> 20} MiB is over the bundle's bound", file=sys.stderr)
        return 2
    try:
        bundle_mod.write(c.files, c.links, out)
    except OSError as e:
        print(f"gpu-ready: capture: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    for s in c.skipped:
        progress(f"not captured: {s}")
    progress(f"wrote {out} ({len(c.files)} files, {total >> 10} KiB); the node read {verdict.status.value}")
    print(out)
    return 0


def _config_line(verdict: Any) -> str:
    names = sorted({g.name for g in verdict.gpus if g.name})
    return f"{', '.join(names) or 'no GPU'} x{len(verdict.gpus)} (captured by gpu-ready capture)"


def _pynvml() -> Any:
    import pynvml

    return pynvml


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help="the bundle: a folder, or a .tar.gz (default gpu-ready-bundle-<time>.tar.gz)")
    p.add_argument("--no-redact", action="store_true", help="keep host names, serials, UUIDs, IP and MAC addresses")
    p.add_argument(
        "--node-json", help="a saved `kubectl get node -o json`: judged with it (the device plugin's counts), kept"
    )
    p.add_argument("--kmsg-records", type=_positive_int, default=KMSG_RECORDS, help="newest kernel-log records kept")
    p.add_argument("--max-seconds", type=_positive_float, default=MAX_SECONDS, help="the whole capture's time bound")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def _positive_float(v: str) -> float:
    x = float(v)
    if not 0 < x <= 86400:
        raise ValueError(v)
    return x


def _positive_int(v: str) -> int:
    n = int(v)
    if n <= 0 or n > 1_000_000:
        raise ValueError(v)
    return n
