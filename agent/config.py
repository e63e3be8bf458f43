"""One typed settings object from flags, environment and a config file (the chart's ConfigMap).

Precedence: command-line flag > environment variable (GPU_READY_<NAME>) > config file > default.
Every setting is declared once in SETTINGS; flags, env names, file keys and docs derive from it.
A bad value raises ConfigError naming the setting, and the CLI exits 2 with that message."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

DEFAULT_METRICS_ADDRESS = "0.0.0.0:9465"  # not dcgm-exporter's 9400 nor node-exporter's 9100


class ConfigError(ValueError):
    pass


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _int_list(v: Any) -> list[int]:
    if isinstance(v, list):
        return [int(x) for x in v]
    s = str(v).strip()
    return [int(x) for x in s.replace(" ", ",").split(",") if x] if s else []


def _opt_int(v: Any) -> int | None:
    return None if v in (None, "", "null") else int(v)


def _choice(*options: str) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        s = str(v)
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {s!r}")
        return s

    return conv


def _positive(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        x = conv(v)
        if x is not None and x <= 0:
            raise ValueError(f"must be greater than 0, got {x}")
        return x

    return check


def _non_negative(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        x = conv(v)
        if x is not None and x < 0:
            raise ValueError(f"must be 0 or more, got {x}")
        return x

    return check


@dataclass(frozen=True)
class Setting:
    name: str  # python attribute; flag --name-with-dashes; env GPU_READY_NAME; file key camelCase
    conv: Callable[[Any], Any]
    default: Any
    help: str
    env: str | None = None  # extra env name (e.g. NODE_NAME)

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
    Setting("node_name", str, None, "Node to report on (default: $NODE_NAME)", env="NODE_NAME"),
    Setting("poll_interval", _positive(float), 30.0, "seconds between check cycles"),
    Setting("heartbeat_interval", _positive(float), 300.0, "seconds between condition heartbeats"),
    Setting("recovery_polls", _positive(int), 2, "clean polls before a level fault clears"),
    Setting("nvidia_smi", str, "nvidia-smi", "path of nvidia-smi"),
    Setting("nvidia_smi_timeout", _positive(float), 30.0, "hard timeout for one nvidia-smi run, seconds"),
    Setting("sysfs_root", str, "/sys", "sysfs mount to count PCI GPUs in"),
    Setting("kmsg", str, "/dev/kmsg", "kernel log to read (a regular file in kmsg format works the same)"),
    Setting("kmsg_trust_user", _bool, False, "count records from user-space facilities too (tests only)"),
    Setting("nvml", _choice("auto", "on", "off"), "auto", "NVML checks: auto = when libnvidia-ml loads"),
    Setting("nvml_timeout", _positive(float), 10.0, "deadline for one NVML call, seconds"),
    Setting("nvml_nvlink", _bool, True, "report NVLink links down (NVML)"),
    Setting("expected_gpus", _non_negative(_opt_int), None, "GPUs this node must have (unset: no floor)"),
    Setting("xid_fatal", _int_list, [], "Xids fatal in addition to the catalog's (comma list)"),
    Setting("xid_ignore", _int_list, [], "Xids never fatal (comma list)"),
    Setting("unknown_xid_fatal", _bool, True, "treat Xids missing from the catalog as fatal"),
    Setting("state_dir", str, "/var/lib/gpu-ready", "directory for latched faults (a hostPath)"),
    Setting("boot_id_file", str, "/proc/sys/kernel/random/boot_id", "file holding the boot ID"),
    Setting(
        "mig_strategy",
        _choice("auto", "none", "single", "mixed"),
        "auto",
        "device plugin MIG strategy (auto: from the nvidia.com/mig.strategy label)",
    ),
    Setting(
        "replicas",
        _positive(_opt_int),
        None,
        "time-slicing/MPS replicas (default: the nvidia.com/gpu.replicas label, else 1)",
    ),
    Setting(
        "plugin_grace",
        _non_negative(float),
        300.0,
        "seconds after start before a missing device-plugin resource is a fault",
    ),
    Setting("event_interval", _non_negative(float), 300.0, "at most one Event per reason and GPU per this many s"),
    Setting("metrics_address", str, DEFAULT_METRICS_ADDRESS, "host:port for /metrics, /healthz, /readyz"),
    Setting("require_preflight", _bool, False, "report True only on nodes labelled <preflight-label>=passed"),
    Setting("preflight_label", str, "preflight", "label key set by gpu-ready preflight"),
    Setting("kubeconfig", str, None, "kubeconfig file (default: in-cluster, then ~/.kube/config)"),
    Setting("api_timeout", _positive(float), 10.0, "timeout for one API request, seconds"),
    Setting("log_format", _choice("auto", "json", "console"), "auto", "auto: JSON unless stderr is a terminal"),
    Setting("log_level", _choice("debug", "info", "warning", "error"), "info", "log level"),
)
BY_NAME = {s.name: s for s in SETTINGS}


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, **kw: Any) -> Config:
        return Config({**self.values, **kw})


def add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    parser.add_argument("--config", help="YAML or JSON settings file (keys in camelCase, e.g. pollInterval)")
    for s in SETTINGS:
        if names is None or s.name in names:
            env = f"; env {s.env_name}" + (f" or {s.env}" if s.env else "")
            parser.add_argument(s.flag, dest=s.name, default=None, help=f"{s.help} (default: {s.default!r}{env})")


def load(
    args: argparse.Namespace | None = None,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    environ = dict(os.environ) if environ is None else environ
    raw: dict[str, tuple[Any, str]] = {}
    path = getattr(args, "config", None) if args is not None else None
    path = path or environ.get("GPU_READY_CONFIG")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            data = yaml.safe_load(text) if not path.endswith(".json") else json.loads(text)
        except (OSError, yaml.YAMLError, json.JSONDecodeError) as e:
            raise ConfigError(f"config file {path}: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
        keys = {s.file_key: s for s in SETTINGS}
        for k, v in data.items():
            s = keys.get(k) or BY_NAME.get(k)
            if s is None:
                raise ConfigError(f"config file {path}: unknown setting {k!r}")
            raw[s.name] = (v, f"{s.file_key} in {path}")
    for s in SETTINGS:
        for env in (s.env_name, s.env):
            if env and environ.get(env) not in (None, ""):
                raw[s.name] = (environ[env], f"environment variable {env}")
                break
        if args is not None and getattr(args, s.name, None) is not None:
            raw[s.name] = (getattr(args, s.name), s.flag)
    for k, v in (overrides or {}).items():
        raw[k] = (v, k)
    values = {}
    for s in SETTINGS:
        if s.name in raw:
            v, where = raw[s.name]
            try:
                values[s.name] = s.conv(v)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"invalid {s.name.replace('_', '-')} ({where}): {e}") from e
        else:
            values[s.name] = s.default
    both = set(values["xid_fatal"]) & set(values["xid_ignore"])
    if both:
        raise ConfigError(f"invalid xid-fatal/xid-ignore: Xids {sorted(both)} are in both lists")
    return Config(values)
