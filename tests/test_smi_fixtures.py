"""Every nvidia-smi sample in tests/fixtures, with what it must read as."""

from __future__ import annotations

import pytest

from agent.model import Reason, Severity
from agent.probes.nvidia_smi import parse_smi_table, smi_findings
from testkit.fixture_files import FIXTURES, fixture_path

H100X8 = [
    "00000000:19:00.0",
    "00000000:3B:00.0",
    "00000000:4C:00.0",
    "00000000:5D:00.0",
    "00000000:9B:00.0",
    "00000000:BB:00.0",
    "00000000:CB:00.0",
    "00000000:DB:00.0",
]
MIG_H100X8 = [
    "00000000:1B:00.0",
    "00000000:43:00.0",
    "00000000:52:00.0",
    "00000000:61:00.0",
    "00000000:9D:00.0",
    "00000000:C3:00.0",
    "00000000:D1:00.0",
    "00000000:DF:00.0",
]
GTX1080X8 = [
    "00000000:04:00.0",
    "00000000:05:00.0",
    "00000000:08:00.0",
    "00000000:09:00.0",
    "00000000:84:00.0",
    "00000000:85:00.0",
    "00000000:88:00.0",
    "00000000:89:00.0",
]

# file -> (bus ids, {gpu index: ERR! fields}, driver version, MIG devices, MIG mode of GPU 0)
TABLES = {
    "smi-table-ERR-fan-geforce-525.125.06-gpud-fixture.txt": (
        ["00000000:01:00.0"],
        {0: ["Fan"]},
        "525.125.06",
        0,
        "N/A",
    ),
    "smi-table-healthy-h100x8-550.90.07-gpud-fixture.txt": (H100X8, {}, "550.90.07", 0, "Disabled"),
    "smi-table-healthy-gtx1080tix8-390.25-nvidia-htop-fixture.txt": (GTX1080X8, {}, "390.25", 0, None),
    "smi-table-healthy-rtx2070-gtx750ti-450.57-nvidia-htop-fixture.txt": (
        ["00000000:01:00.0", "00000000:04:00.0"],
        {},
        "450.57",
        0,
        "N/A",
    ),
    "smi-table-healthy-gridk520-346.46-nvidia-htop-fixture.txt": (["00000000:00:03.0"], {}, "346.46", 0, None),
    "smi-table-healthy-gtx1080tix2-440.82-docker-nvidia-htop-fixture.txt": (
        ["00000000:01:00.0", "00000000:02:00.0"],
        {},
        "440.82",
        0,
        None,
    ),
    "smi-table-healthy-t4-450.51.06-cloud-native-docs.txt": (["00000000:00:1E.0"], {}, "450.51.06", 0, "N/A"),
    "smi-table-healthy-t4-510.47.03-oc-exec-cloud-native-docs.txt": (["00000000:00:1E.0"], {}, "510.47.03", 0, "N/A"),
    "smi-table-infoROM-corrupted-p100-470.82.01-cloud-native-docs.txt": (
        ["00000000:0B:00.0"],
        {},
        "470.82.01",
        0,
        "N/A",
    ),
    "smi-table-MIG-empty-a100-40gb-450.80.02-cloud-native-docs.txt": (
        ["00000000:00:04.0"],
        {},
        "450.80.02",
        0,
        "Enabled",
    ),
    "smi-table-MIG-h100x8-32devices-535.104.12-cloud-native-docs.txt": (MIG_H100X8, {}, "535.104.12", 32, "Enabled"),
    "smi-table-MIG-h200-590.48.01-load-nvgpuexp-capture.txt": (["00000000:83:00.0"], {}, "590.48.01", 5, "Enabled"),
    "smi-table-MIG-h100-590.48.01-idle-nvgpuexp-capture.txt": (["00000000:00:09.0"], {}, "590.48.01", 4, "Enabled"),
    "smi-table-healthy-h100-590.48.01-nvgpuexp-capture.txt": (["00000000:00:09.0"], {}, "590.48.01", 0, "Disabled"),
    "smi-table-healthy-l40s-595.80-nvgpuexp-capture.txt": (["00000000:01:00.0"], {}, "595.80", 0, "N/A"),
    "smi-table-healthy-rtx2080super-610.57.04-kmd-header-nvgpuexp-capture.txt": (
        ["00000000:0C:00.0"],
        {},
        "610.57.04",
        0,
        "N/A",
    ),
    "smi-table-ERR-many-fields-525-gpu-operator-559.txt": (
        ["00000000:19:00.0"],
        {0: ["Name", "Volatile Uncorr. ECC", "Fan", "Temp", "Perf", "Pwr:Usage", "Pwr:Cap", "GPU-Util", "MIG M."]},
        None,
        0,
        "ERR!",
    ),
    "smi-table-ERR-fan-wide-550-nvgpuexp-393.txt": (["00000000:CC:00.0"], {14: ["Fan"]}, None, 0, None),
}


def test_every_shared_table_fixture_is_covered():
    shared = {p.name for p in FIXTURES.glob("smi-table-*.txt")}
    assert shared, f"no fixtures found in {FIXTURES}"
    assert shared <= set(TABLES), f"fixtures without a test: {sorted(shared - set(TABLES))}"


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_fixture(name):
    buses, errs, driver, mig_devices, mig_mode0 = TABLES[name]
    text = fixture_path(name).read_text()
    t = parse_smi_table(text)
    assert [g.address.nvml for g in t.gpus] == buses
    assert {g.index: g.err_fields for g in t.gpus if g.err_fields} == errs
    assert t.driver_version == driver
    assert t.mig_devices == mig_devices
    assert t.gpus[0].mig_mode == mig_mode0
    findings = smi_findings(t, 0, text)
    err_findings = [f for f in findings if f.reason is Reason.NVIDIA_SMI_ERR]
    assert len(err_findings) == len(errs)
    assert {f.gpu.nvml for f in err_findings} == {buses[0]} if errs else not err_findings


def test_gpu_indices_follow_the_table():
    t = parse_smi_table(fixture_path("smi-table-healthy-gtx1080tix8-390.25-nvidia-htop-fixture.txt").read_text())
    assert [g.index for g in t.gpus] == list(range(8))
    assert {g.name for g in t.gpus} == {"GeForce GTX 108..."}


def test_mig_devices_are_attributed_per_gpu():
    t = parse_smi_table(fixture_path("smi-table-MIG-h100x8-32devices-535.104.12-cloud-native-docs.txt").read_text())
    assert [g.mig_devices for g in t.gpus] == [4] * 8


def test_infoROM_warning_and_exit_code_14():
    text = fixture_path("smi-table-infoROM-corrupted-p100-470.82.01-cloud-native-docs.txt").read_text()
    t = parse_smi_table(text)
    assert t.inforom_corrupted == ["0000:0B:00.0"]
    kinds = {f.kind for f in smi_findings(t, 14, text)}
    assert kinds == {"inforom_corrupted", "exit_code_14"}


@pytest.mark.parametrize(
    ("name", "rc", "kinds", "gpu"),
    [
        (
            "smi-handle-unknown-error-01-congphase-my-t450s.txt",
            15,
            {"device_handle", "exit_code_15"},
            "00000000:01:00.0",
        ),
        ("smi-handle-nospace-gpud-sxid-readme.txt", 15, {"device_handle", "exit_code_15"}, "00000000:91:00.0"),
        ("smi-handle-unknown-error-ogkm-387.txt", 255, {"device_handle", "exit_code_255"}, "00000000:0B:00.0"),
        ("smi-driver-unreachable-nvidia-docker-988.txt", 9, {"driver_unreachable", "exit_code_9"}, None),
        ("smi-version-mismatch-shine-cluster-30.txt", 18, {"driver_library_mismatch", "exit_code_18"}, None),
        ("smi-no-devices-ogkm-862.txt", 6, {"no_devices", "exit_code_6"}, None),
    ],
)
def test_whole_run_failures(name, rc, kinds, gpu):
    text = fixture_path(name).read_text()
    t = parse_smi_table(text)
    f = smi_findings(t, rc, text)
    assert {x.kind for x in f} == kinds
    assert all(x.reason is Reason.NVIDIA_SMI_FAILED and x.severity is Severity.FAULT for x in f)
    assert {x.gpu.nvml for x in f if x.gpu} == ({gpu} if gpu else set())
    assert not t.gpus


def test_whole_run_message_counts_even_with_exit_code_zero():
    f = smi_findings(parse_smi_table("No devices were found\n"), 0, "No devices were found\n")
    assert [x.kind for x in f] == ["no_devices"]


def test_garbage_with_exit_zero_is_unchecked_not_healthy():
    text = "\x00\x1b[31m garbage |||| +--+ 12:34"
    f = smi_findings(parse_smi_table(text), 0, text)
    assert [x.severity for x in f] == [Severity.UNCHECKED]
    assert f[0].kind == "unparseable"


def test_leading_unrelated_line_is_skipped():
    text = fixture_path("smi-table-healthy-t4-510.47.03-oc-exec-cloud-native-docs.txt").read_text()
    assert text.startswith("Defaulted container")
    assert len(parse_smi_table(text).gpus) == 1
