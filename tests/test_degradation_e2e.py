"""The degradation signals end to end: the real agent (`gpu-ready run`) and `gpu-ready check` on the
simulated host, the Node on the real apiserver. A downtrained PCIe link, a missing /dev/nvidia-uvm, repeated
non-fatal Xids in the kernel log, the dcgm-exporter stand-in; each degrades the node (GPUDegraded), recovers
through the hysteresis, and a check that cannot run is never True."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from testkit.harness import wait_for
from testkit.simhost import DcgmExporterStandIn

pytestmark = pytest.mark.apiserver

GPU4 = "00000000:9B:00.0"


def polls_after(simhost, n: int, timeout: float = 60.0) -> None:
    start = simhost.smi_call_count()
    wait_for(lambda: simhost.smi_call_count() >= start + n, timeout, what=f"{n} more check cycles")


def statuses_until(agent, admin, status: str, reason: str, timeout: float = 60.0) -> set[str]:
    """Every GPUReady status seen while waiting for (status, reason)."""
    seen: set[str] = set()

    def reached() -> bool:
        c = agent.gpu_ready(admin)
        if c:
            seen.add(c["status"])
        return bool(c and c["status"] == status and c["reason"] == reason)

    try:
        wait_for(reached, timeout, what=f"GPUReady={status} {reason}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- agent log ---\n{agent.logs()[-4000:]}") from None
    return seen


def test_downtrained_link_degrades_the_node_and_recovers_after_clean_polls(admin, agent_factory, simhost):
    a = agent_factory(extra={"--recovery-polls": "3"})
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)
    simhost.set_link(simhost.gpus[4].address, current_width=8)
    c = a.wait_status(admin, "False", "GPUDegraded", timeout=60)
    assert c["message"] == f"GPUDegraded: GPU 4 ({GPU4}): PCIe GPU link trained to x8, capable of x16"
    assert a.metric("gpu_ready_gpu_healthy", {"pci_bus_id": GPU4}) == 0
    assert a.metric("gpu_ready_gpu_healthy", {"pci_bus_id": "00000000:19:00.0"}) == 1
    assert a.metric("gpu_ready_status", {"status": "False", "reason": "GPUDegraded"}) == 1
    assert a.metric("gpu_ready_check_duration_seconds_count", {"check": "pcie"}) >= 1
    calls = simhost.smi_call_count()
    simhost.set_link(simhost.gpus[4].address)  # retrained (e.g. after a reseat and reset)
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)
    assert simhost.smi_call_count() - calls >= 3  # --recovery-polls clean cycles first


def test_missing_nvidia_uvm_degrades_the_node_naming_the_device_node(admin, agent_factory, simhost):
    simhost.make_dev_nodes()
    a = agent_factory()
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)
    simhost.remove_dev_node("nvidia-uvm")
    c = a.wait_status(admin, "False", "GPUDegraded", timeout=60)
    assert c["message"] == (
        f"GPUDegraded: device node {simhost.dev}/nvidia-uvm is missing (CUDA programs fail without it)"
    )
    assert a.metric("gpu_ready_gpu_healthy", {"pci_bus_id": GPU4}) == 1  # node-level: no GPU is blamed
    simhost.make_dev_nodes()
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)


def test_repeated_xid_13_degrades_until_the_window_is_clean_and_never_latches(admin, agent_factory, simhost):
    window = 6.0
    # A saved log's stamps place records only within one read; across reads the agent's clock does. So the first
    # two go in one write (2 s apart: two occurrences, not one burst), and the third comes at least three polls
    # (1 s) after them, beyond a burst of 0.25 s.
    a = agent_factory(extra={"--xid-rate-window": str(window), "--xid-rate-burst": "0.25"})
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)
    line = "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Out Of Range Address"
    simhost.append_kmsg(simhost.xid_line(13, 2, line), simhost.xid_line(13, 2, line), apart_s=2.0)
    polls_after(simhost, 3)
    assert a.gpu_ready(admin)["status"] == "True"  # two of three: below the count
    t0 = time.monotonic()
    simhost.append_xid(13, 2, line, apart_s=2.0)
    c = a.wait_status(admin, "False", "GPUDegraded", timeout=60)
    assert c["message"] == (
        "GPUDegraded: GPU 2 (00000000:4C:00.0): Xid 13 repeated: 3 or more within 0.1 min "
        "(3 occurrences in the last window)"
    )
    assert a.metric("gpu_ready_latched_faults") == 0
    assert a.metric("gpu_ready_xid_total", {"xid": "13", "fatal": "false"}) == 3
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)  # by itself: the rate does not latch
    assert time.monotonic() - t0 >= window


def test_dcgm_exporter_health_fail_then_required_and_unreachable(admin, agent_factory, simhost):
    with DcgmExporterStandIn() as ex:
        a = agent_factory(start=False, extra={"--dcgm-exporter": ex.address, "--dcgm-required": "true"})

        def series(value: int, host: str = a.node) -> str:
            rows = [
                f'DCGM_EXP_GPU_HEALTH_STATUS{{gpu="{i}",UUID="GPU-{i}",pci_bus_id="{g.address.nvml}",'
                f'Hostname="{host}",health_watch="MEM",health_error_code="DCGM_FR_VOLATILE_DBE_DETECTED"}} '
                f"{value if i == 4 else 0}"
                for i, g in enumerate(simhost.gpus)
            ]
            return "\n".join(rows) + "\n"

        ex.text = series(20)
        a.start()
        c = a.wait_status(admin, "False", "GPUDegraded", timeout=60)
        assert c["message"] == (f"GPUDegraded: GPU 4 ({GPU4}): DCGM health MEM: FAIL (DCGM_FR_VOLATILE_DBE_DETECTED)")
        ex.text = series(0)
        a.wait_status(admin, "True", "GPUsHealthy", timeout=60)
        ex.status = 503  # required and unreachable: could not check, never True
        statuses_until(a, admin, "Unknown", "CheckFailed")
        assert "dcgm: dcgm-exporter:" in a.gpu_ready(admin)["message"]
        wait_for(lambda: a.metric("gpu_ready_check_failures_total", {"check": "dcgm"}) >= 1, 30, what="failure metric")
        polls_after(simhost, 3)
        assert a.gpu_ready(admin)["status"] == "Unknown"


def test_cannot_check_device_nodes_is_unknown_never_true(admin, agent_factory, simhost, tmp_path):
    a = agent_factory(extra={"--dev-root": str(tmp_path / "no-dev")})
    seen = statuses_until(a, admin, "Unknown", "CheckFailed")
    assert "True" not in seen
    c = a.gpu_ready(admin)
    assert f"device_nodes: cannot list device nodes in {tmp_path / 'no-dev'}" in c["message"]
    polls_after(simhost, 3)
    assert a.gpu_ready(admin)["status"] == "Unknown"
    assert a.metric("gpu_ready_check_failures_total", {"check": "device_nodes"}) >= 3
    # The dev root appears (e.g. the driver container finished): True after the clean cycles.
    (tmp_path / "no-dev").symlink_to(simhost.make_dev_nodes())
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)


def test_degradation_then_cannot_check_is_unknown_not_stale_false_or_true(admin, agent_factory, simhost):
    dev = simhost.make_dev_nodes()
    a = agent_factory()
    a.wait_status(admin, "True", timeout=60)
    simhost.set_link(simhost.gpus[1].address, current_width=4)
    a.wait_status(admin, "False", "GPUDegraded", timeout=60)
    # The link retrains while the device nodes cannot be read: not "healthy", not the old fault.
    hidden = dev.with_name("dev-hidden")
    dev.rename(hidden)
    simhost.set_link(simhost.gpus[1].address)
    seen = statuses_until(a, admin, "Unknown", "CheckFailed")
    assert "True" not in seen
    hidden.rename(dev)
    a.wait_status(admin, "True", "GPUsHealthy", timeout=60)


def test_check_json_shows_each_degradation_per_gpu(control_plane, make_node, simhost, tmp_path):
    kc = control_plane.kubeconfig(tmp_path / "kubeconfig")
    node = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity=simhost.plugin_resources())
    simhost.make_dev_nodes(skip=("nvidia-uvm",))
    simhost.set_link(simhost.gpus[1].address, current_width=8, current_gts=16.0)
    for _ in range(3):
        simhost.append_xid(31, 6, "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000", apart_s=2.0)

    def check(*extra: str) -> tuple[int, dict]:
        args = [sys.executable, "-m", "agent", "check", "--json", *simhost.check_args(), "--kubeconfig", str(kc)]
        r = subprocess.run(
            [*args, "--node", node, *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode in (0, 1, 3), r.stderr
        return r.returncode, json.loads(r.stdout)

    rc, out = check()
    assert rc == 1 and (out["status"], out["reason"]) == ("False", "GPUDegraded")
    problems = {g["index"]: g["problems"] for g in out["gpus"]}
    assert problems[1] == ["GPUDegraded: PCIe GPU link trained to x8, capable of x16"]  # speed: idle, not judged
    assert problems[6] == ["GPUDegraded: Xid 31 repeated: 3 or more within 10 min (3 occurrences in the last window)"]
    assert all(problems[i] == [] for i in (0, 2, 3, 4, 5, 7))
    assert f"device node {simhost.dev}/nvidia-uvm is missing" in out["message"]
    assert out["counts"]["plugin_capacity"] == 8 and [x["xid"] for x in out["xids"]] == [31, 31, 31]
    # A hard fault ranks above the degradations; they stay listed on their GPUs.
    simhost.set_smi(err={0: ("Temp",)})
    rc, out = check()
    assert rc == 1 and out["reason"] == "NvidiaSmiErr" and "GPUDegraded:" in out["message"]
    assert out["gpus"][1]["problems"] == ["GPUDegraded: PCIe GPU link trained to x8, capable of x16"]
    simhost.set_smi()
    rc, out = check("--pcie", "false", "--require-uvm", "false", "--xid-rate", "false")
    assert rc == 0 and out["status"] == "True", out["message"]
