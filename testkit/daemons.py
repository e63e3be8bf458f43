"""Stand-in programs for the nvidia-smi runner's tests (tests/test_hardening.py, tests/test_nvidia_smi_runner.py):
an executable Python script in place of nvidia-smi, and the source of one that leaves setsid() daemons behind, as a
misbehaving nvidia-smi (or a program it starts) can."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def stand_in(tmp_path: Path, body: str, name: str = "nvidia-smi") -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def daemons(pidfile: Path, lives: tuple[bool, ...], close_stdio: bool = False) -> str:
    """Stand-in source that forks one setsid() daemon per entry of `lives` (True: it pauses until killed; False: it
    exits at once), each appending its pid to `pidfile`, and goes on once every one has written it: each daemon
    closes its end of a pipe when its pid is in the file, so the stand-in waits for the pipe's end of file (at
    most 60 s), not for a fixed time."""
    return f"""\
import os, select, signal, sys
ready_r, ready_w = os.pipe()
for lives in {lives!r}:
    if os.fork() == 0:
        os.close(ready_r)
        os.setsid()  # leaves nvidia-smi's process group and session
        if os.fork() == 0:
            if {close_stdio!r}:
                os.close(1); os.close(2)
            with open({str(pidfile)!r}, "a") as fh:
                fh.write(f"{{os.getpid()}}\\n")
            os.close(ready_w)  # its pid is written
            if lives:
                signal.pause()  # lives until killed
            os._exit(0)
        os._exit(0)
    os.wait()
os.close(ready_w)
while select.select([ready_r], [], [], 60)[0] and os.read(ready_r, 1):
    pass  # nothing is written: the read returns at end of file, when every daemon has closed its end
"""
