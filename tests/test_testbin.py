"""tools/k8s-testbin/build.sh: two runs at once take turns on the cache's lock and both succeed; the helm it
builds assumes the Kubernetes version the tests run when no --kube-version is given."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testkit import controlplane  # the module: a function named test* imported here would be collected
from testkit.chart import CHART, KUBE_VERSION

BUILD = Path(__file__).resolve().parents[1] / "tools" / "k8s-testbin" / "build.sh"


@pytest.mark.apiserver
def test_two_builds_at_once_both_succeed_on_one_cache():
    runs = [
        subprocess.Popen(["bash", str(BUILD), part], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for part in ("all", "demo")
    ]
    outs = [r.communicate(timeout=1800) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [e[-2000:] for _, e in outs]
    assert {o.strip().splitlines()[-1] for o, _ in outs} == {str(controlplane.testbin_dir())}
    assert not list(controlplane.testbin_dir().glob("*.tmp*")), "a build left a temporary file behind"  # type: ignore[union-attr]


def test_a_bad_part_is_one_line_and_exit_2():
    r = subprocess.run(["bash", str(BUILD), "everything"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "usage:" in r.stderr, r.stderr


@pytest.mark.apiserver
def test_helm_assumes_the_tested_kubernetes_version(tmp_path: Path):
    helm = controlplane.testbin_dir() / "helm"  # type: ignore[operator]
    r = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--show-only", "templates/daemonset.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr  # the chart's kubeVersion constraint holds without --kube-version
    chart = tmp_path / "caps"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: caps\nversion: 0.1.0\n")
    (chart / "templates" / "v.yaml").write_text("kube: {{ .Capabilities.KubeVersion.Version }}\n")
    out = subprocess.run([str(helm), "template", "t", str(chart)], capture_output=True, text=True, timeout=120)
    major_minor = ".".join(KUBE_VERSION.lstrip("v").split(".")[:2])
    assert f"kube: v{major_minor}.0" in out.stdout, out.stdout + out.stderr


def test_cached_binaries_return_before_the_lock(tmp_path: Path):
    """Every binary of the part already built: build.sh prints the bin dir at once, even while another run holds
    the lock (it waits on the lock only when it has something to build)."""
    import fcntl

    env_text = (BUILD.parent / "versions.env").read_text()
    k8s = env_text.split('K8S_VERSION="', 1)[1].split('"', 1)[0]
    helm_v = env_text.split('HELM_VERSION="', 1)[1].split('"', 1)[0]
    etcd = next(
        line.split()[1]
        for line in (BUILD.parent / "go.mod").read_text().splitlines()
        if line.split()[:1] == ["go.etcd.io/etcd/server/v3"] and line.split()[1:2] != [] and line.split()[1][0] == "v"
    )
    bin_dir = tmp_path / f"k8s-{k8s}-etcd-{etcd}-helm-{helm_v}"
    bin_dir.mkdir()
    for name in ("kube-apiserver", "etcd", "kube-scheduler"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    with open(tmp_path / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run building
        r = subprocess.run(
            ["bash", str(BUILD), "demo"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "GPU_READY_TESTBIN": str(tmp_path)},
        )
    assert r.returncode == 0 and r.stdout.strip() == str(bin_dir), r.stderr
    assert "waiting" not in r.stderr and r.stderr == ""


def test_the_cache_helper_is_not_collected_as_a_test(pytestconfig: pytest.Config):
    assert "testbin_dir" not in globals()
