"""How nvidia-smi runs (agent/probes/nvidia_smi.py): started by the agent itself, the agent a child
subreaper only while a run needs it. What the former per-poll `python -I -S` supervisor guaranteed is held in
tests/test_hardening.py (setsid() daemons killed, timeout kills the tree, output cap, exit codes) and
tests/test_probes.py (hung runs abandoned); here: what the new way must add (other children of the process never
touched, the flag dropped, a leftover that exits by itself reaped, the loop thread's runs covered) and the one
process a run starts."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from agent.probes.nvidia_smi import NvidiaSmiRunner, probe_nvidia_smi
from testkit.daemons import daemons, stand_in
from testkit.fixture_files import fixture_path
from testkit.harness import wait_for

PR_GET_CHILD_SUBREAPER = 37


def subreaper() -> bool:
    flag = ctypes.c_int(-1)
    zero = ctypes.c_ulong(0)
    assert ctypes.CDLL(None).prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), zero, zero, zero) == 0
    return bool(flag.value)


def table() -> str:
    return fixture_path("smi-table-healthy-h100x8-550.90.07-gpud-fixture.txt").read_text()


def test_other_children_are_never_touched_and_the_flag_is_dropped(tmp_path):
    """A child the process started itself (no marker), alive and one already exited (a zombie older than the
    run), survive every run; the subreaper flag is set only during a run."""
    smi = stand_in(tmp_path, f"import sys; sys.stdout.write({table()!r})")
    sleeper = subprocess.Popen(["sleep", "120"])
    exited = subprocess.Popen(["true"])
    wait_for(lambda: Path(f"/proc/{exited.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z", 10)
    try:
        assert not subreaper()
        runner = NvidiaSmiRunner(str(smi), timeout_s=30)
        for _ in range(3):
            r = probe_nvidia_smi(runner)
            assert r.ran and r.count == 8, r.findings
        assert not subreaper(), "the flag outlived the run"
        assert sleeper.poll() is None, "a child that is not nvidia-smi's was killed"
        assert Path(f"/proc/{exited.pid}").exists(), "a zombie that is not nvidia-smi's was reaped"
        assert exited.wait(5) == 0  # its exit status is still there for its owner
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_leftovers_of_a_run_from_another_thread_are_killed_and_reaped(tmp_path):
    """The agent runs nvidia-smi from its loop thread, while orphans are re-parented to the main thread: a setsid()
    daemon that lives on is killed and one that exits by itself is reaped (no zombie per poll)."""
    pids = tmp_path / "pids"
    smi = stand_in(tmp_path, daemons(pids, (True, False)) + f"sys.stdout.write({table()!r})\n")
    runner = NvidiaSmiRunner(str(smi), timeout_s=30)
    results = []
    t = threading.Thread(target=lambda: results.append(probe_nvidia_smi(runner)))
    t.start()
    t.join(60)
    assert results and results[0].ran and results[0].count == 8, results
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2
    assert [p for p in left if Path(f"/proc/{p}").exists()] == [], "a leftover lives on or stayed a zombie"
    assert not subreaper()


def test_a_run_starts_one_process_nvidia_smi_itself_a_child_of_the_agent(tmp_path, monkeypatch):
    """The former supervisor was one more process per run (a `python -I -S`, 17-20 ms of CPU each); a run now
    starts exactly one process, nvidia-smi, from the agent itself: counted at every way Python starts one (fork,
    posix_spawn, subprocess's fork_exec), and each run's nvidia-smi reports this process as its parent. What a run
    costs in CPU is measured by bench/footprint.py (bench.common.spawned_cpu_ms), not asserted here."""
    parents = tmp_path / "parents"
    smi = stand_in(
        tmp_path,
        f"""
        import os
        with open({str(parents)!r}, "a") as fh:
            fh.write(f"{{os.getppid()}}\\n")
        """,
    )
    started: Counter[str] = Counter()

    def counting(module: Any, name: str) -> None:
        real = getattr(module, name)

        def call(*a: Any, **kw: Any) -> Any:
            started[name] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, name, call)

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        counting(os, name)
    counting(subprocess, "_fork_exec")  # what subprocess.Popen starts a child with (vfork + exec)
    runner = NvidiaSmiRunner(str(smi), timeout_s=30)
    for _ in range(5):
        run = runner.run()
        assert run.exit_code == 0, run
    assert started == {"_fork_exec": 5}, started
    assert parents.read_text().split() == [str(os.getpid())] * 5


def test_nvidia_smi_gets_default_sigpipe_and_no_agent_descriptor(tmp_path):
    """nvidia-smi starts with SIGPIPE at its default (Python ignores it, and an ignored signal stays ignored
    across exec) and none of the agent's descriptors but its stdin, stdout and stderr."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ngrep '^SigIgn' /proc/self/status\nls /proc/self/fd\n")
    smi.chmod(0o755)
    r, w = os.pipe()
    os.set_inheritable(w, True)  # even a descriptor the process made inheritable
    try:
        run = NvidiaSmiRunner(str(smi), timeout_s=30).run()
    finally:
        os.close(r)
        os.close(w)
    assert run.exit_code == 0, run
    lines = run.output.split()
    ignored = int(lines[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), run.output
    fds = sorted(int(x) for x in lines[2:])
    assert fds[:3] == [0, 1, 2] and len(fds) <= 4, run.output  # the 4th: ls's own directory descriptor


def test_environment_changes_reach_the_next_run_and_a_missing_binary_is_found_missing(tmp_path, monkeypatch):
    """The child environment and the executable's path are kept between runs (no rebuild per poll);
    a change to the agent's environment still reaches the next nvidia-smi, and a binary removed after a run
    gives the same "not found" answer as on a first run."""
    smi = stand_in(
        tmp_path,
        """\
        import os, sys
        value, marked = os.environ.get("GPU_READY_TEST_VALUE", "-"), "GPU_READY_NVIDIA_SMI_OF" in os.environ
        sys.stdout.write(f"{value} {marked}")
        """,
    )
    runner = NvidiaSmiRunner(str(smi), timeout_s=30)
    monkeypatch.delenv("GPU_READY_TEST_VALUE", raising=False)
    assert runner.run().output == "- True"
    monkeypatch.setenv("GPU_READY_TEST_VALUE", "one")
    assert runner.run().output == "one True"
    monkeypatch.setenv("GPU_READY_TEST_VALUE", "two")
    assert runner.run().output == "two True"
    smi.unlink()
    gone = runner.run()
    assert gone.exit_code is None and gone.error == f"nvidia-smi not found at {str(smi)!r}", gone.error
    smi.write_text("not a program")
    smi.chmod(0o644)
    assert "not an executable file" in (runner.run().error or "")
