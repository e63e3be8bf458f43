"""Process control for the gates: every gate runs in a child process that leads its own process group, every
command in its own process group, and whatever either leaves behind is killed with it.

A gate that overruns its timeout is stopped (SIGSTOP, so it cannot fork more), every process below it is
killed, then its group and itself. The gate process is a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): a
grandchild whose parent exits, or that calls setsid() to leave its group, is re-parented to the gate process
and stays in its tree, so nothing a command starts outlives the gate."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from agent.preflight.result import FAIL, GateResult

PR_SET_CHILD_SUBREAPER = 36
RESULT_LIMIT = 1 << 20  # bytes of JSON a gate process may send back
OUTPUT_LIMIT = 64 * 1024  # bytes of a command's output kept (the tail)
# Environment variables a third-party command never gets: API credentials and where to find the API.
SCRUBBED_ENV_PREFIXES = ("KUBERNETES_", "KUBECONFIG")


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (Linux /proc)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read(4096)
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses: split after the last ')'
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) >= 2:
            out[int(name)] = int(rest[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before children."""
    children: dict[int, list[int]] = {}
    for p, pp in _parents().items():
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_tree(pid: int, pgid: int | None = None) -> None:
    """SIGKILLs everything below `pid`, its process group `pgid`, and `pid` itself. `pid` is stopped first so
    it cannot start more; the walk repeats until nothing is left below it (forks racing the walk)."""
    _signal(pid, signal.SIGSTOP)
    for _ in range(50):
        below = descendants(pid)
        if not below:
            break
        for p in below:
            _signal(p, signal.SIGSTOP)
        for p in below:
            _signal(p, signal.SIGKILL)
        time.sleep(0.01)
    if pgid is not None:
        _signal_group(pgid, signal.SIGKILL)
    _signal(pid, signal.SIGKILL)
    _signal(pid, signal.SIGCONT)


def kill_leftovers() -> None:
    """In a gate process: kills every process still below it (commands' orphans and daemons)."""
    me = os.getpid()
    for _ in range(50):
        below = descendants(me)
        if not below:
            return
        for p in below:
            _signal(p, signal.SIGKILL)
        _reap()
        time.sleep(0.01)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def scrubbed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a gate's command gets: no Kubernetes API location or credentials."""
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if not k.startswith(SCRUBBED_ENV_PREFIXES)}


# -- a gate in its own process --------------------------------------------------------------------------


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
                res = GateResult(name, FAIL, f"gate error: {type(e).__name__}: {e}"[:2000])
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


# -- a command in its own process group ------------------------------------------------------------------


@dataclass
class CommandOutcome:
    exit_code: int | None  # None: timed out (killed)
    output: str  # the tail of stdout + stderr
    seconds: float


def run_command(
    argv: list[str],
    timeout_s: float,
    sample: Callable[[], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> CommandOutcome:
    """Runs `argv` in its own process group with a scrubbed environment; on timeout the group and every
    process below the command are killed. `sample` is called about every second while it runs. Raises OSError
    when it cannot start."""
    t0 = time.monotonic()
    p = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        process_group=0,
        env=scrubbed_env(env),
        close_fds=True,
    )
    assert p.stdout is not None
    fd = p.stdout.fileno()
    tail = bytearray()
    timed_out = eof = False
    next_sample = t0 + 1.0

    def read_ready(wait_s: float) -> int:
        """Reads what arrives within wait_s: 1 read something, 0 nothing came, -1 end of output."""
        ready, _, _ = select.select([fd], [], [], wait_s)
        if not ready:
            return 0
        chunk = os.read(fd, 65536)
        tail.extend(chunk)
        del tail[:-OUTPUT_LIMIT]
        return 1 if chunk else -1

    try:
        while not timed_out:
            now = time.monotonic()
            if now - t0 > timeout_s:
                timed_out = True
            elif read_ready(max(0.0, min(0.2, next_sample - now, t0 + timeout_s - now))) < 0:
                eof = True
                break
            elif p.poll() is not None:
                break  # exited; something it started may still hold the output open
            if sample is not None and time.monotonic() >= next_sample:
                sample()
                next_sample += 1.0
        if eof:  # output closed: wait for the exit within what is left of the timeout
            try:
                p.wait(max(0.0, t0 + timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        elif not timed_out:
            for _ in range(64):  # exited: take what is already written, without waiting for its children
                if read_ready(0) <= 0:
                    break
    finally:
        if timed_out or p.poll() is None:
            kill_tree(p.pid, p.pid)
        else:
            _signal_group(p.pid, signal.SIGKILL)  # anything it left running in its group
        p.stdout.close()
        p.wait()
    return CommandOutcome(None if timed_out else p.returncode, tail.decode("utf-8", "replace"), time.monotonic() - t0)
