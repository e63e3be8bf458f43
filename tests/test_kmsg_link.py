"""InfiniBand/RoCE link-change records in the kernel log (agent/kernel_log/link.py): what matches, what must not,
the bound on what the patterns see, and the watcher's wake (no latch)."""

from __future__ import annotations

import pytest

from agent.kernel_log.link import MAX_LINE, LinkChange, parse_link_change
from agent.kernel_log.source import KmsgSource, format_record
from agent.kernel_log.watcher import KernelLogIngest, KmsgWatcher
from agent.kernel_log.xid import KernelLogParser
from agent.report.metrics import Metrics
from agent.state import LatchState
from testkit.fixture_files import fixture_path
from testkit.parse_counts import link_pattern_lines

BOOT = "nvrm-dmesg-full-boot-h100-nvswitch-healthy-decode-iso-gpud-fixture.txt"
FORMATS = "kmsg-mlx5-link-change-formats-linux-driver-source.txt"


def changes(name: str) -> list[LinkChange]:
    out = []
    for line in fixture_path(name).read_text().splitlines():
        c = parse_link_change(line)
        if c is not None:
            out.append(c)
    return out


def test_the_captured_boot_log_link_changes_and_nothing_else():
    """A real H100 node's boot: the RoCE netdevs' carrier lines and the cable module events match; the SATA
    "link down" lines, "link becomes ready", the renames and the other mlx5_core lines do not."""
    found = changes(BOOT)
    carrier = [(c.address, c.ifname, c.state) for c in found if c.ifname is not None]
    assert carrier == [
        ("0000:9d:00.1", "enp157s0f1np1", "down"),
        ("0000:9d:00.0", "enp157s0f0np0", "down"),
        ("0000:1b:00.1", "enp27s0f1np1", "down"),
        ("0000:1b:00.0", "bootnet", "up"),
    ]
    modules = [(c.address, c.module, c.state) for c in found if c.module is not None]
    assert ("0000:1b:00.1", 1, "Cable unplugged") in modules and ("0000:9d:00.1", 1, "Cable unplugged") in modules
    assert ("0000:1a:00.0", 0, "Cable plugged") in modules
    text = fixture_path(BOOT).read_text()
    assert len(modules) == text.count("Port module event: module") == 12
    assert len(found) == 16
    assert KernelLogParser().feed(text) == []  # no Xid either


def test_the_driver_format_strings_rendered():
    found = changes(FORMATS)
    assert [(c.address, c.ifname, c.module, c.state) for c in found] == [
        ("0000:3b:00.0", None, 0, "Cable error"),  # mlx5_core_err's "<function>:<line>:(pid N): " prefix
        ("0000:3b:00.0", None, 0, "Cable error"),  # the older kernels' mlx5_core_info form
        ("0000:3b:00.0", None, 0, "Cable disabled"),
        ("0000:3b:00.0", None, 0, "Cable unplugged"),
        ("0000:3b:00.0", "ens1f0np0", None, "down"),
        ("0000:3b:00.0", "ens1f0np0", None, "up"),
    ]
    assert found[4].subject == "0000:3b:00.0 ens1f0np0" and found[0].subject == "0000:3b:00.0 module 0"
    parser = KernelLogParser()
    assert [e for line in fixture_path(FORMATS).read_text().splitlines() for e in parser.feed(line)] == []


@pytest.mark.parametrize(
    "line",
    [
        "ata6: SATA link down (SStatus 4 SControl 300)",
        "IPv6: ADDRCONF(NETDEV_CHANGE): bootnet: link becomes ready",
        "tg3 0000:02:00.0 eth0: Link is down",
        "igb 0000:03:00.0 eno1: igb: eno1 NIC Link is Down",
        "mlx5_core 0000:1b:00.0 enp27s0f0np0: renamed from eth0",
        "mlx5_core 0000:1b:00.0 bootnet: Link up, 100 Gbps",  # not the driver's record: something follows
        "mlx5_core 0000:1b:00.0 bootnet: Link sideways",
        "mlx5_core 0000:1b:00.0: Link down",  # the carrier record always names the netdev
        "mlx5_core 0000:1b:00.0 a/b: Link down",  # no netdev name holds '/'
        "mlx5_core 0000:1b:00.0 abcdefghijklmnop: Link down",  # 16 characters: longer than any netdev name
        "mlx5_core 0000:1b:00.0: Port module event: module 1, Cable exploded",
        "mlx5_core 0000:1b:00.0: Port module event: module 99999, Cable unplugged",
        "mlx5_core 0000:1b:00.0: mlx5_pcie_event:299:(pid 9): Detected insufficient power on the PCIe slot (27W).",
        "mlx5_core 0000:1b:00.0: firmware version: 28.39.1002",
        "mlx5_core0000:1b:00.0 bootnet: Link down",
        "xmlx5_core 0000:1b:00.0 bootnet: Link down",
        "mlx4_core 0000:1b:00.0 eth0: Link down",
        "mlx5_core 0000:1b:00 bootnet: Link down",  # no function number: not a PCI device name
    ],
)
def test_near_misses_do_not_match(line):
    assert parse_link_change(line) is None


def test_prefixes_and_continuation_lines():
    """dmesg prefixes before the driver's name are fine; /dev/kmsg's continuation lines (SUBSYSTEM=, DEVICE=)
    are not read."""
    for prefix in ("", "[ 6781741.548779] ", "kernel: ", "<6>"):
        c = parse_link_change(prefix + "mlx5_core 0000:1B:00.0 bootnet: Link down")
        assert c is not None and (c.address, c.state) == ("0000:1b:00.0", "down")
    assert parse_link_change("mlx5_core 0000:1b:00.0 bootnet: Link down\n SUBSYSTEM=net\n DEVICE=n5") is not None
    assert parse_link_change("usb 1-1: new device\nmlx5_core 0000:1b:00.0 bootnet: Link down") is None


@pytest.mark.parametrize("size", [16_000, 200_000, 4_000_000])
def test_a_huge_record_is_cut_before_the_patterns(size):
    """Whatever a record holds, the patterns see at most MAX_LINE characters of its first line."""
    cases = [
        "mlx5_core " + "0" * size + " Link down",
        "mlx5_core 0000:1b:00.0 " + "x" * size + ": Link down",
        ("mlx5_core 0000:1b:00.0: " * (size // 24)) + "Port module event: module 1, Cable unplugged",
        "Link " * (size // 5) + "mlx5_core",
    ]
    with link_pattern_lines() as seen:
        assert [parse_link_change(t) for t in cases] == [None] * len(cases)
    assert seen and max(seen) <= MAX_LINE, max(seen)


def test_the_work_grows_linearly():
    """8x the records: 8x the characters the patterns see, never more."""
    line = "mlx5_core 0000:1b:00.0: " + "Port module event: module " * 30
    with link_pattern_lines() as small:
        for _ in range(500):
            parse_link_change(line)
    with link_pattern_lines() as large:
        for _ in range(4000):
            parse_link_change(line)
    assert (sum(large), len(large)) == (8 * sum(small), 8 * len(small))


def watcher(tmp_path, links: bool) -> tuple[KmsgWatcher, list[int], LatchState]:
    log = tmp_path / "kmsg"
    log.write_text("")
    wakes: list[int] = []
    state = LatchState(str(tmp_path / "state"), "boot")
    ingest = KernelLogIngest(KernelLogParser(), state, Metrics(), links=links)
    w = KmsgWatcher(KmsgSource(str(log)), ingest, Metrics(), lambda: wakes.append(1), 1.0)
    return w, wakes, state


def append(tmp_path, *texts: str, seq: int = 1) -> None:
    with open(tmp_path / "kmsg", "a") as fh:
        for i, t in enumerate(texts):
            fh.write(format_record(t, seq + i, 1000 * (seq + i), level=6))


def test_a_link_change_wakes_the_runner_once_per_read_and_latches_nothing(tmp_path):
    w, wakes, state = watcher(tmp_path, links=True)
    try:
        append(tmp_path, "usb 1-1: new device", "mlx5_core 0000:1b:00.0 bootnet: Link up")
        assert w.read_available() is False  # nothing latched
        assert (len(wakes), w.take_link_change(), w.take_link_change()) == (1, True, False)
        assert w.ingest.link_change_count == 1 and w.ingest.link_changes[0].state == "up"
        # a storm of flaps in one read: one wake, one flag, the count kept and a few examples only
        flaps = [f"mlx5_core 0000:1b:00.0 bootnet: Link {('down', 'up')[i % 2]}" for i in range(500)]
        append(tmp_path, *flaps, "mlx5_core 0000:1b:00.1: Port module event: module 1, Cable unplugged", seq=3)
        w.read_available()
        assert (len(wakes), w.take_link_change()) == (2, True)
        assert w.ingest.link_change_count == 501  # all counted; the distinct ones kept for the log line
        assert [f"{c.subject}: {c.state}" for c in w.ingest.link_changes] == [
            "0000:1b:00.0 bootnet: down",
            "0000:1b:00.0 bootnet: up",
            "0000:1b:00.1 module 1: Cable unplugged",
        ]
        append(tmp_path, "usb 1-1: another device", seq=504)  # a later read without a link change
        w.read_available()
        assert (len(wakes), w.take_link_change(), w.ingest.link_change_count) == (2, False, 0)
        assert state.snapshot() == [] and w.take_fresh() == [] and w.take_rerun() is False
    finally:
        w.close()


def test_with_the_rails_check_off_a_link_change_wakes_nothing(tmp_path):
    w, wakes, _ = watcher(tmp_path, links=False)
    try:
        append(tmp_path, "mlx5_core 0000:1b:00.1: Port module event: module 1, Cable unplugged")
        w.read_available()
        assert (wakes, w.take_link_change(), w.ingest.link_change_count) == ([], False, 0)
    finally:
        w.close()
