"""API write rate per node: (a) steady state, measured with a shortened heartbeat and scaled to the
default; (b) a GPU whose nvidia-smi output flips between ERR! and clean on every poll."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import save
from testkit.controlplane import ControlPlane
from testkit.harness import AgentProc, launch_agent, wait_for
from testkit.simhost import SimHost


def _agent(cp: ControlPlane, extra: dict[str, str]) -> tuple[AgentProc, SimHost]:
    a, host = launch_agent(cp, Path(tempfile.mkdtemp(prefix="bench-writes-")), "bench-writes", extra)
    wait_for(lambda: a.metric("gpu_ready_condition_writes_total") == 1, 60, 0.1, "first report")
    return a, host


def counts(a: AgentProc) -> tuple[float, float, float]:
    return (
        a.metric("gpu_ready_condition_writes_total") or 0,
        a.metric("gpu_ready_events_total") or 0,
        a.metric("gpu_ready_api_requests_total", {"verb": "GET"}) or 0,
    )


def run(cp: ControlPlane, seconds: float = 65) -> dict[str, Any]:
    # (a) steady state: poll 1 s, heartbeat 10 s, for `seconds`
    poll, hb = 1.0, 10.0
    a, _ = _agent(cp, {"--poll-interval": str(poll), "--heartbeat-interval": str(hb)})
    w0, e0, g0 = counts(a)
    time.sleep(seconds)
    w1, e1, g1 = counts(a)
    a.terminate()
    writes, events, gets = w1 - w0, e1 - e0, g1 - g0
    per_hb = writes / (seconds // hb)  # whole heartbeats in the window
    steady = {
        "measured": f"{writes:.0f} condition writes, {events:.0f} Events, {gets:.0f} Node GETs in "
        f"{seconds:.0f} s (poll {poll:g} s, heartbeat {hb:g} s)",
        "writes_per_heartbeat": round(per_hb, 2),
        "default_writes_per_hour": round(per_hb * 3600 / 300, 1),
        "default_node_gets_per_hour": round(gets / seconds * poll * 3600 / 30),
        "arithmetic": f"{writes:.0f} writes / {seconds // hb:.0f} heartbeats in {seconds:.0f} s = "
        f"{per_hb:.2f} per heartbeat; "
        f"x 3600/300 heartbeats per hour = {per_hb * 12:.1f}; Node GETs: {gets:.0f} in {seconds / poll:.0f} polls "
        f"(the Node is read from one watch)",
    }
    # (b) a GPU flapping on every poll (recovery-polls 2, the default)
    b, host = _agent(cp, {"--poll-interval": str(poll), "--heartbeat-interval": "300", "--recovery-polls": "2"})
    w0, e0, _ = counts(b)
    calls0 = host.smi_call_count()
    end = time.monotonic() + seconds
    bad = False
    while time.monotonic() < end:
        if host.smi_call_count() != calls0:  # flip after every nvidia-smi run
            calls0 = host.smi_call_count()
            bad = not bad
            host.set_smi(err={3: ("Fan",)} if bad else None)
        time.sleep(0.02)
    w1, e1, _ = counts(b)
    flips = host.smi_call_count()
    b.terminate()
    fw, fe = w1 - w0, e1 - e0
    polls = seconds / poll
    flapping = {
        "measured": f"{fw:.0f} condition writes, {fe:.0f} Events over {polls:.0f} polls, the GPU flipping "
        f"ERR!/clean on every poll ({flips} nvidia-smi runs)",
        "writes_per_poll": round(fw / polls, 3),
        "default_writes_per_hour": round(fw / polls * 120 + 12, 1),
        "events_per_hour_bound": "1 per reason and GPU per 5 min = at most 12 per reason per hour",
        "arithmetic": f"{fw:.0f} writes / {polls:.0f} polls x 120 polls per hour (30 s poll) "
        f"+ 12 heartbeats = {fw / polls * 120 + 12:.1f}",
    }
    res = {"steady": steady, "flapping": flapping}
    save("write_rate", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=65)
    a = ap.parse_args()
    with ControlPlane() as cp:
        print(run(cp, a.seconds))


if __name__ == "__main__":
    main()
