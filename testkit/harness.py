"""Runs the real `gpu-ready run` as a subprocess against the real apiserver and a simulated host."""

from __future__ import annotations

import http.client
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.kube.client import ApiError, KubeApi
from testkit.cluster import condition
from testkit.controlplane import ControlPlane, free_port
from testkit.simhost import SimHost

if TYPE_CHECKING:
    from agent.runner import Agent

FAST = {
    "--poll-interval": "0.5",
    "--heartbeat-interval": "300",
    "--recovery-polls": "2",
    "--nvidia-smi-timeout": "5",
    "--plugin-grace": "0",
    "--event-interval": "300",
    "--api-timeout": "5",
    "--start-spread": "0",  # a real fleet spreads its first writes; a test must not wait for that
}


def launch_agent(
    cp: ControlPlane,
    workdir: Path,
    name_prefix: str,
    extra: dict[str, str] | None = None,
    kmsg: str | None = None,
    gpus: int = 8,
) -> tuple[AgentProc, SimHost]:
    """A simulated GPU host, a GPU Node for it, a ServiceAccount with the agent's RBAC (token bound to a
    Pod on that node) and the real agent running for it."""
    from testkit.cluster import AGENT_RULES, create_node, service_account_client

    admin = cp.admin()
    try:
        host = SimHost(workdir / "host", gpus=gpus)
        node = f"{name_prefix}-{secrets.token_hex(3)}"
        create_node(admin, node, {"nvidia.com/gpu.present": "true"}, host.plugin_resources())
        _, info = service_account_client(admin, AGENT_RULES, pod_on_node=node)
    finally:
        admin.close()
    return AgentProc(cp, host, node, info["token"], extra=extra, workdir=workdir, kmsg=kmsg).start(), host


def returns_within(fn: Callable[[], Any], timeout_s: float, on_stall: Callable[[], None] | None = None) -> Any:
    """fn() on a daemon thread: its value, or what it raised, raised again here on the test's thread (relayed
    whole, so that nothing is swallowed). Fails the test when fn has not returned within timeout_s (a stall, not a
    slow run); `on_stall` runs first (e.g. to unblock the thread)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # relayed to the test's thread below, never dropped
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        if on_stall is not None:
            on_stall()
            t.join(timeout_s)
        raise AssertionError(f"{fn} did not return within {timeout_s}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# What a predicate may raise while the thing it waits for is not there yet: the apiserver's refusal or a 404
# (ApiError), a process or port not up yet (OSError, http.client's errors), a file half written (ValueError), an
# object without the key or item yet (LookupError), a condition not there yet (TypeError: None["status"]). Anything
# else is a bug of the test and fails it at once.
TRANSIENT = (ApiError, OSError, http.client.HTTPException, ValueError, LookupError, TypeError)


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except TRANSIENT as e:  # keep polling through transient errors
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def first_times(checks: dict[str, Callable[[], bool]], timeout: float, what: str) -> dict[str, float]:
    """Polls every check about every 20 ms; returns the monotonic time each was first seen true."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(checks) and time.monotonic() < deadline:
        for k, check in checks.items():
            if k not in seen and check():
                seen[k] = time.monotonic()
        time.sleep(0.02)
    assert len(seen) == len(checks), f"timed out after {timeout}s waiting for {what}: saw only {sorted(seen)}"
    return seen


class AgentProc:
    def __init__(
        self,
        cp: ControlPlane,
        host: SimHost,
        node: str,
        token: str | None = None,
        extra: dict[str, str] | None = None,
        workdir: Path | None = None,
        kmsg: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.cp, self.host, self.node = cp, host, node
        self.env = env or {}  # e.g. GPU_READY_KMSG_TRUST_USER=true (a test seam: no flag)
        self.workdir = workdir or host.root
        self.kubeconfig = cp.kubeconfig(self.workdir / f"kubeconfig-{node}", token)
        self.port = free_port()
        self.log_path = self.workdir / f"agent-{node}.log"
        args = [
            sys.executable,
            "-m",
            "agent",
            "run",
            "--node",
            node,
            "--kubeconfig",
            str(self.kubeconfig),
            "--metrics-address",
            f"127.0.0.1:{self.port}",
            "--log-format",
            "json",
            *host.agent_args(),
        ]
        flags = {**FAST, **(extra or {})}
        if kmsg:
            flags["--kmsg"] = kmsg
        for k, v in flags.items():
            if k in args:
                args[args.index(k) + 1] = v
            elif v == "":
                args.append(k)
            else:
                args += [k, v]
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProc:
        fh = open(self.log_path, "ab")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            self.args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        fh.close()
        return self

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=3) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        _, text = self.http("/metrics")
        total = None
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            mname = head.split("{", 1)[0]
            if mname != name:
                continue
            if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
                continue
            total = (total or 0.0) + float(value)
        return total

    def terminate(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode

    def gpu_ready(self, api: KubeApi) -> dict[str, Any] | None:
        return condition(api.get_node(self.node), "GPUReady")

    def wait_status(
        self, api: KubeApi, status: str, reason: str | None = None, timeout: float = 20.0
    ) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            c = self.gpu_ready(api)
            if c and c["status"] == status and (reason is None or c["reason"] == reason):
                return c
            return None

        try:
            return wait_for(ok, timeout, what=f"GPUReady={status} {reason or ''}")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- agent log ---\n{self.logs()[-4000:]}") from None


def in_process_agent(api: KubeApi, node: str, host: SimHost, **over: Any) -> Agent:
    """The agent's runner in this process (not started) for `node` on the simulated `host`, polling every 0.3 s;
    `over`: settings that replace these."""
    from agent import config
    from agent.runner import Agent

    args = host.agent_args()
    flags = {args[i].lstrip("-").replace("-", "_"): args[i + 1] for i in range(0, len(args), 2)}
    settings = {
        **flags,
        "node_name": node,
        "poll_interval": 0.3,
        "plugin_grace": 0,
        "recovery_polls": 1,
        "metrics_address": "127.0.0.1:0",
        "api_timeout": 5,
        **over,
    }
    return Agent(config.load(None, environ={}, overrides=settings), api=api)


def wait_cycles(agent: Agent, n: int) -> None:
    start = agent.cycles
    wait_for(lambda: agent.cycles >= start + n, 20, what=f"{n} more check cycles")
