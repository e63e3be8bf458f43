"""What the parsers hand to their patterns, counted while they parse: how tests show a parser is linear without
timing it (a line cut to its bound before any pattern sees it, the same work per line however many lines). The
times are bench/parsing.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import agent.probes.nvidia_smi as smi
from agent.kernel_log import link
from agent.kernel_log.xid import KernelLogParser


@contextmanager
def smi_row_lines() -> Iterator[list[int]]:
    """The length of every line nvidia-smi's table parser hands to its row patterns."""
    seen: list[int] = []

    def counted(fn: Callable[[str], Any]) -> Callable[[str], Any]:
        def row(line: str) -> Any:
            seen.append(len(line))
            return fn(line)

        return row

    with ExitStack() as stack:
        for name in ("_gpu_row", "_mig_row", "_cells"):
            stack.enter_context(mock.patch.object(smi, name, counted(getattr(smi, name))))
        yield seen


@contextmanager
def xid_pattern_lines() -> Iterator[list[int]]:
    """The length of every line the kernel-log parser hands to its Xid, SXid and fallen-off-the-bus patterns."""
    seen: list[int] = []
    feed_line = KernelLogParser._feed_line

    def counted(self: KernelLogParser, line: str, *rest: object) -> object:
        seen.append(len(line))
        return feed_line(self, line, *rest)  # type: ignore[arg-type]

    with mock.patch.object(KernelLogParser, "_feed_line", counted):
        yield seen


@contextmanager
def link_pattern_lines() -> Iterator[list[int]]:
    """The length of every line the kernel-log link-change patterns (agent/kernel_log/link.py) see."""
    seen: list[int] = []
    match_line = link._match_line

    def counted(line: str) -> object:
        seen.append(len(line))
        return match_line(line)

    with mock.patch.object(link, "_match_line", counted):
        yield seen
