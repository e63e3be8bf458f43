"""`gpu-ready check` end to end: the CLI on the simulated host, the Node read from the real apiserver."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.apiserver


def run_check(simhost, *extra, kubeconfig=None):
    args = [sys.executable, "-m", "agent.cli", "check", "--json", *simhost.check_args(), *extra]
    if kubeconfig:
        args += ["--kubeconfig", str(kubeconfig)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 1, 3), r.stderr
    out = json.loads(r.stdout)
    return r.returncode, out


@pytest.fixture
def check_node(control_plane, make_node, simhost, tmp_path):
    kc = control_plane.kubeconfig(tmp_path / "kubeconfig")

    def _run(capacity=None, allocatable=None, labels=None, *extra):
        node = make_node(
            labels=labels,
            capacity=capacity if capacity is not None else simhost.plugin_resources(),
            allocatable=allocatable,
        )
        return run_check(simhost, "--node", node, *extra, kubeconfig=kc)

    return _run


def test_healthy(check_node):
    rc, out = check_node()
    assert rc == 0 and out["status"] == "True" and out["reason"] == "GPUsHealthy"
    assert out["counts"] == {
        "pci": 8,
        "nvidia_smi": 8,
        "plugin_capacity": 8,
        "plugin_allocatable": 8,
        "plugin_physical": 8,
    }
    assert [g["pci_bus_id"] for g in out["gpus"]][:2] == ["00000000:19:00.0", "00000000:3B:00.0"]
    assert all(g["healthy"] is True and g["problems"] == [] for g in out["gpus"])


def test_err_on_one_gpu(check_node, simhost):
    simhost.set_smi(err={3: ("Temp",)})
    rc, out = check_node()
    assert rc == 1 and out["reason"] == "NvidiaSmiErr"
    bad = [g for g in out["gpus"] if not g["healthy"]]
    assert [(g["index"], g["pci_bus_id"]) for g in bad] == [(3, "00000000:5D:00.0")]
    assert "GPU 3 (00000000:5D:00.0): ERR! in Temp" in out["message"]


def test_hung_nvidia_smi(check_node, simhost):
    simhost.set_smi(hang=True)
    rc, out = check_node(None, None, None, "--nvidia-smi-timeout", "1")
    assert rc == 1 and out["reason"] == "NvidiaSmiFailed" and "timed out after 1s" in out["message"]
    assert out["counts"]["nvidia_smi"] is None
    assert all(g["healthy"] is None for g in out["gpus"])


def test_mig_mixed(check_node, simhost):
    simhost.set_smi(mig={0: 4, 1: 4})
    rc, out = check_node(
        {"nvidia.com/gpu": "6", "nvidia.com/mig-1g.10gb": "8"}, None, {"nvidia.com/mig.strategy": "mixed"}
    )
    assert rc == 0, out["message"]
    assert out["counts"]["plugin_physical"] == 8 and out["counts"]["plugin_capacity"] == 14


def test_mig_single(check_node, simhost):
    simhost.set_smi(mig={i: 7 for i in range(8)})
    rc, out = check_node({"nvidia.com/gpu": "56"}, None, {"nvidia.com/mig.strategy": "single"})
    assert rc == 0, out["message"]
    assert out["counts"]["plugin_physical"] == 8


def test_time_slicing_x4(check_node):
    rc, out = check_node({"nvidia.com/gpu": "32"}, None, {"nvidia.com/gpu.replicas": "4"})
    assert rc == 0 and out["counts"]["plugin_physical"] == 8
    rc, out = check_node({"nvidia.com/gpu": "28"}, None, {"nvidia.com/gpu.replicas": "4"})
    assert rc == 1 and out["reason"] == "GPUCountMismatch" and "device plugin serves 7" in out["message"]


def test_plugin_marks_one_gpu_unhealthy(check_node):
    rc, out = check_node({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "7"})
    assert rc == 1 and out["reason"] == "DevicePluginUnhealthy" and "nvidia.com/gpu 1 of 8" in out["message"]
    assert out["counts"]["plugin_allocatable"] == 7


def test_gpu_on_pci_but_missing_from_nvidia_smi(check_node, simhost):
    simhost.set_smi(hidden=(4,))
    rc, out = check_node({"nvidia.com/gpu": "7"})
    assert rc == 1 and out["reason"] == "GPUCountMismatch"
    assert "PCI shows 8 GPUs, nvidia-smi 7" in out["message"]
    missing = [g for g in out["gpus"] if g["index"] is None]
    assert [g["pci_bus_id"] for g in missing] == ["00000000:9B:00.0"] and missing[0]["healthy"] is False


def test_fatal_xid(check_node, simhost):
    simhost.append_xid(13, 1)
    simhost.append_xid(79, 2)
    rc, out = check_node()
    assert rc == 1 and out["reason"] == "FatalXid"
    assert {(x["xid"], x["pci_bus_id"], x["fatal"]) for x in out["xids"]} == {
        (13, "0000:3b:00", False),
        (79, "0000:4c:00", True),
    }


def test_node_json_and_no_node(simhost, tmp_path):
    saved = tmp_path / "node.json"
    gpus = {"nvidia.com/gpu": "8"}
    saved.write_text(
        json.dumps({"kind": "Node", "metadata": {"name": "n"}, "status": {"capacity": gpus, "allocatable": gpus}})
    )
    rc, out = run_check(simhost, "--node-json", str(saved))
    assert rc == 0 and out["counts"]["plugin_physical"] == 8
    rc, out = run_check(simhost)
    assert rc == 0 and out["counts"]["plugin_capacity"] is None


def test_api_unreachable_is_unknown(simhost, tmp_path, control_plane):
    kc = tmp_path / "kc"
    kc.write_text(
        control_plane.kubeconfig(tmp_path / "x").read_text().replace(control_plane.host, "https://127.0.0.1:1")
    )
    rc, out = run_check(simhost, "--node", "n", kubeconfig=kc)
    assert rc == 3 and out["status"] == "Unknown" and "cannot read the Node" in out["message"]


def test_api_forbidden_is_unknown(simhost, tmp_path, control_plane, make_node, sa_client):
    node = make_node(capacity=simhost.plugin_resources())
    _, info = sa_client(rules=[{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}])
    kc = control_plane.kubeconfig(tmp_path / "kc", info["token"])
    rc, out = run_check(simhost, "--node", node, kubeconfig=kc)
    assert rc == 3 and "HTTP 403" in out["message"]


def test_table_output(simhost):
    simhost.set_smi(err={0: ("Fan",)})
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", *simhost.check_args()], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "0    00000000:19:00.0  NVIDIA H100 80GB HBM3        UNHEALTHY NvidiaSmiErr: ERR! in Fan" in r.stdout
    assert "GPUReady=False  reason=NvidiaSmiErr" in r.stdout


def test_duplicated_bus_id_cannot_hide_a_pci_gpu(simhost):
    """nvidia-smi lists 8 rows but one bus id twice: the counts agree (8 and 8), the address sets do not."""
    from testkit.simhost import smi_table

    table = smi_table(simhost.gpus)
    assert "00000000:9B:00.0" in table
    simhost.set_smi(output=table.replace("00000000:9B:00.0", "00000000:5D:00.0"))
    rc, out = run_check(simhost)
    assert rc == 1 and out["status"] == "False", out["message"]
    assert out["counts"]["pci"] == out["counts"]["nvidia_smi"] == 8
    assert "GPU 00000000:9B:00.0: on PCI but not in nvidia-smi" in out["message"]
    bad = {g["pci_bus_id"] for g in out["gpus"] if g["healthy"] is False}
    assert "00000000:9B:00.0" in bad


# -- the exit status a script can trust: the verdict, or 2 for a usage or configuration error --------------------


def check_process(simhost, *extra, env=None):
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", *simhost.check_args(), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    ("case", "expected"), [("true", (0, "True")), ("false", (1, "False")), ("unknown", (3, "Unknown"))]
)
def test_exit_status_is_the_verdict(simhost, tmp_path, case, expected):
    """0 True, 1 False, 3 Unknown (a check could not run: here the kernel log); never 2."""
    extra = ["--kmsg", str(tmp_path / "no-kmsg")] if case == "unknown" else []
    if case == "false":
        simhost.set_smi(err={3: ("Temp",)})
    r = check_process(simhost, "--json", *extra)
    assert (r.returncode, json.loads(r.stdout)["status"]) == expected, r.stderr
    table = check_process(simhost, *extra)
    assert table.returncode == expected[0] and f"GPUReady={expected[1]} " in table.stdout


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["--kmsg"], ["--node", "a", "--node-json", "b"], ["--no-pcie=true"], ["--poll-interval", "5"]],
)
def test_usage_error_exits_2_with_one_line_and_no_verdict(simhost, argv):
    r = check_process(simhost, "--json", *argv)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith("gpu-ready check: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("how", ["flag", "environment", "file", "node-json", "no credentials"])
def test_configuration_error_exits_2_with_one_line_and_no_verdict(simhost, tmp_path, how):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_READY_", "KUBERNETES_", "KUBECONFIG"))}
    extra: list[str] = []
    if how == "flag":
        extra = ["--pcie=maybe"]
    elif how == "environment":
        env["GPU_READY_NVIDIA_SMI_TIMEOUT"] = "nan"
    elif how == "file":  # a run-only setting too: the file is one configuration for every command
        (tmp_path / "c.yaml").write_text("pollInterval: -3\n")
        env["GPU_READY_CONFIG"] = str(tmp_path / "c.yaml")
    elif how == "node-json":
        (tmp_path / "node.json").write_text("[]")
        extra = ["--node-json", str(tmp_path / "node.json")]
    else:  # --node with neither in-cluster credentials nor a kubeconfig: `run` stops the same way
        env.update(KUBECONFIG=str(tmp_path / "no-kubeconfig"), HOME=str(tmp_path))
        extra = ["--node", "gpu-node-1"]
    r = check_process(simhost, "--json", *extra, env=env)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
