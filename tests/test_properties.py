"""Property tests: no parser raises on arbitrary text or bytes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.kernel_log.source import format_record, parse_record
from agent.kernel_log.xid import KernelLogParser
from agent.model import PciAddress
from agent.probes.nvidia_smi import parse_smi_table, smi_findings

texty = st.text(alphabet=st.characters(), max_size=2000)
tabley = st.lists(
    st.sampled_from(
        [
            "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |                    0 |",
            "| N/A   27C    P0             72W /  700W |       1MiB /  81559MiB |      0%      Default |",
            "|                                         |                        |             Disabled |",
            "+-----------------------------------------+------------------------+----------------------+",
            "| MIG devices:",
            "|  0    2   0   0  |",
            "ERR!",
            "|ERR! ERR! | ERR! |",
            "Processes:",
            "|",
            "||||",
            "",
            "Unable to determine the device handle for GPU0000:91:00.0: Unknown Error",
            "No devices were found",
            "WARNING: infoROM is corrupted at gpu 0000:0B:00.0",
            "| NVIDIA-SMI 610  KMD Version: 610.57.04 |",
        ]
    )
    | texty,
    max_size=60,
).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(tabley, st.integers(min_value=-255, max_value=255))
def test_smi_parser_never_raises(text, rc):
    t = parse_smi_table(text)
    smi_findings(t, rc, text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_smi_parser_never_raises_on_bytes(data):
    parse_smi_table(data.decode("utf-8", "replace"))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        texty
        | st.sampled_from(
            [
                "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                "NVRM: Xid (PCI:zz): x",
                "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=1",
                "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal",
                "NVRM: The NVIDIA GPU 0000:b3:00.0",
                "fallen off the bus and is not responding",
                "NVRM: GPU 0:0: GPU has",
                "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0xZZ",
            ]
        ),
        max_size=30,
    )
)
def test_kernel_log_parser_never_raises(lines):
    p = KernelLogParser()
    for line in lines:
        for ev in p.feed(line):
            assert isinstance(ev.fatal, bool)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=500))
def test_kmsg_record_parser_never_raises(data):
    parse_record(data.decode("utf-8", "replace"))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 23), st.integers(0, 7))
def test_kmsg_format_roundtrip(text, seq, usec, facility, level):
    rec = parse_record(format_record(text.replace("\n", " ").replace("\r", " "), seq, usec, facility, level))
    if text.strip():
        assert rec is not None
        assert (rec.facility, rec.level, rec.seq, rec.usec) == (facility, level, seq, usec)
        assert rec.text == text.replace("\n", " ").replace("\r", " ")


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=40))
def test_pci_address_parse_never_raises(text):
    a = PciAddress.parse(text)
    if a is not None:
        assert PciAddress.parse(a.nvml) == a and PciAddress.parse(a.kernel) == a


def test_pci_address_forms_agree():
    forms = ["0000:3b:00", "PCI:0000:3b:00", "00000000:3B:00.0", "0000:3b:00.0", "3b:00.0"]
    assert len({PciAddress.parse(f) for f in forms}) == 1
