"""A stand-in for the NVML library (no real NVML exists on the CI machines)."""

from __future__ import annotations

import ctypes
import threading
import types

from pynvml import c_nvmlGpuFabricInfo_v3_t, c_nvmlGpuFabricInfoV_t

# The releases of simulated hung calls: a hung call blocks, as a stuck driver call does, until its release is set.
# tests/conftest.py sets every one after each test, so no worker thread outlives its test.
HUNG: list[threading.Event] = []


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(gpus, init_error=None, hang=None):
    """gpus: list of dicts with busId, name, mig (MIG mode on), handle_error, recovery, remap=(c,u,pending,failure),
    links=[states], remote={link: far-end device type};
    throttle (clock event reasons mask), throttle_error (NVML error code), margin (C), util (%),
    pcie_gen / pcie_gen_cur, pcie_width / pcie_width_cur."""
    m = types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        NVML_ERROR_LIBRARY_NOT_FOUND=12,
        NVML_ERROR_DRIVER_NOT_LOADED=9,
        NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_MAX_LINKS=18,
        NVML_DEVICE_MIG_ENABLE=1,
        NVML_ERROR_NOT_SUPPORTED=3,
        NVML_ERROR_INSUFFICIENT_RESOURCES=23,
        c_nvmlGpuFabricInfoV_t=c_nvmlGpuFabricInfoV_t,  # the library's own structures, filled as the driver fills them
        c_nvmlGpuFabricInfo_v3_t=c_nvmlGpuFabricInfo_v3_t,
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH=25,
        byref=ctypes.byref,
    )

    release = threading.Event()
    if hang is not None:
        HUNG.append(release)

    def call(name, fn):
        def wrapped(*a):
            if hang == name:
                release.wait()  # hung until the test is over
            return fn(*a)

        wrapped.__name__ = name
        setattr(m, name, wrapped)

    def init():
        if init_error:
            raise FakeNVMLError(init_error)

    call("nvmlInit", init)
    call("nvmlSystemGetDriverVersion", lambda: b"590.48.01")
    call("nvmlDeviceGetCount", lambda: len(gpus))

    def handle(i):
        if gpus[i].get("handle_error"):
            raise FakeNVMLError(gpus[i]["handle_error"])
        return i

    call("nvmlDeviceGetHandleByIndex", handle)
    call("nvmlDeviceGetPciInfo", lambda h: types.SimpleNamespace(busId=gpus[h]["busId"].encode()))
    call("nvmlDeviceGetName", lambda h: gpus[h].get("name", "NVIDIA H100").encode())
    call(
        "nvmlDeviceGetFieldValues",
        lambda h, ids: [
            types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=gpus[h].get("recovery", 0)))
        ],
    )

    def remap(h):
        if "remap" not in gpus[h]:
            raise FakeNVMLError(3)
        return gpus[h]["remap"]

    call("nvmlDeviceGetRemappedRows", remap)
    call("nvmlDeviceGetMigMode", lambda h: (1, 1) if gpus[h].get("mig") else (0, 0))
    call("nvmlDeviceGetMaxMigDeviceCount", lambda h: 0)

    def link(h, i):
        links = gpus[h].get("links", [])
        if i >= len(links):
            raise FakeNVMLError(3)
        return links[i]

    call("nvmlDeviceGetNvLinkState", link)

    def remote_type(h, i):
        """remote: {link: nvmlNvLinkDeviceType} for the links whose far end the driver names; others answer an
        error, as a disabled link without a far end does."""
        kinds = gpus[h].get("remote", {})
        if i not in kinds:
            raise FakeNVMLError(3)
        return kinds[i]

    call("nvmlDeviceGetNvLinkRemoteDeviceType", remote_type)
    # burn-in monitor: counters read from the dicts, so a test can change them between reads
    call(
        "nvmlDeviceGetTotalEccErrors", lambda h, etype, counter: gpus[h].get("ecc_unc" if etype == 1 else "ecc_cor", 0)
    )
    call("nvmlDeviceGetRetiredPages", lambda h, cause: list(range(gpus[h].get("retired", 0))) if cause == 1 else [])

    def clock_reasons(h):
        if gpus[h].get("throttle_error"):
            raise FakeNVMLError(gpus[h]["throttle_error"])
        return gpus[h].get("throttle", 0)

    call("nvmlDeviceGetCurrentClocksEventReasons", clock_reasons)

    def optional(key, wrap=lambda v: v):
        """A call answering gpus[h][key], NOT_SUPPORTED (3) when the key is absent."""

        def get(h, *a):
            if key not in gpus[h]:
                raise FakeNVMLError(3)
            return wrap(gpus[h][key])

        return get

    # degradation signals: thermal margin (C), utilisation (%), current PCIe generation/width
    call("nvmlDeviceGetMarginTemperature", optional("margin"))
    call("nvmlDeviceGetUtilizationRates", optional("util", lambda u: types.SimpleNamespace(gpu=u, memory=0)))
    call("nvmlDeviceGetCurrPcieLinkGeneration", lambda h: gpus[h].get("pcie_gen_cur", gpus[h].get("pcie_gen", 5)))
    call("nvmlDeviceGetCurrPcieLinkWidth", lambda h: gpus[h].get("pcie_width_cur", gpus[h].get("pcie_width", 16)))

    def fabric(h, ref):
        """fabric: {state, status, clique, cluster (16 bytes), health (mask), summary (v3 health summary), v2_only (a
        driver that predates the v3 structure: it answers a version mismatch)}; absent: NOT_SUPPORTED; fabric_error:
        an NVML error code."""
        if gpus[h].get("fabric_error"):
            raise FakeNVMLError(gpus[h]["fabric_error"])
        if "fabric" not in gpus[h]:
            raise FakeNVMLError(3)
        f, info = gpus[h]["fabric"], ref._obj
        if hasattr(info, "healthSummary"):
            if f.get("v2_only"):
                raise FakeNVMLError(25)
            info.healthSummary = f.get("summary", 0)
        info.state, info.status, info.cliqueId = f.get("state", 3), f.get("status", 0), f.get("clique", 0)
        info.healthMask = f.get("health", 0)
        ctypes.memmove(info.clusterUuid, bytes(f.get("cluster", bytes(16)))[:16].ljust(16, b"\0"), 16)

    call("nvmlDeviceGetGpuFabricInfoV", fabric)
    call("nvmlShutdown", lambda: None)
    # spec reading
    call("nvmlSystemGetCudaDriverVersion_v2", lambda: 12040)
    call("nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(total=gpus[h].get("mem_mib", 81559) * 2**20))
    call("nvmlDeviceGetEccMode", lambda h: (gpus[h].get("ecc_mode", 1), 1))
    call("nvmlDeviceGetMaxPcieLinkGeneration", lambda h: gpus[h].get("pcie_gen", 5))
    call("nvmlDeviceGetMaxPcieLinkWidth", lambda h: gpus[h].get("pcie_width", 16))
    return m
