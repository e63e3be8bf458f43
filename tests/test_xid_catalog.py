"""The Xid catalog and the NVLink5 decode table are data with one rule: these tests fail when a row breaks it."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from agent.kernel_log.xid import (
    NVLINK5_LATCH_ACTIONS,
    KernelLogParser,
    Nvlink5Record,
    decode_nvlink5,
    load_catalog,
    load_nvlink5_table,
)

DOC = Path(__file__).parents[1] / "docs" / "xid-policy.md"
# The catalog's rule (agent/data/xid_catalog.csv header): every immediate action latches except these. The agent
# reads each row's `fatal`; these tests hold the rows to the rule.
NO_LATCH_ACTIONS = frozenset({"RESTART_APP", "IGNORE"})


def latches(action: str) -> bool:
    """The catalog's one rule: an immediate action latches unless it is RESTART_APP or IGNORE."""
    return action not in NO_LATCH_ACTIONS


# Every immediate action the catalog uses. A new bucket in a newer catalog fails here until someone decides it.
KNOWN_ACTIONS = {
    "RESTART_APP",
    "IGNORE",
    "RESET_GPU",
    "RESTART_BM",
    "RESTART_VM",
    "CONTACT_SUPPORT",
    "CHECK_MECHANICALS",
    "CHECK_UVM",
    "UPDATE_SWFW",
    "WORKFLOW_XID_45",
    "WORKFLOW_XID_48",
    "WORKFLOW_NVLINK_ERR",
    "WORKFLOW_NVLINK5_ERR",
    "XID_154",
    "NONE_LISTED",
}


def csv_header() -> str:
    text = resources.files("agent").joinpath("data/xid_catalog.csv").read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


def test_every_code_of_the_catalog_is_a_row():
    cat = load_catalog()
    assert sorted(cat) == list(range(1, 173))
    assert all(e.name and e.action and e.why for e in cat.values())
    assert {e.action for e in cat.values()} <= KNOWN_ACTIONS


def test_the_rule_is_written_at_the_top_of_the_file():
    head = csv_header()
    assert (
        "RULE: fatal (latch GPUReady=False until reboot or clear) unless the immediate action is RESTART_APP or IGNORE"
        in head
    )
    assert {"RESTART_APP", "IGNORE"} == NO_LATCH_ACTIONS


def test_every_row_follows_the_rule_or_says_why_not():
    broken = [
        (e.xid, e.action, e.fatal) for e in load_catalog().values() if e.fatal != latches(e.action) and not e.exception
    ]
    assert broken == [], "rows that break the rule without an exception"


def test_no_exception_is_left_over_after_a_row_follows_the_rule_again():
    stale = [e.xid for e in load_catalog().values() if e.exception and e.fatal == latches(e.action)]
    assert stale == []


def test_exceptions_are_listed_in_the_header_and_the_docs():
    exceptions = sorted(e.xid for e in load_catalog().values() if e.exception)
    assert exceptions == [45, 162, 163, 164, 165, 171, 172]
    m = re.search(r"^# EXCEPTIONS:.*\n#\s+([\d, ]+)", csv_header(), re.M)
    assert m and sorted(int(x) for x in m.group(1).replace(" ", "").strip(",").split(",")) == exceptions
    doc = DOC.read_text()
    section = doc[doc.index("### Exceptions") : doc.index("### Codes that follow the rule")]
    assert sorted(int(x) for x in re.findall(r"^\| (\d+) \|", section, re.M)) == exceptions


def test_decided_per_record_only_where_the_record_carries_the_answer():
    by = {e.xid: e.decide_by for e in load_catalog().values() if e.decide_by}
    assert by == {**{x: "nvlink5" for x in range(144, 151)}, 154: "action_code"}


def test_docs_list_every_code_with_its_action_and_decision():
    doc = DOC.read_text()
    rows = re.findall(r"^\| (\d+) \| (\S+) \| (\S+) \| (yes|no) \|", doc, re.M)
    table = {int(x): (name, action, yes == "yes") for x, name, action, yes in rows if int(x) in range(1, 173)}
    # The exceptions table uses another layout, so only the big table matches this shape
    assert table == {e.xid: (e.name, e.action, e.fatal) for e in load_catalog().values()}


def test_the_contested_decisions():
    cat = load_catalog()
    assert cat[109].fatal and cat[109].action == "RESET_GPU"  # catalog says reset; the device plugin ignores it
    assert not cat[63].fatal and cat[64].fatal  # remap recorded vs remap failed
    assert cat[48].fatal and cat[74].fatal and cat[79].fatal  # WORKFLOW_XID_48, WORKFLOW_NVLINK_ERR, RESTART_BM
    assert not any(cat[x].fatal for x in (8, 13, 14, 31, 43, 45, 69, 92, 94))


# --- NVLink5 decode table -------------------------------------------------------------------------------------


def test_decode_table_rows_are_consistent():
    table = load_nvlink5_table()
    assert sorted(table) == list(range(144, 151))
    rows = [r for rs in table.values() for r in rs]
    assert len(rows) == 95
    assert {r.action for r in rows} | {r.action2 for r in rows if r.action2} == {"IGNORE", "RESET_GPU", "XID_154_EVAL"}
    for r in rows:
        low5 = r.v1.value & 0x1F
        assert r.v1.mask & 0x1F == 0x1F and low5 == (r.xid - 143 if r.xid < 150 else 0), (r.xid, r.units)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_every_row_decodes_to_its_own_action(version):
    """Builds a record from each row's own bit pattern and error status: the decoder must find that row, so no
    V1 pattern collides with a V2 pattern or with another row."""
    table = load_nvlink5_table()
    for rows in table.values():
        for r in rows:
            pattern = r.v1 if version == "v1" else r.v2
            # the pattern's fixed bits, every '-' bit zero
            rec = Nvlink5Record(None, None, pattern.value, 0 if r.status is None else r.status)
            assert decode_nvlink5(table, r.xid, rec) == r.action, (r.xid, r.units, r.status, version)
            a2 = r.action2_v1 if version == "v1" else r.action2_v2
            if a2 is not None:
                rec = Nvlink5Record(None, None, a2.value, r.status or 0)
                assert decode_nvlink5(table, r.xid, rec) == r.action2 == "RESET_GPU"


def test_latching_actions_of_the_decode_table():
    assert {"RESET_GPU"} == NVLINK5_LATCH_ACTIONS


# Record shapes: leptonai/gpud components/accelerator/nvidia/xid/nvlink_logs_test.go (tests/fixtures/
# xid-lines-144-150-nvlink5-r575-shapes-gpud-test.txt), with the word changed where noted: the table decides.
def nvlink5_line(xid: int, unit: str, word: str, intr: int, status: int, domain: str = "0000:04:00") -> str:
    regs = f"(0x{intr:08x} 0x{status:08x} 0x00000000 0x00000000)"
    return f"NVRM: Xid (PCI:{domain}): {xid}, {unit} {word} XC0 i0 Link 00 {regs}"


@pytest.mark.parametrize(
    "line,fatal,action",
    [
        # RLW_REMAP status 0x40 is RESET_GPU/Fatal in the table even when the record says Nonfatal
        (nvlink5_line(145, "RLW_REMAP", "Nonfatal", 0x4, 0x40), True, "RESET_GPU"),
        # TLW status 0x4: RESET_GPU, whatever the word
        (nvlink5_line(146, "TLW_CTRL", "Nonfatal", 0x9, 0x4), True, "RESET_GPU"),
        # and the other way: a row that says IGNORE wins over a "Fatal" word
        (nvlink5_line(145, "RLW_REMAP", "Fatal", 0x4, 0x100), False, "IGNORE"),
        # V1 (R570) record: RLW_REMAP in intrInfo bits 9:5 (0x82), status 0x40
        (nvlink5_line(145, "RLW_REMAP", "Nonfatal", 0x82, 0x40, "0001:00:00"), True, "RESET_GPU"),
        # RLW_RXPIPE "Non-fatal*": the promotion bit (V2 bit 7, V1 bit 10) selects Action 2
        (nvlink5_line(145, "RLW_RXPIPE", "Nonfatal", 0x86, 0x1), True, "RESET_GPU"),
        (nvlink5_line(145, "RLW_RXPIPE", "Nonfatal", 0x4C2, 0x1), True, "RESET_GPU"),
        (nvlink5_line(145, "RLW_RXPIPE", "Nonfatal", 0x6, 0x1), False, "IGNORE"),
        # 149 link down, reason 101000 (bits 25:20): IGNORE / INVESTIGATE_HOST although the record says Fatal
        (nvlink5_line(149, "NETIR_LINK_EVT", "Fatal", 0x02800011, 0x0), False, "IGNORE"),
        # 149 link down, a reason the table does not list (000011): the word decides
        (nvlink5_line(149, "NETIR_LINK_EVT", "Fatal", 0x00300011, 0x0), True, "RESET_GPU"),
        # a status the table has no row for: the word decides
        (nvlink5_line(146, "TLW_CTRL", "Fatal", 0x9, 0x40), True, "RESET_GPU"),
        (nvlink5_line(146, "TLW_CTRL", "Nonfatal", 0x9, 0x40), False, "IGNORE"),
        # unknown intrInfo, but the printed unit names rows that agree: TLW_CTRL status 0x4 is RESET_GPU
        (nvlink5_line(146, "TLW_CTRL", "Nonfatal", 0x7777, 0x4), True, "RESET_GPU"),
        # neither table nor word: latched
        ("NVRM: Xid (PCI:0000:04:00): 147, something new", True, "WORKFLOW_NVLINK5_ERR"),
    ],
)
def test_nvlink5_record_is_judged_by_the_table(line, fatal, action):
    (ev,) = KernelLogParser().feed(line)
    assert (ev.fatal, ev.action) == (fatal, action)
