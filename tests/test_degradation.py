"""Silent degradation signals on the simulated host: PCIe link training, device nodes, clock
events, Xid rate, the dcgm-exporter cross-check, the GPUDegraded reason, and `make gpu-smoke` without GPUs.
Each signal: healthy, degraded, cannot-check."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.kernel_log.rate import XidRateThresholds, XidRateTracker
from agent.kernel_log.xid import KernelLogParser
from agent.model import Check, Finding, GpuIdentity, Observation, PciAddress, Reason, Severity, Status
from agent.probes.clocks import ClockEventTracker, ClockSample, ClockThresholds, nvml_clock_sample
from agent.probes.dcgm import (
    DcgmThresholds,
    dcgm_findings,
    findings_from_metrics,
    parse_labels,
    parse_metrics,
)
from agent.probes.device_nodes import DeviceNodeThresholds, device_node_findings, read_minor_numbers
from agent.probes.pcie import GpuLoad, PcieThresholds, nvml_pcie_load, pcie_findings
from agent.verdict import decide
from testkit.fakes import fake_nvml
from testkit.fixture_files import fixture_path
from testkit.simhost import DcgmExporterStandIn, SimHost

ROOT = Path(__file__).resolve().parents[1]


def faults(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.FAULT]


def unchecked(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.UNCHECKED]


def addrs(host: SimHost) -> list[PciAddress]:
    return [g.address for g in host.gpus]


@pytest.fixture
def bridged(tmp_path: Path) -> SimHost:
    return SimHost(tmp_path / "bridged", gpus=4, pcie_bridges=True)


# -- PCIe link ----------------------------------------------------------------------------------------


def test_pcie_healthy_idle_and_busy(bridged: SimHost):
    assert pcie_findings(str(bridged.sysfs), addrs(bridged)) == []
    busy = {a: GpuLoad(utilization_pct=100, current_gen=5, max_gen=5) for a in addrs(bridged)}
    assert pcie_findings(str(bridged.sysfs), addrs(bridged), load=busy) == []


def test_pcie_link_cache_reads_maxima_once_and_current_fields_every_cycle(bridged: SimHost, monkeypatch):
    import agent.probes.pcie as pcie
    from agent.probes.pci import PciScanner

    reads: list[str] = []
    real = pcie._read_attr
    monkeypatch.setattr(pcie, "_read_attr", lambda path: reads.append(os.path.basename(path)) or real(path))
    scanner, cache = PciScanner(str(bridged.sysfs)), pcie.LinkCache()
    scanner.scan()
    cache.refresh(scanner.key)
    assert pcie_findings(str(bridged.sysfs), addrs(bridged), cache=cache) == []
    assert reads.count("max_link_width") == reads.count("current_link_width") > 0
    reads.clear()
    gpu = bridged.gpus[2].address
    bridged.set_link(gpu, current_width=8)  # retrained narrower: seen on the next cycle
    f = pcie_findings(str(bridged.sysfs), addrs(bridged), cache=cache)
    assert [(x.gpu, x.kind) for x in f] == [(gpu, "pcie_width")]
    assert "max_link_width" not in reads and "max_link_speed" not in reads and "current_link_speed" in reads
    # A changed PCI scan (here: a GPU bound to vfio-pci) drops the cache: the maxima are read again.
    bridged.set_link(gpu, current_width=8, max_width=8)
    bridged.bind_vfio(bridged.gpus[0].address)
    scanner.scan()
    cache.refresh(scanner.key)
    reads.clear()
    assert pcie_findings(str(bridged.sysfs), addrs(bridged)[1:], cache=cache) == []  # x8 of x8: not degraded
    assert "max_link_width" in reads


def test_pcie_width_downtrained_on_gpu_names_the_link(bridged: SimHost):
    gpu = bridged.gpus[2].address
    bridged.set_link(gpu, current_width=8)
    f = pcie_findings(str(bridged.sysfs), addrs(bridged))
    assert [(x.gpu, x.kind, x.reason) for x in f] == [(gpu, "pcie_width", Reason.GPU_DEGRADED)]
    assert f[0].message == "PCIe GPU link trained to x8, capable of x16"
    # the bridge above sees the same link from its end: reported once, not twice
    bridged.set_link(bridged.upstream_bridge(2), current_width=8)
    assert len(pcie_findings(str(bridged.sysfs), addrs(bridged))) == 1


def test_pcie_width_downtrained_on_upstream_bridge(tmp_path: Path):
    host = SimHost(tmp_path / "h", gpus=2, pcie_bridges=True)
    # the bridge above GPU 1 reports its link narrower than both of its ends can do
    bridge = host.upstream_bridge(1)
    host.set_link(bridge, current_width=4, max_width=16)
    f = pcie_findings(str(host.sysfs), addrs(host))
    assert len(f) == 1 and f[0].gpu == host.gpus[1].address
    assert f[0].message == f"PCIe upstream bridge {host.sysfs_name(bridge)} trained to x4, capable of x16"
    assert pcie_findings(str(host.sysfs), addrs(host), PcieThresholds(check_bridges=False)) == []


def test_pcie_narrower_partner_is_no_alarm(bridged: SimHost):
    # an x16-capable GPU under an x8 port runs at x8 by design of the slot, not by downtraining
    bridged.set_link(bridged.upstream_bridge(0), current_width=8, max_width=8)
    bridged.set_link(bridged.gpus[0].address, current_width=8, max_width=16)
    assert pcie_findings(str(bridged.sysfs), addrs(bridged)) == []


def test_pcie_speed_is_judged_only_under_load(bridged: SimHost):
    gpu = bridged.gpus[1].address
    bridged.set_link(gpu, current_gts=2.5)  # idle GPUs drop to Gen1 (ASPM): no alarm at idle
    bridged.set_link(bridged.upstream_bridge(1), current_gts=2.5)
    assert pcie_findings(str(bridged.sysfs), addrs(bridged)) == []
    idle = {gpu: GpuLoad(utilization_pct=3)}
    assert pcie_findings(str(bridged.sysfs), addrs(bridged), load=idle) == []
    busy = {gpu: GpuLoad(utilization_pct=97)}
    f = pcie_findings(str(bridged.sysfs), addrs(bridged), load=busy)
    assert [(x.gpu, x.kind) for x in f] == [(gpu, "pcie_speed")]
    assert f[0].message == "PCIe GPU link at Gen1 (2.5 GT/s) under load (97% busy), capable of Gen5 (32 GT/s)"
    assert pcie_findings(str(bridged.sysfs), addrs(bridged), PcieThresholds(check_speed=False), load=busy) == []


def test_pcie_nvml_generation_under_load(bridged: SimHost):
    gpu = bridged.gpus[0].address
    nv = fake_nvml([{"busId": gpu.nvml, "util": 88, "pcie_gen": 5, "pcie_gen_cur": 3}])
    load = nvml_pcie_load(nv, 0)
    assert load == GpuLoad(utilization_pct=88, current_gen=3, max_gen=5, current_width=16, max_width=16)
    f = pcie_findings(str(bridged.sysfs), [gpu], load={gpu: load})
    assert [x.kind for x in f] == ["pcie_gen"] and "Gen3 under load (88% busy), capable of Gen5" in f[0].message
    idle = nvml_pcie_load(fake_nvml([{"busId": gpu.nvml, "util": 0, "pcie_gen_cur": 1}]), 0)
    assert pcie_findings(str(bridged.sysfs), [gpu], load={gpu: idle}) == []
    # utilisation not supported: speed is not judged at all
    unknown = nvml_pcie_load(fake_nvml([{"busId": gpu.nvml, "pcie_gen_cur": 1}]), 0)
    assert unknown.utilization_pct is None and pcie_findings(str(bridged.sysfs), [gpu], load={gpu: unknown}) == []


def test_pcie_cannot_check(bridged: SimHost, tmp_path: Path):
    gpu = bridged.gpus[3].address
    (bridged.devices / bridged.sysfs_name(gpu) / "current_link_width").write_text("garbage\n")
    f = pcie_findings(str(bridged.sysfs), addrs(bridged))
    assert [(x.severity, x.gpu, x.kind) for x in f] == [(Severity.UNCHECKED, gpu, "unreadable")]
    assert "current_link_width: cannot parse 'garbage'" in f[0].message
    missing = pcie_findings(str(tmp_path / "nosys"), addrs(bridged))
    assert [x.severity for x in missing] == [Severity.UNCHECKED]


def test_pcie_fields_not_exposed_is_informational(simhost: SimHost):
    gpu = simhost.gpus[0].address
    simhost.set_link(gpu, None, None, None, None)
    f = pcie_findings(str(simhost.sysfs), [gpu])
    assert [(x.severity, x.kind) for x in f] == [(Severity.INFO, "not_exposed")]


def test_pcie_real_kernel_speed_formats(simhost: SimHost):
    gpu = simhost.gpus[0].address
    d = simhost.devices / simhost.sysfs_name(gpu)
    (d / "current_link_speed").write_text("8 GT/s\n")  # pre-5.x kernels print no decimals and no "PCIe"
    (d / "max_link_speed").write_text("16.0 GT/s PCIe\n")
    f = pcie_findings(str(simhost.sysfs), [gpu], load={gpu: GpuLoad(utilization_pct=60)})
    assert [x.kind for x in f] == ["pcie_speed"] and "Gen3 (8 GT/s)" in f[0].message
    (d / "current_link_speed").write_text("Unknown\n")  # unknown speed: width still judged, speed not
    assert pcie_findings(str(simhost.sysfs), [gpu], load={gpu: GpuLoad(utilization_pct=60)}) == []


# -- device nodes -------------------------------------------------------------------------------------


def _minors(host: SimHost) -> dict[PciAddress, int]:
    return read_minor_numbers(str(host.proc), addrs(host))


def test_device_nodes_healthy(simhost: SimHost):
    simhost.make_dev_nodes(mig=True)
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    assert _minors(simhost) == {g.address: g.minor for g in simhost.gpus}
    assert device_node_findings(t, minors=_minors(simhost), mig_enabled=True) == []
    assert device_node_findings(t, gpu_count=8) == []


def test_device_nodes_missing_uvm_and_gpu_node(simhost: SimHost):
    simhost.make_dev_nodes(skip=("nvidia-uvm", "nvidia3"))
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    f = device_node_findings(t, minors=_minors(simhost))
    assert [(x.reason, x.gpu, x.kind) for x in f] == [
        (Reason.GPU_DEGRADED, None, "missing"),
        (Reason.GPU_DEGRADED, simhost.gpus[3].address, "missing"),
    ]
    assert f[0].message == f"device node {simhost.dev}/nvidia-uvm is missing (CUDA programs fail without it)"
    assert f[1].message == f"device node {simhost.dev}/nvidia3 is missing"
    counted = device_node_findings(t, gpu_count=8)
    assert any("7 GPU device nodes" in x.message and "0, 1, 2, 4, 5, 6, 7" in x.message for x in counted)
    assert device_node_findings(DeviceNodeThresholds(dev_root=str(simhost.dev), require_uvm=False)) == []


def test_device_nodes_not_a_character_device_and_mig_caps(simhost: SimHost):
    simhost.make_dev_nodes()
    simhost.replace_dev_node_with_file("nvidiactl")
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    f = device_node_findings(t, minors=_minors(simhost), mig_enabled=True)
    assert [x.kind for x in f] == ["not_char", "missing"]
    assert "nvidiactl is not a character device" in f[0].message
    assert (
        f[1].message
        == f"device node directory {simhost.dev}/nvidia-caps is missing (MIG is on; MIG devices cannot be opened)"
    )


def test_device_nodes_cannot_check(tmp_path: Path):
    f = device_node_findings(DeviceNodeThresholds(dev_root=str(tmp_path / "nodev")), gpu_count=1)
    assert [(x.severity, x.check) for x in f] == [(Severity.UNCHECKED, Check.DEVICE_NODES)]


# -- clock events and thermal margin --------------------------------------------------------------------


def _poll(tracker: ClockEventTracker, nv, gpu: PciAddress, now: float) -> None:
    tracker.observe(gpu, nvml_clock_sample(nv, 0), now)


def test_clocks_healthy_with_normal_reasons():
    gpu = PciAddress(0, 0x3B, 0)
    state = {"busId": gpu.nvml, "throttle": 0x1 | 0x4 | 0x20, "margin": 25.0}  # idle, SW power cap, SW thermal
    nv = fake_nvml([state])
    tr = ClockEventTracker(ClockThresholds(margin_min_c=5.0))
    for i in range(20):
        _poll(tr, nv, gpu, 30.0 * i)
    assert tr.findings(600.0) == []


def test_clocks_degraded_over_the_window_then_clear():
    gpu = PciAddress(0, 0x3B, 0)
    state = {"busId": gpu.nvml, "throttle": 0}
    nv = fake_nvml([state])
    tr = ClockEventTracker()
    now = 0.0
    for i in range(20):  # 10 minutes at 30 s: 8 of 20 polls see HW slowdown or power brake (40% > 30%)
        state["throttle"] = (0x8 if i % 3 == 0 else 0) | (0x80 if i == 1 else 0)
        now = 30.0 * i
        _poll(tr, nv, gpu, now)
    f = tr.findings(now)
    assert [(x.gpu, x.reason, x.kind) for x in f] == [(gpu, Reason.GPU_DEGRADED, "clock_slowdown")]
    assert f[0].message == "clocks slowed by HW slowdown, HW power brake in 8 of 20 samples (40%) over the last 10 min"
    state["throttle"] = 0
    for i in range(20, 40):  # the next clean 10 minutes push the slowed samples out of the window
        now = 30.0 * i
        _poll(tr, nv, gpu, now)
    assert tr.findings(now) == []


def test_clocks_one_sample_is_not_a_rate():
    gpu = PciAddress(0, 0x3B, 0)
    nv = fake_nvml([{"busId": gpu.nvml, "throttle": 0x40}])
    tr = ClockEventTracker()
    for i in range(4):  # under min_samples: not judged yet, even if every sample is slowed
        _poll(tr, nv, gpu, float(i))
    assert tr.findings(4.0) == []
    _poll(tr, nv, gpu, 5.0)
    assert [x.kind for x in tr.findings(5.0)] == ["clock_slowdown"]


def test_clocks_thermal_margin_and_history_bound():
    gpu = PciAddress(0, 0x3B, 0)
    nv = fake_nvml([{"busId": gpu.nvml, "margin": 1.5}])
    tr = ClockEventTracker(ClockThresholds(margin_min_c=2.0, max_samples=8))
    for i in range(100):
        _poll(tr, nv, gpu, float(i))
    assert [x.message for x in tr.findings(100.0)] == ["thermal margin 1.5 C, at or below 2 C"]
    assert len(tr._gpus[gpu].samples) == 8
    assert ClockEventTracker().findings(0.0) == [] and ClockThresholds().margin_min_c is None


def test_clocks_cannot_check_and_not_supported():
    gpu = PciAddress(0, 0x3B, 0)
    tr = ClockEventTracker()
    _poll(tr, fake_nvml([{"busId": gpu.nvml, "throttle_error": 15}]), gpu, 0.0)
    f = tr.findings(0.0)
    assert [(x.severity, x.gpu, x.kind) for x in f] == [(Severity.UNCHECKED, gpu, "unreadable")]
    tr2 = ClockEventTracker()
    for i in range(10):  # NOT_SUPPORTED: nothing to count, no alarm, not "could not check"
        _poll(tr2, fake_nvml([{"busId": gpu.nvml, "throttle_error": 3}]), gpu, float(i))
    assert tr2.findings(10.0) == []


# -- Xid rate -----------------------------------------------------------------------------------------


def _xids(host: SimHost, xid: int, gpu: int = 0, n: int = 1):
    parser = KernelLogParser()
    out = []
    for _ in range(n):
        out += parser.feed(host.xid_line(xid, gpu, "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0)"))
    return out


def test_xid_rate_healthy_below_threshold(simhost: SimHost):
    tr = XidRateTracker()
    tr.observe(_xids(simhost, 13, n=2), 0.0)
    tr.observe(_xids(simhost, 13, n=1), 700.0)  # the first two have left the 10 minute window
    assert tr.findings(700.0) == []
    tr.observe(_xids(simhost, 45, n=50), 701.0)  # 45 follows other Xids: ignored by default
    assert tr.findings(701.0) == []


def test_xid_rate_degraded_until_the_window_is_clean(simhost: SimHost):
    evs = _xids(simhost, 31, gpu=2)
    assert evs and not evs[0].fatal
    tr = XidRateTracker()
    for t in (0.0, 120.0, 240.0):
        tr.observe(evs, t)
    f = tr.findings(240.0)
    assert [(x.gpu, x.reason, x.kind) for x in f] == [(simhost.gpus[2].address, Reason.GPU_DEGRADED, "xid_rate")]
    assert f[0].message == "Xid 31 repeated: 3 or more within 10 min (3 occurrences in the last window)"
    assert tr.findings(800.0) != []  # 240 + 600 > 800: the window still holds one
    tr.observe(evs, 820.0)  # a new one keeps it degraded
    assert tr.findings(1400.0) != []
    assert tr.findings(1421.0) == []  # a full window with none: clear, not latched
    tr.observe(evs, 1500.0)
    assert tr.findings(1500.0) == []


def test_xid_rate_counts_per_gpu_and_xid_and_skips_fatal(simhost: SimHost):
    tr = XidRateTracker(XidRateThresholds(count=2, window_s=60))
    tr.observe(_xids(simhost, 13, gpu=0) + _xids(simhost, 13, gpu=1) + _xids(simhost, 43, gpu=0), 0.0)
    assert tr.findings(0.0) == []
    fatal = _xids(simhost, 79, gpu=3, n=5)
    assert fatal and all(e.fatal for e in fatal)
    tr.observe(fatal, 1.0)
    assert tr.findings(1.0) == []


def _kernel_log_times(name: str) -> list[tuple[str, float]]:
    """The lines of a real `dmesg --time-format iso` capture, each with its time in seconds."""
    from datetime import datetime

    out = []
    for line in fixture_path(name).read_text().splitlines():
        m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d),(\d+)([+-]\d\d:\d\d)", line)
        assert m, line
        at = datetime.fromisoformat(f"{m[1]}{m[3]}").timestamp() + float(f"0.{m[2]}")
        out.append((line[line.index("NVRM:") :], at))
    return out


def test_xid_rate_one_fault_printing_a_burst_is_one_occurrence():
    """A real H100 kernel log: one out-of-range access printed 15 Xid 13 lines (one per SM, TPC and ESR) within
    2 ms. That is one occurrence, not a GPU repeating Xid 13: no GPUDegraded. The same burst three times, minutes
    apart, is three occurrences and trips the rate."""
    lines = _kernel_log_times("xid-lines-13-43-dmesg-decode-iso-gpud-fixture.txt")
    parser = KernelLogParser()
    timed = [(ev, at) for text, at in lines for ev in parser.feed(text)]
    xid13 = [at for ev, at in timed if ev.xid == 13]
    assert len(xid13) == 15 and max(xid13) - min(xid13) < 0.01
    tr = XidRateTracker()
    tr.observe_at(timed)
    end = max(at for _, at in timed)
    assert tr.findings(end) == []
    for later in (120.0, 240.0):
        tr.observe_at((ev, at + later) for ev, at in timed)
    f = tr.findings(end + 240.0)  # the capture's Xid 13 burst and its Xid 43, each three times
    assert [(x.gpu, x.message.split(":")[0]) for x in f] == [
        (PciAddress(0, 0x38, 0), "Xid 13 repeated"),
        (PciAddress(0, 0x38, 0), "Xid 43 repeated"),
    ], f
    assert all("(3 occurrences in the last window)" in x.message for x in f)


def test_xid_rate_a_stream_longer_than_a_burst_still_counts(simhost: SimHost):
    """Coalescing is per burst, not per stream: the same Xid every 0.5 s counts once a second and trips."""
    evs = _xids(simhost, 31)
    tr = XidRateTracker()
    for i in range(6):
        tr.observe(evs, i * 0.5)
    assert tr.findings(3.0) != []
    with pytest.raises(ValueError):
        XidRateThresholds(burst_s=600.0)


def test_thresholds_reject_nonsense():
    for bad in (
        lambda: XidRateThresholds(count=0),
        lambda: ClockThresholds(max_slowed_share=1.5),
        lambda: PcieThresholds(busy_utilization_pct=101),
    ):
        with pytest.raises(ValueError):
            bad()


def test_xid_rate_bounded_keys():
    from agent.model import XidEvent

    tr = XidRateTracker(XidRateThresholds(max_keys=10))
    for b in range(200):
        tr.observe([XidEvent(13, PciAddress(0, b, 0), "", False, "")], float(b))
    assert len(tr._times) == 10


# -- dcgm-exporter cross-check ---------------------------------------------------------------------------

L4_TEXT = fixture_path("dcgm-metrics-l4-580.105.08-Hostname-kops-conformance.txt").read_text()
L4 = PciAddress(0, 0x31, 0)


def _set_value(text: str, metric: str, value: str) -> str:
    """The real capture with one metric's value changed (labels kept byte for byte)."""
    new, n = re.subn(rf"^({metric}\{{[^\n]*\}}) \S+$", rf"\g<1> {value}", text, flags=re.MULTILINE)
    assert n == 1, metric
    return new


def _add_like(text: str, template_metric: str, metric: str, extra: str, value: str) -> str:
    """Adds `metric` with the label set of `template_metric` in the capture plus `extra` labels."""
    m = re.search(rf"^{template_metric}\{{([^\n]*)\}} \S+$", text, flags=re.MULTILINE)
    assert m
    return text + f"{metric}{{{m.group(1)}{extra}}} {value}\n"


def test_dcgm_parser_on_real_capture():
    samples = parse_metrics(L4_TEXT)
    assert {s.name for s in samples} == {"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
    assert all(s.labels["pci_bus_id"] == "00000000:31:00.0" and s.labels["Hostname"] for s in samples)
    assert parse_labels('a="x\\"y",b="z"') == {"a": 'x"y', "b": "z"}
    assert parse_labels('a="unterminated') is None


def test_dcgm_healthy_served_by_the_stand_in():
    with DcgmExporterStandIn(L4_TEXT) as ex:
        assert dcgm_findings(DcgmThresholds(address=ex.address, node_name="i-030791dc5a37cd257")) == []
        assert ex.requests == 1
    assert dcgm_findings(DcgmThresholds()) == []  # off unless an address is set


def test_dcgm_degraded_both_hostname_spellings():
    text = _set_value(L4_TEXT, "DCGM_FI_DEV_ROW_REMAP_FAILURE", "1")
    text = _add_like(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "", "2")
    text = _add_like(
        text,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_EXP_GPU_HEALTH_STATUS",
        ',health_error_code="DCGM_FR_VOLATILE_DBE_DETECTED",health_watch="MEM"',
        "20",
    )
    text = _add_like(
        text, "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_XID_ERRORS", ',err_code="48",err_msg="DBE"', "48"
    )
    for spelling in (text, text.replace("Hostname=", "hostname=")):  # before and after dcgm-exporter#655
        with DcgmExporterStandIn(spelling) as ex:
            f = dcgm_findings(DcgmThresholds(address=ex.address, node_name="i-030791dc5a37cd257"))
        got = sorted((x.severity.value, x.kind) for x in f)
        assert got == [
            ("fault", "dcgm_ecc_dbe"),
            ("fault", "dcgm_health"),
            ("fault", "dcgm_row_remap_failure"),
            ("info", "dcgm_last_xid"),
        ]
        assert all(x.gpu == L4 for x in f)
        assert "DCGM health MEM: FAIL (DCGM_FR_VOLATILE_DBE_DETECTED)" in [x.message for x in f]
        # series of another host (an address reaching a Service, not the node's own pod) are ignored
        assert findings_from_metrics(spelling, DcgmThresholds(node_name="other-node", required=True))[0].severity is (
            Severity.UNCHECKED
        )


def test_dcgm_maps_by_uuid_when_bus_id_is_empty():
    text = fixture_path("dcgm-metrics-hostname-lowercase-dcgm-exporter-server-test.txt").read_text()
    text = text.replace("TEST_METRIC", "DCGM_FI_DEV_ROW_REMAP_FAILURE").replace("} 42", "} 1")
    gpu = PciAddress(0, 0x3B, 0)
    f = findings_from_metrics(
        text, DcgmThresholds(node_name="testhost"), {"GPU-00000000-0000-0000-0000-000000000000": gpu}
    )
    assert [(x.gpu, x.kind) for x in f] == [(gpu, "dcgm_row_remap_failure")]
    unmapped = findings_from_metrics(text, DcgmThresholds())
    assert unmapped[0].gpu is None and unmapped[0].message.startswith("GPU-00000000-0000-0000-0000-000000000000: ")


def test_dcgm_blank_sentinels_and_warn_are_not_faults():
    text = _set_value(L4_TEXT, "DCGM_FI_DEV_ROW_REMAP_FAILURE", "9223372036854775794")
    text = _add_like(
        text,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_EXP_GPU_HEALTH_STATUS",
        ',health_error_code="x",health_watch="PCIE"',
        "10",
    )
    f = findings_from_metrics(text)
    assert [(x.severity, x.kind) for x in f] == [(Severity.INFO, "dcgm_health_warn")]


def test_dcgm_unreachable_informational_unless_required():
    with DcgmExporterStandIn("") as ex:
        addr = ex.address
        ex.status = 503
        f = dcgm_findings(DcgmThresholds(address=addr))
        assert [(x.severity, x.kind) for x in f] == [(Severity.INFO, "unavailable")] and "HTTP 503" in f[0].message
        f = dcgm_findings(DcgmThresholds(address=addr, required=True))
        assert [x.severity for x in f] == [Severity.UNCHECKED]
        ex.status = 200
        ex.text = "x" * 2000
        f = dcgm_findings(DcgmThresholds(address=addr, required=True, max_bytes=1000))
        assert "larger than 1000 bytes" in f[0].message
    f = dcgm_findings(DcgmThresholds(address=addr, required=True, timeout_s=2))  # closed: connection refused
    assert [x.severity for x in f] == [Severity.UNCHECKED]


def test_dcgm_parser_is_linear_on_hostile_input():
    evil = "DCGM_FI_DEV_ROW_REMAP_FAILURE{" + 'a="' + "\\" * 4000 + "\n"  # unterminated, escapes only
    huge = "DCGM_FI_DEV_ROW_REMAP_FAILURE{" + 'a="' + "x" * 200_000 + '"} 1\n'  # over the line bound: skipped
    line = 'DCGM_FI_DEV_ROW_REMAP_FAILURE{pci_bus_id="00000000:31:00.0"} 1\n'
    samples = parse_metrics(evil * 1000 + huge * 10 + line * 50_000)  # its time: bench/parsing.py
    assert len(samples) == 50_000


# -- the GPUDegraded reason in the verdict ---------------------------------------------------------------


def test_gpu_degraded_ranks_below_hard_faults_and_names_each_degradation(bridged: SimHost):
    bridged.set_link(bridged.gpus[1].address, current_width=8)
    obs = Observation(gpus={g.address: GpuIdentity(g.address, i, g.name) for i, g in enumerate(bridged.gpus)})
    obs.findings += pcie_findings(str(bridged.sysfs), addrs(bridged))
    tr = XidRateTracker()
    for at in (0.0, 60.0, 120.0):
        tr.observe(_xids(bridged, 13, gpu=1), at)
    obs.findings += tr.findings(120.0)
    v = decide(obs)
    assert (v.status, v.reason) == (Status.FALSE, Reason.GPU_DEGRADED)
    row = next(r for r in v.gpus if r.index == 1)
    assert row.problems == (
        "GPUDegraded: PCIe GPU link trained to x8, capable of x16",
        "GPUDegraded: Xid 13 repeated: 3 or more within 10 min (3 occurrences in the last window)",
    )
    hard = Finding.fault(Check.NVML, Reason.NVML_HEALTH, "GPU recovery action: GPU reset", bridged.gpus[0].address)
    obs.findings.append(hard)
    v = decide(obs)
    assert v.reason is Reason.NVML_HEALTH and v.reasons == (Reason.NVML_HEALTH, Reason.GPU_DEGRADED)
    obs.findings = [Finding.fault(Check.PCIE, Reason.GPU_DEGRADED, "x", bridged.gpus[0].address)]
    assert decide(obs, preflight_required=True, preflight_passed=False).reasons == (
        Reason.GPU_DEGRADED,
        Reason.PREFLIGHT_NOT_PASSED,
    )


# -- make gpu-smoke ------------------------------------------------------------------------------------


def test_gpu_smoke_without_gpus_says_so_and_exits_0(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("NVIDIA_SMI",)}
    # a PATH with the basics but no nvidia-smi, and no /dev/nvidia* under the dev root it looks at
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sh", "bash", "date", "mkdir", "uname", "ls", "cat", "env", "head", "tr", "sed"):
        p = shutil.which(tool)
        if p:
            (bindir / tool).symlink_to(p)
    env.update(PATH=str(bindir), GPU_SMOKE_DEV=str(tmp_path / "dev"), GPU_SMOKE_OUT=str(tmp_path / "out"))
    r = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu-smoke.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "no NVIDIA GPU here"
    assert not (tmp_path / "out").exists()


def test_gpu_smoke_nvidia_smi_without_devices(tmp_path: Path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    smi.chmod(0o755)
    env = dict(os.environ, NVIDIA_SMI=str(smi), GPU_SMOKE_OUT=str(tmp_path / "out"))
    r = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu-smoke.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "nvidia-smi -L (exit 6): No devices were found",
        "no NVIDIA GPU here",
    ]
    assert not (tmp_path / "out").exists()


def test_gpu_smoke_make_target_exists():
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-smoke:.*$", mk, flags=re.MULTILINE) and "tools/gpu-smoke.sh" in mk
    assert sys.executable  # the script runs gpu-ready through the venv's python when present


# -- wiring: settings, the check suite, the kernel-log ingest, `gpu-ready check` -------------------------


def _suite_cfg(host: SimHost, **over: object):
    from agent import config

    base = {
        "nvidia_smi": str(host.nvidia_smi),
        "sysfs_root": str(host.sysfs),
        "kmsg": str(host.kmsg),
        "nvml": "on",
        "dev_root": str(host.make_dev_nodes()),
        "proc_root": str(host.proc),
    }
    return config.defaults(**{**base, **over})


def _nv_states(host: SimHost, **extra: object) -> list[dict]:
    return [{"busId": g.address.nvml, **extra} for g in host.gpus]


def _run(suite, node=None):
    obs, stats = suite.run(node)
    return obs, stats, decide(obs)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--pcie-busy-utilization", "101"),
        ("--clock-max-slowed-share", "1"),
        ("--clock-window", "nan"),
        ("--clock-min-samples", "0"),
        ("--thermal-margin-min", "hot"),
        ("--xid-rate-count", "0"),
        ("--xid-rate-window", "-5"),
        ("--xid-rate-ignore", "13,-1"),
        ("--dcgm-exporter", "ftp://x:9400"),
        ("--dcgm-exporter", ":9400"),
        ("--dcgm-timeout", "0"),
        ("--pcie", "maybe"),
    ],
)
def test_bad_degradation_setting_is_one_line_and_exit_2(flag: str, value: str, simhost: SimHost, capsys):
    from agent.cli import main as cli_main

    assert cli_main(["check", *simhost.check_args(), flag, value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"invalid {flag[2:]} ({flag})" in err, err


def test_degradation_settings_from_a_file_and_their_defaults(tmp_path: Path):
    from agent import config

    d = config.defaults()
    assert (d.pcie, d.pcie_bridges, d.pcie_speed, d.pcie_busy_utilization) == (True, True, True, 50)
    assert (d.device_nodes, d.dev_root, d.require_uvm, d.proc_root) == (True, "/dev", True, "/proc")
    assert (d.clock_events, d.clock_window, d.clock_max_slowed_share, d.clock_min_samples) == (True, 600, 0.3, 5)
    assert d.thermal_margin_min is None and (d.xid_rate, d.xid_rate_count, d.xid_rate_window) == (True, 3, 600)
    assert d.xid_rate_ignore == (45,) and (d.dcgm_exporter, d.dcgm_required, d.dcgm_timeout) == (None, False, 5)
    f = tmp_path / "c.yaml"
    f.write_text("xidRateCount: 5\nxidRateIgnore: [45, 13]\ndcgmExporter: 10.0.0.5:9400\nthermalMarginMin: 3\n")
    c = config.load(None, environ={"GPU_READY_CONFIG": str(f), "GPU_READY_PCIE_SPEED": "false"})
    assert (c.xid_rate_count, c.xid_rate_ignore, c.thermal_margin_min, c.pcie_speed) == (5, (45, 13), 3.0, False)
    assert c.dcgm_exporter == "http://10.0.0.5:9400/metrics"
    f.write_text("clockMaxSlowedShare: 1.0\n")
    with pytest.raises(config.ConfigError, match=r"clock-max-slowed-share \(clockMaxSlowedShare in .*c.yaml\)"):
        config.load(None, environ={"GPU_READY_CONFIG": str(f)})


def test_suite_healthy_host_runs_every_signal_and_reports_true(simhost: SimHost):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    nv = fake_nvml(_nv_states(simhost, util=90, throttle=0x1, margin=30.0))
    suite = CheckSuite(_suite_cfg(simhost, thermal_margin_min=5.0), NvmlProbe("on", nvml=nv))
    _obs, stats, v = _run(suite)
    assert (v.status, v.reason) == (Status.TRUE, Reason.GPUS_HEALTHY), v.message
    assert {"pcie", "device_nodes", "clocks", "xid_rate"} <= {str(c) for c in stats.durations} and not stats.failed
    assert "dcgm" not in {str(c) for c in stats.durations}  # opt-in: off without an address


def test_suite_pcie_speed_only_under_load_and_width_always(bridged: SimHost):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    bridged.set_link(bridged.gpus[1].address, current_gts=8.0)  # Gen3 on a Gen5 link: normal at idle
    states = _nv_states(bridged, util=0)
    suite = CheckSuite(_suite_cfg(bridged), NvmlProbe("on", nvml=fake_nvml(states)))
    assert _run(suite)[2].status is Status.TRUE
    states[1]["util"] = 95  # busy: the same link speed is now a degradation
    v = _run(suite)[2]
    assert (v.status, v.reason) == (Status.FALSE, Reason.GPU_DEGRADED)
    assert v.gpus[1].problems == (
        "GPUDegraded: PCIe GPU link at Gen3 (8 GT/s) under load (95% busy), capable of Gen5 (32 GT/s)",
    )
    off = CheckSuite(_suite_cfg(bridged, pcie_speed=False), NvmlProbe("on", nvml=fake_nvml(states)))
    assert _run(off)[2].status is Status.TRUE
    assert off.probe(Check.NVML).read_load is False  # nothing read that nothing judges
    bridged.set_link(bridged.upstream_bridge(2), current_width=4)  # width: at any load, naming the bridge
    v = _run(off)[2]
    assert v.reason is Reason.GPU_DEGRADED and "upstream bridge 0000:00:03.0 trained to x4" in v.gpus[2].problems[0]
    assert _run(CheckSuite(_suite_cfg(bridged, pcie=False), NvmlProbe("on", nvml=fake_nvml(states))))[2].status is (
        Status.TRUE
    )


def test_suite_reads_device_minors_again_only_when_the_pci_scan_changes(simhost: SimHost, monkeypatch):
    import agent.checks as checks
    import agent.probes.device_nodes as device_nodes
    from agent.probes.nvml import NvmlProbe

    calls: list[int] = []
    monkeypatch.setattr(device_nodes, "read_minor_numbers", lambda root, gpus: calls.append(len(gpus)) or {})
    suite = checks.CheckSuite(_suite_cfg(simhost), NvmlProbe("on", nvml=fake_nvml(_nv_states(simhost))))
    _run(suite)
    _run(suite)
    assert calls == [8, 8]  # the driver's file gave no minor (still loading): read again next cycle
    real = read_minor_numbers
    monkeypatch.setattr(
        device_nodes, "read_minor_numbers", lambda root, gpus: calls.append(len(gpus)) or real(root, gpus)
    )
    calls.clear()
    for _ in range(3):
        assert _run(suite)[2].status is Status.TRUE
    assert calls == [8]  # complete: kept while the PCI functions stay
    simhost.bind_vfio(simhost.gpus[7].address)
    _run(suite)
    assert calls == [8, 7]


def test_suite_clock_tracker_is_kept_across_cycles_and_clears(simhost: SimHost):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    now = [0.0]
    states = _nv_states(simhost, throttle=0)
    suite = CheckSuite(
        _suite_cfg(simhost, clock_window=100.0), NvmlProbe("on", nvml=fake_nvml(states)), clock=lambda: now[0]
    )
    states[3]["throttle"] = 0x40  # HW thermal slowdown on GPU 3, every sample
    seen = []
    for i in range(6):
        now[0] = 10.0 * i
        seen.append(_run(suite)[2].reason)
    assert seen[:4] == [Reason.GPUS_HEALTHY] * 4  # fewer than clockMinSamples samples: not judged
    assert seen[4:] == [Reason.GPU_DEGRADED] * 2
    v = _run(suite)[2]
    assert v.gpus[3].problems[0].startswith("GPUDegraded: clocks slowed by HW thermal slowdown in 7 of 7 samples")
    states[3]["throttle"] = 0
    for i in range(7, 20):  # the slowed samples leave the 100 s window
        now[0] = 10.0 * i
        v = _run(suite)[2]
    assert v.status is Status.TRUE
    states[3]["throttle_error"] = 999  # reasons unreadable: could not check, never True
    _obs, stats, v = _run(suite)
    assert v.status is Status.UNKNOWN and Check.CLOCKS in stats.failed
    assert "clocks: clock event reasons: NVML error 999" in v.message


def test_suite_thermal_margin_and_nvml_off(simhost: SimHost):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    states = _nv_states(simhost, margin=20.0)
    states[6]["margin"] = 2.0
    v = _run(CheckSuite(_suite_cfg(simhost, thermal_margin_min=3.0), NvmlProbe("on", nvml=fake_nvml(states))))[2]
    assert v.reason is Reason.GPU_DEGRADED and v.gpus[6].problems == (
        "GPUDegraded: thermal margin 2 C, at or below 3 C",
    )
    # NVML off: the NVML-based signals have nothing to judge; not a failure, not a fault.
    _obs, stats, v = _run(CheckSuite(_suite_cfg(simhost, nvml="off", thermal_margin_min=3.0)))
    assert v.status is Status.TRUE and not stats.failed


def test_suite_device_nodes_missing_unreadable_and_minors(simhost: SimHost, tmp_path: Path):
    from agent.checks import CheckSuite

    cfg = _suite_cfg(simhost, nvml="off")
    simhost.remove_dev_node("nvidia5")
    v = _run(CheckSuite(cfg))[2]
    assert v.reason is Reason.GPU_DEGRADED and v.gpus[5].problems == (
        f"GPUDegraded: device node {simhost.dev}/nvidia5 is missing",
    )
    simhost.make_dev_nodes()
    simhost.remove_dev_node("nvidia-uvm")
    v = _run(CheckSuite(cfg))[2]
    assert v.reason is Reason.GPU_DEGRADED and f"{simhost.dev}/nvidia-uvm is missing" in v.message
    assert all(g.healthy for g in v.gpus)  # a node-level degradation names no GPU
    assert _run(CheckSuite(_suite_cfg(simhost, nvml="off", require_uvm=False)))[2].status is Status.TRUE
    _obs, stats, v = _run(CheckSuite(_suite_cfg(simhost, nvml="off", dev_root=str(tmp_path / "absent"))))
    assert v.status is Status.UNKNOWN and Check.DEVICE_NODES in stats.failed
    # Minor numbers not known (no driver procfs): as many /dev/nvidia<N> as GPUs are required instead.
    simhost.make_dev_nodes()
    nominor = CheckSuite(_suite_cfg(simhost, nvml="off", proc_root=str(tmp_path / "noproc")))
    assert _run(nominor)[2].status is Status.TRUE
    simhost.remove_dev_node("nvidia7")
    v = _run(nominor)[2]
    assert v.reason is Reason.GPU_DEGRADED and "7 GPU device nodes" in v.message and "for 8 GPUs" in v.message


def test_device_nodes_partial_minors_counts_only_the_rest(simhost: SimHost):
    simhost.make_dev_nodes(skip=("nvidia6",))
    minors = {g.address: g.minor for g in simhost.gpus[:4]}  # only GPUs 0-3 have a known minor
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    f = device_node_findings(t, minors=minors, gpu_count=8)
    assert [x.message for x in f] == [
        f"3 GPU device nodes {simhost.dev}/nvidia<N> for 4 GPUs more (minor numbers known for 4) (present: 4, 5, 7)"
    ]
    simhost.make_dev_nodes()
    assert device_node_findings(t, minors=minors, gpu_count=8) == []


def test_suite_dcgm_maps_by_nvml_uuid_and_required_unreachable(simhost: SimHost):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    states = _nv_states(simhost)
    nv = fake_nvml(states)
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-{h:08d}-0000-0000-0000-000000000000".encode()
    text = (
        'DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="2",UUID="GPU-00000002-0000-0000-0000-000000000000",'
        'pci_bus_id="",Hostname="n1"} 1\n'
        'DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="3",UUID="GPU-00000003-0000-0000-0000-000000000000",'
        'pci_bus_id="",Hostname="other-node"} 1\n'
    )
    with DcgmExporterStandIn(text) as ex:
        suite = CheckSuite(_suite_cfg(simhost, dcgm_exporter=ex.address, node_name="n1"), NvmlProbe("on", nvml=nv))
        v = _run(suite)[2]
        assert ex.requests == 1
    assert v.reason is Reason.GPU_DEGRADED and v.gpus[2].problems == ("GPUDegraded: DCGM: row remapping failed",)
    assert v.gpus[3].problems == ()  # another host's series
    gone = ex.address  # closed: unreachable
    v = _run(CheckSuite(_suite_cfg(simhost, nvml="off", dcgm_exporter=gone)))[2]
    assert v.status is Status.TRUE  # not required: informational
    _obs, stats, v = _run(CheckSuite(_suite_cfg(simhost, nvml="off", dcgm_exporter=gone, dcgm_required=True)))
    assert v.status is Status.UNKNOWN and Check.DCGM in stats.failed and "dcgm-exporter" in v.message


def test_every_signal_can_be_switched_off(bridged: SimHost, tmp_path: Path):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    bridged.set_link(bridged.gpus[0].address, current_width=8)
    states = _nv_states(bridged, throttle=0x8, margin=0.0)
    off = _suite_cfg(
        bridged,
        pcie=False,
        device_nodes=False,
        dev_root=str(tmp_path / "absent"),
        clock_events=False,
        xid_rate=False,
        thermal_margin_min=5.0,
    )
    suite = CheckSuite(off, NvmlProbe("on", nvml=fake_nvml(states)))
    suite.xid_rate.observe(_xids(bridged, 13, n=5), 0.0)
    for _ in range(6):
        _obs, stats, v = _run(suite)
    assert v.status is Status.TRUE, v.message
    assert not {"pcie", "device_nodes", "clocks", "xid_rate", "dcgm"} & {str(c) for c in stats.durations}
    nv = suite.probe(Check.NVML)
    assert (nv.read_load, nv.read_clocks, nv.read_uuids) == (False, False, False)


def test_place_events_device_and_file_stamps():
    from agent.kernel_log.watcher import place_events
    from agent.model import XidEvent

    def ev(usec):
        return XidEvent(13, PciAddress(0, 0x3B, 0), "0000:3b:00", False, "", usec=usec)

    evs = [ev(1_000_000_000), ev(1_590_000_000), ev(None)]
    # /dev/kmsg: ages from the monotonic clock's present (here 1600 s after boot), on the caller's clock.
    placed = place_events(evs, device=True, now=50.0, kernel_now_s=1600.0)
    assert [round(t, 3) for _, t in placed] == [50.0 - 600.0, 50.0 - 10.0, 50.0]
    # A file: ages relative to the newest record read; a stamp after the present is 0 s old.
    placed = place_events(evs, device=False, now=50.0, newest_usec=1_600_000_000)
    assert [round(t, 3) for _, t in placed] == [-550.0, 40.0, 50.0]
    assert [t for _, t in place_events(evs, device=True, now=5.0, kernel_now_s=1.0)] == [5.0, 5.0, 5.0]


def test_ingest_feeds_the_rate_at_kernel_log_time_and_history_is_not_new(tmp_path: Path):
    from agent.kernel_log.source import KmsgSource, format_record
    from agent.kernel_log.watcher import KernelLogIngest
    from agent.report.metrics import Metrics
    from agent.state import LatchState

    host = SimHost(tmp_path / "h", gpus=2)
    line13, line79 = host.xid_line(13, 1), host.xid_line(79, 0)
    log = tmp_path / "kmsg"
    # Three Xid 13 an hour before the newest record (history), a fatal Xid 79, then the present.
    log.write_text(
        "".join(format_record(line13, i, 1_000_000 + i) for i in range(3))
        + format_record(line79, 3, 3_601_000_000)
        + format_record("usb 1-1: new device", 4, 3_602_000_000)
    )
    tracker = XidRateTracker()
    state = LatchState(str(tmp_path / "state"), "boot")
    ingest = KernelLogIngest(KernelLogParser(), state, Metrics(), rate=tracker, clock=lambda: 10_000.0)
    src = KmsgSource(str(log))
    fresh = [e for recs in src.drain() for e in ingest.process(recs, device=src.is_device)]
    assert [e.xid for e in fresh] == [79]  # fatal: latched, not counted by the rate
    assert tracker.findings(10_000.0) == []  # an hour old: outside the 10 minute window
    with open(log, "a") as fh:  # the same Xid three times now, seconds apart (three occurrences): degraded
        fh.write("".join(format_record(line13, 5 + i, 3_603_000_000 + i * 2_000_000) for i in range(3)))
    for recs in src.drain():
        ingest.process(recs, device=src.is_device)
    f = tracker.findings(10_000.0)
    assert [(x.gpu, x.kind) for x in f] == [(host.gpus[1].address, "xid_rate")]
    assert tracker.findings(10_000.0 + 601) == []  # a clean window: cleared, never latched


def test_check_reads_the_xid_rate_and_shows_degradations_per_gpu(bridged: SimHost):
    bridged.set_link(bridged.upstream_bridge(3), current_width=8)
    bridged.make_dev_nodes()
    for _ in range(3):
        bridged.append_xid(31, 1, "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000", apart_s=2.0)
    r = subprocess.run(
        [sys.executable, "-m", "agent", "check", *bridged.check_args()], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line[:1].isdigit()}
    assert "UNHEALTHY GPUDegraded: Xid 31 repeated: 3 or more within 10 min" in rows["1"]
    assert "UNHEALTHY GPUDegraded: PCIe upstream bridge 0000:00:04.0 trained to x8, capable of x16" in rows["3"]
    assert "GPUReady=False  reason=GPUDegraded" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "agent", "check", *bridged.check_args(), "--xid-rate-count", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Xid 31 repeated" not in r.stdout and "trained to x8" in r.stdout


def test_nvml_reads_degradation_inputs_only_when_asked_and_under_its_deadline(simhost: SimHost):
    from agent.checks import CheckSuite
    from agent.probes.nvml import NvmlProbe

    states = _nv_states(simhost, util=77, throttle=0x80, margin=12.0)
    nv = fake_nvml(states)
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-{h}".encode()
    _f, snap = NvmlProbe("on", nvml=nv).sample()
    assert snap is not None and all(g.load is None and g.clock is None and g.uuid is None for g in snap.gpus)
    _f, snap = NvmlProbe("on", nvml=nv, pcie_load=True, clock_events=True, uuids=True).sample()
    g = snap.gpus[2]
    assert (g.load.utilization_pct, g.load.current_gen, g.load.max_gen) == (77, 5, 5)
    assert (g.clock.mask, g.clock.margin_c, g.uuid) == (0x80, 12.0, "GPU-2")
    # A clock read that never returns: NVML is reported hung (a hard fault), the tracker keeps its history.
    now = [0.0]
    suite = CheckSuite(
        _suite_cfg(simhost, nvml_timeout=0.3),
        NvmlProbe("on", 0.3, nvml=fake_nvml(states, hang="nvmlDeviceGetCurrentClocksEventReasons")),
        clock=lambda: now[0],
    )
    suite.probe(Check.CLOCKS).tracker.observe(simhost.gpus[0].address, ClockSample(0x8), -1.0)
    _obs, _stats, v = _run(suite)
    assert v.reason is Reason.NVML_HEALTH and "NVML hung" in v.message
    assert len(suite.probe(Check.CLOCKS).tracker._gpus[simhost.gpus[0].address].samples) == 1
