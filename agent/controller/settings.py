"""The controller's flags as one settings section (agent/settings.py `setting` fields): name, converter, default
and help in one row each; main.py's add_arguments derives the flags from it, and check_args judges the bounds."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from agent.names import CONDITION_TYPE, NEEDS_PREFLIGHT_LABEL, PREFLIGHT_LABEL, TAINT_KEY
from agent.settings import setting


@dataclass(frozen=True)
class ControllerSettings:
    """`gpu-ready controller`'s flags (docs/controller.md)."""

    namespace: str = setting(str, "gpu-ready", "its namespace (Jobs, Lease, brake)", env="POD_NAMESPACE")
    job_template: str | None = setting(str, None, "the chart's preflight Job, rendered (a YAML file)", required=True)
    job_prefix: str = setting(str, "gpu-ready-preflight", "the Jobs' name prefix")
    identity: str = setting(str, socket.gethostname(), "this replica's Lease id", env="POD_NAME")
    lease_name: str = setting(str, "gpu-ready-controller", "the Lease that elects the active replica")
    lease_duration: float = setting(float, 10.0, "seconds a silent holder keeps the Lease")
    gpu_selector: str = setting(str, "nvidia.com/gpu.present=true", "label selector of GPU Nodes")
    needs_label: str = setting(str, NEEDS_PREFLIGHT_LABEL, "the label that asks for preflight on a Node")
    preflight_label: str = setting(str, PREFLIGHT_LABEL, "the label preflight writes: <key>=passed|failed")
    taint_key: str = setting(str, TAINT_KEY, "the agent's taint key")
    condition_type: str = setting(str, CONDITION_TYPE, "the agent's node condition")
    startup_taint: str = setting(str, "", "also run preflight on new nodes with this taint key")
    max_concurrent: int = setting(int, 2, "preflight Jobs running at once, fleet-wide")
    max_failures: int = setting(int, 3, "failed runs per node before the controller stops retrying it")
    backoff: float = setting(float, 300.0, "seconds after a failed run (doubles each time)")
    pending_timeout: float = setting(
        float, 900.0, "seconds a Job's pod may wait to run before it is reported (an Event)"
    )
    brake: str = setting(str, "", 'the brake ConfigMap\'s name ("": no brake)')
    max_unavailable: str = setting(str, "10%", "a count or a percentage of GPU nodes")
    event_namespace: str = setting(str, "default", "namespace of Events about Nodes")
    metrics_address: str = setting(str, "0.0.0.0:9466", "host:port of /metrics and /healthz")
    resync: float = setting(float, 30.0, "reconcile at least this often (seconds)")
    watch_timeout: float = setting(float, 600.0, "each watch lasts about this long, seconds", public=False)
    kubeconfig: str | None = setting(str, None, "a kubeconfig file (default: in-cluster, then ~/.kube/config)")
