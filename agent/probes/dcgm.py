"""dcgm-exporter cross-check (opt-in): the node's own dcgm-exporter `/metrics`, read with a bounded size and
a timeout, per GPU by `pci_bus_id` (or `UUID` through a map the caller passes in).

Read: `DCGM_EXP_GPU_HEALTH_STATUS` (DCGM health per watch: PASS 0 / WARN 10 / FAIL 20, labels
`health_watch`, `health_error_code`), `DCGM_FI_DEV_ROW_REMAP_FAILURE`, `DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`
(degraded when above 0), and as information `DCGM_FI_DEV_XID_ERRORS` (the last Xid, which never resets:
NVIDIA/dcgm-exporter#500), `DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS`, `DCGM_FI_DEV_ECC_SBE_VOL_TOTAL`.
DCGM's "blank" sentinels (values >= 2**63 - 32 or so, e.g. 9223372036854775794) mean "no data".

The host label is `Hostname` up to dcgm-exporter 4.5.x and `hostname` after NVIDIA/dcgm-exporter#655;
both are read. When `node_name` is set, series of another host are ignored (an address that reaches a
Service instead of the node's own pod would otherwise mix nodes).

Unreachable exporter: "could not check" when `required`, else an informational finding."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason, Severity
from agent.probes.base import ProbeContext
from agent.settings import metrics_url, optional, positive, setting, to_bool, to_float

HEALTH = "DCGM_EXP_GPU_HEALTH_STATUS"
XID = "DCGM_FI_DEV_XID_ERRORS"
REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
UNC_REMAPPED = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
DBE_VOL = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
SBE_VOL = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
WANTED = frozenset({HEALTH, XID, REMAP_FAILURE, UNC_REMAPPED, DBE_VOL, SBE_VOL})
BLANK_MIN = 9223372036854775794 - 64  # DCGM_*_BLANK sentinels sit just below 2**63
HEALTH_WARN, HEALTH_FAIL = 10, 20
MAX_LINE = 4096  # longer lines are skipped unread


@dataclass(frozen=True)
class DcgmThresholds:
    """Settings of the dcgm-exporter cross-check (docs/degradation.md)."""

    # e.g. http://$(NODE_IP):9400/metrics; None = off (opt-in)
    address: str | None = setting(
        optional(metrics_url),
        None,
        "dcgm-exporter metrics address on this node (host:port or URL; unset: cross-check off)",
        name="dcgm_exporter",
    )
    # unreachable exporter: "could not check" instead of informational
    required: bool = setting(
        to_bool, False, "an unreachable dcgm-exporter is 'could not check' (else informational)", name="dcgm_required"
    )
    timeout_s: float = setting(
        positive(to_float, 600), 5.0, "timeout for one dcgm-exporter scrape, seconds", name="dcgm_timeout"
    )
    max_bytes: int = 8 * 1024 * 1024  # a 8-GPU exporter with the default counters serves ~0.3 MiB
    node_name: str | None = None  # ignore series whose hostname label names another host


@dataclass
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class DcgmGpu:
    key: str  # pci_bus_id, UUID or gpu index as the exporter labelled it
    address: PciAddress | None
    values: dict[str, float] = field(default_factory=dict)
    last_xid: tuple[int, str] | None = None
    health: list[tuple[str, str, int]] = field(default_factory=list)  # (watch, error code, value)


class ExporterUnavailable(Exception):
    pass


def read_metrics(address: str, timeout_s: float, max_bytes: int) -> str:
    """GET the exporter's text; raises ExporterUnavailable (one line) on any failure or oversize body."""
    req = urllib.request.Request(address, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body: bytes = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ExporterUnavailable(f"{address}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ExporterUnavailable(f"{address}: {reason}") from None
    if len(body) > max_bytes:
        raise ExporterUnavailable(f"{address}: response larger than {max_bytes} bytes")
    return body.decode("utf-8", "replace")


def parse_labels(text: str) -> dict[str, str] | None:
    """`a="x",b="y\\"z"` -> dict; None when malformed. One pass over the text."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " ,":
            i += 1
        if i >= n:
            break
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= n or text[eq + 1] != '"':
            return None
        key = text[i:eq].strip()
        j = eq + 2
        buf: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
                buf.append({"n": "\n"}.get(text[j], text[j]))
            else:
                buf.append(text[j])
            j += 1
        if j >= n:
            return None
        out[key] = "".join(buf)
        i = j + 1
    return out


def parse_metrics(text: str, wanted: frozenset[str] = WANTED) -> list[Sample]:
    """The samples of the `wanted` families from Prometheus text exposition; linear in the input."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line[0] == "#" or len(line) > MAX_LINE:
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            if name not in wanted:
                continue
            close = line.rfind("}")
            if close < brace:
                continue
            labels = parse_labels(line[brace + 1 : close])
            rest = line[close + 1 :].split()
        else:
            name = line[:space] if space > 0 else line
            if name not in wanted:
                continue
            labels = {}
            rest = line[space + 1 :].split() if space > 0 else []
        if labels is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out.append(Sample(name, labels, value))
    return out


def host_of(labels: Mapping[str, str]) -> str | None:
    return labels.get("hostname", labels.get("Hostname"))


def group_by_gpu(
    samples: list[Sample], uuid_to_address: Mapping[str, PciAddress] | None = None, node_name: str | None = None
) -> dict[str, DcgmGpu]:
    gpus: dict[str, DcgmGpu] = {}
    for s in samples:
        host = host_of(s.labels)
        if node_name and host and host != node_name:
            continue
        if s.value >= BLANK_MIN:
            continue
        if s.labels.get("GPU_I_ID"):  # MIG instance rows repeat the parent GPU's device fields
            continue
        uuid = s.labels.get("UUID") or s.labels.get("gpu_uuid") or ""
        addr = PciAddress.parse(s.labels.get("pci_bus_id", "")) or (uuid_to_address or {}).get(uuid)
        key = addr.nvml if addr else (uuid or f"gpu {s.labels.get('gpu', '?')}")
        g = gpus.setdefault(key, DcgmGpu(key, addr))
        if s.name == HEALTH:
            g.health.append((s.labels.get("health_watch", "?"), s.labels.get("health_error_code", ""), int(s.value)))
        elif s.name == XID:
            if s.value:
                g.last_xid = (int(s.value), s.labels.get("err_msg", ""))
        else:
            g.values[s.name] = max(s.value, g.values.get(s.name, 0.0))
    return gpus


def findings_from_metrics(
    text: str,
    thresholds: DcgmThresholds = DcgmThresholds(),
    uuid_to_address: Mapping[str, PciAddress] | None = None,
) -> list[Finding]:
    gpus = group_by_gpu(parse_metrics(text), uuid_to_address, thresholds.node_name)
    if not gpus:
        return [_unreachable(thresholds, "the exporter serves none of the DCGM health, ECC or row-remap metrics")]
    out: list[Finding] = []
    for key, g in sorted(gpus.items()):
        out += _gpu_findings(key, g)
    return out


def _gpu_findings(key: str, g: DcgmGpu) -> list[Finding]:
    addr = g.address
    who = "" if addr else f"{key}: "
    out: list[Finding] = []

    def fault(text: str, kind: str) -> None:
        out.append(Finding.fault(Check.DCGM, Reason.GPU_DEGRADED, who + text, addr, kind=kind))

    def info(text: str, kind: str) -> None:
        out.append(Finding(Check.DCGM, Severity.INFO, who + text, None, addr, kind))

    for watch, code, value in sorted(g.health):
        if value >= HEALTH_FAIL:
            fault(f"DCGM health {watch}: FAIL ({code or 'no error code'})", "dcgm_health")
        elif value >= HEALTH_WARN:
            info(f"DCGM health {watch}: WARN ({code or 'no error code'})", "dcgm_health_warn")
    if g.values.get(REMAP_FAILURE, 0) > 0:
        fault("DCGM: row remapping failed", "dcgm_row_remap_failure")
    dbe = g.values.get(DBE_VOL, 0)
    if dbe > 0:
        fault(f"DCGM: {dbe:g} uncorrectable (double-bit) ECC errors since the last reset", "dcgm_ecc_dbe")
    unc = g.values.get(UNC_REMAPPED, 0)
    if unc > 0:
        info(f"DCGM: {unc:g} rows remapped for uncorrectable errors", "dcgm_remapped_rows")
    sbe = g.values.get(SBE_VOL, 0)
    if sbe > 0:
        info(f"DCGM: {sbe:g} correctable ECC errors since the last reset", "dcgm_ecc_sbe")
    if g.last_xid:
        xid, msg = g.last_xid
        info(f"DCGM: last Xid {xid}{f' ({msg})' if msg else ''}", "dcgm_last_xid")
    return out


def _unreachable(t: DcgmThresholds, why: str) -> Finding:
    if t.required:
        return Finding.unchecked(Check.DCGM, f"dcgm-exporter: {why}", kind="unavailable")
    return Finding.info(Check.DCGM, f"dcgm-exporter not used: {why}", kind="unavailable")


def dcgm_findings(thresholds: DcgmThresholds, uuid_to_address: Mapping[str, PciAddress] | None = None) -> list[Finding]:
    """Off (no findings) unless an address is set."""
    if not thresholds.address:
        return []
    try:
        text = read_metrics(thresholds.address, thresholds.timeout_s, thresholds.max_bytes)
    except ExporterUnavailable as e:
        return [_unreachable(thresholds, str(e))]
    return findings_from_metrics(text, thresholds, uuid_to_address)


class DcgmProbe:
    """The opt-in dcgm-exporter cross-check: its health series on this node's GPUs (matched by NVML's UUIDs)."""

    check = Check.DCGM

    def __init__(self, thresholds: DcgmThresholds) -> None:
        self.thresholds = thresholds

    def read(self, context: ProbeContext) -> ProbeResult:
        from agent.probes.nvml import NvmlSnapshot

        snap = context.payload(Check.NVML, NvmlSnapshot)
        uuids = {g.uuid: g.address for g in (snap.gpus if snap else ()) if g.uuid and g.address is not None}
        return ProbeResult.of(Check.DCGM, dcgm_findings(self.thresholds, uuids))
