"""The binaries tools/k8s-testbin/build.sh builds (kube-apiserver, etcd, the scheduler and controller-manager, helm,
promtool, ...), as a test asks for them: a missing one skips the test, except under CI=true, where it fails the run
(it never skips there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testkit.controlplane import testbin_dir

IN_CI = os.environ.get("CI") == "true"


def require_testbin(*binaries: str) -> Path:
    """The testbin directory holding `binaries`; skips the test when one is missing, except under CI=true,
    where a missing binary fails the run (it never skips there)."""
    bd = testbin_dir()
    missing = [b for b in binaries if bd is None or not (bd / b).exists()]
    if missing or bd is None:
        msg = f"{', '.join(missing)} not built (looked in {bd}); run tools/k8s-testbin/build.sh"
        if IN_CI:
            pytest.fail(msg + " -- under CI=true a missing binary fails the run", pytrace=False)
        pytest.skip(msg)
    return bd


def tool(name: str) -> str:
    """The path of one built tool (helm, promtool, ...), skipping the test (failing it under CI=true) when it is
    not built."""
    bd = testbin_dir()
    path = bd / name if bd else None
    if path is None or not path.exists():
        msg = f"{name} not found in {bd}; run tools/k8s-testbin/build.sh"
        if IN_CI:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return str(path)
