"""The NVLink gate: peer-to-peer copy bandwidth between every GPU pair (cupy memcpyPeer timing). NVLink link
counts are checked by the spec gate without a CUDA binding."""

from __future__ import annotations

import time
from typing import Any

from agent.preflight.result import FAIL, PASS, SKIP, GateResult


def cuda_p2p(cp: Any, min_gbps: float | None) -> GateResult:
    """Peer-to-peer copy bandwidth between every GPU pair."""
    n = cp.cuda.runtime.getDeviceCount()
    nbytes, pairs, low = 256 << 20, {}, []
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            if not cp.cuda.runtime.deviceCanAccessPeer(dst, src):
                low.append(f"{src}->{dst}: no peer access")
                continue
            with cp.cuda.Device(src):
                a = cp.empty(nbytes, dtype=cp.uint8)
            with cp.cuda.Device(dst):
                b = cp.empty(nbytes, dtype=cp.uint8)
                cp.cuda.runtime.memcpyPeer(b.data.ptr, dst, a.data.ptr, src, nbytes)
                cp.cuda.Device(dst).synchronize()
                t0 = time.monotonic()
                for _ in range(5):
                    cp.cuda.runtime.memcpyPeer(b.data.ptr, dst, a.data.ptr, src, nbytes)
                cp.cuda.Device(dst).synchronize()
                gbps = 5 * nbytes / (time.monotonic() - t0) / 1e9
            pairs[f"{src}->{dst}"] = round(gbps, 1)
            if min_gbps is not None and gbps < min_gbps:
                low.append(f"{src}->{dst}: {gbps:.1f} GB/s < {min_gbps:g}")
    if low:
        return GateResult("nvlink", FAIL, "; ".join(low)[:900], {"gbps": pairs})
    return GateResult(
        "nvlink", PASS, f"{len(pairs)} pairs, min {min(pairs.values(), default=0):.1f} GB/s", {"gbps": pairs}
    )


def nvlink_gate(cuda: Any, min_gbps: float | None) -> GateResult:
    if cuda is None:
        return GateResult(
            "nvlink",
            SKIP,
            "no CUDA binding for the P2P bandwidth test (NVLink link counts are checked by the spec gate)",
        )
    return cuda_p2p(cuda, min_gbps)
