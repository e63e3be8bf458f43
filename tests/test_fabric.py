"""The NVLink fabric (agent/probes/fabric.py), the fabric manager (agent/probes/fabric_manager.py) and IMEX
(agent/probes/imex.py): the Fabric blocks of real `nvidia-smi -q` captures (tests/fixtures, provenance in SOURCES.md)
and variants derived from them line by line, NVML's fabric structure (the library's own ctypes structure, filled by
the NVML stand-in as the driver fills it), the simulated host's NVSwitches and nvidia-smi stand-in, through the
check suite, `check --json`, and the real agent against the real apiserver."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from agent import config
from agent.checks import CheckSuite, combine
from agent.model import Check, PciAddress, Reason, Severity, Status
from agent.probes.base import ProbeContext
from agent.probes.fabric import FabricProbe, FabricReport, decode_health, fabric_findings, parse_smi_q
from agent.probes.fabric_manager import FabricManagerProbe, FabricManagerReport
from agent.probes.imex import ImexProbe
from agent.probes.nvml import NvmlProbe
from agent.verdict import decide
from testkit.fakes import fake_nvml
from testkit.fixture_files import FIXTURES
from testkit.harness import wait_for
from testkit.simhost import SimHost

HGX_H100 = FIXTURES / "smi-q-535.161.08-gpud-fixture.txt"  # 8x H100 80GB HBM3 (NVSwitch system), Completed
H200_590 = FIXTURES / "smi-q-h200-590.48.01-nvgpuexp-capture.txt"  # 590 layout: CliqueId, ClusterUUID, Health
NO_FABRIC = (
    FIXTURES / "smi-q-560.35.03-gpud-fixture.txt",  # TITAN V: State N/A
    FIXTURES / "smi-q-a10-535.129.03-gpud-fixture.txt",  # A10 (PCIe): State N/A
    FIXTURES / "smi-q-rtx4090x8-535.154.05-gpud-fixture.txt",  # 8x RTX 4090: State N/A
)
GB200_CLUSTER = bytes.fromhex("5f0c5d2a8e2b4c1f9a7d3e6b1c2d3e4f")


def derived(path, gpu: str, **fields: str) -> str:
    """The capture with the Fabric lines `fields` (State=..., Status=...) of GPU `gpu` replaced, every other line
    as captured: a variant of a real capture, not a capture."""
    out, current, in_fabric = [], None, False
    for line in path.read_text().splitlines():
        if line.startswith("GPU "):
            current = line[4:].strip()
        if line.strip() == "Fabric":
            in_fabric = True
        elif in_fabric and not line.startswith("        "):
            in_fabric = False
        key = line.split(":", 1)[0].strip()
        if in_fabric and current == gpu and key in fields:
            line = line.split(":", 1)[0] + ": " + fields[key]
        out.append(line)
    return "\n".join(out) + "\n"


# -- the Fabric block of real captures --------------------------------------------------------------------------


def test_the_hgx_h100_capture_has_a_completed_fabric_on_every_gpu():
    infos = parse_smi_q(HGX_H100.read_text())
    assert [a.nvml for a in infos] == [
        PciAddress(0, b, 0).nvml for b in (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)
    ]
    assert {(i.state, i.status) for i in infos.values()} == {("Completed", "Success")}
    assert fabric_findings(infos.values()) == []


def test_the_590_capture_reads_clique_cluster_and_health():
    (info,) = parse_smi_q(H200_590.read_text()).values()
    assert (info.state, info.status, info.clique_id) == ("Completed", "Success", 0)
    assert info.cluster_uuid == "00000000-0000-0000-0000-000000000000"
    assert info.health == {
        "Summary": "N/A",
        "Bandwidth": "N/A",
        "Route Recovery in progress": "N/A",
        "Route Unhealthy": "N/A",
        "Access Timeout Recovery": "N/A",
        "Incorrect Configuration": "N/A",
    }
    assert fabric_findings([info]) == []


@pytest.mark.parametrize("path", NO_FABRIC, ids=lambda p: p.name)
def test_systems_without_a_fabric_are_not_applicable(path):
    infos = parse_smi_q(path.read_text())
    assert infos and not any(i.applicable for i in infos.values())
    assert fabric_findings(infos.values()) == []


def test_fabric_in_progress_and_failed_are_not_ready_and_name_the_gpu():
    text = derived(HGX_H100, "00000000:3B:00.0", State="In Progress", Status="N/A")
    (f,) = fabric_findings(parse_smi_q(text).values())
    assert (f.reason, f.kind, f.gpu) == (Reason.FABRIC_NOT_READY, "fabric_not_ready", PciAddress(0, 0x3B, 0))
    assert f.message == "NVLink fabric state In Progress: CUDA cannot start on this GPU until it completes"
    text = derived(HGX_H100, "00000000:DB:00.0", Status="Insufficient Resources")
    (f,) = fabric_findings(parse_smi_q(text).values())
    assert (f.reason, f.kind, f.gpu) == (Reason.FABRIC_NOT_READY, "fabric_failed", PciAddress(0, 0xDB, 0))
    assert "Insufficient Resources" in f.message


def test_health_fields_degrade_or_stop():
    bw = derived(H200_590, "00000000:83:00.0", Bandwidth="Degraded", **{"Route Unhealthy": "True"})
    (f,) = fabric_findings(parse_smi_q(bw).values())
    assert (f.reason, f.kind) == (Reason.GPU_DEGRADED, "fabric_degraded")
    assert f.message == "NVLink fabric health: Bandwidth: Degraded, Route Unhealthy: True"
    wrong = derived(H200_590, "00000000:83:00.0", **{"Incorrect Configuration": "Insufficient NVLinks"})
    (f,) = fabric_findings(parse_smi_q(wrong).values())
    assert (f.reason, f.kind) == (Reason.FABRIC_NOT_READY, "fabric_misconfigured")


def test_the_parser_is_bounded_and_ignores_garbage():
    junk = "GPU 00000000:19:00.0\n    Fabric\n" + ("        State : " + "x" * 5000 + "\n") * 2000
    infos = parse_smi_q(junk)
    assert len(infos) == 1  # one GPU, its over-long value not taken as a state
    assert parse_smi_q("\x00\x1b garbage\n" * 100) == {}


# -- NVML's fabric structure ------------------------------------------------------------------------------------


def nvml_probe(gpus):
    p = NvmlProbe("on", nvml=fake_nvml(gpus))
    p.read_fabric = True
    return p


def fabric_via_nvml(gpus):
    ctx = ProbeContext()
    ctx.results[Check.NVML] = nvml_probe(gpus).read(ctx)
    return FabricProbe("auto", smi=None).read(ctx)


def gb200(n=4, **fabric):
    f = {"state": 3, "status": 0, "clique": 32766, "cluster": GB200_CLUSTER, "health": 0} | fabric
    return [{"busId": f"00000008:{b:02X}:00.0", "fabric": dict(f)} for b in range(1, n + 1)]


def test_gb200_nvl_with_a_clique_is_healthy_and_exports_clique_and_cluster():
    r = fabric_via_nvml(gb200())
    assert r.ran and r.findings == ()
    report = r.payload
    assert isinstance(report, FabricReport) and report.source == "nvml" and report.applicable
    assert {(g.clique_id, g.cluster_uuid) for g in report.gpus} == {(32766, "5f0c5d2a-8e2b-4c1f-9a7d-3e6b1c2d3e4f")}
    j = report.to_json()
    assert j["gpus"][0]["state"] == "Completed" and j["gpus"][0]["clique_id"] == 32766


def test_nvml_fabric_states_status_and_health_mask():
    r = fabric_via_nvml(gb200(2, state=2))
    assert [(f.reason, f.kind) for f in r.findings] == [(Reason.FABRIC_NOT_READY, "fabric_not_ready")] * 2
    r = fabric_via_nvml(gb200(1, status=23, clique=0))  # Insufficient Resources with clique 0: not a pass
    (f,) = r.findings
    assert f.kind == "fabric_failed" and "Insufficient Resources" in f.message and "clique 0" in f.message
    # degraded bandwidth (bits 0-1 = 1), route recovery false (bits 2-3 = 2), configuration None (bits 8-11 = 1)
    r = fabric_via_nvml(gb200(1, health=1 | 2 << 2 | 1 << 8))
    (f,) = r.findings
    assert (f.reason, f.message) == (Reason.GPU_DEGRADED, "NVLink fabric health: Bandwidth: Degraded")
    r = fabric_via_nvml(gb200(1, health=5 << 8))
    assert r.findings[0].kind == "fabric_misconfigured" and "Insufficient NVLinks" in r.findings[0].message
    assert decode_health(2 << 14) == {"Global Fabric Manager": "Disconnected"}


def test_nvml_not_supported_is_not_applicable_and_an_error_is_could_not_check():
    r = fabric_via_nvml([{"busId": "00000000:01:00.0"}])  # NOT_SUPPORTED: a PCIe GPU
    assert r.ran and r.findings == () and not r.payload.applicable
    r = fabric_via_nvml([{"busId": "00000000:01:00.0", "fabric_error": 999}])
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED
    assert decide(combine([r], None), []).status is Status.UNKNOWN


# -- nvidia-smi -q on the simulated host, the fabric manager, the suite -----------------------------------------


def suite_cfg(host: SimHost, **over):
    base = {"nvidia_smi": str(host.nvidia_smi), "sysfs_root": str(host.sysfs), "nvml": "off"}
    base |= {"dev_root": str(host.make_dev_nodes()), "proc_root": str(host.proc)}
    return config.defaults(**(base | over))


def run_suite(host: SimHost, **over):
    suite = CheckSuite(suite_cfg(host, **over))
    obs, stats = suite.run(None, one_shot=True)
    return suite, decide(obs, []), stats


def test_healthy_hgx_h100_with_nvswitches(simhost):
    simhost.set_smi_q(HGX_H100)  # the real capture; the simulated host has the same 8 bus ids and 4 NVSwitches
    suite, v, _ = run_suite(simhost)
    assert v.status is Status.TRUE, v.message
    fm = suite.results[Check.FABRIC_MANAGER].payload
    assert isinstance(fm, FabricManagerReport) and len(fm.nvswitches) == 4 and fm.judged
    assert fm.state == "fabric completed"
    assert simhost.smi_q_call_count() == 1  # one nvidia-smi -q per cycle, NVML being off


def test_fabric_in_progress_stops_work_and_the_fabric_manager_is_named(simhost):
    simhost.set_fabric("Completed", "Success")
    simhost.set_fabric("In Progress", "N/A", gpus=(2, 5))
    _, v, _ = run_suite(simhost)
    assert (v.status, v.reason) == (Status.FALSE, Reason.FABRIC_NOT_READY)
    assert "fabric manager not finished: 2 of 8 GPUs' NVLink fabric in progress (4 NVSwitches)" in v.message
    bad = {g.pci_bus_id for g in v.gpus if not g.healthy}
    assert bad == {simhost.gpus[2].address.nvml, simhost.gpus[5].address.nvml}


def test_fabric_manager_down_is_not_running(simhost):
    simhost.set_fabric("Not Started", "N/A")
    _, v, _ = run_suite(simhost)
    assert v.reason is Reason.FABRIC_NOT_READY
    assert "fabric manager not running: 8 of 8 GPUs' NVLink fabric not started (4 NVSwitches)" in v.message


def test_fabric_failed_is_not_ready(simhost):
    simhost.set_fabric("Completed", "Insufficient Resources", clique_id=0, gpus=(0,))
    _, v, _ = run_suite(simhost)
    assert v.reason is Reason.FABRIC_NOT_READY and "NVLink fabric failed: Insufficient Resources" in v.message


def test_fabric_manager_port(simhost):
    """On an NVSwitch system whose GPUs report no fabric state (the simulated default, as an A100 HGX), only the
    command port tells: a listener is running, a closed port is not."""
    suite, v, _ = run_suite(simhost)
    assert v.status is Status.TRUE
    assert not suite.results[Check.FABRIC_MANAGER].payload.judged  # said, not claimed healthy
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        suite, v, _ = run_suite(simhost, fabric_manager_address=f"127.0.0.1:{port}")
        assert v.status is Status.TRUE and suite.results[Check.FABRIC_MANAGER].payload.state == "running"
    _, v, _ = run_suite(simhost, fabric_manager_address=f"127.0.0.1:{port}")  # closed now
    assert v.reason is Reason.FABRIC_NOT_READY and f"fabric manager not running: 127.0.0.1:{port}" in v.message


def test_no_fabric_and_no_infiniband_reports_nothing(tmp_path):
    host = SimHost(tmp_path / "plain", extra_functions=False)  # no NVSwitch, no ConnectX, State N/A
    suite, v, _ = run_suite(host)
    assert v.status is Status.TRUE
    assert "fabric" not in v.message.lower() and "InfiniBand" not in v.message
    for check in (Check.FABRIC, Check.FABRIC_MANAGER, Check.INFINIBAND):
        assert suite.results[check].ran and suite.results[check].findings == ()
    assert not suite.results[Check.FABRIC].payload.applicable
    assert suite.results[Check.FABRIC_MANAGER].payload.nvswitches == []


def test_nvidia_smi_q_failing_is_could_not_check(simhost):
    simhost.set_smi_q(None, exit_code=15)
    _, v, stats = run_suite(simhost)
    assert v.status is Status.UNKNOWN and "nvidia-smi -q failed: exit code 15" in v.message
    assert "fabric" in stats.failed


def test_the_fabric_can_be_switched_off(simhost):
    simhost.set_fabric("Not Started", "N/A")
    suite, v, stats = run_suite(simhost, fabric="off", fabric_manager=False)
    assert v.status is Status.TRUE and simhost.smi_q_call_count() == 0
    assert suite.probe(Check.FABRIC) is None and "fabric" not in stats.durations


def test_nvml_mode_without_nvml_is_could_not_check(simhost):
    _, v, _ = run_suite(simhost, fabric="nvml")
    assert v.status is Status.UNKNOWN and "NVML was not read this cycle" in v.message


def test_the_fabric_manager_probe_alone_without_nvswitches(tmp_path):
    host = SimHost(tmp_path / "h", extra_functions=False)
    r = FabricManagerProbe(str(host.sysfs)).read(ProbeContext())
    assert r.ran and r.findings == () and r.payload.state == "not an NVSwitch system"


# -- IMEX -------------------------------------------------------------------------------------------------------


def imex(host: SimHost) -> ImexProbe:
    return ImexProbe(str(host.imex_ctl), 10.0)


def test_imex_ready_idle_not_ready_and_missing(simhost):
    simhost.set_imex("READY")
    r = imex(simhost).read(ProbeContext())
    assert r.ran and r.findings == ()
    simhost.set_imex("Connection refused: is the IMEX daemon running?", exit_code=1)
    r = imex(simhost).read(ProbeContext())
    assert r.ran and [(f.severity, f.kind) for f in r.findings] == [(Severity.INFO, "imex_idle")]  # idle: no fault
    simhost.set_imex("NOT_READY")
    (f,) = imex(simhost).read(ProbeContext()).findings
    assert (f.reason, f.message) == (Reason.GPU_DEGRADED, "IMEX daemon not ready: NOT_READY")
    simhost.set_imex("\x00\x1bgarbage")
    r = imex(simhost).read(ProbeContext())
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED
    simhost.set_imex(None)
    r = imex(simhost).read(ProbeContext())
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED


def test_imex_is_opt_in(simhost):
    suite, _, _ = run_suite(simhost)
    assert suite.probe(Check.IMEX) is None
    simhost.set_imex("NOT_READY")
    _, v, _ = run_suite(simhost, imex=True, imex_ctl=str(simhost.imex_ctl))
    assert v.reason is Reason.GPU_DEGRADED and "IMEX daemon not ready" in v.message


# -- check --json and the real agent ----------------------------------------------------------------------------


def test_check_json_shows_the_fabric_and_the_rails(simhost):
    simhost.set_fabric("Completed", "Success", clique_id=7, cluster_uuid="5f0c5d2a-8e2b-4c1f-9a7d-3e6b1c2d3e4f")
    simhost.set_ib_port("mlx5_0")
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", "--json", *simhost.check_args()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["multinode"]
    assert m["fabric"]["source"] == "nvidia-smi" and m["fabric"]["applicable"]
    assert {(g["clique_id"], g["cluster_uuid"]) for g in m["fabric"]["gpus"]} == {
        (7, "5f0c5d2a-8e2b-4c1f-9a7d-3e6b1c2d3e4f")
    }
    assert m["fabric_manager"] == {"nvswitches": 4, "judged": True, "state": "fabric completed"}
    (port,) = m["infiniband"]["ports"]
    assert port["device"] == "mlx5_0" and port["state"] == "ACTIVE" and port["counters"]["link_downed"] == 0
    assert m["imex"] is None


@pytest.mark.apiserver
def test_the_agent_reports_the_fabric_and_exports_clique_and_cluster(admin, agent_factory, simhost):
    simhost.set_fabric("Completed", "Success", clique_id=7, cluster_uuid="5f0c5d2a-8e2b-4c1f-9a7d-3e6b1c2d3e4f")
    a = agent_factory(extra={"--poll-interval": "0.5"})
    a.wait_status(admin, "True")
    labels: dict[str, str] = {
        "clique_id": "7",
        "cluster_uuid": "5f0c5d2a-8e2b-4c1f-9a7d-3e6b1c2d3e4f",
        "state": "Completed",
    }
    wait_for(lambda: a.metric("gpu_ready_fabric_info", labels) == 8, 20, what="the fabric info of 8 GPUs")
    assert a.metric("gpu_ready_fabric_manager_ready") == 1
    simhost.set_fabric("In Progress", "N/A", gpus=(4,))
    a.wait_status(admin, "False", "FabricNotReady")
    wait_for(lambda: "fabric manager not finished" in a.gpu_ready(admin)["message"], 10, what="the cause named")
    assert a.metric("gpu_ready_fabric_manager_ready") == 0


def test_without_a_fabric_nvidia_smi_q_is_not_run_every_poll(simhost):
    """The simulated default (State N/A, as PCIe GPUs and A100 HGX show): one -q, then none until the GPUs change or
    the refresh interval passes; a node with a fabric reads it every poll."""
    suite = CheckSuite(suite_cfg(simhost))
    clock = [0.0]
    suite.clock = lambda: clock[0]
    for t in (0.0, 30.0, 60.0):
        clock[0] = t
        suite.run(None)
    assert simhost.smi_q_call_count() == 1 and simhost.smi_call_count() == 3
    clock[0] = 700.0
    suite.run(None)
    assert simhost.smi_q_call_count() == 2
    simhost.set_fabric("Completed", "Success")  # seen at the next refresh, then read every poll
    for t in (710.0, 1299.0, 1301.0, 1330.0, 1360.0):
        clock[0] = t
        suite.run(None)
    assert simhost.smi_q_call_count() == 5


def test_not_supported_in_words_is_not_applicable():
    text = derived(H200_590, "00000000:83:00.0", State="Not Supported", Status="N/A")
    (info,) = parse_smi_q(text).values()
    assert not info.applicable and fabric_findings([info]) == []


def test_the_fabric_manager_could_not_check(tmp_path, simhost):
    host = SimHost(tmp_path / "h", extra_functions=False)
    devices = host.sysfs / "bus" / "pci" / "devices"
    moved = devices.rename(devices.with_name("devices.real"))
    devices.write_text("")  # there, but not a directory that lists (ENOTDIR)
    r = FabricManagerProbe(str(host.sysfs)).read(ProbeContext())
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED and "Not a directory" in r.findings[0].message
    devices.unlink()
    moved.rename(devices)
    r = FabricManagerProbe(str(simhost.sysfs), "no-such-host.invalid:6666").read(ProbeContext())
    assert (
        not r.ran and r.findings[0].severity is Severity.UNCHECKED and "no-such-host.invalid" in r.findings[0].message
    )


def test_no_gpu_listed_no_fabric_read(simhost):
    simhost.set_smi(output="No devices were found\n", exit_code=6)
    suite, v, _ = run_suite(simhost)
    assert v.reason is Reason.NVIDIA_SMI_FAILED and simhost.smi_q_call_count() == 0
    assert suite.results[Check.FABRIC].ran and suite.results[Check.FABRIC].findings == ()
