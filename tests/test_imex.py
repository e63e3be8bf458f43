"""IMEX (agent/probes/imex.py) against the simulated host's control-tool stand-in (no public capture of
`nvidia-imex-ctl -q` was at hand, docs/fabric.md): where the node runs its daemon as a service (`imexDaemon: host`),
a daemon not running is FabricNotReady; where the DRA driver starts it per ComputeDomain (the default), it is idle;
a tool killed by a signal is could not check in both, never idle."""

from __future__ import annotations

import sys

import pytest

from agent import config
from agent.checks import combine
from agent.model import Reason, Severity, Status
from agent.probes.base import ProbeContext
from agent.probes.imex import ImexProbe
from agent.settings import ConfigError
from agent.verdict import decide
from testkit.simhost import SimHost

REFUSED = "Connection refused: is the IMEX daemon running?"


def read(host: SimHost, daemon: str = "dra"):
    r = ImexProbe(str(host.imex_ctl), 10.0, daemon).read(ProbeContext())
    return r, decide(combine([r], None), [])


def test_a_daemon_not_running_is_idle_per_compute_domain_and_not_ready_as_a_service(simhost: SimHost):
    simhost.set_imex(REFUSED, exit_code=1)
    r, v = read(simhost)
    assert [(f.severity, f.kind) for f in r.findings] == [(Severity.INFO, "imex_idle")] and v.status is Status.TRUE
    r, v = read(simhost, "host")
    assert [(f.severity, f.kind) for f in r.findings] == [(Severity.FAULT, "imex_not_running")]
    assert (v.status, v.reason) == (Status.FALSE, Reason.FABRIC_NOT_READY)
    assert "IMEX daemon not running (the node runs it as a service): Connection refused" in v.message
    simhost.set_imex("READY")
    for daemon in ("dra", "host"):
        assert read(simhost, daemon)[1].status is Status.TRUE


@pytest.mark.parametrize("daemon", ["dra", "host"])
def test_a_tool_killed_by_a_signal_is_could_not_check_not_idle(simhost: SimHost, daemon):
    simhost.imex_ctl.write_text(f"#!{sys.executable}\nimport os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    simhost.imex_ctl.chmod(0o755)
    r, v = read(simhost, daemon)
    assert not r.ran and [f.severity for f in r.findings] == [Severity.UNCHECKED]
    assert "killed by signal 11" in r.findings[0].message and v.status is Status.UNKNOWN


def test_the_setting():
    assert config.defaults().imex_daemon == "dra" and config.defaults(imex_daemon="host").imex_daemon == "host"
    with pytest.raises(ConfigError):
        config.defaults(imex_daemon="systemd")
