"""Shared fixtures: a real kube-apiserver + etcd (session scope), helpers on it, a simulated GPU host, the agent as a
process, and a control plane with the real scheduler (module scope). Plain functions and classes that several test
modules share live in testkit/; no module imports this one (pyproject.toml's import-linter contract)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agent.kube.client import ApiError, KubeApi
from testkit.cluster import create_node, service_account_client
from testkit.controlplane import ControlPlane
from testkit.fakes import HUNG
from testkit.simhost import SimHost
from testkit.testbin import require_testbin

if TYPE_CHECKING:
    from testkit.scheduling import SchedulerPlane


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    cp = ControlPlane(require_testbin("kube-apiserver", "etcd"))
    with contextlib.ExitStack() as on_failure:  # stopped again unless it started
        on_failure.callback(cp.stop)
        cp.start()
        on_failure.pop_all()
    print(f"\n[control plane] kube-apiserver {cp.host} ready in {cp.start_seconds:.1f}s")
    yield cp
    cp.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and call.when == "call":
        cp = getattr(item, "funcargs", {}).get("control_plane")
        if cp is None:
            for v in getattr(item, "funcargs", {}).values():
                cp = getattr(v, "control_plane", None) or cp
        if isinstance(cp, ControlPlane):
            report.sections.append(("kube-apiserver log (tail)", cp.log_tail(80)))
    return report


@pytest.fixture
def admin(control_plane: ControlPlane) -> Iterator[KubeApi]:
    api = control_plane.admin()
    yield api
    api.close()


@pytest.fixture
def make_node(admin: KubeApi) -> Iterator[Callable[..., str]]:
    made: list[str] = []

    def _make(
        labels: dict[str, str] | None = None,
        capacity: dict[str, str] | None = None,
        allocatable: dict[str, str] | None = None,
        name: str | None = None,
        **kw: Any,
    ) -> str:
        n = name or f"gpu-node-{secrets.token_hex(4)}"
        create_node(admin, n, labels, capacity, allocatable, **kw)
        made.append(n)
        return n

    yield _make
    for n in made:
        try:
            admin.request("DELETE", f"/api/v1/nodes/{n}")
        except ApiError:
            pass


@pytest.fixture
def sa_client(admin: KubeApi) -> Iterator[Callable[..., tuple[KubeApi, dict[str, Any]]]]:
    clients: list[KubeApi] = []

    def _make(**kw: Any) -> tuple[KubeApi, dict[str, Any]]:
        c, info = service_account_client(admin, **kw)
        clients.append(c)
        return c, info

    yield _make
    for c in clients:
        c.close()


@pytest.fixture
def simhost(tmp_path: Path) -> SimHost:
    return SimHost(tmp_path / "host")


@pytest.fixture
def agent_factory(control_plane, admin, simhost, make_node, sa_client) -> Iterator[Callable[..., Any]]:
    """Makes a GPU Node for the simulated host and runs the real agent for it, as a ServiceAccount with
    the agent's RBAC (token bound to a Pod on that node)."""
    from testkit.cluster import AGENT_RULES
    from testkit.harness import AgentProc

    procs: list[AgentProc] = []

    def _make(
        node: str | None = None,
        start: bool = True,
        rules: list[dict[str, Any]] | None = None,
        host: SimHost | None = None,
        **kw: Any,
    ) -> AgentProc:
        h = host or simhost
        if node is None:
            node = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity=h.plugin_resources())
        _, info = sa_client(rules=rules or AGENT_RULES, pod_on_node=node)
        p = AgentProc(control_plane, h, node, info["token"], **kw)
        p.sa = info  # type: ignore[attr-defined]
        procs.append(p)
        return p.start() if start else p

    yield _make
    for p in procs:
        p.terminate()


@pytest.fixture(autouse=True)
def _release_hung_nvml_calls() -> Iterator[None]:
    """Ends the simulated hung NVML calls of a test (testkit/fakes.py) when it is over."""
    yield
    while HUNG:
        HUNG.pop().set()


@pytest.fixture(scope="module")
def sched_plane() -> Iterator[SchedulerPlane]:
    """A control plane with the real kube-scheduler and kube-controller-manager (NoExecute taint eviction) and a
    namespace for the module's Pods (testkit/scheduling.py), one per module."""
    from testkit.scheduling import BINARIES, SchedulerPlane

    bd = require_testbin(*BINARIES)
    cp = ControlPlane(bd)
    admin: KubeApi | None = None
    try:
        cp.start()
        cp.start_scheduler()
        cp.start_controller_manager()
        print(
            f"\n[control plane] kube-apiserver {cp.start_seconds:.1f}s, "
            + ", ".join(f"{k} {v:.1f}s" for k, v in cp.component_start_seconds.items())
        )
        admin = cp.admin()
        ns = f"taints-{secrets.token_hex(3)}"
        admin.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        yield SchedulerPlane(cp, admin, ns)
    finally:
        if admin is not None:
            admin.close()
        cp.stop()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The node corpus's healthy and broken counts per configuration (tests/test_corpus.py), in every run's output."""
    from testkit.corpus import SUMMARY

    lines = config.stash.get(SUMMARY, None)
    if lines:
        terminalreporter.section("node corpus: healthy and broken nodes per configuration")
        for line in lines:
            terminalreporter.write_line(line)
