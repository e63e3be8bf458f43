"""The names the agent, the preflight Job and the controller share: the node condition, the taints, the labels and
annotations they read and write on a Node, the marks on what they create, and the fleet brake's ConfigMap (its keys,
one formatter and one parser of its data). Pure: it imports nothing of the agent, so every wing may use it.

The defaults here are also the chart's (values.yaml); the settings that rename the condition, the taint or the
labels (the chart's admission policy allows only the configured ones) start from them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# -- on the Node ---------------------------------------------------------------------------------------------------

CONDITION_TYPE = "GPUReady"  # the node condition the agent writes (settings: condition_type)
TAINT_KEY = "gpu-ready.io/gpu-not-ready"  # gpu-ready's own node taint (settings: taint_key; chart taints.key)
NEEDS_PREFLIGHT_LABEL = "gpu-ready.io/needs-preflight"  # =true: a GPU fault latched here; preflight must pass again
PREFLIGHT_LABEL = "preflight"  # what preflight found: PREFLIGHT_PASSED or PREFLIGHT_FAILED
PREFLIGHT_PASSED = "passed"
PREFLIGHT_FAILED = "failed"
CLEAR_BEFORE_ANNOTATION = "gpu-ready.io/clear-before"  # an operator's clear of latched faults (RFC 3339)
CORDONED_BY_ANNOTATION = "gpu-ready.io/preflight-cordoned"  # =true: the cordon is preflight's, lifted on a pass
PREFLIGHT_TIME_ANNOTATION = "gpu-ready.io/preflight-time"
PREFLIGHT_REPORT_ANNOTATION = "gpu-ready.io/preflight-report"

# -- on what gpu-ready creates -------------------------------------------------------------------------------------

MANAGED_LABEL = "gpu-ready.io/managed-by"  # on the controller's Jobs and its brake ConfigMap
MANAGED_VALUE = "gpu-ready-controller"
RULE_MANAGED_LABEL = "app.kubernetes.io/managed-by"  # on the agent's DeviceTaintRules
RULE_MANAGED_VALUE = "gpu-ready"


# -- the fleet brake's ConfigMap -----------------------------------------------------------------------------------
# The controller writes it; every agent reads `admitted` (and `selector`); the rest is for people and alerts.

BRAKE_ENGAGED = "engaged"  # "true" while more GPU nodes are held out of service than maxUnavailable
BRAKE_ADMITTED = "admitted"  # the nodes admitted to a disruptive action, comma-separated
BRAKE_UNAVAILABLE = "unavailable"
BRAKE_MAX_UNAVAILABLE = "maxUnavailable"
BRAKE_GPU_NODES = "gpuNodes"
BRAKE_SELECTOR = "selector"  # the controller's GPU node selector: a node it does not match is admitted by rule
MAX_ADMITTED_BYTES = 64 * 1024  # the controller admits at most maxUnavailable names: far below this


def format_brake(
    engaged: bool, admitted: Iterable[str], unavailable: int, max_unavailable: int, gpu_nodes: int
) -> dict[str, str]:
    """The brake ConfigMap's data (without `selector`, which the controller adds from its flags)."""
    return {
        BRAKE_ENGAGED: "true" if engaged else "false",
        BRAKE_ADMITTED: ",".join(admitted),
        BRAKE_UNAVAILABLE: str(unavailable),
        BRAKE_MAX_UNAVAILABLE: str(max_unavailable),
        BRAKE_GPU_NODES: str(gpu_nodes),
    }


def parse_admitted(data: Any) -> tuple[str, ...] | None:
    """The admitted nodes of the brake ConfigMap's `data`, in order, blanks and spaces around names dropped; None
    when it is malformed (no data, no `admitted`, not text, over MAX_ADMITTED_BYTES): the agent then holds (fails
    closed) and the controller starts its term with no admissions kept."""
    if not isinstance(data, Mapping):
        return None
    raw = data.get(BRAKE_ADMITTED)
    if not isinstance(raw, str) or len(raw) > MAX_ADMITTED_BYTES:
        return None
    return tuple(n for n in (x.strip() for x in raw.split(",")) if n)


def fleet_over_budget(data: Any) -> bool:
    """Whether the brake's data says the fleet is over its budget."""
    return isinstance(data, Mapping) and data.get(BRAKE_ENGAGED) == "true"
