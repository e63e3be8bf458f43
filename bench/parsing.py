"""Parsing time on hostile input: the worst kernel-log records (testkit.hostile) through the Xid parser, and a
4 MB watch event in 100-byte pieces through the watch stream's line splitter. The tests check what makes these
linear (how many characters reach the patterns, how many bytes are scanned); the time is measured here, where a
loaded machine only makes a figure worse, never a test fail."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from agent.kernel_log.xid import KernelLogParser
from agent.kube.client import split_lines
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
    return {"xid_hostile_ms": xid, "xid_hostile_worst_ms": max(xid.values()), "split_lines_4mb_ms": split}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
