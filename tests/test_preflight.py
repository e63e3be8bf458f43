"""Preflight: profile and spec gate on the simulated host, orchestration and timeouts, onboarding on the
real apiserver (label, annotations, cordon/uncordon, Event), and the agent's requirePreflight option."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from agent.preflight import (
    CORDONED_BY,
    FAIL,
    PASS,
    REPORT_ANNOTATION,
    SKIP,
    TIME_ANNOTATION,
    GateResult,
    Profile,
    ProfileError,
    build_gates,
    check_spec,
    onboard,
    passed,
    read_spec_nvidia_smi,
    run_gates,
    version_matches,
)

H100 = {
    "gpuModel": "H100",
    "gpuCount": 8,
    "memoryPerGpuMiB": 80000,
    "driverVersion": ">=550.54, <600",
    "cudaVersion": ">=12.4",
    "migMode": "disabled",
    "nvlinkLinksPerGpu": 18,
    "pcieGen": 5,
    "pcieWidth": 16,
    "eccEnabled": True,
}


def test_version_ranges():
    assert version_matches("550.90.07", ">=550.54, <600")
    assert not version_matches("535.104.12", ">=550.54")
    assert version_matches("12.4", "==12.4") and not version_matches("12.2", ">=12.4")
    with pytest.raises(ProfileError):
        version_matches("1", "about 550")


def test_profile_errors_are_clear():
    with pytest.raises(ProfileError, match="unknown profile keys: gpuCnt"):
        Profile.from_mapping({"gpuCnt": 8})
    with pytest.raises(ProfileError, match="unknown gate names"):
        Profile.from_mapping({"allowSkip": ["burn"]})


def test_spec_gate_on_the_simulated_host(simhost):
    gpus, cuda = read_spec_nvidia_smi(str(simhost.nvidia_smi))
    assert len(gpus) == 8 and cuda == "12.4" and gpus[3].bus_id == "00000000:5D:00.0"
    assert {g.nvlink_up for g in gpus} == {18}
    r = check_spec(Profile.from_mapping(H100), gpus, cuda)
    assert r.status == PASS, r.reason


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda h: setattr(h.gpus[2], "nvlink_up", 16), "GPU 2 (00000000:4C:00.0): 16 NVLink links up, expected 18"),
        (lambda h: setattr(h.gpus[5], "pcie_width", 8), "GPU 5 (00000000:BB:00.0): PCIe x8 < x16"),
        (lambda h: setattr(h.gpus[1], "ecc", False), "GPU 1 (00000000:3B:00.0): ECC Disabled, expected enabled"),
        (lambda h: setattr(h.gpus[7], "in_smi", False), "expected 8 GPUs, found 7"),
        (lambda h: setattr(h.gpus[0], "mig_devices", 3), "GPU 0 (00000000:19:00.0): MIG Enabled, expected disabled"),
        (lambda h: setattr(h.gpus[4], "memory_mib", 40000), "GPU 4 (00000000:9B:00.0): 40000 MiB < 80000 MiB"),
    ],
)
def test_spec_gate_failures(simhost, change, needle):
    change(simhost)
    simhost.set_smi(
        mig={i: g.mig_devices for i, g in enumerate(simhost.gpus)},
        hidden=tuple(i for i, g in enumerate(simhost.gpus) if not g.in_smi),
    )
    gpus, cuda = read_spec_nvidia_smi(str(simhost.nvidia_smi))
    r = check_spec(Profile.from_mapping(H100), gpus, cuda)
    assert r.status == FAIL and needle in r.reason


def test_driver_and_cuda_out_of_range(simhost):
    gpus, cuda = read_spec_nvidia_smi(str(simhost.nvidia_smi))
    r = check_spec(Profile.from_mapping({"driverVersion": ">=560", "cudaVersion": ">=12.6"}), gpus, cuda)
    assert r.status == FAIL and "CUDA 12.4 does not satisfy >=12.6" in r.reason and "driver 550.90.07" in r.reason


def test_orchestration_timeouts_errors_and_skips():
    def slow():
        time.sleep(3)
        return GateResult("burnin", PASS)

    def boom():
        raise RuntimeError("NVRTC compilation failed")

    t0 = time.monotonic()
    res = run_gates(
        {
            "spec": lambda: GateResult("spec", PASS, "ok"),
            "burnin": slow,
            "cuda": boom,
            "serving": lambda: GateResult("serving", SKIP, "not configured"),
        },
        {"burnin": 0.3},
    )
    assert time.monotonic() - t0 < 2.5
    by = {r.gate: r for r in res}
    assert [r.gate for r in res] == ["spec", "burnin", "cuda", "serving"]
    assert by["burnin"].status == FAIL and "timed out after 0.3s" in by["burnin"].reason
    assert by["burnin"].timeout_s == 0.3 and by["burnin"].duration_s < 1
    assert by["cuda"].status == FAIL and "NVRTC compilation failed" in by["cuda"].reason
    ok, blocking = passed(res, ["serving"])
    assert not ok and [b.gate for b in blocking] == ["burnin", "cuda"]
    assert passed([by["spec"], by["serving"]], ["serving"])[0]
    assert not passed([by["spec"], by["serving"]], [])[0], "a skip counts as passed only where allowed"


def test_gates_without_a_cuda_binding_are_skipped_with_the_reason(simhost, tmp_path):
    gates = build_gates(Profile.from_mapping({}), str(simhost.nvidia_smi), cuda=None)
    res = {r.gate: r for r in run_gates(gates, {})}
    assert res["spec"].status == PASS
    for g in ("burnin", "nvlink", "cuda", "serving"):
        assert res[g].status == SKIP and res[g].reason


def test_serving_and_burnin_commands_are_judged(tmp_path):
    ok = tmp_path / "serve.sh"
    ok.write_text('#!/bin/sh\necho \'{"choices":[{"text":"Paris"}]}\'\n')
    ok.chmod(0o755)
    slow = tmp_path / "slow.sh"
    slow.write_text("#!/bin/sh\nsleep 1\necho Paris\n")
    slow.chmod(0o755)
    prof = Profile.from_mapping(
        {"serving": {"command": str(ok), "expectOutput": "Paris", "maxLatencySeconds": 5}, "burnInCommand": "false"}
    )
    from tests.fakes import fake_nvml

    nv = fake_nvml([{"busId": "00000000:19:00.0"}])
    res = {r.gate: r for r in run_gates(build_gates(prof, "nvidia-smi", None, nv, None), {})}
    assert res["serving"].status == PASS and res["serving"].evidence["exit_code"] == 0
    assert res["burnin"].status == FAIL and "exited 1" in res["burnin"].reason
    prof = Profile.from_mapping({"serving": {"command": str(slow), "maxLatencySeconds": 0.2}})
    assert run_gates(build_gates(prof, "nvidia-smi"), {})[-1].reason.startswith("took ")
    prof = Profile.from_mapping({"serving": {"command": str(ok), "expectOutput": "Berlin"}})
    assert "does not match" in run_gates(build_gates(prof, "nvidia-smi"), {})[-1].reason


# -- onboarding against the real apiserver ---------------------------------------------------------------

pytest_apiserver = pytest.mark.apiserver


def node_obj(admin, name):
    n = admin.get_node(name)
    return (
        (n["metadata"].get("labels") or {}),
        (n["metadata"].get("annotations") or {}),
        bool((n.get("spec") or {}).get("unschedulable")),
    )


@pytest_apiserver
def test_passing_preflight_labels_and_uncordons(admin, make_node):
    node = make_node(labels={"nvidia.com/gpu.present": "true", "gpu-ready.io/needs-preflight": "true"})
    seen_cordoned = []

    def spec():
        seen_cordoned.append(node_obj(admin, node)[2])
        return GateResult("spec", PASS, "8 GPUs match", {"gpus": 8})

    gates = {
        "spec": spec,
        "burnin": lambda: GateResult("burnin", PASS, "ok", {"tflops": 51.2}),
        "nvlink": lambda: GateResult("nvlink", PASS),
        "cuda": lambda: GateResult("cuda", PASS),
        "serving": lambda: GateResult("serving", SKIP, "not configured"),
    }
    ok, _ = onboard(admin, node, gates, Profile.from_mapping({}), needs_label="gpu-ready.io/needs-preflight")
    assert ok and seen_cordoned == [True], "the node is cordoned while the gates run"
    labels, ann, cordoned = node_obj(admin, node)
    assert labels["preflight"] == "passed" and "gpu-ready.io/needs-preflight" not in labels
    assert not cordoned and CORDONED_BY not in ann
    assert ann[TIME_ANNOTATION].endswith("Z")
    assert json.loads(ann[REPORT_ANNOTATION])["burnin"]["status"] == "pass"


@pytest_apiserver
def test_repaired_node_cordoned_by_preflight_is_uncordoned_when_it_passes(admin, make_node):
    node = make_node(unschedulable=True)
    admin.patch_node(node, {"metadata": {"annotations": {CORDONED_BY: "true"}, "labels": {"preflight": "failed"}}})
    assert node_obj(admin, node)[2]
    ok, _ = onboard(admin, node, {"spec": lambda: GateResult("spec", PASS)}, Profile.from_mapping({}))
    labels, _, cordoned = node_obj(admin, node)
    assert ok and labels["preflight"] == "passed" and not cordoned


@pytest_apiserver
def test_node_cordoned_by_an_admin_stays_cordoned(admin, make_node):
    node = make_node(unschedulable=True)
    ok, _ = onboard(admin, node, {"spec": lambda: GateResult("spec", PASS)}, Profile.from_mapping({}))
    labels, _, cordoned = node_obj(admin, node)
    assert ok and labels["preflight"] == "passed" and cordoned


@pytest_apiserver
def test_failing_gate_leaves_node_cordoned_labelled_failed_with_event(admin, make_node):
    node = make_node()
    gates = {
        "spec": lambda: GateResult("spec", PASS),
        "nvlink": lambda: GateResult("nvlink", FAIL, "3->5: 12.1 GB/s < 300", {"gbps": {"3->5": 12.1}}),
    }
    ok, _ = onboard(admin, node, gates, Profile.from_mapping({}))
    labels, ann, cordoned = node_obj(admin, node)
    assert not ok and labels["preflight"] == "failed" and cordoned and ann[CORDONED_BY] == "true"
    events = admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    mine = [e for e in events if e["regarding"]["name"] == node and e["reason"] == "PreflightFailed"]
    assert len(mine) == 1 and "gate nvlink fail: 3->5: 12.1 GB/s < 300" in mine[0]["note"] and "gbps" in mine[0]["note"]


@pytest_apiserver
def test_preflight_cli_end_to_end_on_the_simulated_host(control_plane, admin, make_node, simhost, tmp_path):
    node = make_node(labels={"gpu-ready.io/needs-preflight": "true"})
    kc = control_plane.kubeconfig(tmp_path / "kc")
    prof = tmp_path / "profile.yaml"
    serve = tmp_path / "serve.sh"
    serve.write_text("#!/bin/sh\necho 'The capital of France is Paris.'\n")
    serve.chmod(0o755)
    prof.write_text(
        json.dumps(
            {
                **H100,
                "allowSkip": ["burnin", "nvlink", "cuda"],
                "serving": {"command": str(serve), "expectOutput": "Paris", "maxLatencySeconds": 10},
            }
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "agent.cli",
        "preflight",
        "--profile",
        str(prof),
        "--nvidia-smi",
        str(simhost.nvidia_smi),
        "--node",
        node,
        "--kubeconfig",
        str(kc),
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] and {g["gate"]: g["status"] for g in report["gates"]} == {
        "spec": "pass",
        "burnin": "skipped",
        "nvlink": "skipped",
        "cuda": "skipped",
        "serving": "pass",
    }
    labels, _, cordoned = node_obj(admin, node)
    assert labels["preflight"] == "passed" and not cordoned
    simhost.gpus[6].nvlink_up = 0
    simhost.set_smi()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    labels, _, cordoned = node_obj(admin, node)
    assert labels["preflight"] == "failed" and cordoned
    r = subprocess.run([*cmd[:5], str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read profile" in r.stderr


@pytest_apiserver
def test_agent_reports_true_only_after_preflight_passed(admin, agent_factory):
    a = agent_factory(extra={"--require-preflight": "true"})
    c = a.wait_status(admin, "False", "PreflightNotPassed")
    assert "preflight=passed" in c["message"]
    admin.patch_node(a.node, {"metadata": {"labels": {"preflight": "passed"}}})
    a.wait_status(admin, "True", timeout=20)


# -- the burn-in watch (NVML stand-in: no real NVML on CI machines; kmsg: the simulated host's file) -------


def _burnin_profile(cmd: str) -> Profile:
    return Profile.from_mapping({"burnInCommand": cmd, "timeouts": {"burnin": 30}})


def test_burnin_command_watched_clean_passes(simhost):
    from tests.fakes import fake_nvml

    gpus = [{"busId": "00000000:19:00.0", "remap": (0, 0, 0, 0), "throttle": 0x4 | 0x20}]  # power + thermal cap
    gates = build_gates(_burnin_profile("sleep 1.5"), "nvidia-smi", None, fake_nvml(gpus), str(simhost.kmsg))
    r = run_gates({"burnin": gates["burnin"]}, {})[0]
    assert r.status == PASS and r.evidence["watch"] == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda g, h: g[0].update(ecc_unc=3), "GPU 0: 3 uncorrected ECC errors during burn-in"),
        (lambda g, h: g[0].update(retired=1), "GPU 0: 1 new retired pages"),
        (lambda g, h: g[0].update(remap=(0, 1, 1, 0)), "GPU 0: 1 new remapped rows"),
        (lambda g, h: g[0].update(throttle=0x8), "GPU 0: clocks throttled by HwSlowdown"),
        (lambda g, h: h.append_xid(13, 0), "Xid 13 on 0000:19:00 during burn-in"),
    ],
)
def test_burnin_watch_fails_on_each_fault(simhost, change, needle):
    from tests.fakes import fake_nvml

    gpus = [{"busId": "00000000:19:00.0", "remap": (0, 0, 0, 0)}]
    simhost.append_xid(79, 0)  # logged before the burn-in: must not count
    nv = fake_nvml(gpus)
    gates = build_gates(_burnin_profile("sleep 2.5"), "nvidia-smi", None, nv, str(simhost.kmsg))

    def fault_midway():
        time.sleep(0.8)
        change(gpus, simhost)

    import threading

    t = threading.Thread(target=fault_midway)
    t.start()
    r = run_gates({"burnin": gates["burnin"]}, {})[0]
    t.join()
    assert r.status == FAIL and needle in r.reason, r.reason
    assert "Xid 79" not in r.reason


def test_burnin_without_nvml_cannot_pass(simhost):
    gates = build_gates(_burnin_profile("true"), "nvidia-smi", None, None, str(simhost.kmsg))
    r = run_gates({"burnin": gates["burnin"]}, {})[0]
    assert r.status == FAIL and "NVML unavailable" in r.reason


def test_spec_reads_nvml_first_and_falls_back_to_nvidia_smi(simhost):
    from agent.preflight import read_spec
    from tests.fakes import fake_nvml

    gpus = [{"busId": f"00000000:{b:02X}:00.0", "links": [1] * 18} for b in (0x19, 0x3B)]
    gpus[1]["links"] = [1] * 16 + [0, 0]
    got, cuda, source = read_spec(str(simhost.nvidia_smi), fake_nvml(gpus))
    assert source == "nvml" and cuda == "12.4" and [g.nvlink_up for g in got] == [18, 16]
    r = check_spec(Profile.from_mapping({**H100, "gpuCount": 2}), got, cuda)
    assert r.status == FAIL and "GPU 1 (00000000:3B:00.0): 16 NVLink links up, expected 18" in r.reason
    broken = fake_nvml(gpus)
    del broken.nvmlSystemGetCudaDriverVersion_v2
    got, cuda, source = read_spec(str(simhost.nvidia_smi), broken)
    assert source == "nvidia-smi" and len(got) == 8
    assert read_spec(str(simhost.nvidia_smi), None)[2] == "nvidia-smi"
