"""The InfiniBand/RoCE rails probe (agent/probes/infiniband.py) on simulated sysfs trees in the kernel's formats,
through the check suite as the agent runs it, and the real agent end to end."""

from __future__ import annotations

import pytest

from agent import config
from agent.checks import CheckSuite
from agent.model import Check, Reason, Severity, Status
from agent.probes.base import ProbeContext
from agent.probes.infiniband import InfinibandProbe
from agent.verdict import decide
from testkit.harness import wait_for
from testkit.simhost import SimHost


def rails(host: SimHost, n: int = 8) -> None:
    for i in range(n):
        host.set_ib_port(f"mlx5_{i}")


def probe(host: SimHost, expected: int | None = None, min_rate: float | None = None) -> InfinibandProbe:
    return InfinibandProbe(str(host.sysfs), expected, min_rate)


def test_healthy_rails_and_a_node_without_infiniband_report_nothing(simhost: SimHost):
    r = probe(simhost).read(ProbeContext())
    assert r.ran and r.findings == ()  # no /sys/class/infiniband: nothing to judge
    rails(simhost)
    r = probe(simhost, expected=8, min_rate=400).read(ProbeContext())
    assert r.ran and r.findings == ()


def test_a_rail_down_is_degraded_and_named(simhost: SimHost):
    rails(simhost)
    simhost.set_ib_port("mlx5_3", state="1: DOWN", phys_state="3: Disabled")
    simhost.set_ib_port("mlx5_5", state="2: INIT", phys_state="5: LinkUp")
    r = probe(simhost).read(ProbeContext())
    assert r.ran
    assert [(f.severity, f.reason, f.kind, f.message) for f in r.findings] == [
        (Severity.FAULT, Reason.GPU_DEGRADED, "rail_down", "InfiniBand rail mlx5_3 port 1 is DOWN (Disabled)"),
        (Severity.FAULT, Reason.GPU_DEGRADED, "rail_down", "InfiniBand rail mlx5_5 port 1 is INIT (LinkUp)"),
    ]


def test_a_rail_below_its_rate_and_a_missing_nic(simhost: SimHost):
    rails(simhost, 7)
    simhost.set_ib_port("mlx5_2", rate="200 Gb/sec (4X HDR)")
    r = probe(simhost, expected=8, min_rate=400).read(ProbeContext())
    assert [f.kind for f in r.findings] == ["rail_slow", "nic_missing"]
    assert r.findings[0].message == "InfiniBand rail mlx5_2 port 1 at 200 Gb/s, below 400 Gb/s"
    assert r.findings[1].message == "7 InfiniBand devices, expected 8"
    assert probe(simhost).read(ProbeContext()).findings == ()  # neither is judged unless asked


def test_an_unreadable_port_is_could_not_check(simhost: SimHost):
    port = simhost.set_ib_port("mlx5_0")
    (port / "phys_state").unlink()
    (port / "phys_state").mkdir()  # there, but not a file that reads (EISDIR, for root too)
    r = probe(simhost).read(ProbeContext())
    assert not r.ran and [f.severity for f in r.findings] == [Severity.UNCHECKED]


def test_a_garbled_state_is_could_not_check(simhost: SimHost):
    simhost.set_ib_port("mlx5_0", state="ACTIVE-ish")
    r = probe(simhost).read(ProbeContext())
    assert not r.ran and "is not '<n>: <NAME>'" in r.findings[0].message
    v = decide(_obs(r), [])
    assert v.status is Status.UNKNOWN  # could not check is never True


def _obs(r):  # one result as the suite combines it
    from agent.checks import combine

    return combine([r], None)


def test_the_suite_runs_it_as_a_registered_signal_and_it_can_be_switched_off(simhost: SimHost):
    rails(simhost)
    simhost.set_ib_port("mlx5_1", state="1: DOWN", phys_state="2: Polling")
    base = {"nvidia_smi": str(simhost.nvidia_smi), "sysfs_root": str(simhost.sysfs), "nvml": "off"}
    base |= {"dev_root": str(simhost.make_dev_nodes()), "proc_root": str(simhost.proc)}
    suite = CheckSuite(config.defaults(**base))
    obs, stats = suite.run(None, one_shot=True)
    v = decide(obs, [])
    assert (v.status, v.reason) == (Status.FALSE, Reason.GPU_DEGRADED)
    assert "InfiniBand rail mlx5_1 port 1 is DOWN (Polling)" in v.message
    assert "infiniband" in stats.durations
    off = CheckSuite(config.defaults(**base, infiniband=False))
    obs, stats = off.run(None, one_shot=True)
    assert decide(obs, []).status is Status.TRUE and "infiniband" not in stats.durations
    assert off.probe(Check.INFINIBAND) is None


@pytest.mark.apiserver
def test_the_agent_reports_a_rail_down_within_one_poll(admin, agent_factory, simhost):
    rails(simhost)
    a = agent_factory(extra={"--poll-interval": "0.5"})
    a.wait_status(admin, "True")
    simhost.set_ib_port("mlx5_6", state="1: DOWN", phys_state="3: Disabled")
    a.wait_status(admin, "False", "GPUDegraded")
    wait_for(lambda: "mlx5_6 port 1 is DOWN" in a.gpu_ready(admin)["message"], 10, what="the rail named")
