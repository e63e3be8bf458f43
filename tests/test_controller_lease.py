"""The controller's leader election (agent/controller/lease.py) on the real apiserver: one replica acts, a standby
takes the Lease only once the record it sees has not changed for the lease duration on its own clock, two standbys
racing for an expired Lease cannot both win, a holder that cannot renew stops acting before anyone may take over,
and a clean shutdown hands the Lease over at once. The electors' monotonic and wall clocks are plain numbers the
test sets: what is asserted is what each step decides and what it sent, never how long anything took."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from agent.clock import micro_time
from agent.controller.lease import LeaseElector
from agent.kube.client import KubeApi
from testkit.cluster import ensure_namespace

pytestmark = pytest.mark.apiserver

DURATION, RENEW, RETRY = 10.0, 3.0, 2.0


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Replica:
    """One controller replica's elector, with its own client (its requests counted) and its own clocks."""

    def __init__(self, cp: Any, ns: str, name: str, identity: str) -> None:
        self.api: KubeApi = cp.admin()
        self.sent: list[tuple[str, int]] = []
        self.api.on_request = lambda verb, code: self.sent.append((verb, code))
        self.mono, self.wall = Clock(), Clock(1_800_000_000.0)
        self.elector = LeaseElector(
            self.api, ns, name, identity, DURATION, RENEW, RETRY, mono=self.mono, wall=self.wall
        )

    def step(self) -> bool:
        return self.elector.step()

    def taken(self) -> list[tuple[str, int]]:
        out, self.sent[:] = list(self.sent), []
        return out


@pytest.fixture
def replicas(control_plane: Any, admin: KubeApi) -> Iterator[Any]:
    ns = f"lease-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    made: list[Replica] = []

    def _make(identity: str) -> Replica:
        r = Replica(control_plane, ns, "ctl", identity)
        made.append(r)
        return r

    yield _make
    for r in made:
        r.api.close()


def lease(r: Replica) -> dict[str, Any]:
    return r.api.request("GET", f"{r.elector.path}/ctl")


def test_the_first_replica_creates_the_lease_and_renews_it_keeping_its_acquire_time(replicas):
    a = replicas("a")
    assert a.step()
    assert a.taken() == [("GET", 404), ("POST", 201)]
    spec = lease(a)["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 0 and spec["leaseDurationSeconds"] == 10
    assert spec["acquireTime"] == spec["renewTime"] == micro_time(a.wall.t)
    acquired = spec["acquireTime"]
    a.taken()
    a.wall.t += RENEW
    a.mono.t += RENEW
    assert a.step()
    assert a.taken() == [("GET", 200), ("PUT", 200)]  # a renewal: one read, one write carrying its version
    spec = lease(a)["spec"]
    assert spec["renewTime"] == micro_time(a.wall.t) and spec["acquireTime"] == acquired
    assert spec["leaseTransitions"] == 0


def test_a_standby_takes_over_only_once_the_record_stood_still_for_the_duration_on_its_own_clock(replicas):
    a, b = replicas("a"), replicas("b")
    assert a.step()
    b.wall.t = a.wall.t + 3600  # another machine's wall clock, an hour off: never compared with the Lease's times
    assert not b.step()
    assert b.taken() == [("GET", 200)]  # a standby only reads
    a.mono.t += RENEW
    a.wall.t += RENEW
    assert a.step()  # a renews: the record changes
    b.mono.t += DURATION - 1
    assert not b.step() and b.taken() == [("GET", 200)]  # it changed since b last looked: a is alive
    b.mono.t += DURATION - 1  # a has stopped renewing: the same record for DURATION - 1 on b's clock
    assert not b.step() and b.taken() == [("GET", 200)]
    b.mono.t += 2
    assert b.step()  # unchanged for longer than the duration: taken over
    assert b.taken() == [("GET", 200), ("PUT", 200)]
    spec = lease(b)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1 and b.elector.transitions == 1
    a.taken()
    a.mono.t += RENEW
    assert not a.step() and a.taken() == [("GET", 200)]  # the old holder sees b's record and stands by


def test_two_standbys_racing_for_an_expired_lease_cannot_both_win(replicas):
    a, b, c = replicas("a"), replicas("b"), replicas("c")
    assert a.step()
    for r in (b, c):
        assert not r.step()
        r.mono.t += DURATION + 1  # a is gone: both see the record unchanged for longer than the duration
    real = c.api.request

    def c_request(method: str, path: str, *args: Any, **kw: Any) -> Any:
        out = real(method, path, *args, **kw)
        if method == "GET" and not b.elector.leading:
            assert b.step()  # b takes the Lease between c's read and c's write
        return out

    c.api.request = c_request  # type: ignore[method-assign]
    b.taken()
    c.taken()
    assert not c.step()
    assert c.taken() == [("GET", 200), ("PUT", 409)]  # c's write carried the version it read: refused
    assert b.taken() == [("GET", 200), ("PUT", 200)]
    spec = lease(b)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert [r.elector.leading for r in (a, b, c)] == [True, True, False]  # a does not know yet ...
    a.mono.t += RENEW
    assert not a.step()  # ... until its next step: one leader


def test_a_holder_that_cannot_renew_stops_acting_before_a_standby_may_take_over(control_plane, replicas):
    a = replicas("a")
    assert a.step()
    renewed = a.mono.t
    a.elector.api = KubeApi.from_token("https://127.0.0.1:1", control_plane.admin_token, control_plane.ca_file)
    a.mono.t = renewed + (DURATION - RETRY) - 0.5
    assert a.step()  # a failed renewal, still within duration - retry of the last good one
    a.mono.t = renewed + (DURATION - RETRY) + 0.5
    assert not a.step()  # stepped down: before DURATION, the earliest a standby could take over
    a.elector.api.close()


def test_a_clean_shutdown_hands_the_lease_over_at_once(replicas):
    a, b = replicas("a"), replicas("b")
    assert a.step()
    assert not b.step()
    a.elector.release()
    assert not a.elector.leading and lease(a)["spec"]["holderIdentity"] == ""
    assert b.step()  # at once: no lease duration to wait out
    assert lease(b)["spec"]["holderIdentity"] == "b" and lease(b)["spec"]["leaseTransitions"] == 1
    a.taken()
    a.elector.release()  # not leading: nothing sent
    assert a.taken() == [] and lease(b)["spec"]["holderIdentity"] == "b"
