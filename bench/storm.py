"""Xid storm: 800,000 kmsg records, mostly repeated Xid 95 and Xid 13 lines across 8 GPUs.
Measures (1) the parse path in-process (read, parse, classify, count, latch): records per second and
RSS growth; (2) the running agent: time to read them all, its RSS growth, condition and Event writes.

`--against REV` runs the storm of this tree and of the git revision REV (a temporary `git worktree`) side by side
on this machine: each in a process and on a control plane of its own (each tree's own bench.storm and agent),
alternated REV, this tree, REV, this tree ... (`--rounds` pairs); the best run of each is compared, since other
work on the machine can only slow a run down."""

from __future__ import annotations

import argparse
import ast
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from agent.kernel_log.source import KmsgSource, format_record
from agent.kernel_log.watcher import KMSG_BATCH, KernelLogIngest
from agent.kernel_log.xid import KernelLogParser
from agent.model import PciAddress
from agent.report.metrics import Metrics
from agent.state import LatchState
from bench.common import ProcSampler, save
from testkit.controlplane import ControlPlane
from testkit.harness import launch_agent, wait_for

BUSES = (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)
TEXT95 = "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"
TEXT13 = "pid=1797828, name=pt_main_thread, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction"


def storm_records(n: int, start_seq: int = 1) -> str:
    out = []
    for i in range(n):
        a = PciAddress(0, BUSES[(i // 3) % 8], 0)
        if i % 50 == 49:
            text = "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping"
        elif i % 3:
            text = f"NVRM: Xid (PCI:{a.kernel}): 95, pid='<unknown>', name=<unknown>, {TEXT95}"
        else:
            text = f"NVRM: Xid (PCI:{a.kernel}): 13, {TEXT13}"
        out.append(format_record(text, start_seq + i, 1_000_000 + i))
    return "".join(out)


def in_process(n: int, work: Path) -> dict[str, Any]:
    f = work / "kmsg"
    f.write_text(storm_records(n))
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    src, metrics = KmsgSource(str(f)), Metrics()
    state = LatchState(str(work / "state"), "bench")
    ingest = KernelLogIngest(KernelLogParser(), state, metrics)  # the agent's own hot path
    t0 = time.perf_counter()
    total = 0
    for recs in src.drain(KMSG_BATCH):
        ingest.process(recs)
        total += len(recs)
    took = time.perf_counter() - t0
    rss1 = proc.memory_info().rss
    return {
        "records": total,
        "seconds": round(took, 2),
        "records_per_s": int(total / took),
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "latched": len(state.faults),
    }


def in_agent(cp: ControlPlane, n: int, work: Path) -> dict[str, Any]:
    agent, host = launch_agent(cp, work, "bench-storm", {"--poll-interval": "30"})
    try:
        wait_for(lambda: agent.metric("gpu_ready_condition_writes_total") == 1, 60, 0.2, "first report")
        sampler = ProcSampler(agent.proc.pid, 0.2).start()  # type: ignore[union-attr]
        time.sleep(1)
        rss0 = sampler.sample()[1]
        writes0 = agent.metric("gpu_ready_condition_writes_total") or 0
        events0 = agent.metric("gpu_ready_events_total") or 0
        api0 = agent.metric("gpu_ready_api_requests_total") or 0
        data = storm_records(n)
        t0 = time.monotonic()
        with open(host.kmsg, "a") as fh:
            fh.write(data)
        wait_for(lambda: (agent.metric("gpu_ready_kmsg_records_total") or 0) >= n, 300, 0.1, "storm read")
        took = time.monotonic() - t0
        time.sleep(2)
        sampler.stop()
        peak = max(s[1] for s in sampler.samples)
        rss1 = sampler.sample()[1]
        res = {
            "records": n,
            "seconds_to_read_all": round(took, 2),
            "records_per_s": int(n / took),
            "rss_before_mib": round(rss0 / 2**20, 1),
            "rss_peak_mib": round(peak / 2**20, 1),
            "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
            "condition_writes": int((agent.metric("gpu_ready_condition_writes_total") or 0) - writes0),
            "event_writes": int((agent.metric("gpu_ready_events_total") or 0) - events0),
            "api_requests": int((agent.metric("gpu_ready_api_requests_total") or 0) - api0),
            "event_write_bound": 8 + 2,
        }
        return res
    finally:
        agent.terminate()


def run(cp: ControlPlane, n: int = 800_000) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-storm-"))
    res = {"in_process": in_process(n, work), "agent": in_agent(cp, n, work)}
    save("storm", res)
    return res


REFERENCE = "a275dd0"  # the release before the kernel-log path grew (link changes, the reset proof, the Xid rate)
ROOT = Path(__file__).resolve().parent.parent


def _storm_of(tree: Path, n: int) -> dict[str, Any]:
    """One `python -m bench.storm` of the tree at `tree` (its own code, control plane and agent): its result."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tree's own modules, from its root
    p = subprocess.run(
        [sys.executable, "-m", "bench.storm", "--records", str(n)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"bench.storm in {tree} failed ({p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    result: dict[str, Any] = ast.literal_eval(lines[-1])  # the dict main() prints last
    return result


def against(rev: str, n: int = 800_000, rounds: int = 2) -> dict[str, Any]:
    """The storm of this tree and of `rev` side by side (see the module's doc): the best in-process and in-agent
    rates of each, and every run. Raises RuntimeError when `rev` cannot be checked out or its storm fails."""
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--verify", "--short", f"{rev}^{{commit}}"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"no revision {rev!r} in {ROOT} (a shallow clone?)") from e
    tmp = Path(tempfile.mkdtemp(prefix="bench-storm-against-"))
    ref = tmp / commit
    subprocess.run([*git, "worktree", "add", "--quiet", "--detach", str(ref), commit], check=True)
    runs: dict[str, list[dict[str, Any]]] = {commit: [], "current": []}
    try:
        for _ in range(rounds):
            for name, tree in ((commit, ref), ("current", ROOT)):
                print(f"[storm] {name} ...", flush=True)
                runs[name].append(_storm_of(tree, n))
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(ref)], capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    best = {
        name: {k: max(r[k]["records_per_s"] for r in rs) for k in ("in_process", "agent")} for name, rs in runs.items()
    }
    res = {"reference": commit, "records": n, "rounds": rounds, "best": best, "runs": runs}
    save("storm_against", res)
    return res


def against_report(r: dict[str, Any]) -> str:
    """The side-by-side figures in one line: best rates of this tree and of the reference, and the ratio."""
    cur, ref = r["best"]["current"], r["best"][r["reference"]]
    return "; ".join(
        f"{where}: {cur[k]:,} vs {ref[k]:,} rec/s ({cur[k] / ref[k]:.2f}x)"
        for k, where in (("in_process", "in process"), ("agent", "in the running agent"))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=800_000)
    ap.add_argument("--against", metavar="REV", help=f"also run REV's storm side by side (e.g. {REFERENCE})")
    ap.add_argument("--rounds", type=int, default=2, help="with --against: runs of each, alternated")
    a = ap.parse_args()
    if a.against:
        try:
            r = against(a.against, a.records, a.rounds)
        except RuntimeError as e:
            print(f"bench.storm: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"storm, this tree vs {r['reference']} (best of {a.rounds} each, alternated): {against_report(r)}")
        print(r["best"])
        return
    with ControlPlane() as cp:
        r = run(cp, a.records)
    print(r)


if __name__ == "__main__":
    main()
