"""NVML through nvidia-ml-py (module `pynvml`), optional: used when libnvidia-ml loads.

Per GPU: a handle error (GPU lost, reset required, unknown), a GPU recovery action other than none,
a row-remap failure (pending remaps are reported, not a fault), NVLink links down where NVLink is fitted.
Every call runs in a worker thread under a deadline (probes/bounded.py, the mechanism the sysfs reads share); a call
that never returns is abandoned and no further NVML call starts while it is stuck.

NVLink is judged against what is fitted, not against every link index NVML answers: a PCIe GPU without bridges
(A100/H100 PCIe) answers every link as disabled, and a bridged pair uses only some of its links. A link not up is
down only when something says it should be up (`nvlink_verdict`): it was up earlier in this boot (kept with the
boot id in the state file, so a restart does not forget it), NVML names a GPU or an NVSwitch at its far end, or the
node's topology expects that many links up (`expectedNvlinks` for every GPU, `nvlinkProfiles` per model). Every link
disabled with none of that is "no NVLink fitted": reported (info), never a fault. A GPU in MIG mode is not judged.

For the degradation probes (docs/degradation.md) it also reads, when asked, each GPU's PCIe load (utilisation and
link generation, probes/pcie.py), one clock-event sample (probes/clocks.py), its UUID (to map
dcgm-exporter series) and its NVLink fabric (probes/fabric.py): the readings ride on the snapshot, the judging is
done by those probes."""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, GpuIdentity, PciAddress, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.probes.bounded import Blocked, BoundedCalls
from agent.probes.clocks import ClockSample, nvml_clock_sample
from agent.probes.fabric import FabricInfo, nvml_fabric
from agent.probes.pcie import GpuLoad, nvml_pcie_load
from agent.settings import choice, in_range, optional, positive, setting, to_bool, to_float, to_int, to_str

FI_DEV_GET_GPU_RECOVERY_ACTION = 230
RECOVERY_ACTIONS = {
    0: "None",
    1: "GPU reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}
HANDLE_FAULT_CODES = {15: "GPU is lost (fell off the bus)", 16: "GPU requires reset", 999: "unknown error"}


NvmlTimeout = Blocked  # an NVML call that did not return within the deadline, or one refused while another is stuck


@dataclass
class NvmlGpu:
    index: int
    address: PciAddress | None
    name: str | None = None
    mig_enabled: bool = False
    mig_devices: int = 0
    nvlink_links: int = 0  # link indices NVML answered
    nvlink_down: list[int] = field(default_factory=list)  # judged down (nvlink_verdict)
    nvlink_up: list[int] = field(default_factory=list)  # up at this read
    nvlink_fitted: bool | None = None  # False: every link disabled and nothing says one should be up; None: not read
    load: GpuLoad | None = None  # read when the probe was asked for PCIe load
    clock: ClockSample | None = None  # read when the probe was asked for clock events
    uuid: str | None = None  # read when the probe was asked for UUIDs
    # (MIG handle index, "MIG-..." UUID) per MIG device, read with the UUIDs (the pod-resources allocation map)
    mig_uuids: list[tuple[int, str]] = field(default_factory=list)
    fabric: FabricInfo | None = None  # read when the probe was asked for the NVLink fabric
    fabric_error: str | None = None  # why the fabric could not be read


@dataclass
class NvmlSnapshot:
    driver_version: str | None = None
    gpus: list[NvmlGpu] = field(default_factory=list)


MAX_NVLINKS = 64  # a bound for `expectedNvlinks` (NVML_NVLINK_MAX_LINKS is 18 today)
NVLINK_REMOTE_TYPES = frozenset({0, 2})  # nvmlNvLinkDeviceType: GPU, SWITCH (IBMNPU 1 and UNKNOWN 0xFF say nothing)


@dataclass(frozen=True)
class NvlinkVerdict:
    """What one GPU's link states say (`nvlink_verdict`)."""

    down: tuple[int, ...] = ()  # links not up that should be
    expected: int | None = None  # links the topology expects up (None: no expectation)
    up: int = 0
    fitted: bool = True  # False: every link disabled and nothing says one should be up
    judged: bool = True  # False: not judged (MIG mode)
    why: str = ""  # what expects them: "expectedNvlinks", "nvlinkProfiles", "NVSwitch system"

    @property
    def fault(self) -> bool:
        return self.judged and (bool(self.down) or (self.expected is not None and self.up < self.expected))


def nvlink_verdict(
    up: Sequence[bool],
    seen_up: Collection[int] = (),
    remote: Collection[int] = (),
    expected: int | None = None,
    mig: bool = False,
    why: str = "",
) -> NvlinkVerdict:
    """One GPU's links judged against what is fitted. up: each link index's state now; seen_up: links seen up
    earlier in this boot; remote: links whose far end NVML names (a GPU or an NVSwitch); expected: links the node's
    topology says are up (`expectedNvlinks` / `nvlinkProfiles`). A link not up is down only when it was seen up or has
    a far end; fewer links up than expected is a fault by itself. A GPU in MIG mode is not judged."""
    now_up = {i for i, u in enumerate(up) if u}
    known = (set(seen_up) | set(remote)) & set(range(len(up)))
    down = tuple(sorted(known - now_up))
    fitted = bool(now_up or known or expected)
    return NvlinkVerdict(down, expected, len(now_up), fitted, not mig, why)


def nvlink_findings(v: NvlinkVerdict, total: int, addr: PciAddress | None) -> list[Finding]:
    if not v.judged or total == 0:
        return []
    if not v.fitted:
        return [
            Finding.info(
                Check.NVML,
                f"no NVLink fitted: all {total} links disabled since the first read (a PCIe GPU without bridges)",
                addr,
                kind="nvlink_absent",
            )
        ]
    if not v.fault:
        return []
    parts = []
    if v.expected is not None and v.up < v.expected:
        parts.append(f"{v.up} of {v.expected} expected links up" + (f" ({v.why})" if v.why else ""))
    if v.down:
        parts.append(f"links {', '.join(map(str, v.down))} down (up earlier or connected)")
    return [Finding.fault(Check.NVML, Reason.NVML_HEALTH, f"NVLink down: {'; '.join(parts)}", addr, kind="nvlink_down")]


class LinkMemory:
    """The NVLinks seen up in this boot, per GPU bus id, in memory. The agent hands the probe its state file instead
    (agent/state.py keeps the same two methods), so that an agent restart does not forget a link that was up."""

    def __init__(self) -> None:
        self._up: dict[str, frozenset[int]] = {}
        self._lock = threading.Lock()

    def nvlinks_seen_up(self, gpu: str) -> frozenset[int]:
        with self._lock:
            return self._up.get(gpu, frozenset())

    def note_nvlinks_up(self, gpu: str, links: Collection[int]) -> None:
        with self._lock:
            self._up[gpu] = self._up.get(gpu, frozenset()) | frozenset(links)


def nvlink_profiles(v: Any) -> tuple[tuple[str, int], ...]:
    """`nvlinkProfiles`: "<model glob>=<links>" pairs, comma separated (or a mapping), e.g.
    "NVIDIA H100 80GB HBM3=18,NVIDIA A100-SXM4*=12": the links a GPU of that model (nvidia-smi's name, case
    ignored) has up on this node. The first pattern that matches wins."""
    if isinstance(v, dict):
        pairs = [(str(k), val) for k, val in v.items()]
    else:
        text = to_str(v)
        pairs = []
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            name, eq, n = item.rpartition("=")
            if not eq or not name.strip():
                raise ValueError(f"expected '<model glob>=<links>', got {item[:60]!r}")
            pairs.append((name.strip(), n.strip()))
    if len(pairs) > 64:
        raise ValueError(f"at most 64 profiles, got {len(pairs)}")
    out = []
    for name, n in pairs:
        if len(name) > 128:
            raise ValueError(f"a model pattern is at most 128 characters, got {len(name)}")
        out.append((name.lower(), in_range(to_int, 0, MAX_NVLINKS)(n)))
    return tuple(out)


def expected_links(
    name: str | None, every: int | None, profiles: Sequence[tuple[str, int]], links: int = 0, nvswitches: int = 0
) -> tuple[int | None, str]:
    """The links a GPU of this model must have up, and what says so: the first matching profile, else
    `expectedNvlinks`, else, on an NVSwitch system (NVSwitches on the node's PCI bus: an HGX/DGX baseboard wires every
    NVLink of every GPU to them), every one of the `links` NVML answers; else none."""
    model = (name or "").lower()
    for pattern, n in profiles:
        if fnmatch.fnmatchcase(model, pattern):
            return n, "nvlinkProfiles"
    if every is not None:
        return every, "expectedNvlinks"
    if nvswitches and links:
        return links, "NVSwitch system"
    return None, ""


class NvmlProbe:
    """The NVML probe. mode: "auto" (use when the library loads, skip otherwise), "on" (required), "off"."""

    def __init__(
        self,
        mode: str = "auto",
        deadline_s: float = 10.0,
        check_nvlink: bool = True,
        nvml: Any = None,
        *,
        pcie_load: bool = False,
        clock_events: bool = False,
        uuids: bool = False,
    ) -> None:
        self.mode = mode
        self.deadline_s = deadline_s
        self.check_nvlink = check_nvlink
        self.links: Any = LinkMemory()  # links seen up in this boot (the agent hands its state file instead)
        self.expected_nvlinks: int | None = None  # every GPU's links up (expectedNvlinks)
        self.nvlink_profiles: tuple[tuple[str, int], ...] = ()  # per model (nvlinkProfiles)
        self._far_ends: dict[str, dict[int, bool]] = {}  # per GPU: each link asked, whether NVML named its far end
        # The NVSwitches on the node's PCI bus (fabric_manager.NvswitchScanner.scan, bounded); None: not looked at.
        self.nvswitches: Callable[[], Sequence[str]] | None = None
        self._switches = 0  # this cycle's count (0 when not looked at or not readable: no expectation from it)
        self.read_load, self.read_clocks, self.read_uuids = pcie_load, clock_events, uuids
        self.read_fabric = False
        self.snapshot: NvmlSnapshot | None = None  # the last probe()'s readings
        self._nvml = nvml
        self._calls = BoundedCalls("NVML", deadline_s, max_blocked=1)  # one stuck call: no further call starts
        self._initialized = False
        self._lock = threading.Lock()
        self.paused = False  # a GPU reset runs: NVML is shut down until it ends (agent/probes/nvml_pause.py)

    def _lib(self) -> Any:
        if self._nvml is None:
            import pynvml  # nvidia-ml-py

            self._nvml = pynvml
        return self._nvml

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._calls.call(fn, *args)

    check = Check.NVML

    def read(self, context: ProbeContext) -> ProbeResult:
        """The NVML checks. NVML off or absent (mode auto) is not a failure: `ran` stays True with no GPUs and no
        count. The payload is the snapshot (per-GPU readings for the degradation probes and the allocation map),
        None when NVML was not read (off, absent, failed or hung)."""
        findings, snap = self.sample()
        gpus = tuple(
            GpuIdentity(g.address, g.index, g.name, g.mig_enabled, g.mig_devices)
            for g in (snap.gpus if snap is not None else ())
            if g.address is not None
        )
        return ProbeResult.of(Check.NVML, findings, gpus=gpus, count=len(snap.gpus) if snap else None, payload=snap)

    def sample(self) -> tuple[list[Finding], NvmlSnapshot | None]:
        if self.mode == "off":
            return [], None
        if self.paused:
            return [Finding.info(Check.NVML, "NVML paused while a GPU reset runs", kind="paused")], None
        with self._lock:
            try:
                findings, self.snapshot = self._probe()
            except NvmlTimeout as e:
                self.snapshot = None
                return [Finding.fault(Check.NVML, Reason.NVML_HEALTH, f"NVML hung: {e}", kind="timeout")], None
            return findings, self.snapshot

    def _probe(self) -> tuple[list[Finding], NvmlSnapshot | None]:
        nv = self._lib()
        if not self._initialized:
            try:
                self._call(nv.nvmlInit)
                self._initialized = True
            except nv.NVMLError as e:
                if self.mode == "auto" and getattr(e, "value", None) in (
                    getattr(nv, "NVML_ERROR_LIBRARY_NOT_FOUND", 12),
                    getattr(nv, "NVML_ERROR_DRIVER_NOT_LOADED", 9),
                ):
                    return [Finding.info(Check.NVML, f"NVML not used: {e}", kind="skipped")], None
                return [Finding.unchecked(Check.NVML, f"NVML init failed: {e}", kind="init_failed")], None
        snap = NvmlSnapshot()
        findings: list[Finding] = []
        try:
            snap.driver_version = _text(self._call(nv.nvmlSystemGetDriverVersion))
            count = self._call(nv.nvmlDeviceGetCount)
        except nv.NVMLError as e:
            return [Finding.unchecked(Check.NVML, f"NVML cannot enumerate GPUs: {e}", kind="enumerate")], None
        self._switches = self._nvswitch_count() if self.check_nvlink else 0
        for i in range(count):
            findings += self._probe_gpu(nv, i, snap)
        return findings, snap

    def _probe_gpu(self, nv: Any, i: int, snap: NvmlSnapshot) -> list[Finding]:
        out: list[Finding] = []
        try:
            h = self._call(nv.nvmlDeviceGetHandleByIndex, i)
        except nv.NVMLError as e:
            code = getattr(e, "value", None)
            what = HANDLE_FAULT_CODES.get(code or -1, str(e))
            out.append(
                Finding.fault(
                    Check.NVML, Reason.NVML_HEALTH, f"GPU index {i}: NVML handle error: {what}", kind="handle"
                )
            )
            snap.gpus.append(NvmlGpu(i, None))
            return out
        addr = None
        gpu = NvmlGpu(i, None)
        try:
            pci = self._call(nv.nvmlDeviceGetPciInfo, h)
            addr = PciAddress.parse(_text(pci.busId))
            gpu.address = addr
            gpu.name = _text(self._call(nv.nvmlDeviceGetName, h))
        except nv.NVMLError as e:
            code = getattr(e, "value", None)
            if code in HANDLE_FAULT_CODES:
                out.append(
                    Finding.fault(
                        Check.NVML, Reason.NVML_HEALTH, f"GPU index {i}: {HANDLE_FAULT_CODES[code]}", kind="handle"
                    )
                )
                snap.gpus.append(gpu)
                return out
        snap.gpus.append(gpu)
        # GPU recovery action (a level signal that survives missed Xids).
        try:
            vals = self._call(nv.nvmlDeviceGetFieldValues, h, [FI_DEV_GET_GPU_RECOVERY_ACTION])
            v = vals[0]
            if getattr(v, "nvmlReturn", 0) == 0:
                action = int(getattr(v.value, "uiVal", v.value) if hasattr(v, "value") else 0)
                if action != 0:
                    out.append(
                        Finding.fault(
                            Check.NVML,
                            Reason.NVML_HEALTH,
                            f"GPU recovery action: {RECOVERY_ACTIONS.get(action, action)}",
                            addr,
                            kind="recovery_action",
                        )
                    )
        except nv.NVMLError as e:
            out += _lost_or_skip(nv, e, addr, "recovery action")
        # Row remapping (Ampere+; NOT_SUPPORTED with MIG or on older GPUs).
        try:
            _corr, _unc, pending, failure = self._call(nv.nvmlDeviceGetRemappedRows, h)
            if failure:
                out.append(
                    Finding.fault(
                        Check.NVML, Reason.NVML_HEALTH, "row remapping failed", addr, kind="row_remap_failure"
                    )
                )
            elif pending:
                out.append(
                    Finding.info(
                        Check.NVML,
                        "row remap pending (activates at the next GPU reset)",
                        addr,
                        kind="row_remap_pending",
                    )
                )
        except nv.NVMLError as e:
            out += _lost_or_skip(nv, e, addr, "remapped rows")
        # MIG layout (for the device-plugin accounting).
        try:
            current, _pending = self._call(nv.nvmlDeviceGetMigMode, h)
            gpu.mig_enabled = current == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
            if gpu.mig_enabled:
                for k in range(self._call(nv.nvmlDeviceGetMaxMigDeviceCount, h)):
                    try:
                        mh = self._call(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, k)
                        gpu.mig_devices += 1
                    except nv.NVMLError:
                        continue
                    if self.read_uuids:
                        try:
                            gpu.mig_uuids.append((k, _text(self._call(nv.nvmlDeviceGetUUID, mh))))
                        except nv.NVMLError:
                            pass  # that MIG device's IDs stay unmapped in the allocation map
        except nv.NVMLError:
            pass
        if self.check_nvlink:
            out += self._nvlink(nv, h, gpu, addr)
        self._degradation_readings(nv, h, gpu)
        return out

    def _degradation_readings(self, nv: Any, h: Any, gpu: NvmlGpu) -> None:
        """Readings the degradation probes judge; each helper turns NVML errors into missing values."""
        if self.read_load:
            gpu.load = self._call(nvml_pcie_load, nv, h)
        if self.read_clocks:
            gpu.clock = self._call(nvml_clock_sample, nv, h)
        get_uuid = getattr(nv, "nvmlDeviceGetUUID", None)
        if self.read_uuids and get_uuid is not None:
            try:
                gpu.uuid = _text(self._call(get_uuid, h))
            except nv.NVMLError:
                gpu.uuid = None
        if self.read_fabric and gpu.address is not None:
            try:
                gpu.fabric = self._call(nvml_fabric, nv, h, gpu.address)
            except nv.NVMLError as e:
                gpu.fabric_error = str(e)[:200]

    def _nvlink(self, nv: Any, h: Any, gpu: NvmlGpu, addr: PciAddress | None) -> list[Finding]:
        states: list[bool] = []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                state = self._call(nv.nvmlDeviceGetNvLinkState, h, link)
            except nv.NVMLError:
                break  # NOT_SUPPORTED on link 0: no NVLink; on link k: end of links
            states.append(state == getattr(nv, "NVML_FEATURE_ENABLED", 1))
        gpu.nvlink_links = len(states)
        gpu.nvlink_up = [i for i, u in enumerate(states) if u]
        if not states:
            return []
        key = addr.nvml if addr is not None else f"index {gpu.index}"
        seen = self.links.nvlinks_seen_up(key)
        if gpu.nvlink_up and not set(gpu.nvlink_up) <= seen:
            self.links.note_nvlinks_up(key, gpu.nvlink_up)
        # A link's far end is asked once per GPU while the agent runs: a bridge or a switch is not fitted at run time.
        asked = self._far_ends.setdefault(key, {})
        new = [i for i, u in enumerate(states) if not u and i not in seen and i not in asked]
        if new:
            found = self._remote_ends(nv, h, new)
            asked.update({i: i in found for i in new})
        remote = {i for i, wired in asked.items() if wired}
        expected, why = expected_links(
            gpu.name, self.expected_nvlinks, self.nvlink_profiles, len(states), self._switches
        )
        v = nvlink_verdict(states, seen, remote, expected, gpu.mig_enabled, why)
        gpu.nvlink_fitted = v.fitted
        gpu.nvlink_down = list(v.down) if v.judged else []
        return nvlink_findings(v, len(states), addr)

    def _nvswitch_count(self) -> int:
        """NVSwitches on PCI; 0 when not looked at or the listing cannot be read (the fabric-manager probe reports
        that as could not check): no NVLink expectation is drawn from it."""
        if self.nvswitches is None:
            return 0
        try:
            return len(self.nvswitches())
        except OSError:
            return 0

    def _remote_ends(self, nv: Any, h: Any, links: list[int]) -> set[int]:
        """The links among `links` whose far end NVML names as a GPU or an NVSwitch (a link that is wired)."""
        get = getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        out: set[int] = set()
        if get is None:
            return out
        for link in links:
            try:
                kind = self._call(get, h, link)
            except nv.NVMLError:
                continue  # a disabled link without a far end answers an error: nothing known
            if int(kind) in NVLINK_REMOTE_TYPES:
                out.add(link)
        return out


def nvlink_json(snap: NvmlSnapshot) -> list[dict[str, Any]]:
    """Each GPU's NVLinks as read (`check --json` `multinode.nvlink`): those NVML answers, up, judged down, and
    whether NVLink is fitted (false: every link disabled and nothing says one should be up)."""
    return [
        {
            "pci_bus_id": g.address.nvml if g.address is not None else None,
            "links": g.nvlink_links,
            "up": list(g.nvlink_up),
            "down": list(g.nvlink_down),
            "fitted": g.nvlink_fitted,
            "judged": not g.mig_enabled,
        }
        for g in snap.gpus
        if g.nvlink_links
    ]


def _lost_or_skip(nv: Any, e: Exception, addr: PciAddress | None, what: str) -> list[Finding]:
    code = getattr(e, "value", None)
    if code in HANDLE_FAULT_CODES:
        return [
            Finding.fault(Check.NVML, Reason.NVML_HEALTH, f"{what}: {HANDLE_FAULT_CODES[code]}", addr, kind="handle")
        ]
    return []  # NOT_SUPPORTED and friends: the feature is absent, not a fault


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class NvmlSettings:
    """Settings of the NVML probe."""

    nvml: str = setting(choice("auto", "on", "off"), "auto", "NVML checks: auto = when libnvidia-ml loads")
    nvml_timeout: float = setting(positive(to_float, 3600), 10.0, "deadline for one NVML call, seconds")
    nvml_nvlink: bool = setting(to_bool, True, "report NVLink links down (NVML)")
    expected_nvlinks: int | None = setting(
        optional(in_range(to_int, 0, MAX_NVLINKS)),
        None,
        "NVLinks every GPU of this node must have up (unset: only links seen up or connected are judged)",
    )
    nvlink_profiles: tuple[tuple[str, int], ...] | None = setting(
        optional(nvlink_profiles),
        None,
        "NVLinks up per GPU model, '<model glob>=<links>' comma list (overrides expectedNvlinks for that model)",
    )
