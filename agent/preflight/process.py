"""A preflight gate in a process of its own: it leads its own process group and is a child subreaper, so nothing
a gate starts outlives it (agent/proc.py has the primitives)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import time
from collections.abc import Callable
from dataclasses import asdict

from agent.preflight.result import FAIL, GateResult
from agent.proc import become_subreaper, kill_leftovers, kill_tree

RESULT_LIMIT = 1 << 20  # bytes of JSON a gate process may send back


def gate_error(e: BaseException) -> str:
    """What a gate's exception means, as a sentence: a tool that is missing or cannot be run is named."""
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"cannot run {e.filename}: it is not installed or not on PATH (or name its path in the profile)"
    if isinstance(e, PermissionError) and e.filename:
        return f"cannot run {e.filename}: permission denied (is it executable?)"
    if isinstance(e, OSError) and e.strerror:
        return f"gate error: {e.strerror}{f' ({e.filename})' if e.filename else ''}"
    return f"gate error: {type(e).__name__}: {e}"


def run_in_process(name: str, fn: Callable[[], GateResult], timeout_s: float) -> GateResult:
    """Runs `fn` in a forked child that leads its own process group and is a child subreaper. On timeout the
    child and everything below it are killed before this returns, so no part of the gate keeps running."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the gate process
        code = 0
        try:
            os.close(rfd)
            os.setpgid(0, 0)
            become_subreaper()
            try:
                res = fn()
            except BaseException as e:  # anything the gate raises is its failure, reported as such
                res = GateResult(name, FAIL, gate_error(e)[:2000])
            kill_leftovers()
            data = json.dumps(asdict(res), default=str).encode()
            if len(data) > RESULT_LIMIT:
                res.evidence = {"truncated": True}
                data = json.dumps(asdict(res), default=str).encode()
            with os.fdopen(wfd, "wb") as out:
                out.write(data)
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(wfd)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpgid(pid, pid)  # also from here, so the group exists before any kill (no race with the child)
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size, timed_out = 0, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([rfd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > RESULT_LIMIT + 65536:
                break
            chunks.append(chunk)
    finally:
        os.close(rfd)
    if timed_out:
        kill_tree(pid, pid)
        os.waitpid(pid, 0)
        return GateResult(name, FAIL, f"gate timed out after {timeout_s:g}s")
    # the result is in; the child exits right after writing it (give it a moment, then make sure)
    end = time.monotonic() + 5
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > end:
            kill_tree(pid, pid)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    try:
        return GateResult.from_mapping(json.loads(b"".join(chunks)))
    except ValueError as e:
        return GateResult(name, FAIL, f"gate process ended without a result ({e})")
