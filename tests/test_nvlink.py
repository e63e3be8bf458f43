"""NVLink judged against what is fitted (agent/probes/nvml.py `nvlink_verdict`), on real `nvidia-smi nvlink -s` and
DCGM captures replayed through the NVML stand-in as the driver answers them, and the links seen up in a boot kept
in the state file across an agent restart.

The captures (tests/fixtures, provenance in SOURCES.md): a PCIe A100 without a bridge (all 12 links down, DCGM's
health watch), a PCIe H100 pair on Azure NCv5 (12 of 18 links up by design), a GB200 (18 of 18 up), an A100-SXM4
whose links are all inactive and a V100-SXM2 with two inactive links (both broken nodes in Azure's health checks)."""

from __future__ import annotations

import re

import pytest

from agent import config
from agent.model import Severity
from agent.probes.nvml import LinkMemory, NvmlProbe, expected_links, nvlink_profiles, nvlink_verdict
from agent.settings import ConfigError
from agent.state import LatchState
from testkit.fakes import fake_nvml
from testkit.fixture_files import fixture_path
from testkit.simhost import SimHost

A100_PCIE = "dcgmi-health-nvlink-down-a100-pcie-no-bridge-nvsentinel-1481.txt"
H100_NCV5 = "nhc-nvlink-inactive-h100-pcie-ncv5-azurehpc-hc-162.txt"
GB200 = "smi-nvlink-status-gb200-k8s-test-infra-371.txt"
A100_SXM_INACTIVE = "smi-nvlink-status-inactive-a100-sxm4-azurehpc-hc-fixture.txt"
V100_PARTIAL = "smi-nvlink-status-partial-v100-sxm2-azhpc-diagnostics-73.txt"
_GPU = re.compile(r"^GPU (\d+): (.+?) \(UUID")
_LINK = re.compile(r"Link (\d+): (.+?)\s*$")
_DCGM_DOWN = re.compile(r"NvLink link (\d+) is currently down")


def smi_links(name: str, total: int) -> tuple[str | None, list[int]]:
    """The GPU's model and its links' states (1 up, 0 not) from a capture: `nvidia-smi nvlink -s` ("<n> GB/s" up,
    "<inactive>" not; "all links are inactive": every one of `total`), Azure's health-check message ("Link n:
    Inactive", the others up) or DCGM's health watch ("all N links" down)."""
    text = fixture_path(name).read_text()
    model = next((m[2] for line in text.splitlines() if (m := _GPU.match(line))), None)
    states = [1] * total
    if "all links are inactive" in text or "(all 12 links)" in text:
        return model, [0] * total
    for line in text.splitlines():
        for m in _LINK.finditer(line):
            if int(m[1]) < total and ("inactive" in m[2].lower()):
                states[int(m[1])] = 0
        for m in _DCGM_DOWN.finditer(line):
            states[int(m[1])] = 0
    return model, states


def probe_on(links: list[int], name: str = "NVIDIA H100", **gpu) -> tuple[NvmlProbe, dict]:
    g = {"busId": "00000000:19:00.0", "name": name, "links": links, **gpu}
    return NvmlProbe("auto", nvml=fake_nvml([g])), g


def nvlink_findings(p: NvmlProbe):
    f, snap = p.sample()
    return [x for x in f if x.kind.startswith("nvlink")], snap


# -- the decision, pure ------------------------------------------------------------------------------------------


def test_a_link_is_down_only_when_something_says_it_should_be_up():
    assert nvlink_verdict([0] * 12).fitted is False  # nothing fitted: never a fault
    assert not nvlink_verdict([0] * 12).fault
    v = nvlink_verdict([1, 1, 0, 1])  # a link never up beside links that are: not wired (a bridged pair)
    assert v.fitted and not v.fault and v.down == ()
    v = nvlink_verdict([1, 1, 0, 1], seen_up={2})  # up earlier in this boot
    assert v.fault and v.down == (2,)
    v = nvlink_verdict([0] * 4, remote={1})  # the driver names a far end: wired
    assert v.fitted and v.down == (1,)
    v = nvlink_verdict([1] * 10 + [0] * 2, expected=12)  # the topology expects 12
    assert v.fault and v.down == () and (v.up, v.expected) == (10, 12)
    assert not nvlink_verdict([1] * 12 + [0] * 6, expected=12).fault
    v = nvlink_verdict([0] * 12, seen_up={0, 1}, mig=True)  # MIG mode: link states not judged
    assert not v.fault and not v.judged
    assert nvlink_verdict([0, 0], seen_up={5}).down == ()  # a link index the GPU does not have says nothing


def test_profiles_per_model_and_the_setting_rows():
    profiles = nvlink_profiles("NVIDIA A100-SXM4*=12, *V100-SXM2*=6")
    assert profiles == (("nvidia a100-sxm4*", 12), ("*v100-sxm2*", 6))
    assert expected_links("NVIDIA A100-SXM4-80GB", None, profiles) == (12, "nvlinkProfiles")
    assert expected_links("Tesla V100-SXM2-32GB", 4, profiles) == (6, "nvlinkProfiles")
    assert expected_links("NVIDIA A100 80GB PCIe", 4, profiles) == (4, "expectedNvlinks")  # no profile matches
    assert expected_links("NVIDIA A100 80GB PCIe", None, profiles) == (None, "")
    # an NVSwitch system: every link NVML answers, unless a setting says otherwise
    assert expected_links("NVIDIA A100-SXM4-80GB", None, (), links=12, nvswitches=6) == (12, "NVSwitch system")
    assert expected_links("NVIDIA A100-SXM4-80GB", 10, (), links=12, nvswitches=6) == (10, "expectedNvlinks")
    assert expected_links("NVIDIA A100-SXM4-80GB", None, (), links=0, nvswitches=6) == (None, "")
    assert nvlink_profiles({"NVIDIA H100 80GB HBM3": 18}) == (("nvidia h100 80gb hbm3", 18),)
    for bad in ("H100", "=18", "H100=many", "H100=99", ",".join(["x=1"] * 65)):
        with pytest.raises(ValueError):
            nvlink_profiles(bad)
    cfg = config.defaults(expected_nvlinks=12, nvlink_profiles="*GB200*=18")
    assert (cfg.expected_nvlinks, cfg.nvlink_profiles) == (12, (("*gb200*", 18),))
    assert config.defaults().expected_nvlinks is None and config.defaults().nvlink_profiles is None
    with pytest.raises(ConfigError):
        config.defaults(expected_nvlinks=65)


# -- real captures through the probe ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capture", "model", "total", "up"),
    [
        (A100_PCIE, "NVIDIA A100 80GB PCIe", 12, 0),  # no bridge: every link disabled
        (H100_NCV5, "NVIDIA H100 PCIe", 18, 13),  # bridged pair: the inactive ones are not wired
        (GB200, "NVIDIA GB200", 18, 18),
    ],
)
def test_healthy_nodes_of_several_models_stay_healthy(capture, model, total, up):
    found, states = smi_links(capture, total)
    assert sum(states) == up and (found is None or found == model)
    p, _ = probe_on(states, model)
    for _ in range(3):  # the same every cycle
        f, snap = nvlink_findings(p)
        assert not [x for x in f if x.severity is Severity.FAULT]
    g = snap.gpus[0]
    assert (g.nvlink_links, len(g.nvlink_up), g.nvlink_down) == (total, up, [])
    assert g.nvlink_fitted is (up > 0)
    if up == 0:  # shown, never a fault
        assert [(x.severity, x.kind) for x in f] == [(Severity.INFO, "nvlink_absent")]
        assert "no NVLink fitted: all 12 links disabled" in f[0].message


def test_an_sxm_gpu_whose_links_never_trained_is_caught_by_the_topology():
    """Azure's health checks fail this A100-SXM4 (every link inactive): with nothing saying the links are wired it
    reads as "not fitted"; the node's profile says an A100-SXM4 has 12 up, and so do the NVSwitches on its PCI bus."""
    model, states = smi_links(A100_SXM_INACTIVE, 12)
    assert model == "NVIDIA A100-SXM4-80GB" and sum(states) == 0
    p, _ = probe_on(states, model)
    assert [x.kind for x in nvlink_findings(p)[0]] == ["nvlink_absent"]
    p.nvlink_profiles = nvlink_profiles("NVIDIA A100-SXM4*=12")
    f, snap = nvlink_findings(p)
    assert [(x.severity, x.kind) for x in f] == [(Severity.FAULT, "nvlink_down")]
    assert f[0].message == "NVLink down: 0 of 12 expected links up (nvlinkProfiles)" and snap.gpus[0].nvlink_fitted
    # on its node (Azure ND A100 v4: six NVSwitches on the PCI bus) the topology says so without a setting
    p, _ = probe_on(states, model)
    p.nvswitches = lambda: ["0000:00:0c.0"] * 6
    f, _ = nvlink_findings(p)
    assert [x.message for x in f] == ["NVLink down: 0 of 12 expected links up (NVSwitch system)"]
    p.nvswitches = lambda: (_ for _ in ()).throw(OSError("unreadable"))  # not readable: no expectation from it
    assert [x.kind for x in nvlink_findings(p)[0]] == ["nvlink_absent"]
    # the same GPU on a node where NVML names the far end of its links (NVSwitches): wired, so down
    p, _ = probe_on(states, model, remote={i: 2 for i in range(12)})
    f, _ = nvlink_findings(p)
    assert f[0].kind == "nvlink_down" and "links 0, 1, 2" in f[0].message


def test_links_that_go_down_after_being_up_are_caught():
    """A V100-SXM2 with links 3 and 5 inactive (a broken node in Azure's health checks): seen up earlier in this
    boot, they are down; with the model's profile (6 links), they are down from the first read."""
    model, broken = smi_links(V100_PARTIAL, 6)
    assert model == "Tesla V100-SXM2-32GB" and broken == [1, 1, 1, 0, 1, 0]
    p, g = probe_on([1] * 6, model)
    assert nvlink_findings(p)[0] == []
    g["links"] = broken
    f, snap = nvlink_findings(p)
    assert [x.message for x in f] == ["NVLink down: links 3, 5 down (up earlier or connected)"]
    assert snap.gpus[0].nvlink_down == [3, 5]
    p, _ = probe_on(broken, model)
    assert nvlink_findings(p)[0] == []  # first read, nothing known: not judged
    p.expected_nvlinks = 6
    assert "4 of 6 expected links up (expectedNvlinks)" in nvlink_findings(p)[0][0].message


def test_a_gpu_in_mig_mode_is_not_judged():
    p, g = probe_on([1] * 12, "NVIDIA A100-SXM4-80GB")
    nvlink_findings(p)
    g["links"], g["mig"] = [0] * 12, True
    f, snap = nvlink_findings(p)
    assert f == [] and snap.gpus[0].nvlink_down == []


def test_the_links_seen_up_outlive_an_agent_restart_and_not_a_reboot(tmp_path):
    state = LatchState(str(tmp_path), "boot-1")
    assert state.load() == "new"
    p, _ = probe_on([1] * 18, "NVIDIA H100 80GB HBM3")
    p.links = state
    nvlink_findings(p)
    writes = state.path.stat().st_mtime_ns
    nvlink_findings(p)
    assert state.path.stat().st_mtime_ns == writes  # nothing new seen: no write
    # the agent restarts in the same boot: link 7 down is still known to have been up
    again = LatchState(str(tmp_path), "boot-1")
    assert again.load() == "loaded" and again.nvlinks_seen_up("00000000:19:00.0") == frozenset(range(18))
    p2, _ = probe_on([1] * 7 + [0] + [1] * 10, "NVIDIA H100 80GB HBM3")
    p2.links = again
    f, _ = nvlink_findings(p2)
    assert [x.kind for x in f] == ["nvlink_down"] and "links 7 down" in f[0].message
    # a reboot forgets them: the new boot judges from its own reads
    rebooted = LatchState(str(tmp_path), "boot-2")
    assert rebooted.load() == "boot_changed" and rebooted.nvlinks_seen_up("00000000:19:00.0") == frozenset()
    assert rebooted.new_boot("boot-3") == 0 and rebooted.nvlink_up == {}


def test_the_in_memory_default_remembers_per_gpu():
    m = LinkMemory()
    m.note_nvlinks_up("a", [1, 2])
    m.note_nvlinks_up("a", [3])
    assert m.nvlinks_seen_up("a") == {1, 2, 3} and m.nvlinks_seen_up("b") == frozenset()


def test_check_json_shows_each_gpus_links(tmp_path):
    """`check --json` `multinode.nvlink`: a PCIe A100 without a bridge on a node without NVSwitches shows its links,
    none up, not fitted; the same readings on a node with NVSwitches (the simulated HGX) are links down."""
    from agent.checks import CheckSuite, nvml_reads
    from agent.cli import multinode_json

    _, states = smi_links(A100_PCIE, 12)
    for host, fitted in ((SimHost(tmp_path / "pcie", extra_functions=False), False), (SimHost(tmp_path / "hgx"), True)):
        paths = {"nvidia_smi": str(host.nvidia_smi), "sysfs_root": str(host.sysfs), "fabric": "off"}
        paths |= {"dev_root": str(host.make_dev_nodes()), "proc_root": str(host.proc), "fabric_manager": False}
        probe, _ = probe_on(states, "NVIDIA A100 80GB PCIe")
        cfg = config.defaults(**paths)
        suite = CheckSuite(cfg, nvml=nvml_reads(cfg, probe))
        obs, _ = suite.run(None, one_shot=True)
        (j,) = multinode_json(suite)["nvlink"]
        assert (j["links"], j["up"], j["fitted"], j["judged"]) == (12, [], fitted, True)
        assert [f.kind for f in obs.findings if f.kind.startswith("nvlink")] == (
            ["nvlink_down"] if fitted else ["nvlink_absent"]
        )


def test_far_ends_are_asked_once_per_link():
    """A PCIe GPU without a bridge: its 12 links' far ends are asked at the first read only, not every cycle."""
    calls = []
    p, _ = probe_on([0] * 12, "NVIDIA A100 80GB PCIe")
    real = p._lib().nvmlDeviceGetNvLinkRemoteDeviceType

    def counted(h, link):
        calls.append(link)
        return real(h, link)

    p._lib().nvmlDeviceGetNvLinkRemoteDeviceType = counted
    for _ in range(3):
        assert [x.kind for x in nvlink_findings(p)[0]] == ["nvlink_absent"]
    assert calls == list(range(12))
