"""Detection latency: append a fatal Xid record to the simulated host's kmsg file and time until a watch
on the Node sees GPUReady=False. The latch is cleared between repetitions with the clear annotation."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import NodeWatch, condition, save, summary_ms
from testkit.controlplane import ControlPlane
from testkit.harness import launch_agent, wait_for


def run(cp: ControlPlane, reps: int = 100, poll: float = 1.0) -> dict[str, Any]:
    agent, host = launch_agent(
        cp,
        Path(tempfile.mkdtemp(prefix="bench-latency-")),
        "bench-latency",
        {"--poll-interval": str(poll), "--recovery-polls": "1"},
    )
    node = agent.node
    admin = cp.admin()
    state: dict[str, Any] = {"status": None, "at": 0.0}
    changed = threading.Condition()

    def on_event(obj: dict[str, Any], t: float) -> None:
        c = condition(obj, "GPUReady")
        with changed:
            state["status"] = c["status"] if c else None
            state["at"] = t
            changed.notify_all()

    def wait_status(want: str, timeout: float = 30.0) -> float:
        with changed:
            ok = changed.wait_for(lambda: state["status"] == want, timeout)
            if not ok:
                raise TimeoutError(f"GPUReady never became {want}:\n{agent.logs()[-2000:]}")
            return float(state["at"])

    watch = NodeWatch(cp, node, on_event).start()
    latencies = []
    try:
        wait_status("True", 60)
        for i in range(reps):
            t0 = time.monotonic()
            host.append_xid(79, i % 8)
            t1 = wait_status("False")
            latencies.append(t1 - t0)
            before = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
            time.sleep(1.05)  # the clear applies to faults first seen before `before` (1 s resolution)
            admin.patch_node(node, {"metadata": {"annotations": {"gpu-ready.io/clear-before": before}}})
            wait_status("True")
            wait_for(lambda: agent.metric("gpu_ready_latched_faults") == 0, 10)
    finally:
        watch.stop()
        agent.terminate()
        admin.close()
    res = {"repetitions": reps, "poll_interval_s": poll, **summary_ms(latencies)}
    save("latency", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args()
    with ControlPlane() as cp:
        r = run(cp, a.reps)
    print(
        f"detection latency over {r['n']} repetitions: p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, "
        f"p99 {r['p99_ms']} ms, max {r['max_ms']} ms (target p99 < 250 ms)"
    )


if __name__ == "__main__":
    main()
