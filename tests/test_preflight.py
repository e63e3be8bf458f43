"""Preflight: profile and spec gate on the simulated host, orchestration and timeouts, onboarding on the
real apiserver (label, annotations, cordon/uncordon, Event), and the agent's requirePreflight option."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

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


def test_help_names_the_five_gates_and_the_exit_status():
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli", "preflight", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stderr == ""
    for gate in ("spec", "burnin", "nvlink", "cuda", "serving"):
        assert re.search(rf"^  {gate} +\S", r.stdout, re.M), gate  # one entry per gate, saying what it checks
    assert "five onboarding gates" in r.stdout and "exit status: 0 passed, 1 a gate failed" in r.stdout


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
        signal.pause()  # never finishes by itself: the 0.3 s timeout must end it
        return GateResult("burnin", PASS)

    def boom():
        raise RuntimeError("NVRTC compilation failed")

    res = run_gates(
        {
            "spec": lambda: GateResult("spec", PASS, "ok"),
            "burnin": slow,
            "cuda": boom,
            "serving": lambda: GateResult("serving", SKIP, "not configured"),
        },
        {"burnin": 0.3},
    )
    by = {r.gate: r for r in res}
    assert [r.gate for r in res] == ["spec", "burnin", "cuda", "serving"]
    assert by["burnin"].status == FAIL and "timed out after 0.3s" in by["burnin"].reason
    assert by["burnin"].timeout_s == 0.3  # stopped at its timeout (the reason above), not after it ended itself
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
    from testkit.fakes import fake_nvml

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
def test_passing_preflight_labels_and_uncordons(control_plane, admin, make_node):
    node = make_node(labels={"nvidia.com/gpu.present": "true", "gpu-ready.io/needs-preflight": "true"})

    def spec():  # runs in the gate's own process: its own client, its observation in the evidence
        api = control_plane.admin()
        try:
            return GateResult("spec", PASS, "8 GPUs match", {"cordoned": node_obj(api, node)[2]})
        finally:
            api.close()

    gates = {
        "spec": spec,
        "burnin": lambda: GateResult("burnin", PASS, "ok", {"tflops": 51.2}),
        "nvlink": lambda: GateResult("nvlink", PASS),
        "cuda": lambda: GateResult("cuda", PASS),
        "serving": lambda: GateResult("serving", SKIP, "not configured"),
    }
    ok, results = onboard(admin, node, gates, Profile.from_mapping({}), needs_label="gpu-ready.io/needs-preflight")
    assert ok and results[0].evidence["cordoned"] is True, "the node is cordoned while the gates run"
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
    from testkit.fakes import fake_nvml

    gpus = [{"busId": "00000000:19:00.0", "remap": (0, 0, 0, 0), "throttle": 0x4 | 0x20}]  # power + thermal cap
    gates = build_gates(_burnin_profile("sleep 1.5"), "nvidia-smi", None, fake_nvml(gpus), str(simhost.kmsg))
    r = run_gates({"burnin": gates["burnin"]}, {})[0]  # in its own process: the stand-in is forked with it
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
    from testkit.fakes import fake_nvml

    gpus = [{"busId": "00000000:19:00.0", "remap": (0, 0, 0, 0)}]
    simhost.append_xid(79, 0)  # logged before the burn-in: must not count
    nv = fake_nvml(gpus)
    started = simhost.root / "burnin-started"  # the command runs after the watch took its baseline
    gates = build_gates(
        _burnin_profile(f"sh -c 'touch {started}; sleep 2.5'"), "nvidia-smi", None, nv, str(simhost.kmsg)
    )

    def fault_midway():
        from testkit.harness import wait_for

        wait_for(started.exists, 30, 0.01, "the burn-in command to start")
        change(gpus, simhost)

    import threading

    t = threading.Thread(target=fault_midway)
    t.start()
    r = gates["burnin"]()  # in this process, so that the fault injected into the NVML stand-in is seen
    t.join()
    assert r.status == FAIL and needle in r.reason, r.reason
    assert "Xid 79" not in r.reason


def test_burnin_without_nvml_cannot_pass(simhost):
    gates = build_gates(_burnin_profile("true"), "nvidia-smi", None, None, str(simhost.kmsg))
    r = run_gates({"burnin": gates["burnin"]}, {})[0]
    assert r.status == FAIL and "NVML unavailable" in r.reason


def test_spec_reads_nvml_first_and_falls_back_to_nvidia_smi(simhost):
    from agent.preflight import read_spec
    from testkit.fakes import fake_nvml

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


# -- profile types (a quoted `gpuCount: "8"` once failed with "expected 8 GPUs, found 8") --------------------


def test_profile_values_are_converted_to_their_types(simhost):
    p = Profile.from_mapping({**H100, "gpuCount": "8", "pcieGen": "5", "eccEnabled": "true", "burnInSeconds": "60"})
    assert (p.gpu_count, p.pcie_gen, p.ecc_enabled, p.burnin_seconds) == (8, 5, True, 60.0)
    gpus, cuda = read_spec_nvidia_smi(str(simhost.nvidia_smi))
    r = check_spec(p, gpus, cuda)
    assert r.status == PASS, r.reason


@pytest.mark.parametrize(
    ("profile", "needle"),
    [
        ({"gpuCount": "eight"}, "gpuCount"),
        ({"gpuCount": 8.5}, "gpuCount"),
        ({"gpuCount": True}, "gpuCount"),
        ({"gpuCount": -1}, "gpuCount"),
        ({"driverVersion": 550.9}, "driverVersion"),
        ({"cudaVersion": "about 12"}, "cudaVersion"),
        ({"eccEnabled": "maybe"}, "eccEnabled"),
        ({"migMode": "on"}, "migMode"),
        ({"timeouts": {"burnin": "nan"}}, "timeouts"),
        ({"timeouts": {"burnin": 0}}, "timeouts"),
        ({"allowSkip": "serving"}, "allowSkip"),
        ({"serving": {"command": "x", "expectOutput": "("}}, "serving"),
        ({"serving": {"cmd": "x"}}, "serving"),
        ({"p2pMinGBps": "inf"}, "p2pMinGBps"),
    ],
)
def test_bad_profile_values_name_the_key(profile, needle):
    with pytest.raises(ProfileError, match=needle):
        Profile.from_mapping(profile)


def test_bad_profile_exits_2_with_one_line_and_a_string_count_passes(simhost, tmp_path):
    prof = tmp_path / "p.yaml"
    base = [sys.executable, "-m", "agent.cli", "preflight", "--profile", str(prof), "--gates", "spec"]
    prof.write_text('gpuCount: "eight"\n')
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "gpuCount" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    prof.write_text('gpuCount: "8"\ngpuModel: H100\n')
    r = subprocess.run([*base, "--nvidia-smi", str(simhost.nvidia_smi)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "8 GPUs match the profile" in r.stdout, r.stdout + r.stderr


# -- process groups: a gate or command that overruns is killed with everything it started ------------------


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def pids_in(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_timed_out_gate_is_killed_with_its_tree_before_the_next_gate(tmp_path):
    pids, ticks, shell = tmp_path / "pids", tmp_path / "ticks", tmp_path / "shell"
    script = (
        f"echo $$ > {shell}; sleep 300 & echo $! >> {pids}; setsid sleep 300 & echo $! >> {pids}; "
        f"while :; do echo tick >> {ticks}; sleep 0.05; done"
    )

    def runaway():
        import subprocess as sp

        sp.Popen(["sh", "-c", script])
        signal.pause()  # runs until the gate's timeout kills it
        return GateResult("burnin", PASS)

    def observer():
        from testkit.harness import wait_for

        wait_for(lambda: len(pids_in(pids)) == 2, 10, what="the runaway's children")
        before = ticks.stat().st_size
        # Its ticking shell, killed before this gate started, is gone at once; a runaway still running never is
        # (this gate then fails) and one killed late ticks meanwhile (`grew` above 0).
        wait_for(lambda: not alive(pids_in(shell)[0]), 10, what="the runaway's shell to be gone")
        return GateResult("nvlink", PASS, evidence={"grew": ticks.stat().st_size - before})

    res = {r.gate: r for r in run_gates({"burnin": runaway, "nvlink": observer}, {"burnin": 3.0})}
    assert res["burnin"].status == FAIL and "timed out after 3s" in res["burnin"].reason
    assert res["nvlink"].status == PASS and res["nvlink"].evidence["grew"] == 0, res["nvlink"]
    from testkit.harness import wait_for

    assert len(pids_in(pids)) == 2
    wait_for(lambda: not any(alive(p) for p in pids_in(pids)), 10, what="the gate's processes to be gone")


def test_command_runs_in_its_own_group_and_is_killed_with_it_on_timeout(tmp_path):
    from agent.preflight import run_command_gate
    from testkit.harness import wait_for

    pids = tmp_path / "pids"
    cmd = (
        'sh -c \'echo pgid=$(cut -d" " -f5 /proc/$$/stat) pid=$$; sleep 300 & echo $! >> '
        f"{pids}; setsid sleep 300 & echo $! >> {pids}; sleep 300'"
    )
    r = run_command_gate("serving", cmd, timeout_s=3.0)
    assert r.status == FAIL and "timed out after 3s" in r.reason, r.reason
    m = re.search(r"pgid=(\d+) pid=(\d+)", r.evidence["output_tail"])
    assert m and m.group(1) == m.group(2) and int(m.group(1)) != os.getpgrp(), r.evidence
    assert len(pids_in(pids)) == 2
    wait_for(lambda: not any(alive(p) for p in pids_in(pids)), 10, what="the command's processes to be gone")


def test_daemon_left_by_a_passing_command_dies_with_its_gate(tmp_path):
    from testkit.harness import wait_for

    pid_file = tmp_path / "daemon"
    serve = tmp_path / "serve.sh"
    serve.write_text(
        "#!/bin/sh\n"
        f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 300' &\n"
        f"while [ ! -s {pid_file} ]; do sleep 0.01; done\n"
        "echo Paris\n"
    )
    serve.chmod(0o755)
    prof = Profile.from_mapping({"serving": {"command": str(serve), "expectOutput": "Paris"}})
    res = run_gates({"serving": build_gates(prof, "nvidia-smi")["serving"]}, {})[0]
    assert res.status == PASS, res.reason
    pid = pids_in(pid_file)[0]
    wait_for(lambda: not alive(pid), 10, what="the daemon the command left behind to be gone")


# -- the Job's steps: cordon (token) -> gates (no token) -> record (token) -------------------------------------


def _serve_script(tmp_path, body: str):
    serve = tmp_path / "serve.sh"
    serve.write_text("#!/bin/sh\n" + body + "\n")
    serve.chmod(0o755)
    return serve


def test_gates_step_refuses_to_run_with_a_token_mounted(tmp_path):
    marker = tmp_path / "ran"
    serve = _serve_script(tmp_path, f"touch {marker}; echo Paris")
    prof = tmp_path / "p.yaml"
    prof.write_text(json.dumps({"serving": {"command": str(serve)}}))
    token = tmp_path / "token"
    token.write_text("secret")
    cmd = [sys.executable, "-m", "agent.cli", "preflight", "--profile", str(prof), "--step", "gates"]
    cmd += ["--results", str(tmp_path / "r.json"), "--gates", "serving", "--sa-token-path", str(token)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "refusing to run the gates with a ServiceAccount token" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not marker.exists()


def test_gates_step_runs_commands_without_api_credentials_and_writes_results(tmp_path):
    from agent.preflight import read_results

    env_dump = tmp_path / "env"
    serve = _serve_script(tmp_path, f"env > {env_dump}; echo Paris")
    prof = tmp_path / "p.yaml"
    prof.write_text(json.dumps({"serving": {"command": str(serve), "expectOutput": "Paris"}}))
    results = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "agent.cli", "preflight", "--profile", str(prof), "--step", "gates"]
    cmd += ["--results", str(results), "--gates", "serving", "--sa-token-path", str(tmp_path / "no-token")]
    env = {**os.environ, "KUBECONFIG": "/etc/kubeconfig", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = env_dump.read_text()
    assert "KUBECONFIG" not in seen and "KUBERNETES_SERVICE_HOST" not in seen and "PATH=" in seen
    got = read_results(str(results))
    assert [(g.gate, g.status) for g in got] == [("serving", PASS)]
    missing = read_results(str(tmp_path / "absent.json"))
    assert len(missing) == 1 and missing[0].status == FAIL and "no usable results" in missing[0].reason
    (tmp_path / "bad.json").write_text('{"gates": [{"gate": "spec", "status": "great"}]}')
    assert read_results(str(tmp_path / "bad.json"))[0].status == FAIL


@pytest_apiserver
def test_job_steps_pass_the_chart_policy_with_the_preflight_token(control_plane, admin, make_node, tmp_path):
    """The three steps as the chart's Job runs them, each a separate process; cordon and record with the
    preflight ServiceAccount's token bound to a pod on the node, under the chart's own RBAC and policies."""
    from testkit.chart import apply_release
    from testkit.cluster import bound_token
    from testkit.harness import wait_for

    kc_admin = control_plane.kubeconfig(tmp_path / "admin")
    rel = apply_release(control_plane, kc_admin, "pfjob", ["--set", "preflight.enabled=true"])
    node = make_node(labels={"gpu-ready.io/needs-preflight": "true", "nvidia.com/gpu.present": "true"})
    token, _ = bound_token(admin, rel.ns, f"{rel.fullname}-preflight", node)
    kc = control_plane.kubeconfig(tmp_path / "preflight", token=token, user="preflight")
    other = make_node()

    def probe_denied():  # the policy loads asynchronously: wait until it denies a foreign node
        r = subprocess.run(step("cordon", "--node", other), capture_output=True, text=True, timeout=120)
        if r.returncode == 0:  # not loaded yet: the cordon went through; undo it so the next probe patches again
            admin.patch_node(
                other, {"spec": {"unschedulable": False}, "metadata": {"annotations": {CORDONED_BY: None}}}
            )
        return r.returncode == 2 and "preflight-own-node-only" in r.stderr

    prof = tmp_path / "p.yaml"
    serve = _serve_script(tmp_path, "echo Paris")
    prof.write_text(json.dumps({"serving": {"command": str(serve), "expectOutput": "Paris"}}))
    results = tmp_path / "results.json"

    def step(name, *extra):
        return [
            sys.executable, "-m", "agent.cli", "preflight", "--profile", str(prof), "--step", name,
            "--results", str(results), "--kubeconfig", str(kc), "--gates", "serving", *extra,
        ]  # fmt: skip

    wait_for(probe_denied, 60, 0.5, "the preflight policy to deny another node")
    assert not node_obj(admin, other)[2]
    r = subprocess.run(step("cordon", "--node", node), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert node_obj(admin, node)[2], "cordoned"
    r = subprocess.run(
        step("gates", "--sa-token-path", str(tmp_path / "none")), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and results.exists(), r.stderr
    r = subprocess.run(step("record", "--node", node), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    labels, ann, cordoned = node_obj(admin, node)
    assert labels["preflight"] == "passed" and "gpu-ready.io/needs-preflight" not in labels and not cordoned
    assert CORDONED_BY not in ann and json.loads(ann[REPORT_ANNOTATION])["serving"]["status"] == "pass"
    # a failing run: the record step cordons, labels failed and writes the Event in the Events namespace
    serve.write_text("#!/bin/sh\necho Berlin\n")
    for name in ("cordon", "gates", "record"):
        extra = ("--sa-token-path", str(tmp_path / "none")) if name == "gates" else ("--node", node)
        r = subprocess.run(step(name, *extra), capture_output=True, text=True, timeout=120)
        assert r.returncode == (1 if name == "record" else 0), (name, r.stdout + r.stderr)
    labels, _, cordoned = node_obj(admin, node)
    assert labels["preflight"] == "failed" and cordoned
    events = admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    mine = [e for e in events if e["regarding"]["name"] == node and e["reason"] == "PreflightFailed"]
    assert len(mine) == 1 and "gate serving fail" in mine[0]["note"]
