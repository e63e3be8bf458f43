"""The MIG layout mig-manager was asked for (the Node's nvidia.com/mig.config labels) against the MIG instances
the GPU sources listed this cycle; the judgement itself is pure (agent/mig_layout.py)."""

from __future__ import annotations

from agent.mig_layout import judge_mig_config, node_mig_inputs
from agent.model import Check, ProbeResult
from agent.probes.base import ProbeContext


class MigConfigProbe:
    """Runs after every GPU source: needs the Node (its labels) and the GPUs they listed. A pending plan is timed
    from the cycle it was first seen (kept here); a one-shot `check` never times one out."""

    check = Check.MIG_LAYOUT

    def __init__(self, pending_timeout_s: float) -> None:
        self.pending_timeout_s = pending_timeout_s
        self.pending_since: float | None = None  # when nvidia.com/mig.config.state=pending was first seen

    def read(self, context: ProbeContext) -> ProbeResult:
        if context.node is None:
            return ProbeResult(Check.MIG_LAYOUT)
        labels, advertised = node_mig_inputs(context.node)
        judged = judge_mig_config(
            labels,
            list(context.gpus().values()),
            advertised,
            now=context.now,
            pending_since=self.pending_since,
            timeout_s=self.pending_timeout_s,
        )
        self.pending_since = judged.pending_since
        return ProbeResult(Check.MIG_LAYOUT, judged.findings)
