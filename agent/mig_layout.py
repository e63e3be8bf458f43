"""MIG layout health, pure: the GPU Operator's mig-manager plan and state on the Node against the MIG
instances that exist (NVML/nvidia-smi) and the ones the device plugin advertises. No I/O, no clock (time is an
argument); the runner reads the labels from its cached Node and keeps `pending_since` between cycles.

The Node labels (set by the GPU Operator's mig-manager):
- `nvidia.com/mig.config`: the plan, e.g. `all-disabled`, `all-1g.10gb`, `all-balanced` or a custom name;
- `nvidia.com/mig.config.state`: `pending` while mig-manager applies it, `success`, or `failed`.

Rules (each a MigConfigFailed fault, check `mig_layout`):
- state `failed`;
- state `pending` for `timeout_s` or longer (`migPendingTimeout`); while pending the layout is not compared
  (a reconfiguration is under way);
- otherwise the plan is compared with what exists and what is advertised:
  `all-disabled`: no GPU has MIG enabled or MIG instances, and no `nvidia.com/mig-*` resource is advertised;
  `all-<profile>` (e.g. `all-1g.10gb`): every GPU has MIG enabled with instances, and `nvidia.com/mig-<profile>`
  devices are advertised (or, with the `single` MIG strategy, no `nvidia.com/mig-*` resource and
  `nvidia.com/gpu` devices);
  any other name: MIG instances exist and MIG devices are advertised.
A source that does not say (no GPU listed with a MIG mode, no advertised counts) is not compared."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.model import Check, Finding, GpuIdentity, Reason
from agent.settings import DAY, WITH_NODE, positive, setting, to_float

MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_PENDING_TIMEOUT_S = 600.0
_PROFILE = re.compile(r"[1-9]\d?g\.\d{1,4}gb(?:\+[a-z0-9.]{1,16})?")
_LIMIT = 128  # characters of a label value shown in a message


@dataclass(frozen=True)
class MigConfigResult:
    findings: tuple[Finding, ...]
    pending_since: float | None  # when the `pending` state was first seen (keep it for the next cycle)


def _show(v: str) -> str:
    return v if len(v) <= _LIMIT else v[: _LIMIT - 1] + "…"


def node_mig_inputs(node: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, int] | None]:
    """The Node's labels (strings only) and its advertised device counts per resource name (status.capacity;
    None when the Node has no capacity). Unparseable quantities are left out."""
    meta = (node or {}).get("metadata")
    raw = meta.get("labels") if isinstance(meta, dict) else None
    labels = {str(k): v for k, v in raw.items() if isinstance(v, str)} if isinstance(raw, dict) else {}
    status = (node or {}).get("status")
    cap = status.get("capacity") if isinstance(status, dict) else None
    if not isinstance(cap, dict):
        return labels, None
    counts: dict[str, int] = {}
    for k, v in list(cap.items())[:1000]:
        if isinstance(k, str) and (k == GPU_RESOURCE or k.startswith(MIG_RESOURCE_PREFIX)):
            s = str(v).strip()
            if s.isdigit() and len(s) < 10:
                counts[k] = int(s)
    return labels, counts


def _fault(kind: str, message: str) -> Finding:
    return Finding.fault(Check.MIG_LAYOUT, Reason.MIG_CONFIG_FAILED, message, kind=kind)


def judge_mig_config(
    labels: Mapping[str, str],
    gpus: Sequence[GpuIdentity],
    advertised: Mapping[str, int] | None,
    *,
    now: float,
    pending_since: float | None,
    timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
) -> MigConfigResult:
    """The findings for one cycle. `gpus`: the GPUs NVML/nvidia-smi listed (mig_enabled None: the source does not
    say); `advertised`: device counts per resource name (pod-resources allocatable or the Node's capacity; None:
    not known); `pending_since`: what the previous cycle returned."""
    plan = labels.get(MIG_CONFIG_LABEL)
    state = labels.get(MIG_STATE_LABEL)
    if plan is None and state is None:
        return MigConfigResult((), None)
    shown = _show(plan) if plan is not None else "(no plan label)"
    if state == "failed":
        msg = f"{MIG_STATE_LABEL}=failed: mig-manager could not apply the MIG layout {shown}"
        return MigConfigResult((_fault("mig_config_failed", msg),), None)
    if state == "pending":
        since = now if pending_since is None else pending_since
        waited = max(0.0, now - since)
        if waited >= timeout_s:
            msg = (
                f"{MIG_STATE_LABEL}=pending for {waited:.0f}s (limit {timeout_s:.0f}s): MIG layout {shown} not applied"
            )
            return MigConfigResult((_fault("mig_config_pending", msg),), since)
        info = Finding.info(
            Check.MIG_LAYOUT, f"MIG layout {shown} pending for {waited:.0f}s", kind="mig_config_pending"
        )
        return MigConfigResult((info,), since)
    if plan is None:
        return MigConfigResult((), None)
    problems = compare_plan(plan, gpus, advertised)
    return MigConfigResult(
        tuple(_fault("mig_layout_mismatch", f"{MIG_CONFIG_LABEL}={shown}: {p}") for p in problems), None
    )


def _gpu_name(g: GpuIdentity) -> str:
    return f"GPU {g.index} ({g.address.nvml})" if g.index is not None else f"GPU {g.address.nvml}"


def _names(gs: Sequence[GpuIdentity], limit: int = 4) -> str:
    out = ", ".join(_gpu_name(g) for g in gs[:limit])
    return out + (f" (+{len(gs) - limit} more)" if len(gs) > limit else "")


def compare_plan(plan: str, gpus: Sequence[GpuIdentity], advertised: Mapping[str, int] | None) -> list[str]:
    """What does not match the plan (empty: it matches or cannot be judged)."""
    known = [g for g in gpus if g.mig_enabled is not None]
    mig_ads = {k: n for k, n in (advertised or {}).items() if k.startswith(MIG_RESOURCE_PREFIX) and n > 0}
    out: list[str] = []
    if plan == "all-disabled":
        on = [g for g in known if g.mig_enabled or g.mig_devices > 0]
        if on:
            out.append(f"MIG is enabled on {_names(on)}")
        if mig_ads:
            out.append("MIG devices advertised: " + ", ".join(f"{k}={n}" for k, n in sorted(mig_ads.items())[:4]))
        return out
    instances = sum(g.mig_devices for g in known)
    profile = plan[4:] if plan.startswith("all-") else ""
    if _PROFILE.fullmatch(profile):
        off = [g for g in known if not g.mig_enabled or g.mig_devices == 0]
        if off:
            out.append(f"no MIG instances on {_names(off)}")
        if advertised is not None:
            res = MIG_RESOURCE_PREFIX + profile
            single = not mig_ads and advertised.get(GPU_RESOURCE, 0) > 0 and (not known or instances > 0)
            if advertised.get(res, 0) <= 0 and not single:
                out.append(f"no {res} devices advertised")
        return out
    if known and instances == 0:
        out.append("no MIG instances exist")
    single = advertised is not None and advertised.get(GPU_RESOURCE, 0) > 0 and (instances > 0 or not known)
    if advertised is not None and not mig_ads and not single:
        out.append("no MIG devices advertised")
    return out


@dataclass(frozen=True)
class MigConfigSettings:
    """Settings of the MIG layout check."""

    mig_pending_timeout: float = setting(
        positive(to_float, DAY),
        600.0,
        "seconds nvidia.com/mig.config.state may stay pending before it is a MigConfigFailed fault "
        "(docs/allocation.md)",
        commands=WITH_NODE,
    )
