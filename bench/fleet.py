"""The fleet benchmark: what gpu-ready costs the apiserver and etcd per node, beside kubelet.

One process drives many agent identities against the real apiserver. Each identity has its own Node
(shaped like a GPU node: 50 images in status.images, GPU feature-discovery labels), its own client
(agent.kube.client.KubeApi, the agent's client) and the agent's request pattern made by the agent's own
code: agent.kube.node_cache.NodeCache for the Node, agent.kube.slice_cache.SliceCache for its DRA ResourceSlices (the
CheckSuite's DRA-aware count; a LIST per poll, from the apiserver's cache, where there is no watch),
agent.report.condition.ConditionReporter for the
condition heartbeat (jittered with agent.kube.backoff.heartbeat_delay), agent.report.events.EventReporter
for Events on transitions. Kubelet's pattern (a Lease renewed every 10 s, a node status GET
resourceVersion=0 + PATCH every 5 minutes, one watch on its Node) runs for the same Nodes in the same
run. The figures come from the apiserver's own /metrics: apiserver_request_total (verb, resource),
apiserver_request_body_size_bytes, apiserver_response_sizes (reads), etcd_requests_total (operation,
resource); the bytes of write answers and of watch events are counted where they arrive (the
apiserver's response-size metric covers reads only, and its watch-event metrics include the events
it sends to its own internal watchers).

Phases, one after the other, each measured between two scrapes of /metrics:
  kubelet   kubelet's pattern alone
  before    gpu-ready as it was: a GET of the Node per poll (a quorum read), a ResourceSlice LIST per poll
            (resourceVersion=0), the condition heartbeat
  after     gpu-ready with the Node and ResourceSlice watches (the poll reads the caches) and metadata-only
            answers to its status patches (KubeApi.metadata_answers), the condition heartbeat
  storm     10 % of the nodes fail within one minute (real time): condition write + Event each
Time is compressed by --compress for the steady phases (poll, heartbeat, lease and status periods and
watch lifetimes all divided by it); per-hour figures are scaled back (count x 3600 / (window x
compress)). Watch renewals are arithmetic (3600 / the mean watch lifetime): a short window opened when
every watch has just started would count almost none. The storm runs in real time. Then the figures
are extrapolated to 10,000 nodes, with the arithmetic."""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import math
import random
import re
import secrets
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agent.kube.backoff import first_write_delay, heartbeat_delay
from agent.kube.cache import WATCH_TIMEOUT_S
from agent.kube.client import ApiError, KubeApi
from agent.kube.node_cache import NodeCache
from agent.kube.slice_cache import SliceCache
from agent.kube.slices import SliceRead, read_node_slices
from agent.logs import setup_logging
from agent.model import Reason, Status, Verdict
from agent.report.condition import ConditionReporter
from agent.report.events import EventReporter
from bench.common import machine, save, table
from testkit.controlplane import ControlPlane

HOUR = 3600.0
FLEET = 10_000
# kubelet (pkg/kubelet defaults): node lease renew interval 10 s (leaseDuration 40 s / 4), node status
# report frequency 5 min when nothing changes, an informer on its own Node (client-go reflector: a watch
# lasts 5-10 min)
KUBELET_LEASE_S = 10.0
KUBELET_STATUS_S = 300.0
KUBELET_WATCH_S = 300.0  # client-go's reflector: a watch lasts uniform(1, 2) x this
AGENT_WATCH_S = WATCH_TIMEOUT_S  # agent.kube.node_cache: uniform(1, 2) x this
SLICE_WATCH_FACTOR = 2.0  # the runner's SliceCache watches last twice the Node's (agent/runner.py)
AGENT_POLL_S = 30.0  # gpu-ready defaults (agent/config.py)
AGENT_HEARTBEAT_S = 300.0
AGENT_EVENT_INTERVAL_S = 300.0
LEASE_NS = "kube-node-lease"
AGENT_RESOURCES = ("nodes", "events", "resourceslices")
AGENT_WATCHES = ("nodes", "resourceslices")  # the agent's long-lived watches (runner: NodeCache, SliceCache)
KUBELET_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")

HEALTHY = Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "8 GPUs healthy")
FAILED = Verdict(
    Status.FALSE,
    Reason.NVIDIA_SMI_FAILED,
    "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver",
)

# -- the apiserver's own metrics --------------------------------------------------------------------------

WANTED = (
    "apiserver_request_total",
    "apiserver_request_body_size_bytes_sum",
    "apiserver_response_sizes_sum",
    "apiserver_watch_events_total",
    "apiserver_watch_events_sizes_sum",
    "etcd_requests_total",
    "etcd_request_duration_seconds_count",
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Sample = tuple[str, frozenset[tuple[str, str]]]


def read_metrics_text(api: KubeApi) -> str:
    """GET /metrics of the apiserver (Prometheus text) with the client's credentials, taken from its configuration
    (bearer token, client certificate, CA) so that it does not depend on the client's request layer."""
    cfg = api.configuration
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
    if not cfg.verify_ssl:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    headers = {"Accept": "text/plain"}
    auth = cfg.auth_settings().get("BearerToken")
    if auth and auth.get("value"):
        headers[str(auth["key"])] = str(auth["value"])
    req = urllib.request.Request(cfg.host + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            raw: bytes = r.read()
    except urllib.error.HTTPError as e:
        raise ApiError(e.code, "GET /metrics") from e
    except OSError as e:  # URLError, TLS, refused
        raise ApiError(0, f"GET /metrics: {e}") from e
    return raw.decode("utf-8", "replace")


def parse_samples(text: str, wanted: Iterable[str] = WANTED) -> dict[Sample, float]:
    """The samples of the wanted metric names (a linear pass over the lines; other families skipped)."""
    names = set(wanted)
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        if name not in names:
            continue
        head, _, value = line.rpartition(" ")
        labels = frozenset(_LABEL.findall(head[brace:])) if brace >= 0 else frozenset()
        try:
            out[(name, labels)] = out.get((name, labels), 0.0) + float(value)
        except ValueError:
            continue
    return out


def scrape(api: KubeApi) -> dict[Sample, float]:
    return parse_samples(read_metrics_text(api))


def delta(before: dict[Sample, float], after: dict[Sample, float]) -> dict[Sample, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def total(d: dict[Sample, float], name: str, **match: str | tuple[str, ...]) -> float:
    s = 0.0
    for (n, labels), v in d.items():
        if n != name:
            continue
        lab = dict(labels)
        ok = True
        for k, want in match.items():
            have = lab.get(k, "")
            if have not in (want if isinstance(want, tuple) else (want,)):
                ok = False
                break
        if ok:
            s += v
    return s


def by_label(d: dict[Sample, float], name: str, key: str, **match: str | tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), _ in d.items():
        if n == name:
            lab = dict(labels)
            if key in lab:
                out.setdefault(lab[key], 0.0)
    return {k: v for k in sorted(out) if (v := total(d, name, **{**match, key: k}))}


ETCD_READS = ("get", "list", "listWithCount", "count")


# -- Node objects shaped like a GPU node ---------------------------------------------------------------------


def gpu_node(name: str, rng: random.Random, images: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Node to POST, its status to PATCH): synthetic, shaped like a GPU node that kubelet, GPU
    feature discovery and node-feature-discovery report (label and image counts as on such nodes)."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "gpu-8x-h100-80gb",
        "topology.kubernetes.io/region": "region-1",
        "topology.kubernetes.io/zone": "region-1a",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.machine": "gpu-8x-h100",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/cuda.driver.major": "570",
        "nvidia.com/cuda.driver.minor": "124",
        "nvidia.com/cuda.driver.rev": "06",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "8",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gfd.timestamp": str(1_760_000_000 + rng.randrange(10**6)),
        "feature.node.kubernetes.io/kernel-version.full": "6.8.0-1021-nvidia",
        "feature.node.kubernetes.io/pci-10de.present": "true",
        "feature.node.kubernetes.io/pci-15b3.present": "true",
        "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
        "feature.node.kubernetes.io/system-os_release.VERSION_ID": "24.04",
    }
    for flag in ("AVX", "AVX2", "AVX512BW", "AVX512CD", "AVX512DQ", "AVX512F", "AVX512VL", "AVX512VNNI", "AMXBF16"):
        labels[f"feature.node.kubernetes.io/cpu-cpuid.{flag}"] = "true"
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                "nfd.node.kubernetes.io/feature-labels": ",".join(k.split("/", 1)[1] for k in labels if "feature" in k),
            },
        },
        "spec": {"providerID": f"cloud:///region-1a/{name}", "podCIDR": "10.64.0.0/24"},
    }
    res = {
        "cpu": "192",
        "memory": "2113546728Ki",
        "pods": "110",
        "ephemeral-storage": "7499362304Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
        "nvidia.com/gpu": "8",
        "rdma/ib": "8",
    }
    t = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    conds = [
        {
            "type": c,
            "status": "True" if c == "Ready" else "False",
            "reason": "KubeletReady" if c == "Ready" else f"KubeletHasNo{c}",
            "message": "kubelet is posting ready status" if c == "Ready" else f"kubelet has no {c}",
            "lastHeartbeatTime": t,
            "lastTransitionTime": t,
        }
        for c in KUBELET_CONDITIONS
    ]
    repos = ("nvcr.io/nvidia", "registry.local/ml", "registry.local/platform", "registry.k8s.io")
    imgs = []
    for i in range(images):
        digest = f"{rng.getrandbits(256):064x}"
        repo = f"{rng.choice(repos)}/image-{i:02d}"
        imgs.append(
            {
                "names": [f"{repo}@sha256:{digest}", f"{repo}:v{rng.randrange(1, 30)}.{rng.randrange(0, 12)}"],
                "sizeBytes": rng.randrange(20_000_000, 25_000_000_000),
            }
        )
    status = {
        "capacity": res,
        "allocatable": {**res, "cpu": "191500m", "memory": "2102009320Ki"},
        "conditions": conds,
        "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": secrets.token_hex(16),
            "systemUUID": secrets.token_hex(16),
            "bootID": secrets.token_hex(16),
            "kernelVersion": "6.8.0-1021-nvidia",
            "osImage": "Ubuntu 24.04.2 LTS",
            "containerRuntimeVersion": "containerd://2.0.5",
            "kubeletVersion": "v1.36.3",
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "images": imgs,
    }
    return node, status


def micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- a scheduler: one dispatch thread, a pool of workers -------------------------------------------------------


class Scheduler:
    """Runs callables at given monotonic times on a thread pool. Periodic tasks are fixed-rate (the
    next run is due one period after the last was due, whatever the lag), so a window of whole periods
    holds an exact count. Dispatch lag is measured."""

    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="fleet")
        self.heap: list[tuple[float, int, Callable[[], None], Callable[[], float] | None]] = []
        self.seq = itertools.count()
        self.futures: list[Future[None]] = []
        self.max_lag = 0.0
        self.errors: list[str] = []
        self.runs = 0

    def at(self, t: float, fn: Callable[[], None], period: Callable[[], float] | None = None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, period))

    def run_until(self, t_end: float) -> None:
        """Dispatches everything due before t_end, then waits for it to finish; later tasks stay queued."""
        while self.heap and self.heap[0][0] < t_end:
            due, _, fn, period = heapq.heappop(self.heap)
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self.max_lag = max(self.max_lag, time.monotonic() - due)
            self.futures.append(self.pool.submit(self._call, fn))
            self.runs += 1
            if period is not None:
                self.at(due + period(), fn, period)
        for f in self.futures:
            f.result()
        self.futures.clear()

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except ApiError as e:
            if len(self.errors) < 20:
                self.errors.append(str(e)[:200])

    def clear(self) -> None:
        self.heap.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# -- identities ---------------------------------------------------------------------------------------------


WRITE_VERBS = ("POST", "PATCH", "PUT")


@dataclass
class Traffic:
    """Client-side counts of every identity's requests (a cross-check of the apiserver's figures), the
    bytes of write answers (the apiserver's response-size metric covers reads only), and the completion
    times of writes while `timing` (the storm)."""

    requests: dict[str, int] = field(default_factory=dict)
    write_answer_bytes: int = 0
    timing: bool = False
    write_times: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, api: KubeApi) -> KubeApi:
        api.on_request = self.on_request
        api.on_response_bytes = self.on_bytes
        return api

    def on_request(self, verb: str, code: int) -> None:
        with self.lock:
            self.requests[verb] = self.requests.get(verb, 0) + 1
            if self.timing and verb in WRITE_VERBS and 200 <= code < 300:
                self.write_times.append(time.monotonic())

    def on_bytes(self, verb: str, n: int) -> None:
        if verb in WRITE_VERBS:
            with self.lock:
                self.write_answer_bytes += n

    def reset(self) -> None:
        with self.lock:
            self.requests, self.write_answer_bytes, self.write_times = {}, 0, []


class AgentIdentity:
    """One simulated gpu-ready agent: the agent's client, node cache and reporters, and the API half of
    its check cycle (read the Node, publish the verdict as runner.Agent.publish does)."""

    def __init__(self, cp: ControlPlane, node: str, rng: random.Random, scale: float, traffic: Traffic) -> None:
        self.node = node
        self.rng = rng
        self.api = traffic.attach(cp.admin())
        self.cache: NodeCache | None = None
        self.slices: SliceCache | None = None
        self.slice_lists = 0  # LISTs of the ResourceSlices (every poll before; only while the watch is down after)
        self.heartbeat_base = AGENT_HEARTBEAT_S / scale
        self.condition = ConditionReporter(self.api, node, self.heartbeat_base)
        self.events = EventReporter(self.api, node, AGENT_EVENT_INTERVAL_S)
        self.verdict = HEALTHY
        self.poll_s = AGENT_POLL_S / scale
        self.lock = threading.Lock()
        self.writes = 0

    def period(self) -> float:
        return self.poll_s

    def start_cache(self, scale: float) -> list[NodeCache | SliceCache]:
        self.api.metadata_answers = True  # the status patch's answer: metadata only (the runner sets this)
        self.cache = NodeCache(self.api, self.node, watch_timeout_s=AGENT_WATCH_S / scale, rng=self.rng).start()
        self.slices = SliceCache(
            self.api, self.node, watch_timeout_s=SLICE_WATCH_FACTOR * AGENT_WATCH_S / scale, rng=self.rng
        ).start()
        return [self.cache, self.slices]

    def stop_cache(self) -> None:
        if self.cache is not None:
            self.cache.stop(2.0)
            self.cache = None
        if self.slices is not None:
            self.slices.stop(2.0)
            self.slices = None

    def poll(self) -> None:
        with self.lock:
            if self.cache is not None:
                self.cache.get()  # the watch's cached Node (a GET resourceVersion=0 only while it is not kept)
            else:
                self.api.get_node(self.node)  # before: a quorum GET per poll
            read: SliceRead | None = self.slices.items() if self.slices is not None else None
            if read is None:  # CheckSuite._gpu_serving: the LIST (from the apiserver's cache) without the watch
                self.slice_lists += 1
                read_node_slices(self.api, self.node)
            self.publish(self.verdict)

    def fail(self) -> None:
        with self.lock:
            self.verdict = FAILED
            self.publish(FAILED)  # a fatal Xid wakes the loop at once: the worst case for the storm

    def publish(self, v: Verdict) -> None:
        """The API half of runner.Agent.publish: the condition when due (changed, or the heartbeat), an
        Event on a status transition, flushed at once."""
        if self.condition.due(v):
            prev = self.condition.sent_status
            if self.condition.write(v):
                self.events.record(
                    v.reason.value,
                    f"GPUReady {prev or 'unset'} -> {v.status.value}: {v.message}",
                    type_="Normal" if v.status is Status.TRUE else "Warning",
                    action="StatusChanged",
                )
            self.writes += 1
            # the runner's heartbeat jitter: the next heartbeat after (0.8 .. 1.0) x the interval
            self.condition.heartbeat_s = heartbeat_delay(self.rng, self.heartbeat_base)
        self.events.flush()

    def close(self) -> None:
        self.stop_cache()
        self.api.close()


class KubeletIdentity:
    """Kubelet's request pattern for one Node: Lease renew (PUT), node status (GET resourceVersion=0 then
    PATCH of the condition heartbeats), and an informer on its own Node (a list + watch, NodeCache)."""

    def __init__(self, cp: ControlPlane, node: str, rng: random.Random, traffic: Traffic) -> None:
        self.node = node
        self.rng = rng
        self.api = traffic.attach(cp.admin())
        self.lease: dict[str, Any] | None = None
        self.cache: NodeCache | None = None
        self.lock = threading.Lock()

    def create_lease(self) -> None:
        self.lease = self.api.request(
            "POST",
            f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases",
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node, "namespace": LEASE_NS},
                "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": micro_now()},
            },
        )

    def renew_lease(self) -> None:
        with self.lock:
            assert self.lease is not None
            body = {**self.lease, "spec": {**self.lease["spec"], "renewTime": micro_now()}}
            self.lease = self.api.request(
                "PUT", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases/{self.node}", body
            )

    def update_status(self) -> None:
        self.api.get_node(self.node, resource_version="0")  # kubelet's first try reads the apiserver's cache
        t = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.api.patch_node_status(
            self.node,
            {
                "status": {
                    "$setElementOrder/conditions": [{"type": c} for c in KUBELET_CONDITIONS],
                    "conditions": [{"type": c, "lastHeartbeatTime": t} for c in KUBELET_CONDITIONS],
                }
            },
        )

    def close(self) -> None:
        if self.cache is not None:
            self.cache.stop(2.0)
        self.api.close()


# -- the phases -------------------------------------------------------------------------------------------------


def constant(v: float) -> Callable[[], float]:
    return lambda: v


def in_parallel(fns: Iterable[Callable[[], Any]], workers: int = 8) -> None:
    with ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(fn) for fn in fns]:
            f.result()


def wait_all_synced(caches: list[NodeCache | SliceCache], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in caches:
        if not c.wait_synced(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{type(c).__name__} for {c.node} not synced after {timeout_s}s: {c.last_error}")


@dataclass
class Figures:
    """Per node per hour, from the apiserver's metrics over one window."""

    name: str
    requests: dict[str, float]  # "VERB resource[/sub]" -> per node per hour
    request_total: float
    bytes_request: float
    bytes_response: float
    bytes_watch: float
    watch_events: float
    etcd_reads: float
    etcd_writes: float
    etcd_by_op: dict[str, float]
    window_s: float
    compress: float
    raw: dict[str, float]

    @property
    def bytes_total(self) -> float:
        return self.bytes_request + self.bytes_response + self.bytes_watch

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests_per_node_hour": {k: round(v, 2) for k, v in self.requests.items()},
            "requests_total_per_node_hour": round(self.request_total, 2),
            "bytes_per_node_hour": {
                "request_bodies": round(self.bytes_request),
                "responses": round(self.bytes_response),
                "watch_events": round(self.bytes_watch),
                "total": round(self.bytes_total),
            },
            "watch_events_per_node_hour": round(self.watch_events, 2),
            "etcd_reads_per_node_hour": round(self.etcd_reads, 2),
            "etcd_writes_per_node_hour": round(self.etcd_writes, 2),
            "etcd_per_node_hour_by_operation": {k: round(v, 2) for k, v in self.etcd_by_op.items()},
            "window_s": round(self.window_s, 1),
            "compress": self.compress,
            "raw_counts": {k: round(v) for k, v in self.raw.items()},
        }


def figures(
    name: str,
    d: dict[Sample, float],
    traffic: Traffic,
    watched: tuple[int, int],
    resources: tuple[str, ...],
    nodes: int,
    window_s: float,
    compress: float,
    watch_base_s: float | None,
    watches: tuple[str, ...] = ("nodes",),
) -> Figures:
    """`watched`: (events incl. bookmarks, bytes) our watches received in the window, counted where they
    arrive: the apiserver's watch-event metrics also count the events sent to its own internal watchers.
    `watch_base_s`: the pattern holds one watch per resource in `watches`, each renewed after uniform(1, 2) x this
    many seconds. Its
    renewals are arithmetic (3600 / the mean lifetime per hour): a window shorter than a lifetime, opened
    when every watch has just started, would count almost none of them."""
    per = HOUR / (window_s * compress) / nodes  # a count in the window -> per node per hour
    reqs: dict[str, float] = {}
    raw: dict[str, float] = {}
    for (n, labels), v in d.items():
        lab = dict(labels)
        if n == "apiserver_request_total" and lab.get("resource") in resources:
            key = f"{lab['verb']} {lab['resource']}{'/' + lab['subresource'] if lab.get('subresource') else ''}"
            raw[key] = raw.get(key, 0.0) + v
    reqs = {k: v * per for k, v in sorted(raw.items()) if not k.startswith("WATCH ")}
    if watch_base_s is not None:
        for w in watches:
            base = watch_base_s * SLICE_WATCH_FACTOR if w == "resourceslices" else watch_base_s
            reqs[f"WATCH {w} (renewals: 3600 / mean lifetime)"] = HOUR / (1.5 * base)
    etcd_ops = by_label(d, "etcd_requests_total", "operation", resource=resources)
    reads = sum(v for k, v in etcd_ops.items() if k in ETCD_READS)
    writes = sum(v for k, v in etcd_ops.items() if k not in ETCD_READS)
    raw["watch events (apiserver, incl. its own watchers)"] = total(
        d, "apiserver_watch_events_total", resource=resources
    )
    raw["watch events"], raw["watch bytes"] = watched
    raw["etcd reads"], raw["etcd writes"] = reads, writes
    for verb, count in sorted(traffic.requests.items()):
        raw[f"client-side {verb}"] = count
    # the apiserver's response-size metric covers reads (a WATCH only when it ends: its bytes are taken
    # from the watch-event sizes instead); write answers are counted at the client
    read_bytes = total(d, "apiserver_response_sizes_sum", resource=resources, verb=("GET", "LIST"))
    return Figures(
        name=name,
        requests=reqs,
        request_total=sum(reqs.values()),
        bytes_request=total(d, "apiserver_request_body_size_bytes_sum", resource=resources) * per,
        bytes_response=(read_bytes + traffic.write_answer_bytes) * per,
        bytes_watch=watched[1] * per,
        watch_events=raw["watch events"] * per,
        etcd_reads=reads * per,
        etcd_writes=writes * per,
        etcd_by_op={k: v * per for k, v in etcd_ops.items()},
        window_s=window_s,
        compress=compress,
        raw=raw,
    )


class Fleet:
    def __init__(self, cp: ControlPlane, nodes: int, compress: float, window_s: float, seed: int, workers: int) -> None:
        self.cp = cp
        self.n = nodes
        self.compress = compress
        self.window_s = window_s
        self.rng = random.Random(seed)
        self.admin = cp.admin(timeout_s=30)
        self.sched = Scheduler(workers)
        self.traffic = Traffic()
        self.names = [f"gpu-{i:05d}-{secrets.token_hex(2)}" for i in range(nodes)]
        self.node_bytes = 0
        self.agents: list[AgentIdentity] = []

    def log_phase(self, msg: str) -> None:
        print(f"[fleet] {msg}", flush=True)

    def setup(self, images: int) -> None:
        self.log_phase(f"creating {self.n} GPU Nodes ({images} images each) and their Leases ...")
        try:
            self.admin.request("POST", "/api/v1/namespaces", {"metadata": {"name": LEASE_NS}})
        except ApiError as e:
            if e.status != 409:
                raise
        rngs = [random.Random(self.rng.random()) for _ in self.names]

        def make(i: int) -> None:
            node, status = gpu_node(self.names[i], rngs[i], images)
            self.admin.request("POST", "/api/v1/nodes", node)
            got = self.admin.patch_node_status(self.names[i], {"status": status})
            if i == 0:
                self.node_bytes = len(json.dumps(got, separators=(",", ":")))

        in_parallel([functools.partial(make, i) for i in range(self.n)])

    def measure(
        self,
        name: str,
        resources: tuple[str, ...],
        start: float,
        caches: list[NodeCache | SliceCache],
        compress: float,
        watches: tuple[str, ...] = ("nodes",),
    ) -> Figures:
        """The window is [start, start + window): every scheduled request due in it is sent between the two
        scrapes (a fixed-rate schedule holds an exact count of whole periods)."""

        def watched() -> tuple[int, int]:
            st = [c.stats for c in caches]
            return sum(x.events + x.bookmarks for x in st), sum(x.watch_bytes for x in st)

        self.sched.run_until(start)
        m0 = scrape(self.admin)
        w0 = watched()
        self.traffic.reset()
        self.sched.run_until(start + self.window_s)
        m1 = scrape(self.admin)
        w1 = watched()
        took = time.monotonic() - start
        lag = self.sched.max_lag
        self.sched.max_lag = 0.0
        self.log_phase(f"  {name}: window {self.window_s:.0f} s (took {took:.0f} s, dispatch lag max {lag:.2f} s)")
        d = delta(m0, m1)
        watch_base = KUBELET_WATCH_S if name == "kubelet" else (AGENT_WATCH_S if caches else None)
        return figures(
            name,
            d,
            self.traffic,
            (w1[0] - w0[0], w1[1] - w0[1]),
            resources,
            self.n,
            self.window_s,
            compress,
            watch_base,
            watches,
        )

    def kubelet_phase(self) -> Figures:
        f = self.compress
        self.log_phase(f"kubelet's pattern for {self.n} nodes (time / {f:g}) ...")
        kubelets = [KubeletIdentity(self.cp, n, random.Random(self.rng.random()), self.traffic) for n in self.names]
        in_parallel([k.create_lease for k in kubelets])
        for k in kubelets:
            k.cache = NodeCache(  # an informer: list, then watch
                k.api, k.node, watch_timeout_s=KUBELET_WATCH_S / f, rng=k.rng, initial_list=True
            ).start()
        wait_all_synced([k.cache for k in kubelets if k.cache], 120)
        start = time.monotonic() + 0.5
        for k in kubelets:
            lease_p, status_p = KUBELET_LEASE_S / f, KUBELET_STATUS_S / f
            self.sched.at(start + self.rng.random() * lease_p, k.renew_lease, constant(lease_p))
            self.sched.at(start + self.rng.random() * status_p, k.update_status, constant(status_p))
        try:
            kcaches: list[NodeCache | SliceCache] = [k.cache for k in kubelets if k.cache]
            return self.measure("kubelet", ("nodes", "leases"), start, kcaches, f)
        finally:
            self.sched.clear()
            in_parallel([k.close for k in kubelets], 32)

    def agents_start(self) -> float:
        """The agents start together (a DaemonSet roll-out): each holds its first poll and write for
        first_write_delay (the runner's start-up spread) over one heartbeat interval, so that the fleet is
        in its steady state (heartbeats spread evenly) when the window opens. Returns the window start."""
        f = self.compress
        self.agents = [AgentIdentity(self.cp, n, random.Random(self.rng.random()), f, self.traffic) for n in self.names]
        now = time.monotonic()
        spread = AGENT_HEARTBEAT_S / f
        for a in self.agents:
            self.sched.at(now + first_write_delay(a.rng, spread), a.poll, a.period)
        return now + spread + AGENT_POLL_S / f

    def before_phase(self) -> Figures:
        self.log_phase(f"gpu-ready before (GET + LIST per poll) for {self.n} nodes (time / {self.compress:g}) ...")
        start = self.agents_start()
        return self.measure("gpu-ready before", AGENT_RESOURCES, start, [], self.compress)

    def after_phase(self) -> Figures:
        self.log_phase(
            f"gpu-ready after (Node + ResourceSlice watches) for {self.n} nodes (time / {self.compress:g}) ..."
        )
        caches = [c for a in self.agents for c in a.start_cache(self.compress)]
        wait_all_synced(caches, 120)
        # the polls already queued go on at their phase; from now on they read the caches
        lists0 = sum(a.slice_lists for a in self.agents)
        res = self.measure(
            "gpu-ready after", AGENT_RESOURCES, time.monotonic() + 0.5, caches, self.compress, AGENT_WATCHES
        )
        nodes = [c for c in caches if isinstance(c, NodeCache)]
        slices = [c for c in caches if isinstance(c, SliceCache)]
        res.raw["caches live"] = sum(1 for c in nodes if c.live)
        res.raw["fallback GETs"] = sum(c.stats.fallback_gets for c in nodes)
        res.raw["cache reads"] = sum(c.stats.cache_reads for c in nodes)
        res.raw["watch errors"] = sum(c.stats.errors for c in nodes)
        res.raw["slice caches live"] = sum(1 for c in slices if c.live)
        res.raw["slice cache reads"] = sum(c.stats.reads for c in slices)
        res.raw["slice fallback LISTs"] = sum(a.slice_lists for a in self.agents) - lists0
        res.raw["slice watch errors"] = sum(c.stats.errors for c in slices)
        return res

    def storm_phase(self, fraction: float, within_s: float) -> dict[str, Any]:
        """Real time from here: poll 30 s, heartbeat 5 min, heartbeats uniformly spread over the fleet."""
        k = max(1, round(self.n * fraction))
        self.log_phase(f"storm: {k} of {self.n} nodes fail within {within_s:g} s (real time) ...")
        self.sched.clear()
        now = time.monotonic()
        for a in self.agents:
            a.poll_s = AGENT_POLL_S
            a.heartbeat_base = AGENT_HEARTBEAT_S
            a.condition.heartbeat_s = AGENT_HEARTBEAT_S
            a.condition.last_write_mono = now - a.rng.random() * AGENT_HEARTBEAT_S  # a fleet in steady state
            self.sched.at(now + a.rng.random() * AGENT_POLL_S, a.poll, a.period)
        failing = self.rng.sample(self.agents, k)
        offsets = sorted(self.rng.random() * within_s for _ in failing)
        start = now + 1.0
        for a, off in zip(failing, offsets, strict=True):
            self.sched.at(start + off, a.fail)
        w0 = sum(a.writes for a in self.agents)
        m0 = scrape(self.admin)
        self.traffic.reset()
        self.traffic.timing = True
        self.sched.run_until(start + within_s)
        self.traffic.timing = False
        m1 = scrape(self.admin)
        d = delta(m0, m1)
        bins: dict[int, int] = {}
        for t in self.traffic.write_times:
            bins[int(t - start)] = bins.get(int(t - start), 0) + 1
        writes_api = total(d, "apiserver_request_total", verb=("PATCH", "POST", "PUT"), resource=("nodes", "events"))
        reported = sum(1 for a in failing if a.condition.sent_status == Status.FALSE.value)
        return {
            "nodes": self.n,
            "failing": k,
            "within_s": within_s,
            "writes_total": int(writes_api),
            "writes_client": len(self.traffic.write_times),
            "condition_writes": int(total(d, "apiserver_request_total", verb="PATCH", resource="nodes")),
            "event_writes": int(total(d, "apiserver_request_total", verb=("POST", "PATCH"), resource="events")),
            "heartbeat_writes": sum(a.writes for a in self.agents) - w0 - k,
            "peak_writes_per_s": max(bins.values(), default=0),
            "failures_reported_false": reported,
            "etcd_writes": int(
                sum(
                    v
                    for op, v in by_label(d, "etcd_requests_total", "operation", resource=("nodes", "events")).items()
                    if op not in ETCD_READS
                )
            ),
            "etcd_reads": int(
                sum(
                    v
                    for op, v in by_label(d, "etcd_requests_total", "operation", resource=("nodes", "events")).items()
                    if op in ETCD_READS
                )
            ),
        }

    def close(self) -> None:
        self.sched.clear()
        in_parallel([a.close for a in self.agents], 32)
        self.sched.close()
        self.admin.close()


# -- the arithmetic ----------------------------------------------------------------------------------------------


def peak_per_second(events: int, within_s: float, rng: random.Random, trials: int = 200) -> tuple[float, int]:
    """(mean, 99th percentile) of the busiest one-second bin when `events` failures fall uniformly
    within `within_s` seconds (simulated)."""
    peaks = []
    bins = max(1, math.ceil(within_s))
    for _ in range(trials):
        counts = [0] * bins
        for _ in range(events):
            counts[min(bins - 1, int(rng.random() * within_s))] += 1
        peaks.append(max(counts))
    peaks.sort()
    return sum(peaks) / len(peaks), peaks[int(0.99 * (len(peaks) - 1))]


def extrapolate(
    kub: Figures, before: Figures, after: Figures, storm: dict[str, Any], node_event_bytes: float
) -> dict[str, Any]:
    """gpu-ready beside kubelet per node per hour, and what 10,000 nodes make of it, with the arithmetic."""
    # where both run on one Node, each one's writes also reach the other's watch (one event each)
    kub_status_writes = kub.requests.get("PATCH nodes/status", 0.0)
    gr_writes = after.requests.get("PATCH nodes/status", 0.0)
    cross_events = kub_status_writes + gr_writes
    after_req = after.request_total
    after_bytes = after.bytes_total + cross_events * node_event_bytes
    res: dict[str, Any] = {
        "requests_ratio": after_req / kub.request_total if kub.request_total else float("nan"),
        "bytes_ratio_alone": after.bytes_total / kub.bytes_total if kub.bytes_total else float("nan"),
        "bytes_ratio": after_bytes / kub.bytes_total if kub.bytes_total else float("nan"),
        "bytes_with_cross_watch": after_bytes,
        "arithmetic": {
            "requests_ratio": f"{after_req:.1f} gpu-ready requests / {kub.request_total:.1f} kubelet requests "
            f"per node per hour = {after_req / max(kub.request_total, 1e-9) * 100:.1f} %",
            "bytes": f"gpu-ready alone {after.bytes_total / 1024:.0f} KiB/node/h + watch events where kubelet runs "
            f"too: ({kub_status_writes:.1f} kubelet status writes reaching gpu-ready's watch + {gr_writes:.1f} "
            f"gpu-ready writes reaching kubelet's watch) x {node_event_bytes / 1024:.1f} KiB = "
            f"{after_bytes / 1024:.0f} KiB; kubelet {kub.bytes_total / 1024:.0f} KiB/node/h; "
            f"ratio {after_bytes / max(kub.bytes_total, 1e-9) * 100:.1f} %",
        },
    }
    per_s = FLEET / HOUR
    res["fleet"] = {
        "etcd_reads_per_s_before": before.etcd_reads * per_s,
        "etcd_reads_per_s_after": after.etcd_reads * per_s,
        "requests_per_s_before": before.request_total * per_s,
        "requests_per_s_after": after.request_total * per_s,
        "requests_per_s_kubelet": kub.request_total * per_s,
        "arithmetic": (
            f"x {FLEET:,} nodes / 3600 s: etcd reads {before.etcd_reads:.1f} -> {before.etcd_reads * per_s:.1f}/s "
            f"before, {after.etcd_reads:.1f} -> {after.etcd_reads * per_s:.1f}/s after; requests "
            f"{before.request_total:.1f} -> {before.request_total * per_s:.0f}/s before, {after.request_total:.1f} "
            f"-> {after.request_total * per_s:.1f}/s after, kubelet {kub.request_total:.1f} -> "
            f"{kub.request_total * per_s:.0f}/s"
        ),
    }
    k, n = storm["failing"], storm["nodes"]
    per_failure = (storm["condition_writes"] + storm["event_writes"] - storm["heartbeat_writes"]) / k
    fleet_failing = round(FLEET * k / n)
    mean_peak, p99_peak = peak_per_second(fleet_failing, storm["within_s"], random.Random(20))
    heartbeat_per_s = gr_writes * per_s  # the rest of the fleet keeps its heartbeat meanwhile
    peak = p99_peak * per_failure + heartbeat_per_s
    res["storm_10k"] = {
        "failing": fleet_failing,
        "writes_per_failure": round(per_failure, 2),
        "total_writes": round(fleet_failing * per_failure),
        "busiest_second_failures_mean": round(mean_peak, 1),
        "busiest_second_failures_p99": p99_peak,
        "heartbeat_writes_per_s": round(heartbeat_per_s, 1),
        "peak_writes_per_s": round(peak, 1),
        "linear_from_measured_peak": round(storm["peak_writes_per_s"] * FLEET / n, 1),
        "arithmetic": (
            f"{fleet_failing} nodes fail uniformly within {storm['within_s']:g} s: the busiest second holds "
            f"{mean_peak:.1f} failures on average, {p99_peak} at the 99th percentile (simulated, 200 draws); "
            f"x {per_failure:.2f} writes per failure (measured: condition + Event) = {p99_peak * per_failure:.1f}/s, "
            f"+ the fleet's heartbeats {gr_writes:.2f}/node/h x {FLEET:,} / 3600 = {heartbeat_per_s:.1f}/s -> "
            f"{peak:.1f} writes/s; total {fleet_failing} x {per_failure:.2f} = {fleet_failing * per_failure:.0f} "
            f"writes. (The measured peak {storm['peak_writes_per_s']}/s at {n} nodes x {FLEET // n} = "
            f"{storm['peak_writes_per_s'] * FLEET / n:.0f}/s overstates it: a busiest second among {k} failures is "
            f"far above the mean.)"
        ),
    }
    return res


def run(
    cp: ControlPlane,
    nodes: int = 200,
    compress: float = 10.0,
    window_s: float = 30.0,
    storm_fraction: float = 0.1,
    storm_within_s: float = 60.0,
    images: int = 50,
    seed: int = 20,
    workers: int = 16,
) -> dict[str, Any]:
    t0 = time.monotonic()
    fleet = Fleet(cp, nodes, compress, window_s, seed, workers)
    try:
        fleet.setup(images)
        kub = fleet.kubelet_phase()
        before = fleet.before_phase()
        after = fleet.after_phase()
        storm = fleet.storm_phase(storm_fraction, storm_within_s)
        errors = fleet.sched.errors
    finally:
        fleet.close()
    node_event_bytes = after.bytes_watch / after.watch_events if after.watch_events else float(fleet.node_bytes)
    ext = extrapolate(kub, before, after, storm, node_event_bytes)
    res = {
        "setup": {
            "nodes": nodes,
            "compress": compress,
            "window_s": window_s,
            "node_json_bytes": fleet.node_bytes,
            "images_per_node": images,
            "seconds": round(time.monotonic() - t0, 1),
            "request_errors": errors,
            "machine": machine(),
        },
        "kubelet": kub.as_dict(),
        "before": before.as_dict(),
        "after": after.as_dict(),
        "storm": storm,
        "comparison": ext,
    }
    save("fleet", res)
    return res


def report(r: dict[str, Any]) -> str:
    s, kub, bef, aft, st, cmp_ = r["setup"], r["kubelet"], r["before"], r["after"], r["storm"], r["comparison"]
    lines = [
        f"{s['nodes']} simulated GPU Nodes ({s['node_json_bytes'] / 1024:.1f} KiB each as JSON, "
        f"{s['images_per_node']} images), time compressed {s['compress']:g}x: each {s['window_s']:g} s window "
        f"stands for {s['window_s'] * s['compress'] / 60:g} minutes; per-hour figures = count x 3600 / "
        f"({s['window_s']:g} s x {s['compress']:g}) / {s['nodes']} nodes. Run took {s['seconds']:.0f} s.",
        "",
    ]
    head = ("per node per hour", "kubelet", "gpu-ready before (GET/poll)", "gpu-ready after (watch)")
    keys = sorted(
        set(kub["requests_per_node_hour"]) | set(bef["requests_per_node_hour"]) | set(aft["requests_per_node_hour"])
    )
    rows: list[tuple[str, ...]] = [head]
    for k in keys:
        rows.append(
            (
                k,
                *(f"{x['requests_per_node_hour'].get(k, 0):.1f}" for x in (kub, bef, aft)),
            )
        )
    rows.append(("requests, total", *(f"{x['requests_total_per_node_hour']:.1f}" for x in (kub, bef, aft))))
    for part in ("request_bodies", "responses", "watch_events", "total"):
        rows.append(
            (
                f"KiB, {part.replace('_', ' ')}",
                *(f"{x['bytes_per_node_hour'][part] / 1024:.0f}" for x in (kub, bef, aft)),
            )
        )
    rows.append(("etcd reads", *(f"{x['etcd_reads_per_node_hour']:.1f}" for x in (kub, bef, aft))))
    rows.append(("etcd writes", *(f"{x['etcd_writes_per_node_hour']:.1f}" for x in (kub, bef, aft))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    lines += [fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows[1:]), ""]
    st10 = cmp_["storm_10k"]
    lines += [
        "gpu-ready (after) vs kubelet: " + cmp_["arithmetic"]["requests_ratio"],
        "  " + cmp_["arithmetic"]["bytes"],
        "At 10,000 nodes: " + cmp_["fleet"]["arithmetic"],
        f"Storm at {st['nodes']} nodes: {st['failing']} nodes failed within {st['within_s']:g} s: {st['writes_total']} "
        f"writes ({st['condition_writes']} condition, {st['event_writes']} Event, of which {st['heartbeat_writes']} "
        f"were heartbeats), peak {st['peak_writes_per_s']} writes/s, etcd {st['etcd_writes']} writes / "
        f"{st['etcd_reads']} reads",
        "Storm at 10,000 nodes: " + st10["arithmetic"],
    ]
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    lines += [
        "",
        table(
            [
                (
                    "gpu-ready requests per node-hour / kubelet's",
                    f"{cmp_['requests_ratio'] * 100:.1f} %",
                    "< 5 %",
                    ok(cmp_["requests_ratio"] < 0.05),
                ),
                (
                    "gpu-ready bytes per node-hour / kubelet's",
                    f"{cmp_['bytes_ratio'] * 100:.1f} % ({cmp_['bytes_ratio_alone'] * 100:.1f} % without the "
                    "other's watch events)",
                    "< 5 %",
                    ok(cmp_["bytes_ratio"] < 0.05),
                ),
                (
                    "etcd reads per node-hour, steady state",
                    f"{aft['etcd_reads_per_node_hour']:.1f} (before: {bef['etcd_reads_per_node_hour']:.1f})",
                    "0",
                    ok(aft["etcd_reads_per_node_hour"] == 0),
                ),
                (
                    "storm peak writes/s at 10,000 nodes",
                    f"{st10['peak_writes_per_s']:.0f} (total {st10['total_writes']})",
                    "< 100",
                    ok(st10["peak_writes_per_s"] < 100),
                ),
            ]
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=200, help="simulated nodes (default 200)")
    ap.add_argument("--compress", type=float, default=10.0, help="time compression of the steady phases (10)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds measured per steady phase (30)")
    ap.add_argument("--storm-fraction", type=float, default=0.1, help="share of nodes failing in the storm (0.1)")
    ap.add_argument("--storm-within", type=float, default=60.0, help="seconds the storm's failures spread over (60)")
    ap.add_argument("--images", type=int, default=50, help="images in each Node's status (50, kubelet's default cap)")
    ap.add_argument("--workers", type=int, default=16, help="threads issuing the scheduled requests (16)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print the full results as JSON too")
    a = ap.parse_args()
    bad = [
        f"{name} must be > 0"
        for name, v in (
            ("--nodes", a.nodes),
            ("--compress", a.compress),
            ("--window", a.window),
            ("--workers", a.workers),
        )
        if v <= 0
    ]
    if not 0 < a.storm_fraction <= 1:
        bad.append("--storm-fraction must be in (0, 1]")
    if a.storm_within <= 0 or a.images < 0:
        bad.append("--storm-within must be > 0 and --images >= 0")
    if bad:
        ap.exit(2, f"bench.fleet: {'; '.join(bad)}\n")
    setup_logging("console", "warning")
    try:
        cp = ControlPlane()
    except FileNotFoundError as e:
        ap.exit(2, f"bench.fleet: {e}\n")
    with cp:
        r = run(cp, a.nodes, a.compress, a.window, a.storm_fraction, a.storm_within, a.images, a.seed, a.workers)
    print()
    print(f"Machine: {r['setup']['machine']}")
    print(report(r))
    if a.json:
        print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
