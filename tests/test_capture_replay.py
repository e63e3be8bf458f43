"""`gpu-ready capture` and `gpu-ready check --replay` on the simulated node: a bundle captured there replays to the
verdict the live check gave (healthy, ERR!, Xid 79, a GPU missing from nvidia-smi, NVML faults recorded through the
NVML seam), with identifiers redacted; a bad bundle is one line and exit 2."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile

import pytest

from agent import bundle as bundle_mod
from agent import capture as capture_mod
from agent import cli
from testkit.fakes import fake_nvml
from testkit.fixture_files import FIXTURES

KEYS = ("status", "reason", "message", "gpus", "counts")


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def live(capsys, simhost, *extra):
    rc, out, err = run_cli(capsys, "check", "--json", *simhost.check_args(), *extra)
    assert rc in (0, 1, 3), err
    return rc, json.loads(out)


def capture(capsys, simhost, path, *extra, args=None):
    rc, out, err = run_cli(capsys, "capture", "-o", str(path), *(args or simhost.check_args()), *extra)
    assert rc == 0, err
    assert out.strip() == str(path)
    assert "gpu-ready capture: wrote" in err and "Traceback" not in err
    return err


def replay(capsys, path, *extra):
    rc, out, err = run_cli(capsys, "check", "--json", "--replay", str(path), *extra)
    assert rc in (0, 1, 3), err
    return rc, json.loads(out), err


def same(a, b):
    """The same verdict; a path in a message names the node's folder live and the replay's folder in a replay."""

    def norm(v):
        return json.loads(re.sub(r"/[^ \"']*/(dev|sys|proc)/", r"<\1>/", json.dumps({k: v[k] for k in KEYS})))

    return norm(a) == norm(b)


@pytest.mark.parametrize("form", ["dir", "tar.gz"])
@pytest.mark.parametrize("state", ["healthy", "err", "xid79", "missing", "devnode"])
def test_sim_bundle_replays_to_the_live_verdict(capsys, simhost, tmp_path, state, form):
    if state == "err":
        simhost.set_smi(err={1: ("Fan", "Temp")})
    elif state == "xid79":
        simhost.append_xid(79, gpu=5)
    elif state == "missing":
        simhost.set_smi(hidden=(3,))
    elif state == "devnode":
        simhost.make_dev_nodes(mig=True, skip=("nvidia-uvm",))
        simhost.replace_dev_node_with_file("nvidia3")
    rc_live, want = live(capsys, simhost)
    path = tmp_path / ("bundle" if form == "dir" else "bundle.tar.gz")
    capture(capsys, simhost, path)
    rc, got, err = replay(capsys, path)
    assert (rc, got["status"], got["reason"]) == (rc_live, want["status"], want["reason"])
    assert same(got, want), (got["message"], want["message"])
    assert "not captured" not in err  # a capture holds every source these settings read
    expect = {
        "healthy": "GPUsHealthy",
        "err": "NvidiaSmiErr",
        "xid79": "FatalXid",
        "missing": "GPUCountMismatch",
        "devnode": "GPUDegraded",
    }
    assert want["reason"] == expect[state]
    meta = bundle_mod.load(str(path)).meta
    assert meta["verdict"]["status"] == want["status"] and meta["captured"]["redacted"] is True


def test_replay_takes_the_bundles_settings_unless_flags_override(capsys, simhost, tmp_path):
    simhost.set_smi(hidden=(3,))
    path = tmp_path / "b"
    capture(capsys, simhost, path, "--expected-gpus", "8")
    _, got, _ = replay(capsys, path)
    assert "expected 8 GPUs, found 7" in got["message"]
    _, got, _ = replay(capsys, path, "--expected-gpus", "7")
    assert "expected 8" not in got["message"]


def _nvml_gpus(simhost, **first):
    gpus = [{"busId": g.address.nvml, "remap": (0, 0, False, False), "links": [1] * 18} for g in simhost.gpus]
    gpus[0].update(first)
    return gpus


@pytest.mark.parametrize(
    "fault,reason,words",
    [
        ({}, "GPUsHealthy", "8 GPUs healthy"),
        ({"remap": (0, 3, False, True)}, "NvmlHealth", "row remapping failed"),
        ({"recovery": 2}, "NvmlHealth", "GPU recovery action: node reboot"),
        ({"handle_error": 15}, "NvmlHealth", "fell off the bus"),
        ({"fabric": {"state": 3, "status": 0, "health": 1}}, "GPUDegraded", "Bandwidth: Degraded"),
        ({"fabric": {"state": 1, "status": 0}}, "FabricNotReady", "fabric state Not Started"),
    ],
)
def test_nvml_readings_replay_through_the_same_probe(capsys, simhost, tmp_path, monkeypatch, fault, reason, words):
    """The capture judges the node through the recording NVML backend; the replay runs the same NVML probe code on
    the record and reaches the verdict the live library gave."""
    lib = fake_nvml(_nvml_gpus(simhost, **fault))
    monkeypatch.setattr(capture_mod, "_pynvml", lambda: lib)
    args = [a for a in simhost.check_args() if a not in ("--nvml", "off")]
    path = tmp_path / "b.tar.gz"
    capture(capsys, simhost, path, args=args)
    meta = bundle_mod.load(str(path)).meta
    assert meta["verdict"]["reason"] == reason and words in meta["verdict"]["message"]
    _, got, err = replay(capsys, path)
    assert (got["reason"], got["message"]) == (reason, meta["verdict"]["message"])
    assert "NVML readings not captured" not in err
    record = json.loads(bundle_mod.load(str(path)).files["nvml.json"])
    assert len(record["gpus"]) == 8 and all(g["calls"] for g in record["gpus"])


def test_nvml_call_missing_from_the_record_is_said(capsys, simhost, tmp_path, monkeypatch):
    lib = fake_nvml(_nvml_gpus(simhost))
    monkeypatch.setattr(capture_mod, "_pynvml", lambda: lib)
    args = [a for a in simhost.check_args() if a not in ("--nvml", "off")]
    path = tmp_path / "b"
    capture(capsys, simhost, path, args=args)
    record = json.loads((path / "nvml.json").read_text())
    for g in record["gpus"]:
        g["calls"] = [c for c in g["calls"] if c["call"] != "nvmlDeviceGetRemappedRows"]
    (path / "nvml.json").write_text(json.dumps(record))
    _, got, err = replay(capsys, path)
    assert got["status"] == "True"
    assert "NVML readings not captured (answered NOT_SUPPORTED): 8 (nvmlDeviceGetRemappedRows" in err


def test_redaction_keeps_the_verdict(capsys, simhost, tmp_path, monkeypatch):
    lib = fake_nvml(_nvml_gpus(simhost))
    monkeypatch.setattr(capture_mod, "_pynvml", lambda: lib)
    args = [a for a in simhost.check_args() if a not in ("--nvml", "off")]
    path, kept = tmp_path / "r", tmp_path / "k"
    capture(capsys, simhost, path, args=args)
    capture(capsys, simhost, kept, "--no-redact", args=args)
    uuids = [u for _, u, _ in simhost.gpu_uuids()]
    text = "".join(p.read_text(errors="replace") for p in path.rglob("*") if p.is_file())
    assert not any(u in text for u in uuids) and not any(u[4:] in text for u in uuids)
    assert any(u in (kept / "nvlink-s.txt").read_text() for u in uuids)
    _, a, _ = replay(capsys, path)
    _, b, _ = replay(capsys, kept)
    assert same(a, b)


def test_redactor_replaces_each_value_by_one_stand_in():
    r = capture_mod.Redactor(("gpu-node-7",))
    s = (
        "GPU-1c7e6a3e-0f6c-4b3c-9d8e-3a6a1b2c3d4e on gpu-node-7 10.2.3.4 fe80::1 aa:bb:cc:dd:ee:ff\n"
        "    Serial Number : 1652823045678\nGPU-1c7e6a3e-0f6c-4b3c-9d8e-3a6a1b2c3d4e 00000000:19:00.0 535.129.03\n"
    )
    out = r.text(s)
    assert "gpu-node-7" not in out and "10.2.3.4" not in out and "fe80::1" not in out and "aa:bb" not in out
    assert "1652823045678" not in out and "1c7e6a3e" not in out
    assert "00000000:19:00.0" in out and "535.129.03" in out
    first, second = (line.split()[0] for line in (out.splitlines()[0], out.splitlines()[2]))
    assert first == second and first.startswith("GPU-")


def test_capture_without_a_gpu_is_one_bundle_not_a_traceback(capsys, tmp_path):
    path = tmp_path / "b"
    rc, _, err = run_cli(
        capsys,
        "capture",
        "-o",
        str(path),
        "--nvidia-smi",
        str(tmp_path / "none"),
        "--sysfs-root",
        str(tmp_path / "nosys"),
        "--dev-root",
        str(tmp_path / "nodev"),
        "--kmsg",
        str(tmp_path / "nokmsg"),
        "--nvml",
        "off",
    )
    assert rc == 0 and "Traceback" not in err
    rc, _out, err = run_cli(capsys, "check", "--replay", str(path))
    assert rc == 3 and "Traceback" not in err  # nvidia-smi was not found: could not check, as live


def test_capture_refuses_to_overwrite(capsys, simhost, tmp_path):
    (tmp_path / "b").mkdir()
    rc, _, err = run_cli(capsys, "capture", "-o", str(tmp_path / "b"), *simhost.check_args())
    assert rc == 2 and err.count("\n") == 1 and "exists" in err


# -- bad bundles: one line, exit 2 ----------------------------------------------------------------------------


def _tar(path, members):
    """members: (name, kind, data/target)."""
    with tarfile.open(path, "w:gz") as tf:
        for name, kind, payload in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            elif kind == "sym":
                ti.type, ti.linkname = tarfile.SYMTYPE, payload
                tf.addfile(ti)
            elif kind == "hard":
                ti.type, ti.linkname = tarfile.LNKTYPE, payload
                tf.addfile(ti)
            elif kind == "chr":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
                tf.addfile(ti)
    return path


META = json.dumps({"format": bundle_mod.FORMAT, "settings": {}}).encode()


@pytest.mark.parametrize(
    "members,words",
    [
        ([("bundle.json", "sym", "/etc/passwd")], "symbolic link outside"),
        ([("bundle.json", "file", META), ("sys/x", "sym", "../../etc")], "points outside sys/"),
        ([("bundle.json", "file", META), ("sys/x", "sym", "/etc")], "points outside the bundle"),
        ([("bundle.json", "file", META), ("../evil", "file", b"x")], "leaves the bundle"),
        ([("bundle.json", "file", META), ("/abs", "file", b"x")], "absolute path"),
        ([("bundle.json", "file", META), ("sys/h", "hard", "bundle.json")], "not a regular file"),
        ([("bundle.json", "file", META), ("dev/null", "chr", None)], "not a regular file"),
        ([("bundle.json", "file", META), ("sys/l", "sym", "d"), ("sys/l/f", "file", b"x")], "below a symbolic link"),
        (
            [
                ("bundle.json", "file", META),
                ("sys/p/q", "sym", ".."),
                ("sys/r", "sym", "p/q/.."),
                ("sys/w", "sym", "r/.."),
            ],
            "resolves outside sys/",
        ),
        ([("bundle.json", "file", b"{not json")], "bundle.json is not JSON"),
        ([("bundle.json", "file", b'{"format": "other"}')], "expected 'gpu-ready-bundle/1'"),
        ([("x.txt", "file", b"x")], "no bundle.json"),
        ([("bundle.json", "file", META), ("nvml.json", "file", b'{"format": "x"}')], "nvml.json: not a"),
        ([("bundle.json", "file", META), ("runs.json", "file", b"[]")], "runs.json: not a"),
        ([("bundle.json", "file", META), ("dev.json", "file", b'{"nodes": [{"name": "../x"}]}')], "bad device"),
        (
            [("bundle.json", "file", json.dumps({"format": bundle_mod.FORMAT, "settings": {"noSuch": 1}}).encode())],
            "unknown setting",
        ),
        (
            [
                (
                    "bundle.json",
                    "file",
                    json.dumps({"format": bundle_mod.FORMAT, "settings": {"pollInterval": "x"}}).encode(),
                )
            ],
            "poll",
        ),
    ],
)
def test_hostile_or_broken_bundle_is_one_line(capsys, tmp_path, members, words):
    path = _tar(tmp_path / "b.tar.gz", members)
    rc, out, err = run_cli(capsys, "check", "--replay", str(path))
    assert rc == 2 and out == "", err
    assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path.parent / "evil").exists()


def test_corrupted_truncated_and_oversized_archives(capsys, simhost, tmp_path, monkeypatch):
    good = tmp_path / "good.tar.gz"
    capture(capsys, simhost, good)
    data = good.read_bytes()
    cases = {
        "garbage.tar.gz": os.urandom(4096),
        "truncated.tar.gz": data[: len(data) // 2],
        "flipped.tar.gz": data[:200] + bytes(b ^ 0xFF for b in data[200:400]) + data[400:],
        "empty.tar.gz": b"",
    }
    for name, payload in cases.items():
        (tmp_path / name).write_bytes(payload)
        rc, _out, err = run_cli(capsys, "check", "--replay", str(tmp_path / name))
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (name, err)
    big = tmp_path / "big.tar.gz"
    with open(big, "wb") as fh:
        fh.truncate(bundle_mod.MAX_ARCHIVE + 1)  # sparse: no disk used
    rc, _, err = run_cli(capsys, "check", "--replay", str(big))
    assert rc == 2 and "larger than" in err
    rc, _, err = run_cli(capsys, "check", "--replay", str(tmp_path / "absent"))
    assert rc == 2 and "No such file" in err


def test_tar_bomb_and_too_many_members(capsys, tmp_path, monkeypatch):
    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz") as tf:
        ti = tarfile.TarInfo("bundle.json")
        ti.size = len(META)
        tf.addfile(ti, io.BytesIO(META))
        ti = tarfile.TarInfo("huge.txt")
        ti.size = bundle_mod.MAX_FILE + 1
        tf.addfile(ti, io.BytesIO(bytes(ti.size)))  # zeros: a few KiB compressed
    assert bomb.stat().st_size < 1 << 20
    rc, _, err = run_cli(capsys, "check", "--replay", str(bomb))
    assert rc == 2 and "larger than" in err
    monkeypatch.setattr(bundle_mod, "MAX_MEMBERS", 10)
    many = _tar(
        tmp_path / "many.tar.gz", [("bundle.json", "file", META)] + [(f"f{i}", "file", b"x") for i in range(11)]
    )
    rc, _, err = run_cli(capsys, "check", "--replay", str(many))
    assert rc == 2 and "more than 10 entries" in err
    monkeypatch.setattr(bundle_mod, "MAX_TOTAL", 100)
    big = _tar(tmp_path / "total.tar.gz", [("bundle.json", "file", META), ("a", "file", bytes(200))])
    rc, _, err = run_cli(capsys, "check", "--replay", str(big))
    assert rc == 2 and "unpacked" in err


def test_directory_bundle_with_an_escaping_link_or_a_fifo(capsys, tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "bundle.json").write_bytes(META)
    (d / "sys").mkdir()
    (d / "sys" / "x").symlink_to("/etc")
    rc, _, err = run_cli(capsys, "check", "--replay", str(d))
    assert rc == 2 and "points outside the bundle" in err
    (d / "sys" / "x").unlink()
    os.mkfifo(d / "fifo")
    rc, _, err = run_cli(capsys, "check", "--replay", str(d))
    assert rc == 2 and "not a regular file" in err


def test_gpu_smoke_writes_a_node_bundle_that_replays(simhost, tmp_path):
    """`make gpu-smoke` on a node (here the simulated one's nvidia-smi) writes a bundle with `gpu-ready capture` and
    its replay's verdict beside it, so a first real GPU run can join the corpus."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(
        os.environ,
        NVIDIA_SMI=str(simhost.nvidia_smi),
        GPU_SMOKE_OUT=str(tmp_path / "out"),
        GPU_SMOKE_GATES="spec",
        PY=sys.executable,
    )
    r = subprocess.run(
        ["bash", str(root / "tools" / "gpu-smoke.sh")], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (out,) = (tmp_path / "out").iterdir()
    (bundle,) = out.glob("bundle-*")
    assert (bundle / "bundle.json").is_file() and (bundle / "nvidia-smi-q.txt").is_file()
    codes = (out / "exit-codes.txt").read_text()
    assert any(line.startswith("0 gpu-ready-capture-") for line in codes.splitlines()), codes
    replayed = json.loads(next(out.glob("gpu-ready-replay-*.json")).read_text())
    assert replayed["status"] == bundle_mod.load(str(bundle)).meta["verdict"]["status"]
    assert f"node bundle: {bundle}" in r.stdout


@pytest.mark.parametrize("path", sorted((FIXTURES / "bundles").glob("*.tar.gz")), ids=lambda p: p.name)
def test_committed_bundle_still_replays_to_its_recorded_verdict(capsys, path):
    """A bundle written by an earlier version (testkit/sim_bundles.py) keeps loading and judges as it did."""
    meta = bundle_mod.load(str(path)).meta
    _, got, err = replay(capsys, path)
    assert (got["status"], got["reason"], got["message"]) == (
        meta["verdict"]["status"],
        meta["verdict"]["reason"],
        meta["verdict"]["message"],
    )
    assert "not captured" not in err


def test_hung_nvml_call_is_recorded_and_replays_as_hung(capsys, simhost, tmp_path, monkeypatch):
    """A call that never returned at the capture (the probe gave up at its deadline) replays as the same hang."""
    lib = fake_nvml(_nvml_gpus(simhost), hang="nvmlDeviceGetRemappedRows")
    monkeypatch.setattr(capture_mod, "_pynvml", lambda: lib)
    args = [a for a in simhost.check_args() if a not in ("--nvml", "off")]
    path = tmp_path / "b"
    capture(capsys, simhost, path, "--nvml-timeout", "0.5", args=args)
    meta = bundle_mod.load(str(path)).meta
    assert meta["verdict"]["reason"] == "NvmlHealth" and "NVML hung" in meta["verdict"]["message"]
    record = json.loads((path / "nvml.json").read_text())
    assert [c["call"] for g in record["gpus"] for c in g["calls"] if c.get("hung")] == ["nvmlDeviceGetRemappedRows"]
    _, got, _ = replay(capsys, path)
    assert (got["status"], got["reason"]) == ("False", "NvmlHealth") and "NVML hung" in got["message"]


def test_replay_leaves_no_files_behind(capsys, simhost, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = tmp_path / "b.tar.gz"
    capture(capsys, simhost, path)
    replay(capsys, path)
    run_cli(capsys, "check", "--replay", str(tmp_path / "absent"))
    assert list((tmp_path / "tmp").iterdir()) == []


def test_capture_runs_the_spec_gates_query():
    from agent.preflight.spec import QUERY

    assert capture_mod.SPEC_QUERY == QUERY


def _ctypes_nvml(buses):
    """An NVML stand-in that answers with the library's own ctypes types, as libnvidia-ml does through nvidia-ml-py:
    device handles are `c_nvmlDevice_t` pointers, the PCI info, field values and utilisation are the library's
    structures, the fabric structure is filled by reference. GPU 1's recovery action is "GPU reset" and its fabric
    bandwidth degraded."""
    import ctypes
    import types

    import pynvml

    devices = [pynvml.struct_c_nvmlDevice_t() for _ in buses]
    index = {ctypes.addressof(d): i for i, d in enumerate(devices)}

    def at(h):
        return index[ctypes.addressof(h.contents)]

    def not_supported(*a):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def pci(h):
        info = pynvml.nvmlPciInfo_t()
        info.busId = buses[at(h)].encode()
        return info

    def fields(h, ids):
        vals = (pynvml.c_nvmlFieldValue_t * len(ids))()
        vals[0].fieldId, vals[0].nvmlReturn, vals[0].value.uiVal = ids[0], 0, 1 if at(h) == 1 else 0
        return vals

    def link(h, n):
        if n >= 18:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def fabric(h, ref):
        info = ref._obj
        info.state, info.status, info.cliqueId = 3, 0, 7
        info.healthMask = 1 if at(h) == 1 else 2  # bandwidth degraded / full
        return 0

    lib = types.SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        byref=ctypes.byref,
        c_nvmlGpuFabricInfoV_t=pynvml.c_nvmlGpuFabricInfoV_t,
        NVML_FEATURE_ENABLED=pynvml.NVML_FEATURE_ENABLED,
        NVML_NVLINK_MAX_LINKS=pynvml.NVML_NVLINK_MAX_LINKS,
        NVML_ERROR_NOT_SUPPORTED=pynvml.NVML_ERROR_NOT_SUPPORTED,
        NVML_DEVICE_MIG_ENABLE=pynvml.NVML_DEVICE_MIG_ENABLE,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "550.90.07",
        nvmlDeviceGetCount=lambda: len(buses),
        nvmlDeviceGetHandleByIndex=lambda i: ctypes.pointer(devices[i]),
        nvmlDeviceGetPciInfo=pci,
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetFieldValues=fields,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, 0, 0),
        nvmlDeviceGetMigMode=lambda h: [0, 0],
        nvmlDeviceGetNvLinkState=link,
        nvmlDeviceGetNvLinkRemoteDeviceType=not_supported,
        nvmlDeviceGetUtilizationRates=lambda h: pynvml.c_nvmlUtilization_t(gpu=3, memory=1),
        nvmlDeviceGetGpuFabricInfoV=fabric,
        nvmlDeviceGetCurrPcieLinkGeneration=not_supported,
        nvmlDeviceGetMaxPcieLinkGeneration=not_supported,
        nvmlDeviceGetCurrPcieLinkWidth=not_supported,
        nvmlDeviceGetMaxPcieLinkWidth=not_supported,
        nvmlDeviceGetCurrentClocksEventReasons=not_supported,
        nvmlDeviceGetMarginTemperature=not_supported,
        nvmlDeviceGetUUID=not_supported,
    )
    return lib


def test_library_ctypes_answers_record_and_replay(capsys, tmp_path, monkeypatch):
    """The recording backend on the library's real ctypes types (pointer handles, structures, unions, a structure
    filled by reference) writes a record the replay answers the same way."""
    from testkit.simhost import SimHost

    host = SimHost(tmp_path / "host", gpus=2)
    lib = _ctypes_nvml([g.address.nvml for g in host.gpus])
    monkeypatch.setattr(capture_mod, "_pynvml", lambda: lib)
    args = [a for a in host.check_args() if a not in ("--nvml", "off")]
    path = tmp_path / "b"
    capture(capsys, host, path, args=args)
    meta = bundle_mod.load(str(path)).meta
    assert meta["verdict"]["reason"] == "NvmlHealth"
    assert "GPU recovery action: GPU reset" in meta["verdict"]["message"]
    assert "Bandwidth: Degraded" in meta["verdict"]["message"]
    record = json.loads((path / "nvml.json").read_text())
    calls = {c["call"]: c for c in record["gpus"][1]["calls"]}
    assert calls["nvmlDeviceGetPciInfo"]["value"]["_struct"]["busId"] == host.gpus[1].address.nvml
    assert calls["nvmlDeviceGetGpuFabricInfoV"]["out"]["_struct"]["healthMask"] == 1
    _, got, err = replay(capsys, path)
    assert (got["status"], got["reason"], got["message"]) == (
        meta["verdict"]["status"],
        meta["verdict"]["reason"],
        meta["verdict"]["message"],
    )
    assert "NVML readings not captured" not in err


def test_capture_with_a_saved_node_replays_the_device_plugin_check(capsys, simhost, tmp_path):
    node = {
        "kind": "Node",
        "metadata": {"name": "gpu-node-7", "labels": {}, "annotations": {}},
        "status": {
            "capacity": {"nvidia.com/gpu": "7"},
            "allocatable": {"nvidia.com/gpu": "7"},
            "addresses": [{"type": "InternalIP", "address": "10.1.2.3"}],
        },
    }
    nj = tmp_path / "node.json"
    nj.write_text(json.dumps(node))
    rc_live, want = live(capsys, simhost, "--node-json", str(nj))
    assert want["reason"] == "GPUCountMismatch" and "device plugin serves 7" in want["message"]
    path = tmp_path / "b"
    capture(capsys, simhost, path, "--node-json", str(nj))
    kept = json.loads((path / "node.json").read_text())
    assert kept["status"]["addresses"][0]["address"] != "10.1.2.3"  # redacted
    rc, got, _ = replay(capsys, path)
    assert rc == rc_live and same(got, want)
    rc, _, err = run_cli(capsys, "capture", "-o", str(tmp_path / "c"), "--node-json", str(tmp_path / "none"))
    assert rc == 2 and err.count("\n") == 1 and "--node-json" in err
