"""One active controller: a `coordination.k8s.io/v1` Lease, as client-go's leader election holds it.

The holder renews `spec.renewTime` every `renew_s`; a standby reads the Lease every `retry_s` and takes it
over once the record it sees has not changed for `duration_s` on its own clock (never comparing another
machine's clock). Every write carries the resourceVersion it read, so two standbys racing for an expired
Lease cannot both win (one gets 409). A holder that cannot renew for `duration_s` stops acting before a
standby may take over (it steps down at `duration_s - retry_s` after its last renewal)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from agent.clock import micro_time
from agent.kube.client import ApiError, KubeApi


class LeaseElector:
    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        duration_s: float = 10.0,
        renew_s: float = 3.0,
        retry_s: float = 2.0,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.duration_s, self.renew_s, self.retry_s = duration_s, renew_s, retry_s
        self.mono, self.wall = mono, wall
        self.leading = False
        self.renewed_at = 0.0  # mono of our last successful renewal
        self.observed: tuple[Any, ...] | None = None  # the record last seen (holder, renewTime, transitions)
        self.observed_at = 0.0  # mono when it last changed
        self.transitions = 0
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"

    def _body(self, rv: str | None, transitions: int, acquire: str | None) -> dict[str, Any]:
        now = micro_time(self.wall())
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.duration_s),
            "renewTime": now,
            "leaseTransitions": transitions,
            "acquireTime": acquire or now,
        }
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if rv:
            meta["resourceVersion"] = rv
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def step(self) -> bool:
        """One try: acquire or renew. Returns whether this replica leads now. Never raises for an API error
        (a failed renewal counts against the lease duration)."""
        try:
            self._step()
        except ApiError:
            pass
        if self.leading and self.mono() - self.renewed_at > self.duration_s - self.retry_s:
            self.leading = False  # could not renew in time: stop before anyone may take over
        return self.leading

    def _step(self) -> None:
        try:
            lease = self.api.request("GET", f"{self.path}/{quote(self.name)}")
        except ApiError as e:
            if e.status != 404:
                raise
            self.api.request("POST", self.path, self._body(None, 0, None))
            self._won(0)
            return
        spec = lease.get("spec") or {}
        rv = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        now = self.mono()
        if record != self.observed:
            self.observed, self.observed_at = record, now
        transitions = int(spec.get("leaseTransitions") or 0)
        duration = float(spec.get("leaseDurationSeconds") or self.duration_s)
        if holder == self.identity:
            self.api.request(
                "PUT", f"{self.path}/{quote(self.name)}", self._body(rv, transitions, spec.get("acquireTime"))
            )
            self._won(transitions)
            return
        self.leading = False
        if holder and now - self.observed_at < duration:
            return  # held by someone alive (as far as our own clock can tell)
        self.api.request("PUT", f"{self.path}/{quote(self.name)}", self._body(rv, transitions + 1, None))
        self._won(transitions + 1)

    def _won(self, transitions: int) -> None:
        self.leading = True
        self.renewed_at = self.mono()
        self.transitions = transitions

    def release(self) -> None:
        """On a clean shutdown: hand the Lease over at once (holder cleared) so a standby need not wait."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = self.api.request("GET", f"{self.path}/{quote(self.name)}")
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            self.api.request("PUT", f"{self.path}/{quote(self.name)}", lease)
        except ApiError:
            pass
