"""What the agent knows of its own node (agent/node_facts.py), on a real kube-apiserver: the own Node read (a GET at
resourceVersion=0, or the watch's cache; the last Node judged while the API is away, for STALE_NODE_S at most), and
the standing between cycles (the condition adopted once, the operator's clear-before annotation, the preflight
labels, a new boot)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent import config
from agent.clock import Clock
from agent.config import Config
from agent.kube.client import KubeApi
from agent.model import PciAddress, XidEvent
from agent.node_facts import CLEAR_ANNOTATION, STALE_NODE_S, OwnNode, Standing
from agent.state import LatchState
from testkit.harness import wait_for

GPU = PciAddress.parse("0000:3b:00")
XID = XidEvent(79, GPU, "0000:3b:00", True, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", seq=5)
BOOT = "9e1b4a1c-0000-4000-8000-000000000001"


class Log:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda event, **kw: self.calls.append((level, event))


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def counted(api: KubeApi) -> list[str]:
    seen: list[str] = []
    api.on_request = lambda verb, _code: seen.append(verb)
    return seen


def cfg_for(node: str, tmp_path: Path, **over: Any) -> Config:
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text(BOOT + "\n")
    return config.defaults(node_name=node, state_dir=str(tmp_path / "state"), boot_id_file=str(boot), **over)


def standing(cfg: Config, log: Log | None = None) -> tuple[Standing, LatchState, list[tuple[str, str]]]:
    state = LatchState(cfg.state_dir, BOOT)
    state.load()
    events: list[tuple[str, str]] = []
    s = Standing(cfg, state, Clock(), log or Log(), lambda reason, note, *_: events.append((reason, note)))
    return s, state, events


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the own Node ----------------------------------------------------------------------------------------------


def test_without_the_watch_each_read_is_one_get_and_the_last_node_is_judged_while_the_api_is_away(
    admin: KubeApi, make_node: Callable[..., str], tmp_path: Path
):
    name = make_node(labels={"pool": "a"})
    ticks = Ticks()
    own = OwnNode(admin, cfg_for(name, tmp_path, node_watch=False), Clock(mono=ticks), Log(), on_change=lambda: None)
    assert own.cache is None
    seen = counted(admin)
    node, err = own.read()
    assert err is None and node is not None and node["metadata"]["labels"]["pool"] == "a"
    assert seen == ["GET"] and own.last == (node, ticks.t)
    admin.on_request = None
    admin.request("DELETE", f"/api/v1/nodes/{name}")
    seen = counted(admin)
    ticks.t += STALE_NODE_S - 1
    again, err = own.read()
    assert (again, err) == (node, None)  # the Node last seen, while it is recent enough
    ticks.t += 2
    gone, err = own.read()
    assert gone is None and err is not None and "not found" in err
    assert seen == ["GET", "GET"]  # one request per read, no retry loop of its own


def test_a_node_that_never_existed_is_none_and_why(admin: KubeApi, tmp_path: Path):
    own = OwnNode(admin, cfg_for("no-such-node", tmp_path, node_watch=False), Clock(), Log(), on_change=lambda: None)
    node, err = own.read()
    assert node is None and err and own.last is None


def test_with_the_watch_reads_cost_no_request_and_a_label_change_calls_on_change(
    admin: KubeApi, make_node: Callable[..., str], tmp_path: Path
):
    name = make_node()
    changes: list[int] = []
    own = OwnNode(admin, cfg_for(name, tmp_path), Clock(), Log(), on_change=lambda: changes.append(1))
    assert own.cache is not None
    own.cache.start()
    try:
        wait_for(lambda: own.cache is not None and own.cache.live, 20, what="the Node watch to list")
        seen = counted(admin)
        for _ in range(5):
            node, err = own.read()
            assert err is None and node is not None
        assert seen == []  # five reads from the cache
        admin.on_request = None
        before = len(changes)
        admin.request(
            "PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": {"gpu-ready.io/x": "1"}}},
            "application/merge-patch+json",
        )  # fmt: skip
        wait_for(lambda: len(changes) > before, 20, what="on_change after a label change")
        wait_for(lambda: (own.read()[0] or {}).get("metadata", {}).get("labels", {}).get("gpu-ready.io/x") == "1", 20)
    finally:
        own.cache.stop()


# -- the standing ----------------------------------------------------------------------------------------------


def test_the_condition_on_the_node_is_adopted_once_and_a_latched_hold_counts_as_latched(
    admin: KubeApi, make_node: Callable[..., str], tmp_path: Path
):
    cond = {
        "type": "GPUReady", "status": "False", "reason": "FatalXid", "message": "Xid 79 on GPU 0",
        "lastTransitionTime": rfc3339(time.time() - 5), "lastHeartbeatTime": rfc3339(time.time() - 5),
    }  # fmt: skip
    name = make_node(conditions=[cond])
    cfg = cfg_for(name, tmp_path, node_watch=False)
    s, state, _ = standing(cfg)
    node = admin.get_node(name)
    adopted: list[tuple[Any, str]] = []
    for _ in range(3):
        s.observe(node, None, lambda existing, n: adopted.append((existing, n["metadata"]["name"])))
    assert len(adopted) == 1 and adopted[0][0]["reason"] == "FatalXid" and adopted[0][1] == name
    assert s.adopted and s.gate_state.hold is not None
    assert s.latched_fatal == s.gate_state.hold.latched
    assert state.snapshot() == []


def test_a_clear_before_annotation_clears_the_latches_once_and_records_one_event(
    admin: KubeApi, make_node: Callable[..., str], tmp_path: Path
):
    name = make_node()
    s, state, events = standing(cfg_for(name, tmp_path, node_watch=False))
    assert state.latch(XID, time.time() - 2) is not None and s.latched_fatal
    admin.request(
        "PATCH", f"/api/v1/nodes/{name}", {"metadata": {"annotations": {CLEAR_ANNOTATION: rfc3339(time.time())}}},
        "application/merge-patch+json",
    )  # fmt: skip
    node = admin.get_node(name)
    s.observe(node, 7, lambda *_: None)
    s.observe(node, 7, lambda *_: None)  # the same annotation again: already applied
    assert state.snapshot() == [] and not s.latched_fatal
    assert [r for r, _ in events] == ["FaultsCleared"] and CLEAR_ANNOTATION in events[0][1]


def test_a_future_dated_clear_is_refused_and_logged_once(admin: KubeApi, make_node: Callable[..., str], tmp_path: Path):
    future = rfc3339(time.time() + 3600)
    name = make_node(annotations={CLEAR_ANNOTATION: future})
    log = Log()
    s, state, events = standing(cfg_for(name, tmp_path, node_watch=False), log)
    state.latch(XID, time.time() - 2)
    node = admin.get_node(name)
    for _ in range(3):
        s.observe(node, 7, lambda *_: None)
    assert len(state.snapshot()) == 1 and events == []
    assert log.calls.count(("error", "ignoring clear annotation")) == 1


@pytest.mark.parametrize(
    ("labels", "gate_open"),
    [
        ({}, False),
        ({"preflight": "failed"}, False),
        ({"preflight": "passed"}, True),
        ({"preflight": "passed", "gpu-ready.io/needs-preflight": "true"}, False),
    ],
)
def test_the_preflight_labels_open_the_gate_only_on_a_pass_without_the_needs_label(
    admin: KubeApi, make_node: Callable[..., str], tmp_path: Path, labels: dict[str, str], gate_open: bool
):
    name = make_node(labels=labels)
    s, _, _ = standing(cfg_for(name, tmp_path, node_watch=False, require_preflight=True))
    s.observe(admin.get_node(name), None, lambda *_: None)
    assert s.gate_open is gate_open
    s.observe(None, None, lambda *_: None)  # an unreadable Node keeps what was known
    assert s.gate_open is gate_open


def test_a_new_boot_drops_the_latches_of_the_previous_one(tmp_path: Path):
    cfg = cfg_for("node-a", tmp_path, node_watch=False)
    log = Log()
    s, state, _ = standing(cfg, log)
    state.latch(XID, time.time())
    s.check_boot()
    assert len(state.snapshot()) == 1  # the same boot
    Path(cfg.boot_id_file).write_text("9e1b4a1c-0000-4000-8000-000000000002\n")
    s.check_boot()
    assert state.snapshot() == [] and ("info", "boot ID changed: latched faults cleared") in log.calls
