"""No read can stall a probe: every sysfs and procfs read runs under a deadline on a bounded worker (agent/probes/
sysfs.py over agent/probes/bounded.py). A FIFO nobody writes stands in for an attribute whose driver does not answer
(a wedged HCA): opening it blocks. Asserted by counts (reads abandoned, threads blocked, cycles), never by time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from agent.checks import combine
from agent.model import Check, Severity, Status
from agent.probes.base import ProbeContext
from agent.probes.bounded import Blocked, BoundedCalls
from agent.probes.device_nodes import DeviceNodesProbe, DeviceNodeThresholds
from agent.probes.fabric_manager import FabricManagerProbe
from agent.probes.infiniband import InfinibandProbe
from agent.probes.nvml import NvmlProbe
from agent.probes.pci import PciProbe
from agent.probes.pcie import PcieProbe, PcieThresholds
from agent.probes.sysfs import SysfsReader, read_bytes
from agent.runner import WAKE_CYCLE_GAP_S, wake_cycle_at
from agent.verdict import decide
from testkit.harness import wait_for
from testkit.simhost import SimHost

DEADLINE = 0.2  # short: the first read of a wedged file waits this long once


@pytest.fixture
def host(tmp_path) -> Iterator[SimHost]:
    h = SimHost(tmp_path / "hgx", pcie_bridges=True)
    for i in range(8):
        h.add_rail(f"mlx5_{i}", gpu=i)
    yield h
    h.unwedge(content="0\n")  # the blocked workers go (they end and are dropped), later reads read a file


@pytest.fixture
def reader() -> SysfsReader:
    return SysfsReader(DEADLINE, max_blocked=4)


def pci_context(host: SimHost) -> ProbeContext:
    ctx = ProbeContext()
    ctx.results[Check.PCI] = PciProbe(str(host.sysfs)).read(ctx)
    return ctx


RAIL_FILES = ("counters/link_downed", "counters/symbol_error", "state", "phys_state", "rate", "link_layer")


@pytest.mark.parametrize("name", RAIL_FILES)
def test_a_wedged_rail_file_is_could_not_check_and_refused_at_once_after(host, reader, name):
    ib = InfinibandProbe(str(host.sysfs), reader=reader)
    wedged = host.wedge(host.ib_port_file("mlx5_3", name))
    ctx = pci_context(host)
    r = ib.read(ctx)
    assert not r.ran and [f.severity for f in r.findings] == [Severity.UNCHECKED]
    assert str(wedged) in r.findings[0].message and "did not answer within 0.2s" in r.findings[0].message
    assert decide(combine([r], None), []).status is Status.UNKNOWN  # never True
    for _ in range(20):  # later cycles: the file is refused at once, no new thread, no wait
        r = ib.read(ctx)
        assert not r.ran and "still blocked" in r.findings[0].message
    assert (reader.calls.timeouts, reader.blocked) == (1, 1)


def test_a_wedged_pcie_link_file_is_could_not_check_for_its_gpu(host, reader):
    pcie = PcieProbe(str(host.sysfs), PcieThresholds(), reader=reader)
    wedged = host.wedge(host.link_file(2))
    ctx = pci_context(host)
    r = pcie.read(ctx)
    assert not r.ran and str(wedged) in r.findings[0].message  # the cycle's read gave up at the deadline
    r = pcie.read(ctx)  # next cycle: only that GPU's link is could not check, the others are judged
    unchecked = [f for f in r.findings if f.severity is Severity.UNCHECKED]
    assert not r.ran and [f.gpu for f in unchecked] == [host.gpus[2].address]
    assert "still blocked" in unchecked[0].message
    assert (reader.calls.timeouts, reader.blocked) == (1, 1)


def test_a_wedged_pci_identity_is_could_not_check_not_a_gpu_less(host, reader):
    host.wedge(host.devices / host.sysfs_name(host.gpus[5].address) / "class")
    pci = PciProbe(str(host.sysfs), reader)
    for _ in range(5):
        r = pci.read(ProbeContext())
        assert not r.ran and r.count is None and "class" in r.findings[0].message
    assert (reader.calls.timeouts, reader.blocked) == (1, 1)


def test_a_wedged_nvswitch_vendor_is_could_not_check(host, reader):
    host.wedge(host.devices / "0000:06:00.0" / "vendor")  # one of the simulated NVSwitches
    fm = FabricManagerProbe(str(host.sysfs))
    fm.scanner.reader = reader
    r = fm.read(ProbeContext())
    assert not r.ran and "vendor" in r.findings[0].message


def test_a_wedged_minor_number_file_falls_back_to_counting_the_nodes(host, reader):
    host.make_dev_nodes()
    host.wedge(host.proc / "driver" / "nvidia" / "gpus" / host.sysfs_name(host.gpus[0].address) / "information")
    probe = DeviceNodesProbe(DeviceNodeThresholds(dev_root=str(host.dev)), str(host.proc), reader=reader)
    ctx = pci_context(host)
    for _ in range(5):
        r = probe.read(ctx)
        assert r.ran and r.findings == ()  # every /dev/nvidia<N> is there: counted without the driver's minors
    assert (reader.calls.timeouts, reader.blocked) == (1, 1)


def test_threads_stay_bounded_with_a_wedged_file_over_many_cycles(host, reader):
    ib = InfinibandProbe(str(host.sysfs), reader=reader)
    host.wedge(host.ib_port_file("mlx5_0", "counters/link_downed"))
    ctx = pci_context(host)
    ib.read(ctx)  # abandoned at the deadline: that worker stays blocked
    ib.read(ctx)  # refused at once by the live worker that replaced it
    threads = threading.active_count()
    for _ in range(100):
        assert not ib.read(ctx).ran
    assert threading.active_count() == threads and reader.blocked == 1 and reader.calls.timeouts == 1


def test_at_most_max_blocked_threads_then_every_read_is_refused(host, reader):
    fifos = [host.wedge(host.ib_port_file(f"mlx5_{i}", "rate")) for i in range(6)]
    threads = threading.active_count()
    for f in fifos[:4]:
        with pytest.raises(Blocked, match="did not answer within"):
            reader.read(str(f))
    assert reader.blocked == 4 and threading.active_count() == threads + 4
    for f in [*fifos[4:], host.ib_port_file("mlx5_7", "state")]:  # a healthy file too: could not check
        with pytest.raises(Blocked, match="4 earlier sysfs read calls still blocked"):
            reader.read(str(f))
    assert reader.calls.timeouts == 4 and threading.active_count() == threads + 4
    host.unwedge(fifos[0], content="400 Gb/sec (4X NDR)\n")  # its driver answers at last: the worker ends
    wait_for(lambda: reader.blocked == 3, 10, what="the released worker ended")
    assert reader.read(str(fifos[0])) == b"400 Gb/sec (4X NDR)\n"


def test_a_worker_released_after_its_deadline_changes_nothing(host, reader):
    ib = InfinibandProbe(str(host.sysfs), reader=reader)
    ctx = pci_context(host)
    assert ib.read(ctx).ran
    before = dict(ib.layout.devices)
    host.add_rail("mlx5_8")  # a new device: its layout is read, and its link layer blocks
    host.wedge(host.ib_port_file("mlx5_8", "link_layer"))
    assert not ib.read(ctx).ran
    host.unwedge(content="InfiniBand\n")  # the abandoned worker reads it now: what it read is dropped
    wait_for(lambda: reader.blocked == 0, 10, what="the worker released")
    assert ib.layout.devices == before
    r = ib.read(ctx)
    assert r.ran and len(r.payload.ports) == 9 and r.payload.ports[-1].link_layer == "InfiniBand"


def test_a_read_outside_a_probe_call_is_bounded_too(host):
    wedged = host.wedge(host.ib_port_file("mlx5_1", "state"))
    with pytest.raises(Blocked):  # the shared reader: 2 s once
        read_bytes(str(wedged))
    assert read_bytes(str(host.ib_port_file("mlx5_2", "state"))) == b"4: ACTIVE\n"


def test_nvml_and_sysfs_share_one_mechanism():
    assert isinstance(NvmlProbe("off")._calls, BoundedCalls) and isinstance(SysfsReader().calls, BoundedCalls)


def test_kernel_log_wakes_are_rate_limited_counted_in_cycles():
    """Records lost every 0.2 s for 20 s (and a link change with each): the loop's rule gives a cycle at most every
    WAKE_CYCLE_GAP_S, not one per wake (it gave 99 cycles in 20 s)."""
    poll, last, cycles, t = 300.0, 0.0, 1, 0.0
    next_poll = poll
    while t < 20.0:
        t = round(t + 0.2, 6)
        due = wake_cycle_at(next_poll, last)  # the wake asked for a cycle
        if t >= due:
            cycles, last, next_poll = cycles + 1, t, t + poll
    assert cycles <= 1 + 20.0 / WAKE_CYCLE_GAP_S and cycles < 100 / 2
    assert wake_cycle_at(300.0, None) == WAKE_CYCLE_GAP_S  # long after the last cycle: at once
    assert wake_cycle_at(5.0, 10.0) == 5.0  # never later than the poll
