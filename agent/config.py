"""One typed, frozen settings object from flags, environment and a config file (the chart's ConfigMap).

Precedence: command-line flag > environment variable (GPU_READY_<NAME>, then an extra name such as
NODE_NAME) > config file > default. Every setting is declared once in SETTINGS (converter, default,
help) and once as a typed attribute of Config; flags, env names, file keys and docs derive from
SETTINGS. Every value goes through its converter here, in one place: a bad value raises ConfigError
naming the setting and where it came from, and the CLI exits 2 with that one line.

The converters (`to_float`, `to_int`, `to_bool`, ...) are public so that other inputs (the preflight
profile) validate the same way: `convert(conv, value, what)` raises ConfigError naming `what`."""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import yaml

DEFAULT_METRICS_ADDRESS = "0.0.0.0:9465"  # not dcgm-exporter's 9400 nor node-exporter's 9100
CONFIG_FILE_LIMIT = 1 << 20  # bytes; a settings file is a few hundred
DAY = 86_400.0

T = TypeVar("T")


class ConfigError(ValueError):
    pass


# -- converters: value from a flag/env (str) or a file (YAML scalar/list) -> typed value, or ValueError ---


def to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {_show(v)}")


def to_int(v: Any) -> int:
    """An integer: 8, "8" and 8.0 are 8; 8.5, "8.5", true and 5000-digit strings are errors."""
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {_show(v)}")
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise ValueError(f"expected an integer, got {_show(v)}")
        return int(v)
    s = str(v).strip()
    if not re.fullmatch(r"[+-]?\d{1,18}", s):
        raise ValueError(f"expected an integer, got {_show(v)}")
    return int(s)


def to_float(v: Any) -> float:
    """A finite number: nan and inf are errors (a nan poll interval busy-loops; inf never wakes)."""
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {_show(v)}")
    try:
        x = float(v) if isinstance(v, int | float) else float(str(v).strip()[:64])
    except (ValueError, OverflowError):
        raise ValueError(f"expected a number, got {_show(v)}") from None
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {_show(v)}")
    return x


def to_str(v: Any) -> str:
    if isinstance(v, dict | list | bool) or v is None:
        raise ValueError(f"expected a string, got {_show(v)}")
    s = str(v)
    if not s or len(s) > 4096 or "\x00" in s:
        raise ValueError(f"expected a non-empty string, got {_show(v)}")
    return s


def to_int_list(v: Any) -> tuple[int, ...]:
    items = v if isinstance(v, list | tuple) else [x for x in str(v).replace(" ", ",").split(",") if x]
    if len(items) > 1024:
        raise ValueError(f"at most 1024 entries, got {len(items)}")
    out = tuple(to_int(x) for x in items)
    for x in out:
        if not 0 <= x < 2**31:
            raise ValueError(f"expected numbers from 0 to {2**31 - 1}, got {x}")
    return out


def optional(conv: Callable[[Any], T]) -> Callable[[Any], T | None]:
    def check(v: Any) -> T | None:
        return None if v is None or (isinstance(v, str) and v.strip() in ("", "null")) else conv(v)

    return check


def choice(*options: str) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {_show(v)}")
        return s

    return conv


def choice_exact(*options: str) -> Callable[[Any], str]:
    """One of `options`, spelled as given (API enums such as NoSchedule); any other case is named in the error."""

    def conv(v: Any) -> str:
        s = str(v).strip() if isinstance(v, str) else v
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {_show(v)}")
        return str(s)

    return conv


def in_range(
    conv: Callable[[Any], Any], low: float | None = None, high: float | None = None, *, above: bool = False
) -> Callable[[Any], Any]:
    """Wraps a numeric converter with bounds: `low` inclusive (exclusive when `above`), `high` inclusive."""

    def check(v: Any) -> Any:
        x = conv(v)
        if x is None:
            return x
        if low is not None and (x <= low if above else x < low):
            raise ValueError(f"must be {'greater than' if above else 'at least'} {low:g}, got {x:g}")
        if high is not None and x > high:
            raise ValueError(f"must be at most {high:g}, got {x:g}")
        return x

    return check


def positive(conv: Callable[[Any], Any], high: float | None = None) -> Callable[[Any], Any]:
    return in_range(conv, 0, high, above=True)


def non_negative(conv: Callable[[Any], Any], high: float | None = None) -> Callable[[Any], Any]:
    return in_range(conv, 0, high)


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]{0,251}[A-Za-z0-9])?")


def dns_label(v: Any) -> str:
    s = to_str(v)
    if not _DNS_LABEL.fullmatch(s):
        raise ValueError(f"expected a DNS label (lowercase letters, digits, '-'; at most 63), got {_show(v)}")
    return s


def dns_subdomain(v: Any) -> str:
    s = to_str(v)
    if not _DNS_SUBDOMAIN.fullmatch(s):
        raise ValueError(f"expected a DNS subdomain name (lowercase letters, digits, '-', '.'), got {_show(v)}")
    return s


def absolute_path(v: Any) -> str:
    s = to_str(v)
    if not s.startswith("/"):
        raise ValueError(f"expected an absolute path, got {_show(v)}")
    return s


def label_key(v: Any) -> str:
    s = to_str(v)
    prefix, _, name = s.rpartition("/")
    if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"expected a label key ([prefix/]name), got {_show(v)}")
    return s


_QUALIFIED_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def qualified_name(v: Any) -> str:
    """A Kubernetes qualified name, `[prefix/]name`: the prefix a DNS subdomain (at most 253), the name at
    most 63 letters, digits, '-', '_', '.' starting and ending alphanumeric. Taint keys and condition types
    such as `gpu-ready.io/gpu-not-ready` or `nvidia.com/GPUReady`."""
    s = to_str(v)
    prefix, slash, name = s.rpartition("/")
    if (
        len(s) > 317
        or len(prefix) > 253
        or not _LABEL_NAME.fullmatch(name)
        or (slash and not _QUALIFIED_PREFIX.fullmatch(prefix))
    ):
        raise ValueError(f"expected a qualified name ([prefix/]name, e.g. example.com/Name), got {_show(v)}")
    return s


def host_port(v: Any) -> str:
    """`host:port`, `:port` or `[v6]:port` with a port from 0 to 65535."""
    s = to_str(v).strip()
    host, sep, port = s.rpartition(":")
    if not sep or not re.fullmatch(r"\d{1,5}", port) or int(port) > 65535:
        raise ValueError(f"expected host:port with a port from 0 to 65535, got {_show(v)}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare:
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            if not _HOSTNAME.fullmatch(bare):
                raise ValueError(f"expected host:port, got {_show(v)}") from None
    return s


def readable_file(v: Any) -> str:
    s = to_str(v)
    if not os.path.isfile(s):
        raise ValueError(f"no such file: {_show(v)}")
    if not os.access(s, os.R_OK):
        raise ValueError(f"cannot read {_show(v)}")
    return s


def share(v: Any) -> float:
    """A fraction from 0 (inclusive) to 1 (exclusive)."""
    x = to_float(v)
    if not 0 <= x < 1:
        raise ValueError(f"expected a fraction from 0 up to (not including) 1, got {x:g}")
    return x


def metrics_url(v: Any) -> str:
    """An exporter's metrics address: `http(s)://host:port/path`, or `host:port` for `http://host:port/metrics`."""
    s = to_str(v).strip()
    if "://" not in s:
        if host_port(s).startswith(":"):
            raise ValueError(f"expected host:port with a host, got {_show(v)}")
        return f"http://{s}/metrics"
    scheme, _, rest = s.partition("://")
    hostport, slash, _path = rest.partition("/")
    if scheme not in ("http", "https") or not hostport or any(c in s for c in " \t\r\n"):
        raise ValueError(f"expected http://host:port/metrics or host:port, got {_show(v)}")
    if ":" in hostport.rpartition("]")[2]:
        host_port(hostport)
    elif not _HOSTNAME.fullmatch(hostport.strip("[]")):
        raise ValueError(f"expected http://host:port/metrics or host:port, got {_show(v)}")
    return s if slash else s + "/metrics"


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def convert(conv: Callable[[Any], T], value: Any, what: str) -> T:
    """Runs a converter; a bad value raises ConfigError naming `what` (for inputs other than settings)."""
    try:
        return conv(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid {what}: {e}") from None


# -- the settings ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    name: str  # python attribute; flag --name-with-dashes; env GPU_READY_NAME; file key camelCase
    conv: Callable[[Any], Any]
    default: Any
    help: str
    env: str | None = None  # extra env name (e.g. NODE_NAME), read after GPU_READY_<NAME>

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_name(self) -> str:
        return "GPU_READY_" + self.name.upper()

    @property
    def file_key(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(w.capitalize() for w in rest)


SETTINGS: tuple[Setting, ...] = (
    Setting("node_name", optional(dns_subdomain), None, "Node to report on (default: $NODE_NAME)", env="NODE_NAME"),
    Setting("poll_interval", positive(to_float, DAY), 30.0, "seconds between check cycles"),
    Setting("heartbeat_interval", positive(to_float, DAY), 300.0, "seconds between condition heartbeats"),
    # The own Node from a watch and the fleet's writes spread out (issue 20; README "API cost at fleet scale").
    Setting("node_watch", to_bool, True, "read the own Node from a watch (off: GET resourceVersion=0 each poll)"),
    Setting("node_watch_timeout", positive(to_float, DAY), 600.0, "each Node watch lasts 1 to 2 times this, seconds"),
    Setting(
        "start_spread",
        non_negative(to_float, 3600),
        60.0,
        "hold the first condition write after start a random 0..this many seconds (unless the status changes)",
    ),
    Setting("heartbeat_jitter", in_range(to_float, 0, 1), 0.2, "each heartbeat waits interval x (1 +- jitter/2)"),
    Setting("recovery_polls", in_range(to_int, 1, 1000), 2, "clean polls before a level fault clears"),
    Setting("nvidia_smi", to_str, "nvidia-smi", "path of nvidia-smi"),
    Setting("nvidia_smi_timeout", positive(to_float, 3600), 30.0, "hard timeout for one nvidia-smi run, seconds"),
    Setting("sysfs_root", to_str, "/sys", "sysfs mount to count PCI GPUs in"),
    Setting("kmsg", to_str, "/dev/kmsg", "kernel log to read (a regular file in kmsg format works the same)"),
    Setting("kmsg_trust_user", to_bool, False, "count records from user-space facilities too (tests only)"),
    Setting("nvml", choice("auto", "on", "off"), "auto", "NVML checks: auto = when libnvidia-ml loads"),
    Setting("nvml_timeout", positive(to_float, 3600), 10.0, "deadline for one NVML call, seconds"),
    Setting("nvml_nvlink", to_bool, True, "report NVLink links down (NVML)"),
    # Degradation signals (issue 18); docs/degradation.md gives each default's source.
    Setting("pcie", to_bool, True, "judge PCIe links from sysfs (width below what both ends can do: GPUDegraded)"),
    Setting("pcie_bridges", to_bool, True, "also judge the PCIe links above each GPU (switch and root ports)"),
    Setting("pcie_speed", to_bool, True, "judge PCIe link speed too (only while NVML says the GPU is busy)"),
    Setting(
        "pcie_busy_utilization", in_range(to_int, 0, 100), 50, "NVML GPU utilisation % at which PCIe speed is judged"
    ),
    Setting("device_nodes", to_bool, True, "check the NVIDIA device nodes (nvidiactl, nvidia-uvm, nvidia<N>)"),
    Setting("dev_root", to_str, "/dev", "where the device nodes are (/run/nvidia/driver/dev: driver container)"),
    Setting("require_uvm", to_bool, True, "/dev/nvidia-uvm is required (every CUDA program needs it)"),
    Setting("proc_root", to_str, "/proc", "procfs to read GPU minor numbers from (driver/nvidia/gpus/<bdf>)"),
    Setting("clock_events", to_bool, True, "count hardware clock slowdowns over a window (NVML)"),
    Setting("clock_window", positive(to_float, DAY), 600.0, "window for the clock-slowdown share, seconds"),
    Setting("clock_max_slowed_share", share, 0.3, "share of slowed samples in the window that is degraded"),
    Setting("clock_min_samples", in_range(to_int, 1, 100_000), 5, "fewer samples in the window: not judged"),
    Setting(
        "thermal_margin_min",
        optional(in_range(to_float, -100, 200)),
        None,
        "thermal margin (C) at or below which a GPU is degraded (unset: off)",
    ),
    Setting("xid_rate", to_bool, True, "count repeated non-fatal Xids per GPU"),
    Setting("xid_rate_count", in_range(to_int, 1, 100_000), 3, "this many of the same non-fatal Xid on one GPU ..."),
    Setting("xid_rate_window", positive(to_float, DAY), 600.0, "... within this many seconds: GPUDegraded"),
    Setting("xid_rate_ignore", to_int_list, (45,), "Xids the rate never counts (comma list)"),
    Setting(
        "dcgm_exporter",
        optional(metrics_url),
        None,
        "dcgm-exporter metrics address on this node (host:port or URL; unset: cross-check off)",
    ),
    Setting("dcgm_required", to_bool, False, "an unreachable dcgm-exporter is 'could not check' (else informational)"),
    Setting("dcgm_timeout", positive(to_float, 600), 5.0, "timeout for one dcgm-exporter scrape, seconds"),
    Setting("expected_gpus", optional(non_negative(to_int, 4096)), None, "GPUs this node must have (unset: no floor)"),
    Setting("xid_fatal", to_int_list, (), "Xids fatal in addition to the catalog's (comma list)"),
    Setting("xid_ignore", to_int_list, (), "Xids never fatal (comma list)"),
    Setting("unknown_xid_fatal", to_bool, True, "treat Xids missing from the catalog as fatal"),
    # kubelet's pod-resources API: the per-GPU allocation map (issue 17, agent/allocation.py)
    Setting("pod_resources", to_bool, False, "read kubelet's pod-resources API each poll: which pods hold which GPU"),
    Setting(
        "pod_resources_socket",
        absolute_path,
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet's pod-resources socket (mount its directory: kubelet re-creates the socket)",
    ),
    Setting("pod_resources_interval", positive(to_float, DAY), 1.0, "read pod-resources at most this often, seconds"),
    Setting("pod_resources_timeout", positive(to_float, 600), 5.0, "timeout for one pod-resources call, seconds"),
    # DRA-aware counting and per-GPU fencing (issue 16, docs/fencing.md)
    Setting("dra_counting", to_bool, True, "count GPUs from the node's DRA ResourceSlices where they exist"),
    Setting("dra_driver", dns_subdomain, "gpu.nvidia.com", "DRA driver whose devices are counted and fenced"),
    Setting("fencing", to_bool, False, "one DeviceTaintRule per device of a faulty GPU (DRA nodes; docs/fencing.md)"),
    Setting(
        "fencing_effect",
        choice_exact("None", "NoSchedule", "NoExecute"),
        "None",
        "effect of the DeviceTaintRules: None (dry run), NoSchedule or NoExecute (evicts pods)",
    ),
    Setting("fencing_max_rules", in_range(to_int, 1, 1024), 128, "DeviceTaintRules per node at most"),
    Setting("fencing_resync", positive(to_float, DAY), 300.0, "re-list the DeviceTaintRules this often, seconds"),
    Setting("state_dir", to_str, "/var/lib/gpu-ready", "directory for latched faults (a hostPath)"),
    Setting("boot_id_file", to_str, "/proc/sys/kernel/random/boot_id", "file holding the boot ID"),
    Setting(
        "mig_strategy",
        choice("auto", "none", "single", "mixed"),
        "auto",
        "device plugin MIG strategy (auto: from the nvidia.com/mig.strategy label)",
    ),
    Setting(
        "replicas",
        optional(in_range(to_int, 1, 1_000_000)),
        None,
        "time-slicing/MPS replicas (default: the nvidia.com/gpu.replicas label, else 1)",
    ),
    Setting(
        "plugin_grace",
        non_negative(to_float, DAY),
        300.0,
        "seconds after start before a missing device-plugin resource is a fault",
    ),
    Setting(
        "mig_pending_timeout",
        positive(to_float, DAY),
        600.0,
        "seconds nvidia.com/mig.config.state may stay pending before it is a MigConfigFailed fault",
    ),
    Setting(
        "event_interval", non_negative(to_float, DAY), 300.0, "at most one Event per reason and GPU per this many s"
    ),
    Setting(
        "event_namespace",
        choice("default", "kube-system"),
        "default",
        "namespace of the agent's Events about its Node (the apiserver accepts Events about a cluster-scoped "
        "object only in default or kube-system)",
    ),
    Setting("metrics_address", host_port, DEFAULT_METRICS_ADDRESS, "host:port for /metrics, /healthz, /readyz"),
    Setting("require_preflight", to_bool, False, "report True only on nodes labelled <preflight-label>=passed"),
    Setting("preflight_label", label_key, "preflight", "label key set by gpu-ready preflight"),
    Setting(
        "condition_type",
        qualified_name,
        "GPUReady",
        "Node condition type the agent writes (e.g. nvidia.com/GPUReady); must equal the chart's conditionType",
    ),
    Setting(
        "taints",
        choice("off", "startup", "continuous"),
        "off",
        "gpu-ready's taint on its own Node: off, startup (remove when ready) or continuous (docs/taints.md)",
    ),
    Setting("taint_key", qualified_name, "gpu-ready.io/gpu-not-ready", "key of gpu-ready's taint (= chart taints.key)"),
    Setting("taint_no_execute", to_bool, False, "continuous taints: also NoExecute while a fatal fault is latched"),
    Setting("taint_unknown_as_false", to_bool, False, "continuous taints: Unknown taints like False"),
    Setting("kubeconfig", optional(readable_file), None, "kubeconfig file (default: in-cluster, then ~/.kube/config)"),
    Setting("api_timeout", positive(to_float, 600), 10.0, "timeout for one API request, seconds"),
    Setting("log_format", choice("auto", "json", "console"), "auto", "auto: JSON unless stderr is a terminal"),
    Setting("log_level", choice("debug", "info", "warning", "error"), "info", "log level"),
)
BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Config:
    """Every setting, typed. Build it with load(); the attributes are exactly SETTINGS' names."""

    node_name: str | None
    poll_interval: float
    heartbeat_interval: float
    node_watch: bool
    node_watch_timeout: float
    start_spread: float
    heartbeat_jitter: float
    recovery_polls: int
    nvidia_smi: str
    nvidia_smi_timeout: float
    sysfs_root: str
    kmsg: str
    kmsg_trust_user: bool
    nvml: str
    nvml_timeout: float
    nvml_nvlink: bool
    pcie: bool
    pcie_bridges: bool
    pcie_speed: bool
    pcie_busy_utilization: int
    device_nodes: bool
    dev_root: str
    require_uvm: bool
    proc_root: str
    clock_events: bool
    clock_window: float
    clock_max_slowed_share: float
    clock_min_samples: int
    thermal_margin_min: float | None
    xid_rate: bool
    xid_rate_count: int
    xid_rate_window: float
    xid_rate_ignore: tuple[int, ...]
    dcgm_exporter: str | None
    dcgm_required: bool
    dcgm_timeout: float
    expected_gpus: int | None
    xid_fatal: tuple[int, ...]
    xid_ignore: tuple[int, ...]
    unknown_xid_fatal: bool
    pod_resources: bool
    pod_resources_socket: str
    pod_resources_interval: float
    pod_resources_timeout: float
    dra_counting: bool
    dra_driver: str
    fencing: bool
    fencing_effect: str
    fencing_max_rules: int
    fencing_resync: float
    state_dir: str
    boot_id_file: str
    mig_strategy: str
    replicas: int | None
    plugin_grace: float
    mig_pending_timeout: float
    event_interval: float
    event_namespace: str
    metrics_address: str
    require_preflight: bool
    preflight_label: str
    condition_type: str
    taints: str
    taint_key: str
    taint_no_execute: bool
    taint_unknown_as_false: bool
    kubeconfig: str | None
    api_timeout: float
    log_format: str
    log_level: str


def add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    parser.add_argument("--config", help="YAML or JSON settings file (keys in camelCase, e.g. pollInterval)")
    for s in SETTINGS:
        if names is None or s.name in names:
            env = f"; env {s.env_name}" + (f" or {s.env}" if s.env else "")
            parser.add_argument(s.flag, dest=s.name, default=None, help=f"{s.help} (default: {s.default!r}{env})")


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(CONFIG_FILE_LIMIT + 1)
        if len(text) > CONFIG_FILE_LIMIT:
            raise ConfigError(f"config file {path}: larger than {CONFIG_FILE_LIMIT} bytes")
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: {getattr(e, 'strerror', None) or e}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config file {path}: not valid YAML/JSON: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def load(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Flags (args), environment, file, defaults -> Config. Raises ConfigError naming the setting."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[Any, str]] = {}
    path = getattr(args, "config", None) if args is not None else None
    path = path or environ.get("GPU_READY_CONFIG")
    if path:
        keys = {s.file_key: s for s in SETTINGS}
        for k, v in _read_file(path).items():
            s = keys.get(str(k)) or BY_NAME.get(str(k))
            if s is None:
                raise ConfigError(f"config file {path}: unknown setting {_show(k)}")
            raw[s.name] = (v, f"{s.file_key} in {path}")
    for s in SETTINGS:
        for env in (s.env_name, s.env):
            if env and environ.get(env) not in (None, ""):
                raw[s.name] = (environ[env], f"environment variable {env}")
                break
        if args is not None and getattr(args, s.name, None) is not None:
            raw[s.name] = (getattr(args, s.name), s.flag)
    for k, v in (overrides or {}).items():
        if k not in BY_NAME:
            raise ConfigError(f"unknown setting {k!r}")
        raw[k] = (v, k)
    values: dict[str, Any] = {}
    for s in SETTINGS:
        if s.name in raw:
            v, where = raw[s.name]
            values[s.name] = convert(s.conv, v, f"{s.name.replace('_', '-')} ({where})")
        else:
            values[s.name] = s.default
    both = set(values["xid_fatal"]) & set(values["xid_ignore"])
    if both:
        raise ConfigError(f"invalid xid-fatal/xid-ignore: Xids {sorted(both)} are in both lists")
    return Config(**values)


def defaults(**overrides: Any) -> Config:
    """The defaults (no flags, no environment, no file) with some settings replaced, validated."""
    return load(None, environ={}, overrides=overrides)


assert [f.name for f in fields(Config)] == [s.name for s in SETTINGS], "Config and SETTINGS must list the same names"
