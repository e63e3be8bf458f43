"""`gpu-ready controller`: wiring and the loop (docs/controller.md). The decisions are plan.py's.

One replica acts at a time (lease.py). The active one keeps two caches (informer.py): the GPU Nodes (read
only) and the preflight Jobs it created in its namespace; on each change, and at least every `resync_s`, it
1. publishes the fleet brake on its ConfigMap: a change of what agents act on (engaged, admitted) at once, the
   counts alone at most once per resync, nothing at rest;
2. plans and applies preflight: creates the chart's Job (from the template file, only the node pinned),
   deletes finished ones, reports a node at the retry cap and a Job that does not start (Events, metrics).
It never writes a Node: the Job's own token does, under the preflight admission policy."""

from __future__ import annotations

import argparse
import copy
import os
import stat
import sys
import threading
import time
from typing import Any
from urllib.parse import quote

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector

from agent.controller.informer import Informer
from agent.controller.lease import LeaseElector
from agent.controller.plan import (
    ATTEMPT_LABEL,
    NODE_ANNOTATION,
    NODE_LABEL,
    BrakeState,
    JobView,
    Limits,
    NodeView,
    attempt_of,
    brake_state,
    job_name,
    job_view,
    max_unavailable,
    node_label_value,
    node_view,
    plan_preflight,
)
from agent.controller.settings import ControllerSettings
from agent.kube.client import ApiError, KubeApi, connect
from agent.kube.object_watch import ObjectWatch
from agent.logs import get_logger, setup_logging
from agent.names import (
    BRAKE_ADMITTED,
    BRAKE_ENGAGED,
    BRAKE_SELECTOR,
    MANAGED_LABEL,
    MANAGED_VALUE,
    parse_admitted,
)
from agent.report.events import EventReporter, PendingEvent, node_ref
from agent.settings import add_program_flags

REPORTING_CONTROLLER = "gpu-ready-controller"
MAX_TEMPLATE_BYTES = 256 * 1024
BRAKE_BATCH_S = 0.25  # decisive brake writes at most this often (admissions of nodes that fail together batch)


class ControllerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # RSS and CPU, as the agent's
        self.leader = Gauge("gpu_ready_controller_leader", "1 while this replica holds the Lease", registry=r)
        self.brake = Gauge("gpu_ready_fleet_brake_engaged", "1 while the fleet brake is engaged", registry=r)
        self.unavailable = Gauge(
            "gpu_ready_fleet_unavailable_nodes", "GPU nodes gpu-ready holds out of service", registry=r
        )
        self.budget = Gauge("gpu_ready_fleet_max_unavailable", "maxUnavailable as a node count", registry=r)
        self.gpu_nodes = Gauge("gpu_ready_fleet_gpu_nodes", "GPU nodes watched", registry=r)
        self.running = Gauge("gpu_ready_preflight_jobs_running", "preflight Jobs running", registry=r)
        self.waiting = Gauge(
            "gpu_ready_preflight_nodes_waiting",
            "nodes that need preflight and wait (budget, backoff, brake, a fault still latched)",
            registry=r,
        )
        self.gave_up = Gauge(
            "gpu_ready_preflight_gave_up_nodes",
            "nodes at the retry cap: preflight failed maxFailures times",
            registry=r,
        )
        self.stuck = Gauge("gpu_ready_preflight_jobs_stuck", "preflight Jobs whose pod has not started", registry=r)
        self.created = Counter("gpu_ready_preflight_jobs_created", "preflight Jobs created", registry=r)
        self.deleted = Counter("gpu_ready_preflight_jobs_deleted", "finished preflight Jobs deleted", registry=r)
        self.requests = Counter(
            "gpu_ready_controller_api_requests", "API requests by verb and code", ["verb", "code"], registry=r
        )


MAX_TEMPLATE_DEPTH = 64  # the chart's Job nests about 12 levels


def _depth(obj: Any) -> int:
    """How deep a loaded document nests (iteratively: a hostile one cannot exhaust the stack here)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_TEMPLATE_DEPTH:
            break
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return deepest


def load_template(path: str) -> dict[str, Any]:
    """The chart's preflight Job (rendered into the controller's ConfigMap and mounted as a file): a regular file
    (a FIFO or a device would block the read), at most MAX_TEMPLATE_BYTES, nesting at most MAX_TEMPLATE_DEPTH, a
    batch/v1 Job with a pod spec and at least one container. Anything else is a ValueError of one line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        raw = os.read(fd, MAX_TEMPLATE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{path}: more than {MAX_TEMPLATE_BYTES} bytes")
    if raw.count(b"[") + raw.count(b"{") > 4 * MAX_TEMPLATE_DEPTH and _flow_depth(raw) > MAX_TEMPLATE_DEPTH:
        raise ValueError(f"{path}: nests deeper than {MAX_TEMPLATE_DEPTH} levels")
    try:
        job = yaml.safe_load(raw)
    except RecursionError:
        raise ValueError(f"{path}: nests deeper than {MAX_TEMPLATE_DEPTH} levels") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {str(e).splitlines()[0][:200]}") from None
    if _depth(job) > MAX_TEMPLATE_DEPTH:
        raise ValueError(f"{path}: nests deeper than {MAX_TEMPLATE_DEPTH} levels")
    if not isinstance(job, dict) or job.get("kind") != "Job" or not isinstance(job.get("spec"), dict):
        raise ValueError(f"{path}: not a batch/v1 Job")
    template = job["spec"].get("template")
    pod = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(pod, dict) or not isinstance(pod.get("containers"), list) or not pod["containers"]:
        raise ValueError(f"{path}: the Job has no pod spec with containers (spec.template.spec.containers)")
    if not all(isinstance(c, dict) for c in pod["containers"]):
        raise ValueError(f"{path}: spec.template.spec.containers must be a list of containers")
    return job


def _flow_depth(raw: bytes) -> int:
    """The deepest nesting of flow brackets ([ and {), quoted text included: an upper bound, read in one pass
    before the YAML parser (whose composer recurses once per level) sees the document."""
    depth = deepest = 0
    for b in raw:
        if b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D) and depth:
            depth -= 1
    return deepest


def render_job(template: dict[str, Any], prefix: str, namespace: str, node: str, attempt: int) -> dict[str, Any]:
    """The template with only the node pinned (spec.template.spec.nodeName) and its name and bookkeeping labels."""
    job = copy.deepcopy(template)
    meta = job.setdefault("metadata", {})
    meta["name"] = job_name(prefix, node, attempt)
    meta["namespace"] = namespace
    labels = meta.setdefault("labels", {})
    labels.update({MANAGED_LABEL: MANAGED_VALUE, NODE_LABEL: node_label_value(node), ATTEMPT_LABEL: str(attempt)})
    meta.setdefault("annotations", {})[NODE_ANNOTATION] = node
    job["spec"]["template"]["spec"]["nodeName"] = node
    return job


class Controller:
    def __init__(self, args: argparse.Namespace, api: KubeApi | None = None) -> None:
        self.args = args
        self.log = get_logger(component="controller", identity=args.identity)
        self.m = ControllerMetrics()
        self.template = load_template(args.job_template)
        self.api = api or connect(args.kubeconfig, 10.0)
        self.api.on_request = lambda verb, code: self.m.requests.labels(verb, str(code)).inc()
        self.limits = Limits(args.max_concurrent, args.max_failures, args.backoff, args.pending_timeout)
        self.wake = threading.Event()
        self.stop = threading.Event()
        ns = args.namespace
        self.elector = LeaseElector(
            self.api, ns, args.lease_name, args.identity, args.lease_duration, args.lease_duration / 3,
            max(0.5, args.lease_duration / 5),
        )  # fmt: skip
        a = args

        def to_node(obj: dict[str, Any]) -> NodeView:
            return node_view(obj, a.needs_label, a.preflight_label, a.taint_key, a.condition_type, a.startup_taint)

        self.nodes: Informer[NodeView] = Informer(
            self.api, "/api/v1/nodes", to_node, a.gpu_selector, self.wake.set, a.watch_timeout
        )
        self.jobs: Informer[JobView] = Informer(
            self.api,
            f"/apis/batch/v1/namespaces/{quote(ns)}/jobs",
            job_view,
            f"{MANAGED_LABEL}={MANAGED_VALUE}",
            self.wake.set,
            a.watch_timeout,
        )
        # The brake ConfigMap as the apiserver has it (one watch, by name): a copy someone else changed (deleted,
        # garbled, "everyone admitted", oversized) is rewritten with what this controller computed.
        self.brake_watch: ObjectWatch | None = (
            ObjectWatch(self.api, ns, a.brake, on_change=lambda _o: self.wake.set(), watch_timeout_s=a.watch_timeout)
            if a.brake
            else None
        )
        self.brake_versions: list[str] = []  # resourceVersions of this process's own brake writes (the newest few)
        self.brake_repairs = 0
        self.brake_blind_at = -1e9  # when a brake rewrite last went out while its watch was failing (mono)
        self.created: dict[str, tuple[str, int, float]] = {}  # Job name -> (node, attempt, mono): not yet seen
        self.brake_data: dict[str, str] | None = None  # what the ConfigMap holds, as last written or read
        self.brake: BrakeState | None = None
        self.reported: set[tuple[str, str]] = set()  # (kind, name) of Events already written by this process
        self.started = False
        self.brake_changes = 0
        self.brake_written_at = 0.0
        self.brake_due: float | None = None  # when a held-back decisive brake write is due (mono)
        self.node_events = self._event_writer(args.event_namespace)  # about Nodes
        self.lease_events = self._event_writer(ns)  # the brake's, about the controller's own Lease

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> None:
        next_lease = 0.0
        next_resync = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_lease:
                was = self.elector.leading
                leading = self.elector.step()
                self.m.leader.set(1 if leading else 0)
                next_lease = now + (self.elector.renew_s if leading else self.elector.retry_s)
                if leading and not was:
                    self.log.info("leading: acquired the Lease", lease=self.args.lease_name)
                    self._start_caches()
                    next_resync = 0.0
                elif was and not leading:
                    self.log.warning("lost the Lease: standing by")
            synced = self.nodes.known and self.jobs.known
            if self.elector.leading and synced and (self.wake.is_set() or time.monotonic() >= next_resync):
                self.wake.clear()
                try:
                    self.reconcile()
                except ApiError as e:
                    self.log.warning("reconcile failed", error=str(e)[:300])
                except Exception as e:  # a bug must not stop the controller
                    self.log.exception("reconcile error", error=str(e))
                next_resync = time.monotonic() + self.args.resync
                if self.brake_due is not None:
                    next_resync = min(next_resync, self.brake_due)
            wait = max(0.05, min(next_lease, next_resync if self.elector.leading else next_lease) - time.monotonic())
            self.wake.wait(wait if self.elector.leading else max(0.05, next_lease - time.monotonic()))

    def _start_caches(self) -> None:
        if not self.started:
            self.started = True
            self.nodes.start()
            self.jobs.start()
            if self.brake_watch is not None:
                self.brake_watch.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.wake.set()
        self.elector.release()
        if self.started:
            self.nodes.stop()
            self.jobs.stop()
            if self.brake_watch is not None:
                self.brake_watch.stop()

    # -- one round ----------------------------------------------------------------------------------------

    def reconcile(self) -> None:
        nodes = {v.name: v for v in self.nodes.items().values() if v.name}
        jobs = list(self.jobs.items().values())
        seen = {j.name for j in jobs}
        now_m = time.monotonic()
        for name, (node, attempt, at) in list(self.created.items()):
            if name in seen or now_m - at > 300:
                del self.created[name]  # the cache has it (or it never appeared: plan from the cache again)
            else:
                jobs.append(JobView(name, node, True, False, False, time.time(), None, attempt=attempt))
        self.m.gpu_nodes.set(len(nodes))
        engaged = self._brake(nodes)
        plan = plan_preflight(nodes, jobs, self.limits, time.time(), brake_engaged=engaged)
        for node in plan.create:
            self._create(node, attempt_of(jobs, node))
        for name in plan.delete:
            self._delete(name)
        for node in plan.gave_up:
            self._event(
                ("gave-up", node), node, "PreflightGaveUp",
                f"preflight failed {self.limits.max_failures} times on this node: no more runs (the node stays "
                "cordoned and labelled failed; delete its failed Jobs to try again)", "Warning",
            )  # fmt: skip
        for name in plan.stuck:
            j = next((x for x in jobs if x.name == name), None)
            if j is not None:
                self._event(
                    ("stuck", name), j.node, "PreflightNotStarted",
                    f"preflight Job {name} has not started after {self.limits.pending_timeout_s:.0f}s: not "
                    "recreated; see its pod's events", "Warning",
                )  # fmt: skip
        self.m.running.set(plan.running + len(plan.create))
        self.m.waiting.set(len(plan.waiting) + len(plan.latched))
        self.m.gave_up.set(len(plan.gave_up))
        self.m.stuck.set(len(plan.stuck))
        self._flush_events()  # what a transient failure kept

    def _brake(self, nodes: dict[str, NodeView]) -> bool:
        if not self.args.brake:
            return False
        prev = self.brake.admitted if self.brake is not None else self._read_admitted()
        st = brake_state(nodes.values(), self.args.max_unavailable, prev)
        was = self.brake.engaged if self.brake is not None else False
        self.brake = st
        self.m.brake.set(1 if st.engaged else 0)
        self.m.unavailable.set(len(st.unavailable))
        self.m.budget.set(st.budget)
        data = {**st.data(), BRAKE_SELECTOR: self.args.gpu_selector}
        tampered = self._brake_tampered()
        if tampered:
            self.brake_data = None  # write what was computed, now
        # What the agents act on (engaged, admitted) is written at once; the counts alone (for people and alerts)
        # at most once per resync, so a storm of Node changes is not a storm of ConfigMap writes and of watch
        # events to every agent.
        # Decisive changes are coalesced over BRAKE_BATCH_S: nodes failing together are admitted in one write (one
        # watch event per agent), at the cost of that much delay to their first NoExecute.
        old = self.brake_data or {}
        decisive = any(old.get(k) != data[k] for k in (BRAKE_ENGAGED, BRAKE_ADMITTED))
        since = time.monotonic() - self.brake_written_at
        self.brake_due = None
        if data != self.brake_data and (
            ((decisive or tampered) and since >= BRAKE_BATCH_S) or since >= self.args.resync
        ):
            self._write_brake(data)
            self.brake_written_at = time.monotonic()
        elif decisive or tampered:
            self.brake_due = self.brake_written_at + BRAKE_BATCH_S
        if st.engaged != was:
            what = "engaged" if st.engaged else "released"
            self.log.warning(
                f"fleet brake {what}", unavailable=len(st.unavailable), max_unavailable=st.budget, nodes=len(nodes)
            )
            self.brake_changes += 1
            self._event(
                ("brake", str(self.brake_changes)), None, "FleetBrakeEngaged" if st.engaged else "FleetBrakeReleased",
                f"{len(st.unavailable)} of {len(nodes)} GPU nodes held out of service by gpu-ready "
                f"(maxUnavailable {st.budget}): fleet brake {what}", "Warning" if st.engaged else "Normal",
            )  # fmt: skip
        return st.engaged

    def _brake_tampered(self) -> bool:
        """Whether the brake ConfigMap, as the watch last saw it, is not this controller's: absent, or a version
        it did not write whose data differs from what it wrote."""
        w = self.brake_watch
        if w is None or not w.known or self.brake_data is None:
            return False
        obj = w.get()
        if not w.live:
            # the watch fails (e.g. a copy over the watch's event limit: someone padded it); rewrite it, at most
            # once per resync, which also makes a watch possible again
            bad = time.monotonic() - self.brake_blind_at >= self.args.resync
            if bad:
                self.brake_blind_at = time.monotonic()
        elif obj is None:
            bad = True
        else:
            rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            bad = rv not in self.brake_versions and obj.get("data") != self.brake_data
        if bad and w.live:
            # the watch may not have delivered this controller's own newest write yet (it listed before the
            # first create): one read settles it, and only in this rare case
            bad = not self._brake_is_ours()
        if bad:
            self.brake_repairs += 1
            self.log.warning("the brake ConfigMap was changed by someone else: rewriting it", name=self.args.brake)
        return bad

    def _brake_is_ours(self) -> bool:
        """Whether the brake ConfigMap, read now, is a version this controller wrote or holds what it wrote."""
        cm = self._get_brake()
        if cm is None:
            return False  # absent (or unreadable: the rewrite that follows says which)
        rv = str((cm.get("metadata") or {}).get("resourceVersion") or "")
        return rv in self.brake_versions or cm.get("data") == self.brake_data

    def _cm_path(self, name: str | None = None) -> str:
        base = f"/api/v1/namespaces/{quote(self.args.namespace)}/configmaps"
        return f"{base}/{quote(name)}" if name else base

    def _get_brake(self) -> dict[str, Any] | None:
        """The brake ConfigMap read now; None when it is absent or cannot be read."""
        try:
            return self.api.request("GET", self._cm_path(self.args.brake))
        except ApiError:
            return None

    def _read_admitted(self) -> tuple[str, ...]:
        """At the start of a term: the admissions the previous holder published, kept first."""
        cm = self._get_brake()
        if cm is None:
            return ()
        self.brake_data = cm.get("data") or {}
        self._own_version(cm)
        return parse_admitted(cm.get("data")) or ()

    def _write_brake(self, data: dict[str, str]) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": self.args.brake, "namespace": self.args.namespace,
                         "labels": {MANAGED_LABEL: MANAGED_VALUE}},
            "data": data,
        }  # fmt: skip
        try:
            out = self.api.request("PUT", self._cm_path(self.args.brake), body)
        except ApiError as e:
            if e.status != 404:
                raise
            out = self.api.request("POST", self._cm_path(), body)
        self.brake_data = data
        self._own_version(out)

    def _own_version(self, obj: Any) -> None:
        rv = str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "") if isinstance(obj, dict) else ""
        if rv:
            self.brake_versions = [*self.brake_versions[-7:], rv]

    def _create(self, node: str, attempt: int) -> None:
        job = render_job(self.template, self.args.job_prefix, self.args.namespace, node, attempt)
        name = job["metadata"]["name"]
        try:
            self.api.request("POST", f"/apis/batch/v1/namespaces/{quote(self.args.namespace)}/jobs", job)
        except ApiError as e:
            if e.status == 409:
                return  # created by us (or the previous holder) already: the cache will show it
            self.log.warning("cannot create the preflight Job", node=node, job=name, error=str(e)[:300])
            return
        self.created[name] = (node, attempt, time.monotonic())
        self.m.created.inc()
        self.log.info("preflight Job created", node=node, job=name, attempt=attempt)

    def _delete(self, name: str) -> None:
        path = f"/apis/batch/v1/namespaces/{quote(self.args.namespace)}/jobs/{quote(name)}"
        try:
            self.api.request("DELETE", path, {"propagationPolicy": "Background"}, query={})
        except ApiError as e:
            if e.status != 404:
                self.log.warning("cannot delete the preflight Job", job=name, error=str(e)[:300])
                return
        self.m.deleted.inc()

    def _event(self, key: tuple[str, str], node: str | None, reason: str, note: str, type_: str) -> None:
        """One Event per key for this process (a restart may say it once more), written by report/events.py's
        writer. Regarding the Node, or (the brake) the controller's own Lease."""
        if key in self.reported:
            return
        self.reported.add(key)
        if node is not None:
            self.node_events.record(reason, note, "/".join(key), type_, "Preflight", node_ref(node))
        else:
            lease = {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": self.args.lease_name,
                "namespace": self.args.namespace,
            }  # fmt: skip
            self.lease_events.record(reason, note, "/".join(key), type_, "FleetBrake", lease)
        self._flush_events()

    def _flush_events(self) -> None:
        """Writes the Events recorded; one a transient failure kept is tried again on the next round."""
        for reporter in (self.node_events, self.lease_events):
            try:
                reporter.flush()
            except ApiError as e:
                self.log.warning("cannot write the Event; trying again next round", error=str(e)[:300])

    def _event_writer(self, namespace: str) -> EventReporter:
        instance = f"{REPORTING_CONTROLLER}-{self.args.identity}"
        return EventReporter(
            self.api, "", namespace=namespace, on_drop=self._event_refused, controller=REPORTING_CONTROLLER,
            instance=instance,
        )  # fmt: skip

    def _event_refused(self, p: PendingEvent | None, e: ApiError) -> None:
        self.log.warning("the Event was refused", reason=p.reason if p else "", error=str(e)[:300])


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_program_flags(p, ControllerSettings)


def check_args(a: argparse.Namespace) -> str | None:
    if not 1 <= a.max_concurrent <= 100:
        return "--max-concurrent must be 1..100"
    if not 1 <= a.max_failures <= 100:
        return "--max-failures must be 1..100"
    if a.backoff < 0 or a.pending_timeout <= 0 or a.resync <= 0 or not 2 <= a.lease_duration <= 300:
        return "--backoff, --pending-timeout, --resync and --lease-duration (2..300) must be positive"
    try:
        max_unavailable(a.max_unavailable, 100)
    except ValueError as e:
        return str(e)
    from agent.settings import host_port

    try:
        host_port(a.metrics_address)
    except ValueError as e:
        return f"--metrics-address: {e}"
    return None


def main(args: argparse.Namespace) -> int:
    from agent.http import HealthServer
    from agent.settings import ConfigError
    from agent.shutdown import on_stop_signals, wait_for_signal

    setup_logging(os.environ.get("GPU_READY_LOG_FORMAT", "auto"), os.environ.get("GPU_READY_LOG_LEVEL", "info"))
    problem = check_args(args)
    if problem:
        print(f"gpu-ready controller: {problem}", file=sys.stderr)
        return 2
    try:
        c = Controller(args)
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as e:
        print(f"gpu-ready controller: {(str(e) or type(e).__name__).splitlines()[0][:300]}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"gpu-ready controller: {e}", file=sys.stderr)
        return 2
    try:
        server = HealthServer(
            args.metrics_address, c.m.registry, lambda: (True, "ok"),
            lambda: (True, "leading" if c.elector.leading else "standby"),
        ).start()  # fmt: skip
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        print(f"gpu-ready controller: cannot serve --metrics-address {args.metrics_address}: {why}", file=sys.stderr)
        return 2
    stop = on_stop_signals(lambda name: c.log.info("stopping", signal=name))
    t = threading.Thread(target=c.run, name="controller", daemon=True)
    t.start()
    wait_for_signal(stop)
    c.shutdown()
    t.join(5.0)
    server.stop()
    return 0
