"""The chart's values.schema.json `config` keys against the agent's one list of settings (SETTINGS):
same names, compatible types, the same bounds and choices, and the chart's defaults equal the agent's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import config

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gpu-ready"
BY_KEY = {s.file_key: s for s in config.SETTINGS if s.public}
# Settings the chart sets itself (from other values, the downward API or fixed mount paths), or that
# make no sense in a cluster: not part of `config`.
CHART_MANAGED = {
    "conditionType": "conditionType (also read by the admission policy)",
    "taints": "taints.mode when taints.enabled, else off (docs/taints.md)",
    "taintKey": "taints.key (also read by the admission policy)",
    "taintNoExecute": "taints.noExecuteOnFatal",
    "taintUnknownAsFalse": "taints.unknownAsFalse",
    "fencing": "fencing.enabled",
    "fencingEffect": "fencing.effect",
    "fencingMaxRules": "fencing.maxRules",
    "fencingResync": "fencing.resyncSeconds",
    "draDriver": "fencing.driver",
    "draCounting": "fencing.countFromResourceSlices",
    "recovery": "recovery.enabled (RBAC and the admission policy follow it)",
    "recoveryDrainTimeout": "recovery.drainTimeout",
    "recoveryEvict": "recovery.evict (RBAC and the admission policy follow it)",
    "recoveryResetTimeout": "recovery.resetTimeout",
    "recoveryProofCommand": "recovery.proofCommand",
    "recoveryProofTimeout": "recovery.proofTimeout",
    "recoveryBudget": "recovery.budget",
    "recoveryWindow": "recovery.windowSeconds",
    "recoverySettleTimeout": "recovery.settleTimeout",
    "recoveryBurstWindow": "recovery.burstWindow",
    "recoveryReleaseHolders": "recovery.releaseHolders (RBAC and the admission policy follow it)",
    "recoveryPluginNamespace": "recovery.devicePlugin.namespace (RBAC and the admission policy follow it)",
    "recoveryPluginDaemonset": "recovery.devicePlugin.daemonSet (the admission policy follows it)",
    "nodeName": "NODE_NAME from spec.nodeName",
    "eventNamespace": "GPU_READY_EVENT_NAMESPACE from events.namespace (default or kube-system)",
    "sysfsRoot": "the /host/sys mount",
    "kmsg": "the /dev/kmsg mount",
    "stateDir": "the stateDir hostPath mount",
    "bootIdFile": "the boot_id mount",
    "metricsAddress": "metrics.port",
    "kubeconfig": "in-cluster ServiceAccount",
    "nvidiaSmi": "the image's nvidia-smi",
    "logFormat": "agent.logFormat",
    "logLevel": "agent.logLevel",
    "needsPreflightLabel": "preflight.needsLabel (also read by the admission policy)",
    "brakeConfigmap": "<release namespace>/<fullname>-brake when preflight.auto.enabled and its brake",
}


def schema_config() -> dict[str, Any]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return schema["properties"]["config"]["properties"]


def test_every_schema_key_is_a_setting():
    unknown = sorted(set(schema_config()) - set(BY_KEY))
    assert not unknown, f"values.schema.json config keys the agent does not know: {unknown}"


def test_every_setting_is_in_the_schema_or_set_by_the_chart():
    missing = sorted(set(BY_KEY) - set(schema_config()) - set(CHART_MANAGED))
    assert not missing, f"settings missing from values.schema.json config: {missing}"
    assert set(CHART_MANAGED) <= set(BY_KEY), sorted(set(CHART_MANAGED) - set(BY_KEY))


def _accepts(s: config.Setting, value: Any) -> bool:
    try:
        s.conv(value)
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize("key", sorted(schema_config()))
def test_schema_types_and_bounds_match_the_converter(key):
    prop, s = schema_config()[key], BY_KEY[key]
    types = prop.get("type", [])
    types = [types] if isinstance(types, str) else types
    if "enum" in prop:
        for option in prop["enum"]:
            assert s.conv(option) == option
        assert not _accepts(s, "not-an-option")
    if "boolean" in types:
        assert s.conv(True) is True and s.conv(False) is False
    if "integer" in types:
        assert s.conv(3) == 3 and not _accepts(s, 3.5)
    if "number" in types:
        x = 0.5 if prop.get("exclusiveMaximum", prop.get("maximum", 3)) <= 2.5 else 2.5
        assert s.conv(x) == x
    if "exclusiveMaximum" in prop:
        high = prop["exclusiveMaximum"]
        assert not _accepts(s, high) and _accepts(s, high - (0.5 if "number" in types else 1))
    if "maximum" in prop and "array" not in types:
        assert _accepts(s, prop["maximum"]) and not _accepts(s, prop["maximum"] + 1)
    if "null" in types:
        assert s.conv(None) is None
    if "array" in types:
        assert s.conv([79, 48]) == (79, 48) and not _accepts(s, [-1])
    if "exclusiveMinimum" in prop:
        low = prop["exclusiveMinimum"]
        assert not _accepts(s, low) and _accepts(s, low + 1)
    if "minimum" in prop and "array" not in types:
        low = prop["minimum"]
        assert _accepts(s, low) and not _accepts(s, low - 1)
    if "minLength" in prop:
        assert not _accepts(s, "")


def test_chart_defaults_are_the_agent_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    for key, v in values.items():
        s = BY_KEY[key]
        assert s.conv(v) == s.conv(s.default) if s.default is not None else s.conv(v) is None, key
