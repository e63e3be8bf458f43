"""The preflight profile: what the node must look like and how the gates run. Every key is type-checked and
converted here (a YAML `gpuCount: "8"` is the number 8), so a bad profile is one clear error, never a gate
that compares a string with a number."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from agent.preflight.result import GATES
from agent.settings import (
    ConfigError,
    _show,
    convert,
    load_yaml,
    non_negative,
    positive,
    read_text_file,
    to_bool,
    to_float,
    to_int,
    to_str,
)

PROFILE_LIMIT = 64 << 10  # bytes; a profile is a few hundred


class ProfileError(ValueError):
    pass


_CONSTRAINT = re.compile(r"\s*(>=|<=|==|>|<|=)?\s*([0-9]{1,9}(?:\.[0-9]{1,9}){0,4})\s*")


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d{1,9}", v[:64]))


def version_matches(version: str, spec: str) -> bool:
    """spec: comma-separated constraints like ">=550.90, <600" or "==12.4"."""
    ok = True
    for part in spec.split(",")[:16]:
        m = _CONSTRAINT.fullmatch(part[:64])
        if not m:
            raise ProfileError(f"bad version constraint {part[:64]!r} in {spec[:120]!r}")
        op, want = m.group(1) or ">=", _vtuple(m.group(2))
        have = _vtuple(version)
        ok &= {
            ">=": have >= want,
            "<=": have <= want,
            "==": have == want,
            "=": have == want,
            ">": have > want,
            "<": have < want,
        }[op]
    return ok


def _version_spec(v: Any) -> str:
    if not isinstance(v, str):  # 550.90 in YAML is the float 550.9: refuse instead of guessing
        raise ValueError(f'expected a quoted version constraint such as ">=550.90", got {_show(v)}')
    version_matches("0", v)
    return v


def _regex(v: Any) -> str:
    s = to_str(v)
    try:
        re.compile(s)
    except re.error as e:
        raise ValueError(f"not a regular expression ({e})") from None
    return s


def _gate_list(v: Any) -> list[str]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list of gate names, got {_show(v)}")
    bad = [g for g in v if g not in GATES]
    if bad:
        raise ValueError(f"unknown gate names {_show(bad)}; gates are {', '.join(GATES)}")
    return [str(g) for g in v]


def _timeouts(v: Any) -> dict[str, float]:
    if not isinstance(v, dict):
        raise ValueError(f"expected a mapping of gate name to seconds, got {_show(v)}")
    bad = [g for g in v if g not in GATES]
    if bad:
        raise ValueError(f"unknown gate names {_show(bad)}; gates are {', '.join(GATES)}")
    return {str(g): positive(to_float, 7 * 86400)(s) for g, s in v.items()}


def _mig_mode(v: Any) -> str:
    s = to_str(v).lower()
    if s not in ("enabled", "disabled"):
        raise ValueError("expected enabled or disabled")
    return s


SERVING_KEYS = {"command": to_str, "maxLatencySeconds": positive(to_float, 7 * 86400), "expectOutput": _regex}


def _serving(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"expected a mapping with {', '.join(SERVING_KEYS)}, got {_show(v)}")
    unknown = sorted(set(v) - set(SERVING_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {', '.join(map(str, unknown))} (known: {', '.join(SERVING_KEYS)})")
    return {k: None if x is None else SERVING_KEYS[k](x) for k, x in v.items()}


# profile key -> (attribute, converter)
KEYS: dict[str, tuple[str, Any]] = {
    "gpuModel": ("gpu_model", to_str),
    "gpuCount": ("gpu_count", non_negative(to_int, 4096)),
    "memoryPerGpuMiB": ("memory_per_gpu_mib", non_negative(to_int, 1 << 30)),
    "driverVersion": ("driver_version", _version_spec),
    "cudaVersion": ("cuda_version", _version_spec),
    "migMode": ("mig_mode", _mig_mode),
    "nvlinkLinksPerGpu": ("nvlink_links_per_gpu", non_negative(to_int, 1024)),
    "pcieGen": ("pcie_gen", non_negative(to_int, 64)),
    "pcieWidth": ("pcie_width", non_negative(to_int, 64)),
    "eccEnabled": ("ecc_enabled", to_bool),
    "allowSkip": ("allow_skip", _gate_list),
    "timeouts": ("timeouts", _timeouts),
    "burnInSeconds": ("burnin_seconds", positive(to_float, 7 * 86400)),
    "burnInCommand": ("burnin_command", to_str),
    "p2pMinGBps": ("p2p_min_gbps", non_negative(to_float, 1e6)),
    "serving": ("serving", _serving),
}


@dataclass
class Profile:
    gpu_model: str | None = None  # substring of the GPU name, e.g. "H100"
    gpu_count: int | None = None
    memory_per_gpu_mib: int | None = None  # minimum
    driver_version: str | None = None  # e.g. ">=550.90, <600"
    cuda_version: str | None = None  # e.g. ">=12.4"
    mig_mode: str | None = None  # "enabled" | "disabled"
    nvlink_links_per_gpu: int | None = None
    pcie_gen: int | None = None  # minimum max-link generation
    pcie_width: int | None = None  # minimum max-link width
    ecc_enabled: bool | None = None
    allow_skip: list[str] = field(default_factory=lambda: ["serving"])
    timeouts: dict[str, float] = field(default_factory=dict)
    burnin_seconds: float = 300.0
    burnin_command: str | None = None  # e.g. "dcgmi diag -r 3" or "gpu_burn 300"
    p2p_min_gbps: float | None = None
    serving: dict[str, Any] = field(default_factory=dict)  # command, maxLatencySeconds, expectOutput

    @classmethod
    def from_mapping(cls, data: Any) -> Profile:
        """Validates and converts every key; raises ProfileError naming the key."""
        if not isinstance(data, dict):
            raise ProfileError("the profile must be a mapping")
        unknown = sorted((k if isinstance(k, str) else _show(k))[:60] for k in set(data) - set(KEYS))
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ProfileError(f"unknown profile keys: {', '.join(unknown[:5])}{more} (known: {', '.join(KEYS)})")
        values: dict[str, Any] = {}
        for key, raw in data.items():
            attr, conv = KEYS[key]
            if raw is None:
                continue  # the default
            try:
                values[attr] = convert(conv, raw, f"profile key {key}")
            except (ConfigError, ProfileError) as e:
                msg = str(e)
                raise ProfileError(msg if key in msg else f"invalid profile key {key}: {msg}") from None
        return cls(**values)

    @classmethod
    def load(cls, path: str) -> Profile:
        """A regular file of at most PROFILE_LIMIT bytes, nested at most settings.MAX_NESTING levels (a FIFO, a
        larger or a deeper document is refused before it is parsed); anything wrong is one ProfileError line."""
        try:
            text = read_text_file(path, PROFILE_LIMIT)
            data = load_yaml(text)
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ProfileError(f"cannot read profile {path}: {e}") from None
        except yaml.YAMLError as e:
            raise ProfileError(f"cannot read profile {path}: {(str(e).splitlines() or ['not YAML'])[0]}") from None
        return cls.from_mapping(data or {})
