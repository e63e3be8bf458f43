"""What every preflight gate returns, the gate names and their default timeouts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GATES = ("spec", "burnin", "nvlink", "cuda", "serving")
PASS, FAIL, SKIP = "pass", "fail", "skipped"
DEFAULT_TIMEOUTS = {"spec": 60.0, "burnin": 900.0, "nvlink": 300.0, "cuda": 120.0, "serving": 900.0}


@dataclass
class GateResult:
    gate: str
    status: str
    reason: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    timeout_s: float = 0.0

    @classmethod
    def from_mapping(cls, data: Any) -> GateResult:
        """A result read back from JSON (the gates step's results file); raises ValueError when malformed."""
        if not isinstance(data, dict):
            raise ValueError("a gate result must be a mapping")
        gate, status = data.get("gate"), data.get("status")
        if gate not in GATES or status not in (PASS, FAIL, SKIP):
            raise ValueError(f"bad gate result {str(data)[:120]!r}")
        evidence = data.get("evidence") or {}
        return cls(
            gate,
            status,
            str(data.get("reason", ""))[:2000],
            evidence if isinstance(evidence, dict) else {"evidence": evidence},
            float(data.get("duration_s") or 0.0),
            float(data.get("timeout_s") or 0.0),
        )


GateFn = Callable[[], GateResult]


def passed(results: list[GateResult], allow_skip: list[str]) -> tuple[bool, list[GateResult]]:
    """All gates pass; a skipped gate counts as passed only where the profile allows it."""
    blocking = [r for r in results if r.status == FAIL or (r.status == SKIP and r.gate not in allow_skip)]
    return not blocking, blocking
