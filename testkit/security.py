"""Who said no to a request on the test apiserver: RBAC or one of the chart's admission policies (the security
matrices of tests/test_security.py and tests/test_security_pods.py, and the modules that wait for a policy to
load before relying on it)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from agent.kube.client import ApiError, KubeApi


def denied_by(message: str) -> str:
    """Which layer said no: RBAC (authorization) or one of the chart's admission policies."""
    if "ValidatingAdmissionPolicy" in message:
        return "policy " + re.sub(r"^.*?-gpu-ready-", "", message.split("ValidatingAdmissionPolicy '")[1].split("'")[0])
    return "RBAC" if "cannot" in message and "forbidden" in message else ""


def denied_by_policy(fn: Callable[[], Any], policy: str) -> bool:
    """A probe: True once the request is denied by `policy` (policies take a moment to load after creation)."""
    try:
        fn()
    except ApiError as e:
        if e.status == 403 and policy in str(e):
            return True
        raise
    return False


def client_as(cp: Any, user_agent: str) -> KubeApi:
    """An admin client whose writes the apiserver records under another field manager (the first word of the
    User-Agent): kubelet/..., kubectl/..., so that a Node's managedFields look like a real cluster's."""
    api: KubeApi = cp.admin()
    api.user_agent = user_agent
    return api


def outcome(fn: Callable[[], Any]) -> tuple[int, str]:
    """One attempt: (200, "") when the apiserver took it, else (status, who said no: RBAC, "policy <name>", or ""
    for a refusal by neither, e.g. a quota or validation)."""
    try:
        fn()
    except ApiError as e:
        return e.status, denied_by(str(e))
    return 200, ""
