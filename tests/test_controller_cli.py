"""`gpu-ready controller` refuses bad flags and a bad Job template the way the agent refuses bad settings: one line
on stderr and exit 2, never a traceback and never a hang (a FIFO as the template is refused unread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GOOD_JOB = """apiVersion: batch/v1
kind: Job
metadata: {name: x}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: c, image: busybox}]
"""


def run(tmp_path: Path, *argv: str, template: Path | None = None) -> subprocess.CompletedProcess[str]:
    if template is None:
        template = tmp_path / "job.yaml"
        template.write_text(GOOD_JOB)
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    cmd = [sys.executable, "-m", "agent.cli", "controller", f"--job-template={template}",
           f"--kubeconfig={tmp_path / 'none'}", *argv]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def one_line_exit_2(r: subprocess.CompletedProcess[str], *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("gpu-ready controller: "), lines
    for w in words:
        assert w in lines[0], lines


@pytest.mark.parametrize(
    "address", ["nonsense", ":99999", "host:port", "127.0.0.1:-1", "::::", "exa mple:80", ""]
)  # fmt: skip
def test_bad_metrics_address(tmp_path, address):
    one_line_exit_2(run(tmp_path, f"--metrics-address={address}"), "--metrics-address")


def test_metrics_address_in_use(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run(tmp_path, f"--metrics-address=127.0.0.1:{port}")
    # the template loads, then the kubeconfig is missing (one line) before the server binds; either way one line
    one_line_exit_2(r)


def test_template_fifo_is_refused_unread(tmp_path):
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    one_line_exit_2(run(tmp_path, template=fifo), "not a regular file")


@pytest.mark.parametrize(
    "what,text,words",
    [
        ("5,000 levels of flow nesting", "spec: " + "[" * 5000 + "]" * 5000, ("deeper",)),
        ("5,000 levels of mappings", "a: " + "{b: " * 5000 + "c" + "}" * 5000, ("deeper",)),
        ("200 levels of block mappings", "".join(f"{' ' * i}k{i}:\n" for i in range(200)) + " " * 200 + "x", ()),
        ("no pod spec", "kind: Job\nspec: {template: {}}\n", ("pod spec",)),
        ("a pod spec without containers", "kind: Job\nspec: {template: {spec: {containers: []}}}\n", ("pod spec",)),
        ("containers not objects", "kind: Job\nspec: {template: {spec: {containers: [x]}}}\n", ("containers",)),
        ("not a Job", "kind: Pod\nspec: {}\n", ("not a batch/v1 Job",)),
        ("not YAML", "kind: Job\nspec: [\n", ("not YAML",)),
        ("binary", "\x00\x01\x02\xff", ()),
        ("empty", "", ("not a batch/v1 Job",)),
        ("YAML aliases", "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nkind: Job\n", ("not a batch/v1 Job",)),
    ],
)
def test_bad_template(tmp_path, what, text, words):
    p = tmp_path / "job.yaml"
    p.write_bytes(text.encode("utf-8", "surrogateescape") if what != "binary" else b"\x00\x01\x02\xff")
    one_line_exit_2(run(tmp_path, template=p), *words)


def test_template_too_big_and_missing(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("# " + "x" * 300_000 + "\n" + GOOD_JOB)
    one_line_exit_2(run(tmp_path, template=p), "bytes")
    one_line_exit_2(run(tmp_path, template=tmp_path / "absent.yaml"), "absent.yaml")
    one_line_exit_2(run(tmp_path, template=tmp_path), "not a regular file")
