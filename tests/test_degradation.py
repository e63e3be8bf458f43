"""Silent degradation signals (issue 18) on the simulated host: PCIe link training, device nodes, clock
events, Xid rate, the dcgm-exporter cross-check, the GPUDegraded reason, and `make gpu-smoke` without GPUs.
Each signal: healthy, degraded, cannot-check."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.model import Check, Finding, GpuIdentity, Observation, PciAddress, Reason, Severity, Status
from agent.probes.clocks import ClockEventTracker, ClockThresholds, nvml_clock_sample
from agent.probes.dcgm import (
    DcgmThresholds,
    findings_from_metrics,
    parse_labels,
    parse_metrics,
    probe_dcgm,
)
from agent.probes.device_nodes import DeviceNodeThresholds, probe_device_nodes, read_minor_numbers
from agent.probes.pcie import GpuLoad, PcieThresholds, nvml_pcie_load, probe_pcie
from agent.probes.xid_rate import XidRateThresholds, XidRateTracker
from agent.verdict import decide
from agent.xid import KernelLogParser
from testkit.simhost import DcgmExporterStandIn, SimHost
from tests.conftest import fixture_path
from tests.fakes import fake_nvml

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
    assert probe_pcie(str(bridged.sysfs), addrs(bridged)) == []
    busy = {a: GpuLoad(utilization_pct=100, current_gen=5, max_gen=5) for a in addrs(bridged)}
    assert probe_pcie(str(bridged.sysfs), addrs(bridged), load=busy) == []


def test_pcie_width_downtrained_on_gpu_names_the_link(bridged: SimHost):
    gpu = bridged.gpus[2].address
    bridged.set_link(gpu, current_width=8)
    f = probe_pcie(str(bridged.sysfs), addrs(bridged))
    assert [(x.gpu, x.kind, x.reason) for x in f] == [(gpu, "pcie_width", Reason.GPU_DEGRADED)]
    assert f[0].message == "PCIe GPU link trained to x8, capable of x16"
    # the bridge above sees the same link from its end: reported once, not twice
    bridged.set_link(bridged.upstream_bridge(2), current_width=8)
    assert len(probe_pcie(str(bridged.sysfs), addrs(bridged))) == 1


def test_pcie_width_downtrained_on_upstream_bridge(tmp_path: Path):
    host = SimHost(tmp_path / "h", gpus=2, pcie_bridges=True)
    # the bridge above GPU 1 reports its link narrower than both of its ends can do
    bridge = host.upstream_bridge(1)
    host.set_link(bridge, current_width=4, max_width=16)
    f = probe_pcie(str(host.sysfs), addrs(host))
    assert len(f) == 1 and f[0].gpu == host.gpus[1].address
    assert f[0].message == f"PCIe upstream bridge {host.sysfs_name(bridge)} trained to x4, capable of x16"
    assert probe_pcie(str(host.sysfs), addrs(host), PcieThresholds(check_bridges=False)) == []


def test_pcie_narrower_partner_is_no_alarm(bridged: SimHost):
    # an x16-capable GPU under an x8 port runs at x8 by design of the slot, not by downtraining
    bridged.set_link(bridged.upstream_bridge(0), current_width=8, max_width=8)
    bridged.set_link(bridged.gpus[0].address, current_width=8, max_width=16)
    assert probe_pcie(str(bridged.sysfs), addrs(bridged)) == []


def test_pcie_speed_is_judged_only_under_load(bridged: SimHost):
    gpu = bridged.gpus[1].address
    bridged.set_link(gpu, current_gts=2.5)  # idle GPUs drop to Gen1 (ASPM): no alarm at idle
    bridged.set_link(bridged.upstream_bridge(1), current_gts=2.5)
    assert probe_pcie(str(bridged.sysfs), addrs(bridged)) == []
    idle = {gpu: GpuLoad(utilization_pct=3)}
    assert probe_pcie(str(bridged.sysfs), addrs(bridged), load=idle) == []
    busy = {gpu: GpuLoad(utilization_pct=97)}
    f = probe_pcie(str(bridged.sysfs), addrs(bridged), load=busy)
    assert [(x.gpu, x.kind) for x in f] == [(gpu, "pcie_speed")]
    assert f[0].message == "PCIe GPU link at Gen1 (2.5 GT/s) under load (97% busy), capable of Gen5 (32 GT/s)"
    assert probe_pcie(str(bridged.sysfs), addrs(bridged), PcieThresholds(check_speed=False), load=busy) == []


def test_pcie_nvml_generation_under_load(bridged: SimHost):
    gpu = bridged.gpus[0].address
    nv = fake_nvml([{"busId": gpu.nvml, "util": 88, "pcie_gen": 5, "pcie_gen_cur": 3}])
    load = nvml_pcie_load(nv, 0)
    assert load == GpuLoad(utilization_pct=88, current_gen=3, max_gen=5, current_width=16, max_width=16)
    f = probe_pcie(str(bridged.sysfs), [gpu], load={gpu: load})
    assert [x.kind for x in f] == ["pcie_gen"] and "Gen3 under load (88% busy), capable of Gen5" in f[0].message
    idle = nvml_pcie_load(fake_nvml([{"busId": gpu.nvml, "util": 0, "pcie_gen_cur": 1}]), 0)
    assert probe_pcie(str(bridged.sysfs), [gpu], load={gpu: idle}) == []
    # utilisation not supported: speed is not judged at all
    unknown = nvml_pcie_load(fake_nvml([{"busId": gpu.nvml, "pcie_gen_cur": 1}]), 0)
    assert unknown.utilization_pct is None and probe_pcie(str(bridged.sysfs), [gpu], load={gpu: unknown}) == []


def test_pcie_cannot_check(bridged: SimHost, tmp_path: Path):
    gpu = bridged.gpus[3].address
    (bridged.devices / bridged.sysfs_name(gpu) / "current_link_width").write_text("garbage\n")
    f = probe_pcie(str(bridged.sysfs), addrs(bridged))
    assert [(x.severity, x.gpu, x.kind) for x in f] == [(Severity.UNCHECKED, gpu, "unreadable")]
    assert "current_link_width: cannot parse 'garbage'" in f[0].message
    missing = probe_pcie(str(tmp_path / "nosys"), addrs(bridged))
    assert [x.severity for x in missing] == [Severity.UNCHECKED]


def test_pcie_fields_not_exposed_is_informational(simhost: SimHost):
    gpu = simhost.gpus[0].address
    simhost.set_link(gpu, None, None, None, None)
    f = probe_pcie(str(simhost.sysfs), [gpu])
    assert [(x.severity, x.kind) for x in f] == [(Severity.INFO, "not_exposed")]


def test_pcie_real_kernel_speed_formats(simhost: SimHost):
    gpu = simhost.gpus[0].address
    d = simhost.devices / simhost.sysfs_name(gpu)
    (d / "current_link_speed").write_text("8 GT/s\n")  # pre-5.x kernels print no decimals and no "PCIe"
    (d / "max_link_speed").write_text("16.0 GT/s PCIe\n")
    f = probe_pcie(str(simhost.sysfs), [gpu], load={gpu: GpuLoad(utilization_pct=60)})
    assert [x.kind for x in f] == ["pcie_speed"] and "Gen3 (8 GT/s)" in f[0].message
    (d / "current_link_speed").write_text("Unknown\n")  # unknown speed: width still judged, speed not
    assert probe_pcie(str(simhost.sysfs), [gpu], load={gpu: GpuLoad(utilization_pct=60)}) == []


# -- device nodes -------------------------------------------------------------------------------------


def _minors(host: SimHost) -> dict[PciAddress, int]:
    return read_minor_numbers(str(host.proc), addrs(host))


def test_device_nodes_healthy(simhost: SimHost):
    simhost.make_dev_nodes(mig=True)
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    assert _minors(simhost) == {g.address: g.minor for g in simhost.gpus}
    assert probe_device_nodes(t, minors=_minors(simhost), mig_enabled=True) == []
    assert probe_device_nodes(t, gpu_count=8) == []


def test_device_nodes_missing_uvm_and_gpu_node(simhost: SimHost):
    simhost.make_dev_nodes(skip=("nvidia-uvm", "nvidia3"))
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    f = probe_device_nodes(t, minors=_minors(simhost))
    assert [(x.reason, x.gpu, x.kind) for x in f] == [
        (Reason.GPU_DEGRADED, None, "missing"),
        (Reason.GPU_DEGRADED, simhost.gpus[3].address, "missing"),
    ]
    assert f[0].message == f"device node {simhost.dev}/nvidia-uvm is missing (CUDA programs fail without it)"
    assert f[1].message == f"device node {simhost.dev}/nvidia3 is missing"
    counted = probe_device_nodes(t, gpu_count=8)
    assert any("7 GPU device nodes" in x.message and "0, 1, 2, 4, 5, 6, 7" in x.message for x in counted)
    assert probe_device_nodes(DeviceNodeThresholds(dev_root=str(simhost.dev), require_uvm=False)) == []


def test_device_nodes_not_a_character_device_and_mig_caps(simhost: SimHost):
    simhost.make_dev_nodes()
    simhost.replace_dev_node_with_file("nvidiactl")
    t = DeviceNodeThresholds(dev_root=str(simhost.dev))
    f = probe_device_nodes(t, minors=_minors(simhost), mig_enabled=True)
    assert [x.kind for x in f] == ["not_char", "missing"]
    assert "nvidiactl is not a character device" in f[0].message
    assert (
        f[1].message
        == f"device node directory {simhost.dev}/nvidia-caps is missing (MIG is on; MIG devices cannot be opened)"
    )


def test_device_nodes_cannot_check(tmp_path: Path):
    f = probe_device_nodes(DeviceNodeThresholds(dev_root=str(tmp_path / "nodev")), gpu_count=1)
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
    assert f[0].message == "Xid 31 repeated: 3 or more within 10 min (3 in the last window)"
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
        assert probe_dcgm(DcgmThresholds(address=ex.address, node_name="i-030791dc5a37cd257")) == []
        assert ex.requests == 1
    assert probe_dcgm(DcgmThresholds()) == []  # off unless an address is set


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
            f = probe_dcgm(DcgmThresholds(address=ex.address, node_name="i-030791dc5a37cd257"))
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
        f = probe_dcgm(DcgmThresholds(address=addr))
        assert [(x.severity, x.kind) for x in f] == [(Severity.INFO, "unavailable")] and "HTTP 503" in f[0].message
        f = probe_dcgm(DcgmThresholds(address=addr, required=True))
        assert [x.severity for x in f] == [Severity.UNCHECKED]
        ex.status = 200
        ex.text = "x" * 2000
        f = probe_dcgm(DcgmThresholds(address=addr, required=True, max_bytes=1000))
        assert "larger than 1000 bytes" in f[0].message
    f = probe_dcgm(DcgmThresholds(address=addr, required=True, timeout_s=2))  # closed: connection refused
    assert [x.severity for x in f] == [Severity.UNCHECKED]


def test_dcgm_parser_is_linear_on_hostile_input():
    evil = "DCGM_FI_DEV_ROW_REMAP_FAILURE{" + 'a="' + "\\" * 4000 + "\n"  # unterminated, escapes only
    huge = "DCGM_FI_DEV_ROW_REMAP_FAILURE{" + 'a="' + "x" * 200_000 + '"} 1\n'  # over the line bound: skipped
    line = 'DCGM_FI_DEV_ROW_REMAP_FAILURE{pci_bus_id="00000000:31:00.0"} 1\n'
    t0 = time.monotonic()
    samples = parse_metrics(evil * 1000 + huge * 10 + line * 50_000)
    assert len(samples) == 50_000 and time.monotonic() - t0 < 20


# -- the GPUDegraded reason in the verdict ---------------------------------------------------------------


def test_gpu_degraded_ranks_below_hard_faults_and_names_each_degradation(bridged: SimHost):
    bridged.set_link(bridged.gpus[1].address, current_width=8)
    obs = Observation(gpus={g.address: GpuIdentity(g.address, i, g.name) for i, g in enumerate(bridged.gpus)})
    obs.findings += probe_pcie(str(bridged.sysfs), addrs(bridged))
    tr = XidRateTracker()
    tr.observe(_xids(bridged, 13, gpu=1, n=3), 0.0)
    obs.findings += tr.findings(0.0)
    v = decide(obs)
    assert (v.status, v.reason) == (Status.FALSE, Reason.GPU_DEGRADED)
    row = next(r for r in v.gpus if r.index == 1)
    assert row.problems == (
        "GPUDegraded: PCIe GPU link trained to x8, capable of x16",
        "GPUDegraded: Xid 13 repeated: 3 or more within 10 min (3 in the last window)",
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
