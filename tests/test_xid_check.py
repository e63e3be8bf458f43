"""`gpu-ready check --json` end to end on a simulated 8-GPU host: the real CLI reads a kernel log written in
/dev/kmsg's record format and must follow NVIDIA's Xid catalog."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.kernel_log.source import format_record
from testkit.fixture_files import fixture_path
from testkit.simhost import SimHost

ROOT = Path(__file__).parents[1]


def first_line(fixture: str, needle: str) -> str:
    return next(line for line in fixture_path(fixture).read_text().splitlines() if needle in line)


def on_gpu(line: str, host: SimHost, gpu: int) -> str:
    """A real record moved to one of the simulated GPUs: only the address in the parentheses changes."""
    start = line.index("NVRM: Xid (") + len("NVRM: Xid (")
    if line.startswith("PCI:", start):
        start += len("PCI:")
    end = min(i for i in (line.find(" ", start), line.find(")", start)) if i > 0)
    return line[:start] + host.gpus[gpu].address.kernel + line[end:]


def run_check(host: SimHost, records: list[str]) -> tuple[int, dict]:
    host.kmsg.write_text("".join(format_record(t, seq, 1_000_000 + 1000 * seq, 0, 3) for seq, t in enumerate(records)))
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", "--json", *host.check_args()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode in (0, 1, 3), r.stderr
    return r.returncode, json.loads(r.stdout)


@pytest.fixture
def host(tmp_path: Path) -> SimHost:
    return SimHost(tmp_path / "host")


def test_restart_app_and_ignore_xids_leave_the_node_ready(host):
    records = [
        # Xid 8 (RESTART_APP) and 69 (RESTART_APP): the simulated host's own record shape
        host.xid_line(8, 0, "Channel 0000000d idle timeout"),
        on_gpu(first_line("xid-shapes-reference.txt", "): 14,"), host, 1),  # IGNORE
        on_gpu(first_line("xid-lines-63-syslog-nots-mlengineering.txt", "): 63,"), host, 2),  # IGNORE
        host.xid_line(69, 3, "Class 0000c7c0 Subchannel 00000000 Mismatch"),
        on_gpu(first_line("xid-lines-94-95-format-examples-nvidia-driver-source.txt", "): 94,"), host, 4),
    ]
    rc, out = run_check(host, records)
    assert (rc, out["status"], out["reason"]) == (0, "True", "GPUsHealthy"), out["message"]
    assert sorted(x["xid"] for x in out["xids"]) == [8, 14, 63, 69, 94]
    assert not any(x["fatal"] for x in out["xids"])


R575 = "xid-lines-144-150-nvlink5-r575-shapes-gpud-test.txt"
FATAL_CASES = {
    "48 double-bit ECC": lambda h: on_gpu(first_line("xid-lines-48-63-94-dmesg-iso-gpud-fixture.txt", "): 48,"), h, 5),
    "79 fallen off the bus": lambda h: h.xid_line(79, 5),
    "119 GSP timeout": lambda h: on_gpu(
        first_line("xid-lines-119-gsp-timeout-dmesg-gpud-fixture.txt", "): 119,"), h, 5
    ),
    "146 TLW status 0x4": lambda h: on_gpu(first_line(R575, "146, TLW_CTRL Fatal"), h, 5),
    # the record says Nonfatal; NVIDIA's decode table says RLW_REMAP status 0x40 is RESET_GPU
    "145 RLW_REMAP 0x40 said Nonfatal": lambda h: on_gpu(
        first_line(R575, "145, RLW_REMAP Fatal").replace(" Fatal ", " Nonfatal "), h, 5
    ),
}


@pytest.mark.parametrize("case", sorted(FATAL_CASES))
def test_fatal_xid_makes_the_node_not_ready_and_names_the_gpu(host, case):
    line = FATAL_CASES[case](host)
    rc, out = run_check(host, [host.xid_line(13, 0), line])
    assert (rc, out["status"], out["reason"]) == (1, "False", "FatalXid"), out["message"]
    bad = [g for g in out["gpus"] if g["healthy"] is False]
    assert [g["pci_bus_id"] for g in bad] == [host.gpus[5].address.nvml]
    xid = int(case.split()[0])
    assert f"GPU 5 ({host.gpus[5].address.nvml}): Xid {xid}" in out["message"], out["message"]
    assert [x["xid"] for x in out["xids"] if x["fatal"]] == [xid]


def test_xid_79_and_fallen_off_bus_companion_are_one_fault(host):
    a = host.gpus[6].address
    records = [host.xid_line(79, 6), f"NVRM: GPU {a.kernel}.0: GPU has fallen off the bus."]
    rc, out = run_check(host, records)
    assert (rc, out["reason"]) == (1, "FatalXid")
    assert [(x["xid"], x["source"]) for x in out["xids"]] == [(79, "xid")]


def test_nvswitch_soe_halt_makes_the_node_not_ready(host):
    records = fixture_path("nvswitch-sxid-soe-halt-watchdog-nvidia-driver-source.txt").read_text().splitlines()
    rc, out = run_check(host, records)
    assert (rc, out["status"], out["reason"]) == (1, "False", "FatalXid"), out["message"]
    assert sorted(x["xid"] for x in out["xids"]) == [26006, 26008]
