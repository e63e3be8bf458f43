"""The kernel-log hot path's shortcuts judge exactly as the general path does, on random and hostile input:
- a saved log's lines read by the one header match (`KmsgSource._accept_lines`) give the same records, sequence,
  loss and read counts as `parse_record` + `_accept` line by line;
- the parser's memo of recent lines gives the same events as a parser that parses every line again (a memo
  small enough to be emptied many times over is tried too).
Seeded: a failure names its input and runs again the same."""

from __future__ import annotations

import random

import pytest

from agent.kernel_log import xid
from agent.kernel_log.source import MAX_RECORD, KmsgRecord, KmsgSource, parse_record

PIECES = [
    b"0", b"1", b"9", b",", b";", b"-", b"c", b" ", b"\r", b"\\x41", b"\\x0a", b"\xff", b"\xc3", b"\xc3\xa9",
    b"+", b"_", b"\t", b"NVRM: Xid (PCI:0000:3b:00): 79, ", b"a",
]  # fmt: skip

TEXTS = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
    "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:3b:00): 95, Uncontained",
    "NVRM: Xid (PCI:0000:19:00): 13, Graphics",
    "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 26006, SOE HALTED",
    "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 1",
    "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Severity 1",
    "NVRM: Xid (PCI:0000:3b:00): 99999999999, x",
    "NVRM: The NVIDIA GPU 0000:b3:00.0",
    "NVRM: fallen off the bus and is not responding to commands.",
    "unrelated",
    "NVRM: Xid (PCI:0000:3b:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x00000000 0x00000004 0x0 0x0)",
    "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
]


def random_line(rnd: random.Random) -> bytes:
    k = rnd.random()
    if k < 0.4:  # a kernel header, well formed or nearly
        prio = rnd.choice([0, 3, 6, 14, 30, 8, 999999999999999999999])
        head = b"%d,%d,%d" % (prio, rnd.randint(0, 50), rnd.randint(0, 10**6))
        if rnd.random() < 0.8:
            head += b"," + b"".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 4)))
        return head + b";" + b"".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 12)))
    if k < 0.45:  # at and over the record limit, a multi-byte character at the cut
        body = b"x" * rnd.choice([10, MAX_RECORD - 5, MAX_RECORD + 7]) + rnd.choice([b"", b"\xc3\xa9" * 3])
        return b"6,%d,1,-;" % rnd.randint(0, 60) + body
    return b"".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 14)))


@pytest.mark.parametrize("trust_user", [False, True])
def test_the_header_match_reads_a_saved_log_as_parse_record_does(trust_user: bool) -> None:
    rnd = random.Random(7)
    for _ in range(1500):
        lines = [random_line(rnd) for _ in range(rnd.randint(0, 12))]
        general, fast = KmsgSource("x", trust_user=trust_user), KmsgSource("x", trust_user=trust_user)
        general.last_seq = fast.last_seq = rnd.choice([None, 3])
        want: list[KmsgRecord] = []
        got: list[KmsgRecord] = []
        for raw in lines:
            raw = raw[:MAX_RECORD]
            if raw[:1] == b" ":
                continue  # a continuation line: parse_record's caller skips it too
            general._accept(parse_record(raw.decode("utf-8", "replace")), want)
        fast._accept_lines(lines, got)
        assert got == want, lines
        counts = (general.last_seq, general.lost_records, general.records_read)
        assert (fast.last_seq, fast.lost_records, fast.records_read) == counts, lines


class NoMemo(xid.KernelLogParser):
    """Parses every line again (the memo keeps nothing)."""

    def _remember(self, line, fields, seq, usec):  # type: ignore[no-untyped-def]
        return None if fields is None else xid.XidEvent(*fields, seq, usec)


@pytest.mark.parametrize("memo", [xid.LINE_MEMO, 3])
def test_the_parsers_memo_gives_the_events_a_fresh_parse_gives(monkeypatch: pytest.MonkeyPatch, memo: int) -> None:
    monkeypatch.setattr(xid, "LINE_MEMO", memo)
    rnd = random.Random(11)
    events = 0
    for _ in range(150):
        memoised, fresh = xid.KernelLogParser(), NoMemo()
        for seq in range(1, 201):
            text = rnd.choice(TEXTS)
            if rnd.random() < 0.1:
                text += "\n" + rnd.choice(TEXTS)
            usec = rnd.choice([None, seq * 1000, seq * 10**7])
            got = memoised.feed(text, seq, usec)
            assert got == fresh.feed(text, seq, usec), text
            events += len(got)
    assert events > 10_000  # the comparison saw events, not only lines without one
