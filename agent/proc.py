"""The one process-tree supervisor: every child the agent or a preflight gate starts runs in a process group of
its own, and nothing it starts outlives it (nvidia-smi runs, preflight commands and gate processes, GPU resets).

Two ways, one set of primitives:
- a supervised run (`SupervisedRunner`, for nvidia-smi on every poll): started with vfork + exec as the leader
  of a session of its own, under a hard timeout and an output cap, with a marker in its environment that its
  descendants inherit; the agent is a child subreaper while a run needs it, so what the run leaves behind (even
  after setsid()) is re-parented to the agent and killed and reaped by the marker; a run that cannot be killed
  (D state) is abandoned, remembered, and no second one starts while it lives;
- a command or a forked gate (`run_command`, preflight): its own process group, a scrubbed environment, and on
  timeout the whole tree below it stopped (SIGSTOP, so it cannot fork more) and killed (`kill_tree`); a gate
  process is a child subreaper too (`become_subreaper`)."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Run:
    exit_code: int | None  # None: did not finish (timeout, output cap) or did not start
    output: str
    duration_s: float
    timed_out: bool = False
    error: str | None = None  # could not run at all (missing binary, still-hung previous run)
    hung_pid: int | None = None
    output_capped: bool = False  # wrote more than the cap: reading stopped and the run was killed


# How a supervised run (nvidia-smi) runs, and why this way.
#
# nvidia-smi is started by the agent itself (subprocess: vfork + exec, no copy of the agent) as the leader of
# a session and process group of its own, stdin /dev/null, stdout and stderr one pipe, and an environment
# variable naming this process (CHILD_MARKER) that its descendants inherit. While it runs the agent is a child
# subreaper (prctl PR_SET_CHILD_SUBREAPER; in a container the agent is usually PID 1 and gets orphans anyway),
# so every process nvidia-smi leaves behind, even one that called setsid() to leave its group, is re-parented
# to the agent when its parent exits. When nvidia-smi has exited (a pidfd says so while the output is read,
# so a descendant that keeps the pipe open cannot stall the run), or at the timeout or output cap, the agent
# kills nvidia-smi's process group (nvidia-smi is not reaped yet, so its group id cannot have been reused),
# reaps it, then kills and reaps the children it gained that carry the marker (a zombie among them: one that
# started after nvidia-smi did) until none is left, and drops the subreaper flag again. Only descendants of
# nvidia-smi are ever signalled: another child of the process (a test process runs this code too) has no
# marker and is never touched. (The one thing the marker cannot tell: a zombie. In the agent every child is
# nvidia-smi's; in a process that starts children of its own while a run is in flight, one of them that has
# exited by the end of the run could be reaped here, and one orphaned during the run becomes its child.) A
# nvidia-smi that cannot be killed (D state) is abandoned, remembered, and no second one starts while it lives;
# the flag stays set until it has been reaped and cleaned up after.
#
# Measured per run around /bin/true on 2 cores, Python 3.11, in a process the agent's size (38 MiB; CPU of the
# processes a run starts besides /bin/true, and the agent's own extra CPU; bench.common.spawned_cpu_ms): the
# former supervisor, a fresh `python -I -S` per run, 17-20 ms; a supervisor forked from the agent (os.fork, no
# exec, keeping the separate subreaper), 3.6 ms in the child + 1.5 ms in the agent (copying a 38 MiB process's
# page tables and the copy-on-write faults cost that much even with nothing run in the child: fork + _exit
# alone measured 1.7 + 1.2 ms); os.posix_spawn from the agent, 0.2-0.3 ms in the agent; subprocess.Popen (this:
# vfork + exec too, and it closes the descriptors a library may have left inheritable), 0.2-0.3 ms in the
# agent; in both, 0.0-0.1 ms in other processes (noise).
CHILD_MARKER = "GPU_READY_NVIDIA_SMI_OF"  # names the process whose supervised run a process descends from
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
_MAX_ENVIRON = 1 << 18  # bytes of a child's environment searched for the marker


class _Subreaper:
    """PR_SET_CHILD_SUBREAPER for this process while at least one nvidia-smi run (or an abandoned one) needs it;
    left alone when something else had already set it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._prctl: Any = None
        self._was_set = False

    def call(self, option: int, arg: Any) -> int:
        """prctl(option, arg, 0, 0, 0); arg an int or a ctypes pointer. -1 where it cannot be called."""
        if self._prctl is None:
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).prctl
                fn.restype = ctypes.c_int
                self._prctl = fn
            except (OSError, AttributeError):
                self._prctl = False
        if not self._prctl:
            return -1
        import ctypes

        value = ctypes.c_ulong(arg) if isinstance(arg, int) else arg
        zero = ctypes.c_ulong(0)
        return int(self._prctl(option, value, zero, zero, zero))

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                import ctypes

                flag = ctypes.c_int(0)
                self._was_set = self.call(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) == 0 and bool(flag.value)
                if not self._was_set:
                    self.call(PR_SET_CHILD_SUBREAPER, 1)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and not self._was_set:
                self.call(PR_SET_CHILD_SUBREAPER, 0)


_SUBREAPER = _Subreaper()
_TOKEN = f"{os.getpid()}-{os.urandom(6).hex()}"  # this process's nvidia-smi descendants carry it (CHILD_MARKER)


def _token() -> str:
    global _TOKEN
    if not _TOKEN.startswith(f"{os.getpid()}-"):  # a forked copy of the process: a token of its own
        _TOKEN = f"{os.getpid()}-{os.urandom(6).hex()}"
    return _TOKEN


def _read_proc(path: str, limit: int = 4096) -> bytes | None:
    """The first `limit` bytes of a /proc file with plain `os` calls (read once per nvidia-smi run); None when it
    cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        out = os.read(fd, limit)
        while out and len(out) < limit and (more := os.read(fd, limit - len(out))):
            out += more  # a file longer than one read gives (many children)
        return out
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]; None when gone."""
    raw = _read_proc(f"/proc/{pid}/stat")
    return None if raw is None else raw.rpartition(b")")[2].split()


def _own_children() -> set[int]:
    """Children of this process as its main thread (where the kernel re-parents orphans) and the calling thread
    (nvidia-smi's parent) list them."""
    me = os.getpid()
    out: set[int] = set()
    for tid in {me, threading.get_native_id()}:
        raw = _read_proc(f"/proc/{me}/task/{tid}/children", 1 << 20)
        if raw:
            out.update(int(p) for p in raw.split())
    return out


def _carries_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read(_MAX_ENVIRON)
    except OSError:
        return False
    return env.startswith(marker) or b"\0" + marker in env


class SupervisedProcess:
    """One nvidia-smi run: its pid (not reaped until cleanup(), so its process group id stays reserved), the
    read end of its output pipe, a pidfd when the kernel has them."""

    def __init__(self, popen: subprocess.Popen[bytes], out_r: int, before: frozenset[int] = frozenset()) -> None:
        self.popen, self.pid, self.out_r = popen, popen.pid, out_r
        self.before = before  # the process's children just before nvidia-smi started
        self.returncode: int | None = None
        self.reaped = False
        st = _stat_fields(self.pid)
        self.start_ticks = int(st[19]) if st and len(st) > 19 and st[19].isdigit() else 0
        try:
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            self.pidfd = None  # kernel before 5.3: exits are polled
        self._lock = threading.Lock()  # signalling never races the reaping (the group id is not reused)

    def exited(self) -> bool:
        """True once nvidia-smi has exited (it stays a zombie: not reaped here)."""
        if self.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def kill_group(self) -> None:
        with self._lock:
            if not self.reaped:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    pass

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(timeout, 0.0)
        pause = 0.0005
        while not self.exited():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], left)
            else:
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)
        return True

    def cleanup(self) -> int:
        """After nvidia-smi exited: kill its group, reap it, then kill and reap what it left behind. Returns its
        exit code (128 + N when killed by signal N)."""
        self.kill_group()
        with self._lock:
            if not self.reaped:
                try:
                    _, st = os.waitpid(self.pid, 0)
                    code = os.waitstatus_to_exitcode(st)
                except ChildProcessError:
                    code = 0
                self.returncode = code if code >= 0 else 128 - code
                self.popen.returncode = code  # reaped here: Popen must neither wait for it nor warn
                self.reaped = True
        marker = f"{CHILD_MARKER}={_token()}".encode()
        for _ in range(10_000):  # each round kills what is there; what they leave comes up the next round
            kids = [p for p in _own_children() if p != self.pid and p not in self.before]
            left = []
            for pid in kids:
                fields = _stat_fields(pid)
                if fields is None:
                    continue
                zombie = fields[0] == b"Z"
                started = int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else -1
                if (zombie and started >= self.start_ticks) or (not zombie and _carries_marker(pid, marker)):
                    left.append(pid)
            if not left:
                break
            for pid in left:
                _signal(pid, signal.SIGKILL)
            for pid in left:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        assert self.returncode is not None
        return self.returncode

    def close(self) -> None:
        for fd in (self.out_r, self.pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


_ENV_CACHE: tuple[str, dict[bytes, bytes], dict[bytes, bytes]] | None = None  # (token, environ copy, env)


def _child_environment() -> dict[bytes, bytes]:
    """This process's environment with the marker first: built again only when the environment or the token
    changed (os.environ's own dict compared, a C-level comparison, instead of ~40 Python-level lookups)."""
    global _ENV_CACHE
    token, data = _token(), getattr(os.environ, "_data", None)
    cached = _ENV_CACHE
    if cached is not None and data is not None and cached[0] == token and cached[1] == data:
        return cached[2]
    marker = CHILD_MARKER.encode()
    env = {marker: token.encode(), **{k: v for k, v in os.environb.items() if k != marker}}
    if isinstance(data, dict):
        _ENV_CACHE = (token, dict(data), env)
    return env


def spawn(exe: str, args: Sequence[str] = ()) -> SupervisedProcess:
    """Starts nvidia-smi (see above). The caller holds _SUBREAPER. Raises OSError when it cannot start.
    subprocess.Popen (vfork + exec, as os.posix_spawn) because it also closes every descriptor but the three
    standard ones in the child (a library may open some without close-on-exec) and resets SIGPIPE and SIGXFSZ,
    which Python ignores, to their defaults."""
    before = frozenset(_own_children())  # a zombie among these is not nvidia-smi's, whenever it started
    out_r, out_w = os.pipe()
    env = _child_environment()
    try:
        popen = subprocess.Popen(
            [exe, *args], stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, env=env, start_new_session=True
        )
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    return SupervisedProcess(popen, out_r, before)


class SupervisedRunner:
    """Runs nvidia-smi under a hard timeout and an output cap and leaves no process behind (see
    spawn). On timeout or when the output passes the cap everything is killed; a run that cannot be
    reaped (nvidia-smi in D state) is abandoned, and no second nvidia-smi starts while it lives."""

    def __init__(
        self,
        path: str = "nvidia-smi",
        timeout_s: float = 30.0,
        reap_grace_s: float = 2.0,
        max_output_bytes: int = 4 << 20,
        name: str | None = None,
    ) -> None:
        self.path = path
        self.name = name or os.path.basename(path) or path  # in messages
        self.timeout_s = timeout_s
        self.reap_grace_s = reap_grace_s
        self.max_output_bytes = max_output_bytes
        self._abandoned: SupervisedProcess | None = None
        self._current: SupervisedProcess | None = None
        self._lock = threading.Lock()
        self._exe: str | None = None  # the executable found last time; looked up again when it fails to start

    def kill_running(self) -> None:
        """Stops the nvidia-smi in flight, if any, and its group (on shutdown)."""
        p = self._current
        if p is not None:
            p.kill_group()

    def _still_hung(self) -> int | None:
        p = self._abandoned
        if p is None:
            return None
        if not p.exited():
            return p.pid
        try:
            p.cleanup()  # the D state ended: reap it and whatever it left
        finally:
            p.close()
            self._abandoned = None
            _SUBREAPER.release()
        return None

    def _resolve(self) -> tuple[str | None, str | None]:
        """(executable, None) or (None, why it cannot run)."""
        exe = shutil.which(self.path)
        if exe is not None:
            return exe, None
        if os.sep in self.path and os.path.exists(self.path):
            return None, f"cannot run {self.path!r}: not an executable file"
        return None, f"{self.name} not found at {self.path!r}"

    def run(self, args: Sequence[str] = ()) -> Run:
        """One nvidia-smi run (`args`: e.g. `-L` for the GPU list with UUIDs); never two at once."""
        with self._lock:
            start = time.monotonic()
            hung = self._still_hung()
            if hung is not None:
                return Run(
                    None,
                    "",
                    0.0,
                    error=f"a previous {self.name} (pid {hung}) is still hung; not starting another",
                    hung_pid=hung,
                )
            exe, why = (self._exe, None) if self._exe is not None else self._resolve()
            if exe is None:
                return Run(None, "", 0.0, error=why)
            _SUBREAPER.acquire()
            try:
                proc = spawn(exe, args)
            except OSError as e:
                _SUBREAPER.release()
                self._exe = None
                _, why = self._resolve()  # gone or no longer executable: say so as a first lookup would
                error = why or f"cannot run {self.path!r}: {e.strerror}"
                return Run(None, "", time.monotonic() - start, error=error)
            self._exe = exe
            self._current = proc
            abandoned = False
            try:
                run = self._collect(proc, start)
                abandoned = self._abandoned is proc
                return run
            finally:
                self._current = None
                if not abandoned:
                    proc.close()
                    _SUBREAPER.release()

    def _collect(self, proc: SupervisedProcess, start: float) -> Run:
        deadline = start + self.timeout_s
        out, capped, done = _read_capped(proc, self.max_output_bytes, deadline)
        text = out.decode("utf-8", "replace")
        if done and proc.wait_exit(deadline - time.monotonic()):
            code = proc.cleanup()
            return Run(code, text, time.monotonic() - start)
        # Timed out or wrote too much: kill its group, then what it left once it is gone.
        proc.kill_group()
        hung_pid = None
        if proc.wait_exit(self.reap_grace_s):
            proc.cleanup()
        else:
            self._abandoned = proc  # nvidia-smi cannot be killed (D state): remember it
            hung_pid = proc.pid
        return Run(None, text, time.monotonic() - start, timed_out=not capped, hung_pid=hung_pid, output_capped=capped)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _read_capped(proc: SupervisedProcess, cap: int, deadline: float) -> tuple[bytes, bool, bool]:
    """Reads nvidia-smi's output until it has exited and the pipe is drained (or at end of file), the deadline
    or the cap: (first `cap` bytes at most, capped, done). A descendant that keeps the pipe open does not hold
    the run up: once nvidia-smi has exited, what the pipe holds is read and the run is done."""
    fd = proc.out_r
    buf = bytearray()
    watch = [fd] if proc.pidfd is None else [fd, proc.pidfd]
    gone = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(buf), False, False
        if gone:
            if not select.select([fd], [], [], 0)[0]:
                return bytes(buf), False, True  # exited and drained; a descendant may hold the pipe
        elif fd not in select.select(watch, [], [], left if proc.pidfd is not None else min(left, 0.05))[0]:
            gone = proc.exited()
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return bytes(buf), False, True
        if len(buf) + len(chunk) > cap:
            buf += chunk[: cap - len(buf)]
            return bytes(buf), True, False
        buf += chunk


OUTPUT_LIMIT = 64 * 1024  # bytes of a command's output kept (the tail)
# Environment variables a third-party command never gets: API credentials and where to find the API.
SCRUBBED_ENV_PREFIXES = ("KUBERNETES_", "KUBECONFIG")


def become_subreaper() -> bool:
    """Makes this process a child subreaper for good (a forked gate process)."""
    return sys.platform.startswith("linux") and _SUBREAPER.call(PR_SET_CHILD_SUBREAPER, 1) == 0


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
