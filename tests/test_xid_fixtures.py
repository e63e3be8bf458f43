"""Every kernel-log sample in tests/fixtures, with the GPU errors it must yield."""

from __future__ import annotations

from collections import Counter

import pytest

from agent.kernel_log.xid import MAX_LINE, KernelLogParser, XidClassifier, load_catalog
from agent.model import PciAddress
from testkit.fixture_files import FIXTURES, fixture_path
from testkit.hostile import HOSTILE_XID
from testkit.parse_counts import xid_pattern_lines


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
        ("xid", 79, "0000:91:00", True): 1,  # its "GPU has fallen off the bus" companion is the same fault
        ("sxid", 20034, "0000:06:00.0", True): 1,
        ("sxid", 20034, "0000:05:00.0", True): 2,
        ("sxid", 20034, "0000:07:00.0", True): 1,
    },
    "xid-lines-79-syslog-congphase-my-t450s.txt": {("xid", 79, "0000:01:00", True): 1},
    "xid-lines-94-95-format-examples-nvidia-driver-source.txt": {
        ("xid", 94, "0000:01:00", False): 2,
        ("xid", 95, "0000:01:00", True): 1,
    },
    "nvrm-lines-nvlink-postRxDet-h100-dmesg-gpud-test.txt": {},
    # SOE lines carry no severity word: halted and watchdog are fatal, the halt data dumps are continuation
    "nvswitch-sxid-soe-halt-watchdog-nvidia-driver-source.txt": {
        ("sxid", 26006, "0000:05:00.0", True): 1,
        ("sxid", 26008, "0000:07:00.0", True): 1,
    },
    "nvrm-dmesg-full-boot-h100-nvswitch-healthy-decode-iso-gpud-fixture.txt": {},
    "xid-154-reset-required-nvsentinel.txt": {("xid", 154, "0008:01:00", True): 1},
    # Real GB200 records (V1, <R575): decided by unit + error status, not by the word
    "xid-lines-145-149-nvlink5-gb200-gpud-test.txt": {
        ("xid", 149, "0018:01:00", False): 1,  # NETIR_BER_EVENT status 0x1: IGNORE
        ("xid", 149, "0008:01:00", False): 1,
        ("xid", 145, "0018:01:00", False): 2,  # RLW_RXPIPE 0x8: IGNORE; RLW_SRC_TRACK 0x8: XID_154_EVAL
        ("xid", 145, "0019:01:00", False): 2,
        ("xid", 145, "0008:01:00", False): 3,
        ("xid", 149, "0019:01:00", True): 2,  # NETIR(_INT): RESET_GPU
        ("xid", 149, "0008:01:00", True): 3,  # NETIR / NETIR_LINK_EVT reason 000100: RESET_GPU
        ("xid", 149, "0018:01:00", True): 5,
    },
    # R575+ record shapes (V2 intrInfo), one per unit of the decode table
    "xid-lines-144-150-nvlink5-r575-shapes-gpud-test.txt": {
        ("xid", 144, "0000:04:00", False): 1,
        ("xid", 144, "0000:04:00", True): 1,
        ("xid", 145, "0000:04:00", False): 8,
        ("xid", 145, "0000:04:00", True): 4,
        ("xid", 146, "0000:04:00", False): 5,
        ("xid", 146, "0000:04:00", True): 5,  # TLW status 0x4: RESET_GPU
        ("xid", 147, "0000:04:00", False): 1,
        ("xid", 148, "0000:04:00", False): 1,
        ("xid", 149, "0000:04:00", False): 3,
        ("xid", 149, "0000:04:00", True): 5,
        ("xid", 150, "0000:04:00", True): 1,
    },
    "xid-shapes-reference.txt": {
        ("xid", 14, "0000:03:00", False): 1,  # catalog: IGNORE (was unknown, hence fatal, before)
        ("xid", 32, "0000:01:00", False): 1,
        ("xid", 109, "0000:02:00", True): 1,
        ("xid", 145, "0018:01:00", False): 1,
        ("xid", 45, "0000:dc:00", False): 1,
    },
}


def test_every_shared_kernel_log_fixture_is_covered():
    shared = {p.name for p in FIXTURES.glob("xid-*.txt")} | {p.name for p in FIXTURES.glob("nvrm-*.txt")}
    shared |= {p.name for p in FIXTURES.glob("nvswitch-*.txt")}
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


# --- one failure, one fault -----------------------------------------------------------------------------------

XID79 = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FOB_91 = "NVRM: GPU 0000:91:00.0: GPU has fallen off the bus."
FOB_THREE = (
    "NVRM: The NVIDIA GPU 0000:91:00.0",
    "NVRM: (PCI ID: 10de:2330) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)


def test_xid_79_and_its_companion_are_one_event():
    p = KernelLogParser()
    evs = p.feed(XID79, 1, 6_781_741_548_779) + p.feed(FOB_91, 2, 6_781_741_548_783)
    assert [(e.source, e.xid, e.address) for e in evs] == [("xid", 79, PciAddress(0, 0x91, 0))]


def test_companion_first_then_xid_79_is_one_event():
    p = KernelLogParser()
    evs = [e for i, t in enumerate((*FOB_THREE, XID79)) for e in p.feed(t, i, 1_000_000 + i)]
    assert [(e.source, e.xid) for e in evs] == [("fallen_off_bus", 79)]


def test_one_record_with_both_lines_is_one_event():
    assert len(KernelLogParser().feed(XID79 + "\n" + FOB_91, 7, 5)) == 1


def test_other_gpus_and_later_failures_are_separate_events():
    p = KernelLogParser()
    other = XID79.replace("0000:91:00", "0000:3b:00")
    evs = p.feed(XID79, 1, 1_000_000) + p.feed(other, 2, 1_000_100) + p.feed(FOB_91, 3, 1_000_200)
    assert sorted(e.raw_address for e in evs) == ["0000:3b:00", "0000:91:00"]
    # the same GPU falls off the bus again a minute later (after a reset): a new fault
    assert len(p.feed(XID79, 4, 61_000_000)) == 1


def test_two_xid_79_records_are_two_events_even_in_one_burst():
    """Only the companion of the other kind is folded in: a second Xid 79 for the same GPU a moment later (for
    example after an operator's clear) is a new event, and the pair after it is again one."""
    p = KernelLogParser()
    evs = p.feed(XID79, 1, 1_000_000) + p.feed(XID79, 2, 1_001_000) + p.feed(FOB_91, 3, 1_002_000)
    assert [e.source for e in evs] == ["xid", "xid"]


def test_without_timestamps_a_burst_is_counted_in_records():
    p = KernelLogParser()
    assert len(p.feed(XID79)) == 1 and p.feed(FOB_91) == []
    for _ in range(100):
        p.feed("unrelated record")
    assert len(p.feed(FOB_91)) == 1


# --- bounded, linear-time parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HOSTILE_XID))
def test_hostile_record_parses_in_linear_time(name):
    """Linear by construction: every line is cut to MAX_LINE characters before a pattern sees it (and every pattern
    is anchored with bounded quantifiers), so the patterns see at most the input's length in all. The time each
    record takes is bench/parsing.py's (the old parser took 7 s on some of these)."""
    text = HOSTILE_XID[name]
    with xid_pattern_lines() as seen:
        KernelLogParser().feed(text)
    assert seen and max(seen) <= MAX_LINE, f"{name}: a line of {max(seen)} characters reached the patterns"
    assert sum(seen) <= min(len(text), MAX_LINE * (text.count("\n") + 1)), f"{name}: {sum(seen)} characters matched"


def test_absurd_xid_number_is_unparseable_not_an_error():
    p = KernelLogParser()
    assert p.feed("NVRM: Xid (PCI:0000:01:00): " + "9" * 5000 + ", pid=1, name=x, text") == []
    assert p.feed("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): " + "9" * 5000 + ", Fatal, Link 1") == []
    (ev,) = p.feed("NVRM: Xid (PCI:0000:01:00): 4294967295, a number the driver could print")
    assert ev.xid == 4294967295 and ev.fatal and ev.name == "UNKNOWN_XID"


def test_a_long_record_still_yields_its_xid():
    (ev,) = KernelLogParser().feed("NVRM: Xid (PCI:0000:01:00): 48, " + "x" * 200_000)
    assert ev.xid == 48 and ev.fatal
