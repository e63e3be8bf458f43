"""Parsing time on hostile input: the worst kernel-log records (testkit.hostile) through the Xid parser, and a
4 MB watch event in 100-byte pieces through the watch stream's line splitter. The tests check what makes these
linear (how many characters reach the patterns, how many bytes are scanned); the time is measured here, where a
loaded machine only makes a figure worse, never a test fail."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from agent.kernel_log.source import format_record, parse_record
from agent.kernel_log.xid import KernelLogParser
from agent.kube.client import split_lines
from agent.probes.dcgm import parse_metrics
from agent.probes.nvidia_smi import parse_smi_table
from testkit.hostile import HOSTILE_XID, LONG_LINE_CHUNKS


def best_ms(fn: Callable[[], object], runs: int = 5) -> float:
    """The best of `runs` (ms): load on the host only adds."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(min(times) * 1000, 2)


def run() -> dict[str, object]:
    xid = {name: best_ms(lambda text=text: KernelLogParser().feed(text)) for name, text in HOSTILE_XID.items()}
    split = best_ms(lambda: list(split_lines(LONG_LINE_CHUNKS, 8 * 1024 * 1024)))
    sea = "|   0 " + " " * 4_000_000 + "x|\n"  # took 6 s at 16k spaces before lines were cut
    row = "|   0  NVIDIA H100 " + "  ERR! " * 20 + "| 00000000:19:00.0 Off |  0 |\n"
    record = format_record("NVRM: Xid (PCI:0000:3b:00): 79, " + "A" * 100_000, 7)
    evil = "DCGM_FI_DEV_ROW_REMAP_FAILURE{" + 'a="' + "\\" * 4000 + "\n"  # unterminated, escapes only
    huge = "DCGM_FI_DEV_ROW_REMAP_FAILURE{" + 'a="' + "x" * 200_000 + '"} 1\n'
    metrics = evil * 1000 + huge * 10 + 'DCGM_FI_DEV_ROW_REMAP_FAILURE{pci_bus_id="00000000:31:00.0"} 1\n' * 50_000
    return {
        "xid_hostile_ms": xid,
        "xid_hostile_worst_ms": max(xid.values()),
        "split_lines_4mb_ms": split,
        "smi_sea_of_spaces_4m_ms": best_ms(lambda: parse_smi_table(sea)),
        "smi_16000_err_rows_ms": best_ms(lambda: parse_smi_table(row * 16_000)),
        "kmsg_record_100kb_ms": best_ms(lambda: parse_record(record)),
        "dcgm_hostile_metrics_ms": best_ms(lambda: parse_metrics(metrics), runs=3),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
