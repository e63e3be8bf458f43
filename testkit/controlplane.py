"""A real kube-apiserver + etcd on free loopback ports, for tests and `make demo`.

Binaries come from tools/k8s-testbin/build.sh (cached under ~/.cache/gpu-ready-testbin). Flags follow
controller-runtime's envtest: RBAC (and Node) authorization, a static admin token, service-account
token signing so that TokenRequest works without a controller-manager.

On demand (`start_scheduler`, `start_controller_manager`) the real kube-scheduler and a
kube-controller-manager running only the controllers a test names (by default those NoExecute taint
eviction needs; never the node lifecycle controller, which would taint every kubelet-less Node
unreachable). Both use a kubeconfig with the admin token, no leader election, and log to files
in the work directory that are kept for failure output (`log_tail(component)`)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.kube.client import ApiError, KubeApi

REPO = Path(__file__).resolve().parents[1]


def k8s_version() -> str:
    """The Kubernetes version the test control plane is built at (tools/k8s-testbin/versions.env)."""
    text = (REPO / "tools" / "k8s-testbin" / "versions.env").read_text()
    return next(ln.split("=", 1)[1].strip().strip('"') for ln in text.splitlines() if ln.startswith("K8S_VERSION="))


def testbin_dir() -> Path | None:
    env = os.environ.get("GPU_READY_TESTBIN_DIR")
    if env:
        return Path(env)
    versions = REPO / "tools" / "k8s-testbin" / "versions.env"
    gomod = REPO / "tools" / "k8s-testbin" / "go.mod"
    if not versions.exists():
        return None
    vals = dict(
        line.split("=", 1) for line in versions.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    k8s, helm = vals["K8S_VERSION"].strip('"'), vals["HELM_VERSION"].strip('"')
    etcd = next(
        ln.split()[1] for ln in gomod.read_text().splitlines() if ln.strip().startswith("go.etcd.io/etcd/server/v3 v")
    )
    root = Path(
        os.environ.get("GPU_READY_TESTBIN")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpu-ready-testbin"
    )
    return root / f"k8s-{k8s}-etcd-{etcd}-helm-{helm}"


# NoExecute taint eviction. In 1.36 the taint-eviction controller looks pods up by a spec.nodeName index on the
# shared pod informer that it does not add itself ("Index with name spec.nodeName does not exist"); the node
# lifecycle and DaemonSet controllers add it. The node lifecycle controller would taint every kubelet-less
# Node unreachable, so the DaemonSet controller (idle: the tests create no DaemonSets) supplies the index.
EVICTION_CONTROLLERS = ("taint-eviction-controller", "daemonset-controller")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ControlPlane:
    def __init__(self, bin_dir: Path | None = None, workdir: str | None = None) -> None:
        found = bin_dir or testbin_dir()
        if found is None or not (found / "kube-apiserver").exists():
            raise FileNotFoundError(f"kube-apiserver not found in {found}; run tools/k8s-testbin/build.sh")
        self.bin_dir: Path = found
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gpu-ready-cp-"))
        self.admin_token = secrets.token_hex(16)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.host = ""
        self.ca_file = str(self.workdir / "certs" / "apiserver.crt")
        self.apiserver_log = self.workdir / "kube-apiserver.log"
        self.etcd_log = self.workdir / "etcd.log"
        self.start_seconds = 0.0
        self.port = 0
        self._etcd_args: list[str] = []
        self._api_args: list[str] = []
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.controller_manager: subprocess.Popen[bytes] | None = None
        self.component_ports: dict[str, int] = {}
        self.component_start_seconds: dict[str, float] = {}
        # more flags per component ("kube-apiserver", "kube-scheduler", "kube-controller-manager"), e.g. feature
        # gates and --runtime-config for a beta API; set before start() / start_scheduler() / ...
        self.extra_args: dict[str, list[str]] = {}

    def start(self, timeout_s: float = 90.0) -> ControlPlane:
        t0 = time.monotonic()
        w = self.workdir
        (w / "certs").mkdir(parents=True, exist_ok=True)
        sa_key = w / "sa.key"
        if not sa_key.exists():
            subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
        (w / "tokens.csv").write_text(f"{self.admin_token},admin,admin-uid,system:masters\n")
        ep, pp, self.port = free_port(), free_port(), free_port()
        self.host = f"https://127.0.0.1:{self.port}"
        self._etcd_args = [
            str(self.bin_dir / "etcd"),
            f"--data-dir={w / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{ep}",
            f"--advertise-client-urls=http://127.0.0.1:{ep}",
            f"--listen-peer-urls=http://127.0.0.1:{pp}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{pp}",
            f"--initial-cluster=default=http://127.0.0.1:{pp}",
            "--unsafe-no-fsync",
            "--log-level=warn",
            "--quota-backend-bytes=1073741824",
        ]
        self._api_args = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ep}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # 1.37 refuses a loopback advertise address with the lease endpoint reconciler ("cannot use public
            # IP 127.0.0.1 with endpoint reconciler"); nothing here needs the kubernetes Service's endpoints.
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.port}",
            f"--cert-dir={w / 'certs'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--authorization-mode=Node,RBAC",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--disable-admission-plugins=ServiceAccount",
            "--enable-priority-and-fairness=false",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]
        self._api_args += self.extra_args.get("kube-apiserver", [])
        self._spawn_etcd()
        self._spawn_apiserver()
        self.wait_ready(timeout_s)
        self.start_seconds = time.monotonic() - t0
        return self

    def _spawn(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        fh = open(log, "ab")  # noqa: SIM115 - owned by the child
        p = subprocess.Popen(
            args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        fh.close()
        self.procs.append(p)
        return p

    def _spawn_etcd(self) -> None:
        self.etcd = self._spawn(self._etcd_args, self.etcd_log)

    def _spawn_apiserver(self) -> None:
        self.apiserver = self._spawn(self._api_args, self.apiserver_log)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        api = self.admin()
        last = ""
        try:
            while time.monotonic() < deadline:
                if self.apiserver.poll() is not None:
                    raise RuntimeError(f"kube-apiserver exited with {self.apiserver.returncode}:\n{self.log_tail()}")
                try:
                    api.request("GET", "/readyz", timeout_s=2)
                    return
                except ApiError as e:
                    last = str(e)
                time.sleep(0.25)
        finally:
            api.close()
        raise TimeoutError(f"kube-apiserver not ready after {timeout_s}s ({last}):\n{self.log_tail()}")

    def admin(self, **kw: Any) -> KubeApi:
        return KubeApi.from_token(self.host, self.admin_token, self.ca_file, **kw)

    def kubeconfig(self, path: Path, token: str | None = None, user: str = "admin") -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
            f"clusters:\n- name: t\n  cluster:\n    server: {self.host}\n    certificate-authority: {self.ca_file}\n"
            f"users:\n- name: {user}\n  user:\n    token: {token or self.admin_token}\n"
            f"contexts:\n- name: t\n  context:\n    cluster: t\n    user: {user}\n"
        )
        return path

    # -- kube-scheduler and kube-controller-manager, on demand ------------------------------------------

    def _component_binary(self, name: str) -> Path:
        path = self.bin_dir / name
        if not path.exists():
            raise FileNotFoundError(f"{name} not found in {self.bin_dir}; run tools/k8s-testbin/build.sh")
        return path

    def _component_args(self, name: str) -> list[str]:
        """Flags both components share: the admin kubeconfig for the API, for delegated authn/authz of
        their own /healthz, and a secure port on loopback with a self-signed cert in the work directory."""
        kc = self.kubeconfig(self.workdir / f"{name}.kubeconfig")
        port = self.component_ports[name] = free_port()
        return [
            str(self._component_binary(name)),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--authentication-skip-lookup=true",  # no client-CA configmap in this control plane
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'certs' / name}",
            "--v=2",
            *self.extra_args.get(name, []),
        ]

    def start_scheduler(self, timeout_s: float = 90.0) -> None:
        """Starts the real kube-scheduler (default profile) and waits until its /readyz says its informers
        are synced. A no-op while one is running."""
        if self.scheduler is not None and self.scheduler.poll() is None:
            return
        t0 = time.monotonic()
        args = self._component_args("kube-scheduler")
        self.scheduler = self._spawn(args, self.component_log("kube-scheduler"))
        self._wait_component("kube-scheduler", self.scheduler, "/readyz", timeout_s)
        self.component_start_seconds["kube-scheduler"] = time.monotonic() - t0

    def start_controller_manager(
        self, controllers: tuple[str, ...] = EVICTION_CONTROLLERS, timeout_s: float = 90.0
    ) -> None:
        """Starts kube-controller-manager with only `controllers` (names as in 1.36's
        cmd/kube-controller-manager/names) and waits until /healthz lists each of them as ok. A no-op
        while one is running."""
        if self.controller_manager is not None and self.controller_manager.poll() is None:
            return
        t0 = time.monotonic()
        args = [
            *self._component_args("kube-controller-manager"),
            f"--controllers={','.join(controllers)}",
            "--use-service-account-credentials=false",
        ]
        self.controller_manager = self._spawn(args, self.component_log("kube-controller-manager"))
        expect = [f"[+]{c} ok" for c in controllers]  # each started controller adds a named check
        self._wait_component("kube-controller-manager", self.controller_manager, "/healthz?verbose", timeout_s, expect)
        self.component_start_seconds["kube-controller-manager"] = time.monotonic() - t0

    def component_log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _wait_component(
        self, name: str, proc: subprocess.Popen[bytes], path: str, timeout_s: float, expect: list[str] | None = None
    ) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the component's serving cert is self-signed
        url = f"https://127.0.0.1:{self.component_ports[name]}{path}"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.admin_token}"})
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(component=name)}")
            try:
                with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                    body = resp.read(65536).decode(errors="replace")
                    missing = [e for e in expect or [] if e not in body]
                    if resp.status == 200 and not missing:
                        return
                    last = f"HTTP {resp.status}, missing {missing}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.25)
        raise TimeoutError(f"{name} {path} not ok after {timeout_s}s ({last}):\n{self.log_tail(component=name)}")

    def stop_apiserver(self) -> None:
        terminate_group(self.apiserver)

    def restart_apiserver(self, timeout_s: float = 60.0) -> None:
        self._spawn_apiserver()
        self.wait_ready(timeout_s)

    def log_tail(self, lines: int = 60, component: str = "kube-apiserver") -> str:
        log = self.apiserver_log if component == "kube-apiserver" else self.component_log(component)
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no {component} log)"

    def stop(self) -> None:
        for p in reversed(self.procs):
            terminate_group(p)
        self.procs.clear()
        self.scheduler = self.controller_manager = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def terminate_group(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group of a child started with start_new_session, SIGKILL after 10 s."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def etcd_request(cp: ControlPlane, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A request to etcd's JSON gateway (v3) on the control plane's own etcd (e.g. /v3/kv/put, /v3/kv/compaction)."""
    url = next(a.split("=", 1)[1] for a in cp._etcd_args if a.startswith("--listen-client-urls=")).split(",")[0]
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out
