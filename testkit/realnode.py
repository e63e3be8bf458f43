"""The real node shared by the modules that need kubelet + containerd on this host (tests/test_real_node.py,
test_allocation_node.py, test_podresources_kubelet.py): their prerequisites, a control plane with the node
registered and the sandbox image loaded (testkit/node.py), and the teardown that must leave the host as it was."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.kube.client import KubeApi
from testkit.controlplane import REPO
from testkit.controlplane import testbin_dir as find_testbin
from testkit.node import (
    NODE_CONTROLLERS,
    NodeControlPlane,
    RealNode,
    build_containerd,
    build_images,
    kubelet_binary,
    missing_tools,
)
from testkit.testbin import IN_CI


def skip_or_fail(msg: str) -> None:
    if IN_CI:
        pytest.fail(msg + " -- under CI=true a missing prerequisite fails the run", pytrace=False)
    pytest.skip(msg)


def prerequisites() -> tuple[Path, Path]:
    """(testbin directory, kubelet) when this host can run a real node; otherwise the module is skipped (failed
    under CI=true) with the reason."""
    if os.geteuid() != 0:
        skip_or_fail("the real node needs root (kubelet, containerd, cgroups, mounts)")
    missing = missing_tools()
    if missing:
        skip_or_fail(f"Debian packages missing for the real node: {' '.join(missing)} (.ci/run installs them)")
    bd, kubelet = find_testbin(), kubelet_binary()
    if bd is None or not (bd / "kube-apiserver").exists() or kubelet is None or not kubelet.exists():
        skip_or_fail(f"kube-apiserver/kubelet not built (looked in {bd}); run tools/k8s-testbin/build.sh")
    assert bd is not None and kubelet is not None
    return bd, kubelet


def pause_image() -> tuple[str, Path]:
    """The sandbox (pause) image archive that tools/node-image/build.sh caches under the key sha256(pause.c)[:16];
    only when it is missing the whole build runs (which also rebuilds the agent image whenever agent/ changed:
    minutes that a module running no agent image does not need)."""
    key = hashlib.sha256((REPO / "tools" / "node-image" / "pause.c").read_bytes()).hexdigest()[:16]
    root = os.environ.get("GPU_READY_TESTBIN") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu-ready-testbin"
    )
    tar = Path(root) / "node-image" / f"pause-{key}.tar"
    if tar.is_file() and tar.stat().st_size > 0:
        return "localhost/pause:local", tar
    images = build_images()
    return images.pause, images.pause_tar


@dataclass
class Booted:
    cp: NodeControlPlane
    node: RealNode
    api: KubeApi  # the admin client (closed at teardown)
    bin_dir: Path  # the testbin directory (helm, kubectl, ...)
    pause: str  # the sandbox image's name, loaded
    setup_s: float  # control plane + containerd + kubelet + sandbox image, the wait for the host lock left out


@contextlib.contextmanager
def real_node(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    scheduler: bool = True,
    pause: tuple[str, Path] | None = None,
    tag: str = "real node",
) -> Iterator[Booted]:
    """A control plane (apiserver, the node controllers, the scheduler unless `scheduler` is False) and Node
    `name` run by kubelet + containerd on this host, schedulable, with the sandbox image (`pause`: name and
    archive; default pause_image()) loaded. On the way out, whatever the body did: the node is stopped, the host
    restored (the test fails if anything is left) and the control plane stopped."""
    bd, kubelet = prerequisites()
    containerd_bin = build_containerd()
    pause_name, pause_tar = pause or pause_image()
    cp = NodeControlPlane(name, bd)
    node: RealNode | None = None
    api: KubeApi | None = None
    try:
        t0 = time.monotonic()
        cp.start()
        cp.start_controller_manager(NODE_CONTROLLERS)
        if scheduler:
            cp.start_scheduler()
        cp_s = time.monotonic() - t0
        node = RealNode(cp, kubelet, containerd_bin, labels=labels, pause_image=pause_name)
        node.start()  # waits for the host-wide real-node lock first (not counted in setup_s)
        t1 = time.monotonic()
        node.wait_schedulable()
        node.load_image(pause_tar, pause_name)
        api = cp.admin()
        yield Booted(cp, node, api, bd, pause_name, cp_s + node.start_seconds["node"] + time.monotonic() - t1)
    finally:
        if api is not None:
            api.close()
        if node is not None:
            undone = node.stop()
            left = node.leftovers()
            node.cleanup_workdir()
            print(f"\n[{tag}] restored: {', '.join(undone) or 'nothing'}")
            assert not left, f"host changes left after stop: {left}"
        cp.stop()
