"""`gpu-ready run` end to end: the real agent process, the real apiserver, a simulated GPU host."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from agent.verdict import parse_rfc3339
from testkit.cluster import AGENT_RULES, condition
from testkit.harness import wait_for

pytestmark = pytest.mark.apiserver

# No poll comes due while a test runs: the first check cycle runs at start, and every nvidia-smi run after it would
# be a poll, so "the condition changed and nvidia-smi ran 0 more times" proves the kernel log or the watch carried
# it, however slow the machine (a 30 s poll may fall due during any wait, at a moment the test cannot know).
NO_POLL = {"--poll-interval": "3600"}
CLEAR = "gpu-ready.io/clear-before"


def events_for(admin, node, namespace="default"):
    items = admin.request("GET", f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")["items"]
    return [e for e in items if e["regarding"]["name"] == node]


def writes_of(agent) -> float:
    return agent.metric("gpu_ready_condition_writes_total") or 0.0


def polls_after(agent, simhost, n: int, timeout: float = 30.0) -> None:
    """Waits until the agent has run nvidia-smi n more times (n more check cycles)."""
    start = simhost.smi_call_count()
    wait_for(lambda: simhost.smi_call_count() >= start + n, timeout, what=f"{n} more check cycles")


def test_healthy_node_reports_true_next_to_kubelet_ready(admin, agent_factory):
    a = agent_factory()
    c = a.wait_status(admin, "True", "GPUsHealthy")
    assert c["message"] == "8 GPUs healthy"
    node = admin.get_node(a.node)
    assert condition(node, "Ready")["reason"] == "KubeletReady"  # untouched
    assert a.http("/readyz")[0] == 200 and a.http("/healthz")[0] == 200
    # Events go out on their own thread, after the condition: wait for it (bounded) rather than read once
    wait_for(
        lambda: any(
            e["reason"] == "GPUsHealthy" and e["reportingController"] == "gpu-ready" for e in events_for(admin, a.node)
        ),
        30,
        what="the GPUsHealthy Event",
    )


def test_err_field_then_xid79_then_recovery_and_transition_times(admin, agent_factory, simhost):
    a = agent_factory(extra={"--heartbeat-interval": "1"})
    c0 = a.wait_status(admin, "True")
    simhost.set_smi(err={2: ("Fan", "Pwr:Usage")})
    c1 = a.wait_status(admin, "False", "NvidiaSmiErr")
    assert "GPU 2 (00000000:4C:00.0)" in c1["message"] and "ERR! in Fan, Pwr:Usage" in c1["message"]
    assert c1["lastTransitionTime"] >= c0["lastTransitionTime"]
    # Heartbeat: same status, newer lastHeartbeatTime, unchanged lastTransitionTime.
    c2 = wait_for(
        lambda: (c := a.gpu_ready(admin)) and c["lastHeartbeatTime"] != c1["lastHeartbeatTime"] and c,
        20,
        what="a heartbeat",
    )
    assert c2["status"] == "False" and c2["lastTransitionTime"] == c1["lastTransitionTime"]
    assert parse_rfc3339(c2["lastHeartbeatTime"]) > parse_rfc3339(c1["lastHeartbeatTime"])
    simhost.append_xid(79, 5)
    c3 = a.wait_status(admin, "False", "FatalXid")
    assert "GPU 5 (00000000:BB:00.0): Xid 79" in c3["message"] and "NvidiaSmiErr" in c3["message"]
    assert c3["lastTransitionTime"] == c1["lastTransitionTime"]  # status did not change


def test_recovery_needs_consecutive_clean_polls(admin, agent_factory, simhost):
    a = agent_factory(extra={"--recovery-polls": "3", "--poll-interval": "0.4"})
    a.wait_status(admin, "True")
    simhost.set_smi(err={0: ("Temp",)})
    a.wait_status(admin, "False", "NvidiaSmiErr")
    calls_at_clean = simhost.smi_call_count()
    simhost.set_smi()
    a.wait_status(admin, "True", timeout=20)
    # True only after at least 3 clean runs of nvidia-smi.
    assert simhost.smi_call_count() - calls_at_clean >= 3


def test_latch_survives_agent_restart_and_clears_on_new_boot(admin, agent_factory, simhost):
    a = agent_factory()
    a.wait_status(admin, "True")
    simhost.append_xid(48, 1, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer")
    a.wait_status(admin, "False", "FatalXid")
    assert a.terminate() == 0
    # The ring buffer rolled over: the record is gone, only the state file remembers it.
    simhost.kmsg.write_text("")
    b = agent_factory(node=a.node)
    seen: set[str] = set()

    def b_wrote_and_polled() -> bool:
        seen.add(b.gpu_ready(admin)["status"])
        return writes_of(b) >= 1 and simhost.smi_call_count() >= calls + 5  # > --recovery-polls cycles

    calls = simhost.smi_call_count()
    wait_for(b_wrote_and_polled, 30, what="the restarted agent wrote and ran 5 cycles")
    seen.add(b.gpu_ready(admin)["status"])
    assert seen == {"False"}, "a restart during a fault must never write True"
    assert "Xid 48" in b.gpu_ready(admin)["message"]
    assert b.terminate() == 0
    simhost.new_boot()
    c = agent_factory(node=a.node)
    c.wait_status(admin, "True", timeout=20)


def test_operator_clear_annotation_and_no_relatch_after_restart(admin, agent_factory, simhost):
    a = agent_factory()
    a.wait_status(admin, "True")
    simhost.append_xid(79, 3)
    a.wait_status(admin, "False", "FatalXid")
    # The fault was latched before the condition turned False: a clear dated now (to the microsecond) covers it.
    before = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    admin.patch_node(a.node, {"metadata": {"annotations": {"gpu-ready.io/clear-before": before}}})
    a.wait_status(admin, "True", timeout=20)
    cleared = wait_for(
        lambda: [e for e in events_for(admin, a.node) if e["reason"] == "FaultsCleared"], 20, what="FaultsCleared"
    )
    assert before in cleared[0]["note"]
    assert a.terminate() == 0
    b = agent_factory(node=a.node)  # replays the same ring buffer: must not latch the cleared Xid again
    calls = simhost.smi_call_count()
    wait_for(
        lambda: writes_of(b) >= 1 and simhost.smi_call_count() >= calls + 3,
        30,
        what="the restarted agent wrote the condition and ran 3 cycles",
    )
    assert b.gpu_ready(admin)["status"] == "True"
    assert "latched faults restored" not in b.logs()
    simhost.append_xid(95, 0, "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No")
    c = b.wait_status(admin, "False", "FatalXid")
    assert "Xid 95" in c["message"] and "Xid 79" not in c["message"]


def test_future_dated_clear_before_does_not_clear_a_fault(admin, agent_factory, simhost):
    """A clear-before dated in the future (left on the Node across a reboot) must not clear the faults of
    the boot: refused and logged once; the fault stays."""
    a = agent_factory()
    a.wait_status(admin, "True")
    simhost.append_xid(79, 2)
    a.wait_status(admin, "False", "FatalXid")
    future = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    admin.patch_node(a.node, {"metadata": {"annotations": {"gpu-ready.io/clear-before": future}}})
    wait_for(lambda: "ignoring clear annotation" in a.logs(), 20, what="the refusal logged")
    polls_after(a, simhost, 4)
    c = a.gpu_ready(admin)
    assert (c["status"], c["reason"]) == ("False", "FatalXid") and "Xid 79" in c["message"]
    logged = [json.loads(x) for x in a.logs().splitlines() if x.startswith("{")]
    refusals = [r for r in logged if r.get("event") == "ignoring clear annotation"]
    assert len(refusals) == 1 and "future" in refusals[0]["problem"]
    assert a.metric("gpu_ready_latched_faults") == 1


def test_unwritable_state_dir_is_visible_and_a_restart_after_rollover_is_not_true(admin, agent_factory, simhost):
    """A latch write that fails (here the state dir is under a regular file, which fails for root too) is
    logged, counted and fails /healthz (503 until a write succeeds: a restart would lose the in-memory latch). After a
    restart and a ring-buffer rollover the Node keeps its FatalXid condition: the agent adopts it as a
    latched fault (until a reboot or an operator clear) instead of reading True."""
    blocker = simhost.root / "state-is-a-file"
    blocker.write_text("")
    extra = {"--state-dir": str(blocker / "state")}
    a = agent_factory(extra=extra)
    # never True while a latch would not survive a restart: could not check, naming why
    a.wait_status(admin, "Unknown", "CheckFailed")
    assert "latched faults cannot be saved" in a.gpu_ready(admin)["message"]
    simhost.append_xid(48, 1, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer")
    a.wait_status(admin, "False", "FatalXid")
    wait_for(lambda: (a.metric("gpu_ready_state_write_failures_total") or 0) >= 1, 20, what="failure counted")
    code, body = a.http("/healthz")
    assert code == 503 and "latched faults are not persisted" in body
    assert a.terminate() == 0
    simhost.kmsg.write_text("")  # the ring buffer rolled over: the record is gone
    b = agent_factory(node=a.node, extra=extra)
    seen: set[str] = set()

    def b_wrote_and_polled() -> bool:
        seen.add(b.gpu_ready(admin)["status"])
        return writes_of(b) >= 1 and simhost.smi_call_count() >= calls + 5

    calls = simhost.smi_call_count()
    wait_for(b_wrote_and_polled, 30, what="the restarted agent wrote and ran 5 cycles")
    c = b.gpu_ready(admin)
    assert seen == {"False"} and c["reason"] == "FatalXid"
    assert "Xid 48" in c["message"] and "latch file did not hold it" in c["message"]
    # A reboot ends it (seen by the running agent as a new boot ID; after a restart, the condition's
    # lastTransitionTime older than the kernel's boot time says the same: tests/test_policy.py).
    simhost.new_boot()
    b.wait_status(admin, "Unknown", "CheckFailed", timeout=30)  # still: the latch store is still unwritable
    blocker.unlink()  # the state dir can be made again: the next write succeeds and the node reads True
    b.wait_status(admin, "True", timeout=30)


def test_xid_storm_writes_are_bounded(admin, agent_factory, simhost):
    a = agent_factory()
    a.wait_status(admin, "True")
    writes_before = a.metric("gpu_ready_condition_writes_total")
    lines = []
    for i in range(100_000):
        gpu = (i // 2) % 8
        lines.append(simhost.xid_line(95 if i % 2 else 13, gpu, "Uncontained: LTC TAG (0x2, 0x1). RST: Yes"))
    t0 = time.monotonic()
    simhost.append_kmsg(*lines)
    a.wait_status(admin, "False", "FatalXid", timeout=60)
    wait_for(lambda: (a.metric("gpu_ready_kmsg_records_total") or 0) >= 100_000, 60, 0.2, "storm read")
    elapsed = time.monotonic() - t0
    event_writes = wait_for(lambda: a.metric("gpu_ready_events_total") == 8 + 2 and 10.0, 20, what="10 Events")
    writes = a.metric("gpu_ready_condition_writes_total") - writes_before
    api = a.metric("gpu_ready_api_requests_total")
    print(
        f"\n[storm] 100000 records read in {elapsed:.2f}s; condition writes {writes:.0f}; "
        f"event writes {event_writes:.0f}; API requests {api:.0f}"
    )
    assert writes <= 3
    fatal_events = [e for e in events_for(admin, a.node) if e["reason"] == "FatalXid"]
    print(f"[storm] FatalXid events {len(fatal_events)}: " + ", ".join(sorted(e["note"][:30] for e in fatal_events)))
    # one Event per (reason, GPU) per interval: 8 GPUs x FatalXid, plus the two transitions
    assert len([e for e in fatal_events if e["note"].startswith("Xid 95")]) == 8
    assert event_writes == 8 + 2
    assert a.metric("gpu_ready_xid_total", {"xid": "95", "fatal": "true"}) == 50_000
    assert a.metric("gpu_ready_xid_total", {"xid": "13", "fatal": "false"}) == 50_000


def test_hung_nvidia_smi_is_a_failure_not_a_hang(admin, agent_factory, simhost):
    a = agent_factory(extra={"--nvidia-smi-timeout": "1"})
    a.wait_status(admin, "True")
    simhost.set_smi(hang=True)
    c = a.wait_status(admin, "False", "NvidiaSmiFailed", timeout=20)
    assert "timed out after 1s" in c["message"]
    assert a.metric("gpu_ready_nvidia_smi_timeouts_total") >= 1
    assert a.http("/healthz")[0] == 200  # the loop is not wedged


def test_sigterm_exits_zero(admin, agent_factory):
    a = agent_factory()
    a.wait_status(admin, "True")
    rc = a.terminate(timeout=10)  # killed (not 0) if it had not exited by itself within the wait
    assert rc == 0 and '"event": "stopped"' in a.logs()


def test_forbidden_is_logged_once_and_recovers_when_rbac_is_fixed(admin, agent_factory):
    rules = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]  # no nodes/status patch
    a = agent_factory(rules=rules)
    wait_for(lambda: "forbidden" in a.logs(), 20, what="forbidden logged")
    retried = {"verb": "PATCH", "code": "403"}
    wait_for(lambda: (a.metric("gpu_ready_api_requests_total", retried) or 0) >= 3, 30, what="3 refused writes")
    assert a.proc.poll() is None
    logged = [json.loads(line) for line in a.logs().splitlines() if line.startswith("{")]
    assert sum(1 for r in logged if r.get("state") == "forbidden") == 1, "log once per state change"
    assert a.gpu_ready(admin) is None
    role = a.sa["cluster_role"]
    admin.request(
        "PATCH",
        f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role}",
        {"rules": AGENT_RULES},
        "application/merge-patch+json",
    )
    a.wait_status(admin, "True", timeout=30)


def test_unreadable_kmsg_is_unknown_and_retried(admin, agent_factory, simhost, tmp_path):
    missing = tmp_path / "no-such-kmsg"
    a = agent_factory(kmsg=str(missing))
    c = a.wait_status(admin, "Unknown", "CheckFailed")
    assert "kernel log" in c["message"]
    missing.write_text("")
    a.wait_status(admin, "True", timeout=20)


def test_lost_kmsg_records_are_counted(admin, agent_factory, simhost):
    a = agent_factory()
    a.wait_status(admin, "True")
    simhost.append_kmsg("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07")
    simhost.skip_seq(250)
    simhost.append_kmsg("random kernel line")
    wait_for(lambda: a.metric("gpu_ready_kmsg_lost_records_total") == 250, 10, what="lost records counted")
    wait_for(lambda: "re-running level checks" in a.logs(), 10, what="the loss logged (after it is counted)")


def test_corrupt_state_file_is_replaced_not_fatal(admin, agent_factory, simhost):
    (simhost.state_dir / "state.json").write_text("{not json")
    a = agent_factory()
    a.wait_status(admin, "True")
    assert "corrupt state file" in a.logs()
    assert any(p.name.startswith("state.json.corrupt-") for p in simhost.state_dir.iterdir())
    assert json.loads((simhost.state_dir / "state.json").read_text())["version"] == 1


def test_bad_configuration_exits_nonzero_naming_the_setting(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--node-name", "n", "--poll-interval", "-3"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "poll-interval" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "agent", "run"],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "NODE_NAME"},
    )
    assert r.returncode == 2 and "node-name" in r.stderr


def test_time_from_kmsg_append_to_condition_false(admin, agent_factory, simhost):
    a = agent_factory(extra=NO_POLL)
    a.wait_status(admin, "True", timeout=30)
    t0, polls = time.monotonic(), simhost.smi_call_count()
    simhost.append_xid(79, 7)
    a.wait_status(admin, "False", "FatalXid", timeout=10)
    took = time.monotonic() - t0
    print(f"\n[latency] kmsg append -> GPUReady=False in {took * 1000:.0f} ms (no poll due)")
    assert simhost.smi_call_count() == polls, "a fatal Xid must not wait for a poll"


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/dev/kmsg", os.W_OK), reason="needs root and a writable /dev/kmsg"
)
def test_real_dev_kmsg_record_turns_condition_false(admin, agent_factory, tmp_path):
    """Writes a real record to the real /dev/kmsg. The ring buffer lives as long as the machine, so
    records from earlier runs may already be there (and, correctly, keep the node False): the GPU
    here gets a random bus id, and the test waits for the fault on that GPU."""
    from testkit.simhost import SimHost, buses_free_in_kmsg

    host = SimHost(tmp_path / "realkmsg", buses=buses_free_in_kmsg(8))
    # Records written from user space get the user facility; GPU_READY_KMSG_TRUST_USER lets the test count them.
    a = agent_factory(
        host=host, kmsg="/dev/kmsg", extra={"--poll-interval": "30"}, env={"GPU_READY_KMSG_TRUST_USER": "true"}
    )
    wait_for(lambda: a.gpu_ready(admin), 30, what="first GPUReady condition")
    label = f"GPU 6 ({host.gpus[6].address.nvml}): Xid 79"
    assert label not in a.gpu_ready(admin)["message"]
    t0 = time.monotonic()
    with open("/dev/kmsg", "w") as fh:
        fh.write(f"<3>{host.xid_line(79, 6)}\n")
    wait_for(lambda: label in a.gpu_ready(admin)["message"], 10, what=label)
    assert a.metric("gpu_ready_gpu_healthy", {"gpu": "6"}) == 0
    c = a.gpu_ready(admin)
    assert (c["status"], c["reason"]) == ("False", "FatalXid")
    print(f"\n[latency] real /dev/kmsg write -> condition names the GPU in {(time.monotonic() - t0) * 1000:.0f} ms")


def test_apiserver_outage_fault_during_outage_is_reported_after(control_plane, tmp_path):
    """Own control plane: stop kube-apiserver mid-run, cause a fault while it is down, start it again."""
    from testkit.controlplane import ControlPlane
    from testkit.harness import launch_agent

    cp = ControlPlane(control_plane.bin_dir, workdir=str(tmp_path / "cp")).start()
    try:
        admin = cp.admin()
        a, simhost = launch_agent(cp, tmp_path / "agent", "outage-node")
        try:
            a.wait_status(admin, "True", timeout=30)
            cp.stop_apiserver()
            simhost.append_xid(79, 4)
            wait_for(lambda: a.metric("gpu_ready_latched_faults") == 1, 20, what="latched while the API is down")
            wait_for(lambda: (a.metric("gpu_ready_api_requests_total", {"code": "0"}) or 0) >= 1, 20, what="no answer")
            assert a.proc.poll() is None
            t0 = time.monotonic()
            cp.restart_apiserver()
            back = time.monotonic()
            c = a.wait_status(admin, "False", "FatalXid", timeout=30)
            converge = time.monotonic() - back
            print(f"\n[outage] apiserver restart took {back - t0:.1f}s; condition converged {converge:.2f}s later")
            assert converge < 0.5 * 2 + 2.0  # within about one poll (0.5 s) plus backoff jitter
            assert "GPU 4 (00000000:9B:00.0): Xid 79" in c["message"]
            logged = [json.loads(x) for x in a.logs().splitlines() if x.startswith("{")]
            unreachable = [(r["event"], r.get("request")) for r in logged if r.get("state") == "unreachable"]
            assert unreachable and len(unreachable) == len(set(unreachable)), (
                f"logged once per state change and request (get node, write status, Events): {unreachable}"
            )
        finally:
            a.terminate()
            admin.close()
    finally:
        cp.stop()


# -- Events against the real apiserver: never in the way of the condition -------------------------------


def test_events_start_transient_fault_recovery_aggregate_without_422_then_xid_within_a_second(
    admin, agent_factory, simhost
):
    """Start, a fault and its recovery within the event interval (an Xid, cleared by the clear-before
    annotation): the second GPUsHealthy is folded into the first Event's series by a PATCH the apiserver accepts
    (it used to PATCH `note`: 422, and the 422 backed off every later condition write). Then a fatal Xid reaches
    the Node with no poll run meanwhile (none is due: the write waited for no poll and no backoff)."""
    a = agent_factory(extra={"--event-interval": "15", **NO_POLL})
    a.wait_status(admin, "True")
    simhost.append_xid(79, 1)
    a.wait_status(admin, "False", "FatalXid")
    wait_for(lambda: a.metric("gpu_ready_latched_faults") == 1, 10, 0.05, "the fault latched")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    admin.patch_node(a.node, {"metadata": {"annotations": {CLEAR: now}}})
    a.wait_status(admin, "True")

    def healthy_series():
        evs = [e for e in events_for(admin, a.node) if e["reason"] == "GPUsHealthy"]
        return len(evs) == 1 and (evs[0].get("series") or {}).get("count") == 2 and evs[0]

    ev = wait_for(healthy_series, 40, 0.2, "GPUsHealthy Event with series.count 2")
    assert ev["note"].startswith("GPUReady unset -> True")  # the first occurrence's note is kept
    assert a.metric("gpu_ready_api_requests_total", {"code": "422"}) is None
    assert (a.metric("gpu_ready_events_total", {"reason": "GPUsHealthy"}) or 0) == 2  # create + series patch
    t0, polls = time.monotonic(), simhost.smi_call_count()
    simhost.append_xid(79, 6)
    a.wait_status(admin, "False", "FatalXid", timeout=10)
    took = time.monotonic() - t0
    print(f"\n[events] Xid 79 -> GPUReady=False in {took * 1000:.0f} ms after a series PATCH")
    assert simhost.smi_call_count() == polls  # no poll ran: the kernel log's wake wrote it


def refuse_events_for(admin, node: str) -> str:
    """A ValidatingAdmissionPolicy that refuses every Event about `node` with 422 (reason Invalid)."""
    name = f"refuse-events-{node}"[:63]
    base = "/apis/admissionregistration.k8s.io/v1"
    admin.request(
        "POST",
        f"{base}/validatingadmissionpolicies",
        {
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["events.k8s.io", ""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["events"],
                        }
                    ]
                },
                "validations": [
                    {
                        "expression": f"!has(object.regarding) || object.regarding.name != '{node}'",
                        "reason": "Invalid",
                        "message": "test: Events about this node are refused",
                    }
                ],
            },
        },
    )
    admin.request(
        "POST",
        f"{base}/validatingadmissionpolicybindings",
        {"metadata": {"name": name}, "spec": {"policyName": name, "validationActions": ["Deny"]}},
    )
    return name


def test_xid_reaches_the_node_within_a_second_while_every_event_gets_422(admin, agent_factory, make_node, simhost):
    from agent.kube.client import ApiError

    node = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity=simhost.plugin_resources())
    policy = refuse_events_for(admin, node)
    probe = {
        "metadata": {"generateName": "probe-"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "test",
        "reportingInstance": "test",
        "action": "Probe",
        "reason": "Probe",
        "type": "Normal",
        "regarding": {"kind": "Node", "name": node, "apiVersion": "v1"},
    }

    def refused() -> bool:
        try:
            admin.create_event("default", probe)
        except ApiError as e:
            return e.status == 422
        return False

    try:
        wait_for(refused, 30, 0.2, "the admission policy in force (422)")
        a = agent_factory(node=node, extra=NO_POLL)
        a.wait_status(admin, "True")
        wait_for(lambda: (a.metric("gpu_ready_api_requests_total", {"code": "422"}) or 0) >= 1, 20, what="a 422")
        took, polls = [], []
        for gpu in (3, 5, 7):
            t0, before = time.monotonic(), simhost.smi_call_count()
            simhost.append_xid(79, gpu)
            label = f"GPU {gpu} ({simhost.gpus[gpu].address.nvml}): Xid 79"
            wait_for(lambda label=label: label in a.gpu_ready(admin)["message"], 10, 0.02, label)
            took.append(time.monotonic() - t0)
            polls.append(simhost.smi_call_count() - before)
        print(f"\n[events] Xid -> condition with every Event refused (422): {[round(t * 1000) for t in took]} ms")
        # no poll ran before any of them reached the condition: the kernel log's wake wrote each
        assert polls == [0, 0, 0], (polls, took)
        assert (a.metric("gpu_ready_events_dropped_total", {"code": "422"}) or 0) >= 1
        assert "Event refused by the API; dropped" in a.logs()
        assert [e for e in events_for(admin, node) if e["reportingController"] == "gpu-ready"] == []
    finally:
        base = "/apis/admissionregistration.k8s.io/v1"
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
            try:
                admin.request("DELETE", f"{base}/{kind}/{policy}")
            except ApiError:
                pass


def test_events_go_to_the_configured_namespace(admin, agent_factory):
    # The apiserver accepts Events about a cluster-scoped Node only in default or kube-system.
    a = agent_factory(extra={"--event-namespace": "kube-system"})
    a.wait_status(admin, "True")
    evs = wait_for(lambda: events_for(admin, a.node, "kube-system"), 20, what="an Event in kube-system")
    assert evs[0]["reason"] == "GPUsHealthy" and evs[0]["reportingController"] == "gpu-ready"
    assert events_for(admin, a.node) == []
