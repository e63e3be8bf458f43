"""The agent's own Node from a watch, with the REAL agent process on the real apiserver: a
`clear-before` annotation and the preflight label take effect with no poll due (the watch wakes the loop: not one
nvidia-smi run), the agent keeps working across watch renewals, a 410 Gone and an
apiserver restart, and a steady state makes no Node GET at all (with the watch off: GET resourceVersion=0,
still no etcd read). The start-up spread and the heartbeat jitter run in-process on the same apiserver."""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent import config
from agent.kube.client import KubeApi
from agent.runner import Agent
from bench.fleet import parse_samples, read_metrics_text, total
from testkit.cluster import AGENT_RULES, condition
from testkit.controlplane import etcd_request
from testkit.harness import AgentProc, in_process_agent, wait_cycles, wait_for
from testkit.simhost import SimHost

pytestmark = pytest.mark.apiserver

CLEAR = "gpu-ready.io/clear-before"
# No poll comes due while a test runs (the first check cycle runs at start): a change seen with 0 more nvidia-smi
# runs was carried by the watch, however long it took (a 30 s poll may fall due during any wait).
SLOW_POLL = {"--poll-interval": "3600"}


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def requests_of(a: AgentProc, verb: str, code: str | None = None) -> float:
    labels = {"verb": verb} if code is None else {"verb": verb, "code": code}
    return a.metric("gpu_ready_api_requests_total", labels) or 0.0


def node_reads(admin: KubeApi) -> tuple[float, float]:
    """(etcd reads of Nodes, apiserver GETs of Nodes) from the apiserver's own /metrics."""
    samples = parse_samples(read_metrics_text(admin))
    return (
        total(samples, "etcd_requests_total", resource="nodes", operation="get"),
        total(samples, "apiserver_request_total", resource="nodes", verb="GET"),
    )


def time_to(admin: KubeApi, a: AgentProc, status: str, reason: str | None = None, timeout: float = 10.0) -> float:
    """Seconds until the Node shows GPUReady=status (polled every 20 ms from now)."""
    t0 = time.monotonic()
    a.wait_status(admin, status, reason, timeout=timeout)
    return time.monotonic() - t0


def latch_xid(admin: KubeApi, a: AgentProc, host: SimHost, gpu: int) -> None:
    host.append_xid(79, gpu)  # the kernel-log watcher wakes the loop: no poll needed
    a.wait_status(admin, "False", "FatalXid", timeout=20)


def clear_within(admin: KubeApi, a: AgentProc, host: SimHost) -> float:
    """Annotates clear-before (now) and returns how long the condition took to turn True (for the log); asserts
    that no check cycle (nvidia-smi run) was needed for it: the watch carried it."""
    smi = host.smi_call_count()
    t0 = time.monotonic()
    admin.patch_node(a.node, {"metadata": {"annotations": {CLEAR: now_micro()}}})

    def true() -> bool:
        c = a.gpu_ready(admin)
        return c is not None and c["status"] == "True"

    wait_for(true, 10, 0.02, "GPUReady=True after the clear")
    took = time.monotonic() - t0
    assert host.smi_call_count() == smi, f"the clear was applied by a check cycle, not by the watch\n{a.logs()[-3000:]}"
    return took


def test_clear_before_and_preflight_label_take_effect_within_a_second(admin, agent_factory, simhost, make_node):
    a = agent_factory(extra=SLOW_POLL)
    a.wait_status(admin, "True", timeout=30)
    wait_for(lambda: requests_of(a, "WATCH", "200") >= 1, 20, what="the Node watch")
    latch_xid(admin, a, simhost, 3)
    took = clear_within(admin, a, simhost)
    print(f"\n[watch] clear-before annotation -> GPUReady=True in {took * 1000:.0f} ms (no poll due)")
    assert (a.metric("gpu_ready_latched_faults") or 0) == 0
    # the preflight gate: the label arrives by the watch too
    host2 = SimHost(simhost.root.parent / "host2")
    node = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity=host2.plugin_resources())
    b = agent_factory(node=node, host=host2, extra={**SLOW_POLL, "--require-preflight": "true"})
    b.wait_status(admin, "False", "PreflightNotPassed", timeout=30)
    smi = host2.smi_call_count()
    t0 = time.monotonic()
    admin.patch_node(node, {"metadata": {"labels": {"preflight": "passed"}}})
    took = time_to(admin, b, "True", "GPUsHealthy")
    assert host2.smi_call_count() == smi, (took, b.logs()[-3000:])  # the watch carried it, not a poll
    print(f"[watch] preflight=passed label -> GPUReady=True in {(time.monotonic() - t0) * 1000:.0f} ms")


def watches_restored(a: Any) -> int:
    """How many times the agent logged its Node watch back after failures."""
    return a.logs().count("node watch restored")


def test_keeps_working_across_watch_renewals_410_gone_and_an_apiserver_restart(control_plane, tmp_path):
    """Own control plane (the apiserver is stopped): watches renewed every 2-4 s; then the apiserver goes away, etcd
    moves on and is compacted (the version the watch resumes from is gone: 410), a fault happens meanwhile, and
    the apiserver comes back. The fault reaches the Node, and a clear is again seen within a second."""
    from testkit.controlplane import ControlPlane
    from testkit.harness import launch_agent

    cp = ControlPlane(control_plane.bin_dir, workdir=str(tmp_path / "cp")).start()
    try:
        admin = cp.admin()
        a, host = launch_agent(cp, tmp_path / "agent", "watch-node", extra={**SLOW_POLL, "--node-watch-timeout": "2"})
        try:
            a.wait_status(admin, "True", timeout=30)
            wait_for(lambda: requests_of(a, "WATCH", "200") >= 3, 40, what="3 watches (2 renewals)")
            latch_xid(admin, a, host, 4)
            took = clear_within(admin, a, host)
            print(f"\n[watch] after {requests_of(a, 'WATCH', '200'):.0f} watches: clear seen in {took * 1000:.0f} ms")
            watches = requests_of(a, "WATCH", "200")
            restored = watches_restored(a)
            cp.stop_apiserver()
            for i in range(5):  # etcd moves on ...
                r = etcd_request(cp, "/v3/kv/put", {"key": base64.b64encode(f"/w4-bump/{i}".encode()).decode()})
            # ... and forgets
            etcd_request(cp, "/v3/kv/compaction", {"revision": r["header"]["revision"], "physical": True})
            host.append_xid(79, 2)
            wait_for(lambda: a.metric("gpu_ready_latched_faults") == 1, 20, what="latched while the API is down")
            wait_for(lambda: requests_of(a, "WATCH", "0") >= 1, 40, what="the watch noticing the apiserver is gone")
            assert a.proc is not None and a.proc.poll() is None
            cp.restart_apiserver()
            c = a.wait_status(admin, "False", "FatalXid", timeout=60)
            assert "GPU 2 (00000000:4C:00.0): Xid 79" in c["message"], c
            # the Node's watch itself (the ResourceSlice watch, also counted in WATCH 200, may come back first)
            wait_for(lambda: requests_of(a, "WATCH", "200") > watches, 60, what="a watch to be back")
            wait_for(lambda: watches_restored(a) > restored, 60, what="the Node watch to be back")
            took = clear_within(admin, a, host)
            print(f"[watch] after an apiserver restart and a compaction: clear seen in {took * 1000:.0f} ms")
            assert a.proc.poll() is None
            logged = a.logs()
            assert "node watch failed" in logged and "node watch restored" in logged
            assert "node watch expired (410 Gone)" in logged  # the compaction took the version it resumed from
        finally:
            a.terminate()
            admin.close()
    finally:
        cp.stop()


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "no-watch"])
def test_steady_state_reads_no_node_from_etcd(admin, agent_factory, simhost, watch):
    """20 polls: with the watch, not one Node request (the agent's own count) and no GET of a Node on the apiserver;
    with --node-watch=false, a GET resourceVersion=0 per poll, served from the apiserver's cache: still no etcd
    read. (A plain GET, a quorum read, does move the etcd count: tests/test_node_cache.py shows the measure can
    fail.)"""
    a = agent_factory(extra={"--node-watch": "true" if watch else "false", "--poll-interval": "0.3"})
    a.wait_status(admin, "True", timeout=30)
    if watch:
        wait_for(lambda: requests_of(a, "WATCH", "200") >= 1, 20, what="the Node watch")
    start_smi = simhost.smi_call_count()
    wait_for(lambda: simhost.smi_call_count() >= start_smi + 2, 20, what="2 more polls")  # past the start-up
    etcd0, gets0 = node_reads(admin)
    agent_gets0, smi0 = requests_of(a, "GET"), simhost.smi_call_count()
    wait_for(lambda: simhost.smi_call_count() >= smi0 + 20, 60, what="20 more polls")
    etcd1, gets1 = node_reads(admin)
    agent_gets = requests_of(a, "GET") - agent_gets0
    polls = simhost.smi_call_count() - smi0
    print(
        f"\n[watch={watch}] {polls} polls: agent GETs {agent_gets:.0f}, apiserver node GETs {gets1 - gets0:.0f}, "
        f"etcd node reads {etcd1 - etcd0:.0f}"
    )
    assert etcd1 == etcd0, "a quorum read of the Node in the steady state"
    if watch:
        assert agent_gets == 0 and gets1 == gets0
        # one long-lived watch of the Node and one of its ResourceSlices (agent/kube/slice_cache.py)
        assert requests_of(a, "WATCH") == requests_of(a, "WATCH", "200") == 2
    else:
        assert agent_gets >= polls - 1 and gets1 - gets0 >= polls - 1
        assert requests_of(a, "WATCH") == 0


# -- in-process: the start-up spread and the heartbeat jitter -------------------------------------------------------


def test_first_write_waits_for_its_moment_unless_the_status_changes(admin, make_node, sa_client, tmp_path):
    shown = {"type": "GPUReady", "status": "True", "reason": "GPUsHealthy", "message": "8 GPUs healthy"}
    agents: list[Agent] = []
    try:
        hosts, nodes = [], []
        for i in range(3):
            h = SimHost(tmp_path / f"h{i}")
            hosts.append(h)
            conditions = [] if i == 2 else [shown]  # node 2: no GPUReady yet
            nodes.append(
                make_node(
                    labels={"nvidia.com/gpu.present": "true"}, capacity=h.plugin_resources(), conditions=conditions
                )
            )
        for h, n in zip(hosts, nodes, strict=True):
            api, _ = sa_client(rules=AGENT_RULES, pod_on_node=n)
            agent = in_process_agent(api, n, h, start_spread=3600)
            agent.publisher.first_write_at = agent.started_mono + 3600  # deterministic: the spread's far end
            agents.append(agent)
            agent.start(serve=False)
        held, fault, fresh = agents
        beat = condition(admin.get_node(nodes[0]), "GPUReady")["lastHeartbeatTime"]  # type: ignore[index]
        for ag in agents:
            wait_cycles(ag, 3)
        # the same status as the Node shows: held (a roll-out or a fleet reboot does not write all at once)
        assert held.condition.sent is None and held.condition.last_write_mono is None
        assert condition(admin.get_node(nodes[0]), "GPUReady")["lastHeartbeatTime"] == beat  # type: ignore[index]
        # no GPUReady on the Node yet: written at once
        assert fresh.condition.sent is not None
        assert condition(admin.get_node(nodes[2]), "GPUReady")["status"] == "True"  # type: ignore[index]
        # a fault: the status changes, so it is written at once, spread or not
        hosts[1].append_xid(79, 1)

        def false_on_node() -> bool:
            c = condition(admin.get_node(nodes[1]), "GPUReady")
            return c is not None and c["status"] == "False"

        wait_for(false_on_node, 10, 0.02, "the fault on node 1")
        # the reporter records what it sent once the PATCH's answer is read, just after the Node shows it
        wait_for(lambda: fault.condition.sent_status == "False", 10, 0.02, "the reporter's record of the write")
        assert time.monotonic() < fault.publisher.first_write_at
        # its moment comes: the held write goes out (the loop sleeps until then, not a poll later)
        held.publisher.first_write_at = time.monotonic()
        held.wake.set()
        wait_for(lambda: held.condition.sent is not None, 10, 0.02, "the held write")
        c = condition(admin.get_node(nodes[0]), "GPUReady")
        assert c is not None and c["status"] == "True" and c["lastHeartbeatTime"] >= beat
        # each write draws the next heartbeat: interval x (1 +- jitter/2)
        hb = [ag.condition.heartbeat_s for ag in agents]
        assert all(300 * 0.9 <= x <= 300 * 1.1 for x in hb) and len(set(hb)) == 3, hb
    finally:
        for ag in agents:
            ag.shutdown()
            ag.api.close()


def test_spread_flags_and_defaults():
    d = config.defaults()
    assert (d.node_watch, d.node_watch_timeout, d.start_spread, d.heartbeat_jitter) == (True, 600.0, 60.0, 0.2)
    for bad in ({"start_spread": -1}, {"heartbeat_jitter": 1.5}, {"node_watch_timeout": 0}, {"node_watch": "maybe"}):
        with pytest.raises(config.ConfigError):
            config.defaults(**bad)
    assert config.defaults(start_spread=0, heartbeat_jitter=0).start_spread == 0


def test_bad_spread_setting_exits_2_with_one_line(tmp_path: Path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--node-name", "n", "--heartbeat-jitter", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 2 and "heartbeat-jitter" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
