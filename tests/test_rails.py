"""Which RDMA ports are rails (agent/probes/infiniband.py `rail_devices`), judged on real captures: `ibstat` of H100
and A100 nodes and a `/sys/class/infiniband` tree of an H100 node (tests/fixtures, provenance in SOURCES.md), laid out
in the simulated sysfs beside the node's GPUs as each capture's NICs sit (the rails' model beside a GPU each, the
front-end NICs on their own root ports: the captures hold no PCI topology, so this part is assembled, as SOURCES.md
says). Healthy nodes stay healthy (front-end ports down or slower are not judged), broken rails are caught, every rail
down is FabricNotReady, saturated and garbled counters are said, and every device of an SR-IOV node is read."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from agent import config
from agent.checks import combine
from agent.model import Check, PciAddress, Reason, Severity, Status
from agent.probes import infiniband
from agent.probes.base import ProbeContext
from agent.probes.infiniband import (
    FlapThresholds,
    IbThresholds,
    InfinibandProbe,
    Port,
    port_findings,
    rail_devices,
    rail_patterns,
)
from agent.probes.pci import PciProbe
from agent.settings import ConfigError
from agent.verdict import decide
from testkit.fixture_files import fixture_path
from testkit.simhost import SimHost

ROCE_HEALTHY = "ibstat-h100-roce-8rails-4frontend-all-active-gpud-fixture.txt"
A100_HEALTHY = "ibstat-a100-ib-8rails-1frontend-all-active-gpud-fixture.txt"
IB_FRONTEND_DOWN = "ibstat-h100-ib-rails-up-frontend-disabled-gpud-fixture.txt"
ROCE_TWO_DOWN = "ibstat-h100-roce-2rails-down-gpud-fixture.txt"
ROCE_POLLING = "ibstat-h100-roce-rail-polling-gpud-fixture.txt"
SYSFS_H100 = "sysfs-class-infiniband-h100-ib-bf3-bond-gpud-fixture.txt"
STATES = {"Down": "1: DOWN", "Initializing": "2: INIT", "Init": "2: INIT", "Armed": "3: ARMED", "Active": "4: ACTIVE"}
PHYS = {"Polling": "2: Polling", "Disabled": "3: Disabled", "LinkUp": "5: LinkUp"}
_CA = re.compile(r"^CA '([^']+)'")
_FIELD = re.compile(r"^\s+(CA type|State|Physical state|Rate|Link layer):\s*(.*?)\s*$")


def ibstat(name: str) -> dict[str, dict[str, str]]:
    """Each CA's type and port 1 in an `ibstat` capture."""
    out: dict[str, dict[str, str]] = {}
    ca = None
    for line in fixture_path(name).read_text().splitlines():
        if m := _CA.match(line):
            ca = out.setdefault(m[1], {})
        elif ca is not None and (m := _FIELD.match(line)):
            ca[m[1]] = m[2]
    return out


def sysfs_listing(name: str) -> dict[str, str]:
    """`<device>/<path>: <content>` lines of a flattened /sys/class/infiniband capture."""
    return dict(line.split(": ", 1) for line in fixture_path(name).read_text().splitlines())


def lay_out(host: SimHost, files: dict[str, str], beside: list[str]) -> None:
    """The capture's devices in the simulated sysfs: those in `beside` each next to one GPU (in order), the others
    on their own root port; then every captured file, as captured."""
    devices = sorted(
        {k.split("/", 1)[0] for k in files}, key=lambda d: (d not in beside, beside.index(d) if d in beside else d)
    )
    for d in devices:
        host.add_rail(d, gpu=beside.index(d) if d in beside else None)
    for rel, value in files.items():
        path = host.sysfs / "class" / "infiniband" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")


def ibstat_files(cas: dict[str, dict[str, str]]) -> dict[str, str]:
    """An ibstat capture as the sysfs files it reads them from (the kernel's formats: `4: ACTIVE`, `5: LinkUp`,
    `400 Gb/sec`)."""
    files = {}
    for ca, f in cas.items():
        files[f"{ca}/hca_type"] = f["CA type"]
        files[f"{ca}/ports/1/state"] = STATES[f["State"]]
        files[f"{ca}/ports/1/phys_state"] = PHYS[f["Physical state"]]
        files[f"{ca}/ports/1/rate"] = f"{f['Rate']} Gb/sec"
        files[f"{ca}/ports/1/link_layer"] = f["Link layer"]
    return files


def node(tmp_path: Path, files: dict[str, str], beside: list[str]) -> SimHost:
    host = SimHost(tmp_path / "node", pcie_bridges=True)
    lay_out(host, files, beside)
    return host


def read(host: SimHost, topology: bool = True, now: float = 0.0, **kw):
    ctx = ProbeContext(now=now)
    if topology:  # the GPUs the PCI probe found, as the suite hands them on
        ctx.results[Check.PCI] = PciProbe(str(host.sysfs)).read(ctx)
    probe = kw.pop("probe", None) or InfinibandProbe(str(host.sysfs), thresholds=IbThresholds(**kw))
    return probe.read(ctx), probe


def faults(r) -> list[tuple[str, str]]:
    return [(f.kind, f.message.split()[2]) for f in r.findings if f.severity is Severity.FAULT]


def by_model(cas: dict[str, dict[str, str]], model: str) -> list[str]:
    return sorted((ca for ca, f in cas.items() if f["CA type"] == model), key=lambda d: (len(d), d))


# -- the decision, pure --------------------------------------------------------------------------------------------


def _port(dev: str, up: bool = True, rate: float = 400, layer: str = "InfiniBand", nic: str = "MT4129") -> Port:
    return Port(
        dev, "1", (4, "ACTIVE") if up else (1, "DOWN"), (5, "LinkUp") if up else (3, "Disabled"), rate, layer, nic=nic
    )


def test_which_devices_are_rails():
    ports = [_port("mlx5_0"), _port("mlx5_1", layer="Ethernet"), _port("mlx5_bond_0", layer="Ethernet")]
    assert rail_devices(ports, {"mlx5_0"}) == ({"mlx5_0"}, "topology")
    assert rail_devices(ports, {"mlx5_0"}, ("mlx5_1",))[0] == {"mlx5_0", "mlx5_1"}
    assert rail_devices(ports, set(), ("mlx5_[01]",)) == ({"mlx5_0", "mlx5_1"}, "railDevices")
    # no GPU beside any device: the largest group of one NIC model and link layer
    how = "the largest group of one NIC model and link layer (no GPU affinity found)"
    assert rail_devices(ports, {"mlx5_9"}) == ({"mlx5_1", "mlx5_bond_0"}, how)
    roce = [_port(f"mlx5_{i}", layer="Ethernet") for i in range(8)] + [
        _port(f"fe_{i}", rate=100, layer="Ethernet", nic="MT4125") for i in range(4)
    ]
    assert rail_devices(roce, set())[0] == {f"mlx5_{i}" for i in range(8)}
    one_each = [_port("ib", nic="MT4126"), _port("eth", rate=100, layer="Ethernet", nic="MT4126")]
    assert rail_devices(one_each, set())[0] == {"ib"}  # a tie: the InfiniBand one
    assert rail_devices(roce, set(), vfs={f"mlx5_{i}" for i in range(8)})[0] == {f"fe_{i}" for i in range(4)}
    assert rail_devices([], set()) == (set(), "no device")


def test_rates_compared_within_one_nic_model_and_link_layer_only():
    ports = [_port(f"mlx5_{i}") for i in range(4)] + [_port("mlx5_4", rate=200, nic="MT41692")]
    assert port_findings(ports, None, None, rate_peers=True) == []  # another NIC model: not its peer
    ports.append(_port("mlx5_5", rate=200))
    assert [f.kind for f in port_findings(ports, None, None, rate_peers=True)] == ["rail_slow"]


def test_every_rail_down_is_fabric_not_ready_some_down_degraded():
    ports = [_port("mlx5_0", up=False), _port("mlx5_1"), _port("eth", up=False, layer="Ethernet")]
    f = port_findings(ports, None, None, rails={"mlx5_0", "mlx5_1"})
    assert [(x.kind, x.reason) for x in f if x.severity is Severity.FAULT] == [("rail_down", Reason.GPU_DEGRADED)]
    assert [x.kind for x in f if x.severity is Severity.INFO] == ["front_end"]
    f = port_findings([_port("mlx5_0", up=False), _port("mlx5_1", up=False)], None, None, rails={"mlx5_0", "mlx5_1"})
    assert [(x.kind, x.reason) for x in f] == [
        ("rail_down", Reason.GPU_DEGRADED),
        ("rail_down", Reason.GPU_DEGRADED),
        ("rails_all_down", Reason.FABRIC_NOT_READY),
    ]
    assert port_findings([_port("eth", up=False, layer="Ethernet")], None, None, rails=set()) != []  # shown
    assert not [
        x for x in port_findings([_port("eth", up=False)], None, None, rails=set()) if x.severity is Severity.FAULT
    ]


def test_the_rail_devices_setting():
    assert rail_patterns("mlx5_0, mlx5_[4-7] ibp*") == ("mlx5_0", "mlx5_[4-7]", "ibp*")
    assert rail_patterns(["mlx5_0"]) == ("mlx5_0",)
    for bad in ("mlx5_0;rm", "a" * 65, " ".join(["x"] * 257)):
        with pytest.raises(ValueError):
            rail_patterns(bad)
    assert config.defaults(rail_devices="mlx5_*").rail_devices == ("mlx5_*",)
    assert config.defaults().rail_devices is None
    with pytest.raises(ConfigError):
        config.defaults(rail_devices="$(reboot)")


# -- real captures -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capture", "rails_model", "old_false_alarms"),
    [
        (ROCE_HEALTHY, "MT4129", ["rail_slow"] * 4),  # 100 Gb/s front-end ConnectX-6 Dx beside 400 Gb/s RoCE rails
        (A100_HEALTHY, None, []),  # 8 IB rails and one Ethernet port of the same model (ConnectX-6)
        (IB_FRONTEND_DOWN, "MT4129", ["rail_down"] * 3),  # 3 front-end Ethernet ports admin-disabled
    ],
)
def test_healthy_nodes_stay_healthy_with_their_front_end_ports(tmp_path, capture, rails_model, old_false_alarms):
    cas = ibstat(capture)
    rails = (
        by_model(cas, rails_model) if rails_model else [c for c, f in cas.items() if f["Link layer"] == "InfiniBand"]
    )
    host = node(tmp_path, ibstat_files(cas), rails)
    r, _ = read(host)
    assert r.ran and faults(r) == []
    assert r.payload.rails == set(rails) and r.payload.rails_from == "topology"
    front = [f for f in r.findings if f.kind == "front_end"]
    assert len(front) == (1 if len(rails) < len(cas) else 0)
    # what judging every port as a rail, rates against every port of its link layer, said of this healthy node
    ports = [replace(p, nic="") for p in r.payload.ports]
    old = [f.kind for f in port_findings(ports, None, None, rate_peers=True) if f.severity is Severity.FAULT]
    assert old == old_false_alarms
    assert decide(combine([r], None), []).status is Status.TRUE
    r, _ = read(host, topology=False)  # as a virtual machine shows it: the largest group is the rails
    assert faults(r) == [] and r.payload.rails == set(rails)


@pytest.mark.parametrize(
    ("capture", "down"),
    [
        (ROCE_TWO_DOWN, [("rail_down", "mlx5_5"), ("rail_down", "mlx5_11")]),
        (ROCE_POLLING, [("rail_down", "mlx5_5"), ("rail_down", "mlx5_11")]),
    ],
)
def test_rails_down_on_a_roce_node_are_caught_and_its_front_end_is_not(tmp_path, capture, down):
    cas = ibstat(capture)
    rails = by_model(cas, "MT4129")
    host = node(tmp_path, ibstat_files(cas), rails)
    r, _ = read(host)
    assert sorted(faults(r)) == sorted(down)
    v = decide(combine([r], None), [])
    assert (v.status, v.reason) == (Status.FALSE, Reason.GPU_DEGRADED)
    assert "mlx5_1 " not in v.message and "mlx5_7 " not in v.message  # the front-end ConnectX-6 Dx
    # without a topology (a virtual machine): the largest group of one NIC model and link layer, the 8 MT4129
    r, _ = read(host, topology=False)
    assert sorted(faults(r)) == sorted(down) and r.payload.rails == set(rails)
    assert "(0 down)" in next(f.message for f in r.findings if f.kind == "front_end")
    r, _ = read(host, topology=False, rail_devices=tuple(rails))
    assert sorted(faults(r)) == sorted(down) and r.payload.rails_from == "railDevices"


def test_every_rail_down_is_not_ready(tmp_path):
    """The A100 capture with each of its InfiniBand rails set down (derived): FabricNotReady, not just degraded."""
    cas = ibstat(A100_HEALTHY)
    rails = [c for c, f in cas.items() if f["Link layer"] == "InfiniBand"]
    for c in rails:
        cas[c] |= {"State": "Down", "Physical state": "Polling"}
    r, _ = read(node(tmp_path, ibstat_files(cas), rails))
    v = decide(combine([r], None), [])
    assert (v.status, v.reason) == (Status.FALSE, Reason.FABRIC_NOT_READY)
    assert "no usable InfiniBand rail: all 8 rail ports down" in v.message


def test_the_h100_sysfs_tree_a_saturated_counter_and_a_bluefield_bond(tmp_path):
    """gpud's captured /sys/class/infiniband of an H100 node: 8 NDR rails (ConnectX-7, MT4129) and a BlueField-3
    bond (MT41692, 200 Gb/s Ethernet); mlx5_1's link_downed reads 255, the top of its 8 bits."""
    files = sysfs_listing(SYSFS_H100)
    host = node(tmp_path, files, [])  # no GPU beside any device here: the 8 MT4129 InfiniBand ones are the rails
    r, probe = read(host, topology=False, flaps=FlapThresholds(1, 600.0))
    assert r.ran and faults(r) == []
    assert r.payload.rails == {f"mlx5_{i}" for i in (0, 1, 4, 5, 6, 7, 8, 9)}
    sat = [f for f in r.findings if f.kind == "counter_saturated"]
    assert [f.message for f in sat] == [
        "InfiniBand rail mlx5_1 port 1: counter link_downed saturated at 255 (it no longer moves: flaps seen from "
        "state changes only)"
    ]
    port = next(p for p in r.payload.to_json()["ports"] if p["device"] == "mlx5_1")
    assert port["saturated"] == ["link_downed"] and port["nic"] == "MT4129" and port["rail"]
    bond = next(p for p in r.payload.to_json()["ports"] if p["device"] == "mlx5_bond_0")
    assert (bond["rail"], bond["nic"]) == (False, "MT41692")
    # the saturated rail goes down: its counter cannot move, the state change counts the flap
    (host.sysfs / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "state").write_text("1: DOWN\n")
    r, _ = read(host, topology=False, now=5, probe=probe)
    assert sorted(faults(r)) == [("rail_down", "mlx5_1"), ("rail_flapping", "mlx5_1")]


def test_an_sr_iov_node_every_device_is_read_and_virtual_functions_are_not_rails(tmp_path):
    """8 rails beside the GPUs and 16 virtual functions each (136 devices, names sorting the rails last): a rail
    DOWN is caught; the virtual functions (some down, not in use) are front-end."""
    host = SimHost(tmp_path / "sriov", pcie_bridges=True)
    names = [f"mlx5_{i}" for i in range(136)]
    rails = names[128:]
    for i, dev in enumerate(rails):
        host.add_rail(dev, gpu=i)
    for k, dev in enumerate(names[:128]):
        pf_link = host.sysfs / "class" / "infiniband" / rails[k % 8] / "device"
        pf = Path(os.path.realpath(pf_link))
        pf_addr = PciAddress.parse(pf.name)
        assert pf_addr is not None
        fn = host.add_pci_function(
            PciAddress(0, pf_addr.bus, 1 + k // 8), 0, 0x020700, 0x101E, vendor=0x15B3, driver="mlx5_core",
            physfn=pf.name, parent=pf.parent,
        )  # fmt: skip
        d = host.sysfs / "class" / "infiniband" / dev
        d.mkdir(parents=True)
        (d / "device").symlink_to(os.path.relpath(fn, d))
        host.set_ib_port(
            dev, state="1: DOWN" if k % 3 else "4: ACTIVE", phys_state="3: Disabled" if k % 3 else "5: LinkUp"
        )
    host.set_ib_port(rails[-1], state="1: DOWN", phys_state="2: Polling")
    r, _ = read(host)
    assert r.ran and faults(r) == [("rail_down", "mlx5_135")]
    assert r.payload.rails == set(rails) and len(r.payload.ports) == 136 and r.payload.not_read == 0
    assert sorted(r.payload.gpu_rails.values()) == rails  # each GPU's rail is a physical function


def test_devices_beyond_the_bound_are_counted_and_never_true(tmp_path, monkeypatch):
    host = SimHost(tmp_path / "many", pcie_bridges=True)
    for i in range(8):
        host.add_rail(f"mlx5_{i}", gpu=i)
    monkeypatch.setattr(infiniband, "MAX_DEVICES", 6)
    r, _ = read(host)
    assert not r.ran
    (f,) = [f for f in r.findings if f.severity is Severity.UNCHECKED]
    assert f.message == "InfiniBand: 2 of 8 devices not read (at most 6 per cycle)"
    assert decide(combine([r], None), []).status is Status.UNKNOWN
