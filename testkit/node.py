"""A real Kubernetes node on this machine, for the tests that run the chart's pods: containerd 2.x + kubelet,
registered with a test control plane, with the agent image and a sandbox (pause) image loaded into containerd.

Everything the node changes on the host is recorded first and restored by `stop()`, also after a failed test:
the sysctls kubelet sets (kernel.panic, vm.overcommit_memory, ...), iptables chains, the cgroups (all under one
cgroup root of its own in every hierarchy), mounts (all under the work directory), the bridge that holds the node
address, and the directories the components create outside the work directory.

Network rule: nothing here talks to an address outside loopback. kubelet refuses a loopback node IP, so the node
gets an address from the benchmarking range (198.18.0.0/15) on a bridge that nothing is attached to; kubelet itself
listens on 127.0.0.1 only; pods run with hostNetwork and reach the apiserver at 127.0.0.1 (explicit
KUBERNETES_SERVICE_HOST/PORT), so the node needs no CNI network, kube-proxy or DNS.

Measured needs on this kind of machine (cgroup v1 hybrid, no CAP_SYS_RESOURCE):
kubelet `failCgroupV1: false`, `cgroupDriver: cgroupfs`, `failSwapOn: false`; containerd
`restrict_oom_score_adj = true` and runc (not crun)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from agent.kube.client import ApiError
from testkit.controlplane import REPO, ControlPlane, free_port, terminate_group, testbin_dir
from testkit.harness import wait_for

CONTAINERD_BUILD = REPO / "tools" / "containerd" / "build.sh"
NODE_IMAGE_BUILD = REPO / "tools" / "node-image" / "build.sh"
# The controllers a node's workloads need: DaemonSet, Job and Deployment pods, the cluster CA in every namespace (the
# projected kube-api-access volume), `default` ServiceAccounts, and cascading deletion (helm uninstall).
NODE_CONTROLLERS = (
    "daemonset-controller",
    "job-controller",
    # gpu-ready controller's Deployment (preflight.auto): its ReplicaSet and then its pods
    "deployment-controller",
    "replicaset-controller",
    "root-ca-certificate-publisher-controller",
    "serviceaccount-controller",
    "garbage-collector-controller",
    # Removes the node.kubernetes.io/not-ready:NoSchedule taint the apiserver puts on every new Node once the
    # kubelet reports Ready (without it no DaemonSet pod is ever placed).
    "node-lifecycle-controller",
)
# sysctls kubelet (and CNI plugins) may set; recorded before the node starts and written back after.
SYSCTLS = (
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
)
# Host paths containerd/kubelet/CNI create by default even when pointed elsewhere; removed if they were absent.
DEFAULT_HOST_PATHS = (
    "/run/containerd",
    "/var/lib/containerd",
    "/opt/containerd",
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/cni",
    "/run/nri",
    "/var/run/nri",
    "/etc/cni",
    "/etc/kubernetes",
    "/run/runc",
)
CGROUP_MOUNTS = Path("/sys/fs/cgroup")


HOST_LOCK = "/run/gpu-ready-realnode.lock"
# kubelet's device-manager checkpoint: next to pluginapi.KubeletSocket, whatever --root-dir is
DEVICE_MANAGER_CHECKPOINT = Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
HOST_LOCK_WAIT_S = 2400.0  # another run's real-node module takes minutes
_HOLDERS: set[str] = set()  # the nodes of this process that hold the lock


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def run(args: list[str], timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} exited with {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
    return r


# -- builds ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeImages:
    agent: str
    agent_tar: Path
    pause: str
    pause_tar: Path


def build_images(timeout: float = 1800.0) -> NodeImages:
    """tools/node-image/build.sh: the agent image from docker/Dockerfile on a locally made Debian base, and the
    pause image, as archives (cached by the hash of their inputs)."""
    r = run(["bash", str(NODE_IMAGE_BUILD)], timeout=timeout)
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return NodeImages(
        out["AGENT_IMAGE"], Path(out["AGENT_IMAGE_TAR"]), out["PAUSE_IMAGE"], Path(out["PAUSE_IMAGE_TAR"])
    )


def build_containerd(timeout: float = 1800.0) -> Path:
    return Path(run(["bash", str(CONTAINERD_BUILD)], timeout=timeout).stdout.strip().splitlines()[-1])


def kubelet_binary() -> Path | None:
    """kubelet from the test control plane's bin directory (tools/k8s-testbin builds it with the apiserver)."""
    env = os.environ.get("GPU_READY_KUBELET")
    if env:
        return Path(env)
    bd = testbin_dir()
    return bd / "kubelet" if bd is not None else None


def missing_tools() -> list[str]:
    """Host tools the node needs (Debian packages; .ci/run installs them)."""
    need = {"runc": "runc", "podman": "podman", "mmdebstrap": "mmdebstrap", "iptables": "iptables", "ip": "iproute2"}
    return [pkg for cmd, pkg in need.items() if shutil.which(cmd) is None]


# -- the control plane a node needs -------------------------------------------------------------------------


class NodeControlPlane(ControlPlane):
    """The test control plane plus what a real kubelet and its pods need: the ServiceAccount admission plugin
    (which gives each pod the projected kube-api-access token volume) and NodeRestriction, a kubelet identity
    (`system:node:<name>` in group `system:nodes`, a static token) so that the Node authorizer and
    NodeRestriction treat it as in a real cluster, and kube-controller-manager publishing the cluster CA
    (`--root-ca-file`, the apiserver's serving certificate) as the kube-root-ca.crt ConfigMap."""

    def __init__(self, node_name: str, bin_dir: Path | None = None, workdir: str | None = None) -> None:
        super().__init__(bin_dir, workdir)
        self.node_name = node_name
        self.kubelet_token = secrets.token_hex(16)

    def _spawn_apiserver(self) -> None:
        tokens = self.workdir / "tokens.csv"
        line = f"{self.kubelet_token},system:node:{self.node_name},node-{self.node_name},system:nodes\n"
        if line not in tokens.read_text():
            with open(tokens, "a") as fh:
                fh.write(line)
        args = [a for a in self._api_args if not a.startswith("--disable-admission-plugins=")]
        if not any(a.startswith("--enable-admission-plugins=") for a in args):
            args.append("--enable-admission-plugins=NodeRestriction")
        self._api_args = args
        super()._spawn_apiserver()

    def _component_args(self, name: str) -> list[str]:
        args = super()._component_args(name)
        if name == "kube-controller-manager":
            args.append(f"--root-ca-file={self.ca_file}")
        return args


# -- host changes -------------------------------------------------------------------------------------------


def _iptables_chains(binary: str) -> dict[str, set[str]]:
    if shutil.which(binary) is None:
        return {}
    r = run([f"{binary}-save"], check=False)
    chains: dict[str, set[str]] = {}
    table = ""
    for line in r.stdout.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
            chains.setdefault(table, set())
        elif line.startswith(":") and table:
            chains[table].add(line[1:].split()[0])
    return chains


def _cgroup_hierarchies() -> list[Path]:
    """Every cgroup v1 hierarchy mounted under /sys/fs/cgroup (the unified v2 one of a hybrid host too)."""
    out: list[Path] = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            parts = line.split(" - ", 1)
            if len(parts) != 2:
                continue
            fstype = parts[1].split()[0]
            mnt = Path(parts[0].split()[4].replace("\\040", " "))
            if fstype in ("cgroup", "cgroup2") and mnt.parent == CGROUP_MOUNTS:
                out.append(mnt)
    if not out and (CGROUP_MOUNTS / "cgroup.controllers").exists():
        out.append(CGROUP_MOUNTS)  # pure cgroup v2
    return out


def _mounts_under(root: Path) -> list[str]:
    found = []
    prefix = str(root).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mnt = line.split()[4].replace("\\040", " ")
            if mnt.startswith(prefix) or mnt == str(root):
                found.append(mnt)
    return found


@dataclass
class HostRecord:
    """What the node may change on the host, captured before it starts; `restore()` puts it back and says what
    it undid."""

    sysctls: dict[str, str] = field(default_factory=dict)
    iptables: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    absent_paths: list[str] = field(default_factory=list)
    links: set[str] = field(default_factory=set)

    @classmethod
    def capture(cls) -> HostRecord:
        rec = cls()
        for name in SYSCTLS:
            p = Path("/proc/sys") / name
            with contextlib.suppress(OSError):
                rec.sysctls[name] = p.read_text().strip()
        for binary in ("iptables", "ip6tables"):
            rec.iptables[binary] = _iptables_chains(binary)
        rec.absent_paths = [p for p in DEFAULT_HOST_PATHS if not os.path.lexists(p)]
        rec.links = set(os.listdir("/sys/class/net"))
        return rec

    def restore(self) -> list[str]:
        undone: list[str] = []
        for name, value in self.sysctls.items():
            p = Path("/proc/sys") / name
            with contextlib.suppress(OSError):
                if p.read_text().strip() != value:
                    p.write_text(value + "\n")
                    undone.append(f"sysctl {name.replace('/', '.')}={value}")
        for binary, before in self.iptables.items():
            undone += _restore_iptables(binary, before)
        for path in self.absent_paths:
            if os.path.lexists(path):
                for mnt in sorted(_mounts_under(Path(path)), key=len, reverse=True):
                    run(["umount", "-l", mnt], check=False)
                shutil.rmtree(path, ignore_errors=True)
                undone.append(f"removed {path}")
        for link in sorted(set(os.listdir("/sys/class/net")) - self.links):
            # Only links that the node's components make: the test's own bridge is removed by its owner.
            if link.startswith(("cni", "veth")):
                run(["ip", "link", "del", link], check=False)
                undone.append(f"link {link}")
        return undone


def _restore_iptables(binary: str, before: dict[str, set[str]]) -> list[str]:
    """Deletes the chains created since `before` (KUBE-FIREWALL, KUBE-KUBELET-CANARY, CNI-...) and the rules
    that jump to them; chains and rules that were there stay untouched."""
    if shutil.which(binary) is None:
        return []
    undone = []
    now = _iptables_chains(binary)
    for table, chains in now.items():
        new = chains - before.get(table, set())
        if not new:
            continue
        dump = run([f"{binary}-save", "-t", table], check=False).stdout
        for line in dump.splitlines():
            if line.startswith("-A "):
                words = shlex.split(line)
                if any(w in new for w in words[2:]) and words[1] not in new:
                    run([binary, "-t", table, "-D", *words[1:]], check=False)
        for chain in new:
            run([binary, "-t", table, "-F", chain], check=False)
        for chain in new:
            run([binary, "-t", table, "-X", chain], check=False)
            undone.append(f"{binary} -t {table} -X {chain}")
    return undone


# -- the node -----------------------------------------------------------------------------------------------


class RealNode:
    """containerd + kubelet for Node `name`, registered with `cp` (a NodeControlPlane, started)."""

    def __init__(
        self,
        cp: NodeControlPlane,
        kubelet: Path,
        containerd_bin: Path,
        workdir: Path | None = None,
        labels: dict[str, str] | None = None,
        runtime_handlers: tuple[str, ...] = ("runc", "nvidia"),
        pause_image: str = "localhost/pause:local",
    ) -> None:
        self.cp = cp
        self.name = cp.node_name
        self.kubelet_bin = kubelet
        self.containerd_bin = containerd_bin
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gpu-ready-node-"))
        self.labels = labels or {}
        self.runtime_handlers = runtime_handlers
        self.pause_image = pause_image  # containerd's sandbox image (load it with load_image)
        tag = secrets.token_hex(3)
        self.cgroup_root = f"/gpu-ready-node-{tag}"
        self.bridge = f"gprnode{tag}"
        self.cni_bridge = f"gprcni{tag}"  # made by the CNI bridge plugin for the first pod without hostNetwork
        self.pod_subnet = f"198.19.{secrets.randbelow(250) + 1}.0/24"
        self.node_ip = f"198.18.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 2}"
        self.sock = self.workdir / "containerd" / "containerd.sock"
        self.pod_logs = self.workdir / "pod-logs"
        self.kubelet_root = self.workdir / "kubelet"
        self.host: HostRecord | None = None
        self.containerd: subprocess.Popen[bytes] | None = None
        self.kubelet: subprocess.Popen[bytes] | None = None
        self.kubelet_args: list[str] = []  # the command line of the running kubelet (restart_kubelet reuses it)
        self.start_seconds: dict[str, float] = {}
        self.undone: list[str] = []
        self._made_cgroups: list[Path] = []
        self._bridge_made = False
        self._lock_fd: int | None = None

    # -- start ------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 180.0) -> RealNode:
        self._lock_host()
        t0 = time.monotonic()
        self.host = HostRecord.capture()
        with contextlib.ExitStack() as on_failure:  # what was made is undone unless the node came up
            on_failure.callback(self.stop)
            self._make_bridge()
            self._make_cgroup_root()
            self._start_containerd(timeout_s)
            self.start_seconds["containerd"] = time.monotonic() - t0
            self._start_kubelet(timeout_s)
            self.start_seconds["node"] = time.monotonic() - t0
            on_failure.pop_all()
        return self

    def _make_bridge(self) -> None:
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._bridge_made = True
        run(["ip", "addr", "add", f"{self.node_ip}/32", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])

    def _make_cgroup_root(self) -> None:
        for h in _cgroup_hierarchies():
            d = h / self.cgroup_root.lstrip("/")
            d.mkdir(exist_ok=True)
            self._made_cgroups.append(d)
            for f in ("cpuset.cpus", "cpuset.mems"):  # a new v1 cpuset cgroup starts empty: inherit
                if (h / f).exists():
                    (d / f).write_text((h / f).read_text())

    def containerd_config(self) -> str:
        w = self.workdir / "containerd"
        runtimes = ""
        for handler in self.runtime_handlers:
            runtimes += f"""
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}]
  runtime_type = 'io.containerd.runc.v2'
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}.options]
  BinaryName = '{shutil.which("runc") or "runc"}'
  Root = '{w / "runc"}'
  SystemdCgroup = false
"""
        return f"""version = 4
root = '{w / "root"}'
state = '{w / "state"}'
imports = []
disabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.internal.v1.tracing']

[plugins.'io.containerd.server.v1.grpc']
  address = '{self.sock}'
[plugins.'io.containerd.server.v1.ttrpc']
  address = '{self.sock}.ttrpc'
[plugins.'io.containerd.server.v1.debug']
  address = ''
[plugins.'io.containerd.server.v1.metrics']
  address = ''
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = '{w / "s"}'
[plugins.'io.containerd.internal.v1.opt']
  path = '{w / "opt"}'
[plugins.'io.containerd.image-verifier.v1.bindir']
  bin_dir = '{w / "opt" / "image-verifier"}'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{self.pause_image}'

[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE here: runc cannot set a negative oom_score_adj (every sandbox fails without this).
  restrict_oom_score_adj = true
  cdi_spec_dirs = []
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['/usr/lib/cni']
  conf_dir = '{w / "cni"}'
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
{runtimes}
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
"""

    def cni_config(self) -> str:
        """The pod network: a bridge nothing else is attached to, no gateway, no masquerading, so a pod without
        hostNetwork can reach only other pods. Its presence alone makes the runtime report NetworkReady (and so
        the Node Ready); hostNetwork pods never use it."""
        net = {
            "cniVersion": "1.0.0",
            "name": f"gpu-ready-test-{self.cni_bridge}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.cni_bridge,
                    "isGateway": False,
                    "ipMasq": False,
                    "hairpinMode": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_subnet}]],
                        "dataDir": str(self.workdir / "cni-ipam"),
                    },
                },
                {"type": "loopback"},
            ],
        }
        return json.dumps(net, indent=2)

    def _start_containerd(self, timeout_s: float) -> None:
        w = self.workdir / "containerd"
        (w / "cni").mkdir(parents=True, exist_ok=True)
        (w / "cni" / "10-gpu-ready-test.conflist").write_text(self.cni_config())
        cfg = w / "config.toml"
        cfg.write_text(self.containerd_config())
        env = {**os.environ, "PATH": f"{self.containerd_bin}:{os.environ.get('PATH', '')}"}
        log = open(self.workdir / "containerd.log", "ab")  # noqa: SIM115 - owned by the child
        self.containerd = subprocess.Popen(
            [str(self.containerd_bin / "containerd"), "--config", str(cfg), "--log-level", "info"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        log.close()

        def up() -> bool:
            if self.containerd is not None and self.containerd.poll() is not None:
                raise RuntimeError(f"containerd exited:\n{self.log_tail('containerd')}")
            return self.ctr("version", check=False).returncode == 0

        wait_for(up, timeout_s, 0.2, "containerd")

    def ctr(self, *args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return run(
            [str(self.containerd_bin / "ctr"), "--address", str(self.sock), "--namespace", "k8s.io", *args],
            timeout=timeout,
            check=check,
        )

    def load_image(self, tar: Path, name: str) -> float:
        """Imports an image archive into containerd's k8s.io namespace (what kubelet sees), pinned so that
        image garbage collection never removes it. Returns seconds taken."""
        t0 = time.monotonic()
        if self.ctr("images", "check", f"name=={name}", check=False).stdout.count(name) == 0:
            self.ctr("images", "import", str(tar))
            self.ctr("images", "label", name, "io.cri-containerd.pinned=pinned", check=False)
        return time.monotonic() - t0

    def kubelet_config(self) -> str:
        return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://{self.sock}
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {self.cgroup_root}
failSwapOn: false
address: 127.0.0.1
port: {free_port()}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {free_port()}
podLogsDir: {self.pod_logs}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
authorization:
  mode: AlwaysAllow
makeIPTablesUtilChains: false
registerNode: true
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 1Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 10s
resolvConf: /etc/resolv.conf
"""

    def _start_kubelet(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        # The device manager keeps its checkpoint beside its fixed registration socket, outside --root-dir, so an
        # earlier node on this host leaves its resources there. A kubelet that starts with a checkpoint naming
        # nvidia.com/gpu reports that resource's capacity as 0 for five minutes (its stopped-endpoint grace), which
        # overwrites what a test advertises: a new node starts without one, as a freshly installed host does.
        # (restart_kubelet keeps it: a restarted kubelet restores its allocations from it.)
        DEVICE_MANAGER_CHECKPOINT.unlink(missing_ok=True)
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        self.pod_logs.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "kubelet.yaml"
        cfg.write_text(self.kubelet_config())
        kc = self.cp.kubeconfig(self.workdir / "kubelet.kubeconfig", self.cp.kubelet_token, user=self.name)
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        args = [
            str(self.kubelet_bin),
            f"--config={cfg}",
            f"--kubeconfig={kc}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.node_ip}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}",
            "--v=2",
        ]
        if labels:
            args.append(f"--node-labels={labels}")
        self.kubelet_args = args
        log = open(self.workdir / "kubelet.log", "ab")  # noqa: SIM115 - owned by the child
        self.kubelet = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        api = self.cp.admin()
        try:

            def registered() -> bool:
                if self.kubelet is not None and self.kubelet.poll() is not None:
                    raise RuntimeError(f"kubelet exited:\n{self.log_tail('kubelet')}")
                try:
                    api.request("GET", f"/api/v1/nodes/{self.name}")
                    return True
                except ApiError:
                    return False

            wait_for(registered, timeout_s, 0.25, f"kubelet to register Node {self.name}")
            self.start_seconds["registered"] = time.monotonic() - t0
        finally:
            api.close()

    def wait_schedulable(self, timeout_s: float = 120.0) -> None:
        """Waits until the Node is Ready and carries no not-ready taint (the node lifecycle controller removes it)."""
        api = self.cp.admin()
        try:

            def ready() -> bool:
                node = api.request("GET", f"/api/v1/nodes/{self.name}")
                conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
                taints = [t["key"] for t in node.get("spec", {}).get("taints", [])]
                return conds.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints

            try:
                wait_for(ready, timeout_s, 0.25, f"Node {self.name} Ready and untainted")
            except AssertionError as e:
                raise AssertionError(f"{e}\n{self.log_tail('kubelet')}") from None
        finally:
            api.close()

    def restart_kubelet(self, timeout_s: float = 120.0) -> float:
        """Stops the kubelet process and starts it again with the same command line, as a node upgrade or a
        crash-restart does; pods keep running in containerd. Waits until kubelet serves new device-plugin
        registration and pod-resources sockets (it re-creates both) and its healthz answers. Returns seconds."""
        assert self.kubelet is not None and self.kubelet_args, "kubelet not started"
        t0 = time.monotonic()
        # The device manager's registration socket is at a fixed path whatever --root-dir is (pluginapi.KubeletSocket);
        # pod-resources is under the root directory.
        socks = [
            Path("/var/lib/kubelet/device-plugins/kubelet.sock"),
            self.kubelet_root / "pod-resources" / "kubelet.sock",
        ]

        def inode(p: Path) -> tuple[int, int] | None:  # a new file may get the old inode number: ctime too
            try:
                st = p.stat()
                return st.st_ino, st.st_ctime_ns
            except OSError:
                return None

        before = [inode(p) for p in socks]
        terminate_group(self.kubelet)
        log = open(self.workdir / "kubelet.log", "ab")  # noqa: SIM115 - owned by the child
        self.kubelet = subprocess.Popen(
            self.kubelet_args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        port = re.search(r"^healthzPort: (\d+)$", (self.workdir / "kubelet.yaml").read_text(), re.M)

        def up() -> bool:
            if self.kubelet is not None and self.kubelet.poll() is not None:
                raise RuntimeError(f"kubelet exited after restart:\n{self.log_tail('kubelet')}")
            if any(inode(p) in (None, b) for p, b in zip(socks, before, strict=True)):
                return False
            if port is None:
                return True
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(up, timeout_s, 0.1, "kubelet to come back with new sockets")
        return time.monotonic() - t0

    # -- helpers ----------------------------------------------------------------------------------------

    def log_tail(self, component: str, lines: int = 60) -> str:
        try:
            return "\n".join((self.workdir / f"{component}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no {component} log)"

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        """The container's log as the runtime wrote it (all restarts, oldest first): kubelet keeps it in
        <podLogsDir>/<namespace>_<pod>_<uid>/<container>/<restart>.log (CRI log format)."""
        text = []
        for d in sorted(self.pod_logs.glob(f"{namespace}_{pod}_*/{container}")):
            for f in sorted(d.glob("*.log"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1):
                for line in f.read_text(errors="replace").splitlines():
                    parts = line.split(" ", 3)  # <time> <stream> <P|F> <text>
                    text.append(parts[3] if len(parts) == 4 else line)
        return "\n".join(text)

    def pod_processes(self) -> list[int]:
        """PIDs of every process in the node's pods (their cgroups are all under the node's cgroup root)."""
        pids: set[int] = set()
        for d in self._made_cgroups:
            if not d.exists():
                continue
            # os.walk, not Path.rglob: kubelet and runc remove cgroups while this walks (rglob raises on a
            # directory that vanished under it; os.walk skips it)
            for root, _dirs, files in os.walk(d):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError, ValueError):
                        pids.update(int(x) for x in Path(root, "cgroup.procs").read_text().split())
        return sorted(pids)

    def find_process(self, pattern: str) -> list[int]:
        """PIDs among the node's pod processes whose command line matches `pattern` (a regex)."""
        rx = re.compile(pattern)
        out = []
        for pid in self.pod_processes():
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if rx.search(cmd):
                    out.append(pid)
        return out

    def _shim_pids(self) -> list[int]:
        """containerd-shim-runc-v2 processes of this containerd (their command line names its socket)."""
        out = []
        needle = str(self.sock).encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                if b"containerd-shim" in cmd and needle in cmd:
                    out.append(int(entry))
        return out

    # -- stop -------------------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stops kubelet, the pods, containerd; restores every host change. Returns what it undid."""
        try:
            if self.kubelet is not None:
                terminate_group(self.kubelet)
                self.kubelet = None
            for _ in range(3):  # pod processes, then their shims (a shim waits for its container)
                pids = self.pod_processes()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: not self.pod_processes(), 10, 0.1, "pod processes to exit")
            for pid in self._shim_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.containerd is not None:
                terminate_group(self.containerd)
                self.containerd = None
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not self._shim_pids(), 10, 0.1, "containerd shims to exit")
            for mnt in sorted(_mounts_under(self.workdir), key=len, reverse=True):
                if run(["umount", mnt], check=False).returncode != 0:
                    run(["umount", "-l", mnt], check=False)
                self.undone.append(f"umount {mnt}")
            for d in reversed(self._made_cgroups):
                if d.exists():
                    for sub in sorted(
                        (Path(r) for r, _, _ in os.walk(d) if r != str(d)), key=lambda p: len(p.parts), reverse=True
                    ):
                        with contextlib.suppress(OSError):
                            sub.rmdir()
                    with contextlib.suppress(OSError):
                        d.rmdir()
                        self.undone.append(f"rmdir {d}")
            self._made_cgroups = [d for d in self._made_cgroups if d.exists()]
            if self.cni_bridge in os.listdir("/sys/class/net"):
                run(["ip", "link", "del", self.cni_bridge], check=False)
                self.undone.append(f"link {self.cni_bridge}")
            if self._bridge_made:
                run(["ip", "link", "del", self.bridge], check=False)
                self._bridge_made = False
                self.undone.append(f"link {self.bridge}")
            if self.host is not None:
                self.undone += self.host.restore()
                self.host = None
        finally:
            self._unlock_host()  # even when a step failed: the next real node on this host must not wait forever
        return self.undone

    # -- one real node per host -------------------------------------------------------------------------

    def _lock_host(self) -> None:
        """Waits for the host-wide lock: the host record (iptables chains, sysctls, default directories) and its
        restore assume no other real node starts or stops meanwhile (another pytest run on the same machine).
        flock: released by the kernel if this process dies."""
        if _HOLDERS:  # flock between two descriptors of one process would wait forever
            raise RuntimeError(
                f"another RealNode of this process still holds {HOST_LOCK} ({', '.join(_HOLDERS)}): stop it first"
            )
        fd = os.open(HOST_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        with contextlib.ExitStack() as on_failure:  # closed again unless the lock is held
            on_failure.callback(os.close, fd)
            wait_for(lambda: _try_flock(fd), HOST_LOCK_WAIT_S, 0.5, f"the host-wide real-node lock {HOST_LOCK}")
            on_failure.pop_all()
        self._lock_fd = fd
        _HOLDERS.add(self.name)

    def _unlock_host(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
            _HOLDERS.discard(self.name)

    def leftovers(self) -> list[str]:
        """Host changes still in place after stop() (empty when everything was restored)."""
        left = [str(d) for d in self._made_cgroups if d.exists()]
        left += _mounts_under(self.workdir)
        links = os.listdir("/sys/class/net")
        left += [f"link {b}" for b in (self.bridge, self.cni_bridge) if b in links]
        left += [f"pid {p}" for p in self._shim_pids()]
        return left

    def cleanup_workdir(self) -> None:
        if not _mounts_under(self.workdir):
            shutil.rmtree(self.workdir, ignore_errors=True)
