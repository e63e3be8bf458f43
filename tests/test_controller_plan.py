"""The controller's pure decisions (agent/controller/plan.py), the agent's reading of the brake (act/brake.py),
the needs-preflight rule (verdict.node_facts, act/preflight_mark.py) and the taint plan under the brake."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from agent.act.brake import Brake, engaged_for, object_ref
from agent.act.preflight_mark import NEEDS_LABEL, needs_mark
from agent.act.taints.plan import NO_EXECUTE, NO_SCHEDULE, TaintMode, TaintSettings, plan_taints
from agent.controller.plan import (
    LATCHED_REASONS,
    JobView,
    Limits,
    NodeView,
    attempt_of,
    brake_state,
    job_name,
    job_view,
    max_unavailable,
    node_view,
    plan_preflight,
)
from agent.model import Status
from agent.verdict import LATCHED_REASONS as VERDICT_LATCHED
from agent.verdict import NodeFacts, node_facts

NOW = 1_800_000_000.0


def nodes(*views: NodeView) -> dict[str, NodeView]:
    return {v.name: v for v in views}


def job(name: str, node: str, state: str = "active", attempt: int = 1, age: float = 10, **kw: Any) -> JobView:
    return JobView(
        name, node, state == "active", state == "ok", state == "failed", NOW - age,
        None if state == "active" else NOW - age / 2, attempt=attempt, **kw,
    )  # fmt: skip


# -- node facts and the brake budget ---------------------------------------------------------------------------


def test_node_view_reads_what_holds_a_node_out():
    n = {
        "metadata": {"name": "n1", "labels": {NEEDS_LABEL: "true", "preflight": "passed"}},
        "spec": {"taints": [{"key": "gpu-ready.io/gpu-not-ready", "effect": "NoSchedule"}]},
    }
    v = node_view(n, NEEDS_LABEL, "preflight", "gpu-ready.io/gpu-not-ready", "GPUReady", "")
    assert v == NodeView("n1", needs=True, preflight="passed", held="taint")
    cordoned = {"metadata": {"name": "n2", "annotations": {"gpu-ready.io/preflight-cordoned": "true"}},
                "spec": {"unschedulable": True}}  # fmt: skip
    assert node_view(cordoned, NEEDS_LABEL, "preflight", "t", "GPUReady", "").held == "preflight-cordon"
    admin_cordon = {"metadata": {"name": "n3"}, "spec": {"unschedulable": True}}
    assert node_view(admin_cordon, NEEDS_LABEL, "preflight", "t", "GPUReady", "").held == ""
    fenced = {"metadata": {"name": "n4"}, "status": {"conditions": [{"type": "GPUReady", "status": "False"}]}}
    assert node_view(fenced, NEEDS_LABEL, "preflight", "t", "GPUReady", "").held == "condition"
    new = {"metadata": {"name": "n5"}, "spec": {"taints": [{"key": "readiness.k8s.io/gpu", "effect": "NoSchedule"}]}}
    assert node_view(new, NEEDS_LABEL, "preflight", "t", "GPUReady", "readiness.k8s.io/gpu").startup_tainted


@pytest.mark.parametrize(
    "spec,total,want",
    [("10%", 1000, 100), ("20%", 10, 2), ("10%", 5, 1), ("0%", 10, 0), ("3", 10, 3), (0, 10, 0), ("100%", 7, 7)],
)
def test_max_unavailable(spec, total, want):
    assert max_unavailable(spec, total) == want


@pytest.mark.parametrize("bad", ["10 %", "-1", "ten", "1.5", "%"])
def test_max_unavailable_refuses_what_is_not_a_count_or_percentage(bad):
    with pytest.raises(ValueError):
        max_unavailable(bad, 10)


def test_brake_admits_at_most_the_budget_keeping_earlier_admissions():
    fleet = [NodeView(f"n{i}", held="taint" if i < 5 else "") for i in range(10)]
    st = brake_state(fleet, "20%")
    assert st.budget == 2 and st.engaged and st.admitted == ("n0", "n1")
    st2 = brake_state(fleet, "20%", previous=("n4", "n9"))  # n9 is not held any more: its slot is freed
    assert st2.admitted == ("n4", "n0")
    calm = brake_state([NodeView(f"n{i}") for i in range(10)], "20%", previous=("n1",))
    assert not calm.engaged and calm.admitted == () and calm.data()["engaged"] == "false"


def test_the_agent_reads_the_brake():
    cm = {"data": {"engaged": "true", "admitted": "a,b"}}
    assert not engaged_for(None, "a")  # no controller: as before
    assert not engaged_for(cm, "a") and engaged_for(cm, "c")
    assert engaged_for({"data": {"engaged": "false"}}, "a")  # malformed (no admitted): fails closed
    assert engaged_for({"data": {"admitted": "x" * 70000}}, "x")
    assert not Brake(None, "a", None, None).brake_engaged()  # no brake configured: never engaged
    assert object_ref("gpu-ready/gpu-ready-brake") == "gpu-ready/gpu-ready-brake"
    for bad in ("x", "a/b/c", "/b", "A/b"):
        with pytest.raises(ValueError):
            object_ref(bad)


def test_taints_under_the_brake_add_no_noexecute_and_keep_one_already_there():
    s = TaintSettings(TaintMode.CONTINUOUS, no_execute_on_fatal=True)
    free = plan_taints(Status.FALSE, "FatalXid", True, [], s, True)
    assert set(free.add) == {NO_SCHEDULE, NO_EXECUTE}
    held = plan_taints(Status.FALSE, "FatalXid", True, [], s, True, brake=True)
    assert held.add == (NO_SCHEDULE,) and "fleet brake" in held.why
    had = [{"key": s.key, "effect": NO_SCHEDULE}, {"key": s.key, "effect": NO_EXECUTE}]
    assert not plan_taints(Status.FALSE, "FatalXid", True, had, s, True, brake=True)


# -- the needs-preflight label ------------------------------------------------------------------------------------


def test_needs_preflight_blocks_a_passed_node_until_preflight_removes_it():
    passed = {"metadata": {"labels": {"preflight": "passed"}}}
    marked = {"metadata": {"labels": {"preflight": "passed", NEEDS_LABEL: "true"}}}
    assert node_facts(passed, "preflight", True, NodeFacts(), NEEDS_LABEL).preflight_passed
    assert not node_facts(marked, "preflight", True, NodeFacts(), NEEDS_LABEL).preflight_passed
    assert needs_mark(True, True, passed, NEEDS_LABEL)
    assert not needs_mark(True, True, marked, NEEDS_LABEL)  # already there: no write
    assert not needs_mark(False, True, passed, NEEDS_LABEL) and not needs_mark(True, False, passed, NEEDS_LABEL)


# -- preflight planning ------------------------------------------------------------------------------------------


def test_plan_creates_within_max_concurrent_and_adopts_running_jobs():
    ns = nodes(*(NodeView(f"n{i}", needs=True, held="taint") for i in range(4)), NodeView("ok"))
    p = plan_preflight(ns, [job("j0", "n0")], Limits(max_concurrent=2), NOW)
    assert p.running == 1 and p.create == ["n1"] and set(p.waiting) == {"n2", "n3"}
    assert "n0" not in p.create  # adopted


def test_plan_backs_off_caps_retries_and_cleans_up():
    ns = nodes(NodeView("a", needs=True, held="taint"), NodeView("b", needs=True, held="taint"), NodeView("c"))
    lim = Limits(max_concurrent=5, max_failures=2, backoff_s=100)
    jobs = [
        job("a1", "a", "failed", 1, age=10),  # failed 5 s ago: back off
        job("b1", "b", "failed", 1, age=1000), job("b2", "b", "failed", 2, age=1000),  # at the cap
        job("c1", "c", "ok", 1, age=100),  # passed long enough ago: deleted
        job("c0", "c", "failed", 1, age=100),  # c no longer needs preflight: its failures go
    ]  # fmt: skip
    p = plan_preflight(ns, jobs, lim, NOW)
    assert p.create == [] and p.waiting == ["a"] and p.gave_up == ["b"]
    assert set(p.delete) == {"c1", "c0"}
    later = plan_preflight(ns, jobs, lim, NOW + 200)
    assert later.create == ["a"] and attempt_of(jobs, "a") == 2


def test_plan_reports_a_job_that_never_starts_and_does_not_recreate_it():
    ns = nodes(NodeView("a", needs=True, held="taint"))
    p = plan_preflight(ns, [job("a1", "a", age=2000)], Limits(pending_timeout_s=900), NOW)
    assert p.stuck == ["a1"] and p.create == []


def test_plan_under_the_brake_starts_no_new_cordon():
    ns = nodes(NodeView("held", needs=True, held="taint"), NodeView("serving", needs=True))
    p = plan_preflight(ns, [], Limits(), NOW, brake_engaged=True)
    assert p.create == ["held"] and p.waiting == ["serving"]


def test_a_node_whose_fault_is_still_latched_waits_for_its_remedy():
    """Preflight on a node still reporting a latched fault would test a GPU known to be broken, and a pass would
    take the mark away before the remedy: it waits until the latch is gone (the node reads PreflightNotPassed)."""
    assert {r.value for r in VERDICT_LATCHED} == LATCHED_REASONS

    def cond(reason: str) -> dict[str, Any]:
        return {
            "metadata": {"name": reason, "labels": {NEEDS_LABEL: "true"}},
            "status": {"conditions": [{"type": "GPUReady", "status": "False", "reason": reason}]},
        }

    views = {r: node_view(cond(r), NEEDS_LABEL, "preflight", "t", "GPUReady", "") for r in
             ("FatalXid", "GPURecoveryFailed", "PreflightNotPassed")}  # fmt: skip
    assert [r for r, v in views.items() if v.latched] == ["FatalXid", "GPURecoveryFailed"]
    p = plan_preflight(views, [], Limits(max_concurrent=5), NOW)
    assert p.create == ["PreflightNotPassed"] and sorted(p.latched) == ["FatalXid", "GPURecoveryFailed"]
    assert p.waiting == [] and p.gave_up == []
    # its failed Jobs stay its history while it waits (still needed): no clean-up that would reset the cap
    again = plan_preflight(views, [job("x1", "FatalXid", "failed", 1, age=5000)], Limits(), NOW)
    assert again.delete == [] and again.create == ["PreflightNotPassed"]


def test_startup_taint_asks_for_a_run_until_passed():
    ns = nodes(NodeView("new", startup_tainted=True), NodeView("done", startup_tainted=True, preflight="passed"))
    assert plan_preflight(ns, [], Limits(), NOW).create == ["new"]


def test_job_names_fit_and_jobs_are_read_back():
    long = "n" * 200
    assert len(job_name("gpu-ready-preflight", long, 3)) <= 63
    assert job_name("p", long, 1) != job_name("p", long + "x", 1)
    j = {
        "metadata": {"name": "p-a-1", "annotations": {"gpu-ready.io/preflight-node": "a"},
                     "labels": {"gpu-ready.io/preflight-attempt": "1"}, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {"conditions": [{"type": "Failed", "status": "True", "lastTransitionTime": "2026-01-01T00:01:00Z"}]},
    }  # fmt: skip
    v = job_view(j)
    assert v is not None and v.failed and not v.active and v.attempt == 1 and v.finished == v.created + 60
    assert job_view({"metadata": {"name": "x"}}) is None  # not the controller's


def test_a_node_the_controller_does_not_count_is_admitted_by_rule():
    cm = {"data": {"engaged": "true", "admitted": "a", "selector": "nvidia.com/gpu.present=true"}}
    gpu = {"nvidia.com/gpu.present": "true"}
    assert engaged_for(cm, "b", gpu)  # counted, not admitted: held
    assert not engaged_for(cm, "b", {})  # outside the selector: the controller never counts it
    assert not engaged_for(cm, "b", {"nvidia.com/gpu.present": "false"})
    assert engaged_for(cm, "b", None)  # its labels not read yet: counted
    assert engaged_for({"data": {**cm["data"], "admitted": "x" * 70000}}, "b", {})  # malformed: fails closed
    assert engaged_for({"data": {"admitted": "a"}}, "b", {})  # no selector (an older controller): counted
    assert engaged_for({"data": {"admitted": "a", "selector": "in (x)"}}, "b", {})  # not one it reads: counted


@pytest.mark.parametrize(
    "selector,labels,want",
    [
        ("k=v", {"k": "v"}, True),
        ("k==v", {"k": "w"}, False),
        ("k!=v", {}, True),
        ("k", {"k": ""}, True),
        ("!k", {"k": "x"}, False),
        ("a=b,c", {"a": "b", "c": "1"}, True),
        ("a=b,c", {"a": "b"}, False),
        ("example.com/x=1", {"example.com/x": "1"}, True),
        ("k in (a)", {}, None),
        ("", {}, None),
        ("bad key!=x", {}, None),
        (7, {}, None),
    ],
)
def test_selector_matches(selector, labels, want):
    from agent.act.brake import selector_matches

    assert selector_matches(selector, labels) is want


def test_the_brake_admits_faults_first_and_a_self_report_weighs_one_node():
    latched = NodeView("z-latched", held="taint", latched=True, fault=True)
    fault = NodeView("y-fault", held="taint", fault=True)
    report = NodeView("a-report", held="condition")  # False with no fault reason of its own (a stolen token's)
    fleet = [report, fault, latched, *(NodeView(f"n{i}") for i in range(7))]
    st = brake_state(fleet, 1, previous=("a-report",))
    assert st.admitted == ("z-latched",) and st.engaged and len(st.unavailable) == 3
    st = brake_state(fleet, 2, previous=("a-report",))
    assert st.admitted == ("z-latched", "y-fault")
    alone = brake_state([report, *(NodeView(f"n{i}") for i in range(9))], 1)
    assert alone.admitted == ("a-report",) and not alone.engaged  # one node: one slot, never more
    # an earlier admission of the same rank is kept (no flapping between two faulty nodes)
    two = [NodeView("a", held="taint", fault=True), NodeView("b", held="taint", fault=True)]
    assert brake_state(two, 1, previous=("b",)).admitted == ("b",)


def test_node_view_reads_a_fault_reason():
    def node(reason: str) -> dict[str, Any]:
        return {"metadata": {"name": "n"},
                "status": {"conditions": [{"type": "GPUReady", "status": "False", "reason": reason}]}}  # fmt: skip

    args = ("needs", "preflight", "gpu-ready.io/gpu-not-ready", "GPUReady", "")
    assert node_view(node("NvidiaSmiErr"), *args).fault and not node_view(node("NvidiaSmiErr"), *args).latched
    assert node_view(node("FatalXid"), *args).latched
    assert not node_view(node("PreflightNotPassed"), *args).fault
    assert not node_view(node("Anything"), *args).fault


def test_the_brakes_fault_reasons_are_the_agents():
    from agent.controller.plan import FAULT_REASONS
    from agent.model import FAULT_REASONS as MODEL_FAULTS
    from agent.model import Reason

    assert {str(r) for r in MODEL_FAULTS if r != Reason.PREFLIGHT_NOT_PASSED} == FAULT_REASONS


def test_the_brake_counts_a_noexecute_still_in_effect_before_admitting_another():
    """Two admitted nodes recovered (their condition no longer reports the latched fault) but still carry the
    NoExecute their taint drops a moment later: the two latched nodes behind them wait for those slots instead of
    taking NoExecute beside them (never more evictions in effect than the budget)."""
    recovered = [NodeView(n, held="taint", evicting=True) for n in ("a", "b")]
    latched = [NodeView(n, held="taint", latched=True, fault=True) for n in ("c", "d", "e")]
    fleet = [*recovered, *latched, *(NodeView(f"n{i}") for i in range(5))]
    assert brake_state(fleet, 2, previous=("a", "b")).admitted == ("a", "b")
    # one dropped its NoExecute: its slot goes to the first latched node
    fleet[0] = NodeView("a", held="taint")
    assert brake_state(fleet, 2, previous=("a", "b")).admitted == ("c", "b")
    # more NoExecute in effect than the budget (a brake turned on late): only the budget's worth stay admitted
    many = [NodeView(f"x{i}", held="taint", evicting=True, latched=True, fault=True) for i in range(4)]
    assert brake_state(many, 2).admitted == ("x0", "x1")
    # a NoExecute on a node the brake never admitted (someone else's token) uses a slot: it delays, never adds
    rogue = [NodeView("r", held="taint", evicting=True), *latched, *(NodeView(f"n{i}") for i in range(5))]
    assert brake_state(rogue, 2).admitted == ("c", "r")


def test_node_view_reads_the_noexecute_in_effect():
    def node(effect: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "n"},
            "spec": {"taints": [{"key": "gpu-ready.io/gpu-not-ready", "effect": effect}]},
        }

    view = functools.partial(node_view, needs_label="l", preflight_label="p", taint_key="gpu-ready.io/gpu-not-ready",
                             ctype="GPUReady", startup_taint="")  # fmt: skip
    assert view(node("NoExecute")).evicting and not view(node("NoSchedule")).evicting
