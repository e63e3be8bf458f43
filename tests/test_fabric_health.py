"""The fabric health summary (agent/probes/fabric.py): Unhealthy is FabricNotReady from `nvidia-smi -q` and from NVML's
v3 fabric structure (a driver without it answers a version mismatch and the v2 one is read); and `nvidia-smi -q`
output that is not what nvidia-smi prints is could not check, never "no fabric", and is not remembered as such.

Captures (tests/fixtures, provenance in SOURCES.md): the Fabric block of a multi-node NVLink node whose summary read
Unhealthy (kubernetes-sigs/dra-driver-nvidia-gpu#626), spliced into the H200 590.48.01 `-q` capture in place of its
own block; a GB200 NVL72 health mask 0xaa (NVIDIA/nccl#2186), which decodes to every field healthy."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import config
from agent.checks import CheckSuite, combine
from agent.model import Check, Reason, Severity, Status
from agent.probes.base import ProbeContext
from agent.probes.fabric import FabricProbe, decode_health, fabric_findings, parse_smi_q, smi_q_problem
from agent.probes.nvml import NvmlProbe
from agent.verdict import decide
from testkit.fakes import fake_nvml
from testkit.fixture_files import FIXTURES
from testkit.simhost import SimHost

HGX_H100 = FIXTURES / "smi-q-535.161.08-gpud-fixture.txt"  # 8x H100 80GB HBM3, Fabric Completed
H200_590 = FIXTURES / "smi-q-h200-590.48.01-nvgpuexp-capture.txt"  # 590 layout: CliqueId, ClusterUUID, Health
UNHEALTHY_BLOCK = FIXTURES / "smi-q-fabric-unhealthy-mnnvl-dra-driver-626.txt"
GB200_CLUSTER = bytes.fromhex("dc6e40c4d72243579ba65291dd461278")


def spliced() -> str:
    """The H200 capture with its Fabric block's first lines (Fabric .. Bandwidth) replaced by the captured block."""
    block = UNHEALTHY_BLOCK.read_text().splitlines()
    block = block[block.index("    Fabric") : block.index("--")]
    lines = H200_590.read_text().splitlines()
    start = lines.index("    Fabric")
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("Bandwidth"))
    return "\n".join(lines[:start] + block + lines[end + 1 :]) + "\n"


def test_an_unhealthy_summary_from_nvidia_smi_is_not_ready():
    (info,) = parse_smi_q(spliced()).values()
    assert (info.state, info.status, info.clique_id) == ("Completed", "Success", 2)
    assert info.health["Summary"] == "Unhealthy" and info.health["Bandwidth"] == "Full"
    (f,) = fabric_findings([info])
    assert (f.reason, f.kind) == (Reason.FABRIC_NOT_READY, "fabric_unhealthy")
    assert f.message.startswith("NVLink fabric health: Summary: Unhealthy")
    assert fabric_findings(parse_smi_q(H200_590.read_text()).values()) == []  # the capture as is: healthy


def fabric_via_nvml(fabric: dict):
    ctx = ProbeContext()
    p = NvmlProbe("on", nvml=fake_nvml([{"busId": "00000008:01:00.0", "fabric": fabric}]))
    p.read_fabric = True
    ctx.results[Check.NVML] = p.read(ctx)
    return FabricProbe("auto", smi=None).read(ctx)


def test_an_unhealthy_summary_from_nvml_is_not_ready_and_an_older_driver_still_reads():
    base = {"state": 3, "status": 0, "clique": 2, "cluster": GB200_CLUSTER, "health": 0xAA}
    r = fabric_via_nvml(base | {"summary": 1})
    assert r.ran and r.findings == () and r.payload.gpus[0].health["Summary"] == "Healthy"
    r = fabric_via_nvml(base | {"summary": 2})
    (f,) = r.findings
    assert (f.reason, f.kind) == (Reason.FABRIC_NOT_READY, "fabric_unhealthy")
    v = decide(combine([r], None), [])
    assert (v.status, v.reason) == (Status.FALSE, Reason.FABRIC_NOT_READY)
    (f,) = fabric_via_nvml(base | {"summary": 3}).findings  # limited capacity: slower, degraded
    assert (f.reason, f.kind) == (Reason.GPU_DEGRADED, "fabric_degraded")
    r = fabric_via_nvml(base | {"summary": 2, "v2_only": True})  # a driver before v3: the v2 structure, no summary
    assert r.ran and r.findings == () and "Summary" not in r.payload.gpus[0].health


def test_a_real_nvl72_health_mask_decodes_healthy():
    assert decode_health(0xAA) == {
        "Bandwidth": "Full",
        "Route Recovery in progress": "False",
        "Route Unhealthy": "False",
        "Access Timeout Recovery": "False",
    }
    assert decode_health(0xAA, 2)["Summary"] == "Unhealthy"


# -- nvidia-smi -q output that nvidia-smi does not print ---------------------------------------------------------

_H100 = HGX_H100.read_text()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "is empty"),
        ("\n  \n", "is empty"),
        (_H100[:2000] + "\x00\x00\x7fELF" + _H100[2000:], "is not text"),
        (_H100.replace("\ufffd", "") + "\ufffd", "is not text"),
        (_H100.replace("    ", "\t"), "is indented with tabs"),
        (_H100 + _H100[_H100.index("GPU 00000000:19:00.0") :], "lists GPU 00000000:19:00.0 twice"),
        (_H100[: _H100.index("GPU 00000000:DB:00.0")], "has no section for 1 GPUs"),
    ],
)
def test_bad_output_is_named(text, problem):
    gpus = list(parse_smi_q(_H100))
    assert smi_q_problem(_H100, gpus) is None
    assert problem in (smi_q_problem(text, gpus) or "")


def write(tmp: Path, text: str) -> Path:
    p = tmp / "q.txt"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("kind", ["empty", "binary", "tabs", "twice", "missing"])
def test_bad_output_is_could_not_check_and_not_cached(simhost: SimHost, tmp_path, kind):
    """The simulated node's own -q (no fabric on its GPUs, the cached case) made bad: Unknown each poll, -q run
    again each poll; the good output after it is "no fabric" and cached as before."""
    good = simhost_q(simhost)
    bad = {
        "empty": "",
        "binary": good.replace("Fabric", "Fab\x00ric", 1),
        "tabs": good.replace("    ", "\t"),
        "twice": good + good[good.index("\nGPU ") + 1 :],
        "missing": good[: good.rindex("\nGPU ") + 1],
    }[kind]
    simhost.set_smi_q(write(tmp_path, bad))
    paths = {"nvidia_smi": str(simhost.nvidia_smi), "sysfs_root": str(simhost.sysfs), "nvml": "off"}
    paths |= {"dev_root": str(simhost.make_dev_nodes()), "proc_root": str(simhost.proc)}
    suite = CheckSuite(config.defaults(**paths))
    clock = [0.0]
    suite.clock = lambda: clock[0]
    for t in (0.0, 30.0):
        clock[0] = t
        obs, stats = suite.run(None)
        v = decide(obs, [])
        assert v.status is Status.UNKNOWN and "nvidia-smi -q output" in v.message and "fabric" in stats.failed
        assert [f.severity for f in suite.results[Check.FABRIC].findings] == [Severity.UNCHECKED]
    assert simhost.smi_q_call_count() == 2  # not remembered: read again at the next poll
    simhost.set_smi_q(None)
    for t in (60.0, 90.0):
        clock[0] = t
        obs, _ = suite.run(None)
        assert decide(obs, []).status is Status.TRUE
    assert simhost.smi_q_call_count() == 3  # the good "no fabric" is remembered


def simhost_q(host: SimHost) -> str:
    from testkit.simhost import smi_q

    return smi_q(host.gpus)
