"""The CUDA gate: a small kernel compiles (NVRTC) and computes the right result on every GPU (cupy). The
binding is loaded inside the gate's own process (agent.proc forks before CUDA is touched)."""

from __future__ import annotations

from typing import Any

from agent.preflight.result import FAIL, PASS, SKIP, GateResult


def load_cuda() -> Any:
    """The optional CUDA binding (cupy); None when it is not installed or no GPU is usable."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:
        return None


def cuda_kernel_check(cp: Any) -> GateResult:
    """Compiles (NVRTC) and runs a small kernel on every GPU and checks the result."""
    src = r"""extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
        int i = blockDim.x * blockIdx.x + threadIdx.x; if (i < n) y[i] = a * x[i] + b; }"""
    n, per_gpu = 1 << 20, {}
    for dev in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(dev):
            k = cp.RawKernel(src, "axpb")
            x = cp.arange(n, dtype=cp.float32)
            y = cp.empty_like(x)
            k(((n + 255) // 256,), (256,), (x, y, cp.float32(2.0), cp.float32(1.0), cp.int32(n)))
            ok = bool(cp.allclose(y, 2.0 * x + 1.0))
            per_gpu[dev] = ok
    bad = [d for d, ok in per_gpu.items() if not ok]
    if bad:
        return GateResult("cuda", FAIL, f"wrong kernel result on GPUs {bad}", {"per_gpu": per_gpu})
    return GateResult("cuda", PASS, f"kernel compiled and correct on {len(per_gpu)} GPUs", {"per_gpu": per_gpu})


def cuda_gate(cuda: Any) -> GateResult:
    if cuda is None:
        return GateResult("cuda", SKIP, "no CUDA binding (pip install gpu-ready[cuda])")
    return cuda_kernel_check(cuda)
