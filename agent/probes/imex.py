"""IMEX (NVL72-class systems, opt-in with `imex`): the readiness of the node's IMEX daemon, which shares GPU memory
across the nodes of one NVLink domain, as its control tool reports it: `nvidia-imex-ctl -q` prints the local daemon's
state on its first line (READY when the daemon has joined its domain).

Where the daemon runs decides what "not running" means (`imexDaemon`):
- `dra` (default): on Kubernetes the IMEX daemon runs only while a workload's compute domain is placed on the node
  (NVIDIA's DRA driver starts it per ComputeDomain), so a tool that cannot reach a daemon (a non-zero exit) is idle
  (info), never a fault;
- `host`: the node runs its IMEX daemon as a service (IMEX enabled on the node): a tool that cannot reach it (no
  process, no socket, the unit failed) is FabricNotReady (`imex_not_running`): multi-node memory sharing cannot
  start on this node.
Judged in both:
- a daemon that answers with a state other than READY: GPUDegraded (`imex_not_ready`), naming the state: the
  node's GPUs work, multi-node memory sharing over NVLink does not;
- the tool missing, hung, killed by a signal (an exit status of 128 + N), or printing nothing: could not check,
  never idle.
The tool runs under the same supervision as nvidia-smi (hard timeout, output cap, nothing left behind)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.model import Check, Finding, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.proc import SupervisedRunner
from agent.settings import choice, positive, setting, to_bool, to_float, to_str

_STATE = re.compile(r"^\s*([A-Z][A-Z_]{1,31})\s*$")
READY = "READY"
SIGNALLED = 128  # an exit status above this: killed by signal (status - 128), as the supervisor reports it


class ImexProbe:
    check = Check.IMEX

    def __init__(self, ctl: str, timeout_s: float, daemon: str = "dra") -> None:
        self.runner = SupervisedRunner(ctl, timeout_s, max_output_bytes=64 << 10)
        self.daemon = daemon  # "dra": runs per ComputeDomain (not running: idle); "host": a service of the node

    def read(self, context: ProbeContext) -> ProbeResult:
        run = self.runner.run(("-q",))
        if run.error is not None or run.timed_out or run.output_capped:
            why = run.error or ("timed out" if run.timed_out else "output too long")
            return ProbeResult.of(Check.IMEX, (Finding.unchecked(Check.IMEX, f"IMEX: {self.runner.name}: {why}"),))
        first = next((line for line in run.output.splitlines() if line.strip()), "")[:200]
        if run.exit_code is not None and run.exit_code > SIGNALLED:
            return ProbeResult.of(
                Check.IMEX,
                (
                    Finding.unchecked(
                        Check.IMEX, f"IMEX: {self.runner.name} killed by signal {run.exit_code - SIGNALLED}"
                    ),
                ),
            )
        if run.exit_code != 0 and self.daemon == "host":
            return ProbeResult.of(
                Check.IMEX,
                (
                    Finding.fault(
                        Check.IMEX,
                        Reason.FABRIC_NOT_READY,
                        f"IMEX daemon not running (the node runs it as a service): {first.strip()[:120]}",
                        kind="imex_not_running",
                    ),
                ),
                payload={"state": "not running"},
            )
        if run.exit_code != 0:
            return ProbeResult.of(
                Check.IMEX,
                (Finding.info(Check.IMEX, f"IMEX daemon idle (not running here): {first.strip()}", kind="imex_idle"),),
                payload={"state": "idle"},
            )
        m = _STATE.match(first)
        if m is None:
            return ProbeResult.of(
                Check.IMEX,
                (Finding.unchecked(Check.IMEX, f"IMEX: {self.runner.name} -q printed {first[:60]!r}, not a state"),),
            )
        if m[1] != READY:
            return ProbeResult.of(
                Check.IMEX,
                (
                    Finding.fault(
                        Check.IMEX, Reason.GPU_DEGRADED, f"IMEX daemon not ready: {m[1]}", kind="imex_not_ready"
                    ),
                ),
                payload={"state": m[1]},
            )
        return ProbeResult.of(Check.IMEX, payload={"state": READY})


@dataclass(frozen=True)
class ImexSettings:
    """Settings of the IMEX probe."""

    imex: bool = setting(to_bool, False, "judge the IMEX daemon's readiness (NVL72-class systems; idle is not a fault)")
    imex_ctl: str = setting(to_str, "nvidia-imex-ctl", "the IMEX control tool (run as `<imexCtl> -q` each poll)")
    imex_timeout: float = setting(positive(to_float, 3600), 10.0, "seconds one IMEX query may take")
    imex_daemon: str = setting(
        choice("dra", "host"),
        "dra",
        "where the IMEX daemon runs: dra = per ComputeDomain (not running: idle); host = a service of the node "
        "(not running: FabricNotReady)",
    )
