"""The security matrices' machinery (tests/test_security.py, tests/test_security_bounds.py and the modules that
wait for a policy to load before relying on it): who said no to a request on the test apiserver (RBAC or one of
the chart's admission policies), a token bound to a Pod on a node as a client, one attempt sent and judged, and
the table of attempts in docs/deployment.md compared with the file."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.kube.client import MERGE_PATCH, STRATEGIC_MERGE, ApiError, KubeApi
from testkit.chart import Release
from testkit.cluster import bound_token, now_rfc3339
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for

JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"
PATCH_NAMES = {STRATEGIC_MERGE: "strategic merge", MERGE_PATCH: "merge", JSON_PATCH: "JSON patch", APPLY: "apply"}


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


def wait_policy_loaded(api: KubeApi, probe: Callable[[KubeApi], Any], policy: str, what: str) -> None:
    """Waits (bounded) until `probe(api)` is denied by the admission policy `policy`, then closes `api`."""
    try:
        wait_for(lambda: denied_by_policy(lambda: probe(api), policy), 60, 0.2, f"the {what} to take effect")
    finally:
        api.close()


def client_as(cp: Any, user_agent: str) -> KubeApi:
    """An admin client whose writes the apiserver records under another field manager (the first word of the
    User-Agent): kubelet/..., kubectl/..., so that a Node's managedFields look like a real cluster's."""
    api: KubeApi = cp.admin()
    api.user_agent = user_agent
    return api


def bound_client(cp: ControlPlane, admin: KubeApi, rel: Release, preflight: bool, node: str | None) -> KubeApi:
    """A client with a token of the release's agent (or preflight) ServiceAccount, bound to a new Pod on `node`
    (None: a token bound to no pod)."""
    sa = f"{rel.fullname}-preflight" if preflight else rel.fullname
    tok, _ = bound_token(admin, rel.ns, sa, node)
    return KubeApi.from_token(cp.host, tok, cp.ca_file)


def outcome(fn: Callable[[], Any]) -> tuple[int, str]:
    """One attempt: (200, "") when the apiserver took it, else (status, who said no: RBAC, "policy <name>", or ""
    for a refusal by neither, e.g. a quota or validation)."""
    try:
        fn()
    except ApiError as e:
        return e.status, denied_by(str(e))
    return 200, ""


def attempted_condition(ctype: str, status: str = "True", **over: Any) -> dict[str, Any]:
    """A node condition as an attempt writes it (reason GPUsHealthy, message "attempt", both times now)."""
    t = now_rfc3339()
    c = {"type": ctype, "status": status, "reason": "GPUsHealthy", "message": "attempt"}
    return {**c, "lastHeartbeatTime": t, "lastTransitionTime": t, **over}


def without(node: dict[str, Any], *keys: str) -> dict[str, Any]:
    """A copy of the object without the metadata `keys` (what every write changes), to compare before and after."""
    n = json.loads(json.dumps(node))
    for k in keys:
        n["metadata"].pop(k, None)
    return n


def delete_nodes(admin: KubeApi, nodes: list[str]) -> None:
    for n in nodes:
        admin.request("DELETE", f"/api/v1/nodes/{n}")


# -- one attempt ---------------------------------------------------------------------------------------------------


@dataclass
class Req:
    """One request of an attempt; the path may hold placeholders its matrix fills in."""

    method: str
    path: str
    body: Any = None
    content_type: str = "application/json"
    query: dict[str, str] = field(default_factory=dict)

    @property
    def writes(self) -> bool:
        return self.method in ("PATCH", "PUT", "DELETE")


def request_column(req: Req, path: str) -> str:
    """A docs table's request column: method, `path` without the API prefix, the patch type."""
    path = re.sub(r"/api/v1/|/apis/", "", path).replace("events.k8s.io/v1/", "events.k8s.io: ")
    kind = PATCH_NAMES.get(req.content_type, "") if req.method == "PATCH" else ""
    return f"`{req.method} {path}`" + (f" ({kind})" if kind else "")


def send(api: KubeApi, req: Req, path: str) -> tuple[int, str]:
    """Sends `req` to `path` with `api` (closed after): (the code, the apiserver's message on a refusal)."""
    try:
        api.request(req.method, path, req.body, req.content_type, req.query or None)
    except ApiError as e:
        return e.status, str(e)
    finally:
        api.close()
    return (201 if req.method == "POST" else 200), ""


def observe(
    api: KubeApi,
    req: Req,
    path: str,
    expect: int,
    state: Callable[[], Any],
    effect: Callable[[], bool] | None,
    needs_effect: bool,
) -> tuple[int, str, str]:
    """One attempt: sends `req` with the token's client `api` and judges the answer. Returns (observed code, who
    said no, problem or ""): another code than `expect`; a denied attempt after which `state()` (what the
    attempt must not change) differs; an allowed one whose `effect()` is not there, or that `needs_effect` and
    has no check."""
    before = state()
    code, message = send(api, req, path)
    problem = f"expected {expect}, got {code} {message[:300]}" if code != expect else ""
    if code >= 400:
        after = state()
        if after != before:
            problem += f" denied, yet something changed: {json.dumps([before, after])[:600]}"
    elif effect is not None:
        if not effect():
            problem += " allowed, yet the change is not there"
    elif needs_effect:
        problem += " an allowed write needs an effect check"
    return code, denied_by(message) if code >= 400 else "", problem


def listed_once(keys: list[Any]) -> None:
    """Asserts that no attempt is listed twice (same token, attempt and request)."""
    seen = set()
    for key in keys:
        assert key not in seen, f"duplicate attempt {key}"
        seen.add(key)


@dataclass(frozen=True)
class DocsTable:
    """A matrix's table in the docs, between two markers; `what` names the matrix in messages."""

    docs: Path
    begin: str
    end: str
    what: str

    def check(self, rendered: str) -> None:
        """The table in the file is `rendered` (GPU_READY_UPDATE_DOCS=1 rewrites it)."""
        text, begin, end = self.docs.read_text(), self.begin, self.end
        assert begin in text and end in text, f"{self.docs} has no {begin} ... {end} section"
        current = text[text.index(begin) + len(begin) : text.index(end)].strip()
        if current != rendered and os.environ.get("GPU_READY_UPDATE_DOCS") == "1":
            head, tail = text[: text.index(begin) + len(begin)], text[text.index(end) :]
            self.docs.write_text(head + "\n" + rendered + "\n" + tail)
            current = rendered
        assert current == rendered, f"{self.docs.name}'s {self.what} table is stale: rerun with GPU_READY_UPDATE_DOCS=1"

    def conclude(self, problems: list[str], skipped: list[str], why: str, render: Callable[[], str]) -> None:
        """A matrix's end: no problem, then its table in the docs, which is the current Kubernetes minor's (an
        older minor that skipped rows only says which)."""
        assert not problems, "\n".join(problems)
        if skipped:
            print(f"[{self.what}] skipped, {why}: {'; '.join(skipped)}")
            return
        self.check(render())
