"""Footprint: what `gpu-ready run` imports, the fallback to the plain `kubernetes` import, the
light kubeconfig reader against the official one, no wake-ups of an idle agent, the files a PCI scan reads."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import simple_kubeconfig
from agent.model import PciAddress
from agent.probes.pci import list_pci_gpus
from testkit.simhost import SimHost

REPO = Path(__file__).resolve().parents[1]

# The `run` path's imports, measured in a fresh interpreter (below): 2026-11, kubernetes 37.0.2, Python 3.11,
# this dev venv (which has rich, pulled into structlog by import-linter: +84 modules, +4.8 MiB; the image has
# not): about 375 modules and 39 MiB peak. Before the light client and the deferred imports: 705 modules, 56 MiB.
# The ceilings leave room for small growth; bringing back the whole client (+500 modules, +30 MiB) or preflight
# fails them.
MODULES_MAX = 450
PEAK_RSS_MAX_MIB = 46.0
# what the run path must not import at all
FORBIDDEN = (
    "kubernetes.client.models",
    "kubernetes.client.api_client",
    "kubernetes.client.api",
    "kubernetes.config.kube_config",
    "kubernetes.dynamic",
    "kubernetes.watch",
    "kubernetes.stream",
    "pydantic",
    "oauthlib",
    "requests",
    "websocket",
    "dateutil",
    "agent.preflight",
)

RUN_PATH = r"""
import json, sys, os
before = len(sys.modules)
from agent import cli
parser = cli.build_parser(with_preflight=cli.wants_preflight(["run"]))
import agent.runner
from agent.kube.client import KubeApi, client_layer
api = KubeApi.from_environment(sys.argv[1], 5.0)  # a plain kubeconfig, as the tests and benches use
def status():
    out = {}
    with open("/proc/self/status") as fh:  # this process's own figures (ru_maxrss would survive exec)
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) / 1024
    return out
print(json.dumps({"modules": len(sys.modules) - before, "names": sorted(sys.modules), "light": client_layer().light,
                  "host": api.configuration.host, **status()}))
"""


def run_py(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def plain_kubeconfig(path: Path, server: str = "https://127.0.0.1:6443", ca: str = "ca.crt") -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
        f"clusters:\n- name: t\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n"
        "users:\n- name: u\n  user:\n    token: abc123\n"
        "contexts:\n- name: t\n  context:\n    cluster: t\n    user: u\n"
    )
    return path


def test_the_run_path_imports_only_what_it_uses(tmp_path):
    r = run_py(RUN_PATH, str(plain_kubeconfig(tmp_path / "kc")))
    names = set(r["names"])
    assert r["light"] is True
    assert r["host"] == "https://127.0.0.1:6443"
    present = [m for m in FORBIDDEN if m in names or any(n.startswith(m + ".") for n in names)]
    assert not present, f"the run path imports {present}"
    assert r["modules"] <= MODULES_MAX, f"{r['modules']} modules imported (ceiling {MODULES_MAX})"
    assert r["VmHWM"] <= PEAK_RSS_MAX_MIB, f"peak RSS {r['VmHWM']:.1f} MiB (ceiling {PEAK_RSS_MAX_MIB})"


def test_preflight_still_gets_its_flags():
    from agent import cli

    assert cli.wants_preflight(["preflight", "--profile", "x"]) and cli.wants_preflight([])
    assert not cli.wants_preflight(["run", "--node-name", "preflight"]) and not cli.wants_preflight(["check"])
    ns = cli.build_parser().parse_args(["preflight", "--profile", "p"])
    assert ns.profile == "p"


def test_a_deferred_package_is_whole_on_first_use():
    code = r"""
import json, sys
from agent.lazy import import_light, is_deferred
import_light("kubernetes.client.rest")
light = is_deferred("kubernetes") and is_deferred("kubernetes.client") and "kubernetes.client.models" not in sys.modules
import kubernetes                                  # the ordinary import later in the same process
from kubernetes import client, config, watch       # names the package __init__ defines
from kubernetes.client import CoreV1Api, V1Node
ok = callable(config.load_kube_config) and V1Node(metadata=None).metadata is None and hasattr(watch, "Watch")
print(json.dumps({"light_first": light, "whole_later": ok and not is_deferred("kubernetes.client"),
                  "same_rest": client.rest is sys.modules["kubernetes.client.rest"]}))
"""
    assert run_py(code) == {"light_first": True, "whole_later": True, "same_rest": True}


FALLBACK = r"""
import json, sys
import agent.kube.client as k
mode, host, token, ca = sys.argv[1:5]
if mode == "moved":  # a client release that moved a module of the light path
    k.LIGHT_MODULES["rest"] = "kubernetes.client.rest_moved_away"
api = k.KubeApi.from_token(host, token, ca)
ns = api.request("GET", "/api/v1/namespaces", verb="LIST")
try:
    api.request("GET", "/api/v1/namespaces/no-such-namespace-h10")
    missing = None
except k.ApiError as e:
    missing = e.status
print(json.dumps({"light": k.client_layer().light, "names": [i["metadata"]["name"] for i in ns["items"]],
                  "missing": missing, "models": "kubernetes.client.models" in sys.modules}))
"""


@pytest.mark.apiserver
@pytest.mark.parametrize(
    ("mode", "env", "light"),
    [("light", {}, True), ("moved", {}, False), ("full", {"GPU_READY_FULL_CLIENT": "1"}, False)],
)
def test_requests_work_on_the_light_path_and_on_the_fallback(control_plane, mode, env, light):
    cp = control_plane
    r = run_py(FALLBACK, mode, cp.host, cp.admin_token, cp.ca_file, env=env)
    assert r["light"] is light
    assert r["models"] is not light  # the fallback is the whole client
    assert "default" in r["names"] and "kube-system" in r["names"]
    assert r["missing"] == 404


def _official(path: Path) -> Any:
    import kubernetes

    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(path), client_configuration=cfg)
    return cfg


def _light(path: Path) -> Any:
    from agent.kube.client import client_layer

    cfg = client_layer().configuration()
    assert simple_kubeconfig(str(path), cfg)
    return cfg


def _read(p: str | None) -> bytes | None:
    return Path(p).read_bytes() if p else None


def test_the_plain_kubeconfig_reader_agrees_with_the_official_loader(tmp_path):
    (tmp_path / "ca.crt").write_bytes(b"CA")
    token_cfg = plain_kubeconfig(tmp_path / "token.kc")
    b64 = lambda b: base64.standard_b64encode(b).decode()  # noqa: E731
    cert_cfg = tmp_path / "cert.kc"
    cert_cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters:\n- name: k\n  cluster:\n    server: https://10.0.0.1:443\n"
        f"    certificate-authority-data: {b64(b'CA-DATA')}\n"
        f"users:\n- name: u\n  user:\n    client-certificate-data: {b64(b'CERT')}\n    client-key-data: {b64(b'KEY')}\n"
        "contexts:\n- name: other\n  context:\n    cluster: nope\n    user: nope\n"
        "- name: c\n  context:\n    cluster: k\n    user: u\n"
    )
    for path in (token_cfg, cert_cfg):
        a, b = _official(path), _light(path)
        assert a.host == b.host
        assert a.auth_settings() == b.auth_settings()  # the header a request carries
        assert a.verify_ssl == b.verify_ssl
        for f in ("ssl_ca_cert", "cert_file", "key_file"):
            assert _read(getattr(a, f)) == _read(getattr(b, f)), f


def test_other_kubeconfigs_go_to_the_official_loader(tmp_path):
    from agent.kube.client import client_layer

    exec_cfg = plain_kubeconfig(tmp_path / "exec.kc")
    exec_cfg.write_text(
        exec_cfg.read_text().replace("    token: abc123\n", "    exec:\n      apiVersion: v1\n      command: x\n")
    )
    broken = tmp_path / "broken.kc"
    broken.write_text("current-context: [unclosed\n")
    for path in (exec_cfg, broken, tmp_path / "absent.kc"):
        cfg = client_layer().configuration()
        assert not simple_kubeconfig(str(path), cfg)
        assert cfg.host == client_layer().configuration().host, "left untouched"


def test_a_pci_scan_of_200_functions_reads_each_once_then_only_the_gpus_drivers(tmp_path, monkeypatch):
    """The PCI scan's cost as the files it touches, counted at the system calls (os.scandir, os.open, os.stat,
    os.readlink) under the simulated sysfs: a scan from nothing reads each function's vendor once, the class of
    NVIDIA functions only, and for each GPU its device id, its `physfn` link and its driver; a scan that keeps its
    scanner (the agent's every cycle) lists the directory and reads the GPUs' drivers, nothing else. The time a
    scan takes is measured by bench/footprint.py (pci_scan_*_ms), not asserted here."""
    from agent.probes.pci import PciScanner

    host = SimHost(tmp_path / "host", gpus=8, pcie_bridges=True)
    n = len(os.listdir(host.devices))
    filler = 0
    while n < 200:  # other vendors' functions (bridges, NICs) on another PCI domain
        host.add_pci_function(PciAddress(1, 0x10 + filler // 8, filler % 8), 0, 0x060400, 0x1234, vendor=0x8086)
        filler, n = filler + 1, n + 1
    nvidia = sum((host.devices / f / "vendor").read_text().strip() == "0x10de" for f in os.listdir(host.devices))
    root = str(host.sysfs)
    calls: Counter[str] = Counter()

    def counting(name: str) -> Callable[..., Any]:
        real = getattr(os, name)

        def call(path: Any, *a: Any, **kw: Any) -> Any:
            if os.fspath(path).startswith(root):
                calls[name] += 1
            return real(path, *a, **kw)

        return call

    for name in ("scandir", "open", "stat", "readlink", "listdir"):
        monkeypatch.setattr(os, name, counting(name))
    gpus = list_pci_gpus(root)
    assert [g.address for g in gpus] == sorted(g.address for g in host.gpus)
    assert all(g.driver == "nvidia" for g in gpus)
    assert calls == {"scandir": 1, "open": n + nvidia + 8, "stat": 8, "readlink": 8}, (n, nvidia, calls)
    scanner = PciScanner(root)
    first = scanner.scan()
    calls.clear()
    for _ in range(30):
        assert scanner.scan() == first
    assert calls == {"scandir": 30, "readlink": 30 * 8}, calls  # 9 system calls a scan, not ~420


def _switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                total += sum(int(line.split()[1]) for line in fh if "ctxt_switches" in line)
        except OSError:
            pass  # a thread that ended
    return total


@pytest.mark.apiserver
def test_an_idle_agent_does_not_wake_up(admin, agent_factory):
    """Between polls nothing wakes the agent: its threads block on the kernel log, the watch socket, the HTTP
    listener and the signal pipe (before: five timed wake-ups a second, 0.54 millicores)."""
    a = agent_factory(extra={"--poll-interval": "300", "--heartbeat-interval": "300"})
    a.wait_status(admin, "True")
    pid = a.proc.pid
    from testkit.harness import wait_for

    def quiet_for(seconds: float, allowed: int) -> Callable[[], bool]:
        """True once `seconds` have passed with at most `allowed` context switches of the agent: each burst
        (the first cycle's follow-up Events, a watch bookmark from the apiserver) starts the span over."""
        span = {"n": _switches(pid), "t": time.monotonic()}

        def check() -> bool:
            n, now = _switches(pid), time.monotonic()
            if n - span["n"] > allowed:
                span["n"], span["t"] = n, now
            return now - span["t"] >= seconds

        return check

    # A timed wake-up every 0.5 or 1 s would make 5 to 25 switches in any 5 s and never let this hold; room for
    # 3 (a watch bookmark). The span is waited for, within a bound, not slept through.
    wait_for(quiet_for(5.0, 3), 120, 0.25, "5 s in which the idle agent switches at most 3 times")
    assert a.terminate(timeout=5) == 0  # SIGTERM still ends it (exit 0; not ended within 5 s: SIGKILL, -9)


INCLUSTER = r"""
import json, sys
from agent.lazy import import_light, is_deferred
import agent.kube.client as k
ic = import_light("kubernetes.config.incluster_config")
ic.SERVICE_TOKEN_FILENAME, ic.SERVICE_CERT_FILENAME = sys.argv[1], sys.argv[2]  # a Pod's mounted files
api = k.KubeApi.from_environment(None, 5.0)
ns = api.request("GET", "/api/v1/namespaces/default")
print(json.dumps({"name": ns["metadata"]["name"], "light": k.client_layer().light,
                  "config_deferred": is_deferred("kubernetes.config"), "host": api.configuration.host,
                  "loaded": sorted(m for m in ("kubernetes.config.kube_config", "yaml", "kubernetes.client.models",
                                               "kubernetes.config") if m in sys.modules)}))
"""


@pytest.mark.apiserver
def test_in_cluster_the_agent_reads_no_kubeconfig_loader(control_plane, tmp_path):
    """The service-account path as in a Pod (token and CA files, KUBERNETES_SERVICE_* variables): the light
    client, no kubeconfig loader, no yaml, no generated models."""
    cp = control_plane
    host, port = cp.host.removeprefix("https://").rsplit(":", 1)
    (tmp_path / "token").write_text(cp.admin_token)
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    r = run_py(INCLUSTER, str(tmp_path / "token"), cp.ca_file, env=env)
    assert r["name"] == "default" and r["light"] is True and r["host"] == cp.host
    assert r["loaded"] == ["kubernetes.config"] and r["config_deferred"], "the config package's __init__ never ran"


def test_status_gauge_keeps_one_series_at_1_while_writing_only_what_changes():
    """gpu_ready_status: every status x reason series exists, exactly the verdict's at 1, across changes; a poll
    whose verdict did not change touches no series (before: all 3 x len(Reason) of them every poll)."""
    from agent.model import Reason, Status, Verdict
    from agent.report.metrics import Metrics

    m = Metrics()

    def shown() -> dict[tuple[str, str], float]:
        return {
            (s.labels["status"], s.labels["reason"]): s.value
            for fam in m.registry.collect()
            if fam.name == "gpu_ready_status"
            for s in fam.samples
        }

    touched = 0
    labels = m.status.labels

    def counting_labels(*values: str) -> Any:
        nonlocal touched
        touched += 1
        return labels(*values)

    m.status.labels = counting_labels  # type: ignore[method-assign]
    ok = Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "8 GPUs healthy")
    bad = Verdict(Status.FALSE, Reason.FATAL_XID, "Xid 79")
    expected_touches = [len(Status) * len(Reason) + 1, 0, 2, 0, 2]
    for v, expected in zip((ok, ok, bad, bad, ok), expected_touches, strict=True):
        before = touched
        m.publish(v, 0)
        assert touched - before == expected
        series = shown()
        assert len(series) == len(Status) * len(Reason)
        assert [k for k, x in series.items() if x == 1] == [(v.status.value, v.reason.value)]


def test_benchmark_cpu_clock_counts_every_thread_in_nanoseconds():
    """bench.common.process_cpu_seconds (the benchmarks' CPU figure): the whole process, a thread that already
    exited included, to the nanosecond; psutil's /proc figure agrees to its 10 ms ticks."""
    import psutil

    from bench.common import process_cpu_seconds

    burn = "import sys, threading\nt = threading.Thread(target=lambda: sum(range(3_000_000)))\nt.start(); t.join()\n"
    child = subprocess.Popen(
        [sys.executable, "-c", burn + "print('done', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"done\n"  # the burning thread has exited
        precise = process_cpu_seconds(child.pid)
        ticks = sum(psutil.Process(child.pid).cpu_times()[:2])
        assert precise is not None and precise > 0.02 and abs(precise - ticks) < 0.03, (precise, ticks)
        assert precise != round(precise, 2)  # finer than a tick
    finally:
        child.kill()
        child.wait()
    assert process_cpu_seconds(child.pid) is None  # gone: no figure, not 0
