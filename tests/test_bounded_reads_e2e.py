"""The real agent on the simulated host against the real apiserver, with a sysfs file that never answers (a FIFO
nobody writes, the stand-in for a wedged HCA attribute) and a kernel log that loses records: the fatal Xid still
reaches the Node within one cycle, the threads stay bounded, a restart does not block again, and lost records do not
run a cycle each. Counted in cycles, threads and records, never in wall time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.runner import WAKE_CYCLE_GAP_S, Agent
from testkit.harness import in_process_agent, wait_cycles, wait_for
from testkit.simhost import SimHost

pytestmark = pytest.mark.apiserver

COUNT = "gpu_ready_check_duration_seconds_count"  # one observation per check and cycle


def rails(host: SimHost) -> None:
    for i in range(8):
        host.set_ib_port(f"mlx5_{i}")


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


@pytest.fixture
def wedged(simhost: SimHost) -> Iterator[SimHost]:
    rails(simhost)
    yield simhost
    simhost.unwedge(content="0\n")


@pytest.mark.parametrize("where", ["counters/link_downed", "state", "rate", "link_layer", "pcie"])
def test_an_xid_79_turns_the_node_false_within_one_cycle_while_a_sysfs_file_is_wedged(
    admin, agent_factory, wedged, where
):
    if where == "pcie":
        path, check = wedged.wedge(wedged.link_file(3)), "pcie"
    else:
        path, check = wedged.wedge(wedged.ib_port_file("mlx5_5", where)), "infiniband"
    a = agent_factory(extra={"--poll-interval": "300"})
    c = a.wait_status(admin, "Unknown", "CheckFailed", timeout=60)  # could not check: never True
    assert str(path) in c["message"] and "did not answer" in c["message"]
    runs = {"check": check}
    cycles = a.metric(COUNT, runs)
    assert cycles == 1
    wedged.append_xid(79, gpu=1)
    c = a.wait_status(admin, "False", "FatalXid", timeout=60)
    assert a.metric(COUNT, runs) <= cycles + 1  # the kernel-log wake published it; no probe held it up
    assert "00000000:3B:00.0" in c["message"]


def test_threads_stay_bounded_over_many_cycles_and_a_restart_does_not_block_again(admin, agent_factory, wedged):
    wedged.wedge(wedged.ib_port_file("mlx5_2", "counters/link_downed"))
    a = agent_factory(extra={"--poll-interval": "0.2"})
    a.wait_status(admin, "Unknown", "CheckFailed", timeout=60)
    runs = {"check": "infiniband"}
    wait_for(lambda: (a.metric(COUNT, runs) or 0) >= 3, 60, what="3 cycles")
    assert a.proc is not None
    threads, start = threads_of(a.proc.pid), a.metric(COUNT, runs) or 0
    wait_for(lambda: (a.metric(COUNT, runs) or 0) >= start + 30, 120, what="30 more cycles")
    # one worker blocked in the FIFO, one live; the metrics server's request threads come and go
    assert threads_of(a.proc.pid) <= threads + 2
    assert a.http("/healthz")[0] == 200  # cycles complete: the liveness probe stays green
    assert a.terminate() == 0  # the blocked worker does not hold up the exit
    a.start()  # the restart meets the same file: one deadline, then refused at once
    wait_for(lambda: (a.metric(COUNT, runs) or 0) >= 10, 120, what="10 cycles after the restart")
    assert a.http("/healthz")[0] == 200
    assert a.gpu_ready(admin)["status"] == "Unknown"  # type: ignore[index]


def test_an_xid_79_is_published_while_a_cycle_is_stuck_in_a_probe(admin, agent_factory, simhost):
    """nvidia-smi hangs (its timeout is 120 s) on a cycle that lost kernel-log records started: the Xid 79 that
    follows is on the Node while that cycle still waits."""
    a = agent_factory(extra={"--poll-interval": "300", "--nvidia-smi-timeout": "120"})
    a.wait_status(admin, "True", timeout=60)
    runs = {"check": "nvidia_smi"}
    wait_for(lambda: a.metric(COUNT, runs) == 1, 30, what="the first cycle counted")
    calls = simhost.smi_call_count()
    simhost.set_smi(hang=True)
    simhost.skip_seq(40)  # records lost: the level checks run now, not at the poll 300 s away
    simhost.append_kmsg("random kernel line")
    wait_for(lambda: simhost.smi_call_count() > calls, 60, what="the cycle's nvidia-smi run started")
    simhost.append_xid(79, gpu=4)
    a.wait_status(admin, "False", "FatalXid", timeout=60)
    assert a.metric(COUNT, runs) == 1  # that cycle has not ended: the fault did not wait for it
    simhost.set_smi()


class FrozenMono:
    """The loop's monotonic clock, frozen by the test (None: the real one)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self) -> float:
        return time.monotonic() if self.at is None else self.at


def settle(agent: Agent) -> None:
    """Two whole turns of the loop and no cycle running: every wake so far has been handled."""
    for _ in range(2):
        t = agent.turns
        agent.wake.set()
        wait_for(lambda t=t: agent.turns > t, 20, 0.01, "a turn of the loop")
    wait_for(lambda: not agent.checks.busy, 30, 0.01, "the cycle finished")


def test_lost_kernel_log_records_are_rate_limited_like_link_changes(admin, make_node, sa_client, tmp_path):
    """A loss right after a cycle waits WAKE_CYCLE_GAP_S of the loop's clock: 20 losses with the clock frozen run
    no cycle, then one; then a loss every 0.2 s runs a cycle at most every WAKE_CYCLE_GAP_S, not one per loss."""
    from testkit.cluster import AGENT_RULES

    host = SimHost(tmp_path / "h")
    node = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity=host.plugin_resources())
    api, _ = sa_client(rules=AGENT_RULES, pod_on_node=node)
    agent = in_process_agent(api, node, host, poll_interval=300)
    mono = FrozenMono()
    agent.clock = type(agent.clock)(mono=mono, wall=agent.clock.wall)  # the loop's schedule only
    lost = 0

    def lose(n: int = 3) -> None:
        nonlocal lost
        host.skip_seq(n)
        host.append_kmsg("random kernel line")
        lost += n
        wait_for(
            lambda: agent.metrics.registry.get_sample_value("gpu_ready_kmsg_lost_records_total") == lost,
            20,
            0.01,
            "the loss counted",
        )

    try:
        agent.start(serve=False)
        wait_cycles(agent, 1)
        settle(agent)
        mono.at = agent.last_cycle_mono  # frozen at the end of the last cycle
        assert mono.at is not None
        start = agent.cycles
        for _ in range(20):
            lose()
        settle(agent)
        assert agent.cycles == start  # within WAKE_CYCLE_GAP_S of the last cycle: none yet
        mono.at += WAKE_CYCLE_GAP_S
        settle(agent)
        assert agent.cycles == start + 1  # one cycle for the 20 losses
        for _ in range(10):  # a loss every 0.2 s of the loop's clock
            mono.at += 0.2
            lose()
            settle(agent)
        assert agent.cycles - (start + 1) <= 10 * 0.2 / WAKE_CYCLE_GAP_S + 1  # at most 5, not 10
    finally:
        agent.shutdown()
