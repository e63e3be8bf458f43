"""Raw public text turned into what the probes read (agent/bundle_raw.py), checked on the captured samples in
tests/fixtures: NVML's readings from `nvidia-smi -q` agree with what nvidia-smi's own parsers read from the same text,
`nvlink -s`, ibstat, a sysfs listing, lspci and dmesg become the probes' inputs without losing or inventing a thing."""

from __future__ import annotations

import os

import pytest

from agent.bundle_nvml import RecordedNvml
from agent.bundle_raw import (
    encode_health,
    infiniband_from_ibstat,
    infiniband_from_listing,
    kmsg_from_dmesg,
    nvml_from_raw,
    nvml_from_smi_q,
    parse_nvlink_status,
    pci_from_lspci,
)
from agent.kernel_log.source import parse_record
from agent.kernel_log.xid import KernelLogParser
from agent.model import Check, PciAddress
from agent.probes.base import ProbeContext
from agent.probes.fabric import decode_health, parse_smi_q
from agent.probes.infiniband import InfinibandProbe
from agent.probes.nvml import NvmlProbe
from testkit.fixture_files import fixture_path

Q_FIXTURES = [
    "smi-q-535.161.08-gpud-fixture.txt",
    "smi-q-560.35.03-gpud-fixture.txt",
    "smi-q-a10-535.129.03-gpud-fixture.txt",
    "smi-q-h200-590.48.01-nvgpuexp-capture.txt",
    "smi-q-rtx4090x8-535.154.05-gpud-fixture.txt",
]


def text(name):
    return fixture_path(name).read_text(encoding="utf-8", errors="replace")


def nvml_snapshot(record):
    probe = NvmlProbe("auto", 5.0, True, nvml=RecordedNvml(record))
    probe.read_fabric = True
    r = probe.read(ProbeContext())
    return r, probe.snapshot


@pytest.mark.parametrize("name", Q_FIXTURES)
def test_nvml_from_q_reads_what_nvidia_smi_shows(name):
    q = text(name)
    r, snap = nvml_snapshot(nvml_from_smi_q(q))
    assert r.ran and snap is not None
    smi_fabric = parse_smi_q(q)
    sections = [line.split()[1] for line in q.splitlines() if line.startswith("GPU 0")]
    assert [g.address.nvml for g in snap.gpus] == [PciAddress.parse(s).nvml for s in sections]
    assert all(g.name for g in snap.gpus)
    for g in snap.gpus:
        want = smi_fabric.get(g.address)
        if want is None or not want.applicable:
            assert g.fabric is None or not g.fabric.applicable
            continue
        assert (g.fabric.state, g.fabric.status) == (want.state, want.status)
        if want.clique_id is not None:  # a driver whose -q has no CliqueId line: NVML's structure still has the field
            assert g.fabric.clique_id == want.clique_id
        known = {k: v for k, v in want.health.items() if k in decode_health(0xFFFFFFFF) or v not in ("N/A",)}
        assert {k: v for k, v in g.fabric.health.items()} == {k: v for k, v in known.items() if k in g.fabric.health}


def test_fabric_health_words_round_trip_through_the_mask():
    for health in (
        {"Bandwidth": "Degraded", "Route Unhealthy": "True", "Global Fabric Manager": "Disconnected"},
        {"Bandwidth": "Full", "Route Recovery in progress": "False", "Incorrect Configuration": "None"},
        {"Incorrect Configuration": "Insufficient NVLinks", "Access Timeout Recovery": "True"},
    ):
        assert decode_health(encode_health(health)) == health


def test_remapped_rows_pending_and_mig_from_q():
    q = text("smi-q-a10-535.129.03-gpud-fixture.txt")
    r, snap = nvml_snapshot(nvml_from_smi_q(q))
    kinds = [f.kind for f in r.findings]
    assert "row_remap_pending" in kinds  # Pending : Yes in the capture
    assert snap.gpus[0].name == "NVIDIA A10" and not snap.gpus[0].mig_enabled


def test_nvlink_status_inactive_and_partial():
    inactive = parse_nvlink_status(text("smi-nvlink-status-inactive-a100-azurehpc-hc-fixture.txt"))
    assert inactive and all(v is None for v in inactive.values())
    partial = parse_nvlink_status(text("smi-nvlink-status-partial-v100-sxm2-azhpc-diagnostics-73.txt"))
    links = next(v for v in partial.values() if v)
    assert 0 in links and 1 in links  # some up, some inactive


def test_nvlink_without_q_on_lspci_gpus_in_bus_order():
    lspci = text("lspci-nn-a100x8-nvswitch-azure-gpud-fixture.txt")
    nvlink = (
        "GPU 6: NVIDIA A100-SXM4-80GB (UUID: GPU-x)\n"
        "\t NVML: Unable to retrieve NVLink information as all links are inactive\n"
    )
    record = nvml_from_raw(None, nvlink, None, lspci)
    _, snap = nvml_snapshot(record)
    assert len(snap.gpus) == 8
    g6 = snap.gpus[6]
    assert g6.name == "NVIDIA A100-SXM4-80GB" and g6.nvlink_links > 0 and not g6.nvlink_up
    assert snap.gpus[0].nvlink_links == 0  # not in the text: not captured, not invented
    assert nvml_from_raw(None, None, None, lspci) is None


@pytest.mark.parametrize(
    "name,down",
    [
        ("ibstat-h100-roce-2rails-down-gpud-fixture.txt", 2),
        ("ibstat-h100-roce-8rails-4frontend-all-active-gpud-fixture.txt", 0),
    ],
)
def test_ibstat_to_sysfs(tmp_path, name, down):
    files = infiniband_from_ibstat(text(name))
    for path, data in files.items():
        full = tmp_path / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(data)
    states = [v for k, v in files.items() if k.endswith("/state")]
    assert len(states) >= 8 and sum(v != b"4: ACTIVE\n" for v in states) == down
    assert all(k.endswith(("hca_type", "state", "phys_state", "rate", "link_layer")) for k in files)
    r = InfinibandProbe(str(tmp_path / "sys")).read(ProbeContext())
    assert r.ran  # the probe reads what was written


def test_sysfs_listing_relative_and_absolute():
    rel = infiniband_from_listing(text("sysfs-class-infiniband-h100-ib-bf3-bond-gpud-fixture.txt"))
    assert rel["sys/class/infiniband/mlx5_0/hca_type"] == b"MT4129\n"
    assert rel["sys/class/infiniband/mlx5_0/ports/1/state"] == b"4: ACTIVE\n"
    ab = infiniband_from_listing("/sys/class/infiniband/mlx5_3/ports/1/rate: 400 Gb/sec (4X NDR)\n")
    assert ab == {"sys/class/infiniband/mlx5_3/ports/1/rate": b"400 Gb/sec (4X NDR)\n"}
    assert infiniband_from_listing("/sys/class/infiniband/../../etc/passwd: x\nmlx5_0/../../x: y\n") == {}


def test_lspci_vvv_functions_drivers_and_links():
    fns = pci_from_lspci(text("lspci-vvv-h100x8-nvswitch-dell-xe9680-gpud-fixture.txt"))
    gpus = {n: f for n, f in fns.items() if f["vendor"] == 0x10DE and f["class"] >> 16 == 0x03}
    assert len(gpus) == 8
    assert all(f.get("driver") == "nvidia" and "max_link_width" in f for f in gpus.values())
    nn = pci_from_lspci(text("lspci-nn-a10-vm-gpud-fixture.txt"))
    assert [f["device"] for f in nn.values() if f["vendor"] == 0x10DE and f["class"] >> 16 == 0x03] == [0x2236]


@pytest.mark.parametrize(
    "name",
    [
        "xid-lines-13-43-dmesg-decode-iso-gpud-fixture.txt",
        "xid-lines-79-dmesg-nots-cloud-native-docs.txt",
        "xid-lines-63-syslog-nots-mlengineering.txt",
        "xid-lines-48-63-94-dmesg-iso-gpud-fixture.txt",
    ],
)
def test_dmesg_to_kmsg_keeps_every_xid(name):
    raw = text(name)
    direct = [(e.xid, e.raw_address) for line in raw.splitlines() for e in KernelLogParser().feed(line)]
    records = [parse_record(r) for r in kmsg_from_dmesg(raw).splitlines()]
    parser = KernelLogParser()
    replayed = [(e.xid, e.raw_address) for r in records if r for e in parser.feed(r.text, r.seq, r.usec)]
    assert direct and replayed == direct
    stamps = [r.usec for r in records if r]
    assert stamps == sorted(stamps)


def test_dmesg_wall_clock_stamps_keep_their_distance():
    lines = (
        "2025-01-21T02:21:33,000000+00:00 NVRM: Xid (PCI:0000:38:00): 13, pid=1, name=a, x\n"
        "2025-01-21T02:31:34,500000+00:00 NVRM: Xid (PCI:0000:38:00): 13, pid=1, name=a, x\n"
    )
    a, b = (parse_record(r) for r in kmsg_from_dmesg(lines).splitlines())
    assert b.usec - a.usec == 601_500_000


def test_recorded_hung_call_is_the_probes_timeout():
    record = nvml_from_smi_q(text("smi-q-a10-535.129.03-gpud-fixture.txt"))
    record["calls"][0]["hung"] = True  # nvmlInit never returned when captured
    r, snap = nvml_snapshot(record)
    assert snap is None and any(f.kind == "timeout" and "NVML hung" in f.message for f in r.findings)
    assert r.check is Check.NVML
    assert os.sep  # no files were written


def test_fabric_health_summary_reaches_the_nvml_path():
    """A Fabric block's `Summary : Unhealthy` (a real excerpt without its GPU heading, put under one) rides NVML's
    fabric structure and is judged as nvidia-smi's own text is."""
    from agent.probes.fabric import FabricProbe

    block = fixture_path("smi-q-fabric-unhealthy-mnnvl-dra-driver-626.txt").read_text()
    block = "\n".join(line for line in block.splitlines() if line.strip() not in ("--", "....") and line[:1] != "#")
    q = "Driver Version                            : 570.124.06\n\nGPU 00000000:01:00.0\n" + block + "\n"
    r, _ = nvml_snapshot(nvml_from_smi_q(q))
    ctx = ProbeContext()
    ctx.results[Check.NVML] = r
    fab = FabricProbe("auto", None).read(ctx)
    assert [f.reason.value for f in fab.findings if f.reason] == ["FabricNotReady"]
    assert "Unhealthy" in fab.findings[0].message
