"""The publisher (agent/publisher.py) as the loop over act/steps.py STEPS (the act/step.py contract): the order, the
one snapshot each step gets, a failing step not stopping the others, start/close, the one deadline; each step's
declared settings and admission policies against the settings table and the chart; and the real steps on a real
kube-apiserver (condition, then taint, then the needs-preflight label; the fleet brake read before a NoExecute)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agent import config
from agent.act.fencing.plan import FencingSection
from agent.act.step import Quiet, Snapshot, StepSpec, Wiring
from agent.act.steps import STEPS, ConditionStep, FenceStep, PreflightMarkStep, TaintStep
from agent.act.taints.plan import NO_EXECUTE, NO_SCHEDULE, TAINT_KEY
from agent.clock import Clock
from agent.kube.client import KubeApi
from agent.model import GpuIdentity, LatchedFault, Observation, PciAddress, Reason, Status, Verdict, XidEvent
from agent.publisher import Publisher
from agent.report.metrics import Metrics
from agent.verdict import decide

TEMPLATES = Path(__file__).resolve().parent.parent / "charts" / "gpu-ready" / "templates"
HEALTHY = Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "8 GPUs healthy")
GPU = PciAddress.parse("0000:3b:00")
assert GPU is not None
XID = XidEvent(79, GPU, "0000:3b:00", True, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus")


def fatal_verdict() -> Verdict:
    fault = LatchedFault(79, "0000:3b:00", GPU, "xid", XID.text, 0)
    return decide(Observation(), [fault])


class RecordingLog:
    """The structured logger's calls, kept: (level, event, fields)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda event, **kw: self.calls.append((level, event, kw))


class Recorder:
    """What the recording steps saw, in order: (step name, what happened, the snapshot or None)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Snapshot | None]] = []
        self.deadlines: dict[str, float | None] = {}
        self.fail: set[str] = set()  # "<name>:<run|close>" raises


def recording(name_: str, rec: Recorder, edit: Callable[[Snapshot], Snapshot] = lambda s: s) -> type:
    class Step(Quiet):
        name: ClassVar[str] = name_
        settings: ClassVar[type | None] = None
        policies: ClassVar[tuple[str, ...]] = ()

        def __init__(self, w: Wiring) -> None:
            rec.seen.append((name_, "built", None))

        def start(self) -> None:
            rec.seen.append((name_, "start", None))

        def close(self) -> None:
            rec.seen.append((name_, "close", None))
            if f"{name_}:close" in rec.fail:
                raise RuntimeError(f"{name_} close failed")

        def deadline(self, now: float) -> float | None:
            return rec.deadlines.get(name_)

        def run(self, snap: Snapshot) -> Snapshot:
            rec.seen.append((name_, "run", snap))
            if f"{name_}:run" in rec.fail:
                raise RuntimeError(f"{name_} failed")
            return edit(snap)

    return Step


@pytest.fixture
def node(make_node: Callable[..., str]) -> str:
    return make_node()


def publisher(api: KubeApi, node: str, steps: tuple[StepSpec, ...] = STEPS, log: Any = None, **over: Any) -> Publisher:
    cfg = config.defaults(node_name=node, **{"start_spread": 0, **over})
    return Publisher(cfg, api, Metrics(), Clock(), log or RecordingLog(), random.Random(1), lambda: None, steps=steps)


def publish(p: Publisher, v: Verdict = HEALTHY, **kw: Any) -> Snapshot:
    args: dict[str, Any] = {
        "latched": 0, "latched_fatal": False, "gate_open": True, "gpus": {}, "fresh": (), "inventory": None,
        "allocation": None, "node": None,
    }  # fmt: skip
    return p.publish(v, **{**args, **kw})


# -- the list and the contract -----------------------------------------------------------------------------


def test_steps_are_listed_once_in_the_publish_order():
    assert [s.kind.name for s in STEPS] == [
        "fencing", "affected pods", "metrics", "kernel-log events", "condition", "taint", "needs-preflight label",
    ]  # fmt: skip
    assert len({s.kind for s in STEPS}) == len(STEPS)


def test_each_steps_settings_section_is_a_section_of_the_settings_table():
    for spec in STEPS:
        assert spec.kind.settings is None or spec.kind.settings in config.SECTIONS, spec.kind.name
    assert FenceStep.settings is FencingSection


def test_each_policy_a_step_relies_on_is_a_validating_admission_policy_of_the_chart():
    declared = re.compile(r"kind: ValidatingAdmissionPolicy\nmetadata:\n  name: \{\{ \$fullname \}\}-([a-z-]+)\n")
    in_chart = {m for t in TEMPLATES.glob("*.yaml") for m in declared.findall(t.read_text())}
    wanted = {p for spec in STEPS for p in spec.kind.policies}
    assert wanted == {"own-node-only", "own-events-only", "own-devices-only"}
    assert wanted <= in_chart, wanted - in_chart
    writes = {"fencing", "condition", "taint", "needs-preflight label", "affected pods", "kernel-log events"}
    for spec in STEPS:  # every step that writes to the cluster names a policy; metrics write none
        assert bool(spec.kind.policies) == (spec.kind.name in writes), spec.kind.name


def test_fencing_is_a_step_only_when_on(admin: KubeApi, node: str):
    off = publisher(admin, node)
    assert type(off.steps[0]) is not FenceStep and off.step(FenceStep) is None
    on = publisher(admin, node, fencing=True)
    assert type(on.steps[0]) is FenceStep and [s.name for s in on.steps] == [s.kind.name for s in STEPS]


# -- the loop -----------------------------------------------------------------------------------------------


def test_every_step_gets_the_one_snapshot_in_order_with_the_notes_and_node_of_the_steps_before(
    admin: KubeApi, node: str
):
    rec = Recorder()
    fresher = ({"metadata": {"name": node, "resourceVersion": "9"}}, 5.0)
    steps = (
        StepSpec(recording("a", rec, lambda s: replace(s, note="fenced gpu-3 (NoSchedule)"))),
        StepSpec(recording("off", rec), lambda cfg: False),
        StepSpec(recording("b", rec, lambda s: replace(s, node=fresher))),
        StepSpec(recording("c", rec)),
    )
    p = publisher(admin, node, steps)
    gpus = {GPU: GpuIdentity(GPU, 3)}
    read = ({"metadata": {"name": node, "resourceVersion": "7"}}, 1.0)
    out = publish(p, latched=2, latched_fatal=True, gate_open=False, gpus=gpus, fresh=[XID], node=read, allocation=None)
    runs = [(n, s) for n, what, s in rec.seen if what == "run"]
    assert [n for n, _ in runs] == ["a", "b", "c"]  # in order; a step off under these settings is not built
    first = runs[0][1]
    assert first is not None
    assert (first.latched, first.latched_fatal, first.gate_open, first.gpus, first.fresh, first.node) == (
        2, True, False, gpus, (XID,), read,
    )  # fmt: skip
    assert first.verdict == HEALTHY and first.brake_engaged is False and first.note == ""  # no brake configured
    second, third = runs[1][1], runs[2][1]
    assert second is not None and third is not None
    assert second.verdict.message == "8 GPUs healthy; fenced gpu-3 (NoSchedule)" and second.note == ""
    assert second.node == read and third.node == fresher  # a step hands on a fresher Node copy
    assert out.verdict.message == second.verdict.message and out.node == fresher


def test_a_failing_step_is_logged_and_the_steps_after_it_still_run(admin: KubeApi, node: str):
    rec, log = Recorder(), RecordingLog()
    rec.fail = {"b:run"}
    steps = tuple(StepSpec(recording(n, rec, lambda s: replace(s, note=f"note {s.latched}"))) for n in "abc")
    p = publisher(admin, node, steps, log=log)
    publish(p, latched=1)
    publish(p, latched=2)
    assert [n for n, what, _ in rec.seen if what == "run"] == ["a", "b", "c", "a", "b", "c"]
    assert p.failures == 2
    failed = [(lvl, ev, kw["step"]) for lvl, ev, kw in log.calls if ev == "publish step failed"]
    assert failed == [("exception", "publish step failed", "b")] * 2
    c = next(s for n, what, s in rec.seen if n == "c" and what == "run")
    assert c is not None and c.verdict.message == "8 GPUs healthy; note 1"  # b's failure lost only b's note


def test_start_and_close_reach_every_step_and_one_failing_close_stops_none(admin: KubeApi, node: str):
    rec, log = Recorder(), RecordingLog()
    rec.fail = {"a:close"}
    p = publisher(admin, node, tuple(StepSpec(recording(n, rec)) for n in "ab"), log=log)
    p.start()
    p.close()
    assert [(n, what) for n, what, _ in rec.seen] == [
        ("a", "built"), ("b", "built"), ("a", "start"), ("b", "start"), ("a", "close"), ("b", "close"),
    ]  # fmt: skip
    assert [kw["step"] for _, ev, kw in log.calls if ev == "publish step failed to close"] == ["a"]
    assert p.events.stop.is_set()  # the shared Event writer is closed with the steps


def test_next_deadline_is_the_soonest_future_deadline_of_any_step(admin: KubeApi, node: str):
    rec = Recorder()
    p = publisher(admin, node, tuple(StepSpec(recording(n, rec)) for n in "abc"))
    assert p.next_deadline(100.0) is None
    rec.deadlines = {"a": 130.0, "b": 90.0, "c": 120.0}  # b's is past: no wait
    assert p.next_deadline(100.0) == 120.0


def test_the_first_write_spread_is_the_condition_steps_deadline(admin: KubeApi, node: str):
    p = publisher(admin, node, start_spread=3600)
    cond = p.step(ConditionStep)
    assert cond is not None and p.first_write_at == cond.first_write_at
    p.first_write_at = 1e12
    assert cond.first_write_at == 1e12 and p.next_deadline(0.0) == 1e12


# -- the real steps on a real apiserver ---------------------------------------------------------------------


def test_the_condition_then_the_taint_then_the_label_and_no_noexecute_while_the_brake_is_unknown(
    admin: KubeApi, node: str
):
    """taints continuous with NoExecute on a latched fault, the preflight mark on, a brake ConfigMap configured but
    not watched yet (unknown: held, fails closed): one publish writes the condition, a NoSchedule taint only and
    the label; the snapshot carried the brake as engaged."""
    p = publisher(
        admin, node, taints="continuous", taint_no_execute=True, preflight_after_fault=True,
        brake_configmap="gpu-ready/brake",
    )  # fmt: skip
    seen: list[tuple[str, str]] = []
    admin.on_request = lambda verb, _code: seen.append((verb, ""))
    read = (admin.get_node(node), 0.0)
    seen.clear()
    out = publish(p, fatal_verdict(), latched=1, latched_fatal=True, node=read)
    assert out.brake_engaged is True
    got = admin.get_node(node)
    cond = [c for c in got["status"]["conditions"] if c["type"] == "GPUReady"]
    assert [(c["status"], c["reason"]) for c in cond] == [("False", "FatalXid")]
    effects = sorted(t["effect"] for t in got["spec"].get("taints") or [] if t["key"] == TAINT_KEY)
    assert effects == [NO_SCHEDULE] and NO_EXECUTE not in effects
    assert got["metadata"]["labels"].get("gpu-ready.io/needs-preflight") == "true"
    patches = [v for v, _ in seen if v == "PATCH"]
    assert len(patches) == 3  # status, taint, label: one write each
    taint = p.step(TaintStep)
    mark = p.step(PreflightMarkStep)
    assert taint is not None and mark is not None and mark.mark.writes == 1
    # the label step planned from the Node copy the taint step wrote, not the poll's older read
    assert out.node is not None and out.node[0]["metadata"]["resourceVersion"] != read[0]["metadata"]["resourceVersion"]
    seen.clear()
    publish(p, fatal_verdict(), latched=1, latched_fatal=True, node=out.node)  # steady state: no request
    assert [v for v, _ in seen if v != "GET"] == []
