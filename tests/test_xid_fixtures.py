"""Every kernel-log sample in shared/fixtures and tests/fixtures, with the GPU errors it must yield."""

from __future__ import annotations

from collections import Counter

import pytest

from agent.model import PciAddress
from agent.xid import KernelLogParser, XidClassifier, load_catalog
from tests.conftest import FIXTURES, fixture_path


def parse_file(name, **kw):
    p = KernelLogParser(XidClassifier(**kw))
    out = []
    for line in fixture_path(name).read_text().splitlines():
        out += p.feed(line)
    return out


def parse_whole(name):
    """The file as one record (a printk with embedded newlines, as /dev/kmsg escapes them)."""
    return KernelLogParser().feed(fixture_path(name).read_text())


# file -> Counter of (source, xid, address, fatal)
EXPECTED = {
    "xid-lines-119-gsp-timeout-dmesg-gpud-fixture.txt": {("xid", 119, "0000:9b:00", True): 5},
    "xid-lines-13-31-109-dmesg-ctime-gpud-readme.txt": {
        ("xid", 13, "0000:cb:00", False): 3,
        ("xid", 31, "0000:cb:00", False): 1,
        ("xid", 109, "0000:cb:00", True): 2,
    },
    "xid-lines-13-43-dmesg-decode-iso-gpud-fixture.txt": {
        ("xid", 13, "0000:38:00", False): 15,
        ("xid", 43, "0000:38:00", False): 1,
    },
    "xid-lines-149-154-dmesg-gb200-gpud-kmsg-test.txt": {
        ("xid", 149, "0009:01:00", True): 3,
        ("xid", 149, "0008:01:00", True): 2,
        ("xid", 154, "0009:01:00", True): 1,
        ("xid", 154, "0019:01:00", True): 1,
        ("xid", 154, "0018:01:00", True): 1,
        ("xid", 154, "0008:01:00", True): 1,
    },
    "xid-lines-48-63-94-dmesg-iso-gpud-fixture.txt": {
        ("xid", 48, "0000:19:00", True): 1,
        ("xid", 63, "0000:19:00", False): 1,
        ("xid", 94, "0000:19:00", False): 9,
    },
    "xid-lines-63-syslog-nots-mlengineering.txt": {("xid", 63, "0000:10:1c", False): 1},
    "xid-lines-79-dmesg-nots-cloud-native-docs.txt": {("xid", 79, "0000:ca:00", True): 1},
    "xid-lines-79-sxid-20034-dmesg-gpud-readme.txt": {
        ("xid", 79, "0000:91:00", True): 1,
        ("fallen_off_bus", 79, "0000:91:00.0", True): 1,
        ("sxid", 20034, "0000:06:00.0", True): 1,
        ("sxid", 20034, "0000:05:00.0", True): 2,
        ("sxid", 20034, "0000:07:00.0", True): 1,
    },
    "xid-lines-79-syslog-congphase-my-t450s.txt": {
        ("xid", 79, "0000:01:00", True): 1,
        ("fallen_off_bus", 79, "0000:01:00.0", True): 1,
    },
    "xid-lines-94-95-format-examples-nvidia-driver-source.txt": {
        ("xid", 94, "0000:01:00", False): 2,
        ("xid", 95, "0000:01:00", True): 1,
    },
    "nvrm-lines-nvlink-postRxDet-h100-dmesg-gpud-test.txt": {},
    "nvrm-dmesg-full-boot-h100-nvswitch-healthy-decode-iso-gpud-fixture.txt": {},
    "xid-154-reset-required-nvsentinel.txt": {("xid", 154, "0008:01:00", True): 1},
    "xid-shapes-reference.txt": {
        ("xid", 14, "0000:03:00", True): 1,
        ("xid", 32, "0000:01:00", False): 1,
        ("xid", 109, "0000:02:00", True): 1,
        ("xid", 145, "0018:01:00", False): 1,
        ("xid", 45, "0000:dc:00", False): 1,
    },
}


def test_every_shared_kernel_log_fixture_is_covered():
    shared = {p.name for p in FIXTURES.glob("xid-*.txt")} | {p.name for p in FIXTURES.glob("nvrm-*.txt")}
    assert shared and shared <= set(EXPECTED), f"without a test: {sorted(shared - set(EXPECTED))}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_kernel_log_fixture(name):
    got = Counter((e.source, e.xid, e.raw_address, e.fatal) for e in parse_file(name))
    assert got == Counter(EXPECTED[name])


def test_mig_attributed_xid_keeps_the_gpu_address():
    evs = parse_file("xid-lines-94-95-format-examples-nvidia-driver-source.txt")
    assert {e.address for e in evs} == {PciAddress(0, 1, 0)}


def test_fallen_off_bus_without_xid_one_record_and_separate_records():
    one = parse_whole("kmsg-fallen-off-bus-no-xid-nvsentinel.txt")
    sep = parse_file("kmsg-fallen-off-bus-no-xid-nvsentinel.txt")
    for evs in (one, sep):
        assert [(e.source, e.xid, e.address, e.fatal) for e in evs] == [
            ("fallen_off_bus", 79, PciAddress(0, 0xB3, 0), True)
        ]


def test_ignore_and_fatal_lists_override_the_catalog():
    evs = parse_file("xid-lines-13-31-109-dmesg-ctime-gpud-readme.txt", ignore=[109], fatal=[13])
    fatal = {e.xid for e in evs if e.fatal}
    assert fatal == {13}


def test_xid_154_is_judged_by_the_action_code():
    p = KernelLogParser()
    none = p.feed(
        "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
    )
    reboot = p.feed(
        "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    )
    assert [e.fatal for e in none] == [False] and [e.fatal for e in reboot] == [True]


def test_sxid_nonfatal_and_continuation_records():
    p = KernelLogParser()
    assert [
        e.fatal
        for e in p.feed("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 04 RX Short Error Rate")
    ] == [False]
    assert p.feed("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 Engine instance 60") == []


def test_catalog_is_data_with_a_reason_for_every_row():
    cat = load_catalog()
    assert {13, 31, 43, 45, 48, 63, 79, 94, 95, 109, 119, 154} <= set(cat)
    assert all(e.why and e.action for e in cat.values())
    assert not cat[13].fatal and cat[79].fatal and cat[79].action == "RESTART_BM"


def test_unknown_xid_policy_is_configurable():
    line = "NVRM: Xid (PCI:0000:01:00): 999, something new"
    assert KernelLogParser(XidClassifier()).feed(line)[0].fatal is True
    assert KernelLogParser(XidClassifier(unknown_fatal=False)).feed(line)[0].fatal is False


def test_conflicting_lists_are_rejected():
    with pytest.raises(ValueError, match="both"):
        XidClassifier(fatal=[79], ignore=[79])


def test_docs_table_matches_the_catalog():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "xid-policy.md").read_text()
    for e in load_catalog().values():
        assert f"| {e.xid} | {e.name} | {e.action} | {'yes' if e.fatal else 'no'} |" in doc, e.xid
