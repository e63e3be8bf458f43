"""The InfiniBand/RoCE rails probe (agent/probes/infiniband.py) on simulated sysfs trees in the kernel's formats,
through the check suite as the agent runs it, and the real agent end to end."""

from __future__ import annotations

import pytest

from agent import config
from agent.checks import CheckSuite
from agent.model import Check, Reason, Severity, Status
from agent.probes.base import ProbeContext
from agent.probes.infiniband import FlapThresholds, IbThresholds, InfinibandProbe, RailReport
from agent.probes.pci import PciProbe
from agent.verdict import decide
from testkit.fixture_files import fixture_path
from testkit.harness import wait_for
from testkit.simhost import SimHost

BOOT_LOG = "nvrm-dmesg-full-boot-h100-nvswitch-healthy-decode-iso-gpud-fixture.txt"


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


# -- rails beside GPUs, counters, flaps, peer rate, GPUDirect ---------------------------------------------------


def hgx(tmp_path) -> SimHost:
    """An HGX H100 host: 8 GPUs each below its own PCIe port, a ConnectX rail beside each (400 Gb/s NDR), and the
    4 NVSwitches the simulated host always has."""
    host = SimHost(tmp_path / "hgx", pcie_bridges=True)
    for i in range(8):
        host.add_rail(f"mlx5_{i}", gpu=i)
    return host


def full(host: SimHost, **kw) -> InfinibandProbe:
    t = IbThresholds(**({"flaps": FlapThresholds(3, 600.0)} | kw))
    return InfinibandProbe(str(host.sysfs), thresholds=t)


def ctx_at(now: float, host: SimHost | None = None) -> ProbeContext:
    c = ProbeContext(now=now)
    if host is not None:  # the GPUs the PCI probe found, as the suite hands them on
        c.results[Check.PCI] = PciProbe(str(host.sysfs)).read(c)
    return c


def test_healthy_hgx_rails_map_each_gpu_to_its_nic(tmp_path):
    host = hgx(tmp_path)
    r = full(host, expected_nics=8).read(ctx_at(0, host))
    assert r.ran and r.findings == ()
    report = r.payload
    assert isinstance(report, RailReport)
    assert report.gpu_rails == {g.address: f"mlx5_{i}" for i, g in enumerate(host.gpus)}
    assert report.rail_of(host.gpus[3].address) == "mlx5_3"
    port = report.to_json()["ports"][0]
    assert port["counters"] == {"link_downed": 0, "symbol_error": 0, "port_rcv_errors": 0, "link_error_recovery": 0}
    assert port["link_layer"] == "InfiniBand" and port["rate_gbps"] == 400.0


def test_a_rail_down_is_shown_against_its_gpu(tmp_path):
    host = hgx(tmp_path)
    host.set_ib_port("mlx5_3", state="1: DOWN", phys_state="3: Disabled")
    r = full(host).read(ctx_at(0, host))
    assert [f.kind for f in r.findings] == ["rail_down"]
    assert r.payload.rail_of(host.gpus[3].address) == "mlx5_3 DOWN"
    assert r.payload.rail_of(host.gpus[2].address) == "mlx5_2"


def test_a_rail_at_half_rate_against_the_other_rails(tmp_path):
    host = hgx(tmp_path)
    host.set_ib_port("mlx5_5", rate="200 Gb/sec (4X HDR)")
    (f,) = full(host).read(ctx_at(0)).findings
    assert (f.kind, f.reason) == ("rail_slow", Reason.GPU_DEGRADED)
    assert f.message == "InfiniBand rail mlx5_5 port 1 at 200 Gb/s, below 400 Gb/s (the node's other InfiniBand rails)"
    assert full(host, rate_peers=False).read(ctx_at(0)).findings == ()  # off: only ibMinRateGbps judges
    host.set_ib_port("mlx5_6", rate="100 Gb/sec (4X EDR)", link_layer="Ethernet")  # a RoCE rail: its own layer
    assert [f.message.split()[2] for f in full(host).read(ctx_at(0, host)).findings] == ["mlx5_5"]


def test_a_flapping_rail_counters_moving_between_polls(tmp_path):
    host = hgx(tmp_path)
    p = full(host)
    assert p.read(ctx_at(0)).findings == ()  # the first read is the baseline (the counters count since boot)
    host.set_ib_counters("mlx5_2", link_downed=2)
    r = p.read(ctx_at(30))
    assert r.findings == () and r.payload.flaps[("mlx5_2", "1")] == 2  # below the threshold of 3
    host.set_ib_counters("mlx5_2", link_downed=3)
    (f,) = p.read(ctx_at(60)).findings
    assert (f.kind, f.reason) == ("rail_flapping", Reason.GPU_DEGRADED)
    assert f.message == "InfiniBand rail mlx5_2 port 1 flapping: down 3 times in 600 s (threshold 3)"
    assert p.read(ctx_at(629)).findings != ()  # the first two downs are 599 s old: still in the window
    assert p.read(ctx_at(631)).findings == ()  # they left the window: one down remains


def test_flaps_seen_as_state_changes_and_a_counter_reset_is_a_new_baseline(tmp_path):
    host = hgx(tmp_path)
    for name in ("link_downed",):
        (host.sysfs / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "counters" / name).unlink()
    p = full(host, flaps=FlapThresholds(2, 600.0))
    p.read(ctx_at(0))
    for t in (10, 30):
        host.set_ib_port("mlx5_1", state="1: DOWN", phys_state="2: Polling")
        p.read(ctx_at(t))
        host.set_ib_port("mlx5_1")
        r = p.read(ctx_at(t + 10))
    assert [f.kind for f in r.findings] == ["rail_flapping"]  # two downs seen, no counter to read
    host.set_ib_counters("mlx5_4", link_downed=5)
    assert p.read(ctx_at(50)).payload.flaps[("mlx5_4", "1")] == 5
    host.set_ib_counters("mlx5_4", link_downed=0)  # the driver was reloaded: the counter starts again
    assert p.read(ctx_at(60)).payload.flaps[("mlx5_4", "1")] == 5  # a lower reading is no down
    host.set_ib_counters("mlx5_4", link_downed=1)
    assert p.read(ctx_at(70)).payload.flaps[("mlx5_4", "1")] == 6  # counted from the new baseline
    assert full(host).read(ctx_at(80)).payload.flaps[("mlx5_4", "1")] == 0  # a new probe: baseline only


def test_gpudirect_required_and_missing(tmp_path):
    host = hgx(tmp_path)
    assert full(host).read(ctx_at(0)).findings == ()  # not required: not looked at
    (f,) = full(host, require_gpudirect=True).read(ctx_at(0)).findings
    assert (f.kind, f.message) == ("gpudirect_missing", "GPUDirect RDMA missing: no nvidia_peermem module loaded")
    host.load_module("nvidia_peermem")
    r = full(host, require_gpudirect=True).read(ctx_at(0))
    assert r.findings == () and r.payload.gpudirect is True


def test_a_counter_that_does_not_read_is_reported_and_the_state_still_judges(tmp_path):
    host = hgx(tmp_path)
    host.set_ib_counters("mlx5_7", symbol_error="lots")
    link_downed = host.sysfs / "class" / "infiniband" / "mlx5_6" / "ports" / "1" / "counters" / "link_downed"
    link_downed.unlink()
    link_downed.mkdir()  # there, but does not read (EISDIR, for root too), as a driver refusing a counter
    p = full(host, flaps=FlapThresholds(1, 600.0))
    r = p.read(ctx_at(0))
    # a counter that does not read is reported; one that reads but is not a number is could not check (never True)
    assert not r.ran and [(f.severity, f.kind) for f in r.findings] == [
        (Severity.INFO, "counters_unreadable"),
        (Severity.UNCHECKED, "counters_garbled"),
    ]
    assert "symbol_error" in r.findings[1].message and "is not a number" in r.findings[1].message
    assert decide(_obs(r), []).status is Status.UNKNOWN
    assert "symbol_error" not in r.payload.ports[7].counters and r.payload.ports[7].counters["link_downed"] == 0
    host.set_ib_counters("mlx5_7", symbol_error=0)
    assert p.read(ctx_at(5)).ran
    host.set_ib_port("mlx5_6", state="1: DOWN", phys_state="2: Polling")
    kinds = [f.kind for f in p.read(ctx_at(10)).findings if f.severity is Severity.FAULT]
    assert kinds == ["rail_down", "rail_flapping"]  # the down seen from the state, without its counter


def test_the_rail_metrics_per_device_and_port(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from agent.report.multinode_metrics import MultinodeMetrics

    host = hgx(tmp_path)
    host.set_ib_port("mlx5_0", state="1: DOWN", phys_state="3: Disabled")
    host.set_ib_counters("mlx5_1", symbol_error=12)
    reg = CollectorRegistry()
    m = MultinodeMetrics(reg)
    m.publish({Check.INFINIBAND: full(host).read(ctx_at(0))})
    text = generate_latest(reg).decode()
    assert 'gpu_ready_ib_port_up{device="mlx5_0",port="1"} 0.0' in text
    assert 'gpu_ready_ib_port_up{device="mlx5_1",port="1"} 1.0' in text
    assert 'gpu_ready_ib_port_rate_gbps{device="mlx5_1",port="1"} 400.0' in text
    assert 'gpu_ready_ib_port_errors_total{counter="symbol_error",device="mlx5_1",port="1"} 12.0' in text
    assert text.count("gpu_ready_ib_port_up{") == 8


@pytest.mark.apiserver
def test_the_agent_reports_a_flapping_rail_and_its_metrics(admin, agent_factory, simhost):
    rails(simhost)
    a = agent_factory(extra={"--poll-interval": "0.5"})
    a.wait_status(admin, "True")
    wait_for(lambda: a.metric("gpu_ready_ib_port_up") == 8, 20, what="8 ports up in the metrics")
    for n in (1, 2, 3):  # three link downs, each seen on a later poll than the one before
        before = simhost.smi_call_count()
        simhost.set_ib_counters("mlx5_4", link_downed=n)
        wait_for(lambda b=before: simhost.smi_call_count() >= b + 2, 20, what="a poll after the counter moved")
    a.wait_status(admin, "False", "GPUDegraded")
    wait_for(lambda: "mlx5_4 port 1 flapping" in a.gpu_ready(admin)["message"], 10, what="the rail named")
    assert a.metric("gpu_ready_ib_port_flaps", {"device": "mlx5_4"}) == 3


@pytest.mark.apiserver
def test_a_kernel_log_link_change_reads_the_rails_now_not_at_the_next_poll(admin, agent_factory, simhost):
    """The poll is 300 s and every wait below is at most 60 s: the rail is judged on a cycle the kernel-log record
    started. The record is a real captured one (the cable module of a ConnectX port unplugged)."""
    rails(simhost)
    a = agent_factory(extra={"--poll-interval": "300"})
    a.wait_status(admin, "True", timeout=60)
    runs = {"check": "infiniband"}
    wait_for(lambda: a.metric("gpu_ready_check_duration_seconds_count", runs) == 1, 60, what="the first cycle")
    simhost.set_ib_port("mlx5_4", state="1: DOWN", phys_state="2: Polling")
    assert a.gpu_ready(admin)["status"] == "True"  # sysfs alone is read at the next poll, 300 s away
    (line,) = [
        line.split("+00:00 ", 1)[1]
        for line in fixture_path(BOOT_LOG).read_text().splitlines()
        if "0000:1b:00.1: Port module event: module 1, Cable unplugged" in line
    ]
    simhost.append_kmsg(line, level=6)
    a.wait_status(admin, "False", "GPUDegraded", timeout=60)
    assert "mlx5_4 port 1" in a.gpu_ready(admin)["message"]
    assert a.metric("gpu_ready_check_duration_seconds_count", runs) == 2  # one cycle more: the record's, not a poll
    assert "InfiniBand/RoCE link change in the kernel log" in a.logs()
    # a link coming up starts a cycle too (the clear itself is the standing's: held until the rail stays up)
    simhost.set_ib_port("mlx5_4")
    simhost.append_kmsg("mlx5_core 0000:1b:00.1 enp27s0f1np1: Link up", level=6)
    wait_for(lambda: a.metric("gpu_ready_check_duration_seconds_count", runs) == 3, 60, what="the up record's cycle")
    wait_for(lambda: a.metric("gpu_ready_ib_port_up", {"device": "mlx5_4"}) == 1, 60, what="read up on that cycle")
    assert a.metric("gpu_ready_check_duration_seconds_count", runs) == 3  # and still no poll
