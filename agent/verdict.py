"""The one place that decides readiness: findings + latched faults -> Verdict. Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from agent.model import (
    FAULT_REASONS,
    Check,
    Counts,
    Finding,
    GpuIdentity,
    GpuStatus,
    LatchedFault,
    Observation,
    PciAddress,
    Reason,
    Severity,
    Status,
    Verdict,
)

MESSAGE_LIMIT = 1000  # bytes; the condition message stays under 1 KiB


def gpu_label(addr: PciAddress | None, gpus: dict[PciAddress, GpuIdentity]) -> str:
    if addr is None:
        return "node"
    ident = gpus.get(addr)
    if ident is not None and ident.index is not None:
        return f"GPU {ident.index} ({addr.nvml})"
    return f"GPU {addr.nvml}"


def count_mismatches(c: Counts, expected: int | None) -> list[str]:
    out = []
    if c.pci is not None and c.nvidia_smi is not None and c.pci != c.nvidia_smi:
        out.append(f"PCI shows {c.pci} GPUs, nvidia-smi {c.nvidia_smi}")
    if c.pci is not None and c.plugin_physical is not None and c.pci != c.plugin_physical:
        out.append(f"PCI shows {c.pci} GPUs, the device plugin serves {c.plugin_physical}")
    if expected is not None:
        seen = [n for n in (c.pci, c.nvidia_smi) if n is not None]
        if seen and min(seen) < expected:
            out.append(f"expected {expected} GPUs, found {min(seen)}")
    return out


def render_message(groups: list[tuple[str, list[str]]], limit: int = MESSAGE_LIMIT) -> str:
    """ "Reason: item, item; Reason: item" kept under `limit` bytes; what does not fit is counted."""
    total = sum(len(items) for _, items in groups)
    out = ""
    used = 0
    for head, items in groups:
        for i, item in enumerate(items):
            piece = (f"; {head}: " if out else f"{head}: ") + item if i == 0 else ", " + item
            tail = f" (+{total - used - 1} more)" if total - used - 1 else ""
            if len((out + piece + tail).encode()) > limit:
                if not out:  # a single item longer than the limit
                    cut = (piece.encode()[: limit - len(tail.encode()) - 4]).decode("utf-8", "ignore")
                    return cut + "…" + tail
                return out + f" (+{total - used} more)"
            out += piece
            used += 1
    return out


def decide(
    obs: Observation,
    latched: Sequence[LatchedFault] = (),
    *,
    preflight_required: bool = False,
    preflight_passed: bool = True,
) -> Verdict:
    gpus = obs.gpus
    by_reason: dict[Reason, list[str]] = {}
    problems: dict[PciAddress, list[str]] = {}
    gpu_reasons: dict[PciAddress, set[Reason]] = {}
    unchecked: list[Finding] = []

    def add(reason: Reason, text: str, addr: PciAddress | None) -> None:
        label = gpu_label(addr, gpus)
        by_reason.setdefault(reason, []).append(f"{label}: {text}" if addr is not None else text)
        if addr is not None:
            problems.setdefault(addr, []).append(f"{reason.value}: {text}")
            gpu_reasons.setdefault(addr, set()).add(reason)

    # Faults on the node's own GPUs first (the actionable ones; they survive message truncation), then
    # addresses that match no GPU and NVSwitch SXids; oldest first within each group.
    for lf in sorted(latched, key=lambda f: (f.gpu is None or f.gpu not in gpus, f.since, f.key)):
        what = {"sxid": f"fatal SXid {lf.xid} on NVSwitch {lf.raw_address}", "fallen_off_bus": "fell off the bus"}.get(
            lf.source, f"Xid {lf.xid}"
        )
        if lf.source == "xid" and lf.gpu is not None and lf.gpu not in gpus:
            what += " (address matches no known GPU)"
        add(Reason.FATAL_XID, what, lf.gpu)

    smi_ran = True
    for f in obs.findings:
        if f.severity is Severity.FAULT and f.reason is not None:
            add(f.reason, f.message, f.gpu)
            if f.check is Check.NVIDIA_SMI and f.gpu is None:
                smi_ran = False
        elif f.severity is Severity.UNCHECKED:
            unchecked.append(f)
            if f.check is Check.NVIDIA_SMI:
                smi_ran = False

    for text in count_mismatches(obs.counts, obs.expected_gpus):
        by_reason.setdefault(Reason.GPU_COUNT_MISMATCH, []).append(text)
    # Compare addresses, not only counts: a duplicated bus id in nvidia-smi keeps the counts equal.
    on_pci, in_smi = obs.seen.get(Check.PCI), obs.seen.get(Check.NVIDIA_SMI)
    if on_pci is not None and in_smi is not None:
        for addr in sorted(on_pci - in_smi):
            add(Reason.GPU_COUNT_MISMATCH, "on PCI but not in nvidia-smi", addr)

    if preflight_required and not preflight_passed:
        by_reason.setdefault(Reason.PREFLIGHT_NOT_PASSED, []).append("node is not labelled preflight=passed")

    reasons = tuple(r for r in FAULT_REASONS if r in by_reason)
    if reasons:
        status, reason = Status.FALSE, reasons[0]
        groups = [(r.value, by_reason[r]) for r in reasons]
        if unchecked:
            groups.append(("could not check", [f.message for f in unchecked]))
    elif unchecked:
        status, reason, reasons = Status.UNKNOWN, Reason.CHECK_FAILED, (Reason.CHECK_FAILED,)
        groups = [("CheckFailed", [f"{f.check.value}: {f.message}" for f in unchecked])]
    else:
        status, reason, reasons = Status.TRUE, Reason.GPUS_HEALTHY, (Reason.GPUS_HEALTHY,)
        n = obs.counts.nvidia_smi if obs.counts.nvidia_smi is not None else len(gpus)
        groups = [("", [f"{n} GPUs healthy"])]

    # A source that could not run checked no GPU this cycle (per GPU, so a reporter can tell "clean" from
    # "not looked at" for each of its faults: fencing keeps an NVML rule while NVML cannot run).
    not_checked = tuple(c for c in Check if any(f.check is c for f in unchecked))
    rows = []
    for addr in sorted(set(gpus) | set(problems)):
        ident = gpus.get(addr, GpuIdentity(addr))
        probs = tuple(problems.get(addr, ()))
        healthy: bool | None = False if probs else (True if smi_ran else None)
        mine = gpu_reasons.get(addr, set())
        rows.append(
            GpuStatus(
                ident.index, addr.nvml, ident.name, healthy, probs, tuple(r for r in Reason if r in mine), not_checked
            )
        )
    rows.sort(key=lambda r: (r.index is None, r.index if r.index is not None else 0, r.pci_bus_id))
    message = render_message(groups) if groups[0][0] else groups[0][1][0]
    return Verdict(status, reason, message, tuple(rows), reasons, obs.counts)


def with_note(v: Verdict, note: str, limit: int = MESSAGE_LIMIT) -> Verdict:
    """The verdict with `note` appended to its message ("<message>; <note>"), the whole kept within `limit`
    bytes: the message is cut (with "…") so that the note, which reporters add last, always shows."""
    if not note:
        return v
    note_b = note.encode()[: limit // 2].decode("utf-8", "ignore")
    room = limit - len(("; " + note_b).encode())
    msg = v.message
    if len(msg.encode()) > room:
        msg = msg.encode()[: max(0, room - len("…".encode()))].decode("utf-8", "ignore") + "…"
    message = f"{msg}; {note_b}" if msg else note_b
    return replace(v, message=message)
