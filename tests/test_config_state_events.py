"""Settings, the latched-fault state file, Event aggregation."""

from __future__ import annotations

import json

import pytest

from agent import config
from agent.model import PciAddress, XidEvent
from agent.report.events import EventReporter
from agent.state import LatchState


def test_precedence_flag_env_file_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pollInterval: 10\nxidIgnore: [109]\nexpectedGpus: 8\n")
    args = config.argparse.Namespace(config=str(f), poll_interval=None, nvml="off")
    cfg = config.load(args, environ={"GPU_READY_POLL_INTERVAL": "20", "NODE_NAME": "n1"})
    assert (cfg.poll_interval, cfg.xid_ignore, cfg.expected_gpus, cfg.nvml, cfg.node_name) == (
        20.0,
        [109],
        8,
        "off",
        "n1",
    )
    assert cfg.heartbeat_interval == 300.0


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"GPU_READY_POLL_INTERVAL": "0"}, "poll-interval"),
        ({"GPU_READY_NVML": "maybe"}, "nvml"),
        ({"GPU_READY_XID_FATAL": "79", "GPU_READY_XID_IGNORE": "79"}, "both lists"),
        ({"GPU_READY_RECOVERY_POLLS": "two"}, "recovery-polls"),
    ],
)
def test_bad_values_name_the_setting(env, needle):
    with pytest.raises(config.ConfigError, match=needle):
        config.load(None, environ=env)


def test_unknown_file_key_is_rejected(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pollIntervall: 10\n")
    with pytest.raises(config.ConfigError, match="unknown setting 'pollIntervall'"):
        config.load(None, environ={"GPU_READY_CONFIG": str(f)})


def ev(xid=79, bus=0x3B, seq=1):
    a = PciAddress(0, bus, 0)
    return XidEvent(xid, a, a.kernel, True, f"Xid {xid}", "xid", "X", "RESTART_BM", seq, 0)


def test_state_latch_persist_restart_and_boot_change(tmp_path):
    s = LatchState(str(tmp_path), "boot-a")
    assert s.load() == "new"
    assert s.latch(ev(), 100.0) is not None
    assert s.latch(ev(seq=2), 101.0) is None  # same fault once
    t = LatchState(str(tmp_path), "boot-a")
    assert t.load() == "loaded" and [f.xid for f in t.snapshot()] == [79]
    u = LatchState(str(tmp_path), "boot-b")
    assert u.load() == "boot_changed" and u.snapshot() == []


def test_state_clear_and_no_relatch_of_replayed_records(tmp_path):
    s = LatchState(str(tmp_path), "b")
    s.load()
    s.latch(ev(seq=5), 100.0)
    s.latch(ev(xid=48, seq=6), 200.0)
    gone = s.clear_before(150.0, read_seq=6)
    assert [f.xid for f in gone] == [79] and [f.xid for f in s.snapshot()] == [48]
    r = LatchState(str(tmp_path), "b")
    r.load()
    assert r.latch(ev(seq=5), 300.0) is None  # replayed from the ring buffer after a restart
    assert r.latch(ev(xid=95, seq=7), 300.0) is not None


def test_corrupt_state_is_moved_aside(tmp_path):
    (tmp_path / "state.json").write_text("[1, 2")
    s = LatchState(str(tmp_path), "b")
    assert s.load() == "corrupt" and "corrupt state file" in s.load_problem
    assert json.loads((tmp_path / "state.json").read_text())["faults"] == []
    assert len(list(tmp_path.glob("state.json.corrupt-*"))) == 1


class RecordingApi:
    def __init__(self):
        self.calls = []

    def create_event(self, ns, body):
        self.calls.append(("create", body["reason"], body["note"]))

    def patch_event(self, ns, name, patch):
        self.calls.append(("patch", patch["series"]["count"]))


def test_event_storm_is_bounded_and_aggregated():
    now = [1000.0]
    api = RecordingApi()
    r = EventReporter(api, "n", interval_s=300, wall=lambda: now[0])  # type: ignore[arg-type]
    for i in range(50_000):
        r.record("FatalXid", f"Xid 95 #{i}", gpu="0000:3b:00")
        if i % 1000 == 0:
            r.flush()
    r.flush()
    assert api.calls == [("create", "FatalXid", "Xid 95 #0")]
    now[0] += 301
    r.flush()
    assert api.calls[1] == ("patch", 50_000)
    now[0] += 301
    assert r.flush() == 0  # nothing new: nothing written
    r.record("FatalXid", "again", gpu="0000:3b:00")
    assert r.flush() == 1 and api.calls[-1][0] == "create"


def test_configuration_doc_lists_every_setting():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for s in config.SETTINGS:
        assert f"| `{s.flag}` | `{s.env_name}`" in doc and f"`{s.file_key}`" in doc, s.name
