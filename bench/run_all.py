"""`make bench`: every benchmark in one run and one summary table. The 10-minute footprint run goes on in
the background while the others run (its CPU figure is the agent process's own CPU time, which other
processes do not add to); total wall time is about 11 minutes on 2 cores."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench import footprint, latency, npd_compare, storm, write_rate
from bench.common import OUT, machine, table
from testkit.controlplane import ControlPlane


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--footprint-seconds", type=float, default=600)
    ap.add_argument("--latency-reps", type=int, default=100)
    ap.add_argument("--npd-reps", type=int, default=10)
    a = ap.parse_args()
    t0 = time.monotonic()
    with ControlPlane() as cp:
        fp_agent, fp_sampler = footprint.start(cp)
        print("[bench] latency ...", flush=True)
        lat = latency.run(cp, a.latency_reps, poll=0.5)
        print("[bench] storm ...", flush=True)
        st = storm.run(cp)
        print("[bench] API write rate ...", flush=True)
        wr = write_rate.run(cp)
        print("[bench] node-problem-detector side by side ...", flush=True)
        npd = npd_compare.run(cp, a.npd_reps)
        print("[bench] waiting for the footprint run to reach its duration ...", flush=True)
        fp = footprint.finish(fp_agent, fp_sampler, a.footprint_seconds)
    print()
    print(f"Machine: {machine()}; total {time.monotonic() - t0:.0f} s")
    print(summary({"latency": lat, "storm": st, "write_rate": wr, "npd_compare": npd, "footprint": fp}))
    print("\nDetails:", json.dumps({"write_rate": wr, "npd": npd}, indent=1))
    print(f"JSON results in {OUT}/")


def summary(r: dict[str, Any]) -> str:
    lat, st, wr, npd, fp = r["latency"], r["storm"], r["write_rate"], r["npd_compare"], r["footprint"]
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    s_in, s_ag = st["in_process"], st["agent"]
    rows = [
        (
            "detection latency (kmsg append -> watch sees False)",
            f"p50 {lat['p50_ms']} / p90 {lat['p90_ms']} / p99 {lat['p99_ms']} / max {lat['max_ms']} ms (n={lat['n']})",
            "p99 < 250 ms",
            ok(lat["p99_ms"] < 250),
        ),
        (
            f"footprint RSS ({fp['seconds']} s, default intervals, 8 GPUs)",
            f"peak {fp['rss_peak_mib']} MiB, steady {fp['rss_steady_mib']} MiB",
            "<= 80 MiB",
            ok(fp["rss_peak_mib"] <= 80),
        ),
        (
            "footprint CPU",
            f"{fp['cpu_avg_millicores']} mc average ({fp['cpu_steady_millicores']} mc after the first minute)",
            "<= 5 millicores",
            ok(fp["cpu_avg_millicores"] <= 5),
        ),
        (
            "Xid storm parse rate (800k records)",
            f"{s_in['records_per_s']:,} rec/s in process; {s_ag['records_per_s']:,} rec/s in the running agent",
            ">= 100,000 rec/s",
            ok(min(s_in["records_per_s"], s_ag["records_per_s"]) >= 100_000),
        ),
        (
            "Xid storm RSS growth",
            f"{s_in['rss_growth_mib']} MiB in process; {s_ag['rss_growth_mib']} MiB in the agent "
            f"(peak {s_ag['rss_peak_mib']} MiB)",
            "<= 10 MiB",
            ok(max(s_in["rss_growth_mib"], s_ag["rss_growth_mib"]) <= 10),
        ),
        (
            "Xid storm API writes",
            f"{s_ag['condition_writes']} condition, {s_ag['event_writes']} Event writes",
            f"Events <= {s_ag['event_write_bound']} (1 per GPU + transitions)",
            ok(s_ag["event_writes"] <= s_ag["event_write_bound"]),
        ),
        (
            "API writes, steady state",
            f"{wr['steady']['default_writes_per_hour']} condition writes/node/h + 120 Node GETs/h",
            "-",
            "-",
        ),
        (
            "API writes, GPU flapping every poll",
            f"{wr['flapping']['default_writes_per_hour']} condition writes/node/h",
            "-",
            "-",
        ),
    ]
    if "skipped" in npd:
        rows.append(("node-problem-detector side by side", npd["skipped"], "-", "-"))
    else:
        rows += [
            (
                "vs node-problem-detector: detection",
                f"gpu-ready p50 {npd['gpu_ready']['p50_ms']} ms, NPD p50 "
                f"{npd['npd']['p50_ms']} ms ({npd['latency_ratio_p50_npd_over_gpu_ready']}x)",
                "-",
                "-",
            ),
            (
                "vs node-problem-detector: RSS",
                f"gpu-ready {npd['gpu_ready_rss_mib']['median']} MiB, NPD "
                f"{npd['npd_rss_mib']['median']} MiB ({npd['rss_ratio_gpu_ready_over_npd']}x)",
                "-",
                "-",
            ),
        ]
    return table(rows)


if __name__ == "__main__":
    main()
