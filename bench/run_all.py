"""`make bench`: every benchmark in one run and one summary table. The 10-minute footprint run goes on in
the background while the others run (its CPU figure is the agent process's own CPU time, which other
processes do not add to); the fleet benchmark (bench/fleet.py) runs on a control plane of its own, so
the footprint agent's requests do not blur its per-node counts. Total wall time is about 11 minutes on
2 cores when the others finish within the footprint's 10 minutes."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from typing import Any

from bench import controller, fleet, footprint, latency, multinode, npd_compare, parsing, recovery, storm, write_rate
from bench.common import OUT, machine, table
from testkit.controlplane import ControlPlane


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--footprint-seconds", type=float, default=600)
    ap.add_argument("--latency-reps", type=int, default=100)
    ap.add_argument("--npd-reps", type=int, default=10)
    ap.add_argument("--recovery-reps", type=int, default=10)
    ap.add_argument("--npd-steady-seconds", type=float, default=600, help="both agents idle side by side")
    ap.add_argument("--fleet-nodes", type=int, default=200)
    ap.add_argument("--controller-nodes", type=int, default=1000)
    ap.add_argument("--controller-seconds", type=float, default=120)
    ap.add_argument(
        "--storm-against",
        default=storm.REFERENCE,
        metavar="REV",
        help="git revision whose Xid storm runs side by side with this tree's ('' skips it)",
    )
    a = ap.parse_args()
    t0 = time.monotonic()
    with ControlPlane() as cp:
        fp_agent, fp_sampler = footprint.start(cp)
        print("[bench] latency ...", flush=True)
        lat = latency.run(cp, a.latency_reps, poll=0.5)
        print("[bench] per-GPU recovery: fault -> back in service ...", flush=True)
        rec = recovery.run(cp, a.recovery_reps)
        print("[bench] parsing hostile input ...", flush=True)
        parse = parsing.run()
        print("[bench] multi-node probes per poll ...", flush=True)
        mn = multinode.run()
        print("[bench] storm ...", flush=True)
        st = storm.run(cp)
        sbs = storm_side_by_side(a.storm_against)
        print("[bench] API write rate ...", flush=True)
        wr = write_rate.run(cp)
        print("[bench] node-problem-detector side by side ...", flush=True)
        npd = npd_compare.run(cp, a.npd_reps, a.npd_steady_seconds)
        print("[bench] fleet: API cost per node beside kubelet's (its own control plane) ...", flush=True)
        with ControlPlane() as fleet_cp:  # alone on its apiserver: the footprint agent would blur its counts
            fl = fleet.run(fleet_cp, nodes=a.fleet_nodes)
        print(f"[bench] gpu-ready controller watching {a.controller_nodes} GPU Nodes (its own control plane) ...")
        with ControlPlane() as ctl_cp:  # alone on its apiserver, as the fleet run
            ctl = controller.run(ctl_cp, nodes=a.controller_nodes, seconds=a.controller_seconds, flips=5)
        print("[bench] waiting for the footprint run to reach its duration ...", flush=True)
        fp = footprint.finish(fp_agent, fp_sampler, a.footprint_seconds)
    print()
    print(f"Machine: {machine()}; total {time.monotonic() - t0:.0f} s")
    print(
        summary(
            {"latency": lat, "storm": st, "write_rate": wr, "npd_compare": npd, "footprint": fp, "fleet": fl}
            | {"parsing": parse, "multinode": mn, "recovery": rec, "controller": ctl, "storm_against": sbs}
        )
    )
    print(ratios(npd))
    print("\nFleet:\n" + fleet.report(fl))
    print("\nDetails:", json.dumps({"write_rate": wr, "npd": npd}, indent=1))
    print(f"JSON results in {OUT}/")


def storm_side_by_side(rev: str) -> dict[str, Any] | None:
    """bench.storm --against REV (each tree on a control plane of its own); a revision this clone lacks or a failed
    run is named in the table instead of ending the benchmark run."""
    if not rev:
        return None
    print(f"[bench] storm side by side with {rev} (each on its own control plane) ...", flush=True)
    try:
        return storm.against(rev)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return {"reference": rev, "error": str(e)[-300:]}


def storm_against_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The storm of this tree beside a reference revision's, from the same run (bench.storm --against)."""
    s = r.get("storm_against")
    if s is None:
        return []
    what = f"Xid storm side by side with {s['reference']}, this tree vs it"
    if "error" in s:
        return [(what, f"not run: {s['error']}", "-", "MISSED")]
    cur, ref = s["best"]["current"], s["best"][s["reference"]]
    return [
        (
            f"{what} ({s['records']:,} records, best of {s['rounds']} each, alternated)",
            storm.against_report(s),
            f">= {s['reference']}'s; >= 100,000 rec/s in process",
            "ok" if cur["in_process"] >= max(ref["in_process"], 100_000) and cur["agent"] >= ref["agent"] else "MISSED",
        )
    ]


PARSE_ROWS = (
    "xid_hostile_worst_ms",
    "split_lines_4mb_ms",
    "smi_sea_of_spaces_4m_ms",
    "smi_16000_err_rows_ms",
    "kmsg_record_100kb_ms",
    "dcgm_hostile_metrics_ms",
)


def multinode_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The multi-node probes' cost per poll (bench/multinode.py), when it was run."""
    m = r.get("multinode")
    if m is None:
        return []
    return [
        (
            "multi-node probes per poll: 8 InfiniBand rails (64 sysfs reads) + the NVSwitch scan + the fabric of "
            "8 GPUs from NVML",
            f"{m['multinode_per_poll_ms']} ms (rails {m['infiniband_8_rails_ms']}, NVSwitch scan "
            f"{m['fabric_manager_scan_ms']}, fabric {m['fabric_from_nvml_8_gpus_ms']})",
            "< 1 ms",
            "ok" if m["multinode_per_poll_ms"] < 1 else "MISSED",
        )
    ]


def controller_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The controller's API cost and footprint watching simulated GPU Nodes (bench/controller.py), when it was run."""
    c = r.get("controller")
    if c is None:
        return []
    watch = c["agent_brake_watch_requests"]
    return [
        (
            f"gpu-ready controller watching {c['nodes']} GPU Nodes: API requests/h at rest / with brake flips; "
            "RSS; CPU at rest / with flips",
            f"{c['controller_requests_per_hour_at_rest']} / "
            f"{c['controller_requests_per_hour_with_brake_flips']} req/h; "
            f"{c['controller_rss_mib_max']} MiB; {c['controller_cpu_millicores_at_rest']} / "
            f"{c['controller_cpu_millicores']} mc",
            "< 3,600 req/h at rest (its Lease's renewals and two watches; nothing per Node)",
            "ok" if c["controller_requests_per_hour_at_rest"] < 3600 else "MISSED",
        ),
        (
            "each agent's fleet-brake watch (one ConfigMap): requests by verb",
            ", ".join(f"{k} {v}" for k, v in sorted(watch.items())) + f"; {c['agent_brake_watch_events']} events",
            "one WATCH, no GET per poll",
            "ok" if not watch.get("GET") else "MISSED",
        ),
    ]


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
        *storm_against_rows(r),
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
            "parsing hostile input: worst Xid record; 4 MB watch event in 100-byte pieces; nvidia-smi row of 4M "
            "spaces; 16,000 ERR! rows; 100 KB kmsg record; dcgm-exporter text of 6 MB with hostile lines",
            "; ".join(f"{r['parsing'][k]} ms" for k in PARSE_ROWS),
            "< 1000 ms each (before lines were cut: 6-20 s)",
            ok(max(r["parsing"][k] for k in PARSE_ROWS) < 1000),
        ),
        *multinode_rows(r),
        *controller_rows(r),
        *(
            [
                (
                    "per-GPU recovery: Xid 119 -> GPU back in service (simulated host, instant reset, poll 0.5 s)",
                    f"p50 {r['recovery']['p50_ms']} / p90 {r['recovery']['p90_ms']} / max {r['recovery']['max_ms']} ms"
                    f" (n={r['recovery']['n']}); other GPUs' pods disturbed: {r['recovery']['other_pods_disturbed']}"
                    f"; resets succeeded {r['recovery']['outcomes']['succeeded']} / refused"
                    f" {r['recovery']['outcomes']['refused']} / unsupported {r['recovery']['outcomes']['unsupported']}",
                    "< 60 s + the reset; 0 disturbed",
                    ok(r["recovery"]["max_ms"] < 60_000 and r["recovery"]["other_pods_disturbed"] == 0),
                )
            ]
            if "recovery" in r
            else []
        ),
        (
            "API writes, steady state",
            f"{wr['steady']['default_writes_per_hour']} condition writes/node/h + "
            f"{wr['steady']['default_node_gets_per_hour']} Node GETs/h",
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
                "vs node-problem-detector: RSS during the detection runs",
                f"gpu-ready {npd['gpu_ready_rss_mib']['median']} MiB, NPD "
                f"{npd['npd_rss_mib']['median']} MiB ({npd['rss_ratio_gpu_ready_over_npd']}x)",
                "-",
                "-",
            ),
        ]
        rows += steady_rows(npd)
    if r.get("fleet"):
        rows += fleet_rows(r["fleet"])
    return table(rows)


def steady_rows(npd: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Both agents idle side by side (bench/npd_compare.py steady phase): RSS and CPU against NPD's."""
    st = npd.get("steady")
    if not st:
        return []
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    g, n = st["gpu_ready"], st["npd"]
    return [
        (
            f"vs node-problem-detector: steady RSS ({st['window_s']:.0f} s side by side)",
            f"gpu-ready {g['rss_median_mib']} MiB, NPD {n['rss_median_mib']} MiB "
            f"({st['rss_ratio_gpu_ready_over_npd']}x)",
            "<= 1.3x NPD",
            ok(st["rss_ratio_gpu_ready_over_npd"] <= 1.3),
        ),
        (
            "vs node-problem-detector: steady CPU, agent process",
            f"gpu-ready {g['cpu_millicores']} mc, NPD {n['cpu_millicores']} mc ({st['cpu_ratio_gpu_ready_over_npd']}x)",
            "below NPD, <= 0.3 mc",
            ok(g["cpu_millicores"] < n["cpu_millicores"] and g["cpu_millicores"] <= 0.3),
        ),
        (
            "vs node-problem-detector: steady CPU with what it spawns per poll (nvidia-smi itself not counted)",
            f"gpu-ready {g['cpu_with_spawned_millicores']} mc ({g['spawned_cpu_ms_per_poll']} ms per poll), "
            f"NPD {n['cpu_millicores']} mc ({st['cpu_ratio_with_spawned']}x)",
            "below NPD, <= 0.3 mc",
            ok(g["cpu_with_spawned_millicores"] < n["cpu_millicores"] and g["cpu_with_spawned_millicores"] <= 0.3),
        ),
    ]


def ratios(npd: dict[str, Any]) -> str:
    """One line: gpu-ready over NPD, side by side in the same run."""
    st = npd.get("steady")
    if not st:
        return "Ratios vs node-problem-detector: " + str(npd.get("skipped", "no steady side-by-side phase"))
    return (
        f"Ratios vs node-problem-detector (same run, {st['window_s']:.0f} s side by side): "
        f"RSS {st['rss_ratio_gpu_ready_over_npd']}x, CPU {st['cpu_ratio_gpu_ready_over_npd']}x process alone "
        f"({st['cpu_ratio_with_spawned']}x with what it spawns per poll), detection p50 NPD/gpu-ready "
        f"{npd['latency_ratio_p50_npd_over_gpu_ready']}x"
    )


def fleet_rows(f: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    c, kub, aft, bef = f["comparison"], f["kubelet"], f["after"], f["before"]
    n = f["setup"]["nodes"]
    return [
        (
            f"fleet ({n} nodes): API requests per node-hour vs kubelet",
            f"{aft['requests_total_per_node_hour']:.1f} vs {kub['requests_total_per_node_hour']:.1f} "
            f"({c['requests_ratio'] * 100:.1f} %; before: {bef['requests_total_per_node_hour']:.0f})",
            "< 5 %",
            ok(c["requests_ratio"] < 0.05),
        ),
        (
            "fleet: bytes per node-hour vs kubelet",
            f"{c['bytes_with_cross_watch'] / 1024:.0f} KiB vs {kub['bytes_per_node_hour']['total'] / 1024:.0f} KiB "
            f"({c['bytes_ratio'] * 100:.0f} %; before: {bef['bytes_per_node_hour']['total'] / 1024:.0f} KiB)",
            "< 5 %",
            ok(c["bytes_ratio"] < 0.05),
        ),
        (
            "fleet: etcd reads per node-hour, steady state",
            f"{aft['etcd_reads_per_node_hour']:.1f} (before: {bef['etcd_reads_per_node_hour']:.0f})",
            "0",
            ok(aft["etcd_reads_per_node_hour"] == 0),
        ),
        (
            "fleet: storm peak writes/s at 10,000 nodes",
            f"{c['storm_10k']['peak_writes_per_s']:.0f} ({c['storm_10k']['total_writes']} writes in all)",
            "< 100",
            ok(c["storm_10k"]["peak_writes_per_s"] < 100),
        ),
    ]


if __name__ == "__main__":
    main()
